package serve

import (
	"fmt"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/planner"
)

// Hybrid-model state of an SGLang rank (docs/engine-api.md, "Ranks"):
// SGLang's KVArgs carries one entry per state component in
// kv_args.state_types, and per component the lists of its tensors
// (state_data_ptrs[i] ...). open_rank takes that form (state_types plus
// lists of lists) or the older single state_type with flat lists, which is
// one component. Room ops carry state indices per component in the same
// order.

// maxStateComponents bounds the components of one rank: SGLang has six
// state types, and a model lists each at most once.
const maxStateComponents = 16

// knownStateTypes are SGLang's StateType values (base/conn.py), each
// handled by the push runtime's state planners.
var knownStateTypes = []planner.StateType{
	planner.StateMamba, planner.StateSWA, planner.StateDSA,
	planner.StateMiniMaxIndexK, planner.StateSWARing, planner.StateC128State,
}

func stateType(name, s string) (planner.StateType, error) {
	for _, t := range knownStateTypes {
		if planner.StateType(s) == t {
			return t, nil
		}
	}
	return "", badValue(name, "%q is not one of mamba, swa, dsa, minimax_index_k, swa_ring, c128_state", s)
}

// strs reads an array of strings.
func (r *request) strs(name string) ([]string, error) {
	v, ok := r.get(name)
	if !ok {
		return nil, missing(name)
	}
	if v.Kind != msgpack.Array {
		return nil, wrongType(name, "array of str", v)
	}
	out := make([]string, len(v.Items))
	for i, it := range v.Items {
		s, ok := it.Str()
		if !ok {
			return nil, errorf(CodeBadRequest, "field %q[%d]: want str, got %v", name, i, it.Kind)
		}
		out[i] = s
	}
	return out, nil
}

// u64Lists reads an array of n arrays of uints (SGLang's List[List[int]]).
// Absent and not required: n empty lists.
func (r *request) u64Lists(name string, n int, required bool) ([][]uint64, error) {
	v, ok := r.get(name)
	if !ok {
		if required {
			return nil, missing(name)
		}
		return make([][]uint64, n), nil
	}
	if v.Kind != msgpack.Array {
		return nil, wrongType(name, "array of arrays of uint", v)
	}
	if len(v.Items) != n {
		return nil, badValue(name, "%d entries for %d state types", len(v.Items), n)
	}
	out := make([][]uint64, n)
	for i, it := range v.Items {
		xs, err := asU64s(fmt.Sprintf("%s[%d]", name, i), it)
		if err != nil {
			return nil, err
		}
		out[i] = xs
	}
	return out, nil
}

// sglStateArgs reads the rank's state components, each tensor inside one
// of the session's regions.
func sglStateArgs(s *session, r *request, rk *rankEntry) ([]push.StateComponent, error) {
	var types []planner.StateType
	var ptrs, lens, items, dims [][]uint64
	switch {
	case r.has("state_types"):
		if r.has("state_type") {
			return nil, errorf(CodeBadRequest, `fields "state_types" and "state_type" are exclusive`)
		}
		names, err := r.strs("state_types")
		if err != nil {
			return nil, err
		}
		if len(names) > maxStateComponents {
			return nil, badValue("state_types", "%d state types (at most %d)", len(names), maxStateComponents)
		}
		seen := map[planner.StateType]bool{}
		for i, n := range names {
			t, err := stateType(fmt.Sprintf("state_types[%d]", i), n)
			if err != nil {
				return nil, err
			}
			if seen[t] {
				return nil, badValue("state_types", "%q is listed twice", n)
			}
			seen[t] = true
			types = append(types, t)
		}
		n := len(types)
		if ptrs, err = r.u64Lists("state_data_ptrs", n, n > 0); err != nil {
			return nil, err
		}
		if lens, err = r.u64Lists("state_data_lens", n, n > 0); err != nil {
			return nil, err
		}
		if items, err = r.u64Lists("state_item_lens", n, n > 0); err != nil {
			return nil, err
		}
		if dims, err = r.u64Lists("state_dim_per_tensor", n, false); err != nil {
			return nil, err
		}
	default:
		st, err := r.optStr("state_type", "none")
		if err != nil || st == "none" {
			return nil, err
		}
		t, err := stateType("state_type", st)
		if err != nil {
			return nil, err
		}
		p, l, it, err := r.lists3("state_data_ptrs", "state_data_lens", "state_item_lens", true)
		if err != nil {
			return nil, err
		}
		d, err := r.optU64s("state_dim_per_tensor")
		if err != nil {
			return nil, err
		}
		types, ptrs, lens, items, dims = []planner.StateType{t}, [][]uint64{p}, [][]uint64{l}, [][]uint64{it}, [][]uint64{d}
	}
	comps := make([]push.StateComponent, len(types))
	for c, t := range types {
		if len(lens[c]) != len(ptrs[c]) || len(items[c]) != len(ptrs[c]) {
			return nil, errorf(CodeBadRequest, "state component %d (%s): %d pointers, %d lengths and %d item lengths", c, t, len(ptrs[c]), len(lens[c]), len(items[c]))
		}
		if len(dims[c]) != 0 && len(dims[c]) != len(ptrs[c]) {
			return nil, errorf(CodeBadRequest, "state component %d (%s): %d dims for %d tensors", c, t, len(dims[c]), len(ptrs[c]))
		}
		comps[c].Type = t
		for i := range ptrs[c] {
			if items[c][i] == 0 || lens[c][i] == 0 || lens[c][i]%items[c][i] != 0 {
				return nil, errorf(CodeGeometry, "state component %d (%s) tensor %d: length %d is not a whole number of %d-byte items", c, t, i, lens[c][i], items[c][i])
			}
			local, reg, err := s.useRegion(rk, fmt.Sprintf("state component %d tensor %d", c, i), ptrs[c][i], lens[c][i])
			if err != nil {
				return nil, err
			}
			if kindOf(reg) != abi.VRAM {
				// SGLang keeps state in GPU memory and the state planners
				// (planner/state.go) move it as such: host memory here
				// would fail every room's state transfer.
				return nil, errorf(CodeBadRegion, "state component %d (%s) tensor %d: state is GPU memory (a vram region, or register_as vram)", c, t, i)
			}
			comps[c].Tensors = append(comps[c].Tensors, push.Buffer{Addr: uint64(local), Len: lens[c][i], ItemLen: items[c][i], Kind: kindOf(reg)})
		}
		for _, d := range dims[c] {
			comps[c].DimPerTensor = append(comps[c].DimPerTensor, int(min(d, 1<<31-1)))
		}
	}
	return comps, nil
}

// stateSlots is, per component, the items every tensor of it holds (the
// bound of its state indices); 0 for a component without tensors on this
// rank (a PP stage without such layers), whose indices touch nothing here.
func stateSlots(comps []push.StateComponent) []uint64 {
	out := make([]uint64, len(comps))
	for c, comp := range comps {
		for i, t := range comp.Tensors {
			if n := t.Len / t.ItemLen; i == 0 || n < out[c] {
				out[c] = n
			}
		}
	}
	return out
}

// stateIndices reads a room op's state_indices: an array with one entry
// (packed int32 indices, or nil) per state component of the rank, or, the
// older form, one packed list for a rank with at most one component.
// Absent, nil or an empty array: no state.
func (sr *sglRank) stateIndices(r *request, name string) ([][]int32, error) {
	v, ok := r.get(name)
	if !ok {
		return nil, nil
	}
	var out [][]int32
	switch v.Kind {
	case msgpack.Bin:
		if len(sr.slots) > 1 {
			return nil, badValue(name, "one index list for %d state components: send one entry per component", len(sr.slots))
		}
		p, err := asPages(name, v.Raw())
		if err != nil {
			return nil, err
		}
		out = [][]int32{p}
	case msgpack.Array:
		if len(v.Items) == 0 {
			return nil, nil
		}
		if len(v.Items) != len(sr.slots) {
			return nil, badValue(name, "%d entries for the rank's %d state components", len(v.Items), len(sr.slots))
		}
		out = make([][]int32, len(v.Items))
		for i, it := range v.Items {
			f := fmt.Sprintf("%s[%d]", name, i)
			switch it.Kind {
			case msgpack.Nil:
				continue
			case msgpack.Bin:
				p, err := asPages(f, it.Raw())
				if err != nil {
					return nil, err
				}
				out[i] = p
			default:
				return nil, wrongType(f, "bin or nil", it)
			}
		}
	default:
		return nil, wrongType(name, "bin, array or nil", v)
	}
	for c, idx := range out {
		if c >= len(sr.slots) || sr.slots[c] == 0 {
			continue
		}
		for i, x := range idx {
			if uint64(x) >= sr.slots[c] {
				return nil, badValue(name, "component %d index %d at %d is outside its %d slots", c, x, i, sr.slots[c])
			}
		}
	}
	return out, nil
}
