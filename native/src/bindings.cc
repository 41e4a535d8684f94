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
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <ctime>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

// numpy's C API, for the one-call collectives; the module imports it at load.
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define NPY_TARGET_VERSION NPY_1_23_API_VERSION
#include <numpy/arrayobject.h>

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

// ---- One-call collectives on numpy arrays --------------------------------
// kd.allreduce / kd.broadcast / kd.allgather of a small C-contiguous numpy
// array would spend most of their time in Python. These entries do the whole
// call under one Python call: read the array's dtype and shape through numpy's
// C API, make the output array, name the call exactly as
// keras_dist/tensor/ops.py `_describe` does (so it meets the general path on
// peers that take it, and the header check compares shapes), run the
// collective with the GIL released and, for an average, finish it. Anything
// but the plain case returns None, and the caller takes its general path,
// which makes every check and raises the errors.

// Largest array served: beyond, the copy into the output costs about what the
// Python path costs (benchmarks/ measures both), and the general path reads
// the input in place.
constexpr Py_ssize_t kArrayCallBytes = 64 << 10;

// The numpy dtypes these entries take: numpy's type number, the item size,
// numpy's name, and the engine's dtype code (-1: moved as bytes, never
// reduced).
struct NumpyType {
  int number;
  Py_ssize_t itemsize;
  const char* name;
  int code;
};
constexpr NumpyType kNumpyTypes[] = {
    {NPY_FLOAT, 4, "float32", int(kd::DType::kFloat32)},
    {NPY_DOUBLE, 8, "float64", int(kd::DType::kFloat64)},
    {NPY_HALF, 2, "float16", int(kd::DType::kFloat16)},
    {NPY_INT, 4, "int32", int(kd::DType::kInt32)},
    {NPY_LONG, 8, "int64", int(kd::DType::kInt64)},
    {NPY_LONGLONG, 8, "int64", int(kd::DType::kInt64)},
    {NPY_UBYTE, 1, "uint8", int(kd::DType::kUInt8)},
    {NPY_BYTE, 1, "int8", int(kd::DType::kInt8)},
    {NPY_SHORT, 2, "int16", int(kd::DType::kInt16)},
    {NPY_USHORT, 2, "uint16", int(kd::DType::kUInt16)},
    {NPY_BOOL, 1, "bool", -1},
    {NPY_UINT, 4, "uint32", -1},
    {NPY_ULONG, 8, "uint64", -1},
    {NPY_ULONGLONG, 8, "uint64", -1},
    {NPY_CFLOAT, 8, "complex64", -1},
    {NPY_CDOUBLE, 16, "complex128", -1},
};

// A numpy array these entries serve: exactly a numpy.ndarray or a subclass,
// C-contiguous, in native byte order, of a type above, at most
// kArrayCallBytes. ok() is false for anything else.
struct ArrayIn {
  explicit ArrayIn(PyObject* x) {
    if (!PyArray_Check(x)) return;
    array = reinterpret_cast<PyArrayObject*>(x);
    if (!PyArray_IS_C_CONTIGUOUS(array) || !PyArray_ISNOTSWAPPED(array) ||
        PyArray_NBYTES(array) > kArrayCallBytes) {
      return;
    }
    const int number = PyArray_TYPE(array);
    for (const NumpyType& t : kNumpyTypes) {
      if (t.number == number && t.itemsize == PyArray_ITEMSIZE(array)) type = &t;
    }
  }
  bool ok() const { return type != nullptr; }
  void* data() const { return PyArray_DATA(array); }
  size_t nbytes() const { return size_t(PyArray_NBYTES(array)); }
  int ndim() const { return PyArray_NDIM(array); }
  const npy_intp* shape() const { return PyArray_DIMS(array); }

  PyArrayObject* array = nullptr;
  const NumpyType* type = nullptr;
};

// A new C-contiguous numpy.ndarray of `like`'s shape and dtype (contents
// undefined).
nb::object new_like(const ArrayIn& like) {
  PyObject* out = PyArray_NewLikeArray(like.array, NPY_CORDER, nullptr, 0);
  if (!out) throw nb::python_error();
  return nb::steal(out);
}

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

// The names of recent calls: `_describe`'s text for (label, op, dtype, shape).
// Entries hold a reference to their label, so its address names it.
class CallNames {
 public:
  static constexpr int kMaxDims = 16;

  // `label`: the caller's name (None or "": `fallback`); `op`: a public op
  // index or -1. Empty view when the call cannot be named here (a label that
  // is not a str, too many dimensions).
  std::string_view get(PyObject* label, const char* fallback, int op, const ArrayIn& x) {
    const NumpyType& type = *x.type;
    const int ndim = x.ndim();
    const npy_intp* shape = x.shape();
    if (ndim > kMaxDims) return {};
    for (Entry& e : entries_) {
      if (e.label == label && e.fallback == fallback && e.op == op && e.type == &type &&
          e.ndim == ndim && std::equal(shape, shape + ndim, e.shape)) {
        return e.text;
      }
    }
    std::string prefix;
    if (label != Py_None) {
      Py_ssize_t size = 0;
      const char* text = PyUnicode_Check(label) ? PyUnicode_AsUTF8AndSize(label, &size) : nullptr;
      if (!text) {
        PyErr_Clear();
        return {};
      }
      prefix.assign(text, size_t(size));
    }
    if (prefix.empty()) prefix = fallback;
    if (op >= 0) prefix = prefix + " " + kPublicOps[op].value;
    std::string text = prefix + " [1 of 1 tensors: " + type.name + "[";
    for (int d = 0; d < ndim; ++d) {
      if (d) text += ", ";
      text += std::to_string(shape[d]);
    }
    text += "]]";
    Entry& e = entries_[next_];
    next_ = (next_ + 1) % kEntries;
    Py_XDECREF(e.label);
    Py_INCREF(label);
    e.label = label;
    e.fallback = fallback;
    e.op = op;
    e.type = &type;
    e.ndim = ndim;
    std::copy(shape, shape + ndim, e.shape);
    e.text = std::move(text);
    return e.text;
  }

 private:
  static constexpr int kEntries = 8;
  struct Entry {
    PyObject* label = nullptr;  // a strong reference, kept for the process's life
    const char* fallback = nullptr;
    int op = -1;
    const NumpyType* type = nullptr;
    int ndim = -1;
    npy_intp shape[kMaxDims] = {};
    std::string text;
  };
  Entry entries_[kEntries];
  int next_ = 0;
};

// Used with the GIL held only. Never destroyed: its references to labels
// must not be dropped after the interpreter has gone.
CallNames& call_names() {
  static CallNames* names = new CallNames();
  return *names;
}

nb::object engine_allreduce_array(kd::ShmEngine& engine, nb::handle x, int op_index,
                                  nb::handle label) {
  if (op_index < 0 || op_index >= kNumPublicOps) return nb::none();
  const ArrayIn in(x.ptr());
  if (!in.ok() || in.type->code < 0) return nb::none();
  const std::string_view name = call_names().get(label.ptr(), "allreduce", op_index, in);
  if (name.empty()) return nb::none();
  nb::object out = new_like(in);
  void* result = PyArray_DATA(reinterpret_cast<PyArrayObject*>(out.ptr()));
  const PublicOp& op = kPublicOps[op_index];
  const kd::DType dtype = kd::DType(in.type->code);
  const size_t nbytes = in.nbytes();
  {
    nb::gil_scoped_release release;
    engine.allreduce(result, nbytes, dtype, op.op, name, in.data());
    if (op.average && engine.local_size() > 1) {
      kd::average_inplace(result, nbytes / size_t(in.type->itemsize), dtype,
                          engine.local_size());
    }
  }
  return out;
}

nb::object engine_broadcast_array(kd::ShmEngine& engine, nb::handle x, nb::handle root,
                                  nb::handle label) {
  if (!PyLong_CheckExact(root.ptr())) return nb::none();
  const long root_rank = PyLong_AsLong(root.ptr());
  if (root_rank < 0 || root_rank >= engine.local_size()) {
    PyErr_Clear();
    return nb::none();
  }
  const ArrayIn in(x.ptr());
  if (!in.ok()) return nb::none();
  const std::string_view name = call_names().get(label.ptr(), "broadcast", -1, in);
  if (name.empty()) return nb::none();
  nb::object out = new_like(in);
  void* result = PyArray_DATA(reinterpret_cast<PyArrayObject*>(out.ptr()));
  {
    nb::gil_scoped_release release;
    engine.broadcast(result, in.nbytes(), int(root_rank), name, in.data());
  }
  return out;
}

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
  int64_t mine[kGatherWords] = {};
  mine[0] = int64_t(kGatherWords * sizeof(int64_t) + (inline_data ? data_bytes : 0));
  mine[1] = inline_data ? 1 : 0;
  mine[2] = in.ndim;
  mine[3] = in.type_number;
  std::copy(in.dims, in.dims + in.ndim, mine + 4);
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

nb::object engine_allgather_array(kd::ShmEngine& engine, nb::handle x, nb::handle label) {
  const ArrayIn in(x.ptr());
  if (!in.ok() || in.ndim() > kGatherMaxDims) return nb::none();
  // Kept between calls (used with the GIL held): no allocation per call.
  static thread_local std::string name, shapes_name;
  static thread_local std::vector<int64_t> headers;
  name.assign("allgather");
  if (!label.is_none()) {
    Py_ssize_t size = 0;
    const char* chars =
        PyUnicode_Check(label.ptr()) ? PyUnicode_AsUTF8AndSize(label.ptr(), &size) : nullptr;
    if (!chars) {
      PyErr_Clear();
      return nb::none();
    }
    if (size > 0) name.assign(chars, size_t(size));
  }
  shapes_name.assign(name).append(" shapes");
  GatherIn gather{in.data(), in.ndim() == 0 ? 1 : in.ndim(), {}, in.type->number,
                  size_t(in.type->itemsize)};
  if (in.ndim() == 0) gather.dims[0] = 1;
  for (int d = 0; d < in.ndim(); ++d) gather.dims[d] = in.shape()[d];
  nb::object out;
  auto make = [&](int64_t rows) {  // a new array of shape (rows, *x.shape[1:]), x's dtype
    npy_intp dims[kGatherMaxDims];
    dims[0] = npy_intp(rows);
    for (int d = 1; d < gather.ndim; ++d) dims[d] = npy_intp(gather.dims[d]);
    PyArray_Descr* descr = PyArray_DESCR(in.array);
    Py_INCREF(descr);  // stolen below
    out = nb::steal(PyArray_SimpleNewFromDescr(gather.ndim, dims, descr));
    if (!out.is_valid()) throw nb::python_error();
    return PyArray_DATA(reinterpret_cast<PyArrayObject*>(out.ptr()));
  };
  if (!gather_core<nb::gil_scoped_release>(engine, gather, name, shapes_name, make, headers)) {
    return nb::bytes(headers.data(), headers.size() * sizeof(int64_t));
  }
  return out;
}


// ---- Aligned views ---------------------------------------------------------
// keras_dist/tensor/fusion.py `aligned_views`: one array per template (an
// array, or a numpy scalar: a 0-d array), of its shape and dtype, viewing
// `raw`'s bytes from the first multiple of `align` at or after raw's start,
// plus offsets[i]; each view keeps `raw` alive. Appends them to `out` (a
// list) and returns where the first multiple of `align` lies in `raw`.
size_t fill_views(nb::list out, nb::handle raw, size_t align,
                  const std::vector<int64_t>& offsets, nb::sequence templates) {
  if (!PyArray_Check(raw.ptr()) ||
      !PyArray_IS_C_CONTIGUOUS(reinterpret_cast<PyArrayObject*>(raw.ptr())) ||
      !PyArray_ISWRITEABLE(reinterpret_cast<PyArrayObject*>(raw.ptr()))) {
    throw std::invalid_argument("fill_views: `raw` must be a writable C-contiguous array");
  }
  if (align == 0 || (align & (align - 1)) != 0) {
    throw std::invalid_argument("fill_views: `align` must be a power of 2. Received: " +
                                std::to_string(align));
  }
  auto* base = reinterpret_cast<PyArrayObject*>(raw.ptr());
  char* bytes = PyArray_BYTES(base);
  const size_t available = size_t(PyArray_NBYTES(base));
  const size_t start = (align - reinterpret_cast<uintptr_t>(bytes) % align) % align;
  const size_t count = nb::len(templates);
  if (count != offsets.size()) {
    throw std::invalid_argument("fill_views: one offset per template. Received " +
                                std::to_string(offsets.size()) + " offsets, " +
                                std::to_string(count) + " templates");
  }
  for (size_t i = 0; i < count; ++i) {
    nb::object t = templates[i];
    PyArray_Descr* descr;
    int ndim = 0;
    const npy_intp* dims = nullptr;
    if (PyArray_Check(t.ptr())) {
      auto* a = reinterpret_cast<PyArrayObject*>(t.ptr());
      descr = PyArray_DESCR(a);
      Py_INCREF(descr);
      ndim = PyArray_NDIM(a);
      dims = PyArray_DIMS(a);
    } else if (PyArray_IsScalar(t.ptr(), Generic)) {
      descr = PyArray_DescrFromScalar(t.ptr());  // a new reference
      if (!descr) throw nb::python_error();
    } else {
      throw nb::type_error("fill_views: every template must be a numpy array or scalar");
    }
    npy_intp items = 1;
    for (int d = 0; d < ndim; ++d) items *= dims[d];
    const size_t nbytes = size_t(items) * size_t(PyDataType_ELSIZE(descr));
    if (offsets[i] < 0 || start + size_t(offsets[i]) + nbytes > available) {
      Py_DECREF(descr);
      throw std::invalid_argument("fill_views: view " + std::to_string(i) +
                                  " ends past `raw`");
    }
    PyObject* view = PyArray_NewFromDescr(&PyArray_Type, descr, ndim, dims, nullptr,
                                          bytes + start + size_t(offsets[i]),
                                          NPY_ARRAY_CARRAY, nullptr);  // steals descr
    if (!view) throw nb::python_error();
    Py_INCREF(raw.ptr());
    if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(view), raw.ptr()) != 0) {
      Py_DECREF(view);
      throw nb::python_error();
    }
    const int appended = PyList_Append(out.ptr(), view);
    Py_DECREF(view);
    if (appended != 0) throw nb::python_error();
  }
  return start;
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
Dispatch& dispatch() {
  static Dispatch* d = [] {
    Dispatch* made = new Dispatch();
    made->key_allreduce = PyUnicode_InternFromString("allreduce");
    made->key_broadcast = PyUnicode_InternFromString("broadcast");
    made->key_allgather = PyUnicode_InternFromString("allgather");
    return made;
  }();
  return *d;
}

void dispatch_setup(nb::dict counters, nb::tuple ops) {
  if (ops.size() != size_t(kNumPublicOps)) {
    throw std::invalid_argument("dispatch_setup: `ops` must hold the 5 public ops");
  }
  Dispatch& d = dispatch();
  auto keep = [](PyObject*& slot, nb::handle value) {
    Py_XINCREF(value.ptr());
    Py_XSETREF(slot, value.ptr());
  };
  keep(d.counters, counters);
  for (int i = 0; i < kNumPublicOps; ++i) keep(d.ops[i], ops[size_t(i)]);
}

void set_dispatch_engine(nb::handle engine) {
  if (!engine.is_none() && !nb::isinstance<kd::ShmEngine>(engine)) {
    throw nb::type_error(("set_dispatch_engine: `engine` must be a ShmEngine or None. "
                          "Received: an object of type " +
                          std::string(nb::type_name(engine.type()).c_str()))
                             .c_str());
  }
  Dispatch& d = dispatch();
  PyObject* held = engine.is_none() ? nullptr : engine.ptr();
  Py_XINCREF(held);
  Py_XSETREF(d.engine, held);
}

void set_dispatch_recording(bool recording) { dispatch().recording = recording; }

bool is_plain_array(nb::handle x) { return Py_TYPE(x.ptr()) == &PyArray_Type; }

nb::object dispatch_allreduce(nb::handle x, nb::handle op, nb::handle label) {
  if (!is_plain_array(x)) return nb::none();
  Dispatch& d = dispatch();
  int index = op.is_none() ? 0 : -1;
  for (int i = 0; i < kNumPublicOps && index < 0; ++i) {
    if (op.ptr() == d.ops[i]) index = i;
  }
  if (index < 0) return nb::none();  // another op, or not an op: the general path
  kd::ShmEngine* engine = d.serving_engine();
  if (!engine) return nb::none();
  nb::object out = engine_allreduce_array(*engine, x, index, label);
  if (!out.is_none()) {
    d.count(d.key_allreduce);
    ++d.served;
  }
  return out;
}

nb::object dispatch_broadcast(nb::handle x, nb::handle root, nb::handle label) {
  if (!is_plain_array(x)) return nb::none();
  Dispatch& d = dispatch();
  kd::ShmEngine* engine = d.serving_engine();
  if (!engine) return nb::none();
  nb::object out = engine_broadcast_array(*engine, x, root, label);
  if (!out.is_none()) {
    d.count(d.key_broadcast);
    ++d.served;
  }
  return out;
}

nb::object dispatch_allgather(nb::handle x, nb::handle label) {
  if (!is_plain_array(x)) return nb::none();
  Dispatch& d = dispatch();
  kd::ShmEngine* engine = d.serving_engine();
  if (!engine) return nb::none();
  nb::object out = engine_allgather_array(*engine, x, label);
  if (PyArray_Check(out.ptr())) {
    d.count(d.key_allgather);
    ++d.served;
  }
  return out;
}


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

// The Python classes of the engine's errors (set when the module loads).
PyObject* g_error_types[4] = {};

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

// The XLA FFI handler (xla_handler.cc), which hands a jitted JAX step's
// buffers to keras_dist_tf_allreduce_entry.
extern "C" void* keras_dist_xla_allreduce(void* call_frame);

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
