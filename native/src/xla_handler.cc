// keras_dist's XLA FFI handler: a jitted JAX step's grouped allreduce on the
// CPU (keras_dist/tensor/jax_glue.py `native_allreduce`) with no Python on a
// good step.
//
// The handler is registered with jax.ffi.register_ffi_target and called by
// XLA's CPU runtime where the step reaches the custom call. It is built
// without XLA's headers: it speaks XLA's stable FFI C API (major version 0),
// whose few structs it reads are declared below, each member as that API
// lays it out. Every struct the runtime hands over carries its size, which
// the handler checks before reading a member.
//
// The handler does no collective work itself: its `plan` attribute names a
// plan of keras_dist._native (a ReductionPlan, as the TensorFlow op runs:
// buckets, engine, fallback, timeline), and it hands the plan the call's input and output
// buffers through the entry the TensorFlow op uses
// (keras_dist_tf_allreduce_entry, plans.cc). Outputs alias their inputs
// (the step's fresh gradients), so the allreduce runs in place.
#include "plans.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

// The FFI C API's structs, as far as this handler reads or writes them.
struct ExtensionBase {
  size_t struct_size;
  int type;  // 1: the metadata extension
  ExtensionBase* next;
};

struct ApiVersion {
  size_t struct_size;
  ExtensionBase* extension_start;
  int major_version;
  int minor_version;
};

struct Metadata {
  size_t struct_size;
  ApiVersion api_version;
  uint32_t traits;
};

struct MetadataExtension {
  ExtensionBase extension_base;
  Metadata* metadata;
};

struct Error;

struct ErrorCreateArgs {
  size_t struct_size;
  ExtensionBase* extension_start;
  const char* message;
  int code;
};

struct Api {
  size_t struct_size;
  ExtensionBase* extension_start;
  ApiVersion api_version;
  const void* internal_api;
  Error* (*error_create)(ErrorCreateArgs*);
};

struct Buffer {
  size_t struct_size;
  ExtensionBase* extension_start;
  int dtype;
  void* data;
  int64_t rank;
  int64_t* dims;
};

struct ByteSpan {
  const char* ptr;
  size_t len;
};

struct Scalar {
  int dtype;
  void* value;
};

struct List {  // the args and the results alike
  size_t struct_size;
  ExtensionBase* extension_start;
  int64_t size;
  int* types;  // 1: a buffer
  void** items;
};

struct Attrs {
  size_t struct_size;
  ExtensionBase* extension_start;
  int64_t size;
  int* types;  // 3: a scalar
  ByteSpan** names;
  void** attrs;
};

struct CallFrame {
  size_t struct_size;
  ExtensionBase* extension_start;
  const Api* api;
  void* ctx;
  int stage;  // 3: execute
  List args;
  List rets;
  Attrs attrs;
};

constexpr int kMajorVersion = 0;
// The newest minor version whose structs this file knows (jaxlib 0.10's).
constexpr int kMinorVersion = 3;
constexpr int kExtensionMetadata = 1, kStageExecute = 3, kBufferType = 1, kScalarType = 3;
constexpr int kS64 = 5;
constexpr int kInvalidArgument = 3, kFailedPrecondition = 9;

constexpr size_t kCallFrameSize = offsetof(CallFrame, attrs) + sizeof(Attrs);
constexpr size_t kBufferSize = offsetof(Buffer, dims) + sizeof(int64_t*);
constexpr size_t kMetadataSize = offsetof(Metadata, traits) + sizeof(uint32_t);
constexpr size_t kApiSize = offsetof(Api, error_create) + sizeof(void*);

// Bytes per element of XLA's element type `dtype`, 0 where the allreduce
// cannot carry it.
size_t itemsize(int dtype) {
  switch (dtype) {
    case 1: case 2: case 6: return 1;              // PRED, S8, U8
    case 3: case 7: case 10: case 16: return 2;    // S16, U16, F16, BF16
    case 4: case 8: case 11: return 4;             // S32, U32, F32
    case 5: case 9: case 12: case 15: return 8;    // S64, U64, F64, C64
    case 18: return 16;                            // C128
    default: return 0;
  }
}

Error* fail(const Api* api, int code, const char* message) {
  if (!api || api->struct_size < kApiSize || !api->error_create) return nullptr;
  ErrorCreateArgs args{sizeof(ErrorCreateArgs), nullptr, message, code};
  return api->error_create(&args);
}

// The metadata query: the FFI version this handler speaks, no traits.
Error* describe(const CallFrame* frame) {
  auto* extension = reinterpret_cast<MetadataExtension*>(frame->extension_start);
  if (extension->extension_base.struct_size < sizeof(MetadataExtension) ||
      !extension->metadata || extension->metadata->struct_size < kMetadataSize) {
    return fail(frame->api, kInvalidArgument,
                "keras_dist_allreduce: XLA's FFI metadata is smaller than its API version 0 "
                "lays it out");
  }
  int minor = kMinorVersion;
  if (frame->api && frame->api->struct_size >= kApiSize) {
    if (frame->api->api_version.major_version != kMajorVersion) {
      return fail(frame->api, kFailedPrecondition,
                  "keras_dist_allreduce: this XLA's FFI API has a major version other than "
                  "0, the one keras_dist's handler speaks");
    }
    minor = std::min(minor, frame->api->api_version.minor_version);
  }
  extension->metadata->api_version = ApiVersion{sizeof(ApiVersion), nullptr, kMajorVersion,
                                                minor};
  extension->metadata->traits = 0;
  return nullptr;
}

// The `plan` attribute (a 64-bit integer scalar), or -1.
int64_t plan_of(const Attrs& attrs) {
  for (int64_t i = 0; i < attrs.size; ++i) {
    const ByteSpan* name = attrs.names[i];
    if (attrs.types[i] != kScalarType || !name || name->len != 4 ||
        std::memcmp(name->ptr, "plan", 4) != 0) {
      continue;
    }
    const auto* scalar = static_cast<const Scalar*>(attrs.attrs[i]);
    if (scalar->dtype != kS64) return -1;
    int64_t value;
    std::memcpy(&value, scalar->value, sizeof(value));
    return value;
  }
  return -1;
}

// The data and bytes of buffer `item` of a list, or false (message set).
bool buffer_of(const List& list, int64_t i, const char* what, void*& data, size_t& nbytes,
               std::string& message) {
  const auto* buffer = static_cast<const Buffer*>(list.items[i]);
  if (list.types[i] != kBufferType || buffer->struct_size < kBufferSize) {
    message = std::string("keras_dist_allreduce: ") + what + " " + std::to_string(i) +
              " is not a buffer XLA's FFI API version 0 lays out";
    return false;
  }
  const size_t size = itemsize(buffer->dtype);
  if (size == 0) {
    message = std::string("keras_dist_allreduce: ") + what + " " + std::to_string(i) +
              " has XLA element type " + std::to_string(buffer->dtype) +
              ", which the allreduce does not carry";
    return false;
  }
  nbytes = size;
  for (int64_t d = 0; d < buffer->rank; ++d) nbytes *= size_t(buffer->dims[d]);
  data = buffer->data;
  return true;
}

}  // namespace

// The handler (XLA_FFI_Handler): the plan numbered by the call's `plan`
// attribute on its results, result i taking argument i (arguments past the
// results order the call and are not read).
extern "C" void* keras_dist_xla_allreduce(void* call_frame) {
  auto* frame = static_cast<CallFrame*>(call_frame);
  if (frame->struct_size < kCallFrameSize) {
    return fail(frame->api, kInvalidArgument,
                "keras_dist_allreduce: XLA's call frame is smaller than its FFI API version "
                "0 lays it out");
  }
  if (frame->extension_start && frame->extension_start->type == kExtensionMetadata) {
    return describe(frame);
  }
  if (frame->stage != kStageExecute) return nullptr;
  const int64_t count = frame->rets.size;
  std::string message;
  if (frame->args.size < count) {
    message = "keras_dist_allreduce: " + std::to_string(frame->args.size) + " arguments for " +
              std::to_string(count) + " results";
    return fail(frame->api, kInvalidArgument, message.c_str());
  }
  const int64_t plan = plan_of(frame->attrs);
  if (plan < 0) {
    return fail(frame->api, kInvalidArgument,
                "keras_dist_allreduce: the call has no 64-bit integer attribute `plan`");
  }
  thread_local std::vector<const void*> srcs;
  thread_local std::vector<void*> dsts;
  thread_local std::vector<size_t> nbytes;
  srcs.assign(size_t(count), nullptr);
  dsts.assign(size_t(count), nullptr);
  nbytes.assign(size_t(count), 0);
  for (int64_t i = 0; i < count; ++i) {
    void* src = nullptr;
    size_t src_bytes = 0;
    if (!buffer_of(frame->args, i, "argument", src, src_bytes, message) ||
        !buffer_of(frame->rets, i, "result", dsts[size_t(i)], nbytes[size_t(i)], message)) {
      return fail(frame->api, kInvalidArgument, message.c_str());
    }
    if (src_bytes != nbytes[size_t(i)]) {
      message = "keras_dist_allreduce: argument " + std::to_string(i) + " has " +
                std::to_string(src_bytes) + " bytes, its result " +
                std::to_string(nbytes[size_t(i)]);
      return fail(frame->api, kInvalidArgument, message.c_str());
    }
    srcs[size_t(i)] = src;
  }
  char text[1024];
  const int code = keras_dist_tf_allreduce_entry(plan, int(count), srcs.data(), dsts.data(),
                                                 nbytes.data(), text, sizeof(text));
  return code == 0 ? nullptr : fail(frame->api, code, text);
}
