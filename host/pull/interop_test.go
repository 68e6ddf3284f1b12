package pull

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
)

const python = "/usr/bin/python3"

// needPython fails unless Debian's python3 with zmq and msgpack is there
// (scripts/install-test-deps.sh installs them).
func needPython(t *testing.T) {
	t.Helper()
	out, err := exec.Command(python, "-c", "import zmq, msgpack").CombinedOutput()
	if err != nil {
		t.Fatalf("%s with python3-zmq and python3-msgpack is needed (scripts/install-test-deps.sh): %v\n%s", python, err, out)
	}
}

type peerMetadata struct {
	EngineID         string   `json:"engine_id"`
	AgentMetadata    string   `json:"agent_metadata"` // hex
	KVCachesBaseAddr []uint64 `json:"kv_caches_base_addr"`
	DeviceID         int      `json:"device_id"`
	NumBlocks        int      `json:"num_blocks"`
	BlockLens        []int    `json:"block_lens"`
	KVCacheLayout    string   `json:"kv_cache_layout"`
	BlockSize        int      `json:"block_size"`
}

type peerPayload struct {
	CompatibilityHash string       `json:"compatibility_hash"`
	Metadata          peerMetadata `json:"metadata"`
	ByteExact         bool         `json:"byte_exact,omitempty"`
}

// TestInteropPythonFetchesGoPrefill: a vLLM-shaped Python REQ client
// fetches and decodes the Go prefill's handshake of every rank.
func TestInteropPythonFetchesGoPrefill(t *testing.T) {
	needPython(t)
	g := geom{hnd: true, layers: 3, heads: 4, headBytes: 16, tp: 2, blockSize: 16, blocks: 40}
	ps := newPrefillSide(t, g, "prefill-py", nil)
	for rank := range g.tp {
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		out, err := exec.CommandContext(ctx, python, "testdata/vllm_nixl_peer.py", "req", ps.sender.Endpoint(), strconv.Itoa(rank)).Output()
		cancel()
		if err != nil {
			t.Fatalf("rank %d: %v\n%s", rank, err, stderrOf(err))
		}
		var got peerPayload
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		blob, err := ps.agents[rank].LocalMetadata()
		if err != nil {
			t.Fatal(err)
		}
		want := peerMetadata{EngineID: "prefill-py", AgentMetadata: hex.EncodeToString(blob), NumBlocks: g.blocks,
			KVCacheLayout: "HND", BlockSize: g.blockSize}
		for _, r := range ps.pools[rank].Regions() {
			want.KVCachesBaseAddr = append(want.KVCachesBaseAddr, r.Addr)
			want.BlockLens = append(want.BlockLens, int(r.Len)/g.blocks)
		}
		if got.CompatibilityHash != testHash || !reflect.DeepEqual(got.Metadata, want) {
			t.Fatalf("rank %d:\ngot  %+v\nwant %+v", rank, got, want)
		}
		if !got.ByteExact {
			t.Fatalf("rank %d: the Go bytes differ from msgspec's encoding of the same values", rank)
		}
	}
}

// TestInteropGoDecodeFromPythonRouter: a Go decode handshakes with a
// Python ROUTER serving vLLM-shaped bytes (describing a Go prefill agent
// of this process), then reads and verifies the KV and notifies.
func TestInteropGoDecodeFromPythonRouter(t *testing.T) {
	needPython(t)
	g := geom{hnd: true, layers: 2, heads: 4, headBytes: 16, tp: 2, blockSize: 8, blocks: 32}
	// The prefill: agents and filled pools, but no Sender.
	var spec = map[string]peerPayload{}
	var notifs []func() []string
	blocks := []int32{9, 4, 17}
	for rank := range g.tp {
		p := g.pool(t, rank)
		if err := p.Fill(kvpool.Tokens{Request: 77, Pages: blocks, Count: 20}); err != nil {
			t.Fatal(err)
		}
		a := newAgent(t, "pyprefill")
		c := cacheOf(p, LayoutHND)
		regs, err := register(a, &c)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { a.Deregister(regs...) })
		blob, err := a.LocalMetadata()
		if err != nil {
			t.Fatal(err)
		}
		md := metadataOf("py-engine", blob, &c)
		spec[strconv.Itoa(rank)] = peerPayload{CompatibilityHash: testHash, Metadata: peerMetadata{
			EngineID: md.EngineID, AgentMetadata: hex.EncodeToString(md.AgentMetadata), KVCachesBaseAddr: md.KVCachesBaseAddr,
			DeviceID: md.DeviceID, NumBlocks: md.NumBlocks, BlockLens: md.BlockLens, KVCacheLayout: md.KVCacheLayout, BlockSize: md.BlockSize}}
		notifs = append(notifs, func() []string {
			ns, err := a.Notifs()
			if err != nil {
				t.Error(err)
			}
			var out []string
			for _, n := range ns {
				out = append(out, string(n.Msg))
			}
			return out
		})
	}
	specPath := filepath.Join(t.TempDir(), "spec.json")
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(specPath, b, 0o600); err != nil {
		t.Fatal(err)
	}
	// Decode TP 4 reads prefill TP 2: four handshakes, two per prefill rank.
	dg := g
	dg.tp = 4
	ds := newDecodeSide(t, dg, nil)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	cmd := exec.CommandContext(ctx, python, "testdata/vllm_nixl_peer.py", "router", specPath, strconv.Itoa(dg.tp))
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatal(err)
	}
	// The router keeps answering after its n replies: kill it, then reap it.
	defer func() { cancel(); cmd.Wait() }()
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || !strings.HasPrefix(lines.Text(), "PORT ") {
		t.Fatalf("python router did not start: %q", lines.Text())
	}
	port, _ := strconv.Atoi(strings.TrimPrefix(lines.Text(), "PORT "))
	params := KVTransferParams{DoRemotePrefill: true, RemoteBlockIDs: blocks, RemoteEngineID: "py-engine",
		RemoteRequestID: "py-req", RemoteHost: "127.0.0.1", RemotePort: port, TPSize: 2}
	local := []int32{30, 1, 12}
	for rank, rx := range ds.rx {
		res := wait(t, rx.Load(LoadRequest{RequestID: "d", LocalBlockIDs: local, Params: params}))
		if res.Err != nil {
			t.Fatalf("rank %d: %v", rank, res.Err)
		}
		if err := ds.pools[rank].Verify(kvpool.Tokens{Request: 77, Pages: local, Count: 20}); err != nil {
			t.Fatalf("rank %d: %v", rank, err)
		}
	}
	if !lines.Scan() || lines.Text() != "OK 4" {
		t.Fatalf("python router: %q", lines.Text())
	}
	for rank := range g.tp {
		var got []string
		eventually(t, "notifications", 5*time.Second, func() bool {
			got = append(got, notifs[rank]()...)
			return len(got) >= 2
		})
		if !reflect.DeepEqual(got, []string{"py-req:2", "py-req:2"}) {
			t.Fatalf("prefill rank %d notified %q", rank, got)
		}
	}
}

func stderrOf(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}
