package memkind

import (
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/planner"
)

// The ABI's and the planner's kinds are numbered and named alike, and the
// conversions are each other's inverse.
func TestKindsAgree(t *testing.T) {
	pairs := []struct {
		a abi.MemKind
		p planner.MemKind
	}{{abi.DRAM, planner.DRAM}, {abi.VRAM, planner.VRAM}}
	for _, c := range pairs {
		if uint32(c.a) != uint32(c.p) || c.a.String() != c.p.String() {
			t.Errorf("abi %d %q vs planner %d %q", c.a, c.a, c.p, c.p)
		}
		if ToPlanner(c.a) != c.p || ToABI(c.p) != c.a {
			t.Errorf("conversions of %s disagree", c.a)
		}
		if k, err := planner.ParseMemKind(c.a.String()); err != nil || k != c.p {
			t.Errorf("planner parses abi's name %q as %v, %v", c.a, k, err)
		}
	}
}
