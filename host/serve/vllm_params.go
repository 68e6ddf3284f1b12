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
//
// gen decides remote_block_ids' shape: one list (version 2) or one list
// per KV cache group (GroupedBlockIDs), of which kvhost reads exactly one
// (a hybrid model's further groups are refused). The fields later
// generations add are read by their names when present.
func vllmParamsOf(v msgpack.Value, gen *vllm.Generation) (pull.KVTransferParams, error) {
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
	intField("remote_num_tokens", &p.RemoteNumTokens)
	intField("remote_block_size", &p.RemoteBlockSize)
	intField("pp_size", &p.PPSize)
	// Version 10's: a context parallel prefill splits each block's tokens
	// over its ranks and a push prefill writes instead of being read;
	// kvhost reads whole blocks.
	var dcp int
	var mode string
	intField("dcp_size", &dcp)
	strField("transfer_mode", &mode)
	if err == nil && dcp > 1 {
		err = fmt.Errorf("kv_transfer_params.dcp_size: %d: kvhost reads prefills without context parallelism only (1)", dcp)
	}
	if err == nil && mode != "" && mode != "pull" {
		err = fmt.Errorf("kv_transfer_params.transfer_mode: %q: kvhost reads (\"pull\") only", mode)
	}
	if f, ok := field("remote_blocks_expiry_time"); ok && err == nil {
		// The decode's own blocks' deadline (bidirectional transfers);
		// a prefill's is None. Checked, not used.
		if _, isFloat := f.Float(); !isFloat {
			if _, isInt := f.Int(); !isInt {
				err = fmt.Errorf("kv_transfer_params.remote_blocks_expiry_time: %s, want a float or nil", f.Kind)
			}
		}
	}
	if err != nil {
		return pull.KVTransferParams{}, err
	}
	if f, ok := field("remote_block_ids"); ok {
		const name = "kv_transfer_params.remote_block_ids"
		if vllm.Or(gen).GroupedBlockIDs {
			if f.Kind != msgpack.Array {
				return pull.KVTransferParams{}, fmt.Errorf("%s: %s, want one list per KV cache group ([[...]], %s)", name, f.Kind, vllm.Or(gen))
			}
			if f.Len() != 1 {
				return pull.KVTransferParams{}, fmt.Errorf("%s: %d KV cache groups; kvhost transfers models with one", name, f.Len())
			}
			f, _ = f.Index(0)
			if f.Kind == msgpack.Array || f.Kind == msgpack.Bin {
				p.RemoteBlockIDs, err = vllmBlockList(name+"[0]", f)
			} else {
				err = fmt.Errorf("%s[0]: %s, want a list of ints (%s groups remote_block_ids)", name, f.Kind, vllm.Or(gen))
			}
		} else {
			p.RemoteBlockIDs, err = vllmBlockList(name, f)
		}
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
// NixlConnectorScheduler.request_finished of generation gen returns, key
// for key in its order (vllm.Generation.ParamsFields): version 2
// do_remote_prefill, do_remote_decode, remote_block_ids (a list of ints),
// remote_engine_id, remote_request_id, remote_host, remote_port, tp_size;
// version 6 has remote_block_ids one list per KV cache group ([[...]]) and
// adds remote_num_tokens and remote_blocks_expiry_time (None: a prefill's
// blocks have no deadline the decode needs); version 10 adds dcp_size and
// pp_size (1) and transfer_mode ("pull").
func encodeVLLMParams(e *msgpack.Encoder, p pull.KVTransferParams, gen *vllm.Generation) {
	gen = vllm.Or(gen)
	e.MapHeader(len(gen.ParamsFields))
	for _, f := range gen.ParamsFields {
		e.Str(f)
		switch f {
		case "do_remote_prefill":
			e.Bool(p.DoRemotePrefill)
		case "do_remote_decode":
			e.Bool(p.DoRemoteDecode)
		case "remote_block_ids":
			if gen.GroupedBlockIDs {
				e.ArrayHeader(1)
			}
			e.ArrayHeader(len(p.RemoteBlockIDs))
			for _, b := range p.RemoteBlockIDs {
				e.Int(int64(b))
			}
		case "remote_engine_id":
			e.Str(p.RemoteEngineID)
		case "remote_request_id":
			e.Str(p.RemoteRequestID)
		case "remote_host":
			e.Str(p.RemoteHost)
		case "remote_port":
			e.Int(int64(p.RemotePort))
		case "tp_size":
			e.Int(int64(p.RemoteTPSize()))
		case "remote_num_tokens":
			e.Int(int64(p.RemoteNumTokens))
		case "remote_blocks_expiry_time":
			e.Nil()
		case "dcp_size", "pp_size":
			e.Int(1)
		case "transfer_mode":
			e.Str("pull")
		default:
			panic("serve: no encoder for kv_transfer_params field " + f) // a table entry without code
		}
	}
}

// vllmCompat is what open_rank's compat map says.
type vllmCompat struct {
	Gen  *vllm.Generation
	Hash string
	// AttnBackend is the attn_backend_name factor, which version-6
	// metadata advertises.
	AttnBackend string
}

// vllmMaxCompatFactors bounds the factors of a compat map.
const vllmMaxCompatFactors = 64

// vllmCompatOf reads open_rank's compat map: nixl_connector_version
// selects the generation (absent: 2, which is then hashed as a factor);
// the factors, by vLLM's names and with the types vLLM hashes them as, give
// vLLM's compatibility hash. A version kvhost does not speak is
// `unsupported`, naming it and the supported ones; anything else wrong is
// `bad_request`.
func vllmCompatOf(v msgpack.Value) (vllmCompat, error) {
	var c vllmCompat
	if v.Kind != msgpack.Map {
		return c, errorf(CodeBadRequest, "compat: %s, want a map", v.Kind)
	}
	if len(v.Pairs) > vllmMaxCompatFactors {
		return c, errorf(CodeBadRequest, "compat: %d factors, at most %d", len(v.Pairs), vllmMaxCompatFactors)
	}
	factors := make(map[string]msgpack.Value, len(v.Pairs))
	for _, p := range v.Pairs {
		k, ok := p[0].Str()
		if !ok {
			return c, errorf(CodeBadRequest, "compat: a key is a msgpack %s, want a str", p[0].Kind)
		}
		factors[k] = p[1]
	}
	version := int64(vllm.DefaultVersion)
	if x, ok := factors["nixl_connector_version"]; ok {
		n, isInt := x.Int()
		if !isInt {
			return c, errorf(CodeBadRequest, "compat.nixl_connector_version: %s, want an int", x.Kind)
		}
		version = n
	} else {
		var e msgpack.Encoder
		e.Int(version)
		factors["nixl_connector_version"], _ = msgpack.Decode(e.Bytes())
	}
	if version < 0 || version > math.MaxInt32 {
		return c, errorf(CodeUnsupported, "compat.nixl_connector_version: %d; kvhost speaks versions %s", version, vllm.VersionList())
	}
	g, err := vllm.Lookup(int(version))
	if err != nil {
		return c, errorf(CodeUnsupported, "compat.nixl_connector_version: %v", err)
	}
	hash, err := g.CompatHash(factors)
	if err != nil {
		return c, errorf(CodeBadRequest, "%v", err)
	}
	c.Gen, c.Hash = g, hash
	c.AttnBackend, _ = factors["attn_backend_name"].Str()
	return c, nil
}
