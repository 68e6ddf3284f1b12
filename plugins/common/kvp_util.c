/*
 * kvp_util.c: see kvp_util.h. C11; also compiles as C++17 (no <stdatomic.h>,
 * no implicit void* conversions, no flexible array members).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include "kvp_util.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* Errors                                                                   */
/* ------------------------------------------------------------------------ */

/* The message is allocated in the same block, right after the struct. */
struct kvp_error {
  kvp_status code;
  size_t len;
  char *msg;
};

static char oom_text[] = "out of memory";
static struct kvp_error oom_error = {KVP_ERR_BACKEND, sizeof(oom_text) - 1, oom_text};

kvp_error *kvp_err_oom(void) { return &oom_error; }

static kvp_error *err_vnew(kvp_status code, const char *prefix, const char *fmt, va_list ap) {
  char stack[512];
  va_list ap2;
  va_copy(ap2, ap);
  int n = vsnprintf(stack, sizeof stack, fmt, ap2);
  va_end(ap2);
  if (n < 0) {
    n = 0;
    stack[0] = 0;
  }
  size_t plen = prefix ? strlen(prefix) + 2 : 0; /* "<prefix>: " */
  size_t body = (size_t)n;
  int cut = 0;
  if (plen + body > KVP_ERR_MAX_MESSAGE) {
    cut = 1;
    body = plen >= KVP_ERR_MAX_MESSAGE - 3 ? 0 : KVP_ERR_MAX_MESSAGE - 3 - plen;
  }
  size_t len = plen + body + (cut ? 3 : 0);
  kvp_error *e = (kvp_error *)malloc(sizeof(kvp_error) + len + 1);
  if (!e) return kvp_err_oom();
  e->code = code < 0 ? code : KVP_ERR_UNKNOWN;
  e->len = len;
  e->msg = (char *)(e + 1);
  char *p = e->msg;
  if (prefix) {
    memcpy(p, prefix, plen - 2);
    memcpy(p + plen - 2, ": ", 2);
    p += plen;
  }
  if (body < sizeof stack) {
    memcpy(p, stack, body);
  } else {
    /* Longer than the stack buffer: format again into place. */
    va_copy(ap2, ap);
    char *tmp = (char *)malloc((size_t)n + 1);
    if (tmp) {
      vsnprintf(tmp, (size_t)n + 1, fmt, ap2);
      memcpy(p, tmp, body);
      free(tmp);
    } else {
      memset(p, '?', body);
    }
    va_end(ap2);
  }
  p += body;
  if (cut) {
    memcpy(p, "...", 3);
    p += 3;
  }
  *p = 0;
  return e;
}

kvp_error *kvp_err(kvp_status code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kvp_error *e = err_vnew(code, NULL, fmt, ap);
  va_end(ap);
  return e;
}

kvp_error *kvp_err_wrap(kvp_error *inner, const char *fmt, ...) {
  if (!inner) return NULL;
  char prefix[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  kvp_error *e = kvp_err(inner->code, "%s: %s", prefix, inner->msg);
  if (e == kvp_err_oom()) return inner; /* keep the original rather than lose it */
  kvp_err_free(inner);
  return e;
}

kvp_status kvp_err_code(const kvp_error *e) { return e ? e->code : KVP_SUCCESS; }

const char *kvp_err_message(const kvp_error *e, size_t *len) {
  if (!e) {
    if (len) *len = 0;
    return "";
  }
  if (len) *len = e->len;
  return e->msg;
}

void kvp_err_free(kvp_error *e) {
  if (e && e != &oom_error) free(e);
}

void kvp_util_error_destroy(kvp_error_destroy_args *args) {
  if (!args || args->struct_size < KVP_ERROR_DESTROY_ARGS_STRUCT_SIZE) return;
  kvp_err_free(args->error);
}

void kvp_util_error_message(kvp_error_message_args *args) {
  if (!args || args->struct_size < KVP_ERROR_MESSAGE_ARGS_STRUCT_SIZE) return;
  args->message = kvp_err_message(args->error, &args->message_len);
}

void kvp_util_error_code(kvp_error_code_args *args) {
  if (!args || args->struct_size < KVP_ERROR_CODE_ARGS_STRUCT_SIZE) return;
  args->code = args->error ? args->error->code : KVP_ERR_UNKNOWN;
}

kvp_status kvp_util_get_api(kvp_get_api_args *args, uint32_t major, const kvp_api *api) {
  if (!args || args->struct_size < KVP_GET_API_ARGS_STRUCT_SIZE) return KVP_ERR_INVALID_PARAM;
  args->plugin_abi_major_min = major;
  args->plugin_abi_major_max = major;
  if (args->host_abi_major != major) {
    args->api = NULL;
    return KVP_ERR_NOT_SUPPORTED;
  }
  args->api = api;
  return KVP_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* Args validation                                                          */
/* ------------------------------------------------------------------------ */

kvp_error *kvp_check_args(const void *args, size_t min_size, const char *fn) {
  if (!args) return kvp_err(KVP_ERR_INVALID_PARAM, "%s: args is NULL", fn);
  size_t sz;
  memcpy(&sz, args, sizeof sz);
  if (sz < min_size)
    return kvp_err(KVP_ERR_INVALID_PARAM,
                   "%s: args struct_size is %zu, this plugin needs at least %zu", fn, sz,
                   min_size);
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* Handle table                                                             */
/* ------------------------------------------------------------------------ */

/* Lookups take no lock: each slot keeps its generation, state and reference
 * count in one 64-bit word that acquire and put change with one
 * compare-and-swap (GCC/Clang __atomic builtins, which C11 and C++17 both
 * accept). The mutex serialises only insert and remove (the free list,
 * chunk growth, the live count) and the wait of a remove for the last
 * reference; put takes it only to wake that wait.
 *
 * Slot word: generation << 32 | HT_LIVE | HT_REMOVING | references. An
 * inserted slot is LIVE; remove sets REMOVING (acquire fails from then on),
 * waits until the references are 0, then stores the next generation with
 * neither flag (free). A handle matches a slot when its generation equals
 * the word's. */
#define HT_CHUNK_BITS 10u
#define HT_CHUNK (1u << HT_CHUNK_BITS)
#define HT_MAX_CHUNKS (KVP_HT_MAX_ENTRIES / HT_CHUNK)
#define HT_INDEX_MASK (KVP_HT_MAX_ENTRIES - 1u)

#define HT_LIVE (1ull << 31)
#define HT_REMOVING (1ull << 30)
#define HT_REFS ((1ull << 30) - 1u)

typedef struct ht_slot {
  uint64_t word;      /* atomic: see above */
  void *obj;          /* set before the word turns LIVE; stable while LIVE */
  uint32_t next_free; /* index + 1 of the next free slot; 0 ends the list; under mu */
} ht_slot;

struct kvp_htable {
  uint8_t tag;
  pthread_mutex_t mu;
  pthread_cond_t cv;  /* signalled when a removing slot's refs drop to 0 */
  uint32_t nslots;    /* slots ever handed out; under mu */
  uint32_t free_head; /* index + 1; 0: none */
  uint32_t free_tail;
  size_t live;
  ht_slot *chunks[HT_MAX_CHUNKS]; /* atomic loads: set once (release) under mu */
};

kvp_htable *kvp_ht_create(uint8_t tag) {
  if (tag == 0) return NULL;
  kvp_htable *t = (kvp_htable *)calloc(1, sizeof *t);
  if (!t) return NULL;
  pthread_mutex_init(&t->mu, NULL);
  pthread_cond_init(&t->cv, NULL);
  t->tag = tag;
  return t;
}

void kvp_ht_destroy(kvp_htable *t) {
  if (!t) return;
  for (uint32_t c = 0; c < HT_MAX_CHUNKS && t->chunks[c]; c++) free(t->chunks[c]);
  pthread_cond_destroy(&t->cv);
  pthread_mutex_destroy(&t->mu);
  free(t);
}

static ht_slot *ht_slot_at(kvp_htable *t, uint32_t idx) {
  return &t->chunks[idx >> HT_CHUNK_BITS][idx & (HT_CHUNK - 1u)];
}

static uint64_t ht_handle(const kvp_htable *t, uint32_t idx, uint32_t gen) {
  return ((uint64_t)gen << 32) | ((uint64_t)t->tag << 24) | idx;
}

/* The slot a handle names if its tag is this table's and its slot exists
 * (the generation is checked against the slot word by the caller), else
 * NULL. Takes no lock. */
static ht_slot *ht_slot_of(kvp_htable *t, uint64_t handle) {
  uint32_t low = (uint32_t)handle;
  if (!t || (handle >> 32) == 0 || (low >> 24) != t->tag) return NULL;
  uint32_t idx = low & HT_INDEX_MASK;
  ht_slot *chunk = __atomic_load_n(&t->chunks[idx >> HT_CHUNK_BITS], __ATOMIC_ACQUIRE);
  return chunk ? &chunk[idx & (HT_CHUNK - 1u)] : NULL;
}

static int ht_gen_is(uint64_t word, uint64_t handle) { return (word >> 32) == (handle >> 32); }

kvp_error *kvp_ht_insert(kvp_htable *t, void *obj, uint64_t *handle) {
  if (!t || !obj || !handle) return kvp_err(KVP_ERR_INVALID_PARAM, "kvp_ht_insert: NULL argument");
  pthread_mutex_lock(&t->mu);
  uint32_t idx;
  if (t->free_head) {
    /* FIFO reuse: a freed slot waits behind the others, so a stale handle
     * meets a different generation for as long as possible. */
    idx = t->free_head - 1;
    ht_slot *s = ht_slot_at(t, idx);
    t->free_head = s->next_free;
    if (!t->free_head) t->free_tail = 0;
  } else {
    if (t->nslots >= KVP_HT_MAX_ENTRIES) {
      pthread_mutex_unlock(&t->mu);
      return kvp_err(KVP_ERR_BACKEND, "handle table full (%u live handles)",
                     (unsigned)KVP_HT_MAX_ENTRIES);
    }
    idx = t->nslots;
    uint32_t c = idx >> HT_CHUNK_BITS;
    if (!t->chunks[c]) {
      ht_slot *chunk = (ht_slot *)calloc(HT_CHUNK, sizeof(ht_slot));
      if (!chunk) {
        pthread_mutex_unlock(&t->mu);
        return kvp_err_oom();
      }
      for (uint32_t i = 0; i < HT_CHUNK; i++) chunk[i].word = 1ull << 32; /* generation 1, free */
      __atomic_store_n(&t->chunks[c], chunk, __ATOMIC_RELEASE);
    }
    t->nslots++;
  }
  ht_slot *s = ht_slot_at(t, idx);
  s->obj = obj;
  s->next_free = 0;
  uint64_t gen = __atomic_load_n(&s->word, __ATOMIC_RELAXED) >> 32;
  __atomic_store_n(&s->word, (gen << 32) | HT_LIVE, __ATOMIC_RELEASE); /* publishes obj */
  t->live++;
  *handle = ht_handle(t, idx, (uint32_t)gen);
  pthread_mutex_unlock(&t->mu);
  return NULL;
}

void *kvp_ht_acquire(kvp_htable *t, uint64_t handle) {
  ht_slot *s = ht_slot_of(t, handle);
  if (!s) return NULL;
  uint64_t w = __atomic_load_n(&s->word, __ATOMIC_RELAXED);
  do {
    if (!ht_gen_is(w, handle) || (w & (HT_LIVE | HT_REMOVING)) != HT_LIVE || (w & HT_REFS) == HT_REFS)
      return NULL;
  } while (!__atomic_compare_exchange_n(&s->word, &w, w + 1, 1, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED));
  return s->obj;
}

void kvp_ht_put(kvp_htable *t, uint64_t handle) {
  ht_slot *s = ht_slot_of(t, handle);
  if (!s) return;
  uint64_t w = __atomic_load_n(&s->word, __ATOMIC_RELAXED);
  do {
    if (!ht_gen_is(w, handle) || !(w & HT_LIVE) || (w & HT_REFS) == 0) return; /* stray put */
  } while (!__atomic_compare_exchange_n(&s->word, &w, w - 1, 1, __ATOMIC_RELEASE, __ATOMIC_RELAXED));
  if ((w & HT_REMOVING) && (w & HT_REFS) == 1) {
    /* The last reference of a slot being removed: wake the remover, which
     * checks the count under mu before it waits. */
    pthread_mutex_lock(&t->mu);
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
  }
}

void *kvp_ht_remove(kvp_htable *t, uint64_t handle) {
  ht_slot *s = ht_slot_of(t, handle);
  if (!s) return NULL;
  pthread_mutex_lock(&t->mu);
  uint64_t w = __atomic_load_n(&s->word, __ATOMIC_RELAXED);
  do {
    if (!ht_gen_is(w, handle) || (w & (HT_LIVE | HT_REMOVING)) != HT_LIVE) {
      pthread_mutex_unlock(&t->mu);
      return NULL;
    }
  } while (!__atomic_compare_exchange_n(&s->word, &w, w | HT_REMOVING, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED));
  while (__atomic_load_n(&s->word, __ATOMIC_ACQUIRE) & HT_REFS) pthread_cond_wait(&t->cv, &t->mu);
  void *obj = s->obj;
  uint32_t idx = (uint32_t)handle & HT_INDEX_MASK;
  uint32_t gen = (uint32_t)(handle >> 32) + 1u;
  if (gen == 0) gen = 1;
  s->obj = NULL;
  s->next_free = 0;
  __atomic_store_n(&s->word, (uint64_t)gen << 32, __ATOMIC_RELEASE); /* free: the handle is stale */
  if (t->free_tail)
    ht_slot_at(t, t->free_tail - 1)->next_free = idx + 1;
  else
    t->free_head = idx + 1;
  t->free_tail = idx + 1;
  t->live--;
  pthread_mutex_unlock(&t->mu);
  return obj;
}

size_t kvp_ht_count(kvp_htable *t) {
  if (!t) return 0;
  pthread_mutex_lock(&t->mu);
  size_t n = t->live;
  pthread_mutex_unlock(&t->mu);
  return n;
}

/* ------------------------------------------------------------------------ */
/* Agent parameters                                                         */
/* ------------------------------------------------------------------------ */

int kvp_str_eq(const char *s, size_t len, const char *lit) {
  size_t n = strlen(lit);
  return n == len && (n == 0 || memcmp(s, lit, n) == 0);
}

static int str_ieq(const char *s, size_t len, const char *lit) {
  size_t n = strlen(lit);
  if (n != len) return 0;
  for (size_t i = 0; i < n; i++)
    if (tolower((unsigned char)s[i]) != tolower((unsigned char)lit[i])) return 0;
  return 1;
}

const kvp_param *kvp_param_find(const kvp_param *params, size_t n, const char *key) {
  if (!params) return NULL;
  const kvp_param *found = NULL;
  for (size_t i = 0; i < n; i++)
    if (params[i].key && kvp_str_eq(params[i].key, params[i].key_len, key)) found = &params[i];
  return found;
}

/* Writes the known names as "a, b, c" into buf. */
static void join_names(char *buf, size_t cap, const char *const *names, size_t n) {
  size_t used = 0;
  buf[0] = 0;
  for (size_t i = 0; i < n && used < cap; i++) {
    int w = snprintf(buf + used, cap - used, "%s%s", i ? ", " : "", names[i]);
    if (w < 0) break;
    used += (size_t)w;
  }
}

/* A printable, bounded rendering of a (s, len) string for messages. */
#define SHOW_MAX 64
static int show_len(size_t len) { return (int)(len > SHOW_MAX ? SHOW_MAX : len); }
static const char *show_more(size_t len) { return len > SHOW_MAX ? "..." : ""; }

kvp_error *kvp_params_check(const kvp_param *params, size_t n, const char *const *known,
                            size_t nknown, int pass_unknown) {
  if (n > 0 && !params)
    return kvp_err(KVP_ERR_INVALID_PARAM, "params is NULL but num_params is %zu", n);
  for (size_t i = 0; i < n; i++) {
    const kvp_param *p = &params[i];
    if ((!p->key && p->key_len) || (!p->value && p->value_len))
      return kvp_err(KVP_ERR_INVALID_PARAM, "param %zu: NULL pointer with non-zero length", i);
    if (!p->key || p->key_len == 0)
      return kvp_err(KVP_ERR_INVALID_PARAM, "param %zu: empty key", i);
    for (size_t j = 0; j < i; j++) {
      if (params[j].key_len == p->key_len && memcmp(params[j].key, p->key, p->key_len) == 0)
        return kvp_err(KVP_ERR_INVALID_PARAM, "param \"%.*s%s\" given twice",
                       show_len(p->key_len), p->key, show_more(p->key_len));
    }
    if (pass_unknown) continue;
    int ok = 0;
    for (size_t k = 0; k < nknown && !ok; k++) ok = kvp_str_eq(p->key, p->key_len, known[k]);
    if (!ok) {
      char names[1024];
      join_names(names, sizeof names, known, nknown);
      return kvp_err(KVP_ERR_INVALID_PARAM, "unknown param \"%.*s%s\" (known: %s)",
                     show_len(p->key_len), p->key, show_more(p->key_len), names);
    }
  }
  return NULL;
}

static kvp_error *bad_value(const char *key, const kvp_param *p, const char *want) {
  return kvp_err(KVP_ERR_INVALID_PARAM, "param %s=\"%.*s%s\": %s", key, show_len(p->value_len),
                 p->value ? p->value : "", show_more(p->value_len), want);
}

/* Parses decimal digits; 0 on empty input, non-digits or overflow. */
static int parse_digits(const char *s, size_t len, uint64_t *out) {
  if (len == 0) return 0;
  uint64_t v = 0;
  for (size_t i = 0; i < len; i++) {
    if (s[i] < '0' || s[i] > '9') return 0;
    uint64_t d = (uint64_t)(s[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return 0;
    v = v * 10 + d;
  }
  *out = v;
  return 1;
}

kvp_error *kvp_param_u64(const kvp_param *params, size_t n, const char *key, uint64_t def,
                         uint64_t lo, uint64_t hi, uint64_t *out) {
  const kvp_param *p = kvp_param_find(params, n, key);
  if (!p) {
    *out = def;
    return NULL;
  }
  uint64_t v;
  char want[128];
  if (!p->value && p->value_len) return kvp_err(KVP_ERR_INVALID_PARAM, "param %s: NULL value", key);
  snprintf(want, sizeof want, "want an unsigned integer in [%llu, %llu]",
           (unsigned long long)lo, (unsigned long long)hi);
  if (!parse_digits(p->value, p->value_len, &v) || v < lo || v > hi) return bad_value(key, p, want);
  *out = v;
  return NULL;
}

kvp_error *kvp_param_i64(const kvp_param *params, size_t n, const char *key, int64_t def,
                         int64_t lo, int64_t hi, int64_t *out) {
  const kvp_param *p = kvp_param_find(params, n, key);
  if (!p) {
    *out = def;
    return NULL;
  }
  char want[128];
  snprintf(want, sizeof want, "want an integer in [%lld, %lld]", (long long)lo, (long long)hi);
  if (!p->value && p->value_len) return kvp_err(KVP_ERR_INVALID_PARAM, "param %s: NULL value", key);
  const char *s = p->value;
  size_t len = p->value_len;
  int neg = 0;
  if (len > 0 && (s[0] == '-' || s[0] == '+')) {
    neg = s[0] == '-';
    s++;
    len--;
  }
  uint64_t mag;
  if (!parse_digits(s, len, &mag)) return bad_value(key, p, want);
  int64_t v;
  if (neg) {
    if (mag > (uint64_t)INT64_MAX + 1u) return bad_value(key, p, want);
    v = mag == (uint64_t)INT64_MAX + 1u ? INT64_MIN : -(int64_t)mag;
  } else {
    if (mag > (uint64_t)INT64_MAX) return bad_value(key, p, want);
    v = (int64_t)mag;
  }
  if (v < lo || v > hi) return bad_value(key, p, want);
  *out = v;
  return NULL;
}

kvp_error *kvp_param_double(const kvp_param *params, size_t n, const char *key, double def,
                            double lo, double hi, double *out) {
  const kvp_param *p = kvp_param_find(params, n, key);
  if (!p) {
    *out = def;
    return NULL;
  }
  char want[128];
  snprintf(want, sizeof want, "want a number in [%g, %g]", lo, hi);
  char buf[64];
  if (!p->value || p->value_len == 0 || p->value_len >= sizeof buf) return bad_value(key, p, want);
  memcpy(buf, p->value, p->value_len);
  buf[p->value_len] = 0;
  if (isspace((unsigned char)buf[0])) return bad_value(key, p, want);
  char *end = NULL;
  errno = 0;
  double v = strtod(buf, &end);
  if (end != buf + p->value_len || errno == ERANGE || !isfinite(v) || v < lo || v > hi)
    return bad_value(key, p, want);
  *out = v;
  return NULL;
}

kvp_error *kvp_param_bool(const kvp_param *params, size_t n, const char *key, int def,
                          int *out) {
  const kvp_param *p = kvp_param_find(params, n, key);
  if (!p) {
    *out = def;
    return NULL;
  }
  if (!p->value && p->value_len) return kvp_err(KVP_ERR_INVALID_PARAM, "param %s: NULL value", key);
  static const char *const yes[] = {"1", "true", "yes", "on"};
  static const char *const no[] = {"0", "false", "no", "off"};
  for (size_t i = 0; i < 4; i++) {
    if (str_ieq(p->value, p->value_len, yes[i])) {
      *out = 1;
      return NULL;
    }
    if (str_ieq(p->value, p->value_len, no[i])) {
      *out = 0;
      return NULL;
    }
  }
  return bad_value(key, p, "want a boolean (1/0, true/false, yes/no, on/off)");
}

int kvp_list_next(const char *s, size_t len, size_t *pos, const char **item, size_t *item_len) {
  if (len == 0 || *pos > len) return 0;
  size_t start = *pos;
  size_t end = start;
  while (end < len && s[end] != ',') end++;
  *pos = end + 1; /* past the comma; len + 1 once the last item is out */
  while (start < end && isspace((unsigned char)s[start])) start++;
  while (end > start && isspace((unsigned char)s[end - 1])) end--;
  *item = s + start;
  *item_len = end - start;
  return 1;
}

kvp_error *kvp_param_name_mask(const kvp_param *params, size_t n, const char *key,
                               const char *const *names, size_t nnames, uint64_t *mask) {
  *mask = 0;
  if (nnames > 64) return kvp_err(KVP_ERR_INVALID_PARAM, "kvp_param_name_mask: too many names");
  const kvp_param *p = kvp_param_find(params, n, key);
  if (!p || p->value_len == 0) return NULL;
  if (!p->value) return kvp_err(KVP_ERR_INVALID_PARAM, "param %s: NULL value", key);
  uint64_t m = 0;
  size_t pos = 0;
  const char *it;
  size_t il;
  while (kvp_list_next(p->value, p->value_len, &pos, &it, &il)) {
    size_t k = 0;
    while (k < nnames && !kvp_str_eq(it, il, names[k])) k++;
    if (k == nnames) {
      char list[1024];
      join_names(list, sizeof list, names, nnames);
      return kvp_err(KVP_ERR_INVALID_PARAM, "param %s=\"%.*s%s\": unknown item \"%.*s%s\" (want a comma list of: %s)",
                     key, show_len(p->value_len), p->value, show_more(p->value_len), show_len(il),
                     it, show_more(il), list);
    }
    m |= 1ull << k;
  }
  *mask = m;
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* Ranges                                                                   */
/* ------------------------------------------------------------------------ */

int kvp_strided_end(uint64_t addr, uint64_t len, uint64_t stride, uint64_t count,
                    uint64_t *end) {
  if (len == 0 || count == 0) return 0;
  uint64_t last = addr;
  if (count > 1) {
    uint64_t span;
    if (stride != 0 && count - 1 > UINT64_MAX / stride) return 0;
    span = (count - 1) * stride;
    if (span > UINT64_MAX - addr) return 0;
    last = addr + span;
  }
  if (len > UINT64_MAX - last) return 0;
  *end = last + len;
  return 1;
}

int kvp_strided_in(uint64_t addr, uint64_t len, uint64_t stride, uint64_t count,
                   uint64_t base, uint64_t size) {
  uint64_t end;
  if (!kvp_strided_end(addr, len, stride, count, &end)) return 0;
  /* Written with subtractions so base + size may not be computed at all. */
  return addr >= base && end - base <= size;
}

static const kvp_range *range_at(const void *table, size_t i, size_t elem_size) {
  return (const kvp_range *)((const char *)table + i * elem_size);
}

static int range_cmp(const void *a, const void *b) {
  uint64_t x = ((const kvp_range *)a)->addr, y = ((const kvp_range *)b)->addr;
  return x < y ? -1 : x > y;
}

void kvp_ranges_sort(void *table, size_t n, size_t elem_size) {
  if (n > 1) qsort(table, n, elem_size, range_cmp);
}

long kvp_ranges_check(const void *table, size_t n, size_t elem_size) {
  for (size_t i = 0; i < n; i++) {
    const kvp_range *r = range_at(table, i, elem_size);
    if (r->len > UINT64_MAX - r->addr) return (long)i;
    if (i > 0) {
      const kvp_range *p = range_at(table, i - 1, elem_size);
      if (r->addr < p->addr || r->addr - p->addr < p->len) return (long)i;
    }
  }
  return -1;
}

long kvp_range_find(const void *table, size_t n, size_t elem_size, uint64_t addr,
                    uint64_t len) {
  if (n == 0 || len == 0) return -1;
  /* Last element with start <= addr. */
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (range_at(table, mid, elem_size)->addr <= addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == 0) return -1;
  const kvp_range *r = range_at(table, lo - 1, elem_size);
  uint64_t off = addr - r->addr;
  if (off >= r->len || len > r->len - off) return -1;
  return (long)(lo - 1);
}

long kvp_range_find_strided(const void *table, size_t n, size_t elem_size, uint64_t addr,
                            uint64_t len, uint64_t stride, uint64_t count) {
  uint64_t end;
  if (!kvp_strided_end(addr, len, stride, count, &end)) return -1;
  return kvp_range_find(table, n, elem_size, addr, end - addr);
}

int kvp_strided_each_in(const void *table, size_t n, size_t elem_size, uint64_t addr,
                        uint64_t len, uint64_t stride, uint64_t count,
                        int (*accept)(const void *elem, void *ctx), void *ctx) {
  uint64_t end;
  if (!kvp_strided_end(addr, len, stride, count, &end)) return 0;
  long i = kvp_range_find(table, n, elem_size, addr, end - addr);
  if (i >= 0 && (!accept || accept(range_at(table, (size_t)i, elem_size), ctx))) return 1;
  if (count == 1) return 0;
  /* Element by element, not block by block: count may be huge (a small
   * stride over adjacent elements), but the blocks that follow one found in
   * an element and still end inside it are inside it too. */
  for (uint64_t k = 0; k < count;) {
    uint64_t b = addr + k * stride;
    long j = kvp_range_find(table, n, elem_size, b, len);
    if (j < 0) return 0;
    const kvp_range *r = range_at(table, (size_t)j, elem_size);
    if (accept && !accept(r, ctx)) return 0;
    uint64_t room = r->addr + r->len - (b + len); /* bytes of r after block k */
    uint64_t more = stride ? room / stride : count; /* later blocks inside r */
    if (more >= count - k - 1) return 1;
    k += more + 1;
  }
  return 1;
}

/* ------------------------------------------------------------------------ */
/* Output buffers and wire helpers                                          */
/* ------------------------------------------------------------------------ */

int kvp_out_bytes(uint8_t *buf, size_t cap, const void *src, size_t n, size_t *size) {
  *size = n;
  if (n > cap || (n > 0 && !buf)) return 0;
  if (n > 0) memcpy(buf, src, n);
  return 1;
}

void kvp_put_u16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
void kvp_put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
void kvp_put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
uint16_t kvp_get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
uint32_t kvp_get_u32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
uint64_t kvp_get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

void kvp_reader_init(kvp_reader *r, const uint8_t *p, size_t len) {
  r->p = p;
  r->left = p ? len : 0;
  r->ok = 1;
}

static int reader_take(kvp_reader *r, size_t n, const uint8_t **at) {
  if (!r->ok || r->left < n) {
    r->ok = 0;
    return 0;
  }
  *at = r->p;
  r->p += n;
  r->left -= n;
  return 1;
}

int kvp_read_u16(kvp_reader *r, uint16_t *out) {
  const uint8_t *p;
  if (!reader_take(r, 2, &p)) return 0;
  *out = kvp_get_u16(p);
  return 1;
}
int kvp_read_u32(kvp_reader *r, uint32_t *out) {
  const uint8_t *p;
  if (!reader_take(r, 4, &p)) return 0;
  *out = kvp_get_u32(p);
  return 1;
}
int kvp_read_u64(kvp_reader *r, uint64_t *out) {
  const uint8_t *p;
  if (!reader_take(r, 8, &p)) return 0;
  *out = kvp_get_u64(p);
  return 1;
}
int kvp_read_bytes(kvp_reader *r, size_t n, const uint8_t **out) { return reader_take(r, n, out); }

/* ------------------------------------------------------------------------ */
/* Notification queue                                                       */
/* ------------------------------------------------------------------------ */

/* One queued message; its bytes follow the struct in the same allocation. */
typedef struct nq_rec {
  struct nq_rec *next;
  uint32_t msg_len;
} nq_rec;

/* The queued messages of one sender. */
typedef struct nq_group {
  struct nq_group *next;
  char sender[KVP_MAX_NAME_LEN];
  size_t sender_len;
  nq_rec *head, *tail;
} nq_group;

struct kvp_notif_queue {
  pthread_mutex_t mu;
  nq_group *first, *last; /* by arrival of each group's oldest record */
  size_t nrec;
  size_t bytes; /* record bytes queued (headers included) */
  size_t max_bytes;
};

kvp_notif_queue *kvp_nq_create(size_t max_bytes) {
  kvp_notif_queue *q = (kvp_notif_queue *)calloc(1, sizeof *q);
  if (!q) return NULL;
  pthread_mutex_init(&q->mu, NULL);
  q->max_bytes = max_bytes;
  return q;
}

void kvp_nq_destroy(kvp_notif_queue *q) {
  if (!q) return;
  nq_group *g = q->first;
  while (g) {
    nq_rec *r = g->head;
    while (r) {
      nq_rec *rn = r->next;
      free(r);
      r = rn;
    }
    nq_group *gn = g->next;
    free(g);
    g = gn;
  }
  pthread_mutex_destroy(&q->mu);
  free(q);
}

kvp_error *kvp_nq_push(kvp_notif_queue *q, const char *sender, size_t sender_len,
                       const uint8_t *msg, size_t msg_len) {
  if (!sender || sender_len == 0 || sender_len > KVP_MAX_NAME_LEN)
    return kvp_err(KVP_ERR_INVALID_PARAM, "notification sender name must be 1..%d bytes, got %zu",
                   KVP_MAX_NAME_LEN, sender ? sender_len : 0);
  if ((!msg && msg_len) || msg_len > UINT32_MAX)
    return kvp_err(KVP_ERR_INVALID_PARAM, "notification message: bad pointer or length %zu",
                   msg_len);
  size_t rec_bytes = KVP_NOTIF_RECORD_HEADER + sender_len + msg_len;
  nq_rec *r = (nq_rec *)malloc(sizeof(nq_rec) + (msg_len ? msg_len : 1));
  if (!r) return kvp_err_oom();
  r->next = NULL;
  r->msg_len = (uint32_t)msg_len;
  if (msg_len) memcpy(r + 1, msg, msg_len);

  pthread_mutex_lock(&q->mu);
  if (q->max_bytes && (rec_bytes > q->max_bytes || q->bytes > q->max_bytes - rec_bytes)) {
    size_t used = q->bytes;
    pthread_mutex_unlock(&q->mu);
    free(r);
    return kvp_err(KVP_ERR_BACKEND,
                   "notification queue full (%zu of %zu bytes queued; drain it with get_notifs)",
                   used, q->max_bytes);
  }
  /* Linear in the number of senders with queued records: a handful in
   * practice (the peers of one worker), and a drained sender leaves. */
  nq_group *g = q->last;
  if (!g || g->sender_len != sender_len || memcmp(g->sender, sender, sender_len) != 0) {
    for (g = q->first; g; g = g->next)
      if (g->sender_len == sender_len && memcmp(g->sender, sender, sender_len) == 0) break;
  }
  if (!g) {
    g = (nq_group *)malloc(sizeof *g);
    if (!g) {
      pthread_mutex_unlock(&q->mu);
      free(r);
      return kvp_err_oom();
    }
    memcpy(g->sender, sender, sender_len);
    g->sender_len = sender_len;
    g->head = g->tail = NULL;
    g->next = NULL;
    if (q->last)
      q->last->next = g;
    else
      q->first = g;
    q->last = g;
  }
  if (g->tail)
    g->tail->next = r;
  else
    g->head = r;
  g->tail = r;
  q->nrec++;
  q->bytes += rec_bytes;
  pthread_mutex_unlock(&q->mu);
  return NULL;
}

void kvp_nq_drain(kvp_notif_queue *q, uint8_t *buf, size_t cap, size_t *size, size_t *count,
                  size_t *needed) {
  size_t used = 0, n = 0, need = 0;
  if (!buf) cap = 0;
  pthread_mutex_lock(&q->mu);
  while (q->first) {
    nq_group *g = q->first;
    while (g->head) {
      nq_rec *r = g->head;
      size_t rec = KVP_NOTIF_RECORD_HEADER + g->sender_len + r->msg_len;
      if (rec > cap - used) {
        need = rec;
        goto out;
      }
      uint8_t *p = buf + used;
      kvp_put_u32(p, (uint32_t)g->sender_len);
      kvp_put_u32(p + 4, r->msg_len);
      memcpy(p + KVP_NOTIF_RECORD_HEADER, g->sender, g->sender_len);
      if (r->msg_len) memcpy(p + KVP_NOTIF_RECORD_HEADER + g->sender_len, r + 1, r->msg_len);
      used += rec;
      n++;
      q->nrec--;
      q->bytes -= rec;
      g->head = r->next;
      if (!g->head) g->tail = NULL;
      free(r);
    }
    q->first = g->next;
    if (!q->first) q->last = NULL;
    free(g);
  }
out:
  pthread_mutex_unlock(&q->mu);
  *size = used;
  *count = n;
  *needed = need;
}

size_t kvp_nq_len(kvp_notif_queue *q) {
  pthread_mutex_lock(&q->mu);
  size_t n = q->nrec;
  pthread_mutex_unlock(&q->mu);
  return n;
}

/* ------------------------------------------------------------------------ */
/* Memory the kernel copies through                                         */
/* ------------------------------------------------------------------------ */

uint64_t kvp_prefault_for_kernel(uint64_t addr, uint64_t len) {
  enum { BATCH = 1024 }; /* IOV_MAX */
  long ps = sysconf(_SC_PAGESIZE);
  const uint64_t page = ps > 0 ? (uint64_t)ps : 4096;
  char scratch[BATCH];
  struct iovec local[BATCH];
  const uint64_t end = len > UINT64_MAX - addr ? UINT64_MAX : addr + len;
  const pid_t self = getpid();
  uint64_t at = addr; /* the next byte to read: addr, then page starts */
  while (at < end) {
    int n = 0;
    for (uint64_t p = at; n < BATCH && p < end; n++, p = (p / page + 1) * page) {
      local[n].iov_base = (void *)(uintptr_t)p;
      local[n].iov_len = 1;
    }
    struct iovec remote = {scratch, (size_t)n};
    ssize_t got = process_vm_writev(self, local, (unsigned long)n, &remote, 1, 0);
    if (got < n) return (got <= 0 ? at : (uint64_t)(uintptr_t)local[got].iov_base) - addr;
    at = ((uint64_t)(uintptr_t)local[n - 1].iov_base / page + 1) * page;
  }
  return end - addr;
}
