// What the Python-facing files of keras_dist._native share (bindings.cc, the
// engine's methods, the one-call collectives, the traced steps' plans): numpy's
// C API, the buffer view, the argument checks, and the declarations of the
// helpers bindings.cc registers.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

// numpy's C API, for the one-call collectives; the module imports it at load
// (bindings.cc, which defines KD_NUMPY_IMPORT_ARRAY). One API table for every
// file of the module.
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define NPY_TARGET_VERSION NPY_1_23_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL keras_dist_native_ARRAY_API
#ifndef KD_NUMPY_IMPORT_ARRAY
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include "reduce.h"
#include "shm_engine.h"

namespace nb = nanobind;

namespace kdpy {

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

// Argument checks (engine_py.cc).
kd::DType check_dtype(int dtype);
kd::Op check_op(int op);
size_t element_count(size_t nbytes, int dtype, const char* what);

// The kernels' entries (engine_py.cc).
void py_reduce_many(nb::handle dst_obj, nb::list src_objs, int dtype_code, int op_code);
void py_reduce_finish(nb::handle dst_obj, nb::handle copy_obj, nb::list src_objs, int dtype_code,
                      int op_code, int average_ranks);
void py_reduce_inplace(nb::handle dst_obj, nb::handle src_obj, int dtype_code, int op_code);

// The engine's methods on buffers (engine_py.cc).
std::unique_ptr<kd::ShmEngine> make_engine(const std::string& name, bool create, int local_rank,
                                           int local_size, size_t slot_bytes,
                                           std::vector<int64_t> peer_pids, double stall_seconds,
                                           double timeout_seconds,
                                           std::vector<int64_t> global_ranks,
                                           nb::object on_stall, bool single_copy,
                                           size_t single_copy_bytes);
void engine_allreduce(kd::ShmEngine& engine, nb::handle buf_obj, int dtype_code, int op_code,
                      nb::handle name, nb::handle send_obj);
void engine_allreduce_parts(kd::ShmEngine& engine, nb::list srcs, nb::list dsts, int dtype_code,
                            int op_code, bool average, nb::handle name);
void engine_broadcast(kd::ShmEngine& engine, nb::handle buf_obj, int root, nb::handle name);
void engine_allgatherv(kd::ShmEngine& engine, nb::handle send_obj, nb::handle recv_obj,
                       std::vector<uint64_t> counts_bytes, nb::handle name, bool prefixed);
void engine_check_allreduce(kd::ShmEngine& engine, size_t nbytes, int dtype_code, int op_code,
                            nb::handle name);
void engine_check_broadcast(kd::ShmEngine& engine, size_t nbytes, int root, nb::handle name);
void engine_check_allgatherv(kd::ShmEngine& engine, std::vector<uint64_t> counts_bytes,
                             nb::handle name);
nb::object engine_scratch(nb::handle self, size_t nbytes);

// keras_dist/tensor/fusion.py `aligned_views` (aligned_views.cc).
size_t fill_views(nb::list out, nb::handle raw, size_t align,
                  const std::vector<int64_t>& offsets, nb::sequence templates);

}  // namespace kdpy
