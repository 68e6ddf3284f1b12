/*
 * kvplugin.h: the contract between the kvhost host and its transfer backends.
 *
 * A backend is a shared library exporting one C symbol, kvp_plugin_get_api,
 * that hands the host a table of functions. The host (a cgo-free Go binary)
 * loads the library at run time with dlopen and calls the table through
 * purego. Nothing else crosses the boundary: no C++ types, no callbacks from
 * the plugin into the host, no global "last error".
 *
 * ---------------------------------------------------------------------------
 * Versioning
 * ---------------------------------------------------------------------------
 * KVP_ABI_MAJOR changes when anything is removed, renamed, retyped or moved:
 * deleting a function or a field, changing a field's type, reordering fields,
 * changing a constant's value or the meaning of a call. A host refuses a
 * plugin whose major differs from its own and says which versions each side
 * speaks.
 *
 * KVP_ABI_MINOR changes when something is appended: a function at the end of
 * kvp_api, a field at the end of an args struct, a new capability bit, a new
 * constant. Older plugins and hosts keep working because every args struct
 * starts with struct_size (see KVP_STRUCT_SIZE): a callee reads only the
 * fields that both it and the caller know, and treats fields the caller did
 * not send as zero (KVP_ARGS_HAS). So a callee checks struct_size against
 * the size of the minor that introduced the function (the *_STRUCT_SIZE_1_0
 * macros keep the ABI 1.0 sizes of structs that grew since), never against
 * the current size. A plugin of an older minor hands out a shorter kvp_api
 * (its struct_size); the host treats the functions it lacks as NULL and the
 * capabilities they belong to as absent.
 *
 * History:
 *   1.0  first version.
 *   1.1  KVP_CAP_EVENT_FD (get_event_fd: a per-agent completion descriptor),
 *        KVP_CAP_SUBMIT (submit_xfer: make and post in one call; poll_xfer
 *        flags that release a finished transfer and return its telemetry
 *        in the same call), KVP_ARGS_HAS, the *_STRUCT_SIZE_1_0 macros.
 *
 * ---------------------------------------------------------------------------
 * Calling convention
 * ---------------------------------------------------------------------------
 * Every function takes a single pointer to an args struct whose first two
 * fields are `size_t struct_size; void *ext;`. struct_size is set by the
 * caller to KVP_<NAME>_ARGS_STRUCT_SIZE (the offset of the last field plus its
 * size, so trailing padding does not count); ext is reserved for extensions
 * and must be NULL. Fields marked "out" are written by the callee; all others
 * are inputs the callee must not modify.
 *
 * Functions that can fail return a kvp_error*: NULL on success, otherwise an
 * error object owned by the caller, who reads it with error_code and
 * error_message and frees it with error_destroy. Out fields are unspecified
 * when an error is returned.
 *
 * ---------------------------------------------------------------------------
 * Handles
 * ---------------------------------------------------------------------------
 * Agents, registered regions, remote regions, prepared descriptor lists and
 * transfers are identified by 64-bit handles chosen by the plugin. 0 is never
 * a valid handle. A plugin validates every handle it is given and answers an
 * unknown, released or foreign handle (e.g. a region of another agent) with
 * KVP_ERR_INVALID_PARAM, never with a crash: handles are values, not
 * pointers, precisely so that a stale one is detectable.
 *
 * ---------------------------------------------------------------------------
 * Ownership and lifetime
 * ---------------------------------------------------------------------------
 * - Every input pointer (args struct, arrays, strings, blobs) is owned by the
 *   caller and is only valid for the duration of the call. A plugin copies
 *   whatever it must keep. In particular the host's args structs and arrays
 *   live in Go memory that the Go runtime may reuse after the call returns.
 * - Strings are passed as (pointer, length) pairs and need not be
 *   NUL-terminated.
 * - Output byte buffers (metadata, exported region blobs, notifications) are
 *   supplied by the caller together with their capacity. The callee always
 *   reports the size it needs; it copies only when the buffer is big enough.
 * - Output strings returned as `const char *` point into plugin memory; each
 *   field says how long that memory stays valid.
 * - Memory registered with register_mem belongs to the caller. It must stay
 *   mapped until deregister_mem returns. The plugin never frees it.
 *
 * ---------------------------------------------------------------------------
 * Thread safety
 * ---------------------------------------------------------------------------
 * Every function may be called from any thread, concurrently with any other
 * call, on the same agent or on different agents; a plugin synchronises
 * internally. The caller guarantees two things only:
 *   1. a handle is not released (agent_destroy, deregister_mem,
 *      remote_region_release, release_dlist, release_xfer, poll_xfer with
 *      KVP_POLL_RELEASE) while another call that uses it is running, and
 *   2. one transfer handle is not used by two calls at the same time
 *      (post_xfer, poll_xfer, xfer_telemetry, release_xfer on one xfer are
 *      serialised by the caller).
 * The plugin never calls back into the host. Progress is driven by the
 * plugin's own threads or by poll_xfer / get_notifs.
 *
 * ---------------------------------------------------------------------------
 * Descriptors
 * ---------------------------------------------------------------------------
 * Transfer descriptors are strided: (addr, len, stride, count) names `count`
 * blocks of `len` bytes whose starts are `stride` bytes apart; count 1 is a
 * plain block and then stride is ignored. A plugin without KVP_CAP_STRIDED
 * rejects count > 1 with KVP_ERR_NOT_SUPPORTED and the host expands strided
 * descriptors into plain ones. count 0 and len 0 are invalid.
 *
 * In a transfer the i-th local descriptor moves to or from the i-th remote
 * descriptor. Paired descriptors must have the same len and count (strides
 * may differ): block k of one side pairs with block k of the other.
 *
 * Before any byte moves, a plugin checks every block of every descriptor:
 * local blocks must lie inside memory registered on this agent, remote blocks
 * inside memory the peer advertised in its metadata (or inside the remote
 * region the descriptor is relative to). A block outside is an error
 * (KVP_ERR_NOT_FOUND for addresses, KVP_ERR_INVALID_PARAM for offsets beyond
 * a region) and no byte of that transfer moves.
 */
#ifndef KVPLUGIN_H
#define KVPLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVP_ABI_MAJOR 1
#define KVP_ABI_MINOR 1

/* Size of an args struct up to and including its last field. */
#define KVP_STRUCT_SIZE(type, last_field) \
  (offsetof(type, last_field) + sizeof(((type *)0)->last_field))

/* Whether the caller of an args struct sent `field` (its struct_size covers
 * it). A callee reads an appended field only when this holds, treats it as
 * zero otherwise, and writes an appended out field only when this holds.
 * (ABI 1.1) */
#define KVP_ARGS_HAS(args, type, field) ((args)->struct_size >= KVP_STRUCT_SIZE(type, field))

#if defined(_WIN32)
#define KVP_EXPORT __declspec(dllexport)
#else
#define KVP_EXPORT __attribute__((visibility("default")))
#endif

/* ------------------------------------------------------------------------ */
/* Constants                                                                */
/* ------------------------------------------------------------------------ */

/* Status codes. The values are NIXL's nixl_status_t so a NIXL shim passes
 * them through unchanged. Errors are negative. */
typedef int32_t kvp_status;
#define KVP_IN_PROG 1
#define KVP_SUCCESS 0
#define KVP_ERR_NOT_POSTED -1
#define KVP_ERR_INVALID_PARAM -2
#define KVP_ERR_BACKEND -3
#define KVP_ERR_NOT_FOUND -4
#define KVP_ERR_MISMATCH -5
#define KVP_ERR_NOT_ALLOWED -6
#define KVP_ERR_REPOST_ACTIVE -7
#define KVP_ERR_UNKNOWN -8
#define KVP_ERR_NOT_SUPPORTED -9
#define KVP_ERR_REMOTE_DISCONNECT -10
#define KVP_ERR_CANCELED -11
#define KVP_ERR_NO_TELEMETRY -12

/* Memory kinds, numbered as NIXL's nixl_mem_t. */
typedef uint32_t kvp_mem_kind;
#define KVP_MEM_DRAM 0
#define KVP_MEM_VRAM 1

/* Transfer operations, numbered as NIXL's nixl_xfer_op_t. READ moves remote
 * bytes into local memory; WRITE moves local bytes into remote memory. */
typedef uint32_t kvp_op;
#define KVP_OP_READ 0
#define KVP_OP_WRITE 1

/* Capability bits reported by plugin_info. A plugin must have at least one of
 * KVP_CAP_PREPPED and KVP_CAP_BATCH; the host emulates the other. Function
 * pointers of kvp_api that belong to a capability the plugin does not report
 * may be NULL; the host never calls them. */
#define KVP_CAP_PREPPED (1ull << 0)     /* prep_dlist, release_dlist, make_prepped_xfer */
#define KVP_CAP_BATCH (1ull << 1)       /* make_batch_xfer */
#define KVP_CAP_STRIDED (1ull << 2)     /* descriptors with count > 1 */
#define KVP_CAP_NOTIF (1ull << 3)       /* transfer notifications, get_notifs, send_notif */
#define KVP_CAP_TELEMETRY (1ull << 4)   /* xfer_telemetry */
#define KVP_CAP_REMOTE_ADDR (1ull << 5) /* remote regions and remote dlists by address */
#define KVP_CAP_REMOTE_BLOB (1ull << 6) /* remote regions from region_export blobs */
#define KVP_CAP_EVENT_FD (1ull << 7)    /* get_event_fd (ABI 1.1) */
#define KVP_CAP_SUBMIT (1ull << 8)      /* submit_xfer, poll_xfer flags (ABI 1.1) */

/* Bit for a memory kind in kvp_plugin_info_args.mem_kinds. */
#define KVP_MEM_BIT(kind) (1ull << (kind))

/* Handles (see "Handles" above). 0 is never valid. */
typedef uint64_t kvp_agent;
typedef uint64_t kvp_region;  /* memory registered on a local agent */
typedef uint64_t kvp_rregion; /* a region of a peer, as seen by a local agent */
typedef uint64_t kvp_dlist;   /* a prepared descriptor list */
typedef uint64_t kvp_xfer;    /* a transfer request */

/* ------------------------------------------------------------------------ */
/* Errors                                                                   */
/* ------------------------------------------------------------------------ */

/* Opaque, allocated by the plugin, freed by the caller with error_destroy. */
typedef struct kvp_error kvp_error;

typedef struct kvp_error_destroy_args {
  size_t struct_size;
  void *ext;
  kvp_error *error; /* freed; may be NULL */
} kvp_error_destroy_args;
#define KVP_ERROR_DESTROY_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_error_destroy_args, error)

typedef struct kvp_error_message_args {
  size_t struct_size;
  void *ext;
  const kvp_error *error;
  const char *message; /* out: has the lifetime of error; not NUL-terminated */
  size_t message_len;  /* out: bytes */
} kvp_error_message_args;
#define KVP_ERROR_MESSAGE_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_error_message_args, message_len)

typedef struct kvp_error_code_args {
  size_t struct_size;
  void *ext;
  const kvp_error *error;
  kvp_status code; /* out: a negative KVP_ERR_* value */
} kvp_error_code_args;
#define KVP_ERROR_CODE_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_error_code_args, code)

/* ------------------------------------------------------------------------ */
/* Plugin                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct kvp_plugin_info_args {
  size_t struct_size;
  void *ext;
  const char *name;       /* out: NUL-terminated, e.g. "fake"; static lifetime */
  const char *version;    /* out: NUL-terminated plugin version; static lifetime */
  const char *params_doc; /* out: NUL-terminated, one "key=default<TAB>description"
                             line per agent parameter; static lifetime */
  uint32_t abi_major;     /* out: KVP_ABI_MAJOR the plugin was built with */
  uint32_t abi_minor;     /* out: KVP_ABI_MINOR the plugin was built with */
  uint64_t caps;          /* out: KVP_CAP_* bits */
  uint64_t mem_kinds;     /* out: KVP_MEM_BIT(kind) for every supported kind */
} kvp_plugin_info_args;
#define KVP_PLUGIN_INFO_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_plugin_info_args, mem_kinds)

/* ------------------------------------------------------------------------ */
/* Agents                                                                   */
/* ------------------------------------------------------------------------ */

/* One string key/value parameter. Unknown keys are an error unless the
 * plugin documents that it passes them through (e.g. to a vendor backend). */
typedef struct kvp_param {
  const char *key;
  size_t key_len;
  const char *value;
  size_t value_len;
} kvp_param;

typedef struct kvp_agent_create_args {
  size_t struct_size;
  void *ext;
  const char *name; /* the agent's name, unique among the peers it talks to */
  size_t name_len;  /* 1..KVP_MAX_NAME_LEN bytes */
  const kvp_param *params;
  size_t num_params;
  kvp_agent agent; /* out */
  uint64_t caps;   /* out: the KVP_CAP_* bits this agent offers: the plugin's
                      caps, less any that agent parameters switched off (the
                      fake plugin's caps_off). The host decides emulation per
                      agent from these, not from plugin_info. */
} kvp_agent_create_args;
#define KVP_AGENT_CREATE_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_agent_create_args, caps)
#define KVP_MAX_NAME_LEN 255

/* Cancels the agent's active transfers, releases every handle the agent owns
 * (regions, remote regions, dlists, xfers, loaded peers) and frees it. On
 * return the plugin no longer touches memory the agent registered. */
typedef struct kvp_agent_destroy_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
} kvp_agent_destroy_args;
#define KVP_AGENT_DESTROY_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_agent_destroy_args, agent)

/* ------------------------------------------------------------------------ */
/* Memory registration                                                      */
/* ------------------------------------------------------------------------ */

typedef struct kvp_mem_desc {
  uint64_t addr;         /* start address in this process */
  uint64_t len;          /* bytes, > 0 */
  uint64_t dev_id;       /* GPU ordinal for VRAM; 0 for DRAM */
  kvp_mem_kind mem_kind; /* KVP_MEM_* */
  uint32_t reserved;     /* must be 0 */
} kvp_mem_desc;

/* Registers num_descs regions; regions[i] receives the handle of descs[i].
 * All or nothing: on error no region stays registered. Overlapping an
 * existing registration of the same agent is KVP_ERR_INVALID_PARAM. */
typedef struct kvp_register_mem_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  const kvp_mem_desc *descs;
  size_t num_descs;
  kvp_region *regions; /* out: caller-allocated array of num_descs handles */
} kvp_register_mem_args;
#define KVP_REGISTER_MEM_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_register_mem_args, regions)

/* Deregisters regions. All handles are validated first; if any is invalid
 * nothing is deregistered. The caller releases the dlists and transfers that
 * use a region before deregistering it; a plugin that tracks such use may
 * refuse with KVP_ERR_NOT_ALLOWED. */
typedef struct kvp_deregister_mem_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  const kvp_region *regions;
  size_t num_regions;
} kvp_deregister_mem_args;
#define KVP_DEREGISTER_MEM_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_deregister_mem_args, num_regions)

/* Writes an opaque blob describing a registered region, that a peer passes
 * to remote_region_import (MORI-IO's MemoryDesc.pack(); the fake plugin's
 * own encoding). size is always set; bytes are copied only if size <= cap. */
typedef struct kvp_region_export_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  kvp_region region;
  uint8_t *buf; /* caller-owned; may be NULL when cap is 0 */
  size_t cap;   /* bytes available at buf */
  size_t size;  /* out: bytes the blob needs */
} kvp_region_export_args;
#define KVP_REGION_EXPORT_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_region_export_args, size)

/* ------------------------------------------------------------------------ */
/* Metadata and peers                                                       */
/* ------------------------------------------------------------------------ */

/* Writes the agent's metadata: everything a peer needs to reach this agent
 * and its registered memory (NIXL getLocalMD; MORI-IO EngineDesc.pack()).
 * Register memory first: metadata is a snapshot. size is always set; bytes
 * are copied only if size <= cap. */
typedef struct kvp_local_metadata_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  uint8_t *buf; /* caller-owned; may be NULL when cap is 0 */
  size_t cap;
  size_t size; /* out */
} kvp_local_metadata_args;
#define KVP_LOCAL_METADATA_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_local_metadata_args, size)

/* Loads a peer's metadata. A loaded peer name keeps the agent it was
 * loaded as: metadata that names a loaded peer but describes another agent
 * (other connection details: another process, endpoint or incarnation of
 * the agent, e.g. a forgery that reuses an honest peer's name) is refused
 * with KVP_ERR_NOT_ALLOWED and leaves the loaded peer and everything that
 * refers to it exactly as it was; a peer that restarted comes back through
 * remove_remote and a new load. Loading the same metadata again is
 * idempotent (the same peer_name, nothing changes). Metadata of the same
 * agent that advertises other memory (registered since) either replaces
 * the loaded metadata or is refused with KVP_ERR_NOT_ALLOWED, as far as
 * the plugin can tell it from a forgery (fake replaces it when the peer
 * vouches for it; the nixl shim refuses any other bytes). A plugin may
 * also refuse (KVP_ERR_NOT_ALLOWED) metadata it cannot prove is the
 * described agent's own (fake does, see plugins/fake/README.md). */
typedef struct kvp_load_remote_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  const uint8_t *metadata;
  size_t metadata_len;
  const char *peer_name; /* out: the peer's agent name, not NUL-terminated;
                            valid until remove_remote of that peer or
                            agent_destroy */
  size_t peer_name_len;  /* out */
} kvp_load_remote_args;
#define KVP_LOAD_REMOTE_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_load_remote_args, peer_name_len)

/* Forgets a peer: cancels active transfers to it. Handles that refer to the
 * peer (transfers, remote dlists, remote regions) stay valid handles that
 * the caller still releases, but they are dead: poll of a cancelled
 * transfer returns KVP_ERR_CANCELED, and new transfers, posts and imports
 * that name the peer return KVP_ERR_NOT_FOUND. Unknown peer:
 * KVP_ERR_NOT_FOUND. A peer loaded again after remove_remote (even under
 * the same name, with the same metadata) is a new peer: the old handles
 * stay dead (posting or building transfers from them is still
 * KVP_ERR_NOT_FOUND); make new dlists, regions and transfers against it. */
typedef struct kvp_remove_remote_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  const char *peer_name;
  size_t peer_name_len;
} kvp_remove_remote_args;
#define KVP_REMOVE_REMOTE_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_remove_remote_args, peer_name_len)

/* Imports a region of a loaded peer, either from a blob the peer made with
 * region_export (blob != NULL; needs KVP_CAP_REMOTE_BLOB) or as an address
 * range inside memory the peer advertised (blob == NULL; needs
 * KVP_CAP_REMOTE_ADDR). The out fields describe the region either way. */
typedef struct kvp_remote_region_import_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  const char *peer_name;
  size_t peer_name_len;
  const uint8_t *blob; /* NULL: import by address */
  size_t blob_len;
  uint64_t addr;         /* in when blob == NULL, else out */
  uint64_t len;          /* in when blob == NULL, else out */
  uint64_t dev_id;       /* in when blob == NULL, else out */
  kvp_mem_kind mem_kind; /* in when blob == NULL, else out */
  uint32_t reserved;
  kvp_rregion rregion; /* out */
} kvp_remote_region_import_args;
#define KVP_REMOTE_REGION_IMPORT_ARGS_STRUCT_SIZE \
  KVP_STRUCT_SIZE(kvp_remote_region_import_args, rregion)

typedef struct kvp_remote_region_release_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  kvp_rregion rregion;
} kvp_remote_region_release_args;
#define KVP_REMOTE_REGION_RELEASE_ARGS_STRUCT_SIZE \
  KVP_STRUCT_SIZE(kvp_remote_region_release_args, rregion)

/* ------------------------------------------------------------------------ */
/* Prepared descriptor lists (KVP_CAP_PREPPED)                              */
/* ------------------------------------------------------------------------ */

typedef struct kvp_xfer_desc {
  uint64_t addr;   /* first block */
  uint64_t len;    /* bytes per block, > 0 */
  uint64_t stride; /* bytes between block starts; ignored when count == 1 */
  uint64_t count;  /* blocks, > 0; > 1 needs KVP_CAP_STRIDED */
  uint64_t dev_id; /* GPU ordinal for VRAM; 0 for DRAM */
} kvp_xfer_desc;

/* Prepares a list of descriptors once, so later transfers name them by
 * index (NIXL prepXferDlist). peer_name_len == 0 prepares local descriptors
 * (checked against this agent's registrations); otherwise remote descriptors
 * of that loaded peer (checked against its advertised memory). All
 * descriptors of a list have one memory kind. */
typedef struct kvp_prep_dlist_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  const char *peer_name; /* NULL or empty: local */
  size_t peer_name_len;
  kvp_mem_kind mem_kind;
  uint32_t reserved;
  const kvp_xfer_desc *descs;
  size_t num_descs;
  kvp_dlist dlist; /* out */
} kvp_prep_dlist_args;
#define KVP_PREP_DLIST_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_prep_dlist_args, dlist)

/* The caller releases the transfers made from a dlist first; a plugin that
 * tracks such use may refuse with KVP_ERR_NOT_ALLOWED. */
typedef struct kvp_release_dlist_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  kvp_dlist dlist;
} kvp_release_dlist_args;
#define KVP_RELEASE_DLIST_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_release_dlist_args, dlist)

/* Optional notification attached to a transfer: delivered to the remote
 * agent, with this agent's name as sender, after every byte of the transfer
 * has landed (NIXL opt_args.notif). Present when has_notif is non-zero; an
 * empty message is allowed. Needs KVP_CAP_NOTIF. */
typedef struct kvp_notif {
  const uint8_t *msg;
  size_t msg_len;
  uint32_t has_notif;
  uint32_t reserved;
} kvp_notif;

/* Builds a transfer from index arrays into a local and a remote dlist (NIXL
 * makeXferReq). num_local_indices must equal num_remote_indices; zero
 * indices make a transfer that moves nothing and only delivers its
 * notification. An index
 * outside its list is KVP_ERR_INVALID_PARAM; paired descriptors that differ
 * in len or count are KVP_ERR_MISMATCH. The transfer is not started: call
 * post_xfer. The index arrays are copied. */
typedef struct kvp_make_prepped_xfer_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  kvp_op op;
  uint32_t reserved;
  kvp_dlist local_dlist;
  const int32_t *local_indices;
  size_t num_local_indices;
  kvp_dlist remote_dlist;
  const int32_t *remote_indices;
  size_t num_remote_indices;
  kvp_notif notif;
  kvp_xfer xfer; /* out */
} kvp_make_prepped_xfer_args;
#define KVP_MAKE_PREPPED_XFER_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_make_prepped_xfer_args, xfer)

/* ------------------------------------------------------------------------ */
/* Batch transfers by region (KVP_CAP_BATCH)                                */
/* ------------------------------------------------------------------------ */

/* A (local region, remote region) pair. All remote regions of one transfer
 * belong to one peer (else KVP_ERR_MISMATCH). */
typedef struct kvp_region_pair {
  kvp_region local;
  kvp_rregion remote;
} kvp_region_pair;

/* One strided copy between the regions of pairs[pair]: block k moves
 * between local + local_offset + k*local_stride and remote + remote_offset +
 * k*remote_stride, len bytes each, for k < count. */
typedef struct kvp_batch_entry {
  uint32_t pair;     /* index into the pairs array */
  uint32_t reserved; /* must be 0 */
  uint64_t local_offset;
  uint64_t remote_offset;
  uint64_t len;
  uint64_t local_stride;  /* ignored when count == 1 */
  uint64_t remote_stride; /* ignored when count == 1 */
  uint64_t count;         /* > 1 needs KVP_CAP_STRIDED */
} kvp_batch_entry;

/* Builds one transfer out of many region-relative copies (MORI-IO
 * BatchWrite/BatchRead: batch_write is op KVP_OP_WRITE, batch_read is
 * KVP_OP_READ; NIXL createXferReq). The arrays are copied. The transfer is
 * not started: call post_xfer. */
typedef struct kvp_make_batch_xfer_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  kvp_op op;
  uint32_t reserved;
  const kvp_region_pair *pairs;
  size_t num_pairs;
  const kvp_batch_entry *entries;
  size_t num_entries;
  kvp_notif notif;
  kvp_xfer xfer; /* out */
} kvp_make_batch_xfer_args;
#define KVP_MAKE_BATCH_XFER_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_make_batch_xfer_args, xfer)

/* ------------------------------------------------------------------------ */
/* Transfer lifecycle                                                       */
/* ------------------------------------------------------------------------ */

/* Starts a transfer. status is KVP_SUCCESS when it completed within the
 * call, else KVP_IN_PROG. A completed transfer may be posted again (the same
 * bytes move again, the notification is sent again); posting one still in
 * progress is KVP_ERR_REPOST_ACTIVE. */
typedef struct kvp_post_xfer_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  kvp_xfer xfer;
  kvp_status status; /* out: KVP_SUCCESS or KVP_IN_PROG */
} kvp_post_xfer_args;
#define KVP_POST_XFER_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_post_xfer_args, status)

/* Reports progress without waiting for completion. Like NIXL's
 * getXferStatus without a progress thread, a poll may drive the transfer in
 * the calling thread (move some or all of its bytes) before it returns; a
 * plugin bounds that work per call and documents the bound. A failed
 * transfer returns an error carrying the failure's code and message (every
 * poll after the failure returns the same). Polling a transfer that was
 * never posted is KVP_ERR_NOT_POSTED.
 *
 * ABI 1.1, on an agent with KVP_CAP_SUBMIT (a plugin ignores flags on an
 * agent without it, and a caller of ABI 1.0 sends none):
 *   KVP_POLL_RELEASE: a poll that finds the transfer ended, done (status
 *     KVP_SUCCESS) or failed (the failure returned as the error), also
 *     releases it, as release_xfer would, and sets `released` to 1. Then
 *     the handle is invalid on return. `released` is written even when the
 *     poll returns an error (an exception to the rule that out fields are
 *     unspecified then): 0 means the handle is still valid, e.g. because
 *     the error concerns the call itself (unknown handle, bad args) or the
 *     plugin could not release the ended transfer; the caller then releases
 *     it with release_xfer as usual. A transfer in progress is never
 *     released by a poll.
 *   KVP_POLL_TELEMETRY: a poll that finds the transfer done also writes
 *     its telemetry (as xfer_telemetry would) into the fields below and
 *     sets has_telemetry to 1; it leaves has_telemetry 0 when the agent has
 *     no telemetry (no KVP_CAP_TELEMETRY, or the backend has it switched
 *     off). With KVP_POLL_RELEASE the telemetry is read before the release.
 * So a transfer costs one call to start (submit_xfer) and, with both flags,
 * one call to finish. */
typedef struct kvp_poll_xfer_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  kvp_xfer xfer;
  kvp_status status; /* out: KVP_SUCCESS or KVP_IN_PROG */
  /* ABI 1.1 */
  uint32_t flags;         /* KVP_POLL_* */
  uint32_t released;      /* out: 1 when the poll released the transfer */
  uint32_t has_telemetry; /* out: 1 when the telemetry fields are set */
  uint64_t start_us;      /* out: as kvp_xfer_telemetry_args */
  uint64_t post_us;       /* out */
  uint64_t xfer_us;       /* out */
  uint64_t total_bytes;   /* out */
  uint64_t desc_count;    /* out */
} kvp_poll_xfer_args;
#define KVP_POLL_XFER_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_poll_xfer_args, desc_count)
#define KVP_POLL_XFER_ARGS_STRUCT_SIZE_1_0 KVP_STRUCT_SIZE(kvp_poll_xfer_args, status)
#define KVP_POLL_RELEASE (1u << 0)
#define KVP_POLL_TELEMETRY (1u << 1)

/* Releases a transfer, cancelling it if active. On return the plugin no
 * longer reads or writes the memory of this transfer, so the caller may
 * deregister and unmap it. */
typedef struct kvp_release_xfer_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  kvp_xfer xfer;
} kvp_release_xfer_args;
#define KVP_RELEASE_XFER_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_release_xfer_args, xfer)

/* Telemetry of the last completed post of a transfer (NIXL
 * nixl_xfer_telem_t). KVP_ERR_NO_TELEMETRY before completion. */
typedef struct kvp_xfer_telemetry_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  kvp_xfer xfer;
  uint64_t start_us;    /* out: post time, microseconds since the Unix epoch */
  uint64_t post_us;     /* out: duration of post_xfer, microseconds */
  uint64_t xfer_us;     /* out: post to completion, microseconds */
  uint64_t total_bytes; /* out: bytes moved */
  uint64_t desc_count;  /* out: descriptors in the transfer, as given (strided
                           descriptors count once) */
} kvp_xfer_telemetry_args;
#define KVP_XFER_TELEMETRY_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_xfer_telemetry_args, desc_count)

/* ------------------------------------------------------------------------ */
/* Submit (KVP_CAP_SUBMIT, ABI 1.1)                                         */
/* ------------------------------------------------------------------------ */

/* Makes a transfer and posts it, in one call: exactly one of prepped and
 * batch is non-NULL and is handled as make_prepped_xfer or make_batch_xfer
 * would (same checks, same errors, and the same capability needed: a
 * prepped form needs KVP_CAP_PREPPED, a batch form KVP_CAP_BATCH); the
 * transfer is then posted as post_xfer would. The handle is written into
 * the inner args' xfer field and status is post_xfer's. All or nothing: on
 * error no transfer exists (a plugin releases one it made when the post
 * fails). The transfer is afterwards a transfer like any other: poll it
 * (with KVP_POLL_RELEASE to release it in the final poll), post it again,
 * release it. */
typedef struct kvp_submit_xfer_args {
  size_t struct_size;
  void *ext;
  kvp_make_prepped_xfer_args *prepped; /* the prepped form, or NULL */
  kvp_make_batch_xfer_args *batch;     /* the batch form, or NULL */
  kvp_status status;                   /* out: KVP_SUCCESS or KVP_IN_PROG */
} kvp_submit_xfer_args;
#define KVP_SUBMIT_XFER_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_submit_xfer_args, status)

/* ------------------------------------------------------------------------ */
/* Event descriptor (KVP_CAP_EVENT_FD, ABI 1.1)                             */
/* ------------------------------------------------------------------------ */

/* Returns the agent's event descriptor: a Linux eventfd (non-blocking,
 * close-on-exec, counter mode, not EFD_SEMAPHORE) that the plugin makes
 * readable whenever
 *   - a transfer of this agent ends (done, failed or cancelled) after the
 *     call that posted it returned (one that post_xfer or submit_xfer
 *     reports done may signal too), and
 *   - a notification for this agent is queued (get_notifs would return it).
 * The plugin signals by adding to the counter (write(2) of a uint64_t 1)
 * after the outcome is visible: a poll_xfer or get_notifs that starts after
 * the descriptor became readable sees it. A plugin whose backend has no
 * completion signal may stand in with a thread of its own that polls the
 * backend and signals; it documents how late it can be (the nixl plugin's
 * README: event_notif_max_us for notifications, 100 us for transfers).
 *
 * Level-triggered: the descriptor stays readable until the host resets it
 * by reading it (read(2) of 8 bytes; EAGAIN means it was not set). Events
 * coalesce: one readable state may stand for any number of them. So the
 * host's loop is: wait until readable, read it, then poll every transfer
 * in flight and drain the notifications; an event that happens after the
 * read makes the descriptor readable again, so none is lost.
 *
 * Ownership: the plugin owns the descriptor. Every call for an agent
 * returns the same descriptor; the plugin closes it in agent_destroy, and
 * the host never closes it (to hand it to an event loop that closes what it
 * is given, the host dups it) and stops using it before agent_destroy.
 *
 * Progress: from the first get_event_fd call of an agent on, its transfers
 * complete without being polled (the call that posts one may move it and
 * report it done; otherwise the plugin's own threads move them, or, where
 * the backend must be driven, a plugin thread drives it while transfers
 * are in flight), so a host may wait on the descriptor alone.
 * Before that call a plugin may rely on polls for progress, as in ABI 1.0.
 * No callbacks from the plugin to the host are involved. */
typedef struct kvp_get_event_fd_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  int32_t fd; /* out: the descriptor, >= 0 */
} kvp_get_event_fd_args;
#define KVP_GET_EVENT_FD_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_get_event_fd_args, fd)

/* ------------------------------------------------------------------------ */
/* Notifications (KVP_CAP_NOTIF)                                            */
/* ------------------------------------------------------------------------ */

/* Moves received notifications into buf, oldest first, grouped by sender
 * (all records of one sender are adjacent, in arrival order). Each record is
 *     uint32_t sender_len; uint32_t msg_len;   (little endian)
 *     sender_len bytes of sender name; msg_len bytes of message
 * with no padding. Only whole records are copied; those that do not fit stay
 * queued, and `needed` tells the size of the next one so the caller can grow
 * its buffer. */
typedef struct kvp_get_notifs_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  uint8_t *buf; /* caller-owned */
  size_t cap;
  size_t size;   /* out: bytes written */
  size_t count;  /* out: records written */
  size_t needed; /* out: size of the next queued record that did not fit, or 0 */
} kvp_get_notifs_args;
#define KVP_GET_NOTIFS_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_get_notifs_args, needed)
#define KVP_NOTIF_RECORD_HEADER 8

/* Sends a notification to a loaded peer, outside any transfer (NIXL
 * genNotif). */
typedef struct kvp_send_notif_args {
  size_t struct_size;
  void *ext;
  kvp_agent agent;
  const char *peer_name;
  size_t peer_name_len;
  const uint8_t *msg;
  size_t msg_len;
} kvp_send_notif_args;
#define KVP_SEND_NOTIF_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_send_notif_args, msg_len)

/* ------------------------------------------------------------------------ */
/* The function table                                                       */
/* ------------------------------------------------------------------------ */

typedef struct kvp_api {
  size_t struct_size; /* KVP_API_STRUCT_SIZE of the plugin's ABI minor */
  void *ext;
  uint32_t abi_major;
  uint32_t abi_minor;

  void (*error_destroy)(kvp_error_destroy_args *args);
  void (*error_message)(kvp_error_message_args *args);
  void (*error_code)(kvp_error_code_args *args);

  kvp_error *(*plugin_info)(kvp_plugin_info_args *args);

  kvp_error *(*agent_create)(kvp_agent_create_args *args);
  kvp_error *(*agent_destroy)(kvp_agent_destroy_args *args);

  kvp_error *(*register_mem)(kvp_register_mem_args *args);
  kvp_error *(*deregister_mem)(kvp_deregister_mem_args *args);
  kvp_error *(*region_export)(kvp_region_export_args *args);

  kvp_error *(*local_metadata)(kvp_local_metadata_args *args);
  kvp_error *(*load_remote)(kvp_load_remote_args *args);
  kvp_error *(*remove_remote)(kvp_remove_remote_args *args);
  kvp_error *(*remote_region_import)(kvp_remote_region_import_args *args);
  kvp_error *(*remote_region_release)(kvp_remote_region_release_args *args);

  kvp_error *(*prep_dlist)(kvp_prep_dlist_args *args);
  kvp_error *(*release_dlist)(kvp_release_dlist_args *args);
  kvp_error *(*make_prepped_xfer)(kvp_make_prepped_xfer_args *args);
  kvp_error *(*make_batch_xfer)(kvp_make_batch_xfer_args *args);

  kvp_error *(*post_xfer)(kvp_post_xfer_args *args);
  kvp_error *(*poll_xfer)(kvp_poll_xfer_args *args);
  kvp_error *(*release_xfer)(kvp_release_xfer_args *args);
  kvp_error *(*xfer_telemetry)(kvp_xfer_telemetry_args *args);

  kvp_error *(*get_notifs)(kvp_get_notifs_args *args);
  kvp_error *(*send_notif)(kvp_send_notif_args *args);

  /* ABI 1.1 */
  kvp_error *(*submit_xfer)(kvp_submit_xfer_args *args);
  kvp_error *(*get_event_fd)(kvp_get_event_fd_args *args);
} kvp_api;
#define KVP_API_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_api, get_event_fd)
#define KVP_API_STRUCT_SIZE_1_0 KVP_STRUCT_SIZE(kvp_api, send_notif)

/* ------------------------------------------------------------------------ */
/* The entry point                                                          */
/* ------------------------------------------------------------------------ */

typedef struct kvp_get_api_args {
  size_t struct_size;
  void *ext;
  uint32_t host_abi_major; /* the major the host speaks */
  uint32_t host_abi_minor;
  uint32_t plugin_abi_major_min; /* out: the majors this plugin can serve */
  uint32_t plugin_abi_major_max; /* out */
  const kvp_api *api; /* out: static lifetime; NULL when host_abi_major is not
                         served */
} kvp_get_api_args;
#define KVP_GET_API_ARGS_STRUCT_SIZE KVP_STRUCT_SIZE(kvp_get_api_args, api)

#define KVP_ENTRY_SYMBOL "kvp_plugin_get_api"

/* Returns KVP_SUCCESS and sets api, or KVP_ERR_NOT_SUPPORTED (api NULL) when
 * the plugin does not serve host_abi_major; the range fields are set either
 * way so the host can say which versions each side speaks. Safe to call more
 * than once, from any thread. */
KVP_EXPORT kvp_status kvp_plugin_get_api(kvp_get_api_args *args);

#ifdef __cplusplus
}
#endif

#endif /* KVPLUGIN_H */
