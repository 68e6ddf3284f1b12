package sglang

import (
	"encoding/binary"
	"fmt"
	"unsafe"
)

// integer is an element type of the packed lists: int32 ("i": state
// indices), uint32 ("I": state item lengths and dims), uint64 ("Q":
// pointers and KV item lengths).
type integer interface {
	~int32 | ~uint32 | ~uint64
}

func width[T integer]() int { var z T; return int(unsafe.Sizeof(z)) }

func appendInts[T integer](dst []byte, v []T) []byte {
	for _, x := range v {
		switch width[T]() {
		case 4:
			dst = binary.LittleEndian.AppendUint32(dst, uint32(x))
		default:
			dst = binary.LittleEndian.AppendUint64(dst, uint64(x))
		}
	}
	return dst
}

func decodeInts[T integer](b []byte) ([]T, error) {
	w := width[T]()
	if len(b)%w != 0 {
		return nil, fmt.Errorf("%d bytes is not a whole number of %d-byte integers", len(b), w)
	}
	out := make([]T, len(b)/w)
	for i := range out {
		if w == 4 {
			out[i] = T(binary.LittleEndian.Uint32(b[4*i:]))
		} else {
			out[i] = T(binary.LittleEndian.Uint64(b[8*i:]))
		}
	}
	return out, nil
}

// decodeUint64s reads a flat list of uint64 (struct "Q" per element, as
// SGLang packs pointers and KV item lengths).
func decodeUint64s(b []byte) ([]uint64, error) { return decodeInts[uint64](b) }

// decodeInt32s reads a flat list of int32 (numpy int32 .tobytes(), as
// SGLang sends KV page indices).
func decodeInt32s(b []byte) ([]int32, error) { return decodeInts[int32](b) }

// packLists implements SGLang's pack_int_lists: a little-endian uint32
// count n, n uint32 byte lengths, then each list's elements. No lists
// packs to no bytes.
func packLists[T integer](lists [][]T) []byte {
	if len(lists) == 0 {
		return nil
	}
	size := 4 + 4*len(lists)
	for _, l := range lists {
		size += len(l) * width[T]()
	}
	out := make([]byte, 0, size)
	out = binary.LittleEndian.AppendUint32(out, uint32(len(lists)))
	for _, l := range lists {
		out = binary.LittleEndian.AppendUint32(out, uint32(len(l)*width[T]()))
	}
	for _, l := range lists {
		out = appendInts(out, l)
	}
	return out
}

// unpackLists is unpack_int_lists, but strict: the header must fit, every
// length must be a whole number of elements and the lengths must add up to
// exactly the bytes that follow (SGLang's disaggregation/{nixl,mori}/conn.py slices silently).
func unpackLists[T integer](b []byte) ([][]T, error) {
	if len(b) == 0 {
		return nil, nil
	}
	if len(b) < 4 {
		return nil, fmt.Errorf("packed lists of %d bytes: no count", len(b))
	}
	n := binary.LittleEndian.Uint32(b)
	if uint64(n) > uint64(len(b)-4)/4 {
		return nil, fmt.Errorf("packed lists declare %d lists but have %d bytes", n, len(b))
	}
	hdr := 4 + 4*int(n)
	lens := make([]int, n)
	total := 0
	w := width[T]()
	for i := range lens {
		l := binary.LittleEndian.Uint32(b[4+4*i:])
		if int(l)%w != 0 {
			return nil, fmt.Errorf("packed list %d has %d bytes, not a multiple of %d", i, l, w)
		}
		if uint64(total)+uint64(l) > uint64(len(b)-hdr) {
			return nil, fmt.Errorf("packed list lengths exceed the %d payload bytes", len(b)-hdr)
		}
		lens[i] = int(l)
		total += int(l)
	}
	if total != len(b)-hdr {
		return nil, fmt.Errorf("packed list lengths add up to %d bytes, payload has %d", total, len(b)-hdr)
	}
	out := make([][]T, n)
	off := hdr
	for i, l := range lens {
		v, err := decodeInts[T](b[off : off+l])
		if err != nil {
			return nil, err
		}
		out[i] = v
		off += l
	}
	return out, nil
}

// PackInt32Lists packs state indices (pack_int_lists(lists, "i")).
func PackInt32Lists(lists [][]int32) []byte { return packLists(lists) }

// PackUint32Lists packs state item lengths or dims (pack_int_lists(lists, "I")).
func PackUint32Lists(lists [][]uint32) []byte { return packLists(lists) }

// PackUint64Lists packs state pointers (pack_int_lists(lists, "Q")).
func PackUint64Lists(lists [][]uint64) []byte { return packLists(lists) }

// UnpackInt32Lists is the inverse of PackInt32Lists.
func UnpackInt32Lists(b []byte) ([][]int32, error) { return unpackLists[int32](b) }

// UnpackUint32Lists is the inverse of PackUint32Lists.
func UnpackUint32Lists(b []byte) ([][]uint32, error) { return unpackLists[uint32](b) }

// UnpackUint64Lists is the inverse of PackUint64Lists.
func UnpackUint64Lists(b []byte) ([][]uint64, error) { return unpackLists[uint64](b) }

func (r *frameReader) int32Lists(i int, field string) [][]int32 {
	v, err := UnpackInt32Lists(r.raw(i))
	if err != nil && r.err == nil {
		r.fail(i, field, "%v", err)
	}
	return v
}

func (r *frameReader) uint32Lists(i int, field string) [][]uint32 {
	v, err := UnpackUint32Lists(r.raw(i))
	if err != nil && r.err == nil {
		r.fail(i, field, "%v", err)
	}
	return v
}

func (r *frameReader) uint64Lists(i int, field string) [][]uint64 {
	v, err := UnpackUint64Lists(r.raw(i))
	if err != nil && r.err == nil {
		r.fail(i, field, "%v", err)
	}
	return v
}
