package plugin

import (
	"errors"
	"fmt"

	"github.com/kvhost/kvhost/abi"
)

// Error is a failed plugin operation: either a kvp_error the plugin
// returned, or a check the host made on the plugin's behalf (for example
// while emulating prepped lists). Both carry the same codes, so callers and
// the conformance suite see one behaviour whichever side did the work.
//
// errors.Is(err, ErrNotFound) (and the other code sentinels) matches an
// *Error with that code.
type Error struct {
	Plugin  string     // plugin name, e.g. "fake"
	Op      string     // ABI function or host operation, e.g. "prep_dlist"
	Code    abi.Status // a negative abi status
	Message string     // the plugin's (or host's) text
	Host    bool       // true when the host, not the plugin, raised it
}

func (e *Error) Error() string {
	who := "plugin " + e.Plugin
	if e.Host {
		who = "host (plugin " + e.Plugin + ")"
	}
	if e.Message == "" {
		return fmt.Sprintf("%s: %s: %s", who, e.Op, e.Code)
	}
	return fmt.Sprintf("%s: %s: %s: %s", who, e.Op, e.Code, e.Message)
}

// Unwrap returns the code sentinel, so errors.Is(err, ErrNotFound) works.
func (e *Error) Unwrap() error { return codeError(e.Code) }

// codeError is the type of the code sentinels: a status as an error value.
type codeError abi.Status

func (c codeError) Error() string { return abi.Status(c).String() }

// Sentinels for errors.Is, one per ABI error status.
var (
	ErrNotPosted        error = codeError(abi.ErrNotPosted)
	ErrInvalidParam     error = codeError(abi.ErrInvalidParam)
	ErrBackend          error = codeError(abi.ErrBackend)
	ErrNotFound         error = codeError(abi.ErrNotFound)
	ErrMismatch         error = codeError(abi.ErrMismatch)
	ErrNotAllowed       error = codeError(abi.ErrNotAllowed)
	ErrRepostActive     error = codeError(abi.ErrRepostActive)
	ErrUnknown          error = codeError(abi.ErrUnknown)
	ErrNotSupported     error = codeError(abi.ErrNotSupported)
	ErrRemoteDisconnect error = codeError(abi.ErrRemoteDisconnect)
	ErrCanceled         error = codeError(abi.ErrCanceled)
	ErrNoTelemetry      error = codeError(abi.ErrNoTelemetry)
)

// ErrClosed is returned (wrapped) by any use of a handle after its Close, or
// after the Agent or Plugin that owns it was closed. The plugin is never
// called with such a handle.
var ErrClosed = errors.New("handle is closed")

// Reasons a file is not loaded as a plugin (see LoadError).
var (
	ErrNotPlugin   = errors.New("not a loadable shared library")
	ErrNoEntry     = errors.New("no " + abi.EntrySymbol + " symbol")
	ErrABIMismatch = errors.New("ABI major version mismatch")
	ErrBadTable    = errors.New("invalid function table")
)

// LoadError says why the file at Path could not be used as a plugin. Kind is
// one of ErrNotPlugin, ErrNoEntry, ErrABIMismatch, ErrBadTable (match with
// errors.Is); Detail is the human reason.
type LoadError struct {
	Path   string
	Kind   error
	Detail string
}

func (e *LoadError) Error() string { return e.Path + ": " + e.Detail }
func (e *LoadError) Unwrap() error { return e.Kind }

// hostError builds an *Error raised by the host in the name of plugin op.
func hostError(pluginName, op string, code abi.Status, format string, args ...any) *Error {
	return &Error{Plugin: pluginName, Op: op, Code: code, Message: fmt.Sprintf(format, args...), Host: true}
}

// closedError reports use of a closed handle.
func closedError(what string) error { return fmt.Errorf("%s: %w", what, ErrClosed) }
