package serve

import (
	"errors"
	"fmt"
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
