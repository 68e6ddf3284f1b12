package push

import "testing"

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
