package engmem

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// The folders a DRAM region's file may lie in: POSIX shared memory and
// the hugetlbfs mount point most distributions use.
const (
	shmDir       = "/dev/shm"
	hugepagesDir = "/dev/hugepages"
)

// hugetlbfsMagic is HUGETLBFS_MAGIC of linux/magic.h: mappings of a file
// there must start at a multiple of the huge page size (statfs f_bsize).
const hugetlbfsMagic = 0x958458f6

// maxSHMName bounds the SHM field (PATH_MAX).
const maxSHMName = 4096

// allowedRoots returns shmDir and hugepagesDir with their symbolic links
// resolved (on some systems /dev/shm links to /run/shm), once per process;
// a folder that does not exist is left out.
var allowedRoots = sync.OnceValue(func() []string {
	var roots []string
	for _, d := range []string{shmDir, hugepagesDir} {
		if r, err := filepath.EvalSymlinks(d); err == nil {
			roots = append(roots, r)
		}
	}
	return roots
})

// underRoot reports whether path names a file strictly inside one of the
// allowed folders (with their links resolved).
func underRoot(path string) bool {
	return underAny(path, allowedRoots())
}

func underAny(path string, roots []string) bool {
	for _, r := range roots {
		if strings.HasPrefix(path, r+"/") && len(path) > len(r)+1 {
			return true
		}
	}
	return false
}

// resolveSHM turns a Spec.SHM into the path to open, refusing anything
// that is not a shm name or a path under /dev/shm or /dev/hugepages.
func resolveSHM(name string) (string, *Error) {
	switch {
	case name == "":
		return "", errorf(CodeBadRegion, "dram region has no shm name")
	case len(name) > maxSHMName:
		return "", errorf(CodeBadRegion, "shm name of %d bytes is longer than %d", len(name), maxSHMName)
	case strings.IndexByte(name, 0) >= 0:
		return "", errorf(CodeBadRegion, "shm %q holds a NUL byte", name)
	case !strings.HasPrefix(name, "/"):
		return "", errorf(CodeBadRegion, "shm %q is neither a POSIX shared-memory name (\"/name\") nor an absolute path under %s or %s", name, shmDir, hugepagesDir)
	}
	if strings.Count(name, "/") == 1 {
		// A POSIX shm name, as shm_open(3) resolves it under /dev/shm.
		base := name[1:]
		if base == "" || base == "." || base == ".." {
			return "", errorf(CodeBadRegion, "shm %q is not a shared-memory name", name)
		}
		return shmDir + "/" + base, nil
	}
	clean := filepath.Clean(name)
	// Look only under the allowed folders: a path elsewhere is refused
	// before the file system is asked anything about it.
	if !underAny(clean, []string{shmDir, hugepagesDir}) && !underRoot(clean) {
		return "", errorf(CodeBadRegion, "shm %q is not under %s or %s", name, shmDir, hugepagesDir)
	}
	resolved, err := filepath.EvalSymlinks(clean)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", errorf(CodeBadRegion, "shm %q: no such file", name)
		}
		return "", errorf(CodeBadRegion, "shm %q: %v", name, err)
	}
	if !underRoot(resolved) {
		if resolved != clean {
			return "", errorf(CodeBadRegion, "shm %q resolves to %q, which is not under %s or %s", name, resolved, shmDir, hugepagesDir)
		}
		return "", errorf(CodeBadRegion, "shm %q is not under %s or %s", name, shmDir, hugepagesDir)
	}
	return resolved, nil
}

// mapWindow returns what to mmap for length bytes at offset when mappings
// must start at a multiple of align (a power of two): the file offset to
// map from, where the region starts in the mapping, and the mapping's
// length (a multiple of align, as hugetlbfs requires); ok is false when
// the mapping's length does not fit in 64 bits.
func mapWindow(offset, length, align uint64) (start, delta, mapLen uint64, ok bool) {
	start = offset &^ (align - 1)
	delta = offset - start
	end := delta + length
	if end < delta || end+align-1 < end {
		return 0, 0, 0, false
	}
	mapLen = (end + align - 1) &^ (align - 1)
	return start, delta, mapLen, true
}

// testHookBeforeOpen, when set by a test, runs between resolveSHM and
// open: a test swaps a folder for a link there, as a racing process could.
var testHookBeforeOpen func(path string)

// openDRAM maps s.Length bytes at s.Offset of s.SHM, MAP_SHARED
// read-write. checkSpec has run.
func openDRAM(s Spec) (*Region, error) {
	pid, n, memfd, e := procFDName(s.SHM)
	if e != nil {
		return nil, e
	}
	if !memfd {
		fd, e := openSHMFile(s)
		if e != nil {
			return nil, e
		}
		defer syscall.Close(fd) // the mapping outlives the descriptor
		return mapDRAM(s, fd, nil)
	}
	fd, e := openMemfd(s.SHM, pid, n)
	if e != nil {
		return nil, e
	}
	// The descriptor stays open as long as the mapping (closed after
	// munmap): a plugin that maps a peer's memory itself finds the memfd
	// in this process's descriptors (see memfd.go).
	r, err := mapDRAM(s, fd, func() { syscall.Close(fd) })
	if err != nil {
		syscall.Close(fd)
	}
	return r, err
}

// openSHMFile opens the file of a shm name or path under /dev/shm or
// /dev/hugepages.
func openSHMFile(s Spec) (int, *Error) {
	path, e := resolveSHM(s.SHM)
	if e != nil {
		return -1, e
	}
	if testHookBeforeOpen != nil {
		testHookBeforeOpen(path)
	}
	fd, err := syscall.Open(path, syscall.O_RDWR|syscall.O_NOFOLLOW|syscall.O_CLOEXEC|syscall.O_NONBLOCK, 0)
	if err != nil {
		switch err {
		case syscall.ENOENT:
			return -1, errorf(CodeBadRegion, "shm %q: no such shared-memory object or file", s.SHM)
		case syscall.ELOOP:
			return -1, errorf(CodeBadRegion, "shm %q is a symbolic link", s.SHM)
		}
		return -1, errorf(CodeBadRegion, "shm %q: open: %v", s.SHM, err)
	}

	// The file opened must lie under the allowed folders whatever was
	// renamed or linked between resolveSHM and open: ask the kernel.
	if real, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd)); err != nil {
		syscall.Close(fd)
		return -1, errorf(CodeBadRegion, "shm %q: cannot tell where the file opened lies: %v", s.SHM, err)
	} else if !underRoot(real) {
		syscall.Close(fd)
		return -1, errorf(CodeBadRegion, "shm %q opened %q, which is not under %s or %s", s.SHM, real, shmDir, hugepagesDir)
	}
	return fd, nil
}

// mapDRAM maps s.Length bytes at s.Offset of the file fd, MAP_SHARED
// read-write, into a Region; closeFD, when not nil, runs after the munmap
// of the Region's release (the caller closes fd on error).
func mapDRAM(s Spec, fd int, closeFD func()) (*Region, error) {
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return nil, errorf(CodeBadRegion, "shm %q: fstat: %v", s.SHM, err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return nil, errorf(CodeBadRegion, "shm %q is not a regular file", s.SHM)
	}
	size := uint64(st.Size)
	if st.Size < 0 || s.Offset+s.Length > size {
		return nil, errorf(CodeBadRegion, "region of %d bytes at offset %d is past the end of %s (size %d)", s.Length, s.Offset, s.SHM, size)
	}

	// mmap maps from a page boundary (a huge page's on hugetlbfs): map
	// from the offset rounded down and point into the mapping.
	align := uint64(os.Getpagesize())
	var sfs syscall.Statfs_t
	if err := syscall.Fstatfs(fd, &sfs); err == nil && uint32(sfs.Type) == hugetlbfsMagic && sfs.Bsize > 0 {
		align = uint64(sfs.Bsize)
	}
	start, delta, mapLen, ok := mapWindow(s.Offset, s.Length, align)
	if !ok || mapLen > maxLength {
		return nil, errorf(CodeBadRegion, "region of %d bytes at offset %d of %s is larger than this process can map", s.Length, s.Offset, s.SHM)
	}
	m, err := syscall.Mmap(fd, int64(start), int(mapLen), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		code := CodeBadRegion
		if err == syscall.ENOMEM {
			code = CodeLimit
		}
		return nil, errorf(code, "shm %q: mmap of %d bytes at offset %d: %v", s.SHM, mapLen, start, err)
	}
	b := m[delta : delta+s.Length : delta+s.Length]
	r := &Region{Spec: s, Bytes: b, Local: uintptrOf(b)}
	r.release = func() error {
		err := syscall.Munmap(m)
		if closeFD != nil {
			closeFD()
		}
		if err != nil {
			return errorf(CodeBadRegion, "shm %q: munmap: %v", s.SHM, err)
		}
		return nil
	}
	return r, nil
}
