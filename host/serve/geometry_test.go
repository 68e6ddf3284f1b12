package serve

import (
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
)

// TestOpenRankGeometry: KV buffers whose lengths do not match the
// declared geometry are refused with `geometry`, buffers outside the
// connection's regions with `bad_region`, aux outside host memory too;
// a refused rank leaves nothing behind (the regions are not busy).
func TestOpenRankGeometry(t *testing.T) {
	s := newTestServer(t, func(c *Config) { c.CUDALibrary = standin(t) })
	c := dial(t, s)
	ctx := testCtx(t)
	r, err := fakeengine.NewRank(shmName(), "decode", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ids, err := c.RegisterMemory(ctx, r.MemRegions())
	if err != nil {
		t.Fatal(err)
	}
	good := r.Args("nixl", "")
	cases := []struct {
		name string
		mod  func(a *client.SGLangRank)
		code string
		msg  string
	}{
		{"not whole pages", func(a *client.SGLangRank) { a.KVDataLens[1]-- }, CodeGeometry, "whole number"},
		{"page counts differ", func(a *client.SGLangRank) { a.KVDataLens[2] -= a.KVItemLens[2] }, CodeGeometry, "pages, buffer 0 holds"},
		{"odd MHA buffers", func(a *client.SGLangRank) {
			a.KVDataPtrs, a.KVDataLens, a.KVItemLens = a.KVDataPtrs[:3], a.KVDataLens[:3], a.KVItemLens[:3]
		}, CodeGeometry, "K then V"},
		{"heads do not divide", func(a *client.SGLangRank) { a.KVHeadNum, a.TotalKVHeadNum = 3, 4 }, CodeGeometry, "do not divide"},
		{"lists of different lengths", func(a *client.SGLangRank) { a.KVItemLens = a.KVItemLens[:1] }, CodeBadRequest, "kv_item_lens"},
		{"outside the regions", func(a *client.SGLangRank) { a.KVDataPtrs[0] += 1 << 40 }, CodeBadRegion, "KV buffer 0"},
		{"past a region's end", func(a *client.SGLangRank) { a.AuxDataLens[0] += 4096 }, CodeBadRegion, "aux buffer 0"},
		{"rank out of range", func(a *client.SGLangRank) { a.TPRank = 3 }, CodeBadRequest, "out of range"},
	}
	for _, x := range cases {
		t.Run(x.name, func(t *testing.T) {
			a := good
			a.KVDataPtrs = append([]uint64(nil), good.KVDataPtrs...)
			a.KVDataLens = append([]uint64(nil), good.KVDataLens...)
			a.KVItemLens = append([]uint64(nil), good.KVItemLens...)
			a.AuxDataLens = append([]uint64(nil), good.AuxDataLens...)
			x.mod(&a)
			_, err := c.OpenSGLang(ctx, a)
			var e *client.Error
			if !asClientError(err, &e) || e.Code != x.code || !strings.Contains(e.Message, x.msg) {
				t.Fatalf("want %s naming %q, got %v", x.code, x.msg, err)
			}
		})
	}
	// Aux in GPU memory: register the pool as VRAM only.
	v, err := fakeengine.NewRank(shmName(), "decode", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	v.VRAM = true
	regs := v.MemRegions()
	vram := regs[len(regs)-1]
	vram.Length += regs[0].Length // the whole pool, aux included
	if _, err := c.RegisterMemory(ctx, []client.Region{vram}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.OpenSGLang(ctx, v.Args("nixl", "")); !client.IsCode(err, CodeBadRegion) || !strings.Contains(err.Error(), "host memory") {
		t.Fatalf("aux in VRAM: %v", err)
	}
	// Nothing was left using the regions.
	if err := c.DeregisterMemory(ctx, ids); err != nil {
		t.Fatalf("regions after refused ranks: %v", err)
	}
}
