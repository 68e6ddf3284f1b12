// Package cudarttest builds the stand-in libcudart of host/serve/engmem's
// tests (engmem/testdata/cudart_standin.c: CUDA's IPC entry points over
// POSIX shared memory, the handle carrying a shm name), so that every
// package testing the VRAM path without a GPU loads the same library.
package cudarttest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
)

var (
	once sync.Once
	dir  string
	path string
	err  error
)

// Path builds the stand-in with gcc once per test process and returns the
// library's path. No gcc fails the test: the VRAM path would otherwise go
// untested.
func Path(tb testing.TB) string {
	tb.Helper()
	once.Do(func() {
		gcc, lerr := exec.LookPath("gcc")
		if lerr != nil {
			err = fmt.Errorf("gcc is needed to build the stand-in libcudart: %v", lerr)
			return
		}
		_, self, _, _ := runtime.Caller(0)
		src := filepath.Join(filepath.Dir(self), "..", "testdata", "cudart_standin.c")
		if dir, err = os.MkdirTemp("", "kvhost-cudart-standin-"); err != nil {
			return
		}
		path = filepath.Join(dir, "libcudart_standin.so")
		out, berr := exec.Command(gcc, "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-pthread",
			"-fvisibility=hidden", "-o", path, src).CombinedOutput()
		if berr != nil {
			err = fmt.Errorf("building the stand-in libcudart: %v\n%s", berr, out)
		}
	})
	if err != nil {
		tb.Fatal(err)
	}
	return path
}

// Cleanup removes the built library; call it from TestMain after m.Run.
func Cleanup() {
	if dir != "" {
		os.RemoveAll(dir)
	}
}
