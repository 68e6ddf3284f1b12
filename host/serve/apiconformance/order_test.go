package apiconformance

import (
	"net"
	"testing"
)

// TestOrderAndExactlyOnce: a pipeline of requests (sent without waiting
// for replies) is answered in order, each exactly once, with its own
// seq and its own answer; a state change made by one request is seen by
// the next.
func TestOrderAndExactlyOnce(t *testing.T) {
	x := newSGL(t)
	c := x.P
	type want struct {
		seq  uint64
		code string // "" for ok
	}
	var sent []want
	for i := range 300 {
		room := uint64(1000 + i)
		sent = append(sent,
			want{c.send("sender_create", m("rank", x.pRank, "room", room)), ""},
			want{c.send("sender_create", m("rank", x.pRank, "room", room)), "exists"},
			want{c.send("frobnicate", m()), "unknown_op"},
			want{c.send("close_room", m("rank", x.pRank, "room", room)), ""},
			want{c.send("close_room", m("rank", x.pRank, "room", room)), "unknown"},
			want{c.send("poll", m("rank", x.pRank, "rooms", u64s(room))), ""},
		)
	}
	// Read every reply as it comes: the order of arrival is the order of
	// the requests.
	var order []uint64
	for len(order) < len(sent) {
		if !c.pump(wait) {
			t.Fatalf("replies stopped after %d of %d (connection gone: %v)", len(order), len(sent), c.gone)
		}
		v := c.inbox[len(c.inbox)-1]
		if _, ev := v.Get("event"); ev {
			continue
		}
		n, _ := uintOf(v, "seq")
		w := sent[len(order)]
		if n != w.seq {
			t.Fatalf("reply %d is to seq %d, want %d: replies out of order", len(order), n, w.seq)
		}
		if w.code == "" {
			c.wantOK("pipelined request", v)
		} else {
			c.wantErr("pipelined request", v, w.code)
		}
		order = append(order, n)
	}
	// Nothing more: no request had a second reply (pump checks every
	// reply that arrives against the seqs already answered).
	c.ok("poll", m("rank", x.pRank, "rooms", []byte{}))
}

// TestOpenRankRepliesLater: an SGLang prefill open_rank is answered when
// its rank has registered with the bootstrap server; requests sent after
// it are answered meanwhile, and the regions it uses are busy from the
// request on.
func TestOpenRankRepliesLater(t *testing.T) {
	side := startSidecar(t)
	c := side.engine(t, "p")
	p := newSGLPool(t, 2, 8, 2, 2, 8)
	ids := c.register(p.region())
	// A bootstrap server that accepts and never answers.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			cn, err := ln.Accept()
			if err != nil {
				return
			}
			defer cn.Close()
		}
	}()
	open := c.send("open_rank", p.fields("prefill").with("bootstrap_addr", ln.Addr().String()))
	dereg := c.send("deregister_memory", m("regions", ids))
	c.wantErr("deregister_memory of a rank being opened", c.reply(dereg), "busy")
	c.fail("frobnicate", m(), "unknown_op")
	if c.answered[open] {
		t.Fatal("open_rank was answered while its bootstrap server had not answered")
	}
}
