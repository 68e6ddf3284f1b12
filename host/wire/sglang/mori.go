package sglang

import (
	"encoding/binary"
	"fmt"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// MORIGuard is the first frame of MORI-variant messages (decode to prefill,
// and status messages prefill to decode).
const MORIGuard = "MoriMsgGuard"

// AuxDataHeader is the first frame of MORI's aux-over-ZMQ messages
// (prefill to decode).
const AuxDataHeader = "AUX_DATA"

// MORIRegistration is the MORI variant of the once-per-prefill-rank
// registration (room "None"). Frame layout after the guard
// (MoriKVReceiver._register_kv_args):
//
//	0 "None"   3 EngineDesc blob     6 state MemoryDescs (nested)   9 decode engine rank
//	1 decode IP   4 KV MemoryDescs   7 gpu_id                      10 KV item len
//	2 decode port   5 aux MemoryDescs   8 decode attn TP size      11 state item lens ("I" lists, optional)
//	12 state dims per tensor ("I" lists, optional)
//
// EngineDesc and MemoryDesc blobs are MORI's own msgpack serializations
// (mori.io EngineDesc.pack()/MemoryDesc.pack()); kvhost carries them
// opaquely to the MORI plugin. The descriptor lists are msgpack arrays of
// those blobs (bin), nested one level for state; an empty list is sent as
// no bytes.
type MORIRegistration struct {
	Endpoint      string
	Port          int
	EngineDesc    []byte
	KVMemDescs    [][]byte
	AuxMemDescs   [][]byte
	StateMemDescs [][][]byte
	GPUID         int
	DecodeTPSize  int
	DecodeTPRank  int
	KVItemLen     uint64

	StateItemLens     [][]uint32
	StateDimPerTensor [][]uint32
}

// EngineKey is the MORI engine key inside EngineDesc, which the prefill
// side uses to name this peer (MoriKVManager keys decode peers by it).
func (m *MORIRegistration) EngineKey() (string, error) { return MORIEngineKey(m.EngineDesc) }

// MORIEngineKey extracts the key from a packed EngineDesc: MORI
// serializes EngineDesc as a msgpack array whose first element is the key
// (MORI ≥ 1.1.1: MSGPACK_DEFINE(key, nodeId, hostname, host, port, pid)).
// Only the key is read, so the other fields may change between versions.
func MORIEngineKey(desc []byte) (string, error) {
	v, err := msgpack.Decode(desc)
	if err != nil {
		return "", fmt.Errorf("%w: MORI EngineDesc: %v", ErrMalformed, err)
	}
	if v.Kind != msgpack.Array || len(v.Items) == 0 {
		return "", fmt.Errorf("%w: MORI EngineDesc is a msgpack %s, want a non-empty array", ErrMalformed, v.Kind)
	}
	key, ok := v.Items[0].Str()
	if !ok {
		return "", fmt.Errorf("%w: MORI EngineDesc key is a msgpack %s, want str", ErrMalformed, v.Items[0].Kind)
	}
	return key, nil
}

// A MORI registration carries the decode engine's EngineDesc, a msgpack
// array whose first element is the engine key (MORIEngineKey). A MORI
// plugin's metadata is exactly that. Other plugins' metadata (the fake
// plugin's, NIXL's) is not msgpack, so kvhost sends it wrapped in an
// EngineDesc-shaped array, which SGLang reads the key from like any other:
//
//	[key (str), gpu id (int), "kvhost-wrapped" (str), metadata (bin), nil]
const wrappedEngineHost = "kvhost-wrapped"

// WrapEngineDesc returns what a decode rank sends as EngineDesc for its
// plugin's metadata md: md itself when it already is an EngineDesc, else
// the kvhost wrapper with key and gpuID.
func WrapEngineDesc(md []byte, key string, gpuID int) []byte {
	if _, err := MORIEngineKey(md); err == nil {
		return md
	}
	var e msgpack.Encoder
	e.ArrayHeader(5)
	e.Str(key)
	e.Int(int64(gpuID))
	e.Str(wrappedEngineHost)
	e.Bin(md)
	e.Nil()
	return e.Bytes()
}

// UnwrapEngineDesc returns the plugin metadata inside a kvhost wrapper, or
// desc itself when it is not one (a MORI peer's own EngineDesc, for the
// MORI plugin). The metadata aliases desc.
func UnwrapEngineDesc(desc []byte) []byte {
	v, err := msgpack.Decode(desc)
	if err != nil || v.Kind != msgpack.Array || len(v.Items) != 5 {
		return desc
	}
	_, keyOK := v.Items[0].Str()
	_, gpuOK := v.Items[1].Int()
	host, hostOK := v.Items[2].Str()
	md, mdOK := v.Items[3].Bin()
	if !keyOK || !gpuOK || !hostOK || host != wrappedEngineHost || !mdOK || v.Items[4].Kind != msgpack.Nil {
		return desc
	}
	return md
}

// Frames builds the multipart message, guard included.
func (m *MORIRegistration) Frames() ([][]byte, error) {
	if err := checkASCII(m.Endpoint, "endpoint"); err != nil {
		return nil, err
	}
	return [][]byte{
		[]byte(MORIGuard),
		[]byte("None"),
		[]byte(m.Endpoint),
		itoaInt(m.Port),
		m.EngineDesc,
		packDescList(m.KVMemDescs),
		packDescList(m.AuxMemDescs),
		packDescLists(m.StateMemDescs),
		itoaInt(m.GPUID),
		itoaInt(m.DecodeTPSize),
		itoaInt(m.DecodeTPRank),
		utoa(m.KVItemLen),
		PackUint32Lists(m.StateItemLens),
		PackUint32Lists(m.StateDimPerTensor),
	}, nil
}

// packDescList is _pack_mem_desc_list: a msgpack array of bin blobs, or no
// bytes for an empty list.
func packDescList(descs [][]byte) []byte {
	if len(descs) == 0 {
		return nil
	}
	var e msgpack.Encoder
	e.ArrayHeader(len(descs))
	for _, d := range descs {
		e.Bin(d)
	}
	return e.Bytes()
}

// packDescLists is _pack_mem_desc_lists: an array of arrays of blobs.
func packDescLists(comps [][][]byte) []byte {
	if len(comps) == 0 {
		return nil
	}
	var e msgpack.Encoder
	e.ArrayHeader(len(comps))
	for _, c := range comps {
		e.ArrayHeader(len(c))
		for _, d := range c {
			e.Bin(d)
		}
	}
	return e.Bytes()
}

func blobs(v msgpack.Value) ([][]byte, error) {
	if v.Kind != msgpack.Array {
		return nil, fmt.Errorf("msgpack %s, want an array of bin", v.Kind)
	}
	out := make([][]byte, len(v.Items))
	for i, it := range v.Items {
		b, ok := it.Bin()
		if !ok {
			return nil, fmt.Errorf("element %d is a msgpack %s, want bin", i, it.Kind)
		}
		out[i] = b
	}
	return out, nil
}

func (r *frameReader) descList(i int, field string) [][]byte {
	b := r.raw(i)
	if r.err != nil || len(b) == 0 {
		return nil
	}
	v, err := msgpack.Decode(b)
	if err == nil {
		var out [][]byte
		if out, err = blobs(v); err == nil {
			return out
		}
	}
	r.fail(i, field, "%v", err)
	return nil
}

func (r *frameReader) descLists(i int, field string) [][][]byte {
	b := r.raw(i)
	if r.err != nil || len(b) == 0 {
		return nil
	}
	v, err := msgpack.Decode(b)
	if err != nil {
		r.fail(i, field, "%v", err)
		return nil
	}
	if v.Kind != msgpack.Array {
		r.fail(i, field, "msgpack %s, want an array of arrays", v.Kind)
		return nil
	}
	out := make([][][]byte, len(v.Items))
	for j, it := range v.Items {
		c, err := blobs(it)
		if err != nil {
			r.fail(i, field, "component %d: %v", j, err)
			return nil
		}
		out[j] = c
	}
	return out
}

func parseMORIRegistration(payload [][]byte) (*MORIRegistration, error) {
	r, err := newFrameReader("MORI registration", payload, 1, 11)
	if err != nil {
		return nil, err
	}
	m := &MORIRegistration{
		Endpoint:      r.ascii(1, "endpoint"),
		Port:          r.port(2, "port"),
		EngineDesc:    r.raw(3),
		KVMemDescs:    r.descList(4, "KV mem descs"),
		AuxMemDescs:   r.descList(5, "aux mem descs"),
		StateMemDescs: r.descLists(6, "state mem descs"),
		GPUID:         r.smallInt(7, "gpu_id"),
		DecodeTPSize:  r.smallInt(8, "decode TP size"),
		DecodeTPRank:  r.smallInt(9, "decode TP rank"),
		KVItemLen:     r.uint(10, "KV item len"),
	}
	if r.present(11) {
		m.StateItemLens = r.uint32Lists(11, "state item lens")
	}
	if r.present(12) {
		m.StateDimPerTensor = r.uint32Lists(12, "state dims per tensor")
	}
	if r.err != nil {
		return nil, r.err
	}
	if _, err := m.EngineKey(); err != nil {
		return nil, fmt.Errorf("%w (frame 4)", err)
	}
	return m, nil
}

// MORITransferInfo is the MORI variant of the per-request transfer info.
// Frame layout after the guard (MoriKVReceiver.send_metadata):
//
//	0 room   2 decode port   4 dst KV page indices (int32 each, may be empty)
//	1 decode IP   3 engine key   5 dst aux index (empty: none)
//	6 dst state indices ("i" lists, optional)   7 required_dst_info_num (optional, default 1)
//	8 decode_prefix_len (optional; empty when 0 or unknown)
type MORITransferInfo struct {
	Room               uint64
	Endpoint           string
	Port               int
	EngineKey          string
	DstKVIndices       []int32
	DstAuxIndex        int64 // -1: none (empty frame)
	DstStateIndices    [][]int32
	RequiredDstInfoNum int // 1 when the frame is missing
	DecodePrefixLen    int64
	DecodePrefixLenSet bool // false: Python None (frame missing or empty)
}

// IsDummy is SGLang's disaggregation/mori/conn.py's test: no pages, no aux, no prefix hit.
func (m *MORITransferInfo) IsDummy() bool {
	return len(m.DstKVIndices) == 0 && m.DstAuxIndex < 0 && m.DecodePrefixLen == 0
}

// Frames builds the multipart message, guard included. A negative
// DstAuxIndex and a DecodePrefixLen of 0 or less are sent as empty
// frames, as SGLang's disaggregation/mori/conn.py does.
func (m *MORITransferInfo) Frames() ([][]byte, error) {
	var aux, prefix []byte
	if m.DstAuxIndex >= 0 {
		aux = itoa(m.DstAuxIndex)
	}
	if m.DecodePrefixLen > 0 {
		prefix = itoa(m.DecodePrefixLen)
	}
	h := infoHead{m.Room, m.Endpoint, m.Port, m.EngineKey, m.DstKVIndices}
	return h.frames(MORIGuard, "engine key",
		aux,
		PackInt32Lists(m.DstStateIndices),
		itoaInt(m.RequiredDstInfoNum),
		prefix,
	)
}

func parseMORITransferInfo(payload [][]byte) (*MORITransferInfo, error) {
	r, err := newFrameReader("MORI transfer info", payload, 1, 6)
	if err != nil {
		return nil, err
	}
	h := r.infoHead("engine key")
	m := &MORITransferInfo{
		Room: h.room, Endpoint: h.endpoint, Port: h.port, EngineKey: h.peer, DstKVIndices: h.kvIndices,
		DstAuxIndex:        -1,
		RequiredDstInfoNum: 1,
	}
	if r.present(5) {
		m.DstAuxIndex = r.int(5, "dst aux index")
	}
	if r.present(6) {
		m.DstStateIndices = r.int32Lists(6, "dst state indices")
	}
	if r.has(7) {
		// SGLang's disaggregation/mori/conn.py parses this frame whenever it exists, so an empty
		// one is an error there too.
		m.RequiredDstInfoNum = r.smallInt(7, "required_dst_info_num")
	}
	m.DecodePrefixLen, m.DecodePrefixLenSet = r.prefixLen(8)
	if r.err != nil {
		return nil, r.err
	}
	return m, nil
}

// MORIStatus is prefill's out-of-band completion message to decode:
// [guard, room, status, prefill_unique_rank, reason].
type MORIStatus struct {
	Room              uint64
	Status            KVPoll
	PrefillUniqueRank int    // tp_rank*(pp_size*cp_size) + pp_rank*cp_size + cp_rank
	Reason            string // failure reason, UTF-8; empty for none
}

// Frames builds the multipart message, guard included.
func (m *MORIStatus) Frames() ([][]byte, error) {
	return [][]byte{
		[]byte(MORIGuard),
		utoa(m.Room),
		itoaInt(int(m.Status)),
		itoaInt(m.PrefillUniqueRank),
		[]byte(m.Reason),
	}, nil
}

func parseMORIStatus(payload [][]byte) (*MORIStatus, error) {
	r, err := newFrameReader("MORI status", payload, 1, 3)
	if err != nil {
		return nil, err
	}
	m := &MORIStatus{
		Room:              r.uint(0, "room"),
		Status:            KVPoll(r.smallInt(1, "status")),
		PrefillUniqueRank: r.smallInt(2, "prefill unique rank"),
	}
	if r.present(3) {
		m.Reason = r.utf8(3, "reason")
	}
	if r.err != nil {
		return nil, r.err
	}
	return m, nil
}

// AuxData carries one aux buffer item over ZeroMQ (MORI's TCP aux path):
// [AUX_DATA, room, buffer index, aux index, big-endian uint32 length, data].
type AuxData struct {
	Room        uint64
	BufferIndex int   // which aux buffer (kv_args.aux_data_ptrs index)
	AuxIndex    int64 // destination slot in that buffer
	Data        []byte
}

// Frames builds the multipart message.
func (m *AuxData) Frames() ([][]byte, error) {
	if uint64(len(m.Data)) > 1<<32-1 {
		return nil, fmt.Errorf("sglang: aux data of %d bytes does not fit the uint32 length", len(m.Data))
	}
	return [][]byte{
		[]byte(AuxDataHeader),
		utoa(m.Room),
		itoaInt(m.BufferIndex),
		itoa(m.AuxIndex),
		binary.BigEndian.AppendUint32(nil, uint32(len(m.Data))),
		m.Data,
	}, nil
}

func parseAuxData(frames [][]byte) (*AuxData, error) {
	r, err := newFrameReader("AUX_DATA", frames, 0, 6)
	if err != nil {
		return nil, err
	}
	m := &AuxData{
		Room:        r.uint(1, "room"),
		BufferIndex: r.smallInt(2, "buffer index"),
		AuxIndex:    r.int(3, "aux index"),
		Data:        frames[5],
	}
	if r.err != nil {
		return nil, r.err
	}
	if len(frames[4]) != 4 {
		return nil, msgErr("AUX_DATA", 4, "length", "%d bytes, want a 4-byte big-endian length", len(frames[4]))
	}
	if n := binary.BigEndian.Uint32(frames[4]); uint64(n) != uint64(len(m.Data)) {
		return nil, msgErr("AUX_DATA", 5, "data", "length frame says %d bytes, data has %d", n, len(m.Data))
	}
	return m, nil
}
