// S = scale * Q K^T of a backward tile (flash_bwd.cpp), formed as the forward
// formed it on the same object: what makes P = exp(S - lse) exact.
//
// The forward of bf16 storage on the pair-product objects multiplies bf16
// pairs (flash_fwd_dot.h: vdpbf16ps on avx512_bf16, BFDOT on neon_bf16) and
// scales the fp32 sum; everywhere else it multiplies (scale Q) K^T in the
// compute type by FMAs, as the backward's gemm does. An fp32 FMA recomputation
// of a pair product differs by a few ulps (another summation order, bf16
// denormals kept), so lse and S disagree, P = 1 +- 1e-7 where the forward's
// row had one key, and a gradient that is an exact tie can round to the other
// neighbour. So on those objects the backward's bf16 S is qk_pair_sums
// (qk_pairs.h), the forward's own sums, times the same fp32 scale; its gradient
// products stay fp32 (the forward has no counterpart to match).
//
// Layouts (words of two bf16 values of consecutive d, the pair path's):
//   K^T  KTw[k2 * Bcp + c], key c of the block, in the space of the fp32 K^T
//        (dp x Bcp floats), which S alone reads; keys cols .. Bcp zero
//   Q    micro-panels of kBMR rows (the last of the rows left), panel p at
//        Qw + p kBMR d2 holding h rows, word (k2, r) at [k2 * h + r]
//
// dispatch.cpp sends bf16 backward calls of avx512_bf16, amx and amx_emu to the
// avx512_bf16 object (the amx_emu tiles add the same pairs in the same order:
// amx_tiles.h) and of neon_bf16 to that object.
//
// Not `#pragma once`: included once, inside flash_bwd.cpp's ISA namespace,
// after gemm and BScratch.

#if defined(ATTN_DOT_BF16)
#include "qk_pairs.h"  // bf16_pair, qk_pair_sums

template <typename S>
constexpr bool kPairScores = false;
template <>
constexpr bool kPairScores<bf16_t> = true;

// Rows c < n of x (row c at x + c * ldr, elements stride sd, d of them) as pair
// words, transposed: out[k2 * n + c] = the pair (2 k2, 2 k2 + 1) of row c; rows
// nvalid .. n - 1 are zero (a key panel's padding).
inline void pairs_transposed(const bf16_t* x, int64_t ldr, int64_t sd, int64_t d, int64_t nvalid,
                             int64_t n, uint32_t* out) {
  const int64_t d2 = (d + 1) / 2;
  for (int64_t c = 0; c < n; ++c)
    for (int64_t k2 = 0; k2 < d2; ++k2)
      out[k2 * n + c] = c < nvalid ? bf16_pair(x + c * ldr, sd, 2 * k2, d) : 0u;
}

// S[r][c] = scale * sum of qk_pair_sums for the h (= MR) rows of one Q panel
// and the Bcp columns of KTw: kBNR-vector strips, then single vectors.
template <int MR>
inline void pair_scores_panel(const uint32_t* Qw, int64_t d2, const uint32_t* KTw, int64_t Bcp,
                              float scale, float* S) {
  using V = Vec<float>;
  constexpr int W = V::W;
  const V::R vs = V::set1(scale);
  int64_t c0 = 0;
  for (; c0 + kBNR * W <= Bcp; c0 += kBNR * W) {
    V::R acc[MR][kBNR];
    qk_pair_sums<MR, kBNR>(Qw, d2, KTw + c0, Bcp, acc);
    for (int r = 0; r < MR; ++r)
      for (int n = 0; n < kBNR; ++n) V::store(S + r * Bcp + c0 + n * W, V::mul(acc[r][n], vs));
  }
  for (; c0 < Bcp; c0 += W) {
    V::R acc[MR][1];
    qk_pair_sums<MR, 1>(Qw, d2, KTw + c0, Bcp, acc);
    for (int r = 0; r < MR; ++r) V::store(S + r * Bcp + c0, V::mul(acc[r][0], vs));
  }
}

// The last h < kBMR rows (pair_scores_panel<h>).
template <int R = kBMR - 1>
inline void pair_scores_tail(int64_t h, const uint32_t* Qw, int64_t d2, const uint32_t* KTw,
                             int64_t Bcp, float scale, float* S) {
  if constexpr (R >= 1) {
    if (h == R) return pair_scores_panel<R>(Qw, d2, KTw, Bcp, scale, S);
    pair_scores_tail<R - 1>(h, Qw, d2, KTw, Bcp, scale, S);
  }
}
#else
template <typename S>
constexpr bool kPairScores = false;
#endif

// K^T of the key block at kbase (cols keys, padded to Bcp) as the scores of
// tile_scores read it: on the pair objects' bf16, pair words over sc.KT (the
// fp32 K^T bwd_item packed there has no other reader); elsewhere nothing (S
// reads the fp32 K^T).
template <typename S, typename T>
inline void pack_scores_k(const AttnArgs<S>& a, const S* kbase, int64_t cols, int64_t Bcp,
                          BScratch<T>& sc) {
#if defined(ATTN_DOT_BF16)
  if constexpr (kPairScores<S>) {
    pairs_transposed(kbase, a.sk.l, a.sk.d, a.d, cols, Bcp, reinterpret_cast<uint32_t*>(sc.KT));
  }
#endif
  (void)a, (void)kbase, (void)cols, (void)Bcp, (void)sc;
}

// S[rows][Bcp] = scale * Q K^T of the tile's rows at qb (local rows i0 ..), into
// sc.S: the pair product from the pair-word K^T (pack_scores_k) and the rows'
// pairs (sc.Qw) on the pair objects' bf16; elsewhere the gemm of the scaled
// fp32 Q (sc.Qs) and the fp32 K^T.
template <typename S, typename T>
inline void tile_scores(const AttnArgs<S>& a, const S* qb, int64_t rows, int64_t Bcp,
                        BScratch<T>& sc) {
#if defined(ATTN_DOT_BF16)
  if constexpr (kPairScores<S>) {
    const int64_t d = a.d, d2 = (d + 1) / 2;
    const float scale = static_cast<float>(a.scale);
    uint32_t* Qw = reinterpret_cast<uint32_t*>(sc.Qw);
    const uint32_t* KTw = reinterpret_cast<const uint32_t*>(sc.KT);
    for (int64_t r0 = 0; r0 < rows; r0 += kBMR) {
      const int64_t h = imin(kBMR, rows - r0);
      uint32_t* panel = Qw + r0 * d2;
      pairs_transposed(qb + r0 * a.sq.l, a.sq.l, a.sq.d, d, h, h, panel);
      if (h == kBMR)
        pair_scores_panel<kBMR>(panel, d2, KTw, Bcp, scale, sc.S + r0 * Bcp);
      else
        pair_scores_tail(h, panel, d2, KTw, Bcp, scale, sc.S + r0 * Bcp);
    }
    return;
  }
#endif
  const int64_t dp = round_up(a.d, Vec<T>::W);
  gemm<T>(rows, Bcp, a.d, sc.Qs, dp, sc.KT, Bcp, sc.S, Bcp, false);
}
