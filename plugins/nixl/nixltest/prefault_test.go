package nixltest

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

// The shim's register_mem reads one byte of every page of the DRAM it
// registers through the kernel (agent parameter prefault, default true), so
// that the kernel's first access to each page, which UCX's cma copies make
// and which a VM with shadow page tables makes expensive, happens at
// registration and not inside the first transfers (plugins/nixl/README.md,
// "The first request to a peer"). Seen from here: a file mapping this
// process never touched has no page-table entries; after register_mem
// every page of the registered range has one (/proc/self/pagemap), its
// bytes unchanged. With prefault=false registration maps none, which also
// shows that NIXL's registerMem alone does not touch the pages.
func TestPrefault(t *testing.T) {
	p := load(t)
	pg := os.Getpagesize()
	const pages = 64
	size := pages * pg

	register := func(t *testing.T, params []plugin.Param, mem []byte, start, end int) error {
		t.Helper()
		a, err := p.NewAgent(uniqueName(t, "prefault"), params...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { a.Close() })
		_, err = a.Register([]abi.MemDesc{{Addr: addr(mem) + uint64(start), Len: uint64(end - start), MemKind: abi.DRAM}})
		return err
	}

	// The range starts and ends inside a page: the first page counts from
	// the range's first byte, the last from its page start.
	t.Run("default", func(t *testing.T) {
		mem, want := untouchedFileMapping(t, size)
		if n := mappedPages(t, mem); n != 0 {
			t.Fatalf("%d of %d pages mapped before registration; the test needs an untouched mapping", n, pages)
		}
		if err := register(t, nil, mem, 100, size-100); err != nil {
			t.Fatalf("register: %v", err)
		}
		if n := mappedPages(t, mem); n != pages {
			t.Errorf("after register_mem %d of %d pages are mapped, want all (prefault)", n, pages)
		}
		if !bytes.Equal(mem, want) {
			t.Errorf("registration changed the registered bytes")
		}
	})

	t.Run("off", func(t *testing.T) {
		mem, _ := untouchedFileMapping(t, size)
		if err := register(t, []plugin.Param{{Key: "prefault", Value: "false"}}, mem, 0, size); err != nil {
			t.Fatalf("register: %v", err)
		}
		if n := mappedPages(t, mem); n != 0 {
			t.Errorf("prefault=false: %d of %d pages mapped after register_mem, want none", n, pages)
		}
	})

	// A page the kernel cannot read ends the pass without failing the
	// registration; the pages before it were read.
	t.Run("unreadable tail", func(t *testing.T) {
		mem, _ := untouchedFileMapping(t, size)
		if err := syscall.Mprotect(mem[size/2:], syscall.PROT_NONE); err != nil {
			t.Fatal(err)
		}
		if err := register(t, nil, mem, 0, size); err != nil {
			t.Fatalf("register of a range with a PROT_NONE half: %v", err)
		}
		if n := mappedPages(t, mem[:size/2]); n != pages/2 {
			t.Errorf("%d of the %d readable pages mapped, want all", n, pages/2)
		}
		if n := mappedPages(t, mem[size/2:]); n != 0 {
			t.Errorf("%d PROT_NONE pages mapped", n)
		}
	})

	t.Run("bad value", func(t *testing.T) {
		a, err := p.NewAgent(uniqueName(t, "prefault"), plugin.Param{Key: "prefault", Value: "sometimes"})
		if err == nil {
			a.Close()
			t.Fatal("prefault=sometimes accepted")
		}
		expectCode(t, "prefault=sometimes", err, abi.ErrInvalidParam)
	})
}

// untouchedFileMapping maps a file of size bytes (a pattern, written with
// write(2), so it sits in the page cache) shared and touches none of the
// mapping, and returns the mapping and the bytes it holds.
func untouchedFileMapping(t *testing.T, size int) (mem, want []byte) {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "prefault")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	want = make([]byte, size)
	fill(want, 3)
	if _, err := f.Write(want); err != nil {
		t.Fatal(err)
	}
	mem, err = syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Munmap(mem) })
	return mem, want
}

// mappedPages counts the pages of mem that have a present page-table entry
// in this process (bit 63 of their /proc/self/pagemap entry).
func mappedPages(t *testing.T, mem []byte) int {
	t.Helper()
	f, err := os.Open("/proc/self/pagemap")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	pg := uint64(os.Getpagesize())
	first, last := addr(mem)/pg, (addr(mem)+uint64(len(mem))-1)/pg
	buf := make([]byte, 8*(last-first+1))
	if _, err := f.ReadAt(buf, int64(first*8)); err != nil {
		t.Fatal(err)
	}
	n := 0
	for i := 0; i < len(buf); i += 8 {
		if binary.LittleEndian.Uint64(buf[i:])&(1<<63) != 0 {
			n++
		}
	}
	return n
}

// TestFirstTransfer measures what prefault is for: the first and the
// second transfer of a 128 MiB request of 4096 scattered 32 KiB blocks
// (a demo request's shape) between two agents of this process, over fresh
// pools allocated as an engine's are (MAP_POPULATE, then written by user
// space), with prefault=false and with the default, WRITE and READ, each
// with the host's initiator defaults (plugin.ForSide). It logs the times;
// it fails only when a transfer fails or lands wrong bytes, since on a
// shared machine a time bound would not hold. With prefault=false on this
// machine (a PVM guest) the first transfer took several times the second;
// see plugins/nixl/README.md, "The first request to a peer".
//
//	KVHOST_NIXL_OVERHEAD=1 go test ./plugins/nixl/nixltest -run FirstTransfer -v -count=1
func TestFirstTransfer(t *testing.T) {
	if os.Getenv("KVHOST_NIXL_OVERHEAD") != "1" {
		t.Skip("a measurement: set KVHOST_NIXL_OVERHEAD=1 to run it")
	}
	p := load(t)
	const blk, nblk = 32 << 10, 4096
	const size = blk * nblk
	// The same shuffled block order on both sides: NIXL merges only
	// descriptors adjacent on both, so these stay 4096 and are split over
	// the initiator's worker threads, as an engine's scattered pages are.
	order := rand.New(rand.NewPCG(1, 2)).Perm(nblk)
	descs := func(b []byte) []abi.XferDesc {
		d := make([]abi.XferDesc, nblk)
		for i, o := range order {
			d[i] = abi.XferDesc{Addr: addr(b) + uint64(o*blk), Len: blk, Count: 1}
		}
		return d
	}
	idx := make([]int32, nblk)
	for i := range idx {
		idx[i] = int32(i)
	}
	for _, prefault := range []string{"false", "true"} {
		for _, op := range []abi.Op{abi.Write, abi.Read} {
			params := []plugin.Param{{Key: "prefault", Value: prefault}}
			init := populatedSide(t, p, uniqueName(t, "init"), size, p.ForSide(plugin.Initiator, params)...)
			target := populatedSide(t, p, uniqueName(t, "target"), size, p.ForSide(plugin.Target, params)...)
			peer := connect(t, init, target)
			ld, err := init.a.PrepLocal(abi.DRAM, descs(init.buf))
			if err != nil {
				t.Fatal(err)
			}
			rd, err := init.a.PrepRemote(peer, abi.DRAM, descs(target.buf))
			if err != nil {
				t.Fatal(err)
			}
			src, dst := init.buf, target.buf
			if op == abi.Read {
				src, dst = dst, src
			}
			var took [2]time.Duration
			for i := range took {
				fill(src, byte(i+1))
				x, err := init.a.MakePreppedXfer(op, ld, idx, rd, idx, nil)
				if err != nil {
					t.Fatal(err)
				}
				start := time.Now()
				if _, err := x.Post(); err != nil {
					t.Fatalf("post: %v", err)
				}
				wait(t, x, "transfer")
				took[i] = time.Since(start)
				x.Close()
				if !bytes.Equal(src, dst) {
					t.Fatalf("prefault=%s %v transfer %d: bytes differ", prefault, op, i+1)
				}
			}
			t.Logf("prefault=%-5s %-5v first %7.1f ms, second %7.1f ms (%.1fx)", prefault, op,
				took[0].Seconds()*1e3, took[1].Seconds()*1e3, took[0].Seconds()/took[1].Seconds())
			rd.Close()
			ld.Close()
		}
	}
}

// populatedSide is newSide over memory an engine would have: mapped with
// MAP_POPULATE and written by user space before registration.
func populatedSide(t *testing.T, p *plugin.Plugin, name string, size int, params ...plugin.Param) *side {
	t.Helper()
	buf, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS|syscall.MAP_POPULATE)
	if err != nil {
		t.Fatalf("mmap: %v", err)
	}
	fill(buf, 0)
	a, err := p.NewAgent(name, params...)
	if err != nil {
		syscall.Munmap(buf)
		t.Fatalf("agent %s: %v", name, err)
	}
	regs, err := a.Register([]abi.MemDesc{{Addr: addr(buf), Len: uint64(size), MemKind: abi.DRAM}})
	if err != nil {
		a.Close()
		syscall.Munmap(buf)
		t.Fatalf("register: %v", err)
	}
	t.Cleanup(func() {
		if err := a.Close(); err != nil {
			t.Errorf("closing agent %s: %v", name, err)
		}
		syscall.Munmap(buf)
	})
	return &side{a: a, buf: buf, reg: regs[0]}
}
