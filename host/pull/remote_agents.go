package pull

import (
	"fmt"
	"log/slog"
	"slices"
	"sync"

	"github.com/kvhost/kvhost/host/plugin"
)

// remoteAgents counts the peers using each loaded remote agent, by name.
// Two engine ids may name the same agent (one of them lying): the agent is
// removed only when the last peer using it lets go, so a refused or
// released peer never takes another engine's agent with it.
//
// No lock is held across a plugin call: load_remote may wait seconds for a
// peer (the fake plugin waits up to 5 s for a challenge's answer; a slow or
// unreachable NIXL peer can too), and one engine's handshake must not hold
// up another's. The name an agent gets is known only once load_remote
// returns, so a load that ran while the same name was being removed may
// have been undone by the removal: it loads again.
type remoteAgents struct {
	agent *plugin.Agent
	log   *slog.Logger

	mu   sync.Mutex
	refs map[string]int
	// removing holds, by name, the removals under way; each channel closes
	// when its remove_remote has returned.
	removing map[string]chan struct{}
	// loading holds the loads under way.
	loading map[*agentLoad]struct{}
}

// agentLoad is one load_remote under way.
type agentLoad struct {
	// raced lists the names whose removal was under way at some time while
	// the load ran: the plugin may have removed what the load found.
	raced []string
}

// maxAgentLoads bounds the loads of one acquire whose agent was removed
// meanwhile (each such removal needs another peer to acquire and release
// the same agent, so more than one is already unlikely).
const maxAgentLoads = 8

func newRemoteAgents(a *plugin.Agent, log *slog.Logger) *remoteAgents {
	return &remoteAgents{agent: a, log: log, refs: map[string]int{},
		removing: map[string]chan struct{}{}, loading: map[*agentLoad]struct{}{}}
}

// acquire loads a peer's agent metadata and counts one more peer using the
// agent it names.
func (m *remoteAgents) acquire(md []byte) (string, error) {
	for attempt := 1; ; attempt++ {
		ld := &agentLoad{}
		m.mu.Lock()
		for name := range m.removing { // under way: it may follow this load
			ld.raced = append(ld.raced, name)
		}
		m.loading[ld] = struct{}{}
		m.mu.Unlock()
		name, err := m.agent.LoadRemote(md)
		m.mu.Lock()
		delete(m.loading, ld)
		if err != nil {
			m.mu.Unlock()
			return "", err
		}
		removal := m.removing[name]
		if removal == nil && !slices.Contains(ld.raced, name) {
			m.refs[name]++
			m.mu.Unlock()
			return name, nil
		}
		m.mu.Unlock()
		if removal != nil {
			<-removal // remove_remote returned: this load may be undone
		}
		if attempt == maxAgentLoads {
			// The plugin may hold the agent from the last load: count it
			// and let go, which removes it unless another peer took it.
			m.mu.Lock()
			m.refs[name]++
			m.mu.Unlock()
			m.release(name)
			return "", fmt.Errorf("remote agent %s was removed while it loaded, %d times", name, attempt)
		}
	}
}

// release counts one peer fewer using a remote agent and removes the agent
// when none is left.
func (m *remoteAgents) release(name string) {
	m.mu.Lock()
	if m.refs[name]--; m.refs[name] > 0 {
		m.mu.Unlock()
		return
	}
	delete(m.refs, name)
	// An acquire of this name waits for the removal before it counts
	// (none counted since refs reached 0), so removals of a name do not
	// overlap.
	done := make(chan struct{})
	m.removing[name] = done
	for ld := range m.loading {
		ld.raced = append(ld.raced, name)
	}
	m.mu.Unlock()
	err := m.agent.RemoveRemote(name)
	m.mu.Lock()
	delete(m.removing, name)
	m.mu.Unlock()
	close(done)
	if err != nil {
		m.log.Warn("removing a remote agent", "agent", name, "err", err)
	}
}

// count returns how many remote agents peers hold (for tests).
func (m *remoteAgents) count() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.refs)
}
