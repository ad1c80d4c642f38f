// The bf16 pair product path of the flash forward (flash_fwd.cpp): the
// avx512_bf16 object (vdpbf16ps) and the neon_bf16 object (BFDOT) run bf16
// storage through it, over DotBf16 (vec_avx512.h / vec_neon.h). Q, K and V
// stay bf16 and are packed as pairs (one 32-bit word = two consecutive values
// of the reduction index); each dot instruction does W lanes x 2 products,
// exact in fp32, accumulated in fp32.
//
// Layouts (the FMA path's panels, flash_fwd_fma.h, of 32-bit words):
//   Q  kMR-row panels of pairs along d, unscaled, Qw[k2 * kMR + r] (an odd d
//      padded with a zero)
//   K  panels of kNR * W keys of pairs along d, Kw[k2 * NRW + c]
//   V  strips of pairs along the keys, word (c2, e) = (v[2 c2][e], v[2 c2 + 1][e])
//   P  rounded to bf16 in place: row r's word c2 = (p[r][2 c2], p[r][2 c2 + 1])
// Numerics: the scale (and nothing else) multiplies S in fp32 at the store, so
// scale * Q is never rounded to bf16; P is rounded to bf16 before P V (as
// torch's bf16 SDPA does), except on a V block with an inf/NaN, whose guarded
// product reads fp32 P and skips zero weights. Measured: bench/NOTES.md,
// #prefill-bf16.
//
// Not `#pragma once`: included once, inside flash_fwd.cpp's ISA namespace,
// after flash_fwd_fma.h (fold_row_max, HasTranspose16 / HasInterleave6).

// The hardware invariants of the pair layout.
static_assert(sizeof(uint32_t) == 2 * sizeof(bf16_t), "one 32-bit word holds one bf16 pair");
static_assert(sizeof(DotBf16::B) == sizeof(Vec<float>::R), "one dot register: W pairs -> W fp32");

#include "qk_pairs.h"  // bf16_pair, pair_dot_acc, qk_pair_sums (the sums the backward's S repeats)

// S[MR][NR*W] = scale * Q K^T over d2 pairs (Qw a micro-panel, Kw a key panel).
template <int MR, int NR, bool kMax = false>
inline void qk_micro_dot(const uint32_t* __restrict Qw, int64_t d2, const uint32_t* __restrict Kw,
                         float scale, float* __restrict S, int64_t lds,
                         float* __restrict rmax = nullptr,
                         const int32_t* __restrict lim = nullptr) {
  using V = Vec<float>;
  constexpr int W = V::W;
#if defined(ATTN_ISA_NEON_BF16)
  if constexpr (MR == 6 && NR == 4 && !kMax)
    return qk_micro_dot_neon_6x4(Qw, d2, Kw, scale, S, lds);  // the same sums (neon_tiles.h)
#endif
  V::R acc[MR][NR];
  qk_pair_sums<MR, NR>(Qw, d2, Kw, NR * W, acc);
  const V::R vs = V::set1(scale);
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) {
      acc[r][n] = V::mul(acc[r][n], vs);
      V::store(S + r * lds + n * W, acc[r][n]);
    }
  if constexpr (kMax) fold_row_max<MR, NR>(acc, rmax, lim);
}

// O[MR][NR*W] += P[MR][2 c2n] * V[2 c2n][NR*W] with P and V as bf16 pairs
// along the keys (Pw[r*ldp + c2], Vw[c2*ldv + e]).
template <int MR, int NR>
inline void pv_micro_dot(const uint32_t* __restrict Pw, int64_t ldp, int64_t c2n,
                         const uint32_t* __restrict Vw, int64_t ldv, float* __restrict O,
                         int64_t ldo) {
  using V = Vec<float>;
  constexpr int W = V::W;
  V::R acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = V::load(O + r * ldo + n * W);
  pair_dot_acc<MR, NR>(Pw, 1, ldp, c2n, Vw, ldv, acc);
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) V::store(O + r * ldo + n * W, acc[r][n]);
}

// P rows (fp32, cols_p % (2 W) == 0) rounded to bf16 in place: row r's first
// cols_p / 2 words become its pairs (each chunk is read before it is overwritten).
inline void p_to_bf16(float* S, int64_t lds, int64_t rows_p, int64_t cols_p) {
  for (int64_t r = 0; r < rows_p; ++r) {
    float* s = S + r * lds;
    uint16_t* h = reinterpret_cast<uint16_t*>(s);
    constexpr int W = Vec<float>::W;
    for (int64_t j = 0; j < cols_p; j += 2 * W)
      DotBf16::store_pairs(h + j, Vec<float>::load(s + j), Vec<float>::load(s + j + W));
  }
}

// O[rows_p][dvp] += P V on the pair layouts; column ranges pc as pv_block,
// widened to whole pairs (the weights there are exactly 0).
inline void pv_block_dot(const float* S, int64_t lds, int64_t rows_p, const int64_t* pc,
                         const float* Vp, int64_t Bc, int64_t dvp, float* O) {
  constexpr int W = Vec<float>::W, NRW = kNR * W;
  const uint32_t* Pw = reinterpret_cast<const uint32_t*>(S);
  const uint16_t* Vh = reinterpret_cast<const uint16_t*>(Vp);
  for (int64_t c0 = 0; c0 < dvp;) {
    const int64_t width = c0 + NRW <= dvp ? NRW : W;
    const uint32_t* strip = reinterpret_cast<const uint32_t*>(Vh + c0 * Bc);
    for (int64_t i = 0; i < rows_p; i += kMR) {
      const int64_t c2lo = pc[2 * (i / kMR)] / 2, c2hi = (pc[2 * (i / kMR) + 1] + 1) / 2;
      if (c2hi <= c2lo) continue;
      if (width == NRW)
        pv_micro_dot<kMR, kNR>(Pw + i * lds + c2lo, lds, c2hi - c2lo, strip + c2lo * NRW, NRW,
                               O + i * dvp + c0, dvp);
      else
        pv_micro_dot<kMR, 1>(Pw + i * lds + c2lo, lds, c2hi - c2lo, strip + c2lo * W, W,
                             O + i * dvp + c0, dvp);
    }
    c0 += width;
  }
}

// NaN-safe P V for a V block holding inf/NaN (pv_block_guarded on the pair
// layout): P stays fp32, zero weights are skipped.
inline void pv_block_guarded_dot(const float* P, int64_t ldp, int64_t rows, int64_t cols,
                                 const float* Vp, int64_t Bc, int64_t dvp, float* O) {
  constexpr int W = Vec<float>::W, NRW = kNR * W;
  const uint16_t* Vh = reinterpret_cast<const uint16_t*>(Vp);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float p = P[r * ldp + c];
      if (p == 0.f) continue;
      for (int64_t c0 = 0; c0 < dvp;) {
        const int64_t width = c0 + NRW <= dvp ? NRW : W;
        const uint16_t* col = Vh + c0 * Bc + (c / 2) * width * 2 + (c & 1);
        for (int64_t e = 0; e < width; ++e) O[r * dvp + c0 + e] += p * bf16_to_f32(col[2 * e]);
        c0 += width;
      }
    }
}

// The K panels of pairs (d2p pairs per key, zeros past d): unit-stride rows
// 16 keys x 16 pairs per register transpose of 32-bit words where the vector
// has it (the words are only moved, so the panels are those of the element
// loop), the remaining pairs and any strides one word at a time.
// (A template over V so that the discarded branch is not compiled without it.)
template <typename V = Vec<float>>
void pack_k_pairs(const bf16_t* kbase, int64_t ldk, int64_t sd, int64_t cols, int64_t cols_p,
                  int64_t d, int64_t d2p, uint32_t* Kw) {
  constexpr int NRW = kNR * V::W;
  if constexpr (HasTranspose16<V>::value) {
    if (sd == 1) {
      static_assert(V::W == 16 && NRW % 16 == 0, "16-key groups inside a panel");
      for (int64_t c0 = 0; c0 < cols_p; c0 += 16) {  // cols_p is a multiple of NRW
        uint32_t* panel = Kw + (c0 / NRW) * d2p * NRW + c0 % NRW;
        const int64_t n = imax(0, imin(16, cols - c0));  // real keys of this group
        int64_t k2 = 0;
        for (; 2 * (k2 + 16) <= d; k2 += 16) {
          typename V::R x[16];
          for (int r = 0; r < 16; ++r)
            x[r] = r < n ? V::load(reinterpret_cast<const float*>(kbase + (c0 + r) * ldk + 2 * k2))
                         : V::zero();
          V::store_transposed16(reinterpret_cast<float*>(panel + k2 * NRW), NRW, x);
        }
        for (; k2 < d2p; ++k2)
          for (int r = 0; r < 16; ++r)
            panel[k2 * NRW + r] =
                r < n && 2 * k2 < d ? bf16_pair(kbase + (c0 + r) * ldk, 1, 2 * k2, d) : 0u;
      }
      return;
    }
  }
  for (int64_t c = 0; c < cols_p; ++c) {
    uint32_t* dst = Kw + (c / NRW) * d2p * NRW + c % NRW;
    const bf16_t* src = kbase + c * ldk;
    for (int64_t k2 = 0; k2 < d2p; ++k2)
      dst[k2 * NRW] = c < cols && 2 * k2 < d ? bf16_pair(src, sd, 2 * k2, d) : 0u;
  }
}

// The Q panels of pairs (unscaled, zero rows up to rows_p): unit-stride rows
// in 6-row panels 16 pairs (32 dims) at a time interleaved as 32-bit words in
// registers where the vector has it, one word at a time otherwise; same words.
template <typename V = Vec<float>>
void pack_q_pairs(const AttnArgs<bf16_t>& a, const bf16_t* qbase, int64_t i0, int64_t rows,
                  int64_t rows_p, uint32_t* Qw) {
  const int64_t d = a.d, d2 = (d + 1) / 2;
  if constexpr (HasInterleave6<V>::value) {
    if (kMR == 6 && a.sq.d == 1) {
      for (int64_t r0 = 0; r0 < rows_p; r0 += 6) {
        uint32_t* dst = Qw + r0 * d2;
        const bf16_t* src[6];
        const int64_t n = panel_rows6(qbase, a.sq.l, i0 + r0, rows - r0, src);
        int64_t k2 = 0;
        for (; 2 * (k2 + 16) <= d; k2 += 16) {
          typename V::R x[6];
          for (int r = 0; r < 6; ++r)
            x[r] = r < n ? V::load(reinterpret_cast<const float*>(src[r] + 2 * k2)) : V::zero();
          V::store_interleaved6(reinterpret_cast<float*>(dst + k2 * 6), x);
        }
        for (; k2 < d2; ++k2)
          for (int r = 0; r < 6; ++r)
            dst[k2 * 6 + r] = r < n ? bf16_pair(src[r], 1, 2 * k2, d) : 0u;
      }
      return;
    }
  }
  for (int64_t r = 0; r < rows_p; ++r) {
    uint32_t* dst = Qw + (r / kMR) * kMR * d2 + r % kMR;
    const bf16_t* src = qbase + (i0 + r) * a.sq.l;
    for (int64_t k2 = 0; k2 < d2; ++k2)
      dst[k2 * kMR] = r < rows ? bf16_pair(src, a.sq.d, 2 * k2, d) : 0u;
  }
}

// The V strips of pairs along the keys; returns whether the block holds an
// inf or NaN (exponent bits all set). Two whole unit-stride keys are paired W
// words at a time where the vector has key_pairs (same bits).
inline bool pack_v_pairs(const AttnArgs<bf16_t>& a, const bf16_t* vbase, int64_t cols,
                         int64_t cols_p, int64_t Bc, uint16_t* Vh) {
  constexpr int W = Vec<float>::W, NRW = kNR * W;
  const int64_t dv = a.dv, dvp = round_up(dv, W);
  bool bad16 = false;
#if defined(ATTN_ISA_AVX512_BF16)
  const bool vector_pairs = a.sv.d == 1;
  __mmask32 bad_mask = 0;
#endif
  for (int64_t col0 = 0; col0 < dvp;) {
    const int64_t width = col0 + NRW <= dvp ? NRW : W;
    uint16_t* panel = Vh + col0 * Bc;
    for (int64_t c = 0; c < cols_p; ++c) {
#if defined(ATTN_ISA_AVX512_BF16)
      if (vector_pairs && (c & 1) == 0 && c + 1 < cols && col0 + width <= dv) {
        const bf16_t* s0 = vbase + c * a.sv.l + col0;
        const bf16_t* s1 = s0 + a.sv.l;
        uint32_t* dw = reinterpret_cast<uint32_t*>(panel) + (c / 2) * width;
        for (int64_t e = 0; e < width; e += W) {
          const __m512i x = DotBf16::key_pairs(&s0[e].bits, &s1[e].bits);
          _mm512_storeu_si512(dw + e, x);
          bad_mask |= DotBf16::nonfinite(x);
        }
        ++c;  // the pair's second key is done
        continue;
      }
#endif
      uint16_t* dst = panel + (c / 2) * width * 2 + (c & 1);
      const int64_t n = c < cols ? imax(0, imin(width, dv - col0)) : 0;
      const bf16_t* src = vbase + c * a.sv.l + col0 * a.sv.d;
      for (int64_t e = 0; e < width; ++e) {
        const uint16_t h = e < n ? src[e * a.sv.d].bits : uint16_t(0);
        dst[2 * e] = h;
        bad16 = bad16 || (h & 0x7F80u) == 0x7F80u;  // inf or NaN
      }
    }
    col0 += width;
  }
#if defined(ATTN_ISA_AVX512_BF16)
  bad16 = bad16 || bad_mask != 0;
#endif
  return bad16;
}

// K and V of the pair paths, d's pairs padded to a multiple of kPad (DotPath:
// 1, AmxPath: whole B tiles); bf16 storage only.
template <int64_t kPad>
struct PairPacking {
  using S = bf16_t;
  using T = float;
  static int64_t pairs(int64_t d) { return round_up((d + 1) / 2, kPad); }
  static void pack_k(const AttnArgs<S>& a, const S* kbase, int64_t cols, int64_t cols_p, T* Kt) {
    pack_k_pairs(kbase, a.sk.l, a.sk.d, cols, cols_p, a.d, pairs(a.d),
                 reinterpret_cast<uint32_t*>(Kt));
  }
  static bool pack_v(const AttnArgs<S>& a, const S* vbase, int64_t cols, int64_t cols_p, int64_t Bc,
                     T* Vp) {
    return pack_v_pairs(a, vbase, cols, cols_p, Bc, reinterpret_cast<uint16_t*>(Vp));
  }
};

// The path's interface to the generic kernel (flash_fwd.cpp, ProductPath).
struct DotPath : PairPacking<1> {
  static constexpr int W = Vec<float>::W;
  // The fused row max and P rounded inside the softmax pass need AVX-512's
  // masked max (fold_row_max): not on the 4-lane BFDOT object.
  static constexpr bool kFuseMax = W == 16;
  static constexpr bool kPairs = true, kRaw = false;
  static constexpr int64_t kBlockK = 256;
  static constexpr bool kTallQ = false;

  static int64_t k_elems(int64_t d) { return d; }  // d / 2 words fit a d-float slot

  static void pack_q(const AttnArgs<S>& a, const S* qbase, int64_t i0, int64_t rows, int64_t rows_p,
                     T* Qp) {
    pack_q_pairs(a, qbase, i0, rows, rows_p, reinterpret_cast<uint32_t*>(Qp));
  }

  template <bool kMax = false>
  static void qk_panel(const AttnArgs<S>& a, Scratch<T>& sc, const T* Kt, int64_t i, int64_t jv,
                       bool /*raw*/, bool /*fuse_max*/, const int32_t* lim = nullptr) {
    const int64_t d2 = pairs(a.d);
    const uint32_t* Qw = reinterpret_cast<const uint32_t*>(sc.Qp) + i * d2;
    const uint32_t* Kw = reinterpret_cast<const uint32_t*>(Kt) + jv * d2;
    const float scale = static_cast<float>(a.scale);
    if constexpr (kMax)
      qk_micro_dot<kMR, kNR, true>(Qw, d2, Kw, scale, sc.S + i * sc.lds + jv, sc.lds,
                                   sc.rmax + i * W, lim);
    else
      qk_micro_dot<kMR, kNR>(Qw, d2, Kw, scale, sc.S + i * sc.lds + jv, sc.lds);
  }

  // pairs: the softmax left P as bf16 pairs already.
  static void pv_tile(Scratch<T>& sc, const T* Vp, int64_t rows, int64_t rows_p, int64_t cols,
                      int64_t cols_p, int64_t Bc, int64_t dvp, bool nonfinite, bool pairs) {
    if (nonfinite) {
      pv_block_guarded_dot(sc.S, sc.lds, rows, cols, Vp, Bc, dvp, sc.O);
    } else {
      if (!pairs) p_to_bf16(sc.S, sc.lds, rows_p, cols_p);
      pv_block_dot(sc.S, sc.lds, rows_p, sc.pc, Vp, Bc, dvp, sc.O);
    }
  }
};
