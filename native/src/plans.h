// The traced steps' plans (plans.cc): what bindings.cc needs of them.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>

namespace nb = nanobind;

namespace kdpy {

// The Python classes of the engine's errors (set when the module loads).
extern PyObject* g_error_types[4];

// Registers ReductionPlan (and its earlier name TfPlan) and TfGatherPlan on `m`.
void bind_plans(nb::module_& m);

}  // namespace kdpy

// The entries of KerasDistAllreduce (and of the XLA FFI handler) and of
// KerasDistAllgather: see their definitions in plans.cc.
extern "C" int keras_dist_tf_allreduce_entry(int64_t plan, int count, const void* const* srcs,
                                             void* const* dsts, const size_t* nbytes,
                                             char* message, size_t message_bytes);
extern "C" int keras_dist_tf_allgather_entry(int64_t plan, int count, const void* const* srcs,
                                             const int* ndims, const int64_t* dims,
                                             void* (*out)(void*, int, int64_t),
                                             void* out_context, char* message,
                                             size_t message_bytes);
