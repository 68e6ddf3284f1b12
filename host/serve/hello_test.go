package serve

import (
	"strings"
	"testing"

	"github.com/kvhost/kvhost/host/serve/client"
)

func TestHello(t *testing.T) {
	s := newTestServer(t)
	c := dial(t, s)
	h := c.Hello()
	if h.Session != s.Session() || h.Version != [2]int{1, 0} || h.Backend != "fake" || h.MaxMessage != DefaultMaxMessage {
		t.Fatalf("hello %+v", h)
	}
	if !h.Has("dram_shm") || !h.Has("dram_memfd") || !h.Has("events") {
		t.Fatalf("capabilities %v", h.Capabilities)
	}
	_, err := c.Call(testCtx(t), "hello", map[string]any{"version": []int{1, 0}})
	if !client.IsCode(err, CodeOutOfOrder) {
		t.Fatalf("second hello: %v", err)
	}
	if _, err := c.Call(testCtx(t), "poll", map[string]any{"rank": struct{}{}}); err == nil || !strings.Contains(err.Error(), "cannot encode") {
		t.Fatalf("a field the client cannot encode: %v", err)
	}
	_, err = c.Call(testCtx(t), "nope", nil)
	if !client.IsCode(err, CodeUnknownOp) {
		t.Fatalf("unknown op: %v", err)
	}
}
