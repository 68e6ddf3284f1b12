package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/demo/pushworker"
	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
)

// Interop: a Python peer that builds and parses SGLang's messages with
// SGLang's field layouts (host/push/testdata/sglang_peer.py, Debian's
// python3-zmq, python3-msgpack and python3-numpy), owning memory and an agent on the
// fake plugin through ctypes, talks to a kvhost prefill (as SGLang decode)
// and to a kvhost decode (as SGLang prefill), in both wire variants. Bytes
// are checked with kvpool's formula on the receiving side.

const python = "/usr/bin/python3"

func requirePython(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(python); err != nil {
		t.Fatalf("%s is needed, with python3-zmq, python3-numpy and python3-msgpack (scripts/install-test-deps.sh): %v", python, err)
	}
	if out, err := exec.Command(python, "-c", "import zmq, numpy, msgpack").CombinedOutput(); err != nil {
		t.Fatalf("python3-zmq, python3-numpy and python3-msgpack are needed (scripts/install-test-deps.sh): %v\n%s", err, out)
	}
}

// interopShape is the model both sides use (TP 1, one rank each).
var interopShape = pushworker.Shape{Layers: 3, KVHeads: 2, HeadBytes: 24, PageSize: 4, AuxItemLen: 40}

func interopGeometry(pages, auxSlots int) kvpool.Geometry {
	return kvpool.Geometry{Attention: kvpool.MHA, Order: kvpool.KThenV, Layers: interopShape.Layers, Pages: pages,
		PageSize: interopShape.PageSize, TotalHeads: interopShape.KVHeads, TPSize: 1, HeadBytes: interopShape.HeadBytes,
		AuxItems: auxSlots, AuxItemLen: interopShape.AuxItemLen}
}

type pyRequest struct {
	Room   uint64  `json:"room"`
	Tokens int     `json:"tokens"`
	Pages  []int32 `json:"pages,omitempty"`
	Aux    int     `json:"aux"`
}

type pyResult struct {
	Room   uint64  `json:"room"`
	OK     bool    `json:"ok"`
	Reason string  `json:"reason"`
	Pages  []int32 `json:"pages"`
	Aux    int     `json:"aux"`
}

// pySpec is the spec of a Python peer (host/push/testdata/sglang_peer.py): its role,
// variant, fake plugin library, bootstrap server, pool geometry and
// requests, plus the role's own files in extra.
func pySpec(role, variant, lib, bootstrap string, g kvpool.Geometry, reqs []pyRequest, extra map[string]any) map[string]any {
	spec := map[string]any{
		"role": role, "variant": variant, "plugin": lib, "bootstrap": bootstrap,
		"layers": g.Layers, "page_size": g.PageSize, "item_len": g.ItemLen(), "pages": g.Pages,
		"aux_item_len": g.AuxItemLen, "aux_slots": g.AuxItems, "requests": reqs,
	}
	for k, v := range extra {
		spec[k] = v
	}
	return spec
}

func runPython(t *testing.T, ctx context.Context, spec map[string]any) (*exec.Cmd, chan error) {
	t.Helper()
	dir := t.TempDir()
	raw, _ := json.Marshal(spec)
	path := filepath.Join(dir, "spec.json")
	if err := os.WriteFile(path, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	script, _ := filepath.Abs("../../../push/testdata/sglang_peer.py")
	cmd := exec.CommandContext(ctx, python, script, path)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	return cmd, done
}

func fakePath(t *testing.T) string {
	t.Helper()
	p, err := plugin.Find("fake", plugin.SearchDirs(""))
	if err != nil {
		t.Fatalf("the fake plugin is needed (make plugin-fake): %v", err)
	}
	abs, _ := filepath.Abs(p)
	return abs
}

func startBootstrap(t *testing.T) *bootstrap.Running {
	srv, err := bootstrap.NewServer().Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		srv.Close(ctx)
	})
	return srv
}

// TestPythonDecode: SGLang-layout decode (Python) <- kvhost prefill.
func TestPythonDecode(t *testing.T) {
	requirePython(t)
	for _, variant := range []string{"nixl", "mori"} {
		t.Run(variant, func(t *testing.T) {
			lib := fakePath(t)
			srv := startBootstrap(t)
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			wl := pushworker.Workload{Seed: 5, Requests: 12, MinTokens: 1, MaxTokens: 30, ChunkPages: 3}
			reqs := wl.List(interopShape.PageSize)
			var pyReqs []pyRequest
			totalPages := 0
			for _, r := range reqs {
				pyReqs = append(pyReqs, pyRequest{Room: r.Room, Tokens: r.Tokens})
				totalPages += (r.Tokens + interopShape.PageSize - 1) / interopShape.PageSize
			}
			const auxSlots = 17 // the prefill worker's: concurrency 16 + 1
			g := interopGeometry(totalPages+4, auxSlots)
			dir := t.TempDir()
			out, dump := filepath.Join(dir, "out.json"), filepath.Join(dir, "mem.bin")
			_, pyDone := runPython(t, ctx, pySpec("decode", variant, lib, srv.Addr(), g, pyReqs, map[string]any{
				"out": out, "dump": dump}))
			pl := faketest.Plugin(t)
			v, _ := push.ParseVariant(variant)
			ps, err := pushworker.RunPrefill(ctx, pushworker.PrefillOptions{BootstrapAddr: srv.Addr(), Common: pushworker.Common{
				Plugin: pl, Variant: v, Shape: interopShape, Workload: wl, TPSize: 1, Concurrency: 16}})
			if err != nil {
				t.Fatal(err)
			}
			if err := <-pyDone; err != nil {
				t.Fatalf("python decode: %v", err)
			}
			if !ps.OKExit() || ps.OK != len(reqs) {
				t.Fatalf("kvhost prefill: ok %d of %d: %+v", ps.OK, len(reqs), ps.Failures)
			}
			// Check what the Python decode received, with kvpool's formula.
			var res struct{ Results []pyResult }
			raw, _ := os.ReadFile(out)
			if err := json.Unmarshal(raw, &res); err != nil {
				t.Fatal(err)
			}
			mem, _ := os.ReadFile(dump)
			pool, err := kvpool.New(g)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			if len(mem) != len(pool.Bytes()) {
				t.Fatalf("dump of %d bytes, pool of %d", len(mem), len(pool.Bytes()))
			}
			copy(pool.Bytes(), mem)
			if len(res.Results) != len(reqs) {
				t.Fatalf("%d results for %d requests", len(res.Results), len(reqs))
			}
			for i, r := range res.Results {
				if !r.OK {
					t.Fatalf("room %d failed on the Python decode: %s", r.Room, r.Reason)
				}
				if err := pool.Verify(kvpool.Tokens{Request: r.Room, Pages: r.Pages, Count: reqs[i].Tokens}); err != nil {
					t.Fatal(err)
				}
				if err := pool.VerifyAux(r.Room, r.Aux); err != nil {
					t.Fatal(err)
				}
			}
			t.Logf("%s: Python decode received %d requests from kvhost prefill, every byte checked", variant, len(reqs))
		})
	}
}

// TestPythonPrefill: kvhost decode <- SGLang-layout prefill (Python).
func TestPythonPrefill(t *testing.T) {
	requirePython(t)
	for _, variant := range []string{"nixl", "mori"} {
		t.Run(variant, func(t *testing.T) {
			lib := fakePath(t)
			srv := startBootstrap(t)
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			wl := pushworker.Workload{Seed: 9, Requests: 12, MinTokens: 1, MaxTokens: 30, ChunkPages: 0}
			reqs := wl.List(interopShape.PageSize)
			// The prefill's memory: kvpool's bytes for every request, written
			// here and loaded by the Python prefill.
			total := 0
			for _, r := range reqs {
				total += (r.Tokens + interopShape.PageSize - 1) / interopShape.PageSize
			}
			g := interopGeometry(total, len(reqs))
			pool, err := kvpool.New(g)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			var pyReqs []pyRequest
			next := int32(0)
			for i, r := range reqs {
				n := (r.Tokens + g.PageSize - 1) / g.PageSize
				pr := pyRequest{Room: r.Room, Tokens: r.Tokens, Aux: i}
				for k := 0; k < n; k++ {
					pr.Pages = append(pr.Pages, next)
					next++
				}
				// Scatter them: reverse every other request's pages.
				if i%2 == 1 {
					for a, b := 0, len(pr.Pages)-1; a < b; a, b = a+1, b-1 {
						pr.Pages[a], pr.Pages[b] = pr.Pages[b], pr.Pages[a]
					}
				}
				if err := pool.Fill(kvpool.Tokens{Request: r.Room, Pages: pr.Pages, Count: r.Tokens}); err != nil {
					t.Fatal(err)
				}
				if err := pool.FillAux(r.Room, i); err != nil {
					t.Fatal(err)
				}
				pyReqs = append(pyReqs, pr)
			}
			dir := t.TempDir()
			content, out := filepath.Join(dir, "content.bin"), filepath.Join(dir, "out.json")
			if err := os.WriteFile(content, pool.Bytes(), 0o644); err != nil {
				t.Fatal(err)
			}
			_, pyDone := runPython(t, ctx, pySpec("prefill", variant, lib, srv.Addr(), g, pyReqs, map[string]any{
				"content": content, "out": out}))
			pl := faketest.Plugin(t)
			v, _ := push.ParseVariant(variant)
			ds, err := pushworker.RunDecode(ctx, pushworker.DecodeOptions{BootstrapAddr: srv.Addr(), Common: pushworker.Common{
				Plugin: pl, Variant: v, Shape: interopShape, Workload: wl, TPSize: 1, Concurrency: 4}})
			if err != nil {
				t.Fatal(err)
			}
			if err := <-pyDone; err != nil {
				t.Fatalf("python prefill: %v", err)
			}
			if !ds.OKExit() || ds.OK != len(reqs) || ds.Bytes == 0 {
				t.Fatalf("kvhost decode: ok %d of %d, verify errors %d: %+v", ds.OK, len(reqs), ds.VerifyErrors, ds.Failures)
			}
			t.Logf("%s: kvhost decode verified %d requests (%d bytes) from the Python prefill", variant, ds.OK, ds.Bytes)
		})
	}
}
