package pull

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvhost/kvhost/host/kvpool"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// serveHandshake serves one crafted TP-rank-0 handshake for md, as a
// hostile prefill would, and returns its endpoint's port.
func serveHandshake(t *testing.T, md *vllm.AgentMetadata) int {
	t.Helper()
	srv, err := vllm.ListenHandshake("tcp://127.0.0.1:0", map[int][]byte{0: vllm.NewHandshakePayload(testHash, md).Encode()}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv.Port()
}

// honestLoads runs n requests against the honest prefill, one after the
// other, and returns how many verified.
func honestLoads(t *testing.T, ps *prefillSide, rx *Receiver, pool *kvpool.Pool, tag string, n int) (ok int, firstErr error) {
	t.Helper()
	for i := range n {
		id := fmt.Sprintf("%s-%d", tag, i)
		seed := uint64(1000 + i)
		params := ps.hold(t, id, seed, []int32{int32(2 * (i % 8)), int32(2*(i%8) + 1)}, 8)
		res := wait(t, rx.Load(LoadRequest{RequestID: id, LocalBlockIDs: []int32{4, 5}, Params: params}))
		err := res.Err
		if err == nil {
			err = pool.Verify(kvpool.Tokens{Request: seed, Pages: []int32{4, 5}, Count: 8})
		}
		if err == nil {
			ok++
		} else if firstErr == nil {
			firstErr = err
		}
		ps.sender.Abort(id)
	}
	return ok, firstErr
}

// TestRefusedHandshakeSparesOtherEngines (issue 19.1): a handshake for
// another engine id that carries the honest prefill's own agent metadata
// with lying geometry is refused, and the refusal leaves the honest
// engine's peer (its remote agent and lists) as it was.
func TestRefusedHandshakeSparesOtherEngines(t *testing.T) {
	ps := newPrefillSide(t, smallGeom, "prefill", nil)
	ds := newDecodeSide(t, smallGeom, nil)
	rx, pool := ds.rx[0], ds.pools[0]
	if ok, err := honestLoads(t, ps, rx, pool, "before", 10); ok != 10 {
		t.Fatalf("before the attack: %d/10 honest requests ok (%v)", ok, err)
	}
	lies := map[string]func(*vllm.AgentMetadata){
		"doubled num_blocks": func(m *vllm.AgentMetadata) { m.NumBlocks *= 2 },
		"shifted base":       func(m *vllm.AgentMetadata) { m.KVCachesBaseAddr[0] += 1 << 20 },
		"other device":       func(m *vllm.AgentMetadata) { m.DeviceID++ },
	}
	for what, lie := range lies {
		md := fetchPayload(t, ps.sender.Endpoint(), 0)
		md.EngineID = "evil"
		lie(md)
		port := serveHandshake(t, md)
		evil := KVTransferParams{DoRemotePrefill: true, RemoteBlockIDs: []int32{0, 1}, RemoteEngineID: "evil",
			RemoteRequestID: "evil", RemoteHost: "127.0.0.1", RemotePort: port, TPSize: 1}
		res := wait(t, rx.Load(LoadRequest{RequestID: "evil", LocalBlockIDs: []int32{6, 7}, Params: evil}))
		if !errors.Is(res.Err, ErrHandshake) {
			t.Fatalf("%s: the lying handshake was not refused: %v", what, res.Err)
		}
		ok, err := honestLoads(t, ps, rx, pool, "after-"+what, 29)
		t.Logf("%s: honest requests after the refused handshake: %d/29 ok", what, ok)
		if ok != 29 {
			t.Fatalf("%s: %d/29 honest requests ok after the refused handshake (first error: %v)", what, ok, err)
		}
	}
	if got := rx.Peers(); len(got) != 1 || got[0].EngineID != "prefill" {
		t.Fatalf("peers %+v", got)
	}
}
