// The one-call collectives on numpy arrays and the public calls' dispatch
// (one_call.cc), and what the traced steps' plans (plans.cc) share with them:
// the public ops, the allgather's records and its core, the dispatch state.
#pragma once

#include <nanobind/nanobind.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "py_common.h"
#include "shm_engine.h"

namespace kdpy {

// The public ops by the index keras_dist/tensor/ops.py passes: Average, Sum,
// Min, Max, Product (their ReduceOp values name them).
struct PublicOp {
  const char* value;
  kd::Op op;
  bool average;
};
constexpr PublicOp kPublicOps[] = {{"average", kd::Op::kSum, true},
                                   {"sum", kd::Op::kSum, false},
                                   {"min", kd::Op::kMin, false},
                                   {"max", kd::Op::kMax, false},
                                   {"product", kd::Op::kProduct, false}};
constexpr int kNumPublicOps = int(sizeof(kPublicOps) / sizeof(kPublicOps[0]));

// kd.allgather as keras_dist/tensor/ops.py `_allgather_array` takes it (so
// peers may take either path): first every rank's record, named
// "<name> shapes": int64 words [used bytes, inline, ndim, numpy type number,
// shape padded to kGatherMaxDims] (ndim 0 counts as shape (1,)), followed by
// the data when it has at most kGatherInline bytes (inline 1); then, when the
// ranks agree on the dtype and the shape past the first dimension and some
// rank's data did not fit, the allgather of the data. Returns a new array,
// None (the general path serves the call), or, when the ranks disagree, the
// headers from `ndim` on as bytes (int64, kGatherHeader per rank) for the
// caller to describe the disagreement.
constexpr int kGatherMaxDims = 8;
constexpr int kGatherHeader = 2 + kGatherMaxDims;
constexpr int kGatherWords = 2 + kGatherHeader;
constexpr size_t kGatherInline = 4096;
constexpr size_t kGatherRecord = kGatherWords * sizeof(int64_t) + kGatherInline;

// One rank's part of such an allgather: `ndim` (1 to kGatherMaxDims) dims,
// elements of numpy type `type_number`, `itemsize` bytes each.
struct GatherIn {
  const void* data;
  int ndim;
  int64_t dims[kGatherMaxDims];
  int type_number;
  size_t itemsize;

  size_t nbytes() const {
    size_t n = itemsize;
    for (int d = 0; d < ndim; ++d) n *= size_t(dims[d]);
    return n;
  }
};

// This rank's record words for `in`, as laid out above (the data, when
// inline, follows them). tests/unit/test_shared_tables.py checks them against
// keras_dist/tensor/gather_records.py's record_of (_native._gather_record_words).
inline void gather_record_words(const GatherIn& in, int64_t (&words)[kGatherWords]) {
  const size_t data_bytes = in.nbytes();
  const bool inline_data = data_bytes <= kGatherInline;
  std::fill(words, words + kGatherWords, 0);
  words[0] = int64_t(kGatherWords * sizeof(int64_t) + (inline_data ? data_bytes : 0));
  words[1] = inline_data ? 1 : 0;
  words[2] = in.ndim;
  words[3] = in.type_number;
  std::copy(in.dims, in.dims + in.ndim, words + 4);
}

// Nothing to release around the engine's calls (a caller without the GIL).
struct NoRelease {};

// The allgather of `in` described above, named `name`: `out(rows)` returns
// where the result (rows, *dims[1:]) goes. Returns true, or false when the
// ranks disagree (then `headers` holds every rank's header, kGatherHeader
// words each, and nothing else moved). `Release` is held around the engine's
// calls (nb::gil_scoped_release from Python). `name` and `shapes_name` are
// the data step's name and the records'.
template <class Release, class Out>
bool gather_core(kd::ShmEngine& engine, const GatherIn& in, const std::string& name,
                 const std::string& shapes_name, Out&& out, std::vector<int64_t>& headers) {
  const int n = engine.local_size();
  const size_t data_bytes = in.nbytes();
  const bool inline_data = data_bytes <= kGatherInline;
  int64_t mine[kGatherWords];
  gather_record_words(in, mine);
  {
    [[maybe_unused]] Release release;
    engine.gather_records(mine, sizeof(mine), in.data, inline_data ? data_bytes : 0,
                          kGatherRecord, shapes_name);
  }
  // The records stay in the engine's slots until this rank's next collective.
  auto words = [&](int p) {  // rank p's record's words (an aligned copy)
    std::array<int64_t, kGatherWords> w;
    std::memcpy(w.data(), engine.record(p), sizeof(mine));
    return w;
  };
  int64_t rows = 0;
  bool all_inline = true;
  for (int p = 0; p < n; ++p) {
    const auto h = words(p);
    if (h[2] != mine[2] || h[3] != mine[3] || !std::equal(h.data() + 5, h.data() + 4 + mine[2],
                                                          mine + 5)) {
      headers.assign(size_t(n) * kGatherHeader, 0);
      for (int q = 0; q < n; ++q) {
        const auto hq = words(q);
        std::copy(hq.data() + 2, hq.data() + kGatherWords, headers.data() + size_t(q) * kGatherHeader);
      }
      return false;
    }
    rows += h[4];
    all_inline = all_inline && h[1] != 0;
  }
  thread_local std::vector<uint64_t> counts;
  counts.resize(size_t(n));
  int64_t row_items = 1;
  for (int d = 1; d < in.ndim; ++d) row_items *= in.dims[d];
  for (int p = 0; p < n; ++p) {
    counts[size_t(p)] = uint64_t(words(p)[4] * row_items * int64_t(in.itemsize));
  }
  void* result = out(rows);
  if (all_inline) {
    uint8_t* at = static_cast<uint8_t*>(result);
    for (int p = 0; p < n; ++p) {
      std::memcpy(at, engine.record(p) + sizeof(mine), counts[size_t(p)]);
      at += counts[size_t(p)];
    }
    return true;
  }
  [[maybe_unused]] Release release;
  engine.allgatherv(in.data, data_bytes, result, counts, name);
  return true;
}

// ---- The public calls' dispatch ---------------------------------------------
// kd.allreduce / kd.broadcast / kd.allgather call these first, whatever `x`
// is. They serve a numpy.ndarray (exactly) when the runtime has registered
// the job's shm engine (set_dispatch_engine) and no timeline records
// (set_dispatch_recording), through the entries above, counting the call in
// keras_dist.tensor.ops.COUNTERS; otherwise, or when the entry cannot serve
// the call, they return None and the caller takes its general path. Python
// hands over everything used here explicitly: nothing reads a Python
// object's attributes, so a small call's Python stays in the public
// function's own frame.
struct Dispatch {
  PyObject* counters = nullptr;  // keras_dist.tensor.ops.COUNTERS
  PyObject* ops[kNumPublicOps] = {};  // Average, Sum, Min, Max, Product
  PyObject* engine = nullptr;  // the job's ShmEngine, or null (a strong reference)
  bool recording = false;  // whether a timeline records (the general path records)
  uint64_t served = 0;  // calls the entries served, for tests
  PyObject* key_allreduce = nullptr;
  PyObject* key_broadcast = nullptr;
  PyObject* key_allgather = nullptr;

  // The engine to serve the job's calls now, or null.
  kd::ShmEngine* serving_engine() const {
    if (!engine || recording) return nullptr;
    return nb::inst_ptr<kd::ShmEngine>(engine);
  }

  // Adds 1 to counters[key] (key: an interned str).
  void count(PyObject* key) {
    if (!counters) return;
    PyObject* now = PyDict_GetItemWithError(counters, key);  // borrowed
    if (!now) {
      if (PyErr_Occurred()) throw nb::python_error();
      return;
    }
    const long value = PyLong_AsLong(now);
    if (value == -1 && PyErr_Occurred()) throw nb::python_error();
    nb::object more = nb::steal(PyLong_FromLong(value + 1));
    if (!more.is_valid() || PyDict_SetItem(counters, key, more.ptr()) != 0) {
      throw nb::python_error();
    }
  }
};

// Used with the GIL held only; never destroyed (it holds references).
Dispatch& dispatch();

// The one-call entries (the engine's methods) and the public calls' dispatch
// (module functions).
nb::object engine_allreduce_array(kd::ShmEngine& engine, nb::handle x, int op_index,
                                  nb::handle label);
nb::object engine_broadcast_array(kd::ShmEngine& engine, nb::handle x, nb::handle root,
                                  nb::handle label);
nb::object engine_allgather_array(kd::ShmEngine& engine, nb::handle x, nb::handle label);
void dispatch_setup(nb::dict counters, nb::tuple ops);
void set_dispatch_engine(nb::handle engine);
void set_dispatch_recording(bool recording);
nb::object dispatch_allreduce(nb::handle x, nb::handle op, nb::handle label);
nb::object dispatch_broadcast(nb::handle x, nb::handle root, nb::handle label);
nb::object dispatch_allgather(nb::handle x, nb::handle label);

}  // namespace kdpy
