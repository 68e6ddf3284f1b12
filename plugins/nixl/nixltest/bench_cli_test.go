package nixltest

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestKvhostBenchVsDirect is the comparison, command for command:
// `kvhost bench --backend nixl` (the Go host through the plugin) beside
// bin/nixl-bench-direct (NIXL's C++ API called directly), same transfers
// (contiguous blocks, batch descriptors per request; make, post, poll to
// completion, release per iteration), same NIXL settings (the plugin's
// defaults: progress thread with a 1 ms wake-up, sync mode rw, UCX worker
// lock a mutex), the same process layouts (--procs 1: both agents in one
// process; 2: the target in a second one).
//
// A shared 2-core machine swings by tens of percent from one second to the
// next, so the two programs alternate (the order flips every repetition),
// each run is short, and the table reports the median over the repetitions
// of each side and of the paired ratio (kvhost over direct, the two runs of
// one repetition being seconds apart), with the load average seen during
// the runs.
// Both programs pair every request with a raw copy of the same blocks
// (bin/nixl-bench-direct --raw does what kvhost bench always does), so
// both bandwidths are bytes over the time spent in requests, and both
// report Eff., the median per-request ratio of raw copy time to request
// time: the Eff. ratio cancels the machine's load best. Latency is the
// average of one whole request in both; CPU/op is the initiating thread's
// CPU time per request (with cma the copy runs in that thread).
//
// It is a measurement, not a CI check, so it runs only with
// KVHOST_NIXL_OVERHEAD=1 (it fails only when a run fails or a side did not
// verify its bytes):
//
//	KVHOST_NIXL_OVERHEAD=1 go test ./plugins/nixl/nixltest -run KvhostBench -v -count=1 -timeout 30m
//
// Optional: KVHOST_NIXL_BENCH_PROCS (default 1,2), _OPS (WRITE,READ),
// _PATHS (prepped,batch), _BLOCKS (64K,256K,1M,4M), _BATCHES (1,16),
// _SECONDS of transfers per row and run (0.2), _REPEAT (5).
func TestKvhostBenchVsDirect(t *testing.T) {
	if os.Getenv("KVHOST_NIXL_OVERHEAD") != "1" {
		t.Skip("a measurement: set KVHOST_NIXL_OVERHEAD=1 to run it")
	}
	load(t) // skips without the plugin
	direct := findDirect(t)
	kvhost := filepath.Join(filepath.Dir(direct), "kvhost")
	if _, err := os.Stat(kvhost); err != nil {
		t.Fatalf("%s: %v (make builds it)", kvhost, err)
	}
	procs := envWords("KVHOST_NIXL_BENCH_PROCS", "1,2")
	ops := envWords("KVHOST_NIXL_BENCH_OPS", "WRITE,READ")
	paths := envWords("KVHOST_NIXL_BENCH_PATHS", "prepped,batch")
	blocks := envOr("KVHOST_NIXL_BENCH_BLOCKS", "64K,256K,1M,4M")
	batches := envOr("KVHOST_NIXL_BENCH_BATCHES", "1,16")
	seconds := envFloat(t, "KVHOST_NIXL_BENCH_SECONDS", 0.2)
	repeat := int(envFloat(t, "KVHOST_NIXL_BENCH_REPEAT", 5))

	directArgs := func(p, op, path string) []string {
		return []string{"--progress-thread", "--progress-delay-us", "1000", "--sync", "rw",
			"--param", "engine_config=USE_MT_MUTEX=y", "--warmup", "4", "--min-iters", "20", "--raw",
			"--procs", p, "--ops", op, "--paths", path, "--blocks", blocks, "--batches", batches,
			"--seconds", strconv.FormatFloat(seconds, 'f', -1, 64)}
	}
	kvhostArgs := func(p, op, path string) []string {
		// kvhost bench splits --time between the transfers and its raw
		// copy baselines (two in one process, one across two): give the
		// transfers about the direct run's time.
		share := 2.0
		if p == "1" {
			share = 3
		}
		return []string{"--backend", "nixl", "bench", "--procs", p, "--ops", op, "--paths", path,
			"--blocks", blocks, "--batches", batches, "--warmup", "4", "--iters", "20",
			"--time", time.Duration(seconds * share * float64(time.Second)).String(), "--rounds", "3", "--json"}
	}

	type key struct {
		procs, op, path string
		block, batch    uint64
	}
	type sample struct{ gbps, lat, cpu, eff float64 }
	samples := map[key][2][]sample{} // [0] direct, [1] kvhost
	add := func(k key, side int, s sample) {
		v := samples[k]
		v[side] = append(v[side], s)
		samples[k] = v
	}
	var loads []float64
	for rep := range repeat {
		for _, p := range procs {
			for _, op := range ops {
				for _, path := range paths {
					loads = append(loads, loadAvg())
					for i := range 2 {
						side := (i + rep) % 2 // the order flips every repetition
						if side == 0 {
							out := run(t, direct, directArgs(p, op, path))
							for b, s := range parseDirectRows(t, out) {
								add(key{p, op, path, b[0], b[1]}, 0, sample{s[0], s[1], s[2], s[3]})
							}
							continue
						}
						var res struct {
							Rows []struct {
								Procs    int     `json:"procs"`
								Op       string  `json:"op"`
								Path     string  `json:"path"`
								Block    uint64  `json:"block_size"`
								Batch    uint64  `json:"batch_size"`
								GBps     float64 `json:"gb_per_s"`
								Lat      float64 `json:"avg_lat_us"`
								CPU      float64 `json:"cpu_us_per_op"`
								Eff      float64 `json:"efficiency"`
								Verified bool    `json:"verified"`
							} `json:"rows"`
						}
						out := run(t, kvhost, kvhostArgs(p, op, path))
						if err := json.Unmarshal(out, &res); err != nil {
							t.Fatalf("kvhost bench output: %v\n%s", err, out)
						}
						for _, r := range res.Rows {
							if !r.Verified {
								t.Fatalf("kvhost bench did not verify row %+v", r)
							}
							add(key{p, op, path, r.Block, r.Batch}, 1, sample{r.GBps, r.Lat, r.CPU, r.Eff})
						}
					}
				}
			}
		}
		t.Logf("repetition %d of %d done, load average %.1f", rep+1, repeat, loadAvg())
	}

	keys := make([]key, 0, len(samples))
	for k := range samples {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b key) int {
		return cmp.Or(cmp.Compare(a.procs, b.procs), cmp.Compare(slices.Index(ops, a.op), slices.Index(ops, b.op)),
			cmp.Compare(slices.Index(paths, a.path), slices.Index(paths, b.path)), cmp.Compare(a.block, b.block), cmp.Compare(a.batch, b.batch))
	})
	var out strings.Builder
	fmt.Fprintf(&out, "\nmedians of %d interleaved runs (ratio: median of kvhost/direct per repetition); 1-minute load average during them: min %.1f, median %.1f, max %.1f\n",
		repeat, slices.Min(loads), median(loads), slices.Max(loads))
	fmt.Fprintf(&out, "%-5s %-5s %-7s %6s %5s | %8s %8s %6s | %9s %9s %6s | %9s %9s %6s | %6s %6s %6s\n", "procs", "op", "path", "block", "batch",
		"direct", "kvhost", "ratio", "direct", "kvhost", "ratio", "direct", "kvhost", "ratio", "direct", "kvhost", "ratio")
	fmt.Fprintf(&out, "%-5s %-5s %-7s %6s %5s | %8s %8s %6s | %9s %9s %6s | %9s %9s %6s | %6s %6s %6s\n", "", "", "", "", "",
		"GB/s", "GB/s", "", "lat µs", "lat µs", "", "CPU µs", "CPU µs", "", "Eff.", "Eff.", "")
	for _, k := range keys {
		s := samples[k]
		if len(s[0]) == 0 || len(s[1]) == 0 {
			continue
		}
		med := func(side int, f func(sample) float64) float64 {
			var v []float64
			for _, x := range s[side] {
				v = append(v, f(x))
			}
			return median(v)
		}
		// The ratio is the median over repetitions of kvhost's value over
		// the direct one of the same repetition (seconds apart, so under
		// about the same load), steadier than the ratio of the medians.
		ratio := func(f func(sample) float64) float64 {
			var v []float64
			for i := range min(len(s[0]), len(s[1])) {
				v = append(v, f(s[1][i])/f(s[0][i]))
			}
			return median(v)
		}
		gbps := func(x sample) float64 { return x.gbps }
		lat := func(x sample) float64 { return x.lat }
		cpu := func(x sample) float64 { return x.cpu }
		eff := func(x sample) float64 { return x.eff }
		fmt.Fprintf(&out, "%-5s %-5s %-7s %6s %5d | %8.2f %8.2f %6.3f | %9.1f %9.1f %6.3f | %9.1f %9.1f %6.3f | %6.3f %6.3f %6.3f\n",
			k.procs, k.op, k.path, humanSize(k.block), k.batch, med(0, gbps), med(1, gbps), ratio(gbps),
			med(0, lat), med(1, lat), ratio(lat), med(0, cpu), med(1, cpu), ratio(cpu), med(0, eff), med(1, eff), ratio(eff))
	}
	t.Log(out.String())
}

// parseDirectRows reads the rows of bin/nixl-bench-direct --raw: (block,
// batch) -> (GB/s, average latency µs, CPU µs per request, Eff.). A row
// that did not verify its bytes fails the test.
func parseDirectRows(t *testing.T, out []byte) map[[2]uint64][4]float64 {
	t.Helper()
	rows := map[[2]uint64][4]float64{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 15 {
			continue
		}
		block, err1 := strconv.ParseUint(f[0], 10, 64)
		batch, err2 := strconv.ParseUint(f[1], 10, 64)
		if err1 != nil || err2 != nil {
			continue // a header
		}
		if f[14] != "yes" {
			t.Fatalf("direct run did not verify its bytes: %s", sc.Text())
		}
		var v [4]float64
		for i, col := range []int{2, 3, 10, 12} {
			x, err := strconv.ParseFloat(f[col], 64)
			if err != nil {
				t.Fatalf("unparsable direct row %q", sc.Text())
			}
			v[i] = x
		}
		rows[[2]uint64{block, batch}] = v
	}
	if len(rows) == 0 {
		t.Fatalf("no rows in bin/nixl-bench-direct's output:\n%s", out)
	}
	return rows
}

// run runs a program and returns its standard output; NIXL's own log is
// quieted by TestMain's NIXL_LOG_LEVEL, which the program inherits.
func run(t *testing.T, bin string, args []string) []byte {
	t.Helper()
	var stderr bytes.Buffer
	cmd := exec.Command(bin, args...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s\n%s", bin, strings.Join(args, " "), err, out, stderr.Bytes())
	}
	return out
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	n := len(s)
	if n == 0 {
		return 0
	}
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// loadAvg is the 1-minute load average (/proc/loadavg), 0 if unreadable.
func loadAvg() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}

func humanSize(b uint64) string {
	if b >= 1<<20 && b%(1<<20) == 0 {
		return fmt.Sprintf("%dM", b>>20)
	}
	if b >= 1<<10 && b%(1<<10) == 0 {
		return fmt.Sprintf("%dK", b>>10)
	}
	return strconv.FormatUint(b, 10)
}

func envOr(key, def string) string {
	if s := os.Getenv(key); s != "" {
		return s
	}
	return def
}

func envWords(key, def string) []string { return strings.Split(envOr(key, def), ",") }
