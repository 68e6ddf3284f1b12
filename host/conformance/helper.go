package conformance

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"time"

	"github.com/kvhost/kvhost/host/internal/peerproc"
	"github.com/kvhost/kvhost/host/plugin"
)

// HelperEnv is set (to "1") in the environment of the helper process of a
// two-process run. A program that offers the helper (the conformance test
// binary, kvhost) checks it, or a hidden flag, and then calls
// ServeHelperStdio instead of doing its usual work.
const HelperEnv = "KVHOST_CONFORMANCE_HELPER"

// The helper process is a peerproc peer process: it owns agents and their
// memory; the suite asks it to create agents, fill and checksum their
// memory, load metadata and exchange notifications. Bytes a test wrote
// into the helper are checked there (Sum), so every data test proves the
// bytes crossed the process boundary.

// ServeHelperStdio serves the helper protocol on stdin and stdout (see
// peerproc.ServeStdio).
func ServeHelperStdio() error { return peerproc.ServeStdio() }

// ServeHelper serves the helper protocol on r and w.
func ServeHelper(r io.Reader, w io.Writer) error { return peerproc.Serve(r, w) }

// helperHost is a peerHost whose agents live in a helper process.
type helperHost struct{ *peerproc.Proc }

// startHelper starts cmd as a helper and opens the plugin in it. A request
// that gets no answer within answerWithin (plus its own timeout) kills the
// helper, so a hung helper fails the suite instead of hanging it.
func startHelper(cmd *exec.Cmd, pluginName string, dirs []string, answerWithin time.Duration) (*helperHost, error) {
	p, err := peerproc.Start(cmd, pluginName, dirs, peerproc.Options{
		Env: HelperEnv, What: "helper process", AnswerWithin: answerWithin, Stderr: os.Stderr,
	})
	if err != nil {
		return nil, fmt.Errorf("helper: %w", err)
	}
	return &helperHost{p}, nil
}

func (h *helperHost) NewAgent(name string, params []plugin.Param, sizes []int) (peerproc.Peer, error) {
	a, err := h.Proc.NewAgent(name, params, u64s(sizes))
	if err != nil {
		return nil, err
	}
	return a, nil
}
