// Package engmem is the serving engine's memory as the kvhost sidecar
// (kvhost serve) sees it: the regions an engine registers over the control
// API (docs/engine-api.md, "Memory"), opened in this process, and the
// translation of the engine's own pointers into this process's addresses.
//
// An engine declares each region as a [Spec]: a range of its address space
// (Addr, Length) and where the sidecar finds the same bytes.
//
//   - Host memory (DRAM) is shared by name: a POSIX shared-memory object
//     ("/kvhost-1234-kv", that is /dev/shm/kvhost-1234-kv) or an absolute
//     path of a file under /dev/shm or /dev/hugepages, at an offset; or
//     a memfd sealed with F_SEAL_SHRINK that another process holds, by
//     its descriptor ("/proc/<pid>/fd/<n>"; never one of the sidecar's
//     own, not on hugetlbfs, not sealed against writing), whose
//     descriptor the sidecar keeps open until the region is released. The
//     sidecar maps it MAP_SHARED read-write; nothing else can be mapped
//     (no other path, no symbolic link leading out of those folders, no
//     file that is not regular, no unsealed descriptor), so a client
//     cannot make the sidecar map an arbitrary file. Spec.AsVRAM (register_as "vram") changes only the
//     kind the sidecar registers the region's buffers with the plugin as
//     ([Spec.PluginKind]); the region is opened as host memory all the same.
//   - GPU memory (VRAM) is shared by CUDA IPC handle (cudaIpcGetMemHandle's
//     64 bytes), opened with cudaIpcOpenMemHandle through libcudart, which
//     is loaded with purego at run time when the first VRAM region is
//     opened: there is no CUDA at build time and no cgo. Without libcudart
//     a VRAM region is refused with code "unsupported", naming the
//     libraries tried.
//
// An [Opener] opens one Spec into a [Region]; a [Table] holds one engine
// connection's regions (non-overlapping engine ranges, all-or-nothing
// Add, Remove, Close) and translates engine ranges with [Table.Translate]
// and [Table.Bytes]. Every refusal is an [*Error] carrying the control API
// error code.
//
// Ownership: a Region's mapping (DRAM) or IPC mapping (VRAM) lives until
// the Region is closed. Regions returned by Table.Add belong to the Table:
// close them with Table.Remove or Table.Close, and stop using a Region's
// Bytes and Local before that (the memory is unmapped; the control API's
// "busy" refusal, kept by host/serve, is what guarantees it).
//
// A limit the kernel sets: the engine owns its shared-memory file and can
// shrink it after registering. A later access to the part cut off is a
// SIGBUS in the sidecar, which no check at Open can prevent (POSIX shm
// objects cannot be sealed against shrinking). Engines must keep their
// shm objects at full size until they deregister the regions. A memfd
// sealed with F_SEAL_SHRINK cannot shrink: its mappings never fault,
// which is what the memfd form is for.
//
// What was run on a GPU: see docs/engine-api.md, "What was run on a GPU".
// The tests drive the VRAM path through a stand-in libcudart
// (testdata/cudart_standin.c) that exports the same entry points over
// shared memory.
package engmem
