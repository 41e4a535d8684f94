// Reduction kernels: a baseline family the compiler vectorises for the ISA the
// module is built for, and an AVX2+F16C family compiled with target attributes,
// chosen at run time with __builtin_cpu_supports. Each kernel walks the data in
// blocks of kBlock elements held in an L1-resident accumulator, so any number
// of sources is combined in one pass with one rounding for the half types.
#include "reduce.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KD_X86 1
#else
#define KD_X86 0
#endif

#define KD_INLINE inline __attribute__((always_inline))

namespace kd {
namespace {

constexpr size_t kBlock = 512;

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- scalar conversions (exact) -------------------------------------------

KD_INLINE float h2f(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float.
    const float mag = float(mant) * 5.9604644775390625e-8f;
    return float_of(sign | bits_of(mag));
  }
  if (exp == 31) return float_of(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0));
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

KD_INLINE uint16_t f2h(float f) {
  uint32_t x = bits_of(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) {  // inf or NaN (quieted, top payload bits kept)
    if (x == 0x7f800000u) return sign | 0x7c00u;
    return uint16_t(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  }
  const uint32_t e = x >> 23;
  if (e >= 143) return sign | 0x7c00u;  // >= 2^16: overflow
  if (e >= 113) {                        // normal half
    uint32_t r = ((e - 112u) << 10) | ((x >> 13) & 0x3ffu);
    const uint32_t rem = x & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;  // carry may give inf
    return uint16_t(sign | r);
  }
  if (e < 102) return sign;  // below 2^-25: rounds to zero
  const uint32_t m = (x & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  uint32_t r = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (r & 1u))) ++r;  // may reach min normal
  return uint16_t(sign | r);
}

KD_INLINE float b2f(uint16_t b) { return float_of(uint32_t(b) << 16); }

KD_INLINE uint16_t f2b(float f) {
  const uint32_t x = bits_of(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // quiet NaN
  const uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
  return uint16_t(rounded >> 16);
}

// ---- combine ---------------------------------------------------------------

template <class T>
struct Wide {  // arithmetic type that wraps instead of overflowing (no UB)
  using type = T;
};
template <>
struct Wide<int32_t> {
  using type = uint32_t;
};
template <>
struct Wide<int64_t> {
  using type = uint64_t;
};
template <>
struct Wide<uint8_t> {
  using type = uint32_t;
};
template <>
struct Wide<int8_t> {
  using type = uint32_t;
};
template <>
struct Wide<int16_t> {
  using type = uint32_t;
};
template <>
struct Wide<uint16_t> {
  using type = uint32_t;
};

template <Op op, class T>
KD_INLINE T combine(T a, T b) {
  using W = typename Wide<T>::type;
  if constexpr (op == Op::kSum) {
    return T(W(a) + W(b));
  } else if constexpr (op == Op::kProduct) {
    return T(W(a) * W(b));
  } else if constexpr (op == Op::kMin) {
    if constexpr (std::is_floating_point_v<T>) return (a < b || a != a) ? a : b;  // NaN wins
    else return a < b ? a : b;
  } else {
    if constexpr (std::is_floating_point_v<T>) return (a > b || a != a) ? a : b;
    else return a > b ? a : b;
  }
}

// ---- codecs: how a block moves between memory and the accumulator ---------

// Types reduced in their own precision. Loads go through memcpy so unaligned
// buffers are fine; the aligned case combines straight from the source.
template <class T>
struct NativeCodec {
  using Acc = T;
  static KD_INLINE void load(const void* src, size_t base, Acc* acc, size_t n) {
    std::memcpy(acc, static_cast<const T*>(src) + base, n * sizeof(T));
  }
  template <Op op>
  static KD_INLINE void combine_from(const void* src, size_t base, Acc* __restrict acc, Acc* tmp,
                                     size_t n) {
    const T* p = static_cast<const T*>(src) + base;
    if (reinterpret_cast<uintptr_t>(p) % alignof(T) == 0) {
      for (size_t i = 0; i < n; ++i) acc[i] = combine<op>(acc[i], p[i]);
    } else {
      std::memcpy(tmp, p, n * sizeof(T));
      for (size_t i = 0; i < n; ++i) acc[i] = combine<op>(acc[i], tmp[i]);
    }
  }
  static KD_INLINE void store(void* dst, size_t base, const Acc* acc, size_t n) {
    std::memcpy(static_cast<T*>(dst) + base, acc, n * sizeof(T));
  }
};

template <bool kBF16>
struct HalfCodecScalar {
  using Acc = float;
  static KD_INLINE void load(const void* src, size_t base, float* acc, size_t n) {
    const uint8_t* p = static_cast<const uint8_t*>(src) + 2 * base;
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      acc[i] = kBF16 ? b2f(h) : h2f(h);
    }
  }
  template <Op op>
  static KD_INLINE void combine_from(const void* src, size_t base, float* __restrict acc,
                                     float* tmp, size_t n) {
    load(src, base, tmp, n);
    for (size_t i = 0; i < n; ++i) acc[i] = combine<op>(acc[i], tmp[i]);
  }
  static KD_INLINE void store(void* dst, size_t base, const float* acc, size_t n) {
    uint8_t* p = static_cast<uint8_t*>(dst) + 2 * base;
    for (size_t i = 0; i < n; ++i) {
      const uint16_t h = kBF16 ? f2b(acc[i]) : f2h(acc[i]);
      std::memcpy(p + 2 * i, &h, 2);
    }
  }
};

template <class Codec, Op op>
KD_INLINE void reduce_blocks(void* dst, const void* const* srcs, size_t nsrcs, size_t count) {
  using Acc = typename Codec::Acc;
  alignas(64) Acc acc[kBlock];
  alignas(64) Acc tmp[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    Codec::load(srcs[0], base, acc, n);
    for (size_t s = 1; s < nsrcs; ++s) Codec::template combine_from<op>(srcs[s], base, acc, tmp, n);
    Codec::store(dst, base, acc, n);
  }
}

// Two aligned native sources: one streaming loop, no accumulator block.
template <class T, Op op>
KD_INLINE bool reduce_pair_direct(void* dst, const void* const* srcs, size_t nsrcs, size_t count) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % alignof(T) == 0; };
  if (nsrcs != 2 || !aligned(dst) || !aligned(srcs[0]) || !aligned(srcs[1])) return false;
  T* d = static_cast<T*>(dst);
  const T* a = static_cast<const T*>(srcs[0]);
  const T* b = static_cast<const T*>(srcs[1]);
  // d may equal a or b exactly: each element is read before it is written.
  for (size_t i = 0; i < count; ++i) d[i] = combine<op>(a[i], b[i]);
  return true;
}

using Kernel = void (*)(void*, const void* const*, size_t, size_t);

// reduce_finish in one pass: two aligned sources of a native float type into
// `dst` and `copy`, scaled by 1/ranks as average_inplace scales (the factor
// rounded to T once). Each element is read before either store, so `copy`
// may be a source.
template <class T, Op op>
KD_INLINE bool finish_pair_direct(void* dst, void* copy, const void* const* srcs, size_t nsrcs,
                                  size_t count, int ranks) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % alignof(T) == 0; };
  if (nsrcs != 2 || !copy || !aligned(dst) || !aligned(copy) || !aligned(srcs[0]) ||
      !aligned(srcs[1])) {
    return false;
  }
  T* d = static_cast<T*>(dst);
  T* c = static_cast<T*>(copy);
  const T* a = static_cast<const T*>(srcs[0]);
  const T* b = static_cast<const T*>(srcs[1]);
  if (ranks > 0) {
    const T factor = T(1.0 / double(ranks));
    for (size_t i = 0; i < count; ++i) {
      const T v = combine<op>(a[i], b[i]) * factor;
      d[i] = v;
      c[i] = v;
    }
  } else {
    for (size_t i = 0; i < count; ++i) {
      const T v = combine<op>(a[i], b[i]);
      d[i] = v;
      c[i] = v;
    }
  }
  return true;
}

using FinishKernel = bool (*)(void*, void*, const void* const*, size_t, size_t, int);

template <class T, Op op>
bool finish_base(void* dst, void* copy, const void* const* srcs, size_t nsrcs, size_t count,
                 int ranks) {
  return finish_pair_direct<T, op>(dst, copy, srcs, nsrcs, count, ranks);
}

template <class T, Op op>
void native_base(void* dst, const void* const* srcs, size_t nsrcs, size_t count) {
  if (reduce_pair_direct<T, op>(dst, srcs, nsrcs, count)) return;
  reduce_blocks<NativeCodec<T>, op>(dst, srcs, nsrcs, count);
}

template <bool kBF16, Op op>
void half_base(void* dst, const void* const* srcs, size_t nsrcs, size_t count) {
  reduce_blocks<HalfCodecScalar<kBF16>, op>(dst, srcs, nsrcs, count);
}

#if KD_X86
#define KD_AVX2 __attribute__((target("avx2,f16c")))

// float16 with F16C: 8 lanes per instruction, scalar tail. Called (not inlined)
// once per block from the generic loop, which has no target attribute.
struct HalfCodecF16C {
  using Acc = float;
  static KD_AVX2 void load(const void* src, size_t base, float* acc, size_t n) {
    const uint8_t* p = static_cast<const uint8_t*>(src) + 2 * base;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
      _mm256_store_ps(acc + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      acc[i] = h2f(h);
    }
  }
  template <Op op>
  static KD_AVX2 void combine_from(const void* src, size_t base, float* __restrict acc,
                                             float* tmp, size_t n) {
    load(src, base, tmp, n);
    for (size_t i = 0; i < n; ++i) acc[i] = combine<op>(acc[i], tmp[i]);
  }
  static KD_AVX2 void store(void* dst, size_t base, const float* acc, size_t n) {
    uint8_t* p = static_cast<uint8_t*>(dst) + 2 * base;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm256_cvtps_ph(_mm256_load_ps(acc + i), _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 2 * i), h);
    }
    for (; i < n; ++i) {
      const uint16_t h = f2h(acc[i]);
      std::memcpy(p + 2 * i, &h, 2);
    }
  }
};

template <class T, Op op>
KD_AVX2 void native_avx2(void* dst, const void* const* srcs, size_t nsrcs, size_t count) {
  if (reduce_pair_direct<T, op>(dst, srcs, nsrcs, count)) return;
  reduce_blocks<NativeCodec<T>, op>(dst, srcs, nsrcs, count);
}

template <class T, Op op>
KD_AVX2 bool finish_avx2(void* dst, void* copy, const void* const* srcs, size_t nsrcs,
                         size_t count, int ranks) {
  return finish_pair_direct<T, op>(dst, copy, srcs, nsrcs, count, ranks);
}

template <Op op>
KD_AVX2 void f16_avx2(void* dst, const void* const* srcs, size_t nsrcs, size_t count) {
  reduce_blocks<HalfCodecF16C, op>(dst, srcs, nsrcs, count);
}

template <Op op>
KD_AVX2 void bf16_avx2(void* dst, const void* const* srcs, size_t nsrcs, size_t count) {
  reduce_blocks<HalfCodecScalar<true>, op>(dst, srcs, nsrcs, count);
}
#endif

#define KD_ROW(FN, ...) \
  { FN<__VA_ARGS__ Op::kSum>, FN<__VA_ARGS__ Op::kMin>, FN<__VA_ARGS__ Op::kMax>, FN<__VA_ARGS__ Op::kProduct> }

const Kernel kBaseline[kNumDTypes][kNumOps] = {
    KD_ROW(half_base, false,), KD_ROW(half_base, true,),  KD_ROW(native_base, float,),
    KD_ROW(native_base, double,), KD_ROW(native_base, int32_t,), KD_ROW(native_base, int64_t,),
    KD_ROW(native_base, uint8_t,), KD_ROW(native_base, int8_t,), KD_ROW(native_base, int16_t,),
    KD_ROW(native_base, uint16_t,),
};

// One-pass reduce_finish kernels: float32, float64.
const FinishKernel kFinishBaseline[2][kNumOps] = {KD_ROW(finish_base, float,),
                                                  KD_ROW(finish_base, double,)};

#if KD_X86
const FinishKernel kFinishAvx2[2][kNumOps] = {KD_ROW(finish_avx2, float,),
                                              KD_ROW(finish_avx2, double,)};

const Kernel kAvx2[kNumDTypes][kNumOps] = {
    KD_ROW(f16_avx2, ), KD_ROW(bf16_avx2, ), KD_ROW(native_avx2, float,),
    KD_ROW(native_avx2, double,), KD_ROW(native_avx2, int32_t,), KD_ROW(native_avx2, int64_t,),
    KD_ROW(native_avx2, uint8_t,), KD_ROW(native_avx2, int8_t,), KD_ROW(native_avx2, int16_t,),
    KD_ROW(native_avx2, uint16_t,),
};

bool cpu_has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return has;
}
#endif

std::atomic<bool> g_force_baseline{false};

// Whether the AVX2 (+F16C) kernels serve: the CPU has them and tests have
// not asked for the baseline ones.
bool use_avx2() {
#if KD_X86
  return !g_force_baseline.load(std::memory_order_relaxed) && cpu_has_avx2();
#else
  return false;
#endif
}

const Kernel (*kernel_table())[kNumOps] {
#if KD_X86
  if (use_avx2()) return kAvx2;
#endif
  return kBaseline;
}

const FinishKernel (*finish_table())[kNumOps] {
#if KD_X86
  if (use_avx2()) return kFinishAvx2;
#endif
  return kFinishBaseline;
}

}  // namespace

size_t dtype_size(int code) {
  static const size_t sizes[kNumDTypes] = {2, 2, 4, 8, 4, 8, 1, 1, 2, 2};
  return valid_dtype(code) ? sizes[code] : 0;
}

const char* dtype_name(int code) {
  static const char* names[kNumDTypes] = {"float16", "bfloat16", "float32", "float64",
                                          "int32",   "int64",    "uint8",   "int8",
                                          "int16",   "uint16"};
  return valid_dtype(code) ? names[code] : "unknown";
}

const char* op_name(int code) {
  static const char* names[kNumOps] = {"sum", "min", "max", "product"};
  return valid_op(code) ? names[code] : "unknown";
}

void reduce_many(void* dst, const void* const* srcs, size_t nsrcs, size_t count, DType dtype,
                 Op op) {
  if (nsrcs == 0 || count == 0) return;
  kernel_table()[int(dtype)][int(op)](dst, srcs, nsrcs, count);
}

void reduce_finish(void* dst, void* copy, const void* const* srcs, size_t nsrcs, size_t count,
                   DType dtype, Op op, int average_ranks) {
  if (nsrcs == 0 || count == 0) return;
  if ((dtype == DType::kFloat32 || dtype == DType::kFloat64) &&
      finish_table()[dtype == DType::kFloat64][int(op)](dst, copy, srcs, nsrcs, count,
                                                          average_ranks)) {
    return;
  }
  reduce_many(dst, srcs, nsrcs, count, dtype, op);
  if (average_ranks > 0) average_inplace(dst, count, dtype, average_ranks);
  if (copy && copy != dst) std::memcpy(copy, dst, count * dtype_size(int(dtype)));
}

void reduce_inplace(void* dst, const void* src, size_t count, DType dtype, Op op) {
  const void* srcs[2] = {dst, src};
  reduce_many(dst, srcs, 2, count, dtype, op);
}

const char* simd_level() { return use_avx2() ? "avx2" : "baseline"; }

void force_baseline(bool on) { g_force_baseline.store(on, std::memory_order_relaxed); }

namespace {
// The scaling kernels write dst[i] = src[i] * factor, each element read
// before it is written: dst may be src (exactly), not a partial overlap.
template <typename T>
void scale_floats(void* dst, const void* src, size_t count, T factor) {
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  for (size_t i = 0; i < count; ++i) d[i] = s[i] * factor;
}

template <typename T>
void floor_divide(void* buf, size_t count, int ranks) {
  T* v = static_cast<T*>(buf);
  const T d = T(ranks);
  for (size_t i = 0; i < count; ++i) {
    T q = T(v[i] / d);
    if (std::is_signed<T>::value && v[i] % d != 0 && v[i] < 0) --q;  // toward -inf, as numpy
    v[i] = q;
  }
}

template <uint16_t (*to_half)(float), float (*from_half)(uint16_t)>
void scale_halves(void* dst, const void* src, size_t count, float factor) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  const uint16_t* s = static_cast<const uint16_t*>(src);
  for (size_t i = 0; i < count; ++i) d[i] = to_half(from_half(s[i]) * factor);
}
#if KD_X86
// float16 times `factor` with F16C, 8 lanes at a time: the same bits as
// scale_halves (exact conversions, one float32 multiply, round to nearest even).
KD_AVX2 void scale_halves_f16c(void* dst, const void* src, size_t count, float factor) {
  uint8_t* p = static_cast<uint8_t*>(dst);
  const uint8_t* q = static_cast<const uint8_t*>(src);
  const __m256 f = _mm256_set1_ps(factor);
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2 * i));
    const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(h), f);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 2 * i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < count; ++i) {
    uint16_t h;
    std::memcpy(&h, q + 2 * i, 2);
    h = f2h(h2f(h) * factor);
    std::memcpy(p + 2 * i, &h, 2);
  }
}

// bfloat16 times `factor`, 8 lanes at a time: the same bits as scale_halves
// with f2b (round to nearest even on the float32 bits, a NaN kept quiet).
KD_AVX2 void scale_bfloat16_avx2(void* dst, const void* src, size_t count, float factor) {
  uint8_t* p = static_cast<uint8_t*>(dst);
  const uint8_t* q = static_cast<const uint8_t*>(src);
  const __m256 f = _mm256_set1_ps(factor);
  const __m256i one = _mm256_set1_epi32(1), half_ulp = _mm256_set1_epi32(0x7fff);
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2 * i));
    const __m256 x = _mm256_mul_ps(
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)), f);
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i high = _mm256_srli_epi32(bits, 16);
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(bits, half_ulp), _mm256_and_si256(high, one)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, magnitude), inf);
    const __m256i out = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, quiet), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 2 * i),
                     _mm_packus_epi32(_mm256_castsi256_si128(out),
                                      _mm256_extracti128_si256(out, 1)));
  }
  for (; i < count; ++i) {
    uint16_t h;
    std::memcpy(&h, q + 2 * i, 2);
    h = f2b(b2f(h) * factor);
    std::memcpy(p + 2 * i, &h, 2);
  }
}
#endif

uint16_t f2h_fn(float f) { return f2h(f); }
float h2f_fn(uint16_t h) { return h2f(h); }
uint16_t f2b_fn(float f) { return f2b(f); }
float b2f_fn(uint16_t b) { return b2f(b); }
}  // namespace

void scale(void* dst, const void* src, size_t count, DType dtype, double factor) {
  const float f = float(factor);
  switch (dtype) {
#if KD_X86
    case DType::kFloat16:
      return use_avx2() ? scale_halves_f16c(dst, src, count, f)
                        : scale_halves<f2h_fn, h2f_fn>(dst, src, count, f);
    case DType::kBFloat16:
      return use_avx2() ? scale_bfloat16_avx2(dst, src, count, f)
                        : scale_halves<f2b_fn, b2f_fn>(dst, src, count, f);
#else
    case DType::kFloat16: return scale_halves<f2h_fn, h2f_fn>(dst, src, count, f);
    case DType::kBFloat16: return scale_halves<f2b_fn, b2f_fn>(dst, src, count, f);
#endif
    case DType::kFloat32: return scale_floats<float>(dst, src, count, f);
    case DType::kFloat64: return scale_floats<double>(dst, src, count, factor);
    default:
      throw std::invalid_argument("scale: a floating-point dtype was expected. Received: "
                                  "dtype code " + std::to_string(int(dtype)));
  }
}

void average_inplace(void* buf, size_t count, DType dtype, int ranks) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kFloat32:
    case DType::kFloat64: return scale(buf, buf, count, dtype, 1.0 / double(ranks));
    case DType::kInt32: return floor_divide<int32_t>(buf, count, ranks);
    case DType::kInt64: return floor_divide<int64_t>(buf, count, ranks);
    case DType::kUInt8: return floor_divide<uint8_t>(buf, count, ranks);
    case DType::kInt8: return floor_divide<int8_t>(buf, count, ranks);
    case DType::kInt16: return floor_divide<int16_t>(buf, count, ranks);
    case DType::kUInt16: return floor_divide<uint16_t>(buf, count, ranks);
  }
}

float half_to_float(uint16_t h) { return h2f(h); }
uint16_t float_to_half(float f) { return f2h(f); }
float bfloat16_to_float(uint16_t b) { return b2f(b); }
uint16_t float_to_bfloat16(float f) { return f2b(f); }

}  // namespace kd
