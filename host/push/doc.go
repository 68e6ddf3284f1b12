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
//	st, _ := s.Wait(ctx)                 // Success or Failed (s.Failure())
//	s.Close()
//
// A decode rank runs a Decode manager and makes one Receiver per request:
//
//	r, _ := dec.NewReceiver(bootstrapAddr, room)
//	r.Init(ctx)                          // rank mapping, registration: WaitingForInput
//	r.SendMetadata(ctx, pages, auxIndex, stateIndices, prefixLen)
//	st, _ := r.Wait(ctx)                 // Success when every byte landed
//	r.Close()
//
// # Transport and clock
//
// A rank holds no socket and reads no wall clock itself: what it exchanges
// with peers (control messages, the bootstrap server's API) goes through
// the Transport of its config (ZMQ, what SGLang speaks, by default; the
// only file importing host/internal/zmq is transport.go), and every timeout,
// heartbeat, sweep and latency is timed on its Clock (host/internal/clock;
// the wall clock by default), as hashicorp/raft injects its Transport.
// Tests run the timeout paths on a clock.Fake they advance by hand and an
// in-memory transport (host/internal/memtransport). Completing transfers
// and receiving notifications (the agent's completion engine,
// plugin.Engine) and the times of a TransferEvent stay on the wall clock:
// the plugin works in real time. So does timing the planner
// (TransferEvent.Plan): it is CPU work on the calling goroutine, which a
// fake clock would report as zero.
//
// # Semantics (SGLang's python/sglang/srt/disaggregation/{nixl,mori}/conn.py)
//
// Room status is sglang.KVPoll, kept by package rooms: monotonic, Failed
// terminal.
// Chunks go to transfer worker shards by room (room % QueueSize), so a
// room's chunks are processed in order. Each chunk is planned once per
// decode rank with package planner, checked against the region tables of
// both sides (Plan.Validate: every byte read lies in this worker's
// registered memory, every byte written in memory the peer registered),
// for every rank before anything is posted, and then posted from those
// same plans as one plugin transfer (one per memory-kind segment on mixed
// VRAM/DRAM pools), each submitted (made and posted) in one plugin call
// through the agent's completion engine, which reports it to the worker
// when it ends and releases it; the worker waits for the chunk's last
// report, its first failure or the SLA, and cancels (Engine.Abort) what is
// left. Aux and state go with the last chunk. Decode receives
// notifications from the engine (a subscription); while rooms wait for
// them it tells the engine to expect them (Engine.Expect), so an engine
// without an event descriptor polls for them adaptively. The planning
// time is TransferEvent.Plan (kvhost_plan_time_seconds).
//
// How KV reaches the plugin (PrefillConfig.XferMode): the default, auto,
// follows the agent's native capabilities (plugin.Agent.Caps). With native
// strides, each chunk is planned as strided copies (below): the fewest
// descriptors, and on head-slice shapes half the planning time of indices.
// Without strides but with prepped lists (NIXL variant, e.g. NIXL builds
// without the strided list API), SGLang's prepared lists are built
// once per decode rank and each chunk is planned as indices into them
// (SGLang NIXL's make_prepped_xfer), never as strided copies it would not
// use; a rank whose geometry SGLang's nixl/conn.py posts without prepped lists, or
// whose lists NIXL would reject, gets batch transfers. Otherwise (and
// with strides) each chunk is planned as strided copies posted as one batch transfer over
// region pairs imported once per peer, which the plugin takes as they are
// with native strides and the host expands into plain descriptors
// without. "batch" and "prepped" force either path (prepped lists are
// emulated by the host on agents without them; MORI has no prepped path).
// Prefill.XferMode says what auto chose.
//
// Completion reaches decode either as transfer-attached notifications with
// SGLang NIXL's tags ("{room}_kv_{chunk}_{last}_{rank}", "_part_{i}_{n}",
// "{room}_aux", "{room}_aux_nokv_{rank}", "{room}_state_{rank}_{i}"), tracked
// as SGLang's disaggregation/nixl/conn.py's TransferStatus does, or as MORI-style status messages
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
// Observability: an Observer sees every transfer (the completion engine's
// plugin.TransferEvent: bytes, descriptors, post time, post and transfer
// durations from the plugin's telemetry, planning time, error; with the
// room, decode rank, chunk and SGLang's descriptor count for the same
// bytes), failure, room state change and handshake or heartbeat latency.
// pull reports its READs with the same plugin.TransferEvent, so
// host/metrics adapts both with one function (Metrics.Transfer). It is the hook for Prometheus metrics: implement it
// (embed NopObserver for the events you ignore) and pass it in the config.
//
// # Containment
//
// Whatever a peer sends, a prefill rank reads only its own registered KV
// and writes only into the regions the peer registered: a decode rank's
// remote regions are imported exactly as its registration declares them
// (NIXL: address ranges; MORI: the exported region blobs), the planners'
// region tables are checked against them once per peer, and every plan is
// validated against those tables before it is posted, whatever the plugin.
// A decode rank writes into its aux buffers only the slot a room asked for.
// A malformed or unexpected control message is logged (rate-limited) and
// dropped; ABORT is honoured only from the room's decode ranks (or, before
// they sent anything, from a registered decode rank).
//
// A registration that is refused or ignored leaves every registered decode
// rank as it was: one claiming a registered agent (engine) name is ignored
// before its metadata is loaded, and metadata that names a loaded agent
// under another name is refused without replacing or removing that agent
// (plugin.Agent.LoadNewRemote).
//
// What decode ranks' transfer infos hold while their room is not yet both
// complete (every decode rank reported) and opened by the engine is
// bounded in bytes: Settings.MaxPendingInfoBytes in total (64 MiB) and
// MaxPendingInfoBytesPerPeer per registered decode agent (16 MiB; infos
// naming agents that are not registered share one such budget), besides
// the 65,536 rooms that may wait for the engine. An info over the bound is
// dropped (logged, rate-limited, and counted by Dropped) and its room
// fails with the reason: at once if the engine holds it, else as soon as
// the engine opens it. Infos for rooms the engine never opens are dropped
// after the bootstrap timeout.
//
// # Who may complete a room on a decode rank
//
// A decode rank has no byte check: when a room reports Success the engine
// reads the pages, and when it fails the pages are freed and reused. So a
// room's completion is accepted only from the prefill ranks the room was
// sent to (the targets its transfer info went to, found through the
// bootstrap server), and Success only when every data-sending one of them
// reported, each counted once (duplicates, and MLA's dummy ranks, count
// nothing). Refused messages change nothing, are counted in Dropped and
// logged (rate-limited).
//
//   - Status messages (both variants) count only from the prefill rank
//     they name (its prefill_unique_rank), if the room was sent to it and
//     the message came on a connection from that rank's host: the remote
//     IP of the connection must be the rank_ip the rank registered with the
//     bootstrap server (for a rank on the decode's own host, also a
//     loopback address when rank_ip is one of the host's addresses, or
//     one of the host's addresses when rank_ip is a loopback address: any
//     local process can use all of them, and a local rank uses whichever
//     its route to the decode gives). MORI's AUX_DATA is written only when
//     it comes from the host of a rank that sends the room data. In
//     automatic completion mode a rank whose notifications come from a
//     known agent (below) does not complete rooms by status.
//   - Notifications count per prefill rank, identified by the agent they
//     come from, not by the rank a tag names (SGLang keys its
//     TransferStatus by the tag's rank field, which any sender writes).
//     Each data-sending prefill rank has one agent and each agent speaks
//     for one rank, with one rank in all its tags; the agent of a rank is
//     learned from the first notification that finds one of an open
//     room's data-sending ranks without a known agent (the rank the tag
//     names if that one has none yet), and forgotten when the heartbeat
//     declares the prefill deployment dead. A notification from an agent
//     that is not the agent of one of the room's data-sending ranks, or
//     that names another rank than the agent's earlier tags, is refused.
//
// What that guarantees, and what a peer can still do:
//
//   - A peer on another host than every prefill rank of a room cannot
//     complete or fail the room, nor write its aux slot, by status or
//     AUX_DATA: TCP's handshake keeps a remote host from using another
//     host's IP (an attacker on the network path, or one that can route
//     packets as another host, is outside this). Its notifications count
//     only if it holds this rank's agent metadata (which the decode sends
//     only to the prefill ranks it registers with) and a room id (known to
//     the room's prefill ranks and the router), and only as the first
//     agent to speak for a rank (below).
//   - A peer on the same host as a prefill rank (the same IP) can send that
//     rank's status messages: in status mode it can report Success for the
//     part of every rank on its host, and fail the room. It cannot report
//     the part of a rank on another host, so a room fed by ranks on several
//     hosts still waits for the others. In automatic mode it cannot
//     complete a rank that reports by notification once its agent is known.
//   - A peer on the decode's own host is no host of its own: any local
//     process can connect from any 127.0.0.0/8 address or any of the
//     host's addresses, so it can send every status message of every
//     prefill rank on that host. (A prefill rank on 127.0.0.1 does not
//     accept 127.0.0.2, so tests on one machine can stand a peer on
//     127.0.0.2 for another host.) On the fake plugin a process of
//     the same user can also write the decode's memory directly
//     (process_vm_writev); one host and one user is one trust domain.
//   - The agent name is what the plugin reports: the fake plugin checks it
//     against the sending process's socket credentials; NIXL reports the
//     name the remote agent claims (its notification path does not
//     authenticate it), so on NIXL a sender that can reach this agent can
//     also claim a known prefill agent's name.
//   - First contact: SGLang's protocol gives a decode no way to learn a
//     prefill rank's agent (registration flows from decode to prefill
//     only), so until the rank's first notification arrives, an agent that
//     beats it (holding this rank's metadata and a room id) becomes the
//     rank's agent: it can complete that rank's part of the rooms, and the
//     honest agent's notifications are refused (its rooms fail at the
//     waiting timeout) until the heartbeat declares the deployment dead.
//   - A prefill rank (or its agent) can report its own part before the
//     bytes landed: it is that rank, and the decode trusts it as SGLang's
//     does.
//   - A prefill rank on another host must reach the decode from its
//     rank_ip: on a multi-homed host whose route to the decode leaves by
//     another address, or behind NAT, its status messages are refused and
//     its rooms fail at the waiting timeout (the drop log names the
//     address they came from).
//
// # Wire details beyond SGLang's layouts
//
//   - SGLang's NIXL registration carries no aux or state buffer lengths. A
//     kvhost decode appends three frames after the 19 SGLang sends:
//     "kvhost.lens.v1", the aux lengths (uint64 LE each) and the state
//     lengths (pack_int_lists "Q"). SGLang ignores them; a kvhost prefill
//     bounds the decode's aux and state regions with them (malformed ones
//     refuse the registration). For an SGLang decode without them, whose
//     aux buffers hold as many slots as its server sized them for (fewer or
//     more than the prefill's), the prefill writes aux as SGLang's does, at
//     ptr + item_len * index: each room imports just the slot it writes,
//     and the plugin refuses one outside the memory the decode registered
//     (the room fails with its reason). State buffers without lengths are
//     assumed as long as the prefill's own.
//   - MORI's EngineDesc is a msgpack array whose first element is the
//     engine key. A plugin whose metadata is not one (the fake plugin,
//     NIXL) has it wrapped: [key, gpu id, "kvhost-wrapped", metadata (bin),
//     nil] (sglang.WrapEngineDesc); the prefill unwraps it before loading
//     it. A MORI plugin's metadata goes as is.
//   - Failures travel as MORI status messages in both variants (SGLang NIXL
//     has no way to tell decode why a room failed); an SGLang NIXL decode
//     ignores them.
//   - The rank field of notification tags and of status messages is the
//     prefill's unique rank, tp*(pp_size*cp_size) + pp*cp_size + cp, so
//     every prefill rank answering one decode rank (TP fan-in, PP stages)
//     counts apart.
//
// # Deliberate differences from SGLang's disaggregation/{nixl,mori}/conn.py
//
//   - Decode counts Success status messages only from the prefill ranks
//     that send it data: SGLang MORI's dummy ranks (MLA) report Success at
//     once, which would end a room before its data landed.
//   - Decode accepts status and AUX_DATA messages only from the host of
//     the prefill rank they name, and counts notifications per sending
//     agent, one agent per prefill rank (see "Who may complete a room");
//     SGLang accepts them from anyone and keys notifications by the rank
//     their tags name.
//   - A chunk whose decode rank sent fewer page indices than the chunk has
//     fails the room (SGLang truncates with a warning).
//   - Transfer info for a room past Bootstrapping is ignored in both
//     variants (MORI's rule; SGLang NIXL overwrites it).
//   - An ABORT that arrives before the prefill engine opened the room is
//     remembered, and the room fails as soon as it is opened (or the ABORT
//     is dropped after the bootstrap timeout). An ABORT for a room the
//     engine closed within the bootstrap timeout (the last 65,536 closed
//     rooms) is dropped: it would fail a later room with the same id.
//   - With notifications, decode waits for aux from every prefill rank that
//     answers the room (counted per rank's agent), not just the first: every
//     such rank writes the aux slot, and a slower one (another PP stage)
//     must not write it after the room completed and the slot was reused.
//   - Notifications for rooms this rank does not hold are dropped instead
//     of creating tracking state, and per-room tracking is bounded.
//   - The heartbeat interval may be set below SGLang's 2 s floor (tests do).
//   - SGLang MORI supports prefill PP > 1 only towards a decode with PP 1
//     (it slices the decode list by the stage's start layer); kvhost keeps
//     that rule and refuses other layouts at registration with
//     SGLang's reason.
//   - kvhost ranks do not run with attention context parallelism (CP > 1
//     is refused by NewPrefill and NewDecode); a kvhost decode maps onto an
//     SGLang prefill with CP as SGLang's disaggregation/{nixl,mori}/conn.py does. SGLang's staging
//     messages (WATERMARK, STAGING_REQ, STAGING_RSP) are dropped as
//     unsupported.
package push
