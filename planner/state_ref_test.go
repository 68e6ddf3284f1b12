package planner

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"reflect"
	"slices"
	"testing"
)

// Reference-equivalence tests: random inputs are planned in Go and by
// testdata/ref_state.py, a plain-Python restatement of SGLang's disaggregation/{nixl,mori}/conn.py
// formulas, and the results must agree: the same error/no-error outcome
// and, for plans, the same bytes moved from the same addresses to the same
// addresses.

type bRefCase struct {
	Fn   string         `json:"fn"`
	Args map[string]any `json:"args"`
}

type bRefResult struct {
	OK  json.RawMessage `json:"ok"`
	Err string          `json:"err"`
}

// bRunRef runs SGLang's disaggregation/{nixl,mori}/conn.py restatement on all cases in one process.
func bRunRef(t *testing.T, cases []bRefCase) []bRefResult {
	t.Helper()
	const py = "/usr/bin/python3"
	if _, err := os.Stat(py); err != nil {
		t.Fatalf("reference check needs %s (with python3-numpy: scripts/install-test-deps.sh): %v", py, err)
	}
	if err := exec.Command(py, "-c", "import numpy").Run(); err != nil {
		t.Fatalf("%s cannot import numpy (apt-get install python3-numpy): %v", py, err)
	}
	in, err := json.Marshal(cases)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(py, "testdata/ref_state.py")
	cmd.Stdin = bytes.NewReader(in)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("ref_state.py: %v\n%s", err, stderr.String())
	}
	var res []bRefResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("ref_state.py output: %v", err)
	}
	if len(res) != len(cases) {
		t.Fatalf("ref_state.py answered %d of %d cases", len(res), len(cases))
	}
	return res
}

// bBlock is one absolute (src, dst, len) copy.
type bBlock [3]uint64

// bCanonical sorts blocks, drops empty ones and merges blocks adjacent
// on both sides, so two decompositions of the same byte mapping compare
// equal.
func bCanonical(in []bBlock) []bBlock {
	var bs []bBlock
	for _, b := range in {
		if b[2] != 0 {
			bs = append(bs, b)
		}
	}
	slices.SortFunc(bs, func(a, b bBlock) int {
		for k := range a {
			if a[k] != b[k] {
				if a[k] < b[k] {
					return -1
				}
				return 1
			}
		}
		return 0
	})
	var out []bBlock
	for _, b := range bs {
		if n := len(out); n > 0 && out[n-1][0]+out[n-1][2] == b[0] && out[n-1][1]+out[n-1][2] == b[1] {
			out[n-1][2] += b[2]
			continue
		}
		out = append(out, b)
	}
	return out
}

func bPlanBlocks(p *Plan) []bBlock {
	var out []bBlock
	p.ForEachBlock(func(s, d, n uint64) bool {
		out = append(out, bBlock{s, d, n})
		return true
	})
	return bCanonical(out)
}

func bDecodeBlocks(t *testing.T, raw json.RawMessage) []bBlock {
	t.Helper()
	var bs [][3]uint64
	if err := json.Unmarshal(raw, &bs); err != nil {
		t.Fatalf("blocks %s: %v", raw, err)
	}
	out := make([]bBlock, len(bs))
	for i, b := range bs {
		out[i] = bBlock(b)
	}
	return bCanonical(out)
}

// bAddrs hands out distinct, well separated region base addresses.
type bAddrs struct{ next uint64 }

func (a *bAddrs) get() uint64 {
	a.next += 1 << 32
	return a.next
}

func bPick[T any](r *rand.Rand, xs ...T) T { return xs[r.Intn(len(xs))] }

// ---------------------------------------------------------------- aux ---

func TestAuxMatchesReference(t *testing.T) {
	r := rand.New(rand.NewSource(1))
	type tc struct {
		src, dst AuxBuffers
		pi, di   int64
		mori     bool
	}
	var tcs []tc
	var cases []bRefCase
	for n := 0; n < 300; n++ {
		var a bAddrs
		var c tc
		c.mori = n%2 == 1
		nb := r.Intn(5)
		nd := nb
		if r.Intn(4) == 0 {
			nd = r.Intn(6)
		}
		for i := 0; i < nb; i++ {
			c.src.Ptrs = append(c.src.Ptrs, a.get())
			c.src.ItemLens = append(c.src.ItemLens, uint64(bPick(r, 0, 8, 64, 512, 4096)))
		}
		for i := 0; i < nd; i++ {
			c.dst.Ptrs = append(c.dst.Ptrs, a.get())
			if r.Intn(2) == 0 {
				c.dst.ItemLens = append(c.dst.ItemLens, uint64(bPick(r, 8, 64, 512)))
			}
		}
		if len(c.dst.ItemLens) != nd {
			c.dst.ItemLens = nil
		}
		c.pi, c.di = int64(r.Intn(100)), int64(r.Intn(100))
		if c.mori && r.Intn(5) == 0 {
			c.di = -1
		}
		tcs = append(tcs, c)
		fn := "aux_nixl"
		if c.mori {
			fn = "aux_mori"
		}
		cases = append(cases, bRefCase{fn, map[string]any{
			"src": map[string]any{"ptrs": c.src.Ptrs, "item_lens": c.src.ItemLens},
			"dst": map[string]any{"ptrs": c.dst.Ptrs, "item_lens": c.dst.ItemLens},
			"pi":  c.pi, "di": c.di,
		}})
	}
	res := bRunRef(t, cases)
	for i, c := range tcs {
		var p *Plan
		var err error
		if c.mori {
			p, err = PlanAuxMORI(c.src, c.dst, c.pi, c.di)
		} else {
			p, err = PlanAuxNIXL(c.src, c.dst, c.pi, c.di)
		}
		bComparePlan(t, fmt.Sprintf("case %d %+v", i, c), res[i], p, err)
	}
}

// bComparePlan compares one Go plan with a reference {"path", "blocks"}.
func bComparePlan(t *testing.T, name string, ref bRefResult, p *Plan, err error) {
	t.Helper()
	if (err != nil) != (ref.Err != "") {
		t.Fatalf("%s: Go error %v, reference error %q", name, err, ref.Err)
	}
	if err != nil {
		return
	}
	if verr := p.Validate(); verr != nil {
		t.Fatalf("%s: invalid plan: %v", name, verr)
	}
	var want struct {
		Path   string          `json:"path"`
		Blocks json.RawMessage `json:"blocks"`
	}
	if err := json.Unmarshal(ref.OK, &want); err != nil {
		t.Fatal(err)
	}
	if p.Path != want.Path {
		t.Fatalf("%s: path %q, reference %q", name, p.Path, want.Path)
	}
	got, exp := bPlanBlocks(p), bDecodeBlocks(t, want.Blocks)
	if !reflect.DeepEqual(got, exp) {
		t.Fatalf("%s: blocks differ\n go: %v\nref: %v", name, got, exp)
	}
}

// -------------------------------------------------------------- state ---

// bGenState builds a random state request (and its reference arguments):
// mostly well formed, with the mismatches SGLang's disaggregation/{nixl,mori}/conn.py treats as errors
// or truncates mixed in.
func bGenState(r *rand.Rand) (StateRequest, map[string]any) {
	var a bAddrs
	var req StateRequest
	// Half of the cases are clean; the other half mix in the mismatches
	// SGLang's disaggregation/{nixl,mori}/conn.py rejects or truncates (rarely: odds(n) is 1 in n).
	noisy := r.Intn(2) == 0
	odds := func(n int) bool { return noisy && r.Intn(n) == 0 }
	tp := func() int { return bPick(r, 1, 2, 4) }
	t := &req.Topology
	t.PrefillTPSize = tp()
	t.DecodeTPSize = t.PrefillTPSize
	if r.Intn(3) == 0 {
		t.DecodeTPSize = tp()
	}
	t.MLA = r.Intn(2) == 0
	if !noisy && !t.MLA {
		t.DecodeTPSize = t.PrefillTPSize // non-MLA paged state needs equal TP
	}
	t.PrefillTPRank = r.Intn(2 * t.PrefillTPSize)
	t.DecodeTPRank = r.Intn(2 * t.DecodeTPSize)
	t.PrefillPPSize = bPick(r, 1, 1, 2, 4)
	if !noisy && t.PrefillPPSize > 1 {
		t.PP.HasEnd = true
	}
	models := 8 // model layers
	if t.PrefillPPSize > 1 {
		t.PP.StartLayer = r.Intn(models - 1)
	}
	stage := 1 + r.Intn(models-t.PP.StartLayer)
	t.PP.EndLayer, t.PP.HasEnd = t.PP.StartLayer+stage, !odds(4)
	compressed := t.MLA && r.Intn(4) == 0
	if compressed {
		for l := 0; l < models; l++ {
			t.PP.CompressionRatios = append(t.PP.CompressionRatios, bPick(r, 0, 4, 128))
		}
	}
	ratioCount := func(lo, hi, ratio int) int {
		n := 0
		for _, x := range t.PP.CompressionRatios[lo:hi] {
			if x == ratio {
				n++
			}
		}
		return n
	}

	nComp := 1 + r.Intn(3)
	for i := 0; i < nComp; i++ {
		st := bPick(r, StateMamba, StateMamba, StateSWA, StateDSA, StateSWARing, StateC128State, StateMiniMaxIndexK)
		if odds(10) {
			st = "dsa_tail" // not transferred by these connectors
		}
		req.Types = append(req.Types, st)
		var nSrc, nDst int
		var srcIDs, dstIDs []int
		var dims [2][]int
		var conv [][]int
		var outer []int
		var srcLens, dstLens []uint64
		switch st {
		case StateMamba:
			nSrc = 1 + r.Intn(3)
			nDst = nSrc
			if odds(4) {
				nDst = max(0, nSrc+bPick(r, -1, 1))
			}
			withConv := r.Intn(3) == 0
			for k := 0; k < max(nSrc, nDst); k++ {
				heads := 8 * (1 + r.Intn(3))
				b := uint64(bPick(r, 1, 2, 16))
				o := 1
				if withConv {
					o = 1 + r.Intn(3)
				}
				sd, dd := heads/t.PrefillTPSize, heads/t.DecodeTPSize
				if k < nSrc {
					srcLens = append(srcLens, uint64(sd*o)*b)
					dims[0] = append(dims[0], sd)
					outer = append(outer, o)
					if withConv && r.Intn(2) == 0 {
						conv = append(conv, []int{heads / 2, heads / 4, heads / 4})
					} else {
						conv = append(conv, nil)
					}
				}
				if k < nDst {
					dstLens = append(dstLens, uint64(dd*o)*b)
					dims[1] = append(dims[1], dd)
				}
			}
			if !withConv {
				conv, outer = nil, nil
			}
			if odds(3) {
				dims[r.Intn(2)] = nil
			}
			if r.Intn(6) == 0 && nSrc > 0 {
				srcIDs, dstIDs = rankSeq(nSrc), rankSeq(nDst)
				if r.Intn(2) == 0 {
					r.Shuffle(len(dstIDs), func(x, y int) { dstIDs[x], dstIDs[y] = dstIDs[y], dstIDs[x] })
				}
			}
		default:
			mha := !t.MLA && st != StateMiniMaxIndexK
			layers := stage
			switch {
			case compressed && st != StateMiniMaxIndexK:
				// Decode holds the whole model in the layout of the
				// component; prefill holds its stage's share.
				all := func(lo, hi int) int { return ratioCount(lo, hi, 4) }
				s, e := t.PP.StartLayer, t.PP.EndLayer
				switch st {
				case StateC128State:
					nDst, nSrc = ratioCount(0, models, 128), ratioCount(s, e, 128)
				case StateSWARing:
					nDst, nSrc = models, e-s
				case StateSWA:
					nDst, nSrc = models+2*all(0, models), (e-s)+2*all(s, e)
				default:
					nDst = 2*all(0, models) + ratioCount(0, models, 128)
					nSrc = 2*all(s, e) + ratioCount(s, e, 128)
				}
				if odds(4) {
					nSrc++
				}
			case mha:
				nSrc = 2 * layers
				switch r.Intn(4) {
				case 0: // draft layers on decode
					if t.PP.StartLayer == 0 && layers > 1 {
						nDst = 2 * (layers + 1 + r.Intn(layers-1))
					} else {
						nDst = nSrc
					}
				case 1:
					nDst = 2 * (t.PP.StartLayer + layers + r.Intn(3))
				default:
					nDst = nSrc
				}
				if odds(5) {
					nDst = 2 * max(0, t.PP.StartLayer+layers-1)
				}
			default:
				nSrc = layers
				nDst = bPick(r, nSrc, nSrc, t.PP.StartLayer+layers+r.Intn(3), max(0, t.PP.StartLayer+layers-1))
			}
			lenCount := nSrc
			if mha && r.Intn(3) == 0 {
				lenCount = nSrc / 2 // the V half reads the K layer's length
			}
			if odds(6) {
				lenCount = max(0, lenCount-1)
			}
			for k := 0; k < lenCount; k++ {
				srcLens = append(srcLens, uint64(bPick(r, 0, 64, 128, 256, 256)))
			}
			if r.Intn(8) == 0 && nSrc > 0 && !compressed {
				srcIDs, dstIDs = rankSeq(nSrc), rankSeq(max(nSrc, nDst))
				nDst = len(dstIDs)
			}
		}
		req.Src.Ptrs = append(req.Src.Ptrs, nil)
		req.Dst.Ptrs = append(req.Dst.Ptrs, nil)
		for k := 0; k < nSrc; k++ {
			req.Src.Ptrs[i] = append(req.Src.Ptrs[i], a.get())
		}
		for k := 0; k < nDst; k++ {
			req.Dst.Ptrs[i] = append(req.Dst.Ptrs[i], a.get())
		}
		if st == StateMamba && nSrc > 0 && odds(6) {
			req.Src.Ptrs[i][0] = 0 // unregistered tensor: NIXL skips it
		}
		req.Src.ItemLens = append(req.Src.ItemLens, srcLens)
		req.Dst.ItemLens = append(req.Dst.ItemLens, dstLens)
		req.Src.DimPerTensor = append(req.Src.DimPerTensor, dims[0])
		req.Dst.DimPerTensor = append(req.Dst.DimPerTensor, dims[1])
		req.Src.ConvShardGroups = append(req.Src.ConvShardGroups, conv)
		req.Src.SliceOuterCounts = append(req.Src.SliceOuterCounts, outer)
		req.Src.LayerIDs = append(req.Src.LayerIDs, srcIDs)
		req.Dst.LayerIDs = append(req.Dst.LayerIDs, dstIDs)

		// Indices.
		var si, di []int32
		if st == StateMamba {
			si = []int32{int32(r.Intn(6))}
			di = []int32{int32(r.Intn(6))}
			if odds(2) {
				switch r.Intn(3) {
				case 0:
					si = append(si, 3)
				case 1:
					di = nil
				case 2:
					si = nil
				}
			}
		} else {
			n := 1 + r.Intn(8)
			s0, d0 := int32(r.Intn(20)), int32(r.Intn(20))
			for k := 0; k < n; k++ {
				if r.Intn(3) == 0 {
					s0 += int32(1 + r.Intn(3))
				}
				if r.Intn(3) == 0 {
					d0 += int32(1 + r.Intn(3))
				}
				si = append(si, s0)
				di = append(di, d0)
				s0++
				d0++
			}
			if odds(2) {
				switch r.Intn(3) {
				case 0:
					di = di[:len(di)-1]
				case 1:
					si = si[:len(si)-1]
				case 2:
					di = nil
				}
			}
		}
		req.SrcIndices = append(req.SrcIndices, si)
		req.DstIndices = append(req.DstIndices, di)
	}
	// Occasionally a decode that registered a different component count.
	if odds(8) {
		req.Dst.Ptrs = append(req.Dst.Ptrs, []uint64{a.get()})
	}

	topo := map[string]any{
		"p_tp": t.PrefillTPSize, "p_rank": t.PrefillTPRank, "d_tp": t.DecodeTPSize, "d_rank": t.DecodeTPRank,
		"mla": t.MLA, "pp_size": t.PrefillPPSize,
		"pp": map[string]any{"start": t.PP.StartLayer, "ratios": t.PP.CompressionRatios},
	}
	if t.PP.HasEnd {
		topo["pp"].(map[string]any)["end"] = t.PP.EndLayer
	}
	side := func(b *StateBuffers) map[string]any {
		return map[string]any{"ptrs": b.Ptrs, "item_lens": b.ItemLens, "dims": b.DimPerTensor,
			"conv": b.ConvShardGroups, "outer": b.SliceOuterCounts, "layer_ids": b.LayerIDs}
	}
	return req, map[string]any{
		"types": req.Types, "src": side(&req.Src), "dst": side(&req.Dst),
		"si": req.SrcIndices, "di": req.DstIndices, "topo": topo,
	}
}

func TestStateMatchesReference(t *testing.T) {
	for _, style := range []string{"nixl", "mori"} {
		t.Run(style, func(t *testing.T) {
			r := rand.New(rand.NewSource(2))
			var reqs []StateRequest
			var cases []bRefCase
			count := 1500
			if raceEnabled {
				count = 500 // the first 500 of the same sequence
			}
			for n := 0; n < count; n++ {
				req, args := bGenState(r)
				reqs = append(reqs, req)
				cases = append(cases, bRefCase{"state_" + style, args})
			}
			res := bRunRef(t, cases)
			var errs, plans, copies, stricter int
			for i := range reqs {
				var sps []StatePlan
				var err error
				if style == "nixl" {
					sps, err = PlanStateNIXL(&reqs[i])
				} else {
					sps, err = PlanStateMORI(&reqs[i])
				}
				name := fmt.Sprintf("case %d: %s", i, bJSON(cases[i].Args))
				if err != nil && res[i].Err == "" && style == "nixl" && bCrossesKV(&reqs[i]) {
					// Deliberately stricter than SGLang's disaggregation/{nixl,mori}/conn.py: its draft
					// rule would pair K layers with V regions (PairKVRegions).
					stricter++
					continue
				}
				if (err != nil) != (res[i].Err != "") {
					t.Fatalf("%s\nGo error %v, reference error %q", name, err, res[i].Err)
				}
				if err != nil {
					errs++
					continue
				}
				var want []struct {
					Component int             `json:"component"`
					Path      string          `json:"path"`
					Blocks    json.RawMessage `json:"blocks"`
				}
				if err := json.Unmarshal(res[i].OK, &want); err != nil {
					t.Fatal(err)
				}
				if len(want) != len(sps) {
					t.Fatalf("%s\n%d component plans, reference %d", name, len(sps), len(want))
				}
				for k, sp := range sps {
					if sp.Component != want[k].Component || sp.Plan.Path != want[k].Path {
						t.Fatalf("%s\ncomponent %d path %s, reference component %d path %s", name, sp.Component, sp.Plan.Path, want[k].Component, want[k].Path)
					}
					if err := sp.Plan.Validate(); err != nil {
						t.Fatalf("%s\ninvalid plan: %v", name, err)
					}
					got, exp := bPlanBlocks(&sp.Plan), bDecodeBlocks(t, want[k].Blocks)
					if !reflect.DeepEqual(got, exp) {
						t.Fatalf("%s\ncomponent %d blocks differ\n go: %v\nref: %v", name, sp.Component, got, exp)
					}
					plans++
					copies += len(got)
				}
			}
			// The generator must exercise both outcomes substantially.
			if errs < count/15 || plans < count/3 {
				t.Fatalf("weak coverage: %d errors, %d component plans", errs, plans)
			}
			t.Logf("%d cases: %d errors, %d component plans, %d merged blocks, %d stricter than SGLang's disaggregation/{nixl,mori}/conn.py", len(reqs), errs, plans, copies, stricter)
		})
	}
}

// bCrossesKV reports whether a component of req would be paired by the
// reference's MHA draft rule (L < T, T % L != 0) with a decode K slice that
// runs into the V half (start+L > T): SGLang's disaggregation/{nixl,mori}/conn.py then moves K layers into
// V regions, where kvhost refuses.
func bCrossesKV(req *StateRequest) bool {
	t := req.Topology
	for i, st := range req.Types {
		if st == StateMamba || st == StateMiniMaxIndexK || t.MLA || i >= len(req.Src.Ptrs) || i >= len(req.Dst.Ptrs) {
			continue
		}
		if len(bAt(req.Src.LayerIDs, i)) > 0 || len(bAt(req.Dst.LayerIDs, i)) > 0 {
			continue
		}
		l, tt := len(req.Src.Ptrs[i])/2, len(req.Dst.Ptrs[i])/2
		if l > 0 && l < tt && tt%l != 0 && t.PP.StartLayer+l > tt {
			return true
		}
	}
	return false
}

func bAt[T any](xs [][]T, i int) []T {
	if i < len(xs) {
		return xs[i]
	}
	return nil
}

func bJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return err.Error()
	}
	return string(b)
}
