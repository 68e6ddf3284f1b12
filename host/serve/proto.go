package serve

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// request is one decoded request: its op, seq and fields. The getters
// return a bad_request *Error naming the field for a missing field or one
// of the wrong type, so handlers read fields in one line each.
type request struct {
	op  string
	seq uint64
	m   msgpack.Value
}

// parseRequest decodes a request frame. seqOK reports whether seq could be
// read (else the error reply carries seq nil).
func parseRequest(b []byte) (r *request, seqOK bool, err error) {
	v, derr := msgpack.Decode(b)
	if derr != nil {
		return nil, false, errorf(CodeBadRequest, "not a msgpack message: %v", derr)
	}
	if v.Kind != msgpack.Map {
		return nil, false, errorf(CodeBadRequest, "a request is a msgpack map, got %v", v.Kind)
	}
	r = &request{m: v}
	sv, ok := v.Get("seq")
	if !ok || sv.Kind == msgpack.Nil {
		return nil, false, errorf(CodeBadRequest, `field "seq" is missing`)
	}
	if r.seq, ok = sv.Uint(); !ok {
		return nil, false, errorf(CodeBadRequest, `field "seq": want uint, got %v`, sv.Kind)
	}
	if r.op, err = r.str("op"); err != nil {
		return r, true, err
	}
	return r, true, nil
}

// get returns a field; nil values count as absent.
func (r *request) get(name string) (msgpack.Value, bool) {
	v, ok := r.m.Get(name)
	if !ok || v.Kind == msgpack.Nil {
		return msgpack.Value{}, false
	}
	return v, true
}

func missing(name string) error { return errorf(CodeBadRequest, "field %q is missing", name) }

func wrongType(name, want string, v msgpack.Value) error {
	return errorf(CodeBadRequest, "field %q: want %s, got %v", name, want, v.Kind)
}

func badValue(name, format string, args ...any) error {
	return errorf(CodeBadRequest, "field %q: %s", name, fmt.Sprintf(format, args...))
}

func (r *request) has(name string) bool { _, ok := r.get(name); return ok }

func (r *request) u64(name string) (uint64, error) {
	v, ok := r.get(name)
	if !ok {
		return 0, missing(name)
	}
	return asU64(name, v)
}

func asU64(name string, v msgpack.Value) (uint64, error) {
	n, ok := v.Uint()
	if !ok {
		if v.Kind == msgpack.Int {
			return 0, badValue(name, "negative")
		}
		return 0, wrongType(name, "uint", v)
	}
	return n, nil
}

func (r *request) optU64(name string, def uint64) (uint64, error) {
	if !r.has(name) {
		return def, nil
	}
	return r.u64(name)
}

// int reads a non-negative int that fits an int32 (counts, ranks, sizes).
func (r *request) int(name string) (int, error) {
	n, err := r.u64(name)
	if err != nil {
		return 0, err
	}
	if n > math.MaxInt32 {
		return 0, badValue(name, "%d is out of range", n)
	}
	return int(n), nil
}

func (r *request) optInt(name string, def int) (int, error) {
	if !r.has(name) {
		return def, nil
	}
	return r.int(name)
}

// i64 reads a signed int64 (page and aux indices may be -1 in SGLang).
func (r *request) i64(name string) (int64, error) {
	v, ok := r.get(name)
	if !ok {
		return 0, missing(name)
	}
	n, ok := v.Int()
	if !ok {
		return 0, wrongType(name, "int", v)
	}
	return n, nil
}

func (r *request) optI64(name string, def int64) (int64, error) {
	if !r.has(name) {
		return def, nil
	}
	return r.i64(name)
}

func (r *request) str(name string) (string, error) {
	v, ok := r.get(name)
	if !ok {
		return "", missing(name)
	}
	s, ok := v.Str()
	if !ok {
		return "", wrongType(name, "str", v)
	}
	return s, nil
}

func (r *request) optStr(name, def string) (string, error) {
	if !r.has(name) {
		return def, nil
	}
	return r.str(name)
}

func (r *request) bool(name string, def bool) (bool, error) {
	v, ok := r.get(name)
	if !ok {
		return def, nil
	}
	b, ok := v.Bool()
	if !ok {
		return false, wrongType(name, "bool", v)
	}
	return b, nil
}

func (r *request) bin(name string) ([]byte, error) {
	v, ok := r.get(name)
	if !ok {
		return nil, missing(name)
	}
	b, ok := v.Bin()
	if !ok {
		return nil, wrongType(name, "bin", v)
	}
	return b, nil
}

// u64s reads an array of uints.
func (r *request) u64s(name string) ([]uint64, error) {
	v, ok := r.get(name)
	if !ok {
		return nil, missing(name)
	}
	return asU64s(name, v)
}

func asU64s(name string, v msgpack.Value) ([]uint64, error) {
	if v.Kind != msgpack.Array {
		return nil, wrongType(name, "array of uint", v)
	}
	out := make([]uint64, len(v.Items))
	for i, it := range v.Items {
		n, ok := it.Uint()
		if !ok {
			return nil, errorf(CodeBadRequest, "field %q[%d]: want uint, got %v", name, i, it.Kind)
		}
		out[i] = n
	}
	return out, nil
}

func (r *request) optU64s(name string) ([]uint64, error) {
	if !r.has(name) {
		return nil, nil
	}
	return r.u64s(name)
}

// pages reads packed little-endian int32 page indices (docs/engine-api.md:
// numpy.asarray(x, dtype="<i4").tobytes()). Negative indices are refused.
func (r *request) pages(name string) ([]int32, error) {
	b, err := r.bin(name)
	if err != nil {
		return nil, err
	}
	return asPages(name, b)
}

func asPages(name string, b []byte) ([]int32, error) {
	if len(b)%4 != 0 {
		return nil, badValue(name, "%d bytes is not a whole number of int32", len(b))
	}
	out := make([]int32, len(b)/4)
	for i := range out {
		p := int32(binary.LittleEndian.Uint32(b[4*i:]))
		if p < 0 {
			return nil, badValue(name, "page %d at index %d is negative", p, i)
		}
		out[i] = p
	}
	return out, nil
}

// rooms reads packed little-endian uint64 room ids, at most max of them
// (checked before anything is allocated).
func (r *request) rooms(name string, max int) ([]uint64, error) {
	b, err := r.bin(name)
	if err != nil {
		return nil, err
	}
	if len(b)%8 != 0 {
		return nil, badValue(name, "%d bytes is not a whole number of uint64", len(b))
	}
	if len(b)/8 > max {
		return nil, badValue(name, "%d rooms, at most %d", len(b)/8, max)
	}
	out := make([]uint64, len(b)/8)
	for i := range out {
		out[i] = binary.LittleEndian.Uint64(b[8*i:])
	}
	return out, nil
}

// Field is one key and value of a reply or event, in order.
type Field struct {
	K string
	V any
}

// Fields is a reply's or event's fields; encode writes them as a map in
// this order.
type Fields []Field

// encodeValue appends v. It knows the types replies and events use; any
// other type is a bug and encodes as nil (the tests cover every reply).
func encodeValue(e *msgpack.Encoder, v any) {
	switch x := v.(type) {
	case nil:
		e.Nil()
	case bool:
		e.Bool(x)
	case int:
		e.Int(int64(x))
	case int32:
		e.Int(int64(x))
	case int64:
		e.Int(x)
	case uint8:
		e.Uint(uint64(x))
	case uint32:
		e.Uint(uint64(x))
	case uint64:
		e.Uint(x)
	case float64:
		e.Float(x)
	case string:
		e.Str(x)
	case []byte:
		e.Bin(x)
	case []uint64:
		e.ArrayHeader(len(x))
		for _, n := range x {
			e.Uint(n)
		}
	case []int:
		e.ArrayHeader(len(x))
		for _, n := range x {
			e.Int(int64(n))
		}
	case []string:
		e.ArrayHeader(len(x))
		for _, s := range x {
			e.Str(s)
		}
	case []any:
		e.ArrayHeader(len(x))
		for _, it := range x {
			encodeValue(e, it)
		}
	case Fields:
		e.MapHeader(len(x))
		for _, f := range x {
			e.Str(f.K)
			encodeValue(e, f.V)
		}
	case map[string]string:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		e.MapHeader(len(keys))
		for _, k := range keys {
			e.Str(k)
			e.Str(x[k])
		}
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		e.MapHeader(len(keys))
		for _, k := range keys {
			e.Str(k)
			encodeValue(e, x[k])
		}
	case msgpack.Value:
		e.Value(x)
	default:
		e.Nil()
	}
}

// encodeReply encodes {seq, ok: true, ...f}; seq nil when !seqOK.
func encodeReply(seq uint64, seqOK bool, f Fields) []byte {
	var e msgpack.Encoder
	e.MapHeader(2 + len(f))
	e.Str("seq")
	if seqOK {
		e.Uint(seq)
	} else {
		e.Nil()
	}
	e.Str("ok")
	e.Bool(true)
	for _, x := range f {
		e.Str(x.K)
		encodeValue(&e, x.V)
	}
	return e.Bytes()
}

// encodeError encodes {seq, ok: false, code, message}.
func encodeError(seq uint64, seqOK bool, err *Error) []byte {
	var e msgpack.Encoder
	e.MapHeader(4)
	e.Str("seq")
	if seqOK {
		e.Uint(seq)
	} else {
		e.Nil()
	}
	e.Str("ok")
	e.Bool(false)
	e.Str("code")
	e.Str(err.Code)
	e.Str("message")
	e.Str(clip(err.Message, maxMessage)) // may quote what the engine sent
	return e.Bytes()
}

// encodeEvent encodes {event: name, ...f}.
func encodeEvent(name string, f Fields) []byte {
	var e msgpack.Encoder
	e.MapHeader(1 + len(f))
	e.Str("event")
	e.Str(name)
	for _, x := range f {
		e.Str(x.K)
		encodeValue(&e, x.V)
	}
	return e.Bytes()
}
