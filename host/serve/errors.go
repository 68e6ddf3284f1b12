package serve

import (
	"errors"
	"fmt"
	"unicode/utf8"
)

// Error codes of docs/engine-api.md ("Error codes").
const (
	CodeBadRequest   = "bad_request"
	CodeUnknownOp    = "unknown_op"
	CodeVersion      = "version"
	CodeNoHello      = "no_hello"
	CodeOutOfOrder   = "out_of_order"
	CodeTooLarge     = "too_large"
	CodeBadRegion    = "bad_region"
	CodeGeometry     = "geometry"
	CodeUnknown      = "unknown"
	CodeExists       = "exists"
	CodeBusy         = "busy"
	CodeUnsupported  = "unsupported"
	CodeLimit        = "limit"
	CodeBackend      = "backend"
	CodeShuttingDown = "shutting_down"
	CodeInternal     = "internal"
)

// Error is an error reply: one of the API's codes and a message for a
// person.
type Error struct {
	Code    string
	Message string
}

func (e *Error) Error() string { return e.Code + ": " + e.Message }

// errorf builds an *Error.
func errorf(code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// asError turns any handler error into the reply's code and message: an
// *Error as it is, anything else with fallback as its code.
func asError(err error, fallback string) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return &Error{Code: fallback, Message: err.Error()}
}

// Bounds on what a reply or event quotes, so that none grows with the
// request (or a peer's message) it answers.
const (
	maxQuote   = 64   // bytes of an engine's string quoted in a message (an op)
	maxReason  = 512  // bytes of a room's failure reason (peers send some)
	maxMessage = 1024 // bytes of an error reply's message
)

// clip returns s cut to at most n bytes (on a UTF-8 boundary), marked
// with "..." when cut.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n - 3
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}
