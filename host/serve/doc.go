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
// goroutines and report through events. Replies and events share the
// connection's queue (Config.EventQueue messages, DefaultEventQueue by
// default), so one connection's events are never reordered; an engine
// that leaves the queue full, or does not take a message within the send
// timeout, is dropped and its session torn down. Other connections are
// not affected.
//
// # Files
//
// The core (server.go, session.go, ops.go, proto.go, memory*.go) is style
// free. A style adds its open_rank hook with registerStyle and its ops
// with registerOp from an init function in its own files: sglang.go for
// SGLang's push rooms, vllm*.go for vLLM's pull requests.
package serve
