// Package peerproc is the far side of kvhost's multi-process tests and
// benchmarks: an agent with registered memory that the near side moves
// bytes to and from, and the process that owns such agents when the far
// side must be another process.
//
// MemAgent is an agent of this process with buffers outside the Go heap
// (anonymous mappings), registered with the plugin, their blobs exported
// when the agent can. Proc is a peer process (a re-executed kvhost or test
// binary serving ServeStdio) that loads the plugin itself and makes
// RemoteAgents, which do what a MemAgent does, in that process: so bytes a
// test writes there are checked there (Verify, Sum), proving they crossed
// the process boundary. Both satisfy Peer, so a test or benchmark runs the
// same in either layout. host/conformance's helper process and host/bench's
// target process are this one implementation.
//
// The protocol: one JSON request per line on the peer process's stdin, one
// JSON response per line on its stdout, strictly in turn. The process
// writes anything else (a plugin's diagnostics) to stderr, which the near
// side keeps the tail of for its error messages. A request that gets no
// answer in time kills the process, so a hung peer fails a run instead of
// hanging it.
//
// Memory content is checked with one pattern (Fill, Verify): every 8-byte
// word depends on a seed and on its position, so a block landing at the
// wrong offset, a shifted copy or a stale byte all show.
package peerproc
