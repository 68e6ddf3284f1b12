// Package pull is kvhost's pull runtime: vLLM's NIXL connector model, in
// which the decode worker READs KV blocks out of the prefill worker's
// registered memory and then tells the prefill it may free them
// (vLLM 0.13's vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py).
//
// Both sides speak the wire generation of their engine
// (vllm.Generation, NIXL_CONNECTOR_VERSION 2 or 6; SenderConfig.Gen and
// ReceiverConfig.Gen). What follows describes version 2; version 6
// handshakes with (get_meta_msg, pp_rank, tp_rank) and a reply carrying
// the prefill's clock, advertises version 6's metadata, counts
// notifications "{request_id}:{decode TP size}" (decode_tp / prefill_tp
// of them per prefill rank) and holds for a lease (30 s) that the decode
// renews while a load is in flight with "HB:id,..." every lease // 6 (the
// prefill extends a held request to now + lease*2//3), instead of the abort
// timeout. A peer of another generation is refused naming both versions.
//
// Two types do the work, one per side:
//
//   - Sender (prefill). It registers each TP rank's KV cache on that rank's
//     agent, serves the handshake (a ZeroMQ ROUTER answering
//     [get_meta_msg, tp_rank] with the msgpack NixlHandshakePayload encoded
//     by host/wire/vllm; HandshakeServer, and FetchHandshake its REQ
//     client), and holds each finished request's blocks until every
//     decode rank that reads them has sent "{request_id}:{tp_ratio}", or
//     until the abort timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s by
//     default) expires. Either way it calls OnRelease once, saying which.
//     Notifications for unknown, expired or malformed requests are counted
//     and logged, never fatal. A request's notifications on a rank count
//     once per sending agent, and the rank is done when as many distinct
//     agents as a tp_ratio claimed it (at most MaxNotifiers); see
//     "Notifications" below.
//   - Receiver (one decode TP rank). Load takes a request's local block ids
//     and the kv_transfer_params the prefill returned. The first request
//     naming a remote engine starts a background handshake with it
//     (requests queue until it completes; a failed handshake fails only
//     them); the handshake validates the hash first, then the engine id and
//     the geometry (planner.NewVLLMReader), loads the peer's agent
//     metadata and prepares both descriptor lists once. Every request is
//     then ONE prepped READ carrying the notification, or, on a full prefix
//     hit, only the notification, submitted in one plugin call through
//     the agent's completion engine (plugin.Engine), which reports the
//     READ when it ends (Receiver.TransferDone) and releases it; a failed
//     read marks the request's blocks invalid (BlockIDsWithLoadErrors).
//     The Sender receives notifications from the engines of its ranks'
//     agents (subscriptions) and keeps one goroutine for expiries, asleep
//     while it holds nothing.
//
// What a peer can cost a decode is bounded. The declared geometry is
// checked against MaxDescriptors (per list; by default 16 times the rank's
// own regions × blocks, within [2^20, 2^26]) and MaxTotalDescriptors (all
// peers' remote lists together; by default 4 × MaxDescriptors) before a
// descriptor is built, at about 80 bytes each. HandshakeTimeout bounds the
// whole handshake (exchange, metadata load, list preparation): its requests
// fail when it runs out, and what it still builds is released. A peer no
// request used for PeerIdleTimeout (5 min by default) is released within
// 1.25 × PeerIdleTimeout; the next request handshakes again. Remote agents
// are counted per peer using them: a handshake that is refused, times out
// or is evicted never removes an agent another engine's peer still uses.
//
// Both sides record vLLM's kv_connector/v1/nixl_connector.py's per-transfer statistics (Stats, with
// its Reduce summary) and report events to an Observer, which the CLI
// wires to Prometheus under vLLM's metric names (host/metrics owns them).
// A READ's TransferStat is the completion engine's plugin.TransferEvent,
// the transfer event push reports too, so host/metrics has one adapter
// for both (Metrics.Transfer).
//
// Ownership: the caller owns the plugin agents and the KV memory. A Sender
// or Receiver registers that memory on its agent and deregisters it on
// Close, which also releases every transfer, prepared list and remote agent
// it made. Close the Sender or Receiver before the agent and before
// unmapping the memory.
//
// Notifications: the prefill cannot tell which decode a request was meant
// for. vLLM's side channel carries no reader identity (a handshake request
// is [get_meta_msg, tp_rank], answered to anyone who reaches the port), and
// a notification names only its sending agent. vLLM's kv_connector/v1/nixl_connector.py's
// _get_new_notifs counts every "{request_id}:{tp_ratio}" from any agent, so
// one peer could free a request by repeating it, or send a larger tp_ratio
// early so that the real readers' notifications fell short and the blocks
// stayed held until the abort timeout. kvhost counts each agent once per
// request and rank, and a rank is done only when k distinct agents claimed
// the same tp_ratio k: a peer's extra notifications are surplus, and a
// claim it makes cannot change what the real readers need. What a peer that
// loaded this prefill's agent metadata and knows a request id (it travels in
// the kv_transfer_params the proxy hands the decode) can still do is what
// vLLM's kv_connector/v1/nixl_connector.py allows too: claim tp_ratio 1 (or join the readers' own
// claim with one of its agents) and so release the blocks before the real
// reader finished; the reader then reads blocks the engine may have
// reused. Nothing in vLLM's protocol tells the prefill who the reader is;
// keep side channels and transfer agents on a network only the engines
// reach. The sending agent's name is the plugin's word: the fake plugin
// checks it against the sending process, NIXL carries the sender's claim.
//
// Where kvhost deliberately differs from vLLM's kv_connector/v1/nixl_connector.py:
//   - decode block size > prefill block size with a partial prefix hit: the
//     reference reads remote_block_ids[-n:], which lands the tokens in the
//     wrong decode blocks unless the request's last decode block is full
//     of prefill blocks; kvhost skips the prefill blocks of the hit decode
//     blocks instead (identical whenever vLLM's kv_connector/v1/nixl_connector.py is right;
//     planner.VLLMAlignRemote, which `kvhost plan` applies too, so the plan
//     shows this read: docs/plan.md);
//   - after a READ between different block sizes the received decode
//     blocks are reordered into the decode layout for every layout that
//     needs it (HND, and blocks-first in either layout), where the
//     reference post-processes only non-blocks-first HND;
//   - heterogeneous TP without replicated KV needs HND on both sides (the
//     reference asks vLLM for HND but does not check the peer); an NHD
//     prefill is refused at handshake rather than read as wrong bytes;
//   - a READ may be given a timeout (vLLM's kv_connector/v1/nixl_connector.py waits forever);
//   - a prefill counts each agent's notification once per request and
//     rank, per claimed tp_ratio (vLLM's kv_connector/v1/nixl_connector.py counts every one).
//
// # Transport and clock
//
// Sender and Receiver hold no socket and read no wall clock themselves:
// the handshake side channel goes through the Transport of their config
// (ZMQ, what vLLM speaks, by default; the only file importing host/internal/zmq is
// transport.go), and the abort timeout, handshake and READ timeouts, idle
// eviction and latencies are timed on their Clock (host/internal/clock;
// the wall clock by default), as hashicorp/raft injects its Transport.
// Tests run the timeout paths on a clock.Fake they advance by hand and an
// in-memory transport (host/internal/memtransport). Completing READs and
// receiving notifications (the completion engine), and a READ's
// TransferStat times, stay on the wall clock: the plugin works in real
// time. So does timing the planner (TransferStat.Plan): it is CPU work on
// the calling goroutine, which a fake clock would report as zero. A READ's
// timeout (ReadTimeout) is timed on the Clock and aborts the READ through
// the engine.
package pull
