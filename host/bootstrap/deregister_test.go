package bootstrap

import (
	"context"
	"testing"
)

// TestDeregister: a rank that is gone answers 404 at once (decodes fail
// the room instead of sending to a dead socket), the layout is still
// served, /health fails until the deployment is whole again; only the
// address registered is removed; once every rank left, another layout
// may register.
func TestDeregister(t *testing.T) {
	s, c := start(t)
	ctx := context.Background()
	r0, r1 := reg(2, 0, 1, 0), reg(2, 1, 1, 0)
	for _, r := range []Registration{r0, r1} {
		if err := c.Register(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	stale := r1
	stale.RankPort++
	if s.Deregister(stale) {
		t.Fatal("Deregister removed a rank registered at another address")
	}
	if !s.Deregister(r1) || s.Deregister(r1) {
		t.Fatal("Deregister of a registered rank, then again")
	}
	if _, err := c.Route(ctx, 0, 0, 1, 0); !IsNotFound(err) {
		t.Fatalf("route of the deregistered rank: %v, want 404", err)
	}
	if info, err := c.Route(ctx, 0, 0, 0, 0); err != nil || info.RankPort != r0.RankPort {
		t.Fatalf("route of the rank still there: %+v %v", info, err)
	}
	if _, err := c.ParallelInfo(ctx); err != nil {
		t.Fatalf("parallel info after a deregistration: %v", err)
	}
	if err := c.Health(ctx); !IsNotReady(err) {
		t.Fatalf("health with a rank lost: %v, want 503", err)
	}
	if err := c.Register(ctx, r1); err != nil {
		t.Fatal(err)
	}
	if err := c.Health(ctx); err != nil {
		t.Fatalf("health once whole again: %v", err)
	}
	// Every rank leaves; a deployment of another layout starts.
	s.Deregister(r0)
	s.Deregister(r1)
	other := reg(1, 0, 1, 0)
	other.PageSize = 32
	if err := c.Register(ctx, other); err != nil {
		t.Fatalf("another layout after every rank left: %v", err)
	}
	if err := c.Health(ctx); err != nil || !s.Ready() {
		t.Fatalf("the new deployment: health %v ready %v", err, s.Ready())
	}
	if pi, err := c.ParallelInfo(ctx); err != nil || pi.AttnTPSize != 1 || *pi.PageSize != 32 {
		t.Fatalf("parallel info of the new deployment: %+v %v", pi, err)
	}
}
