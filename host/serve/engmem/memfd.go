package engmem

import (
	"bytes"
	"errors"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// A DRAM region may name a memfd of another process by its descriptor:
// "/proc/<pid>/fd/<n>". Host memory in POSIX shm can be truncated by its
// engine at any time, and an access through a mapping past the new end is
// a SIGBUS; a memfd sealed with F_SEAL_SHRINK cannot shrink (the kernel
// refuses any ftruncate to a smaller size, the seal cannot be removed),
// so a mapping within its size can never fault. The sidecar keeps a
// descriptor of the memfd open while the region is registered: a plugin
// that wants to map such memory itself finds it in /proc/self/fd by the
// mapping's device and inode.
//
// Trust: as with /dev/shm names, the sidecar opens what its own user may
// open (the control socket is the user's alone): /proc/<pid>/fd of a
// process needs ptrace read access to it, that is the same user or
// privileges. What it adds is that only sealed memfds are mapped, and
// never a descriptor of the sidecar's own process (its sockets, its log,
// memory it holds for other engines or its plugin). Before opening, the
// link is read: only a target the kernel names "/memfd:..." is opened, so
// a device, FIFO or socket is never opened through this form. Between
// that read and the open the engine can swap the descriptor; what is then
// opened is refused by the checks after open, but its open has happened:
// it is a file the sidecar's user could open anyway.

// The fcntl(2) seals and commands of linux/fcntl.h that package syscall
// does not name.
const (
	fGetSeals        = 1034 // F_GET_SEALS
	sealShrink       = 0x2  // F_SEAL_SHRINK
	sealWrite        = 0x8  // F_SEAL_WRITE
	sealFutureWrite  = 0x10 // F_SEAL_FUTURE_WRITE
	memfdLinkPrefix  = "/memfd:"
	pidMaxLimit      = 1 << 22 // PID_MAX_LIMIT: no pid is larger
	maxProcStatusLen = 64 << 10
)

// procFDName reports whether name is the memfd form "/proc/<pid>/fd/<n>"
// (ok), with its pid and descriptor; e is a refusal for names of that
// shape that can never be used ("self", "thread-self", a pid of 0, a
// number with leading zeros or out of range). A name of any other shape
// is not the memfd form (ok and e both false/nil): it is resolved as a
// shm name or path.
func procFDName(name string) (pid, fd int, ok bool, e *Error) {
	// The longest valid name is 27 bytes: a longer one, or one elsewhere,
	// is not split at all.
	if len(name) > 64 || !strings.HasPrefix(name, "/proc/") {
		return 0, 0, false, nil
	}
	parts := strings.Split(name, "/")
	if len(parts) != 5 || parts[0] != "" || parts[1] != "proc" || parts[3] != "fd" {
		return 0, 0, false, nil
	}
	p, n := parts[2], parts[4]
	if p == "self" || p == "thread-self" {
		if _, ok := decimal(n, 1<<31-1, true); ok {
			return 0, 0, false, errorf(CodeBadRegion, "shm %q names a descriptor of the sidecar itself (/proc/%s is the reader): name the engine's memfd by the engine's pid", name, p)
		}
		return 0, 0, false, nil
	}
	if !allDigits(p) || !allDigits(n) {
		return 0, 0, false, nil
	}
	pid, okp := decimal(p, pidMaxLimit, false)
	if !okp {
		return 0, 0, false, errorf(CodeBadRegion, "shm %q: %q is not a process id (a decimal number from 1 to %d without leading zeros)", name, p, pidMaxLimit)
	}
	fd, okf := decimal(n, 1<<31-1, true)
	if !okf {
		return 0, 0, false, errorf(CodeBadRegion, "shm %q: %q is not a descriptor number (a decimal number below 2^31 without leading zeros)", name, n)
	}
	return pid, fd, true, nil
}

func allDigits(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// decimal parses s as a canonical decimal number (no sign, no leading
// zeros) of at most max, and of at least 1 unless zero is allowed.
func decimal(s string, max uint64, zero bool) (int, bool) {
	if !allDigits(s) || len(s) > 1 && s[0] == '0' || len(s) > 19 {
		return 0, false
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil || v > max || v == 0 && !zero {
		return 0, false
	}
	return int(v), true
}

// testHookBeforeMemfdOpen, when set by a test, runs between the check of
// the descriptor's link and its open and returns the path to open in its
// place: what a racing engine that swaps the descriptor there achieves.
var testHookBeforeMemfdOpen func(link string) string

// openMemfd opens the memfd that descriptor fd of process pid holds
// (name is the engine's "/proc/<pid>/fd/<n>") and checks that it is a
// shmem memfd sealed against shrinking and not against writing. The
// caller maps it and keeps the descriptor until the region is released.
func openMemfd(name string, pid, fd int) (int, *Error) {
	notMemfd := "shm " + strconv.Quote(name) + " is not a memfd sealed against shrinking (F_SEAL_SHRINK): "
	proc := "/proc/" + strconv.Itoa(pid)

	// Never the sidecar's own descriptors, whether named by its pid or by
	// the id of one of its threads (/proc/<tid> is the same process).
	tgid, err := procTgid(proc)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return -1, errorf(CodeBadRegion, "shm %q: no process %d", name, pid)
		}
		return -1, errorf(CodeBadRegion, "shm %q: process %d: %v", name, pid, err)
	}
	if tgid == os.Getpid() {
		return -1, errorf(CodeBadRegion, "shm %q names a descriptor of the sidecar itself (process %d): name the engine's memfd by the engine's pid", name, os.Getpid())
	}

	link := proc + "/fd/" + strconv.Itoa(fd)
	target, err := os.Readlink(link)
	if err != nil {
		switch {
		case errors.Is(err, os.ErrNotExist):
			return -1, errorf(CodeBadRegion, "shm %q: process %d has no descriptor %d", name, pid, fd)
		case errors.Is(err, os.ErrPermission):
			return -1, errorf(CodeBadRegion, "shm %q: the sidecar may not read process %d's descriptors (another user's process?): %v", name, pid, err)
		}
		return -1, errorf(CodeBadRegion, "shm %q: %v", name, err)
	}
	if !strings.HasPrefix(target, memfdLinkPrefix) {
		return -1, errorf(CodeBadRegion, "%sit is %q", notMemfd, target)
	}
	if testHookBeforeMemfdOpen != nil {
		link = testHookBeforeMemfdOpen(link)
	}

	// Opening /proc/<pid>/fd/<n> follows the magic link to the open file
	// itself (a memfd has no path to open): O_NOFOLLOW cannot be used
	// here, it would refuse the very link this form names. What was
	// opened is checked below on the descriptor. O_NONBLOCK: a FIFO
	// swapped in behind the link does not block the open.
	mfd, err := syscall.Open(link, syscall.O_RDWR|syscall.O_CLOEXEC|syscall.O_NONBLOCK, 0)
	if err != nil {
		switch err {
		case syscall.ENOENT:
			return -1, errorf(CodeBadRegion, "shm %q: process %d has no descriptor %d", name, pid, fd)
		case syscall.EACCES, syscall.EPERM:
			return -1, errorf(CodeBadRegion, "shm %q: the sidecar may not open it read-write: %v", name, err)
		}
		return -1, errorf(CodeBadRegion, "shm %q: open: %v", name, err)
	}
	refuse := func(format string, args ...any) (int, *Error) {
		syscall.Close(mfd)
		return -1, errorf(CodeBadRegion, format, args...)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(mfd, &st); err != nil {
		return refuse("shm %q: fstat: %v", name, err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return refuse("%snot a regular file", notMemfd)
	}
	// A hugetlbfs memfd can be sealed too, but a hole punched in it
	// (fallocate, which F_SEAL_SHRINK does not forbid) is refilled on the
	// next access from the huge page pool, and that access is a SIGBUS
	// when the pool is empty: the seal does not make its mappings safe.
	var sfs syscall.Statfs_t
	if err := syscall.Fstatfs(mfd, &sfs); err != nil {
		return refuse("shm %q: fstatfs: %v", name, err)
	}
	if uint32(sfs.Type) == hugetlbfsMagic {
		return refuse("shm %q is a hugetlbfs memfd: refused, since a hole punched in it faults (SIGBUS) when huge pages run out, seal or not; use a memfd without MFD_HUGETLB", name)
	}
	// F_GET_SEALS succeeds only on memfds (shmem files; hugetlbfs is
	// refused above): any other file is EINVAL.
	seals, _, errno := syscall.Syscall(syscall.SYS_FCNTL, uintptr(mfd), fGetSeals, 0)
	if errno != 0 {
		if errno == syscall.EINVAL {
			return refuse("%snot a memfd (F_GET_SEALS: %v)", notMemfd, errno)
		}
		return refuse("shm %q: F_GET_SEALS: %v", name, errno)
	}
	if seals&sealShrink == 0 {
		return refuse("%sits seals are %#x", notMemfd, seals)
	}
	if seals&(sealWrite|sealFutureWrite) != 0 {
		return refuse("shm %q is sealed against writing (seals %#x): the sidecar writes into engine memory", name, seals)
	}
	return mfd, nil
}

// procTgid returns the thread-group id (the process id) of the task at
// proc ("/proc/<id>"), from its status file.
func procTgid(proc string) (int, error) {
	f, err := os.Open(proc + "/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	b := make([]byte, maxProcStatusLen)
	n, err := f.Read(b)
	if err != nil {
		return 0, err
	}
	for _, l := range bytes.Split(b[:n], []byte("\n")) {
		if v, ok := bytes.CutPrefix(l, []byte("Tgid:")); ok {
			t, err := strconv.Atoi(string(bytes.TrimSpace(v)))
			if err != nil {
				return 0, errors.New("unreadable Tgid in " + proc + "/status")
			}
			return t, nil
		}
	}
	return 0, errors.New("no Tgid in " + proc + "/status")
}
