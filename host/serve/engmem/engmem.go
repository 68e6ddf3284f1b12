package engmem

import (
	"fmt"
	"sync"

	"github.com/kvhost/kvhost/abi"
)

// Kind is where a region lives.
type Kind uint8

const (
	// DRAM is host memory, shared by shm name or file path.
	DRAM Kind = iota
	// VRAM is GPU memory, shared by CUDA IPC handle.
	VRAM
)

// MemKind returns the plugin ABI's memory kind of k.
func (k Kind) MemKind() abi.MemKind {
	if k == VRAM {
		return abi.VRAM
	}
	return abi.DRAM
}

// String returns "dram" or "vram", the control API's names.
func (k Kind) String() string {
	switch k {
	case DRAM:
		return "dram"
	case VRAM:
		return "vram"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Spec is one region as the engine declares it (docs/engine-api.md,
// "Memory"). Every field is the engine's word: nothing is trusted before
// Open checks it.
type Spec struct {
	Kind   Kind
	Addr   uint64 // the engine's pointer to the first byte
	Length uint64 // bytes
	// SHM (DRAM): a POSIX shared-memory name ("/kvhost-1-kv": one
	// component, resolved under /dev/shm), an absolute path of a file
	// under /dev/shm or /dev/hugepages, or "/proc/<pid>/fd/<n>": a memfd
	// of another process sealed against shrinking (memfd.go).
	SHM string
	// Offset is, for DRAM, the byte offset of the region in the SHM
	// object; for VRAM, the byte offset of the region in the IPC
	// allocation.
	Offset uint64
	// IPCHandle (VRAM) is the cudaIpcMemHandle_t of the allocation that
	// holds the region.
	IPCHandle [64]byte
	// Device (VRAM) is the CUDA device ordinal the handle is opened on.
	Device int
	// AsVRAM (DRAM) has the sidecar register the region's buffers with
	// the plugin as VRAM (register_as "vram"), for plugins that model GPU
	// memory with host memory (the fake plugin). Opening is unchanged:
	// the region is mapped and read as host memory.
	AsVRAM bool
}

// PluginKind is the memory kind the region's buffers are registered with
// the plugin as: VRAM for VRAM regions and DRAM regions with AsVRAM, else
// DRAM.
func (s *Spec) PluginKind() abi.MemKind {
	if s.Kind == VRAM || s.AsVRAM {
		return abi.VRAM
	}
	return abi.DRAM
}

// Region is an opened Spec: the same bytes in this process. Its fields do
// not change after Open (Close does not clear them), so any goroutine may
// read them without locking; the memory they point to is valid until
// Close.
type Region struct {
	Spec
	// ID is unique in the Table that opened the Region (0 from
	// Opener.Open).
	ID uint64
	// Local is this process's address of Spec.Addr: into the mapping
	// (DRAM) or a device pointer (VRAM). Valid until Close.
	Local uintptr
	// Bytes is the DRAM mapping of the region, Length bytes (nil for
	// VRAM). Valid until Close.
	Bytes []byte

	closeMu sync.Mutex
	closed  bool
	release func() error // unmaps; nil once run
}

// Close releases the region's mapping (munmap for DRAM,
// cudaIpcCloseMemHandle for VRAM). It is idempotent: later calls return
// nil. The region's Bytes and Local must not be used after Close.
func (r *Region) Close() error {
	r.closeMu.Lock()
	defer r.closeMu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	rel := r.release
	r.release = nil
	if rel == nil {
		return nil
	}
	return rel()
}

// Error codes of the control API (docs/engine-api.md, "Error codes") that
// this package returns.
const (
	CodeBadRegion   = "bad_region"
	CodeUnsupported = "unsupported"
	CodeLimit       = "limit"
	CodeUnknown     = "unknown"
)

// Error is a refusal carrying the control API error code (Code) and the
// message for the engine (Msg).
type Error struct {
	Code string
	Msg  string
}

func (e *Error) Error() string { return e.Code + ": " + e.Msg }

func errorf(code, format string, args ...any) *Error {
	return &Error{Code: code, Msg: fmt.Sprintf(format, args...)}
}

// Opener opens specs. The zero value is usable: libcudart is searched for
// and loaded on the first VRAM spec (see [Opener.CUDALibrary]).
type Opener struct {
	// CUDALibrary is the libcudart to load for VRAM specs: a path or a
	// name dlopen searches. "" searches $KVHOST_CUDART, then libcudart.so,
	// libcudart.so.13 and libcudart.so.12, and loads the first that opens.
	CUDALibrary string
}

// Open opens s: maps a DRAM spec or opens a VRAM spec's IPC handle. The
// returned Region has ID 0; close it with Region.Close. Errors are *Error.
func (o *Opener) Open(s Spec) (*Region, error) {
	if err := checkSpec(s); err != nil {
		return nil, err
	}
	switch s.Kind {
	case DRAM:
		return openDRAM(s)
	case VRAM:
		return o.openVRAM(s)
	}
	return nil, errorf(CodeBadRegion, "unknown memory kind %d", s.Kind)
}

// checkSpec checks what needs no system call: lengths and overflows.
func checkSpec(s Spec) *Error {
	if s.Kind != DRAM && s.Kind != VRAM {
		return errorf(CodeBadRegion, "unknown memory kind %d", s.Kind)
	}
	if s.Length == 0 {
		return errorf(CodeBadRegion, "%s region at 0x%x has length 0", s.Kind, s.Addr)
	}
	if s.Addr == 0 {
		return errorf(CodeBadRegion, "%s region has address 0", s.Kind)
	}
	if s.Addr+s.Length < s.Addr {
		return errorf(CodeBadRegion, "%s region at 0x%x of %d bytes wraps the address space", s.Kind, s.Addr, s.Length)
	}
	if s.Offset+s.Length < s.Offset {
		return errorf(CodeBadRegion, "%s region of %d bytes at offset %d overflows", s.Kind, s.Length, s.Offset)
	}
	// A length past what this process can address can never be mapped
	// (and would overflow int on a 32-bit build).
	if s.Length > maxLength || s.Offset > maxLength {
		return errorf(CodeBadRegion, "%s region of %d bytes at offset %d is larger than this process can map", s.Kind, s.Length, s.Offset)
	}
	return nil
}

// maxLength bounds Length and Offset: 2^47 bytes (128 TiB), the user
// address space of x86-64 and arm64 with 4-level page tables.
const maxLength = 1 << 47
