package plugin

import (
	"unsafe"

	"github.com/kvhost/kvhost/abi"
)

// The plugin calls that make and release handles, each written once: Agent
// adds its checks and bookkeeping around them, Raw calls them as they are.
// agent is the plugin's handle of the calling agent; the returned errors
// are *Error.

func (p *Plugin) prepDList(agent abi.Agent, peer string, kind abi.MemKind, descs []abi.XferDesc) (abi.DList, error) {
	args := &abi.PrepDListArgs{
		StructSize: abi.PrepDListArgsSize, Agent: agent,
		PeerName: stringData(peer), PeerNameLen: uintptr(len(peer)),
		MemKind: kind, Descs: sliceData(descs), NumDescs: uintptr(len(descs)),
	}
	err := p.check("prep_dlist", callC(p.api.PrepDList, unsafe.Pointer(args)))
	return args.DList, err
}

func (p *Plugin) releaseDList(agent abi.Agent, d abi.DList) error {
	args := &abi.ReleaseDListArgs{StructSize: abi.ReleaseDListArgsSize, Agent: agent, DList: d}
	return p.check("release_dlist", callC(p.api.ReleaseDList, unsafe.Pointer(args)))
}

// makePrepped calls make_prepped_xfer, or with submit submit_xfer in its
// prepped form (ABI 1.1: make and post in one call), which also reports
// the post's status (for make_prepped_xfer it is 0).
func (p *Plugin) makePrepped(agent abi.Agent, op abi.Op, ld abi.DList, li []int32, rd abi.DList, ri []int32, n abi.Notif, submit bool) (abi.Xfer, abi.Status, error) {
	args := &abi.MakePreppedXferArgs{
		StructSize: abi.MakePreppedXferArgsSize, Agent: agent, Op: op,
		LocalDList: ld, LocalIndices: sliceData(li), NumLocalIndices: uintptr(len(li)),
		RemoteDList: rd, RemoteIndices: sliceData(ri), NumRemoteIndices: uintptr(len(ri)),
		Notif: n,
	}
	if submit {
		sub := &abi.SubmitXferArgs{StructSize: abi.SubmitXferArgsSize, Prepped: args}
		err := p.check("submit_xfer", callC(p.api.SubmitXfer, unsafe.Pointer(sub)))
		return args.Xfer, sub.Status, err
	}
	err := p.check("make_prepped_xfer", callC(p.api.MakePreppedXfer, unsafe.Pointer(args)))
	return args.Xfer, 0, err
}

// makeBatch calls make_batch_xfer, or with submit submit_xfer in its batch
// form; see makePrepped.
func (p *Plugin) makeBatch(agent abi.Agent, op abi.Op, pairs []abi.RegionPair, entries []abi.BatchEntry, n abi.Notif, submit bool) (abi.Xfer, abi.Status, error) {
	args := &abi.MakeBatchXferArgs{
		StructSize: abi.MakeBatchXferArgsSize, Agent: agent, Op: op,
		Pairs: sliceData(pairs), NumPairs: uintptr(len(pairs)),
		Entries: sliceData(entries), NumEntries: uintptr(len(entries)),
		Notif: n,
	}
	if submit {
		sub := &abi.SubmitXferArgs{StructSize: abi.SubmitXferArgsSize, Batch: args}
		err := p.check("submit_xfer", callC(p.api.SubmitXfer, unsafe.Pointer(sub)))
		return args.Xfer, sub.Status, err
	}
	err := p.check("make_batch_xfer", callC(p.api.MakeBatchXfer, unsafe.Pointer(args)))
	return args.Xfer, 0, err
}

// importRegion imports a region of peer: from blob when it is not empty,
// else the address range d. It returns the handle and the region as the
// plugin describes it.
func (p *Plugin) importRegion(agent abi.Agent, peer string, blob []byte, d abi.MemDesc) (abi.RRegion, abi.MemDesc, error) {
	args := &abi.RemoteRegionImportArgs{
		StructSize: abi.RemoteRegionImportArgsSize, Agent: agent,
		PeerName: stringData(peer), PeerNameLen: uintptr(len(peer)),
		Blob: sliceData(blob), BlobLen: uintptr(len(blob)),
		Addr: d.Addr, Len: d.Len, DevID: d.DevID, MemKind: d.MemKind,
	}
	if err := p.check("remote_region_import", callC(p.api.RemoteRegionImport, unsafe.Pointer(args))); err != nil {
		return 0, abi.MemDesc{}, err
	}
	return args.RRegion, abi.MemDesc{Addr: args.Addr, Len: args.Len, DevID: args.DevID, MemKind: args.MemKind}, nil
}

func (p *Plugin) releaseRRegion(agent abi.Agent, rr abi.RRegion) error {
	args := &abi.RemoteRegionReleaseArgs{StructSize: abi.RemoteRegionReleaseArgsSize, Agent: agent, RRegion: rr}
	return p.check("remote_region_release", callC(p.api.RemoteRegionRelease, unsafe.Pointer(args)))
}
