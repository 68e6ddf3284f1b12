package serve

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// vllmMaxBlockIDs bounds the block ids of one hold or read, and of the
// remote_block_ids of kv_transfer_params.
const vllmMaxBlockIDs = 1 << 20

// vllmParamsOf reads kv_transfer_params as vLLM's scheduler hands them to
// the decode (the dict of request_finished, as msgpack): every field
// vLLM's NixlConnector reads, by its name. remote_block_ids is a list of
// ints (what the dict holds) or, as a convenience, bin of little-endian
// int32. nil values are missing fields. A field of the wrong type is an
// error naming it; missing fields are left zero for pull's own check.
func vllmParamsOf(v msgpack.Value) (pull.KVTransferParams, error) {
	var p pull.KVTransferParams
	if v.Kind != msgpack.Map {
		return p, fmt.Errorf("kv_transfer_params: %s, want a map", v.Kind)
	}
	var err error
	field := func(name string) (msgpack.Value, bool) {
		f, ok := v.Get(name)
		return f, ok && f.Kind != msgpack.Nil
	}
	boolField := func(name string, dst *bool) {
		if f, ok := field(name); ok && err == nil {
			b, ok := f.Bool()
			if !ok {
				err = fmt.Errorf("kv_transfer_params.%s: %s, want a bool", name, f.Kind)
			}
			*dst = b
		}
	}
	strField := func(name string, dst *string) {
		if f, ok := field(name); ok && err == nil {
			s, ok := f.Str()
			if !ok {
				err = fmt.Errorf("kv_transfer_params.%s: %s, want a str", name, f.Kind)
			}
			*dst = s
		}
	}
	intField := func(name string, dst *int) {
		if f, ok := field(name); ok && err == nil {
			n, ok := f.Int()
			if !ok || n < math.MinInt32 || n > math.MaxInt32 {
				err = fmt.Errorf("kv_transfer_params.%s: %s, want an int32", name, f.Kind)
			}
			*dst = int(n)
		}
	}
	boolField("do_remote_prefill", &p.DoRemotePrefill)
	boolField("do_remote_decode", &p.DoRemoteDecode)
	strField("remote_engine_id", &p.RemoteEngineID)
	strField("remote_request_id", &p.RemoteRequestID)
	strField("remote_host", &p.RemoteHost)
	intField("remote_port", &p.RemotePort)
	intField("tp_size", &p.TPSize)
	if err != nil {
		return pull.KVTransferParams{}, err
	}
	if f, ok := field("remote_block_ids"); ok {
		p.RemoteBlockIDs, err = vllmBlockList("kv_transfer_params.remote_block_ids", f)
		if err != nil {
			return pull.KVTransferParams{}, err
		}
	}
	return p, nil
}

// vllmBlockList reads a list of int32 block ids, or packed <i4 bin.
func vllmBlockList(name string, v msgpack.Value) ([]int32, error) {
	switch v.Kind {
	case msgpack.Bin:
		b, _ := v.Bin()
		return vllmBlocks(name, b)
	case msgpack.Array:
		n := v.Len()
		if n > vllmMaxBlockIDs {
			return nil, fmt.Errorf("%s: %d ids, at most %d", name, n, vllmMaxBlockIDs)
		}
		out := make([]int32, n)
		for i := range n {
			e, _ := v.Index(i)
			x, ok := e.Int()
			if !ok || x < 0 || x > math.MaxInt32 {
				return nil, fmt.Errorf("%s[%d]: not a block id", name, i)
			}
			out[i] = int32(x)
		}
		return out, nil
	}
	return nil, fmt.Errorf("%s: %s, want a list of ints", name, v.Kind)
}

// vllmBlocks reads packed little-endian int32 block ids (a numpy array's
// tobytes()), each non-negative.
func vllmBlocks(name string, b []byte) ([]int32, error) {
	if len(b)%4 != 0 {
		return nil, fmt.Errorf("%s: %d bytes is not a whole number of int32", name, len(b))
	}
	if len(b)/4 > vllmMaxBlockIDs {
		return nil, fmt.Errorf("%s: %d ids, at most %d", name, len(b)/4, vllmMaxBlockIDs)
	}
	out := make([]int32, len(b)/4)
	for i := range out {
		x := int32(binary.LittleEndian.Uint32(b[4*i:]))
		if x < 0 {
			return nil, fmt.Errorf("%s[%d]: %d is negative", name, i, x)
		}
		out[i] = x
	}
	return out, nil
}

// vllmPackBlocks packs block ids as little-endian int32.
func vllmPackBlocks(ids []int32) []byte {
	out := make([]byte, 4*len(ids))
	for i, x := range ids {
		binary.LittleEndian.PutUint32(out[4*i:], uint32(x))
	}
	return out
}

// encodeVLLMParams writes p as the dict vLLM's
// NixlConnectorScheduler.request_finished returns, key for key in its
// order: do_remote_prefill, do_remote_decode, remote_block_ids (a list of
// ints), remote_engine_id, remote_request_id, remote_host, remote_port,
// tp_size.
func encodeVLLMParams(e *msgpack.Encoder, p pull.KVTransferParams) {
	e.MapHeader(8)
	e.Str("do_remote_prefill")
	e.Bool(p.DoRemotePrefill)
	e.Str("do_remote_decode")
	e.Bool(p.DoRemoteDecode)
	e.Str("remote_block_ids")
	e.ArrayHeader(len(p.RemoteBlockIDs))
	for _, b := range p.RemoteBlockIDs {
		e.Int(int64(b))
	}
	e.Str("remote_engine_id")
	e.Str(p.RemoteEngineID)
	e.Str("remote_request_id")
	e.Str(p.RemoteRequestID)
	e.Str("remote_host")
	e.Str(p.RemoteHost)
	e.Str("remote_port")
	e.Int(int64(p.RemotePort))
	e.Str("tp_size")
	e.Int(int64(p.RemoteTPSize()))
}

// vllmCompatOf computes vLLM's compatibility hash from open_rank's compat
// map (vLLM's compute_nixl_compatibility_hash factors, by their names).
// Every factor is required: a hash from guessed factors would only fail
// later, at every handshake.
func vllmCompatOf(v msgpack.Value) (string, error) {
	if v.Kind != msgpack.Map {
		return "", fmt.Errorf("compat: %s, want a map", v.Kind)
	}
	var f vllm.CompatFactors
	str := func(name string, dst *string) error {
		x, ok := v.Get(name)
		if !ok {
			return fmt.Errorf("compat.%s: missing", name)
		}
		s, ok := x.Str()
		if !ok {
			return fmt.Errorf("compat.%s: %s, want a str", name, x.Kind)
		}
		*dst = s
		return nil
	}
	num := func(name string, dst *int) error {
		x, ok := v.Get(name)
		if !ok {
			return fmt.Errorf("compat.%s: missing", name)
		}
		n, ok := x.Int()
		if !ok || n < math.MinInt32 || n > math.MaxInt32 {
			return fmt.Errorf("compat.%s: %s, want an int", name, x.Kind)
		}
		*dst = int(n)
		return nil
	}
	for _, err := range []error{
		str("vllm_version", &f.VLLMVersion),
		num("nixl_connector_version", &f.ConnectorVersion),
		str("model", &f.Model),
		str("dtype", &f.DType),
		num("num_kv_heads", &f.NumKVHeads),
		num("head_size", &f.HeadSize),
		num("num_hidden_layers", &f.NumHiddenLayers),
		str("attn_backend_name", &f.AttnBackendName),
		str("cache_dtype", &f.CacheDType),
	} {
		if err != nil {
			return "", err
		}
	}
	return vllm.CompatibilityHash(f), nil
}
