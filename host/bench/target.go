package bench

import (
	"errors"
	"fmt"
	"io"

	"github.com/kvhost/kvhost/host/internal/peerproc"
	"github.com/kvhost/kvhost/host/plugin"
)

// TargetEnv is set to "1" in the environment of the target process, so a
// program that re-executes itself (kvhost, a test binary) can tell it must
// call ServeTargetStdio.
const TargetEnv = "KVHOST_BENCH_TARGET"

// targetAgentName and initiatorAgentName are the agents' names; the fake
// plugin and NIXL want them unique among peers.
const (
	targetAgentName    = "bench-target"
	initiatorAgentName = "bench-initiator"
)

// ServeTargetStdio serves the target process's protocol on stdin and
// stdout: the target process is a peerproc peer process (see
// peerproc.ServeStdio), which owns the target agent and its memory.
func ServeTargetStdio() error { return peerproc.ServeStdio() }

// ServeTarget serves the target protocol on r and w.
func ServeTarget(r io.Reader, w io.Writer) error { return peerproc.Serve(r, w) }

// target is the passive side of every transfer: an agent owning one
// registered buffer (region 0). The initiator writes into it (WRITE) or
// reads from it (READ). It lives in this process (a peerproc.MemAgent) or
// in the target process (a peerproc.RemoteAgent), which checks its own
// memory, so the bytes are proven to have crossed the process boundary.
type target struct {
	peer peerproc.Peer
	mem  *peerproc.MemAgent // the agent when it is in this process
	proc *peerproc.Proc     // the target process, or nil
	info targetMeta
}

type targetMeta struct {
	Metadata []byte
	Addr     uint64 // buffer start in the target's address space
	Size     uint64 // buffer length
	Pid      int    // target process (this one for a local target)
	Blob     []byte // region blob, when the plugin exports them
}

// newLocalTarget makes the target agent in this process, with the
// initiator's plugin.
func newLocalTarget(p *plugin.Plugin, params []plugin.Param, size uint64) (*target, error) {
	m, err := peerproc.NewMemAgent(p, targetAgentName, params, []uint64{size})
	if err != nil {
		return nil, fmt.Errorf("bench: target agent: %w", err)
	}
	return newTarget(m, m, nil)
}

// startProcTarget starts the target process (cfg.TargetCommand), which
// loads the plugin itself and makes the target agent.
func startProcTarget(cfg *Config, params []plugin.Param, size uint64) (*target, error) {
	cmd, err := cfg.TargetCommand()
	if err != nil {
		return nil, fmt.Errorf("bench: target command: %w", err)
	}
	proc, err := peerproc.Start(cmd, cfg.Plugin, cfg.Dirs, peerproc.Options{Env: TargetEnv, What: "bench target process"})
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	a, err := proc.NewAgent(targetAgentName, params, []uint64{size})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("bench: target agent: %w", err), proc.Close())
	}
	return newTarget(a, nil, proc)
}

func newTarget(peer peerproc.Peer, mem *peerproc.MemAgent, proc *peerproc.Proc) (*target, error) {
	t := &target{peer: peer, mem: mem, proc: proc}
	r := peer.Regions()[0]
	t.info = targetMeta{Addr: r.Addr, Size: r.Len, Pid: peer.Pid(), Blob: r.Blob}
	var err error
	if t.info.Metadata, err = peer.Metadata(); err != nil {
		return nil, errors.Join(fmt.Errorf("bench: target metadata: %w", err), t.close())
	}
	return t, nil
}

func (t *target) meta() targetMeta { return t.info }

// local returns the buffer when it is in this process, else nil.
func (t *target) local() buffer {
	if t.mem == nil {
		return nil
	}
	return t.mem.Bufs[0]
}

func (t *target) fill(n, seed uint64) error { return t.peer.Fill(0, 0, n, seed) }
func (t *target) clear(n uint64) error      { return t.peer.Clear(0, 0, n) }

// verify returns the offset of the first byte of [0,n) that differs from
// the pattern of seed, or -1.
func (t *target) verify(n, seed uint64) (int64, error) { return t.peer.Verify(0, 0, n, seed) }

// close destroys the agent (which deregisters the buffer) before its
// buffer is unmapped, and stops the target process.
func (t *target) close() error {
	err := t.peer.Close()
	if t.proc != nil {
		err = errors.Join(err, t.proc.Close())
	}
	return err
}
