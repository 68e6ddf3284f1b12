package sglang

import (
	"bytes"
	"testing"
)

func TestEngineDescWrap(t *testing.T) {
	md := []byte("KVFM\x01 plugin metadata that is not msgpack")
	desc := WrapEngineDesc(md, "decode-agent-0", 3)
	key, err := MORIEngineKey(desc)
	if err != nil || key != "decode-agent-0" {
		t.Fatalf("wrapped desc key %q, %v", key, err)
	}
	if got := UnwrapEngineDesc(desc); !bytes.Equal(got, md) {
		t.Fatalf("unwrap: %q", got)
	}
	// A real EngineDesc (msgpack array, key first) passes through as is.
	real := []byte{0x92, 0xa3, 'k', 'e', 'y', 0x01}
	if got := WrapEngineDesc(real, "ignored", 0); !bytes.Equal(got, real) {
		t.Fatal("a msgpack EngineDesc was wrapped")
	}
	if got := UnwrapEngineDesc(real); !bytes.Equal(got, real) {
		t.Fatal("a real EngineDesc was unwrapped")
	}
	// Five elements but not kvhost's host marker: not a wrapper.
	other := WrapEngineDesc(md, "k", 1)
	other = bytes.Replace(other, []byte(wrappedEngineHost), []byte("kvhost-wrappeX"), 1)
	if got := UnwrapEngineDesc(other); !bytes.Equal(got, other) {
		t.Fatal("a foreign 5-element EngineDesc was unwrapped")
	}
	for _, gpu := range []int{-1, 0, 127, 128, 1 << 20} {
		big := bytes.Repeat([]byte{7}, 70000)
		if got := UnwrapEngineDesc(WrapEngineDesc(big, "k", gpu)); !bytes.Equal(got, big) {
			t.Fatalf("large metadata, gpu %d", gpu)
		}
	}
}

// FuzzUnwrapEngineDesc: what a MORI peer sends as EngineDesc never panics
// the unwrapper, and wrapped metadata round-trips.
func FuzzUnwrapEngineDesc(f *testing.F) {
	f.Add(WrapEngineDesc([]byte("meta"), "k", 1))
	f.Add([]byte{0x95, 0xa1, 'k'})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		UnwrapEngineDesc(b)
		if _, err := MORIEngineKey(b); err != nil { // b is wrapped, not passed through
			if got := UnwrapEngineDesc(WrapEngineDesc(b, "key", 2)); !bytes.Equal(got, b) {
				t.Fatalf("round trip changed the metadata")
			}
		}
	})
}
