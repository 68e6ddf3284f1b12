package pull

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/wire/vllm"
	"github.com/kvhost/kvhost/planner"
)

// Lease renewal, the decode side (generations with leases, version 6):
// vLLM's decode scheduler tracks a request from its arrival
// (on_new_request) until finished_recving, and its workers send every
// lease // 6 "HB:" and the tracked remote request ids to every agent of
// the prefill engine (_send_heartbeats). A Receiver renews the leases of
// its loads in flight and of the requests the engine said it will load
// (Watch), once it has met their prefill engine.

// maxHeartbeatBytes bounds one heartbeat notification; more ids go in
// more heartbeats.
const maxHeartbeatBytes = 16 << 10

// MaxWatched bounds the requests a Receiver watches at once.
const MaxWatched = 1 << 16

// watchedReq is a request whose lease is renewed before its load.
type watchedReq struct {
	engineID, remoteID string
	params             KVTransferParams // to handshake with its engine
}

// ErrNoLease: Watch on a Receiver whose generation has no leases.
var ErrNoLease = errors.New("pull: this generation has no leases to renew")

// Watch renews the prefill's lease of a request this rank will load
// (vLLM's on_new_request on a decode: the request waits in the engine's
// queue before its load) until its Load finishes or Unwatch. Heartbeats
// go to the prefill engine once this rank has a handshake with it; the
// next heartbeat round starts one when there is none, as vLLM's
// _send_heartbeats does. id is the decode's request id, the one its Load
// will have. p must be params a Load could pull with.
func (r *Receiver) Watch(id string, p KVTransferParams) error {
	if !r.gen.Lease {
		return fmt.Errorf("%w (%s)", ErrNoLease, r.gen)
	}
	if err := p.checkPull(); err != nil {
		return err
	}
	if _, err := planner.VLLMTargetRemoteRank(r.cfg.TPRank, r.cfg.TPSize, p.RemoteTPSize()); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidParams, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.watched[id]; !ok && len(r.watched) >= MaxWatched {
		return fmt.Errorf("pull: %d requests watched already", len(r.watched))
	}
	p.RemoteBlockIDs = nil // not needed to renew
	r.watched[id] = watchedReq{engineID: p.RemoteEngineID, remoteID: p.RemoteRequestID, params: p}
	return nil
}

// Unwatch stops renewing the lease of request id (vLLM's _stop_heartbeat:
// the request finished or was aborted). It is a no-op for a request not
// watched.
func (r *Receiver) Unwatch(id string) {
	r.mu.Lock()
	delete(r.watched, id)
	r.mu.Unlock()
}

// heartbeat renews, every Lease//6 on the clock, the prefill's leases of
// the loads in flight and of the watched requests: each ready peer's
// agent gets "HB:" and their remote request ids. A load waiting for its
// handshake has no agent to send to yet; the prefill extends only
// requests it holds.
func (r *Receiver) heartbeat(t clock.Ticker) {
	defer r.wg.Done()
	defer t.Stop()
	for {
		select {
		case <-r.ctx.Done():
			return
		case <-t.C():
		}
		for name, ids := range r.heartbeatIDs() {
			for _, msg := range vllm.EncodeHeartbeats(ids, maxHeartbeatBytes) {
				if err := r.cfg.Agent.SendNotif(name, msg); err != nil {
					r.log.Debug("heartbeat not sent", "agent", name, "err", err)
				}
			}
		}
		r.hbSent.Add(1)
	}
}

// heartbeatIDs returns, by the agent of each ready peer, the sorted remote
// request ids whose leases to renew.
func (r *Receiver) heartbeatIDs() map[string][]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	byPeer := map[*peer]map[string]bool{}
	add := func(pr *peer, id string) {
		if byPeer[pr] == nil {
			byPeer[pr] = map[string]bool{}
		}
		byPeer[pr][id] = true
	}
	for _, pr := range r.peers {
		if pr.ready {
			for l := range pr.loads {
				add(pr, l.req.Params.RemoteRequestID)
			}
		}
	}
	for _, w := range r.watched {
		switch pr := r.peers[w.engineID]; {
		case pr == nil && !r.closed:
			// Checked by Watch.
			rank, _ := planner.VLLMTargetRemoteRank(r.cfg.TPRank, r.cfg.TPSize, w.params.RemoteTPSize())
			r.startHandshakeLocked(&w.params, rank, nil)
		case pr != nil && pr.ready:
			add(pr, w.remoteID)
		}
	}
	out := make(map[string][]string, len(byPeer))
	for pr, ids := range byPeer {
		for id := range ids {
			out[pr.name] = append(out[pr.name], id)
		}
		slices.Sort(out[pr.name])
	}
	return out
}

// Heartbeats returns how many heartbeat rounds ran (tests wait on it).
func (r *Receiver) Heartbeats() int64 { return r.hbSent.Load() }
