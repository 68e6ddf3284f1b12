/*
 * A minimal plugin for host/plugin's loader tests, compiled by the tests in
 * variants (-D flags below). It moves no bytes: the fake plugin does that.
 *
 *   TP_MAJOR_MIN / TP_MAJOR_MAX  ABI majors served (default 1..1)
 *   TP_INFO_MAJOR                ABI major plugin_info reports (default 1)
 *   TP_CAPS                      capability bits (default PREPPED|BATCH|REMOTE_ADDR)
 *   TP_NULL_POST                 leave post_xfer NULL
 *   TP_NO_ENTRY                  do not export the entry symbol
 *   TP_SMALL_TABLE               report a struct_size smaller than ABI 1.0's
 *   TP_WORKING                   transfer functions succeed and count calls (see below)
 *   TP_BAD_NOTIFS=n              get_notifs misbehaves: 1 says a record of 16 bytes is
 *                                queued but copies nothing whatever the buffer; 2 asks for
 *                                one byte more than each buffer it is given
 *
 * agent_create fails with KVP_ERR_INVALID_PARAM "unknown parameter <key>"
 * for a parameter other than agent_caps and alpha; agent_caps=<decimal> sets the caps
 * the agent reports. Other functions fail with KVP_ERR_NOT_SUPPORTED.
 * testplugin_live_errors() counts error objects not yet destroyed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvplugin.h"

#ifndef TP_MAJOR_MIN
#define TP_MAJOR_MIN 1
#endif
#ifndef TP_MAJOR_MAX
#define TP_MAJOR_MAX 1
#endif
#ifndef TP_INFO_MAJOR
#define TP_INFO_MAJOR 1
#endif
#ifndef TP_CAPS
#define TP_CAPS (KVP_CAP_PREPPED | KVP_CAP_BATCH | KVP_CAP_REMOTE_ADDR)
#endif

struct kvp_error {
  kvp_status code;
  char msg[128];
};

static int live_errors;
static int agents_destroyed;

KVP_EXPORT int testplugin_live_errors(void) { return live_errors; }
KVP_EXPORT int testplugin_agents_destroyed(void) { return agents_destroyed; }

static kvp_error *mkerr(kvp_status code, const char *msg, size_t len) {
  kvp_error *e = calloc(1, sizeof *e);
  e->code = code;
  if (len >= sizeof e->msg) len = sizeof e->msg - 1;
  memcpy(e->msg, msg, len);
  __atomic_add_fetch(&live_errors, 1, __ATOMIC_SEQ_CST);
  return e;
}

static void err_destroy(kvp_error_destroy_args *a) {
  if (a->error) {
    free(a->error);
    __atomic_sub_fetch(&live_errors, 1, __ATOMIC_SEQ_CST);
  }
}
static void err_message(kvp_error_message_args *a) {
  a->message = a->error->msg;
  a->message_len = strlen(a->error->msg);
}
static void err_code(kvp_error_code_args *a) { a->code = a->error->code; }

static kvp_error *info(kvp_plugin_info_args *a) {
  a->name = "testplugin";
  a->version = "0.0.1-test";
  a->params_doc = "agent_caps=\tcapabilities the agent reports\nalpha=1\tfirst parameter\n";
  a->abi_major = TP_INFO_MAJOR;
  a->abi_minor = 0;
  a->caps = TP_CAPS;
  a->mem_kinds = KVP_MEM_BIT(KVP_MEM_DRAM) | KVP_MEM_BIT(KVP_MEM_VRAM);
  return NULL;
}

static kvp_error *agent_create(kvp_agent_create_args *a) {
  uint64_t caps = TP_CAPS;
  for (size_t i = 0; i < a->num_params; i++) {
    const kvp_param *p = &a->params[i];
    if (p->key_len == 10 && memcmp(p->key, "agent_caps", 10) == 0) {
      char buf[32] = {0};
      memcpy(buf, p->value, p->value_len < 31 ? p->value_len : 31);
      caps = strtoull(buf, NULL, 10);
      continue;
    }
    if (p->key_len == 5 && memcmp(p->key, "alpha", 5) == 0) continue;
    char msg[96];
    int n = snprintf(msg, sizeof msg, "unknown parameter %.*s", (int)p->key_len, p->key);
    return mkerr(KVP_ERR_INVALID_PARAM, msg, (size_t)n);
  }
  a->agent = 7;
  a->caps = caps;
  return NULL;
}

static kvp_error *agent_destroy(kvp_agent_destroy_args *a) {
  if (a->agent != 7) return mkerr(KVP_ERR_INVALID_PARAM, "unknown agent", 13);
  agents_destroyed++;
  return NULL;
}

#ifdef TP_WORKING
/* TP_WORKING: the transfer functions succeed without touching memory and
 * count their calls, so tests can see exactly which calls the host makes.
 * testplugin_calls(i) is the count of function i (the enum below);
 * testplugin_last(j) the last call's item count (0), pair count (1) and
 * number of strided descriptors or entries (2). testplugin_refuse(i, code)
 * makes the next call of function i fail with code (once; the call is
 * counted and changes nothing), as a plugin refuses a release: MORI-IO and
 * NIXL keep a transfer still in flight after their release timeout, and a
 * plugin that tracks use refuses deregister_mem or release_dlist with
 * KVP_ERR_NOT_ALLOWED. */
enum { C_REGISTER, C_DEREGISTER, C_IMPORT, C_RELEASE_RR, C_PREP, C_RELEASE_DLIST, C_MAKE_PREPPED,
       C_MAKE_BATCH, C_POST, C_POLL, C_RELEASE_XFER, C_NCALLS };
static int calls[C_NCALLS];
static kvp_status refuse[C_NCALLS];
static uint64_t last[3];
static uint64_t next_handle = 1000;
KVP_EXPORT int testplugin_calls(int i) { return __atomic_load_n(&calls[i], __ATOMIC_SEQ_CST); }
KVP_EXPORT uint64_t testplugin_last(int i) { return last[i]; }
KVP_EXPORT void testplugin_refuse(int i, int code) { __atomic_store_n(&refuse[i], code, __ATOMIC_SEQ_CST); }
static void count(int i) { __atomic_add_fetch(&calls[i], 1, __ATOMIC_SEQ_CST); }
/* Counts a call of function i and returns the armed refusal, if any. */
static kvp_error *count_or_refuse(int i, const char *msg) {
  count(i);
  kvp_status code = __atomic_exchange_n(&refuse[i], 0, __ATOMIC_SEQ_CST);
  return code ? mkerr(code, msg, strlen(msg)) : NULL;
}
static uint64_t handle(void) { return __atomic_add_fetch(&next_handle, 1, __ATOMIC_SEQ_CST); }

static kvp_error *w_register(kvp_register_mem_args *a) {
  count(C_REGISTER);
  for (size_t i = 0; i < a->num_descs; i++) a->regions[i] = handle();
  return NULL;
}
static kvp_error *w_deregister(kvp_deregister_mem_args *a) {
  (void)a;
  return count_or_refuse(C_DEREGISTER, "region used by a transfer");
}
static kvp_error *w_metadata(kvp_local_metadata_args *a) {
  a->size = 4;
  if (a->cap >= 4) memcpy(a->buf, "tpmd", 4);
  return NULL;
}
static kvp_error *w_load(kvp_load_remote_args *a) {
  a->peer_name = "peer";
  a->peer_name_len = 4;
  return NULL;
}
static kvp_error *w_import(kvp_remote_region_import_args *a) {
  count(C_IMPORT);
  if (a->blob) return mkerr(KVP_ERR_NOT_SUPPORTED, "no blobs", 8);
  a->rregion = handle();
  return NULL;
}
static kvp_error *w_release_rr(kvp_remote_region_release_args *a) {
  (void)a;
  return count_or_refuse(C_RELEASE_RR, "remote region in use");
}
static kvp_error *w_prep(kvp_prep_dlist_args *a) {
  count(C_PREP);
  last[0] = a->num_descs;
  last[2] = 0;
  for (size_t i = 0; i < a->num_descs; i++) last[2] += a->descs[i].count > 1;
  a->dlist = handle();
  return NULL;
}
static kvp_error *w_release_dlist(kvp_release_dlist_args *a) {
  (void)a;
  return count_or_refuse(C_RELEASE_DLIST, "dlist used by a transfer");
}
static kvp_error *w_make_prepped(kvp_make_prepped_xfer_args *a) {
  count(C_MAKE_PREPPED);
  last[0] = a->num_local_indices;
  a->xfer = handle();
  return NULL;
}
static kvp_error *w_make_batch(kvp_make_batch_xfer_args *a) {
  count(C_MAKE_BATCH);
  last[0] = a->num_entries;
  last[1] = a->num_pairs;
  last[2] = 0;
  for (size_t i = 0; i < a->num_entries; i++) last[2] += a->entries[i].count > 1;
  a->xfer = handle();
  return NULL;
}
static kvp_error *w_post(kvp_post_xfer_args *a) { count(C_POST); a->status = KVP_SUCCESS; return NULL; }
static kvp_error *w_poll(kvp_poll_xfer_args *a) { count(C_POLL); a->status = KVP_SUCCESS; return NULL; }
static kvp_error *w_release_xfer(kvp_release_xfer_args *a) {
  (void)a;
  return count_or_refuse(C_RELEASE_XFER, "transfer still in flight; release it again later");
}
#define FN(working, fallback) working
#else
#define FN(working, fallback) fallback
#endif

#ifdef TP_BAD_NOTIFS
static kvp_error *bad_notifs(kvp_get_notifs_args *a) {
  a->size = 0;
  a->count = 0;
  a->needed = TP_BAD_NOTIFS == 1 ? 16 : a->cap + 1;
  return NULL;
}
static kvp_error *ok_send(kvp_send_notif_args *a) {
  (void)a;
  return NULL;
}
#endif

static kvp_error *unsupported(void *a) {
  (void)a;
  return mkerr(KVP_ERR_NOT_SUPPORTED, "testplugin moves no bytes", 25);
}

#define UNSUP(T) ((kvp_error * (*)(T *)) unsupported)

__attribute__((unused)) static kvp_api api = {
    .struct_size = KVP_API_STRUCT_SIZE,
    .abi_major = TP_MAJOR_MAX,
    .abi_minor = 0,
    .error_destroy = err_destroy,
    .error_message = err_message,
    .error_code = err_code,
    .plugin_info = info,
    .agent_create = agent_create,
    .agent_destroy = agent_destroy,
    .register_mem = FN(w_register, UNSUP(kvp_register_mem_args)),
    .deregister_mem = FN(w_deregister, UNSUP(kvp_deregister_mem_args)),
    .region_export = UNSUP(kvp_region_export_args),
    .local_metadata = FN(w_metadata, UNSUP(kvp_local_metadata_args)),
    .load_remote = FN(w_load, UNSUP(kvp_load_remote_args)),
    .remove_remote = UNSUP(kvp_remove_remote_args),
    .remote_region_import = FN(w_import, UNSUP(kvp_remote_region_import_args)),
    .remote_region_release = FN(w_release_rr, UNSUP(kvp_remote_region_release_args)),
    .prep_dlist = FN(w_prep, UNSUP(kvp_prep_dlist_args)),
    .release_dlist = FN(w_release_dlist, UNSUP(kvp_release_dlist_args)),
    .make_prepped_xfer = FN(w_make_prepped, UNSUP(kvp_make_prepped_xfer_args)),
    .make_batch_xfer = FN(w_make_batch, UNSUP(kvp_make_batch_xfer_args)),
#ifndef TP_NULL_POST
    .post_xfer = FN(w_post, UNSUP(kvp_post_xfer_args)),
#endif
    .poll_xfer = FN(w_poll, UNSUP(kvp_poll_xfer_args)),
    .release_xfer = FN(w_release_xfer, UNSUP(kvp_release_xfer_args)),
    .xfer_telemetry = UNSUP(kvp_xfer_telemetry_args),
#ifdef TP_BAD_NOTIFS
    .get_notifs = bad_notifs,
    .send_notif = ok_send,
#else
    .get_notifs = UNSUP(kvp_get_notifs_args),
    .send_notif = UNSUP(kvp_send_notif_args),
#endif
};

#ifndef TP_NO_ENTRY
KVP_EXPORT kvp_status kvp_plugin_get_api(kvp_get_api_args *a) {
  a->plugin_abi_major_min = TP_MAJOR_MIN;
  a->plugin_abi_major_max = TP_MAJOR_MAX;
#ifdef TP_SMALL_TABLE
  api.struct_size = 64;
#endif
  if (a->host_abi_major < TP_MAJOR_MIN || a->host_abi_major > TP_MAJOR_MAX) {
    a->api = NULL;
    return KVP_ERR_NOT_SUPPORTED;
  }
  a->api = &api;
  return KVP_SUCCESS;
}
#endif
