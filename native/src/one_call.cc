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
// The allgather's records, the public ops and the dispatch state are in
// one_call.h, which the traced steps' plans (plans.cc) share.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <string>
#include <vector>

#include "one_call.h"
#include "py_common.h"
#include "reduce.h"
#include "shm_engine.h"

namespace kdpy {

namespace {

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

}  // namespace

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

namespace {

bool is_plain_array(nb::handle x) { return Py_TYPE(x.ptr()) == &PyArray_Type; }

}  // namespace

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

}  // namespace kdpy
