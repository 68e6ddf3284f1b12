// Package bench is kvhost's transfer benchmark: a nixlbench-style sweep of
// one plugin over block sizes, batch sizes (descriptors per transfer),
// operations (READ, WRITE), transfer paths (prepped lists, batch entries),
// threads (goroutines posting at once) and process layouts (both agents in
// this process, or the target agent in a second process), with the raw copy
// rate of this machine measured in the same run beside every row.
//
// # What one iteration measures
//
// One iteration is the whole per-request cost a KV transfer host pays, as in
// plugins/nixl/bench_direct.cc (the direct-NIXL baseline), so that the two
// tables compare column for column:
//
//   - prep: the submit call, which makes and posts the transfer (prepped
//     path: Agent.SubmitPrepped over lists prepared once per row, outside
//     the timing; batch path: Agent.SubmitBatch from region-relative
//     entries against a remote region imported once): one plugin call on a
//     plugin with CapSubmit, make and post otherwise;
//   - post: 0, as posting is part of the submit call (prep);
//   - transfer (tx): from before the submit until the poll that releases
//     the transfer reports completion (Xfer.PollRelease polled back to
//     back, as nixlbench polls; with --wait, the agent's completion engine
//     finishes it, as the runtimes do);
//   - latency: the same as tx: the final poll released the transfer (one
//     plugin call to finish on a plugin with CapSubmit; poll, telemetry
//     and release otherwise);
//   - CPU/op: the posting thread's CPU time per iteration (as bench_direct's
//     CPU/op; a plugin's own threads are not in it).
//
// Descriptors are contiguous blocks: descriptor i of thread t covers
// [(t*batch+i)*block, +block) on both sides.
//
// # Baselines and efficiency
//
// Each row is measured in rounds. In a round every thread alternates one
// transfer with one run of each baseline copier over its own blocks (the
// order rotating), until the round's share of the row's time and
// iterations is done; so a load change on a shared machine hits the subject
// and the baseline alike. A rate is the bytes over the time spent in that
// kind of iteration, summed over threads. The baseline is the raw copy a
// program would do without kvhost:
//
//   - same process: memcpy. Both Go's copy and libc's memcpy (through purego,
//     what the fake plugin calls) run every round and the faster one counts,
//     so the baseline is this machine's best plain copy.
//   - two processes: process_vm_writev (WRITE) or process_vm_readv (READ)
//     from this process into the target process, up to IOV_MAX blocks per
//     system call, as the fake plugin issues them.
//
// A row's GB/s and its baseline's are medians over rounds of those rates
// (nixlbench's bandwidth: bytes over time, hiccups included). Its
// efficiency is the median, over every iteration, of the paired ratio:
// the best baseline copy's time in that iteration over the transfer's
// latency. The two sides of a pair run microseconds apart, so a hiccup
// that hits one side of one pair (a preemption on a shared machine) moves
// the median not at all; that makes the efficiency steadier than the ratio
// of the two rates, which it need not equal.
//
// # Verification
//
// After the rounds of a row, the destination is cleared, every thread runs
// one more transfer, and the destination is checked against the pattern the
// source was filled with. In two-process runs the target process checks its
// own memory, so the bytes are proven to have crossed the process boundary.
//
// # Two processes
//
// The target process is started by Config.TargetCommand (kvhost re-executes
// itself with a hidden flag; tests re-execute the test binary) and serves
// ServeTargetStdio: it is the peer process of host/internal/peerproc (the
// same as the conformance suite's helper), one JSON request per line on its
// stdin, one response per line on its stdout. It owns the target agent and
// its memory.
package bench
