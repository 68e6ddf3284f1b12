// Package pull is kvhost's pull runtime: vLLM's NIXL connector model, in
// which the decode worker READs KV blocks out of the prefill worker's
// registered memory and then tells the prefill it may free them
// (../shared/reference/vllm_nixl_connector.py.txt, vLLM 0.13).
//
// Two types do the work, one per side:
//
//   - Sender (prefill). It registers each TP rank's KV cache on that rank's
//     agent, serves the handshake (a ZeroMQ ROUTER answering
//     [get_meta_msg, tp_rank] with the msgpack NixlHandshakePayload, see
//     host/wire/vllm), and holds each finished request's blocks until every
//     decode rank that reads them has sent "{request_id}:{tp_ratio}", or
//     until the abort timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s by
//     default) expires. Either way it calls OnRelease once, saying which.
//     Notifications for unknown, expired or malformed requests are counted
//     and logged, never fatal.
//   - Receiver (one decode TP rank). Load takes a request's local block ids
//     and the kv_transfer_params the prefill returned. The first request
//     naming a remote engine starts a background handshake with it
//     (requests queue until it completes; a failed handshake fails only
//     them); the handshake validates the hash first, then the engine id and
//     the geometry (planner.NewVLLMReader), loads the peer's agent
//     metadata and prepares both descriptor lists once. Every request is
//     then ONE prepped READ carrying the notification, or, on a full prefix
//     hit, only the notification. A poller completes transfers with
//     backoff; a failed read marks the request's blocks invalid
//     (BlockIDsWithLoadErrors).
//
// Both sides record the reference's per-transfer statistics (Stats, with
// its Reduce summary) and report events to an Observer, which the CLI
// wires to Prometheus under the reference's metric names (MetricSpecs).
//
// Ownership: the caller owns the plugin agents and the KV memory. A Sender
// or Receiver registers that memory on its agent and deregisters it on
// Close, which also releases every transfer, prepared list and remote agent
// it made. Close the Sender or Receiver before the agent and before
// unmapping the memory.
//
// Where kvhost deliberately differs from the reference:
//   - decode block size > prefill block size with a partial prefix hit: the
//     reference reads remote_block_ids[-n:], which lands the tokens in the
//     wrong decode blocks unless the request's last decode block is full
//     of prefill blocks; kvhost skips the prefill blocks of the hit decode
//     blocks instead (identical whenever the reference is right;
//     planner.VLLMAlignRemote, which `kvhost plan` applies too, so the plan
//     shows this read: docs/plan.md);
//   - after a READ between different block sizes the received decode
//     blocks are reordered into the decode layout for every layout that
//     needs it (HND, and blocks-first in either layout), where the
//     reference post-processes only non-blocks-first HND;
//   - heterogeneous TP without replicated KV needs HND on both sides (the
//     reference asks vLLM for HND but does not check the peer); an NHD
//     prefill is refused at handshake rather than read as wrong bytes;
//   - a READ may be given a timeout (the reference waits forever).
package pull
