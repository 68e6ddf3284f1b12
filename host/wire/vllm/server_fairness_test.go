package vllm

import (
	"context"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/zmq/zmqtest"
)

// Clients that pipeline requests and never read the replies (here four of
// them, with 1 MiB replies that soon fill their socket buffers) do not
// hold up anyone else's handshake: honest clients are served at once
// meanwhile, and the stuck clients lose their connections.
func TestHandshakeStuckClientsDelayNobody(t *testing.T) {
	md := sampleMetadata()
	md.AgentMetadata = make([]byte, 1<<20)
	s, err := ListenHandshake("tcp://127.0.0.1:0", map[int][]byte{0: NewHandshakePayload("H", md).Encode()}, quietLog)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()

	const stuckClients = 4
	var wg sync.WaitGroup
	disconnected := make(chan struct{}, stuckClients)
	for range stuckClients {
		c := zmqtest.DialRaw(t, s.Endpoint(), "REQ")
		wg.Add(1)
		go func() {
			defer wg.Done()
			for { // never reads
				if err := c.Send(nil, EncodeMetaRequest(0)); err != nil {
					disconnected <- struct{}{}
					return
				}
				time.Sleep(time.Millisecond)
			}
		}()
	}
	time.Sleep(300 * time.Millisecond) // their replies pile up meanwhile

	var slowest time.Duration
	for i := range 10 {
		start := time.Now()
		got, err := FetchHandshake(context.Background(), s.Endpoint(), 0, expect("H"))
		if err != nil {
			t.Fatalf("honest client %d: %v", i, err)
		}
		if !reflect.DeepEqual(got, md) {
			t.Fatalf("honest client %d: wrong metadata", i)
		}
		slowest = max(slowest, time.Since(start))
	}
	// Before replies were queued per client, each stuck client held the
	// server for replyTimeout (1 s).
	if slowest > replyTimeout/2 {
		t.Fatalf("an honest handshake took %v with %d stuck clients connected", slowest, stuckClients)
	}
	for i := range stuckClients {
		select {
		case <-disconnected:
		case <-time.After(10 * replyTimeout):
			t.Fatalf("only %d of %d stuck clients were disconnected", i, stuckClients)
		}
	}
	wg.Wait()
	t.Logf("slowest honest handshake %v", slowest)
}
