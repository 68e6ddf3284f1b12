package plugin

import (
	"context"
	"errors"
	"sync"
	"time"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
)

// Xfer is a transfer request (kvp_xfer): made once, posted one or more times
// (a completed transfer may be posted again), polled, and closed. Its
// methods are safe for concurrent use; the host serialises them, as the
// header requires for one transfer handle.
type Xfer struct {
	a      *Agent
	op     abi.Op
	descs  int  // descriptors or entries as the caller gave them
	shaped bool // the host reshaped the descriptors (emulation, expansion)

	mu     sync.Mutex
	h      abi.Xfer
	closed bool
	// released: release_xfer succeeded but a list of tmp did not release
	// yet; the transfer is unusable and Close retries the lists.
	released bool
	tmp      [2]abi.DList // lists made by batch emulation, released with the transfer; 0 once released
	// tmpPeer is the peer of tmp[1]. RemoveRemote leaves tmp[1] a dead
	// handle that Close still releases; a plugin that released it with the
	// peer answers ErrInvalidParam, which Close then ignores.
	tmpPeer *peer

	// Args of the hot calls, kept in the (heap) Xfer so that posting,
	// polling and reading telemetry allocate nothing; guarded by mu.
	post abi.PostXferArgs
	poll abi.PollXferArgs
	tel  abi.XferTelemetryArgs
	rel  abi.ReleaseXferArgs
	slot [1]uintptr // callHeap's argument buffer, guarded by mu
}

// Pair is a (local region, remote region) pair of a batch transfer; batch
// entries name pairs by index. All remote regions of one transfer belong to
// one peer.
type Pair struct {
	Local  *Region
	Remote *RemoteRegion
}

// Telemetry of the last completed post of a transfer (kvp_xfer_telemetry).
type Telemetry struct {
	Start time.Time     // when the transfer was posted
	Post  time.Duration // time spent inside post_xfer (µs resolution)
	Xfer  time.Duration // post to completion (µs resolution)
	Bytes uint64        // bytes moved
	// Descs is the number of descriptors (prepped) or entries (batch) as
	// the caller gave them, strided ones counting once, also when the host
	// reshaped them for the plugin.
	Descs uint64
}

// cNotif builds the optional notification of a transfer: nil means none,
// an empty non-nil slice an empty notification.
func cNotif(msg []byte) abi.Notif {
	if msg == nil {
		return abi.Notif{}
	}
	return abi.Notif{Msg: sliceData(msg), MsgLen: uintptr(len(msg)), HasNotif: 1}
}

func (a *Agent) getScratch() *scratch  { return a.scratch.Get().(*scratch) }
func (a *Agent) putScratch(s *scratch) { a.scratch.Put(s) }

func (a *Agent) newXfer(h abi.Xfer, op abi.Op, descs int, shaped bool) *Xfer {
	x := &Xfer{a: a, op: op, h: h, descs: descs, shaped: shaped}
	x.post = abi.PostXferArgs{StructSize: abi.PostXferArgsSize, Agent: a.h, Xfer: h}
	x.poll = abi.PollXferArgs{StructSize: abi.PollXferArgsSize, Agent: a.h, Xfer: h}
	x.tel = abi.XferTelemetryArgs{StructSize: abi.XferTelemetryArgsSize, Agent: a.h, Xfer: h}
	x.rel = abi.ReleaseXferArgs{StructSize: abi.ReleaseXferArgsSize, Agent: a.h, Xfer: h}
	return x
}

// MakePreppedXfer builds a transfer that moves local descriptor localIdx[k]
// to or from remote descriptor remoteIdx[k] (op Write: local to remote; Read:
// remote to local). notif, when not nil, is delivered to the peer after every
// byte landed (an empty non-nil slice sends an empty notification; needs
// CapNotif); with no indices the transfer moves nothing and only delivers
// its notification. The index slices are passed to the plugin as they are, or, on
// an agent without native prepped lists, become one batch transfer built in
// reused buffers. Index out of range is ErrInvalidParam, paired descriptors
// of different length or count ErrMismatch. The transfer is not started:
// call Post.
func (a *Agent) MakePreppedXfer(op abi.Op, local *DList, localIdx []int32, remote *DList, remoteIdx []int32, notif []byte) (*Xfer, error) {
	const opName = "make_prepped_xfer"
	switch {
	case local == nil || remote == nil || local.a != a || remote.a != a:
		return nil, a.hostErr(opName, abi.ErrInvalidParam, "both lists must be prepared on agent %s", a.name)
	case local.peer != "":
		return nil, a.hostErr(opName, abi.ErrInvalidParam, "the local list is a list of peer %s", local.peer)
	case remote.peer == "":
		return nil, a.hostErr(opName, abi.ErrInvalidParam, "the remote list is a local list")
	case len(localIdx) != len(remoteIdx):
		return nil, a.hostErr(opName, abi.ErrInvalidParam, "%d local indices but %d remote indices", len(localIdx), len(remoteIdx))
	case notif != nil && !a.caps.Has(abi.CapNotif):
		return nil, a.needCaps(opName, abi.CapNotif)
	}
	if err := a.use(); err != nil {
		return nil, err
	}
	// One defer and few returns here keep the defer open-coded (cheap); the
	// work, with its many returns, is in makePreppedLocked.
	defer a.mu.RUnlock()
	return a.makePreppedLocked(op, local, localIdx, remote, remoteIdx, notif)
}

// makePreppedLocked is MakePreppedXfer past its argument checks. Needs a.mu
// held (shared).
func (a *Agent) makePreppedLocked(op abi.Op, local *DList, localIdx []int32, remote *DList, remoteIdx []int32, notif []byte) (*Xfer, error) {
	const opName = "make_prepped_xfer"
	if local.closed {
		return nil, closedError(local.describe())
	}
	if remote.closed {
		return nil, closedError(remote.describe())
	}
	if local.emu != nil || local.first != nil || remote.first != nil {
		s := a.getScratch()
		defer a.putScratch(s)
		if local.emu != nil {
			return a.makePreppedEmulated(s, op, local, localIdx, remote, remoteIdx, notif)
		}
		if cerr := s.expandIndices(local.first, local.n, localIdx, remote.first, remote.n, remoteIdx); cerr != nil {
			return nil, a.wrap(opName, cerr)
		}
		h, err := a.p.makePrepped(a.h, op, local.h, s.local, remote.h, s.remote, cNotif(notif))
		if err != nil {
			return nil, err
		}
		return a.newXfer(h, op, len(localIdx), true), nil
	}
	h, err := a.p.makePrepped(a.h, op, local.h, localIdx, remote.h, remoteIdx, cNotif(notif))
	if err != nil {
		return nil, err
	}
	return a.newXfer(h, op, len(localIdx), false), nil
}

// makePreppedEmulated builds a prepped transfer over emulated lists as one
// batch transfer, in s. Needs a.mu held (shared).
func (a *Agent) makePreppedEmulated(s *scratch, op abi.Op, local *DList, localIdx []int32, remote *DList, remoteIdx []int32, notif []byte) (*Xfer, error) {
	const opName = "make_prepped_xfer"
	if cerr := s.buildPreppedBatch(local.emu, remote.emu, localIdx, remoteIdx, !a.caps.Has(abi.CapStrided)); cerr != nil {
		return nil, a.wrap(opName, cerr)
	}
	if len(s.pairs) == 0 && notif != nil {
		// A notification-only transfer (no indices): make_batch_xfer
		// learns the peer from a region pair, so give it one that no
		// entry uses.
		pair, err := a.notifPair(local, remote)
		if err != nil {
			return nil, err
		}
		s.pairs = append(s.pairs, pair)
	}
	h, err := a.p.makeBatch(a.h, op, s.pairs, s.entries, cNotif(notif))
	if err != nil {
		return nil, err
	}
	return a.newXfer(h, op, len(localIdx), true), nil
}

// notifPair returns a region pair that names the peer of an emulated
// remote list, for a notification-only transfer over emulated lists: a
// region of the local list (or any region of the agent) and one of the
// remote list. Needs a.mu held (shared).
func (a *Agent) notifPair(local, remote *DList) (abi.RegionPair, error) {
	const opName = "make_prepped_xfer"
	var lh uint64
	if len(local.emu.handles) > 0 {
		lh = local.emu.handles[0]
	} else {
		a.book.Lock()
		if len(a.regions) > 0 {
			lh = uint64(a.regions[0].h)
		}
		a.book.Unlock()
	}
	if lh == 0 || len(remote.emu.handles) == 0 {
		return abi.RegionPair{}, a.hostErr(opName, abi.ErrNotSupported,
			"a notification-only transfer over emulated lists needs a registered local region and a non-empty remote list of peer %s", remote.peer)
	}
	return abi.RegionPair{Local: abi.Region(lh), Remote: abi.RRegion(remote.emu.handles[0])}, nil
}

// MakeBatchXfer builds one transfer out of many region-relative copies
// (MORI-IO BatchWrite/BatchRead): entries[k] moves its blocks between the
// regions of pairs[entries[k].Pair]. Entries go to the plugin as they are on
// an agent with native batch and strides. Without native strides they are
// expanded into reused buffers. Without native batch the host builds a
// local and a remote list and a prepped transfer over them: 3 plugin calls
// to make the transfer and 2 more to release the lists with it. The
// transfer is not started: call Post.
func (a *Agent) MakeBatchXfer(op abi.Op, pairs []Pair, entries []abi.BatchEntry, notif []byte) (*Xfer, error) {
	const opName = "make_batch_xfer"
	if notif != nil && !a.caps.Has(abi.CapNotif) {
		return nil, a.needCaps(opName, abi.CapNotif)
	}
	if err := a.use(); err != nil {
		return nil, err
	}
	defer a.mu.RUnlock()
	s := a.getScratch()
	defer a.putScratch(s)
	s.pairs = s.pairs[:0]
	for i, p := range pairs {
		if p.Local == nil || p.Remote == nil || p.Local.a != a || p.Remote.a != a {
			return nil, a.hostErr(opName, abi.ErrInvalidParam, "pair %d: both regions must belong to agent %s", i, a.name)
		}
		if p.Local.closed {
			return nil, closedError("pair " + itoa(uint32(i)) + ": local region")
		}
		if p.Remote.closed {
			return nil, closedError("pair " + itoa(uint32(i)) + ": remote region")
		}
		s.pairs = append(s.pairs, abi.RegionPair{Local: p.Local.h, Remote: p.Remote.h})
	}
	if !a.caps.Has(abi.CapBatch) {
		return a.batchViaPrepped(s, op, pairs, entries, notif)
	}
	e, shaped := entries, false
	if !a.caps.Has(abi.CapStrided) && hasStrided(entries) {
		var cerr *codedError
		if e, cerr = s.expandEntries(entries); cerr != nil {
			return nil, a.wrap(opName, cerr)
		}
		shaped = true
	}
	h, err := a.p.makeBatch(a.h, op, s.pairs, e, cNotif(notif))
	if err != nil {
		return nil, err
	}
	return a.newXfer(h, op, len(entries), shaped), nil
}

// batchViaPrepped emulates make_batch_xfer with two temporary lists and
// make_prepped_xfer over identity indices. Needs a.mu held (shared).
func (a *Agent) batchViaPrepped(s *scratch, op abi.Op, pairs []Pair, entries []abi.BatchEntry, notif []byte) (*Xfer, error) {
	const opName = "make_batch_xfer"
	if len(pairs) == 0 {
		return nil, a.hostErr(opName, abi.ErrInvalidParam, "no region pairs")
	}
	peerName := pairs[0].Remote.peer
	lsides := make([]batchSide, len(pairs))
	rsides := make([]batchSide, len(pairs))
	for i, p := range pairs {
		if p.Remote.peer != peerName {
			return nil, a.hostErr(opName, abi.ErrMismatch, "pair %d is a region of peer %s, pair 0 of %s: one transfer reaches one peer", i, p.Remote.peer, peerName)
		}
		lsides[i] = batchSide{addr: p.Local.desc.Addr, len: p.Local.desc.Len, dev: p.Local.desc.DevID, kind: p.Local.desc.MemKind}
		rsides[i] = batchSide{addr: p.Remote.desc.Addr, len: p.Remote.desc.Len, dev: p.Remote.desc.DevID, kind: p.Remote.desc.MemKind}
	}
	lkind, rkind, cerr := s.buildBatchDescs(lsides, rsides, entries, !a.caps.Has(abi.CapStrided))
	if cerr != nil {
		return nil, a.wrap(opName, cerr)
	}
	if len(entries) == 0 {
		lkind, rkind = lsides[0].kind, rsides[0].kind
	}
	ld, err := a.p.prepDList(a.h, "", lkind, s.ldescs)
	if err != nil {
		return nil, err
	}
	rd, err := a.p.prepDList(a.h, peerName, rkind, s.rdescs)
	if err != nil {
		return nil, errors.Join(err, a.p.releaseDList(a.h, ld))
	}
	idx := s.identity(len(s.ldescs))
	h, err := a.p.makePrepped(a.h, op, ld, idx, rd, idx, cNotif(notif))
	if err != nil {
		return nil, errors.Join(err, a.p.releaseDList(a.h, ld), a.p.releaseDList(a.h, rd))
	}
	x := a.newXfer(h, op, len(entries), true)
	x.tmp = [2]abi.DList{ld, rd}
	a.book.Lock()
	x.tmpPeer = a.peerLocked(peerName)
	a.book.Unlock()
	return x, nil
}

// Op returns the transfer's operation.
func (x *Xfer) Op() abi.Op { return x.op }

// Descs returns the number of descriptors (prepped) or entries (batch) the
// caller gave.
func (x *Xfer) Descs() int { return x.descs }

// Handle returns the plugin's handle of the transfer.
func (x *Xfer) Handle() abi.Xfer { return x.h }

// Agent returns the agent that made the transfer.
func (x *Xfer) Agent() *Agent { return x.a }

// lock takes the transfer and its agent for one call. On success the caller
// must call x.unlock.
func (x *Xfer) lock() error {
	x.mu.Lock()
	if x.closed || x.released {
		x.mu.Unlock()
		return closedError("transfer")
	}
	if err := x.a.use(); err != nil {
		x.closed = true // the agent released it
		x.mu.Unlock()
		return err
	}
	return nil
}

func (x *Xfer) unlock() {
	x.a.mu.RUnlock()
	x.mu.Unlock()
}

// status interprets the status out-field of post and poll.
func (x *Xfer) status(op string, s abi.Status) (bool, error) {
	switch s {
	case abi.Success:
		return true, nil
	case abi.InProg:
		return false, nil
	}
	return false, x.a.hostErr(op, abi.ErrBackend, "plugin returned no error but status %v", s)
}

// Post starts the transfer and reports whether it already completed. A
// completed transfer may be posted again; posting one in progress is
// ErrRepostActive.
func (x *Xfer) Post() (done bool, err error) {
	if err := x.lock(); err != nil {
		return false, err
	}
	defer x.unlock()
	x.post.Status = 0
	if err := x.a.check("post_xfer", callHeap(x.a.p.api.PostXfer, unsafe.Pointer(&x.post), &x.slot)); err != nil {
		return false, err
	}
	return x.status("post_xfer", x.post.Status)
}

// Poll reports whether the transfer completed, without waiting for it. As
// kvplugin.h allows, a poll may drive the transfer in the calling goroutine
// (the fake plugin copies one slice of up to 16 MiB there per poll); each
// plugin documents its bound. A failed transfer returns the failure (every poll after it the
// same); a cancelled one ErrCanceled; one never posted ErrNotPosted.
func (x *Xfer) Poll() (done bool, err error) {
	if err := x.lock(); err != nil {
		return false, err
	}
	defer x.unlock()
	x.poll.Status = 0
	if err := x.a.check("poll_xfer", callHeap(x.a.p.api.PollXfer, unsafe.Pointer(&x.poll), &x.slot)); err != nil {
		return false, err
	}
	return x.status("poll_xfer", x.poll.Status)
}

// Backoff of Wait: poll back to back for spinFor, so that short transfers
// are not delayed by timer granularity, then sleep from minSleep, doubling
// up to maxSleep. The spin does not yield (runtime.Gosched): a yielding
// goroutine may resume on another thread and core, and a poll that then
// moves bytes (kvplugin.h lets a poll drive the transfer; the fake plugin
// copies a slice of up to 16 MiB there) copies through cold caches:
// measured with kvhost bench --wait, 1 MiB same-process, 0.66-0.79x of
// memcpy with the yield, 0.88-0.93x without. A poll that itself took
// spinFor or longer drove the transfer: the next poll follows at once, as
// sleeping then would only leave the rest of the transfer waiting.
const (
	spinFor  = 50 * time.Microsecond
	minSleep = 20 * time.Microsecond
	maxSleep = time.Millisecond
)

// Wait waits until the transfer completes or fails, or ctx ends (then it
// returns ctx.Err() and the transfer keeps running: Close cancels it). It
// polls in the calling goroutine for spinFor, then leaves the transfer to
// the agent's completion engine (Agent.Engine), which wakes it.
func (x *Xfer) Wait(ctx context.Context) error {
	return x.a.Engine().wait(ctx, x)
}

// Telemetry returns the telemetry of the last completed post (needs
// CapTelemetry; ErrNoTelemetry before completion). It allocates nothing.
func (x *Xfer) Telemetry() (Telemetry, error) {
	if err := x.a.needCaps("xfer_telemetry", abi.CapTelemetry); err != nil {
		return Telemetry{}, err
	}
	if err := x.lock(); err != nil {
		return Telemetry{}, err
	}
	defer x.unlock()
	args := &x.tel
	args.StartUs, args.PostUs, args.XferUs, args.TotalBytes, args.DescCount = 0, 0, 0, 0, 0
	if err := x.a.check("xfer_telemetry", callHeap(x.a.p.api.XferTelemetry, unsafe.Pointer(args), &x.slot)); err != nil {
		return Telemetry{}, err
	}
	t := Telemetry{
		Start: time.UnixMicro(int64(args.StartUs)),
		Post:  time.Duration(args.PostUs) * time.Microsecond,
		Xfer:  time.Duration(args.XferUs) * time.Microsecond,
		Bytes: args.TotalBytes,
		Descs: args.DescCount,
	}
	if x.shaped {
		t.Descs = uint64(x.descs)
	}
	return t, nil
}

// Close releases the transfer, cancelling it if active; on return the
// plugin no longer touches its memory. Lists the host made for it are
// released too.
//
// A plugin may refuse: MORI-IO and NIXL cannot cancel posted work and keep
// a transfer still in flight after their release timeout (ErrBackend,
// ErrRepostActive). Then Close returns that error and the transfer stays
// open and usable (Poll it, Close it again later). Only ErrInvalidParam
// (the plugin no longer knows the handle) closes it with the error. A list
// of an emulated batch transfer that the plugin refuses to release keeps
// the transfer closed to every use but Close, which releases the rest.
func (x *Xfer) Close() error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.closed {
		return closedError("transfer")
	}
	if err := x.a.use(); err != nil {
		x.closed = true // the agent released it
		return err
	}
	defer x.a.mu.RUnlock()
	var errs [3]error // release_xfer, then the lists; allocated only when joined
	if !x.released {
		err := x.a.check("release_xfer", callHeap(x.a.p.api.ReleaseXfer, unsafe.Pointer(&x.rel), &x.slot))
		if err != nil && !errors.Is(err, ErrInvalidParam) {
			return err // the plugin kept the transfer: it stays open
		}
		errs[0] = err
		x.released = true
	}
	for i, d := range x.tmp {
		if d == 0 {
			continue
		}
		err := x.a.p.releaseDList(x.a.h, d)
		// RemoveRemote leaves tmp[1] a dead handle that is still released;
		// a plugin that released it with the peer answers ErrInvalidParam.
		if i == 1 && x.tmpPeer.removed && errors.Is(err, ErrInvalidParam) {
			err = nil
		}
		if err == nil || errors.Is(err, ErrInvalidParam) {
			x.tmp[i] = 0 // released, or unknown to the plugin: nothing to retry
		}
		errs[1+i] = err
	}
	x.closed = x.tmp == [2]abi.DList{}
	if errs[0] == nil && errs[1] == nil && errs[2] == nil {
		return nil
	}
	return errors.Join(errs[:]...)
}
