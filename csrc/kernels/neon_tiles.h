// The Q K^T micro-kernels of the neon and neon_bf16 objects (flash_fwd.cpp's
// qk_micro and qk_micro_dot take them for the 6 x 4 tile of vec_neon.h), by
// the by-element forms of FMLA and BFDOT.
//
// The generic kernels broadcast each of the tile's 6 Q values into a register
// of its own: 24 accumulators + 4 K vectors + 6 broadcasts is 34 of the 32
// vector registers, and GCC spills accumulators in the inner loop (stores and
// reloads beside the 24 FMAs). Here Q stays in the panel's own layout (6
// values per k, consecutive) and is read as whole vectors whose lanes the
// multiply-adds index: 24 + 4 + 3 registers for two k steps, and per k two
// load pairs of K and one and a half vector loads of Q for 24 FMLA / BFDOT.
// The sums are the generic kernels' (each accumulator adds the same products
// in the same k order), so the results are the same bits.
//
// Shapes as qk_micro / qk_micro_dot: Qp[k * 6 + r], Kp[k * 16 + c] (fp32), or
// the same layouts of 32-bit bf16 pairs (Qw, Kw; k counts pairs); S[r * lds + c].
//
// The 24 accumulators and the 4 K vectors are named variables, not arrays:
// GCC 12 keeps an array of 24 vectors partly in memory here (a store of the
// spilled ones on every k step).
//
// Included by flash_fwd.cpp inside its ISA namespace after vec_neon.h; neon
// objects only.
#pragma once

// The tile's 24 accumulators c<r><n> (row r, vector n) and their stores.
#define ATTN_NEON_ACC(Z)                                                              \
  float32x4_t c00 = Z, c01 = Z, c02 = Z, c03 = Z, c10 = Z, c11 = Z, c12 = Z, c13 = Z; \
  float32x4_t c20 = Z, c21 = Z, c22 = Z, c23 = Z, c30 = Z, c31 = Z, c32 = Z, c33 = Z; \
  float32x4_t c40 = Z, c41 = Z, c42 = Z, c43 = Z, c50 = Z, c51 = Z, c52 = Z, c53 = Z;
#define ATTN_NEON_STORE_ROW(r, F)         \
  vst1q_f32(S + r * lds + 0, F(c##r##0)); \
  vst1q_f32(S + r * lds + 4, F(c##r##1)); \
  vst1q_f32(S + r * lds + 8, F(c##r##2)); \
  vst1q_f32(S + r * lds + 12, F(c##r##3));
#define ATTN_NEON_STORE(F)  \
  ATTN_NEON_STORE_ROW(0, F) \
  ATTN_NEON_STORE_ROW(1, F) \
  ATTN_NEON_STORE_ROW(2, F) \
  ATTN_NEON_STORE_ROW(3, F) \
  ATTN_NEON_STORE_ROW(4, F) \
  ATTN_NEON_STORE_ROW(5, F)
// Row r of the tile += K vectors b0..b3 times lane L of A, by OP (FMLA or BFDOT by element).
#define ATTN_NEON_ROW(OP, r, A, L) \
  c##r##0 = OP(c##r##0, b0, A, L); \
  c##r##1 = OP(c##r##1, b1, A, L); \
  c##r##2 = OP(c##r##2, b2, A, L); \
  c##r##3 = OP(c##r##3, b3, A, L);
// One k step: K vectors b0..b3 loaded from kp, then rows 0-5 of the tile by
// lanes (A0, L0) .. (A5, L5) of the Q registers.
#define ATTN_NEON_K_STEP(OP, LD, kp, A0, L0, A1, L1, A2, L2, A3, L3, A4, L4, A5, L5) \
  b0 = LD(kp);                                                                       \
  b1 = LD(kp + 4);                                                                   \
  b2 = LD(kp + 8);                                                                   \
  b3 = LD(kp + 12);                                                                  \
  ATTN_NEON_ROW(OP, 0, A0, L0)                                                       \
  ATTN_NEON_ROW(OP, 1, A1, L1)                                                       \
  ATTN_NEON_ROW(OP, 2, A2, L2)                                                       \
  ATTN_NEON_ROW(OP, 3, A3, L3)                                                       \
  ATTN_NEON_ROW(OP, 4, A4, L4)                                                       \
  ATTN_NEON_ROW(OP, 5, A5, L5)
// Two k steps: Q values of k in a0 (rows 0-3) and a1 (rows 4-5, lanes 0-1), of
// k + 1 in a1 (rows 0-1, lanes 2-3) and a2 (rows 2-5); K of k, then of k + 1.
#define ATTN_NEON_TWO_STEPS(OP, LD, kp)                                  \
  ATTN_NEON_K_STEP(OP, LD, kp, a0, 0, a0, 1, a0, 2, a0, 3, a1, 0, a1, 1) \
  ATTN_NEON_K_STEP(OP, LD, kp + 16, a1, 2, a1, 3, a2, 0, a2, 1, a2, 2, a2, 3)
// The last k of an odd count: Q's 6 values as 4 + 2 (no read past the panel).
#define ATTN_NEON_ONE_STEP(OP, LD, kp) \
  ATTN_NEON_K_STEP(OP, LD, kp, a0, 0, a0, 1, a0, 2, a0, 3, a1, 0, a1, 1)

// The by-element multiply-add of each tile, on its K / Q vectors B loaded
// from elements E: FMLA on fp32 values, BFDOT on 32-bit bf16 pairs.
struct NeonFmla {
  using E = float;
  using B = float32x4_t;
  static B ld(const float* p) { return vld1q_f32(p); }
  static B ld_half(const float* p) { return vcombine_f32(vld1_f32(p), vdup_n_f32(0.f)); }
  template <int L>
  static float32x4_t op(float32x4_t c, B b, B a) {
    return vfmaq_laneq_f32(c, b, a, L);
  }
};
#if defined(ATTN_ISA_NEON_BF16)
struct NeonBfdot {
  using E = uint32_t;
  using B = bfloat16x8_t;
  static B ld(const uint32_t* p) { return vreinterpretq_bf16_u32(vld1q_u32(p)); }
  static B ld_half(const uint32_t* p) {
    return vreinterpretq_bf16_u32(vcombine_u32(vld1_u32(p), vdup_n_u32(0)));
  }
  template <int L>
  static float32x4_t op(float32x4_t c, B b, B a) {
    return vbfdotq_laneq_f32(c, b, a, L);
  }
};
#endif

// S[r * lds + c] = out(sum over k of Q[k][r] K[k][c]) for the 6 x 16 tile, by
// P's multiply-add (d: the k count, in P's elements).
#define ATTN_NEON_OP(c, b, A, L) P::template op<L>(c, b, A)
template <typename P, typename Out>
inline void qk_neon_6x4(const typename P::E* __restrict Qp, int64_t d,
                        const typename P::E* __restrict Kp, float* __restrict S, int64_t lds,
                        Out out) {
  ATTN_NEON_ACC(vdupq_n_f32(0.f))
  typename P::B b0, b1, b2, b3;
  int64_t k = 0;
  for (; k + 2 <= d; k += 2) {
    const typename P::E* q = Qp + k * 6;
    const typename P::B a0 = P::ld(q), a1 = P::ld(q + 4), a2 = P::ld(q + 8);
    ATTN_NEON_TWO_STEPS(ATTN_NEON_OP, P::ld, (Kp + k * 16))
  }
  if (k < d) {
    const typename P::E* q = Qp + k * 6;
    const typename P::B a0 = P::ld(q), a1 = P::ld_half(q + 4);
    ATTN_NEON_ONE_STEP(ATTN_NEON_OP, P::ld, (Kp + k * 16))
  }
  ATTN_NEON_STORE(out)
}

// qk_micro's 6 x 4 tile: S = Q K^T in fp32.
inline void qk_micro_neon_6x4(const float* __restrict Qp, int64_t d, const float* __restrict Kp,
                              float* __restrict S, int64_t lds) {
  qk_neon_6x4<NeonFmla>(Qp, d, Kp, S, lds, [](float32x4_t x) { return x; });
}

#if defined(ATTN_ISA_NEON_BF16)
// qk_micro_dot's 6 x 4 tile: S = scale * (Q K^T), Q and K as bf16 pairs.
inline void qk_micro_dot_neon_6x4(const uint32_t* __restrict Qw, int64_t d2,
                                  const uint32_t* __restrict Kw, float scale, float* __restrict S,
                                  int64_t lds) {
  const float32x4_t vs = vdupq_n_f32(scale);
  qk_neon_6x4<NeonBfdot>(Qw, d2, Kw, S, lds, [vs](float32x4_t x) { return vmulq_f32(x, vs); });
}
#endif

#undef ATTN_NEON_ACC
#undef ATTN_NEON_STORE_ROW
#undef ATTN_NEON_STORE
#undef ATTN_NEON_ROW
#undef ATTN_NEON_TWO_STEPS
#undef ATTN_NEON_ONE_STEP
#undef ATTN_NEON_K_STEP
#undef ATTN_NEON_OP
