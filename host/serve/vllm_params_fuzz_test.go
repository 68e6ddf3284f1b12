package serve

import (
	"slices"
	"testing"

	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

func fuzzGens(t testing.TB) []*vllm.Generation {
	var gs []*vllm.Generation
	for _, v := range vllm.Versions() {
		g, err := vllm.Lookup(v)
		if err != nil {
			t.Fatal(err)
		}
		gs = append(gs, g)
	}
	return gs
}

// FuzzVLLMParams: kv_transfer_params come from a proxy (the peer's
// output): parsing them in every generation never panics, and params a
// generation accepts survive its own encoding.
func FuzzVLLMParams(f *testing.F) {
	for _, g := range fuzzGens(f) {
		var e msgpack.Encoder
		encodeVLLMParams(&e, pull.KVTransferParams{DoRemotePrefill: true, RemoteBlockIDs: []int32{1, 5}, RemoteEngineID: "e",
			RemoteRequestID: "r", RemoteHost: "h", RemotePort: 9, TPSize: 2, RemoteNumTokens: 7}, g)
		f.Add(e.Bytes())
	}
	f.Add([]byte{0x81, 0xb0, 'r', 'e', 'm', 'o', 't', 'e', '_', 'b', 'l', 'o', 'c', 'k', '_', 'i', 'd', 's', 0x92, 0x90, 0x90})
	// Version 10's keys, refused values among them.
	for _, kv := range [][2]any{{"dcp_size", 2}, {"transfer_mode", "push"}, {"transfer_mode", 1}, {"pp_size", "x"}} {
		var e msgpack.Encoder
		e.MapHeader(2)
		e.Str("remote_block_ids")
		e.ArrayHeader(1)
		e.ArrayHeader(1)
		e.Int(3)
		e.Str(kv[0].(string))
		switch v := kv[1].(type) {
		case int:
			e.Int(int64(v))
		case string:
			e.Str(v)
		}
		f.Add(e.Bytes())
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := msgpack.Decode(b)
		if err != nil {
			return
		}
		for _, g := range fuzzGens(t) {
			p, err := vllmParamsOf(v, g)
			if err != nil {
				continue
			}
			var e msgpack.Encoder
			encodeVLLMParams(&e, p, g)
			v2, err := msgpack.Decode(e.Bytes())
			if err != nil {
				t.Fatal(err)
			}
			p2, err := vllmParamsOf(v2, g)
			if err != nil || !slices.Equal(p2.RemoteBlockIDs, p.RemoteBlockIDs) || p2.RemoteRequestID != p.RemoteRequestID ||
				p2.RemoteEngineID != p.RemoteEngineID || p2.RemotePort != p.RemotePort {
				t.Fatalf("%s: %+v re-read as %+v, %v", g, p, p2, err)
			}
		}
	})
}

// FuzzVLLMCompat: an engine's compat map never panics the hash; a hash
// comes with a supported generation.
func FuzzVLLMCompat(f *testing.F) {
	var e msgpack.Encoder
	e.MapHeader(2)
	e.Str("nixl_connector_version")
	e.Int(6)
	e.Str("speculative_config")
	e.Nil()
	f.Add(e.Bytes())
	e.Reset()
	e.MapHeader(2)
	e.Str("nixl_connector_version")
	e.Int(10)
	e.Str("transfer_mode")
	e.Str("pull")
	f.Add(e.Bytes())
	f.Add([]byte{0x80})
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := msgpack.Decode(b)
		if err != nil {
			return
		}
		c, err := vllmCompatOf(v)
		if err == nil && (c.Gen == nil || len(c.Hash) != 64) {
			t.Fatalf("%+v", c)
		}
	})
}
