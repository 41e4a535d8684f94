// keras_dist's TensorFlow ops, KerasDistAllreduce and KerasDistAllgather: a
// traced step's grouped allreduce, and its allgathers, without a trip
// through Python.
//
// This library is loaded with tf.load_op_library (keras_dist/tensor/tf_kernel.py).
// It is built without TensorFlow: it speaks TensorFlow's stable C API for ops
// and kernels (tensorflow/c/ops.h, kernels.h), declared below, and finds those
// functions at load time in the libtensorflow_framework.so.2 the process has
// already loaded (dlopen RTLD_NOLOAD). Where that fails, nothing is
// registered, and keras_dist keeps its numpy_function path.
//
// The kernel does no collective work itself. Its attributes name an entry
// function of keras_dist._native (`entry`, an address) and a plan registered
// there (`plan`): the kernel hands the entry its inputs and outputs as raw
// buffers, and turns a failure into the op's status.
//
// An output is its input's buffer wherever TensorFlow lets the op reuse it
// (the input has no other reader, as a step's fresh gradients): the
// allreduce then runs in place, with nothing written to memory the step has
// not just touched. Elsewhere the outputs live in regions the op keeps.
//
// KerasDistAllgather's outputs have a first dimension known only once the
// ranks have exchanged their shapes: its entry asks the kernel for each
// output (gather_output) when it knows its rows.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

namespace {

// TensorFlow's C API types, opaque here.
struct TF_Status;
struct TF_Tensor;
struct TF_OpDefinitionBuilder;
struct TF_ShapeInferenceContext;
struct TF_ShapeHandle;
struct TF_KernelBuilder;
struct TF_OpKernelConstruction;
struct TF_OpKernelContext;
using TF_Code = int;  // TF_OK is 0
using TF_DataType = int;

// The functions used, as TensorFlow's C API declares them.
struct Api {
  TF_Status* (*NewStatus)();
  void (*DeleteStatus)(TF_Status*);
  void (*SetStatus)(TF_Status*, TF_Code, const char*);
  TF_Code (*GetCode)(const TF_Status*);
  TF_OpDefinitionBuilder* (*NewOpDefinitionBuilder)(const char*);
  void (*OpDefinitionBuilderAddAttr)(TF_OpDefinitionBuilder*, const char*);
  void (*OpDefinitionBuilderAddInput)(TF_OpDefinitionBuilder*, const char*);
  void (*OpDefinitionBuilderAddOutput)(TF_OpDefinitionBuilder*, const char*);
  void (*OpDefinitionBuilderSetIsStateful)(TF_OpDefinitionBuilder*, bool);
  void (*OpDefinitionBuilderSetShapeInferenceFunction)(
      TF_OpDefinitionBuilder*, void (*)(TF_ShapeInferenceContext*, TF_Status*));
  void (*RegisterOpDefinition)(TF_OpDefinitionBuilder*, TF_Status*);
  int64_t (*ShapeInferenceContextNumInputs)(TF_ShapeInferenceContext*);
  TF_ShapeHandle* (*NewShapeHandle)();
  void (*DeleteShapeHandle)(TF_ShapeHandle*);
  void (*ShapeInferenceContextGetInput)(TF_ShapeInferenceContext*, int, TF_ShapeHandle*,
                                        TF_Status*);
  void (*ShapeInferenceContextSetOutput)(TF_ShapeInferenceContext*, int, TF_ShapeHandle*,
                                         TF_Status*);
  TF_KernelBuilder* (*NewKernelBuilder)(const char*, const char*,
                                        void* (*)(TF_OpKernelConstruction*),
                                        void (*)(void*, TF_OpKernelContext*), void (*)(void*));
  void (*RegisterKernelBuilder)(const char*, TF_KernelBuilder*, TF_Status*);
  void (*OpKernelConstruction_GetAttrInt64)(TF_OpKernelConstruction*, const char*, int64_t*,
                                            TF_Status*);
  void (*OpKernelConstruction_Failure)(TF_OpKernelConstruction*, TF_Status*);
  int (*NumInputs)(TF_OpKernelContext*);
  void (*GetInput)(TF_OpKernelContext*, int, TF_Tensor**, TF_Status*);
  void (*SetOutput)(TF_OpKernelContext*, int, const TF_Tensor*, TF_Status*);
  void (*OpKernelContext_Failure)(TF_OpKernelContext*, TF_Status*);
  void* (*TensorData)(const TF_Tensor*);
  size_t (*TensorByteSize)(const TF_Tensor*);
  int (*NumDims)(const TF_Tensor*);
  int64_t (*Dim)(const TF_Tensor*, int);
  void (*DeleteTensor)(TF_Tensor*);
  TF_DataType (*TensorType)(const TF_Tensor*);
  size_t (*DataTypeSize)(TF_DataType);
  TF_Tensor* (*NewTensor)(TF_DataType, const int64_t*, int, void*, size_t,
                          void (*)(void*, size_t, void*), void*);
  TF_Tensor* (*AllocateOutput)(TF_OpKernelContext*, int, TF_DataType, const int64_t*, int, size_t,
                               TF_Status*);
  // Optional: without it, KerasDistAllgather is not registered.
  void (*ShapeInferenceContextSetUnknownShape)(TF_ShapeInferenceContext*, TF_Status*);
  // Optional (TensorFlow 2.4+): without it, no output reuses its input.
  TF_Tensor* (*ForwardInputOrAllocateOutput)(TF_OpKernelContext*, const int*, int, int,
                                             const int64_t*, int, int*, TF_Status*);
};

Api api;

// Fills `api` from the loaded TensorFlow framework library; false if any is missing.
bool load_api() {
  void* lib = dlopen("libtensorflow_framework.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (!lib) return false;
  bool ok = true;
  auto get = [&](auto& slot, const char* symbol) {
    void* found = dlsym(lib, symbol);
    if (!found) ok = false;
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(found);
  };
  get(api.NewStatus, "TF_NewStatus");
  get(api.DeleteStatus, "TF_DeleteStatus");
  get(api.SetStatus, "TF_SetStatus");
  get(api.GetCode, "TF_GetCode");
  get(api.NewOpDefinitionBuilder, "TF_NewOpDefinitionBuilder");
  get(api.OpDefinitionBuilderAddAttr, "TF_OpDefinitionBuilderAddAttr");
  get(api.OpDefinitionBuilderAddInput, "TF_OpDefinitionBuilderAddInput");
  get(api.OpDefinitionBuilderAddOutput, "TF_OpDefinitionBuilderAddOutput");
  get(api.OpDefinitionBuilderSetIsStateful, "TF_OpDefinitionBuilderSetIsStateful");
  get(api.OpDefinitionBuilderSetShapeInferenceFunction,
      "TF_OpDefinitionBuilderSetShapeInferenceFunction");
  get(api.RegisterOpDefinition, "TF_RegisterOpDefinition");
  get(api.ShapeInferenceContextNumInputs, "TF_ShapeInferenceContextNumInputs");
  get(api.NewShapeHandle, "TF_NewShapeHandle");
  get(api.DeleteShapeHandle, "TF_DeleteShapeHandle");
  get(api.ShapeInferenceContextGetInput, "TF_ShapeInferenceContextGetInput");
  get(api.ShapeInferenceContextSetOutput, "TF_ShapeInferenceContextSetOutput");
  get(api.NewKernelBuilder, "TF_NewKernelBuilder");
  get(api.RegisterKernelBuilder, "TF_RegisterKernelBuilder");
  get(api.OpKernelConstruction_GetAttrInt64, "TF_OpKernelConstruction_GetAttrInt64");
  get(api.OpKernelConstruction_Failure, "TF_OpKernelConstruction_Failure");
  get(api.NumInputs, "TF_NumInputs");
  get(api.GetInput, "TF_GetInput");
  get(api.SetOutput, "TF_SetOutput");
  get(api.OpKernelContext_Failure, "TF_OpKernelContext_Failure");
  get(api.TensorData, "TF_TensorData");
  get(api.TensorByteSize, "TF_TensorByteSize");
  get(api.NumDims, "TF_NumDims");
  get(api.Dim, "TF_Dim");
  get(api.DeleteTensor, "TF_DeleteTensor");
  get(api.TensorType, "TF_TensorType");
  get(api.DataTypeSize, "TF_DataTypeSize");
  get(api.NewTensor, "TF_NewTensor");
  get(api.AllocateOutput, "TF_AllocateOutput");
  api.ForwardInputOrAllocateOutput =
      reinterpret_cast<decltype(api.ForwardInputOrAllocateOutput)>(
          dlsym(lib, "TF_ForwardInputOrAllocateOutput"));
  api.ShapeInferenceContextSetUnknownShape =
      reinterpret_cast<decltype(api.ShapeInferenceContextSetUnknownShape)>(
          dlsym(lib, "TF_ShapeInferenceContextSetUnknownShape"));
  dlclose(lib);  // the process keeps TensorFlow loaded
  return ok;
}

// keras_dist._native's entry (see `keras_dist_tf_allreduce_entry` in
// plans.cc): returns 0, or a TF_Code with `message` (NUL-terminated, at
// most `message_bytes`) filled in.
using Entry = int (*)(int64_t plan, int count, const void* const* srcs, void* const* dsts,
                      const size_t* nbytes, char* message, size_t message_bytes);

// keras_dist._native's allgather entry (`keras_dist_tf_allgather_entry` in
// plans.cc): `dims` holds kGatherMaxDims per tensor; `out(out_context, i,
// rows)` makes output i and returns its data, or null.
constexpr int kGatherMaxDims = 8;
using GatherEntry = int (*)(int64_t plan, int count, const void* const* srcs, const int* ndims,
                            const int64_t* dims, void* (*out)(void*, int, int64_t),
                            void* out_context, char* message, size_t message_bytes);

constexpr size_t kAlign = 64;  // TensorFlow's alignment for CPU tensors

size_t aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Memory the outputs that cannot reuse their inputs live in, one region per
// step, reused once TensorFlow has released every output made in it. A fresh
// TensorFlow allocation per step is slower: the C library returns large freed
// blocks to the system, and each step faults its pages in again. `refs` counts the
// outputs alive plus one for the pool; the last release frees the region.
struct Region {
  uint8_t* data = nullptr;
  size_t bytes = 0;
  std::atomic<int> refs{1};
};

void release(Region* region) {
  if (region->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    std::free(region->data);
    delete region;
  }
}

void release_output(void*, size_t, void* region) { release(static_cast<Region*>(region)); }

// Regions beyond this many in use at once (outputs a program keeps): each
// output is then TensorFlow's own allocation.
constexpr size_t kMaxRegions = 4;

// Outputs made from their own inputs, in this process (tests read it).
std::atomic<int64_t> g_forwarded{0};

struct Kernel {
  int64_t plan = 0;
  intptr_t address = 0;  // the entry's (an Entry or a GatherEntry, by the op)
  Entry entry = nullptr;
  std::mutex mutex;  // guards `regions` and the making of `refused`
  std::vector<Region*> regions;
  // Per input: TensorFlow once refused to hand its buffer over (and allocated
  // the output instead); from then on that output lives in a region.
  std::unique_ptr<std::atomic<bool>[]> refused;

  std::atomic<bool>* refusals(int count) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!refused) refused.reset(new std::atomic<bool>[size_t(count)]());
    return refused.get();
  }

  ~Kernel() {
    for (Region* region : regions) release(region);
  }

  // A region of at least `bytes` that no output uses, taken for `outputs`
  // outputs (their references added), or null.
  Region* take_region(size_t bytes, int outputs) {
    std::lock_guard<std::mutex> lock(mutex);
    for (Region* region : regions) {
      if (region->bytes >= bytes && region->refs.load(std::memory_order_acquire) == 1) {
        region->refs.fetch_add(outputs, std::memory_order_relaxed);
        return region;
      }
    }
    if (regions.size() >= kMaxRegions) return nullptr;
    auto* region = new Region();
    region->bytes = bytes;
    region->data = static_cast<uint8_t*>(std::aligned_alloc(kAlign, aligned(bytes)));
    if (!region->data) {
      delete region;
      return nullptr;
    }
    region->refs.fetch_add(outputs, std::memory_order_relaxed);
    regions.push_back(region);
    return region;
  }
};

// Each output has its input's shape.
void same_shapes(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  TF_ShapeHandle* shape = api.NewShapeHandle();
  const int64_t count = api.ShapeInferenceContextNumInputs(ctx);
  for (int64_t i = 0; i < count && api.GetCode(status) == 0; ++i) {
    api.ShapeInferenceContextGetInput(ctx, int(i), shape, status);
    if (api.GetCode(status) == 0) api.ShapeInferenceContextSetOutput(ctx, int(i), shape, status);
  }
  api.DeleteShapeHandle(shape);
}

void* create(TF_OpKernelConstruction* ctx) {
  auto* kernel = new Kernel();
  TF_Status* status = api.NewStatus();
  int64_t entry = 0;
  api.OpKernelConstruction_GetAttrInt64(ctx, "plan", &kernel->plan, status);
  if (api.GetCode(status) == 0) api.OpKernelConstruction_GetAttrInt64(ctx, "entry", &entry, status);
  if (api.GetCode(status) == 0 && entry == 0) {
    api.SetStatus(status, 3 /* INVALID_ARGUMENT */, "keras_dist's op: `entry` is 0");
  }
  if (api.GetCode(status) != 0) api.OpKernelConstruction_Failure(ctx, status);
  kernel->address = static_cast<intptr_t>(entry);
  kernel->entry = reinterpret_cast<Entry>(kernel->address);
  api.DeleteStatus(status);
  return kernel;
}

void destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }

// The end of a kernel's compute: the inputs it still holds released, a
// failure in `status` made the op's, `status` deleted.
void end_compute(TF_OpKernelContext* ctx, TF_Status* status,
                 const std::vector<TF_Tensor*>& inputs) {
  for (TF_Tensor* t : inputs) {
    if (t) api.DeleteTensor(t);
  }
  if (api.GetCode(status) != 0) api.OpKernelContext_Failure(ctx, status);
  api.DeleteStatus(status);
}

void compute(void* opaque, TF_OpKernelContext* ctx) {
  Kernel& kernel = *static_cast<Kernel*>(opaque);
  TF_Status* status = api.NewStatus();
  const int count = api.NumInputs(ctx);
  // Held per thread between steps: no allocation in a step.
  thread_local std::vector<TF_Tensor*> inputs;
  thread_local std::vector<const void*> srcs;
  thread_local std::vector<void*> dsts;
  thread_local std::vector<size_t> nbytes;
  thread_local std::vector<int64_t> dims;
  inputs.assign(size_t(count), nullptr);
  srcs.assign(size_t(count), nullptr);
  dsts.assign(size_t(count), nullptr);
  nbytes.assign(size_t(count), 0);
  static char empty[kAlign];  // where a part of no bytes points
  std::atomic<bool>* refused = count ? kernel.refusals(count) : nullptr;
  size_t total = 0;
  int outputs = 0;  // those of one byte or more still to make in a region
  for (int i = 0; i < count && api.GetCode(status) == 0; ++i) {
    api.GetInput(ctx, i, &inputs[size_t(i)], status);
    if (api.GetCode(status) != 0) break;
    TF_Tensor* in = inputs[size_t(i)];
    const size_t n = nbytes[size_t(i)] = api.TensorByteSize(in);
    srcs[size_t(i)] = n ? api.TensorData(in) : empty;
    if (n && api.ForwardInputOrAllocateOutput && !refused[i].load(std::memory_order_relaxed)) {
      // The context's reference must be the input's only one: drop ours (the
      // context keeps the buffer alive until the op ends).
      const int rank = api.NumDims(in);
      dims.resize(size_t(rank));
      for (int d = 0; d < rank; ++d) dims[size_t(d)] = api.Dim(in, d);
      api.DeleteTensor(in);
      inputs[size_t(i)] = nullptr;
      int forwarded = -1;
      TF_Tensor* out = api.ForwardInputOrAllocateOutput(ctx, &i, 1, i, dims.data(), rank,
                                                        &forwarded, status);
      if (!out) break;  // status says why
      dsts[size_t(i)] = api.TensorData(out);
      api.DeleteTensor(out);  // the context holds the output
      if (forwarded == i) {
        g_forwarded.fetch_add(1, std::memory_order_relaxed);
      } else {
        refused[i].store(true, std::memory_order_relaxed);
      }
      continue;
    }
    total += aligned(n);
    outputs += n ? 1 : 0;
  }
  Region* region =
      api.GetCode(status) == 0 && total ? kernel.take_region(total, outputs) : nullptr;
  size_t offset = 0;
  int made = 0;  // outputs made in `region`
  for (int i = 0; i < count && api.GetCode(status) == 0; ++i) {
    if (dsts[size_t(i)]) continue;  // made above, from its input
    TF_Tensor* in = inputs[size_t(i)];
    const int rank = api.NumDims(in);
    dims.resize(size_t(rank));
    for (int d = 0; d < rank; ++d) dims[size_t(d)] = api.Dim(in, d);
    const size_t n = nbytes[size_t(i)];
    TF_Tensor* out;
    if (region && n) {
      out = api.NewTensor(api.TensorType(in), dims.data(), rank, region->data + offset, n,
                          &release_output, region);
      offset += aligned(n);
      ++made;
      api.SetOutput(ctx, i, out, status);
    } else {
      out = api.AllocateOutput(ctx, i, api.TensorType(in), dims.data(), rank, n, status);
    }
    if (out) {
      dsts[size_t(i)] = n ? api.TensorData(out) : empty;
      api.DeleteTensor(out);  // the context holds the output
    }
  }
  for (; region && made < outputs; ++made) release(region);  // a failure stopped the loop
  if (api.GetCode(status) == 0) {
    char message[4096];
    message[0] = '\0';
    const int code = kernel.entry(kernel.plan, count, srcs.data(), dsts.data(), nbytes.data(),
                                  message, sizeof(message));
    if (code != 0) api.SetStatus(status, code, message);
  }
  end_compute(ctx, status, inputs);
}

// KerasDistAllgather: each input gathered along its first dimension from
// every rank (the entry exchanges the shapes, then asks for each output).
struct GatherOutputs {
  TF_OpKernelContext* ctx;
  TF_Status* status;
  const std::vector<TF_Tensor*>* inputs;
  const std::vector<int>* ndims;
  const std::vector<int64_t>* dims;
};

void* gather_output(void* opaque, int i, int64_t rows) {
  static char empty[kAlign];  // where an output of no bytes points
  auto& o = *static_cast<GatherOutputs*>(opaque);
  TF_Tensor* in = (*o.inputs)[size_t(i)];
  const int rank = std::max((*o.ndims)[size_t(i)], 1);
  int64_t shape[kGatherMaxDims];
  shape[0] = rows;
  size_t items = size_t(rows);
  for (int d = 1; d < rank; ++d) {
    shape[d] = (*o.dims)[size_t(i) * kGatherMaxDims + size_t(d)];
    items *= size_t(shape[d]);
  }
  TF_Tensor* out = api.AllocateOutput(o.ctx, i, api.TensorType(in), shape, rank,
                                      items * api.DataTypeSize(api.TensorType(in)), o.status);
  if (!out) return nullptr;
  void* data = api.TensorData(out);
  api.DeleteTensor(out);  // the context holds the output
  return data && items ? data : empty;
}

void compute_gather(void* opaque, TF_OpKernelContext* ctx) {
  Kernel& kernel = *static_cast<Kernel*>(opaque);
  TF_Status* status = api.NewStatus();
  const int count = api.NumInputs(ctx);
  thread_local std::vector<TF_Tensor*> inputs;
  thread_local std::vector<const void*> srcs;
  thread_local std::vector<int> ndims;
  thread_local std::vector<int64_t> dims;
  inputs.assign(size_t(count), nullptr);
  srcs.assign(size_t(count), nullptr);
  ndims.assign(size_t(count), 0);
  dims.assign(size_t(count) * kGatherMaxDims, 0);
  static char empty[kAlign];
  for (int i = 0; i < count && api.GetCode(status) == 0; ++i) {
    api.GetInput(ctx, i, &inputs[size_t(i)], status);
    if (api.GetCode(status) != 0) break;
    TF_Tensor* in = inputs[size_t(i)];
    ndims[size_t(i)] = api.NumDims(in);
    for (int d = 0; d < std::min(ndims[size_t(i)], kGatherMaxDims); ++d) {
      dims[size_t(i) * kGatherMaxDims + size_t(d)] = api.Dim(in, d);
    }
    srcs[size_t(i)] = api.TensorByteSize(in) ? api.TensorData(in) : empty;
  }
  if (api.GetCode(status) == 0) {
    GatherOutputs outputs{ctx, status, &inputs, &ndims, &dims};
    char message[4096];
    message[0] = '\0';
    const int code = reinterpret_cast<GatherEntry>(kernel.address)(
        kernel.plan, count, srcs.data(), ndims.data(), dims.data(), &gather_output, &outputs,
        message, sizeof(message));
    if (code != 0 && api.GetCode(status) == 0) api.SetStatus(status, code, message);
  }
  end_compute(ctx, status, inputs);
}

// Outputs of unknown shapes (the first dimension is known only when the op runs).
void unknown_shapes(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  api.ShapeInferenceContextSetUnknownShape(ctx, status);
}

// Registers the op and its CPU kernel while tf.load_op_library loads this
// library (TensorFlow collects what a library registers as it loads).
struct Registration {
  Registration() {
    if (!load_api()) return;
    TF_Status* status = api.NewStatus();
    TF_OpDefinitionBuilder* op = api.NewOpDefinitionBuilder("KerasDistAllreduce");
    api.OpDefinitionBuilderAddInput(op, "inputs: T");
    api.OpDefinitionBuilderAddOutput(op, "outputs: T");
    api.OpDefinitionBuilderAddAttr(op, "T: list(type)");
    api.OpDefinitionBuilderAddAttr(op, "plan: int");
    api.OpDefinitionBuilderAddAttr(op, "entry: int");
    api.OpDefinitionBuilderSetIsStateful(op, true);  // a collective: runs once, in order
    api.OpDefinitionBuilderSetShapeInferenceFunction(op, &same_shapes);
    api.RegisterOpDefinition(op, status);
    if (api.GetCode(status) == 0) {
      TF_KernelBuilder* builder =
          api.NewKernelBuilder("KerasDistAllreduce", "CPU", &create, &compute, &destroy);
      api.RegisterKernelBuilder("KerasDistAllreduce", builder, status);
    }
    if (api.GetCode(status) == 0 && api.ShapeInferenceContextSetUnknownShape) {
      op = api.NewOpDefinitionBuilder("KerasDistAllgather");
      api.OpDefinitionBuilderAddInput(op, "inputs: T");
      api.OpDefinitionBuilderAddOutput(op, "outputs: T");
      api.OpDefinitionBuilderAddAttr(op, "T: list(type)");
      api.OpDefinitionBuilderAddAttr(op, "plan: int");
      api.OpDefinitionBuilderAddAttr(op, "entry: int");
      api.OpDefinitionBuilderSetIsStateful(op, true);
      api.OpDefinitionBuilderSetShapeInferenceFunction(op, &unknown_shapes);
      api.RegisterOpDefinition(op, status);
      if (api.GetCode(status) == 0) {
        TF_KernelBuilder* builder =
            api.NewKernelBuilder("KerasDistAllgather", "CPU", &create, &compute_gather, &destroy);
        api.RegisterKernelBuilder("KerasDistAllgather", builder, status);
      }
    }
    api.DeleteStatus(status);
  }
};

Registration registration;

}  // namespace

// How many of the op's outputs so far were their inputs' buffers (tests).
extern "C" __attribute__((visibility("default"))) int64_t keras_dist_tf_forwarded_outputs() {
  return g_forwarded.load(std::memory_order_relaxed);
}
