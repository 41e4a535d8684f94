// Shared-memory collectives. See shm_engine.h for the shape; the protocol:
//
// * Every rank owns a step counter in its own cache line. A rank publishes a
//   step (release store) after writing what the step shares, and waits until
//   every peer has published the same step (acquire loads) before reading.
// * Data written into a buffer at step s is read by peers during steps s and
//   s+1 only; buffers alternate, and a buffer is rewritten only after every
//   peer has published s+2, so no step needs a trailing barrier.
// * Each collective begins by writing a header (kind, op, dtype, bytes, name
//   hash, root) into one of two header lines (alternating per collective); after
//   the first wait every rank compares all headers, so a mismatch raises on
//   every rank before any data is exchanged, and leaves the engine usable:
//   every collective publishes exactly one step before that comparison, so
//   the step counters stay aligned, and a header line is rewritten only two
//   collectives later, after every rank has passed the next one's first wait
//   (and so has read this one's headers).
// * A verdict reached outside the engine takes the place of a collective: a
//   rank publishes a "verdict" header carrying the message, and the header
//   comparison makes every rank raise it (raise_mismatch).
// * A rank that closes the engine marks itself as having left the group
//   (leave); a peer that waits for it, or begins a collective after that,
//   raises PeerFailureError at once instead of waiting forever.
// * Waits spin, then yield, then block in a futex (wait_timings.h has the
//   durations); every kLivenessSeconds they check that the awaited peers are
//   alive and that no rank has aborted, warn after stall_seconds and raise
//   after timeout_seconds.
// * Large allreduces and allgathers, when every rank can read its peers'
//   memory (process_vm_readv, probed at attach), skip the slots: each rank
//   publishes the addresses of its buffers in its header, reads the peers'
//   parts straight into its own buffers, and a final step keeps every buffer
//   alive until all peers have read it. Every rank picks the same path (it
//   depends only on what the header check compares), and the header says it.
// * allreduce_parts takes a message as separate source and destination
//   arrays (a training step's gradients): the same two steps as one chunk of
//   the chunked path, except that a rank copies only its peers' shares into
//   its slot, reduces its own share from its sources, and copies the reduced
//   shares straight into the destinations; a message of more than a few MiB
//   goes in windows, each those two steps. Its header's path says "from
//   parts", so it never meets another path's data.
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

const char* path_name(uint32_t path) {
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

const char* kind_name(uint32_t kind) {
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

double now_seconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

bool process_alive(int64_t pid) {
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

uint64_t hash_bytes(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t hash_counts(const std::vector<uint64_t>& counts) {
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
uint32_t* futex_word(std::atomic<uint64_t>& step) { return reinterpret_cast<uint32_t*>(&step); }

void futex_wait(std::atomic<uint64_t>& step, uint32_t expected, long timeout_ns) {
  timespec ts{0, timeout_ns};
  syscall(SYS_futex, futex_word(step), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint64_t>& step) {
  syscall(SYS_futex, futex_word(step), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}
// CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU
// quota (a container's "cpu.max": quota and period in us, or "max"); 1 if the
// mask cannot be read.
int usable_cpus() {
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

ShmEngine::ShmEngine(const EngineOptions& options, EngineHooks hooks)
    : opt_(options), hooks_(std::move(hooks)), me_(options.local_rank),
      n_(options.local_size) {
  if (n_ < 1 || me_ < 0 || me_ >= n_) {
    throw std::invalid_argument("`local_rank` must be in [0, local_size). Received: local_rank=" +
                                std::to_string(me_) + " (local_size=" + std::to_string(n_) + ")");
  }
  if (!opt_.pids.empty() && opt_.pids.size() != size_t(n_)) {
    throw std::invalid_argument("`peer_pids` must list local_size pids. Received: " +
                                std::to_string(opt_.pids.size()) + " for local_size=" +
                                std::to_string(n_));
  }
  if (!opt_.ranks.empty() && opt_.ranks.size() != size_t(n_)) {
    throw std::invalid_argument("`global_ranks` must list local_size ranks. Received: " +
                                std::to_string(opt_.ranks.size()) + " for local_size=" +
                                std::to_string(n_));
  }
  if (opt_.slot_bytes < 2 * kPage) {
    throw std::invalid_argument("`slot_bytes` must be at least 8192. Received: slot_bytes=" +
                                std::to_string(opt_.slot_bytes));
  }
  if (opt_.name.size() < 2 || opt_.name[0] != '/' || opt_.name.find('/', 1) != std::string::npos) {
    throw std::invalid_argument("`name` must look like '/kd-...'. Received: name='" + opt_.name +
                                "'");
  }
  half_bytes_ = opt_.slot_bytes / 2 / kPage * kPage;
  yield_seconds_ = n_ <= usable_cpus() ? kOwnCoreYieldSeconds : kYieldSeconds;
  data_offset_ = round_up(sizeof(SegmentLayout) + size_t(n_) * sizeof(RankCtl), kPage);
  map_bytes_ = data_offset_ + size_t(n_) * 2 * half_bytes_;
  srcs_.resize(size_t(n_));
  peer_src_.resize(size_t(n_));
  peer_dst_.resize(size_t(n_));

  const int flags = opt_.create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR;
  fd_ = shm_open(opt_.name.c_str(), flags, 0600);
  if (fd_ < 0) {
    throw TransportError(std::string("shm: cannot ") + (opt_.create ? "create" : "open") +
                         " shared memory segment '" + opt_.name + "' (local rank " +
                         std::to_string(me_) + "): " + std::strerror(errno));
  }
  if (opt_.create && ftruncate(fd_, off_t(map_bytes_)) != 0) {
    const int err = errno;
    shm_unlink(opt_.name.c_str());
    close(fd_);
    throw TransportError("shm: cannot size segment '" + opt_.name + "' to " +
                         std::to_string(map_bytes_) + " bytes: " + std::strerror(err));
  }
  struct stat st;
  if (fstat(fd_, &st) != 0 || size_t(st.st_size) != map_bytes_) {
    close(fd_);
    throw TransportError("shm: segment '" + opt_.name + "' has " + std::to_string(st.st_size) +
                         " bytes, expected " + std::to_string(map_bytes_) +
                         " (do all ranks use the same slot_bytes and local_size?)");
  }
  void* p = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    if (opt_.create) shm_unlink(opt_.name.c_str());
    close(fd_);
    throw TransportError("shm: cannot map segment '" + opt_.name + "': " + std::strerror(err));
  }
  base_ = static_cast<uint8_t*>(p);
  auto* seg = reinterpret_cast<SegmentLayout*>(base_);
  if (opt_.create) {
    // ftruncate zero-fills, so step counters start at 0.
    seg->local_size = uint64_t(n_);
    seg->slot_bytes = opt_.slot_bytes;
    seg->half_bytes = half_bytes_;
    seg->abort_rank.store(-1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    seg->magic = kMagic;
  } else {
    std::atomic_thread_fence(std::memory_order_acquire);
    if (seg->magic != kMagic || seg->local_size != uint64_t(n_) ||
        seg->half_bytes != half_bytes_) {
      munmap(base_, map_bytes_);
      base_ = nullptr;
      close(fd_);
      throw TransportError("shm: segment '" + opt_.name +
                           "' was not set up for this job (magic, local_size or slot_bytes "
                           "differ)");
    }
  }
}

ShmEngine::~ShmEngine() {
  if (base_) leave();
  if (opt_.create && !unlinked_) shm_unlink(opt_.name.c_str());
  if (base_) munmap(base_, map_bytes_);
  if (fd_ >= 0) close(fd_);
}

ShmEngine::RankCtl* ShmEngine::ctl(int rank) const {
  return reinterpret_cast<RankCtl*>(base_ + sizeof(SegmentLayout)) + rank;
}

uint8_t* ShmEngine::data(int rank, int which) const {
  return base_ + data_offset_ + (size_t(rank) * 2 + size_t(which)) * half_bytes_;
}

bool ShmEngine::overlaps_slot(const void* p, size_t nbytes) const {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  const uint8_t* lo = data(me_, 0);
  const uint8_t* hi = lo + 2 * half_bytes_;
  return nbytes > 0 && b < hi && b + nbytes > lo;
}

uint8_t* ShmEngine::scratch(size_t nbytes) {
  ensure_usable();
  return nbytes <= half_bytes_ ? data(me_, next_buf_) : nullptr;
}

std::string ShmEngine::rank_label(int local) const {
  if (opt_.ranks.empty()) return "local rank " + std::to_string(local);
  const int64_t global = opt_.ranks[size_t(local)];
  if (global == local) return "rank " + std::to_string(global);
  return "rank " + std::to_string(global) + " (local rank " + std::to_string(local) + ")";
}

std::string ShmEngine::current_collective() const {
  const Header& h = ctl(me_)->hdr[(coll_ - 1) & 1];
  std::ostringstream out;
  out << "shm " << kind_name(h.kind) << " #" << h.coll;
  if (h.kind == kAllreduce) out << " (" << dtype_name(int(h.dtype)) << ", " << op_name(int(h.op)) << ", " << h.nbytes << " bytes)";
  if (h.kind == kBroadcast) out << " (root " << h.root << ", " << h.nbytes << " bytes)";
  if (h.kind == kAllgatherv) out << " (" << h.nbytes << " bytes)";
  out << " on " << rank_label(me_);
  return out.str();
}

void ShmEngine::ensure_usable() {
  if (!base_) throw TransportError("shm: the engine is closed");
  if (broken_) {
    throw TransportError("shm: an earlier collective on " + rank_label(me_) +
                         " failed; the shared-memory transport cannot be used any more");
  }
}

void ShmEngine::fail(const char* reason) {
  broken_ = true;
  auto* seg = reinterpret_cast<SegmentLayout*>(base_);
  int32_t expected = -1;
  if (seg->abort_rank.compare_exchange_strong(expected, -2, std::memory_order_acq_rel)) {
    std::snprintf(seg->abort_reason, sizeof(seg->abort_reason), "%s", reason);
    seg->abort_rank.store(me_, std::memory_order_release);
  }
}

void ShmEngine::raise_aborted(int32_t rank, const std::string& where) {
  broken_ = true;
  const auto* seg = reinterpret_cast<const SegmentLayout*>(base_);
  throw PeerFailureError(where + ": " + rank_label(rank) + " aborted: " + seg->abort_reason);
}

void ShmEngine::leave() {
  if (!base_ || left_) return;
  left_ = true;
  std::atomic<uint64_t>& step = ctl(me_)->step;
  ctl(me_)->left.store(1, std::memory_order_seq_cst);
  // Peers blocked on this rank's step word wake up and see the flag.
  if (reinterpret_cast<SegmentLayout*>(base_)->sleepers.load(std::memory_order_seq_cst) != 0) {
    futex_wake_all(step);
  }
}

void ShmEngine::check_departed(int p, const std::string& where) {
  if (p == me_ || ctl(p)->left.load(std::memory_order_acquire) == 0) return;
  // A rank that aborted (e.g. was interrupted) and then left: its abort names the cause.
  if (reinterpret_cast<const SegmentLayout*>(base_)->abort_rank.load(std::memory_order_acquire) == p)
    raise_aborted(p, where);
  throw PeerFailureError(where + ": " + rank_label(p) +
                         " has shut down keras_dist (left the group) while " +
                         rank_label(me_) + " waits in this collective");
}

void ShmEngine::begin(uint32_t kind, uint32_t op, uint32_t dtype, int32_t root, uint64_t nbytes,
                      std::string_view name, uint64_t extra_hash) {
  ensure_usable();
  if (left_) throw TransportError("shm: " + rank_label(me_) + " has left the group");
  auto* seg = reinterpret_cast<SegmentLayout*>(base_);
  for (int p = 0; p < n_; ++p) {
    if (p != me_ && ctl(p)->left.load(std::memory_order_acquire) != 0) {
      check_departed(p, "shm " + std::string(kind_name(kind)) + " on " + rank_label(me_));
    }
  }
  const int32_t aborted = seg->abort_rank.load(std::memory_order_acquire);
  if (aborted >= 0) {
    raise_aborted(aborted, "shm " + std::string(kind_name(kind)) + " on " + rank_label(me_));
  }
  Header& h = ctl(me_)->hdr[coll_ & 1];
  h.coll = coll_;
  h.kind = kind;
  h.op = op;
  h.dtype = dtype;
  h.root = root;
  h.nbytes = nbytes;
  h.name_hash = (name.empty() ? 0 : hash_bytes(name.data(), name.size())) ^ extra_hash;
  h.src = 0;
  h.dst = 0;
  h.path = kSmall;
  h.name_len = uint32_t(std::min(name.size(), sizeof(h.name)));
  std::memcpy(h.name, name.data(), h.name_len);
  h.note_len = 0;
  ++coll_;
}

void ShmEngine::begin_allreduce(size_t nbytes, DType dtype, Op op, std::string_view name) {
  begin(kAllreduce, uint32_t(op), uint32_t(dtype), -1, nbytes, name);
}

void ShmEngine::begin_broadcast(size_t nbytes, int root, std::string_view name) {
  begin(kBroadcast, kNone, kNone, root, nbytes, name);
}

void ShmEngine::begin_allgatherv(const std::vector<uint64_t>& counts_bytes,
                                 std::string_view name) {
  uint64_t total = 0;
  for (uint64_t c : counts_bytes) total += c;
  begin(kAllgatherv, kNone, kNone, -1, total, name, hash_counts(counts_bytes));
}

void ShmEngine::header_step() {
  if (n_ == 1) return;
  publish();
  wait_all();
  check_headers();
}

void ShmEngine::check_allreduce(size_t nbytes, DType dtype, Op op, std::string_view name) {
  begin_allreduce(nbytes, dtype, op, name);
  header_step();
}

void ShmEngine::check_broadcast(size_t nbytes, int root, std::string_view name) {
  begin_broadcast(nbytes, root, name);
  header_step();
}

void ShmEngine::check_allgatherv(const std::vector<uint64_t>& counts_bytes,
                                 std::string_view name) {
  begin_allgatherv(counts_bytes, name);
  header_step();
}

void ShmEngine::check_barrier() {
  begin(kBarrier, kNone, kNone, -1, 0, {});
  header_step();
}

void ShmEngine::raise_mismatch(const std::string& message) {
  begin(kVerdict, kNone, kNone, -1, 0, {});
  Header& h = ctl(me_)->hdr[(coll_ - 1) & 1];
  h.note_len = uint32_t(std::min(message.size(), sizeof(h.note)));
  std::memcpy(h.note, message.data(), h.note_len);
  header_step();    // raises: this rank's header is a verdict
  throw MismatchError(message);  // one local rank
}

void ShmEngine::publish() {
  // seq_cst store then load, paired with the waiter's increment-then-recheck:
  // either the waiter sees the new step or this rank sees the sleeper.
  std::atomic<uint64_t>& step = ctl(me_)->step;
  step.store(++step_, std::memory_order_seq_cst);
  if (reinterpret_cast<SegmentLayout*>(base_)->sleepers.load(std::memory_order_seq_cst) != 0) {
    futex_wake_all(step);
  }
}

std::string ShmEngine::describe_missing(const std::vector<int>& missing) const {
  std::string out;
  for (size_t i = 0; i < missing.size(); ++i) {
    if (i) out += ", ";
    out += rank_label(missing[i]);
    if (!opt_.pids.empty()) out += " (pid " + std::to_string(opt_.pids[size_t(missing[i])]) + ")";
  }
  return out;
}

void ShmEngine::set_yield_seconds(double seconds) {
  if (!(seconds >= 0.0 && seconds <= 1.0)) {
    throw std::invalid_argument("`yield_seconds` must be in [0, 1]. Received: " +
                                std::to_string(seconds));
  }
  yield_seconds_ = seconds;
}

void ShmEngine::wait_all() {
  const uint64_t target = step_;
  auto arrived = [&](int p) { return ctl(p)->step.load(std::memory_order_acquire) >= target; };
  auto all_arrived = [&] {
    for (int p = 0; p < n_; ++p)
      if (p != me_ && !arrived(p)) return false;
    return true;
  };
  // Whichever way out, ask for the peers' lines that come next (this
  // collective's headers, the start of their buffers) all at once, so that
  // their cache misses overlap instead of following one another.
  struct Prefetch {
    const ShmEngine& e;
    ~Prefetch() { e.prefetch_peers(); }
  } prefetch{*this};
  if (all_arrived()) return;  // no wait, and no clock read
  // The phases and their durations: wait_timings.h. Spin first, reading the
  // clock every 64 polls only. Every way out from here adds the time waited
  // to wait_seconds_.
  const double start = now_seconds();
  struct AddWait {
    double& total;
    double start;
    ~AddWait() { total += now_seconds() - start; }
  } add_wait{wait_seconds_, start};
  for (uint32_t i = 1;; ++i) {
    if (all_arrived()) return;
    KD_PAUSE();
    if (i % 64 == 0 && now_seconds() - start >= kSpinSeconds) break;
  }
  double next_check = start + kLivenessSeconds;
  double next_stall = opt_.stall_seconds > 0 ? start + opt_.stall_seconds : 1e300;
  const double yield_until = start + yield_seconds_;
  bool yielding = true;
  auto* seg = reinterpret_cast<SegmentLayout*>(base_);
  try {
    for (;;) {
      if (all_arrived()) return;
      if (yielding && now_seconds() < yield_until) {
        sched_yield();
      } else {
        yielding = false;
        // Block until the first missing peer publishes (it wakes sleepers), or
        // kFutexWaitSeconds pass, so that abort, liveness and time limits are
        // still checked.
        int missing = 0;
        while (missing < n_ && (missing == me_ || arrived(missing))) ++missing;
        if (missing == n_) continue;
        std::atomic<uint64_t>& step = ctl(missing)->step;
        const uint64_t seen = step.load(std::memory_order_acquire);
        if (seen < target) {
          seg->sleepers.fetch_add(1, std::memory_order_seq_cst);
          if (step.load(std::memory_order_seq_cst) == seen) futex_wait(step, uint32_t(seen), kFutexWaitNanoseconds);
          seg->sleepers.fetch_sub(1, std::memory_order_seq_cst);
        }
      }
      // A peer publishes this step before it can finish the collective and
      // leave: after seeing it left, read its step again, so that a peer that
      // published, went on and left since the first read counts as arrived.
      for (int p = 0; p < n_; ++p) {
        if (!arrived(p) && ctl(p)->left.load(std::memory_order_acquire) != 0 && !arrived(p))
          check_departed(p, current_collective());
      }
      const int32_t aborted = seg->abort_rank.load(std::memory_order_acquire);
      if (aborted >= 0 && aborted != me_) raise_aborted(aborted, current_collective());
      const double t = now_seconds();
      if (t < next_check) continue;
      next_check = t + kLivenessSeconds;
      std::vector<int> missing;
      for (int p = 0; p < n_; ++p)
        if (p != me_ && !arrived(p)) missing.push_back(p);
      if (missing.empty()) return;
      for (int p : missing) {
        if (!opt_.pids.empty() && !process_alive(opt_.pids[size_t(p)])) {
          throw PeerFailureError(current_collective() + ": " + rank_label(p) + " (pid " +
                                 std::to_string(opt_.pids[size_t(p)]) +
                                 ") died while this rank waited for it");
        }
      }
      if (opt_.timeout_seconds > 0 && t - start >= opt_.timeout_seconds) {
        std::ostringstream msg;
        msg << current_collective() << ": timed out after " << opt_.timeout_seconds
            << " s waiting for " << describe_missing(missing);
        throw TimeoutError(msg.str());
      }
      if (t >= next_stall && hooks_.on_stall) {
        next_stall = t + opt_.stall_seconds;
        std::ostringstream msg;
        msg << current_collective() << " has waited " << int(t - start) << " s for "
            << describe_missing(missing) << ", which have not joined it";
        try {
          hooks_.on_stall(msg.str());
        } catch (...) {
          fail("its stall warning raised an exception");
          throw;
        }
      }
      if (hooks_.check_interrupt) {
        try {
          hooks_.check_interrupt();
        } catch (...) {
          fail("it was interrupted");
          throw;
        }
      }
    }
  } catch (const std::exception& e) {
    if (!broken_) fail(e.what());
    throw;
  }
}

void ShmEngine::prefetch_peers() const {
  const int which = int((coll_ - 1) & 1);
  for (int p = 0; p < n_; ++p) {
    if (p == me_) continue;
    __builtin_prefetch(&ctl(p)->hdr[which], 0, 3);
    const uint8_t* d = data(p, next_buf_);
    for (size_t off = 0; off < kPrefetchBytes; off += kLine) __builtin_prefetch(d + off, 0, 3);
  }
}

void ShmEngine::check_headers() {
  const int which = int((coll_ - 1) & 1);
  const Header& mine = ctl(me_)->hdr[which];
  bool differ[7] = {};  // kind op dtype bytes name root path
  for (int p = 0; p < n_; ++p) {
    const Header& h = ctl(p)->hdr[which];
    if (h.coll != mine.coll) {
      fail("collective sequence numbers diverged");
      throw TransportError(current_collective() + ": " + rank_label(p) + " is at collective #" +
                           std::to_string(h.coll) + "; the shared-memory state is corrupt");
    }
    differ[0] |= h.kind != mine.kind;
    differ[1] |= h.op != mine.op;
    differ[2] |= h.dtype != mine.dtype;
    differ[3] |= h.nbytes != mine.nbytes;
    differ[4] |= h.name_hash != mine.name_hash;
    differ[5] |= h.root != mine.root;
    differ[6] |= h.path != mine.path;
  }
  if (differ[0] || mine.kind == kVerdict) {
    // A verdict reached outside the engine replaces this collective: every
    // rank raises the first message given.
    bool verdict = false;
    for (int p = 0; p < n_; ++p) {
      const Header& h = ctl(p)->hdr[which];
      if (h.kind != kVerdict) continue;
      verdict = true;
      if (h.note_len) throw MismatchError(std::string(h.note, h.note_len));
    }
    if (verdict) {
      throw MismatchError(std::string(kind_name(mine.kind)) + " #" + std::to_string(mine.coll) +
                          " mismatch: a rank gave up this collective without saying why");
    }
  }
  if (!std::any_of(std::begin(differ), std::end(differ), [](bool d) { return d; })) return;
  std::ostringstream msg;
  if (!(differ[0] || differ[1] || differ[2] || differ[3] || differ[4] || differ[5])) {
    // Same call, different data paths: one rank passed its scratch() buffer
    // and another did not.
    msg << kind_name(mine.kind) << " mismatch: the ranks' buffers take different paths (";
    for (int p = 0; p < n_; ++p) {
      msg << (p ? ", " : "") << rank_label(p) << " " << path_name(ctl(p)->hdr[which].path);
    }
    msg << "); either every rank or none passes the buffer scratch() returned";
    throw MismatchError(msg.str());
  }
  msg << (differ[0] ? "collective" : kind_name(mine.kind)) << " mismatch: ";
  for (int p = 0; p < n_; ++p) {
    const Header& h = ctl(p)->hdr[which];
    if (p) msg << ", ";
    msg << rank_label(p) << (differ[0] ? " called " : " has ");
    std::vector<std::string> parts;
    if (differ[0]) parts.push_back(kind_name(h.kind));
    if (differ[1] && h.op != kNone) parts.push_back(std::string("op ") + op_name(int(h.op)));
    if (h.dtype != kNone) {
      parts.push_back(std::string("dtype ") + dtype_name(int(h.dtype)));
      parts.push_back("count " + std::to_string(h.nbytes / dtype_size(int(h.dtype))));
    } else if (h.kind == kBroadcast || h.kind == kAllgatherv) {
      parts.push_back(std::to_string(h.nbytes) + " bytes");
    }
    if (differ[5] && h.root >= 0) parts.push_back("root " + std::to_string(h.root));
    if (differ[4]) {
      std::string quoted = "'" + std::string(h.name, h.name_len) +
                           (h.name_len == sizeof(h.name) ? "...'" : "'");
      parts.push_back(h.name_len ? "name " + quoted : "no name");
      if (h.kind == kAllgatherv) {
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h.name_hash));
        parts.push_back(std::string("counts/name hash ") + buf);
      }
    }
    for (size_t i = 0; i < parts.size(); ++i) msg << (i ? " " : "") << parts[i];
  }
  // Every rank saw the same headers and raises the same error; the steps stay
  // in lock step, so the engine remains usable.
  throw MismatchError(msg.str());
}

void ShmEngine::attach() {
  begin(kAttach, kNone, kNone, -1, 0, {});
  Probe& probe = ctl(me_)->probe;
  if (getrandom(&probe_value_, sizeof(probe_value_), 0) != ssize_t(sizeof(probe_value_))) {
    probe_value_ = uint64_t(getpid()) * 0x9e3779b97f4a7c15ull ^ uint64_t(now_seconds() * 1e9);
  }
  probe.addr = reinterpret_cast<uint64_t>(&probe_value_);
  probe.value = probe_value_;
  probe.want = opt_.single_copy && n_ > 1 && opt_.pids.size() == size_t(n_) ? 1 : 0;
  probe.ok = 0;
  probe.reason[0] = 0;
  publish();
  wait_all();
  check_headers();
  probe_single_copy();
  if (opt_.create) unlink();
}

void ShmEngine::probe_single_copy() {
  if (n_ == 1) {
    single_copy_status_ = "off: one local rank";
    return;
  }
  // Step 1 (attach's) published every probe; read each peer's value, then
  // publish whether that worked and learn the others' verdicts in step 2.
  Probe& mine = ctl(me_)->probe;
  std::string reason;
  if (!mine.want) {
    reason = opt_.single_copy ? rank_label(me_) + " does not know its peers' pids"
                              : "disabled on " + rank_label(me_);
  }
  for (int p = 0; p < n_ && reason.empty(); ++p) {
    if (p == me_) continue;
    const Probe& peer = ctl(p)->probe;
    if (!peer.want) continue;  // that rank reports why
    uint64_t seen = 0;
    iovec local{&seen, sizeof(seen)};
    iovec remote{reinterpret_cast<void*>(peer.addr), sizeof(seen)};
    const ssize_t got = process_vm_readv(pid_t(opt_.pids[size_t(p)]), &local, 1, &remote, 1, 0);
    if (got != ssize_t(sizeof(seen))) {
      reason = rank_label(me_) + " cannot read the memory of " + rank_label(p) + ": " +
               (got < 0 ? std::strerror(errno) : "short read");
    } else if (seen != peer.value) {
      reason = "pid " + std::to_string(opt_.pids[size_t(p)]) + " of " + rank_label(p) +
               " names another process here (separate pid namespaces?)";
    }
  }
  mine.ok = reason.empty() ? 1 : 0;
  std::snprintf(mine.reason, sizeof(mine.reason), "%s", reason.c_str());
  publish();
  wait_all();
  single_copy_ = true;
  for (int p = 0; p < n_ && single_copy_; ++p) {
    const Probe& probe = ctl(p)->probe;
    if (!probe.ok) {
      single_copy_ = false;
      single_copy_status_ = std::string("off: ") + probe.reason;
    }
  }
  if (single_copy_) single_copy_status_ = "on";
}

uint32_t ShmEngine::choose_path(size_t nbytes, bool in_slot) const {
  if (in_slot) return kInSlot;
  if (single_copy_ && nbytes >= opt_.single_copy_bytes) return kSingleCopy;
  return nbytes <= kSmallBytes ? kSmall : kChunked;
}

void ShmEngine::read_peer(int p, void* local, uint64_t remote, size_t nbytes) {
  auto* to = static_cast<uint8_t*>(local);
  while (nbytes > 0) {
    iovec lv{to, nbytes};
    iovec rv{reinterpret_cast<void*>(remote), nbytes};
    const ssize_t got = process_vm_readv(pid_t(opt_.pids[size_t(p)]), &lv, 1, &rv, 1, 0);
    if (got <= 0) {
      const int err = got < 0 ? errno : EIO;
      if (err == EINTR) continue;
      std::string what = current_collective() + ": cannot read the buffer of " + rank_label(p) +
                         " (pid " + std::to_string(opt_.pids[size_t(p)]) + "): ";
      if (err == ESRCH || !process_alive(opt_.pids[size_t(p)])) {
        fail("a peer died during a single-copy read");
        throw PeerFailureError(what + "the process died");
      }
      fail("a single-copy read failed");
      throw TransportError(what + std::strerror(err));
    }
    to += got;
    remote += uint64_t(got);
    nbytes -= size_t(got);
  }
}

void ShmEngine::load_peer_addresses() {
  const int which = int((coll_ - 1) & 1);
  for (int p = 0; p < n_; ++p) {
    const Header& h = ctl(p)->hdr[which];
    peer_src_[size_t(p)] = h.src;
    peer_dst_[size_t(p)] = h.dst;
  }
}

void ShmEngine::unlink() {
  if (!opt_.create || unlinked_) return;
  unlinked_ = true;
  if (shm_unlink(opt_.name.c_str()) != 0 && errno != ENOENT) {
    throw TransportError("shm: cannot unlink '" + opt_.name + "': " + std::strerror(errno));
  }
}

void ShmEngine::barrier() { check_barrier(); }

void ShmEngine::allreduce(void* buf, size_t nbytes, DType dtype, Op op, std::string_view name,
                          const void* send) {
  uint8_t* bytes = static_cast<uint8_t*>(buf);
  const uint8_t* from = send ? static_cast<const uint8_t*>(send) : bytes;
  ensure_usable();
  const bool in_slot =
      nbytes > 0 && bytes == data(me_, next_buf_) && nbytes <= half_bytes_ && from == bytes;
  if (!in_slot && (overlaps_slot(buf, nbytes) || overlaps_slot(from, nbytes))) {
    throw std::invalid_argument(
        "allreduce: a buffer inside this rank's shared-memory slot must be the one scratch() "
        "returned, from offset 0, reduced in place, with no collective called in between");
  }
  if (from != bytes && nbytes && from < bytes + nbytes && bytes < from + nbytes) {
    throw std::invalid_argument("allreduce: `send` and `buf` must be the same or not overlap");
  }
  begin_allreduce(nbytes, dtype, op, name);
  if (n_ == 1) {
    if (from != bytes && nbytes) std::memcpy(bytes, from, nbytes);
    return;
  }
  Header& h = ctl(me_)->hdr[(coll_ - 1) & 1];
  h.path = choose_path(nbytes, in_slot);
  switch (h.path) {
    case kSmall:
      reduce_small(bytes, from, nbytes, dtype, op);
      break;
    case kSingleCopy:
      h.src = reinterpret_cast<uint64_t>(from);
      h.dst = reinterpret_cast<uint64_t>(bytes);
      reduce_single_copy(bytes, from, nbytes, dtype, op);
      break;
    default:
      reduce_chunked(bytes, from, nbytes, dtype, op, in_slot);
  }
}

void ShmEngine::reduce_single_copy(uint8_t* buf, const uint8_t* send, size_t nbytes, DType dtype,
                                   Op op) {
  publish();
  wait_all();
  check_headers();
  load_peer_addresses();
  const size_t esize = dtype_size(int(dtype));
  const size_t count = nbytes / esize;
  const size_t per = round_up((count + size_t(n_) - 1) / size_t(n_), kLine / esize);
  auto share_lo = [&](int p) { return std::min(size_t(p) * per, count); };
  auto share_hi = [&](int p) { return std::min(size_t(p + 1) * per, count); };
  // Reduce-scatter: read every peer's part of this rank's share, a piece at a
  // time, and reduce the pieces (in rank order, as every path does) into `buf`.
  const size_t piece = kPieceBytes / esize;
  if (pieces_.size() < size_t(n_ - 1) * kPieceBytes) pieces_.resize(size_t(n_ - 1) * kPieceBytes);
  for (size_t at = share_lo(me_); at < share_hi(me_); at += piece) {
    const size_t m = std::min(piece, share_hi(me_) - at);
    uint8_t* next = pieces_.data();
    for (int p = 0; p < n_; ++p) {
      if (p == me_) {
        srcs_[size_t(p)] = send + at * esize;
        continue;
      }
      read_peer(p, next, peer_src_[size_t(p)] + at * esize, m * esize);
      srcs_[size_t(p)] = next;
      next += kPieceBytes;
    }
    reduce_many(buf + at * esize, srcs_.data(), size_t(n_), m, dtype, op);
  }
  publish();
  wait_all();
  // Allgather: read every peer's reduced share straight into `buf`.
  for (int p = 0; p < n_; ++p) {
    const size_t lo = share_lo(p), hi = share_hi(p);
    if (p != me_ && hi > lo) {
      read_peer(p, buf + lo * esize, peer_dst_[size_t(p)] + lo * esize, (hi - lo) * esize);
    }
  }
  // Peers may still be reading this rank's buffers until they publish this step.
  publish();
  wait_all();
}

void ShmEngine::reduce_small(void* buf, const void* send, size_t nbytes, DType dtype, Op op) {
  uint8_t* mine = data(me_, next_buf_);
  if (nbytes) std::memcpy(mine, send, nbytes);
  publish();
  wait_all();
  check_headers();
  for (int p = 0; p < n_; ++p) srcs_[size_t(p)] = data(p, next_buf_);
  reduce_many(buf, srcs_.data(), size_t(n_), nbytes / dtype_size(int(dtype)), dtype, op);
  next_buf_ ^= 1;
}

void ShmEngine::reduce_chunked(uint8_t* buf, const uint8_t* send, size_t nbytes, DType dtype,
                               Op op, bool in_slot) {
  const size_t esize = dtype_size(int(dtype));
  // Share boundaries fall on cache lines; a chunk is whole elements of every share.
  const size_t align_elems = kLine / esize;
  const size_t chunk_bytes =
      in_slot ? nbytes : std::min(half_bytes_, round_up(kChunkBytes * size_t(n_), kLine));
  bool first = true;
  for (size_t off = 0; off < nbytes; off += chunk_bytes) {
    const size_t cb = std::min(chunk_bytes, nbytes - off);
    const size_t count = cb / esize;
    const size_t per = round_up((count + size_t(n_) - 1) / size_t(n_), align_elems);
    auto share_lo = [&](int p) { return std::min(size_t(p) * per, count); };
    auto share_hi = [&](int p) { return std::min(size_t(p + 1) * per, count); };
    uint8_t* mine = data(me_, next_buf_);
    if (!in_slot) std::memcpy(mine, send + off, cb);
    publish();
    wait_all();
    if (first) {
      check_headers();
      first = false;
    }
    // Reduce-scatter: this rank reduces its share of every rank's chunk.
    const size_t lo = share_lo(me_), hi = share_hi(me_);
    if (hi > lo) {
      for (int p = 0; p < n_; ++p) srcs_[size_t(p)] = data(p, next_buf_) + lo * esize;
      reduce_many(mine + lo * esize, srcs_.data(), size_t(n_), hi - lo, dtype, op);
    }
    publish();
    wait_all();
    // Allgather: copy every reduced share out.
    for (int p = 0; p < n_; ++p) {
      if (p == me_ && in_slot) continue;
      const size_t plo = share_lo(p), phi = share_hi(p);
      if (phi > plo) {
        std::memcpy(buf + off + plo * esize, data(p, next_buf_) + plo * esize, (phi - plo) * esize);
      }
    }
    next_buf_ ^= 1;
  }
}

void ShmEngine::allreduce_parts(const std::vector<Part>& parts, DType dtype, Op op, bool average,
                                std::string_view name) {
  ensure_usable();
  const size_t esize = dtype_size(int(dtype));
  size_t nbytes = 0;
  for (const Part& part : parts) {
    if (part.nbytes % esize != 0) {
      throw std::invalid_argument("allreduce_parts: every part must hold whole " +
                                  std::string(dtype_name(int(dtype))) + " elements. Received: " +
                                  std::to_string(part.nbytes) + " bytes");
    }
    if (overlaps_slot(part.src, part.nbytes) || overlaps_slot(part.dst, part.nbytes)) {
      throw std::invalid_argument(
          "allreduce_parts: a part must not lie in this rank's shared-memory slot");
    }
    nbytes += part.nbytes;
  }
  begin_allreduce(nbytes, dtype, op, name);
  if (n_ == 1) {
    for (const Part& part : parts) {
      if (part.src != part.dst && part.nbytes) std::memmove(part.dst, part.src, part.nbytes);
    }
    return;
  }
  ctl(me_)->hdr[(coll_ - 1) & 1].path = kParts;
  // One round for a message that fits kPartsOneRoundBytes, else windows of
  // kPartsWindowBytes (whole cache lines, so whole elements of every dtype).
  const size_t window = nbytes <= std::min(half_bytes_, kPartsOneRoundBytes)
                            ? nbytes
                            : std::min(half_bytes_, kPartsWindowBytes) / kLine * kLine;
  size_t w0 = 0;
  do {  // an empty message too takes one round: its header is checked
    const size_t w1 = std::min(nbytes, w0 + window);
    parts_window(parts, w0, w1, esize, dtype, op, average, w0 == 0);
    w0 = w1;
  } while (w0 < nbytes);
}

void ShmEngine::parts_window(const std::vector<Part>& parts, size_t w0, size_t w1, size_t esize,
                             DType dtype, Op op, bool average, bool first) {
  // Shares as reduce_chunked cuts one chunk, in bytes of the message.
  const size_t count = (w1 - w0) / esize;
  const size_t per = round_up((count + size_t(n_) - 1) / size_t(n_), kLine / esize);
  auto share_lo = [&](int p) { return w0 + std::min(size_t(p) * per, count) * esize; };
  auto share_hi = [&](int p) { return w0 + std::min(size_t(p + 1) * per, count) * esize; };
  const size_t lo = share_lo(me_), hi = share_hi(me_);
  // The slots hold the window: message byte x at slot byte x - w0.
  uint8_t* mine = data(me_, next_buf_);
  // Step 1: the peers' shares of this rank's window into its slot.
  size_t at = 0;
  for (const Part& part : parts) {
    const auto* src = static_cast<const uint8_t*>(part.src);
    const size_t end = at + part.nbytes;
    const size_t a = std::max(at, w0), b = std::min(end, w1);
    if (b > a) {
      const size_t until = std::min(b, lo);
      if (until > a) std::memcpy(mine + (a - w0), src + (a - at), until - a);
      const size_t from = std::max(a, hi);
      if (b > from) std::memcpy(mine + (from - w0), src + (from - at), b - from);
    }
    at = end;
  }
  publish();
  wait_all();
  if (first) check_headers();
  // Step 2: this rank's share, from the peers' slots and its own sources, in
  // rank order as every path reduces; a piece at a time while it is in L1:
  // reduced (and averaged) into the slot and this rank's own destination at
  // once (so step 3 copies only the peers' shares).
  at = 0;
  for (const Part& part : parts) {
    const size_t end = at + part.nbytes;
    const size_t a = std::max(at, lo), b = std::min(end, hi);
    const auto* src = static_cast<const uint8_t*>(part.src);
    auto* dst = static_cast<uint8_t*>(part.dst);
    for (size_t x = a; x < b; x += kL1PieceBytes) {
      const size_t y = std::min(b, x + kL1PieceBytes);
      for (int p = 0; p < n_; ++p) srcs_[size_t(p)] = data(p, next_buf_) + (x - w0);
      srcs_[size_t(me_)] = src + (x - at);
      reduce_finish(mine + (x - w0), dst + (x - at), srcs_.data(), size_t(n_), (y - x) / esize,
                    dtype, op, average ? n_ : 0);
    }
    at = end;
  }
  publish();
  wait_all();
  // Step 3: the peers' reduced shares into the destinations.
  at = 0;
  for (const Part& part : parts) {
    auto* dst = static_cast<uint8_t*>(part.dst);
    const size_t end = at + part.nbytes;
    for (int p = 0; p < n_; ++p) {
      if (p == me_) continue;
      const size_t a = std::max(at, share_lo(p)), b = std::min(end, share_hi(p));
      if (b > a) std::memcpy(dst + (a - at), data(p, next_buf_) + (a - w0), b - a);
    }
    at = end;
  }
  next_buf_ ^= 1;
}

void ShmEngine::broadcast(void* buf, size_t nbytes, int root, std::string_view name,
                          const void* send) {
  if (root < 0 || root >= n_) {
    throw std::invalid_argument("broadcast: `root` must be in [0, local_size). Received: root=" +
                                std::to_string(root) + " (local_size=" + std::to_string(n_) + ")");
  }
  uint8_t* out = static_cast<uint8_t*>(buf);
  const uint8_t* src = send && send != buf ? static_cast<const uint8_t*>(send) : out;
  if (me_ == root && src != out && nbytes &&
      (overlaps_slot(buf, nbytes) || (src < out + nbytes && out < src + nbytes))) {
    std::memmove(out, src, nbytes);  // as without `send`
    src = out;
  }
  begin_broadcast(nbytes, root, name);
  if (n_ == 1) {
    if (src != out && nbytes) std::memcpy(out, src, nbytes);
    return;
  }
  // Always through the slots: the root's copy into its slot overlaps the
  // others' copies out of it, which reading the root's buffer directly (one
  // copy, done by the readers alone) measured no faster than.
  ctl(me_)->hdr[(coll_ - 1) & 1].path = kChunked;
  std::unique_ptr<uint8_t[]> copy;
  if (me_ == root && overlaps_slot(src, nbytes)) {
    copy.reset(new uint8_t[nbytes]);
    std::memcpy(copy.get(), src, nbytes);
    src = copy.get();
  }
  const bool copy_out_at_root = me_ == root && src != out;
  const size_t chunk_bytes = std::min(half_bytes_, size_t(1) << 20);
  size_t off = 0;
  bool first = true;
  do {
    const size_t cb = std::min(chunk_bytes, nbytes - off);
    if (me_ == root && cb) std::memcpy(data(root, next_buf_), src + off, cb);
    publish();
    if (copy_out_at_root && cb) std::memcpy(out + off, src + off, cb);
    wait_all();
    if (first) {
      check_headers();
      first = false;
    }
    if (me_ != root && cb) std::memcpy(out + off, data(root, next_buf_), cb);
    next_buf_ ^= 1;
    off += cb;
  } while (off < nbytes);
}

void ShmEngine::gather_records(const void* head, size_t head_bytes, const void* body,
                               size_t body_bytes, size_t record_bytes, std::string_view name) {
  uint64_t used = 0;
  if (head_bytes >= sizeof(used)) std::memcpy(&used, head, sizeof(used));
  const size_t limit = std::min(half_bytes_, size_t(1) << 20);
  if (head_bytes < sizeof(used) || used != head_bytes + body_bytes || used > record_bytes ||
      record_bytes > limit) {
    throw std::invalid_argument(
        "gather_records: the record must start with its used bytes (8 <= head + body <= "
        "record_bytes <= " + std::to_string(limit) + "). Received: first word " +
        std::to_string(used) + ", head " + std::to_string(head_bytes) + " + body " +
        std::to_string(body_bytes) + " bytes, record_bytes " + std::to_string(record_bytes));
  }
  record_counts_.assign(size_t(n_), record_bytes);
  begin_allgatherv(record_counts_, name);
  uint8_t* mine = data(me_, next_buf_);
  std::memcpy(mine, head, head_bytes);
  if (body_bytes) std::memcpy(mine + head_bytes, body, body_bytes);
  if (n_ > 1) {  // the prefixed allgatherv's one chunk, read in place
    ctl(me_)->hdr[(coll_ - 1) & 1].path = kChunked;
    publish();
    wait_all();
    check_headers();
  }
  records_buf_ = next_buf_;
  next_buf_ ^= 1;
}

void ShmEngine::allgatherv(const void* send, size_t send_bytes, void* recv,
                           const std::vector<uint64_t>& counts_bytes, std::string_view name,
                           bool prefixed) {
  if (counts_bytes.size() != size_t(n_)) {
    throw std::invalid_argument("allgatherv: `counts` must have local_size entries. Received: " +
                                std::to_string(counts_bytes.size()) + " (local_size=" +
                                std::to_string(n_) + ")");
  }
  if (counts_bytes[size_t(me_)] != send_bytes) {
    throw std::invalid_argument("allgatherv: `send` must have counts[local_rank] bytes. Received: " +
                                std::to_string(send_bytes) + " bytes, counts[" +
                                std::to_string(me_) + "]=" +
                                std::to_string(counts_bytes[size_t(me_)]));
  }
  std::vector<size_t> displ(size_t(n_) + 1, 0);
  for (int p = 0; p < n_; ++p) displ[size_t(p) + 1] = displ[size_t(p)] + counts_bytes[size_t(p)];
  const size_t total = displ[size_t(n_)];
  if (overlaps_slot(recv, total)) {
    throw std::invalid_argument("allgatherv: `recv` must not be a scratch() buffer");
  }
  const size_t chunk_bytes = std::min(half_bytes_, size_t(1) << 20);
  // The bytes of a record at `p` that matter: its first word, kept within `limit`.
  auto used = [](const uint8_t* p, size_t limit) {
    uint64_t n = 0;
    if (limit >= sizeof(n)) std::memcpy(&n, p, sizeof(n));
    return size_t(std::min<uint64_t>(n, limit));
  };
  if (prefixed) {
    for (uint64_t c : counts_bytes) {
      if (c < sizeof(uint64_t) || c > chunk_bytes) {
        throw std::invalid_argument(
            "allgatherv: a prefixed record must have 8 to " + std::to_string(chunk_bytes) +
            " bytes. Received: counts_bytes with " + std::to_string(c));
      }
    }
  }
  begin_allgatherv(counts_bytes, name);
  uint8_t* out = static_cast<uint8_t*>(recv);
  if (n_ == 1) {
    const uint8_t* from = static_cast<const uint8_t*>(send);
    if (send_bytes) std::memmove(out, send, prefixed ? used(from, send_bytes) : send_bytes);
    return;
  }
  // Peers read `send` while this rank writes `recv`: keep a private copy of a
  // `send` that `recv` overlaps (unless it sits exactly at this rank's place),
  // or that lies in the slot the copy path writes.
  const uint8_t* src = static_cast<const uint8_t*>(send);
  std::unique_ptr<uint8_t[]> copy;
  const bool overlaps_recv = send_bytes && src < out + total && out < src + send_bytes &&
                             src != out + displ[size_t(me_)];
  if (overlaps_recv || overlaps_slot(send, send_bytes)) {
    copy.reset(new uint8_t[send_bytes]);
    std::memcpy(copy.get(), send, send_bytes);
    src = copy.get();
  }
  Header& h = ctl(me_)->hdr[(coll_ - 1) & 1];
  h.path = single_copy_ && !prefixed && total >= kAllgatherSingleCopyBytes ? kSingleCopy
                                                                           : kChunked;
  if (h.path == kSingleCopy) {
    h.src = reinterpret_cast<uint64_t>(src);
    publish();
    wait_all();
    check_headers();
    load_peer_addresses();
    for (int p = 0; p < n_; ++p) {
      const size_t cb = counts_bytes[size_t(p)];
      if (p == me_ && cb) std::memmove(out + displ[size_t(p)], src, cb);
      if (p != me_ && cb) read_peer(p, out + displ[size_t(p)], peer_src_[size_t(p)], cb);
    }
    publish();  // `send` is in use until every rank has read it
    wait_all();
    return;
  }
  if (prefixed) {  // one chunk
    if (send_bytes) std::memcpy(data(me_, next_buf_), src, used(src, send_bytes));
    publish();
    wait_all();
    check_headers();
    for (int p = 0; p < n_; ++p) {
      const uint8_t* record = data(p, next_buf_);
      std::memcpy(out + displ[size_t(p)], record, used(record, counts_bytes[size_t(p)]));
    }
    next_buf_ ^= 1;
    return;
  }
  const size_t largest = *std::max_element(counts_bytes.begin(), counts_bytes.end());
  size_t off = 0;
  bool first = true;
  do {
    const size_t mine = send_bytes > off ? std::min(chunk_bytes, send_bytes - off) : 0;
    if (mine) std::memcpy(data(me_, next_buf_), src + off, mine);
    publish();
    // This rank's own part, while the peers copy theirs in.
    uint8_t* own = out + displ[size_t(me_)] + off;
    if (mine && own != src + off) std::memcpy(own, src + off, mine);
    wait_all();
    if (first) {
      check_headers();
      first = false;
    }
    for (int p = 0; p < n_; ++p) {
      if (p == me_) continue;
      const size_t count = counts_bytes[size_t(p)];
      const size_t cb = count > off ? std::min(chunk_bytes, count - off) : 0;
      if (cb) std::memcpy(out + displ[size_t(p)] + off, data(p, next_buf_), cb);
    }
    next_buf_ ^= 1;
    off += chunk_bytes;
  } while (off < largest);
}

}  // namespace kd
