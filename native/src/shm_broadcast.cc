// The shm engine's broadcast.
#include "shm_internal.h"

namespace kd {

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

}  // namespace kd
