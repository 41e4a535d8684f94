// The Python face of the native extension: keras_dist._native.
// This file holds the module definition: every function, class and table of
// the module, registered here from the parts that implement them:
// engine_py.cc (the kernels' and the engine's methods on buffers),
// one_call.cc (the one-call collectives on numpy arrays and the public calls'
// dispatch), aligned_views.cc (fusion's aligned views) and plans.cc (the
// traced steps' plans for TensorFlow's ops and XLA's handler).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <string>
#include <vector>

// This file imports numpy's C API for every file of the module (py_common.h).
#define KD_NUMPY_IMPORT_ARRAY
#include "one_call.h"
#include "plans.h"
#include "py_common.h"
#include "reduce.h"
#include "shm_engine.h"
#include "wait_timings.h"

using namespace kdpy;

// The XLA FFI handler (xla_handler.cc), which hands a jitted JAX step's
// buffers to keras_dist_tf_allreduce_entry.
extern "C" void* keras_dist_xla_allreduce(void* call_frame);

NB_MODULE(_native, m) {
  m.doc() = "keras_dist native kernels and the shared-memory engine.";
  if (_import_array() < 0) throw nb::python_error();

  m.def("reduce_inplace", &py_reduce_inplace, nb::arg("dst"), nb::arg("src"), nb::arg("dtype"),
        nb::arg("op"),
        "dst[i] = op(dst[i], src[i]) over 1-D uint8 views of `dtype` elements "
        "(float16/bfloat16 accumulate in float32, rounded once).");
  m.def("reduce_many", &py_reduce_many, nb::arg("dst"), nb::arg("srcs"), nb::arg("dtype"),
        nb::arg("op"),
        "dst[i] = op(srcs[0][i], ..., srcs[k-1][i]), combined left to right with one "
        "rounding for half types; dst may be one of the sources.");
  m.def("_reduce_finish", &py_reduce_finish, nb::arg("dst"), nb::arg("copy").none(),
        nb::arg("srcs"), nb::arg("dtype"), nb::arg("op"), nb::arg("average_ranks"),
        "Tests only: reduce_many into `dst`, then averaged over `average_ranks` (0: not) "
        "and copied into `copy` (None: not), in one pass where the kernel can.");
  m.def("simd_level", &kd::simd_level, "Kernel family in use: 'avx2' or 'baseline'.");
  m.def("_force_baseline", &kd::force_baseline, nb::arg("on"),
        "Tests only: use the baseline kernels even on an AVX2 CPU.");

  // The one set of wait timings (wait_timings.h), for Python's waits.
  nb::dict timings;
  timings["spin_seconds"] = kd::kSpinSeconds;
  timings["python_spin_seconds"] = kd::kPythonSpinSeconds;
  timings["yield_seconds"] = kd::kYieldSeconds;
  timings["own_core_yield_seconds"] = kd::kOwnCoreYieldSeconds;
  timings["futex_wait_seconds"] = kd::kFutexWaitSeconds;
  timings["poll_sleep_seconds"] = kd::kPollSleepSeconds;
  timings["liveness_seconds"] = kd::kLivenessSeconds;
  m.attr("WAIT_TIMINGS") = timings;

  // The tables Python shares with this module, for tests to check
  // keras_dist/_vocab.py and keras_dist/tensor/gather_records.py against.
  nb::dict dtype_codes;
  dtype_codes["float16"] = int(kd::DType::kFloat16);
  dtype_codes["bfloat16"] = int(kd::DType::kBFloat16);
  dtype_codes["float32"] = int(kd::DType::kFloat32);
  dtype_codes["float64"] = int(kd::DType::kFloat64);
  dtype_codes["int32"] = int(kd::DType::kInt32);
  dtype_codes["int64"] = int(kd::DType::kInt64);
  dtype_codes["uint8"] = int(kd::DType::kUInt8);
  dtype_codes["int8"] = int(kd::DType::kInt8);
  dtype_codes["int16"] = int(kd::DType::kInt16);
  dtype_codes["uint16"] = int(kd::DType::kUInt16);
  m.attr("DTYPE_CODES") = dtype_codes;
  nb::dict op_codes;
  op_codes["sum"] = int(kd::Op::kSum);
  op_codes["min"] = int(kd::Op::kMin);
  op_codes["max"] = int(kd::Op::kMax);
  op_codes["product"] = int(kd::Op::kProduct);
  m.attr("OP_CODES") = op_codes;
  nb::dict gather_record;
  gather_record["max_dims"] = kGatherMaxDims;
  gather_record["header_words"] = kGatherHeader;
  gather_record["record_words"] = kGatherWords;
  gather_record["inline_bytes"] = kGatherInline;
  gather_record["record_bytes"] = kGatherRecord;
  m.attr("GATHER_RECORD") = gather_record;
  m.def(
      "_gather_record_words",
      [](const std::vector<int64_t>& shape, int type_number, size_t itemsize) {
        if (shape.empty() || shape.size() > size_t(kGatherMaxDims)) {
          throw std::invalid_argument("`shape` must have 1 to " + std::to_string(kGatherMaxDims) +
                                      " dimensions. Received: " + std::to_string(shape.size()));
        }
        GatherIn in{nullptr, int(shape.size()), {}, type_number, itemsize};
        std::copy(shape.begin(), shape.end(), in.dims);
        int64_t words[kGatherWords];
        gather_record_words(in, words);
        return nb::bytes(words, sizeof(words));
      },
      nb::arg("shape"), nb::arg("type_number"), nb::arg("itemsize"),
      "Tests only: the words of the allgather record the one-call paths write for an "
      "array of this shape and numpy type number (GATHER_RECORD's layout).");

  m.def("fill_views", &fill_views, nb::arg("out"), nb::arg("raw"), nb::arg("align"),
        nb::arg("offsets"), nb::arg("templates"),
        "Appends to `out` one array per template (shape and dtype), viewing `raw` from its "
        "first `align`-aligned byte plus that offset; returns that first aligned byte's "
        "index in `raw`.");
  m.def("dispatch_setup", &dispatch_setup, nb::arg("counters"), nb::arg("ops"),
        "Once, at keras_dist.tensor.ops' import: COUNTERS (the entries count the calls "
        "they serve there) and (Average, Sum, Min, Max, Product).");
  m.def("set_dispatch_engine", &set_dispatch_engine, nb::arg("engine").none(),
        "The runtime's handover: the ShmEngine that serves the job's one-call "
        "collectives (its group installed), or None (no group, or one without an engine).");
  m.def("set_dispatch_recording", &set_dispatch_recording, nb::arg("recording"),
        "The timeline's handover: whether it records (then the one-call entries leave "
        "every call to the general path, which records it, and the TensorFlow and XLA "
        "plans call their `record`).");
  m.def("dispatch_served", [] { return dispatch().served; },
        "How many calls the one-call entries (dispatch_*) have served in this process.");
  m.def("dispatch_allreduce", &dispatch_allreduce, nb::arg("x").none(), nb::arg("op").none(),
        nb::arg("name").none(),
        "kd.allreduce(x, op, name) of a small numpy array through the job's shm engine, "
        "or None where the caller takes its general path.");
  m.def("dispatch_broadcast", &dispatch_broadcast, nb::arg("x").none(), nb::arg("root").none(),
        nb::arg("name").none(), "kd.broadcast's counterpart of dispatch_allreduce.");
  m.def("dispatch_allgather", &dispatch_allgather, nb::arg("x").none(), nb::arg("name").none(),
        "kd.allgather's counterpart of dispatch_allreduce (bytes: the ranks' headers "
        "when they disagree).");

  // The engine's errors share one base, so a caller catches them in one
  // clause and translates them (keras_dist/transports/engine_errors.py).
  nb::object engine_error = nb::steal(
      PyErr_NewException("keras_dist._native.EngineError", PyExc_Exception, nullptr));
  if (!engine_error.is_valid()) throw nb::python_error();
  m.attr("EngineError") = engine_error;
  nb::exception<kd::MismatchError> mismatch(m, "CollectiveMismatchError", engine_error);
  nb::exception<kd::PeerFailureError> peer_failure(m, "PeerFailureError", engine_error);
  nb::exception<kd::TimeoutError> timeout(m, "CollectiveTimeoutError", engine_error);
  nb::exception<kd::TransportError> transport(m, "TransportError", engine_error);
  const nb::handle error_types[4] = {mismatch, peer_failure, timeout, transport};
  for (int i = 0; i < 4; ++i) g_error_types[i] = error_types[i].inc_ref().ptr();


  bind_plans(m);
  m.def("tf_allgather_entry_address",
        [] { return int64_t(reinterpret_cast<intptr_t>(&keras_dist_tf_allgather_entry)); },
        "The address of the KerasDistAllgather op's entry function.");
  m.def("xla_allreduce_address",
        [] { return int64_t(reinterpret_cast<intptr_t>(&keras_dist_xla_allreduce)); },
        "The address of the XLA FFI handler of a jitted JAX step's allreduce "
        "(xla_handler.cc).");
  m.def("tf_entry_address",
        [] { return int64_t(reinterpret_cast<intptr_t>(&keras_dist_tf_allreduce_entry)); },
        "The address of the KerasDistAllreduce op's entry function.");

  nb::class_<kd::ShmEngine>(m, "ShmEngine",
                            "Collectives among the ranks of one machine through one POSIX "
                            "shared-memory segment. Local rank 0 creates it (create=True) "
                            "before the others open it; then every rank calls attach().")
      .def(nb::new_(&make_engine), nb::arg("name"), nb::arg("create"), nb::arg("local_rank"),
           nb::arg("local_size"), nb::arg("slot_bytes"), nb::arg("peer_pids"),
           nb::arg("stall_seconds") = 60.0, nb::arg("timeout_seconds") = 0.0,
           nb::arg("global_ranks") = std::vector<int64_t>(), nb::arg("on_stall") = nb::none(),
           nb::arg("single_copy") = true, nb::arg("single_copy_bytes") = size_t(1) << 20)
      .def("attach", &kd::ShmEngine::attach, nb::call_guard<nb::gil_scoped_release>(),
           "Collective: waits for every local rank, then local rank 0 unlinks the name.")
      .def("unlink", &kd::ShmEngine::unlink, "Removes the segment's name (local rank 0).")
      .def("leave", &kd::ShmEngine::leave,
           "Marks this rank as gone from the group: a peer waiting for it, or starting a "
           "collective after it, raises PeerFailureError naming it. Idempotent.")
      .def("check_allreduce", &engine_check_allreduce, nb::arg("nbytes"), nb::arg("dtype"),
           nb::arg("op"), nb::arg("name") = nb::none(),
           "Header-only step: raises CollectiveMismatchError on every local rank if they "
           "disagree on this allreduce; moves no data.")
      .def("check_broadcast", &engine_check_broadcast, nb::arg("nbytes"), nb::arg("root"),
           nb::arg("name") = nb::none(), "Header-only step for a broadcast (see check_allreduce).")
      .def("check_allgatherv", &engine_check_allgatherv, nb::arg("counts_bytes"),
           nb::arg("name") = nb::none(), "Header-only step for an allgatherv (see check_allreduce).")
      .def("check_barrier", &kd::ShmEngine::check_barrier,
           nb::call_guard<nb::gil_scoped_release>(),
           "Header-only step for a barrier (see check_allreduce).")
      .def("raise_mismatch", &kd::ShmEngine::raise_mismatch, nb::arg("message"),
           nb::call_guard<nb::gil_scoped_release>(),
           "Takes the place of this rank's next collective: every local rank raises "
           "CollectiveMismatchError with the first non-empty message given; the engine "
           "stays usable.")
      .def("allreduce", &engine_allreduce, nb::arg("buf"), nb::arg("dtype"), nb::arg("op"),
           nb::arg("name") = nb::none(), nb::arg("send") = nb::none(),
           "Reduces `buf` in place across local ranks, or `send` into `buf` when given.")
      .def("allreduce_parts", &engine_allreduce_parts, nb::arg("srcs"), nb::arg("dsts"),
           nb::arg("dtype"), nb::arg("op"), nb::arg("average") = false,
           nb::arg("name") = nb::none(),
           "Allreduce of a message made of the 1-D arrays `srcs` end to end into `dsts` "
           "(same sizes; a destination may be its source), without a fused buffer; "
           "`average` divides as an Average does; a message larger than buffer_bytes "
           "goes in windows.")
      .def("allreduce_array", &engine_allreduce_array, nb::arg("x"), nb::arg("op"),
           nb::arg("name") = nb::none(),
           "kd.allreduce of a small C-contiguous numpy array in one call: a new array, or "
           "None where the caller must take its general path. `op`: 0 Average, 1 Sum, "
           "2 Min, 3 Max, 4 Product.")
      .def("broadcast_array", &engine_broadcast_array, nb::arg("x"), nb::arg("root"),
           nb::arg("name") = nb::none(),
           "kd.broadcast of a small C-contiguous numpy array in one call: a new array "
           "holding the root's values, or None where the caller must take its general path.")
      .def("allgather_array", &engine_allgather_array, nb::arg("x"),
           nb::arg("name") = nb::none(),
           "kd.allgather of a small C-contiguous numpy array in one call: a new array, None "
           "where the caller must take its general path, or, when the ranks disagree on the "
           "dtype or the shape past the first dimension, every rank's header as bytes.")
      .def("broadcast", &engine_broadcast, nb::arg("buf"), nb::arg("root"),
           nb::arg("name") = nb::none())
      .def("allgatherv", &engine_allgatherv, nb::arg("send"), nb::arg("recv"),
           nb::arg("counts_bytes"), nb::arg("name") = nb::none(), nb::arg("prefixed") = false)
      .def("barrier", &kd::ShmEngine::barrier, nb::call_guard<nb::gil_scoped_release>())
      .def("scratch", &engine_scratch, nb::arg("nbytes"),
           "A view of this rank's next shared buffer (None if nbytes is too large); "
           "allreduce of it skips the copy in. Valid until the next collective.")
      .def_prop_ro("buffer_bytes", &kd::ShmEngine::buffer_bytes)
      .def_prop_ro("single_copy", &kd::ShmEngine::single_copy,
                   "Whether large allreduces and allgathers read peers' buffers directly "
                   "(process_vm_readv).")
      .def_prop_ro("single_copy_status", &kd::ShmEngine::single_copy_status,
                   "'on', or 'off: <why>'.")
      .def_prop_ro("local_rank", &kd::ShmEngine::local_rank)
      .def_prop_ro("local_size", &kd::ShmEngine::local_size)
      .def_prop_ro("name", &kd::ShmEngine::name)
      .def_prop_ro("wait_seconds", &kd::ShmEngine::wait_seconds,
                   "Seconds spent waiting for peers in collectives so far.")
      .def_prop_rw("yield_seconds", &kd::ShmEngine::yield_seconds,
                   &kd::ShmEngine::set_yield_seconds,
                   "How long a wait polls, yielding the core, before it sleeps: longer when "
                   "every local rank has a CPU of its own. Settable (benchmarks), 0 to 1 s.");
}
