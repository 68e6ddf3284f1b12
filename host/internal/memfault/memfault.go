// Package memfault contains faults on memory that someone else may shrink
// or unmap under us: an engine's shared memory, mapped by the sidecar.
// Touching such memory after the engine truncated its shm object raises
// SIGBUS, which kills a Go program ("unexpected fault address") and with
// it every other engine's connection. Code that reads or writes engine
// memory does it through Do or Copy, which turn the fault into an error
// for that access alone.
package memfault

import (
	"fmt"
	"runtime/debug"
)

// Error is a fault while touching memory: the memory at Addr is no longer
// mapped (its owner shrank or unmapped it).
type Error struct {
	// What names the memory (for the message): "KV region 2", "aux buffer 0".
	What string
	// Addr is the faulting address (0 when the runtime did not say).
	Addr uintptr
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: memory at %#x is no longer mapped (fault): its owner shrank or unmapped memory it registered", e.What, e.Addr)
}

// Do runs f, turning a memory fault in it into an *Error naming what. f
// must not start goroutines that touch the memory (the guard is the
// calling goroutine's) and must leave its state consistent at any point
// where it may fault (it stops there).
func Do(what string, f func()) (err error) {
	old := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(old)
		r := recover()
		if r == nil {
			return
		}
		// A fault panics with a runtime.Error that has an Addr method.
		if f, ok := r.(interface {
			error
			Addr() uintptr
		}); ok {
			err = &Error{What: what, Addr: f.Addr()}
			return
		}
		panic(r)
	}()
	f()
	return nil
}

// Copy is copy(dst, src) through Do.
func Copy(what string, dst, src []byte) (n int, err error) {
	err = Do(what, func() { n = copy(dst, src) })
	return n, err
}
