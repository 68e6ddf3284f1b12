package zmq

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"
)

// BenchmarkPushPull measures one-way throughput of a typical control
// message (SGLang transfer info: 10 frames, about 300 bytes) through our
// PUSH/PULL sockets, and as a same-run baseline the same bytes through a
// bare TCP connection with a 4-byte length prefix per frame. The ratio
// metric is our cost per message over the baseline's.
func BenchmarkPushPull(b *testing.B) {
	frames := [][]byte{[]byte("NixlMsgGuard"), []byte("1234567890123"), []byte("10.0.0.1"), []byte("17001"),
		[]byte("agent-0123456789"), make([]byte, 256), []byte("3"), []byte("1"), nil, []byte("0")}

	zmqPerMsg := func(n int) time.Duration {
		pull, err := ListenPull("tcp://127.0.0.1:0", quiet())
		if err != nil {
			b.Fatal(err)
		}
		defer pull.Close()
		push, _ := DialPush(pull.Endpoint(), quiet())
		defer push.Close()
		ctx := context.Background()
		done := make(chan struct{})
		go func() {
			defer close(done)
			for range n {
				if _, err := pull.Recv(ctx); err != nil {
					return
				}
			}
		}()
		start := time.Now()
		for range n {
			if err := push.Send(ctx, frames...); err != nil {
				b.Fatal(err)
			}
		}
		<-done
		return time.Since(start) / time.Duration(n)
	}
	rawPerMsg := func(n int) time.Duration {
		ln, _ := net.Listen("tcp", "127.0.0.1:0")
		defer ln.Close()
		done := make(chan struct{})
		go func() {
			defer close(done)
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			r := bufio.NewReader(c)
			var hdr [4]byte
			for range n * len(frames) {
				if _, err := io.ReadFull(r, hdr[:]); err != nil {
					return
				}
				body := make([]byte, binary.BigEndian.Uint32(hdr[:]))
				if _, err := io.ReadFull(r, body); err != nil {
					return
				}
			}
		}()
		c, _ := net.Dial("tcp", ln.Addr().String())
		defer c.Close()
		start := time.Now()
		for range n {
			bufs := make(net.Buffers, 0, 2*len(frames))
			for _, f := range frames {
				bufs = append(bufs, binary.BigEndian.AppendUint32(nil, uint32(len(f))), f)
			}
			if _, err := bufs.WriteTo(c); err != nil {
				b.Fatal(err)
			}
		}
		<-done
		return time.Since(start) / time.Duration(n)
	}
	for b.Loop() {
		const n = 20000
		raw := rawPerMsg(n)
		ours := zmqPerMsg(n)
		b.ReportMetric(float64(ours.Nanoseconds()), "ns/msg")
		b.ReportMetric(float64(raw.Nanoseconds()), "baseline-ns/msg")
		b.ReportMetric(float64(ours)/float64(raw), "ratio")
	}
}

// BenchmarkRouterEnqueue measures what a kvhost serve sidecar does for
// its replies and events: a ROUTER queues small messages (about 100
// bytes) to one DEALER peer faster than they are written (Enqueue), and
// the peer reads them all. With a queue of 16 (the default) the sender
// waits 10 µs whenever the queue is full; with kvhost serve's queue
// (serve.DefaultEventQueue) it never does.
func BenchmarkRouterEnqueue(b *testing.B) {
	for _, queue := range []int{DefaultSendQueue, 1 << 18} {
		b.Run(fmt.Sprint("queue=", queue), func(b *testing.B) {
			peer, r, d := benchRouterPeer(b, WithSendQueue(queue))
			ctx := context.Background()
			msg := make([]byte, 100)
			const n = 20000
			for b.Loop() {
				done := make(chan error, 1)
				go func() {
					for range n {
						if _, err := d.Recv(ctx); err != nil {
							done <- err
							return
						}
					}
					done <- nil
				}()
				start := time.Now()
				for i := 0; i < n; {
					if err := r.Enqueue(peer, msg); err != nil {
						if errors.Is(err, ErrPeerBusy) {
							time.Sleep(10 * time.Microsecond)
							continue
						}
						b.Fatal(err)
					}
					i++
				}
				if err := <-done; err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(float64(time.Since(start).Nanoseconds())/n, "ns/msg")
			}
		})
	}
}

// BenchmarkRouterReply measures a request and its reply, one at a time,
// as an engine's control requests to kvhost serve go: a DEALER sends a
// small request, the ROUTER receives it and answers with Enqueue.
func BenchmarkRouterReply(b *testing.B) {
	peer, r, d := benchRouterPeer(b)
	ctx := context.Background()
	req, rep := make([]byte, 100), make([]byte, 100)
	for b.Loop() {
		if err := d.Send(ctx, req); err != nil {
			b.Fatal(err)
		}
		m, err := r.Recv(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if string(m.Peer) != string(peer) {
			b.Fatal("a request from another peer")
		}
		if err := r.Enqueue(m.Peer, rep); err != nil {
			b.Fatal(err)
		}
		if _, err := d.Recv(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// benchRouterPeer binds an ipc ROUTER, connects a DEALER to it and
// returns the DEALER's id at the ROUTER.
func benchRouterPeer(b *testing.B, opts ...Option) ([]byte, *Router, *Dealer) {
	r, err := ListenRouter("ipc://"+b.TempDir()+"/r.sock", append([]Option{quiet()}, opts...)...)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { r.Close() })
	d, err := DialDealer(r.Endpoint(), quiet())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { d.Close() })
	ctx := context.Background()
	if err := d.Send(ctx, []byte("hello")); err != nil {
		b.Fatal(err)
	}
	m, err := r.Recv(ctx)
	if err != nil {
		b.Fatal(err)
	}
	return m.Peer, r, d
}
