package bench

import (
	"errors"
	"fmt"
	"math"
	"path/filepath"
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
	p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Add(plotter.NewGrid())
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.TextStyle.Font.Size = vg.Points(8)

	type series struct {
		label string
		xy    plotter.XYs
	}
	var configs, baselines []*series
	byConfig := map[string]*series{}
	byBase := map[string]*series{}
	baseColor := map[string]int{}
	for _, r := range res.Rows {
		if r.GBps <= 0 || r.BaselineGBps <= 0 {
			continue // nothing to draw on a log axis
		}
		l := r.Label()
		s := byConfig[l]
		if s == nil {
			s = &series{label: l}
			byConfig[l] = s
			configs = append(configs, s)
		}
		s.xy = append(s.xy, plotter.XY{X: float64(r.Block), Y: r.GBps})
		bk := fmt.Sprintf("%dp %s x%d t%d %s", r.Procs, r.Op, r.Batch, r.Threads, r.Baseline)
		b := byBase[bk]
		if b == nil {
			b = &series{label: "baseline " + bk}
			byBase[bk] = b
			baselines = append(baselines, b)
			baseColor[bk] = len(configs) - 1
		}
		// Prepped and batch rows of one shape share a baseline; each
		// measured it, so the line shows the first measurement per block.
		if n := len(b.xy); n == 0 || b.xy[n-1].X != float64(r.Block) {
			b.xy = append(b.xy, plotter.XY{X: float64(r.Block), Y: r.BaselineGBps})
		}
	}
	if len(configs) == 0 {
		return errors.New("plot: no row with a positive rate")
	}
	for i, s := range configs {
		l, pts, err := plotter.NewLinePoints(s.xy)
		if err != nil {
			return fmt.Errorf("plot: %w", err)
		}
		l.Color = plotutil.Color(i)
		l.Width = vg.Points(1.5)
		pts.Color = plotutil.Color(i)
		pts.Shape = plotutil.Shape(i)
		p.Add(l, pts)
		p.Legend.Add(s.label, l, pts)
	}
	for _, b := range baselines {
		l, err := plotter.NewLine(b.xy)
		if err != nil {
			return fmt.Errorf("plot: %w", err)
		}
		ci := baseColor[strings.TrimPrefix(b.label, "baseline ")]
		l.Color = plotutil.Color(ci)
		l.Width = vg.Points(1.5)
		l.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
		p.Add(l)
		p.Legend.Add(b.label, l)
	}
	if err := p.Save(9*vg.Inch, 5.5*vg.Inch, file); err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	return nil
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
