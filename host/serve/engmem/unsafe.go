package engmem

import "unsafe"

// uintptrOf returns the address of b's first byte (len(b) > 0).
func uintptrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
