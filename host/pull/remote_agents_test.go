package pull

import (
	"sync"
	"testing"

	"github.com/kvhost/kvhost/abi"
)

// Peers acquiring and releasing the same remote agent at once (loads and
// removals interleaving in the plugin, with no lock across either) never
// hold an agent the plugin removed: while a peer holds it, a list prepared
// against it works; once all let go, it is removed.
func TestRemoteAgentsAcquireReleaseRace(t *testing.T) {
	ps := newPrefillSide(t, smallGeom, "prefill", nil)
	md := fetchPayload(t, ps.sender.Endpoint(), 0)
	ds := newDecodeSide(t, smallGeom, nil)
	rx := ds.rx[0]
	desc := []abi.XferDesc{{Addr: md.KVCachesBaseAddr[0], Len: uint64(md.BlockLens[0]), Count: 1, DevID: uint64(md.DeviceID)}}
	const workers, rounds = 8, 2000
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Go(func() {
			for range rounds {
				name, err := rx.agents.acquire(md.AgentMetadata)
				if err != nil {
					errs <- err
					return
				}
				dl, err := rx.cfg.Agent.PrepRemote(name, rx.cfg.Cache.Kind, desc)
				if err == nil {
					err = dl.Close()
				}
				rx.agents.release(name, nil)
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal("a peer held a removed agent:", err)
	}
	if n := rx.agents.count(); n != 0 {
		t.Fatalf("%d remote agents counted after every peer let go", n)
	}
	if _, err := rx.cfg.Agent.PrepRemote(ps.agents[0].Name(), rx.cfg.Cache.Kind, desc); err == nil {
		t.Fatal("the agent is still loaded after every peer let go")
	}
}
