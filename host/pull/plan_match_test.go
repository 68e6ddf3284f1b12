package pull

import (
	"bytes"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/planner/planjson"
)

// TestPlanShowsRuntimeRead: for decode blocks larger than the prefill's
// and a partial prefix hit (where kvhost deliberately reads other prefill
// blocks than vLLM, see planner.VLLMAlignRemote), what `kvhost plan`
// prints for the request (planjson.PlanRequest and WriteResponse, the
// command's two calls) is exactly what a Receiver reads from a Sender:
// every planned decode range holds the planned prefill bytes afterwards,
// and no other decode byte changed. NHD and TP 1, so the runtime does not
// reorder the blocks after the READ and memory shows the READ itself.
func TestPlanShowsRuntimeRead(t *testing.T) {
	pg := geom{layers: 2, heads: 2, headBytes: 16, tp: 1, blockSize: 4, blocks: 32}
	dg := pg
	dg.blockSize, dg.blocks = 8, 16 // block-size ratio 2
	ps := newPrefillSide(t, pg, "prefill", nil)
	ds := newDecodeSide(t, dg, nil)

	// 5 prefill blocks (18 tokens) span 3 decode blocks; the first decode
	// block is a prefix hit, so the decode reads into 2.
	remote := []int32{7, 2, 30, 11, 5}
	local := []int32{9, 4}
	params := ps.hold(t, "r", 42, remote, 18)
	dmem := ds.pools[0].Bytes()
	for i := range dmem {
		dmem[i] = 0xEE
	}
	res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "r", LocalBlockIDs: local, Params: params}))
	if res.Err != nil || res.NotifyOnly {
		t.Fatalf("load: %+v", res)
	}

	side := func(p geomSide) map[string]any {
		var ptrs, lens []uint64
		var kinds []string
		for _, r := range p.regions {
			ptrs = append(ptrs, r.Addr)
			lens = append(lens, r.Len/uint64(p.g.blocks))
			kinds = append(kinds, "DRAM")
		}
		return map[string]any{"tp_size": 1, "tp_rank": 0, "kv_head_num": p.g.heads, "kv_ptrs": ptrs, "kv_item_lens": lens,
			"num_pages": p.g.blocks, "block_size": p.g.blockSize, "kv_cache_layout": LayoutNHD, "mem_kinds": kinds}
	}
	pSide := geomSide{pg, ps.pools[0].Regions()}
	dSide := geomSide{dg, ds.pools[0].Regions()}
	req, _ := json.Marshal(map[string]any{"style": "vllm", "attention": "mha", "page_size": pg.blockSize, "total_kv_heads": pg.heads,
		"prefill": side(pSide), "decode": side(dSide), "prefill_pages": remote, "decode_pages": local})
	p, env, err := planjson.PlanRequest(req)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := planjson.WriteResponse(&out, env, p, false); err != nil {
		t.Fatal(err)
	}
	var resp struct {
		Bytes  uint64      `json:"bytes"`
		Copies [][3]uint64 `json:"copies"`
	}
	if err := json.Unmarshal(out.Bytes(), &resp); err != nil {
		t.Fatalf("plan output %s: %v", out.Bytes(), err)
	}

	pmem, pbase := ps.pools[0].Bytes(), ps.pools[0].Regions()[0].Addr
	dbase := ds.pools[0].Regions()[0].Addr
	covered := make([]bool, len(dmem))
	var planned uint64
	for _, c := range resp.Copies {
		src, dst, n := c[0]-pbase, c[1]-dbase, c[2]
		if !bytes.Equal(dmem[dst:dst+n], pmem[src:src+n]) {
			t.Errorf("plan copy %v: the decode range does not hold the planned prefill bytes", c)
		}
		for i := dst; i < dst+n; i++ {
			covered[i] = true
		}
		planned += n
	}
	var stray []string
	for i, b := range dmem {
		if !covered[i] && b != 0xEE {
			stray = append(stray, fmt.Sprintf("%#x", dbase+uint64(i)))
			if len(stray) == 8 {
				break
			}
		}
	}
	if len(stray) > 0 {
		t.Errorf("the runtime wrote decode bytes the plan does not list, at %v...", stray)
	}
	// 3 prefill blocks of 2 layers × K and V × 2 heads × 4 tokens × 16 bytes.
	if want := uint64(3 * 4 * 2 * 4 * 16); planned != want || resp.Bytes != want {
		t.Errorf("plan moves %d bytes (copies %d), want %d", resp.Bytes, planned, want)
	}
}

type geomSide struct {
	g       geom
	regions []kvpool.Region
}
