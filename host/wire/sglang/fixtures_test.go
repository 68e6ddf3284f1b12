package sglang

import (
	"encoding/hex"
	"fmt"
	"math"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// moriDesc builds a blob shaped like a packed MORI descriptor (a msgpack
// array whose first element is the engine key).
func moriDesc(key string, fields ...int64) []byte {
	var e msgpack.Encoder
	e.ArrayHeader(1 + len(fields))
	e.Str(key)
	for _, f := range fields {
		e.Int(f)
	}
	return e.Bytes()
}

// fixtures are messages in the normalized form the parsers return. The
// interop test sends them both ways through a Python peer that uses the
// reference layouts.
func fixtures() []Message {
	big := make([]int32, 5000)
	for i := range big {
		big[i] = int32(i * 3)
	}
	return []Message{
		&NIXLRegistration{
			Endpoint: "10.1.2.3", Port: 17001, AgentName: "9f1c2a0e-agent",
			AgentMetadata: []byte("\x00nixl-agent-metadata\xff"),
			KVPtrs:        []uint64{0x7f0000001000, 0x7f0000002000, math.MaxUint64, 0},
			AuxPtrs:       []uint64{0x7e0000000000},
			StatePtrs:     [][]uint64{{1, 2, 3}, {}, {0x10000000000}},
			GPUID:         3, DecodeTPSize: 4, DecodeTPRank: 2, KVItemLen: 65536,
			StateItemLens:     [][]uint32{{128, 256}, {}, {4096}},
			StateDimPerTensor: [][]uint32{{8}, {}, {1, 2}},
			Staging:           &NIXLStaging{BasePtr: 0x7d0000000000, TotalSize: 1 << 30},
			NumSlots:          4096,
			KVMemKinds:        []MemKind{VRAM, VRAM, DRAM, DRAM},
			KVItemLens:        []uint64{65536, 65536, 32768, 32768},
		},
		&NIXLRegistration{ // no state, no staging
			Endpoint: "::1", Port: 1, AgentName: "a", AgentMetadata: []byte{},
			KVPtrs: []uint64{4096}, AuxPtrs: []uint64{}, GPUID: 0, DecodeTPSize: 1, DecodeTPRank: 0,
			KVItemLen: 8, NumSlots: 1, KVMemKinds: []MemKind{VRAM}, KVItemLens: []uint64{8},
		},
		&NIXLTransferInfo{
			Room: 1<<63 - 1, Endpoint: "10.1.2.3", Port: 17001, AgentName: "9f1c2a0e-agent",
			DstKVIndices: big, DstAuxIndex: 17, RequiredDstInfoNum: 2,
			DstStateIndices: [][]int32{{5, -1}, {}, {7}}, DecodePrefixLen: 64, DecodePrefixLenSet: true,
		},
		&NIXLTransferInfo{ // dummy MLA rank: no pages, no prefix
			Room: 42, Endpoint: "10.1.2.3", Port: 17001, AgentName: "x",
			DstKVIndices: []int32{}, DstAuxIndex: 0, RequiredDstInfoNum: 1, DecodePrefixLenSet: true,
		},
		&MORIRegistration{
			Endpoint: "10.9.8.7", Port: 30000,
			EngineDesc:    moriDesc("decode-engine-7", 0, 1),
			KVMemDescs:    [][]byte{moriDesc("decode-engine-7", 1), moriDesc("decode-engine-7", 2)},
			AuxMemDescs:   [][]byte{moriDesc("decode-engine-7", 3)},
			StateMemDescs: [][][]byte{{moriDesc("decode-engine-7", 4)}, {}},
			GPUID:         1, DecodeTPSize: 2, DecodeTPRank: 1, KVItemLen: 1 << 20,
			StateItemLens: [][]uint32{{64}, {}}, StateDimPerTensor: [][]uint32{{2}, {}},
		},
		&MORIRegistration{ // nothing optional
			Endpoint: "h", Port: 2, EngineDesc: moriDesc("k"), KVItemLen: 1, DecodeTPSize: 1,
		},
		&MORITransferInfo{
			Room: 7, Endpoint: "10.9.8.7", Port: 30000, EngineKey: "decode-engine-7",
			DstKVIndices: []int32{1, 2, 3, 100}, DstAuxIndex: 5, DstStateIndices: [][]int32{{9}},
			RequiredDstInfoNum: 1, DecodePrefixLen: 32, DecodePrefixLenSet: true,
		},
		&MORITransferInfo{ // dummy: empty indices, no aux, no prefix
			Room: 8, Endpoint: "10.9.8.7", Port: 30000, EngineKey: "decode-engine-7",
			DstKVIndices: []int32{}, DstAuxIndex: -1, RequiredDstInfoNum: 2,
		},
		&Abort{Room: 123456789, Endpoint: "10.1.2.3", Port: 17001},
		&MORIStatus{Room: 7, Status: KVPollSuccess, PrefillUniqueRank: 3},
		&MORIStatus{Room: 8, Status: KVPollFailed, PrefillUniqueRank: 0, Reason: "Aborted by AbortReq. — üñí"},
		&AuxData{Room: 7, BufferIndex: 1, AuxIndex: 12, Data: []byte("aux bytes \x00\x01")},
		&AuxData{Room: 9, BufferIndex: 0, AuxIndex: 0, Data: []byte{}},
	}
}

// kindOf names a message kind the way the Python peer does.
func kindOf(m Message) string {
	switch m.(type) {
	case *NIXLRegistration:
		return "nixl_register"
	case *NIXLTransferInfo:
		return "nixl_transfer"
	case *MORIRegistration:
		return "mori_register"
	case *MORITransferInfo:
		return "mori_transfer"
	case *Abort:
		return "abort"
	case *MORIStatus:
		return "mori_status"
	case *AuxData:
		return "aux_data"
	}
	panic(fmt.Sprintf("unknown message %T", m))
}

// toSpec renders a message as the JSON object the Python peer uses
// (empty and nil slices alike, bytes as hex).
func toSpec(m Message) map[string]any {
	hx := func(b []byte) string { return hex.EncodeToString(b) }
	hexes := func(bs [][]byte) []string {
		out := []string{}
		for _, b := range bs {
			out = append(out, hx(b))
		}
		return out
	}
	s := map[string]any{"kind": kindOf(m)}
	switch m := m.(type) {
	case *NIXLRegistration:
		s["endpoint"], s["port"], s["agent_name"] = m.Endpoint, m.Port, m.AgentName
		s["agent_metadata"] = hx(m.AgentMetadata)
		s["kv_ptrs"], s["aux_ptrs"], s["state_ptrs"] = list(m.KVPtrs), list(m.AuxPtrs), lists(m.StatePtrs)
		s["gpu_id"], s["decode_tp_size"], s["decode_tp_rank"] = m.GPUID, m.DecodeTPSize, m.DecodeTPRank
		s["kv_item_len"] = m.KVItemLen
		s["state_item_lens"], s["state_dim_per_tensor"] = lists(m.StateItemLens), lists(m.StateDimPerTensor)
		s["staging"] = nil
		if m.Staging != nil {
			s["staging"] = map[string]any{"base_ptr": m.Staging.BasePtr, "total_size": m.Staging.TotalSize}
		}
		s["num_slots"] = nil
		if m.NumSlots > 0 {
			s["num_slots"] = m.NumSlots
		}
		kinds := []string{}
		for _, k := range m.KVMemKinds {
			kinds = append(kinds, string(k))
		}
		s["kv_mem_kinds"], s["kv_item_lens"] = kinds, list(m.KVItemLens)
	case *NIXLTransferInfo:
		s["room"], s["endpoint"], s["port"], s["agent_name"] = m.Room, m.Endpoint, m.Port, m.AgentName
		s["dst_kv_indices"], s["dst_aux_index"] = list(m.DstKVIndices), m.DstAuxIndex
		s["required_dst_info_num"], s["dst_state_indices"] = m.RequiredDstInfoNum, lists(m.DstStateIndices)
		s["decode_prefix_len"] = optional(m.DecodePrefixLen, m.DecodePrefixLenSet)
	case *MORIRegistration:
		key, _ := m.EngineKey()
		s["endpoint"], s["port"], s["engine_desc"], s["engine_key"] = m.Endpoint, m.Port, hx(m.EngineDesc), key
		s["kv_mem_descs"], s["aux_mem_descs"] = hexes(m.KVMemDescs), hexes(m.AuxMemDescs)
		nested := []any{}
		for _, c := range m.StateMemDescs {
			nested = append(nested, hexes(c))
		}
		s["state_mem_descs"] = nested
		s["gpu_id"], s["decode_tp_size"], s["decode_tp_rank"] = m.GPUID, m.DecodeTPSize, m.DecodeTPRank
		s["kv_item_len"] = m.KVItemLen
		s["state_item_lens"], s["state_dim_per_tensor"] = lists(m.StateItemLens), lists(m.StateDimPerTensor)
	case *MORITransferInfo:
		s["room"], s["endpoint"], s["port"], s["engine_key"] = m.Room, m.Endpoint, m.Port, m.EngineKey
		s["dst_kv_indices"], s["dst_aux_index"] = list(m.DstKVIndices), m.DstAuxIndex
		s["dst_state_indices"], s["required_dst_info_num"] = lists(m.DstStateIndices), m.RequiredDstInfoNum
		s["decode_prefix_len"] = optional(m.DecodePrefixLen, m.DecodePrefixLenSet)
		s["is_dummy"] = m.IsDummy()
	case *Abort:
		s["room"], s["endpoint"], s["port"] = m.Room, m.Endpoint, m.Port
	case *MORIStatus:
		s["room"], s["status"], s["prefill_unique_rank"] = m.Room, int(m.Status), m.PrefillUniqueRank
		s["reason"] = nil
		if m.Reason != "" {
			s["reason"] = m.Reason
		}
	case *AuxData:
		s["room"], s["buffer_index"], s["aux_index"], s["data"] = m.Room, m.BufferIndex, m.AuxIndex, hx(m.Data)
	}
	return s
}

func list[T any](v []T) []any {
	out := []any{}
	for _, x := range v {
		out = append(out, x)
	}
	return out
}

func lists[T any](v [][]T) []any {
	out := []any{}
	for _, l := range v {
		out = append(out, list(l))
	}
	return out
}

func optional(v int64, set bool) any {
	if !set {
		return nil
	}
	return v
}
