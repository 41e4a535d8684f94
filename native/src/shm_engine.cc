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
//
// This file: the segment (create, map, attach, unlink) and the rank's
// place in the group (leave, failures); the other parts are shm_*.cc.
#include "shm_internal.h"

namespace kd {

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

void ShmEngine::unlink() {
  if (!opt_.create || unlinked_) return;
  unlinked_ = true;
  if (shm_unlink(opt_.name.c_str()) != 0 && errno != ENOENT) {
    throw TransportError("shm: cannot unlink '" + opt_.name + "': " + std::strerror(errno));
  }
}

void ShmEngine::barrier() { check_barrier(); }

}  // namespace kd
