// The Python face of the native extension: keras_dist._native.
// Buffers arrive through the buffer protocol as 1-D C-contiguous uint8 arrays
// (callers pass arr.view(np.uint8)); dtype and op are the codes of
// keras_dist/_dtypes.py. Every wait happens with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "reduce.h"

namespace nb = nanobind;

namespace {

// A view on a Python object's memory, released on scope exit.
class ByteBuffer {
 public:
  ByteBuffer(nb::handle obj, bool writable, const char* what) {
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
    if (view_.itemsize != 1 || (std::strcmp(fmt, "B") != 0 && std::strcmp(fmt, "=B") != 0 &&
                                std::strcmp(fmt, "<B") != 0 && std::strcmp(fmt, "|B") != 0)) {
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
    if (view_.strides && view_.strides[0] != 1 && view_.shape[0] > 1) {
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
  size_t size() const { return size_t(view_.len); }

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
}
