package push

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/internal/backoff"
	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/memfault"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/sglang"
	"github.com/kvhost/kvhost/planner"
)

// DecodeConfig configures one decode rank.
type DecodeConfig struct {
	// Plugin, AgentName and AgentParams as in PrefillConfig; the agent
	// gets the host's defaults for a target (plugin.ForSide: it is
	// written to).
	Plugin      *plugin.Plugin
	AgentName   string
	AgentParams []plugin.Param

	Variant Variant
	// Completion: CompletionAuto accepts both notifications and status
	// messages (whatever the prefill uses), per prefill rank: once a rank's
	// notification agent is known, its Success statuses are refused; the
	// others accept only theirs. Either way only from the room's prefill
	// ranks (see the package doc, "Who may complete a room").
	Completion Completion

	KV       KVArgs
	Parallel Parallel
	MLA      bool
	// KVCacheDType must match the prefill's (default "auto").
	KVCacheDType string

	// Host is the IP the PULL socket binds to and advertises to prefill
	// (default 127.0.0.1); Port 0 picks a free port.
	Host string
	Port int

	Settings Settings
	Observer Observer
	Logger   *slog.Logger
	// Transport carries the control messages; nil means ZMQ{} (what
	// SGLang peers speak).
	Transport Transport
	// Clock times every timeout, heartbeat and latency; nil means the
	// wall clock.
	Clock clock.Clock
}

// Decode is one decode rank's transfer manager (SGLang's KVManager in
// DECODE mode). Safe for concurrent use.
type Decode struct {
	rank
	cfg DecodeConfig

	useNote bool     // track notifications
	useStat bool     // track status messages
	reg     [][]byte // registration message, built once

	mu        sync.Mutex
	prefills  map[string]*prefillInfo // by bootstrap address
	conns     map[string][]target     // connection pool: targets registered with
	recvs     map[uint64]*Receiver
	addrRooms map[string]map[uint64]struct{}
	// dead holds bootstrap addresses the heartbeat declared dead: a new
	// room for one fails at once unless the server answers again.
	dead    map[string]bool
	waiting int // receivers waiting for notifications
	// agents and agentOf tie notification senders to prefill ranks: the
	// agent that sends the notifications of the prefill rank at an
	// endpoint (a rank's PULL socket), and the endpoint of each such
	// agent. One agent per rank and one rank per agent, learned from the
	// first notification that names one of an open room's prefill ranks
	// (see senderSlot), forgotten with the rank's registration.
	agents  map[string]*senderAgent // by agent name
	agentOf map[string]string       // endpoint -> agent name
	initMu  sync.Mutex

	// unsubNotifs ends the notification subscription (nil without one).
	unsubNotifs func()
}

// prefillInfo is one prefill deployment as seen from this decode rank.
type prefillInfo struct {
	client   BootstrapClient
	info     bootstrap.ParallelInfo
	mapping  planner.RankMapping
	failures int // consecutive failed heartbeats
}

// target is one prefill rank a room's metadata goes to.
type target struct {
	planner.BootstrapTarget
	endpoint string // its PULL socket
	unique   int    // its prefill_unique_rank
	src      sources
}

// sources is where a prefill rank's messages may come from: the addresses
// of its rank_ip, and, for a rank on this host, the addresses any process
// of this host may use as well (see sourcesOf).
type sources struct {
	ips      []net.IP
	loopback bool // any loopback address too
}

// sentFrom says whether a message that came on a connection from addr
// comes from this prefill rank's host.
func (t *target) sentFrom(addr net.Addr) bool {
	ta, ok := addr.(*net.TCPAddr)
	if !ok {
		return false
	}
	for _, ip := range t.src.ips {
		if ip.Equal(ta.IP) {
			return true
		}
	}
	return t.src.loopback && ta.IP.IsLoopback()
}

// sourcesOf returns where messages of a prefill rank whose rank_ip has the
// addresses rankIPs may come from, given this host's own (non-loopback)
// addresses. Another host's rank: its addresses only. A rank on this host
// connects to a decode on 127.0.0.1 from a loopback address, and to one on
// a host address from that address, whatever rank_ip it advertises; since
// any local process can use any of those, accepting them all for a local
// rank costs nothing. A rank whose rank_ip is a loopback address is
// local, and accepts this host's addresses, but not other loopback
// addresses: on one machine, 127.0.0.2 stands for another host.
func sourcesOf(rankIPs, hostIPs []net.IP) sources {
	s := sources{ips: slices.Clone(rankIPs)}
	for _, ip := range rankIPs {
		switch {
		case ip.IsLoopback():
			s.ips = append(s.ips, hostIPs...)
		case slices.ContainsFunc(hostIPs, ip.Equal):
			s.loopback = true
		}
	}
	return s
}

// hostIPs returns this host's non-loopback interface addresses.
func hostIPs() []net.IP {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	var out []net.IP
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && !n.IP.IsLoopback() {
			out = append(out, n.IP)
		}
	}
	return out
}

// senderAgent is the agent known to send a prefill rank's notifications.
type senderAgent struct {
	endpoint string // the rank's PULL socket
	rank     int    // the rank its tags name (-1: none seen yet)
}

// NewDecode starts a decode rank: agent and buffers registered, PULL socket
// bound (status and aux messages), heartbeat, timeouts and the notification
// loop running.
func NewDecode(ctx context.Context, cfg DecodeConfig) (*Decode, error) {
	if err := checkConfig(&cfg.Parallel, &cfg.KV, cfg.MLA, cfg.Plugin, &cfg.Host, &cfg.KVCacheDType); err != nil {
		return nil, err
	}
	d := &Decode{
		cfg:      cfg,
		prefills: make(map[string]*prefillInfo), conns: make(map[string][]target),
		recvs: make(map[uint64]*Receiver), addrRooms: make(map[string]map[uint64]struct{}), dead: make(map[string]bool),
		agents: make(map[string]*senderAgent), agentOf: make(map[string]string),
	}
	if err := d.open(rankSetup{role: RoleDecode, plugin: cfg.Plugin, agentName: cfg.AgentName, agentParams: cfg.AgentParams,
		parallel: cfg.Parallel, settings: cfg.Settings, observer: cfg.Observer, logger: cfg.Logger,
		transport: cfg.Transport, clock: cfg.Clock}); err != nil {
		return nil, err
	}
	fail := func(err error) (*Decode, error) {
		d.shutdown()
		return nil, err
	}
	hasNotif := d.agent.Caps().Has(abi.CapNotif)
	switch cfg.Completion {
	case CompletionAuto:
		d.useNote, d.useStat = hasNotif && cfg.Variant == VariantNIXL, true
	case CompletionNotif:
		if !hasNotif || cfg.Variant == VariantMORI {
			return fail(errors.New("push: completion by notification needs the NIXL variant and a plugin agent with notifications"))
		}
		d.useNote = true
	case CompletionStatus:
		d.useStat = true
	}
	// SGLang's decode PUSH sockets: SNDTIMEO 30 s (the zmq default here).
	if err := d.listen(&cfg.KV, cfg.Host, cfg.Port, 0); err != nil {
		return fail(err)
	}
	var err error
	if d.reg, err = d.registration(); err != nil {
		return fail(err)
	}
	d.goServeFrom(d.handle)
	d.goEvery(d.set.HeartbeatInterval, d.heartbeat)
	d.goEvery(sweepPeriod(d.set.WaitingTimeout), d.janitor)
	if d.useNote {
		unsub, err := d.agent.Engine().Subscribe(d.handleNotifs)
		if err != nil {
			return fail(err)
		}
		d.unsubNotifs = unsub
	}
	d.log.Info("decode rank ready", "agent", d.agent.Name(), "endpoint", d.pull.Endpoint(),
		"variant", cfg.Variant, "notifications", d.useNote)
	return d, nil
}

// Close stops the manager; open receivers report Failed. The agent is
// destroyed, releasing every plugin handle.
func (d *Decode) Close() error {
	if !d.closed.CompareAndSwap(false, true) {
		return nil
	}
	d.mu.Lock()
	open := slices.Collect(maps.Keys(d.recvs))
	d.mu.Unlock()
	for _, r := range open {
		d.rooms.Fail(r, "decode rank closed")
	}
	if d.unsubNotifs != nil {
		d.unsubNotifs()
	}
	return d.shutdown()
}

// registration builds the message that registers this rank's buffers with
// a prefill rank (room "None"), once.
func (d *Decode) registration() ([][]byte, error) {
	a := &d.cfg.KV
	md, err := d.agent.LocalMetadata()
	if err != nil {
		return nil, fmt.Errorf("push: agent metadata: %w", err)
	}
	n, _ := a.numPages()
	if d.cfg.Variant == VariantMORI {
		reg := &sglang.MORIRegistration{
			Endpoint: d.cfg.Host, Port: d.pull.Port(), EngineDesc: sglang.WrapEngineDesc(md, d.agent.Name(), a.GPUID),
			GPUID: a.GPUID, DecodeTPSize: d.cfg.Parallel.TPSize, DecodeTPRank: d.cfg.Parallel.TPRank,
			KVItemLen: a.KV[0].ItemLen,
		}
		export := func(rs []*plugin.Region) ([][]byte, error) {
			var out [][]byte
			for _, r := range rs {
				b, err := r.Export()
				if err != nil {
					return nil, fmt.Errorf("push: export region: %w", err)
				}
				out = append(out, b)
			}
			return out, nil
		}
		if reg.KVMemDescs, err = export(d.regs.kv); err != nil {
			return nil, err
		}
		if reg.AuxMemDescs, err = export(d.regs.aux); err != nil {
			return nil, err
		}
		for i, c := range d.regs.state {
			blobs, err := export(c)
			if err != nil {
				return nil, err
			}
			reg.StateMemDescs = append(reg.StateMemDescs, blobs)
			reg.StateItemLens = append(reg.StateItemLens, stateItemLens(a.State[i]))
			reg.StateDimPerTensor = append(reg.StateDimPerTensor, stateDims(a.State[i]))
		}
		return reg.Frames()
	}
	reg := &sglang.NIXLRegistration{
		Endpoint: d.cfg.Host, Port: d.pull.Port(), AgentName: d.agent.Name(), AgentMetadata: md,
		GPUID: a.GPUID, DecodeTPSize: d.cfg.Parallel.TPSize, DecodeTPRank: d.cfg.Parallel.TPRank,
		KVItemLen: a.KV[0].ItemLen, NumSlots: n,
	}
	for _, b := range a.KV {
		reg.KVPtrs = append(reg.KVPtrs, b.Addr)
		reg.KVItemLens = append(reg.KVItemLens, b.ItemLen)
		kind := sglang.VRAM
		if b.Kind == abi.DRAM {
			kind = sglang.DRAM
		}
		reg.KVMemKinds = append(reg.KVMemKinds, kind)
	}
	for _, b := range a.Aux {
		reg.AuxPtrs = append(reg.AuxPtrs, b.addr())
	}
	for _, c := range a.State {
		var ptrs []uint64
		for _, t := range c.Tensors {
			ptrs = append(ptrs, t.Addr)
		}
		reg.StatePtrs = append(reg.StatePtrs, ptrs)
		reg.StateItemLens = append(reg.StateItemLens, stateItemLens(c))
		reg.StateDimPerTensor = append(reg.StateDimPerTensor, stateDims(c))
	}
	frames, err := reg.Frames()
	if err != nil {
		return nil, err
	}
	return append(frames, nixlExtFrames(a)...), nil
}

func stateItemLens(c StateComponent) []uint32 {
	var out []uint32
	for _, t := range c.Tensors {
		out = append(out, uint32(t.ItemLen))
	}
	return out
}

func stateDims(c StateComponent) []uint32 {
	var out []uint32
	for _, d := range c.DimPerTensor {
		out = append(out, uint32(d))
	}
	return out
}

// parallelInfo returns the prefill deployment's layout and this rank's
// mapping onto it, asking the bootstrap server the first time
// (try_ensure_parallel_info), retrying with backoff until it answers or ctx
// ends.
func (d *Decode) parallelInfo(ctx context.Context, addr string) (*prefillInfo, error) {
	d.mu.Lock()
	pi := d.prefills[addr]
	d.mu.Unlock()
	if pi != nil {
		return pi, nil
	}
	c := d.tr.Bootstrap(addr)
	start := d.clock.Now()
	retry := backoff.New(20*time.Millisecond, time.Second)
	var info bootstrap.ParallelInfo
	for {
		var err error
		info, err = c.ParallelInfo(ctx)
		if err == nil {
			break
		}
		d.mu.Lock()
		dead := d.dead[addr]
		d.mu.Unlock()
		if dead {
			//lint:ignore ST1005 SGLang's own message, kept verbatim
			return nil, fmt.Errorf("Lost connection with prefill instance (bootstrap_addr: %s): %w", addr, err)
		}
		// Like SGLang's scheduler, which retries try_ensure_parallel_info
		// until it succeeds: the server may not be up (connection refused)
		// or not every prefill rank registered yet (503). ctx bounds it.
		if ctx.Err() == nil {
			select {
			case <-ctx.Done():
			case <-d.clock.After(retry.Next()):
			}
		}
		if ctx.Err() != nil {
			d.obs.Handshake(HandshakeEvent{Role: RoleDecode, Kind: HandshakeParallelInfo, Peer: addr, Latency: d.clock.Since(start), Err: err})
			return nil, fmt.Errorf("prefill parallel info from %s: %w (last: %v)", addr, ctx.Err(), err)
		}
	}
	d.obs.Handshake(HandshakeEvent{Role: RoleDecode, Kind: HandshakeParallelInfo, Peer: addr, Latency: d.clock.Since(start)})
	if info.PageSize != nil && *info.PageSize != d.cfg.KV.PageSize {
		//lint:ignore ST1005 SGLang's own message, kept verbatim
		return nil, fmt.Errorf("Page size mismatch: prefill server has page_size=%d, but decode server has page_size=%d", *info.PageSize, d.cfg.KV.PageSize)
	}
	if info.KVCacheDType != nil && *info.KVCacheDType != d.cfg.KVCacheDType {
		return nil, fmt.Errorf("KV cache dtype mismatch: prefill server has kv_cache_dtype=%s, but decode server has kv_cache_dtype=%s", *info.KVCacheDType, d.cfg.KVCacheDType)
	}
	p := d.cfg.Parallel
	mapping, err := planner.MapRanks(planner.RankMappingInput{
		DecodeTPSize: p.TPSize, DecodeEngineRank: p.TPRank, DecodeCPSize: p.CPSize, DecodeCPRank: p.CPRank,
		DecodePPSize: p.PPSize, DecodePPRank: p.PPRank,
		PrefillTPSize: info.AttnTPSize, PrefillCPSize: info.AttnCPSize, PrefillPPSize: info.PPSize,
		MLA: d.cfg.MLA, PrefillDSACacheLayerSplit: info.EnableDSACacheLayerSplit,
	})
	if err != nil {
		return nil, fmt.Errorf("rank mapping onto prefill %s: %w", addr, err)
	}
	pi = &prefillInfo{client: c, info: info, mapping: mapping}
	d.mu.Lock()
	delete(d.dead, addr)
	if old := d.prefills[addr]; old != nil {
		pi = old
	} else {
		d.prefills[addr] = pi
	}
	d.mu.Unlock()
	return pi, nil
}

// targets resolves (once per prefill DP rank) where the prefill ranks of
// the mapping listen, and registers this rank's buffers with each of them.
func (d *Decode) targets(ctx context.Context, addr string, pi *prefillInfo, dpRank int) ([]target, error) {
	key := fmt.Sprintf("%s_%d", addr, dpRank)
	d.mu.Lock()
	ts, ok := d.conns[key]
	d.mu.Unlock()
	if ok {
		return ts, nil
	}
	d.initMu.Lock()
	defer d.initMu.Unlock()
	d.mu.Lock()
	ts, ok = d.conns[key]
	d.mu.Unlock()
	if ok {
		return ts, nil
	}
	info := pi.info
	local := hostIPs()
	for _, bt := range pi.mapping.Targets(d.cfg.MLA) {
		start := d.clock.Now()
		ri, err := pi.client.Route(ctx, dpRank, bt.CPRank, bt.TPRank, bt.PPRank)
		d.obs.Handshake(HandshakeEvent{Role: RoleDecode, Kind: HandshakeRoute, Peer: addr, Latency: d.clock.Since(start), Err: err})
		if err != nil {
			//lint:ignore ST1005 SGLang's own message, kept verbatim
			return nil, fmt.Errorf("Could not fetch bootstrap info for: prefill_dp_rank: %d prefill_cp_rank: %d target_tp_rank: %d and target_pp_rank %d: %w", dpRank, bt.CPRank, bt.TPRank, bt.PPRank, err)
		}
		ips, err := resolveIPs(ctx, ri.RankIP)
		if err != nil {
			return nil, fmt.Errorf("prefill rank (prefill_dp_rank: %d prefill_cp_rank: %d target_tp_rank: %d target_pp_rank %d) at %q: %w", dpRank, bt.CPRank, bt.TPRank, bt.PPRank, ri.RankIP, err)
		}
		ts = append(ts, target{
			BootstrapTarget: bt,
			endpoint:        tcpEndpoint(ri.RankIP, ri.RankPort),
			unique:          bt.TPRank*(info.PPSize*info.AttnCPSize) + bt.PPRank*info.AttnCPSize + bt.CPRank,
			src:             sourcesOf(ips, local),
		})
	}
	for _, t := range ts {
		if err := d.push.Send(ctx, t.endpoint, d.reg...); err != nil {
			return nil, fmt.Errorf("register with prefill rank %s: %w", t.endpoint, err)
		}
	}
	d.mu.Lock()
	d.conns[key] = ts
	d.mu.Unlock()
	return ts, nil
}

// resolveIPs returns the addresses of a prefill rank's rank_ip (an IP, or
// a host name SGLang's get_local_ip_auto would not give but a config may).
func resolveIPs(ctx context.Context, host string) ([]net.IP, error) {
	if ip := net.ParseIP(host); ip != nil {
		return []net.IP{ip}, nil
	}
	ips, err := net.DefaultResolver.LookupIP(ctx, "ip", host)
	if err != nil {
		return nil, err
	}
	return ips, nil
}

// handle takes one of prefill's status and aux messages, and the address
// of the connection it came on.
func (d *Decode) handle(frames [][]byte, from net.Addr) {
	msg, err := sglang.ParseMORIToDecode(frames)
	if err != nil {
		d.drops.drop("message", err)
		return
	}
	switch v := msg.(type) {
	case *sglang.MORIStatus:
		d.handleStatus(v, from)
	case *sglang.AuxData:
		d.handleAux(v, from)
	}
}

func (d *Decode) receiver(room uint64) *Receiver {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.recvs[room]
}

// handleStatus applies a status message: only from the host of the
// prefill rank it names, and only if that rank is one the room was sent
// to. Success also needs the rank to send the room data, and, with
// notifications tracked, a rank whose notifications are known to come
// reports by them, not by status.
func (d *Decode) handleStatus(st *sglang.MORIStatus, from net.Addr) {
	r := d.receiver(st.Room)
	if r == nil {
		d.log.Debug("status for an unknown room", "room", st.Room, "status", st.Status)
		return
	}
	t, err := r.source(st.PrefillUniqueRank, from)
	if err != nil {
		d.drops.drop("status", fmt.Errorf("room %d, status %d: %w", st.Room, st.Status, err))
		return
	}
	switch st.Status {
	case sglang.KVPollFailed:
		reason := st.Reason
		if reason == "" {
			reason = fmt.Sprintf("KV transfer failed on prefill rank %d", st.PrefillUniqueRank)
		}
		r.fail(reason, true)
	case sglang.KVPollSuccess:
		if !d.useStat {
			d.drops.drop("status", fmt.Errorf("room %d: Success status, but only notifications are accepted", st.Room))
			return
		}
		if t.Dummy {
			d.log.Debug("Success from a prefill rank that sends this room nothing", "room", st.Room, "rank", t.unique)
			return
		}
		if d.useNote {
			d.mu.Lock()
			agent := d.agentOf[t.endpoint]
			d.mu.Unlock()
			if agent != "" {
				d.drops.drop("status", fmt.Errorf("room %d: Success status for prefill rank %d, whose agent %q reports by notification", st.Room, t.unique, agent))
				return
			}
		}
		r.statusSuccess(t.unique)
	default:
		d.drops.drop("status", fmt.Errorf("room %d: unknown status code %d", st.Room, st.Status))
	}
}

// handleAux stores MORI's aux bytes into this rank's aux buffer: only from
// the host of a prefill rank that sends the room data, only into the slot
// the room asked for, only within the buffer.
func (d *Decode) handleAux(a *sglang.AuxData, from net.Addr) {
	r := d.receiver(a.Room)
	if r == nil {
		d.drops.drop("AUX_DATA", fmt.Errorf("room %d is not open", a.Room))
		return
	}
	r.mu.Lock()
	sent, want, ts := !r.sent.IsZero(), r.auxIndex, r.targets
	r.mu.Unlock()
	fromData := false
	for i := range ts {
		if !ts[i].Dummy && ts[i].sentFrom(from) {
			fromData = true
			break
		}
	}
	aux := d.cfg.KV.Aux
	switch {
	case !sent:
		d.drops.drop("AUX_DATA", fmt.Errorf("room %d: no metadata sent yet", a.Room))
		return
	case !fromData:
		d.drops.drop("AUX_DATA", fmt.Errorf("room %d: from %v, not the host of a prefill rank that sends this room data", a.Room, from))
		return
	case a.AuxIndex != want:
		d.drops.drop("AUX_DATA", fmt.Errorf("room %d: aux index %d, the room asked for %d", a.Room, a.AuxIndex, want))
		return
	case a.BufferIndex < 0 || a.BufferIndex >= len(aux):
		d.drops.drop("AUX_DATA", fmt.Errorf("room %d: aux buffer %d of %d", a.Room, a.BufferIndex, len(aux)))
		return
	}
	buf := aux[a.BufferIndex]
	off := uint64(a.AuxIndex) * buf.ItemLen
	if uint64(len(a.Data)) > buf.ItemLen || off+uint64(len(a.Data)) > uint64(len(buf.Mem)) {
		d.drops.drop("AUX_DATA", fmt.Errorf("room %d: %d bytes at slot %d of aux buffer %d (item len %d)", a.Room, len(a.Data), a.AuxIndex, a.BufferIndex, buf.ItemLen))
		return
	}
	// The engine may have shrunk its aux memory: a fault fails this room,
	// not the process.
	if _, err := memfault.Copy(fmt.Sprintf("aux buffer %d", a.BufferIndex), buf.Mem[off:], a.Data); err != nil {
		r.failAbort(err.Error())
	}
}

// senderSlot returns which of a room's prefill ranks (an index into ts,
// the room's targets) a notification from agent comes from. An agent
// sends for one prefill rank only, and a rank's notifications come from
// one agent only: the first agent whose notification for an open room
// finds one of the room's data-sending ranks without a known agent
// becomes that rank's agent (the rank its tag names if that one is free,
// else the first free one: tags of SGLang prefills need not carry the
// unique rank), for as long as this decode rank is registered with it.
// Every tag of an agent must name the same rank. An agent that is not the
// agent of one of the room's data-sending ranks is refused.
func (d *Decode) senderSlot(ts []target, agent string, n sglang.Notif) (int, error) {
	rank := -1
	if n.Kind == sglang.NotifKV || n.Kind == sglang.NotifState || (n.Kind == sglang.NotifAux && n.NoKV) {
		rank = n.PPRank
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	sa := d.agents[agent]
	if sa == nil {
		pick := -1
		for i := range ts {
			if ts[i].Dummy || d.agentOf[ts[i].endpoint] != "" {
				continue
			}
			if pick < 0 || (ts[i].unique == rank && ts[pick].unique != rank) {
				pick = i
			}
		}
		if pick < 0 {
			return 0, fmt.Errorf("agent %q is not the agent of a prefill rank this room was sent to", agent)
		}
		sa = &senderAgent{endpoint: ts[pick].endpoint, rank: -1}
		d.agents[agent] = sa
		d.agentOf[sa.endpoint] = agent
		d.log.Info("prefill rank's notification agent known", "prefill", sa.endpoint, "agent", agent)
	}
	slot := -1
	for i := range ts {
		if ts[i].endpoint == sa.endpoint && !ts[i].Dummy {
			slot = i
			break
		}
	}
	if slot < 0 {
		return 0, fmt.Errorf("agent %q sends for prefill rank %s, which sends this room no data", agent, sa.endpoint)
	}
	if rank >= 0 {
		if sa.rank < 0 {
			sa.rank = rank
		} else if sa.rank != rank {
			return 0, fmt.Errorf("agent %q of prefill rank %s names rank %d, its earlier tags %d", agent, sa.endpoint, rank, sa.rank)
		}
	}
	return slot, nil
}

// handleNotifs takes the notifications the agent's completion engine
// delivers and tracks arrivals. While rooms wait for notifications the
// engine is told to expect them (expectNotifs), so an engine without an
// event descriptor polls for them adaptively.
func (d *Decode) handleNotifs(ns []plugin.Notif) {
	for _, n := range ns {
		d.handleNotif(n)
	}
}

func (d *Decode) handleNotif(n plugin.Notif) {
	tag, err := sglang.ParseNotif(n.Msg)
	if err != nil {
		d.drops.drop("notification", fmt.Errorf("from %s: %w", n.From, err))
		return
	}
	r := d.receiver(tag.Room)
	if r == nil {
		d.log.Debug("notification for an unknown room", "room", tag.Room, "from", n.From)
		return
	}
	if err := r.notif(tag, n.From); err != nil {
		d.drops.drop("notification", fmt.Errorf("room %d, %q from %s: %w", tag.Room, n.Msg, n.From, err))
	}
}

// expectNotifs tells the completion engine that one room more (delta 1)
// or fewer (-1) waits for notifications.
func (d *Decode) expectNotifs(delta int) { d.agent.Engine().Expect(delta) }

// heartbeat checks every known bootstrap server; after
// HeartbeatMaxFailures failed checks in a row, every unfinished room of that
// prefill fails.
func (d *Decode) heartbeat(time.Time) {
	d.mu.Lock()
	addrs := slices.Collect(maps.Keys(d.prefills))
	d.mu.Unlock()
	for _, addr := range addrs {
		d.mu.Lock()
		pi := d.prefills[addr]
		d.mu.Unlock()
		if pi == nil {
			continue
		}
		ctx, cancel := d.clock.WithTimeout(d.ctx, 3*time.Second)
		start := d.clock.Now()
		err := pi.client.Health(ctx)
		cancel()
		d.obs.Handshake(HandshakeEvent{Role: RoleDecode, Kind: HandshakeHeartbeat, Peer: addr, Latency: d.clock.Since(start), Err: err})
		if d.ctx.Err() != nil {
			return
		}
		d.mu.Lock()
		if err == nil {
			pi.failures = 0
		} else {
			pi.failures++
		}
		dead := pi.failures >= d.set.HeartbeatMaxFailures
		d.mu.Unlock()
		if err != nil {
			d.log.Info("heartbeat failed", "bootstrap", addr, "failures", pi.failures, "err", err)
		}
		if dead {
			d.nodeFailure(addr)
		}
	}
}

// nodeFailure forgets a prefill deployment and fails its unfinished rooms.
func (d *Decode) nodeFailure(addr string) {
	reason := fmt.Sprintf("Lost connection with prefill instance (bootstrap_addr: %s)", addr)
	d.mu.Lock()
	delete(d.prefills, addr)
	d.dead[addr] = true
	var stale []string
	for k, ts := range d.conns {
		if strings.HasPrefix(k, addr+"_") {
			for _, t := range ts {
				stale = append(stale, t.endpoint)
				if a, ok := d.agentOf[t.endpoint]; ok {
					delete(d.agents, a)
					delete(d.agentOf, t.endpoint)
				}
			}
			delete(d.conns, k)
		}
	}
	var affected []*Receiver
	for room := range d.addrRooms[addr] {
		if r := d.recvs[room]; r != nil {
			affected = append(affected, r)
		}
	}
	d.mu.Unlock()
	for _, ep := range stale {
		d.push.Forget(ep)
	}
	n := 0
	for _, r := range affected {
		if st, _ := d.rooms.Get(r.room); st != sglang.KVPollSuccess && st != sglang.KVPollFailed {
			r.fail(reason, false)
			n++
		}
	}
	d.log.Error("lost connection with prefill instance", "bootstrap", addr, "rooms_failed", n)
}

// janitor applies the waiting timeout.
func (d *Decode) janitor(now time.Time) {
	d.mu.Lock()
	var late []*Receiver
	for _, r := range d.recvs {
		r.mu.Lock()
		if !r.sent.IsZero() && !r.done && now.Sub(r.sent) >= d.set.WaitingTimeout {
			late = append(late, r)
		}
		r.mu.Unlock()
	}
	d.mu.Unlock()
	for _, r := range late {
		r.mu.Lock()
		sent := r.sent
		r.mu.Unlock()
		r.failAbort(fmt.Sprintf("Request %d timed out after %.1fs in KVPoll.WaitingForInput", r.room, now.Sub(sent).Seconds()))
	}
}
