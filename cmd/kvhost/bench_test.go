package main

import (
	"encoding/csv"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/bench"
)

// quickBench are flags for a sweep that takes milliseconds.
var quickBench = []string{"--blocks", "4K,16K", "--rounds", "1", "--iters", "2", "--warmup", "1", "--time", "1ms"}

func TestBenchCommand(t *testing.T) {
	out, err := runKvhost(t, "", append([]string{"bench"}, quickBench...)...)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{"# same-process, WRITE, prepped, 1 thread; baseline memcpy", "B/W (GB/Sec)", "Eff.", "16384 "} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}

	out, err = runKvhost(t, "", append([]string{"bench", "--csv", "--ops", "READ,WRITE", "--paths", "batch", "--batches", "2"}, quickBench...)...)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	recs, err := csv.NewReader(strings.NewReader(out)).ReadAll()
	if err != nil || len(recs) != 5 || recs[1][1] != "READ" || recs[1][2] != "batch" || recs[1][5] != "2" {
		t.Fatalf("csv %v, %v", recs, err)
	}

	plot := filepath.Join(t.TempDir(), "bw.svg")
	out, err = runKvhost(t, "", append([]string{"bench", "--json", "--threads", "2", "--plot", plot}, quickBench...)...)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	var res bench.Result
	if err := json.Unmarshal([]byte(out), &res); err != nil || len(res.Rows) != 2 || res.Rows[0].Threads != 2 || !res.Rows[0].Verified {
		t.Fatalf("json %v: %s", err, out)
	}
	if st, err := os.Stat(plot); err != nil || st.Size() == 0 {
		t.Errorf("plot: %v", err)
	}
}

func TestBenchCommandErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"bench", "--json", "--csv"}, "exclude"},
		{[]string{"bench", "--blocks", "4X"}, "--blocks"},
		{[]string{"bench", "--ops", "COPY"}, "--ops"},
		{[]string{"bench", "--paths", "fast"}, "--paths"},
		{[]string{"bench", "--procs", "3"}, "procs"},
		{[]string{"bench", "--param", "novalue"}, "--param"},
		{[]string{"bench", "--max-buffer", "1K"}, "max-buffer"},
		{[]string{"bench", "--serve-target"}, "not by hand"},
		{[]string{"bench", "extra"}, "unexpected argument"},
		{[]string{"--backend", "nosuchplugin", "bench"}, "nosuchplugin"},
	} {
		out, err := runKvhost(t, "", c.args...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: err %v (want %q)\n%s", c.args, err, c.want, out)
		}
	}
}
