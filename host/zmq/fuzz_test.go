package zmq

import (
	"bufio"
	"bytes"
	"testing"
)

// FuzzReadMessage feeds arbitrary bytes to the frame reader: it must never
// panic, and what it returns must respect the limits.
func FuzzReadMessage(f *testing.F) {
	f.Add(encodeMessage([][]byte{[]byte("a"), bytes.Repeat([]byte("b"), 300)}))
	f.Add(encodeCommand("PING", []byte{0, 1, 'c'}))
	f.Add([]byte{flagLong, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{flagMore, 0, flagMore, 0, 0, 0})
	f.Fuzz(func(t *testing.T, wire []byte) {
		lim := limits{maxMessageSize: 4096, maxFrames: 8}
		r := bufio.NewReader(bytes.NewReader(wire))
		for range 64 {
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
			}
		}
	})
}

// FuzzHandshakeParsing covers the greeting check and READY metadata parser.
func FuzzHandshakeParsing(f *testing.F) {
	f.Add(greeting(), readyMetadata(typeReq))
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
