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

var g11, g12 = generations[11], generations[12]

// sampleMetadata12 is a one-group vLLM worker's version-12 metadata: three
// regions of num_blocks blocks, group 0, VRAM, named by layer, no members.
func sampleMetadata12() *AgentMetadata {
	md := sampleMetadata10()
	md.UniformRegions([]string{"model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "mtp.0"}, "VRAM")
	return md
}

// withField is md's encoding for g with field replaced by with (dropped
// when with is nil).
func withField(t *testing.T, g *Generation, md *AgentMetadata, field string, with *msgpack.Value) []byte {
	t.Helper()
	v, err := msgpack.Decode(md.EncodeFor(g))
	if err != nil {
		t.Fatal(err)
	}
	var pairs [][2]msgpack.Value
	found := false
	for _, p := range v.Pairs {
		if k, _ := p[0].Str(); k == field {
			found = true
			if with == nil {
				continue
			}
			p[1] = *with
		}
		pairs = append(pairs, p)
	}
	if !found {
		t.Fatalf("%s has no field %s", g, field)
	}
	var e msgpack.Encoder
	e.MapHeader(len(pairs))
	for _, p := range pairs {
		e.Value(p[0])
		e.Value(p[1])
	}
	return e.Bytes()
}

func mp(t *testing.T, hexBytes string) *msgpack.Value {
	t.Helper()
	b, err := hex.DecodeString(hexBytes)
	if err != nil {
		t.Fatal(err)
	}
	v, err := msgpack.Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	return &v
}

// Versions 11 and 12 are byte for byte Python's msgpack.packb of the
// dataclass's fields in declaration order (the region lists, or None,
// between physical_blocks_per_logical_kv_block and dcp_size;
// region_members last in 12), and each decodes back.
func TestGeneration11And12MatchPython(t *testing.T) {
	zmqtest.RequirePython(t, "zmq", "msgpack")
	for _, c := range []struct {
		name string
		g    *Generation
		edit func(*AgentMetadata)
	}{
		{"v12", g12, func(*AgentMetadata) {}},
		{"v12-members", g12, func(md *AgentMetadata) { md.RegionMembers = [][]string{{"a"}, {"b", "b.swa"}, {}} }},
		{"v12-none", g12, func(md *AgentMetadata) {
			md.RegionNumBlocks, md.RegionGroupIDs, md.RegionNames, md.RegionMemTypes = nil, nil, nil, nil
		}},
		{"v11", g11, func(md *AgentMetadata) { md.RegionMembers = nil }},
		{"v11-mixed", g11, func(md *AgentMetadata) {
			md.RegionMembers = nil
			md.RegionNumBlocks, md.RegionGroupIDs = []int{12345, 7, 1}, []int{0, 1, 2}
			md.RegionMemTypes = []string{"VRAM", "DRAM", "VRAM"}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			md := sampleMetadata12()
			md.DCPSize, md.PCPSize = 2, 3
			c.edit(md)
			members := md.RegionMembers
			if members == nil {
				members = [][]string{}
			}
			spec := map[string]any{"version": c.g.Version, "pp_rank": 0, "tp_rank": 5, "metadata": map[string]any{
				"engine_id": md.EngineID, "agent_metadata": hex.EncodeToString(md.AgentMetadata), "kv_caches_base_addr": md.KVCachesBaseAddr,
				"device_id": md.DeviceID, "num_blocks": md.NumBlocks, "block_lens": md.BlockLens, "block_strides": md.BlockStrides,
				"kv_cache_layout": md.KVCacheLayout, "block_size": md.BlockSize, "ssm_sizes": md.SSMSizes[:],
				"attn_backend_name": md.AttnBackendName, "physical_blocks_per_logical_kv_block": md.PhysicalBlocksPerLogical,
				"region_num_blocks": md.RegionNumBlocks, "region_group_ids": md.RegionGroupIDs, "region_names": md.RegionNames,
				"region_mem_types": md.RegionMemTypes, "dcp_size": md.DCPSize, "pcp_size": md.PCPSize, "region_members": members}}
			path := filepath.Join(t.TempDir(), "spec.json")
			b, _ := json.Marshal(spec)
			if err := os.WriteFile(path, b, 0o644); err != nil {
				t.Fatal(err)
			}
			peer := zmqtest.Start(t, peerScript, "encode12", path)
			var py map[string]string
			if err := json.Unmarshal([]byte(peer.Line(30*time.Second)), &py); err != nil {
				t.Fatal(err)
			}
			peer.Wait(10 * time.Second)
			if got := hex.EncodeToString(c.g.EncodeMetaRequest(0, 5)); got != py["request"] {
				t.Errorf("request: go %s, python %s", got, py["request"])
			}
			if got := hex.EncodeToString(md.EncodeFor(c.g)); got != py["metadata"] {
				t.Errorf("metadata:\n go     %s\n python %s", got, py["metadata"])
			}
			raw, _ := hex.DecodeString(py["metadata"])
			got, err := c.g.DecodeAgentMetadata(raw)
			if err != nil || !reflect.DeepEqual(got, md) {
				t.Fatalf("decoded python's: %+v %v", got, err)
			}
		})
	}
}

// The region fields have their defaults when absent (None; region_members
// empty), msgspec's type rules when present, and must agree with the
// regions: one entry per region, counts and group ids in range, names and
// memory types non-empty and bounded, no layer in two regions. Each
// refusal is ErrMalformed naming the field.
func TestGeneration12RegionFields(t *testing.T) {
	md := sampleMetadata12()
	for _, f := range []string{"region_num_blocks", "region_group_ids", "region_names", "region_mem_types", "region_members"} {
		got, err := g12.DecodeAgentMetadata(withField(t, g12, md, f, nil))
		if err != nil {
			t.Fatalf("without %s: %v", f, err)
		}
		want := sampleMetadata12()
		switch f {
		case "region_num_blocks":
			want.RegionNumBlocks = nil
		case "region_group_ids":
			want.RegionGroupIDs = nil
		case "region_names":
			want.RegionNames = nil
		case "region_mem_types":
			want.RegionMemTypes = nil
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("without %s: %+v", f, got)
		}
	}
	// None where vLLM allows it; an empty list is a list (of the wrong length).
	got, err := g12.DecodeAgentMetadata(withField(t, g12, md, "region_names", mp(t, "c0")))
	if err != nil || got.RegionNames != nil {
		t.Fatalf("region_names None: %+v %v", got, err)
	}
	for _, c := range []struct {
		field, value, want string
	}{
		{"region_num_blocks", "90", `"region_num_blocks" has 0 entries for 3 regions`},
		{"region_num_blocks", "9401020304", `"region_num_blocks" has 4 entries`},
		{"region_num_blocks", "93010200", "region_num_blocks[2] is 0"},
		{"region_num_blocks", "9301ff01", "region_num_blocks[1] is -1"},
		{"region_num_blocks", "930102a178", `"region_num_blocks[2]" is a msgpack str`},
		{"region_num_blocks", "a3616263", `"region_num_blocks" is a msgpack str, expected array`},
		{"region_group_ids", "93000003", "region_group_ids[2] is 3, want 0..2"},
		{"region_group_ids", "930000ff", "region_group_ids[2] is -1"},
		{"region_group_ids", "920000", `"region_group_ids" has 2 entries`},
		{"region_names", "93a161a162a0", "region_names[2] is 0 bytes"},
		{"region_names", "93a161a16201", `"region_names[2]" is a msgpack uint`},
		{"region_names", "93a161a162a2fffe", `"region_names[2]" is a msgpack str, expected str`},
		{"region_mem_types", "93a45652414da45652414da0", "region_mem_types[2] is 0 bytes"},
		{"region_mem_types", "91a45652414d", `"region_mem_types" has 1 entries`},
		{"region_members", "c0", `"region_members" is a msgpack nil, expected array`},
		{"region_members", "9391a16191a16290", ""}, // one empty member list is well formed
		{"region_members", "9291a16191a162", `"region_members" has 2 entries for 3 regions`},
		{"region_members", "9391a16191a16191a163", `names layer "a" in regions 0 and 1`},
		{"region_members", "9391a16191a162a163", `"region_members[2]" is a msgpack str, expected array of str`},
		{"region_members", "9391a16191a16291a0", "region_members[2][0] is 0 bytes"},
	} {
		v := mp(t, c.value)
		got, err := g12.DecodeAgentMetadata(withField(t, g12, md, c.field, v))
		if c.want == "" {
			if err != nil {
				t.Errorf("%s %s: %v", c.field, c.value, err)
			}
			continue
		}
		if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s %s: got %+v %v, want %q", c.field, c.value, got, err, c.want)
		}
	}
	long := &AgentMetadata{}
	*long = *sampleMetadata12()
	long.RegionNames = []string{"a", strings.Repeat("n", MaxRegionName+1), "c"}
	if _, err := g12.DecodeAgentMetadata(long.EncodeFor(g12)); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "region_names[1]") {
		t.Fatalf("a long name: %v", err)
	}
	// A version-11 decoder ignores region_members (msgspec ignores unknown
	// fields); version 10 ignores every region field.
	md.RegionMembers = [][]string{{"a"}, {"b"}, {"c"}}
	if got, err := g11.DecodeAgentMetadata(md.EncodeFor(g12)); err != nil || got.RegionMembers != nil || got.RegionNames == nil {
		t.Fatalf("version 12 to 11: %+v %v", got, err)
	}
	if got, err := g10.DecodeAgentMetadata(md.EncodeFor(g12)); err != nil || got.RegionNames != nil {
		t.Fatalf("version 12 to 10: %+v %v", got, err)
	}
}

// What kvhost cannot map is refused naming the field: regions of other
// sizes, several KV cache groups, another memory type, pooled layers. A
// one-group worker's metadata, or one that says nothing (None), passes.
func TestCheckMappable(t *testing.T) {
	if err := sampleMetadata12().CheckMappable("VRAM"); err != nil {
		t.Fatal(err)
	}
	none := sampleMetadata10()
	if err := none.CheckMappable("DRAM"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		edit func(*AgentMetadata)
		want string
	}{
		{func(m *AgentMetadata) { m.RegionNumBlocks[1] = m.NumBlocks / 2 }, "region_num_blocks[1]"},
		{func(m *AgentMetadata) { m.RegionGroupIDs[2] = 1 }, "region_group_ids[2] is 1"},
		{func(m *AgentMetadata) { m.RegionMemTypes[0] = "DRAM" }, `region_mem_types[0] is "DRAM"`},
		{func(m *AgentMetadata) { m.RegionMembers = [][]string{{"a"}, {"b", "b.swa"}, {"c"}} }, "region_members[1] pools 2 layers"},
	} {
		md := sampleMetadata12()
		c.edit(md)
		err := md.CheckMappable("VRAM")
		if !errors.Is(err, ErrRegionLayout) || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "kvhost reads") {
			t.Errorf("want %q: %v", c.want, err)
		}
	}
	if err := sampleMetadata12().CheckMappable("DRAM"); !errors.Is(err, ErrRegionLayout) || !strings.Contains(err.Error(), `"DRAM"`) {
		t.Fatalf("VRAM regions for a DRAM decode: %v", err)
	}
}

func FuzzDecodeAgentMetadata12(f *testing.F) {
	f.Add(sampleMetadata12().EncodeFor(g12))
	f.Add(sampleMetadata12().EncodeFor(g11))
	f.Add(sampleMetadata10().EncodeFor(g12))
	md := sampleMetadata12()
	md.RegionMembers = [][]string{{"a", "b"}, {}, {"c"}}
	md.RegionGroupIDs = []int{0, 2, 1}
	f.Add(md.EncodeFor(g12))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, g := range []*Generation{g11, g12} {
			md, err := g.DecodeAgentMetadata(b)
			if err != nil {
				continue
			}
			n := len(md.KVCachesBaseAddr)
			for _, l := range [][]int{md.RegionNumBlocks, md.RegionGroupIDs} {
				if l != nil && len(l) != n {
					t.Fatalf("%s: region list of %d for %d regions", g, len(l), n)
				}
			}
			for _, id := range md.RegionGroupIDs {
				if id < 0 || id >= n {
					t.Fatalf("%s: group %d of %d regions", g, id, n)
				}
			}
			if len(md.RegionMembers) != 0 && len(md.RegionMembers) != n {
				t.Fatalf("%s: %d member lists for %d regions", g, len(md.RegionMembers), n)
			}
			md.CheckMappable("VRAM") // must not panic
			again, err := g.DecodeAgentMetadata(md.EncodeFor(g))
			if err != nil || !reflect.DeepEqual(again, md) {
				t.Fatalf("%s re-encoded: %+v %v", g, again, err)
			}
		}
	})
}
