// The shm engine's collective headers: each collective's first step, and the
// comparison that makes every rank raise the same mismatch.
#include "shm_internal.h"

namespace kd {

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

}  // namespace kd
