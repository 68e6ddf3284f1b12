package vllm

import (
	"bytes"
	"fmt"
	"math"
	"unicode"
	"unicode/utf8"
)

// ReadNotif formats the notification a decode worker attaches to its
// READ (or sends alone on a full prefix hit):
// "{remote_request_id}:{tp_ratio}". Prefill frees the request's blocks
// once tp_ratio such notifications arrived (kvhost: from tp_ratio distinct agents).
func ReadNotif(remoteRequestID string, tpRatio int) string {
	return fmt.Sprintf("%s:%d", remoteRequestID, tpRatio)
}

// ParseReadNotif parses a READ notification received by a prefill worker
// exactly as vLLM's kv_connector/v1/nixl_connector.py's _get_new_notifs does:
// notif.decode("utf-8").rsplit(":", 1), then int(tp_ratio). So the bytes
// must be UTF-8, the request id is everything before the last ':' (it may
// itself contain ':', or be empty), and the count is whatever Python's int()
// accepts: surrounding whitespace, a sign, leading zeros, single '_' between
// digits, and any Unicode decimal digit (as Go's Unicode tables know them).
//
// vLLM's kv_connector/v1/nixl_connector.py would count a notification whose count is 0, negative or
// beyond any int and never release on it; here such a count is an error
// too, so the caller reports it instead of holding blocks until they
// expire. Every error wraps ErrMalformed.
func ParseReadNotif(b []byte) (requestID string, tpRatio int, err error) {
	if !utf8.Valid(b) {
		return "", 0, fmt.Errorf("%w: notification %q is not UTF-8", ErrMalformed, truncate(b))
	}
	i := bytes.LastIndexByte(b, ':')
	if i < 0 {
		return "", 0, fmt.Errorf("%w: notification %q has no ':' before the tp_ratio", ErrMalformed, truncate(b))
	}
	n, ok, inRange := pyInt(b[i+1:])
	switch {
	case !ok:
		return "", 0, fmt.Errorf("%w: notification %q: tp_ratio %q is not an integer", ErrMalformed, truncate(b), truncate(b[i+1:]))
	case !inRange || n <= 0:
		return "", 0, fmt.Errorf("%w: notification %q: tp_ratio %q is not a positive int", ErrMalformed, truncate(b), truncate(b[i+1:]))
	}
	return string(b[:i]), n, nil
}

// pyInt parses UTF-8 text as Python's int(str) with base 10 does
// (PyLong_FromUnicodeObject): non-ASCII whitespace counts as a space and
// non-ASCII decimal digits as their ASCII digit, then the ASCII rules of
// PyLong_FromString apply: optional C-locale whitespace, an optional sign,
// digits with single underscores between them, optional whitespace. ok
// reports whether Python accepts the text; inRange whether the value fits
// an int (Python would return a larger integer).
func pyInt(b []byte) (n int, ok, inRange bool) {
	// Positions: leading space, sign, digits, trailing space.
	i := 0
	next := func() (r rune, size int) {
		r, size = utf8.DecodeRune(b[i:])
		switch {
		case r < utf8.RuneSelf:
			if r == ' ' || r == '\t' || r == '\n' || r == '\v' || r == '\f' || r == '\r' {
				return ' ', size
			}
		case unicode.IsSpace(r):
			// Python's non-ASCII whitespace (bidi WS, B, S or Zs) is the
			// same set as Go's non-ASCII unicode.IsSpace.
			return ' ', size
		default:
			if d, isDigit := decimalValue(r); isDigit {
				return '0' + rune(d), size
			}
			return utf8.RuneError, size // no ASCII meaning: invalid
		}
		return r, size
	}
	peek := func() rune {
		if i >= len(b) {
			return -1
		}
		r, _ := next()
		return r
	}
	advance := func() { _, size := next(); i += size }

	for peek() == ' ' {
		advance()
	}
	neg := false
	if r := peek(); r == '+' || r == '-' {
		neg = r == '-'
		advance()
	}
	inRange = true
	digits := 0
	for {
		r := peek()
		if r == '_' && digits > 0 {
			advance()
			if r = peek(); r < '0' || r > '9' {
				return 0, false, false // "__", or '_' not followed by a digit
			}
		}
		if r < '0' || r > '9' {
			break
		}
		advance()
		digits++
		d := int(r - '0')
		if n > (math.MaxInt-d)/10 {
			inRange = false
		} else {
			n = n*10 + d
		}
	}
	if digits == 0 {
		return 0, false, false
	}
	for peek() == ' ' {
		advance()
	}
	if i != len(b) {
		return 0, false, false
	}
	// Python refuses more than 4300 digits (sys.int_info.default_max_str_digits).
	if digits > 4300 {
		return 0, false, false
	}
	if neg {
		n = -n
	}
	return n, true, inRange
}

// decimalValue returns the value of a decimal digit (Unicode category Nd,
// which is Python's Numeric_Type=Decimal). Unicode keeps decimal digits in
// contiguous runs from 0 to 9 and unicode.Nd joins adjacent runs, so the
// value is the distance from the start of the run, modulo 10.
func decimalValue(r rune) (int, bool) {
	if r >= '0' && r <= '9' {
		return int(r - '0'), true
	}
	if r < utf8.RuneSelf || !unicode.Is(unicode.Nd, r) {
		return 0, false
	}
	lo := r
	for unicode.Is(unicode.Nd, lo-1) {
		lo--
	}
	return int(r-lo) % 10, true
}

// MaxHeartbeatIDs bounds the request ids one heartbeat may name; a
// heartbeat naming more is refused whole (a decode splits its ids over
// several, EncodeHeartbeats).
const MaxHeartbeatIDs = 1 << 14

// EncodeHeartbeats formats the heartbeats that renew the leases of ids:
// "HB:" + ",".join(ids), as vLLM's _send_heartbeats does, split into
// several messages where one would pass maxBytes or MaxHeartbeatIDs ids
// (each is a heartbeat of its own to the prefill). An id longer than
// maxBytes gets a message of its own.
func EncodeHeartbeats(ids []string, maxBytes int) [][]byte {
	var out [][]byte
	var cur []byte
	n := 0
	for _, id := range ids {
		if cur != nil && (len(cur)+1+len(id) > maxBytes || n == MaxHeartbeatIDs) {
			out = append(out, cur)
			cur, n = nil, 0
		}
		if cur == nil {
			cur = append([]byte(HeartbeatPrefix), id...)
		} else {
			cur = append(append(cur, ','), id...)
		}
		n++
	}
	if cur != nil {
		out = append(out, cur)
	}
	return out
}

// ParseHeartbeat recognises a heartbeat as vLLM's _get_new_notifs does
// (a UTF-8 notification starting "HB:") and returns the request ids it
// names (payload.split(",")). isHeartbeat is false for anything else;
// err (wrapping ErrMalformed) is set for a heartbeat that is not UTF-8 or
// names more than MaxHeartbeatIDs ids.
func ParseHeartbeat(b []byte) (ids []string, isHeartbeat bool, err error) {
	if !bytes.HasPrefix(b, []byte(HeartbeatPrefix)) {
		return nil, false, nil
	}
	if !utf8.Valid(b) {
		return nil, true, fmt.Errorf("%w: heartbeat %q is not UTF-8", ErrMalformed, truncate(b))
	}
	payload := b[len(HeartbeatPrefix):]
	if n := bytes.Count(payload, []byte{','}) + 1; n > MaxHeartbeatIDs {
		return nil, true, fmt.Errorf("%w: heartbeat names %d requests, at most %d", ErrMalformed, n, MaxHeartbeatIDs)
	}
	for _, id := range bytes.Split(payload, []byte{','}) {
		ids = append(ids, string(id))
	}
	return ids, true, nil
}
