package plugin

import (
	"unsafe"

	"github.com/kvhost/kvhost/abi"
)

// Raw calls plugin functions with handles exactly as given, bypassing every
// check and all bookkeeping of the host: stale, released or foreign handles
// reach the plugin. It exists so the conformance suite can prove that a
// plugin answers such handles with an error rather than a crash; programs
// use Agent and its types instead. Using Raw on a handle that an Agent still
// owns breaks that Agent's bookkeeping.
type Raw struct{ p *Plugin }

// Raw returns the unchecked interface of the plugin.
func (p *Plugin) Raw() Raw { return Raw{p} }

// AgentDestroy calls agent_destroy.
func (r Raw) AgentDestroy(agent abi.Agent) error {
	args := &abi.AgentDestroyArgs{StructSize: abi.AgentDestroyArgsSize, Agent: agent}
	return r.p.check("agent_destroy", callC(r.p.api.AgentDestroy, unsafe.Pointer(args)))
}

// DeregisterMem calls deregister_mem.
func (r Raw) DeregisterMem(agent abi.Agent, regions ...abi.Region) error {
	args := &abi.DeregisterMemArgs{StructSize: abi.DeregisterMemArgsSize, Agent: agent, Regions: sliceData(regions), NumRegions: uintptr(len(regions))}
	return r.p.check("deregister_mem", callC(r.p.api.DeregisterMem, unsafe.Pointer(args)))
}

// RegionExport calls region_export with a zero-capacity buffer and returns
// the size the blob needs.
func (r Raw) RegionExport(agent abi.Agent, region abi.Region) (uintptr, error) {
	if r.p.api.RegionExport == 0 {
		return 0, hostError(r.p.info.Name, "region_export", abi.ErrNotSupported, "plugin has no region_export")
	}
	args := &abi.RegionExportArgs{StructSize: abi.RegionExportArgsSize, Agent: agent, Region: region}
	err := r.p.check("region_export", callC(r.p.api.RegionExport, unsafe.Pointer(args)))
	return args.Size, err
}

// RemoteRegionRelease calls remote_region_release.
func (r Raw) RemoteRegionRelease(agent abi.Agent, rr abi.RRegion) error {
	if r.p.api.RemoteRegionRelease == 0 {
		return hostError(r.p.info.Name, "remote_region_release", abi.ErrNotSupported, "plugin has no remote_region_release")
	}
	args := &abi.RemoteRegionReleaseArgs{StructSize: abi.RemoteRegionReleaseArgsSize, Agent: agent, RRegion: rr}
	return r.p.check("remote_region_release", callC(r.p.api.RemoteRegionRelease, unsafe.Pointer(args)))
}

// ReleaseDList calls release_dlist.
func (r Raw) ReleaseDList(agent abi.Agent, d abi.DList) error {
	if r.p.api.ReleaseDList == 0 {
		return hostError(r.p.info.Name, "release_dlist", abi.ErrNotSupported, "plugin has no release_dlist")
	}
	args := &abi.ReleaseDListArgs{StructSize: abi.ReleaseDListArgsSize, Agent: agent, DList: d}
	return r.p.check("release_dlist", callC(r.p.api.ReleaseDList, unsafe.Pointer(args)))
}

// PostXfer calls post_xfer.
func (r Raw) PostXfer(agent abi.Agent, x abi.Xfer) (abi.Status, error) {
	args := &abi.PostXferArgs{StructSize: abi.PostXferArgsSize, Agent: agent, Xfer: x}
	err := r.p.check("post_xfer", callC(r.p.api.PostXfer, unsafe.Pointer(args)))
	return args.Status, err
}

// PollXfer calls poll_xfer.
func (r Raw) PollXfer(agent abi.Agent, x abi.Xfer) (abi.Status, error) {
	args := &abi.PollXferArgs{StructSize: abi.PollXferArgsSize, Agent: agent, Xfer: x}
	err := r.p.check("poll_xfer", callC(r.p.api.PollXfer, unsafe.Pointer(args)))
	return args.Status, err
}

// ReleaseXfer calls release_xfer.
func (r Raw) ReleaseXfer(agent abi.Agent, x abi.Xfer) error {
	args := &abi.ReleaseXferArgs{StructSize: abi.ReleaseXferArgsSize, Agent: agent, Xfer: x}
	return r.p.check("release_xfer", callC(r.p.api.ReleaseXfer, unsafe.Pointer(args)))
}

// XferTelemetry calls xfer_telemetry and discards the result.
func (r Raw) XferTelemetry(agent abi.Agent, x abi.Xfer) error {
	if r.p.api.XferTelemetry == 0 {
		return hostError(r.p.info.Name, "xfer_telemetry", abi.ErrNotSupported, "plugin has no xfer_telemetry")
	}
	args := &abi.XferTelemetryArgs{StructSize: abi.XferTelemetryArgsSize, Agent: agent, Xfer: x}
	return r.p.check("xfer_telemetry", callC(r.p.api.XferTelemetry, unsafe.Pointer(args)))
}

// MakeBatchXfer calls make_batch_xfer with raw pairs.
func (r Raw) MakeBatchXfer(agent abi.Agent, op abi.Op, pairs []abi.RegionPair, entries []abi.BatchEntry) (abi.Xfer, error) {
	if r.p.api.MakeBatchXfer == 0 {
		return 0, hostError(r.p.info.Name, "make_batch_xfer", abi.ErrNotSupported, "plugin has no make_batch_xfer")
	}
	args := &abi.MakeBatchXferArgs{
		StructSize: abi.MakeBatchXferArgsSize, Agent: agent, Op: op,
		Pairs: sliceData(pairs), NumPairs: uintptr(len(pairs)),
		Entries: sliceData(entries), NumEntries: uintptr(len(entries)),
	}
	err := r.p.check("make_batch_xfer", callC(r.p.api.MakeBatchXfer, unsafe.Pointer(args)))
	return args.Xfer, err
}

// MakePreppedXfer calls make_prepped_xfer with raw lists and indices.
func (r Raw) MakePreppedXfer(agent abi.Agent, op abi.Op, local abi.DList, li []int32, remote abi.DList, ri []int32) (abi.Xfer, error) {
	if r.p.api.MakePreppedXfer == 0 {
		return 0, hostError(r.p.info.Name, "make_prepped_xfer", abi.ErrNotSupported, "plugin has no make_prepped_xfer")
	}
	args := &abi.MakePreppedXferArgs{
		StructSize: abi.MakePreppedXferArgsSize, Agent: agent, Op: op,
		LocalDList: local, LocalIndices: sliceData(li), NumLocalIndices: uintptr(len(li)),
		RemoteDList: remote, RemoteIndices: sliceData(ri), NumRemoteIndices: uintptr(len(ri)),
	}
	err := r.p.check("make_prepped_xfer", callC(r.p.api.MakePreppedXfer, unsafe.Pointer(args)))
	return args.Xfer, err
}

// RemoteRegionImport calls remote_region_import: by blob when blob is not
// empty, else by the address range in d. The handle is the caller's to
// release with RemoteRegionRelease.
func (r Raw) RemoteRegionImport(agent abi.Agent, peer string, blob []byte, d abi.MemDesc) (abi.RRegion, error) {
	if r.p.api.RemoteRegionImport == 0 {
		return 0, hostError(r.p.info.Name, "remote_region_import", abi.ErrNotSupported, "plugin has no remote_region_import")
	}
	args := &abi.RemoteRegionImportArgs{
		StructSize: abi.RemoteRegionImportArgsSize, Agent: agent,
		PeerName: stringData(peer), PeerNameLen: uintptr(len(peer)),
		Blob: sliceData(blob), BlobLen: uintptr(len(blob)),
		Addr: d.Addr, Len: d.Len, DevID: d.DevID, MemKind: d.MemKind,
	}
	err := r.p.check("remote_region_import", callC(r.p.api.RemoteRegionImport, unsafe.Pointer(args)))
	return args.RRegion, err
}

// PrepDList calls prep_dlist (peer "" prepares a local list). The handle is
// the caller's to release with ReleaseDList.
func (r Raw) PrepDList(agent abi.Agent, peer string, kind abi.MemKind, descs []abi.XferDesc) (abi.DList, error) {
	if r.p.api.PrepDList == 0 {
		return 0, hostError(r.p.info.Name, "prep_dlist", abi.ErrNotSupported, "plugin has no prep_dlist")
	}
	args := &abi.PrepDListArgs{
		StructSize: abi.PrepDListArgsSize, Agent: agent,
		PeerName: stringData(peer), PeerNameLen: uintptr(len(peer)),
		MemKind: kind, Descs: sliceData(descs), NumDescs: uintptr(len(descs)),
	}
	err := r.p.check("prep_dlist", callC(r.p.api.PrepDList, unsafe.Pointer(args)))
	return args.DList, err
}
