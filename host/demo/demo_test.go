package demo

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/metrics"
	"github.com/kvhost/kvhost/host/plugin"
)

// small is a workload that runs in about a second on a loaded 2-core box.
func small(t *testing.T) Config {
	t.Helper()
	if _, err := plugin.Find("fake", plugin.SearchDirs("")); err != nil {
		t.Fatalf("%v (build it with `make plugin-fake`)", err)
	}
	c := Defaults()
	c.Requests, c.Layers, c.KVHeads, c.HeadDim, c.PageSize = 12, 2, 4, 16, 4
	c.MinTokens, c.MaxTokens, c.ChunkPages, c.Concurrency = 1, 48, 3, 4
	c.InProcess = true
	c.Timeout = 2 * time.Minute
	c.MemcpyTime = 20 * time.Millisecond
	return c
}

func check(t *testing.T, s *Summary, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	if !s.Success() || s.OK != s.Requests {
		t.Fatalf("not verified: %d ok of %d, failures %q", s.OK, s.Requests, s.Failures)
	}
	switch {
	case s.BytesMoved == 0 || s.BytesVerified == 0:
		t.Errorf("bytes moved %d, verified %d", s.BytesMoved, s.BytesVerified)
	case s.Transfers == 0 || s.DescsPerRequest <= 0 || s.XferP99us < s.XferP50us || s.XferP50us <= 0:
		t.Errorf("transfers %d, descriptors/request %v, p50 %v p99 %v", s.Transfers, s.DescsPerRequest, s.XferP50us, s.XferP99us)
	case s.GBps <= 0 || s.MemcpyGBps <= 0 || s.Seconds <= 0:
		t.Errorf("rates %v GB/s over %v s, memcpy %v", s.GBps, s.Seconds, s.MemcpyGBps)
	case len(s.Workers) != 1+s.DecodeTP:
		t.Errorf("%d worker summaries, want %d", len(s.Workers), 1+s.DecodeTP)
	}
	var b strings.Builder
	s.WriteText(&b)
	if !strings.Contains(b.String(), "OK: every byte verified") || !strings.Contains(b.String(), "raw memcpy") {
		t.Errorf("text summary:\n%s", b.String())
	}
	// The workers' threads ran (they moved and checked every byte) and
	// the summary says how long they waited for a core.
	if s.CPURunSeconds == nil || s.CPUWaitSeconds == nil || s.CPUWaitPerRun == nil {
		t.Fatalf("CPU not measured: %s", s.CPUScope)
	}
	if *s.CPURunSeconds <= 0 || *s.CPUWaitSeconds < 0 || *s.CPUWaitPerRun != *s.CPUWaitSeconds / *s.CPURunSeconds {
		t.Errorf("CPU ran %v s, waited %v s, wait/run %v", *s.CPURunSeconds, *s.CPUWaitSeconds, *s.CPUWaitPerRun)
	}
	line := fmt.Sprintf("threads ran %.2f s and waited %.2f s for a core (wait/run %.2f)", *s.CPURunSeconds, *s.CPUWaitSeconds, *s.CPUWaitPerRun)
	if !strings.Contains(b.String(), line) {
		t.Errorf("text summary lacks %q:\n%s", line, b.String())
	}
}

func TestInProcessStyles(t *testing.T) {
	for _, c := range []struct{ style, attention string }{{"sglang", "mha"}, {"vllm", "mha"}, {"sglang", "mla"}, {"vllm", "mla"}} {
		t.Run(c.style+"-"+c.attention, func(t *testing.T) {
			cfg := small(t)
			cfg.Style, cfg.Attention = c.style, c.attention
			var mu sync.Mutex
			last, total := 0, 0
			cfg.Progress = func(done, n int) { mu.Lock(); last, total = max(last, done), n; mu.Unlock() }
			s, err := Run(context.Background(), cfg)
			check(t, s, err)
			if last != cfg.Requests*cfg.DecodeTP || total != last {
				t.Errorf("progress ended at %d of %d", last, total)
			}
		})
	}
}

// Injected transfer failures are reported, never passed off as verified.
func TestFailuresAreReported(t *testing.T) {
	cfg := small(t)
	cfg.AgentParams = []string{"fail_rate=0.5"}
	s, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if s.Success() || s.Failed == 0 || s.OK+s.Failed != s.Requests || len(s.Failures) == 0 {
		t.Fatalf("summary %d ok, %d failed, failures %q", s.OK, s.Failed, s.Failures)
	}
	if !strings.Contains(strings.Join(s.Failures, "\n"), "injected failure") {
		t.Errorf("failures do not name the cause: %q", s.Failures)
	}
}

func TestValidateAndMissingPlugin(t *testing.T) {
	for name, mut := range map[string]func(*Config){
		"style":    func(c *Config) { c.Style = "trtllm" },
		"attn":     func(c *Config) { c.Attention = "gqa" },
		"tp":       func(c *Config) { c.DecodeTP = 0 },
		"vllm tp":  func(c *Config) { c.Style = "vllm"; c.PrefillTP, c.DecodeTP = 4, 2 },
		"requests": func(c *Config) { c.Requests = 0 },
		"tokens":   func(c *Config) { c.MinTokens = 10; c.MaxTokens = 5 },
		"dtype":    func(c *Config) { c.DTypeBytes = 3 },
		"exe":      func(c *Config) { c.InProcess = false },
		"metrics":  func(c *Config) { c.InProcess = false; c.Exe = "x"; c.Metrics = metrics.New(nil) },
		"kinds":    func(c *Config) { c.MemKinds = "hbm" },
		"vllm mix": func(c *Config) { c.Style = "vllm"; c.MemKinds = "mixed" },
		// SGLang's NIXL connector refuses heterogeneous-TP MHA into host memory.
		"hetero dram": func(c *Config) { c.MemKinds = "dram" },
	} {
		c := Defaults()
		c.InProcess = true
		mut(&c)
		if _, err := Run(context.Background(), c); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	// Heads that do not split over a TP size are refused before any worker
	// starts, saying so (workers used to fail one by one, 20 s later).
	for _, tp := range [][2]int{{3, 4}, {2, 3}, {2, 12}} {
		c := Defaults()
		c.InProcess = true
		c.Style = "vllm"
		c.PrefillTP, c.DecodeTP = tp[0], tp[1]
		start := time.Now()
		_, err := Run(context.Background(), c)
		if err == nil || !strings.Contains(err.Error(), "TP must divide the KV heads") {
			t.Errorf("8 heads, TP %d -> %d: %v, want the heads refused", tp[0], tp[1], err)
		}
		if el := time.Since(start); el > time.Second {
			t.Errorf("8 heads, TP %d -> %d: refused after %v", tp[0], tp[1], el)
		}
	}
	c := small(t)
	c.Plugin = "nosuchplugin"
	if _, err := Run(context.Background(), c); err == nil || !strings.Contains(err.Error(), "nosuchplugin") {
		t.Errorf("missing plugin: %v", err)
	}
}

// MemKinds: the fake accepts host memory as VRAM, so the default probe
// picks VRAM; DRAM pools (what a real backend gets) move and verify the
// same; MLA and heterogeneous TP in vLLM style take DRAM; a bad agent
// parameter fails at the probe, before any worker starts.
func TestMemKinds(t *testing.T) {
	cfg := small(t)
	s, err := Run(context.Background(), cfg)
	check(t, s, err)
	if s.MemKinds != "vram" {
		t.Errorf("fake, default: pools %q, want vram", s.MemKinds)
	}
	for _, c := range []struct {
		style, attn string
		decodeTP    int
	}{{"sglang", "mha", 2}, {"sglang", "mla", 4}, {"vllm", "mha", 4}} {
		cfg := small(t)
		cfg.Style, cfg.Attention, cfg.DecodeTP, cfg.MemKinds = c.style, c.attn, c.decodeTP, "dram"
		s, err := Run(context.Background(), cfg)
		check(t, s, err)
		var b strings.Builder
		s.WriteText(&b)
		if s.MemKinds != "dram" || !strings.Contains(b.String(), "DRAM pools") {
			t.Errorf("%+v: pools %q, text:\n%s", c, s.MemKinds, b.String())
		}
	}
	cfg = small(t)
	cfg.AgentParams = []string{"no_such_param=1"}
	if _, err := Run(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), "probe agent") {
		t.Errorf("bad agent parameter: %v", err)
	}
}

// A Prometheus scrape while the demo runs finds the transfer histograms
// populated.
func TestMetricsDuringRun(t *testing.T) {
	cfg := small(t)
	cfg.Requests, cfg.Layers = 40, 4
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m, srv, err := metrics.Start(ctx, "127.0.0.1:0", map[string]string{"role": "demo"})
	if err != nil {
		t.Fatal(err)
	}
	m.SetReady(true)
	cfg.Metrics = m
	count := regexp.MustCompile(`(?m)^kvhost_nixl_xfer_time_seconds_count\{role="demo"\} (\d+)$`)
	// A transfer's time is observed before its room turns Success, so a
	// scrape counts only once every series is there (one scrape between
	// the two would lack the transition).
	wants := []string{"kvhost_nixl_post_time_seconds_count", "kvhost_nixl_bytes_transferred_bucket", "kvhost_nixl_num_descriptors_sum", `kvhost_room_transitions_total{role="demo",state="Success"}`}
	complete := func(b []byte) bool {
		for _, w := range wants {
			if !bytes.Contains(b, []byte(w)) {
				return false
			}
		}
		return true
	}
	scraped := make(chan string, 1)
	var running sync.WaitGroup
	running.Add(1)
	finished := make(chan struct{})
	go func() {
		defer running.Done()
		for {
			select {
			case <-finished:
				return
			case <-time.After(20 * time.Millisecond):
			}
			resp, err := http.Get("http://" + srv.Addr() + "/metrics")
			if err != nil {
				continue
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if mm := count.FindSubmatch(b); mm != nil {
				if n, _ := strconv.Atoi(string(mm[1])); n > 0 && complete(b) {
					select {
					case <-finished: // too late: the run is over
					default:
						scraped <- string(b)
					}
					return
				}
			}
		}
	}()
	s, err := Run(ctx, cfg)
	close(finished)
	running.Wait()
	check(t, s, err)
	select {
	case body := <-scraped:
		for _, want := range wants {
			if !strings.Contains(body, want) {
				t.Errorf("scrape during the run lacks %s", want)
			}
		}
	default:
		t.Fatalf("no scrape during the run found kvhost_nixl_xfer_time_seconds populated and %v", wants)
	}
}

// kvhostBinary builds kvhost for the separate-process runs, with the
// Makefile's flags so that `make`'s compiled packages are reused.
func kvhostBinary(t *testing.T) string {
	t.Helper()
	exe := filepath.Join(t.TempDir(), "kvhost")
	cmd := exec.Command("go", "build", "-trimpath", "-o", exe, "github.com/kvhost/kvhost/cmd/kvhost")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building kvhost: %v\n%s", err, out)
	}
	return exe
}

func TestSeparateProcesses(t *testing.T) {
	exe := kvhostBinary(t)
	dirs := plugin.SearchDirs("")
	path, err := plugin.Find("fake", dirs)
	if err != nil {
		t.Fatal(err)
	}
	for _, style := range []string{"sglang", "vllm"} {
		t.Run(style, func(t *testing.T) {
			// Variables meant for a deployment's workers must not reach the
			// demo's: each of these would break them.
			t.Setenv("KVHOST_STYLE", map[string]string{"sglang": "vllm", "vllm": "sglang"}[style])
			t.Setenv("KVHOST_METRICS_ADDR", "256.0.0.1:1")
			t.Setenv("KVHOST_DECODE_TP_SIZE", "3")
			cfg := small(t)
			cfg.Style, cfg.InProcess, cfg.Exe = style, false, exe
			cfg.PluginPath = filepath.Dir(path)
			cfg.WorkDir = t.TempDir()
			var mu sync.Mutex
			last := 0
			cfg.Progress = func(done, total int) {
				mu.Lock()
				defer mu.Unlock()
				if done < last || total != cfg.Requests*cfg.DecodeTP {
					t.Errorf("progress %d of %d after %d", done, total, last)
				}
				last = done
			}
			s, err := Run(context.Background(), cfg)
			check(t, s, err)
			if last != cfg.Requests*cfg.DecodeTP {
				t.Errorf("progress ended at %d of %d", last, cfg.Requests*cfg.DecodeTP)
			}
			want := 1 + 1 + cfg.DecodeTP // bootstrap, prefill, decodes
			if style == "vllm" {
				want-- // the prefill's API stands in for the bootstrap server
			}
			if s.Processes != want {
				t.Errorf("%d processes, want %d", s.Processes, want)
			}
			for _, f := range []string{"prefill.json", "decode-0.json", "decode-3.requests", "prefill.log"} {
				if _, err := os.Stat(filepath.Join(cfg.WorkDir, f)); err != nil {
					t.Errorf("work dir: %v", err)
				}
			}
		})
	}
}

func TestTally(t *testing.T) {
	tl := newTally()
	tl.addReport(strings.NewReader(`{"room":1,"ok":true}` + "\n" + `{"room":2,"ok":false,"reason":"timeout"}` + "\n"))
	tl.addReport(strings.NewReader(`{"room":1,"ok":true}` + "\n" + `{"room":2,"ok":true}` + "\n"))
	tl.addReport(strings.NewReader(`{"request_id":"a","ok":true}`))
	s := &Summary{Requests: 3}
	tl.apply(s, 2)
	// room 1: both ranks; room 2: one failed; "a": only one rank of two.
	if s.OK != 1 || s.Failed != 2 || len(s.Failures) != 1 || !strings.Contains(s.Failures[0], "timeout") {
		t.Errorf("tally: ok %d failed %d failures %q", s.OK, s.Failed, s.Failures)
	}
	if err := newTally().addReport(strings.NewReader("{bad")); err == nil {
		t.Error("a broken report line was accepted")
	}
}

// TestLineTail: the progress of separate processes counts the lines of a
// report another process appends to, each byte read once.
func TestLineTail(t *testing.T) {
	path := filepath.Join(t.TempDir(), "r")
	lt := &lineTail{path: path}
	defer lt.close()
	if n := lt.count(); n != 0 {
		t.Fatalf("no file yet: %d", n)
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for i, chunk := range []string{"{\"room\":1}\n", "{\"room\":2", "}\n{\"room\":3}\n", ""} {
		if _, err := f.WriteString(chunk); err != nil {
			t.Fatal(err)
		}
		if n, want := lt.count(), []int{1, 1, 3, 3}[i]; n != want {
			t.Fatalf("after chunk %d: %d lines, want %d", i, n, want)
		}
	}
}

// In one process the targets' agents keep the plugin's first-touch pass
// (their initiator copies into their pages from here): the host's target
// default prefault=false does not apply, and a user's value still wins.
func TestInProcessKeepsPrefault(t *testing.T) {
	small(t) // fails when the fake plugin is not built
	path, err := plugin.Find("fake", plugin.SearchDirs(""))
	if err != nil {
		t.Fatal(err)
	}
	p, err := plugin.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, c := range []struct {
		given []string
		want  string
	}{{nil, "true"}, {[]string{"prefault=false"}, "false"}, {[]string{"workers=2"}, "true"}} {
		params, err := inProcessParams(p, c.given)
		if err != nil {
			t.Fatal(err)
		}
		for _, side := range []plugin.Side{plugin.Target, plugin.Initiator} {
			got := ""
			for _, kv := range p.ForSide(side, params) {
				if kv.Key == plugin.PrefaultParam {
					got += kv.Value + ";"
				}
			}
			if got != c.want+";" {
				t.Errorf("given %v, %v: prefault %q, want exactly %q", c.given, side, got, c.want)
			}
		}
	}
	if _, err := inProcessParams(p, []string{"nonsense"}); err == nil {
		t.Error("a parameter without '=' was accepted")
	}
}
