// The shm engine's allreduce paths: one round, chunked copies (in or out of
// the slot), single copy, and from parts (allreduce_parts).
#include "shm_internal.h"

namespace kd {

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

}  // namespace kd
