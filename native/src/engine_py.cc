// The Python face of the native extension: keras_dist._native.
// Buffers arrive through the buffer protocol as 1-D C-contiguous uint8 arrays
// (callers pass arr.view(np.uint8)); dtype and op are the codes of
// keras_dist/_vocab.py. Every wait happens with the GIL released.
//
// This file: the kernels' and the shm engine's Python methods on buffers
// (argument checks, the GIL released around every wait); bindings.cc
// registers them.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "py_common.h"
#include "reduce.h"
#include "shm_engine.h"

namespace kdpy {

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

namespace {

// The buffers of `src_objs`, each as many bytes as `dst_bytes` (held alive in `held`).
std::vector<const void*> source_pointers(nb::list src_objs, size_t dst_bytes,
                                         std::vector<std::unique_ptr<ByteBuffer>>& held) {
  std::vector<const void*> srcs;
  held.reserve(src_objs.size());
  for (size_t i = 0; i < src_objs.size(); ++i) {
    const std::string what = "srcs[" + std::to_string(i) + "]";
    held.emplace_back(new ByteBuffer(src_objs[i], false, what.c_str()));
    if (held.back()->size() != dst_bytes) {
      throw nb::value_error((what + " must have as many bytes as `dst`. Received: " +
                             std::to_string(held.back()->size()) + " bytes, dst has " +
                             std::to_string(dst_bytes))
                                .c_str());
    }
    srcs.push_back(held.back()->data());
  }
  return srcs;
}

}  // namespace

void py_reduce_many(nb::handle dst_obj, nb::list src_objs, int dtype_code, int op_code) {
  const kd::DType dtype = check_dtype(dtype_code);
  const kd::Op op = check_op(op_code);
  ByteBuffer dst(dst_obj, true, "dst");
  std::vector<std::unique_ptr<ByteBuffer>> held;
  const std::vector<const void*> srcs = source_pointers(src_objs, dst.size(), held);
  const size_t count = element_count(dst.size(), dtype_code, "dst");
  nb::gil_scoped_release release;
  kd::reduce_many(dst.data(), srcs.data(), srcs.size(), count, dtype, op);
}

// Tests: kd::reduce_finish (`copy` None: no copy).
void py_reduce_finish(nb::handle dst_obj, nb::handle copy_obj, nb::list src_objs, int dtype_code,
                      int op_code, int average_ranks) {
  const kd::DType dtype = check_dtype(dtype_code);
  const kd::Op op = check_op(op_code);
  ByteBuffer dst(dst_obj, true, "dst");
  std::unique_ptr<ByteBuffer> copy;
  if (!copy_obj.is_none()) {
    copy.reset(new ByteBuffer(copy_obj, true, "copy"));
    if (copy->size() != dst.size()) {
      throw nb::value_error(("`copy` must have as many bytes as `dst`. Received: " +
                             std::to_string(copy->size()) + " bytes, dst has " +
                             std::to_string(dst.size()))
                                .c_str());
    }
  }
  if (average_ranks < 0) {
    throw nb::value_error(("`average_ranks` must be 0 (no average) or a number of ranks. "
                           "Received: " + std::to_string(average_ranks)).c_str());
  }
  std::vector<std::unique_ptr<ByteBuffer>> held;
  const std::vector<const void*> srcs = source_pointers(src_objs, dst.size(), held);
  const size_t count = element_count(dst.size(), dtype_code, "dst");
  nb::gil_scoped_release release;
  kd::reduce_finish(dst.data(), copy ? copy->data() : nullptr, srcs.data(), srcs.size(), count,
                    dtype, op, average_ranks);
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

namespace {

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

}  // namespace

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

void engine_allreduce_parts(kd::ShmEngine& engine, nb::list srcs, nb::list dsts, int dtype_code,
                            int op_code, bool average, nb::handle name) {
  const kd::DType dtype = check_dtype(dtype_code);
  const kd::Op op = check_op(op_code);
  if (srcs.size() != dsts.size()) {
    throw nb::value_error(("allreduce_parts: `srcs` and `dsts` must have as many arrays. "
                           "Received: " + std::to_string(srcs.size()) + " and " +
                           std::to_string(dsts.size()))
                              .c_str());
  }
  const size_t esize = kd::dtype_size(dtype_code);
  std::vector<std::unique_ptr<ByteBuffer>> held;
  std::vector<kd::ShmEngine::Part> parts;
  parts.reserve(srcs.size());
  // A C-contiguous numpy array of the element size (or of bytes), of any
  // shape, is read through numpy's C API; other buffers (1-D) as ByteBuffer.
  std::vector<nb::object> scalars;  // 0-d arrays of numpy scalars among `srcs`
  auto run_of = [&](nb::handle obj, bool writable, const char* side, size_t i) {
    PyObject* o = obj.ptr();
    if (!writable && PyArray_IsScalar(o, Generic)) {  // tf.numpy_function's 0-d inputs
      scalars.push_back(nb::steal(PyArray_FromScalar(o, nullptr)));
      if (!scalars.back().is_valid()) throw nb::python_error();
      o = scalars.back().ptr();
    }
    if (PyArray_Check(o)) {
      auto* a = reinterpret_cast<PyArrayObject*>(o);
      const size_t item = size_t(PyArray_ITEMSIZE(a));
      if (PyArray_IS_C_CONTIGUOUS(a) && (!writable || PyArray_ISWRITEABLE(a)) &&
          (item == esize || PyArray_TYPE(a) == NPY_UINT8)) {
        return std::pair<uint8_t*, size_t>(static_cast<uint8_t*>(PyArray_DATA(a)),
                                           size_t(PyArray_NBYTES(a)));
      }
    }
    const std::string what = std::string(side) + "[" + std::to_string(i) + "]";
    held.emplace_back(new ByteBuffer(obj, writable, what.c_str(), esize));
    return std::pair<uint8_t*, size_t>(held.back()->data(), held.back()->size());
  };
  for (size_t i = 0; i < srcs.size(); ++i) {
    const auto [src, src_bytes] = run_of(srcs[i], false, "srcs", i);
    const auto [dst, dst_bytes] = run_of(dsts[i], true, "dsts", i);
    if (src_bytes % esize != 0) {
      element_count(src_bytes, dtype_code, ("srcs[" + std::to_string(i) + "]").c_str());
    }
    if (dst_bytes != src_bytes) {
      const std::string src_what = "srcs[" + std::to_string(i) + "]";
      const std::string dst_what = "dsts[" + std::to_string(i) + "]";
      throw nb::value_error(("allreduce_parts: `" + dst_what + "` must have as many bytes as `" +
                             src_what + "`. Received: " + std::to_string(dst_bytes) + " and " +
                             std::to_string(src_bytes))
                                .c_str());
    }
    parts.push_back({src, dst, src_bytes});
  }
  const std::string_view text = name_text(name);
  nb::gil_scoped_release release;
  engine.allreduce_parts(parts, dtype, op, average, text);
}

void engine_broadcast(kd::ShmEngine& engine, nb::handle buf_obj, int root, nb::handle name) {
  ByteBuffer buf(buf_obj, true, "buf");
  const std::string_view text = name_text(name);
  nb::gil_scoped_release release;
  engine.broadcast(buf.data(), buf.size(), root, text);
}

void engine_allgatherv(kd::ShmEngine& engine, nb::handle send_obj, nb::handle recv_obj,
                       std::vector<uint64_t> counts_bytes, nb::handle name, bool prefixed) {
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
  engine.allgatherv(send.data(), send.size(), recv.data(), counts_bytes, text, prefixed);
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

}  // namespace kdpy
