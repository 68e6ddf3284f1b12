package memfault

import (
	"errors"
	"runtime/debug"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvhost/kvhost/host/internal/memfault/memfaulttest"
)

// A copy into or out of memory whose file was truncated under it fails
// with an Error naming the memory and the address (it took SIGBUS and
// killed the process), and the goroutine's fault setting is restored.
func TestCopyFromShrunkMemory(t *testing.T) {
	const n = 1 << 16
	f, mem := memfaulttest.SharedMem(t, n)
	buf := make([]byte, n)
	if got, err := Copy("KV region 1", buf, mem); err != nil || got != n {
		t.Fatalf("before the shrink: %d, %v", got, err)
	}
	if err := f.Truncate(0); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name     string
		dst, src []byte
	}{{"read", buf, mem}, {"write", mem, buf}} {
		_, err := Copy("KV region 1", c.dst, c.src)
		var fe *Error
		base := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
		if !errors.As(err, &fe) || fe.Addr-base >= n || !strings.Contains(err.Error(), "KV region 1") {
			t.Fatalf("%s after the shrink: %v", c.name, err)
		}
	}
	if old := debug.SetPanicOnFault(false); old {
		t.Fatal("SetPanicOnFault left on")
	}
	// Other panics pass through.
	defer func() {
		if r := recover(); r != "not a fault" {
			t.Fatalf("recovered %v", r)
		}
	}()
	Do("x", func() { panic("not a fault") })
}
