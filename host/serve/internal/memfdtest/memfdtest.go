// Package memfdtest makes memfds for tests of the sidecar's memfd
// regions (docs/engine-api.md, "Memory"): memfd_create, sized and sealed
// as the test asks, and held open by a child process, as an engine
// holds its pool, so the test names it as the engine would:
// "/proc/<child pid>/fd/3". The sidecar refuses descriptors of its own
// process, and the tests run the sidecar in the test process: the memfd
// must be another process's.
package memfdtest

import (
	"os"
	"os/exec"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"unsafe"
)

// The memfd_create(2) and fcntl(2) constants of linux/memfd.h and
// linux/fcntl.h that package syscall does not name.
const (
	MFD_CLOEXEC       = 0x1
	MFD_ALLOW_SEALING = 0x2
	MFD_HUGETLB       = 0x4

	F_ADD_SEALS = 1033
	F_GET_SEALS = 1034

	F_SEAL_SEAL         = 0x1
	F_SEAL_SHRINK       = 0x2
	F_SEAL_GROW         = 0x4
	F_SEAL_WRITE        = 0x8
	F_SEAL_FUTURE_WRITE = 0x10
)

// Memfd is a memfd the test process and a child both hold.
type Memfd struct {
	// FD is the test process's descriptor (closed at the end of the test
	// unless the test closed it: see Close).
	FD int
	// Pid is the child holding the memfd as its descriptor 3.
	Pid int
	// SHM is the name an engine gives the sidecar: /proc/<Pid>/fd/3.
	SHM string
	// Name is the memfd's name ("kvhost-test-<n>"): /proc/*/maps shows
	// its mappings as "/memfd:<Name> (deleted)".
	Name string

	closed bool
}

// Create returns a new memfd of size bytes (flags: MFD_* beyond
// MFD_CLOEXEC), filled with a pattern (byte i is i*13+1) and sealed with
// seals (0: none), without a holder: the test process alone has it.
func Create(t testing.TB, name string, size int, flags, seals int) int {
	t.Helper()
	p, err := syscall.BytePtrFromString(name)
	if err != nil {
		t.Fatal(err)
	}
	r, _, errno := syscall.Syscall(sysMemfdCreate, uintptr(unsafe.Pointer(p)), uintptr(MFD_CLOEXEC|flags), 0)
	if errno != 0 {
		t.Fatalf("memfd_create(%q, %#x): %v", name, flags, errno)
	}
	fd := int(r)
	if err := syscall.Ftruncate(fd, int64(size)); err != nil {
		syscall.Close(fd)
		t.Fatalf("ftruncate memfd to %d: %v", size, err)
	}
	if flags&MFD_HUGETLB == 0 && size > 0 {
		data := make([]byte, size)
		for i := range data {
			data[i] = byte(i*13 + 1)
		}
		if _, err := syscall.Pwrite(fd, data, 0); err != nil {
			syscall.Close(fd)
			t.Fatalf("filling memfd: %v", err)
		}
	}
	if seals != 0 {
		if err := AddSeals(fd, seals); err != nil {
			syscall.Close(fd)
			t.Fatalf("sealing memfd %#x: %v", seals, err)
		}
	}
	return fd
}

// AddSeals is fcntl(fd, F_ADD_SEALS, seals).
func AddSeals(fd, seals int) error {
	if _, _, errno := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), F_ADD_SEALS, uintptr(seals)); errno != 0 {
		return errno
	}
	return nil
}

var seq atomic.Uint64

// New is Create with a holder: a child process (cat, reading a pipe the
// test holds, so it exits with the test process whatever happens) that
// has the memfd as its descriptor 3. The child is ended and the test's
// descriptor closed at the end of the test.
func New(t testing.TB, size int, flags, seals int) *Memfd {
	t.Helper()
	name := "kvhost-test-" + strconv.FormatUint(seq.Add(1), 10)
	fd := Create(t, name, size, flags, seals)
	m := &Memfd{FD: fd, Name: name}
	t.Cleanup(m.Close)
	m.Pid = Hold(t, fd)
	m.SHM = "/proc/" + strconv.Itoa(m.Pid) + "/fd/3"
	return m
}

// Hold starts a child process (cat, reading a pipe the test holds) with
// fd as its descriptor 3 and returns its pid; the child ends at the end
// of the test.
func Hold(t testing.TB, fd int) int {
	t.Helper()
	cmd := exec.Command("cat")
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	// Stdout and stderr are /dev/null (exec opens it).
	// A dup: exec closes the *os.File it hands over, and fd stays the test's.
	dup, err := syscall.Dup(fd)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(dup), "memfd")
	cmd.ExtraFiles = []*os.File{f}
	err = cmd.Start()
	f.Close()
	if err != nil {
		t.Fatalf("starting the memfd holder: %v", err)
	}
	t.Cleanup(func() {
		in.Close()
		cmd.Wait()
	})
	return cmd.Process.Pid
}

// Close closes the test's descriptor (once).
func (m *Memfd) Close() {
	if !m.closed {
		m.closed = true
		syscall.Close(m.FD)
	}
}

// Seals is fcntl(fd, F_GET_SEALS).
func Seals(fd int) (int, error) {
	r, _, errno := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), F_GET_SEALS, 0)
	if errno != 0 {
		return 0, errno
	}
	return int(r), nil
}

// FDsOf returns this process's descriptors open on the file fd names
// (same device and inode), from /proc/self/fd.
func FDsOf(t testing.TB, fd int) []int {
	t.Helper()
	var want syscall.Stat_t
	if err := syscall.Fstat(fd, &want); err != nil {
		t.Fatal(err)
	}
	return FDsOfInode(t, want.Dev, want.Ino)
}

// FDsOfInode returns this process's descriptors open on the file of
// device dev and inode ino, from /proc/self/fd.
func FDsOfInode(t testing.TB, dev, ino uint64) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		var st syscall.Stat_t
		if syscall.Stat("/proc/self/fd/"+e.Name(), &st) != nil {
			continue // closed meanwhile (ReadDir's own descriptor)
		}
		if st.Dev == dev && st.Ino == ino {
			out = append(out, n)
		}
	}
	return out
}
