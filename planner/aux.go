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

// AuxPlanner plans the aux slot copy of one (prefill rank, decode peer)
// pair. Build it once per peer; it is immutable and safe for concurrent
// use.
type AuxPlanner struct {
	nixl     bool
	path     string // NIXL: nixl-aux; MORI: rdma or tcp
	src, dst []Region
	// items are the (prefill, decode) slot lengths of buffers 0..n-1; the
	// copy moves the prefill length.
	items [][2]uint64
}

// NewAuxPlannerNIXL resolves the NIXL connector's send_aux: for every
// decode aux buffer i, prefill item_lens[i] bytes move from the prefill
// slot of buffer i to the decode slot of buffer i (the decode offset also
// scaled by the prefill item length). Buffers are host memory (DRAM).
// Decode registering more aux buffers than prefill is an error; fewer sends
// only the first ones.
func NewAuxPlannerNIXL(src, dst AuxBuffers) (*AuxPlanner, error) {
	if len(dst.Ptrs) > len(src.Ptrs) || len(dst.Ptrs) > len(src.ItemLens) {
		return nil, errorf("decode.aux_ptrs", "decode registers %d aux buffers, prefill %d (with %d item lengths)", len(dst.Ptrs), len(src.Ptrs), len(src.ItemLens))
	}
	a, err := newAuxPlanner(PathNIXLAux, src, dst)
	if err != nil {
		return nil, err
	}
	a.nixl = true
	for i := range dst.Ptrs {
		a.items = append(a.items, [2]uint64{src.ItemLens[i], src.ItemLens[i]})
	}
	return a, nil
}

// NewAuxPlannerMORI resolves the MORI connector's send_aux. With aux
// buffers on both sides in equal number the copies are RDMA writes (path
// mori-aux-rdma, offsets scaled by the prefill item lengths); otherwise the
// reference falls back to TCP (path mori-aux-tcp): prefill ships each of
// its buffers' slot bytes and decode stores them at its own item length
// times its slot, which the plan's destination side describes. The
// reference sends aux only from the last PP stage; that is the caller's
// decision.
func NewAuxPlannerMORI(src, dst AuxBuffers) (*AuxPlanner, error) {
	if len(src.ItemLens) < len(src.Ptrs) {
		return nil, errorf("prefill.aux_item_lens", "%d item lengths for %d aux buffers", len(src.ItemLens), len(src.Ptrs))
	}
	rdma := len(src.Ptrs) > 0 && len(src.Ptrs) == len(dst.Ptrs)
	path := PathMORIAuxTCP
	if rdma {
		path = PathMORIAuxRDMA
	}
	a, err := newAuxPlanner(path, src, dst)
	if err != nil {
		return nil, err
	}
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
		a.items = append(a.items, [2]uint64{src.ItemLens[i], dstItem})
	}
	return a, nil
}

func newAuxPlanner(path string, src, dst AuxBuffers) (*AuxPlanner, error) {
	s, err := regionTable("prefill.aux_data_lens", src.Ptrs, src.DataLens, DRAM)
	if err != nil {
		return nil, err
	}
	d, err := regionTable("decode.aux_data_lens", dst.Ptrs, dst.DataLens, DRAM)
	if err != nil {
		return nil, err
	}
	return &AuxPlanner{path: path, src: s, dst: d}, nil
}

// Plan fills p (reset first, capacity kept) with one request's aux copy:
// slot prefillAuxIndex to slot dstAuxIndex of every buffer. For MORI a
// negative dstAuxIndex means decode wants no aux from this rank: the plan
// is empty (path mori-aux-skip). Slots past a buffer with a known length
// are an error naming the index. Region tables are borrowed from the
// planner.
func (a *AuxPlanner) Plan(p *Plan, prefillAuxIndex, dstAuxIndex int64) error {
	p.Reset()
	p.Src, p.Dst = a.src, a.dst
	if !a.nixl && dstAuxIndex < 0 {
		p.Path = PathMORIAuxSkip
		return nil
	}
	p.Path = a.path
	p.ReferenceDescriptors = uint64(len(a.items))
	inside := len(a.items) <= len(a.src) && len(a.items) <= len(a.dst)
	for i, it := range a.items {
		if it[0] == 0 {
			continue // an empty slot moves nothing
		}
		so, err := slotOffset(namedField("prefill_aux_index"), prefillAuxIndex, it[0], 0)
		if err != nil {
			return err
		}
		do, err := slotOffset(namedField("dst_aux_index"), dstAuxIndex, it[1], 0)
		if err != nil {
			return err
		}
		// Each copy has its own regions, so Add would only append it.
		p.Copies = append(p.Copies, Copy{SrcRegion: int32(i), DstRegion: int32(i), SrcOff: so, DstOff: do, Len: it[0], Count: 1})
		se, ok1 := add64(so, it[0])
		de, ok2 := add64(do, it[0])
		inside = inside && ok1 && ok2 && se <= a.src[i].Len && de <= a.dst[i].Len
	}
	if inside {
		return nil
	}
	// checkPlanBounds names the copy that leaves its buffers.
	return checkPlanBounds(p, namedField("prefill_aux_index"), namedField("dst_aux_index"))
}

// PlanAuxNIXL plans one request with a fresh NewAuxPlannerNIXL.
func PlanAuxNIXL(src, dst AuxBuffers, prefillAuxIndex, dstAuxIndex int64) (*Plan, error) {
	return planAuxOnce(NewAuxPlannerNIXL, src, dst, prefillAuxIndex, dstAuxIndex)
}

// PlanAuxMORI plans one request with a fresh NewAuxPlannerMORI. A negative
// dstAuxIndex skips aux before anything else is looked at, as the
// reference does.
func PlanAuxMORI(src, dst AuxBuffers, prefillAuxIndex, dstAuxIndex int64) (*Plan, error) {
	if dstAuxIndex < 0 {
		s, _ := regionTable("prefill.aux_data_lens", src.Ptrs, nil, DRAM)
		d, _ := regionTable("decode.aux_data_lens", dst.Ptrs, nil, DRAM)
		return &Plan{Path: PathMORIAuxSkip, Src: s, Dst: d}, nil
	}
	return planAuxOnce(NewAuxPlannerMORI, src, dst, prefillAuxIndex, dstAuxIndex)
}

func planAuxOnce(newPlanner func(src, dst AuxBuffers) (*AuxPlanner, error), src, dst AuxBuffers, prefillAuxIndex, dstAuxIndex int64) (*Plan, error) {
	a, err := newPlanner(src, dst)
	if err != nil {
		return nil, err
	}
	p := new(Plan)
	if err := a.Plan(p, prefillAuxIndex, dstAuxIndex); err != nil {
		return nil, err
	}
	return p, nil
}
