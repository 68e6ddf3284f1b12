package zmq

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
)

const peerScript = "testdata/zmq_peer.py"

func portLine(t *testing.T, p *zmqtest.Peer) int {
	t.Helper()
	var port int
	if _, err := fmt.Sscanf(p.Line(30*time.Second), "PORT %d", &port); err != nil {
		t.Fatalf("bad PORT line: %v", err)
	}
	return port
}

// libzmq PUSH -> our PULL.
func TestInteropPythonPushToGoPull(t *testing.T) {
	zmqtest.RequirePython(t, "zmq")
	pull, err := ListenPull("tcp://127.0.0.1:0", quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer pull.Close()
	peer := zmqtest.Start(t, peerScript, "push", pull.Endpoint())
	ctx := testCtx(t, 20*time.Second)
	for i, want := range standardMessages() {
		got, err := pull.Recv(ctx)
		if err != nil {
			t.Fatalf("message %d: %v\npeer stderr: %s", i, err, peer.Stderr())
		}
		if !equalFrames(got, want) {
			t.Fatalf("message %d: got %d frames, want %d", i, len(got), len(want))
		}
	}
	peer.Wait(10 * time.Second)
}

// our PUSH -> libzmq PULL.
func TestInteropGoPushToPythonPull(t *testing.T) {
	zmqtest.RequirePython(t, "zmq")
	peer := zmqtest.Start(t, peerScript, "pull")
	port := portLine(t, peer)
	push, err := DialPush(TCPEndpoint("127.0.0.1", port), quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer push.Close()
	ctx := testCtx(t, 20*time.Second)
	msgs := standardMessages()
	for i, m := range msgs {
		if err := push.Send(ctx, m...); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
	}
	if got, want := peer.Line(20*time.Second), fmt.Sprint("OK ", len(msgs)); got != want {
		t.Fatalf("peer said %q, want %q", got, want)
	}
	peer.Wait(10 * time.Second)
}

// libzmq REQ (a new socket per request, as vLLM does) -> our ROUTER.
func TestInteropPythonReqToGoRouter(t *testing.T) {
	zmqtest.RequirePython(t, "zmq")
	r, err := ListenRouter("tcp://127.0.0.1:0", quiet())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	const n = 20
	peer := zmqtest.Start(t, peerScript, "req", r.Endpoint(), fmt.Sprint(n))
	ctx := testCtx(t, 20*time.Second)
	for i := range n {
		m, err := r.Recv(ctx)
		if err != nil {
			t.Fatalf("request %d: %v\npeer stderr: %s", i, err, peer.Stderr())
		}
		if len(m.Frames) != 3 || len(m.Frames[0]) != 0 || string(m.Frames[1]) != "req" {
			t.Fatalf("request %d: unexpected frames %q", i, m.Frames)
		}
		if err := r.Send(ctx, m.Peer, nil, []byte("rep"), m.Frames[2]); err != nil {
			t.Fatalf("reply %d: %v", i, err)
		}
	}
	if got := peer.Line(10 * time.Second); got != fmt.Sprint("OK ", n) {
		t.Fatalf("peer said %q", got)
	}
	peer.Wait(10 * time.Second)
}

// our REQ -> libzmq ROUTER.
func TestInteropGoReqToPythonRouter(t *testing.T) {
	zmqtest.RequirePython(t, "zmq")
	const n = 10
	peer := zmqtest.Start(t, peerScript, "router", fmt.Sprint(n))
	ep := TCPEndpoint("127.0.0.1", portLine(t, peer))
	for i := range n {
		ctx := testCtx(t, 5*time.Second)
		body := []byte(strings.Repeat("b", 100*i))
		rep, err := Request(ctx, ep, [][]byte{[]byte("hello"), body}, quiet())
		if err != nil {
			t.Fatalf("request %d: %v\npeer stderr: %s", i, err, peer.Stderr())
		}
		if !equalFrames(rep, [][]byte{[]byte("echo"), []byte("hello"), body}) {
			t.Fatalf("request %d: reply %q", i, rep)
		}
	}
	if got := peer.Line(10 * time.Second); got != fmt.Sprint("OK ", n) {
		t.Fatalf("peer said %q", got)
	}
	peer.Wait(10 * time.Second)
}

// A libzmq PUSH with heartbeats on keeps its one connection to our PULL
// through an idle period (we answer its PINGs), so nothing reconnects.
func TestInteropHeartbeats(t *testing.T) {
	zmqtest.RequirePython(t, "zmq")
	var logs logBuffer
	pull, err := ListenPull("tcp://127.0.0.1:0", WithLogger(logs.logger()))
	if err != nil {
		t.Fatal(err)
	}
	defer pull.Close()
	peer := zmqtest.Start(t, peerScript, "push-heartbeat", pull.Endpoint())
	ctx := testCtx(t, 30*time.Second)
	for _, want := range []string{"one", "two"} {
		m, err := pull.Recv(ctx)
		if err != nil || string(m[0]) != want {
			t.Fatalf("recv %s: %q %v\n%s", want, m, err, peer.Stderr())
		}
	}
	peer.Wait(10 * time.Second)
	waitFor(t, "the peer's final disconnect", func() bool { return strings.Contains(logs.String(), "peer disconnected") })
	if n := strings.Count(logs.String(), "peer disconnected"); n != 1 {
		t.Fatalf("%d disconnects, want 1 (heartbeat timeouts?):\n%s", n, logs.String())
	}
}
