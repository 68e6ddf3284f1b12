package serve

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
)

var (
	standinOnce sync.Once
	standinDir  string
	standinPath string
	standinErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	for _, d := range []string{standinDir, buildDir} {
		if d != "" {
			os.RemoveAll(d)
		}
	}
	os.Exit(code)
}

// standin builds host/serve/engmem's stand-in libcudart
// (engmem/testdata/cudart_standin.c: CUDA's IPC entry points over POSIX
// shared memory) once per test process. No gcc fails the test.
func standin(t testing.TB) string {
	t.Helper()
	standinOnce.Do(func() {
		gcc, err := exec.LookPath("gcc")
		if err != nil {
			standinErr = fmt.Errorf("gcc is needed to build the stand-in libcudart: %v", err)
			return
		}
		if standinDir, standinErr = os.MkdirTemp("", "kvhost-serve-cudart-"); standinErr != nil {
			return
		}
		standinPath = filepath.Join(standinDir, "libcudart_standin.so")
		out, err := exec.Command(gcc, "-std=c11", "-O1", "-fPIC", "-shared", "-pthread",
			"-o", standinPath, "engmem/testdata/cudart_standin.c").CombinedOutput()
		if err != nil {
			standinErr = fmt.Errorf("building the stand-in libcudart: %v\n%s", err, out)
		}
	})
	if standinErr != nil {
		t.Fatal(standinErr)
	}
	return standinPath
}
