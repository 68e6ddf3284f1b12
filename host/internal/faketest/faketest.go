// Package faketest gives tests the fake plugin that `make plugin-fake`
// builds, loaded once per test binary.
package faketest

import (
	"sync"
	"testing"

	"github.com/kvhost/kvhost/host/plugin"
)

var (
	once   sync.Once
	loaded *plugin.Plugin
	err    error
)

// Plugin returns the fake plugin, found as kvhost finds plugins
// (plugin.SearchDirs). Without it the test fails, saying how to build it:
// a skip would let `go test` pass without running anything.
func Plugin(t testing.TB) *plugin.Plugin {
	t.Helper()
	once.Do(func() { loaded, err = plugin.Load("fake", plugin.SearchDirs("")) })
	if err != nil {
		t.Fatalf("the fake plugin is needed (make plugin-fake): %v", err)
	}
	return loaded
}
