package bench

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// Plot draws bandwidth against block size for every configuration of res
// (one solid line each) with the baselines as dashed lines (one per distinct
// baseline shape: process layout, operation, batch and threads), and saves it
// to file; the extension picks the format (.png or .svg).
func Plot(res *Result, file string) error {
	ext := strings.ToLower(filepath.Ext(file))
	if ext != ".png" && ext != ".svg" {
		return fmt.Errorf("plot: %s: want a .png or .svg file", file)
	}
	if len(res.Rows) == 0 {
		return errors.New("plot: no rows to draw")
	}
	p := plot.New()
	p.Title.Text = fmt.Sprintf("kvhost bench: %s plugin %s (dashed: raw baseline, same run)", res.Plugin, res.PluginVersion)
	p.X.Label.Text = "block size (bytes per descriptor)"
	p.Y.Label.Text = "bandwidth (GB/s)"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = sizeTicks{}
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = rateTicks{}
	p.Add(plotter.NewGrid())
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.TextStyle.Font.Size = vg.Points(8)

	type series struct {
		label string
		color int
		xy    plotter.XYs
	}
	var configs, baselines []*series
	byConfig := map[string]*series{}
	byBase := map[string]*series{}
	minY, maxY := math.Inf(1), 0.0
	for _, r := range res.Rows {
		if r.GBps <= 0 || r.BaselineGBps <= 0 {
			continue // nothing to draw on a log axis
		}
		minY, maxY = min(minY, r.GBps, r.BaselineGBps), max(maxY, r.GBps, r.BaselineGBps)
		l := r.Label()
		s := byConfig[l]
		if s == nil {
			label := fmt.Sprintf("%s %s %s%s, batch %d, %s", where(r.Procs), r.Op, r.Path, r.scatterTag(), r.Batch, threads(r.Threads))
			if r.Sweep != "" {
				label += ", " + r.Sweep
			}
			s = &series{label: label, color: len(configs)}
			byConfig[l] = s
			configs = append(configs, s)
		}
		s.xy = append(s.xy, plotter.XY{X: float64(r.Block), Y: r.GBps})
		// Prepped and batch rows of one shape share a baseline; each
		// measured it, and the line shows the first measurement per block.
		bk := fmt.Sprintf("%s (%s %s, batch %d, %s)", r.Baseline, where(r.Procs), r.Op, r.Batch, threads(r.Threads))
		b := byBase[bk]
		if b == nil {
			b = &series{label: bk, color: s.color}
			byBase[bk] = b
			baselines = append(baselines, b)
		}
		if !slices.ContainsFunc(b.xy, func(p plotter.XY) bool { return p.X == float64(r.Block) }) {
			b.xy = append(b.xy, plotter.XY{X: float64(r.Block), Y: r.BaselineGBps})
		}
	}
	if len(configs) == 0 {
		return errors.New("plot: no row with a positive rate")
	}
	for _, s := range append(configs, baselines...) {
		slices.SortFunc(s.xy, func(a, b plotter.XY) int { return cmp.Compare(a.X, b.X) })
	}
	for _, s := range configs {
		l, pts, err := plotter.NewLinePoints(s.xy)
		if err != nil {
			return fmt.Errorf("plot: %w", err)
		}
		l.Color = plotutil.Color(s.color)
		l.Width = vg.Points(1.5)
		pts.Color = plotutil.Color(s.color)
		pts.Shape = plotutil.Shape(s.color)
		p.Add(l, pts)
		p.Legend.Add(s.label, l, pts)
	}
	for _, b := range baselines {
		l, err := plotter.NewLine(b.xy)
		if err != nil {
			return fmt.Errorf("plot: %w", err)
		}
		l.Color = plotutil.Color(b.color)
		l.Width = vg.Points(1.5)
		l.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
		p.Add(l)
		p.Legend.Add(b.label, l)
	}
	// Headroom above the data for the legend (top left), so it hides no
	// line: on the log axis, the legend's share of the height in decades.
	const height = 5.5 * vg.Inch
	entries := len(configs) + len(baselines)
	share := min(0.8, float64(entries)*float64(p.Legend.TextStyle.Font.Size+2)/float64(height-1.2*vg.Inch))
	lo, hi := math.Log10(minY)-0.1, math.Log10(maxY)+0.1
	p.Y.Min = math.Pow(10, lo)
	p.Y.Max = math.Pow(10, lo+(hi-lo)/(1-share))
	if err := p.Save(9*vg.Inch, height, file); err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	return nil
}

// rateTicks marks 1..9 × 10^k on a log axis and labels 1, 2 and 5 × 10^k
// (every mark when the axis spans less than a factor of 5, where 1-2-5
// could leave one label or none). gonum's LogTicks
// labels only powers of ten, so a sweep between 10 and 100 GB/s, the usual
// case, had a bandwidth axis without a single number.
type rateTicks struct{}

func (rateTicks) Ticks(min, max float64) []plot.Tick {
	if !(min > 0) || !(max > min) {
		return nil
	}
	every := max/min < 5
	var ticks []plot.Tick
	for d := math.Floor(math.Log10(min)); d <= math.Ceil(math.Log10(max)); d++ {
		for m := 1.0; m <= 9; m++ {
			v := m * math.Pow(10, d)
			if v < min || v > max {
				continue
			}
			label := ""
			if every || m == 1 || m == 2 || m == 5 {
				label = strconv.FormatFloat(v, 'g', 3, 64)
			}
			ticks = append(ticks, plot.Tick{Value: v, Label: label})
		}
	}
	return ticks
}

// sizeTicks labels powers of two on a log axis as 4K, 1M, 64M.
type sizeTicks struct{}

func (sizeTicks) Ticks(min, max float64) []plot.Tick {
	var ticks []plot.Tick
	lo := math.Floor(math.Log2(min))
	hi := math.Ceil(math.Log2(max))
	step := 1.0
	if hi-lo > 12 {
		step = 2
	}
	for e := lo; e <= hi; e++ {
		v := math.Exp2(e)
		if v < min || v > max {
			continue
		}
		label := ""
		if math.Mod(e-lo, step) == 0 {
			label = FormatSize(uint64(v))
		}
		ticks = append(ticks, plot.Tick{Value: v, Label: label})
	}
	return ticks
}

func where(procs int) string {
	if procs == 2 {
		return "two-process"
	}
	return "same-process"
}

func threads(n int) string {
	if n == 1 {
		return "1 thread"
	}
	return fmt.Sprintf("%d threads", n)
}
