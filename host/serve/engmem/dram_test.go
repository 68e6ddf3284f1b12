package engmem

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvhost/kvhost/abi"
)

var shmSeq atomic.Uint64

// newSHM creates a shared-memory object of size bytes filled with a
// pattern (byte i is i*7+seed), removed at the end of the test. It
// returns its POSIX name ("/kvhost-engmem-test-...") and path.
func newSHM(t testing.TB, size int) (name, path string) {
	t.Helper()
	name = fmt.Sprintf("/kvhost-engmem-test-%d-%d", os.Getpid(), shmSeq.Add(1))
	path = shmDir + name
	data := make([]byte, size)
	seed := byte(shmSeq.Load())
	for i := range data {
		data[i] = byte(i*7) + seed
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(path) })
	return name, path
}

// mapsOf counts this process's mappings of path (lines of
// /proc/self/maps naming it).
func mapsOf(t testing.TB, path string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasSuffix(l, " "+path) || strings.HasSuffix(l, " "+path+" (deleted)") {
			n++
		}
	}
	return n
}

// wantCode fails unless err is an *Error of code whose message holds
// every one of parts.
func wantCode(t testing.TB, err error, code string, parts ...string) {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v (%T), want *Error %s", err, err, code)
	}
	if e.Code != code {
		t.Fatalf("code %q (%s), want %q", e.Code, e.Msg, code)
	}
	for _, p := range parts {
		if !strings.Contains(e.Msg, p) {
			t.Fatalf("message %q does not name %q", e.Msg, p)
		}
	}
}

const page = 4096

func TestKindMemKind(t *testing.T) {
	if DRAM.MemKind() != abi.DRAM || VRAM.MemKind() != abi.VRAM {
		t.Fatalf("DRAM→%v VRAM→%v", DRAM.MemKind(), VRAM.MemKind())
	}
	if DRAM.String() != "dram" || VRAM.String() != "vram" {
		t.Fatal(DRAM.String(), VRAM.String())
	}
}

// TestDRAMSharedView: the region and the engine's file are one memory,
// both ways, by shm name and by path, at aligned and unaligned offsets.
func TestDRAMSharedView(t *testing.T) {
	for _, tc := range []struct {
		byPath         bool
		offset, length uint64
	}{
		{false, 0, 3 * page},
		{true, 0, 3 * page},
		{false, page, page},
		{false, 100, 5000},
		{true, 2*page + 17, page - 17},
		{false, 4*page - 1, 1},
	} {
		t.Run(fmt.Sprintf("path=%v/off=%d/len=%d", tc.byPath, tc.offset, tc.length), func(t *testing.T) {
			name, path := newSHM(t, 4*page)
			shm := name
			if tc.byPath {
				shm = path
			}
			var o Opener
			r, err := o.Open(Spec{Kind: DRAM, Addr: 0x7f0000001000, Length: tc.length, SHM: shm, Offset: tc.offset})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			file, _ := os.ReadFile(path)
			if uint64(len(r.Bytes)) != tc.length || uint64(cap(r.Bytes)) != tc.length {
				t.Fatalf("len %d cap %d, want %d", len(r.Bytes), cap(r.Bytes), tc.length)
			}
			if !bytes.Equal(r.Bytes, file[tc.offset:tc.offset+tc.length]) {
				t.Fatal("mapping does not hold the file's bytes at the offset")
			}
			if r.Local != uintptrOf(r.Bytes) {
				t.Fatalf("Local 0x%x, mapping at 0x%x", r.Local, uintptrOf(r.Bytes))
			}
			// Sidecar writes, engine reads.
			for i := range r.Bytes {
				r.Bytes[i] = ^r.Bytes[i]
			}
			file2, _ := os.ReadFile(path)
			for i := range file {
				want := file[i]
				if uint64(i) >= tc.offset && uint64(i) < tc.offset+tc.length {
					want = ^want
				}
				if file2[i] != want {
					t.Fatalf("file byte %d = %d, want %d", i, file2[i], want)
				}
			}
			// Engine writes, sidecar reads.
			f, err := os.OpenFile(path, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt([]byte("engine"), int64(tc.offset)); err != nil {
				t.Fatal(err)
			}
			f.Close()
			if n := min(6, int(tc.length)); string(r.Bytes[:n]) != "engine"[:n] {
				t.Fatalf("mapping reads %q after the engine wrote", r.Bytes[:n])
			}
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
			if r.Close() != nil {
				t.Fatal("second Close failed")
			}
			if n := mapsOf(t, path); n != 0 {
				t.Fatalf("%d mappings of %s left after Close", n, path)
			}
		})
	}
}

// TestDRAMRefused: every spec the sidecar must not map, with the words
// the engine sees.
func TestDRAMRefused(t *testing.T) {
	name, path := newSHM(t, 2*page)
	dir := fmt.Sprintf("%s/kvhost-engmem-test-%d-dir", shmDir, os.Getpid())
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	link := dir + "-passwd"
	if err := os.Symlink("/etc/passwd", link); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(link) })
	dirLink := dir + "-etc"
	if err := os.Symlink("/etc", dirLink); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(dirLink) })
	outside := filepath.Join(t.TempDir(), "kv")
	if err := os.WriteFile(outside, make([]byte, page), 0o600); err != nil {
		t.Fatal(err)
	}
	const a = 0x10000
	for _, tc := range []struct {
		what  string
		spec  Spec
		parts []string
	}{
		{"short", Spec{Addr: a, Length: 2 * page, SHM: name, Offset: 1},
			[]string{fmt.Sprintf("region of %d bytes at offset 1 is past the end of %s (size %d)", 2*page, name, 2*page)}},
		{"offset past end", Spec{Addr: a, Length: 1, SHM: name, Offset: 2 * page}, []string{"past the end"}},
		{"zero length", Spec{Addr: a, Length: 0, SHM: name}, []string{"length 0"}},
		{"address 0", Spec{Addr: 0, Length: 1, SHM: name}, []string{"address 0"}},
		{"address wraps", Spec{Addr: 1<<64 - page, Length: 2 * page, SHM: name}, []string{"wraps"}},
		{"offset overflows", Spec{Addr: a, Length: 2, SHM: name, Offset: 1<<64 - 1}, []string{"overflows"}},
		{"huge", Spec{Addr: a, Length: 1 << 60, SHM: name}, []string{"larger than"}},
		{"no name", Spec{Addr: a, Length: 1}, []string{"no shm name"}},
		{"relative", Spec{Addr: a, Length: 1, SHM: name[1:]}, []string{"neither"}},
		{"slash", Spec{Addr: a, Length: 1, SHM: "/"}, []string{"not a shared-memory name"}},
		{"dotdot name", Spec{Addr: a, Length: 1, SHM: "/.."}, []string{"not a shared-memory name"}},
		{"NUL", Spec{Addr: a, Length: 1, SHM: name + "\x00x"}, []string{"NUL"}},
		{"missing name", Spec{Addr: a, Length: 1, SHM: name + "-gone"}, []string{"no such"}},
		{"missing path", Spec{Addr: a, Length: 1, SHM: path + "-gone"}, []string{"no such"}},
		{"directory", Spec{Addr: a, Length: 1, SHM: "/" + filepath.Base(dir)}, []string{filepath.Base(dir)}},
		{"directory path", Spec{Addr: a, Length: 1, SHM: dir}, []string{filepath.Base(dir)}},
		{"shm folder itself", Spec{Addr: a, Length: 1, SHM: shmDir + "/"}, []string{"not under"}},
		{"outside", Spec{Addr: a, Length: 1, SHM: outside}, []string{"not under /dev/shm or /dev/hugepages"}},
		{"etc", Spec{Addr: a, Length: 1, SHM: "/etc/passwd"}, []string{"not under"}},
		{"missing outside", Spec{Addr: a, Length: 1, SHM: "/etc/kvhost-none"}, []string{"not under"}},
		{"prefix lookalike", Spec{Addr: a, Length: 1, SHM: shmDir + "x/kv"}, []string{"not under"}},
		{"dotdot path", Spec{Addr: a, Length: 1, SHM: shmDir + "/../../etc/passwd"}, []string{"not under"}},
		{"symlink path escape", Spec{Addr: a, Length: 1, SHM: link}, []string{"resolves to \"/etc/passwd\""}},
		{"symlink name escape", Spec{Addr: a, Length: 1, SHM: "/" + filepath.Base(link)}, []string{"symbolic link"}},
		{"symlinked folder escape", Spec{Addr: a, Length: 1, SHM: dirLink + "/passwd"}, []string{"resolves to \"/etc/passwd\""}},
		{"unknown kind", Spec{Kind: 7, Addr: a, Length: 1, SHM: name}, []string{"kind"}},
	} {
		t.Run(tc.what, func(t *testing.T) {
			var o Opener
			r, err := o.Open(tc.spec)
			if err == nil {
				r.Close()
				t.Fatal("opened")
			}
			wantCode(t, err, CodeBadRegion, tc.parts...)
		})
	}
	if n := mapsOf(t, path); n != 0 {
		t.Fatalf("%d mappings left", n)
	}
}

// TestDRAMSymlinkInside: a path whose links stay under /dev/shm is the
// file it leads to.
func TestDRAMSymlinkInside(t *testing.T) {
	_, path := newSHM(t, page)
	link := path + "-link"
	if err := os.Symlink(path, link); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(link)
	var o Opener
	r, err := o.Open(Spec{Addr: 0x1000, Length: page, SHM: link})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if n := mapsOf(t, path); n != 1 {
		t.Fatalf("%d mappings of %s, want 1", n, path)
	}
}

func readAt(path string, off int64, n int) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b := make([]byte, n)
	_, err = f.ReadAt(b, off)
	return b, err
}

// TestDRAMSwappedAfterCheck: a folder replaced by a link out of /dev/shm
// between the path check and open (a race another process could win) is
// caught by asking the kernel where the opened file lies.
func TestDRAMSwappedAfterCheck(t *testing.T) {
	dir := fmt.Sprintf("%s/kvhost-engmem-test-%d-swap", shmDir, os.Getpid())
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir); os.RemoveAll(dir + "-old") })
	if err := os.WriteFile(dir+"/kv", make([]byte, page), 0o600); err != nil {
		t.Fatal(err)
	}
	outside := t.TempDir()
	if err := os.WriteFile(outside+"/kv", make([]byte, page), 0o600); err != nil {
		t.Fatal(err)
	}
	testHookBeforeOpen = func(string) {
		if err := os.Rename(dir, dir+"-old"); err != nil {
			t.Error(err)
		}
		if err := os.Symlink(outside, dir); err != nil {
			t.Error(err)
		}
	}
	defer func() { testHookBeforeOpen = nil }()
	var o Opener
	r, err := o.Open(Spec{Addr: 0x1000, Length: page, SHM: dir + "/kv"})
	if err == nil {
		r.Close()
		t.Fatal("opened a file outside /dev/shm")
	}
	wantCode(t, err, CodeBadRegion, "opened \""+outside+"/kv\", which is not under /dev/shm")
	if n := mapsOf(t, outside+"/kv"); n != 0 {
		t.Fatalf("%d mappings of the outside file", n)
	}
}

// TestMapWindow: mmap offsets rounded down to the page (4 KiB) or huge
// page (2 MiB, hugetlbfs), lengths rounded up to it.
func TestMapWindow(t *testing.T) {
	const huge = 2 << 20
	for _, tc := range []struct{ offset, length, align, start, delta, mapLen uint64 }{
		{0, 1, page, 0, 0, page},
		{0, page, page, 0, 0, page},
		{100, 5000, page, 0, 100, 2 * page},
		{page - 1, 2, page, 0, page - 1, 2 * page},
		{3*page + 5, page, page, 3 * page, 5, 2 * page},
		{huge + 4096, huge, huge, huge, 4096, 2 * huge},
		{5 * huge, 1, huge, 5 * huge, 0, huge},
	} {
		start, delta, mapLen, ok := mapWindow(tc.offset, tc.length, tc.align)
		if !ok || start != tc.start || delta != tc.delta || mapLen != tc.mapLen {
			t.Errorf("mapWindow(%d, %d, %d) = %d, %d, %d; want %d, %d, %d", tc.offset, tc.length, tc.align,
				start, delta, mapLen, tc.start, tc.delta, tc.mapLen)
		}
	}
	for _, length := range []uint64{1<<64 - 50, 1<<64 - 100, 1<<64 - 101} {
		if _, _, mapLen, ok := mapWindow(100, length, page); ok {
			t.Errorf("mapWindow(100, %d) overflowed to %d unnoticed", length, mapLen)
		}
	}
}
