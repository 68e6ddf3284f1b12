// Package serve is the control server of `kvhost serve`, the sidecar a
// serving engine (SGLang, vLLM) runs beside itself: the engine shares its
// KV memory with the sidecar and drives transfers over the API of
// docs/engine-api.md (ZeroMQ ROUTER on an ipc:// socket, one msgpack map
// per frame); the sidecar moves the bytes with host/push (SGLang) and
// host/pull (vLLM), so its peers see exactly the wire of SGLang's and
// vLLM's own connectors.
//
// # Sessions
//
// Each engine connection (a ROUTER peer) is one session, created by its
// first message and torn down when the connection closes: its rooms fail
// with "engine disconnected" (peers told), its ranks' agents are
// destroyed and its memory mappings released. Nothing of one session is
// visible to another: ids of another connection's ranks, rooms and
// regions answer `unknown`.
//
// A session's requests run one at a time, in arrival order, on the
// session's goroutine; every request gets exactly one reply. No handler
// blocks on a peer: bootstrap, receiver init and transfers run on
// goroutines and report through events: an SGLang prefill rank's
// open_rank, which registers with its bootstrap server, is finished on a
// goroutine (deferredOpen, within Config.OpenTimeout) and answered from
// the session's goroutine when done, after the replies of requests that
// came later.
//
// Everything one connection can make the sidecar hold is bounded: the
// requests waiting for its session (Config.RequestQueue of them, and 2
// MaxMessage bytes; 8 MaxMessage bytes over all connections), its ranks,
// regions and rooms (Config.Limits), and the replies and events waiting
// to be written to it (Config.EventQueue messages, EventQueueBytes
// bytes). Replies and events share that one queue, so one connection's
// events are never reordered; its bounds hold the largest burst of events
// the limits allow (eventBurst), so only an engine that does not read
// fills it: one past either bound, or that does not take a message within
// the send timeout, is dropped and its session torn down. Replies do not
// grow with requests: error messages and failure reasons are clipped
// (errors.go). A message over MaxMessage is read and discarded
// (zmq.WithDiscardOversize) and answered too_large. Other connections are
// not affected by any of this.
//
// # Files
//
// The core (server.go, session.go, ops.go, proto.go, memory*.go) is style
// free; bootserver.go is the bootstrap server of start_bootstrap. A style adds its open_rank hook with registerStyle and its ops
// with registerOp from an init function in its own files: sglang.go for
// SGLang's push rooms, vllm*.go for vLLM's pull requests.
package serve
