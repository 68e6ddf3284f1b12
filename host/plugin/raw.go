package plugin

import (
	"errors"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
)

// Raw calls plugin functions with handles exactly as given, bypassing every
// check and all bookkeeping of the host: stale, released or foreign handles
// reach the plugin. It exists so the conformance suite can prove that a
// plugin answers such handles with an error rather than a crash; programs
// use Agent and its types instead. Using Raw on a handle that an Agent still
// owns breaks that Agent's bookkeeping. A function the plugin's table
// leaves NULL (its capability is off) is ErrNotSupported, raised by the
// host.
type Raw struct{ p *Plugin }

// Raw returns the unchecked interface of the plugin.
func (p *Plugin) Raw() Raw { return Raw{p} }

// absent reports a NULL table function as an ErrNotSupported *Error.
func (r Raw) absent(fn uintptr, op string) error {
	if fn != 0 {
		return nil
	}
	return hostError(r.p.info.Name, op, abi.ErrNotSupported, "plugin has no %s", op)
}

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
	if err := r.absent(r.p.api.RegionExport, "region_export"); err != nil {
		return 0, err
	}
	args := &abi.RegionExportArgs{StructSize: abi.RegionExportArgsSize, Agent: agent, Region: region}
	err := r.p.check("region_export", callC(r.p.api.RegionExport, unsafe.Pointer(args)))
	return args.Size, err
}

// RemoteRegionImport calls remote_region_import: by blob when blob is not
// empty, else by the address range in d. The handle is the caller's to
// release with RemoteRegionRelease.
func (r Raw) RemoteRegionImport(agent abi.Agent, peer string, blob []byte, d abi.MemDesc) (abi.RRegion, error) {
	if err := r.absent(r.p.api.RemoteRegionImport, "remote_region_import"); err != nil {
		return 0, err
	}
	h, _, err := r.p.importRegion(agent, peer, blob, d)
	return h, err
}

// RemoteRegionRelease calls remote_region_release.
func (r Raw) RemoteRegionRelease(agent abi.Agent, rr abi.RRegion) error {
	if err := r.absent(r.p.api.RemoteRegionRelease, "remote_region_release"); err != nil {
		return err
	}
	return r.p.releaseRRegion(agent, rr)
}

// PrepDList calls prep_dlist (peer "" prepares a local list). The handle is
// the caller's to release with ReleaseDList.
func (r Raw) PrepDList(agent abi.Agent, peer string, kind abi.MemKind, descs []abi.XferDesc) (abi.DList, error) {
	if err := r.absent(r.p.api.PrepDList, "prep_dlist"); err != nil {
		return 0, err
	}
	return r.p.prepDList(agent, peer, kind, descs)
}

// ReleaseDList calls release_dlist.
func (r Raw) ReleaseDList(agent abi.Agent, d abi.DList) error {
	if err := r.absent(r.p.api.ReleaseDList, "release_dlist"); err != nil {
		return err
	}
	return r.p.releaseDList(agent, d)
}

// MakeBatchXfer calls make_batch_xfer with raw pairs, without a
// notification.
func (r Raw) MakeBatchXfer(agent abi.Agent, op abi.Op, pairs []abi.RegionPair, entries []abi.BatchEntry) (abi.Xfer, error) {
	if err := r.absent(r.p.api.MakeBatchXfer, "make_batch_xfer"); err != nil {
		return 0, err
	}
	h, _, err := r.p.makeBatch(agent, op, pairs, entries, abi.Notif{}, false)
	return h, err
}

// MakePreppedXfer calls make_prepped_xfer with raw lists and indices,
// without a notification.
func (r Raw) MakePreppedXfer(agent abi.Agent, op abi.Op, local abi.DList, li []int32, remote abi.DList, ri []int32) (abi.Xfer, error) {
	if err := r.absent(r.p.api.MakePreppedXfer, "make_prepped_xfer"); err != nil {
		return 0, err
	}
	h, _, err := r.p.makePrepped(agent, op, local, li, remote, ri, abi.Notif{}, false)
	return h, err
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
	if err := r.absent(r.p.api.XferTelemetry, "xfer_telemetry"); err != nil {
		return err
	}
	args := &abi.XferTelemetryArgs{StructSize: abi.XferTelemetryArgsSize, Agent: agent, Xfer: x}
	return r.p.check("xfer_telemetry", callC(r.p.api.XferTelemetry, unsafe.Pointer(args)))
}

// PollRelease calls poll_xfer with KVP_POLL_RELEASE and KVP_POLL_TELEMETRY
// (ABI 1.1) and reports the status and whether the plugin released the
// transfer (the released out field, which a plugin writes even when it
// returns an error).
func (r Raw) PollRelease(agent abi.Agent, x abi.Xfer) (abi.Status, bool, error) {
	args := &abi.PollXferArgs{StructSize: abi.PollXferArgsSize, Agent: agent, Xfer: x,
		Flags: abi.PollRelease | abi.PollTelemetry, Released: 77}
	err := r.p.check("poll_xfer", callC(r.p.api.PollXfer, unsafe.Pointer(args)))
	if args.Released != 0 && args.Released != 1 {
		err = errors.Join(err, hostError(r.p.info.Name, "poll_xfer", abi.ErrBackend, "released is %d, want 0 or 1", args.Released))
	}
	return args.Status, args.Released == 1, err
}

// SubmitBatchXfer calls submit_xfer (ABI 1.1) in its batch form, without a
// notification. The handle is the caller's to release.
func (r Raw) SubmitBatchXfer(agent abi.Agent, op abi.Op, pairs []abi.RegionPair, entries []abi.BatchEntry) (abi.Xfer, abi.Status, error) {
	if err := r.absent(r.p.api.SubmitXfer, "submit_xfer"); err != nil {
		return 0, 0, err
	}
	return r.p.makeBatch(agent, op, pairs, entries, abi.Notif{}, true)
}

// EventFD calls get_event_fd (ABI 1.1).
func (r Raw) EventFD(agent abi.Agent) (int, error) {
	if err := r.absent(r.p.api.GetEventFD, "get_event_fd"); err != nil {
		return -1, err
	}
	args := &abi.GetEventFDArgs{StructSize: abi.GetEventFDArgsSize, Agent: agent, FD: -1}
	err := r.p.check("get_event_fd", callC(r.p.api.GetEventFD, unsafe.Pointer(args)))
	return int(args.FD), err
}
