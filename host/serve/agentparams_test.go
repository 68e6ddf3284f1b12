package serve

import (
	"strconv"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
)

var defaultThreads = strconv.Itoa(plugin.InitiatorThreads)

// openSGL opens an SGLang rank of role on srv with agent_params over.
func openSGL(t *testing.T, srv *Server, role, boot string, over map[string]string) (client.Rank, error) {
	t.Helper()
	ctx := testCtx(t)
	c := dial(t, srv)
	r, err := fakeengine.NewRank(shmName(), role, smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	if _, err := c.RegisterMemory(ctx, r.MemRegions()); err != nil {
		t.Fatal(err)
	}
	a := r.Args("nixl", boot)
	a.AgentParams = over
	return c.OpenSGLang(ctx, a)
}

// Every open_rank reply carries the agent's parameters: the initiator
// side (SGLang's prefill writes, vLLM's decode reads) gets the host's
// num_threads default, which the fake plugin documents as nixl does; the
// target side prefault=false (plugin.PrefaultParam); the sidecar's
// --agent-param and, over it, the rank's agent_params win.
func TestOpenRankAgentParams(t *testing.T) {
	ctx := testCtx(t)
	srv := newTestServer(t)
	boot, err := dial(t, srv).StartBootstrap(ctx, "127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	check := func(what string, rk client.Rank, err error, want map[string]string) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if len(rk.AgentParams) != len(want) {
			t.Errorf("%s: agent_params %v, want %v", what, rk.AgentParams, want)
		}
		for k, v := range want {
			if rk.AgentParams[k] != v {
				t.Errorf("%s: agent_params %v, want %v", what, rk.AgentParams, want)
			}
		}
	}
	threads := map[string]string{plugin.ThreadsParam: defaultThreads}
	noPrefault := map[string]string{plugin.PrefaultParam: "false"}
	rk, err := openSGL(t, srv, "prefill", boot, nil)
	check("sglang prefill", rk, err, threads)
	rk, err = openSGL(t, srv, "decode", "", nil)
	check("sglang decode", rk, err, noPrefault)
	rk, err = openSGL(t, srv, "decode", "", map[string]string{plugin.ThreadsParam: "2"})
	check("sglang decode with agent_params", rk, err, map[string]string{plugin.ThreadsParam: "2", plugin.PrefaultParam: "false"})
	rk, err = openSGL(t, srv, "decode", "", map[string]string{plugin.PrefaultParam: "true"})
	check("sglang decode keeping prefault", rk, err, map[string]string{plugin.PrefaultParam: "true"})

	w, err := vsOpen(t, srv, "decode", "D", 1, 0, 8, 4, nil)
	check("vllm decode", w.rank, err, threads)
	w, err = vsOpen(t, srv, "prefill", "P", 1, 0, 8, 4, nil)
	check("vllm prefill", w.rank, err, noPrefault)
	w, err = vsOpen(t, srv, "decode", "D2", 1, 0, 8, 4, func(r *client.VLLMRank) { r.AgentParams = map[string]string{plugin.ThreadsParam: "0"} })
	check("vllm decode with agent_params", w.rank, err, map[string]string{plugin.ThreadsParam: "0"})

	// The sidecar's parameters: the rank's own override them key by key.
	side := newTestServer(t, func(c *Config) {
		c.AgentParams = []plugin.Param{{Key: "workers", Value: "2"}, {Key: plugin.ThreadsParam, Value: "65"}}
	})
	if _, err := openSGL(t, side, "decode", "", nil); !client.IsCode(err, CodeBackend) || !strings.Contains(err.Error(), "num_threads") {
		t.Fatalf("num_threads=65 (the fake's range is 0..64) from --agent-param: %v", err)
	}
	rk, err = openSGL(t, side, "decode", "", map[string]string{plugin.ThreadsParam: "3"})
	check("sidecar params overridden", rk, err, map[string]string{"workers": "2", plugin.ThreadsParam: "3", plugin.PrefaultParam: "false"})
}

// agent_params is bounded and typed; a refused one opens nothing.
func TestOpenRankAgentParamsRefused(t *testing.T) {
	srv := newTestServer(t)
	many := map[string]any{}
	for i := range maxRankAgentParams + 1 {
		many["k"+strconv.Itoa(i)] = "1"
	}
	for _, c := range []struct {
		name string
		v    any
		code string
		want string
	}{
		{"not a map", "num_threads=4", CodeBadRequest, "want map"},
		{"too many", many, CodeBadRequest, "at most 16"},
		{"long key", map[string]any{strings.Repeat("k", maxAgentParamKey+1): "1"}, CodeBadRequest, "a key of 65 bytes"},
		{"long value", map[string]any{"k": strings.Repeat("v", maxAgentParamValue+1)}, CodeBadRequest, "at most 1024"},
		{"bool value", map[string]any{"k": true}, CodeBadRequest, "want str or int"},
		{"unknown to the plugin", map[string]any{"no_such_param": "1"}, CodeBackend, "no_such_param"},
		{"out of the plugin's range", map[string]any{plugin.ThreadsParam: 65}, CodeBackend, "num_threads"},
	} {
		err := rawVLLMDecode(t, srv, c.v)
		if !client.IsCode(err, c.code) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %s with %q", c.name, err, c.code, c.want)
		}
	}
	// An int value is written in decimal, and then the same memory opens.
	if err := rawVLLMDecode(t, srv, map[string]any{plugin.ThreadsParam: 2}); err != nil {
		t.Fatalf("an int value: %v", err)
	}
}

// rawVLLMDecode opens a vLLM decode rank of a fresh engine with
// agent_params v as given.
func rawVLLMDecode(t *testing.T, srv *Server, v any) error {
	t.Helper()
	ctx := testCtx(t)
	c := dial(t, srv)
	pool, shm := vsShmPool(t, vsGeom(1, 0, 8, 4))
	regs := pool.Regions()
	if _, err := c.RegisterMemory(ctx, []client.Region{{Kind: "dram", Addr: regs[0].Addr, Length: pool.Geometry().Size(), SHM: shm}}); err != nil {
		t.Fatal(err)
	}
	var addrs []uint64
	for _, x := range regs {
		addrs = append(addrs, x.Addr)
	}
	m := vsModel
	_, err := c.OpenRank(ctx, map[string]any{"style": "vllm", "role": "decode", "engine_id": "raw", "tp_size": 1, "tp_rank": 0,
		"kv_caches_base_addr": addrs, "region_len": regs[0].Len, "num_blocks": 8, "block_size": 4, "kv_cache_layout": "HND",
		"total_kv_heads": 4, "agent_params": v,
		"compat": map[string]any{"vllm_version": m.VLLMVersion, "nixl_connector_version": m.NixlConnectorVersion, "model": m.Model,
			"dtype": m.DType, "num_kv_heads": m.NumKVHeads, "head_size": m.HeadSize, "num_hidden_layers": m.NumHiddenLayers,
			"attn_backend_name": m.AttnBackendName, "cache_dtype": m.CacheDType}})
	return err
}
