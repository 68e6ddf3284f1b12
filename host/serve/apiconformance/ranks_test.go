package apiconformance

import (
	"strings"
	"testing"
)

// TestOpenRankSGLang: every refusal of an SGLang open_rank, the field it
// names, and the fields a decode rank must give (tp_size, tp_rank,
// kv_head_num): refused up front rather than failing at the first
// transfer.
func TestOpenRankSGLang(t *testing.T) {
	side := startSidecar(t, "--max-ranks", "2")
	c := side.engine(t, "s")
	p := newSGLPool(t, 2, 8, 2, 2, 8)
	c.register(p.region())
	d := p.fields("decode")

	c.fail("open_rank", d.without("style"), "bad_request", "style")
	c.fail("open_rank", d.with("style", "trtllm"), "unsupported", "trtllm")
	c.fail("open_rank", d.without("role"), "bad_request", "role")
	c.fail("open_rank", d.with("role", "both"), "bad_request", "role")
	for _, f := range []string{"tp_size", "tp_rank", "kv_head_num", "kv_data_ptrs", "kv_data_lens", "kv_item_lens"} {
		c.fail("open_rank", d.without(f), "bad_request", f)
	}
	c.fail("open_rank", d.with("kv_head_num", 0), "bad_request", "kv_head_num")
	c.fail("open_rank", d.without("page_size"), "bad_request", "page_size")
	c.fail("open_rank", d.with("page_size", 0), "bad_request", "page_size")
	c.fail("open_rank", d.with("tp_rank", 1), "bad_request", "tp")
	c.fail("open_rank", d.with("tp_rank", "0"), "bad_request", "tp_rank")
	c.fail("open_rank", d.with("is_mla", 1), "bad_request", "is_mla")
	c.fail("open_rank", d.with("variant", "ucx"), "bad_request", "variant")
	c.fail("open_rank", d.with("host", "localhost"), "bad_request", "host")
	c.fail("open_rank", d.with("state_type", "lstm"), "bad_request", "state_type")
	c.fail("open_rank", d.with("kv_item_lens", []uint64{32, 32, 32}), "bad_request", "kv_item_lens")
	c.fail("open_rank", d.with("kv_data_ptrs", []uint64{}).with("kv_data_lens", []uint64{}).with("kv_item_lens", []uint64{}), "bad_request", "kv_data_ptrs")
	// Geometry: lengths against the declared geometry.
	lens := []uint64{uint64(p.bufLen()), uint64(p.bufLen()), uint64(p.bufLen()), uint64(p.bufLen() - 1)}
	c.fail("open_rank", d.with("kv_data_lens", lens), "geometry")
	lens[3] = uint64(p.bufLen() / 2)
	c.fail("open_rank", d.with("kv_data_lens", lens), "geometry")
	odd := d.with("kv_data_ptrs", []uint64{p.base, p.base + uint64(p.bufLen()), p.base + 2*uint64(p.bufLen())}).
		with("kv_data_lens", lens[:3]).with("kv_item_lens", []uint64{uint64(p.itemLen()), uint64(p.itemLen()), uint64(p.itemLen())})
	c.fail("open_rank", odd, "geometry")
	c.fail("open_rank", d.with("kv_head_num", 3).with("total_kv_head_num", 2), "geometry")
	// Buffers outside the connection's regions.
	far := d.with("kv_data_ptrs", []uint64{p.base, p.base + uint64(p.bufLen()), p.base + 2*uint64(p.bufLen()), p.base + 1<<30})
	c.fail("open_rank", far, "bad_region")
	c.fail("open_rank", d.with("aux_data_ptrs", []uint64{p.base + 1<<30}), "bad_region")
	// A prefill rank needs its bootstrap server.
	c.fail("open_rank", p.fields("prefill"), "bad_request", "bootstrap_addr")

	// Another connection's regions are not this one's.
	o := side.engine(t, "o")
	o.fail("open_rank", d, "bad_region")

	// Ranks per connection (2).
	r1 := must(t, c.ok("open_rank", d), "rank")
	q := newSGLPool(t, 2, 8, 2, 2, 8)
	c.register(q.region())
	r2 := must(t, c.ok("open_rank", q.fields("decode")), "rank")
	if r1 == r2 {
		t.Fatalf("two ranks got id %d", r1)
	}
	c.fail("open_rank", q.fields("decode"), "limit")
	o.fail("close_rank", m("rank", r1), "unknown")
	c.ok("close_rank", m("rank", r2))
	c.ok("open_rank", q.fields("decode"))
}

// TestOpenRankVLLM: every refusal of a vLLM open_rank and the field it
// names; one engine's ranks must agree; a connection names one engine.
func TestOpenRankVLLM(t *testing.T) {
	side := startSidecar(t)
	c := side.engine(t, "v")
	p := newVLLMPool(t, 2, 8, 4, 2, 8)
	c.register(p.region())
	d := p.fields("decode", "E", 1, 0)
	for _, f := range []string{"engine_id", "tp_size", "tp_rank", "kv_caches_base_addr", "region_len", "num_blocks", "block_size", "compat", "total_kv_heads"} {
		c.fail("open_rank", d.without(f), "bad_request", f)
	}
	for _, f := range []string{"vllm_version", "model", "dtype", "num_kv_heads", "head_size", "num_hidden_layers", "attn_backend_name", "cache_dtype"} {
		c.fail("open_rank", d.with("compat", compat().without(f)), "bad_request", "compat."+f)
	}
	// nixl_connector_version selects the wire generation (absent: 2); one
	// kvhost does not speak is unsupported, naming it and those it speaks.
	c.fail("open_rank", d.with("compat", compat().with("nixl_connector_version", 7)), "unsupported", "7", "2, 6, 10, 11, 12")
	c.fail("open_rank", d.with("compat", compat().with("num_kv_heads", "2")), "bad_request", "compat.num_kv_heads")
	c.fail("open_rank", d.with("compat", compat().with("model", 3)), "bad_request", "compat.model")
	c.fail("open_rank", d.with("engine_id", ""), "bad_request", "engine_id")
	c.fail("open_rank", d.with("engine_id", strings.Repeat("e", 1025)), "bad_request", "engine_id")
	c.fail("open_rank", d.with("tp_rank", 1), "bad_request", "tp_rank")
	c.fail("open_rank", d.with("kv_cache_layout", "HDN"), "bad_request", "kv_cache_layout")
	c.fail("open_rank", d.with("abort_timeout", "x").with("role", "prefill"), "bad_request", "abort_timeout")
	c.fail("open_rank", d.with("num_blocks", 0), "geometry")
	c.fail("open_rank", d.with("region_len", uint64(p.regionLen()-1)), "geometry")
	c.fail("open_rank", d.with("kv_caches_base_addr", []uint64{p.base + 1<<30}), "bad_region")
	// MLA needs no head count.
	c.ok("open_rank", p.fields("decode", "E", 1, 0).without("total_kv_heads").with("is_mla", true))
	// The connection is bound to engine E now.
	q := newVLLMPool(t, 2, 8, 4, 2, 8)
	c.register(q.region())
	c.fail("open_rank", q.fields("decode", "F", 1, 0), "unknown", "E")
	c.fail("hold", m("engine_id", "F", "request_id", "r", "block_ids", i32s(0)), "unknown")

	// One prefill engine from two connections: the ranks must agree.
	a := side.engine(t, "p0")
	b := side.engine(t, "p1")
	pa := newVLLMPool(t, 2, 8, 4, 1, 8)
	pb := newVLLMPool(t, 2, 8, 4, 1, 8)
	a.register(pa.region())
	b.register(pb.region())
	a.ok("open_rank", pa.fields("prefill", "P", 2, 0))
	b.fail("open_rank", pb.fields("prefill", "P", 2, 0), "exists")
	b.fail("open_rank", pb.fields("prefill", "P", 4, 1), "bad_request", "tp_size")
	b.fail("open_rank", pb.fields("prefill", "P", 2, 1).with("compat", compat().with("model", "other")), "bad_request", "compat")
	b.fail("open_rank", pb.fields("prefill", "P", 2, 1).with("side_channel_port", 1), "bad_request", "side_channel")
	b.fail("open_rank", pb.fields("prefill", "P", 2, 1).with("abort_timeout", 5.0), "bad_request", "abort_timeout")
	b.ok("open_rank", pb.fields("prefill", "P", 2, 1))
}
