package sglang

import (
	"bytes"
	"fmt"
)

// AbortHeader is the first frame of the abort message decode sends to
// each prefill rank it bootstrapped with.
const AbortHeader = "ABORT"

// Abort tells a prefill rank that decode gave up on a request:
// [b"ABORT", room, decode IP, decode port] (CommonKVReceiver's
// _send_abort_notification). Both variants use it.
type Abort struct {
	Room     uint64
	Endpoint string
	Port     int
}

// Frames builds the multipart message.
func (m *Abort) Frames() ([][]byte, error) {
	if err := checkASCII(m.Endpoint, "endpoint"); err != nil {
		return nil, err
	}
	return [][]byte{[]byte(AbortHeader), utoa(m.Room), []byte(m.Endpoint), itoaInt(m.Port)}, nil
}

func parseAbort(frames [][]byte) (*Abort, error) {
	r, err := newFrameReader("ABORT", frames, 0, 4)
	if err != nil {
		return nil, err
	}
	m := &Abort{Room: r.uint(1, "room"), Endpoint: r.ascii(2, "endpoint"), Port: r.port(3, "port")}
	if r.err != nil {
		return nil, r.err
	}
	return m, nil
}

// Message is one parsed control message: *NIXLRegistration,
// *NIXLTransferInfo, *MORIRegistration, *MORITransferInfo, *Abort,
// *MORIStatus or *AuxData. Frames rebuilds its multipart form.
type Message interface {
	Frames() ([][]byte, error)
}

var (
	_ Message = (*NIXLRegistration)(nil)
	_ Message = (*NIXLTransferInfo)(nil)
	_ Message = (*MORIRegistration)(nil)
	_ Message = (*MORITransferInfo)(nil)
	_ Message = (*Abort)(nil)
	_ Message = (*MORIStatus)(nil)
	_ Message = (*AuxData)(nil)
)

// stagingHeaders are SGLang staging messages, which kvhost does not
// implement.
var stagingHeaders = []string{"WATERMARK", "STAGING_REQ", "STAGING_RSP"}

// ParseNIXLToPrefill parses a message a NIXL-variant prefill rank receives
// on its PULL socket: *NIXLRegistration (room "None"),
// *NIXLTransferInfo, or *Abort.
func ParseNIXLToPrefill(frames [][]byte) (Message, error) {
	return parseToPrefill(frames, NIXLGuard,
		func(p [][]byte) (Message, error) { return parseNIXLRegistration(p) },
		func(p [][]byte) (Message, error) { return parseNIXLTransferInfo(p) })
}

// ParseMORIToPrefill parses a message a MORI-variant prefill rank receives:
// *MORIRegistration (room "None"), *MORITransferInfo, or *Abort.
func ParseMORIToPrefill(frames [][]byte) (Message, error) {
	return parseToPrefill(frames, MORIGuard,
		func(p [][]byte) (Message, error) { return parseMORIRegistration(p) },
		func(p [][]byte) (Message, error) { return parseMORITransferInfo(p) })
}

func parseToPrefill(frames [][]byte, guard string, reg, xfer func([][]byte) (Message, error)) (Message, error) {
	if len(frames) == 0 {
		return nil, fmt.Errorf("%w: empty message", ErrMalformed)
	}
	head := frames[0]
	switch {
	case string(head) == AbortHeader:
		return parseAbort(frames)
	case string(head) == guard:
	default:
		for _, h := range stagingHeaders {
			if string(head) == h {
				return nil, fmt.Errorf("%w: %s (staging is not implemented)", ErrUnsupported, h)
			}
		}
		return nil, fmt.Errorf("%w: first frame %q is not %q (foreign traffic?)", ErrMalformed, truncate(head), guard)
	}
	payload := frames[1:]
	if len(payload) == 0 {
		return nil, fmt.Errorf("%w: guard without payload", ErrMalformed)
	}
	if bytes.Equal(payload[0], []byte("None")) {
		return reg(payload)
	}
	return xfer(payload)
}

// ParseMORIToDecode parses a message a MORI-variant decode rank receives
// on its PULL socket: *MORIStatus or *AuxData.
func ParseMORIToDecode(frames [][]byte) (Message, error) {
	if len(frames) == 0 {
		return nil, fmt.Errorf("%w: empty message", ErrMalformed)
	}
	switch string(frames[0]) {
	case AuxDataHeader:
		return parseAuxData(frames)
	case MORIGuard:
		return parseMORIStatus(frames[1:])
	}
	return nil, fmt.Errorf("%w: first frame %q is neither %q nor %q", ErrMalformed, truncate(frames[0]), MORIGuard, AuxDataHeader)
}

// infoHead is how the transfer info of both variants begins, after the
// guard: room, decode IP, decode port, the decode rank's id (NIXL: agent
// name, MORI: engine key), dst KV page indices.
type infoHead struct {
	room      uint64
	endpoint  string
	port      int
	peer      string
	kvIndices []int32
}

// frames builds guard, the head and rest; peerField names the id in errors.
func (h infoHead) frames(guard, peerField string, rest ...[]byte) ([][]byte, error) {
	if err := checkASCII(h.endpoint, "endpoint"); err != nil {
		return nil, err
	}
	if err := checkASCII(h.peer, peerField); err != nil {
		return nil, err
	}
	head := [][]byte{[]byte(guard), utoa(h.room), []byte(h.endpoint), itoaInt(h.port), []byte(h.peer), appendInts(nil, h.kvIndices)}
	return append(head, rest...), nil
}

// infoHead reads frames 0 to 4 of a transfer info.
func (r *frameReader) infoHead(peerField string) infoHead {
	return infoHead{
		room:      r.uint(0, "room"),
		endpoint:  r.ascii(1, "endpoint"),
		port:      r.port(2, "port"),
		peer:      r.ascii(3, peerField),
		kvIndices: r.int32s(4, "dst KV indices"),
	}
}
