package serve

import (
	"context"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/serve/client"
)

// newTestServer starts a sidecar on the fake plugin, closed when the test
// ends.
func newTestServer(t testing.TB, mod ...func(*Config)) *Server {
	t.Helper()
	cfg := Config{Control: testEndpoint(t), Plugin: faketest.Plugin(t), Backend: "fake"}
	for _, m := range mod {
		m(&cfg)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s.Close(ctx)
	})
	return s
}

func dial(t testing.TB, s *Server) *client.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := client.Dial(ctx, s.Endpoint(), client.Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}
