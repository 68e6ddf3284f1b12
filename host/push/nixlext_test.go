package push

import "testing"

func TestExtFrames(t *testing.T) {
	a := &KVArgs{Aux: []AuxBuffer{{Mem: make([]byte, 640), ItemLen: 64}}, State: []StateComponent{{Type: "mamba", Tensors: []Buffer{{Len: 10}, {Len: 20}}}}}
	frames := append(make([][]byte, 20), nixlExtFrames(a)...)
	aux, state, err := nixlExtLens(frames)
	if err != nil || len(aux) != 1 || aux[0] != 640 || len(state) != 1 || len(state[0]) != 2 || state[0][1] != 20 {
		t.Fatalf("aux %v state %v err %v", aux, state, err)
	}
	if aux, state, err := nixlExtLens(make([][]byte, 20)); aux != nil || state != nil || err != nil {
		t.Fatal("lengths from a message without the extension")
	}
	// Present but without aux buffers: lengths known (none), not unknown.
	if aux, _, err := nixlExtLens(append(make([][]byte, 20), nixlExtFrames(&KVArgs{})...)); aux == nil || len(aux) != 0 || err != nil {
		t.Fatalf("no aux buffers: %v %v", aux, err)
	}
	// Present but malformed: an error, never "no lengths" (which would
	// relax the aux check).
	for _, bad := range [][][]byte{
		{[]byte(kvhostExt)},
		{[]byte(kvhostExt), {1, 2, 3}, nil},
		{[]byte(kvhostExt), nil, {1, 0, 0, 0, 9, 0, 0, 0}},
	} {
		if _, _, err := nixlExtLens(append(make([][]byte, 20), bad...)); err == nil {
			t.Errorf("malformed extension %q accepted", bad)
		}
	}
}

// FuzzNIXLExtLens: kvhost's extension frames of a NIXL registration are
// parsed without panics whatever they hold.
func FuzzNIXLExtLens(f *testing.F) {
	f.Add([]byte(kvhostExt), []byte{1, 0, 0, 0, 0, 0, 0, 0}, []byte{})
	f.Add([]byte(kvhostExt), []byte{1, 2, 3}, []byte{1, 0, 0, 0, 9, 0, 0, 0})
	f.Fuzz(func(t *testing.T, a, b, c []byte) {
		frames := append(make([][]byte, 20), a, b, c)
		aux, _, err := nixlExtLens(frames)
		if len(aux)*8 > len(b) {
			t.Fatal("more lengths than bytes")
		}
		if string(a) == kvhostExt && err == nil && aux == nil {
			t.Fatal("extension present but lengths unknown")
		}
	})
}
