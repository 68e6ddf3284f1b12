package plugin

import (
	"errors"
	"testing"

	"github.com/ebitengine/purego"
	"github.com/kvhost/kvhost/abi"
)

// Indices of testplugin_calls (the enum in testdata/testplugin.c).
const (
	cRegister = iota
	cDeregister
	cImport
	cReleaseRR
	cPrep
	cReleaseDList
	cMakePrepped
	cMakeBatch
	cPost
	cPoll
	cReleaseXfer
	cNumCalls
)

var callNames = [cNumCalls]string{"register_mem", "deregister_mem", "remote_region_import", "remote_region_release",
	"prep_dlist", "release_dlist", "make_prepped_xfer", "make_batch_xfer", "post_xfer", "poll_xfer", "release_xfer"}

// callCounter reads the call counts of a TP_WORKING test plugin.
type callCounter struct {
	calls, last, refuse uintptr
}

func newCallCounter(t *testing.T, path string) callCounter {
	lib, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { purego.Dlclose(lib) })
	var c callCounter
	if c.calls, err = purego.Dlsym(lib, "testplugin_calls"); err != nil {
		t.Fatal(err)
	}
	if c.last, err = purego.Dlsym(lib, "testplugin_last"); err != nil {
		t.Fatal(err)
	}
	if c.refuse, err = purego.Dlsym(lib, "testplugin_refuse"); err != nil {
		t.Fatal(err)
	}
	return c
}

func (c callCounter) snapshot() [cNumCalls]int {
	var s [cNumCalls]int
	for i := range s {
		r, _, _ := purego.SyscallN(c.calls, uintptr(i))
		s[i] = int(int32(r))
	}
	return s
}

// refuseNext makes the next call of plugin function fn fail with code.
func (c callCounter) refuseNext(fn int, code abi.Status) {
	purego.SyscallN(c.refuse, uintptr(fn), uintptr(int64(code)))
}

// lastCall returns the item count, pair count and strided count of the
// last prep/make call.
func (c callCounter) lastCall() (items, pairs, strided uint64) {
	r0, _, _ := purego.SyscallN(c.last, 0)
	r1, _, _ := purego.SyscallN(c.last, 1)
	r2, _, _ := purego.SyscallN(c.last, 2)
	return uint64(r0), uint64(r1), uint64(r2)
}

// expectCalls runs f and checks that it made exactly the plugin calls in
// want (function -> count), and no other counted call.
func (c callCounter) expectCalls(t *testing.T, what string, want map[int]int, f func()) {
	t.Helper()
	before := c.snapshot()
	f()
	after := c.snapshot()
	for i := range after {
		if got := after[i] - before[i]; got != want[i] {
			t.Errorf("%s: %d calls of %s, want %d", what, got, callNames[i], want[i])
		}
	}
}

// capsAgent makes an agent of the test plugin p with capabilities caps,
// one registered region [localBase, +size) and the range [remoteBase, +size)
// of a loaded peer imported. The caller closes the agent.
func capsAgent(t *testing.T, p *Plugin, caps abi.Caps, localBase, remoteBase, size uint64) (*Agent, []*Region, string, *RemoteRegion) {
	t.Helper()
	a, err := p.NewAgent("a", Param{"agent_caps", itoa(uint32(caps))})
	if err != nil {
		t.Fatal(err)
	}
	regions, err := a.Register([]abi.MemDesc{{Addr: localBase, Len: size}})
	if err != nil {
		a.Close()
		t.Fatal(err)
	}
	peer, err := a.LoadRemote([]byte("md"))
	if err != nil {
		a.Close()
		t.Fatal(err)
	}
	rr, err := a.ImportRange(peer, remoteBase, size, 0, abi.DRAM)
	if err != nil {
		a.Close()
		t.Fatal(err)
	}
	return a, regions, peer, rr
}

// TestPluginCallsPerOperation proves how many plugin calls each operation
// costs on every emulation path: one per transfer made, posted or polled on
// native paths, whatever the number of descriptors.
func TestPluginCallsPerOperation(t *testing.T) {
	path := buildTestPlugin(t, t.TempDir(), "working", "TP_WORKING",
		"TP_CAPS=(KVP_CAP_PREPPED|KVP_CAP_BATCH|KVP_CAP_STRIDED|KVP_CAP_REMOTE_ADDR)")
	p, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	cc := newCallCounter(t, path)
	const n = 1000 // descriptors, 1 in 10 strided with 4 blocks
	const localBase, remoteBase, size = 1 << 30, 1 << 40, 1 << 24
	var ld, rd []abi.XferDesc
	var idx []int32
	var entries []abi.BatchEntry
	expanded := 0
	for i := range n {
		d := abi.XferDesc{Addr: uint64(i) * 4096, Len: 512, Count: 1}
		if i%10 == 0 {
			d.Stride, d.Count = 1024, 4
		}
		l, r := d, d
		l.Addr += localBase
		r.Addr += remoteBase
		ld, rd = append(ld, l), append(rd, r)
		idx = append(idx, int32(n-1-i))
		entries = append(entries, abi.BatchEntry{LocalOffset: d.Addr, RemoteOffset: d.Addr, Len: d.Len, LocalStride: d.Stride, RemoteStride: d.Stride, Count: d.Count})
		expanded += int(d.Count)
	}
	for _, tc := range []struct {
		caps abi.Caps
		// calls to make a prepped and a batch transfer, and to close them
		prepped, batch, closeBatch map[int]int
		// descriptors (or entries) the plugin receives for each
		preppedItems, batchItems int
	}{
		{abi.CapPrepped | abi.CapBatch | abi.CapStrided | abi.CapRemoteAddr,
			map[int]int{cMakePrepped: 1}, map[int]int{cMakeBatch: 1}, map[int]int{cReleaseXfer: 1}, n, n},
		{abi.CapPrepped | abi.CapBatch | abi.CapRemoteAddr, // strides expanded
			map[int]int{cMakePrepped: 1}, map[int]int{cMakeBatch: 1}, map[int]int{cReleaseXfer: 1}, expanded, expanded},
		{abi.CapBatch | abi.CapStrided | abi.CapRemoteAddr, // prepped lists emulated
			map[int]int{cMakeBatch: 1}, map[int]int{cMakeBatch: 1}, map[int]int{cReleaseXfer: 1}, n, n},
		{abi.CapPrepped | abi.CapStrided | abi.CapRemoteAddr, // batch emulated: 2 lists + 1 prepped xfer
			map[int]int{cMakePrepped: 1}, map[int]int{cPrep: 2, cMakePrepped: 1}, map[int]int{cReleaseXfer: 1, cReleaseDList: 2}, n, n},
	} {
		t.Run(fmtCaps(tc.caps), func(t *testing.T) {
			a, regions, peer, rr := capsAgent(t, p, tc.caps, localBase, remoteBase, size)
			defer a.Close()
			var l, r *DList
			// Native lists cost a call each to make and to release; Go-side
			// lists none (the remote one is covered by rr).
			var prepCalls, releaseCalls map[int]int
			if tc.caps.Has(abi.CapPrepped) {
				prepCalls, releaseCalls = map[int]int{cPrep: 2}, map[int]int{cReleaseDList: 2}
			}
			cc.expectCalls(t, "preparing two lists", prepCalls, func() {
				if l, err = a.PrepLocal(abi.DRAM, ld); err != nil {
					t.Fatal(err)
				}
				if r, err = a.PrepRemote(peer, abi.DRAM, rd); err != nil {
					t.Fatal(err)
				}
			})
			var x *Xfer
			cc.expectCalls(t, "making a prepped transfer", tc.prepped, func() {
				if x, err = a.MakePreppedXfer(abi.Write, l, idx, r, idx, nil); err != nil {
					t.Fatal(err)
				}
			})
			if items, _, _ := cc.lastCall(); items != uint64(tc.preppedItems) {
				t.Errorf("the plugin got %d descriptors for a prepped transfer, want %d", items, tc.preppedItems)
			}
			cc.expectCalls(t, "posting", map[int]int{cPost: 1}, func() { x.Post() })
			cc.expectCalls(t, "polling", map[int]int{cPoll: 1}, func() { x.Poll() })
			cc.expectCalls(t, "waiting for a done transfer", map[int]int{cPoll: 1}, func() { x.Wait(t.Context()) })
			cc.expectCalls(t, "closing a prepped transfer", map[int]int{cReleaseXfer: 1}, func() { x.Close() })

			var y *Xfer
			cc.expectCalls(t, "making a batch transfer", tc.batch, func() {
				if y, err = a.MakeBatchXfer(abi.Write, []Pair{{regions[0], rr}}, entries, nil); err != nil {
					t.Fatal(err)
				}
			})
			items, pairs, strided := cc.lastCall()
			if items != uint64(tc.batchItems) {
				t.Errorf("the plugin got %d items for a batch transfer, want %d", items, tc.batchItems)
			}
			if tc.caps.Has(abi.CapBatch) && pairs != 1 {
				t.Errorf("the plugin got %d region pairs, want 1", pairs)
			}
			if wantStrided := uint64(n / 10); tc.caps.Has(abi.CapStrided) && tc.caps.Has(abi.CapBatch) && strided != wantStrided {
				t.Errorf("the plugin got %d strided entries, want them passed through (%d)", strided, wantStrided)
			}
			cc.expectCalls(t, "closing a batch transfer", tc.closeBatch, func() { y.Close() })
			cc.expectCalls(t, "closing the lists", releaseCalls, func() {
				if err := l.Close(); err != nil {
					t.Error(err)
				}
				if err := r.Close(); err != nil {
					t.Error(err)
				}
			})
		})
	}
}

func fmtCaps(c abi.Caps) string {
	s := ""
	for _, n := range c.Names() {
		if s != "" {
			s += "+"
		}
		s += n
	}
	return s
}

// TestRefusedReleasesStayRetryable: a plugin may refuse a release (MORI-IO
// and NIXL keep a transfer still in flight after their release timeout; a
// plugin that tracks use refuses deregister_mem and release_dlist with
// NOT_ALLOWED). The host then returns the error and keeps the handle open
// and usable, and a later Close releases it, exactly once.
func TestRefusedReleasesStayRetryable(t *testing.T) {
	path := buildTestPlugin(t, t.TempDir(), "working", "TP_WORKING",
		"TP_CAPS=(KVP_CAP_PREPPED|KVP_CAP_BATCH|KVP_CAP_STRIDED|KVP_CAP_REMOTE_ADDR)")
	p, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	cc := newCallCounter(t, path)
	const localBase, remoteBase, otherRemote, size = 1 << 30, 1 << 40, 1 << 41, 1 << 20
	desc := []abi.XferDesc{{Addr: 0, Len: 4096, Count: 1}}
	at := func(base uint64) []abi.XferDesc { d := desc[0]; d.Addr += base; return []abi.XferDesc{d} }
	entries := []abi.BatchEntry{{Len: 4096, Count: 1}}
	expectErr := func(what string, err, want error) {
		t.Helper()
		if !errors.Is(err, want) {
			t.Errorf("%s: %v, want %v", what, err, want)
		}
	}
	for _, caps := range []abi.Caps{
		abi.CapPrepped | abi.CapBatch | abi.CapStrided | abi.CapRemoteAddr,
		abi.CapPrepped | abi.CapStrided | abi.CapRemoteAddr, // batch emulated: lists per transfer
		abi.CapBatch | abi.CapStrided | abi.CapRemoteAddr,   // prepped emulated: lists in Go
	} {
		t.Run(fmtCaps(caps), func(t *testing.T) {
			a, regions, peer, rr := capsAgent(t, p, caps, localBase, remoteBase, size)
			defer a.Close()
			pairs := []Pair{{regions[0], rr}}

			// A transfer the plugin keeps: open, usable, released by the
			// second Close.
			x, err := a.MakeBatchXfer(abi.Write, pairs, entries, nil)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := x.Post(); err != nil {
				t.Fatal(err)
			}
			cc.refuseNext(cReleaseXfer, abi.ErrBackend)
			cc.expectCalls(t, "a refused Close", map[int]int{cReleaseXfer: 1}, func() { expectErr("refused Close", x.Close(), ErrBackend) })
			if done, err := x.Poll(); !done || err != nil {
				t.Errorf("Poll after a refused Close: %v, %v; want the transfer still usable", done, err)
			}
			closeCalls := map[int]int{cReleaseXfer: 1}
			if !caps.Has(abi.CapBatch) {
				closeCalls[cReleaseDList] = 2
			}
			cc.expectCalls(t, "Close again", closeCalls, func() {
				if err := x.Close(); err != nil {
					t.Errorf("Close again: %v", err)
				}
			})
			cc.expectCalls(t, "Close of a closed transfer", nil, func() { expectErr("third Close", x.Close(), ErrClosed) })

			// ErrInvalidParam: the plugin no longer knows the handle; closed.
			y, err := a.MakeBatchXfer(abi.Write, pairs, entries, nil)
			if err != nil {
				t.Fatal(err)
			}
			cc.refuseNext(cReleaseXfer, abi.ErrInvalidParam)
			expectErr("Close answered INVALID_PARAM", y.Close(), ErrInvalidParam)
			cc.expectCalls(t, "using it after", nil, func() {
				_, err := y.Poll()
				expectErr("Poll", err, ErrClosed)
				expectErr("Close", y.Close(), ErrClosed)
			})

			if !caps.Has(abi.CapBatch) {
				// A list of the emulation refused: the transfer is released
				// and closed to use; Close releases the remaining list.
				z, err := a.MakeBatchXfer(abi.Write, pairs, entries, nil)
				if err != nil {
					t.Fatal(err)
				}
				cc.refuseNext(cReleaseDList, abi.ErrNotAllowed)
				cc.expectCalls(t, "Close with a refused list", map[int]int{cReleaseXfer: 1, cReleaseDList: 2}, func() {
					expectErr("Close with a refused list", z.Close(), ErrNotAllowed)
				})
				cc.expectCalls(t, "Close again", map[int]int{cReleaseDList: 1}, func() {
					_, err := z.Post()
					expectErr("Post of a released transfer", err, ErrClosed)
					if err := z.Close(); err != nil {
						t.Errorf("Close again: %v", err)
					}
					expectErr("third Close", z.Close(), ErrClosed)
				})
			}

			// Lists: a native list the plugin refuses to release stays
			// usable; an emulated remote list whose imported region the
			// plugin refuses to release stays open.
			l, err := a.PrepLocal(abi.DRAM, at(localBase))
			if err != nil {
				t.Fatal(err)
			}
			r, err := a.PrepRemote(peer, abi.DRAM, at(otherRemote)) // emulated: imports a range
			if err != nil {
				t.Fatal(err)
			}
			if caps.Has(abi.CapPrepped) {
				cc.refuseNext(cReleaseDList, abi.ErrNotAllowed)
				expectErr("refused list Close", l.Close(), ErrNotAllowed)
			} else {
				cc.refuseNext(cReleaseRR, abi.ErrBackend)
				expectErr("list Close with a refused region release", r.Close(), ErrBackend)
			}
			idx := []int32{0}
			if x, err = a.MakePreppedXfer(abi.Write, l, idx, r, idx, nil); err != nil {
				t.Errorf("a list whose release was refused is not usable: %v", err)
			} else if err := x.Close(); err != nil {
				t.Error(err)
			}
			for _, d := range []*DList{l, r} {
				if err := d.Close(); err != nil {
					t.Errorf("Close of %s: %v", d.describe(), err)
				}
				expectErr("Close of a closed list", d.Close(), ErrClosed)
			}

			// Regions.
			cc.refuseNext(cDeregister, abi.ErrNotAllowed)
			expectErr("refused deregister", regions[0].Close(), ErrNotAllowed)
			cc.expectCalls(t, "deregister again", map[int]int{cDeregister: 1}, func() {
				if err := regions[0].Close(); err != nil {
					t.Errorf("deregister again: %v", err)
				}
			})
			expectErr("deregister a closed region", regions[0].Close(), ErrClosed)
			cc.refuseNext(cReleaseRR, abi.ErrBackend)
			expectErr("refused remote region release", rr.Close(), ErrBackend)
			cc.expectCalls(t, "remote region release again", map[int]int{cReleaseRR: 1}, func() {
				if err := rr.Close(); err != nil {
					t.Errorf("remote region release again: %v", err)
				}
			})
			expectErr("release a closed remote region", rr.Close(), ErrClosed)
		})
	}
}
