// Package vllm encodes and decodes vLLM's NIXL connector side channel (see
// vLLM 0.13's vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py):
// the msgpack messages of the ZeroMQ ROUTER/REQ handshake in which a decode
// worker fetches a prefill worker's NIXL agent metadata, the compatibility
// hash both sides compare, and the READ completion notification. It is a
// codec only: the handshake server and client that carry these messages
// over ZeroMQ are host/pull's HandshakeServer and FetchHandshake.
//
// Wire shapes, as msgspec produces them (NixlAgentMetadata and
// NixlHandshakePayload are dataclasses, which msgspec encodes as msgpack
// maps keyed by field name, in declaration order):
//
//	request:  [bin "get_meta_msg", int target_tp_rank]        (a msgpack array: a Python tuple)
//	reply:    {"compatibility_hash": str, "agent_metadata_bytes": bin}
//	metadata: {"engine_id": str, "agent_metadata": bin, "kv_caches_base_addr": [int],
//	           "device_id": int, "num_blocks": int, "block_lens": [int],
//	           "kv_cache_layout": str, "block_size": int}
//
// Decoding follows msgspec's rules for these types: a map is required,
// unknown keys are ignored, a missing field, a value of the wrong type or a
// str that is not UTF-8 is an error.
package vllm

import (
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// GetMetaMsg is the request tag of the handshake.
const GetMetaMsg = "get_meta_msg"

// ConnectorVersion is vLLM's kv_connector/v1/nixl_connector.py's NIXL_CONNECTOR_VERSION (2 adds
// remote_request_id to kv_transfer_params). It is one of the
// compatibility hash factors.
const ConnectorVersion = 2

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

// EncodeMetaRequest encodes msgspec.msgpack.encode((GET_META_MSG, tpRank)).
func EncodeMetaRequest(tpRank int) []byte {
	var e msgpack.Encoder
	e.ArrayHeader(2)
	e.Bin([]byte(GetMetaMsg))
	e.Int(int64(tpRank))
	return e.Bytes()
}

// maxMetaRequest bounds an encoded handshake request: fixarray, bin8
// "get_meta_msg" and an int of at most 9 bytes take 24 bytes.
const maxMetaRequest = 64

// DecodeMetaRequest decodes a handshake request and returns the TP rank it
// asks for. It insists on the exact shape; vLLM's kv_connector/v1/nixl_connector.py only logs an
// unexpected tag, kvhost refuses it. Bytes longer than any request are
// refused before they are decoded.
func DecodeMetaRequest(b []byte) (int, error) {
	if len(b) > maxMetaRequest {
		return 0, malformed("request of %d bytes; a [get_meta_msg, rank] request has at most %d", len(b), maxMetaRequest)
	}
	v, err := msgpack.Decode(b)
	if err != nil {
		return 0, malformed("request: %v", err)
	}
	if v.Kind != msgpack.Array || len(v.Items) != 2 {
		return 0, malformed("request is a msgpack %s of %d items, want [get_meta_msg, rank]", v.Kind, len(v.Items))
	}
	tag := v.Items[0]
	if (tag.Kind != msgpack.Bin && tag.Kind != msgpack.Str) || string(tag.Raw()) != GetMetaMsg {
		return 0, malformed("request tag is %s %q, want %q", tag.Kind, truncate(tag.Raw()), GetMetaMsg)
	}
	rank, ok := v.Items[1].Int()
	if !ok || rank < 0 || rank > 1<<31-1 {
		return 0, malformed("request TP rank is a msgpack %s, want a non-negative int", v.Items[1].Kind)
	}
	return int(rank), nil
}

// AgentMetadata is vLLM's NixlAgentMetadata: what a prefill worker
// publishes about its KV cache and NIXL agent.
type AgentMetadata struct {
	EngineID         string
	AgentMetadata    []byte   // NIXL agent metadata blob (get_agent_metadata())
	KVCachesBaseAddr []uint64 // base address of each registered KV region
	DeviceID         int
	NumBlocks        int
	BlockLens        []int // bytes per block, per region
	KVCacheLayout    string
	BlockSize        int // tokens per block
}

// Encode is msgspec.msgpack.encode(NixlAgentMetadata(...)).
func (m *AgentMetadata) Encode() []byte {
	var e msgpack.Encoder
	e.MapHeader(8)
	e.Str("engine_id")
	e.Str(m.EngineID)
	e.Str("agent_metadata")
	e.Bin(m.AgentMetadata)
	e.Str("kv_caches_base_addr")
	e.ArrayHeader(len(m.KVCachesBaseAddr))
	for _, a := range m.KVCachesBaseAddr {
		e.Uint(a)
	}
	e.Str("device_id")
	e.Int(int64(m.DeviceID))
	e.Str("num_blocks")
	e.Int(int64(m.NumBlocks))
	e.Str("block_lens")
	e.ArrayHeader(len(m.BlockLens))
	for _, l := range m.BlockLens {
		e.Int(int64(l))
	}
	e.Str("kv_cache_layout")
	e.Str(m.KVCacheLayout)
	e.Str("block_size")
	e.Int(int64(m.BlockSize))
	return e.Bytes()
}

// DecodeAgentMetadata decodes agent_metadata_bytes.
func DecodeAgentMetadata(b []byte) (*AgentMetadata, error) {
	s, err := decodeStruct(b, "NixlAgentMetadata")
	if err != nil {
		return nil, err
	}
	m := &AgentMetadata{
		EngineID:         s.str("engine_id"),
		AgentMetadata:    s.bin("agent_metadata"),
		KVCachesBaseAddr: s.uints("kv_caches_base_addr"),
		DeviceID:         s.int("device_id"),
		NumBlocks:        s.int("num_blocks"),
		BlockLens:        s.ints("block_lens"),
		KVCacheLayout:    s.str("kv_cache_layout"),
		BlockSize:        s.int("block_size"),
	}
	if s.err != nil {
		return nil, s.err
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

// NewHandshakePayload wraps encoded agent metadata with the local hash, as
// a prefill worker publishes it.
func NewHandshakePayload(hash string, md *AgentMetadata) *HandshakePayload {
	return &HandshakePayload{CompatibilityHash: hash, AgentMetadataBytes: md.Encode()}
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
	md, err := DecodeAgentMetadata(p.AgentMetadataBytes)
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
