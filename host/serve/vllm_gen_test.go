package serve

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/serve/client"
)

// vsModel6 is vsModel in version 6: its version and extra factors by
// vLLM's names.
func vsModel6() client.VLLMCompat {
	c := vsModel
	c.NixlConnectorVersion = 6
	c.Extra = client.Fields{{K: "cross_layers_blocks", V: false}, {K: "is_hma_enabled", V: true}, {K: "speculative_config", V: nil}}
	return c
}

func vsGen6(r *client.VLLMRank) { r.Compat = vsModel6() }

// vsModel10 is vsModel in version 10 (nixl/metadata.py @ 0316d25):
// transfer_mode instead of cross_layers_blocks.
func vsModel10() client.VLLMCompat {
	c := vsModel
	c.NixlConnectorVersion = 10
	c.Extra = client.Fields{{K: "is_hma_enabled", V: true}, {K: "speculative_config", V: nil}, {K: "transfer_mode", V: "pull"}}
	return c
}

func vsGen10(r *client.VLLMRank) { r.Compat = vsModel10() }

// vsModelAt is vsModel10 at version v (11 and 12 hash 10's factors:
// nixl/metadata.py @ 02cfb534).
func vsModelAt(v int) client.VLLMCompat {
	c := vsModel10()
	c.NixlConnectorVersion = v
	return c
}

func vsGenAt(v int) func(*client.VLLMRank) {
	return func(r *client.VLLMRank) { r.Compat = vsModelAt(v) }
}

// TestServeVLLMGeneration6: engines whose compat says
// nixl_connector_version 6 speak version 6 through the sidecars: hold
// returns version 6's kv_transfer_params (remote_block_ids one list per
// KV cache group, remote_num_tokens, remote_blocks_expiry_time), the
// decode reads them back, every byte arrives (TP 1 → 2, a partial prefix
// hit on one rank and a full one on the other) and the prefill releases
// the request once both decode ranks notified "{id}:2".
func TestServeVLLMGeneration6(t *testing.T) {
	vsGenerationRoundTrip(t, vsGen6, []string{"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
		"remote_request_id", "remote_host", "remote_port", "tp_size", "remote_num_tokens", "remote_blocks_expiry_time"})
}

// TestServeVLLMGeneration10: the same in version 10, whose
// kv_transfer_params add dcp_size and pp_size (1) and transfer_mode
// ("pull") (pull_scheduler.py's request_finished), and whose decode ranks
// notify "{id}:2" as the count of readers of the prefill rank.
func TestServeVLLMGeneration10(t *testing.T) {
	params := vsGenerationRoundTrip(t, vsGen10, []string{"do_remote_prefill", "do_remote_decode", "remote_block_ids",
		"remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
		"remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode"})
	for _, k := range []string{"dcp_size", "pp_size"} {
		if v, _ := params.Get(k); func() bool { n, ok := v.Int(); return !ok || n != 1 }() {
			t.Fatalf("%s is a %s, want 1", k, v.Kind)
		}
	}
	if v, _ := params.Get("transfer_mode"); func() bool { m, ok := v.Str(); return !ok || m != "pull" }() {
		t.Fatalf("transfer_mode is a %s, want \"pull\"", v.Kind)
	}
}

// TestServeVLLMGeneration11And12: versions 11 and 12 through the sidecars
// as version 10 (the same kv_transfer_params, handshake and
// notification; their metadata adds the region fields), every byte
// arriving; a version-12 decode refuses a version-10 or -11 prefill by its
// compatibility hash (nixl_connector_version is a factor).
func TestServeVLLMGeneration11And12(t *testing.T) {
	for _, v := range []int{11, 12} {
		params := vsGenerationRoundTrip(t, vsGenAt(v), []string{"do_remote_prefill", "do_remote_decode", "remote_block_ids",
			"remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
			"remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode"})
		if m, _ := params.Get("transfer_mode"); func() bool { s, ok := m.Str(); return !ok || s != "pull" }() {
			t.Fatalf("version %d: transfer_mode is a %s", v, m.Kind)
		}
	}
	ctx := testCtx(t)
	srv := newTestServer(t)
	d := vsMust(vsOpenT(t, srv, "decode", "D12", 1, 0, 32, 4, vsGenAt(12)))
	for _, v := range []int{10, 11} {
		ps := newTestServer(t)
		w := vsMust(vsOpenT(t, ps, "prefill", "P", 1, 0, 64, 4, vsGenAt(v)))
		vsEvent(t, w.c)
		params, err := dial(t, ps).Hold(ctx, "P", "r", []int32{1, 2})
		if err != nil {
			t.Fatal(err)
		}
		if err := d.c.Read(ctx, d.rank.ID, "x", params, []int32{3, 4}); err != nil {
			t.Fatal(err)
		}
		if r, _ := vsEvent(t, d.c).AsRead(); r.OK || !strings.Contains(r.Reason, "hash") || len(r.InvalidBlocks) != 2 {
			t.Fatalf("a version-12 decode of a version-%d prefill: %+v", v, r)
		}
	}
}

// vsGenerationRoundTrip holds a request on a TP-1 prefill of the
// generation gen sets, checks its kv_transfer_params' keys, reads it on
// two decode ranks and returns the params.
func vsGenerationRoundTrip(t *testing.T, gen func(*client.VLLMRank), wantKeys []string) msgpack.Value {
	ctx := testCtx(t)
	ps, ds := newTestServer(t), newTestServer(t)
	w := vsMust(vsOpenT(t, ps, "prefill", "P6", 1, 0, 64, 4, gen))
	if id, _, ok := vsEvent(t, w.c).AsEngineReady(); !ok || id != "P6" {
		t.Fatal("no engine_ready")
	}
	sched := dial(t, ps)
	blocks := []int32{17, 3, 40, 8, 22}
	const tokens = 18
	if err := w.pool.Fill(kvpool.Tokens{Request: 11, Pages: blocks, Count: tokens}); err != nil {
		t.Fatal(err)
	}
	params, err := sched.HoldTokens(ctx, "P6", "req-6", blocks, tokens)
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, p := range params.Pairs {
		k, _ := p[0].Str()
		keys = append(keys, k)
	}
	if !slices.Equal(keys, wantKeys) {
		t.Fatalf("kv_transfer_params keys %v, want %v", keys, wantKeys)
	}
	rb, _ := params.Get("remote_block_ids")
	if g0, _ := rb.Index(0); rb.Kind != msgpack.Array || rb.Len() != 1 || g0.Kind != msgpack.Array || g0.Len() != len(blocks) {
		t.Fatalf("remote_block_ids is not [[...]] of %d: %v", len(blocks), rb.Kind)
	}
	if n, _ := params.Get("remote_num_tokens"); func() bool { x, _ := n.Int(); return x != tokens }() {
		t.Fatal("remote_num_tokens")
	}
	if e, _ := params.Get("remote_blocks_expiry_time"); e.Kind != msgpack.Nil {
		t.Fatal("a prefill's remote_blocks_expiry_time is None")
	}
	local := []int32{30, 0, 9, 14, 2}
	hits := []int{2, len(local)}
	var dec []*vsRank
	for rank := 0; rank < 2; rank++ {
		d := vsMust(vsOpenT(t, ds, "decode", "D6", 2, rank, 32, 4, gen))
		if err := d.pool.Fill(kvpool.Tokens{Request: 11, Pages: local, Count: min(hits[rank]*4, tokens)}); err != nil {
			t.Fatal(err)
		}
		if err := d.c.Read(ctx, d.rank.ID, "dreq-6", params, local[hits[rank]:]); err != nil {
			t.Fatal(err)
		}
		dec = append(dec, d)
	}
	for i, d := range dec {
		e := vsEvent(t, d.c)
		if r, ok := e.AsRead(); !ok || !r.OK || len(r.InvalidBlocks) != 0 {
			t.Fatalf("rank %d: %s %+v", i, e.Name, r)
		}
		if err := d.pool.Verify(kvpool.Tokens{Request: 11, Pages: local, Count: tokens}); err != nil {
			t.Fatalf("decode rank %d: %v", i, err)
		}
	}
	vsReleased(t, w.c, "P6", "req-6", "notified")
	vsReleased(t, sched, "P6", "req-6", "notified")
	return params
}

// TestServeVLLMGeneration10Refusals: version 10 without transfer_mode is
// bad_request; a version-10 decode fails the read of params saying a
// context parallel or a push prefill, naming the field.
func TestServeVLLMGeneration10Refusals(t *testing.T) {
	ctx := testCtx(t)
	srv := newTestServer(t)
	_, err := vsOpen(t, srv, "decode", "D", 1, 0, 32, 4, func(r *client.VLLMRank) {
		r.Compat = vsModel10()
		r.Compat.Extra = r.Compat.Extra[:2]
	})
	if !isCode(err, CodeBadRequest) || !strings.Contains(err.Error(), "transfer_mode") {
		t.Fatalf("version 10 without transfer_mode: %v", err)
	}
	ps := newTestServer(t)
	w := vsMust(vsOpenT(t, ps, "prefill", "P10", 1, 0, 64, 4, vsGen10))
	vsEvent(t, w.c)
	params, err := dial(t, ps).Hold(ctx, "P10", "r", []int32{1, 2})
	if err != nil {
		t.Fatal(err)
	}
	d := vsMust(vsOpenT(t, srv, "decode", "D10", 1, 0, 32, 4, vsGen10))
	for _, c := range []struct {
		key string
		v   any
	}{{"dcp_size", 2}, {"transfer_mode", "push"}} {
		bad := vsSetParam(params, c.key, c.v)
		if err := d.c.Read(ctx, d.rank.ID, "x-"+c.key, bad, []int32{3, 4}); err != nil {
			t.Fatal(err)
		}
		r, _ := vsEvent(t, d.c).AsRead()
		if r.OK || !strings.Contains(r.Reason, c.key) || len(r.InvalidBlocks) != 2 {
			t.Fatalf("%s %v: %+v", c.key, c.v, r)
		}
	}
	// Versions 6 and 10 share the handshake's shape: the compatibility
	// hash (nixl_connector_version is a factor) refuses the other.
	ps6 := newTestServer(t)
	w6 := vsMust(vsOpenT(t, ps6, "prefill", "P6", 1, 0, 64, 4, vsGen6))
	vsEvent(t, w6.c)
	params6, err := dial(t, ps6).Hold(ctx, "P6", "r6", []int32{1, 2})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.c.Read(ctx, d.rank.ID, "x-v6", params6, []int32{3, 4}); err != nil {
		t.Fatal(err)
	}
	if r, _ := vsEvent(t, d.c).AsRead(); r.OK || !strings.Contains(r.Reason, "hash") || len(r.InvalidBlocks) != 2 {
		t.Fatalf("a version-10 decode of a version-6 prefill: %+v", r)
	}
}

// TestServeVLLMGenerationRefusals: region_names that do not name each
// region in bounds are refused; a version kvhost does not speak is
// unsupported, naming it and the supported ones; version 6 without its
// factors, or with a factor of the wrong type, is bad_request; a version-6
// decode fails a read of version-2 params (a flat remote_block_ids) and of
// several KV cache groups; a version-2 decode of a version-6 prefill fails
// the handshake naming both versions.
func TestServeVLLMGenerationRefusals(t *testing.T) {
	ctx := testCtx(t)
	srv := newTestServer(t)
	_, err := vsOpen(t, srv, "decode", "D", 1, 0, 32, 4, func(r *client.VLLMRank) { r.Compat.NixlConnectorVersion = 5 })
	if !isCode(err, CodeUnsupported) || !strings.Contains(err.Error(), "5") || !strings.Contains(err.Error(), "2, 6, 10, 11, 12") {
		t.Fatalf("version 5: %v", err)
	}
	for name, names := range map[string]func(n int) []string{
		"one name short": func(n int) []string { return slices.Repeat([]string{"layer"}, n-1) },
		"an empty name":  func(n int) []string { return append(slices.Repeat([]string{"layer"}, n-1), "") },
		"a long name":    func(n int) []string { return slices.Repeat([]string{strings.Repeat("l", 513)}, n) },
	} {
		_, err = vsOpen(t, srv, "decode", "D", 1, 0, 32, 4, func(r *client.VLLMRank) {
			vsGenAt(12)(r)
			r.RegionNames = names(len(r.KVCachesBaseAddr))
		})
		if !isCode(err, CodeBadRequest) || !strings.Contains(err.Error(), "region_names") {
			t.Fatalf("region_names, %s: %v", name, err)
		}
	}
	_, err = vsOpen(t, srv, "decode", "D", 1, 0, 32, 4, func(r *client.VLLMRank) { r.Compat.NixlConnectorVersion = 6 })
	if !isCode(err, CodeBadRequest) || !strings.Contains(err.Error(), "cross_layers_blocks") {
		t.Fatalf("version 6 without its factors: %v", err)
	}
	_, err = vsOpen(t, srv, "decode", "D", 1, 0, 32, 4, func(r *client.VLLMRank) {
		r.Compat = vsModel6()
		r.Compat.Extra[0] = client.Field{K: "cross_layers_blocks", V: 1}
	})
	if !isCode(err, CodeBadRequest) || !strings.Contains(err.Error(), "want a bool") {
		t.Fatalf("a factor of the wrong type: %v", err)
	}

	ps := newTestServer(t)
	w := vsMust(vsOpenT(t, ps, "prefill", "P6", 1, 0, 64, 4, vsGen6))
	vsEvent(t, w.c)
	sched := dial(t, ps)
	params, err := sched.Hold(ctx, "P6", "r", []int32{1, 2})
	if err != nil {
		t.Fatal(err)
	}
	d6 := vsMust(vsOpenT(t, srv, "decode", "D6", 1, 0, 32, 4, vsGen6))
	for name, v := range map[string]any{"flat": []int{1, 2}, "two groups": [][]int{{1}, {2}}} {
		bad := vsSetParam(params, "remote_block_ids", v)
		if err := d6.c.Read(ctx, d6.rank.ID, "x-"+name, bad, []int32{3, 4}); err != nil {
			t.Fatal(err)
		}
		r, _ := vsEvent(t, d6.c).AsRead()
		if r.OK || !strings.Contains(r.Reason, "remote_block_ids") || len(r.InvalidBlocks) != 2 {
			t.Fatalf("%s: %+v", name, r)
		}
	}
	d2 := vsMust(vsOpenT(t, srv, "decode", "D2", 1, 0, 32, 4, nil))
	v2params := vsSetParam(params, "remote_block_ids", []int{1, 2})
	if err := d2.c.Read(ctx, d2.rank.ID, "x", v2params, []int32{3, 4}); err != nil {
		t.Fatal(err)
	}
	r, _ := vsEvent(t, d2.c).AsRead()
	if r.OK || !strings.Contains(r.Reason, "refused") || !strings.Contains(r.Reason, "version 2") {
		t.Fatalf("version-2 decode of a version-6 prefill: %+v", r)
	}
}

// isCode reports whether err is the sidecar's refusal with code.
func isCode(err error, code string) bool {
	var e *client.Error
	return errors.As(err, &e) && e.Code == code
}

// TestServeVLLMLeaseLapses: a version-6 hold nobody reads is released
// "timeout" once its kv_lease_duration passes (vLLM's lease, not the
// abort timeout); until then it is held.
func TestServeVLLMLeaseLapses(t *testing.T) {
	ctx := testCtx(t)
	ps := newTestServer(t)
	w := vsMust(vsOpenT(t, ps, "prefill", "PL", 1, 0, 64, 4, func(r *client.VLLMRank) {
		vsGen6(r)
		r.KVLeaseDuration = 300 * time.Millisecond
	}))
	vsEvent(t, w.c)
	sched := dial(t, ps)
	start := time.Now()
	if _, err := sched.Hold(ctx, "PL", "unread", []int32{1, 2}); err != nil {
		t.Fatal(err)
	}
	vsReleased(t, sched, "PL", "unread", "timeout")
	if el := time.Since(start); el < 300*time.Millisecond {
		t.Fatalf("released after %v, before its lease", el)
	}
}

// TestServeVLLMGeneration6PythonPeer: a vLLM version-6 decode rank
// (host/pull's Python peer) fetches a version-6 sidecar prefill's
// handshake: the bytes are msgspec's, and the compatibility hash the
// sidecar computed from the engine's compat map is the one vLLM's
// hash_factors computes from the same factors (json.dumps, sorted keys,
// True/False/None, a nested speculative_config).
func TestServeVLLMGeneration6PythonPeer(t *testing.T) {
	const python = "/usr/bin/python3"
	if out, err := exec.Command(python, "-c", "import zmq, msgpack").CombinedOutput(); err != nil {
		t.Fatalf("%s with python3-zmq and python3-msgpack is needed: %v\n%s", python, err, out)
	}
	compat := vsModel6()
	compat.Extra = client.Fields{{K: "cross_layers_blocks", V: true}, {K: "is_hma_enabled", V: false},
		{K: "speculative_config", V: client.Fields{{K: "method", V: "eagle3"}, {K: "model", V: "draft"}, {K: "revision", V: nil},
			{K: "parallel_drafting", V: false}, {K: "auxiliary_layer_ids", V: []int{2, 16}}}}}
	ps := newTestServer(t)
	w := vsMust(vsOpenT(t, ps, "prefill", "PY6", 1, 0, 16, 4, func(r *client.VLLMRank) { r.Compat = compat }))
	_, ep, _ := vsEvent(t, w.c).AsEngineReady()
	factors := map[string]any{"vllm_version": compat.VLLMVersion, "nixl_connector_version": 6, "model": compat.Model,
		"dtype": compat.DType, "num_kv_heads": compat.NumKVHeads, "head_size": compat.HeadSize,
		"num_hidden_layers": compat.NumHiddenLayers, "attn_backend_name": compat.AttnBackendName, "cache_dtype": compat.CacheDType,
		"cross_layers_blocks": true, "is_hma_enabled": false, "speculative_config": map[string]any{"method": "eagle3", "model": "draft",
			"revision": nil, "parallel_drafting": false, "auxiliary_layer_ids": []int{2, 16}}}
	path := filepath.Join(t.TempDir(), "factors.json")
	b, _ := json.Marshal(factors)
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	want, err := exec.Command(python, "-c", `import hashlib, json, sys
print(hashlib.sha256(json.dumps(json.load(open(sys.argv[1])), sort_keys=True).encode()).hexdigest())`, path).Output()
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(python, "../pull/testdata/vllm_nixl_peer.py", "req", ep, "0", "6").Output()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	var got struct {
		Hash      string `json:"compatibility_hash"`
		ByteExact bool   `json:"byte_exact"`
		Metadata  struct {
			Backend string `json:"attn_backend_name"`
			Engine  string `json:"engine_id"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if got.Hash != strings.TrimSpace(string(want)) || !got.ByteExact || got.Metadata.Backend != compat.AttnBackendName || got.Metadata.Engine != "PY6" {
		t.Fatalf("python peer: %+v, want hash %s", got, want)
	}
}

// TestServeVLLMWatch: watch and unwatch on a version-6 decode rank are
// accepted (the lease renewal itself is host/pull's
// TestLeaseWatchedBeforeLoad); on a version-2 rank watch is unsupported,
// params without the remote ids are bad_request.
func TestServeVLLMWatch(t *testing.T) {
	ctx := testCtx(t)
	ps, ds := newTestServer(t), newTestServer(t)
	w := vsMust(vsOpenT(t, ps, "prefill", "PW", 1, 0, 16, 4, vsGen6))
	vsEvent(t, w.c)
	params, err := dial(t, ps).Hold(ctx, "PW", "q", []int32{1})
	if err != nil {
		t.Fatal(err)
	}
	d6 := vsMust(vsOpenT(t, ds, "decode", "DW6", 1, 0, 16, 4, vsGen6))
	if err := d6.c.Watch(ctx, d6.rank.ID, "dq", params); err != nil {
		t.Fatal(err)
	}
	if err := d6.c.Unwatch(ctx, d6.rank.ID, "dq"); err != nil {
		t.Fatal(err)
	}
	if err := d6.c.Watch(ctx, d6.rank.ID, "dq", vsSetParam(params, "remote_request_id", nil)); !isCode(err, CodeBadRequest) {
		t.Fatalf("no remote_request_id: %v", err)
	}
	d2 := vsMust(vsOpenT(t, ds, "decode", "DW2", 1, 0, 16, 4, nil))
	if err := d2.c.Watch(ctx, d2.rank.ID, "dq", vsSetParam(params, "remote_block_ids", []int{1})); !isCode(err, CodeUnsupported) {
		t.Fatalf("version 2: %v", err)
	}
}

// TestServeVLLMGeneration12PythonPeer: a vLLM version-12 decode rank
// (host/pull's Python peer, metadata.py @ 02cfb534) fetches a version-12
// sidecar prefill's handshake: msgspec's bytes, the region fields a
// one-group worker fills (num_blocks, group 0, the engine's layer name and
// the memory type per region, no members), the hash of version 10's
// factors at 12.
func TestServeVLLMGeneration12PythonPeer(t *testing.T) {
	const python = "/usr/bin/python3"
	if out, err := exec.Command(python, "-c", "import zmq, msgpack").CombinedOutput(); err != nil {
		t.Fatalf("%s with python3-zmq and python3-msgpack is needed: %v\n%s", python, err, out)
	}
	ps := newTestServer(t)
	// The engine names its regions' layers (K and V of a layer share one).
	var names []string
	w := vsMust(vsOpenT(t, ps, "prefill", "PY12", 1, 0, 16, 4, func(r *client.VLLMRank) {
		vsGenAt(12)(r)
		for i := range r.KVCachesBaseAddr {
			names = append(names, fmt.Sprintf("model.layers.%d.self_attn.attn", i/2))
		}
		r.RegionNames = names
	}))
	_, ep, _ := vsEvent(t, w.c).AsEngineReady()
	out, err := exec.Command(python, "../pull/testdata/vllm_nixl_peer.py", "req", ep, "0", "12").Output()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	var got struct {
		ByteExact bool `json:"byte_exact"`
		Metadata  struct {
			Addrs     []uint64   `json:"kv_caches_base_addr"`
			NumBlocks int        `json:"num_blocks"`
			Blocks    []int      `json:"region_num_blocks"`
			Groups    []int      `json:"region_group_ids"`
			Names     []string   `json:"region_names"`
			MemTypes  []string   `json:"region_mem_types"`
			Members   [][]string `json:"region_members"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	m := got.Metadata
	n := len(m.Addrs)
	if !got.ByteExact || n == 0 || m.NumBlocks != 16 || len(m.Blocks) != n || len(m.Groups) != n || len(m.Names) != n ||
		len(m.MemTypes) != n || m.Members == nil || len(m.Members) != 0 {
		t.Fatalf("python peer: %s", out)
	}
	for i := range n {
		if m.Blocks[i] != 16 || m.Groups[i] != 0 || m.Names[i] != names[i] || m.MemTypes[i] != "DRAM" {
			t.Fatalf("region %d: %s", i, out)
		}
	}
}
