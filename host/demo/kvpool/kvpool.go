// Package kvpool is a synthetic KV cache in host memory, laid out as SGLang
// or vLLM lay out theirs, with an independent byte check.
//
// Prefill workers Fill the pages of a request with bytes derived only from
// (request, global layer, K or V, token position, global KV head, byte
// index); decode workers Verify every byte they own against the same
// formula. Neither step knows anything about transfer plans: a planner bug
// that moves a byte to the wrong place shows up as a failed check, because
// the check is computed from the decode worker's own geometry alone.
//
// Memory comes from an anonymous mmap, outside the Go heap, so plugins may
// keep its addresses for as long as the pool is open.
package kvpool

import (
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"
	"unsafe"
)

// Attention is the attention kind, which decides whether heads are split
// across tensor-parallel ranks.
type Attention uint8

const (
	// MHA (and GQA): per-layer K and V buffers whose KV heads are split
	// across TP ranks.
	MHA Attention = iota
	// MLA: one latent buffer per layer, the same on every TP rank (no heads
	// to split).
	MLA
)

// Order is the order and shape of a worker's KV regions.
type Order uint8

const (
	// KThenV is SGLang's kv_data_ptrs order: K of every layer, then V of
	// every layer (MLA: one region per layer).
	KThenV Order = iota
	// Interleaved is vLLM's per-layer K and V tensors: K0, V0, K1, V1, ...
	// (MLA: one region per layer).
	Interleaved
	// BlocksFirst is vLLM's blocks-first layout (e.g. FlashInfer): one
	// region per layer whose every block holds the K half then the V half.
	BlocksFirst
)

// Geometry describes one worker rank's KV pool.
type Geometry struct {
	Attention Attention
	Order     Order
	// HeadMajor lays a page out as [head][token][bytes] (vLLM's "HND");
	// otherwise [token][head][bytes] (SGLang, vLLM's "NHD").
	HeadMajor bool

	Layers     int // layers this worker holds (its PP stage)
	StartLayer int // global index of its first layer
	Pages      int // pages (SGLang) or blocks (vLLM)
	PageSize   int // tokens per page or block
	TotalHeads int // KV heads of the whole model (MHA); ignored for MLA
	TPSize     int
	TPRank     int
	HeadBytes  int // bytes of one head of one token (MLA: the latent row)

	AuxItems   int // aux buffer slots (0: no aux region)
	AuxItemLen int // bytes per aux slot
}

// Validate reports the first field that makes the geometry unusable.
func (g Geometry) Validate() error {
	switch {
	case g.Attention > MLA:
		return fmt.Errorf("kvpool: unknown attention %d", g.Attention)
	case g.Order > BlocksFirst:
		return fmt.Errorf("kvpool: unknown order %d", g.Order)
	case g.Attention == MLA && g.Order == BlocksFirst:
		return errors.New("kvpool: MLA has no K/V halves; use KThenV or Interleaved")
	case g.Layers <= 0:
		return fmt.Errorf("kvpool: layers %d must be > 0", g.Layers)
	case g.StartLayer < 0:
		return fmt.Errorf("kvpool: start layer %d must be >= 0", g.StartLayer)
	case g.Pages <= 0:
		return fmt.Errorf("kvpool: pages %d must be > 0", g.Pages)
	case g.PageSize <= 0:
		return fmt.Errorf("kvpool: page size %d must be > 0", g.PageSize)
	case g.TPSize <= 0 || g.TPRank < 0 || g.TPRank >= g.TPSize:
		return fmt.Errorf("kvpool: tp rank %d of size %d", g.TPRank, g.TPSize)
	case g.HeadBytes <= 0:
		return fmt.Errorf("kvpool: head bytes %d must be > 0", g.HeadBytes)
	case g.AuxItems < 0 || g.AuxItemLen < 0 || (g.AuxItems > 0) != (g.AuxItemLen > 0):
		return fmt.Errorf("kvpool: aux items %d x %d bytes", g.AuxItems, g.AuxItemLen)
	}
	if g.Attention == MHA {
		if g.TotalHeads <= 0 {
			return fmt.Errorf("kvpool: total heads %d must be > 0", g.TotalHeads)
		}
		if err := CheckHeadSplit(g.TotalHeads, g.TPSize); err != nil {
			return err
		}
	}
	if uint64(g.Pages)*g.itemLen() > 1<<46 {
		return errors.New("kvpool: pool larger than 64 TiB")
	}
	return nil
}

// CheckHeadSplit reports whether tp ranks can hold heads KV heads (MHA):
// each rank an equal share, or, with more ranks than heads, each head
// replicated over tp/heads ranks.
func CheckHeadSplit(heads, tp int) error {
	if heads <= 0 || tp <= 0 {
		return fmt.Errorf("kvpool: %d KV heads over TP %d", heads, tp)
	}
	if tp <= heads && heads%tp != 0 {
		return fmt.Errorf("kvpool: %d KV heads do not split over TP %d", heads, tp)
	}
	if tp > heads && tp%heads != 0 {
		return fmt.Errorf("kvpool: TP %d is not a multiple of %d KV heads", tp, heads)
	}
	return nil
}

// HeadsLocal returns the KV heads one rank holds: TotalHeads/TPSize, or 1
// when TP exceeds the KV heads and heads are replicated (MLA: 1).
func (g Geometry) HeadsLocal() int {
	if g.Attention == MLA || g.TPSize >= g.TotalHeads {
		return 1
	}
	return g.TotalHeads / g.TPSize
}

// GlobalHead returns the model's KV head index held as local head h. With
// replication (TP > KV heads), TPSize/TotalHeads consecutive ranks hold the
// same head. MLA has a single "head" 0.
func (g Geometry) GlobalHead(h int) int {
	if g.Attention == MLA {
		return 0
	}
	if g.TPSize >= g.TotalHeads {
		return g.TPRank / (g.TPSize / g.TotalHeads)
	}
	return g.TPRank*g.HeadsLocal() + h
}

// kvs returns 2 for MHA (K and V) and 1 for MLA.
func (g Geometry) kvs() int {
	if g.Attention == MLA {
		return 1
	}
	return 2
}

// NumRegions returns the number of KV regions.
func (g Geometry) NumRegions() int {
	if g.Order == BlocksFirst || g.Attention == MLA {
		return g.Layers
	}
	return 2 * g.Layers
}

// kvBytesPerPage is the bytes of one of K or V (or the latent) in a page.
func (g Geometry) kvBytesPerPage() uint64 {
	return uint64(g.PageSize) * uint64(g.HeadsLocal()) * uint64(g.HeadBytes)
}

// itemLen is the bytes of one page of one region (kv_item_lens / block_len).
func (g Geometry) itemLen() uint64 {
	if g.Order == BlocksFirst {
		return 2 * g.kvBytesPerPage()
	}
	return g.kvBytesPerPage()
}

// ItemLen returns the bytes per page of every KV region (SGLang's
// kv_item_lens, vLLM's block_len).
func (g Geometry) ItemLen() uint64 { return g.itemLen() }

// region returns the region index of (local layer, kv) and the offset of
// that kv inside a page of the region.
func (g Geometry) region(layer, kv int) (idx int, kvOff uint64) {
	switch {
	case g.Attention == MLA:
		return layer, 0
	case g.Order == KThenV:
		return kv*g.Layers + layer, 0
	case g.Order == Interleaved:
		return 2*layer + kv, 0
	default: // BlocksFirst
		return layer, uint64(kv) * g.kvBytesPerPage()
	}
}

// headOffset is the offset of (token slot, local head) inside one kv part of
// a page.
func (g Geometry) headOffset(slot, h int) uint64 {
	if g.HeadMajor {
		return (uint64(h)*uint64(g.PageSize) + uint64(slot)) * uint64(g.HeadBytes)
	}
	return (uint64(slot)*uint64(g.HeadsLocal()) + uint64(h)) * uint64(g.HeadBytes)
}

// Region is one registered buffer: its address in this process and length.
type Region struct {
	Addr uint64
	Len  uint64
}

// Pool is one rank's synthetic KV cache.
type Pool struct {
	g       Geometry
	mem     []byte // the whole mapping: KV regions, then aux
	regions []Region
	aux     Region
	kvLen   uint64 // bytes of one KV region
}

// New maps a pool for g. Close unmaps it.
func New(g Geometry) (*Pool, error) {
	if err := g.Validate(); err != nil {
		return nil, err
	}
	kvLen := uint64(g.Pages) * g.itemLen()
	auxLen := uint64(g.AuxItems) * uint64(g.AuxItemLen)
	total := kvLen*uint64(g.NumRegions()) + auxLen
	// MAP_POPULATE allocates every page now, as an engine's KV memory is
	// allocated (GPU memory, or host memory a transfer backend registers
	// and pins). Unpopulated anonymous memory reads as the kernel's one
	// shared zero page: copies out of a pool nobody wrote (NoBytes runs)
	// then read one cached 4 KiB page, and looked about 25% faster than
	// copies out of real KV (host/serve's BenchmarkThroughput compared
	// the sidecar, reading real shared-memory pages, with that).
	mem, err := syscall.Mmap(-1, 0, int(total), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE|syscall.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("kvpool: mmap %d bytes: %w", total, err)
	}
	p := &Pool{g: g, mem: mem, kvLen: kvLen}
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	for i := 0; i < g.NumRegions(); i++ {
		p.regions = append(p.regions, Region{Addr: base + uint64(i)*kvLen, Len: kvLen})
	}
	if auxLen > 0 {
		p.aux = Region{Addr: base + kvLen*uint64(g.NumRegions()), Len: auxLen}
	}
	return p, nil
}

// Close unmaps the pool. Deregister it from every plugin first.
func (p *Pool) Close() error {
	if p.mem == nil {
		return nil
	}
	err := syscall.Munmap(p.mem)
	p.mem = nil
	return err
}

// Geometry returns the pool's geometry.
func (p *Pool) Geometry() Geometry { return p.g }

// Regions returns the KV regions in the geometry's order (SGLang
// kv_data_ptrs, vLLM kv_caches_base_addr). The slice is shared; do not
// modify it.
func (p *Pool) Regions() []Region { return p.regions }

// Aux returns the aux region (Len 0 when the geometry has none).
func (p *Pool) Aux() Region { return p.aux }

// Bytes returns the pool memory, for tests and for zeroing.
func (p *Pool) Bytes() []byte { return p.mem }

// Tokens names tokens [First, First+Count) of a request whose token t lives
// in page Pages[t / PageSize] at slot t % PageSize.
type Tokens struct {
	Request uint64
	Pages   []int32
	First   int
	Count   int
}

func (p *Pool) checkTokens(t Tokens) error {
	if t.First < 0 || t.Count < 0 {
		return fmt.Errorf("kvpool: tokens [%d, +%d)", t.First, t.Count)
	}
	end := t.First + t.Count
	if need := (end + p.g.PageSize - 1) / p.g.PageSize; need > len(t.Pages) {
		return fmt.Errorf("kvpool: %d tokens need %d pages, request has %d", end, need, len(t.Pages))
	}
	for i := t.First / p.g.PageSize; i*p.g.PageSize < end; i++ {
		if pg := t.Pages[i]; pg < 0 || int(pg) >= p.g.Pages {
			return fmt.Errorf("kvpool: page %d out of range [0, %d)", pg, p.g.Pages)
		}
	}
	return nil
}

// Fill writes the expected bytes of tokens t into every head this rank
// holds, in every layer, K and V.
func (p *Pool) Fill(t Tokens) error {
	if err := p.checkTokens(t); err != nil {
		return err
	}
	p.walk(t, func(dst []byte, k seedKey) bool {
		fillHead(dst, k.seed())
		return true
	})
	return nil
}

// Verify checks every byte of tokens t that this rank holds against the
// expected bytes and returns a *Mismatch for the first wrong one.
func (p *Pool) Verify(t Tokens) error {
	if err := p.checkTokens(t); err != nil {
		return err
	}
	var bad *Mismatch
	p.walk(t, func(got []byte, k seedKey) bool {
		seed := k.seed()
		if i := firstDiff(got, seed); i >= 0 {
			bad = &Mismatch{Request: k.request, Layer: k.layer, KV: k.kv, Token: k.token, Head: k.head,
				Byte: i, Got: got[i], Want: headByte(seed, i), mla: p.g.Attention == MLA}
			return false
		}
		return true
	})
	if bad != nil {
		return bad
	}
	return nil
}

// Mismatch is the first byte that Verify found wrong.
type Mismatch struct {
	Request uint64
	Layer   int // global layer
	KV      int // 0 K (or the MLA latent), 1 V
	Token   int // position in the request
	Head    int // global KV head
	Byte    int // byte index within the head
	Got     byte
	Want    byte
	mla     bool
}

func (m *Mismatch) Error() string {
	part := "K"
	switch {
	case m.mla:
		part = "latent"
	case m.KV == 1:
		part = "V"
	}
	return fmt.Sprintf("kvpool: request %d layer %d %s token %d head %d byte %d: got 0x%02x, want 0x%02x",
		m.Request, m.Layer, part, m.Token, m.Head, m.Byte, m.Got, m.Want)
}

// walk calls fn with the bytes of every (layer, kv, token, local head) of t
// and its identity, stopping when fn returns false.
func (p *Pool) walk(t Tokens, fn func(head []byte, k seedKey) bool) {
	g := p.g
	hb := uint64(g.HeadBytes)
	item := g.itemLen()
	heads := g.HeadsLocal()
	for layer := 0; layer < g.Layers; layer++ {
		for kv := 0; kv < g.kvs(); kv++ {
			ri, kvOff := g.region(layer, kv)
			regionOff := uint64(ri) * p.kvLen
			for tok := t.First; tok < t.First+t.Count; tok++ {
				page := uint64(t.Pages[tok/g.PageSize])
				slot := tok % g.PageSize
				for h := 0; h < heads; h++ {
					off := regionOff + page*item + kvOff + g.headOffset(slot, h)
					k := seedKey{t.Request, g.StartLayer + layer, kv, tok, g.GlobalHead(h)}
					if !fn(p.mem[off:off+hb:off+hb], k) {
						return
					}
				}
			}
		}
	}
}

// seedKey identifies one head of one token.
type seedKey struct {
	request uint64
	layer   int // global layer
	kv      int // 0 K (or MLA latent), 1 V
	token   int // position in the request
	head    int // global KV head
}

func (k seedKey) seed() uint64 {
	h := mix(k.request ^ 0x6b76686f7374) // "kvhost"
	h = mix(h ^ uint64(k.layer)<<1 ^ uint64(k.kv))
	h = mix(h ^ uint64(k.token))
	return mix(h ^ uint64(k.head))
}

// mix is SplitMix64's finalizer: a bijective 64-bit hash.
func mix(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// word returns the i-th 8-byte word of the content with the given seed.
// The seed is already a strong hash of the head's identity, so words only
// need to differ from each other: an odd-constant step does that with one
// multiply-add, which keeps Fill and Verify near memory speed.
func word(seed uint64, i int) uint64 { return seed + uint64(i)*0x9e3779b97f4a7c15 }

func headByte(seed uint64, i int) byte {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], word(seed, i/8))
	return b[i%8]
}

func fillHead(dst []byte, seed uint64) {
	i := 0
	for ; i+8 <= len(dst); i += 8 {
		binary.LittleEndian.PutUint64(dst[i:], word(seed, i/8))
	}
	for ; i < len(dst); i++ {
		dst[i] = headByte(seed, i)
	}
}

// firstDiff returns the index of the first byte of got that differs from
// the content of seed, or -1.
func firstDiff(got []byte, seed uint64) int {
	i := 0
	for ; i+8 <= len(got); i += 8 {
		if binary.LittleEndian.Uint64(got[i:]) != word(seed, i/8) {
			break
		}
	}
	for ; i < len(got); i++ {
		if got[i] != headByte(seed, i) {
			return i
		}
	}
	return -1
}

// auxLayer marks aux content in a seedKey (no real layer is negative).
const auxLayer = -1

// FillAux writes request's expected aux bytes into aux slot idx.
func (p *Pool) FillAux(request uint64, idx int) error {
	b, err := p.auxSlot(idx)
	if err != nil {
		return err
	}
	fillHead(b, seedKey{request: request, layer: auxLayer}.seed())
	return nil
}

// VerifyAux checks aux slot idx against request's expected aux bytes.
func (p *Pool) VerifyAux(request uint64, idx int) error {
	b, err := p.auxSlot(idx)
	if err != nil {
		return err
	}
	seed := seedKey{request: request, layer: auxLayer}.seed()
	if i := firstDiff(b, seed); i >= 0 {
		return fmt.Errorf("kvpool: request %d aux slot %d byte %d: got 0x%02x, want 0x%02x",
			request, idx, i, b[i], headByte(seed, i))
	}
	return nil
}

func (p *Pool) auxSlot(idx int) ([]byte, error) {
	if idx < 0 || idx >= p.g.AuxItems {
		return nil, fmt.Errorf("kvpool: aux slot %d out of range [0, %d)", idx, p.g.AuxItems)
	}
	off := p.aux.Addr - p.regions[0].Addr + uint64(idx)*uint64(p.g.AuxItemLen)
	return p.mem[off : off+uint64(p.g.AuxItemLen)], nil
}

// ClearPages zeroes the given pages in every KV region, so bytes a previous
// request left behind cannot pass a later Verify.
func (p *Pool) ClearPages(pages []int32) error {
	item := p.g.itemLen()
	for _, pg := range pages {
		if pg < 0 || int(pg) >= p.g.Pages {
			return fmt.Errorf("kvpool: page %d out of range [0, %d)", pg, p.g.Pages)
		}
		for r := range p.regions {
			off := uint64(r)*p.kvLen + uint64(pg)*item
			clear(p.mem[off : off+item])
		}
	}
	return nil
}
