package pull

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/zmq"
	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// vllm_peer.py also serves the codec tests of host/wire/vllm.
const peerScript = "../wire/vllm/testdata/vllm_peer.py"

var quietLog = slog.New(slog.DiscardHandler)

// sampleMetadata is host/wire/vllm's test metadata.
func sampleMetadata() *vllm.AgentMetadata {
	return &vllm.AgentMetadata{
		EngineID:         "prefill-engine-0",
		AgentMetadata:    []byte("\x00nixl agent md\xff"),
		KVCachesBaseAddr: []uint64{0x7f0000000000, 0x7f0000100000, 1<<64 - 1},
		DeviceID:         2,
		NumBlocks:        12345,
		BlockLens:        []int{4096, 4096, 2048},
		KVCacheLayout:    "HND",
		BlockSize:        16,
	}
}

func quietZMQ() []zmq.Option { return []zmq.Option{zmq.WithLogger(quietLog)} }

// prefill serves two TP ranks.
func startServer(t *testing.T, hash string) (*HandshakeServer, map[int]*vllm.AgentMetadata) {
	t.Helper()
	mds := map[int]*vllm.AgentMetadata{}
	payloads := map[int][]byte{}
	for rank := range 2 {
		md := sampleMetadata() // includes a base address of 2^64-1
		md.DeviceID = rank
		md.KVCachesBaseAddr[0] += uint64(0x1000 * rank)
		mds[rank] = md
		payloads[rank] = vllm.NewHandshakePayload(hash, md).Encode()
	}
	s, err := ListenHandshake("tcp://127.0.0.1:0", HandshakeService{Payloads: payloads}, quietLog)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, mds
}

func expect(hash string) FetchOptions {
	return FetchOptions{Expect: vllm.Expect{LocalHash: hash, EnforceHash: true, EngineID: "prefill-engine-0"}, ZMQ: quietZMQ()}
}

func TestFetchHandshake(t *testing.T) {
	s, mds := startServer(t, "H")
	for rank, want := range mds {
		got, err := FetchHandshake(context.Background(), s.Endpoint(), rank, expect("H"))
		if err != nil {
			t.Fatalf("rank %d: %v", rank, err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("rank %d: %+v", rank, got)
		}
	}
	// Unknown rank: refused at once (empty reply), not after a timeout.
	start := time.Now()
	if _, err := FetchHandshake(context.Background(), s.Endpoint(), 7, expect("H")); !errors.Is(err, vllm.ErrMalformed) {
		t.Fatalf("unknown rank: %v", err)
	}
	if el := time.Since(start); el > time.Second {
		t.Fatalf("refusal took %v", el)
	}
	// Hash mismatch lists both hashes.
	_, err := FetchHandshake(context.Background(), s.Endpoint(), 0, expect("MINE"))
	if !errors.Is(err, vllm.ErrHashMismatch) || !strings.Contains(err.Error(), "Local: MINE, Remote: H") {
		t.Fatalf("mismatch: %v", err)
	}
}

// A dead prefill cannot hang decode: dead port fails at once, a peer that
// never answers fails at the timeout.
func TestFetchHandshakeTimeouts(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	dead := zmq.TCPEndpoint("127.0.0.1", ln.Addr().(*net.TCPAddr).Port)
	ln.Close()
	start := time.Now()
	if _, err := FetchHandshake(context.Background(), dead, 0, expect("H")); err == nil {
		t.Fatal("dead port succeeded")
	}
	if el := time.Since(start); el > time.Second {
		t.Fatalf("dead port took %v", el)
	}
	mute, err := zmq.ListenRouter("tcp://127.0.0.1:0", quietZMQ()...) // receives, never answers
	if err != nil {
		t.Fatal(err)
	}
	defer mute.Close()
	o := expect("H")
	o.Timeout = 300 * time.Millisecond
	start = time.Now()
	_, err = FetchHandshake(context.Background(), mute.Endpoint(), 0, o)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("mute peer: %v", err)
	}
	if el := time.Since(start); el < 250*time.Millisecond || el > 2*time.Second {
		t.Fatalf("mute peer failed after %v, want about 300ms", el)
	}
	if DefaultHandshakeTimeout != 5*time.Second {
		t.Fatal("vLLM's receive timeout is 5 s")
	}
}

// Many concurrent handshakes, each client connecting once (as vLLM does),
// with hostile requests mixed in: every honest client gets its metadata.
func TestHandshakeStorm(t *testing.T) {
	s, mds := startServer(t, "H")
	var wg sync.WaitGroup
	errc := make(chan error, 64)
	for w := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 25 {
				if w%6 == 0 && i%5 == 0 { // hostile: raw garbage request
					ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
					rep, err := zmq.Request(ctx, s.Endpoint(), [][]byte{[]byte("\xdd\xff\xff\xff\xff")}, quietZMQ()...)
					cancel()
					if err != nil || len(rep) != 1 || len(rep[0]) != 0 {
						errc <- fmt.Errorf("garbage request: %q %v", rep, err)
						return
					}
					continue
				}
				rank := (w + i) % 2
				md, err := FetchHandshake(context.Background(), s.Endpoint(), rank, expect("H"))
				if err != nil {
					errc <- err
					return
				}
				if !reflect.DeepEqual(md, mds[rank]) {
					errc <- fmt.Errorf("rank %d: wrong metadata", rank)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
}

// A request larger than any handshake request is refused while it is
// read: the peer is disconnected (its REQ gets no reply) without the
// server buffering or decoding it, and honest clients are still served.
func TestHandshakeOversizedRequest(t *testing.T) {
	s, mds := startServer(t, "H")
	for _, size := range []int{maxRequestMessage + 1, 8 << 20} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		rep, err := zmq.Request(ctx, s.Endpoint(), [][]byte{make([]byte, size)}, quietZMQ()...)
		cancel()
		if err == nil || errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("%d-byte request: reply %q, err %v; want the connection dropped", size, rep, err)
		}
	}
	md, err := FetchHandshake(context.Background(), s.Endpoint(), 1, expect("H"))
	if err != nil || !reflect.DeepEqual(md, mds[1]) {
		t.Fatalf("honest client after oversized requests: %v", err)
	}
}

func TestHandshakeServerClose(t *testing.T) {
	s, _ := startServer(t, "H")
	ep := s.Endpoint()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	o := expect("H")
	o.Timeout = 500 * time.Millisecond
	if _, err := FetchHandshake(context.Background(), ep, 0, o); err == nil {
		t.Fatal("fetch after Close succeeded")
	}
}

func peerPort(t *testing.T, p *zmqtest.Peer) int {
	t.Helper()
	var port int
	if _, err := fmt.Sscanf(p.Line(30*time.Second), "PORT %d", &port); err != nil {
		t.Fatal(err)
	}
	return port
}

// A Python REQ client with vLLM's message shapes fetches and decodes the
// Go server's handshake; the bytes are exactly msgspec's.
func TestInteropPythonFetchesFromGo(t *testing.T) {
	zmqtest.RequirePython(t, "zmq", "msgpack")
	s, mds := startServer(t, "H")
	for rank, want := range mds {
		peer := zmqtest.Start(t, peerScript, "req", s.Endpoint(), fmt.Sprint(rank))
		var got struct {
			Hash      string         `json:"compatibility_hash"`
			Metadata  map[string]any `json:"metadata"`
			ByteExact bool           `json:"byte_exact"`
		}
		d := json.NewDecoder(strings.NewReader(peer.Line(30 * time.Second)))
		d.UseNumber()
		if err := d.Decode(&got); err != nil {
			t.Fatal(err)
		}
		peer.Wait(10 * time.Second)
		if got.Hash != "H" || !got.ByteExact {
			t.Fatalf("rank %d: hash %q byte_exact %v", rank, got.Hash, got.ByteExact)
		}
		if !reflect.DeepEqual(jsonOf(t, got.Metadata), jsonOf(t, mdJSON(want))) {
			t.Fatalf("rank %d: python decoded %v, want %v", rank, got.Metadata, mdJSON(want))
		}
	}
	// Hostile requests from libzmq clients are refused quickly and the
	// server keeps serving.
	peer := zmqtest.Start(t, peerScript, "badreq", s.Endpoint())
	if l := peer.Line(30 * time.Second); l != "OK" {
		t.Fatalf("badreq: %q", l)
	}
	peer.Wait(10 * time.Second)
	if _, err := FetchHandshake(context.Background(), s.Endpoint(), 0, expect("H")); err != nil {
		t.Fatalf("after hostile requests: %v", err)
	}
}

// A Go decode fetches from a Python ROUTER serving vLLM-shaped bytes.
func TestInteropGoFetchesFromPython(t *testing.T) {
	zmqtest.RequirePython(t, "zmq", "msgpack")
	mds := map[string]any{}
	want := map[int]*vllm.AgentMetadata{}
	for rank := range 2 {
		md := sampleMetadata()
		md.DeviceID = rank
		want[rank] = md
		mds[fmt.Sprint(rank)] = map[string]any{"compatibility_hash": "PY", "metadata": mdJSON(md)}
	}
	spec := filepath.Join(t.TempDir(), "spec.json")
	b, _ := json.Marshal(mds)
	os.WriteFile(spec, b, 0o644)
	peer := zmqtest.Start(t, peerScript, "router", spec, "3")
	ep := zmq.TCPEndpoint("127.0.0.1", peerPort(t, peer))
	for i, rank := range []int{0, 1, 0} {
		got, err := FetchHandshake(context.Background(), ep, rank, expect("PY"))
		if err != nil {
			t.Fatalf("fetch %d: %v\n%s", i, err, peer.Stderr())
		}
		if !reflect.DeepEqual(got, want[rank]) {
			t.Fatalf("fetch %d: %+v", i, got)
		}
	}
	if l := peer.Line(30 * time.Second); l != "OK 3" {
		t.Fatalf("peer: %q", l)
	}
	peer.Wait(10 * time.Second)
}

// Go and Python compute the same compatibility hash, including for
// strings that need JSON escaping.
func TestInteropCompatibilityHash(t *testing.T) {
	zmqtest.RequirePython(t, "zmq", "msgpack")
	base := vllm.CompatFactors{VLLMVersion: "0.13.0", ConnectorVersion: 2, Model: "Qwen/Qwen3-8B", DType: "torch.float16",
		NumKVHeads: 8, HeadSize: 128, NumHiddenLayers: 36, AttnBackendName: "FLASHINFER", CacheDType: "fp8_e4m3"}
	var cases []vllm.CompatFactors
	for _, model := range []string{"Qwen/Qwen3-8B", `/models/"quoted"\path`, "modèle-ünïcode-模型", "emoji-😀", "tab\tnew\nline\x01\x7f", ""} {
		c := base
		c.Model = model
		cases = append(cases, c)
	}
	c := base
	c.NumKVHeads, c.HeadSize, c.NumHiddenLayers, c.ConnectorVersion = 1, 576, 61, 1
	cases = append(cases, c)
	var spec []map[string]any
	for _, c := range cases {
		spec = append(spec, map[string]any{
			"vllm_version": c.VLLMVersion, "nixl_connector_version": c.ConnectorVersion, "model": c.Model,
			"dtype": c.DType, "num_kv_heads": c.NumKVHeads, "head_size": c.HeadSize,
			"num_hidden_layers": c.NumHiddenLayers, "attn_backend_name": c.AttnBackendName, "cache_dtype": c.CacheDType,
		})
	}
	path := filepath.Join(t.TempDir(), "factors.json")
	b, _ := json.Marshal(spec)
	os.WriteFile(path, b, 0o644)
	peer := zmqtest.Start(t, peerScript, "hash", path)
	var hashes []string
	if err := json.Unmarshal([]byte(peer.Line(30*time.Second)), &hashes); err != nil {
		t.Fatal(err)
	}
	peer.Wait(10 * time.Second)
	for i, c := range cases {
		if got := vllm.CompatibilityHash(c); got != hashes[i] {
			t.Errorf("factors %d (%q): go %s, python %s", i, c.Model, got, hashes[i])
		}
	}
}

func mdJSON(md *vllm.AgentMetadata) map[string]any {
	return map[string]any{
		"engine_id": md.EngineID, "agent_metadata": hex.EncodeToString(md.AgentMetadata),
		"kv_caches_base_addr": md.KVCachesBaseAddr, "device_id": md.DeviceID, "num_blocks": md.NumBlocks,
		"block_lens": md.BlockLens, "kv_cache_layout": md.KVCacheLayout, "block_size": md.BlockSize,
	}
}

func jsonOf(t *testing.T, v any) any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	d := json.NewDecoder(strings.NewReader(string(b)))
	d.UseNumber()
	var out any
	if err := d.Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out
}

// A handshake server that served honest and hostile clients, closed while
// a client is connected and silent, leaves no goroutine behind.
func TestHandshakeServerCloseLeavesNoGoroutines(t *testing.T) {
	before := runtime.NumGoroutine()
	s, _ := startServer(t, "H")
	if _, err := FetchHandshake(context.Background(), s.Endpoint(), 0, expect("H")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if _, err := zmq.Request(ctx, s.Endpoint(), [][]byte{{0xc1}}, quietZMQ()...); err != nil {
		t.Fatalf("garbage request: %v", err)
	}
	silent, err := net.Dial("tcp", strings.TrimPrefix(s.Endpoint(), "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines after Close, %d before:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(10 * time.Millisecond)
	}
}
