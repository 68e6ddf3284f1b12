// nixl_plugin.cc: the kvhost ABI (abi/kvplugin.h) over NIXL's public C++ API
// (nixl.h). A thin shim: every kvhost call maps to one or a few nixlAgent
// calls; the shim adds what the ABI promises and NIXL leaves to its caller:
// validated 64-bit handles instead of pointers, per-descriptor range and
// pairing checks with precise messages, the notification record format, and
// exception-free error objects.
//
// Object model (all owned by the plugin, named across the ABI by handles from
// the common handle tables in kvp_util):
//   Agent    one nixlAgent with one backend (UCX by default)
//   Region   one registerMem call of one descriptor (so deregistering one
//            handle is one deregisterMem of exactly what was registered)
//   Peer     a loaded remote agent (loadRemoteMD), shared by the remote
//            regions, remote dlists and transfers that refer to it;
//            remove_remote marks it dead, which makes them dead handles
//            (errors until released), and invalidates it in NIXL
//   RRegion  an address range inside a peer's advertised memory
//   Dlist    a prepXferDlist handle plus the descriptor shapes (len, count)
//            the shim needs for index and pairing checks
//   Xfer     a nixlXferReqH; the Xfer structs are recycled per agent (see
//            alloc_xfer), so making and releasing a transfer does not
//            new/delete the shim's own object
//
// ABI 1.1: submit_xfer is make_prepped_xfer/make_batch_xfer plus post_xfer
// in one call (makeXferReq or createXferReq, then postXferReq), and
// poll_xfer with KVP_POLL_RELEASE is getXferStatus plus, once the transfer
// ended, getXferTelemetry and releaseXferReq. NIXL has no completion
// descriptor, so get_event_fd starts a shim thread per agent (see
// "Event descriptor") that polls the agent's transfers in flight and, every
// event_notif_us, NIXL's notifications, and signals an eventfd.
//
// Locking: every call holds a reference on its agent handle for its whole
// duration (so agent_destroy, which removes the agent handle first, waits for
// running calls). Agent::mu guards the agent's bookkeeping (region table,
// peers, handle sets); it is never held while waiting for a handle reference,
// and hot paths (post_xfer, poll_xfer) never take it. NIXL's own lock (sync
// mode RW or STRICT) serialises what happens inside NIXL.

#include <nixl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cctype>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

extern "C" {
#include "kvp_util.h"
}

// KVP_NIXL_HAVE_STRIDE is set by the Makefile after a compile test: 1 when
// nixl.h has the strided list API (nixl_stride_dlist_t and a prepXferDlist
// overload taking it, NIXL PR #1978), else 0 and KVP_CAP_STRIDED is off.
#ifndef KVP_NIXL_HAVE_STRIDE
#define KVP_NIXL_HAVE_STRIDE 0
#endif

#ifndef KVP_NIXL_VERSION
#define KVP_NIXL_VERSION "0.1.0"
#endif

namespace {

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

// NIXL status name for messages ("NIXL_ERR_NOT_FOUND").
std::string status_name(nixl_status_t s) {
  try {
    return nixlEnumStrings::statusStr(s);
  } catch (...) {
    return "NIXL status " + std::to_string(static_cast<int>(s));
  }
}

// An error for a failed NIXL call: the status passes through unchanged as
// the code (kvp_status values are nixl_status_t values).
kvp_error *nixl_err(nixl_status_t s, const char *what, const char *fmt, ...) KVP_PRINTF(3, 4);
kvp_error *nixl_err(nixl_status_t s, const char *what, const char *fmt, ...) {
  char extra[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(extra, sizeof extra, fmt, ap);
  va_end(ap);
  kvp_status code = s < 0 ? static_cast<kvp_status>(s) : KVP_ERR_UNKNOWN;
  return kvp_err(code, "%s: %s (%d)%s%s (NIXL's log on stderr has details; NIXL_LOG_LEVEL=DEBUG for more)",
                 what, status_name(s).c_str(), static_cast<int>(s), extra[0] ? ": " : "", extra);
}

// Runs an ABI entry point body, turning every C++ exception into an error
// object: nothing may unwind across the C boundary into the Go host.
template <class F>
kvp_error *guarded(const char *fn, F &&body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc &) {
    return kvp_err_oom();
  } catch (const std::exception &e) {
    return kvp_err(KVP_ERR_BACKEND, "%s: exception from NIXL: %s", fn, e.what());
  } catch (...) {
    return kvp_err(KVP_ERR_BACKEND, "%s: unknown exception from NIXL", fn);
  }
}

std::string as_string(const char *p, size_t n) { return n ? std::string(p, n) : std::string(); }

bool mem_kind_ok(kvp_mem_kind k) { return k == KVP_MEM_DRAM || k == KVP_MEM_VRAM; }
nixl_mem_t to_nixl_mem(kvp_mem_kind k) { return k == KVP_MEM_VRAM ? VRAM_SEG : DRAM_SEG; }
const char *kind_name(kvp_mem_kind k) { return k == KVP_MEM_VRAM ? "VRAM" : "DRAM"; }

// ---------------------------------------------------------------------------
// Objects
// ---------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;

struct Agent;

struct Region {
  Agent *agent;
  uint64_t addr, len, dev_id;
  kvp_mem_kind kind;
};

// An element of the agent's sorted region table (kvp_range layout first).
struct RegionEntry {
  uint64_t addr;
  uint64_t len;
  uint64_t dev_id;
  kvp_mem_kind kind;
  kvp_region handle;
};

// A loaded peer. Shared by the objects that refer to it (remote regions,
// remote dlists, transfers), which outlive its removal as dead handles that
// report errors until released, so its name stays readable for them.
struct Peer {
  explicit Peer(std::string n, std::string m) : name(std::move(n)), md(std::move(m)) {}
  const std::string name;  // stable: peer_name of load_remote points into it
  const std::string md;    // the metadata it was loaded with (see load_remote)
  std::atomic<bool> dead{false};  // set by remove_remote
};
using PeerRef = std::shared_ptr<Peer>;

struct RRegion {
  Agent *agent;
  PeerRef peer;
  uint64_t addr, len, dev_id;
  kvp_mem_kind kind;
};

struct Dlist {
  Agent *agent;
  nixlDlistH *h = nullptr;
  bool remote = false;
  PeerRef peer;  // null for local lists
  kvp_mem_kind kind;
  // Shapes of the descriptors as given, for index/pairing checks.
  std::vector<uint64_t> lens;
  std::vector<uint64_t> counts;
  // With native strides NIXL indexes flattened blocks: descriptor i covers
  // flat indices [first[i], first[i] + counts[i]). Empty when every count is
  // 1 (then flat index == descriptor index).
  std::vector<int> first;
};

struct Xfer {
  Agent *agent;
  PeerRef peer;
  uint64_t desc_count;  // descriptors as given (strided ones count once)
  kvp_xfer handle = 0;
  // The agent's list of transfers (guarded by Agent::mu): intrusive, so
  // that making and releasing a transfer allocates no bookkeeping nodes.
  Xfer *prev = nullptr, *next = nullptr;
  // A transfer with no descriptors (make_prepped_xfer with zero indices)
  // moves nothing: posting it only sends its notification (genNotif).
  bool notif_only = false;
  bool has_notif = false;
  nixl_blob_t notif;       // for notif_only transfers
  Clock::time_point start;  // notif_only telemetry: last post
  uint64_t post_us = 0;

  // mu guards everything below. The caller serialises its own calls on one
  // transfer (ABI rule 2), but remove_remote cancels the transfers of its
  // peer from another call; then req is released and the handle stays
  // valid until release_xfer, dead: poll reports dead_status, post
  // KVP_ERR_NOT_FOUND.
  std::mutex mu;
  nixlXferReqH *req = nullptr;
  bool posted = false;
  bool active = false;                // the last post or poll said IN_PROG
  nixl_status_t last = NIXL_SUCCESS;  // outcome of the last post or poll
  bool dead = false;
  kvp_status dead_status = KVP_SUCCESS;  // what poll reports once dead

  // Back to the state of a new Xfer for reuse (alloc_xfer); keeps the
  // notification string's storage.
  void reset() noexcept {
    agent = nullptr;
    peer.reset();
    desc_count = 0;
    handle = 0;
    prev = next = nullptr;
    notif_only = has_notif = false;
    notif.clear();
    start = Clock::time_point();
    post_us = 0;
    req = nullptr;
    posted = active = dead = false;
    last = NIXL_SUCCESS;
    dead_status = KVP_SUCCESS;
  }
};

// Released transfers an agent keeps for reuse (alloc_xfer).
constexpr unsigned kXferCache = 32;

struct Agent {
  std::string name;
  std::unique_ptr<nixlAgent> nixl;
  nixlBackendH *backend = nullptr;
  uint64_t caps = 0;
  kvp_notif_queue *notifs = nullptr;
  // How long release_xfer, remove_remote and agent_destroy wait for an
  // active transfer to finish (NIXL cannot cancel one; see quiesce).
  std::chrono::milliseconds release_wait{0};
  // Whether register_mem prefaults DRAM for the kernel (kvp_prefault_for_kernel).
  bool prefault = true;

  // Serialises get_notifs' move from NIXL into notifs, so that two callers
  // cannot reorder one sender's notifications between them.
  std::mutex notif_mu;

  // Serialises load_remote and remove_remote, so that a check of the
  // loaded peers, NIXL's loadRemoteMD and the peer record happen as one.
  // Taken before mu.
  std::mutex load_mu;

  // Released Xfer structs kept for reuse (linked by next), under xfree_mu.
  std::mutex xfree_mu;
  Xfer *xfree = nullptr;
  unsigned nxfree = 0;

  // The event descriptor (KVP_CAP_EVENT_FD; see "Event descriptor"):
  // ev_fd is -1 until get_event_fd makes it and starts ev_thread. ev_mu
  // guards ev_watch (handles of transfers posted IN_PROG, for the thread
  // to poll) and ev_stop.
  std::atomic<int> ev_fd{-1};
  std::chrono::microseconds ev_notif_interval{0};  // shortest notification check interval
  std::chrono::microseconds ev_notif_max{0};       // longest
  std::mutex ev_mu;
  std::condition_variable ev_cv;
  std::vector<kvp_xfer> ev_watch;
  bool ev_stop = false;
  std::thread ev_thread;

  std::mutex mu;  // guards everything below
  std::vector<RegionEntry> regions;  // sorted by addr, non-overlapping
  std::map<std::string, PeerRef> peers;
  std::unordered_set<kvp_rregion> rregions;
  std::unordered_set<kvp_dlist> dlists;
  Xfer *xfers = nullptr;  // head of the list of this agent's transfers

  void link(Xfer *x) {
    x->prev = nullptr;
    x->next = xfers;
    if (xfers) xfers->prev = x;
    xfers = x;
  }
  void unlink(Xfer *x) {
    if (x->prev) x->prev->next = x->next;
    else if (xfers == x) xfers = x->next;
    if (x->next) x->next->prev = x->prev;
    x->prev = x->next = nullptr;
  }

  ~Agent() {
    if (notifs) kvp_nq_destroy(notifs);
    while (xfree) {
      Xfer *x = xfree;
      xfree = x->next;
      delete x;
    }
  }
};

// A new or recycled Xfer of agent a.
Xfer *alloc_xfer(Agent &a) {
  {
    std::lock_guard<std::mutex> lk(a.xfree_mu);
    if (Xfer *x = a.xfree) {
      a.xfree = x->next;
      a.nxfree--;
      x->next = nullptr;
      x->agent = &a;
      return x;
    }
  }
  Xfer *x = new Xfer();
  x->agent = &a;
  return x;
}

// Takes back an Xfer whose handle is gone and whose request was released.
void recycle_xfer(Agent &a, Xfer *x) noexcept {
  x->reset();
  {
    std::lock_guard<std::mutex> lk(a.xfree_mu);
    if (a.nxfree < kXferCache) {
      x->next = a.xfree;
      a.xfree = x;
      a.nxfree++;
      return;
    }
  }
  delete x;
}

// unique_ptr deleter for an Xfer not published yet: recycles it.
struct XferRecycle {
  Agent *a;
  void operator()(Xfer *x) const noexcept { recycle_xfer(*a, x); }
};
using XferPtr = std::unique_ptr<Xfer, XferRecycle>;
XferPtr new_xfer(Agent &a) { return XferPtr(alloc_xfer(a), XferRecycle{&a}); }

// ---------------------------------------------------------------------------
// Event descriptor (KVP_CAP_EVENT_FD)
// ---------------------------------------------------------------------------
//
// NIXL has no completion descriptor and calls nothing back, so the shim
// stands in with one thread per agent, started by the first get_event_fd:
// it polls (getXferStatus) the agent's transfers that post_xfer or
// submit_xfer left in progress, from every 2 us backing off to every
// 100 us while any is in flight, and checks NIXL's notifications
// (getNotifs, moved into the agent's queue) every event_notif_us; it adds
// to the eventfd when a watched transfer ended (done, failed, or removed
// with its peer) or a notification arrived. With nothing in flight it
// sleeps between notification checks. Its polls also drive NIXL's progress,
// so transfers complete without the host polling even with
// progress_thread=false.

void ev_signal(Agent &a) {
  int fd = a.ev_fd.load(std::memory_order_acquire);
  if (fd < 0) return;
  uint64_t one = 1;
  ssize_t wr = write(fd, &one, sizeof one);
  (void)wr;  // EAGAIN: the counter is saturated, still readable
}

// Has the event thread watch a transfer that post_xfer left in progress.
void ev_watch(Agent &a, kvp_xfer h) {
  {
    std::lock_guard<std::mutex> lk(a.ev_mu);
    a.ev_watch.push_back(h);
  }
  a.ev_cv.notify_one();
}

kvp_error *pull_notifs(Agent &a, const char *fn, size_t *n);

// One check of a watched transfer: true when it is no longer to be
// watched; *ended when it ended (the descriptor is to be signalled).
bool ev_check(Agent &a, kvp_xfer h, bool *ended);

void ev_main(Agent *a) {
  using namespace std::chrono;
  std::vector<kvp_xfer> watch, keep;
  const bool notif = (a->caps & KVP_CAP_NOTIF) != 0;
  Clock::time_point notif_due = Clock::now();
  microseconds pause(2);
  microseconds notif_every = a->ev_notif_interval;  // doubles while checks find nothing
  std::unique_lock<std::mutex> lk(a->ev_mu);
  for (;;) {
    auto wake = [a] { return a->ev_stop || !a->ev_watch.empty(); };
    if (watch.empty()) {
      if (notif)
        a->ev_cv.wait_until(lk, notif_due, wake);
      else
        a->ev_cv.wait(lk, wake);
    } else {
      a->ev_cv.wait_for(lk, pause, [a] { return a->ev_stop; });
    }
    if (a->ev_stop) return;
    if (!a->ev_watch.empty()) {
      watch.insert(watch.end(), a->ev_watch.begin(), a->ev_watch.end());
      a->ev_watch.clear();
      pause = microseconds(2);
      notif_every = a->ev_notif_interval;  // activity: a notification may follow
    } else {
      pause = std::min(pause * 2, microseconds(100));
    }
    lk.unlock();
    bool signal = false;
    keep.clear();
    for (kvp_xfer h : watch) {
      bool ended = false;
      bool drop = true;
      try {
        drop = ev_check(*a, h, &ended);
      } catch (...) {  // NIXL threw: stop watching it; the host's poll reports it
        ended = true;
      }
      signal = signal || ended;
      if (!drop) keep.push_back(h);
    }
    watch.swap(keep);
    if (notif && Clock::now() >= notif_due) {
      size_t n = 0;
      try {
        std::lock_guard<std::mutex> nl(a->notif_mu);
        kvp_err_free(pull_notifs(*a, "event thread", &n));
      } catch (...) {  // the host's get_notifs reports NIXL's failure
      }
      signal = signal || n > 0;
      notif_every = n > 0 || !watch.empty() ? a->ev_notif_interval : std::min(notif_every * 2, a->ev_notif_max);
      notif_due = Clock::now() + notif_every;
    }
    if (signal) ev_signal(*a);
    lk.lock();
  }
}

// Stops the event thread (agent_destroy); the descriptor is closed after.
void ev_stop(Agent &a) {
  {
    std::lock_guard<std::mutex> lk(a.ev_mu);
    a.ev_stop = true;
  }
  a.ev_cv.notify_all();
  if (a.ev_thread.joinable()) a.ev_thread.join();
  int fd = a.ev_fd.exchange(-1);
  if (fd >= 0) close(fd);
}

// The handle tables, one per kind (distinct tags keep handles of one kind
// from being accepted as another). Created once, never destroyed: a plugin
// library stays loaded for the life of the process.
struct Tables {
  kvp_htable *agents, *regions, *rregions, *dlists, *xfers;
};

Tables *tables() {
  static Tables *t = [] {
    auto *tt = new Tables{kvp_ht_create(1), kvp_ht_create(2), kvp_ht_create(3), kvp_ht_create(4),
                          kvp_ht_create(5)};
    return tt;
  }();
  return t;
}

// A reference on a live handle, released at scope exit.
template <class T>
class Ref {
 public:
  Ref(kvp_htable *t, uint64_t h) : t_(t), h_(h), obj_(static_cast<T *>(kvp_ht_acquire(t, h))) {}
  ~Ref() {
    if (obj_) kvp_ht_put(t_, h_);
  }
  Ref(const Ref &) = delete;
  Ref &operator=(const Ref &) = delete;
  Ref(Ref &&o) noexcept : t_(o.t_), h_(o.h_), obj_(o.obj_) { o.obj_ = nullptr; }
  T *operator->() const { return obj_; }
  T &operator*() const { return *obj_; }
  T *get() const { return obj_; }
  explicit operator bool() const { return obj_ != nullptr; }

 private:
  kvp_htable *t_;
  uint64_t h_;
  T *obj_;
};

kvp_error *bad_handle(const char *fn, const char *kind, uint64_t h) {
  return kvp_err(KVP_ERR_INVALID_PARAM, "%s: unknown, released or foreign %s handle %#llx", fn,
                 kind, static_cast<unsigned long long>(h));
}

// Looks up the agent of a call; the reference lives as long as the call.
#define WITH_AGENT(ref, fn)                                            \
  Ref<Agent> ref(tables()->agents, args->agent);                       \
  if (!ref) return bad_handle(fn, "agent", args->agent)

// ---------------------------------------------------------------------------
// Parameters
// ---------------------------------------------------------------------------

// The agent parameters the shim itself reads; every other key is passed to
// the NIXL backend as a string parameter.
const char *const kOwnKeys[] = {"backend", "progress_thread", "progress_delay_us", "sync_mode", "release_wait_ms",
                                "telemetry", "tcp_put_emulation", "event_notif_us",
                                "event_notif_max_us", "prefault"};

const char kParamsDoc[] =
    "backend=UCX\tNIXL backend plugin to create (an unknown name is an error listing the "
    "plugins NIXL found)\n"
    "progress_thread=true\tNIXL's progress thread: it completes connection set-up and receives "
    "notifications while the host is not calling poll_xfer or get_notifs on this agent (without "
    "it a peer that waits idle stalls the first transfer); set false only when the host keeps "
    "polling every agent\n"
    "progress_delay_us=1000\tlongest sleep of the progress thread between wake-ups, "
    "microseconds (it also wakes on backend events); 0 makes it spin, which starves the "
    "transfers on few cores\n"
    "sync_mode=rw\tNIXL thread sync mode: rw or strict (none is refused: the host calls "
    "concurrently)\n"
    "telemetry=true\tcapture per-transfer telemetry (xfer_telemetry)\n"
    "event_notif_us=100\tonce the host asked for the event descriptor (get_event_fd), the "
    "shortest interval at which the shim's event thread checks NIXL for notifications, "
    "microseconds (1..1000000): right after a notification, a post or a transfer's end\n"
    "event_notif_max_us=2000\tthe longest such interval (event_notif_us..1000000): each check "
    "that finds nothing doubles the interval up to this, so an idle agent costs one getNotifs "
    "call per event_notif_max_us and a notification after a quiet spell wakes the host at most "
    "this much after NIXL received it; transfers in flight are checked from every 2 us, backing "
    "off to 100 us\n"
    "release_wait_ms=30000\thow long release_xfer, remove_remote and agent_destroy wait for an "
    "active transfer to finish: NIXL cannot cancel an in-flight UCX transfer, so they wait "
    "rather than return while it still touches memory\n"
    "tcp_put_emulation=auto\tUCX only: whether the shim adds TCP_PUT_ENABLE=n to engine_config, "
    "so that PUTs over UCX's TCP transport go as active messages instead of TCP PUT zcopy, whose "
    "receive path crashes the target in UCX 1.22 (uct_tcp_ep_progress_put_rx); auto: when the "
    "transports (UCX_TLS, else engine_config TLS=, else UCX's default) include tcp; true: always; "
    "false: never. UCX_TCP_PUT_ENABLE in the environment or TCP_PUT_ENABLE in engine_config wins\n"
    "prefault=true\tbefore registering DRAM, read one byte of every page of it through the "
    "kernel (process_vm_writev from the region into a scratch buffer), so that the kernel's own "
    "first access to each page (UCX's cma copies out of or into this process's memory with "
    "process_vm_writev/readv) happens at registration and not inside the first transfers; on a "
    "VM that shadows page tables that first access cost about 4.6 us per 4 KiB page (about 1.3 s per "
    "GiB). Only reads: the memory's bytes are unchanged; pages never touched get mapped. false "
    "registers without it\n"
    "num_threads=0\tUCX backend worker threads, passed to the backend: a transfer of at least "
    "split_batch_size (1024) descriptors is split over them, each with its own UCX worker. 0 is "
    "NIXL's default; kvhost passes 4 to the agents that post the bulk transfers (SGLang prefill, "
    "vLLM decode) unless given. Each thread takes UCX resources (UARs on Mellanox NICs)\n"
    "*=\tany other key is passed to the backend unchanged (UCX: device_list, num_workers, "
    "num_threads, ucx_error_handling_mode, engine_config, ...); for UCX the shim adds "
    "USE_MT_MUTEX=y to engine_config (a mutex, not a spinlock, guards the UCX worker its "
    "threads share) unless engine_config sets USE_MT_MUTEX, and CMA_TX_QUOTA=16 (UCX's cma "
    "transport copies up to 16 descriptors per progress call instead of 1) unless "
    "engine_config or the environment sets it\n";

// Defaults of the shim's own parameters.
constexpr int kDefaultProgressThread = 1;
constexpr uint64_t kDefaultProgressDelayUs = 1000;
constexpr uint64_t kDefaultReleaseWaitMs = 30000;
constexpr uint64_t kDefaultEventNotifUs = 100;
constexpr uint64_t kDefaultEventNotifMaxUs = 2000;

// Upper-cases ASCII, for UCX setting names and values.
std::string upper_ascii(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return s;
}

// Finds key in engine_config, UCX settings "KEY=value" separated by commas as
// NIXL's src/plugins/ucx/ucx_utils.cpp (nixlUcxContext) splits them, each
// passed to ucp_config_modify without the UCX_ prefix. Names compare without
// case; the last setting of a key counts, as it does in NIXL.
bool engine_config_find(const std::string &ec, const char *key, std::string *value) {
  const std::string want = upper_ascii(key);
  bool found = false;
  size_t pos = 0;
  while (pos <= ec.size()) {
    size_t end = ec.find(',', pos);
    if (end == std::string::npos) end = ec.size();
    std::string elem = ec.substr(pos, end - pos);
    size_t eq = elem.find('=');
    if (eq != std::string::npos && upper_ascii(elem.substr(0, eq)) == want) {
      found = true;
      *value = elem.substr(eq + 1);
    }
    pos = end + 1;
  }
  return found;
}

// UCX guards a worker shared by threads with a spinlock unless told to use
// a mutex (UCX_USE_MT_MUTEX). NIXL's worker is shared by the progress thread
// and every host thread that posts or polls (the runtimes post from many
// goroutines at once, one ucp_get/put_nbx per descriptor, each taking the
// lock), and a spinning waiter burns the CPU its lock holder needs whenever
// threads outnumber cores: measured on 2 cores, the vLLM-style demo spent
// 36% of its CPU in pthread_spin_lock and moved 0.27 GB/s; with the mutex,
// 0.90 GB/s. So the shim asks UCX for the mutex through NIXL's engine_config
// (UCX config "KEY=value" pairs, comma separated) unless the caller's
// engine_config says otherwise; UCX_USE_MT_MUTEX in the environment wins
// over both (NIXL applies engine_config only where no UCX_ variable is set).
// Returns whether it added it.
bool ucx_prefer_mutex(nixl_b_params_t &bparams) {
  std::string &ec = bparams["engine_config"];
  std::string upper(ec);
  std::transform(upper.begin(), upper.end(), upper.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  if (upper.find("USE_MT_MUTEX") != std::string::npos) return false;
  ec += ec.empty() ? "USE_MT_MUTEX=y" : ",USE_MT_MUTEX=y";
  return true;
}

// UCX's cma transport (process_vm_writev/readv, which carries DRAM to DRAM
// within a host) queues each descriptor and copies it when the worker is
// progressed, CMA_TX_QUOTA (UCX's default: 1) descriptors per progress
// call; every call also polls the worker's other transports. A KV request
// of scattered 16-token pages is thousands of 32 KiB descriptors, so with 1
// the progress overhead came to as much as the copies: measured on 2 cores
// (kvhost bench --blocks 32K --batches 4096 --scatter, paired ratio to
// memcpy, median of 8 rows over two repetitions, UCX_CMA_TX_QUOTA in the
// environment) 0.20 with 1 and 0.32-0.33 with 16, 256 or 4096, READ and
// WRITE alike. The shim adds CMA_TX_QUOTA=16 (up to 16 descriptors, at most
// 8 MiB with UCX's 512 KiB segments, per progress call) to engine_config
// unless engine_config or the environment (UCX_CMA_TX_QUOTA or
// UCX_SCOPY_TX_QUOTA, which NIXL leaves in force) sets it. It changes
// nothing where cma carries nothing (RDMA, GPU memory). Returns whether it
// added it.
constexpr const char *kDefaultCmaTxQuota = "16";

bool ucx_cma_tx_quota(nixl_b_params_t &bparams) {
  std::string &ec = bparams["engine_config"];
  std::string v;
  if (std::getenv("UCX_CMA_TX_QUOTA") || std::getenv("UCX_SCOPY_TX_QUOTA")) return false;
  if (engine_config_find(ec, "CMA_TX_QUOTA", &v) || engine_config_find(ec, "SCOPY_TX_QUOTA", &v))
    return false;
  ec += std::string(ec.empty() ? "" : ",") + "CMA_TX_QUOTA=" + kDefaultCmaTxQuota;
  return true;
}

// Whether a UCX transport list (UCX_TLS syntax: names separated by commas,
// "all", a leading '^' for "all but", a ":aux" suffix) lets UCX use its TCP
// transport. Empty means UCX's default, "all". Of UCX's transport aliases only
// "all" includes tcp.
bool ucx_tls_allows_tcp(const std::string &tls) {
  std::string list = upper_ascii(tls);
  list.erase(std::remove_if(list.begin(), list.end(), [](unsigned char c) { return std::isspace(c); }),
             list.end());
  if (list.empty()) return true;
  const bool negate = list[0] == '^';
  if (negate) list.erase(0, 1);
  bool tcp = false, all = false;
  size_t pos = 0;
  while (pos <= list.size()) {
    size_t end = list.find(',', pos);
    if (end == std::string::npos) end = list.size();
    std::string name = list.substr(pos, end - pos);
    name = name.substr(0, name.find(':'));
    tcp = tcp || name == "TCP";
    all = all || name == "ALL";
    pos = end + 1;
  }
  return negate ? !tcp : (tcp || all);
}

// UCX 1.22's TCP transport crashes the process that receives PUT zcopy data:
// uct_tcp_ep_progress_put_rx (UCX's src/uct/tcp/tcp_ep.c) reads the PUT
// header from an endpoint receive buffer that is NULL, from NIXL's progress
// thread or from any thread progressing the worker (measured: the decode,
// target of SGLang-style WRITEs, in 5 of 9 `UCX_TLS=tcp kvhost demo` runs;
// a decode written on NIXL's own Python bindings, 7 of 9). UCX's TCP
// interface setting PUT_ENABLE (src/uct/tcp/tcp_iface.c, "Enable PUT Zcopy
// support", default y) set to n stops the interface from offering PUT
// zcopy, so UCP carries the PUTs that
// would use TCP as active messages (UCX's src/ucp/rma/rma_sw.c) and the
// receive path above never runs. The shim adds TCP_PUT_ENABLE=n to
// engine_config when TCP may carry transfers (tcp_put_emulation=auto: the
// transport list, UCX_TLS in the environment, else TLS in engine_config, else
// UCX's default "all", includes tcp) or always (tcp_put_emulation=true),
// never over the caller's own setting: UCX_TCP_PUT_ENABLE in the environment
// (which NIXL's config::modify leaves in force over engine_config) or
// TCP_PUT_ENABLE in engine_config. The setting changes nothing where another
// transport carries the RMA (cma, shared memory, RDMA): it only removes TCP's
// PUT zcopy. Sets *note to what it decided, for the log (empty: nothing worth
// saying), and returns whether it added the setting.
enum class TcpPutEmulation { kAuto, kOn, kOff };

bool ucx_tcp_put_emulation(nixl_b_params_t &bparams, TcpPutEmulation mode, std::string *note) {
  std::string &ec = bparams["engine_config"];
  std::string v;
  if (const char *env = std::getenv("UCX_TCP_PUT_ENABLE")) {
    *note = std::string("UCX_TCP_PUT_ENABLE=") + env + " in the environment decides TCP PUT zcopy";
    return false;
  }
  if (engine_config_find(ec, "TCP_PUT_ENABLE", &v)) {
    *note = "engine_config sets TCP_PUT_ENABLE=" + v;
    return false;
  }
  if (mode == TcpPutEmulation::kOff) {
    *note = "tcp_put_emulation=false: UCX's TCP PUT zcopy stays on (UCX 1.22 can crash the process "
            "receiving WRITEs over TCP, see plugins/nixl/README.md)";
    return false;
  }
  std::string why;
  if (mode == TcpPutEmulation::kOn) {
    why = "tcp_put_emulation=true";
  } else {
    const char *env_tls = std::getenv("UCX_TLS");
    std::string tls;
    if (env_tls) {
      tls = env_tls;
      why = "UCX_TLS=" + tls;
    } else if (engine_config_find(ec, "TLS", &tls)) {
      why = "engine_config TLS=" + tls;
    } else {
      why = "UCX's default transports";
    }
    if (!ucx_tls_allows_tcp(tls)) {
      note->clear();
      return false;
    }
    why += " may carry transfers over tcp";
  }
  ec += ec.empty() ? "TCP_PUT_ENABLE=n" : ",TCP_PUT_ENABLE=n";
  *note = "added TCP_PUT_ENABLE=n to the UCX backend's engine_config (" + why +
          "): PUTs over UCX's TCP transport go as active messages, since UCX 1.22's TCP PUT zcopy "
          "can crash the receiving process (plugins/nixl/README.md); tcp_put_emulation=false keeps "
          "UCX's default";
  return true;
}

// Prints a line about the shim's own choices on stderr, each distinct line
// once per process (a deployment creates many agents), unless NIXL_LOG_LEVEL
// asks for errors only (ERROR, FATAL), as the tests do.
void shim_log(const std::string &line) {
  static std::mutex mu;
  static std::set<std::string> said;
  if (const char *lvl = std::getenv("NIXL_LOG_LEVEL")) {
    std::string l = upper_ascii(lvl);
    if (l == "ERROR" || l == "FATAL") return;
  }
  std::lock_guard<std::mutex> lk(mu);
  if (!said.insert(line).second) return;
  std::fprintf(stderr, "kvhost nixl plugin: %s\n", line.c_str());
}

// ---------------------------------------------------------------------------
// Capabilities
// ---------------------------------------------------------------------------

constexpr uint64_t kCaps = KVP_CAP_PREPPED | KVP_CAP_BATCH | KVP_CAP_NOTIF | KVP_CAP_TELEMETRY |
                           KVP_CAP_REMOTE_ADDR | KVP_CAP_SUBMIT | KVP_CAP_EVENT_FD
#if KVP_NIXL_HAVE_STRIDE
                           | KVP_CAP_STRIDED
#endif
    ;

// ---------------------------------------------------------------------------
// Helpers on agents
// ---------------------------------------------------------------------------

// Checks a strided descriptor's shape: len, count > 0, count > 1 only with
// native strides, and no 64-bit overflow. Returns nullptr or an error.
kvp_error *check_shape(const char *fn, size_t i, uint64_t addr, uint64_t len, uint64_t stride,
                       uint64_t count) {
  if (len == 0 || count == 0)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: descriptor %zu: len and count must be > 0 (len %llu, count %llu)",
                   fn, i, static_cast<unsigned long long>(len),
                   static_cast<unsigned long long>(count));
#if !KVP_NIXL_HAVE_STRIDE
  if (count > 1)
    return kvp_err(KVP_ERR_NOT_SUPPORTED,
                   "%s: descriptor %zu: count %llu > 1 but this NIXL has no strided list API "
                   "(KVP_CAP_STRIDED is off; the host expands strided descriptors)",
                   fn, i, static_cast<unsigned long long>(count));
#endif
  uint64_t end;
  if (!kvp_strided_end(addr, len, stride, count, &end))
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: descriptor %zu: address range overflows 64 bits",
                   fn, i);
  return nullptr;
}

struct KindCtx {
  kvp_mem_kind kind;
  uint64_t dev_id;
};

int accept_kind(const void *elem, void *ctx) {
  const auto *e = static_cast<const RegionEntry *>(elem);
  const auto *k = static_cast<const KindCtx *>(ctx);
  return e->kind == k->kind && e->dev_id == k->dev_id;
}

// Peer lookup under a.mu.
PeerRef find_peer(Agent &a, const std::string &name) {
  auto it = a.peers.find(name);
  return it == a.peers.end() ? nullptr : it->second;
}

// Waits until a transfer is no longer in progress, polling (which drives
// progress) until deadline. This is how the shim "cancels": NIXL's
// releaseXferReq of an active UCX transfer calls ucp_request_cancel, which
// cancels only tag receives, so an RMA transfer keeps reading and writing
// its memory after the release returns (and over TCP a released in-flight
// PUT crashed the receiving process in UCX 1.22). Returns false when it is
// still active at the deadline.
bool quiesce(Agent &a, nixlXferReqH *req, Clock::time_point deadline) {
  for (int spin = 0;; spin++) {
    if (a.nixl->getXferStatus(req) != NIXL_IN_PROG) return true;
    if (Clock::now() >= deadline) return false;
    if (spin < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// Releases a NIXL request once it is no longer active (see quiesce). On
// KVP_ERR_REPOST_ACTIVE (still active at the deadline) NIXL keeps the
// request and the caller keeps its handle.
kvp_error *release_req(Agent &a, nixlXferReqH *&req, Clock::time_point deadline, const char *fn) {
  if (!quiesce(a, req, deadline))
    return kvp_err(KVP_ERR_REPOST_ACTIVE,
                   "%s: the transfer is still in progress after %lld ms (release_wait_ms); NIXL "
                   "cannot cancel an active transfer, so it was not released: release it again "
                   "later",
                   fn, static_cast<long long>(a.release_wait.count()));
  nixl_status_t s = a.nixl->releaseXferReq(req);
  if (s != NIXL_SUCCESS) return nixl_err(s, fn, "releaseXferReq");
  req = nullptr;
  return nullptr;
}

// Frees a transfer whose handle was removed, at agent_destroy: waits for it
// until deadline, then releases it regardless (the agent's backend is torn
// down next, which stops whatever is left).
void free_xfer(Agent &a, Xfer *x, Clock::time_point deadline) noexcept {
  {
    std::lock_guard<std::mutex> lk(x->mu);
    if (x->req) {
      try {
        quiesce(a, x->req, deadline);
        a.nixl->releaseXferReq(x->req);
      } catch (...) {  // teardown goes on; the backend is torn down next
      }
      x->req = nullptr;
    }
  }
  delete x;
}

// Kills a transfer whose peer is being removed: an active one is cancelled
// (waited for until deadline, see quiesce) and then polls report
// KVP_ERR_CANCELED; one that was not active keeps reporting its outcome
// (or NOT_POSTED). Its request is released; the handle stays valid.
void kill_xfer(Agent &a, kvp_xfer h, Clock::time_point deadline) {
  Ref<Xfer> x(tables()->xfers, h);
  if (!x) return;  // released meanwhile
  std::lock_guard<std::mutex> lk(x->mu);
  if (x->dead) return;
  x->dead = true;
  if (!x->posted)
    x->dead_status = KVP_ERR_NOT_POSTED;
  else if (x->active)
    x->dead_status = KVP_ERR_CANCELED;
  else
    x->dead_status = x->last < 0 ? static_cast<kvp_status>(x->last) : KVP_SUCCESS;
  if (x->req) {
    try {
      quiesce(a, x->req, deadline);
      a.nixl->releaseXferReq(x->req);
    } catch (...) {  // the peer is being forgotten either way
    }
    x->req = nullptr;
  }
}

bool ev_check(Agent &a, kvp_xfer h, bool *ended) {
  *ended = false;
  Ref<Xfer> x(tables()->xfers, h);
  if (!x || x->agent != &a) return true;  // released meanwhile
  std::lock_guard<std::mutex> lk(x->mu);
  if (x->dead) {  // cancelled with its peer
    *ended = true;
    return true;
  }
  if (!x->req || !x->posted) return true;
  if (!x->active) {  // a poll of the host saw it end first
    *ended = true;
    return true;
  }
  nixl_status_t s = a.nixl->getXferStatus(x->req);
  x->active = s == NIXL_IN_PROG;
  x->last = s;
  if (s == NIXL_IN_PROG) return false;
  *ended = true;
  return true;
}

// The errors of dead handles, whose peer was removed.
kvp_error *peer_removed(const char *fn, const char *what, const Peer &p) {
  return kvp_err(KVP_ERR_NOT_FOUND, "%s: %s peer '%s', which was removed (remove_remote)", fn,
                 what, p.name.c_str());
}

kvp_error *dead_poll(const char *fn, const Xfer &x) {
  if (x.dead_status == KVP_ERR_CANCELED)
    return kvp_err(KVP_ERR_CANCELED,
                   "%s: the transfer was cancelled: its peer '%s' was removed (remove_remote)",
                   fn, x.peer->name.c_str());
  if (x.dead_status == KVP_ERR_NOT_POSTED)
    return kvp_err(KVP_ERR_NOT_POSTED, "%s: the transfer was never posted (and its peer '%s' was removed)",
                   fn, x.peer->name.c_str());
  return kvp_err(x.dead_status, "%s: the transfer failed (%s) before its peer '%s' was removed",
                 fn, status_name(static_cast<nixl_status_t>(x.dead_status)).c_str(),
                 x.peer->name.c_str());
}

void free_dlist(Agent &a, Dlist *d) {
  if (d->h) a.nixl->releasedDlistH(d->h);
  delete d;
}

// Frees the given dlists and remote regions (collected under a.mu, removed
// without it: kvp_ht_remove may wait for references held by other calls).
void drop_dependents(Agent &a, const std::vector<kvp_dlist> &dlists,
                     const std::vector<kvp_rregion> &rrs) {
  Tables *t = tables();
  for (kvp_dlist h : dlists) {
    if (auto *d = static_cast<Dlist *>(kvp_ht_remove(t->dlists, h))) free_dlist(a, d);
  }
  for (kvp_rregion h : rrs) {
    delete static_cast<RRegion *>(kvp_ht_remove(t->rregions, h));
  }
}

// ---------------------------------------------------------------------------
// Plugin and agents
// ---------------------------------------------------------------------------

kvp_error *plugin_info(kvp_plugin_info_args *args) {
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_PLUGIN_INFO_ARGS_STRUCT_SIZE)) return e;
  args->name = "nixl";
  args->version = KVP_NIXL_VERSION;
  args->params_doc = kParamsDoc;
  args->abi_major = KVP_ABI_MAJOR;
  args->abi_minor = KVP_ABI_MINOR;
  args->caps = kCaps;
  args->mem_kinds = KVP_MEM_BIT(KVP_MEM_DRAM) | KVP_MEM_BIT(KVP_MEM_VRAM);
  return nullptr;
}

kvp_error *agent_create(kvp_agent_create_args *args) {
  static const char fn[] = "agent_create";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_AGENT_CREATE_ARGS_STRUCT_SIZE)) return e;
  if (!args->name || args->name_len == 0 || args->name_len > KVP_MAX_NAME_LEN)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: agent name must be 1..%d bytes (got %zu)", fn,
                   KVP_MAX_NAME_LEN, args->name_len);
  if (kvp_error *e = kvp_params_check(args->params, args->num_params, kOwnKeys,
                                      sizeof kOwnKeys / sizeof kOwnKeys[0], 1))
    return kvp_err_wrap(e, "%s", fn);

  const kvp_param *p = args->params;
  size_t np = args->num_params;
  std::string backend = "UCX";
  if (const kvp_param *b = kvp_param_find(p, np, "backend")) {
    backend = as_string(b->value, b->value_len);
    if (backend.empty()) return kvp_err(KVP_ERR_INVALID_PARAM, "%s: backend must not be empty", fn);
  }
  int prog = 0, telem = 1;
  uint64_t delay = 0, release_wait = 0;
  if (kvp_error *e = kvp_param_u64(p, np, "release_wait_ms", kDefaultReleaseWaitMs, 0,
                                   24ull * 3600 * 1000, &release_wait))
    return kvp_err_wrap(e, "%s", fn);
  if (kvp_error *e = kvp_param_bool(p, np, "progress_thread", kDefaultProgressThread, &prog))
    return kvp_err_wrap(e, "%s", fn);
  if (kvp_error *e = kvp_param_bool(p, np, "telemetry", 1, &telem)) return kvp_err_wrap(e, "%s", fn);
  int prefault = 1;
  if (kvp_error *e = kvp_param_bool(p, np, "prefault", 1, &prefault)) return kvp_err_wrap(e, "%s", fn);
  uint64_t ev_notif_us = 0, ev_notif_max_us = 0;
  if (kvp_error *e = kvp_param_u64(p, np, "event_notif_us", kDefaultEventNotifUs, 1, 1000000, &ev_notif_us))
    return kvp_err_wrap(e, "%s", fn);
  if (kvp_error *e = kvp_param_u64(p, np, "event_notif_max_us", std::max(kDefaultEventNotifMaxUs, ev_notif_us),
                                   ev_notif_us, 1000000, &ev_notif_max_us))
    return kvp_err_wrap(e, "%s", fn);
  if (kvp_error *e = kvp_param_u64(p, np, "progress_delay_us", kDefaultProgressDelayUs, 0,
                                   10000000, &delay))
    return kvp_err_wrap(e, "%s", fn);
  nixl_thread_sync_t sync = nixl_thread_sync_t::NIXL_THREAD_SYNC_RW;
  if (const kvp_param *s = kvp_param_find(p, np, "sync_mode")) {
    if (kvp_str_eq(s->value, s->value_len, "rw") || kvp_str_eq(s->value, s->value_len, "RW"))
      sync = nixl_thread_sync_t::NIXL_THREAD_SYNC_RW;
    else if (kvp_str_eq(s->value, s->value_len, "strict") ||
             kvp_str_eq(s->value, s->value_len, "STRICT"))
      sync = nixl_thread_sync_t::NIXL_THREAD_SYNC_STRICT;
    else
      return kvp_err(KVP_ERR_INVALID_PARAM,
                     "%s: sync_mode %.*s: want rw or strict (none is unsafe: the host calls an "
                     "agent from several threads)",
                     fn, static_cast<int>(s->value_len), s->value ? s->value : "");
  }
  TcpPutEmulation tcp_put = TcpPutEmulation::kAuto;
  if (const kvp_param *tp = kvp_param_find(p, np, "tcp_put_emulation");
      tp && !kvp_str_eq(tp->value, tp->value_len, "auto")) {
    int on = 0;
    if (kvp_error *e = kvp_param_bool(p, np, "tcp_put_emulation", 0, &on)) {
      kvp_err_free(e);
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: tcp_put_emulation %.*s: want auto, true or false", fn,
                     static_cast<int>(tp->value_len), tp->value ? tp->value : "");
    }
    tcp_put = on ? TcpPutEmulation::kOn : TcpPutEmulation::kOff;
  }
  nixl_b_params_t bparams;
  for (size_t i = 0; i < np; i++) {
    bool own = false;
    for (const char *k : kOwnKeys) own = own || kvp_str_eq(p[i].key, p[i].key_len, k);
    if (!own) bparams[as_string(p[i].key, p[i].key_len)] = as_string(p[i].value, p[i].value_len);
  }

  std::string keys;  // the backend parameters as given, for messages
  for (const auto &kv : bparams) keys += (keys.empty() ? "" : ", ") + kv.first;
  const bool mutex_added = backend == "UCX" && ucx_prefer_mutex(bparams);
  const bool quota_added = backend == "UCX" && ucx_cma_tx_quota(bparams);
  std::string tcp_put_note;
  const bool tcp_put_added =
      backend == "UCX" && ucx_tcp_put_emulation(bparams, tcp_put, &tcp_put_note);
  if (!tcp_put_note.empty()) shim_log(tcp_put_note);

  auto a = std::make_unique<Agent>();
  a->name = as_string(args->name, args->name_len);
  a->release_wait = std::chrono::milliseconds(release_wait);
  a->prefault = prefault != 0;
  a->ev_notif_interval = std::chrono::microseconds(ev_notif_us);
  a->ev_notif_max = std::chrono::microseconds(ev_notif_max_us);
  a->notifs = kvp_nq_create(0);
  if (!a->notifs) return kvp_err_oom();
  nixlAgentConfig cfg(prog != 0, false, default_comm_port, sync, 1, delay,
                      nixlAgentConfig::kDefaultLthrDelayUs, telem != 0);
  a->nixl = std::make_unique<nixlAgent>(a->name, cfg);

  std::vector<nixl_backend_t> avail;
  nixl_status_t s = a->nixl->getAvailPlugins(avail);
  if (s != NIXL_SUCCESS) return nixl_err(s, fn, "getAvailPlugins");
  if (std::find(avail.begin(), avail.end(), backend) == avail.end()) {
    std::string list;
    for (const auto &b : avail) list += (list.empty() ? "" : ", ") + b;
    return kvp_err(KVP_ERR_NOT_FOUND,
                   "%s: NIXL has no backend plugin %s; available: %s (NIXL looks in "
                   "$NIXL_PLUGIN_DIR, else the plugins folder beside libnixl.so)",
                   fn, backend.c_str(), list.empty() ? "none" : list.c_str());
  }
  s = a->nixl->createBackend(backend, bparams, a->backend);
  if (s != NIXL_SUCCESS) {
    std::string added;
    if (mutex_added) added += "USE_MT_MUTEX=y";
    if (quota_added)
      added += std::string(added.empty() ? "" : ", ") + "CMA_TX_QUOTA=" + kDefaultCmaTxQuota;
    if (tcp_put_added) added += std::string(added.empty() ? "" : ", ") + "TCP_PUT_ENABLE=n";
    return nixl_err(s, fn, "createBackend(%s) with backend params {%s}%s%s%s", backend.c_str(),
                    keys.c_str(), added.empty() ? "" : " (and ", added.c_str(),
                    added.empty() ? "" : " in engine_config)");
  }
  a->caps = kCaps & ~(telem ? 0 : KVP_CAP_TELEMETRY);

  Agent *raw = a.get();
  kvp_agent h = 0;
  if (kvp_error *e = kvp_ht_insert(tables()->agents, raw, &h)) return e;
  a.release();
  args->agent = h;
  args->caps = raw->caps;
  return nullptr;
}

kvp_error *agent_destroy(kvp_agent_destroy_args *args) {
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_AGENT_DESTROY_ARGS_STRUCT_SIZE)) return e;
  Tables *t = tables();
  // Removing the handle first waits for every call still running on it.
  auto *a = static_cast<Agent *>(kvp_ht_remove(t->agents, args->agent));
  if (!a) return bad_handle("agent_destroy", "agent", args->agent);
  std::unique_ptr<Agent> owner(a);
  ev_stop(*a);  // before the transfers go: the event thread polls them
  std::vector<kvp_xfer> xs;
  std::vector<kvp_dlist> ds;
  std::vector<kvp_rregion> rs;
  std::vector<RegionEntry> regs;
  {
    std::lock_guard<std::mutex> lk(a->mu);
    for (Xfer *x = a->xfers; x; x = x->next) xs.push_back(x->handle);
    ds.assign(a->dlists.begin(), a->dlists.end());
    rs.assign(a->rregions.begin(), a->rregions.end());
    regs = a->regions;
    a->xfers = nullptr;
    a->dlists.clear();
    a->rregions.clear();
    a->regions.clear();
  }
  Clock::time_point deadline = Clock::now() + a->release_wait;
  for (kvp_xfer h : xs) {
    if (auto *x = static_cast<Xfer *>(kvp_ht_remove(t->xfers, h))) free_xfer(*a, x, deadline);
  }
  drop_dependents(*a, ds, rs);
  // Teardown goes on past a failing NIXL call: every handle must be freed.
  std::string failed;
  auto attempt = [&](const char *what, auto &&call) {
    try {
      if (call() != NIXL_SUCCESS) failed += std::string(failed.empty() ? "" : ", ") + what;
    } catch (const std::exception &ex) {
      failed += std::string(failed.empty() ? "" : ", ") + what + " threw " + ex.what();
    }
  };
  for (const RegionEntry &r : regs) {
    if (auto *reg = static_cast<Region *>(kvp_ht_remove(t->regions, r.handle))) {
      nixl_reg_dlist_t dl(to_nixl_mem(reg->kind));
      dl.addDesc(nixlBlobDesc(reg->addr, reg->len, reg->dev_id, ""));
      attempt("deregisterMem", [&] { return a->nixl->deregisterMem(dl); });
      delete reg;
    }
  }
  for (auto &kv : a->peers)
    attempt("invalidateRemoteMD", [&] {
      nixl_status_t s = a->nixl->invalidateRemoteMD(kv.first);
      return s == NIXL_ERR_NOT_FOUND ? NIXL_SUCCESS : s;
    });
  a->peers.clear();
  a->nixl.reset();  // the nixlAgent destructor tears down the backend
  if (!failed.empty())
    return kvp_err(KVP_ERR_BACKEND, "agent_destroy: the agent is gone, but NIXL failed: %s",
                   failed.c_str());
  return nullptr;
}

// ---------------------------------------------------------------------------
// Memory registration
// ---------------------------------------------------------------------------

kvp_error *register_mem(kvp_register_mem_args *args) {
  static const char fn[] = "register_mem";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_REGISTER_MEM_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  if (args->num_descs == 0) return nullptr;
  if (!args->descs || !args->regions)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: descs and regions must not be NULL", fn);

  std::vector<RegionEntry> add(args->num_descs);
  for (size_t i = 0; i < args->num_descs; i++) {
    const kvp_mem_desc &d = args->descs[i];
    if (d.len == 0 || d.addr + d.len < d.addr)
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: desc %zu: len must be > 0 and addr + len must not overflow", fn, i);
    if (!mem_kind_ok(d.mem_kind))
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: desc %zu: unknown memory kind %u", fn, i, d.mem_kind);
    if (d.reserved != 0)
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: desc %zu: reserved must be 0", fn, i);
    add[i] = RegionEntry{d.addr, d.len, d.dev_id, d.mem_kind, 0};
  }
  // Outside a->mu: on a VM this pass takes about a second per GiB.
  if (a->prefault)
    for (const RegionEntry &r : add)
      if (r.kind == KVP_MEM_DRAM) kvp_prefault_for_kernel(r.addr, r.len);

  std::lock_guard<std::mutex> lk(a->mu);
  // Overlap check: among the new descriptors and against live registrations.
  std::vector<RegionEntry> all = a->regions;
  all.insert(all.end(), add.begin(), add.end());
  kvp_ranges_sort(all.data(), all.size(), sizeof(RegionEntry));
  long bad = kvp_ranges_check(all.data(), all.size(), sizeof(RegionEntry));
  if (bad >= 0)
    return kvp_err(KVP_ERR_INVALID_PARAM,
                   "%s: region [%#llx, +%llu) overlaps another registration of this agent", fn,
                   static_cast<unsigned long long>(all[bad].addr),
                   static_cast<unsigned long long>(all[bad].len));

  Tables *t = tables();
  size_t done = 0;
  kvp_error *err = nullptr;
  for (; done < add.size(); done++) {
    RegionEntry &r = add[done];
    nixl_reg_dlist_t dl(to_nixl_mem(r.kind));
    dl.addDesc(nixlBlobDesc(r.addr, r.len, r.dev_id, ""));
    nixl_status_t s;
    try {
      s = a->nixl->registerMem(dl);
    } catch (const std::exception &ex) {
      err = kvp_err(KVP_ERR_BACKEND, "%s: desc %zu: registerMem threw: %s", fn, done, ex.what());
      break;
    }
    if (s != NIXL_SUCCESS) {
      err = nixl_err(s, fn, "desc %zu (%s [%#llx, +%llu) dev %llu): registerMem", done,
                     kind_name(r.kind), static_cast<unsigned long long>(r.addr),
                     static_cast<unsigned long long>(r.len),
                     static_cast<unsigned long long>(r.dev_id));
      break;
    }
    auto *reg = new (std::nothrow) Region{a.get(), r.addr, r.len, r.dev_id, r.kind};
    if (!reg) {
      a->nixl->deregisterMem(dl);
      err = kvp_err_oom();
      break;
    }
    if ((err = kvp_ht_insert(t->regions, reg, &r.handle)) != nullptr) {
      a->nixl->deregisterMem(dl);
      delete reg;
      break;
    }
  }
  if (err) {  // all or nothing: undo what this call registered
    for (size_t i = 0; i < done; i++) {
      delete static_cast<Region *>(kvp_ht_remove(t->regions, add[i].handle));
      nixl_reg_dlist_t dl(to_nixl_mem(add[i].kind));
      dl.addDesc(nixlBlobDesc(add[i].addr, add[i].len, add[i].dev_id, ""));
      a->nixl->deregisterMem(dl);
    }
    return err;
  }
  for (size_t i = 0; i < add.size(); i++) args->regions[i] = add[i].handle;
  a->regions.insert(a->regions.end(), add.begin(), add.end());
  kvp_ranges_sort(a->regions.data(), a->regions.size(), sizeof(RegionEntry));
  return nullptr;
}

kvp_error *deregister_mem(kvp_deregister_mem_args *args) {
  static const char fn[] = "deregister_mem";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_DEREGISTER_MEM_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  if (args->num_regions == 0) return nullptr;
  if (!args->regions) return kvp_err(KVP_ERR_INVALID_PARAM, "%s: regions must not be NULL", fn);
  Tables *t = tables();
  std::lock_guard<std::mutex> lk(a->mu);
  std::set<kvp_region> seen;
  for (size_t i = 0; i < args->num_regions; i++) {
    kvp_region h = args->regions[i];
    Ref<Region> r(t->regions, h);
    if (!r || r->agent != a.get() || !seen.insert(h).second)
      return kvp_err(KVP_ERR_INVALID_PARAM,
                     "%s: region %zu (%#llx) is unknown, released, another agent's or listed "
                     "twice; nothing was deregistered",
                     fn, i, static_cast<unsigned long long>(h));
  }
  kvp_error *first = nullptr;
  for (size_t i = 0; i < args->num_regions; i++) {
    auto *r = static_cast<Region *>(kvp_ht_remove(t->regions, args->regions[i]));
    if (!r) continue;
    a->regions.erase(std::remove_if(a->regions.begin(), a->regions.end(),
                                    [&](const RegionEntry &e) { return e.handle == args->regions[i]; }),
                     a->regions.end());
    nixl_reg_dlist_t dl(to_nixl_mem(r->kind));
    dl.addDesc(nixlBlobDesc(r->addr, r->len, r->dev_id, ""));
    nixl_status_t s = a->nixl->deregisterMem(dl);
    if (s != NIXL_SUCCESS && !first) first = nixl_err(s, fn, "region %zu: deregisterMem", i);
    delete r;
  }
  return first;
}

kvp_error *region_export(kvp_region_export_args *args) {
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_REGION_EXPORT_ARGS_STRUCT_SIZE)) return e;
  return kvp_err(KVP_ERR_NOT_SUPPORTED,
                 "region_export: NIXL addresses remote memory by address inside the peer's "
                 "metadata, not by per-region blobs (KVP_CAP_REMOTE_BLOB is off)");
}

// ---------------------------------------------------------------------------
// Metadata and peers
// ---------------------------------------------------------------------------

kvp_error *local_metadata(kvp_local_metadata_args *args) {
  static const char fn[] = "local_metadata";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_LOCAL_METADATA_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  nixl_blob_t md;
  nixl_status_t s = a->nixl->getLocalMD(md);
  if (s != NIXL_SUCCESS) return nixl_err(s, fn, "getLocalMD");
  kvp_out_bytes(args->buf, args->cap, md.data(), md.size(), &args->size);
  return nullptr;
}

// The agent name NIXL metadata claims, or false when the blob does not
// start as NIXL's serialiser writes it (NIXL src/utils/serdes/serdes.cpp:
// "nixlSerDes|", then the tag "Agent", a size_t length and the name; see
// nixlAgentData::loadRemoteMD in src/core/nixl_agent.cpp).
bool md_agent_name(const uint8_t *md, size_t len, std::string *name) {
  static const char pre[] = "nixlSerDes|Agent";
  const size_t pl = sizeof pre - 1;
  if (len < pl + sizeof(size_t) || std::memcmp(md, pre, pl) != 0) return false;
  size_t n;
  std::memcpy(&n, md + pl, sizeof n);
  if (n == 0 || n > len - pl - sizeof n) return false;
  name->assign(reinterpret_cast<const char *>(md) + pl + sizeof n, n);
  return true;
}

// A loaded name keeps its metadata (ABI load_remote): the same bytes again
// are idempotent and do not reach NIXL; other bytes under a loaded name are
// refused before NIXL sees them. NIXL itself refuses other connection info
// (NIXL_ERR_NOT_ALLOWED) but merges other memory sections into the loaded
// peer, and when those fail to load it drops the whole peer, connection
// included (nixlAgentData::loadRemoteSections), which would cut off the
// honest peer whose name was forged.
kvp_error *load_remote(kvp_load_remote_args *args) {
  static const char fn[] = "load_remote";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_LOAD_REMOTE_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  if (!args->metadata || args->metadata_len == 0)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: metadata is empty", fn);
  std::lock_guard<std::mutex> load_lk(a->load_mu);
  nixl_blob_t md(reinterpret_cast<const char *>(args->metadata), args->metadata_len);
  std::string claimed;
  if (md_agent_name(args->metadata, args->metadata_len, &claimed)) {
    std::lock_guard<std::mutex> lk(a->mu);
    auto it = a->peers.find(claimed);
    if (it != a->peers.end()) {
      if (it->second->md != md)
        return kvp_err(KVP_ERR_NOT_ALLOWED,
                       "%s: peer '%s' is loaded with other metadata (another process, connection or "
                       "memory); refused, the loaded peer is unchanged (remove_remote it first if it "
                       "restarted)",
                       fn, claimed.c_str());
      args->peer_name = it->second->name.data();
      args->peer_name_len = it->second->name.size();
      return nullptr;
    }
  }
  std::string name;
  nixl_status_t s = a->nixl->loadRemoteMD(md, name);
  if (s == NIXL_ERR_NOT_ALLOWED)
    return nixl_err(s, fn,
                    "loadRemoteMD: a peer of that name is loaded with other connection info or "
                    "other keys for the same memory (did it restart?); remove_remote it first");
  if (s != NIXL_SUCCESS) return nixl_err(s, fn, "loadRemoteMD");
  std::lock_guard<std::mutex> lk(a->mu);
  auto &slot = a->peers[name];
  if (!slot) slot = std::make_shared<Peer>(name, md);
  args->peer_name = slot->name.data();
  args->peer_name_len = slot->name.size();
  return nullptr;
}

kvp_error *remove_remote(kvp_remove_remote_args *args) {
  static const char fn[] = "remove_remote";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_REMOVE_REMOTE_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  std::string name = as_string(args->peer_name, args->peer_name_len);
  PeerRef peer;
  std::vector<kvp_xfer> xs;
  std::lock_guard<std::mutex> load_lk(a->load_mu);
  {
    std::lock_guard<std::mutex> lk(a->mu);
    auto it = a->peers.find(name);
    if (it == a->peers.end())
      return kvp_err(KVP_ERR_NOT_FOUND, "%s: no loaded peer named '%s'", fn, name.c_str());
    peer = std::move(it->second);
    a->peers.erase(it);
    peer->dead = true;  // its dlists and remote regions are dead from now on
    for (Xfer *x = a->xfers; x; x = x->next)
      if (x->peer == peer) xs.push_back(x->handle);
  }
  // Its transfers are cancelled but keep their handles; so do its dlists
  // and remote regions: the caller releases them all.
  Clock::time_point deadline = Clock::now() + a->release_wait;
  for (kvp_xfer h : xs) kill_xfer(*a, h, deadline);
  if (!xs.empty()) ev_signal(*a);  // its transfers ended (cancelled)
  nixl_status_t s = a->nixl->invalidateRemoteMD(name);
  if (s != NIXL_SUCCESS && s != NIXL_ERR_NOT_FOUND) return nixl_err(s, fn, "invalidateRemoteMD(%s)", name.c_str());
  return nullptr;
}

kvp_error *remote_region_import(kvp_remote_region_import_args *args) {
  static const char fn[] = "remote_region_import";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_REMOTE_REGION_IMPORT_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  if (args->blob)
    return kvp_err(KVP_ERR_NOT_SUPPORTED,
                   "%s: NIXL has no region blobs (KVP_CAP_REMOTE_BLOB is off); import by "
                   "address (blob NULL)",
                   fn);
  std::string name = as_string(args->peer_name, args->peer_name_len);
  if (args->len == 0 || args->addr + args->len < args->addr)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: len must be > 0 and addr + len must not overflow", fn);
  if (!mem_kind_ok(args->mem_kind))
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: unknown memory kind %u", fn, args->mem_kind);
  {
    std::lock_guard<std::mutex> lk(a->mu);
    if (!find_peer(*a, name))
      return kvp_err(KVP_ERR_NOT_FOUND, "%s: no loaded peer named '%s'", fn, name.c_str());
  }
  nixl_xfer_dlist_t dl(to_nixl_mem(args->mem_kind));
  dl.addDesc(nixlBasicDesc(args->addr, args->len, args->dev_id));
  nixl_status_t s = a->nixl->checkRemoteMD(name, dl);
  if (s != NIXL_SUCCESS)
    return kvp_err(KVP_ERR_NOT_FOUND,
                   "%s: %s [%#llx, +%llu) dev %llu is not inside memory peer '%s' advertised",
                   fn, kind_name(args->mem_kind), static_cast<unsigned long long>(args->addr),
                   static_cast<unsigned long long>(args->len),
                   static_cast<unsigned long long>(args->dev_id), name.c_str());
  PeerRef peer;
  {
    std::lock_guard<std::mutex> lk(a->mu);
    peer = find_peer(*a, name);
  }
  if (!peer) return kvp_err(KVP_ERR_NOT_FOUND, "%s: peer '%s' was removed", fn, name.c_str());
  auto *rr = new RRegion{a.get(), peer, args->addr, args->len, args->dev_id, args->mem_kind};
  kvp_rregion h = 0;
  if (kvp_error *e = kvp_ht_insert(tables()->rregions, rr, &h)) {
    delete rr;
    return e;
  }
  std::lock_guard<std::mutex> lk(a->mu);
  a->rregions.insert(h);
  args->rregion = h;
  return nullptr;
}

kvp_error *remote_region_release(kvp_remote_region_release_args *args) {
  static const char fn[] = "remote_region_release";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_REMOTE_REGION_RELEASE_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  {
    Ref<RRegion> r(tables()->rregions, args->rregion);
    if (!r || r->agent != a.get()) return bad_handle(fn, "remote region", args->rregion);
  }
  auto *rr = static_cast<RRegion *>(kvp_ht_remove(tables()->rregions, args->rregion));
  if (!rr) return bad_handle(fn, "remote region", args->rregion);
  {
    std::lock_guard<std::mutex> lk(a->mu);
    a->rregions.erase(args->rregion);
  }
  delete rr;
  return nullptr;
}

// ---------------------------------------------------------------------------
// Prepared descriptor lists
// ---------------------------------------------------------------------------

kvp_error *prep_dlist(kvp_prep_dlist_args *args) {
  static const char fn[] = "prep_dlist";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_PREP_DLIST_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  if (!mem_kind_ok(args->mem_kind))
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: unknown memory kind %u", fn, args->mem_kind);
  if (args->num_descs == 0 || !args->descs)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: a dlist needs at least one descriptor", fn);
  if (args->num_descs > static_cast<size_t>(INT32_MAX))
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: too many descriptors (%zu)", fn, args->num_descs);

  auto d = std::make_unique<Dlist>();
  d->agent = a.get();
  d->kind = args->mem_kind;
  const std::string peer_name = as_string(args->peer_name, args->peer_name_len);
  d->remote = !peer_name.empty();
  size_t n = args->num_descs;
  d->lens.resize(n);
  d->counts.resize(n);
  bool strided = false;
  uint64_t flat = 0;
  for (size_t i = 0; i < n; i++) {
    const kvp_xfer_desc &x = args->descs[i];
    if (kvp_error *e = check_shape(fn, i, x.addr, x.len, x.stride, x.count)) return e;
    d->lens[i] = x.len;
    d->counts[i] = x.count;
    strided = strided || x.count > 1;
    flat += x.count;
  }
  if (flat > static_cast<uint64_t>(INT32_MAX))
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: %llu blocks exceed NIXL's int indices", fn,
                   static_cast<unsigned long long>(flat));

  if (!d->remote) {
    // Local: every block inside a registration of this agent of the same
    // kind and device, checked here for a precise message (NIXL would say
    // NOT_FOUND without naming the descriptor).
    std::lock_guard<std::mutex> lk(a->mu);
    for (size_t i = 0; i < n; i++) {
      const kvp_xfer_desc &x = args->descs[i];
      KindCtx ctx{args->mem_kind, x.dev_id};
      if (!kvp_strided_each_in(a->regions.data(), a->regions.size(), sizeof(RegionEntry), x.addr,
                               x.len, x.stride, x.count, accept_kind, &ctx))
        return kvp_err(KVP_ERR_NOT_FOUND,
                       "%s: local descriptor %zu (%s [%#llx, +%llu) x%llu dev %llu) is not inside "
                       "memory registered on this agent",
                       fn, i, kind_name(args->mem_kind), static_cast<unsigned long long>(x.addr),
                       static_cast<unsigned long long>(x.len),
                       static_cast<unsigned long long>(x.count),
                       static_cast<unsigned long long>(x.dev_id));
    }
  } else {
    std::lock_guard<std::mutex> lk(a->mu);
    d->peer = find_peer(*a, peer_name);
    if (!d->peer)
      return kvp_err(KVP_ERR_NOT_FOUND, "%s: no loaded peer named '%s'", fn, peer_name.c_str());
  }

  const std::string target = d->remote ? peer_name : std::string(NIXL_INIT_AGENT);
  nixl_status_t s;
#if KVP_NIXL_HAVE_STRIDE
  if (strided) {
    nixl_stride_dlist_t sl(to_nixl_mem(args->mem_kind));
    sl.reserve(n);
    d->first.resize(n);
    int f = 0;
    for (size_t i = 0; i < n; i++) {
      const kvp_xfer_desc &x = args->descs[i];
      // count 1 ignores the stride: give NIXL a dense one.
      sl.addDesc(nixlStrideDesc(x.addr, x.len, x.dev_id, x.count > 1 ? x.stride : x.len, x.count));
      d->first[i] = f;
      f += static_cast<int>(x.count);
    }
    s = a->nixl->prepXferDlist(target, sl, d->h);
  } else
#endif
  {
    (void)strided;
    nixl_xfer_dlist_t xl(to_nixl_mem(args->mem_kind));
    xl.reserve(n);
    for (size_t i = 0; i < n; i++) {
      const kvp_xfer_desc &x = args->descs[i];
      xl.addDesc(nixlBasicDesc(x.addr, x.len, x.dev_id));
    }
    s = a->nixl->prepXferDlist(target, xl, d->h);
  }
  if (s != NIXL_SUCCESS) {
    d->h = nullptr;
    if (d->remote && s == NIXL_ERR_NOT_FOUND) {
      // Name the first descriptor outside the peer's advertised memory.
      for (size_t i = 0; i < n; i++) {
        const kvp_xfer_desc &x = args->descs[i];
        nixl_xfer_dlist_t one(to_nixl_mem(args->mem_kind));
        for (uint64_t k = 0; k < x.count; k++)
          one.addDesc(nixlBasicDesc(x.addr + k * (x.count > 1 ? x.stride : 0), x.len, x.dev_id));
        if (a->nixl->checkRemoteMD(peer_name, one) != NIXL_SUCCESS)
          return kvp_err(KVP_ERR_NOT_FOUND,
                         "%s: remote descriptor %zu (%s [%#llx, +%llu) x%llu dev %llu) is not "
                         "inside memory peer '%s' advertised",
                         fn, i, kind_name(args->mem_kind), static_cast<unsigned long long>(x.addr),
                         static_cast<unsigned long long>(x.len),
                         static_cast<unsigned long long>(x.count),
                         static_cast<unsigned long long>(x.dev_id), peer_name.c_str());
      }
    }
    return nixl_err(s, fn, "prepXferDlist(%s, %zu descriptors)",
                    d->remote ? peer_name.c_str() : "local", n);
  }

  Dlist *raw = d.get();
  kvp_dlist h = 0;
  if (kvp_error *e = kvp_ht_insert(tables()->dlists, raw, &h)) {
    free_dlist(*a, d.release());
    return e;
  }
  d.release();
  std::lock_guard<std::mutex> lk(a->mu);
  a->dlists.insert(h);
  args->dlist = h;
  return nullptr;
}

kvp_error *release_dlist(kvp_release_dlist_args *args) {
  static const char fn[] = "release_dlist";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_RELEASE_DLIST_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  {
    Ref<Dlist> d(tables()->dlists, args->dlist);
    if (!d || d->agent != a.get()) return bad_handle(fn, "dlist", args->dlist);
  }
  auto *d = static_cast<Dlist *>(kvp_ht_remove(tables()->dlists, args->dlist));
  if (!d) return bad_handle(fn, "dlist", args->dlist);
  {
    std::lock_guard<std::mutex> lk(a->mu);
    a->dlists.erase(args->dlist);
  }
  free_dlist(*a, d);
  return nullptr;
}

// ---------------------------------------------------------------------------
// Transfers
// ---------------------------------------------------------------------------

kvp_error *check_notif(const char *fn, const Agent &a, const kvp_notif &n) {
  if (!n.has_notif) return nullptr;
  if (!(a.caps & KVP_CAP_NOTIF))
    return kvp_err(KVP_ERR_NOT_SUPPORTED, "%s: notifications are off for this agent", fn);
  if (n.msg_len && !n.msg) return kvp_err(KVP_ERR_INVALID_PARAM, "%s: notif msg is NULL", fn);
  return nullptr;
}

nixl_xfer_op_t to_nixl_op(kvp_op op) { return op == KVP_OP_READ ? NIXL_READ : NIXL_WRITE; }

// Inserts a new transfer and links it to its agent and peer.
// *made (when not null) receives the transfer, for submit_xfer to post it
// without looking the handle up again.
kvp_error *publish_xfer(const char *fn, Agent &a, XferPtr x, kvp_xfer *out, Xfer **made = nullptr) {
  Xfer *raw = x.get();
  kvp_xfer h = 0;
  if (kvp_error *e = kvp_ht_insert(tables()->xfers, raw, &h)) {
    free_xfer(a, x.release(), Clock::now());
    return e;
  }
  x.release();
  raw->handle = h;
  std::lock_guard<std::mutex> lk(a.mu);
  if (raw->peer->dead) {  // removed meanwhile (checked under mu: remove_remote
                          // collects the transfers to kill under it)
    free_xfer(a, static_cast<Xfer *>(kvp_ht_remove(tables()->xfers, h)), Clock::now());
    return peer_removed(fn, "a transfer to", *raw->peer);
  }
  a.link(raw);
  *out = h;
  if (made) *made = raw;
  return nullptr;
}

// A transfer with no descriptors moves nothing and only delivers its
// notification (kvplugin.h). NIXL has no empty request, so its post sends
// the notification with genNotif.
kvp_error *notif_only_xfer(const char *fn, Agent &a, const PeerRef &peer, const kvp_notif &n,
                           kvp_xfer *out, Xfer **made) {
  XferPtr x = new_xfer(a);
  x->peer = peer;
  x->desc_count = 0;
  x->notif_only = true;
  x->has_notif = n.has_notif != 0;
  if (x->has_notif) x->notif.assign(reinterpret_cast<const char *>(n.msg), n.msg_len);
  return publish_xfer(fn, a, std::move(x), out, made);
}

// An agent the caller holds a reference on, with Ref's interface, so that
// the make functions' bodies serve make_* (their own reference) and
// submit_xfer (one reference for make and post).
struct AgentPtr {
  Agent *p;
  Agent *operator->() const { return p; }
  Agent &operator*() const { return *p; }
  Agent *get() const { return p; }
};

kvp_error *make_prepped_impl(AgentPtr a, kvp_make_prepped_xfer_args *args, Xfer **made);
kvp_error *make_batch_impl(AgentPtr a, kvp_make_batch_xfer_args *args, Xfer **made);

kvp_error *make_prepped_xfer(kvp_make_prepped_xfer_args *args) {
  static const char fn[] = "make_prepped_xfer";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_MAKE_PREPPED_XFER_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  return make_prepped_impl(AgentPtr{a.get()}, args, nullptr);
}

kvp_error *make_prepped_impl(AgentPtr a, kvp_make_prepped_xfer_args *args, Xfer **made) {
  static const char fn[] = "make_prepped_xfer";
  if (args->op != KVP_OP_READ && args->op != KVP_OP_WRITE)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: unknown op %u", fn, args->op);
  if (kvp_error *e = check_notif(fn, *a, args->notif)) return e;
  Tables *t = tables();
  Ref<Dlist> ld(t->dlists, args->local_dlist);
  if (!ld || ld->agent != a.get()) return bad_handle(fn, "local dlist", args->local_dlist);
  Ref<Dlist> rd(t->dlists, args->remote_dlist);
  if (!rd || rd->agent != a.get()) return bad_handle(fn, "remote dlist", args->remote_dlist);
  if (ld->remote) return kvp_err(KVP_ERR_INVALID_PARAM, "%s: local_dlist was prepared for peer '%s'", fn, ld->peer->name.c_str());
  if (!rd->remote) return kvp_err(KVP_ERR_INVALID_PARAM, "%s: remote_dlist is a local dlist", fn);
  if (rd->peer->dead) return peer_removed(fn, "remote_dlist was prepared for", *rd->peer);
  size_t n = args->num_local_indices;
  if (n != args->num_remote_indices)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: %zu local indices but %zu remote indices", fn, n,
                   args->num_remote_indices);
  if (n == 0) return notif_only_xfer(fn, *a, rd->peer, args->notif, &args->xfer, made);
  if (!args->local_indices || !args->remote_indices)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: index arrays must not be NULL", fn);

  // Reused per thread: no allocation per transfer once warm.
  thread_local std::vector<int> li, ri;
  li.clear();
  ri.clear();
  const bool flat = ld->first.empty() && rd->first.empty();
  if (flat) {
    li.reserve(n);
    ri.reserve(n);
  }
  const size_t nl = ld->lens.size(), nr = rd->lens.size();
  for (size_t i = 0; i < n; i++) {
    int32_t l = args->local_indices[i], r = args->remote_indices[i];
    if (l < 0 || static_cast<size_t>(l) >= nl)
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: local index %zu is %d, outside the dlist's %zu descriptors", fn, i, l, nl);
    if (r < 0 || static_cast<size_t>(r) >= nr)
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: remote index %zu is %d, outside the dlist's %zu descriptors", fn, i, r, nr);
    if (ld->lens[l] != rd->lens[r] || ld->counts[l] != rd->counts[r])
      return kvp_err(KVP_ERR_MISMATCH,
                     "%s: pair %zu: local descriptor %d (len %llu x%llu) and remote descriptor %d "
                     "(len %llu x%llu) differ",
                     fn, i, l, static_cast<unsigned long long>(ld->lens[l]),
                     static_cast<unsigned long long>(ld->counts[l]), r,
                     static_cast<unsigned long long>(rd->lens[r]),
                     static_cast<unsigned long long>(rd->counts[r]));
    if (flat) {
      li.push_back(l);
      ri.push_back(r);
    } else {
      int lf = ld->first.empty() ? l : ld->first[l];
      int rf = rd->first.empty() ? r : rd->first[r];
      for (uint64_t k = 0; k < ld->counts[l]; k++) {
        li.push_back(lf + static_cast<int>(k));
        ri.push_back(rf + static_cast<int>(k));
      }
    }
  }
  nixl_opt_args_t opt;
  if (args->notif.has_notif)
    opt.notif = nixl_blob_t(reinterpret_cast<const char *>(args->notif.msg), args->notif.msg_len);
  XferPtr x = new_xfer(*a);
  x->peer = rd->peer;
  x->desc_count = n;
  nixl_status_t s = a->nixl->makeXferReq(to_nixl_op(args->op), ld->h, li, rd->h, ri, x->req,
                                         args->notif.has_notif ? &opt : nullptr);
  if (s != NIXL_SUCCESS) return nixl_err(s, fn, "makeXferReq(%zu descriptors)", n);
  return publish_xfer(fn, *a, std::move(x), &args->xfer, made);
}

kvp_error *make_batch_xfer(kvp_make_batch_xfer_args *args) {
  static const char fn[] = "make_batch_xfer";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_MAKE_BATCH_XFER_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  return make_batch_impl(AgentPtr{a.get()}, args, nullptr);
}

kvp_error *make_batch_impl(AgentPtr a, kvp_make_batch_xfer_args *args, Xfer **made) {
  static const char fn[] = "make_batch_xfer";
  if (args->op != KVP_OP_READ && args->op != KVP_OP_WRITE)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: unknown op %u", fn, args->op);
  if (kvp_error *e = check_notif(fn, *a, args->notif)) return e;
  if (args->num_pairs == 0 || !args->pairs)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: no region pairs (a transfer needs a peer)", fn);
  if (args->num_entries && !args->entries)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: entries is NULL", fn);

  // Copy what the entries need from the pairs' regions. The caller keeps the
  // regions alive for the call (ABI thread-safety rule 1), so the references
  // are dropped right after the copy.
  struct Side {
    uint64_t addr, len, dev_id;
    kvp_mem_kind kind;
  };
  thread_local std::vector<Side> loc, rem;
  loc.resize(args->num_pairs);
  rem.resize(args->num_pairs);
  Tables *t = tables();
  PeerRef peer;
  for (size_t i = 0; i < args->num_pairs; i++) {
    Ref<Region> l(t->regions, args->pairs[i].local);
    if (!l || l->agent != a.get())
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: pair %zu: unknown, released or foreign local region %#llx", fn, i,
                     static_cast<unsigned long long>(args->pairs[i].local));
    Ref<RRegion> r(t->rregions, args->pairs[i].remote);
    if (!r || r->agent != a.get())
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: pair %zu: unknown, released or foreign remote region %#llx", fn, i,
                     static_cast<unsigned long long>(args->pairs[i].remote));
    if (r->peer->dead) return peer_removed(fn, "a remote region of", *r->peer);
    if (i == 0)
      peer = r->peer;
    else if (r->peer != peer)
      return kvp_err(KVP_ERR_MISMATCH, "%s: pair %zu: remote region of peer '%s', pair 0 of peer '%s'", fn, i,
                     r->peer->name.c_str(), peer->name.c_str());
    loc[i] = Side{l->addr, l->len, l->dev_id, l->kind};
    rem[i] = Side{r->addr, r->len, r->dev_id, r->kind};
    if (loc[i].kind != loc[0].kind || rem[i].kind != rem[0].kind)
      return kvp_err(KVP_ERR_NOT_SUPPORTED,
                     "%s: pair %zu mixes memory kinds (NIXL transfers one kind per side; split "
                     "the transfer by kind)",
                     fn, i);
  }

  if (args->num_entries == 0) return notif_only_xfer(fn, *a, peer, args->notif, &args->xfer, made);

  nixl_xfer_dlist_t ll(to_nixl_mem(loc[0].kind)), rl(to_nixl_mem(rem[0].kind));
  size_t blocks = 0;
  for (size_t i = 0; i < args->num_entries; i++) {
    const kvp_batch_entry &e = args->entries[i];
    if (e.pair >= args->num_pairs)
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: entry %zu: pair %u outside the %zu pairs", fn, i, e.pair, args->num_pairs);
    if (e.reserved != 0) return kvp_err(KVP_ERR_INVALID_PARAM, "%s: entry %zu: reserved must be 0", fn, i);
    if (kvp_error *er = check_shape(fn, i, e.local_offset, e.len, e.local_stride, e.count)) return er;
    if (kvp_error *er = check_shape(fn, i, e.remote_offset, e.len, e.remote_stride, e.count)) return er;
    const Side &L = loc[e.pair], &R = rem[e.pair];
    if (!kvp_strided_in(e.local_offset, e.len, e.local_stride, e.count, 0, L.len))
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: entry %zu: local blocks (offset %llu, len %llu x%llu) run past the %llu-byte local region", fn, i,
                     static_cast<unsigned long long>(e.local_offset), static_cast<unsigned long long>(e.len),
                     static_cast<unsigned long long>(e.count), static_cast<unsigned long long>(L.len));
    if (!kvp_strided_in(e.remote_offset, e.len, e.remote_stride, e.count, 0, R.len))
      return kvp_err(KVP_ERR_INVALID_PARAM, "%s: entry %zu: remote blocks (offset %llu, len %llu x%llu) run past the %llu-byte remote region", fn, i,
                     static_cast<unsigned long long>(e.remote_offset), static_cast<unsigned long long>(e.len),
                     static_cast<unsigned long long>(e.count), static_cast<unsigned long long>(R.len));
    blocks += e.count;
  }
  if (blocks > static_cast<size_t>(INT32_MAX))
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: %zu blocks exceed NIXL's int indices", fn, blocks);
  ll.reserve(blocks);
  rl.reserve(blocks);
  for (size_t i = 0; i < args->num_entries; i++) {
    const kvp_batch_entry &e = args->entries[i];
    const Side &L = loc[e.pair], &R = rem[e.pair];
    for (uint64_t k = 0; k < e.count; k++) {
      ll.addDesc(nixlBasicDesc(L.addr + e.local_offset + k * e.local_stride, e.len, L.dev_id));
      rl.addDesc(nixlBasicDesc(R.addr + e.remote_offset + k * e.remote_stride, e.len, R.dev_id));
    }
  }
  nixl_opt_args_t opt;
  if (args->notif.has_notif)
    opt.notif = nixl_blob_t(reinterpret_cast<const char *>(args->notif.msg), args->notif.msg_len);
  XferPtr x = new_xfer(*a);
  x->peer = peer;
  x->desc_count = args->num_entries;
  nixl_status_t s = a->nixl->createXferReq(to_nixl_op(args->op), ll, rl, peer->name, x->req,
                                           args->notif.has_notif ? &opt : nullptr);
  if (s != NIXL_SUCCESS)
    return nixl_err(s, fn, "createXferReq(%zu descriptors to '%s')", blocks, peer->name.c_str());
  return publish_xfer(fn, *a, std::move(x), &args->xfer, made);
}

kvp_error *post_locked(AgentPtr a, Xfer *x, kvp_xfer h, kvp_status *status);

kvp_error *post_xfer(kvp_post_xfer_args *args) {
  static const char fn[] = "post_xfer";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_POST_XFER_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  Ref<Xfer> x(tables()->xfers, args->xfer);
  if (!x || x->agent != a.get()) return bad_handle(fn, "xfer", args->xfer);
  std::lock_guard<std::mutex> lk(x->mu);
  return post_locked(AgentPtr{a.get()}, x.get(), args->xfer, &args->status);
}

// post_xfer of transfer x (handle h), locked by the caller.
kvp_error *post_locked(AgentPtr a, Xfer *x, kvp_xfer h, kvp_status *status) {
  static const char fn[] = "post_xfer";
  if (x->dead) return peer_removed(fn, "the transfer goes to", *x->peer);
  if (x->notif_only) {
    x->start = Clock::now();
    if (x->has_notif) {
      nixl_status_t s = a->nixl->genNotif(x->peer->name, x->notif);
      if (s != NIXL_SUCCESS)
        return nixl_err(s, fn, "genNotif to '%s' (a transfer without descriptors)",
                        x->peer->name.c_str());
    }
    x->post_us = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - x->start).count());
    x->posted = true;
    x->last = NIXL_SUCCESS;
    *status = KVP_SUCCESS;
    return nullptr;
  }
  nixl_status_t s = a->nixl->postXferReq(x->req);
  // REPOST_ACTIVE leaves the earlier post running; any other outcome
  // replaces it.
  if (s != NIXL_ERR_REPOST_ACTIVE) {
    x->posted = true;
    x->active = s == NIXL_IN_PROG;
    x->last = s;
  }
  if (s < 0) return nixl_err(s, fn, "postXferReq to '%s'", x->peer->name.c_str());
  *status = s == NIXL_SUCCESS ? KVP_SUCCESS : KVP_IN_PROG;
  if (s == NIXL_IN_PROG && a->ev_fd.load(std::memory_order_acquire) >= 0) ev_watch(*a, h);
  return nullptr;
}

// poll_xfer calls NIXL's getXferStatus once. Without a progress thread that
// progresses the UCX worker in the calling thread until it has no more
// completions ready (ucp_worker_progress in a loop while it reports
// progress): it may move data the transport has ready, but never waits.
//
// ABI 1.1 flags (agents with KVP_CAP_SUBMIT, args of the 1.1 size): once the
// transfer ended, KVP_POLL_TELEMETRY reads getXferTelemetry (as
// xfer_telemetry does) and KVP_POLL_RELEASE releases it (releaseXferReq and
// the handle, as release_xfer does), in the same call.
kvp_error *poll_locked(Agent &a, Xfer *x, kvp_poll_xfer_args *args, bool *ended);
nixl_status_t telemetry_locked(Agent &a, Xfer *x, kvp_xfer_telemetry_args *t);

kvp_error *poll_xfer_once(Agent &a, kvp_poll_xfer_args *args, uint32_t flags, bool *release) {
  static const char fn[] = "poll_xfer";
  *release = false;
  Ref<Xfer> x(tables()->xfers, args->xfer);
  if (!x || x->agent != &a) return bad_handle(fn, "xfer", args->xfer);
  std::lock_guard<std::mutex> lk(x->mu);
  bool ended = false;
  kvp_error *e = poll_locked(a, x.get(), args, &ended);
  if (!ended) return e;
  if (!e && (flags & KVP_POLL_TELEMETRY) && (a.caps & KVP_CAP_TELEMETRY)) {
    kvp_xfer_telemetry_args t{};
    if (telemetry_locked(a, x.get(), &t) == NIXL_SUCCESS) {
      args->start_us = t.start_us;
      args->post_us = t.post_us;
      args->xfer_us = t.xfer_us;
      args->total_bytes = t.total_bytes;
      args->desc_count = t.desc_count;
      args->has_telemetry = 1;
    }
  }
  if (flags & KVP_POLL_RELEASE) {
    // It ended: not active, so NIXL's request goes without waiting (as in
    // release_xfer); the handle goes after the lock and reference.
    if (x->req) {
      if (a.nixl->releaseXferReq(x->req) != NIXL_SUCCESS) return e;  // released stays 0
      x->req = nullptr;
    }
    *release = true;
  }
  return e;
}

// One poll of x, locked by the caller; *ended when it ended (done, failed,
// dead).
kvp_error *poll_locked(Agent &a, Xfer *x, kvp_poll_xfer_args *args, bool *ended) {
  static const char fn[] = "poll_xfer";
  *ended = false;
  if (x->dead) {
    *ended = true;
    if (x->dead_status != KVP_SUCCESS) return dead_poll(fn, *x);
    args->status = KVP_SUCCESS;
    return nullptr;
  }
  if (x->notif_only) {
    if (!x->posted) return kvp_err(KVP_ERR_NOT_POSTED, "%s: the transfer was never posted", fn);
    args->status = KVP_SUCCESS;
    *ended = true;
    return nullptr;
  }
  nixl_status_t s = a.nixl->getXferStatus(x->req);
  x->active = s == NIXL_IN_PROG;
  if (x->posted) x->last = s;
  *ended = x->posted && s != NIXL_IN_PROG;
  if (s < 0) return nixl_err(s, fn, "getXferStatus of a transfer to '%s'", x->peer->name.c_str());
  args->status = s == NIXL_SUCCESS ? KVP_SUCCESS : KVP_IN_PROG;
  return nullptr;
}

kvp_error *xfer_telemetry(kvp_xfer_telemetry_args *args);
kvp_error *release_xfer(kvp_release_xfer_args *args);

kvp_error *poll_xfer(kvp_poll_xfer_args *args) {
  static const char fn[] = "poll_xfer";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_POLL_XFER_ARGS_STRUCT_SIZE_1_0)) return e;
  uint32_t flags = 0;
  if (KVP_ARGS_HAS(args, kvp_poll_xfer_args, desc_count)) {
    flags = args->flags;
    args->released = 0;
    args->has_telemetry = 0;
  }
  WITH_AGENT(a, fn);
  if (!(a->caps & KVP_CAP_SUBMIT)) flags = 0;
  bool release = false;
  kvp_error *e = poll_xfer_once(*a, args, flags, &release);
  if (release) {
    if (auto *x = static_cast<Xfer *>(kvp_ht_remove(tables()->xfers, args->xfer))) {
      {
        std::lock_guard<std::mutex> lk(a->mu);
        a->unlink(x);
      }
      recycle_xfer(*a, x);
      args->released = 1;
    }
  }
  return e;
}

kvp_error *release_xfer(kvp_release_xfer_args *args) {
  static const char fn[] = "release_xfer";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_RELEASE_XFER_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  {
    // Release the NIXL request first, waiting for an active transfer to
    // finish; if it does not in time the handle stays valid.
    Ref<Xfer> x(tables()->xfers, args->xfer);
    if (!x || x->agent != a.get()) return bad_handle(fn, "xfer", args->xfer);
    std::lock_guard<std::mutex> lk(x->mu);
    if (x->req) {
      if (!x->active) {  // known to be done, failed or never posted
        nixl_status_t s = a->nixl->releaseXferReq(x->req);
        if (s != NIXL_SUCCESS) return nixl_err(s, fn, "releaseXferReq");
        x->req = nullptr;
      } else if (kvp_error *e = release_req(*a, x->req, Clock::now() + a->release_wait, fn)) {
        return e;
      }
    }
  }
  auto *x = static_cast<Xfer *>(kvp_ht_remove(tables()->xfers, args->xfer));
  if (!x) return bad_handle(fn, "xfer", args->xfer);
  {
    std::lock_guard<std::mutex> lk(a->mu);
    a->unlink(x);
  }
  recycle_xfer(*a, x);
  return nullptr;
}

kvp_error *xfer_telemetry(kvp_xfer_telemetry_args *args) {
  static const char fn[] = "xfer_telemetry";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_XFER_TELEMETRY_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  Ref<Xfer> x(tables()->xfers, args->xfer);
  if (!x || x->agent != a.get()) return bad_handle(fn, "xfer", args->xfer);
  if (!(a->caps & KVP_CAP_TELEMETRY))
    return kvp_err(KVP_ERR_NO_TELEMETRY, "%s: telemetry is off for this agent (telemetry=false)", fn);
  std::lock_guard<std::mutex> lk(x->mu);
  if (x->dead)
    return kvp_err(KVP_ERR_NO_TELEMETRY, "%s: no telemetry: the transfer's peer '%s' was removed", fn,
                   x->peer->name.c_str());
  kvp_xfer_telemetry_args t{};
  nixl_status_t s = telemetry_locked(*a, x.get(), &t);
  if (s == NIXL_ERR_NOT_POSTED && x->notif_only)
    return kvp_err(KVP_ERR_NO_TELEMETRY, "%s: no telemetry: the transfer was never posted", fn);
  if (s != NIXL_SUCCESS)
    return kvp_err(KVP_ERR_NO_TELEMETRY, "%s: no telemetry: the transfer has not completed (%s)", fn,
                   status_name(s).c_str());
  args->start_us = t.start_us;
  args->post_us = t.post_us;
  args->xfer_us = t.xfer_us;
  args->total_bytes = t.total_bytes;
  args->desc_count = t.desc_count;
  return nullptr;
}

// The telemetry of a transfer that ended (not dead), locked by the caller;
// t->struct_size stays 0 when NIXL has none.
nixl_status_t telemetry_locked(Agent &a, Xfer *x, kvp_xfer_telemetry_args *args) {
  if (x->notif_only) {
    if (!x->posted) return NIXL_ERR_NOT_POSTED;
    auto start = std::chrono::system_clock::now() -
                 std::chrono::duration_cast<std::chrono::system_clock::duration>(Clock::now() - x->start);
    args->start_us = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(start.time_since_epoch()).count());
    args->post_us = args->xfer_us = x->post_us;
    args->total_bytes = 0;
    args->desc_count = 0;
    args->struct_size = KVP_XFER_TELEMETRY_ARGS_STRUCT_SIZE;
    return NIXL_SUCCESS;
  }
  nixl_xfer_telem_t tm{};
  nixl_status_t s = a.nixl->getXferTelemetry(x->req, tm);
  if (s != NIXL_SUCCESS) return s;
  // NIXL stamps the start on the steady clock; the ABI wants Unix time.
  auto since = std::chrono::steady_clock::now() - tm.startTime;
  auto start = std::chrono::system_clock::now() -
               std::chrono::duration_cast<std::chrono::system_clock::duration>(since);
  args->start_us = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(start.time_since_epoch()).count());
  args->post_us = static_cast<uint64_t>(tm.postDuration.count());
  args->xfer_us = static_cast<uint64_t>(tm.xferDuration.count());
  args->total_bytes = tm.totalBytes;
  args->desc_count = x->desc_count;
  args->struct_size = KVP_XFER_TELEMETRY_ARGS_STRUCT_SIZE;
  return NIXL_SUCCESS;
}

// ---------------------------------------------------------------------------
// Submit (ABI 1.1)
// ---------------------------------------------------------------------------

kvp_error *submit_xfer(kvp_submit_xfer_args *args) {
  static const char fn[] = "submit_xfer";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_SUBMIT_XFER_ARGS_STRUCT_SIZE)) return e;
  if (!args->prepped == !args->batch)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: exactly one of prepped and batch must be set", fn);
  kvp_agent ah;
  kvp_xfer *out;
  kvp_error *e;
  if (args->prepped) {
    if ((e = KVP_CHECK_ARGS(args->prepped, KVP_MAKE_PREPPED_XFER_ARGS_STRUCT_SIZE))) return e;
    ah = args->prepped->agent;
    out = &args->prepped->xfer;
  } else {
    if ((e = KVP_CHECK_ARGS(args->batch, KVP_MAKE_BATCH_XFER_ARGS_STRUCT_SIZE))) return e;
    ah = args->batch->agent;
    out = &args->batch->xfer;
  }
  // One reference on the agent for the make and the post; the new
  // transfer is posted through the pointer the make hands back (nobody
  // else knows its handle yet, so nobody can release it meanwhile).
  Ref<Agent> a(tables()->agents, ah);
  if (!a) return bad_handle(fn, "agent", ah);
  if (!(a->caps & KVP_CAP_SUBMIT))
    return kvp_err(KVP_ERR_NOT_SUPPORTED, "%s: submit is off for this agent", fn);
  Xfer *x = nullptr;
  AgentPtr ap{a.get()};
  if ((e = args->prepped ? make_prepped_impl(ap, args->prepped, &x) : make_batch_impl(ap, args->batch, &x)))
    return e;
  kvp_status st = KVP_IN_PROG;
  {
    std::lock_guard<std::mutex> lk(x->mu);
    e = post_locked(ap, x, *out, &st);
  }
  if (e) {
    kvp_release_xfer_args r{KVP_RELEASE_XFER_ARGS_STRUCT_SIZE, nullptr, ah, *out};
    kvp_err_free(release_xfer(&r));  // never posted: nothing to wait for
    *out = 0;
    return e;
  }
  args->status = st;
  return nullptr;
}

kvp_error *get_event_fd(kvp_get_event_fd_args *args) {
  static const char fn[] = "get_event_fd";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_GET_EVENT_FD_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  if (!(a->caps & KVP_CAP_EVENT_FD))
    return kvp_err(KVP_ERR_NOT_SUPPORTED, "%s: the event descriptor is off for this agent", fn);
  bool first = false;
  {
    std::lock_guard<std::mutex> lk(a->ev_mu);
    if (a->ev_fd.load(std::memory_order_acquire) < 0) {
      int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
      if (fd < 0) return kvp_err(KVP_ERR_BACKEND, "%s: eventfd: %s", fn, std::strerror(errno));
      try {
        a->ev_thread = std::thread(ev_main, a.get());
      } catch (...) {
        close(fd);
        throw;
      }
      a->ev_fd.store(fd, std::memory_order_release);
      first = true;
    }
    args->fd = a->ev_fd.load(std::memory_order_acquire);
  }
  if (first) {
    // Transfers posted before: the thread watches those still in progress.
    std::vector<kvp_xfer> xs;
    {
      std::lock_guard<std::mutex> lk(a->mu);
      for (Xfer *x = a->xfers; x; x = x->next) xs.push_back(x->handle);
    }
    for (kvp_xfer h : xs) {
      Ref<Xfer> x(tables()->xfers, h);
      if (!x) continue;
      bool active;
      {
        std::lock_guard<std::mutex> lk(x->mu);
        active = x->active && !x->dead;
      }
      if (active) ev_watch(*a, h);
    }
  }
  return nullptr;
}

// ---------------------------------------------------------------------------
// Notifications
// ---------------------------------------------------------------------------

// Moves what NIXL has received (getNotifs, which also drives the backend's
// progress) into the agent's queue; *n counts the notifications moved.
// Needs a.notif_mu.
kvp_error *pull_notifs(Agent &a, const char *fn, size_t *n) {
  *n = 0;
  nixl_notifs_t got;
  nixl_status_t s = a.nixl->getNotifs(got);
  if (s != NIXL_SUCCESS) return nixl_err(s, fn, "getNotifs");
  kvp_error *first = nullptr;
  for (auto &kv : got) {
    for (auto &msg : kv.second) {
      kvp_error *e = kvp_nq_push(a.notifs, kv.first.data(), kv.first.size(),
                                 reinterpret_cast<const uint8_t *>(msg.data()), msg.size());
      if (!e) (*n)++;
      if (e && !first)
        first = kvp_err_wrap(e, "%s: notification from '%s' dropped", fn, kv.first.c_str());
      else if (e)
        kvp_err_free(e);
    }
  }
  return first;
}

kvp_error *get_notifs(kvp_get_notifs_args *args) {
  static const char fn[] = "get_notifs";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_GET_NOTIFS_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  if (!(a->caps & KVP_CAP_NOTIF))
    return kvp_err(KVP_ERR_NOT_SUPPORTED, "%s: notifications are off for this agent", fn);
  // Pull what NIXL has received into the agent's queue, then hand out
  // whole records that fit.
  std::lock_guard<std::mutex> lk(a->notif_mu);
  size_t n;
  if (kvp_error *e = pull_notifs(*a, fn, &n)) return e;
  kvp_nq_drain(a->notifs, args->buf, args->cap, &args->size, &args->count, &args->needed);
  return nullptr;
}

kvp_error *send_notif(kvp_send_notif_args *args) {
  static const char fn[] = "send_notif";
  if (kvp_error *e = KVP_CHECK_ARGS(args, KVP_SEND_NOTIF_ARGS_STRUCT_SIZE)) return e;
  WITH_AGENT(a, fn);
  if (!(a->caps & KVP_CAP_NOTIF))
    return kvp_err(KVP_ERR_NOT_SUPPORTED, "%s: notifications are off for this agent", fn);
  if (args->msg_len && !args->msg) return kvp_err(KVP_ERR_INVALID_PARAM, "%s: msg is NULL", fn);
  std::string peer = as_string(args->peer_name, args->peer_name_len);
  {
    std::lock_guard<std::mutex> lk(a->mu);
    if (!find_peer(*a, peer))
      return kvp_err(KVP_ERR_NOT_FOUND, "%s: no loaded peer named '%s'", fn, peer.c_str());
  }
  nixl_blob_t msg(reinterpret_cast<const char *>(args->msg), args->msg_len);
  nixl_status_t s = a->nixl->genNotif(peer, msg);
  if (s != NIXL_SUCCESS) return nixl_err(s, fn, "genNotif to '%s'", peer.c_str());
  return nullptr;
}

// ---------------------------------------------------------------------------
// The table
// ---------------------------------------------------------------------------

#define GUARD(name, type)                                                          \
  kvp_error *name##_entry(type *args) {                                             \
    return guarded(#name, [&] { return name(args); });                              \
  }

GUARD(plugin_info, kvp_plugin_info_args)
GUARD(agent_create, kvp_agent_create_args)
GUARD(agent_destroy, kvp_agent_destroy_args)
GUARD(register_mem, kvp_register_mem_args)
GUARD(deregister_mem, kvp_deregister_mem_args)
GUARD(region_export, kvp_region_export_args)
GUARD(local_metadata, kvp_local_metadata_args)
GUARD(load_remote, kvp_load_remote_args)
GUARD(remove_remote, kvp_remove_remote_args)
GUARD(remote_region_import, kvp_remote_region_import_args)
GUARD(remote_region_release, kvp_remote_region_release_args)
GUARD(prep_dlist, kvp_prep_dlist_args)
GUARD(release_dlist, kvp_release_dlist_args)
GUARD(make_prepped_xfer, kvp_make_prepped_xfer_args)
GUARD(make_batch_xfer, kvp_make_batch_xfer_args)
GUARD(post_xfer, kvp_post_xfer_args)
GUARD(poll_xfer, kvp_poll_xfer_args)
GUARD(release_xfer, kvp_release_xfer_args)
GUARD(xfer_telemetry, kvp_xfer_telemetry_args)
GUARD(get_notifs, kvp_get_notifs_args)
GUARD(send_notif, kvp_send_notif_args)
GUARD(submit_xfer, kvp_submit_xfer_args)
GUARD(get_event_fd, kvp_get_event_fd_args)

const kvp_api kApi = {
    KVP_API_STRUCT_SIZE,
    nullptr,
    KVP_ABI_MAJOR,
    KVP_ABI_MINOR,
    kvp_util_error_destroy,
    kvp_util_error_message,
    kvp_util_error_code,
    plugin_info_entry,
    agent_create_entry,
    agent_destroy_entry,
    register_mem_entry,
    deregister_mem_entry,
    region_export_entry,
    local_metadata_entry,
    load_remote_entry,
    remove_remote_entry,
    remote_region_import_entry,
    remote_region_release_entry,
    prep_dlist_entry,
    release_dlist_entry,
    make_prepped_xfer_entry,
    make_batch_xfer_entry,
    post_xfer_entry,
    poll_xfer_entry,
    release_xfer_entry,
    xfer_telemetry_entry,
    get_notifs_entry,
    send_notif_entry,
    submit_xfer_entry,
    get_event_fd_entry,
};

}  // namespace

extern "C" KVP_EXPORT kvp_status kvp_plugin_get_api(kvp_get_api_args *args) {
  return kvp_util_get_api(args, KVP_ABI_MAJOR, &kApi);
}
