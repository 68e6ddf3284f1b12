package planjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"sort"
	"strings"

	"github.com/kvhost/kvhost/planner"
)

// This file is the JSON request layer behind `kvhost plan`: an envelope
// that names the style and kind, a registry of handlers (one per
// (style, kind), each living in its owner's file), the KV request shape the
// issue fixes, and strict decoding whose errors name the offending field.

// Styles of plan requests.
const (
	StyleSGLangNIXL = "sglang-nixl"
	StyleSGLangMORI = "sglang-mori"
	StyleVLLM       = "vllm"
)

// Kinds of plan requests.
const (
	KindKV    = "kv"
	KindAux   = "aux"
	KindState = "state"
)

// Envelope is the part of every request that selects a handler.
type Envelope struct {
	Style string `json:"style"`
	Kind  string `json:"kind,omitempty"` // default "kv"
}

// Handler plans one request of its (style, kind). raw is the whole request
// object; the handler decodes it with DecodeStrict into its own type, which
// must declare the envelope fields too. Errors should be *Error naming the
// JSON field (dotted path, e.g. "prefill.kv_item_lens[3]").
type Handler func(raw json.RawMessage) (*planner.Plan, error)

type handlerKey struct{ style, kind string }

// handlers is filled by registerHandler from init functions only and read
// afterwards; it is never modified once main starts.
var handlers = map[handlerKey]Handler{}

// registerHandler adds the handler of (style, kind). Call it from init in
// the file that owns the plan. Registering a pair twice panics: that is a
// programming error caught by any test run.
func registerHandler(style, kind string, h Handler) {
	k := handlerKey{style, kind}
	if _, dup := handlers[k]; dup {
		panic(fmt.Sprintf("planner: handler for style %q kind %q registered twice", style, kind))
	}
	handlers[k] = h
}

// Handled lists the registered (style, kind) pairs as "style/kind", sorted.
func Handled() []string {
	out := make([]string, 0, len(handlers))
	for k := range handlers {
		out = append(out, k.style+"/"+k.kind)
	}
	sort.Strings(out)
	return out
}

// PlanRequest decodes one JSON request, plans it with the handler of its
// style and kind, and validates the plan against its regions. The envelope
// is returned with Kind defaulted to "kv".
func PlanRequest(raw []byte) (*planner.Plan, Envelope, error) {
	var env Envelope
	if err := json.Unmarshal(raw, &env); err != nil {
		return nil, env, jsonError(err)
	}
	if env.Kind == "" {
		env.Kind = KindKV
	}
	switch env.Style {
	case StyleSGLangNIXL, StyleSGLangMORI, StyleVLLM:
	case "":
		return nil, env, errorf("style", "missing (want %q, %q or %q)", StyleSGLangNIXL, StyleSGLangMORI, StyleVLLM)
	default:
		return nil, env, errorf("style", "unknown style %q (want %q, %q or %q)", env.Style, StyleSGLangNIXL, StyleSGLangMORI, StyleVLLM)
	}
	h, ok := handlers[handlerKey{env.Style, env.Kind}]
	if !ok {
		return nil, env, errorf("kind", "style %q has no %q plans (have: %s)", env.Style, env.Kind, strings.Join(Handled(), ", "))
	}
	p, err := h(raw)
	if err != nil {
		return nil, env, err
	}
	if err := p.Validate(); err != nil {
		// A planner bug, never bad input: planners check geometry first.
		return nil, env, fmt.Errorf("internal error: plan %s addresses bytes outside its regions: %w", p.Path, err)
	}
	return p, env, nil
}

// DecodeStrict decodes raw into v, rejecting unknown fields and trailing
// data, and turns decoding errors into one-line *Error values naming the
// field by its JSON path (e.g. "prefill.kv_ptrs" or "decode.bogus").
func DecodeStrict(raw []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		if name, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
			// encoding/json names the key but not where it is.
			name = strings.Trim(name, `"`)
			return errorf(unknownFieldPath(raw, reflect.TypeOf(v), name), "unknown field")
		}
		return jsonError(err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return errorf("", "request: unexpected data after the JSON object")
	}
	return nil
}

// jsonError turns an encoding/json error into a one-line *Error naming the
// field where one is known, in JSON terms: Go types and the names of
// embedded structs do not appear.
func jsonError(err error) error {
	var typeErr *json.UnmarshalTypeError
	var syntaxErr *json.SyntaxError
	switch {
	case errors.As(err, &typeErr):
		field := jsonPath(typeErr.Field)
		if field == "" {
			field = "request"
		}
		return errorf(field, "want %s, got JSON %s", jsonTypeName(typeErr.Type), typeErr.Value)
	case errors.As(err, &syntaxErr):
		if syntaxErr.Error() == "unexpected end of JSON input" {
			return errorf("request", "empty or truncated JSON")
		}
		return errorf("request", "invalid JSON at byte %d: %v", syntaxErr.Offset, syntaxErr)
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return errorf("request", "empty or truncated JSON")
	}
	return errorf("request", "%s", strings.TrimPrefix(err.Error(), "json: "))
}

// jsonPath drops the Go names of embedded structs from an encoding/json
// field path ("prefill.KVSideJSON.num_pages" is "prefill.num_pages"):
// JSON field names are lower case, Go type names are not.
func jsonPath(field string) string {
	parts := strings.Split(field, ".")
	out := parts[:0]
	for _, p := range parts {
		if p != "" && (p[0] < 'A' || p[0] > 'Z') {
			out = append(out, p)
		}
	}
	return strings.Join(out, ".")
}

// jsonTypeName describes a Go type as the JSON a request must hold.
func jsonTypeName(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Struct, reflect.Map:
		return "an object"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "an integer"
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "a non-negative integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	}
	return t.String()
}

// unknownFieldPath returns the JSON path of the first key called name (in
// document order, breadth first) that the Go type t does not declare at
// its place; name itself when none is found.
func unknownFieldPath(raw []byte, t reflect.Type, name string) string {
	var doc any
	if json.Unmarshal(raw, &doc) != nil {
		return name
	}
	type node struct {
		v    any
		t    reflect.Type
		path string
	}
	join := func(path, key string) string {
		if path == "" {
			return key
		}
		return path + "." + key
	}
	queue := []node{{doc, t, ""}}
	for len(queue) > 0 {
		n := queue[0]
		queue = queue[1:]
		t := n.t
		for t.Kind() == reflect.Pointer {
			t = t.Elem()
		}
		switch v := n.v.(type) {
		case map[string]any:
			keys := make([]string, 0, len(v))
			for k := range v {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				switch t.Kind() {
				case reflect.Struct:
					ft, ok := jsonField(t, k)
					if !ok {
						if k == name {
							return join(n.path, k)
						}
						continue
					}
					queue = append(queue, node{v[k], ft, join(n.path, k)})
				case reflect.Map:
					queue = append(queue, node{v[k], t.Elem(), join(n.path, k)})
				}
			}
		case []any:
			if t.Kind() == reflect.Slice || t.Kind() == reflect.Array {
				for i, e := range v {
					queue = append(queue, node{e, t.Elem(), fmt.Sprintf("%s[%d]", n.path, i)})
				}
			}
		}
	}
	return name
}

// jsonField returns the type of the field encoding/json decodes key into
// in struct t: declared fields first, then those of embedded structs
// (shallower wins, as encoding/json resolves them); names match without
// regard to case, as encoding/json matches them.
func jsonField(t reflect.Type, key string) (reflect.Type, bool) {
	var embedded []reflect.Type
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		name, _, _ := strings.Cut(tag, ",")
		if name == "-" && tag == "-" {
			continue
		}
		if f.Anonymous && name == "" {
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				embedded = append(embedded, ft)
				continue
			}
		}
		if !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		if strings.EqualFold(name, key) {
			return f.Type, true
		}
	}
	for _, et := range embedded {
		if ft, ok := jsonField(et, key); ok {
			return ft, true
		}
	}
	return nil, false
}

// KVRequest is the KV plan request of every style (the fixed
// contract). Style-specific extras are marked.
type KVRequest struct {
	Style     string `json:"style"`
	Kind      string `json:"kind,omitempty"`
	Attention string `json:"attention"` // "mha" or "mla"
	// PageSize is tokens per page (SGLang) or per block (vLLM default).
	PageSize int `json:"page_size"`
	// TotalKVHeads defaults to prefill kv_head_num * prefill tp_size.
	TotalKVHeads int        `json:"total_kv_heads,omitempty"`
	Prefill      KVSideJSON `json:"prefill"`
	Decode       KVSideJSON `json:"decode"`
	PrefillPages []int64    `json:"prefill_pages"`
	DecodePages  []int64    `json:"decode_pages"`
	// Prepped (sglang-nixl only) selects the prepped-dlist paths (default
	// true, what SGLang runs) or, false, the non-prepped path
	// (_send_kvcache_generic's group_concurrent_contiguous runs).
	Prepped *bool `json:"prepped,omitempty"`
}

// KVSideJSON is one side of a KV request.
type KVSideJSON struct {
	TPSize     int      `json:"tp_size"`
	TPRank     int      `json:"tp_rank"`
	KVHeadNum  int      `json:"kv_head_num"`
	KVPtrs     []uint64 `json:"kv_ptrs"`
	KVItemLens []uint64 `json:"kv_item_lens"`
	NumPages   uint64   `json:"num_pages"`
	MemKinds   []string `json:"mem_kinds,omitempty"`
	StartLayer int      `json:"start_layer,omitempty"`
	// DraftLayers (decode only) is the number of decode-only draft layers
	// after the main K and V regions; when given, layers pair exactly
	// instead of by SGLang's disaggregation/{nixl,mori}/conn.py's heuristic.
	DraftLayers *int `json:"draft_layers,omitempty"`
	// vLLM only.
	BlockSize   int  `json:"block_size,omitempty"`
	BlocksFirst bool `json:"blocks_first,omitempty"`
}

// Side converts the JSON side into a KVSide; name ("prefill" or "decode")
// prefixes error fields.
func (s *KVSideJSON) Side(name string) (planner.KVSide, error) {
	out := planner.KVSide{
		TPSize:     s.TPSize,
		TPRank:     s.TPRank,
		KVHeadNum:  s.KVHeadNum,
		Ptrs:       s.KVPtrs,
		ItemLens:   s.KVItemLens,
		NumPages:   s.NumPages,
		StartLayer: s.StartLayer,
	}
	if s.DraftLayers != nil {
		if name != "decode" {
			return out, errorf(name+".draft_layers", "only the decode side has draft layers")
		}
		if *s.DraftLayers < 0 {
			return out, errorf(name+".draft_layers", "must not be negative, got %d", *s.DraftLayers)
		}
		out.DraftLayers, out.DraftLayersKnown = *s.DraftLayers, true
	}
	if s.MemKinds != nil {
		out.Kinds = make([]planner.MemKind, len(s.MemKinds))
		for i, k := range s.MemKinds {
			mk, err := planner.ParseMemKind(k)
			if err != nil {
				return out, errorf(fmt.Sprintf("%s.mem_kinds[%d]", name, i), "unsupported NIXL KV memory kind %q (want VRAM or DRAM)", k)
			}
			out.Kinds[i] = mk
		}
	}
	if err := out.Check(name); err != nil {
		return out, err
	}
	return out, nil
}

// MLA reports whether the request is for MLA attention ("mha" or "mla";
// anything else is an error naming "attention").
func (r *KVRequest) MLA() (bool, error) {
	switch r.Attention {
	case "mha":
		return false, nil
	case "mla":
		return true, nil
	case "":
		return false, errorf("attention", `missing (want "mha" or "mla")`)
	}
	return false, errorf("attention", `unknown attention %q (want "mha" or "mla")`, r.Attention)
}

// Pages converts a JSON page list into int32 indices (SGLang's disaggregation/{nixl,mori}/conn.py's and
// the ABI's index type).
func Pages(field string, in []int64) ([]int32, error) {
	out := make([]int32, len(in))
	for i, p := range in {
		if p < 0 || p > 1<<31-1 {
			return nil, errorf(fmt.Sprintf("%s[%d]", field, i), "page %d outside [0, 2^31)", p)
		}
		out[i] = int32(p)
	}
	return out, nil
}
