package serve

import (
	"os"
	"testing"

	"github.com/kvhost/kvhost/host/serve/engmem/cudarttest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	cudarttest.Cleanup()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// standin is host/serve/engmem's stand-in libcudart (CUDA's IPC entry
// points over POSIX shared memory), built once per test process.
func standin(t testing.TB) string { return cudarttest.Path(t) }
