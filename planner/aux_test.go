package planner

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

// bFieldErr asserts err is an *Error for field (prefix match, so
// "decode_state_indices" matches "decode_state_indices[1]") whose message
// contains msg.
func bFieldErr(t *testing.T, err error, field, msg string) {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("want *Error for %s, got %v", field, err)
	}
	if !strings.HasPrefix(e.Field, field) || !strings.Contains(e.Msg, msg) {
		t.Fatalf("want error %s: ...%s..., got %v", field, msg, err)
	}
}

// bCheckPlan validates p and compares its copies.
func bCheckPlan(t *testing.T, p *Plan, path string, want []Copy) {
	t.Helper()
	if err := p.Validate(); err != nil {
		t.Fatalf("invalid plan: %v", err)
	}
	if p.Path != path {
		t.Fatalf("path %q, want %q", p.Path, path)
	}
	if len(want) == 0 && len(p.Copies) == 0 {
		return
	}
	if !reflect.DeepEqual(p.Copies, want) {
		t.Fatalf("copies\n got %+v\nwant %+v", p.Copies, want)
	}
}

func plain(src, dst int32, so, do, n uint64) Copy {
	return Copy{SrcRegion: src, DstRegion: dst, SrcOff: so, DstOff: do, Len: n, Count: 1}
}

func TestPlanAuxNIXL(t *testing.T) {
	src := AuxBuffers{Ptrs: []uint64{0x1000, 0x2000, 0x3000}, ItemLens: []uint64{16, 64, 0}, DataLens: []uint64{1600, 6400, 100}}
	dst := AuxBuffers{Ptrs: []uint64{0x9000, 0xa000, 0xb000}}
	p, err := PlanAuxNIXL(src, dst, 3, 5)
	if err != nil {
		t.Fatal(err)
	}
	// Slot 3 of 16 bytes -> slot 5 (offset scaled by the prefill length);
	// the empty third buffer moves nothing.
	bCheckPlan(t, p, PathNIXLAux, []Copy{plain(0, 0, 48, 80, 16), plain(1, 1, 192, 320, 64)})
	if p.Src[0].Kind != DRAM || p.Dst[1].Kind != DRAM {
		t.Fatal("aux buffers are host memory")
	}
	if p.Dst[0].Len == 0 || p.Src[0].Len != 1600 {
		t.Fatalf("regions %+v %+v", p.Src[0], p.Dst[0])
	}

	// Decode with fewer buffers: only those are sent.
	p, err = PlanAuxNIXL(src, AuxBuffers{Ptrs: dst.Ptrs[:1]}, 3, 5)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, p, PathNIXLAux, []Copy{plain(0, 0, 48, 80, 16)})

	// More decode buffers than prefill: SGLang's disaggregation/{nixl,mori}/conn.py fails on the lookup.
	_, err = PlanAuxNIXL(src, AuxBuffers{Ptrs: append(dst.Ptrs, 0xc000)}, 3, 5)
	bFieldErr(t, err, "decode.aux_ptrs", "decode registers 4 aux buffers")
	_, err = PlanAuxNIXL(src, dst, -1, 5)
	bFieldErr(t, err, "prefill_aux_index", "negative")
	_, err = PlanAuxNIXL(src, dst, 100, 5) // past the 1600-byte buffer
	bFieldErr(t, err, "prefill_aux_index", "leaves the prefill buffers")
	_, err = PlanAuxNIXL(src, AuxBuffers{Ptrs: dst.Ptrs, DataLens: []uint64{90, 90, 90}}, 3, 5)
	bFieldErr(t, err, "dst_aux_index", "leaves the decode buffers")
	_, err = PlanAuxNIXL(src, AuxBuffers{Ptrs: dst.Ptrs, DataLens: []uint64{1}}, 3, 5)
	bFieldErr(t, err, "decode.aux_data_lens", "1 lengths for 3 pointers")
	_, err = PlanAuxNIXL(src, dst, 1<<62, 5)
	bFieldErr(t, err, "prefill_aux_index", "overflows")
}

func TestPlanAuxMORI(t *testing.T) {
	src := AuxBuffers{Ptrs: []uint64{0x1000, 0x2000}, ItemLens: []uint64{16, 64}}
	dst := AuxBuffers{Ptrs: []uint64{0x9000, 0xa000}, ItemLens: []uint64{32, 64}}
	p, err := PlanAuxMORI(src, dst, 2, 4)
	if err != nil {
		t.Fatal(err)
	}
	// RDMA: equal buffer counts, offsets scaled by the prefill lengths.
	bCheckPlan(t, p, PathMORIAuxRDMA, []Copy{plain(0, 0, 32, 64, 16), plain(1, 1, 128, 256, 64)})

	// TCP fallback (decode has one more buffer): decode stores the bytes at
	// its own item length times its slot.
	dst3 := AuxBuffers{Ptrs: []uint64{0x9000, 0xa000, 0xb000}, ItemLens: []uint64{32, 128, 8}}
	p, err = PlanAuxMORI(src, dst3, 2, 4)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, p, PathMORIAuxTCP, []Copy{plain(0, 0, 32, 128, 16), plain(1, 1, 128, 512, 64)})
	// Without decode item lengths, the prefill's are assumed.
	p, err = PlanAuxMORI(src, AuxBuffers{Ptrs: dst3.Ptrs}, 2, 4)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, p, PathMORIAuxTCP, []Copy{plain(0, 0, 32, 64, 16), plain(1, 1, 128, 256, 64)})

	// No aux wanted: nothing to send.
	p, err = PlanAuxMORI(src, dst, 2, -1)
	if err != nil {
		t.Fatal(err)
	}
	bCheckPlan(t, p, PathMORIAuxSkip, nil)
	if len(p.Copies) != 0 {
		t.Fatal("skip plan has copies")
	}

	// TCP with fewer decode buffers: decode cannot place buffer 1.
	_, err = PlanAuxMORI(src, AuxBuffers{Ptrs: dst.Ptrs[:1]}, 2, 4)
	bFieldErr(t, err, "decode.aux_ptrs", "prefill sends buffer 1")
	_, err = PlanAuxMORI(AuxBuffers{Ptrs: src.Ptrs, ItemLens: src.ItemLens[:1]}, dst, 2, 4)
	bFieldErr(t, err, "prefill.aux_item_lens", "1 item lengths for 2")
	_, err = PlanAuxMORI(src, dst, -2, 4)
	bFieldErr(t, err, "prefill_aux_index", "negative")
}
