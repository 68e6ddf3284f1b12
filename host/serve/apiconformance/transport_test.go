package apiconformance

import (
	"bytes"
	"os"
	"slices"
	"testing"
)

// TestHello: hello's reply carries every documented field, the limits
// and max_message the sidecar was started with; session is one per
// sidecar process; client and pid are optional; a newer minor is fine.
func TestHello(t *testing.T) {
	side := startSidecar(t, "--max-message", "65536", "--max-ranks", "3", "--max-regions", "5", "--max-rooms", "7")
	c := side.dial(t, "a")
	v := c.ok("hello", m("version", []int{1, 0}))
	ver, _ := v.Get("version")
	major, _ := ver.Index(0)
	minor, _ := ver.Index(1)
	if ma, _ := major.Uint(); ver.Len() != 2 || ma != 1 {
		t.Fatalf("hello version %s, want [1, minor]", show(ver))
	}
	if _, ok := minor.Uint(); !ok {
		t.Fatalf("hello version %s: minor is not a uint", show(ver))
	}
	for _, k := range []string{"sidecar", "session", "backend"} {
		if strOf(v, k) == "" {
			t.Fatalf("hello: %q missing or empty: %s", k, show(v))
		}
	}
	if strOf(v, "backend") != "fake" {
		t.Fatalf("hello backend %q, want fake", strOf(v, "backend"))
	}
	caps, _ := v.Get("capabilities")
	var got []string
	for i := range caps.Len() {
		x, _ := caps.Index(i)
		s, _ := x.Str()
		got = append(got, s)
	}
	for _, want := range []string{"sglang", "vllm", "dram_shm", "dram_memfd", "vram_cuda_ipc", "events", "poll"} {
		if !slices.Contains(got, want) {
			t.Fatalf("hello capabilities %v lack %q", got, want)
		}
	}
	if n := must(t, v, "max_message"); n != 65536 {
		t.Fatalf("hello max_message %d, want 65536 (--max-message)", n)
	}
	lim, _ := v.Get("limits")
	for k, want := range map[string]uint64{"ranks": 3, "regions": 5, "rooms": 7} {
		if n := must(t, lim, k); n != want {
			t.Fatalf("hello limits.%s = %d, want %d", k, n, want)
		}
	}
	// client and pid are optional; a newer minor is accepted.
	v2 := side.dial(t, "b").ok("hello", m("version", []int{1, 9}, "client", "b", "pid", os.Getpid()))
	if strOf(v2, "session") != strOf(v, "session") {
		t.Fatalf("two connections of one sidecar see sessions %q and %q", strOf(v, "session"), strOf(v2, "session"))
	}
}

// TestSessionPerProcess: another sidecar process has another session.
func TestSessionPerProcess(t *testing.T) {
	s1 := strOf(startSidecar(t).dial(t, "a").ok("hello", m("version", []int{1, 0})), "session")
	s2 := strOf(startSidecar(t).dial(t, "b").ok("hello", m("version", []int{1, 0})), "session")
	if s1 == s2 {
		t.Fatalf("two sidecar processes share session %q", s1)
	}
}

// TestHelloErrors: no_hello before hello; version for another major
// (and the connection stays usable for another hello); bad_request for
// malformed hello fields; out_of_order for a second hello.
func TestHelloErrors(t *testing.T) {
	side := startSidecar(t)
	c := side.dial(t, "e")
	c.fail("register_memory", m("regions", []any{}), "no_hello")
	c.fail("poll", m("rank", uint64(1), "rooms", []byte{}), "no_hello")
	c.fail("hello", m("version", []int{2, 0}), "version")
	c.fail("hello", m("version", []int{0, 9}), "version")
	c.fail("hello", m(), "bad_request", "version")
	c.fail("hello", m("version", "1.0"), "bad_request", "version")
	c.fail("hello", m("version", []int{1}), "bad_request", "version")
	c.fail("hello", m("version", []int{1, 0}, "client", 5), "bad_request", "client")
	c.fail("hello", m("version", []int{1, 0}, "pid", -1), "bad_request", "pid")
	c.fail("hello", m("version", []int{1, 0}, "pid", "x"), "bad_request", "pid")
	c.ok("hello", m("version", []int{1, 0}))
	c.fail("hello", m("version", []int{1, 0}), "out_of_order")
	c.fail("frobnicate", m(), "unknown_op", "frobnicate")
	// No request is left without its reply, none has two.
	for seq := range c.sent {
		if !c.answered[seq] {
			t.Fatalf("seq %d was never answered", seq)
		}
	}
}

// TestMessageErrors: what cannot be read as a request is bad_request
// with seq nil; a request whose seq was read gets it back even when the
// rest is wrong; a message over max_message is too_large with seq nil;
// the connection stays usable after each.
func TestMessageErrors(t *testing.T) {
	side := startSidecar(t, "--max-message", "65536")
	c := side.engine(t, "e")
	enc := func(v any) []byte { return encode(v) }
	for _, tc := range []struct {
		name string
		msg  [][]byte
	}{
		{"not msgpack", [][]byte{{0xc1}}},
		{"truncated msgpack", [][]byte{{0x82, 0xa3}}},
		{"an array", [][]byte{enc([]any{"hello", 1})}},
		{"a str", [][]byte{enc("hello")}},
		{"no seq", [][]byte{enc(m("op", "poll"))}},
		{"seq nil", [][]byte{enc(m("op", "poll", "seq", nil))}},
		{"seq a str", [][]byte{enc(m("op", "poll", "seq", "1"))}},
		{"seq negative", [][]byte{enc(m("op", "poll", "seq", -1))}},
		{"two frames", [][]byte{enc(m("op", "hello", "seq", uint64(1))), enc(m())}},
		{"a REQ delimiter", [][]byte{{}, enc(m("op", "hello", "seq", uint64(1)))}},
	} {
		c.frames(tc.msg...)
		c.wantErr(tc.name, c.nilReply(), "bad_request")
	}
	// seq read, op not: the reply echoes seq.
	c.seq++
	c.sent[c.seq] = true
	c.frames(enc(m("seq", c.seq)))
	c.wantErr("no op", c.reply(c.seq), "bad_request", "op")
	c.seq++
	c.sent[c.seq] = true
	c.frames(enc(m("seq", c.seq, "op", 3)))
	c.wantErr("op an int", c.reply(c.seq), "bad_request", "op")

	// too_large: discarded unread, seq nil, the connection goes on.
	big := enc(m("op", "poll", "seq", uint64(1), "pad", bytes.Repeat([]byte{1}, 70000)))
	c.frames(big)
	c.wantErr("too large", c.nilReply(), "too_large")
	c.fail("poll", m("rank", uint64(1<<60), "rooms", []byte{}), "unknown")
}
