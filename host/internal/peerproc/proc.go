package peerproc

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

// Options says how to run a peer process.
type Options struct {
	// Env is the environment variable Start sets to "1" in the process: the
	// re-executed program sees it (or a hidden flag) and calls ServeStdio.
	Env string
	// What names the process in errors, e.g. "helper process".
	What string
	// AnswerWithin bounds how long a request may go unanswered (plus the
	// request's own timeout); a process that does not answer in time is
	// killed. Default 30 s.
	AnswerWithin time.Duration
	// ExitWithin bounds how long Close waits for the process to exit
	// before it kills it. Default 10 s.
	ExitWithin time.Duration
	// Stderr, when set, also receives the process's stderr; its last 8 KiB
	// are kept either way and quoted in errors.
	Stderr io.Writer
}

// Proc is a running peer process.
type Proc struct {
	cmd    *exec.Cmd
	opts   Options
	plugin string
	pid    int
	in     io.WriteCloser
	out    *os.File
	dec    *json.Decoder
	enc    *json.Encoder
	stderr *tailBuffer
	exited chan struct{} // closed when cmd.Wait returned; then waitErr is set
	wait   error

	mu     sync.Mutex // one request at a time
	broken error      // set once the process stopped answering or was closed
}

// Start starts cmd as a peer process that loads the plugin called
// pluginName from dirs. The command must serve the protocol on its stdin
// and stdout when opts.Env is set (ServeStdio).
func Start(cmd *exec.Cmd, pluginName string, dirs []string, opts Options) (*Proc, error) {
	if opts.What == "" {
		opts.What = "peer process"
	}
	if opts.AnswerWithin == 0 {
		opts.AnswerWithin = 30 * time.Second
	}
	if opts.ExitWithin == 0 {
		opts.ExitWithin = 10 * time.Second
	}
	p := &Proc{cmd: cmd, opts: opts, plugin: pluginName, stderr: &tailBuffer{max: 8 << 10}, exited: make(chan struct{})}
	if opts.Env != "" {
		cmd.Env = append(cmd.Environ(), opts.Env+"=1")
	}
	cmd.Stderr = p.stderr
	if opts.Stderr != nil {
		cmd.Stderr = io.MultiWriter(p.stderr, opts.Stderr)
	}
	var err error
	if p.in, err = cmd.StdinPipe(); err != nil {
		return nil, fmt.Errorf("%s: stdin: %w", opts.What, err)
	}
	// A plain pipe rather than StdoutPipe: Wait (run as soon as the process
	// starts, to learn when it dies) must not close our end while a
	// response is still unread.
	out, pw, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("%s: stdout: %w", opts.What, err)
	}
	cmd.Stdout = pw
	err = cmd.Start()
	pw.Close()
	if err != nil {
		out.Close()
		p.in.Close()
		return nil, fmt.Errorf("starting the %s %s: %w", opts.What, cmd.Path, err)
	}
	p.out = out
	go func() {
		p.wait = cmd.Wait()
		close(p.exited)
	}()
	p.dec = json.NewDecoder(bufio.NewReader(out))
	p.enc = json.NewEncoder(p.in)
	resp, err := p.call(request{Op: "open", Plugin: pluginName, Dirs: dirs})
	if err != nil {
		p.Close()
		return nil, err
	}
	p.pid = resp.Pid
	return p, nil
}

// Pid returns the process's pid.
func (p *Proc) Pid() int { return p.pid }

// call sends one request and waits for its answer. A process that does not
// answer within AnswerWithin plus req.Timeout is killed; after any failure
// to talk to it, every call fails.
func (p *Proc) call(req request) (response, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var resp response
	if p.broken != nil {
		return resp, p.broken
	}
	limit := p.opts.AnswerWithin + req.Timeout
	var killed atomic.Bool
	timer := time.AfterFunc(limit, func() {
		killed.Store(true)
		p.cmd.Process.Kill() // ends the Decode below
	})
	defer timer.Stop()
	if err := p.enc.Encode(req); err != nil {
		p.broken = p.died(fmt.Errorf("%s: sending %s: %w", p.opts.What, req.Op, err))
		return resp, p.broken
	}
	if err := p.dec.Decode(&resp); err != nil {
		if killed.Load() {
			err = fmt.Errorf("no answer within %v; killed it", limit)
		}
		p.broken = p.died(fmt.Errorf("%s: no answer to %s: %w", p.opts.What, req.Op, err))
		return resp, p.broken
	}
	switch {
	case resp.Code != 0:
		return resp, &plugin.Error{Plugin: p.plugin, Op: resp.PluginOp, Code: resp.Code, Message: resp.Err + " (in the " + p.opts.What + ")"}
	case resp.Err != "":
		return resp, fmt.Errorf("%s: %s: %s", p.opts.What, req.Op, resp.Err)
	}
	return resp, nil
}

// died adds the process's exit status (if it exits within a second) and
// the tail of its stderr to err.
func (p *Proc) died(err error) error {
	select {
	case <-p.exited:
		return fmt.Errorf("%w (exited: %v; stderr: %q)", err, p.wait, p.stderr.String())
	case <-time.After(time.Second):
		return fmt.Errorf("%w (stderr: %q)", err, p.stderr.String())
	}
}

// NewAgent makes an agent in the process with one registered buffer per
// size.
func (p *Proc) NewAgent(name string, params []plugin.Param, sizes []uint64) (*RemoteAgent, error) {
	resp, err := p.call(request{Op: "new_agent", Name: name, Params: params, Sizes: sizes})
	if err != nil {
		return nil, err
	}
	return &RemoteAgent{p: p, id: resp.Agent, name: name, caps: resp.Caps, regions: resp.Regions}, nil
}

// Kill kills the process and waits for it to exit (to prove that a peer's
// death is survived); every later call fails.
func (p *Proc) Kill() {
	p.cmd.Process.Kill()
	<-p.exited
}

// Close asks the process to exit and waits for it; a process that does not
// exit within ExitWithin is killed. It returns an error, with the tail of
// the process's stderr, when the process failed.
func (p *Proc) Close() error {
	p.mu.Lock()
	if p.broken == nil {
		p.enc.Encode(request{Op: "exit"})
	}
	p.broken = fmt.Errorf("%s: closed", p.opts.What)
	p.in.Close()
	p.mu.Unlock()
	defer p.out.Close()
	select {
	case <-p.exited:
	case <-time.After(p.opts.ExitWithin):
		p.cmd.Process.Kill()
		<-p.exited
		return fmt.Errorf("%s did not exit within %v; killed (stderr: %q)", p.opts.What, p.opts.ExitWithin, p.stderr.String())
	}
	if p.wait != nil {
		return fmt.Errorf("%s: %w (stderr: %q)", p.opts.What, p.wait, p.stderr.String())
	}
	return nil
}

// RemoteAgent is a MemAgent in a peer process.
type RemoteAgent struct {
	p       *Proc
	id      int
	name    string
	caps    abi.Caps
	regions []RegionInfo
}

var _ Peer = (*RemoteAgent)(nil)

func (r *RemoteAgent) Name() string          { return r.name }
func (r *RemoteAgent) Caps() abi.Caps        { return r.caps }
func (r *RemoteAgent) Pid() int              { return r.p.pid }
func (r *RemoteAgent) Regions() []RegionInfo { return r.regions }

func (r *RemoteAgent) Metadata() ([]byte, error) {
	resp, err := r.p.call(request{Op: "metadata", Agent: r.id})
	return resp.Data, err
}

func (r *RemoteAgent) Fill(region int, off, n, seed uint64) error {
	_, err := r.p.call(request{Op: "fill", Agent: r.id, Region: region, Off: off, N: n, Seed: seed})
	return err
}

func (r *RemoteAgent) Verify(region int, off, n, seed uint64) (int64, error) {
	resp, err := r.p.call(request{Op: "verify", Agent: r.id, Region: region, Off: off, N: n, Seed: seed})
	return resp.Bad, err
}

func (r *RemoteAgent) Clear(region int, off, n uint64) error {
	_, err := r.p.call(request{Op: "clear", Agent: r.id, Region: region, Off: off, N: n})
	return err
}

func (r *RemoteAgent) Sum(region int, off, n uint64) ([]byte, error) {
	resp, err := r.p.call(request{Op: "sum", Agent: r.id, Region: region, Off: off, N: n})
	return resp.Data, err
}

func (r *RemoteAgent) Bytes(region int, off, n uint64) ([]byte, error) {
	resp, err := r.p.call(request{Op: "bytes", Agent: r.id, Region: region, Off: off, N: n})
	return resp.Data, err
}

func (r *RemoteAgent) LoadRemote(md []byte) (string, error) {
	resp, err := r.p.call(request{Op: "load", Agent: r.id, Data: md})
	return resp.Name, err
}

func (r *RemoteAgent) SendNotif(peer string, msg []byte) error {
	if msg == nil {
		msg = []byte{} // JSON keeps an empty message apart from none
	}
	_, err := r.p.call(request{Op: "send", Agent: r.id, Peer: peer, Data: msg})
	return err
}

func (r *RemoteAgent) Notifs(want int, timeout time.Duration) ([][]plugin.Notif, error) {
	resp, err := r.p.call(request{Op: "notifs", Agent: r.id, Want: want, Timeout: timeout})
	return resp.Batches, err
}

func (r *RemoteAgent) Close() error {
	_, err := r.p.call(request{Op: "close_agent", Agent: r.id})
	return err
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
