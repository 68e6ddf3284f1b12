package planner

// Aux (metadata) buffers: per-request first-token metadata that prefill
// hands to decode on the last chunk (output ids, cached token counts,
// logprobs, hidden states, bootstrap room, ...). Each aux buffer is an
// array of fixed-size slots; one request owns slot prefill_aux_index on the
// prefill side and slot dst_aux_index on the decode side, and every buffer
// copies that one slot (the connectors' send_aux).

// AuxBuffers is one side's aux registration (kv_args.aux_*).
type AuxBuffers struct {
	Ptrs []uint64 // aux_data_ptrs
	// DataLens are the buffers' lengths (aux_data_lens); nil means
	// unknown (the SGLang NIXL wire sends decode aux pointers only).
	DataLens []uint64
	// ItemLens are bytes per slot (aux_item_lens). The connectors use the
	// prefill's for the RDMA copy; the decode's matter only for MORI's TCP
	// fallback, where decode places the bytes itself (empty: the
	// prefill's).
	ItemLens []uint64
}

// Plan paths of the aux planners.
const (
	PathNIXLAux     = "nixl-aux"
	PathMORIAuxRDMA = "mori-aux-rdma"
	PathMORIAuxTCP  = "mori-aux-tcp"
	PathMORIAuxSkip = "mori-aux-skip"
)

// PlanAuxNIXL plans the NIXL connector's send_aux: for every decode aux
// buffer i, prefill item_lens[i] bytes move from prefill slot
// prefillAuxIndex of buffer i to decode slot dstAuxIndex of buffer i (the
// decode offset also scaled by the prefill item length). Buffers are host
// memory (DRAM). Decode registering more aux buffers than prefill is an
// error; fewer sends only the first ones.
func PlanAuxNIXL(src, dst AuxBuffers, prefillAuxIndex, dstAuxIndex int64) (*Plan, error) {
	if len(dst.Ptrs) > len(src.Ptrs) || len(dst.Ptrs) > len(src.ItemLens) {
		return nil, errorf("decode.aux_ptrs", "decode registers %d aux buffers, prefill %d (with %d item lengths)", len(dst.Ptrs), len(src.Ptrs), len(src.ItemLens))
	}
	plan, err := newAuxPlan(PathNIXLAux, src, dst)
	if err != nil {
		return nil, err
	}
	plan.Copies = make([]Copy, 0, len(dst.Ptrs))
	for i := range dst.Ptrs {
		if err = addAuxCopy(plan, i, src.ItemLens[i], src.ItemLens[i], prefillAuxIndex, dstAuxIndex); err != nil {
			return nil, err
		}
	}
	if err := checkPlanBounds(plan, "prefill_aux_index", "dst_aux_index"); err != nil {
		return nil, err
	}
	return plan, nil
}

// PlanAuxMORI plans the MORI connector's send_aux. A negative dstAuxIndex
// means decode wants no aux from this rank: the plan is empty (path
// mori-aux-skip). The reference also sends aux only from the last PP stage;
// that is the caller's decision. With aux buffers on both sides in equal
// number the copies are RDMA writes (path mori-aux-rdma, offsets scaled by
// the prefill item lengths); otherwise the reference falls back to TCP
// (path mori-aux-tcp): prefill ships each of its buffers' slot bytes and
// decode stores them at its own item length times dstAuxIndex, which the
// plan's destination side describes.
func PlanAuxMORI(src, dst AuxBuffers, prefillAuxIndex, dstAuxIndex int64) (*Plan, error) {
	if dstAuxIndex < 0 {
		return newAuxPlan(PathMORIAuxSkip, src, dst)
	}
	if len(src.ItemLens) < len(src.Ptrs) {
		return nil, errorf("prefill.aux_item_lens", "%d item lengths for %d aux buffers", len(src.ItemLens), len(src.Ptrs))
	}
	rdma := len(src.Ptrs) > 0 && len(src.Ptrs) == len(dst.Ptrs)
	path := PathMORIAuxTCP
	if rdma {
		path = PathMORIAuxRDMA
	}
	plan, err := newAuxPlan(path, src, dst)
	if err != nil {
		return nil, err
	}
	plan.Copies = make([]Copy, 0, len(src.Ptrs))
	for i := range src.Ptrs {
		dstItem := src.ItemLens[i]
		if !rdma {
			if i >= len(dst.Ptrs) {
				return nil, errorf("decode.aux_ptrs", "decode has %d aux buffers; prefill sends buffer %d", len(dst.Ptrs), i)
			}
			if len(dst.ItemLens) > 0 {
				if i >= len(dst.ItemLens) {
					return nil, errorf("decode.aux_item_lens", "%d item lengths for aux buffer %d", len(dst.ItemLens), i)
				}
				dstItem = dst.ItemLens[i]
			}
		}
		if err = addAuxCopy(plan, i, src.ItemLens[i], dstItem, prefillAuxIndex, dstAuxIndex); err != nil {
			return nil, err
		}
	}
	if err := checkPlanBounds(plan, "prefill_aux_index", "dst_aux_index"); err != nil {
		return nil, err
	}
	return plan, nil
}

func newAuxPlan(path string, src, dst AuxBuffers) (*Plan, error) {
	s, err := regionTable("prefill.aux_data_lens", src.Ptrs, src.DataLens, DRAM)
	if err != nil {
		return nil, err
	}
	d, err := regionTable("decode.aux_data_lens", dst.Ptrs, dst.DataLens, DRAM)
	if err != nil {
		return nil, err
	}
	return &Plan{Path: path, Src: s, Dst: d}, nil
}

// addAuxCopy adds buffer i's slot copy of srcItem bytes; the decode slot
// offset is dstItem * dstIndex. Empty slots move nothing.
func addAuxCopy(p *Plan, i int, srcItem, dstItem uint64, srcIndex, dstIndex int64) error {
	if srcItem == 0 {
		return nil
	}
	so, err := slotOffset("prefill_aux_index", srcIndex, srcItem, 0)
	if err != nil {
		return err
	}
	do, err := slotOffset("dst_aux_index", dstIndex, dstItem, 0)
	if err != nil {
		return err
	}
	p.Add(Copy{SrcRegion: int32(i), DstRegion: int32(i), SrcOff: so, DstOff: do, Len: srcItem, Count: 1})
	return nil
}
