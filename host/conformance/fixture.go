package conformance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/peerproc"
	"github.com/kvhost/kvhost/host/plugin"
)

// Geometry of a fixture: two regions per side, split into destination slots
// so that the blocks a transfer writes never overlap.
const (
	regionSize  = 128 << 10
	numRegions  = 2
	maxBlockLen = 4096     // longest plain block; also its destination slot
	stridedSlot = 16 << 10 // destination slot of a strided run (up to 8 blocks of 512 bytes, 1.5 KiB apart)
)

// fixture is a local agent and a peer that loaded each other's metadata,
// with the expected content of every region of both sides, so that a test
// can check every byte after each transfer.
type fixture struct {
	t        TB
	s        *Suite
	local    *peerproc.MemAgent
	peer     peerproc.Peer
	peerName string                // the peer as the local agent knows it
	rinfo    []peerproc.RegionInfo // the peer's regions
	lmodel   [][]byte              // expected bytes of the local regions
	rmodel   [][]byte              // expected bytes of the peer's regions
	rng      *rand.Rand
	seed     uint64
	rregions []*plugin.RemoteRegion // imported by importRemote
}

// newFixture makes a local agent (with extra parameters) and a peer, makes
// them load each other's metadata and fills both sides with patterns.
func (s *Suite) newFixture(t TB, extra ...plugin.Param) *fixture {
	t.Helper()
	s.needDRAM(t)
	sizes := []int{regionSize, regionSize}
	f := &fixture{t: t, s: s, rng: rand.New(rand.NewPCG(uint64(s.names.Load()), 0x6b76686f7374))}
	f.local = s.newLocal(t, sizes, extra...)
	f.peer = s.newPeer(t, sizes)
	f.rinfo = f.peer.Regions()
	md, err := f.peer.Metadata()
	if err != nil {
		t.Fatalf("peer metadata: %v", err)
	}
	if f.peerName, err = f.local.Agent.LoadRemote(md); err != nil {
		t.Fatalf("loading the peer's metadata: %v", err)
	}
	if f.peerName != f.peer.Name() {
		t.Errorf("load_remote named the peer %q, want %q", f.peerName, f.peer.Name())
	}
	lmd, err := f.local.Agent.LocalMetadata()
	if err != nil {
		t.Fatalf("local metadata: %v", err)
	}
	if name, err := f.peer.LoadRemote(lmd); err != nil {
		t.Fatalf("peer loading the local metadata: %v", err)
	} else if name != f.local.Agent.Name() {
		t.Errorf("the peer's load_remote named the local agent %q, want %q", name, f.local.Agent.Name())
	}
	f.lmodel = make([][]byte, numRegions)
	f.rmodel = make([][]byte, numRegions)
	for i := range numRegions {
		f.lmodel[i] = make([]byte, regionSize)
		f.rmodel[i] = make([]byte, regionSize)
		f.fillLocal(i)
		f.fillRemote(i)
	}
	return f
}

func (f *fixture) nextSeed() uint64 { f.seed++; return f.seed*1000003 + uint64(f.rng.Uint32()) }

// fillLocal writes a fresh pattern into local region i.
func (f *fixture) fillLocal(i int) {
	seed := f.nextSeed()
	peerproc.Fill(f.local.Bufs[i], seed)
	peerproc.Fill(f.lmodel[i], seed)
}

// fillRemote writes a fresh pattern into peer region i.
func (f *fixture) fillRemote(i int) {
	seed := f.nextSeed()
	if err := f.peer.Fill(i, 0, regionSize, seed); err != nil {
		f.t.Fatalf("filling peer region %d: %v", i, err)
	}
	peerproc.Fill(f.rmodel[i], seed)
}

// refillSource gives the source side of op fresh patterns.
func (f *fixture) refillSource(op abi.Op) {
	for i := range numRegions {
		if op == abi.Write {
			f.fillLocal(i)
		} else {
			f.fillRemote(i)
		}
	}
}

// verify checks every byte of both sides against the model.
func (f *fixture) verify(what string) {
	f.t.Helper()
	for i := range numRegions {
		if !bytes.Equal(f.local.Bufs[i], f.lmodel[i]) {
			f.t.Errorf("%s: local region %d: %s", what, i, firstDiff(f.local.Bufs[i], f.lmodel[i]))
		}
		got, err := f.peer.Sum(i, 0, regionSize)
		if err != nil {
			f.t.Fatalf("%s: checksum of peer region %d: %v", what, i, err)
		}
		if !bytes.Equal(got, peerproc.Sum(f.rmodel[i])) {
			b, err := f.peer.Bytes(i, 0, regionSize)
			if err != nil {
				f.t.Fatalf("%s: reading peer region %d: %v", what, i, err)
			}
			f.t.Errorf("%s: peer region %d (%s): %s", what, i, f.s.cfg.Mode, firstDiff(b, f.rmodel[i]))
		}
	}
}

// peerMatches reports whether every peer region holds what the model says
// (no failure is reported: for checks that accept more than one outcome).
func (f *fixture) peerMatches() bool {
	f.t.Helper()
	for i := range numRegions {
		got, err := f.peer.Sum(i, 0, regionSize)
		if err != nil {
			f.t.Fatalf("checksum of peer region %d: %v", i, err)
		}
		if !bytes.Equal(got, peerproc.Sum(f.rmodel[i])) {
			return false
		}
	}
	return true
}

// run posts x and waits for it.
func (f *fixture) run(what string, x *plugin.Xfer) {
	f.t.Helper()
	if err := f.post(x); err != nil {
		f.t.Fatalf("%s: %v", what, err)
	}
}

func (f *fixture) post(x *plugin.Xfer) error {
	done, err := x.Post()
	if err != nil || done {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), f.s.cfg.Timeout)
	defer cancel()
	return x.Wait(ctx)
}

// run describes count blocks of len bytes: the local run starts at loff in
// local region lreg with blocks lstride apart, the remote one likewise.
type run struct {
	lreg, rreg       int
	loff, roff       uint64
	lstride, rstride uint64
	len, count       uint64
}

// genRuns draws n runs whose destination sides (remote for Write, local for
// Read) lie in distinct slots, so they never overlap; with strided, runs
// have up to 8 blocks. Lengths and offsets are deliberately unaligned.
func (f *fixture) genRuns(n int, op abi.Op, strided bool) []run {
	slot := uint64(maxBlockLen) // destination slot: one block, or one strided run
	if strided {
		slot = stridedSlot
	}
	perRegion := regionSize / int(slot)
	if n > numRegions*perRegion {
		f.t.Fatalf("genRuns: %d runs do not fit in %d slots", n, numRegions*perRegion)
	}
	out := make([]run, n)
	for i, si := range f.rng.Perm(numRegions * perRegion)[:n] {
		r := run{count: 1, len: 1 + uint64(f.rng.IntN(maxBlockLen))}
		var dstride, sstride uint64
		if strided {
			r.count = 2 + uint64(f.rng.IntN(7))
			r.len = 1 + uint64(f.rng.IntN(512))
			dstride = r.len + uint64(f.rng.IntN(1024))
			sstride = r.len + uint64(f.rng.IntN(1024))
		}
		dspan := (r.count-1)*dstride + r.len
		sspan := (r.count-1)*sstride + r.len
		dreg := si / perRegion
		doff := uint64(si%perRegion)*slot + uint64(f.rng.IntN(int(slot-dspan+1)))
		sreg := f.rng.IntN(numRegions)
		soff := uint64(f.rng.IntN(int(regionSize - sspan + 1)))
		if op == abi.Write {
			r.lreg, r.loff, r.lstride, r.rreg, r.roff, r.rstride = sreg, soff, sstride, dreg, doff, dstride
		} else {
			r.lreg, r.loff, r.lstride, r.rreg, r.roff, r.rstride = dreg, doff, dstride, sreg, soff, sstride
		}
		out[i] = r
	}
	return out
}

// apply updates the model as if runs moved by op.
func (f *fixture) apply(op abi.Op, runs []run) {
	for _, r := range runs {
		for k := range r.count {
			lo, ro := r.loff+k*r.lstride, r.roff+k*r.rstride
			if op == abi.Write {
				copy(f.rmodel[r.rreg][ro:ro+r.len], f.lmodel[r.lreg][lo:lo+r.len])
			} else {
				copy(f.lmodel[r.lreg][lo:lo+r.len], f.rmodel[r.rreg][ro:ro+r.len])
			}
		}
	}
}

func (r run) localDesc(f *fixture) abi.XferDesc {
	d := abi.XferDesc{Addr: f.local.Registered[r.lreg].Addr() + r.loff, Len: r.len, Count: r.count}
	if r.count > 1 {
		d.Stride = r.lstride
	}
	return d
}

func (r run) remoteDesc(f *fixture) abi.XferDesc {
	d := abi.XferDesc{Addr: f.rinfo[r.rreg].Addr + r.roff, Len: r.len, Count: r.count, DevID: f.rinfo[r.rreg].DevID}
	if r.count > 1 {
		d.Stride = r.rstride
	}
	return d
}

// prepped holds the lists and indices of a prepped transfer of runs.
type prepped struct {
	local, remote *plugin.DList
	li, ri        []int32
}

// prepRuns prepares a local and a remote list for runs, in different
// orders and with unused descriptors between, so that the indices of a run
// differ on the two sides; the lists are closed when the case ends.
func (f *fixture) prepRuns(runs []run) prepped {
	f.t.Helper()
	f.importForLists()
	n := len(runs)
	lpos, rpos := f.rng.Perm(n), f.rng.Perm(n)
	ldescs := make([]abi.XferDesc, 2*n)
	rdescs := make([]abi.XferDesc, n+1)
	var p prepped
	for i, r := range runs {
		ldescs[2*lpos[i]+1] = r.localDesc(f)
		rdescs[rpos[i]] = r.remoteDesc(f)
		p.li = append(p.li, int32(2*lpos[i]+1))
		p.ri = append(p.ri, int32(rpos[i]))
	}
	for i := 0; i < 2*n; i += 2 { // unused local descriptors
		ldescs[i] = abi.XferDesc{Addr: f.local.Registered[0].Addr() + uint64(i), Len: 8, Count: 1}
	}
	rdescs[n] = abi.XferDesc{Addr: f.rinfo[1].Addr, Len: 64, Count: 1, DevID: f.rinfo[1].DevID}
	var err error
	if p.local, err = f.local.Agent.PrepLocal(abi.DRAM, ldescs); err != nil {
		f.t.Fatalf("prep_dlist (local, %d descriptors): %v", len(ldescs), err)
	}
	f.t.Cleanup(func() { closeQuietly(f.t, "local list", p.local.Close) })
	if p.remote, err = f.local.Agent.PrepRemote(f.peerName, abi.DRAM, rdescs); err != nil {
		f.t.Fatalf("prep_dlist (remote, %d descriptors): %v", len(rdescs), err)
	}
	f.t.Cleanup(func() { closeQuietly(f.t, "remote list", p.remote.Close) })
	return p
}

// makePrepped prepares lists for runs and makes one prepped transfer.
func (f *fixture) makePrepped(op abi.Op, runs []run, notif []byte) *plugin.Xfer {
	f.t.Helper()
	p := f.prepRuns(runs)
	x, err := f.local.Agent.MakePreppedXfer(op, p.local, p.li, p.remote, p.ri, notif)
	if err != nil {
		f.t.Fatalf("make_prepped_xfer (%v, %d descriptors): %v", op, len(runs), err)
	}
	f.t.Cleanup(func() { closeQuietly(f.t, "transfer", x.Close) })
	return x
}

// importForLists imports the peer's regions when remote lists need them:
// the host emulates the agent's lists and cannot import by address (the
// MORI-IO profile: lists are built over regions imported from blobs).
func (f *fixture) importForLists() {
	f.t.Helper()
	if caps := f.local.Agent.Caps(); !caps.Has(abi.CapPrepped) && !caps.Has(abi.CapRemoteAddr) {
		f.importRemote()
	}
}

// importRemote imports the peer's regions once: from their blobs when the
// local agent can, else by address. It skips the case when neither works.
func (f *fixture) importRemote() []*plugin.RemoteRegion {
	f.t.Helper()
	if f.rregions != nil {
		return f.rregions
	}
	caps := f.local.Agent.Caps()
	useBlob := caps.Has(abi.CapRemoteBlob) && f.rinfo[0].Blob != nil
	if !useBlob && !caps.Has(abi.CapRemoteAddr) {
		f.t.Skipf("agent cannot name remote regions: no remote_blob (with a peer that exports) and no remote_addr (caps %v)", caps.Names())
	}
	for i, ri := range f.rinfo {
		var rr *plugin.RemoteRegion
		var err error
		if useBlob {
			rr, err = f.local.Agent.ImportRegion(f.peerName, ri.Blob)
		} else {
			rr, err = f.local.Agent.ImportRange(f.peerName, ri.Addr, ri.Len, ri.DevID, ri.Kind)
		}
		if err != nil {
			f.t.Fatalf("importing peer region %d: %v", i, err)
		}
		f.t.Cleanup(func() { closeQuietly(f.t, "remote region", rr.Close) })
		f.rregions = append(f.rregions, rr)
	}
	return f.rregions
}

// batchOf builds the pairs and entries of a batch transfer of runs.
func (f *fixture) batchOf(runs []run) ([]plugin.Pair, []abi.BatchEntry) {
	rrs := f.importRemote()
	var pairs []plugin.Pair
	index := map[[2]int]uint32{}
	var entries []abi.BatchEntry
	for _, r := range runs {
		key := [2]int{r.lreg, r.rreg}
		pi, ok := index[key]
		if !ok {
			pi = uint32(len(pairs))
			index[key] = pi
			pairs = append(pairs, plugin.Pair{Local: f.local.Registered[r.lreg], Remote: rrs[r.rreg]})
		}
		e := abi.BatchEntry{Pair: pi, LocalOffset: r.loff, RemoteOffset: r.roff, Len: r.len, Count: r.count}
		if r.count > 1 {
			e.LocalStride, e.RemoteStride = r.lstride, r.rstride
		}
		entries = append(entries, e)
	}
	return pairs, entries
}

// makeBatch makes one batch transfer of runs.
func (f *fixture) makeBatch(op abi.Op, runs []run, notif []byte) *plugin.Xfer {
	f.t.Helper()
	pairs, entries := f.batchOf(runs)
	x, err := f.local.Agent.MakeBatchXfer(op, pairs, entries, notif)
	if err != nil {
		f.t.Fatalf("make_batch_xfer (%v, %d entries): %v", op, len(entries), err)
	}
	f.t.Cleanup(func() { closeQuietly(f.t, "transfer", x.Close) })
	return x
}

// closeQuietly closes a handle at the end of a case; ErrClosed is fine (the
// case closed it, or closed its agent).
func closeQuietly(t TB, what string, close func() error) {
	if err := close(); err != nil && !isClosed(err) {
		t.Errorf("closing %s: %v", what, err)
	}
}

func isClosed(err error) bool { return errors.Is(err, plugin.ErrClosed) }

// totalBytes is the number of bytes runs move.
func totalBytes(runs []run) uint64 {
	var n uint64
	for _, r := range runs {
		n += r.len * r.count
	}
	return n
}

// expectNotifs checks that batches hold exactly want (in order), from from.
func expectNotifs(t TB, what string, batches [][]plugin.Notif, from string, want [][]byte) {
	t.Helper()
	got := slices.Concat(batches...)
	if len(got) != len(want) {
		t.Errorf("%s: %d notifications arrived, want %d: %s", what, len(got), len(want), describeNotifs(got))
		return
	}
	for i := range got {
		if got[i].From != from || !bytes.Equal(got[i].Msg, want[i]) {
			t.Errorf("%s: notification %d is %q from %q, want %q from %q", what, i, abbrev(got[i].Msg), got[i].From, abbrev(want[i]), from)
		}
	}
}

func describeNotifs(ns []plugin.Notif) string {
	var b bytes.Buffer
	for i, n := range ns {
		if i == 8 {
			fmt.Fprintf(&b, " ... (%d more)", len(ns)-i)
			break
		}
		fmt.Fprintf(&b, " [%s: %q]", n.From, abbrev(n.Msg))
	}
	return b.String()
}

// abbrev shortens long messages in failure reports.
func abbrev(b []byte) string {
	if len(b) <= 40 {
		return string(b)
	}
	return fmt.Sprintf("%s...(%d bytes)", b[:32], len(b))
}
