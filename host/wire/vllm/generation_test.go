package vllm

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
)

var g6 = generations[6]

func sampleMetadata6() *AgentMetadata {
	md := sampleMetadata()
	md.SSMSizes = [2]int{0, 0}
	md.AttnBackendName = "FLASH_ATTN"
	md.PhysicalBlocksPerLogical = 1
	return md
}

var g10 = generations[10]

func sampleMetadata10() *AgentMetadata {
	md := sampleMetadata6()
	md.BlockStrides = []int{8192, 4096, 2048}
	md.DCPSize, md.PCPSize = 1, 1
	return md
}

func TestLookup(t *testing.T) {
	for _, v := range []int{2, 6, 10, 11, 12} {
		g, err := Lookup(v)
		if err != nil || g.Version != v {
			t.Fatalf("version %d: %v %v", v, g, err)
		}
	}
	_, err := Lookup(5)
	if !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "version 5") || !strings.Contains(err.Error(), "2, 6, 10, 11, 12") {
		t.Fatalf("version 5: %v", err)
	}
	if Or(nil).Version != DefaultVersion || Or(g6) != g6 {
		t.Fatal("Or")
	}
	// Every table entry has code behind each of its fields: encoding and
	// decoding a metadata of every generation round-trips.
	for _, v := range Versions() {
		g := generations[v]
		md := sampleMetadata10()
		got, err := g.DecodeAgentMetadata(md.EncodeFor(g))
		if err != nil {
			t.Fatalf("version %d: %v", v, err)
		}
		if v < 10 {
			md.BlockStrides, md.DCPSize, md.PCPSize = nil, 0, 0
		}
		if v == 2 {
			md.SSMSizes, md.AttnBackendName, md.PhysicalBlocksPerLogical = [2]int{}, "", 0
		}
		if !reflect.DeepEqual(got, md) {
			t.Fatalf("version %d: got %+v", v, got)
		}
	}
}

// The version-6 encodings are byte for byte Python's msgpack.packb of the
// same values (what msgspec produces for the tuple, the dataclass and the
// float), and each decodes back.
func TestGeneration6MatchesPython(t *testing.T) {
	zmqtest.RequirePython(t, "zmq", "msgpack")
	md := sampleMetadata6()
	md.SSMSizes = [2]int{3, 70000}
	spec := map[string]any{"pp_rank": 1, "tp_rank": 3, "clock": 12345.678, "metadata": map[string]any{
		"engine_id": md.EngineID, "agent_metadata": hex.EncodeToString(md.AgentMetadata), "kv_caches_base_addr": md.KVCachesBaseAddr,
		"device_id": md.DeviceID, "num_blocks": md.NumBlocks, "block_lens": md.BlockLens, "kv_cache_layout": md.KVCacheLayout,
		"block_size": md.BlockSize, "ssm_sizes": md.SSMSizes[:], "attn_backend_name": md.AttnBackendName,
		"physical_blocks_per_logical_kv_block": md.PhysicalBlocksPerLogical}}
	path := filepath.Join(t.TempDir(), "spec.json")
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	peer := zmqtest.Start(t, peerScript, "encode6", path)
	var py map[string]string
	if err := json.Unmarshal([]byte(peer.Line(30*time.Second)), &py); err != nil {
		t.Fatal(err)
	}
	peer.Wait(10 * time.Second)
	if got := hex.EncodeToString(g6.EncodeMetaRequest(1, 3)); got != py["request"] {
		t.Errorf("request: go %s, python %s", got, py["request"])
	}
	if got := hex.EncodeToString(md.EncodeFor(g6)); got != py["metadata"] {
		t.Errorf("metadata:\n go     %s\n python %s", got, py["metadata"])
	}
	frames := g6.ReplyFrames([]byte("payload"), 12345.678)
	if got := hex.EncodeToString(frames[1]); got != py["clock"] {
		t.Errorf("clock: go %s, python %s", got, py["clock"])
	}
	payload, clock, err := g6.SplitReply(frames)
	if err != nil || string(payload) != "payload" || clock != 12345.678 {
		t.Fatalf("split: %q %v %v", payload, clock, err)
	}
	pp, tp, err := g6.DecodeMetaRequest(g6.EncodeMetaRequest(1, 3))
	if err != nil || pp != 1 || tp != 3 {
		t.Fatalf("request: %d %d %v", pp, tp, err)
	}
}

// A peer of the other generation is refused with both versions named,
// never misread: the request's arity and the reply's frame count differ.
func TestCrossGenerationRefused(t *testing.T) {
	_, _, err := G2.DecodeMetaRequest(g6.EncodeMetaRequest(0, 1))
	if !errors.Is(err, ErrGeneration) || !strings.Contains(err.Error(), "as versions 6, 10, 11, 12 send") || !strings.Contains(err.Error(), "speaks NIXL connector version 2") {
		t.Fatalf("v6 request to v2: %v", err)
	}
	_, _, err = g6.DecodeMetaRequest(G2.EncodeMetaRequest(0, 1))
	if !errors.Is(err, ErrGeneration) || !strings.Contains(err.Error(), "as version 2 sends") || !strings.Contains(err.Error(), "version 6") {
		t.Fatalf("v2 request to v6: %v", err)
	}
	_, _, err = g6.SplitReply(G2.ReplyFrames([]byte("p"), 1))
	if !errors.Is(err, ErrGeneration) || !strings.Contains(err.Error(), "1 frames, as version 2") {
		t.Fatalf("v2 reply to v6: %v", err)
	}
	_, _, err = G2.SplitReply(g6.ReplyFrames([]byte("p"), 1))
	if !errors.Is(err, ErrGeneration) || !strings.Contains(err.Error(), "2 frames, as versions 6, 10, 11, 12 send") {
		t.Fatalf("v6 reply to v2: %v", err)
	}
	// A version-2 decoder skips the version-6 fields (msgspec ignores
	// unknown ones); a version-6 decoder requires them.
	if _, err := G2.DecodeAgentMetadata(sampleMetadata6().EncodeFor(g6)); err != nil {
		t.Fatal(err)
	}
	if _, err := g6.DecodeAgentMetadata(sampleMetadata6().EncodeFor(G2)); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "ssm_sizes") {
		t.Fatalf("v2 metadata to v6: %v", err)
	}
	for _, bad := range [][]byte{{0x92, 1, 2}, {0xcb}, []byte("\xa1x"), {0xcb, 0x7f, 0xf8, 0, 0, 0, 0, 0, 1}} {
		if _, _, err := g6.SplitReply([][]byte{[]byte("p"), bad}); !errors.Is(err, ErrMalformed) {
			t.Errorf("clock %x: %v", bad, err)
		}
	}
}

func TestConsumers(t *testing.T) {
	for _, c := range []struct {
		g              *Generation
		n, prefill, wt int
	}{
		{G2, 2, 2, 2}, {G2, 1, 4, 1}, {G2, 0, 1, 0},
		{g6, 4, 2, 2}, {g6, 2, 2, 1}, {g6, 1, 4, 1}, {g6, 8, 1, 8}, {g6, 0, 1, 0},
		// Version 10 counts readers again (pull_worker.py's expected_consumers).
		{g10, 4, 2, 4}, {g10, 2, 2, 2}, {g10, 1, 4, 1}, {g10, 0, 1, 0},
	} {
		if got := c.g.Consumers(c.n, c.prefill); got != c.wt {
			t.Errorf("%s: %d notified by decode, prefill TP %d: %d, want %d", c.g, c.n, c.prefill, got, c.wt)
		}
	}
	if G2.NotifNumber(2, 4) != 2 || g6.NotifNumber(2, 4) != 4 || g10.NotifNumber(2, 4) != 2 {
		t.Fatal("NotifNumber")
	}
	iv, ext := LeaseTimes(30 * time.Second)
	if iv != 5*time.Second || ext != 20*time.Second {
		t.Fatalf("lease 30 s: %v %v", iv, ext)
	}
	iv, ext = LeaseTimes(31 * time.Second)
	if iv != 5*time.Second || ext != 20*time.Second { // 31 // 6, 62 // 3
		t.Fatalf("lease 31 s: %v %v", iv, ext)
	}
}

func TestHeartbeats(t *testing.T) {
	msgs := EncodeHeartbeats([]string{"a", "bb", "ccc"}, 100)
	if len(msgs) != 1 || string(msgs[0]) != "HB:a,bb,ccc" {
		t.Fatalf("%q", msgs)
	}
	msgs = EncodeHeartbeats([]string{"a", "bb", "ccc"}, 6)
	if len(msgs) != 3 || string(msgs[0]) != "HB:a" || string(msgs[1]) != "HB:bb" || string(msgs[2]) != "HB:ccc" {
		t.Fatalf("%q", msgs)
	}
	if EncodeHeartbeats(nil, 10) != nil {
		t.Fatal("no ids, no heartbeat")
	}
	ids, hb, err := ParseHeartbeat([]byte("HB:x,y:1,"))
	if !hb || err != nil || !reflect.DeepEqual(ids, []string{"x", "y:1", ""}) {
		t.Fatalf("%q %v %v", ids, hb, err)
	}
	if _, hb, _ := ParseHeartbeat([]byte("req:2")); hb {
		t.Fatal("a READ notification is no heartbeat")
	}
	if _, hb, err := ParseHeartbeat([]byte("HB:\xff")); !hb || !errors.Is(err, ErrMalformed) {
		t.Fatal(err)
	}
	if _, _, err := ParseHeartbeat([]byte("HB:" + strings.Repeat(",", MaxHeartbeatIDs))); !errors.Is(err, ErrMalformed) {
		t.Fatal(err)
	}
	// Chunks stay under MaxHeartbeatIDs ids each.
	many := make([]string, MaxHeartbeatIDs+3)
	for i := range many {
		many[i] = "i"
	}
	for _, m := range EncodeHeartbeats(many, 1<<30) {
		if ids, _, err := ParseHeartbeat(m); err != nil || len(ids) > MaxHeartbeatIDs {
			t.Fatalf("%d ids, %v", len(ids), err)
		}
	}
}

// factorsOf turns a JSON object into msgpack factors, as an engine sends
// them.
func factorsOf(t *testing.T, js string) map[string]msgpack.Value {
	var m map[string]any
	if err := json.Unmarshal([]byte(js), &m); err != nil {
		t.Fatal(err)
	}
	var e *msgpack.Encoder // one per value: decoded values point into its bytes
	var enc func(v any)
	enc = func(v any) {
		switch x := v.(type) {
		case nil:
			e.Nil()
		case bool:
			e.Bool(x)
		case float64:
			e.Int(int64(x))
		case string:
			e.Str(x)
		case []any:
			e.ArrayHeader(len(x))
			for _, it := range x {
				enc(it)
			}
		case map[string]any:
			e.MapHeader(len(x))
			for k, it := range x {
				e.Str(k)
				enc(it)
			}
		}
	}
	out := map[string]msgpack.Value{}
	for k, v := range m {
		e = &msgpack.Encoder{}
		enc(v)
		mv, err := msgpack.Decode(e.Bytes())
		if err != nil {
			t.Fatal(err)
		}
		out[k] = mv
	}
	return out
}

const factors6 = `{"vllm_version": "0.16.0", "nixl_connector_version": 6, "model": "meta-llama/Llama-3.1-8B", "dtype": "torch.bfloat16",
 "num_kv_heads": 8, "head_size": 128, "num_hidden_layers": 32, "attn_backend_name": "FLASH_ATTN", "cache_dtype": "auto",
 "cross_layers_blocks": false, "is_hma_enabled": true, "speculative_config": null}`

const factors6Spec = `{"vllm_version": "0.16.0", "nixl_connector_version": 6, "model": "m\u00fc", "dtype": "torch.float16",
 "num_kv_heads": 8, "head_size": 128, "num_hidden_layers": 32, "attn_backend_name": "FLASHINFER", "cache_dtype": "fp8",
 "cross_layers_blocks": true, "is_hma_enabled": false, "transfer_mode": "pull",
 "speculative_config": {"method": "eagle3", "model": "d", "revision": null, "code_revision": null,
   "parallel_drafting": false, "kv_cache_dtype": "auto", "auxiliary_layer_ids": [2, 16, 29]}}`

// CompatHash agrees with Python's hash_factors (json.dumps with sorted
// keys, True/False/None, nested dicts and tuples) on version-6 factor sets.
func TestCompatHash6MatchesPython(t *testing.T) {
	zmqtest.RequirePython(t, "zmq", "msgpack")
	sets := []string{factors6, factors6Spec}
	var spec []json.RawMessage
	for _, s := range sets {
		spec = append(spec, json.RawMessage(s))
	}
	path := filepath.Join(t.TempDir(), "factors.json")
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	peer := zmqtest.Start(t, peerScript, "hash", path)
	var py []string
	if err := json.Unmarshal([]byte(peer.Line(30*time.Second)), &py); err != nil {
		t.Fatal(err)
	}
	peer.Wait(10 * time.Second)
	for i, s := range sets {
		got, err := g6.CompatHash(factorsOf(t, s))
		if err != nil || got != py[i] {
			t.Errorf("set %d: go %s %v, python %s", i, got, err, py[i])
		}
	}
}

func TestCompatHashRefusals(t *testing.T) {
	base := factorsOf(t, factors6)
	h, err := g6.CompatHash(base)
	if err != nil {
		t.Fatal(err)
	}
	with := func(name, js string) map[string]msgpack.Value {
		f := factorsOf(t, factors6)
		if js == "" {
			delete(f, name)
		} else {
			f[name] = factorsOf(t, `{"x": `+js+`}`)["x"]
		}
		return f
	}
	for _, c := range []struct {
		name, js, want string
	}{
		{"speculative_config", "", "missing"},
		{"is_hma_enabled", `1`, "want a bool"},
		{"num_kv_heads", `"8"`, "want an int"},
		{"speculative_config", `[1]`, "want a map or nil"},
		{"nixl_connector_version", `2`, "but the codec is NIXL connector version 6"},
		{"bogus_factor", `1`, "not a compatibility hash factor"},
		{"speculative_config", `{"a": {"b": {"c": {"d": {"e": [1]}}}}}`, "nested deeper"},
	} {
		_, err := g6.CompatHash(with(c.name, c.js))
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), c.name) {
			t.Errorf("%s = %s: %v", c.name, c.js, err)
		}
	}
	// Each factor changes the hash.
	for name, js := range map[string]string{"cross_layers_blocks": "true", "is_hma_enabled": "false",
		"speculative_config": `{"method": "mtp"}`, "model": `"other"`} {
		if h2, err := g6.CompatHash(with(name, js)); err != nil || h2 == h {
			t.Errorf("%s: %v, hash unchanged: %v", name, err, h2 == h)
		}
	}
	// Version 2 hashes exactly what CompatibilityHash does.
	f2 := factorsOf(t, `{"vllm_version": "0.13.0", "nixl_connector_version": 2, "model": "m", "dtype": "torch.bfloat16",
		"num_kv_heads": 8, "head_size": 128, "num_hidden_layers": 2, "attn_backend_name": "FLASH_ATTN", "cache_dtype": "auto"}`)
	got, err := G2.CompatHash(f2)
	want := CompatibilityHash(CompatFactors{VLLMVersion: "0.13.0", ConnectorVersion: 2, Model: "m", DType: "torch.bfloat16",
		NumKVHeads: 8, HeadSize: 128, NumHiddenLayers: 2, AttnBackendName: "FLASH_ATTN", CacheDType: "auto"})
	if err != nil || got != want {
		t.Fatalf("version 2: %s %v, want %s", got, err, want)
	}
}

func FuzzDecodeMetaRequestGenerations(f *testing.F) {
	f.Add(G2.EncodeMetaRequest(0, 3))
	f.Add(g6.EncodeMetaRequest(1, 2))
	f.Add(g10.EncodeMetaRequest(0, 7))
	f.Add([]byte{0x93, 0xa0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, g := range []*Generation{G2, g6, g10} {
			pp, tp, err := g.DecodeMetaRequest(b)
			if err != nil {
				continue
			}
			if pp < 0 || tp < 0 || (!g.RequestPPRank && pp != 0) {
				t.Fatalf("%s: %d %d", g, pp, tp)
			}
			if _, tp2, err := g.DecodeMetaRequest(g.EncodeMetaRequest(pp, tp)); err != nil || tp2 != tp {
				t.Fatalf("%s: re-encoded %d: %v", g, tp, err)
			}
		}
	})
}

func FuzzSplitReply(f *testing.F) {
	f.Add([]byte("payload"), g6.ReplyFrames(nil, 3.5)[1], true)
	f.Add([]byte("p"), []byte{}, false)
	f.Fuzz(func(t *testing.T, payload, clock []byte, two bool) {
		frames := [][]byte{payload}
		if two {
			frames = append(frames, clock)
		}
		for _, g := range []*Generation{G2, g6, g10} {
			p, c, err := g.SplitReply(frames)
			if err == nil && (string(p) != string(payload) || c != c) {
				t.Fatalf("%s: %q %v", g, p, c)
			}
		}
	})
}

func FuzzDecodeAgentMetadata6(f *testing.F) {
	f.Add(sampleMetadata6().EncodeFor(g6))
	f.Add(sampleMetadata6().EncodeFor(G2))
	f.Fuzz(func(t *testing.T, b []byte) {
		md, err := g6.DecodeAgentMetadata(b)
		if err != nil {
			return
		}
		again, err := g6.DecodeAgentMetadata(md.EncodeFor(g6))
		if err != nil || !reflect.DeepEqual(again, md) {
			t.Fatalf("re-encoded: %+v %v", again, err)
		}
	})
}

func FuzzParseHeartbeat(f *testing.F) {
	f.Add([]byte("HB:a,b"))
	f.Add([]byte("HB:"))
	f.Add([]byte("req:1"))
	f.Fuzz(func(t *testing.T, b []byte) {
		ids, hb, err := ParseHeartbeat(b)
		if !hb || err != nil {
			return
		}
		if len(ids) > MaxHeartbeatIDs {
			t.Fatalf("%d ids", len(ids))
		}
		msgs := EncodeHeartbeats(ids, len(b)+1)
		if len(msgs) != 1 || string(msgs[0]) != string(b) {
			t.Fatalf("%q re-encoded as %q", b, msgs)
		}
	})
}

func FuzzCompatHash(f *testing.F) {
	var e msgpack.Encoder
	e.MapHeader(1)
	e.Str("method")
	e.Str("eagle")
	f.Add(e.Bytes())
	f.Add([]byte{0xc0})
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := msgpack.Decode(b)
		if err != nil {
			return
		}
		fs := factorsOf(t, factors6)
		fs["speculative_config"] = v
		g6.CompatHash(fs) // must not panic; refusals are errors
	})
}

// Version 10's metadata is byte for byte Python's msgpack.packb of the
// dataclass's fields in declaration order (block_strides after block_lens,
// dcp_size and pcp_size, which have defaults, last: msgspec encodes them).
func TestGeneration10MatchesPython(t *testing.T) {
	zmqtest.RequirePython(t, "zmq", "msgpack")
	md := sampleMetadata10()
	md.DCPSize, md.PCPSize = 2, 3 // distinct, to catch a swap
	spec := map[string]any{"pp_rank": 0, "tp_rank": 5, "metadata": map[string]any{
		"engine_id": md.EngineID, "agent_metadata": hex.EncodeToString(md.AgentMetadata), "kv_caches_base_addr": md.KVCachesBaseAddr,
		"device_id": md.DeviceID, "num_blocks": md.NumBlocks, "block_lens": md.BlockLens, "block_strides": md.BlockStrides,
		"kv_cache_layout": md.KVCacheLayout, "block_size": md.BlockSize, "ssm_sizes": md.SSMSizes[:],
		"attn_backend_name": md.AttnBackendName, "physical_blocks_per_logical_kv_block": md.PhysicalBlocksPerLogical,
		"dcp_size": md.DCPSize, "pcp_size": md.PCPSize}}
	path := filepath.Join(t.TempDir(), "spec.json")
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	peer := zmqtest.Start(t, peerScript, "encode10", path)
	var py map[string]string
	if err := json.Unmarshal([]byte(peer.Line(30*time.Second)), &py); err != nil {
		t.Fatal(err)
	}
	peer.Wait(10 * time.Second)
	if got := hex.EncodeToString(g10.EncodeMetaRequest(0, 5)); got != py["request"] {
		t.Errorf("request: go %s, python %s", got, py["request"])
	}
	if got := hex.EncodeToString(md.EncodeFor(g10)); got != py["metadata"] {
		t.Errorf("metadata:\n go     %s\n python %s", got, py["metadata"])
	}
	raw, _ := hex.DecodeString(py["metadata"])
	got, err := g10.DecodeAgentMetadata(raw)
	if err != nil || !reflect.DeepEqual(got, md) {
		t.Fatalf("decoded python's: %+v %v", got, err)
	}
}

// metadataWithout is md's version-10 encoding with the named fields left
// out, or replaced by the given value.
func metadataWithout(t *testing.T, md *AgentMetadata, drop string, with *msgpack.Value) []byte {
	t.Helper()
	v, err := msgpack.Decode(md.EncodeFor(g10))
	if err != nil {
		t.Fatal(err)
	}
	var e msgpack.Encoder
	var pairs [][2]msgpack.Value
	for _, p := range v.Pairs {
		if k, _ := p[0].Str(); k == drop {
			if with == nil {
				continue
			}
			p[1] = *with
		}
		pairs = append(pairs, p)
	}
	e.MapHeader(len(pairs))
	for _, p := range pairs {
		e.Value(p[0])
		e.Value(p[1])
	}
	return e.Bytes()
}

// Version 10 requires block_strides; dcp_size and pcp_size have vLLM's
// default 1 when absent and msgspec's type rules when present. A
// version-6 encoding (no block_strides) is refused by a version-10
// decoder, and a version-6 decoder ignores the version-10 fields.
func TestGeneration10Metadata(t *testing.T) {
	md := sampleMetadata10()
	if _, err := g10.DecodeAgentMetadata(metadataWithout(t, md, "block_strides", nil)); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "block_strides") {
		t.Fatalf("without block_strides: %v", err)
	}
	if _, err := g10.DecodeAgentMetadata(md.EncodeFor(g6)); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "block_strides") {
		t.Fatalf("version 6 metadata to version 10: %v", err)
	}
	if got, err := g6.DecodeAgentMetadata(md.EncodeFor(g10)); err != nil || got.BlockStrides != nil || got.DCPSize != 0 {
		t.Fatalf("version 10 metadata to version 6: %+v %v", got, err)
	}
	md.DCPSize, md.PCPSize = 4, 2
	for _, f := range []string{"dcp_size", "pcp_size"} {
		got, err := g10.DecodeAgentMetadata(metadataWithout(t, md, f, nil))
		if err != nil {
			t.Fatalf("without %s: %v", f, err)
		}
		if (f == "dcp_size" && (got.DCPSize != 1 || got.PCPSize != 2)) || (f == "pcp_size" && (got.DCPSize != 4 || got.PCPSize != 1)) {
			t.Fatalf("without %s: dcp %d pcp %d, want the default 1 for it only", f, got.DCPSize, got.PCPSize)
		}
		str, _ := msgpack.Decode([]byte("\xa11"))
		if _, err := g10.DecodeAgentMetadata(metadataWithout(t, md, f, &str)); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), f) {
			t.Fatalf("%s a str: %v", f, err)
		}
	}
	bad, _ := msgpack.Decode([]byte{0x92, 0x01, 0xa1, 'x'})
	if _, err := g10.DecodeAgentMetadata(metadataWithout(t, md, "block_strides", &bad)); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "block_strides[1]") {
		t.Fatalf("block_strides with a str: %v", err)
	}
}

func FuzzDecodeAgentMetadata10(f *testing.F) {
	f.Add(sampleMetadata10().EncodeFor(g10))
	f.Add(sampleMetadata10().EncodeFor(g6))
	md := sampleMetadata10()
	md.DCPSize, md.PCPSize = 8, 1<<40
	f.Add(md.EncodeFor(g10))
	f.Fuzz(func(t *testing.T, b []byte) {
		md, err := g10.DecodeAgentMetadata(b)
		if err != nil {
			return
		}
		again, err := g10.DecodeAgentMetadata(md.EncodeFor(g10))
		if err != nil || !reflect.DeepEqual(again, md) {
			t.Fatalf("re-encoded: %+v %v", again, err)
		}
	})
}
