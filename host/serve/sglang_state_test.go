package serve

import (
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
)

// stateArgs is a rank with SGLang's hybrid state as two components, a
// Mamba slot pool (16 slots of 64 bytes per tensor) and SWA pages (16
// pages of 256 bytes per tensor), carved out of another pool, mem (the
// plugin refuses overlapping registrations).
func stateArgs(r, mem *fakeengine.Rank, bootstrap string) client.SGLangRank {
	a := r.Args("nixl", bootstrap)
	b := mem.Base()
	a.State = []client.StateComponent{
		{Type: "mamba", DataPtrs: []uint64{b, b + 1024}, DataLens: []uint64{1024, 1024}, ItemLens: []uint64{64, 64}, DimPerTensor: []uint64{4, 4}},
		{Type: "swa", DataPtrs: []uint64{b + 2048, b + 6144}, DataLens: []uint64{4096, 4096}, ItemLens: []uint64{256, 256}},
	}
	return a
}

// TestOpenRankStateComponents: open_rank takes several state components
// (state_types with lists of lists, SGLang's KVArgs) and refuses malformed
// ones naming the field; the older single state_type form still opens.
func TestOpenRankStateComponents(t *testing.T) {
	s := newTestServer(t)
	c := dial(t, s)
	ctx := testCtx(t)
	r, err := fakeengine.NewRank(shmName(), "decode", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	mem, err := fakeengine.NewRank(shmName(), "decode", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	mem.RegisterAs = "vram" // SGLang's state is GPU memory
	if _, err := c.RegisterMemory(ctx, append(r.MemRegions(), mem.MemRegions()...)); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		mod  func(a *client.SGLangRank)
		code string
		msg  string
	}{
		{"unknown type", func(a *client.SGLangRank) { a.State[1].Type = "nsa" }, CodeBadRequest, "state_types[1]"},
		{"type twice", func(a *client.SGLangRank) { a.State[1].Type = "mamba" }, CodeBadRequest, "twice"},
		{"lens short", func(a *client.SGLangRank) { a.State[0].DataLens = a.State[0].DataLens[:1] }, CodeBadRequest, "state component 0"},
		{"dims short", func(a *client.SGLangRank) { a.State[0].DimPerTensor = []uint64{4} }, CodeBadRequest, "dims"},
		{"not whole items", func(a *client.SGLangRank) { a.State[1].DataLens[1] = 4000 }, CodeGeometry, "tensor 1"},
		{"outside the regions", func(a *client.SGLangRank) { a.State[1].DataPtrs[0] += 1 << 40 }, CodeBadRegion, "state component 1 tensor 0"},
		{"state in host memory", func(a *client.SGLangRank) {
			a.State[0].DataPtrs = []uint64{r.Base(), r.Base() + 1024} // the KV pool: a dram region
		}, CodeBadRegion, "GPU memory"},
		{"both forms", func(a *client.SGLangRank) {
			a.StateType = "swa" // sent only without State: add it by hand below
		}, CodeBadRequest, "exclusive"},
	}
	for _, x := range cases {
		t.Run(x.name, func(t *testing.T) {
			a := stateArgs(r, mem, "")
			x.mod(&a)
			var err error
			if a.StateType != "" {
				f := map[string]any{"style": "sglang", "role": "decode", "kv_data_ptrs": a.KVDataPtrs, "kv_data_lens": a.KVDataLens,
					"kv_item_lens": a.KVItemLens, "page_size": a.PageSize, "kv_head_num": a.KVHeadNum, "tp_size": 1, "tp_rank": 0,
					"state_type": "swa", "state_types": []string{"swa"}}
				_, err = c.OpenRank(ctx, f)
			} else {
				_, err = c.OpenSGLang(ctx, a)
			}
			var e *client.Error
			if !asClientError(err, &e) || e.Code != x.code || !strings.Contains(e.Message, x.msg) {
				t.Fatalf("want %s naming %q, got %v", x.code, x.msg, err)
			}
		})
	}
	rk, err := c.OpenSGLang(ctx, stateArgs(r, mem, ""))
	if err != nil {
		t.Fatalf("two state components: %v", err)
	}
	if err := c.CloseRank(ctx, rk.ID); err != nil {
		t.Fatal(err)
	}
	old := r.Args("nixl", "")
	old.StateType, old.StateDataPtrs, old.StateDataLens, old.StateItemLens = "swa", []uint64{mem.Base()}, []uint64{4096}, []uint64{256}
	if _, err := c.OpenSGLang(ctx, old); err != nil {
		t.Fatalf("the single state_type form: %v", err)
	}
}

// TestStateIndicesChecked: a room op's state indices are one entry per
// component of the rank, each inside the component's slots; anything else
// is bad_request naming the field, and the room is untouched.
func TestStateIndicesChecked(t *testing.T) {
	s := newTestServer(t)
	c := dial(t, s)
	ctx := testCtx(t)
	boot, err := c.StartBootstrap(ctx, "127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	r, err := fakeengine.NewRank(shmName(), "prefill", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	mem, err := fakeengine.NewRank(shmName(), "decode", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	mem.RegisterAs = "vram" // SGLang's state is GPU memory
	if _, err := c.RegisterMemory(ctx, append(r.MemRegions(), mem.MemRegions()...)); err != nil {
		t.Fatal(err)
	}
	rk, err := c.OpenSGLang(ctx, stateArgs(r, mem, boot))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.SenderCreate(ctx, rk.ID, 7); err != nil {
		t.Fatal(err)
	}
	if err := c.SenderInit(ctx, rk.ID, 7, 2, 0); err != nil {
		t.Fatal(err)
	}
	bad := []struct {
		name  string
		state [][]int32
		msg   string
	}{
		{"one entry for two components", [][]int32{{1}}, "2 state components"},
		{"three entries", [][]int32{{1}, {2}, {3}}, "2 state components"},
		{"mamba slot outside", [][]int32{{16}, {0}}, "component 0 index 16"},
		{"swa page outside", [][]int32{{1}, {0, 16}}, "component 1 index 16"},
	}
	for _, x := range bad {
		err := c.SenderSendStates(ctx, rk.ID, 7, []int32{0, 1}, x.state)
		if !client.IsCode(err, CodeBadRequest) || !strings.Contains(err.Error(), x.msg) {
			t.Errorf("%s: want bad_request naming %q, got %v", x.name, x.msg, err)
		}
	}
	// The older single packed list cannot say which component it is for.
	if err := c.SenderSend(ctx, rk.ID, 7, []int32{0, 1}, []int32{1}); !client.IsCode(err, CodeBadRequest) || !strings.Contains(err.Error(), "one entry per component") {
		t.Errorf("one packed list for two components: %v", err)
	}
	// decode_prefix_len is not known before decode's transfer info.
	if _, err := c.SenderPrefixLen(ctx, rk.ID, 7); !client.IsCode(err, CodeOutOfOrder) {
		t.Errorf("sender_prefix_len while Bootstrapping: %v", err)
	}
	st, _, err := c.Poll(ctx, rk.ID, []uint64{7})
	if err != nil || st[0] != client.StateBootstrapping {
		t.Fatalf("room after refused sends: %v %v", st, err)
	}
	// In range, one entry per component (nil for none): accepted.
	if err := c.SenderSendStates(ctx, rk.ID, 7, []int32{0, 1}, [][]int32{{15}, nil}); err != nil {
		t.Fatalf("valid state indices: %v", err)
	}
	// The decode side's receiver_init is checked the same way, once its
	// room is WaitingForInput (a decode rank of another connection).
	dc := dial(t, s)
	w := fakeengine.Watch(dc)
	dr, err := fakeengine.NewRank(shmName(), "decode", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer dr.Close()
	dmem, err := fakeengine.NewRank(shmName(), "decode", smallShape, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer dmem.Close()
	dmem.RegisterAs = "vram"
	if _, err := dc.RegisterMemory(ctx, append(dr.MemRegions(), dmem.MemRegions()...)); err != nil {
		t.Fatal(err)
	}
	drk, err := dc.OpenSGLang(ctx, stateArgs(dr, dmem, ""))
	if err != nil {
		t.Fatal(err)
	}
	if err := dc.ReceiverCreate(ctx, drk.ID, 7, boot, -1); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Wait(ctx, drk.ID, 7, client.StateWaitingForInput); err != nil {
		t.Fatal(err)
	}
	if err := dc.ReceiverInitStates(ctx, drk.ID, 7, []int32{0, 1}, 0, [][]int32{{1}, {3, 16}}, 0); !client.IsCode(err, CodeBadRequest) || !strings.Contains(err.Error(), "component 1 index 16") {
		t.Fatalf("receiver_init with an SWA page outside: %v", err)
	}
	if err := dc.ReceiverInitStates(ctx, drk.ID, 7, []int32{0, 1}, 0, [][]int32{{1}, nil}, 0); err != nil {
		t.Fatalf("receiver_init with valid state indices: %v", err)
	}
}

// FuzzStateIndices: whatever an engine sends as state_indices, the answer
// is an error or one index list per component of the rank (the older
// single list only for at most one component), every index non-negative
// and inside its component's slots.
func FuzzStateIndices(f *testing.F) {
	f.Add(req("op", "sender_send", "seq", 1, "state_indices", []any{[]byte{1, 0, 0, 0}, nil}), uint8(2))
	f.Add(req("op", "sender_send", "seq", 1, "state_indices", []byte{5, 0, 0, 0, 9, 0, 0, 0}), uint8(1))
	f.Add(req("op", "sender_send", "seq", 1, "state_indices", []any{}), uint8(3))
	f.Add(req("op", "sender_send", "seq", 1, "state_indices", []any{[]byte{0xff, 0xff, 0xff, 0x7f}, []byte{1, 0, 0}}), uint8(2))
	f.Add(req("op", "sender_send", "seq", 1, "state_indices", "x"), uint8(0))
	f.Fuzz(func(t *testing.T, b []byte, n uint8) {
		r, _, err := parseRequest(b)
		if err != nil {
			return
		}
		sr := &sglRank{slots: make([]uint64, n%4)}
		for i := range sr.slots {
			sr.slots[i] = uint64(3 * i) // component 0 has no tensors here: unchecked
		}
		out, err := sr.stateIndices(r, "state_indices")
		if err != nil || out == nil {
			return
		}
		if len(out) != len(sr.slots) && !(len(out) == 1 && len(sr.slots) <= 1) {
			t.Fatalf("%d lists for %d components", len(out), len(sr.slots))
		}
		for c, idx := range out {
			for _, x := range idx {
				if x < 0 || (c < len(sr.slots) && sr.slots[c] > 0 && uint64(x) >= sr.slots[c]) {
					t.Fatalf("component %d index %d accepted (slots %v)", c, x, sr.slots)
				}
			}
		}
	})
}
