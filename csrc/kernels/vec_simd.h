// The primitives every SIMD Vec<T> shares, written once: vec_avx2.h,
// vec_avx512.h and vec_neon.h derive their Vec<float> and Vec<double> from
// SimdVec<T, R> (R the ISA's register type) and keep only what differs per
// ISA: set1, fma, max / min (the x86 NaN rule: max(a, b) = b when either is
// NaN), the horizontal reductions and their extras.
//
// Written with the GCC / Clang vector extensions, on the ISA's own register
// types: that is how those compilers define the intrinsics of these
// operations (_mm256_add_ps is `a + b`, _mm512_loadu_ps an unaligned vector
// load, vaddq_f32 `a + b`), so the instructions and the bits are the
// intrinsics'. Every operation is exact or IEEE-rounded lane by lane.
//   zero load store add sub mul
//   select_lt(a, b, x, y) = a < b ? x : y, select_nan(a, x, y) = a NaN ? x : y
//   shift_exponent(r[, bias]) = the bits of r (plus bias, as integers)
//   shifted left by the mantissa width: 2^n from a magic-rounded n
//
// Included by the SIMD headers, inside the kernel source's ISA namespace, with
// kSimdBytes (the register width in bytes) defined; declares Vec<T> and brings
// in vec_math.h (VecMath, ExpFormat) for them: no static data.
#pragma once

#include <cstring>
#include <limits>
#include <type_traits>

template <typename T>
struct Vec;

#include "vec_math.h"

// Unsigned integer lanes of the register width (wrapping adds, logical shifts).
typedef uint32_t SimdU32 __attribute__((vector_size(kSimdBytes)));
typedef uint64_t SimdU64 __attribute__((vector_size(kSimdBytes)));

// Members are templates over the register type R (deduced; zero and load
// take it from Vec<T>::R, complete when they are called), so that the ISA's
// register type is never a template argument (which would drop its
// may_alias attribute).
template <typename T>
struct SimdVec : VecMath<T> {
  static constexpr int W = kSimdBytes / static_cast<int>(sizeof(T));
  using U = std::conditional_t<sizeof(T) == 4, SimdU32, SimdU64>;
  using Bits = typename ExpFormat<T>::Bits;
  static constexpr int kMant = ExpFormat<T>::kMant;

  static auto zero() { return typename Vec<T>::R{}; }
  static auto load(const T* p) {
    typename Vec<T>::R x;
    std::memcpy(&x, p, sizeof(x));
    return x;
  }
  template <typename R>
  static void store(T* p, R x) {
    std::memcpy(p, &x, sizeof(R));
  }
  template <typename R>
  static R add(R a, R b) {
    return a + b;
  }
  template <typename R>
  static R sub(R a, R b) {
    return a - b;
  }
  template <typename R>
  static R mul(R a, R b) {
    return a * b;
  }
  template <typename R>
  static R select_lt(R a, R b, R x, R y) {
    return a < b ? x : y;
  }
  template <typename R>
  static R select_nan(R a, R x, R y) {
    return a != a ? x : y;
  }
  template <typename R>
  static R shift_exponent(R r) {
    return (R)((U)r << kMant);
  }
  template <typename R>
  static R shift_exponent(R r, Bits bias) {
    return (R)(((U)r + static_cast<std::make_unsigned_t<Bits>>(bias)) << kMant);
  }
};
