// The Python face of the native extension: keras_dist._native.
// Buffers arrive through the buffer protocol as 1-D C-contiguous uint8 arrays
// (callers pass arr.view(np.uint8)); dtype and op are the codes of
// keras_dist/_vocab.py. Every wait happens with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "reduce.h"
#include "shm_engine.h"
#include "wait_timings.h"

namespace nb = nanobind;

namespace {

// A view on a Python object's memory, released on scope exit.
class ByteBuffer {
 public:
  // `element_size`, when given, also admits a buffer of any format with that
  // item size (a float32 array for dtype float32), saving the caller a view.
  ByteBuffer(nb::handle obj, bool writable, const char* what, size_t element_size = 0) {
    const int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
      PyErr_Clear();
      const std::string type = nb::type_name(obj.type()).c_str();
      throw nb::type_error((std::string("`") + what + "` must be a " +
                            (writable ? "writable " : "") +
                            "1-D C-contiguous uint8 numpy array. Received: an object of type " +
                            type + (writable ? " (not a writable buffer)" : ""))
                               .c_str());
    }
    held_ = true;
    const char* fmt = view_.format ? view_.format : "B";
    const bool same_size = element_size > 0 && size_t(view_.itemsize) == element_size;
    const bool is_bytes = view_.itemsize == 1 &&
                          (std::strcmp(fmt, "B") == 0 || std::strcmp(fmt, "=B") == 0 ||
                           std::strcmp(fmt, "<B") == 0 || std::strcmp(fmt, "|B") == 0);
    if (!is_bytes && !same_size) {
      throw nb::type_error((std::string("`") + what +
                            "` must have dtype uint8 (pass arr.view(np.uint8)). Received: format '" +
                            fmt + "' with itemsize " + std::to_string(view_.itemsize))
                               .c_str());
    }
    if (view_.ndim != 1) {
      throw nb::value_error((std::string("`") + what + "` must be 1-D. Received: ndim=" +
                             std::to_string(view_.ndim))
                                .c_str());
    }
    if (view_.strides && view_.strides[0] != view_.itemsize && view_.shape[0] > 1) {
      throw nb::value_error((std::string("`") + what +
                             "` must be C-contiguous. Received: stride " +
                             std::to_string(view_.strides[0]) + " bytes")
                                .c_str());
    }
  }
  ~ByteBuffer() {
    if (held_) PyBuffer_Release(&view_);
  }
  ByteBuffer(const ByteBuffer&) = delete;
  ByteBuffer& operator=(const ByteBuffer&) = delete;

  uint8_t* data() const { return static_cast<uint8_t*>(view_.buf); }
  size_t size() const { return size_t(view_.len); }  // bytes

 private:
  Py_buffer view_{};
  bool held_ = false;
};

kd::DType check_dtype(int dtype) {
  if (!kd::valid_dtype(dtype)) {
    throw nb::value_error(("`dtype` must be a keras_dist dtype code in [0, " +
                           std::to_string(kd::kNumDTypes) + "). Received: dtype=" +
                           std::to_string(dtype))
                              .c_str());
  }
  return kd::DType(dtype);
}

kd::Op check_op(int op) {
  if (!kd::valid_op(op)) {
    throw nb::value_error(("`op` must be a keras_dist op code in [0, " +
                           std::to_string(kd::kNumOps) + ") (SUM, MIN, MAX, PRODUCT). Received: op=" +
                           std::to_string(op))
                              .c_str());
  }
  return kd::Op(op);
}

size_t element_count(size_t nbytes, int dtype, const char* what) {
  const size_t esize = kd::dtype_size(dtype);
  if (nbytes % esize != 0) {
    throw nb::value_error((std::string("`") + what + "` must hold whole " +
                           kd::dtype_name(dtype) + " elements (" + std::to_string(esize) +
                           " bytes each). Received: " + std::to_string(nbytes) + " bytes")
                              .c_str());
  }
  return nbytes / esize;
}

void py_reduce_many(nb::handle dst_obj, nb::list src_objs, int dtype_code, int op_code) {
  const kd::DType dtype = check_dtype(dtype_code);
  const kd::Op op = check_op(op_code);
  ByteBuffer dst(dst_obj, true, "dst");
  std::vector<std::unique_ptr<ByteBuffer>> held;
  std::vector<const void*> srcs;
  held.reserve(src_objs.size());
  for (size_t i = 0; i < src_objs.size(); ++i) {
    const std::string what = "srcs[" + std::to_string(i) + "]";
    held.emplace_back(new ByteBuffer(src_objs[i], false, what.c_str()));
    if (held.back()->size() != dst.size()) {
      throw nb::value_error((what + " must have as many bytes as `dst`. Received: " +
                             std::to_string(held.back()->size()) + " bytes, dst has " +
                             std::to_string(dst.size()))
                                .c_str());
    }
    srcs.push_back(held.back()->data());
  }
  const size_t count = element_count(dst.size(), dtype_code, "dst");
  nb::gil_scoped_release release;
  kd::reduce_many(dst.data(), srcs.data(), srcs.size(), count, dtype, op);
}

void py_reduce_inplace(nb::handle dst_obj, nb::handle src_obj, int dtype_code, int op_code) {
  const kd::DType dtype = check_dtype(dtype_code);
  const kd::Op op = check_op(op_code);
  ByteBuffer dst(dst_obj, true, "dst");
  ByteBuffer src(src_obj, false, "src");
  if (src.size() != dst.size()) {
    throw nb::value_error(("`src` must have as many bytes as `dst`. Received: src has " +
                           std::to_string(src.size()) + " bytes, dst has " +
                           std::to_string(dst.size()))
                              .c_str());
  }
  const size_t count = element_count(dst.size(), dtype_code, "dst");
  nb::gil_scoped_release release;
  kd::reduce_inplace(dst.data(), src.data(), count, dtype, op);
}

std::unique_ptr<kd::ShmEngine> make_engine(const std::string& name, bool create, int local_rank,
                                           int local_size, size_t slot_bytes,
                                           std::vector<int64_t> peer_pids, double stall_seconds,
                                           double timeout_seconds,
                                           std::vector<int64_t> global_ranks,
                                           nb::object on_stall, bool single_copy,
                                           size_t single_copy_bytes) {
  kd::EngineOptions options;
  options.name = name;
  options.create = create;
  options.local_rank = local_rank;
  options.local_size = local_size;
  options.slot_bytes = slot_bytes;
  options.pids = std::move(peer_pids);
  options.ranks = std::move(global_ranks);
  options.stall_seconds = stall_seconds;
  options.timeout_seconds = timeout_seconds;
  options.single_copy = single_copy;
  options.single_copy_bytes = single_copy_bytes;
  // Both hooks run inside a wait that released the GIL; a Python exception
  // (KeyboardInterrupt, a warning turned into an error) propagates out.
  kd::EngineHooks hooks;
  if (!on_stall.is_none()) {
    auto shared = std::make_shared<nb::object>(on_stall);
    hooks.on_stall = [shared](const std::string& message) {
      nb::gil_scoped_acquire acquire;
      (*shared)(message);
    };
  }
  hooks.check_interrupt = [] {
    nb::gil_scoped_acquire acquire;
    if (PyErr_CheckSignals() != 0) throw nb::python_error();
  };
  return std::make_unique<kd::ShmEngine>(options, std::move(hooks));
}

// The UTF-8 text of an optional collective name (None: no name).
std::string_view name_text(nb::handle name) {
  if (name.is_none()) return {};
  Py_ssize_t size = 0;
  const char* text = PyUnicode_AsUTF8AndSize(name.ptr(), &size);
  if (!text) {
    PyErr_Clear();
    throw nb::type_error(("`name` must be a str or None. Received: an object of type " +
                          std::string(nb::type_name(name.type()).c_str()))
                             .c_str());
  }
  return std::string_view(text, size_t(size));
}

void engine_allreduce(kd::ShmEngine& engine, nb::handle buf_obj, int dtype_code, int op_code,
                      nb::handle name, nb::handle send_obj) {
  const kd::DType dtype = check_dtype(dtype_code);
  const kd::Op op = check_op(op_code);
  ByteBuffer buf(buf_obj, true, "buf", kd::dtype_size(dtype_code));
  element_count(buf.size(), dtype_code, "buf");
  std::unique_ptr<ByteBuffer> send;
  if (!send_obj.is_none()) {
    send.reset(new ByteBuffer(send_obj, false, "send", kd::dtype_size(dtype_code)));
    if (send->size() != buf.size()) {
      throw nb::value_error(("allreduce: `send` must have as many bytes as `buf`. Received: " +
                             std::to_string(send->size()) + " bytes, buf has " +
                             std::to_string(buf.size()))
                                .c_str());
    }
  }
  const std::string_view text = name_text(name);
  nb::gil_scoped_release release;
  engine.allreduce(buf.data(), buf.size(), dtype, op, text, send ? send->data() : nullptr);
}

void engine_broadcast(kd::ShmEngine& engine, nb::handle buf_obj, int root, nb::handle name) {
  ByteBuffer buf(buf_obj, true, "buf");
  const std::string_view text = name_text(name);
  nb::gil_scoped_release release;
  engine.broadcast(buf.data(), buf.size(), root, text);
}

void engine_allgatherv(kd::ShmEngine& engine, nb::handle send_obj, nb::handle recv_obj,
                       std::vector<uint64_t> counts_bytes, nb::handle name) {
  ByteBuffer send(send_obj, false, "send");
  ByteBuffer recv(recv_obj, true, "recv");
  uint64_t total = 0;
  for (uint64_t c : counts_bytes) total += c;
  if (total != recv.size()) {
    throw nb::value_error(("allgatherv: `recv` must have sum(counts_bytes) bytes. Received: " +
                           std::to_string(recv.size()) + " bytes, sum(counts_bytes)=" +
                           std::to_string(total))
                              .c_str());
  }
  const std::string_view text = name_text(name);
  nb::gil_scoped_release release;
  engine.allgatherv(send.data(), send.size(), recv.data(), counts_bytes, text);
}

void engine_check_allreduce(kd::ShmEngine& engine, size_t nbytes, int dtype_code, int op_code,
                            nb::handle name) {
  const kd::DType dtype = check_dtype(dtype_code);
  const kd::Op op = check_op(op_code);
  element_count(nbytes, dtype_code, "nbytes");
  const std::string_view text = name_text(name);
  nb::gil_scoped_release release;
  engine.check_allreduce(nbytes, dtype, op, text);
}

void engine_check_broadcast(kd::ShmEngine& engine, size_t nbytes, int root, nb::handle name) {
  const std::string_view text = name_text(name);
  nb::gil_scoped_release release;
  engine.check_broadcast(nbytes, root, text);
}

void engine_check_allgatherv(kd::ShmEngine& engine, std::vector<uint64_t> counts_bytes,
                             nb::handle name) {
  const std::string_view text = name_text(name);
  nb::gil_scoped_release release;
  engine.check_allgatherv(counts_bytes, text);
}

nb::object engine_scratch(nb::handle self, size_t nbytes) {
  kd::ShmEngine& engine = nb::cast<kd::ShmEngine&>(self);
  uint8_t* ptr = engine.scratch(nbytes);
  if (!ptr) return nb::none();
  const size_t shape[1] = {nbytes};
  // The array keeps the engine (and so the mapping) alive.
  return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(ptr, 1, shape, self));
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "keras_dist native kernels and the shared-memory engine.";

  m.def("reduce_inplace", &py_reduce_inplace, nb::arg("dst"), nb::arg("src"), nb::arg("dtype"),
        nb::arg("op"),
        "dst[i] = op(dst[i], src[i]) over 1-D uint8 views of `dtype` elements "
        "(float16/bfloat16 accumulate in float32, rounded once).");
  m.def("reduce_many", &py_reduce_many, nb::arg("dst"), nb::arg("srcs"), nb::arg("dtype"),
        nb::arg("op"),
        "dst[i] = op(srcs[0][i], ..., srcs[k-1][i]), combined left to right with one "
        "rounding for half types; dst may be one of the sources.");
  m.def("simd_level", &kd::simd_level, "Kernel family in use: 'avx2' or 'baseline'.");
  m.def("_force_baseline", &kd::force_baseline, nb::arg("on"),
        "Tests only: use the baseline kernels even on an AVX2 CPU.");

  // The one set of wait timings (wait_timings.h), for Python's waits.
  nb::dict timings;
  timings["spin_seconds"] = kd::kSpinSeconds;
  timings["yield_seconds"] = kd::kYieldSeconds;
  timings["futex_wait_seconds"] = kd::kFutexWaitSeconds;
  timings["poll_sleep_seconds"] = kd::kPollSleepSeconds;
  timings["liveness_seconds"] = kd::kLivenessSeconds;
  m.attr("WAIT_TIMINGS") = timings;

  nb::exception<kd::MismatchError>(m, "CollectiveMismatchError");
  nb::exception<kd::PeerFailureError>(m, "PeerFailureError");
  nb::exception<kd::TimeoutError>(m, "CollectiveTimeoutError");
  nb::exception<kd::TransportError>(m, "TransportError");

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
      .def("broadcast", &engine_broadcast, nb::arg("buf"), nb::arg("root"),
           nb::arg("name") = nb::none())
      .def("allgatherv", &engine_allgatherv, nb::arg("send"), nb::arg("recv"),
           nb::arg("counts_bytes"), nb::arg("name") = nb::none())
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
      .def_prop_ro("name", &kd::ShmEngine::name);
}
