package sglang

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"context"
	"github.com/kvhost/kvhost/host/internal/zmq"
	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
	"log/slog"
)

const peerScript = "testdata/sglang_peer.py"

func writeSpec(t *testing.T, msgs []Message) string {
	t.Helper()
	specs := make([]map[string]any, len(msgs))
	for i, m := range msgs {
		specs[i] = toSpec(m)
	}
	b, err := json.Marshal(specs)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "spec.json")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// jsonNormal compares specs after a JSON round trip (numbers as float64
// on both sides, like the Python peer sees them).
func jsonNormal(t *testing.T, v any) any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// parseAs parses frames with the parser for the message's direction and
// variant.
func parseAs(m Message, frames [][]byte) (Message, error) {
	switch m.(type) {
	case *NIXLRegistration, *NIXLTransferInfo:
		return ParseNIXLToPrefill(frames)
	case *MORIRegistration, *MORITransferInfo:
		return ParseMORIToPrefill(frames)
	case *Abort:
		return ParseNIXLToPrefill(frames)
	default:
		return ParseMORIToDecode(frames)
	}
}

// The Python peer builds every message with SGLang's disaggregation/{nixl,mori}/conn.py layouts and
// pushes it to a Go PULL socket; Go parses each into exactly the fixture.
func TestInteropPythonBuildsGoParses(t *testing.T) {
	zmqtest.RequirePython(t, "zmq", "msgpack", "numpy")
	msgs := fixtures()
	spec := writeSpec(t, msgs)
	pull, err := zmq.ListenPull("tcp://127.0.0.1:0", zmq.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	defer pull.Close()
	peer := zmqtest.Start(t, peerScript, "send", spec, pull.Endpoint())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for i, want := range msgs {
		frames, err := pull.Recv(ctx)
		if err != nil {
			t.Fatalf("message %d: %v\npeer stderr:\n%s", i, err, peer.Stderr())
		}
		got, err := parseAs(want, frames)
		if err != nil {
			t.Fatalf("message %d (%s): %v", i, kindOf(want), err)
		}
		if g, w := jsonNormal(t, toSpec(got)), jsonNormal(t, toSpec(want)); !reflect.DeepEqual(g, w) {
			t.Fatalf("message %d (%s):\n got %v\nwant %v", i, kindOf(want), g, w)
		}
		// And Go rebuilds byte-identical frames.
		again, err := got.Frames()
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(normFrames(again), normFrames(frames)) {
			t.Fatalf("message %d (%s): rebuilt frames differ from SGLang's disaggregation/{nixl,mori}/conn.py's", i, kindOf(want))
		}
	}
	peer.Wait(10 * time.Second)
}

// Go builds every message; the Python peer checks the bytes against the
// reference layout and parses them with SGLang's disaggregation/{nixl,mori}/conn.py's logic.
func TestInteropGoBuildsPythonParses(t *testing.T) {
	zmqtest.RequirePython(t, "zmq", "msgpack", "numpy")
	msgs := fixtures()
	spec := writeSpec(t, msgs)
	peer := zmqtest.Start(t, peerScript, "recv", spec)
	var port int
	if _, err := fmt.Sscanf(peer.Line(30*time.Second), "PORT %d", &port); err != nil {
		t.Fatal(err)
	}
	push, err := zmq.DialPush(zmq.TCPEndpoint("127.0.0.1", port), zmq.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	defer push.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for i, m := range msgs {
		frames, err := m.Frames()
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
		if err := push.Send(ctx, frames...); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := peer.Line(20*time.Second), fmt.Sprint("OK ", len(msgs)); got != want {
		t.Fatalf("peer: %q, want %q", got, want)
	}
	peer.Wait(10 * time.Second)
}

func normFrames(fs [][]byte) []string {
	out := make([]string, len(fs))
	for i, f := range fs {
		out[i] = string(f)
	}
	return out
}
