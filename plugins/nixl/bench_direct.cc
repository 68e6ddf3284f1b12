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
// makeXferReq over dlists prepared once, outside the timing; batch:
// createXferReq from descriptors), post it, poll it to completion, release
// it. Columns follow nixlbench: block and batch size, bandwidth, average
// latency per iteration, and average/p99 of the prep (request build), post and
// transfer (post to completion) phases, and the initiator thread's CPU time
// per request (steadier than wall time on a shared machine). The bytes of
// the last iteration are verified.
//
// Build: make plugin-nixl NIXL_PREFIX=... (builds bin/nixl-bench-direct).
// Run:   bin/nixl-bench-direct --help

#include <nixl.h>

#include <poll.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
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
      "  --procs 1|2            agents in one process or two (default 2)\n"
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
      "                         --param ucx_error_handling_mode=none\n");
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
    } else if (a == "--param") {
      std::string kv = val();
      size_t eq = kv.find('=');
      if (eq == std::string::npos || eq == 0) die("--param wants key=value, got %s", kv);
      o.bparams[kv.substr(0, eq)] = kv.substr(eq + 1);
    } else {
      die("unknown option %s (try --help)", a);
    }
  }
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

// One agent with its backend and one registered DRAM buffer.
struct Side {
  std::unique_ptr<nixlAgent> agent;
  uint8_t *buf = nullptr;
  uint64_t size = 0;

  Side(const std::string &name, const Options &o, uint64_t size_) : size(size_) {
    nixlAgentConfig cfg(o.progress_thread, false, default_comm_port, o.sync, 1,
                        o.progress_delay_us, nixlAgentConfig::kDefaultLthrDelayUs, true);
    agent = std::make_unique<nixlAgent>(name, cfg);
    nixlBackendH *bh = nullptr;
    check(agent->createBackend(o.backend, o.bparams, bh), "createBackend");
    buf = static_cast<uint8_t *>(std::aligned_alloc(4096, size));
    if (!buf) die("out of memory");
    std::memset(buf, 0, size);
    nixl_reg_dlist_t dl(DRAM_SEG);
    dl.addDesc(nixlBlobDesc(reinterpret_cast<uintptr_t>(buf), size, 0, ""));
    check(agent->registerMem(dl), "registerMem");
  }
  ~Side() {
    nixl_reg_dlist_t dl(DRAM_SEG);
    dl.addDesc(nixlBlobDesc(reinterpret_cast<uintptr_t>(buf), size, 0, ""));
    agent->deregisterMem(dl);
    agent.reset();
    std::free(buf);
  }
  std::string md() const {
    nixl_blob_t b;
    check(agent->getLocalMD(b), "getLocalMD");
    return b;
  }
};

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
void serve(Side &t, int cmd_fd) {
  for (;;) {
    nixl_notifs_t n;
    check(t.agent->getNotifs(n), "getNotifs");
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

struct Row {
  double gbps, lat, prep_avg, prep_p99, post_avg, post_p99, tx_avg, tx_p99, cpu;
  long iters;
  bool ok;
};

// Runs one row. local/remote are the initiator's and target's buffers as
// seen by the initiator (remote_buf is an address in the target process).
Row run_row(nixlAgent &ag, const std::string &peer, uint8_t *local_buf, uintptr_t remote_buf,
            uint8_t *remote_view, const std::string &op, const std::string &path, uint64_t block,
            uint64_t batch, const Options &o, uint64_t seed) {
  nixl_xfer_op_t xop = op == "WRITE" ? NIXL_WRITE : NIXL_READ;
  nixl_xfer_dlist_t ld(DRAM_SEG), rd(DRAM_SEG);
  ld.reserve(batch);
  rd.reserve(batch);
  for (uint64_t i = 0; i < batch; i++) {
    ld.addDesc(nixlBasicDesc(reinterpret_cast<uintptr_t>(local_buf) + i * block, block, 0));
    rd.addDesc(nixlBasicDesc(remote_buf + i * block, block, 0));
  }
  nixlDlistH *lh = nullptr, *rh = nullptr;
  std::vector<int> idx(batch);
  for (uint64_t i = 0; i < batch; i++) idx[i] = static_cast<int>(i);
  if (path == "prepped") {
    check(ag.prepXferDlist(NIXL_INIT_AGENT, ld, lh), "prepXferDlist local");
    check(ag.prepXferDlist(peer, rd, rh), "prepXferDlist remote");
  }
  // The source of the data: local for WRITE, remote for READ. The remote
  // side is only writable here when it is in this process (--procs 1); with
  // two processes the target filled its buffer with the same pattern.
  uint64_t bytes = block * batch;
  if (xop == NIXL_WRITE) fill(local_buf, bytes, seed);
  else std::memset(local_buf, 0, bytes);
  if (remote_view) {
    if (xop == NIXL_READ) fill(remote_view, bytes, seed);
    else std::memset(remote_view, 0, bytes);
  }

  std::vector<double> prep, post, tx, total;
  auto one = [&](bool record) {
    auto t0 = Clock::now();
    nixlXferReqH *req = nullptr;
    if (path == "prepped")
      check(ag.makeXferReq(xop, lh, idx, rh, idx, req), "makeXferReq");
    else
      check(ag.createXferReq(xop, ld, rd, peer, req), "createXferReq");
    auto t1 = Clock::now();
    nixl_status_t s = ag.postXferReq(req);
    check(s, "postXferReq");
    auto t2 = Clock::now();
    while (s == NIXL_IN_PROG) s = ag.getXferStatus(req);
    check(s, "getXferStatus");
    auto t3 = Clock::now();
    check(ag.releaseXferReq(req), "releaseXferReq");
    auto t4 = Clock::now();
    if (record) {
      prep.push_back(us(t1 - t0));
      post.push_back(us(t2 - t1));
      tx.push_back(us(t3 - t1));
      total.push_back(us(t4 - t0));
    }
  };
  for (int i = 0; i < o.warmup; i++) one(false);
  auto start = Clock::now();
  double cpu0 = thread_cpu_us();
  long iters = 0;
  while (iters < o.min_iters ||
         std::chrono::duration<double>(Clock::now() - start).count() < o.seconds) {
    one(true);
    iters++;
  }
  double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  double cpu = thread_cpu_us() - cpu0;
  if (lh) ag.releasedDlistH(lh);
  if (rh) ag.releasedDlistH(rh);

  Row r{};
  r.iters = iters;
  r.gbps = static_cast<double>(bytes) * static_cast<double>(iters) / elapsed / 1e9;
  r.lat = avg(total);
  r.prep_avg = avg(prep);
  r.prep_p99 = pct(prep, 0.99);
  r.post_avg = avg(post);
  r.post_p99 = pct(post, 0.99);
  r.tx_avg = avg(tx);
  r.tx_p99 = pct(tx, 0.99);
  r.cpu = cpu / static_cast<double>(iters);
  // Verify: the destination now holds the pattern.
  std::vector<uint8_t> want(bytes);
  fill(want.data(), bytes, seed);
  if (xop == NIXL_READ) r.ok = std::memcmp(local_buf, want.data(), bytes) == 0;
  else if (remote_view) r.ok = std::memcmp(remote_view, want.data(), bytes) == 0;
  else {
    // Two processes: read the target's bytes back and compare.
    std::vector<uint8_t> back(bytes);
    std::memset(local_buf, 0, bytes);
    nixlXferReqH *req = nullptr;
    check(ag.createXferReq(NIXL_READ, ld, rd, peer, req), "createXferReq verify");
    nixl_status_t s = ag.postXferReq(req);
    while (s == NIXL_IN_PROG) s = ag.getXferStatus(req);
    check(s, "verify read");
    ag.releaseXferReq(req);
    r.ok = std::memcmp(local_buf, want.data(), bytes) == 0;
  }
  return r;
}

void print_header(const std::string &op, const std::string &path) {
  std::printf("\n# op %s, path %s\n", op.c_str(), path.c_str());
  std::printf("%-14s %-10s %-13s %-14s %-14s %-14s %-14s %-14s %-12s %-12s %-12s %-8s %s\n",
              "Block Size (B)", "Batch Size", "B/W (GB/Sec)", "Avg Lat. (us)", "Avg Prep (us)",
              "P99 Prep (us)", "Avg Post (us)", "P99 Post (us)", "Avg Tx (us)", "P99 Tx (us)",
              "CPU/op (us)", "Iters", "Verified");
}

}  // namespace

int main(int argc, char **argv) {
  Options o = parse(argc, argv);
  uint64_t size = buffer_size(o);
  std::string params;
  for (auto &kv : o.bparams) params += " " + kv.first + "=" + kv.second;
  std::printf("# nixl-bench-direct: backend %s, %d process(es), progress thread %s, sync %s, "
              "buffer %" PRIu64 " bytes per side, backend params:%s\n",
              o.backend.c_str(), o.procs, o.progress_thread ? "on" : "off",
              o.sync == nixl_thread_sync_t::NIXL_THREAD_SYNC_RW ? "rw" : "strict", size,
              params.empty() ? " none" : params.c_str());
  std::fflush(stdout);

  if (o.procs == 1) {
    Side target("bench-target", o, size);
    Side init("bench-initiator", o, size);
    std::string name;
    check(init.agent->loadRemoteMD(target.md(), name), "loadRemoteMD");
    uint64_t seed = 1;
    bool all_ok = true;
    for (auto &op : o.ops)
      for (auto &path : o.paths) {
        print_header(op, path);
        for (uint64_t b : o.blocks)
          for (uint64_t n : o.batches) {
            if (b * n > o.max_buffer) continue;
            Row r = run_row(*init.agent, name, init.buf, reinterpret_cast<uintptr_t>(target.buf),
                            target.buf, op, path, b, n, o, seed++);
            all_ok = all_ok && r.ok;
            std::printf("%-14" PRIu64 " %-10" PRIu64
                        " %-13.3f %-14.1f %-14.1f %-14.1f %-14.1f %-14.1f %-12.1f %-12.1f %-12.1f %-8ld %s\n",
                        b, n, r.gbps, r.lat, r.prep_avg, r.prep_p99, r.post_avg, r.post_p99,
                        r.tx_avg, r.tx_p99, r.cpu, r.iters, r.ok ? "yes" : "NO");
            std::fflush(stdout);
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
    Side target("bench-target", o, size);
    write_blob(to_parent[1], target.md());
    write_blob(to_parent[1], std::to_string(reinterpret_cast<uintptr_t>(target.buf)));
    // Commands: "fill <bytes> <seed>", "clear <bytes>", "serve" (until
    // "stop"), "exit".
    for (;;) {
      std::string cmd = read_blob(to_child[0]);
      unsigned long long a = 0, b = 0;
      if (std::sscanf(cmd.c_str(), "fill %llu %llu", &a, &b) == 2) {
        fill(target.buf, a, b);
      } else if (std::sscanf(cmd.c_str(), "clear %llu", &a) == 1) {
        std::memset(target.buf, 0, a);
      } else if (cmd == "serve") {
        write_blob(to_parent[1], "serving");
        serve(target, to_child[0]);
      } else {
        break;
      }
      write_blob(to_parent[1], "ok");
    }
    _exit(0);
  }
  close(to_child[0]);
  close(to_parent[1]);
  Side init("bench-initiator", o, size);
  std::string name;
  check(init.agent->loadRemoteMD(read_blob(to_parent[0]), name), "loadRemoteMD");
  uintptr_t remote_buf = std::strtoull(read_blob(to_parent[0]).c_str(), nullptr, 10);
  uint64_t seed = 1;
  bool all_ok = true;
  for (auto &op : o.ops)
    for (auto &path : o.paths) {
      print_header(op, path);
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
          Row r = run_row(*init.agent, name, init.buf, remote_buf, nullptr, op, path, b, n, o,
                          seed++);
          write_blob(to_child[1], "stop");
          read_blob(to_parent[0]);
          all_ok = all_ok && r.ok;
          std::printf("%-14" PRIu64 " %-10" PRIu64
                      " %-13.3f %-14.1f %-14.1f %-14.1f %-14.1f %-14.1f %-12.1f %-12.1f %-12.1f %-8ld %s\n",
                      b, n, r.gbps, r.lat, r.prep_avg, r.prep_p99, r.post_avg, r.post_p99, r.tx_avg,
                      r.tx_p99, r.cpu, r.iters, r.ok ? "yes" : "NO");
          std::fflush(stdout);
        }
    }
  write_blob(to_child[1], "exit");
  int st = 0;
  waitpid(pid, &st, 0);
  return all_ok ? 0 : 1;
}
