package apiconformance

import (
	"bytes"
	"testing"
)

// sglPool is one SGLang rank's memory as docs/engine-api.md lays it out
// (MHA): kv_data_ptrs are K of every layer then V of every layer, each
// pages × item_len bytes, a page holding page_size tokens of heads ×
// head_bytes; then one aux buffer of auxSlots slots. All of it is one
// shared-memory object, registered as one dram region.
type sglPool struct {
	shm                                *shm
	base                               uint64
	layers, pages, pageSize, heads, hb int
	auxSlots, auxItem                  int
}

func newSGLPool(t testing.TB, layers, pages, pageSize, heads, headBytes int) *sglPool {
	p := &sglPool{layers: layers, pages: pages, pageSize: pageSize, heads: heads, hb: headBytes, auxSlots: 8, auxItem: 64}
	p.shm = newSHM(t, p.size())
	p.base = engineAddr()
	return p
}

func (p *sglPool) itemLen() int { return p.pageSize * p.heads * p.hb }
func (p *sglPool) bufLen() int  { return p.pages * p.itemLen() }
func (p *sglPool) nbuf() int    { return 2 * p.layers }
func (p *sglPool) auxOff() int  { return p.nbuf() * p.bufLen() }
func (p *sglPool) size() int    { return p.auxOff() + p.auxSlots*p.auxItem }

func (p *sglPool) region() M { return region(p.base, p.size(), p.shm.name) }

// page is page pg of KV buffer b in the engine's own mapping.
func (p *sglPool) page(b, pg int) []byte {
	o := b*p.bufLen() + pg*p.itemLen()
	return p.shm.mem[o : o+p.itemLen()]
}

func (p *sglPool) aux(slot int) []byte {
	o := p.auxOff() + slot*p.auxItem
	return p.shm.mem[o : o+p.auxItem]
}

// fields are open_rank's SGLang fields for the pool (TP 1).
func (p *sglPool) fields(role string) M {
	var ptrs, lens, items []uint64
	for b := range p.nbuf() {
		ptrs = append(ptrs, p.base+uint64(b*p.bufLen()))
		lens = append(lens, uint64(p.bufLen()))
		items = append(items, uint64(p.itemLen()))
	}
	return m("style", "sglang", "role", role,
		"kv_data_ptrs", ptrs, "kv_data_lens", lens, "kv_item_lens", items,
		"aux_data_ptrs", []uint64{p.base + uint64(p.auxOff())}, "aux_data_lens", []uint64{uint64(p.auxSlots * p.auxItem)},
		"aux_item_lens", []uint64{uint64(p.auxItem)},
		"page_size", p.pageSize, "kv_head_num", p.heads, "total_kv_head_num", p.heads,
		"tp_size", 1, "tp_rank", 0)
}

// fill writes a pattern, distinct per seed, buffer, page and byte, into
// pages and an aux slot.
func (p *sglPool) fill(seed byte, pages []int, auxSlot int) {
	for b := range p.nbuf() {
		for _, pg := range pages {
			pattern(p.page(b, pg), seed, b, pg)
		}
	}
	pattern(p.aux(auxSlot), seed, 99, auxSlot)
}

func pattern(dst []byte, seed byte, b, pg int) {
	for i := range dst {
		dst[i] = seed + byte(b*7+pg*13+i*3)
	}
}

// sameKV checks that decode pages dst hold prefill pages src, buffer by
// buffer, and the aux slots likewise.
func sameKV(t testing.TB, pre *sglPool, src []int, srcAux int, dec *sglPool, dst []int, dstAux int) {
	t.Helper()
	for b := range pre.nbuf() {
		for i := range src {
			if !bytes.Equal(pre.page(b, src[i]), dec.page(b, dst[i])) {
				t.Fatalf("buffer %d: decode page %d does not hold prefill page %d", b, dst[i], src[i])
			}
		}
	}
	if !bytes.Equal(pre.aux(srcAux), dec.aux(dstAux)) {
		t.Fatalf("decode aux slot %d does not hold prefill aux slot %d", dstAux, srcAux)
	}
}

// vllmPool is one vLLM worker's KV cache: one region per KV cache tensor
// in vLLM's registration order (layer 0 K, layer 0 V, layer 1 K, ...),
// each num_blocks blocks of heads × block_size × head_bytes (HND).
type vllmPool struct {
	shm                              *shm
	base                             uint64
	layers, blocks, blockSize, heads int
	hb                               int
}

func newVLLMPool(t testing.TB, layers, blocks, blockSize, heads, headBytes int) *vllmPool {
	p := &vllmPool{layers: layers, blocks: blocks, blockSize: blockSize, heads: heads, hb: headBytes}
	p.shm = newSHM(t, p.nreg()*p.regionLen())
	p.base = engineAddr()
	return p
}

func (p *vllmPool) blockLen() int  { return p.heads * p.blockSize * p.hb }
func (p *vllmPool) regionLen() int { return p.blocks * p.blockLen() }
func (p *vllmPool) nreg() int      { return 2 * p.layers }
func (p *vllmPool) region() M      { return region(p.base, p.nreg()*p.regionLen(), p.shm.name) }

func (p *vllmPool) block(r, b int) []byte {
	o := r*p.regionLen() + b*p.blockLen()
	return p.shm.mem[o : o+p.blockLen()]
}

func (p *vllmPool) fill(seed byte, blocks []int) {
	for r := range p.nreg() {
		for _, b := range blocks {
			pattern(p.block(r, b), seed, r, b)
		}
	}
}

// compat are vLLM's compatibility factors of the test model.
func compat() M {
	return m("vllm_version", "0.13.0", "nixl_connector_version", 2, "model", "kvhost/apiconformance",
		"dtype", "torch.bfloat16", "num_kv_heads", 2, "head_size", 8, "num_hidden_layers", 2,
		"attn_backend_name", "FLASH_ATTN", "cache_dtype", "auto")
}

// fields are open_rank's vLLM fields for the pool.
func (p *vllmPool) fields(role, engine string, tpSize, tpRank int) M {
	var addrs []uint64
	for r := range p.nreg() {
		addrs = append(addrs, p.base+uint64(r*p.regionLen()))
	}
	f := m("style", "vllm", "role", role, "engine_id", engine, "tp_size", tpSize, "tp_rank", tpRank,
		"kv_caches_base_addr", addrs, "region_len", uint64(p.regionLen()), "num_blocks", p.blocks,
		"block_size", p.blockSize, "kv_cache_layout", "HND", "total_kv_heads", p.heads*tpSize, "compat", compat())
	if role == "prefill" {
		f = append(f, F{"side_channel_host", "127.0.0.1"})
	}
	return f
}

func sameBlocks(t testing.TB, pre *vllmPool, src []int, dec *vllmPool, dst []int) {
	t.Helper()
	for r := range pre.nreg() {
		for i := range src {
			if !bytes.Equal(pre.block(r, src[i]), dec.block(r, dst[i])) {
				t.Fatalf("region %d: decode block %d does not hold prefill block %d", r, dst[i], src[i])
			}
		}
	}
}
