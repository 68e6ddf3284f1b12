package serve

import (
	"strconv"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// memSpec is one region of register_memory as the engine declared it.
type memSpec struct {
	Kind      string // "dram" or "vram"
	Addr      uint64
	Length    uint64
	SHM       string
	Offset    uint64
	IPCHandle [64]byte
	Device    int
}

// parseRegion reads one element of register_memory's regions.
func parseRegion(i int, v msgpack.Value) (memSpec, error) {
	var s memSpec
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
	s.Kind = kind
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
		x, ok := r.get("shm")
		if !ok {
			return s, missing(name("shm"))
		}
		if s.SHM, ok = x.Str(); !ok {
			return s, wrongType(name("shm"), "str", x)
		}
	case "vram":
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
	return s, nil
}
