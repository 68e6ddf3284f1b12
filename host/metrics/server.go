package metrics

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Handler serves GET /metrics (Prometheus text or protobuf, as the scraper
// asks) and GET /health: 200 "ok" when the worker is ready, 503 "starting"
// before.
func (m *Metrics) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{
		Registry: m.reg, EnableOpenMetrics: true, ErrorHandling: promhttp.ContinueOnError,
	}))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if !m.Ready() {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintln(w, "starting")
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// Server is a running metrics server.
type Server struct {
	srv  *http.Server
	ln   net.Listener
	done chan error
}

// Serve listens on addr (host:port; port 0 picks one) and serves
// m.Handler until ctx ends or Close is called. Listening happens before it
// returns, so an address in use is an error here rather than a log line.
func Serve(ctx context.Context, addr string, m *Metrics) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: listen on %s: %w", addr, err)
	}
	s := &Server{
		srv: &http.Server{Handler: m.Handler(), ReadHeaderTimeout: 5 * time.Second,
			ReadTimeout: 10 * time.Second, WriteTimeout: 30 * time.Second, MaxHeaderBytes: 64 << 10},
		ln:   ln,
		done: make(chan error, 1),
	}
	go func() {
		err := s.srv.Serve(ln)
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		s.done <- err
	}()
	stop := context.AfterFunc(ctx, func() { s.Close() })
	go func() {
		err := <-s.done
		stop()
		s.done <- err
	}()
	return s, nil
}

// Addr returns the address the server listens on (with the port chosen
// when the address asked for port 0).
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the server, letting requests in progress finish for up to
// 2 s. It is safe to call more than once.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := s.srv.Shutdown(ctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics: shutdown: %w", err)
	}
	return nil
}

// Wait blocks until the server stopped and returns why (nil after Close
// or the end of Serve's context).
func (s *Server) Wait() error {
	err := <-s.done
	s.done <- err
	return err
}

// Start is the one call a worker command makes for its --metrics-addr
// flag: it makes the worker's metric set with constLabels (for example
// {"role": "prefill"}) and, when addr is not empty, serves it there until
// ctx ends. The Metrics is returned either way, so the command can pass
// m.PushObserver() or m.PullObserver() to its runtime and call
// m.SetReady(true) once it serves, whether or not anyone scrapes.
func Start(ctx context.Context, addr string, constLabels map[string]string) (*Metrics, *Server, error) {
	m := New(constLabels)
	if addr == "" {
		return m, nil, nil
	}
	s, err := Serve(ctx, addr, m)
	if err != nil {
		return nil, nil, err
	}
	return m, s, nil
}
