package plugin

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
)

// EnvPluginPath is the environment variable holding extra plugin folders
// (colon-separated), searched first.
const EnvPluginPath = "KVHOST_PLUGIN_PATH"

// modulePath identifies a kvhost checkout (the build tree) by its go.mod.
const modulePath = "github.com/kvhost/kvhost"

const (
	filePrefix = "libkvhost_"
	fileSuffix = ".so"
)

// ErrPluginNotFound is returned by Find when no folder holds the plugin.
var ErrPluginNotFound = errors.New("plugin not found")

var validName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

// FileName returns the library file name of plugin name:
// libkvhost_<name>.so.
func FileName(name string) string { return filePrefix + name + fileSuffix }

// SearchDirs returns the folders searched for plugins, in order:
//
//  1. pluginPath (the --plugin-path flag), or when it is empty
//     $KVHOST_PLUGIN_PATH; both colon-separated;
//  2. the folder of the running binary;
//  3. ../lib/kvhost beside the binary (an installed bin/ + lib/kvhost/ tree);
//  4. the build tree: lib/kvhost in the kvhost checkout that contains the
//     working directory, if any (so `go test` and `go run` find `make`'s
//     plugins).
//
// Duplicates are dropped, keeping the first position.
func SearchDirs(pluginPath string) []string {
	exe, err := os.Executable()
	if err == nil {
		if resolved, err := filepath.EvalSymlinks(exe); err == nil {
			exe = resolved
		}
	}
	cwd, _ := os.Getwd()
	return searchDirs(pluginPath, os.Getenv(EnvPluginPath), exe, cwd)
}

// searchDirs is SearchDirs with its inputs made explicit, for tests.
func searchDirs(flagPath, envPath, exe, cwd string) []string {
	var dirs []string
	seen := map[string]bool{}
	add := func(d string) {
		if d == "" {
			return
		}
		d = filepath.Clean(d)
		if !seen[d] {
			seen[d] = true
			dirs = append(dirs, d)
		}
	}
	list := flagPath
	if list == "" {
		list = envPath
	}
	for _, d := range strings.Split(list, ":") {
		add(d)
	}
	if exe != "" {
		bin := filepath.Dir(exe)
		add(bin)
		add(filepath.Join(bin, "..", "lib", "kvhost"))
	}
	if root := moduleRoot(cwd); root != "" {
		add(filepath.Join(root, "lib", "kvhost"))
	}
	return dirs
}

// moduleRoot returns the nearest folder at or above dir whose go.mod declares
// the kvhost module, or "".
func moduleRoot(dir string) string {
	if dir == "" {
		return ""
	}
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		if isKVHostModule(filepath.Join(d, "go.mod")) {
			return d
		}
		if filepath.Dir(d) == d {
			return ""
		}
	}
}

func isKVHostModule(gomod string) bool {
	f, err := os.Open(gomod)
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), "module "); ok {
			return strings.Trim(strings.TrimSpace(rest), `"`) == modulePath
		}
	}
	return false
}

// Find returns the path of plugin name: the first file libkvhost_<name>.so
// in dirs. It does not open the file; a file found first is used even if a
// later folder holds a loadable one, so what runs never depends on a failure.
func Find(name string, dirs []string) (string, error) {
	if !validName.MatchString(name) {
		return "", fmt.Errorf("plugin name %q: want letters, digits, '_', '-' or '.'", name)
	}
	file := FileName(name)
	for _, d := range dirs {
		p := filepath.Join(d, file)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
	}
	return "", fmt.Errorf("%w: no %s in %s", ErrPluginNotFound, file, describeDirs(dirs))
}

func describeDirs(dirs []string) string {
	if len(dirs) == 0 {
		return "an empty search path"
	}
	return strings.Join(dirs, ", ")
}

// Candidate is one libkvhost_*.so file found by Discover.
type Candidate struct {
	Name string // from the file name: libkvhost_<Name>.so
	Path string
	Info *Info // nil when rejected
	Err  error // why the file was rejected (a *LoadError), or nil
	// ShadowedBy is the path of an earlier file with the same Name, which
	// Find and Load use instead of this one; "" if this one is used.
	ShadowedBy string
}

// Discover lists every libkvhost_*.so file in dirs, in search order, each
// with its Info or the reason it cannot be loaded. Missing folders are
// skipped.
func Discover(dirs []string) []Candidate {
	var out []Candidate
	first := map[string]string{}
	for _, d := range dirs {
		entries, err := os.ReadDir(d)
		if err != nil {
			continue
		}
		for _, e := range entries {
			fn := e.Name()
			if !strings.HasPrefix(fn, filePrefix) || !strings.HasSuffix(fn, fileSuffix) || len(fn) <= len(filePrefix)+len(fileSuffix) {
				continue
			}
			path := filepath.Join(d, fn)
			if st, err := os.Stat(path); err != nil || !st.Mode().IsRegular() {
				continue
			}
			c := Candidate{Name: strings.TrimSuffix(strings.TrimPrefix(fn, filePrefix), fileSuffix), Path: path}
			if prev, ok := first[c.Name]; ok {
				c.ShadowedBy = prev
			} else {
				first[c.Name] = path
			}
			if info, err := Probe(path); err != nil {
				c.Err = err
			} else {
				c.Info = &info
			}
			out = append(out, c)
		}
	}
	return out
}

func fileBase(path string) string { return filepath.Base(path) }
