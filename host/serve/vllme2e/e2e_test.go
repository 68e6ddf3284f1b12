package vllme2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/pullworker"
	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/serve"
	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

func TestMain(m *testing.M) {
	if os.Getenv(engineEnv) != "" {
		os.Exit(runEngine())
	}
	os.Exit(m.Run())
}

// model is what every test engine serves (the compatibility factors).
var model = client.VLLMCompat{VLLMVersion: "0.13.0", NixlConnectorVersion: vllm.ConnectorVersion, Model: "kvhost/vllme2e",
	DType: "torch.bfloat16", NumKVHeads: 4, HeadSize: 8, NumHiddenLayers: 3, AttnBackendName: "FLASH_ATTN", CacheDType: "auto"}

func engineCfg(role, engine string, tp int, ranks []int, blocks int) engineConfig {
	return engineConfig{Role: role, EngineID: engine, TPSize: tp, Ranks: ranks, Blocks: blocks, BlockSize: 4,
		Layers: 3, Heads: 4, HeadBytes: 16, Compat: model}
}

// sidecar starts a kvhost serve server on an ipc:// socket.
func sidecar(t *testing.T) *serve.Server {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvsv")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	s, err := serve.New(serve.Config{Control: "ipc://" + filepath.Join(dir, "ctl.sock"), Plugin: faketest.Plugin(t), Backend: "fake"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s.Close(ctx)
	})
	return s
}

// engineProc is a running test engine process.
type engineProc struct {
	t        *testing.T
	cmd      *exec.Cmd
	in       io.WriteCloser
	out      chan answer
	endpoint string
}

func startEngine(t *testing.T, srv *serve.Server, cfg engineConfig) *engineProc {
	t.Helper()
	cfg.Endpoint = srv.Endpoint()
	b, _ := json.Marshal(cfg)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), engineEnv+"="+string(b))
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// An engine the test kills (or that fails) cannot unlink its pools:
	// remove what it left once it is gone (registered first, so it runs
	// after e.stop).
	pid := cmd.Process.Pid
	t.Cleanup(func() { removeSHM(t, fmt.Sprintf("kvhost-vllme2e-%d-*", pid)) })
	e := &engineProc{t: t, cmd: cmd, in: in, out: make(chan answer, 16)}
	go func() {
		defer close(e.out)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(nil, 16<<20)
		for sc.Scan() {
			var a answer
			if err := json.Unmarshal(sc.Bytes(), &a); err != nil {
				a = answer{Err: fmt.Sprintf("engine said %q", sc.Text())}
			}
			e.out <- a
		}
	}()
	t.Cleanup(e.stop)
	a := e.answer()
	if !a.Ready {
		t.Fatalf("engine %s %s did not start: %s", cfg.Role, cfg.EngineID, a.Err)
	}
	e.endpoint = a.Endpoint
	return e
}

func (e *engineProc) answer() answer {
	e.t.Helper()
	select {
	case a, ok := <-e.out:
		if !ok {
			e.t.Fatal("engine exited")
		}
		return a
	case <-time.After(90 * time.Second):
		e.t.Fatal("engine did not answer within 90 s")
	}
	return answer{}
}

func (e *engineProc) do(cmd command) answer {
	e.t.Helper()
	b, _ := json.Marshal(cmd)
	if _, err := e.in.Write(append(b, '\n')); err != nil {
		e.t.Fatal(err)
	}
	return e.answer()
}

// stop asks the engine to exit and waits (killing it after 10 s).
func (e *engineProc) stop() {
	if e.cmd.ProcessState != nil {
		return
	}
	b, _ := json.Marshal(command{Op: "exit"})
	e.in.Write(append(b, '\n'))
	e.in.Close()
	done := make(chan struct{})
	go func() { e.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		e.cmd.Process.Kill()
		<-done
	}
}

// kill kills the engine at once (SIGKILL): its connections drop.
func (e *engineProc) kill() {
	e.cmd.Process.Kill()
	e.cmd.Wait()
}

func dial(t *testing.T, srv *serve.Server) *client.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := client.Dial(ctx, srv.Endpoint(), client.Options{Name: "vllme2e-scheduler"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func released(t *testing.T, c *client.Client, engine, req, reason string) {
	t.Helper()
	select {
	case e := <-c.Events():
		r, ok := e.AsReleased()
		if !ok || r.EngineID != engine || r.RequestID != req || r.Reason != reason {
			t.Fatalf("event %s %+v, want released %s %s %s", e.Name, r, engine, req, reason)
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("no released %s %s within 60 s", req, reason)
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// asJSON is kv_transfer_params as the proxy passes them on, with
// changes.
func asJSON(t *testing.T, c *client.Client, ctx context.Context, engine, req string, blocks []int32) map[string]any {
	t.Helper()
	p, err := c.Hold(ctx, engine, req, blocks)
	if err != nil {
		t.Fatal(err)
	}
	return msgpackToJSON(p).(map[string]any)
}

func with(p map[string]any, k string, v any) map[string]any {
	q := map[string]any{}
	for kk, vv := range p {
		q[kk] = vv
	}
	q[k] = v
	return q
}

// TestVLLMSidecarPull: a vLLM prefill engine (TP 1) and a vLLM decode
// engine (TP 2), each a process owning its KV in POSIX shared memory and
// driving its own sidecar; the scheduler (this test) holds the request's
// blocks on the prefill sidecar and hands the kv_transfer_params to the
// decode, which reads them and checks every byte in its own memory.
// Then the failures: params naming an engine the side channel is not,
// params of the wrong type, a hold nobody reads (abort timeout), and the
// prefill engine killed while a request is held.
func TestVLLMSidecarPull(t *testing.T) {
	ctx := ctxT(t)
	ps, ds := sidecar(t), sidecar(t)
	pe := startEngine(t, ps, engineCfg("prefill", "P", 1, []int{0}, 64))
	if pe.endpoint == "" {
		t.Fatal("the prefill engine's side channel is not open")
	}
	de := startEngine(t, ds, engineCfg("decode", "D", 2, []int{0, 1}, 32))
	sched := dial(t, ps)

	prefillBlocks := []int32{33, 4, 60, 12, 7}
	local := []int32{3, 30, 0, 17, 9}
	const tokens = 19
	if a := pe.do(command{Op: "fill", Seed: 42, Blocks: prefillBlocks, Tokens: tokens}); a.Err != "" {
		t.Fatal(a.Err)
	}
	params := asJSON(t, sched, ctx, "P", "req-1", prefillBlocks)
	a := de.do(command{Op: "read", RequestID: "dreq-1", Params: params, Blocks: local, Seed: 42, Tokens: tokens})
	if a.Err != "" || !a.OK || !a.Verified || a.Bytes == 0 {
		t.Fatalf("read: %+v", a)
	}
	released(t, sched, "P", "req-1", "notified")

	// Reads that cannot pull: every block invalid on every rank.
	params = asJSON(t, sched, ctx, "P", "req-2", prefillBlocks)
	for _, bad := range []struct {
		name   string
		params map[string]any
	}{
		{"unknown engine", with(params, "remote_engine_id", "no-such-engine")},
		{"remote_port of the wrong type", with(params, "remote_port", "5600")},
		{"nothing held", with(params, "do_remote_prefill", false)},
	} {
		a := de.do(command{Op: "read", RequestID: "bad-" + bad.name, Params: bad.params, Blocks: local})
		if a.Err != "" || a.OK || len(a.Invalid) != 2 {
			t.Fatalf("%s: %+v", bad.name, a)
		}
		for i, inv := range a.Invalid {
			if !slices.Equal(inv, local) || a.Reasons[i] == "" {
				t.Fatalf("%s: rank %d: invalid %v reason %q", bad.name, i, inv, a.Reasons[i])
			}
		}
		t.Logf("%s: %s", bad.name, a.Reasons[0])
	}
	if err := sched.Release(ctx, "P", "req-2"); err != nil {
		t.Fatal(err)
	}
	released(t, sched, "P", "req-2", "aborted")

	// A hold nobody reads: released "timeout" after the engine's abort
	// timeout.
	tc := engineCfg("prefill", "T", 1, []int{0}, 16)
	tc.AbortMs = 300
	startEngine(t, ps, tc)
	schedT := dial(t, ps)
	if _, err := schedT.Hold(ctx, "T", "req-t", []int32{1, 2}); err != nil {
		t.Fatal(err)
	}
	released(t, schedT, "T", "req-t", "timeout")

	// The prefill engine dies (SIGKILL) while a request is held: its
	// sidecar sees the connection drop, closes the engine's side channel
	// and releases the request "closed" to the scheduler.
	if _, err := sched.Hold(ctx, "P", "req-3", prefillBlocks); err != nil {
		t.Fatal(err)
	}
	pe.kill()
	released(t, sched, "P", "req-3", "closed")
	if _, err := sched.Hold(ctx, "P", "req-4", prefillBlocks); !client.IsCode(err, serve.CodeUnknown) {
		t.Fatalf("hold on the dead engine: %v", err)
	}
	// The decode engine dies too: both sidecars end its sessions.
	de.kill()
	for deadline := time.Now().Add(30 * time.Second); ds.Sessions() != 0; {
		if time.Now().After(deadline) {
			t.Fatalf("decode sidecar still has %d sessions", ds.Sessions())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestVLLMSidecarInterop: a decode engine behind a sidecar reads from
// today's `kvhost prefill --style vllm` worker, which is no sidecar: it
// runs its own pull.Sender over a synthetic pool in its own process. Its
// HTTP API hands out vLLM's kv_transfer_params (JSON), as a proxy would;
// the decode engine reads them through its sidecar and checks every byte
// against what the worker filled (pullworker.KVSeed of the request id),
// and the worker reports the request released "notified": the wire
// between them is vLLM's, unchanged.
func TestVLLMSidecarInterop(t *testing.T) {
	bin, err := filepath.Abs("../../../bin/kvhost")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("bin/kvhost is needed (make all): %v", err)
	}
	dir := t.TempDir()
	urlFile, report := filepath.Join(dir, "api"), filepath.Join(dir, "report")
	cmd := exec.Command(bin, "--backend", "fake", "prefill", "--style", "vllm", "--requests", "0",
		"--api-port", "0", "--api-url-file", urlFile, "--side-channel-port", "0", "--tp-size", "1",
		"--layers", "3", "--kv-heads", "4", "--head-dim", "8", "--dtype-bytes", "2", "--page-size", "4", "--pages", "64",
		"--mem-kinds", "dram", "--model", model.Model, "--engine-id", "legacy-prefill", "--report", report, "--summary", "")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	var api string
	for deadline := time.Now().Add(60 * time.Second); ; {
		if b, err := os.ReadFile(urlFile); err == nil && len(b) > 0 {
			api = strings.TrimSpace(string(b))
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("kvhost prefill --style vllm did not serve within 60 s")
		}
		time.Sleep(20 * time.Millisecond)
	}

	ds := sidecar(t)
	de := startEngine(t, ds, engineCfg("decode", "D", 2, []int{0, 1}, 32))
	const id, tokens = "interop-1", 21
	body, _ := json.Marshal(map[string]any{"request_id": id, "num_tokens": tokens, "kv_transfer_params": map[string]any{"do_remote_decode": true}})
	resp, err := http.Post(api+pullworker.PrefillPath, "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	var pr struct {
		KVTransferParams map[string]any `json:"kv_transfer_params"`
	}
	err = json.NewDecoder(resp.Body).Decode(&pr)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("prefill API: %s %v", resp.Status, err)
	}
	local := []int32{5, 31, 0, 16, 22, 8}
	a := de.do(command{Op: "read", RequestID: "dreq-interop", Params: pr.KVTransferParams, Blocks: local,
		Seed: pullworker.KVSeed(id), Tokens: tokens})
	if a.Err != "" || !a.OK || !a.Verified {
		t.Fatalf("read from kvhost prefill: %+v", a)
	}
	// The worker released the request because both decode ranks notified.
	for deadline := time.Now().Add(30 * time.Second); ; {
		b, _ := os.ReadFile(report)
		var r pullworker.ReleaseReport
		if json.Unmarshal(bytes.TrimSpace(b), &r) == nil && r.RequestID == id {
			if r.Released != "notified" || r.Notifications != 2 {
				t.Fatalf("worker report %+v, want notified by 2", r)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the worker did not release %s within 30 s (report %q)", id, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestVLLMSidecarHandshakeFromPython: a vLLM-shaped Python client
// (host/pull/testdata/vllm_nixl_peer.py: vLLM's _nixl_handshake with
// msgspec's decoding rules) fetches every rank's handshake from the side
// channel of a TP 2 engine whose ranks come from two connections; the
// compatibility hash it receives is the one Python computes from the
// factors the engine sent (vLLM's hash_factors: sha256 of
// json.dumps(factors, sort_keys=True)).
func TestVLLMSidecarHandshakeFromPython(t *testing.T) {
	const python = "/usr/bin/python3"
	if out, err := exec.Command(python, "-c", "import zmq, msgpack").CombinedOutput(); err != nil {
		t.Fatalf("%s with python3-zmq and python3-msgpack is needed (scripts/install-test-deps.sh): %v\n%s", python, err, out)
	}
	ps := sidecar(t)
	startEngine(t, ps, engineCfg("prefill", "P2", 2, []int{0}, 24))
	pe1 := startEngine(t, ps, engineCfg("prefill", "P2", 2, []int{1}, 24))
	if pe1.endpoint == "" {
		t.Fatal("the engine's side channel did not open with its second rank")
	}
	factors, _ := json.Marshal(map[string]any{
		"vllm_version": model.VLLMVersion, "nixl_connector_version": model.NixlConnectorVersion, "model": model.Model,
		"dtype": model.DType, "num_kv_heads": model.NumKVHeads, "head_size": model.HeadSize,
		"num_hidden_layers": model.NumHiddenLayers, "attn_backend_name": model.AttnBackendName, "cache_dtype": model.CacheDType})
	want, err := exec.Command(python, "-c", "import hashlib, json, sys; "+
		"print(hashlib.sha256(json.dumps(json.loads(sys.argv[1]), sort_keys=True).encode()).hexdigest())", string(factors)).Output()
	if err != nil {
		t.Fatal(err)
	}
	for rank := range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		out, err := exec.CommandContext(ctx, python, "../../pull/testdata/vllm_nixl_peer.py", "req", pe1.endpoint, fmt.Sprint(rank)).Output()
		cancel()
		if err != nil {
			t.Fatalf("rank %d: %v", rank, err)
		}
		var got struct {
			Hash     string `json:"compatibility_hash"`
			Metadata struct {
				EngineID  string   `json:"engine_id"`
				NumBlocks int      `json:"num_blocks"`
				BlockSize int      `json:"block_size"`
				Layout    string   `json:"kv_cache_layout"`
				BaseAddrs []uint64 `json:"kv_caches_base_addr"`
				BlockLens []int    `json:"block_lens"`
			} `json:"metadata"`
		}
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("rank %d: %v: %s", rank, err, out)
		}
		md := got.Metadata
		if got.Hash != strings.TrimSpace(string(want)) || md.EngineID != "P2" || md.NumBlocks != 24 || md.BlockSize != 4 ||
			md.Layout != "HND" || len(md.BaseAddrs) != 6 || len(md.BlockLens) != 6 || md.BlockLens[0] != 4*2*16 {
			t.Fatalf("rank %d: %s (want hash %s)", rank, out, want)
		}
	}
}

// removeSHM removes the shared-memory files under /dev/shm matching
// pattern, which a killed engine process leaves behind.
func removeSHM(t *testing.T, pattern string) {
	names, err := filepath.Glob(filepath.Join("/dev/shm", pattern))
	if err != nil {
		t.Error(err)
	}
	for _, n := range names {
		if err := os.Remove(n); err != nil && !os.IsNotExist(err) {
			t.Error(err)
		}
	}
}
