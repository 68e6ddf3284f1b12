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
	// finished: PollRelease closed the transfer; Close is then a no-op.
	finished bool
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
	x, _, err := a.makePrepped(false, op, local, localIdx, remote, remoteIdx, notif)
	return x, err
}

// SubmitPrepped makes a prepped transfer as MakePreppedXfer does and posts
// it, and reports whether it already completed. On an agent with native
// CapSubmit that is one plugin call (submit_xfer); otherwise the host
// emulates it with make and post. All or nothing: on error no transfer
// exists. Finish it with PollRelease (or Poll/Wait and Close).
func (a *Agent) SubmitPrepped(op abi.Op, local *DList, localIdx []int32, remote *DList, remoteIdx []int32, notif []byte) (*Xfer, bool, error) {
	if !a.caps.Has(abi.CapSubmit) {
		x, _, err := a.makePrepped(false, op, local, localIdx, remote, remoteIdx, notif)
		return postNew(x, err)
	}
	return a.makePrepped(true, op, local, localIdx, remote, remoteIdx, notif)
}

// postNew posts a transfer just made (emulated submit) and closes it when
// the post fails, so that no transfer exists on error.
func postNew(x *Xfer, err error) (*Xfer, bool, error) {
	if err != nil {
		return nil, false, err
	}
	done, err := x.Post()
	if err != nil {
		return nil, false, errors.Join(err, x.Close())
	}
	return x, done, nil
}

// submitted turns the result of a make or submit into an *Xfer. With
// submit it interprets the post's status; a status that is neither done
// nor in progress releases the transfer and is an error.
func (a *Agent) submitted(h abi.Xfer, st abi.Status, err error, submit bool, op abi.Op, descs int, shaped bool) (*Xfer, bool, error) {
	if err != nil {
		return nil, false, err
	}
	x := a.newXfer(h, op, descs, shaped)
	if !submit {
		return x, false, nil
	}
	done, err := x.status("submit_xfer", st)
	if err != nil {
		rerr := a.check("release_xfer", callC(a.p.api.ReleaseXfer, unsafe.Pointer(&abi.ReleaseXferArgs{StructSize: abi.ReleaseXferArgsSize, Agent: a.h, Xfer: h})))
		return nil, false, errors.Join(err, rerr)
	}
	return x, done, nil
}

// makePrepped is MakePreppedXfer (submit false) and the native form of
// SubmitPrepped (submit true).
func (a *Agent) makePrepped(submit bool, op abi.Op, local *DList, localIdx []int32, remote *DList, remoteIdx []int32, notif []byte) (*Xfer, bool, error) {
	const opName = "make_prepped_xfer"
	switch {
	case local == nil || remote == nil || local.a != a || remote.a != a:
		return nil, false, a.hostErr(opName, abi.ErrInvalidParam, "both lists must be prepared on agent %s", a.name)
	case local.peer != "":
		return nil, false, a.hostErr(opName, abi.ErrInvalidParam, "the local list is a list of peer %s", local.peer)
	case remote.peer == "":
		return nil, false, a.hostErr(opName, abi.ErrInvalidParam, "the remote list is a local list")
	case len(localIdx) != len(remoteIdx):
		return nil, false, a.hostErr(opName, abi.ErrInvalidParam, "%d local indices but %d remote indices", len(localIdx), len(remoteIdx))
	case notif != nil && !a.caps.Has(abi.CapNotif):
		return nil, false, a.needCaps(opName, abi.CapNotif)
	}
	if err := a.use(); err != nil {
		return nil, false, err
	}
	// One defer and few returns here keep the defer open-coded (cheap); the
	// work, with its many returns, is in makePreppedLocked.
	defer a.mu.RUnlock()
	return a.makePreppedLocked(submit, op, local, localIdx, remote, remoteIdx, notif)
}

// makePreppedLocked is makePrepped past its argument checks. Needs a.mu
// held (shared).
func (a *Agent) makePreppedLocked(submit bool, op abi.Op, local *DList, localIdx []int32, remote *DList, remoteIdx []int32, notif []byte) (*Xfer, bool, error) {
	const opName = "make_prepped_xfer"
	if local.closed {
		return nil, false, closedError(local.describe())
	}
	if remote.closed {
		return nil, false, closedError(remote.describe())
	}
	if local.emu != nil || local.first != nil || remote.first != nil {
		s := a.getScratch()
		defer a.putScratch(s)
		if local.emu != nil {
			return a.makePreppedEmulated(submit, s, op, local, localIdx, remote, remoteIdx, notif)
		}
		if cerr := s.expandIndices(local.first, local.n, localIdx, remote.first, remote.n, remoteIdx); cerr != nil {
			return nil, false, a.wrap(opName, cerr)
		}
		h, st, err := a.p.makePrepped(a.h, op, local.h, s.local, remote.h, s.remote, cNotif(notif), submit)
		return a.submitted(h, st, err, submit, op, len(localIdx), true)
	}
	h, st, err := a.p.makePrepped(a.h, op, local.h, localIdx, remote.h, remoteIdx, cNotif(notif), submit)
	return a.submitted(h, st, err, submit, op, len(localIdx), false)
}

// makePreppedEmulated builds a prepped transfer over emulated lists as one
// batch transfer, in s. Needs a.mu held (shared).
func (a *Agent) makePreppedEmulated(submit bool, s *scratch, op abi.Op, local *DList, localIdx []int32, remote *DList, remoteIdx []int32, notif []byte) (*Xfer, bool, error) {
	const opName = "make_prepped_xfer"
	if cerr := s.buildPreppedBatch(local.emu, remote.emu, localIdx, remoteIdx, !a.caps.Has(abi.CapStrided)); cerr != nil {
		return nil, false, a.wrap(opName, cerr)
	}
	if len(s.pairs) == 0 && notif != nil {
		// A notification-only transfer (no indices): make_batch_xfer
		// learns the peer from a region pair, so give it one that no
		// entry uses.
		pair, err := a.notifPair(local, remote)
		if err != nil {
			return nil, false, err
		}
		s.pairs = append(s.pairs, pair)
	}
	h, st, err := a.p.makeBatch(a.h, op, s.pairs, s.entries, cNotif(notif), submit)
	return a.submitted(h, st, err, submit, op, len(localIdx), true)
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
	x, _, err := a.makeBatch(false, op, pairs, entries, notif)
	return x, err
}

// SubmitBatch makes a batch transfer as MakeBatchXfer does and posts it,
// and reports whether it already completed. On an agent with native
// CapSubmit that is one plugin call (submit_xfer; plus the list calls of
// batch emulation on an agent without CapBatch); otherwise the host
// emulates it with make and post. All or nothing: on error no transfer
// exists. Finish it with PollRelease (or Poll/Wait and Close).
func (a *Agent) SubmitBatch(op abi.Op, pairs []Pair, entries []abi.BatchEntry, notif []byte) (*Xfer, bool, error) {
	if !a.caps.Has(abi.CapSubmit) {
		x, _, err := a.makeBatch(false, op, pairs, entries, notif)
		return postNew(x, err)
	}
	return a.makeBatch(true, op, pairs, entries, notif)
}

// makeBatch is MakeBatchXfer (submit false) and the native form of
// SubmitBatch (submit true).
func (a *Agent) makeBatch(submit bool, op abi.Op, pairs []Pair, entries []abi.BatchEntry, notif []byte) (*Xfer, bool, error) {
	const opName = "make_batch_xfer"
	if notif != nil && !a.caps.Has(abi.CapNotif) {
		return nil, false, a.needCaps(opName, abi.CapNotif)
	}
	if err := a.use(); err != nil {
		return nil, false, err
	}
	defer a.mu.RUnlock()
	s := a.getScratch()
	defer a.putScratch(s)
	s.pairs = s.pairs[:0]
	for i, p := range pairs {
		if p.Local == nil || p.Remote == nil || p.Local.a != a || p.Remote.a != a {
			return nil, false, a.hostErr(opName, abi.ErrInvalidParam, "pair %d: both regions must belong to agent %s", i, a.name)
		}
		if p.Local.closed {
			return nil, false, closedError("pair " + itoa(uint32(i)) + ": local region")
		}
		if p.Remote.closed {
			return nil, false, closedError("pair " + itoa(uint32(i)) + ": remote region")
		}
		s.pairs = append(s.pairs, abi.RegionPair{Local: p.Local.h, Remote: p.Remote.h})
	}
	if !a.caps.Has(abi.CapBatch) {
		return a.batchViaPrepped(submit, s, op, pairs, entries, notif)
	}
	e, shaped := entries, false
	if !a.caps.Has(abi.CapStrided) && hasStrided(entries) {
		var cerr *codedError
		if e, cerr = s.expandEntries(entries); cerr != nil {
			return nil, false, a.wrap(opName, cerr)
		}
		shaped = true
	}
	h, st, err := a.p.makeBatch(a.h, op, s.pairs, e, cNotif(notif), submit)
	return a.submitted(h, st, err, submit, op, len(entries), shaped)
}

// batchViaPrepped emulates make_batch_xfer with two temporary lists and
// make_prepped_xfer (or, with submit, submit_xfer) over identity indices.
// Needs a.mu held (shared).
func (a *Agent) batchViaPrepped(submit bool, s *scratch, op abi.Op, pairs []Pair, entries []abi.BatchEntry, notif []byte) (*Xfer, bool, error) {
	const opName = "make_batch_xfer"
	if len(pairs) == 0 {
		return nil, false, a.hostErr(opName, abi.ErrInvalidParam, "no region pairs")
	}
	peerName := pairs[0].Remote.peer
	lsides := make([]batchSide, len(pairs))
	rsides := make([]batchSide, len(pairs))
	for i, p := range pairs {
		if p.Remote.peer != peerName {
			return nil, false, a.hostErr(opName, abi.ErrMismatch, "pair %d is a region of peer %s, pair 0 of %s: one transfer reaches one peer", i, p.Remote.peer, peerName)
		}
		lsides[i] = batchSide{addr: p.Local.desc.Addr, len: p.Local.desc.Len, dev: p.Local.desc.DevID, kind: p.Local.desc.MemKind}
		rsides[i] = batchSide{addr: p.Remote.desc.Addr, len: p.Remote.desc.Len, dev: p.Remote.desc.DevID, kind: p.Remote.desc.MemKind}
	}
	lkind, rkind, cerr := s.buildBatchDescs(lsides, rsides, entries, !a.caps.Has(abi.CapStrided))
	if cerr != nil {
		return nil, false, a.wrap(opName, cerr)
	}
	if len(entries) == 0 {
		lkind, rkind = lsides[0].kind, rsides[0].kind
	}
	ld, err := a.p.prepDList(a.h, "", lkind, s.ldescs)
	if err != nil {
		return nil, false, err
	}
	rd, err := a.p.prepDList(a.h, peerName, rkind, s.rdescs)
	if err != nil {
		return nil, false, errors.Join(err, a.p.releaseDList(a.h, ld))
	}
	idx := s.identity(len(s.ldescs))
	h, st, err := a.p.makePrepped(a.h, op, ld, idx, rd, idx, cNotif(notif), submit)
	x, done, err := a.submitted(h, st, err, submit, op, len(entries), true)
	if err != nil {
		return nil, false, errors.Join(err, a.p.releaseDList(a.h, ld), a.p.releaseDList(a.h, rd))
	}
	x.tmp = [2]abi.DList{ld, rd}
	a.book.Lock()
	x.tmpPeer = a.peerLocked(peerName)
	a.book.Unlock()
	return x, done, nil
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
	return x.pollLocked()
}

// pollLocked is Poll with x locked (x.lock).
func (x *Xfer) pollLocked() (bool, error) {
	x.poll.Status, x.poll.Flags = 0, 0
	if err := x.a.check("poll_xfer", callHeap(x.a.p.api.PollXfer, unsafe.Pointer(&x.poll), &x.slot)); err != nil {
		return false, err
	}
	return x.status("poll_xfer", x.poll.Status)
}

// PollRelease polls the transfer and, once it ended, releases it in the
// same call: on an agent with native CapSubmit a poll_xfer with
// KVP_POLL_RELEASE and KVP_POLL_TELEMETRY, so a transfer costs one plugin
// call to finish; otherwise the host emulates it with poll, telemetry and
// release. It reports done and the transfer's telemetry (zero but for
// Descs on an agent without CapTelemetry) when the transfer completed, the
// failure when it failed, and (false, zero, nil) while it is in progress.
// Once it reports done or the transfer's failure, the transfer is closed
// (its lists too, for an emulated batch transfer): Close is then a no-op
// and every other method returns ErrClosed. Should the release itself fail
// (a plugin that refuses it), the error says so and the transfer stays
// open: Close it later. It allocates nothing.
func (x *Xfer) PollRelease() (done bool, tel Telemetry, err error) {
	if err := x.lock(); err != nil {
		return false, Telemetry{}, err
	}
	defer x.unlock()
	if !x.a.caps.Has(abi.CapSubmit) {
		return x.pollReleaseEmulated()
	}
	p := &x.poll
	p.Flags = abi.PollRelease | abi.PollTelemetry
	p.Status, p.Released, p.HasTelemetry = 0, 0, 0
	err = x.a.check("poll_xfer", callHeap(x.a.p.api.PollXfer, unsafe.Pointer(p), &x.slot))
	p.Flags = 0
	if p.Released != 0 {
		x.released = true // the handle is gone; closeLocked releases the lists
	}
	if err == nil {
		if done, err = x.status("poll_xfer", p.Status); err == nil && !done {
			if p.Released != 0 { // a plugin bug: released a transfer in progress
				err = x.a.hostErr("poll_xfer", abi.ErrBackend, "plugin released a transfer in progress")
			} else {
				return false, Telemetry{}, nil
			}
		}
	}
	if done {
		tel = Telemetry{Descs: uint64(x.descs)}
		if p.HasTelemetry != 0 {
			tel = x.telemetry(p.StartUs, p.PostUs, p.XferUs, p.TotalBytes, p.DescCount)
		}
	}
	// Ended (done or failed): release what the poll did not.
	if cerr := x.closeLocked(); cerr != nil {
		if err == nil {
			return done, tel, cerr
		}
		return false, Telemetry{}, errors.Join(err, cerr)
	}
	x.finished = true
	return done, tel, err
}

// pollReleaseEmulated is PollRelease on an agent without native CapSubmit:
// poll, then telemetry (with CapTelemetry) and release once ended.
func (x *Xfer) pollReleaseEmulated() (bool, Telemetry, error) {
	done, err := x.pollLocked()
	if err == nil && !done {
		return false, Telemetry{}, nil
	}
	var tel Telemetry
	if done {
		tel = Telemetry{Descs: uint64(x.descs)}
		if x.a.caps.Has(abi.CapTelemetry) {
			if t, terr := x.telemetryLocked(); terr == nil {
				tel = t
			}
		}
	}
	if cerr := x.closeLocked(); cerr != nil {
		if err == nil {
			return done, tel, cerr
		}
		return false, Telemetry{}, errors.Join(err, cerr)
	}
	x.finished = true
	return done, tel, err
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
	return x.telemetryLocked()
}

// telemetryLocked is Telemetry with x locked.
func (x *Xfer) telemetryLocked() (Telemetry, error) {
	args := &x.tel
	args.StartUs, args.PostUs, args.XferUs, args.TotalBytes, args.DescCount = 0, 0, 0, 0, 0
	if err := x.a.check("xfer_telemetry", callHeap(x.a.p.api.XferTelemetry, unsafe.Pointer(args), &x.slot)); err != nil {
		return Telemetry{}, err
	}
	return x.telemetry(args.StartUs, args.PostUs, args.XferUs, args.TotalBytes, args.DescCount), nil
}

// telemetry converts the plugin's telemetry fields.
func (x *Xfer) telemetry(startUs, postUs, xferUs, bytes, descs uint64) Telemetry {
	t := Telemetry{
		Start: time.UnixMicro(int64(startUs)),
		Post:  time.Duration(postUs) * time.Microsecond,
		Xfer:  time.Duration(xferUs) * time.Microsecond,
		Bytes: bytes,
		Descs: descs,
	}
	if x.shaped {
		t.Descs = uint64(x.descs)
	}
	return t
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
//
// After PollRelease closed the transfer, Close is a no-op and returns nil.
func (x *Xfer) Close() error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.closed {
		if x.finished {
			return nil
		}
		return closedError("transfer")
	}
	if err := x.a.use(); err != nil {
		x.closed = true // the agent released it
		return err
	}
	defer x.a.mu.RUnlock()
	return x.closeLocked()
}

// closeLocked is Close with x.mu held and the agent in use.
func (x *Xfer) closeLocked() error {
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
