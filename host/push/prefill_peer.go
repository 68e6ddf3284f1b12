package push

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/memkind"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/sglang"
	"github.com/kvhost/kvhost/planner"
)

// peer is a registered decode rank, with everything a chunk needs built
// once at registration: imported remote regions, planners, prepared lists.
// Immutable after addPeer; owned by the manager (its handles belong to the
// agent and are released with it, or by removePeer).
type peer struct {
	name     string
	endpoint string // decode's PULL socket
	tpSize   int
	tpRank   int

	kv    kvPlanner
	nixl  kvIndexer // NIXL variant: for prepped transfers
	aux   *planner.AuxPlanner
	state *planner.StatePlanner

	kvRemote    []*plugin.RemoteRegion
	auxRemote   []*plugin.RemoteRegion
	stateRemote [][]*plugin.RemoteRegion

	// auxBySlot: the decode rank did not say how long its aux buffers are
	// (an SGLang NIXL decode: no kvhost length frames). Its aux regions
	// are then not imported at registration; each room imports the slot
	// it writes (see worker.auxRemote), which the plugin checks against
	// the memory the peer registered, as SGLang's prefill has NIXL check
	// ptr + item_len * index.
	auxBySlot bool

	// auxTCP: MORI ships aux as AUX_DATA messages (no RDMA pairs).
	auxTCP bool

	prepped *preppedPeer
}

// kvPlanner is what NIXLKV and MORIKV have in common.
type kvPlanner interface {
	Plan(p *planner.Plan, prefillPages, decodePages []int32) error
	Regions() (src, dst []planner.Region)
	Path() string
}

// kvIndexer is NIXLKV's prepped side: the prepared lists once per peer,
// indices into them per chunk.
type kvIndexer interface {
	Prepped() (*planner.PreppedKV, error)
	Indices(pk *planner.PreppedKV, part int, srcIdx, dstIdx []int32, prefillPages, decodePages []int32) ([]int32, []int32, error)
}

// preppedPeer holds the prepared descriptor lists of one decode peer
// (SGLang NIXL's prep_handles), one pair per memory-kind part.
type preppedPeer struct {
	pk    *planner.PreppedKV
	src   []*plugin.DList // shared with other peers when pk.SrcShared
	dst   []*plugin.DList
	notif []string // part notification suffixes
}

// kvhostExt marks the frames kvhost appends to SGLang NIXL's registration:
// the byte lengths of the aux and state buffers, which SGLang's layout does
// not carry. SGLang ignores frames past the ones it knows; a kvhost prefill
// uses them to bound the decode's aux and state regions exactly.
const kvhostExt = "kvhost.lens.v1"

// maxRemoteRegions bounds the regions one registration may ask us to import.
const maxRemoteRegions = 1 << 16

// addPeer registers the decode rank build makes. name is the agent (engine)
// name the registration claims: a registration claiming a registered name
// is ignored before anything is loaded, and build loads the peer's
// metadata only if it names an agent not loaded yet (LoadNewRemote), so a
// registration that is refused or ignored leaves every registered peer as
// it was.
func (m *Prefill) addPeer(build func() (*peer, error), name string) {
	start := m.clock.Now()
	m.mu.Lock()
	if name != "" {
		if _, ok := m.peers[name]; ok {
			m.mu.Unlock()
			m.log.Info("peer already registered, ignoring", "peer", name)
			return
		}
	}
	if len(m.peers) >= m.set.MaxPeers {
		m.mu.Unlock()
		m.drops.drop("registration", fmt.Errorf("peer limit %d reached", m.set.MaxPeers))
		return
	}
	m.mu.Unlock()
	p, err := build()
	if p == nil && err == nil {
		return // already registered
	}
	ev := HandshakeEvent{Role: RolePrefill, Kind: HandshakePeer, Peer: name, Latency: m.clock.Since(start), Err: err}
	if p != nil {
		ev.Peer = p.name
	}
	m.obs.Handshake(ev)
	if err != nil {
		m.log.Warn("decode registration rejected", "peer", ev.Peer, "err", err)
		if ev.Peer != "" {
			m.mu.Lock()
			if len(m.peerErr) >= 1024 {
				clear(m.peerErr)
			}
			m.peerErr[ev.Peer] = err.Error()
			m.mu.Unlock()
		}
		return
	}
	m.mu.Lock()
	if _, dup := m.peers[p.name]; dup {
		m.mu.Unlock()
		m.releasePeer(p)
		return
	}
	m.peers[p.name] = p
	delete(m.peerErr, p.name)
	m.mu.Unlock()
	m.log.Info("decode rank registered", "peer", p.name, "endpoint", p.endpoint,
		"decode_tp", fmt.Sprintf("%d/%d", p.tpRank, p.tpSize), "path", p.kv.Path(), "took", ev.Latency)
}

// releasePeer releases the handles of a peer that lost a registration race.
func (m *Prefill) releasePeer(p *peer) {
	if p.prepped != nil {
		for _, d := range p.prepped.dst {
			d.Close()
		}
	}
	for _, r := range p.kvRemote {
		r.Close()
	}
	for _, r := range p.auxRemote {
		r.Close()
	}
	for _, c := range p.stateRemote {
		for _, r := range c {
			r.Close()
		}
	}
}

// peerMissing explains why a transfer info names no usable peer.
func (m *Prefill) peerMissing(name string) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	if e, ok := m.peerErr[name]; ok {
		return fmt.Sprintf("Peer info missing for engine %s: its registration was rejected: %s", name, e)
	}
	return fmt.Sprintf("Peer info missing for engine %s", name)
}

func (m *Prefill) devID(kind abi.MemKind, gpu int) uint64 {
	if kind == abi.VRAM && gpu > 0 {
		return uint64(gpu)
	}
	return 0
}

// nixlPeer builds a peer from SGLang NIXL's registration: decode's agent
// metadata is loaded, and its KV, aux and state buffers are imported by
// address, each exactly the range the registration declares.
func (m *Prefill) nixlPeer(r *sglang.NIXLRegistration, frames [][]byte) (p *peer, err error) {
	// Only metadata of an agent that is not loaded: metadata naming a
	// registered decode agent is refused and leaves it as it was. From here
	// on name is this registration's own, so removing it on failure touches
	// nobody else.
	name, err := m.agent.LoadNewRemote(r.AgentMetadata)
	if err != nil {
		return nil, fmt.Errorf("load agent metadata of %s: %w", r.AgentName, err)
	}
	if name != r.AgentName {
		m.agent.RemoveRemote(name)
		return nil, fmt.Errorf("agent metadata names %q, registration names %q", name, r.AgentName)
	}
	p = &peer{name: name, endpoint: tcpEndpoint(r.Endpoint, r.Port), tpSize: r.DecodeTPSize, tpRank: r.DecodeTPRank}
	defer func() {
		if err != nil {
			m.releasePeer(p)
			m.agent.RemoveRemote(name)
			p = &peer{name: name} // for the error report only
		}
	}()
	if !m.agent.Caps().Has(abi.CapRemoteAddr) && !m.agent.Emulated().Has(abi.CapRemoteAddr) {
		return p, errors.New("the plugin agent cannot import remote regions by address, which the NIXL variant needs")
	}
	if len(r.KVPtrs)+len(r.AuxPtrs) > maxRemoteRegions {
		return p, fmt.Errorf("%d KV and %d aux regions", len(r.KVPtrs), len(r.AuxPtrs))
	}
	auxLens, stateLens, err := nixlExtLens(frames)
	if err != nil {
		return p, err
	}

	numPages := r.NumSlots
	if numPages == 0 {
		numPages = m.srcKV.NumPages // SGLang's disaggregation/{nixl,mori}/conn.py's default
	}
	dst := planner.KVSide{TPSize: r.DecodeTPSize, TPRank: r.DecodeTPRank, NumPages: numPages}
	for i, ptr := range r.KVPtrs {
		kind := abi.VRAM
		if i < len(r.KVMemKinds) && r.KVMemKinds[i] == sglang.DRAM {
			kind = abi.DRAM
		}
		item := r.KVItemLens[i]
		if item == 0 || numPages > ^uint64(0)/item {
			return p, fmt.Errorf("KV region %d: item len %d x %d pages", i, item, numPages)
		}
		rr, err := m.agent.ImportRange(name, ptr, item*numPages, m.devID(kind, r.GPUID), kind)
		if err != nil {
			return p, fmt.Errorf("import KV region %d: %w", i, err)
		}
		p.kvRemote = append(p.kvRemote, rr)
		dst.Ptrs = append(dst.Ptrs, ptr)
		dst.ItemLens = append(dst.ItemLens, item)
		dst.Kinds = append(dst.Kinds, memkind.ToPlanner(kind))
	}
	g := planner.SGLangKV{MLA: m.cfg.MLA, PageSize: m.cfg.KV.PageSize, TotalKVHeads: m.cfg.KV.TotalKVHeads, Prefill: m.srcKV, Decode: dst}
	nk, err := planner.NewNIXLKV(g, true)
	if err != nil {
		return p, fmt.Errorf("KV geometry: %w", err)
	}
	p.kv, p.nixl = nk, nk

	// Aux: SGLang's layout has pointers only. With kvhost's extension
	// frames the decode's aux regions are imported as long as they say and
	// every slot is checked against them. Without them (an SGLang decode,
	// whose aux buffers hold as many slots as its own server sized them
	// for, fewer or more than ours) the lengths stay unknown, as in
	// SGLang's prefill, which writes at ptr + item_len * index: each room
	// imports just the slot it writes, and the plugin refuses a slot
	// outside the memory the peer registered.
	dstAux := planner.AuxBuffers{Ptrs: r.AuxPtrs, DataLens: auxLens}
	if len(r.AuxPtrs) > 0 {
		if p.aux, err = planner.NewAuxPlannerNIXL(m.srcAux, dstAux); err != nil {
			return p, fmt.Errorf("aux geometry: %w", err)
		}
		p.auxBySlot = auxLens == nil
		for i, ptr := range r.AuxPtrs {
			if p.auxBySlot {
				break // imported slot by slot, see worker.auxRemote
			}
			if dstAux.DataLens[i] == 0 {
				return p, fmt.Errorf("aux buffer %d: length 0", i)
			}
			rr, err := m.agent.ImportRange(name, ptr, dstAux.DataLens[i], 0, abi.DRAM)
			if err != nil {
				return p, fmt.Errorf("import aux region %d: %w", i, err)
			}
			p.auxRemote = append(p.auxRemote, rr)
		}
	}
	if err := m.nixlState(p, r, stateLens); err != nil {
		return p, err
	}
	if err := m.checkPeerTables(p); err != nil {
		return p, err
	}
	if m.xfer == XferPrepped {
		if err := m.prepPeer(p); err != nil {
			if m.cfg.XferMode != XferAuto || !errors.Is(err, errNoPreppedLists) {
				return p, err
			}
			// XferAuto: a geometry SGLang's nixl/conn.py posts without prepped
			// lists (or whose lists NIXL would reject) gets strided
			// batch transfers instead (p.prepped stays nil).
			m.log.Info("decode rank gets batch transfers", "peer", p.name, "reason", err)
		}
	}
	return p, nil
}

func (m *Prefill) nixlState(p *peer, r *sglang.NIXLRegistration, lens [][]uint64) error {
	if len(m.stateTypes) == 0 || len(r.StatePtrs) == 0 {
		return nil
	}
	dst := planner.StateBuffers{Ptrs: r.StatePtrs}
	for c, ptrs := range r.StatePtrs {
		var dl []uint64
		for t := range ptrs {
			switch {
			case c < len(lens) && t < len(lens[c]):
				dl = append(dl, lens[c][t])
			case c < len(m.srcState.DataLens) && t < len(m.srcState.DataLens[c]):
				dl = append(dl, m.srcState.DataLens[c][t]) // SGLang decode: assume ours
			default:
				dl = append(dl, 0)
			}
		}
		dst.ItemLens = append(dst.ItemLens, peerItemLens(r.StateItemLens, c, len(ptrs)))
		dst.DataLens = append(dst.DataLens, dl)
		dst.DimPerTensor = append(dst.DimPerTensor, peerDims(r.StateDimPerTensor, c))
	}
	sp, err := planner.NewStatePlannerNIXL(m.stateTypes, m.srcState, dst, m.stateTopology(r.DecodeTPSize, r.DecodeTPRank))
	if err != nil {
		return fmt.Errorf("state geometry: %w", err)
	}
	p.state = sp
	for c, ptrs := range r.StatePtrs {
		var comp []*plugin.RemoteRegion
		for t, ptr := range ptrs {
			n := dst.DataLens[c][t]
			if n == 0 || ptr == 0 {
				comp = append(comp, nil)
				continue
			}
			rr, err := m.agent.ImportRange(p.name, ptr, n, m.devID(abi.VRAM, r.GPUID), abi.VRAM)
			if err != nil {
				return fmt.Errorf("import state region %d.%d: %w", c, t, err)
			}
			comp = append(comp, rr)
		}
		p.stateRemote = append(p.stateRemote, comp)
	}
	return nil
}

func (m *Prefill) stateTopology(decodeTP, decodeRank int) planner.StateTopology {
	par := m.cfg.Parallel
	return planner.StateTopology{
		PrefillTPSize: par.TPSize, PrefillTPRank: par.TPRank, PrefillPPSize: par.PPSize,
		PP: planner.PPLayout{StartLayer: m.cfg.KV.StartLayer}, MLA: m.cfg.MLA,
		DecodeTPSize: decodeTP, DecodeTPRank: decodeRank,
	}
}

// nixlExtLens reads kvhost's extension frames of a NIXL registration
// (guard included in frames): aux lengths (not nil when the frames are
// there) and state lengths; nil, nil without them (an SGLang decode).
// Malformed frames are an error: a decode that sends them gets the strict
// check or none.
func nixlExtLens(frames [][]byte) (aux []uint64, state [][]uint64, err error) {
	const at = 20 // guard + the 19 frames SGLang sends
	if len(frames) < at+1 || string(frames[at]) != kvhostExt {
		return nil, nil, nil
	}
	if len(frames) < at+3 {
		return nil, nil, fmt.Errorf("%s: %d frames, want 3", kvhostExt, len(frames)-at)
	}
	b := frames[at+1]
	if len(b)%8 != 0 {
		return nil, nil, fmt.Errorf("%s: aux lengths frame of %d bytes", kvhostExt, len(b))
	}
	aux = make([]uint64, 0, len(b)/8)
	for i := 0; i < len(b); i += 8 {
		aux = append(aux, binary.LittleEndian.Uint64(b[i:]))
	}
	if state, err = sglang.UnpackUint64Lists(frames[at+2]); err != nil {
		return nil, nil, fmt.Errorf("%s: state lengths: %w", kvhostExt, err)
	}
	return aux, state, nil
}

// nixlExtFrames builds kvhost's extension frames for a NIXL registration.
func nixlExtFrames(a *KVArgs) [][]byte {
	var aux []byte
	for _, b := range a.Aux {
		aux = binary.LittleEndian.AppendUint64(aux, uint64(len(b.Mem)))
	}
	var state [][]uint64
	for _, c := range a.State {
		var l []uint64
		for _, t := range c.Tensors {
			l = append(l, t.Len)
		}
		state = append(state, l)
	}
	return [][]byte{[]byte(kvhostExt), aux, sglang.PackUint64Lists(state)}
}

// moriPeer builds a peer from SGLang MORI's registration: the engine
// descriptor is the plugin's metadata and every memory descriptor a region
// blob the plugin exported, imported as is.
func (m *Prefill) moriPeer(r *sglang.MORIRegistration) (p *peer, err error) {
	// addPeer ignored a registration whose engine key is registered before
	// anything was loaded; LoadNewRemote refuses a descriptor naming a
	// loaded engine under another key, leaving that engine as it was.
	key, kerr := r.EngineKey()
	if kerr != nil {
		return nil, fmt.Errorf("engine descriptor: %w", kerr)
	}
	name, err := m.agent.LoadNewRemote(sglang.UnwrapEngineDesc(r.EngineDesc))
	if err != nil {
		return nil, fmt.Errorf("load engine descriptor of %s: %w", key, err)
	}
	p = &peer{name: name, endpoint: tcpEndpoint(r.Endpoint, r.Port), tpSize: r.DecodeTPSize, tpRank: r.DecodeTPRank}
	defer func() {
		if err != nil {
			m.releasePeer(p)
			m.agent.RemoveRemote(name)
			p = &peer{name: name} // for the error report only
		}
	}()
	if key != name {
		return p, fmt.Errorf("engine descriptor names %q, the plugin loaded %q", key, name)
	}
	if !m.agent.Caps().Has(abi.CapRemoteBlob) {
		return p, errors.New("the plugin agent cannot import exported regions, which the MORI variant needs")
	}
	n := len(r.KVMemDescs) + len(r.AuxMemDescs)
	for _, c := range r.StateMemDescs {
		n += len(c)
	}
	if n > maxRemoteRegions {
		return p, fmt.Errorf("%d memory descriptors", n)
	}
	if r.KVItemLen == 0 {
		return p, errors.New("KV item len 0")
	}
	dst := planner.KVSide{TPSize: r.DecodeTPSize, TPRank: r.DecodeTPRank}
	for i, blob := range r.KVMemDescs {
		rr, err := m.agent.ImportRegion(name, blob)
		if err != nil {
			return p, fmt.Errorf("import KV region %d: %w", i, err)
		}
		p.kvRemote = append(p.kvRemote, rr)
		pages := rr.Len() / r.KVItemLen
		if i == 0 {
			dst.NumPages = pages
		} else if pages != dst.NumPages {
			return p, fmt.Errorf("KV region %d holds %d pages, region 0 holds %d", i, pages, dst.NumPages)
		}
		dst.Ptrs = append(dst.Ptrs, rr.Addr())
		dst.ItemLens = append(dst.ItemLens, r.KVItemLen)
		dst.Kinds = append(dst.Kinds, memkind.ToPlanner(rr.Kind()))
	}
	g := planner.SGLangKV{MLA: m.cfg.MLA, PageSize: m.cfg.KV.PageSize, TotalKVHeads: m.cfg.KV.TotalKVHeads, Prefill: m.srcKV, Decode: dst}
	if p.kv, err = planner.NewMORIKV(g); err != nil {
		return p, fmt.Errorf("KV geometry: %w", err)
	}
	var dstAux planner.AuxBuffers
	for i, blob := range r.AuxMemDescs {
		rr, err := m.agent.ImportRegion(name, blob)
		if err != nil {
			return p, fmt.Errorf("import aux region %d: %w", i, err)
		}
		p.auxRemote = append(p.auxRemote, rr)
		dstAux.Ptrs = append(dstAux.Ptrs, rr.Addr())
		dstAux.DataLens = append(dstAux.DataLens, rr.Len())
	}
	if len(m.srcAux.Ptrs) > 0 {
		if p.aux, err = planner.NewAuxPlannerMORI(m.srcAux, dstAux); err != nil {
			return p, fmt.Errorf("aux geometry: %w", err)
		}
		// SGLang MORI sends aux over ZeroMQ unless SGLANG_MORI_SEND_AUX_RDMA
		// is set and both sides have the same aux buffers.
		var probe planner.Plan
		p.auxTCP = !m.set.MORIAuxRDMA
		if !p.auxTCP && p.aux.Plan(&probe, 0, 0) == nil && probe.Path == planner.PathMORIAuxTCP {
			p.auxTCP = true
		}
	}
	if len(m.stateTypes) > 0 && len(r.StateMemDescs) > 0 {
		dstState := planner.StateBuffers{}
		for c, comp := range r.StateMemDescs {
			var ptrs, lens []uint64
			var regs []*plugin.RemoteRegion
			for t, blob := range comp {
				rr, err := m.agent.ImportRegion(name, blob)
				if err != nil {
					return p, fmt.Errorf("import state region %d.%d: %w", c, t, err)
				}
				regs = append(regs, rr)
				ptrs = append(ptrs, rr.Addr())
				lens = append(lens, rr.Len())
			}
			p.stateRemote = append(p.stateRemote, regs)
			dstState.Ptrs = append(dstState.Ptrs, ptrs)
			dstState.DataLens = append(dstState.DataLens, lens)
			dstState.ItemLens = append(dstState.ItemLens, peerItemLens(r.StateItemLens, c, len(comp)))
			dstState.DimPerTensor = append(dstState.DimPerTensor, peerDims(r.StateDimPerTensor, c))
		}
		if p.state, err = planner.NewStatePlannerMORI(m.stateTypes, m.srcState, dstState, m.stateTopology(r.DecodeTPSize, r.DecodeTPRank)); err != nil {
			return p, fmt.Errorf("state geometry: %w", err)
		}
	}
	if err := m.checkPeerTables(p); err != nil {
		return p, err
	}
	return p, nil
}

// checkPeerTables confirms that the planners' region tables are this rank's
// registered regions and the peer's imported ones, so that validating a
// plan against its tables bounds every byte it moves.
func (m *Prefill) checkPeerTables(p *peer) error {
	src, dst := p.kv.Regions()
	if err := sameTables(src, m.regs.kv, dst, p.kvRemote); err != nil {
		return fmt.Errorf("KV: %w", err)
	}
	return nil
}

func sameTables(src []planner.Region, local []*plugin.Region, dst []planner.Region, remote []*plugin.RemoteRegion) error {
	if len(src) != len(local) || len(dst) != len(remote) {
		return fmt.Errorf("planner tables (%d, %d regions) differ from the registered ones (%d, %d)", len(src), len(dst), len(local), len(remote))
	}
	for i, r := range src {
		if r.Addr != local[i].Addr() || r.Len > local[i].Len() {
			return fmt.Errorf("planner source region %d [%#x, +%d) is not registered region [%#x, +%d)", i, r.Addr, r.Len, local[i].Addr(), local[i].Len())
		}
	}
	for i, r := range dst {
		if remote[i] == nil || r.Addr != remote[i].Addr() || r.Len > remote[i].Len() {
			return fmt.Errorf("planner destination region %d [%#x, +%d) is not the peer's imported region", i, r.Addr, r.Len)
		}
	}
	return nil
}

// errNoPreppedLists: the peer's geometry has no prepared lists NIXL would
// take (SGLang's disaggregation/nixl/conn.py posts it without them, or its lists would be
// rejected); with XferAuto the peer gets batch transfers instead.
var errNoPreppedLists = errors.New("prepared lists")

// prepPeer builds SGLang's disaggregation/nixl/conn.py's prepared lists for a NIXL peer: the
// source lists once per distinct list (shared by peers, as SGLang shares
// them), the destination lists per peer.
func (m *Prefill) prepPeer(p *peer) error {
	pk, err := p.nixl.Prepped()
	if err != nil {
		return fmt.Errorf("%w: %w", errNoPreppedLists, err)
	}
	for i := range pk.Parts {
		part := &pk.Parts[i]
		if err := part.Src.Validate(); err != nil {
			return fmt.Errorf("%w: source list %d: %w", errNoPreppedLists, i, err)
		}
		if err := part.Dst.Validate(); err != nil {
			return fmt.Errorf("%w: destination list %d: %w", errNoPreppedLists, i, err)
		}
	}
	pp := &preppedPeer{pk: pk}
	p.prepped = pp
	for i := range pk.Parts {
		part := &pk.Parts[i]
		key := dlistKey(&part.Src)
		m.mu.Lock()
		src := m.srcLists[key]
		m.mu.Unlock()
		if src == nil {
			descs := expandDlist(&part.Src, uint64(m.cfg.KV.GPUID))
			if src, err = m.agent.PrepLocal(memkind.ToABI(part.Src.Kind), descs); err != nil {
				return fmt.Errorf("prepare source list %d: %w", i, err)
			}
			m.mu.Lock()
			if old := m.srcLists[key]; old != nil {
				m.mu.Unlock()
				src.Close()
				src = old
			} else {
				m.srcLists[key] = src
				m.mu.Unlock()
			}
		}
		pp.src = append(pp.src, src)
		descs := expandDlist(&part.Dst, 0)
		dst, err := m.agent.PrepRemote(p.name, memkind.ToABI(part.Dst.Kind), descs)
		if err != nil {
			return fmt.Errorf("prepare destination list %d: %w", i, err)
		}
		pp.dst = append(pp.dst, dst)
		suffix := ""
		if len(pk.Parts) > 1 {
			suffix = planner.PartNotifSuffix(i, len(pk.Parts))
		}
		pp.notif = append(pp.notif, suffix)
	}
	return nil
}

func dlistKey(d *planner.Dlist) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d", d.Kind)
	for _, x := range d.Blocks {
		fmt.Fprintf(&b, "|%d,%d,%d,%d,%d,%d,%d,%d,%d", x.Region, x.Off, x.Slots, x.Tokens, x.Groups, x.SlotStride, x.TokenStride, x.GroupStride, x.Len)
	}
	for _, r := range d.Regions {
		fmt.Fprintf(&b, "|%x+%d", r.Addr, r.Len)
	}
	return b.String()
}

func expandDlist(d *planner.Dlist, dev uint64) []abi.XferDesc {
	out := make([]abi.XferDesc, 0, d.Len())
	d.ForEach(func(addr, length uint64) bool {
		out = append(out, abi.XferDesc{Addr: addr, Len: length, Count: 1, DevID: dev})
		return true
	})
	return out
}

// peerItemLens returns the item lengths a decode rank sent for the first n
// tensors of state component c (as many as it sent, nil for none).
func peerItemLens(lists [][]uint32, c, n int) []uint64 {
	if c >= len(lists) {
		return nil
	}
	var out []uint64
	for _, l := range lists[c][:min(n, len(lists[c]))] {
		out = append(out, uint64(l))
	}
	return out
}

// peerDims returns the dims per tensor a decode rank sent for state
// component c (nil if none).
func peerDims(lists [][]uint32, c int) []int {
	if c >= len(lists) {
		return nil
	}
	var out []int
	for _, d := range lists[c] {
		out = append(out, int(d))
	}
	return out
}
