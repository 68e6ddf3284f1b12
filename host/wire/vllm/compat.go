package vllm

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// CompatFactors are the inputs of vLLM's compute_nixl_compatibility_hash:
// exactly what decides whether two workers can exchange KV. TP size, block
// size and KV cache layout are deliberately not factors (they are checked
// per handshake, to allow heterogeneous deployments).
type CompatFactors struct {
	VLLMVersion      string // vllm.__version__ of the peer you pair with, e.g. "0.13.0"
	ConnectorVersion int    // NIXL_CONNECTOR_VERSION; ConnectorVersion for vLLM's kv_connector/v1/nixl_connector.py
	Model            string // model_config.model (name or path as given)
	DType            string // str(model_config.dtype), e.g. "torch.bfloat16"
	NumKVHeads       int    // model_config.get_total_num_kv_heads(): the model's total, MLA too
	HeadSize         int
	NumHiddenLayers  int    // total hidden layers
	AttnBackendName  string // attention backend name, e.g. "FLASH_ATTN"
	CacheDType       string // str(cache_config.cache_dtype), e.g. "auto"
}

// CompatibilityHash computes vLLM's hash: the SHA-256 hex digest of
// json.dumps(factors, sort_keys=True) (vllm.config.utils.hash_factors), so
// a Go worker and a Python worker with the same factors agree.
func CompatibilityHash(f CompatFactors) string {
	var b strings.Builder
	writePythonJSON(&b, map[string]any{
		"vllm_version":           f.VLLMVersion,
		"nixl_connector_version": f.ConnectorVersion,
		"model":                  f.Model,
		"dtype":                  f.DType,
		"num_kv_heads":           f.NumKVHeads,
		"head_size":              f.HeadSize,
		"num_hidden_layers":      f.NumHiddenLayers,
		"attn_backend_name":      f.AttnBackendName,
		"cache_dtype":            f.CacheDType,
	})
	sum := sha256.Sum256([]byte(b.String()))
	return hex.EncodeToString(sum[:])
}

// FactorKind is the Python type vLLM hashes a factor as.
type FactorKind int

// Factor kinds.
const (
	FactorStr  FactorKind = iota // str
	FactorInt                    // int
	FactorBool                   // bool (JSON true/false)
	// FactorDictOrNone is a dict or None (speculative_config): a msgpack
	// map of str keys whose values are None, bool, int, str or lists of
	// them, or nil.
	FactorDictOrNone
)

func (k FactorKind) String() string {
	return [...]string{"a str", "an int", "a bool", "a map or nil"}[k]
}

// Factors are every compatibility hash factor of the generations kvhost
// speaks, by vLLM's name, with the type vLLM hashes it as. A generation
// requires its own (Generation.Factors); the others are hashed when given.
var Factors = map[string]FactorKind{
	"vllm_version":           FactorStr,
	"nixl_connector_version": FactorInt,
	"model":                  FactorStr,
	"dtype":                  FactorStr,
	"num_kv_heads":           FactorInt,
	"head_size":              FactorInt,
	"num_hidden_layers":      FactorInt,
	"attn_backend_name":      FactorStr,
	"cache_dtype":            FactorStr,
	"cross_layers_blocks":    FactorBool,
	"is_hma_enabled":         FactorBool,
	"speculative_config":     FactorDictOrNone,
	"transfer_mode":          FactorStr,
}

// maxFactorDepth bounds the nesting of a factor value (speculative_config
// is a dict of scalars and tuples: depth 2).
const maxFactorDepth = 4

// CompatHash computes vLLM's compatibility hash of the generation from
// factors by vLLM's names (an engine's compat map): every factor of
// g.Factors is required, each known factor must have its type (Factors),
// nixl_connector_version must be g's version and an unknown name is
// refused (a misspelt factor would only fail later, at every handshake).
// The hash covers every factor given.
func (g *Generation) CompatHash(factors map[string]msgpack.Value) (string, error) {
	for _, name := range g.Factors {
		if _, ok := factors[name]; !ok {
			return "", fmt.Errorf("compat.%s: missing (%s hashes it)", name, g)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(factors)) {
		kind, known := Factors[name]
		if !known {
			return "", fmt.Errorf("compat.%s: not a compatibility hash factor kvhost knows", name)
		}
		if err := checkFactor(factors[name], kind, 0); err != nil {
			return "", fmt.Errorf("compat.%s: %v, want %s", name, err, kind)
		}
	}
	if v, _ := factors["nixl_connector_version"].Int(); v != int64(g.Version) {
		return "", fmt.Errorf("compat.nixl_connector_version: %d, but the codec is %s", v, g)
	}
	var b strings.Builder
	vals := make(map[string]any, len(factors))
	for k, v := range factors {
		vals[k] = v
	}
	writePythonJSON(&b, vals)
	sum := sha256.Sum256([]byte(b.String()))
	return hex.EncodeToString(sum[:]), nil
}

// checkFactor checks v is of kind (at depth: the nesting so far).
func checkFactor(v msgpack.Value, kind FactorKind, depth int) error {
	bad := func() error { return fmt.Errorf("a msgpack %s", v.Kind) }
	switch kind {
	case FactorStr:
		if s, ok := v.Str(); !ok || !utf8.ValidString(s) {
			return bad()
		}
	case FactorInt:
		if _, ok := v.Int(); !ok {
			return bad()
		}
	case FactorBool:
		if v.Kind != msgpack.Bool {
			return bad()
		}
	case FactorDictOrNone:
		if v.Kind == msgpack.Nil {
			return nil
		}
		if v.Kind != msgpack.Map {
			return bad()
		}
		return checkJSONValue(v, depth)
	}
	return nil
}

// checkJSONValue checks v is what json.dumps writes the same way Python
// does here: None, bool, int, str (UTF-8), lists and str-keyed maps of
// them, nested at most maxFactorDepth deep.
func checkJSONValue(v msgpack.Value, depth int) error {
	if depth > maxFactorDepth {
		return fmt.Errorf("nested deeper than %d", maxFactorDepth)
	}
	switch v.Kind {
	case msgpack.Nil, msgpack.Bool:
		return nil
	case msgpack.Int, msgpack.Uint:
		return nil
	case msgpack.Str:
		if s, _ := v.Str(); !utf8.ValidString(s) {
			return fmt.Errorf("a str that is not UTF-8")
		}
		return nil
	case msgpack.Array:
		for _, it := range v.Items {
			if err := checkJSONValue(it, depth+1); err != nil {
				return err
			}
		}
		return nil
	case msgpack.Map:
		for _, p := range v.Pairs {
			if k, ok := p[0].Str(); !ok || !utf8.ValidString(k) {
				return fmt.Errorf("a map key that is a msgpack %s", p[0].Kind)
			}
			if err := checkJSONValue(p[1], depth+1); err != nil {
				return err
			}
		}
		return nil
	}
	return fmt.Errorf("a msgpack %s inside", v.Kind)
}

// writePythonJSON writes v exactly as Python's json.dumps(v,
// sort_keys=True) does with its defaults: ", " and ": " separators, keys
// sorted by code point (at every level), ensure_ascii escaping, True/False
// as true/false, None as null, tuples and lists as arrays. v is a
// map[string]any, string, int, bool or a checked msgpack.Value.
func writePythonJSON(b *strings.Builder, v any) {
	switch x := v.(type) {
	case map[string]any:
		keys := slices.Sorted(maps.Keys(x)) // byte order of UTF-8 is code point order
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteString(", ")
			}
			pythonString(b, k)
			b.WriteString(": ")
			writePythonJSON(b, x[k])
		}
		b.WriteByte('}')
	case string:
		pythonString(b, x)
	case int:
		b.WriteString(strconv.Itoa(x))
	case bool:
		b.WriteString(strconv.FormatBool(x))
	case msgpack.Value:
		switch x.Kind {
		case msgpack.Nil:
			b.WriteString("null")
		case msgpack.Bool:
			t, _ := x.Bool()
			b.WriteString(strconv.FormatBool(t))
		case msgpack.Int:
			n, _ := x.Int()
			b.WriteString(strconv.FormatInt(n, 10))
		case msgpack.Uint:
			n, _ := x.Uint()
			b.WriteString(strconv.FormatUint(n, 10))
		case msgpack.Str:
			s, _ := x.Str()
			pythonString(b, s)
		case msgpack.Array:
			b.WriteByte('[')
			for i, it := range x.Items {
				if i > 0 {
					b.WriteString(", ")
				}
				writePythonJSON(b, it)
			}
			b.WriteByte(']')
		case msgpack.Map:
			m := make(map[string]any, len(x.Pairs))
			for _, p := range x.Pairs { // the last occurrence wins, as in a Python dict
				k, _ := p[0].Str()
				m[k] = p[1]
			}
			writePythonJSON(b, m)
		default:
			panic("vllm: unchecked factor value " + x.Kind.String())
		}
	default:
		panic(fmt.Sprintf("vllm: no JSON for %T", v))
	}
}

// pythonString writes s as json.dumps does with ensure_ascii=True: the
// short escapes for " \ \n \r \t \b \f, and \uXXXX (lower-case hex, UTF-16
// surrogate pairs above the BMP) for everything outside ' '..'~'. Invalid
// UTF-8 cannot occur in a Python str; here it is written as U+FFFD.
func pythonString(b *strings.Builder, s string) {
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		default:
			switch {
			case r >= ' ' && r <= '~':
				b.WriteRune(r)
			case r > 0xFFFF:
				r -= 0x10000
				writeU(b, 0xD800+(r>>10))
				writeU(b, 0xDC00+(r&0x3FF))
			case r == utf8.RuneError:
				writeU(b, 0xFFFD)
			default:
				writeU(b, r)
			}
		}
	}
	b.WriteByte('"')
}

func writeU(b *strings.Builder, r rune) {
	const digits = "0123456789abcdef"
	b.WriteString(`\u`)
	for shift := 12; shift >= 0; shift -= 4 {
		b.WriteByte(digits[(r>>shift)&0xF])
	}
}
