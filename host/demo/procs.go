package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/host/demo/pullworker"
	"github.com/kvhost/kvhost/host/demo/pushworker"
	"github.com/kvhost/kvhost/host/internal/schedstat"
)

// child is one worker process.
type child struct {
	name string
	cmd  *exec.Cmd
	log  string        // its stderr, in the work dir
	done chan struct{} // closed when it exited
	err  error         // its exit status, once done
}

// exitGrace is how long the other workers may go on after one failed
// before they are stopped: long enough for them to notice and report.
const exitGrace = 20 * time.Second

// procRun is a demo of separate processes.
type procRun struct {
	cfg      *Config
	dir      string
	global   []string // kvhost's global flags for every child
	children []*child
	tails    []*lineTail // the decode ranks' request reports (progress)
}

func (r *procRun) path(name string) string { return filepath.Join(r.dir, name) }

func (r *procRun) start(name string, args ...string) (*child, error) {
	c := &child{name: name, log: r.path(name + ".log"), done: make(chan struct{})}
	logf, err := os.Create(c.log)
	if err != nil {
		return nil, fmt.Errorf("demo: %s log: %w", name, err)
	}
	var stderr io.Writer = logf
	if r.cfg.WorkerLog != nil {
		stderr = io.MultiWriter(logf, &prefixWriter{w: r.cfg.WorkerLog, prefix: name + ": "})
	}
	c.cmd = exec.Command(r.cfg.Exe, append(append([]string{}, r.global...), args...)...)
	c.cmd.Env = childEnv(os.Environ())
	c.cmd.Stdout = io.Discard
	c.cmd.Stderr = stderr
	if err := c.cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("demo: starting %s (%s): %w", name, r.cfg.Exe, err)
	}
	r.children = append(r.children, c)
	go func() {
		c.err = c.cmd.Wait()
		logf.Close()
		close(c.done)
	}()
	return c, nil
}

// childEnv is the environment of a worker process: this one's without the
// KVHOST_ variables. The demo gives every setting on the command line, and
// a variable meant for a deployment's workers (KVHOST_METRICS_ADDR,
// KVHOST_STYLE, KVHOST_PREFIX_RATE, ...) must not change or break the
// demo's workers behind its back.
func childEnv(env []string) []string {
	out := make([]string, 0, len(env))
	for _, kv := range env {
		if !strings.HasPrefix(kv, "KVHOST_") {
			out = append(out, kv)
		}
	}
	return out
}

// stop asks c to exit (SIGTERM) and kills it if it has not after 3 s.
func (c *child) stop() {
	select {
	case <-c.done:
		return
	default:
	}
	c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(3 * time.Second):
		c.cmd.Process.Kill()
		<-c.done
	}
}

// failure describes a child that failed, with the end of its log.
func (c *child) failure() string {
	b, _ := os.ReadFile(c.log)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 6 {
		lines = lines[len(lines)-6:]
	}
	return fmt.Sprintf("%s exited: %v; last log lines:\n    %s", c.name, c.err, strings.Join(lines, "\n    "))
}

// waitFile waits for name to hold a line (an address the child writes),
// or for c to exit first.
func waitFile(ctx context.Context, name string, c *child) (string, error) {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(30 * time.Second)
	for {
		if b, err := os.ReadFile(name); err == nil && bytes.HasSuffix(b, []byte("\n")) {
			return strings.TrimSpace(string(b)), nil
		}
		select {
		case <-c.done:
			return "", errors.New(c.failure())
		case <-ctx.Done():
			return "", ctx.Err()
		case <-deadline:
			return "", fmt.Errorf("%s wrote no address to %s within 30 s", c.name, name)
		case <-tick.C:
		}
	}
}

// modelArgs are the flags both sides share.
func (r *procRun) modelArgs() []string {
	c := r.cfg
	a := []string{"--attention", c.Attention, "--layers", itoa(c.Layers), "--kv-heads", itoa(c.KVHeads),
		"--head-dim", itoa(c.HeadDim), "--dtype-bytes", itoa(c.DTypeBytes), "--page-size", itoa(c.PageSize),
		"--requests", itoa(c.Requests), "--seed", strconv.FormatUint(c.Seed, 10),
		"--min-tokens", itoa(c.MinTokens), "--max-tokens", itoa(c.MaxTokens), "--concurrency", itoa(c.Concurrency),
		"--host", "127.0.0.1", "--style", c.Style, "--mem-kinds", c.MemKinds}
	if c.Style == "sglang" {
		a = append(a, "--chunk-pages", itoa(c.ChunkPages))
	}
	for _, p := range c.AgentParams {
		a = append(a, "--agent-param", p)
	}
	return a
}

func itoa(n int) string { return strconv.Itoa(n) }

// runProcs runs the demo as separate processes and fills s.
func runProcs(ctx context.Context, cfg *Config, pluginDir string, s *Summary) (err error) {
	r := &procRun{cfg: cfg, dir: cfg.WorkDir}
	if r.dir == "" {
		if r.dir, err = os.MkdirTemp("", "kvhost-demo-"); err != nil {
			return fmt.Errorf("demo: work dir: %w", err)
		}
		defer os.RemoveAll(r.dir)
	} else if err := os.MkdirAll(r.dir, 0o755); err != nil {
		return fmt.Errorf("demo: work dir: %w", err)
	}
	level := "warn"
	if cfg.WorkerLog != nil {
		level = "info"
	}
	r.global = []string{"--backend", cfg.Plugin, "--plugin-path", pluginDir, "--log-level", level}
	defer func() {
		for _, c := range r.children {
			c.stop()
		}
		for _, t := range r.tails {
			t.close()
		}
	}()
	var prefill *child
	var decodes []*child
	model := r.modelArgs()
	if cfg.Style == "sglang" {
		bs, err := r.start("bootstrap", "bootstrap", "--host", "127.0.0.1", "--port", "0", "--addr-file", r.path("bootstrap.addr"))
		if err != nil {
			return err
		}
		addr, err := waitFile(ctx, r.path("bootstrap.addr"), bs)
		if err != nil {
			return fmt.Errorf("demo: bootstrap server: %w", err)
		}
		if prefill, err = r.start("prefill", append([]string{"prefill", "--tp-size", itoa(cfg.PrefillTP),
			"--bootstrap-addr", addr, "--summary", r.path("prefill.json")}, model...)...); err != nil {
			return err
		}
		for rank := range cfg.DecodeTP {
			d, err := r.start(fmt.Sprintf("decode-%d", rank), append([]string{"decode", "--tp-size", itoa(cfg.DecodeTP),
				"--tp-ranks", itoa(rank), "--bootstrap-addr", addr, "--summary", r.path(fmt.Sprintf("decode-%d.json", rank)),
				"--report", r.path(fmt.Sprintf("decode-%d.requests", rank))}, model...)...)
			if err != nil {
				return err
			}
			decodes = append(decodes, d)
		}
	} else {
		if prefill, err = r.start("prefill", append([]string{"prefill", "--tp-size", itoa(cfg.PrefillTP),
			"--engine-id", "demo-prefill", "--api-port", "0", "--side-channel-host", "127.0.0.1", "--side-channel-port", "0",
			"--api-url-file", r.path("prefill.url"), "--summary", r.path("prefill.json")}, model...)...); err != nil {
			return err
		}
		url, err := waitFile(ctx, r.path("prefill.url"), prefill)
		if err != nil {
			return fmt.Errorf("demo: prefill API: %w", err)
		}
		for rank := range cfg.DecodeTP {
			d, err := r.start(fmt.Sprintf("decode-%d", rank), append([]string{"decode", "--tp-size", itoa(cfg.DecodeTP),
				"--tp-ranks", itoa(rank), "--engine-id", "demo-decode", "--prefill-url", url,
				"--summary", r.path(fmt.Sprintf("decode-%d.json", rank)),
				"--report", r.path(fmt.Sprintf("decode-%d.requests", rank))}, model...)...)
			if err != nil {
				return err
			}
			decodes = append(decodes, d)
		}
	}
	s.Processes = len(r.children)
	workers := append([]*child{prefill}, decodes...)
	if err := r.wait(ctx, workers); err != nil {
		return err
	}
	for _, c := range workers {
		if c.err != nil {
			s.addFailure(c.failure())
		}
	}
	return r.collect(s, cfg.DecodeTP)
}

// wait waits for the workers, reporting progress from the decode ranks'
// request reports; once one failed, the others get exitGrace to finish.
func (r *procRun) wait(ctx context.Context, workers []*child) error {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var grace <-chan time.Time
	for {
		running, failed := 0, false
		for _, c := range workers {
			select {
			case <-c.done:
				failed = failed || c.err != nil
			default:
				running++
			}
		}
		r.progress()
		if running == 0 {
			return nil
		}
		if failed && grace == nil {
			grace = time.After(exitGrace)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("demo: %w (workers still running: %d)", ctx.Err(), running)
		case <-grace:
			for _, c := range workers {
				c.stop()
			}
		case <-tick.C:
		}
	}
}

// progress reports the request lines the decode ranks wrote so far (each
// writes one as a request finishes), reading only what is new.
func (r *procRun) progress() {
	if r.cfg.Progress == nil {
		return
	}
	if r.tails == nil {
		for rank := range r.cfg.DecodeTP {
			r.tails = append(r.tails, &lineTail{path: r.path(fmt.Sprintf("decode-%d.requests", rank))})
		}
	}
	done := 0
	for _, t := range r.tails {
		done += t.count()
	}
	r.cfg.Progress(min(done, r.cfg.total()), r.cfg.total())
}

// lineTail counts the lines of a file another process appends to,
// reading each byte once.
type lineTail struct {
	path  string
	f     *os.File // nil until the file exists
	lines int
	buf   []byte
}

// count reads what was appended since the last call and returns the lines
// so far.
func (t *lineTail) count() int {
	if t.f == nil {
		f, err := os.Open(t.path)
		if err != nil {
			return 0 // not created yet
		}
		t.f, t.buf = f, make([]byte, 64<<10)
	}
	for {
		n, err := t.f.Read(t.buf)
		t.lines += bytes.Count(t.buf[:n], []byte("\n"))
		if n == 0 || err != nil {
			return t.lines
		}
	}
}

func (t *lineTail) close() {
	if t.f != nil {
		t.f.Close()
	}
}

// collect reads the workers' summaries and request reports into s.
func (r *procRun) collect(s *Summary, ranks int) error {
	// Each worker process measured its own threads (MeasureCPU); one that
	// wrote no summary counts as not reported.
	cpus := make([]*schedstat.Usage, 1+ranks)
	if r.cfg.Style == "sglang" {
		p, ds := readSummaries[pushworker.Summary, pushworker.Summary](r, s, ranks)
		s.addPush(p, ds)
		if p != nil {
			cpus[0] = p.CPU
		}
		for i, d := range ds {
			cpus[1+i] = d.CPU
		}
		s.sumWorkerCPU(cpus, " (the bootstrap server's not counted)")
	} else {
		p, ds := readSummaries[pullworker.PrefillSummary, pullworker.DecodeSummary](r, s, ranks)
		s.addPull(p, ds)
		if p != nil {
			cpus[0] = p.CPU
		}
		for i, d := range ds {
			cpus[1+i] = d.CPU
		}
		s.sumWorkerCPU(cpus, "")
	}
	t := newTally()
	for rank := range ranks {
		f, err := os.Open(r.path(fmt.Sprintf("decode-%d.requests", rank)))
		if err != nil {
			s.addFailure(fmt.Sprintf("decode rank %d wrote no request report", rank))
			continue
		}
		err = t.addReport(f)
		f.Close()
		if err != nil {
			s.addFailure(fmt.Sprintf("decode rank %d: %v", rank, err))
		}
	}
	t.apply(s, ranks)
	return nil
}

// readSummaries reads the prefill's and the decode ranks' JSON summaries
// (nil or absent for a worker that wrote none or a broken one, which s
// then names) and keeps them raw in s.Workers.
func readSummaries[P, D any](r *procRun, s *Summary, ranks int) (*P, []*D) {
	prefill := readSummary[P](r, s, "prefill.json")
	var decodes []*D
	for rank := range ranks {
		if d := readSummary[D](r, s, fmt.Sprintf("decode-%d.json", rank)); d != nil {
			decodes = append(decodes, d)
		}
	}
	return prefill, decodes
}

func readSummary[T any](r *procRun, s *Summary, name string) *T {
	b, err := os.ReadFile(r.path(name))
	b = bytes.TrimSpace(b)
	if err != nil || len(b) == 0 {
		s.addFailure(fmt.Sprintf("no summary %s", name))
		return nil
	}
	s.Workers = append(s.Workers, json.RawMessage(b))
	v := new(T)
	if err := json.Unmarshal(b, v); err != nil {
		s.addFailure(fmt.Sprintf("summary %s: %v", name, err))
		return nil
	}
	return v
}

// prefixWriter prefixes every line written to w (workers' logs).
type prefixWriter struct {
	mu      sync.Mutex
	w       io.Writer
	prefix  string
	midLine bool
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []byte
	for _, c := range b {
		if !p.midLine {
			out = append(out, p.prefix...)
		}
		out = append(out, c)
		p.midLine = c != '\n'
	}
	if _, err := p.w.Write(out); err != nil {
		return 0, err
	}
	return len(b), nil
}
