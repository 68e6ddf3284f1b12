package plugin

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
)

// Param is one agent parameter (kvp_param), e.g. {"backend", "UCX"}.
type Param struct {
	Key, Value string
}

// ParseParams parses "key=value" strings (as given to --param) into Params.
// A string without "=" continues the previous value after a comma: the CLI
// splits repeatable flags (and their environment variables) on commas, and
// values such as caps_off=prepped,notif are comma lists themselves.
func ParseParams(kvs []string) ([]Param, error) {
	out := make([]Param, 0, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok && len(out) > 0 {
			out[len(out)-1].Value += "," + kv
			continue
		}
		if !ok || k == "" {
			return nil, fmt.Errorf("agent parameter %q: want key=value", kv)
		}
		out = append(out, Param{Key: k, Value: v})
	}
	return out, nil
}

// Agent is a plugin agent (kvp_agent): an endpoint that registers memory,
// talks to peers and moves bytes. It owns every handle made through it;
// Close releases them all. An Agent is safe for concurrent use.
//
// Capabilities are decided per agent (Caps). What the agent lacks among
// prepped lists, batch transfers and strided descriptors the host emulates
// (Emulated), so every method works on every agent.
type Agent struct {
	p    *Plugin
	name string
	h    abi.Agent
	caps abi.Caps // what the plugin offers natively on this agent
	// params are the parameters the agent was created with (a copy).
	params []Param

	// mu makes handle release exclusive: every call that uses the agent or
	// one of its handles holds it shared, every release (agent_destroy,
	// deregister_mem, remote_region_release, release_dlist, remove_remote)
	// holds it exclusively. This is rule 1 of the header's thread-safety
	// contract. It also guards the closed flags of the agent, its regions,
	// remote regions and dlists. Xfers have their own lock (rule 2).
	mu     sync.RWMutex
	closed bool

	// engine is the agent's completion engine (completion.go), started
	// by the first Engine call and stopped by Close.
	engine     *Engine
	engineOnce sync.Once

	// book guards the bookkeeping below. Lock order: mu, then book.
	book    sync.Mutex
	regions []*Region        // registered on this agent, sorted by Addr
	peers   map[string]*peer // peers with remote regions or lists
	// loaded holds the names of the peers loaded (LoadRemote,
	// LoadNewRemote) until RemoveRemote.
	loaded map[string]struct{}

	notifMu sync.Mutex // serialises Notifs (which reuses notif)
	notif   notifState

	scratch sync.Pool // *scratch: per-call buffers of the hot paths

	// The event descriptor (CapEventFD): evFD is -1 until EventFD got it
	// from the plugin, which owns it; evMu serialises the first call.
	evMu sync.Mutex
	evFD atomic.Int32
}

// peer is what the agent tracks of one remote agent, so that RemoveRemote
// can release and close the handles that refer to it.
type peer struct {
	rregions []*RemoteRegion // imported by the user; emulation may use them
	dlists   []*DList        // remote lists prepared against this peer
	removed  bool            // RemoveRemote removed the peer; guarded by Agent.mu
}

// NewAgent creates an agent called name (unique among the peers it talks
// to) with plugin-specific parameters (see Info().ParamsDoc).
func (p *Plugin) NewAgent(name string, params ...Param) (*Agent, error) {
	cparams := make([]abi.Param, len(params))
	for i, kv := range params {
		cparams[i] = abi.Param{Key: stringData(kv.Key), KeyLen: uintptr(len(kv.Key)), Value: stringData(kv.Value), ValueLen: uintptr(len(kv.Value))}
	}
	args := &abi.AgentCreateArgs{
		StructSize: abi.AgentCreateArgsSize,
		Name:       stringData(name), NameLen: uintptr(len(name)),
		Params: sliceData(cparams), NumParams: uintptr(len(cparams)),
	}
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed {
		return nil, closedError("plugin " + p.info.Name)
	}
	if err := p.check("agent_create", callC(p.api.AgentCreate, unsafe.Pointer(args))); err != nil {
		return nil, err
	}
	a := &Agent{p: p, name: name, h: args.Agent, caps: args.Caps, params: slices.Clone(params),
		peers: map[string]*peer{}, loaded: map[string]struct{}{}}
	a.evFD.Store(-1)
	a.scratch.New = func() any { return new(scratch) }
	bad := ""
	if extra := args.Caps &^ p.info.Caps; extra != 0 {
		bad = fmt.Sprintf("agent reports capabilities %v that the plugin does not", extra.Names())
	} else if err := checkCapFuncs(&p.api, args.Caps); err != nil {
		bad = err.Error()
	}
	if err := p.addAgent(a); err != nil || bad != "" {
		destroy := &abi.AgentDestroyArgs{StructSize: abi.AgentDestroyArgsSize, Agent: a.h}
		derr := p.check("agent_destroy", callC(p.api.AgentDestroy, unsafe.Pointer(destroy)))
		if err == nil {
			err = hostError(p.info.Name, "agent_create", abi.ErrBackend, "%s", bad)
		}
		return nil, errors.Join(err, derr)
	}
	return a, nil
}

// Name returns the agent's name.
func (a *Agent) Name() string { return a.name }

// Params returns the parameters the agent was created with, defaults the
// host added (Plugin.ForSide) included. The caller must not modify them.
func (a *Agent) Params() []Param { return a.params }

// Plugin returns the plugin the agent belongs to.
func (a *Agent) Plugin() *Plugin { return a.p }

// Handle returns the plugin's handle of the agent (for Raw and diagnostics).
func (a *Agent) Handle() abi.Agent { return a.h }

// Caps returns the capabilities the plugin offers natively on this agent
// (kvp_agent_create_args.caps), which may be fewer than the plugin's.
func (a *Agent) Caps() abi.Caps { return a.caps }

// Emulated returns the capabilities the host provides for this agent on top
// of the native ones: CapPrepped (Go-side lists over batch transfers),
// CapBatch (prepped lists per transfer), CapStrided (expansion into plain
// descriptors) and CapSubmit (SubmitPrepped and SubmitBatch as make and
// post, PollRelease as poll, telemetry and release). Notifications,
// telemetry, remote regions and the event descriptor (CapEventFD) cannot
// be emulated.
func (a *Agent) Emulated() abi.Caps {
	var e abi.Caps
	if !a.caps.Has(abi.CapSubmit) {
		e |= abi.CapSubmit
	}
	if !a.caps.Has(abi.CapPrepped) {
		e |= abi.CapPrepped
	}
	if !a.caps.Has(abi.CapBatch) {
		e |= abi.CapBatch
	}
	if !a.caps.Has(abi.CapStrided) {
		e |= abi.CapStrided
	}
	return e
}

// Close destroys the agent: the plugin cancels its transfers and releases
// every handle it owns. Every Region, RemoteRegion, DList and Xfer of the
// agent is closed with it (their methods return ErrClosed afterwards).
// agent_destroy cannot be refused (kvplugin.h): an error the plugin
// reports (e.g. NIXL's "the agent is gone, but NIXL failed") is returned,
// and the agent is closed all the same.
func (a *Agent) Close() error {
	a.stopEngine()
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return a.closedErr()
	}
	a.closed = true
	args := &abi.AgentDestroyArgs{StructSize: abi.AgentDestroyArgsSize, Agent: a.h}
	err := a.p.check("agent_destroy", callC(a.p.api.AgentDestroy, unsafe.Pointer(args)))
	a.mu.Unlock()
	a.p.removeAgent(a)
	return err
}

func (a *Agent) closedErr() error { return closedError("agent " + a.name) }

// EventFD returns the agent's event descriptor (kvp_get_event_fd_args in
// abi/kvplugin.h), ok only on an agent with native CapEventFD. It becomes
// readable when a transfer of the agent ends (done, failed or cancelled)
// or a notification for it is queued, and stays readable until
// DrainEvents. Events coalesce, so after a wakeup: DrainEvents first, then
// poll every transfer in flight and drain the notifications; an event
// after the drain makes it readable again.
//
// The plugin owns the descriptor and closes it when the agent is closed:
// never close it, and stop waiting on it before Agent.Close (to hand it to
// something that closes what it is given, such as os.NewFile, dup it
// first). From the first call on, the plugin completes the agent's
// transfers without polls, so the descriptor alone may be waited on. Every
// call returns the same descriptor.
func (a *Agent) EventFD() (fd int, ok bool) {
	if fd := a.evFD.Load(); fd >= 0 {
		return int(fd), true
	}
	if !a.caps.Has(abi.CapEventFD) {
		return -1, false
	}
	if a.use() != nil {
		return -1, false
	}
	defer a.mu.RUnlock()
	a.evMu.Lock()
	defer a.evMu.Unlock()
	if fd := a.evFD.Load(); fd >= 0 {
		return int(fd), true
	}
	args := &abi.GetEventFDArgs{StructSize: abi.GetEventFDArgsSize, Agent: a.h, FD: -1}
	if err := a.check("get_event_fd", callC(a.p.api.GetEventFD, unsafe.Pointer(args))); err != nil || args.FD < 0 {
		return -1, false
	}
	a.evFD.Store(args.FD)
	return int(args.FD), true
}

// DrainEvents resets the event descriptor after a wakeup by reading its
// eventfd counter; without a descriptor (EventFD not called, or not ok) it
// does nothing. It does not block and allocates nothing.
func (a *Agent) DrainEvents() error {
	fd := a.evFD.Load()
	if fd < 0 {
		return nil
	}
	if err := a.use(); err != nil {
		return err
	}
	defer a.mu.RUnlock()
	var buf [8]byte
	for {
		_, err := syscall.Read(int(fd), buf[:])
		switch err {
		case nil, syscall.EAGAIN:
			return nil
		case syscall.EINTR:
			continue
		}
		return a.hostErr("get_event_fd", abi.ErrBackend, "reading the event descriptor %d: %v", fd, err)
	}
}

// use takes the agent shared for one call; the caller must call a.mu.RUnlock
// when it returns nil.
func (a *Agent) use() error {
	a.mu.RLock()
	if a.closed {
		a.mu.RUnlock()
		return a.closedErr()
	}
	return nil
}

// useExclusive takes the agent exclusively for a release.
func (a *Agent) useExclusive() error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return a.closedErr()
	}
	return nil
}

func (a *Agent) check(op string, errPtr uintptr) error { return a.p.check(op, errPtr) }

func (a *Agent) hostErr(op string, code abi.Status, format string, args ...any) *Error {
	return hostError(a.p.info.Name, op, code, format, args...)
}

func (a *Agent) needCaps(op string, c abi.Caps) error {
	if !a.caps.Has(c) {
		return a.hostErr(op, abi.ErrNotSupported, "agent %s lacks capability %v (has %v)", a.name, c.Names(), a.caps.Names())
	}
	return nil
}

// ---------------------------------------------------------------------------
// Memory registration
// ---------------------------------------------------------------------------

// Region is memory registered on an agent (kvp_region). The memory belongs
// to the caller and must stay mapped until Close returns.
type Region struct {
	a      *Agent
	h      abi.Region
	desc   abi.MemDesc
	closed bool         // guarded by a.mu
	users  atomic.Int32 // emulated lists that refer to the region
}

// Addr returns the start address of the region in this process.
func (r *Region) Addr() uint64 { return r.desc.Addr }

// Len returns the region's length in bytes.
func (r *Region) Len() uint64 { return r.desc.Len }

// DevID returns the GPU ordinal (0 for DRAM).
func (r *Region) DevID() uint64 { return r.desc.DevID }

// Kind returns the memory kind.
func (r *Region) Kind() abi.MemKind { return r.desc.MemKind }

// Handle returns the plugin's handle of the region.
func (r *Region) Handle() abi.Region { return r.h }

// Agent returns the agent the region is registered on.
func (r *Region) Agent() *Agent { return r.a }

// Close deregisters the region (Agent.Deregister(r)).
func (r *Region) Close() error { return r.a.Deregister(r) }

// Register registers memory; the i-th Region describes descs[i]. All or
// nothing: on error nothing stays registered. The plugin reads and writes
// the memory asynchronously, without the Go runtime knowing: register
// memory outside the Go heap (mmap'd buffers, GPU memory), and keep it
// mapped until the Region is closed.
func (a *Agent) Register(descs []abi.MemDesc) ([]*Region, error) {
	if err := a.use(); err != nil {
		return nil, err
	}
	defer a.mu.RUnlock()
	if len(descs) == 0 {
		return nil, nil
	}
	handles := make([]abi.Region, len(descs))
	args := &abi.RegisterMemArgs{
		StructSize: abi.RegisterMemArgsSize, Agent: a.h,
		Descs: sliceData(descs), NumDescs: uintptr(len(descs)), Regions: sliceData(handles),
	}
	if err := a.check("register_mem", callC(a.p.api.RegisterMem, unsafe.Pointer(args))); err != nil {
		return nil, err
	}
	out := make([]*Region, len(descs))
	a.book.Lock()
	for i, d := range descs {
		out[i] = &Region{a: a, h: handles[i], desc: d}
		a.regions = append(a.regions, out[i])
	}
	slices.SortFunc(a.regions, func(x, y *Region) int { return cmpU64(x.desc.Addr, y.desc.Addr) })
	a.book.Unlock()
	return out, nil
}

// Deregister deregisters regions in one plugin call. It fails without
// deregistering anything if any region is closed, belongs to another agent,
// or is still used by a prepared list the host emulates. Close the transfers
// that use a region first; a plugin that tracks such use refuses with
// ErrNotAllowed. When the plugin returns an error the regions stay open, so
// the call can be repeated once the transfers are closed.
func (a *Agent) Deregister(regions ...*Region) error {
	if err := a.useExclusive(); err != nil {
		return err
	}
	defer a.mu.Unlock()
	handles := make([]abi.Region, len(regions))
	for i, r := range regions {
		switch {
		case r == nil || r.a != a:
			return a.hostErr("deregister_mem", abi.ErrInvalidParam, "region %d is not registered on agent %s", i, a.name)
		case r.closed:
			return closedError(fmt.Sprintf("region %#x", r.desc.Addr))
		case r.users.Load() > 0:
			return a.hostErr("deregister_mem", abi.ErrNotAllowed, "region %#x is used by %d prepared lists", r.desc.Addr, r.users.Load())
		case slices.Contains(regions[:i], r):
			return a.hostErr("deregister_mem", abi.ErrInvalidParam, "region %#x listed twice", r.desc.Addr)
		}
		handles[i] = r.h
	}
	args := &abi.DeregisterMemArgs{StructSize: abi.DeregisterMemArgsSize, Agent: a.h, Regions: sliceData(handles), NumRegions: uintptr(len(handles))}
	if err := a.check("deregister_mem", callC(a.p.api.DeregisterMem, unsafe.Pointer(args))); err != nil {
		return err
	}
	a.book.Lock()
	for _, r := range regions {
		r.closed = true
	}
	a.regions = slices.DeleteFunc(a.regions, func(r *Region) bool { return r.closed })
	a.book.Unlock()
	return nil
}

// Export returns the region's descriptor blob, which a peer passes to
// ImportRegion (needs CapRemoteBlob).
func (r *Region) Export() ([]byte, error) {
	a := r.a
	if err := a.needCaps("region_export", abi.CapRemoteBlob); err != nil {
		return nil, err
	}
	if err := a.use(); err != nil {
		return nil, err
	}
	defer a.mu.RUnlock()
	if r.closed {
		return nil, closedError(fmt.Sprintf("region %#x", r.desc.Addr))
	}
	return a.sizedOutput("region_export", func(buf []byte) (uintptr, error) {
		args := &abi.RegionExportArgs{StructSize: abi.RegionExportArgsSize, Agent: a.h, Region: r.h, Buf: sliceData(buf), Cap: uintptr(len(buf))}
		err := a.check("region_export", callC(a.p.api.RegionExport, unsafe.Pointer(args)))
		return args.Size, err
	})
}

// maxOutput bounds the size a plugin may ask the host to allocate for one
// metadata blob, region blob or notification.
const maxOutput = 1 << 30

// sizedOutput runs the "size is always set; bytes are copied only if size <=
// cap" protocol: call with a guess, grow to the reported size, repeat until
// the output fits (it can grow between calls, e.g. metadata while another
// goroutine registers memory).
func (a *Agent) sizedOutput(op string, call func(buf []byte) (uintptr, error)) ([]byte, error) {
	buf := make([]byte, 256)
	for range 8 {
		size, err := call(buf)
		if err != nil {
			return nil, err
		}
		if size <= uintptr(len(buf)) {
			return buf[:size:size], nil
		}
		if size > maxOutput {
			return nil, a.hostErr(op, abi.ErrBackend, "plugin asks for a %d-byte buffer", size)
		}
		buf = make([]byte, size)
	}
	return nil, a.hostErr(op, abi.ErrBackend, "output size kept changing")
}

// ---------------------------------------------------------------------------
// Metadata and peers
// ---------------------------------------------------------------------------

// LocalMetadata returns the agent's metadata, which a peer passes to
// LoadRemote. It is a snapshot: register memory first.
func (a *Agent) LocalMetadata() ([]byte, error) {
	if err := a.use(); err != nil {
		return nil, err
	}
	defer a.mu.RUnlock()
	return a.sizedOutput("local_metadata", func(buf []byte) (uintptr, error) {
		args := &abi.LocalMetadataArgs{StructSize: abi.LocalMetadataArgsSize, Agent: a.h, Buf: sliceData(buf), Cap: uintptr(len(buf))}
		err := a.check("local_metadata", callC(a.p.api.LocalMetadata, unsafe.Pointer(args)))
		return args.Size, err
	})
}

// LoadRemote loads a peer's metadata and returns the peer's agent name.
// Loading the same metadata again is idempotent; metadata that names a
// loaded peer but describes another agent (another process, endpoint or
// incarnation) is refused with ErrNotAllowed and leaves the peer as it
// was: a restarted peer is removed (RemoveRemote) and loaded again. See
// load_remote in abi/kvplugin.h.
func (a *Agent) LoadRemote(md []byte) (string, error) {
	if err := a.use(); err != nil {
		return "", err
	}
	defer a.mu.RUnlock()
	name, err := a.loadLocked(md)
	if err != nil {
		return "", err
	}
	a.book.Lock()
	a.loaded[name] = struct{}{}
	a.book.Unlock()
	return name, nil
}

// LoadNewRemote loads the metadata of a peer that is not loaded on this
// agent and returns its name. Metadata naming a peer that is loaded
// already (by LoadRemote or LoadNewRemote, and not removed since) is
// refused with an error matching ErrNotAllowed, and that peer is left as
// it was: load_remote itself refuses metadata that describes another
// agent under a loaded name (abi/kvplugin.h; the conformance suite's
// forged-reload case holds every plugin to it), and the same metadata
// again loads idempotently, which this refuses. The agent is held
// exclusively, so the check and the load are one step against a
// concurrent RemoveRemote. Use it where the metadata comes from someone
// who must not change another peer (a registration).
func (a *Agent) LoadNewRemote(md []byte) (string, error) {
	if err := a.useExclusive(); err != nil {
		return "", err
	}
	defer a.mu.Unlock()
	name, err := a.loadLocked(md)
	if err != nil {
		return "", err
	}
	a.book.Lock()
	defer a.book.Unlock()
	if _, known := a.loaded[name]; known {
		return "", a.hostErr("load_remote", abi.ErrNotAllowed, "metadata names peer %q, which is loaded already; it was left as it was", name)
	}
	a.loaded[name] = struct{}{}
	return name, nil
}

// loadLocked calls load_remote. Needs a.mu held.
func (a *Agent) loadLocked(md []byte) (string, error) {
	args := &abi.LoadRemoteArgs{StructSize: abi.LoadRemoteArgsSize, Agent: a.h, Metadata: sliceData(md), MetadataLen: uintptr(len(md))}
	if err := a.check("load_remote", callC(a.p.api.LoadRemote, unsafe.Pointer(args))); err != nil {
		return "", err
	}
	return string(cBytes(args.PeerName, args.PeerNameLen)), nil
}

// RemoveRemote forgets a peer: the plugin cancels transfers to it (their
// Poll then reports ErrCanceled, and Post ErrNotFound, until they are
// closed), and the host releases the peer's remote regions and remote
// lists, which are closed here too. An unknown peer is ErrNotFound. The
// peer may be loaded again with LoadRemote.
func (a *Agent) RemoveRemote(peerName string) error {
	if err := a.useExclusive(); err != nil {
		return err
	}
	defer a.mu.Unlock()
	args := &abi.RemoveRemoteArgs{StructSize: abi.RemoveRemoteArgsSize, Agent: a.h, PeerName: stringData(peerName), PeerNameLen: uintptr(len(peerName))}
	if err := a.check("remove_remote", callC(a.p.api.RemoveRemote, unsafe.Pointer(args))); err != nil {
		return err
	}
	return a.forgetPeer(peerName)
}

// forgetPeer releases and closes every remote region and remote list of a
// peer that remove_remote just removed. The header keeps such handles
// valid (dead) until the caller releases them; a plugin that released them
// itself answers the release with ErrInvalidParam, which is ignored here:
// either way the plugin no longer holds them. Called with a.mu held
// exclusively, so no other call uses the handles.
func (a *Agent) forgetPeer(name string) error {
	a.book.Lock()
	pr := a.peers[name]
	delete(a.peers, name)
	delete(a.loaded, name)
	a.book.Unlock()
	if pr == nil {
		return nil
	}
	pr.removed = true
	var errs []error
	released := func(err error) {
		if err != nil && !errors.Is(err, ErrInvalidParam) {
			errs = append(errs, err)
		}
	}
	for _, d := range pr.dlists {
		d.closed = true
		if d.emu == nil {
			released(a.p.releaseDList(a.h, d.h))
			continue
		}
		for _, rr := range d.emu.owned {
			released(a.releaseRRegionLocked(rr))
			rr.closed = true
		}
		d.emu.unref()
	}
	for _, rr := range pr.rregions {
		released(a.releaseRRegionLocked(rr))
		rr.closed = true
	}
	return errors.Join(errs...)
}

// peerLocked returns the bookkeeping of a peer, creating it. Needs a.book.
func (a *Agent) peerLocked(name string) *peer {
	pr := a.peers[name]
	if pr == nil {
		pr = &peer{}
		a.peers[name] = pr
	}
	return pr
}

// RemoteRegion is a region of a peer as seen by this agent (kvp_rregion).
type RemoteRegion struct {
	a      *Agent
	peer   string
	h      abi.RRegion
	desc   abi.MemDesc  // where the region lies in the peer's address space
	closed bool         // guarded by a.mu
	users  atomic.Int32 // emulated lists that refer to the region
	owner  *DList       // the emulated list that imported it, or nil (the user's)
}

// Peer returns the name of the agent the region belongs to.
func (r *RemoteRegion) Peer() string { return r.peer }

// Addr returns the region's start address in the peer's address space.
func (r *RemoteRegion) Addr() uint64 { return r.desc.Addr }

// Len returns the region's length in bytes.
func (r *RemoteRegion) Len() uint64 { return r.desc.Len }

// DevID returns the region's GPU ordinal on the peer (0 for DRAM).
func (r *RemoteRegion) DevID() uint64 { return r.desc.DevID }

// Kind returns the region's memory kind.
func (r *RemoteRegion) Kind() abi.MemKind { return r.desc.MemKind }

// Handle returns the plugin's handle of the remote region.
func (r *RemoteRegion) Handle() abi.RRegion { return r.h }

// ImportRegion imports a peer's region from the blob the peer's Export made
// (needs CapRemoteBlob). The peer's metadata must be loaded.
func (a *Agent) ImportRegion(peerName string, blob []byte) (*RemoteRegion, error) {
	if err := a.needCaps("remote_region_import", abi.CapRemoteBlob); err != nil {
		return nil, err
	}
	if len(blob) == 0 {
		return nil, a.hostErr("remote_region_import", abi.ErrInvalidParam, "empty region blob")
	}
	return a.importRegion(peerName, blob, abi.MemDesc{})
}

// ImportRange imports the range [addr, addr+length) of a peer's advertised
// memory as a remote region (needs CapRemoteAddr).
func (a *Agent) ImportRange(peerName string, addr, length, devID uint64, kind abi.MemKind) (*RemoteRegion, error) {
	if err := a.needCaps("remote_region_import", abi.CapRemoteAddr); err != nil {
		return nil, err
	}
	return a.importRegion(peerName, nil, abi.MemDesc{Addr: addr, Len: length, DevID: devID, MemKind: kind})
}

// importRegion imports a region for the user (by blob when blob is not
// empty, else the range d) and tracks it under its peer.
func (a *Agent) importRegion(peerName string, blob []byte, d abi.MemDesc) (*RemoteRegion, error) {
	if err := a.use(); err != nil {
		return nil, err
	}
	defer a.mu.RUnlock()
	rr, err := a.importLocked(peerName, blob, d)
	if err != nil {
		return nil, err
	}
	a.book.Lock()
	pr := a.peerLocked(peerName)
	pr.rregions = append(pr.rregions, rr)
	a.book.Unlock()
	return rr, nil
}

// importLocked calls remote_region_import (by blob when blob is non-empty,
// else by the address range in d), without tracking the region. Needs a.mu
// held.
func (a *Agent) importLocked(peerName string, blob []byte, d abi.MemDesc) (*RemoteRegion, error) {
	h, desc, err := a.p.importRegion(a.h, peerName, blob, d)
	if err != nil {
		return nil, err
	}
	return &RemoteRegion{a: a, peer: peerName, h: h, desc: desc}, nil
}

// Close releases the remote region. It fails if a prepared list the host
// emulates still uses it. When the plugin refuses the release the region
// stays open, to be closed again later.
func (r *RemoteRegion) Close() error {
	a := r.a
	if err := a.useExclusive(); err != nil {
		return err
	}
	defer a.mu.Unlock()
	if r.closed {
		return closedError(fmt.Sprintf("remote region %#x of %s", r.desc.Addr, r.peer))
	}
	if r.owner != nil {
		return a.hostErr("remote_region_release", abi.ErrNotAllowed, "remote region %#x belongs to a prepared list; close the list", r.desc.Addr)
	}
	if n := r.users.Load(); n > 0 {
		return a.hostErr("remote_region_release", abi.ErrNotAllowed, "remote region %#x of %s is used by %d prepared lists", r.desc.Addr, r.peer, n)
	}
	if err := a.releaseRRegionLocked(r); err != nil {
		return err
	}
	a.book.Lock()
	if pr := a.peers[r.peer]; pr != nil {
		pr.rregions = slices.DeleteFunc(pr.rregions, func(x *RemoteRegion) bool { return x == r })
	}
	a.book.Unlock()
	return nil
}

// releaseRRegionLocked calls remote_region_release. Needs a.mu exclusively.
func (a *Agent) releaseRRegionLocked(r *RemoteRegion) error {
	if err := a.p.releaseRRegion(a.h, r.h); err != nil {
		return err
	}
	r.closed = true
	return nil
}

func cmpU64(x, y uint64) int {
	switch {
	case x < y:
		return -1
	case x > y:
		return 1
	}
	return 0
}
