package faketest

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// skipAllowed lists the skips that are not a missing prerequisite: a run
// asked for explicitly (soaks, measurements), a measurement the race
// detector makes meaningless, a hardware condition, and the plugin
// conformance suite's capability skips (a plugin that lacks a capability
// has nothing to test there). Each entry is a file (relative to the module
// root, or a folder ending in /) and a phrase its skip message holds.
var skipAllowed = []struct{ path, phrase string }{
	{"host/demo/pullworker/soak_test.go", "KVHOST_SOAK=1"},
	{"host/demo/pushworker/e2e/e2e_test.go", "KVHOST_SOAK=1"},
	{"host/plugin/", "race detector"}, // allocation counts and latencies
	{"plugins/nixl/", ""},             // optional vendor plugin: runs where NIXL is installed
	{"plugins/mori/", ""},             // optional vendor plugin: runs where MORI is installed
	{"host/conformance/", "lack"},
	{"host/conformance/", "does not support DRAM"},
	{"host/conformance/", "cannot name remote regions"},
	{"host/conformance/", "no fail_rate parameter"},
	{"host/conformance/", "needs a peer process"},
}

// TestNoSkipOnMissingPrerequisite fails on any Skip, Skipf or SkipNow in
// the repository's Go code that skipAllowed does not list: a test that
// skips when the fake plugin, Python or a system file is missing lets
// `go test ./...` pass having checked nothing, so such tests fail instead
// (as Plugin does).
func TestNoSkipOnMissingPrerequisite(t *testing.T) {
	root, err := filepath.Abs("../../..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("module root %s: %v", root, err)
	}
	fset := token.NewFileSet()
	var found int
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); path != root && (strings.HasPrefix(n, ".") || n == "testdata" || n == "vendor" || n == "build" || n == "dist") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		rel, _ := filepath.Rel(root, path)
		rel = filepath.ToSlash(rel)
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || (sel.Sel.Name != "Skip" && sel.Sel.Name != "Skipf" && sel.Sel.Name != "SkipNow") {
				return true
			}
			found++
			msg := ""
			if len(call.Args) > 0 {
				if lit, ok := call.Args[0].(*ast.BasicLit); ok {
					msg = lit.Value
				}
			}
			for _, a := range skipAllowed {
				inPath := rel == a.path || (strings.HasSuffix(a.path, "/") && strings.HasPrefix(rel, a.path))
				if inPath && strings.Contains(msg, a.phrase) {
					return true
				}
			}
			t.Errorf("%s: %s(%s): a test must fail, not skip, when a prerequisite is missing (or list the skip in skipAllowed with why)",
				fset.Position(call.Pos()), sel.Sel.Name, msg)
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if found == 0 {
		t.Fatal("no Skip call found at all: the walk missed the repository")
	}
}
