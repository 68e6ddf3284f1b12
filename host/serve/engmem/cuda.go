package engmem

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"

	"github.com/ebitengine/purego"
)

// EnvCUDART names a libcudart to try first (a path or a name dlopen
// searches) when Opener.CUDALibrary is "".
const EnvCUDART = "KVHOST_CUDART"

// cudartNames are the libcudart names searched after $KVHOST_CUDART: the
// development link, then the sonames of CUDA 13 and 12. A variable so the
// tests can search names that exist on no machine.
var cudartNames = []string{"libcudart.so", "libcudart.so.13", "libcudart.so.12"}

// cudaIpcMemLazyEnablePeerAccess is the only flag cudaIpcOpenMemHandle
// accepts (CUDA runtime API, driver_types.h).
const cudaIpcMemLazyEnablePeerAccess = 1

// Error numbers of cudaError_t (driver_types.h) that mean there is no
// usable CUDA here rather than a bad region.
const (
	cudaErrorInsufficientDriver = 35
	cudaErrorStubLibrary        = 34
	cudaErrorNoDevice           = 100
)

// maxDevice bounds Spec.Device: CUDA ordinals are small ints.
const maxDevice = 1 << 16

// ipcHandle is cudaIpcMemHandle_t: struct { char reserved[64]; }.
//
// cudaIpcOpenMemHandle takes it BY VALUE. purego (v0.11, RegisterFunc)
// passes struct arguments as the C ABI does on linux/amd64 and
// linux/arm64: on amd64 (System V) an aggregate over 16 bytes is of class
// MEMORY and is copied onto the stack in argument order, its eightbytes
// as they lie in memory, while the other arguments keep their registers
// (devPtr in RDI, flags in RSI); on arm64 (AAPCS64) a composite over 16
// bytes is copied by the caller and passed by pointer in the next integer
// register. The stand-in libcudart the tests build with the system's C
// compiler checks both the handle's bytes and the flags argument behind
// it, so a wrong placement fails the tests.
type ipcHandle struct {
	Reserved [64]byte
}

// cudart is a loaded libcudart: the entry points the sidecar calls.
// cudaError_t is a C enum (int).
type cudart struct {
	path        string
	setDevice   func(device int32) int32
	ipcOpen     func(devPtr *uintptr, handle ipcHandle, flags uint32) int32
	ipcClose    func(devPtr uintptr) int32
	errorString func(code int32) string
}

// cudaLoaded holds each libcudart loaded, by the list of candidates that
// found it. A library loaded stays loaded for the life of the process
// (libcudart cannot be unloaded while contexts may live). A failed search
// is not remembered: the next VRAM region searches again, so installing
// CUDA or fixing $KVHOST_CUDART needs no sidecar restart, at the price of
// a few failing dlopen calls per refused request.
var (
	cudaMu     sync.Mutex
	cudaLoaded = map[string]*cudart{}
)

// cudartCandidates returns the libraries to try, in order.
func cudartCandidates(lib string) []string {
	if lib != "" {
		return []string{lib}
	}
	var c []string
	if env := os.Getenv(EnvCUDART); env != "" {
		c = append(c, env)
	}
	return append(c, cudartNames...)
}

// loadCUDART returns the first of candidates that loads and exports the
// entry points, loading it once per process.
func loadCUDART(candidates []string) (*cudart, *Error) {
	key := strings.Join(candidates, "\x00")
	cudaMu.Lock()
	defer cudaMu.Unlock()
	if c := cudaLoaded[key]; c != nil {
		return c, nil
	}
	var tried []string
	for _, name := range candidates {
		c, err := openCUDART(name)
		if err != nil {
			tried = append(tried, fmt.Sprintf("%s (%v)", name, err))
			continue
		}
		cudaLoaded[key] = c
		return c, nil
	}
	return nil, errorf(CodeUnsupported, "vram regions need libcudart, which could not be loaded: tried %s",
		strings.Join(tried, "; "))
}

// openCUDART dlopens one library and binds the entry points; a library
// lacking one is closed again.
func openCUDART(name string) (*cudart, error) {
	h, err := purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, err
	}
	syms := map[string]uintptr{}
	for _, s := range []string{"cudaSetDevice", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle", "cudaGetErrorString"} {
		p, err := purego.Dlsym(h, s)
		if err != nil || p == 0 {
			purego.Dlclose(h)
			return nil, fmt.Errorf("no %s in it", s)
		}
		syms[s] = p
	}
	c := &cudart{path: name}
	purego.RegisterFunc(&c.setDevice, syms["cudaSetDevice"])
	purego.RegisterFunc(&c.ipcOpen, syms["cudaIpcOpenMemHandle"])
	purego.RegisterFunc(&c.ipcClose, syms["cudaIpcCloseMemHandle"])
	purego.RegisterFunc(&c.errorString, syms["cudaGetErrorString"])
	return c, nil
}

// cudaErr turns a failed call into an *Error with CUDA's message.
func (c *cudart) cudaErr(call string, rc int32) *Error {
	code := CodeBadRegion
	switch rc {
	case cudaErrorInsufficientDriver, cudaErrorStubLibrary, cudaErrorNoDevice:
		code = CodeUnsupported
	}
	return errorf(code, "%s: %s (cudaError %d, %s)", call, c.errorString(rc), rc, c.path)
}

// onDevice runs f on one OS thread whose current device is device: CUDA's
// current device is per thread, and the Go scheduler could otherwise move
// the goroutine to another thread between cudaSetDevice and the call.
//
// The thread's previous device is not restored: cudaGetDevice answers 0
// on a thread that never chose one, and setting device 0 back would
// create a CUDA context on GPU 0 (hundreds of MiB of another rank's GPU)
// in a sidecar that serves only, say, GPU 3. Code that needs a device on
// a Go thread (a plugin's CUDA calls) must set it, as CUDA code on shared
// threads does.
func (c *cudart) onDevice(device int, f func() *Error) *Error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if rc := c.setDevice(int32(device)); rc != 0 {
		return c.cudaErr(fmt.Sprintf("cudaSetDevice(%d)", device), rc)
	}
	if testHookAfterSetDevice != nil {
		testHookAfterSetDevice()
	}
	return f()
}

// testHookAfterSetDevice, when set by a test, runs between cudaSetDevice
// and the call that needs the device: a test parks the goroutine there to
// let the scheduler move it, were it not locked to its thread.
var testHookAfterSetDevice func()

// openVRAM opens s.IPCHandle on s.Device; Local is the IPC mapping's
// pointer plus s.Offset. libcudart cannot tell the size of the
// allocation behind a handle, so Offset+Length is not checked against it
// here (a plugin registering the range will refuse it when the CUDA
// driver does).
func (o *Opener) openVRAM(s Spec) (*Region, error) {
	if s.Device < 0 || s.Device >= maxDevice {
		return nil, errorf(CodeBadRegion, "vram region on CUDA device %d", s.Device)
	}
	c, e := loadCUDART(cudartCandidates(o.CUDALibrary))
	if e != nil {
		return nil, e
	}
	var base uintptr
	e = c.onDevice(s.Device, func() *Error {
		if rc := c.ipcOpen(&base, ipcHandle{s.IPCHandle}, cudaIpcMemLazyEnablePeerAccess); rc != 0 {
			return c.cudaErr("cudaIpcOpenMemHandle", rc)
		}
		return nil
	})
	if e != nil {
		return nil, e
	}
	release := func() error {
		return c.onDevice(s.Device, func() *Error {
			if rc := c.ipcClose(base); rc != 0 {
				return c.cudaErr("cudaIpcCloseMemHandle", rc)
			}
			return nil
		}).orNil()
	}
	local := base + uintptr(s.Offset)
	if base == 0 || uint64(local) < uint64(base) || uint64(local)+s.Length < uint64(local) {
		_ = release()
		return nil, errorf(CodeBadRegion, "cudaIpcOpenMemHandle returned 0x%x, which cannot hold %d bytes at offset %d", base, s.Length, s.Offset)
	}
	return &Region{Spec: s, Local: local, release: release}, nil
}

// orNil returns e as an error, nil when e is nil (a nil *Error in an
// error interface is not nil).
func (e *Error) orNil() error {
	if e == nil {
		return nil
	}
	return e
}
