// Package abi is the Go mirror of kvplugin.h, the C ABI between the kvhost
// host and its transfer plugins.
//
// Every type here has exactly the layout of its C counterpart (checked by
// TestLayoutMatchesC, which compiles a C program against the header). The
// `c` struct tags name the C field; they are used only by that test.
//
// Pointer fields that carry Go memory into a call are unsafe.Pointer, so the
// garbage collector keeps what they point to alive for as long as the args
// struct is alive. Pointer fields that the plugin fills with plugin memory are
// uintptr: Go must never treat C memory as its own.
package abi

import (
	"strconv"
	"unsafe"
)

// ABI version this host speaks. See the versioning rules in kvplugin.h.
const (
	Major = 1
	Minor = 1
)

// EntrySymbol is the one symbol a plugin exports.
const EntrySymbol = "kvp_plugin_get_api"

// Status is kvp_status: NIXL's status numbering.
type Status int32

// Status codes, as in kvplugin.h (and NIXL).
const (
	InProg              Status = 1
	Success             Status = 0
	ErrNotPosted        Status = -1
	ErrInvalidParam     Status = -2
	ErrBackend          Status = -3
	ErrNotFound         Status = -4
	ErrMismatch         Status = -5
	ErrNotAllowed       Status = -6
	ErrRepostActive     Status = -7
	ErrUnknown          Status = -8
	ErrNotSupported     Status = -9
	ErrRemoteDisconnect Status = -10
	ErrCanceled         Status = -11
	ErrNoTelemetry      Status = -12
)

var statusNames = map[Status]string{
	InProg:              "IN_PROG",
	Success:             "SUCCESS",
	ErrNotPosted:        "ERR_NOT_POSTED",
	ErrInvalidParam:     "ERR_INVALID_PARAM",
	ErrBackend:          "ERR_BACKEND",
	ErrNotFound:         "ERR_NOT_FOUND",
	ErrMismatch:         "ERR_MISMATCH",
	ErrNotAllowed:       "ERR_NOT_ALLOWED",
	ErrRepostActive:     "ERR_REPOST_ACTIVE",
	ErrUnknown:          "ERR_UNKNOWN",
	ErrNotSupported:     "ERR_NOT_SUPPORTED",
	ErrRemoteDisconnect: "ERR_REMOTE_DISCONNECT",
	ErrCanceled:         "ERR_CANCELED",
	ErrNoTelemetry:      "ERR_NO_TELEMETRY",
}

// String returns the NIXL-style name of the status, e.g. "ERR_NOT_FOUND".
func (s Status) String() string {
	if n, ok := statusNames[s]; ok {
		return n
	}
	return "STATUS(" + itoa(int64(s)) + ")"
}

// MemKind is kvp_mem_kind, numbered as NIXL's nixl_mem_t. The planner has
// its own planner.MemKind, numbered alike, because it imports nothing of
// kvhost; the runtimes convert between them only in host/internal/memkind,
// whose test keeps the two in step.
type MemKind uint32

// Memory kinds.
const (
	DRAM MemKind = 0
	VRAM MemKind = 1
)

// String returns "DRAM" or "VRAM" (the names the SGLang wire format uses).
func (k MemKind) String() string {
	switch k {
	case DRAM:
		return "DRAM"
	case VRAM:
		return "VRAM"
	}
	return "MEM(" + itoa(int64(k)) + ")"
}

// Op is kvp_op, numbered as NIXL's nixl_xfer_op_t.
type Op uint32

// Transfer operations.
const (
	Read  Op = 0
	Write Op = 1
)

// String returns "READ" or "WRITE".
func (o Op) String() string {
	switch o {
	case Read:
		return "READ"
	case Write:
		return "WRITE"
	}
	return "OP(" + itoa(int64(o)) + ")"
}

// Caps is the capability bit set reported by plugin_info.
type Caps uint64

// Capability bits.
const (
	CapPrepped    Caps = 1 << 0
	CapBatch      Caps = 1 << 1
	CapStrided    Caps = 1 << 2
	CapNotif      Caps = 1 << 3
	CapTelemetry  Caps = 1 << 4
	CapRemoteAddr Caps = 1 << 5
	CapRemoteBlob Caps = 1 << 6
	CapEventFD    Caps = 1 << 7 // ABI 1.1: get_event_fd
	CapSubmit     Caps = 1 << 8 // ABI 1.1: submit_xfer, poll_xfer flags
)

var capNames = []struct {
	c    Caps
	name string
}{
	{CapPrepped, "prepped"},
	{CapBatch, "batch"},
	{CapStrided, "strided"},
	{CapNotif, "notif"},
	{CapTelemetry, "telemetry"},
	{CapRemoteAddr, "remote_addr"},
	{CapRemoteBlob, "remote_blob"},
	{CapEventFD, "event_fd"},
	{CapSubmit, "submit"},
}

// Has reports whether every bit of want is set.
func (c Caps) Has(want Caps) bool { return c&want == want }

// Names lists the capability names of the set bits, in bit order; unknown
// bits (from a newer minor version) are listed as "bitN".
func (c Caps) Names() []string {
	var out []string
	known := Caps(0)
	for _, n := range capNames {
		known |= n.c
		if c&n.c != 0 {
			out = append(out, n.name)
		}
	}
	for b := 0; b < 64; b++ {
		if bit := Caps(1) << b; c&bit != 0 && known&bit == 0 {
			out = append(out, "bit"+itoa(int64(b)))
		}
	}
	return out
}

// CapByName returns the capability bit with the given name (as in Names).
func CapByName(name string) (Caps, bool) {
	for _, n := range capNames {
		if n.name == name {
			return n.c, true
		}
	}
	return 0, false
}

// MemBit is KVP_MEM_BIT.
func MemBit(k MemKind) uint64 { return 1 << k }

// MaxNameLen is KVP_MAX_NAME_LEN.
const MaxNameLen = 255

// NotifRecordHeader is KVP_NOTIF_RECORD_HEADER: the bytes before each
// notification record's sender name.
const NotifRecordHeader = 8

// Handle types. 0 is never valid.
type (
	Agent   uint64
	Region  uint64
	RRegion uint64
	DList   uint64
	Xfer    uint64
)

// ErrorDestroyArgs is kvp_error_destroy_args.
type ErrorDestroyArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Error      uintptr        `c:"error"`
}

// ErrorMessageArgs is kvp_error_message_args.
type ErrorMessageArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Error      uintptr        `c:"error"`
	Message    uintptr        `c:"message"`
	MessageLen uintptr        `c:"message_len"`
}

// ErrorCodeArgs is kvp_error_code_args.
type ErrorCodeArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Error      uintptr        `c:"error"`
	Code       Status         `c:"code"`
}

// PluginInfoArgs is kvp_plugin_info_args.
type PluginInfoArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Name       uintptr        `c:"name"`
	Version    uintptr        `c:"version"`
	ParamsDoc  uintptr        `c:"params_doc"`
	ABIMajor   uint32         `c:"abi_major"`
	ABIMinor   uint32         `c:"abi_minor"`
	Caps       Caps           `c:"caps"`
	MemKinds   uint64         `c:"mem_kinds"`
}

// Param is kvp_param.
type Param struct {
	Key      unsafe.Pointer `c:"key"`
	KeyLen   uintptr        `c:"key_len"`
	Value    unsafe.Pointer `c:"value"`
	ValueLen uintptr        `c:"value_len"`
}

// AgentCreateArgs is kvp_agent_create_args.
type AgentCreateArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Name       unsafe.Pointer `c:"name"`
	NameLen    uintptr        `c:"name_len"`
	Params     unsafe.Pointer `c:"params"`
	NumParams  uintptr        `c:"num_params"`
	Agent      Agent          `c:"agent"`
	Caps       Caps           `c:"caps"`
}

// AgentDestroyArgs is kvp_agent_destroy_args.
type AgentDestroyArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
}

// MemDesc is kvp_mem_desc.
type MemDesc struct {
	Addr     uint64  `c:"addr"`
	Len      uint64  `c:"len"`
	DevID    uint64  `c:"dev_id"`
	MemKind  MemKind `c:"mem_kind"`
	Reserved uint32  `c:"reserved"`
}

// RegisterMemArgs is kvp_register_mem_args.
type RegisterMemArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
	Descs      unsafe.Pointer `c:"descs"`
	NumDescs   uintptr        `c:"num_descs"`
	Regions    unsafe.Pointer `c:"regions"`
}

// DeregisterMemArgs is kvp_deregister_mem_args.
type DeregisterMemArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
	Regions    unsafe.Pointer `c:"regions"`
	NumRegions uintptr        `c:"num_regions"`
}

// RegionExportArgs is kvp_region_export_args.
type RegionExportArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
	Region     Region         `c:"region"`
	Buf        unsafe.Pointer `c:"buf"`
	Cap        uintptr        `c:"cap"`
	Size       uintptr        `c:"size"`
}

// LocalMetadataArgs is kvp_local_metadata_args.
type LocalMetadataArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
	Buf        unsafe.Pointer `c:"buf"`
	Cap        uintptr        `c:"cap"`
	Size       uintptr        `c:"size"`
}

// LoadRemoteArgs is kvp_load_remote_args.
type LoadRemoteArgs struct {
	StructSize  uintptr        `c:"struct_size"`
	Ext         unsafe.Pointer `c:"ext"`
	Agent       Agent          `c:"agent"`
	Metadata    unsafe.Pointer `c:"metadata"`
	MetadataLen uintptr        `c:"metadata_len"`
	PeerName    uintptr        `c:"peer_name"`
	PeerNameLen uintptr        `c:"peer_name_len"`
}

// RemoveRemoteArgs is kvp_remove_remote_args.
type RemoveRemoteArgs struct {
	StructSize  uintptr        `c:"struct_size"`
	Ext         unsafe.Pointer `c:"ext"`
	Agent       Agent          `c:"agent"`
	PeerName    unsafe.Pointer `c:"peer_name"`
	PeerNameLen uintptr        `c:"peer_name_len"`
}

// RemoteRegionImportArgs is kvp_remote_region_import_args.
type RemoteRegionImportArgs struct {
	StructSize  uintptr        `c:"struct_size"`
	Ext         unsafe.Pointer `c:"ext"`
	Agent       Agent          `c:"agent"`
	PeerName    unsafe.Pointer `c:"peer_name"`
	PeerNameLen uintptr        `c:"peer_name_len"`
	Blob        unsafe.Pointer `c:"blob"`
	BlobLen     uintptr        `c:"blob_len"`
	Addr        uint64         `c:"addr"`
	Len         uint64         `c:"len"`
	DevID       uint64         `c:"dev_id"`
	MemKind     MemKind        `c:"mem_kind"`
	Reserved    uint32         `c:"reserved"`
	RRegion     RRegion        `c:"rregion"`
}

// RemoteRegionReleaseArgs is kvp_remote_region_release_args.
type RemoteRegionReleaseArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
	RRegion    RRegion        `c:"rregion"`
}

// XferDesc is kvp_xfer_desc: count blocks of Len bytes, Stride bytes apart.
type XferDesc struct {
	Addr   uint64 `c:"addr"`
	Len    uint64 `c:"len"`
	Stride uint64 `c:"stride"`
	Count  uint64 `c:"count"`
	DevID  uint64 `c:"dev_id"`
}

// PrepDListArgs is kvp_prep_dlist_args.
type PrepDListArgs struct {
	StructSize  uintptr        `c:"struct_size"`
	Ext         unsafe.Pointer `c:"ext"`
	Agent       Agent          `c:"agent"`
	PeerName    unsafe.Pointer `c:"peer_name"`
	PeerNameLen uintptr        `c:"peer_name_len"`
	MemKind     MemKind        `c:"mem_kind"`
	Reserved    uint32         `c:"reserved"`
	Descs       unsafe.Pointer `c:"descs"`
	NumDescs    uintptr        `c:"num_descs"`
	DList       DList          `c:"dlist"`
}

// ReleaseDListArgs is kvp_release_dlist_args.
type ReleaseDListArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
	DList      DList          `c:"dlist"`
}

// Notif is kvp_notif.
type Notif struct {
	Msg      unsafe.Pointer `c:"msg"`
	MsgLen   uintptr        `c:"msg_len"`
	HasNotif uint32         `c:"has_notif"`
	Reserved uint32         `c:"reserved"`
}

// MakePreppedXferArgs is kvp_make_prepped_xfer_args.
type MakePreppedXferArgs struct {
	StructSize       uintptr        `c:"struct_size"`
	Ext              unsafe.Pointer `c:"ext"`
	Agent            Agent          `c:"agent"`
	Op               Op             `c:"op"`
	Reserved         uint32         `c:"reserved"`
	LocalDList       DList          `c:"local_dlist"`
	LocalIndices     unsafe.Pointer `c:"local_indices"`
	NumLocalIndices  uintptr        `c:"num_local_indices"`
	RemoteDList      DList          `c:"remote_dlist"`
	RemoteIndices    unsafe.Pointer `c:"remote_indices"`
	NumRemoteIndices uintptr        `c:"num_remote_indices"`
	Notif            Notif          `c:"notif"`
	Xfer             Xfer           `c:"xfer"`
}

// RegionPair is kvp_region_pair.
type RegionPair struct {
	Local  Region  `c:"local"`
	Remote RRegion `c:"remote"`
}

// BatchEntry is kvp_batch_entry: one strided copy between the regions of
// pairs[Pair].
type BatchEntry struct {
	Pair         uint32 `c:"pair"`
	Reserved     uint32 `c:"reserved"`
	LocalOffset  uint64 `c:"local_offset"`
	RemoteOffset uint64 `c:"remote_offset"`
	Len          uint64 `c:"len"`
	LocalStride  uint64 `c:"local_stride"`
	RemoteStride uint64 `c:"remote_stride"`
	Count        uint64 `c:"count"`
}

// MakeBatchXferArgs is kvp_make_batch_xfer_args.
type MakeBatchXferArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
	Op         Op             `c:"op"`
	Reserved   uint32         `c:"reserved"`
	Pairs      unsafe.Pointer `c:"pairs"`
	NumPairs   uintptr        `c:"num_pairs"`
	Entries    unsafe.Pointer `c:"entries"`
	NumEntries uintptr        `c:"num_entries"`
	Notif      Notif          `c:"notif"`
	Xfer       Xfer           `c:"xfer"`
}

// PostXferArgs is kvp_post_xfer_args.
type PostXferArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
	Xfer       Xfer           `c:"xfer"`
	Status     Status         `c:"status"`
}

// PollXferArgs is kvp_poll_xfer_args. The fields after Status are ABI 1.1.
type PollXferArgs struct {
	StructSize   uintptr        `c:"struct_size"`
	Ext          unsafe.Pointer `c:"ext"`
	Agent        Agent          `c:"agent"`
	Xfer         Xfer           `c:"xfer"`
	Status       Status         `c:"status"`
	Flags        uint32         `c:"flags"`
	Released     uint32         `c:"released"`
	HasTelemetry uint32         `c:"has_telemetry"`
	StartUs      uint64         `c:"start_us"`
	PostUs       uint64         `c:"post_us"`
	XferUs       uint64         `c:"xfer_us"`
	TotalBytes   uint64         `c:"total_bytes"`
	DescCount    uint64         `c:"desc_count"`
}

// Poll flags (KVP_POLL_*, ABI 1.1; need CapSubmit).
const (
	PollRelease   uint32 = 1 << 0
	PollTelemetry uint32 = 1 << 1
)

// SubmitXferArgs is kvp_submit_xfer_args (ABI 1.1): exactly one of Prepped
// and Batch is set.
type SubmitXferArgs struct {
	StructSize uintptr              `c:"struct_size"`
	Ext        unsafe.Pointer       `c:"ext"`
	Prepped    *MakePreppedXferArgs `c:"prepped"`
	Batch      *MakeBatchXferArgs   `c:"batch"`
	Status     Status               `c:"status"`
}

// GetEventFDArgs is kvp_get_event_fd_args (ABI 1.1).
type GetEventFDArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
	FD         int32          `c:"fd"`
}

// ReleaseXferArgs is kvp_release_xfer_args.
type ReleaseXferArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
	Xfer       Xfer           `c:"xfer"`
}

// XferTelemetryArgs is kvp_xfer_telemetry_args.
type XferTelemetryArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
	Xfer       Xfer           `c:"xfer"`
	StartUs    uint64         `c:"start_us"`
	PostUs     uint64         `c:"post_us"`
	XferUs     uint64         `c:"xfer_us"`
	TotalBytes uint64         `c:"total_bytes"`
	DescCount  uint64         `c:"desc_count"`
}

// GetNotifsArgs is kvp_get_notifs_args.
type GetNotifsArgs struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	Agent      Agent          `c:"agent"`
	Buf        unsafe.Pointer `c:"buf"`
	Cap        uintptr        `c:"cap"`
	Size       uintptr        `c:"size"`
	Count      uintptr        `c:"count"`
	Needed     uintptr        `c:"needed"`
}

// SendNotifArgs is kvp_send_notif_args.
type SendNotifArgs struct {
	StructSize  uintptr        `c:"struct_size"`
	Ext         unsafe.Pointer `c:"ext"`
	Agent       Agent          `c:"agent"`
	PeerName    unsafe.Pointer `c:"peer_name"`
	PeerNameLen uintptr        `c:"peer_name_len"`
	Msg         unsafe.Pointer `c:"msg"`
	MsgLen      uintptr        `c:"msg_len"`
}

// API is kvp_api. Function fields hold C function pointers; a field may be
// 0 when the plugin lacks the capability it belongs to.
type API struct {
	StructSize uintptr        `c:"struct_size"`
	Ext        unsafe.Pointer `c:"ext"`
	ABIMajor   uint32         `c:"abi_major"`
	ABIMinor   uint32         `c:"abi_minor"`

	ErrorDestroy uintptr `c:"error_destroy"`
	ErrorMessage uintptr `c:"error_message"`
	ErrorCode    uintptr `c:"error_code"`

	PluginInfo uintptr `c:"plugin_info"`

	AgentCreate  uintptr `c:"agent_create"`
	AgentDestroy uintptr `c:"agent_destroy"`

	RegisterMem   uintptr `c:"register_mem"`
	DeregisterMem uintptr `c:"deregister_mem"`
	RegionExport  uintptr `c:"region_export"`

	LocalMetadata       uintptr `c:"local_metadata"`
	LoadRemote          uintptr `c:"load_remote"`
	RemoveRemote        uintptr `c:"remove_remote"`
	RemoteRegionImport  uintptr `c:"remote_region_import"`
	RemoteRegionRelease uintptr `c:"remote_region_release"`

	PrepDList       uintptr `c:"prep_dlist"`
	ReleaseDList    uintptr `c:"release_dlist"`
	MakePreppedXfer uintptr `c:"make_prepped_xfer"`
	MakeBatchXfer   uintptr `c:"make_batch_xfer"`

	PostXfer      uintptr `c:"post_xfer"`
	PollXfer      uintptr `c:"poll_xfer"`
	ReleaseXfer   uintptr `c:"release_xfer"`
	XferTelemetry uintptr `c:"xfer_telemetry"`

	GetNotifs uintptr `c:"get_notifs"`
	SendNotif uintptr `c:"send_notif"`

	// ABI 1.1
	SubmitXfer uintptr `c:"submit_xfer"`
	GetEventFD uintptr `c:"get_event_fd"`
}

// GetAPIArgs is kvp_get_api_args.
type GetAPIArgs struct {
	StructSize        uintptr        `c:"struct_size"`
	Ext               unsafe.Pointer `c:"ext"`
	HostABIMajor      uint32         `c:"host_abi_major"`
	HostABIMinor      uint32         `c:"host_abi_minor"`
	PluginABIMajorMin uint32         `c:"plugin_abi_major_min"`
	PluginABIMajorMax uint32         `c:"plugin_abi_major_max"`
	API               uintptr        `c:"api"`
}

// Struct sizes as KVP_STRUCT_SIZE computes them: up to the end of the last
// field, without trailing padding.
var (
	ErrorDestroyArgsSize        = unsafe.Offsetof(ErrorDestroyArgs{}.Error) + unsafe.Sizeof(ErrorDestroyArgs{}.Error)
	ErrorMessageArgsSize        = unsafe.Offsetof(ErrorMessageArgs{}.MessageLen) + unsafe.Sizeof(ErrorMessageArgs{}.MessageLen)
	ErrorCodeArgsSize           = unsafe.Offsetof(ErrorCodeArgs{}.Code) + unsafe.Sizeof(ErrorCodeArgs{}.Code)
	PluginInfoArgsSize          = unsafe.Offsetof(PluginInfoArgs{}.MemKinds) + unsafe.Sizeof(PluginInfoArgs{}.MemKinds)
	AgentCreateArgsSize         = unsafe.Offsetof(AgentCreateArgs{}.Caps) + unsafe.Sizeof(AgentCreateArgs{}.Caps)
	AgentDestroyArgsSize        = unsafe.Offsetof(AgentDestroyArgs{}.Agent) + unsafe.Sizeof(AgentDestroyArgs{}.Agent)
	RegisterMemArgsSize         = unsafe.Offsetof(RegisterMemArgs{}.Regions) + unsafe.Sizeof(RegisterMemArgs{}.Regions)
	DeregisterMemArgsSize       = unsafe.Offsetof(DeregisterMemArgs{}.NumRegions) + unsafe.Sizeof(DeregisterMemArgs{}.NumRegions)
	RegionExportArgsSize        = unsafe.Offsetof(RegionExportArgs{}.Size) + unsafe.Sizeof(RegionExportArgs{}.Size)
	LocalMetadataArgsSize       = unsafe.Offsetof(LocalMetadataArgs{}.Size) + unsafe.Sizeof(LocalMetadataArgs{}.Size)
	LoadRemoteArgsSize          = unsafe.Offsetof(LoadRemoteArgs{}.PeerNameLen) + unsafe.Sizeof(LoadRemoteArgs{}.PeerNameLen)
	RemoveRemoteArgsSize        = unsafe.Offsetof(RemoveRemoteArgs{}.PeerNameLen) + unsafe.Sizeof(RemoveRemoteArgs{}.PeerNameLen)
	RemoteRegionImportArgsSize  = unsafe.Offsetof(RemoteRegionImportArgs{}.RRegion) + unsafe.Sizeof(RemoteRegionImportArgs{}.RRegion)
	RemoteRegionReleaseArgsSize = unsafe.Offsetof(RemoteRegionReleaseArgs{}.RRegion) + unsafe.Sizeof(RemoteRegionReleaseArgs{}.RRegion)
	PrepDListArgsSize           = unsafe.Offsetof(PrepDListArgs{}.DList) + unsafe.Sizeof(PrepDListArgs{}.DList)
	ReleaseDListArgsSize        = unsafe.Offsetof(ReleaseDListArgs{}.DList) + unsafe.Sizeof(ReleaseDListArgs{}.DList)
	MakePreppedXferArgsSize     = unsafe.Offsetof(MakePreppedXferArgs{}.Xfer) + unsafe.Sizeof(MakePreppedXferArgs{}.Xfer)
	MakeBatchXferArgsSize       = unsafe.Offsetof(MakeBatchXferArgs{}.Xfer) + unsafe.Sizeof(MakeBatchXferArgs{}.Xfer)
	PostXferArgsSize            = unsafe.Offsetof(PostXferArgs{}.Status) + unsafe.Sizeof(PostXferArgs{}.Status)
	PollXferArgsSize            = unsafe.Offsetof(PollXferArgs{}.DescCount) + unsafe.Sizeof(PollXferArgs{}.DescCount)
	PollXferArgsSize10          = unsafe.Offsetof(PollXferArgs{}.Status) + unsafe.Sizeof(PollXferArgs{}.Status)
	SubmitXferArgsSize          = unsafe.Offsetof(SubmitXferArgs{}.Status) + unsafe.Sizeof(SubmitXferArgs{}.Status)
	GetEventFDArgsSize          = unsafe.Offsetof(GetEventFDArgs{}.FD) + unsafe.Sizeof(GetEventFDArgs{}.FD)
	ReleaseXferArgsSize         = unsafe.Offsetof(ReleaseXferArgs{}.Xfer) + unsafe.Sizeof(ReleaseXferArgs{}.Xfer)
	XferTelemetryArgsSize       = unsafe.Offsetof(XferTelemetryArgs{}.DescCount) + unsafe.Sizeof(XferTelemetryArgs{}.DescCount)
	GetNotifsArgsSize           = unsafe.Offsetof(GetNotifsArgs{}.Needed) + unsafe.Sizeof(GetNotifsArgs{}.Needed)
	SendNotifArgsSize           = unsafe.Offsetof(SendNotifArgs{}.MsgLen) + unsafe.Sizeof(SendNotifArgs{}.MsgLen)
	APISize                     = unsafe.Offsetof(API{}.GetEventFD) + unsafe.Sizeof(API{}.GetEventFD)
	APISize10                   = unsafe.Offsetof(API{}.SendNotif) + unsafe.Sizeof(API{}.SendNotif)
	GetAPIArgsSize              = unsafe.Offsetof(GetAPIArgs{}.API) + unsafe.Sizeof(GetAPIArgs{}.API)
)

func itoa(v int64) string { return strconv.FormatInt(v, 10) }
