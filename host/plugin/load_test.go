package plugin

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ebitengine/purego"
	"github.com/kvhost/kvhost/abi"
)

// buildTestPlugin compiles testdata/testplugin.c with the given -D flags to
// dir/libkvhost_<name>.so.
func buildTestPlugin(t *testing.T, dir, name string, defines ...string) string {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Fatalf("gcc is needed to build test plugins (it builds the real ones too): %v", err)
	}
	cwd, _ := os.Getwd()
	root := moduleRoot(cwd)
	if root == "" {
		t.Fatalf("no kvhost module above %s", cwd)
	}
	out := filepath.Join(dir, FileName(name))
	args := []string{"-std=c11", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
		"-I" + filepath.Join(root, "abi"), "-o", out, "testdata/testplugin.c"}
	for _, d := range defines {
		args = append(args, "-D"+d)
	}
	if msg, err := exec.Command(gcc, args...).CombinedOutput(); err != nil {
		t.Fatalf("gcc %s: %v\n%s", strings.Join(args, " "), err, msg)
	}
	return out
}

// cCounter calls an exported `int f(void)` of the library at path.
func cCounter(t *testing.T, path, sym string) int {
	t.Helper()
	lib, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		t.Fatal(err)
	}
	defer purego.Dlclose(lib)
	fn, err := purego.Dlsym(lib, sym)
	if err != nil {
		t.Fatal(err)
	}
	r, _, _ := purego.SyscallN(fn)
	return int(int32(r))
}

func TestOpenReadsInfo(t *testing.T) {
	path := buildTestPlugin(t, t.TempDir(), "tp")
	p, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	info := p.Info()
	if info.Name != "testplugin" || info.Version != "0.0.1-test" || info.ABIMajor != 1 || info.ABIMinor != 0 {
		t.Errorf("info = %+v", info)
	}
	if want := abi.CapPrepped | abi.CapBatch | abi.CapRemoteAddr; info.Caps != want {
		t.Errorf("caps = %v, want %v", info.Caps.Names(), want.Names())
	}
	if len(info.MemKinds) != 2 || info.MemKinds[0] != abi.DRAM || info.MemKinds[1] != abi.VRAM {
		t.Errorf("mem kinds = %v", info.MemKinds)
	}
	wantDoc := []ParamDoc{{"agent_caps", "", "capabilities the agent reports"}, {"alpha", "1", "first parameter"}}
	if len(info.ParamsDoc) != 2 || info.ParamsDoc[0] != wantDoc[0] || info.ParamsDoc[1] != wantDoc[1] {
		t.Errorf("params doc = %+v, want %+v", info.ParamsDoc, wantDoc)
	}
	if !info.HasParam("alpha") || info.HasParam("beta") {
		t.Error("HasParam")
	}
	if p.Path() != path || p.Name() != "testplugin" {
		t.Errorf("path %q name %q", p.Path(), p.Name())
	}
}

func TestPluginErrorsBecomeGoErrors(t *testing.T) {
	path := buildTestPlugin(t, t.TempDir(), "tp")
	p, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	_, err = p.NewAgent("a", Param{"bogus", "1"})
	var pe *Error
	if !errors.As(err, &pe) {
		t.Fatalf("NewAgent with a bad parameter: got %v, want *Error", err)
	}
	if pe.Plugin != "testplugin" || pe.Op != "agent_create" || pe.Code != abi.ErrInvalidParam || pe.Message != "unknown parameter bogus" || pe.Host {
		t.Errorf("error = %+v", pe)
	}
	if !errors.Is(err, ErrInvalidParam) || errors.Is(err, ErrNotFound) {
		t.Errorf("errors.Is against the code sentinels is wrong for %v", err)
	}
	if got := err.Error(); got != "plugin testplugin: agent_create: ERR_INVALID_PARAM: unknown parameter bogus" {
		t.Errorf("message %q", got)
	}

	a, err := p.NewAgent("a", Param{"alpha", "2"}, Param{"agent_caps", "35"}) // prepped|batch|remote_addr
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Register([]abi.MemDesc{{Addr: 4096, Len: 4096}}); !errors.Is(err, ErrNotSupported) {
		t.Errorf("Register on a plugin that refuses: %v", err)
	}
	if _, err := a.LocalMetadata(); !errors.Is(err, ErrNotSupported) {
		t.Errorf("LocalMetadata: %v", err)
	}
	// Capabilities the agent lacks are refused by the host, not the plugin.
	_, err = a.ImportRegion("peer", []byte{1})
	if !errors.As(err, &pe) || !pe.Host || pe.Code != abi.ErrNotSupported {
		t.Errorf("ImportRegion without remote_blob: %v", err)
	}
	if _, err := a.Notifs(); !errors.Is(err, ErrNotSupported) {
		t.Errorf("Notifs without notif: %v", err)
	}
	if n := cCounter(t, path, "testplugin_live_errors"); n != 0 {
		t.Errorf("%d error objects were not destroyed", n)
	}
	before := cCounter(t, path, "testplugin_agents_destroyed")
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); !errors.Is(err, ErrClosed) {
		t.Errorf("second Close: %v", err)
	}
	if _, err := a.Register([]abi.MemDesc{{Addr: 4096, Len: 4096}}); !errors.Is(err, ErrClosed) {
		t.Errorf("Register after Close: %v", err)
	}
	if got := cCounter(t, path, "testplugin_agents_destroyed"); got != before+1 {
		t.Errorf("agent_destroy called %d times, want 1", got-before)
	}
}

func TestAgentCapsAreValidated(t *testing.T) {
	path := buildTestPlugin(t, t.TempDir(), "tp")
	p, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, tc := range []struct {
		caps abi.Caps
		want string
	}{
		{abi.CapPrepped | abi.CapNotif, "does not"},      // more than the plugin
		{abi.CapRemoteAddr, "neither prepped nor batch"}, // no way to transfer
	} {
		before := cCounter(t, path, "testplugin_agents_destroyed")
		_, err := p.NewAgent("a", Param{"agent_caps", itoa(uint32(tc.caps))})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("agent caps %v: got %v, want an error containing %q", tc.caps.Names(), err, tc.want)
		}
		if got := cCounter(t, path, "testplugin_agents_destroyed"); got != before+1 {
			t.Errorf("agent caps %v: the refused agent was not destroyed", tc.caps.Names())
		}
	}
	a, err := p.NewAgent("a", Param{"agent_caps", itoa(uint32(abi.CapBatch | abi.CapRemoteAddr))})
	if err != nil {
		t.Fatal(err)
	}
	if a.Caps() != abi.CapBatch|abi.CapRemoteAddr {
		t.Errorf("Caps = %v", a.Caps().Names())
	}
	if want := abi.CapPrepped | abi.CapStrided | abi.CapSubmit; a.Emulated() != want {
		t.Errorf("Emulated = %v, want %v", a.Emulated().Names(), want.Names())
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); !errors.Is(err, ErrClosed) {
		t.Errorf("Plugin.Close did not close the agent: %v", err)
	}
	if _, err := p.NewAgent("b"); !errors.Is(err, ErrClosed) {
		t.Errorf("NewAgent after Plugin.Close: %v", err)
	}
}

func TestLoadRejections(t *testing.T) {
	dir := t.TempDir()
	junk := filepath.Join(dir, FileName("junk"))
	if err := os.WriteFile(junk, []byte("not an ELF file"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		defines []string
		path    string
		kind    error
		detail  string
	}{
		{name: "junk", path: junk, kind: ErrNotPlugin, detail: "not a loadable library"},
		{name: "noentry", defines: []string{"TP_NO_ENTRY"}, kind: ErrNoEntry, detail: "no kvp_plugin_get_api symbol"},
		{name: "abi2", defines: []string{"TP_MAJOR_MIN=2", "TP_MAJOR_MAX=2"}, kind: ErrABIMismatch, detail: "plugin speaks ABI 2 (majors 2..2), host speaks 1"},
		{name: "abi23", defines: []string{"TP_MAJOR_MIN=2", "TP_MAJOR_MAX=3"}, kind: ErrABIMismatch, detail: "plugin speaks ABI 3 (majors 2..3), host speaks 1"},
		{name: "infomajor", defines: []string{"TP_INFO_MAJOR=2"}, kind: ErrABIMismatch, detail: "plugin_info reports ABI 2.0"},
		{name: "nullpost", defines: []string{"TP_NULL_POST"}, kind: ErrBadTable, detail: "required functions are NULL: post_xfer"},
		{name: "smalltable", defines: []string{"TP_SMALL_TABLE"}, kind: ErrBadTable, detail: "struct_size 64"},
		{name: "nocaps", defines: []string{"TP_CAPS=KVP_CAP_NOTIF"}, kind: ErrBadTable, detail: "neither prepped nor batch"},
		{name: "batchnoremote", defines: []string{"TP_CAPS=KVP_CAP_BATCH"}, kind: ErrBadTable, detail: "batch needs remote_addr or remote_blob"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := tc.path
			if path == "" {
				path = buildTestPlugin(t, dir, tc.name, tc.defines...)
			}
			_, err := Open(path)
			var le *LoadError
			if !errors.As(err, &le) || !errors.Is(err, tc.kind) {
				t.Fatalf("Open: got %v, want a *LoadError of kind %v", err, tc.kind)
			}
			if le.Path != path || !strings.Contains(err.Error(), tc.detail) || !strings.HasPrefix(err.Error(), path+": ") {
				t.Errorf("Open: %q, want the path and %q", err, tc.detail)
			}
			if _, perr := Probe(path); perr == nil || perr.Error() != err.Error() {
				t.Errorf("Probe: %v, want the same as Open", perr)
			}
		})
	}
}

func TestCheckABI(t *testing.T) {
	path := buildTestPlugin(t, t.TempDir(), "range", "TP_MAJOR_MIN=1", "TP_MAJOR_MAX=3")
	for _, tc := range []struct {
		major uint32
		ok    bool
	}{{0, false}, {1, true}, {3, true}, {4, false}} {
		lo, hi, err := CheckABI(path, tc.major, 0)
		if lo != 1 || hi != 3 {
			t.Errorf("major %d: range %d..%d, want 1..3", tc.major, lo, hi)
		}
		if tc.ok != (err == nil) || (!tc.ok && !errors.Is(err, ErrABIMismatch)) {
			t.Errorf("major %d: err %v", tc.major, err)
		}
		if !tc.ok && !strings.Contains(err.Error(), "host speaks "+itoa(tc.major)) {
			t.Errorf("major %d: %v does not name the host's version", tc.major, err)
		}
	}
}

func TestDiscoverAndFind(t *testing.T) {
	d1, d2, missing := t.TempDir(), t.TempDir(), filepath.Join(t.TempDir(), "missing")
	good1 := buildTestPlugin(t, d1, "good")
	old := buildTestPlugin(t, d1, "old", "TP_MAJOR_MIN=2", "TP_MAJOR_MAX=2")
	good2 := buildTestPlugin(t, d2, "good")
	other := buildTestPlugin(t, d2, "other")
	if err := os.WriteFile(filepath.Join(d1, "libfoo.so"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(d1, FileName("dir")), 0o755); err != nil {
		t.Fatal(err)
	}
	dirs := []string{missing, d1, d2}
	got := Discover(dirs)
	type row struct {
		name, path, shadowed string
		ok                   bool
	}
	want := []row{{"good", good1, "", true}, {"old", old, "", false}, {"good", good2, good1, true}, {"other", other, "", true}}
	if len(got) != len(want) {
		t.Fatalf("Discover found %d candidates, want %d: %+v", len(got), len(want), got)
	}
	for i, w := range want {
		c := got[i]
		if c.Name != w.name || c.Path != w.path || c.ShadowedBy != w.shadowed || (c.Err == nil) != w.ok || (c.Info != nil) != w.ok {
			t.Errorf("candidate %d = %+v, want %+v", i, c, w)
		}
	}
	if !errors.Is(got[1].Err, ErrABIMismatch) {
		t.Errorf("old plugin rejected with %v", got[1].Err)
	}
	if got[0].Info.Name != "testplugin" {
		t.Errorf("info %+v", got[0].Info)
	}

	if p, err := Find("good", dirs); err != nil || p != good1 {
		t.Errorf("Find(good) = %q, %v; want %q", p, err, good1)
	}
	if p, err := Find("other", dirs); err != nil || p != other {
		t.Errorf("Find(other) = %q, %v", p, err)
	}
	_, err := Find("absent", dirs)
	if !errors.Is(err, ErrPluginNotFound) || !strings.Contains(err.Error(), "libkvhost_absent.so") || !strings.Contains(err.Error(), d2) {
		t.Errorf("Find(absent): %v", err)
	}
	for _, bad := range []string{"", "../x", "a/b", ".hidden"} {
		if _, err := Find(bad, dirs); err == nil || errors.Is(err, ErrPluginNotFound) {
			t.Errorf("Find(%q) = %v, want a name error", bad, err)
		}
	}
	p, err := Load("good", dirs)
	if err != nil {
		t.Fatal(err)
	}
	p.Close()
	if _, err := Load("old", dirs); !errors.Is(err, ErrABIMismatch) {
		t.Errorf("Load(old): %v", err)
	}
}

func TestSearchDirs(t *testing.T) {
	root := t.TempDir()
	if err := os.WriteFile(filepath.Join(root, "go.mod"), []byte("// kvhost\nmodule github.com/kvhost/kvhost\n\ngo 1.26\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	deep := filepath.Join(root, "host", "plugin")
	if err := os.MkdirAll(deep, 0o755); err != nil {
		t.Fatal(err)
	}
	other := t.TempDir()
	if err := os.WriteFile(filepath.Join(other, "go.mod"), []byte("module example.com/other\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	build := filepath.Join(root, "lib", "kvhost")
	for _, tc := range []struct {
		name                string
		flag, env, exe, cwd string
		want                []string
	}{
		{"flag wins over env, then binary, ../lib/kvhost, build tree", "/a:/b/::/a", "/env", "/opt/kv/bin/kvhost", deep,
			[]string{"/a", "/b", "/opt/kv/bin", "/opt/kv/lib/kvhost", build}},
		{"env when no flag", "", "/e1:/e2", "/opt/kv/bin/kvhost", deep,
			[]string{"/e1", "/e2", "/opt/kv/bin", "/opt/kv/lib/kvhost", build}},
		{"outside a checkout", "", "", "/usr/bin/kvhost", other,
			[]string{"/usr/bin", "/usr/lib/kvhost"}},
		{"binary in the checkout", "", "", filepath.Join(root, "bin", "kvhost"), root,
			[]string{filepath.Join(root, "bin"), build}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := searchDirs(tc.flag, tc.env, tc.exe, tc.cwd)
			if strings.Join(got, "|") != strings.Join(tc.want, "|") {
				t.Errorf("searchDirs = %q, want %q", got, tc.want)
			}
		})
	}
	// The real thing, from this package's folder, ends with the build tree.
	dirs := SearchDirs("")
	cwd, _ := os.Getwd()
	if want := filepath.Join(moduleRoot(cwd), "lib", "kvhost"); dirs[len(dirs)-1] != want {
		t.Errorf("SearchDirs = %q, want the build tree %q last", dirs, want)
	}
}

func TestParseParams(t *testing.T) {
	got, err := ParseParams([]string{"backend=UCX", "caps_off=prepped,batch", "empty="})
	if err != nil || len(got) != 3 || got[0] != (Param{"backend", "UCX"}) || got[1] != (Param{"caps_off", "prepped,batch"}) || got[2] != (Param{"empty", ""}) {
		t.Errorf("ParseParams = %+v, %v", got, err)
	}
	for _, bad := range []string{"novalue", "=x"} {
		if _, err := ParseParams([]string{bad}); err == nil {
			t.Errorf("ParseParams(%q) accepted", bad)
		}
	}
	// What the CLI hands over for --param caps_off=prepped,notif,remote_addr --param workers=2.
	got, err = ParseParams([]string{"caps_off=prepped", "notif", "remote_addr", "workers=2"})
	if err != nil || len(got) != 2 || got[0] != (Param{"caps_off", "prepped,notif,remote_addr"}) || got[1] != (Param{"workers", "2"}) {
		t.Errorf("ParseParams of a comma-split list = %+v, %v", got, err)
	}
}

func TestParseParamsDoc(t *testing.T) {
	got := parseParamsDoc("a=1\tfirst\n\nb=\tsecond one\r\nc\n  \nd=x=y\tthird\n")
	want := []ParamDoc{{"a", "1", "first"}, {"b", "", "second one"}, {"c", "", ""}, {"d", "x=y", "third"}}
	if len(got) != len(want) {
		t.Fatalf("got %+v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("line %d: %+v, want %+v", i, got[i], want[i])
		}
	}
}

func TestErrorFormatting(t *testing.T) {
	e := hostError("fake", "make_prepped_xfer", abi.ErrMismatch, "position %d", 3)
	if e.Error() != "host (plugin fake): make_prepped_xfer: ERR_MISMATCH: position 3" {
		t.Errorf("%q", e.Error())
	}
	if !errors.Is(e, ErrMismatch) || errors.Is(e, ErrInvalidParam) {
		t.Error("errors.Is")
	}
	e2 := &Error{Plugin: "x", Op: "poll_xfer", Code: abi.ErrCanceled}
	if e2.Error() != "plugin x: poll_xfer: ERR_CANCELED" || !errors.Is(e2, ErrCanceled) {
		t.Errorf("%q", e2.Error())
	}
	if err := closedError("agent a"); !errors.Is(err, ErrClosed) || err.Error() != "agent a: handle is closed" {
		t.Errorf("%v", err)
	}
}

// TestNotifsOfAMisbehavingPlugin: a get_notifs that never delivers what it
// announces ends Notifs with an error, without looping or allocating
// without bound.
func TestNotifsOfAMisbehavingPlugin(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		mode, want string
	}{
		{"1", "copied nothing"},
		{"2", "-byte notification"},
	} {
		path := buildTestPlugin(t, dir, "badnotifs"+tc.mode, "TP_BAD_NOTIFS="+tc.mode, "TP_CAPS=(KVP_CAP_PREPPED|KVP_CAP_NOTIF)")
		p, err := Open(path)
		if err != nil {
			t.Fatal(err)
		}
		a, err := p.NewAgent("a")
		if err != nil {
			t.Fatal(err)
		}
		ns, err := a.Notifs()
		if err == nil || !strings.Contains(err.Error(), tc.want) || len(ns) != 0 {
			t.Errorf("get_notifs mode %s: %d notifications, %v; want an error containing %q", tc.mode, len(ns), err, tc.want)
		}
		p.Close()
	}
}
