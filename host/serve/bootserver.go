package serve

import (
	"net"
	"strconv"

	"github.com/kvhost/kvhost/host/bootstrap"
)

// The sidecar's bootstrap server (docs/engine-api.md, "SGLang push
// rooms"): SGLang's KVBootstrapServer of
// python/sglang/srt/disaggregation/common/conn.py, one per sidecar, which
// the sidecar's prefill ranks (and any other) register with. Unlike
// SGLang's, it outlives the engines that registered: a rank that closes
// is deregistered, so decodes do not keep being sent to it.

func init() {
	registerOp("start_bootstrap", opStartBootstrap)
}

// opStartBootstrap starts the bootstrap server, or answers with the one
// running when the request's port is 0 or the port it serves.
func opStartBootstrap(s *session, r *request) (Fields, error) {
	host, err := r.optStr("host", s.srv.cfg.Host)
	if err != nil {
		return nil, err
	}
	port, err := r.int("port")
	if err != nil {
		return nil, err
	}
	if port > 65535 {
		return nil, badValue("port", "%d is out of range", port)
	}
	srv := s.srv
	srv.bootMu.Lock()
	defer srv.bootMu.Unlock()
	if srv.boot != nil {
		if port == 0 || port == srv.bootPort {
			return Fields{{"addr", srv.boot.Addr()}}, nil
		}
		return nil, errorf(CodeExists, "the bootstrap server already serves %s (requested port %d)", srv.boot.Addr(), port)
	}
	b := bootstrap.NewServer(bootstrap.WithLogger(srv.log))
	run, berr := b.Start(net.JoinHostPort(host, strconv.Itoa(port)))
	if berr != nil {
		return nil, errorf(CodeBackend, "bootstrap server: %v", berr)
	}
	// The port served, not the one asked for: port 0 picked it.
	_, p, _ := net.SplitHostPort(run.Addr())
	srv.bootPort, _ = strconv.Atoi(p)
	srv.boot, srv.bootSrv = run, b
	return Fields{{"addr", run.Addr()}}, nil
}

// deregisterRank removes a closing prefill rank from the sidecar's
// bootstrap server, if it is registered there at its own address (a rank
// registered with another process's server is that process's to forget).
func (s *Server) deregisterRank(reg bootstrap.Registration) {
	s.bootMu.Lock()
	b := s.bootSrv
	s.bootMu.Unlock()
	if b != nil {
		b.Deregister(reg)
	}
}
