package plugin

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvhost/kvhost/abi"
)

// DList is a prepared descriptor list (kvp_dlist): descriptors checked once
// and named by index in later transfers (MakePreppedXfer). A local list
// describes memory registered on the agent, a remote list memory of a peer.
//
// On an agent without native prepped lists the list lives in Go: each
// descriptor is resolved at prep time to (region, offset) (remote ones to
// imported regions of the peer), so a transfer is one make_batch_xfer built
// without allocation. On an agent without native strides, strided
// descriptors are expanded into plain ones and indices are mapped at
// transfer time.
type DList struct {
	a      *Agent
	peer   string // "" for a local list
	kind   abi.MemKind
	n      int  // descriptors as given; transfer indices refer to these
	closed bool // guarded by a.mu

	h     abi.DList // the plugin's list; 0 when emulated
	first []int32   // native list with expanded strides: descriptor i is plugin descriptors first[i]..first[i+1]-1; nil if not expanded
	emu   *emuList  // the emulated list, or nil
}

// Len returns the number of descriptors (valid indices are 0..Len()-1).
func (d *DList) Len() int { return d.n }

// Peer returns the peer of a remote list, "" for a local one.
func (d *DList) Peer() string { return d.peer }

// Kind returns the memory kind of the list's descriptors.
func (d *DList) Kind() abi.MemKind { return d.kind }

// Emulated reports whether the host emulates the list (no native prepped
// lists on the agent).
func (d *DList) Emulated() bool { return d.emu != nil }

// Handle returns the plugin's handle of the list, 0 for an emulated one.
func (d *DList) Handle() abi.DList { return d.h }

// PrepLocal prepares a list of descriptors of memory registered on this
// agent. Every block must lie inside one registered region (else
// ErrNotFound).
func (a *Agent) PrepLocal(kind abi.MemKind, descs []abi.XferDesc) (*DList, error) {
	return a.prep("", kind, descs)
}

// PrepRemote prepares a list of descriptors of memory the loaded peer
// advertised. On an agent without native prepped lists, the host covers the
// descriptors with the peer's regions this agent imported (ImportRegion,
// ImportRange) and, if the agent has CapRemoteAddr, imports by address the
// merged ranges nothing covers; those imports belong to the list.
func (a *Agent) PrepRemote(peerName string, kind abi.MemKind, descs []abi.XferDesc) (*DList, error) {
	if peerName == "" {
		return nil, a.hostErr("prep_dlist", abi.ErrInvalidParam, "PrepRemote needs a peer name")
	}
	return a.prep(peerName, kind, descs)
}

func (a *Agent) prep(peerName string, kind abi.MemKind, descs []abi.XferDesc) (*DList, error) {
	if err := a.use(); err != nil {
		return nil, err
	}
	defer a.mu.RUnlock()
	d := &DList{a: a, peer: peerName, kind: kind, n: len(descs)}
	var err error
	switch {
	case !a.caps.Has(abi.CapPrepped) && peerName == "":
		err = a.prepEmulatedLocal(d, descs)
	case !a.caps.Has(abi.CapPrepped):
		err = a.prepEmulatedRemote(d, descs)
	default:
		err = a.prepNative(d, descs)
	}
	if err != nil {
		return nil, err
	}
	if peerName != "" {
		a.book.Lock()
		pr := a.peerLocked(peerName)
		pr.dlists = append(pr.dlists, d)
		a.book.Unlock()
	}
	return d, nil
}

func (a *Agent) prepNative(d *DList, descs []abi.XferDesc) error {
	plain := descs
	if !a.caps.Has(abi.CapStrided) {
		var cerr *codedError
		if plain, d.first, cerr = expandDescs(descs); cerr != nil {
			return a.wrap("prep_dlist", cerr)
		}
	}
	h, err := a.p.prepDList(a.h, d.peer, d.kind, plain)
	if err != nil {
		return err
	}
	d.h = h
	return nil
}

// prepEmulatedLocal resolves each descriptor to a region registered on the
// agent. Needs a.mu held (shared).
func (a *Agent) prepEmulatedLocal(d *DList, descs []abi.XferDesc) error {
	a.book.Lock()
	regions := slices.Clone(a.regions) // sorted by Addr
	a.book.Unlock()
	sorted := make([]memRange, len(regions))
	for i, r := range regions {
		sorted[i] = rangeOf(r.desc)
	}
	emu := &emuList{}
	var missing []int
	var cerr *codedError
	if emu.descs, missing, cerr = resolveDescs(descs, d.kind, sorted, make([]emuDesc, 0, len(descs))); cerr != nil {
		return a.wrap("prep_dlist", cerr)
	}
	if len(missing) > 0 {
		x := descs[missing[0]]
		return a.hostErr("prep_dlist", abi.ErrNotFound, "%d descriptors lie outside memory registered on agent %s, the first is %d (%v addr %#x len %d stride %d count %d dev %d)",
			len(missing), a.name, missing[0], d.kind, x.Addr, x.Len, x.Stride, x.Count, x.DevID)
	}
	for _, old := range compactRefs(emu.descs) {
		r := regions[old]
		emu.handles = append(emu.handles, uint64(r.h))
		emu.locals = append(emu.locals, r)
		r.users.Add(1)
	}
	d.emu = emu
	return nil
}

// prepEmulatedRemote resolves each descriptor to a remote region of the
// peer, importing what is missing. Needs a.mu held (shared).
func (a *Agent) prepEmulatedRemote(d *DList, descs []abi.XferDesc) (err error) {
	a.book.Lock()
	var existing []*RemoteRegion
	if pr := a.peers[d.peer]; pr != nil {
		for _, rr := range pr.rregions {
			if !rr.closed {
				existing = append(existing, rr)
			}
		}
	}
	a.book.Unlock()
	slices.SortFunc(existing, func(x, y *RemoteRegion) int { return cmpU64(x.desc.Addr, y.desc.Addr) })
	ranges := make([]memRange, len(existing))
	for i, r := range existing {
		ranges[i] = rangeOf(r.desc)
	}
	emu := &emuList{}
	var missing []int
	var cerr *codedError
	if emu.descs, missing, cerr = resolveDescs(descs, d.kind, ranges, make([]emuDesc, 0, len(descs))); cerr != nil {
		return a.wrap("prep_dlist", cerr)
	}
	all := existing // index space of emu.descs[].ref: existing, then imports
	if len(missing) > 0 {
		if !a.caps.Has(abi.CapRemoteAddr) {
			x := descs[missing[0]]
			return a.hostErr("prep_dlist", abi.ErrNotFound, "%d descriptors of peer %s lie outside the regions agent %s imported from it, the first is %d (addr %#x len %d dev %d); "+
				"the agent cannot import by address (no remote_addr capability): import the peer's regions with ImportRegion first",
				len(missing), d.peer, a.name, missing[0], x.Addr, x.Len, x.DevID)
		}
		defer func() {
			if err != nil {
				a.releaseOwned(emu) // best effort: the error at hand says more
				emu.unref()
			}
		}()
		imported, ierr := a.importCovering(d, descs, missing, emu)
		if ierr != nil {
			return ierr
		}
		all = append(slices.Clip(all), imported...)
		sortedNew := make([]memRange, len(imported))
		for i, r := range imported {
			sortedNew[i] = rangeOf(r.desc)
		}
		for _, i := range missing {
			x := descs[i]
			end, _ := extent(x.Addr, x.Len, x.Stride, x.Count)
			j := coverIndex(sortedNew, memRange{addr: x.Addr, end: end, dev: x.DevID, kind: d.kind})
			if j < 0 { // the plugin imported less than asked
				return a.hostErr("prep_dlist", abi.ErrBackend, "descriptor %d of peer %s is not covered by the ranges the plugin imported", i, d.peer)
			}
			emu.descs[i].ref, emu.descs[i].off = int32(len(existing)+j), x.Addr-sortedNew[j].addr
		}
	}
	for _, old := range compactRefs(emu.descs) {
		r := all[old]
		emu.handles = append(emu.handles, uint64(r.h))
		if r.owner == nil {
			emu.remotes = append(emu.remotes, r)
			r.users.Add(1)
		}
	}
	d.emu = emu
	return nil
}

// importCovering imports by address ranges covering descs[missing] and
// records them in emu.owned (sorted by address). It first tries one range
// per memory kind and device spanning all the descriptors, then, where the
// plugin refuses a range (it crosses memory the peer did not advertise as
// one region), splits it at the widest gap between descriptors and tries
// each half. KV descriptors mostly lie in a few large peer buffers, so a
// list costs a few imports, not one per descriptor.
func (a *Agent) importCovering(d *DList, descs []abi.XferDesc, missing []int, emu *emuList) ([]*RemoteRegion, error) {
	spans := make([]memRange, len(missing))
	for k, i := range missing {
		x := descs[i]
		end, _ := extent(x.Addr, x.Len, x.Stride, x.Count)
		spans[k] = memRange{addr: x.Addr, end: end, dev: x.DevID, kind: d.kind}
	}
	pieces := mergeRanges(spans, false) // sorted by kind, dev, address; disjoint
	for len(pieces) > 0 {
		n := 1
		for n < len(pieces) && pieces[n].kind == pieces[0].kind && pieces[n].dev == pieces[0].dev {
			n++
		}
		if err := a.importSpan(d, pieces[:n], emu); err != nil {
			return nil, err
		}
		pieces = pieces[n:]
	}
	slices.SortFunc(emu.owned, func(x, y *RemoteRegion) int { return cmpU64(x.desc.Addr, y.desc.Addr) })
	return emu.owned, nil
}

// importSpan imports one range covering pieces (disjoint, sorted, one kind
// and device), splitting at the widest gap while the plugin refuses.
func (a *Agent) importSpan(d *DList, pieces []memRange, emu *emuList) error {
	first, last := pieces[0], pieces[len(pieces)-1]
	rr, err := a.importLocked(d.peer, nil, abi.MemDesc{Addr: first.addr, Len: last.end - first.addr, DevID: first.dev, MemKind: first.kind})
	if err == nil {
		rr.owner = d
		emu.owned = append(emu.owned, rr)
		return nil
	}
	if len(pieces) == 1 || !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrInvalidParam) {
		return err
	}
	split, widest := 1, uint64(0)
	for i := 1; i < len(pieces); i++ {
		if gap := pieces[i].addr - pieces[i-1].end; gap > widest {
			split, widest = i, gap
		}
	}
	if err := a.importSpan(d, pieces[:split], emu); err != nil {
		return err
	}
	return a.importSpan(d, pieces[split:], emu)
}

// releaseOwned releases the remote regions an emulated list imported
// that are not released yet (a region the plugin refuses stays open, so a
// later call retries it). Needs a.mu held; the owned regions are used by no
// one else, so shared is enough.
func (a *Agent) releaseOwned(emu *emuList) error {
	var errs []error
	for _, rr := range emu.owned {
		if !rr.closed {
			errs = append(errs, a.releaseRRegionLocked(rr))
		}
	}
	return errors.Join(errs...)
}

// Close releases the list (and, for an emulated remote list, the remote
// regions imported for it). Close the transfers made from it first: a
// plugin may refuse (e.g. ErrNotAllowed while a transfer uses the list, or
// a refused release of an imported region); then Close returns the error
// and the list stays open, to be closed again later.
func (d *DList) Close() error {
	a := d.a
	if err := a.useExclusive(); err != nil {
		return err
	}
	defer a.mu.Unlock()
	if d.closed {
		return closedError(d.describe())
	}
	if d.emu != nil {
		if err := a.releaseOwned(d.emu); err != nil {
			return err
		}
		d.emu.unref()
	} else if err := a.p.releaseDList(a.h, d.h); err != nil {
		return err
	}
	d.closed = true
	if d.peer != "" {
		a.book.Lock()
		if pr := a.peers[d.peer]; pr != nil {
			pr.dlists = slices.DeleteFunc(pr.dlists, func(x *DList) bool { return x == d })
		}
		a.book.Unlock()
	}
	return nil
}

func (d *DList) describe() string {
	if d.peer == "" {
		return fmt.Sprintf("local list of %d descriptors", d.n)
	}
	return fmt.Sprintf("list of %d descriptors of peer %s", d.n, d.peer)
}

// wrap turns an emulation error into an *Error of operation op.
func (a *Agent) wrap(op string, e *codedError) error {
	return hostError(a.p.info.Name, op, e.code, "%s", e.msg)
}
