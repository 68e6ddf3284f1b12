package nixltest

import (
	"bytes"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

// The host gives an initiator agent UCX worker threads by default (the
// plugin documents num_threads, so plugin.ForSide adds it), the target
// none but prefault=false (plugin.PrefaultParam); NIXL's UCX backend splits a transfer of at least split_batch_size
// (1024) descriptors over those threads, and such a transfer, WRITE and
// READ, moves every byte of every descriptor, nothing else, and delivers
// its notification once.
func TestWorkerThreads(t *testing.T) {
	p := load(t)
	want := plugin.Param{Key: plugin.ThreadsParam, Value: strconv.Itoa(plugin.InitiatorThreads)}
	ip := p.ForSide(plugin.Initiator, nil)
	if !p.Info().HasParam(plugin.ThreadsParam) || !slices.Contains(ip, want) {
		t.Fatalf("initiator params %v, want %v (params_doc %+v)", ip, want, p.Info().ParamsDoc)
	}
	if tp, want := p.ForSide(plugin.Target, nil), []plugin.Param{{Key: plugin.PrefaultParam, Value: "false"}}; !slices.Equal(tp, want) {
		t.Fatalf("target params %v, want %v", tp, want)
	}
	const n, block = 2048, 4 << 10
	const size = 2 * n * block
	init := newSide(t, p, uniqueName(t, "init"), size, ip...)
	target := newSide(t, p, uniqueName(t, "target"), size)
	peer := connect(t, init, target)
	rr, err := init.a.ImportRange(peer, addr(target.buf), size, 0, abi.DRAM)
	if err != nil {
		t.Fatalf("import range: %v", err)
	}
	// Every other block, in reverse order on the far side: nothing merges
	// the descriptors, and the gaps show stray bytes.
	entries := make([]abi.BatchEntry, n)
	for i := range entries {
		entries[i] = abi.BatchEntry{LocalOffset: uint64(2*i) * block, RemoteOffset: uint64(2*(n-1-i)) * block, Len: block, Count: 1}
	}
	for _, op := range []abi.Op{abi.Write, abi.Read} {
		fill(init.buf, 1)
		fill(target.buf, 2)
		src, dst := init.buf, target.buf
		if op == abi.Read {
			src, dst = target.buf, init.buf
		}
		before := bytes.Clone(dst)
		msg := []byte(fmt.Sprintf("threads %v", op))
		x, err := init.a.MakeBatchXfer(op, []plugin.Pair{{Local: init.reg, Remote: rr}}, entries, msg)
		if err != nil {
			t.Fatalf("%v: make_batch_xfer: %v", op, err)
		}
		if _, err := x.Post(); err != nil {
			t.Fatalf("%v: post: %v", op, err)
		}
		wait(t, x, op.String()+" of 2048 descriptors over worker threads")
		if err := x.Close(); err != nil {
			t.Fatalf("%v: release: %v", op, err)
		}
		for i, e := range entries {
			so, do := e.LocalOffset, e.RemoteOffset
			if op == abi.Read {
				so, do = e.RemoteOffset, e.LocalOffset
			}
			if !bytes.Equal(dst[do:do+block], src[so:so+block]) {
				t.Fatalf("%v: descriptor %d: bytes differ", op, i)
			}
			gap := do + block
			if !bytes.Equal(dst[gap:gap+block], before[gap:gap+block]) {
				t.Fatalf("%v: the gap after descriptor %d changed", op, i)
			}
		}
		got := 0
		for deadline := time.Now().Add(10 * time.Second); got == 0 && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			ns, err := target.a.Notifs()
			if err != nil {
				t.Fatalf("get_notifs: %v", err)
			}
			for _, nt := range ns {
				if nt.From != init.a.Name() || !bytes.Equal(nt.Msg, msg) {
					t.Fatalf("%v: notification %q from %q, want %q from %q", op, nt.Msg, nt.From, msg, init.a.Name())
				}
				got++
			}
		}
		time.Sleep(50 * time.Millisecond) // a duplicate would follow closely
		ns, err := target.a.Notifs()
		if got+len(ns) != 1 || err != nil {
			t.Fatalf("%v: %d notifications (%v), want 1", op, got+len(ns), err)
		}
	}
}
