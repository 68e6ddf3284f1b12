package apiconformance

import (
	"strings"
	"testing"
)

// TestRegisterMemory: every refusal of register_memory and
// deregister_memory; a refused request registers nothing; regions are
// scoped to their connection.
func TestRegisterMemory(t *testing.T) {
	side := startSidecar(t, "--max-regions", "3")
	c := side.engine(t, "a")
	other := side.engine(t, "b")
	s := newSHM(t, 1<<16)
	base := engineAddr()

	c.fail("register_memory", m(), "bad_request", "regions")
	c.fail("register_memory", m("regions", []any{}), "bad_request", "regions")
	c.fail("register_memory", m("regions", "x"), "bad_request", "regions")
	c.fail("register_memory", m("regions", []any{5}), "bad_request", "regions")
	for _, tc := range []struct {
		r     M
		field string
	}{
		{region(base, 4096, s.name).without("kind"), "kind"},
		{region(base, 4096, s.name).with("kind", "hbm"), "kind"},
		{region(base, 4096, s.name).without("addr"), "addr"},
		{region(0, 4096, s.name), "addr"},
		{region(^uint64(0)-10, 4096, s.name), "addr"},
		{region(base, 4096, s.name).without("length"), "length"},
		{region(base, 0, s.name), "length"},
		{region(base, 4096, s.name).with("length", -5), "length"},
		{region(base, 4096, s.name).without("shm"), "shm"},
		{region(base, 4096, s.name).with("shm", 7), "shm"},
		{region(base, 4096, s.name).with("offset", "0"), "offset"},
		{region(base, 4096, s.name).with("register_as", "hbm"), "register_as"},
		{m("kind", "vram", "addr", base, "length", uint64(4096), "cuda_ipc", make([]byte, 63)), "cuda_ipc"},
		{m("kind", "vram", "addr", base, "length", uint64(4096), "cuda_ipc", make([]byte, 64), "register_as", "dram"), "register_as"},
	} {
		c.fail("register_memory", m("regions", []any{tc.r}), "bad_request", tc.field)
	}
	c.fail("register_memory", m("regions", []any{region(base, 4096, "/kvac-no-such-object")}), "bad_region")
	c.fail("register_memory", m("regions", []any{region(base, 1<<17, s.name)}), "bad_region")
	c.fail("register_memory", m("regions", []any{region(base, 4096, s.name).with("offset", uint64(1<<16-100))}), "bad_region")
	// Overlap within one request; and the whole request is refused when
	// one region is bad: the good one is not registered, so registering
	// it again alone succeeds (it would overlap itself otherwise).
	c.fail("register_memory", m("regions", []any{region(base, 4096, s.name), region(base+100, 4096, s.name)}), "bad_region")
	c.fail("register_memory", m("regions", []any{region(base, 4096, s.name), region(base+8192, 4096, "/kvac-no-such-object")}), "bad_region")
	ids := c.register(region(base, 4096, s.name))
	c.fail("register_memory", m("regions", []any{region(base+4095, 4096, s.name)}), "bad_region")
	// The path form and an offset.
	ids = append(ids, c.register(region(base+8192, 4096, s.path).with("offset", uint64(8192)))...)
	// Another connection has its own regions: the same addresses are fine.
	// (Region ids are numbered per connection: another's may equal one
	// of ours, so only an id of neither says unknown.)
	oid := other.register(region(base, 4096, s.name))
	c.fail("deregister_memory", m("regions", []uint64{oid[0] + 1000}), "unknown")
	// The limit counts this connection's regions (3).
	c.fail("register_memory", m("regions", []any{region(base+3*8192, 4096, s.name), region(base+4*8192, 4096, s.name)}), "limit")
	c.register(region(base+3*8192, 4096, s.name))
	c.fail("register_memory", m("regions", []any{region(base+4*8192, 4096, s.name)}), "limit")
	c.ok("deregister_memory", m("regions", ids))
	c.fail("deregister_memory", m("regions", ids[:1]), "unknown")
	c.fail("deregister_memory", m("regions", "x"), "bad_request", "regions")
	c.register(region(base+4*8192, 4096, s.name))
}

// TestDeregisterBusy: a region a rank uses is busy until the rank
// closes; then the sidecar unmaps it.
func TestDeregisterBusy(t *testing.T) {
	side := startSidecar(t)
	c := side.engine(t, "d")
	p := newSGLPool(t, 1, 4, 2, 1, 8)
	ids := c.register(p.region())
	if !strings.Contains(side.maps(), p.shm.path) {
		t.Fatalf("the sidecar does not map %s after register_memory", p.shm.path)
	}
	rank := must(t, c.ok("open_rank", p.fields("decode")), "rank")
	c.fail("deregister_memory", m("regions", ids), "busy")
	c.ok("close_rank", m("rank", rank))
	c.fail("close_rank", m("rank", rank), "unknown")
	c.ok("deregister_memory", m("regions", ids))
	side.waitUnmapped(p.shm.path)
}
