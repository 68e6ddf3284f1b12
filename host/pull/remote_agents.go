package pull

import (
	"log/slog"
	"sync"

	"github.com/kvhost/kvhost/host/plugin"
)

// remoteAgents counts the peers using each loaded remote agent, by name,
// and releases what peers let go of. Two engine ids may name the same agent
// (one of them lying): the agent is removed only when the last peer using
// it lets go, so a refused or released peer never takes another engine's
// agent with it.
//
// load_remote may wait seconds for a peer (the fake plugin waits up to 5 s
// for the answer to its challenge; a slow or unreachable NIXL peer can
// too), and one engine's handshake must not wait for another's. So no lock
// is held across it; and the releases, which take the agent exclusively
// (release_dlist, remove_remote: plugin.Agent waits for every call in
// flight, and every new call queues behind it), never start while a load
// is in flight: they wait, queued, until no load is, and run then (loads
// arriving meanwhile wait for them, which takes no peer's time). A load
// and a removal of the same agent therefore never overlap either, so a
// count never stands for an agent the plugin removed. An attacker keeping
// loads in flight back to back delays releases (the plugin holds released
// lists and agents longer), never anyone's handshake.
type remoteAgents struct {
	agent *plugin.Agent
	log   *slog.Logger

	mu   sync.Mutex
	cond *sync.Cond // releasing ended
	refs map[string]int
	// loading counts the loads in flight; releasing is set while queued
	// releases run (then loads wait).
	loading   int
	releasing bool
	// Queued releases: lists to close, then agents to remove (names no
	// peer counts any more; a name counted again leaves the queue).
	lists  []*plugin.DList
	doomed map[string]struct{}
}

func newRemoteAgents(a *plugin.Agent, log *slog.Logger) *remoteAgents {
	m := &remoteAgents{agent: a, log: log, refs: map[string]int{}, doomed: map[string]struct{}{}}
	m.cond = sync.NewCond(&m.mu)
	return m
}

// acquire loads a peer's agent metadata and counts one more peer using the
// agent it names.
func (m *remoteAgents) acquire(md []byte) (string, error) {
	m.mu.Lock()
	for m.releasing {
		m.cond.Wait()
	}
	m.loading++
	m.mu.Unlock()
	name, err := m.agent.LoadRemote(md)
	m.mu.Lock()
	m.loading--
	if err == nil {
		m.refs[name]++
		delete(m.doomed, name) // loaded still: keep it
	}
	m.runQueuedLocked()
	m.mu.Unlock()
	return name, err
}

// release closes a peer's remote list (nil: none) and counts one peer fewer
// using the remote agent name (empty: none), removing the agent when none
// is left; both wait while a load is in flight.
func (m *remoteAgents) release(name string, dl *plugin.DList) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if dl != nil {
		m.lists = append(m.lists, dl)
	}
	if name != "" {
		if m.refs[name]--; m.refs[name] <= 0 {
			delete(m.refs, name)
			m.doomed[name] = struct{}{}
		}
	}
	m.runQueuedLocked()
}

// runQueuedLocked runs the queued releases unless a load is in flight or
// another caller runs them; m.mu is held, and released while the plugin is
// called.
func (m *remoteAgents) runQueuedLocked() {
	for m.loading == 0 && !m.releasing && (len(m.lists) > 0 || len(m.doomed) > 0) {
		m.releasing = true
		lists, doomed := m.lists, m.doomed
		m.lists, m.doomed = nil, map[string]struct{}{}
		m.mu.Unlock()
		for _, dl := range lists {
			if err := dl.Close(); err != nil {
				m.log.Warn("releasing a remote descriptor list", "err", err)
			}
		}
		for name := range doomed {
			if err := m.agent.RemoveRemote(name); err != nil {
				m.log.Warn("removing a remote agent", "agent", name, "err", err)
			}
		}
		m.mu.Lock()
		m.releasing = false
		m.cond.Broadcast()
	}
}

// count returns how many remote agents peers hold (for tests).
func (m *remoteAgents) count() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.refs)
}

// queued reports whether releases wait for loads in flight (for tests).
func (m *remoteAgents) queued() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.lists) > 0 || len(m.doomed) > 0
}
