package nixltest

import (
	"os"
	"testing"
)

// TestMain quiets NIXL's own log before the plugin (and with it libnixl,
// which reads NIXL_LOG_LEVEL once, when it is loaded) is loaded: the tests
// provoke errors on purpose and NIXL would print each on stderr. The
// plugin's errors carry NIXL's status either way; run with
// NIXL_LOG_LEVEL=ERROR (or DEBUG) to see NIXL's lines too. The variable
// reaches libnixl because purego routes os.Setenv to the C environment, and
// bin/nixl-bench-direct, which the overhead test runs, inherits it.
func TestMain(m *testing.M) {
	if _, set := os.LookupEnv("NIXL_LOG_LEVEL"); !set {
		os.Setenv("NIXL_LOG_LEVEL", "FATAL")
	}
	os.Exit(m.Run())
}
