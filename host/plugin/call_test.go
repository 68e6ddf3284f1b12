package plugin

import (
	"runtime"
	"strconv"
	"sync"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
)

// growStack recurses deep enough to make the runtime copy the goroutine's
// stack to a larger one.
//
//go:noinline
func growStack(n int) int {
	var pad [256]byte
	pad[n%256] = byte(n)
	if n == 0 {
		return int(pad[0])
	}
	return growStack(n-1) + int(pad[n%256])
}

// TestCallCStackArgs calls C functions through callC with their argument
// on the goroutine's stack, after the stack moved, while the garbage
// collector runs: libc's atoll reads the string its argument points to and
// returns a 64-bit value, time writes the result through its argument too.
// The call path must pass the current address, let C's writes land, and
// return the result whole.
func TestCallCStackArgs(t *testing.T) {
	libc, err := purego.Dlopen("libc.so.6", purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		t.Fatal("no libc.so.6:", err)
	}
	atoll, err := purego.Dlsym(libc, "atoll")
	if err != nil {
		t.Fatal(err)
	}
	ctime, err := purego.Dlsym(libc, "time")
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
				runtime.GC()
			}
		}
	})
	defer func() { close(stop); wg.Wait() }()
	for i := range 200 {
		want := -(int64(i) << 40) - 12345
		buf := [32]byte{}
		copy(buf[:], strconv.FormatInt(want, 10)) // NUL-terminated by the zero bytes after
		growStack(64 + i)                         // the stack may move: &buf follows it
		if got := int64(callC(atoll, unsafe.Pointer(&buf[0]))); got != want {
			t.Fatalf("atoll through callC = %d, want %d", got, want)
		}
		var tloc int64
		growStack(64 + i)
		got := int64(callC(ctime, unsafe.Pointer(&tloc)))
		if got <= 0 || tloc != got {
			t.Fatalf("time through callC returned %d and wrote %d, want the same positive time", got, tloc)
		}
	}
}
