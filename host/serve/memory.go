package serve

import (
	"strconv"

	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/serve/engmem"
)

// parseRegion reads one element of register_memory's regions.
func parseRegion(i int, v msgpack.Value) (engmem.Spec, error) {
	var s engmem.Spec
	if v.Kind != msgpack.Map {
		return s, errorf(CodeBadRequest, "field \"regions\"[%d]: want map, got %v", i, v.Kind)
	}
	r := &request{m: v}
	name := func(f string) string { return "regions[" + strconv.Itoa(i) + "]." + f }
	var err error
	get := func(f string) (uint64, error) {
		x, ok := r.get(f)
		if !ok {
			return 0, missing(name(f))
		}
		return asU64(name(f), x)
	}
	kv, ok := r.get("kind")
	if !ok {
		return s, missing(name("kind"))
	}
	kind, ok := kv.Str()
	if !ok {
		return s, wrongType(name("kind"), "str", kv)
	}
	if s.Addr, err = get("addr"); err != nil {
		return s, err
	}
	if s.Length, err = get("length"); err != nil {
		return s, err
	}
	if s.Length == 0 {
		return s, badValue(name("length"), "zero")
	}
	if s.Addr == 0 || s.Addr+s.Length < s.Addr {
		return s, badValue(name("addr"), "%#x with length %d is not a valid range", s.Addr, s.Length)
	}
	if r.has("offset") {
		if s.Offset, err = get("offset"); err != nil {
			return s, err
		}
	}
	switch kind {
	case "dram":
		s.Kind = engmem.DRAM
		x, ok := r.get("shm")
		if !ok {
			return s, missing(name("shm"))
		}
		if s.SHM, ok = x.Str(); !ok {
			return s, wrongType(name("shm"), "str", x)
		}
	case "vram":
		s.Kind = engmem.VRAM
		x, ok := r.get("cuda_ipc")
		if !ok {
			return s, missing(name("cuda_ipc"))
		}
		h, ok := x.Bin()
		if !ok {
			return s, wrongType(name("cuda_ipc"), "bin", x)
		}
		if len(h) != 64 {
			return s, badValue(name("cuda_ipc"), "%d bytes, want 64", len(h))
		}
		copy(s.IPCHandle[:], h)
		if r.has("device") {
			d, err := get("device")
			if err != nil {
				return s, err
			}
			if d > 1<<16 {
				return s, badValue(name("device"), "%d is out of range", d)
			}
			s.Device = int(d)
		}
	default:
		return s, badValue(name("kind"), "%q is neither dram nor vram", kind)
	}
	if x, ok := r.get("register_as"); ok {
		as, ok := x.Str()
		if !ok {
			return s, wrongType(name("register_as"), "str", x)
		}
		switch {
		case as == "vram":
			s.AsVRAM = s.Kind == engmem.DRAM
		case as == "dram" && s.Kind == engmem.DRAM:
		case as == "dram":
			return s, badValue(name("register_as"), "\"dram\" for a vram region: GPU memory is registered as VRAM")
		default:
			return s, badValue(name("register_as"), "%q is neither dram nor vram", as)
		}
	}
	return s, nil
}
