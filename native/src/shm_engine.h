// The shared-memory collective engine: one POSIX segment per machine, a slot
// per local rank (control lines + two data buffers), collectives executed in
// lock step through monotonically increasing per-rank step counters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "reduce.h"

namespace kd {

// Ranks disagree about a collective (kind, op, dtype, size, name or root).
struct MismatchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A peer process died, or aborted the collective this rank waits in.
struct PeerFailureError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A wait passed timeout_seconds.
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The segment cannot be created, opened or used.
struct TransportError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct EngineOptions {
  std::string name;             // "/kd-..." as for shm_open
  bool create = false;          // true on local rank 0 only
  int local_rank = 0;
  int local_size = 1;
  size_t slot_bytes = 16u << 20;  // data bytes per rank (two buffers)
  std::vector<int64_t> pids;      // pid of every local rank
  std::vector<int64_t> ranks;     // global rank of every local rank, for messages
  double stall_seconds = 60.0;    // 0: never warn
  double timeout_seconds = 0.0;   // 0: wait forever (still checking liveness)
  // Single-copy reads of peers' buffers (process_vm_readv) when every local
  // rank can read every other one: allreduces of at least single_copy_bytes,
  // allgathers of at least 16 KiB.
  bool single_copy = true;
  size_t single_copy_bytes = 1u << 20;
};

// Hooks into the host runtime, called from slow waits (never from the fast path).
struct EngineHooks {
  // Receives stall warnings. May throw; the collective then aborts.
  std::function<void(const std::string&)> on_stall;
  // Called every kLivenessSeconds (wait_timings.h) while waiting; throws to abandon the wait
  // (for example when the process got SIGINT).
  std::function<void()> check_interrupt;
};

struct SegmentLayout;

class ShmEngine {
 public:
  ShmEngine(const EngineOptions& options, EngineHooks hooks);
  ~ShmEngine();
  ShmEngine(const ShmEngine&) = delete;
  ShmEngine& operator=(const ShmEngine&) = delete;

  // Collective: returns once every local rank has mapped the segment; local
  // rank 0 then unlinks the name, so nothing can leak even on SIGKILL.
  void attach();
  // Removes the name if it still exists (local rank 0; idempotent).
  void unlink();
  // Marks this rank as gone from the group (idempotent; the destructor does it
  // too): a peer that waits for it, or starts a collective after it, raises
  // PeerFailureError naming it instead of waiting. No collective may follow.
  void leave();

  // Header-only steps: each compares this call with the local ranks' calls
  // exactly as the collective of that name does first (and raises the same
  // MismatchError on every local rank), without moving data. A transport that
  // must learn a verdict before any data moves (hierarchical: machines agree
  // first) runs one, then the collective itself.
  void check_allreduce(size_t nbytes, DType dtype, Op op, std::string_view name = {});
  void check_broadcast(size_t nbytes, int root, std::string_view name = {});
  void check_allgatherv(const std::vector<uint64_t>& counts_bytes, std::string_view name = {});
  void check_barrier();
  // Takes the place of this rank's next collective (any kind) and makes every
  // local rank raise MismatchError for it, with the first non-empty `message`
  // any of them gave. The engine stays usable: a verdict reached outside the
  // engine (between machines) reaches every local rank this way.
  [[noreturn]] void raise_mismatch(const std::string& message);

  // `name` (optional) is part of what ranks must agree on; mismatch errors quote it.
  // `send` (optional, nbytes like `buf`) makes the allreduce out of place.
  void allreduce(void* buf, size_t nbytes, DType dtype, Op op, std::string_view name = {},
                 const void* send = nullptr);
  // `send` (optional, the root's): the root broadcasts `send` and copies it
  // into its `buf` while the others copy it out.
  void broadcast(void* buf, size_t nbytes, int root, std::string_view name = {},
                 const void* send = nullptr);
  // `prefixed`: each rank's `send` is a record whose first uint64 is the
  // number of its bytes that matter (that word included); only those are
  // copied, in and out (the rest of each place in `recv` is left as it was).
  // Records are at most one chunk of the slot; always the slots' path.
  void allgatherv(const void* send, size_t send_bytes, void* recv,
                  const std::vector<uint64_t>& counts_bytes, std::string_view name = {},
                  bool prefixed = false);
  void barrier();
  // The prefixed allgatherv above (same header, so peers may call either),
  // with this rank's record written straight into its slot (`head`, then
  // `body`; head's first uint64 says how many bytes of the record matter)
  // and every rank's record left there: record(p) points at rank p's until
  // this rank's next collective (a peer rewrites that buffer only after
  // this rank has published a later step).
  void gather_records(const void* head, size_t head_bytes, const void* body, size_t body_bytes,
                      size_t record_bytes, std::string_view name = {});
  const uint8_t* record(int p) const { return data(p, records_buf_); }

  // One contiguous run of an allreduce's message (allreduce_parts): `nbytes`
  // read from `src`, and the same bytes of the result written to `dst`
  // (which may be `src`).
  struct Part {
    const void* src;
    void* dst;
    size_t nbytes;
  };
  // Allreduce of a message made of `parts` end to end, read from the sources
  // and written to the destinations without a fused buffer: the engine copies
  // only the peers' shares of the sources into its slot, reduces its own
  // share straight from them (and, with `average`, turns it into an average
  // as average_inplace does, before peers copy it), and copies every rank's
  // reduced share into the destinations. A message larger than one buffer
  // (buffer_bytes()) goes in windows, each one round of these steps.
  // Every rank must call this (its header says so) for the same message.
  void allreduce_parts(const std::vector<Part>& parts, DType dtype, Op op, bool average,
                       std::string_view name = {});

  // This rank's next data buffer, valid until the next collective; allreduce
  // of a buffer starting there skips the copy in. nullptr if nbytes is larger
  // than one buffer.
  uint8_t* scratch(size_t nbytes);
  size_t buffer_bytes() const { return half_bytes_; }
  bool overlaps_slot(const void* p, size_t nbytes) const;

  // Whether large allreduces and allgathers read peers' buffers
  // directly, and if not, why ("on" or "off: <reason>"); set by attach().
  bool single_copy() const { return single_copy_; }
  const std::string& single_copy_status() const { return single_copy_status_; }

  int local_rank() const { return me_; }
  int local_size() const { return n_; }
  const std::string& name() const { return opt_.name; }

  // Seconds this rank has spent waiting for peers inside collectives since
  // the engine was made (every wait of every collective); the timeline reads
  // it before and after a call to split the call into waiting and moving data.
  double wait_seconds() const { return wait_seconds_; }

  // How long a wait polls, yielding, before it blocks (wait_timings.h):
  // kOwnCoreYieldSeconds when every local rank has a CPU of its own, else
  // kYieldSeconds.
  double yield_seconds() const { return yield_seconds_; }
  // Benchmarks compare the two policies in one job; a value in [0, 1] seconds.
  void set_yield_seconds(double seconds);

 private:
  struct Header;
  struct Probe;
  struct RankCtl;

  void begin(uint32_t kind, uint32_t op, uint32_t dtype, int32_t root, uint64_t nbytes,
             std::string_view name, uint64_t extra_hash = 0);
  // The header of each collective (begin() with its fields).
  void begin_allreduce(size_t nbytes, DType dtype, Op op, std::string_view name);
  void begin_broadcast(size_t nbytes, int root, std::string_view name);
  void begin_allgatherv(const std::vector<uint64_t>& counts_bytes, std::string_view name);
  // The first step alone: publish the header, wait, compare.
  inline void header_step();
  // Raises PeerFailureError if local rank p has left the group (leave()).
  void check_departed(int p, const std::string& where);
  inline void publish();
  void wait_all();
  void check_headers();
  // Poisons the segment: every rank's current or next wait raises.
  void fail(const char* reason);
  [[noreturn]] void raise_aborted(int32_t rank, const std::string& where);
  inline void ensure_usable();
  std::string describe_missing(const std::vector<int>& missing) const;
  std::string rank_label(int local) const;
  std::string current_collective() const;

  inline RankCtl* ctl(int rank) const;
  inline void prefetch_peers() const;
  uint8_t* data(int rank, int which) const {
    return base_ + data_offset_ + (size_t(rank) * 2 + size_t(which)) * half_bytes_;
  }
  void reduce_small(void* buf, const void* send, size_t nbytes, DType dtype, Op op);
  // One window [w0, w1) of allreduce_parts' message: its two steps (with the
  // header check when `first`), as one chunk of reduce_chunked.
  void parts_window(const std::vector<Part>& parts, size_t w0, size_t w1, size_t esize,
                    DType dtype, Op op, bool average, bool first);
  void reduce_chunked(uint8_t* buf, const uint8_t* send, size_t nbytes, DType dtype, Op op,
                      bool in_slot);
  void reduce_single_copy(uint8_t* buf, const uint8_t* send, size_t nbytes, DType dtype, Op op);
  void probe_single_copy();
  // The path this collective takes; every rank must take the same one.
  inline uint32_t choose_path(size_t nbytes, bool in_slot) const;
  // Copies nbytes at `remote` in local rank p's address space to `local`.
  void read_peer(int p, void* local, uint64_t remote, size_t nbytes);
  // Collects every rank's published addresses of the current collective.
  inline void load_peer_addresses();

  EngineOptions opt_;
  EngineHooks hooks_;
  int me_ = 0;
  int records_buf_ = 0;  // the buffer of the last gather_records
  std::vector<uint64_t> record_counts_;  // its counts (kept: no allocation per call)
  int n_ = 1;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  size_t map_bytes_ = 0;
  size_t half_bytes_ = 0;
  size_t data_offset_ = 0;
  bool unlinked_ = false;
  bool broken_ = false;
  bool left_ = false;
  uint64_t step_ = 0;   // last step this rank published
  double wait_seconds_ = 0.0;  // see wait_seconds()
  double yield_seconds_ = 0.0;  // see yield_seconds()
  uint64_t coll_ = 0;   // collectives begun so far
  int next_buf_ = 0;    // data buffer the next write uses
  std::vector<const void*> srcs_;
  bool single_copy_ = false;
  std::string single_copy_status_ = "off: not attached";
  uint64_t probe_value_ = 0;         // what peers must read at &probe_value_
  std::vector<uint64_t> peer_src_;  // peers' source buffers in their address spaces
  std::vector<uint64_t> peer_dst_;  // peers' destination buffers
  std::vector<uint8_t> pieces_;     // peers' pieces of this rank's share, read in turn
};

}  // namespace kd
