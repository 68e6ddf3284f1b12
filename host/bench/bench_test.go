package bench

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

// The test binary doubles as the target process of two-process runs.
func TestMain(m *testing.M) {
	if os.Getenv(TargetEnv) == "1" {
		if err := ServeTargetStdio(); err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func selfTarget() (*exec.Cmd, error) { return exec.Command(os.Args[0], "-test.run=^$"), nil }

// fakeDirs finds the fake plugin (built by make) or skips.
func fakeDirs(t *testing.T) []string {
	t.Helper()
	dirs := plugin.SearchDirs("")
	if _, err := plugin.Find("fake", dirs); err != nil {
		t.Fatalf("fake plugin not built (run make plugin-fake): %v", err)
	}
	return dirs
}

// quick is a sweep small enough for a loaded 2-core machine.
func quick(t *testing.T) Config {
	c := Defaults()
	c.Dirs = fakeDirs(t)
	c.Blocks = []uint64{4 << 10, 64 << 10}
	c.Warmup, c.Iters, c.Rounds, c.Time = 1, 2, 2, 2*time.Millisecond
	c.TargetCommand = selfTarget
	return c
}

func TestParseSizes(t *testing.T) {
	for in, want := range map[string][]uint64{
		"4096":         {4096},
		"4K,1M":        {4 << 10, 1 << 20},
		"4KiB..32KiB":  {4 << 10, 8 << 10, 16 << 10, 32 << 10},
		"1M..1M":       {1 << 20},
		"3K..16K":      {3 << 10, 6 << 10, 12 << 10},
		" 2g , 512b ":  {2 << 30, 512},
		"4K..64M":      DefaultBlocks(),
		"1000..1000,7": {1000, 7},
	} {
		got, err := ParseSizes(in)
		if err != nil || !equal(got, want) {
			t.Errorf("ParseSizes(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "0", "-1", "4X", "K", "64M..4K", "4K..", "99999999999999G"} {
		if got, err := ParseSizes(bad); err == nil {
			t.Errorf("ParseSizes(%q) = %v, want an error", bad, got)
		}
	}
	if n := len(DefaultBlocks()); n != 15 || DefaultBlocks()[0] != 4096 || DefaultBlocks()[n-1] != 64<<20 {
		t.Errorf("DefaultBlocks = %v", DefaultBlocks())
	}
}

func equal(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestParseLists(t *testing.T) {
	ops, err := ParseOps("write, READ")
	if err != nil || len(ops) != 2 || ops[0] != abi.Write || ops[1] != abi.Read {
		t.Errorf("ParseOps = %v, %v", ops, err)
	}
	if _, err := ParseOps("WRITE,COPY"); err == nil {
		t.Error("ParseOps accepted COPY")
	}
	paths, err := ParsePaths("Batch,prepped")
	if err != nil || len(paths) != 2 || paths[0] != Batch || paths[1] != Prepped {
		t.Errorf("ParsePaths = %v, %v", paths, err)
	}
	if _, err := ParsePaths("fast"); err == nil {
		t.Error("ParsePaths accepted fast")
	}
	if n, err := ParseInts("1,16,128"); err != nil || len(n) != 3 || n[2] != 128 {
		t.Errorf("ParseInts = %v, %v", n, err)
	}
	for _, bad := range []string{"", "0", "1,x", "-3"} {
		if _, err := ParseInts(bad); err == nil {
			t.Errorf("ParseInts(%q) accepted", bad)
		}
	}
	for n, want := range map[uint64]string{4096: "4K", 1 << 20: "1M", 3 << 30: "3G", 1536: "1536", 1000: "1000"} {
		if got := FormatSize(n); got != want {
			t.Errorf("FormatSize(%d) = %q, want %q", n, got, want)
		}
	}
}

func TestValidate(t *testing.T) {
	for name, mut := range map[string]func(*Config){
		"no plugin":       func(c *Config) { c.Plugin = "" },
		"procs 3":         func(c *Config) { c.Procs = []int{3} },
		"procs 2 no cmd":  func(c *Config) { c.Procs = []int{2}; c.TargetCommand = nil },
		"rounds 0":        func(c *Config) { c.Rounds = 0 },
		"iters 0":         func(c *Config) { c.Iters = 0 },
		"batch 0":         func(c *Config) { c.Batches = []int{0} },
		"threads 0":       func(c *Config) { c.Threads = []int{0} },
		"nothing fits":    func(c *Config) { c.MaxBuffer = 1024 },
		"empty sweep":     func(c *Config) { c.Ops = nil },
		"unknown path":    func(c *Config) { c.Paths = []Path{"x"} },
		"negative warmup": func(c *Config) { c.Warmup = -1 },
	} {
		c := Defaults()
		c.TargetCommand = selfTarget
		mut(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%s: Validate accepted", name)
		}
	}
	c := Defaults()
	if err := c.Validate(); err != nil {
		t.Errorf("defaults: %v", err)
	}
}

func TestPattern(t *testing.T) {
	b, err := mapBuffer(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer b.free()
	for _, n := range []uint64{1, 7, 8, 9, 1000, 4096} {
		fill(b, n, 42)
		if bad := verify(b, n, 42); bad != -1 {
			t.Fatalf("n=%d: fresh pattern fails at %d", n, bad)
		}
		if bad := verify(b, n, 43); bad < 0 || bad >= 8 {
			t.Fatalf("n=%d: another seed's pattern passes up to %d", n, bad)
		}
		b[n-1] ^= 1
		if bad := verify(b, n, 42); bad != int64(n-1) {
			t.Fatalf("n=%d: flipped last byte found at %d", n, bad)
		}
	}
	clear0(b, 4096)
	if bad := verify(b, 4096, 1); bad < 0 || bad >= 8 {
		t.Fatalf("zeros pass up to %d", bad)
	}
}

func run(t *testing.T, c Config) *Result {
	t.Helper()
	var seen []Row
	r := &Runner{Config: c, OnRow: func(row Row) { seen = append(seen, row) }}
	res, err := r.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(seen) != len(res.Rows) {
		t.Errorf("OnRow saw %d rows, result has %d", len(seen), len(res.Rows))
	}
	return res
}

func checkRows(t *testing.T, res *Result, want int) {
	t.Helper()
	if len(res.Rows) != want {
		t.Fatalf("%d rows, want %d", len(res.Rows), want)
	}
	for _, r := range res.Rows {
		switch {
		case !r.Verified:
			t.Errorf("%s %d: not verified", r.Label(), r.Block)
		case r.GBps <= 0 || r.BaselineGBps <= 0 || r.Efficiency <= 0:
			t.Errorf("%s %d: rates %v / %v, efficiency %v", r.Label(), r.Block, r.GBps, r.BaselineGBps, r.Efficiency)
		case r.Iters < r.Threads*2 || len(r.Rounds) != res.Rounds:
			t.Errorf("%s %d: %d iterations in %d rounds", r.Label(), r.Block, r.Iters, len(r.Rounds))
		case r.AvgLatUs < r.AvgTxUs || r.AvgTxUs < r.AvgPostUs || r.AvgPrepUs <= 0 || r.CPUUs <= 0:
			t.Errorf("%s %d: inconsistent times %+v", r.Label(), r.Block, r)
		}
		wantBase := BaselineMemcpy
		if r.Procs == 2 {
			wantBase = map[string]string{"WRITE": BaselineWritev, "READ": BaselineReadv}[r.Op]
		}
		if r.Baseline != wantBase {
			t.Errorf("%s: baseline %q, want %q", r.Label(), r.Baseline, wantBase)
		}
	}
}

func TestSameProcessSweep(t *testing.T) {
	c := quick(t)
	c.Ops = []abi.Op{abi.Write, abi.Read}
	c.Paths = []Path{Prepped, Batch}
	c.Batches = []int{1, 3}
	c.Threads = []int{1, 2}
	c.Telemetry = true
	var progress []int
	c.Progress = func(done, total int, label string) {
		progress = append(progress, done)
		if total != 2*2*2*2*2*c.Rounds || label == "" {
			t.Errorf("progress %d/%d %q", done, total, label)
		}
	}
	res := run(t, c)
	checkRows(t, res, 2*2*2*2*2)
	if len(progress) != 32*c.Rounds || progress[len(progress)-1] != 32*c.Rounds {
		t.Errorf("progress calls %v", progress)
	}
	for _, r := range res.Rows {
		if r.PluginXferUs <= 0 {
			t.Errorf("%s: no telemetry with Telemetry on", r.Label())
		}
		if _, ok := r.Rounds[0].Baseline["go-copy"]; !ok {
			t.Errorf("%s: rounds lack the go-copy baseline: %v", r.Label(), r.Rounds[0].Baseline)
		}
	}
	if res.Plugin != "fake" || len(res.Caps) == 0 {
		t.Errorf("result header %+v", res)
	}
}

func TestTwoProcessSweep(t *testing.T) {
	c := quick(t)
	c.Procs = []int{2}
	c.Ops = []abi.Op{abi.Write, abi.Read}
	c.Paths = []Path{Prepped, Batch}
	c.Batches = []int{2}
	res := run(t, c)
	checkRows(t, res, 2*2*2)
}

// Emulated paths (the host builds what the agent lacks) measure the same.
func TestEmulatedPaths(t *testing.T) {
	for _, off := range []string{"prepped", "batch"} {
		c := quick(t)
		c.Params = []plugin.Param{{Key: "caps_off", Value: off}}
		c.Paths = []Path{Prepped, Batch}
		c.Blocks = []uint64{4 << 10}
		res := run(t, c)
		checkRows(t, res, 2)
		if len(res.Emulated) == 0 {
			t.Errorf("caps_off=%s: nothing emulated", off)
		}
	}
}

func TestSkippedRows(t *testing.T) {
	c := quick(t)
	c.Blocks = []uint64{4 << 10, 1 << 20}
	c.MaxBuffer = 64 << 10
	res := run(t, c)
	checkRows(t, res, 1)
	if len(res.Skipped) != 1 || !strings.Contains(res.Skipped[0], "1M") {
		t.Errorf("skipped %q", res.Skipped)
	}
}

func TestFailedTransfersFailTheRun(t *testing.T) {
	c := quick(t)
	c.Params = []plugin.Param{{Key: "fail_rate", Value: "1"}}
	_, err := (&Runner{Config: c}).Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "injected failure") {
		t.Fatalf("err = %v, want the plugin's injected failure", err)
	}
}

func TestCancel(t *testing.T) {
	c := quick(t)
	c.Time = time.Hour // only cancelling ends this row
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	res, err := (&Runner{Config: c}).Run(ctx)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want context.DeadlineExceeded", err)
	}
	if res == nil || res.Err == "" {
		t.Errorf("result %+v should carry the error", res)
	}
}

func TestTargetProcessFailures(t *testing.T) {
	c := quick(t)
	c.Procs = []int{2}
	c.TargetCommand = func() (*exec.Cmd, error) { return exec.Command("/bin/sh", "-c", "echo target broke >&2; exit 3"), nil }
	_, err := (&Runner{Config: c}).Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "target broke") {
		t.Fatalf("err = %v, want the target's stderr", err)
	}
	c.TargetCommand = func() (*exec.Cmd, error) { return nil, errors.New("no binary") }
	if _, err := (&Runner{Config: c}).Run(context.Background()); err == nil || !strings.Contains(err.Error(), "no binary") {
		t.Fatalf("err = %v", err)
	}
	c.TargetCommand = selfTarget
	c.Plugin = "nosuchplugin"
	if _, err := (&Runner{Config: c}).Run(context.Background()); err == nil {
		t.Fatal("unknown plugin accepted")
	}
}

// The target process checks its memory itself: a wrong seed is caught,
// and so is a span beyond its buffer.
func TestProcTargetVerifies(t *testing.T) {
	c := quick(t)
	tg, err := startProcTarget(&c, c.Params, 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := tg.close(); err != nil {
			t.Errorf("close: %v", err)
		}
	}()
	m := tg.meta()
	if m.Size != 4096 || m.Pid == os.Getpid() || m.Pid <= 0 || len(m.Metadata) == 0 || tg.local() != nil {
		t.Errorf("target meta %+v", m)
	}
	if err := tg.fill(100, 5); err != nil {
		t.Fatal(err)
	}
	if bad, err := tg.verify(100, 5); err != nil || bad != -1 {
		t.Errorf("verify of the pattern: %d, %v", bad, err)
	}
	if bad, err := tg.verify(100, 6); err != nil || bad < 0 || bad >= 8 {
		t.Errorf("verify with another seed: %d, %v", bad, err)
	}
	if err := tg.clear(4096); err != nil {
		t.Fatal(err)
	}
	if bad, err := tg.verify(100, 5); err != nil || bad < 0 || bad >= 8 {
		t.Errorf("verify after clear: %d, %v", bad, err)
	}
	if _, err := tg.verify(8192, 5); err == nil {
		t.Error("verify beyond the buffer succeeded")
	}
}

func TestOutputs(t *testing.T) {
	c := quick(t)
	c.Batches = []int{1, 2}
	res := run(t, c)
	var tab bytes.Buffer
	if err := WriteTable(&tab, res); err != nil {
		t.Fatal(err)
	}
	s := tab.String()
	for _, want := range []string{"# same-process, WRITE, prepped, 1 thread; baseline memcpy", "Block Size (B)", "B/W (GB/Sec)", "P99 Tx (us)", "CPU/op (us)", "Eff.", "65536 "} {
		if !strings.Contains(s, want) {
			t.Errorf("table lacks %q:\n%s", want, s)
		}
	}
	if strings.Count(s, "Block Size (B)") != 1 {
		t.Errorf("one configuration, want one header:\n%s", s)
	}
	var cb bytes.Buffer
	if err := WriteCSV(&cb, res.Rows); err != nil {
		t.Fatal(err)
	}
	recs, err := csv.NewReader(&cb).ReadAll()
	if err != nil || len(recs) != 1+len(res.Rows) || len(recs[0]) != len(CSVHeader) || recs[1][4] != "4096" || recs[0][14] != "cpu_us_per_op" {
		t.Errorf("csv %v, %v", recs, err)
	}
	var jb bytes.Buffer
	if err := WriteJSON(&jb, res); err != nil {
		t.Fatal(err)
	}
	var back Result
	if err := json.Unmarshal(jb.Bytes(), &back); err != nil || len(back.Rows) != len(res.Rows) || back.Rows[0].GBps != res.Rows[0].GBps {
		t.Errorf("json round trip: %v", err)
	}
	dir := t.TempDir()
	for _, name := range []string{"bw.png", "bw.svg"} {
		f := filepath.Join(dir, name)
		if err := Plot(res, f); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(f)
		if err != nil || len(b) < 1000 {
			t.Fatalf("%s: %d bytes, %v", name, len(b), err)
		}
		if name == "bw.png" && !bytes.HasPrefix(b, []byte("\x89PNG")) || name == "bw.svg" && !bytes.Contains(b[:200], []byte("<svg")) {
			t.Errorf("%s: wrong format", name)
		}
	}
	if err := Plot(res, filepath.Join(dir, "bw.jpg")); err == nil {
		t.Error("Plot accepted .jpg")
	}
	if err := Plot(&Result{}, filepath.Join(dir, "empty.png")); err == nil {
		t.Error("Plot of nothing succeeded")
	}
}

func TestMemcpyRate(t *testing.T) {
	r, err := MemcpyRate(64<<10, 1<<20, 5*time.Millisecond)
	if err != nil || r <= 0 {
		t.Fatalf("MemcpyRate = %v, %v", r, err)
	}
	if _, err := MemcpyRate(0, 1<<20, time.Millisecond); err == nil {
		t.Error("block 0 accepted")
	}
	if r, err := MemcpyRate(1<<20, 1, time.Millisecond); err != nil || r <= 0 {
		t.Errorf("total below one block: %v, %v", r, err)
	}
}

// Scattered rows shuffle every thread's descriptors, the same way on both
// sides: almost no neighbours stay neighbours (NIXL would merge them), and
// every block still lands at its own offset (the rows verify), in one and
// two processes, on both paths; tables, CSV and plot say so.
func TestScatter(t *testing.T) {
	if got := blockOrder(8, 3, nil); !slices.Equal(got, []int32{8, 9, 10}) {
		t.Errorf("blockOrder without scatter = %v", got)
	}
	idx := blockOrder(4096, 4096, rand.New(rand.NewPCG(1, 2)))
	adjacent := 0
	for i := 1; i < len(idx); i++ {
		if idx[i] == idx[i-1]+1 {
			adjacent++
		}
	}
	sorted := slices.Clone(idx)
	slices.Sort(sorted)
	for i, v := range sorted {
		if v != int32(4096+i) {
			t.Fatalf("scatter lost or repeated index %d (found %d)", i, v)
		}
	}
	// A shuffle keeps about one of 4095 pairs adjacent.
	if adjacent > 8 {
		t.Errorf("%d of 4095 neighbours still adjacent after scatter", adjacent)
	}

	c := quick(t)
	c.Procs = []int{1, 2}
	c.Paths = []Path{Prepped, Batch}
	c.Batches = []int{16}
	c.Threads = []int{1, 2}
	c.Ops = []abi.Op{abi.Write, abi.Read}
	c.Blocks = []uint64{4 << 10}
	c.Scatter = true
	res := run(t, c)
	checkRows(t, res, 2*2*2*2)
	var table, csvOut bytes.Buffer
	tw := NewTableWriter(&table)
	for _, r := range res.Rows {
		if !r.Scattered || !strings.Contains(r.Label(), "scattered") {
			t.Errorf("%s: not marked scattered", r.Label())
		}
		if err := tw.Row(r); err != nil {
			t.Fatal(err)
		}
	}
	if !strings.Contains(table.String(), "prepped scattered, 1 thread") {
		t.Errorf("the table does not say the rows were scattered:\n%s", table.String())
	}
	if err := WriteCSV(&csvOut, res.Rows); err != nil {
		t.Fatal(err)
	}
	recs, err := csv.NewReader(&csvOut).ReadAll()
	col := slices.Index(CSVHeader, "scattered")
	if err != nil || col < 0 || recs[1][col] != "true" {
		t.Errorf("CSV scattered column %d: %v %v", col, recs, err)
	}
}
