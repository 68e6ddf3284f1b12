// Package vllm encodes and decodes vLLM's NIXL connector side channel:
// the msgpack messages of the ZeroMQ ROUTER/REQ handshake in which a
// decode worker fetches a prefill worker's NIXL agent metadata, the
// compatibility hash both sides compare, the READ completion notification
// and the lease heartbeat. Every generation of the connector kvhost speaks
// (NIXL_CONNECTOR_VERSION; Generation, generation.go) is one table entry
// the codecs read. It is a codec only: the handshake server and client
// that carry these messages over ZeroMQ are host/pull's HandshakeServer and
// FetchHandshake.
//
// Wire shapes, as msgspec produces them (NixlAgentMetadata and
// NixlHandshakePayload are dataclasses, which msgspec encodes as msgpack
// maps keyed by field name, in declaration order):
//
//	request:  [bin "get_meta_msg", int tp_rank]                  (version 2: a Python tuple)
//	          [bin "get_meta_msg", int pp_rank, int tp_rank]     (version 6)
//	reply:    {"compatibility_hash": str, "agent_metadata_bytes": bin}
//	          then, version 6, a second frame: float perf_counter()
//	metadata: {"engine_id": str, "agent_metadata": bin, "kv_caches_base_addr": [int],
//	           "device_id": int, "num_blocks": int, "block_lens": [int],
//	           "kv_cache_layout": str, "block_size": int}
//	          version 6 adds "ssm_sizes": [int, int], "attn_backend_name": str,
//	          "physical_blocks_per_logical_kv_block": int
//	          version 10 adds "block_strides": [int] after "block_lens", and
//	          "dcp_size": int, "pcp_size": int at the end (defaults 1: a
//	          decoder takes 1 when absent)
//	          version 11 adds "region_num_blocks": [int] | nil,
//	          "region_group_ids": [int] | nil, "region_names": [str] | nil,
//	          "region_mem_types": [str] | nil before "dcp_size" (default nil)
//	          version 12 adds "region_members": [[str]] last (default [])
//
// Decoding follows msgspec's rules for these types: a map is required,
// unknown keys are ignored, a missing field, a value of the wrong type or a
// str that is not UTF-8 is an error.
package vllm

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// GetMetaMsg is the request tag of the handshake.
const GetMetaMsg = "get_meta_msg"

// ConnectorVersion is vLLM 0.13's NIXL_CONNECTOR_VERSION (2 adds
// remote_request_id to kv_transfer_params), the default generation. It is
// one of the compatibility hash factors.
const ConnectorVersion = DefaultVersion

// ErrMalformed marks handshake bytes that do not have vLLM's shape.
var ErrMalformed = errors.New("vllm: malformed handshake message")

// ErrHashMismatch is returned when the peer's compatibility hash differs
// from ours and enforcement is on.
var ErrHashMismatch = errors.New("vllm: NIXL compatibility hash mismatch")

// ErrEngineIDMismatch is returned when the peer is not the engine the
// request named.
var ErrEngineIDMismatch = errors.New("vllm: remote NIXL agent engine ID mismatch")

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

// EncodeMetaRequest encodes generation 2's request,
// msgspec.msgpack.encode((GET_META_MSG, tpRank)).
func EncodeMetaRequest(tpRank int) []byte { return G2.EncodeMetaRequest(0, tpRank) }

// EncodeMetaRequest encodes the generation's handshake request:
// (GET_META_MSG, pp_rank, tp_rank), or (GET_META_MSG, tp_rank) without
// RequestPPRank.
func (g *Generation) EncodeMetaRequest(ppRank, tpRank int) []byte {
	var e msgpack.Encoder
	if g.RequestPPRank {
		e.ArrayHeader(3)
		e.Bin([]byte(GetMetaMsg))
		e.Int(int64(ppRank))
	} else {
		e.ArrayHeader(2)
		e.Bin([]byte(GetMetaMsg))
	}
	e.Int(int64(tpRank))
	return e.Bytes()
}

// maxMetaRequest bounds an encoded handshake request: fixarray, bin8
// "get_meta_msg" and two ints of at most 9 bytes take 33 bytes.
const maxMetaRequest = 64

// ErrGeneration marks a peer that speaks another generation of the
// connector than this engine (the error names both when it can tell).
var ErrGeneration = errors.New("vllm: the peer speaks another NIXL connector version")

// ErrRefused marks an empty handshake reply: a kvhost side channel's
// refusal (vLLM has no error reply) of a request it cannot answer, of
// another generation's shape or for a rank it does not serve. It is
// malformed for a vLLM decoder too.
var ErrRefused = fmt.Errorf("%w: the prefill refused the request with an empty reply", ErrMalformed)

// DecodeMetaRequest decodes a generation-2 request and returns the TP
// rank it asks for.
func DecodeMetaRequest(b []byte) (int, error) {
	_, rank, err := G2.DecodeMetaRequest(b)
	return rank, err
}

// DecodeMetaRequest decodes a handshake request of the generation and
// returns the PP rank (0 when the generation has none) and TP rank it asks
// for. It insists on the exact shape; vLLM only logs an unexpected tag,
// kvhost refuses it. A request of another generation's shape is refused
// with ErrGeneration naming both (vLLM's listener would fail to unpack
// it). Bytes longer than any request are refused before they are decoded.
func (g *Generation) DecodeMetaRequest(b []byte) (ppRank, tpRank int, err error) {
	if len(b) > maxMetaRequest {
		return 0, 0, malformed("request of %d bytes; a handshake request has at most %d", len(b), maxMetaRequest)
	}
	v, err := msgpack.Decode(b)
	if err != nil {
		return 0, 0, malformed("request: %v", err)
	}
	want := 2
	if g.RequestPPRank {
		want = 3
	}
	if v.Kind != msgpack.Array || (len(v.Items) != 2 && len(v.Items) != 3) {
		return 0, 0, malformed("request is a msgpack %s of %d items, want [get_meta_msg, rank] or [get_meta_msg, pp_rank, rank]", v.Kind, len(v.Items))
	}
	tag := v.Items[0]
	if (tag.Kind != msgpack.Bin && tag.Kind != msgpack.Str) || string(tag.Raw()) != GetMetaMsg {
		return 0, 0, malformed("request tag is %s %q, want %q", tag.Kind, truncate(tag.Raw()), GetMetaMsg)
	}
	if len(v.Items) != want {
		return 0, 0, fmt.Errorf("%w: a request of %d items, as %s; this engine speaks %s", ErrGeneration,
			len(v.Items), sentBy(func(o *Generation) bool { return o.RequestPPRank == (len(v.Items) == 3) }), g)
	}
	ranks := make([]int, 0, 2)
	for _, it := range v.Items[1:] {
		r, ok := it.Int()
		if !ok || r < 0 || r > 1<<31-1 {
			return 0, 0, malformed("request rank is a msgpack %s, want a non-negative int", it.Kind)
		}
		ranks = append(ranks, int(r))
	}
	if g.RequestPPRank {
		return ranks[0], ranks[1], nil
	}
	return 0, ranks[0], nil
}

// sentBy names the supported generations that match as senders:
// "version 2 sends" or "versions 6, 10 send"; "an unknown version sends"
// when none does.
func sentBy(match func(*Generation) bool) string {
	var vs []string
	for _, v := range Versions() {
		if match(generations[v]) {
			vs = append(vs, strconv.Itoa(v))
		}
	}
	switch len(vs) {
	case 0:
		return "an unknown version sends"
	case 1:
		return "version " + vs[0] + " sends"
	}
	return "versions " + strings.Join(vs, ", ") + " send"
}

// ReplyFrames are the frames of a handshake reply after the REQ
// delimiter: the payload, then, with ReplyClock, the prefill's clock
// (msgspec.msgpack.encode(time.perf_counter()), seconds).
func (g *Generation) ReplyFrames(payload []byte, clock float64) [][]byte {
	if !g.ReplyClock {
		return [][]byte{payload}
	}
	var e msgpack.Encoder
	e.Float(clock)
	return [][]byte{payload, e.Bytes()}
}

// SplitReply takes a handshake reply's frames apart: the payload and the
// prefill's clock (0 without ReplyClock). A reply with the frames of
// another generation is refused with ErrGeneration naming both.
func (g *Generation) SplitReply(frames [][]byte) (payload []byte, clock float64, err error) {
	want := 1
	if g.ReplyClock {
		want = 2
	}
	if len(frames) != want {
		if len(frames) == 1 || len(frames) == 2 {
			return nil, 0, fmt.Errorf("%w: a reply of %d frames, as %s; this engine speaks %s", ErrGeneration,
				len(frames), sentBy(func(o *Generation) bool { return o.ReplyClock == (len(frames) == 2) }), g)
		}
		return nil, 0, malformed("reply has %d frames, want %d", len(frames), want)
	}
	if !g.ReplyClock {
		return frames[0], 0, nil
	}
	if len(frames[1]) > 16 {
		return nil, 0, malformed("reply clock frame of %d bytes", len(frames[1]))
	}
	v, err := msgpack.Decode(frames[1])
	if err != nil {
		return nil, 0, malformed("reply clock: %v", err)
	}
	switch v.Kind {
	case msgpack.Float:
		clock, _ = v.Float()
	case msgpack.Int, msgpack.Uint:
		n, ok := v.Int()
		if !ok {
			return nil, 0, malformed("reply clock out of range")
		}
		clock = float64(n)
	default:
		return nil, 0, malformed("reply clock is a msgpack %s, want a float", v.Kind)
	}
	if math.IsNaN(clock) || math.IsInf(clock, 0) {
		return nil, 0, malformed("reply clock %v is not a time", clock)
	}
	return frames[0], clock, nil
}

// AgentMetadata is vLLM's NixlAgentMetadata: what a prefill worker
// publishes about its KV cache and NIXL agent. A generation encodes and
// requires its own fields (Generation.MetadataFields); the others are
// ignored.
type AgentMetadata struct {
	EngineID         string
	AgentMetadata    []byte   // NIXL agent metadata blob (get_agent_metadata())
	KVCachesBaseAddr []uint64 // base address of each registered KV region
	DeviceID         int
	NumBlocks        int
	BlockLens        []int // bytes per block, per region
	KVCacheLayout    string
	BlockSize        int // tokens per block

	// Since version 6.
	SSMSizes                 [2]int // Mamba (conv, ssm) state sizes; (0, 0) without Mamba
	AttnBackendName          string // the prefill's attention backend
	PhysicalBlocksPerLogical int    // kernel blocks per logical block; 1 when they are the same

	// Since version 10.
	BlockStrides []int // bytes from one block to the next, per region; BlockLens when blocks are contiguous
	DCPSize      int   // decode context parallel size of the engine (1: none)
	PCPSize      int   // prefill context parallel size of the engine (1: none)

	// Since version 11: per-region transfer geometry, index-aligned with
	// KVCachesBaseAddr. nil is None (the peer gives none: every region has
	// num_blocks blocks, is in group 0 and of the decode's memory type); a
	// decoded list is never nil, even when empty.
	RegionNumBlocks []int    // blocks of each region
	RegionGroupIDs  []int    // the KV cache (transfer) group of each region
	RegionNames     []string // the layer each region belongs to
	RegionMemTypes  []string // NIXL memory type of each region: "VRAM", "DRAM"

	// Since version 12: the layer names sharing each region, in region
	// order; empty (nil) when the worker does not say (a pull worker).
	RegionMembers [][]string
}

// Encode is msgspec.msgpack.encode(NixlAgentMetadata(...)) of generation 2.
func (m *AgentMetadata) Encode() []byte { return m.EncodeFor(G2) }

// EncodeFor is msgspec.msgpack.encode(NixlAgentMetadata(...)) of
// generation g: its fields, in declaration order.
func (m *AgentMetadata) EncodeFor(g *Generation) []byte {
	var e msgpack.Encoder
	e.MapHeader(len(g.MetadataFields) + len(g.MetadataDefaults))
	for _, f := range append(slices.Clone(g.MetadataFields), g.MetadataDefaults...) {
		e.Str(f)
		switch f {
		case "engine_id":
			e.Str(m.EngineID)
		case "agent_metadata":
			e.Bin(m.AgentMetadata)
		case "kv_caches_base_addr":
			e.ArrayHeader(len(m.KVCachesBaseAddr))
			for _, a := range m.KVCachesBaseAddr {
				e.Uint(a)
			}
		case "device_id":
			e.Int(int64(m.DeviceID))
		case "num_blocks":
			e.Int(int64(m.NumBlocks))
		case "block_lens":
			e.ArrayHeader(len(m.BlockLens))
			for _, l := range m.BlockLens {
				e.Int(int64(l))
			}
		case "kv_cache_layout":
			e.Str(m.KVCacheLayout)
		case "block_size":
			e.Int(int64(m.BlockSize))
		case "ssm_sizes":
			e.ArrayHeader(2)
			e.Int(int64(m.SSMSizes[0]))
			e.Int(int64(m.SSMSizes[1]))
		case "attn_backend_name":
			e.Str(m.AttnBackendName)
		case "physical_blocks_per_logical_kv_block":
			e.Int(int64(m.PhysicalBlocksPerLogical))
		case "block_strides":
			e.ArrayHeader(len(m.BlockStrides))
			for _, l := range m.BlockStrides {
				e.Int(int64(l))
			}
		case "dcp_size":
			e.Int(int64(m.DCPSize))
		case "pcp_size":
			e.Int(int64(m.PCPSize))
		case "region_num_blocks":
			intsOrNil(&e, m.RegionNumBlocks)
		case "region_group_ids":
			intsOrNil(&e, m.RegionGroupIDs)
		case "region_names":
			strsOrNil(&e, m.RegionNames)
		case "region_mem_types":
			strsOrNil(&e, m.RegionMemTypes)
		case "region_members":
			e.ArrayHeader(len(m.RegionMembers))
			for _, names := range m.RegionMembers {
				e.ArrayHeader(len(names))
				for _, n := range names {
					e.Str(n)
				}
			}
		default:
			panic("vllm: no encoder for NixlAgentMetadata field " + f) // a table entry without code
		}
	}
	return e.Bytes()
}

// DecodeAgentMetadata decodes generation 2's agent_metadata_bytes.
func DecodeAgentMetadata(b []byte) (*AgentMetadata, error) { return G2.DecodeAgentMetadata(b) }

// DecodeAgentMetadata decodes agent_metadata_bytes of the generation:
// every field of MetadataFields is required, others are ignored.
func (g *Generation) DecodeAgentMetadata(b []byte) (*AgentMetadata, error) {
	s, err := decodeStruct(b, "NixlAgentMetadata")
	if err != nil {
		return nil, err
	}
	m := &AgentMetadata{}
	for _, f := range g.MetadataFields {
		switch f {
		case "engine_id":
			m.EngineID = s.str(f)
		case "agent_metadata":
			m.AgentMetadata = s.bin(f)
		case "kv_caches_base_addr":
			m.KVCachesBaseAddr = s.uints(f)
		case "device_id":
			m.DeviceID = s.int(f)
		case "num_blocks":
			m.NumBlocks = s.int(f)
		case "block_lens":
			m.BlockLens = s.ints(f)
		case "kv_cache_layout":
			m.KVCacheLayout = s.str(f)
		case "block_size":
			m.BlockSize = s.int(f)
		case "ssm_sizes":
			// tuple[int, int]: msgspec wants an array of exactly two ints.
			if v := s.ints(f); s.err == nil {
				if len(v) != 2 {
					s.err = malformed("NixlAgentMetadata field %q has %d items, want 2", f, len(v))
				} else {
					m.SSMSizes = [2]int{v[0], v[1]}
				}
			}
		case "attn_backend_name":
			m.AttnBackendName = s.str(f)
		case "physical_blocks_per_logical_kv_block":
			m.PhysicalBlocksPerLogical = s.int(f)
		case "block_strides":
			m.BlockStrides = s.ints(f)
		default:
			panic("vllm: no decoder for NixlAgentMetadata field " + f)
		}
	}
	for _, f := range g.MetadataDefaults {
		switch f {
		case "dcp_size":
			m.DCPSize = s.intOr(f, 1) // the dataclass default
		case "pcp_size":
			m.PCPSize = s.intOr(f, 1)
		// The region lists default to None; msgspec takes nil for None.
		case "region_num_blocks":
			if !s.isNil(f) {
				m.RegionNumBlocks = s.ints(f)
			}
		case "region_group_ids":
			if !s.isNil(f) {
				m.RegionGroupIDs = s.ints(f)
			}
		case "region_names":
			if !s.isNil(f) {
				m.RegionNames = s.strs(f)
			}
		case "region_mem_types":
			if !s.isNil(f) {
				m.RegionMemTypes = s.strs(f)
			}
		case "region_members":
			// list[list[str]], default empty: None is a type error.
			if s.has(f) {
				for i, it := range s.list(f) {
					names, ok := strsOf(it)
					if !ok {
						s.typeErr(fmt.Sprintf("%s[%d]", f, i), "array of str", it)
						break
					}
					m.RegionMembers = append(m.RegionMembers, names)
				}
			}
		default:
			panic("vllm: no decoder for NixlAgentMetadata field " + f)
		}
	}
	if s.err != nil {
		return nil, s.err
	}
	if err := m.checkRegions(); err != nil {
		return nil, err
	}
	return m, nil
}

// HandshakePayload is vLLM's NixlHandshakePayload: the hash, checked
// first, and the still-encoded agent metadata.
type HandshakePayload struct {
	CompatibilityHash  string
	AgentMetadataBytes []byte
}

// Encode is msgspec.msgpack.encode(NixlHandshakePayload(...)).
func (p *HandshakePayload) Encode() []byte {
	var e msgpack.Encoder
	e.MapHeader(2)
	e.Str("compatibility_hash")
	e.Str(p.CompatibilityHash)
	e.Str("agent_metadata_bytes")
	e.Bin(p.AgentMetadataBytes)
	return e.Bytes()
}

// NewHandshakePayload wraps generation 2's encoded agent metadata with the
// local hash, as a prefill worker publishes it.
func NewHandshakePayload(hash string, md *AgentMetadata) *HandshakePayload {
	return G2.NewHandshakePayload(hash, md)
}

// NewHandshakePayload wraps the generation's encoded agent metadata with
// the local hash.
func (g *Generation) NewHandshakePayload(hash string, md *AgentMetadata) *HandshakePayload {
	return &HandshakePayload{CompatibilityHash: hash, AgentMetadataBytes: md.EncodeFor(g)}
}

// DecodeHandshakePayload decodes the first phase: the payload wrapper.
func DecodeHandshakePayload(b []byte) (*HandshakePayload, error) {
	s, err := decodeStruct(b, "NixlHandshakePayload")
	if err != nil {
		return nil, err
	}
	p := &HandshakePayload{
		CompatibilityHash:  s.str("compatibility_hash"),
		AgentMetadataBytes: s.bin("agent_metadata_bytes"),
	}
	if s.err != nil {
		return nil, s.err
	}
	return p, nil
}

// Expect is what a decode worker checks in a handshake reply.
type Expect struct {
	LocalHash   string // our compatibility hash
	EnforceHash bool   // vLLM's enforce_handshake_compat (default true)
	EngineID    string // the remote_engine_id the request named
	// Gen is this engine's generation; nil means version 2.
	Gen *Generation
}

// DecodeHandshake decodes a reply in vLLM's two phases: the wrapper and
// its hash first (a mismatch is refused before the metadata is even
// decoded, unless enforcement is off), then the agent metadata, whose
// engine id must be the expected one.
func DecodeHandshake(reply []byte, want Expect) (*AgentMetadata, error) {
	p, err := DecodeHandshakePayload(reply)
	if err != nil {
		return nil, fmt.Errorf("failed to decode NixlHandshakePayload (incompatible connector version?): %w", err)
	}
	if want.EnforceHash && p.CompatibilityHash != want.LocalHash {
		return nil, fmt.Errorf("%w. Local: %s, Remote: %s. Prefill and decode instances have incompatible "+
			"configurations (vLLM version, model, dtype, KV heads, head size, layers, attention backend or cache dtype). "+
			"Turn the check off only if you know better (vLLM: kv_connector_extra_config enforce_handshake_compat=false)",
			ErrHashMismatch, want.LocalHash, p.CompatibilityHash)
	}
	md, err := Or(want.Gen).DecodeAgentMetadata(p.AgentMetadataBytes)
	if err != nil {
		return nil, fmt.Errorf("failed to decode NixlAgentMetadata: %w", err)
	}
	if md.EngineID != want.EngineID {
		return nil, fmt.Errorf("%w: expected %q, received %q", ErrEngineIDMismatch, want.EngineID, md.EngineID)
	}
	return md, nil
}

// structReader reads the fields of a msgspec-encoded dataclass; the first
// error sticks.
type structReader struct {
	name string
	m    msgpack.Value
	err  error
}

func decodeStruct(b []byte, name string) (*structReader, error) {
	v, err := msgpack.Decode(b)
	if err != nil {
		return nil, malformed("%s: %v", name, err)
	}
	if v.Kind != msgpack.Map {
		return nil, malformed("%s is a msgpack %s, want a map", name, v.Kind)
	}
	return &structReader{name: name, m: v}, nil
}

func (s *structReader) field(key string) (msgpack.Value, bool) {
	if s.err != nil {
		return msgpack.Value{}, false
	}
	var (
		v     msgpack.Value
		found bool
	)
	for _, p := range s.m.Pairs { // the last occurrence wins
		if k, ok := p[0].Str(); ok && k == key {
			v, found = p[1], true
		}
	}
	if !found {
		s.err = malformed("%s is missing required field %q", s.name, key)
	}
	return v, found
}

// has says whether the struct has key (a field with a default may be
// absent).
func (s *structReader) has(key string) bool {
	for _, p := range s.m.Pairs {
		if k, ok := p[0].Str(); ok && k == key {
			return true
		}
	}
	return false
}

func (s *structReader) typeErr(key, want string, v msgpack.Value) {
	if s.err == nil {
		s.err = malformed("%s field %q is a msgpack %s, expected %s", s.name, key, v.Kind, want)
	}
}

func (s *structReader) str(key string) string {
	v, ok := s.field(key)
	if !ok {
		return ""
	}
	str, ok := v.Str()
	if !ok {
		s.typeErr(key, "str", v)
	} else if !utf8.ValidString(str) && s.err == nil {
		// msgspec decodes msgpack str as UTF-8 and fails otherwise.
		s.err = malformed("%s field %q is not valid UTF-8", s.name, key)
	}
	return str
}

func (s *structReader) bin(key string) []byte {
	v, ok := s.field(key)
	if !ok {
		return nil
	}
	b, ok := v.Bin()
	if !ok {
		s.typeErr(key, "bytes", v)
	}
	return b
}

func (s *structReader) int(key string) int {
	v, ok := s.field(key)
	if !ok {
		return 0
	}
	i, ok := v.Int()
	if !ok || i < -1<<62 || i > 1<<62 {
		s.typeErr(key, "int", v)
	}
	return int(i)
}

// intOr reads an optional int field, def when absent.
func (s *structReader) intOr(key string, def int) int {
	if !s.has(key) {
		return def
	}
	return s.int(key)
}

func (s *structReader) list(key string) []msgpack.Value {
	v, ok := s.field(key)
	if !ok {
		return nil
	}
	if v.Kind != msgpack.Array {
		s.typeErr(key, "array", v)
		return nil
	}
	return v.Items
}

// isNil says whether the struct has key with the value nil (None); an
// absent key is None too, the region lists' default.
func (s *structReader) isNil(key string) bool {
	if !s.has(key) {
		return true
	}
	v, ok := s.field(key)
	return ok && v.Kind == msgpack.Nil
}

// strs reads a list of str, each valid UTF-8 (msgspec's str); never nil
// when the field is a list.
func (s *structReader) strs(key string) []string {
	items := s.list(key)
	if s.err != nil {
		return nil
	}
	out := make([]string, len(items))
	for i, it := range items {
		str, ok := it.Str()
		if !ok || !utf8.ValidString(str) {
			s.typeErr(fmt.Sprintf("%s[%d]", key, i), "str", it)
			return nil
		}
		out[i] = str
	}
	return out
}

// strsOf is v as a list of UTF-8 str.
func strsOf(v msgpack.Value) ([]string, bool) {
	if v.Kind != msgpack.Array {
		return nil, false
	}
	out := make([]string, len(v.Items))
	for i, it := range v.Items {
		str, ok := it.Str()
		if !ok || !utf8.ValidString(str) {
			return nil, false
		}
		out[i] = str
	}
	return out, true
}

func intsOrNil(e *msgpack.Encoder, v []int) {
	if v == nil {
		e.Nil()
		return
	}
	e.ArrayHeader(len(v))
	for _, x := range v {
		e.Int(int64(x))
	}
}

func strsOrNil(e *msgpack.Encoder, v []string) {
	if v == nil {
		e.Nil()
		return
	}
	e.ArrayHeader(len(v))
	for _, x := range v {
		e.Str(x)
	}
}

func (s *structReader) uints(key string) []uint64 {
	items := s.list(key)
	out := make([]uint64, len(items))
	for i, it := range items {
		u, ok := it.Uint()
		if !ok {
			s.typeErr(fmt.Sprintf("%s[%d]", key, i), "non-negative int", it)
			return nil
		}
		out[i] = u
	}
	return out
}

func (s *structReader) ints(key string) []int {
	items := s.list(key)
	out := make([]int, len(items))
	for i, it := range items {
		v, ok := it.Int()
		if !ok || v < -1<<62 || v > 1<<62 {
			s.typeErr(fmt.Sprintf("%s[%d]", key, i), "int", it)
			return nil
		}
		out[i] = int(v)
	}
	return out
}

func truncate(b []byte) []byte {
	if len(b) > 40 {
		return b[:40]
	}
	return b
}
