/*
 * Unit tests of kvp_util (run under -fsanitize=address,undefined and
 * -fsanitize=thread by `make plugin-test`). Exit status 0 when every check
 * passed; each failure prints file:line and the failed expression.
 */
#define _GNU_SOURCE
#include "kvp_util.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static int failures;
static int checks;

#define CHECK(cond)                                                      \
  do {                                                                   \
    checks++;                                                            \
    if (!(cond)) {                                                       \
      failures++;                                                        \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                    \
  } while (0)

/* Checks that e is an error with code and a message containing want (then
 * frees it), or that e is NULL when code is 0. */
#define CHECK_ERR(e, want_code, want_text) check_err((e), (want_code), (want_text), __LINE__)
static void check_err(kvp_error *e, kvp_status code, const char *text, int line) {
  checks++;
  if (code == 0) {
    if (e) {
      failures++;
      fprintf(stderr, "%s:%d: unexpected error %d: %s\n", __FILE__, line, kvp_err_code(e),
              kvp_err_message(e, NULL));
      kvp_err_free(e);
    }
    return;
  }
  if (!e) {
    failures++;
    fprintf(stderr, "%s:%d: expected error %d (%s), got none\n", __FILE__, line, code, text);
    return;
  }
  const char *msg = kvp_err_message(e, NULL);
  if (kvp_err_code(e) != code || (text && !strstr(msg, text))) {
    failures++;
    fprintf(stderr, "%s:%d: expected error %d containing \"%s\", got %d: %s\n", __FILE__, line,
            code, text ? text : "", kvp_err_code(e), msg);
  }
  kvp_err_free(e);
}

static kvp_param P(const char *k, const char *v) {
  kvp_param p;
  p.key = k;
  p.key_len = k ? strlen(k) : 0;
  p.value = v;
  p.value_len = v ? strlen(v) : 0;
  return p;
}

/* ------------------------------------------------------------------------ */

static void test_errors(void) {
  kvp_error *e = kvp_err(KVP_ERR_NOT_FOUND, "peer %s not loaded (%d)", "bob", 7);
  size_t len = 0;
  const char *m = kvp_err_message(e, &len);
  CHECK(kvp_err_code(e) == KVP_ERR_NOT_FOUND);
  CHECK(strcmp(m, "peer bob not loaded (7)") == 0);
  CHECK(len == strlen(m));

  /* Through the kvp_api entries. */
  kvp_error_code_args ca = {KVP_ERROR_CODE_ARGS_STRUCT_SIZE, NULL, e, 0};
  kvp_util_error_code(&ca);
  CHECK(ca.code == KVP_ERR_NOT_FOUND);
  kvp_error_message_args ma = {KVP_ERROR_MESSAGE_ARGS_STRUCT_SIZE, NULL, e, NULL, 0};
  kvp_util_error_message(&ma);
  CHECK(ma.message == m && ma.message_len == len);
  /* A short struct_size is ignored rather than written past. */
  kvp_error_message_args short_ma = {8, NULL, e, NULL, 99};
  kvp_util_error_message(&short_ma);
  CHECK(short_ma.message == NULL && short_ma.message_len == 99);
  kvp_util_error_message(NULL);
  kvp_error_destroy_args da = {KVP_ERROR_DESTROY_ARGS_STRUCT_SIZE, NULL, e};
  kvp_util_error_destroy(&da);
  da.error = NULL;
  kvp_util_error_destroy(&da); /* NULL error: nothing */
  kvp_util_error_destroy(NULL);

  /* Non-negative codes are a bug and become KVP_ERR_UNKNOWN. */
  CHECK_ERR(kvp_err(0, "x"), KVP_ERR_UNKNOWN, "x");
  CHECK_ERR(kvp_err(KVP_IN_PROG, "y"), KVP_ERR_UNKNOWN, "y");

  /* The OOM error is static and survives destroy. */
  kvp_error *oom = kvp_err_oom();
  CHECK(kvp_err_code(oom) == KVP_ERR_BACKEND);
  CHECK(strcmp(kvp_err_message(oom, NULL), "out of memory") == 0);
  kvp_error_destroy_args oda = {KVP_ERROR_DESTROY_ARGS_STRUCT_SIZE, NULL, oom};
  kvp_util_error_destroy(&oda);
  CHECK(strcmp(kvp_err_message(kvp_err_oom(), NULL), "out of memory") == 0);

  /* Long messages are cut at KVP_ERR_MAX_MESSAGE and end in "...". */
  char *big = (char *)malloc(10000);
  memset(big, 'a', 9999);
  big[9999] = 0;
  e = kvp_err(KVP_ERR_BACKEND, "%s", big);
  m = kvp_err_message(e, &len);
  CHECK(len == KVP_ERR_MAX_MESSAGE);
  CHECK(strlen(m) == len);
  CHECK(memcmp(m + len - 3, "...", 3) == 0);
  kvp_err_free(e);
  /* Between the stack buffer (512) and the cap: kept whole. */
  big[2000] = 0;
  e = kvp_err(KVP_ERR_BACKEND, "<%s>", big);
  m = kvp_err_message(e, &len);
  CHECK(len == 2002 && m[0] == '<' && m[2001] == '>' && m[1000] == 'a');
  kvp_err_free(e);
  free(big);

  /* Wrapping adds context and keeps the code. */
  e = kvp_err_wrap(kvp_err(KVP_ERR_MISMATCH, "len 4 vs 8"), "desc %d", 3);
  CHECK_ERR(e, KVP_ERR_MISMATCH, "desc 3: len 4 vs 8");
  CHECK(kvp_err_wrap(NULL, "x") == NULL);

  CHECK(kvp_err_code(NULL) == KVP_SUCCESS);
  kvp_err_free(NULL);
}

static void test_check_args(void) {
  CHECK_ERR(kvp_check_args(NULL, 16, "post_xfer"), KVP_ERR_INVALID_PARAM, "post_xfer: args is NULL");
  kvp_post_xfer_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = KVP_POST_XFER_ARGS_STRUCT_SIZE - 1;
  CHECK_ERR(KVP_CHECK_ARGS(&a, KVP_POST_XFER_ARGS_STRUCT_SIZE), KVP_ERR_INVALID_PARAM,
            "test_check_args: args struct_size is");
  a.struct_size = KVP_POST_XFER_ARGS_STRUCT_SIZE;
  CHECK_ERR(KVP_CHECK_ARGS(&a, KVP_POST_XFER_ARGS_STRUCT_SIZE), 0, NULL);
  a.struct_size = KVP_POST_XFER_ARGS_STRUCT_SIZE + 64; /* a newer caller */
  CHECK_ERR(KVP_CHECK_ARGS(&a, KVP_POST_XFER_ARGS_STRUCT_SIZE), 0, NULL);
}

/* ------------------------------------------------------------------------ */

static void test_handles_basic(void) {
  kvp_htable *t = kvp_ht_create(7);
  kvp_htable *u = kvp_ht_create(8);
  CHECK(kvp_ht_create(0) == NULL);
  int a = 1, b = 2;
  uint64_t ha = 0, hb = 0, hu = 0;
  CHECK_ERR(kvp_ht_insert(t, &a, &ha), 0, NULL);
  CHECK_ERR(kvp_ht_insert(t, &b, &hb), 0, NULL);
  CHECK_ERR(kvp_ht_insert(u, &a, &hu), 0, NULL);
  CHECK_ERR(kvp_ht_insert(t, NULL, &hu), KVP_ERR_INVALID_PARAM, NULL);
  CHECK(ha != 0 && hb != 0 && ha != hb);
  CHECK((ha >> 32) >= 1);                       /* generation first */
  CHECK((((uint32_t)ha) >> 24) == 7);           /* tag in the slot */
  CHECK(hu != ha);                              /* tables differ by tag */
  CHECK(kvp_ht_count(t) == 2);

  CHECK(kvp_ht_acquire(t, 0) == NULL);
  CHECK(kvp_ht_acquire(t, hu) == NULL);          /* foreign table */
  CHECK(kvp_ht_acquire(t, ha ^ 0x5) == NULL);    /* slot never handed out */
  CHECK(kvp_ht_acquire(t, ha + (1ull << 32)) == NULL); /* wrong generation */
  CHECK(kvp_ht_acquire(t, ~0ull) == NULL);
  CHECK(kvp_ht_acquire(t, ha) == &a);
  kvp_ht_put(t, ha);
  CHECK(kvp_ht_acquire(t, hb) == &b);
  kvp_ht_put(t, hb);

  CHECK(kvp_ht_remove(t, ha) == &a);
  CHECK(kvp_ht_remove(t, ha) == NULL); /* double release */
  CHECK(kvp_ht_acquire(t, ha) == NULL); /* stale */
  kvp_ht_put(t, ha);                    /* a stray put on a stale handle is harmless */
  CHECK(kvp_ht_count(t) == 1);

  /* The slot is reused with a new generation; the old handle stays stale. */
  uint64_t hc = 0;
  CHECK_ERR(kvp_ht_insert(t, &a, &hc), 0, NULL);
  CHECK(hc != ha);
  CHECK(kvp_ht_acquire(t, ha) == NULL);
  CHECK(kvp_ht_acquire(t, hc) == &a);
  kvp_ht_put(t, hc);

  /* Growth past one chunk; all handles distinct and resolvable. */
  enum { N = 5000 };
  static uint64_t hs[N];
  static int objs[N];
  for (int i = 0; i < N; i++) CHECK_ERR(kvp_ht_insert(u, &objs[i], &hs[i]), 0, NULL);
  int ok = 1;
  for (int i = 0; i < N; i++) {
    if (kvp_ht_acquire(u, hs[i]) != &objs[i]) ok = 0;
    kvp_ht_put(u, hs[i]);
  }
  CHECK(ok);
  for (int i = 0; i < N; i += 2) CHECK(kvp_ht_remove(u, hs[i]) == &objs[i]);
  ok = 1;
  for (int i = 0; i < N; i++) {
    void *o = kvp_ht_acquire(u, hs[i]);
    if (i % 2 == 0 ? o != NULL : o != &objs[i]) ok = 0;
    if (o) kvp_ht_put(u, hs[i]);
  }
  CHECK(ok);
  CHECK(kvp_ht_count(u) == 1 + N / 2);
  kvp_ht_destroy(t);
  kvp_ht_destroy(u);
}

/* remove waits for references taken before it. */
typedef struct {
  kvp_htable *t;
  uint64_t h;
  volatile int removed;
  pthread_mutex_t mu;
} remove_ctx;

static void *remover(void *p) {
  remove_ctx *c = (remove_ctx *)p;
  void *o = kvp_ht_remove(c->t, c->h);
  pthread_mutex_lock(&c->mu);
  c->removed = o != NULL;
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

static void test_handles_remove_waits(void) {
  remove_ctx c;
  c.t = kvp_ht_create(1);
  c.removed = 0;
  pthread_mutex_init(&c.mu, NULL);
  int obj = 5;
  CHECK_ERR(kvp_ht_insert(c.t, &obj, &c.h), 0, NULL);
  CHECK(kvp_ht_acquire(c.t, c.h) == &obj);
  pthread_t th;
  pthread_create(&th, NULL, remover, &c);
  /* The remover has marked the slot dead: new acquires fail at once. */
  int dead = 0;
  for (int i = 0; i < 2000 && !dead; i++) {
    void *o = kvp_ht_acquire(c.t, c.h);
    if (o)
      kvp_ht_put(c.t, c.h);
    else
      dead = 1;
    usleep(500);
  }
  CHECK(dead);
  usleep(20000);
  pthread_mutex_lock(&c.mu);
  int early = c.removed;
  pthread_mutex_unlock(&c.mu);
  CHECK(!early); /* still waiting for our reference */
  kvp_ht_put(c.t, c.h);
  pthread_join(th, NULL);
  CHECK(c.removed);
  CHECK(kvp_ht_count(c.t) == 0);
  kvp_ht_destroy(c.t);
  pthread_mutex_destroy(&c.mu);
}

/* 8 threads insert, look up and remove their own handles while probing the
 * handles of the others. */
typedef struct {
  kvp_htable *t;
  int id;
  int bad;
} churn_ctx;

static uint64_t shared_handles[8];
static pthread_mutex_t shared_mu = PTHREAD_MUTEX_INITIALIZER;

static void *churn(void *p) {
  churn_ctx *c = (churn_ctx *)p;
  int mine[64];
  uint64_t hs[64];
  for (int round = 0; round < 200; round++) {
    for (int i = 0; i < 64; i++) {
      mine[i] = c->id * 1000 + i;
      if (kvp_ht_insert(c->t, &mine[i], &hs[i])) c->bad++;
    }
    pthread_mutex_lock(&shared_mu);
    shared_handles[c->id] = hs[0];
    uint64_t other = shared_handles[(c->id + 1) % 8];
    pthread_mutex_unlock(&shared_mu);
    int *o = (int *)kvp_ht_acquire(c->t, other);
    if (o) {
      if (*o < 0 || *o % 1000 != 0) c->bad++; /* someone's first object */
      kvp_ht_put(c->t, other);
    }
    for (int i = 0; i < 64; i++) {
      int *x = (int *)kvp_ht_acquire(c->t, hs[i]);
      if (x != &mine[i]) c->bad++;
      if (x) kvp_ht_put(c->t, hs[i]);
    }
    pthread_mutex_lock(&shared_mu);
    shared_handles[c->id] = 0;
    pthread_mutex_unlock(&shared_mu);
    for (int i = 0; i < 64; i++)
      if (kvp_ht_remove(c->t, hs[i]) != &mine[i]) c->bad++;
  }
  return NULL;
}

static void test_handles_concurrent(void) {
  kvp_htable *t = kvp_ht_create(3);
  pthread_t th[8];
  churn_ctx cs[8];
  for (int i = 0; i < 8; i++) {
    cs[i].t = t;
    cs[i].id = i;
    cs[i].bad = 0;
    pthread_create(&th[i], NULL, churn, &cs[i]);
  }
  int bad = 0;
  for (int i = 0; i < 8; i++) {
    pthread_join(th[i], NULL);
    bad += cs[i].bad;
  }
  CHECK(bad == 0);
  CHECK(kvp_ht_count(t) == 0);
  kvp_ht_destroy(t);
}

/* Lock-free acquire and put race with remove and re-insert of the same
 * slot: a reference, once taken, keeps the object alive (remove waits for
 * it), and no acquire succeeds on a handle after its remove returned. The
 * object's `alive` flag is plain memory: ThreadSanitizer checks that the
 * table orders the readers' accesses before the remover's write. */
typedef struct {
  int alive;
  int id;
} race_obj;

typedef struct {
  kvp_htable *t;
  uint64_t *handle; /* the handle in use now; __atomic */
  int *stop;        /* __atomic */
  long hits, bad;
  long *all_hits; /* __atomic: every reader's hits, so the writer knows when to stop */
} race_ctx;

static void *race_reader(void *p) {
  race_ctx *c = (race_ctx *)p;
  while (!__atomic_load_n(c->stop, __ATOMIC_ACQUIRE)) {
    uint64_t h = __atomic_load_n(c->handle, __ATOMIC_ACQUIRE);
    race_obj *o = (race_obj *)kvp_ht_acquire(c->t, h);
    if (!o) continue;
    if (!o->alive || (uint32_t)o->id != (uint32_t)(h >> 32)) c->bad++;
    c->hits++;
    __atomic_add_fetch(c->all_hits, 1, __ATOMIC_RELAXED);
    kvp_ht_put(c->t, h);
  }
  return NULL;
}

static void test_handles_lockfree_race(void) {
  kvp_htable *t = kvp_ht_create(9);
  race_obj obj = {0, 0};
  uint64_t handle = 0;
  int stop = 0;
  race_ctx cs[3];
  pthread_t th[3];
  long all_hits = 0;
  for (int i = 0; i < 3; i++) {
    cs[i] = (race_ctx){t, &handle, &stop, 0, 0, &all_hits};
    pthread_create(&th[i], NULL, race_reader, &cs[i]);
  }
  int stale_ok = 1;
  /* At least 3000 rounds, and on until the readers hit an object at all
   * (on a loaded machine they may not run during the first ones), at
   * most ~10 s. */
  struct timespec t0, tn;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int round = 0;; round++) {
    if (round >= 3000) {
      clock_gettime(CLOCK_MONOTONIC, &tn);
      if (__atomic_load_n(&all_hits, __ATOMIC_RELAXED) > 0 || tn.tv_sec - t0.tv_sec > 10) break;
    }
    uint64_t h = 0;
    obj.alive = 1;
    CHECK_ERR(kvp_ht_insert(t, &obj, &h), 0, NULL);
    obj.id = (int)(uint32_t)(h >> 32); /* written before the handle is shared */
    __atomic_store_n(&handle, h, __ATOMIC_RELEASE);
    for (volatile int spin = 0; spin < 200; spin++) {
    }
    if (kvp_ht_remove(t, h) != &obj) stale_ok = 0;
    obj.alive = 0; /* no reader holds a reference any more */
    if (kvp_ht_acquire(t, h) != NULL) stale_ok = 0;
  }
  __atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
  long hits = 0, bad = 0;
  for (int i = 0; i < 3; i++) {
    pthread_join(th[i], NULL);
    hits += cs[i].hits;
    bad += cs[i].bad;
  }
  CHECK(stale_ok);
  CHECK(bad == 0);
  CHECK(hits > 0);
  CHECK(kvp_ht_count(t) == 0);
  kvp_ht_destroy(t);
}

/* ------------------------------------------------------------------------ */

static void test_params(void) {
  const char *known[] = {"workers", "fail_rate", "caps_off", "verbose", "offset"};
  kvp_param ps[] = {P("workers", "4"), P("fail_rate", "0.25"), P("caps_off", "batch, strided"),
                    P("verbose", "Yes"), P("offset", "-12")};
  size_t n = 5;
  CHECK_ERR(kvp_params_check(ps, n, known, 5, 0), 0, NULL);
  CHECK(kvp_param_find(ps, n, "fail_rate") == &ps[1]);
  CHECK(kvp_param_find(ps, n, "fail") == NULL);
  CHECK(kvp_param_find(NULL, 0, "x") == NULL);

  uint64_t u = 0;
  CHECK_ERR(kvp_param_u64(ps, n, "workers", 1, 1, 64, &u), 0, NULL);
  CHECK(u == 4);
  CHECK_ERR(kvp_param_u64(ps, n, "absent", 9, 1, 64, &u), 0, NULL);
  CHECK(u == 9);
  CHECK_ERR(kvp_param_u64(ps, n, "workers", 1, 5, 64, &u), KVP_ERR_INVALID_PARAM,
            "param workers=\"4\": want an unsigned integer in [5, 64]");
  double d = 0;
  CHECK_ERR(kvp_param_double(ps, n, "fail_rate", 0, 0, 1, &d), 0, NULL);
  CHECK(d == 0.25);
  CHECK_ERR(kvp_param_double(ps, n, "fail_rate", 0, 0.5, 1, &d), KVP_ERR_INVALID_PARAM,
            "fail_rate=\"0.25\"");
  int b = 0;
  CHECK_ERR(kvp_param_bool(ps, n, "verbose", 0, &b), 0, NULL);
  CHECK(b == 1);
  int64_t i64 = 0;
  CHECK_ERR(kvp_param_i64(ps, n, "offset", 0, -100, 100, &i64), 0, NULL);
  CHECK(i64 == -12);
  CHECK_ERR(kvp_param_i64(ps, n, "offset", 0, 0, 100, &i64), KVP_ERR_INVALID_PARAM, "offset=\"-12\"");

  const char *caps[] = {"prepped", "batch", "strided"};
  uint64_t mask = 99;
  CHECK_ERR(kvp_param_name_mask(ps, n, "caps_off", caps, 3, &mask), 0, NULL);
  CHECK(mask == 6);
  CHECK_ERR(kvp_param_name_mask(ps, n, "absent", caps, 3, &mask), 0, NULL);
  CHECK(mask == 0);

  /* Unknown, duplicate, empty and NULL keys. */
  kvp_param bad1[] = {P("workers", "1"), P("wokers", "2")};
  CHECK_ERR(kvp_params_check(bad1, 2, known, 5, 0), KVP_ERR_INVALID_PARAM,
            "unknown param \"wokers\" (known: workers, fail_rate, caps_off, verbose, offset)");
  CHECK_ERR(kvp_params_check(bad1, 2, known, 5, 1), 0, NULL); /* pass-through */
  kvp_param dup[] = {P("workers", "1"), P("workers", "2")};
  CHECK_ERR(kvp_params_check(dup, 2, known, 5, 1), KVP_ERR_INVALID_PARAM, "given twice");
  kvp_param empty[] = {P("", "1")};
  CHECK_ERR(kvp_params_check(empty, 1, known, 5, 0), KVP_ERR_INVALID_PARAM, "empty key");
  kvp_param nullv = {"workers", 7, NULL, 3};
  CHECK_ERR(kvp_params_check(&nullv, 1, known, 5, 0), KVP_ERR_INVALID_PARAM, "NULL pointer");
  kvp_param nullk = {NULL, 3, "x", 1};
  CHECK_ERR(kvp_params_check(&nullk, 1, known, 5, 0), KVP_ERR_INVALID_PARAM, "NULL pointer");
  CHECK_ERR(kvp_params_check(NULL, 2, known, 5, 0), KVP_ERR_INVALID_PARAM, "params is NULL");
  CHECK_ERR(kvp_params_check(NULL, 0, known, 5, 0), 0, NULL);
  /* Values need not be NUL-terminated: lengths rule. */
  kvp_param cut = {"workersXYZ", 7, "12345", 2};
  CHECK_ERR(kvp_params_check(&cut, 1, known, 5, 0), 0, NULL);
  CHECK_ERR(kvp_param_u64(&cut, 1, "workers", 1, 1, 64, &u), 0, NULL);
  CHECK(u == 12);
  kvp_param cutd = {"r", 1, "0.59", 3};
  CHECK_ERR(kvp_param_double(&cutd, 1, "r", 0, 0, 1, &d), 0, NULL);
  CHECK(d == 0.5);

  /* u64 syntax and overflow. */
  const char *bad_u[] = {"", "-1", "+1", " 1", "1 ", "0x10", "1.0", "18446744073709551616", "abc"};
  for (size_t i = 0; i < sizeof bad_u / sizeof *bad_u; i++) {
    kvp_param p = P("k", bad_u[i]);
    CHECK_ERR(kvp_param_u64(&p, 1, "k", 0, 0, UINT64_MAX, &u), KVP_ERR_INVALID_PARAM, "param k=");
  }
  kvp_param maxu = P("k", "18446744073709551615");
  CHECK_ERR(kvp_param_u64(&maxu, 1, "k", 0, 0, UINT64_MAX, &u), 0, NULL);
  CHECK(u == UINT64_MAX);
  /* i64 limits. */
  kvp_param mini = P("k", "-9223372036854775808");
  CHECK_ERR(kvp_param_i64(&mini, 1, "k", 0, INT64_MIN, INT64_MAX, &i64), 0, NULL);
  CHECK(i64 == INT64_MIN);
  kvp_param over = P("k", "9223372036854775808");
  CHECK_ERR(kvp_param_i64(&over, 1, "k", 0, INT64_MIN, INT64_MAX, &i64), KVP_ERR_INVALID_PARAM, NULL);
  kvp_param under = P("k", "-9223372036854775809");
  CHECK_ERR(kvp_param_i64(&under, 1, "k", 0, INT64_MIN, INT64_MAX, &i64), KVP_ERR_INVALID_PARAM, NULL);
  kvp_param sign = P("k", "-");
  CHECK_ERR(kvp_param_i64(&sign, 1, "k", 0, INT64_MIN, INT64_MAX, &i64), KVP_ERR_INVALID_PARAM, NULL);
  /* doubles: nan, inf, junk, out of range, overlong. */
  const char *bad_d[] = {"nan", "inf", "1e999", "0.5x", "", " 0.5", "2", "-0.1",
                         "0.0000000000000000000000000000000000000000000000000000000000000000001"};
  for (size_t i = 0; i < sizeof bad_d / sizeof *bad_d; i++) {
    kvp_param p = P("rate", bad_d[i]);
    CHECK_ERR(kvp_param_double(&p, 1, "rate", 0, 0, 1, &d), KVP_ERR_INVALID_PARAM, "param rate=");
  }
  kvp_param sci = P("rate", "1e-3");
  CHECK_ERR(kvp_param_double(&sci, 1, "rate", 0, 0, 1, &d), 0, NULL);
  CHECK(d == 1e-3);
  /* bools. */
  const char *t_vals[] = {"1", "true", "TRUE", "yes", "on"};
  const char *f_vals[] = {"0", "false", "No", "off", "OFF"};
  for (int i = 0; i < 5; i++) {
    kvp_param pt = P("b", t_vals[i]), pf = P("b", f_vals[i]);
    b = -1;
    CHECK_ERR(kvp_param_bool(&pt, 1, "b", 0, &b), 0, NULL);
    CHECK(b == 1);
    CHECK_ERR(kvp_param_bool(&pf, 1, "b", 1, &b), 0, NULL);
    CHECK(b == 0);
  }
  kvp_param pb = P("b", "maybe");
  CHECK_ERR(kvp_param_bool(&pb, 1, "b", 0, &b), KVP_ERR_INVALID_PARAM, "b=\"maybe\": want a boolean");
  /* name masks. */
  kvp_param m1 = P("caps_off", "batch,batch");
  CHECK_ERR(kvp_param_name_mask(&m1, 1, "caps_off", caps, 3, &mask), 0, NULL);
  CHECK(mask == 2);
  kvp_param m2 = P("caps_off", "batch,,prepped");
  CHECK_ERR(kvp_param_name_mask(&m2, 1, "caps_off", caps, 3, &mask), KVP_ERR_INVALID_PARAM,
            "unknown item \"\"");
  kvp_param m3 = P("caps_off", "batch,notif");
  CHECK_ERR(kvp_param_name_mask(&m3, 1, "caps_off", caps, 3, &mask), KVP_ERR_INVALID_PARAM,
            "unknown item \"notif\" (want a comma list of: prepped, batch, strided)");
  kvp_param m4 = P("caps_off", "");
  CHECK_ERR(kvp_param_name_mask(&m4, 1, "caps_off", caps, 3, &mask), 0, NULL);
  CHECK(mask == 0);
  kvp_param m5 = P("caps_off", "strided,");
  CHECK_ERR(kvp_param_name_mask(&m5, 1, "caps_off", caps, 3, &mask), KVP_ERR_INVALID_PARAM, NULL);

  /* list iteration. */
  const char *s = " a , bb,,c ";
  size_t pos = 0, il;
  const char *it;
  const char *want[] = {"a", "bb", "", "c"};
  int k = 0;
  while (kvp_list_next(s, strlen(s), &pos, &it, &il)) {
    CHECK(k < 4 && il == strlen(want[k]) && memcmp(it, want[k], il) == 0);
    k++;
  }
  CHECK(k == 4);
  pos = 0;
  CHECK(kvp_list_next("", 0, &pos, &it, &il) == 0);
  pos = 0;
  k = 0;
  while (kvp_list_next("x,", 2, &pos, &it, &il)) k++;
  CHECK(k == 2);

  CHECK(kvp_str_eq("abc", 3, "abc") && !kvp_str_eq("abc", 2, "abc") && kvp_str_eq(NULL, 0, ""));
}

/* ------------------------------------------------------------------------ */

typedef struct {
  uint64_t addr, len; /* kvp_range prefix */
  uint32_t kind;
} region;

static int accept_kind(const void *elem, void *ctx) {
  return ((const region *)elem)->kind == *(const uint32_t *)ctx;
}

static void test_ranges(void) {
  uint64_t end = 0;
  CHECK(kvp_strided_end(100, 10, 0, 1, &end) && end == 110);
  CHECK(kvp_strided_end(100, 10, 999, 1, &end) && end == 110); /* stride ignored */
  CHECK(kvp_strided_end(100, 10, 20, 3, &end) && end == 150);
  CHECK(kvp_strided_end(100, 10, 4, 3, &end) && end == 118);   /* overlapping blocks */
  CHECK(kvp_strided_end(100, 10, 0, 5, &end) && end == 110);   /* same block repeated */
  CHECK(!kvp_strided_end(100, 0, 20, 3, &end));
  CHECK(!kvp_strided_end(100, 10, 20, 0, &end));
  CHECK(!kvp_strided_end(UINT64_MAX - 5, 10, 0, 1, &end));
  CHECK(kvp_strided_end(UINT64_MAX - 10, 10, 0, 1, &end) && end == UINT64_MAX);
  CHECK(!kvp_strided_end(0, 1, 1ull << 40, 1ull << 30, &end)); /* (count-1)*stride overflows */
  CHECK(!kvp_strided_end(UINT64_MAX - 100, 1, 60, 3, &end));   /* addr + span overflows */
  CHECK(!kvp_strided_end(UINT64_MAX - 100, 51, 50, 2, &end));  /* last + len overflows */
  CHECK(kvp_strided_end(UINT64_MAX - 100, 50, 50, 2, &end) && end == UINT64_MAX);

  CHECK(kvp_strided_in(100, 10, 20, 3, 100, 50));
  CHECK(!kvp_strided_in(100, 10, 20, 3, 100, 49));
  CHECK(!kvp_strided_in(99, 10, 20, 3, 100, 60));
  CHECK(kvp_strided_in(UINT64_MAX - 10, 10, 0, 1, UINT64_MAX - 20, 20));
  CHECK(kvp_strided_in(0, 16, 0, 1, 0, UINT64_MAX)); /* base + size would overflow */
  CHECK(!kvp_strided_in(0, 1, 1ull << 40, 1ull << 30, 0, UINT64_MAX));

  region rs[] = {{3000, 100, 1}, {1000, 100, 0}, {2000, 500, 0}, {1100, 50, 1}};
  kvp_ranges_sort(rs, 4, sizeof(region));
  CHECK(rs[0].addr == 1000 && rs[1].addr == 1100 && rs[2].addr == 2000 && rs[3].addr == 3000);
  CHECK(kvp_ranges_check(rs, 4, sizeof(region)) == -1);
  CHECK(kvp_range_find(rs, 4, sizeof(region), 1000, 100) == 0);
  CHECK(kvp_range_find(rs, 4, sizeof(region), 1050, 50) == 0);
  CHECK(kvp_range_find(rs, 4, sizeof(region), 1050, 51) == -1); /* spans two regions */
  CHECK(kvp_range_find(rs, 4, sizeof(region), 999, 1) == -1);
  CHECK(kvp_range_find(rs, 4, sizeof(region), 1150, 1) == -1);  /* gap */
  CHECK(kvp_range_find(rs, 4, sizeof(region), 3099, 1) == 3);
  CHECK(kvp_range_find(rs, 4, sizeof(region), 3099, 2) == -1);
  CHECK(kvp_range_find(rs, 4, sizeof(region), 3000, 0) == -1);
  CHECK(kvp_range_find(rs, 4, sizeof(region), UINT64_MAX, UINT64_MAX) == -1);
  CHECK(kvp_range_find(rs, 0, sizeof(region), 1000, 1) == -1);
  CHECK(kvp_range_find_strided(rs, 4, sizeof(region), 2000, 10, 100, 5) == 2);
  CHECK(kvp_range_find_strided(rs, 4, sizeof(region), 2000, 10, 100, 6) == -1);
  CHECK(kvp_range_find_strided(rs, 4, sizeof(region), 2000, 0, 100, 6) == -1);

  /* Blocks in different regions: block 0 in [1000,1100), block 1 in [2000,2500). */
  uint32_t k0 = 0, k1 = 1;
  CHECK(kvp_strided_each_in(rs, 4, sizeof(region), 1050, 20, 1000, 2, NULL, NULL));
  CHECK(kvp_strided_each_in(rs, 4, sizeof(region), 1050, 20, 1000, 2, accept_kind, &k0));
  CHECK(!kvp_strided_each_in(rs, 4, sizeof(region), 1050, 20, 1000, 2, accept_kind, &k1));
  CHECK(kvp_strided_each_in(rs, 4, sizeof(region), 1050, 20, 1000, 3, NULL, NULL));  /* 3050+20 */
  CHECK(!kvp_strided_each_in(rs, 4, sizeof(region), 1050, 20, 1000, 4, NULL, NULL)); /* 4050 */
  CHECK(!kvp_strided_each_in(rs, 4, sizeof(region), 1090, 20, 1000, 2, NULL, NULL));
  CHECK(kvp_strided_each_in(rs, 4, sizeof(region), 1100, 50, 0, 1, accept_kind, &k1));
  CHECK(!kvp_strided_each_in(rs, 4, sizeof(region), 1100, 50, 0, 1, accept_kind, &k0));
  CHECK(!kvp_strided_each_in(rs, 4, sizeof(region), 0, 1, 1ull << 40, 1ull << 30, NULL, NULL));
  /* 2^41 one-byte blocks over two adjacent 2^40-byte elements: answered
   * element by element, not block by block (which would not finish). */
  region big[] = {{1ull << 40, 1ull << 40, 0}, {2ull << 40, 1ull << 40, 1}};
  CHECK(kvp_strided_each_in(big, 2, sizeof(region), 1ull << 40, 1, 1, 2ull << 40, NULL, NULL));
  CHECK(!kvp_strided_each_in(big, 2, sizeof(region), 1ull << 40, 1, 1, (2ull << 40) + 1, NULL, NULL));
  CHECK(!kvp_strided_each_in(big, 2, sizeof(region), 1ull << 40, 1, 1, 2ull << 40, accept_kind, &k0));
  /* Two-byte blocks one byte apart: one straddles the boundary. */
  CHECK(!kvp_strided_each_in(big, 2, sizeof(region), 1ull << 40, 2, 1, 3ull << 39, NULL, NULL));
  /* Stride 2 keeps them apart: blocks end exactly at the boundary. */
  CHECK(kvp_strided_each_in(big, 2, sizeof(region), 1ull << 40, 2, 2, 1ull << 40, NULL, NULL));
  CHECK(kvp_strided_each_in(big, 2, sizeof(region), (1ull << 40) + 3, 2, 1000, 2000000000ull, NULL, NULL));

  region ov[] = {{1000, 100, 0}, {1099, 10, 0}};
  CHECK(kvp_ranges_check(ov, 2, sizeof(region)) == 1);
  region adj[] = {{1000, 100, 0}, {1100, 10, 0}};
  CHECK(kvp_ranges_check(adj, 2, sizeof(region)) == -1);
  region wrap[] = {{UINT64_MAX - 1, 5, 0}};
  CHECK(kvp_ranges_check(wrap, 1, sizeof(region)) == 0);
  /* kvp_mem_desc starts with addr, len: usable as a range table directly. */
  kvp_mem_desc md[2] = {{4096, 4096, 0, KVP_MEM_DRAM, 0}, {65536, 100, 0, KVP_MEM_VRAM, 0}};
  CHECK(kvp_range_find(md, 2, sizeof(kvp_mem_desc), 65600, 36) == 1);
}

static void test_out_and_reader(void) {
  uint8_t buf[8];
  size_t size = 0;
  memset(buf, 0xee, sizeof buf);
  CHECK(kvp_out_bytes(buf, 8, "abcdef", 6, &size) == 1 && size == 6 && memcmp(buf, "abcdef", 6) == 0);
  memset(buf, 0xee, sizeof buf);
  CHECK(kvp_out_bytes(buf, 5, "abcdef", 6, &size) == 0 && size == 6 && buf[0] == 0xee);
  CHECK(kvp_out_bytes(NULL, 0, "abcdef", 6, &size) == 0 && size == 6);
  CHECK(kvp_out_bytes(NULL, 0, NULL, 0, &size) == 1 && size == 0);
  CHECK(kvp_out_bytes(NULL, 100, "ab", 2, &size) == 0 && size == 2); /* NULL buf never written */

  uint8_t w[14];
  kvp_put_u16(w, 0xBEEF);
  kvp_put_u32(w + 2, 0x01020304u);
  kvp_put_u64(w + 6, 0x1122334455667788ull);
  CHECK(w[0] == 0xEF && w[1] == 0xBE && w[2] == 4 && w[5] == 1 && w[6] == 0x88 && w[13] == 0x11);
  kvp_reader r;
  kvp_reader_init(&r, w, sizeof w);
  uint16_t a;
  uint32_t b;
  uint64_t c;
  const uint8_t *bytes;
  CHECK(kvp_read_u16(&r, &a) && a == 0xBEEF);
  CHECK(kvp_read_u32(&r, &b) && b == 0x01020304u);
  CHECK(kvp_read_u64(&r, &c) && c == 0x1122334455667788ull);
  CHECK(r.ok && r.left == 0);
  CHECK(!kvp_read_u16(&r, &a) && !r.ok);
  kvp_reader_init(&r, w, 5);
  CHECK(kvp_read_u32(&r, &b));
  CHECK(!kvp_read_u32(&r, &b) && !r.ok);
  CHECK(!kvp_read_bytes(&r, 0, &bytes)); /* sticky failure */
  kvp_reader_init(&r, w, 3);
  CHECK(kvp_read_bytes(&r, 3, &bytes) && bytes == w && r.left == 0);
  kvp_reader_init(&r, NULL, 100);
  CHECK(r.left == 0 && !kvp_read_u16(&r, &a));
}

/* ------------------------------------------------------------------------ */

/* Parses drained records back; returns the number parsed or -1 on a
 * malformed buffer. */
typedef struct {
  char sender[300];
  char msg[300];
} rec;
static int parse_records(const uint8_t *buf, size_t size, rec *out, int max) {
  size_t off = 0;
  int n = 0;
  while (off < size) {
    if (size - off < 8 || n >= max) return -1;
    uint32_t sl = kvp_get_u32(buf + off), ml = kvp_get_u32(buf + off + 4);
    if (size - off - 8 < (size_t)sl + ml || sl >= 300 || ml >= 300) return -1;
    memcpy(out[n].sender, buf + off + 8, sl);
    out[n].sender[sl] = 0;
    memcpy(out[n].msg, buf + off + 8 + sl, ml);
    out[n].msg[ml] = 0;
    off += 8 + (size_t)sl + ml;
    n++;
  }
  return n;
}

static kvp_error *push(kvp_notif_queue *q, const char *s, const char *m) {
  return kvp_nq_push(q, s, strlen(s), (const uint8_t *)m, strlen(m));
}

static void test_notif_queue(void) {
  kvp_notif_queue *q = kvp_nq_create(0);
  CHECK_ERR(push(q, "alice", "a1"), 0, NULL);
  CHECK_ERR(push(q, "bob", "b1"), 0, NULL);
  CHECK_ERR(push(q, "alice", "a2"), 0, NULL);
  CHECK_ERR(push(q, "carol", ""), 0, NULL);
  CHECK_ERR(push(q, "bob", "b2"), 0, NULL);
  CHECK(kvp_nq_len(q) == 5);

  uint8_t buf[512];
  size_t size, count, needed;
  rec rs[16];
  kvp_nq_drain(q, buf, sizeof buf, &size, &count, &needed);
  CHECK(count == 5 && needed == 0);
  CHECK(size == 5 * 8 + (5 + 2) * 2 + (3 + 2) * 2 + 5);
  CHECK(parse_records(buf, size, rs, 16) == 5);
  /* Grouped by sender, senders by their oldest record, in arrival order. */
  CHECK(strcmp(rs[0].sender, "alice") == 0 && strcmp(rs[0].msg, "a1") == 0);
  CHECK(strcmp(rs[1].sender, "alice") == 0 && strcmp(rs[1].msg, "a2") == 0);
  CHECK(strcmp(rs[2].sender, "bob") == 0 && strcmp(rs[2].msg, "b1") == 0);
  CHECK(strcmp(rs[3].sender, "bob") == 0 && strcmp(rs[3].msg, "b2") == 0);
  CHECK(strcmp(rs[4].sender, "carol") == 0 && rs[4].msg[0] == 0);
  CHECK(kvp_nq_len(q) == 0);
  kvp_nq_drain(q, buf, sizeof buf, &size, &count, &needed);
  CHECK(size == 0 && count == 0 && needed == 0);

  /* Only whole records; the rest stay queued and needed names the next. */
  CHECK_ERR(push(q, "alice", "0123456789"), 0, NULL); /* 8+5+10 = 23 */
  CHECK_ERR(push(q, "alice", "x"), 0, NULL);          /* 14 */
  CHECK_ERR(push(q, "bob", "yy"), 0, NULL);           /* 13 */
  kvp_nq_drain(q, NULL, 0, &size, &count, &needed);
  CHECK(size == 0 && count == 0 && needed == 23);
  kvp_nq_drain(q, buf, 22, &size, &count, &needed);
  CHECK(size == 0 && count == 0 && needed == 23);
  kvp_nq_drain(q, buf, 30, &size, &count, &needed);
  CHECK(size == 23 && count == 1 && needed == 14);
  /* alice keeps her place before bob: her remaining record is older. */
  CHECK_ERR(push(q, "alice", "z"), 0, NULL);
  kvp_nq_drain(q, buf, 28, &size, &count, &needed);
  CHECK(count == 2 && size == 28 && needed == 13);
  CHECK(parse_records(buf, size, rs, 16) == 2 && strcmp(rs[0].msg, "x") == 0 && strcmp(rs[1].msg, "z") == 0);
  kvp_nq_drain(q, buf, sizeof buf, &size, &count, &needed);
  CHECK(count == 1 && needed == 0 && parse_records(buf, size, rs, 16) == 1 && strcmp(rs[0].sender, "bob") == 0);

  /* Bad input. */
  CHECK_ERR(kvp_nq_push(q, "", 0, NULL, 0), KVP_ERR_INVALID_PARAM, "sender name");
  CHECK_ERR(kvp_nq_push(q, NULL, 3, NULL, 0), KVP_ERR_INVALID_PARAM, "sender name");
  char longname[300];
  memset(longname, 'n', sizeof longname);
  CHECK_ERR(kvp_nq_push(q, longname, 256, NULL, 0), KVP_ERR_INVALID_PARAM, "1..255");
  CHECK_ERR(kvp_nq_push(q, longname, 255, NULL, 0), 0, NULL);
  CHECK_ERR(kvp_nq_push(q, "a", 1, NULL, 5), KVP_ERR_INVALID_PARAM, "message");
  kvp_nq_drain(q, buf, sizeof buf, &size, &count, &needed);
  CHECK(count == 1 && size == 8 + 255);
  kvp_nq_destroy(q);

  /* Bounded queue. */
  q = kvp_nq_create(40);
  CHECK_ERR(push(q, "ab", "0123456789"), 0, NULL); /* 20 */
  CHECK_ERR(push(q, "ab", "0123456789"), 0, NULL); /* 40 */
  CHECK_ERR(push(q, "ab", ""), KVP_ERR_BACKEND, "notification queue full");
  kvp_nq_drain(q, buf, 20, &size, &count, &needed);
  CHECK(count == 1);
  CHECK_ERR(push(q, "ab", "0123456789"), 0, NULL);
  CHECK_ERR(push(q, "ab", "0123456789012345678901234567890123456789"), KVP_ERR_BACKEND, NULL);
  kvp_nq_destroy(q); /* frees what is still queued */
}

/* 8 producers push numbered messages while a consumer drains; every message
 * arrives exactly once and each sender's arrive in order. */
typedef struct {
  kvp_notif_queue *q;
  int id;
} prod_ctx;
enum { PROD_MSGS = 3000 };

static void *producer(void *p) {
  prod_ctx *c = (prod_ctx *)p;
  char sender[16], msg[16];
  snprintf(sender, sizeof sender, "peer%d", c->id);
  for (int i = 0; i < PROD_MSGS; i++) {
    snprintf(msg, sizeof msg, "%d", i);
    kvp_error *e = push(c->q, sender, msg);
    if (e) {
      kvp_err_free(e);
      i--; /* cannot happen with an unbounded queue; retry to keep the count */
    }
  }
  return NULL;
}

static void test_notif_queue_concurrent(void) {
  kvp_notif_queue *q = kvp_nq_create(0);
  pthread_t th[8];
  prod_ctx cs[8];
  for (int i = 0; i < 8; i++) {
    cs[i].q = q;
    cs[i].id = i;
    pthread_create(&th[i], NULL, producer, &cs[i]);
  }
  int next[8] = {0};
  int total = 0, bad = 0;
  uint8_t buf[512];
  for (int spins = 0; total < 8 * PROD_MSGS && spins < 10000000; spins++) {
    size_t size, count, needed;
    kvp_nq_drain(q, buf, sizeof buf, &size, &count, &needed);
    size_t off = 0;
    while (off < size) {
      uint32_t sl = kvp_get_u32(buf + off), ml = kvp_get_u32(buf + off + 4);
      char s[32] = {0}, m[32] = {0};
      memcpy(s, buf + off + 8, sl);
      memcpy(m, buf + off + 8 + sl, ml);
      int id = atoi(s + 4), v = atoi(m);
      if (id < 0 || id >= 8 || v != next[id]) bad++;
      if (id >= 0 && id < 8) next[id] = v + 1;
      off += 8 + sl + ml;
      total++;
    }
    if (count == 0) sched_yield();
  }
  for (int i = 0; i < 8; i++) pthread_join(th[i], NULL);
  CHECK(bad == 0);
  CHECK(total == 8 * PROD_MSGS);
  CHECK(kvp_nq_len(q) == 0);
  kvp_nq_destroy(q);
}

/* Pages of [p, p + n * page) present in this process's page tables (bit 63
 * of each /proc/self/pagemap entry); -1 if pagemap cannot be read. */
static long pages_present(const uint8_t *p, size_t n, size_t page) {
  FILE *f = fopen("/proc/self/pagemap", "rb");
  if (!f) return -1;
  long present = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t e = 0;
    if (fseek(f, (long)(((uintptr_t)p / page + i) * sizeof e), SEEK_SET) != 0 ||
        fread(&e, sizeof e, 1, f) != 1) {
      present = -1;
      break;
    }
    present += (long)(e >> 63);
  }
  fclose(f);
  return present;
}

static void test_prefault(void) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE), n = 3000; /* three batches */
  /* A shared mapping nobody has touched: no page is mapped yet. */
  uint8_t *m = (uint8_t *)mmap(NULL, (n + 1) * page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  CHECK(m != MAP_FAILED);
  if (m == MAP_FAILED) return;
  CHECK(pages_present(m, n + 1, page) == 0);
  m[5 * page + 7] = 0xA5; /* one page with a byte the pass must keep */
  /* From an unaligned start to an unaligned end: every page it spans. */
  CHECK(kvp_prefault_for_kernel((uint64_t)(uintptr_t)(m + 100), n * page - 200) == n * page - 200);
  CHECK(pages_present(m, n, page) == (long)n);
  CHECK(pages_present(m + n * page, 1, page) == 0); /* nothing past the range */
  CHECK(m[5 * page + 7] == 0xA5 && m[5 * page + 6] == 0);
  /* A page it cannot read ends the pass there: PROT_NONE from page 2000. */
  uint8_t *g = (uint8_t *)mmap(NULL, n * page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  CHECK(g != MAP_FAILED);
  if (g != MAP_FAILED) {
    CHECK(mprotect(g + 2000 * page, (n - 2000) * page, PROT_NONE) == 0);
    CHECK(kvp_prefault_for_kernel((uint64_t)(uintptr_t)g, n * page) == 2000 * page);
    CHECK(pages_present(g, 2000, page) == 2000);
    munmap(g, n * page);
  }
  CHECK(kvp_prefault_for_kernel((uint64_t)(uintptr_t)m, 0) == 0);
  munmap(m, (n + 1) * page);
}

int main(void) {
  test_errors();
  test_check_args();
  test_handles_basic();
  test_handles_remove_waits();
  test_handles_concurrent();
  test_handles_lockfree_race();
  test_params();
  test_ranges();
  test_out_and_reader();
  test_notif_queue();
  test_notif_queue_concurrent();
  test_prefault();
  if (failures) {
    fprintf(stderr, "test_kvp_util: %d of %d checks FAILED\n", failures, checks);
    return 1;
  }
  printf("test_kvp_util: all %d checks passed\n", checks);
  return 0;
}
