package push_test

import (
	"reflect"
	"strconv"
	"testing"

	"github.com/kvhost/kvhost/host/plugin"
)

// The prefill writes, so its agent gets the host's initiator defaults
// (num_threads, which the fake plugin documents, as nixl does); the decode
// is written to and gets the target's (prefault=false); a value the caller
// gives wins.
func TestAgentSideDefaults(t *testing.T) {
	threads := plugin.Param{Key: plugin.ThreadsParam, Value: strconv.Itoa(plugin.InitiatorThreads)}
	r := newRig(t, rigOpts{})
	if got, want := r.pf.Agent().Params(), []plugin.Param{threads}; !reflect.DeepEqual(got, want) {
		t.Errorf("prefill agent params = %v, want %v", got, want)
	}
	if got, want := r.dec.Agent().Params(), []plugin.Param{{Key: plugin.PrefaultParam, Value: "false"}}; !reflect.DeepEqual(got, want) {
		t.Errorf("decode agent params = %v, want %v", got, want)
	}
	own := []plugin.Param{{Key: plugin.ThreadsParam, Value: "0"}, {Key: "workers", Value: "2"}, {Key: plugin.PrefaultParam, Value: "true"}}
	r = newRig(t, rigOpts{pparams: own, dparams: own})
	if got := r.pf.Agent().Params(); !reflect.DeepEqual(got, own) {
		t.Errorf("prefill agent params = %v, want the caller's %v", got, own)
	}
	if got := r.dec.Agent().Params(); !reflect.DeepEqual(got, own) {
		t.Errorf("decode agent params = %v, want the caller's %v", got, own)
	}
}
