// AVX2 + FMA vectors: 8 floats / 4 doubles per register, 16 registers.
//
// The vector layer of one ISA: the register type and its primitives, the
// tile shapes of the micro-kernels (IsaTraits) and nothing else. The
// primitives every SIMD ISA shares (zero load store add sub mul select_lt
// select_nan shift_exponent) are vec_simd.h, the math over the primitives
// (exp, exp2_neg) is vec_math.h. Here, per Vec<T> (W lanes of T in one R):
//   set1, fma(a, b, c) = a * b + c, min max (the x86 rule: max(a, b) = b when
//   either is NaN); hmax hsum (one register to a scalar) and hsum4 (four
//   registers to four sums at once); Vec<float> only: W int8 codes and W
//   16-bit values (bf16, fp16) to and from fp32.
#pragma once
#include <immintrin.h>

// Register blocking of the fused kernels' micro-tiles (flash_fwd.cpp,
// flash_bwd.cpp): MR rows x NR vectors, 12 accumulators of 16 ymm.
struct IsaTraits {
  static constexpr int kMR = 6, kNR = 2;
  static constexpr int kRegs = 16;  // vector registers
};

constexpr int kSimdBytes = 32;
#include "vec_simd.h"

template <>
struct Vec<float> : SimdVec<float>, HalfScalar {
  using R = __m256;
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static R min(R a, R b) { return _mm256_min_ps(a, b); }
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
  static void hsum4(const R* a, float* out) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);  // a01 a23 b01 b23 | a45 a67 b45 b67
    const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(t0, t1);  // a0-3 b0-3 c0-3 d0-3 | a4-7 ...
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1)));
  }
  // W int8 codes, sign-extended and converted to fp32 (the int8 KV cache).
  static R load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
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
};

template <>
struct Vec<double> : SimdVec<double> {
  using R = __m256d;
  static R set1(double x) { return _mm256_set1_pd(x); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_pd(a, b, c); }
  static R max(R a, R b) { return _mm256_max_pd(a, b); }
  static R min(R a, R b) { return _mm256_min_pd(a, b); }
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
};
