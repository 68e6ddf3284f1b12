package nixltest

import (
	"bytes"
	"encoding/binary"
	"os"
	"syscall"
	"testing"

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
