// The shm engine's allgathers: the records of gather_records and allgatherv.
#include "shm_internal.h"

namespace kd {

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
