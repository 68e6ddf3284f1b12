package peerproc

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

// request is one line the near side sends. Op is one of open, new_agent,
// close_agent, metadata, fill, verify, clear, sum, bytes, load, send,
// notifs, exit; the other fields are its arguments.
type request struct {
	Op      string         `json:"op"`
	Plugin  string         `json:"plugin,omitempty"`
	Dirs    []string       `json:"dirs,omitempty"`
	Name    string         `json:"name,omitempty"`
	Params  []plugin.Param `json:"params,omitempty"`
	Sizes   []uint64       `json:"sizes,omitempty"`
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

// response is the line the peer process answers. Err (and, when the error
// came from the plugin, Code and PluginOp) report a failure.
type response struct {
	Err      string           `json:"err,omitempty"`
	Code     abi.Status       `json:"code,omitempty"`
	PluginOp string           `json:"plugin_op,omitempty"`
	Name     string           `json:"name,omitempty"`
	Pid      int              `json:"pid,omitempty"`
	Agent    int              `json:"agent,omitempty"`
	Caps     abi.Caps         `json:"caps,omitempty"`
	Regions  []RegionInfo     `json:"regions,omitempty"`
	Data     []byte           `json:"data,omitempty"`
	Bad      int64            `json:"bad,omitempty"`
	Batches  [][]plugin.Notif `json:"batches,omitempty"`
}

// ServeStdio serves the protocol on stdin and stdout. Anything else that
// writes to stdout (a plugin's diagnostics) is sent to stderr instead, so
// that it cannot corrupt the protocol. It returns when the near side says
// exit or closes stdin.
func ServeStdio() error {
	protoFD, err := syscall.Dup(1)
	if err != nil {
		return fmt.Errorf("peerproc: dup stdout: %w", err)
	}
	if err := syscall.Dup3(2, 1, 0); err != nil {
		return fmt.Errorf("peerproc: redirect stdout: %w", err)
	}
	out := os.NewFile(uintptr(protoFD), "peerproc-protocol")
	defer out.Close()
	return Serve(os.Stdin, out)
}

// Serve serves the protocol on r and w: it loads the plugin named by the
// first request (open) and owns the MemAgents the near side makes, closing
// them all when it returns.
func Serve(r io.Reader, w io.Writer) error {
	s := &server{agents: map[int]*MemAgent{}}
	defer s.closeAll()
	dec := json.NewDecoder(bufio.NewReader(r))
	enc := json.NewEncoder(w)
	for {
		var req request
		if err := dec.Decode(&req); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("peerproc: reading a request: %w", err)
		}
		if req.Op == "exit" {
			return enc.Encode(response{})
		}
		resp, err := s.handle(&req)
		if err != nil { // what the op got before failing (e.g. notifications) goes too
			resp.Err = err.Error()
			var pe *plugin.Error
			if errors.As(err, &pe) {
				resp.Code, resp.PluginOp, resp.Err = pe.Code, pe.Op, pe.Message
			}
		}
		if err := enc.Encode(resp); err != nil {
			return fmt.Errorf("peerproc: writing a response: %w", err)
		}
	}
}

type server struct {
	p      *plugin.Plugin
	agents map[int]*MemAgent
	next   int
}

func (s *server) closeAll() {
	for _, m := range s.agents {
		m.Close()
	}
	if s.p != nil {
		s.p.Close()
	}
}

func (s *server) handle(req *request) (response, error) {
	if req.Op == "open" {
		if s.p != nil {
			return response{}, errors.New("peerproc: plugin already open")
		}
		p, err := plugin.Load(req.Plugin, req.Dirs)
		if err != nil {
			return response{}, err
		}
		s.p = p
		return response{Name: p.Name(), Pid: os.Getpid()}, nil
	}
	if s.p == nil {
		return response{}, fmt.Errorf("peerproc: %q before open", req.Op)
	}
	if req.Op == "new_agent" {
		m, err := NewMemAgent(s.p, req.Name, req.Params, req.Sizes)
		if err != nil {
			return response{}, err
		}
		s.next++
		s.agents[s.next] = m
		return response{Agent: s.next, Caps: m.Caps(), Regions: m.Regions()}, nil
	}
	m := s.agents[req.Agent]
	if m == nil {
		return response{}, fmt.Errorf("peerproc: no agent %d", req.Agent)
	}
	var resp response
	var err error
	switch req.Op {
	case "close_agent":
		delete(s.agents, req.Agent)
		err = m.Close()
	case "metadata":
		resp.Data, err = m.Metadata()
	case "fill":
		err = m.Fill(req.Region, req.Off, req.N, req.Seed)
	case "verify":
		resp.Bad, err = m.Verify(req.Region, req.Off, req.N, req.Seed)
	case "clear":
		err = m.Clear(req.Region, req.Off, req.N)
	case "sum":
		resp.Data, err = m.Sum(req.Region, req.Off, req.N)
	case "bytes":
		resp.Data, err = m.Bytes(req.Region, req.Off, req.N)
	case "load":
		resp.Name, err = m.LoadRemote(req.Data)
	case "send":
		err = m.SendNotif(req.Peer, req.Data)
	case "notifs":
		resp.Batches, err = m.Notifs(req.Want, req.Timeout)
	default:
		err = fmt.Errorf("peerproc: unknown op %q", req.Op)
	}
	return resp, err
}
