//go:build !amd64 || kvhost_purego

package plugin

// makeAllocs is what making (and closing) one transfer allocates on a
// native path: the *Xfer, its make args struct (purego.SyscallN moves it
// to the heap) and SyscallN's variadic argument slice.
const makeAllocs = 3
