package push

import (
	"bytes"
	"testing"

	"github.com/kvhost/kvhost/host/wire/sglang"
)

func TestEngineDescWrap(t *testing.T) {
	md := []byte("KVFM\x01 plugin metadata that is not msgpack")
	desc := moriEngineDesc(md, "decode-agent-0", 3)
	key, err := sglang.MORIEngineKey(desc)
	if err != nil || key != "decode-agent-0" {
		t.Fatalf("wrapped desc key %q, %v", key, err)
	}
	if got := unwrapEngineDesc(desc); !bytes.Equal(got, md) {
		t.Fatalf("unwrap: %q", got)
	}
	// A real EngineDesc (msgpack array, key first) passes through as is.
	real := []byte{0x92, 0xa3, 'k', 'e', 'y', 0x01}
	if got := moriEngineDesc(real, "ignored", 0); !bytes.Equal(got, real) {
		t.Fatal("a msgpack EngineDesc was wrapped")
	}
	if got := unwrapEngineDesc(real); !bytes.Equal(got, real) {
		t.Fatal("a real EngineDesc was unwrapped")
	}
	big := bytes.Repeat([]byte{7}, 70000)
	if got := unwrapEngineDesc(moriEngineDesc(big, "k", -1)); !bytes.Equal(got, big) {
		t.Fatal("large metadata")
	}
}

func TestExtFrames(t *testing.T) {
	a := &KVArgs{Aux: []AuxBuffer{{Mem: make([]byte, 640), ItemLen: 64}}, State: []StateComponent{{Type: "mamba", Tensors: []Buffer{{Len: 10}, {Len: 20}}}}}
	frames := append(make([][]byte, 20), nixlExtFrames(a)...)
	aux, state := nixlExtLens(frames)
	if len(aux) != 1 || aux[0] != 640 || len(state) != 1 || len(state[0]) != 2 || state[0][1] != 20 {
		t.Fatalf("aux %v state %v", aux, state)
	}
	if aux, state := nixlExtLens(make([][]byte, 20)); aux != nil || state != nil {
		t.Fatal("lengths from a message without the extension")
	}
}

// FuzzUnwrapEngineDesc: what a MORI peer sends as EngineDesc never panics
// the unwrapper, and a wrapped blob round-trips.
func FuzzUnwrapEngineDesc(f *testing.F) {
	f.Add(moriEngineDesc([]byte("meta"), "k", 1))
	f.Add([]byte{0x95, 0xa1, 'k'})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		unwrapEngineDesc(b)
		if md, err := parseWrapped(moriEngineDesc(b, "key", 2)); err == nil && !bytes.Equal(md, b) {
			if _, kerr := sglang.MORIEngineKey(b); kerr != nil {
				t.Fatalf("round trip changed the metadata")
			}
		}
	})
}

// FuzzNIXLExtLens: kvhost's extension frames of a NIXL registration are
// parsed without panics whatever they hold.
func FuzzNIXLExtLens(f *testing.F) {
	f.Add([]byte(kvhostExt), []byte{1, 0, 0, 0, 0, 0, 0, 0}, []byte{})
	f.Add([]byte(kvhostExt), []byte{1, 2, 3}, []byte{1, 0, 0, 0, 9, 0, 0, 0})
	f.Fuzz(func(t *testing.T, a, b, c []byte) {
		frames := append(make([][]byte, 20), a, b, c)
		aux, _ := nixlExtLens(frames)
		if len(aux)*8 > len(b) {
			t.Fatal("more lengths than bytes")
		}
	})
}
