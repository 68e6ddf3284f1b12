package main

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/conformance"
	"github.com/kvhost/kvhost/host/plugin"
)

// asKvhostEnv makes this test binary run as kvhost (see kvhostProcess).
const asKvhostEnv = "KVHOST_TEST_RUN_AS_KVHOST"

// TestMain lets this test binary stand in for kvhost: as the helper process
// of `plugins --check` (which starts os.Executable() with
// "plugins --conformance-helper" and conformance.HelperEnv set), and as the
// worker processes tests start with asKvhostEnv set.
func TestMain(m *testing.M) {
	if os.Getenv(conformance.HelperEnv) != "" || os.Getenv(asKvhostEnv) != "" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// fakeDir returns the folder of the fake plugin the build made.
func fakeDir(t *testing.T) string {
	t.Helper()
	path, err := plugin.Find("fake", plugin.SearchDirs(""))
	if err != nil {
		t.Fatalf("%v (build it with `make plugin-fake`)", err)
	}
	return filepath.Dir(path)
}

// fakeABI2 returns the fake plugin built to claim ABI major 2 (`make
// plugin-fake-abi2`, part of `make test`).
func fakeABI2(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	for ; ; dir = filepath.Dir(dir) {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			break
		}
		if filepath.Dir(dir) == dir {
			t.Fatal("no go.mod above the test's folder")
		}
	}
	path := filepath.Join(dir, "build", "testplugins", plugin.FileName("fakeabi2"))
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("%v: build it with `make plugin-fake-abi2`", err)
	}
	return path
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o755); err != nil {
		t.Fatal(err)
	}
}

// pluginDirWithReject makes a folder holding a copy of the fake plugin and
// files the host must reject: the fake built for ABI 2, a file that is not
// a library, and a library that is not a plugin.
func pluginDirWithReject(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	copyFile(t, filepath.Join(fakeDir(t), plugin.FileName("fake")), filepath.Join(dir, plugin.FileName("fake")))
	copyFile(t, fakeABI2(t), filepath.Join(dir, plugin.FileName("fakeabi2")))
	if err := os.WriteFile(filepath.Join(dir, plugin.FileName("junk")), []byte("not a library"), 0o644); err != nil {
		t.Fatal(err)
	}
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Fatalf("gcc is needed to build a non-plugin library: %v", err)
	}
	c := filepath.Join(dir, "lib.c")
	if err := os.WriteFile(c, []byte("int not_a_plugin(void) { return 1; }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(gcc, "-shared", "-fPIC", "-o", filepath.Join(dir, plugin.FileName("other")), c).CombinedOutput(); err != nil {
		t.Fatalf("gcc: %v\n%s", err, out)
	}
	return dir
}

func TestPluginsListJSON(t *testing.T) {
	dir := pluginDirWithReject(t)
	out, err := runKvhost(t, "", "--plugin-path", dir, "plugins", "--json")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	var list pluginList
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if len(list.SearchPath) == 0 || list.SearchPath[0] != dir {
		t.Errorf("search path %q does not start with --plugin-path %s", list.SearchPath, dir)
	}
	byFile := map[string]pluginEntry{}
	for _, p := range list.Plugins {
		byFile[p.File] = p
	}
	fake := byFile[filepath.Join(dir, plugin.FileName("fake"))]
	if fake.Name != "fake" || !fake.Used || fake.ABI != "1.1" || fake.Version == "" || fake.Error != "" ||
		!strings.Contains(strings.Join(fake.Caps, ","), "prepped,batch,strided,notif,telemetry") ||
		strings.Join(fake.MemKinds, ",") != "DRAM,VRAM" || len(fake.Params) == 0 {
		t.Errorf("fake entry %+v", fake)
	}
	// The build tree's fake comes later in the path: listed, shadowed.
	shadowed := false
	for _, p := range list.Plugins {
		if p.Name == "fake" && p.File != fake.File {
			shadowed = p.ShadowedBy == fake.File && !p.Used
		}
	}
	if !shadowed {
		t.Errorf("the build tree's fake is not listed as shadowed by %s: %s", fake.File, out)
	}
	junk := byFile[filepath.Join(dir, plugin.FileName("junk"))]
	if junk.Used || !strings.Contains(junk.Error, "not a loadable library") {
		t.Errorf("junk entry %+v", junk)
	}
	abi2 := byFile[filepath.Join(dir, plugin.FileName("fakeabi2"))]
	if abi2.Used || !strings.HasSuffix(abi2.Error, "plugin speaks ABI 2 (majors 2..2), host speaks 1") || !strings.Contains(abi2.Error, abi2.File) {
		t.Errorf("ABI-2 entry %+v, want it rejected naming the file and both versions", abi2)
	}
	other := byFile[filepath.Join(dir, plugin.FileName("other"))]
	if other.Used || !strings.Contains(other.Error, "no kvp_plugin_get_api symbol") {
		t.Errorf("non-plugin library entry %+v", other)
	}
}

func TestPluginsListText(t *testing.T) {
	dir := pluginDirWithReject(t)
	out, err := runKvhost(t, "", "--plugin-path", dir, "plugins")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{
		"plugin path: " + dir + ":",
		"fake  " + filepath.Join(dir, plugin.FileName("fake")),
		"version 1.0.0, ABI 1.1",
		"capabilities: prepped batch strided notif telemetry remote_addr remote_blob event_fd submit",
		"memory kinds: DRAM VRAM",
		"caps_off=",
		"junk  " + filepath.Join(dir, plugin.FileName("junk")),
		"REJECTED: not a loadable library",
		"fakeabi2  " + filepath.Join(dir, plugin.FileName("fakeabi2")) + "\n  REJECTED: plugin speaks ABI 2 (majors 2..2), host speaks 1",
		"REJECTED: no kvp_plugin_get_api symbol",
		"not used: shadowed by " + filepath.Join(dir, plugin.FileName("fake")),
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

func TestPluginsCheckFake(t *testing.T) {
	out, err := runKvhost(t, "", "--plugin-path", fakeDir(t), "plugins", "--check", "fake", "--param", "caps_off=prepped")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{"PASS  in-process   prepped-write", "PASS  two-process  prepped-write", "PASS  two-process  notif-buffer", "PASS  two-process  peer-exit", "fake: 57 passed, 0 failed, 1 skipped"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

func TestPluginsCheckFailsOnFailure(t *testing.T) {
	// An unknown parameter makes every agent_create fail: the suite fails
	// and the command must say so with a non-zero exit.
	out, err := runKvhost(t, "", "--plugin-path", fakeDir(t), "plugins", "--check", "fake", "--mode", "in-process", "--param", "no_such_param=1")
	if err == nil || !strings.Contains(err.Error(), "cases failed") {
		t.Fatalf("err %v, want a failure\n%s", err, out)
	}
	if !strings.Contains(out, "FAIL  in-process   agents") || !strings.Contains(out, "unknown") {
		t.Errorf("output does not show the failing case and the plugin's reason:\n%s", out)
	}
}

func TestPluginsCheckErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"plugins", "--check", "no-such-plugin"}, "plugin not found"},
		{[]string{"plugins", "--check", "fake", "--mode", "sideways"}, "--mode"},
		{[]string{"plugins", "--check", "fake", "--param", "novalue"}, "want key=value"},
		{[]string{"plugins", "--param", "a=b"}, "go with --check"},
		{[]string{"plugins", "extra"}, "unexpected argument"},
		{[]string{"plugins", "--conformance-helper"}, "started by --check"},
	} {
		out, err := runKvhost(t, "", append([]string{"--plugin-path", fakeDir(t)}, tc.args...)...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: err %v, want %q\n%s", tc.args, err, tc.want, out)
		}
	}
	if _, err := runKvhost(t, "", "plugins", "--check", "no-such-plugin"); !errors.Is(err, plugin.ErrPluginNotFound) {
		t.Errorf("--check of a missing plugin: %v, want ErrPluginNotFound", err)
	}
}
