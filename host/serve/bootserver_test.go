package serve

import (
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
)

// TestStartBootstrapSamePort: start_bootstrap for the port the server
// serves (the one port 0 picked) or port 0 answers its addr; another
// port is exists.
func TestStartBootstrapSamePort(t *testing.T) {
	s := newTestServer(t)
	c := dial(t, s)
	ctx := testCtx(t)
	addr, err := c.StartBootstrap(ctx, "127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	_, p, _ := net.SplitHostPort(addr)
	port, _ := strconv.Atoi(p)
	for _, ask := range []int{port, 0} {
		if got, err := c.StartBootstrap(ctx, "127.0.0.1", ask); err != nil || got != addr {
			t.Fatalf("start_bootstrap port %d: %q %v, want %q", ask, got, err, addr)
		}
	}
	other := port + 1
	if other > 65535 {
		other = port - 1
	}
	if _, err := c.StartBootstrap(ctx, "127.0.0.1", other); !client.IsCode(err, CodeExists) {
		t.Fatalf("start_bootstrap of another port: %v, want exists", err)
	}
}

// TestDeadPrefillDeregistered: a prefill engine that leaves is
// deregistered from its sidecar's bootstrap server. Its rank's route is
// 404 and /health 503 at once; a decode that never talked to it fails a
// new room at once (the route lookup, as SGLang's decode on a 404), and
// one that had (addresses cached) fails its new room by its heartbeat,
// both well before the 30 s a send to the dead rank would wait.
func TestDeadPrefillDeregistered(t *testing.T) {
	ps := newTestServer(t)
	// The decode that talked to the prefill checks its bootstrap server
	// often (the wait below is for an event, not a timing bound).
	ds := newTestServer(t, func(c *Config) { c.Settings = push.Settings{HeartbeatInterval: 20 * time.Millisecond} })
	admin := dial(t, ps)
	ctx := testCtx(t)
	boot, err := admin.StartBootstrap(ctx, "127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	pre := newEngine(t, ps, "prefill", "nixl", memDRAM, smallShape, 1, boot)
	old := newEngine(t, ds, "decode", "nixl", memDRAM, smallShape, 1, "")
	run(t, pre, old, boot, []fakeengine.Request{{Room: 1, Tokens: 8}})
	bc := bootstrap.NewClient(boot)
	if _, err := bc.Route(ctx, 0, 0, 0, 0); err != nil {
		t.Fatalf("route of the live rank: %v", err)
	}

	pre.c.Close()
	waitFor(t, "prefill session torn down", func() bool { return ps.Sessions() == 1 })
	if _, err := bc.Route(ctx, 0, 0, 0, 0); !bootstrap.IsNotFound(err) {
		t.Fatalf("route of the dead rank: %v, want 404", err)
	}
	if err := bc.Health(ctx); !bootstrap.IsNotReady(err) {
		t.Fatalf("health with the rank gone: %v, want 503", err)
	}

	fresh := newEngine(t, newTestServer(t), "decode", "nixl", memDRAM, smallShape, 1, "")
	for _, d := range []struct {
		name string
		e    *engine
		want []string
	}{
		{"fresh decode", fresh, []string{"Could not fetch bootstrap info"}},
		{"decode that cached the rank", old, []string{"Could not fetch bootstrap info", "Lost connection with prefill instance"}},
	} {
		r := d.e.ranks[0]
		if err := d.e.c.ReceiverCreate(ctx, r.ID, 2, boot, -1); err != nil {
			t.Fatal(err)
		}
		e, err := d.e.w.Wait(ctx, r.ID, 2, client.StateWaitingForInput)
		if err == nil && e.State == client.StateWaitingForInput {
			// Bootstrapped from its cache: the heartbeat fails it.
			e, err = d.e.w.Wait(ctx, r.ID, 2, client.StateSuccess)
		}
		if err != nil {
			t.Fatalf("%s: %v", d.name, err)
		}
		ok := e.State == client.StateFailed
		if ok {
			ok = false
			for _, w := range d.want {
				ok = ok || strings.Contains(e.Reason, w)
			}
		}
		if !ok {
			t.Fatalf("%s: room to the dead prefill: state %d reason %q, want Failed with one of %q", d.name, e.State, e.Reason, d.want)
		}
	}
}
