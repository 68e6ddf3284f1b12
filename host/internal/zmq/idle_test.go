package zmq

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// idlePeer connects from localIP, completes a ZMTP handshake as a socket
// of type typ and returns the connection, which then says nothing.
func idlePeer(addr, localIP, typ string) (net.Conn, error) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(localIP)}, Timeout: 10 * time.Second}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	c.Write(greeting())
	c.Write(encodeCommand("READY", readyMetadata(typ)))
	r := bufio.NewReader(c)
	if _, err := io.ReadFull(r, make([]byte, greetingSize)); err != nil {
		c.Close()
		return nil, err
	}
	if _, cmd, err := readMessage(r, limits{maxMessageSize: 1 << 16, maxFrames: 1}); err != nil || cmd == nil || cmd.name != "READY" {
		c.Close()
		return nil, fmt.Errorf("READY: %v %v", cmd, err)
	}
	c.SetDeadline(time.Time{})
	return c, nil
}

// openIdle opens n idle connections from localIP (those the socket
// refuses are not kept) and returns how many it holds.
func openIdle(t *testing.T, addr, localIP, typ string, n int) int {
	t.Helper()
	var mu sync.Mutex
	var held []net.Conn
	t.Cleanup(func() {
		for _, c := range held {
			c.Close()
		}
	})
	work := make(chan struct{})
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for range work {
				c, err := idlePeer(addr, localIP, typ)
				if err != nil {
					continue
				}
				mu.Lock()
				held = append(held, c)
				mu.Unlock()
			}
		})
	}
	for range n {
		work <- struct{}{}
	}
	close(work)
	wg.Wait()
	return len(held)
}

// 1100 connections that finish the ZMTP handshake and then say nothing,
// more than the default connection limit, do not lock a real peer out of
// a PULL or a ROUTER socket, whether they come from the real peer's own
// host (everyone on 127.0.0.1: the idle ones give way) or from another
// (127.0.0.2: the source holding the most connections gives way). They
// locked the socket for good: every later peer was refused.
func TestIdleConnectionsDoNotLockOutPeers(t *testing.T) {
	const idle = 1100
	for _, attacker := range []string{"127.0.0.1", "127.0.0.2"} {
		t.Run("PULL from "+attacker, func(t *testing.T) {
			pull := newPull(t)
			opened := openIdle(t, pull.Addr().String(), attacker, typePush, idle)
			start := time.Now()
			push := newPush(t, pull.Endpoint())
			ctx := testCtx(t, 20*time.Second)
			if err := push.Send(ctx, []byte("real")); err != nil {
				t.Fatalf("real peer with %d idle connections opened (%d finished the handshake): %v", idle, opened, err)
			}
			if m, err := pull.Recv(ctx); err != nil || string(m[0]) != "real" {
				t.Fatalf("real peer: %q %v", m, err)
			}
			t.Logf("%d idle connections opened (%d finished the handshake); the real peer was served after %v", idle, opened, time.Since(start))
		})
		t.Run("ROUTER from "+attacker, func(t *testing.T) {
			router := newRouter(t)
			ctx := testCtx(t, 20*time.Second)
			go func() {
				for {
					m, err := router.Recv(ctx)
					if err != nil {
						return
					}
					router.Enqueue(m.Peer, nil, []byte("reply"))
				}
			}()
			opened := openIdle(t, router.Addr().String(), attacker, typeReq, idle)
			start := time.Now()
			var rep [][]byte
			var err error
			for ctx.Err() == nil { // a REQ does not reconnect by itself; vLLM's client retries
				attempt, cancel := context.WithTimeout(ctx, 2*time.Second)
				rep, err = Request(attempt, router.Endpoint(), [][]byte{[]byte("real")}, quiet())
				cancel()
				if err == nil {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			if err != nil || string(rep[0]) != "reply" {
				t.Fatalf("real peer with %d idle connections opened (%d finished the handshake): %q %v", idle, opened, rep, err)
			}
			t.Logf("%d idle connections opened (%d finished the handshake); the real peer was served after %v", idle, opened, time.Since(start))
		})
	}
}

// The policy behind the limit: a source with fewer connections takes a
// slot from the source holding the most (its least recently active one)
// at once; that source cannot push out the other's connections, and
// replaces its own only once they are idle for evictIdle.
func TestConnectionLimitIsSharedFairly(t *testing.T) {
	const limit, grace = 4, 2 * time.Second
	pull := newPull(t, WithMaxConns(limit), withEvictIdle(grace))
	addr := pull.Addr().String()
	var hog []net.Conn
	for range limit {
		c, err := idlePeer(addr, "127.0.0.2", typePush)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		hog = append(hog, c)
		time.Sleep(5 * time.Millisecond) // distinct activity times
	}
	// Activity of hog[0] makes hog[1] the least recently active.
	hog[0].Write(encodeMessage([][]byte{[]byte("active")}))
	if _, err := pull.Recv(testCtx(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	real, err := idlePeer(addr, "127.0.0.1", typePush)
	if err != nil {
		t.Fatalf("the smaller source was refused: %v", err)
	}
	defer real.Close()
	// The hog, now at limit-1 against 1, cannot take the real peer's slot,
	// and its own are younger than grace.
	if _, err := idlePeer(addr, "127.0.0.2", typePush); err == nil {
		t.Fatal("a new connection of the largest source replaced one active within evictIdle")
	}
	closed := func(c net.Conn) bool {
		c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		return err == io.EOF
	}
	for i, c := range hog {
		if got, want := closed(c), i == 1; got != want {
			t.Fatalf("hog connection %d closed: %v, want %v", i, got, want)
		}
	}
	// Once idle for grace, they give way to the hog's new connection.
	time.Sleep(grace)
	c, err := idlePeer(addr, "127.0.0.2", typePush)
	if err != nil {
		t.Fatalf("a new connection of the largest source did not replace its idle one: %v", err)
	}
	defer c.Close()
	if closed(real) {
		t.Fatal("the smaller source's connection was closed")
	}
	real.Write(encodeMessage([][]byte{[]byte("real")}))
	if m, err := pull.Recv(testCtx(t, 5*time.Second)); err != nil || string(m[0]) != "real" {
		t.Fatalf("real peer: %q %v", m, err)
	}
}

// A peer silent for the idle timeout is dropped; one that keeps sending
// is not.
func TestIdleTimeout(t *testing.T) {
	const timeout = 300 * time.Millisecond
	pull := newPull(t, WithIdleTimeout(timeout))
	addr := pull.Addr().String()
	idle, err := idlePeer(addr, "127.0.0.1", typePush)
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	busy, err := idlePeer(addr, "127.0.0.1", typePush)
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	start := time.Now()
	for i := range 10 {
		busy.Write(encodeMessage([][]byte{[]byte(fmt.Sprint(i))}))
		if _, err := pull.Recv(testCtx(t, 5*time.Second)); err != nil {
			t.Fatalf("busy peer, message %d: %v", i, err)
		}
		time.Sleep(timeout / 3)
	}
	idle.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := idle.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("idle peer: %v, want EOF (dropped)", err)
	}
	if el := time.Since(start); el < timeout/2 {
		t.Fatalf("idle peer dropped after %v, want about %v", el, timeout)
	}
}

// Many sources with one connection each (many hosts, or an attacker
// with many addresses): a new source takes no active peer's slot, only
// the least recently active one idle for evictIdle.
func TestManySourcesOnlyIdleGiveWay(t *testing.T) {
	const limit, grace = 4, time.Second
	pull := newPull(t, WithMaxConns(limit), withEvictIdle(grace))
	addr := pull.Addr().String()
	var peers []net.Conn
	for i := range limit {
		c, err := idlePeer(addr, fmt.Sprintf("127.0.0.%d", 2+i), typePush)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		peers = append(peers, c)
	}
	if c, err := idlePeer(addr, "127.0.0.9", typePush); err == nil {
		c.Close()
		t.Fatal("a new source replaced a connection active within evictIdle")
	}
	time.Sleep(grace)
	for _, i := range []int{0, 2, 3} { // peers[1] stays idle
		peers[i].Write(encodeMessage([][]byte{[]byte("active")}))
		if _, err := pull.Recv(testCtx(t, 5*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	c, err := idlePeer(addr, "127.0.0.9", typePush)
	if err != nil {
		t.Fatalf("a new source did not replace the idle connection: %v", err)
	}
	defer c.Close()
	peers[1].SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := peers[1].Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("the idle connection: %v, want EOF (closed)", err)
	}
}
