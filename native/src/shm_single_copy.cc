// The shm engine's single-copy path: the probe at attach (can every rank
// read its peers' memory?) and the reads of peers' buffers.
#include "shm_internal.h"

namespace kd {

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

}  // namespace kd
