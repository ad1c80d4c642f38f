// The vector math of the kernels, written once over the Vec<T> primitives of
// the SIMD headers (vec_avx2.h, vec_avx512.h, vec_neon.h): exp and exp2_neg
// for float and double. Included by vec_simd.h right after `template
// <typename T> struct Vec;`, inside the kernel source's ISA namespace (isa.h):
// no static data. The scalar header (vec_scalar.h) uses libm instead.
//
// Primitives used: zero, set1, add, sub, mul, fma, min, max, select_lt,
// select_nan, shift_exponent, hsum (see vec_avx2.h for their meaning).
//
// exp(x): x * log2(e) = n + f with n integer (round to nearest via the
//   1.5 * 2^p magic constant, p = mantissa bits) and |f| <= 0.5; 2^f by the
//   Taylor series of e^(f ln 2) (degree 6 in float, relative error < 1.2e-7,
//   about 1 ulp; degree 12 in double, < 2e-16); 2^n by building the exponent
//   bits. Inputs below the smallest normal exponent give exactly 0, -inf
//   gives 0, +inf and overflow give +inf, NaN stays NaN.
// exp2_neg(t): 2^t for t <= 0 in log2 units (softmax weights:
//   t = (s - m) * log2(e)). t below the smallest exponent gives 0 or a
//   denormal, -inf gives 0, NaN stays NaN (max() passes its second operand
//   through). No upper clamp and no blends: t <= 0 cannot overflow. The
//   exponent is built by one shift: r = t + (1.5 * 2^p + bias) holds n + bias
//   in its low mantissa bits. In float the polynomial has ln 2 folded into
//   its coefficients; double keeps the Taylor series of exp, times ln 2.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

// The constants of exp / exp2_neg that follow from the format of T (IEEE
// binary32 / binary64): the exponent range, and the magic 1.5 * 2^p (p the
// mantissa bits) whose addition rounds to an integer n in the low mantissa
// bits, plus the exponent bias for exp2_neg's shift.
template <typename T>
struct ExpFormat {
  using Bits = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  static constexpr int kMant = std::numeric_limits<T>::digits - 1;        // 23, 52
  static constexpr int kBias = std::numeric_limits<T>::max_exponent - 1;  // 127, 1023
  static constexpr T kLog2e = static_cast<T>(1.442695040888963407359924681L);
  static constexpr T kLn2 = static_cast<T>(0.693147180559945309417232121L);
  static constexpr T kLo = T(-kBias), kHi = T(kBias + 1), kUnderflow = T(1 - kBias);
  static constexpr T kMagic = T(3) * T(Bits(1) << (kMant - 1));  // 1.5 * 2^p
  static constexpr T kMagicBiased = kMagic + T(kBias);
  // The exponent bias minus the magic's bits (exp_poly's shift_exponent).
  static constexpr Bits kExpBias =
      kBias - ((Bits(kMant + kBias) << kMant) | (Bits(1) << (kMant - 1)));
};

// The polynomials per compute type.
template <typename T>
struct ExpConsts;

template <>
struct ExpConsts<float> : ExpFormat<float> {
  static constexpr bool kScaleF = false;  // exp2_neg: ln 2 is in its coefficients
  static constexpr int kTaylorN = 7, kExp2N = 7;
  // Horner order, highest degree first.
  static constexpr float taylor(int i) {
    constexpr float c[kTaylorN] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
    return c[i];
  }
  // exp2_neg_bf16: degree 4 with p(0) = 1 exactly (equal scores get equal, exact
  // weights), minimax relative error 2.9e-6 on [-0.5, 0.5] otherwise (fitted for
  // weights that are rounded to bf16 next, whose ulp is 3.9e-3).
  static constexpr int kExp2Bf16N = 5;
  static constexpr float exp2_bf16(int i) {
    constexpr float c[kExp2Bf16N] = {9.582852945e-03f, 5.590642616e-02f, 2.402409911e-01f,
                                     6.931241751e-01f, 1.f};
    return c[i];
  }
  static constexpr float exp2(int i) {
    constexpr float c[kExp2N] = {1.540353039e-04f,
                                 1.333355815e-03f,
                                 9.618129108e-03f,
                                 5.550410866e-02f,
                                 2.402265070e-01f,
                                 6.931471806e-01f,
                                 1.f};
    return c[i];
  }
};

template <>
struct ExpConsts<double> : ExpFormat<double> {
  static constexpr bool kScaleF = true;  // exp2_neg: f * ln 2, then the Taylor series of exp
  static constexpr int kTaylorN = 13, kExp2N = 13;
  static constexpr double taylor(int i) {
    constexpr double c[kTaylorN] = {1.0 / 479001600,
                                    1.0 / 39916800,
                                    1.0 / 3628800,
                                    1.0 / 362880,
                                    1.0 / 40320,
                                    1.0 / 5040,
                                    1.0 / 720,
                                    1.0 / 120,
                                    1.0 / 24,
                                    1.0 / 6,
                                    0.5,
                                    1.0,
                                    1.0};
    return c[i];
  }
  static constexpr double exp2(int i) { return taylor(i); }
};

// p(f) by Horner's rule, coefficient i = C(i), highest degree first.
template <typename T, int N, typename C>
inline typename Vec<T>::R horner(typename Vec<T>::R f, C coef) {
  using V = Vec<T>;
  typename V::R p = V::set1(coef(0));
#pragma GCC unroll 16
  for (int i = 1; i < N; ++i) p = V::fma(p, f, V::set1(coef(i)));
  return p;
}

template <typename T>
inline typename Vec<T>::R exp_poly(typename Vec<T>::R x) {
  using V = Vec<T>;
  using K = ExpConsts<T>;
  const typename V::R t0 = V::mul(x, V::set1(K::kLog2e));
  const typename V::R t = V::min(V::max(t0, V::set1(K::kLo)), V::set1(K::kHi));
  const typename V::R magic = V::set1(K::kMagic);
  const typename V::R r = V::add(t, magic);
  const typename V::R n = V::sub(r, magic);
  const typename V::R f = V::mul(V::sub(t, n), V::set1(K::kLn2));
  const typename V::R p = horner<T, K::kTaylorN>(f, [](int i) { return K::taylor(i); });
  typename V::R y = V::mul(p, V::shift_exponent(r, K::kExpBias));
  y = V::select_lt(t0, V::set1(K::kUnderflow), V::zero(), y);
  return V::select_nan(t0, t0, y);  // t0 NaN: keep NaN (the clamp turned it into a number)
}

// 2^t for t <= 0 with the polynomial coef(0 .. N-1) of 2^f on [-0.5, 0.5]
// (exp2_neg_poly, exp2_neg_bf16_poly below).
template <typename T, int N, typename C>
inline typename Vec<T>::R exp2_neg_with(typename Vec<T>::R t0, C coef) {
  using V = Vec<T>;
  using K = ExpConsts<T>;
  const typename V::R t = V::max(V::set1(K::kLo), t0);
  const typename V::R magic = V::set1(K::kMagicBiased);
  const typename V::R r = V::add(t, magic);
  typename V::R f = V::sub(t, V::sub(r, magic));
  if constexpr (K::kScaleF) f = V::mul(f, V::set1(K::kLn2));
  const typename V::R p = horner<T, N>(f, coef);
  return V::mul(p, V::shift_exponent(r));
}

template <typename T>
inline typename Vec<T>::R exp2_neg_poly(typename Vec<T>::R t0) {
  using K = ExpConsts<T>;
  return exp2_neg_with<T, K::kExp2N>(t0, [](int i) { return K::exp2(i); });
}

// exp2_neg_poly with the degree-4 polynomial of ExpConsts<float>::exp2_bf16
// (float only: ExpConsts<double> has no exp2_bf16): for softmax weights that are rounded to bf16
// right after (the AMX path's P), 2 FMAs fewer; the same clamps, zeros and NaN as exp2_neg.
template <typename T>
inline typename Vec<T>::R exp2_neg_bf16_poly(typename Vec<T>::R t0) {
  using K = ExpConsts<T>;
  return exp2_neg_with<T, K::kExp2Bf16N>(t0, [](int i) { return K::exp2_bf16(i); });
}

// The math members every SIMD Vec<T> inherits (struct Vec<T> : VecMath<T>):
// V::exp and V::exp2_neg above, and a four-way horizontal sum by hsum (a
// Vec<T> may declare a faster hsum4 of its own, which hides this one).
// Templates over the register type, so that Vec<T> need not be complete here.
template <typename T>
struct VecMath {
  template <typename R>
  static R exp(R x) {
    return exp_poly<T>(x);
  }
  template <typename R>
  static R exp2_neg(R t) {
    return exp2_neg_poly<T>(t);
  }
  template <typename R>
  static R exp2_neg_bf16(R t) {
    return exp2_neg_bf16_poly<T>(t);
  }
  template <typename R>
  static void hsum4(const R* a, T* out) {
    for (int i = 0; i < 4; ++i) out[i] = Vec<T>::hsum(a[i]);
  }
};

#if defined(ATTN_ISA_AVX2) || defined(ATTN_ISA_AVX512)
// One 16-bit value <-> fp32, the same on every x86 SIMD ISA (both have F16C):
// bf16 by bit manipulation (attn_fast/half.h: round to nearest even, NaN
// kept), fp16 by vcvtph2ps / vcvtps2ph. Vec<float> inherits these.
struct HalfScalar {
  static float from_bf16(uint16_t h) { return bf16_to_f32(h); }
  static float from_f16(uint16_t h) { return _cvtsh_ss(h); }
  static uint16_t to_bf16(float x) { return f32_to_bf16(x); }
  static uint16_t to_f16(float x) {
    return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
#endif  // x86 (vec_neon.h has its own HalfNeon)
