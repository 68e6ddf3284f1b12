package plugin

import (
	"bytes"
	"errors"
	"testing"

	"github.com/kvhost/kvhost/abi"
)

// TestLoadNewRemoteLeavesLoadedPeers: LoadNewRemote loads a new peer, and
// refuses metadata naming a loaded one (its own again, or another agent's
// that calls itself the same) leaving it as it was: a transfer prepared
// before and one made after still write into the right peer's memory. A
// removed peer may be loaded anew.
func TestLoadNewRemoteLeavesLoadedPeers(t *testing.T) {
	p := openFake(t)
	a := newSide(t, p, "init", []int{4096})
	b := newSide(t, p, "target", []int{4096})
	mdB, err := b.a.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	name, err := a.a.LoadNewRemote(mdB)
	if err != nil || name != b.a.Name() {
		t.Fatalf("load new peer: %q %v", name, err)
	}
	rr, err := a.a.ImportRange(name, addr(b.bufs[0]), 4096, 0, abi.DRAM)
	if err != nil {
		t.Fatal(err)
	}
	x, err := a.a.MakeBatchXfer(abi.Write, []Pair{{a.regions[0], rr}}, []abi.BatchEntry{{Len: 4096, Count: 1}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()

	// An impostor: another agent with b's name and memory of its own.
	imp, err := p.NewAgent(name)
	if err != nil {
		t.Fatal(err)
	}
	defer imp.Close()
	impBuf := mmap(t, 4096)
	if _, err := imp.Register([]abi.MemDesc{{Addr: addr(impBuf), Len: 4096, MemKind: abi.DRAM}}); err != nil {
		t.Fatal(err)
	}
	mdImp, err := imp.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	for what, md := range map[string][]byte{"its own metadata again": mdB, "an impostor's": mdImp} {
		if got, err := a.a.LoadNewRemote(md); !errors.Is(err, ErrNotAllowed) || got != "" {
			t.Fatalf("%s: %q %v, want ErrNotAllowed", what, got, err)
		}
		fill(a.bufs[0], byte(len(what)))
		wait(t, x) // prepared before
		if !bytes.Equal(a.bufs[0], b.bufs[0]) {
			t.Fatalf("after %s: the transfer did not write the peer's memory", what)
		}
		y, err := a.a.MakeBatchXfer(abi.Write, []Pair{{a.regions[0], rr}}, []abi.BatchEntry{{Len: 4096, Count: 1}}, nil)
		if err != nil {
			t.Fatalf("after %s: %v", what, err)
		}
		fill(a.bufs[0], byte(len(what)+1))
		wait(t, y)
		y.Close()
		if !bytes.Equal(a.bufs[0], b.bufs[0]) {
			t.Fatalf("after %s: a new transfer did not write the peer's memory", what)
		}
		for _, c := range impBuf {
			if c != 0 {
				t.Fatalf("after %s: the impostor's memory was written", what)
			}
		}
	}
	// LoadRemote still replaces (a restarted peer reloads its metadata).
	if got, err := a.a.LoadRemote(mdB); err != nil || got != name {
		t.Fatalf("LoadRemote of a loaded peer: %q %v", got, err)
	}
	x.Close()
	if err := a.a.RemoveRemote(name); err != nil {
		t.Fatal(err)
	}
	if got, err := a.a.LoadNewRemote(mdImp); err != nil || got != name {
		t.Fatalf("load after remove: %q %v", got, err)
	}
}
