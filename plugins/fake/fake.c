/*
 * fake.c: the kvhost "fake" transfer backend (ABI v1, see abi/kvplugin.h).
 *
 * Real byte movement without vendor libraries, for CI, laptops and tests:
 *   - agents of one process copy with memcpy; agents of different processes
 *     on one host copy with process_vm_writev / process_vm_readv, or with
 *     memcpy through a mapping of the peer's memory where it is a memfd
 *     sealed against shrinking (see "Peer memory mapped" in the README);
 *   - transfers complete asynchronously, so poll_xfer really reports
 *     KVP_IN_PROG before KVP_SUCCESS: the caller's later polls move them
 *     in bounded slices, and per-agent worker threads take over what
 *     nobody polls (see "Scheduling" below);
 *   - notifications reach the remote agent after every byte landed: directly
 *     into its queue in this process, else over a unix datagram socket in
 *     the abstract namespace whose name travels in the metadata, without
 *     ever blocking a poll or a worker (see "Notification outboxes"); the
 *     receiver checks the kernel-reported sender (notif_sender_ok);
 *   - load_remote proves that metadata is the described agent's own before
 *     any byte can move to the process it names (md_verify), and a loaded
 *     peer name keeps its identity (fake_load_remote);
 *   - every block is checked against registered (local) or advertised
 *     (remote) memory before any byte moves;
 *   - fault injection and capability switches through agent parameters
 *     (see PARAMS_DOC).
 *
 * C11, libc and pthreads only. Memory kinds DRAM and VRAM are both host
 * memory here.
 *
 * Concurrency. Plugin-wide state is five handle tables (one per handle kind)
 * and two process identity values, set once. Each agent has:
 *   mem_lock   (rwlock)  its registration table; writers: register/deregister;
 *                        readers: validation and a transfer's runner while it
 *                        copies a slice, so memory cannot be deregistered
 *                        under a copy;
 *   peers_lock (rwlock)  its loaded peers and their metadata;
 *   own_lock   (mutex)   the lists of handles it owns (for destroy/remove)
 *                        and its cache of released transfers;
 *   qlock      (mutex)   its transfer queue, transfer states and telemetry
 *                        (read without it once a run has ended, see xfer);
 *   ob_lock    (mutex)   its peers' notification outboxes;
 *   md_lock    (mutex)   the digests of metadata it vouches for (a leaf).
 * No thread holds two of these at once, except a runner that read-locks the
 * mem_lock of its own agent and of a same-process peer, always in address
 * order; the rx thread, which finishes transfers (qlock) under ob_lock; and
 * local_metadata and deregister_mem, which take md_lock under mem_lock. Handle lookups take no lock (kvp_util); the tables' mutexes (insert
 * and remove only) are leaves. Every API call holds a reference
 * on the agent handle it names (and on other handles it uses) for its whole
 * duration, so a concurrent destroy or release waits for it.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "kvp_util.h"
#include "kvplugin.h"

/* AddressSanitizer cannot see a use after free of memory an agent keeps
 * for reuse (released transfers, see xfer_alloc): poison it while it is
 * cached, so ASan builds still catch such a use. No-ops otherwise. */
#if defined(__has_feature)
#if __has_feature(address_sanitizer) && !defined(__SANITIZE_ADDRESS__)
#define __SANITIZE_ADDRESS__ 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define FAKE_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define FAKE_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define FAKE_POISON(p, n) ((void)(p), (void)(n))
#define FAKE_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

/* The ABI major this build claims. A test build sets it to another value to
 * show that hosts refuse it. */
#ifndef KVP_FAKE_ABI_MAJOR
#define KVP_FAKE_ABI_MAJOR KVP_ABI_MAJOR
#endif
/* The ABI minor this build claims. A test build sets 0 to be an ABI 1.0
 * plugin: a 1.0-sized table without submit_xfer and get_event_fd, no
 * KVP_CAP_EVENT_FD or KVP_CAP_SUBMIT, and poll_xfer ignoring the 1.1
 * fields, so that hosts can show they emulate what it lacks. */
#ifndef KVP_FAKE_ABI_MINOR
#define KVP_FAKE_ABI_MINOR KVP_ABI_MINOR
#endif
#if KVP_FAKE_ABI_MINOR >= 1
#define FAKE_CAPS_1_1 (KVP_CAP_EVENT_FD | KVP_CAP_SUBMIT)
#define FAKE_API_SIZE KVP_API_STRUCT_SIZE
#else
#define FAKE_CAPS_1_1 0
#define FAKE_API_SIZE KVP_API_STRUCT_SIZE_1_0
#endif

#define FAKE_VERSION "1.0.0"
#define FAKE_CAPS                                                                      \
  (KVP_CAP_PREPPED | KVP_CAP_BATCH | KVP_CAP_STRIDED | KVP_CAP_NOTIF | KVP_CAP_TELEMETRY | \
   KVP_CAP_REMOTE_ADDR | KVP_CAP_REMOTE_BLOB | FAKE_CAPS_1_1)
#define FAKE_MEM_KINDS (KVP_MEM_BIT(KVP_MEM_DRAM) | KVP_MEM_BIT(KVP_MEM_VRAM))

/* Largest notification message (bytes). Cross-process notifications travel
 * as one datagram, and 64 KiB plus a header fits the default socket buffer
 * (net.core.wmem_default, 208 KiB). The same limit holds in-process. */
#define FAKE_MAX_NOTIF (64u * 1024u)
/* Received notifications an agent keeps while nobody drains them. */
#define FAKE_NQ_MAX_BYTES (64u * 1024u * 1024u)
/* Scheduling (see poll_drive and worker_next). A transfer without delay_us
 * is "pollable": the caller's polls move it, one slice of at most
 * FAKE_SLICE_BYTES per poll from the second poll after the post on (no
 * cross-thread hand-off, warm caches, and no other thread competing with a
 * spinning caller for the CPU). FAKE_GRACE_NS after its post, or after the
 * last slice a poll ran, with nobody polling, a worker takes it over and
 * runs the rest, so transfers nobody polls still complete and notify.
 * Transfers of an agent with delay_us go to a worker at once ("urgent").
 * In event mode (from the agent's first get_event_fd on) no transfer is
 * pollable: a post runs the first slice itself (post_here), so one that
 * fits is done when the post returns; what is left of a larger one, and
 * every transfer with delay_us or a drawn failure, is urgent.
 * After running a transfer a worker spins FAKE_SPIN_NS for the next urgent
 * one before it sleeps; while the agent is active (a post or a slice within
 * FAKE_ACTIVE_NS, or a poll running a slice) an idle worker sleeps at most
 * FAKE_GRACE_NS at a time, so neither posting nor requeueing a pollable
 * transfer needs a futex wake-up. */
#define FAKE_SLICE_BYTES (16ull << 20)
#define FAKE_GRACE_NS 1000000ull
#define FAKE_SPIN_NS 20000ull
#define FAKE_ACTIVE_NS 20000000ull
/* How long a notification may wait in its peer's outbox (see "Notification
 * outboxes") before its transfer fails, or, for send_notif, it is dropped
 * and counted. Nothing waits for it: not the poll, not a worker. */
#define FAKE_SEND_TIMEOUT_S 2
/* Bounds of one peer's outbox: queued notifications and their bytes. */
#define FAKE_OB_MAX_ENTRIES 1024u
#define FAKE_OB_MAX_BYTES (8u * 1024u * 1024u)
/* How long load_remote waits for a cross-process peer to answer the
 * challenge that proves the metadata is its own (see md_verify). */
#define FAKE_VERIFY_TIMEOUT_MS 5000
/* Digests of the metadata an agent handed out that it still vouches for
 * (the last FAKE_MD_RING; a deregistration forgets them all). */
#define FAKE_MD_RING 16
/* Senders of notifications that are not loaded peers: names an agent pins
 * to the process that first used them (see notif_sender_ok). */
#define FAKE_PINS 256
#define FAKE_PINS_PER_PID 16
/* process_vm_* moves at most MAX_RW_COUNT (~2 GiB) per call; stay below. */
#define FAKE_PVM_MAX_BYTES (1ull << 30)
/* Peer memory mapped into this process (see rmap), at most this much and
 * this many mappings per process: an eighth of x86-64's 47-bit user
 * address space, and a quarter of the kernel's default vm.max_map_count.
 * Regions beyond either keep process_vm_*. */
#define FAKE_MAP_MAX_BYTES (16ull << 40)
#define FAKE_MAP_MAX_COUNT 16384u
/* statfs f_type of hugetlbfs (linux/magic.h): its files can be sealed
 * too, but a fault with no huge page left takes SIGBUS. */
#define FAKE_HUGETLBFS_MAGIC 0x958458f6ul
#ifdef IOV_MAX
#define FAKE_IOV_MAX IOV_MAX
#else
#define FAKE_IOV_MAX 1024
#endif

/* Wire formats (all integers little endian). */
#define MD_MAGIC "KVFM"
#define MD_VERSION 1
#define MD_VERSION_FILES 2 /* v1 and the regions' files (see md_decode) */
#define MD_FIXED 56
#define MD_REGION 32
#define MD_FILES_HDR 8
#define MD_FILE 32
#define BLOB_MAGIC "KVFR"
#define BLOB_VERSION 1
#define BLOB_SIZE 48
#define MD_FLAG_NO_NOTIF 1u /* the agent switched notifications off */
#define NOTIF_MAGIC "KVFN"
#define NOTIF_VERSION 2
#define NOTIF_FIXED 26
#define CHAL_MAGIC "KVFC"
#define CHAL_SIZE 64
#define ANSWER_MAGIC "KVFA"
#define ANSWER_SIZE 40
enum { VOUCH_YES = 0, VOUCH_NO = 1, VOUCH_NOT_ME = 2 };

static const char PARAMS_DOC[] =
    "caps_off=\tcomma list of capabilities this agent switches off, so the host emulates "
    "them: prepped, batch, strided, notif, telemetry, remote_addr, remote_blob, event_fd, submit (not both "
    "prepped and batch); the agent refuses their calls with KVP_ERR_NOT_SUPPORTED\n"
    "fail_rate=0\tprobability in [0,1] that a posted transfer fails with KVP_ERR_BACKEND "
    "\"fake: injected failure\" after moving half of its bytes\n"
    "fail_seed=1\tseed of the pseudo-random draws of fail_rate and drop_notif_rate "
    "(same seed, same sequence of posts: same outcomes)\n"
    "delay_us=0\tmicroseconds each transfer waits on its worker before it moves bytes "
    "(0..60000000)\n"
    "drop_notif_rate=0\tprobability in [0,1] that the notification of a successful "
    "transfer is silently dropped\n"
    "workers=1\tworker threads per agent (1..64); they take over transfers nobody polls, and "
    "run every transfer with delay_us or a drawn fail_rate failure and, once the event "
    "descriptor was asked for (get_event_fd), the rest of a transfer larger than the 16 MiB "
    "slice its post moves: raise it to run that many at once\n"
    "num_threads=0\tbackend worker threads (0..64), the nixl plugin's parameter that the host "
    "sets per side (plugin.ForSide); the fake checks the value and otherwise ignores it, so "
    "tests can see the host's defaults reach a plugin\n"
    "prefault=true\tbefore registering memory, have the kernel read one byte of every page of it "
    "(process_vm_writev from it into a scratch buffer), so that the kernel's first access to each "
    "page, which a cross-process copy (process_vm_writev/readv) makes through this process's "
    "addresses, happens at registration and not inside the first transfers; on a VM that shadows "
    "page tables it cost about 4.6 us per 4 KiB page. Only reads. Memory the agent copies with memcpy "
    "(registered memory in a sealed memfd; a peer's mapped memory, at load_remote) is also touched once "
    "from user space, by an atomic add of zero per page: the first user-mode access to a page of a "
    "mapping pays the same there. false does neither\n";

static const char *const PARAM_KEYS[] = {"caps_off", "fail_rate", "fail_seed",
                                         "delay_us", "drop_notif_rate", "workers",
                                         "num_threads", "prefault"};
#define NUM_PARAM_KEYS (sizeof PARAM_KEYS / sizeof PARAM_KEYS[0])

/* Names of the KVP_CAP_* bits, bit i = names[i]. */
static const char *const CAP_NAMES[] = {"prepped",     "batch",       "strided",  "notif", "telemetry",
                                        "remote_addr", "remote_blob", "event_fd", "submit"};
#define NUM_CAPS (sizeof CAP_NAMES / sizeof CAP_NAMES[0])

/* ------------------------------------------------------------------------ */
/* Types                                                                    */
/* ------------------------------------------------------------------------ */

struct agent;
struct peer;

/* Intrusive list link: first member of every object an agent owns. */
typedef struct own_link {
  struct own_link *prev, *next;
} own_link;

/* A range-table element (kvp_range prefix: addr, len). */
typedef struct mem_range {
  uint64_t addr, len, dev_id;
  uint32_t kind;
  uint32_t pad;
  struct region *reg; /* the local region; NULL in peer metadata */
} mem_range;

/* Memory registered on a local agent. Immutable after creation. */
typedef struct region {
  own_link link;
  struct agent *ag;
  uint64_t handle;
  uint64_t addr, len, dev_id;
  kvp_mem_kind kind;
  /* The memory may vanish under a copy (see range_may_fault): copies
   * touching the agent then go through copy_checked. */
  int may_fault;
  /* A descriptor of the sealed memfd the region maps (see
   * region_sealed_file), or -1: the memory cannot vanish, and its number,
   * device, inode and the file offset of the region's start travel in the
   * metadata (v2), so that a peer in another process can take the file
   * (pidfd_getfd) and map it ("Peer memory mapped"). Closed with the
   * region. */
  int file_fd;
  uint64_t file_dev, file_ino, file_off;
} region;

/* A region's file as metadata v2 advertises it (see md_decode). */
typedef struct md_file {
  uint32_t region; /* index into the regions */
  uint32_t fd;     /* the descriptor number in the agent's process */
  uint64_t dev, ino, off;
} md_file;

/* A peer's metadata, decoded. Immutable; replaced as a whole on reload. */
typedef struct peer_md {
  uint64_t process_token, pidns, agent_id, agent_handle;
  uint32_t pid;
  uint16_t flags;
  char name[KVP_MAX_NAME_LEN];
  size_t name_len;
  char sock[sizeof(((struct sockaddr_un *)0)->sun_path)];
  size_t sock_len;
  size_t nregions;
  mem_range *regions; /* sorted by addr, non-overlapping */
  size_t nfiles;
  md_file *files; /* sorted by region, at most one per region; v2 only */
} peer_md;

/* A peer region mapped into this process: remote [addr, addr + len) is
 * local [base, base + len), inside the mapping [map, map + map_len) of a
 * sealed memfd (dev, ino) that cannot shrink (see peer_maps_take). */
typedef struct rmap {
  uint64_t addr, len;
  uint8_t *base;
  void *map;
  size_t map_len;
  uint64_t dev, ino;
} rmap;

/* A peer's mapped regions, sorted by addr. Immutable; reference counted:
 * the peer holds one reference, and so does each transfer posted against
 * it (route.maps) until its next post or its retirement, so a reload,
 * remove_remote or agent_destroy never unmaps memory under a running copy;
 * the last reference unmaps. */
typedef struct rmaps {
  atomic_int refs;
  size_t n;
  rmap e[];
} rmaps;

/* A loaded peer. Reference counted: the agent's peer list holds one, and so
 * does every dlist, remote region and transfer that refers to it. name is
 * fixed; md and gen change under the agent's peers_lock (write) on reload.
 * remove_remote takes the peer out of the list and sets removed: the
 * dlists, remote regions and transfers that still refer to it are dead
 * (their handles stay valid until released, see kvp_remove_remote_args),
 * and a peer loaded again under the same name is a new record. */
typedef struct peer {
  struct peer *next; /* peer list, under peers_lock */
  atomic_int refs;
  atomic_int removed; /* set once by remove_remote, before it cancels the
                         peer's transfers under qlock; post checks it
                         under qlock, make_* when they build a transfer */
  uint64_t gen; /* bumped when md is replaced */
  peer_md *md;
  uint8_t digest[32]; /* SHA-256 of the metadata md came from */
  char name[KVP_MAX_NAME_LEN];
  size_t name_len;
  /* Cross-process peers (else -1), fixed at the first load: a pidfd of the
   * process that proved the metadata its own (see md_verify), and a
   * datagram socket connected to its notification socket. */
  int pidfd, tx_fd;
  /* The peer's regions this process mapped (or NULL); replaced with md,
   * under peers_lock. */
  rmaps *maps;
  /* Identity, fixed at the first load (a re-load with another identity is
   * refused): the copies the rx thread and the outbox read without
   * peers_lock. */
  uint32_t pid;
  uint64_t agent_id;
  int no_notif;
  /* Outbox: notifications waiting for room in the peer's socket, oldest
   * first (see "Notification outboxes"); under the agent's ob_lock. A peer
   * with a non-empty outbox is on the agent's ob_peers list, which holds a
   * reference. */
  struct obent *ob_head, *ob_tail;
  size_t ob_n, ob_bytes;
  struct peer *ob_next;
} peer;

/* A queued notification datagram; x is its transfer, or NULL (send_notif). */
typedef struct obent {
  struct obent *next;
  struct xfer *x;
  uint64_t deadline_ns;
  size_t len;
  uint8_t data[];
} obent;

/* A region of a peer as seen by a local agent. */
typedef struct rregion {
  own_link link;
  struct agent *ag;
  uint64_t handle;
  peer *peer;
  uint64_t agent_id; /* the peer incarnation it was imported from */
  uint64_t addr, len, dev_id;
  kvp_mem_kind kind;
} rregion;

/* A prepared descriptor list. Immutable after creation. */
typedef struct dlist {
  own_link link;
  struct agent *ag;
  uint64_t handle;
  peer *peer;        /* NULL: local */
  uint64_t agent_id; /* remote: peer incarnation it was checked against */
  uint64_t gen;      /* local: reg_gen, remote: peer gen, at the check */
  kvp_mem_kind kind;
  size_t n;
  kvp_xfer_desc *descs;
} dlist;

/* One pair of (strided) descriptors of a transfer, in absolute addresses.
 * Strides are 0 when count is 1. */
typedef struct xpair {
  uint64_t laddr, raddr, len, lstride, rstride, count, ldev, rdev;
  uint32_t lkind, rkind;
} xpair;

enum xstate { X_IDLE, X_QUEUED, X_RUNNING, X_DONE, X_FAILED };
enum { BASIS_ADVERTISED, BASIS_REGIONS };
enum { ROUTE_NONE, ROUTE_LOCAL, ROUTE_PVM };

/* Where a transfer's peer lives, copied from its metadata at post. pidfd
 * is the peer's (it stays open while the transfer holds its peer), -1 for
 * a same-process peer. */
typedef struct route {
  int kind;
  uint32_t pid;
  int pidfd;
  uint64_t agent_handle, agent_id;
  rmaps *maps; /* a reference to the peer's mappings (ROUTE_PVM), or NULL; see xfer_prepare */
} route;

typedef struct telem {
  int valid;
  uint64_t start_us, post_us, xfer_us, bytes, descs;
} telem;

/* Pairs a transfer keeps inside its own struct; more go to a heap array.
 * Two cover the one-descriptor transfers of benchmarks and the few-region
 * transfers of small requests without an allocation. */
#define FAKE_INLINE_PAIRS 2
/* A released transfer keeps its heap pair array for the next one when the
 * array holds at most this many pairs (72 bytes each), its notification
 * buffer when at most this many bytes, and its agent keeps at most
 * FAKE_XFER_CACHE released transfers for reuse (see xfer_alloc). */
#define FAKE_KEEP_PAIRS 128
#define FAKE_KEEP_NOTIF 4096
#define FAKE_XFER_CACHE 32

/* A transfer. Agents recycle them (see xfer_alloc): everything before
 * heap_pairs is zeroed for each new transfer (XFER_CLEARED); the fields
 * from heap_pairs on keep
 * their storage across reuse, and the two message buffers at the end only
 * ever have their first byte reset. The fields a transfer touches on every
 * make, post, poll and release come first, so that after a large copy has
 * evicted them a lifecycle reloads a few cache lines, not the whole
 * struct. */
typedef struct xfer {
  own_link link; /* in ag->xfers while live, ag->xfree (link.next) while cached */
  struct agent *ag;
  uint64_t handle;
  kvp_op op;
  int basis;         /* how remote blocks are checked: BASIS_* */
  peer *peer;        /* NULL only for an empty batch without a peer */
  uint64_t agent_id; /* peer incarnation the transfer was built against */
  size_t npairs;
  xpair *pairs;      /* inline_pairs or heap_pairs */
  uint64_t desc_count, total_bytes;
  int has_notif;
  size_t notif_len;

  /* Validation cache: generations at which the blocks were last checked.
   * Written by the poster while idle and by the runner (see below). */
  uint64_t local_gen, peer_gen, live_gen;
  int live_valid;

  /* Execution. state is read without a lock by poll, telemetry and
   * release (X_DONE and X_FAILED are stored with release order after the
   * last write of the run, see xfer_record_locked); everything else below
   * changes under ag->qlock, or, while the transfer is X_RUNNING, by the
   * one thread running it (its "runner": a worker, a poll running a
   * slice, or, in event mode, the post running the first one); X_RUNNING
   * is entered and left under qlock. */
  atomic_int state;
  atomic_int cancel;
  int fail, drop_notif; /* drawn at post */
  int polled;           /* polls since the last post; only calls on this xfer touch it */
  int pollable;         /* polls may run it (no delay_us); set at post */
  int waiters;
  /* Progress of the current post, reset at post, advanced by the runner:
   * the next byte to move is byte cur_off of block cur_blk of pair
   * cur_pair; `moved` bytes moved so far; the post stops at `limit` bytes
   * (total_bytes, or half of it when an injected failure was drawn). */
  size_t cur_pair;
  uint64_t cur_blk, cur_off, moved, limit;
  uint64_t enq_ns; /* when it was (re)queued (monotonic ns) */
  struct xfer *qprev, *qnext;
  uint64_t t0_ns, start_us, post_us;
  telem done;
  kvp_status err_code;
  route rt;

  /* Storage kept across reuse. */
  xpair *heap_pairs; /* NULL, or heap_cap pairs */
  size_t heap_cap;
  uint8_t *notif; /* NULL, or notif_cap bytes; valid while has_notif */
  size_t notif_cap;
  xpair inline_pairs[FAKE_INLINE_PAIRS];
  /* Why the transfer is being cancelled (under qlock): set by
   * xfer_cancel_locked before it tells the runner to stop, used by
   * xfer_finish as the message of the KVP_ERR_CANCELED outcome, cleared at
   * post. Written before the outcome is published, so poll, which reads
   * err_msg without a lock once it sees X_FAILED, never races with it. */
  char cancel_msg[KVP_MAX_NAME_LEN + 64];
  char err_msg[512];
} xfer;

/* Bytes of a transfer cleared when an agent reuses it (see xfer). */
#define XFER_CLEARED offsetof(xfer, heap_pairs)

typedef struct agent {
  uint64_t handle, id;
  char name[KVP_MAX_NAME_LEN];
  size_t name_len;
  uint64_t caps;
  double fail_rate, drop_notif_rate;
  uint64_t delay_us;
  unsigned nworkers;
  int prefault; /* register_mem has the kernel touch the memory first */
  uint64_t rng; /* xorshift64* state, under qlock */

  pthread_rwlock_t mem_lock;
  mem_range *regs; /* sorted by addr */
  size_t nregs, capregs;
  atomic_uint_fast64_t reg_gen;
  /* Registered regions whose memory may vanish under a copy (shared file
   * mappings another process can shrink, holes): while there is one,
   * same-process copies of this agent cannot fault (copy_checked). */
  atomic_size_t may_fault_regs;

  pthread_rwlock_t peers_lock;
  peer *peers;

  pthread_mutex_t own_lock;
  own_link regions, rregions, dlists, xfers;
  xfer *xfree;   /* released transfers kept for reuse (link.next), under own_lock */
  unsigned nxfree;

  pthread_mutex_t qlock;
  pthread_cond_t qcv;      /* work queued or stopping */
  pthread_cond_t donecv;   /* a transfer with waiters left its runner */
  pthread_cond_t cancelcv; /* a transfer was cancelled (wakes delay waits) */
  xfer *qhead, *qtail;
  atomic_size_t urgent; /* queued transfers that are not pollable */
  int stopping, sleepers, untimed_sleepers;
  int driving;          /* polls running a slice now */
  uint64_t last_active_ns; /* last post, or end of a slice a poll ran */
  struct iovbuf *iov_free; /* iovec arrays for polls running cross-process
                              slices: one per concurrent poll, kept until
                              the agent is freed */
  pthread_t *workers;
  unsigned workers_started;

  kvp_notif_queue *nq;
  /* The event descriptor (KVP_CAP_EVENT_FD): -1 until the first
   * get_event_fd makes it (under own_lock); then signalled by ev_signal
   * and closed in agent_free. From then on the agent's transfers are not
   * pollable: a post moves the first slice itself (post_here) and workers
   * run what is left at once, so the host may wait on the descriptor
   * alone (see kvp_get_event_fd_args). */
  atomic_int ev_fd;
  int rx_sock, stop_fd, ob_wake;
  int rx_started;
  pthread_t rx_thread;
  char sock[sizeof(((struct sockaddr_un *)0)->sun_path)];
  size_t sock_len;

  /* Digests of metadata this agent handed out (local_metadata) and still
   * vouches for when a peer's load_remote asks (see md_verify). */
  pthread_mutex_t md_lock;
  uint8_t md_dig[FAKE_MD_RING][32];
  unsigned md_ndig, md_next;

  /* Outboxes of its peers that hold notifications; the rx thread drains
   * them. ob_lock may be held while taking qlock (never the reverse). */
  pthread_mutex_t ob_lock;
  peer *ob_peers;

  /* Senders that are not loaded peers, pinned to their process (rx thread
   * only). */
  struct pin {
    uint8_t name_dig[16]; /* SHA-256 of the name, first 16 bytes */
    uint32_t pid;
  } pins[FAKE_PINS];
  size_t npins;

  /* Counters (test hooks read them). */
  atomic_uint_fast64_t notif_forged;  /* datagrams dropped: sender is not who it says */
  atomic_uint_fast64_t notif_expired; /* send_notif notifications dropped from an outbox */
  atomic_uint_fast64_t map_bytes;     /* bytes moved by memcpy through peer mappings */
  atomic_uint_fast64_t warm_pages;    /* pages warm_for_user touched (prefault) */
} agent;

/* ------------------------------------------------------------------------ */
/* Plugin-wide state                                                        */
/* ------------------------------------------------------------------------ */

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static kvp_htable *g_agents, *g_regions, *g_rregions, *g_dlists, *g_xfers;
/* Random per process (re-drawn in a forked child): with the pid it tells
 * whether a peer lives in this very process. */
static uint64_t g_process_token;
/* getpid(), cached (and set again in a forked child): glibc does not cache
 * it, and post_xfer needs it for every transfer. */
static uint32_t g_pid;
/* Peer memory this process maps now (bytes, mappings): see FAKE_MAP_MAX_*. */
static atomic_uint_fast64_t g_map_bytes;
static atomic_uint g_map_count;
static uint64_t g_pidns;
static int g_init_ok;

static uint64_t random_u64(void) {
  uint64_t v = 0;
  if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    static atomic_uint_fast64_t ctr;
    v = ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^ ((uint64_t)getpid() << 40) ^
        (atomic_fetch_add(&ctr, 1) * 0x9E3779B97F4A7C15ull);
  }
  return v ? v : 0x9E3779B97F4A7C15ull;
}

static void after_fork_child(void) {
  g_process_token = random_u64();
  g_pid = (uint32_t)getpid();
}

/* 1 if a peer's metadata describes an agent of this process. */
static int md_same_process(const peer_md *md) {
  return md->process_token == g_process_token && md->pid == g_pid;
}

/* SHA-256 (FIPS 180-4) of [p, p + n): the digest a peer vouches for (see
 * md_verify). One shot; no state outlives the call. */
static const uint32_t SHA256_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static uint32_t ror32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void sha256_block(uint32_t h[8], const uint8_t *p) {
  uint32_t w[64], v[8];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = ror32(w[i - 15], 7) ^ ror32(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ror32(w[i - 2], 17) ^ ror32(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  memcpy(v, h, sizeof v);
  for (int i = 0; i < 64; i++) {
    uint32_t t1 = v[7] + (ror32(v[4], 6) ^ ror32(v[4], 11) ^ ror32(v[4], 25)) + ((v[4] & v[5]) ^ (~v[4] & v[6])) +
                  SHA256_K[i] + w[i];
    uint32_t t2 = (ror32(v[0], 2) ^ ror32(v[0], 13) ^ ror32(v[0], 22)) + ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
    memmove(v + 1, v, 7 * sizeof v[0]);
    v[4] += t1;
    v[0] = t1 + t2;
  }
  for (int i = 0; i < 8; i++) h[i] += v[i];
}

static void sha256(const uint8_t *p, size_t n, uint8_t out[32]) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  size_t full = n / 64 * 64;
  for (size_t i = 0; i < full; i += 64) sha256_block(h, p + i);
  uint8_t tail[128] = {0};
  size_t t = n - full;
  if (t) memcpy(tail, p + full, t);
  tail[t] = 0x80;
  size_t tl = t + 9 <= 64 ? 64 : 128;
  uint64_t bits = (uint64_t)n * 8;
  for (int i = 0; i < 8; i++) tail[tl - 1 - i] = (uint8_t)(bits >> (8 * i));
  sha256_block(h, tail);
  if (tl == 128) sha256_block(h, tail + 64);
  for (int i = 0; i < 8; i++) {
    out[4 * i] = (uint8_t)(h[i] >> 24);
    out[4 * i + 1] = (uint8_t)(h[i] >> 16);
    out[4 * i + 2] = (uint8_t)(h[i] >> 8);
    out[4 * i + 3] = (uint8_t)h[i];
  }
}

/* A pidfd of process pid (Linux 5.3), or -1 with errno. */
static int pidfd_of(uint32_t pid) {
#ifdef SYS_pidfd_open
  return (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

/* 1 if the process of a pidfd has exited (its pid may be reused soon). */
static int pidfd_exited(int fd) {
  struct pollfd pf = {fd, POLLIN, 0};
  return poll(&pf, 1, 0) > 0;
}

static void fake_init(void) {
  g_agents = kvp_ht_create(1);
  g_regions = kvp_ht_create(2);
  g_rregions = kvp_ht_create(3);
  g_dlists = kvp_ht_create(4);
  g_xfers = kvp_ht_create(5);
  g_process_token = random_u64();
  g_pid = (uint32_t)getpid();
  struct stat st;
  g_pidns = stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
  pthread_atfork(NULL, NULL, after_fork_child);
  g_init_ok = g_agents && g_regions && g_rregions && g_dlists && g_xfers;
}

/* Test hooks. test_fake.c compiles this file with -DKVP_FAKE_TEST_HOOKS
 * (the plugin built by `make` never has them): it tunes the slice size and
 * the grace period so that tests of poll-driven progress are deterministic,
 * and reads how many handles each table holds, which LeakSanitizer cannot
 * judge: an object left in a global table is still reachable. */
#ifdef KVP_FAKE_TEST_HOOKS
static atomic_uint_fast64_t g_test_slice = FAKE_SLICE_BYTES, g_test_grace = FAKE_GRACE_NS;
/* Non-zero: pidfd_getfd fails with this errno (tests of the fallback). */
static atomic_int g_test_getfd_errno;
void fake_test_getfd_errno(int err) { atomic_store(&g_test_getfd_errno, err); }
static uint64_t slice_bytes(void) { return atomic_load_explicit(&g_test_slice, memory_order_relaxed); }
static uint64_t grace_ns(void) { return atomic_load_explicit(&g_test_grace, memory_order_relaxed); }

/* Sets the slice a poll runs (bytes) and the grace period before a worker
 * takes over a pollable transfer (ns); 0 restores a default. */
void fake_test_tune(uint64_t slice, uint64_t grace) {
  atomic_store(&g_test_slice, slice ? slice : FAKE_SLICE_BYTES);
  atomic_store(&g_test_grace, grace ? grace : FAKE_GRACE_NS);
}

/* Live handles per table: agents, regions, remote regions, dlists,
 * transfers. */
void fake_test_handle_counts(size_t out[5]) {
  pthread_once(&g_once, fake_init);
  kvp_htable *ts[5] = {g_agents, g_regions, g_rregions, g_dlists, g_xfers};
  for (int i = 0; i < 5; i++) out[i] = kvp_ht_count(ts[i]);
}

/* Counters of an agent: [0] notification datagrams dropped because their
 * sender is not who it says, [1] send_notif notifications dropped from an
 * outbox after FAKE_SEND_TIMEOUT_S. 0 on an unknown handle. */
struct agent;
static struct agent *test_agent_get(uint64_t h);
static void test_agent_put(struct agent *ag);
static void test_agent_counters(struct agent *ag, uint64_t out[2]);
int fake_test_agent_counters(uint64_t agent, uint64_t out[2]) {
  struct agent *ag = test_agent_get(agent);
  if (!ag) return 0;
  test_agent_counters(ag, out);
  test_agent_put(ag);
  return 1;
}
#else
static uint64_t slice_bytes(void) { return FAKE_SLICE_BYTES; }
static uint64_t grace_ns(void) { return FAKE_GRACE_NS; }
#endif

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Durations for telemetry, in the ABI's whole microseconds, rounded up: a
 * same-process transfer of a few KiB takes well under a microsecond, and
 * truncating reported it as taking no time at all. */
static uint64_t dur_us(uint64_t ns) { return (ns + 999u) / 1000u; }

static uint64_t epoch_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000u;
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static const char *kind_name(uint32_t kind) {
  return kind == KVP_MEM_DRAM ? "DRAM" : kind == KVP_MEM_VRAM ? "VRAM" : "?";
}

static int kind_ok(uint32_t kind) { return kind == KVP_MEM_DRAM || kind == KVP_MEM_VRAM; }

static const char *cap_name(uint64_t cap) {
  for (size_t i = 0; i < NUM_CAPS; i++)
    if (cap == 1ull << i) return CAP_NAMES[i];
  return "?";
}

/* ------------------------------------------------------------------------ */
/* Handles and common checks                                                */
/* ------------------------------------------------------------------------ */

/* malloc of n elements of size sz, NULL on overflow or OOM (n may be 0). */
static void *alloc_array(size_t n, size_t sz) {
  if (n > SIZE_MAX / sz) return NULL;
  return malloc(n ? n * sz : 1);
}

static void list_init(own_link *head) { head->prev = head->next = head; }

static void list_add(own_link *head, own_link *l) {
  l->prev = head->prev;
  l->next = head;
  head->prev->next = l;
  head->prev = l;
}

static void list_del(own_link *l) {
  l->prev->next = l->next;
  l->next->prev = l->prev;
  l->prev = l->next = l;
}

/* Acquires the agent of handle h or explains why not. */
static agent *agent_get(uint64_t h, const char *fn, kvp_error **err) {
  agent *ag = (agent *)kvp_ht_acquire(g_agents, h);
  if (!ag)
    *err = kvp_err(KVP_ERR_INVALID_PARAM, "%s: unknown or released agent handle 0x%" PRIx64, fn, h);
  return ag;
}

static void agent_put(agent *ag) { kvp_ht_put(g_agents, ag->handle); }

/* Acquires an object of table t owned by ag. Objects begin with own_link
 * followed by their agent pointer (region, rregion, dlist, xfer). */
typedef struct owned_head {
  own_link link;
  agent *ag;
} owned_head;

/* collect_handles reads the handle right after owned_head. */
_Static_assert(offsetof(region, handle) == sizeof(owned_head), "region layout");
_Static_assert(offsetof(rregion, handle) == sizeof(owned_head), "rregion layout");
_Static_assert(offsetof(dlist, handle) == sizeof(owned_head), "dlist layout");
_Static_assert(offsetof(xfer, handle) == sizeof(owned_head), "xfer layout");
_Static_assert(offsetof(region, ag) == offsetof(owned_head, ag), "region layout");
_Static_assert(offsetof(rregion, ag) == offsetof(owned_head, ag), "rregion layout");
_Static_assert(offsetof(dlist, ag) == offsetof(owned_head, ag), "dlist layout");
_Static_assert(offsetof(xfer, ag) == offsetof(owned_head, ag), "xfer layout");

static void *obj_get(kvp_htable *t, uint64_t h, agent *ag, const char *what, const char *fn,
                     kvp_error **err) {
  owned_head *o = (owned_head *)kvp_ht_acquire(t, h);
  if (!o) {
    *err = kvp_err(KVP_ERR_INVALID_PARAM, "%s: unknown or released %s handle 0x%" PRIx64, fn, what, h);
    return NULL;
  }
  if (o->ag != ag) {
    kvp_ht_put(t, h);
    *err = kvp_err(KVP_ERR_INVALID_PARAM, "%s: %s handle 0x%" PRIx64 " belongs to another agent", fn,
                   what, h);
    return NULL;
  }
  return o;
}

static kvp_error *need_cap(const agent *ag, uint64_t cap, const char *fn) {
  if (ag->caps & cap) return NULL;
  return kvp_err(KVP_ERR_NOT_SUPPORTED,
                 "%s: capability %s is switched off on agent \"%.*s\" (caps_off)", fn,
                 cap_name(cap), (int)ag->name_len, ag->name);
}

static void rmaps_unref(rmaps *m) {
  if (!m || atomic_fetch_sub(&m->refs, 1) != 1) return;
  for (size_t i = 0; i < m->n; i++) {
    munmap(m->e[i].map, m->e[i].map_len);
    atomic_fetch_sub(&g_map_bytes, m->e[i].map_len);
    atomic_fetch_sub(&g_map_count, 1);
  }
  free(m);
}

static rmaps *rmaps_ref(rmaps *m) {
  if (m) atomic_fetch_add(&m->refs, 1);
  return m;
}

static void md_free(peer_md *md) {
  if (!md) return;
  free(md->regions);
  free(md->files);
  free(md);
}

static void peer_ref(peer *p) { atomic_fetch_add(&p->refs, 1); }

static void peer_unref(peer *p) {
  if (!p || atomic_fetch_sub(&p->refs, 1) != 1) return;
  md_free(p->md);
  rmaps_unref(p->maps);
  if (p->pidfd >= 0) close(p->pidfd);
  if (p->tx_fd >= 0) close(p->tx_fd);
  free(p);
}

/* The loaded peer called (name, len); peers_lock held. */
static peer *peer_find(agent *ag, const char *name, size_t len) {
  for (peer *p = ag->peers; p; p = p->next)
    if (p->name_len == len && memcmp(p->name, name, len) == 0) return p;
  return NULL;
}

static kvp_error *peer_name_check(const char *name, size_t len, const char *fn) {
  if (!name || len == 0 || len > KVP_MAX_NAME_LEN)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: peer name must be 1..%d bytes", fn, KVP_MAX_NAME_LEN);
  return NULL;
}

static kvp_error *peer_unknown(agent *ag, const char *name, size_t len, const char *fn) {
  return kvp_err(KVP_ERR_NOT_FOUND, "%s: peer \"%.*s\" is not loaded on agent \"%.*s\"", fn,
                 (int)len, name, (int)ag->name_len, ag->name);
}

/* ------------------------------------------------------------------------ */
/* Block validation                                                         */
/* ------------------------------------------------------------------------ */

typedef struct match_ctx {
  uint64_t dev_id;
  uint32_t kind;
} match_ctx;

static int match_kind_dev(const void *elem, void *ctx) {
  const mem_range *r = (const mem_range *)elem;
  const match_ctx *m = (const match_ctx *)ctx;
  return r->kind == m->kind && r->dev_id == m->dev_id;
}

/* 1 if every block of the descriptor lies inside an element of the table
 * with the same memory kind and device. */
static int blocks_inside(const mem_range *tab, size_t n, uint64_t addr, uint64_t len,
                         uint64_t stride, uint64_t count, uint64_t dev_id, uint32_t kind) {
  match_ctx m = {dev_id, kind};
  return kvp_strided_each_in(tab, n, sizeof(mem_range), addr, len, stride, count, match_kind_dev,
                             &m);
}

/* Checks one side of every pair against a table; returns the index of the
 * first pair with a block outside, or -1. */
static long pairs_outside(const xpair *ps, size_t n, int remote, const mem_range *tab, size_t ntab) {
  for (size_t i = 0; i < n; i++) {
    const xpair *p = &ps[i];
    int ok = remote ? blocks_inside(tab, ntab, p->raddr, p->len, p->rstride, p->count, p->rdev, p->rkind)
                    : blocks_inside(tab, ntab, p->laddr, p->len, p->lstride, p->count, p->ldev, p->lkind);
    if (!ok) return (long)i;
  }
  return -1;
}

static kvp_error *pair_outside_err(const xfer *x, long i, int remote, const char *where,
                                   const char *fn) {
  const xpair *p = &x->pairs[i];
  return kvp_err(KVP_ERR_NOT_FOUND,
                 "%s: descriptor %ld: %s blocks (addr 0x%" PRIx64 ", len %" PRIu64 ", stride %" PRIu64
                 ", count %" PRIu64 ", %s dev %" PRIu64 ") are not inside %s; no byte moved",
                 fn, i, remote ? "remote" : "local", remote ? p->raddr : p->laddr, p->len,
                 remote ? p->rstride : p->lstride, p->count, kind_name(remote ? p->rkind : p->lkind),
                 remote ? p->rdev : p->ldev, where);
}

/* Revalidates the local side against the agent's registrations if they
 * changed since the last check. mem_lock must be held (read). */
static kvp_error *check_local_locked(agent *ag, xfer *x, const char *fn) {
  uint64_t gen = atomic_load(&ag->reg_gen);
  if (gen == x->local_gen) return NULL;
  long bad = pairs_outside(x->pairs, x->npairs, 0, ag->regs, ag->nregs);
  if (bad >= 0) return pair_outside_err(x, bad, 0, "memory registered on this agent (deregistered?)", fn);
  x->local_gen = gen;
  return NULL;
}

/* Same for the remote side against a same-process peer agent's current
 * registrations. peer_ag->mem_lock must be held (read). */
static kvp_error *check_live_locked(agent *peer_ag, xfer *x, const char *fn) {
  uint64_t gen = atomic_load(&peer_ag->reg_gen);
  if (x->live_valid && gen == x->live_gen) return NULL;
  long bad = pairs_outside(x->pairs, x->npairs, 1, peer_ag->regs, peer_ag->nregs);
  if (bad >= 0)
    return pair_outside_err(x, bad, 1, "memory the peer has registered now (deregistered?)", fn);
  x->live_gen = gen;
  x->live_valid = 1;
  return NULL;
}

/* Read-locks the mem_locks of a and b (b may be NULL or a) in address
 * order, so two workers locking the same pair cannot deadlock. */
static void mem_rdlock2(agent *a, agent *b) {
  if (!b || b == a) {
    pthread_rwlock_rdlock(&a->mem_lock);
  } else if (a < b) {
    pthread_rwlock_rdlock(&a->mem_lock);
    pthread_rwlock_rdlock(&b->mem_lock);
  } else {
    pthread_rwlock_rdlock(&b->mem_lock);
    pthread_rwlock_rdlock(&a->mem_lock);
  }
}

static void mem_unlock2(agent *a, agent *b) {
  if (b && b != a) pthread_rwlock_unlock(&b->mem_lock);
  pthread_rwlock_unlock(&a->mem_lock);
}

/* The same-process agent a route points at, with a reference, or NULL. */
static agent *route_agent(const route *rt) {
  agent *p = (agent *)kvp_ht_acquire(g_agents, rt->agent_handle);
  if (p && p->id != rt->agent_id) {
    kvp_ht_put(g_agents, rt->agent_handle);
    p = NULL;
  }
  return p;
}

/* ------------------------------------------------------------------------ */
/* Wire formats                                                             */
/* ------------------------------------------------------------------------ */

/* Metadata v1 and v2:
 *   0  "KVFM"            4  u16 version (1, 2) 6  u16 flags (bit 0: the agent
 *                                                 takes no notifications)
 *   8  u64 process token 16 u64 pid namespace  24 u32 pid   28 u32 reserved
 *   32 u64 agent id      40 u64 agent handle (valid in its process only)
 *   48 u16 name_len      50 u16 sock_len       52 u32 num_regions
 *   56 name, sock (abstract unix socket name without its leading NUL), then
 *      num_regions x { u64 addr, u64 len, u64 dev_id, u32 kind, u32 0 }
 * sorted by addr. v2 (only when a region maps a sealed memfd, so that
 * every other agent hands out v1 exactly as before) then has the regions'
 * files:
 *      u32 num_files, u32 0,
 *      num_files x { u32 region index, u32 fd, u64 st_dev, u64 st_ino,
 *                    u64 file offset of the region's start }
 * at most one per region, by increasing region index. The length must
 * match exactly. */
static size_t md_nfiles(const agent *ag) {
  size_t n = 0;
  for (size_t i = 0; i < ag->nregs; i++) n += ag->regs[i].reg->file_fd >= 0;
  return n;
}

static size_t md_size(const agent *ag) {
  size_t nf = md_nfiles(ag);
  return MD_FIXED + ag->name_len + ag->sock_len + ag->nregs * MD_REGION + (nf ? MD_FILES_HDR + nf * MD_FILE : 0);
}

static void md_encode(const agent *ag, uint8_t *p) {
  size_t nf = md_nfiles(ag);
  memcpy(p, MD_MAGIC, 4);
  kvp_put_u16(p + 4, nf ? MD_VERSION_FILES : MD_VERSION);
  kvp_put_u16(p + 6, (ag->caps & KVP_CAP_NOTIF) ? 0 : MD_FLAG_NO_NOTIF);
  kvp_put_u64(p + 8, g_process_token);
  kvp_put_u64(p + 16, g_pidns);
  kvp_put_u32(p + 24, g_pid);
  kvp_put_u32(p + 28, 0);
  kvp_put_u64(p + 32, ag->id);
  kvp_put_u64(p + 40, ag->handle);
  kvp_put_u16(p + 48, (uint16_t)ag->name_len);
  kvp_put_u16(p + 50, (uint16_t)ag->sock_len);
  kvp_put_u32(p + 52, (uint32_t)ag->nregs);
  uint8_t *q = p + MD_FIXED;
  memcpy(q, ag->name, ag->name_len);
  q += ag->name_len;
  memcpy(q, ag->sock, ag->sock_len);
  q += ag->sock_len;
  for (size_t i = 0; i < ag->nregs; i++, q += MD_REGION) {
    kvp_put_u64(q, ag->regs[i].addr);
    kvp_put_u64(q + 8, ag->regs[i].len);
    kvp_put_u64(q + 16, ag->regs[i].dev_id);
    kvp_put_u32(q + 24, ag->regs[i].kind);
    kvp_put_u32(q + 28, 0);
  }
  if (!nf) return;
  kvp_put_u32(q, (uint32_t)nf);
  kvp_put_u32(q + 4, 0);
  q += MD_FILES_HDR;
  for (size_t i = 0; i < ag->nregs; i++) {
    const region *rg = ag->regs[i].reg;
    if (rg->file_fd < 0) continue;
    kvp_put_u32(q, (uint32_t)i);
    kvp_put_u32(q + 4, (uint32_t)rg->file_fd);
    kvp_put_u64(q + 8, rg->file_dev);
    kvp_put_u64(q + 16, rg->file_ino);
    kvp_put_u64(q + 24, rg->file_off);
    q += MD_FILE;
  }
}

static kvp_error *md_bad(const char *why) {
  return kvp_err(KVP_ERR_INVALID_PARAM, "load_remote: metadata is not fake-plugin metadata v%d or v%d: %s",
                 MD_VERSION, MD_VERSION_FILES, why);
}

/* Decodes metadata into a new peer_md (owned by the caller). Never reads
 * outside [buf, buf + len). */
static kvp_error *md_decode(const uint8_t *buf, size_t len, peer_md **out) {
  kvp_reader r;
  kvp_reader_init(&r, buf, len);
  const uint8_t *magic, *name, *sock;
  uint16_t version, flags, name_len, sock_len;
  uint32_t pid, reserved, nreg;
  peer_md m;
  memset(&m, 0, sizeof m);
  if (!buf || len < MD_FIXED) return md_bad("truncated header");
  kvp_read_bytes(&r, 4, &magic);
  if (memcmp(magic, MD_MAGIC, 4) != 0) return md_bad("bad magic");
  kvp_read_u16(&r, &version);
  if (version != MD_VERSION && version != MD_VERSION_FILES) {
    return kvp_err(KVP_ERR_INVALID_PARAM,
                   "load_remote: metadata version %u, this fake plugin reads versions %d and %d", version,
                   MD_VERSION, MD_VERSION_FILES);
  }
  kvp_read_u16(&r, &flags);
  kvp_read_u64(&r, &m.process_token);
  kvp_read_u64(&r, &m.pidns);
  kvp_read_u32(&r, &pid);
  kvp_read_u32(&r, &reserved);
  kvp_read_u64(&r, &m.agent_id);
  kvp_read_u64(&r, &m.agent_handle);
  kvp_read_u16(&r, &name_len);
  kvp_read_u16(&r, &sock_len);
  kvp_read_u32(&r, &nreg);
  if (!r.ok) return md_bad("truncated header");
  if ((flags & ~MD_FLAG_NO_NOTIF) != 0 || reserved != 0) return md_bad("unknown flags or non-zero reserved field");
  if (pid == 0 || m.agent_id == 0) return md_bad("zero pid or agent id");
  if (name_len == 0 || name_len > KVP_MAX_NAME_LEN) return md_bad("agent name length not in 1..255");
  if (sock_len == 0 || sock_len >= sizeof m.sock) return md_bad("socket name empty or too long");
  /* The sizes in 64 bits: nreg * MD_REGION cannot overflow them. */
  uint64_t strs = (uint64_t)name_len + sock_len, regs = (uint64_t)nreg * MD_REGION;
  uint64_t files_at = strs + regs; /* bytes after the header up to the file table (v2) */
  if (version == MD_VERSION && (r.left < strs || (r.left - strs) % MD_REGION != 0 || (r.left - strs) / MD_REGION != nreg))
    return md_bad("length does not match its region count (truncated or trailing bytes)");
  if (version == MD_VERSION_FILES &&
      (r.left < files_at + MD_FILES_HDR || (r.left - files_at - MD_FILES_HDR) % MD_FILE != 0))
    return md_bad("length does not match its region count (truncated or trailing bytes)");
  kvp_read_bytes(&r, name_len, &name);
  kvp_read_bytes(&r, sock_len, &sock);
  m.pid = pid;
  m.flags = flags;
  m.name_len = name_len;
  memcpy(m.name, name, name_len);
  m.sock_len = sock_len;
  memcpy(m.sock, sock, sock_len);
  m.nregions = nreg;
  if (nreg) {
    m.regions = (mem_range *)calloc(nreg, sizeof(mem_range));
    if (!m.regions) return kvp_err_oom();
  }
  kvp_error *e = NULL;
  for (uint32_t i = 0; i < nreg && !e; i++) {
    mem_range *g = &m.regions[i];
    uint32_t rres;
    kvp_read_u64(&r, &g->addr);
    kvp_read_u64(&r, &g->len);
    kvp_read_u64(&r, &g->dev_id);
    kvp_read_u32(&r, &g->kind);
    kvp_read_u32(&r, &rres);
    if (g->len == 0 || rres != 0 || !kind_ok(g->kind))
      e = md_bad("bad region (zero length, unknown memory kind or reserved bits)");
  }
  if (!e && (!r.ok || kvp_ranges_check(m.regions, nreg, sizeof(mem_range)) >= 0))
    e = md_bad("regions unsorted, overlapping or overflowing");
  if (!e && version == MD_VERSION_FILES) {
    uint32_t nf, fres;
    kvp_read_u32(&r, &nf);
    kvp_read_u32(&r, &fres);
    if (!r.ok || fres != 0 || nf == 0 || nf > nreg || r.left != (uint64_t)nf * MD_FILE) {
      e = md_bad("file table count (none, more than regions, reserved bits or not matching the length)");
    } else {
      m.files = (md_file *)calloc(nf, sizeof(md_file));
      if (!m.files) e = kvp_err_oom();
      m.nfiles = nf;
    }
    for (uint32_t i = 0; !e && i < nf; i++) {
      md_file *f = &m.files[i];
      kvp_read_u32(&r, &f->region);
      kvp_read_u32(&r, &f->fd);
      kvp_read_u64(&r, &f->dev);
      kvp_read_u64(&r, &f->ino);
      kvp_read_u64(&r, &f->off);
      /* The file range [off, off + len) must be a valid off_t range. */
      if (f->region >= nreg || (i && f->region <= m.files[i - 1].region) || f->fd > INT32_MAX || f->ino == 0 ||
          f->off > (uint64_t)INT64_MAX || m.regions[f->region].len > (uint64_t)INT64_MAX - f->off)
        e = md_bad("bad file entry (region out of range or out of order, fd, inode or offset)");
    }
  }
  if (!e && (!r.ok || r.left != 0)) e = md_bad("length does not match its region count (truncated or trailing bytes)");
  peer_md *pm = e ? NULL : (peer_md *)malloc(sizeof *pm);
  if (!e && !pm) e = kvp_err_oom();
  if (e) {
    free(m.regions);
    free(m.files);
    return e;
  }
  *pm = m;
  *out = pm;
  return NULL;
}

/* Region blob v1 (48 bytes):
 *   0 "KVFR"  4 u16 version (1)  6 u16 flags (0)  8 u64 owner agent id
 *   16 u64 addr  24 u64 len  32 u64 dev_id  40 u32 kind  44 u32 0 */
static void blob_encode(const agent *ag, const region *rg, uint8_t *p) {
  memcpy(p, BLOB_MAGIC, 4);
  kvp_put_u16(p + 4, BLOB_VERSION);
  kvp_put_u16(p + 6, 0);
  kvp_put_u64(p + 8, ag->id);
  kvp_put_u64(p + 16, rg->addr);
  kvp_put_u64(p + 24, rg->len);
  kvp_put_u64(p + 32, rg->dev_id);
  kvp_put_u32(p + 40, rg->kind);
  kvp_put_u32(p + 44, 0);
}

typedef struct blob_fields {
  uint64_t agent_id, addr, len, dev_id;
  uint32_t kind;
} blob_fields;

static kvp_error *blob_decode(const uint8_t *p, size_t len, blob_fields *b) {
  if (len != BLOB_SIZE || memcmp(p, BLOB_MAGIC, 4) != 0 || kvp_get_u16(p + 4) != BLOB_VERSION ||
      kvp_get_u16(p + 6) != 0 || kvp_get_u32(p + 44) != 0)
    return kvp_err(KVP_ERR_INVALID_PARAM,
                   "remote_region_import: blob of %zu bytes is not a fake-plugin region blob v%d "
                   "(%d bytes)",
                   len, BLOB_VERSION, BLOB_SIZE);
  b->agent_id = kvp_get_u64(p + 8);
  b->addr = kvp_get_u64(p + 16);
  b->len = kvp_get_u64(p + 24);
  b->dev_id = kvp_get_u64(p + 32);
  b->kind = kvp_get_u32(p + 40);
  if (b->len == 0 || b->len > UINT64_MAX - b->addr || !kind_ok(b->kind) || b->agent_id == 0)
    return kvp_err(KVP_ERR_INVALID_PARAM,
                   "remote_region_import: blob names an invalid region (len 0, overflow or bad kind)");
  return NULL;
}

/* Notification datagram v2:
 *   0 "KVFN"  4 u16 version (2)  6 u16 flags (0)  8 u64 target agent id
 *   16 u64 sender agent id  24 u16 sender_len  26 sender  then the message.
 * Challenge (load_remote, see md_verify), 64 bytes:
 *   0 "KVFC"  4 u16 1  6 u16 0  8 u64 target agent id  16 nonce[16]
 *   32 SHA-256 of the metadata the challenger was given
 * Answer, 40 bytes, sent from the challenged agent's own socket:
 *   0 "KVFA"  4 u16 1  6 u16 0  8 u64 agent id  16 nonce[16]
 *   32 u32 verdict (VOUCH_*)  36 u32 0 */

/* ------------------------------------------------------------------------ */
/* Notifications                                                            */
/* ------------------------------------------------------------------------ */

static kvp_error *notif_len_check(const uint8_t *msg, size_t len, const char *fn) {
  if (!msg && len)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: notification message is NULL with length %zu", fn, len);
  if (len > FAKE_MAX_NOTIF)
    return kvp_err(KVP_ERR_INVALID_PARAM,
                   "%s: notification of %zu bytes is larger than the fake plugin's limit of %u "
                   "(one datagram)",
                   fn, len, FAKE_MAX_NOTIF);
  return NULL;
}

static void xfer_finish(agent *ag, struct xfer *x, kvp_error *e);
static int canceled(struct xfer *x);
static kvp_error *canceled_err(void);

static void wake_fd(int fd) {
  uint64_t one = 1;
  ssize_t wr = write(fd, &one, sizeof one);
  (void)wr;
}

/* Makes the agent's event descriptor readable, if it has one: a transfer
 * of the agent ended or a notification was queued for it. Called after the
 * outcome is visible (state stored, notification queued). */
static void ev_signal(struct agent *ag);

static kvp_error *notif_send_err(int err, uint32_t pid) {
  if (err == ECONNREFUSED || err == ENOENT || err == ENOTCONN)
    return kvp_err(KVP_ERR_REMOTE_DISCONNECT,
                   "notification: peer process %u is gone (its socket refuses: %s)", pid, strerror(err));
  return kvp_err(KVP_ERR_BACKEND, "notification: send to peer process %u: %s", pid, strerror(err));
}

/* Notification outboxes. A notification to a peer in another process is
 * one datagram on a socket connected to that peer alone (peer->tx_fd, so
 * a peer that does not drain fills only its own socket's budget). It is
 * sent at once without blocking when the peer's outbox is empty; else, or
 * when the peer's socket is full, it joins the peer's outbox (order kept)
 * and the agent's rx thread sends it when the socket has room. A
 * transfer whose notification is queued stays in progress, owned by the
 * rx thread, until the notification is sent (success) or
 * FAKE_SEND_TIMEOUT_S passed (the transfer fails with KVP_ERR_BACKEND), or
 * it is cancelled; a send_notif notification that waited that long is
 * dropped and counted (notif_expired). A full outbox (FAKE_OB_MAX_ENTRIES
 * or FAKE_OB_MAX_BYTES) refuses at once. No poll and no worker ever waits
 * for a peer's socket.
 *
 * Delivers (msg, len) from ag to peer p (route rt), or queues it. x is the
 * transfer it completes, or NULL. *queued = 1: in the outbox; for a
 * transfer the rx thread now finishes x, and the caller must not touch it
 * again. */
static kvp_error *notif_submit(agent *ag, peer *p, const route *rt, struct xfer *x, const uint8_t *msg,
                               size_t len, int *queued) {
  *queued = 0;
  if (rt->kind == ROUTE_LOCAL) {
    agent *to = route_agent(rt);
    if (!to) return kvp_err(KVP_ERR_REMOTE_DISCONNECT, "notification: peer agent no longer exists");
    kvp_error *e = NULL;
    if (!(to->caps & KVP_CAP_NOTIF))
      e = kvp_err(KVP_ERR_NOT_SUPPORTED, "notification: peer \"%.*s\" switched notifications off",
                  (int)to->name_len, to->name);
    else if (!(e = kvp_nq_push(to->nq, ag->name, ag->name_len, msg, len)))
      ev_signal(to);
    agent_put(to);
    return kvp_err_wrap(e, "notification not delivered");
  }
  if (rt->kind != ROUTE_PVM || !p || p->tx_fd < 0)
    return kvp_err(KVP_ERR_INVALID_PARAM, "notification: the transfer has no peer");
  if (p->no_notif)
    return kvp_err(KVP_ERR_NOT_SUPPORTED, "notification: peer \"%.*s\" switched notifications off",
                   (int)p->name_len, p->name);
  uint8_t hdr[NOTIF_FIXED];
  memcpy(hdr, NOTIF_MAGIC, 4);
  kvp_put_u16(hdr + 4, NOTIF_VERSION);
  kvp_put_u16(hdr + 6, 0);
  kvp_put_u64(hdr + 8, rt->agent_id);
  kvp_put_u64(hdr + 16, ag->id);
  kvp_put_u16(hdr + 24, (uint16_t)ag->name_len);
  struct iovec iov[3] = {{hdr, sizeof hdr}, {ag->name, ag->name_len}, {(void *)msg, len}};
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = iov;
  mh.msg_iovlen = len ? 3 : 2;
  size_t total = NOTIF_FIXED + ag->name_len + len;
  int wake = 0;
  kvp_error *e = NULL;
  pthread_mutex_lock(&ag->ob_lock);
  if (x && canceled(x)) {
    e = canceled_err();
    goto out;
  }
  if (!p->ob_head) {
    ssize_t n;
    do n = sendmsg(p->tx_fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    if (n >= 0) goto out;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      e = notif_send_err(errno, rt->pid);
      goto out;
    }
  }
  if (p->ob_n >= FAKE_OB_MAX_ENTRIES || p->ob_bytes + total > FAKE_OB_MAX_BYTES) {
    e = kvp_err(KVP_ERR_BACKEND,
                "notification: peer process %u does not drain its socket (%zu notifications, %zu bytes "
                "wait for it)",
                rt->pid, p->ob_n, p->ob_bytes);
    goto out;
  }
  obent *o = (obent *)malloc(sizeof *o + total);
  if (!o) {
    e = kvp_err_oom();
    goto out;
  }
  memcpy(o->data, hdr, sizeof hdr);
  memcpy(o->data + sizeof hdr, ag->name, ag->name_len);
  if (len) memcpy(o->data + sizeof hdr + ag->name_len, msg, len);
  o->len = total;
  o->x = x;
  o->next = NULL;
  o->deadline_ns = now_ns() + FAKE_SEND_TIMEOUT_S * 1000000000ull;
  if (p->ob_tail) {
    p->ob_tail->next = o;
  } else {
    p->ob_head = o;
    peer_ref(p); /* the ob_peers list's */
    p->ob_next = ag->ob_peers;
    ag->ob_peers = p;
    wake = 1;
  }
  p->ob_tail = o;
  p->ob_n++;
  p->ob_bytes += total;
  *queued = 1;
out:
  pthread_mutex_unlock(&ag->ob_lock);
  if (wake) wake_fd(ag->ob_wake);
  return e;
}

/* The rx thread's turn on the outboxes: sends what the peers' sockets take,
 * finishes transfers whose notification went out, expired or was
 * cancelled, and lists (from index base of *fds) the sockets to wait on
 * for room. Returns the number of pollfds; *timeout_ms is when the oldest
 * queued notification expires (-1: none). */
static size_t ob_service(agent *ag, struct pollfd **fds, size_t *cap, size_t base, int *timeout_ms) {
  uint64_t now = now_ns(), next = UINT64_MAX;
  size_t n = base;
  /* Outbox references dropped after ob_lock (the last one of a removed
   * peer unmaps its memory: see rmaps); beyond 8 at once, in place. */
  peer *drop[8];
  size_t ndrop = 0;
  pthread_mutex_lock(&ag->ob_lock);
  peer **pp = &ag->ob_peers;
  while (*pp) {
    peer *p = *pp;
    while (p->ob_head) {
      obent *o = p->ob_head;
      kvp_error *e = NULL;
      if (o->x && canceled(o->x)) {
        e = canceled_err();
      } else {
        ssize_t r;
        do r = send(p->tx_fd, o->data, o->len, MSG_DONTWAIT | MSG_NOSIGNAL);
        while (r < 0 && errno == EINTR);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
          if (now < o->deadline_ns) break; /* wait for room */
          e = kvp_err(KVP_ERR_BACKEND, "notification: peer process %u did not drain its socket within %ds",
                      p->pid, FAKE_SEND_TIMEOUT_S);
        } else if (r < 0) {
          e = notif_send_err(errno, p->pid);
        }
      }
      p->ob_head = o->next;
      if (!p->ob_head) p->ob_tail = NULL;
      p->ob_n--;
      p->ob_bytes -= o->len;
      if (o->x) {
        xfer_finish(ag, o->x, e);
      } else if (e) {
        atomic_fetch_add(&ag->notif_expired, 1);
        kvp_err_free(e);
      }
      free(o);
    }
    if (!p->ob_head) {
      *pp = p->ob_next;
      p->ob_next = NULL;
      if (ndrop < sizeof drop / sizeof drop[0])
        drop[ndrop++] = p;
      else
        peer_unref(p);
      continue;
    }
    if (n == *cap) {
      size_t nc = *cap * 2;
      struct pollfd *nf = (struct pollfd *)realloc(*fds, nc * sizeof **fds);
      if (!nf) { /* retry on the next turn */
        next = now + 1000000u;
        break;
      }
      *fds = nf;
      *cap = nc;
    }
    (*fds)[n++] = (struct pollfd){p->tx_fd, POLLOUT, 0};
    if (p->ob_head->deadline_ns < next) next = p->ob_head->deadline_ns;
    pp = &p->ob_next;
  }
  pthread_mutex_unlock(&ag->ob_lock);
  for (size_t i = 0; i < ndrop; i++) peer_unref(drop[i]);
  *timeout_ms = next == UINT64_MAX ? -1 : (int)((next > now ? next - now : 0) / 1000000u) + 1;
  return n;
}

/* Frees every queued notification of a stopped agent (its transfers were
 * cancelled, so only send_notif entries remain). */
static void ob_free_all(agent *ag) {
  while (ag->ob_peers) {
    peer *p = ag->ob_peers;
    ag->ob_peers = p->ob_next;
    while (p->ob_head) {
      obent *o = p->ob_head;
      p->ob_head = o->next;
      if (o->x) xfer_finish(ag, o->x, canceled_err());
      free(o);
    }
    p->ob_tail = NULL;
    p->ob_n = p->ob_bytes = 0;
    peer_unref(p);
  }
}

/* 1 if this agent handed out metadata with this digest and has not
 * deregistered memory since. */
static int agent_vouches(agent *ag, const uint8_t dig[32]) {
  int yes = 0;
  pthread_mutex_lock(&ag->md_lock);
  for (unsigned i = 0; i < ag->md_ndig && !yes; i++) yes = memcmp(ag->md_dig[i], dig, 32) == 0;
  pthread_mutex_unlock(&ag->md_lock);
  return yes;
}

/* Answers a challenge (see md_verify) from the challenger's own address,
 * without blocking: a challenger that does not drain gets no answer. */
static void rx_challenge(agent *ag, const uint8_t *b, size_t n, const struct sockaddr_un *src, socklen_t srclen) {
  if (n != CHAL_SIZE || kvp_get_u16(b + 4) != 1 || kvp_get_u16(b + 6) != 0) return;
  if (srclen <= offsetof(struct sockaddr_un, sun_path)) return; /* unbound: nowhere to answer */
  uint32_t verdict = kvp_get_u64(b + 8) != ag->id ? VOUCH_NOT_ME : agent_vouches(ag, b + 32) ? VOUCH_YES : VOUCH_NO;
  uint8_t ans[ANSWER_SIZE];
  memcpy(ans, ANSWER_MAGIC, 4);
  kvp_put_u16(ans + 4, 1);
  kvp_put_u16(ans + 6, 0);
  kvp_put_u64(ans + 8, ag->id);
  memcpy(ans + 16, b + 16, 16);
  kvp_put_u32(ans + 32, verdict);
  kvp_put_u32(ans + 36, 0);
  ssize_t w = sendto(ag->rx_sock, ans, sizeof ans, MSG_DONTWAIT | MSG_NOSIGNAL, (const struct sockaddr *)src, srclen);
  (void)w;
}

static int pid_alive(uint32_t pid) { return kill((pid_t)pid, 0) == 0 || errno == EPERM; }

/* Whether a notification datagram really comes from the agent it names.
 * The kernel reports the sending process (SCM_CREDENTIALS). A sender that
 * is a loaded peer must be that peer: its verified pid and agent id. Any
 * other name is pinned to the first process that uses it, for as long as
 * that process lives (agents of one process share its memory, so the
 * process is what the kernel can tell apart); a process pins at most
 * FAKE_PINS_PER_PID names and the agent FAKE_PINS. rx thread only. */
static int notif_sender_ok(agent *ag, const uint8_t *name, size_t nl, uint64_t sender_id, uint32_t pid) {
  pthread_rwlock_rdlock(&ag->peers_lock);
  peer *p = peer_find(ag, (const char *)name, nl);
  int known = p != NULL, ok = p && p->pid == pid && p->agent_id == sender_id;
  pthread_rwlock_unlock(&ag->peers_lock);
  if (known) return ok;
  uint8_t d[32];
  sha256(name, nl, d);
  size_t of_pid = 0;
  for (size_t i = 0; i < ag->npins; i++) {
    struct pin *q = &ag->pins[i];
    if (memcmp(q->name_dig, d, 16) == 0) {
      if (q->pid == pid) return 1;
      if (pid_alive(q->pid)) return 0;
      q->pid = pid; /* its process is gone: the name is free again */
      return 1;
    }
    if (q->pid == pid) of_pid++;
  }
  if (of_pid >= FAKE_PINS_PER_PID) return 0;
  size_t at = SIZE_MAX;
  if (ag->npins < FAKE_PINS)
    at = ag->npins++;
  else /* full: take the slot of a process that is gone */
    for (size_t i = 0; i < ag->npins && at == SIZE_MAX; i++)
      if (!pid_alive(ag->pins[i].pid)) at = i;
  if (at == SIZE_MAX) return 0;
  memcpy(ag->pins[at].name_dig, d, 16);
  ag->pins[at].pid = pid;
  return 1;
}

/* Reads every datagram waiting on the agent's socket: answers challenges,
 * queues notifications whose sender is who it says (else drops and counts
 * them), drops anything else. */
static void rx_drain(agent *ag, uint8_t *buf, size_t cap) {
  for (;;) {
    struct sockaddr_un src;
    union {
      struct cmsghdr h;
      char b[CMSG_SPACE(sizeof(struct ucred)) + CMSG_SPACE(16 * sizeof(int))];
    } cb;
    struct iovec iov = {buf, cap};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_name = &src;
    mh.msg_namelen = sizeof src;
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cb.b;
    mh.msg_controllen = sizeof cb.b;
    ssize_t n = recvmsg(ag->rx_sock, &mh, MSG_DONTWAIT | MSG_TRUNC | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      break; /* EAGAIN: drained */
    }
    int have_cred = 0;
    struct ucred cr;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level != SOL_SOCKET) continue;
      if (c->cmsg_type == SCM_CREDENTIALS && c->cmsg_len >= CMSG_LEN(sizeof cr)) {
        memcpy(&cr, CMSG_DATA(c), sizeof cr);
        have_cred = 1;
      } else if (c->cmsg_type == SCM_RIGHTS) { /* nobody sends us descriptors: close them */
        size_t nfd = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < nfd; i++) {
          int fd;
          memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
          close(fd);
        }
      }
    }
    if ((size_t)n > cap || (size_t)n < 4) continue;
    if (memcmp(buf, CHAL_MAGIC, 4) == 0) {
      rx_challenge(ag, buf, (size_t)n, &src, mh.msg_namelen);
      continue;
    }
    if ((size_t)n < NOTIF_FIXED || memcmp(buf, NOTIF_MAGIC, 4) != 0 || kvp_get_u16(buf + 4) != NOTIF_VERSION ||
        kvp_get_u64(buf + 8) != ag->id)
      continue;
    size_t sl = kvp_get_u16(buf + 24);
    if (sl == 0 || sl > KVP_MAX_NAME_LEN || (size_t)n - NOTIF_FIXED < sl) continue;
    if (!(ag->caps & KVP_CAP_NOTIF)) continue;
    if (!have_cred || !notif_sender_ok(ag, buf + NOTIF_FIXED, sl, kvp_get_u64(buf + 16), (uint32_t)cr.pid)) {
      atomic_fetch_add(&ag->notif_forged, 1);
      continue;
    }
    kvp_error *pe = kvp_nq_push(ag->nq, (const char *)buf + NOTIF_FIXED, sl, buf + NOTIF_FIXED + sl,
                                (size_t)n - NOTIF_FIXED - sl);
    if (!pe) ev_signal(ag);
    kvp_err_free(pe);
  }
}

/* The agent's rx thread, until stop_fd becomes readable: takes datagrams
 * from its socket (rx_drain) and drains its peers' outboxes (ob_service). */
static void *rx_main(void *arg) {
  agent *ag = (agent *)arg;
  size_t cap = NOTIF_FIXED + KVP_MAX_NAME_LEN + FAKE_MAX_NOTIF + 1;
  uint8_t *buf = (uint8_t *)malloc(cap);
  size_t fcap = 16;
  struct pollfd *fds = (struct pollfd *)malloc(fcap * sizeof *fds);
  if (!buf || !fds) {
    free(buf);
    free(fds);
    return NULL;
  }
  for (;;) {
    int timeout;
    size_t nf = ob_service(ag, &fds, &fcap, 3, &timeout);
    fds[0] = (struct pollfd){ag->rx_sock, POLLIN, 0};
    fds[1] = (struct pollfd){ag->stop_fd, POLLIN, 0};
    fds[2] = (struct pollfd){ag->ob_wake, POLLIN, 0};
    int pr = poll(fds, (nfds_t)nf, timeout);
    if (pr < 0 && errno != EINTR) break;
    if (pr <= 0) continue;
    if (fds[1].revents) break;
    if (fds[2].revents) {
      uint64_t v;
      ssize_t r = read(ag->ob_wake, &v, sizeof v);
      (void)r;
    }
    if (fds[0].revents) rx_drain(ag, buf, cap);
  }
  free(buf);
  free(fds);
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* Transfer execution                                                       */
/* ------------------------------------------------------------------------ */

/* iovec arrays for one cross-process slice: each worker owns one; polls
 * borrow one from their agent's free list (ag->iov_free), so no transfer
 * allocates. */
typedef struct iovbuf {
  struct iovbuf *next; /* in ag->iov_free */
  struct iovec l[FAKE_IOV_MAX], r[FAKE_IOV_MAX];
} iovbuf;

/* The thread running a transfer (a worker, or a poll or post running a
 * slice) and its iovecs (NULL for same-process transfers run by a poll or
 * post). */
typedef struct runner {
  agent *ag;
  iovbuf *iov;
} runner;

static kvp_error *canceled_err(void) {
  return kvp_err(KVP_ERR_CANCELED, "transfer cancelled");
}

static int canceled(xfer *x) { return atomic_load_explicit(&x->cancel, memory_order_relaxed) != 0; }

/* Advances the cursor of x by n bytes within the current block. */
static void cursor_advance(xfer *x, uint64_t n) {
  const xpair *p = &x->pairs[x->cur_pair];
  x->cur_off += n;
  if (x->cur_off < p->len) return;
  x->cur_off = 0;
  if (++x->cur_blk < p->count) return;
  x->cur_blk = 0;
  x->cur_pair++;
}

/* Moves n bytes from src to dst in this process with process_vm_readv on
 * our own pid: memory that is not mapped (any more) fails the call with
 * EFAULT where memcpy would take SIGBUS or SIGSEGV, which a plugin cannot
 * handle (the host owns the signals; a Go host dies). Overlapping ranges
 * go through a bounce buffer, in memmove order. Sets *moved to the bytes
 * moved; returns 0 or an errno. */
static int copy_checked(uint64_t dst, uint64_t src, uint64_t n, uint64_t *moved) {
  *moved = 0;
  int disjoint = dst - src >= n && src - dst >= n;
  if (disjoint) {
    while (*moved < n) {
      uint64_t c = n - *moved;
      if (c > FAKE_PVM_MAX_BYTES) c = FAKE_PVM_MAX_BYTES;
      struct iovec l = {(void *)(uintptr_t)(dst + *moved), (size_t)c};
      struct iovec r = {(void *)(uintptr_t)(src + *moved), (size_t)c};
      ssize_t got = process_vm_readv((pid_t)g_pid, &l, 1, &r, 1, 0);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) return errno;
      if (got == 0) return EFAULT;
      *moved += (uint64_t)got;
    }
    return 0;
  }
  enum { BOUNCE = 1 << 20 };
  uint64_t b = n < BOUNCE ? n : BOUNCE;
  uint8_t *bounce = (uint8_t *)malloc((size_t)b);
  if (!bounce) return ENOMEM;
  int err = 0;
  int forward = dst < src; /* memmove: forward when moving down */
  while (*moved < n && !err) {
    uint64_t c = n - *moved < b ? n - *moved : b;
    uint64_t off = forward ? *moved : n - *moved - c;
    for (int pass = 0; pass < 2 && !err; pass++) { /* src -> bounce -> dst */
      struct iovec l = {pass ? (void *)(uintptr_t)(dst + off) : bounce, (size_t)c};
      struct iovec r = {pass ? bounce : (void *)(uintptr_t)(src + off), (size_t)c};
      ssize_t got;
      do got = process_vm_readv((pid_t)g_pid, &l, 1, &r, 1, 0);
      while (got < 0 && errno == EINTR);
      if (got < 0) err = errno;
      else if ((uint64_t)got != c) err = EFAULT; /* a partial pass: the rest is not mapped */
    }
    if (!err) *moved += c;
  }
  free(bounce);
  return err;
}

/* Returns the first address of [addr, addr + n) that cannot be read (a
 * probe of one byte per page), or 0 when every page reads. */
static uint64_t first_unmapped(uint64_t addr, uint64_t n) {
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  for (uint64_t a = addr; a - addr < n; a = (a | (page - 1)) + 1) {
    uint8_t byte;
    struct iovec l = {&byte, 1}, r = {(void *)(uintptr_t)a, 1};
    if (process_vm_readv((pid_t)g_pid, &l, 1, &r, 1, 0) != 1) return a;
    if (a > UINT64_MAX - page) break;
  }
  return 0;
}

/* The registered region of ag holding addr (under ag's mem_lock), or NULL. */
static const mem_range *region_at(const agent *ag, uint64_t addr) {
  if (!ag) return NULL;
  for (size_t i = 0; i < ag->nregs; i++)
    if (addr - ag->regs[i].addr < ag->regs[i].len) return &ag->regs[i];
  return NULL;
}

/* The failure of a same-process copy whose memory faulted: names the
 * address and the registered region (and agent) it lies in, so the host
 * can tell whose memory went. */
static kvp_error *copy_fault_err(const xfer *x, const agent *ag, const agent *peer_ag, uint64_t la, uint64_t ra,
                                 uint64_t n, int err) {
  if (err != EFAULT)
    return kvp_err(KVP_ERR_BACKEND, "transfer: same-process copy: %s; %" PRIu64 " of %" PRIu64 " bytes moved",
                   strerror(err), x->moved, x->total_bytes);
  uint64_t bad = first_unmapped(la, n);
  const agent *owner = ag;
  const char *side = "local";
  if (!bad) {
    bad = first_unmapped(ra, n);
    owner = peer_ag;
    side = "remote";
  }
  const mem_range *m = bad ? region_at(owner, bad) : NULL;
  if (!m) { /* mapped again by now (an owner that shrinks and regrows): name both sides */
    const mem_range *lm = region_at(ag, la), *rm = region_at(peer_ag, ra);
    if (!lm || !rm)
      return kvp_err(KVP_ERR_BACKEND,
                     "transfer: memory of a same-process copy is not mapped (EFAULT): its owner shrank or "
                     "unmapped memory it registered; %" PRIu64 " of %" PRIu64 " bytes moved",
                     x->moved, x->total_bytes);
    return kvp_err(KVP_ERR_BACKEND,
                   "transfer: memory of a same-process copy was not mapped (EFAULT), and is again: agent "
                   "\"%.*s\"'s registered region [0x%" PRIx64 ", +%" PRIu64 ") or agent \"%.*s\"'s registered "
                   "region [0x%" PRIx64 ", +%" PRIu64 ") shrank under the copy and grew back; %" PRIu64 " of %" PRIu64
                   " bytes moved",
                   (int)ag->name_len, ag->name, lm->addr, lm->len, (int)peer_ag->name_len, peer_ag->name, rm->addr,
                   rm->len, x->moved, x->total_bytes);
  }
  return kvp_err(KVP_ERR_BACKEND,
                 "transfer: %s memory at 0x%" PRIx64 " is not mapped (EFAULT): agent \"%.*s\"'s registered "
                 "region [0x%" PRIx64 ", +%" PRIu64 ") shrank or was unmapped by its owner; %" PRIu64 " of %" PRIu64
                 " bytes moved",
                 side, bad, (int)owner->name_len, owner->name, m->addr, m->len, x->moved, x->total_bytes);
}

/* Same-process copy from the cursor: one memcpy per block (or piece of a
 * block), up to budget bytes. A block whose source and destination overlap
 * (a loopback peer, one buffer) is moved by one memmove, never in pieces,
 * so it moves as it would in one call. With checked (memory that may
 * vanish is registered on either agent) copy_checked moves the bytes
 * instead, so that the copy fails rather than the process; memcpy stays
 * for the rest, 3-8x faster here. ag and peer_ag are the two agents, with
 * their mem_locks held (peer_ag may be ag, or NULL for a loopback). */
static kvp_error *copy_local(xfer *x, uint64_t budget, const agent *ag, const agent *peer_ag, int checked) {
  uint64_t done = 0;
  while (x->cur_pair < x->npairs && done < budget && x->moved < x->limit) {
    if (canceled(x)) return canceled_err();
    const xpair *p = &x->pairs[x->cur_pair];
    uint64_t la = p->laddr + x->cur_blk * p->lstride + x->cur_off;
    uint64_t ra = p->raddr + x->cur_blk * p->rstride + x->cur_off;
    uint64_t dst = x->op == KVP_OP_WRITE ? ra : la, src = x->op == KVP_OP_WRITE ? la : ra;
    uint64_t n = p->len - x->cur_off, room = x->limit - x->moved;
    int disjoint = dst - src >= n && src - dst >= n; /* unsigned wrap-around */
    if (n > room) n = room;
    if (disjoint && n > budget - done) n = budget - done;
    if (checked) {
      uint64_t moved;
      int err = copy_checked(dst, src, n, &moved);
      done += moved;
      x->moved += moved;
      if (moved) cursor_advance(x, moved);
      if (err) return copy_fault_err(x, ag, peer_ag ? peer_ag : ag, la + moved, ra + moved, n - moved, err);
      continue;
    }
    if (disjoint)
      memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    else
      memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    done += n;
    x->moved += n;
    cursor_advance(x, n);
  }
  return NULL;
}

static kvp_error *pvm_error(int err, const route *rt, int write) {
  const char *call = write ? "process_vm_writev" : "process_vm_readv";
  if (err == ESRCH)
    return kvp_err(KVP_ERR_REMOTE_DISCONNECT, "%s: peer process %u is gone", call, rt->pid);
  if (err == EPERM || err == EACCES)
    return kvp_err(KVP_ERR_BACKEND,
                   "%s: not permitted to access peer process %u (%s; both processes need the same "
                   "user, or CAP_SYS_PTRACE)",
                   call, rt->pid, strerror(err));
  if (err == EFAULT)
    return kvp_err(KVP_ERR_BACKEND,
                   "%s: memory of peer process %u (or local memory) is not mapped (EFAULT)", call,
                   rt->pid);
  return kvp_err(KVP_ERR_BACKEND, "%s to peer process %u: %s", call, rt->pid, strerror(err));
}

/* Drops the first n bytes of the iovec array *v (*cnt entries): the
 * iovecs moved whole go, the one moved in part is trimmed. */
static void iov_skip(struct iovec **v, int *cnt, size_t n) {
  while (*cnt > 0 && n >= (*v)->iov_len) {
    n -= (*v)->iov_len;
    (*v)++;
    (*cnt)--;
  }
  if (*cnt > 0 && n) {
    (*v)->iov_base = (char *)(*v)->iov_base + n;
    (*v)->iov_len -= n;
  }
}

/* Moves the local iovecs [0, nl) to or from the remote ones [0, nr) (the
 * same bytes in all, cut differently) with as many calls as partial
 * transfers need, adding the bytes moved to x->moved. */
static kvp_error *pvm_flush(iovbuf *iov, xfer *x, int nl, int nr) {
  struct iovec *l = iov->l, *r = iov->r;
  int write = x->op == KVP_OP_WRITE;
  while (nl > 0 && nr > 0) {
    /* The pid is the process that proved the metadata its own (md_verify)
     * only while that process lives: once its pidfd reports an exit, the
     * pid may name another process soon. */
    if (x->rt.pidfd >= 0 && pidfd_exited(x->rt.pidfd)) return pvm_error(ESRCH, &x->rt, write);
    ssize_t got = write ? process_vm_writev((pid_t)x->rt.pid, l, (unsigned long)nl, r, (unsigned long)nr, 0)
                        : process_vm_readv((pid_t)x->rt.pid, l, (unsigned long)nl, r, (unsigned long)nr, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return pvm_error(errno, &x->rt, write);
    }
    if (got == 0) return pvm_error(EFAULT, &x->rt, write);
    x->moved += (uint64_t)got;
    /* Partial: both sides advance by the bytes moved, each in its own
     * cut. */
    iov_skip(&l, &nl, (size_t)got);
    iov_skip(&r, &nr, (size_t)got);
  }
  return NULL;
}

/* Appends [base, base+len) to the iovec array v (*cnt entries), merged
 * into the last entry when it continues it. */
static void iov_add(struct iovec *v, int *cnt, uintptr_t base, uint64_t len) {
  if (*cnt > 0 && (uintptr_t)v[*cnt - 1].iov_base + v[*cnt - 1].iov_len == base) {
    v[*cnt - 1].iov_len += (size_t)len;
    return;
  }
  v[*cnt].iov_base = (void *)base;
  v[*cnt].iov_len = (size_t)len;
  (*cnt)++;
}

/* The mapped peer region holding all of remote [addr, addr + n), or
 * NULL; *hint is the last one found (pieces mostly come in address
 * order). */
static const rmap *rmap_at(const rmaps *ms, uint64_t addr, uint64_t n, const rmap **hint) {
  const rmap *m = *hint;
  if (!m || addr - m->addr >= m->len) {
    size_t lo = 0, hi = ms->n;
    while (lo < hi) { /* the first entry starting above addr */
      size_t mid = lo + (hi - lo) / 2;
      if (ms->e[mid].addr <= addr) lo = mid + 1;
      else hi = mid;
    }
    if (!lo || addr - ms->e[lo - 1].addr >= ms->e[lo - 1].len) return NULL;
    m = *hint = &ms->e[lo - 1];
  }
  return n <= m->len - (addr - m->addr) ? m : NULL;
}

/* Cross-process copy from the cursor, up to budget bytes: up to
 * FAKE_IOV_MAX iovecs a side per system call, pieces that continue one
 * another on a side merged into one iovec. The kernel pins the remote
 * pages once per remote iovec: a layout that gathers small runs of one
 * side into contiguous memory on the other (heterogeneous-TP MHA pages:
 * a head range of each token, 512 bytes, into the decode's whole page)
 * moves several times faster as few remote iovecs than as one per run.
 * With maps (the peer's mapped regions, passed only when no local memory
 * of the agent may vanish: see xfer_step) a piece whose remote range lies
 * in one of them moves with memcpy through the mapping instead, at once,
 * and the rest of the batch with process_vm_*; the peer's pidfd is
 * checked once per batch first, so a peer that exited fails the transfer
 * with KVP_ERR_REMOTE_DISCONNECT as on the process_vm_* path. A batch
 * holds at most FAKE_IOV_MAX mapped pieces, so cancellation and the
 * peer's exit are seen as often as there. */
static kvp_error *copy_pvm(iovbuf *iov, xfer *x, uint64_t budget, const rmaps *maps) {
  uint64_t queued = 0;
  uint64_t room = x->limit - x->moved;
  int write = x->op == KVP_OP_WRITE;
  const rmap *hint = NULL;
  if (budget > room) budget = room;
  while (queued < budget && x->cur_pair < x->npairs) {
    int nl = 0, nr = 0, nm = 0;
    uint64_t batch = 0, mapped = 0;
    if (maps && pidfd_exited(x->rt.pidfd)) return pvm_error(ESRCH, &x->rt, write);
    while (nl < FAKE_IOV_MAX && nr < FAKE_IOV_MAX && nm < FAKE_IOV_MAX && batch < FAKE_PVM_MAX_BYTES &&
           queued < budget && x->cur_pair < x->npairs) {
      const xpair *p = &x->pairs[x->cur_pair];
      uint64_t piece = p->len - x->cur_off;
      if (piece > budget - queued) piece = budget - queued;
      if (piece > FAKE_PVM_MAX_BYTES - batch) piece = FAKE_PVM_MAX_BYTES - batch;
      uint64_t la = p->laddr + x->cur_blk * p->lstride + x->cur_off;
      uint64_t ra = p->raddr + x->cur_blk * p->rstride + x->cur_off;
      const rmap *m = maps ? rmap_at(maps, ra, piece, &hint) : NULL;
      if (m) {
        uint8_t *mp = m->base + (ra - m->addr);
        if (write)
          memcpy(mp, (const void *)(uintptr_t)la, (size_t)piece);
        else
          memcpy((void *)(uintptr_t)la, mp, (size_t)piece);
        x->moved += piece;
        mapped += piece;
        nm++;
      } else {
        iov_add(iov->l, &nl, (uintptr_t)la, piece);
        iov_add(iov->r, &nr, (uintptr_t)ra, piece);
      }
      queued += piece;
      batch += piece;
      cursor_advance(x, piece);
    }
    if (mapped) atomic_fetch_add_explicit(&x->ag->map_bytes, mapped, memory_order_relaxed);
    if (canceled(x)) return canceled_err();
    kvp_error *e = nl ? pvm_flush(iov, x, nl, nr) : NULL;
    if (e) return e;
  }
  return NULL;
}

/* 1 when a local region of ag (mem_lock held) maps a file that one of
 * the peer's mapped regions maps too: both processes registered one
 * file. A copy between them through the mapping and the local memory
 * could see the same pages under two addresses, where memmove cannot tell
 * an overlap; such a transfer keeps process_vm_* (xfer_step). */
static int maps_share_local_file(const agent *ag, const rmaps *maps) {
  uint64_t last_dev = 0, last_ino = 0;
  for (size_t i = 0; i < ag->nregs; i++) {
    const region *rg = ag->regs[i].reg;
    if (rg->file_fd < 0 || (rg->file_dev == last_dev && rg->file_ino == last_ino)) continue;
    last_dev = rg->file_dev;
    last_ino = rg->file_ino;
    for (size_t k = 0; k < maps->n; k++)
      if (maps->e[k].dev == rg->file_dev && maps->e[k].ino == rg->file_ino) return 1;
  }
  return 0;
}

/* Waits delay_us unless the transfer is cancelled first. */
static int delay_wait(agent *ag, xfer *x) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t ns = (uint64_t)ts.tv_nsec + ag->delay_us * 1000u;
  ts.tv_sec += (time_t)(ns / 1000000000u);
  ts.tv_nsec = (long)(ns % 1000000000u);
  pthread_mutex_lock(&ag->qlock);
  int rc = 0;
  while (!atomic_load(&x->cancel) && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&ag->cancelcv, &ag->qlock, &ts);
  int canceled = atomic_load(&x->cancel);
  pthread_mutex_unlock(&ag->qlock);
  return canceled;
}

/* Runs one slice of a transfer: moves up to budget bytes from its cursor,
 * under the registration locks of both sides (so that memory cannot be
 * deregistered under the copy) after re-checking them if registrations
 * changed. Sets *done to 1 once every byte moved and the notification is
 * delivered, or to 2 when every byte moved and the notification waits in
 * the peer's outbox: then the rx thread finishes the transfer, and the
 * caller must not touch it again. Returns the transfer's failure, if any.
 * The caller is the transfer's runner. */
static kvp_error *xfer_step(runner *r, xfer *x, uint64_t budget, int *done) {
  agent *ag = r->ag;
  *done = 0;
  if (x->rt.kind == ROUTE_NONE) { /* an empty transfer without a peer */
    *done = 1;
    return NULL;
  }
  agent *peer_ag = NULL;
  if (x->rt.kind == ROUTE_LOCAL) {
    peer_ag = route_agent(&x->rt);
    if (!peer_ag)
      return kvp_err(KVP_ERR_REMOTE_DISCONNECT, "transfer: peer agent no longer exists in this process; %" PRIu64
                     " of %" PRIu64 " bytes moved", x->moved, x->total_bytes);
  }
  mem_rdlock2(ag, peer_ag);
  /* Registrations may have changed since the post or the last slice. */
  kvp_error *e = check_local_locked(ag, x, "transfer");
  if (!e && peer_ag) e = check_live_locked(peer_ag, x, "transfer");
  if (!e && x->moved < x->limit) {
    if (x->rt.kind == ROUTE_LOCAL) {
      int checked = atomic_load(&ag->may_fault_regs) || atomic_load(&peer_ag->may_fault_regs);
      e = copy_local(x, budget, ag, peer_ag, checked);
    } else {
      /* Peer mappings only while no local memory of the agent may vanish
       * (a memcpy from or into it cannot fault; see "Peer memory mapped"). */
      const rmaps *maps = x->rt.maps;
      if (maps && (atomic_load(&ag->may_fault_regs) || maps_share_local_file(ag, maps))) maps = NULL;
      e = copy_pvm(r->iov, x, budget, maps);
    }
  }
  mem_unlock2(ag, peer_ag);
  if (peer_ag) agent_put(peer_ag);
  if (e || x->moved < x->limit) return e;
  if (x->fail)
    return kvp_err(KVP_ERR_BACKEND,
                   "fake: injected failure (fail_rate) after moving %" PRIu64 " of %" PRIu64 " bytes",
                   x->moved, x->total_bytes);
  *done = 1;
  if (!x->has_notif || x->drop_notif) return NULL;
  int queued;
  kvp_error *ne = notif_submit(ag, x->peer, &x->rt, x, x->notif, x->notif_len, &queued);
  if (queued) *done = 2;
  return ne;
}

/* Runs a transfer to its end on a worker (delay first, if the agent has
 * one); returns NULL on success. It may have been started by polls. */
static kvp_error *worker_run(runner *r, xfer *x, int *parked) {
  if (parked) *parked = 0;
  if (r->ag->delay_us && delay_wait(r->ag, x)) return canceled_err();
  int done = 0;
  kvp_error *e = NULL;
  while (!e && !done) e = canceled(x) ? canceled_err() : xfer_step(r, x, slice_bytes(), &done);
  if (parked) *parked = done == 2;
  return e;
}

static void queue_unlink_locked(agent *ag, xfer *x);

/* Appends a transfer to the queue as X_QUEUED. qlock held. */
static void queue_push_locked(agent *ag, xfer *x, uint64_t now) {
  atomic_store_explicit(&x->state, X_QUEUED, memory_order_relaxed);
  x->enq_ns = ag->last_active_ns = now;
  x->qnext = NULL;
  x->qprev = ag->qtail;
  if (ag->qtail)
    ag->qtail->qnext = x;
  else
    ag->qhead = x;
  ag->qtail = x;
  if (!x->pollable) atomic_fetch_add_explicit(&ag->urgent, 1, memory_order_release);
  /* A spinning worker sees `urgent` by itself, and a worker in a timed
   * sleep wakes within a grace period anyway; only an urgent transfer with
   * a sleeping worker, or any transfer with a worker in an untimed sleep,
   * needs the futex. */
  if ((!x->pollable && ag->sleepers) || ag->untimed_sleepers) pthread_cond_signal(&ag->qcv);
}

/* The first queued transfer a worker may run now; else NULL and *wake_ns
 * the time the first pollable one leaves its grace period. qlock held. */
static xfer *queue_pick_locked(agent *ag, uint64_t now, uint64_t *wake_ns) {
  *wake_ns = UINT64_MAX;
  for (xfer *x = ag->qhead; x; x = x->qnext) {
    if (!x->pollable || now >= x->enq_ns + grace_ns()) {
      queue_unlink_locked(ag, x);
      atomic_store(&x->state, X_RUNNING);
      return x;
    }
    if (x->enq_ns + grace_ns() < *wake_ns) *wake_ns = x->enq_ns + grace_ns();
  }
  return NULL;
}

static void abs_time(uint64_t ns, struct timespec *ts) {
  ts->tv_sec = (time_t)(ns / 1000000000u);
  ts->tv_nsec = (long)(ns % 1000000000u);
}

/* Takes the next transfer for a worker; NULL when the agent stops. spin:
 * the worker just ran one, so more may follow: spin a little first. */
static xfer *worker_next(agent *ag, int spin) {
  if (spin) {
    uint64_t until = now_ns() + FAKE_SPIN_NS;
    for (unsigned i = 1; atomic_load_explicit(&ag->urgent, memory_order_acquire) == 0; i++) {
      if ((i & 63) == 0 && now_ns() >= until) break;
      cpu_relax();
    }
  }
  pthread_mutex_lock(&ag->qlock);
  for (;;) {
    if (ag->stopping) {
      pthread_mutex_unlock(&ag->qlock);
      return NULL;
    }
    uint64_t now = now_ns(), wake;
    xfer *x = queue_pick_locked(ag, now, &wake);
    if (x) {
      pthread_mutex_unlock(&ag->qlock);
      return x;
    }
    /* While active, wake at least every grace period: then neither a post
     * of a pollable transfer nor a poll requeueing one after a slice needs
     * a signal (see queue_push_locked). In event mode no transfer is
     * pollable, and every push of one that is not signals a sleeper. */
    int active = atomic_load_explicit(&ag->ev_fd, memory_order_relaxed) < 0 &&
                 (ag->driving || now - ag->last_active_ns < FAKE_ACTIVE_NS);
    if (active && now + grace_ns() < wake) wake = now + grace_ns();
    ag->sleepers++;
    if (wake == UINT64_MAX) {
      ag->untimed_sleepers++;
      pthread_cond_wait(&ag->qcv, &ag->qlock);
      ag->untimed_sleepers--;
    } else {
      struct timespec ts;
      abs_time(wake, &ts);
      pthread_cond_timedwait(&ag->qcv, &ag->qlock, &ts);
    }
    ag->sleepers--;
  }
}

/* Records the outcome of a run (consuming e) and wakes waiters, without
 * signalling the event descriptor. qlock held. Storing the final state is
 * its last access to x: from then on telemetry and release may use x
 * without qlock (see xfer_destroy). */
static void xfer_record_locked(agent *ag, xfer *x, kvp_error *e) {
  int waiters = x->waiters;
  if (e) {
    x->err_code = kvp_err_code(e);
    const char *msg = kvp_err_message(e, NULL);
    if (x->err_code == KVP_ERR_CANCELED && x->cancel_msg[0]) msg = x->cancel_msg;
    snprintf(x->err_msg, sizeof x->err_msg, "%s", msg);
    kvp_err_free(e);
    atomic_store_explicit(&x->state, X_FAILED, memory_order_release);
  } else {
    x->done.valid = 1;
    x->done.start_us = x->start_us;
    x->done.post_us = x->post_us;
    x->done.xfer_us = dur_us(now_ns() - x->t0_ns);
    x->done.bytes = x->total_bytes;
    x->done.descs = x->desc_count;
    atomic_store_explicit(&x->state, X_DONE, memory_order_release);
  }
  if (waiters) pthread_cond_broadcast(&ag->donecv);
}

/* Records the outcome of a run that ends after the call that posted it
 * returned (or may have), and signals the event descriptor. qlock held. */
static void xfer_finish_locked(agent *ag, xfer *x, kvp_error *e) {
  xfer_record_locked(ag, x, e);
  ev_signal(ag);
}

static void xfer_finish(agent *ag, xfer *x, kvp_error *e) {
  pthread_mutex_lock(&ag->qlock);
  xfer_finish_locked(ag, x, e);
  pthread_mutex_unlock(&ag->qlock);
}

static void *worker_main(void *arg) {
  runner *w = (runner *)arg;
  agent *ag = w->ag;
  xfer *x;
  int ran = 0;
  while ((x = worker_next(ag, ran))) {
    int parked;
    kvp_error *e = worker_run(w, x, &parked);
    if (!parked) xfer_finish(ag, x, e); /* else the rx thread finishes it */
    ran = 1;
  }
  free(w->iov);
  free(w);
  return NULL;
}

/* Removes a queued transfer from the queue. qlock held. */
static void queue_unlink_locked(agent *ag, xfer *x) {
  if (x->qprev)
    x->qprev->qnext = x->qnext;
  else
    ag->qhead = x->qnext;
  if (x->qnext)
    x->qnext->qprev = x->qprev;
  else
    ag->qtail = x->qprev;
  x->qnext = x->qprev = NULL;
  if (!x->pollable) atomic_fetch_sub(&ag->urgent, 1);
}

/* Cancels a transfer and returns once no thread runs it any more. qlock
 * held. A queued transfer leaves the queue and fails with KVP_ERR_CANCELED
 * and msg; a running one is told to stop and waited for: it then ends
 * cancelled (with msg, see cancel_msg), or done or failed if it got there
 * first. Idle and finished transfers are left as they are. */
static void xfer_cancel_locked(agent *ag, xfer *x, const char *msg) {
  int st = atomic_load(&x->state);
  if (st == X_QUEUED) {
    queue_unlink_locked(ag, x);
    x->err_code = KVP_ERR_CANCELED;
    snprintf(x->err_msg, sizeof x->err_msg, "%s", msg);
    atomic_store(&x->state, X_FAILED);
    ev_signal(ag);
  } else if (st == X_RUNNING) {
    snprintf(x->cancel_msg, sizeof x->cancel_msg, "%s", msg);
    atomic_store(&x->cancel, 1);
    pthread_cond_broadcast(&ag->cancelcv);
    if (ag->ob_wake >= 0) wake_fd(ag->ob_wake); /* it may wait in an outbox */
    x->waiters++;
    while (atomic_load(&x->state) == X_RUNNING) pthread_cond_wait(&ag->donecv, &ag->qlock);
    x->waiters--;
  }
}

/* ------------------------------------------------------------------------ */
/* Object teardown (no locks held by the caller)                            */
/* ------------------------------------------------------------------------ */

static void own_unlink(agent *ag, own_link *l) {
  pthread_mutex_lock(&ag->own_lock);
  list_del(l);
  pthread_mutex_unlock(&ag->own_lock);
}

/* Poisons (or unpoisons) for ASan what a cached transfer must not be used
 * for: all of it but its list link, and its kept buffers. */
static void xfer_poison(xfer *x, int on) {
  char *body = (char *)x + sizeof(own_link);
  size_t n = sizeof *x - sizeof(own_link);
  if (on) {
    if (x->heap_pairs) FAKE_POISON(x->heap_pairs, x->heap_cap * sizeof(xpair));
    if (x->notif) FAKE_POISON(x->notif, x->notif_cap);
    FAKE_POISON(body, n);
  } else {
    FAKE_UNPOISON(body, n);
    if (x->heap_pairs) FAKE_UNPOISON(x->heap_pairs, x->heap_cap * sizeof(xpair));
    if (x->notif) FAKE_UNPOISON(x->notif, x->notif_cap);
  }
  (void)body;
  (void)n;
}

/* Frees a transfer's memory; it refers to no peer any more. */
static void xfer_free(xfer *x) {
  free(x->heap_pairs);
  free(x->notif);
  free(x);
}

/* Ends a transfer that no handle names (never published, or removed from
 * the table, and not running or queued): drops its peer reference, takes it
 * out of its agent's list if `linked`, and keeps it in the agent's cache
 * for the next xfer_alloc, or frees it when the cache is full. */
static void xfer_retire(agent *ag, xfer *x, int linked) {
  rmaps_unref(x->rt.maps);
  x->rt.maps = NULL;
  peer_unref(x->peer);
  x->peer = NULL;
  if (x->heap_cap > FAKE_KEEP_PAIRS) {
    free(x->heap_pairs);
    x->heap_pairs = NULL;
    x->heap_cap = 0;
  }
  if (x->notif_cap > FAKE_KEEP_NOTIF) {
    free(x->notif);
    x->notif = NULL;
    x->notif_cap = 0;
  }
  pthread_mutex_lock(&ag->own_lock);
  if (linked) list_del(&x->link);
  int keep = ag->nxfree < FAKE_XFER_CACHE;
  if (keep) {
    x->link.next = (own_link *)ag->xfree; /* link is the first member */
    ag->xfree = x;
    ag->nxfree++;
    xfer_poison(x, 1);
  }
  pthread_mutex_unlock(&ag->own_lock);
  if (!keep) xfer_free(x);
}

/* Releases a transfer whose handle was removed from the table: cancels it
 * if it is queued or running (and waits for its runner), then retires it.
 * A transfer seen idle or finished (state read with acquire order) has no
 * runner and is in no queue, and its last run wrote nothing after
 * publishing the outcome: no lock is needed to retire it. */
static void xfer_destroy(agent *ag, xfer *x) {
  int st = atomic_load_explicit(&x->state, memory_order_acquire);
  if (st == X_QUEUED || st == X_RUNNING) {
    pthread_mutex_lock(&ag->qlock);
    xfer_cancel_locked(ag, x, "transfer released");
    pthread_mutex_unlock(&ag->qlock);
  }
  xfer_retire(ag, x, 1);
}

static void dlist_destroy(agent *ag, dlist *d) {
  own_unlink(ag, &d->link);
  peer_unref(d->peer);
  free(d->descs);
  free(d);
}

static void rregion_destroy(agent *ag, rregion *r) {
  own_unlink(ag, &r->link);
  peer_unref(r->peer);
  free(r);
}

/* Collects the handles of a list whose objects match pred. own_lock is
 * taken here; the caller removes them afterwards with no lock held, since
 * removal may wait for calls that use them. */
typedef int (*own_pred)(const own_link *l, const void *ctx);

static size_t collect_handles(agent *ag, own_link *head, own_pred pred, const void *ctx,
                              uint64_t **out) {
  pthread_mutex_lock(&ag->own_lock);
  size_t n = 0;
  for (own_link *l = head->next; l != head; l = l->next)
    if (!pred || pred(l, ctx)) n++;
  uint64_t *hs = n ? (uint64_t *)alloc_array(n, sizeof *hs) : NULL;
  size_t k = 0;
  if (hs) {
    for (own_link *l = head->next; l != head; l = l->next) {
      /* handle follows link and agent pointer in every owned object */
      if (!pred || pred(l, ctx)) hs[k++] = *(const uint64_t *)((const char *)l + sizeof(owned_head));
    }
  }
  pthread_mutex_unlock(&ag->own_lock);
  *out = hs;
  return k;
}

/* ------------------------------------------------------------------------ */
/* Plugin info and agents                                                   */
/* ------------------------------------------------------------------------ */

static kvp_error *fake_plugin_info(kvp_plugin_info_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_PLUGIN_INFO_ARGS_STRUCT_SIZE);
  if (e) return e;
  a->name = "fake";
  a->version = FAKE_VERSION;
  a->params_doc = PARAMS_DOC;
  a->abi_major = KVP_FAKE_ABI_MAJOR;
  a->abi_minor = KVP_FAKE_ABI_MINOR;
  a->caps = FAKE_CAPS;
  a->mem_kinds = FAKE_MEM_KINDS;
  return NULL;
}

static void agent_free(agent *ag);
static void region_free(region *r);

static kvp_error *agent_parse_params(agent *ag, const kvp_agent_create_args *a) {
  kvp_error *e = kvp_params_check(a->params, a->num_params, PARAM_KEYS, NUM_PARAM_KEYS, 0);
  uint64_t off = 0, workers = 1, threads = 0;
  if (!e) e = kvp_param_name_mask(a->params, a->num_params, "caps_off", CAP_NAMES, NUM_CAPS, &off);
  if (!e) e = kvp_param_double(a->params, a->num_params, "fail_rate", 0, 0, 1, &ag->fail_rate);
  if (!e) e = kvp_param_u64(a->params, a->num_params, "fail_seed", 1, 0, UINT64_MAX, &ag->rng);
  if (!e) e = kvp_param_u64(a->params, a->num_params, "delay_us", 0, 0, 60000000, &ag->delay_us);
  if (!e)
    e = kvp_param_double(a->params, a->num_params, "drop_notif_rate", 0, 0, 1, &ag->drop_notif_rate);
  if (!e) e = kvp_param_u64(a->params, a->num_params, "workers", 1, 1, 64, &workers);
  if (!e) e = kvp_param_u64(a->params, a->num_params, "num_threads", 0, 0, 64, &threads);
  if (!e) e = kvp_param_bool(a->params, a->num_params, "prefault", 1, &ag->prefault);
  if (e) return kvp_err_wrap(e, "agent_create");
  ag->caps = FAKE_CAPS & ~off;
  if (!(ag->caps & (KVP_CAP_PREPPED | KVP_CAP_BATCH)))
    return kvp_err(KVP_ERR_INVALID_PARAM,
                   "agent_create: caps_off switches off both prepped and batch; an agent needs one "
                   "of them");
  ag->nworkers = (unsigned)workers;
  /* xorshift64* needs a non-zero state; mix the seed so small seeds differ. */
  ag->rng = (ag->rng ^ 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
  if (!ag->rng) ag->rng = 1;
  return NULL;
}

static double rng_next(agent *ag) {
  uint64_t x = ag->rng;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  ag->rng = x;
  return (double)((x * 0x2545F4914F6CDD1Dull) >> 11) * 0x1.0p-53;
}

static kvp_error *agent_open_sockets(agent *ag) {
  ag->sock_len = (size_t)snprintf(ag->sock, sizeof ag->sock, "kvhost-fake/%d/%016" PRIx64,
                                  (int)getpid(), ag->id);
  ag->rx_sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  ag->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ag->ob_wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (ag->rx_sock < 0 || ag->stop_fd < 0 || ag->ob_wake < 0)
    return kvp_err(KVP_ERR_BACKEND, "agent_create: notification socket: %s", strerror(errno));
  /* The kernel tells who sent each datagram (notif_sender_ok). */
  int one = 1;
  if (setsockopt(ag->rx_sock, SOL_SOCKET, SO_PASSCRED, &one, sizeof one) != 0)
    return kvp_err(KVP_ERR_BACKEND, "agent_create: SO_PASSCRED: %s", strerror(errno));
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  memcpy(sa.sun_path + 1, ag->sock, ag->sock_len);
  if (bind(ag->rx_sock, (struct sockaddr *)&sa,
           (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + ag->sock_len)) != 0)
    return kvp_err(KVP_ERR_BACKEND, "agent_create: bind notification socket @%s: %s", ag->sock,
                   strerror(errno));
  return NULL;
}

static kvp_error *fake_agent_create(kvp_agent_create_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_AGENT_CREATE_ARGS_STRUCT_SIZE);
  if (e) return e;
  pthread_once(&g_once, fake_init);
  if (!g_init_ok) return kvp_err_oom();
  if (!a->name || a->name_len == 0 || a->name_len > KVP_MAX_NAME_LEN)
    return kvp_err(KVP_ERR_INVALID_PARAM, "agent_create: name must be 1..%d bytes, got %zu",
                   KVP_MAX_NAME_LEN, a->name ? a->name_len : 0);
  agent *ag = (agent *)calloc(1, sizeof *ag);
  if (!ag) return kvp_err_oom();
  ag->rx_sock = ag->stop_fd = ag->ob_wake = -1;
  atomic_init(&ag->ev_fd, -1);
  memcpy(ag->name, a->name, a->name_len);
  ag->name_len = a->name_len;
  pthread_rwlock_init(&ag->mem_lock, NULL);
  pthread_rwlock_init(&ag->peers_lock, NULL);
  pthread_mutex_init(&ag->own_lock, NULL);
  pthread_mutex_init(&ag->qlock, NULL);
  pthread_mutex_init(&ag->md_lock, NULL);
  pthread_mutex_init(&ag->ob_lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&ag->qcv, &ca);
  pthread_cond_init(&ag->donecv, NULL);
  pthread_cond_init(&ag->cancelcv, &ca);
  pthread_condattr_destroy(&ca);
  list_init(&ag->regions);
  list_init(&ag->rregions);
  list_init(&ag->dlists);
  list_init(&ag->xfers);
  atomic_init(&ag->reg_gen, 1);
  atomic_init(&ag->urgent, 0);
  ag->id = random_u64();

  if ((e = agent_parse_params(ag, a))) goto fail;
  ag->nq = kvp_nq_create(FAKE_NQ_MAX_BYTES);
  ag->workers = (pthread_t *)calloc(ag->nworkers, sizeof(pthread_t));
  if (!ag->nq || !ag->workers) {
    e = kvp_err_oom();
    goto fail;
  }
  /* Every agent has a socket and an rx thread, also with notifications
   * switched off: they answer the challenges of peers' load_remote. */
  if ((e = agent_open_sockets(ag))) goto fail;
  if (pthread_create(&ag->rx_thread, NULL, rx_main, ag) != 0) {
    e = kvp_err(KVP_ERR_BACKEND, "agent_create: cannot start the notification thread");
    goto fail;
  }
  ag->rx_started = 1;
  for (unsigned i = 0; i < ag->nworkers; i++) {
    runner *w = (runner *)calloc(1, sizeof *w);
    if (w) {
      w->ag = ag;
      w->iov = (iovbuf *)malloc(sizeof(iovbuf));
    }
    if (!w || !w->iov || pthread_create(&ag->workers[i], NULL, worker_main, w) != 0) {
      if (w) free(w->iov);
      free(w);
      e = kvp_err(KVP_ERR_BACKEND, "agent_create: cannot start worker thread %u", i);
      goto fail;
    }
    ag->workers_started++;
  }
  /* Let same-user peer processes use process_vm_* on us when the Yama LSM
   * restricts ptrace to descendants (ptrace_scope 1). Without Yama this
   * fails with EINVAL, which is fine. */
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  if ((e = kvp_ht_insert(g_agents, ag, &ag->handle))) goto fail;
  a->agent = ag->handle;
  a->caps = ag->caps;
  return NULL;
fail:
  agent_free(ag);
  return e;
}

/* Stops the threads of an agent and frees it. Everything it owns must be
 * released already (or never created). */
static void agent_free(agent *ag) {
  if (ag->rx_started) {
    uint64_t one = 1;
    ssize_t wr = write(ag->stop_fd, &one, sizeof one);
    (void)wr;
    pthread_join(ag->rx_thread, NULL);
  }
  pthread_mutex_lock(&ag->qlock);
  ag->stopping = 1;
  pthread_cond_broadcast(&ag->qcv);
  pthread_mutex_unlock(&ag->qlock);
  for (unsigned i = 0; i < ag->workers_started; i++) pthread_join(ag->workers[i], NULL);
  if (ag->rx_sock >= 0) close(ag->rx_sock);
  if (ag->stop_fd >= 0) close(ag->stop_fd);
  ob_free_all(ag);
  if (ag->ob_wake >= 0) close(ag->ob_wake);
  if (atomic_load(&ag->ev_fd) >= 0) close(atomic_load(&ag->ev_fd));
  peer *p = ag->peers;
  while (p) {
    peer *next = p->next;
    peer_unref(p);
    p = next;
  }
  while (ag->iov_free) {
    iovbuf *b = ag->iov_free;
    ag->iov_free = b->next;
    free(b);
  }
  while (ag->xfree) {
    xfer *x = ag->xfree;
    ag->xfree = (xfer *)x->link.next;
    xfer_poison(x, 0);
    xfer_free(x);
  }
  kvp_nq_destroy(ag->nq);
  free(ag->workers);
  free(ag->regs);
  pthread_rwlock_destroy(&ag->mem_lock);
  pthread_rwlock_destroy(&ag->peers_lock);
  pthread_mutex_destroy(&ag->own_lock);
  pthread_mutex_destroy(&ag->qlock);
  pthread_mutex_destroy(&ag->md_lock);
  pthread_mutex_destroy(&ag->ob_lock);
  pthread_cond_destroy(&ag->qcv);
  pthread_cond_destroy(&ag->donecv);
  pthread_cond_destroy(&ag->cancelcv);
  free(ag);
}

static kvp_error *fake_agent_destroy(kvp_agent_destroy_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_AGENT_DESTROY_ARGS_STRUCT_SIZE);
  if (e) return e;
  /* From here no call can acquire the agent; remove waits for the calls
   * (and same-process peers' workers) that hold it. */
  agent *ag = (agent *)kvp_ht_remove(g_agents, a->agent);
  if (!ag)
    return kvp_err(KVP_ERR_INVALID_PARAM, "agent_destroy: unknown or released agent handle 0x%" PRIx64,
                   a->agent);
  /* Cancel every transfer first so the workers let go of its memory. */
  pthread_mutex_lock(&ag->qlock);
  for (own_link *l = ag->xfers.next; l != &ag->xfers; l = l->next)
    xfer_cancel_locked(ag, (xfer *)l, "agent destroyed");
  pthread_mutex_unlock(&ag->qlock);
  uint64_t *hs;
  size_t n = collect_handles(ag, &ag->xfers, NULL, NULL, &hs);
  for (size_t i = 0; i < n; i++) {
    xfer *x = (xfer *)kvp_ht_remove(g_xfers, hs[i]);
    if (x) xfer_destroy(ag, x);
  }
  free(hs);
  n = collect_handles(ag, &ag->dlists, NULL, NULL, &hs);
  for (size_t i = 0; i < n; i++) {
    dlist *d = (dlist *)kvp_ht_remove(g_dlists, hs[i]);
    if (d) dlist_destroy(ag, d);
  }
  free(hs);
  n = collect_handles(ag, &ag->rregions, NULL, NULL, &hs);
  for (size_t i = 0; i < n; i++) {
    rregion *r = (rregion *)kvp_ht_remove(g_rregions, hs[i]);
    if (r) rregion_destroy(ag, r);
  }
  free(hs);
  n = collect_handles(ag, &ag->regions, NULL, NULL, &hs);
  for (size_t i = 0; i < n; i++) {
    region *r = (region *)kvp_ht_remove(g_regions, hs[i]);
    if (r) {
      own_unlink(ag, &r->link);
      region_free(r);
    }
  }
  free(hs);
  agent_free(ag);
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* Memory registration                                                      */
/* ------------------------------------------------------------------------ */

static int u64_cmp(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* One line of /proc/self/maps: the range [lo, hi), its permissions
 * ("rw-s"), and the file offset, device and inode of what it maps (inode
 * 0: anonymous memory). */
typedef struct maps_entry {
  uint64_t lo, hi, off, dev, ino;
  char perms[8];
} maps_entry;

/* Parses a line of /proc/self/maps into *m; 0 when it does not parse. */
static int maps_parse(const char *line, maps_entry *m) {
  unsigned long long lo, hi, off, ino;
  unsigned dmaj, dmin;
  char perms[8];
  if (sscanf(line, "%llx-%llx %7s %llx %x:%x %llu", &lo, &hi, perms, &off, &dmaj, &dmin, &ino) != 7) return 0;
  *m = (maps_entry){lo, hi, off, makedev(dmaj, dmin), ino, {0}};
  memcpy(m->perms, perms, sizeof perms);
  return 1;
}

/* Reports whether memory of [addr, addr + len) may vanish under a copy:
 * some of it lies in a shared or file-backed mapping (a POSIX shm object,
 * a hugetlbfs file, a CUDA IPC mapping: another process can shrink the
 * file, and a copy then takes SIGBUS), is not readable and writable, or
 * is not mapped at all, as /proc/self/maps says now. Private anonymous
 * read-write memory (malloc, a pool this process made) stays. Anything
 * unreadable counts as "may". */
static int range_may_fault(uint64_t addr, uint64_t len) {
  FILE *f = fopen("/proc/self/maps", "re");
  if (!f) return 1;
  uint64_t end = addr + len, covered = addr;
  int may = 0;
  char *line = NULL;
  size_t cap = 0;
  maps_entry m;
  while (!may && covered < end && getline(&line, &cap, f) > 0) {
    if (!maps_parse(line, &m)) {
      may = 1;
      break;
    }
    if (m.hi <= covered) continue;
    if (m.lo > covered) { /* a hole (lines are sorted by address) */
      may = 1;
      break;
    }
    /* Not readable and writable: a copy out of or into it faults too. */
    if (m.perms[3] == 's' || m.ino != 0 || m.perms[0] != 'r' || m.perms[1] != 'w') may = 1;
    covered = m.hi;
  }
  if (covered < end) may = 1;
  free(line);
  fclose(f);
  return may;
}

/* 1 if fd is a regular file with device dev and inode ino that cannot
 * shrink: sealed with F_SEAL_SHRINK (only memfds and other shmem files
 * take seals; a seal, once set, stays for the file's life), not on
 * hugetlbfs (a fault there with no huge page left takes SIGBUS), and at
 * least end bytes long. Then no page of [0, end) of a MAP_SHARED mapping
 * of it can vanish: the kernel refuses every truncation below its size
 * (EPERM), so a copy through such a mapping cannot take SIGBUS. */
static int sealed_file_is(int fd, uint64_t dev, uint64_t ino, uint64_t end, struct stat *st) {
  struct statfs sfs;
  int seals = fcntl(fd, F_GET_SEALS);
  return fstat(fd, st) == 0 && S_ISREG(st->st_mode) && (uint64_t)st->st_dev == dev && (uint64_t)st->st_ino == ino &&
         seals >= 0 && (seals & F_SEAL_SHRINK) && (uint64_t)st->st_size >= end && fstatfs(fd, &sfs) == 0 &&
         (unsigned long)sfs.f_type != FAKE_HUGETLBFS_MAGIC;
}

/* The file [addr, addr + len) maps, as /proc/self/maps says now: 1 and
 * *dev, *ino, *off (the file offset of addr) when the range lies in
 * MAP_SHARED mappings of one file, consecutive in address and in file
 * offset, readable and writable; 0 otherwise (a hole, private or
 * anonymous memory, two files, read-only). */
static int range_shared_file(uint64_t addr, uint64_t len, uint64_t *dev, uint64_t *ino, uint64_t *off) {
  FILE *f = fopen("/proc/self/maps", "re");
  if (!f) return 0;
  uint64_t end = addr + len, covered = addr, next_off = 0;
  int ok = 1;
  char *line = NULL;
  size_t cap = 0;
  maps_entry m;
  while (ok && covered < end && getline(&line, &cap, f) > 0) {
    if (!maps_parse(line, &m)) {
      ok = 0;
      break;
    }
    if (m.hi <= covered) continue;
    uint64_t here = m.off + (covered - m.lo); /* file offset of `covered` */
    if (m.lo > covered || m.perms[3] != 's' || m.ino == 0 || m.perms[0] != 'r' || m.perms[1] != 'w') {
      ok = 0;
    } else if (covered == addr) {
      *dev = m.dev;
      *ino = m.ino;
      *off = here;
    } else if (m.dev != *dev || m.ino != *ino || here != next_off) {
      ok = 0; /* another file, or the same file at other offsets */
    }
    next_off = here + (m.hi - covered);
    covered = m.hi;
  }
  free(line);
  fclose(f);
  return ok && covered >= end;
}

/* Touches every page of [addr, addr + len) once from user space, with an
 * atomic add of zero (the bytes stay what they are, whoever writes them
 * meanwhile); returns the pages touched. For memory the plugin copies
 * with memcpy (a sealed memfd it registered, a peer's mapped memory) when
 * prefault is on: on a VM that shadows page tables, the first user-mode
 * access to a page of a mapping costs about 5 us even when the page is
 * already mapped (MAP_POPULATE, the kernel's prefault), and a first
 * read leaves the first write to pay again, which the atomic write does
 * not. The caller makes sure no page can fault (sealed, within size,
 * mapped read-write). */
static uint64_t warm_for_user(uint64_t addr, uint64_t len) {
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), n = 0;
  for (uint64_t a = addr; a - addr < len; a = (a | (page - 1)) + 1) {
    __atomic_fetch_add((uint8_t *)(uintptr_t)a, 0, __ATOMIC_RELAXED);
    n++;
    if (a > UINT64_MAX - page) break;
  }
  return n;
}

/* Makes r->file_fd a descriptor of the sealed memfd r's memory maps, when
 * it maps one (range_shared_file, sealed_file_is): the host keeps a
 * descriptor of such a file open in this process while the memory is
 * registered (README, "Peer memory mapped"), so one is found by a scan of
 * /proc/self/fd (fstat of each: device and inode), and duplicated
 * (close-on-exec) for the region's life; a read-write one is preferred, a
 * peer can map only that. Returns 1 when found (the memory cannot
 * vanish), else 0 with file_fd -1: the memory is judged as before
 * (range_may_fault). prev: the regions the same register_mem call made
 * before r. */
static int region_sealed_file(region *r, region *const *prev, size_t nprev) {
  uint64_t dev = 0, ino = 0, off = 0;
  if (!range_shared_file(r->addr, r->len, &dev, &ino, &off) || off > (uint64_t)INT64_MAX ||
      r->len > (uint64_t)INT64_MAX - off)
    return 0;
  /* A host registers many regions of one pool at once (every layer's K
   * and V): a region of this call that found the file already gives it,
   * without another scan of every descriptor. */
  for (size_t i = 0; i < nprev; i++) {
    if (prev[i]->file_fd < 0 || prev[i]->file_dev != dev || prev[i]->file_ino != ino) continue;
    struct stat st;
    int fd = fcntl(prev[i]->file_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) break;
    if (!sealed_file_is(fd, dev, ino, off + r->len, &st)) { /* too short for this region */
      close(fd);
      break;
    }
    r->file_fd = fd;
    r->file_dev = dev;
    r->file_ino = ino;
    r->file_off = off;
    return 1;
  }
  DIR *d = opendir("/proc/self/fd");
  if (!d) return 0;
  int best = -1, best_rw = 0;
  struct dirent *de;
  while (!best_rw && (de = readdir(d)) != NULL) {
    char *endp;
    long n = strtol(de->d_name, &endp, 10);
    if (*endp || endp == de->d_name || n < 0 || n > INT_MAX || n == dirfd(d)) continue;
    struct stat st;
    if (!sealed_file_is((int)n, dev, ino, off + r->len, &st)) continue;
    int fl = fcntl((int)n, F_GETFL);
    int rw = fl >= 0 && (fl & O_ACCMODE) == O_RDWR && !(fl & O_PATH);
    if (best >= 0 && !rw) continue;
    int fd = fcntl((int)n, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) continue;
    /* Checked again on the duplicate: the number may have been reused in
     * between by another thread. */
    if (!sealed_file_is(fd, dev, ino, off + r->len, &st)) {
      close(fd);
      continue;
    }
    if (best >= 0) close(best);
    best = fd;
    best_rw = rw;
  }
  closedir(d);
  if (best < 0) return 0;
  r->file_fd = best;
  r->file_dev = dev;
  r->file_ino = ino;
  r->file_off = off;
  return 1;
}

static void region_free(region *r) {
  if (r->file_fd >= 0) close(r->file_fd);
  free(r);
}

static kvp_error *fake_register_mem(kvp_register_mem_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_REGISTER_MEM_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, "register_mem", &e);
  if (!ag) return e;
  size_t n = a->num_descs;
  region **rs = NULL;
  mem_range *merged = NULL;
  size_t made = 0;
  if (n == 0) goto out;
  if (!a->descs || !a->regions) {
    e = kvp_err(KVP_ERR_INVALID_PARAM, "register_mem: descs or regions is NULL");
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    const kvp_mem_desc *d = &a->descs[i];
    if (d->len == 0 || d->addr == 0 || d->len > UINT64_MAX - d->addr || d->reserved != 0 ||
        !kind_ok(d->mem_kind)) {
      e = kvp_err(KVP_ERR_INVALID_PARAM,
                  "register_mem: desc %zu (addr 0x%" PRIx64 ", len %" PRIu64 ", kind %u): need a "
                  "non-NULL address, len > 0 without overflow, kind DRAM or VRAM, reserved 0",
                  i, d->addr, d->len, d->mem_kind);
      goto out;
    }
  }
  /* Outside every lock: on a VM the pass takes about a second per GiB. */
  if (ag->prefault)
    for (size_t i = 0; i < n; i++) kvp_prefault_for_kernel(a->descs[i].addr, a->descs[i].len);
  rs = (region **)calloc(n, sizeof *rs);
  if (!rs) {
    e = kvp_err_oom();
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    region *r = (region *)calloc(1, sizeof *r);
    if (!r) {
      e = kvp_err_oom();
      goto out;
    }
    r->ag = ag;
    r->addr = a->descs[i].addr;
    r->len = a->descs[i].len;
    r->dev_id = a->descs[i].dev_id;
    r->kind = a->descs[i].mem_kind;
    r->file_fd = -1;
    r->may_fault = !region_sealed_file(r, rs, made) && range_may_fault(r->addr, r->len);
    /* Outside every lock, as the kernel's pass above. */
    if (ag->prefault && r->file_fd >= 0) atomic_fetch_add(&ag->warm_pages, warm_for_user(r->addr, r->len));
    list_init(&r->link);
    rs[made++] = r;
  }
  for (size_t i = 0; i < n; i++) {
    if ((e = kvp_ht_insert(g_regions, rs[i], &rs[i]->handle))) goto out;
  }
  /* Merge into the registration table, all or nothing. */
  pthread_rwlock_wrlock(&ag->mem_lock);
  size_t total = ag->nregs + n;
  merged = total < n ? NULL : (mem_range *)alloc_array(total, sizeof *merged);
  if (!merged) {
    pthread_rwlock_unlock(&ag->mem_lock);
    e = kvp_err_oom();
    goto out;
  }
  if (ag->nregs) memcpy(merged, ag->regs, ag->nregs * sizeof *merged);
  for (size_t i = 0; i < n; i++) {
    mem_range *m = &merged[ag->nregs + i];
    memset(m, 0, sizeof *m);
    m->addr = rs[i]->addr;
    m->len = rs[i]->len;
    m->dev_id = rs[i]->dev_id;
    m->kind = rs[i]->kind;
    m->reg = rs[i];
  }
  kvp_ranges_sort(merged, total, sizeof *merged);
  long bad = kvp_ranges_check(merged, total, sizeof *merged);
  if (bad >= 0) {
    mem_range *b = &merged[bad], *p = &merged[bad - 1];
    /* New regions are not linked into the agent's list yet. */
    int both_new = b->reg->link.next == &b->reg->link && p->reg->link.next == &p->reg->link;
    e = kvp_err(KVP_ERR_INVALID_PARAM,
                "register_mem: [0x%" PRIx64 ", +%" PRIu64 ") overlaps [0x%" PRIx64 ", +%" PRIu64
                ") (%s); nothing registered",
                b->addr, b->len, p->addr, p->len,
                both_new ? "two descs of this call" : "an existing registration of this agent");
    pthread_rwlock_unlock(&ag->mem_lock);
    goto out;
  }
  free(ag->regs);
  ag->regs = merged;
  ag->nregs = ag->capregs = total;
  merged = NULL;
  /* Counted before the table is visible to a slice (which reads the
   * count under mem_lock): no copy may see the new regions and a count
   * that misses them, and memcpy memory that may vanish. */
  for (size_t i = 0; i < n; i++)
    if (rs[i]->may_fault) atomic_fetch_add(&ag->may_fault_regs, 1);
  atomic_fetch_add(&ag->reg_gen, 1);
  pthread_rwlock_unlock(&ag->mem_lock);
  pthread_mutex_lock(&ag->own_lock);
  for (size_t i = 0; i < n; i++) {
    list_add(&ag->regions, &rs[i]->link);
    a->regions[i] = rs[i]->handle;
  }
  pthread_mutex_unlock(&ag->own_lock);
  made = 0; /* owned by the agent now */
out:
  free(merged);
  for (size_t i = 0; i < made; i++) {
    if (rs[i]->handle) kvp_ht_remove(g_regions, rs[i]->handle);
    region_free(rs[i]);
  }
  free(rs);
  agent_put(ag);
  return e;
}

static kvp_error *fake_deregister_mem(kvp_deregister_mem_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_DEREGISTER_MEM_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, "deregister_mem", &e);
  if (!ag) return e;
  size_t n = a->num_regions;
  uint64_t *sorted = NULL;
  if (n == 0) goto out;
  if (!a->regions) {
    e = kvp_err(KVP_ERR_INVALID_PARAM, "deregister_mem: regions is NULL");
    goto out;
  }
  /* Validate everything first: all or nothing. */
  for (size_t i = 0; i < n; i++) {
    region *r = (region *)obj_get(g_regions, a->regions[i], ag, "region", "deregister_mem", &e);
    if (!r) goto out;
    kvp_ht_put(g_regions, a->regions[i]);
  }
  sorted = (uint64_t *)alloc_array(n, sizeof *sorted);
  if (!sorted) {
    e = kvp_err_oom();
    goto out;
  }
  memcpy(sorted, a->regions, n * sizeof *sorted);
  qsort(sorted, n, sizeof *sorted, u64_cmp);
  for (size_t i = 1; i < n; i++) {
    if (sorted[i] == sorted[i - 1]) {
      e = kvp_err(KVP_ERR_INVALID_PARAM, "deregister_mem: region handle 0x%" PRIx64 " listed twice",
                  sorted[i]);
      goto out;
    }
  }
  /* Kill the handles first (waiting for calls that hold them), so that a
   * make_batch_xfer either saw the region alive before the reg_gen bump
   * below, or fails to acquire it. Then take them out of the registration
   * table: from then on no validation accepts them, and a running copy has
   * finished (it holds the read lock while it copies). */
  for (size_t i = 0; i < n; i++) kvp_ht_remove(g_regions, a->regions[i]);
  pthread_rwlock_wrlock(&ag->mem_lock);
  size_t k = 0;
  for (size_t i = 0; i < ag->nregs; i++) {
    uint64_t h = ag->regs[i].reg->handle;
    if (bsearch(&h, sorted, n, sizeof *sorted, u64_cmp)) {
      region *r = ag->regs[i].reg;
      own_unlink(ag, &r->link);
      if (r->may_fault) atomic_fetch_sub(&ag->may_fault_regs, 1);
      region_free(r);
    } else {
      ag->regs[k++] = ag->regs[i];
    }
  }
  ag->nregs = k;
  atomic_fetch_add(&ag->reg_gen, 1);
  /* Metadata handed out before advertises memory that is gone: stop
   * vouching for it (md_verify). */
  pthread_mutex_lock(&ag->md_lock);
  ag->md_ndig = ag->md_next = 0;
  pthread_mutex_unlock(&ag->md_lock);
  pthread_rwlock_unlock(&ag->mem_lock);
out:
  free(sorted);
  agent_put(ag);
  return e;
}

static kvp_error *fake_region_export(kvp_region_export_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_REGION_EXPORT_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, "region_export", &e);
  if (!ag) return e;
  if (!(e = need_cap(ag, KVP_CAP_REMOTE_BLOB, "region_export"))) {
    region *r = (region *)obj_get(g_regions, a->region, ag, "region", "region_export", &e);
    if (r) {
      uint8_t blob[BLOB_SIZE];
      blob_encode(ag, r, blob);
      kvp_out_bytes(a->buf, a->cap, blob, sizeof blob, &a->size);
      kvp_ht_put(g_regions, a->region);
    }
  }
  agent_put(ag);
  return e;
}

/* ------------------------------------------------------------------------ */
/* Metadata and peers                                                       */
/* ------------------------------------------------------------------------ */

static kvp_error *fake_local_metadata(kvp_local_metadata_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_LOCAL_METADATA_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, "local_metadata", &e);
  if (!ag) return e;
  pthread_rwlock_rdlock(&ag->mem_lock);
  if (ag->nregs > UINT32_MAX) {
    e = kvp_err(KVP_ERR_BACKEND, "local_metadata: too many regions");
  } else {
    size_t need = md_size(ag);
    a->size = need;
    if (a->buf && need <= a->cap) {
      md_encode(ag, a->buf);
      /* Vouch for it when a peer's load_remote asks (md_verify); under
       * mem_lock, so a deregistration cannot slip between. */
      uint8_t dig[32];
      sha256(a->buf, need, dig);
      if (!agent_vouches(ag, dig)) {
        pthread_mutex_lock(&ag->md_lock);
        memcpy(ag->md_dig[ag->md_next], dig, 32);
        ag->md_next = (ag->md_next + 1) % FAKE_MD_RING;
        if (ag->md_ndig < FAKE_MD_RING) ag->md_ndig++;
        pthread_mutex_unlock(&ag->md_lock);
      }
    }
  }
  pthread_rwlock_unlock(&ag->mem_lock);
  agent_put(ag);
  return e;
}

/* 1 if two decodings of metadata name the same agent at the same place:
 * everything but the regions. */
static int md_same_identity(const peer_md *a, const peer_md *b) {
  return a->process_token == b->process_token && a->pidns == b->pidns && a->pid == b->pid &&
         a->agent_id == b->agent_id && a->agent_handle == b->agent_handle && a->flags == b->flags &&
         a->sock_len == b->sock_len && memcmp(a->sock, b->sock, a->sock_len) == 0;
}

static kvp_error *verify_fail(const peer_md *md, const char *why) {
  return kvp_err(KVP_ERR_NOT_ALLOWED,
                 "load_remote: metadata of \"%.*s\" (pid %u) is not that process's own: %s; refused",
                 (int)md->name_len, md->name, md->pid, why);
}

/* Proves that metadata (buf, len), decoded as md, is what the agent it
 * describes handed out, so that no byte moves to a process that did not
 * send it (process_vm_* write wherever a pid and an address say). An agent
 * vouches for the digests of the metadata its local_metadata produced
 * until it deregisters memory (agent_vouches). Same process: the agent is
 * asked directly. Another process: a challenge with a fresh nonce and the
 * digest goes to the socket the metadata names, from a socket connected
 * to it; the answer must come back on it, carry the nonce, the agent id
 * and a "yes", and the kernel must report (SCM_CREDENTIALS) that the
 * process that sent it has the metadata's pid. A pidfd opened before the
 * challenge and still alive after the answer pins that process: its pid
 * cannot have passed to another one in between, and transfers check it
 * before every process_vm_* call. On success *pidfd and *tx_fd (the
 * connected socket, for notifications) are the caller's; -1 for a
 * same-process peer. */
static kvp_error *md_verify(const uint8_t *buf, size_t len, const peer_md *md, int *pidfd, int *tx_fd) {
  uint8_t dig[32];
  sha256(buf, len, dig);
  *pidfd = *tx_fd = -1;
  if (md_same_process(md)) {
    route rt = {ROUTE_LOCAL, md->pid, -1, md->agent_handle, md->agent_id, NULL};
    agent *pa = route_agent(&rt);
    if (!pa) return verify_fail(md, "no such agent lives in this process");
    int yes = agent_vouches(pa, dig);
    agent_put(pa);
    return yes ? NULL : verify_fail(md, "the agent does not vouch for it (forged or stale)");
  }
  if (md->pidns != g_pidns)
    return kvp_err(KVP_ERR_NOT_SUPPORTED,
                   "load_remote: peer \"%.*s\" runs in another pid namespace; process_vm_* cannot reach it",
                   (int)md->name_len, md->name);
  kvp_error *e = NULL;
  int pfd = pidfd_of(md->pid);
  if (pfd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOMEM))
    return kvp_err(KVP_ERR_BACKEND, "load_remote: pidfd_open(%u): %s", md->pid, strerror(errno));
  if (pfd < 0 && errno != ENOSYS) /* ESRCH, EINVAL, ENOENT (a thread, not a process) */
    return kvp_err(KVP_ERR_REMOTE_DISCONNECT, "load_remote: peer process %u of \"%.*s\" does not exist (%s)",
                   md->pid, (int)md->name_len, md->name, strerror(errno));
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &one, sizeof one) != 0 ||
      bind(fd, (struct sockaddr *)&sa, sizeof(sa_family_t)) != 0) { /* autobind */
    e = kvp_err(KVP_ERR_BACKEND, "load_remote: socket: %s", strerror(errno));
    goto fail;
  }
  memcpy(sa.sun_path + 1, md->sock, md->sock_len);
  if (connect(fd, (struct sockaddr *)&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + md->sock_len)) != 0) {
    e = errno == ECONNREFUSED || errno == ENOENT
            ? kvp_err(KVP_ERR_REMOTE_DISCONNECT, "load_remote: no agent listens on the socket of \"%.*s\" (pid %u): %s",
                      (int)md->name_len, md->name, md->pid, strerror(errno))
            : kvp_err(KVP_ERR_BACKEND, "load_remote: connect to the socket of \"%.*s\": %s", (int)md->name_len,
                      md->name, strerror(errno));
    goto fail;
  }
  uint8_t ch[CHAL_SIZE];
  memcpy(ch, CHAL_MAGIC, 4);
  kvp_put_u16(ch + 4, 1);
  kvp_put_u16(ch + 6, 0);
  kvp_put_u64(ch + 8, md->agent_id);
  kvp_put_u64(ch + 16, random_u64());
  kvp_put_u64(ch + 24, random_u64());
  memcpy(ch + 32, dig, 32);
  uint64_t deadline = now_ns() + FAKE_VERIFY_TIMEOUT_MS * 1000000ull;
  int sent = 0;
  for (;;) {
    uint64_t now = now_ns();
    if (now >= deadline) {
      e = verify_fail(md, "its socket did not answer the challenge in time");
      goto fail;
    }
    if (!sent) {
      ssize_t w = send(fd, ch, sizeof ch, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (w == (ssize_t)sizeof ch) {
        sent = 1;
      } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        e = notif_send_err(errno, md->pid);
        goto fail;
      }
    }
    struct pollfd pf = {fd, (short)(sent ? POLLIN : POLLOUT), 0};
    int ms = (int)((deadline - now) / 1000000u) + 1;
    if (poll(&pf, 1, ms) <= 0 || !sent) continue;
    uint8_t ans[ANSWER_SIZE + 1];
    union {
      struct cmsghdr h;
      char b[CMSG_SPACE(sizeof(struct ucred)) + CMSG_SPACE(16 * sizeof(int))];
    } cb;
    struct iovec iov = {ans, sizeof ans};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cb.b;
    mh.msg_controllen = sizeof cb.b;
    ssize_t n = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      e = notif_send_err(errno, md->pid);
      goto fail;
    }
    int have_cred = 0;
    struct ucred cr;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level != SOL_SOCKET) continue;
      if (c->cmsg_type == SCM_CREDENTIALS && c->cmsg_len >= CMSG_LEN(sizeof cr)) {
        memcpy(&cr, CMSG_DATA(c), sizeof cr);
        have_cred = 1;
      } else if (c->cmsg_type == SCM_RIGHTS) {
        size_t nfd = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < nfd; i++) {
          int x;
          memcpy(&x, CMSG_DATA(c) + i * sizeof(int), sizeof x);
          close(x);
        }
      }
    }
    if (n != ANSWER_SIZE || memcmp(ans, ANSWER_MAGIC, 4) != 0 || memcmp(ans + 16, ch + 16, 16) != 0)
      continue; /* not the answer to this challenge */
    if (!have_cred || (uint32_t)cr.pid != md->pid) {
      e = verify_fail(md, "the agent that answers on its socket lives in another process");
      goto fail;
    }
    if (kvp_get_u64(ans + 8) != md->agent_id || kvp_get_u32(ans + 32) == VOUCH_NOT_ME) {
      e = verify_fail(md, "another agent answers on its socket");
      goto fail;
    }
    if (kvp_get_u32(ans + 32) != VOUCH_YES) {
      e = verify_fail(md, "the agent does not vouch for it (forged or stale)");
      goto fail;
    }
    break;
  }
  if (pfd >= 0 && pidfd_exited(pfd)) {
    e = kvp_err(KVP_ERR_REMOTE_DISCONNECT, "load_remote: peer process %u of \"%.*s\" exited", md->pid,
                (int)md->name_len, md->name);
    goto fail;
  }
  *pidfd = pfd;
  *tx_fd = fd;
  return NULL;
fail:
  if (fd >= 0) close(fd);
  if (pfd >= 0) close(pfd);
  return e;
}

/* pidfd_getfd (Linux 5.6): a duplicate of descriptor fd of the process
 * of pidfd, or -1 with errno. The kernel allows it under the same ptrace
 * check (PTRACE_MODE_ATTACH_REALCREDS) as process_vm_*; the duplicate is
 * close-on-exec. */
static int pidfd_getfd_of(int pidfd, int fd) {
#ifdef KVP_FAKE_TEST_HOOKS
  int err = atomic_load(&g_test_getfd_errno);
  if (err) {
    errno = err;
    return -1;
  }
#endif
#ifdef SYS_pidfd_getfd
  return (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
#else
  (void)pidfd;
  (void)fd;
  errno = ENOSYS;
  return -1;
#endif
}

/* Reserves room for one more peer mapping of n bytes in the process's
 * budget (FAKE_MAP_MAX_*); 0 when there is none. */
static int map_budget_take(uint64_t n) {
  if (atomic_fetch_add(&g_map_count, 1) >= FAKE_MAP_MAX_COUNT) {
    atomic_fetch_sub(&g_map_count, 1);
    return 0;
  }
  uint64_t before = atomic_fetch_add(&g_map_bytes, n);
  if (before + n > FAKE_MAP_MAX_BYTES || before + n < before) {
    atomic_fetch_sub(&g_map_bytes, n);
    atomic_fetch_sub(&g_map_count, 1);
    return 0;
  }
  return 1;
}

/* Maps the regions of a cross-process peer that metadata v2 says are
 * sealed memfds (see "Peer memory mapped"): each file is taken with
 * pidfd_getfd on the pidfd of the process that proved the metadata its
 * own (md_verify), so the descriptor numbers are read in that very
 * process, and the peer's words are checked, never trusted: the file must
 * be the one named (device, inode), regular, not hugetlbfs, sealed with
 * F_SEAL_SHRINK and at least as long as the region's window
 * (sealed_file_is). Each window is mapped MAP_SHARED read-write, with
 * MAP_POPULATE when the file has at least that many bytes allocated (so
 * that a sparse file's holes are not filled for nothing); the mapping
 * keeps the file, and the descriptor is closed. A region that fails any
 * step, or that the process's budget has no room for, keeps
 * process_vm_*. With warm (the agent's prefault), each populated window
 * is touched from user space (warm_for_user), adding the pages to
 * *warmed. Returns NULL when no region is mapped (or out of memory). */
static rmaps *peer_maps_take(const peer_md *md, int pidfd, int warm, uint64_t *warmed) {
  if (pidfd < 0 || md->nfiles == 0) return NULL;
  rmaps *ms = (rmaps *)calloc(1, sizeof *ms + md->nfiles * sizeof(rmap));
  int *fds = (int *)malloc(md->nfiles * sizeof *fds);
  if (!ms || !fds) {
    free(ms);
    free(fds);
    return NULL;
  }
  atomic_init(&ms->refs, 1);
  const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  for (size_t i = 0; i < md->nfiles; i++) {
    const md_file *mf = &md->files[i];
    const mem_range *g = &md->regions[mf->region];
    uint64_t end = mf->off + g->len; /* no overflow: md_decode */
    fds[i] = -1;
    /* One file serves several regions: a descriptor taken for an earlier
     * entry, and found to be this device and inode, is that file. */
    int fd = -1;
    struct stat st;
    for (size_t j = 0; j < i && fd < 0; j++)
      if (fds[j] >= 0 && md->files[j].dev == mf->dev && md->files[j].ino == mf->ino) fd = fds[j];
    if (fd < 0) {
      fd = pidfd_getfd_of(pidfd, (int)mf->fd);
      if (fd >= 0 && !sealed_file_is(fd, mf->dev, mf->ino, 0, &st)) {
        close(fd);
        fd = -1;
      }
      fds[i] = fd;
    }
    if (fd < 0 || !sealed_file_is(fd, mf->dev, mf->ino, end, &st)) continue;
    uint64_t moff = mf->off & ~(page - 1);
    uint64_t mlen = ((end - moff) + page - 1) & ~(page - 1);
    if (mlen > SIZE_MAX || !map_budget_take(mlen)) continue;
    int populate = (uint64_t)st.st_blocks * 512u >= mlen ? MAP_POPULATE : 0;
    void *map = mmap(NULL, (size_t)mlen, PROT_READ | PROT_WRITE, MAP_SHARED | populate, fd, (off_t)moff);
    if (map == MAP_FAILED) {
      atomic_fetch_sub(&g_map_bytes, mlen);
      atomic_fetch_sub(&g_map_count, 1);
      continue;
    }
    ms->e[ms->n++] = (rmap){g->addr, g->len, (uint8_t *)map + (mf->off - moff), map, (size_t)mlen, mf->dev, mf->ino};
    /* Only a window whose pages exist: a sparse one is left sparse. */
    if (warm && populate) *warmed += warm_for_user((uint64_t)(uintptr_t)map, mlen);
  }
  for (size_t i = 0; i < md->nfiles; i++)
    if (fds[i] >= 0) close(fds[i]);
  free(fds);
  if (ms->n == 0) {
    free(ms);
    return NULL;
  }
  return ms; /* files are sorted by region index, regions by addr */
}

static kvp_error *reload_refused(const peer *p) {
  return kvp_err(KVP_ERR_NOT_ALLOWED,
                 "load_remote: peer \"%.*s\" is loaded as another agent (other process, agent id or "
                 "socket); refused, the loaded peer is unchanged (remove_remote it first if it restarted)",
                 (int)p->name_len, p->name);
}

static kvp_error *fake_load_remote(kvp_load_remote_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_LOAD_REMOTE_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, "load_remote", &e);
  if (!ag) return e;
  peer_md *md = NULL;
  rmaps *maps = NULL, *old_maps = NULL;
  int pidfd = -1, tx_fd = -1;
  if ((e = md_decode(a->metadata, a->metadata_len, &md))) goto out;
  uint8_t dig[32];
  sha256(a->metadata, a->metadata_len, dig);
  /* A loaded name keeps its identity: metadata that reuses it with
   * another process, agent id or socket is refused before anything
   * changes; the same metadata again is idempotent. */
  pthread_rwlock_rdlock(&ag->peers_lock);
  peer *p = peer_find(ag, md->name, md->name_len);
  int same = 0;
  if (p && !md_same_identity(p->md, md)) e = reload_refused(p);
  else if (p) same = memcmp(p->digest, dig, 32) == 0;
  if (same) {
    a->peer_name = p->name;
    a->peer_name_len = p->name_len;
  }
  pthread_rwlock_unlock(&ag->peers_lock);
  if (e || same) goto out;
  /* Outside peers_lock: it may wait for the peer's answer. */
  if ((e = md_verify(a->metadata, a->metadata_len, md, &pidfd, &tx_fd))) goto out;
  /* Outside peers_lock too (MAP_POPULATE takes a while); with the pidfd
   * md_verify proved. A reload maps afresh: the files may be others. */
  uint64_t warmed = 0;
  maps = peer_maps_take(md, pidfd, ag->prefault, &warmed);
  atomic_fetch_add(&ag->warm_pages, warmed);
  pthread_rwlock_wrlock(&ag->peers_lock);
  p = peer_find(ag, md->name, md->name_len);
  if (p && !md_same_identity(p->md, md)) {
    e = reload_refused(p);
  } else if (p) { /* the same agent, with other memory: replace */
    peer_md *old = p->md;
    p->md = md;
    md = NULL;
    p->gen++;
    memcpy(p->digest, dig, 32);
    md_free(old);
    old_maps = p->maps;
    p->maps = maps;
    maps = NULL;
  } else {
    p = (peer *)calloc(1, sizeof *p);
    if (!p) {
      e = kvp_err_oom();
    } else {
      atomic_init(&p->refs, 1);
      p->md = md;
      p->gen = 1;
      memcpy(p->digest, dig, 32);
      memcpy(p->name, md->name, md->name_len);
      p->name_len = md->name_len;
      p->pid = md->pid;
      p->agent_id = md->agent_id;
      p->no_notif = (md->flags & MD_FLAG_NO_NOTIF) != 0;
      p->pidfd = pidfd;
      p->tx_fd = tx_fd;
      p->maps = maps;
      maps = NULL;
      pidfd = tx_fd = -1;
      md = NULL;
      p->next = ag->peers;
      ag->peers = p;
    }
  }
  if (!e) {
    /* The name lives in the peer record until remove_remote or destroy. */
    a->peer_name = p->name;
    a->peer_name_len = p->name_len;
  }
  pthread_rwlock_unlock(&ag->peers_lock);
out:
  md_free(md);
  rmaps_unref(maps);
  rmaps_unref(old_maps);
  if (pidfd >= 0) close(pidfd);
  if (tx_fd >= 0) close(tx_fd);
  agent_put(ag);
  return e;
}

static int xfer_of_peer(const own_link *l, const void *ctx) {
  return ((const xfer *)l)->peer == (const peer *)ctx;
}

static kvp_error *peer_removed(const peer *p, const char *fn) {
  return kvp_err(KVP_ERR_NOT_FOUND, "%s: peer \"%.*s\" was removed", fn, (int)p->name_len, p->name);
}

static kvp_error *fake_remove_remote(kvp_remove_remote_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_REMOVE_REMOTE_ARGS_STRUCT_SIZE);
  if (e) return e;
  if ((e = peer_name_check(a->peer_name, a->peer_name_len, "remove_remote"))) return e;
  agent *ag = agent_get(a->agent, "remove_remote", &e);
  if (!ag) return e;
  pthread_rwlock_wrlock(&ag->peers_lock);
  peer *p = peer_find(ag, a->peer_name, a->peer_name_len);
  if (p) {
    peer **pp = &ag->peers;
    while (*pp != p) pp = &(*pp)->next;
    *pp = p->next;
    p->next = NULL;
    atomic_store(&p->removed, 1); /* posts of its transfers fail from now on */
  }
  pthread_rwlock_unlock(&ag->peers_lock);
  if (!p) {
    e = peer_unknown(ag, a->peer_name, a->peer_name_len, "remove_remote");
    agent_put(ag);
    return e;
  }
  /* Cancel its transfers. Every handle that refers to the peer (transfers,
   * remote dlists, remote regions) stays valid until the caller releases
   * it, but is dead: poll of a cancelled transfer says CANCELED, and post,
   * make_prepped_xfer and make_batch_xfer say NOT_FOUND (p->removed). */
  uint64_t *hs;
  size_t n = collect_handles(ag, &ag->xfers, xfer_of_peer, p, &hs);
  char msg[KVP_MAX_NAME_LEN + 64];
  snprintf(msg, sizeof msg, "transfer cancelled: peer \"%.*s\" was removed", (int)p->name_len, p->name);
  for (size_t i = 0; i < n; i++) {
    xfer *x = (xfer *)kvp_ht_acquire(g_xfers, hs[i]);
    if (!x) continue;
    pthread_mutex_lock(&ag->qlock);
    xfer_cancel_locked(ag, x, msg);
    pthread_mutex_unlock(&ag->qlock);
    kvp_ht_put(g_xfers, hs[i]);
  }
  free(hs);
  peer_unref(p); /* the list's reference; dead handles keep theirs */
  agent_put(ag);
  return NULL;
}

static kvp_error *fake_remote_region_import(kvp_remote_region_import_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_REMOTE_REGION_IMPORT_ARGS_STRUCT_SIZE);
  if (e) return e;
  if ((e = peer_name_check(a->peer_name, a->peer_name_len, "remote_region_import"))) return e;
  agent *ag = agent_get(a->agent, "remote_region_import", &e);
  if (!ag) return e;
  blob_fields b;
  memset(&b, 0, sizeof b);
  if (a->blob) {
    if ((e = need_cap(ag, KVP_CAP_REMOTE_BLOB, "remote_region_import (blob)"))) goto out;
    if ((e = blob_decode(a->blob, a->blob_len, &b))) goto out;
  } else {
    if ((e = need_cap(ag, KVP_CAP_REMOTE_ADDR, "remote_region_import (address)"))) goto out;
    if (a->len == 0 || a->len > UINT64_MAX - a->addr || !kind_ok(a->mem_kind)) {
      e = kvp_err(KVP_ERR_INVALID_PARAM,
                  "remote_region_import: need len > 0 without overflow and kind DRAM or VRAM");
      goto out;
    }
    b.addr = a->addr;
    b.len = a->len;
    b.dev_id = a->dev_id;
    b.kind = a->mem_kind;
  }
  rregion *r = (rregion *)calloc(1, sizeof *r);
  if (!r) {
    e = kvp_err_oom();
    goto out;
  }
  pthread_rwlock_rdlock(&ag->peers_lock);
  peer *p = peer_find(ag, a->peer_name, a->peer_name_len);
  if (!p) {
    e = peer_unknown(ag, a->peer_name, a->peer_name_len, "remote_region_import");
  } else if (a->blob && b.agent_id != p->md->agent_id) {
    e = kvp_err(KVP_ERR_INVALID_PARAM,
                "remote_region_import: blob was exported by agent id %016" PRIx64
                ", but peer \"%.*s\" is agent id %016" PRIx64,
                b.agent_id, (int)p->name_len, p->name, p->md->agent_id);
  } else if (!a->blob && !blocks_inside(p->md->regions, p->md->nregions, b.addr, b.len, 0, 1,
                                        b.dev_id, b.kind)) {
    e = kvp_err(KVP_ERR_NOT_FOUND,
                "remote_region_import: [0x%" PRIx64 ", +%" PRIu64 ") %s dev %" PRIu64
                " is not inside memory peer \"%.*s\" advertised",
                b.addr, b.len, kind_name(b.kind), b.dev_id, (int)p->name_len, p->name);
  } else {
    peer_ref(p);
    r->peer = p;
    r->agent_id = p->md->agent_id;
  }
  pthread_rwlock_unlock(&ag->peers_lock);
  if (e) {
    free(r);
    goto out;
  }
  r->ag = ag;
  r->addr = b.addr;
  r->len = b.len;
  r->dev_id = b.dev_id;
  r->kind = b.kind;
  if ((e = kvp_ht_insert(g_rregions, r, &r->handle))) {
    peer_unref(r->peer);
    free(r);
    goto out;
  }
  pthread_mutex_lock(&ag->own_lock);
  list_add(&ag->rregions, &r->link);
  pthread_mutex_unlock(&ag->own_lock);
  a->addr = r->addr;
  a->len = r->len;
  a->dev_id = r->dev_id;
  a->mem_kind = r->kind;
  a->rregion = r->handle;
out:
  agent_put(ag);
  return e;
}

static kvp_error *fake_remote_region_release(kvp_remote_region_release_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_REMOTE_REGION_RELEASE_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, "remote_region_release", &e);
  if (!ag) return e;
  rregion *r = (rregion *)obj_get(g_rregions, a->rregion, ag, "remote region", "remote_region_release", &e);
  if (r) {
    kvp_ht_put(g_rregions, a->rregion);
    r = (rregion *)kvp_ht_remove(g_rregions, a->rregion);
    if (r)
      rregion_destroy(ag, r);
    else
      e = kvp_err(KVP_ERR_INVALID_PARAM, "remote_region_release: handle 0x%" PRIx64 " released twice",
                  a->rregion);
  }
  agent_put(ag);
  return e;
}

/* ------------------------------------------------------------------------ */
/* Prepared descriptor lists                                                */
/* ------------------------------------------------------------------------ */

static kvp_error *desc_shape_check(const agent *ag, const kvp_xfer_desc *d, size_t i, const char *fn) {
  uint64_t end;
  if (d->len == 0 || d->count == 0)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: descriptor %zu has len %" PRIu64 " and count %" PRIu64
                   " (both must be > 0)", fn, i, d->len, d->count);
  if (d->count > 1 && !(ag->caps & KVP_CAP_STRIDED))
    return kvp_err(KVP_ERR_NOT_SUPPORTED, "%s: descriptor %zu is strided (count %" PRIu64
                   ") but capability strided is switched off", fn, i, d->count);
  if (!kvp_strided_end(d->addr, d->len, d->stride, d->count, &end))
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: descriptor %zu overflows 64-bit addresses", fn, i);
  return NULL;
}

static kvp_error *fake_prep_dlist(kvp_prep_dlist_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_PREP_DLIST_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, "prep_dlist", &e);
  if (!ag) return e;
  int remote = a->peer_name && a->peer_name_len > 0;
  dlist *d = NULL;
  if ((e = need_cap(ag, KVP_CAP_PREPPED, "prep_dlist"))) goto out;
  if (remote && (e = need_cap(ag, KVP_CAP_REMOTE_ADDR, "prep_dlist (remote)"))) goto out;
  if (remote && (e = peer_name_check(a->peer_name, a->peer_name_len, "prep_dlist"))) goto out;
  if (!kind_ok(a->mem_kind)) {
    e = kvp_err(KVP_ERR_INVALID_PARAM, "prep_dlist: unknown memory kind %u", a->mem_kind);
    goto out;
  }
  if (a->num_descs && !a->descs) {
    e = kvp_err(KVP_ERR_INVALID_PARAM, "prep_dlist: descs is NULL");
    goto out;
  }
  for (size_t i = 0; i < a->num_descs; i++)
    if ((e = desc_shape_check(ag, &a->descs[i], i, "prep_dlist"))) goto out;
  d = (dlist *)calloc(1, sizeof *d);
  if (!d || !(d->descs = (kvp_xfer_desc *)alloc_array(a->num_descs, sizeof(kvp_xfer_desc)))) {
    e = kvp_err_oom();
    goto out;
  }
  d->ag = ag;
  d->kind = a->mem_kind;
  d->n = a->num_descs;
  if (d->n) memcpy(d->descs, a->descs, d->n * sizeof(kvp_xfer_desc));
  for (size_t i = 0; i < d->n; i++)
    if (d->descs[i].count == 1) d->descs[i].stride = 0;

  const mem_range *tab;
  size_t ntab;
  long bad = -1;
  if (remote) {
    pthread_rwlock_rdlock(&ag->peers_lock);
    peer *p = peer_find(ag, a->peer_name, a->peer_name_len);
    if (!p) {
      pthread_rwlock_unlock(&ag->peers_lock);
      e = peer_unknown(ag, a->peer_name, a->peer_name_len, "prep_dlist");
      goto out;
    }
    tab = p->md->regions;
    ntab = p->md->nregions;
    for (size_t i = 0; i < d->n && bad < 0; i++) {
      const kvp_xfer_desc *x = &d->descs[i];
      if (!blocks_inside(tab, ntab, x->addr, x->len, x->stride, x->count, x->dev_id, d->kind)) bad = (long)i;
    }
    if (bad < 0) {
      peer_ref(p);
      d->peer = p;
      d->agent_id = p->md->agent_id;
      d->gen = p->gen;
    }
    pthread_rwlock_unlock(&ag->peers_lock);
  } else {
    pthread_rwlock_rdlock(&ag->mem_lock);
    for (size_t i = 0; i < d->n && bad < 0; i++) {
      const kvp_xfer_desc *x = &d->descs[i];
      if (!blocks_inside(ag->regs, ag->nregs, x->addr, x->len, x->stride, x->count, x->dev_id, d->kind))
        bad = (long)i;
    }
    d->gen = atomic_load(&ag->reg_gen);
    pthread_rwlock_unlock(&ag->mem_lock);
  }
  if (bad >= 0) {
    const kvp_xfer_desc *x = &d->descs[bad];
    e = kvp_err(KVP_ERR_NOT_FOUND,
                "prep_dlist: descriptor %ld (addr 0x%" PRIx64 ", len %" PRIu64 ", stride %" PRIu64
                ", count %" PRIu64 ", %s dev %" PRIu64 ") is not inside memory %s%.*s%s",
                bad, x->addr, x->len, x->stride, x->count, kind_name(d->kind), x->dev_id,
                remote ? "advertised by peer \"" : "registered on this agent", remote ? (int)a->peer_name_len : 0,
                remote ? a->peer_name : "", remote ? "\"" : "");
    goto out;
  }
  if ((e = kvp_ht_insert(g_dlists, d, &d->handle))) goto out;
  pthread_mutex_lock(&ag->own_lock);
  list_add(&ag->dlists, &d->link);
  pthread_mutex_unlock(&ag->own_lock);
  a->dlist = d->handle;
  d = NULL;
out:
  if (d) {
    peer_unref(d->peer);
    free(d->descs);
    free(d);
  }
  agent_put(ag);
  return e;
}

static kvp_error *fake_release_dlist(kvp_release_dlist_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_RELEASE_DLIST_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, "release_dlist", &e);
  if (!ag) return e;
  if (!(e = need_cap(ag, KVP_CAP_PREPPED, "release_dlist"))) {
    dlist *d = (dlist *)obj_get(g_dlists, a->dlist, ag, "dlist", "release_dlist", &e);
    if (d) {
      kvp_ht_put(g_dlists, a->dlist);
      d = (dlist *)kvp_ht_remove(g_dlists, a->dlist);
      if (d)
        dlist_destroy(ag, d);
      else
        e = kvp_err(KVP_ERR_INVALID_PARAM, "release_dlist: handle 0x%" PRIx64 " released twice", a->dlist);
    }
  }
  agent_put(ag);
  return e;
}

/* ------------------------------------------------------------------------ */
/* Building transfers                                                       */
/* ------------------------------------------------------------------------ */

static kvp_error *xfer_common_check(agent *ag, kvp_op op, const kvp_notif *nt, const char *fn) {
  if (op != KVP_OP_READ && op != KVP_OP_WRITE)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: op %u is neither READ (0) nor WRITE (1)", fn, op);
  if (nt->has_notif) {
    kvp_error *e = need_cap(ag, KVP_CAP_NOTIF, fn);
    if (!e) e = notif_len_check(nt->msg, nt->msg_len, fn);
    return e;
  }
  return NULL;
}

/* A transfer with room for n pairs and a copy of the notif, not yet
 * published: one from the agent's cache of released transfers (only its
 * first XFER_CLEARED bytes are cleared; pairs and notification reuse its
 * buffers when they fit), else a new one. Up to FAKE_INLINE_PAIRS pairs
 * live inside the struct. A transfer that will not be published goes back
 * with xfer_retire(ag, x, 0). */
static kvp_error *xfer_alloc(agent *ag, kvp_op op, size_t n, const kvp_notif *nt, xfer **out) {
  xfer *x = NULL;
  pthread_mutex_lock(&ag->own_lock);
  if ((x = ag->xfree)) {
    ag->xfree = (xfer *)x->link.next;
    ag->nxfree--;
  }
  pthread_mutex_unlock(&ag->own_lock);
  if (x) {
    xfer_poison(x, 0);
    memset(x, 0, XFER_CLEARED);
    x->cancel_msg[0] = 0;
    x->err_msg[0] = 0;
  } else if (!(x = (xfer *)calloc(1, sizeof *x))) {
    return kvp_err_oom();
  }
  x->ag = ag;
  x->op = op;
  x->npairs = n;
  atomic_init(&x->state, X_IDLE);
  atomic_init(&x->cancel, 0);
  list_init(&x->link);
  if (n <= FAKE_INLINE_PAIRS) {
    x->pairs = x->inline_pairs;
  } else {
    if (n > x->heap_cap) {
      free(x->heap_pairs);
      x->heap_cap = 0;
      if (!(x->heap_pairs = (xpair *)alloc_array(n, sizeof(xpair)))) {
        xfer_retire(ag, x, 0);
        return kvp_err_oom();
      }
      x->heap_cap = n;
    }
    x->pairs = x->heap_pairs;
  }
  if (nt->has_notif) {
    size_t need = nt->msg_len ? nt->msg_len : 1;
    if (need > x->notif_cap) {
      free(x->notif);
      x->notif_cap = 0;
      if (!(x->notif = (uint8_t *)malloc(need))) {
        xfer_retire(ag, x, 0);
        return kvp_err_oom();
      }
      x->notif_cap = need;
    }
    x->has_notif = 1;
    x->notif_len = nt->msg_len;
    if (nt->msg_len) memcpy(x->notif, nt->msg, nt->msg_len);
  }
  *out = x;
  return NULL;
}

static kvp_error *xfer_publish(agent *ag, xfer *x, uint64_t *out) {
  kvp_error *e = kvp_ht_insert(g_xfers, x, &x->handle);
  if (e) {
    xfer_retire(ag, x, 0);
    return e;
  }
  pthread_mutex_lock(&ag->own_lock);
  list_add(&ag->xfers, &x->link);
  pthread_mutex_unlock(&ag->own_lock);
  *out = x->handle;
  return NULL;
}

static kvp_error *add_bytes(xfer *x, uint64_t len, uint64_t count, const char *fn) {
  if (count > UINT64_MAX / len || len * count > UINT64_MAX - x->total_bytes)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: transfer size overflows 64 bits", fn);
  x->total_bytes += len * count;
  return NULL;
}

static kvp_error *fake_make_prepped_xfer(kvp_make_prepped_xfer_args *a) {
  const char *fn = "make_prepped_xfer";
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_MAKE_PREPPED_XFER_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, fn, &e);
  if (!ag) return e;
  dlist *ld = NULL, *rd = NULL;
  xfer *x = NULL;
  if ((e = need_cap(ag, KVP_CAP_PREPPED, fn))) goto out;
  if ((e = xfer_common_check(ag, a->op, &a->notif, fn))) goto out;
  if (a->num_local_indices != a->num_remote_indices) {
    e = kvp_err(KVP_ERR_INVALID_PARAM, "%s: %zu local indices but %zu remote indices", fn,
                a->num_local_indices, a->num_remote_indices);
    goto out;
  }
  size_t n = a->num_local_indices;
  if (n && (!a->local_indices || !a->remote_indices)) {
    e = kvp_err(KVP_ERR_INVALID_PARAM, "%s: index array is NULL", fn);
    goto out;
  }
  if (!(ld = (dlist *)obj_get(g_dlists, a->local_dlist, ag, "dlist", fn, &e))) goto out;
  if (!(rd = (dlist *)obj_get(g_dlists, a->remote_dlist, ag, "dlist", fn, &e))) goto out;
  if (ld->peer || !rd->peer) {
    e = kvp_err(KVP_ERR_INVALID_PARAM, "%s: local_dlist must be a local dlist and remote_dlist a remote one", fn);
    goto out;
  }
  if (atomic_load(&rd->peer->removed)) {
    e = peer_removed(rd->peer, fn);
    goto out;
  }
  if ((e = xfer_alloc(ag, a->op, n, &a->notif, &x))) goto out;
  for (size_t i = 0; i < n; i++) {
    int32_t li = a->local_indices[i], ri = a->remote_indices[i];
    if (li < 0 || (size_t)li >= ld->n || ri < 0 || (size_t)ri >= rd->n) {
      e = kvp_err(KVP_ERR_INVALID_PARAM,
                  "%s: pair %zu: index %d into the local dlist (%zu descs) or %d into the remote "
                  "dlist (%zu descs) is out of range",
                  fn, i, li, ld->n, ri, rd->n);
      goto out;
    }
    const kvp_xfer_desc *l = &ld->descs[li], *r = &rd->descs[ri];
    if (l->len != r->len || l->count != r->count) {
      e = kvp_err(KVP_ERR_MISMATCH,
                  "%s: pair %zu: local desc %d has len %" PRIu64 " count %" PRIu64
                  ", remote desc %d has len %" PRIu64 " count %" PRIu64,
                  fn, i, li, l->len, l->count, ri, r->len, r->count);
      goto out;
    }
    xpair *p = &x->pairs[i];
    p->laddr = l->addr;
    p->raddr = r->addr;
    p->len = l->len;
    p->count = l->count;
    p->lstride = l->stride;
    p->rstride = r->stride;
    p->ldev = l->dev_id;
    p->rdev = r->dev_id;
    p->lkind = ld->kind;
    p->rkind = rd->kind;
    if ((e = add_bytes(x, p->len, p->count, fn))) goto out;
  }
  x->basis = BASIS_ADVERTISED;
  x->desc_count = n;
  x->local_gen = ld->gen;
  x->peer_gen = rd->gen;
  x->agent_id = rd->agent_id;
  peer_ref(rd->peer);
  x->peer = rd->peer;
  e = xfer_publish(ag, x, &a->xfer);
  x = NULL;
out:
  if (x) xfer_retire(ag, x, 0);
  if (ld) kvp_ht_put(g_dlists, a->local_dlist);
  if (rd) kvp_ht_put(g_dlists, a->remote_dlist);
  agent_put(ag);
  return e;
}

static kvp_error *fake_make_batch_xfer(kvp_make_batch_xfer_args *a) {
  const char *fn = "make_batch_xfer";
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_MAKE_BATCH_XFER_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, fn, &e);
  if (!ag) return e;
  /* Read before the regions are acquired: see deregister_mem. */
  uint64_t gen0 = atomic_load(&ag->reg_gen);
  size_t np = a->num_pairs, ne = a->num_entries, got = 0;
  region **lr = NULL;
  rregion **rr = NULL;
  xfer *x = NULL;
  peer *p = NULL;
  if ((e = need_cap(ag, KVP_CAP_BATCH, fn))) goto out;
  if ((e = xfer_common_check(ag, a->op, &a->notif, fn))) goto out;
  if ((np && !a->pairs) || (ne && !a->entries)) {
    e = kvp_err(KVP_ERR_INVALID_PARAM, "%s: pairs or entries is NULL", fn);
    goto out;
  }
  if (np == 0 && (ne || a->notif.has_notif)) {
    e = kvp_err(KVP_ERR_INVALID_PARAM, "%s: no region pairs (entries and notifications need a peer)", fn);
    goto out;
  }
  lr = (region **)calloc(np ? np : 1, sizeof *lr);
  rr = (rregion **)calloc(np ? np : 1, sizeof *rr);
  if (!lr || !rr) {
    e = kvp_err_oom();
    goto out;
  }
  for (got = 0; got < np; got++) {
    if (!(lr[got] = (region *)obj_get(g_regions, a->pairs[got].local, ag, "region", fn, &e))) break;
    if (!(rr[got] = (rregion *)obj_get(g_rregions, a->pairs[got].remote, ag, "remote region", fn, &e))) {
      kvp_ht_put(g_regions, a->pairs[got].local);
      lr[got] = NULL;
      break;
    }
    if (got > 0 && (rr[got]->peer != rr[0]->peer || rr[got]->agent_id != rr[0]->agent_id)) {
      e = kvp_err(KVP_ERR_MISMATCH,
                  "%s: pair %zu's remote region belongs to peer \"%.*s\", pair 0's to \"%.*s\"; one "
                  "transfer talks to one peer",
                  fn, got, (int)rr[got]->peer->name_len, rr[got]->peer->name,
                  (int)rr[0]->peer->name_len, rr[0]->peer->name);
      got++;
      goto out;
    }
  }
  if (e) goto out;
  if (np && atomic_load(&rr[0]->peer->removed)) {
    e = peer_removed(rr[0]->peer, fn);
    goto out;
  }
  if ((e = xfer_alloc(ag, a->op, ne, &a->notif, &x))) goto out;
  for (size_t i = 0; i < ne; i++) {
    const kvp_batch_entry *en = &a->entries[i];
    if (en->pair >= np || en->reserved != 0) {
      e = kvp_err(KVP_ERR_INVALID_PARAM, "%s: entry %zu: pair index %u out of range (%zu pairs) or reserved != 0",
                  fn, i, en->pair, np);
      goto out;
    }
    if (en->len == 0 || en->count == 0) {
      e = kvp_err(KVP_ERR_INVALID_PARAM, "%s: entry %zu: len and count must be > 0", fn, i);
      goto out;
    }
    if (en->count > 1 && !(ag->caps & KVP_CAP_STRIDED)) {
      e = kvp_err(KVP_ERR_NOT_SUPPORTED, "%s: entry %zu is strided (count %" PRIu64
                  ") but capability strided is switched off", fn, i, en->count);
      goto out;
    }
    const region *l = lr[en->pair];
    const rregion *r = rr[en->pair];
    uint64_t ls = en->count > 1 ? en->local_stride : 0, rs = en->count > 1 ? en->remote_stride : 0;
    int lok = kvp_strided_in(en->local_offset, en->len, ls, en->count, 0, l->len);
    int rok = kvp_strided_in(en->remote_offset, en->len, rs, en->count, 0, r->len);
    if (!lok || !rok) {
      e = kvp_err(KVP_ERR_INVALID_PARAM,
                  "%s: entry %zu: %s blocks (offset %" PRIu64 ", len %" PRIu64 ", stride %" PRIu64
                  ", count %" PRIu64 ") reach beyond the %s region of %" PRIu64 " bytes; no byte moved",
                  fn, i, lok ? "remote" : "local", lok ? en->remote_offset : en->local_offset, en->len,
                  lok ? rs : ls, en->count, lok ? "remote" : "local", lok ? r->len : l->len);
      goto out;
    }
    xpair *pp = &x->pairs[i];
    pp->laddr = l->addr + en->local_offset;
    pp->raddr = r->addr + en->remote_offset;
    pp->len = en->len;
    pp->count = en->count;
    pp->lstride = ls;
    pp->rstride = rs;
    pp->ldev = l->dev_id;
    pp->rdev = r->dev_id;
    pp->lkind = l->kind;
    pp->rkind = r->kind;
    if ((e = add_bytes(x, pp->len, pp->count, fn))) goto out;
  }
  x->basis = BASIS_REGIONS;
  x->desc_count = ne;
  /* The local regions were alive at gen0; a deregistration since then
   * bumped reg_gen and post re-checks. */
  x->local_gen = gen0;
  if (np) {
    p = rr[0]->peer;
    peer_ref(p);
    x->peer = p;
    x->agent_id = rr[0]->agent_id;
  }
  e = xfer_publish(ag, x, &a->xfer);
  x = NULL;
out:
  if (x) xfer_retire(ag, x, 0);
  for (size_t i = 0; i < got && lr && rr; i++) {
    if (lr[i]) kvp_ht_put(g_regions, a->pairs[i].local);
    if (rr[i]) kvp_ht_put(g_rregions, a->pairs[i].remote);
  }
  free(lr);
  free(rr);
  agent_put(ag);
  return e;
}

/* ------------------------------------------------------------------------ */
/* Transfer lifecycle                                                       */
/* ------------------------------------------------------------------------ */

/* Checks a transfer against the current state of its peer and memory and
 * fills its route. Called by post while the transfer is idle. */
static kvp_error *xfer_prepare(agent *ag, xfer *x) {
  const char *fn = "post_xfer";
  kvp_error *e = NULL;
  rmaps *old_maps = NULL;
  x->rt.kind = ROUTE_NONE;
  x->rt.pidfd = -1;
  if (x->peer) {
    pthread_rwlock_rdlock(&ag->peers_lock);
    peer *p = x->peer;
    const peer_md *md = p->md;
    if (atomic_load(&p->removed)) {
      e = peer_removed(p, fn);
    } else if (md->agent_id != x->agent_id) {
      e = kvp_err(KVP_ERR_REMOTE_DISCONNECT,
                  "%s: peer \"%.*s\" was reloaded as another agent (restarted?); rebuild the "
                  "transfer from fresh dlists or regions",
                  fn, (int)p->name_len, p->name);
    } else if (x->basis == BASIS_ADVERTISED && p->gen != x->peer_gen) {
      long bad = pairs_outside(x->pairs, x->npairs, 1, md->regions, md->nregions);
      if (bad >= 0)
        e = pair_outside_err(x, bad, 1, "memory the peer advertises in its current metadata", fn);
      else
        x->peer_gen = p->gen;
    }
    if (!e) {
      int same = md_same_process(md);
      x->rt.kind = same ? ROUTE_LOCAL : ROUTE_PVM;
      x->rt.pid = md->pid;
      x->rt.pidfd = p->pidfd; /* open while the transfer holds p */
      x->rt.agent_handle = md->agent_handle;
      x->rt.agent_id = md->agent_id;
      /* The peer's mappings as of this post; the transfer keeps them until
       * its next post or its retirement, so a reload or remove_remote
       * cannot unmap them under a slice. */
      if (x->rt.maps != p->maps) {
        old_maps = x->rt.maps;
        x->rt.maps = rmaps_ref(p->maps);
      }
    }
    pthread_rwlock_unlock(&ag->peers_lock);
    rmaps_unref(old_maps);
    if (e) return e;
  }
  if (atomic_load(&ag->reg_gen) != x->local_gen) {
    pthread_rwlock_rdlock(&ag->mem_lock);
    e = check_local_locked(ag, x, fn);
    pthread_rwlock_unlock(&ag->mem_lock);
    if (e) return e;
  }
  if (x->rt.kind == ROUTE_LOCAL) {
    agent *pa = route_agent(&x->rt);
    if (!pa)
      return kvp_err(KVP_ERR_REMOTE_DISCONNECT,
                     "%s: peer \"%.*s\" no longer exists in this process", fn,
                     (int)x->peer->name_len, x->peer->name);
    if (!x->live_valid || atomic_load(&pa->reg_gen) != x->live_gen) {
      pthread_rwlock_rdlock(&pa->mem_lock);
      e = check_live_locked(pa, x, fn);
      pthread_rwlock_unlock(&pa->mem_lock);
    }
    agent_put(pa);
  }
  return e;
}

/* iovec arrays for a cross-process slice that a caller's thread runs (a
 * poll, or a post in event mode): from the agent's free list, else new;
 * NULL when out of memory. iov_put_locked gives them back (qlock held). */
static iovbuf *iov_get(agent *ag) {
  pthread_mutex_lock(&ag->qlock);
  iovbuf *iov = ag->iov_free;
  if (iov) ag->iov_free = iov->next;
  pthread_mutex_unlock(&ag->qlock);
  return iov ? iov : (iovbuf *)malloc(sizeof *iov);
}

static void iov_put_locked(agent *ag, iovbuf *iov) {
  if (!iov) return;
  iov->next = ag->iov_free;
  ag->iov_free = iov;
}

/* Event mode (from the agent's first get_event_fd on; no delay_us, no
 * injected failure drawn): the post runs the transfer's first slice (at
 * most FAKE_SLICE_BYTES, the bound of a poll) in the calling thread, as a
 * poll does in poll mode: no wake-up of a worker, warm caches, and as many
 * transfers move at once as threads post them. A transfer that ends within
 * it is done when the post returns (KVP_SUCCESS), and the event descriptor
 * is not signalled for it: the caller learns it from the status, and
 * kvplugin.h signals only ends after the posting call returned. One that
 * fails in it ends failed (signalled, post says KVP_IN_PROG), one whose
 * notification waits in the peer's outbox is finished by the rx thread
 * (signalled), and one with bytes left goes to a worker at once, which
 * runs the rest and signals. x is X_RUNNING, run by this thread; iov
 * (cross-process only) goes back to the agent. Returns the post's status. */
static kvp_status post_here(agent *ag, xfer *x, iovbuf *iov, uint64_t t0) {
  runner r = {ag, iov};
  int done = 0;
  kvp_error *e = xfer_step(&r, x, slice_bytes(), &done);
  kvp_status st = KVP_IN_PROG;
  pthread_mutex_lock(&ag->qlock);
  iov_put_locked(ag, iov);
  /* A cancellation during the slice waits for it under qlock (see
   * xfer_cancel_locked): finish it here rather than queue it. */
  if (!e && !done && canceled(x)) e = canceled_err();
  if (done == 2) {
    /* its notification waits in an outbox: the rx thread finishes it */
  } else if (e) {
    xfer_finish_locked(ag, x, e);
  } else if (done) {
    x->post_us = dur_us(now_ns() - t0); /* the whole post, copy included */
    xfer_record_locked(ag, x, NULL);
    st = KVP_SUCCESS;
  } else {
    queue_push_locked(ag, x, now_ns()); /* not pollable: a worker takes it now */
  }
  pthread_mutex_unlock(&ag->qlock);
  return st;
}

static kvp_error *fake_post_xfer(kvp_post_xfer_args *a) {
  const char *fn = "post_xfer";
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_POST_XFER_ARGS_STRUCT_SIZE);
  if (e) return e;
  uint64_t t0 = now_ns();
  uint64_t start = epoch_us();
  agent *ag = agent_get(a->agent, fn, &e);
  if (!ag) return e;
  xfer *x = (xfer *)obj_get(g_xfers, a->xfer, ag, "xfer", fn, &e);
  if (!x) goto out;
  int st = atomic_load_explicit(&x->state, memory_order_acquire);
  if (st == X_QUEUED || st == X_RUNNING) {
    e = kvp_err(KVP_ERR_REPOST_ACTIVE, "%s: transfer 0x%" PRIx64 " is still in progress", fn, a->xfer);
    goto out;
  }
  if ((e = xfer_prepare(ag, x))) goto out;
  /* Event mode without delay_us: this call runs the first slice (see
   * post_here); a cross-process one borrows iovec arrays for it. */
  int ev = atomic_load_explicit(&ag->ev_fd, memory_order_relaxed) >= 0;
  int here = ev && !ag->delay_us;
  iovbuf *iov = NULL;
  if (here && x->rt.kind == ROUTE_PVM && !(iov = iov_get(ag))) here = 0; /* a worker runs it */
  x->t0_ns = t0;
  x->start_us = start;
  x->polled = 0;
  x->err_code = 0;
  x->err_msg[0] = 0;
  atomic_store_explicit(&x->cancel, 0, memory_order_relaxed);
  pthread_mutex_lock(&ag->qlock);
  if (x->peer && atomic_load(&x->peer->removed)) {
    /* remove_remote ran since xfer_prepare; it cancels under qlock, so
     * checking here closes the race. */
    iov_put_locked(ag, iov);
    pthread_mutex_unlock(&ag->qlock);
    e = peer_removed(x->peer, fn);
    goto out;
  }
  x->cancel_msg[0] = 0;
  x->fail = ag->fail_rate > 0 && rng_next(ag) < ag->fail_rate;
  x->drop_notif = x->has_notif && ag->drop_notif_rate > 0 && rng_next(ag) < ag->drop_notif_rate;
  x->cur_pair = 0;
  x->cur_blk = x->cur_off = x->moved = 0;
  x->limit = x->fail ? x->total_bytes / 2 : x->total_bytes;
  x->pollable = !ag->delay_us && !ev;
  here = here && !x->fail; /* an injected failure runs on a worker */
  uint64_t now = now_ns();
  x->post_us = dur_us(now - t0);
  if (here) {
    atomic_store(&x->state, X_RUNNING);
  } else {
    iov_put_locked(ag, iov);
    queue_push_locked(ag, x, now);
  }
  pthread_mutex_unlock(&ag->qlock);
  a->status = here ? post_here(ag, x, iov, t0) : KVP_IN_PROG;
out:
  if (x) kvp_ht_put(g_xfers, a->xfer);
  agent_put(ag);
  return e;
}

/* Progress by poll (kvplugin.h lets a poll drive the transfer): a
 * pollable transfer still queued at the second poll after its post, or at
 * any later poll, has one slice (at most FAKE_SLICE_BYTES) run in the
 * polling thread, and goes back to the queue if bytes remain. A hand-off
 * to a worker costs a scheduler round trip whenever the worker is not on a
 * CPU (on a loaded machine the wake-up also preempts the caller, which
 * then spins while another thread copies) and copies through another
 * core's cache; the caller is polling anyway. The first poll never runs
 * it, so an unfinished transfer is always seen in progress once. A poll
 * thus takes as long as one slice (plus, for the last one, the
 * notification's delivery). A cross-process slice borrows iovec arrays
 * from the agent's free list, allocated only when more polls run slices
 * at once than ever before on this agent. */
static void poll_drive(agent *ag, xfer *x) {
  iovbuf *iov = NULL;
  int pvm = x->rt.kind == ROUTE_PVM;
  pthread_mutex_lock(&ag->qlock);
  if (pvm && !(iov = ag->iov_free)) {
    pthread_mutex_unlock(&ag->qlock);
    if (!(iov = (iovbuf *)malloc(sizeof *iov))) return; /* a worker will run it */
    pthread_mutex_lock(&ag->qlock);
  } else if (iov) {
    ag->iov_free = iov->next;
  }
  int mine = atomic_load(&x->state) == X_QUEUED;
  if (mine) {
    queue_unlink_locked(ag, x);
    atomic_store(&x->state, X_RUNNING);
    ag->driving++;
  }
  pthread_mutex_unlock(&ag->qlock);
  int done = 0;
  kvp_error *e = NULL;
  if (mine) {
    runner r = {ag, iov};
    e = xfer_step(&r, x, slice_bytes(), &done);
  }
  pthread_mutex_lock(&ag->qlock);
  if (iov) {
    iov->next = ag->iov_free;
    ag->iov_free = iov;
  }
  if (mine) {
    ag->driving--;
    /* A cancellation during the slice waits for it under qlock (see
     * xfer_cancel_locked): finish it here rather than requeue it. */
    if (!e && !done && canceled(x)) e = canceled_err();
    if (done == 2)
      ; /* its notification waits in an outbox: the rx thread finishes it */
    else if (e || done)
      xfer_finish_locked(ag, x, e);
    else {
      /* get_event_fd during the slice: from now on workers run it. */
      if (atomic_load_explicit(&ag->ev_fd, memory_order_relaxed) >= 0) x->pollable = 0;
      queue_push_locked(ag, x, now_ns());
    }
  }
  pthread_mutex_unlock(&ag->qlock);
}

static kvp_error *fake_poll_xfer(kvp_poll_xfer_args *a) {
  const char *fn = "poll_xfer";
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_POLL_XFER_ARGS_STRUCT_SIZE_1_0);
  if (e) return e;
#if KVP_FAKE_ABI_MINOR >= 1
  /* ABI 1.1 flags; released is written on every path once the args are
   * known to be long enough (see kvp_poll_xfer_args). */
  uint32_t flags = 0;
  if (KVP_ARGS_HAS(a, kvp_poll_xfer_args, desc_count)) {
    flags = a->flags;
    a->released = 0;
    a->has_telemetry = 0;
  }
#endif
  agent *ag = agent_get(a->agent, fn, &e);
  if (!ag) return e;
#if KVP_FAKE_ABI_MINOR >= 1
  if (!(ag->caps & KVP_CAP_SUBMIT)) flags = 0; /* ignored without the capability */
#endif
  xfer *x = (xfer *)obj_get(g_xfers, a->xfer, ag, "xfer", fn, &e);
  if (x) {
    if (x->polled++ > 0 && x->pollable && atomic_load_explicit(&x->state, memory_order_relaxed) == X_QUEUED)
      poll_drive(ag, x);
    /* One load: the status, the telemetry and KVP_POLL_RELEASE all follow
     * it, so a run that ends meanwhile (on a worker) cannot have a poll
     * report IN_PROG and release the transfer. */
    int st = atomic_load_explicit(&x->state, memory_order_acquire);
    switch (st) {
      case X_IDLE:
        e = kvp_err(KVP_ERR_NOT_POSTED, "%s: transfer 0x%" PRIx64 " was never posted", fn, a->xfer);
        break;
      case X_QUEUED:
      case X_RUNNING:
        a->status = KVP_IN_PROG;
        break;
      case X_DONE:
        a->status = KVP_SUCCESS;
        break;
      default:
        e = kvp_err(x->err_code, "%s", x->err_msg);
        break;
    }
#if KVP_FAKE_ABI_MINOR >= 1
    if (st == X_DONE && (flags & KVP_POLL_TELEMETRY) && (ag->caps & KVP_CAP_TELEMETRY) && x->done.valid) {
      /* Done: no run writes x->done any more (see fake_xfer_telemetry). */
      a->start_us = x->done.start_us;
      a->post_us = x->done.post_us;
      a->xfer_us = x->done.xfer_us;
      a->total_bytes = x->done.bytes;
      a->desc_count = x->done.descs;
      a->has_telemetry = 1;
    }
    kvp_ht_put(g_xfers, a->xfer);
    if ((flags & KVP_POLL_RELEASE) && (st == X_DONE || st == X_FAILED)) {
      xfer *rx = (xfer *)kvp_ht_remove(g_xfers, a->xfer);
      if (rx) {
        xfer_destroy(ag, rx);
        a->released = 1;
      }
    }
#else
    kvp_ht_put(g_xfers, a->xfer);
#endif
  }
  agent_put(ag);
  return e;
}

static kvp_error *fake_release_xfer(kvp_release_xfer_args *a) {
  const char *fn = "release_xfer";
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_RELEASE_XFER_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, fn, &e);
  if (!ag) return e;
  xfer *x = (xfer *)obj_get(g_xfers, a->xfer, ag, "xfer", fn, &e);
  if (x) {
    kvp_ht_put(g_xfers, a->xfer);
    x = (xfer *)kvp_ht_remove(g_xfers, a->xfer);
    if (x)
      xfer_destroy(ag, x); /* cancels and waits for the worker */
    else
      e = kvp_err(KVP_ERR_INVALID_PARAM, "%s: handle 0x%" PRIx64 " released twice", fn, a->xfer);
  }
  agent_put(ag);
  return e;
}

static kvp_error *fake_xfer_telemetry(kvp_xfer_telemetry_args *a) {
  const char *fn = "xfer_telemetry";
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_XFER_TELEMETRY_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, fn, &e);
  if (!ag) return e;
  xfer *x = NULL;
  if (!(e = need_cap(ag, KVP_CAP_TELEMETRY, fn)) &&
      (x = (xfer *)obj_get(g_xfers, a->xfer, ag, "xfer", fn, &e))) {
    /* Only a run in progress may write x->done (when it ends); calls on
     * one transfer are serialised, so a transfer seen idle or finished has
     * none. */
    telem t;
    int st = atomic_load_explicit(&x->state, memory_order_acquire);
    if (st == X_QUEUED || st == X_RUNNING) {
      pthread_mutex_lock(&ag->qlock);
      t = x->done;
      pthread_mutex_unlock(&ag->qlock);
    } else {
      t = x->done;
    }
    if (!t.valid) {
      e = kvp_err(KVP_ERR_NO_TELEMETRY, "%s: transfer 0x%" PRIx64 " has not completed yet", fn, a->xfer);
    } else {
      a->start_us = t.start_us;
      a->post_us = t.post_us;
      a->xfer_us = t.xfer_us;
      a->total_bytes = t.bytes;
      a->desc_count = t.descs;
    }
    kvp_ht_put(g_xfers, a->xfer);
  }
  agent_put(ag);
  return e;
}

/* ------------------------------------------------------------------------ */
/* Notifications                                                            */
/* ------------------------------------------------------------------------ */

/* ABI 1.1: submit and the event descriptor. */

static void ev_signal(agent *ag) {
  int fd = atomic_load_explicit(&ag->ev_fd, memory_order_acquire);
  if (fd >= 0) wake_fd(fd);
}

#if KVP_FAKE_ABI_MINOR >= 1
/* make_prepped_xfer or make_batch_xfer, then post_xfer; a transfer whose
 * post fails is released, so on error none exists. */
static kvp_error *fake_submit_xfer(kvp_submit_xfer_args *a) {
  const char *fn = "submit_xfer";
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_SUBMIT_XFER_ARGS_STRUCT_SIZE);
  if (e) return e;
  if (!a->prepped == !a->batch)
    return kvp_err(KVP_ERR_INVALID_PARAM, "%s: exactly one of prepped and batch must be set", fn);
  if (a->prepped && (e = KVP_CHECK_ARGS(a->prepped, KVP_MAKE_PREPPED_XFER_ARGS_STRUCT_SIZE))) return e;
  if (a->batch && (e = KVP_CHECK_ARGS(a->batch, KVP_MAKE_BATCH_XFER_ARGS_STRUCT_SIZE))) return e;
  kvp_agent h = a->prepped ? a->prepped->agent : a->batch->agent;
  agent *ag = agent_get(h, fn, &e);
  if (!ag) return e;
  e = need_cap(ag, KVP_CAP_SUBMIT, fn);
  agent_put(ag);
  if (e) return e;
  if ((e = a->prepped ? fake_make_prepped_xfer(a->prepped) : fake_make_batch_xfer(a->batch))) return e;
  kvp_xfer x = a->prepped ? a->prepped->xfer : a->batch->xfer;
  kvp_post_xfer_args p = {KVP_POST_XFER_ARGS_STRUCT_SIZE, NULL, h, x, 0};
  if ((e = fake_post_xfer(&p))) {
    kvp_release_xfer_args r = {KVP_RELEASE_XFER_ARGS_STRUCT_SIZE, NULL, h, x};
    kvp_err_free(fake_release_xfer(&r));
    if (a->prepped)
      a->prepped->xfer = 0;
    else
      a->batch->xfer = 0;
    return e;
  }
  a->status = p.status;
  return NULL;
}

static kvp_error *fake_get_event_fd(kvp_get_event_fd_args *a) {
  const char *fn = "get_event_fd";
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_GET_EVENT_FD_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, fn, &e);
  if (!ag) return e;
  if (!(e = need_cap(ag, KVP_CAP_EVENT_FD, fn))) {
    pthread_mutex_lock(&ag->own_lock);
    int fd = atomic_load(&ag->ev_fd);
    if (fd < 0) {
      fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
      if (fd < 0)
        e = kvp_err(KVP_ERR_BACKEND, "%s: eventfd: %s", fn, strerror(errno));
      else
        atomic_store_explicit(&ag->ev_fd, fd, memory_order_release);
    }
    pthread_mutex_unlock(&ag->own_lock);
    if (!e) {
      /* Transfers posted before the first call may be pollable and wait
       * for a poll or a grace period: make them urgent so workers take
       * them over now. */
      pthread_mutex_lock(&ag->qlock);
      for (xfer *q = ag->qhead; q; q = q->qnext) {
        if (q->pollable) {
          q->pollable = 0;
          atomic_fetch_add_explicit(&ag->urgent, 1, memory_order_release);
        }
      }
      if (ag->qhead) pthread_cond_broadcast(&ag->qcv);
      pthread_mutex_unlock(&ag->qlock);
      a->fd = fd;
    }
  }
  agent_put(ag);
  return e;
}
#endif

static kvp_error *fake_get_notifs(kvp_get_notifs_args *a) {
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_GET_NOTIFS_ARGS_STRUCT_SIZE);
  if (e) return e;
  agent *ag = agent_get(a->agent, "get_notifs", &e);
  if (!ag) return e;
  if (!(e = need_cap(ag, KVP_CAP_NOTIF, "get_notifs")))
    kvp_nq_drain(ag->nq, a->buf, a->cap, &a->size, &a->count, &a->needed);
  agent_put(ag);
  return e;
}

static kvp_error *fake_send_notif(kvp_send_notif_args *a) {
  const char *fn = "send_notif";
  kvp_error *e = KVP_CHECK_ARGS(a, KVP_SEND_NOTIF_ARGS_STRUCT_SIZE);
  if (e) return e;
  if ((e = peer_name_check(a->peer_name, a->peer_name_len, fn))) return e;
  agent *ag = agent_get(a->agent, fn, &e);
  if (!ag) return e;
  if ((e = need_cap(ag, KVP_CAP_NOTIF, fn)) || (e = notif_len_check(a->msg, a->msg_len, fn))) goto out;
  route rt;
  memset(&rt, 0, sizeof rt);
  pthread_rwlock_rdlock(&ag->peers_lock);
  peer *p = peer_find(ag, a->peer_name, a->peer_name_len);
  if (p) {
    const peer_md *md = p->md;
    rt.kind = md_same_process(md) ? ROUTE_LOCAL : ROUTE_PVM;
    rt.pid = md->pid;
    rt.pidfd = p->pidfd;
    rt.agent_handle = md->agent_handle;
    rt.agent_id = md->agent_id;
    peer_ref(p);
  }
  pthread_rwlock_unlock(&ag->peers_lock);
  if (!p) {
    e = peer_unknown(ag, a->peer_name, a->peer_name_len, fn);
  } else {
    int queued;
    e = kvp_err_wrap(notif_submit(ag, p, &rt, NULL, a->msg, a->msg_len, &queued), "%s to \"%.*s\"", fn,
                     (int)a->peer_name_len, a->peer_name);
    peer_unref(p);
  }
out:
  agent_put(ag);
  return e;
}

#ifdef KVP_FAKE_TEST_HOOKS
static struct agent *test_agent_get(uint64_t h) { return (agent *)kvp_ht_acquire(g_agents, h); }
static void test_agent_put(struct agent *ag) { agent_put(ag); }
static void test_agent_counters(struct agent *ag, uint64_t out[2]) {
  out[0] = atomic_load(&ag->notif_forged);
  out[1] = atomic_load(&ag->notif_expired);
}

/* Mapped-memory state of an agent: [0] bytes its transfers moved by
 * memcpy through peer mappings, [1] its registered regions whose memory
 * may vanish (may_fault_regs), [2] its regions with a sealed file
 * (advertised in metadata v2). 0 on an unknown handle. */
/* Pages warm_for_user touched for the agent (its sealed registrations
 * and its peers' mapped windows); 0 on an unknown handle. */
uint64_t fake_test_warm_pages(uint64_t handle) {
  agent *ag = test_agent_get(handle);
  if (!ag) return 0;
  uint64_t n = atomic_load(&ag->warm_pages);
  test_agent_put(ag);
  return n;
}

int fake_test_map_state(uint64_t handle, uint64_t out[3]) {
  agent *ag = test_agent_get(handle);
  if (!ag) return 0;
  out[0] = atomic_load(&ag->map_bytes);
  out[1] = atomic_load(&ag->may_fault_regs);
  pthread_rwlock_rdlock(&ag->mem_lock);
  out[2] = md_nfiles(ag);
  pthread_rwlock_unlock(&ag->mem_lock);
  test_agent_put(ag);
  return 1;
}
#endif

/* ------------------------------------------------------------------------ */
/* Entry point                                                              */
/* ------------------------------------------------------------------------ */

static const kvp_api g_api = {
    FAKE_API_SIZE,
    NULL,
    KVP_FAKE_ABI_MAJOR,
    KVP_FAKE_ABI_MINOR,
    kvp_util_error_destroy,
    kvp_util_error_message,
    kvp_util_error_code,
    fake_plugin_info,
    fake_agent_create,
    fake_agent_destroy,
    fake_register_mem,
    fake_deregister_mem,
    fake_region_export,
    fake_local_metadata,
    fake_load_remote,
    fake_remove_remote,
    fake_remote_region_import,
    fake_remote_region_release,
    fake_prep_dlist,
    fake_release_dlist,
    fake_make_prepped_xfer,
    fake_make_batch_xfer,
    fake_post_xfer,
    fake_poll_xfer,
    fake_release_xfer,
    fake_xfer_telemetry,
    fake_get_notifs,
    fake_send_notif,
#if KVP_FAKE_ABI_MINOR >= 1
    fake_submit_xfer,
    fake_get_event_fd,
#else
    NULL, /* beyond the 1.0 table's struct_size: never read */
    NULL,
#endif
};

KVP_EXPORT kvp_status kvp_plugin_get_api(kvp_get_api_args *args) {
  pthread_once(&g_once, fake_init);
  return kvp_util_get_api(args, KVP_FAKE_ABI_MAJOR, &g_api);
}
