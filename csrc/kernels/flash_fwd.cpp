// The fused flash-attention forward kernel, O = softmax(scale * Q K^T) V.
//
// This one source is compiled once per instruction set (ATTN_ISA_SCALAR,
// ATTN_ISA_AVX2, ATTN_ISA_AVX512; see CMakeLists.txt) into its own namespace;
// csrc/dispatch.cpp picks one at import. It is not the readable reference:
// that is csrc/reference.cpp (plain loops), which tests compare this against.
//
// Shapes: q (B, Hq, Lq, d), k (B, Hkv, Lk, d), v (B, Hkv, Lk, dv),
//         o (B, Hq, Lq, dv), lse (B, Hq, Lq); all read through element strides.
//
// Tiling (FlashAttention-2 forward, names from the paper):
//   One work item = one (sequence, head, block of Br query rows). A thread
//   packs its Q block once (scaled by `scale`, rows padded with zeros to a
//   multiple of the micro-tile height MR, stored as MR-row panels, k-major),
//   then walks the key blocks of Bc keys (aligned to multiples of Bc) that the
//   structural masks leave visible, trimmed to the last visible key:
//     1. fetch the packed K and V block from the thread's cache (kv_block):
//        K as panels of NR*W keys, k-major (Kp[k][NR*W]); V as strips of
//        NR*W (then W) columns, each a contiguous [Bc][width] panel. A block
//        is packed once per thread and (sequence, kv head), not once per
//        query block, so GQA heads and later query blocks reuse it;
//     2. S = Q_blk K^T                    register-blocked MR x (NR*W) tiles,
//        key panel outer so that panel stays in L1. On a tile a structural
//        mask cuts (causal diagonal, window edges) each MR-row micro-panel
//        computes only the key panels its rows can see, and step 5 skips
//        the columns it cannot;
//     3. score transforms (softcap, ALiBi, additive bias) and element masks,
//        only on tiles that need them (diagonal/partial tiles);
//     4. online softmax per row: m_new = max(m, rowmax(S)),
//        P = 2^((S - m_new) log2 e) (exp2_neg: no clamps or blends needed for
//        arguments <= 0), l = l * exp(m - m_new) + rowsum(P),
//        O_acc *= exp(m - m_new) (skipped when the max did not move);
//     5. O_acc += P V                     register-blocked MR x (NR*W) tiles,
//        the V strip streamed from its panel
//   and finally O = O_acc / l, lse = m + log(l), written through o's strides.
//   The L x L score matrix never exists. Scratch per thread is
//   Br*d + Br*Bc + Br*dv_pad elements plus the K/V block cache, which holds
//   the packed blocks of one (sequence, kv head), at most kCacheBytes (blocks
//   are reused as a ring beyond that).
//
// Micro-kernels (the tile shape is IsaTraits in vec_*.h; AVX2: MR = 6,
//   NR = 2, W = 8): 12 accumulators, 2 panel loads and 6 broadcasts per 12
//   FMAs; the inner loops are pure loads and FMAs (checked in the
//   disassembly). AVX-512: 6 x 4 zmm, scalar 4 x 4. Packing: unit-stride Q and
//   K rows are transposed in registers where the vector type has
//   store_interleaved6 / store_transposed16 (AVX-512 float; on the vdpbf16ps
//   path the same transposes move 32-bit bf16 pairs), element by element
//   otherwise; a V strip row is copied and checked in one pass (bf16: two key
//   rows widened into pairs, the inf/NaN test on the pair vector).
//
// Fusions (AVX-512, compute type float; each gives the unfused bits): on a
//   tile that no mask cuts, no score transform touches and no padding column
//   ends (cols == cols_p), the QK micro-kernel also folds each row's maximum
//   into a vector at its store (sc.rmax; vmaxps on the FP add pipes), so step
//   4 has no max pass; on the vdpbf16ps path P is rounded to bf16 pairs inside
//   the softmax pass (its sum still taken in fp32) instead of a pass after it,
//   except on a V block with an inf/NaN, whose guarded product reads fp32 P.
//
// Code: process_item runs one work item as named steps (row_ranges, pack_q,
//   classify_tile, kv_block, panel_columns, qk_tile, softmax_rows with
//   score_transforms / element_masks / online_softmax_row, pv_tile,
//   finalize_rows); scratch is one ThreadArena block per thread
//   (carve_scratch); the shared helpers are kernels/toolkit.h and
//   attn_fast/seq.h, the storage types kernels/storage.h.
//
// Memory: Br = 48, Bc = 256, d = dv = 128 in fp32: Q block 24 KiB, a K panel
//   8 KiB (L1), a V strip 16 KiB (AVX-512: K panel 32 KiB, V strip 64 KiB,
//   which pv_strip walks in 32 KiB key chunks), S 48 KiB, O_acc 24 KiB; the K/V blocks
//   of a head (Lk * (d + dv) * 4 bytes) sit in L2/L3 and are streamed once
//   per query block, so Br = 96 when they exceed 2 MiB (long sequences; on
//   AVX-512 from 2 MiB).
//   Why these sizes (the measurements behind them): bench/notes_archive.md,
//   "Tuning history moved out of the kernel essays".
//
// Threads: OpenMP over work units, dynamic schedule: whole (sequence, kv head)
//   groups while there are at least 2 per thread (one thread packs a group's
//   K/V), then single items (one query block of one head), heaviest causal
//   blocks first, for the last nt groups. Each output row is computed by
//   exactly one thread in a fixed order, so results are bit-for-bit identical
//   for any thread count.
//
// Numerics: exp is the vector polynomial of vec_math.h (about 1 ulp in fp32;
//   the AVX-512 float softmax weights: Vec<float>::exp2_neg, vreduceps / vscalefps).
//   Rows that see no key (fully masked, padding) get O = 0 and lse = -inf,
//   never NaN. A +inf sink gives O = 0 and lse = +inf (its limit). A NaN/inf in a V row that is
//   masked for some query of the tile is not multiplied by 0: tiles whose packed V holds a
//   non-finite value use a path that skips zero weights, so masked rows cannot leak NaN.
//
// Storage types: q, k, v, o are float, double, bf16_t or fp16_t (the template
//   parameter S); the kernel computes in compute_t<S> (fp32 for the 16-bit
//   types). 16-bit values are widened where they are packed (Q block, K/V
//   panels: bf16 by a 16-bit shift, fp16 by F16C) and O is rounded once
//   (round to nearest even, NaN kept) in the finalize step; everything between
//   is the fp32 kernel, and lse, bias, alibi and sinks are fp32. Compiled as
//   the avx512_bf16 object (ATTN_ISA_AVX512_BF16), bf16 instead keeps Q, K, V
//   as bf16 pairs and runs vdpbf16ps micro-kernels for S = Q K^T (scale
//   applied to S in fp32) and O += P V (P rounded to bf16, as torch's bf16
//   SDPA does); the tiling, masking and softmax are unchanged.
//
// AMX tiles (the amx and amx_emu objects, ATTN_AMX_TILES; bf16 only): the
//   micro-panel is 16 query rows (kMR = 16, one tile's rows), S = Q K^T is
//   amx_qk_panel per (16 rows, 64-key panel): 4 C tiles, Q as the A tile in
//   chunks of 32 dims (d padded to 32 with zeros; a unit-stride Q row is
//   copied, it is its pairs already), K as B tiles in the vdpbf16ps path's
//   pair layout. Blocks default to Br = 96, Bc = 512 there (the fixed costs
//   per key block and row, and the K/V tile loads per product, halve).
//   Raw scores (no softcap, ALiBi or bias, scale > 0, the usual case): S
//   stays unscaled, each row's maximum is folded at the tile store on whole
//   tiles (amx_qk_panel_raw), and the softmax computes
//   P = 2^(s scale log2 e - m log2 e) in one FMA plus the degree-4 exp2 of
//   bf16 weights (exp2_neg_bf16), writing P as bf16 pairs in its pass;
//   otherwise the scale multiplies S in fp32 after the store and the steps
//   are the generic ones. O += P V takes two row panels at a time
//   (amx_pv_panel2: each V tile, read from L2, serves both), issued between
//   the next pair's softmax rows on the raw path (AmxPvJob,
//   softmax_pv_interleaved); O goes through the C tiles per 32-column half
//   strip. A V block with an inf/NaN takes the guarded product (AMX
//   multiplies 0 x NaN = NaN). The tile plan, layouts and numerics are in
//   kernels/amx_tiles.h; the tile registers are configured once per thread
//   in forward_impl's parallel region (AmxTiles). Measured: bench/notes_archive.md,
//   "amx5". Steps 1-7 of process_item are the same code on every path.
//
// Nothing here touches Python or the C++ standard containers (see seq.h for
// why per-ISA objects keep to plain functions).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attn_fast/attention.h"
#include "attn_fast/half.h"
#include "attn_fast/interrupt.h"
#include "attn_fast/kernel_entries.h"
#include "attn_fast/seq.h"

#include "isa.h"

namespace attn_fast {
namespace ATTN_NS {

#include ATTN_VEC_HEADER

namespace {

#include "amx_tiles.h"  // the AMX tile plan and ops (amx / amx_emu objects only)
#if defined(ATTN_ISA_NEON)
#include "neon_tiles.h"  // the 6 x 4 Q K^T tiles by lane-indexed FMLA / BFDOT (neon objects)
#endif

// Storage type S of q, k, v, o <-> compute type compute_t<S>. The 16-bit
// types are read into fp32 where the kernel packs (Q block, K/V panels) and
// written back once, in the finalize step; every other step is the fp32 kernel.
#include "storage.h"  // Storage<S>, ld / put / bits_of
#include "scores.h"   // add_alibi_bias, mask_user_row
#include "toolkit.h"  // NEG_INF, online_softmax_row, ThreadArena

}  // namespace
// The micro-tile (vec_*.h); the AMX objects use 16-row micro-panels (one tile's rows).
constexpr int kMR = kAmxTiles ? 16 : IsaTraits::kMR, kNR = IsaTraits::kNR;
namespace {

// dst[0..n) = src[0..n) in the compute type (unit stride both sides):
// copied for the native types, converted W at a time for the others.
template <typename S>
inline void ld_row(const S* src, compute_t<S>* dst, int64_t n) {
  using St = Storage<S>;
  if constexpr (St::kNative) {
    if (n > 0) std::memcpy(dst, src, sizeof(S) * n);
  } else {
    using V = Vec<compute_t<S>>;
    int64_t e = 0;
    for (; e + V::W <= n; e += V::W) V::store(dst + e, St::load(src + e));
    for (; e < n; ++e) dst[e] = St::ld(src + e);
  }
}

// dst[0..n) = src[0..n) * f in the storage type (unit stride both sides).
template <typename S>
inline void st_row(S* dst, const compute_t<S>* src, compute_t<S> f, int64_t n) {
  using St = Storage<S>;
  if constexpr (St::kNative) {
    for (int64_t e = 0; e < n; ++e) dst[e] = src[e] * f;
  } else {
    using V = Vec<compute_t<S>>;
    const typename V::R vf = V::set1(f);
    int64_t e = 0;
    for (; e + V::W <= n; e += V::W) St::store(dst + e, V::mul(V::load(src + e), vf));
    for (; e < n; ++e) St::put(dst + e, src[e] * f);
  }
}

// S[MR][NR*W] = Q[MR][d] * K^T for one micro-tile. Qp is an MR-row panel
// stored k-major (Qp[k*MR + r]), Kp a packed panel of NR*W keys stored k-major
// (Kp[k*NR*W + c]): both are read as two contiguous streams, the inner loop is
// NR aligned loads, MR broadcasts and MR*NR FMAs.
// kMax: also rmax[r*W ..] = max(rmax[r*W ..], the row's NR vectors) at the store
// (the online softmax's row max without a pass over S; max is exact, so the
// same m). vmaxps runs on the FP add pipes, beside the FMAs. lim (or nullptr:
// every column counts): row r counts only the micro-tile's columns
// [lim[2r], lim[2r+1]) (0 <= lim <= NR*W), the others are masked for it.
template <int MR, int NR, typename R>
inline void fold_row_max(const R (&acc)[MR][NR], float* __restrict rmax,
                         const int32_t* __restrict lim) {
  using V = Vec<float>;
  for (int r = 0; r < MR; ++r) {
    R x = V::set1(NEG_INF<float>);
    if (!lim) {
      for (int n = 0; n < NR; ++n) x = V::max(x, acc[r][n]);
    } else {
#if defined(ATTN_ISA_AVX512)
      const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      const __m512i lo = _mm512_set1_epi32(lim[2 * r]), hi = _mm512_set1_epi32(lim[2 * r + 1]);
      for (int n = 0; n < NR; ++n) {
        const __m512i c = _mm512_add_epi32(iota, _mm512_set1_epi32(n * V::W));
        const __mmask16 vis = _mm512_cmpge_epi32_mask(c, lo) & _mm512_cmplt_epi32_mask(c, hi);
        x = _mm512_mask_max_ps(x, vis, x, acc[r][n]);
      }
#endif
    }
    V::store(rmax + r * V::W, V::max(V::load(rmax + r * V::W), x));
  }
}
template <typename T, int MR, int NR, bool kMax = false>
inline void qk_micro(const T* __restrict Qp, int64_t d, const T* __restrict Kp, T* __restrict S,
                     int64_t lds, T* __restrict rmax = nullptr,
                     const int32_t* __restrict lim = nullptr) {
  using V = Vec<T>;
  constexpr int W = V::W;
#if defined(ATTN_ISA_NEON)
  if constexpr (std::is_same<T, float>::value && MR == 6 && NR == 4 && !kMax)
    return qk_micro_neon_6x4(Qp, d, Kp, S, lds);  // the same sums (neon_tiles.h)
#endif
  typename V::R acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = V::zero();
  for (int64_t k = 0; k < d; ++k) {
    typename V::R b[NR];
    for (int n = 0; n < NR; ++n) b[n] = V::load(Kp + k * (NR * W) + n * W);
    for (int r = 0; r < MR; ++r) {
      const typename V::R a = V::set1(Qp[k * MR + r]);
      for (int n = 0; n < NR; ++n) acc[r][n] = V::fma(a, b[n], acc[r][n]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) V::store(S + r * lds + n * W, acc[r][n]);
  if constexpr (kMax) fold_row_max<MR, NR>(acc, rmax, lim);
}

// The vdpbf16ps path (the avx512_bf16 object, bf16 storage only): Q and K stay
// bf16 and are packed as pairs along d (one 32-bit word = elements 2k, 2k+1;
// an odd d is padded with a zero), Qw[k2*MR + r] and Kw[k2*NR*W + c]; each
// vdpbf16ps does W keys x 2 dims, twice the multiply-adds of an fp32 FMA.
// Products are exact in fp32 and accumulate in fp32; the scale (and nothing
// else) multiplies S in fp32 at the store, so scale * Q is never rounded to
// bf16. P V stays the fp32 kernel (P is not rounded to bf16 either).
#if defined(ATTN_DOT_BF16)
constexpr bool kDotBf16 = true;
template <int MR, int NR, bool kMax = false>
inline void qk_micro_dot(const uint32_t* __restrict Qw, int64_t d2, const uint32_t* __restrict Kw,
                         float scale, float* __restrict S, int64_t lds,
                         float* __restrict rmax = nullptr,
                         const int32_t* __restrict lim = nullptr) {
  using V = Vec<float>;
  using D = DotBf16;
  constexpr int W = V::W;
#if defined(ATTN_ISA_NEON_BF16)
  if constexpr (MR == 6 && NR == 4 && !kMax)
    return qk_micro_dot_neon_6x4(Qw, d2, Kw, scale, S, lds);  // the same sums (neon_tiles.h)
#endif
  V::R acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = V::zero();
  for (int64_t k = 0; k < d2; ++k) {
    D::B b[NR];
    for (int n = 0; n < NR; ++n) b[n] = D::load(Kw + k * (NR * W) + n * W);
    for (int r = 0; r < MR; ++r) {
      const D::B a = D::set1(Qw[k * MR + r]);
      for (int n = 0; n < NR; ++n) acc[r][n] = D::dot(acc[r][n], a, b[n]);
    }
  }
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
  using D = DotBf16;
  constexpr int W = V::W;
  V::R acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = V::load(O + r * ldo + n * W);
  for (int64_t c = 0; c < c2n; ++c) {
    D::B b[NR];
    for (int n = 0; n < NR; ++n) b[n] = D::load(Vw + c * ldv + n * W);
    for (int r = 0; r < MR; ++r) {
      const D::B a = D::set1(Pw[r * ldp + c]);
      for (int n = 0; n < NR; ++n) acc[r][n] = D::dot(acc[r][n], a, b[n]);
    }
  }
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

// O[rows_p][dvp] += P V on the bf16-pair layouts; column ranges pc as pv_block,
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

// NaN-safe P V for a V block holding inf/NaN (pv_block_guarded on the pair layout):
// P stays fp32, zero weights are skipped.
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
#else
constexpr bool kDotBf16 = false;
#endif
// The bf16 pair (x[e], x[e + 1]) of a strided row as one word; e + 1 == d pads with 0.
[[maybe_unused]] inline uint32_t bf16_pair(const bf16_t* x, int64_t stride, int64_t e, int64_t d) {
  const uint32_t lo = x[e * stride].bits, hi = e + 1 < d ? x[(e + 1) * stride].bits : 0u;
  return lo | (hi << 16);
}
template <typename S>
constexpr bool dot_path() {
  return kDotBf16 && std::is_same<S, bf16_t>::value;
}
// The AMX tile path (amx / amx_emu objects, bf16): the vdpbf16ps path's K and
// V layouts with the pair count of d padded to whole tiles (amx_tiles.h), Q
// row-major, and tile micro-kernels for S = Q K^T and O += P V.
template <typename S>
constexpr bool amx_path() {
  return kAmxTiles && dot_path<S>();
}
// Pairs per key (and per Q row) in the packed K / Q of the bf16 paths.
template <typename S>
inline int64_t packed_pairs(int64_t d) {
  return amx_path<S>() ? round_up((d + 1) / 2, 16) : (d + 1) / 2;
}
// Elements of compute_t<S> per key in a K slot and per row of the Q block: d,
// or more on the AMX path where the padded pairs need them (d < 16).
template <typename S>
inline int64_t k_elems(int64_t d) {
  return amx_path<S>() ? imax(d, packed_pairs<S>(d)) : d;
}

// O[MR][NR*W] += P[MR][cols] * Vp[cols][ldv].
template <typename T, int MR, int NR>
inline void pv_micro(const T* __restrict P, int64_t ldp, int64_t cols, const T* __restrict Vp,
                     int64_t ldv, T* __restrict O, int64_t ldo) {
  using V = Vec<T>;
  constexpr int W = V::W;
  typename V::R acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = V::load(O + r * ldo + n * W);
  for (int64_t c = 0; c < cols; ++c) {
    typename V::R b[NR];
    for (int n = 0; n < NR; ++n) b[n] = V::load(Vp + c * ldv + n * W);
    for (int r = 0; r < MR; ++r) {
      const typename V::R a = V::set1(P[r * ldp + c]);
      for (int n = 0; n < NR; ++n) acc[r][n] = V::fma(a, b[n], acc[r][n]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) V::store(O + r * ldo + n * W, acc[r][n]);
}

// Packed V layout: the dvp columns are cut into strips, full strips of
// kNR*W columns then W-wide tail strips; each strip is stored as a contiguous
// [Bc][width] panel at offset col0 * Bc, so the P*V micro-kernel streams it.
// Element (c, e) of a packed block:
template <typename T>
inline int64_t vp_index(int64_t c, int64_t e, int64_t Bc, int64_t dvp) {
  constexpr int W = Vec<T>::W, NRW = kNR * W;
  int64_t col0 = e / NRW * NRW, width = NRW;
  if (col0 + NRW > dvp) {
    col0 = e / W * W;
    width = W;
  }
  return col0 * Bc + c * width + (e - col0);
}

// Micro-panel p (rows p*kMR .. p*kMR + kMR-1) uses only the columns
// [pc[2p], pc[2p+1]) of the tile: its weights outside are all zero (keys no
// row of the panel sees), so they are skipped, not multiplied.
// The keys go in chunks of kPvChunk<T, NR> (k0 outer, micro-panels inner), so
// that the chunk of the strip (at most 32 KiB) stays in L1 while every
// micro-panel reads it: a whole strip of Bc = 256 keys x 64 floats (64 KiB)
// would come from L2 once per micro-panel. O is stored and reloaded between
// chunks (exact), and each O element gets the same FMAs in the same key
// order, so the bits are those of one pass.
#ifndef ATTN_PV_CHUNK_BYTES
#define ATTN_PV_CHUNK_BYTES 32768
#endif
template <typename T, int NR>
constexpr int64_t kPvChunk = ATTN_PV_CHUNK_BYTES / (NR * Vec<T>::W * int64_t(sizeof(T))) > 64
                                 ? ATTN_PV_CHUNK_BYTES / (NR * Vec<T>::W * int64_t(sizeof(T)))
                                 : 64;
template <typename T, int NR>
inline void pv_strip(const T* P, int64_t ldp, int64_t rows_p, const int64_t* pc, const T* Vstrip,
                     T* O, int64_t ldo, int64_t col0) {
  constexpr int W = Vec<T>::W;
  int64_t c_max = 0;
  for (int64_t i = 0; i < rows_p; i += kMR) c_max = imax(c_max, pc[2 * (i / kMR) + 1]);
  for (int64_t k0 = 0; k0 < c_max; k0 += kPvChunk<T, NR>) {
    const int64_t k1 = k0 + kPvChunk<T, NR>;
    for (int64_t i = 0; i < rows_p; i += kMR) {
      const int64_t c_lo = imax(k0, pc[2 * (i / kMR)]), c_hi = imin(k1, pc[2 * (i / kMR) + 1]);
      if (c_hi > c_lo)
        pv_micro<T, kMR, NR>(P + i * ldp + c_lo, ldp, c_hi - c_lo, Vstrip + c_lo * NR * W, NR * W,
                             O + i * ldo + col0, ldo);
    }
  }
}

// O[rows_p][dvp] += P[rows_p][cols] * V[cols][dvp]; V packed in strips of a
// Bc-row block (vp_index); rows_p % kMR == 0, dvp % W == 0; pc: the column
// range of each micro-panel (pv_strip).
template <typename T>
void pv_block(const T* P, int64_t ldp, int64_t rows_p, const int64_t* pc, const T* Vp, int64_t Bc,
              int64_t dvp, T* O) {
  constexpr int W = Vec<T>::W;
  int64_t c0 = 0;
  for (; c0 + kNR * W <= dvp; c0 += kNR * W)
    pv_strip<T, kNR>(P, ldp, rows_p, pc, Vp + c0 * Bc, O, dvp, c0);
  for (; c0 < dvp; c0 += W) pv_strip<T, 1>(P, ldp, rows_p, pc, Vp + c0 * Bc, O, dvp, c0);
}

// NaN-safe P*V for tiles whose V block holds a non-finite value: weights that
// are exactly zero (masked pairs) are skipped instead of multiplied.
template <typename T>
void pv_block_guarded(const T* P, int64_t ldp, int64_t rows, int64_t cols, const T* Vp, int64_t Bc,
                      int64_t dvp, T* O) {
  using V = Vec<T>;
  constexpr int W = V::W;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const T p = P[r * ldp + c];
      if (p == T(0)) continue;
      const typename V::R a = V::set1(p);
      for (int64_t e = 0; e < dvp; e += W)
        V::store(O + r * dvp + e,
                 V::fma(a, V::load(Vp + vp_index<T>(c, e, Bc, dvp)), V::load(O + r * dvp + e)));
    }
}

// One thread's buffers (carve_scratch: one ThreadArena block).
template <typename T>
struct Scratch {
  T* Qp = nullptr;    // Brp * d: Q block scaled, MR-row panels, k-major
  T* S = nullptr;     // Brp * lds: scores, then P
  int64_t lds = 0;    // S row stride: Bc + one cache line (rows a power of two apart share L1 sets)
  T* O = nullptr;     // Brp * dvp: unnormalised output accumulator
  T* m = nullptr;     // Brp: running row max
  T* rmax = nullptr;  // Brp * W: the tile's row maxima as vectors (qk_tile's fused max)
  T* l = nullptr;     // Brp: running row sum
  int64_t* lo = nullptr;  // Brp: structural key range of each row
  int64_t* hi = nullptr;
  int64_t* pc = nullptr;         // 2 per micro-panel: the tile columns its rows can see
  T* Kc = nullptr;               // nslots * Bc * d: panels of kNR*W keys, k-major
  T* Vc = nullptr;               // nslots * Bc * dvp: rows
  int64_t* tag = nullptr;        // nslots: block held by the slot, -1 = none
  uint8_t* nonfinite = nullptr;  // nslots: the slot's V block holds an inf/NaN
  int64_t nslots = 1;
  int64_t key_s = -1, key_hk = -1;  // owner of the cached blocks
#if defined(ATTN_AMX_TILES)
  AmxTiles* tiles = nullptr;  // the thread's tile registers (forward_impl)
#endif
};

constexpr int64_t kCacheBytes = int64_t(24) << 20;

// The K panels of kv_block (Kt[(c / NRW) * d * NRW + e * NRW + c % NRW] = key c,
// dim e; keys [cols, cols_p) zero): any strides, one value at a time.
template <typename S, typename T>
void pack_k_strided(const S* kbase, int64_t ldk, int64_t sd, int64_t cols, int64_t cols_p,
                    int64_t d, T* Kt) {
  constexpr int NRW = kNR * Vec<T>::W;
  for (int64_t c = 0; c < cols_p; ++c) {
    T* dst = Kt + (c / NRW) * d * NRW + c % NRW;
    if (c < cols) {
      const S* src = kbase + c * ldk;
      for (int64_t e = 0; e < d; ++e) dst[e * NRW] = ld(src + e * sd);
    } else {
      for (int64_t e = 0; e < d; ++e) dst[e * NRW] = T(0);
    }
  }
}

// Whether Vec<T> has store_transposed16 (the AVX-512 float vector does).
template <typename V, typename = void>
struct HasTranspose16 : std::false_type {};
template <typename V>
struct HasTranspose16<
    V, std::void_t<decltype(V::store_transposed16(static_cast<float*>(nullptr), int64_t(0),
                                                  static_cast<const typename V::R*>(nullptr)))>>
    : std::true_type {};
template <typename T>
[[maybe_unused]] constexpr bool kTranspose16 = HasTranspose16<Vec<T>>::value;

// The K panels from unit-stride key rows, 16 keys x 16 dims per register
// transpose (16 loads and 16 stores where pack_k_strided does 256 of each);
// the values are copied (or widened exactly), so the panels are the same.
template <typename S, typename T>
void pack_k_rows16(const S* kbase, int64_t ldk, int64_t cols, int64_t cols_p, int64_t d, T* Kt) {
  using V = Vec<T>;
  constexpr int NRW = kNR * V::W;
  static_assert(V::W == 16 && NRW % 16 == 0, "16-key groups inside a panel");
  for (int64_t c0 = 0; c0 < cols_p; c0 += 16) {  // cols_p is a multiple of NRW
    T* panel = Kt + (c0 / NRW) * d * NRW + c0 % NRW;
    const int64_t n = imax(0, imin(16, cols - c0));  // real keys of this group
    int64_t e = 0;
    for (; e + 16 <= d; e += 16) {
      typename V::R x[16];
      for (int r = 0; r < 16; ++r)
        x[r] = r < n ? Storage<S>::load(kbase + (c0 + r) * ldk + e) : V::zero();
      V::store_transposed16(panel + e * NRW, NRW, x);
    }
    for (; e < d; ++e)
      for (int r = 0; r < 16; ++r)
        panel[e * NRW + r] = r < n ? ld(kbase + (c0 + r) * ldk + e) : T(0);
  }
}

#if defined(ATTN_ISA_AVX512_BF16)
// The bf16 K panels of the pair paths (kv_block) from unit-stride key rows:
// 16 keys x 16 pairs (32 dims) per register transpose of 32-bit words, the
// remaining pairs (d % 32, the padding to d2p) one word at a time. The words
// are only moved, so the panels are those of the element loop.
template <typename S>
void pack_k_pairs16(const S* kbase, int64_t ldk, int64_t cols, int64_t cols_p, int64_t d,
                    int64_t d2p, uint32_t* Kw) {
  using V = Vec<float>;
  constexpr int NRW = kNR * V::W;
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
}
#endif

// Returns the slot holding packed key block `blk` of (sequence s, kv head hk),
// packing it on a miss. Columns past the sequence end are zero up to the
// panel width.
template <typename S>
int64_t kv_block(const AttnArgs<S>& a, const SeqInfo& si, int64_t s, int64_t hk, int64_t blk,
                 int64_t Bc, Scratch<compute_t<S>>& sc) {
  using T = compute_t<S>;
  using V = Vec<T>;
  constexpr int W = V::W;
  constexpr int NRW = kNR * W;
  if (sc.key_s != s || sc.key_hk != hk) {
    for (int64_t i = 0; i < sc.nslots; ++i) sc.tag[i] = -1;
    sc.key_s = s;
    sc.key_hk = hk;
  }
  const int64_t slot = blk % sc.nslots;
  if (sc.tag[slot] == blk) return slot;
  const int64_t d = a.d, dv = a.dv, dvp = round_up(dv, W);
  const int64_t j0 = blk * Bc;
  const int64_t cols = imin(Bc, si.k_len - j0), cols_p = round_up(cols, NRW);
  const S* kbase = a.k + si.b * a.sk.b + hk * a.sk.h + (si.k0 + j0) * a.sk.l;
  const S* vbase = a.v + si.b * a.sv.b + hk * a.sv.h + (si.k0 + j0) * a.sv.l;
  T* Kt = sc.Kc + slot * Bc * k_elems<S>(d);
  if constexpr (dot_path<S>()) {
    // bf16 pairs along d (see qk_micro_dot): the slot's Bc * d floats hold Bc * d2 words.
    // The AMX path pads the pairs to d2p (zeros), amx_tiles.h.
    const int64_t d2p = packed_pairs<S>(d);
    uint32_t* Kw = reinterpret_cast<uint32_t*>(Kt);
#if defined(ATTN_ISA_AVX512_BF16)
    if (a.sk.d == 1) {
      pack_k_pairs16(kbase, a.sk.l, cols, cols_p, d, d2p, Kw);
    } else
#endif
    {
      for (int64_t c = 0; c < cols_p; ++c) {
        uint32_t* dst = Kw + (c / NRW) * d2p * NRW + c % NRW;
        const S* src = kbase + c * a.sk.l;
        for (int64_t k2 = 0; k2 < d2p; ++k2)
          dst[k2 * NRW] = c < cols && 2 * k2 < d ? bf16_pair(src, a.sk.d, 2 * k2, d) : 0u;
      }
    }
  } else if constexpr (kTranspose16<T>) {
    if (a.sk.d == 1)
      pack_k_rows16(kbase, a.sk.l, cols, cols_p, d, Kt);
    else
      pack_k_strided(kbase, a.sk.l, a.sk.d, cols, cols_p, d, Kt);
  } else {
    pack_k_strided(kbase, a.sk.l, a.sk.d, cols, cols_p, d, Kt);
  }
  T* Vp = sc.Vc + slot * Bc * dvp;
  if constexpr (dot_path<S>()) {
    // bf16 pairs along the keys (pv_micro_dot): strip words (c2, e) = (v[2 c2][e], v[2 c2 + 1][e]).
    uint16_t* Vh = reinterpret_cast<uint16_t*>(Vp);
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
          // Keys c and c + 1 whole and unit-stride: W words at a time (same bits).
          const S* s0 = vbase + c * a.sv.l + col0;
          const S* s1 = s0 + a.sv.l;
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
        const S* src = vbase + c * a.sv.l + col0 * a.sv.d;
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
    sc.nonfinite[slot] = bad16;
    sc.tag[slot] = blk;
    return slot;
  }
  // x * 0 summed over the block: NaN iff some x is inf or NaN. Four partial
  // sums, so that the check is not one chain of dependent adds.
  typename V::R bad[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
  for (int64_t col0 = 0; col0 < dvp;) {
    const int64_t width = col0 + NRW <= dvp ? NRW : W;
    T* panel = Vp + col0 * Bc;
    for (int64_t c = 0; c < cols_p; ++c) {
      T* dst = panel + c * width;
      const int64_t n = c < cols ? imax(0, imin(width, dv - col0)) : 0;
      const S* src = vbase + c * a.sv.l + col0 * a.sv.d;
      if (a.sv.d == 1 && n == width) {  // a whole unit-stride row: copy and check in one pass
        for (int64_t e = 0, i = 0; e < width; e += W, i = (i + 1) & 3) {
          const typename V::R x = Storage<S>::load(src + e);
          V::store(dst + e, x);
          bad[i] = V::add(bad[i], V::mul(x, V::zero()));
        }
        continue;
      }
      if (a.sv.d == 1) {
        ld_row(src, dst, n);
      } else {
        for (int64_t e = 0; e < n; ++e) dst[e] = ld(src + e * a.sv.d);
      }
      for (int64_t e = n; e < width; ++e) dst[e] = T(0);
      for (int64_t e = 0; e < width; e += W)
        bad[0] = V::add(bad[0], V::mul(V::load(dst + e), V::zero()));
    }
    col0 += width;
  }
  const T b = V::hsum(V::add(V::add(bad[0], bad[1]), V::add(bad[2], bad[3])));
  sc.nonfinite[slot] = b != T(0) || b != b;
  sc.tag[slot] = blk;
  return slot;
}

// Tile classification against the block-sparse layout and the dense mask
// (TileClass, attention.h: the numbering Python's masks.block_summary uses).
template <typename T>
TileClass classify_user_masks(const AttnArgs<T>& a, const SeqInfo& si, int64_t h, int64_t i0,
                              int64_t rows, int64_t j0, int64_t cols) {
  bool any = false, all = true;
  if (a.layout) {
    const uint8_t* L = a.layout + si.b * a.slayout.b + h * a.slayout.h;
    const int64_t qb0 = i0 / a.layout_bq, qb1 = (i0 + rows - 1) / a.layout_bq;
    const int64_t kb0 = j0 / a.layout_bk, kb1 = (j0 + cols - 1) / a.layout_bk;
    for (int64_t x = qb0; x <= qb1; ++x)
      for (int64_t y = kb0; y <= kb1; ++y) {
        const bool vis = L[x * a.slayout.l + y * a.slayout.d] != 0;
        any = any || vis;
        all = all && vis;
      }
    if (!any) return TileClass::masked;
  }
  if (a.mask) {
    // A mask broadcast over the query axis (a key-padding mask: stride 0) is
    // the same row for every query: one row says it. Each row is an OR / AND
    // reduction without branches; the scan stops once the tile is known mixed.
    bool many = false, mall = true;
    const uint8_t* M = a.mask + si.b * a.smask.b + h * a.smask.h;
    const int64_t nr = a.smask.l == 0 ? imin(rows, 1) : rows;
    for (int64_t r = 0; r < nr && !(many && !mall); ++r) {
      const uint8_t* row = M + (i0 + r) * a.smask.l + j0 * a.smask.d;
      unsigned any_v = 0, all_v = 1;
      if (a.smask.d == 1) {
        for (int64_t c = 0; c < cols; ++c) {
          const unsigned vis = row[c] != 0;
          any_v |= vis;
          all_v &= vis;
        }
      } else {
        for (int64_t c = 0; c < cols; ++c) {
          const unsigned vis = row[c * a.smask.d] != 0;
          any_v |= vis;
          all_v &= vis;
        }
      }
      many = many || any_v;
      mall = mall && all_v;
    }
    if (!many) return TileClass::masked;
    all = all && mall;
  }
  return all ? TileClass::visible : TileClass::partial;
}

// ---------------------------------------------------------------------------
// The steps of one work item (process_item below runs them in this order).

// Per-row structural key ranges [sc.lo[r], sc.hi[r]) of rows i0 .. i0+rows-1
// and their union [*jlo, *jhi) (empty: *jhi <= *jlo).
template <typename S, typename T>
void row_ranges(const AttnArgs<S>& a, const SeqInfo& si, int64_t i0, int64_t rows, Scratch<T>& sc,
                int64_t* jlo, int64_t* jhi) {
  int64_t lo = si.k_len, hi = 0;
  for (int64_t r = 0; r < rows; ++r) {
    row_range(a, si, i0 + r, &sc.lo[r], &sc.hi[r]);
    if (sc.hi[r] > sc.lo[r]) {
      lo = imin(lo, sc.lo[r]);
      hi = imax(hi, sc.hi[r]);
    }
  }
  *jlo = lo;
  *jhi = hi;
}

// pack_q's element loop: any strides, any storage type, one value at a time.
template <typename S>
void pack_q_strided(const AttnArgs<S>& a, const S* qbase, int64_t i0, int64_t rows, int64_t rows_p,
                    compute_t<S>* Qp) {
  using T = compute_t<S>;
  const int64_t d = a.d;
  const T scale = static_cast<T>(a.scale);
  for (int64_t r = 0; r < rows_p; ++r) {
    T* dst = Qp + (r / kMR) * kMR * d + r % kMR;
    if (r < rows) {
      const S* src = qbase + (i0 + r) * a.sq.l;
      for (int64_t e = 0; e < d; ++e) dst[e * kMR] = ld(src + e * a.sq.d) * scale;
    } else {
      for (int64_t e = 0; e < d; ++e) dst[e * kMR] = T(0);
    }
  }
}

// Whether Vec<T> has store_interleaved6 (the AVX-512 float vector does).
template <typename V, typename = void>
struct HasInterleave6 : std::false_type {};
template <typename V>
struct HasInterleave6<
    V, std::void_t<decltype(V::store_interleaved6(static_cast<float*>(nullptr),
                                                  static_cast<const typename V::R*>(nullptr)))>>
    : std::true_type {};
template <typename T>
[[maybe_unused]] constexpr bool kInterleave6 = HasInterleave6<Vec<T>>::value;

// pack_q for unit-stride rows and 6-row panels: W columns of the panel's six
// rows are loaded, scaled and interleaved in registers (six stores instead of
// 6 W scalar ones); the same products as pack_q_strided, so the same bits.
template <typename S>
void pack_q_rows6(const AttnArgs<S>& a, const S* qbase, int64_t i0, int64_t rows, int64_t rows_p,
                  compute_t<S>* Qp) {
  using T = compute_t<S>;
  using V = Vec<T>;
  constexpr int W = V::W;
  const int64_t d = a.d;
  const T scale = static_cast<T>(a.scale);
  const typename V::R vs = V::set1(scale);
  for (int64_t r0 = 0; r0 < rows_p; r0 += 6) {
    T* dst = Qp + r0 * d;
    const int64_t n = imax(0, imin(6, rows - r0));  // real rows of this panel
    const S* src[6];
    for (int r = 0; r < 6; ++r) src[r] = qbase + (i0 + r0 + (r < n ? r : 0)) * a.sq.l;
    int64_t e = 0;
    for (; e + W <= d; e += W) {
      typename V::R x[6];
      for (int r = 0; r < 6; ++r)
        x[r] = r < n ? V::mul(Storage<S>::load(src[r] + e), vs) : V::zero();
      V::store_interleaved6(dst + e * 6, x);
    }
    for (; e < d; ++e)
      for (int r = 0; r < 6; ++r) dst[e * 6 + r] = r < n ? ld(src[r] + e) * scale : T(0);
  }
}

#if defined(ATTN_ISA_AVX512_BF16)
// pack_q of the vdpbf16ps path for unit-stride rows and 6-row panels: 16 pairs
// (32 dims) of the panel's six rows interleaved as 32-bit words in registers
// (store_interleaved6), the remaining pairs one word at a time; same words.
template <typename S>
void pack_q_pairs6(const AttnArgs<S>& a, const S* qbase, int64_t i0, int64_t rows, int64_t rows_p,
                   uint32_t* Qw) {
  using V = Vec<float>;
  const int64_t d = a.d, d2 = (d + 1) / 2;
  for (int64_t r0 = 0; r0 < rows_p; r0 += 6) {
    uint32_t* dst = Qw + r0 * d2;
    const int64_t n = imax(0, imin(6, rows - r0));  // real rows of this panel
    const S* src[6];
    for (int r = 0; r < 6; ++r) src[r] = qbase + (i0 + r0 + (r < n ? r : 0)) * a.sq.l;
    int64_t k2 = 0;
    for (; 2 * (k2 + 16) <= d; k2 += 16) {
      typename V::R x[6];
      for (int r = 0; r < 6; ++r)
        x[r] = r < n ? V::load(reinterpret_cast<const float*>(src[r] + 2 * k2)) : V::zero();
      V::store_interleaved6(reinterpret_cast<float*>(dst + k2 * 6), x);
    }
    for (; k2 < d2; ++k2)
      for (int r = 0; r < 6; ++r) dst[k2 * 6 + r] = r < n ? bf16_pair(src[r], 1, 2 * k2, d) : 0u;
  }
}
#endif

// 1. Pack Q: rows i0 .. i0+rows-1 (scaled) as kMR-row panels, k-major
// (Qp[(r / kMR) * kMR * d + k * kMR + r % kMR]); zero rows up to rows_p.
// The vdpbf16ps path packs unscaled bf16 pairs instead (qk_micro_dot).
template <typename S>
void pack_q(const AttnArgs<S>& a, const S* qbase, int64_t i0, int64_t rows, int64_t rows_p,
            compute_t<S>* Qp) {
  using T = compute_t<S>;
  const int64_t d = a.d;
  if constexpr (amx_path<S>()) {
    // Row-major unscaled bf16 pairs, padded to d2p (the A tiles of amx_qk_panel).
    const int64_t d2p = packed_pairs<S>(d);
    uint32_t* Qw = reinterpret_cast<uint32_t*>(Qp);
    for (int64_t r = 0; r < rows_p; ++r) {
      const S* src = qbase + (i0 + r) * a.sq.l;
      uint32_t* dst = Qw + r * d2p;
      if (r < rows && a.sq.d == 1) {  // a unit-stride row is its pairs already
        std::memcpy(dst, src, sizeof(S) * d);
        uint16_t* h = reinterpret_cast<uint16_t*>(dst);
        for (int64_t e = d; e < 2 * d2p; ++e) h[e] = 0;
        continue;
      }
      for (int64_t k2 = 0; k2 < d2p; ++k2)
        dst[k2] = r < rows && 2 * k2 < d ? bf16_pair(src, a.sq.d, 2 * k2, d) : 0u;
    }
  } else if constexpr (dot_path<S>()) {
    // Unscaled bf16 pairs (the scale multiplies S in fp32, qk_micro_dot).
    const int64_t d2 = (d + 1) / 2;
    uint32_t* Qw = reinterpret_cast<uint32_t*>(Qp);
#if defined(ATTN_ISA_AVX512_BF16)
    if (kMR == 6 && a.sq.d == 1) return pack_q_pairs6(a, qbase, i0, rows, rows_p, Qw);
#endif
    for (int64_t r = 0; r < rows_p; ++r) {
      uint32_t* dst = Qw + (r / kMR) * kMR * d2 + r % kMR;
      const S* src = qbase + (i0 + r) * a.sq.l;
      for (int64_t k2 = 0; k2 < d2; ++k2)
        dst[k2 * kMR] = r < rows ? bf16_pair(src, a.sq.d, 2 * k2, d) : 0u;
    }
  } else if constexpr (kInterleave6<T>) {
    if (kMR == 6 && a.sq.d == 1) return pack_q_rows6(a, qbase, i0, rows, rows_p, Qp);
    pack_q_strided(a, qbase, i0, rows, rows_p, Qp);
  } else {
    pack_q_strided(a, qbase, i0, rows, rows_p, Qp);
  }
}

// The class of the tile (rows i0 .. i0+rows-1) x (keys j0 .. j0+cols-1):
// partial when a structural mask cuts it (rows are monotone in lo/hi) or the
// user masks make it mixed, masked when the user masks hide all of it.
template <typename S, typename T>
TileClass classify_tile(const AttnArgs<S>& a, const SeqInfo& si, int64_t h, int64_t i0,
                        int64_t rows, int64_t j0, int64_t cols, const Scratch<T>& sc) {
  bool partial = false;
  for (int64_t r = 0; r < rows; ++r)
    if (sc.lo[r] > j0 || sc.hi[r] < j0 + cols) {
      partial = true;
      break;
    }
  if (a.layout || a.mask) {
    const TileClass c = classify_user_masks(a, si, h, i0, rows, j0, cols);
    if (c == TileClass::masked) return c;
    partial = partial || c == TileClass::partial;
  }
  return partial ? TileClass::partial : TileClass::visible;
}

// 2. Panel column ranges: micro-panel p (rows p*kMR .. p*kMR + kMR-1) sees
// only the tile columns [sc.pc[2p], sc.pc[2p+1]) (all of [0, cols_p) on a
// tile no mask cuts); S = Q K^T and O += P V skip the rest.
template <typename T>
void panel_columns(Scratch<T>& sc, int64_t rows, int64_t rows_p, int64_t j0, int64_t cols,
                   int64_t cols_p, bool partial) {
  const int64_t npanels = rows_p / kMR;
  for (int64_t p = 0; p < npanels; ++p) {
    int64_t c_lo = cols_p, c_hi = 0;
    if (!partial) {
      c_lo = 0;
      c_hi = cols_p;
    } else {
      for (int64_t r = p * kMR; r < imin(rows, (p + 1) * kMR); ++r) {
        const int64_t lo = imax(sc.lo[r] - j0, 0), hi = imin(sc.hi[r] - j0, cols);
        if (hi > lo) {
          c_lo = imin(c_lo, lo);
          c_hi = imax(c_hi, hi);
        }
      }
    }
    if (c_hi <= c_lo) c_lo = c_hi = 0;
    sc.pc[2 * p] = c_lo;
    sc.pc[2 * p + 1] = c_hi;
  }
}

// Whether qk_tile can fuse the row max for storage S: the fp32 kernel (W = 16
// floats, the AVX-512 object) and the vdpbf16ps path; not double, the 16-bit
// types widened into fp32 elsewhere, AVX2, scalar or the AMX tiles.
template <typename S>
constexpr bool kFuseMax =
    !kAmxTiles && Vec<compute_t<S>>::W == 16 && std::is_same<compute_t<S>, float>::value;

// qk_tile with the fused row max. cut: the structural masks cut the tile (or
// padding columns end it, cols < cols_p): each row's maximum then counts only
// its visible columns [lo - j0, hi - j0) below cols, the entries element_masks
// and softmax_rows will leave finite, so it is the max of their pass.
template <typename S>
void qk_tile_max(const AttnArgs<S>& a, Scratch<compute_t<S>>& sc, const compute_t<S>* Kt,
                 int64_t rows, int64_t rows_p, int64_t j0, int64_t cols, int64_t cols_p, bool cut) {
  using T = compute_t<S>;
  constexpr int W = Vec<T>::W, NRW = kNR * W;
  const int64_t d = a.d;
  int32_t lim_buf[2 * kMR];
  for (int64_t jv = 0; jv < cols_p; jv += NRW)
    for (int64_t i = 0; i < rows_p; i += kMR) {
      const int32_t* lim = nullptr;
      if (cut) {
        const int64_t c_lo = sc.pc[2 * (i / kMR)], c_hi = sc.pc[2 * (i / kMR) + 1];
        if (!(jv < c_hi && jv + NRW > c_lo)) continue;  // no row of the panel sees these keys
        for (int r = 0; r < kMR; ++r) {
          int64_t lo = 0, hi = 0;  // padding rows (i + r >= rows): nothing counts
          if (i + r < rows) {
            lo = imax(sc.lo[i + r] - j0, 0) - jv;
            hi = imin(sc.hi[i + r] - j0, cols) - jv;
          }
          lim_buf[2 * r] = static_cast<int32_t>(imin(imax(lo, 0), NRW));
          lim_buf[2 * r + 1] = static_cast<int32_t>(imin(imax(hi, 0), NRW));
        }
        lim = lim_buf;
      }
#if defined(ATTN_DOT_BF16)
      if constexpr (dot_path<S>()) {
        const int64_t d2 = (d + 1) / 2;
        qk_micro_dot<kMR, kNR, true>(reinterpret_cast<const uint32_t*>(sc.Qp) + i * d2, d2,
                                     reinterpret_cast<const uint32_t*>(Kt) + jv * d2,
                                     static_cast<float>(a.scale), sc.S + i * sc.lds + jv, sc.lds,
                                     sc.rmax + i * W, lim);
        continue;
      }
#endif
      qk_micro<T, kMR, kNR, true>(sc.Qp + i * d, d, Kt + jv * d, sc.S + i * sc.lds + jv, sc.lds,
                                  sc.rmax + i * W, lim);
    }
}

// S = Q_blk K^T over the packed K block Kt. Key panel outer: one panel
// (d x kNR*W) stays in L1 while the Q block's row panels stream past it; each
// micro-panel computes only the key panels of its column range (panel_columns).
// fuse_max (fp32 and vdpbf16ps paths): only the structural masks cut the tile
// and S needs no transform, so the micro-kernels also leave each row's maximum
// over its visible columns as a vector in sc.rmax (softmax_rows then skips its
// max pass); partial: the structural masks cut it (qk_tile_max).
template <typename S>
void qk_tile(const AttnArgs<S>& a, Scratch<compute_t<S>>& sc, const compute_t<S>* Kt, int64_t rows,
             int64_t rows_p, int64_t j0, int64_t cols, int64_t cols_p, bool partial, bool fuse_max,
             bool raw) {
  using T = compute_t<S>;
  constexpr int W = Vec<T>::W;
  const int64_t d = a.d;
  if constexpr (kFuseMax<S>) {
    if (fuse_max) {
      for (int64_t r = 0; r < rows_p; ++r) Vec<T>::store(sc.rmax + r * W, Vec<T>::set1(NEG_INF<T>));
      qk_tile_max(a, sc, Kt, rows, rows_p, j0, cols, cols_p, partial || cols < cols_p);
      return;
    }
  }
  if (amx_path<S>() && fuse_max)  // the AMX raw path's row maxima (amx_qk_panel_raw)
    for (int64_t r = 0; r < rows_p; ++r) Vec<T>::store(sc.rmax + r * W, Vec<T>::set1(NEG_INF<T>));
  (void)raw;
  for (int64_t jv = 0; jv < cols_p; jv += kNR * W)
    for (int64_t i = 0; i < rows_p; i += kMR) {
      const int64_t c_lo = sc.pc[2 * (i / kMR)], c_hi = sc.pc[2 * (i / kMR) + 1];
      if (jv < c_hi && jv + kNR * W > c_lo) {
#if defined(ATTN_AMX_TILES)
        if constexpr (amx_path<S>()) {
          const int64_t d2p = packed_pairs<S>(d);
          const uint32_t* Qw = reinterpret_cast<const uint32_t*>(sc.Qp) + i * d2p;
          const uint32_t* Kw = reinterpret_cast<const uint32_t*>(Kt) + jv * d2p;
          if (raw)
            amx_qk_panel_raw(*sc.tiles, Qw, d2p, Kw, sc.S + i * sc.lds + jv, sc.lds,
                             fuse_max ? sc.rmax + i * W : nullptr);
          else
            amx_qk_panel(*sc.tiles, Qw, d2p, Kw, static_cast<float>(a.scale),
                         sc.S + i * sc.lds + jv, sc.lds);
          continue;
        }
#endif
#if defined(ATTN_DOT_BF16)
        if constexpr (dot_path<S>()) {
          const int64_t d2 = (d + 1) / 2;
          qk_micro_dot<kMR, kNR>(reinterpret_cast<const uint32_t*>(sc.Qp) + i * d2, d2,
                                 reinterpret_cast<const uint32_t*>(Kt) + jv * d2,
                                 static_cast<float>(a.scale), sc.S + i * sc.lds + jv, sc.lds);
          continue;
        }
#endif
        qk_micro<T, kMR, kNR>(sc.Qp + i * d, d, Kt + jv * d, sc.S + i * sc.lds + jv, sc.lds);
      }
    }
}

// 3. Score transforms of one row s[0, cols) (query row i, keys j0 ..):
// softcap, then ALiBi and the additive bias (scores.h).
template <typename S, typename T>
inline void score_transforms(const AttnArgs<S>& a, const SeqInfo& si, int64_t h, int64_t i,
                             int64_t j0, int64_t cols, T* s) {
  if (a.softcap > 0) {
    const T c = static_cast<T>(a.softcap), ic = T(1) / c;
    for (int64_t j = 0; j < cols; ++j) s[j] = c * std::tanh(s[j] * ic);
  }
  add_alibi_bias(a, si, h, i, j0, cols, s);
}

// 4. Element masks of one row on a partial tile: keys outside the row's
// structural range [lo, hi) (absolute), then the block-sparse layout and the
// dense mask, set to -inf.
template <typename S, typename T>
inline void element_masks(const AttnArgs<S>& a, const SeqInfo& si, int64_t h, int64_t i, int64_t j0,
                          int64_t cols, int64_t row_lo, int64_t row_hi, T* s) {
  const int64_t lo = imax(row_lo - j0, 0), hi = imin(row_hi - j0, cols);
  for (int64_t j = 0; j < imin(lo, cols); ++j) s[j] = NEG_INF<T>;
  for (int64_t j = imax(hi, 0); j < cols; ++j) s[j] = NEG_INF<T>;
  mask_user_row(a, si, h, i, j0, cols, s);  // the layout and the dense mask (scores.h)
}

// online_softmax_row<T, 2> (toolkit.h) with its two optional fusions: the row
// max mx given (have_mx: from qk_tile's fused max, the same value as its max
// pass), and P stored as bf16 pairs (pairs: what p_to_bf16 would make of it,
// P's sum still taken in fp32 before the rounding). The same operations in
// the same order otherwise, so the same bits. cols_p is a multiple of 2 W.
// kRaw (the AMX path): s holds the unscaled Q K^T; scale > 0 is folded into
// the exponent, P = 2^(s * scale log2 e - m_new log2 e) in one FMA (m, l and
// lse keep their scaled meaning: m_new = max(m, max(s) * scale), the same
// value as the max of the scaled scores since rounding is monotone), and P
// that is rounded to bf16 next takes exp2_neg_bf16 (degree 4, 2.9e-6).
template <typename T, bool kPairs, bool kRaw = false>
inline void softmax_row_fused(T* s, int64_t cols, int64_t cols_p, bool have_mx, T mx, T& m, T& l,
                              T* o, int64_t dvp, T scale = T(1)) {
  using V = Vec<T>;
  constexpr int W = V::W;
  if (!have_mx) {
    typename V::R vm = V::set1(NEG_INF<T>), vm1 = vm;
    for (int64_t j = 0; j < cols_p; j += 2 * W) {
      vm = V::max(vm, V::load(s + j));
      vm1 = V::max(vm1, V::load(s + j + W));
    }
    mx = V::hmax(V::max(vm, vm1));
  }
  if constexpr (kRaw) mx *= scale;
  const T m_old = m;
  const T m_new = mx > m_old ? mx : m_old;  // a NaN m_old stays (NaN row)
  if (m_new == NEG_INF<T>) {                // nothing visible in this row so far, or only NaN
    softmax_row_none_visible(s, cols, cols_p, m, l);  // P = 0, as pairs too
    return;
  }
  const typename V::R vmn = V::set1(m_new);
  const T l2e = static_cast<T>(1.44269504088896340736);
  const typename V::R vl2e = V::set1(l2e);
  const typename V::R vc = V::set1(scale * l2e), vb = V::set1(-(m_new * l2e));
  typename V::R vs = V::zero(), vs1 = V::zero();
  for (int64_t j = 0; j < cols_p; j += 2 * W) {
    typename V::R p, p1;
    if constexpr (kRaw && kPairs) {
      p = V::exp2_neg_bf16(V::fma(V::load(s + j), vc, vb));
      p1 = V::exp2_neg_bf16(V::fma(V::load(s + j + W), vc, vb));
    } else if constexpr (kRaw) {
      p = V::exp2_neg(V::fma(V::load(s + j), vc, vb));
      p1 = V::exp2_neg(V::fma(V::load(s + j + W), vc, vb));
    } else {
      p = V::exp2_neg(V::mul(V::sub(V::load(s + j), vmn), vl2e));
      p1 = V::exp2_neg(V::mul(V::sub(V::load(s + j + W), vmn), vl2e));
    }
#if defined(ATTN_DOT_BF16)
    if constexpr (kPairs) {
      // The 2 W weights j .. j + 2W as bf16 at h[j ..]: floats j / 2 .., already read.
      DotBf16::store_pairs(reinterpret_cast<uint16_t*>(s) + j, p, p1);
    } else
#endif
    {
      V::store(s + j, p);
      V::store(s + j + W, p1);
    }
    vs = V::add(vs, p);
    vs1 = V::add(vs1, p1);
  }
  const T rowsum = V::hsum(V::add(vs, vs1));
  softmax_row_rescale(m_old, m_new, rowsum, m, l, o, dvp);
}

// One row r of softmax_rows_fused.
template <typename S>
inline void softmax_row_at(const AttnArgs<S>& a, const SeqInfo& si, int64_t h, int64_t i0,
                           int64_t r, int64_t j0, int64_t cols, int64_t cols_p, bool transforms,
                           bool partial, int64_t dvp, Scratch<compute_t<S>>& sc, bool fused_max,
                           bool pairs, bool raw) {
  using T = compute_t<S>;
  using V = Vec<T>;
  const T scale = static_cast<T>(a.scale);
  {
    T* s = sc.S + r * sc.lds;
    const int64_t i = i0 + r;
    if (transforms) score_transforms(a, si, h, i, j0, cols, s);
    if (partial) element_masks(a, si, h, i, j0, cols, sc.lo[r], sc.hi[r], s);
    for (int64_t j = cols; j < cols_p; ++j) s[j] = NEG_INF<T>;
    const T mx = fused_max ? V::hmax(V::load(sc.rmax + r * V::W)) : T(0);
    T* o = sc.O + r * dvp;
    if (raw && pairs)
      softmax_row_fused<T, true, true>(s, cols, cols_p, fused_max, mx, sc.m[r], sc.l[r], o, dvp,
                                       scale);
    else if (raw)
      softmax_row_fused<T, false, true>(s, cols, cols_p, fused_max, mx, sc.m[r], sc.l[r], o, dvp,
                                        scale);
    else if (pairs)
      softmax_row_fused<T, true>(s, cols, cols_p, fused_max, mx, sc.m[r], sc.l[r], o, dvp);
    else
      softmax_row_fused<T, false>(s, cols, cols_p, fused_max, mx, sc.m[r], sc.l[r], o, dvp);
  }
}

// softmax_rows on the fused paths (kFuseMax, and the AMX raw scores): fused_max:
// the row maxima are in sc.rmax (no transform or mask on this tile); pairs: P
// left as bf16 pairs; raw: S unscaled (softmax_row_fused).
template <typename S>
void softmax_rows_fused(const AttnArgs<S>& a, const SeqInfo& si, int64_t h, int64_t i0,
                        int64_t rows, int64_t rows_p, int64_t j0, int64_t cols, int64_t cols_p,
                        bool transforms, bool partial, int64_t dvp, Scratch<compute_t<S>>& sc,
                        bool fused_max, bool pairs, bool raw) {
  using T = compute_t<S>;
  for (int64_t r = 0; r < rows; ++r)
    softmax_row_at(a, si, h, i0, r, j0, cols, cols_p, transforms, partial, dvp, sc, fused_max,
                   pairs, raw);
  for (int64_t r = rows; r < rows_p; ++r)
    for (int64_t j = 0; j < cols_p; ++j) sc.S[r * sc.lds + j] = T(0);
}

// 5. Softmax rows: steps 3 and 4 where the tile needs them, the padding
// columns [cols, cols_p) to -inf, then the online-softmax update of each row
// (toolkit.h; two chains: cols_p is a multiple of 2W when kNR >= 2, of W for
// scalar); the padding rows [rows, rows_p) get P = 0.
template <typename S>
void softmax_rows(const AttnArgs<S>& a, const SeqInfo& si, int64_t h, int64_t i0, int64_t rows,
                  int64_t rows_p, int64_t j0, int64_t cols, int64_t cols_p, bool transforms,
                  bool partial, int64_t dvp, Scratch<compute_t<S>>& sc, bool fused_max, bool pairs,
                  bool raw) {
  using T = compute_t<S>;
  if constexpr (kFuseMax<S> || amx_path<S>()) {
    if (fused_max || pairs || raw) {
      softmax_rows_fused<S>(a, si, h, i0, rows, rows_p, j0, cols, cols_p, transforms, partial, dvp,
                            sc, fused_max, pairs, raw);
      return;
    }
  }
  (void)fused_max;
  (void)pairs;
  for (int64_t r = 0; r < rows; ++r) {
    T* s = sc.S + r * sc.lds;
    const int64_t i = i0 + r;
    if (transforms) score_transforms(a, si, h, i, j0, cols, s);
    if (partial) element_masks(a, si, h, i, j0, cols, sc.lo[r], sc.hi[r], s);
    for (int64_t j = cols; j < cols_p; ++j) s[j] = NEG_INF<T>;
    online_softmax_row<T, 2>(s, cols, cols_p, sc.m[r], sc.l[r], sc.O + r * dvp, dvp);
  }
  for (int64_t r = rows; r < rows_p; ++r)
    for (int64_t j = 0; j < cols_p; ++j) sc.S[r * sc.lds + j] = T(0);
}

#if defined(ATTN_AMX_TILES)
// The column range, in pairs of whole 32-key A tiles, of row panels p and p + 1
// together (P is exactly 0 outside each row's keys, element_masks); empty: lo == hi.
inline void pair_columns(const int64_t* pc, int64_t p, int64_t* c2lo, int64_t* c2hi) {
  const bool e0 = pc[2 * p + 1] <= pc[2 * p], e1 = pc[2 * p + 3] <= pc[2 * p + 2];
  if (e0 && e1) {
    *c2lo = *c2hi = 0;
    return;
  }
  const int64_t lo = e0 ? pc[2 * p + 2] : e1 ? pc[2 * p] : imin(pc[2 * p], pc[2 * p + 2]);
  const int64_t hi = e0 ? pc[2 * p + 3] : e1 ? pc[2 * p + 1] : imax(pc[2 * p + 1], pc[2 * p + 3]);
  *c2lo = lo / 32 * 16;
  *c2hi = (hi + 31) / 32 * 16;
}

// Steps 5 and 6 on the AMX raw-score path with P as pairs (no inf/NaN in the
// V block): the rows' softmax two row panels at a time, and between the rows of
// each pair the k-steps of the previous pair's P V (AmxPvJob), so that the tile
// unit multiplies while the vector units compute exponentials. Each output
// element gets the sums of pv_tile in the same order: the same bits.
template <typename S>
void softmax_pv_interleaved(const AttnArgs<S>& a, const SeqInfo& si, int64_t h, int64_t i0,
                            int64_t rows, int64_t rows_p, int64_t j0, int64_t cols, int64_t cols_p,
                            bool partial, int64_t dvp, Scratch<float>& sc, bool fused_max,
                            const float* Vp, int64_t Bc) {
  AmxTiles& t = *sc.tiles;
  const uint32_t* Pw = reinterpret_cast<const uint32_t*>(sc.S);
  const uint32_t* Vw = reinterpret_cast<const uint32_t*>(Vp);
  AmxPvJob job;
  int64_t per_row = 0;
  const int64_t npan = rows_p / kMR;
  for (int64_t p = 0; p < npan; p += 2) {
    const int64_t r0 = p * kMR, r1 = imin(rows_p, r0 + 2 * kMR);
    for (int64_t r = r0; r < r1; ++r) {
      if (r < rows)
        softmax_row_at(a, si, h, i0, r, j0, cols, cols_p, false, partial, dvp, sc, fused_max, true,
                       true);
      else
        for (int64_t j = 0; j < cols_p; ++j) sc.S[r * sc.lds + j] = 0.f;
      job.step(t, per_row);
    }
    job.step(t, -1);  // the previous pair's products, all of them
    if (p + 1 < npan) {
      int64_t c2lo, c2hi;
      pair_columns(sc.pc, p, &c2lo, &c2hi);
      job = AmxPvJob(Pw + r0 * sc.lds, Pw + (r0 + kMR) * sc.lds, sc.lds, c2lo, c2hi, Vw, Bc, dvp,
                     sc.O + r0 * dvp, sc.O + (r0 + kMR) * dvp);
      const int64_t next_rows = imin(rows_p, r0 + 4 * kMR) - imin(rows_p, r0 + 2 * kMR);
      per_row = next_rows > 0 ? (job.total_steps() + next_rows - 1) / next_rows : -1;
    } else {
      const int64_t c_lo = sc.pc[2 * p], c_hi = sc.pc[2 * p + 1];  // a last single panel
      if (c_hi > c_lo)
        amx_pv_panel(t, Pw + r0 * sc.lds, sc.lds, c_lo / 32 * 16, (c_hi + 31) / 32 * 16, Vw, Bc,
                     dvp, sc.O + r0 * dvp);
    }
  }
  job.step(t, -1);
}
#endif

// 6. O += P V over the packed V block Vp; the NaN-safe product when the
// block holds an inf/NaN (nonfinite). pairs: softmax_rows left P as bf16 pairs.
template <typename S>
void pv_tile(Scratch<compute_t<S>>& sc, const compute_t<S>* Vp, int64_t rows, int64_t rows_p,
             int64_t cols, int64_t cols_p, int64_t Bc, int64_t dvp, bool nonfinite, bool pairs) {
  using T = compute_t<S>;
#if defined(ATTN_AMX_TILES)
  if constexpr (amx_path<S>()) {
    if (nonfinite) {  // AMX multiplies 0 x NaN = NaN too: the guarded product
      pv_block_guarded_dot(sc.S, sc.lds, rows, cols, Vp, Bc, dvp, sc.O);
      return;
    }
    if (!pairs) p_to_bf16(sc.S, sc.lds, rows_p, cols_p);
    const uint32_t* Pw = reinterpret_cast<const uint32_t*>(sc.S);
    const uint32_t* Vw = reinterpret_cast<const uint32_t*>(Vp);
    int64_t i = 0;
    // Two row panels at a time over the union of their column ranges (P is
    // exactly 0 outside each row's keys, element_masks), then a last single one.
    for (; i + 2 * kMR <= rows_p; i += 2 * kMR) {
      int64_t c2lo, c2hi;
      pair_columns(sc.pc, i / kMR, &c2lo, &c2hi);
      if (c2hi <= c2lo) continue;
      amx_pv_panel2(*sc.tiles, Pw + i * sc.lds, Pw + (i + kMR) * sc.lds, sc.lds, c2lo, c2hi, Vw, Bc,
                    dvp, sc.O + i * dvp, sc.O + (i + kMR) * dvp);
    }
    for (; i < rows_p; i += kMR) {
      // Whole 32-key A tiles over the panel's columns (weights outside are exactly 0).
      const int64_t c_lo = sc.pc[2 * (i / kMR)], c_hi = sc.pc[2 * (i / kMR) + 1];
      if (c_hi <= c_lo) continue;
      amx_pv_panel(*sc.tiles, Pw + i * sc.lds, sc.lds, c_lo / 32 * 16, (c_hi + 31) / 32 * 16, Vw,
                   Bc, dvp, sc.O + i * dvp);
    }
    return;
  }
#endif
#if defined(ATTN_DOT_BF16)
  if constexpr (dot_path<S>()) {
    if (nonfinite) {
      pv_block_guarded_dot(sc.S, sc.lds, rows, cols, Vp, Bc, dvp, sc.O);
    } else {
      if (!pairs) p_to_bf16(sc.S, sc.lds, rows_p, cols_p);
      pv_block_dot(sc.S, sc.lds, rows_p, sc.pc, Vp, Bc, dvp, sc.O);
    }
    return;
  }
#endif
  (void)cols_p;
  (void)pairs;
  if (nonfinite)
    pv_block_guarded<T>(sc.S, sc.lds, rows, cols, Vp, Bc, dvp, sc.O);
  else
    pv_block<T>(sc.S, sc.lds, rows_p, sc.pc, Vp, Bc, dvp, sc.O);
}

// 7. Finalize rows 0 .. rows_all-1: O = O_acc / l (with the sink's weight),
// lse = m + log(l), through o's strides; empty rows -> 0 and -inf. has_keys:
// the item saw a visible key range at all.
template <typename S>
void finalize_rows(const AttnArgs<S>& a, int64_t h, int64_t i0, int64_t rows, int64_t rows_all,
                   bool has_keys, int64_t dvp, S* obase, compute_t<S>* lsebase,
                   const Scratch<compute_t<S>>& sc) {
  using T = compute_t<S>;
  const int64_t dv = a.dv;
  for (int64_t r = 0; r < rows_all; ++r) {
    S* dst = obase + (i0 + r) * a.so.l;
    T m = r < rows ? sc.m[r] : NEG_INF<T>;
    T l = r < rows ? sc.l[r] : T(0);
    bool has_o = r < rows && has_keys && !(l == T(0));  // NaN l propagates
    T factor = T(0);
    if (r < rows && a.sinks && a.sinks[h] == std::numeric_limits<T>::infinity() && m == m &&
        l == l) {
      // A +inf sink takes all the weight: the limit O = 0, lse = +inf (the
      // formula's inf - inf would be NaN). A NaN row stays NaN.
      has_o = false;
      m = a.sinks[h];
      l = T(1);
    } else if (r < rows && a.sinks && a.sinks[h] != NEG_INF<T>) {  // a -inf sink is no sink
      const T sk = a.sinks[h];
      const T m2 = sk > m ? sk : m;
      const T keep = m == NEG_INF<T> ? T(0) : std::exp(m - m2);
      l = l * keep + std::exp(sk - m2);
      factor = keep / l;
      m = m2;
    } else if (has_o) {
      factor = T(1) / l;
    }
    if (has_o) {
      const T* src = sc.O + r * dvp;
      if (a.so.d == 1)
        st_row(dst, src, factor, dv);
      else
        for (int64_t e = 0; e < dv; ++e) put(dst + e * a.so.d, src[e] * factor);
    } else {
      for (int64_t e = 0; e < dv; ++e) put(dst + e * a.so.d, T(0));
    }
    if (lsebase) lsebase[i0 + r] = (l > T(0) || l != l) ? m + std::log(l) : NEG_INF<T>;
  }
}

// One work item: (sequence si, head h, query block qb of Br rows) against
// the key blocks of Bc keys its rows can see.
template <typename S>
void process_item(const AttnArgs<S>& a, const SeqInfo& si, int64_t s_idx, int64_t h, int64_t qb,
                  int64_t Br, int64_t Bc, Scratch<compute_t<S>>& sc, AttnStats& st,
                  CancelToken& tok) {
  using T = compute_t<S>;
  constexpr int W = Vec<T>::W;
  const int64_t d = a.d, dvp = round_up(a.dv, W);
  const int64_t i0 = qb * Br;
  const int64_t rows_all = imin(Br, si.q_rows - i0);            // rows to write
  const int64_t rows = imax(0, imin(rows_all, si.q_len - i0));  // rows to compute
  const int64_t rows_p = round_up(rows, kMR);
  const int64_t hk = h / (a.Hq / a.Hkv);

  const S* qbase = a.q + si.b * a.sq.b + h * a.sq.h + si.q0 * a.sq.l;
  S* obase = a.o + si.b * a.so.b + h * a.so.h + si.q0 * a.so.l;
  T* lsebase = nullptr;
  if (a.lse) lsebase = a.cu_q ? a.lse + h * a.Lq + si.q0 : a.lse + (si.b * a.Hq + h) * a.Lq;

  int64_t jlo, jhi;
  row_ranges(a, si, i0, rows, sc, &jlo, &jhi);
  for (int64_t r = 0; r < rows_p; ++r) {
    sc.m[r] = NEG_INF<T>;
    sc.l[r] = T(0);
  }
  if (jhi > jlo) {
    std::memset(sc.O, 0, sizeof(T) * rows_p * dvp);
    pack_q(a, qbase, i0, rows, rows_p, sc.Qp);
  }

  const bool transforms = a.softcap > 0 || a.alibi || a.bias;
  for (int64_t j0 = jlo / Bc * Bc; j0 < jhi; j0 += Bc) {
    if (tok.poll()) return;  // Ctrl-C: the call raises, this block's rows stay unwritten
    const int64_t cols = imin(Bc, jhi - j0);
    const TileClass tc = classify_tile(a, si, h, i0, rows, j0, cols, sc);
    if (tc == TileClass::masked) {
      ++st.tiles_skipped;
      continue;
    }
    const bool partial = tc == TileClass::partial;
    ++st.tiles_computed;
    const int64_t cols_p = round_up(cols, kNR * W);

    // The packed K and V blocks (cached per thread, kv_block).
    const int64_t slot = kv_block(a, si, s_idx, hk, j0 / Bc, Bc, sc);
    const T* Kt = sc.Kc + slot * Bc * k_elems<S>(d);
    const T* Vp = sc.Vc + slot * Bc * dvp;

    // The row max fused into S = Q K^T where no transform or mask comes between
    // (kFuseMax); P rounded to bf16 pairs inside the softmax on the vdpbf16ps
    // path unless the guarded product needs it in fp32.
    // AMX (raw): S stays unscaled, the scale goes into the softmax's exponent
    // (no transform needs the scaled scores); the fused max only on whole tiles.
    const bool nonfinite = sc.nonfinite[slot] != 0;
    const bool raw = amx_path<S>() && !transforms && a.scale > 0;
    const bool fuse_max = (kFuseMax<S> && !transforms && !a.layout && !a.mask) ||
                          (raw && !partial && cols == cols_p && !a.layout && !a.mask);
    const bool pairs = (kFuseMax<S> && dot_path<S>() && !nonfinite) || (raw && !nonfinite);
    panel_columns(sc, rows, rows_p, j0, cols, cols_p, partial);
    qk_tile(a, sc, Kt, rows, rows_p, j0, cols, cols_p, partial, fuse_max, raw);
#if defined(ATTN_AMX_TILES)
    if constexpr (amx_path<S>()) {
      if (raw && pairs) {
        softmax_pv_interleaved(a, si, h, i0, rows, rows_p, j0, cols, cols_p, partial, dvp, sc,
                               fuse_max, Vp, Bc);
        continue;
      }
    }
#endif
    softmax_rows(a, si, h, i0, rows, rows_p, j0, cols, cols_p, transforms, partial, dvp, sc,
                 fuse_max, pairs, raw);
    pv_tile<S>(sc, Vp, rows, rows_p, cols, cols_p, Bc, dvp, nonfinite, pairs);
  }
  finalize_rows(a, h, i0, rows, rows_all, jhi > jlo, dvp, obase, lsebase, sc);
}

// One thread's scratch (Scratch<T>) carved from its arena; false when it
// cannot be had (the thread then computes nothing and the call throws).
template <typename T>
bool carve_scratch(ThreadArena& arena, Scratch<T>& sc, int64_t Br, int64_t Bc, int64_t d,
                   int64_t dvp, int64_t Lk) {
  const int64_t Brp = round_up(Br, kMR);
  sc.lds = Bc + 64 / static_cast<int64_t>(sizeof(T));
  const int64_t slot_bytes = Bc * (d + dvp) * static_cast<int64_t>(sizeof(T));
  sc.nslots = imax(1, imin((Lk + Bc - 1) / Bc, kCacheBytes / slot_bytes));
  T** tp[] = {&sc.Qp, &sc.S, &sc.O, &sc.m, &sc.l, &sc.Kc, &sc.Vc, &sc.rmax};
  const int64_t tn[] = {
      Brp * d,        Brp * sc.lds, Brp * dvp, Brp, Brp, sc.nslots * Bc * d, sc.nslots * Bc * dvp,
      Brp * Vec<T>::W};
  int64_t** ip[] = {&sc.lo, &sc.hi, &sc.pc, &sc.tag};
  const int64_t in[] = {Brp, Brp, 2 * (Brp / kMR + 1), sc.nslots};
  int64_t toff[8], ioff[4];
  for (int i = 0; i < 8; ++i) toff[i] = arena.plan<T>(tn[i]);
  for (int i = 0; i < 4; ++i) ioff[i] = arena.plan<int64_t>(in[i]);
  const int64_t onf = arena.plan<uint8_t>(sc.nslots);
  if (!arena.acquire()) return false;
  for (int i = 0; i < 8; ++i) *tp[i] = arena.at<T>(toff[i]);
  for (int i = 0; i < 4; ++i) *ip[i] = arena.at<int64_t>(ioff[i]);
  sc.nonfinite = arena.at<uint8_t>(onf);
  return true;
}

template <typename S>
AttnStats forward_impl(const AttnArgs<S>& a) {
  using T = compute_t<S>;
  constexpr int W = Vec<T>::W;
  AttnStats total;
  if (a.B <= 0 || a.Hq <= 0) return total;
  // The AMX path's fixed costs per key block and row (the O strips through the
  // C tiles, the rescale, the row max) halve at Bc = 512, and a 96-row Q block
  // halves the K/V tile loads per product: measured, bench/notes_archive.md (amx5).
  int64_t Bc = round_up(a.block_k > 0 ? a.block_k : (amx_path<S>() ? 512 : 256), kNR * W);
  // A tile never outgrows the problem or 4096 (a huge block_k from a caller
  // must not size the per-thread scratch).
  Bc = imin(Bc, round_up(imin(imax(a.Lk, 1), 4096), kNR * W));
  const int64_t dvp = round_up(a.dv, W);
  // Every query block streams its head's packed K/V blocks once: when those
  // exceed 2 MiB (beyond L2, from L3 or memory) a taller Q block halves that
  // traffic per FLOP. The AVX-512 objects count exactly 2 MiB (a whole 2 MiB
  // L2, scratch aside) as long too: 2-4 % on Sapphire Rapids, neutral on Zen 5;
  // AVX2 keeps the strict test (Br = 96 measured 4 % slower there:
  // bench/notes_archive.md, fp18 step 3).
  const int64_t kv_bytes = a.Lk * (a.d + dvp) * static_cast<int64_t>(sizeof(T));
  const bool long_kv =
      kv_bytes > (int64_t(2) << 20) || (Vec<float>::W == 16 && kv_bytes == (int64_t(2) << 20));
  int64_t Br = a.block_q > 0 ? a.block_q : (long_kv || amx_path<S>() ? 96 : 48);
  Br = imin(Br, imin(imax(a.Lq, 1), 4096));

  // Work items: (sequence, head, query block); prefix over sequences.
  int64_t* prefix = alloc_scratch<int64_t>(a.B + 1);
  if (!prefix) throw std::bad_alloc();
  prefix[0] = 0;
  for (int64_t s = 0; s < a.B; ++s) {
    const SeqInfo si = seq_info(a, s);
    prefix[s + 1] = prefix[s] + (si.q_rows + Br - 1) / Br;
  }
  const int64_t n_items = prefix[a.B] * a.Hq;
  int64_t computed = 0, skipped = 0, failed = 0;
  CancelToken tok;  // Ctrl-C, polled between items and key blocks

  int nt = a.num_threads > 0 ? a.num_threads : 1;
  if (n_items < nt) nt = static_cast<int>(n_items > 0 ? n_items : 1);
  // Tiny calls (a few microseconds of work) run on the calling thread: waking
  // a team costs more than it saves, and on a loaded machine much more.
  const double work =
      static_cast<double>(a.B) * a.Hq * a.Lq * a.Lk * static_cast<double>(a.d + a.dv);
  if (work < kSerialWork) nt = 1;
  // Work units. With several threads and at least 2 (sequence, kv head) groups
  // per thread, a unit is first a whole group (its q heads, all their query
  // blocks): one thread then packs that group's K/V blocks, where single items
  // would have every thread pack every head's. The last nt groups are cut into
  // single items (w >= w_tail, the order of the items below) so that the
  // threads finish together. One thread, or few groups: single items only.
  const int64_t n_groups = a.B * a.Hkv, group_q = a.Hq / a.Hkv;
  const int64_t n_whole = nt > 1 && n_groups >= 2 * nt ? n_groups - nt : 0;
  const int64_t s_tail = n_whole / a.Hkv, hk_tail = n_whole % a.Hkv;  // the first split group
  const int64_t w_tail =
      prefix[s_tail] * a.Hq + hk_tail * group_q * (prefix[s_tail + 1] - prefix[s_tail]);
  const int64_t n_units = n_whole + (n_items - w_tail);
#pragma omp parallel num_threads(nt) reduction(+ : computed, skipped, failed)
  {
    // A thread whose scratch could not be allocated computes nothing; the
    // call then throws std::bad_alloc (MemoryError) instead of crashing.
    ThreadArena arena;
    Scratch<T> sc;
    const bool ok = carve_scratch(arena, sc, Br, Bc, k_elems<S>(a.d), dvp, a.Lk);
    failed += ok ? 0 : 1;
#if defined(ATTN_AMX_TILES)
    AmxTiles tiles;  // ldtilecfg here, tilerelease when the region ends (amx_tiles.h)
    sc.tiles = &tiles;
#endif
    AttnStats st;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t u = 0; u < n_units; ++u) {
      if (!ok || tok.poll()) continue;
      if (u < n_whole) {  // group u: sequence u / Hkv, kv head u % Hkv
        const int64_t s = u / a.Hkv, hk = u % a.Hkv;
        const int64_t nblk = prefix[s + 1] - prefix[s];
        const SeqInfo si = seq_info(a, s);
        for (int64_t h = hk * group_q; h < (hk + 1) * group_q; ++h)
          for (int64_t qb = nblk - 1; qb >= 0; --qb) {
            if (tok.poll()) break;
            process_item(a, si, s, h, qb, Br, Bc, sc, st, tok);
          }
        continue;
      }
      const int64_t w = w_tail + (u - n_whole);
      // Find the sequence: largest s with prefix[s] * Hq <= w.
      int64_t lo = 0, hi = a.B;
      while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (prefix[mid] * a.Hq <= w)
          lo = mid;
        else
          hi = mid;
      }
      const int64_t s = lo;
      const int64_t nblk = prefix[s + 1] - prefix[s];
      const int64_t rem = w - prefix[s] * a.Hq;
      const int64_t h = rem / nblk;
      const int64_t qb = nblk - 1 - rem % nblk;  // late (heavier causal) blocks first
      process_item(a, seq_info(a, s), s, h, qb, Br, Bc, sc, st, tok);
    }
    tok.finish_share();  // the calling thread keeps polling until the team is done
    computed += st.tiles_computed;
    skipped += st.tiles_skipped;
  }
  std::free(prefix);
  if (failed) throw std::bad_alloc();
  total.tiles_computed = computed;
  total.tiles_skipped = skipped;
  total.block_q = Br;
  total.block_k = Bc;
  return total;
}

}  // namespace

#if defined(ATTN_AMX_TILES)
// The amx / amx_emu objects hold only the tile bf16 kernel and one tile product
// for the tests (kernel_entries.h).
ATTN_AMX_ENTRY_POINTS
AttnStats flash_forward_bf16(const AttnArgs<bf16_t>& a) { return forward_impl<bf16_t>(a); }
void tdpbf16ps_tile(const uint16_t* a, const uint16_t* b, float* c) { amx_tile_product(a, b, c); }
#elif defined(ATTN_DOT_BF16)
// The avx512_bf16 object holds only the vdpbf16ps bf16 kernel (and, in
// probes.cpp, its probe loop).
ATTN_BF16DOT_ENTRY_POINTS
AttnStats flash_forward_bf16(const AttnArgs<bf16_t>& a) { return forward_impl<bf16_t>(a); }
#else
ATTN_ISA_ENTRY_POINTS
#define ATTN_DEFINE_FORWARD(sfx, S) \
  AttnStats flash_forward_##sfx(const AttnArgs<S>& a) { return forward_impl<S>(a); }
ATTN_FORWARD_TYPES(ATTN_DEFINE_FORWARD)
#undef ATTN_DEFINE_FORWARD
#endif

}  // namespace ATTN_NS
}  // namespace attn_fast
