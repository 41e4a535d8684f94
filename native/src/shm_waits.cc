// The shm engine's waits for its peers: spin, yield, then block in a futex,
// checking liveness, aborts and the time limits (wait_timings.h).
#include "shm_internal.h"

namespace kd {

void ShmEngine::check_departed(int p, const std::string& where) {
  if (p == me_ || ctl(p)->left.load(std::memory_order_acquire) == 0) return;
  // A rank that aborted (e.g. was interrupted) and then left: its abort names the cause.
  if (reinterpret_cast<const SegmentLayout*>(base_)->abort_rank.load(std::memory_order_acquire) == p)
    raise_aborted(p, where);
  throw PeerFailureError(where + ": " + rank_label(p) +
                         " has shut down keras_dist (left the group) while " +
                         rank_label(me_) + " waits in this collective");
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

}  // namespace kd
