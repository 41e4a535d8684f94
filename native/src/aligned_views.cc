// keras_dist._native's aligned views: numpy arrays over one raw buffer, for
// keras_dist/tensor/fusion.py; bindings.cc registers fill_views.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "py_common.h"

namespace kdpy {

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

}  // namespace kdpy
