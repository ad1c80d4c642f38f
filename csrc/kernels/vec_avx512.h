// AVX-512 F/BW/VL/DQ vectors: 16 floats / 8 doubles per register, 32 registers.
// exp() follows the same scheme as vec_avx2.h (see there for the accuracy).
#pragma once
#include <immintrin.h>

template <typename T>
struct Vec;

template <>
struct Vec<float> {
  static constexpr int W = 16;
  using R = __m512;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static float hmax(R a) { return _mm512_reduce_max_ps(a); }
  static float hsum(R a) { return _mm512_reduce_add_ps(a); }
  static R exp(R x) {
    const R t0 = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const R t = _mm512_min_ps(_mm512_max_ps(t0, _mm512_set1_ps(-127.f)), _mm512_set1_ps(128.f));
    const R magic = _mm512_set1_ps(12582912.f);
    const R r = _mm512_add_ps(t, magic);
    const R n = _mm512_sub_ps(r, magic);
    const R f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    R p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_castps_si512(r), _mm512_set1_epi32(127 - 0x4B400000)), 23);
    R y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t0, _mm512_set1_ps(-126.f), _CMP_LT_OQ), y,
                             _mm512_setzero_ps());
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t0, t0, _CMP_UNORD_Q), y, t0);
  }
  // 2^t for t <= 0 in log2 units (softmax weights: t = (s - m) * log2(e)).
  // The polynomial of exp() with ln 2 folded into the coefficients; t < -126
  // gives 0 or a denormal, -inf gives 0, NaN stays NaN (max() passes its
  // second operand through). No upper clamp and no blends: t <= 0 cannot
  // overflow. The exponent is built by one shift: r = t + (1.5 * 2^23 + 127)
  // holds n + 127 in its low mantissa bits.
  static R exp2_neg(R t0) {
    const R t = _mm512_max_ps(_mm512_set1_ps(-127.f), t0);
    const R magic = _mm512_set1_ps(12583039.f);  // 1.5 * 2^23 + 127
    const R r = _mm512_add_ps(t, magic);
    const R f = _mm512_sub_ps(t, _mm512_sub_ps(r, magic));
    R p = _mm512_set1_ps(1.540353039e-04f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.333355815e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129108e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265070e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471806e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(r), 23)));
  }
  // 16-bit storage <-> fp32, W elements: bf16 widens by a 16-bit shift and
  // narrows with round to nearest even (NaN kept NaN, quieted; denormals kept,
  // unlike vcvtneps2bf16); fp16 by vcvtph2ps / vcvtps2ph.
  static R load_bf16(const uint16_t* p) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static R load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_bf16(uint16_t* p, R x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store_f16(uint16_t* p, R x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static float from_bf16(uint16_t h) { return bf16_to_f32(h); }
  static float from_f16(uint16_t h) { return _cvtsh_ss(h); }
  static uint16_t to_bf16(float x) { return f32_to_bf16(x); }
  static uint16_t to_f16(float x) {
    return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

template <>
struct Vec<double> {
  static constexpr int W = 8;
  using R = __m512d;
  static R zero() { return _mm512_setzero_pd(); }
  static R set1(double x) { return _mm512_set1_pd(x); }
  static R load(const double* p) { return _mm512_loadu_pd(p); }
  static void store(double* p, R x) { _mm512_storeu_pd(p, x); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_pd(a, b, c); }
  static R mul(R a, R b) { return _mm512_mul_pd(a, b); }
  static R add(R a, R b) { return _mm512_add_pd(a, b); }
  static R sub(R a, R b) { return _mm512_sub_pd(a, b); }
  static R max(R a, R b) { return _mm512_max_pd(a, b); }
  static double hmax(R a) { return _mm512_reduce_max_pd(a); }
  static double hsum(R a) { return _mm512_reduce_add_pd(a); }
  static R exp(R x) {
    const R t0 = _mm512_mul_pd(x, _mm512_set1_pd(1.4426950408889634074));
    const R t = _mm512_min_pd(_mm512_max_pd(t0, _mm512_set1_pd(-1023.)), _mm512_set1_pd(1024.));
    const R magic = _mm512_set1_pd(6755399441055744.0);
    const R r = _mm512_add_pd(t, magic);
    const R n = _mm512_sub_pd(r, magic);
    const R f = _mm512_mul_pd(_mm512_sub_pd(t, n), _mm512_set1_pd(0.69314718055994530942));
    R p = _mm512_set1_pd(1.0 / 479001600);
    p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(1.0 / 39916800));
    p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(1.0 / 3628800));
    p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(1.0 / 362880));
    p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(1.0 / 40320));
    p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(1.0 / 5040));
    p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(1.0 / 720));
    p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(1.0 / 120));
    p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(1.0 / 24));
    p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(1.0 / 6));
    p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(0.5));
    p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(1.0));
    p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(1.0));
    const __m512i e = _mm512_slli_epi64(
        _mm512_add_epi64(_mm512_castpd_si512(r), _mm512_set1_epi64(1023 - 0x4338000000000000LL)),
        52);
    R y = _mm512_mul_pd(p, _mm512_castsi512_pd(e));
    y = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(t0, _mm512_set1_pd(-1022.), _CMP_LT_OQ), y,
                             _mm512_setzero_pd());
    return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(t0, t0, _CMP_UNORD_Q), y, t0);
  }
  // 2^t for t <= 0 (see Vec<float>::exp2_neg); r = t + (1.5 * 2^52 + 1023).
  static R exp2_neg(R t0) {
    const R t = _mm512_max_pd(_mm512_set1_pd(-1023.), t0);
    const R magic = _mm512_set1_pd(6755399441056767.0);  // 1.5 * 2^52 + 1023
    const R r = _mm512_add_pd(t, magic);
    const R f = _mm512_mul_pd(_mm512_sub_pd(t, _mm512_sub_pd(r, magic)),
                              _mm512_set1_pd(0.69314718055994530942));
    R p = _mm512_set1_pd(1.0 / 479001600);
    const double c[12] = {1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320,
                          1.0 / 5040,     1.0 / 720,     1.0 / 120,    1.0 / 24,
                          1.0 / 6,        0.5,           1.0,          1.0};
    for (double ci : c) p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(ci));
    return _mm512_mul_pd(p, _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_castpd_si512(r), 52)));
  }
};
