package bench

import (
	"encoding/binary"
	"fmt"
	"syscall"
	"unsafe"
)

// buffer is anonymous mmap'd memory outside the Go heap, so a plugin may keep
// its address for as long as it is registered. The owner unmaps it with free
// after deregistering it.
type buffer []byte

func mapBuffer(size uint64) (buffer, error) {
	if size > 1<<40 {
		return nil, fmt.Errorf("bench: buffer of %d bytes is too large", size)
	}
	b, err := syscall.Mmap(-1, 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("bench: mmap %d bytes: %w", size, err)
	}
	return b, nil
}

func (b buffer) free() error {
	if b == nil {
		return nil
	}
	return syscall.Munmap(b)
}

func (b buffer) addr() uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

// The data pattern: byte i of a row's bytes is byte i%8 (little endian) of
// word (i/8 + seed) * golden. A fresh seed per row means a stale byte from an
// earlier row never passes for a moved one.
const golden = 0x9E3779B97F4A7C15

func patternWord(k, seed uint64) uint64 { return (k + seed) * golden }

// fill writes the pattern of seed into b[:n].
func fill(b buffer, n, seed uint64) {
	words := n / 8
	if words > 0 {
		w := unsafe.Slice((*uint64)(unsafe.Pointer(unsafe.SliceData(b))), words) // mmap'd: 8-aligned
		for k := range w {
			w[k] = patternWord(uint64(k), seed)
		}
	}
	if tail := n % 8; tail != 0 {
		var last [8]byte
		binary.LittleEndian.PutUint64(last[:], patternWord(words, seed))
		copy(b[words*8:n], last[:tail])
	}
}

// verify checks b[:n] against the pattern of seed and returns the offset of
// the first wrong byte, or -1.
func verify(b buffer, n, seed uint64) int64 {
	words := n / 8
	if words > 0 {
		w := unsafe.Slice((*uint64)(unsafe.Pointer(unsafe.SliceData(b))), words)
		for k, v := range w {
			if v != patternWord(uint64(k), seed) {
				var got, want [8]byte
				binary.LittleEndian.PutUint64(got[:], v)
				binary.LittleEndian.PutUint64(want[:], patternWord(uint64(k), seed))
				for j := range 8 {
					if got[j] != want[j] {
						return int64(k*8 + j)
					}
				}
			}
		}
	}
	if tail := n % 8; tail != 0 {
		var last [8]byte
		binary.LittleEndian.PutUint64(last[:], patternWord(words, seed))
		for j := range tail {
			if b[words*8+j] != last[j] {
				return int64(words*8 + j)
			}
		}
	}
	return -1
}

// clear zeroes b[:n].
func clear0(b buffer, n uint64) { clear(b[:n]) }
