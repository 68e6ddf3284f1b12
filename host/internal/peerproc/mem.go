package peerproc

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"syscall"
	"unsafe"
)

// Map returns size bytes of anonymous memory outside the Go heap, so that a
// plugin may keep its address for as long as it is registered. The caller
// unmaps it with Unmap, after deregistering it.
func Map(size uint64) ([]byte, error) {
	if size == 0 || size > 1<<40 {
		return nil, fmt.Errorf("peerproc: cannot map a buffer of %d bytes", size)
	}
	b, err := syscall.Mmap(-1, 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("peerproc: mmap %d bytes: %w", size, err)
	}
	return b, nil
}

// Unmap unmaps memory Map returned; nil is a no-op.
func Unmap(b []byte) error {
	if b == nil {
		return nil
	}
	return syscall.Munmap(b)
}

// Addr returns the address of the first byte of b.
func Addr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

// The pattern: the bytes of b are the little-endian bytes of the words
// (k + mix(seed)) * golden, k = 0, 1, ... from b's start (the last word cut
// short when len(b) is not a multiple of 8). mix spreads the seeds, so two
// seeds' patterns do not line up at any offset of a buffer.
const golden = 0x9E3779B97F4A7C15

// mix is splitmix64's finaliser.
func mix(x uint64) uint64 {
	x += golden
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// Fill writes the pattern of seed into b.
func Fill(b []byte, seed uint64) {
	base := mix(seed)
	words := len(b) / 8
	for k := range words {
		binary.LittleEndian.PutUint64(b[8*k:], (uint64(k)+base)*golden)
	}
	if tail := len(b) % 8; tail != 0 {
		var last [8]byte
		binary.LittleEndian.PutUint64(last[:], (uint64(words)+base)*golden)
		copy(b[8*words:], last[:tail])
	}
}

// Verify checks b against the pattern of seed and returns the offset of
// the first wrong byte, or -1.
func Verify(b []byte, seed uint64) int64 {
	base := mix(seed)
	words := len(b) / 8
	for k := range words {
		want := (uint64(k) + base) * golden
		if got := binary.LittleEndian.Uint64(b[8*k:]); got != want {
			for j := range 8 {
				if byte(got>>(8*j)) != byte(want>>(8*j)) {
					return int64(8*k + j)
				}
			}
		}
	}
	if tail := len(b) % 8; tail != 0 {
		want := (uint64(words) + base) * golden
		for j := range tail {
			if b[8*words+j] != byte(want>>(8*j)) {
				return int64(8*words + j)
			}
		}
	}
	return -1
}

// Sum returns the SHA-256 of b.
func Sum(b []byte) []byte {
	s := sha256.Sum256(b)
	return s[:]
}
