package nixltest

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

// TestOverheadVsDirect measures what the host (host/plugin over purego) and
// the nixl shim add to NIXL: for each row it runs the same transfers three
// ways, with bin/nixl-bench-direct calling NIXL's C++ API directly, with
// bin/nixl-bench-direct --plugin calling the shim's ABI table from C++ (the
// shim's own cost), and from Go through host/plugin (the shim plus the
// host), all with two agents in one process and the same NIXL settings,
// interleaved and repeated. It reports the median bandwidth of
// each and their ratios, and the median CPU time the initiating thread
// spends per request (user + system; with cma the copy itself runs in that
// thread) and its ratios: on a shared machine wall time swings with the
// other processes, CPU time per request much less, so the CPU ratio is the
// steadier measure of what the plugin path adds. One iteration is the whole per-request cost
// in both: build the request (makeXferReq over dlists prepared once, or
// createXferReq), post, poll to completion, release.
//
// It is a measurement, not a CI check (the machine is shared and noisy), so
// it runs only with KVHOST_NIXL_OVERHEAD=1:
//
//	KVHOST_NIXL_OVERHEAD=1 go test ./plugins/nixl/nixltest -run Overhead -v -count=1
//
// Optional: KVHOST_NIXL_OVERHEAD_BLOCKS (default 64K,256K,1M,4M,16M),
// _BATCHES (1,16), _SECONDS per measurement (0.3), _REPEAT (5).
func TestOverheadVsDirect(t *testing.T) {
	if os.Getenv("KVHOST_NIXL_OVERHEAD") != "1" {
		t.Skip("a measurement: set KVHOST_NIXL_OVERHEAD=1 to run it")
	}
	p := load(t)
	direct := findDirect(t)
	blocks := envList(t, "KVHOST_NIXL_OVERHEAD_BLOCKS", "64K,256K,1M,4M,16M")
	batches := envList(t, "KVHOST_NIXL_OVERHEAD_BATCHES", "1,16")
	seconds := envFloat(t, "KVHOST_NIXL_OVERHEAD_SECONDS", 0.3)
	repeat := int(envFloat(t, "KVHOST_NIXL_OVERHEAD_REPEAT", 5))

	// The plugin's defaults, spelled out so that the direct run uses the
	// same: progress thread on, 1 ms wake-up, sync mode rw, UCX's worker
	// lock a mutex (the shim adds USE_MT_MUTEX=y to engine_config).
	params := []plugin.Param{{Key: "progress_thread", Value: "true"}, {Key: "progress_delay_us", Value: "1000"}, {Key: "sync_mode", Value: "rw"},
		{Key: "engine_config", Value: "USE_MT_MUTEX=y"}}
	directFlags := []string{"--procs", "1", "--progress-thread", "--progress-delay-us", "1000", "--sync", "rw", "--param", "engine_config=USE_MT_MUTEX=y"}

	var size uint64
	for _, b := range blocks {
		for _, n := range batches {
			size = max(size, b*n)
		}
	}
	init := newSide(t, p, uniqueName(t, "init"), int(size), params...)
	target := newSide(t, p, uniqueName(t, "target"), int(size), params...)
	peer := connect(t, init, target)
	rr, err := init.a.ImportRange(peer, addr(target.buf), size, 0, abi.DRAM)
	if err != nil {
		t.Fatalf("import range: %v", err)
	}

	type row struct {
		op, path     string
		block, batch uint64
		// per run: GB/s, µs per iteration, CPU µs per iteration; [0]
		// direct, [1] C++ shim, [2] Go host
		gbps, lat, cpu [3][]float64
	}
	var rows []row
	var loads []float64
	for _, op := range []string{"WRITE", "READ"} {
		for _, path := range []string{"prepped", "batch"} {
			for _, b := range blocks {
				for _, n := range batches {
					r := row{op: op, path: path, block: b, batch: n}
					record := func(i int, gbps, lat, cpu float64) {
						r.gbps[i] = append(r.gbps[i], gbps)
						r.lat[i] = append(r.lat[i], lat)
						r.cpu[i] = append(r.cpu[i], cpu)
					}
					for range repeat {
						loads = append(loads, loadAvg())
						g, l, c := runDirect(t, direct, directFlags, op, path, b, n, seconds)
						record(0, g, l, c)
						g, l, c = runDirect(t, direct, append(directFlags[:len(directFlags):len(directFlags)], "--plugin", p.Path()), op, path, b, n, seconds)
						record(1, g, l, c)
						g, l, c = runShim(t, init, target, peer, rr, op, path, b, n, seconds)
						record(2, g, l, c)
					}
					rows = append(rows, r)
				}
			}
		}
	}
	var out strings.Builder
	fmt.Fprintf(&out, "\nmedians of %d interleaved runs of %.2f s each; 1-minute load average during them: min %.1f, median %.1f, max %.1f\n",
		repeat, seconds, slices.Min(loads), median(loads), slices.Max(loads))
	fmt.Fprintf(&out, "GB/s, and CPU time of the initiating thread per request; ratios against direct\n")
	fmt.Fprintf(&out, "%-6s %-8s %9s %5s | %8s %8s %8s %6s %6s | %9s %9s %9s %6s %6s\n", "op", "path", "block", "batch",
		"direct", "C++shim", "Go host", "shim", "total", "direct", "C++shim", "Go host", "shim", "total")
	for _, r := range rows {
		g := [3]float64{median(r.gbps[0]), median(r.gbps[1]), median(r.gbps[2])}
		c := [3]float64{median(r.cpu[0]), median(r.cpu[1]), median(r.cpu[2])}
		fmt.Fprintf(&out, "%-6s %-8s %9d %5d | %8.3f %8.3f %8.3f %6.3f %6.3f | %7.1fus %7.1fus %7.1fus %6.3f %6.3f\n", r.op, r.path, r.block, r.batch,
			g[0], g[1], g[2], g[1]/g[0], g[2]/g[0], c[0], c[1], c[2], c[1]/c[0], c[2]/c[0])
	}
	t.Logf("two agents in one process, %s%s", runtime.GOOS, out.String())
}

// runShim times one row through the plugin and returns GB/s, µs per
// iteration and CPU µs per iteration of the calling thread; the last
// iteration's bytes are verified.
func runShim(t *testing.T, init, target *side, peer string, rr *plugin.RemoteRegion, op, path string, block, batch uint64, seconds float64) (float64, float64, float64) {
	t.Helper()
	runtime.LockOSThread() // so that the thread's CPU time is this loop's
	defer runtime.UnlockOSThread()
	xop := abi.Write
	src, dst := init.buf, target.buf
	if op == "READ" {
		xop = abi.Read
		src, dst = target.buf, init.buf
	}
	n := block * batch
	fill(src[:n], byte(block+batch))
	clear(dst[:n])

	var ld, rd *plugin.DList
	idx := make([]int32, batch)
	entries := make([]abi.BatchEntry, batch)
	ldescs := make([]abi.XferDesc, batch)
	rdescs := make([]abi.XferDesc, batch)
	for i := range batch {
		idx[i] = int32(i)
		entries[i] = abi.BatchEntry{Pair: 0, LocalOffset: i * block, RemoteOffset: i * block, Len: block, Count: 1}
		ldescs[i] = abi.XferDesc{Addr: addr(init.buf) + i*block, Len: block, Count: 1}
		rdescs[i] = abi.XferDesc{Addr: addr(target.buf) + i*block, Len: block, Count: 1}
	}
	pairs := []plugin.Pair{{Local: init.reg, Remote: rr}}
	if path == "prepped" {
		var err error
		if ld, err = init.a.PrepLocal(abi.DRAM, ldescs); err != nil {
			t.Fatalf("prep local: %v", err)
		}
		defer ld.Close()
		if rd, err = init.a.PrepRemote(peer, abi.DRAM, rdescs); err != nil {
			t.Fatalf("prep remote: %v", err)
		}
		defer rd.Close()
	}
	one := func() {
		var x *plugin.Xfer
		var err error
		if path == "prepped" {
			x, err = init.a.MakePreppedXfer(xop, ld, idx, rd, idx, nil)
		} else {
			x, err = init.a.MakeBatchXfer(xop, pairs, entries, nil)
		}
		if err != nil {
			t.Fatalf("make xfer: %v", err)
		}
		done, err := x.Post()
		for err == nil && !done {
			done, err = x.Poll()
		}
		if err != nil {
			t.Fatalf("transfer: %v", err)
		}
		if err := x.Close(); err != nil {
			t.Fatalf("release: %v", err)
		}
	}
	for range 2 {
		one()
	}
	start := time.Now()
	cpu0 := threadCPU(t)
	iters := 0
	for iters < 5 || time.Since(start).Seconds() < seconds {
		one()
		iters++
	}
	el := time.Since(start).Seconds()
	cpu := threadCPU(t) - cpu0
	if !bytes.Equal(src[:n], dst[:n]) {
		t.Fatalf("%s %s block %d batch %d: bytes differ", op, path, block, batch)
	}
	return float64(n) * float64(iters) / el / 1e9, el / float64(iters) * 1e6, cpu / float64(iters)
}

// threadCPU returns the CPU time (user + system) of the calling OS thread in
// microseconds (getrusage RUSAGE_THREAD), as bench_direct measures it.
func threadCPU(t *testing.T) float64 {
	const rusageThread = 1
	var ru syscall.Rusage
	if err := syscall.Getrusage(rusageThread, &ru); err != nil {
		t.Fatalf("getrusage: %v", err)
	}
	return float64(ru.Utime.Sec+ru.Stime.Sec)*1e6 + float64(ru.Utime.Usec+ru.Stime.Usec)
}

// runDirect runs one row of bin/nixl-bench-direct and returns its GB/s,
// average latency and CPU µs per request.
func runDirect(t *testing.T, bin string, flags []string, op, path string, block, batch uint64, seconds float64) (float64, float64, float64) {
	t.Helper()
	args := append(append([]string(nil), flags...), "--ops", op, "--paths", path,
		"--blocks", strconv.FormatUint(block, 10), "--batches", strconv.FormatUint(batch, 10),
		"--seconds", strconv.FormatFloat(seconds, 'f', -1, 64))
	cmd := exec.Command(bin, args...)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", bin, args, err, out)
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 13 && f[0] == strconv.FormatUint(block, 10) {
			if f[12] != "yes" {
				t.Fatalf("direct run did not verify its bytes: %s", sc.Text())
			}
			gbps, err1 := strconv.ParseFloat(f[2], 64)
			lat, err2 := strconv.ParseFloat(f[3], 64)
			cpu, err3 := strconv.ParseFloat(f[10], 64)
			if err1 != nil || err2 != nil || err3 != nil {
				t.Fatalf("unparsable direct row %q", sc.Text())
			}
			return gbps, lat, cpu
		}
	}
	t.Fatalf("no result row in the output of %s %v:\n%s", bin, args, out)
	return 0, 0, 0
}

// findDirect locates bin/nixl-bench-direct in the build tree.
func findDirect(t *testing.T) string {
	t.Helper()
	dir, _ := os.Getwd()
	for d := dir; ; d = filepath.Dir(d) {
		p := filepath.Join(d, "bin", "nixl-bench-direct")
		if _, err := os.Stat(p); err == nil {
			return p
		}
		if filepath.Dir(d) == d {
			t.Fatalf("bin/nixl-bench-direct not found above %s: make plugin-nixl NIXL_PREFIX=... builds it", dir)
		}
	}
}

func envList(t *testing.T, key, def string) []uint64 {
	t.Helper()
	s := os.Getenv(key)
	if s == "" {
		s = def
	}
	var out []uint64
	for _, f := range strings.Split(s, ",") {
		mult := uint64(1)
		switch {
		case strings.HasSuffix(f, "K"):
			mult, f = 1<<10, strings.TrimSuffix(f, "K")
		case strings.HasSuffix(f, "M"):
			mult, f = 1<<20, strings.TrimSuffix(f, "M")
		}
		v, err := strconv.ParseUint(f, 10, 64)
		if err != nil || v == 0 {
			t.Fatalf("%s: bad size %q", key, f)
		}
		out = append(out, v*mult)
	}
	return out
}

func envFloat(t *testing.T, key string, def float64) float64 {
	t.Helper()
	s := os.Getenv(key)
	if s == "" {
		return def
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || v <= 0 {
		t.Fatalf("%s: bad number %q", key, s)
	}
	return v
}
