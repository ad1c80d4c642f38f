// AVX2 + FMA vectors: 8 floats / 4 doubles per register, 16 registers.
#pragma once
#include <immintrin.h>

template <typename T>
struct Vec;

// exp(x) for the softmax: x * log2(e) = n + f with n integer (round to nearest
// via the 1.5 * 2^23 magic constant) and |f| <= 0.5; 2^f by its Taylor series
// to degree 6 (relative error < 1.2e-7, about 1 ulp); 2^n by building the
// exponent bits. Inputs below -87.3 (t < -126) give exactly 0, -inf gives 0,
// +inf and overflow give +inf, NaN stays NaN.
template <>
struct Vec<float> {
  static constexpr int W = 8;
  using R = __m256;
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static float hmax(R a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  static float hsum(R a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  static R exp(R x) {
    const R t0 = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const R t = _mm256_min_ps(_mm256_max_ps(t0, _mm256_set1_ps(-127.f)), _mm256_set1_ps(128.f));
    const R magic = _mm256_set1_ps(12582912.f);  // 1.5 * 2^23
    const R r = _mm256_add_ps(t, magic);
    const R n = _mm256_sub_ps(r, magic);
    const R f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
    R p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_castps_si256(r), _mm256_set1_epi32(127 - 0x4B400000)), 23);
    R y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(),
                         _mm256_cmp_ps(t0, _mm256_set1_ps(-126.f), _CMP_LT_OQ));
    // t0 NaN: keep NaN (the clamp above turned it into a number).
    return _mm256_blendv_ps(y, t0, _mm256_cmp_ps(t0, t0, _CMP_UNORD_Q));
  }
  // 2^t for t <= 0 in log2 units (softmax weights: t = (s - m) * log2(e)).
  // The polynomial of exp() with ln 2 folded into the coefficients; t < -126
  // gives 0 or a denormal, -inf gives 0, NaN stays NaN (max() passes its
  // second operand through). No upper clamp and no blends: t <= 0 cannot
  // overflow. The exponent is built by one shift: r = t + (1.5 * 2^23 + 127)
  // holds n + 127 in its low mantissa bits.
  static R exp2_neg(R t0) {
    const R t = _mm256_max_ps(_mm256_set1_ps(-127.f), t0);
    const R magic = _mm256_set1_ps(12583039.f);  // 1.5 * 2^23 + 127
    const R r = _mm256_add_ps(t, magic);
    const R f = _mm256_sub_ps(t, _mm256_sub_ps(r, magic));
    R p = _mm256_set1_ps(1.540353039e-04f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.333355815e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129108e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866e-02f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265070e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471806e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(r), 23)));
  }
  // 16-bit storage <-> fp32, W elements: bf16 widens by a 16-bit shift and
  // narrows with round to nearest even (NaN kept NaN, quieted); fp16 by F16C.
  static R load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static R load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_bf16(uint16_t* p, R x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(qnan),
                                             _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store_f16(uint16_t* p, R x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static float from_bf16(uint16_t h) { return bf16_to_f32(h); }
  static float from_f16(uint16_t h) { return _cvtsh_ss(h); }
  static uint16_t to_bf16(float x) { return f32_to_bf16(x); }
  static uint16_t to_f16(float x) {
    return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

// Same scheme in double: magic 1.5 * 2^52, Taylor series of 2^f to degree 12
// (relative error < 2e-16).
template <>
struct Vec<double> {
  static constexpr int W = 4;
  using R = __m256d;
  static R zero() { return _mm256_setzero_pd(); }
  static R set1(double x) { return _mm256_set1_pd(x); }
  static R load(const double* p) { return _mm256_loadu_pd(p); }
  static void store(double* p, R x) { _mm256_storeu_pd(p, x); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_pd(a, b, c); }
  static R mul(R a, R b) { return _mm256_mul_pd(a, b); }
  static R add(R a, R b) { return _mm256_add_pd(a, b); }
  static R sub(R a, R b) { return _mm256_sub_pd(a, b); }
  static R max(R a, R b) { return _mm256_max_pd(a, b); }
  static double hmax(R a) {
    __m128d x = _mm_max_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    x = _mm_max_sd(x, _mm_unpackhi_pd(x, x));
    return _mm_cvtsd_f64(x);
  }
  static double hsum(R a) {
    __m128d x = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    x = _mm_add_sd(x, _mm_unpackhi_pd(x, x));
    return _mm_cvtsd_f64(x);
  }
  static R exp(R x) {
    const R t0 = _mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634074));
    const R t = _mm256_min_pd(_mm256_max_pd(t0, _mm256_set1_pd(-1023.)), _mm256_set1_pd(1024.));
    const R magic = _mm256_set1_pd(6755399441055744.0);  // 1.5 * 2^52
    const R r = _mm256_add_pd(t, magic);
    const R n = _mm256_sub_pd(r, magic);
    const R f = _mm256_mul_pd(_mm256_sub_pd(t, n), _mm256_set1_pd(0.69314718055994530942));
    R p = _mm256_set1_pd(1.0 / 479001600);
    const double c[12] = {1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320,
                          1.0 / 5040,     1.0 / 720,     1.0 / 120,    1.0 / 24,
                          1.0 / 6,        0.5,           1.0,          1.0};
    for (double ci : c) p = _mm256_fmadd_pd(p, f, _mm256_set1_pd(ci));
    const __m256i e = _mm256_slli_epi64(
        _mm256_add_epi64(_mm256_castpd_si256(r), _mm256_set1_epi64x(1023 - 0x4338000000000000LL)),
        52);
    R y = _mm256_mul_pd(p, _mm256_castsi256_pd(e));
    y = _mm256_blendv_pd(y, _mm256_setzero_pd(),
                         _mm256_cmp_pd(t0, _mm256_set1_pd(-1022.), _CMP_LT_OQ));
    return _mm256_blendv_pd(y, t0, _mm256_cmp_pd(t0, t0, _CMP_UNORD_Q));
  }
  // 2^t for t <= 0 (see Vec<float>::exp2_neg); r = t + (1.5 * 2^52 + 1023).
  static R exp2_neg(R t0) {
    const R t = _mm256_max_pd(_mm256_set1_pd(-1023.), t0);
    const R magic = _mm256_set1_pd(6755399441056767.0);  // 1.5 * 2^52 + 1023
    const R r = _mm256_add_pd(t, magic);
    const R f = _mm256_mul_pd(_mm256_sub_pd(t, _mm256_sub_pd(r, magic)),
                              _mm256_set1_pd(0.69314718055994530942));
    R p = _mm256_set1_pd(1.0 / 479001600);
    const double c[12] = {1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320,
                          1.0 / 5040,     1.0 / 720,     1.0 / 120,    1.0 / 24,
                          1.0 / 6,        0.5,           1.0,          1.0};
    for (double ci : c) p = _mm256_fmadd_pd(p, f, _mm256_set1_pd(ci));
    return _mm256_mul_pd(p, _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(r), 52)));
  }
};
