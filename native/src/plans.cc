// ---- The traced steps' plans (TensorFlow's ops, XLA's handler) -------------
// A traced TensorFlow step's grouped allreduce runs as KerasDistAllreduce
// (tf_kernel.cc), a jitted JAX step's as the XLA FFI handler (xla_handler.cc);
// both hand their buffers to keras_dist_tf_allreduce_entry below with the
// number of a ReductionPlan made when the step was traced
// (keras_dist/tensor/native_plan.py): the buckets
// keras_dist/tensor/allreduce_plans.py `allreduce_plan` made, each reduced by
// ShmEngine::allreduce_parts straight from TensorFlow's inputs into its
// outputs, with no Python. A bucket the engine raises on (ranks that have
// joined, a mismatch, a failed peer) goes to the plan's Python `fallback`
// for that bucket, which does what the Python path does with that error.
// The call is counted in COUNTERS, and recorded by the plan's `record` when
// a timeline records, as the Python path does.
// bindings.cc registers the plans' classes through bind_plans.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "one_call.h"
#include "plans.h"
#include "py_common.h"
#include "reduce.h"
#include "shm_engine.h"

namespace kdpy {

PyObject* g_error_types[4] = {};

namespace {

// What the plans share: a number the op's attribute names
// (a registry from it to the plan), the engine, the Python `fallback` and
// `record`, and the conversion of the engine's errors to Python's.
class PlanBase {
 public:
  PlanBase(nb::handle engine, nb::callable fallback, nb::callable record)
      : engine_obj_(nb::borrow(engine)),
        engine_(engine_of(engine)),
        fallback_(std::move(fallback)),
        record_(std::move(record)) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    id_ = ++next_id();
    registry()[id_] = this;
  }
  virtual ~PlanBase() {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().erase(id_);
  }
  PlanBase(const PlanBase&) = delete;
  PlanBase& operator=(const PlanBase&) = delete;

  int64_t id() const { return id_; }

  // The plan numbered `id` if it is a `Plan`, or null (its Python object is gone).
  template <class Plan>
  static Plan* find(int64_t id) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(id);
    return it == registry().end() ? nullptr : dynamic_cast<Plan*>(it->second);
  }

 protected:
  static constexpr int kUnknown = 2, kInvalidArgument = 3;

  static kd::ShmEngine* engine_of(nb::handle engine) {
    if (!nb::isinstance<kd::ShmEngine>(engine)) {
      throw nb::type_error(("a plan's `engine` must be a ShmEngine. Received: an object "
                            "of type " +
                            std::string(nb::type_name(engine.type()).c_str()))
                               .c_str());
    }
    return nb::inst_ptr<kd::ShmEngine>(engine);
  }

  static int64_t realtime_ns() {
    timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
  }

  // The engine's error as the Python exception the Python path would see.
  static nb::object python_error_of(std::exception_ptr failure) {
    auto make = [](PyObject* type, const char* text) {
      PyObject* made = PyObject_CallFunction(type, "s", text);
      if (!made) throw nb::python_error();
      return nb::steal(made);
    };
    try {
      std::rethrow_exception(failure);
    } catch (nb::python_error& e) {
      return nb::borrow(e.value());
    } catch (const kd::MismatchError& e) {
      return make(g_error_types[0], e.what());
    } catch (const kd::PeerFailureError& e) {
      return make(g_error_types[1], e.what());
    } catch (const kd::TimeoutError& e) {
      return make(g_error_types[2], e.what());
    } catch (const kd::TransportError& e) {
      return make(g_error_types[3], e.what());
    } catch (const std::invalid_argument& e) {
      return make(PyExc_ValueError, e.what());
    } catch (const std::exception& e) {
      return make(PyExc_RuntimeError, e.what());
    }
  }

  // After the op's collectives (with the GIL): `calls` more in COUNTERS[key],
  // and record() where a timeline records. 0, or kUnknown with `message`.
  template <class Record>
  int finish(PyObject* key, size_t calls, Record&& record, std::string& message) {
    try {
      Dispatch& d = dispatch();
      for (size_t i = 0; i < calls; ++i) d.count(key);
      if (d.recording) record();
    } catch (const std::exception& e) {
      message = std::string("keras_dist: after the collective: ") + e.what();
      return kUnknown;
    }
    return 0;
  }

  // fallback(...)'s answer: None (0), or (code, message) for the op's status.
  static int status_of(nb::object result, std::string& message) {
    if (result.is_none()) return 0;
    auto [code, text] = nb::cast<std::pair<int, std::string>>(result);
    message = text;
    return code == 0 ? kUnknown : code;
  }

  nb::object engine_obj_;  // keeps the engine alive
  kd::ShmEngine* engine_;
  nb::callable fallback_;
  nb::callable record_;

 private:
  static std::mutex& registry_mutex() {
    static std::mutex* m = new std::mutex();
    return *m;
  }
  static std::unordered_map<int64_t, PlanBase*>& registry() {
    static auto* r = new std::unordered_map<int64_t, PlanBase*>();
    return *r;
  }
  static int64_t& next_id() {
    static int64_t id = 0;
    return id;
  }

  int64_t id_ = 0;
};

class ReductionPlan : public PlanBase {
 public:
  struct Bucket {
    std::vector<size_t> members;
    kd::DType dtype;
    std::string name;
  };

  ReductionPlan(nb::handle engine, nb::list buckets, int op_code, bool average,
         std::vector<uint64_t> nbytes, nb::callable fallback, nb::callable record,
         double prescale, double postscale)
      : PlanBase(engine, std::move(fallback), std::move(record)),
        op_(check_op(op_code)),
        average_(average),
        prescale_(prescale),
        postscale_(postscale),
        nbytes_(std::move(nbytes)) {
    for (nb::handle item : buckets) {
      auto [members, dtype_code, name] =
          nb::cast<std::tuple<std::vector<size_t>, int, std::string>>(item);
      for (size_t i : members) {
        if (i >= nbytes_.size()) {
          throw nb::value_error(("ReductionPlan: bucket member " + std::to_string(i) +
                                 " is past the plan's " + std::to_string(nbytes_.size()) +
                                 " tensors")
                                    .c_str());
        }
      }
      const kd::DType dtype = check_dtype(dtype_code);
      if ((prescale_ != 1.0 || postscale_ != 1.0) && !is_float(dtype)) {
        throw nb::value_error(("ReductionPlan: scaling needs floating-point tensors. Received: "
                               "bucket \"" + name + "\" of dtype code " +
                               std::to_string(dtype_code) + " with prescale " +
                               std::to_string(prescale_) + ", postscale " +
                               std::to_string(postscale_))
                                  .c_str());
      }
      buckets_.push_back({std::move(members), dtype, std::move(name)});
    }
  }

  // See tf_allreduce_entry. Called without the GIL.
  int run(int count, const void* const* srcs, void* const* dsts, const size_t* nbytes,
          std::string& message) {
    if (size_t(count) != nbytes_.size()) {
      message = "KerasDistAllreduce: the op has " + std::to_string(count) +
                " tensors, its plan " + std::to_string(nbytes_.size());
      return kInvalidArgument;
    }
    for (size_t i = 0; i < nbytes_.size(); ++i) {
      if (nbytes[i] != nbytes_[i]) {
        message = "KerasDistAllreduce: tensor " + std::to_string(i) + " has " +
                  std::to_string(nbytes[i]) + " bytes, the shape it was traced with " +
                  std::to_string(nbytes_[i]);
        return kInvalidArgument;
      }
    }
    const int64_t start = realtime_ns();
    const double waited = engine_->wait_seconds();
    thread_local std::vector<kd::ShmEngine::Part> parts;
    // What each rank sends: its input, or, scaled first, its output.
    thread_local std::vector<const void*> sent;
    sent.assign(srcs, srcs + count);
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Bucket& bucket = buckets_[b];
      const size_t itemsize = kd::dtype_size(int(bucket.dtype));
      parts.clear();
      for (size_t i : bucket.members) {
        if (prescale_ != 1.0) {  // scaled into the output, reduced there in place
          kd::scale(dsts[i], srcs[i], nbytes[i] / itemsize, bucket.dtype, prescale_);
          sent[i] = dsts[i];
        }
        parts.push_back({sent[i], dsts[i], nbytes[i]});
      }
      try {
        engine_->allreduce_parts(parts, bucket.dtype, op_, average_, bucket.name);
      } catch (...) {
        const int code = fall_back(b, std::current_exception(), sent.data(), dsts, message);
        if (code != 0) return code;
      }
      if (postscale_ != 1.0) {
        for (size_t i : bucket.members) {
          kd::scale(dsts[i], dsts[i], nbytes[i] / itemsize, bucket.dtype, postscale_);
        }
      }
    }
    const int64_t end = realtime_ns();
    const int64_t wait_ns = int64_t((engine_->wait_seconds() - waited) * 1e9);
    nb::gil_scoped_acquire acquire;
    return finish(dispatch().key_allreduce, buckets_.size(),
                  [&] { record_(start, end, wait_ns); }, message);
  }

 private:
  // Bucket `b` by the Python fallback: fallback(b, srcs, dsts, error), the
  // buffers as 1-D uint8 arrays, error the engine's error as Python's; it
  // returns None, or (code, message) for the op's status.
  int fall_back(size_t b, std::exception_ptr failure, const void* const* srcs_in,
                void* const* dsts_in, std::string& message) {
    nb::gil_scoped_acquire acquire;
    try {
      nb::object error = python_error_of(failure);
      failure = nullptr;  // a held python_error is released with the GIL
      nb::list srcs, dsts;
      for (size_t i : buckets_[b].members) {
        srcs.append(bytes_array(srcs_in[i], nbytes_[i]));
        dsts.append(bytes_array(dsts_in[i], nbytes_[i]));
      }
      return status_of(fallback_(b, srcs, dsts, error), message);
    } catch (const std::exception& e) {
      message = std::string("keras_dist: the allreduce's fallback failed: ") + e.what();
      return kUnknown;
    }
  }

  static nb::object bytes_array(const void* data, size_t nbytes) {
    npy_intp dims[1] = {npy_intp(nbytes)};
    PyObject* a = PyArray_SimpleNewFromData(1, dims, NPY_UINT8, const_cast<void*>(data));
    if (!a) throw nb::python_error();
    return nb::steal(a);
  }

  static bool is_float(kd::DType dtype) {
    return dtype == kd::DType::kFloat16 || dtype == kd::DType::kBFloat16 ||
           dtype == kd::DType::kFloat32 || dtype == kd::DType::kFloat64;
  }

  kd::Op op_;
  bool average_;
  double prescale_;   // each rank's input times this before the reduction
  double postscale_;  // the result times this after it (and after any average)
  std::vector<uint64_t> nbytes_;
  std::vector<Bucket> buckets_;
};

// A traced TensorFlow step's allgathers as one KerasDistAllgather op: tensor
// i gathered as kd.allgather gathers it (gather_core, named names[i]), one
// after another, each counted as one allgather and recorded by
// record(i, nbytes, start_ns, end_ns, wait_ns) (nbytes: the result's). Where the ranks disagree, or the
// engine raises, fallback(i, headers, error) (headers: bytes as
// dispatch_allgather returns them, or None; error: the engine's error as
// Python's, or None) returns (code, message): the op fails with that status.
class TfGatherPlan : public PlanBase {
 public:
  TfGatherPlan(nb::handle engine, std::vector<std::string> names, std::vector<int> type_numbers,
               std::vector<size_t> itemsizes, nb::callable fallback, nb::callable record)
      : PlanBase(engine, std::move(fallback), std::move(record)),
        names_(std::move(names)),
        type_numbers_(std::move(type_numbers)),
        itemsizes_(std::move(itemsizes)) {
    if (type_numbers_.size() != names_.size() || itemsizes_.size() != names_.size()) {
      throw nb::value_error("TfGatherPlan: one name, type number and item size per tensor");
    }
    for (const std::string& name : names_) shapes_names_.push_back(name + " shapes");
  }

  // See tf_allgather_entry. Called without the GIL.
  template <class Out>
  int run(int count, const void* const* srcs, const int* ndims, const int64_t* dims, Out&& out,
          std::string& message) {
    if (size_t(count) != names_.size()) {
      message = "KerasDistAllgather: the op has " + std::to_string(count) +
                " tensors, its plan " + std::to_string(names_.size());
      return kInvalidArgument;
    }
    thread_local std::vector<int64_t> headers;
    for (int i = 0; i < count; ++i) {
      GatherIn in{srcs[i], ndims[i] == 0 ? 1 : ndims[i], {}, type_numbers_[size_t(i)],
                  itemsizes_[size_t(i)]};
      if (ndims[i] > kGatherMaxDims) {
        message = "KerasDistAllgather: `allgather` takes at most " +
                  std::to_string(kGatherMaxDims) + " dimensions. Received: " +
                  std::to_string(ndims[i]);
        return kInvalidArgument;
      }
      if (ndims[i] == 0) in.dims[0] = 1;
      std::copy(dims + size_t(i) * kGatherMaxDims, dims + size_t(i) * kGatherMaxDims + ndims[i],
                in.dims);
      const int64_t start = realtime_ns();
      const double waited = engine_->wait_seconds();
      bool agreed = false;
      std::exception_ptr failure;
      int64_t gathered = 0;  // the result's bytes
      try {
        agreed = gather_core<NoRelease>(
            *engine_, in, names_[size_t(i)], shapes_names_[size_t(i)],
            [&](int64_t rows) {
              gathered = rows * int64_t(in.itemsize);
              for (int d = 1; d < in.ndim; ++d) gathered *= in.dims[d];
              return out(i, rows);
            },
            headers);
      } catch (...) {
        failure = std::current_exception();
      }
      const int64_t end = realtime_ns();
      const int64_t wait_ns = int64_t((engine_->wait_seconds() - waited) * 1e9);
      nb::gil_scoped_acquire acquire;
      if (!agreed) {
        try {
          nb::object error = failure ? python_error_of(failure) : nb::none();
          failure = nullptr;  // a held python_error is released with the GIL
          nb::object described = nb::none();
          if (error.is_none()) described = nb::bytes(headers.data(), headers.size() * sizeof(int64_t));
          const int code = status_of(fallback_(i, described, error), message);
          if (code == 0) message = "keras_dist: the allgather's fallback gave no status";
          return code == 0 ? kUnknown : code;
        } catch (const std::exception& e) {
          message = std::string("keras_dist: the allgather's fallback failed: ") + e.what();
          return kUnknown;
        }
      }
      const int code =
          finish(dispatch().key_allgather, 1,
                 [&] { record_(i, gathered, start, end, wait_ns); }, message);
      if (code != 0) return code;
    }
    return 0;
  }

 private:
  std::vector<std::string> names_, shapes_names_;
  std::vector<int> type_numbers_;
  std::vector<size_t> itemsizes_;
};

}  // namespace

void bind_plans(nb::module_& m) {
  nb::class_<ReductionPlan>(m, "ReductionPlan",
                     "A traced step's grouped allreduce, for TensorFlow's KerasDistAllreduce "
                     "op and the XLA FFI handler of a jitted JAX step: its buckets [(member "
                     "indices, dtype code, name)], the engine, the op and the tensors' sizes; fallback(bucket, srcs, dsts, error) serves "
                     "what the engine cannot, record(start_ns, end_ns, wait_ns) a timeline. "
                     "Floating-point buckets may be scaled: each rank's input by prescale "
                     "before the reduction, the result by postscale after it.")
      .def(nb::init<nb::handle, nb::list, int, bool, std::vector<uint64_t>, nb::callable,
                    nb::callable, double, double>(),
           nb::arg("engine"), nb::arg("buckets"), nb::arg("op"), nb::arg("average"),
           nb::arg("nbytes"), nb::arg("fallback"), nb::arg("record"),
           nb::arg("prescale") = 1.0, nb::arg("postscale") = 1.0)
      .def_prop_ro("id", [](const ReductionPlan& plan) { return plan.id(); });
  m.attr("TfPlan") = m.attr("ReductionPlan");  // its earlier name
  nb::class_<TfGatherPlan>(m, "TfGatherPlan",
                           "A traced TensorFlow step's allgathers, for the KerasDistAllgather "
                           "op: per tensor its name, numpy type number and item size; "
                           "fallback(index, headers, error) gives the op's status where the "
                           "ranks disagree or the engine raises, record(index, nbytes, "
                           "start_ns, end_ns, wait_ns) a timeline.")
      .def(nb::init<nb::handle, std::vector<std::string>, std::vector<int>, std::vector<size_t>,
                    nb::callable, nb::callable>(),
           nb::arg("engine"), nb::arg("names"), nb::arg("type_numbers"), nb::arg("itemsizes"),
           nb::arg("fallback"), nb::arg("record"))
      .def_prop_ro("id", [](const TfGatherPlan& plan) { return plan.id(); });
}

}  // namespace kdpy

using kdpy::PlanBase;
using kdpy::ReductionPlan;
using kdpy::TfGatherPlan;

// KerasDistAllreduce's entry (its `entry` attribute is this address), and
// the XLA FFI handler's (xla_handler.cc): the
// plan numbered `plan` on `count` tensors, `srcs[i]` into `dsts[i]` (may be
// the same buffer), `nbytes[i]` each. Returns 0, or a TF_Code with `message`
// filled (NUL-terminated, at most `message_bytes`).
extern "C" int keras_dist_tf_allreduce_entry(int64_t plan, int count, const void* const* srcs,
                                             void* const* dsts, const size_t* nbytes,
                                             char* message, size_t message_bytes) {
  std::string text;
  int code = 0;
  ReductionPlan* found = PlanBase::find<ReductionPlan>(plan);
  if (!found) {
    text = "keras_dist: this traced step's allreduce plan is gone (the step was traced "
           "before keras_dist was shut down or initialised again): trace the step again";
    code = 9;  // FAILED_PRECONDITION
  } else {
    code = found->run(count, srcs, dsts, nbytes, text);
  }
  if (code != 0 && message_bytes > 0) {
    const size_t n = std::min(text.size(), message_bytes - 1);
    std::memcpy(message, text.data(), n);
    message[n] = '\0';
  }
  return code;
}

// KerasDistAllgather's entry (tf_kernel.cc): the plan numbered `plan` on
// `count` tensors, `srcs[i]` of `ndims[i]` dimensions (`dims`, kGatherMaxDims
// per tensor). `out(out_context, i, rows)` returns where tensor i's result
// (rows, *its dims[1:]) goes, or null where it could not be made. Returns 0,
// or a TF_Code with `message` filled (NUL-terminated, at most `message_bytes`).
extern "C" int keras_dist_tf_allgather_entry(int64_t plan, int count, const void* const* srcs,
                                             const int* ndims, const int64_t* dims,
                                             void* (*out)(void*, int, int64_t),
                                             void* out_context, char* message,
                                             size_t message_bytes) {
  std::string text;
  int code = 0;
  TfGatherPlan* found = PlanBase::find<TfGatherPlan>(plan);
  if (!found) {
    text = "keras_dist: this traced step's allgather plan is gone (the step was traced "
           "before keras_dist was shut down or initialised again): trace the step again";
    code = 9;  // FAILED_PRECONDITION
  } else {
    code = found->run(count, srcs, ndims, dims,
                      [&](int i, int64_t rows) {
                        void* at = out(out_context, i, rows);
                        if (!at) throw std::runtime_error("the output could not be made");
                        return at;
                      },
                      text);
  }
  if (code != 0 && message_bytes > 0) {
    const size_t n = std::min(text.size(), message_bytes - 1);
    std::memcpy(message, text.data(), n);
    message[n] = '\0';
  }
  return code;
}
