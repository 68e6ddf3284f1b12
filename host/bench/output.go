package bench

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
)

// TableWriter prints rows as a nixlbench-style table, a header before each
// new configuration. Rows may be written as they are measured.
type TableWriter struct {
	w    io.Writer
	last string
}

// NewTableWriter returns a TableWriter printing to w.
func NewTableWriter(w io.Writer) *TableWriter { return &TableWriter{w: w} }

const tableFormat = "%-14s %-10s %-13s %-14s %-14s %-14s %-14s %-14s %-12s %-12s %-12s %-14s %-6s %-8s %s\n"

// Row prints one row (and the header of its configuration if it is new).
func (t *TableWriter) Row(r Row) error {
	if l := r.Group(); l != t.last {
		sweep := ""
		if r.Sweep != "" {
			sweep = ", " + r.Sweep
		}
		if _, err := fmt.Fprintf(t.w, "\n# %s, %s, %s%s, %s%s; baseline %s\n", where(r.Procs), r.Op, r.Path, r.scatterTag(), threads(r.Threads), sweep, r.Baseline); err != nil {
			return err
		}
		if _, err := fmt.Fprintf(t.w, tableFormat, "Block Size (B)", "Batch Size", "B/W (GB/Sec)", "Avg Lat. (us)",
			"Avg Prep (us)", "P99 Prep (us)", "Avg Post (us)", "P99 Post (us)", "Avg Tx (us)", "P99 Tx (us)",
			"CPU/op (us)", "Base (GB/Sec)", "Eff.", "Iters", "Verified"); err != nil {
			return err
		}
		t.last = l
	}
	verified := "yes"
	if !r.Verified {
		verified = "NO"
	}
	_, err := fmt.Fprintf(t.w, tableFormat, strconv.FormatUint(r.Block, 10), strconv.Itoa(r.Batch),
		f3(r.GBps), f1(r.AvgLatUs), f1(r.AvgPrepUs), f1(r.P99PrepUs), f1(r.AvgPostUs), f1(r.P99PostUs),
		f1(r.AvgTxUs), f1(r.P99TxUs), f1(r.CPUUs), f3(r.BaselineGBps), f2(r.Efficiency), strconv.Itoa(r.Iters), verified)
	return err
}

func f1(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }
func f2(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }
func f3(v float64) string { return strconv.FormatFloat(v, 'f', 3, 64) }

// WriteTable prints a whole result as a table, then the skipped rows.
func WriteTable(w io.Writer, res *Result) error {
	t := NewTableWriter(w)
	for _, r := range res.Rows {
		if err := t.Row(r); err != nil {
			return err
		}
	}
	return WriteFooter(w, res)
}

// WriteFooter prints what follows the table: skipped rows and the
// efficiency summary.
func WriteFooter(w io.Writer, res *Result) error {
	for _, s := range res.Skipped {
		if _, err := fmt.Fprintf(w, "# skipped %s\n", s); err != nil {
			return err
		}
	}
	return nil
}

// CSVHeader is the header line of WriteCSV, one column per Row field.
var CSVHeader = []string{"procs", "op", "path", "threads", "block_size", "batch_size", "gb_per_s", "avg_lat_us",
	"avg_prep_us", "p99_prep_us", "avg_post_us", "p99_post_us", "avg_tx_us", "p99_tx_us", "cpu_us_per_op", "iters",
	"baseline", "baseline_gb_per_s", "efficiency", "verified", "plugin_post_us", "plugin_xfer_us", "sweep", "scattered"}

// WriteCSV prints the rows as CSV with CSVHeader.
func WriteCSV(w io.Writer, rows []Row) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(CSVHeader); err != nil {
		return err
	}
	g := func(v float64) string { return strconv.FormatFloat(v, 'g', 6, 64) }
	for _, r := range rows {
		rec := []string{strconv.Itoa(r.Procs), r.Op, string(r.Path), strconv.Itoa(r.Threads),
			strconv.FormatUint(r.Block, 10), strconv.Itoa(r.Batch), g(r.GBps), g(r.AvgLatUs),
			g(r.AvgPrepUs), g(r.P99PrepUs), g(r.AvgPostUs), g(r.P99PostUs), g(r.AvgTxUs), g(r.P99TxUs),
			g(r.CPUUs), strconv.Itoa(r.Iters), r.Baseline, g(r.BaselineGBps), g(r.Efficiency), strconv.FormatBool(r.Verified),
			g(r.PluginPostUs), g(r.PluginXferUs), r.Sweep, strconv.FormatBool(r.Scattered)}
		if err := cw.Write(rec); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// WriteJSON prints the whole result as indented JSON.
func WriteJSON(w io.Writer, res *Result) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(res)
}
