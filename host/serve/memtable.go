package serve

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// memRegion is one registered region: the engine's range and the
// sidecar's mapping of it.
type memRegion struct {
	memSpec
	ID    uint64
	Local uintptr
	Bytes []byte // the mapping (DRAM); nil for VRAM
	unmap func()
}

// memTable is one connection's registered regions. Not safe for
// concurrent use: the session's goroutine owns it.
type memTable struct {
	regions []*memRegion // sorted by Addr
	nextID  uint64
}

func newMemTable() *memTable { return &memTable{} }

// add maps every spec or none.
func (t *memTable) add(specs []memSpec) ([]*memRegion, error) {
	// Overlaps with each other and with what is registered.
	all := slices.Clone(t.regions)
	for i := range specs {
		all = append(all, &memRegion{memSpec: specs[i]})
	}
	slices.SortFunc(all, func(a, b *memRegion) int {
		switch {
		case a.Addr < b.Addr:
			return -1
		case a.Addr > b.Addr:
			return 1
		}
		return 0
	})
	for i := 1; i < len(all); i++ {
		if all[i-1].Addr+all[i-1].Length > all[i].Addr {
			return nil, errorf(CodeBadRegion, "region [%#x, +%d) overlaps region [%#x, +%d) of this connection",
				all[i].Addr, all[i].Length, all[i-1].Addr, all[i-1].Length)
		}
	}
	var out []*memRegion
	for i, s := range specs {
		r, merr := mapRegion(s)
		if merr != nil {
			for _, o := range out {
				o.unmap()
			}
			e := asError(merr, CodeBadRegion)
			return nil, &Error{Code: e.Code, Message: fmt.Sprintf("regions[%d]: %s", i, e.Message)}
		}
		t.nextID++
		r.ID = t.nextID
		out = append(out, r)
	}
	t.regions = append(t.regions, out...)
	slices.SortFunc(t.regions, func(a, b *memRegion) int {
		if a.Addr < b.Addr {
			return -1
		}
		return 1
	})
	return out, nil
}

// shmPath resolves register_memory's shm: a POSIX shared-memory name
// ("/name", under /dev/shm) or an absolute path under /dev/shm or
// /dev/hugepages.
func shmPath(name string) (string, error) {
	if name == "" {
		return "", errorf(CodeBadRegion, "empty shm name")
	}
	if strings.HasPrefix(name, "/") && strings.Count(name, "/") == 1 {
		return "/dev/shm" + name, nil
	}
	p := filepath.Clean(name)
	if p != name || !(strings.HasPrefix(p, "/dev/shm/") || strings.HasPrefix(p, "/dev/hugepages/")) {
		return "", errorf(CodeBadRegion, "shm %q is neither a POSIX shared-memory name nor a file under /dev/shm or /dev/hugepages", name)
	}
	return p, nil
}

func mapRegion(s memSpec) (*memRegion, error) {
	if s.Kind != "dram" {
		return nil, errorf(CodeUnsupported, "vram regions need the engmem table (CUDA IPC) which this sidecar does not have")
	}
	path, err := shmPath(s.SHM)
	if err != nil {
		return nil, err
	}
	f, oerr := os.OpenFile(path, os.O_RDWR, 0)
	if oerr != nil {
		return nil, errorf(CodeBadRegion, "shm %q: %v", s.SHM, oerr)
	}
	defer f.Close()
	st, serr := f.Stat()
	if serr != nil {
		return nil, errorf(CodeBadRegion, "shm %q: %v", s.SHM, serr)
	}
	if !st.Mode().IsRegular() {
		return nil, errorf(CodeBadRegion, "shm %q is not a regular file", s.SHM)
	}
	end := s.Offset + s.Length
	if end < s.Offset || uint64(st.Size()) < end {
		return nil, errorf(CodeBadRegion, "shm %q holds %d bytes, shorter than offset %d + length %d", s.SHM, st.Size(), s.Offset, s.Length)
	}
	pg := uint64(os.Getpagesize())
	base := s.Offset / pg * pg
	n := int(end - base)
	mem, merr := unix.Mmap(int(f.Fd()), int64(base), n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if merr != nil {
		return nil, errorf(CodeBadRegion, "shm %q: mmap %d bytes at %d: %v", s.SHM, n, base, merr)
	}
	b := mem[s.Offset-base:]
	return &memRegion{memSpec: s, Bytes: b, Local: uintptr(unsafe.Pointer(&b[0])), unmap: func() { unix.Munmap(mem) }}, nil
}

// find returns the region holding [addr, addr+length).
func (t *memTable) find(addr, length uint64) (*memRegion, error) {
	i, _ := slices.BinarySearchFunc(t.regions, addr, func(r *memRegion, a uint64) int {
		switch {
		case r.Addr+r.Length <= a:
			return -1
		case r.Addr > a:
			return 1
		}
		return 0
	})
	if i < len(t.regions) {
		r := t.regions[i]
		if addr >= r.Addr && addr+length >= addr && addr+length <= r.Addr+r.Length {
			return r, nil
		}
	}
	return nil, errorf(CodeBadRegion, "range [%#x, +%d) is not inside one region of this connection", addr, length)
}

// translate maps an engine pointer range to the sidecar's address.
func (t *memTable) translate(addr, length uint64) (uintptr, *memRegion, error) {
	r, err := t.find(addr, length)
	if err != nil {
		return 0, nil, err
	}
	return r.Local + uintptr(addr-r.Addr), r, nil
}

// bytes returns the sidecar's mapping of a DRAM range.
func (t *memTable) bytes(addr, length uint64) ([]byte, error) {
	r, err := t.find(addr, length)
	if err != nil {
		return nil, err
	}
	if r.Bytes == nil {
		return nil, errorf(CodeBadRegion, "range [%#x, +%d) is not host memory", addr, length)
	}
	off := addr - r.Addr
	return r.Bytes[off : off+length : off+length], nil
}

// byID returns the region with the id.
func (t *memTable) byID(id uint64) *memRegion {
	for _, r := range t.regions {
		if r.ID == id {
			return r
		}
	}
	return nil
}

// remove unmaps regions by id (all known: checked by the caller).
func (t *memTable) remove(ids []uint64) {
	for _, id := range ids {
		for i, r := range t.regions {
			if r.ID == id {
				r.unmap()
				t.regions = slices.Delete(t.regions, i, i+1)
				break
			}
		}
	}
}

func (t *memTable) len() int { return len(t.regions) }

// close unmaps everything.
func (t *memTable) close() {
	for _, r := range t.regions {
		r.unmap()
	}
	t.regions = nil
}
