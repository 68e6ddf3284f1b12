/*
 * kvp_util.h: code every kvhost plugin shares (fake, nixl, mori), so that
 * the rules of abi/kvplugin.h are implemented once.
 *
 *   errors          kvp_err(), kvp_err_oom() and the three error_* entries
 *                   of kvp_api (kvp_util_error_destroy/_message/_code)
 *   args checks     kvp_check_args(): NULL args and short struct_size
 *   handle table    kvp_htable: 64-bit generation-checked handles
 *   parameters      kvp_param lookup, typed parsing, unknown-key rejection
 *   ranges          overflow-safe strided range checks, sorted region lookup
 *   output buffers  kvp_out_bytes(): "size always set, copy only if it fits"
 *   notifications   kvp_notif_queue: thread-safe queue drained in the
 *                   kvp_get_notifs_args record format
 *
 * C11 with no dependencies beyond libc and pthreads; the header and
 * kvp_util.c also compile as C++17 (the nixl and mori shims are C++).
 * Every function is thread-safe unless its comment says otherwise.
 */
#ifndef KVP_UTIL_H
#define KVP_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "kvplugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) || defined(__clang__)
#define KVP_PRINTF(fmt_idx, first_arg) __attribute__((format(printf, fmt_idx, first_arg)))
#else
#define KVP_PRINTF(fmt_idx, first_arg)
#endif

/* ------------------------------------------------------------------------ */
/* Errors                                                                   */
/* ------------------------------------------------------------------------ */

/* Longest message kept in an error object (bytes, without the NUL); longer
 * ones are cut and end in "...". */
#define KVP_ERR_MAX_MESSAGE 4096

/* Allocates an error with a negative KVP_ERR_* code and a printf-style
 * message. A code >= 0 is a programming error and becomes KVP_ERR_UNKNOWN.
 * Never returns NULL: when memory runs out it returns kvp_err_oom(). The
 * caller (ultimately the host) frees it with error_destroy. */
kvp_error *kvp_err(kvp_status code, const char *fmt, ...) KVP_PRINTF(2, 3);

/* A static KVP_ERR_BACKEND "out of memory" error that needs no allocation.
 * error_destroy recognises it and does not free it. */
kvp_error *kvp_err_oom(void);

/* Returns a new error with the code of `inner` and the message
 * "<prefix>: <inner message>", and destroys inner. inner may be NULL (then
 * NULL is returned). Used to add context ("register_mem: desc 3: ..."). */
kvp_error *kvp_err_wrap(kvp_error *inner, const char *fmt, ...) KVP_PRINTF(2, 3);

/* Accessors for plugin-internal use (tests, logging). The message is
 * NUL-terminated and lives as long as the error. */
kvp_status kvp_err_code(const kvp_error *e);
const char *kvp_err_message(const kvp_error *e, size_t *len);
void kvp_err_free(kvp_error *e); /* NULL and the OOM error are ignored */

/* Ready-made kvp_api entries: put them straight into the function table. */
void kvp_util_error_destroy(kvp_error_destroy_args *args);
void kvp_util_error_message(kvp_error_message_args *args);
void kvp_util_error_code(kvp_error_code_args *args);

/* The body of every plugin's kvp_plugin_get_api: checks args, reports the
 * ABI major this plugin speaks (major..major) and hands out api when the
 * host speaks the same major, else KVP_ERR_NOT_SUPPORTED with api NULL. A
 * newer host minor is served: minors only append. */
kvp_status kvp_util_get_api(kvp_get_api_args *args, uint32_t major, const kvp_api *api);

/* ------------------------------------------------------------------------ */
/* Args validation                                                          */
/* ------------------------------------------------------------------------ */

/* Checks an args struct: args must not be NULL and its struct_size (the
 * first field of every args struct) must be at least min_size, the size of
 * the fields this plugin reads. fn names the function in the message.
 * Returns NULL or a KVP_ERR_INVALID_PARAM error. ext is not checked: it is
 * reserved and a plugin ignores what it does not know. */
kvp_error *kvp_check_args(const void *args, size_t min_size, const char *fn);

/* kvp_check_args with the min size taken from the ABI's STRUCT_SIZE macro
 * and the function name from the caller, e.g.
 *   kvp_error *e = KVP_CHECK_ARGS(args, KVP_POST_XFER_ARGS_STRUCT_SIZE);  */
#define KVP_CHECK_ARGS(args, min_size) kvp_check_args((args), (min_size), __func__)

/* ------------------------------------------------------------------------ */
/* Handle table                                                             */
/* ------------------------------------------------------------------------ */

/* Maps 64-bit handles to objects. A handle is (generation << 32 | slot)
 * where slot = (tag << 24 | index): the table's 8-bit tag makes handles of
 * different tables (agents, regions, xfers, ...) distinct, and the 32-bit
 * generation, bumped each time a slot is freed, makes a released handle
 * stale. 0 is never a valid handle (generations start at 1 and skip 0).
 * Lookup is O(1). Slots live in fixed chunks, so they never move.
 *
 * Acquire/put implement reference counting: kvp_ht_remove() marks the entry
 * dead at once (further acquires fail) and then waits until every reference
 * taken before is put back, so an object can be freed safely after remove
 * returns even while other threads were using it.
 *
 * Acquire and put take no lock (one compare-and-swap each on the slot), so
 * the calls of a hot path that validate several handles cost a few atomic
 * operations, not a mutex round trip each; insert and remove serialise on
 * the table's mutex. */
typedef struct kvp_htable kvp_htable;

#define KVP_HT_MAX_ENTRIES (1u << 24)

/* tag: 1..255, distinct per table kind within a plugin. NULL on OOM. */
kvp_htable *kvp_ht_create(uint8_t tag);
/* Frees the table (not the objects). No other call may be running. */
void kvp_ht_destroy(kvp_htable *t);

/* Inserts obj (not NULL) and stores its new handle in *handle. Errors:
 * out of memory, or KVP_HT_MAX_ENTRIES live entries (KVP_ERR_BACKEND). */
kvp_error *kvp_ht_insert(kvp_htable *t, void *obj, uint64_t *handle);

/* Returns the object of a live handle and takes a reference on it, or NULL
 * for 0, stale, released, removing or foreign (other table) handles. Every
 * successful acquire must be paired with one kvp_ht_put. */
void *kvp_ht_acquire(kvp_htable *t, uint64_t handle);
void kvp_ht_put(kvp_htable *t, uint64_t handle);

/* Removes a handle: marks it dead, waits until all references are put, frees
 * the slot (the handle is stale from now on) and returns the object. NULL if
 * the handle is not live (or another thread is already removing it). Must
 * not be called while the calling thread holds a reference on the handle. */
void *kvp_ht_remove(kvp_htable *t, uint64_t handle);

/* Live entries (for tests and leak checks). */
size_t kvp_ht_count(kvp_htable *t);

/* ------------------------------------------------------------------------ */
/* Agent parameters                                                         */
/* ------------------------------------------------------------------------ */

/* 1 if the (s, len) string equals the NUL-terminated lit. */
int kvp_str_eq(const char *s, size_t len, const char *lit);

/* The last parameter whose key equals key (NUL-terminated), or NULL. */
const kvp_param *kvp_param_find(const kvp_param *params, size_t n, const char *key);

/* Checks the shape of a parameter array: params may be NULL only when n is
 * 0; a key is non-empty; a NULL key or value pointer needs length 0; no key
 * appears twice; and unless pass_unknown is set, every key is one of the
 * nknown NUL-terminated names in known. The error names the offending key
 * and lists the known ones. */
kvp_error *kvp_params_check(const kvp_param *params, size_t n, const char *const *known,
                            size_t nknown, int pass_unknown);

/* Typed getters: when key is absent *out = def; else the value is parsed
 * and range-checked. Errors (KVP_ERR_INVALID_PARAM) name key and value.
 *   u64:    decimal digits only, in [lo, hi]
 *   i64:    optional sign then decimal digits, in [lo, hi]
 *   double: strtod syntax, finite, in [lo, hi]
 *   bool:   1/0, true/false, yes/no, on/off (case-insensitive) */
kvp_error *kvp_param_u64(const kvp_param *params, size_t n, const char *key, uint64_t def,
                         uint64_t lo, uint64_t hi, uint64_t *out);
kvp_error *kvp_param_i64(const kvp_param *params, size_t n, const char *key, int64_t def,
                         int64_t lo, int64_t hi, int64_t *out);
kvp_error *kvp_param_double(const kvp_param *params, size_t n, const char *key, double def,
                            double lo, double hi, double *out);
kvp_error *kvp_param_bool(const kvp_param *params, size_t n, const char *key, int def,
                          int *out);

/* Comma lists. kvp_list_next iterates the items of (s, len): *pos starts at
 * 0; each call stores the next item (spaces around it trimmed) in
 * (*item, *item_len) and returns 1, or returns 0 at the end. Empty items
 * (",," or a trailing comma) are returned as empty strings. */
int kvp_list_next(const char *s, size_t len, size_t *pos, const char **item, size_t *item_len);

/* Parses the value of key as a comma list of names; *mask gets bit i for
 * names[i]. Absent key or empty value: *mask = 0. Unknown or empty items
 * are an error that lists the accepted names. nnames <= 64. */
kvp_error *kvp_param_name_mask(const kvp_param *params, size_t n, const char *key,
                               const char *const *names, size_t nnames, uint64_t *mask);

/* ------------------------------------------------------------------------ */
/* Memory the kernel copies through                                         */
/* ------------------------------------------------------------------------ */

/* Has the kernel read one byte of every page of [addr, addr + len) through
 * this process's user addresses (process_vm_writev from the range into a
 * scratch buffer, up to 1024 pages a call). Only reads: the bytes are
 * unchanged; a page never touched gets mapped. Returns the bytes of the
 * range it covered: len, or up to the first page it could not read
 * (unmapped, PROT_NONE, process_vm_* refused), where it stops.
 *
 * Why: the plugins' in-host copies (the fake's process_vm_writev/readv,
 * UCX's cma under NIXL) reach their local side through the process's user
 * addresses, and on a VM that shadows page tables (a PVM guest with page
 * table isolation) the kernel's first such access to each page costs about
 * 4.6 us, even after MAP_POPULATE and user-space writes: ~1.2 s per GiB
 * inside the first transfers that touch a pool. register_mem pays it
 * once instead (plugins/nixl/README.md, "The first request to a peer");
 * on bare metal the pass is about 0.07 us a page. */
uint64_t kvp_prefault_for_kernel(uint64_t addr, uint64_t len);

/* ------------------------------------------------------------------------ */
/* Ranges                                                                   */
/* ------------------------------------------------------------------------ */

/* Strided extent: count blocks of len bytes, stride apart, from addr. Sets
 * *end to one past the last byte of the last block and returns 1; returns 0
 * when len or count is 0 or the arithmetic overflows 64 bits. count == 1
 * ignores stride. */
int kvp_strided_end(uint64_t addr, uint64_t len, uint64_t stride, uint64_t count,
                    uint64_t *end);

/* 1 if every block of (addr, len, stride, count) lies inside
 * [base, base + size); 0 otherwise, including on overflow or len/count 0. */
int kvp_strided_in(uint64_t addr, uint64_t len, uint64_t stride, uint64_t count,
                   uint64_t base, uint64_t size);

/* A range table is an array of elements that each START with these two
 * fields (kvp_mem_desc does; plugins may append their own), sorted by addr
 * and non-overlapping; elem_size is the size of one element. */
typedef struct kvp_range {
  uint64_t addr;
  uint64_t len;
} kvp_range;

/* Sorts a range table by addr (qsort; not thread-safe on the same array). */
void kvp_ranges_sort(void *table, size_t n, size_t elem_size);

/* For a sorted table: index of the first element that overlaps its
 * predecessor or whose addr + len overflows, or -1 when all is well. */
long kvp_ranges_check(const void *table, size_t n, size_t elem_size);

/* Index of the element that contains all of [addr, addr + len) (len > 0),
 * or -1. O(log n). */
long kvp_range_find(const void *table, size_t n, size_t elem_size, uint64_t addr,
                    uint64_t len);

/* Index of the element that contains every block of the strided
 * descriptor, when one element does (the common case), else -1; see
 * kvp_strided_each_in for descriptors whose blocks fall in different
 * elements. */
long kvp_range_find_strided(const void *table, size_t n, size_t elem_size, uint64_t addr,
                            uint64_t len, uint64_t stride, uint64_t count);

/* 1 if every block of the strided descriptor lies entirely inside some
 * element (blocks may be in different elements), else 0. Tries the whole
 * extent first, then element by element (time grows with the elements the
 * blocks cross, not with count). If accept is not NULL it is called
 * with each element index that would contain a block and may veto it
 * (return 0), e.g. to demand a matching memory kind; it must be cheap. */
int kvp_strided_each_in(const void *table, size_t n, size_t elem_size, uint64_t addr,
                        uint64_t len, uint64_t stride, uint64_t count,
                        int (*accept)(const void *elem, void *ctx), void *ctx);

/* ------------------------------------------------------------------------ */
/* Output buffers                                                           */
/* ------------------------------------------------------------------------ */

/* The ABI rule for caller-supplied output buffers: *size = n always; the n
 * bytes of src are copied into buf only when n <= cap (buf may be NULL when
 * cap is 0). Returns 1 if copied, 0 if not. */
int kvp_out_bytes(uint8_t *buf, size_t cap, const void *src, size_t n, size_t *size);

/* Little-endian load/store helpers for wire formats. */
void kvp_put_u16(uint8_t *p, uint16_t v);
void kvp_put_u32(uint8_t *p, uint32_t v);
void kvp_put_u64(uint8_t *p, uint64_t v);
uint16_t kvp_get_u16(const uint8_t *p);
uint32_t kvp_get_u32(const uint8_t *p);
uint64_t kvp_get_u64(const uint8_t *p);

/* A bounds-checked reader over a byte string. Each get returns 1 and
 * advances, or returns 0 (and leaves *out untouched) when fewer bytes are
 * left; after a failure every later get fails too, so a decoder may check
 * r.ok once at the end. */
typedef struct kvp_reader {
  const uint8_t *p;
  size_t left;
  int ok;
} kvp_reader;

void kvp_reader_init(kvp_reader *r, const uint8_t *p, size_t len);
int kvp_read_u16(kvp_reader *r, uint16_t *out);
int kvp_read_u32(kvp_reader *r, uint32_t *out);
int kvp_read_u64(kvp_reader *r, uint64_t *out);
/* Points *out at the next n bytes (no copy). */
int kvp_read_bytes(kvp_reader *r, size_t n, const uint8_t **out);

/* ------------------------------------------------------------------------ */
/* Notification queue                                                       */
/* ------------------------------------------------------------------------ */

/* Received notifications of one agent, waiting for get_notifs. Records are
 * kept per sender in arrival order; senders are ordered by the arrival of
 * their oldest queued record. kvp_nq_drain writes them in the record format
 * of kvp_get_notifs_args (KVP_NOTIF_RECORD_HEADER bytes: u32 sender_len,
 * u32 msg_len, little endian; then sender, then message). */
typedef struct kvp_notif_queue kvp_notif_queue;

/* max_bytes bounds the queued record bytes (0: unbounded); a push that
 * would exceed it fails, so a peer that floods an agent nobody drains
 * cannot exhaust memory. NULL on OOM. */
kvp_notif_queue *kvp_nq_create(size_t max_bytes);
void kvp_nq_destroy(kvp_notif_queue *q);

/* Appends a copy of (sender, msg). sender_len 1..KVP_MAX_NAME_LEN; msg may
 * be empty (msg NULL when msg_len is 0) and at most UINT32_MAX bytes.
 * Errors: KVP_ERR_INVALID_PARAM for bad lengths, KVP_ERR_BACKEND when the
 * queue is full, out of memory. */
kvp_error *kvp_nq_push(kvp_notif_queue *q, const char *sender, size_t sender_len,
                       const uint8_t *msg, size_t msg_len);

/* Moves whole records into buf (capacity cap; buf may be NULL when cap is
 * 0): senders in order, each sender's records oldest first and adjacent.
 * Stops at the first record that does not fit; it and all later ones stay
 * queued. Out: *size bytes written, *count records written, *needed the
 * size of the record that did not fit (0 when the queue was emptied). */
void kvp_nq_drain(kvp_notif_queue *q, uint8_t *buf, size_t cap, size_t *size, size_t *count,
                  size_t *needed);

/* Queued records (for tests). */
size_t kvp_nq_len(kvp_notif_queue *q);

#ifdef __cplusplus
}
#endif

#endif /* KVP_UTIL_H */
