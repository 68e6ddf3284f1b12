package vllm

import (
	"crypto/sha256"
	"encoding/hex"
	"maps"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
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
	factors := map[string]any{
		"vllm_version":           f.VLLMVersion,
		"nixl_connector_version": f.ConnectorVersion,
		"model":                  f.Model,
		"dtype":                  f.DType,
		"num_kv_heads":           f.NumKVHeads,
		"head_size":              f.HeadSize,
		"num_hidden_layers":      f.NumHiddenLayers,
		"attn_backend_name":      f.AttnBackendName,
		"cache_dtype":            f.CacheDType,
	}
	sum := sha256.Sum256([]byte(pythonJSON(factors)))
	return hex.EncodeToString(sum[:])
}

// pythonJSON renders a flat map of strings and ints exactly as Python's
// json.dumps(obj, sort_keys=True) does with its defaults: ", " and ": "
// separators, keys sorted by code point, ensure_ascii escaping.
func pythonJSON(m map[string]any) string {
	keys := slices.Sorted(maps.Keys(m)) // byte order of UTF-8 is code point order
	var b strings.Builder
	b.WriteByte('{')
	for i, k := range keys {
		if i > 0 {
			b.WriteString(", ")
		}
		pythonString(&b, k)
		b.WriteString(": ")
		switch v := m[k].(type) {
		case string:
			pythonString(&b, v)
		case int:
			b.WriteString(strconv.Itoa(v))
		default:
			panic("pythonJSON: unsupported value type") // only called with the factors above
		}
	}
	b.WriteByte('}')
	return b.String()
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
