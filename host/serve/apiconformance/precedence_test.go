package apiconformance

import (
	"bytes"
	"testing"
)

// TestPrecedence: when several errors apply, the one docs/engine-api.md
// ("Precedence of errors") names wins: what cannot be read as a request
// first, then no_hello, then the objects named (unknown), then the
// fields (bad_request), then the objects' state (out_of_order, exists),
// and limit before the fields of what it refuses.
func TestPrecedence(t *testing.T) {
	x := newSGL(t, "--max-message", "65536", "--max-regions", "1", "--max-ranks", "2")
	P, D := x.P, x.D
	pr, dr := x.pRank, x.dRank

	// too_large before anything inside the message.
	fresh := x.side.dial(t, "fresh")
	fresh.frames(bytes.Repeat([]byte{0xc1}, 70000))
	fresh.wantErr("too large and not msgpack", fresh.nilReply(), "too_large")
	// An unreadable request before no_hello.
	fresh.frames(encode(m("op", "hello")))
	fresh.wantErr("no seq before hello", fresh.nilReply(), "bad_request")
	// no_hello before the op's fields.
	fresh.fail("register_memory", m("regions", "garbage"), "no_hello")
	fresh.fail("sender_send", m("rank", "x"), "no_hello")

	// unknown (the rank or room named) before the fields.
	P.fail("sender_send", m("rank", pr+1000, "room", uint64(1), "pages", []byte{1}), "unknown")
	P.fail("sender_send", m("rank", pr, "room", uint64(77), "pages", []byte{1}), "unknown")
	D.fail("receiver_init", m("rank", dr, "room", uint64(77), "pages", []byte{1}, "aux_index", -5), "unknown")
	// bad_request (fields) before out_of_order (state).
	P.ok("sender_create", m("rank", pr, "room", uint64(1)))
	P.fail("sender_send", m("rank", pr, "room", uint64(1), "pages", i32s(99)), "bad_request", "pages")
	P.fail("sender_send", m("rank", pr, "room", uint64(1), "pages", i32s(1)), "out_of_order")
	x.receiver(2)
	D.ok("receiver_init", m("rank", dr, "room", uint64(2), "pages", i32s(1), "aux_index", 0))
	D.fail("receiver_init", m("rank", dr, "room", uint64(2), "pages", i32s(1), "aux_index", 0, "prefix_len", -1), "bad_request", "prefix_len")
	// exists before limit: the room is open already.
	// (limit: --max-rooms is the default here; exists is checked first
	// in any case, see TestRoomLimit for limit itself.)
	P.fail("sender_create", m("rank", pr, "room", uint64(1)), "exists")

	// limit before the fields of what it refuses: a second region with a
	// bad field is limit (one region allowed, one registered).
	P.fail("register_memory", m("regions", []any{m("kind", "nonsense")}), "limit")
	// open_rank: the style first (unsupported), then role, then the rank
	// limit, then the style's fields.
	P.fail("open_rank", m("style", "trtllm", "role", "both"), "unsupported")
	P.fail("open_rank", m("style", "sglang", "role", "both"), "bad_request", "role")
	q := newSGLPool(t, 2, 8, 2, 2, 8)
	o := x.side.engine(t, "other")
	o.register(q.region())
	o.ok("open_rank", q.fields("decode"))
	o.ok("open_rank", q.fields("decode"))
	o.fail("open_rank", m("style", "sglang", "role", "decode"), "limit")
}
