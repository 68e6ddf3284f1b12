// Package sglang builds and parses SGLang's disaggregation control
// messages byte for byte as SGLang's NIXL and MORI connectors do (SGLang's
// python/sglang/srt/disaggregation/nixl/conn.py and .../mori/conn.py):
// the ZeroMQ multipart messages decode sends to each prefill rank
// (registration, transfer info, ABORT), MORI's status and aux messages
// back to decode, the pack_int_lists encoding, and the NIXL notification
// tag grammar.
//
// Every parser takes the frames of one multipart message, as received,
// and returns a descriptive error wrapping ErrMalformed for anything the
// reference would choke on (wrong guard, too few frames, non-numeric or
// non-ASCII fields, lengths that do not add up). Parsers never panic and
// never keep references to memory other than the frames they were given:
// byte slices in parsed values alias those frames.
//
// Numbers are little-endian: SGLang packs pointers and item lengths with
// struct "Q" (native order) and indices with numpy int32 .tobytes()
// (native order); SGLang runs on little-endian hosts (x86-64, aarch64),
// and so does kvhost.
package sglang

import (
	"errors"
	"fmt"
	"strconv"
	"unicode/utf8"
)

// ErrMalformed marks a message that does not follow SGLang's disaggregation/{nixl,mori}/conn.py layout.
// The runtime logs such a message and drops it.
var ErrMalformed = errors.New("sglang: malformed message")

// ErrUnsupported marks a well-formed message of a kind kvhost does not
// implement (SGLang's staging messages WATERMARK, STAGING_REQ,
// STAGING_RSP).
var ErrUnsupported = errors.New("sglang: unsupported message")

// msgErr formats errors about message kind, frame index and field name.
func msgErr(kind string, idx int, field string, format string, args ...any) error {
	return fmt.Errorf("%w: %s frame %d (%s): %s", ErrMalformed, kind, idx, field, fmt.Sprintf(format, args...))
}

// frameReader reads the positional fields of one message. The first error
// sticks; later reads return zero values, so parsers read straight through
// and check err once.
type frameReader struct {
	kind   string
	frames [][]byte
	base   int // index of frames[0] in the message as sent (1 after the guard)
	err    error
}

// newFrameReader reads a message of at least min frames. base is 1 for
// payloads after a guard frame (frame numbers in errors count the guard),
// 0 for whole messages.
func newFrameReader(kind string, frames [][]byte, base, min int) (*frameReader, error) {
	if len(frames) < min {
		after := ""
		if base > 0 {
			after = " after the guard"
		}
		return nil, fmt.Errorf("%w: %s has %d frames%s, needs at least %d", ErrMalformed, kind, len(frames), after, min)
	}
	return &frameReader{kind: kind, frames: frames, base: base}, nil
}

func (r *frameReader) fail(i int, field, format string, args ...any) {
	if r.err == nil {
		r.err = msgErr(r.kind, i+r.base, field, format, args...)
	}
}

// has reports whether frame i exists.
func (r *frameReader) has(i int) bool { return i < len(r.frames) }

// present reports whether frame i exists and is not empty (SGLang's disaggregation/{nixl,mori}/conn.py's
// "len(msg) > i and msg[i] != b”" test for optional fields).
func (r *frameReader) present(i int) bool { return i < len(r.frames) && len(r.frames[i]) > 0 }

func (r *frameReader) raw(i int) []byte {
	if i >= len(r.frames) {
		r.fail(i, "", "missing")
		return nil
	}
	return r.frames[i]
}

func (r *frameReader) ascii(i int, field string) string {
	b := r.raw(i)
	for _, c := range b {
		if c >= 0x80 {
			r.fail(i, field, "not ASCII: %q", truncate(b))
			return ""
		}
	}
	return string(b)
}

func (r *frameReader) utf8(i int, field string) string {
	b := r.raw(i)
	if !utf8.Valid(b) {
		r.fail(i, field, "not UTF-8: %q", truncate(b))
		return ""
	}
	return string(b)
}

// int parses a decimal integer written by Python's str(int).
func (r *frameReader) int(i int, field string) int64 {
	b := r.raw(i)
	if r.err != nil {
		return 0
	}
	v, err := parseDecimal(b)
	if err != nil {
		r.fail(i, field, "%v", err)
	}
	return v
}

// prefixLen parses decode_prefix_len. SGLang's disaggregation/{nixl,mori}/conn.py would take a negative
// value as a (truthy) prefix hit; no sender writes one (NIXL writes
// str(x or 0), MORI only x > 0), and a negative token count means nothing,
// so it is malformed here.
//
// The frame is optional: set reports whether it is there and not empty
// (Python None otherwise).
func (r *frameReader) prefixLen(i int) (v int64, set bool) {
	if !r.present(i) {
		return 0, false
	}
	v = r.int(i, "decode_prefix_len")
	if r.err == nil && v < 0 {
		r.fail(i, "decode_prefix_len", "negative: %d", v)
		return 0, true
	}
	return v, true
}

func (r *frameReader) uint(i int, field string) uint64 {
	b := r.raw(i)
	if r.err != nil {
		return 0
	}
	v, err := parseUnsigned(b)
	if err != nil {
		r.fail(i, field, "%v", err)
	}
	return v
}

func (r *frameReader) port(i int, field string) int {
	v := r.int(i, field)
	if r.err == nil && (v < 0 || v > 65535) {
		r.fail(i, field, "port %d out of range", v)
		return 0
	}
	return int(v)
}

// smallInt parses a decimal that must fit an int32 (ranks, sizes, ids).
func (r *frameReader) smallInt(i int, field string) int {
	v := r.int(i, field)
	if r.err == nil && (v < -1<<31 || v > 1<<31-1) {
		r.fail(i, field, "%d out of range", v)
		return 0
	}
	return int(v)
}

func (r *frameReader) uint64s(i int, field string) []uint64 {
	b := r.raw(i)
	if r.err != nil {
		return nil
	}
	v, err := decodeUint64s(b)
	if err != nil {
		r.fail(i, field, "%v", err)
	}
	return v
}

func (r *frameReader) int32s(i int, field string) []int32 {
	b := r.raw(i)
	if r.err != nil {
		return nil
	}
	v, err := decodeInt32s(b)
	if err != nil {
		r.fail(i, field, "%v", err)
	}
	return v
}

// parseDecimal accepts an optional '-' and one or more ASCII digits: what
// Python's str(int) writes. (int() would also accept '+', spaces and
// underscores, which no SGLang sender writes.)
func parseDecimal(b []byte) (int64, error) {
	if len(b) == 0 {
		return 0, errors.New("empty number")
	}
	if len(b) > 20 || !isDecimal(b) {
		return 0, fmt.Errorf("not a decimal integer: %q", truncate(b))
	}
	v, err := strconv.ParseInt(string(b), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("integer %q out of range", b)
	}
	return v, nil
}

func parseUnsigned(b []byte) (uint64, error) {
	if len(b) == 0 {
		return 0, errors.New("empty number")
	}
	if len(b) > 20 || !isDecimal(b) || b[0] == '-' {
		return 0, fmt.Errorf("not a non-negative decimal integer: %q", truncate(b))
	}
	v, err := strconv.ParseUint(string(b), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("integer %q out of range", b)
	}
	return v, nil
}

func isDecimal(b []byte) bool {
	if b[0] == '-' {
		b = b[1:]
	}
	if len(b) == 0 {
		return false
	}
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

func itoa(v int64) []byte  { return strconv.AppendInt(nil, v, 10) }
func utoa(v uint64) []byte { return strconv.AppendUint(nil, v, 10) }
func itoaInt(v int) []byte { return itoa(int64(v)) }
func truncate(b []byte) []byte {
	if len(b) > 40 {
		return b[:40]
	}
	return b
}

func checkASCII(s, field string) error {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return fmt.Errorf("sglang: %s %q is not ASCII", field, s)
		}
	}
	return nil
}
