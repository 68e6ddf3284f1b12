package zmq

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"testing"
)

var testLimits = limits{maxMessageSize: 1 << 20, maxFrames: 16}

func encodeMessage(frames [][]byte) []byte {
	var b bytes.Buffer
	for i, f := range frames {
		var hdr [9]byte
		var flags byte
		if i < len(frames)-1 {
			flags = flagMore
		}
		n := frameHeader(hdr[:], flags, len(f))
		b.Write(hdr[:n])
		b.Write(f)
	}
	return b.Bytes()
}

func TestFrameRoundTrip(t *testing.T) {
	msgs := [][][]byte{
		{{}},
		{[]byte("x")},
		{bytes.Repeat([]byte("y"), 255), bytes.Repeat([]byte("z"), 256), {}},
	}
	var wire []byte
	for _, m := range msgs {
		wire = append(wire, encodeMessage(m)...)
	}
	r := bufio.NewReader(bytes.NewReader(wire))
	for i, want := range msgs {
		got, cmd, err := readMessage(r, testLimits)
		if err != nil || cmd != nil {
			t.Fatalf("message %d: err %v cmd %v", i, err, cmd)
		}
		if !equalFrames(got, want) {
			t.Fatalf("message %d: got %q want %q", i, got, want)
		}
	}
	if _, _, err := readMessage(r, testLimits); err != io.EOF {
		t.Fatalf("after last message: %v, want io.EOF", err)
	}
}

func TestFrameHeaderLongForm(t *testing.T) {
	var hdr [9]byte
	if n := frameHeader(hdr[:], 0, 255); n != 2 || hdr[1] != 255 {
		t.Fatalf("255 bytes: header % x", hdr[:n])
	}
	if n := frameHeader(hdr[:], flagMore, 256); n != 9 || hdr[0] != flagMore|flagLong || !bytes.Equal(hdr[1:9], []byte{0, 0, 0, 0, 0, 0, 1, 0}) {
		t.Fatalf("256 bytes: header % x", hdr[:n])
	}
}

func TestReadMessageRejects(t *testing.T) {
	cmd := encodeCommand("PING", []byte{0, 10})
	cases := map[string][]byte{
		"reserved flag bits":   {0x08, 0},
		"declared 2^44 bytes":  {flagLong, 0, 0, 0x10, 0, 0, 0, 0, 0},
		"just over the limit":  append([]byte{flagLong}, 0, 0, 0, 0, 0, 0x10, 0, 1),
		"command inside msg":   append([]byte{flagMore, 1, 'a'}, cmd...),
		"command with MORE":    {flagCommand | flagMore, 1, 1},
		"huge command":         {flagCommand | flagLong, 0, 0, 0, 0, 0, 1, 0, 1},
		"empty command name":   {flagCommand, 1, 0},
		"command name too big": {flagCommand, 2, 5, 'x'},
		"too many frames":      bytes.Repeat([]byte{flagMore, 0}, 17),
	}
	for name, wire := range cases {
		_, _, err := readMessage(bufio.NewReader(bytes.NewReader(wire)), testLimits)
		if !errors.Is(err, ErrProtocol) {
			t.Errorf("%s: err = %v, want ErrProtocol", name, err)
		}
	}
}

func TestReadMessageTruncated(t *testing.T) {
	wire := encodeMessage([][]byte{[]byte("abc"), []byte("defgh")})
	for cut := 1; cut < len(wire); cut++ {
		_, _, err := readMessage(bufio.NewReader(bytes.NewReader(wire[:cut])), testLimits)
		if err != io.ErrUnexpectedEOF {
			t.Fatalf("cut at %d: err = %v, want io.ErrUnexpectedEOF", cut, err)
		}
	}
}

func TestGreetingChecks(t *testing.T) {
	if err := checkGreeting(greeting()); err != nil {
		t.Fatalf("own greeting rejected: %v", err)
	}
	bad := func(mut func(g []byte)) []byte {
		g := greeting()
		mut(g)
		return g
	}
	for name, g := range map[string][]byte{
		"no signature": bad(func(g []byte) { g[0] = 'G' }),
		"zmtp 2":       bad(func(g []byte) { g[10] = 2 }),
		"curve":        bad(func(g []byte) { copy(g[12:32], "CURVE") }),
		"short":        greeting()[:10],
	} {
		if err := checkGreeting(g); !errors.Is(err, ErrProtocol) {
			t.Errorf("%s: %v, want ErrProtocol", name, err)
		}
	}
}

func TestProperties(t *testing.T) {
	props, err := parseProperties(readyMetadata(typeRouter))
	if err != nil {
		t.Fatal(err)
	}
	if string(props["socket-type"]) != "ROUTER" {
		t.Fatalf("socket-type %q", props["socket-type"])
	}
	if id, ok := props["identity"]; !ok || len(id) != 0 {
		t.Fatalf("identity %q present=%v", id, ok)
	}
	for _, bad := range [][]byte{
		{0},                       // empty name
		{3, 'a', 'b'},             // name runs past the end
		{1, 'a', 0, 0, 0, 9, 'x'}, // value runs past the end
	} {
		if _, err := parseProperties(bad); !errors.Is(err, ErrProtocol) {
			t.Errorf("% x: %v, want ErrProtocol", bad, err)
		}
	}
}

func TestCompatibleTypes(t *testing.T) {
	ok := [][2]string{{"PUSH", "PULL"}, {"PULL", "PUSH"}, {"ROUTER", "REQ"}, {"ROUTER", "DEALER"}, {"REQ", "ROUTER"}, {"REQ", "REP"}}
	for _, p := range ok {
		if !compatible(p[0], p[1]) {
			t.Errorf("%s/%s should be compatible", p[0], p[1])
		}
	}
	for _, p := range [][2]string{{"PULL", "PULL"}, {"PUSH", "REQ"}, {"ROUTER", "PUSH"}, {"REQ", "REQ"}, {"PULL", ""}} {
		if compatible(p[0], p[1]) {
			t.Errorf("%s/%s should not be compatible", p[0], p[1])
		}
	}
}
