package pull

import (
	"context"
	"errors"
	"fmt"
	"net"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/memtransport"
	"github.com/kvhost/kvhost/host/internal/zmq"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

var smallGeom = geom{hnd: true, layers: 2, heads: 2, headBytes: 16, tp: 1, blockSize: 4, blocks: 32}

// countingObserver counts events.
type countingObserver struct {
	NopObserver
	handshakes, handshakeErrs, transfers, failed, failedNotifs atomic.Int32
}

func (o *countingObserver) Handshake(_ time.Duration, err error) {
	o.handshakes.Add(1)
	if err != nil {
		o.handshakeErrs.Add(1)
	}
}
func (o *countingObserver) Transfer(TransferStat) { o.transfers.Add(1) }
func (o *countingObserver) FailedTransfer()       { o.failed.Add(1) }
func (o *countingObserver) FailedNotification()   { o.failedNotifs.Add(1) }

// hold fills blocks for a request on every prefill rank and holds them.
func (ps *prefillSide) hold(t *testing.T, id string, seed uint64, blocks []int32, tokens int) KVTransferParams {
	t.Helper()
	for _, p := range ps.pools {
		if err := p.Fill(kvpool.Tokens{Request: seed, Pages: blocks, Count: tokens}); err != nil {
			t.Fatal(err)
		}
	}
	params, err := ps.sender.Hold(id, blocks)
	if err != nil {
		t.Fatal(err)
	}
	return params
}

func wait(t *testing.T, l *Load) LoadResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	res, err := l.Wait(ctx)
	if err != nil {
		t.Fatal("load did not finish:", err)
	}
	return res
}

func deadParams(t *testing.T) KVTransferParams {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	return KVTransferParams{DoRemotePrefill: true, RemoteBlockIDs: []int32{0, 1}, RemoteEngineID: "dead",
		RemoteRequestID: "x", RemoteHost: "127.0.0.1", RemotePort: port, TPSize: 1}
}

// TestHandshakeDeadPort: a handshake with nobody listening fails at once;
// the request fails with its blocks invalid, and the next request tries
// again.
func TestHandshakeDeadPort(t *testing.T) {
	obs := &countingObserver{}
	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.Observer = obs })
	params := deadParams(t)
	start := time.Now()
	res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "a", LocalBlockIDs: []int32{5, 3}, Params: params}))
	if !errors.Is(res.Err, ErrHandshake) || !reflect.DeepEqual(res.InvalidBlocks, []int32{5, 3}) {
		t.Fatalf("%+v", res)
	}
	if d := time.Since(start); d > DefaultHandshakeTimeout {
		t.Fatalf("a dead port took %v", d)
	}
	if got := ds.rx[0].BlockIDsWithLoadErrors(); !reflect.DeepEqual(got, []int32{3, 5}) {
		t.Fatalf("invalid blocks %v", got)
	}
	if got := ds.rx[0].BlockIDsWithLoadErrors(); len(got) != 0 {
		t.Fatalf("invalid blocks reported twice: %v", got)
	}
	res = wait(t, ds.rx[0].Load(LoadRequest{RequestID: "b", LocalBlockIDs: []int32{7}, Params: params}))
	if !errors.Is(res.Err, ErrHandshake) || obs.handshakes.Load() != 2 || obs.handshakeErrs.Load() != 2 {
		t.Fatalf("second request: %v; %d handshakes", res.Err, obs.handshakes.Load())
	}
	if st := ds.rx[0].TakeStats(); st.FailedTransfers != 0 {
		t.Fatalf("a handshake failure counted as a failed transfer: %+v", st)
	}
}

// TestHandshakeTimeout: a side channel that accepts but never answers
// cannot hang the decode: the handshake fails after HandshakeTimeout. It
// runs on a fake clock and the in-memory transport.
func TestHandshakeTimeout(t *testing.T) {
	fk := clock.NewFake(time.Time{})
	mem := memtransport.New(fk)
	asked := make(chan struct{}, 1)
	silent, err := mem.Serve("tcp://127.0.0.1:0", func(net.Addr, [][]byte) ([][]byte, bool) {
		select {
		case asked <- struct{}{}:
		default:
		}
		return nil, false // hold the request, say nothing
	})
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	const timeout = 300 * time.Millisecond
	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) {
		c.HandshakeTimeout, c.Transport, c.Clock = timeout, memTransport{mem}, fk
	})
	params := deadParams(t)
	params.RemotePort = silent.Port()
	start := fk.Now()
	l := ds.rx[0].Load(LoadRequest{RequestID: "a", LocalBlockIDs: []int32{1}, Params: params})
	select {
	case <-asked: // the request is held
	case <-time.After(10 * time.Second):
		t.Fatal("no handshake request")
	}
	waitArmed(t, fk, timeout)
	fk.Advance(timeout)
	res := wait(t, l)
	d := fk.Since(start)
	if !errors.Is(res.Err, ErrHandshake) || !errors.Is(res.Err, context.DeadlineExceeded) {
		t.Fatalf("%v", res.Err)
	}
	if d < timeout || d > timeout+2*time.Second {
		t.Fatalf("failed after %v with a %v timeout", d, timeout)
	}
}

// TestHandshakeRefusals: hash and engine id mismatches are refused with
// vLLM's kv_connector/v1/nixl_connector.py's message; with the check off the hash is ignored.
func TestHandshakeRefusals(t *testing.T) {
	ps := newPrefillSide(t, smallGeom, "prefill", nil)
	params := ps.hold(t, "r", 1, []int32{2, 3}, 8)

	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.CompatHash = "decode-hash" })
	res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "r", LocalBlockIDs: []int32{0, 1}, Params: params}))
	if !errors.Is(res.Err, vllm.ErrHashMismatch) || !errors.Is(res.Err, ErrHandshake) ||
		!strings.Contains(res.Err.Error(), "Local: decode-hash") || !strings.Contains(res.Err.Error(), "Remote: "+testHash) {
		t.Fatalf("%v", res.Err)
	}

	bad := params
	bad.RemoteEngineID = "someone-else"
	ds2 := newDecodeSide(t, smallGeom, nil)
	res = wait(t, ds2.rx[0].Load(LoadRequest{RequestID: "r", LocalBlockIDs: []int32{0, 1}, Params: bad}))
	if !errors.Is(res.Err, vllm.ErrEngineIDMismatch) || !strings.Contains(res.Err.Error(), `"someone-else"`) {
		t.Fatalf("%v", res.Err)
	}

	ds3 := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.CompatHash = "decode-hash"; c.SkipCompatCheck = true })
	if res := wait(t, ds3.rx[0].Load(LoadRequest{RequestID: "r", LocalBlockIDs: []int32{0, 1}, Params: params})); res.Err != nil {
		t.Fatal(res.Err)
	}
	if err := ds3.pools[0].Verify(kvpool.Tokens{Request: 1, Pages: []int32{0, 1}, Count: 8}); err != nil {
		t.Fatal(err)
	}

	// Geometry the planner refuses: a decode with other head size.
	other := smallGeom
	other.headBytes = 32
	ds4 := newDecodeSide(t, other, nil)
	res = wait(t, ds4.rx[0].Load(LoadRequest{RequestID: "r", LocalBlockIDs: []int32{0, 1}, Params: params}))
	if !errors.Is(res.Err, ErrHandshake) || !strings.Contains(res.Err.Error(), "incompatible KV geometry") {
		t.Fatalf("%v", res.Err)
	}
	// A peer advertising more descriptors than the decode prepares.
	ds5 := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.MaxDescriptors = 100 })
	res = wait(t, ds5.rx[0].Load(LoadRequest{RequestID: "r", LocalBlockIDs: []int32{0, 1}, Params: params}))
	if !errors.Is(res.Err, ErrHandshake) || !strings.Contains(res.Err.Error(), "128 descriptors, more than the 100") {
		t.Fatalf("%v", res.Err)
	}
	// Heterogeneous TP over NHD is refused rather than read wrong.
	nhd := smallGeom
	nhd.hnd = false
	psN := newPrefillSide(t, nhd, "prefill", nil)
	pN := psN.hold(t, "n", 2, []int32{1}, 4)
	nhd.tp = 2
	dsN := newDecodeSide(t, nhd, nil)
	res = wait(t, dsN.rx[0].Load(LoadRequest{RequestID: "n", LocalBlockIDs: []int32{0}, Params: pN}))
	if !errors.Is(res.Err, ErrHandshake) || !strings.Contains(res.Err.Error(), "needs the HND layout") {
		t.Fatalf("%v", res.Err)
	}
}

// TestHandshakeOncePerEngine: requests queue behind their engine's one
// handshake; a failed handshake fails only the requests waiting for it.
func TestHandshakeOncePerEngine(t *testing.T) {
	g := smallGeom
	g.blocks = 128
	good := newPrefillSide(t, g, "prefill", nil)
	obs := &countingObserver{}
	ds := newDecodeSide(t, g, func(c *ReceiverConfig) { c.Observer = obs })
	dead := deadParams(t)
	var goodLoads, deadLoads []*Load
	for i := range 20 {
		p := good.hold(t, fmt.Sprintf("g%d", i), uint64(i), []int32{int32(2 * i), int32(2*i + 1)}, 8)
		goodLoads = append(goodLoads, ds.rx[0].Load(LoadRequest{RequestID: fmt.Sprintf("g%d", i),
			LocalBlockIDs: []int32{int32(127 - 2*i), int32(126 - 2*i)}, Params: p}))
		deadLoads = append(deadLoads, ds.rx[0].Load(LoadRequest{RequestID: fmt.Sprintf("d%d", i),
			LocalBlockIDs: []int32{int32(i)}, Params: dead}))
	}
	for i, l := range goodLoads {
		if res := wait(t, l); res.Err != nil {
			t.Fatalf("g%d: %v", i, res.Err)
		}
		if err := ds.pools[0].Verify(kvpool.Tokens{Request: uint64(i), Pages: []int32{int32(127 - 2*i), int32(126 - 2*i)}, Count: 8}); err != nil {
			t.Fatal(err)
		}
	}
	failedHS := 0
	for i, l := range deadLoads {
		if res := wait(t, l); !errors.Is(res.Err, ErrHandshake) {
			t.Fatalf("d%d: %v", i, res.Err)
		}
	}
	failedHS = int(obs.handshakeErrs.Load())
	// One good handshake; the dead engine is tried again by requests that
	// arrived after a failure, never more often than requests.
	if obs.handshakes.Load()-int32(failedHS) != 1 || failedHS < 1 || failedHS > 20 {
		t.Fatalf("%d handshakes, %d failed", obs.handshakes.Load(), failedHS)
	}
	if n := len(ds.rx[0].Peers()); n != 1 {
		t.Fatalf("%d peers", n)
	}
}

// TestReadFailure: a READ the plugin fails marks the request's blocks
// invalid and counts a failed transfer; the prefill, never notified,
// releases on expiry.
func TestReadFailure(t *testing.T) {
	ps := newPrefillSide(t, smallGeom, "prefill", func(c *SenderConfig) { c.AbortTimeout = 200 * time.Millisecond })
	obs := &countingObserver{}
	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.Observer = obs }, plugin.Param{Key: "fail_rate", Value: "1"})
	params := ps.hold(t, "r", 1, []int32{4, 5, 6}, 12)
	res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "r", LocalBlockIDs: []int32{9, 8, 7}, Params: params}))
	if !errors.Is(res.Err, ErrTransfer) || !errors.Is(res.Err, plugin.ErrBackend) || !strings.Contains(res.Err.Error(), "injected failure") {
		t.Fatalf("%v", res.Err)
	}
	if got := ds.rx[0].BlockIDsWithLoadErrors(); !reflect.DeepEqual(got, []int32{7, 8, 9}) {
		t.Fatalf("invalid blocks %v", got)
	}
	if st := ds.rx[0].TakeStats(); st.FailedTransfers != 1 || len(st.Transfers) != 0 || obs.failed.Load() != 1 {
		t.Fatalf("stats %+v, observer %d", st, obs.failed.Load())
	}
	if r := nextRelease(t, ps, 3*time.Second); r.Reason != ReleaseExpired || r.Notified != 0 {
		t.Fatalf("release %+v", r)
	}
}

// TestReadTimeoutAndClose: a READ past ReadTimeout is cancelled and
// failed; Close fails loads still running and releases everything.
func TestReadTimeoutAndClose(t *testing.T) {
	ps := newPrefillSide(t, smallGeom, "prefill", nil)
	// The READ timeout runs on a fake clock: advanced past it once the
	// READ is posted (its timer armed).
	fk := clock.NewFake(time.Time{})
	const readTimeout = 100 * time.Millisecond
	ds := newDecodeSide(t, smallGeom, func(c *ReceiverConfig) { c.ReadTimeout, c.Clock = readTimeout, fk },
		plugin.Param{Key: "delay_us", Value: "2000000"})
	params := ps.hold(t, "slow", 1, []int32{1}, 4)
	start := fk.Now()
	slow := ds.rx[0].Load(LoadRequest{RequestID: "slow", LocalBlockIDs: []int32{2}, Params: params})
	waitArmed(t, fk, readTimeout)
	fk.Advance(readTimeout)
	res := wait(t, slow)
	if !errors.Is(res.Err, ErrReadTimeout) || fk.Since(start) > 1500*time.Millisecond {
		t.Fatalf("%v after %v", res.Err, fk.Since(start))
	}

	ds2 := newDecodeSide(t, smallGeom, nil, plugin.Param{Key: "delay_us", Value: "5000000"})
	params2 := ps.hold(t, "closing", 2, []int32{3}, 4)
	l := ds2.rx[0].Load(LoadRequest{RequestID: "closing", LocalBlockIDs: []int32{2}, Params: params2})
	eventually(t, "the handshake", 5*time.Second, func() bool { return len(ds2.rx[0].Peers()) == 1 })
	peer := ds2.rx[0].Peers()[0].AgentName
	rx := ds2.rx[0]
	rx.mu.Lock()
	handles := []interface{ Close() error }{rx.peers["prefill"].remoteDL}
	rx.mu.Unlock()
	for _, dl := range rx.localLists {
		handles = append(handles, dl)
	}
	for _, reg := range rx.regions {
		handles = append(handles, reg)
	}
	start = time.Now()
	if err := ds2.rx[0].Close(); err != nil {
		t.Fatal(err)
	}
	// Every list and registration was released by Close.
	for i, h := range handles {
		if err := h.Close(); !errors.Is(err, plugin.ErrClosed) {
			t.Fatalf("handle %d (%T) still open after Close: %v", i, h, err)
		}
	}
	if res := wait(t, l); !errors.Is(res.Err, ErrClosed) {
		t.Fatalf("%v", res.Err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Close waited %v for a delayed READ", d)
	}
	// The remote agent and the registration are gone.
	if err := ds2.rx[0].cfg.Agent.RemoveRemote(peer); !errors.Is(err, plugin.ErrNotFound) {
		t.Fatalf("remote agent still loaded after Close: %v", err)
	}
	if res := wait(t, ds2.rx[0].Load(LoadRequest{RequestID: "late", LocalBlockIDs: []int32{1}, Params: params2})); !errors.Is(res.Err, ErrClosed) {
		t.Fatalf("load after Close: %v", res.Err)
	}
	if err := ds2.rx[0].Close(); err != nil {
		t.Fatal("second Close:", err)
	}
}

// TestInvalidRequests: unusable params and block ids fail the request and
// nothing else.
func TestInvalidRequests(t *testing.T) {
	ps := newPrefillSide(t, smallGeom, "prefill", nil)
	ds := newDecodeSide(t, smallGeom, nil)
	good := ps.hold(t, "r", 1, []int32{1, 2}, 8)
	for _, c := range []struct {
		name  string
		mod   func(*KVTransferParams)
		local []int32
		want  string
	}{
		{"not remote prefill", func(p *KVTransferParams) { p.DoRemotePrefill = false }, []int32{0}, "do_remote_prefill"},
		{"no blocks", func(p *KVTransferParams) { p.RemoteBlockIDs = nil }, []int32{0}, "remote_block_ids is empty"},
		{"no engine", func(p *KVTransferParams) { p.RemoteEngineID = "" }, []int32{0}, "remote_engine_id"},
		{"no request", func(p *KVTransferParams) { p.RemoteRequestID = "" }, []int32{0}, "remote_request_id"},
		{"no host", func(p *KVTransferParams) { p.RemoteHost = "" }, []int32{0}, "remote_host"},
		{"bad port", func(p *KVTransferParams) { p.RemotePort = 70000 }, []int32{0}, "remote_port"},
		{"negative block", func(p *KVTransferParams) { p.RemoteBlockIDs = []int32{1, -2} }, []int32{0}, "remote_block_ids[1]"},
		{"decode TP below prefill", func(p *KVTransferParams) { p.TPSize = 2 }, []int32{0}, "smaller than prefill TP"},
		{"more local than remote blocks", nil, []int32{0, 3, 4}, "prefill sent only 2 blocks"},
		{"local block out of range", nil, []int32{40}, "local_block_ids[0]"},
	} {
		p := good
		if c.mod != nil {
			c.mod(&p)
		}
		res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: c.name, LocalBlockIDs: c.local, Params: p}))
		if !errors.Is(res.Err, ErrInvalidParams) || !strings.Contains(res.Err.Error(), c.want) {
			t.Errorf("%s: %v", c.name, res.Err)
		}
	}
	// The receiver still works.
	if res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "ok", LocalBlockIDs: []int32{5, 6}, Params: good})); res.Err != nil {
		t.Fatal(res.Err)
	}
	if err := ds.pools[0].Verify(kvpool.Tokens{Request: 1, Pages: []int32{5, 6}, Count: 8}); err != nil {
		t.Fatal(err)
	}
}

// TestHostileHandshakeBytes: garbage on the side channel is refused and
// the listener keeps serving real handshakes.
func TestHostileHandshakeBytes(t *testing.T) {
	ps := newPrefillSide(t, smallGeom, "prefill", nil)
	addr := strings.TrimPrefix(ps.sender.Endpoint(), "tcp://")
	for _, junk := range [][]byte{
		[]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
		{0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 1, 'N', 'U', 'L', 'L'}, // a greeting, then it stops
		make([]byte, 70000),
	} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		c.Write(junk)
		c.Close()
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	for _, frames := range [][][]byte{
		{[]byte("\xc1")},
		{[]byte("\x92\xc4\x05other\x00")},
		{vllm.EncodeMetaRequest(9)}, // no such TP rank
	} {
		reply, err := zmq.Request(ctx, ps.sender.Endpoint(), frames)
		if err != nil {
			t.Fatalf("bad request %q got no reply: %v", frames, err)
		}
		if len(reply) != 1 || len(reply[0]) != 0 {
			t.Fatalf("bad request %q answered %q", frames, reply)
		}
	}
	md := fetchPayload(t, ps.sender.Endpoint(), 0)
	if md.EngineID != "prefill" || md.NumBlocks != smallGeom.blocks {
		t.Fatalf("%+v", md)
	}
	ds := newDecodeSide(t, smallGeom, nil)
	params := ps.hold(t, "after", 3, []int32{2}, 4)
	if res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "after", LocalBlockIDs: []int32{7}, Params: params})); res.Err != nil {
		t.Fatal(res.Err)
	}
}

// TestHandshakeChurn: many clients, each connecting once as vLLM does, all
// get the right payload; many decode engines handshake and read at once.
func TestHandshakeChurn(t *testing.T) {
	g := smallGeom
	g.tp = 2
	g.blocks = 64
	ps := newPrefillSide(t, g, "prefill", nil)
	want := make([][]byte, g.tp)
	for r := range want {
		var err error
		if want[r], err = ps.agents[r].LocalMetadata(); err != nil {
			t.Fatal(err)
		}
	}
	const clients = 200
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	start := time.Now()
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rank := i % g.tp
			md, err := FetchHandshake(t.Context(), ps.sender.Endpoint(), rank, FetchOptions{
				Expect: vllm.Expect{LocalHash: testHash, EnforceHash: true, EngineID: "prefill"}})
			switch {
			case err != nil:
				errs <- err
			case !reflect.DeepEqual(md.AgentMetadata, want[rank]):
				errs <- fmt.Errorf("client %d got rank %d's metadata wrong", i, rank)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d one-shot handshakes in %v", clients, time.Since(start))

	// Eight decode engines (TP 2 each) handshake and read concurrently.
	const engines = 8
	params := ps.hold(t, "shared", 5, []int32{10, 11, 12}, 10)
	var loads []*Load
	var sides []*decodeSide
	for range engines {
		ds := newDecodeSide(t, g, nil)
		sides = append(sides, ds)
		for _, rx := range ds.rx {
			loads = append(loads, rx.Load(LoadRequest{RequestID: "shared", LocalBlockIDs: []int32{1, 2, 3}, Params: params}))
		}
	}
	for _, l := range loads {
		if res := wait(t, l); res.Err != nil {
			t.Fatal(res.Err)
		}
	}
	for _, ds := range sides {
		for _, p := range ds.pools {
			if err := p.Verify(kvpool.Tokens{Request: 5, Pages: []int32{1, 2, 3}, Count: 10}); err != nil {
				t.Fatal(err)
			}
		}
	}
	// 16 readers sent "shared:1" to ranks expecting 1 each: the first per
	// rank releases, the other 14 are surplus.
	if r := nextRelease(t, ps, 5*time.Second); r.Reason != ReleaseNotified {
		t.Fatalf("%+v", r)
	}
	eventually(t, "surplus notifications", 5*time.Second, func() bool {
		return ps.sender.Counts().UnknownNotifications == engines*g.tp-g.tp
	})
}
