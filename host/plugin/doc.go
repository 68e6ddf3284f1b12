// Package plugin loads kvhost transfer plugins (C shared libraries speaking
// abi/kvplugin.h) with purego, without cgo, and wraps them in Go types that
// own their handles. On amd64 the table functions are called through
// runtime.cgocall and a ten-instruction assembly trampoline (call_amd64.s):
// about 40 ns a call against purego.SyscallN's 90, and args structs may stay
// on the stack; other architectures, and builds with -tags kvhost_purego,
// call through purego.SyscallN.
//
// Finding and loading: SearchDirs gives the folders searched (the
// --plugin-path flag or $KVHOST_PLUGIN_PATH, the binary's folder,
// ../lib/kvhost beside it, the build tree); Find and Load locate
// libkvhost_<name>.so; Discover lists every candidate with its Info or the
// reason it was rejected (*LoadError: not a library, no entry symbol, ABI
// major mismatch, invalid table).
//
// Handles: Plugin -> Agent -> Region, RemoteRegion, DList, Xfer. Close
// releases a handle; a second Close or any use after Close returns an error
// wrapping ErrClosed, and the plugin never sees the stale handle. Closing an
// Agent closes everything it owns. All types are safe for concurrent use;
// the host serialises what the ABI asks callers to serialise (releasing a
// handle while a call uses it; calls on one transfer).
//
// Errors: every kvp_error becomes an *Error carrying the plugin name, the
// operation, the status code and the plugin's message, and is freed.
// errors.Is(err, ErrNotFound) and the other code sentinels test the code.
// Checks the host makes while emulating a capability return *Error values
// with the same codes a native plugin would use.
//
// Capabilities are decided per agent (Agent.Caps, from agent_create).
// What an agent lacks the host emulates (Agent.Emulated):
//
//   - prepped lists (CapPrepped, e.g. MORI-IO): a DList lives in Go, each
//     descriptor resolved at prep time to (region, offset); remote
//     descriptors to the peer's regions the agent imported, or, with
//     CapRemoteAddr, to merged address ranges imported for the list. A
//     prepped transfer is then one make_batch_xfer, built in reused buffers.
//   - batch transfers (CapBatch): a temporary local and remote list and a
//     prepped transfer with identity indices: 3 plugin calls per transfer
//     made, plus 2 to release the lists with it.
//   - strided descriptors (CapStrided): expanded into plain descriptors (at
//     prep time for lists, keeping prefix offsets so indices expand; per
//     transfer for batch entries, into reused buffers).
//   - submit (CapSubmit, ABI 1.1): SubmitPrepped and SubmitBatch make and
//     post a transfer in one plugin call (submit_xfer) where native, else
//     as make + post; PollRelease finishes one with one poll_xfer
//     (KVP_POLL_RELEASE | KVP_POLL_TELEMETRY) where native, else with poll,
//     telemetry and release. Plugins of ABI 1.0 get this emulation.
//
// The event descriptor (CapEventFD, ABI 1.1) cannot be emulated:
// Agent.EventFD reports it only where the plugin has one; it becomes
// readable when a transfer of the agent ends or a notification arrives,
// and Agent.DrainEvents resets it. The plugin owns and closes it.
//
// Peers: RemoveRemote has the plugin forget a peer and cancel its active
// transfers (they report ErrCanceled, and ErrNotFound when posted again,
// until closed); the host then releases the peer's remote regions and
// lists, which are closed with it.
//
// Hot paths make one plugin call per transfer on native paths and pass the
// caller's index and entry slices to C unchanged; making a transfer
// allocates its *Xfer only (on amd64; the purego path also allocates the
// args struct and SyscallN's argument slice); Post, Poll, PollRelease,
// Telemetry, Close of a transfer, DrainEvents and Notifs with nothing
// queued allocate nothing.
// Strided descriptors the host expands are bounded (16 Mi plain
// descriptors per list or transfer).
//
// Completion: every agent has one completion engine (Agent.Engine,
// completion.go), one goroutine through which the runtimes (host/push,
// host/pull, host/bench) finish every transfer and receive every
// notification. Engine.SubmitPrepped and SubmitBatch make and post a
// transfer in one plugin call (Agent.SubmitPrepped, SubmitBatch); the
// engine finishes it with the poll that releases it (Xfer.PollRelease) and
// tells the submitter's Handler one TransferEvent (bytes, descriptors,
// post time, post and transfer durations, planning time, error), which is
// also the event push and pull report to their observers. Engine.Finish
// waits for one transfer in the caller's goroutine (bench), Xfer.Wait for
// a transfer the caller posted, Engine.Abort gives one up (released, or
// finished and released later if the plugin refuses). Subscribers
// (Engine.Subscribe) get the agent's notifications. With an event
// descriptor (CapEventFD, Agent.EventFD) the engine waits on a dup of it
// through Go's netpoller and never spins (the plugin completes transfers
// on its own threads); an idle engine costs nothing. Without one it polls transfers in flight
// adaptively (spin, then 20µs doubling to 1ms), notifications adaptively
// while a runtime Expects them (a decode room waiting, a prefill holding
// blocks) and every 50ms otherwise (about 0.5% of a core on a loaded
// 2-core machine), and sleeps with nothing to watch. Agent.Close stops
// the engine first; what it still watched fails with ErrClosed.
//
// Releases a plugin refuses (a transfer still in flight after MORI-IO's or
// NIXL's release timeout, a region or list still in use: ErrNotAllowed)
// leave the handle open and usable; Close it again later.
package plugin
