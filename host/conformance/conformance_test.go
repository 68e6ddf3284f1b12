package conformance_test

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/conformance"
	"github.com/kvhost/kvhost/host/plugin"
)

var (
	flagPlugin = flag.String("plugin", "", "plugin to prove; default: fake, in every configuration CI runs")
	flagParams = flag.String("params", "", "agent parameters k=v,k=v (a piece without '=' continues the previous value: caps_off=prepped,notif); selects this one configuration")
	flagMode   = flag.String("mode", "both", "in-process, two-process or both")
	flagABI    = flag.String("abi-variant", "", "colon-separated builds of the plugin for another ABI major, which the host must refuse")
)

// TestMain serves as the helper process of two-process runs: the suite
// starts this test binary again with conformance.HelperEnv set.
func TestMain(m *testing.M) {
	if os.Getenv(conformance.HelperEnv) != "" {
		if err := conformance.ServeHelperStdio(); err != nil {
			fmt.Fprintln(os.Stderr, "conformance helper:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

type configuration struct {
	name   string
	params []plugin.Param
}

// ciConfigurations are the fake plugin's configurations CI proves: every
// capability native, then each of prepped lists, batch transfers, strides
// and the ABI 1.1 pair (event descriptor, submit) switched off so that the
// host emulates it (or does without), and MORI-IO's profile.
var ciConfigurations = []configuration{
	{"all-caps", nil},
	{"caps_off=prepped", []plugin.Param{{Key: "caps_off", Value: "prepped"}}},
	{"caps_off=batch", []plugin.Param{{Key: "caps_off", Value: "batch"}}},
	{"caps_off=strided", []plugin.Param{{Key: "caps_off", Value: "strided"}}},
	// ABI 1.1 emulated: no event descriptor, submit and poll-release by
	// the host.
	{"caps_off=event_fd,submit", []plugin.Param{{Key: "caps_off", Value: "event_fd,submit"}}},
	// The MORI-IO profile, as plugins/mori reports it: batch transfers
	// with native strides, regions named by blobs (no remote addresses), no
	// prepped lists and no notifications (SGLang runs MORI-IO without
	// them).
	{"caps_off=prepped,notif,remote_addr", []plugin.Param{{Key: "caps_off", Value: "prepped,notif,remote_addr"}}},
}

// splitParams parses -params: comma-separated k=v pieces, where a piece
// without '=' belongs to the previous value.
func splitParams(s string) ([]plugin.Param, error) {
	var kvs []string
	for _, piece := range strings.Split(s, ",") {
		if !strings.Contains(piece, "=") && len(kvs) > 0 {
			kvs[len(kvs)-1] += "," + piece
			continue
		}
		kvs = append(kvs, piece)
	}
	return plugin.ParseParams(kvs)
}

func TestSplitParams(t *testing.T) {
	got, err := splitParams("backend=UCX,caps_off=prepped,notif,x=")
	if err != nil || len(got) != 3 || got[0] != (plugin.Param{Key: "backend", Value: "UCX"}) ||
		got[1] != (plugin.Param{Key: "caps_off", Value: "prepped,notif"}) || got[2] != (plugin.Param{Key: "x", Value: ""}) {
		t.Errorf("splitParams = %+v, %v", got, err)
	}
	if _, err := splitParams("nokey"); err == nil {
		t.Error("a piece without '=' and nothing before it was accepted")
	}
}

func TestConformance(t *testing.T) {
	name := *flagPlugin
	configs := ciConfigurations
	if name != "" || *flagParams != "" {
		params, err := splitParams(*flagParams)
		if *flagParams == "" {
			params, err = nil, nil
		}
		if err != nil {
			t.Fatalf("-params: %v", err)
		}
		label := *flagParams
		if label == "" {
			label = "default-params"
		}
		configs = []configuration{{label, params}}
	}
	if name == "" {
		name = "fake"
	}
	modes, err := conformance.ParseModes(*flagMode)
	if err != nil {
		t.Fatalf("-mode: %v", err)
	}
	var variants []string
	if *flagABI != "" {
		variants = strings.Split(*flagABI, ":")
	} else if name == "fake" {
		variants = fakeABIVariants(t)
	}
	dirs := plugin.SearchDirs("")
	for _, c := range configs {
		for _, mode := range modes {
			t.Run(name+"/"+c.name+"/"+mode.String(), func(t *testing.T) {
				s, err := conformance.Open(conformance.Config{
					Plugin: name, Dirs: dirs, Params: c.params, Mode: mode, ABIVariants: variants,
					Helper: func() *exec.Cmd { return exec.Command(os.Args[0], "-test.run=^$") },
				})
				if err != nil {
					hint := ""
					if name == "fake" {
						hint = " (build it with `make plugin-fake`)"
					}
					t.Fatalf("opening plugin %s%s: %v", name, hint, err)
				}
				defer func() {
					if err := s.Close(); err != nil {
						t.Errorf("closing the suite: %v", err)
					}
				}()
				for _, cs := range conformance.Cases() {
					t.Run(cs.Name, func(t *testing.T) { cs.Run(t, s) })
				}
			})
		}
	}
}

// fakeABIVariants returns the fake plugin's build for ABI major 2, made by
// `make plugin-fake-abi2` (and by `make test`) in the build tree.
func fakeABIVariants(t *testing.T) []string {
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for ; ; dir = filepath.Dir(dir) {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			break
		}
		if filepath.Dir(dir) == dir {
			t.Fatalf("no go.mod above the test's folder")
		}
	}
	path := filepath.Join(dir, "build", "testplugins", plugin.FileName("fakeabi2"))
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the fake plugin's ABI-2 build is missing (%v): run `make plugin-fake-abi2`, or pass -abi-variant", err)
	}
	return []string{path}
}
