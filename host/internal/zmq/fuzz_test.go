package zmq

import (
	"bufio"
	"bytes"
	"net"
	"strings"
	"testing"
)

// FuzzReadMessage feeds arbitrary bytes to the frame reader: it must never
// panic, what it returns must respect the limits, and it must reserve
// exactly the memory a message keeps (what a socket's receive budget is
// charged).
func FuzzReadMessage(f *testing.F) {
	f.Add(encodeMessage([][]byte{[]byte("a"), bytes.Repeat([]byte("b"), 300)}))
	f.Add(encodeCommand("PING", []byte{0, 1, 'c'}))
	f.Add([]byte{flagLong, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{flagMore, 0, flagMore, 0, 0, 0})
	f.Fuzz(func(t *testing.T, wire []byte) {
		var reserved int64
		lim := limits{maxMessageSize: 4096, maxFrames: 8, reserve: func(n int64) error { reserved += n; return nil }}
		r := bufio.NewReader(bytes.NewReader(wire))
		for range 64 {
			reserved = 0
			frames, cmd, err := readMessage(r, lim)
			if err != nil {
				return
			}
			if cmd == nil {
				var total int
				for _, fr := range frames {
					total += len(fr)
				}
				if len(frames) == 0 || len(frames) > lim.maxFrames || int64(total) > lim.maxMessageSize {
					t.Fatalf("limits broken: %d frames, %d bytes", len(frames), total)
				}
				if want := int64(total + frameOverhead*len(frames)); reserved != want {
					t.Fatalf("reserved %d bytes for a message that keeps %d", reserved, want)
				}
			} else if reserved != 0 {
				t.Fatalf("reserved %d bytes for a command", reserved)
			}
		}
	})
}

// FuzzHandshakeParsing covers the greeting check and READY metadata parser.
func FuzzHandshakeParsing(f *testing.F) {
	f.Add(greeting(), readyMetadata(typeReq))
	f.Add(greeting(), readyMetadata(typeDealer))
	f.Add(greeting(), encodeCommand("READY", readyMetadata(typeDealer))[2:])
	f.Add(make([]byte, 64), []byte{1, 'a', 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, g, props []byte) {
		_ = checkGreeting(g)
		if m, err := parseProperties(props); err == nil {
			for name := range m {
				if name == "" {
					t.Fatal("empty property name accepted")
				}
			}
		}
		_, _ = parseCommand(props)
	})
}

// FuzzParseEndpoint: endpoint parsing never panics, and what it accepts
// is usable: an ipc path within sun_path without NUL bytes, a TCP
// address that splits into host and port.
func FuzzParseEndpoint(f *testing.F) {
	for _, s := range []string{"ipc:///run/kvhost/engine.sock", "ipc://@kvhost", "ipc://", "ipc://*", "tcp://127.0.0.1:5", "tcp://*:0", "tcp://[::1]:80", "ipc://a\x00"} {
		f.Add(s, true)
	}
	f.Fuzz(func(t *testing.T, ep string, bind bool) {
		a, err := parseEndpoint(ep, bind)
		if err != nil {
			return
		}
		switch a.network {
		case "unix":
			if a.addr == "" || len(a.addr) > maxIPCPath || strings.IndexByte(a.addr, 0) >= 0 || IPCEndpoint(a.addr) != ep {
				t.Fatalf("%q: bad ipc address %q", ep, a.addr)
			}
		case "tcp":
			if _, _, err := net.SplitHostPort(a.addr); err != nil {
				t.Fatalf("%q: bad tcp address %q: %v", ep, a.addr, err)
			}
		default:
			t.Fatalf("%q: network %q", ep, a.network)
		}
	})
}
