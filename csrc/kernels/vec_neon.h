// Advanced SIMD (NEON) vectors of ARMv8-A: 4 floats / 2 doubles per register,
// 32 registers. The primitives of vec_avx2.h (see there for their meaning), on
// 128-bit registers; those every SIMD ISA shares are vec_simd.h, the math over
// them vec_math.h. Baseline ARMv8-A only:
// every aarch64 CPU runs the neon object. The neon_bf16 object (FEAT_BF16,
// ATTN_ISA_NEON_BF16) adds DotBf16 at the end: BFDOT on bf16 pairs.
//
// max / min follow the x86 rule of the other headers (max(a, b) = b when
// either is NaN: a compare and a select, not FMAX, which would return the
// NaN either way), so the kernels see the same NaN flow on every ISA.
#pragma once
#include <arm_neon.h>

#include <cstring>

// Register blocking of the fused kernels' micro-tiles: 6 rows x 4 vectors,
// 24 accumulators + 4 K vectors + 3 Q vectors (two k steps of 6 rows, read by
// lane: neon_tiles.h) of the 32 registers.
struct IsaTraits {
  static constexpr int kMR = 6, kNR = 4;
  static constexpr int kRegs = 32;  // vector registers
};

constexpr int kSimdBytes = 16;
#include "vec_simd.h"

// One 16-bit value <-> fp32 (attn_fast/half.h: round to nearest even, NaN
// kept), the scalar tails of the vector conversions below.
struct HalfNeon {
  static float from_bf16(uint16_t h) { return bf16_to_f32(h); }
  static float from_f16(uint16_t h) { return fp16_to_f32(h); }
  static uint16_t to_bf16(float x) { return f32_to_bf16(x); }
  static uint16_t to_f16(float x) { return f32_to_fp16(x); }
};

template <>
struct Vec<float> : SimdVec<float>, HalfNeon {
  using R = float32x4_t;
  static R set1(float x) { return vdupq_n_f32(x); }
  static R fma(R a, R b, R c) { return vfmaq_f32(c, a, b); }
  static R max(R a, R b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
  static R min(R a, R b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
  static float hmax(R a) {  // the x86 order: (0 max 2, 1 max 3), then the two
    const float32x2_t x = vget_low_f32(max(a, vextq_f32(a, a, 2)));
    const float x0 = vget_lane_f32(x, 0), x1 = vget_lane_f32(x, 1);
    return x0 > x1 ? x0 : x1;
  }
  static float hsum(R a) {  // (0 + 2) + (1 + 3), as vec_avx2.h's tree
    const float32x2_t x = vadd_f32(vget_low_f32(a), vget_high_f32(a));
    return vget_lane_f32(x, 0) + vget_lane_f32(x, 1);
  }
  static void hsum4(const R* a, float* out) {
    vst1q_f32(out, vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3])));
  }
  // W int8 codes, sign-extended and converted to fp32 (the int8 KV cache):
  // exactly W bytes are read.
  static R load_i8(const int8_t* p) {
    int32_t w;
    std::memcpy(&w, p, 4);
    const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
  }
  // 16-bit storage <-> fp32, W elements: bf16 widens by a 16-bit shift and
  // narrows with round to nearest even (NaN kept NaN, quieted, as vec_avx2.h);
  // fp16 by FCVTL / FCVTN (round to nearest even, the default FPCR mode).
  static R load_bf16(const uint16_t* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
  }
  static R load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  static uint16x4_t round_bf16(R x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), lsb), 16);
    const uint32x4_t qnan = vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40));
    return vmovn_u32(vbslq_u32(vceqq_f32(x, x), r, qnan));
  }
  static void store_bf16(uint16_t* p, R x) { vst1_u16(p, round_bf16(x)); }
  static void store_f16(uint16_t* p, R x) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x))); }
};

template <>
struct Vec<double> : SimdVec<double> {
  using R = float64x2_t;
  static R set1(double x) { return vdupq_n_f64(x); }
  static R fma(R a, R b, R c) { return vfmaq_f64(c, a, b); }
  static R max(R a, R b) { return vbslq_f64(vcgtq_f64(a, b), a, b); }
  static R min(R a, R b) { return vbslq_f64(vcltq_f64(a, b), a, b); }
  static double hmax(R a) {
    const double x0 = vgetq_lane_f64(a, 0), x1 = vgetq_lane_f64(a, 1);
    return x0 > x1 ? x0 : x1;
  }
  static double hsum(R a) { return vgetq_lane_f64(a, 0) + vgetq_lane_f64(a, 1); }
};

#if defined(ATTN_ISA_NEON_BF16)
// FEAT_BF16 (the neon_bf16 object): BFDOT on pairs of bf16 values, one pair
// per 32-bit word (element 2k in the low half), W pairs per B; the interface
// of vec_avx512.h's DotBf16 (the avx512_bf16 object's vdpbf16ps), so the
// pair-layout kernels of flash_fwd.cpp and decode.cpp are shared.
struct DotBf16 {
  using B = bfloat16x8_t;
  static B load(const uint32_t* p) { return vreinterpretq_bf16_u32(vld1q_u32(p)); }
  static B set1(uint32_t pair) { return vreinterpretq_bf16_u32(vdupq_n_u32(pair)); }
  // 2 W consecutive bf16 values (pairs along the row), all of them or the first
  // n < 2 W (the rest zero; the values past n are not read).
  static B load_row(const uint16_t* p) { return vreinterpretq_bf16_u16(vld1q_u16(p)); }
  static B load_row(const uint16_t* p, int64_t n) {
    uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(t, p, static_cast<size_t>(n) * 2);
    return vreinterpretq_bf16_u16(vld1q_u16(t));
  }
  // acc + a[2k] b[2k] + a[2k+1] b[2k+1] per lane k, in fp32 (BFDOT: products
  // exact, the pair summed with round to odd, then added to acc).
  static Vec<float>::R dot(Vec<float>::R acc, B a, B b) { return vbfdotq_f32(acc, a, b); }
  // 2 W floats (lo, then hi) rounded to bf16 (nearest even, as
  // Vec<float>::store_bf16) and stored as 2 W values.
  static void store_pairs(uint16_t* p, Vec<float>::R lo, Vec<float>::R hi) {
    vst1q_u16(p, vcombine_u16(Vec<float>::round_bf16(lo), Vec<float>::round_bf16(hi)));
  }
};
#endif
