package planjson

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/planner"
)

// A TP 1 -> 2 pull, decode rank 1: 4 KV heads, 16-byte head slices per
// block on decode (32-byte blocks) and 64-byte prefill blocks; two layers.
const vllmJSONTP2 = `{
  "style": "vllm",
  "attention": "mha",
  "page_size": 16,
  "total_kv_heads": 4,
  "prefill": {"tp_size": 1, "tp_rank": 0, "kv_head_num": 4,
              "kv_ptrs": [268435456, 269484032, 270532608, 271581184],
              "kv_item_lens": [64, 64, 64, 64], "num_pages": 10},
  "decode":  {"tp_size": 2, "tp_rank": 1, "kv_head_num": 2,
              "kv_ptrs": [536870912, 537919488, 538968064, 540016640],
              "kv_item_lens": [32, 32, 32, 32], "num_pages": 8},
  "prefill_pages": [2, 3, 7],
  "decode_pages": [0, 1, 5]
}`

func TestVLLMJSONPlan(t *testing.T) {
	p, env, err := PlanRequest([]byte(vllmJSONTP2))
	if err != nil {
		t.Fatal(err)
	}
	if env.Style != StyleVLLM || env.Kind != KindKV || p.Path != planner.PathVLLMRead {
		t.Fatalf("envelope %+v path %q", env, p.Path)
	}
	// Per region: blocks 0,1 <- 2,3 as one strided copy of the second half
	// of each prefill block, then block 5 <- 7.
	var want []planner.Copy
	for i := int32(0); i < 4; i++ {
		want = append(want,
			planner.Copy{SrcRegion: i, DstRegion: i, SrcOff: 2*64 + 32, DstOff: 0, Len: 32, SrcStride: 64, DstStride: 32, Count: 2},
			planner.Copy{SrcRegion: i, DstRegion: i, SrcOff: 7*64 + 32, DstOff: 5 * 32, Len: 32, Count: 1})
	}
	// Plan.Add may join the single block onto the run (same strides? no:
	// 5*32 is not 2*32), so the copies are exactly these.
	if !reflect.DeepEqual(p.Copies, want) {
		t.Fatalf("copies\n got  %+v\n want %+v", p.Copies, want)
	}
	if p.Bytes() != 4*3*32 || p.ReferenceDescriptors != 12 {
		t.Errorf("bytes %d reference descriptors %d", p.Bytes(), p.ReferenceDescriptors)
	}
	r := NewResponse(env, p)
	if r.Descriptors != 8 || r.ExpandedDescriptors != 12 {
		t.Errorf("response %+v", r)
	}
}

func TestVLLMJSONFullHit(t *testing.T) {
	req := strings.Replace(vllmJSONTP2, `"decode_pages": [0, 1, 5]`, `"decode_pages": []`, 1)
	p, _, err := PlanRequest([]byte(req))
	if err != nil {
		t.Fatal(err)
	}
	if p.Path != planner.PathVLLMNotifyOnly || len(p.Copies) != 0 {
		t.Fatalf("path %q, %d copies", p.Path, len(p.Copies))
	}
}

func TestVLLMJSONExtras(t *testing.T) {
	// Blocks-first, block size ratio 2, windows, kernel factor, layouts and
	// device ids all pass through to the reader.
	req := `{
	  "style": "vllm", "attention": "mha", "page_size": 16, "total_kv_heads": 2,
	  "prefill": {"tp_size": 1, "tp_rank": 0, "kv_ptrs": [4096, 1052672], "kv_item_lens": [32, 32],
	              "num_pages": 20, "block_size": 8, "blocks_first": true, "kv_cache_layout": "HND", "device_id": 1},
	  "decode":  {"tp_size": 1, "tp_rank": 0, "kv_ptrs": [8192, 1056768], "kv_item_lens": [64, 64],
	              "num_pages": 10, "blocks_first": true, "kv_cache_layout": "NHD", "device_id": 2,
	              "mem_kinds": ["DRAM", "DRAM"]},
	  "enable_permute_local_kv": true,
	  "block_window_per_layer": [null, 1],
	  "physical_blocks_per_logical": 1,
	  "prefill_pages": [4, 5, 6],
	  "decode_pages": [3, 8]
	}`
	r, local, remote, err := vllmFromJSON([]byte(req))
	if err != nil {
		t.Fatal(err)
	}
	if !r.PermuteLocalKV() || r.BlockSizeRatio() != 2 || r.LocalList().DeviceID != 2 || r.RemoteList().DeviceID != 1 || r.LocalList().Kind != planner.DRAM || r.RemoteList().Kind != planner.VRAM {
		t.Fatalf("reader: permute %v ratio %d devs %d %d kinds %v %v (prefill has no mem_kinds: VRAM)", r.PermuteLocalKV(), r.BlockSizeRatio(),
			r.LocalList().DeviceID, r.RemoteList().DeviceID, r.LocalList().Kind, r.RemoteList().Kind)
	}
	rd, err := r.Read(local, remote)
	if err != nil {
		t.Fatal(err)
	}
	// Decode blocks [3 8] -> sub-blocks [6 7 16], clipped to 3. Layer 0
	// (virtual regions 0, 1) reads all three, layer 1 (2, 3) the last one.
	wantLocal := []int32{6, 7, 16, 20 + 6, 20 + 7, 20 + 16, 40 + 16, 60 + 16}
	wantRemote := []int32{4, 5, 6, 20 + 4, 20 + 5, 20 + 6, 40 + 6, 60 + 6}
	if !reflect.DeepEqual(rd.LocalIDs, wantLocal) || !reflect.DeepEqual(rd.RemoteIDs, wantRemote) {
		t.Fatalf("ids %v %v\nwant %v %v", rd.LocalIDs, rd.RemoteIDs, wantLocal, wantRemote)
	}
}

func TestVLLMJSONErrors(t *testing.T) {
	cases := []struct {
		name, from, to, field string
	}{
		{"unknown field", `"page_size": 16,`, `"page_size": 16, "bogus": 1,`, "bogus"},
		{"attention", `"attention": "mha"`, `"attention": "gqa"`, "attention"},
		{"page size", `"page_size": 16`, `"page_size": 0`, "page_size"},
		{"prepped", `"page_size": 16,`, `"page_size": 16, "prepped": true,`, "prepped"},
		{"blocks_first differs", `"kv_head_num": 2,`, `"kv_head_num": 2, "blocks_first": true,`, "prefill.blocks_first"},
		{"wrong prefill rank", `"tp_size": 1, "tp_rank": 0`, `"tp_size": 1, "tp_rank": 1`, "prefill.tp_rank"},
		{"prefill block lens", `"kv_item_lens": [64, 64, 64, 64]`, `"kv_item_lens": [64, 64, 64, 48]`, "prefill.kv_item_lens"},
		{"region count", `"kv_item_lens": [64, 64, 64, 64]`, `"kv_item_lens": [64, 64, 64]`, "prefill.kv_item_lens"},
		{"decode overlap", `536870912, 537919488`, `536870912, 536870913`, "decode.kv_ptrs"},
		{"num pages", `"num_pages": 10`, `"num_pages": 0`, "prefill.num_pages"},
		{"layout", `"num_pages": 10}`, `"num_pages": 10, "kv_cache_layout": "NHD"}`, "prefill.kv_cache_layout"},
		{"block size", `"num_pages": 10}`, `"num_pages": 10, "block_size": 32}`, "prefill.block_size"},
		{"decode TP smaller", `"tp_size": 1, "tp_rank": 0, "kv_head_num": 4`, `"tp_size": 4, "tp_rank": 0, "kv_head_num": 4`, "prefill.tp_size"},
		{"decode TP not a multiple", `"tp_size": 2, "tp_rank": 1`, `"tp_size": 3, "tp_rank": 1`, ""},
		{"start layer", `"num_pages": 10}`, `"num_pages": 10, "start_layer": 2}`, "prefill.start_layer"},
		{"draft layers", `"num_pages": 8}`, `"num_pages": 8, "draft_layers": 0}`, "decode.draft_layers"},
		{"unknown side field", `"num_pages": 8}`, `"num_pages": 8, "bogus": 0}`, "decode.bogus"},
		{"embedded type error", `"num_pages": 8}`, `"num_pages": 8, "kv_head_num": "x"}`, "decode.kv_head_num"},
		{"mixed mem kinds", `"num_pages": 8}`, `"num_pages": 8, "mem_kinds": ["VRAM", "DRAM", "VRAM", "VRAM"]}`, "decode.mem_kinds[1]"},
		{"bad mem kind", `"num_pages": 8}`, `"num_pages": 8, "mem_kinds": ["VRAM", "HBM", "VRAM", "VRAM"]}`, "decode.mem_kinds[1]"},
		{"decode page range", `"decode_pages": [0, 1, 5]`, `"decode_pages": [0, 1, 8]`, "decode_pages[2]"},
		{"decode page duplicate", `"decode_pages": [0, 1, 5]`, `"decode_pages": [0, 1, 1]`, "decode_pages[2]"},
		{"negative page", `"prefill_pages": [2, 3, 7]`, `"prefill_pages": [2, -3, 7]`, "prefill_pages[1]"},
		{"prefill page range", `"prefill_pages": [2, 3, 7]`, `"prefill_pages": [2, 3, 10]`, "prefill_pages[2]"},
		{"more decode than prefill pages", `"prefill_pages": [2, 3, 7]`, `"prefill_pages": [2, 3]`, "decode_pages"},
		{"windows", `"page_size": 16,`, `"page_size": 16, "block_window_per_layer": [1, 2, 3],`, "block_window_per_layer"},
		{"negative window", `"page_size": 16,`, `"page_size": 16, "block_window_per_layer": [1, -2],`, "block_window_per_layer"},
		{"negative heads", `"total_kv_heads": 4,`, `"total_kv_heads": -4,`, "total_kv_heads"},
		{"kernel factor", `"page_size": 16,`, `"page_size": 16, "physical_blocks_per_logical": -1,`, "physical_blocks_per_logical"},
		{"type error", `"num_pages": 10`, `"num_pages": "ten"`, "prefill.num_pages"},
		{"top-level type error", `"page_size": 16`, `"page_size": "16"`, "page_size"},
		{"window type error", `"page_size": 16,`, `"page_size": 16, "block_window_per_layer": ["x"],`, "block_window_per_layer"},
		{"trailing data", `"decode_pages": [0, 1, 5]
}`, `"decode_pages": [0, 1, 5]
} {}`, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req := strings.Replace(vllmJSONTP2, tc.from, tc.to, 1)
			if req == vllmJSONTP2 {
				t.Fatalf("replacement %q not found", tc.from)
			}
			_, _, err := PlanRequest([]byte(req))
			var pe *planner.Error
			if !errors.As(err, &pe) {
				t.Fatalf("want *Error, got %v", err)
			}
			if tc.field != "" && pe.Field != tc.field {
				t.Fatalf("got %q, want field %q", err, tc.field)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("error is not one line: %q", err)
			}
		})
	}
	// The defaulted head count: prefill kv_head_num 4 x tp_size 1.
	req := strings.Replace(vllmJSONTP2, `"total_kv_heads": 4,`, ``, 1)
	if _, _, err := PlanRequest([]byte(req)); err != nil {
		t.Fatalf("total_kv_heads default: %v", err)
	}
	req = strings.Replace(req, `"kv_head_num": 4,`, ``, 1)
	if _, _, err := PlanRequest([]byte(req)); err == nil || !strings.Contains(err.Error(), "total_kv_heads") {
		t.Fatalf("no head count: %v", err)
	}
}

// The examples shipped for the docs plan without error.
func TestVLLMJSONExamples(t *testing.T) {
	files, err := filepath.Glob("testdata/vllm_*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata/vllm_*.json examples (%v)", err)
	}
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		p, _, err := PlanRequest(raw)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		if err := p.Validate(); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}
}

func FuzzVLLMKVRequest(f *testing.F) {
	f.Add([]byte(vllmJSONTP2))
	f.Add([]byte(strings.Replace(vllmJSONTP2, `"decode_pages": [0, 1, 5]`, `"decode_pages": []`, 1)))
	f.Add([]byte(`{"style":"vllm","attention":"mla","page_size":4,"prefill":{"tp_size":1,"kv_ptrs":[0],"kv_item_lens":[8],"num_pages":4,"block_size":2},"decode":{"tp_size":2,"tp_rank":1,"kv_ptrs":[4096],"kv_item_lens":[16],"num_pages":4},"block_window_per_layer":[1],"prefill_pages":[0,1,2],"decode_pages":[3,0]}`))
	f.Add([]byte(`{"style":"vllm","attention":"mha","page_size":4,"total_kv_heads":1,"prefill":{"tp_size":1,"kv_ptrs":[0],"kv_item_lens":[8],"num_pages":4,"blocks_first":true},"decode":{"tp_size":4,"tp_rank":3,"kv_ptrs":[4096],"kv_item_lens":[8],"num_pages":4,"blocks_first":true},"prefill_pages":[0,1,2],"decode_pages":[3,0]}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		p, _, err := PlanRequest(raw)
		if err != nil {
			if strings.Contains(err.Error(), "internal error") {
				t.Fatalf("plan left its regions: %v", err)
			}
			return
		}
		if err := p.Validate(); err != nil {
			t.Fatal(err)
		}
	})
}
