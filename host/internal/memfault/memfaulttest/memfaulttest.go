// Package memfaulttest gives tests memory that can vanish as an engine's
// can: a file in /dev/shm mapped MAP_SHARED, as the sidecar maps an
// engine's memory. Truncating the file makes later accesses fault.
package memfaulttest

import (
	"os"
	"syscall"
	"testing"
)

// SharedMem maps n bytes of a fresh file in /dev/shm MAP_SHARED and
// returns the file (truncate it to make the memory vanish) and the
// mapping; both are released when the test ends.
func SharedMem(t testing.TB, n int) (*os.File, []byte) {
	t.Helper()
	f, err := os.CreateTemp("/dev/shm", "kvhost-memfault-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close(); os.Remove(f.Name()) })
	if err := f.Truncate(int64(n)); err != nil {
		t.Fatal(err)
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Munmap(mem) })
	return f, mem
}
