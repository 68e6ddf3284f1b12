package conformance

import "fmt"

// firstDiff describes where got and want differ, for failure messages.
func firstDiff(got, want []byte) string {
	if len(got) != len(want) {
		return fmt.Sprintf("length %d, want %d", len(got), len(want))
	}
	first, n := -1, 0
	for i := range got {
		if got[i] != want[i] {
			if first < 0 {
				first = i
			}
			n++
		}
	}
	if first < 0 {
		return "no difference"
	}
	end := min(first+8, len(got))
	return fmt.Sprintf("%d bytes differ, the first at offset %d: got % x, want % x", n, first, got[first:end], want[first:end])
}
