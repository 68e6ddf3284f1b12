package pullworker

import (
	"reflect"
	"strconv"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/plugin"
)

// The decode reads, so its agents get the host's initiator defaults
// (num_threads, documented by the fake plugin as by nixl); the prefill is
// read from and gets the target's (prefault=false); a value the caller
// gives wins.
func TestAgentSideDefaults(t *testing.T) {
	threads := plugin.Param{Key: plugin.ThreadsParam, Value: strconv.Itoa(plugin.InitiatorThreads)}
	pl := faketest.Plugin(t)
	for _, c := range []struct {
		given           []plugin.Param
		prefill, decode []plugin.Param
	}{
		{nil, []plugin.Param{{Key: plugin.PrefaultParam, Value: "false"}}, []plugin.Param{threads}},
		{[]plugin.Param{{Key: plugin.ThreadsParam, Value: "1"}}, []plugin.Param{{Key: plugin.ThreadsParam, Value: "1"}, {Key: plugin.PrefaultParam, Value: "false"}}, []plugin.Param{{Key: plugin.ThreadsParam, Value: "1"}}},
		{[]plugin.Param{{Key: plugin.PrefaultParam, Value: "true"}}, []plugin.Param{{Key: plugin.PrefaultParam, Value: "true"}}, []plugin.Param{{Key: plugin.PrefaultParam, Value: "true"}, threads}},
	} {
		pf, err := StartPrefill(PrefillConfig{Plugin: pl, AgentParams: c.given, Model: smallModel, Engine: engine(1, 16, "HND"), EngineID: "p",
			SideChannel: "tcp://127.0.0.1:0", APIAddr: "127.0.0.1:0", AbortTimeout: time.Second,
			Workload: Workload{Seed: 3, Requests: 1, MinTokens: 10, MaxTokens: 20}, Logger: testLog()})
		if err != nil {
			t.Fatal(err)
		}
		if got := pf.agents[0].Params(); !reflect.DeepEqual(got, c.prefill) {
			t.Errorf("given %v: prefill agent params = %v, want %v", c.given, got, c.prefill)
		}
		pf.Close()
		cfg := DecodeConfig{Plugin: pl, AgentParams: c.given, Model: smallModel, Engine: engine(1, 16, "HND"), EngineID: "d",
			PrefillURL: "http://127.0.0.1:1", Workload: Workload{Seed: 3, Requests: 1, MinTokens: 10, MaxTokens: 20}, Logger: testLog()}
		if err := checkDecodeConfig(&cfg); err != nil {
			t.Fatal(err)
		}
		d := &decodeRun{cfg: cfg, log: testLog(), client: newPrefillClient(cfg.PrefillURL, cfg.ConnectTimeout)}
		if err := d.setup(); err != nil {
			t.Fatal(err)
		}
		if got := d.agents[0].Params(); !reflect.DeepEqual(got, c.decode) {
			t.Errorf("given %v: decode agent params = %v, want %v", c.given, got, c.decode)
		}
		d.close()
	}
}
