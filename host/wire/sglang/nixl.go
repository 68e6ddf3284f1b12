package sglang

import (
	"bytes"
	"fmt"
	"strings"
)

// NIXLGuard is the first frame of every NIXL-variant message from decode
// to prefill.
const NIXLGuard = "NixlMsgGuard"

// MemKind is where a KV region lives, as NIXL's SGLang connector names it.
type MemKind string

// The memory kinds SGLang's NIXL connector accepts for KV regions.
const (
	VRAM MemKind = "VRAM"
	DRAM MemKind = "DRAM"
)

// NIXLRegistration is the message a decode rank sends once to each prefill
// rank it will receive from (room "None"): where its KV, aux and state
// buffers are, and how to reach its NIXL agent. Frame layout after the
// guard (SGLang's NixlKVReceiver._register_kv_args):
//
//	0 "None"            7 state ptrs (pack_int_lists "Q")   14 staging base ptr ("Q" or empty)
//	1 decode IP         8 gpu_id                            15 staging total size (or empty)
//	2 decode port       9 decode attn TP size               16 num slots (optional)
//	3 agent name       10 decode engine rank                17 KV mem kinds "VRAM,DRAM,..." (optional)
//	4 agent metadata   11 KV item len (first layer)         18 KV item lens, "Q" each (optional)
//	5 KV ptrs ("Q" each) 12 state item lens ("I" lists)
//	6 aux ptrs ("Q" each) 13 state dims per tensor ("I" lists)
//
// Frames 12 and later may be missing (older senders); the parser fills the
// defaults SGLang's disaggregation/nixl/conn.py uses.
type NIXLRegistration struct {
	Endpoint      string // decode's IP
	Port          int    // decode's PULL port
	AgentName     string
	AgentMetadata []byte // NIXL agent metadata, opaque
	KVPtrs        []uint64
	AuxPtrs       []uint64
	StatePtrs     [][]uint64 // per state component
	GPUID         int
	DecodeTPSize  int
	DecodeTPRank  int    // decode's engine rank
	KVItemLen     uint64 // bytes per page of the first KV region

	StateItemLens     [][]uint32
	StateDimPerTensor [][]uint32

	// Staging is the decode staging buffer, nil when not sent. kvhost does
	// not implement staging; it is carried so nothing is lost.
	Staging *NIXLStaging

	// NumSlots is the number of pages per KV region (kv_data_lens[0] /
	// kv_item_lens[0]); 0 when the sender did not include it.
	NumSlots uint64
	// KVMemKinds has one kind per KV pointer; VRAM for all when the
	// sender did not include kinds.
	KVMemKinds []MemKind
	// KVItemLens has one item length per KV pointer; KVItemLen for all
	// when the sender did not include them.
	KVItemLens []uint64
}

// NIXLStaging is the optional staging buffer of a NIXL registration.
type NIXLStaging struct {
	BasePtr   uint64
	TotalSize uint64
}

// Frames builds the multipart message, guard included, as SGLang's decode
// sends it (all 20 frames).
func (m *NIXLRegistration) Frames() ([][]byte, error) {
	if err := checkASCII(m.Endpoint, "endpoint"); err != nil {
		return nil, err
	}
	if err := checkASCII(m.AgentName, "agent name"); err != nil {
		return nil, err
	}
	if m.KVMemKinds != nil && len(m.KVMemKinds) != len(m.KVPtrs) {
		return nil, fmt.Errorf("sglang: %d KV mem kinds for %d KV pointers", len(m.KVMemKinds), len(m.KVPtrs))
	}
	if m.KVItemLens != nil && len(m.KVItemLens) != len(m.KVPtrs) {
		return nil, fmt.Errorf("sglang: %d KV item lens for %d KV pointers", len(m.KVItemLens), len(m.KVPtrs))
	}
	kinds := make([]string, len(m.KVMemKinds))
	for i, k := range m.KVMemKinds {
		if k != VRAM && k != DRAM {
			return nil, fmt.Errorf("sglang: unsupported KV memory kind %q", k)
		}
		kinds[i] = string(k)
	}
	var stagingPtr, stagingSize []byte
	if m.Staging != nil {
		stagingPtr = appendInts(nil, []uint64{m.Staging.BasePtr})
		stagingSize = utoa(m.Staging.TotalSize)
	}
	var numSlots []byte
	if m.NumSlots > 0 {
		numSlots = utoa(m.NumSlots)
	}
	return [][]byte{
		[]byte(NIXLGuard),
		[]byte("None"),
		[]byte(m.Endpoint),
		itoaInt(m.Port),
		[]byte(m.AgentName),
		m.AgentMetadata,
		appendInts(nil, m.KVPtrs),
		appendInts(nil, m.AuxPtrs),
		PackUint64Lists(m.StatePtrs),
		itoaInt(m.GPUID),
		itoaInt(m.DecodeTPSize),
		itoaInt(m.DecodeTPRank),
		utoa(m.KVItemLen),
		PackUint32Lists(m.StateItemLens),
		PackUint32Lists(m.StateDimPerTensor),
		stagingPtr,
		stagingSize,
		numSlots,
		[]byte(strings.Join(kinds, ",")),
		appendInts(nil, m.KVItemLens),
	}, nil
}

// NIXLTransferInfo is what decode sends for each request (room) to each
// target prefill rank: where in decode's KV pool the pages go. Frame
// layout after the guard (NixlKVReceiver.send_metadata):
//
//	0 room   2 decode port   4 dst KV page indices (int32 each)   6 required_dst_info_num
//	1 decode IP   3 agent name   5 dst aux index   7 dst state indices ("i" lists, optional)
//	8 decode_prefix_len (optional)
type NIXLTransferInfo struct {
	Room               uint64
	Endpoint           string
	Port               int
	AgentName          string
	DstKVIndices       []int32 // empty for a dummy rank or a full prefix hit
	DstAuxIndex        int64
	RequiredDstInfoNum int
	DstStateIndices    [][]int32 // per state component; nil when not sent
	// DecodePrefixLen is the number of tokens decode already holds;
	// DecodePrefixLenSet is false when the frame was missing or empty
	// (Python None). The NIXL sender always writes it ("0" for none), and
	// so does Frames: an unset length is sent as "0".
	DecodePrefixLen    int64
	DecodePrefixLenSet bool
}

// IsDummy reports a transfer that needs nothing delivered: no KV pages and
// no prefix hit (SGLang's disaggregation/nixl/conn.py's TransferInfo.is_dummy).
func (m *NIXLTransferInfo) IsDummy() bool {
	return len(m.DstKVIndices) == 0 && m.DecodePrefixLen == 0
}

// Frames builds the multipart message, guard included.
func (m *NIXLTransferInfo) Frames() ([][]byte, error) {
	h := infoHead{m.Room, m.Endpoint, m.Port, m.AgentName, m.DstKVIndices}
	return h.frames(NIXLGuard, "agent name",
		itoa(m.DstAuxIndex),
		itoaInt(m.RequiredDstInfoNum),
		PackInt32Lists(m.DstStateIndices),
		itoa(m.DecodePrefixLen), // str(decode_prefix_len or 0)
	)
}

func parseNIXLRegistration(payload [][]byte) (*NIXLRegistration, error) {
	r, err := newFrameReader("NIXL registration", payload, 1, 12)
	if err != nil {
		return nil, err
	}
	m := &NIXLRegistration{
		Endpoint:      r.ascii(1, "endpoint"),
		Port:          r.port(2, "port"),
		AgentName:     r.ascii(3, "agent name"),
		AgentMetadata: r.raw(4),
		KVPtrs:        r.uint64s(5, "KV ptrs"),
		AuxPtrs:       r.uint64s(6, "aux ptrs"),
		GPUID:         r.smallInt(8, "gpu_id"),
		DecodeTPSize:  r.smallInt(9, "decode TP size"),
		DecodeTPRank:  r.smallInt(10, "decode TP rank"),
		KVItemLen:     r.uint(11, "KV item len"),
	}
	if r.present(7) {
		m.StatePtrs = r.uint64Lists(7, "state ptrs")
	}
	if r.present(12) {
		m.StateItemLens = r.uint32Lists(12, "state item lens")
	}
	if r.present(13) {
		m.StateDimPerTensor = r.uint32Lists(13, "state dims per tensor")
	}
	var staging NIXLStaging
	if r.has(14) && len(payload[14]) > 0 {
		if len(payload[14]) != 8 {
			r.fail(14, "staging base ptr", "%d bytes, want 8", len(payload[14]))
		} else if v := r.uint64s(14, "staging base ptr"); len(v) == 1 {
			staging.BasePtr = v[0]
		}
	}
	if r.present(15) {
		staging.TotalSize = r.uint(15, "staging total size")
	}
	if staging != (NIXLStaging{}) {
		m.Staging = &staging
	}
	if r.present(16) {
		m.NumSlots = r.uint(16, "num slots")
	}
	if r.err != nil {
		return nil, r.err
	}
	m.KVMemKinds = make([]MemKind, len(m.KVPtrs))
	for i := range m.KVMemKinds {
		m.KVMemKinds[i] = VRAM
	}
	if r.present(17) {
		parts := bytes.Split(payload[17], []byte(","))
		if len(parts) != len(m.KVPtrs) {
			r.fail(17, "KV mem kinds", "%d kinds for %d KV pointers", len(parts), len(m.KVPtrs))
		}
		for i, p := range parts {
			k := MemKind(p)
			if k != VRAM && k != DRAM {
				r.fail(17, "KV mem kinds", "unsupported memory kind %q", truncate(p))
				break
			}
			if i < len(m.KVMemKinds) {
				m.KVMemKinds[i] = k
			}
		}
	}
	if r.present(18) {
		m.KVItemLens = r.uint64s(18, "KV item lens")
		if r.err == nil && len(m.KVItemLens) != len(m.KVPtrs) {
			r.fail(18, "KV item lens", "%d item lens for %d KV pointers", len(m.KVItemLens), len(m.KVPtrs))
		}
	} else {
		m.KVItemLens = make([]uint64, len(m.KVPtrs))
		for i := range m.KVItemLens {
			m.KVItemLens[i] = m.KVItemLen
		}
	}
	if r.err != nil {
		return nil, r.err
	}
	return m, nil
}

func parseNIXLTransferInfo(payload [][]byte) (*NIXLTransferInfo, error) {
	r, err := newFrameReader("NIXL transfer info", payload, 1, 7)
	if err != nil {
		return nil, err
	}
	h := r.infoHead("agent name")
	m := &NIXLTransferInfo{
		Room: h.room, Endpoint: h.endpoint, Port: h.port, AgentName: h.peer, DstKVIndices: h.kvIndices,
		DstAuxIndex:        r.int(5, "dst aux index"),
		RequiredDstInfoNum: r.smallInt(6, "required_dst_info_num"),
	}
	if r.present(7) {
		m.DstStateIndices = r.int32Lists(7, "dst state indices")
	}
	m.DecodePrefixLen, m.DecodePrefixLenSet = r.prefixLen(8)
	if r.err != nil {
		return nil, r.err
	}
	return m, nil
}
