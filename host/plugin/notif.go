package plugin

import (
	"encoding/binary"
	"fmt"
	"slices"
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

// maxSenderNames bounds the sender names an agent keeps for Notifs to hand
// out without allocating (an agent talks to a few dozen peers; past the
// bound a name is allocated per record).
const maxSenderNames = 1024

// notifState is an agent's notification receiving state: the buffer
// get_notifs fills and the args of that call, reused by every Notifs so
// that polling an empty queue allocates nothing, and the sender names seen
// so far. Guarded by Agent.notifMu.
type notifState struct {
	buf     []byte
	args    abi.GetNotifsArgs
	slot    [1]uintptr // callHeap's argument buffer
	senders map[string]string
}

// Notifs returns the notifications received since the last call, oldest
// first and grouped by sender, as the plugin delivers them (needs
// CapNotif). It drains the plugin's queue into a buffer the agent reuses,
// growing it when a record does not fit. On error it returns the
// notifications already taken from the plugin along with the error, so none
// is lost.
//
// When nothing arrived it returns nil and allocates nothing, so runtimes may
// call it in idle polling loops. Otherwise the result costs a few
// allocations whatever the number of records: the slice, one block holding
// every message of a get_notifs call (each Msg has its own capacity, so an
// append to one never reaches another), and a sender name only the first
// time a sender is seen.
func (a *Agent) Notifs() ([]Notif, error) {
	if err := a.needCaps("get_notifs", abi.CapNotif); err != nil {
		return nil, err
	}
	a.notifMu.Lock()
	defer a.notifMu.Unlock()
	st := &a.notif
	if st.buf == nil {
		st.buf = make([]byte, initialNotifBuf)
	}
	var out []Notif
	for range maxNotifRounds {
		size, count, needed, err := a.getNotifs(st)
		if err != nil {
			return out, err
		}
		if size > uintptr(len(st.buf)) {
			return out, a.hostErr("get_notifs", abi.ErrBackend, "plugin wrote %d bytes into a %d-byte buffer", size, len(st.buf))
		}
		if count > 0 || size > 0 {
			if out, err = st.decode(st.buf[:size], int(count), out); err != nil {
				return out, a.hostErr("get_notifs", abi.ErrBackend, "%v", err)
			}
		}
		if needed == 0 {
			return out, nil
		}
		if count == 0 && needed <= uintptr(len(st.buf)) {
			return out, a.hostErr("get_notifs", abi.ErrBackend, "plugin copied nothing into a %d-byte buffer but says the next record needs %d", len(st.buf), needed)
		}
		if needed > maxOutput {
			return out, a.hostErr("get_notifs", abi.ErrBackend, "plugin reports a %d-byte notification", needed)
		}
		if needed > uintptr(len(st.buf)) {
			st.buf = make([]byte, max(needed, 2*uintptr(len(st.buf))))
		}
	}
	return out, nil
}

// getNotifs calls get_notifs into st.buf with st's args. Needs notifMu.
func (a *Agent) getNotifs(st *notifState) (size, count, needed uintptr, err error) {
	if err := a.use(); err != nil {
		return 0, 0, 0, err
	}
	defer a.mu.RUnlock()
	st.args = abi.GetNotifsArgs{StructSize: abi.GetNotifsArgsSize, Agent: a.h, Buf: sliceData(st.buf), Cap: uintptr(len(st.buf))}
	err = a.check("get_notifs", callHeap(a.p.api.GetNotifs, unsafe.Pointer(&st.args), &st.slot))
	size, count, needed = st.args.Size, st.args.Count, st.args.Needed
	st.args.Buf = nil // do not keep the buffer reachable from the args
	return size, count, needed, err
}

// decode appends the records of buf to dst (see decodeNotifs), handing out
// the sender names it keeps.
func (st *notifState) decode(buf []byte, count int, dst []Notif) ([]Notif, error) {
	if st.senders == nil {
		st.senders = map[string]string{}
	}
	return decodeNotifs(buf, count, dst, st.senders)
}

// decodeNotifs appends the count records of buf (the get_notifs encoding:
// little-endian uint32 sender_len, uint32 msg_len, sender, message; no
// padding) to dst. It fails if the records do not fill buf exactly. The
// messages are copied into one new block; sender names come from senders
// (a name not there is added while the map holds fewer than
// maxSenderNames; nil: every name is allocated).
func decodeNotifs(buf []byte, count int, dst []Notif, senders map[string]string) ([]Notif, error) {
	// First pass: check the framing and size the message block.
	off, msgBytes := 0, 0
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
		off += int(sl + ml)
		msgBytes += int(ml)
	}
	if off != len(buf) {
		return dst, fmt.Errorf("%d records end at byte %d of %d written", count, off, len(buf))
	}
	block := make([]byte, msgBytes)
	dst = slices.Grow(dst, count)
	off = 0
	for i := 0; i < count; i++ {
		sl := int(binary.LittleEndian.Uint32(buf[off:]))
		ml := int(binary.LittleEndian.Uint32(buf[off+4:]))
		off += abi.NotifRecordHeader
		name := buf[off : off+sl]
		from, ok := senders[string(name)] // no allocation for the lookup
		if !ok {
			from = string(name)
			if senders != nil && len(senders) < maxSenderNames {
				senders[from] = from
			}
		}
		off += sl
		n := copy(block, buf[off:off+ml])
		msg := block[:n:n]
		block = block[n:]
		off += ml
		dst = append(dst, Notif{From: from, Msg: msg})
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
