/*
 * mori_plugin.cc: the kvhost backend over MORI-IO (github.com/ROCm/mori).
 *
 * A thin shim: one kvhost agent is one mori::io::IOEngine with an RDMA
 * backend, and every ABI call maps onto one or two IOEngine calls.
 *
 *   agent_create          IOEngine(name, {host, port}) + CreateBackend(RDMA)
 *   register_mem          IOEngine::RegisterMemory (CPU or GPU)
 *   region_export         msgpack of the region's MemoryDesc (MemoryDesc.pack())
 *   local_metadata        msgpack of the engine's EngineDesc (EngineDesc.pack())
 *   load_remote           IOEngine::RegisterRemoteEngine; peer name = engine key
 *   remote_region_import  a peer's MemoryDesc blob becomes a remote region handle
 *   make_batch_xfer       entries grouped by region pair into MORI's
 *                         vector-of-vectors (strides expanded here)
 *   post_xfer             ONE IOEngine::BatchWrite/BatchRead, one TransferStatus
 *                         per (local, remote) region pair, fresh transfer uids
 *   poll_xfer             IOEngine::WaitAll(statuses, 0)
 *   submit_xfer (1.1)     make_batch_xfer + post_xfer in one call
 *   poll_xfer flags (1.1) KVP_POLL_TELEMETRY: the shim's timestamps;
 *                         KVP_POLL_RELEASE: release_xfer once nothing of the
 *                         transfer runs in MORI (never waits: a failed
 *                         transfer whose posted work still runs is left to
 *                         release_xfer, released = 0)
 *   get_event_fd (1.1)    an eventfd signalled by a shim thread per agent
 *                         (see "Event descriptor")
 *
 * Capabilities: KVP_CAP_BATCH | KVP_CAP_STRIDED | KVP_CAP_TELEMETRY |
 * KVP_CAP_REMOTE_BLOB | KVP_CAP_SUBMIT | KVP_CAP_EVENT_FD.
 *   - No KVP_CAP_PREPPED: MORI-IO has no prepared descriptor lists; the host
 *     emulates them over make_batch_xfer.
 *   - KVP_CAP_STRIDED: MORI has no strided descriptors, but the shim must copy
 *     every entry into MORI's per-pair offset vectors anyway, so expanding
 *     count > 1 while copying costs nothing extra and saves the host building
 *     and passing an expanded array (one plugin call either way).
 *   - No KVP_CAP_NOTIF: SGLang runs MORI-IO with notifications off and tells
 *     the decode side about completion with its own status message; kvhost's
 *     runtime does the same (out-of-band status) for this backend. MORI's own
 *     "notification" (PopInboundTransferStatus) carries no payload anyway.
 *   - KVP_CAP_TELEMETRY: timestamps taken in the shim (post duration; post to
 *     the poll that saw completion, so xfer_us is as fine as the caller polls).
 *   - No KVP_CAP_REMOTE_ADDR: an EngineDesc does not list the peer's memory;
 *     MORI addresses remote memory only through MemoryDesc blobs.
 *
 * What MORI-IO can and cannot cancel: nothing that was posted. There is no
 * cancel call; a posted batch ends only when its work completions arrive
 * (success, or an error such as a retry timeout when the peer is gone), and
 * until then MORI's completion thread writes to the TransferStatus objects
 * the shim owns. So release_xfer drains: it waits for posted work, at most
 * release_timeout_ms, and fails (handle kept, retry later) if it is still
 * running. remove_remote cancels logically: the peer's transfers report
 * KVP_ERR_CANCELED at once while their posted work runs out in MORI. Only
 * agent_destroy really stops work: it destroys the IOEngine, which joins
 * MORI's threads and tears down its queue pairs and memory registrations,
 * after which the NIC touches nothing.
 *
 * Threading: IOEngine::RegisterMemory/DeregisterMemory/RegisterRemoteEngine
 * mutate unsynchronised maps inside MORI, and DeregisterMemory frees cached
 * RDMA sessions that a concurrent BatchWrite may be using. Each agent
 * therefore has a reader/writer lock: BatchWrite/BatchRead run shared (many
 * posts at once), the mutating calls run exclusive. WaitAll only reads
 * TransferStatus atomics and runs unlocked.
 *
 * Every C++ exception is caught at the ABI boundary (Guard) and becomes an
 * error object. Beware what cannot be caught: MORI calls exit(-1) when a
 * socket call fails (SYSCALL_RETURN_ZERO), abort()s when it cannot register
 * memory with a NIC (lazily, at the first transfer of a region), and
 * assert()s on some internal states. So the shim finds out first where it
 * can: agent_create test-binds host:port before MORI does, and register_mem
 * registers each region with the NICs MORI may use and deregisters it again
 * (see "Registration probe"), refusing the region with the reason instead of
 * letting MORI abort the process mid-transfer.
 *
 * MORI's C++ classes change size without changing any symbol (a member
 * added to IOEngine links fine and corrupts memory), so the build records
 * which libmori_io.so the shim was compiled against and the shim refuses any
 * other one (see "Build facts").
 */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <netinet/in.h>
#include <strings.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include <infiniband/verbs.h>
#include <msgpack.hpp>

#include "mori/io/io.hpp"

#include "kvp_util.h"
#include "kvplugin.h"

namespace {

namespace mio = mori::io;

/* ------------------------------------------------------------------------ */
/* Build facts                                                              */
/* ------------------------------------------------------------------------ */

// What the build (make plugin-mori, check_compile.sh) recorded about the
// MORI it compiled against:
//   KVHOST_MORI_COMMIT  the MORI commit or tag (the wheel's version string
//                       when that is all there is)
//   KVHOST_MORI_LIB_ID  the libmori_io.so linked: "build-id:HEX" (its ELF
//                       build ID), "size:BYTES" for a library without one,
//                       or "none" for a compile-only check
//   KVHOST_MORI_REG     how that MORI registers memory with a NIC: "ibv"
//                       (ibv_reg_mr only: before 09ad89c4), "auto-offset0"
//                       (ibv_reg_mr, then dmabuf at offset 0: 09ad89c4 up to
//                       0d05a4d2), "auto" (ibv_reg_mr, then dmabuf at the
//                       buffer's offset: 0d05a4d2 on), "unknown"
#ifndef KVHOST_MORI_COMMIT
#error "KVHOST_MORI_COMMIT is not defined: build with make plugin-mori or check_compile.sh"
#endif
#ifndef KVHOST_MORI_LIB_ID
#error "KVHOST_MORI_LIB_ID is not defined: build with make plugin-mori or check_compile.sh"
#endif
#ifndef KVHOST_MORI_REG
#error "KVHOST_MORI_REG is not defined: build with make plugin-mori or check_compile.sh"
#endif

constexpr const char *kMoriCommit = KVHOST_MORI_COMMIT;
constexpr const char *kMoriLibId = KVHOST_MORI_LIB_ID;
constexpr const char *kMoriReg = KVHOST_MORI_REG;

// The layout facts of the headers compiled against, named in refusals.
std::string LayoutFacts() {
  char b[256];
  snprintf(b, sizeof b,
           "sizeof IOEngine %zu, MemoryDesc %zu, EngineDesc %zu, RdmaBackendConfig %zu, "
           "TransferStatus %zu",
           sizeof(mori::io::IOEngine), sizeof(mori::io::MemoryDesc),
           sizeof(mori::io::EngineDesc), sizeof(mori::io::RdmaBackendConfig),
           sizeof(mori::io::TransferStatus));
  return b;
}

constexpr const char *kPluginName = "mori";
// kvhost plugins shows it: the MORI build the shim belongs to.
constexpr const char *kPluginVersion =
    "0.2.0 (MORI " KVHOST_MORI_COMMIT ", libmori_io.so " KVHOST_MORI_LIB_ID ")";

constexpr uint64_t kCaps = KVP_CAP_BATCH | KVP_CAP_STRIDED | KVP_CAP_TELEMETRY |
                           KVP_CAP_REMOTE_BLOB | KVP_CAP_SUBMIT | KVP_CAP_EVENT_FD;

// The largest piece handed to MORI as one work request. MORI rejects sizes
// above UINT32_MAX and NICs cap a message at max_msg_sz (1 GiB on some, 2 GiB
// on mlx5), so longer blocks are split here.
constexpr uint64_t kMaxPiece = uint64_t{1} << 30;

// MORI counts the work requests of one region pair in an int.
constexpr uint64_t kMaxPiecesPerPair = INT_MAX;

// MORI's IOEngineConfig.port value reserved for its XGMI-only fallback.
constexpr uint64_t kMoriReservedPort = 1;

// EngineDesc has had 6 fields (key, nodeId, hostname, host, port, pid) in
// every release; MemoryDesc has 8 (v1.1), 9 (v1.2.0, v1.2.1) or 15 (v1.2.2).
constexpr size_t kEngineDescFields = 6;
constexpr size_t kMemoryDescMinFields = 8;

// Limits for decoding peer blobs (EngineDesc: 6 fields; MemoryDesc: 8 to 15
// fields depending on the MORI release, with two 64-byte bin handles).
const msgpack::unpack_limit kBlobLimit(/*array=*/64, /*map=*/0, /*str=*/4096, /*bin=*/4096,
                                       /*ext=*/0, /*depth=*/4);

const char kParamsDoc[] =
    "host=127.0.0.1\tIPv4 address of this host that the engine's control-plane TCP server binds "
    "and advertises in the metadata (EngineDesc.host); use a routable address for peers on other "
    "nodes\n"
    "port=0\tcontrol-plane TCP port; 0 picks a free one (advertised in the metadata)\n"
    "qp_per_transfer=4\tRDMA queue pairs per (local, remote) memory pair "
    "(RdmaBackendConfig.qpPerTransfer; env MORI_IO_QP_PER_TRANSFER wins)\n"
    "post_batch_size=-1\twork requests per post; -1 lets MORI choose "
    "(postBatchSize; env MORI_IO_POST_BATCH_SIZE wins)\n"
    "num_worker_threads=4\tMORI posting threads "
    "(numWorkerThreads; env MORI_IO_NUM_WORKER_THREADS wins)\n"
    "poll_cq_mode=polling\tcompletion queue mode, polling or event "
    "(pollCqMode; env MORI_IO_POLL_CQ_MODE wins)\n"
    "num_nics_per_transfer=1\tNICs one transfer is striped over "
    "(numNicsPerTransfer; env MORI_IO_NUM_NICS_PER_TRANSFER wins)\n"
    "transfer_chunking=0\tsplit large blocks into chunks (enableTransferChunking; "
    "env MORI_IO_ENABLE_CHUNKING wins)\n"
    "chunk_bytes=65536\tchunk size with transfer_chunking, at least 4096 "
    "(chunkBytes; env MORI_IO_CHUNK_BYTES wins)\n"
    "max_chunks_per_transfer=64\tchunks per transfer with transfer_chunking "
    "(maxChunksPerTransfer; env MORI_IO_MAX_CHUNKS wins)\n"
    "max_send_wr=0\tsend queue depth per QP; 0 lets MORI choose (8192) "
    "(maxSendWr; env MORI_IO_QP_MAX_SEND_WR wins)\n"
    "max_cqe=0\tcompletion queue entries; 0 lets MORI choose (16384) "
    "(maxCqeNum; env MORI_IO_QP_MAX_CQE wins)\n"
    "max_msg_sge=0\tscatter-gather entries per work request; 0 lets MORI choose "
    "(maxMsgSge; env MORI_IO_QP_MAX_MSG_SGE wins)\n"
    "intra_node_only=0\t1 accepts MORI's XGMI-only fallback (no usable RDMA NIC and "
    "MORI_DISABLE_AUTO_XGMI=0): peers on other nodes cannot reach the agent\n"
    "probe_registration=1\tregister_mem registers each region with every NIC MORI may use "
    "and refuses what fails (MORI registers lazily and aborts the process when it cannot); "
    "0 skips the probe\n"
    "release_timeout_ms=30000\thow long release_xfer waits for the posted work of a transfer "
    "to finish (MORI-IO cannot cancel it) before it refuses; -1 waits without limit\n";

const char *const kParamNames[] = {
    "host",          "port",          "qp_per_transfer",       "post_batch_size",
    "num_worker_threads", "poll_cq_mode", "num_nics_per_transfer", "transfer_chunking",
    "chunk_bytes",   "max_chunks_per_transfer", "max_send_wr", "max_cqe",
    "max_msg_sge",   "intra_node_only", "probe_registration",  "release_timeout_ms"};

/* ------------------------------------------------------------------------ */
/* Time                                                                     */
/* ------------------------------------------------------------------------ */

using Clock = std::chrono::steady_clock;

uint64_t WallMicros() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000u + static_cast<uint64_t>(ts.tv_nsec) / 1000u;
}

uint64_t MicrosBetween(Clock::time_point a, Clock::time_point b) {
  if (b < a) return 0;
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(b - a).count());
}

/* ------------------------------------------------------------------------ */
/* Objects behind handles                                                   */
/* ------------------------------------------------------------------------ */

// A registered local region. desc and blob are immutable; users and dying
// are guarded by the owning Agent::mu.
struct Region {
  kvp_agent owner = 0;
  mio::MemoryDesc desc;
  std::string blob;  // msgpack of desc: what region_export hands out
  uint64_t addr = 0;
  uint64_t len = 0;
  uint32_t users = 0;  // live transfers that name this region
  bool dying = false;  // deregister_mem has claimed it
};

// A region of a peer, imported from its MemoryDesc blob. Immutable. It is
// live while its peer is loaded under the same epoch; after remove_remote it
// stays a valid handle that the caller releases, but it is dead.
struct RemoteRegion {
  kvp_agent owner = 0;
  std::string peer;
  uint64_t epoch = 0;  // Peer::epoch at import
  mio::MemoryDesc desc;
};

// A loaded peer. name == desc.key; its bytes are what load_remote returns,
// so a Peer never moves (held by unique_ptr) until remove_remote. epoch
// tells this loading of the peer from an earlier one that was removed:
// remote regions and transfers made under another epoch are dead.
struct Peer {
  std::string name;
  uint64_t epoch = 0;
  mio::EngineDesc desc;
};

// One element of an agent's registration table, sorted by addr. Starts with
// (addr, len) as the kvp_range functions of kvp_util require.
struct RangeEntry {
  uint64_t addr;
  uint64_t len;
  uint64_t id;  // region handle, or kNewRangeBit | index during register_mem
};
constexpr uint64_t kNewRangeBit = uint64_t{1} << 63;

// A batch transfer. The MORI arguments are built once by make_batch_xfer and
// reused by every post. The post state is guarded by mu. The caller already
// serialises post, poll, telemetry and release of one transfer (ABI rule 2);
// the lock makes a caller that breaks the rule get answers, not data races.
struct Xfer {
  kvp_agent owner = 0;
  kvp_op op = KVP_OP_WRITE;
  std::string peer;
  uint64_t peer_epoch = 0;  // Peer::epoch of its remote regions
  std::vector<kvp_region> regions;  // distinct local regions, each counted in Region::users

  // MORI's batch: element i is one (local, remote) region pair.
  mio::MemDescVec locals;
  mio::MemDescVec remotes;
  mio::BatchSizeVec local_offsets;
  mio::BatchSizeVec remote_offsets;
  mio::BatchSizeVec sizes;
  std::vector<size_t> pair_index;  // MORI element i came from pairs[pair_index[i]]
  uint64_t total_bytes = 0;
  uint64_t desc_count = 0;  // entries as given (strided ones count once)

  std::mutex mu;
  enum class State { kIdle, kActive, kDone, kFailed } state = State::kIdle;
  // The current post's statuses, one per MORI element. MORI's completion
  // thread writes to them until they leave IN_PROGRESS.
  std::vector<std::unique_ptr<mio::TransferStatus>> statuses;
  mio::TransferStatusPtrVec status_ptrs;
  // Statuses that had already failed when BatchWrite/BatchRead returned. A
  // partially posted batch fails this way while some of its work requests
  // are still queued, and their completions may still write the status, so
  // these are never freed before the engine is destroyed.
  std::vector<bool> failed_in_post;
  mio::TransferUniqueIdVec uids;
  kvp_status err_code = KVP_SUCCESS;  // when state == kFailed
  std::string err_msg;

  // The current post's clock readings.
  uint64_t start_us = 0;
  uint64_t post_us = 0;
  Clock::time_point posted_at{};
  // Telemetry of the last post that completed (xfer_telemetry).
  bool tel_valid = false;
  uint64_t tel_start_us = 0;
  uint64_t tel_post_us = 0;
  uint64_t tel_xfer_us = 0;

  // Marks the current post complete, as seen now. Caller holds mu.
  void Complete() {
    state = State::kDone;
    tel_valid = true;
    tel_start_us = start_us;
    tel_post_us = post_us;
    tel_xfer_us = MicrosBetween(posted_at, Clock::now());
  }
};

// The NICs register_mem probes (see "Registration probe"); opened at the
// first register_mem of an agent, closed with it.
struct ProbeNic {
  std::string name;
  ibv_context *ctx = nullptr;
  ibv_pd *pd = nullptr;
};

// An IOEngine in storage with a watched tail (see NewEngine).
struct EngineDeleter {
  void operator()(mio::IOEngine *e) const;
};
using EnginePtr = std::unique_ptr<mio::IOEngine, EngineDeleter>;

struct Agent {
  kvp_agent handle = 0;
  std::string name;
  int release_timeout_ms = 30000;  // -1: no limit
  bool probe = true;               // probe_registration
  bool xgmi_only = false;          // MORI fell back to XGMI only and intra_node_only allowed it
  EnginePtr engine;
  // The registration probe's NICs, guarded by probe_mu (taken alone: a
  // probe pins memory and may take long, so it holds no lock that posts
  // or polls need).
  std::mutex probe_mu;
  bool probe_open = false;
  std::vector<ProbeNic> probe_nics;

  // Exclusive for IOEngine Register*/Deregister*; shared for Batch*. Taken
  // before mu when both are needed.
  std::shared_mutex engine_mu;

  // Guards everything below and Region::users/dying.
  std::mutex mu;
  std::map<std::string, std::unique_ptr<Peer>> peers;
  uint64_t next_epoch = 1;
  std::vector<RangeEntry> ranges;  // registered memory, sorted, non-overlapping
  std::unordered_set<kvp_region> regions;
  std::unordered_set<kvp_rregion> rregions;
  std::unordered_set<kvp_xfer> xfers;
  // TransferStatus objects are never freed while the engine lives: MORI's
  // TransferStatus::Update stores the final code, unlocks, and only then
  // calls notify_all, so a status whose completion was just seen may still be
  // touched by MORI's completion thread. Finished statuses are reset and
  // reused from status_pool; those that failed inside the post call (see
  // Xfer::failed_in_post) are never reused. Both are freed after the engine
  // is destroyed (agent_destroy), when MORI's threads are joined.
  std::vector<std::unique_ptr<mio::TransferStatus>> status_pool;
  std::vector<std::unique_ptr<mio::TransferStatus>> quarantine;

  // The event descriptor (KVP_CAP_EVENT_FD, see "Event descriptor"): -1
  // until get_event_fd makes it and starts ev_thread. ev_mu guards
  // ev_watch (transfers posted in progress) and ev_stop.
  std::atomic<int> ev_fd{-1};
  std::mutex ev_mu;
  std::condition_variable ev_cv;
  std::vector<kvp_xfer> ev_watch;
  bool ev_stop = false;
  std::thread ev_thread;
};

// 1 if peer `name` is loaded under `epoch`. Caller holds a.mu.
bool PeerLive(const Agent &a, const std::string &name, uint64_t epoch) {
  auto it = a.peers.find(name);
  return it != a.peers.end() && it->second->epoch == epoch;
}

/* ------------------------------------------------------------------------ */
/* Handle tables                                                            */
/* ------------------------------------------------------------------------ */

// One table per kind for the whole plugin (handles are process-wide values;
// each object records its owning agent so a foreign handle is refused).
// Created on first use and never freed: the plugin lives as long as the
// process.
struct Tables {
  kvp_htable *agents;
  kvp_htable *regions;
  kvp_htable *rregions;
  kvp_htable *xfers;
  bool ok() const { return agents && regions && rregions && xfers; }
};

const Tables &GetTables() {
  static const Tables t = {kvp_ht_create(1), kvp_ht_create(2), kvp_ht_create(3),
                           kvp_ht_create(4)};
  return t;
}

// A counted reference from kvp_ht_acquire, put back on scope exit.
template <class T>
class Ref {
 public:
  Ref() = default;
  Ref(kvp_htable *t, uint64_t h) : t_(t), h_(h), p_(static_cast<T *>(kvp_ht_acquire(t, h))) {}
  ~Ref() { reset(); }
  Ref(Ref &&o) noexcept : t_(o.t_), h_(o.h_), p_(o.p_) { o.p_ = nullptr; }
  Ref &operator=(Ref &&o) noexcept {
    if (this != &o) {
      reset();
      t_ = o.t_;
      h_ = o.h_;
      p_ = o.p_;
      o.p_ = nullptr;
    }
    return *this;
  }
  Ref(const Ref &) = delete;
  Ref &operator=(const Ref &) = delete;

  void reset() {
    if (p_) kvp_ht_put(t_, h_);
    p_ = nullptr;
  }
  T *get() const { return p_; }
  T *operator->() const { return p_; }
  T &operator*() const { return *p_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  kvp_htable *t_ = nullptr;
  uint64_t h_ = 0;
  T *p_ = nullptr;
};

/* ------------------------------------------------------------------------ */
/* Errors                                                                   */
/* ------------------------------------------------------------------------ */

// Runs an ABI entry, turning every C++ exception into an error object.
template <class F>
kvp_error *Guard(const char *fn, F &&body) noexcept {
  try {
    if (!GetTables().ok()) return kvp_err_oom();
    return body();
  } catch (const std::bad_alloc &) {
    return kvp_err_oom();
  } catch (const std::system_error &e) {
    return kvp_err(KVP_ERR_BACKEND, "%s: MORI-IO: %s", fn, e.what());
  } catch (const std::exception &e) {
    return kvp_err(KVP_ERR_BACKEND, "%s: MORI-IO: %s", fn, e.what());
  } catch (...) {
    return kvp_err(KVP_ERR_UNKNOWN, "%s: unknown C++ exception", fn);
  }
}

kvp_error *BadAgent(const char *fn, kvp_agent a) {
  return kvp_err(KVP_ERR_INVALID_PARAM, "%s: unknown agent handle 0x%llx", fn,
                 static_cast<unsigned long long>(a));
}

kvp_error *BadHandle(const char *fn, const char *what, uint64_t h) {
  return kvp_err(KVP_ERR_INVALID_PARAM, "%s: unknown %s handle 0x%llx for this agent", fn, what,
                 static_cast<unsigned long long>(h));
}

const char *MoriCodeName(mio::StatusCode c) {
  switch (c) {
    case mio::StatusCode::SUCCESS: return "SUCCESS";
    case mio::StatusCode::INIT: return "INIT";
    case mio::StatusCode::IN_PROGRESS: return "IN_PROGRESS";
    case mio::StatusCode::ERR_INVALID_ARGS: return "ERR_INVALID_ARGS";
    case mio::StatusCode::ERR_NOT_FOUND: return "ERR_NOT_FOUND";
    case mio::StatusCode::ERR_RDMA_OP: return "ERR_RDMA_OP";
    case mio::StatusCode::ERR_BAD_STATE: return "ERR_BAD_STATE";
    case mio::StatusCode::ERR_GPU_OP: return "ERR_GPU_OP";
    default: return "ERR_UNKNOWN";
  }
}

// The kvhost code for a MORI failure. INIT after a post means MORI stopped
// before submitting that part of the batch.
kvp_status KvpCodeOf(mio::StatusCode c) {
  switch (c) {
    case mio::StatusCode::ERR_INVALID_ARGS: return KVP_ERR_INVALID_PARAM;
    case mio::StatusCode::ERR_NOT_FOUND: return KVP_ERR_NOT_FOUND;
    default: return KVP_ERR_BACKEND;
  }
}

/* ------------------------------------------------------------------------ */
/* Blobs                                                                    */
/* ------------------------------------------------------------------------ */

template <class T>
std::string Pack(const T &v) {
  msgpack::sbuffer buf;
  msgpack::pack(buf, v);
  return std::string(buf.data(), buf.size());
}

// Decodes exactly one msgpack object of type T filling all of (p, n); the
// bytes come from a peer. Returns NULL or a KVP_ERR_INVALID_PARAM error.
// min_fields: the fewest positional fields any MORI release writes (fields
// appended by newer releases are optional: msgpack-c leaves them default).
template <class T>
kvp_error *Unpack(const char *fn, const char *what, size_t min_fields, const uint8_t *p, size_t n,
                  T *out) {
  if (!p || n == 0) return kvp_err(KVP_ERR_INVALID_PARAM, "%s: empty %s", fn, what);
  try {
    size_t off = 0;
    msgpack::object_handle oh = msgpack::unpack(reinterpret_cast<const char *>(p), n, off,
                                                nullptr, nullptr, kBlobLimit);
    if (off != n)
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: %s has %zu trailing bytes after the object", fn,
                     what, n - off);
    const msgpack::object &o = oh.get();
    if (o.type != msgpack::type::ARRAY || o.via.array.size < min_fields)
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: %s is not an array of at least %zu fields", fn,
                     what, min_fields);
    o.convert(*out);
    return nullptr;
  } catch (const std::bad_alloc &) {
    throw;
  } catch (const std::exception &e) {
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: malformed %s (%zu bytes): %s", fn, what, n,
                   e.what());
  }
}

/* ------------------------------------------------------------------------ */
/* Transfer state                                                           */
/* ------------------------------------------------------------------------ */

// 1 if some status of the current post is still running in MORI.
bool InFlight(Xfer &x) {
  for (auto &s : x.statuses)
    if (s->InProgress()) return true;
  return false;
}

// Waits up to timeout_ms (-1: no limit) for the current post's work to end.
// Returns true when nothing is in flight any more.
bool Drain(mio::IOEngine &engine, Xfer &x, int timeout_ms) {
  if (!InFlight(x)) return true;
  (void)engine.WaitAll(x.status_ptrs, timeout_ms);
  return !InFlight(x);
}

// Records the transfer's first failure (in MORI element order) and returns
// a fresh error for it. Caller holds x.mu.
kvp_error *RecordFailure(Xfer &x) {
  for (size_t i = 0; i < x.statuses.size(); i++) {
    mio::TransferStatus &s = *x.statuses[i];
    mio::StatusCode c = s.Code();
    if (c == mio::StatusCode::SUCCESS || c == mio::StatusCode::IN_PROGRESS) continue;
    x.err_code = KvpCodeOf(c);
    std::string m = c == mio::StatusCode::INIT ? std::string("not submitted by MORI-IO")
                                                : s.Message();
    x.err_msg = "mori " + std::string(x.op == KVP_OP_READ ? "BatchRead" : "BatchWrite") +
                " failed on region pair " + std::to_string(x.pair_index[i]) + " (" +
                MoriCodeName(c) + "): " + m;
    x.state = Xfer::State::kFailed;
    return kvp_err(x.err_code, "%s", x.err_msg.c_str());
  }
  x.err_code = KVP_ERR_BACKEND;
  x.err_msg = "mori: WaitAll reported a failure that no status shows";
  x.state = Xfer::State::kFailed;
  return kvp_err(x.err_code, "%s", x.err_msg.c_str());
}

// Asks MORI, without waiting, how a posted transfer stands: sets *status
// to KVP_IN_PROG or KVP_SUCCESS, or records and returns its first failure.
// Caller holds x.mu.
kvp_error *Progress(mio::IOEngine &engine, Xfer &x, kvp_status *status) {
  mio::StatusCode c = engine.WaitAll(x.status_ptrs, 0);
  if (c == mio::StatusCode::IN_PROGRESS) {
    *status = KVP_IN_PROG;
    return nullptr;
  }
  if (c == mio::StatusCode::SUCCESS) {
    x.Complete();
    *status = KVP_SUCCESS;
    return nullptr;
  }
  return RecordFailure(x);
}

// Hands the statuses of the previous post back to the agent (see
// Agent::status_pool). Caller holds x.mu and has checked that nothing is in
// flight.
void RetireStatuses(Agent &a, Xfer &x) {
  if (!x.statuses.empty()) {
    std::lock_guard<std::mutex> g(a.mu);
    a.status_pool.reserve(a.status_pool.size() + x.statuses.size());
    a.quarantine.reserve(a.quarantine.size() + x.statuses.size());
    for (size_t i = 0; i < x.statuses.size(); i++) {
      bool suspect = i < x.failed_in_post.size() && x.failed_in_post[i];
      (suspect ? a.quarantine : a.status_pool).push_back(std::move(x.statuses[i]));
    }
  }
  x.statuses.clear();
  x.status_ptrs.clear();
  x.failed_in_post.clear();
  x.uids.clear();
}

// Fills x.statuses with n statuses in state INIT, reusing pooled ones.
void TakeStatuses(Agent &a, Xfer &x, size_t n) {
  x.statuses.reserve(n);
  x.status_ptrs.reserve(n);
  std::lock_guard<std::mutex> g(a.mu);
  for (size_t i = 0; i < n; i++) {
    std::unique_ptr<mio::TransferStatus> s;
    if (!a.status_pool.empty()) {
      s = std::move(a.status_pool.back());
      a.status_pool.pop_back();
      s->SetWaitCallback(nullptr);  // XGMI sets these per transfer
      s->SetProgressCallback(nullptr);
      s->SetMessage("");
      s->SetCode(mio::StatusCode::INIT);
    } else {
      s = std::make_unique<mio::TransferStatus>();
    }
    x.status_ptrs.push_back(s.get());
    x.statuses.push_back(std::move(s));
  }
}

/* ------------------------------------------------------------------------ */
/* Event descriptor (KVP_CAP_EVENT_FD)                                      */
/* ------------------------------------------------------------------------ */

// MORI-IO calls nothing back and has no descriptor, but its completion
// thread notifies each TransferStatus's condition variable when the status
// ends. The first get_event_fd of an agent starts a shim thread that
// watches the transfers post_xfer and submit_xfer left in progress: with
// one in flight it sleeps on an unfinished status of it
// (TransferStatus::WaitFor, at most 1 ms, so a transfer posted meanwhile is
// seen within 1 ms); with several it checks their statuses (atomic loads)
// from every 2 us, backing off to every 100 us; with none it sleeps until
// a post. It adds to the agent's eventfd when a watched transfer ended
// (done, failed, or its peer removed). Statuses are never freed while the
// engine lives (Agent::status_pool), so the thread may wait on one after
// its transfer was released; the engine is destroyed only after the thread
// is joined.

void EvSignal(Agent &a) {
  int fd = a.ev_fd.load(std::memory_order_acquire);
  if (fd < 0) return;
  uint64_t one = 1;
  ssize_t wr = write(fd, &one, sizeof one);
  (void)wr;  // EAGAIN: the counter is saturated, still readable
}

void EvWatch(Agent &a, kvp_xfer h) {
  {
    std::lock_guard<std::mutex> g(a.ev_mu);
    a.ev_watch.push_back(h);
  }
  a.ev_cv.notify_one();
}

// One look at a watched transfer: true when it is no longer to be watched
// (*ended: it ended, signal), else *wait is a status still in progress.
bool EvCheck(Agent &a, kvp_xfer h, bool *ended, mio::TransferStatus **wait) {
  *ended = false;
  *wait = nullptr;
  const Tables &t = GetTables();
  Ref<Xfer> xr(t.xfers, h);
  if (!xr || xr->owner != a.handle) return true;  // released meanwhile
  Xfer &x = *xr;
  std::lock_guard<std::mutex> g(x.mu);
  if (x.state != Xfer::State::kActive) {  // a poll saw it end first
    *ended = x.state != Xfer::State::kIdle;
    return true;
  }
  {
    std::lock_guard<std::mutex> ga(a.mu);
    if (!PeerLive(a, x.peer, x.peer_epoch)) {  // cancelled: the next poll says so
      *ended = true;
      return true;
    }
  }
  for (auto &st : x.statuses) {
    if (st->InProgress()) {
      *wait = st.get();
      return false;
    }
  }
  *ended = true;  // every status left IN_PROGRESS: the next poll reports it
  return true;
}

void EvMain(Agent *a) {
  std::vector<kvp_xfer> watch, keep;
  std::chrono::microseconds pause(2);
  std::unique_lock<std::mutex> lk(a->ev_mu);
  for (;;) {
    if (watch.empty()) a->ev_cv.wait(lk, [a] { return a->ev_stop || !a->ev_watch.empty(); });
    if (a->ev_stop) return;
    if (!a->ev_watch.empty()) {
      watch.insert(watch.end(), a->ev_watch.begin(), a->ev_watch.end());
      a->ev_watch.clear();
      pause = std::chrono::microseconds(2);
    }
    lk.unlock();
    bool signal = false;
    mio::TransferStatus *wait = nullptr;
    keep.clear();
    for (kvp_xfer h : watch) {
      bool ended = false;
      mio::TransferStatus *w = nullptr;
      bool drop = true;
      try {
        drop = EvCheck(*a, h, &ended, &w);
      } catch (...) {  // the host's poll reports what went wrong
        ended = true;
      }
      signal = signal || ended;
      if (!drop) {
        keep.push_back(h);
        if (!wait) wait = w;
      }
    }
    watch.swap(keep);
    if (signal) EvSignal(*a);
    if (watch.size() == 1 && wait) {
      (void)wait->WaitFor(1);  // MORI's completion thread wakes it
      lk.lock();
    } else {
      lk.lock();
      if (!watch.empty()) {
        a->ev_cv.wait_for(lk, pause, [a] { return a->ev_stop || !a->ev_watch.empty(); });
        pause = std::min(pause * 2, std::chrono::microseconds(100));
      }
    }
  }
}

// Stops the event thread and closes the descriptor (agent_destroy, before
// the engine goes).
void EvStop(Agent &a) {
  {
    std::lock_guard<std::mutex> g(a.ev_mu);
    a.ev_stop = true;
  }
  a.ev_cv.notify_all();
  if (a.ev_thread.joinable()) a.ev_thread.join();
  int fd = a.ev_fd.exchange(-1);
  if (fd >= 0) close(fd);
}

/* ------------------------------------------------------------------------ */
/* The libmori_io.so loaded                                                 */
/* ------------------------------------------------------------------------ */

// The libmori_io.so of this process and what identifies it.
struct LoadedMori {
  bool found = false;
  std::string path;
  std::string build_id;  // hex; empty when the library has none
};

int FindMori(struct dl_phdr_info *info, size_t, void *data) {
  auto *out = static_cast<LoadedMori *>(data);
  const char *name = info->dlpi_name;
  if (!name || !*name) return 0;
  const char *base = strrchr(name, '/');
  base = base ? base + 1 : name;
  if (strncmp(base, "libmori_io.so", 13) != 0) return 0;
  out->found = true;
  out->path = name;
  // The build ID is an ELF note in a PT_NOTE segment, mapped with the library.
  for (int i = 0; i < info->dlpi_phnum && out->build_id.empty(); i++) {
    const ElfW(Phdr) &ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_NOTE) continue;
    const char *p = reinterpret_cast<const char *>(info->dlpi_addr + ph.p_vaddr);
    const char *end = p + ph.p_memsz;
    while (p + sizeof(ElfW(Nhdr)) <= end) {
      ElfW(Nhdr) n;
      memcpy(&n, p, sizeof n);
      const char *nm = p + sizeof n;
      const char *desc = nm + ((n.n_namesz + 3u) & ~3u);
      const char *next = desc + ((n.n_descsz + 3u) & ~3u);
      if (next > end) break;
      if (n.n_type == NT_GNU_BUILD_ID && n.n_namesz == 4 && memcmp(nm, "GNU", 4) == 0) {
        static const char hex[] = "0123456789abcdef";
        for (uint32_t k = 0; k < n.n_descsz; k++) {
          unsigned char c = static_cast<unsigned char>(desc[k]);
          out->build_id += hex[c >> 4];
          out->build_id += hex[c & 15];
        }
        break;
      }
      p = next;
    }
  }
  return 1;
}

// The identity of the loaded library in the form the build recorded.
std::string LoadedId(const LoadedMori &m) {
  if (strncmp(kMoriLibId, "size:", 5) == 0) {
    struct stat st;
    if (stat(m.path.c_str(), &st) != 0) return "size:unknown (" + std::string(strerror(errno)) + ")";
    return "size:" + std::to_string(static_cast<unsigned long long>(st.st_size));
  }
  return m.build_id.empty() ? std::string("no build-id") : "build-id:" + m.build_id;
}

// Empty when the libmori_io.so in this process is the one the shim was
// built against, else why not. Computed once: the library cannot change.
const std::string &MoriMismatch() {
  static const std::string why = []() -> std::string {
    if (strcmp(kMoriLibId, "none") == 0)
      return "this libkvhost_mori.so was built for a compile check only (no libmori_io.so "
             "recorded); build it with make plugin-mori";
    LoadedMori m;
    dl_iterate_phdr(FindMori, &m);
    std::string built = std::string("built against MORI ") + kMoriCommit + " (libmori_io.so " +
                        kMoriLibId + "; " + LayoutFacts() + ")";
    if (!m.found) return built + ", but no libmori_io.so is loaded in this process";
    std::string id = LoadedId(m);
    if (id == kMoriLibId) return "";
    return built + ", but the libmori_io.so loaded is " + m.path + " (" + id +
           "): MORI's C++ classes change size and layout without changing any symbol, so "
           "using another build would corrupt memory; rebuild the plugin against this MORI "
           "(make plugin-mori MORI_PREFIX=...)";
  }();
  return why;
}

kvp_error *CheckMori(const char *fn) {
  const std::string &why = MoriMismatch();
  if (why.empty()) return nullptr;
  return kvp_err(KVP_ERR_MISMATCH, "%s: libkvhost_mori.so %s", fn, why.c_str());
}

/* ------------------------------------------------------------------------ */
/* Engine storage                                                           */
/* ------------------------------------------------------------------------ */

// The shim allocates the IOEngine (sizeof from the headers) and libmori_io
// constructs it. A library whose IOEngine has grown (a member added, as
// MORI PR #515 does) writes past the end of that storage. So the storage
// has kEngineTail more bytes, filled with kTailByte, and agent_create
// refuses an engine whose construction changed any of them: the library's
// IOEngine is larger than the headers said. The tail keeps the overrun
// inside memory the shim owns, so the refusal is clean.
constexpr size_t kEngineTail = 4096;
constexpr unsigned char kTailByte = 0xA5;
static_assert(alignof(mio::IOEngine) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__,
              "IOEngine needs over-aligned storage");

void EngineDeleter::operator()(mio::IOEngine *e) const {
  e->~IOEngine();
  ::operator delete(static_cast<void *>(e));
}

EnginePtr NewEngine(const std::string &key, const mio::IOEngineConfig &cfg) {
  void *p = ::operator new(sizeof(mio::IOEngine) + kEngineTail);
  memset(static_cast<char *>(p) + sizeof(mio::IOEngine), kTailByte, kEngineTail);
  try {
    return EnginePtr(new (p) mio::IOEngine(key, cfg));
  } catch (...) {
    ::operator delete(p);
    throw;
  }
}

// How many bytes past sizeof(IOEngine) the library wrote (0: none).
size_t EngineOverrun(const mio::IOEngine *e) {
  const unsigned char *tail = reinterpret_cast<const unsigned char *>(e) + sizeof(mio::IOEngine);
  for (size_t i = kEngineTail; i > 0; i--)
    if (tail[i - 1] != kTailByte) return i;
  return 0;
}

kvp_error *CheckEngineSize(const mio::IOEngine *e) {
  size_t over = EngineOverrun(e);
  if (over == 0) return nullptr;
  LoadedMori m;
  dl_iterate_phdr(FindMori, &m);
  return kvp_err(KVP_ERR_MISMATCH,
                 "agent_create: libmori_io.so %s (%s) constructed an IOEngine of at least %zu "
                 "bytes, but this libkvhost_mori.so was built against MORI %s with "
                 "sizeof(IOEngine) %zu (%s): the headers and the library differ; rebuild the "
                 "plugin against the MORI installed (make plugin-mori MORI_PREFIX=...)",
                 m.found ? m.path.c_str() : "?", m.found ? LoadedId(m).c_str() : "?",
                 sizeof(mio::IOEngine) + over, kMoriCommit, sizeof(mio::IOEngine),
                 LayoutFacts().c_str());
}

/* ------------------------------------------------------------------------ */
/* Registration probe                                                       */
/* ------------------------------------------------------------------------ */

// MORI registers a region with a NIC lazily: at the first transfer of a
// (local, remote) region pair, or when a peer asks for the region's key.
// When that registration fails MORI calls abort() (RdmaDeviceContext::
// RegisterRdmaMemoryRegion*, src/application/transport/rdma/rdma.cpp), so
// IOEngine::RegisterMemory can never report a region it cannot use and the
// process dies later, mid-transfer. register_mem therefore does the same
// registration up front with each NIC MORI may pick (MORI_RDMA_DEVICES as
// MORI reads it, ports ACTIVE, as RdmaContext::Initialize and
// GetActiveDevicePortList select them), the way the recorded MORI build
// would (KVHOST_MORI_REG), and deregisters it again at once.

#ifdef MR_DEFAULT_ACCESS_FLAG
constexpr int kMrAccess = MR_DEFAULT_ACCESS_FLAG;
#else
constexpr int kMrAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                          IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
#endif

// MORI_RDMA_DEVICES: "a,b" uses those, "^a,b" all but those.
bool MoriMayUse(const char *dev) {
  const char *env = getenv("MORI_RDMA_DEVICES");
  if (!env || !*env) return true;
  bool exclude = env[0] == '^';
  std::string list(env + (exclude ? 1 : 0));
  bool listed = false;
  size_t pos = 0;
  while (pos <= list.size()) {
    size_t comma = list.find(',', pos);
    if (comma == std::string::npos) comma = list.size();
    std::string item = list.substr(pos, comma - pos);
    size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    if (a != std::string::npos && item.substr(a, b - a + 1) == dev) listed = true;
    pos = comma + 1;
  }
  bool any = list.find_first_not_of(", \t") != std::string::npos;
  if (!any) return true;
  return exclude ? !listed : listed;
}

void CloseProbe(Agent &a) {
  for (ProbeNic &n : a.probe_nics) {
    if (n.pd) ibv_dealloc_pd(n.pd);
    if (n.ctx) ibv_close_device(n.ctx);
  }
  a.probe_nics.clear();
  a.probe_open = false;
}

// Opens a protection domain on each NIC MORI may use. Caller holds
// probe_mu.
kvp_error *OpenProbe(Agent &a) {
  if (a.probe_open) return nullptr;
  int n = 0;
  ibv_device **list = ibv_get_device_list(&n);
  if (!list)
    return kvp_err(KVP_ERR_BACKEND, "register_mem: ibv_get_device_list: %s", strerror(errno));
  for (int i = 0; i < n; i++) {
    const char *name = ibv_get_device_name(list[i]);
    if (!name || !MoriMayUse(name)) continue;
    ProbeNic nic;
    nic.name = name;
    nic.ctx = ibv_open_device(list[i]);
    if (!nic.ctx) continue;  // MORI cannot open it either
    ibv_device_attr da;
    bool active = false;
    if (ibv_query_device(nic.ctx, &da) == 0) {
      for (int port = 1; port <= da.phys_port_cnt && !active; port++) {
        ibv_port_attr pa;
        active = ibv_query_port(nic.ctx, static_cast<uint8_t>(port), &pa) == 0 &&
                 pa.state == IBV_PORT_ACTIVE;
      }
    }
    if (active) nic.pd = ibv_alloc_pd(nic.ctx);
    if (!nic.pd) {
      ibv_close_device(nic.ctx);
      continue;
    }
    a.probe_nics.push_back(nic);
  }
  ibv_free_device_list(list);
  if (a.probe_nics.empty())
    return kvp_err(KVP_ERR_BACKEND,
                   "register_mem: no active RDMA NIC%s to check the registration on, though "
                   "MORI-IO created its RDMA backend; set probe_registration=0 to register "
                   "unchecked (MORI aborts the process if it cannot register later)",
                   getenv("MORI_RDMA_DEVICES") ? " within MORI_RDMA_DEVICES" : "");
  a.probe_open = true;
  return nullptr;
}

// As MORI's env::IsEnvVarEnabled: set, not empty, and not a false boolean.
bool MoriEnvEnabled(const char *name) {
  const char *v = getenv(name);
  if (!v || !*v) return false;
  for (const char *f : {"0", "false", "no", "off"})
    if (strcasecmp(v, f) == 0) return false;
  return true;
}

// hsa_amd_portable_export_dmabuf from the HSA runtime MORI loaded.
using ExportDmabufFn = int (*)(const void *ptr, size_t size, int *fd, uint64_t *offset);

// Registers [addr, addr+len) with nic as the recorded MORI would and
// deregisters it; empty when that works, else why not.
std::string ProbeOne(const ProbeNic &nic, uint64_t addr, uint64_t len, bool gpu) {
  void *p = reinterpret_cast<void *>(addr);
  errno = 0;
  ibv_mr *mr = ibv_reg_mr(nic.pd, p, len, kMrAccess);
  int plain_err = errno;
  if (mr) ibv_dereg_mr(mr);
  const char *reg = kMoriReg;
  bool offset0 = strcmp(reg, "auto-offset0") == 0;
  bool dmabuf_first = MoriEnvEnabled("MORI_ENABLE_DMABUF_REG");
  if (mr && !(gpu && offset0 && dmabuf_first)) return "";
  auto exp = reinterpret_cast<ExportDmabufFn>(dlsym(RTLD_DEFAULT, "hsa_amd_portable_export_dmabuf"));
  std::string offset0_bug = " bytes into its GPU allocation, and MORI " + std::string(kMoriCommit) +
                            " registers it through dmabuf at offset 0 (wrong address or LOC_PROT "
                            "errors; fixed in MORI 0d05a4d2): use MORI >= 0d05a4d2";
  if (mr) {
    // MORI_ENABLE_DMABUF_REG on an offset-0 build: dmabuf goes first, and
    // is wrong exactly when the buffer does not start its allocation.
    int fd = -1;
    uint64_t off = 0;
    if (!exp || exp(p, len, &fd, &off) != 0 || fd < 0) return "";  // MORI falls back to ibv_reg_mr
    close(fd);
    if (off == 0) return "";
    return "with MORI_ENABLE_DMABUF_REG set, the buffer starts " +
           std::to_string(static_cast<unsigned long long>(off)) + offset0_bug;
  }
  std::string plain = "ibv_reg_mr failed (" + std::string(strerror(plain_err)) + ")";
  if (!gpu || strcmp(reg, "ibv") == 0)
    return plain + "; MORI " + kMoriCommit + " registers " + (gpu ? "GPU" : "host") +
           " memory with ibv_reg_mr only and aborts when it fails" +
           (gpu ? " (GPU memory needs the peer-memory kernel module)" : "");
  if (strcmp(reg, "unknown") == 0)
    return plain + "; whether MORI " + kMoriCommit +
           " then tries dmabuf is unknown (build with MORI_SRC set to its git checkout, or "
           "MORI_REG=auto for MORI >= 0d05a4d2)";
  if (!exp) return plain + "; dmabuf: hsa_amd_portable_export_dmabuf is not loaded";
  int fd = -1;
  uint64_t off = 0;
  if (exp(p, len, &fd, &off) != 0 || fd < 0)
    return plain + "; dmabuf: hsa_amd_portable_export_dmabuf failed";
  if (offset0 && off != 0) {
    close(fd);
    return plain + "; the buffer starts " + std::to_string(static_cast<unsigned long long>(off)) +
           offset0_bug;
  }
  errno = 0;
  ibv_mr *dm = ibv_reg_dmabuf_mr(nic.pd, off, len, addr, fd, kMrAccess);
  int dm_err = errno;
  close(fd);
  if (dm) {
    ibv_dereg_mr(dm);
    return "";
  }
  return plain + "; ibv_reg_dmabuf_mr failed (" + std::string(strerror(dm_err)) +
         "); MORI aborts when both fail";
}

// Empty when every NIC MORI may use can register the region. Caller holds
// probe_mu.
std::string ProbeRegion(Agent &a, uint64_t addr, uint64_t len, bool gpu) {
  for (const ProbeNic &nic : a.probe_nics) {
    std::string why = ProbeOne(nic, addr, len, gpu);
    if (!why.empty())
      return "NIC " + nic.name + " cannot register it: " + why +
             " (MORI_RDMA_DEVICES chooses the NICs MORI uses)";
  }
  return "";
}

/* ------------------------------------------------------------------------ */
/* Agent creation helpers                                                   */
/* ------------------------------------------------------------------------ */

struct AgentConfig {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  mio::RdmaBackendConfig rdma{/*qpPerTransfer=*/4, /*postBatchSize=*/-1,
                              /*numWorkerThreads=*/4, mio::PollCqMode::POLLING,
                              /*enableNotification=*/false};
  int release_timeout_ms = 30000;
  bool intra_node_only = false;
  bool probe = true;
};

kvp_error *ParseConfig(const kvp_param *params, size_t n, AgentConfig *cfg) {
  kvp_error *e = kvp_params_check(params, n, kParamNames,
                                  sizeof kParamNames / sizeof kParamNames[0], 0);
  if (e) return e;

  if (const kvp_param *p = kvp_param_find(params, n, "host")) {
    cfg->host.assign(p->value ? p->value : "", p->value_len);
    struct in_addr ia;
    if (cfg->host.find('\0') != std::string::npos || inet_pton(AF_INET, cfg->host.c_str(), &ia) != 1 ||
        ia.s_addr == INADDR_NONE)
      return kvp_err(KVP_ERR_INVALID_PARAM,
                     "param host=\"%s\": want a dotted IPv4 address of this host "
                     "(MORI-IO binds and advertises it as given)",
                     cfg->host.c_str());
  }
  uint64_t port;
  if ((e = kvp_param_u64(params, n, "port", 0, 0, 65535, &port))) return e;
  if (port == kMoriReservedPort)
    return kvp_err(KVP_ERR_INVALID_PARAM,
                   "param port=1: MORI-IO reserves port 1 for its XGMI-only fallback");
  cfg->port = static_cast<uint16_t>(port);

  int64_t v;
  if ((e = kvp_param_i64(params, n, "qp_per_transfer", 4, 1, 1024, &v))) return e;
  cfg->rdma.qpPerTransfer = static_cast<int>(v);
  if ((e = kvp_param_i64(params, n, "post_batch_size", -1, -1, 1 << 20, &v))) return e;
  if (v == 0)
    return kvp_err(KVP_ERR_INVALID_PARAM,
                   "param post_batch_size=0: want -1 (MORI chooses) or a positive count");
  cfg->rdma.postBatchSize = static_cast<int>(v);
  if ((e = kvp_param_i64(params, n, "num_worker_threads", 4, 1, 1024, &v))) return e;
  cfg->rdma.numWorkerThreads = static_cast<int>(v);
  if (const kvp_param *p = kvp_param_find(params, n, "poll_cq_mode")) {
    if (kvp_str_eq(p->value, p->value_len, "polling"))
      cfg->rdma.pollCqMode = mio::PollCqMode::POLLING;
    else if (kvp_str_eq(p->value, p->value_len, "event"))
      cfg->rdma.pollCqMode = mio::PollCqMode::EVENT;
    else
      return kvp_err(KVP_ERR_INVALID_PARAM, "param poll_cq_mode=\"%.*s\": want polling or event",
                     static_cast<int>(std::min<size_t>(p->value_len, 64)),
                     p->value ? p->value : "");
  }
  // MORI's RdmaBackendConfig settings; MORI applies its MORI_IO_*
  // environment variables on top of them (RdmaBackend's constructor and
  // its queue pair setup), so the environment wins, as in MORI itself.
  if ((e = kvp_param_i64(params, n, "num_nics_per_transfer", 1, 1, 64, &v))) return e;
  cfg->rdma.numNicsPerTransfer = static_cast<int>(v);
  int b;
  if ((e = kvp_param_bool(params, n, "transfer_chunking", 0, &b))) return e;
  cfg->rdma.enableTransferChunking = b != 0;
  // MORI refuses chunks under 4096 bytes when chunking is on.
  if ((e = kvp_param_i64(params, n, "chunk_bytes", 65536, 4096, int64_t{1} << 30, &v))) return e;
  cfg->rdma.chunkBytes = static_cast<size_t>(v);
  if ((e = kvp_param_i64(params, n, "max_chunks_per_transfer", 64, 1, 1 << 20, &v))) return e;
  cfg->rdma.maxChunksPerTransfer = static_cast<int>(v);
  if ((e = kvp_param_i64(params, n, "max_send_wr", 0, 0, 1 << 20, &v))) return e;
  cfg->rdma.maxSendWr = static_cast<int>(v);
  if ((e = kvp_param_i64(params, n, "max_cqe", 0, 0, 1 << 24, &v))) return e;
  cfg->rdma.maxCqeNum = static_cast<int>(v);
  if ((e = kvp_param_i64(params, n, "max_msg_sge", 0, 0, 1024, &v))) return e;
  cfg->rdma.maxMsgSge = static_cast<int>(v);
  if ((e = kvp_param_bool(params, n, "intra_node_only", 0, &b))) return e;
  cfg->intra_node_only = b != 0;
  if ((e = kvp_param_bool(params, n, "probe_registration", 1, &b))) return e;
  cfg->probe = b != 0;
  if ((e = kvp_param_i64(params, n, "release_timeout_ms", 30000, -1, INT_MAX, &v))) return e;
  cfg->release_timeout_ms = static_cast<int>(v);
  return nullptr;
}

// MORI's control plane calls exit(-1) when bind() fails, so find out first
// whether host:port can be bound (same options as MORI: SO_REUSEADDR).
kvp_error *ProbeBind(const std::string &host, uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return kvp_err(KVP_ERR_BACKEND, "agent_create: socket(): %s", strerror(errno));
  int one = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  (void)inet_pton(AF_INET, host.c_str(), &sa.sin_addr);
  int rc = bind(fd, reinterpret_cast<sockaddr *>(&sa), sizeof sa);
  int err = errno;
  close(fd);
  if (rc != 0)
    return kvp_err(err == EADDRINUSE ? KVP_ERR_NOT_ALLOWED : KVP_ERR_INVALID_PARAM,
                   "agent_create: cannot bind the control-plane address %s:%u: %s", host.c_str(),
                   static_cast<unsigned>(port), strerror(err));
  return nullptr;
}

/* ------------------------------------------------------------------------ */
/* ABI entries                                                              */
/* ------------------------------------------------------------------------ */

kvp_error *PluginInfo(kvp_plugin_info_args *args) {
  return Guard("plugin_info", [&]() -> kvp_error * {
    const char *fn = "plugin_info";
    if (kvp_error *e = kvp_check_args(args, KVP_PLUGIN_INFO_ARGS_STRUCT_SIZE, fn)) return e;
    // Refused here so that loading the plugin fails, naming both builds.
    if (kvp_error *e = CheckMori(fn)) return e;
    args->name = kPluginName;
    args->version = kPluginVersion;
    args->params_doc = kParamsDoc;
    args->abi_major = KVP_ABI_MAJOR;
    args->abi_minor = KVP_ABI_MINOR;
    args->caps = kCaps;
    args->mem_kinds = KVP_MEM_BIT(KVP_MEM_DRAM) | KVP_MEM_BIT(KVP_MEM_VRAM);
    return nullptr;
  });
}

kvp_error *AgentCreate(kvp_agent_create_args *args) {
  return Guard("agent_create", [&]() -> kvp_error * {
    const char *fn = "agent_create";
    if (kvp_error *e = kvp_check_args(args, KVP_AGENT_CREATE_ARGS_STRUCT_SIZE, fn)) return e;
    if (!args->name || args->name_len == 0 || args->name_len > KVP_MAX_NAME_LEN)
      return kvp_err(KVP_ERR_INVALID_PARAM, "agent_create: name must be 1..%d bytes, got %zu",
                     KVP_MAX_NAME_LEN, args->name ? args->name_len : 0);
    if (kvp_error *e = CheckMori(fn)) return e;
    AgentConfig cfg;
    if (kvp_error *e = ParseConfig(args->params, args->num_params, &cfg))
      return kvp_err_wrap(e, "agent_create");
    if (kvp_error *e = ProbeBind(cfg.host, cfg.port)) return e;

    auto agent = std::make_unique<Agent>();
    agent->name.assign(args->name, args->name_len);
    agent->release_timeout_ms = cfg.release_timeout_ms;
    agent->probe = cfg.probe;
    // The engine key is the agent name: peers see it as our peer name and
    // SGLang sends it as TransferInfo.engine_key.
    agent->engine = NewEngine(agent->name, mio::IOEngineConfig{cfg.host, cfg.port});
    if (kvp_error *e = CheckEngineSize(agent->engine.get())) return e;
    // MORI applies its MORI_IO_* environment overrides on top of cfg.rdma
    // inside RdmaBackend's constructor, so they keep working unchanged.
    agent->engine->CreateBackend(mio::BackendType::RDMA, cfg.rdma);
    if (kvp_error *e = CheckEngineSize(agent->engine.get())) return e;
    int port = agent->engine->GetEngineDesc().port;
    if (port == static_cast<int>(kMoriReservedPort)) {
      // No active RDMA device, and MORI_DISABLE_AUTO_XGMI=0 let MORI fall
      // back to XGMI only: the engine advertises port 1, which nobody can
      // reach over RDMA.
      if (!cfg.intra_node_only)
        return kvp_err(KVP_ERR_BACKEND,
                       "agent_create: MORI-IO found no active RDMA NIC and, because "
                       "MORI_DISABLE_AUTO_XGMI=0 is set, fell back to XGMI only (port 1): peers "
                       "on other nodes could not reach this agent; fix the NIC (or "
                       "MORI_RDMA_DEVICES), unset MORI_DISABLE_AUTO_XGMI, or pass "
                       "intra_node_only=1 if only GPUs of this node are peers");
      agent->xgmi_only = true;
    } else if (port <= 0) {
      return kvp_err(KVP_ERR_BACKEND, "agent_create: MORI-IO did not bind a control-plane port");
    }

    kvp_agent h = 0;
    if (kvp_error *e = kvp_ht_insert(GetTables().agents, agent.get(), &h)) return e;
    agent->handle = h;
    (void)agent.release();
    args->agent = h;
    args->caps = kCaps;
    return nullptr;
  });
}

kvp_error *AgentDestroy(kvp_agent_destroy_args *args) {
  return Guard("agent_destroy", [&]() -> kvp_error * {
    const char *fn = "agent_destroy";
    if (kvp_error *e = kvp_check_args(args, KVP_AGENT_DESTROY_ARGS_STRUCT_SIZE, fn)) return e;
    const Tables &t = GetTables();
    // Waits for calls that hold the agent; later calls find it gone.
    std::unique_ptr<Agent> a(static_cast<Agent *>(kvp_ht_remove(t.agents, args->agent)));
    if (!a) return BadAgent("agent_destroy", args->agent);
    EvStop(*a);  // it looks at the transfers, which go next

    std::vector<std::unique_ptr<Xfer>> xfers;
    std::vector<std::unique_ptr<Region>> regions;
    std::vector<std::unique_ptr<RemoteRegion>> rregions;
    for (kvp_xfer h : a->xfers)
      if (void *p = kvp_ht_remove(t.xfers, h)) xfers.emplace_back(static_cast<Xfer *>(p));
    for (kvp_region h : a->regions)
      if (void *p = kvp_ht_remove(t.regions, h)) regions.emplace_back(static_cast<Region *>(p));
    for (kvp_rregion h : a->rregions)
      if (void *p = kvp_ht_remove(t.rregions, h))
        rregions.emplace_back(static_cast<RemoteRegion *>(p));

    // Destroying the engine is the one real cancel MORI offers: its threads
    // are joined and its queue pairs and memory registrations torn down, so
    // afterwards nothing writes to the statuses or the registered memory.
    std::string failure;
    try {
      for (auto &r : regions) a->engine->DeregisterMemory(r->desc);
    } catch (const std::exception &e) {
      failure = e.what();
    }
    a->engine.reset();
    CloseProbe(*a);
    // Now the statuses (in xfers, the pool and quarantine) can go.
    xfers.clear();
    a->status_pool.clear();
    a->quarantine.clear();
    if (!failure.empty())
      return kvp_err(KVP_ERR_BACKEND,
                     "agent_destroy: agent destroyed, but MORI-IO DeregisterMemory failed: %s",
                     failure.c_str());
    return nullptr;
  });
}

kvp_error *RegisterMem(kvp_register_mem_args *args) {
  return Guard("register_mem", [&]() -> kvp_error * {
    const char *fn = "register_mem";
    if (kvp_error *e = kvp_check_args(args, KVP_REGISTER_MEM_ARGS_STRUCT_SIZE, fn)) return e;
    if (args->num_descs == 0) return nullptr;
    if (!args->descs || !args->regions)
      return kvp_err(KVP_ERR_INVALID_PARAM, "register_mem: descs and regions must not be NULL");
    for (size_t i = 0; i < args->num_descs; i++) {
      const kvp_mem_desc &d = args->descs[i];
      if (d.addr == 0 || d.len == 0 || d.len > UINT64_MAX - d.addr)
        return kvp_err(KVP_ERR_INVALID_PARAM,
                       "register_mem: desc %zu: bad range addr=0x%llx len=%llu", i,
                       static_cast<unsigned long long>(d.addr),
                       static_cast<unsigned long long>(d.len));
      if (d.reserved != 0)
        return kvp_err(KVP_ERR_INVALID_PARAM, "register_mem: desc %zu: reserved must be 0", i);
      if (d.mem_kind == KVP_MEM_DRAM && d.dev_id != 0)
        return kvp_err(KVP_ERR_INVALID_PARAM, "register_mem: desc %zu: DRAM needs dev_id 0", i);
      if (d.mem_kind == KVP_MEM_VRAM && d.dev_id > INT_MAX)
        return kvp_err(KVP_ERR_INVALID_PARAM, "register_mem: desc %zu: dev_id %llu too large",
                       i, static_cast<unsigned long long>(d.dev_id));
      if (d.mem_kind != KVP_MEM_DRAM && d.mem_kind != KVP_MEM_VRAM)
        return kvp_err(KVP_ERR_NOT_SUPPORTED, "register_mem: desc %zu: memory kind %u", i,
                       d.mem_kind);
    }

    const Tables &t = GetTables();
    Ref<Agent> a(t.agents, args->agent);
    if (!a) return BadAgent("register_mem", args->agent);
    // Check that MORI will be able to register each region with its NICs
    // (see "Registration probe"), before MORI sees any of them.
    if (a->probe && !a->xgmi_only) {
      std::lock_guard<std::mutex> pg(a->probe_mu);
      if (kvp_error *e = OpenProbe(*a)) return e;
      for (size_t i = 0; i < args->num_descs; i++) {
        const kvp_mem_desc &d = args->descs[i];
        std::string why = ProbeRegion(*a, d.addr, d.len, d.mem_kind == KVP_MEM_VRAM);
        if (!why.empty())
          return kvp_err(KVP_ERR_BACKEND,
                         "register_mem: desc %zu (%s addr=0x%llx len=%llu): %s; nothing was "
                         "registered",
                         i, d.mem_kind == KVP_MEM_VRAM ? "VRAM" : "DRAM",
                         static_cast<unsigned long long>(d.addr),
                         static_cast<unsigned long long>(d.len), why.c_str());
      }
    }

    std::unique_lock<std::shared_mutex> engine_lock(a->engine_mu);
    std::lock_guard<std::mutex> g(a->mu);

    // Overlap: the new ranges among themselves and against the agent's.
    std::vector<RangeEntry> merged(a->ranges);
    for (size_t i = 0; i < args->num_descs; i++)
      merged.push_back({args->descs[i].addr, args->descs[i].len, kNewRangeBit | i});
    kvp_ranges_sort(merged.data(), merged.size(), sizeof(RangeEntry));
    long bad = kvp_ranges_check(merged.data(), merged.size(), sizeof(RangeEntry));
    if (bad >= 0) {
      uint64_t id = (merged[bad].id & kNewRangeBit) || bad == 0 ? merged[bad].id
                                                                 : merged[bad - 1].id;
      return kvp_err(KVP_ERR_INVALID_PARAM,
                     "register_mem: desc %llu overlaps memory already registered on this agent "
                     "or another desc of this call",
                     static_cast<unsigned long long>(id & ~kNewRangeBit));
    }

    // Register, undoing everything on the first failure (all or nothing).
    std::vector<std::unique_ptr<Region>> made;
    std::vector<kvp_region> handles;
    auto undo = [&]() {
      for (size_t i = 0; i < made.size(); i++) {
        try {
          a->engine->DeregisterMemory(made[i]->desc);
        } catch (...) {
        }
        if (i < handles.size()) (void)kvp_ht_remove(t.regions, handles[i]);
      }
    };
    try {
      for (size_t i = 0; i < args->num_descs; i++) {
        const kvp_mem_desc &d = args->descs[i];
        auto r = std::make_unique<Region>();
        r->owner = a->handle;
        r->addr = d.addr;
        r->len = d.len;
        // MORI's convention: CPU memory has device -1 (SGLang registers its
        // aux buffers that way); GPU memory the ordinal given.
        bool gpu = d.mem_kind == KVP_MEM_VRAM;
        r->desc = a->engine->RegisterMemory(reinterpret_cast<void *>(d.addr), d.len,
                                            gpu ? static_cast<int>(d.dev_id) : -1,
                                            gpu ? mio::MemoryLocationType::GPU
                                                : mio::MemoryLocationType::CPU);
        made.push_back(std::move(r));
        made.back()->blob = Pack(made.back()->desc);
        kvp_region h = 0;
        if (kvp_error *e = kvp_ht_insert(t.regions, made.back().get(), &h)) {
          undo();
          return kvp_err_wrap(e, "register_mem: desc %zu", i);
        }
        handles.push_back(h);
      }
      a->regions.reserve(a->regions.size() + handles.size());
      a->ranges.reserve(merged.size());
    } catch (...) {
      undo();
      throw;
    }
    // Nothing below throws.
    for (size_t i = 0; i < handles.size(); i++) {
      a->regions.insert(handles[i]);
      args->regions[i] = handles[i];
      (void)made[i].release();
    }
    for (RangeEntry &r : merged)
      if (r.id & kNewRangeBit) r.id = handles[r.id & ~kNewRangeBit];
    a->ranges.swap(merged);
    return nullptr;
  });
}

kvp_error *DeregisterMem(kvp_deregister_mem_args *args) {
  return Guard("deregister_mem", [&]() -> kvp_error * {
    const char *fn = "deregister_mem";
    if (kvp_error *e = kvp_check_args(args, KVP_DEREGISTER_MEM_ARGS_STRUCT_SIZE, fn)) return e;
    if (args->num_regions == 0) return nullptr;
    if (!args->regions)
      return kvp_err(KVP_ERR_INVALID_PARAM, "deregister_mem: regions is NULL");
    const Tables &t = GetTables();
    Ref<Agent> a(t.agents, args->agent);
    if (!a) return BadAgent("deregister_mem", args->agent);

    std::vector<Region *> claimed;
    std::string failure;
    {
      std::unique_lock<std::shared_mutex> engine_lock(a->engine_mu);
      std::lock_guard<std::mutex> g(a->mu);
      // Validate all first: nothing is deregistered if any handle is bad.
      std::unordered_set<kvp_region> seen;
      std::vector<Ref<Region>> refs;
      for (size_t i = 0; i < args->num_regions; i++) {
        kvp_region h = args->regions[i];
        Ref<Region> r(t.regions, h);
        if (!r || r->owner != a->handle || r->dying)
          return BadHandle("deregister_mem", "region", h);
        if (!seen.insert(h).second)
          return kvp_err(KVP_ERR_INVALID_PARAM, "deregister_mem: region 0x%llx given twice",
                         static_cast<unsigned long long>(h));
        if (r->users > 0)
          return kvp_err(KVP_ERR_NOT_ALLOWED,
                         "deregister_mem: region 0x%llx is used by %u transfer(s); release them "
                         "first",
                         static_cast<unsigned long long>(h), r->users);
        refs.push_back(std::move(r));
      }
      for (auto &r : refs) {
        r->dying = true;
        claimed.push_back(r.get());
      }
      for (Region *r : claimed) {
        try {
          a->engine->DeregisterMemory(r->desc);
        } catch (const std::exception &e) {
          if (failure.empty()) failure = e.what();
        }
      }
      for (size_t i = 0; i < args->num_regions; i++) a->regions.erase(args->regions[i]);
      a->ranges.erase(std::remove_if(a->ranges.begin(), a->ranges.end(),
                                     [&](const RangeEntry &e) { return seen.count(e.id) > 0; }),
                      a->ranges.end());
    }
    // Outside the locks: kvp_ht_remove waits for other holders of the region
    // (e.g. a make_batch_xfer about to see `dying`), which may need a->mu.
    for (size_t i = 0; i < args->num_regions; i++)
      delete static_cast<Region *>(kvp_ht_remove(t.regions, args->regions[i]));
    // The regions are gone from kvhost's view either way, and kvplugin.h
    // says a failed release leaves its handles valid: so report success and
    // log what MORI said instead of failing with handles that no longer
    // exist.
    if (!failure.empty())
      fprintf(stderr, "kvhost mori plugin: deregister_mem: MORI-IO DeregisterMemory: %s\n",
              failure.c_str());
    return nullptr;
  });
}

kvp_error *RegionExport(kvp_region_export_args *args) {
  return Guard("region_export", [&]() -> kvp_error * {
    const char *fn = "region_export";
    if (kvp_error *e = kvp_check_args(args, KVP_REGION_EXPORT_ARGS_STRUCT_SIZE, fn)) return e;
    const Tables &t = GetTables();
    Ref<Agent> a(t.agents, args->agent);
    if (!a) return BadAgent("region_export", args->agent);
    Ref<Region> r(t.regions, args->region);
    if (!r || r->owner != a->handle) return BadHandle("region_export", "region", args->region);
    if (args->cap > 0 && !args->buf)
      return kvp_err(KVP_ERR_INVALID_PARAM, "region_export: buf is NULL but cap is %zu", args->cap);
    (void)kvp_out_bytes(args->buf, args->cap, r->blob.data(), r->blob.size(), &args->size);
    return nullptr;
  });
}

kvp_error *LocalMetadata(kvp_local_metadata_args *args) {
  return Guard("local_metadata", [&]() -> kvp_error * {
    const char *fn = "local_metadata";
    if (kvp_error *e = kvp_check_args(args, KVP_LOCAL_METADATA_ARGS_STRUCT_SIZE, fn)) return e;
    Ref<Agent> a(GetTables().agents, args->agent);
    if (!a) return BadAgent("local_metadata", args->agent);
    if (args->cap > 0 && !args->buf)
      return kvp_err(KVP_ERR_INVALID_PARAM, "local_metadata: buf is NULL but cap is %zu",
                     args->cap);
    std::string blob = Pack(a->engine->GetEngineDesc());
    (void)kvp_out_bytes(args->buf, args->cap, blob.data(), blob.size(), &args->size);
    return nullptr;
  });
}

kvp_error *LoadRemote(kvp_load_remote_args *args) {
  return Guard("load_remote", [&]() -> kvp_error * {
    const char *fn = "load_remote";
    if (kvp_error *e = kvp_check_args(args, KVP_LOAD_REMOTE_ARGS_STRUCT_SIZE, fn)) return e;
    mio::EngineDesc desc;
    if (kvp_error *e = Unpack(fn, "MORI EngineDesc metadata", kEngineDescFields, args->metadata,
                              args->metadata_len, &desc))
      return e;
    if (desc.key.empty() || desc.key.size() > KVP_MAX_NAME_LEN)
      return kvp_err(KVP_ERR_INVALID_PARAM, "load_remote: engine key must be 1..%d bytes, got %zu",
                     KVP_MAX_NAME_LEN, desc.key.size());
    if (desc.port <= 0 || desc.port > 65535)
      return kvp_err(KVP_ERR_INVALID_PARAM, "load_remote: engine %s has port %d",
                     desc.key.c_str(), desc.port);

    Ref<Agent> a(GetTables().agents, args->agent);
    if (!a) return BadAgent("load_remote", args->agent);
    std::unique_lock<std::shared_mutex> engine_lock(a->engine_mu);
    std::lock_guard<std::mutex> g(a->mu);
    auto it = a->peers.find(desc.key);
    Peer *p;
    if (it == a->peers.end()) {
      auto np = std::make_unique<Peer>();
      np->name = desc.key;
      np->epoch = a->next_epoch++;
      np->desc = desc;
      a->engine->RegisterRemoteEngine(desc);
      p = np.get();
      a->peers.emplace(desc.key, std::move(np));
    } else {
      p = it->second.get();
      // A loaded key keeps its engine descriptor (ABI load_remote): the
      // same descriptor again is idempotent; another one (other host, port
      // or process under a known key) is refused and changes nothing.
      // Replacing it would overwrite MORI's address book entry, so that
      // the honest peer's transfers went to whoever forged its key; and
      // MORI keeps the RDMA connections it built for a key, so a peer that
      // restarted comes back under a new key (SGLang puts pid and a random
      // suffix in its keys) or after remove_remote.
      if (!(p->desc == desc))
        return kvp_err(KVP_ERR_NOT_ALLOWED,
                       "load_remote: engine %s is loaded with another engine descriptor (other "
                       "host, port or process); refused, the loaded peer is unchanged "
                       "(remove_remote it first if it restarted)",
                       desc.key.c_str());
    }
    args->peer_name = p->name.data();
    args->peer_name_len = p->name.size();
    return nullptr;
  });
}

// MORI-IO cannot cancel posted work, so "cancel" is logical: the peer's
// transfers and remote regions die at once (poll of an active transfer says
// KVP_ERR_CANCELED, posts and new transfers say KVP_ERR_NOT_FOUND) while any
// posted work runs to its end in MORI; release_xfer waits for that before it
// frees the transfer. DeregisterRemoteEngine only drops MORI's address-book
// entry (MORI v1.2.2 keeps the queue pairs it built), so in-flight work
// still completes or fails normally.
kvp_error *RemoveRemote(kvp_remove_remote_args *args) {
  return Guard("remove_remote", [&]() -> kvp_error * {
    const char *fn = "remove_remote";
    if (kvp_error *e = kvp_check_args(args, KVP_REMOVE_REMOTE_ARGS_STRUCT_SIZE, fn)) return e;
    if (!args->peer_name || args->peer_name_len == 0)
      return kvp_err(KVP_ERR_INVALID_PARAM, "remove_remote: empty peer name");
    Ref<Agent> a(GetTables().agents, args->agent);
    if (!a) return BadAgent(fn, args->agent);
    std::string name(args->peer_name, args->peer_name_len);
    // Exclusive: no post is inside BatchWrite/BatchRead while the peer goes,
    // and posts check the epoch under the shared lock.
    std::unique_lock<std::shared_mutex> engine_lock(a->engine_mu);
    std::lock_guard<std::mutex> g(a->mu);
    auto it = a->peers.find(name);
    if (it == a->peers.end())
      return kvp_err(KVP_ERR_NOT_FOUND, "remove_remote: no loaded peer %s", name.c_str());
    a->engine->DeregisterRemoteEngine(it->second->desc);  // throws: nothing changed
    a->peers.erase(it);
    EvSignal(*a);  // the peer's transfers in progress ended (cancelled)
    return nullptr;
  });
}

kvp_error *RemoteRegionImport(kvp_remote_region_import_args *args) {
  return Guard("remote_region_import", [&]() -> kvp_error * {
    const char *fn = "remote_region_import";
    if (kvp_error *e = kvp_check_args(args, KVP_REMOTE_REGION_IMPORT_ARGS_STRUCT_SIZE, fn)) return e;
    if (!args->blob)
      return kvp_err(KVP_ERR_NOT_SUPPORTED,
                     "remote_region_import: import by address needs KVP_CAP_REMOTE_ADDR; "
                     "MORI-IO reaches remote memory only through the peer's MemoryDesc blobs");
    if (!args->peer_name || args->peer_name_len == 0)
      return kvp_err(KVP_ERR_INVALID_PARAM, "remote_region_import: empty peer name");
    std::string name(args->peer_name, args->peer_name_len);
    auto rr = std::make_unique<RemoteRegion>();
    if (kvp_error *e = Unpack(fn, "MORI MemoryDesc blob", kMemoryDescMinFields, args->blob,
                              args->blob_len, &rr->desc))
      return e;
    const mio::MemoryDesc &d = rr->desc;
    if (d.data == 0 || d.size == 0 || d.size > UINT64_MAX - d.data)
      return kvp_err(KVP_ERR_INVALID_PARAM,
                     "remote_region_import: blob has bad range data=0x%llx size=%llu",
                     static_cast<unsigned long long>(d.data),
                     static_cast<unsigned long long>(d.size));
    if (d.loc != mio::MemoryLocationType::CPU && d.loc != mio::MemoryLocationType::GPU)
      return kvp_err(KVP_ERR_INVALID_PARAM, "remote_region_import: blob has memory location %u",
                     static_cast<unsigned>(d.loc));

    const Tables &t = GetTables();
    Ref<Agent> a(t.agents, args->agent);
    if (!a) return BadAgent("remote_region_import", args->agent);
    rr->owner = a->handle;
    rr->peer = name;
    std::lock_guard<std::mutex> g(a->mu);
    auto it = a->peers.find(name);
    if (it == a->peers.end())
      return kvp_err(KVP_ERR_NOT_FOUND, "remote_region_import: no loaded peer %s", name.c_str());
    if (d.engineKey != name)
      return kvp_err(KVP_ERR_MISMATCH,
                     "remote_region_import: blob belongs to engine %s, not to peer %s",
                     d.engineKey.c_str(), name.c_str());
    rr->epoch = it->second->epoch;
    a->rregions.reserve(a->rregions.size() + 1);
    kvp_rregion h = 0;
    if (kvp_error *e = kvp_ht_insert(t.rregions, rr.get(), &h)) return e;
    a->rregions.insert(h);
    args->addr = d.data;
    args->len = d.size;
    args->dev_id = d.deviceId < 0 ? 0 : static_cast<uint64_t>(d.deviceId);
    args->mem_kind = d.loc == mio::MemoryLocationType::GPU ? KVP_MEM_VRAM : KVP_MEM_DRAM;
    args->rregion = h;
    (void)rr.release();
    return nullptr;
  });
}

kvp_error *RemoteRegionRelease(kvp_remote_region_release_args *args) {
  return Guard("remote_region_release", [&]() -> kvp_error * {
    const char *fn = "remote_region_release";
    if (kvp_error *e = kvp_check_args(args, KVP_REMOTE_REGION_RELEASE_ARGS_STRUCT_SIZE, fn)) return e;
    const Tables &t = GetTables();
    Ref<Agent> a(t.agents, args->agent);
    if (!a) return BadAgent("remote_region_release", args->agent);
    {
      std::lock_guard<std::mutex> g(a->mu);
      Ref<RemoteRegion> rr(t.rregions, args->rregion);
      if (!rr || rr->owner != a->handle || !a->rregions.erase(args->rregion))
        return BadHandle("remote_region_release", "remote region", args->rregion);
    }
    // Transfers copied the MemoryDesc, so they do not depend on this handle.
    delete static_cast<RemoteRegion *>(kvp_ht_remove(t.rregions, args->rregion));
    return nullptr;
  });
}

// Appends the blocks of one entry to MORI element `slot`, splitting blocks
// longer than kMaxPiece.
void AppendEntry(Xfer &x, size_t slot, const kvp_batch_entry &e) {
  for (uint64_t k = 0; k < e.count; k++) {
    uint64_t lo = e.local_offset + (e.count > 1 ? k * e.local_stride : 0);
    uint64_t ro = e.remote_offset + (e.count > 1 ? k * e.remote_stride : 0);
    for (uint64_t done = 0; done < e.len; done += kMaxPiece) {
      uint64_t n = std::min(kMaxPiece, e.len - done);
      x.local_offsets[slot].push_back(lo + done);
      x.remote_offsets[slot].push_back(ro + done);
      x.sizes[slot].push_back(n);
    }
  }
}

kvp_error *MakeBatchXfer(kvp_make_batch_xfer_args *args) {
  return Guard("make_batch_xfer", [&]() -> kvp_error * {
    const char *fn = "make_batch_xfer";
    if (kvp_error *e = kvp_check_args(args, KVP_MAKE_BATCH_XFER_ARGS_STRUCT_SIZE, fn)) return e;
    if (args->op != KVP_OP_READ && args->op != KVP_OP_WRITE)
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: op %u is neither READ nor WRITE", fn, args->op);
    if (args->notif.has_notif)
      return kvp_err(KVP_ERR_NOT_SUPPORTED,
                     "%s: transfer notifications need KVP_CAP_NOTIF; the mori plugin runs "
                     "MORI-IO with notifications off (completion goes out of band, as in SGLang)",
                     fn);
    if ((args->num_pairs > 0 && !args->pairs) || (args->num_entries > 0 && !args->entries))
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: pairs or entries is NULL", fn);

    const Tables &t = GetTables();
    Ref<Agent> a(t.agents, args->agent);
    if (!a) return BadAgent(fn, args->agent);

    auto x = std::make_unique<Xfer>();
    x->owner = a->handle;
    x->op = args->op;

    // Resolve every pair; all remote regions must belong to one peer.
    std::vector<Ref<Region>> locals;
    std::vector<Ref<RemoteRegion>> remotes;
    locals.reserve(args->num_pairs);
    remotes.reserve(args->num_pairs);
    for (size_t i = 0; i < args->num_pairs; i++) {
      Ref<Region> r(t.regions, args->pairs[i].local);
      if (!r || r->owner != a->handle) {
        return kvp_err(KVP_ERR_INVALID_PARAM, "%s: pair %zu: unknown region handle 0x%llx", fn,
                       i, static_cast<unsigned long long>(args->pairs[i].local));
      }
      Ref<RemoteRegion> rr(t.rregions, args->pairs[i].remote);
      if (!rr || rr->owner != a->handle) {
        return kvp_err(KVP_ERR_INVALID_PARAM,
                       "%s: pair %zu: unknown remote region handle 0x%llx", fn, i,
                       static_cast<unsigned long long>(args->pairs[i].remote));
      }
      if (i == 0) {
        x->peer = rr->peer;
        x->peer_epoch = rr->epoch;
      } else if (rr->peer != x->peer) {
        return kvp_err(KVP_ERR_MISMATCH,
                       "%s: pair %zu: remote region of peer %s, pair 0 is of peer %s", fn, i,
                       rr->peer.c_str(), x->peer.c_str());
      }
      locals.push_back(std::move(r));
      remotes.push_back(std::move(rr));
    }

    // Check every entry before building anything; count MORI work requests.
    std::vector<uint64_t> pieces(args->num_pairs, 0);
    for (size_t i = 0; i < args->num_entries; i++) {
      const kvp_batch_entry &e = args->entries[i];
      if (e.pair >= args->num_pairs)
        return kvp_err(KVP_ERR_INVALID_PARAM, "%s: entry %zu: pair %u out of %zu pairs", fn, i,
                       e.pair, args->num_pairs);
      if (e.reserved != 0)
        return kvp_err(KVP_ERR_INVALID_PARAM, "%s: entry %zu: reserved must be 0", fn, i);
      if (e.len == 0 || e.count == 0)
        return kvp_err(KVP_ERR_INVALID_PARAM, "%s: entry %zu: len and count must be > 0", fn, i);
      const Region &lr = *locals[e.pair];
      const RemoteRegion &rr = *remotes[e.pair];
      if (!kvp_strided_in(e.local_offset, e.len, e.local_stride, e.count, 0, lr.len))
        return kvp_err(KVP_ERR_INVALID_PARAM,
                       "%s: entry %zu: local blocks (offset %llu, len %llu, stride %llu, count "
                       "%llu) leave the local region of %llu bytes",
                       fn, i, static_cast<unsigned long long>(e.local_offset),
                       static_cast<unsigned long long>(e.len),
                       static_cast<unsigned long long>(e.local_stride),
                       static_cast<unsigned long long>(e.count),
                       static_cast<unsigned long long>(lr.len));
      if (!kvp_strided_in(e.remote_offset, e.len, e.remote_stride, e.count, 0, rr.desc.size))
        return kvp_err(KVP_ERR_INVALID_PARAM,
                       "%s: entry %zu: remote blocks (offset %llu, len %llu, stride %llu, count "
                       "%llu) leave the remote region of %llu bytes",
                       fn, i, static_cast<unsigned long long>(e.remote_offset),
                       static_cast<unsigned long long>(e.len),
                       static_cast<unsigned long long>(e.remote_stride),
                       static_cast<unsigned long long>(e.count),
                       static_cast<unsigned long long>(rr.desc.size));
      // In range of the region, so len * count <= 2^64 and no overflow below.
      uint64_t per_block = (e.len + kMaxPiece - 1) / kMaxPiece;
      if (e.count > kMaxPiecesPerPair / per_block ||
          pieces[e.pair] > kMaxPiecesPerPair - e.count * per_block)
        return kvp_err(KVP_ERR_INVALID_PARAM,
                       "%s: pair %u has more than %llu blocks; MORI-IO counts them in an int", fn,
                       e.pair, static_cast<unsigned long long>(kMaxPiecesPerPair));
      pieces[e.pair] += e.count * per_block;
      x->total_bytes += e.len * e.count;
      x->desc_count++;
    }

    // Group by pair: one MORI element per pair that has entries.
    std::vector<size_t> slot_of(args->num_pairs, SIZE_MAX);
    for (size_t p = 0; p < args->num_pairs; p++) {
      if (pieces[p] == 0) continue;
      slot_of[p] = x->locals.size();
      x->pair_index.push_back(p);
      x->locals.push_back(locals[p]->desc);
      x->remotes.push_back(remotes[p]->desc);
      x->local_offsets.emplace_back();
      x->remote_offsets.emplace_back();
      x->sizes.emplace_back();
      x->local_offsets.back().reserve(pieces[p]);
      x->remote_offsets.back().reserve(pieces[p]);
      x->sizes.back().reserve(pieces[p]);
    }
    for (size_t i = 0; i < args->num_entries; i++)
      AppendEntry(*x, slot_of[args->entries[i].pair], args->entries[i]);

    // The distinct local regions the transfer uses, each counted once in
    // Region::users so deregister_mem can refuse while the transfer lives.
    std::vector<std::pair<kvp_region, Region *>> used;
    for (size_t p = 0; p < args->num_pairs; p++)
      if (pieces[p] > 0) used.emplace_back(args->pairs[p].local, locals[p].get());
    std::sort(used.begin(), used.end());
    used.erase(std::unique(used.begin(), used.end()), used.end());
    for (auto &u : used) x->regions.push_back(u.first);

    // Publish: the peer must still be loaded and no region being deregistered.
    std::lock_guard<std::mutex> g(a->mu);
    for (size_t p = 0; p < args->num_pairs; p++)
      if (!PeerLive(*a, remotes[p]->peer, remotes[p]->epoch))
        return kvp_err(KVP_ERR_NOT_FOUND,
                       "%s: pair %zu: remote region of peer %s, which was removed", fn, p,
                       remotes[p]->peer.c_str());
    for (auto &u : used)
      if (u.second->dying)
        return kvp_err(KVP_ERR_INVALID_PARAM, "%s: region 0x%llx is being deregistered", fn,
                       static_cast<unsigned long long>(u.first));
    a->xfers.reserve(a->xfers.size() + 1);
    kvp_xfer h = 0;
    if (kvp_error *e = kvp_ht_insert(t.xfers, x.get(), &h)) return e;
    a->xfers.insert(h);
    for (auto &u : used) u.second->users++;
    args->xfer = h;
    (void)x.release();
    return nullptr;
  });
}

kvp_error *PostXfer(kvp_post_xfer_args *args) {
  return Guard("post_xfer", [&]() -> kvp_error * {
    const char *fn = "post_xfer";
    if (kvp_error *e = kvp_check_args(args, KVP_POST_XFER_ARGS_STRUCT_SIZE, fn)) return e;
    const Tables &t = GetTables();
    Ref<Agent> a(t.agents, args->agent);
    if (!a) return BadAgent("post_xfer", args->agent);
    Ref<Xfer> xr(t.xfers, args->xfer);
    if (!xr || xr->owner != a->handle) return BadHandle("post_xfer", "transfer", args->xfer);
    Xfer &x = *xr;
    std::lock_guard<std::mutex> g(x.mu);
    {
      std::lock_guard<std::mutex> ga(a->mu);
      if (!PeerLive(*a, x.peer, x.peer_epoch) && !x.locals.empty())
        return kvp_err(KVP_ERR_NOT_FOUND, "post_xfer: peer %s was removed", x.peer.c_str());
    }
    if (InFlight(x))
      return kvp_err(KVP_ERR_REPOST_ACTIVE, "post_xfer: the transfer is still in progress");
    RetireStatuses(*a, x);

    x.start_us = WallMicros();
    x.posted_at = Clock::now();
    x.err_code = KVP_SUCCESS;
    x.err_msg.clear();
    if (x.locals.empty()) {  // nothing to move
      x.post_us = 0;
      x.Complete();
      args->status = KVP_SUCCESS;
      return nullptr;
    }
    std::shared_lock<std::shared_mutex> engine_lock(a->engine_mu);
    {
      std::lock_guard<std::mutex> ga(a->mu);
      if (!PeerLive(*a, x.peer, x.peer_epoch))
        return kvp_err(KVP_ERR_NOT_FOUND, "post_xfer: peer %s was removed", x.peer.c_str());
    }

    size_t n = x.locals.size();
    TakeStatuses(*a, x, n);
    x.uids.reserve(n);
    for (size_t i = 0; i < n; i++) x.uids.push_back(a->engine->AllocateTransferUniqueId());
    x.failed_in_post.assign(n, false);
    x.state = Xfer::State::kActive;

    std::string thrown;
    kvp_status thrown_code = KVP_ERR_BACKEND;
    {
      try {
        if (x.op == KVP_OP_WRITE)
          a->engine->BatchWrite(x.locals, x.local_offsets, x.remotes, x.remote_offsets, x.sizes,
                                x.status_ptrs, x.uids);
        else
          a->engine->BatchRead(x.locals, x.local_offsets, x.remotes, x.remote_offsets, x.sizes,
                               x.status_ptrs, x.uids);
      } catch (const std::bad_alloc &) {
        thrown = "out of memory";
      } catch (const std::system_error &e) {
        // MORI reaches the peer's control plane over TCP to set up RDMA.
        thrown = e.what();
        thrown_code = KVP_ERR_REMOTE_DISCONNECT;
      } catch (const std::exception &e) {
        thrown = e.what();
      } catch (...) {
        thrown = "unknown C++ exception";
      }
    }
    engine_lock.unlock();
    Clock::time_point posted = Clock::now();
    x.post_us = MicrosBetween(x.posted_at, posted);
    for (size_t i = 0; i < n; i++) x.failed_in_post[i] = x.statuses[i]->Failed();

    if (!thrown.empty()) {
      // Pairs before the throwing one may be running; release waits for them.
      x.state = Xfer::State::kFailed;
      x.err_code = thrown_code;
      x.err_msg = std::string("mori ") + (x.op == KVP_OP_READ ? "BatchRead" : "BatchWrite") +
                  ": " + thrown;
      return kvp_err(x.err_code, "%s", x.err_msg.c_str());
    }
    kvp_error *pe = Progress(*a->engine, x, &args->status);
    if (!pe && args->status == KVP_IN_PROG && a->ev_fd.load(std::memory_order_acquire) >= 0)
      EvWatch(*a, args->xfer);
    return pe;
  });
}

// One poll of x, as poll_xfer without ABI 1.1 flags. Caller holds x.mu.
kvp_error *PollLocked(Agent &a, Xfer &x, kvp_status *status) {
  {
    switch (x.state) {
      case Xfer::State::kIdle:
        return kvp_err(KVP_ERR_NOT_POSTED, "poll_xfer: the transfer was never posted");
      case Xfer::State::kDone:
        *status = KVP_SUCCESS;
        return nullptr;
      case Xfer::State::kFailed:
        return kvp_err(x.err_code, "%s", x.err_msg.c_str());
      case Xfer::State::kActive:
        break;
    }
    {
      std::lock_guard<std::mutex> ga(a.mu);
      if (!PeerLive(a, x.peer, x.peer_epoch)) {
        // remove_remote cancelled it. Posted work may still run in MORI;
        // release_xfer waits for it.
        x.state = Xfer::State::kFailed;
        x.err_code = KVP_ERR_CANCELED;
        x.err_msg = "poll_xfer: cancelled: peer " + x.peer + " was removed";
        return kvp_err(x.err_code, "%s", x.err_msg.c_str());
      }
    }
    // MORI's RDMA backend completes transfers on its own completion thread:
    // this poll does no transfer work here. (The XGMI backend, which MORI
    // adds only with MORI_DISABLE_AUTO_XGMI=0, runs a non-blocking event
    // query per status.)
    return Progress(*a.engine, x, status);
  }
}

kvp_error *ReleaseXfer(kvp_release_xfer_args *args);

// ABI 1.1 flags (KVP_CAP_SUBMIT): once the transfer ended,
// KVP_POLL_TELEMETRY copies the shim's telemetry and KVP_POLL_RELEASE
// releases it, but only when nothing of it runs in MORI any more (a
// failed or cancelled transfer's posted work may): release never waits
// inside a poll; released stays 0 and the host calls release_xfer.
kvp_error *PollXfer(kvp_poll_xfer_args *args) {
  return Guard("poll_xfer", [&]() -> kvp_error * {
    const char *fn = "poll_xfer";
    if (kvp_error *e = kvp_check_args(args, KVP_POLL_XFER_ARGS_STRUCT_SIZE_1_0, fn)) return e;
    uint32_t flags = 0;
    if (KVP_ARGS_HAS(args, kvp_poll_xfer_args, desc_count)) {
      flags = args->flags;
      args->released = 0;
      args->has_telemetry = 0;
    }
    const Tables &t = GetTables();
    Ref<Agent> a(t.agents, args->agent);
    if (!a) return BadAgent("poll_xfer", args->agent);
    kvp_error *e;
    bool release = false;
    {
      Ref<Xfer> xr(t.xfers, args->xfer);
      if (!xr || xr->owner != a->handle) return BadHandle("poll_xfer", "transfer", args->xfer);
      Xfer &x = *xr;
      std::lock_guard<std::mutex> g(x.mu);
      e = PollLocked(*a, x, &args->status);
      bool ended = x.state == Xfer::State::kDone || x.state == Xfer::State::kFailed;
      if (ended && !e && (flags & KVP_POLL_TELEMETRY) && x.tel_valid) {
        args->start_us = x.tel_start_us;
        args->post_us = x.tel_post_us;
        args->xfer_us = x.tel_xfer_us;
        args->total_bytes = x.total_bytes;
        args->desc_count = x.desc_count;
        args->has_telemetry = 1;
      }
      release = ended && (flags & KVP_POLL_RELEASE) && !InFlight(x);
    }
    if (release) {
      kvp_release_xfer_args r{KVP_RELEASE_XFER_ARGS_STRUCT_SIZE, nullptr, args->agent, args->xfer};
      if (kvp_error *re = ReleaseXfer(&r))
        kvp_err_free(re);  // the handle stays valid: released 0
      else
        args->released = 1;
    }
    return e;
  });
}

kvp_error *ReleaseXfer(kvp_release_xfer_args *args) {
  return Guard("release_xfer", [&]() -> kvp_error * {
    const char *fn = "release_xfer";
    if (kvp_error *e = kvp_check_args(args, KVP_RELEASE_XFER_ARGS_STRUCT_SIZE, fn)) return e;
    const Tables &t = GetTables();
    Ref<Agent> a(t.agents, args->agent);
    if (!a) return BadAgent("release_xfer", args->agent);
    {
      Ref<Xfer> xr(t.xfers, args->xfer);
      if (!xr || xr->owner != a->handle) return BadHandle("release_xfer", "transfer", args->xfer);
      std::lock_guard<std::mutex> g(xr->mu);
      // MORI cannot cancel posted work: wait for it to end.
      if (!Drain(*a->engine, *xr, a->release_timeout_ms))
        return kvp_err(KVP_ERR_BACKEND,
                       "release_xfer: transfer still in flight after %d ms; MORI-IO cannot "
                       "cancel posted work; the handle stays valid, release it again later",
                       a->release_timeout_ms);
    }
    std::unique_ptr<Xfer> x(static_cast<Xfer *>(kvp_ht_remove(t.xfers, args->xfer)));
    if (!x) return BadHandle("release_xfer", "transfer", args->xfer);
    RetireStatuses(*a, *x);
    std::lock_guard<std::mutex> g(a->mu);
    a->xfers.erase(args->xfer);
    for (kvp_region h : x->regions) {
      Ref<Region> r(t.regions, h);
      if (r && r->users > 0) r->users--;
    }
    return nullptr;
  });
}

kvp_error *XferTelemetry(kvp_xfer_telemetry_args *args) {
  return Guard("xfer_telemetry", [&]() -> kvp_error * {
    const char *fn = "xfer_telemetry";
    if (kvp_error *e = kvp_check_args(args, KVP_XFER_TELEMETRY_ARGS_STRUCT_SIZE, fn)) return e;
    const Tables &t = GetTables();
    Ref<Agent> a(t.agents, args->agent);
    if (!a) return BadAgent("xfer_telemetry", args->agent);
    Ref<Xfer> xr(t.xfers, args->xfer);
    if (!xr || xr->owner != a->handle)
      return BadHandle("xfer_telemetry", "transfer", args->xfer);
    std::lock_guard<std::mutex> g(xr->mu);
    if (!xr->tel_valid)
      return kvp_err(KVP_ERR_NO_TELEMETRY,
                     "xfer_telemetry: no completed post yet (poll until it reports success)");
    args->start_us = xr->tel_start_us;
    args->post_us = xr->tel_post_us;
    args->xfer_us = xr->tel_xfer_us;
    args->total_bytes = xr->total_bytes;
    args->desc_count = xr->desc_count;
    return nullptr;
  });
}

// make_batch_xfer + post_xfer. The prepped form needs KVP_CAP_PREPPED, which
// MORI-IO lacks (the host emulates prepped lists with the batch form).
kvp_error *SubmitXfer(kvp_submit_xfer_args *args) {
  return Guard("submit_xfer", [&]() -> kvp_error * {
    const char *fn = "submit_xfer";
    if (kvp_error *e = kvp_check_args(args, KVP_SUBMIT_XFER_ARGS_STRUCT_SIZE, fn)) return e;
    if (!args->prepped == !args->batch)
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: exactly one of prepped and batch must be set", fn);
    if (args->prepped)
      return kvp_err(KVP_ERR_NOT_SUPPORTED,
                     "%s: the prepped form needs KVP_CAP_PREPPED, which the mori plugin lacks "
                     "(the host emulates prepped lists with the batch form)",
                     fn);
    kvp_make_batch_xfer_args *m = args->batch;
    if (kvp_error *e = MakeBatchXfer(m)) return e;
    kvp_post_xfer_args p{KVP_POST_XFER_ARGS_STRUCT_SIZE, nullptr, m->agent, m->xfer, KVP_IN_PROG};
    if (kvp_error *e = PostXfer(&p)) {
      // Work posted before a failure may run: release waits for it, as
      // release_xfer does (release_timeout_ms).
      kvp_release_xfer_args r{KVP_RELEASE_XFER_ARGS_STRUCT_SIZE, nullptr, m->agent, m->xfer};
      kvp_err_free(ReleaseXfer(&r));
      m->xfer = 0;
      return e;
    }
    args->status = p.status;
    return nullptr;
  });
}

kvp_error *GetEventFd(kvp_get_event_fd_args *args) {
  return Guard("get_event_fd", [&]() -> kvp_error * {
    const char *fn = "get_event_fd";
    if (kvp_error *e = kvp_check_args(args, KVP_GET_EVENT_FD_ARGS_STRUCT_SIZE, fn)) return e;
    const Tables &t = GetTables();
    Ref<Agent> a(t.agents, args->agent);
    if (!a) return BadAgent(fn, args->agent);
    bool first = false;
    {
      std::lock_guard<std::mutex> g(a->ev_mu);
      if (a->ev_fd.load(std::memory_order_acquire) < 0) {
        int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (fd < 0) return kvp_err(KVP_ERR_BACKEND, "%s: eventfd: %s", fn, strerror(errno));
        try {
          a->ev_thread = std::thread(EvMain, a.get());
        } catch (...) {
          close(fd);
          throw;
        }
        a->ev_fd.store(fd, std::memory_order_release);
        first = true;
      }
      args->fd = a->ev_fd.load(std::memory_order_acquire);
    }
    if (first) {  // transfers posted before: watch those still in progress
      std::vector<kvp_xfer> xs;
      {
        std::lock_guard<std::mutex> g(a->mu);
        xs.assign(a->xfers.begin(), a->xfers.end());
      }
      for (kvp_xfer h : xs) {
        Ref<Xfer> xr(t.xfers, h);
        if (!xr) continue;
        bool active;
        {
          std::lock_guard<std::mutex> g(xr->mu);
          active = xr->state == Xfer::State::kActive;
        }
        if (active) EvWatch(*a, h);
      }
    }
    return nullptr;
  });
}

// Entries of capabilities this plugin does not report. The host never calls
// them; they answer KVP_ERR_NOT_SUPPORTED rather than crash if one does.
kvp_error *NotSupported(const char *fn, const char *cap) {
  return kvp_err(KVP_ERR_NOT_SUPPORTED, "%s: the mori plugin has no %s", fn, cap);
}
kvp_error *PrepDlist(kvp_prep_dlist_args *) {
  return NotSupported("prep_dlist", "KVP_CAP_PREPPED (the host emulates it)");
}
kvp_error *ReleaseDlist(kvp_release_dlist_args *) {
  return NotSupported("release_dlist", "KVP_CAP_PREPPED (the host emulates it)");
}
kvp_error *MakePreppedXfer(kvp_make_prepped_xfer_args *) {
  return NotSupported("make_prepped_xfer", "KVP_CAP_PREPPED (the host emulates it)");
}
kvp_error *GetNotifs(kvp_get_notifs_args *) {
  return NotSupported("get_notifs", "KVP_CAP_NOTIF (completion goes out of band)");
}
kvp_error *SendNotif(kvp_send_notif_args *) {
  return NotSupported("send_notif", "KVP_CAP_NOTIF (completion goes out of band)");
}

const kvp_api kApi = {
    KVP_API_STRUCT_SIZE,
    nullptr,
    KVP_ABI_MAJOR,
    KVP_ABI_MINOR,
    kvp_util_error_destroy,
    kvp_util_error_message,
    kvp_util_error_code,
    PluginInfo,
    AgentCreate,
    AgentDestroy,
    RegisterMem,
    DeregisterMem,
    RegionExport,
    LocalMetadata,
    LoadRemote,
    RemoveRemote,
    RemoteRegionImport,
    RemoteRegionRelease,
    PrepDlist,
    ReleaseDlist,
    MakePreppedXfer,
    MakeBatchXfer,
    PostXfer,
    PollXfer,
    ReleaseXfer,
    XferTelemetry,
    GetNotifs,
    SendNotif,
    SubmitXfer,
    GetEventFd,
};

}  // namespace

extern "C" KVP_EXPORT kvp_status kvp_plugin_get_api(kvp_get_api_args *args) {
  return kvp_util_get_api(args, KVP_ABI_MAJOR, &kApi);
}
