package kvpool

import (
	"errors"
	"math/rand/v2"
	"testing"
)

func mha(order Order, headMajor bool, tpSize, tpRank int) Geometry {
	return Geometry{Attention: MHA, Order: order, HeadMajor: headMajor, Layers: 3, StartLayer: 2,
		Pages: 10, PageSize: 4, TotalHeads: 4, TPSize: tpSize, TPRank: tpRank, HeadBytes: 20,
		AuxItems: 4, AuxItemLen: 24}
}

func newPool(t *testing.T, g Geometry) *Pool {
	t.Helper()
	p, err := New(g)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

var layouts = map[string]Geometry{
	"sglang-mha":       mha(KThenV, false, 2, 1),
	"sglang-mla":       {Attention: MLA, Order: KThenV, Layers: 2, Pages: 6, PageSize: 8, TPSize: 4, TPRank: 3, HeadBytes: 72},
	"vllm-nhd":         mha(Interleaved, false, 1, 0),
	"vllm-hnd":         mha(Interleaved, true, 4, 2),
	"vllm-blocksfirst": mha(BlocksFirst, true, 2, 0),
	"replicated":       mha(KThenV, false, 8, 5),
}

func TestFillVerifyEveryLayout(t *testing.T) {
	for name, g := range layouts {
		t.Run(name, func(t *testing.T) {
			p := newPool(t, g)
			tok := Tokens{Request: 77, Pages: []int32{5, 1, 3}, First: 2, Count: 9}
			if err := p.Fill(tok); err != nil {
				t.Fatal(err)
			}
			if err := p.Verify(tok); err != nil {
				t.Fatal(err)
			}
			// Tokens never filled must fail: token 1 shares page 5 with token 2.
			if err := p.Verify(Tokens{Request: 77, Pages: tok.Pages, First: 1, Count: 1}); err == nil {
				t.Fatal("unfilled token verified")
			}
			// Another request's bytes differ.
			if err := p.Verify(Tokens{Request: 78, Pages: tok.Pages, First: 2, Count: 9}); err == nil {
				t.Fatal("request 78 verified against request 77's bytes")
			}
		})
	}
}

func TestFillTouchesOnlyItsTokens(t *testing.T) {
	g := layouts["vllm-hnd"]
	p := newPool(t, g)
	tok := Tokens{Request: 1, Pages: []int32{7, 2}, First: 1, Count: 5}
	if err := p.Fill(tok); err != nil {
		t.Fatal(err)
	}
	touched := 0
	for _, b := range p.Bytes() {
		if b != 0 {
			touched++
		}
	}
	// 5 tokens x heads x bytes x layers x K/V, minus the rare zero byte.
	want := 5 * g.HeadsLocal() * g.HeadBytes * g.Layers * 2
	if touched > want || touched < want*9/10 {
		t.Fatalf("fill changed %d bytes, want about %d", touched, want)
	}
	if err := p.ClearPages([]int32{7, 2}); err != nil {
		t.Fatal(err)
	}
	for i, b := range p.Bytes() {
		if b != 0 {
			t.Fatalf("byte %d not cleared", i)
		}
	}
}

func TestMismatchNamesTheHead(t *testing.T) {
	g := layouts["sglang-mha"] // rank 1 of 2: global heads 2 and 3
	p := newPool(t, g)
	tok := Tokens{Request: 9, Pages: []int32{4, 0}, First: 0, Count: 8}
	if err := p.Fill(tok); err != nil {
		t.Fatal(err)
	}
	// Corrupt layer 1 (global 3), V, token 6 (page 0 slot 2), local head 1 (global 3), byte 5.
	ri, kvOff := g.region(1, 1)
	off := uint64(ri)*p.kvLen + 0*g.itemLen() + kvOff + g.headOffset(2, 1) + 5
	p.Bytes()[off] ^= 0xff
	err := p.Verify(tok)
	var m *Mismatch
	if !errors.As(err, &m) {
		t.Fatalf("Verify = %v, want *Mismatch", err)
	}
	want := Mismatch{Request: 9, Layer: 3, KV: 1, Token: 6, Head: 3, Byte: 5}
	if m.Layer != want.Layer || m.KV != want.KV || m.Token != want.Token || m.Head != want.Head || m.Byte != want.Byte || m.Got == m.Want {
		t.Fatalf("mismatch %+v, want %+v", *m, want)
	}
	t.Log(err)
}

// TestCrossGeometryCopy moves heads from a TP-1 prefill pool to the two ranks
// of a TP-2 decode pool with the layout formulas written out here, and shows
// that a correct placement verifies and a swapped head does not.
func TestCrossGeometryCopy(t *testing.T) {
	pg := Geometry{Attention: MHA, Order: KThenV, Layers: 2, Pages: 8, PageSize: 4, TotalHeads: 4, TPSize: 1, HeadBytes: 16}
	pre := newPool(t, pg)
	tokens := 7
	prePages := []int32{3, 6}
	if err := pre.Fill(Tokens{Request: 5, Pages: prePages, Count: tokens}); err != nil {
		t.Fatal(err)
	}
	for rank := 0; rank < 2; rank++ {
		for _, swap := range []bool{false, true} {
			dg := pg
			dg.TPSize, dg.TPRank = 2, rank
			dec := newPool(t, dg)
			decPages := []int32{1, 0}
			for layer := 0; layer < 2; layer++ {
				for kv := 0; kv < 2; kv++ {
					for tok := 0; tok < tokens; tok++ {
						for h := 0; h < 2; h++ {
							src := h + 2*rank // global head
							if swap && tok == 5 && layer == 1 {
								src = (h+1)%2 + 2*rank
							}
							// SGLang layout: region kv*L+layer, [page][token][head][16 bytes].
							so := (uint64(kv*2+layer)*8*4*4 + uint64(prePages[tok/4])*4*4 + uint64(tok%4)*4 + uint64(src)) * 16
							do := (uint64(kv*2+layer)*8*4*2 + uint64(decPages[tok/4])*4*2 + uint64(tok%4)*2 + uint64(h)) * 16
							copy(dec.Bytes()[do:do+16], pre.Bytes()[so:so+16])
						}
					}
				}
			}
			err := dec.Verify(Tokens{Request: 5, Pages: decPages, Count: tokens})
			if swap != (err != nil) {
				t.Fatalf("rank %d swap=%v: Verify = %v", rank, swap, err)
			}
		}
	}
}

func TestGlobalHeads(t *testing.T) {
	cases := []struct {
		total, tp, rank int
		want            []int
	}{
		{8, 2, 1, []int{4, 5, 6, 7}},
		{2, 4, 0, []int{0}}, {2, 4, 1, []int{0}}, {2, 4, 2, []int{1}}, {2, 4, 3, []int{1}},
		{4, 4, 3, []int{3}},
	}
	for _, c := range cases {
		g := Geometry{Attention: MHA, TotalHeads: c.total, TPSize: c.tp, TPRank: c.rank}
		var got []int
		for h := 0; h < g.HeadsLocal(); h++ {
			got = append(got, g.GlobalHead(h))
		}
		if len(got) != len(c.want) {
			t.Fatalf("%+v: heads %v, want %v", c, got, c.want)
		}
		for i := range got {
			if got[i] != c.want[i] {
				t.Fatalf("%+v: heads %v, want %v", c, got, c.want)
			}
		}
	}
}

func TestRegionsAndItemLens(t *testing.T) {
	for name, g := range layouts {
		p := newPool(t, g)
		if len(p.Regions()) != g.NumRegions() {
			t.Fatalf("%s: %d regions, want %d", name, len(p.Regions()), g.NumRegions())
		}
		for i, r := range p.Regions() {
			if r.Len != uint64(g.Pages)*g.ItemLen() {
				t.Fatalf("%s: region %d len %d", name, i, r.Len)
			}
			if i > 0 && r.Addr != p.Regions()[i-1].Addr+r.Len {
				t.Fatalf("%s: regions not laid out back to back", name)
			}
		}
	}
	if got := layouts["vllm-blocksfirst"].ItemLen(); got != 2*4*2*20 {
		t.Fatalf("blocks-first item len %d", got)
	}
}

func TestAux(t *testing.T) {
	p := newPool(t, layouts["sglang-mha"])
	if err := p.FillAux(3, 2); err != nil {
		t.Fatal(err)
	}
	if err := p.VerifyAux(3, 2); err != nil {
		t.Fatal(err)
	}
	if p.VerifyAux(4, 2) == nil || p.VerifyAux(3, 1) == nil {
		t.Fatal("wrong aux verified")
	}
	if p.FillAux(3, 4) == nil || p.FillAux(3, -1) == nil {
		t.Fatal("aux slot out of range accepted")
	}
}

func TestBadInput(t *testing.T) {
	bad := []Geometry{
		{},
		{Attention: MHA, Layers: 1, Pages: 1, PageSize: 1, TotalHeads: 3, TPSize: 2, HeadBytes: 1},
		{Attention: MHA, Layers: 1, Pages: 1, PageSize: 1, TotalHeads: 2, TPSize: 3, HeadBytes: 1},
		{Attention: MLA, Order: BlocksFirst, Layers: 1, Pages: 1, PageSize: 1, TPSize: 1, HeadBytes: 1},
		{Attention: MHA, Layers: 1, Pages: 1, PageSize: 1, TotalHeads: 1, TPSize: 1, TPRank: 1, HeadBytes: 1},
		{Attention: MHA, Layers: 1, Pages: 1 << 30, PageSize: 1 << 10, TotalHeads: 1, TPSize: 1, HeadBytes: 1 << 10},
	}
	for i, g := range bad {
		if _, err := New(g); err == nil {
			t.Errorf("geometry %d accepted: %+v", i, g)
		}
	}
	p := newPool(t, layouts["sglang-mha"])
	for _, tok := range []Tokens{
		{Pages: []int32{1}, Count: 5},  // needs 2 pages
		{Pages: []int32{10}, Count: 1}, // page out of range
		{Pages: []int32{-1}, Count: 1}, // negative page
		{Pages: []int32{1}, First: -1}, // negative first
	} {
		if p.Fill(tok) == nil || p.Verify(tok) == nil {
			t.Errorf("tokens %+v accepted", tok)
		}
	}
}

func BenchmarkFillVerify(b *testing.B) {
	g := Geometry{Attention: MHA, Order: KThenV, Layers: 32, Pages: 256, PageSize: 16, TotalHeads: 8, TPSize: 2, HeadBytes: 256}
	p, err := New(g)
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	pages := rand.Perm(256)[:64]
	tok := Tokens{Request: 1, Count: 64 * 16}
	for _, pg := range pages {
		tok.Pages = append(tok.Pages, int32(pg))
	}
	bytes := int64(tok.Count * g.HeadsLocal() * g.HeadBytes * g.Layers * 2)
	b.SetBytes(2 * bytes)
	for b.Loop() {
		p.Fill(tok)
		if err := p.Verify(tok); err != nil {
			b.Fatal(err)
		}
	}
}
