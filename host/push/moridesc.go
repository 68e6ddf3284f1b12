package push

import (
	"encoding/binary"
	"errors"

	"github.com/kvhost/kvhost/host/wire/sglang"
)

// MORI's registration carries the decode engine's EngineDesc, a msgpack
// array whose first element is the engine key; SGLang (and kvhost's wire
// parser) read the key from it. A MORI plugin's metadata is exactly that.
// Other plugins' metadata (the fake plugin's, NIXL's) is not msgpack, so
// kvhost wraps it in an EngineDesc-shaped array:
//
//	[key (str), gpu id (int), "kvhost-wrapped" (str), metadata (bin), nil]
//
// and the prefill side unwraps it before handing it to its plugin.
const wrappedHost = "kvhost-wrapped"

// moriEngineDesc returns what decode sends as EngineDesc: the plugin's
// metadata itself when it already is an EngineDesc, else the wrapper.
func moriEngineDesc(md []byte, key string, gpu int) []byte {
	if _, err := sglang.MORIEngineKey(md); err == nil {
		return md
	}
	b := []byte{0x95}
	b = mpStr(b, key)
	b = mpInt(b, gpu)
	b = mpStr(b, wrappedHost)
	b = mpBin(b, md)
	return append(b, 0xc0)
}

// unwrapEngineDesc returns the plugin metadata inside a kvhost wrapper, or
// desc itself when it is not one.
func unwrapEngineDesc(desc []byte) []byte {
	if md, err := parseWrapped(desc); err == nil {
		return md
	}
	return desc
}

var errNotWrapped = errors.New("not a kvhost-wrapped EngineDesc")

func parseWrapped(b []byte) ([]byte, error) {
	if len(b) < 1 || b[0] != 0x95 {
		return nil, errNotWrapped
	}
	b = b[1:]
	var ok bool
	if _, b, ok = mpReadStr(b); !ok {
		return nil, errNotWrapped
	}
	if b, ok = mpSkipInt(b); !ok {
		return nil, errNotWrapped
	}
	var host string
	if host, b, ok = mpReadStr(b); !ok || host != wrappedHost {
		return nil, errNotWrapped
	}
	var md []byte
	if md, b, ok = mpReadBin(b); !ok {
		return nil, errNotWrapped
	}
	if len(b) != 1 || b[0] != 0xc0 {
		return nil, errNotWrapped
	}
	return md, nil
}

func mpStr(b []byte, s string) []byte {
	switch n := len(s); {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n < 1<<8:
		b = append(b, 0xd9, byte(n))
	case n < 1<<16:
		b = append(b, 0xda)
		b = binary.BigEndian.AppendUint16(b, uint16(n))
	default:
		b = append(b, 0xdb)
		b = binary.BigEndian.AppendUint32(b, uint32(n))
	}
	return append(b, s...)
}

func mpInt(b []byte, v int) []byte {
	if v >= 0 && v < 128 {
		return append(b, byte(v))
	}
	b = append(b, 0xd3)
	return binary.BigEndian.AppendUint64(b, uint64(int64(v)))
}

func mpBin(b, data []byte) []byte {
	switch n := len(data); {
	case n < 1<<8:
		b = append(b, 0xc4, byte(n))
	case n < 1<<16:
		b = append(b, 0xc5)
		b = binary.BigEndian.AppendUint16(b, uint16(n))
	default:
		b = append(b, 0xc6)
		b = binary.BigEndian.AppendUint32(b, uint32(n))
	}
	return append(b, data...)
}

// mpLen reads a length of size bytes (1, 2 or 4) big-endian.
func mpLen(b []byte, size int) (int, []byte, bool) {
	if len(b) < size {
		return 0, nil, false
	}
	switch size {
	case 1:
		return int(b[0]), b[1:], true
	case 2:
		return int(binary.BigEndian.Uint16(b)), b[2:], true
	default:
		return int(binary.BigEndian.Uint32(b)), b[4:], true
	}
}

func mpReadStr(b []byte) (string, []byte, bool) {
	if len(b) < 1 {
		return "", nil, false
	}
	var n int
	var ok bool
	switch t := b[0]; {
	case t&0xe0 == 0xa0:
		n, b, ok = int(t&0x1f), b[1:], true
	case t == 0xd9:
		n, b, ok = mpLen(b[1:], 1)
	case t == 0xda:
		n, b, ok = mpLen(b[1:], 2)
	case t == 0xdb:
		n, b, ok = mpLen(b[1:], 4)
	}
	if !ok || n > len(b) {
		return "", nil, false
	}
	return string(b[:n]), b[n:], true
}

func mpReadBin(b []byte) ([]byte, []byte, bool) {
	if len(b) < 1 {
		return nil, nil, false
	}
	var n int
	var ok bool
	switch b[0] {
	case 0xc4:
		n, b, ok = mpLen(b[1:], 1)
	case 0xc5:
		n, b, ok = mpLen(b[1:], 2)
	case 0xc6:
		n, b, ok = mpLen(b[1:], 4)
	}
	if !ok || n > len(b) {
		return nil, nil, false
	}
	return b[:n], b[n:], true
}

func mpSkipInt(b []byte) ([]byte, bool) {
	if len(b) < 1 {
		return nil, false
	}
	switch t := b[0]; {
	case t < 0x80 || t >= 0xe0:
		return b[1:], true
	case t == 0xcc || t == 0xd0:
		return skip(b, 2)
	case t == 0xcd || t == 0xd1:
		return skip(b, 3)
	case t == 0xce || t == 0xd2:
		return skip(b, 5)
	case t == 0xcf || t == 0xd3:
		return skip(b, 9)
	}
	return nil, false
}

func skip(b []byte, n int) ([]byte, bool) {
	if len(b) < n {
		return nil, false
	}
	return b[n:], true
}
