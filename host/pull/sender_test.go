package pull

import (
	"encoding/json"
	"errors"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/plugin"
)

func eventually(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// notifier is a decode-side agent that talks to prefill ranks directly.
type notifier struct {
	a     *plugin.Agent
	peers []string // by prefill rank
}

func newNotifier(t *testing.T, ps *prefillSide) *notifier {
	n := &notifier{a: newAgent(t, "notifier")}
	for _, pa := range ps.agents {
		md, err := pa.LocalMetadata()
		if err != nil {
			t.Fatal(err)
		}
		name, err := n.a.LoadRemote(md)
		if err != nil {
			t.Fatal(err)
		}
		n.peers = append(n.peers, name)
	}
	return n
}

func (n *notifier) send(t *testing.T, rank int, msg string) {
	t.Helper()
	if err := n.a.SendNotif(n.peers[rank], []byte(msg)); err != nil {
		t.Fatal(err)
	}
}

func noRelease(t *testing.T, ps *prefillSide, d time.Duration) {
	t.Helper()
	select {
	case r := <-ps.releases:
		t.Fatalf("unexpected release %+v", r)
	case <-time.After(d):
	}
}

func nextRelease(t *testing.T, ps *prefillSide, d time.Duration) Release {
	t.Helper()
	select {
	case r := <-ps.releases:
		return r
	case <-time.After(d):
		t.Fatalf("no release within %v", d)
		return Release{}
	}
}

// TestSenderNotifications: a request is freed only once every hosted rank
// got tp_ratio notifications; unknown, surplus and malformed
// notifications are counted and harmless.
func TestSenderNotifications(t *testing.T) {
	g := geom{hnd: true, layers: 1, heads: 2, headBytes: 8, tp: 2, blockSize: 4, blocks: 16}
	ps := newPrefillSide(t, g, "prefill", nil)
	n := newNotifier(t, ps)

	params, err := ps.sender.Hold("a", []int32{3, 1, 2})
	if err != nil {
		t.Fatal(err)
	}
	if !params.DoRemotePrefill || params.DoRemoteDecode || params.RemoteEngineID != "prefill" || params.RemoteRequestID != "a" ||
		params.RemoteHost != "127.0.0.1" || params.RemotePort != ps.sender.Port() || params.TPSize != 2 ||
		!reflect.DeepEqual(params.RemoteBlockIDs, []int32{3, 1, 2}) {
		t.Fatalf("params %+v", params)
	}
	if _, err := ps.sender.Hold("a", []int32{4}); err == nil {
		t.Fatal("holding a request twice was accepted")
	}
	if _, err := ps.sender.Hold("b", []int32{16}); err == nil || !strings.Contains(err.Error(), "outside [0, 16)") {
		t.Fatalf("a block outside the cache: %v", err)
	}
	if p, err := ps.sender.Hold("empty", nil); err != nil || len(p.RemoteBlockIDs) != 0 || ps.sender.Counts().Held != 1 {
		t.Fatalf("holding no block: %+v %v (held %d)", p, err, ps.sender.Counts().Held)
	}

	// Two decode ranks read each prefill rank (tp_ratio 2): each counts
	// once, whatever it sends.
	n2 := newNotifier(t, ps)
	n.send(t, 0, "a:2")
	n.send(t, 0, "a:2")  // surplus: n already counted
	n2.send(t, 0, "a:2") // rank 0 done
	n2.send(t, 0, "a:2") // surplus
	n.send(t, 1, "a:2")
	noRelease(t, ps, 50*time.Millisecond)
	eventually(t, "the surplus notifications", time.Second, func() bool { return ps.sender.Counts().UnknownNotifications == 2 })
	n2.send(t, 1, "a:2")
	r := nextRelease(t, ps, 2*time.Second)
	if r.RequestID != "a" || r.Reason != ReleaseNotified || r.Notified != 4 || !reflect.DeepEqual(r.BlockIDs, []int32{3, 1, 2}) {
		t.Fatalf("release %+v", r)
	}
	// Request ids may hold ':' (the count follows the last one).
	if _, err := ps.sender.Hold("x:y", []int32{5}); err != nil {
		t.Fatal(err)
	}
	n.send(t, 0, "x:y:1")
	n.send(t, 1, "x:y:1")
	if r := nextRelease(t, ps, 2*time.Second); r.RequestID != "x:y" || r.Reason != ReleaseNotified {
		t.Fatalf("release %+v", r)
	}

	n.send(t, 0, "a:2")       // already released
	n.send(t, 1, "never:1")   // never held
	n.send(t, 0, "no count")  // malformed
	n.send(t, 1, "zero:0")    // malformed
	n.send(t, 0, "\xff\xfe:") // malformed
	eventually(t, "bad notifications counted", 2*time.Second, func() bool {
		c := ps.sender.Counts()
		return c.UnknownNotifications == 4 && c.MalformedNotifications == 3
	})
	if c := ps.sender.Counts(); c.ReleasedNotified != 2 || c.Held != 0 || c.Notifications != 13 {
		t.Fatalf("counts %+v", c)
	}

	if _, err := ps.sender.Hold("d", []int32{7}); err != nil {
		t.Fatal(err)
	}
	if !ps.sender.Abort("d") || ps.sender.Abort("d") {
		t.Fatal("Abort reports wrongly")
	}
	if r := nextRelease(t, ps, time.Second); r.RequestID != "d" || r.Reason != ReleaseAborted {
		t.Fatalf("release %+v", r)
	}
}

// TestSenderExpiry: blocks without every notification are released when
// the abort timeout expires, saying so; a late notification is reported,
// not fatal.
func TestSenderExpiry(t *testing.T) {
	g := geom{hnd: true, layers: 1, heads: 2, headBytes: 8, tp: 1, blockSize: 4, blocks: 16}
	const timeout = 300 * time.Millisecond
	fk := clock.NewFake(time.Time{}) // the abort timeout passes when advanced
	ps := newPrefillSide(t, g, "prefill", func(c *SenderConfig) { c.AbortTimeout, c.Clock = timeout, fk })
	n := newNotifier(t, ps)
	start := fk.Now()
	if _, err := ps.sender.Hold("slow", []int32{1, 2}); err != nil {
		t.Fatal(err)
	}
	if _, err := ps.sender.Hold("ok", []int32{3}); err != nil {
		t.Fatal(err)
	}
	n.send(t, 0, "slow:2") // one of two readers
	n.send(t, 0, "ok:1")
	if r := nextRelease(t, ps, time.Second); r.RequestID != "ok" || r.Reason != ReleaseNotified {
		t.Fatalf("release %+v", r)
	}
	fk.Advance(timeout)
	r := nextRelease(t, ps, 3*time.Second)
	waited := fk.Since(start)
	if r.RequestID != "slow" || r.Reason != ReleaseExpired || r.Notified != 1 || !reflect.DeepEqual(r.BlockIDs, []int32{1, 2}) {
		t.Fatalf("release %+v", r)
	}
	if waited < timeout || waited > timeout+time.Second {
		t.Fatalf("expired after %v, abort timeout %v", waited, timeout)
	}
	n.send(t, 0, "slow:2")
	eventually(t, "the late notification", time.Second, func() bool { return ps.sender.Counts().UnknownNotifications == 1 })
	if c := ps.sender.Counts(); c.ReleasedExpired != 1 || c.ReleasedNotified != 1 || c.Held != 0 {
		t.Fatalf("counts %+v", c)
	}
}

func TestAbortTimeoutFromEnv(t *testing.T) {
	for _, c := range []struct {
		env  string
		want time.Duration
		bad  bool
	}{
		{"", DefaultAbortTimeout, false},
		{"30", 30 * time.Second, false},
		{" 1.5 ", 1500 * time.Millisecond, false},
		{"0", 0, true},
		{"-3", 0, true},
		{"soon", 0, true},
	} {
		t.Setenv(EnvAbortTimeout, c.env)
		if c.env == "" {
			os.Unsetenv(EnvAbortTimeout)
		}
		got, err := AbortTimeoutFromEnv()
		if (err != nil) != c.bad || got != c.want {
			t.Errorf("%s=%q: %v, %v; want %v (error %v)", EnvAbortTimeout, c.env, got, err, c.want, c.bad)
		}
	}
}

func TestSenderConfigErrors(t *testing.T) {
	g := geom{hnd: true, layers: 1, heads: 2, headBytes: 8, tp: 1, blockSize: 4, blocks: 16}
	p := g.pool(t, 0)
	a := newAgent(t, "cfg")
	good := func() SenderConfig {
		return SenderConfig{EngineID: "e", TPSize: 1, CompatHash: "h", Listen: "tcp://127.0.0.1:0", Logger: testLogger(t),
			Ranks: []SenderRank{{TPRank: 0, Agent: a, Cache: cacheOf(p, LayoutHND)}}}
	}
	for _, c := range []struct {
		name string
		mod  func(*SenderConfig)
		want string
	}{
		{"engine", func(c *SenderConfig) { c.EngineID = "" }, "engine id"},
		{"rank range", func(c *SenderConfig) { c.Ranks[0].TPRank = 1 }, "outside [0, 1)"},
		{"rank twice", func(c *SenderConfig) { c.TPSize = 2; c.Ranks = append(c.Ranks, c.Ranks[0]) }, "given twice"},
		{"layout", func(c *SenderConfig) { c.Ranks[0].Cache.Layout = "XYZ" }, "layout"},
		{"wildcard", func(c *SenderConfig) { c.Listen = "tcp://0.0.0.0:0" }, "every address"},
		{"no notifications", func(c *SenderConfig) {
			c.Ranks[0].Agent = newAgent(t, "nonotif", plugin.Param{Key: "caps_off", Value: "notif"})
		}, "no notifications"},
	} {
		cfg := good()
		c.mod(&cfg)
		s, err := NewSender(cfg)
		if err == nil {
			s.Close()
			t.Errorf("%s: accepted", c.name)
		} else if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want it to mention %q", c.name, err, c.want)
		}
	}
	// A good config registers, and Close deregisters: the same memory can
	// be registered again.
	for range 2 {
		s, err := NewSender(good())
		if err != nil {
			t.Fatal(err)
		}
		regs := s.ranks[0].regions
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		for _, r := range regs {
			if err := r.Close(); !errors.Is(err, plugin.ErrClosed) {
				t.Fatalf("region still registered after Close: %v", err)
			}
		}
		if err := s.Close(); err != nil {
			t.Fatal("second Close:", err)
		}
		if _, err := s.Hold("late", []int32{1}); !errors.Is(err, plugin.ErrClosed) {
			t.Fatalf("Hold after Close: %v", err)
		}
	}
}

// TestKVTransferParamsJSON: vLLM's field names, and the proxy's first
// message with nulls decodes.
func TestKVTransferParamsJSON(t *testing.T) {
	p := KVTransferParams{DoRemotePrefill: true, RemoteBlockIDs: []int32{1, 2}, RemoteEngineID: "e", RemoteRequestID: "r",
		RemoteHost: "h", RemotePort: 5600, TPSize: 2}
	b, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2],"remote_engine_id":"e",` +
		`"remote_request_id":"r","remote_host":"h","remote_port":5600,"tp_size":2}`
	if string(b) != want {
		t.Fatalf("got  %s\nwant %s", b, want)
	}
	var q KVTransferParams
	proxy := `{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,` +
		` "remote_host": null, "remote_port": null}`
	if err := json.Unmarshal([]byte(proxy), &q); err != nil || !q.DoRemoteDecode || q.RemoteTPSize() != 1 {
		t.Fatalf("%+v %v", q, err)
	}
	if err := q.checkPull(); !errors.Is(err, ErrInvalidParams) {
		t.Fatalf("the proxy's first message is not pullable: %v", err)
	}
	if ep := (&KVTransferParams{RemoteHost: "::1", RemotePort: 7}).Endpoint(); ep != "tcp://[::1]:7" {
		t.Fatal(ep)
	}
}
