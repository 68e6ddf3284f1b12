package conformance

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

// HelperEnv is set (to "1") in the environment of the helper process of a
// two-process run. A program that offers the helper (the conformance test
// binary, kvhost) checks it, or a hidden flag, and then calls
// ServeHelperStdio instead of doing its usual work.
const HelperEnv = "KVHOST_CONFORMANCE_HELPER"

// The helper protocol: one JSON request per line on the helper's stdin, one
// JSON response per line on its stdout, strictly in turn. The helper owns
// agents and their memory; the suite asks it to create agents, fill and
// checksum their memory, load metadata and exchange notifications. Bytes a
// test wrote into the helper are checked there (Sum), so every data test
// proves the bytes crossed the process boundary.

type helperRequest struct {
	Op      string         `json:"op"`
	Plugin  string         `json:"plugin,omitempty"`
	Dirs    []string       `json:"dirs,omitempty"`
	Name    string         `json:"name,omitempty"`
	Params  []plugin.Param `json:"params,omitempty"`
	Sizes   []int          `json:"sizes,omitempty"`
	Agent   int            `json:"agent,omitempty"`
	Region  int            `json:"region,omitempty"`
	Off     uint64         `json:"off,omitempty"`
	N       uint64         `json:"n,omitempty"`
	Seed    uint64         `json:"seed,omitempty"`
	Data    []byte         `json:"data,omitempty"`
	Peer    string         `json:"peer,omitempty"`
	Want    int            `json:"want,omitempty"`
	Timeout time.Duration  `json:"timeout,omitempty"`
}

type helperResponse struct {
	Err     string           `json:"err,omitempty"`
	Code    abi.Status       `json:"code,omitempty"` // plugin status of Err, if it came from the plugin
	Op      string           `json:"plugin_op,omitempty"`
	Agent   int              `json:"agent,omitempty"`
	Caps    abi.Caps         `json:"caps,omitempty"`
	Regions []regionInfo     `json:"regions,omitempty"`
	Data    []byte           `json:"data,omitempty"`
	Name    string           `json:"name,omitempty"`
	Batches [][]plugin.Notif `json:"batches,omitempty"`
}

// ServeHelperStdio serves the helper protocol on stdin and stdout. Anything
// else that writes to stdout (a plugin's diagnostics) is sent to stderr
// instead, so that it cannot corrupt the protocol. It returns when the suite
// says exit or closes stdin.
func ServeHelperStdio() error {
	protoFD, err := syscall.Dup(1)
	if err != nil {
		return fmt.Errorf("dup stdout: %w", err)
	}
	if err := syscall.Dup3(2, 1, 0); err != nil {
		return fmt.Errorf("redirect stdout: %w", err)
	}
	out := os.NewFile(uintptr(protoFD), "helper-protocol")
	defer out.Close()
	return ServeHelper(os.Stdin, out)
}

// ServeHelper serves the helper protocol on r and w.
func ServeHelper(r io.Reader, w io.Writer) error {
	h := &helperServer{agents: map[int]*memAgent{}}
	defer h.closeAll()
	dec := json.NewDecoder(bufio.NewReader(r))
	enc := json.NewEncoder(w)
	for {
		var req helperRequest
		if err := dec.Decode(&req); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("helper: reading request: %w", err)
		}
		if req.Op == "exit" {
			return enc.Encode(helperResponse{})
		}
		resp, err := h.handle(&req)
		if err != nil {
			resp = helperResponse{Err: err.Error()}
			var pe *plugin.Error
			if errors.As(err, &pe) {
				resp.Code, resp.Op, resp.Err = pe.Code, pe.Op, pe.Message
			}
		}
		if err := enc.Encode(resp); err != nil {
			return fmt.Errorf("helper: writing response: %w", err)
		}
	}
}

type helperServer struct {
	p      *plugin.Plugin
	agents map[int]*memAgent
	next   int
}

func (h *helperServer) closeAll() {
	for _, m := range h.agents {
		m.Close()
	}
	if h.p != nil {
		h.p.Close()
	}
}

func (h *helperServer) agent(id int) (*memAgent, error) {
	m := h.agents[id]
	if m == nil {
		return nil, fmt.Errorf("helper: no agent %d", id)
	}
	return m, nil
}

func (h *helperServer) handle(req *helperRequest) (helperResponse, error) {
	if req.Op == "open" {
		if h.p != nil {
			return helperResponse{}, errors.New("helper: plugin already open")
		}
		p, err := plugin.Load(req.Plugin, req.Dirs)
		if err != nil {
			return helperResponse{}, err
		}
		h.p = p
		return helperResponse{Name: p.Name()}, nil
	}
	if h.p == nil {
		return helperResponse{}, errors.New("helper: no plugin open")
	}
	if req.Op == "new_agent" {
		m, err := newMemAgent(h.p, req.Name, req.Params, req.Sizes)
		if err != nil {
			return helperResponse{}, err
		}
		h.next++
		h.agents[h.next] = m
		return helperResponse{Agent: h.next, Caps: m.a.Caps(), Regions: m.infos()}, nil
	}
	m, err := h.agent(req.Agent)
	if err != nil {
		return helperResponse{}, err
	}
	p := inProcPeer{m}
	switch req.Op {
	case "close_agent":
		delete(h.agents, req.Agent)
		return helperResponse{}, m.Close()
	case "metadata":
		md, err := p.Metadata()
		return helperResponse{Data: md}, err
	case "fill":
		return helperResponse{}, p.Fill(req.Region, req.Seed)
	case "sum":
		s, err := p.Sum(req.Region, req.Off, req.N)
		return helperResponse{Data: s}, err
	case "bytes":
		b, err := p.Bytes(req.Region, req.Off, req.N)
		return helperResponse{Data: b}, err
	case "load":
		name, err := p.LoadRemote(req.Data)
		return helperResponse{Name: name}, err
	case "send":
		return helperResponse{}, p.SendNotif(req.Peer, req.Data)
	case "notifs":
		b, err := p.Notifs(req.Want, req.Timeout)
		return helperResponse{Batches: b}, err
	}
	return helperResponse{}, fmt.Errorf("helper: unknown op %q", req.Op)
}

// helperHost is a peerHost whose agents live in a helper process.
type helperHost struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	dec    *json.Decoder
	enc    *json.Encoder
	plugin string
	// answerWithin bounds how long a request may go unanswered (plus the
	// request's own Timeout); a helper that does not answer in time is
	// killed, so a hung helper fails the suite instead of hanging it.
	answerWithin time.Duration

	mu     sync.Mutex // one request at a time
	broken error      // set when the helper stopped answering
}

// startHelper starts cmd as a helper and opens the plugin in it. A request
// that gets no answer within answerWithin kills the helper.
func startHelper(cmd *exec.Cmd, pluginName string, dirs []string, answerWithin time.Duration) (*helperHost, error) {
	cmd.Env = append(cmd.Environ(), HelperEnv+"=1")
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting helper %s: %w", cmd.Path, err)
	}
	h := &helperHost{cmd: cmd, stdin: stdin, dec: json.NewDecoder(bufio.NewReader(stdout)), enc: json.NewEncoder(stdin),
		plugin: pluginName, answerWithin: answerWithin}
	if _, err := h.call(helperRequest{Op: "open", Plugin: pluginName, Dirs: dirs}); err != nil {
		h.Close()
		return nil, fmt.Errorf("helper: %w", err)
	}
	return h, nil
}

func (h *helperHost) call(req helperRequest) (helperResponse, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.broken != nil {
		return helperResponse{}, h.broken
	}
	var resp helperResponse
	limit := h.answerWithin + req.Timeout
	var killed atomic.Bool
	timer := time.AfterFunc(limit, func() {
		killed.Store(true)
		h.cmd.Process.Kill() // ends the Decode below
	})
	defer timer.Stop()
	if err := h.enc.Encode(req); err != nil {
		h.broken = fmt.Errorf("helper process: sending %s: %w", req.Op, err)
		return resp, h.broken
	}
	if err := h.dec.Decode(&resp); err != nil {
		if killed.Load() {
			err = fmt.Errorf("no answer within %v; killed it", limit)
		}
		h.broken = fmt.Errorf("helper process: no answer to %s: %w", req.Op, err)
		return resp, h.broken
	}
	if resp.Err != "" || resp.Code != 0 {
		if resp.Code != 0 {
			return resp, &plugin.Error{Plugin: h.plugin, Op: resp.Op, Code: resp.Code, Message: resp.Err + " (in the helper process)"}
		}
		return resp, errors.New(resp.Err)
	}
	return resp, nil
}

func (h *helperHost) NewAgent(name string, params []plugin.Param, sizes []int) (peerAgent, error) {
	resp, err := h.call(helperRequest{Op: "new_agent", Name: name, Params: params, Sizes: sizes})
	if err != nil {
		return nil, err
	}
	return &helperPeer{h: h, id: resp.Agent, name: name, caps: resp.Caps, regions: resp.Regions}, nil
}

// Close asks the helper to exit and waits for it; a helper that does not
// exit within 10 s is killed.
func (h *helperHost) Close() error {
	h.mu.Lock()
	if h.broken == nil {
		h.enc.Encode(helperRequest{Op: "exit"})
	}
	h.broken = errors.New("helper closed")
	h.stdin.Close()
	h.mu.Unlock()
	done := make(chan error, 1)
	go func() { done <- h.cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		h.cmd.Process.Kill()
		<-done
		return errors.New("helper process did not exit; killed")
	}
}

// helperPeer is an agent in the helper process.
type helperPeer struct {
	h       *helperHost
	id      int
	name    string
	caps    abi.Caps
	regions []regionInfo
}

func (p *helperPeer) Name() string          { return p.name }
func (p *helperPeer) Caps() abi.Caps        { return p.caps }
func (p *helperPeer) Regions() []regionInfo { return p.regions }

func (p *helperPeer) Metadata() ([]byte, error) {
	resp, err := p.h.call(helperRequest{Op: "metadata", Agent: p.id})
	return resp.Data, err
}

func (p *helperPeer) Fill(region int, seed uint64) error {
	_, err := p.h.call(helperRequest{Op: "fill", Agent: p.id, Region: region, Seed: seed})
	return err
}

func (p *helperPeer) Sum(region int, off, n uint64) ([]byte, error) {
	resp, err := p.h.call(helperRequest{Op: "sum", Agent: p.id, Region: region, Off: off, N: n})
	return resp.Data, err
}

func (p *helperPeer) Bytes(region int, off, n uint64) ([]byte, error) {
	resp, err := p.h.call(helperRequest{Op: "bytes", Agent: p.id, Region: region, Off: off, N: n})
	return resp.Data, err
}

func (p *helperPeer) LoadRemote(md []byte) (string, error) {
	resp, err := p.h.call(helperRequest{Op: "load", Agent: p.id, Data: md})
	return resp.Name, err
}

func (p *helperPeer) SendNotif(peer string, msg []byte) error {
	if msg == nil {
		msg = []byte{}
	}
	_, err := p.h.call(helperRequest{Op: "send", Agent: p.id, Peer: peer, Data: msg})
	return err
}

func (p *helperPeer) Notifs(want int, timeout time.Duration) ([][]plugin.Notif, error) {
	resp, err := p.h.call(helperRequest{Op: "notifs", Agent: p.id, Want: want, Timeout: timeout})
	return resp.Batches, err
}

func (p *helperPeer) Close() error {
	_, err := p.h.call(helperRequest{Op: "close_agent", Agent: p.id})
	return err
}
