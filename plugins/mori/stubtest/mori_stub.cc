/*
 * mori_stub.cc: an in-process stand-in for the 11 mori::io::IOEngine
 * functions the mori plugin calls, so the shim's own logic (handles,
 * grouping, range checks, post/poll/release, errors) can run on a machine
 * without ROCm, an AMD GPU or an RDMA NIC. It is NOT MORI and proves nothing
 * about MORI itself: it copies with memcpy between engines of one process.
 *
 * Built as a shared library named libmori_io.so (as the shim finds and
 * checks the library it was built against by that name), by `make
 * mori-stub-test` against the stand-in headers in stubtest/include and by
 * check_compile.sh --stub-test against MORI's real headers (then
 * TransferStatus, MemoryDesc and the class layout are MORI's own).
 *
 * Behaviour, modelled on MORI v1.2.2 src/io/engine.cpp and rdma/backend_impl:
 *   - CreateBackend(RDMA) binds nothing; port 0 becomes a fake port.
 *   - BatchWrite/BatchRead: per element, a peer not registered gives
 *     ERR_BAD_STATE and stops the batch (later statuses stay INIT), as
 *     MORI's SELECT_BACKEND_AND_RETURN_IF_NONE does. A registered peer is
 *     reached at the host and port of the EngineDesc this engine registered
 *     for its key, as MORI's ControlPlaneServer::BuildRdmaConn
 *     (src/io/rdma/backend_impl.cpp) connects to rdesc.host:rdesc.port; so
 *     two engines of one process with the same key stay apart, and a
 *     transfer goes to whichever the shim registered. Otherwise the status
 *     goes IN_PROGRESS and a worker thread copies after MORI_STUB_DELAY_MS
 *     (default 2) and sets SUCCESS.
 *   - MORI_STUB_FAIL=1 makes every copy end in ERR_RDMA_OP instead;
 *     MORI_STUB_THROW=1 makes BatchWrite/BatchRead throw on the second
 *     element (after posting the first), as a failed RDMA connect does.
 *   - Unlike MORI, the stub checks every block against the registered
 *     memory of both engines and aborts the process if one is outside: the
 *     shim must never hand MORI an out-of-range block.
 *   - ~IOEngine waits for the engine's queued copies (MORI joins its threads).
 *   - MORI_STUB_XGMI_ONLY=1: CreateBackend does what MORI does with no
 *     active RDMA device and MORI_DISABLE_AUTO_XGMI=0: port 1, no control
 *     plane (src/io/engine.cpp, IOEngine::CreateBackend).
 *   - MORI_STUB_GROW=N: the constructor also writes N bytes past
 *     sizeof(IOEngine), as a libmori_io.so whose IOEngine gained members
 *     (MORI PR #515) does in storage sized by older headers.
 *   - hsa_amd_portable_export_dmabuf stands in for the HSA runtime's: it
 *     hands out a descriptor of /dev/null and MORI_STUB_DMABUF_OFFSET
 *     (default 0) as the buffer's offset in its allocation, or fails with
 *     MORI_STUB_DMABUF_FAIL=1.
 *   - stubtest/run.sh links it twice, the second time with one more
 *     constant, so the test has a second libmori_io.so with another build ID.
 */
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>

#include "mori/io/io.hpp"

namespace mori {
namespace io {
namespace {

struct Engine {
  std::mutex mu;
  std::unordered_map<EngineKey, EngineDesc> remotes;
  std::unordered_map<MemoryUniqueId, MemoryDesc> mems;
  int pending = 0;  // queued copies (guarded by g_mu)
};

struct Copy {
  std::shared_ptr<Engine> owner;
  std::vector<std::tuple<char *, const char *, size_t>> blocks;  // dst, src, n
  TransferStatus *status;
  std::chrono::steady_clock::time_point due;
  bool fail;
};

// Process-wide stub state, never destroyed: the detached worker thread may
// still wait on the condition variable while the process exits.
struct Global {
  std::mutex mu;
  std::condition_variable cv;
  std::unordered_map<const IOEngine *, std::shared_ptr<Engine>> engines;
  // Engines with a backend, by "host:port" (the address MORI's control
  // plane listens on), not by key: see BatchWrite/BatchRead above.
  std::unordered_map<std::string, std::shared_ptr<Engine>> by_addr;
  std::deque<Copy> queue;
  bool worker_started = false;
  int next_port = 40000;
};
Global &G() {
  static Global *g = new Global;
  return *g;
}
#define g_mu (G().mu)
#define g_cv (G().cv)
#define g_engines (G().engines)
#define g_by_addr (G().by_addr)
#define g_queue (G().queue)
#define g_worker_started (G().worker_started)
#define g_next_port (G().next_port)

std::string Addr(const std::string &host, uint16_t port) {
  return host + ":" + std::to_string(port);
}

int EnvInt(const char *name, int def) {
  const char *v = getenv(name);
  return v && *v ? atoi(v) : def;
}

void Worker() {
  std::unique_lock<std::mutex> lk(g_mu);
  for (;;) {
    g_cv.wait(lk, [] { return !g_queue.empty(); });
    Copy c = std::move(g_queue.front());
    g_queue.pop_front();
    lk.unlock();
    std::this_thread::sleep_until(c.due);
    if (c.fail) {
      c.status->Update(StatusCode::ERR_RDMA_OP, "stub: injected RDMA failure (MORI_STUB_FAIL)");
    } else {
      for (auto &b : c.blocks) memcpy(std::get<0>(b), std::get<1>(b), std::get<2>(b));
      c.status->Update(StatusCode::SUCCESS, "");
    }
    lk.lock();
    c.owner->pending--;
    g_cv.notify_all();
  }
}

std::shared_ptr<Engine> Self(const IOEngine *e) {
  std::lock_guard<std::mutex> g(g_mu);
  return g_engines.at(e);
}

// Aborts unless [data+off, data+off+n) lies inside the registered desc.
void CheckInside(const char *side, const MemoryDesc &d, size_t off, size_t n) {
  if (n == 0 || off > d.size || n > d.size - off) {
    fprintf(stderr, "mori_stub: %s block off=%zu n=%zu outside region of %zu bytes\n", side, off,
            n, d.size);
    abort();
  }
}

void Batch(IOEngine *self, const MemDescVec &local, const BatchSizeVec &loff,
           const MemDescVec &remote, const BatchSizeVec &roff, const BatchSizeVec &sizes,
           TransferStatusPtrVec &st, TransferUniqueIdVec &ids, bool read) {
  size_t n = local.size();
  if (remote.size() != n || loff.size() != n || roff.size() != n || sizes.size() != n ||
      st.size() != n || ids.size() != n) {
    fprintf(stderr, "mori_stub: batch vectors of different lengths\n");
    abort();
  }
  auto me = Self(self);
  int delay = EnvInt("MORI_STUB_DELAY_MS", 2);
  bool fail = EnvInt("MORI_STUB_FAIL", 0) != 0;
  bool do_throw = EnvInt("MORI_STUB_THROW", 0) != 0;
  for (size_t i = 0; i < n; i++) {
    if (do_throw && i == 1) throw std::runtime_error("stub: connect to peer failed (MORI_STUB_THROW)");
    std::shared_ptr<Engine> peer;
    std::string addr;
    {
      std::lock_guard<std::mutex> g(me->mu);
      auto r = me->remotes.find(remote[i].engineKey);
      if (r == me->remotes.end()) {
        st[i]->Update(StatusCode::ERR_BAD_STATE, "No available backend found, create backend first");
        return;
      }
      addr = Addr(r->second.host, r->second.port);
      if (!me->mems.count(local[i].id)) {
        fprintf(stderr, "mori_stub: local memory id %u not registered\n", local[i].id);
        abort();
      }
    }
    {
      std::lock_guard<std::mutex> g(g_mu);
      auto it = g_by_addr.find(addr);
      if (it == g_by_addr.end()) {
        st[i]->Update(StatusCode::ERR_BAD_STATE, "stub: remote engine is gone");
        continue;
      }
      peer = it->second;
    }
    {
      std::lock_guard<std::mutex> g(peer->mu);
      auto m = peer->mems.find(remote[i].id);
      if (m == peer->mems.end() || m->second.data != remote[i].data ||
          m->second.size != remote[i].size) {
        st[i]->Update(StatusCode::ERR_NOT_FOUND, "stub: remote memory not registered");
        continue;
      }
    }
    Copy c;
    c.owner = me;
    c.status = st[i];
    c.fail = fail;
    c.due = std::chrono::steady_clock::now() + std::chrono::milliseconds(delay);
    if (loff[i].size() != roff[i].size() || sizes[i].size() != loff[i].size()) abort();
    for (size_t k = 0; k < sizes[i].size(); k++) {
      CheckInside("local", local[i], loff[i][k], sizes[i][k]);
      CheckInside("remote", remote[i], roff[i][k], sizes[i][k]);
      char *l = reinterpret_cast<char *>(local[i].data) + loff[i][k];
      char *r = reinterpret_cast<char *>(remote[i].data) + roff[i][k];
      if (read)
        c.blocks.emplace_back(l, r, sizes[i][k]);
      else
        c.blocks.emplace_back(r, l, sizes[i][k]);
    }
    if (sizes[i].empty()) {
      st[i]->SetCode(StatusCode::SUCCESS);
      continue;
    }
    st[i]->SetCode(StatusCode::IN_PROGRESS);
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_worker_started) {
      std::thread(Worker).detach();
      g_worker_started = true;
    }
    me->pending++;
    g_queue.push_back(std::move(c));
    g_cv.notify_all();
  }
}

}  // namespace

// The HSA runtime's dmabuf export (hsa_ext_amd.h): 0 is HSA_STATUS_SUCCESS.
extern "C" __attribute__((visibility("default"))) int hsa_amd_portable_export_dmabuf(
    const void *ptr, size_t size, int *fd, uint64_t *offset) {
  (void)ptr;
  (void)size;
  if (EnvInt("MORI_STUB_DMABUF_FAIL", 0)) return 1;
  *fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  *offset = static_cast<uint64_t>(EnvInt("MORI_STUB_DMABUF_OFFSET", 0));
  return *fd < 0 ? 1 : 0;
}

// The RdmaBackendConfig of the last CreateBackend(RDMA), so the test can see
// which settings reached MORI: qpPerTransfer, postBatchSize,
// numWorkerThreads, pollCqMode, enableNotification, numNicsPerTransfer,
// enableTransferChunking, chunkBytes, maxChunksPerTransfer, maxSendWr,
// maxCqeNum, maxMsgSge.
static std::mutex g_cfg_mu;
static long g_last_cfg[12];

extern "C" __attribute__((visibility("default"))) void mori_stub_last_rdma_config(long out[12]) {
  std::lock_guard<std::mutex> g(g_cfg_mu);
  memcpy(out, g_last_cfg, sizeof g_last_cfg);
}

IOEngine::IOEngine(EngineKey key, IOEngineConfig cfg) : config(cfg) {
  if (int grow = EnvInt("MORI_STUB_GROW", 0))
    memset(reinterpret_cast<char *>(this) + sizeof(IOEngine), 0x5A, static_cast<size_t>(grow));
  desc.key = key;
  desc.nodeId = "stub-node";
  desc.hostname = "stub-host";
  desc.host = cfg.host;
  desc.port = cfg.port;
  desc.pid = static_cast<int>(getpid());
  std::lock_guard<std::mutex> g(g_mu);
  g_engines[this] = std::make_shared<Engine>();
}

IOEngine::~IOEngine() {
  std::unique_lock<std::mutex> lk(g_mu);
  auto me = g_engines.at(this);
  g_cv.wait(lk, [&] { return me->pending == 0; });
  g_engines.erase(this);
  auto it = g_by_addr.find(Addr(desc.host, desc.port));
  if (it != g_by_addr.end() && it->second == me) g_by_addr.erase(it);
}

void IOEngine::CreateBackend(BackendType type, const BackendConfig &cfg) {
  if (type != BackendType::RDMA || cfg.Type() != BackendType::RDMA)
    throw std::runtime_error("stub: only the RDMA backend");
  if (EnvInt("MORI_STUB_CREATE_FAIL", 0)) throw std::runtime_error("stub: no active RDMA device");
  {
    const auto &r = static_cast<const RdmaBackendConfig &>(cfg);
    std::lock_guard<std::mutex> g(g_cfg_mu);
    long v[12] = {r.qpPerTransfer,      r.postBatchSize,
                  r.numWorkerThreads,   static_cast<long>(r.pollCqMode),
                  r.enableNotification, r.numNicsPerTransfer,
                  r.enableTransferChunking, static_cast<long>(r.chunkBytes),
                  r.maxChunksPerTransfer, r.maxSendWr,
                  r.maxCqeNum,          r.maxMsgSge};
    memcpy(g_last_cfg, v, sizeof v);
  }
  if (EnvInt("MORI_STUB_XGMI_ONLY", 0)) {
    desc.port = config.port = 1;
    return;
  }
  std::lock_guard<std::mutex> g(g_mu);
  if (desc.port == 0) desc.port = config.port = static_cast<uint16_t>(g_next_port++);
  g_by_addr[Addr(desc.host, desc.port)] = g_engines.at(this);
}

void IOEngine::RegisterRemoteEngine(const EngineDesc &r) {
  auto me = Self(this);
  std::lock_guard<std::mutex> g(me->mu);
  me->remotes[r.key] = r;
}

void IOEngine::DeregisterRemoteEngine(const EngineDesc &r) {
  auto me = Self(this);
  std::lock_guard<std::mutex> g(me->mu);
  me->remotes.erase(r.key);
}

MemoryDesc IOEngine::RegisterMemory(void *data, size_t size, int device, MemoryLocationType loc) {
  MemoryDesc d;
  d.engineKey = desc.key;
  d.id = nextMemUid.fetch_add(1);
  d.deviceId = device;
  d.data = reinterpret_cast<uintptr_t>(data);
  d.size = size;
  d.loc = loc;
  auto me = Self(this);
  std::lock_guard<std::mutex> g(me->mu);
  me->mems[d.id] = d;
  return d;
}

void IOEngine::DeregisterMemory(const MemoryDesc &d) {
  auto me = Self(this);
  std::lock_guard<std::mutex> g(me->mu);
  me->mems.erase(d.id);
}

TransferUniqueId IOEngine::AllocateTransferUniqueId() { return nextTransferUid.fetch_add(1); }

void IOEngine::BatchWrite(const MemDescVec &l, const BatchSizeVec &lo, const MemDescVec &r,
                          const BatchSizeVec &ro, const BatchSizeVec &s, TransferStatusPtrVec &st,
                          TransferUniqueIdVec &ids) {
  Batch(this, l, lo, r, ro, s, st, ids, false);
}

void IOEngine::BatchRead(const MemDescVec &l, const BatchSizeVec &lo, const MemDescVec &r,
                         const BatchSizeVec &ro, const BatchSizeVec &s, TransferStatusPtrVec &st,
                         TransferUniqueIdVec &ids) {
  Batch(this, l, lo, r, ro, s, st, ids, true);
}

// Same contract as MORI's: 0 polls once, < 0 waits, failure wins.
StatusCode IOEngine::WaitAll(const std::vector<TransferStatus *> &statuses, int timeoutMs) {
  if (statuses.empty()) return StatusCode::SUCCESS;
  bool any = false;
  StatusCode first = StatusCode::SUCCESS;
  for (TransferStatus *s : statuses) {
    if (!s) continue;
    StatusCode c = s->WaitFor(timeoutMs);
    if (c == StatusCode::IN_PROGRESS) {
      any = true;
      continue;
    }
    if (c != StatusCode::SUCCESS && first == StatusCode::SUCCESS) first = c;
    if (timeoutMs == 0 && c != StatusCode::SUCCESS) return c;
  }
  if (first != StatusCode::SUCCESS) return first;
  return any ? StatusCode::IN_PROGRESS : StatusCode::SUCCESS;
}

}  // namespace io
}  // namespace mori
