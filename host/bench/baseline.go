package bench

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"
	"golang.org/x/sys/unix"
)

// Baseline names, as reported in Row.Baseline.
const (
	BaselineMemcpy = "memcpy"
	BaselineWritev = "process_vm_writev"
	BaselineReadv  = "process_vm_readv"
)

// iovMax is the most iovecs one process_vm_* call takes (IOV_MAX on Linux).
const iovMax = 1024

// copier moves one thread's blocks from src to dst the raw way, once per
// call of run. Its buffers are built up front: run allocates nothing.
type copier interface{ run() error }

// goCopier copies with Go's copy (the runtime's memmove).
type goCopier struct {
	src, dst [][]byte // one slice per block
}

func (c *goCopier) run() error {
	for i, s := range c.src {
		copy(c.dst[i], s)
	}
	return nil
}

// libcCopier calls libc's memcpy through purego, one call per block: what
// the fake plugin does for a same-process transfer.
type libcCopier struct {
	fn       uintptr
	src, dst []uintptr
	n        uintptr
}

func (c *libcCopier) run() error {
	for i, s := range c.src {
		purego.SyscallN(c.fn, c.dst[i], s, c.n)
	}
	return nil
}

// pvmCopier moves blocks between this process and another with
// process_vm_writev (write) or process_vm_readv, IOV_MAX blocks per call.
type pvmCopier struct {
	pid    int
	write  bool
	local  []unix.Iovec
	remote []unix.RemoteIovec
}

func (c *pvmCopier) run() error {
	for i := 0; i < len(c.local); i += iovMax {
		j := min(i+iovMax, len(c.local))
		var n int
		var err error
		if c.write {
			n, err = unix.ProcessVMWritev(c.pid, c.local[i:j], c.remote[i:j], 0)
		} else {
			n, err = unix.ProcessVMReadv(c.pid, c.local[i:j], c.remote[i:j], 0)
		}
		if err != nil {
			return fmt.Errorf("process_vm: %w", err)
		}
		if want := (j - i) * int(c.local[i].Len); n != want {
			return fmt.Errorf("process_vm: moved %d of %d bytes", n, want)
		}
	}
	return nil
}

// libcMemcpy returns the address of libc's memcpy.
func libcMemcpy() (uintptr, error) {
	h, err := purego.Dlopen("libc.so.6", purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return 0, fmt.Errorf("bench: dlopen libc: %w", err)
	}
	fn, err := purego.Dlsym(h, "memcpy")
	if err != nil {
		return 0, fmt.Errorf("bench: memcpy: %w", err)
	}
	return fn, nil
}

// blockSpan is one thread's blocks: offsets of its first block in both
// buffers, the block size and the count (blocks are contiguous).
type blockSpan struct {
	off   uint64
	block uint64
	count int
}

func newGoCopier(src, dst buffer, s blockSpan) *goCopier {
	c := &goCopier{src: make([][]byte, s.count), dst: make([][]byte, s.count)}
	for i := range s.count {
		o := s.off + uint64(i)*s.block
		c.src[i] = src[o : o+s.block]
		c.dst[i] = dst[o : o+s.block]
	}
	return c
}

func newLibcCopier(fn uintptr, src, dst buffer, s blockSpan) *libcCopier {
	c := &libcCopier{fn: fn, n: uintptr(s.block), src: make([]uintptr, s.count), dst: make([]uintptr, s.count)}
	for i := range s.count {
		o := s.off + uint64(i)*s.block
		c.src[i] = uintptr(unsafe.Pointer(&src[o]))
		c.dst[i] = uintptr(unsafe.Pointer(&dst[o]))
	}
	return c
}

// newPVMCopier moves between local (this process) and the target's buffer
// at remoteAddr in process pid.
func newPVMCopier(pid int, write bool, local buffer, remoteAddr uint64, s blockSpan) *pvmCopier {
	c := &pvmCopier{pid: pid, write: write, local: make([]unix.Iovec, s.count), remote: make([]unix.RemoteIovec, s.count)}
	for i := range s.count {
		o := s.off + uint64(i)*s.block
		c.local[i] = unix.Iovec{Base: &local[o]}
		c.local[i].SetLen(int(s.block))
		c.remote[i] = unix.RemoteIovec{Base: uintptr(remoteAddr + o), Len: int(s.block)}
	}
	return c
}

// MemcpyRate measures this machine's raw copy rate for blocks of block
// bytes: for at least d it copies total bytes (whole blocks; at least one)
// between two mmap'd buffers, alternating Go's copy and libc's memcpy block
// by block, and returns the faster one's rate in GB/s (1e9 bytes/s). kvhost
// demo prints it beside the transfer rate, with block the average transfer
// size.
func MemcpyRate(block, total uint64, d time.Duration) (float64, error) {
	if block == 0 {
		return 0, fmt.Errorf("bench: memcpy rate: block size 0")
	}
	n := max(1, total/block)
	src, err := mapBuffer(n * block)
	if err != nil {
		return 0, err
	}
	defer src.free()
	dst, err := mapBuffer(n * block)
	if err != nil {
		return 0, err
	}
	defer dst.free()
	fill(src, n*block, 1)
	fn, err := libcMemcpy()
	if err != nil {
		return 0, err
	}
	span := blockSpan{block: block, count: int(n)}
	copiers := []copier{newGoCopier(src, dst, span), newLibcCopier(fn, src, dst, span)}
	spent := make([]time.Duration, len(copiers))
	for _, c := range copiers { // warm: page faults
		c.run()
	}
	start := time.Now()
	iters := 0
	for iters < 2 || time.Since(start) < d {
		for i, c := range copiers {
			t0 := time.Now()
			c.run()
			spent[i] += time.Since(t0)
		}
		iters++
	}
	best := min(spent[0], spent[1])
	return float64(iters) * float64(n*block) / best.Seconds() / 1e9, nil
}
