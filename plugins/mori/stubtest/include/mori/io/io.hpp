/*
 * Stand-in for MORI-IO's public header mori/io/io.hpp, written for kvhost's
 * stand-in test (`make mori-stub-test`, part of `make test`) so that CI can
 * build and drive the mori shim without MORI, ROCm or HIP. It is NOT MORI:
 * it declares, in our own words, the subset of the API the shim and
 * stubtest/mori_stub.cc use, with the names, types and field order of
 * ROCm/mori main at 624002c (include/mori/io/{enum,common,backend,engine}.hpp)
 * so that the shim compiles unchanged against either. The compile proof
 * against MORI's real headers is check_compile.sh (README, "Compile proof").
 *
 * TransferStatus keeps MORI's observable contract (codes are atomics; a
 * final Update stores, unlocks and only then notifies; WaitFor(0) polls),
 * which the shim's status pool and event thread depend on.
 */
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <msgpack.hpp>

// MORI's default memory-region access flags (mori/application/transport/rdma/rdma.hpp).
#define MR_DEFAULT_ACCESS_FLAG \
  IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC

namespace mori {
namespace io {

enum class BackendType : uint32_t { Unknown = 0, XGMI = 1, RDMA = 2, TCP = 3, FABRIC = 4 };
enum class MemoryLocationType : uint32_t { Unknown = 0, CPU = 1, GPU = 2 };
enum class StatusCode : uint32_t {
  SUCCESS = 0,
  INIT = 1,
  IN_PROGRESS = 2,
  ERR_BEGIN = 10,
  ERR_INVALID_ARGS = 11,
  ERR_NOT_FOUND = 12,
  ERR_RDMA_OP = 13,
  ERR_BAD_STATE = 14,
  ERR_GPU_OP = 15
};
enum class PollCqMode : uint32_t { POLLING = 0, EVENT = 1 };

using EngineKey = std::string;
using MemoryUniqueId = uint32_t;
using TransferUniqueId = uint64_t;
constexpr size_t kIpcHandleSize = 64;

}  // namespace io
}  // namespace mori

MSGPACK_ADD_ENUM(mori::io::MemoryLocationType);

namespace mori {
namespace io {

struct EngineDesc {
  EngineKey key;
  std::string nodeId;
  std::string hostname;
  std::string host;
  int port;
  int pid{0};
  bool operator==(const EngineDesc &o) const {
    return key == o.key && nodeId == o.nodeId && hostname == o.hostname && host == o.host &&
           port == o.port && pid == o.pid;
  }
  MSGPACK_DEFINE(key, nodeId, hostname, host, port, pid);
};

struct MemoryDesc {
  EngineKey engineKey;
  MemoryUniqueId id{0};
  int deviceId{-1};
  std::string deviceBusId;
  uintptr_t data{0};
  size_t size{0};
  MemoryLocationType loc;
  std::array<char, kIpcHandleSize> ipcHandle{};
  int numaNode{-1};
  uintptr_t ipcOffset{0};
  std::array<char, kIpcHandleSize> fabricHandle{};
  int vpodId{-1};
  std::string vpodPpodId;
  uint64_t fabricOffset{0};
  uint64_t fabricAllocSize{0};
  MSGPACK_DEFINE(engineKey, id, deviceId, deviceBusId, data, size, loc, ipcHandle, numaNode,
                 ipcOffset, fabricHandle, vpodId, vpodPpodId, fabricOffset, fabricAllocSize);
};

struct TransferStatus {
  TransferStatus() = default;
  TransferStatus(const TransferStatus &) = delete;
  TransferStatus &operator=(const TransferStatus &) = delete;

  StatusCode Code() {
    Progress();
    return code.load(std::memory_order_acquire);
  }
  std::string Message() {
    std::lock_guard<std::mutex> g(mu);
    return msg;
  }
  // A failed status keeps its first failure.
  void Update(StatusCode c, const std::string &m) {
    {
      std::lock_guard<std::mutex> g(mu);
      if (code.load(std::memory_order_relaxed) > StatusCode::ERR_BEGIN) return;
      msg = m;
      code.store(c, std::memory_order_release);
    }
    cv.notify_all();
  }
  bool Init() { return Code() == StatusCode::INIT; }
  bool InProgress() { return Code() == StatusCode::IN_PROGRESS; }
  bool Succeeded() { return Code() == StatusCode::SUCCESS; }
  bool Failed() { return Code() > StatusCode::ERR_BEGIN; }
  void SetCode(StatusCode c) {
    {
      std::lock_guard<std::mutex> g(mu);
      code.store(c, std::memory_order_release);
    }
    if (c != StatusCode::INIT && c != StatusCode::IN_PROGRESS) cv.notify_all();
  }
  void SetMessage(const std::string &m) {
    std::lock_guard<std::mutex> g(mu);
    msg = m;
  }
  void Wait() { (void)WaitFor(-1); }
  // < 0 waits without limit, 0 polls once, > 0 waits at most that long.
  StatusCode WaitFor(int timeoutMs = -1) {
    if (code.load(std::memory_order_acquire) != StatusCode::IN_PROGRESS) return code.load();
    Progress();
    if (timeoutMs == 0) return code.load(std::memory_order_acquire);
    std::unique_lock<std::mutex> lk(mu);
    auto running = [&] { return code.load(std::memory_order_acquire) == StatusCode::IN_PROGRESS; };
    if (timeoutMs < 0)
      cv.wait(lk, [&] { return !running(); });
    else
      cv.wait_for(lk, std::chrono::milliseconds(timeoutMs), [&] { return !running(); });
    return code.load(std::memory_order_acquire);
  }
  void SetWaitCallback(std::function<void()> cb) { waitCallback = std::move(cb); }
  void SetProgressCallback(std::function<void()> cb) { progressCallback = std::move(cb); }

 private:
  void Progress() {
    if (code.load(std::memory_order_acquire) == StatusCode::IN_PROGRESS && progressCallback)
      progressCallback();
  }
  std::atomic<StatusCode> code{StatusCode::INIT};
  std::mutex mu;
  std::string msg;
  std::function<void()> waitCallback;
  std::function<void()> progressCallback;
  std::condition_variable cv;
};

using SizeVec = std::vector<size_t>;
using MemDescVec = std::vector<MemoryDesc>;
using BatchSizeVec = std::vector<SizeVec>;
using TransferUniqueIdVec = std::vector<TransferUniqueId>;
using TransferStatusPtrVec = std::vector<TransferStatus *>;

struct BackendConfig {
  BackendConfig(BackendType t) : type(t) {}
  BackendType Type() const { return type; }

 private:
  BackendType type;
};

struct RdmaBackendConfig : public BackendConfig {
  RdmaBackendConfig() : BackendConfig(BackendType::RDMA) {}
  RdmaBackendConfig(int qp, int postBatch, int workers, PollCqMode mode, bool notif)
      : BackendConfig(BackendType::RDMA),
        qpPerTransfer(qp),
        postBatchSize(postBatch),
        numWorkerThreads(workers),
        pollCqMode(mode),
        enableNotification(notif) {}
  int qpPerTransfer{1};
  int postBatchSize{-1};
  int numWorkerThreads{1};
  PollCqMode pollCqMode{PollCqMode::POLLING};
  bool enableNotification{true};
  uint32_t notifPerQp{1024};
  bool enableTransferChunking{false};
  size_t chunkBytes{65536};
  int maxChunksPerTransfer{64};
  int numNicsPerTransfer{1};
  int maxSendWr{0};
  int maxCqeNum{0};
  int maxMsgSge{0};
};

struct IOEngineConfig {
  std::string host;
  uint16_t port;
};

class Backend;

class IOEngine {
 public:
  IOEngine(EngineKey, IOEngineConfig);
  ~IOEngine();

  void CreateBackend(BackendType, const BackendConfig &);
  EngineDesc GetEngineDesc() const { return desc; }
  void RegisterRemoteEngine(const EngineDesc &);
  void DeregisterRemoteEngine(const EngineDesc &);
  MemoryDesc RegisterMemory(void *data, size_t size, int device, MemoryLocationType loc);
  void DeregisterMemory(const MemoryDesc &desc);
  TransferUniqueId AllocateTransferUniqueId();
  void BatchRead(const MemDescVec &localDest, const BatchSizeVec &localOffsets,
                 const MemDescVec &remoteSrc, const BatchSizeVec &remoteOffsets,
                 const BatchSizeVec &sizes, TransferStatusPtrVec &status, TransferUniqueIdVec &ids);
  void BatchWrite(const MemDescVec &localSrc, const BatchSizeVec &localOffsets,
                  const MemDescVec &remoteDest, const BatchSizeVec &remoteOffsets,
                  const BatchSizeVec &sizes, TransferStatusPtrVec &status,
                  TransferUniqueIdVec &ids);
  StatusCode WaitAll(const std::vector<TransferStatus *> &statuses, int timeoutMs = -1);

 public:
  IOEngineConfig config;
  EngineDesc desc;

 private:
  std::atomic<uint32_t> nextTransferUid{0};
  std::atomic<uint32_t> nextMemUid{0};
  std::unordered_map<MemoryUniqueId, MemoryDesc> memPool;
};

}  // namespace io
}  // namespace mori
