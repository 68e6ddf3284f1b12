package kvpool

import (
	"os"
	"syscall"
	"testing"
	"unsafe"
)

// A new pool's pages are resident before anything writes them, as an
// engine's KV memory is: an unpopulated pool that nobody wrote (NoBytes
// runs) reads as the kernel's shared zero page, which made copies out of
// it look faster than copies out of real KV.
func TestNewPoolIsPopulated(t *testing.T) {
	g := Geometry{Attention: MHA, Order: KThenV, Layers: 4, Pages: 64, PageSize: 16, TotalHeads: 8, TPSize: 1, HeadBytes: 128}
	p, err := New(g)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	mem := p.Bytes()
	page := os.Getpagesize()
	vec := make([]byte, (len(mem)+page-1)/page)
	if _, _, e := syscall.Syscall(syscall.SYS_MINCORE, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		t.Fatalf("mincore: %v", e)
	}
	resident := 0
	for _, v := range vec {
		resident += int(v & 1)
	}
	if resident != len(vec) {
		t.Fatalf("%d of %d pages of a new pool are resident, want all", resident, len(vec))
	}
}
