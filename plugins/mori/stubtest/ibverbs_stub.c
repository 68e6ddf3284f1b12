/*
 * ibverbs_stub.c: a stand-in libibverbs.so.1 for the mori shim's stand-in
 * test, so that register_mem's registration probe can be driven without an
 * RDMA NIC. It is NOT libibverbs: it implements only the calls the probe
 * makes, against Debian's <infiniband/verbs.h> (rdma-core 44), and lets the
 * test choose what fails:
 *   FAKE_IBV_NICS=a,b      the devices listed (default "fake0"; "" for none)
 *   FAKE_IBV_DOWN=a        devices whose only port is DOWN
 *   FAKE_IBV_REG_FAIL=a    devices whose ibv_reg_mr fails with EFAULT ("*": all)
 *   FAKE_IBV_DMABUF_FAIL=a devices whose ibv_reg_dmabuf_mr fails ("*": all)
 * fake_ibv_live() tells how many protection domains and memory regions are
 * open (the probe must give back what it takes).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#undef ibv_query_port
#undef ibv_reg_mr

static int live; /* atomic: agents probe concurrently */

/* 1 if name is in the comma list of environment variable var ("*": any). */
static int listed(const char *var, const char *name) {
  const char *v = getenv(var);
  if (!v || !*v) return 0;
  if (strcmp(v, "*") == 0) return 1;
  size_t n = strlen(name);
  for (const char *p = v; *p;) {
    const char *c = strchr(p, ',');
    size_t len = c ? (size_t)(c - p) : strlen(p);
    if (len == n && strncmp(p, name, n) == 0) return 1;
    if (!c) break;
    p = c + 1;
  }
  return 0;
}

int fake_ibv_live(void) { return __atomic_load_n(&live, __ATOMIC_SEQ_CST); }

struct ibv_device **ibv_get_device_list(int *num) {
  const char *v = getenv("FAKE_IBV_NICS");
  if (!v) v = "fake0";
  char *copy = strdup(v);
  struct ibv_device **list = calloc(17, sizeof *list);
  int n = 0;
  for (char *save = NULL, *t = strtok_r(copy, ",", &save); t && n < 16;
       t = strtok_r(NULL, ",", &save)) {
    struct ibv_device *d = calloc(1, sizeof *d);
    strncpy(d->name, t, sizeof d->name - 1);
    list[n++] = d;
  }
  free(copy);
  if (num) *num = n;
  return list;
}

void ibv_free_device_list(struct ibv_device **list) {
  for (int i = 0; list && list[i]; i++) free(list[i]);
  free(list);
}

const char *ibv_get_device_name(struct ibv_device *d) { return d->name; }

/* A context keeps its own copy of the device: as in libibverbs, it stays
 * valid after ibv_free_device_list. */
struct ibv_context *ibv_open_device(struct ibv_device *d) {
  struct ibv_context *c = calloc(1, sizeof *c);
  struct ibv_device *own = calloc(1, sizeof *own);
  memcpy(own->name, d->name, sizeof own->name);
  c->device = own; /* abi_compat NULL: the header's inline calls come here */
  return c;
}

int ibv_close_device(struct ibv_context *c) {
  free(c->device);
  free(c);
  return 0;
}

int ibv_query_device(struct ibv_context *c, struct ibv_device_attr *a) {
  (void)c;
  memset(a, 0, sizeof *a);
  a->phys_port_cnt = 1;
  return 0;
}

int ibv_query_port(struct ibv_context *c, uint8_t port, struct _compat_ibv_port_attr *a) {
  struct ibv_port_attr *pa = (struct ibv_port_attr *)a;
  if (port != 1) return EINVAL;
  pa->state = listed("FAKE_IBV_DOWN", c->device->name) ? IBV_PORT_DOWN : IBV_PORT_ACTIVE;
  return 0;
}

struct ibv_pd *ibv_alloc_pd(struct ibv_context *c) {
  struct ibv_pd *pd = calloc(1, sizeof *pd);
  pd->context = c;
  __atomic_add_fetch(&live, 1, __ATOMIC_SEQ_CST);
  return pd;
}

int ibv_dealloc_pd(struct ibv_pd *pd) {
  free(pd);
  __atomic_sub_fetch(&live, 1, __ATOMIC_SEQ_CST);
  return 0;
}

static struct ibv_mr *new_mr(struct ibv_pd *pd, void *addr, size_t len) {
  struct ibv_mr *mr = calloc(1, sizeof *mr);
  mr->context = pd->context;
  mr->pd = pd;
  mr->addr = addr;
  mr->length = len;
  __atomic_add_fetch(&live, 1, __ATOMIC_SEQ_CST);
  return mr;
}

struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access) {
  (void)access;
  if (listed("FAKE_IBV_REG_FAIL", pd->context->device->name)) {
    errno = EFAULT;
    return NULL;
  }
  return new_mr(pd, addr, len);
}

struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t len, uint64_t iova,
                                unsigned int access) {
  (void)iova;
  return ibv_reg_mr(pd, addr, len, (int)access);
}

struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova,
                                 int fd, int access) {
  (void)offset;
  (void)fd;
  (void)access;
  if (listed("FAKE_IBV_DMABUF_FAIL", pd->context->device->name)) {
    errno = EINVAL;
    return NULL;
  }
  return new_mr(pd, (void *)(uintptr_t)iova, len);
}

int ibv_dereg_mr(struct ibv_mr *mr) {
  free(mr);
  __atomic_sub_fetch(&live, 1, __ATOMIC_SEQ_CST);
  return 0;
}
