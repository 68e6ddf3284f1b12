package planjson

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"slices"
	"testing"

	"github.com/kvhost/kvhost/planner"
	"github.com/kvhost/kvhost/planner/internal/plantest"
)

// This file checks the SGLang NIXL and MORI planners against
// testdata/ref_sglang.py, a line-by-line numpy re-expression of the
// reference connectors' math, on random consistent geometries: same bytes
// to the same places, byte for byte, and an error exactly when the
// reference raises.

// The byte-range helpers, shared with planner's tests.

type block = plantest.Block

var canonical = plantest.Canonical

// planBlocks expands a plan (or one part of it) into blocks.
func planBlocks(p *planner.Plan, part int) []block {
	q := *p
	if part >= 0 && len(p.Parts) > 0 {
		pt := p.Parts[part]
		q.Copies = p.Copies[pt.Start:pt.End]
		q.Parts = nil
	}
	return plantest.Blocks(q.ForEachBlock)
}

// refResult is one answer of ref_sglang.py.
type refResult struct {
	Error   string        `json:"error"`
	Parts   [][][3]uint64 `json:"parts"`
	Prepped []refPrepped  `json:"prepped"`
}

// refPrepped is one make_prepped_xfer call of SGLang's disaggregation/{nixl,mori}/conn.py: both dlists
// as [addr, len] and both index arrays.
type refPrepped struct {
	SrcList [][2]uint64 `json:"src_list"`
	DstList [][2]uint64 `json:"dst_list"`
	SrcIdx  []int32     `json:"src_idx"`
	DstIdx  []int32     `json:"dst_idx"`
}

// refCase is a request plus what to ask ref_sglang.py for.
type refCase struct {
	KVRequest
	WantPrepped bool `json:"want_prepped,omitempty"`
}

// runReference runs ref_sglang.py on requests.
func runReference(t testing.TB, reqs []KVRequest) []refResult {
	t.Helper()
	cases := make([]refCase, len(reqs))
	for i, r := range reqs {
		cases[i] = refCase{KVRequest: r}
	}
	return runReferenceCases(t, cases)
}

// runReferenceCases runs ref_sglang.py on cases.
func runReferenceCases(t testing.TB, cases []refCase) []refResult {
	t.Helper()
	in, err := json.Marshal(cases)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("/usr/bin/python3", "testdata/ref_sglang.py")
	cmd.Stdin = bytes.NewReader(in)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("reference script: %v\n%s\n(needs /usr/bin/python3 with numpy: scripts/install-test-deps.sh)", err, stderr.String())
	}
	var res []refResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("reference output: %v", err)
	}
	if len(res) != len(cases) {
		t.Fatalf("reference answered %d of %d cases", len(res), len(cases))
	}
	return res
}

// planKVRequest plans a KV request through the JSON layer (the path
// `kvhost plan` takes).
func planKVRequest(req KVRequest) (*planner.Plan, error) {
	raw, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	p, _, err := PlanRequest(raw)
	return p, err
}

// geomGen draws consistent SGLang geometries.
type geomGen struct{ r *rand.Rand }

func (g geomGen) pick(xs ...int) int { return xs[g.r.IntN(len(xs))] }

// pages draws n distinct page indices below numPages, in an order with
// some runs and some jumps.
func (g geomGen) pages(n int, numPages uint64) []int64 {
	perm := g.r.Perm(int(numPages))
	if g.r.IntN(2) == 0 {
		slices.Sort(perm[:n])
	}
	out := make([]int64, n)
	for i := range out {
		out[i] = int64(perm[i])
	}
	return out
}

// regions lays out count regions of the given item lengths from base,
// with gaps, and returns their pointers.
func (g geomGen) ptrs(base uint64, items []uint64, numPages uint64) []uint64 {
	out := make([]uint64, len(items))
	addr := base
	for i, it := range items {
		out[i] = addr
		addr += it*numPages + uint64(g.pick(0, 64, 4096))
	}
	return out
}

// kvCase draws one request of style, consistent enough that SGLang's disaggregation/{nixl,mori}/conn.py
// runs it without error, avoiding the one layout where kvhost deliberately
// differs (the prepped equal-TP path pairs regions positionally in the
// reference, by layer in kvhost).
func (g geomGen) kvCase(style string) KVRequest {
	r := g.r
	req := KVRequest{Style: style, Attention: "mha", PageSize: g.pick(1, 2, 4)}
	mla := r.IntN(4) == 0
	if mla {
		req.Attention = "mla"
	}
	heads := g.pick(1, 2, 4, 8)
	ptp, dtp := g.pick(1, 2, 4, 8), g.pick(1, 2, 4, 8)
	if mla || r.IntN(3) == 0 {
		dtp = ptp
	}
	equal := mla || ptp == dtp
	prepped := style == StyleSGLangNIXL && (!equal || r.IntN(4) != 0)
	positional := prepped && equal // reference pairs dst[:n_src]

	totalLayers := 1 + r.IntN(4)
	stageLayers, start := totalLayers, 0
	decLayers := totalLayers // decode PP 1: every layer
	if totalLayers > 1 && r.IntN(3) == 0 {
		stageLayers = 1 + r.IntN(totalLayers-1)
		start = r.IntN(totalLayers - stageLayers + 1)
		if positional || r.IntN(2) == 0 {
			// decode PP equal to prefill PP: it holds the same stage
			decLayers = stageLayers
			if style == StyleSGLangMORI || positional && r.IntN(2) == 0 {
				start = 0 // MORI slices [start, start+L) of decode's stage
			}
		}
	}
	draft := 0 // decode-only draft layers (spec dec), equal-TP NIXL without PP
	if style == StyleSGLangNIXL && equal && !mla && stageLayers == totalLayers && totalLayers > 1 && r.IntN(4) == 0 {
		draft = 1 + r.IntN(totalLayers-1)
	}
	headBytes := uint64(g.pick(2, 4, 8))
	page := uint64(req.PageSize)
	srcHeads, dstHeads := max(1, heads/ptp), max(1, heads/dtp)
	srcItem := page * uint64(srcHeads) * headBytes
	dstItem := page * uint64(dstHeads) * headBytes
	if mla {
		srcItem, dstItem = page*headBytes*8, page*headBytes*8
	}
	req.TotalKVHeads = heads
	if heads >= ptp && r.IntN(2) == 0 {
		req.TotalKVHeads = 0 // default: kv_head_num * tp_size
	}
	srcPages, dstPages := uint64(4+r.IntN(9)), uint64(4+r.IntN(9))
	perLayer := 2
	if mla {
		perLayer = 1
	}
	dstStride := dstItem
	if prepped && equal && r.IntN(4) == 0 {
		dstStride = dstItem * 2 // HiSparse: wider decode slots
	}
	srcItems := slices.Repeat([]uint64{srcItem}, perLayer*stageLayers)
	dstItems := slices.Repeat([]uint64{dstStride}, perLayer*(decLayers+draft))
	req.Prefill = KVSideJSON{
		TPSize: ptp, TPRank: r.IntN(ptp), KVHeadNum: srcHeads,
		KVItemLens: srcItems, NumPages: srcPages, StartLayer: start,
	}
	req.Decode = KVSideJSON{
		TPSize: dtp, TPRank: r.IntN(dtp), KVHeadNum: dstHeads,
		KVItemLens: dstItems, NumPages: dstPages,
	}
	req.Prefill.KVPtrs = g.ptrs(1<<32, srcItems, srcPages)
	req.Decode.KVPtrs = g.ptrs(1<<40, dstItems, dstPages)
	if style == StyleSGLangNIXL {
		if !prepped {
			f := false
			req.Prepped = &f
		}
		if r.IntN(5) == 0 {
			req.Prefill.MemKinds = slices.Repeat([]string{"DRAM"}, len(srcItems))
		}
		if prepped && equal && draft == 0 && decLayers == stageLayers && r.IntN(3) == 0 {
			kinds := make([]string, len(dstItems))
			for i := range kinds {
				kinds[i] = []string{"VRAM", "DRAM"}[r.IntN(2)]
			}
			req.Decode.MemKinds = kinds
		}
	}
	n := 1 + r.IntN(int(min(srcPages, dstPages)))
	req.PrefillPages = g.pages(n, srcPages)
	req.DecodePages = g.pages(n, dstPages)
	if style == StyleSGLangNIXL && r.IntN(6) == 0 && n > 1 {
		req.PrefillPages = append(req.PrefillPages, int64(r.IntN(int(srcPages)))) // truncated by the worker
	}
	return req
}

func TestSGLangMatchesReference(t *testing.T) {
	g := geomGen{rand.New(rand.NewPCG(1, 2))}
	var cases []KVRequest
	for i := 0; i < 400; i++ {
		style := StyleSGLangNIXL
		if i%3 == 2 {
			style = StyleSGLangMORI
		}
		cases = append(cases, g.kvCase(style))
	}
	ref := runReference(t, referenceView(cases))
	paths := map[string]int{}
	for i, c := range cases {
		p, err := planKVRequest(c)
		if ref[i].Error != "" {
			t.Errorf("case %d: reference raised %q; the generator should only draw valid geometry", i, ref[i].Error)
			continue
		}
		if err != nil {
			raw, _ := json.Marshal(c)
			t.Errorf("case %d: %v\n%s", i, err, raw)
			continue
		}
		paths[p.Path]++
		if err := p.Validate(); err != nil {
			t.Errorf("case %d: %v", i, err)
		}
		nparts := max(1, len(p.Parts))
		if len(ref[i].Parts) == 0 && p.Bytes() == 0 {
			continue
		}
		if len(ref[i].Parts) != nparts {
			t.Errorf("case %d (%s): %d parts, reference %d", i, p.Path, nparts, len(ref[i].Parts))
			continue
		}
		var refDescs uint64
		for part := 0; part < nparts; part++ {
			var want []block
			for _, d := range ref[i].Parts[part] {
				want = append(want, block{Src: d[0], Dst: d[1], Len: d[2]})
			}
			refDescs += uint64(len(want))
			got := planBlocks(p, part-boolInt(len(p.Parts) == 0))
			if cg, cw := canonical(got), canonical(want); !slices.Equal(cg, cw) {
				raw, _ := json.Marshal(c)
				t.Errorf("case %d (%s) part %d: plan differs from reference\n got  %v\n want %v\n%s", i, p.Path, part, head(cg), head(cw), raw)
			}
		}
		if p.ReferenceDescriptors != refDescs {
			t.Errorf("case %d (%s): ReferenceDescriptors %d, reference handed %d", i, p.Path, p.ReferenceDescriptors, refDescs)
		}
	}
	for _, path := range []string{planner.PathNIXLPreppedEqualTP, planner.PathNIXLPreppedMLA, planner.PathNIXLPreppedSlice, planner.PathNIXLPreppedMixed,
		planner.PathNIXLRuns, planner.PathNIXLRunsMLA, planner.PathMORIRuns, planner.PathMORIRunsMLA, planner.PathMORITPSlice} {
		if paths[path] < 3 {
			t.Errorf("path %s drawn %d times; widen the generator", path, paths[path])
		}
	}
	t.Logf("paths compared: %v", paths)
}

// referenceView returns the requests to hand SGLang's disaggregation/{nixl,mori}/conn.py so that its
// answer is the one kvhost must match. kvhost deliberately differs in one
// place: when decode TP exceeds the KV heads (replicated decode heads) and
// prefill TP is smaller, SGLang's disaggregation/{nixl,mori}/conn.py picks the prefill head group with the
// decode rank itself, kvhost with the head that rank holds (rank /
// (decode_tp / heads)). Handing SGLang's disaggregation/{nixl,mori}/conn.py that rank instead yields
// kvhost's bytes; nothing else about the rank enters the slice math.
func referenceView(reqs []KVRequest) []KVRequest {
	out := slices.Clone(reqs)
	for i := range out {
		r := &out[i]
		total := r.TotalKVHeads
		if total <= 0 {
			total = r.Prefill.KVHeadNum * r.Prefill.TPSize
		}
		p, d := r.Prefill.TPSize, r.Decode.TPSize
		if r.Attention == "mha" && p < d && d > total && total > 0 {
			r.Decode.TPRank = (r.Decode.TPRank % d) / (d / total)
		}
	}
	return out
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func head(bs []block) string {
	if len(bs) > 6 {
		return fmt.Sprintf("%v ... (%d blocks)", bs[:6], len(bs))
	}
	return fmt.Sprint(bs)
}

// dlistEntries materializes a dlist as [addr, len] pairs.
func dlistEntries(d *planner.Dlist) [][2]uint64 {
	var out [][2]uint64
	d.ForEach(func(a, l uint64) bool {
		out = append(out, [2]uint64{a, l})
		return true
	})
	return out
}

// TestSGLangPreppedMatchesReference checks the prepped representation:
// every dlist entry and every index array equals SGLang's disaggregation/{nixl,mori}/conn.py's, and where
// kvhost refuses to prepare a list, SGLang's disaggregation/{nixl,mori}/conn.py's list does hold a
// descriptor outside its region (NIXL would reject it).
func TestSGLangPreppedMatchesReference(t *testing.T) {
	g := geomGen{rand.New(rand.NewPCG(7, 8))}
	var cases []refCase
	for len(cases) < 250 {
		c := g.kvCase(StyleSGLangNIXL)
		if c.Prepped != nil {
			continue
		}
		cases = append(cases, refCase{KVRequest: c, WantPrepped: true})
	}
	var reqs []KVRequest
	for _, c := range cases {
		reqs = append(reqs, c.KVRequest)
	}
	refCases := slices.Clone(cases)
	for i, r := range referenceView(reqs) {
		refCases[i].KVRequest = r
	}
	ref := runReferenceCases(t, refCases)
	checked, refused := 0, 0
	for i, c := range cases {
		raw, _ := json.Marshal(c.KVRequest)
		geo, src, dst, _, err := sglangKVRequest(raw, StyleSGLangNIXL)
		if err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		n, err := planner.NewNIXLKV(geo, true)
		if err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		if ref[i].Error != "" {
			t.Fatalf("case %d: reference: %s", i, ref[i].Error)
		}
		pk, err := n.Prepped()
		if err != nil {
			refused++
			outside := false
			srcRegions, _ := n.Regions()
			for _, e := range ref[i].Prepped[0].SrcList {
				in := false
				for _, r := range srcRegions {
					if e[0] >= r.Addr && e[0]+e[1] <= r.Addr+r.Len {
						in = true
						break
					}
				}
				outside = outside || !in
			}
			if !outside {
				t.Errorf("case %d (%s): kvhost refused the prepped lists (%v) but every reference source descriptor is inside a region\n%s", i, n.Path(), err, raw)
			}
			continue
		}
		if len(pk.Parts) != len(ref[i].Prepped) && len(src) > 0 {
			t.Errorf("case %d (%s): %d prepped parts, reference %d", i, n.Path(), len(pk.Parts), len(ref[i].Prepped))
			continue
		}
		for part := range ref[i].Prepped {
			want := ref[i].Prepped[part]
			pp := &pk.Parts[part]
			if got := dlistEntries(&pp.Src); !slices.Equal(got, want.SrcList) {
				t.Errorf("case %d (%s) part %d: source dlist differs (%d entries, reference %d)\n%s", i, n.Path(), part, len(got), len(want.SrcList), raw)
			}
			if got := dlistEntries(&pp.Dst); !slices.Equal(got, want.DstList) {
				t.Errorf("case %d (%s) part %d: destination dlist differs (%d entries, reference %d)\n%s", i, n.Path(), part, len(got), len(want.DstList), raw)
			}
			si, di, err := n.Indices(pk, part, nil, nil, src, dst)
			if err != nil {
				t.Errorf("case %d: Indices: %v", i, err)
				continue
			}
			if !slices.Equal(si, want.SrcIdx) || !slices.Equal(di, want.DstIdx) {
				t.Errorf("case %d (%s) part %d: indices differ\n got %v / %v\nwant %v / %v", i, n.Path(), part, si, di, want.SrcIdx, want.DstIdx)
			}
		}
		checked++
	}
	if checked < 150 || refused == 0 {
		t.Errorf("checked %d cases, %d refused; widen the generator", checked, refused)
	}
	t.Logf("prepped cases checked: %d, refused as NIXL would: %d", checked, refused)
}
