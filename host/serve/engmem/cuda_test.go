package engmem

import (
	"bytes"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/kvhost/kvhost/host/serve/engmem/cudarttest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	cudarttest.Cleanup()
	os.Exit(code)
}

// standin is the stand-in libcudart (testdata/cudart_standin.c), built
// once per test process.
func standin(t testing.TB) string { return cudarttest.Path(t) }

// engine is the engine's side of the stand-in: allocations and handles,
// as an engine gets them from CUDA.
type engine struct {
	setDevice func(int32) int32
	malloc    func(*uintptr, uintptr) int32
	free      func(uintptr) int32
	getHandle func(*ipcHandle, uintptr) int32
	liveOpens func() int32
}

func newEngine(t testing.TB) *engine {
	h, err := purego.Dlopen(standin(t), purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		t.Fatal(err)
	}
	var e engine
	purego.RegisterLibFunc(&e.setDevice, h, "cudaSetDevice")
	purego.RegisterLibFunc(&e.malloc, h, "cudaMalloc")
	purego.RegisterLibFunc(&e.free, h, "cudaFree")
	purego.RegisterLibFunc(&e.getHandle, h, "cudaIpcGetMemHandle")
	purego.RegisterLibFunc(&e.liveOpens, h, "standin_live_opens")
	return &e
}

// alloc returns size bytes of "device memory" on device, its handle and
// the path of the file behind it; freed at the end of the test.
func (e *engine) alloc(t testing.TB, device int, size uintptr) (uintptr, [64]byte, string) {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if rc := e.setDevice(int32(device)); rc != 0 {
		t.Fatalf("cudaSetDevice: %d", rc)
	}
	var p uintptr
	if rc := e.malloc(&p, size); rc != 0 {
		t.Fatalf("cudaMalloc: %d", rc)
	}
	t.Cleanup(func() { e.free(p) })
	var h ipcHandle
	if rc := e.getHandle(&h, p); rc != 0 {
		t.Fatalf("cudaIpcGetMemHandle: %d", rc)
	}
	name := string(h.Reserved[8 : bytes.IndexByte(h.Reserved[8:56], 0)+8])
	return p, h.Reserved, shmDir + "/" + name
}

// mem is n bytes at address p outside the Go heap.
func mem(p uintptr, n int) []byte {
	return unsafe.Slice(*(**byte)(unsafe.Pointer(&p)), n)
}

// TestVRAMStandIn: a VRAM spec opened through libcudart (the stand-in):
// bytes written through Region.Local are the engine's, at the offset;
// Close releases the IPC mapping.
func TestVRAMStandIn(t *testing.T) {
	e := newEngine(t)
	ptr, h, path := e.alloc(t, 2, 3*page)
	o := &Opener{CUDALibrary: standin(t)}
	before := mapsOf(t, path)
	r, err := o.Open(Spec{Kind: VRAM, Addr: uint64(ptr) + page, Length: page, IPCHandle: h, Offset: page, Device: 2})
	if err != nil {
		t.Fatal(err)
	}
	if r.Bytes != nil || r.Local == ptr+page || r.Local == 0 {
		t.Fatalf("Local 0x%x (engine 0x%x), Bytes %v: want a mapping of its own", r.Local, ptr+page, r.Bytes != nil)
	}
	if mapsOf(t, path) != before+1 || e.liveOpens() != 1 {
		t.Fatalf("%d mappings, %d opens after Open", mapsOf(t, path)-before, e.liveOpens())
	}
	local := mem(r.Local, page)
	for i := range local {
		local[i] = byte(i*13 + 1)
	}
	if !bytes.Equal(mem(ptr+page, page), local) {
		t.Fatal("the engine's pointer does not see the bytes written through Local")
	}
	file, _ := os.ReadFile(path)
	if !bytes.Equal(file[page:2*page], local) || bytes.Equal(file[:page], local) {
		t.Fatal("the engine's file does not hold the bytes at the region's offset")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	if mapsOf(t, path) != before || e.liveOpens() != 0 {
		t.Fatalf("%d mappings, %d opens after Close", mapsOf(t, path)-before, e.liveOpens())
	}
}

// TestVRAMTable: VRAM and DRAM regions in one Table; two regions of one
// allocation share its IPC mapping (CUDA counts opens of one handle), so
// removing one leaves the other usable.
func TestVRAMTable(t *testing.T) {
	e := newEngine(t)
	ptr, h, path := e.alloc(t, 1, 4*page)
	name, _ := newSHM(t, page)
	tb := NewTable(&Opener{CUDALibrary: standin(t)})
	defer tb.Close()
	rs, err := tb.Add([]Spec{
		{Kind: VRAM, Addr: uint64(ptr), Length: page, IPCHandle: h, Offset: 0, Device: 1},
		{Kind: VRAM, Addr: uint64(ptr) + 2*page, Length: 2 * page, IPCHandle: h, Offset: 2 * page, Device: 1},
		dram(0x10000, page, name, 0),
	})
	if err != nil {
		t.Fatal(err)
	}
	if rs[1].Local-rs[0].Local != 2*page || e.liveOpens() != 2 {
		t.Fatalf("locals 0x%x 0x%x, %d opens", rs[0].Local, rs[1].Local, e.liveOpens())
	}
	local, r, err := tb.Translate(uint64(ptr)+3*page+8, 8)
	if err != nil || r != rs[1] || local != rs[1].Local+page+8 {
		t.Fatalf("Translate: 0x%x %v %v", local, r, err)
	}
	_, err = tb.Bytes(uint64(ptr), 8)
	wantCode(t, err, CodeBadRegion, "vram")
	_, err = tb.Add([]Spec{{Kind: VRAM, Addr: uint64(ptr) + page/2, Length: page, IPCHandle: h, Device: 1}})
	wantCode(t, err, CodeBadRegion, "overlaps")
	if err := tb.Remove([]uint64{rs[0].ID}); err != nil {
		t.Fatal(err)
	}
	copy(mem(local, 8), "sidecar!")
	if string(mem(ptr+3*page+8, 8)) != "sidecar!" || e.liveOpens() != 1 {
		t.Fatalf("after removing the first region: %q, %d opens", mem(ptr+3*page+8, 8), e.liveOpens())
	}
	before := mapsOf(t, path)
	if err := tb.Close(); err != nil {
		t.Fatal(err)
	}
	if e.liveOpens() != 0 || mapsOf(t, path) != before-1 {
		t.Fatalf("%d opens, mappings %d→%d after Close", e.liveOpens(), before, mapsOf(t, path))
	}
}

// TestVRAMRefused: CUDA's refusals reach the engine as bad_region with
// CUDA's message, and leave nothing open.
func TestVRAMRefused(t *testing.T) {
	e := newEngine(t)
	ptr, h, _ := e.alloc(t, 2, page)
	gone := h
	copy(gone[8:56], "kvhost-standin-none\x00")
	o := &Opener{CUDALibrary: standin(t)}
	for _, tc := range []struct {
		what  string
		spec  Spec
		parts []string
	}{
		{"zero handle", Spec{Kind: VRAM, Addr: 0x1000, Length: 1, Device: 2}, []string{"cudaIpcOpenMemHandle: invalid resource handle (cudaError 400"}},
		{"no allocation", Spec{Kind: VRAM, Addr: 0x1000, Length: 1, IPCHandle: gone, Device: 2}, []string{"mapping of buffer object failed"}},
		{"no such device", Spec{Kind: VRAM, Addr: uint64(ptr), Length: 1, IPCHandle: h, Device: 9}, []string{"cudaSetDevice(9): invalid device ordinal"}},
		{"negative device", Spec{Kind: VRAM, Addr: uint64(ptr), Length: 1, IPCHandle: h, Device: -1}, []string{"device -1"}},
		{"offset wraps", Spec{Kind: VRAM, Addr: uint64(ptr), Length: 2, IPCHandle: h, Device: 2, Offset: 1<<64 - 1}, []string{"overflows"}},
	} {
		t.Run(tc.what, func(t *testing.T) {
			r, err := o.Open(tc.spec)
			if err == nil {
				r.Close()
				t.Fatal("opened")
			}
			wantCode(t, err, CodeBadRegion, tc.parts...)
		})
	}
	// One bad spec in an Add closes the good ones opened before it.
	tb := NewTable(o)
	defer tb.Close()
	_, err := tb.Add([]Spec{
		{Kind: VRAM, Addr: uint64(ptr), Length: page, IPCHandle: h, Device: 2},
		{Kind: VRAM, Addr: 0x1000, Length: 1, Device: 2},
	})
	wantCode(t, err, CodeBadRegion, "regions[1]", "invalid resource handle")
	if n := e.liveOpens(); n != 0 || tb.Len() != 0 {
		t.Fatalf("%d opens, %d regions left", n, tb.Len())
	}
}

// TestVRAMThreads: opens on several devices at once. The stand-in refuses
// an open on a thread whose current device is not the handle's, so
// cudaSetDevice and cudaIpcOpenMemHandle must run on one OS thread.
func TestVRAMThreads(t *testing.T) {
	e := newEngine(t)
	o := &Opener{CUDALibrary: standin(t)}
	testHookAfterSetDevice = func() { time.Sleep(time.Microsecond) }
	defer func() { testHookAfterSetDevice = nil }()
	var wg sync.WaitGroup
	for d := range 4 {
		ptr, h, _ := e.alloc(t, d, page)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				r, err := o.Open(Spec{Kind: VRAM, Addr: uint64(ptr), Length: page, IPCHandle: h, Device: d})
				if err != nil {
					t.Errorf("device %d: %v", d, err)
					return
				}
				if err := r.Close(); err != nil {
					t.Errorf("device %d: %v", d, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if n := e.liveOpens(); n != 0 {
		t.Fatalf("%d opens left", n)
	}
}

// TestCUDARTMissing: without libcudart a VRAM region is unsupported, and
// the message names every library tried and why it did not load.
func TestCUDARTMissing(t *testing.T) {
	vram := Spec{Kind: VRAM, Addr: 0x1000, Length: 1}
	o := &Opener{CUDALibrary: "/nonexistent/libcudart.so.12"}
	_, err := o.Open(vram)
	wantCode(t, err, CodeUnsupported, "libcudart", "/nonexistent/libcudart.so.12", "No such file")

	// The search: $KVHOST_CUDART first, then the names (replaced by one
	// that exists on no machine, so the test does not depend on whether
	// this machine has CUDA).
	defer func(n []string) { cudartNames = n }(cudartNames)
	cudartNames = []string{"libcudart-kvhost-absent.so.13"}
	t.Setenv(EnvCUDART, "/nonexistent/kvhost/libcudart.so")
	if c := cudartCandidates(""); strings.Join(c, ",") != "/nonexistent/kvhost/libcudart.so,libcudart-kvhost-absent.so.13" {
		t.Fatalf("candidates %q", c)
	}
	if c := cudartCandidates("x.so"); len(c) != 1 || c[0] != "x.so" {
		t.Fatalf("an explicit library searched %q", c)
	}
	_, err = (&Opener{}).Open(vram)
	wantCode(t, err, CodeUnsupported, "tried /nonexistent/kvhost/libcudart.so (", "; libcudart-kvhost-absent.so.13 (")

	// A library that loads but is no libcudart.
	_, err = (&Opener{CUDALibrary: "libc.so.6"}).Open(vram)
	wantCode(t, err, CodeUnsupported, "libc.so.6 (no cudaSetDevice in it)")
}

// TestCUDARTRetry: a failed load is not remembered: once the library is
// where the sidecar looks, the next VRAM region loads it.
func TestCUDARTRetry(t *testing.T) {
	e := newEngine(t)
	ptr, h, _ := e.alloc(t, 0, page)
	lib := filepath.Join(t.TempDir(), "libcudart.so.12")
	o := &Opener{CUDALibrary: lib}
	spec := Spec{Kind: VRAM, Addr: uint64(ptr), Length: page, IPCHandle: h, Device: 0}
	_, err := o.Open(spec)
	wantCode(t, err, CodeUnsupported, lib)
	so, err := os.ReadFile(standin(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(lib, so, 0o755); err != nil {
		t.Fatal(err)
	}
	r, err := o.Open(spec)
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
}
