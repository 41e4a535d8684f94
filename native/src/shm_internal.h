// The shm engine's internals, shared by the files that implement it, one
// concern each (the protocol is described at the top of shm_engine.cc): the
// segment's layout, the constants, the small helpers, and the small members
// that every part calls, inline, so each file inlines them as the single
// file did.
#pragma once

#include "shm_engine.h"
#include "wait_timings.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KD_PAUSE() _mm_pause()
#else
#define KD_PAUSE() ((void)0)
#endif

namespace kd {

namespace {

constexpr uint64_t kMagic = 0x6b645f73686d3031ull;  // "kd_shm01"
constexpr size_t kLine = 64;
constexpr size_t kPage = 4096;
constexpr long kFutexWaitNanoseconds = long(kFutexWaitSeconds * 1e9);
// Messages up to this size go in one round (every rank reduces everything).
constexpr size_t kSmallBytes = 32u << 10;
// Share of one rank in a chunk of the pipelined path: the chunks of all ranks
// stay in the shared L3 cache, and each chunk costs two synchronisations.
constexpr size_t kChunkBytes = 512u << 10;
// Piece of a peer's share read at a time on the single-copy path: the pieces
// of all peers stay in this core's cache until they are reduced.
constexpr size_t kPieceBytes = 256u << 10;
// allreduce_parts moves a message larger than kPartsOneRoundBytes in windows
// of kPartsWindowBytes, each the two steps of one chunk; both sizes measured
// fastest of those tried (benchmarks/README.md).
constexpr size_t kPartsOneRoundBytes = 4u << 20;
constexpr size_t kPartsWindowBytes = 2u << 20;
// allreduce_parts reduces, averages and copies out its share in pieces this
// size (whole elements of every dtype), each while it is still in L1.
constexpr size_t kL1PieceBytes = 8u << 10;
// Bytes at the start of each peer's current buffer that a finished wait
// prefetches (a small collective's whole message).
constexpr size_t kPrefetchBytes = 256;
// Smallest allgather (total bytes) that reads peers' buffers directly: one
// system call per peer against two copies through the slots.
constexpr size_t kAllgatherSingleCopyBytes = 16u << 10;

// How a collective moves its data. Every rank must choose the same one.
enum Path : uint32_t { kSmall = 0, kChunked, kInSlot, kSingleCopy, kParts };

inline const char* path_name(uint32_t path) {
  switch (path) {
    case kSmall: return "one round";
    case kChunked: return "chunked copies";
    case kInSlot: return "in shared memory";
    case kSingleCopy: return "single copy";
    case kParts: return "from parts";
    default: return "unknown path";
  }
}

enum Kind : uint32_t { kAttach = 1, kBarrier, kAllreduce, kBroadcast, kAllgatherv, kVerdict };
constexpr uint32_t kNone = 0xffffffffu;

inline const char* kind_name(uint32_t kind) {
  switch (kind) {
    case kAttach: return "attach";
    case kBarrier: return "barrier";
    case kAllreduce: return "allreduce";
    case kBroadcast: return "broadcast";
    case kAllgatherv: return "allgather";
    case kVerdict: return "mismatch verdict";
    default: return "unknown collective";
  }
}

inline double now_seconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

inline size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

inline bool process_alive(int64_t pid) {
  if (pid <= 0) return true;  // unknown: cannot tell
  if (kill(pid_t(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return errno != ENOENT;
  char buf[512];
  const size_t got = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[got] = 0;
  const char* paren = std::strrchr(buf, ')');  // "pid (comm) S ..."
  if (paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X')) return false;
  return true;
}

inline uint64_t hash_bytes(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

inline uint64_t hash_counts(const std::vector<uint64_t>& counts) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the 8-byte counts
  for (uint64_t c : counts) {
    for (int i = 0; i < 8; ++i) {
      h ^= (c >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  return h;
}

}  // namespace

struct ShmEngine::Header {
  uint64_t coll;
  uint32_t kind;
  uint32_t op;
  uint32_t dtype;
  int32_t root;
  uint64_t nbytes;
  uint64_t name_hash;
  uint64_t src;       // single copy: this rank's source buffer (its own address)
  uint64_t dst;       // single copy: this rank's destination buffer
  uint32_t path;      // Path; compared like the fields above
  uint32_t name_len;  // bytes of `name` kept (a prefix of the caller's name)
  char name[128];
  uint32_t note_len;  // kVerdict: bytes of `note`, the mismatch message (0: none)
  char note[1020];
};

// Written once, at attach: can this rank read its peers' memory?
struct ShmEngine::Probe {
  uint64_t addr;   // where peers find `value` in this rank's memory
  uint64_t value;  // random
  uint32_t want;   // single copy enabled in this rank's options
  uint32_t ok;     // this rank read every peer's value
  char reason[104];
};

struct ShmEngine::RankCtl {
  alignas(kLine) std::atomic<uint64_t> step;
  // 1 once the rank has left the group (leave()). Its own line: every
  // collective reads it first, and the line of `step`, which the rank
  // rewrites at every step, would be a cache miss each time.
  alignas(kLine) std::atomic<uint32_t> left;
  alignas(kLine) Header hdr[2];
  alignas(kLine) Probe probe;
};

struct SegmentLayout {
  alignas(kLine) uint64_t magic;
  uint64_t local_size;
  uint64_t slot_bytes;
  uint64_t half_bytes;
  alignas(kLine) std::atomic<uint32_t> sleepers;  // ranks blocked in futex_wait
  alignas(kLine) std::atomic<int32_t> abort_rank;  // -1: none
  char abort_reason[1024];
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "need lock-free 64-bit atomics");
static_assert(std::atomic<int32_t>::is_always_lock_free, "need lock-free 32-bit atomics");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "futex waits on the low half of a step");

namespace {
// The low 32 bits of a step counter: what a futex can wait on.
inline uint32_t* futex_word(std::atomic<uint64_t>& step) { return reinterpret_cast<uint32_t*>(&step); }

inline void futex_wait(std::atomic<uint64_t>& step, uint32_t expected, long timeout_ns) {
  timespec ts{0, timeout_ns};
  syscall(SYS_futex, futex_word(step), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint64_t>& step) {
  syscall(SYS_futex, futex_word(step), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}
// CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU
// quota (a container's "cpu.max": quota and period in us, or "max"); 1 if the
// mask cannot be read.
inline int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  int cpus = std::max(1, CPU_COUNT(&set));
  if (FILE* f = std::fopen("/sys/fs/cgroup/cpu.max", "r")) {
    long long quota = 0, period = 0;
    if (std::fscanf(f, "%lld %lld", &quota, &period) == 2 && quota > 0 && period > 0) {
      cpus = std::min<long long>(cpus, std::max<long long>(1, quota / period));
    }
    std::fclose(f);
  }
  return cpus;
}
}  // namespace

inline ShmEngine::RankCtl* ShmEngine::ctl(int rank) const {
  return reinterpret_cast<RankCtl*>(base_ + sizeof(SegmentLayout)) + rank;
}

inline void ShmEngine::publish() {
  // seq_cst store then load, paired with the waiter's increment-then-recheck:
  // either the waiter sees the new step or this rank sees the sleeper.
  std::atomic<uint64_t>& step = ctl(me_)->step;
  step.store(++step_, std::memory_order_seq_cst);
  if (reinterpret_cast<SegmentLayout*>(base_)->sleepers.load(std::memory_order_seq_cst) != 0) {
    futex_wake_all(step);
  }
}

inline void ShmEngine::ensure_usable() {
  if (!base_) throw TransportError("shm: the engine is closed");
  if (broken_) {
    throw TransportError("shm: an earlier collective on " + rank_label(me_) +
                         " failed; the shared-memory transport cannot be used any more");
  }
}

inline void ShmEngine::prefetch_peers() const {
  const int which = int((coll_ - 1) & 1);
  for (int p = 0; p < n_; ++p) {
    if (p == me_) continue;
    __builtin_prefetch(&ctl(p)->hdr[which], 0, 3);
    const uint8_t* d = data(p, next_buf_);
    for (size_t off = 0; off < kPrefetchBytes; off += kLine) __builtin_prefetch(d + off, 0, 3);
  }
}

inline void ShmEngine::header_step() {
  if (n_ == 1) return;
  publish();
  wait_all();
  check_headers();
}

inline uint32_t ShmEngine::choose_path(size_t nbytes, bool in_slot) const {
  if (in_slot) return kInSlot;
  if (single_copy_ && nbytes >= opt_.single_copy_bytes) return kSingleCopy;
  return nbytes <= kSmallBytes ? kSmall : kChunked;
}

inline void ShmEngine::load_peer_addresses() {
  const int which = int((coll_ - 1) & 1);
  for (int p = 0; p < n_; ++p) {
    const Header& h = ctl(p)->hdr[which];
    peer_src_[size_t(p)] = h.src;
    peer_dst_[size_t(p)] = h.dst;
  }
}

}  // namespace kd
