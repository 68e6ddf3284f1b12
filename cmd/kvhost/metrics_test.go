package main

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/bootstrap"
)

// kvhostProc is this test binary running as `kvhost ARGS` (see TestMain).
type kvhostProc struct {
	name    string
	cmd     *exec.Cmd
	done    chan struct{} // closed once it exited
	err     error         // its exit status, once done
	metrics chan string   // the address its "serving metrics" log line names

	mu  sync.Mutex
	log strings.Builder // its stderr
}

var metricsLine = regexp.MustCompile(`msg="serving metrics" addr=(\S+)`)

func startKvhost(t *testing.T, name string, args ...string) *kvhostProc {
	t.Helper()
	p := &kvhostProc{name: name, done: make(chan struct{}), metrics: make(chan string, 1)}
	p.cmd = exec.Command(os.Args[0], append([]string{"--log-level", "info"}, args...)...)
	p.cmd.Env = append(os.Environ(), asKvhostEnv+"=1")
	p.cmd.Stdout = io.Discard
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			line := sc.Text()
			p.mu.Lock()
			p.log.WriteString(line + "\n")
			p.mu.Unlock()
			if m := metricsLine.FindStringSubmatch(line); m != nil {
				p.metrics <- m[1]
			}
		}
		p.err = p.cmd.Wait() // after the last read of stderr
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			p.cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

func (p *kvhostProc) logText() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log.String()
}

// metricsAddr waits for the address the process serves metrics on.
func (p *kvhostProc) metricsAddr(t *testing.T) string {
	t.Helper()
	select {
	case a := <-p.metrics:
		return a
	case <-p.done:
		t.Fatalf("%s exited (%v) before serving metrics:\n%s", p.name, p.err, p.logText())
	case <-time.After(30 * time.Second):
		t.Fatalf("%s logged no metrics address:\n%s", p.name, p.logText())
	}
	return ""
}

// wait waits for the process to exit and fails the test unless it exited 0.
func (p *kvhostProc) wait(t *testing.T, timeout time.Duration) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		t.Fatalf("%s still running after %v:\n%s", p.name, timeout, p.logText())
	}
	if p.err != nil {
		t.Fatalf("%s: %v\n%s", p.name, p.err, p.logText())
	}
}

// get fetches url, returning the status code and body (0 when unreachable).
func get(url string) (int, string) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// metricValue returns the value of the first sample of name whose labels
// contain all of labels ("k=\"v\"" pairs), or -1.
func metricValue(body, name string, labels ...string) float64 {
	for _, line := range strings.Split(body, "\n") {
		rest, ok := strings.CutPrefix(line, name+"{")
		if !ok {
			continue
		}
		lbl, val, ok := strings.Cut(rest, "} ")
		if !ok {
			continue
		}
		match := true
		for _, l := range labels {
			match = match && strings.Contains(","+lbl+",", ","+l+",")
		}
		if match {
			v, err := strconv.ParseFloat(strings.Fields(val)[0], 64)
			if err == nil {
				return v
			}
		}
	}
	return -1
}

// until polls fn every 20 ms until it reports true or timeout passes.
func until(timeout time.Duration, fn func() bool) bool {
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if fn() {
			return true
		}
	}
	return fn()
}

var metricsWorkload = []string{"--layers", "4", "--kv-heads", "4", "--head-dim", "32", "--page-size", "8",
	"--requests", "48", "--min-tokens", "8", "--max-tokens", "200", "--concurrency", "4"}

// TestWorkerMetricsSGLang runs `kvhost prefill` and `kvhost decode`
// (sglang style) as processes with --metrics-addr: /health answers 503
// until the prefill registered with the bootstrap server and 200 after,
// the decode's room gauge shows the rooms it holds, and a scrape of the
// prefill during the run finds the transfer histograms populated.
func TestWorkerMetricsSGLang(t *testing.T) {
	plugins := fakeDir(t)
	// A bootstrap server that answers 503 until opened: the prefill keeps
	// retrying its registration and is not ready until then.
	var open atomic.Bool
	bs := bootstrap.NewServer()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gate := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !open.Load() {
			http.Error(w, "not yet", http.StatusServiceUnavailable)
			return
		}
		bs.ServeHTTP(w, r)
	})}
	go gate.Serve(ln)
	t.Cleanup(func() { gate.Close() })
	addr := ln.Addr().String()
	dir := t.TempDir()

	prefill := startKvhost(t, "prefill", append([]string{"--plugin-path", plugins, "prefill", "--tp-size", "2",
		"--bootstrap-addr", addr, "--metrics-addr", "127.0.0.1:0", "--linger", "2m",
		"--summary", filepath.Join(dir, "prefill.json")}, metricsWorkload...)...)
	pm := "http://" + prefill.metricsAddr(t)
	if code, body := get(pm + "/health"); code != http.StatusServiceUnavailable || !strings.Contains(body, "starting") {
		t.Fatalf("prefill /health before registering: %d %q, want 503 starting", code, body)
	}
	if _, body := get(pm + "/metrics"); metricValue(body, "kvhost_ready", `role="prefill"`, `style="sglang"`) != 0 {
		t.Errorf("prefill kvhost_ready before registering is not 0:\n%s", body)
	}

	decode := startKvhost(t, "decode", append([]string{"--plugin-path", plugins, "decode", "--tp-size", "2",
		"--bootstrap-addr", addr, "--metrics-addr", "127.0.0.1:0", "--summary", filepath.Join(dir, "decode.json"),
		"--report", filepath.Join(dir, "decode.requests")}, metricsWorkload...)...)
	dm := "http://" + decode.metricsAddr(t)
	// The decode ranks serve without the prefill; their requests wait in
	// Bootstrapping for the prefill layout.
	var body string
	if !until(30*time.Second, func() bool {
		var code int
		code, body = get(dm + "/metrics")
		return code == http.StatusOK && metricValue(body, "kvhost_rooms", `role="decode"`, `state="Bootstrapping"`) > 0
	}) {
		t.Fatalf("decode /metrics shows no room held in Bootstrapping:\n%s\n%s", body, decode.logText())
	}
	if code, _ := get(dm + "/health"); code != http.StatusOK {
		t.Errorf("decode /health %d, want 200 once its ranks serve", code)
	}

	open.Store(true)
	if !until(30*time.Second, func() bool { code, _ := get(pm + "/health"); return code == http.StatusOK }) {
		t.Fatalf("prefill /health never answered 200 after the bootstrap server opened:\n%s", prefill.logText())
	}
	// Scrape the prefill while it runs (it lingers after its workload, so
	// the last scrapes still find it), until every series checked below has
	// been recorded. A transfer's histograms are observed one after the
	// other (a scrape between them saw a transfer time but no bytes), and
	// one scrape saw four transfers before any Transferring transition.
	populated := []string{"kvhost_nixl_post_time_seconds_count", "kvhost_nixl_bytes_transferred_sum", "kvhost_nixl_num_descriptors_count"}
	if !until(60*time.Second, func() bool {
		_, body = get(pm + "/metrics")
		// Every series checked below, sums included: one CI run scraped
		// kvhost_nixl_bytes_transferred_sum at 0 with the descriptor
		// count already above 0 (bytes are observed first; why it read 0
		// is not known).
		for _, name := range populated {
			if metricValue(body, name, `role="prefill"`) <= 0 {
				return false
			}
		}
		return metricValue(body, "kvhost_nixl_xfer_time_seconds_count", `role="prefill"`) > 0 &&
			metricValue(body, "kvhost_room_transitions_total", `state="Transferring"`) > 0
	}) {
		t.Fatalf("prefill /metrics: transfer histograms or Transferring transitions never populated:\n%s", body)
	}
	for _, name := range populated {
		if v := metricValue(body, name, `role="prefill"`, `style="sglang"`); v <= 0 {
			t.Errorf("prefill %s = %v during the run", name, v)
		}
	}
	if metricValue(body, "kvhost_nixl_xfer_time_seconds_bucket", `le="+Inf"`) <= 0 ||
		metricValue(body, "kvhost_room_transitions_total", `state="Transferring"`) <= 0 ||
		metricValue(body, "kvhost_rooms", `state="WaitingForInput"`) < 0 {
		t.Errorf("prefill /metrics lacks histogram buckets, room transitions or the room gauge:\n%s", body)
	}

	decode.wait(t, 2*time.Minute)
	prefill.cmd.Process.Signal(syscall.SIGTERM) // end the linger
	prefill.wait(t, 30*time.Second)
	p, d := readSummary(t, filepath.Join(dir, "prefill.json")), readSummary(t, filepath.Join(dir, "decode.json"))
	if p.OK != 48 || d.OK != 48 || d.Bytes == 0 {
		t.Fatalf("prefill %d ok, decode %d ok (%d bytes), want 48", p.OK, d.OK, d.Bytes)
	}
}

// TestWorkerMetricsVLLM: the vllm-style prefill serves its metrics while a
// decode process pulls from it; the releases are counted.
func TestWorkerMetricsVLLM(t *testing.T) {
	plugins := fakeDir(t)
	dir := t.TempDir()
	urlFile := filepath.Join(dir, "api.url")
	prefill := startKvhost(t, "prefill", append([]string{"--plugin-path", plugins, "prefill", "--style", "vllm",
		"--tp-size", "1", "--api-port", "0", "--side-channel-port", "0", "--api-url-file", urlFile,
		"--metrics-addr", "127.0.0.1:0"}, append(metricsWorkload, "--requests", "0")...)...)
	pm := "http://" + prefill.metricsAddr(t)
	if !until(30*time.Second, func() bool { code, _ := get(pm + "/health"); return code == http.StatusOK }) {
		t.Fatalf("prefill /health never answered 200:\n%s", prefill.logText())
	}
	var url []byte
	until(30*time.Second, func() bool { url, _ = os.ReadFile(urlFile); return len(url) > 0 })
	decode := startKvhost(t, "decode", append([]string{"--plugin-path", plugins, "decode", "--style", "vllm",
		"--tp-size", "2", "--prefill-url", strings.TrimSpace(string(url)), "--metrics-addr", "127.0.0.1:0",
		"--summary", filepath.Join(dir, "decode.json")}, metricsWorkload...)...)
	decode.metricsAddr(t)
	decode.wait(t, 2*time.Minute)
	var body string
	if !until(30*time.Second, func() bool {
		_, body = get(pm + "/metrics")
		return metricValue(body, "kvhost_requests_released_total", `reason="notified"`, `style="vllm"`) == 48
	}) {
		t.Fatalf("prefill /metrics: released requests not 48:\n%s", body)
	}
	prefill.cmd.Process.Signal(syscall.SIGTERM) // --requests 0 serves until told
	prefill.wait(t, 30*time.Second)
}
