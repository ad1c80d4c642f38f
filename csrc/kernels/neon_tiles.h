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
// Two k steps: Q values of k in a0 (rows 0-3) and a1 (rows 4-5, lanes 0-1), of
// k + 1 in a1 (rows 0-1, lanes 2-3) and a2 (rows 2-5); K of k, then of k + 1.
#define ATTN_NEON_TWO_STEPS(OP, LD, kp) \
  b0 = LD(kp);                          \
  b1 = LD(kp + 4);                      \
  b2 = LD(kp + 8);                      \
  b3 = LD(kp + 12);                     \
  ATTN_NEON_ROW(OP, 0, a0, 0)           \
  ATTN_NEON_ROW(OP, 1, a0, 1)           \
  ATTN_NEON_ROW(OP, 2, a0, 2)           \
  ATTN_NEON_ROW(OP, 3, a0, 3)           \
  ATTN_NEON_ROW(OP, 4, a1, 0)           \
  ATTN_NEON_ROW(OP, 5, a1, 1)           \
  b0 = LD(kp + 16);                     \
  b1 = LD(kp + 20);                     \
  b2 = LD(kp + 24);                     \
  b3 = LD(kp + 28);                     \
  ATTN_NEON_ROW(OP, 0, a1, 2)           \
  ATTN_NEON_ROW(OP, 1, a1, 3)           \
  ATTN_NEON_ROW(OP, 2, a2, 0)           \
  ATTN_NEON_ROW(OP, 3, a2, 1)           \
  ATTN_NEON_ROW(OP, 4, a2, 2)           \
  ATTN_NEON_ROW(OP, 5, a2, 3)
// The last k of an odd count: Q's 6 values as 4 + 2 (no read past the panel).
#define ATTN_NEON_ONE_STEP(OP, LD, kp) \
  b0 = LD(kp);                         \
  b1 = LD(kp + 4);                     \
  b2 = LD(kp + 8);                     \
  b3 = LD(kp + 12);                    \
  ATTN_NEON_ROW(OP, 0, a0, 0)          \
  ATTN_NEON_ROW(OP, 1, a0, 1)          \
  ATTN_NEON_ROW(OP, 2, a0, 2)          \
  ATTN_NEON_ROW(OP, 3, a0, 3)          \
  ATTN_NEON_ROW(OP, 4, a1, 0)          \
  ATTN_NEON_ROW(OP, 5, a1, 1)

#define ATTN_NEON_FMLA(c, b, A, L) vfmaq_laneq_f32(c, b, A, L)
#define ATTN_NEON_SAME(x) (x)

inline void qk_micro_neon_6x4(const float* __restrict Qp, int64_t d, const float* __restrict Kp,
                              float* __restrict S, int64_t lds) {
  ATTN_NEON_ACC(vdupq_n_f32(0.f))
  float32x4_t b0, b1, b2, b3;
  int64_t k = 0;
  for (; k + 2 <= d; k += 2) {
    const float* q = Qp + k * 6;
    const float32x4_t a0 = vld1q_f32(q), a1 = vld1q_f32(q + 4), a2 = vld1q_f32(q + 8);
    ATTN_NEON_TWO_STEPS(ATTN_NEON_FMLA, vld1q_f32, (Kp + k * 16))
  }
  if (k < d) {
    const float* q = Qp + k * 6;
    const float32x4_t a0 = vld1q_f32(q), a1 = vcombine_f32(vld1_f32(q + 4), vdup_n_f32(0.f));
    ATTN_NEON_ONE_STEP(ATTN_NEON_FMLA, vld1q_f32, (Kp + k * 16))
  }
  ATTN_NEON_STORE(ATTN_NEON_SAME)
}

#if defined(ATTN_ISA_NEON_BF16)
#define ATTN_NEON_BFDOT(c, b, A, L) vbfdotq_laneq_f32(c, b, A, L)
inline bfloat16x8_t neon_ld_pairs(const uint32_t* p) {
  return vreinterpretq_bf16_u32(vld1q_u32(p));
}

// qk_micro_dot's 6 x 4 tile: S = scale * (Q K^T), Q and K as bf16 pairs.
inline void qk_micro_dot_neon_6x4(const uint32_t* __restrict Qw, int64_t d2,
                                  const uint32_t* __restrict Kw, float scale, float* __restrict S,
                                  int64_t lds) {
  ATTN_NEON_ACC(vdupq_n_f32(0.f))
  bfloat16x8_t b0, b1, b2, b3;
  int64_t k = 0;
  for (; k + 2 <= d2; k += 2) {
    const uint32_t* q = Qw + k * 6;
    const bfloat16x8_t a0 = neon_ld_pairs(q), a1 = neon_ld_pairs(q + 4), a2 = neon_ld_pairs(q + 8);
    ATTN_NEON_TWO_STEPS(ATTN_NEON_BFDOT, neon_ld_pairs, (Kw + k * 16))
  }
  if (k < d2) {
    const uint32_t* q = Qw + k * 6;
    const bfloat16x8_t a0 = neon_ld_pairs(q);
    const bfloat16x8_t a1 = vreinterpretq_bf16_u32(vcombine_u32(vld1_u32(q + 4), vdup_n_u32(0)));
    ATTN_NEON_ONE_STEP(ATTN_NEON_BFDOT, neon_ld_pairs, (Kw + k * 16))
  }
  const float32x4_t vs = vdupq_n_f32(scale);
  auto scaled = [vs](float32x4_t x) { return vmulq_f32(x, vs); };
  ATTN_NEON_STORE(scaled)
}
#undef ATTN_NEON_BFDOT
#endif

#undef ATTN_NEON_ACC
#undef ATTN_NEON_STORE_ROW
#undef ATTN_NEON_STORE
#undef ATTN_NEON_ROW
#undef ATTN_NEON_TWO_STEPS
#undef ATTN_NEON_ONE_STEP
#undef ATTN_NEON_FMLA
#undef ATTN_NEON_SAME
