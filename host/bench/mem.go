package bench

import "github.com/kvhost/kvhost/host/internal/peerproc"

// buffer is anonymous mmap'd memory outside the Go heap (peerproc.Map), so
// a plugin may keep its address for as long as it is registered. The owner
// unmaps it with free after deregistering it.
type buffer []byte

func mapBuffer(size uint64) (buffer, error) {
	b, err := peerproc.Map(size)
	return buffer(b), err
}

func (b buffer) free() error  { return peerproc.Unmap(b) }
func (b buffer) addr() uint64 { return peerproc.Addr(b) }

// fill writes the pattern of seed (peerproc.Fill) into b[:n]. A fresh seed
// per row means a stale byte from an earlier row never passes for a moved
// one.
func fill(b buffer, n, seed uint64) { peerproc.Fill(b[:n], seed) }

// verify checks b[:n] against the pattern of seed and returns the offset of
// the first wrong byte, or -1.
func verify(b buffer, n, seed uint64) int64 { return peerproc.Verify(b[:n], seed) }

// clear0 zeroes b[:n].
func clear0(b buffer, n uint64) { clear(b[:n]) }
