// Package push is kvhost's SGLang-compatible push runtime: the part of a
// disaggregated serving engine that moves a request's KV cache from the
// prefill worker that computed it to the decode workers that continue it,
// the way SGLang's NIXL and MORI connectors do, byte-compatible with their
// control messages so a kvhost worker pairs with an SGLang one.
//
// # Roles
//
// A prefill rank runs a Prefill manager. It registers its KV, aux and state
// buffers with a transfer plugin, listens on a ZeroMQ PULL socket, registers
// itself with the bootstrap server, and makes one Sender per request
// ("room"):
//
//	s, _ := pf.NewSender(room)           // KVPoll Bootstrapping
//	... s.Poll() == WaitingForInput      // decode sent where the pages go
//	s.Init(numPages, auxIndex)
//	s.Send(pages[0:8], nil)              // chunks, in order
//	s.Send(pages[8:12], stateIndices)    // the last chunk carries aux and state
//	st := s.Wait(ctx)                    // Success or Failed (s.Failure())
//	s.Close()
//
// A decode rank runs a Decode manager and makes one Receiver per request:
//
//	r, _ := dec.NewReceiver(bootstrapAddr, room)
//	r.Init(ctx)                          // rank mapping, registration: WaitingForInput
//	r.SendMetadata(ctx, pages, auxIndex, stateIndices, prefixLen)
//	st := r.Wait(ctx)                    // Success when every byte landed
//	r.Close()
//
// # Semantics (the reference's, see ../shared/reference)
//
// Room status is KVPoll (package rooms): monotonic, Failed terminal.
// Chunks go to transfer worker shards by room (room % QueueSize), so a
// room's chunks are processed in order. Each chunk is planned with package
// planner, checked against the region tables of both sides (Plan.Validate:
// every byte read lies in this worker's registered memory, every byte
// written in memory the peer registered) and posted as one plugin transfer
// (one per memory-kind segment on mixed VRAM/DRAM pools). Aux and state go
// with the last chunk.
//
// Completion reaches decode either as transfer-attached notifications with
// SGLang NIXL's tags ("{room}_kv_{chunk}_{last}_{rank}", "_part_{i}_{n}",
// "{room}_aux", "{room}_aux_nokv_{rank}", "{room}_state_{rank}_{i}"), tracked
// as the reference's TransferStatus does, or as MORI-style status messages
// [guard, room, status, prefill_unique_rank, reason] (plugins without
// notifications, and the MORI variant). Failures always travel as status
// messages with their reason, whatever the completion mode; decode tells
// prefill with an ABORT message.
//
// Timeouts: bootstrap (prefill, Bootstrapping), waiting (decode, after the
// metadata went out), an optional per-chunk transfer SLA, and decode's
// heartbeat to the bootstrap server (a dead prefill fails its rooms).
// Every plugin handle of a finished or failed transfer is released.
//
// Observability: an Observer sees every transfer (bytes, descriptors, post
// and transfer time), failure, room state change and handshake.
package push
