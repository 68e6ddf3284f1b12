package apiconformance

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/zmq"
)

// TestRoomLimit: rooms per connection (--max-rooms) count the rooms of
// all the connection's ranks; close_room frees one.
func TestRoomLimit(t *testing.T) {
	x := newSGL(t, "--max-rooms", "2")
	x.P.ok("sender_create", m("rank", x.pRank, "room", uint64(1)))
	x.P.ok("sender_create", m("rank", x.pRank, "room", uint64(2)))
	x.P.fail("sender_create", m("rank", x.pRank, "room", uint64(3)), "limit")
	// Another connection has its own count.
	x.D.ok("receiver_create", m("rank", x.dRank, "room", uint64(3), "bootstrap_addr", x.boot))
	x.P.ok("close_room", m("rank", x.pRank, "room", uint64(1)))
	x.P.ok("sender_create", m("rank", x.pRank, "room", uint64(3)))
}

// TestBlockIDBound: a hold or read names at most 2^20 block ids.
func TestBlockIDBound(t *testing.T) {
	x := newVLLM(t)
	many := make([]int, 1<<20+1)
	x.P.fail("hold", m("engine_id", "P", "request_id", "big", "block_ids", i32s(many...)), "bad_request", "block_ids")
	p := x.hold(x.P, "r", 1)
	x.D.fail("read", m("rank", x.dRank, "request_id", "big", "kv_transfer_params", p, "block_ids", i32s(many...)), "bad_request", "block_ids")
}

// TestHoldLimit: one engine holds at most 65536 requests.
func TestHoldLimit(t *testing.T) {
	x := newVLLM(t)
	const limit = 1 << 16
	const batch = 1000 // under the 1024 requests a connection may have waiting
	for done := 0; done < limit; {
		n := min(batch, limit-done)
		seqs := make([]uint64, n)
		for i := range n {
			seqs[i] = x.P.send("hold", m("engine_id", "P", "request_id", fmt.Sprint("h", done+i), "block_ids", i32s(1)))
		}
		for _, s := range seqs {
			x.P.wantOK("hold", x.P.reply(s))
		}
		done += n
	}
	x.P.fail("hold", m("engine_id", "P", "request_id", "one-more", "block_ids", i32s(1)), "limit")
	x.P.ok("release", m("engine_id", "P", "request_id", "h0"))
	x.P.ok("hold", m("engine_id", "P", "request_id", "one-more", "block_ids", i32s(1)))
}

// TestConnectionCap: the sidecar keeps at most 1024 connections; with
// every connection from one process, a new one makes room by closing the
// least recently active connection idle for a second, and the others go
// on.
func TestConnectionCap(t *testing.T) {
	side := startSidecar(t)
	const cap = 1024
	conns := make([]*conn, cap)
	for i := range conns {
		conns[i] = side.engine(t, fmt.Sprint("c", i))
	}
	// Everyone idle for more than the second eviction asks; c0 the
	// longest.
	time.Sleep(1500 * time.Millisecond)
	late := side.engine(t, "late")
	conns[0].waitGone()
	for _, c := range []*conn{conns[1], conns[cap-1], late} {
		c.fail("frobnicate", m(), "unknown_op")
	}
}

// TestReadLimit: one decode rank has at most 16384 reads in flight.
func TestReadLimit(t *testing.T) {
	// The reads wait on a side channel that takes the handshake request
	// and never answers: they must stay in flight however long sending
	// 16384 of them takes here.
	side := startSidecar(t, "--handshake-timeout", "10m")
	d := side.engine(t, "decode")
	p := newVLLMPool(t, 2, 8, 4, 2, 8)
	d.register(p.region())
	rank := must(t, d.ok("open_rank", p.fields("decode", "D", 1, 0)), "rank")
	params := m("do_remote_prefill", true, "do_remote_decode", false, "remote_block_ids", []int{1},
		"remote_engine_id", "S", "remote_request_id", "s", "remote_host", "127.0.0.1", "remote_port", silentSideChannel(t), "tp_size", 1)
	const limit = 1 << 14
	for done := 0; done < limit; done += 1000 {
		var seqs []uint64
		for i := done; i < min(done+1000, limit); i++ {
			seqs = append(seqs, d.send("read", m("rank", rank, "request_id", fmt.Sprint("r", i), "kv_transfer_params", params, "block_ids", i32s(1))))
		}
		for _, s := range seqs {
			d.wantOK("read", d.reply(s))
		}
		d.inbox = d.inbox[:0]
	}
	d.fail("read", m("rank", rank, "request_id", "one-more", "kv_transfer_params", params, "block_ids", i32s(1)), "limit")
}

// silentSideChannel is a local ZeroMQ ROUTER that completes the ZMTP
// handshake (so no greeting timeout ends the wait) and never answers a
// request: a vLLM side channel whose handshake hangs.
func silentSideChannel(t *testing.T) int {
	t.Helper()
	r, err := zmq.ListenRouter("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	go func() {
		for {
			if _, err := r.Recv(context.Background()); err != nil {
				return
			}
		}
	}()
	return r.Port()
}
