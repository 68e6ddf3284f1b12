// bench_direct.cc: the direct-NIXL baseline for `kvhost bench --backend nixl`.
//
// Moves the same transfers kvhost's bench does, but by calling NIXL's C++ API
// directly, so the two tables, taken in the same run on the same machine,
// show what kvhost (Go host + purego + the nixl shim) adds per transfer.
//
// Two agents: an initiator that makes, posts and polls the transfers, and a
// target that only owns the remote memory and drains notifications. By
// default they live in two processes (fork; metadata crosses a pipe), as in a
// real prefill/decode pair; --procs 1 puts both in this process.
//
// For every (op, path, block size, batch size) one iteration is the full
// per-request cost a KV transfer host pays: build the request (prepped:
// makeXferReq over dlists prepared once, outside the timing; batch: build
// the descriptor lists and createXferReq, as a caller whose descriptors
// change per request does), post it, poll it to completion, release it. Columns follow nixlbench: block and batch size, bandwidth, average
// latency per iteration, and average/p99 of the prep (request build), post and
// transfer (post to completion) phases, and the initiator thread's CPU time
// per request (steadier than wall time on a shared machine). The bytes of
// the last iteration are verified. With --raw every request is followed (or
// preceded, alternately) by a raw copy of the same blocks, as kvhost bench
// does: the ratio of the two, iteration by iteration, is the efficiency both
// programs report, so comparing them cancels the load of a shared machine.
//
// With --plugin PATH the same rows go through the kvhost plugin ABI instead
// (dlopen of libkvhost_nixl.so, its function table called from C++): the
// difference between the two runs is what the nixl shim adds, without the
// Go host; the difference between that and `kvhost bench` is the host's.
//
// Build: make plugin-nixl NIXL_PREFIX=... (builds bin/nixl-bench-direct).
// Run:   bin/nixl-bench-direct --help

#include <nixl.h>

#include "kvplugin.h"

#include <dlfcn.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int procs = 2;
  std::vector<std::string> ops{"WRITE", "READ"};
  std::vector<std::string> paths{"prepped", "batch"};
  std::vector<uint64_t> blocks;
  std::vector<uint64_t> batches{1, 16, 128};
  uint64_t max_buffer = 256ull << 20;
  double seconds = 0.25;  // per measurement, after warmup
  int min_iters = 5;
  int warmup = 2;
  bool progress_thread = false;
  uint64_t progress_delay_us = 0;
  nixl_thread_sync_t sync = nixl_thread_sync_t::NIXL_THREAD_SYNC_RW;
  std::string backend = "UCX";
  nixl_b_params_t bparams;
  std::string plugin;  // --plugin: go through this kvhost plugin's ABI
  bool raw = false;    // --raw: interleave a raw copy of the same blocks
  bool submit = false; // --submit: ABI 1.1 submit_xfer + poll-release (with --plugin)
};

[[noreturn]] void die(const char *fmt, const std::string &a = "", int b = 0) {
  std::fprintf(stderr, "nixl-bench-direct: ");
  std::fprintf(stderr, fmt, a.c_str(), b);
  std::fprintf(stderr, "\n");
  std::exit(1);
}

void check(nixl_status_t s, const char *what) {
  if (s != NIXL_SUCCESS && s != NIXL_IN_PROG)
    die("%s failed: %d", what, static_cast<int>(s));
}

uint64_t parse_size(const std::string &s) {
  char *end = nullptr;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  std::string suf(end);
  if (suf == "K" || suf == "KiB" || suf == "k") v <<= 10;
  else if (suf == "M" || suf == "MiB" || suf == "m") v <<= 20;
  else if (suf == "G" || suf == "GiB" || suf == "g") v <<= 30;
  else if (!suf.empty() || end == s.c_str()) die("bad size %s", s);
  return v;
}

std::vector<std::string> split(const std::string &s) {
  std::vector<std::string> out;
  size_t p = 0;
  while (p <= s.size()) {
    size_t q = s.find(',', p);
    if (q == std::string::npos) q = s.size();
    if (q > p) out.push_back(s.substr(p, q - p));
    p = q + 1;
  }
  return out;
}

void usage() {
  std::printf(
      "usage: nixl-bench-direct [options]\n"
      "  --procs 1|2            agents in one process or two (default 2); 1 needs\n"
      "                         --progress-thread\n"
      "  --ops WRITE,READ       operations (default both)\n"
      "  --paths prepped,batch  prepped = prepXferDlist once + makeXferReq per request;\n"
      "                         batch = createXferReq per request (default both)\n"
      "  --blocks 4K,64K,...    block sizes (default 4K,16K,64K,256K,1M,4M,16M,64M)\n"
      "  --batches 1,16,128     descriptors per request (default 1,16,128)\n"
      "  --max-buffer 256M      skip block x batch above this (bytes per side)\n"
      "  --seconds 0.25         measuring time per row (after warmup)\n"
      "  --min-iters 5          at least this many iterations per row\n"
      "  --warmup 2             untimed iterations per row\n"
      "  --progress-thread      start NIXL's progress thread\n"
      "  --progress-delay-us 0  progress thread wake-up period\n"
      "  --sync rw|strict       NIXL thread sync mode (default rw, as the plugin)\n"
      "  --backend UCX          NIXL backend\n"
      "  --param key=value      backend parameter (repeatable), e.g.\n"
      "                         --param ucx_error_handling_mode=none\n"
      "  --plugin PATH          go through the kvhost plugin ABI of PATH\n"
      "  --submit               with --plugin: ABI 1.1, submit_xfer (make + post in one call)\n"
      "                         and a final poll_xfer that releases (KVP_POLL_RELEASE)\n"
      "                         (lib/kvhost/libkvhost_nixl.so) instead of NIXL directly,\n"
      "                         with the same NIXL settings\n"
      "  --raw                  after every request, copy the same blocks the raw way\n"
      "                         (memcpy with --procs 1, process_vm_writev/readv with 2),\n"
      "                         as kvhost bench does, and add its rate (Base) and the\n"
      "                         median per-iteration ratio of raw copy time to request\n"
      "                         time (Eff.); B/W is then bytes over request time only\n");
}

Options parse(int argc, char **argv) {
  Options o;
  for (uint64_t b = 4096; b <= (64ull << 20); b *= 4) o.blocks.push_back(b);
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) die("%s needs a value", a);
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else if (a == "--procs") {
      o.procs = std::atoi(val().c_str());
      if (o.procs != 1 && o.procs != 2) die("--procs must be 1 or 2");
    } else if (a == "--ops") {
      o.ops = split(val());
      for (auto &x : o.ops)
        if (x != "WRITE" && x != "READ") die("unknown op %s", x);
    } else if (a == "--paths") {
      o.paths = split(val());
      for (auto &x : o.paths)
        if (x != "prepped" && x != "batch") die("unknown path %s", x);
    } else if (a == "--blocks") {
      o.blocks.clear();
      for (auto &x : split(val())) o.blocks.push_back(parse_size(x));
    } else if (a == "--batches") {
      o.batches.clear();
      for (auto &x : split(val())) o.batches.push_back(parse_size(x));
    } else if (a == "--max-buffer") {
      o.max_buffer = parse_size(val());
    } else if (a == "--seconds") {
      o.seconds = std::atof(val().c_str());
    } else if (a == "--min-iters") {
      o.min_iters = std::max(1, std::atoi(val().c_str()));
    } else if (a == "--warmup") {
      o.warmup = std::max(0, std::atoi(val().c_str()));
    } else if (a == "--progress-thread") {
      o.progress_thread = true;
    } else if (a == "--progress-delay-us") {
      o.progress_delay_us = parse_size(val());
    } else if (a == "--sync") {
      std::string v = val();
      if (v == "rw") o.sync = nixl_thread_sync_t::NIXL_THREAD_SYNC_RW;
      else if (v == "strict") o.sync = nixl_thread_sync_t::NIXL_THREAD_SYNC_STRICT;
      else die("--sync wants rw or strict, got %s", v);
    } else if (a == "--backend") {
      o.backend = val();
    } else if (a == "--plugin") {
      o.plugin = val();
    } else if (a == "--raw") {
      o.raw = true;
    } else if (a == "--submit") {
      o.submit = true;
    } else if (a == "--param") {
      std::string kv = val();
      size_t eq = kv.find('=');
      if (eq == std::string::npos || eq == 0) die("--param wants key=value, got %s", kv);
      o.bparams[kv.substr(0, eq)] = kv.substr(eq + 1);
    } else {
      die("unknown option %s (try --help)", a);
    }
  }
  // In one process the initiator's thread never progresses the target
  // agent, and UCX's connection set-up needs both: without a progress
  // thread the first transfer would wait forever.
  if (o.procs == 1 && !o.progress_thread)
    die("--procs 1 needs --progress-thread (nothing else makes progress for the target agent)");
  return o;
}

uint64_t buffer_size(const Options &o) {
  uint64_t need = 0;
  for (uint64_t b : o.blocks)
    for (uint64_t n : o.batches)
      if (b * n <= o.max_buffer) need = std::max(need, b * n);
  if (need == 0) die("every block x batch exceeds --max-buffer");
  return need;
}

// One agent with one registered DRAM buffer, and the per-request steps the
// benchmark times. Two implementations: NIXL's C++ API directly, and the
// kvhost plugin ABI (--plugin).
class Engine {
 public:
  virtual ~Engine() = default;
  uint8_t *buf = nullptr;
  uint64_t size = 0;

  virtual std::string md() = 0;
  virtual std::string load(const std::string &md) = 0;  // returns the peer name
  // Serving side: drain notifications (which makes progress).
  virtual void drain() = 0;
  // Per row, on the initiator: batch descriptors of block bytes from the
  // starts of both buffers.
  virtual void begin_row(const std::string &peer, uintptr_t remote_buf, uint64_t remote_size,
                         const std::string &path, uint64_t block, uint64_t batch) = 0;
  virtual void end_row() = 0;
  // One request: make it; post (true when done); poll (true when done);
  // release.
  virtual void make(bool write, bool prepped) = 0;
  virtual bool post() = 0;
  virtual bool poll() = 0;
  virtual void release() = 0;

 protected:
  void alloc(uint64_t n) {
    size = n;
    buf = static_cast<uint8_t *>(std::aligned_alloc(4096, size));
    if (!buf) die("out of memory");
    std::memset(buf, 0, size);
  }
};

class NixlEngine : public Engine {
 public:
  NixlEngine(const std::string &name, const Options &o, uint64_t n) {
    nixlAgentConfig cfg(o.progress_thread, false, default_comm_port, o.sync, 1,
                        o.progress_delay_us, nixlAgentConfig::kDefaultLthrDelayUs, true);
    agent_ = std::make_unique<nixlAgent>(name, cfg);
    nixlBackendH *bh = nullptr;
    check(agent_->createBackend(o.backend, o.bparams, bh), "createBackend");
    alloc(n);
    check(agent_->registerMem(reg()), "registerMem");
  }
  ~NixlEngine() override {
    agent_->deregisterMem(reg());
    agent_.reset();
    std::free(buf);
  }
  std::string md() override {
    nixl_blob_t b;
    check(agent_->getLocalMD(b), "getLocalMD");
    return b;
  }
  std::string load(const std::string &md) override {
    std::string name;
    check(agent_->loadRemoteMD(md, name), "loadRemoteMD");
    return name;
  }
  void drain() override {
    nixl_notifs_t n;
    check(agent_->getNotifs(n), "getNotifs");
  }
  void begin_row(const std::string &peer, uintptr_t remote_buf, uint64_t, const std::string &path,
                 uint64_t block, uint64_t batch) override {
    peer_ = peer;
    remote_buf_ = remote_buf;
    block_ = block;
    batch_ = batch;
    build(ld_, rd_);
    idx_.resize(batch);
    for (uint64_t i = 0; i < batch; i++) idx_[i] = static_cast<int>(i);
    if (path == "prepped") {
      check(agent_->prepXferDlist(NIXL_INIT_AGENT, ld_, lh_), "prepXferDlist local");
      check(agent_->prepXferDlist(peer_, rd_, rh_), "prepXferDlist remote");
    }
  }
  void end_row() override {
    if (lh_) agent_->releasedDlistH(lh_);
    if (rh_) agent_->releasedDlistH(rh_);
    lh_ = rh_ = nullptr;
  }
  void make(bool write, bool prepped) override {
    nixl_xfer_op_t op = write ? NIXL_WRITE : NIXL_READ;
    if (prepped) {
      check(agent_->makeXferReq(op, lh_, idx_, rh_, idx_, req_), "makeXferReq");
    } else {
      nixl_xfer_dlist_t ld(DRAM_SEG), rd(DRAM_SEG);
      build(ld, rd);
      check(agent_->createXferReq(op, ld, rd, peer_, req_), "createXferReq");
    }
  }
  bool post() override {
    nixl_status_t s = agent_->postXferReq(req_);
    check(s, "postXferReq");
    return s == NIXL_SUCCESS;
  }
  bool poll() override {
    nixl_status_t s = agent_->getXferStatus(req_);
    check(s, "getXferStatus");
    return s == NIXL_SUCCESS;
  }
  void release() override { check(agent_->releaseXferReq(req_), "releaseXferReq"); }

 private:
  // The row's descriptors: batch blocks from the start of both buffers.
  void build(nixl_xfer_dlist_t &ld, nixl_xfer_dlist_t &rd) const {
    ld = nixl_xfer_dlist_t(DRAM_SEG);
    rd = nixl_xfer_dlist_t(DRAM_SEG);
    ld.reserve(batch_);
    rd.reserve(batch_);
    for (uint64_t i = 0; i < batch_; i++) {
      ld.addDesc(nixlBasicDesc(reinterpret_cast<uintptr_t>(buf) + i * block_, block_, 0));
      rd.addDesc(nixlBasicDesc(remote_buf_ + i * block_, block_, 0));
    }
  }
  nixl_reg_dlist_t reg() const {
    nixl_reg_dlist_t dl(DRAM_SEG);
    dl.addDesc(nixlBlobDesc(reinterpret_cast<uintptr_t>(buf), size, 0, ""));
    return dl;
  }
  std::unique_ptr<nixlAgent> agent_;
  std::string peer_;
  uintptr_t remote_buf_ = 0;
  uint64_t block_ = 0, batch_ = 0;
  nixl_xfer_dlist_t ld_{DRAM_SEG}, rd_{DRAM_SEG};
  std::vector<int> idx_;
  nixlDlistH *lh_ = nullptr, *rh_ = nullptr;
  nixlXferReqH *req_ = nullptr;
};

// The kvhost plugin's function table, loaded once.
const kvp_api *plugin_api(const std::string &path) {
  static const kvp_api *api = nullptr;
  if (api) return api;
  void *lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) die("dlopen %s", dlerror());
  auto get = reinterpret_cast<kvp_status (*)(kvp_get_api_args *)>(dlsym(lib, KVP_ENTRY_SYMBOL));
  if (!get) die("%s has no " KVP_ENTRY_SYMBOL, path);
  kvp_get_api_args a{};
  a.struct_size = KVP_GET_API_ARGS_STRUCT_SIZE;
  a.host_abi_major = KVP_ABI_MAJOR;
  a.host_abi_minor = KVP_ABI_MINOR;
  if (get(&a) != KVP_SUCCESS || !a.api) die("%s does not serve ABI major %d", path, KVP_ABI_MAJOR);
  api = a.api;
  return api;
}

class PluginEngine : public Engine {
 public:
  PluginEngine(const std::string &name, const Options &o, uint64_t n)
      : t_(plugin_api(o.plugin)), submit_(o.submit) {
    if (submit_ && (t_->struct_size < KVP_API_STRUCT_SIZE || !t_->submit_xfer))
      die("--submit: %s has no submit_xfer (an ABI 1.0 plugin)", o.plugin);
    std::vector<std::pair<std::string, std::string>> kv = {
        {"backend", o.backend},
        {"progress_thread", o.progress_thread ? "true" : "false"},
        {"progress_delay_us", std::to_string(o.progress_delay_us)},
        {"sync_mode", o.sync == nixl_thread_sync_t::NIXL_THREAD_SYNC_RW ? "rw" : "strict"}};
    for (auto &b : o.bparams) kv.emplace_back(b.first, b.second);
    std::vector<kvp_param> params;
    for (auto &p : kv) params.push_back({p.first.data(), p.first.size(), p.second.data(), p.second.size()});
    kvp_agent_create_args c{};
    c.struct_size = KVP_AGENT_CREATE_ARGS_STRUCT_SIZE;
    c.name = name.data();
    c.name_len = name.size();
    c.params = params.data();
    c.num_params = params.size();
    ok(t_->agent_create(&c), "agent_create");
    agent_ = c.agent;
    alloc(n);
    kvp_mem_desc d{reinterpret_cast<uint64_t>(buf), size, 0, KVP_MEM_DRAM, 0};
    kvp_register_mem_args r{};
    r.struct_size = KVP_REGISTER_MEM_ARGS_STRUCT_SIZE;
    r.agent = agent_;
    r.descs = &d;
    r.num_descs = 1;
    r.regions = &region_;
    ok(t_->register_mem(&r), "register_mem");
    post_.struct_size = KVP_POST_XFER_ARGS_STRUCT_SIZE;
    post_.agent = agent_;
    poll_.struct_size = KVP_POLL_XFER_ARGS_STRUCT_SIZE;
    poll_.agent = agent_;
    rel_.struct_size = KVP_RELEASE_XFER_ARGS_STRUCT_SIZE;
    rel_.agent = agent_;
  }
  ~PluginEngine() override {
    kvp_deregister_mem_args d{};
    d.struct_size = KVP_DEREGISTER_MEM_ARGS_STRUCT_SIZE;
    d.agent = agent_;
    d.regions = &region_;
    d.num_regions = 1;
    ok(t_->deregister_mem(&d), "deregister_mem");
    kvp_agent_destroy_args a{};
    a.struct_size = KVP_AGENT_DESTROY_ARGS_STRUCT_SIZE;
    a.agent = agent_;
    ok(t_->agent_destroy(&a), "agent_destroy");
    std::free(buf);
  }
  std::string md() override {
    kvp_local_metadata_args m{};
    m.struct_size = KVP_LOCAL_METADATA_ARGS_STRUCT_SIZE;
    m.agent = agent_;
    ok(t_->local_metadata(&m), "local_metadata");
    std::string b(m.size, '\0');
    m.buf = reinterpret_cast<uint8_t *>(&b[0]);
    m.cap = b.size();
    ok(t_->local_metadata(&m), "local_metadata");
    b.resize(m.size);
    return b;
  }
  std::string load(const std::string &md) override {
    kvp_load_remote_args l{};
    l.struct_size = KVP_LOAD_REMOTE_ARGS_STRUCT_SIZE;
    l.agent = agent_;
    l.metadata = reinterpret_cast<const uint8_t *>(md.data());
    l.metadata_len = md.size();
    ok(t_->load_remote(&l), "load_remote");
    return std::string(l.peer_name, l.peer_name_len);
  }
  void drain() override {
    uint8_t b[4096];
    kvp_get_notifs_args g{};
    g.struct_size = KVP_GET_NOTIFS_ARGS_STRUCT_SIZE;
    g.agent = agent_;
    g.buf = b;
    g.cap = sizeof b;
    ok(t_->get_notifs(&g), "get_notifs");
  }
  void begin_row(const std::string &peer, uintptr_t remote_buf, uint64_t remote_size,
                 const std::string &path, uint64_t block, uint64_t batch) override {
    idx_.resize(batch);
    entries_.resize(batch);
    std::vector<kvp_xfer_desc> ld(batch), rd(batch);
    for (uint64_t i = 0; i < batch; i++) {
      idx_[i] = static_cast<int32_t>(i);
      ld[i] = {reinterpret_cast<uint64_t>(buf) + i * block, block, 0, 1, 0};
      rd[i] = {remote_buf + i * block, block, 0, 1, 0};
      entries_[i] = kvp_batch_entry{0, 0, i * block, i * block, block, 0, 0, 1};
    }
    if (path == "prepped") {
      ldl_ = prep("", ld);
      rdl_ = prep(peer, rd);
    } else {
      kvp_remote_region_import_args im{};
      im.struct_size = KVP_REMOTE_REGION_IMPORT_ARGS_STRUCT_SIZE;
      im.agent = agent_;
      im.peer_name = peer.data();
      im.peer_name_len = peer.size();
      im.addr = remote_buf;
      im.len = remote_size;
      im.mem_kind = KVP_MEM_DRAM;
      ok(t_->remote_region_import(&im), "remote_region_import");
      pair_ = {region_, im.rregion};
    }
  }
  void end_row() override {
    for (kvp_dlist *d : {&ldl_, &rdl_}) {
      if (!*d) continue;
      kvp_release_dlist_args r{};
      r.struct_size = KVP_RELEASE_DLIST_ARGS_STRUCT_SIZE;
      r.agent = agent_;
      r.dlist = *d;
      ok(t_->release_dlist(&r), "release_dlist");
      *d = 0;
    }
    if (pair_.remote) {
      kvp_remote_region_release_args r{};
      r.struct_size = KVP_REMOTE_REGION_RELEASE_ARGS_STRUCT_SIZE;
      r.agent = agent_;
      r.rregion = pair_.remote;
      ok(t_->remote_region_release(&r), "remote_region_release");
      pair_.remote = 0;
    }
  }
  void make(bool write, bool prepped) override {
    kvp_op op = write ? KVP_OP_WRITE : KVP_OP_READ;
    if (submit_) {  // made by post(): submit_xfer
      mp_ = {};
      mb_ = {};
      if (prepped) {
        mp_.struct_size = KVP_MAKE_PREPPED_XFER_ARGS_STRUCT_SIZE;
        mp_.agent = agent_;
        mp_.op = op;
        mp_.local_dlist = ldl_;
        mp_.local_indices = idx_.data();
        mp_.num_local_indices = idx_.size();
        mp_.remote_dlist = rdl_;
        mp_.remote_indices = idx_.data();
        mp_.num_remote_indices = idx_.size();
      } else {
        mb_.struct_size = KVP_MAKE_BATCH_XFER_ARGS_STRUCT_SIZE;
        mb_.agent = agent_;
        mb_.op = op;
        mb_.pairs = &pair_;
        mb_.num_pairs = 1;
        mb_.entries = entries_.data();
        mb_.num_entries = entries_.size();
      }
      sub_prepped_ = prepped;
      return;
    }
    if (prepped) {
      kvp_make_prepped_xfer_args m{};
      m.struct_size = KVP_MAKE_PREPPED_XFER_ARGS_STRUCT_SIZE;
      m.agent = agent_;
      m.op = op;
      m.local_dlist = ldl_;
      m.local_indices = idx_.data();
      m.num_local_indices = idx_.size();
      m.remote_dlist = rdl_;
      m.remote_indices = idx_.data();
      m.num_remote_indices = idx_.size();
      ok(t_->make_prepped_xfer(&m), "make_prepped_xfer");
      xfer_ = m.xfer;
    } else {
      kvp_make_batch_xfer_args m{};
      m.struct_size = KVP_MAKE_BATCH_XFER_ARGS_STRUCT_SIZE;
      m.agent = agent_;
      m.op = op;
      m.pairs = &pair_;
      m.num_pairs = 1;
      m.entries = entries_.data();
      m.num_entries = entries_.size();
      ok(t_->make_batch_xfer(&m), "make_batch_xfer");
      xfer_ = m.xfer;
    }
  }
  bool post() override {
    if (submit_) {
      kvp_submit_xfer_args s{};
      s.struct_size = KVP_SUBMIT_XFER_ARGS_STRUCT_SIZE;
      s.prepped = sub_prepped_ ? &mp_ : nullptr;
      s.batch = sub_prepped_ ? nullptr : &mb_;
      ok(t_->submit_xfer(&s), "submit_xfer");
      xfer_ = sub_prepped_ ? mp_.xfer : mb_.xfer;
      released_ = false;
      // Done within the call: one poll-release still finishes it (the
      // host's PollRelease), so a transfer costs two calls either way.
      if (s.status == KVP_SUCCESS) (void)poll();
      return s.status == KVP_SUCCESS;
    }
    post_.xfer = xfer_;
    ok(t_->post_xfer(&post_), "post_xfer");
    return post_.status == KVP_SUCCESS;
  }
  bool poll() override {
    poll_.xfer = xfer_;
    poll_.flags = submit_ ? (KVP_POLL_RELEASE | KVP_POLL_TELEMETRY) : 0;
    ok(t_->poll_xfer(&poll_), "poll_xfer");
    if (poll_.released) released_ = true;
    return poll_.status == KVP_SUCCESS;
  }
  void release() override {
    if (submit_ && released_) return;  // the final poll released it
    rel_.xfer = xfer_;
    ok(t_->release_xfer(&rel_), "release_xfer");
  }

 private:
  void ok(kvp_error *e, const char *what) {
    if (!e) return;
    kvp_error_message_args m{};
    m.struct_size = KVP_ERROR_MESSAGE_ARGS_STRUCT_SIZE;
    m.error = e;
    t_->error_message(&m);
    die("%s", std::string(what) + ": " + std::string(m.message, m.message_len));
  }
  kvp_dlist prep(const std::string &peer, const std::vector<kvp_xfer_desc> &descs) {
    kvp_prep_dlist_args p{};
    p.struct_size = KVP_PREP_DLIST_ARGS_STRUCT_SIZE;
    p.agent = agent_;
    p.peer_name = peer.data();
    p.peer_name_len = peer.size();
    p.mem_kind = KVP_MEM_DRAM;
    p.descs = descs.data();
    p.num_descs = descs.size();
    ok(t_->prep_dlist(&p), "prep_dlist");
    return p.dlist;
  }
  const kvp_api *t_;
  kvp_agent agent_ = 0;
  kvp_region region_ = 0;
  kvp_dlist ldl_ = 0, rdl_ = 0;
  kvp_region_pair pair_{0, 0};
  std::vector<int32_t> idx_;
  std::vector<kvp_batch_entry> entries_;
  kvp_xfer xfer_ = 0;
  bool submit_ = false, sub_prepped_ = false, released_ = false;
  kvp_make_prepped_xfer_args mp_{};
  kvp_make_batch_xfer_args mb_{};
  // Reused args structs of the hot calls, as the Go host keeps them.
  kvp_post_xfer_args post_{};
  kvp_poll_xfer_args poll_{};
  kvp_release_xfer_args rel_{};
};

std::unique_ptr<Engine> make_engine(const std::string &name, const Options &o, uint64_t size) {
  if (o.plugin.empty()) return std::make_unique<NixlEngine>(name, o, size);
  return std::make_unique<PluginEngine>(name, o, size);
}

// Pipes carry length-prefixed blobs between the processes.
void write_blob(int fd, const std::string &s) {
  uint64_t n = s.size();
  if (write(fd, &n, sizeof n) != sizeof n) die("pipe write");
  size_t off = 0;
  while (off < s.size()) {
    ssize_t w = write(fd, s.data() + off, s.size() - off);
    if (w <= 0) die("pipe write");
    off += static_cast<size_t>(w);
  }
}

std::string read_blob(int fd) {
  uint64_t n = 0;
  if (read(fd, &n, sizeof n) != sizeof n) die("pipe read");
  std::string s(n, '\0');
  size_t off = 0;
  while (off < n) {
    ssize_t r = read(fd, &s[off], n - off);
    if (r <= 0) die("pipe read");
    off += static_cast<size_t>(r);
  }
  return s;
}

// The target: serves its memory until the initiator writes "stop" on the
// pipe, meanwhile calling getNotifs every millisecond, which makes progress
// on its side as a KV receiver waiting for notifications would.
void serve(Engine &t, int cmd_fd) {
  for (;;) {
    t.drain();
    pollfd p{cmd_fd, POLLIN, 0};
    if (poll(&p, 1, 1) > 0) {
      if (read_blob(cmd_fd) == "stop") return;
      die("target: unexpected command while serving");
    }
  }
}

double pct(std::vector<double> &v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

double avg(const std::vector<double> &v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

double us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// Fills the source side with a pattern unique to this row and checks that
// the destination matches after the run.
void fill(uint8_t *p, uint64_t n, uint64_t seed) {
  for (uint64_t i = 0; i < n; i += 8) {
    uint64_t v = (i + seed) * 0x9E3779B97F4A7C15ull;
    std::memcpy(p + i, &v, std::min<uint64_t>(8, n - i));
  }
}

// CPU time (user + system) this thread has used, microseconds. Unlike wall
// time it hardly moves when other processes compete for the cores, so the
// CPU cost per request is the steadier measure of overhead on a busy host.
double thread_cpu_us() {
  rusage ru{};
  getrusage(RUSAGE_THREAD, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

// The same from the thread's CPU clock (nanosecond resolution), for
// per-request measurements.
double thread_cpu_ns_us() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

struct Row {
  double gbps, lat, prep_avg, prep_p99, post_avg, post_p99, tx_avg, tx_p99, cpu;
  double base_gbps, eff;  // --raw only
  long iters;
  bool ok;
};

// RawCopy moves a row's blocks without NIXL, as kvhost bench's baseline
// does: memcpy per block when the target lives in this process, else
// process_vm_writev (WRITE) or process_vm_readv (READ) into or out of the
// target process, up to IOV_MAX blocks per system call.
struct RawCopy {
  pid_t pid = 0;            // target process; 0: this one
  uint8_t *local = nullptr;  // the initiator's buffer
  uintptr_t remote = 0;     // the target's buffer, in its address space
  uint64_t block = 0, batch = 0;
  bool write = true;
  std::vector<iovec> liov, riov;

  void begin(pid_t p, uint8_t *l, uintptr_t r, uint64_t b, uint64_t n, bool w) {
    pid = p, local = l, remote = r, block = b, batch = n, write = w;
    liov.resize(n);
    riov.resize(n);
    for (uint64_t i = 0; i < n; i++) {
      liov[i] = iovec{local + i * b, b};
      riov[i] = iovec{reinterpret_cast<void *>(remote + i * b), b};
    }
  }

  void run() {
    if (pid == 0) {
      for (uint64_t i = 0; i < batch; i++) {
        void *dst = write ? riov[i].iov_base : liov[i].iov_base;
        const void *src = write ? liov[i].iov_base : riov[i].iov_base;
        std::memcpy(dst, src, block);
      }
      return;
    }
    for (uint64_t i = 0; i < batch; i += IOV_MAX) {
      unsigned long k = static_cast<unsigned long>(std::min<uint64_t>(IOV_MAX, batch - i));
      ssize_t want = static_cast<ssize_t>(k * block);
      ssize_t got = write ? process_vm_writev(pid, &liov[i], k, &riov[i], k, 0)
                          : process_vm_readv(pid, &liov[i], k, &riov[i], k, 0);
      if (got != want)
        die("raw copy (process_vm_%s) moved less than asked (errno %d)", write ? "writev" : "readv", errno);
    }
  }

  // Zeroes the destination of the row's transfers in the target process
  // (WRITE), so that a raw copy's bytes cannot pass for the transfer's.
  void clear_remote(uint64_t bytes) {
    std::vector<uint8_t> zero(bytes);
    iovec l{zero.data(), bytes}, r{reinterpret_cast<void *>(remote), bytes};
    if (process_vm_writev(pid, &l, 1, &r, 1, 0) != static_cast<ssize_t>(bytes))
      die("clearing the target's buffer (process_vm_writev) failed (errno %d)", "", errno);
  }
};

// Runs one row on the initiator. remote_buf is the target's buffer in the
// target's address space; remote_view is the same buffer when the target
// lives in this process (--procs 1), else nullptr.
Row run_row(Engine &e, const std::string &peer, uintptr_t remote_buf, uint64_t remote_size,
            uint8_t *remote_view, pid_t target_pid, const std::string &op, const std::string &path,
            uint64_t block, uint64_t batch, const Options &o, uint64_t seed) {
  const bool write = op == "WRITE", prepped = path == "prepped";
  e.begin_row(peer, remote_buf, remote_size, path, block, batch);
  // The source of the data: local for WRITE, remote for READ. The remote
  // side is only writable here when it is in this process; with two
  // processes the target filled its buffer with the same pattern.
  uint64_t bytes = block * batch;
  if (write) fill(e.buf, bytes, seed);
  else std::memset(e.buf, 0, bytes);
  if (remote_view) {
    if (!write) fill(remote_view, bytes, seed);
    else std::memset(remote_view, 0, bytes);
  }

  RawCopy raw;
  raw.begin(remote_view ? 0 : target_pid, e.buf, remote_buf, block, batch, write);
  std::vector<double> prep, post, tx, total, rawt, ratio;
  auto one = [&](bool record) {
    auto t0 = Clock::now();
    e.make(write, prepped);
    auto t1 = Clock::now();
    bool done = e.post();
    auto t2 = Clock::now();
    while (!done) done = e.poll();
    auto t3 = Clock::now();
    e.release();
    auto t4 = Clock::now();
    if (record) {
      prep.push_back(us(t1 - t0));
      post.push_back(us(t2 - t1));
      tx.push_back(us(t3 - t1));
      total.push_back(us(t4 - t0));
    }
  };
  // With --raw every iteration also copies the same blocks the raw way,
  // the order alternating, and the CPU time counts the requests only.
  auto raw_one = [&]() {
    auto t0 = Clock::now();
    raw.run();
    rawt.push_back(us(Clock::now() - t0));
  };
  for (int i = 0; i < o.warmup; i++) {
    one(false);
    if (o.raw) raw.run();
  }
  auto start = Clock::now();
  double cpu = 0, cpu_row0 = thread_cpu_us();
  long iters = 0;
  while (iters < o.min_iters ||
         std::chrono::duration<double>(Clock::now() - start).count() < o.seconds) {
    if (!o.raw) {
      one(true);
      iters++;
      continue;
    }
    if (iters % 2) raw_one();
    double c0 = thread_cpu_ns_us();  // the request's CPU time only, as kvhost bench
    one(true);
    cpu += thread_cpu_ns_us() - c0;
    if (!(iters % 2)) raw_one();
    ratio.push_back(rawt.back() / total.back());
    iters++;
  }
  double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  if (!o.raw) cpu = thread_cpu_us() - cpu_row0;

  Row r{};
  r.iters = iters;
  double busy = elapsed;  // what the rate's time is: the loop, or the requests only
  if (o.raw) {
    busy = 0;
    for (double t : total) busy += t / 1e6;
    double raw_busy = 0;
    for (double t : rawt) raw_busy += t / 1e6;
    r.base_gbps = static_cast<double>(bytes) * static_cast<double>(iters) / raw_busy / 1e9;
    r.eff = pct(ratio, 0.5);
  }
  r.gbps = static_cast<double>(bytes) * static_cast<double>(iters) / busy / 1e9;
  r.lat = avg(total);
  r.prep_avg = avg(prep);
  r.prep_p99 = pct(prep, 0.99);
  r.post_avg = avg(post);
  r.post_p99 = pct(post, 0.99);
  r.tx_avg = avg(tx);
  r.tx_p99 = pct(tx, 0.99);
  r.cpu = cpu / static_cast<double>(iters);
  if (o.raw) {
    // The raw copies moved the same bytes: clear the destination and move
    // it once more, so that only the transfer's bytes can pass.
    if (!write) std::memset(e.buf, 0, bytes);
    else if (remote_view) std::memset(remote_view, 0, bytes);
    else raw.clear_remote(bytes);
    e.make(write, prepped);
    bool done = e.post();
    while (!done) done = e.poll();
    e.release();
  }
  // Verify: the destination now holds the pattern.
  std::vector<uint8_t> want(bytes);
  fill(want.data(), bytes, seed);
  if (!write) {
    r.ok = std::memcmp(e.buf, want.data(), bytes) == 0;
  } else if (remote_view) {
    r.ok = std::memcmp(remote_view, want.data(), bytes) == 0;
  } else {
    // Two processes: read the target's bytes back and compare.
    std::memset(e.buf, 0, bytes);
    e.make(false, prepped);
    bool done = e.post();
    while (!done) done = e.poll();
    e.release();
    r.ok = std::memcmp(e.buf, want.data(), bytes) == 0;
  }
  e.end_row();
  return r;
}

// The columns of kvhost bench (with --raw, its Base and Eff. too).
void print_header(const std::string &op, const std::string &path, bool raw) {
  std::printf("\n# op %s, path %s\n", op.c_str(), path.c_str());
  std::printf("%-14s %-10s %-13s %-14s %-14s %-14s %-14s %-14s %-12s %-12s %-12s ", "Block Size (B)",
              "Batch Size", "B/W (GB/Sec)", "Avg Lat. (us)", "Avg Prep (us)", "P99 Prep (us)",
              "Avg Post (us)", "P99 Post (us)", "Avg Tx (us)", "P99 Tx (us)", "CPU/op (us)");
  if (raw) std::printf("%-14s %-6s ", "Base (GB/Sec)", "Eff.");
  std::printf("%-8s %s\n", "Iters", "Verified");
}

void print_row(uint64_t b, uint64_t n, const Row &r, bool raw) {
  std::printf("%-14" PRIu64 " %-10" PRIu64
              " %-13.3f %-14.1f %-14.1f %-14.1f %-14.1f %-14.1f %-12.1f %-12.1f %-12.1f ",
              b, n, r.gbps, r.lat, r.prep_avg, r.prep_p99, r.post_avg, r.post_p99, r.tx_avg,
              r.tx_p99, r.cpu);
  if (raw) std::printf("%-14.3f %-6.3f ", r.base_gbps, r.eff);
  std::printf("%-8ld %s\n", r.iters, r.ok ? "yes" : "NO");
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char **argv) {
  Options o = parse(argc, argv);
  uint64_t size = buffer_size(o);
  std::string params;
  for (auto &kv : o.bparams) params += " " + kv.first + "=" + kv.second;
  std::printf("# nixl-bench-direct: %s, backend %s, %d process(es), progress thread %s "
              "(delay %" PRIu64 " us), sync %s, buffer %" PRIu64 " bytes per side, backend params:%s\n",
              o.plugin.empty() ? "NIXL C++ API directly" : ("through plugin " + o.plugin).c_str(),
              o.backend.c_str(), o.procs, o.progress_thread ? "on" : "off", o.progress_delay_us,
              o.sync == nixl_thread_sync_t::NIXL_THREAD_SYNC_RW ? "rw" : "strict", size,
              params.empty() ? " none" : params.c_str());
  std::fflush(stdout);

  if (o.procs == 1) {
    auto target = make_engine("bench-target", o, size);
    auto init = make_engine("bench-initiator", o, size);
    std::string name = init->load(target->md());
    uint64_t seed = 1;
    bool all_ok = true;
    for (auto &op : o.ops)
      for (auto &path : o.paths) {
        print_header(op, path, o.raw);
        for (uint64_t b : o.blocks)
          for (uint64_t n : o.batches) {
            if (b * n > o.max_buffer) continue;
            Row r = run_row(*init, name, reinterpret_cast<uintptr_t>(target->buf), target->size,
                            target->buf, 0, op, path, b, n, o, seed++);
            all_ok = all_ok && r.ok;
            print_row(b, n, r, o.raw);
          }
      }
    return all_ok ? 0 : 1;
  }

  // Two processes. The target fills its buffer per row on request: rows
  // that READ need the pattern on the target side before they start.
  int to_child[2], to_parent[2];
  if (pipe(to_child) || pipe(to_parent)) die("pipe");
  pid_t pid = fork();
  if (pid < 0) die("fork");
  if (pid == 0) {
    close(to_child[1]);
    close(to_parent[0]);
    auto target = make_engine("bench-target", o, size);
    write_blob(to_parent[1], target->md());
    write_blob(to_parent[1], std::to_string(reinterpret_cast<uintptr_t>(target->buf)));
    // Commands: "fill <bytes> <seed>", "clear <bytes>", "serve" (until
    // "stop"), "exit".
    for (;;) {
      std::string cmd = read_blob(to_child[0]);
      unsigned long long a = 0, b = 0;
      if (std::sscanf(cmd.c_str(), "fill %llu %llu", &a, &b) == 2) {
        fill(target->buf, a, b);
      } else if (std::sscanf(cmd.c_str(), "clear %llu", &a) == 1) {
        std::memset(target->buf, 0, a);
      } else if (cmd == "serve") {
        write_blob(to_parent[1], "serving");
        serve(*target, to_child[0]);
      } else {
        break;
      }
      write_blob(to_parent[1], "ok");
    }
    target.reset();
    _exit(0);
  }
  close(to_child[0]);
  close(to_parent[1]);
  auto init = make_engine("bench-initiator", o, size);
  std::string name = init->load(read_blob(to_parent[0]));
  uintptr_t remote_buf = std::strtoull(read_blob(to_parent[0]).c_str(), nullptr, 10);
  uint64_t seed = 1;
  bool all_ok = true;
  for (auto &op : o.ops)
    for (auto &path : o.paths) {
      print_header(op, path, o.raw);
      for (uint64_t b : o.blocks)
        for (uint64_t n : o.batches) {
          if (b * n > o.max_buffer) continue;
          char cmd[128];
          if (op == "READ")
            std::snprintf(cmd, sizeof cmd, "fill %llu %llu", static_cast<unsigned long long>(b * n),
                          static_cast<unsigned long long>(seed));
          else
            std::snprintf(cmd, sizeof cmd, "clear %llu", static_cast<unsigned long long>(b * n));
          write_blob(to_child[1], cmd);
          read_blob(to_parent[0]);
          write_blob(to_child[1], "serve");
          read_blob(to_parent[0]);
          Row r = run_row(*init, name, remote_buf, size, nullptr, pid, op, path, b, n, o, seed++);
          write_blob(to_child[1], "stop");
          read_blob(to_parent[0]);
          all_ok = all_ok && r.ok;
          print_row(b, n, r, o.raw);
        }
    }
  write_blob(to_child[1], "exit");
  int st = 0;
  waitpid(pid, &st, 0);
  return all_ok ? 0 : 1;
}
