package planner

import (
	"errors"
	"fmt"
	"sort"
	"testing"

	"pgregory.net/rapid"
)

// Property tests for vLLM pull plans over random models. Unlike the
// reference-equivalence test, these do not restate vLLM's kv_connector/v1/nixl_connector.py's offset
// arithmetic: they decode every byte address back into what it holds
// (layer, K or V, global KV head, token position, byte) from the model's
// shape alone, and require that every byte a decode rank reads lands where
// that same element belongs on the decode side.

// vModel is a model and deployment: both TP sizes, block sizes, layers.
type vModel struct {
	mla, blocksFirst bool
	heads            int      // total KV heads
	headBytes        uint64   // bytes per head per token (non-MLA)
	latentBytes      []uint64 // MLA: bytes per token, per layer
	layers           int
	ptp, dtp         int
	pbs, bsr         int // prefill block size, decode/prefill ratio
	kf               int // kernel blocks per logical block
	nbL, nbR         int // blocks per region (kernel blocks)
	windows          []int
}

func (m *vModel) regions() int {
	if m.mla || m.blocksFirst {
		return m.layers
	}
	return 2 * m.layers
}

// headsOf returns the global KV heads a rank of a TP size holds: a
// contiguous share, or one replicated head when TP exceeds the head count.
func (m *vModel) headsOf(tp, rank int) []int {
	if tp <= m.heads {
		per := m.heads / tp
		out := make([]int, per)
		for i := range out {
			out[i] = rank*per + i
		}
		return out
	}
	return []int{rank * m.heads / tp}
}

func (m *vModel) blockLen(tp, blockSize, region int) uint64 {
	if m.mla {
		return uint64(blockSize) * m.latentBytes[region]
	}
	kv := uint64(1)
	if m.blocksFirst {
		kv = 2
	}
	return kv * uint64(len(m.headsOf(tp, 0))) * uint64(blockSize) * m.headBytes
}

const (
	vPropDecodeBase  = 0x10_0000_0000
	vPropPrefillBase = 0x20_0000_0000
	vPropRegionGap   = 1 << 24
)

func (m *vModel) agents() (dec, pre VLLMAgent) {
	dbs := m.pbs * m.bsr
	dec = VLLMAgent{NumBlocks: m.nbL, BlockSize: dbs, KVCacheLayout: "HND"}
	pre = VLLMAgent{NumBlocks: m.nbR, BlockSize: m.pbs, KVCacheLayout: "HND"}
	for i := range m.regions() {
		dec.BaseAddrs = append(dec.BaseAddrs, vPropDecodeBase+uint64(i)*vPropRegionGap)
		dec.BlockLens = append(dec.BlockLens, m.blockLen(m.dtp, dbs, i))
		pre.BaseAddrs = append(pre.BaseAddrs, vPropPrefillBase+uint64(i)*vPropRegionGap)
		pre.BlockLens = append(pre.BlockLens, m.blockLen(m.ptp, m.pbs, i))
	}
	return dec, pre
}

// vElem is what one byte of KV cache holds.
type vElem struct {
	layer, kv, head int
	pos             int // token position in the request's sequence
	b               uint64
}

// locate decodes a byte address of one side. order maps a (kernel) block id
// to its index in the request's expanded block list; sub is how many
// prefill-sized sub-blocks a block holds (bsr on decode, 1 on prefill);
// first is the sequence index, in prefill blocks, of the list's first
// block.
func (m *vModel) locate(addr, base uint64, blockLens []uint64, tp, rank, sub int, order map[int]int, first int) (vElem, error) {
	if addr < base {
		return vElem{}, fmt.Errorf("address %#x below the side's regions", addr)
	}
	region := int((addr - base) / vPropRegionGap)
	if region >= len(blockLens) {
		return vElem{}, fmt.Errorf("address %#x past the side's regions", addr)
	}
	off := addr - base - uint64(region)*vPropRegionGap
	bl := blockLens[region]
	block, within := int(off/bl), off%bl
	idx, ok := order[block]
	if !ok {
		return vElem{}, fmt.Errorf("block %d of region %d is not in the request", block, region)
	}
	sb := bl / uint64(sub)
	j, q := int(within/sb), within%sb
	var e vElem
	switch {
	case m.mla:
		e.layer = region
	case m.blocksFirst:
		e.layer = region
		half := sb / 2
		e.kv, q = int(q/half), q%half
	default:
		e.layer, e.kv = region/2, region%2
	}
	var tok int
	if m.mla {
		lb := m.latentBytes[region]
		tok, e.b = int(q/lb), q%lb
	} else {
		perHead := uint64(m.pbs) * m.headBytes
		hl := int(q / perHead)
		tok, e.b = int(q%perHead/m.headBytes), q%m.headBytes
		e.head = m.headsOf(tp, rank)[hl]
	}
	e.pos = (first+idx*sub+j)*m.pbs + tok
	return e, nil
}

func vExpandIDs(ids []int32, f int) []int {
	var out []int
	for _, id := range ids {
		for k := range f {
			out = append(out, int(id)*f+k)
		}
	}
	return out
}

func vIndexOf(ids []int) map[int]int {
	out := make(map[int]int, len(ids))
	for i, id := range ids {
		out[id] = i
	}
	return out
}

func vDrawModel(t *rapid.T) vModel {
	m := vModel{
		mla:       rapid.Bool().Draw(t, "mla"),
		heads:     rapid.SampledFrom([]int{1, 2, 4, 8}).Draw(t, "heads"),
		headBytes: uint64(rapid.IntRange(1, 4).Draw(t, "headBytes")),
		layers:    rapid.IntRange(1, 3).Draw(t, "layers"),
		ptp:       rapid.SampledFrom([]int{1, 2, 4, 8}).Draw(t, "ptp"),
		pbs:       rapid.SampledFrom([]int{1, 2, 4}).Draw(t, "pbs"),
		bsr:       rapid.SampledFrom([]int{1, 2, 4}).Draw(t, "bsr"),
		kf:        rapid.IntRange(1, 2).Draw(t, "kf"),
	}
	m.blocksFirst = !m.mla && rapid.Bool().Draw(t, "blocksFirst")
	m.dtp = m.ptp * rapid.SampledFrom([]int{1, 2, 4}).Draw(t, "tpRatio")
	if m.mla {
		for range m.layers {
			m.latentBytes = append(m.latentBytes, uint64(rapid.IntRange(1, 6).Draw(t, "latent")))
		}
	}
	m.nbL = m.kf * rapid.IntRange(1, 6).Draw(t, "nbL")
	m.nbR = m.kf * rapid.IntRange(1, 12).Draw(t, "nbR")
	if rapid.Bool().Draw(t, "windowed") {
		m.windows = rapid.SliceOfN(rapid.IntRange(0, 4), m.layers, m.layers).Draw(t, "windows")
	}
	return m
}

// valid reports whether vLLM's kv_connector/v1/nixl_connector.py accepts the deployment: without
// replication (prefill TP < heads), decode ranks must not hold fewer than
// one head each.
func (m *vModel) valid() bool {
	return m.mla || m.ptp >= m.heads || m.dtp <= m.heads
}

// vDrawValidModel draws a deployment the reference accepts. It draws the
// heads, then the prefill TP, then a decode TP from what that pair allows,
// so every draw is valid by construction (no draw is thrown away, and the
// semantic property checks every example it runs).
func vDrawValidModel(t *rapid.T) vModel {
	m := vDrawModel(t)
	if !m.valid() {
		// Without replication on prefill, decode ranks hold one head at
		// least: the decode TP may grow from the prefill TP up to the
		// head count.
		var dtps []int
		for d := m.ptp; d <= m.heads; d *= 2 {
			dtps = append(dtps, d)
		}
		m.dtp = rapid.SampledFrom(dtps).Draw(t, "validDTP")
	}
	return m
}

// vDrawInvalidModel draws an MHA deployment the reference refuses: heads
// split across prefill ranks (prefill TP < heads) but fewer heads than
// decode ranks (decode TP > heads).
func vDrawInvalidModel(t *rapid.T) vModel {
	m := vDrawModel(t)
	m.mla, m.latentBytes = false, nil
	m.heads = rapid.SampledFrom([]int{2, 4, 8}).Draw(t, "invalidHeads")
	var ptps []int
	for p := 1; p < m.heads; p *= 2 {
		ptps = append(ptps, p)
	}
	m.ptp = rapid.SampledFrom(ptps).Draw(t, "invalidPTP")
	m.dtp = m.heads * rapid.SampledFrom([]int{2, 4}).Draw(t, "invalidOver")
	return m
}

// TestVLLMPropertiesRefused: every deployment that splits heads on prefill
// and gives a decode rank less than one head is refused at the prefill's
// block lengths, on every decode rank. Its own property (rather than a
// share of random draws in TestVLLMPropertiesSemantic) so that every run
// checks it.
func TestVLLMPropertiesRefused(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		m := vDrawInvalidModel(t)
		if m.valid() {
			t.Fatalf("drew a valid deployment: heads %d, TP %d -> %d", m.heads, m.ptp, m.dtp)
		}
		dec, pre := m.agents()
		for rank := range m.dtp {
			d := VLLMDecode{Agent: dec, TPRank: rank, TPSize: m.dtp, MLA: m.mla, BlocksFirst: m.blocksFirst,
				TotalKVHeads: m.heads, BlockWindows: m.windows, PhysicalBlocksPerLogical: m.kf}
			_, err := NewVLLMReader(d, pre, m.ptp)
			var pe *Error
			if !errors.As(err, &pe) || pe.Field != "prefill.block_lens" {
				t.Fatalf("invalid deployment (heads %d, TP %d -> %d), rank %d: got %v", m.heads, m.ptp, m.dtp, rank, err)
			}
		}
	})
}

// TestVLLMPropertiesFullHit: a full prefix hit (no decode blocks to fill)
// reads nothing and only notifies, on every rank of every valid deployment.
func TestVLLMPropertiesFullHit(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		m := vDrawValidModel(t)
		dec, pre := m.agents()
		nbRl := m.nbR / m.kf
		remote := vDrawDistinct(t, "remote", rapid.IntRange(0, nbRl).Draw(t, "nr"), nbRl)
		for rank := range m.dtp {
			d := VLLMDecode{Agent: dec, TPRank: rank, TPSize: m.dtp, MLA: m.mla, BlocksFirst: m.blocksFirst,
				TotalKVHeads: m.heads, BlockWindows: m.windows, PhysicalBlocksPerLogical: m.kf}
			r, err := NewVLLMReader(d, pre, m.ptp)
			if err != nil {
				t.Fatalf("rank %d: %v", rank, err)
			}
			p, err := planRead(r, nil, remote)
			if err != nil {
				t.Fatalf("rank %d: Plan: %v", rank, err)
			}
			rd, err := r.Read(nil, remote)
			if err != nil {
				t.Fatal(err)
			}
			if !rd.NotifyOnly || len(p.Copies) != 0 {
				t.Fatalf("full prefix hit: notify %v, %d copies", rd.NotifyOnly, len(p.Copies))
			}
		}
	})
}

// TestVLLMPropertiesSemantic checks, byte by byte, every rank plan of valid
// deployments reading at least one block. Invalid deployments and full
// prefix hits have their own properties above, so every example here is
// checked: coverage does not depend on what the random draw happens to hit.
func TestVLLMPropertiesSemantic(t *testing.T) {
	var examples, checked, bytesChecked int
	defer func() {
		t.Logf("%d examples, %d rank plans checked byte by byte (%d bytes)", examples, checked, bytesChecked)
		if checked < examples {
			t.Errorf("%d rank plans checked in %d examples: every example must check one at least", checked, examples)
		}
	}()
	rapid.Check(t, func(t *rapid.T) {
		examples++
		m := vDrawValidModel(t)
		dec, pre := m.agents()
		// Request: distinct remote blocks and decode blocks, at least one
		// and as many as the decode needs (or fewer: a prefix hit, partial
		// only without a block-size ratio, where vLLM's kv_connector/v1/nixl_connector.py
		// aligns blocks).
		nbRl, nbLl := m.nbR/m.kf, m.nbL/m.kf
		nr := rapid.IntRange(1, min(nbRl, nbLl*m.bsr)).Draw(t, "nr")
		remote := vDrawDistinct(t, "remote", nr, nbRl)
		nl := (nr + m.bsr - 1) / m.bsr
		if m.bsr == 1 {
			nl = rapid.IntRange(1, nr).Draw(t, "nl")
		}
		local := vDrawDistinct(t, "local", nl, nbLl)

		// One window per layer; it covers the layer's K and V regions.
		windows := m.windows
		owners := map[int]map[int]bool{} // head -> decode ranks that received it
		for rank := range m.dtp {
			d := VLLMDecode{Agent: dec, TPRank: rank, TPSize: m.dtp, MLA: m.mla, BlocksFirst: m.blocksFirst,
				TotalKVHeads: m.heads, BlockWindows: windows, PhysicalBlocksPerLogical: m.kf}
			r, err := NewVLLMReader(d, pre, m.ptp)
			if err != nil {
				t.Fatalf("rank %d: %v", rank, err)
			}
			p, err := planRead(r, local, remote)
			if err != nil {
				t.Fatalf("rank %d: Plan: %v", rank, err)
			}
			if err := p.Validate(); err != nil {
				t.Fatalf("rank %d: Validate: %v", rank, err)
			}
			rd, err := r.Read(local, remote)
			if err != nil {
				t.Fatal(err)
			}
			checked++
			bytesChecked += int(p.Bytes())
			checkRankSemantics(t, &m, r, p, rd, rank, local, remote, owners)
		}
		if m.mla {
			return
		}
		// Every head reached every decode rank that owns it, and only those.
		for h := range m.heads {
			for rank := range m.dtp {
				owns := false
				for _, x := range m.headsOf(m.dtp, rank) {
					owns = owns || x == h
				}
				if owners[h][rank] != owns {
					t.Fatalf("head %d: decode rank %d received %v, owns %v", h, rank, owners[h][rank], owns)
				}
			}
		}
	})
}

func checkRankSemantics(t *rapid.T, m *vModel, r *VLLMReader, p *Plan, rd VLLMRead, rank int, local, remote []int32, owners map[int]map[int]bool) {
	dec, pre := m.agents()
	eL, eR := vExpandIDs(local, m.kf), vExpandIDs(remote, m.kf)
	// Decode sub-block s reads prefill block remoteStart + s.
	read := min(len(eL)*m.bsr, len(eR))
	remoteStart := len(eR) - read
	orderL, orderR := vIndexOf(eL), vIndexOf(eR)
	prank := rank / (m.dtp / m.ptp)

	type span struct{ lo, hi uint64 }
	var written []span
	var bytes uint64
	p.ForEachBlock(func(src, dst, n uint64) bool {
		written = append(written, span{dst, dst + n})
		bytes += n
		for o := range n {
			de, err := m.locate(dst+o, vPropDecodeBase, dec.BlockLens, m.dtp, rank, m.bsr, orderL, remoteStart)
			if err != nil {
				t.Fatalf("rank %d: decode byte %#x: %v", rank, dst+o, err)
			}
			pe, err := m.locate(src+o, vPropPrefillBase, pre.BlockLens, m.ptp, prank, 1, orderR, 0)
			if err != nil {
				t.Fatalf("rank %d: prefill byte %#x: %v", rank, src+o, err)
			}
			if de != pe {
				t.Fatalf("rank %d: decode byte %#x holds %+v but receives prefill byte %#x holding %+v", rank, dst+o, de, src+o, pe)
			}
			if owners[de.head] == nil {
				owners[de.head] = map[int]bool{}
			}
			owners[de.head][rank] = true
		}
		return true
	})
	// No decode byte written twice.
	sort.Slice(written, func(i, j int) bool { return written[i].lo < written[j].lo })
	for i := 1; i < len(written); i++ {
		if written[i].lo < written[i-1].hi {
			t.Fatalf("rank %d: decode bytes [%#x, %#x) written twice", rank, written[i].lo, written[i-1].hi)
		}
	}
	// Bytes conserved: every sub-block the request reads, whole, per region
	// (windows cut a layer's blocks), and the prepped form agrees.
	var want uint64
	for i, bl := range dec.BlockLens {
		used := read
		if m.windows != nil {
			used = read - windowStart(read, m.windows[vLayerOf(m, i)])
		}
		want += uint64(used) * (bl / uint64(m.bsr))
	}
	if bytes != want || p.Bytes() != want {
		t.Fatalf("rank %d: plan moves %d bytes (%d by copy count), want %d", rank, bytes, p.Bytes(), want)
	}
	var prepped uint64
	ll := r.LocalList()
	for _, id := range rd.LocalIDs {
		d, ok := ll.Desc(int(id))
		if !ok {
			t.Fatalf("rank %d: local id %d outside the list", rank, id)
		}
		prepped += d.Len
	}
	if prepped != want {
		t.Fatalf("rank %d: prepped ids move %d bytes, want %d", rank, prepped, want)
	}
	if uint64(len(rd.LocalIDs)) != p.ReferenceDescriptors {
		t.Fatalf("rank %d: ReferenceDescriptors %d, prepped ids %d", rank, p.ReferenceDescriptors, len(rd.LocalIDs))
	}
}

func vLayerOf(m *vModel, region int) int {
	if m.mla || m.blocksFirst {
		return region
	}
	return region / 2
}

func vDrawDistinct(t *rapid.T, label string, n, limit int) []int32 {
	perm := rapid.Permutation(vSeq(limit)).Draw(t, label)
	return perm[:n]
}

func vSeq(n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(i)
	}
	return out
}

// TestVLLMPropertiesNoPanic starts from a random valid deployment, breaks
// any number of its fields with hostile values, and throws arbitrary ids at
// the reader: every outcome is an *Error or a plan that stays inside its
// regions with matching prepped ids.
func TestVLLMPropertiesNoPanic(t *testing.T) {
	var planned, refused int
	defer func() {
		t.Logf("%d inputs planned a read, %d refused", planned, refused)
		if planned == 0 || refused == 0 {
			t.Errorf("generator too thin: %d planned, %d refused", planned, refused)
		}
	}()
	hostileInt := rapid.SampledFrom([]int{-1, 0, 1, 2, 3, 7, 1 << 20, 1<<31 - 1, 1 << 40})
	hostileU64 := rapid.SampledFrom([]uint64{0, 1, 3, 64, 1 << 32, ^uint64(0) - 64, ^uint64(0)})
	rapid.Check(t, func(t *rapid.T) {
		m := vDrawModel(t)
		dec, pre := m.agents()
		local := VLLMDecode{Agent: dec, TPRank: rapid.IntRange(0, m.dtp-1).Draw(t, "rank"), TPSize: m.dtp, MLA: m.mla,
			BlocksFirst: m.blocksFirst, TotalKVHeads: m.heads, BlockWindows: m.windows, PhysicalBlocksPerLogical: m.kf}
		remoteTP := m.ptp
		breakages := rapid.IntRange(0, 3).Draw(t, "breakages")
		if rapid.Bool().Draw(t, "intact") {
			breakages = 0
		}
		for range breakages {
			side := &local.Agent
			if rapid.Bool().Draw(t, "prefillSide") {
				side = &pre
			}
			switch rapid.IntRange(0, 13).Draw(t, "field") {
			case 0:
				side.NumBlocks = hostileInt.Draw(t, "v")
			case 1:
				side.BlockSize = hostileInt.Draw(t, "v")
			case 2:
				if len(side.BlockLens) > 0 {
					side.BlockLens[rapid.IntRange(0, len(side.BlockLens)-1).Draw(t, "i")] = hostileU64.Draw(t, "v")
				}
			case 3:
				side.BaseAddrs[rapid.IntRange(0, len(side.BaseAddrs)-1).Draw(t, "i")] = hostileU64.Draw(t, "v")
			case 4:
				side.BlockLens = side.BlockLens[:rapid.IntRange(0, len(side.BlockLens)).Draw(t, "n")]
			case 5:
				side.KVCacheLayout = rapid.SampledFrom([]string{"NHD", "", "HND"}).Draw(t, "v")
			case 6:
				side.Kind = MemKind(rapid.IntRange(0, 3).Draw(t, "v"))
			case 7:
				local.TPRank = hostileInt.Draw(t, "v")
			case 8:
				local.TPSize = hostileInt.Draw(t, "v")
			case 9:
				remoteTP = hostileInt.Draw(t, "v")
			case 10:
				local.TotalKVHeads = hostileInt.Draw(t, "v")
			case 11:
				local.BlockWindows = rapid.SliceOfN(rapid.IntRange(-2, 6), 0, 8).Draw(t, "v")
			case 12:
				local.PhysicalBlocksPerLogical = hostileInt.Draw(t, "v")
			case 13:
				local.MLA, local.BlocksFirst = rapid.Bool().Draw(t, "mla"), rapid.Bool().Draw(t, "bf")
			}
		}
		r, err := NewVLLMReader(local, pre, remoteTP)
		if err != nil {
			var pe *Error
			if !errors.As(err, &pe) {
				t.Fatalf("error %v is not an *Error", err)
			}
			refused++
			return
		}
		var l, rm []int32
		if rapid.Bool().Draw(t, "hostileIDs") {
			ids := rapid.SliceOfN(rapid.OneOf(rapid.Int32Range(-2, 24), rapid.SampledFrom([]int32{1<<31 - 1, -1 << 31})), 0, 12)
			l, rm = ids.Draw(t, "local"), ids.Draw(t, "remote")
		} else {
			nbRl, nbLl := max(m.nbR/m.kf, 1), max(m.nbL/m.kf, 1)
			nr := rapid.IntRange(0, nbRl).Draw(t, "nr")
			rm = vDrawDistinct(t, "remote", nr, nbRl)
			l = vDrawDistinct(t, "local", rapid.IntRange(0, min(nbLl, (nr+m.bsr-1)/m.bsr)).Draw(t, "nl"), nbLl)
		}
		rd, err := r.Read(l, rm)
		p, perr := planRead(r, l, rm)
		if (err == nil) != (perr == nil) {
			t.Fatalf("Read %v but Plan %v", err, perr)
		}
		if err != nil {
			var pe *Error
			if !errors.As(err, &pe) {
				t.Fatalf("error %v is not an *Error", err)
			}
			refused++
			return
		}
		if err := p.Validate(); err != nil {
			t.Fatalf("Validate: %v", err)
		}
		if len(rd.LocalIDs) != len(rd.RemoteIDs) {
			t.Fatalf("id arrays of %d and %d", len(rd.LocalIDs), len(rd.RemoteIDs))
		}
		ll, rl := r.LocalList(), r.RemoteList()
		for k := range rd.LocalIDs {
			a, ok1 := ll.Desc(int(rd.LocalIDs[k]))
			b, ok2 := rl.Desc(int(rd.RemoteIDs[k]))
			if !ok1 || !ok2 || a.Len != b.Len {
				t.Fatalf("pair %d: ids %d %d, descs %v %v", k, rd.LocalIDs[k], rd.RemoteIDs[k], a, b)
			}
		}
		if !rd.NotifyOnly {
			planned++
			vAssertSameBytes(t, r, rd, p)
		}
	})
}
