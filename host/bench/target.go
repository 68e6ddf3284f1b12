package bench

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/abi"
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

// target is the passive side of every transfer: an agent owning one
// registered buffer. The initiator writes into it (WRITE) or reads from it
// (READ). It lives in this process (localTarget) or in the target process
// (procTarget).
type target interface {
	// meta returns what the initiator needs to reach the buffer.
	meta() targetMeta
	fill(n, seed uint64) error
	clear(n uint64) error
	// verify returns the offset of the first byte of [0,n) that differs
	// from the pattern of seed, or -1.
	verify(n, seed uint64) (int64, error)
	// local returns the buffer when it is in this process, else nil.
	local() buffer
	close() error
}

type targetMeta struct {
	Metadata []byte `json:"metadata"`
	Addr     uint64 `json:"addr"`           // buffer start in the target's address space
	Size     uint64 `json:"size"`           // buffer length
	Pid      int    `json:"pid"`            // target process (this one for a local target)
	Blob     []byte `json:"blob,omitempty"` // region blob, when the plugin exports them
}

// targetSide is the target agent and its memory, wherever it lives.
type targetSide struct {
	p    *plugin.Plugin
	own  bool // p was opened for this side and is closed with it
	ag   *plugin.Agent
	reg  *plugin.Region
	buf  buffer
	info targetMeta
}

func newTargetSide(p *plugin.Plugin, own bool, params []plugin.Param, size uint64) (*targetSide, error) {
	t := &targetSide{p: p, own: own}
	if err := t.init(params, size); err != nil {
		t.close()
		return nil, err
	}
	return t, nil
}

func (t *targetSide) init(params []plugin.Param, size uint64) error {
	var err error
	if t.ag, err = t.p.NewAgent(targetAgentName, params...); err != nil {
		return fmt.Errorf("bench: target agent: %w", err)
	}
	if t.buf, err = mapBuffer(size); err != nil {
		return err
	}
	regs, err := t.ag.Register([]abi.MemDesc{{Addr: t.buf.addr(), Len: size, MemKind: abi.DRAM}})
	if err != nil {
		return fmt.Errorf("bench: target register: %w", err)
	}
	t.reg = regs[0]
	t.info = targetMeta{Addr: t.buf.addr(), Size: size, Pid: os.Getpid()}
	if t.info.Metadata, err = t.ag.LocalMetadata(); err != nil {
		return fmt.Errorf("bench: target metadata: %w", err)
	}
	if t.ag.Caps()&abi.CapRemoteBlob != 0 {
		if t.info.Blob, err = t.reg.Export(); err != nil {
			return fmt.Errorf("bench: target region export: %w", err)
		}
	}
	return nil
}

func (t *targetSide) meta() targetMeta          { return t.info }
func (t *targetSide) local() buffer             { return t.buf }
func (t *targetSide) fill(n, seed uint64) error { fill(t.buf, n, seed); return nil }
func (t *targetSide) clear(n uint64) error      { clear0(t.buf, n); return nil }
func (t *targetSide) verify(n, seed uint64) (int64, error) {
	return verify(t.buf, n, seed), nil
}

// close destroys the agent (which deregisters the buffer) before unmapping
// the buffer.
func (t *targetSide) close() error {
	var errs []error
	if t.ag != nil {
		errs = append(errs, t.ag.Close())
	}
	if t.own && t.p != nil {
		errs = append(errs, t.p.Close())
	}
	errs = append(errs, t.buf.free())
	t.buf = nil
	return errors.Join(errs...)
}

// The target protocol: one JSON request per line, one JSON response per
// line, strictly in turn. The first request is "init".
type targetRequest struct {
	Op     string         `json:"op"` // init, fill, clear, verify, exit
	Plugin string         `json:"plugin,omitempty"`
	Dirs   []string       `json:"dirs,omitempty"`
	Params []plugin.Param `json:"params,omitempty"`
	Size   uint64         `json:"size,omitempty"`
	N      uint64         `json:"n,omitempty"`
	Seed   uint64         `json:"seed,omitempty"`
}

type targetResponse struct {
	Err  string      `json:"err,omitempty"`
	Meta *targetMeta `json:"meta,omitempty"`
	Bad  int64       `json:"bad,omitempty"` // verify: first wrong offset or -1
}

// ServeTargetStdio serves the target protocol on stdin and stdout. Anything
// else that writes to stdout (a plugin's diagnostics) goes to stderr, so it
// cannot corrupt the protocol. It returns when the initiator says exit or
// closes stdin.
func ServeTargetStdio() error {
	protoFD, err := syscall.Dup(1)
	if err != nil {
		return fmt.Errorf("bench target: dup stdout: %w", err)
	}
	if err := syscall.Dup3(2, 1, 0); err != nil {
		return fmt.Errorf("bench target: redirect stdout: %w", err)
	}
	out := os.NewFile(uintptr(protoFD), "bench-target-protocol")
	defer out.Close()
	return ServeTarget(os.Stdin, out)
}

// ServeTarget serves the target protocol on r and w.
func ServeTarget(r io.Reader, w io.Writer) error {
	dec := json.NewDecoder(bufio.NewReader(r))
	enc := json.NewEncoder(w)
	var side *targetSide
	defer func() {
		if side != nil {
			side.close()
		}
	}()
	for {
		var req targetRequest
		if err := dec.Decode(&req); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("bench target: reading request: %w", err)
		}
		var resp targetResponse
		var err error
		switch {
		case req.Op == "exit":
			return enc.Encode(resp)
		case req.Op == "init" && side == nil:
			var p *plugin.Plugin
			if p, err = plugin.Load(req.Plugin, req.Dirs); err == nil {
				if side, err = newTargetSide(p, true, req.Params, req.Size); err == nil {
					m := side.meta()
					resp.Meta = &m
				}
			}
		case side == nil:
			err = fmt.Errorf("request %q before init", req.Op)
		case req.Op == "fill" && req.N <= side.info.Size:
			err = side.fill(req.N, req.Seed)
		case req.Op == "clear" && req.N <= side.info.Size:
			err = side.clear(req.N)
		case req.Op == "verify" && req.N <= side.info.Size:
			resp.Bad, err = side.verify(req.N, req.Seed)
		default:
			err = fmt.Errorf("bad request %q (n=%d, buffer %d)", req.Op, req.N, side.info.Size)
		}
		if err != nil {
			resp.Err = err.Error()
		}
		if err := enc.Encode(resp); err != nil {
			return fmt.Errorf("bench target: writing response: %w", err)
		}
	}
}

// procTarget is a target in a child process.
type procTarget struct {
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *os.File
	dec    *json.Decoder
	stderr *tailBuffer
	info   targetMeta
	waited chan error
}

func startProcTarget(cfg *Config, size uint64) (*procTarget, error) {
	cmd, err := cfg.TargetCommand()
	if err != nil {
		return nil, fmt.Errorf("bench: target command: %w", err)
	}
	cmd.Env = append(os.Environ(), TargetEnv+"=1")
	t := &procTarget{cmd: cmd, stderr: &tailBuffer{max: 8 << 10}, waited: make(chan error, 1)}
	cmd.Stderr = t.stderr
	if t.in, err = cmd.StdinPipe(); err != nil {
		return nil, fmt.Errorf("bench: target stdin: %w", err)
	}
	// A plain pipe rather than StdoutPipe: Wait (run as soon as the
	// process starts, to learn when it dies) must not close our end while
	// a response is still unread.
	out, pw, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("bench: target stdout: %w", err)
	}
	cmd.Stdout = pw
	err = cmd.Start()
	pw.Close()
	if err != nil {
		out.Close()
		return nil, fmt.Errorf("bench: starting the target process %s: %w", cmd.Path, err)
	}
	t.out = out
	go func() { t.waited <- cmd.Wait() }()
	t.dec = json.NewDecoder(bufio.NewReader(out))
	resp, err := t.call(targetRequest{Op: "init", Plugin: cfg.Plugin, Dirs: cfg.Dirs, Params: cfg.Params, Size: size})
	if err != nil {
		t.close()
		return nil, err
	}
	if resp.Meta == nil {
		t.close()
		return nil, errors.New("bench: target process sent no metadata")
	}
	t.info = *resp.Meta
	return t, nil
}

func (t *procTarget) call(req targetRequest) (targetResponse, error) {
	var resp targetResponse
	if err := json.NewEncoder(t.in).Encode(req); err != nil {
		return resp, t.died(fmt.Errorf("bench: target process: sending %s: %w", req.Op, err))
	}
	if err := t.dec.Decode(&resp); err != nil {
		return resp, t.died(fmt.Errorf("bench: target process: waiting for %s: %w", req.Op, err))
	}
	if resp.Err != "" {
		return resp, fmt.Errorf("bench: target process: %s: %s", req.Op, resp.Err)
	}
	return resp, nil
}

// died adds the target's exit status and the tail of its stderr to err.
func (t *procTarget) died(err error) error {
	select {
	case werr := <-t.waited:
		t.waited <- werr
		return fmt.Errorf("%w (target exited: %v; stderr: %q)", err, werr, t.stderr.String())
	case <-time.After(time.Second):
		return fmt.Errorf("%w (stderr: %q)", err, t.stderr.String())
	}
}

func (t *procTarget) meta() targetMeta { return t.info }
func (t *procTarget) local() buffer    { return nil }
func (t *procTarget) fill(n, seed uint64) error {
	_, err := t.call(targetRequest{Op: "fill", N: n, Seed: seed})
	return err
}
func (t *procTarget) clear(n uint64) error {
	_, err := t.call(targetRequest{Op: "clear", N: n})
	return err
}
func (t *procTarget) verify(n, seed uint64) (int64, error) {
	resp, err := t.call(targetRequest{Op: "verify", N: n, Seed: seed})
	return resp.Bad, err
}

// close asks the target to exit and waits for it; a target that does not
// exit within 5 s is killed.
func (t *procTarget) close() error {
	_ = json.NewEncoder(t.in).Encode(targetRequest{Op: "exit"})
	t.in.Close()
	defer t.out.Close()
	select {
	case err := <-t.waited:
		t.waited <- err
		if err != nil {
			return fmt.Errorf("bench: target process: %w (stderr: %q)", err, t.stderr.String())
		}
		return nil
	case <-time.After(5 * time.Second):
		t.cmd.Process.Kill()
		err := <-t.waited
		t.waited <- err
		return fmt.Errorf("bench: target process did not exit; killed (stderr: %q)", t.stderr.String())
	}
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = append(t.b[:0], t.b[len(t.b)-t.max:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(bytes.TrimSpace(t.b))
}
