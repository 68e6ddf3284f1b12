package plugin

import (
	"runtime"
	"unsafe"

	"github.com/ebitengine/purego"
)

// This file holds the only code that touches the C side directly: calling a
// table function and reading memory the plugin owns.

// callC calls the C function fn with a single pointer argument (every table
// function takes one args struct) and returns the raw result: a kvp_error*
// for the fallible functions, nothing meaningful for the error_* helpers.
//
// purego.SyscallN is //go:uintptrescapes: the struct args points to is moved
// to the heap (Go heap objects never move) and kept alive until the call
// returns. The args structs keep every Go buffer they reference alive through
// their unsafe.Pointer fields. Hot paths pass structs that already live on
// the heap inside their owner (see Xfer), so they allocate nothing here.
func callC(fn uintptr, args unsafe.Pointer) uintptr {
	r1, _, _ := purego.SyscallN(fn, uintptr(args))
	runtime.KeepAlive(args)
	return r1
}

// callHeap is callC for hot paths: args must point into a heap object the
// caller keeps alive for the call (Go never moves heap objects), and slot is
// a one-element buffer in heap memory the caller owns exclusively for the
// call. Passing the argument through slot avoids the one small allocation
// purego.SyscallN's variadic, pointer-escaping argument costs otherwise.
func callHeap(fn uintptr, args unsafe.Pointer, slot *[1]uintptr) uintptr {
	slot[0] = uintptr(args)
	r1, _, _ := purego.SyscallN(fn, slot[:]...)
	runtime.KeepAlive(args)
	return r1
}

// cPointer turns an address in C memory into an unsafe.Pointer without a
// uintptr-to-pointer conversion (which vet rightly flags for Go memory). Only
// for memory the plugin owns: the garbage collector ignores such pointers.
func cPointer(addr uintptr) unsafe.Pointer {
	return *(*unsafe.Pointer)(unsafe.Pointer(&addr))
}

// maxCString bounds how far cString scans for the terminating NUL, so a
// plugin that forgets it cannot make the host read without end.
const maxCString = 1 << 20

// cString copies the NUL-terminated string at addr (plugin memory) into Go.
// addr 0 gives "".
func cString(addr uintptr) string {
	if addr == 0 {
		return ""
	}
	p := cPointer(addr)
	n := 0
	for n < maxCString && *(*byte)(unsafe.Add(p, n)) != 0 {
		n++
	}
	return string(unsafe.Slice((*byte)(p), n))
}

// cBytes copies n bytes at addr (plugin memory) into a new Go slice.
func cBytes(addr uintptr, n uintptr) []byte {
	if addr == 0 || n == 0 {
		return nil
	}
	out := make([]byte, n)
	copy(out, unsafe.Slice((*byte)(cPointer(addr)), n))
	return out
}

// stringData returns a pointer to the bytes of s for a (pointer, length)
// pair in an args struct; nil for the empty string. The C side only reads.
func stringData(s string) unsafe.Pointer {
	if s == "" {
		return nil
	}
	return unsafe.Pointer(unsafe.StringData(s))
}

// sliceData returns a pointer to the first element of s, or nil if s is
// empty, for a (pointer, count) pair in an args struct.
func sliceData[T any](s []T) unsafe.Pointer {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Pointer(unsafe.SliceData(s))
}
