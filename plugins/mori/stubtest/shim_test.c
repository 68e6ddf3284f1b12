/*
 * shim_test.c: drives the mori plugin through its kvp_api table, linked with
 * the stand-ins mori_stub.cc (as libmori_io.so) and ibverbs_stub.c (as
 * libibverbs.so.1) instead of MORI and libibverbs (see stubtest/run.sh).
 * Every ABI entry, the error cases, and bytes verified after each transfer.
 * Exits 0 when every check passed; prints each failed check.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kvplugin.h"

static const kvp_api *api;
static int failures, checks;

#define CHECK(cond, ...)                                        \
  do {                                                          \
    checks++;                                                   \
    if (!(cond)) {                                              \
      failures++;                                               \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                             \
      fprintf(stderr, "\n");                                    \
    }                                                           \
  } while (0)

/* Returns the error code (0 for success) and frees the error; copies the
 * message into msg when given. */
static kvp_status take(kvp_error *e, char *msg, size_t cap) {
  if (msg && cap) msg[0] = 0;
  if (!e) return 0;
  kvp_error_code_args c = {KVP_ERROR_CODE_ARGS_STRUCT_SIZE, NULL, e, 0};
  api->error_code(&c);
  kvp_error_message_args m = {KVP_ERROR_MESSAGE_ARGS_STRUCT_SIZE, NULL, e, NULL, 0};
  api->error_message(&m);
  if (msg && cap) snprintf(msg, cap, "%.*s", (int)m.message_len, m.message);
  if (getenv("SHIM_TEST_VERBOSE")) fprintf(stderr, "  error %d: %.*s\n", c.code, (int)m.message_len, m.message);
  kvp_error_destroy_args d = {KVP_ERROR_DESTROY_ARGS_STRUCT_SIZE, NULL, e};
  api->error_destroy(&d);
  return c.code;
}

static kvp_param P(const char *k, const char *v) {
  kvp_param p = {k, strlen(k), v, strlen(v)};
  return p;
}

static kvp_status create_agent(const char *name, const kvp_param *params, size_t n, kvp_agent *out,
                               uint64_t *caps) {
  kvp_agent_create_args a = {KVP_AGENT_CREATE_ARGS_STRUCT_SIZE, NULL, name, strlen(name), params,
                             n, 0, 0};
  kvp_status s = take(api->agent_create(&a), NULL, 0);
  if (out) *out = a.agent;
  if (caps) *caps = a.caps;
  return s;
}

static kvp_status destroy_agent(kvp_agent a) {
  kvp_agent_destroy_args d = {KVP_AGENT_DESTROY_ARGS_STRUCT_SIZE, NULL, a};
  return take(api->agent_destroy(&d), NULL, 0);
}

static kvp_status reg(kvp_agent a, void *p, uint64_t len, kvp_mem_kind kind, uint64_t dev,
                      kvp_region *out) {
  kvp_mem_desc d = {(uint64_t)(uintptr_t)p, len, dev, kind, 0};
  kvp_region r = 0;
  kvp_register_mem_args args = {KVP_REGISTER_MEM_ARGS_STRUCT_SIZE, NULL, a, &d, 1, &r};
  kvp_status s = take(api->register_mem(&args), NULL, 0);
  if (out) *out = r;
  return s;
}

static kvp_status dereg(kvp_agent a, kvp_region r) {
  kvp_deregister_mem_args args = {KVP_DEREGISTER_MEM_ARGS_STRUCT_SIZE, NULL, a, &r, 1};
  return take(api->deregister_mem(&args), NULL, 0);
}

/* Metadata of `from`, loaded into `into`; returns the peer name length. */
static kvp_status exchange(kvp_agent from, kvp_agent into, char *peer, size_t cap) {
  kvp_local_metadata_args q = {KVP_LOCAL_METADATA_ARGS_STRUCT_SIZE, NULL, from, NULL, 0, 0};
  kvp_status s = take(api->local_metadata(&q), NULL, 0);
  if (s) return s;
  uint8_t *buf = malloc(q.size);
  kvp_local_metadata_args g = {KVP_LOCAL_METADATA_ARGS_STRUCT_SIZE, NULL, from, buf, q.size, 0};
  s = take(api->local_metadata(&g), NULL, 0);
  if (!s) {
    kvp_load_remote_args l = {KVP_LOAD_REMOTE_ARGS_STRUCT_SIZE, NULL, into, buf, g.size, NULL, 0};
    s = take(api->load_remote(&l), NULL, 0);
    if (!s) snprintf(peer, cap, "%.*s", (int)l.peer_name_len, l.peer_name);
  }
  free(buf);
  return s;
}

static kvp_status import(kvp_agent owner, kvp_region r, kvp_agent into, const char *peer,
                         kvp_remote_region_import_args *out) {
  uint8_t blob[4096];
  kvp_region_export_args e = {KVP_REGION_EXPORT_ARGS_STRUCT_SIZE, NULL, owner, r, blob,
                              sizeof blob, 0};
  kvp_status s = take(api->region_export(&e), NULL, 0);
  if (s) return s;
  memset(out, 0, sizeof *out);
  out->struct_size = KVP_REMOTE_REGION_IMPORT_ARGS_STRUCT_SIZE;
  out->agent = into;
  out->peer_name = peer;
  out->peer_name_len = strlen(peer);
  out->blob = blob;
  out->blob_len = e.size;
  return take(api->remote_region_import(out), NULL, 0);
}

static kvp_status make(kvp_agent a, kvp_op op, const kvp_region_pair *pairs, size_t np,
                       const kvp_batch_entry *ents, size_t ne, kvp_xfer *x) {
  kvp_make_batch_xfer_args m;
  memset(&m, 0, sizeof m);
  m.struct_size = KVP_MAKE_BATCH_XFER_ARGS_STRUCT_SIZE;
  m.agent = a;
  m.op = op;
  m.pairs = pairs;
  m.num_pairs = np;
  m.entries = ents;
  m.num_entries = ne;
  kvp_status s = take(api->make_batch_xfer(&m), NULL, 0);
  *x = m.xfer;
  return s;
}

static kvp_status post(kvp_agent a, kvp_xfer x, kvp_status *st) {
  kvp_post_xfer_args p = {KVP_POST_XFER_ARGS_STRUCT_SIZE, NULL, a, x, 0};
  kvp_status s = take(api->post_xfer(&p), NULL, 0);
  if (st) *st = p.status;
  return s;
}

static kvp_status poll1(kvp_agent a, kvp_xfer x, kvp_status *st, char *msg, size_t cap) {
  kvp_poll_xfer_args p;
  memset(&p, 0, sizeof p);
  p.struct_size = KVP_POLL_XFER_ARGS_STRUCT_SIZE;
  p.agent = a;
  p.xfer = x;
  kvp_status s = take(api->poll_xfer(&p), msg, cap);
  if (st) *st = p.status;
  return s;
}

/* Polls until not in progress (at most ~5 s); returns the poll's code. */
static kvp_status wait_done(kvp_agent a, kvp_xfer x, int *polls_in_prog) {
  for (int i = 0; i < 5000; i++) {
    kvp_status st = 0;
    kvp_status s = poll1(a, x, &st, NULL, 0);
    if (s) return s;
    if (st == KVP_SUCCESS) return 0;
    if (polls_in_prog) (*polls_in_prog)++;
    usleep(1000);
  }
  return KVP_IN_PROG;
}

static kvp_status release(kvp_agent a, kvp_xfer x) {
  kvp_release_xfer_args r = {KVP_RELEASE_XFER_ARGS_STRUCT_SIZE, NULL, a, x};
  return take(api->release_xfer(&r), NULL, 0);
}

static void fill(uint8_t *p, size_t n, uint8_t seed) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(seed + i * 7);
}

/* ------------------------------------------------------------------------ */

struct conc {
  kvp_agent a;
  kvp_xfer x;
  kvp_status rc;
};

static void *conc_post(void *p) {
  struct conc *c = p;
  c->rc = post(c->a, c->x, NULL);
  if (!c->rc) c->rc = wait_done(c->a, c->x, NULL);
  return NULL;
}

static kvp_status create_msg(const char *name, const kvp_param *params, size_t n, kvp_agent *out,
                             char *msg, size_t cap) {
  kvp_agent_create_args a = {KVP_AGENT_CREATE_ARGS_STRUCT_SIZE, NULL, name, strlen(name), params,
                             n, 0, 0};
  kvp_status s = take(api->agent_create(&a), msg, cap);
  if (out) *out = a.agent;
  return s;
}

static kvp_status reg_msg(kvp_agent a, void *p, uint64_t len, kvp_mem_kind kind, uint64_t dev,
                          kvp_region *out, char *msg, size_t cap) {
  kvp_mem_desc d = {(uint64_t)(uintptr_t)p, len, dev, kind, 0};
  kvp_region r = 0;
  kvp_register_mem_args args = {KVP_REGISTER_MEM_ARGS_STRUCT_SIZE, NULL, a, &d, 1, &r};
  kvp_status s = take(api->register_mem(&args), msg, cap);
  if (out) *out = r;
  return s;
}

/* From the stand-ins (stubtest/mori_stub.cc, stubtest/ibverbs_stub.c). */
void mori_stub_last_rdma_config(long out[12]);
int fake_ibv_live(void);

/* Run against a libmori_io.so other than the one the shim was built with
 * (--expect-mismatch): loading must be refused, naming both libraries. The
 * runner passes their identities in SHIM_TEST_BUILT_ID and
 * SHIM_TEST_LOADED_ID. */
static int expect_mismatch(void) {
  const char *built = getenv("SHIM_TEST_BUILT_ID"), *loaded = getenv("SHIM_TEST_LOADED_ID");
  CHECK(built && loaded && strcmp(built, loaded) != 0, "runner must pass two different ids");
  if (!built || !loaded) built = loaded = "?";
  char msg[1024];
  kvp_plugin_info_args info = {KVP_PLUGIN_INFO_ARGS_STRUCT_SIZE};
  CHECK(take(api->plugin_info(&info), msg, sizeof msg) == KVP_ERR_MISMATCH, "plugin_info refused");
  CHECK(strstr(msg, built) && strstr(msg, loaded) && strstr(msg, "libmori_io.so") &&
            strstr(msg, "sizeof IOEngine"),
        "names both libraries and the layout: %s", msg);
  CHECK(create_msg("x", NULL, 0, NULL, msg, sizeof msg) == KVP_ERR_MISMATCH &&
            strstr(msg, loaded),
        "agent_create refused: %s", msg);
  printf("shim_test --expect-mismatch: %d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}

/* --reg-mode MODE: the shim built with KVHOST_MORI_REG=MODE refuses what
 * that MORI build could not register (stubtest/run.sh builds it). */
static int check_reg_mode(const char *mode) {
  static uint8_t buf[1 << 14];
  char msg[1024];
  kvp_agent x = 0;
  kvp_region r = 0;
  CHECK(create_agent("regmode", NULL, 0, &x, NULL) == 0 && x, "create");
  if (strcmp(mode, "ibv") == 0) {
    /* Before 09ad89c4 MORI has no dmabuf fallback. */
    setenv("FAKE_IBV_REG_FAIL", "*", 1);
    CHECK(reg_msg(x, buf, 4096, KVP_MEM_VRAM, 0, &r, msg, sizeof msg) == KVP_ERR_BACKEND &&
              strstr(msg, "ibv_reg_mr only") && strstr(msg, "peer-memory"),
          "VRAM refused although dmabuf would work: %s", msg);
    unsetenv("FAKE_IBV_REG_FAIL");
    CHECK(reg_msg(x, buf, 4096, KVP_MEM_VRAM, 0, &r, msg, sizeof msg) == 0, "VRAM ok: %s", msg);
  } else if (strcmp(mode, "auto-offset0") == 0) {
    /* 09ad89c4 up to 0d05a4d2: dmabuf at offset 0. */
    setenv("FAKE_IBV_REG_FAIL", "*", 1);
    setenv("MORI_STUB_DMABUF_OFFSET", "4096", 1);
    CHECK(reg_msg(x, buf, 4096, KVP_MEM_VRAM, 0, &r, msg, sizeof msg) == KVP_ERR_BACKEND &&
              strstr(msg, "4096 bytes into its GPU allocation") && strstr(msg, "0d05a4d2"),
          "a view inside its allocation is refused: %s", msg);
    setenv("MORI_STUB_DMABUF_OFFSET", "0", 1);
    CHECK(reg_msg(x, buf, 4096, KVP_MEM_VRAM, 0, &r, msg, sizeof msg) == 0 && r,
          "a whole allocation through dmabuf is fine: %s", msg);
    CHECK(dereg(x, r) == 0, "dereg");
    unsetenv("FAKE_IBV_REG_FAIL");
    /* ibv_reg_mr works, but MORI_ENABLE_DMABUF_REG puts dmabuf first. */
    setenv("MORI_STUB_DMABUF_OFFSET", "4096", 1);
    setenv("MORI_ENABLE_DMABUF_REG", "1", 1);
    CHECK(reg_msg(x, buf, 4096, KVP_MEM_VRAM, 0, &r, msg, sizeof msg) == KVP_ERR_BACKEND &&
              strstr(msg, "MORI_ENABLE_DMABUF_REG"),
          "dmabuf first on a view is refused: %s", msg);
    setenv("MORI_ENABLE_DMABUF_REG", "off", 1);
    CHECK(reg_msg(x, buf, 4096, KVP_MEM_VRAM, 0, &r, msg, sizeof msg) == 0,
          "MORI_ENABLE_DMABUF_REG=off: ibv_reg_mr goes first: %s", msg);
    unsetenv("MORI_ENABLE_DMABUF_REG");
    unsetenv("MORI_STUB_DMABUF_OFFSET");
  } else {
    CHECK(0, "unknown mode %s", mode);
  }
  CHECK(x && destroy_agent(x) == 0, "destroy");
  CHECK(fake_ibv_live() == 0, "%d NIC objects left open", fake_ibv_live());
  printf("shim_test --reg-mode %s: %d checks, %d failed\n", mode, checks, failures);
  return failures ? 1 : 0;
}

/* The refusals that stand in for MORI failing silently or fatally: a
 * library whose IOEngine is larger than the headers', MORI's XGMI-only
 * fallback, and memory MORI could not register with a NIC. Also that the
 * RdmaBackendConfig parameters reach MORI. */
static void check_refusals(void) {
  char msg[1024];
  kvp_agent x = 0;
  long cfg[12];

  /* RdmaBackendConfig parameters reach CreateBackend. */
  kvp_param rc[] = {P("num_nics_per_transfer", "2"), P("transfer_chunking", "1"),
                    P("chunk_bytes", "8192"),        P("max_chunks_per_transfer", "8"),
                    P("max_send_wr", "256"),         P("max_cqe", "1024"),
                    P("max_msg_sge", "2"),           P("qp_per_transfer", "3")};
  CHECK(create_agent("cfg", rc, 8, &x, NULL) == 0 && x, "create with RDMA settings");
  mori_stub_last_rdma_config(cfg);
  CHECK(cfg[0] == 3 && cfg[4] == 0 && cfg[5] == 2 && cfg[6] == 1 && cfg[7] == 8192 &&
            cfg[8] == 8 && cfg[9] == 256 && cfg[10] == 1024 && cfg[11] == 2,
        "settings reached RdmaBackendConfig: qp %ld notif %ld nics %ld chunking %ld bytes %ld "
        "chunks %ld wr %ld cqe %ld sge %ld",
        cfg[0], cfg[4], cfg[5], cfg[6], cfg[7], cfg[8], cfg[9], cfg[10], cfg[11]);
  CHECK(x && destroy_agent(x) == 0, "destroy cfg");
  CHECK(create_agent("d", NULL, 0, &x, NULL) == 0, "create with defaults");
  mori_stub_last_rdma_config(cfg);
  CHECK(cfg[0] == 4 && cfg[1] == -1 && cfg[2] == 4 && cfg[5] == 1 && cfg[6] == 0 &&
            cfg[7] == 65536 && cfg[8] == 64 && cfg[9] == 0 && cfg[10] == 0 && cfg[11] == 0,
        "defaults are MORI's (and SGLang's for qp/workers)");
  CHECK(destroy_agent(x) == 0, "destroy d");
  kvp_param bad_chunk[] = {P("chunk_bytes", "100")};
  CHECK(create_agent("x", bad_chunk, 1, NULL, NULL) == KVP_ERR_INVALID_PARAM, "chunk_bytes < 4096");
  kvp_param bad_nics[] = {P("num_nics_per_transfer", "0")};
  CHECK(create_agent("x", bad_nics, 1, NULL, NULL) == KVP_ERR_INVALID_PARAM, "0 NICs");
  kvp_param bad_bool[] = {P("intra_node_only", "maybe")};
  CHECK(create_agent("x", bad_bool, 1, NULL, NULL) == KVP_ERR_INVALID_PARAM, "bool param");

  /* A libmori_io.so whose IOEngine grew (a member added) is refused. */
  setenv("MORI_STUB_GROW", "16", 1);
  CHECK(create_msg("grown", NULL, 0, &x, msg, sizeof msg) == KVP_ERR_MISMATCH &&
            strstr(msg, "sizeof(IOEngine)") && strstr(msg, "libmori_io.so"),
        "grown IOEngine refused: %s", msg);
  unsetenv("MORI_STUB_GROW");

  /* MORI's XGMI-only fallback (port 1) is refused unless asked for. */
  setenv("MORI_STUB_XGMI_ONLY", "1", 1);
  CHECK(create_msg("xgmi", NULL, 0, &x, msg, sizeof msg) == KVP_ERR_BACKEND &&
            strstr(msg, "MORI_DISABLE_AUTO_XGMI") && strstr(msg, "intra_node_only=1"),
        "XGMI-only refused: %s", msg);
  kvp_param intra[] = {P("intra_node_only", "1")};
  setenv("FAKE_IBV_NICS", "", 1); /* no NIC at all: no probe either */
  CHECK(create_agent("xgmi", intra, 1, &x, NULL) == 0 && x, "XGMI-only with intra_node_only=1");
  {
    static uint8_t buf[4096];
    kvp_region r = 0;
    CHECK(reg_msg(x, buf, sizeof buf, KVP_MEM_DRAM, 0, &r, msg, sizeof msg) == 0 && r,
          "XGMI-only registers without a NIC probe: %s", msg);
  }
  CHECK(x && destroy_agent(x) == 0, "destroy xgmi");
  unsetenv("FAKE_IBV_NICS");
  unsetenv("MORI_STUB_XGMI_ONLY");

  /* Registration probe. */
  static uint8_t host[1 << 14], vram[1 << 14];
  kvp_region r = 0;
  CHECK(create_agent("probe", NULL, 0, &x, NULL) == 0 && x, "create probe");
  setenv("FAKE_IBV_REG_FAIL", "*", 1);
  CHECK(reg_msg(x, host, sizeof host, KVP_MEM_DRAM, 0, &r, msg, sizeof msg) == KVP_ERR_BACKEND &&
            strstr(msg, "fake0") && strstr(msg, "ibv_reg_mr") && strstr(msg, "nothing was registered"),
        "host memory the NIC refuses is refused up front: %s", msg);
  /* VRAM: MORI (auto registration, >= 0d05a4d2) falls back to dmabuf. */
  CHECK(reg_msg(x, vram, 4096, KVP_MEM_VRAM, 0, &r, msg, sizeof msg) == 0 && r,
        "VRAM that registers through dmabuf is accepted: %s", msg);
  CHECK(dereg(x, r) == 0, "dereg vram");
  setenv("MORI_STUB_DMABUF_OFFSET", "8192", 1); /* a view inside its allocation */
  CHECK(reg_msg(x, vram, 4096, KVP_MEM_VRAM, 0, &r, msg, sizeof msg) == 0 && r,
        "from 0d05a4d2 MORI registers a view at its offset: %s", msg);
  CHECK(dereg(x, r) == 0, "dereg view");
  unsetenv("MORI_STUB_DMABUF_OFFSET");
  setenv("FAKE_IBV_DMABUF_FAIL", "*", 1);
  CHECK(reg_msg(x, vram, 4096, KVP_MEM_VRAM, 0, &r, msg, sizeof msg) == KVP_ERR_BACKEND &&
            strstr(msg, "ibv_reg_dmabuf_mr"),
        "VRAM that neither way registers is refused: %s", msg);
  unsetenv("FAKE_IBV_DMABUF_FAIL");
  setenv("MORI_STUB_DMABUF_FAIL", "1", 1);
  CHECK(reg_msg(x, vram, 4096, KVP_MEM_VRAM, 0, &r, msg, sizeof msg) == KVP_ERR_BACKEND &&
            strstr(msg, "hsa_amd_portable_export_dmabuf"),
        "VRAM without a dmabuf export is refused: %s", msg);
  unsetenv("MORI_STUB_DMABUF_FAIL");
  unsetenv("FAKE_IBV_REG_FAIL");
  CHECK(reg_msg(x, host, sizeof host, KVP_MEM_DRAM, 0, &r, msg, sizeof msg) == 0 && r,
        "the refused range was not kept: %s", msg);
  CHECK(fake_ibv_live() == 1, "probe left %d NIC objects open (want its one PD)", fake_ibv_live());
  CHECK(destroy_agent(x) == 0, "destroy probe");
  CHECK(fake_ibv_live() == 0, "agent_destroy left %d NIC objects open", fake_ibv_live());

  /* Every NIC MORI may use is probed; MORI_RDMA_DEVICES and port state
   * narrow them as in MORI. */
  setenv("FAKE_IBV_NICS", "nic_a,nic_b,nic_c", 1);
  setenv("FAKE_IBV_REG_FAIL", "nic_b", 1);
  CHECK(create_agent("multi", NULL, 0, &x, NULL) == 0, "create multi");
  CHECK(reg_msg(x, host, sizeof host, KVP_MEM_DRAM, 0, &r, msg, sizeof msg) == KVP_ERR_BACKEND &&
            strstr(msg, "nic_b") && strstr(msg, "MORI_RDMA_DEVICES"),
        "one NIC that cannot register refuses the region: %s", msg);
  CHECK(destroy_agent(x) == 0, "destroy multi");
  setenv("MORI_RDMA_DEVICES", "^nic_b", 1);
  CHECK(create_agent("multi", NULL, 0, &x, NULL) == 0, "create multi ^nic_b");
  CHECK(reg_msg(x, host, sizeof host, KVP_MEM_DRAM, 0, &r, msg, sizeof msg) == 0,
        "a NIC MORI_RDMA_DEVICES excludes is not probed: %s", msg);
  CHECK(fake_ibv_live() == 2, "two PDs (nic_a, nic_c), got %d", fake_ibv_live());
  CHECK(destroy_agent(x) == 0, "destroy multi ^nic_b");
  setenv("MORI_RDMA_DEVICES", "nic_b", 1);
  CHECK(create_agent("multi", NULL, 0, &x, NULL) == 0, "create multi nic_b");
  CHECK(reg_msg(x, host, sizeof host, KVP_MEM_DRAM, 0, &r, msg, sizeof msg) == KVP_ERR_BACKEND &&
            strstr(msg, "nic_b"),
        "the listed NIC is probed: %s", msg);
  CHECK(destroy_agent(x) == 0, "destroy multi nic_b");
  unsetenv("MORI_RDMA_DEVICES");
  setenv("FAKE_IBV_DOWN", "nic_b", 1);
  CHECK(create_agent("multi", NULL, 0, &x, NULL) == 0, "create multi down");
  CHECK(reg_msg(x, host, sizeof host, KVP_MEM_DRAM, 0, &r, msg, sizeof msg) == 0,
        "a NIC whose port is down is not probed: %s", msg);
  CHECK(destroy_agent(x) == 0, "destroy multi down");
  unsetenv("FAKE_IBV_DOWN");
  kvp_param noprobe[] = {P("probe_registration", "0")};
  CHECK(create_agent("multi", noprobe, 1, &x, NULL) == 0, "create probe_registration=0");
  CHECK(reg_msg(x, host, sizeof host, KVP_MEM_DRAM, 0, &r, msg, sizeof msg) == 0,
        "probe_registration=0 registers unchecked: %s", msg);
  CHECK(destroy_agent(x) == 0, "destroy noprobe");
  setenv("FAKE_IBV_NICS", "", 1);
  CHECK(create_agent("none", NULL, 0, &x, NULL) == 0, "create without NICs");
  CHECK(reg_msg(x, host, sizeof host, KVP_MEM_DRAM, 0, &r, msg, sizeof msg) == KVP_ERR_BACKEND &&
            strstr(msg, "probe_registration=0"),
        "no NIC to probe on is said: %s", msg);
  CHECK(destroy_agent(x) == 0, "destroy none");
  unsetenv("FAKE_IBV_NICS");
  unsetenv("FAKE_IBV_REG_FAIL");
  CHECK(fake_ibv_live() == 0, "%d NIC objects left open", fake_ibv_live());
}

int main(int argc, char **argv) {
  kvp_get_api_args g = {KVP_GET_API_ARGS_STRUCT_SIZE, NULL, KVP_ABI_MAJOR + 1, 0, 0, 0, NULL};
  CHECK(kvp_plugin_get_api(&g) == KVP_ERR_NOT_SUPPORTED && g.api == NULL &&
            g.plugin_abi_major_min == KVP_ABI_MAJOR,
        "other major must be refused");
  g.host_abi_major = KVP_ABI_MAJOR;
  CHECK(kvp_plugin_get_api(&g) == KVP_SUCCESS && g.api, "get_api");
  api = g.api;
  CHECK(api->struct_size == KVP_API_STRUCT_SIZE, "api size");
  if (argc > 1 && strcmp(argv[1], "--expect-mismatch") == 0) return expect_mismatch();
  if (argc > 2 && strcmp(argv[1], "--reg-mode") == 0) return check_reg_mode(argv[2]);

  kvp_plugin_info_args info = {KVP_PLUGIN_INFO_ARGS_STRUCT_SIZE};
  CHECK(take(api->plugin_info(&info), NULL, 0) == 0, "plugin_info");
  CHECK(strcmp(info.name, "mori") == 0, "name %s", info.name);
  CHECK(strstr(info.version, "MORI stand-in") && strstr(info.version, "libmori_io.so build-id:"),
        "version names the MORI build: %s", info.version);
  CHECK(info.caps == (KVP_CAP_BATCH | KVP_CAP_STRIDED | KVP_CAP_TELEMETRY | KVP_CAP_REMOTE_BLOB |
                      KVP_CAP_SUBMIT | KVP_CAP_EVENT_FD),
        "caps 0x%llx", (unsigned long long)info.caps);
  CHECK(info.mem_kinds == (KVP_MEM_BIT(KVP_MEM_DRAM) | KVP_MEM_BIT(KVP_MEM_VRAM)), "mem kinds");
  CHECK(strstr(info.params_doc, "qp_per_transfer=4\t") && strstr(info.params_doc, "num_worker_threads=4\t") &&
            strstr(info.params_doc, "post_batch_size=-1\t") && strstr(info.params_doc, "poll_cq_mode=polling\t"),
        "params_doc defaults: %s", info.params_doc);
  CHECK(strstr(info.params_doc, "num_nics_per_transfer=1\t") &&
            strstr(info.params_doc, "transfer_chunking=0\t") &&
            strstr(info.params_doc, "chunk_bytes=65536\t") &&
            strstr(info.params_doc, "max_chunks_per_transfer=64\t") &&
            strstr(info.params_doc, "max_send_wr=0\t") && strstr(info.params_doc, "max_cqe=0\t") &&
            strstr(info.params_doc, "max_msg_sge=0\t") &&
            strstr(info.params_doc, "intra_node_only=0\t") &&
            strstr(info.params_doc, "probe_registration=1\t") &&
            strstr(info.params_doc, "MORI_IO_NUM_NICS_PER_TRANSFER wins"),
        "params_doc lists the RdmaBackendConfig settings: %s", info.params_doc);
  kvp_plugin_info_args shortinfo = {8};
  CHECK(take(api->plugin_info(&shortinfo), NULL, 0) == KVP_ERR_INVALID_PARAM, "short struct_size");

  /* ---- agent_create params ---- */
  kvp_param bad1[] = {P("bogus", "1")};
  CHECK(create_agent("x", bad1, 1, NULL, NULL) == KVP_ERR_INVALID_PARAM, "unknown param");
  kvp_param bad2[] = {P("host", "localhost")};
  CHECK(create_agent("x", bad2, 1, NULL, NULL) == KVP_ERR_INVALID_PARAM, "host name");
  kvp_param bad3[] = {P("port", "1")};
  CHECK(create_agent("x", bad3, 1, NULL, NULL) == KVP_ERR_INVALID_PARAM, "port 1");
  kvp_param bad4[] = {P("post_batch_size", "0")};
  CHECK(create_agent("x", bad4, 1, NULL, NULL) == KVP_ERR_INVALID_PARAM, "post_batch_size 0");
  kvp_param bad5[] = {P("poll_cq_mode", "busy")};
  CHECK(create_agent("x", bad5, 1, NULL, NULL) == KVP_ERR_INVALID_PARAM, "poll mode");
  kvp_param bad6[] = {P("host", "192.0.2.1")}; /* TEST-NET-1: not an address of this host */
  CHECK(create_agent("x", bad6, 1, NULL, NULL) == KVP_ERR_INVALID_PARAM, "non-local host");
  kvp_param bad7[] = {P("qp_per_transfer", "0")};
  CHECK(create_agent("x", bad7, 1, NULL, NULL) == KVP_ERR_INVALID_PARAM, "qp 0");
  CHECK(create_agent("", NULL, 0, NULL, NULL) == KVP_ERR_INVALID_PARAM, "empty name");
  {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd, (struct sockaddr *)&sa, sizeof sa);
    listen(fd, 1);
    socklen_t sl = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    char port[16];
    snprintf(port, sizeof port, "%u", ntohs(sa.sin_port));
    kvp_param busy[] = {P("port", port)};
    CHECK(create_agent("x", busy, 1, NULL, NULL) == KVP_ERR_NOT_ALLOWED, "port in use");
    close(fd);
  }
  setenv("MORI_STUB_CREATE_FAIL", "1", 1);
  CHECK(create_agent("x", NULL, 0, NULL, NULL) == KVP_ERR_BACKEND, "CreateBackend throws");
  unsetenv("MORI_STUB_CREATE_FAIL");

  check_refusals();

  /* ---- two agents ---- */
  kvp_agent A = 0, B = 0;
  uint64_t caps = 0;
  kvp_param pa[] = {P("host", "127.0.0.1"), P("port", "0"), P("qp_per_transfer", "2"),
                    P("post_batch_size", "16"), P("num_worker_threads", "2"),
                    P("poll_cq_mode", "event"), P("release_timeout_ms", "5000")};
  CHECK(create_agent("prefill-a", pa, 7, &A, &caps) == 0 && A, "create A");
  CHECK(caps == info.caps, "agent caps");
  CHECK(create_agent("decode-b", NULL, 0, &B, NULL) == 0 && B && B != A, "create B");

  enum { N = 1 << 16 };
  uint8_t *a1 = malloc(N), *a2 = malloc(N), *b1 = malloc(N), *b2 = malloc(N);
  fill(a1, N, 1);
  fill(a2, N, 2);
  memset(b1, 0, N);
  memset(b2, 0, N);
  kvp_region ra1, ra2, rb1, rb2;
  CHECK(reg(A, a1, N, KVP_MEM_DRAM, 0, &ra1) == 0, "reg a1");
  CHECK(reg(A, a2, N, KVP_MEM_DRAM, 0, &ra2) == 0, "reg a2");
  CHECK(reg(B, b1, N, KVP_MEM_DRAM, 0, &rb1) == 0, "reg b1");
  CHECK(reg(B, b2, N, KVP_MEM_DRAM, 0, &rb2) == 0, "reg b2");
  CHECK(reg(A, a1 + 100, 10, KVP_MEM_DRAM, 0, NULL) == KVP_ERR_INVALID_PARAM, "overlap");
  CHECK(reg(A, (uint8_t *)0x1000, 10, KVP_MEM_DRAM, 1, NULL) == KVP_ERR_INVALID_PARAM, "dram dev");
  CHECK(reg(A, (uint8_t *)0x1000, 10, 7, 0, NULL) == KVP_ERR_NOT_SUPPORTED, "kind 7");
  CHECK(reg(A, NULL, 10, KVP_MEM_DRAM, 0, NULL) == KVP_ERR_INVALID_PARAM, "addr 0");
  {
    /* all or nothing: the second desc overlaps, so the first must not stay */
    static uint8_t c[256];
    kvp_mem_desc d[2] = {{(uint64_t)(uintptr_t)c, 128, 0, KVP_MEM_DRAM, 0},
                         {(uint64_t)(uintptr_t)(c + 64), 128, 0, KVP_MEM_DRAM, 0}};
    kvp_region r[2];
    kvp_register_mem_args ra = {KVP_REGISTER_MEM_ARGS_STRUCT_SIZE, NULL, A, d, 2, r};
    CHECK(take(api->register_mem(&ra), NULL, 0) == KVP_ERR_INVALID_PARAM, "overlap in one call");
    kvp_region rc;
    CHECK(reg(A, c, 128, KVP_MEM_DRAM, 0, &rc) == 0, "first desc was not kept");
    CHECK(dereg(A, rc) == 0, "dereg c");
  }
  /* VRAM registration reaches MORI as GPU memory with the given device. */
  static uint8_t vram_like[64];
  kvp_region rv;
  CHECK(reg(B, vram_like, sizeof vram_like, KVP_MEM_VRAM, 3, &rv) == 0, "reg vram");

  char peer_b[256] = "", peer_a[256] = "";
  CHECK(exchange(B, A, peer_b, sizeof peer_b) == 0 && strcmp(peer_b, "decode-b") == 0,
        "A loads B: %s", peer_b);
  CHECK(exchange(A, B, peer_a, sizeof peer_a) == 0 && strcmp(peer_a, "prefill-a") == 0,
        "B loads A: %s", peer_a);
  CHECK(exchange(B, A, peer_b, sizeof peer_b) == 0, "reload is fine");
  {
    /* Another engine under B's key (a restarted B or an impostor, at another
     * port) is refused and A keeps B's descriptor: the transfers to B below
     * would otherwise go to B2's address, gone once B2 is destroyed. */
    kvp_agent B2 = 0;
    char peer_b2[256] = "";
    CHECK(create_agent("decode-b", NULL, 0, &B2, NULL) == 0 && B2, "create B2 under B's key");
    CHECK(exchange(B2, A, peer_b2, sizeof peer_b2) == KVP_ERR_NOT_ALLOWED,
          "another EngineDesc under a loaded key refused");
    CHECK(B2 && destroy_agent(B2) == 0, "destroy B2");
  }
  {
    uint8_t junk[] = {0x93, 0x01, 0x02};
    kvp_load_remote_args l = {KVP_LOAD_REMOTE_ARGS_STRUCT_SIZE, NULL, A, junk, sizeof junk};
    CHECK(take(api->load_remote(&l), NULL, 0) == KVP_ERR_INVALID_PARAM, "short EngineDesc");
    uint8_t junk2[] = {0xc1};
    l.metadata = junk2;
    l.metadata_len = 1;
    CHECK(take(api->load_remote(&l), NULL, 0) == KVP_ERR_INVALID_PARAM, "bad msgpack");
    uint8_t huge[] = {0xdd, 0xff, 0xff, 0xff, 0xff};
    l.metadata = huge;
    l.metadata_len = sizeof huge;
    CHECK(take(api->load_remote(&l), NULL, 0) == KVP_ERR_INVALID_PARAM, "4G-element array");
    /* a good blob plus a trailing byte */
    kvp_local_metadata_args q = {KVP_LOCAL_METADATA_ARGS_STRUCT_SIZE, NULL, B, NULL, 0, 0};
    take(api->local_metadata(&q), NULL, 0);
    uint8_t *md = malloc(q.size + 1);
    q.buf = md;
    q.cap = q.size;
    CHECK(take(api->local_metadata(&q), NULL, 0) == 0, "md");
    md[q.size] = 0;
    l.metadata = md;
    l.metadata_len = q.size + 1;
    CHECK(take(api->load_remote(&l), NULL, 0) == KVP_ERR_INVALID_PARAM, "trailing byte");
    /* buffer too small: size reported, nothing copied */
    uint8_t tiny[2] = {0xAA, 0xAA};
    kvp_local_metadata_args t = {KVP_LOCAL_METADATA_ARGS_STRUCT_SIZE, NULL, B, tiny, 2, 0};
    CHECK(take(api->local_metadata(&t), NULL, 0) == 0 && t.size == q.size && tiny[0] == 0xAA,
          "small buffer");
    free(md);
  }

  kvp_remote_region_import_args ib1, ib2, ibv;
  CHECK(import(B, rb1, A, "decode-b", &ib1) == 0, "import b1");
  CHECK(ib1.addr == (uint64_t)(uintptr_t)b1 && ib1.len == N && ib1.mem_kind == KVP_MEM_DRAM &&
            ib1.dev_id == 0,
        "import out fields");
  CHECK(import(B, rb2, A, "decode-b", &ib2) == 0, "import b2");
  CHECK(import(B, rv, A, "decode-b", &ibv) == 0 && ibv.mem_kind == KVP_MEM_VRAM && ibv.dev_id == 3,
        "import vram: kind %u dev %llu", ibv.mem_kind, (unsigned long long)ibv.dev_id);
  {
    kvp_remote_region_import_args x;
    CHECK(import(B, rb1, A, "someone-else", &x) == KVP_ERR_NOT_FOUND, "peer never loaded");
    CHECK(import(A, ra1, A, "decode-b", &x) == KVP_ERR_MISMATCH, "blob of another engine");
    CHECK(import(A, ra1, B, "prefill-a", &x) == 0, "B imports a1");
    kvp_remote_region_release_args rr = {KVP_REMOTE_REGION_RELEASE_ARGS_STRUCT_SIZE, NULL, B,
                                         x.rregion};
    CHECK(take(api->remote_region_release(&rr), NULL, 0) == 0, "release rregion");
    CHECK(take(api->remote_region_release(&rr), NULL, 0) == KVP_ERR_INVALID_PARAM, "twice");
    kvp_remote_region_import_args byaddr;
    memset(&byaddr, 0, sizeof byaddr);
    byaddr.struct_size = KVP_REMOTE_REGION_IMPORT_ARGS_STRUCT_SIZE;
    byaddr.agent = A;
    byaddr.peer_name = "decode-b";
    byaddr.peer_name_len = 8;
    byaddr.addr = (uint64_t)(uintptr_t)b1;
    byaddr.len = 16;
    CHECK(take(api->remote_region_import(&byaddr), NULL, 0) == KVP_ERR_NOT_SUPPORTED,
          "import by address");
    uint8_t badblob[] = {0x91, 0xa1, 'x'};
    byaddr.blob = badblob;
    byaddr.blob_len = sizeof badblob;
    CHECK(take(api->remote_region_import(&byaddr), NULL, 0) != 0, "short MemoryDesc");
    /* region_export of a foreign region */
    uint8_t blob[512];
    kvp_region_export_args e = {KVP_REGION_EXPORT_ARGS_STRUCT_SIZE, NULL, A, rb1, blob, sizeof blob, 0};
    CHECK(take(api->region_export(&e), NULL, 0) == KVP_ERR_INVALID_PARAM, "foreign region");
  }

  /* ---- WRITE: two pairs, plain and strided entries ---- */
  kvp_region_pair pairs[2] = {{ra1, ib1.rregion}, {ra2, ib2.rregion}};
  kvp_batch_entry ents[3] = {
      {0, 0, 0, 1000, 512, 0, 0, 1},      /* a1[0,512) -> b1[1000,1512) */
      {1, 0, 64, 0, 32, 128, 256, 16},    /* a2 blocks of 32 every 128 from 64 -> b2 every 256 */
      {0, 0, 4096, 8192, 2000, 0, 0, 1},  /* a1[4096,6096) -> b1[8192,10192) */
  };
  kvp_xfer xw = 0;
  CHECK(make(A, KVP_OP_WRITE, pairs, 2, ents, 3, &xw) == 0 && xw, "make write");
  {
    kvp_status st;
    CHECK(poll1(A, xw, &st, NULL, 0) == KVP_ERR_NOT_POSTED, "poll unposted");
    kvp_xfer_telemetry_args tel = {KVP_XFER_TELEMETRY_ARGS_STRUCT_SIZE, NULL, A, xw};
    CHECK(take(api->xfer_telemetry(&tel), NULL, 0) == KVP_ERR_NO_TELEMETRY, "telemetry early");
  }
  setenv("MORI_STUB_DELAY_MS", "30", 1);
  kvp_status st = 0;
  CHECK(post(A, xw, &st) == 0 && st == KVP_IN_PROG, "post write: st %d", st);
  CHECK(post(A, xw, NULL) == KVP_ERR_REPOST_ACTIVE, "repost while active");
  {
    kvp_xfer_telemetry_args tel = {KVP_XFER_TELEMETRY_ARGS_STRUCT_SIZE, NULL, A, xw};
    CHECK(take(api->xfer_telemetry(&tel), NULL, 0) == KVP_ERR_NO_TELEMETRY, "telemetry active");
  }
  int inprog = 0;
  CHECK(wait_done(A, xw, &inprog) == 0, "write completes");
  CHECK(inprog > 0, "poll saw in-progress first");
  unsetenv("MORI_STUB_DELAY_MS");
  CHECK(memcmp(b1 + 1000, a1, 512) == 0, "entry 0 bytes");
  CHECK(memcmp(b1 + 8192, a1 + 4096, 2000) == 0, "entry 2 bytes");
  {
    int ok = 1;
    for (int k = 0; k < 16; k++) ok &= memcmp(b2 + k * 256, a2 + 64 + k * 128, 32) == 0;
    CHECK(ok, "strided bytes");
    uint8_t zero[256] = {0};
    CHECK(memcmp(b2 + 32, zero, 224) == 0, "gaps untouched");
    CHECK(memcmp(b1, zero, 256) == 0, "b1 head untouched");
  }
  {
    kvp_xfer_telemetry_args tel = {KVP_XFER_TELEMETRY_ARGS_STRUCT_SIZE, NULL, A, xw};
    CHECK(take(api->xfer_telemetry(&tel), NULL, 0) == 0, "telemetry");
    CHECK(tel.total_bytes == 512 + 32 * 16 + 2000 && tel.desc_count == 3,
          "telemetry bytes %llu descs %llu", (unsigned long long)tel.total_bytes,
          (unsigned long long)tel.desc_count);
    CHECK(tel.xfer_us >= 25000 && tel.start_us > 1600000000000000ull, "telemetry times %llu %llu",
          (unsigned long long)tel.xfer_us, (unsigned long long)tel.start_us);
  }
  /* repost: the same bytes move again */
  memset(b1, 0, N);
  CHECK(post(A, xw, &st) == 0, "repost");
  CHECK(wait_done(A, xw, NULL) == 0 && memcmp(b1 + 1000, a1, 512) == 0, "repost bytes");

  /* deregister while a live transfer names the region */
  CHECK(dereg(A, ra1) == KVP_ERR_NOT_ALLOWED, "dereg in use");

  /* ---- READ ---- */
  fill(b2, N, 9);
  kvp_region_pair rp[1] = {{ra1, ib2.rregion}};
  kvp_batch_entry re[1] = {{0, 0, 100, 200, 300, 0, 0, 1}};
  kvp_xfer xr = 0;
  CHECK(make(A, KVP_OP_READ, rp, 1, re, 1, &xr) == 0, "make read");
  {
    /* a READ must move remote -> local: compare with copies of both sides
     * (a WRITE would also make the two ranges equal) */
    uint8_t want[300], remote_before[300];
    memcpy(want, b2 + 200, 300);
    memcpy(remote_before, b2 + 200, 300);
    CHECK(memcmp(a1 + 100, want, 300) != 0, "read test needs different bytes");
    CHECK(post(A, xr, NULL) == 0 && wait_done(A, xr, NULL) == 0, "read");
    CHECK(memcmp(a1 + 100, want, 300) == 0, "read bytes landed locally");
    CHECK(memcmp(b2 + 200, remote_before, 300) == 0, "read left the remote side alone");
  }
  CHECK(release(A, xr) == 0, "release read");

  /* ---- ABI 1.1: event descriptor, submit, poll-release ---- */
  {
    kvp_get_event_fd_args ef = {KVP_GET_EVENT_FD_ARGS_STRUCT_SIZE, NULL, A, -1};
    CHECK(take(api->get_event_fd(&ef), NULL, 0) == 0 && ef.fd >= 0, "get_event_fd");
    kvp_get_event_fd_args ef2 = {KVP_GET_EVENT_FD_ARGS_STRUCT_SIZE, NULL, A, -1};
    CHECK(take(api->get_event_fd(&ef2), NULL, 0) == 0 && ef2.fd == ef.fd, "get_event_fd again");
    struct pollfd pf = {ef.fd, POLLIN, 0};
    CHECK(poll(&pf, 1, 20) == 0, "idle: not readable");
    setenv("MORI_STUB_DELAY_MS", "20", 1);
    fill(a1, N, 21);
    kvp_make_batch_xfer_args m;
    memset(&m, 0, sizeof m);
    m.struct_size = KVP_MAKE_BATCH_XFER_ARGS_STRUCT_SIZE;
    m.agent = A;
    m.op = KVP_OP_WRITE;
    m.pairs = rp;
    m.num_pairs = 1;
    m.entries = re;
    m.num_entries = 1;
    kvp_submit_xfer_args sb = {KVP_SUBMIT_XFER_ARGS_STRUCT_SIZE, NULL, NULL, &m, 99};
    CHECK(take(api->submit_xfer(&sb), NULL, 0) == 0 && m.xfer && sb.status == KVP_IN_PROG,
          "submit: status %d", sb.status);
    /* completes with no poll: the descriptor says so */
    CHECK(poll(&pf, 1, 5000) == 1 && (pf.revents & POLLIN), "readable after the transfer ended");
    uint64_t cnt = 0;
    CHECK(read(ef.fd, &cnt, sizeof cnt) == (ssize_t)sizeof cnt && cnt >= 1, "drain");
    kvp_poll_xfer_args pl;
    memset(&pl, 0, sizeof pl);
    pl.struct_size = KVP_POLL_XFER_ARGS_STRUCT_SIZE;
    pl.agent = A;
    pl.xfer = m.xfer;
    pl.flags = KVP_POLL_RELEASE | KVP_POLL_TELEMETRY;
    CHECK(take(api->poll_xfer(&pl), NULL, 0) == 0 && pl.status == KVP_SUCCESS && pl.released == 1 &&
              pl.has_telemetry == 1 && pl.total_bytes == 300 && pl.desc_count == 1,
          "poll-release: status %d released %u tel %u bytes %llu", pl.status, pl.released,
          pl.has_telemetry, (unsigned long long)pl.total_bytes);
    CHECK(memcmp(b2 + 200, a1 + 100, 300) == 0, "submitted bytes");
    CHECK(release(A, m.xfer) == KVP_ERR_INVALID_PARAM, "released by the poll");
    unsetenv("MORI_STUB_DELAY_MS");
    pf.revents = 0;
    CHECK(poll(&pf, 1, 20) == 0, "idle again: not readable");
    /* the prepped form needs KVP_CAP_PREPPED; both or neither is refused */
    kvp_make_prepped_xfer_args mp;
    memset(&mp, 0, sizeof mp);
    mp.struct_size = KVP_MAKE_PREPPED_XFER_ARGS_STRUCT_SIZE;
    mp.agent = A;
    kvp_submit_xfer_args sp = {KVP_SUBMIT_XFER_ARGS_STRUCT_SIZE, NULL, &mp, NULL, 0};
    CHECK(take(api->submit_xfer(&sp), NULL, 0) == KVP_ERR_NOT_SUPPORTED, "submit prepped");
    kvp_submit_xfer_args sn = {KVP_SUBMIT_XFER_ARGS_STRUCT_SIZE, NULL, NULL, NULL, 0};
    CHECK(take(api->submit_xfer(&sn), NULL, 0) == KVP_ERR_INVALID_PARAM, "submit neither");
    /* a refused submit leaves no transfer */
    kvp_batch_entry oob = {0, 0, N - 10, 0, 20, 0, 0, 1};
    m.entries = &oob;
    m.xfer = 0;
    CHECK(take(api->submit_xfer(&sb), NULL, 0) == KVP_ERR_INVALID_PARAM && m.xfer == 0, "submit oob");
    /* an ABI 1.0 poll (1.0 struct_size): flags neither read nor written */
    kvp_xfer x10 = 0;
    CHECK(make(A, KVP_OP_WRITE, rp, 1, re, 1, &x10) == 0 && post(A, x10, NULL) == 0 &&
              wait_done(A, x10, NULL) == 0,
          "1.0 transfer");
    memset(&pl, 0, sizeof pl);
    pl.struct_size = KVP_POLL_XFER_ARGS_STRUCT_SIZE_1_0;
    pl.agent = A;
    pl.xfer = x10;
    pl.flags = KVP_POLL_RELEASE;
    pl.released = 77;
    CHECK(take(api->poll_xfer(&pl), NULL, 0) == 0 && pl.status == KVP_SUCCESS && pl.released == 77,
          "1.0 poll");
    CHECK(release(A, x10) == 0, "1.0 transfer still valid");
    read(ef.fd, &cnt, sizeof cnt); /* the 1.0 transfer's signal, if any */
  }

  /* ---- bad transfers: nothing built, nothing moved ---- */
  {
    kvp_xfer x;
    kvp_batch_entry oob = {0, 0, N - 10, 0, 20, 0, 0, 1};
    CHECK(make(A, KVP_OP_WRITE, pairs, 2, &oob, 1, &x) == KVP_ERR_INVALID_PARAM, "local oob");
    kvp_batch_entry oobr = {0, 0, 0, N - 10, 20, 0, 0, 1};
    CHECK(make(A, KVP_OP_WRITE, pairs, 2, &oobr, 1, &x) == KVP_ERR_INVALID_PARAM, "remote oob");
    kvp_batch_entry oobs = {1, 0, 0, 0, 32, 4096, 4096, 17};
    CHECK(make(A, KVP_OP_WRITE, pairs, 2, &oobs, 1, &x) == KVP_ERR_INVALID_PARAM, "strided oob");
    kvp_batch_entry bp = {2, 0, 0, 0, 8, 0, 0, 1};
    CHECK(make(A, KVP_OP_WRITE, pairs, 2, &bp, 1, &x) == KVP_ERR_INVALID_PARAM, "pair index");
    kvp_batch_entry z = {0, 0, 0, 0, 0, 0, 0, 1};
    CHECK(make(A, KVP_OP_WRITE, pairs, 2, &z, 1, &x) == KVP_ERR_INVALID_PARAM, "len 0");
    kvp_batch_entry ovf = {0, 0, UINT64_MAX - 4, 0, 8, 0, 0, 1};
    CHECK(make(A, KVP_OP_WRITE, pairs, 2, &ovf, 1, &x) == KVP_ERR_INVALID_PARAM, "overflow");
    CHECK(make(A, 9, pairs, 2, ents, 1, &x) == KVP_ERR_INVALID_PARAM, "op 9");
    kvp_region_pair foreign[1] = {{rb1, ib1.rregion}};
    CHECK(make(A, KVP_OP_WRITE, foreign, 1, ents, 1, &x) == KVP_ERR_INVALID_PARAM, "foreign");
    kvp_region_pair mixed[2] = {{ra1, ib1.rregion}, {ra2, 0}};
    CHECK(make(A, KVP_OP_WRITE, mixed, 2, ents, 1, &x) == KVP_ERR_INVALID_PARAM, "rregion 0");
    kvp_make_batch_xfer_args m;
    memset(&m, 0, sizeof m);
    m.struct_size = KVP_MAKE_BATCH_XFER_ARGS_STRUCT_SIZE;
    m.agent = A;
    m.op = KVP_OP_WRITE;
    m.pairs = pairs;
    m.num_pairs = 2;
    m.entries = ents;
    m.num_entries = 1;
    m.notif.has_notif = 1;
    CHECK(take(api->make_batch_xfer(&m), NULL, 0) == KVP_ERR_NOT_SUPPORTED, "notif");
    CHECK(post(B, xw, NULL) == KVP_ERR_INVALID_PARAM, "post on foreign agent");
  }
  /* unsupported capabilities answer NOT_SUPPORTED, not a crash */
  {
    kvp_prep_dlist_args pd = {KVP_PREP_DLIST_ARGS_STRUCT_SIZE};
    CHECK(take(api->prep_dlist(&pd), NULL, 0) == KVP_ERR_NOT_SUPPORTED, "prep");
    kvp_get_notifs_args gn = {KVP_GET_NOTIFS_ARGS_STRUCT_SIZE};
    CHECK(take(api->get_notifs(&gn), NULL, 0) == KVP_ERR_NOT_SUPPORTED, "get_notifs");
  }

  /* ---- empty transfer ---- */
  {
    kvp_xfer x;
    CHECK(make(A, KVP_OP_WRITE, pairs, 2, NULL, 0, &x) == 0, "make empty");
    CHECK(post(A, x, &st) == 0 && st == KVP_SUCCESS, "empty completes in post");
    CHECK(release(A, x) == 0, "release empty");
  }

  /* ---- failures reported by MORI statuses ---- */
  {
    kvp_xfer x;
    CHECK(make(A, KVP_OP_WRITE, pairs, 2, ents, 3, &x) == 0, "make");
    setenv("MORI_STUB_FAIL", "1", 1);
    CHECK(post(A, x, &st) == 0, "post");
    char msg[512];
    kvp_status s = 0;
    for (int i = 0; i < 2000 && (s = poll1(A, x, &st, msg, sizeof msg)) == 0; i++) usleep(1000);
    CHECK(s == KVP_ERR_BACKEND && strstr(msg, "ERR_RDMA_OP") && strstr(msg, "injected") &&
              strstr(msg, "region pair 0"),
          "failure: %d %s", s, msg);
    char msg2[512];
    CHECK(poll1(A, x, &st, msg2, sizeof msg2) == s && strcmp(msg, msg2) == 0, "sticky failure");
    unsetenv("MORI_STUB_FAIL");
    /* The other pair's failed copy may still run in the stand-in: the post
     * is refused until it ended (MORI cannot cancel posted work). */
    kvp_status rp;
    for (int i = 0; i < 2000 && (rp = post(A, x, NULL)) == KVP_ERR_REPOST_ACTIVE; i++) usleep(1000);
    CHECK(rp == 0 && wait_done(A, x, NULL) == 0, "retry after failure: %d", rp);
    CHECK(release(A, x) == 0, "release");

    setenv("MORI_STUB_THROW", "1", 1);
    CHECK(make(A, KVP_OP_WRITE, pairs, 2, ents, 3, &x) == 0, "make");
    CHECK(post(A, x, NULL) == KVP_ERR_BACKEND, "post throws");
    CHECK(poll1(A, x, &st, msg, sizeof msg) == KVP_ERR_BACKEND && strstr(msg, "MORI_STUB_THROW"),
          "poll after throw: %s", msg);
    unsetenv("MORI_STUB_THROW");
    CHECK(release(A, x) == 0, "release after throw");
  }

  /* ---- release waits for posted work; a short timeout refuses ---- */
  {
    kvp_agent C = 0;
    kvp_param pc[] = {P("release_timeout_ms", "0")};
    CHECK(create_agent("quick-c", pc, 1, &C, NULL) == 0, "create C");
    CHECK(exchange(B, C, peer_b, sizeof peer_b) == 0, "C loads B");
    kvp_remote_region_import_args ic;
    CHECK(import(B, rb1, C, "decode-b", &ic) == 0, "C imports");
    static uint8_t cbuf[4096];
    kvp_region rc;
    CHECK(reg(C, cbuf, sizeof cbuf, KVP_MEM_DRAM, 0, &rc) == 0, "reg C");
    kvp_region_pair cp[1] = {{rc, ic.rregion}};
    kvp_batch_entry ce[1] = {{0, 0, 0, 0, 4096, 0, 0, 1}};
    kvp_xfer x;
    CHECK(make(C, KVP_OP_WRITE, cp, 1, ce, 1, &x) == 0, "make C");
    setenv("MORI_STUB_DELAY_MS", "200", 1);
    CHECK(post(C, x, NULL) == 0, "post C");
    CHECK(release(C, x) == KVP_ERR_BACKEND, "release while in flight refused");
    CHECK(wait_done(C, x, NULL) == 0, "handle still valid, completes");
    CHECK(release(C, x) == 0, "release after completion");
    /* remove_remote cancels at once; handles stay valid but dead */
    kvp_xfer done_x;
    CHECK(make(C, KVP_OP_WRITE, cp, 1, ce, 1, &done_x) == 0, "make C-done");
    setenv("MORI_STUB_DELAY_MS", "1", 1);
    CHECK(post(C, done_x, NULL) == 0 && wait_done(C, done_x, NULL) == 0, "C-done completes");
    setenv("MORI_STUB_DELAY_MS", "200", 1);
    CHECK(make(C, KVP_OP_WRITE, cp, 1, ce, 1, &x) == 0, "make C2");
    CHECK(post(C, x, NULL) == 0, "post C2");
    kvp_remove_remote_args rm = {KVP_REMOVE_REMOTE_ARGS_STRUCT_SIZE, NULL, C, "decode-b", 8};
    CHECK(take(api->remove_remote(&rm), NULL, 0) == 0, "remove while in flight");
    CHECK(poll1(C, x, &st, NULL, 0) == KVP_ERR_CANCELED, "poll of cancelled transfer");
    CHECK(poll1(C, x, &st, NULL, 0) == KVP_ERR_CANCELED, "stays cancelled");
    CHECK(poll1(C, done_x, &st, NULL, 0) == 0 && st == KVP_SUCCESS, "completed one keeps success");
    CHECK(post(C, x, NULL) == KVP_ERR_NOT_FOUND, "no post to a removed peer, even in flight");
    CHECK(release(C, x) == KVP_ERR_BACKEND, "release waits for posted work (timeout 0)");
    usleep(400 * 1000);
    CHECK(post(C, x, NULL) == KVP_ERR_NOT_FOUND, "post to removed peer");
    CHECK(release(C, x) == 0, "release cancelled after its work ended");
    CHECK(release(C, done_x) == 0, "release completed");
    kvp_xfer dead;
    CHECK(make(C, KVP_OP_WRITE, cp, 1, ce, 1, &dead) == KVP_ERR_NOT_FOUND, "make with dead rregion");
    CHECK(take(api->remove_remote(&rm), NULL, 0) == KVP_ERR_NOT_FOUND, "remove twice");
    /* reload: old remote region stays dead, a new import works */
    CHECK(exchange(B, C, peer_b, sizeof peer_b) == 0, "C reloads B");
    CHECK(make(C, KVP_OP_WRITE, cp, 1, ce, 1, &dead) == KVP_ERR_NOT_FOUND, "old rregion stays dead");
    kvp_remote_region_release_args rrel = {KVP_REMOTE_REGION_RELEASE_ARGS_STRUCT_SIZE, NULL, C,
                                           ic.rregion};
    CHECK(take(api->remote_region_release(&rrel), NULL, 0) == 0, "dead rregion is released by caller");
    CHECK(import(B, rb1, C, "decode-b", &ic) == 0, "C re-imports");
    cp[0].remote = ic.rregion;
    /* agent_destroy with a transfer in flight: waits, frees, no crash */
    CHECK(make(C, KVP_OP_WRITE, cp, 1, ce, 1, &x) == 0, "make C3");
    CHECK(post(C, x, NULL) == 0, "post C3");
    CHECK(destroy_agent(C) == 0, "destroy C with a transfer in flight");
    CHECK(post(C, x, NULL) == KVP_ERR_INVALID_PARAM, "C gone");
    unsetenv("MORI_STUB_DELAY_MS");
  }

  /* ---- 8 threads posting at once ---- */
  {
    enum { T = 8, S = 4096 };
    struct conc c[T];
    pthread_t th[T];
    for (int i = 0; i < T; i++) {
      kvp_batch_entry e = {0, 0, (uint64_t)i * S, (uint64_t)i * S, S, 0, 0, 1};
      c[i].a = A;
      CHECK(make(A, KVP_OP_WRITE, pairs, 2, &e, 1, &c[i].x) == 0, "make %d", i);
    }
    memset(b1, 0, N);
    for (int i = 0; i < T; i++) pthread_create(&th[i], NULL, conc_post, &c[i]);
    for (int i = 0; i < T; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < T; i++) {
      CHECK(c[i].rc == 0, "thread %d rc %d", i, c[i].rc);
      CHECK(release(A, c[i].x) == 0, "release %d", i);
    }
    CHECK(memcmp(b1, a1, T * S) == 0, "concurrent bytes");
  }

  /* ---- remove_remote: remote regions become dead handles ---- */
  CHECK(release(A, xw) == 0, "release write");
  CHECK(release(A, xw) == KVP_ERR_INVALID_PARAM, "double release");
  CHECK(dereg(A, ra1) == 0, "dereg after release");
  CHECK(dereg(A, ra1) == KVP_ERR_INVALID_PARAM, "double dereg");
  {
    kvp_remove_remote_args rm = {KVP_REMOVE_REMOTE_ARGS_STRUCT_SIZE, NULL, A, "decode-b", 8};
    CHECK(take(api->remove_remote(&rm), NULL, 0) == 0, "remove B from A");
    CHECK(take(api->remove_remote(&rm), NULL, 0) == KVP_ERR_NOT_FOUND, "remove twice");
    kvp_xfer x2;
    kvp_batch_entry e = {0, 0, 0, 0, 8, 0, 0, 1};
    CHECK(make(A, KVP_OP_WRITE, pairs + 1, 1, &e, 1, &x2) == KVP_ERR_NOT_FOUND, "dead rregion");
    kvp_remote_region_release_args rr = {KVP_REMOTE_REGION_RELEASE_ARGS_STRUCT_SIZE, NULL, A,
                                         ib1.rregion};
    CHECK(take(api->remote_region_release(&rr), NULL, 0) == 0, "caller releases dead rregion");
    CHECK(take(api->remote_region_release(&rr), NULL, 0) == KVP_ERR_INVALID_PARAM, "only once");
    kvp_remote_region_import_args x;
    CHECK(import(B, rb1, A, "decode-b", &x) == KVP_ERR_NOT_FOUND, "import from unloaded peer");
  }

  CHECK(destroy_agent(A) == 0, "destroy A");
  CHECK(destroy_agent(A) == KVP_ERR_INVALID_PARAM, "destroy A twice");
  CHECK(destroy_agent(B) == 0, "destroy B");
  free(a1);
  free(a2);
  free(b1);
  free(b2);
  printf("shim_test: %d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}
