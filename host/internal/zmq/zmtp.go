package zmq

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
)

// ZMTP 3.1 (rfc.zeromq.org/spec/37) as libzmq 4.x speaks it, NULL
// mechanism only.

const (
	greetingSize = 64

	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04
	flagsKnown  = flagMore | flagLong | flagCommand

	// maxCommandSize bounds a command frame (READY metadata, PING, ERROR).
	maxCommandSize = 64 << 10

	// smallFrame: frames up to this size are allocated at their declared
	// size; larger ones grow with the bytes that actually arrive, so a
	// declared length costs nothing until the peer sends the bytes.
	smallFrame = 64 << 10
)

// Socket types as they appear in the READY command's Socket-Type property.
const (
	typePush   = "PUSH"
	typePull   = "PULL"
	typeRouter = "ROUTER"
	typeReq    = "REQ"
	typeDealer = "DEALER"
)

// ErrProtocol marks a peer that violated ZMTP (bad greeting, bad frame,
// oversized message). errors.Is(err, ErrProtocol) tells it from I/O errors.
var ErrProtocol = errors.New("zmq: protocol violation")

func protoErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrProtocol, fmt.Sprintf(format, args...))
}

// compatible reports whether a local socket of type local may talk to a
// peer of type peer (ZMTP's socket-type matrix, restricted to our types).
func compatible(local, peer string) bool {
	switch local {
	case typePush:
		return peer == typePull
	case typePull:
		return peer == typePush
	case typeRouter:
		return peer == typeReq || peer == typeDealer || peer == typeRouter
	case typeReq:
		return peer == "REP" || peer == typeRouter
	case typeDealer:
		return peer == typeRouter || peer == typeDealer || peer == "REP"
	}
	return false
}

// greeting is what we send: signature (0xFF, 8 bytes, 0x7F) as libzmq
// writes it, version 3.1, mechanism NULL, as-server 0, filler.
func greeting() []byte {
	g := make([]byte, greetingSize)
	g[0] = 0xFF
	g[8] = 0x01 // libzmq writes the ZMTP 1.0 identity length (empty id + 1)
	g[9] = 0x7F
	g[10] = 3
	g[11] = 1
	copy(g[12:32], "NULL")
	return g
}

// checkGreeting validates a peer's 64-byte greeting.
func checkGreeting(g []byte) error {
	if len(g) != greetingSize {
		return protoErr("greeting of %d bytes", len(g))
	}
	if g[0] != 0xFF || g[9]&0x01 == 0 {
		return protoErr("not a ZMTP peer (signature % x)", g[:10])
	}
	if g[10] < 3 {
		return protoErr("peer speaks ZMTP %d.%d; 3.0 or later is required", g[10], g[11])
	}
	mech := string(bytes.TrimRight(g[12:32], "\x00"))
	if mech != "NULL" {
		return protoErr("peer uses security mechanism %q; only NULL is supported", mech)
	}
	return nil
}

// readyMetadata builds the metadata of our READY command for a socket of
// the given type. REQ, DEALER and ROUTER also announce an empty Identity,
// as libzmq does.
func readyMetadata(sockType string) []byte {
	var b bytes.Buffer
	writeProp := func(name string, value []byte) {
		b.WriteByte(byte(len(name)))
		b.WriteString(name)
		var n [4]byte
		binary.BigEndian.PutUint32(n[:], uint32(len(value)))
		b.Write(n[:])
		b.Write(value)
	}
	writeProp("Socket-Type", []byte(sockType))
	if sockType == typeReq || sockType == typeDealer || sockType == typeRouter {
		writeProp("Identity", nil)
	}
	return b.Bytes()
}

// command is a parsed ZMTP command frame.
type command struct {
	name string
	body []byte // the bytes after the name
}

func parseCommand(frame []byte) (command, error) {
	if len(frame) < 1 || int(frame[0]) > len(frame)-1 || frame[0] == 0 {
		return command{}, protoErr("malformed command frame (%d bytes)", len(frame))
	}
	n := int(frame[0])
	return command{name: string(frame[1 : 1+n]), body: frame[1+n:]}, nil
}

// parseProperties parses READY metadata: repeated (1-byte name length,
// name, 4-byte big-endian value length, value). Names are
// case-insensitive; they are returned lower-cased.
func parseProperties(b []byte) (map[string][]byte, error) {
	props := make(map[string][]byte)
	for len(b) > 0 {
		nl := int(b[0])
		if nl == 0 || 1+nl+4 > len(b) {
			return nil, protoErr("truncated metadata property")
		}
		name := strings.ToLower(string(b[1 : 1+nl]))
		b = b[1+nl:]
		vl := binary.BigEndian.Uint32(b[:4])
		b = b[4:]
		if uint64(vl) > uint64(len(b)) {
			return nil, protoErr("metadata property %q declares %d bytes, %d left", name, vl, len(b))
		}
		props[name] = b[:vl]
		b = b[vl:]
	}
	return props, nil
}

// frameHeader encodes the flags and size of one frame into dst (at least
// 9 bytes) and returns the header length.
func frameHeader(dst []byte, flags byte, size int) int {
	if size > 255 {
		dst[0] = flags | flagLong
		binary.BigEndian.PutUint64(dst[1:9], uint64(size))
		return 9
	}
	dst[0] = flags
	dst[1] = byte(size)
	return 2
}

// encodeCommand returns a complete command frame (header and body).
func encodeCommand(name string, body []byte) []byte {
	payload := make([]byte, 0, 1+len(name)+len(body))
	payload = append(payload, byte(len(name)))
	payload = append(payload, name...)
	payload = append(payload, body...)
	var hdr [9]byte
	n := frameHeader(hdr[:], flagCommand, len(payload))
	return append(hdr[:n:n], payload...)
}

// limits bound what readMessage accepts from a peer.
type limits struct {
	maxMessageSize int64
	maxFrames      int
	// reserve, when set, is called before memory for a data frame is
	// allocated, with the bytes about to be allocated; it may wait (for a
	// receive budget) and fails the read when it returns an error.
	reserve func(n int64) error
	// discardOversize: a data message over maxMessageSize or maxFrames is
	// read to its end and dropped (errOversized) instead of ending the
	// connection (WithDiscardOversize).
	discardOversize bool
}

func (l limits) take(n int64) error {
	if l.reserve == nil {
		return nil
	}
	return l.reserve(n)
}

// readMessage reads the next message or command from r. Exactly one of
// frames and cmd is set on success. A command in the middle of a
// multi-frame message, unknown flag bits, an oversized message or too many
// frames are protocol errors. Memory grows with the bytes received, never
// with a declared length.
func readMessage(r *bufio.Reader, lim limits) (frames [][]byte, cmd *command, err error) {
	var total int64
	discarding := false
	for {
		flags, err := r.ReadByte()
		if err != nil {
			return nil, nil, truncated(err, len(frames) > 0)
		}
		if flags&^flagsKnown != 0 {
			return nil, nil, protoErr("frame flags %#02x have reserved bits set", flags)
		}
		var size uint64
		if flags&flagLong != 0 {
			var b [8]byte
			if _, err := io.ReadFull(r, b[:]); err != nil {
				return nil, nil, truncated(err, true)
			}
			size = binary.BigEndian.Uint64(b[:])
		} else {
			b, err := r.ReadByte()
			if err != nil {
				return nil, nil, truncated(err, true)
			}
			size = uint64(b)
		}
		if flags&flagCommand != 0 {
			if len(frames) > 0 {
				return nil, nil, protoErr("command frame inside a multi-frame message")
			}
			if flags&flagMore != 0 {
				return nil, nil, protoErr("command frame with the MORE flag")
			}
			if size > maxCommandSize {
				return nil, nil, protoErr("command frame of %d bytes (limit %d)", size, maxCommandSize)
			}
			body := make([]byte, size)
			if _, err := io.ReadFull(r, body); err != nil {
				return nil, nil, truncated(err, true)
			}
			c, err := parseCommand(body)
			if err != nil {
				return nil, nil, err
			}
			return nil, &c, nil
		}
		if !discarding && len(frames) >= lim.maxFrames {
			if !lim.discardOversize {
				return nil, nil, protoErr("message has more than %d frames", lim.maxFrames)
			}
			discarding, frames = true, nil
		}
		if !discarding && size > uint64(lim.maxMessageSize-total) {
			if !lim.discardOversize {
				return nil, nil, protoErr("message larger than %d bytes", lim.maxMessageSize)
			}
			discarding, frames = true, nil
		}
		if discarding {
			// Read and drop: memory does not grow, and the connection
			// stays in step with the peer's frames.
			if size > 1<<62 {
				return nil, nil, protoErr("frame of %d bytes", size)
			}
			if _, err := io.CopyN(io.Discard, r, int64(size)); err != nil {
				return nil, nil, truncated(err, true)
			}
			if flags&flagMore == 0 {
				return nil, nil, errOversized
			}
			continue
		}
		total += int64(size)
		body, err := readBody(r, int64(size), lim)
		if err != nil {
			return nil, nil, truncated(err, true)
		}
		frames = append(frames, body)
		if flags&flagMore == 0 {
			return frames, nil, nil
		}
	}
}

// readBody reads exactly n bytes, allocating as they arrive for large n.
// Every allocation is reserved through lim first (with frameOverhead for
// the frame itself), so what is charged is the memory actually held.
func readBody(r io.Reader, n int64, lim limits) ([]byte, error) {
	if n <= smallFrame {
		if err := lim.take(frameOverhead + n); err != nil {
			return nil, err
		}
		b := make([]byte, n)
		_, err := io.ReadFull(r, b)
		return b, err
	}
	if err := lim.take(frameOverhead); err != nil {
		return nil, err
	}
	var buf []byte
	for int64(len(buf)) < n {
		if len(buf) == cap(buf) {
			// Grow by doubling, never past n: the capacity held is at most
			// twice the bytes received and never more than n.
			grown := min(n, max(2*int64(cap(buf)), smallFrame))
			if err := lim.take(grown - int64(cap(buf))); err != nil {
				return nil, err
			}
			nb := make([]byte, len(buf), grown)
			copy(nb, buf)
			buf = nb
		}
		m, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+m]
		if err != nil && int64(len(buf)) < n {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
	return buf, nil
}

// truncated turns an EOF inside a message into io.ErrUnexpectedEOF; a
// clean EOF between messages stays io.EOF.
func truncated(err error, inside bool) error {
	if inside && errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}
