//go:build !amd64 || kvhost_purego

package plugin

import (
	"runtime"
	"unsafe"

	"github.com/ebitengine/purego"
)

// callC calls the C function fn with a single pointer argument (every table
// function takes one args struct) and returns the raw result: a kvp_error*
// for the fallible functions, nothing meaningful for the error_* helpers.
//
// purego.SyscallN is //go:uintptrescapes: the struct args points to is moved
// to the heap (Go heap objects never move) and kept alive until the call
// returns. The args structs keep every Go buffer they reference alive through
// their unsafe.Pointer fields. Hot paths pass structs that already live on
// the heap inside their owner (see Xfer) through callHeap, so they allocate
// nothing here.
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
