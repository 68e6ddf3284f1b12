package bench

import (
	"slices"
	"testing"
)

// The bandwidth axis must carry numbers whatever range a sweep lands in.
func TestRateTicksLabelled(t *testing.T) {
	labels := func(min, max float64) []string {
		var out []string
		for _, tk := range (rateTicks{}).Ticks(min, max) {
			if tk.Value < min || tk.Value > max {
				t.Errorf("[%g, %g]: tick %g outside the axis", min, max, tk.Value)
			}
			if tk.Label != "" {
				out = append(out, tk.Label)
			}
		}
		return out
	}
	for _, c := range []struct {
		min, max float64
		want     []string
	}{
		{8, 60, []string{"10", "20", "50"}},  // the common case: one decade, no power of ten inside
		{12, 45, []string{"20", "30", "40"}}, // less than a decade: every mark
		{0.3, 40, []string{"0.5", "1", "2", "5", "10", "20"}},
		{0.04, 0.09, []string{"0.04", "0.05", "0.06", "0.07", "0.08", "0.09"}},
	} {
		if got := labels(c.min, c.max); !slices.Equal(got, c.want) {
			t.Errorf("[%g, %g]: labels %q, want %q", c.min, c.max, got, c.want)
		}
	}
	if tks := (rateTicks{}).Ticks(0, 10); tks != nil {
		t.Errorf("min 0 on a log axis: %v", tks)
	}
}
