package planjson

import (
	"fmt"

	"github.com/kvhost/kvhost/planner"
)

// errorf builds a *planner.Error for field (a dotted JSON path).
func errorf(field, format string, args ...any) error {
	return &planner.Error{Field: field, Msg: fmt.Sprintf(format, args...)}
}
