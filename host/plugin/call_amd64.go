//go:build amd64 && !kvhost_purego

package plugin

import "unsafe"

// On amd64 the host calls plugin functions through runtime.cgocall and a
// ten-instruction assembly trampoline (call_amd64.s) instead of
// purego.SyscallN. Every table function takes one pointer and returns one
// pointer, and SyscallN's generality costs there: it copies its arguments
// into two 32-word arrays and a pooled 58-word block and pushes them all
// onto the C stack, about 50 ns of a ~90 ns call (measured with libc's
// labs), and its //go:uintptrescapes moves the args struct of every call
// to the heap. runtime.cgocall is what purego itself calls (the runtime
// keeps it linkable for purego, see runtime/cgocall.go).
//
// Build with -tags kvhost_purego to use purego.SyscallN here too (the
// path of every other architecture, call_purego.go).

// callTrampolineABI0 is the address of callTrampoline (call_amd64.s).
var callTrampolineABI0 uintptr

// runtime_cgocall runs fn(arg) on the system stack as a C call (the
// goroutine is in a system call meanwhile, so its stack does not move).
// arg does not escape: the plugin keeps no pointer into Go memory after a
// call (kvplugin.h), so args structs, and the buffers they point to, may
// live on the caller's stack.
//
//go:linkname runtime_cgocall runtime.cgocall
//go:noescape
func runtime_cgocall(fn uintptr, arg unsafe.Pointer) int32

// cFrame is what callTrampoline reads and writes; the layout is fixed by
// call_amd64.s.
type cFrame struct {
	fn  uintptr
	arg unsafe.Pointer
	ret uintptr
}

// callC calls the C function fn with a single pointer argument (every table
// function takes one args struct) and returns the raw result: a kvp_error*
// for the fallible functions, nothing meaningful for the error_* helpers.
// args may point anywhere in Go memory, the stack included; it allocates
// nothing.
func callC(fn uintptr, args unsafe.Pointer) uintptr {
	f := cFrame{fn: fn, arg: args}
	runtime_cgocall(callTrampolineABI0, unsafe.Pointer(&f))
	return f.ret
}

// callHeap is callC; slot is what the purego path needs (call_purego.go).
func callHeap(fn uintptr, args unsafe.Pointer, _ *[1]uintptr) uintptr { return callC(fn, args) }
