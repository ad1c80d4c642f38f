// AVX-512 F/BW/VL/DQ vectors: 16 floats / 8 doubles per register, 32 registers.
// The primitives of vec_avx2.h (see there), on zmm registers; those every
// SIMD ISA shares are vec_simd.h, the math over them vec_math.h.
#pragma once
#include <immintrin.h>

// Register blocking of the fused kernels' micro-tiles: 24 accumulators of 32 zmm.
struct IsaTraits {
  static constexpr int kMR = 6, kNR = 4;
  static constexpr int kRegs = 32;  // vector registers
};

constexpr int kSimdBytes = 64;
#include "vec_simd.h"

template <>
struct Vec<float> : SimdVec<float>, HalfScalar {
  using R = __m512;
  // x kept in its register: GCC may not fold a later use into a memory operand.
  static void pin(R& x) { __asm__("" : "+v"(x)); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static R min(R a, R b) { return _mm512_min_ps(a, b); }
  // 2^t for t <= 0 (the softmax weights; hides VecMath's exp2_neg): f = t - floor(t)
  // in [0, 1] by vreduceps, 2^f by a degree-6 polynomial (a minimax fit on [0, 1],
  // relative error 1.9e-9, about 1 ulp in float), times 2^floor(t) by vscalefps, which
  // also gives the underflow (0 or a denormal), -inf -> 0 (vreduceps gives f = 0) and
  // NaN -> NaN. 8 instructions on the FP ports where exp2_neg_poly has 11 (no clamp,
  // no magic-constant rounding, no exponent shift).
  static R exp2_neg(R t) {
    const R f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    R p = set1(2.1709407155867666e-04f);
    p = fma(p, f, set1(1.2437598779797554e-03f));
    p = fma(p, f, set1(9.6790688112378120e-03f));
    p = fma(p, f, set1(5.5483229458332060e-02f));
    p = fma(p, f, set1(2.4022985994815826e-01f));
    p = fma(p, f, set1(6.9314700365066530e-01f));
    p = fma(p, f, set1(1.f));
    return _mm512_scalef_ps(p, t);
  }
  static float hmax(R a) { return _mm512_reduce_max_ps(a); }
  static float hsum(R a) { return _mm512_reduce_add_ps(a); }
  static void hsum4(const R* a, float* out) {
    __m256 h[4];  // fold each to 8 lanes, then the four-way hadd of vec_avx2.h
    for (int i = 0; i < 4; ++i)
      h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
    const __m256 t2 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1)));
  }
  // The sums of sixteen registers as one: lane i = the sum of a[i]'s lanes.
  // A transpose-and-add tree, 30 shuffles and 15 adds where four hsum4 take
  // 4 x 20 uops (decode.cpp's 4-row x 4-key QK: bench/notes_archive.md, dec6).
  //   1. unpacklo/hi_ps of a pair: per 128-bit lane [x0+x2, y0+y2, x1+x3, y1+y3];
  //   2. unpacklo/hi_pd of two of those: per lane [x, y, z, w] partial sums;
  //   3., 4. shuffle_f32x4 and add: fold the four 128-bit lanes.
  static R hsum16(const R* a) {
    R t[8], u[4];
    for (int i = 0; i < 8; ++i)
      t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                           _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int m = 0; m < 4; ++m) {
      const __m512d x = _mm512_castps_pd(t[2 * m]), y = _mm512_castps_pd(t[2 * m + 1]);
      u[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const R v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const R v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88),
                         _mm512_shuffle_f32x4(v01, v23, 0xDD));
  }
  // The sums of twelve registers a[4 r + j] (3 rows x 4 keys of a QK pass),
  // out[4 r + j], each by the tree qk_rows<3, 2>'s passes give it (so the same
  // bits): rows 0 and 1 by hsum4's (lo + hi halves, then adjacent pairs, then
  // the two 128-bit lanes), row 2 by hsum's (GCC's _mm512_reduce_add_ps: lo +
  // hi halves, then the 128-bit lanes, then lanes i and i + 2, then i and i +
  // 1); the adds of all twelve at full width, 24 shuffles and 15 adds where
  // the hsum4 / hsum calls take about twice the instructions.
  static void hsum_3x4(const R* a, float* out) {
    R x[6];  // x[m]: 128-bit lanes [a.L0 + a.L2, a.L1 + a.L3] of a[2m], then of a[2m + 1]
    for (int m = 0; m < 6; ++m)
      x[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                           _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
    // Rows 0, 1 (x[0..3]): within each 128-bit lane (v0 + v1) + (v2 + v3)...
    const R s01 =
        _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
    const R s23 =
        _mm512_add_ps(_mm512_shuffle_ps(x[2], x[3], 0x88), _mm512_shuffle_ps(x[2], x[3], 0xDD));
    // t: lane 0 the low-half totals of a[0], a[2], a[4], a[6], lane 1 their
    // high-half totals, lanes 2 and 3 those of a[1], a[3], a[5], a[7]
    const R t = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x88), _mm512_shuffle_ps(s01, s23, 0xDD));
    // ... then low + high: sums of a[0], a[2], a[4], a[6], a[1], a[3], a[5], a[7]
    const R u = _mm512_add_ps(_mm512_shuffle_f32x4(t, t, 0x08), _mm512_shuffle_f32x4(t, t, 0x0D));
    alignas(64) float s[16];
    _mm512_store_ps(s, u);
    for (int i = 0; i < 4; ++i) out[2 * i] = s[i], out[2 * i + 1] = s[4 + i];
    // Row 2 (x[4], x[5]): y = low + high 128-bit lanes, then (y0 + y2) + (y1 + y3).
    const R y = _mm512_add_ps(_mm512_shuffle_f32x4(x[4], x[5], 0x88),
                              _mm512_shuffle_f32x4(x[4], x[5], 0xDD));
    const R z = _mm512_add_ps(y, _mm512_permute_ps(y, 0x4E));
    const R w = _mm512_add_ps(z, _mm512_permute_ps(z, 0xB1));
    _mm512_store_ps(s, w);
    for (int j = 0; j < 4; ++j) out[8 + j] = s[4 * j];
  }
  // Six rows of W floats interleaved: out[6 i + r] = rows[r][i] (r < 6, i < W),
  // the k-major layout of a 6-row Q panel (flash_fwd.cpp, pack_q), in 6 stores.
  // Pairs of rows first become 64-bit units (rows[2p][i], rows[2p + 1][i]) of
  // columns 0-7 (lo) and 8-15 (hi); out's 64-bit unit u is the pair u % 3 of
  // column u / 3, so out's first three vectors come from the lo halves, the
  // last three from the hi halves, by the same three index patterns.
  static void store_interleaved6(float* out, const R* rows) {
    const __m512i ilo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ihi = _mm512_add_epi32(ilo, _mm512_set1_epi32(8));
    __m512d lo[3], hi[3];
    for (int p = 0; p < 3; ++p) {
      lo[p] = _mm512_castps_pd(_mm512_permutex2var_ps(rows[2 * p], ilo, rows[2 * p + 1]));
      hi[p] = _mm512_castps_pd(_mm512_permutex2var_ps(rows[2 * p], ihi, rows[2 * p + 1]));
    }
    // Output vector j, unit t: u = 8 j + t, column u / 3 (minus 8 j / 3 rounded to
    // the half), pair u % 3; pairs 0 and 1 by one two-source permute (pair 1 from
    // the second source: index + 8), pair 2 merged in under a mask.
    const __m512i i01[3] = {_mm512_set_epi64(10, 2, 0, 9, 1, 0, 8, 0),
                            _mm512_set_epi64(5, 0, 12, 4, 0, 11, 3, 0),
                            _mm512_set_epi64(0, 15, 7, 0, 14, 6, 0, 13)};
    const __m512i i2[3] = {_mm512_set_epi64(2, 2, 1, 1, 1, 0, 0, 0),
                           _mm512_set_epi64(5, 4, 4, 4, 3, 3, 3, 2),
                           _mm512_set_epi64(7, 7, 7, 6, 6, 6, 5, 5)};
    const __mmask8 m2[3] = {0x24, 0x49, 0x92};  // units t with (8 j + t) % 3 == 2
    for (int j = 0; j < 3; ++j) {
      const __m512d a = _mm512_mask_permutexvar_pd(_mm512_permutex2var_pd(lo[0], i01[j], lo[1]),
                                                   m2[j], i2[j], lo[2]);
      const __m512d b = _mm512_mask_permutexvar_pd(_mm512_permutex2var_pd(hi[0], i01[j], hi[1]),
                                                   m2[j], i2[j], hi[2]);
      _mm512_storeu_ps(out + 16 * j, _mm512_castpd_ps(a));
      _mm512_storeu_ps(out + 16 * (j + 3), _mm512_castpd_ps(b));
    }
  }
  // A 16 x 16 transpose: out[i * ldo + j] = rows[j][i] (the k-major K panels
  // of flash_fwd.cpp's kv_block, 16 keys x 16 dims at a time). Pairs of rows
  // interleaved by 32 bits, then by 64 bits within 128-bit lanes, then the
  // lanes exchanged twice; 64 shuffles and 16 stores for 256 elements.
  static void store_transposed16(float* out, int64_t ldo, const R* rows) {
    R t[16], r[16];
    for (int k = 0; k < 16; k += 2) {
      t[k] = _mm512_unpacklo_ps(rows[k], rows[k + 1]);
      t[k + 1] = _mm512_unpackhi_ps(rows[k], rows[k + 1]);
    }
    for (int k = 0; k < 16; k += 4) {
      r[k] = _mm512_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[k + 1] = _mm512_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
      r[k + 2] = _mm512_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
      r[k + 3] = _mm512_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; ++k) {
      t[k] = _mm512_shuffle_f32x4(r[k], r[k + 4], 0x88);
      t[k + 4] = _mm512_shuffle_f32x4(r[k], r[k + 4], 0xdd);
      t[k + 8] = _mm512_shuffle_f32x4(r[k + 8], r[k + 12], 0x88);
      t[k + 12] = _mm512_shuffle_f32x4(r[k + 8], r[k + 12], 0xdd);
    }
    for (int k = 0; k < 8; ++k) {
      _mm512_storeu_ps(out + k * ldo, _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88));
      _mm512_storeu_ps(out + (k + 8) * ldo, _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd));
    }
  }
  // W int8 codes, sign-extended and converted to fp32 (the int8 KV cache).
  static R load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
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
  // 2 W bf16 values as their even (elements 0, 2, .., 2 W - 2) and odd
  // elements in fp32, from one load: a shift and a mask, no widening shuffle.
  static void load_bf16_eo(const uint16_t* p, R* even, R* odd) {
    const __m512i w = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
  // 2 W floats in order <-> their even and odd elements (as load_bf16_eo).
  static void load_eo(const float* p, R* even, R* odd) {
    const R lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    *even = _mm512_permutex2var_ps(lo, ie, hi);
    *odd = _mm512_permutex2var_ps(lo, _mm512_add_epi32(ie, _mm512_set1_epi32(1)), hi);
  }
  static void store_eo(float* p, R even, R odd) {
    const __m512i il = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_storeu_ps(p, _mm512_permutex2var_ps(even, il, odd));
    _mm512_storeu_ps(p + 16,
                     _mm512_permutex2var_ps(even, _mm512_add_epi32(il, _mm512_set1_epi32(8)), odd));
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
};

template <>
struct Vec<double> : SimdVec<double> {
  using R = __m512d;
  static void pin(R& x) { __asm__("" : "+v"(x)); }  // as Vec<float>::pin
  static R set1(double x) { return _mm512_set1_pd(x); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_pd(a, b, c); }
  static R max(R a, R b) { return _mm512_max_pd(a, b); }
  static R min(R a, R b) { return _mm512_min_pd(a, b); }
  static double hmax(R a) { return _mm512_reduce_max_pd(a); }
  static double hsum(R a) { return _mm512_reduce_add_pd(a); }
};

#if defined(ATTN_ISA_AVX512_BF16)
// AVX512-BF16 (the avx512_bf16 object): vdpbf16ps on pairs of bf16 values,
// one pair per 32-bit word (element 2k in the low half), W pairs per B.
struct DotBf16 {
  using B = __m512bh;
  static B load(const uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static B set1(uint32_t pair) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)); }
  // 2 W consecutive bf16 values (pairs along the row), all of them or the first
  // n < 2 W (the rest zero; masked lanes are not read).
  static B load_row(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static B load_row(const uint16_t* p, int64_t n) {
    return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
  }
  // acc + a[2k] b[2k] + a[2k+1] b[2k+1] per lane k, in fp32 (products exact).
  static Vec<float>::R dot(Vec<float>::R acc, B a, B b) { return _mm512_dpbf16_ps(acc, a, b); }
  // 2 W floats (lo, then hi) rounded to bf16 (vcvtne2ps2bf16) and stored as 2 W values.
  static void store_pairs(uint16_t* p, Vec<float>::R lo, Vec<float>::R hi) {
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  // W words (a[e], b[e]) of two rows of W bf16 values (element e of row a in the
  // low half): the pair layout along the keys of a packed V strip, by two widenings.
  static __m512i key_pairs(const uint16_t* a, const uint16_t* b) {
    const __m512i lo =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
    const __m512i hi =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
  }
  // The bf16 values of x (2 W of them) that are inf or NaN (exponent bits all set).
  static __mmask32 nonfinite(__m512i x) {
    const __m512i e = _mm512_set1_epi16(0x7F80);
    return _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, e), e);
  }
};
#endif
