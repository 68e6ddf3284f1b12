package plugin

import (
	"encoding/binary"
	"fmt"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
)

// Notif is a notification received from a peer.
type Notif struct {
	From string // the sender's agent name
	Msg  []byte
}

// initialNotifBuf is the first size of an agent's notification buffer; it
// grows to fit the largest record seen and is kept for later calls.
const initialNotifBuf = 4 << 10

// maxNotifRounds bounds how many get_notifs calls one Notifs makes, so a peer
// that never stops sending cannot keep the caller inside.
const maxNotifRounds = 64

// Notifs returns the notifications received since the last call, oldest
// first and grouped by sender, as the plugin delivers them (needs
// CapNotif). It drains the plugin's queue into a buffer the agent reuses,
// growing it when a record does not fit. On error it returns the
// notifications already taken from the plugin along with the error, so none
// is lost.
func (a *Agent) Notifs() ([]Notif, error) {
	if err := a.needCaps("get_notifs", abi.CapNotif); err != nil {
		return nil, err
	}
	a.notifMu.Lock()
	defer a.notifMu.Unlock()
	if a.notifBuf == nil {
		a.notifBuf = make([]byte, initialNotifBuf)
	}
	var out []Notif
	for range maxNotifRounds {
		size, count, needed, err := a.getNotifs(a.notifBuf)
		if err != nil {
			return out, err
		}
		if size > uintptr(len(a.notifBuf)) {
			return out, a.hostErr("get_notifs", abi.ErrBackend, "plugin wrote %d bytes into a %d-byte buffer", size, len(a.notifBuf))
		}
		if out, err = decodeNotifs(a.notifBuf[:size], int(count), out); err != nil {
			return out, a.hostErr("get_notifs", abi.ErrBackend, "%v", err)
		}
		if needed == 0 {
			return out, nil
		}
		if count == 0 && needed <= uintptr(len(a.notifBuf)) {
			return out, a.hostErr("get_notifs", abi.ErrBackend, "plugin copied nothing into a %d-byte buffer but says the next record needs %d", len(a.notifBuf), needed)
		}
		if needed > maxOutput {
			return out, a.hostErr("get_notifs", abi.ErrBackend, "plugin reports a %d-byte notification", needed)
		}
		if needed > uintptr(len(a.notifBuf)) {
			a.notifBuf = make([]byte, max(needed, 2*uintptr(len(a.notifBuf))))
		}
	}
	return out, nil
}

func (a *Agent) getNotifs(buf []byte) (size, count, needed uintptr, err error) {
	if err := a.use(); err != nil {
		return 0, 0, 0, err
	}
	defer a.mu.RUnlock()
	args := &abi.GetNotifsArgs{StructSize: abi.GetNotifsArgsSize, Agent: a.h, Buf: sliceData(buf), Cap: uintptr(len(buf))}
	err = a.check("get_notifs", callC(a.p.api.GetNotifs, unsafe.Pointer(args)))
	return args.Size, args.Count, args.Needed, err
}

// decodeNotifs appends the count records of buf (the get_notifs encoding:
// little-endian uint32 sender_len, uint32 msg_len, sender, message; no
// padding) to dst. It fails if the records do not fill buf exactly.
func decodeNotifs(buf []byte, count int, dst []Notif) ([]Notif, error) {
	off := 0
	for i := 0; i < count; i++ {
		if len(buf)-off < abi.NotifRecordHeader {
			return dst, fmt.Errorf("notification record %d: header past the %d bytes written", i, len(buf))
		}
		sl := uint64(binary.LittleEndian.Uint32(buf[off:]))
		ml := uint64(binary.LittleEndian.Uint32(buf[off+4:]))
		off += abi.NotifRecordHeader
		if sl+ml > uint64(len(buf)-off) {
			return dst, fmt.Errorf("notification record %d: %d+%d bytes past the %d bytes written", i, sl, ml, len(buf))
		}
		from := string(buf[off : off+int(sl)])
		off += int(sl)
		msg := make([]byte, ml)
		copy(msg, buf[off:])
		off += int(ml)
		dst = append(dst, Notif{From: from, Msg: msg})
	}
	if off != len(buf) {
		return dst, fmt.Errorf("%d records end at byte %d of %d written", count, off, len(buf))
	}
	return dst, nil
}

// SendNotif sends a notification to a loaded peer, outside any transfer
// (needs CapNotif).
func (a *Agent) SendNotif(peerName string, msg []byte) error {
	if err := a.needCaps("send_notif", abi.CapNotif); err != nil {
		return err
	}
	if err := a.use(); err != nil {
		return err
	}
	defer a.mu.RUnlock()
	args := &abi.SendNotifArgs{
		StructSize: abi.SendNotifArgsSize, Agent: a.h,
		PeerName: stringData(peerName), PeerNameLen: uintptr(len(peerName)),
		Msg: sliceData(msg), MsgLen: uintptr(len(msg)),
	}
	return a.check("send_notif", callC(a.p.api.SendNotif, unsafe.Pointer(args)))
}
