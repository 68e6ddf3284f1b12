package schedstat

import (
	"fmt"
	"testing"
)

// FuzzParse: any bytes give a Thread or an error, and what parses prints
// back to the same numbers.
func FuzzParse(f *testing.F) {
	for _, s := range []string{"845423 0 1\n", "1 2 3", "", "1 2", "9223372036854775807 1 1\n", "-1 0 0"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		th, err := Parse(b)
		if err != nil {
			return
		}
		back, err := Parse([]byte(fmt.Sprintf("%d %d %d\n", int64(th.Run), int64(th.Wait), th.Slices)))
		if err != nil || back != th {
			t.Fatalf("Parse(%q) = %+v, reprinted: %+v, %v", b, th, back, err)
		}
		if th.Run < 0 || th.Wait < 0 {
			t.Fatalf("Parse(%q): negative %+v", b, th)
		}
	})
}
