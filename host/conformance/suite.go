// Package conformance is the plugin conformance suite: it proves, through
// the host (host/plugin), that a plugin implements every function of
// abi/kvplugin.h with the promised semantics, and that the host's
// capability emulation fills the gaps of an agent that lacks some.
//
// The suite runs against any plugin by name, with optional agent
// parameters (e.g. backend=UCX for nixl). It checks what the agent's
// capabilities say it can do and skips the rest with the reason. Every data
// test verifies bytes exactly. Peers live in this process or, in
// two-process mode, in a helper process that owns its agents and memory
// (see ServeHelper), so cross-process paths are proven too.
//
// The suite is a library: `go test ./host/conformance` wraps it in
// testing.T, and `kvhost plugins --check NAME` runs it with Run.
//
//	go test ./host/conformance                     # fake: all caps, caps_off=prepped,
//	                                               # caps_off=batch, caps_off=strided and
//	                                               # the MORI-IO profile (caps_off=prepped,
//	                                               # notif,remote_addr); each in-process
//	                                               # and two-process
//	go test ./host/conformance -plugin=nixl -params backend=UCX
//	go test ./host/conformance -params caps_off=prepped,remote_addr -mode two-process
//	kvhost plugins --check nixl --param backend=UCX
package conformance

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/internal/peerproc"
	"github.com/kvhost/kvhost/host/plugin"
)

// Mode says where the suite's peer agents live.
type Mode int

const (
	InProcess  Mode = iota // peers are agents of this process
	TwoProcess             // peers are agents of a helper process
)

func (m Mode) String() string {
	if m == TwoProcess {
		return "two-process"
	}
	return "in-process"
}

// ParseModes parses a mode flag: "in-process", "two-process" or "both".
func ParseModes(s string) ([]Mode, error) {
	switch s {
	case "both":
		return []Mode{InProcess, TwoProcess}, nil
	case "in-process":
		return []Mode{InProcess}, nil
	case "two-process":
		return []Mode{TwoProcess}, nil
	}
	return nil, fmt.Errorf("mode %q: want in-process, two-process or both", s)
}

// Config selects what the suite runs against.
type Config struct {
	Plugin string         // plugin name, e.g. "fake"
	Dirs   []string       // plugin search path (plugin.SearchDirs)
	Params []plugin.Param // agent parameters of every agent the suite makes
	Mode   Mode
	// Helper returns the command of a helper process (needed for
	// TwoProcess). The command must serve the helper protocol on its stdin
	// and stdout when HelperEnv is set (ServeHelperStdio); the suite sets
	// HelperEnv and pipes.
	Helper func() *exec.Cmd
	// ABIVariants are builds of the plugin made for another ABI major; the
	// host must refuse each with a message naming both versions.
	ABIVariants []string
	// Timeout bounds each wait for a transfer or notification (default
	// 10 s); a helper process that leaves a request unanswered for three
	// times as long is killed.
	Timeout time.Duration
}

// TB is what the suite needs of a test: *testing.T implements it, and Run
// provides one for the command line. Fatalf and Skipf end the case (they
// must be called from the case's goroutine).
type TB interface {
	Helper()
	Logf(format string, args ...any)
	Errorf(format string, args ...any)
	Fatalf(format string, args ...any)
	Skipf(format string, args ...any)
	Cleanup(func())
	Failed() bool
}

// Case is one test of the suite.
type Case struct {
	Name string
	Doc  string // what the case proves
	Run  func(t TB, s *Suite)
}

// Cases returns every case of the suite, in the order they run.
func Cases() []Case { return slices.Clone(cases) }

// Suite is an open run: the plugin, loaded once, and the host of peer
// agents. It is shared by the cases, which run one at a time.
type Suite struct {
	cfg   Config
	p     *plugin.Plugin
	peers peerHost
	id    string       // distinguishes this run's agent names from other runs'
	names atomic.Int64 // makes agent names unique within the run
}

// Open loads the plugin and, in two-process mode, starts the helper.
func Open(cfg Config) (*Suite, error) {
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	p, err := plugin.Load(cfg.Plugin, cfg.Dirs)
	if err != nil {
		return nil, err
	}
	s := &Suite{cfg: cfg, p: p, peers: inProcHost{p}, id: strconv.FormatInt(time.Now().UnixNano()%(1<<32), 36)}
	if cfg.Mode == TwoProcess {
		if cfg.Helper == nil {
			p.Close()
			return nil, errors.New("conformance: two-process mode needs Config.Helper")
		}
		h, err := startHelper(cfg.Helper(), cfg.Plugin, cfg.Dirs, 3*cfg.Timeout)
		if err != nil {
			p.Close()
			return nil, err
		}
		s.peers = h
	}
	return s, nil
}

// Close stops the helper and closes the plugin.
func (s *Suite) Close() error {
	return errors.Join(s.peers.Close(), s.p.Close())
}

// Plugin returns the plugin under test.
func (s *Suite) Plugin() *plugin.Plugin { return s.p }

// Config returns the configuration the suite runs.
func (s *Suite) Config() Config { return s.cfg }

// agentName returns a fresh agent name, unique across processes.
func (s *Suite) agentName(role string) string {
	return fmt.Sprintf("conf-%s-%d-%s-%d", role, os.Getpid(), s.id, s.names.Add(1))
}

// params returns the configured agent parameters followed by extra ones
// (a later key overrides an earlier one in the plugins we know, but the
// suite never repeats a key: extra keys replace configured ones).
func (s *Suite) params(extra ...plugin.Param) []plugin.Param {
	out := make([]plugin.Param, 0, len(s.cfg.Params)+len(extra))
	for _, p := range s.cfg.Params {
		if !slices.ContainsFunc(extra, func(e plugin.Param) bool { return e.Key == p.Key }) {
			out = append(out, p)
		}
	}
	return append(out, extra...)
}

// newLocal makes an agent of this process with buffers of the given sizes,
// closed when the case ends.
func (s *Suite) newLocal(t TB, sizes []int, extra ...plugin.Param) *peerproc.MemAgent {
	t.Helper()
	m, err := newMemAgent(s.p, s.agentName("local"), s.params(extra...), sizes)
	if err != nil {
		t.Fatalf("creating a local agent: %v", err)
	}
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Errorf("closing local agent %s: %v", m.Agent.Name(), err)
		}
	})
	return m
}

// newPeer makes a peer agent (in this process or the helper), closed when
// the case ends.
func (s *Suite) newPeer(t TB, sizes []int, extra ...plugin.Param) peerproc.Peer {
	t.Helper()
	p, err := s.peers.NewAgent(s.agentName("peer"), s.params(extra...), sizes)
	if err != nil {
		t.Fatalf("creating a peer agent (%s): %v", s.cfg.Mode, err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("closing peer agent %s: %v", p.Name(), err)
		}
	})
	return p
}

// needDRAM skips the case when the plugin cannot register host memory,
// the only memory the suite allocates.
func (s *Suite) needDRAM(t TB) {
	t.Helper()
	if !slices.Contains(s.p.Info().MemKinds, abi.DRAM) {
		t.Skipf("plugin %s does not support DRAM; the suite moves host memory only", s.p.Name())
	}
}

// expectCode fails the case unless err is a plugin error with code.
func expectCode(t TB, what string, err error, code abi.Status) {
	t.Helper()
	if p := codeProblem(what, err, code); p != "" {
		t.Errorf("%s", p)
	}
}

// codeProblem describes how err differs from a plugin error with code, or
// returns "" when it is one.
func codeProblem(what string, err error, code abi.Status) string {
	var pe *plugin.Error
	switch {
	case err == nil:
		return fmt.Sprintf("%s: succeeded, want %v", what, code)
	case !errors.As(err, &pe):
		return fmt.Sprintf("%s: %v, want a plugin error %v", what, err, code)
	case pe.Code != code:
		return fmt.Sprintf("%s: %v, want %v", what, err, code)
	}
	return ""
}

// expectClosed fails the case unless err wraps plugin.ErrClosed.
func expectClosed(t TB, what string, err error) {
	t.Helper()
	if !errors.Is(err, plugin.ErrClosed) {
		t.Errorf("%s: %v, want ErrClosed", what, err)
	}
}
