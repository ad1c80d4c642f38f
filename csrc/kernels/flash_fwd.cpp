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
// Product paths (ProductPath<S>, one file each beside this one): how Q, K and
//   V are packed and how S = Q K^T and O += P V are multiplied; the steps
//   above are the same code on every path.
//     flash_fwd_fma.h  FMA micro-tiles (IsaTraits: AVX2 6 x 2 ymm, AVX-512
//                      6 x 4 zmm, NEON 6 x 4, scalar 4 x 4) in compute_t<S>;
//                      every type, 16-bit values widened where they are packed
//     flash_fwd_dot.h  bf16 kept as pairs, vdpbf16ps / BFDOT micro-tiles
//                      (the avx512_bf16 and neon_bf16 objects)
//     flash_fwd_amx.h  bf16 pairs on AMX tiles, 16-row micro-panels (the amx
//                      and amx_emu objects; the tile plan is amx_tiles.h)
//   Fusions (each gives the unfused bits): where no mask cuts a tile, no
//   score transform touches it and no padding column ends it, the QK
//   micro-kernel also folds each row's maximum into sc.rmax (kFuseMax), so
//   step 4 has no max pass; on the pair paths P is rounded to bf16 pairs
//   inside the softmax pass (kPairs); the AMX path keeps S unscaled and folds
//   the scale into the exponent (kRaw).
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
//   AVX-512 from 2 MiB). Why these sizes: bench/NOTES.md, #prefill-fp32.
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
//   types) and O is rounded once (round to nearest even, NaN kept) in the
//   finalize step; lse, bias, alibi and sinks are fp32. On the pair paths the
//   scale multiplies S in fp32 and P is rounded to bf16 before P V (as torch's
//   bf16 SDPA does); the tiling, masking and softmax are unchanged.
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

// The product paths: how Q, K and V are packed and multiplied (the steps
// below call them through ProductPath<S>). Each file states its layouts and
// hardware invariants.
#include "flash_fwd_fma.h"  // FMA micro-tiles in compute_t<S>: every type, every object
#if defined(ATTN_DOT_BF16)
#include "flash_fwd_dot.h"  // bf16 pairs by vdpbf16ps / BFDOT (avx512_bf16, neon_bf16)
#endif
#if defined(ATTN_AMX_TILES)
#include "flash_fwd_amx.h"  // bf16 pairs by AMX tiles (amx, amx_emu)
#endif

template <typename S>
struct ProductPathOf {
  using type = FmaPath<S>;
};
#if defined(ATTN_AMX_TILES)
template <>
struct ProductPathOf<bf16_t> {
  using type = AmxPath;
};
#elif defined(ATTN_DOT_BF16)
template <>
struct ProductPathOf<bf16_t> {
  using type = DotPath;
};
#endif
template <typename S>
using ProductPath = typename ProductPathOf<S>::type;

// Returns the slot holding packed key block `blk` of (sequence s, kv head hk),
// packing it on a miss (the path's layouts; keys past the sequence end are
// zero up to the panel width) and noting whether its V holds an inf/NaN.
template <typename S>
int64_t kv_block(const AttnArgs<S>& a, const SeqInfo& si, int64_t s, int64_t hk, int64_t blk,
                 int64_t Bc, Scratch<compute_t<S>>& sc) {
  using P = ProductPath<S>;
  constexpr int W = Vec<compute_t<S>>::W;
  if (sc.key_s != s || sc.key_hk != hk) {
    for (int64_t i = 0; i < sc.nslots; ++i) sc.tag[i] = -1;
    sc.key_s = s;
    sc.key_hk = hk;
  }
  const int64_t slot = blk % sc.nslots;
  if (sc.tag[slot] == blk) return slot;
  const int64_t dvp = round_up(a.dv, W);
  const int64_t j0 = blk * Bc;
  const int64_t cols = imin(Bc, si.k_len - j0), cols_p = round_up(cols, kNR * W);
  const S* kbase = a.k + si.b * a.sk.b + hk * a.sk.h + (si.k0 + j0) * a.sk.l;
  const S* vbase = a.v + si.b * a.sv.b + hk * a.sv.h + (si.k0 + j0) * a.sv.l;
  P::pack_k(a, kbase, cols, cols_p, sc.Kc + slot * Bc * P::k_elems(a.d));
  sc.nonfinite[slot] = P::pack_v(a, vbase, cols, cols_p, Bc, sc.Vc + slot * Bc * dvp);
  sc.tag[slot] = blk;
  return slot;
}

#include "flash_fwd_visibility.h"  // row_ranges, classify_tile, panel_columns

// ---------------------------------------------------------------------------
// The steps of one work item (process_item below runs them in this order;
// row_ranges, classify_tile and panel_columns are flash_fwd_visibility.h).

// qk_tile with the fused row max (ProductPath<S>::kFuseMax). cut: the
// structural masks cut the tile (or padding columns end it, cols < cols_p):
// each row's maximum then counts only its visible columns [lo - j0, hi - j0)
// below cols, the entries element_masks and softmax_rows will leave finite,
// so it is the max of their pass.
template <typename S>
void qk_tile_max(const AttnArgs<S>& a, Scratch<compute_t<S>>& sc, const compute_t<S>* Kt,
                 int64_t rows, int64_t rows_p, int64_t j0, int64_t cols, int64_t cols_p, bool cut) {
  constexpr int NRW = kNR * Vec<compute_t<S>>::W;
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
      ProductPath<S>::template qk_panel<true>(a, sc, Kt, i, jv, false, true, lim);
    }
}

// S = Q_blk K^T over the packed K block Kt. Key panel outer: one panel
// (d x kNR*W) stays in L1 while the Q block's row panels stream past it; each
// micro-panel computes only the key panels of its column range (panel_columns).
// fuse_max: no transform or user mask comes between, so the micro-kernels also
// leave each row's maximum over its visible columns as a vector in sc.rmax
// (softmax_rows then skips its max pass; qk_tile_max where the path fuses it
// in the FMA / dot micro-kernels, the tile store on the AMX raw path); raw:
// S unscaled (the AMX path).
template <typename S>
void qk_tile(const AttnArgs<S>& a, Scratch<compute_t<S>>& sc, const compute_t<S>* Kt, int64_t rows,
             int64_t rows_p, int64_t j0, int64_t cols, int64_t cols_p, bool partial, bool fuse_max,
             bool raw) {
  using T = compute_t<S>;
  using P = ProductPath<S>;
  constexpr int W = Vec<T>::W;
  if (fuse_max)
    for (int64_t r = 0; r < rows_p; ++r) Vec<T>::store(sc.rmax + r * W, Vec<T>::set1(NEG_INF<T>));
  if constexpr (P::kFuseMax) {
    if (fuse_max)
      return qk_tile_max(a, sc, Kt, rows, rows_p, j0, cols, cols_p, partial || cols < cols_p);
  }
  for (int64_t jv = 0; jv < cols_p; jv += kNR * W)
    for (int64_t i = 0; i < rows_p; i += kMR) {
      const int64_t c_lo = sc.pc[2 * (i / kMR)], c_hi = sc.pc[2 * (i / kMR) + 1];
      if (jv < c_hi && jv + kNR * W > c_lo) P::qk_panel(a, sc, Kt, i, jv, raw, fuse_max);
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

// 5. Softmax of row r: steps 3 and 4 where the tile needs them, the padding
// columns [cols, cols_p) to -inf, then the online-softmax update of the row
// (online_softmax_row, toolkit.h; two chains: cols_p is a multiple of 2W when
// kNR >= 2, of W for scalar), or on the fused paths softmax_row_fused:
// fused_max: the row maxima are in sc.rmax (no transform or mask on this
// tile); pairs: P left as bf16 pairs; raw: S unscaled.
template <typename S>
inline void softmax_row_at(const AttnArgs<S>& a, const SeqInfo& si, int64_t h, int64_t i0,
                           int64_t r, int64_t j0, int64_t cols, int64_t cols_p, bool transforms,
                           bool partial, int64_t dvp, Scratch<compute_t<S>>& sc, bool fused_max,
                           bool pairs, bool raw) {
  using T = compute_t<S>;
  T* s = sc.S + r * sc.lds;
  const int64_t i = i0 + r;
  if (transforms) score_transforms(a, si, h, i, j0, cols, s);
  if (partial) element_masks(a, si, h, i, j0, cols, sc.lo[r], sc.hi[r], s);
  for (int64_t j = cols; j < cols_p; ++j) s[j] = NEG_INF<T>;
  T* o = sc.O + r * dvp;
  if constexpr (ProductPath<S>::kFuseMax || ProductPath<S>::kRaw) {
    if (fused_max || pairs || raw) {
      using V = Vec<T>;
      const T scale = static_cast<T>(a.scale);
      const T mx = fused_max ? V::hmax(V::load(sc.rmax + r * V::W)) : T(0);
      T &m = sc.m[r], &l = sc.l[r];
      if (raw && pairs)
        softmax_row_fused<T, true, true>(s, cols, cols_p, fused_max, mx, m, l, o, dvp, scale);
      else if (raw)
        softmax_row_fused<T, false, true>(s, cols, cols_p, fused_max, mx, m, l, o, dvp, scale);
      else if (pairs)
        softmax_row_fused<T, true>(s, cols, cols_p, fused_max, mx, m, l, o, dvp);
      else
        softmax_row_fused<T, false>(s, cols, cols_p, fused_max, mx, m, l, o, dvp);
      return;
    }
  }
  online_softmax_row<T, 2>(s, cols, cols_p, sc.m[r], sc.l[r], o, dvp);
}

// The softmax of a tile's rows (softmax_row_at); the padding rows [rows,
// rows_p) get P = 0.
template <typename S>
void softmax_rows(const AttnArgs<S>& a, const SeqInfo& si, int64_t h, int64_t i0, int64_t rows,
                  int64_t rows_p, int64_t j0, int64_t cols, int64_t cols_p, bool transforms,
                  bool partial, int64_t dvp, Scratch<compute_t<S>>& sc, bool fused_max, bool pairs,
                  bool raw) {
  for (int64_t r = 0; r < rows; ++r)
    softmax_row_at(a, si, h, i0, r, j0, cols, cols_p, transforms, partial, dvp, sc, fused_max,
                   pairs, raw);
  for (int64_t r = rows; r < rows_p; ++r)
    for (int64_t j = 0; j < cols_p; ++j) sc.S[r * sc.lds + j] = compute_t<S>(0);
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
  using P = ProductPath<S>;
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
    P::pack_q(a, qbase, i0, rows, rows_p, sc.Qp);
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
    const T* Kt = sc.Kc + slot * Bc * P::k_elems(d);
    const T* Vp = sc.Vc + slot * Bc * dvp;

    // The row max fused into S = Q K^T where no transform or mask comes between
    // (kFuseMax); P rounded to bf16 pairs inside the softmax on the vdpbf16ps
    // path unless the guarded product needs it in fp32.
    // AMX (raw): S stays unscaled, the scale goes into the softmax's exponent
    // (no transform needs the scaled scores); the fused max only on whole tiles.
    const bool nonfinite = sc.nonfinite[slot] != 0;
    const bool raw = P::kRaw && !transforms && a.scale > 0;
    const bool fuse_max = (P::kFuseMax && !transforms && !a.layout && !a.mask) ||
                          (raw && !partial && cols == cols_p && !a.layout && !a.mask);
    const bool pairs = P::kPairs && (P::kFuseMax || raw) && !nonfinite;
    panel_columns(sc, rows, rows_p, j0, cols, cols_p, partial);
    qk_tile(a, sc, Kt, rows, rows_p, j0, cols, cols_p, partial, fuse_max, raw);
    if constexpr (P::kRaw) {
      if (raw && pairs) {  // the tile path's P V issued between the softmax rows
        P::softmax_pv(sc, rows, rows_p, cols_p, dvp, Vp, Bc, [&](int64_t r) {
          softmax_row_at(a, si, h, i0, r, j0, cols, cols_p, false, partial, dvp, sc, fuse_max, true,
                         true);
        });
        continue;
      }
    }
    softmax_rows(a, si, h, i0, rows, rows_p, j0, cols, cols_p, transforms, partial, dvp, sc,
                 fuse_max, pairs, raw);
    P::pv_tile(sc, Vp, rows, rows_p, cols, cols_p, Bc, dvp, nonfinite, pairs);
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
  using P = ProductPath<S>;
  constexpr int W = Vec<T>::W;
  AttnStats total;
  if (a.B <= 0 || a.Hq <= 0) return total;
  // The path's block shape (P::kBlockK, P::kTallQ: flash_fwd_amx.h).
  int64_t Bc = round_up(a.block_k > 0 ? a.block_k : P::kBlockK, kNR * W);
  // A tile never outgrows the problem or 4096 (a huge block_k from a caller
  // must not size the per-thread scratch).
  Bc = imin(Bc, round_up(imin(imax(a.Lk, 1), 4096), kNR * W));
  const int64_t dvp = round_up(a.dv, W);
  // Every query block streams its head's packed K/V blocks once: when those
  // exceed 2 MiB (beyond L2, from L3 or memory) a taller Q block halves that
  // traffic per FLOP. The AVX-512 objects count exactly 2 MiB (a whole 2 MiB
  // L2, scratch aside) as long too, AVX2 keeps the strict test (measured per
  // ISA: bench/NOTES.md, #prefill-fp32).
  const int64_t kv_bytes = a.Lk * (a.d + dvp) * static_cast<int64_t>(sizeof(T));
  const bool long_kv =
      kv_bytes > (int64_t(2) << 20) || (Vec<float>::W == 16 && kv_bytes == (int64_t(2) << 20));
  int64_t Br = a.block_q > 0 ? a.block_q : (long_kv || P::kTallQ ? 96 : 48);
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
    const bool ok = carve_scratch(arena, sc, Br, Bc, P::k_elems(a.d), dvp, a.Lk);
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
// probe_loops.cpp, its probe loop).
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