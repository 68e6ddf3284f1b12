//go:build amd64 && !kvhost_purego

package plugin

// makeAllocs is what making (and closing) one transfer allocates on a
// native path: the *Xfer. The args structs stay on the stack (callC does
// not let them escape).
const makeAllocs = 1
