package serve

import (
	"path/filepath"
	"testing"
)

// testEndpoint is an ipc endpoint in the test's temporary directory.
func testEndpoint(t testing.TB) string {
	return "ipc://" + filepath.Join(t.TempDir(), "kvhost.sock")
}
