// Element-wise reduction kernels shared by every transport.
//
// The integer codes match keras_dist/_vocab.py; keep the two in step.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kd {

enum class DType : int {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUInt8 = 6,
  kInt8 = 7,
  kInt16 = 8,
  kUInt16 = 9,
};
constexpr int kNumDTypes = 10;

enum class Op : int { kSum = 0, kMin = 1, kMax = 2, kProduct = 3 };
constexpr int kNumOps = 4;

inline bool valid_dtype(int code) { return code >= 0 && code < kNumDTypes; }
inline bool valid_op(int code) { return code >= 0 && code < kNumOps; }

// Bytes per element; 0 for an invalid code.
size_t dtype_size(int code);
// "float32", ...; "dtype(<code>)" style text is left to callers for bad codes.
const char* dtype_name(int code);
const char* op_name(int code);

// dst[i] = op(srcs[0][i], srcs[1][i], ..., srcs[nsrcs-1][i]) for i < count,
// combined left to right. float16/bfloat16 accumulate in float32 and round to
// nearest-even once, on the store. dst may be the same pointer as any source
// (not a partial overlap). nsrcs == 0 leaves dst untouched. Codes must be valid.
void reduce_many(void* dst, const void* const* srcs, size_t nsrcs, size_t count,
                 DType dtype, Op op);

// dst[i] = op(dst[i], src[i]).
void reduce_inplace(void* dst, const void* src, size_t count, DType dtype, Op op);

// Turns a sum of `ranks` contributions in `buf` into their average, in place, as
// keras_dist's Python side finishes one (keras_dist/_vocab.py finishing_scale with
// numpy >= 2): floats times the factor 1/ranks rounded to the dtype (float16 and
// bfloat16 computed in float32, rounded once), integers floor-divided by ranks.
void average_inplace(void* buf, size_t count, DType dtype, int ranks);

// dst[i] = src[i] * factor for a floating-point dtype, rounded as
// average_inplace rounds (the factor rounded to float32 for float16, bfloat16
// and float32): numpy >= 2's `src * factor` (keras_dist/_vocab.py
// scale_in_place). dst may be src (exactly), not a partial overlap. Throws
// std::invalid_argument for an integer dtype.
void scale(void* dst, const void* src, size_t count, DType dtype, double factor);

// reduce_many into `dst`, then, when `average_ranks` > 0, average_inplace's
// scaling by it, and, when `copy` is not null, the same result into `copy` too:
// bit for bit what the three calls in turn would write. float32 and float64
// from two aligned sources take one pass; other cases make the three calls.
// `copy` may be a source (exactly), not `dst`.
void reduce_finish(void* dst, void* copy, const void* const* srcs, size_t nsrcs, size_t count,
                   DType dtype, Op op, int average_ranks);

// Name of the kernel family in use: "avx2" or "baseline".
const char* simd_level();
// Tests only: use the baseline kernels even when the CPU has AVX2.
void force_baseline(bool on);

// Exact IEEE round-to-nearest-even conversions (NaN kept, quiet).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bfloat16_to_float(uint16_t b);
uint16_t float_to_bfloat16(float f);

}  // namespace kd
