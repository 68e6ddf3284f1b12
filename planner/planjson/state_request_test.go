package planjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/planner"
)

// Seeds of every aux/state/dsa_tail request shape, valid and broken.
var bStateSeeds = []string{
	`{"style":"sglang-nixl","kind":"aux","prefill":{"aux_ptrs":[4096,8192],"aux_item_lens":[16,64],"aux_data_lens":[1600,6400]},
	  "decode":{"aux_ptrs":[65536,131072]},"prefill_aux_index":3,"dst_aux_index":5}`,
	`{"style":"sglang-mori","kind":"aux","prefill":{"aux_ptrs":[4096],"aux_item_lens":[16]},
	  "decode":{"aux_ptrs":[65536,131072],"aux_item_lens":[32,8]},"prefill_aux_index":1,"dst_aux_index":2}`,
	`{"style":"sglang-mori","kind":"aux","prefill":{"aux_ptrs":[4096],"aux_item_lens":[16]},"decode":{"aux_ptrs":[65536]},"prefill_aux_index":1,"dst_aux_index":-1}`,
	`{"style":"sglang-nixl","kind":"state","attention":"mla","state_types":["mamba","swa"],
	  "prefill":{"tp_size":1,"tp_rank":0,"state_ptrs":[[4096],[100000,200000]],"state_data_lens":[[6400],[4096,4096]],
	    "state_item_lens":[[64],[64,64]],"state_dim_per_tensor":[[8]]},
	  "decode":{"tp_size":2,"tp_rank":1,"state_ptrs":[[8192],[500000,600000,700000,800000]],"state_item_lens":[[32],[64,64,64,64]],
	    "state_dim_per_tensor":[[4]]},
	  "prefill_state_indices":[[3],[1,2,3]],"decode_state_indices":[[5],[7,8,9]]}`,
	`{"style":"sglang-mori","kind":"state","attention":"mha","state_types":["mamba","dsa","swa_ring"],
	  "prefill":{"tp_size":2,"tp_rank":1,"state_ptrs":[[4096,8192],[1048576],[2097152]],"state_item_lens":[[64,128],[32],[16]],
	    "state_dim_per_tensor":[[4,8]],"state_conv_shard_groups":[[[4,2,2],null]],"state_slice_outer_counts":[[2,1]]},
	  "decode":{"tp_size":1,"tp_rank":0,"state_ptrs":[[16384,32768],[4194304],[8388608]],"state_item_lens":[[128,256],[32],[16]],
	    "state_dim_per_tensor":[[8,16]]},
	  "prefill_state_indices":[[2],[4,5,6],[9]],"decode_state_indices":[[1],[0,1],[3]]}`,
	`{"style":"sglang-nixl","kind":"state","attention":"mla","state_types":["swa_ring","c128_state"],
	  "prefill":{"tp_size":1,"tp_rank":0,"pp_size":2,"start_layer":2,"end_layer":4,"mla_compression_ratios":[0,4,128,4],
	    "state_ptrs":[[4096,8192],[12288]],"state_item_lens":[[16,16],[32]]},
	  "decode":{"tp_size":1,"tp_rank":0,"state_ptrs":[[1,2,3,4],[5]]},
	  "prefill_state_indices":[[5],[1]],"decode_state_indices":[[9],[2]]}`,
	`{"style":"sglang-nixl","kind":"state","attention":"mha","state_types":["mamba"],
	  "prefill":{"tp_size":1,"tp_rank":0,"pp_size":2,"state_ptrs":[[4096]],"state_item_lens":[[64]],"state_layer_ids":[[7]]},
	  "decode":{"tp_size":1,"tp_rank":0,"state_ptrs":[[8192,9000]],"state_layer_ids":[[3,7]]},
	  "prefill_state_indices":[[1]],"decode_state_indices":[[2]]}`,
	`{"style":"sglang-nixl","kind":"dsa_tail","prefill":{"dsa_tail_ptrs":[4294967296,8589934592],"dsa_tail_item_lens":[48,96],
	  "dsa_tail_indices":[1,4,2,0,1,6]},"decode":{"dsa_tail_ptrs":[12884901888,17179869184],"dsa_tail_item_lens":[32,64],
	  "dsa_tail_indices":[2,0,3,0,0,4]}}`,
	`{"style":"sglang-mori","kind":"dsa_tail","prefill":{"dsa_tail_ptrs":[4096,8192],"dsa_tail_item_lens":[8,8],"dsa_tail_indices":[0,0,1,0,0,8],
	  "start_layer":1,"end_layer":2},"decode":{"dsa_tail_ptrs":[1,2,3,4,5,6],"dsa_tail_indices":[0,0,1,0,0,8]}}`,
	`{"style":"sglang-nixl","kind":"state","attention":"mha","state_types":[],"prefill":{"tp_size":1},"decode":{"tp_size":1}}`,
	`{"style":"sglang-nixl","kind":"state"}`,
	`{"style":"sglang-mori","kind":"aux"}`,
}

// FuzzStateRequest: aux, state and dsa_tail requests never panic, errors
// are one line, and plans stay inside their regions and print as JSON.
func FuzzStateRequest(f *testing.F) {
	for _, s := range bStateSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		p, env, err := PlanRequest(raw)
		if err != nil {
			if strings.ContainsRune(err.Error(), '\n') {
				t.Fatalf("multi-line error %q", err)
			}
			if strings.HasPrefix(err.Error(), "internal error") {
				t.Fatalf("planner bug: %v", err)
			}
			return
		}
		if err := p.Validate(); err != nil {
			t.Fatalf("plan outside its regions: %v", err)
		}
		var buf bytes.Buffer
		if err := WriteResponse(&buf, env, p, p.ExpandedDescriptors() > 1<<16); err != nil {
			t.Fatal(err)
		}
		if !json.Valid(buf.Bytes()) {
			t.Fatalf("response is not JSON: %.200s", buf.String())
		}
	})
}

func TestStateRequestSeedsPlan(t *testing.T) {
	// Every seed but the last three plans.
	for i, s := range bStateSeeds[:len(bStateSeeds)-2] {
		p, _, err := PlanRequest([]byte(s))
		if err != nil {
			t.Fatalf("seed %d: %v", i, err)
		}
		if i != 2 && i != len(bStateSeeds)-3 && p.Bytes() == 0 {
			t.Fatalf("seed %d moves nothing (%s)", i, p.Path)
		}
	}
}

func TestStateRequestJSON(t *testing.T) {
	// The aux seed, answered in full.
	p, env, err := PlanRequest([]byte(bStateSeeds[0]))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := WriteResponse(&buf, env, p, false); err != nil {
		t.Fatal(err)
	}
	want := `{"style":"sglang-nixl","kind":"aux","path":"nixl-aux","descriptors":2,"expanded_descriptors":2,"bytes":80,"reference_descriptors":2,"copies":[[4144,65616,16],[8384,131392,64]]}` + "\n"
	if buf.String() != want {
		t.Fatalf("got  %s\nwant %s", buf.String(), want)
	}

	// The NIXL state seed: Mamba TP 1 -> 2 slice, MLA SWA paged; one part
	// per component, notified with the component index.
	p, env, err = PlanRequest([]byte(bStateSeeds[3]))
	if err != nil {
		t.Fatal(err)
	}
	r := NewResponse(env, p)
	if r.Path != "state:mamba[0]=nixl-state-mamba-slice,swa[1]=nixl-state-paged" || len(r.Parts) != 2 ||
		r.Parts[0].NotifSuffix != "_0" || r.Parts[1].NotifSuffix != "_1" || r.Bytes != 32+2*192 {
		t.Fatalf("response %+v", r)
	}

	for _, tc := range []struct {
		name, req, field string
	}{
		{"unknown field", `{"style":"sglang-nixl","kind":"aux","prefill":{"aux_ptrs":[1],"aux_item_lens":[1],"bogus":1},"decode":{"aux_ptrs":[2]}}`, "prefill.bogus"},
		{"item lens", `{"style":"sglang-nixl","kind":"aux","prefill":{"aux_ptrs":[1,2],"aux_item_lens":[1]},"decode":{"aux_ptrs":[2]}}`, "prefill.aux_item_lens"},
		{"negative pointer", `{"style":"sglang-nixl","kind":"aux","prefill":{"aux_ptrs":[-1]},"decode":{}}`, "prefill.aux_ptrs"},
		{"attention", `{"style":"sglang-nixl","kind":"state","attention":"gqa","state_types":[],"prefill":{},"decode":{}}`, "attention"},
		{"decode pp", `{"style":"sglang-nixl","kind":"state","attention":"mha","state_types":[],"prefill":{"tp_size":1},"decode":{"tp_size":1,"pp_size":2}}`, "decode.pp_size"},
		{"decode groups", `{"style":"sglang-nixl","kind":"state","attention":"mha","state_types":[],"prefill":{"tp_size":1},"decode":{"tp_size":1,"state_conv_shard_groups":[]}}`, "decode.state_conv_shard_groups"},
		{"index range", `{"style":"sglang-nixl","kind":"state","attention":"mha","state_types":["swa"],"prefill":{"tp_size":1,"state_ptrs":[[1]],"state_item_lens":[[1]]},"decode":{"tp_size":1,"state_ptrs":[[2]]},"prefill_state_indices":[[4294967296]],"decode_state_indices":[[1]]}`, "prefill_state_indices[0][0]"},
		{"empty type", `{"style":"sglang-nixl","kind":"state","attention":"mha","state_types":[""],"prefill":{"tp_size":1},"decode":{"tp_size":1}}`, "state_types[0]"},
		{"tp size", `{"style":"sglang-mori","kind":"state","attention":"mha","state_types":[],"prefill":{"tp_size":0},"decode":{"tp_size":1}}`, "prefill.tp_size"},
		{"dsa decode layers", `{"style":"sglang-nixl","kind":"dsa_tail","prefill":{"dsa_tail_ptrs":[]},"decode":{"dsa_tail_ptrs":[],"start_layer":1}}`, "decode.start_layer"},
		{"vllm has no aux", `{"style":"vllm","kind":"aux"}`, "kind"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := PlanRequest([]byte(tc.req))
			bFieldErr(t, err, tc.field, "")
		})
	}
}

// bFieldErr fails unless err is a *planner.Error whose field starts with
// field and whose message contains msg.
func bFieldErr(t *testing.T, err error, field, msg string) {
	t.Helper()
	var e *planner.Error
	if !errors.As(err, &e) {
		t.Fatalf("want *Error for %s, got %v", field, err)
	}
	if !strings.HasPrefix(e.Field, field) || !strings.Contains(e.Msg, msg) {
		t.Fatalf("want error %s: ...%s..., got %v", field, msg, err)
	}
}
