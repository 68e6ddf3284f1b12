package vllm

import (
	"encoding/hex"
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

func sampleMetadata() *AgentMetadata {
	return &AgentMetadata{
		EngineID:         "prefill-engine-0",
		AgentMetadata:    []byte("\x00nixl agent md\xff"),
		KVCachesBaseAddr: []uint64{0x7f0000000000, 0x7f0000100000, 1<<64 - 1},
		DeviceID:         2,
		NumBlocks:        12345,
		BlockLens:        []int{4096, 4096, 2048},
		KVCacheLayout:    "HND",
		BlockSize:        16,
	}
}

// Golden bytes from Python's msgpack.packb of the same values (msgspec
// produces the same for dataclasses, tuples and bytes).
func TestEncodeGolden(t *testing.T) {
	if got := hex.EncodeToString(EncodeMetaRequest(3)); got != "92c40c6765745f6d6574615f6d736703" {
		t.Errorf("request: %s", got)
	}
	md := &AgentMetadata{EngineID: "e", AgentMetadata: []byte{1}, KVCachesBaseAddr: []uint64{1}, NumBlocks: 10,
		BlockLens: []int{4096}, KVCacheLayout: "HND", BlockSize: 16}
	want := "88a9656e67696e655f6964a165ae6167656e745f6d65746164617461c40101b36b765f6361636865735f626173655f616464729101" +
		"a96465766963655f696400aa6e756d5f626c6f636b730aaa626c6f636b5f6c656e7391cd1000af6b765f63616368655f6c61796f7574" +
		"a3484e44aa626c6f636b5f73697a6510"
	if got := hex.EncodeToString(md.Encode()); got != want {
		t.Errorf("metadata:\n got %s\nwant %s", got, want)
	}
	p := &HandshakePayload{CompatibilityHash: "h", AgentMetadataBytes: []byte("xy")}
	if got := hex.EncodeToString(p.Encode()); got != "82b2636f6d7061746962696c6974795f68617368a168b46167656e745f6d657461646174615f6279746573c4027879" {
		t.Errorf("payload: %s", got)
	}
}

func TestRoundTrip(t *testing.T) {
	md := sampleMetadata()
	got, err := DecodeAgentMetadata(md.Encode())
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, md) {
		t.Fatalf("got %+v", got)
	}
	for _, rank := range []int{0, 1, 127, 128, 70000} {
		r, err := DecodeMetaRequest(EncodeMetaRequest(rank))
		if err != nil || r != rank {
			t.Fatalf("rank %d: %d %v", rank, r, err)
		}
	}
}

func TestDecodeHandshakeTwoPhase(t *testing.T) {
	md := sampleMetadata()
	reply := NewHandshakePayload("hash-A", md).Encode()
	want := Expect{LocalHash: "hash-A", EnforceHash: true, EngineID: md.EngineID}
	got, err := DecodeHandshake(reply, want)
	if err != nil || !reflect.DeepEqual(got, md) {
		t.Fatalf("matching handshake: %+v %v", got, err)
	}

	// Hash mismatch: refused with both hashes, before the metadata is
	// decoded (it is garbage here and must not matter).
	garbage := (&HandshakePayload{CompatibilityHash: "hash-B", AgentMetadataBytes: []byte{0xc1}}).Encode()
	_, err = DecodeHandshake(garbage, want)
	if !errors.Is(err, ErrHashMismatch) || !strings.Contains(err.Error(), "Local: hash-A") || !strings.Contains(err.Error(), "Remote: hash-B") {
		t.Fatalf("mismatch: %v", err)
	}
	// Enforcement off: the mismatch passes, the metadata is decoded.
	loose := want
	loose.EnforceHash = false
	if _, err := DecodeHandshake(NewHandshakePayload("hash-B", md).Encode(), loose); err != nil {
		t.Fatalf("enforcement off: %v", err)
	}
	if _, err := DecodeHandshake(garbage, loose); !errors.Is(err, ErrMalformed) {
		t.Fatalf("enforcement off, bad metadata: %v", err)
	}
	// Engine id mismatch.
	other := want
	other.EngineID = "someone-else"
	if _, err := DecodeHandshake(reply, other); !errors.Is(err, ErrEngineIDMismatch) || !strings.Contains(err.Error(), "someone-else") {
		t.Fatalf("engine id: %v", err)
	}
}

func encodeMap(kv ...any) []byte {
	var e msgpack.Encoder
	e.MapHeader(len(kv) / 2)
	for i := 0; i < len(kv); i += 2 {
		e.Str(kv[i].(string))
		switch v := kv[i+1].(type) {
		case string:
			e.Str(v)
		case []byte:
			e.Bin(v)
		case int:
			e.Int(int64(v))
		case nil:
			e.Nil()
		case []int:
			e.ArrayHeader(len(v))
			for _, x := range v {
				e.Int(int64(x))
			}
		}
	}
	return e.Bytes()
}

func TestDecodeRejects(t *testing.T) {
	okFields := []any{"engine_id", "e", "agent_metadata", []byte{1}, "kv_caches_base_addr", []int{1},
		"device_id", 0, "num_blocks", 1, "block_lens", []int{1}, "kv_cache_layout", "NHD", "block_size", 16}
	if _, err := DecodeAgentMetadata(encodeMap(append(okFields, "future_field", "ignored")...)); err != nil {
		t.Fatalf("unknown fields must be ignored: %v", err)
	}
	replace := func(key string, v any) []byte {
		f := append([]any{}, okFields...)
		for i := 0; i < len(f); i += 2 {
			if f[i] == key {
				f[i+1] = v
			}
		}
		return encodeMap(f...)
	}
	cases := map[string][]byte{
		"not a map":           EncodeMetaRequest(0),
		"missing field":       encodeMap(okFields[:14]...),
		"engine id not str":   replace("engine_id", 5),
		"engine id not UTF-8": replace("engine_id", "e\xff"),
		"metadata as str":     replace("agent_metadata", "text"),
		"negative address":    replace("kv_caches_base_addr", []int{-1}),
		"block lens not list": replace("block_lens", 4096),
		"block size nil":      replace("block_size", nil),
		"truncated":           encodeMap(okFields...)[:20],
		"trailing":            append(encodeMap(okFields...), 0),
	}
	for name, b := range cases {
		if _, err := DecodeAgentMetadata(b); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v, want ErrMalformed", name, err)
		}
	}
	for name, b := range map[string][]byte{
		"empty":    {},
		"hash int": encodeMap("compatibility_hash", 1, "agent_metadata_bytes", []byte{}),
		"no bytes": encodeMap("compatibility_hash", "h"),
	} {
		if _, err := DecodeHandshakePayload(b); !errors.Is(err, ErrMalformed) {
			t.Errorf("payload %s: %v", name, err)
		}
	}
	var e msgpack.Encoder
	e.ArrayHeader(2)
	e.Str("get_meta_msg")
	e.Int(1)
	if r, err := DecodeMetaRequest(e.Bytes()); err != nil || r != 1 {
		t.Errorf("str tag should be accepted: %v", err)
	}
	for name, b := range map[string][]byte{
		"wrong tag": func() []byte { var e msgpack.Encoder; e.ArrayHeader(2); e.Bin([]byte("x")); e.Int(0); return e.Bytes() }(),
		"negative rank": func() []byte {
			var e msgpack.Encoder
			e.ArrayHeader(2)
			e.Bin([]byte(GetMetaMsg))
			e.Int(-1)
			return e.Bytes()
		}(),
		"four items": func() []byte {
			var e msgpack.Encoder
			e.ArrayHeader(4)
			e.Bin([]byte(GetMetaMsg))
			e.Int(0)
			e.Int(0)
			e.Int(0)
			return e.Bytes()
		}(),
		"garbage": {0xc1},
		"too long": func() []byte {
			var e msgpack.Encoder
			e.ArrayHeader(2)
			e.Bin([]byte(GetMetaMsg))
			e.Int(math.MaxInt64)
			return append(e.Bytes(), make([]byte, maxMetaRequest)...)
		}(),
	} {
		if _, err := DecodeMetaRequest(b); !errors.Is(err, ErrMalformed) {
			t.Errorf("request %s: %v", name, err)
		}
	}
}

// Golden hash from Python: hashlib.sha256(json.dumps(f, sort_keys=True).encode()).hexdigest().
func TestCompatibilityHashGolden(t *testing.T) {
	f := CompatFactors{VLLMVersion: "0.13.0", ConnectorVersion: ConnectorVersion, Model: "meta-llama/Llama-3.1-8B-Instruct",
		DType: "torch.bfloat16", NumKVHeads: 8, HeadSize: 128, NumHiddenLayers: 32, AttnBackendName: "FLASH_ATTN", CacheDType: "auto"}
	if got := CompatibilityHash(f); got != "68657f3176b59fd3da7a0f8e452ad780386f0b403a7def4f4c4a070a1da0d01e" {
		t.Fatalf("hash %s", got)
	}
	// TP size and block size are not factors; everything else is.
	g := f
	g.CacheDType = "fp8"
	if CompatibilityHash(g) == CompatibilityHash(f) {
		t.Fatal("cache dtype must change the hash")
	}
}

func FuzzDecodeMetaRequest(f *testing.F) {
	f.Add(EncodeMetaRequest(0))
	f.Add([]byte{0x92, 0xa1, 'x', 0x00})
	f.Fuzz(func(t *testing.T, b []byte) {
		if r, err := DecodeMetaRequest(b); err == nil && r < 0 {
			t.Fatalf("negative rank %d", r)
		}
	})
}

func FuzzDecodeHandshake(f *testing.F) {
	f.Add(NewHandshakePayload("h", sampleMetadata()).Encode())
	f.Add(sampleMetadata().Encode())
	f.Fuzz(func(t *testing.T, b []byte) {
		DecodeHandshake(b, Expect{LocalHash: "h", EnforceHash: true, EngineID: "prefill-engine-0"})
		DecodeHandshake(b, Expect{})
		if md, err := DecodeAgentMetadata(b); err == nil {
			again, err := DecodeAgentMetadata(md.Encode())
			if err != nil || !reflect.DeepEqual(again, md) {
				t.Fatalf("metadata does not round-trip: %+v vs %+v (%v)", md, again, err)
			}
		}
	})
}
