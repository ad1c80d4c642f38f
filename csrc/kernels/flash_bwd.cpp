// The fused flash-attention backward kernel (FlashAttention-2, Algorithm 2).
//
// Compiled once per instruction set like flash_fwd.cpp (see isa.h and
// CMakeLists.txt). Given the forward's O and lse, and dO, it computes
// dQ, dK, dV (and dsinks) without ever holding the Lq x Lk matrices:
//
//   D_i  = rowsum(dO_i * O_i)                        (pass 1, per query row)
//   per (key block, query block) tile, recomputed:
//     S  = scale * Q K^T, then softcap / ALiBi / bias and the masks of
//          attention.h exactly as the forward applies them
//     P  = exp(S - lse)                              (no max, no rescale)
//     dV += P^T dO
//     dP = dO V^T
//     dS = P * (dP - D)          (* (1 - tanh^2) under softcap)
//     dK += dS^T (scale Q)
//     dQ += scale * dS K
//   dsink_h = -sum_i exp(sink_h - lse_i) D_i        (pass 1, per head)
//
// Shapes: q (B, Hq, Lq, d), k (B, Hkv, Lk, d), v (B, Hkv, Lk, dv),
//         o, dO (B, Hq, Lq, dv), lse (B, Hq, Lq) / (Hq, total_q) for varlen;
//         dq, dk, dv like q, k, v. All read and written through strides.
//
// Tiling and threads: one work item = (sequence, kv head, key chunk). It owns
//   dK/dV of its keys (accumulated in Bc x d / Bc x dv tiles over its G query
//   heads and all query blocks, then written once) and accumulates its
//   contribution to dQ of those G heads in a fixed key-block order: no atomics.
//   A chunk is all of the sequence's keys unless there are fewer than
//   kMinItems (sequence, kv head) pairs; then the keys are cut into up to
//   kMaxSplit chunks, chunk c > 0 accumulates dQ into its own buffer and the
//   buffers are added to dq afterwards in chunk order. The split depends on
//   the shapes only, never on the thread count, so results are bit-for-bit
//   identical for any number of threads.
//
// Loop order inside an item: key block outer (K, K^T, V^T and the dK/dV
//   accumulators stay in L2), then query head, then query block (its Q and dO
//   rows packed once per tile). The five products are one register-blocked
//   kernel, C[M][N] (+)= A[M][K] B[K][N], A read by broadcast, B and C by
//   Vec<T> rows: MR x NR vectors as in the forward. On tiles a structural
//   range cuts (the causal diagonal) each micro-tile computes only what its
//   rows see (gemm_*_ranged): same results, a causal (1,12,512,64) backward
//   0.87x the time [avx2-bwd-2].
//
// Memory: scratch per thread is O(Br * Bc + (Br + Bc) * (d + dv)); D is
//   B * Hq * Lq elements; split buffers at most (kMaxSplit - 1) * |dq|
//   (16-bit storage: nsplit fp32 buffers of |dq| elements, at most kMaxSplit).
//   Allocation failure throws std::bad_alloc (MemoryError in Python).
//
// Numerics: rows with lse = -inf (no visible key, padding) get P = 0, so
//   their dQ is 0 and they add nothing to dK/dV; masked pairs get P = dS = 0.
//   Key blocks whose K or V holds a non-finite value use products that skip
//   zero weights, so a NaN in a masked K/V row never reaches a gradient.
//
// Storage types: q, k, v, o, dO, dq, dk, dv are float, double, bf16_t or
//   fp16_t (the template parameter S); the kernel computes in compute_t<S>
//   (fp32 for the 16-bit types; lse, bias, alibi, sinks and dsinks are fp32
//   there). 16-bit values are widened where they are packed (Q, dO, K, V and
//   O in pass 1); everything between is the fp32 kernel. dK/dV stay in their
//   fp32 accumulators over all query blocks and are rounded once when the key
//   block is written; dQ of 16-bit storage is accumulated in fp32 buffers (one
//   per key chunk, |dq| * 4 bytes each) and rounded once in pass 3. S is
//   formed as the same object's forward formed it, so that P = exp(S - lse)
//   is exact: bf16 on the pair-product objects (avx512_bf16, neon_bf16) by
//   their pair sums, everything else by the FMA gemm (flash_bwd_pairs.h).

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attn_fast/attention.h"
#include "attn_fast/interrupt.h"
#include "attn_fast/kernel_entries.h"
#include "attn_fast/seq.h"

#include "isa.h"

namespace attn_fast {
namespace ATTN_NS {

#include ATTN_VEC_HEADER
#include "scores.h"  // add_alibi_bias, mask_user_row

namespace {

#include "storage.h"  // Storage<S>, ld / put
#include "toolkit.h"  // ThreadArena

constexpr int kBMR = IsaTraits::kMR, kBNR = IsaTraits::kNR;  // the micro-tile (vec_*.h)
constexpr int64_t kMinItems = 16;  // (sequence, kv head) pairs below which keys are split
constexpr int64_t kMaxSplit = 8;

// C[MR][NR*W] (+)= A[MR][K] * B[K][NR*W]; B rows of ldb. A element (r, k) is
// A[r * lda + k], or A[k * lda + r] when TA (A stored transposed: P^T and dS^T
// are read straight from P and dS, no transpose copy).
template <typename T, int MR, int NR, bool TA>
inline void gemm_micro(const T* __restrict A, int64_t lda, const T* __restrict Bm, int64_t ldb,
                       int64_t K, T* __restrict C, int64_t ldc, bool accumulate) {
  using V = Vec<T>;
  constexpr int W = V::W;
  typename V::R acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = accumulate ? V::load(C + r * ldc + n * W) : V::zero();
  for (int64_t k = 0; k < K; ++k) {
    typename V::R b[NR];
    for (int n = 0; n < NR; ++n) b[n] = V::load(Bm + k * ldb + n * W);
    for (int r = 0; r < MR; ++r) {
      const typename V::R a = V::set1(TA ? A[k * lda + r] : A[r * lda + k]);
      for (int n = 0; n < NR; ++n) acc[r][n] = V::fma(a, b[n], acc[r][n]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) V::store(C + r * ldc + n * W, acc[r][n]);
}

// The last rem < kBMR rows of a strip as one rem-row micro-tile: rem
// independent FMA chains per B vector instead of one (a 1-row tile waits on
// the FMA latency: 2 ymm chains keep a quarter of two pipes busy). Each C
// element sums its K terms in the same order whatever the tile's height.
template <typename T, int NR, bool TA, int R = kBMR - 1>
inline void gemm_tail(int64_t rem, const T* A, int64_t lda, const T* Bm, int64_t ldb, int64_t K,
                      T* C, int64_t ldc, bool accumulate) {
  if constexpr (R >= 1) {
    if (rem == R) return gemm_micro<T, R, NR, TA>(A, lda, Bm, ldb, K, C, ldc, accumulate);
    gemm_tail<T, NR, TA, R - 1>(rem, A, lda, Bm, ldb, K, C, ldc, accumulate);
  }
}

template <typename T, int NR, bool TA>
inline void gemm_strip(int64_t M, const T* A, int64_t lda, const T* Bm, int64_t ldb, int64_t K,
                       T* C, int64_t ldc, bool accumulate) {
  const int64_t step = TA ? 1 : lda;  // A's offset between rows
  int64_t m = 0;
  for (; m + kBMR <= M; m += kBMR)
    gemm_micro<T, kBMR, NR, TA>(A + m * step, lda, Bm, ldb, K, C + m * ldc, ldc, accumulate);
  if (m < M)
    gemm_tail<T, NR, TA>(M - m, A + m * step, lda, Bm, ldb, K, C + m * ldc, ldc, accumulate);
}

// C[M][N] (+)= op(A)[M][K] B[K][N], op(A) = A or (TA) A^T stored [K][M];
// N a multiple of W (B and C padded).
template <typename T, bool TA = false>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* Bm, int64_t ldb, T* C,
          int64_t ldc, bool accumulate) {
  constexpr int W = Vec<T>::W;
  int64_t n0 = 0;
  for (; n0 + kBNR * W <= N; n0 += kBNR * W)
    gemm_strip<T, kBNR, TA>(M, A, lda, Bm + n0, ldb, K, C + n0, ldc, accumulate);
  for (; n0 < N; n0 += W) gemm_strip<T, 1, TA>(M, A, lda, Bm + n0, ldb, K, C + n0, ldc, accumulate);
}

// Ranged products for tiles a structural range cuts (the causal diagonal, a
// sliding window's edges): row r of the tile sees columns [vlo[r], vhi[r])
// (vlo = vhi when none), and each micro-tile computes only what one of its
// rows sees. What is skipped is a sum of P = 0 or dS = 0 terms: an FMA chain
// that starts at +0 and adds fma(0, x, acc) = acc stays the same, so the
// results are those of the full products (for finite K, V; a sum that is -0
// can read +0 in the full product, the only bit it can change). Without it a
// causal diagonal tile pair computes 2x its visible area.

// The union [lo, hi) of the column ranges [vlo[r], vhi[r]) of h rows (rows
// with an empty range add nothing); lo = hi = 0 when every range is empty.
inline void rows_span(const int64_t* vlo, const int64_t* vhi, int64_t h, int64_t* lo, int64_t* hi) {
  int64_t a = INT64_MAX, b = 0;
  for (int64_t r = 0; r < h; ++r)
    if (vhi[r] > vlo[r]) {
      a = imin(a, vlo[r]);
      b = imax(b, vhi[r]);
    }
  if (b <= a) a = b = 0;
  *lo = a;
  *hi = b;
}

// C = A B for N columns; rows m..m+kBMR-1 get only the W-aligned columns their
// ranges cover, the rest of each row is set to 0 (S and dP: P = 0 there).
template <typename T>
void gemm_cols_ranged(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* Bm,
                      int64_t ldb, T* C, int64_t ldc, const int64_t* vlo, const int64_t* vhi) {
  constexpr int W = Vec<T>::W;
  for (int64_t m = 0; m < M; m += kBMR) {
    const int64_t h = imin(kBMR, M - m);
    int64_t lo, hi;
    rows_span(vlo + m, vhi + m, h, &lo, &hi);
    lo = lo / W * W;
    hi = imin(N, round_up(hi, W));
    for (int64_t r = m; r < m + h; ++r) {
      for (int64_t j = 0; j < lo; ++j) C[r * ldc + j] = T(0);
      for (int64_t j = hi; j < N; ++j) C[r * ldc + j] = T(0);
    }
    if (hi > lo)
      gemm<T>(h, hi - lo, K, A + m * lda, lda, Bm + lo, ldb, C + m * ldc + lo, ldc, false);
  }
}

// C = A B with A [M][cols] zero outside each row's range (dQ = dS K): rows
// m..m+kBMR-1 sum only over the columns their ranges cover.
template <typename T>
void gemm_k_ranged(int64_t M, int64_t N, const T* A, int64_t lda, const T* Bm, int64_t ldb, T* C,
                   int64_t ldc, const int64_t* vlo, const int64_t* vhi) {
  for (int64_t m = 0; m < M; m += kBMR) {
    const int64_t h = imin(kBMR, M - m);
    int64_t lo, hi;
    rows_span(vlo + m, vhi + m, h, &lo, &hi);
    if (hi > lo)
      gemm<T>(h, N, hi - lo, A + m * lda + lo, lda, Bm + lo * ldb, ldb, C + m * ldc, ldc, false);
    else
      for (int64_t r = m; r < m + h; ++r)
        for (int64_t e = 0; e < N; ++e) C[r * ldc + e] = T(0);
  }
}

// C += A^T B with A [K][M] (P or dS: row k of A is query row k): key
// micro-tile t (keys t kBMR ..) sums only over the query rows [tlo[t], thi[t])
// that see one of its keys (dV += P^T dO, dK += dS^T Q).
template <typename T>
void gemm_t_ranged(int64_t M, int64_t N, const T* A, int64_t lda, const T* Bm, int64_t ldb, T* C,
                   int64_t ldc, const int64_t* tlo, const int64_t* thi) {
  for (int64_t c = 0, t = 0; c < M; c += kBMR, ++t)
    if (thi[t] > tlo[t])
      gemm<T, true>(imin(kBMR, M - c), N, thi[t] - tlo[t], A + tlo[t] * lda + c, lda,
                    Bm + tlo[t] * ldb, ldb, C + c * ldc, ldc, true);
}

// Guarded products for key blocks holding a non-finite K or V value: terms
// with a zero weight are skipped, not multiplied (0 * NaN would leak).
// dP[r][j] = P[r][j] == 0 ? 0 : <dO_r, V_j>
template <typename T>
void dp_guarded(int64_t rows, int64_t cols, const T* P, int64_t ldp, const T* dO, int64_t lddo,
                const T* VT, int64_t ldvt, int64_t dv, T* dP) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      T acc = T(0);
      if (P[r * ldp + j] != T(0))
        for (int64_t e = 0; e < dv; ++e) acc += dO[r * lddo + e] * VT[e * ldvt + j];
      dP[r * ldp + j] = acc;
    }
}

// dQb[r][:] = sum_{j: dS[r][j] != 0} dS[r][j] K_j
template <typename T>
void dq_guarded(int64_t rows, int64_t cols, const T* dS, int64_t lds, const T* Kb, int64_t ldk,
                int64_t dp, T* dQb) {
  using V = Vec<T>;
  constexpr int W = V::W;
  for (int64_t r = 0; r < rows; ++r) {
    T* out = dQb + r * dp;
    for (int64_t e = 0; e < dp; e += W) V::store(out + e, V::zero());
    for (int64_t j = 0; j < cols; ++j) {
      const T s = dS[r * lds + j];
      if (s == T(0)) continue;
      const typename V::R a = V::set1(s);
      for (int64_t e = 0; e < dp; e += W)
        V::store(out + e, V::fma(a, V::load(Kb + j * ldk + e), V::load(out + e)));
    }
  }
}

// One thread's buffers, carved from its ThreadArena (toolkit.h).
template <typename T>
struct BScratch {
  T *Kb, *KT, *VT, *dKa, *dVa;  // key block: K rows, K^T, V^T, dK / dV accumulators
  T *Qs, *dOb, *S, *dS, *G, *dQb, *lse, *D;
  T* Qw;         // qw elements: the rows' bf16 pairs of tile_scores (flash_bwd_pairs.h), if any
  int64_t* qlo;  // per query block: union of its rows' structural key ranges
  int64_t* qhi;
  int64_t *vlo, *vhi;  // per row of a tile: its visible columns (gemm_*_ranged)
  int64_t *tlo, *thi;  // per key micro-tile of a tile: the rows that see it
  // Plans and takes every piece; false when the arena cannot provide them.
  bool carve(ThreadArena& ar, int64_t Br, int64_t Bc, int64_t dp, int64_t dvp, int64_t max_qb,
             int64_t qw) {
    T** pieces[] = {&Kb, &KT, &VT, &dKa, &dVa, &Qs, &dOb, &S, &dS, &G, &dQb, &lse, &D, &Qw};
    const int64_t sizes[] = {Bc * dp, dp * Bc, dvp * Bc, Bc * dp, Bc * dvp, Br * dp, Br * dvp,
                             Br * Bc, Br * Bc, Br * Bc,  Br * dp, Br,       Br,      qw};
    int64_t off[14];
    for (int i = 0; i < 14; ++i) off[i] = ar.plan<T>(sizes[i]);
    const int64_t olo = ar.plan<int64_t>(max_qb), ohi = ar.plan<int64_t>(max_qb);
    const int64_t nt = Bc / kBMR + 1;
    const int64_t ovl = ar.plan<int64_t>(Br), ovh = ar.plan<int64_t>(Br);
    const int64_t otl = ar.plan<int64_t>(nt), oth = ar.plan<int64_t>(nt);
    if (!ar.acquire()) return false;
    for (int i = 0; i < 14; ++i) *pieces[i] = ar.at<T>(off[i]);
    qlo = ar.at<int64_t>(olo);
    qhi = ar.at<int64_t>(ohi);
    vlo = ar.at<int64_t>(ovl);
    vhi = ar.at<int64_t>(ovh);
    tlo = ar.at<int64_t>(otl);
    thi = ar.at<int64_t>(oth);
    return true;
  }
};

#include "flash_bwd_pairs.h"  // tile_scores, pack_scores_k: S as this object's forward forms it

// The call's arguments plus the kernel's own buffers (in the compute type).
template <typename S>
struct BwdRun : BwdArgs<S> {
  using T = compute_t<S>;
  T* Dbuf = nullptr;  // D, laid out as lse
  // dQ partials, each laid out as lse x d: one per key chunk c > 0 for the
  // native types (chunk 0 adds into dq itself), one per chunk for 16-bit
  // storage (dq is written once, rounded, after the chunks are summed in fp32).
  T* split_buf = nullptr;
  int64_t split_stride = 0;
};

template <typename T>
inline int64_t lse_row(const AttnArgs<T>& a, const SeqInfo& si, int64_t h) {
  return a.cu_q ? h * a.Lq + si.q0 : (si.b * a.Hq + h) * a.Lq;
}

// Visibility of key j (absolute within the sequence) for local row i beyond
// the structural range: block-sparse layout and dense mask.
template <typename T>
inline bool user_visible(const AttnArgs<T>& a, const SeqInfo& si, int64_t h, int64_t i, int64_t j) {
  if (a.layout && !a.layout[si.b * a.slayout.b + h * a.slayout.h + (i / a.layout_bq) * a.slayout.l +
                            (j / a.layout_bk) * a.slayout.d])
    return false;
  if (a.mask && !a.mask[si.b * a.smask.b + h * a.smask.h + i * a.smask.l + j * a.smask.d])
    return false;
  return true;
}

// Each row's structural columns in the tile (sc.vlo / sc.vhi, tile-local) and,
// for each key micro-tile t, the rows that see one of its keys (sc.tlo / sc.thi).
// Returns cut: some row does not see all the tile's columns, so the products take
// the ranged forms (finite K, V only: a non-finite block keeps the full products).
template <typename S, typename T>
bool tile_ranges(const AttnArgs<S>& a, const SeqInfo& si, int64_t i0, int64_t rows, int64_t j0,
                 int64_t cols, bool nonfinite, BScratch<T>& sc) {
  bool cut = false;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t lo, hi;
    row_range(a, si, i0 + r, &lo, &hi);
    sc.vlo[r] = imin(imax(lo - j0, 0), cols);
    sc.vhi[r] = imin(imax(hi - j0, 0), cols);
    if (sc.vhi[r] <= sc.vlo[r]) sc.vlo[r] = sc.vhi[r] = 0;
    cut |= sc.vlo[r] > 0 || sc.vhi[r] < cols;
  }
  if (!cut || nonfinite) return false;
  for (int64_t c = 0, t = 0; c < cols; c += kBMR, ++t) {
    int64_t rlo = rows, rhi = 0;
    for (int64_t r = 0; r < rows; ++r)
      if (sc.vlo[r] < c + kBMR && sc.vhi[r] > c && sc.vhi[r] > sc.vlo[r]) {
        rlo = imin(rlo, r);
        rhi = r + 1;
      }
    sc.tlo[t] = rlo;
    sc.thi[t] = rhi;
  }
  return true;
}

// One (query head h, query block at local row i0) x (key block at j0) tile.
template <typename S>
void bwd_tile(const BwdRun<S>& g, const SeqInfo& si, int64_t h, int64_t i0, int64_t rows,
              int64_t j0, int64_t cols, int64_t Br, int64_t Bcp, bool nonfinite,
              BScratch<compute_t<S>>& sc, compute_t<S>* dq_target, const int64_t* dq_str) {
  using T = compute_t<S>;
  using V = Vec<T>;
  constexpr int W = V::W;
  const AttnArgs<S>& a = g.f;
  const int64_t d = a.d, dv = a.dv, dp = round_up(d, W), dvp = round_up(dv, W);
  const T scale = static_cast<T>(a.scale);

  // Pack Q (scaled), dO, lse and D of the rows.
  const S* qb = a.q + si.b * a.sq.b + h * a.sq.h + (si.q0 + i0) * a.sq.l;
  const S* dob = g.dout + si.b * g.sdo.b + h * g.sdo.h + (si.q0 + i0) * g.sdo.l;
  const int64_t lrow = lse_row(a, si, h) + i0;
  for (int64_t r = 0; r < rows; ++r) {
    T* qd = sc.Qs + r * dp;
    for (int64_t e = 0; e < d; ++e) qd[e] = ld(qb + r * a.sq.l + e * a.sq.d) * scale;
    for (int64_t e = d; e < dp; ++e) qd[e] = T(0);
    T* od = sc.dOb + r * dvp;
    for (int64_t e = 0; e < dv; ++e) od[e] = ld(dob + r * g.sdo.l + e * g.sdo.d);
    for (int64_t e = dv; e < dvp; ++e) od[e] = T(0);
    sc.lse[r] = a.lse[lrow + r];
    sc.D[r] = g.Dbuf[lrow + r];
  }
  const bool cut = tile_ranges(a, si, i0, rows, j0, cols, nonfinite, sc);

  // S = (scale Q) K^T, formed as this object's forward formed it (flash_bwd_pairs.h); the
  // FMA gemm of a cut tile computes each row's visible columns only.
  if (cut && !kPairScores<S>)
    gemm_cols_ranged<T>(rows, Bcp, d, sc.Qs, dp, sc.KT, Bcp, sc.S, Bcp, sc.vlo, sc.vhi);
  else
    tile_scores<S>(a, qb, rows, Bcp, sc);

  // Transforms, masks, P = exp(S - lse).
  const bool capped = a.softcap > 0;
  const T cap = static_cast<T>(a.softcap), icap = capped ? T(1) / cap : T(0);
  for (int64_t r = 0; r < rows; ++r) {
    T* s = sc.S + r * Bcp;
    T* gr = sc.G + r * Bcp;
    const int64_t i = i0 + r;
    const int64_t lo = j0 + sc.vlo[r], hi = j0 + sc.vhi[r];  // the row's range, clipped
    if (capped) {
      for (int64_t j = 0; j < cols; ++j) {
        const T t = std::tanh(s[j] * icap);
        s[j] = cap * t;
        gr[j] = T(1) - t * t;
      }
      for (int64_t j = cols; j < Bcp; ++j) gr[j] = T(0);
    }
    add_alibi_bias(a, si, h, i, j0, cols, s);
    if (lo > j0 || hi < j0 + cols)  // the structural range cuts this row of the tile
      for (int64_t j = 0; j < cols; ++j)
        if (j0 + j < lo || j0 + j >= hi) s[j] = NEG_INF<T>;
    mask_user_row(a, si, h, i, j0, cols, s);  // the layout and the dense mask (scores.h)
    for (int64_t j = cols; j < Bcp; ++j) s[j] = NEG_INF<T>;
    const T L = sc.lse[r];
    if (L == NEG_INF<T>) {  // the row sees nothing: P = 0
      for (int64_t j = 0; j < Bcp; ++j) s[j] = T(0);
      continue;
    }
    const typename V::R vl = V::set1(L);
    for (int64_t j = 0; j < Bcp; j += W)
      V::store(s + j, V::exp(V::sub(V::load(s + j), vl)));  // -inf -> 0
  }

  // dV += P^T dO.
  if (cut)
    gemm_t_ranged<T>(cols, dvp, sc.S, Bcp, sc.dOb, dvp, sc.dVa, dvp, sc.tlo, sc.thi);
  else
    gemm<T, true>(cols, dvp, rows, sc.S, Bcp, sc.dOb, dvp, sc.dVa, dvp, true);

  // dP = dO V^T, then dS = P * (dP - D) (* (1 - tanh^2)).
  if (nonfinite)
    dp_guarded<T>(rows, cols, sc.S, Bcp, sc.dOb, dvp, sc.VT, Bcp, dv, sc.dS);
  else if (cut)
    gemm_cols_ranged<T>(rows, Bcp, dv, sc.dOb, dvp, sc.VT, Bcp, sc.dS, Bcp, sc.vlo, sc.vhi);
  else
    gemm<T>(rows, Bcp, dv, sc.dOb, dvp, sc.VT, Bcp, sc.dS, Bcp, false);
  // (P = 0 gives dS = 0: dP is finite here, or 0 where P = 0 on guarded blocks;
  // padded columns have P = 0.)
  for (int64_t r = 0; r < rows; ++r) {
    const T* p = sc.S + r * Bcp;
    T* ds = sc.dS + r * Bcp;
    const T* gr = sc.G + r * Bcp;
    const typename V::R vD = V::set1(sc.D[r]);
    if (capped)
      for (int64_t j = 0; j < Bcp; j += W)
        V::store(ds + j,
                 V::mul(V::mul(V::load(p + j), V::sub(V::load(ds + j), vD)), V::load(gr + j)));
    else
      for (int64_t j = 0; j < Bcp; j += W)
        V::store(ds + j, V::mul(V::load(p + j), V::sub(V::load(ds + j), vD)));
  }

  // dK += dS^T (scale Q).
  if (cut)
    gemm_t_ranged<T>(cols, dp, sc.dS, Bcp, sc.Qs, dp, sc.dKa, dp, sc.tlo, sc.thi);
  else
    gemm<T, true>(cols, dp, rows, sc.dS, Bcp, sc.Qs, dp, sc.dKa, dp, true);

  // dQ += scale * dS K, into the item's dQ target (fixed key-block order).
  if (nonfinite)
    dq_guarded<T>(rows, cols, sc.dS, Bcp, sc.Kb, dp, dp, sc.dQb);
  else if (cut)
    gemm_k_ranged<T>(rows, dp, sc.dS, Bcp, sc.Kb, dp, sc.dQb, dp, sc.vlo, sc.vhi);
  else
    gemm<T>(rows, dp, cols, sc.dS, Bcp, sc.Kb, dp, sc.dQb, dp, false);
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = dq_target + (i0 + r) * dq_str[0];
    const T* src = sc.dQb + r * dp;
    for (int64_t e = 0; e < d; ++e) dst[e * dq_str[1]] += scale * src[e];
  }
}

// Where key chunk `chunk` of sequence si adds the dQ of head h: for the
// native types dq itself for chunk 0 (strided like the caller's array), else
// that chunk's contiguous buffer, added in chunk order after the items; for
// 16-bit storage every chunk's buffer (fp32), summed and rounded into dq after
// the items. str: (row, element) strides.
template <typename S>
compute_t<S>* dq_target(const BwdRun<S>& g, const SeqInfo& si, int64_t h, int64_t chunk,
                        int64_t str[2]) {
  if constexpr (Storage<S>::kNative) {
    if (chunk == 0) {
      str[0] = g.sdq.l;
      str[1] = g.sdq.d;
      return g.dq + si.b * g.sdq.b + h * g.sdq.h + si.q0 * g.sdq.l;
    }
  }
  const int64_t buf = Storage<S>::kNative ? chunk - 1 : chunk;
  str[0] = g.f.d;
  str[1] = 1;
  return g.split_buf + buf * g.split_stride + lse_row(g.f, si, h) * g.f.d;
}

// One work item: sequence s, kv head hk, key blocks [kb0, kb1); dQ of its G
// heads goes to dq (chunk 0) or to the chunk's buffer.
template <typename S>
void bwd_item(const BwdRun<S>& g, int64_t s, int64_t hk, int64_t chunk, int64_t nsplit, int64_t Br,
              int64_t Bc, BScratch<compute_t<S>>& sc, CancelToken& tok) {
  using T = compute_t<S>;
  using V = Vec<T>;
  constexpr int W = V::W;
  const AttnArgs<S>& a = g.f;
  const SeqInfo si = seq_info(a, s);
  const int64_t d = a.d, dv = a.dv, dp = round_up(d, W), dvp = round_up(dv, W);
  const int64_t G = a.Hq / a.Hkv;
  const int64_t nkb = (si.k_len + Bc - 1) / Bc;
  const int64_t kb0 = chunk * nkb / nsplit, kb1 = (chunk + 1) * nkb / nsplit;
  const int64_t nqb = (si.q_len + Br - 1) / Br;

  // dQ targets: zero this item's rows first.
  for (int64_t hh = 0; hh < G; ++hh) {
    int64_t str[2];
    T* t = dq_target(g, si, hk * G + hh, chunk, str);
    for (int64_t r = 0; r < si.q_rows; ++r)
      for (int64_t e = 0; e < d; ++e) t[r * str[0] + e * str[1]] = T(0);
  }
  // Keys past the sequence's length (padding) get zero gradients.
  if (chunk == 0 && !a.cu_q)
    for (int64_t j = si.k_len; j < a.Lk; ++j) {
      S* dkr = g.dk + si.b * g.sdk.b + hk * g.sdk.h + j * g.sdk.l;
      S* dvr = g.dv + si.b * g.sdv.b + hk * g.sdv.h + j * g.sdv.l;
      for (int64_t e = 0; e < d; ++e) put(dkr + e * g.sdk.d, T(0));
      for (int64_t e = 0; e < dv; ++e) put(dvr + e * g.sdv.d, T(0));
    }
  // Structural key range of each query block.
  for (int64_t qb = 0; qb < nqb; ++qb) {
    int64_t jlo = si.k_len, jhi = 0;
    const int64_t i0 = qb * Br, rows = imin(Br, si.q_len - i0);
    for (int64_t r = 0; r < rows; ++r) {
      int64_t lo, hi;
      row_range(a, si, i0 + r, &lo, &hi);
      if (hi > lo) {
        jlo = imin(jlo, lo);
        jhi = imax(jhi, hi);
      }
    }
    sc.qlo[qb] = jlo;
    sc.qhi[qb] = jhi;
  }

  for (int64_t kb = kb0; kb < kb1; ++kb) {
    if (tok.poll()) return;  // Ctrl-C: the call raises; the gradients are not a result
    const int64_t j0 = kb * Bc, cols = imin(Bc, si.k_len - j0), Bcp = round_up(cols, W);
    // Pack K (rows and transposed) and V^T; zero the accumulators.
    const S* kbase = a.k + si.b * a.sk.b + hk * a.sk.h + (si.k0 + j0) * a.sk.l;
    const S* vbase = a.v + si.b * a.sv.b + hk * a.sv.h + (si.k0 + j0) * a.sv.l;
    // Non-finite test as a flag (a sum of x * 0 would be one serial FMA chain).
    bool bad = false;
    for (int64_t c = 0; c < Bcp; ++c) {
      T* kr = sc.Kb + c * dp;
      for (int64_t e = 0; e < dp; ++e) {
        const T x = (c < cols && e < d) ? ld(kbase + c * a.sk.l + e * a.sk.d) : T(0);
        kr[e] = x;
        sc.KT[e * Bcp + c] = x;
        bad |= !std::isfinite(x);
      }
      for (int64_t e = 0; e < dv; ++e) {
        const T x = c < cols ? ld(vbase + c * a.sv.l + e * a.sv.d) : T(0);
        sc.VT[e * Bcp + c] = x;
        bad |= !std::isfinite(x);
      }
    }
    const bool nonfinite = bad;
    pack_scores_k<S>(a, kbase, cols, Bcp, sc);
    std::memset(sc.dKa, 0, sizeof(T) * Bcp * dp);
    std::memset(sc.dVa, 0, sizeof(T) * Bcp * dvp);

    for (int64_t hh = 0; hh < G; ++hh) {
      const int64_t h = hk * G + hh;
      int64_t str[2];
      T* target = dq_target(g, si, h, chunk, str);
      for (int64_t qb = 0; qb < nqb; ++qb) {
        if (!(sc.qlo[qb] < j0 + cols && sc.qhi[qb] > j0)) continue;
        // Ctrl-C between query tiles too: one key block against all the queries
        // of a long sequence is seconds of work (2^17 rows: 0.1 s here, ~4 s
        // under ASan), and the tile is ~10^4 times the poll's cost.
        if (tok.poll()) return;
        const int64_t i0 = qb * Br, rows = imin(Br, si.q_len - i0);
        if ((a.layout || a.mask)) {  // skip tiles the user masks leave empty
          bool any = false;
          for (int64_t r = 0; r < rows && !any; ++r) {
            int64_t lo, hi;
            row_range(a, si, i0 + r, &lo, &hi);
            for (int64_t jj = imax(lo, j0); jj < imin(hi, j0 + cols) && !any; ++jj)
              any = user_visible(a, si, h, i0 + r, jj);
          }
          if (!any) continue;
        }
        bwd_tile<S>(g, si, h, i0, rows, j0, cols, Br, Bcp, nonfinite, sc, target, str);
      }
    }
    // Write dK, dV of the block (16-bit storage: rounded once, here).
    S* dkb = g.dk + si.b * g.sdk.b + hk * g.sdk.h + (si.k0 + j0) * g.sdk.l;
    S* dvb = g.dv + si.b * g.sdv.b + hk * g.sdv.h + (si.k0 + j0) * g.sdv.l;
    for (int64_t c = 0; c < cols; ++c) {
      for (int64_t e = 0; e < d; ++e) put(dkb + c * g.sdk.l + e * g.sdk.d, sc.dKa[c * dp + e]);
      for (int64_t e = 0; e < dv; ++e) put(dvb + c * g.sdv.l + e * g.sdv.d, sc.dVa[c * dvp + e]);
    }
  }
}

// Pass 1 of the backward: D = rowsum(dO * O) per (sequence, head, row) into
// g.Dbuf, 0 on rows that see nothing; then dsinks_h = -sum over rows of
// exp(sink_h - lse) D, in a fixed row order.
template <typename S>
void bwd_row_dots(BwdRun<S>& g, int nt) {
  using T = compute_t<S>;
  const AttnArgs<S>& a = g.f;
  const int64_t dv = a.dv, n_sh = a.B * a.Hq;
  T* Dbuf = g.Dbuf;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t w = 0; w < n_sh; ++w) {
    const int64_t s = w / a.Hq, h = w % a.Hq;
    const SeqInfo si = seq_info(a, s);
    const int64_t lr = lse_row(a, si, h);
    const S* ob = a.o + si.b * a.so.b + h * a.so.h + si.q0 * a.so.l;
    const S* dob = g.dout + si.b * g.sdo.b + h * g.sdo.h + si.q0 * g.sdo.l;
    for (int64_t i = 0; i < si.q_rows; ++i) {
      T acc = T(0);
      if (i < si.q_len && a.lse[lr + i] != NEG_INF<T>)
        for (int64_t e = 0; e < dv; ++e)
          acc += ld(dob + i * g.sdo.l + e * g.sdo.d) * ld(ob + i * a.so.l + e * a.so.d);
      Dbuf[lr + i] = acc;
    }
  }
  if (a.sinks && g.dsinks) {
    for (int64_t h = 0; h < a.Hq; ++h) {
      double acc = 0;
      for (int64_t s = 0; s < a.B; ++s) {
        const SeqInfo si = seq_info(a, s);
        const int64_t lr = lse_row(a, si, h);
        for (int64_t i = 0; i < si.q_len; ++i) {
          const T L = a.lse[lr + i], Di = Dbuf[lr + i];
          if (Di != T(0) || Di != Di) acc += static_cast<double>(std::exp(a.sinks[h] - L) * Di);
        }
      }
      g.dsinks[h] = static_cast<T>(-acc);
    }
  }
}

// Pass 3 of the backward: add the chunks' dQ buffers, in chunk order (16-bit
// storage: sum the fp32 buffers in the same order, then round into dq once).
template <typename S>
void bwd_reduce_dq(const BwdRun<S>& g, int64_t nsplit, int nt) {
  using T = compute_t<S>;
  const AttnArgs<S>& a = g.f;
  const int64_t d = a.d, n_sh = a.B * a.Hq;
  constexpr bool kNative = Storage<S>::kNative;
  const T* split_buf = g.split_buf;
  if constexpr (kNative) {
    if (nsplit > 1) {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
      for (int64_t w = 0; w < n_sh; ++w) {
        const int64_t s = w / a.Hq, h = w % a.Hq;
        const SeqInfo si = seq_info(a, s);
        T* t = g.dq + si.b * g.sdq.b + h * g.sdq.h + si.q0 * g.sdq.l;
        for (int64_t c = 1; c < nsplit; ++c) {
          const T* src = split_buf + (c - 1) * g.split_stride + lse_row(a, si, h) * d;
          for (int64_t i = 0; i < si.q_rows; ++i)
            for (int64_t e = 0; e < d; ++e) t[i * g.sdq.l + e * g.sdq.d] += src[i * d + e];
        }
      }
    }
  } else {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t w = 0; w < n_sh; ++w) {
      const int64_t s = w / a.Hq, h = w % a.Hq;
      const SeqInfo si = seq_info(a, s);
      S* t = g.dq + si.b * g.sdq.b + h * g.sdq.h + si.q0 * g.sdq.l;
      const T* src = split_buf + lse_row(a, si, h) * d;
      for (int64_t i = 0; i < si.q_rows; ++i)
        for (int64_t e = 0; e < d; ++e) {
          T acc = src[i * d + e];
          for (int64_t c = 1; c < nsplit; ++c) acc += src[c * g.split_stride + i * d + e];
          put(t + i * g.sdq.l + e * g.sdq.d, acc);
        }
    }
  }
}

template <typename S>
void backward_impl(const BwdArgs<S>& g0) {
  using T = compute_t<S>;
  constexpr bool kNative = Storage<S>::kNative;
  constexpr int W = Vec<T>::W;
  const AttnArgs<S>& a = g0.f;
  if (a.B <= 0 || a.Hq <= 0 || a.Hkv <= 0) return;
  const int64_t Bc =
      imin(round_up(a.block_k > 0 ? a.block_k : 128, W), round_up(imin(imax(a.Lk, 1), 4096), W));
  const int64_t Br = imin(a.block_q > 0 ? a.block_q : 64, imin(imax(a.Lq, 1), 4096));
  const int64_t d = a.d, dv = a.dv, dp = round_up(d, W), dvp = round_up(dv, W);

  // Split rule (shapes only): few (sequence, kv head) pairs -> cut the keys.
  const int64_t pairs = a.B * a.Hkv;
  int64_t nsplit = 1;
  if (pairs < kMinItems)
    nsplit = imin(kMaxSplit, imin((kMinItems + pairs - 1) / pairs, (a.Lk + Bc - 1) / Bc));
  nsplit = imax(nsplit, 1);
  const int64_t rows_total = a.cu_q ? a.Lq : a.B * a.Lq;  // rows per head in lse's layout

  BwdRun<S> g;
  static_cast<BwdArgs<S>&>(g) = g0;
  const int64_t nD = a.Hq * rows_total;
  const int64_t nbuf = kNative ? nsplit - 1 : nsplit;  // dQ partials (see BwdRun)
  T* Dbuf = alloc_scratch<T>(nD);
  T* split_buf = nbuf > 0 ? alloc_scratch<T>(nbuf * nD * d) : nullptr;
  if (!Dbuf || (nbuf > 0 && !split_buf)) {
    std::free(Dbuf);
    std::free(split_buf);
    throw std::bad_alloc();
  }
  g.Dbuf = Dbuf;
  g.split_buf = split_buf;
  g.split_stride = nD * d;

  int nt = a.num_threads > 0 ? a.num_threads : 1;
  const double work =
      static_cast<double>(a.B) * a.Hq * a.Lq * a.Lk * static_cast<double>(a.d + a.dv) * 2.5;
  if (work < kSerialWork) nt = 1;

  bwd_row_dots(g, nt);

  // Pass 2: the work items.
  const int64_t n_items = pairs * nsplit;
  int64_t max_q = 0;
  for (int64_t s = 0; s < a.B; ++s) max_q = imax(max_q, seq_info(a, s).q_len);
  const int64_t max_qb = (max_q + Br - 1) / Br + 1;
  int failed = 0;
  if (nt > n_items) nt = static_cast<int>(imax(n_items, 1));
  CancelToken tok;  // Ctrl-C, polled between items and key blocks
#pragma omp parallel num_threads(nt) reduction(+ : failed)
  {
    ThreadArena arena;
    BScratch<T> sc;
    const bool ok =
        sc.carve(arena, Br, Bc, dp, dvp, max_qb, kPairScores<S> ? Br * ((d + 1) / 2) : 0);
    failed += ok ? 0 : 1;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t w = 0; w < n_items; ++w) {
      if (!ok || tok.poll()) continue;
      const int64_t chunk = w % nsplit, pair = w / nsplit;
      bwd_item<S>(g, pair / a.Hkv, pair % a.Hkv, chunk, nsplit, Br, Bc, sc, tok);
    }
    tok.finish_share();  // the calling thread keeps polling until the team is done
  }
  if (failed) {
    std::free(Dbuf);
    std::free(split_buf);
    throw std::bad_alloc();
  }

  if (!tok.cancelled()) bwd_reduce_dq(g, nsplit, nt);
  std::free(Dbuf);
  std::free(split_buf);
}

}  // namespace

#if defined(ATTN_DOT_BF16)
// The pair-product objects hold the bf16 backward only (its S by their pair
// product); every other call of their ISAs runs the avx512 / neon object.
ATTN_BF16DOT_ENTRY_POINTS
void flash_backward_bf16(const BwdArgs<bf16_t>& a) { backward_impl<bf16_t>(a); }
#else
ATTN_ISA_ENTRY_POINTS
#define ATTN_DEFINE_BACKWARD(sfx, S) \
  void flash_backward_##sfx(const BwdArgs<S>& a) { backward_impl<S>(a); }
ATTN_BACKWARD_TYPES(ATTN_DEFINE_BACKWARD)
#undef ATTN_DEFINE_BACKWARD
#endif

}  // namespace ATTN_NS
}  // namespace attn_fast
