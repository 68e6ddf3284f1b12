package zmq

import (
	"bufio"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

func withMessageTimeout(d time.Duration) Option {
	return func(o *options) { o.messageTimeout = d }
}

func withEvictIdle(d time.Duration) Option {
	return func(o *options) { o.evictIdle = d }
}

func withContendedTimeout(d time.Duration) Option {
	return func(o *options) { o.contendedTimeout = d }
}

// rawPeer completes a ZMTP handshake by hand as a socket of type typ and
// returns the connection, positioned after the server's READY. addr is
// "host:port", or a unix socket path ("/..." or "@name").
func rawPeer(t *testing.T, addr, typ string) (net.Conn, *bufio.Reader) {
	t.Helper()
	network := "tcp"
	if strings.HasPrefix(addr, "/") || strings.HasPrefix(addr, "@") {
		network = "unix"
	}
	c, err := net.Dial(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	c.Write(greeting())
	c.Write(encodeCommand("READY", readyMetadata(typ)))
	r := bufio.NewReader(c)
	if _, err := io.ReadFull(r, make([]byte, greetingSize)); err != nil {
		t.Fatal(err)
	}
	if _, cmd, err := readMessage(r, limits{maxMessageSize: 1 << 16, maxFrames: 1}); err != nil || cmd == nil || cmd.name != "READY" {
		t.Fatalf("READY: %v %v", cmd, err)
	}
	return c, r
}

// A peer that starts a message and stalls is dropped once the message
// timeout passes; a peer that is merely idle between messages is not.
func TestPullDropsStalledMessages(t *testing.T) {
	const timeout = 300 * time.Millisecond
	var logs logBuffer
	pull := newPull(t, WithLogger(logs.logger()), withMessageTimeout(timeout))
	addr := pull.Addr().String()

	idle, _ := rawPeer(t, addr, typePush)
	slow, slowR := rawPeer(t, addr, typePush)
	slow.Write([]byte{0, 100})   // a 100-byte frame...
	slow.Write(make([]byte, 10)) // ...of which 10 bytes arrive
	start := time.Now()
	if _, err := slowR.ReadByte(); err != io.EOF {
		t.Fatalf("stalled peer: read %v, want EOF (dropped)", err)
	}
	if el := time.Since(start); el < timeout/2 || el > 10*timeout {
		t.Fatalf("stalled peer dropped after %v, want about %v", el, timeout)
	}
	waitFor(t, "the stall to be logged", func() bool { return strings.Contains(logs.String(), "did not finish a message") })

	time.Sleep(timeout) // idle for longer than the message timeout
	idle.Write(encodeMessage([][]byte{[]byte("still here")}))
	if m, err := pull.Recv(testCtx(t, 5*time.Second)); err != nil || string(m[0]) != "still here" {
		t.Fatalf("idle peer: %q %v", m, err)
	}
}

// Before READY only a command is acceptable: a data frame that declares
// more than a command may hold is refused by its header, at once, not
// read for up to the handshake timeout.
func TestHandshakeRefusesDataBeforeReady(t *testing.T) {
	var logs logBuffer
	pull := newPull(t, WithLogger(logs.logger()), WithHandshakeTimeout(5*time.Second))
	c, err := net.Dial("tcp", pull.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	c.Write(greeting())
	c.Write([]byte{flagLong, 0, 0, 0, 0, 0x01, 0, 0, 0}) // a 16 MiB data frame
	start := time.Now()
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("reading until the server closes: %v", err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("refused after %v; the header alone should do", el)
	}
	waitFor(t, "the refusal to be logged", func() bool { return strings.Contains(logs.String(), "message larger than") })
}
