package bench

import (
	"bytes"
	"encoding/csv"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/plugin"
)

func TestParseSweep(t *testing.T) {
	// The CLI splits repeatable flags on commas: a piece without "=" goes
	// on with the previous list.
	got, err := ParseSweep([]string{"num_threads=0", "2", "4", "num_workers=1,2"})
	want := []ParamSweep{{"num_threads", []string{"0", "2", "4"}}, {"num_workers", []string{"1", "2"}}}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Errorf("ParseSweep = %v, %v; want %v", got, err, want)
	}
	for _, bad := range [][]string{{"num_threads"}, {"=1"}, {"num_threads="}, {"num_threads=,"}} {
		if got, err := ParseSweep(bad); err == nil {
			t.Errorf("ParseSweep(%q) = %v, want an error", bad, got)
		}
	}
	if got := variants(want); len(got) != 6 || !reflect.DeepEqual(got[1], []plugin.Param{{Key: "num_threads", Value: "0"}, {Key: "num_workers", Value: "2"}}) {
		t.Errorf("variants = %v", got)
	}
	if got := variants(nil); len(got) != 1 || got[0] != nil {
		t.Errorf("variants(nil) = %v, want one empty variant", got)
	}
}

func TestValidateSweep(t *testing.T) {
	var many []string
	for i := range maxVariants + 1 {
		many = append(many, strconv.Itoa(i))
	}
	for name, sw := range map[string][]ParamSweep{
		"no key":        {{"", []string{"1"}}},
		"no value":      {{"num_threads", nil}},
		"key twice":     {{"k", []string{"1"}}, {"k", []string{"2"}}},
		"too many rows": {{"k", many}},
	} {
		c := Defaults()
		c.Sweep = sw
		if err := c.Validate(); err == nil {
			t.Errorf("%s: Validate accepted %v", name, sw)
		}
	}
}

// A sweep runs every row once per combination, each on an initiator agent
// of its own with the swept values; keys not swept keep the host's
// initiator default (num_threads, which the fake plugin documents); the
// target gets the target defaults (none). Table, CSV and plot tell the
// combinations apart.
func TestSweepRuns(t *testing.T) {
	c := quick(t)
	c.Procs = []int{1, 2}
	c.Sweep = []ParamSweep{{"workers", []string{"1", "2"}}}
	res := run(t, c)
	rowsPer := len(c.Blocks) * len(c.Procs)
	if len(res.Rows) != 2*rowsPer {
		t.Fatalf("%d rows, want %d", len(res.Rows), 2*rowsPer)
	}
	def := plugin.ThreadsParam + "=" + strconv.Itoa(plugin.InitiatorThreads)
	for i, r := range res.Rows {
		w := "workers=" + strconv.Itoa(1+i/rowsPer)
		if r.Sweep != w || !reflect.DeepEqual(r.InitiatorParams, []string{w, def}) || !r.Verified {
			t.Errorf("row %d (%s): sweep %q, initiator params %v, verified %v; want %q, [%s %s]", i, r.Label(), r.Sweep, r.InitiatorParams, r.Verified, w, w, def)
		}
		if !strings.HasSuffix(r.Label(), " "+w) || !strings.HasSuffix(r.Group(), " "+w) {
			t.Errorf("row %d: label %q, group %q lack %q", i, r.Label(), r.Group(), w)
		}
	}
	// The fake documents prefault: a target in another process gets the
	// host's prefault=false, one in this process keeps the pass.
	if want := []string{plugin.PrefaultParam + "=false"}; !reflect.DeepEqual(res.TargetParams, want) {
		t.Errorf("target params %v, want %v", res.TargetParams, want)
	}
	if want := []string{plugin.PrefaultParam + "=true"}; !reflect.DeepEqual(res.LocalTargetParams, want) {
		t.Errorf("local target params %v, want %v", res.LocalTargetParams, want)
	}
	var tab bytes.Buffer
	if err := WriteTable(&tab, res); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"# same-process, WRITE, prepped, 1 thread, workers=1; baseline memcpy", "# same-process, WRITE, prepped, 1 thread, workers=2; baseline memcpy"} {
		if !strings.Contains(tab.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, tab.String())
		}
	}
	var cb bytes.Buffer
	if err := WriteCSV(&cb, res.Rows); err != nil {
		t.Fatal(err)
	}
	recs, err := csv.NewReader(&cb).ReadAll()
	col := slices.Index(CSVHeader, "sweep")
	if err != nil || col < 0 || recs[1][col] != "workers=1" || recs[len(recs)-1][col] != "workers=2" {
		t.Errorf("csv sweep column %d: %v, %v", col, recs, err)
	}
	f := filepath.Join(t.TempDir(), "sweep.svg")
	if err := Plot(res, f); err != nil {
		t.Fatal(err)
	}
	svg, err := os.ReadFile(f)
	if err != nil || !bytes.Contains(svg, []byte("workers=1")) || !bytes.Contains(svg, []byte("workers=2")) {
		t.Errorf("plot legend lacks the sweep: %v", err)
	}

	// Sweeping the default's own key replaces it; a value the fake
	// refuses fails the run.
	c.Procs = []int{1}
	c.Sweep = []ParamSweep{{plugin.ThreadsParam, []string{"0", "8"}}}
	res = run(t, c)
	if got := res.Rows[len(res.Rows)-1].InitiatorParams; !reflect.DeepEqual(got, []string{plugin.ThreadsParam + "=8"}) {
		t.Errorf("initiator params %v, want [num_threads=8]", got)
	}
	c.Sweep = []ParamSweep{{plugin.ThreadsParam, []string{"65"}}}
	if _, err := (&Runner{Config: c}).Run(t.Context()); err == nil || !strings.Contains(err.Error(), "num_threads") {
		t.Errorf("num_threads=65: %v", err)
	}
}
