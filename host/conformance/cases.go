package conformance

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/peerproc"
	"github.com/kvhost/kvhost/host/plugin"
)

// cases is the suite, in order: the plugin and its handles first, then
// metadata and regions, then transfers, notifications, progress and
// failure.
var cases = []Case{
	{"info", "plugin_info: name, version, ABI, capabilities, memory kinds, parameter docs", caseInfo},
	{"abi-negotiation", "the entry point refuses a host major it does not serve; builds for another major are refused by the host", caseABI},
	{"agents", "agent_create/agent_destroy: capabilities, bad names and parameters, double destroy", caseAgents},
	{"register", "register_mem/deregister_mem: overlap, zero length, all-or-nothing, stale and foreign handles", caseRegister},
	{"metadata", "local_metadata/load_remote/remove_remote: peer names, reload, garbage, unknown peer", caseMetadata},
	{"forged-reload", "load_remote of another agent under a loaded peer's name (other connection details) is refused with NOT_ALLOWED and leaves the peer as it was; the same metadata again is idempotent; after remove_remote the other agent loads", caseForgedReload},
	{"import-blob", "region_export/remote_region_import by blob/remote_region_release", caseImportBlob},
	{"import-range", "remote_region_import by address range, inside and outside advertised memory", caseImportRange},
	{"dlists", "prep_dlist/release_dlist, local and remote, in and out of bounds", caseDLists},
	{"prepped-write", "make_prepped_xfer WRITE, bytes verified, reposted with new data", casePrepped(abi.Write)},
	{"prepped-read", "make_prepped_xfer READ, bytes verified, reposted with new data", casePrepped(abi.Read)},
	{"batch-write", "make_batch_xfer WRITE over region pairs, bytes verified, reposted", caseBatch(abi.Write)},
	{"batch-read", "make_batch_xfer READ over region pairs, bytes verified, reposted", caseBatch(abi.Read)},
	{"strided", "strided descriptors in prepped and batch transfers, READ and WRITE", caseStrided},
	{"xfer-errors", "index out of range, length mismatch, pair and offset out of range: errors, and no byte moves", caseXferErrors},
	{"notif-attached", "notifications attached to transfers (prepped and batch, WRITE and READ, empty, reposted); an agent without notif refuses them and every notification call", caseNotifAttached},
	{"notif-standalone", "send_notif both ways, binary messages, unknown peer", caseNotifStandalone},
	{"notif-grouping", "get_notifs groups records by sender and keeps each sender's order", caseNotifGrouping},
	{"notif-buffer", "get_notifs with records larger than the host's buffer and more records than fit", caseNotifBuffer},
	{"poll-progress", "post_xfer/poll_xfer: NOT_POSTED, IN_PROG before done, REPOST_ACTIVE, cancel by release", casePollProgress},
	{"telemetry", "xfer_telemetry: bytes, descriptor count, times; NO_TELEMETRY before completion", caseTelemetry},
	{"submit", "ABI 1.1 submit_xfer (native, or emulated as make + post) of prepped and batch transfers, READ and WRITE, strided, with notifications, finished by poll-release (native KVP_POLL_RELEASE, or poll + telemetry + release): bytes, telemetry, the transfer closed; refused submits leave nothing", caseSubmit},
	{"event-fd", "ABI 1.1 get_event_fd: none without the capability; else one descriptor per agent, not readable when idle, readable after a transfer ends with no poll and after a notification arrives, reset by DrainEvents", caseEventFD},
	{"concurrency", "8 goroutines posting at once on one agent, 20 rounds, bytes verified", caseConcurrency},
	{"remove-remote", "remove_remote cancels a transfer in flight (CANCELED); the peer's transfers, lists and regions stay handles to release, dead (NOT_FOUND)", caseRemoveRemote},
	{"peer-exit", "a transfer to a peer process that died fails (no hang, no false success); remove_remote still works", casePeerExit},
	{"fault-injection", "a failing transfer reports the plugin's error on every poll", caseFaultInjection},
	{"bad-handles", "released, foreign and zero handles are errors, not crashes", caseBadHandles},
	{"agent-close", "agent_destroy releases everything; the host closes every child handle", caseAgentClose},
}

func caseInfo(t TB, s *Suite) {
	info := s.p.Info()
	t.Logf("plugin %s %s, ABI %d.%d, caps %v, memory %v, file %s", info.Name, info.Version, info.ABIMajor, info.ABIMinor, info.Caps.Names(), info.MemKinds, s.p.Path())
	if info.Name != s.cfg.Plugin {
		t.Errorf("plugin_info name %q, but the file is %s", info.Name, filepath.Base(s.p.Path()))
	}
	if info.Version == "" {
		t.Errorf("plugin_info version is empty")
	}
	if info.ABIMajor != abi.Major {
		t.Errorf("plugin_info ABI major %d, host %d", info.ABIMajor, abi.Major)
	}
	if info.Caps&(abi.CapPrepped|abi.CapBatch) == 0 {
		t.Errorf("capabilities %v have neither prepped nor batch", info.Caps.Names())
	}
	if len(info.MemKinds) == 0 {
		t.Errorf("plugin_info reports no memory kinds")
	}
	seen := map[string]bool{}
	for _, p := range info.ParamsDoc {
		if p.Key == "" || strings.ContainsAny(p.Key, " =\t") {
			t.Errorf("params_doc has a malformed key %q", p.Key)
		}
		if seen[p.Key] {
			t.Errorf("params_doc documents %q twice", p.Key)
		}
		seen[p.Key] = true
		if p.Description == "" {
			t.Errorf("params_doc: parameter %q has no description", p.Key)
		}
	}
	for _, p := range s.cfg.Params {
		if !seen[p.Key] {
			t.Logf("parameter %q is not in params_doc (the plugin may pass it through)", p.Key)
		}
	}
}

func caseABI(t TB, s *Suite) {
	path := s.p.Path()
	lo, hi, err := plugin.CheckABI(path, abi.Major, abi.Minor)
	if err != nil {
		t.Fatalf("negotiating ABI %d: %v", abi.Major, err)
	}
	if lo > abi.Major || hi < abi.Major {
		t.Errorf("plugin serves majors %d..%d but handed out a table for %d", lo, hi, abi.Major)
	}
	offer := []uint32{hi + 1}
	if lo > 0 {
		offer = append(offer, lo-1)
	}
	for _, major := range offer {
		_, _, err := plugin.CheckABI(path, major, 0)
		if !errors.Is(err, plugin.ErrABIMismatch) {
			t.Errorf("offering ABI %d: %v, want an ABI mismatch", major, err)
			continue
		}
		for _, want := range []string{fmt.Sprintf("majors %d..%d", lo, hi), fmt.Sprintf("host speaks %d", major), path} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("offering ABI %d: %q does not say %q", major, err, want)
			}
		}
	}
	if len(s.cfg.ABIVariants) == 0 {
		t.Logf("no build for another ABI major was given; the refusal was checked through negotiation only")
	}
	for _, v := range s.cfg.ABIVariants {
		p, err := plugin.Open(v)
		if err == nil {
			p.Close()
		}
		if !errors.Is(err, plugin.ErrABIMismatch) {
			t.Errorf("opening %s: %v, want an ABI mismatch", v, err)
			continue
		}
		if !strings.Contains(err.Error(), v) || !strings.Contains(err.Error(), fmt.Sprintf("host speaks %d", abi.Major)) || !strings.Contains(err.Error(), "plugin speaks ABI") {
			t.Errorf("opening %s: %q should name the file and both versions", v, err)
		}
		found := false
		for _, c := range plugin.Discover([]string{filepath.Dir(v)}) {
			if c.Path == v {
				found = true
				if !errors.Is(c.Err, plugin.ErrABIMismatch) || c.Info != nil {
					t.Errorf("Discover lists %s with %v, want it rejected for its ABI", v, c.Err)
				}
			}
		}
		if !found && strings.HasPrefix(filepath.Base(v), "libkvhost_") {
			t.Errorf("Discover did not list %s", v)
		}
	}
}

func caseAgents(t TB, s *Suite) {
	a, err := s.p.NewAgent(s.agentName("agent"), s.params()...)
	if err != nil {
		t.Fatalf("agent_create: %v", err)
	}
	caps := a.Caps()
	t.Logf("agent caps %v; emulated by the host: %v", caps.Names(), a.Emulated().Names())
	if extra := caps &^ s.p.Info().Caps; extra != 0 {
		t.Errorf("agent offers %v beyond the plugin's capabilities", extra.Names())
	}
	if caps&(abi.CapPrepped|abi.CapBatch) == 0 {
		t.Errorf("agent has neither prepped nor batch")
	}
	b, err := s.p.NewAgent(s.agentName("agent"), s.params()...)
	if err != nil {
		t.Fatalf("a second agent: %v", err)
	}
	if a.Handle() == 0 || b.Handle() == 0 || a.Handle() == b.Handle() {
		t.Errorf("agent handles %d and %d: want two distinct non-zero handles", a.Handle(), b.Handle())
	}
	if err := b.Close(); err != nil {
		t.Errorf("agent_destroy: %v", err)
	}

	_, err = s.p.NewAgent(strings.Repeat("x", abi.MaxNameLen+1), s.params()...)
	expectCode(t, "agent name of 256 bytes", err, abi.ErrInvalidParam)
	_, err = s.p.NewAgent("", s.params()...)
	expectCode(t, "empty agent name", err, abi.ErrInvalidParam)
	maxName := s.agentName("maxlen")
	maxName += strings.Repeat("y", abi.MaxNameLen-len(maxName))
	if long, err := s.p.NewAgent(maxName, s.params()...); err != nil {
		t.Errorf("agent name of %d bytes: %v", abi.MaxNameLen, err)
	} else {
		long.Close()
	}
	if c, err := s.p.NewAgent(s.agentName("agent"), s.params(plugin.Param{Key: "kvhost_conformance_no_such_parameter", Value: "1"})...); err == nil {
		t.Logf("the plugin accepted an unknown agent parameter (it must document that it passes parameters through)")
		c.Close()
	} else {
		expectCode(t, "unknown agent parameter", err, abi.ErrInvalidParam)
	}

	h := a.Handle()
	if err := a.Close(); err != nil {
		t.Errorf("agent_destroy: %v", err)
	}
	expectClosed(t, "second Close of an agent", a.Close())
	expectCode(t, "agent_destroy of a destroyed agent (raw)", s.p.Raw().AgentDestroy(h), abi.ErrInvalidParam)
	expectCode(t, "agent_destroy of handle 0 (raw)", s.p.Raw().AgentDestroy(0), abi.ErrInvalidParam)
}

// mmapForTest maps size bytes, unmapped when the case ends (after the
// agents closed: cleanups run last-in first-out, so call it before making
// the agent that registers it).
func mmapForTest(t TB, size int) []byte {
	t.Helper()
	b, err := peerproc.Map(uint64(size))
	if err != nil {
		t.Fatalf("%v", err)
	}
	t.Cleanup(func() { peerproc.Unmap(b) })
	return b
}

func caseRegister(t TB, s *Suite) {
	s.needDRAM(t)
	buf := mmapForTest(t, 64<<10)
	base := peerproc.Addr(buf)
	m := s.newLocal(t, []int{64 << 10})
	other := s.newLocal(t, []int{4096})
	a, raw := m.Agent, s.p.Raw()
	r0 := m.Registered[0]
	if r0.Handle() == 0 {
		t.Errorf("register_mem returned handle 0")
	}

	_, err := a.Register([]abi.MemDesc{{Addr: r0.Addr() + 4096, Len: 4096, MemKind: abi.DRAM}})
	expectCode(t, "registering inside a registered region", err, abi.ErrInvalidParam)
	_, err = a.Register([]abi.MemDesc{{Addr: base, Len: 0, MemKind: abi.DRAM}})
	expectCode(t, "registering 0 bytes", err, abi.ErrInvalidParam)
	_, err = a.Register([]abi.MemDesc{{Addr: base, Len: 4096, MemKind: abi.DRAM}, {Addr: base + 8192, Len: 0, MemKind: abi.DRAM}})
	expectCode(t, "registering a good and a bad region at once", err, abi.ErrInvalidParam)
	_, err = a.Register([]abi.MemDesc{{Addr: base, Len: 4096, MemKind: abi.DRAM}, {Addr: base + 2048, Len: 4096, MemKind: abi.DRAM}})
	expectCode(t, "registering two overlapping regions at once", err, abi.ErrInvalidParam)

	// All or nothing: the good half of the refused calls is not registered.
	rs, err := a.Register([]abi.MemDesc{{Addr: base, Len: 4096, MemKind: abi.DRAM}, {Addr: base + 8192, Len: 8192, MemKind: abi.DRAM}})
	if err != nil {
		t.Fatalf("registering memory a refused call named: %v (was it left registered?)", err)
	}
	if len(rs) != 2 || rs[0].Handle() == rs[1].Handle() || rs[0].Addr() != base || rs[1].Len() != 8192 {
		t.Errorf("regions %+v", rs)
	}
	stale := rs[0].Handle()
	if err := rs[0].Close(); err != nil {
		t.Errorf("deregister_mem: %v", err)
	}
	expectClosed(t, "second Close of a region", rs[0].Close())
	expectCode(t, "deregister_mem of a released region (raw)", raw.DeregisterMem(a.Handle(), stale), abi.ErrInvalidParam)
	expectCode(t, "deregister_mem of handle 0 (raw)", raw.DeregisterMem(a.Handle(), 0), abi.ErrInvalidParam)
	expectCode(t, "deregister_mem of a region of another agent (raw)", raw.DeregisterMem(a.Handle(), other.Registered[0].Handle()), abi.ErrInvalidParam)
	expectCode(t, "deregister_mem of a live and a released region (raw)", raw.DeregisterMem(a.Handle(), rs[1].Handle(), stale), abi.ErrInvalidParam)
	// The live one is still registered: registering over it is refused.
	_, err = a.Register([]abi.MemDesc{{Addr: base + 8192, Len: 4096, MemKind: abi.DRAM}})
	expectCode(t, "registering over a region a refused deregister_mem named", err, abi.ErrInvalidParam)
	if err := a.Deregister(rs[1]); err != nil {
		t.Errorf("deregister_mem: %v", err)
	}
	// Released memory can be registered again.
	again, err := a.Register([]abi.MemDesc{{Addr: base, Len: 64 << 10, MemKind: abi.DRAM}})
	if err != nil {
		t.Errorf("registering released memory again: %v", err)
	} else if err := a.Deregister(again...); err != nil {
		t.Errorf("deregister_mem: %v", err)
	}
	// The other agent's region was not touched by the foreign call.
	if err := other.Registered[0].Close(); err != nil {
		t.Errorf("deregistering the other agent's region: %v", err)
	}
}

func caseMetadata(t TB, s *Suite) {
	f := s.newFixture(t)
	a := f.local.Agent
	md, err := f.peer.Metadata()
	if err != nil {
		t.Fatalf("%v", err)
	}
	if len(md) == 0 {
		t.Errorf("local_metadata is empty")
	}
	if name, err := a.LoadRemote(md); err != nil || name != f.peerName {
		t.Errorf("loading the same metadata again: %q, %v", name, err)
	}
	_, err = a.LoadRemote([]byte("this is not metadata"))
	expectAnyPluginError(t, "load_remote of garbage", err)
	_, err = a.LoadRemote(nil)
	expectAnyPluginError(t, "load_remote of nothing", err)
	if len(md) > 8 {
		_, err = a.LoadRemote(md[:len(md)/2])
		expectAnyPluginError(t, "load_remote of truncated metadata", err)
	}

	var rr *plugin.RemoteRegion
	if a.Caps().Has(abi.CapRemoteAddr) {
		ri := f.rinfo[0]
		if rr, err = a.ImportRange(f.peerName, ri.Addr, 4096, ri.DevID, ri.Kind); err != nil {
			t.Fatalf("import by range: %v", err)
		}
	}
	if err := a.RemoveRemote(f.peerName); err != nil {
		t.Fatalf("remove_remote: %v", err)
	}
	f.rregions = nil // released with the peer
	expectCode(t, "remove_remote of a removed peer", a.RemoveRemote(f.peerName), abi.ErrNotFound)
	expectCode(t, "remove_remote of a peer never loaded", a.RemoveRemote("conf-no-such-peer"), abi.ErrNotFound)
	if rr != nil {
		expectClosed(t, "a remote region of a removed peer", rr.Close())
	}
	_, err = a.PrepRemote(f.peerName, abi.DRAM, []abi.XferDesc{{Addr: f.rinfo[0].Addr, Len: 64, Count: 1}})
	expectCode(t, "prep_dlist against a removed peer", err, abi.ErrNotFound)
	if a.Caps().Has(abi.CapNotif) {
		expectCode(t, "send_notif to a removed peer", a.SendNotif(f.peerName, []byte("x")), abi.ErrNotFound)
	}

	// Loaded again, the peer is reachable again.
	if name, err := a.LoadRemote(md); err != nil || name != f.peerName {
		t.Fatalf("loading a removed peer again: %q, %v", name, err)
	}
	runs := f.genRuns(4, abi.Write, false)
	f.run("write after reloading the peer", f.makePrepped(abi.Write, runs, nil))
	f.apply(abi.Write, runs)
	f.verify("write after reloading the peer")
}

// caseForgedReload: metadata that reuses a loaded peer's name with other
// connection details (here an agent of the same name, elsewhere: another
// incarnation or an impostor) must not replace the peer. A plugin that let
// it would send the peer's bytes and notifications to the impostor
// (issue 19, item 2).
func caseForgedReload(t TB, s *Suite) {
	f := s.newFixture(t)
	a := f.local.Agent
	impostor, err := s.peers.NewAgent(f.peerName, s.params(), []int{regionSize})
	if err != nil {
		t.Fatalf("creating an agent named like the peer: %v", err)
	}
	t.Cleanup(func() { closeQuietly(t, "the impostor agent", impostor.Close) })
	imd, err := impostor.Metadata()
	if err != nil {
		t.Fatalf("%v", err)
	}
	_, err = a.LoadRemote(imd)
	expectCode(t, "load_remote of another agent under a loaded peer's name", err, abi.ErrNotAllowed)

	// The peer is untouched: its bytes and its notifications reach it.
	notif := a.Caps().Has(abi.CapNotif) && f.peer.Caps().Has(abi.CapNotif)
	var msg []byte
	if notif {
		msg = []byte("after-the-forgery")
	}
	runs := f.genRuns(4, abi.Write, false)
	f.run("write after a refused re-load", f.makePrepped(abi.Write, runs, msg))
	f.apply(abi.Write, runs)
	f.verify("write after a refused re-load")
	if notif {
		batches, err := f.peer.Notifs(1, s.cfg.Timeout)
		if err != nil {
			t.Fatalf("get_notifs of the peer: %v", err)
		}
		expectNotifs(t, "the notification after a refused re-load", batches, a.Name(), [][]byte{msg})
		if got, err := impostor.Notifs(1, settle); err == nil && len(got) > 0 {
			t.Errorf("the impostor received notifications: %s", describeNotifs(got[0]))
		}
	}
	// The peer's own metadata again: idempotent.
	md, err := f.peer.Metadata()
	if err != nil {
		t.Fatalf("%v", err)
	}
	if name, err := a.LoadRemote(md); err != nil || name != f.peerName {
		t.Errorf("loading the peer's metadata again: %q, %v", name, err)
	}
	f.run("write after loading the same metadata again", f.makePrepped(abi.Write, runs, nil))
	f.apply(abi.Write, runs)
	f.verify("write after loading the same metadata again")

	// A restarted peer comes back through remove_remote.
	if err := a.RemoveRemote(f.peerName); err != nil {
		t.Fatalf("remove_remote: %v", err)
	}
	f.rregions = nil
	if name, err := a.LoadRemote(imd); err != nil || name != f.peerName {
		t.Errorf("loading the other agent after remove_remote: %q, %v", name, err)
	}
}

func expectAnyPluginError(t TB, what string, err error) {
	t.Helper()
	var pe *plugin.Error
	if !errors.As(err, &pe) || pe.Code >= 0 {
		t.Errorf("%s: %v, want a plugin error", what, err)
	}
}

func caseImportBlob(t TB, s *Suite) {
	f := s.newFixture(t)
	a := f.local.Agent
	if !a.Caps().Has(abi.CapRemoteBlob) {
		t.Skipf("agent lacks remote_blob (caps %v)", a.Caps().Names())
	}
	if f.rinfo[0].Blob == nil {
		t.Fatalf("the peer agent has remote_blob but exported no blob")
	}
	for i, ri := range f.rinfo {
		rr, err := a.ImportRegion(f.peerName, ri.Blob)
		if err != nil {
			t.Fatalf("remote_region_import of peer region %d: %v", i, err)
		}
		if rr.Addr() != ri.Addr || rr.Len() != ri.Len || rr.DevID() != ri.DevID || rr.Kind() != ri.Kind || rr.Peer() != f.peerName {
			t.Errorf("imported region %d describes %#x+%d dev %d %v of %s, want %#x+%d dev %d %v of %s", i,
				rr.Addr(), rr.Len(), rr.DevID(), rr.Kind(), rr.Peer(), ri.Addr, ri.Len, ri.DevID, ri.Kind, f.peerName)
		}
		h := rr.Handle()
		if err := rr.Close(); err != nil {
			t.Errorf("remote_region_release: %v", err)
		}
		expectClosed(t, "second Close of a remote region", rr.Close())
		expectCode(t, "remote_region_release of a released region (raw)", s.p.Raw().RemoteRegionRelease(a.Handle(), h), abi.ErrInvalidParam)
	}
	_, err := a.ImportRegion(f.peerName, []byte("garbage, not a region blob"))
	expectAnyPluginError(t, "import of a garbage blob", err)
	_, err = a.ImportRegion("conf-no-such-peer", f.rinfo[0].Blob)
	expectCode(t, "import from a peer never loaded", err, abi.ErrNotFound)
	n, err := s.p.Raw().RegionExport(a.Handle(), f.local.Registered[0].Handle())
	if err != nil || n == 0 {
		t.Errorf("region_export with no buffer: size %d, %v; want the size it needs", n, err)
	}
	_, err = s.p.Raw().RegionExport(a.Handle(), 0)
	expectCode(t, "region_export of handle 0 (raw)", err, abi.ErrInvalidParam)

	// The imported regions carry a transfer.
	runs := f.genRuns(6, abi.Write, false)
	f.run("batch write to regions imported from blobs", f.makeBatch(abi.Write, runs, nil))
	f.apply(abi.Write, runs)
	f.verify("batch write to regions imported from blobs")
}

func caseImportRange(t TB, s *Suite) {
	f := s.newFixture(t)
	a := f.local.Agent
	if !a.Caps().Has(abi.CapRemoteAddr) {
		t.Skipf("agent lacks remote_addr (caps %v)", a.Caps().Names())
	}
	ri := f.rinfo[1]
	rr, err := a.ImportRange(f.peerName, ri.Addr+100, 5000, ri.DevID, ri.Kind)
	if err != nil {
		t.Fatalf("import by range: %v", err)
	}
	if rr.Addr() != ri.Addr+100 || rr.Len() != 5000 || rr.DevID() != ri.DevID || rr.Kind() != ri.Kind {
		t.Errorf("imported range %#x+%d dev %d %v, want %#x+5000", rr.Addr(), rr.Len(), rr.DevID(), rr.Kind(), ri.Addr+100)
	}
	// A transfer into the imported range lands at the right place.
	loc := f.local.Registered[0]
	x, err := a.MakeBatchXfer(abi.Write, []plugin.Pair{{Local: loc, Remote: rr}}, []abi.BatchEntry{{LocalOffset: 7, RemoteOffset: 11, Len: 4989, Count: 1}}, nil)
	if err != nil {
		t.Fatalf("batch over an imported range: %v", err)
	}
	f.run("write into an imported range", x)
	copy(f.rmodel[1][111:111+4989], f.lmodel[0][7:7+4989])
	f.verify("write into an imported range")
	if err := x.Close(); err != nil {
		t.Errorf("release_xfer: %v", err)
	}
	if err := rr.Close(); err != nil {
		t.Errorf("remote_region_release: %v", err)
	}
	for _, tc := range []struct {
		what    string
		addr, n uint64
		peer    string
	}{
		{"a range straddling the end of an advertised region", ri.Addr + ri.Len - 100, 200, f.peerName},
		{"a range below every advertised region", 4096, 4096, f.peerName},
		{"a range of a peer never loaded", ri.Addr, 4096, "conf-no-such-peer"},
	} {
		_, err := a.ImportRange(tc.peer, tc.addr, tc.n, ri.DevID, ri.Kind)
		expectCode(t, "import of "+tc.what, err, abi.ErrNotFound)
	}
}

func caseDLists(t TB, s *Suite) {
	f := s.newFixture(t)
	a := f.local.Agent
	if !a.Caps().Has(abi.CapPrepped) {
		t.Logf("agent lacks native prepped lists: the host emulates them (remote descriptors over imported regions)")
	}
	loc, rem := f.local.Registered[0], f.rinfo[0]
	good := []abi.XferDesc{{Addr: loc.Addr(), Len: 100, Count: 1}, {Addr: loc.Addr() + regionSize - 100, Len: 100, Count: 1}, {Addr: loc.Addr() + 1000, Len: 10, Stride: 100, Count: 5}}
	d, err := a.PrepLocal(abi.DRAM, good)
	if err != nil {
		t.Fatalf("prep_dlist (local): %v", err)
	}
	if d.Len() != 3 || d.Peer() != "" {
		t.Errorf("local list: Len %d Peer %q", d.Len(), d.Peer())
	}
	h := d.Handle()
	if err := d.Close(); err != nil {
		t.Errorf("release_dlist: %v", err)
	}
	expectClosed(t, "second Close of a list", d.Close())
	if a.Caps().Has(abi.CapPrepped) {
		expectCode(t, "release_dlist of a released list (raw)", s.p.Raw().ReleaseDList(a.Handle(), h), abi.ErrInvalidParam)
		expectCode(t, "release_dlist of handle 0 (raw)", s.p.Raw().ReleaseDList(a.Handle(), 0), abi.ErrInvalidParam)
	}
	f.importForLists()
	rgood := []abi.XferDesc{{Addr: rem.Addr, Len: 100, Count: 1, DevID: rem.DevID}, {Addr: rem.Addr + regionSize - 1, Len: 1, Count: 1, DevID: rem.DevID}}
	if rd, err := a.PrepRemote(f.peerName, abi.DRAM, rgood); err != nil {
		t.Errorf("prep_dlist (remote): %v", err)
	} else {
		if rd.Len() != 2 || rd.Peer() != f.peerName {
			t.Errorf("remote list: Len %d Peer %q", rd.Len(), rd.Peer())
		}
		if err := rd.Close(); err != nil {
			t.Errorf("release_dlist (remote): %v", err)
		}
	}

	for _, tc := range []struct {
		what string
		peer string
		desc abi.XferDesc
		code abi.Status
	}{
		{"local block past the end of a region", "", abi.XferDesc{Addr: loc.Addr() + regionSize - 10, Len: 20, Count: 1}, abi.ErrNotFound},
		{"local block in unregistered memory", "", abi.XferDesc{Addr: 4096, Len: 16, Count: 1}, abi.ErrNotFound},
		{"local strided run whose last block is outside", "", abi.XferDesc{Addr: loc.Addr() + regionSize - 1000, Len: 100, Stride: 400, Count: 4}, abi.ErrNotFound},
		{"local block of 0 bytes", "", abi.XferDesc{Addr: loc.Addr(), Len: 0, Count: 1}, abi.ErrInvalidParam},
		{"local run of 0 blocks", "", abi.XferDesc{Addr: loc.Addr(), Len: 8, Count: 0}, abi.ErrInvalidParam},
		{"remote block past the end of a region", f.peerName, abi.XferDesc{Addr: rem.Addr + regionSize - 10, Len: 20, Count: 1, DevID: rem.DevID}, abi.ErrNotFound},
		{"remote block outside advertised memory", f.peerName, abi.XferDesc{Addr: 4096, Len: 16, Count: 1}, abi.ErrNotFound},
		{"remote block of 0 bytes", f.peerName, abi.XferDesc{Addr: rem.Addr, Len: 0, Count: 1, DevID: rem.DevID}, abi.ErrInvalidParam},
		{"remote block of a peer never loaded", "conf-no-such-peer", abi.XferDesc{Addr: rem.Addr, Len: 16, Count: 1}, abi.ErrNotFound},
	} {
		descs := []abi.XferDesc{good[0], tc.desc}
		var err error
		if tc.peer == "" {
			_, err = a.PrepLocal(abi.DRAM, descs)
		} else {
			descs[0] = rgood[0]
			_, err = a.PrepRemote(tc.peer, abi.DRAM, descs)
		}
		expectCode(t, "prep_dlist with a "+tc.what, err, tc.code)
	}
}
