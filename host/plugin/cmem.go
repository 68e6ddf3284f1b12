package plugin

import "unsafe"

// This file and call_*.go hold the only code that touches the C side
// directly: calling a table function (callC and callHeap, in call_amd64.go,
// an assembly trampoline over runtime.cgocall, and call_purego.go,
// purego.SyscallN, for every other architecture) and reading memory the
// plugin owns (here).

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
