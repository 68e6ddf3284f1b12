package planner

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"os/exec"
	"reflect"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/wire/vllm"
)

// Reference equivalence: random geometries and requests run through
// testdata/vllm_ref.py, an independent restatement of vLLM 0.13.0's
// descriptor math in numpy, and through VLLMReader. Both must agree on
// errors, both descriptor lists, both id arrays, and the plan must move
// exactly the bytes those ids name.

type vllmRefSide struct {
	BaseAddrs []uint64 `json:"base_addrs"`
	BlockLens []uint64 `json:"block_lens"`
	NumBlocks int      `json:"num_blocks"`
	BlockSize int      `json:"block_size"`
	Layout    string   `json:"layout"`
	DeviceID  uint64   `json:"device_id"`
}

type vllmRefCase struct {
	Local           vllmRefSide `json:"local"`
	Remote          vllmRefSide `json:"remote"`
	TPRank          int         `json:"tp_rank"`
	TPSize          int         `json:"tp_size"`
	RemoteTPSize    int         `json:"remote_tp_size"`
	MLA             bool        `json:"mla"`
	BlocksFirst     bool        `json:"blocks_first"`
	TotalKVHeads    int         `json:"total_kv_heads"`
	Windows         []*int      `json:"windows"`
	Permute         bool        `json:"permute"`
	KernelFactor    int         `json:"kernel_factor"`
	LocalBlockIDs   []int32     `json:"local_block_ids"`
	RemoteBlockIDs  []int32     `json:"remote_block_ids"`
	RemoteRequestID string      `json:"remote_request_id"`
}

type vllmRefResult struct {
	Error       string      `json:"error"`
	NotifyOnly  bool        `json:"notify_only"`
	TPRatio     int         `json:"tp_ratio"`
	RemoteRank  int         `json:"remote_rank"`
	Notif       string      `json:"notif"`
	LocalDescs  [][3]uint64 `json:"local_descs"`
	RemoteDescs [][3]uint64 `json:"remote_descs"`
	LocalIDs    []int32     `json:"local_ids"`
	RemoteIDs   []int32     `json:"remote_ids"`
}

func vPick[T any](rng *rand.Rand, xs ...T) T { return xs[rng.IntN(len(xs))] }

// genVLLMRefCase draws one decode rank's pull: a model (heads, layers, head
// bytes), both sides' TP and block sizes, usually valid and sometimes broken
// in one of the ways vLLM's kv_connector/v1/nixl_connector.py refuses, and a request.
func genVLLMRefCase(rng *rand.Rand) vllmRefCase {
	c := vllmRefCase{KernelFactor: vPick(rng, 1, 1, 1, 2), RemoteRequestID: "req-1"}
	c.MLA = rng.IntN(4) == 0
	c.BlocksFirst = !c.MLA && rng.IntN(3) == 0
	k := vPick(rng, 1, 2, 4, 8)
	c.TotalKVHeads = k
	ptp := vPick(rng, 1, 2, 4)
	ratio := vPick(rng, 1, 2, 4)
	c.RemoteTPSize, c.TPSize = ptp, ptp*ratio
	c.TPRank = rng.IntN(c.TPSize)
	pbs := vPick(rng, 2, 4, 8)
	bsr := vPick(rng, 1, 1, 2, 4)
	c.Local.BlockSize, c.Remote.BlockSize = pbs*bsr, pbs
	layers := 1 + rng.IntN(3)
	regions := layers
	if !c.MLA && !c.BlocksFirst {
		regions = 2 * layers
	}
	hb := uint64(vPick(rng, 2, 4, 6))
	dh, ph := uint64(max(1, k/c.TPSize)), uint64(max(1, k/ptp))
	kv := uint64(1)
	if c.BlocksFirst {
		kv = 2
	}
	c.Local.NumBlocks = (2 + rng.IntN(10)) * c.KernelFactor
	c.Remote.NumBlocks = (2 + rng.IntN(20)) * c.KernelFactor
	if rng.IntN(3) == 0 {
		// Windows need decode blocks × ratio == prefill blocks for the
		// reference's swapped engine ids to be harmless.
		c.Remote.NumBlocks = c.Local.NumBlocks * bsr
		nw := layers
		c.Windows = make([]*int, nw)
		for i := range c.Windows {
			if rng.IntN(2) == 0 {
				w := 1 + rng.IntN(4)
				c.Windows[i] = &w
			}
		}
	}
	for i := range regions {
		c.Local.BaseAddrs = append(c.Local.BaseAddrs, 0x1000_0000+uint64(i)<<20+uint64(rng.IntN(4))*64)
		c.Remote.BaseAddrs = append(c.Remote.BaseAddrs, 0x7000_0000+uint64(i)<<20+uint64(rng.IntN(4))*64)
		if c.MLA {
			lb := uint64(vPick(rng, 4, 6, 8, 12))
			c.Local.BlockLens = append(c.Local.BlockLens, uint64(c.Local.BlockSize)*lb)
			c.Remote.BlockLens = append(c.Remote.BlockLens, uint64(pbs)*lb)
		} else {
			c.Local.BlockLens = append(c.Local.BlockLens, kv*dh*uint64(c.Local.BlockSize)*hb)
			c.Remote.BlockLens = append(c.Remote.BlockLens, kv*ph*uint64(pbs)*hb)
		}
	}
	c.Local.Layout, c.Remote.Layout = "HND", "HND"
	c.Local.DeviceID, c.Remote.DeviceID = uint64(rng.IntN(8)), uint64(rng.IntN(8))

	if rng.IntN(4) == 0 {
		switch rng.IntN(8) {
		case 0:
			c.Remote.Layout = "NHD"
		case 1:
			c.Local.Layout = "NHD"
			c.Permute = rng.IntN(4) != 0
		case 2:
			c.Remote.BlockLens[rng.IntN(regions)] += hb
		case 3:
			c.Remote.BlockSize = c.Local.BlockSize * 2
		case 4:
			c.Local.BlockSize = pbs*bsr + 1
		case 5:
			c.Remote.BaseAddrs = c.Remote.BaseAddrs[1:]
			c.Remote.BlockLens = c.Remote.BlockLens[1:]
		case 6:
			c.RemoteTPSize = c.TPSize * 2
		case 7:
			c.TPSize = ptp*ratio + 1
			c.TPRank = rng.IntN(c.TPSize)
		}
	}

	// Request: remote blocks (logical), then the decode's unhashed blocks.
	nbRl, nbLl := c.Remote.NumBlocks/c.KernelFactor, c.Local.NumBlocks/c.KernelFactor
	nr := rng.IntN(min(nbRl, 10) + 1)
	c.RemoteBlockIDs = vDrawIDs(rng, nr, nbRl)
	need := nr
	if bsr > 1 {
		need = (nr + bsr - 1) / bsr
	}
	nl := min(need, nbLl)
	switch rng.IntN(6) {
	case 0:
		nl = 0 // full prefix hit
	case 1:
		nl = rng.IntN(nl + 1) // partial hit
	}
	c.LocalBlockIDs = vDrawIDs(rng, nl, nbLl)
	if rng.IntN(20) == 0 && nl > 0 {
		c.LocalBlockIDs[rng.IntN(nl)] = int32(nbLl + rng.IntN(3))
	}
	if rng.IntN(20) == 0 && nr > 0 {
		c.RemoteBlockIDs[rng.IntN(nr)] = int32(nbRl + rng.IntN(3))
	}
	return c
}

// vDrawIDs returns n distinct ids below limit: a consecutive run, or random.
func vDrawIDs(rng *rand.Rand, n, limit int) []int32 {
	out := make([]int32, 0, n)
	if rng.IntN(2) == 0 {
		start := rng.IntN(limit - n + 1)
		for i := range n {
			out = append(out, int32(start+i))
		}
		return out
	}
	for _, v := range rng.Perm(limit)[:n] {
		out = append(out, int32(v))
	}
	return out
}

func (c *vllmRefCase) reader() (*VLLMReader, error) {
	local := VLLMDecode{
		Agent: VLLMAgent{BaseAddrs: c.Local.BaseAddrs, BlockLens: c.Local.BlockLens, NumBlocks: c.Local.NumBlocks,
			BlockSize: c.Local.BlockSize, KVCacheLayout: c.Local.Layout, DeviceID: c.Local.DeviceID},
		TPRank: c.TPRank, TPSize: c.TPSize, MLA: c.MLA, BlocksFirst: c.BlocksFirst, TotalKVHeads: c.TotalKVHeads,
		EnablePermuteLocalKV: c.Permute, PhysicalBlocksPerLogical: c.KernelFactor,
	}
	if c.Windows != nil {
		local.BlockWindows = make([]int, len(c.Windows))
		for i, w := range c.Windows {
			if w != nil {
				local.BlockWindows[i] = *w
			}
		}
	}
	remote := VLLMAgent{BaseAddrs: c.Remote.BaseAddrs, BlockLens: c.Remote.BlockLens, NumBlocks: c.Remote.NumBlocks,
		BlockSize: c.Remote.BlockSize, KVCacheLayout: c.Remote.Layout, DeviceID: c.Remote.DeviceID}
	return NewVLLMReader(local, remote, c.RemoteTPSize)
}

func runVLLMRef(t *testing.T, cases []vllmRefCase) []vllmRefResult {
	t.Helper()
	in, err := json.Marshal(cases)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("/usr/bin/python3", "testdata/vllm_ref.py")
	cmd.Stdin = bytes.NewReader(in)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("reference script: %v\n%s\n(needs /usr/bin/python3 with numpy: scripts/install-test-deps.sh)", err, stderr.String())
	}
	var out []vllmRefResult
	if err := json.Unmarshal(stdout.Bytes(), &out); err != nil || len(out) != len(cases) {
		t.Fatalf("reference output: %v (%d results for %d cases)", err, len(out), len(cases))
	}
	return out
}

func TestVLLMReferenceEquivalence(t *testing.T) {
	const n = 600
	rng := rand.New(rand.NewPCG(42, 7))
	cases := make([]vllmRefCase, n)
	for i := range cases {
		cases[i] = genVLLMRefCase(rng)
	}
	want := runVLLMRef(t, cases)
	var errs, notify, planned int
	coverage := map[string]int{}
	for i := range cases {
		c, w := &cases[i], want[i]
		fail := func(format string, args ...any) {
			t.Helper()
			js, _ := json.Marshal(c)
			t.Fatalf("case %d: "+format+"\ncase: %s", append([]any{i}, append(args, string(js))...)...)
		}
		r, err := c.reader()
		var rd VLLMRead
		if err == nil {
			rd, err = r.Read(c.LocalBlockIDs, c.RemoteBlockIDs)
		}
		if err != nil && w.Error == "" && c.outOfRangeID() {
			// A block id past num_blocks that still indexes inside the
			// whole descriptor list: vLLM's kv_connector/v1/nixl_connector.py (and NIXL) read another
			// region's block; kvhost refuses it.
			if pe, ok := err.(*Error); ok && (strings.HasPrefix(pe.Field, "local_block_ids[") || strings.HasPrefix(pe.Field, "remote_block_ids[")) {
				errs++
				continue
			}
		}
		if (err != nil) != (w.Error != "") {
			fail("kvhost error %v, reference error %q", err, w.Error)
		}
		if err != nil {
			errs++
			continue
		}
		if r.TPRatio() != w.TPRatio || r.RemoteRank() != w.RemoteRank || vllm.ReadNotif(c.RemoteRequestID, r.TPRatio()) != w.Notif {
			fail("tp_ratio %d rank %d, reference %d %d %q", r.TPRatio(), r.RemoteRank(), w.TPRatio, w.RemoteRank, w.Notif)
		}
		if rd.NotifyOnly != w.NotifyOnly {
			fail("notify only %v, reference %v", rd.NotifyOnly, w.NotifyOnly)
		}
		p, err := planRead(r, c.LocalBlockIDs, c.RemoteBlockIDs)
		if err != nil {
			fail("Plan: %v", err)
		}
		if err := p.Validate(); err != nil {
			fail("Validate: %v", err)
		}
		if rd.NotifyOnly {
			notify++
			if len(p.Copies) != 0 {
				fail("full prefix hit plans %d copies", len(p.Copies))
			}
			continue
		}
		planned++
		coverage["mla"] += vB2I(c.MLA)
		coverage["blocks-first"] += vB2I(c.BlocksFirst)
		coverage["tp-ratio>1"] += vB2I(r.TPRatio() > 1 && !r.Replicated())
		coverage["replicated-mha"] += vB2I(r.Replicated() && !c.MLA)
		coverage["block-size-ratio>1"] += vB2I(r.BlockSizeRatio() > 1)
		coverage["windows"] += vB2I(c.Windows != nil)
		coverage["kernel-factor"] += vB2I(c.KernelFactor > 1)
		coverage["partial-hit"] += vB2I(len(rd.LocalIDs)/len(r.local.Regions) < len(c.RemoteBlockIDs)*c.KernelFactor && c.Windows == nil)
		coverage["permute"] += vB2I(r.PermuteLocalKV())
		ll, rl := r.LocalList(), r.RemoteList()
		if !vSameDescs(ll.Append(nil), ll.DeviceID, w.LocalDescs) {
			fail("local list differs:\n got %v dev %d\nwant %v", ll.Append(nil), ll.DeviceID, w.LocalDescs)
		}
		if !vSameDescs(rl.Append(nil), rl.DeviceID, w.RemoteDescs) {
			fail("remote list differs:\n got %v dev %d\nwant %v", rl.Append(nil), rl.DeviceID, w.RemoteDescs)
		}
		if !reflect.DeepEqual(rd.LocalIDs, w.LocalIDs) || !reflect.DeepEqual(rd.RemoteIDs, w.RemoteIDs) {
			fail("ids differ:\n got %v\n     %v\nwant %v\n     %v", rd.LocalIDs, rd.RemoteIDs, w.LocalIDs, w.RemoteIDs)
		}
		// vLLM's kv_connector/v1/nixl_connector.py's bytes, straight from its lists and ids.
		var ref []vByteRange
		for k := range w.LocalIDs {
			l, m := w.LocalDescs[w.LocalIDs[k]], w.RemoteDescs[w.RemoteIDs[k]]
			ref = append(ref, vByteRange{dst: l[0], src: m[0], n: l[1]})
		}
		refBytes := vSumLens(ref)
		if got, want := vPlanRanges(p), vNormalize(ref); !reflect.DeepEqual(got, want) {
			fail("plan bytes differ from vLLM's kv_connector/v1/nixl_connector.py:\n got  %v\n want %v", got, want)
		}
		if p.Bytes() != refBytes {
			fail("plan moves %d bytes, reference %d", p.Bytes(), refBytes)
		}
	}
	t.Logf("%d cases: %d planned reads, %d notify-only, %d refused by both", n, planned, notify, errs)
	t.Logf("planned reads by feature: %v", coverage)
	if planned < n/3 || errs < n/20 || notify < n/20 {
		t.Errorf("generator coverage too thin: %d planned, %d notify-only, %d errors", planned, notify, errs)
	}
	for _, f := range []string{"mla", "blocks-first", "tp-ratio>1", "replicated-mha", "block-size-ratio>1", "windows", "kernel-factor", "partial-hit", "permute"} {
		if coverage[f] < 3 {
			t.Errorf("generator covers feature %q in only %d planned reads", f, coverage[f])
		}
	}
}

func vB2I(b bool) int {
	if b {
		return 1
	}
	return 0
}

// outOfRangeID reports whether the request names a block past its side's
// (logical) block count.
func (c *vllmRefCase) outOfRangeID() bool {
	for _, id := range c.LocalBlockIDs {
		if int(id) >= c.Local.NumBlocks/c.KernelFactor {
			return true
		}
	}
	for _, id := range c.RemoteBlockIDs {
		if int(id) >= c.Remote.NumBlocks/c.KernelFactor {
			return true
		}
	}
	return false
}

func vSameDescs(got []VLLMDesc, dev uint64, want [][3]uint64) bool {
	if len(got) != len(want) {
		return false
	}
	for i, d := range got {
		if d.Addr != want[i][0] || d.Len != want[i][1] || dev != want[i][2] {
			return false
		}
	}
	return true
}

func vSumLens(rs []vByteRange) uint64 {
	var n uint64
	for _, r := range rs {
		n += r.n
	}
	return n
}
