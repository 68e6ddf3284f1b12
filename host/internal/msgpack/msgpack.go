// Package msgpack is the small MessagePack codec the wire formats and the
// sidecar's control API need: an encoder that writes the same bytes as Python's msgspec and msgpack
// (smallest integer, string and container forms), and a decoder into a
// value tree that is safe on hostile input: every length is checked
// against the bytes left before anything is allocated, nesting is bounded,
// the number of values one Decode builds is bounded (MaxValues), and
// nothing panics.
//
// General-purpose libraries were not used because the decoder is fed
// network bytes: vmihailenco/msgpack v5.4.1 sizes typed slices from the
// declared array length (its allocation limit check compares a flag with 1
// and never applies), so a 5-byte input can demand gigabytes.
package msgpack

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unsafe"
)

// Kind is the type of a decoded Value.
type Kind uint8

// Kinds of values. Integers decode as Int when the encoding was signed and
// Uint when unsigned (positive fixint included); use Value.Int and
// Value.Uint to read either.
const (
	Nil Kind = iota
	Bool
	Int
	Uint
	Float
	Str
	Bin
	Array
	Map
	Ext
)

func (k Kind) String() string {
	return [...]string{"nil", "bool", "int", "uint", "float", "str", "bin", "array", "map", "ext"}[k]
}

// Value is one decoded MessagePack value. Bytes of Str, Bin and Ext alias
// the decoded input.
type Value struct {
	Kind    Kind
	b       bool
	i       int64
	u       uint64
	f       float64
	bytes   []byte
	ExtType int8
	Items   []Value    // Array
	Pairs   [][2]Value // Map, in encoded order
}

// Bool returns the value of a Bool.
func (v Value) Bool() (bool, bool) { return v.b, v.Kind == Bool }

// Int returns an integer value as int64; false if v is not an integer or
// does not fit.
func (v Value) Int() (int64, bool) {
	switch v.Kind {
	case Int:
		return v.i, true
	case Uint:
		if v.u <= math.MaxInt64 {
			return int64(v.u), true
		}
	}
	return 0, false
}

// Uint returns a non-negative integer value as uint64.
func (v Value) Uint() (uint64, bool) {
	switch v.Kind {
	case Uint:
		return v.u, true
	case Int:
		if v.i >= 0 {
			return uint64(v.i), true
		}
	}
	return 0, false
}

// Float returns a float value.
func (v Value) Float() (float64, bool) { return v.f, v.Kind == Float }

// Str returns the text of a Str value.
func (v Value) Str() (string, bool) { return string(v.bytes), v.Kind == Str }

// Bin returns the bytes of a Bin value.
func (v Value) Bin() ([]byte, bool) { return v.bytes, v.Kind == Bin }

// Raw returns the payload of a Str, Bin or Ext value.
func (v Value) Raw() []byte { return v.bytes }

// Get returns the value stored under the string key in a Map (the first
// if the key is duplicated). It allocates nothing.
func (v Value) Get(key string) (Value, bool) {
	for _, p := range v.Pairs {
		if p[0].Kind == Str && string(p[0].bytes) == key {
			return p[1], true
		}
	}
	return Value{}, false
}

// Len returns the number of elements of an Array, of key-value pairs of a
// Map, of bytes of a Str, Bin or Ext, and 0 for every other kind.
func (v Value) Len() int {
	switch v.Kind {
	case Array:
		return len(v.Items)
	case Map:
		return len(v.Pairs)
	case Str, Bin, Ext:
		return len(v.bytes)
	}
	return 0
}

// Index returns element i of an Array; false if v is not an Array or i is
// out of range (a nil element is returned as a Nil value with true).
func (v Value) Index(i int) (Value, bool) {
	if v.Kind != Array || i < 0 || i >= len(v.Items) {
		return Value{}, false
	}
	return v.Items[i], true
}

// ErrType marks a value of another kind than the caller asked for.
var ErrType = errors.New("msgpack: wrong type")

// Each calls fn with every key and value of a Map whose keys are all
// strings, in encoded order, until fn returns false. It returns an error
// wrapping ErrType, before calling fn at all, if v is not a Map or any key
// is not a Str (a control message from Python has string keys only; a map
// with other keys is refused whole rather than half visited). Duplicate
// keys are passed on as encoded; Get returns the first. Each allocates
// nothing: key aliases the decoded input, like Raw, so it is valid only
// while the input is unchanged; strings.Clone it to keep it longer (a kept
// alias would also keep the whole input alive).
func (v Value) Each(fn func(key string, val Value) bool) error {
	if v.Kind != Map {
		return fmt.Errorf("%w: %s, want map", ErrType, v.Kind)
	}
	for i, p := range v.Pairs {
		if p[0].Kind != Str {
			return fmt.Errorf("%w: map key %d is %s, want str", ErrType, i, p[0].Kind)
		}
	}
	for _, p := range v.Pairs {
		if !fn(p[0].str(), p[1]) {
			break
		}
	}
	return nil
}

// str returns the text of a Str without copying it: the string aliases
// the decoded input, which callers of Decode must not change while they
// use the tree.
func (v Value) str() string { return unsafe.String(unsafe.SliceData(v.bytes), len(v.bytes)) }

// MaxDepth bounds nesting of arrays and maps.
const MaxDepth = 32

// MaxValues bounds the array elements and map keys and values one Decode
// builds. Every element costs a Value (about 110 bytes) for as little as one
// input byte, so without a bound a message of n bytes could cost 110 n bytes
// of memory (a 256 MiB ZeroMQ message, 28 GiB). The control messages this
// package decodes hold at most a few thousand values (one pointer or one
// descriptor per KV region); MaxValues caps a hostile message at about
// 7 MiB of tree.
const MaxValues = 1 << 16

// ErrMalformed marks input that is not valid MessagePack.
var ErrMalformed = errors.New("msgpack: malformed input")

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

// Decode decodes exactly one value that must span all of b.
func Decode(b []byte) (Value, error) {
	d := decoder{b: b, budget: MaxValues}
	v, err := d.value(0)
	if err != nil {
		return Value{}, err
	}
	if d.off != len(b) {
		return Value{}, malformed("%d trailing bytes after the value", len(b)-d.off)
	}
	return v, nil
}

type decoder struct {
	b   []byte
	off int
	// budget is how many more array elements and map keys and values
	// this Decode may build (MaxValues in all).
	budget uint64
}

// spend takes n values from the budget, before they are allocated.
func (d *decoder) spend(n uint64) error {
	if n > d.budget {
		return malformed("more than %d values in one message", MaxValues)
	}
	d.budget -= n
	return nil
}

func (d *decoder) left() int { return len(d.b) - d.off }

func (d *decoder) take(n uint64) ([]byte, error) {
	if n > uint64(d.left()) {
		return nil, malformed("needs %d bytes at offset %d, %d left", n, d.off, d.left())
	}
	s := d.b[d.off : d.off+int(n)]
	d.off += int(n)
	return s, nil
}

func (d *decoder) uintN(n int) (uint64, error) {
	s, err := d.take(uint64(n))
	if err != nil {
		return 0, err
	}
	switch n {
	case 1:
		return uint64(s[0]), nil
	case 2:
		return uint64(binary.BigEndian.Uint16(s)), nil
	case 4:
		return uint64(binary.BigEndian.Uint32(s)), nil
	default:
		return binary.BigEndian.Uint64(s), nil
	}
}

func (d *decoder) value(depth int) (Value, error) {
	if depth > MaxDepth {
		return Value{}, malformed("nesting deeper than %d", MaxDepth)
	}
	tb, err := d.take(1)
	if err != nil {
		return Value{}, err
	}
	t := tb[0]
	switch {
	case t <= 0x7f:
		return Value{Kind: Uint, u: uint64(t)}, nil
	case t >= 0xe0:
		return Value{Kind: Int, i: int64(int8(t))}, nil
	case t&0xf0 == 0x80:
		return d.mapOf(uint64(t&0x0f), depth)
	case t&0xf0 == 0x90:
		return d.arrayOf(uint64(t&0x0f), depth)
	case t&0xe0 == 0xa0:
		return d.bytesOf(Str, uint64(t&0x1f))
	}
	switch t {
	case 0xc0:
		return Value{Kind: Nil}, nil
	case 0xc2, 0xc3:
		return Value{Kind: Bool, b: t == 0xc3}, nil
	case 0xc4, 0xc5, 0xc6:
		n, err := d.uintN(1 << (t - 0xc4))
		if err != nil {
			return Value{}, err
		}
		return d.bytesOf(Bin, n)
	case 0xc7, 0xc8, 0xc9:
		n, err := d.uintN(1 << (t - 0xc7))
		if err != nil {
			return Value{}, err
		}
		return d.ext(n)
	case 0xca:
		u, err := d.uintN(4)
		return Value{Kind: Float, f: float64(math.Float32frombits(uint32(u)))}, err
	case 0xcb:
		u, err := d.uintN(8)
		return Value{Kind: Float, f: math.Float64frombits(u)}, err
	case 0xcc, 0xcd, 0xce, 0xcf:
		u, err := d.uintN(1 << (t - 0xcc))
		return Value{Kind: Uint, u: u}, err
	case 0xd0, 0xd1, 0xd2, 0xd3:
		n := 1 << (t - 0xd0)
		u, err := d.uintN(n)
		if err != nil {
			return Value{}, err
		}
		var i int64
		switch n {
		case 1:
			i = int64(int8(u))
		case 2:
			i = int64(int16(u))
		case 4:
			i = int64(int32(u))
		default:
			i = int64(u)
		}
		return Value{Kind: Int, i: i}, nil
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8:
		return d.ext(uint64(1) << (t - 0xd4))
	case 0xd9, 0xda, 0xdb:
		n, err := d.uintN(1 << (t - 0xd9))
		if err != nil {
			return Value{}, err
		}
		return d.bytesOf(Str, n)
	case 0xdc, 0xdd:
		n, err := d.uintN(2 << (t - 0xdc))
		if err != nil {
			return Value{}, err
		}
		return d.arrayOf(n, depth)
	case 0xde, 0xdf:
		n, err := d.uintN(2 << (t - 0xde))
		if err != nil {
			return Value{}, err
		}
		return d.mapOf(n, depth)
	}
	return Value{}, malformed("reserved type byte %#02x at offset %d", t, d.off-1)
}

func (d *decoder) bytesOf(k Kind, n uint64) (Value, error) {
	s, err := d.take(n)
	if err != nil {
		return Value{}, err
	}
	return Value{Kind: k, bytes: s}, nil
}

func (d *decoder) ext(n uint64) (Value, error) {
	tb, err := d.take(1)
	if err != nil {
		return Value{}, err
	}
	s, err := d.take(n)
	if err != nil {
		return Value{}, err
	}
	return Value{Kind: Ext, ExtType: int8(tb[0]), bytes: s}, nil
}

func (d *decoder) arrayOf(n uint64, depth int) (Value, error) {
	// Every element takes at least one byte.
	if n > uint64(d.left()) {
		return Value{}, malformed("array of %d elements with %d bytes left", n, d.left())
	}
	if err := d.spend(n); err != nil {
		return Value{}, err
	}
	items := make([]Value, n)
	for i := range items {
		v, err := d.value(depth + 1)
		if err != nil {
			return Value{}, err
		}
		items[i] = v
	}
	return Value{Kind: Array, Items: items}, nil
}

func (d *decoder) mapOf(n uint64, depth int) (Value, error) {
	if n > uint64(d.left())/2 {
		return Value{}, malformed("map of %d pairs with %d bytes left", n, d.left())
	}
	if err := d.spend(2 * n); err != nil {
		return Value{}, err
	}
	pairs := make([][2]Value, n)
	for i := range pairs {
		k, err := d.value(depth + 1)
		if err != nil {
			return Value{}, err
		}
		v, err := d.value(depth + 1)
		if err != nil {
			return Value{}, err
		}
		pairs[i] = [2]Value{k, v}
	}
	return Value{Kind: Map, Pairs: pairs}, nil
}

// Encoder appends MessagePack to a buffer using the smallest forms, as
// msgspec and msgpack-python do.
type Encoder struct {
	buf []byte
}

// Bytes returns the encoded bytes.
func (e *Encoder) Bytes() []byte { return e.buf }

// Reset empties the buffer and keeps its capacity, so one Encoder can
// encode message after message without allocating.
func (e *Encoder) Reset() { e.buf = e.buf[:0] }

// Nil appends nil.
func (e *Encoder) Nil() { e.buf = append(e.buf, 0xc0) }

// Bool appends a boolean.
func (e *Encoder) Bool(b bool) {
	if b {
		e.buf = append(e.buf, 0xc3)
	} else {
		e.buf = append(e.buf, 0xc2)
	}
}

// Int appends an integer: non-negative values in unsigned forms, negative
// ones in signed forms, always the smallest that fits.
func (e *Encoder) Int(v int64) {
	if v >= 0 {
		e.Uint(uint64(v))
		return
	}
	switch {
	case v >= -32:
		e.buf = append(e.buf, byte(int8(v)))
	case v >= math.MinInt8:
		e.buf = append(e.buf, 0xd0, byte(int8(v)))
	case v >= math.MinInt16:
		e.buf = binary.BigEndian.AppendUint16(append(e.buf, 0xd1), uint16(int16(v)))
	case v >= math.MinInt32:
		e.buf = binary.BigEndian.AppendUint32(append(e.buf, 0xd2), uint32(int32(v)))
	default:
		e.buf = binary.BigEndian.AppendUint64(append(e.buf, 0xd3), uint64(v))
	}
}

// Uint appends a non-negative integer in the smallest form.
func (e *Encoder) Uint(v uint64) {
	switch {
	case v <= 0x7f:
		e.buf = append(e.buf, byte(v))
	case v <= math.MaxUint8:
		e.buf = append(e.buf, 0xcc, byte(v))
	case v <= math.MaxUint16:
		e.buf = binary.BigEndian.AppendUint16(append(e.buf, 0xcd), uint16(v))
	case v <= math.MaxUint32:
		e.buf = binary.BigEndian.AppendUint32(append(e.buf, 0xce), uint32(v))
	default:
		e.buf = binary.BigEndian.AppendUint64(append(e.buf, 0xcf), v)
	}
}

// Float appends a float64, always in the 9-byte form (0xcb), as
// msgpack-python and msgspec pack a Python float.
func (e *Encoder) Float(f float64) {
	e.buf = binary.BigEndian.AppendUint64(append(e.buf, 0xcb), math.Float64bits(f))
}

// Value appends a decoded value as it is (re-encoding a tree a peer sent,
// such as a map to echo). Every form is written in its smallest encoding,
// so the bytes may be shorter than the input's; the values are the same.
func (e *Encoder) Value(v Value) {
	switch v.Kind {
	case Bool:
		b, _ := v.Bool()
		e.Bool(b)
	case Int:
		i, _ := v.Int()
		e.Int(i)
	case Uint:
		u, _ := v.Uint()
		e.Uint(u)
	case Float:
		f, _ := v.Float()
		e.Float(f)
	case Str:
		s, _ := v.Str()
		e.Str(s)
	case Bin:
		b, _ := v.Bin()
		e.Bin(b)
	case Ext:
		n := uint32(len(v.Raw()))
		e.buf = append(e.buf, 0xc9, byte(n>>24), byte(n>>16), byte(n>>8), byte(n), byte(v.ExtType))
		e.buf = append(e.buf, v.Raw()...)
	case Array:
		e.ArrayHeader(len(v.Items))
		for _, x := range v.Items {
			e.Value(x)
		}
	case Map:
		e.MapHeader(len(v.Pairs))
		for _, p := range v.Pairs {
			e.Value(p[0])
			e.Value(p[1])
		}
	default:
		e.Nil()
	}
}

// Str appends a string.
func (e *Encoder) Str(s string) {
	n := len(s)
	switch {
	case n <= 31:
		e.buf = append(e.buf, 0xa0|byte(n))
	case n <= math.MaxUint8:
		e.buf = append(e.buf, 0xd9, byte(n))
	case n <= math.MaxUint16:
		e.buf = binary.BigEndian.AppendUint16(append(e.buf, 0xda), uint16(n))
	default:
		e.buf = binary.BigEndian.AppendUint32(append(e.buf, 0xdb), uint32(n))
	}
	e.buf = append(e.buf, s...)
}

// Bin appends a byte string.
func (e *Encoder) Bin(b []byte) {
	n := len(b)
	switch {
	case n <= math.MaxUint8:
		e.buf = append(e.buf, 0xc4, byte(n))
	case n <= math.MaxUint16:
		e.buf = binary.BigEndian.AppendUint16(append(e.buf, 0xc5), uint16(n))
	default:
		e.buf = binary.BigEndian.AppendUint32(append(e.buf, 0xc6), uint32(n))
	}
	e.buf = append(e.buf, b...)
}

// ArrayHeader starts an array of n elements; append them next.
func (e *Encoder) ArrayHeader(n int) {
	switch {
	case n <= 15:
		e.buf = append(e.buf, 0x90|byte(n))
	case n <= math.MaxUint16:
		e.buf = binary.BigEndian.AppendUint16(append(e.buf, 0xdc), uint16(n))
	default:
		e.buf = binary.BigEndian.AppendUint32(append(e.buf, 0xdd), uint32(n))
	}
}

// MapHeader starts a map of n pairs; append key, value, key, value, ...
func (e *Encoder) MapHeader(n int) {
	switch {
	case n <= 15:
		e.buf = append(e.buf, 0x80|byte(n))
	case n <= math.MaxUint16:
		e.buf = binary.BigEndian.AppendUint16(append(e.buf, 0xde), uint16(n))
	default:
		e.buf = binary.BigEndian.AppendUint32(append(e.buf, 0xdf), uint32(n))
	}
}
