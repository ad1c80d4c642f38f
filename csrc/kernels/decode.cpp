// Split-KV decode kernel (flash-decoding): a few query tokens against a long
// KV cache, O = softmax(scale * Q K^T) V.
//
// Shapes: q (B, Hq, Lq, d), o (B, Hq, Lq, dv), lse (B, Hq, Lq); the keys and
//   values of sequence b are read through a KvBlockSource (decode_sources.h):
//   a plain array or a KV cache's ring of R slots, or a paged pool through a
//   block table; rows stored as f32, f64, f16, bf16 or int8 codes with scales.
//
// Why another kernel: decoding has Lq = 1..4 query rows per head, so the
//   prefill kernel's work items (sequence, head, query block) number B * Hq,
//   each reading a whole head of K/V: with B = 1 most cores idle, and with GQA
//   every query head re-reads its group's K/V. Here:
//   1. Group rows. The G = Hq / Hkv query heads sharing kv head hk and the
//      Lq query tokens form G * Lq rows, processed together in row blocks of
//      up to kRB rows: K/V are read once per group, not once per query head.
//   2. Split the keys. The visible key range of a row block is cut into
//      splits of kSplitShort / 2, kSplitShort or kSplitLong keys, chosen by
//      the shape (results never depend on the thread count). Work item =
//      (sequence, row block, kv head, split), spread over the threads
//      (OpenMP, dynamic).
//   3. Each item streams its keys in blocks of kBc = 64 (run_split): S = Q K^T
//      and O_acc += P V by register-blocked micro-kernels (decode_rows.h),
//      online softmax (m, l) between them; the partial (O_acc, m, l) is
//      written unnormalised.
//   4. Merge: per row, m = max_s m_s, l = sum_s l_s exp(m_s - m),
//      O = sum_s O_s exp(m_s - m) / l, lse = m + log(l), the splits taken in
//      order (bit-for-bit identical for any thread count; the rule of
//      attn_fast.merge_attention_states). The thread that finishes the last
//      split of a (row block, kv head) merges it (an atomic counter,
//      acquire/release), so the two phases need no barrier.
//
// Memory traffic: K and V are read exactly once per kv head (a long-cache
//   decode is memory-bound); the per-item scratch is a few KiB, in L1. How
//   the next block's lines are requested is the prefetch policy
//   (PrefetchPolicy, DecodeArgs::prefetch_l2): hints only, the same bits under
//   any policy (bench/NOTES.md#decode-kernel).
//
// Masks: bottom-right (or top-left) causal and window_left/right on logical
//   key indices, exactly as AttnArgs documents (kv_lens / q_lens per sequence).
//   Rows with no visible key and padding rows (i >= q_len) get O = 0 and
//   lse = -inf. In blocks where a mask cuts through, keys of weight 0 are
//   skipped rather than multiplied, so a NaN in a masked V row cannot leak.
//   IEEE rules as the fused kernel (docs/HARDENING.md): a NaN visible score
//   makes the row NaN and its lse NaN, also when a whole 64-key block of the
//   row is NaN (max() drops NaN, so that case is looked for) and through the
//   merge of the splits.
//
// Numbers: S, P, m, l, the partials and the merge are in the compute type
//   (fp32 for the 16-bit and int8 storage); the merge sums the splits into one
//   row (DScratch::Ob) and rounds O once to the storage type.
// Scratch: bounded whatever Lq and Lk (see kPartBytes); per thread one
//   ThreadArena block; every allocation is checked (std::bad_alloc, thrown
//   outside the parallel region).
// Ctrl-C: a CancelToken (attn_fast/interrupt.h) polled between items and
//   every 16 key blocks of a split.
//
// Per-ISA like flash_fwd.cpp: plain functions, no std containers or statics.

#include <cmath>
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
#include "attn_fast/seq.h"

#include "isa.h"

namespace attn_fast {
namespace ATTN_NS {

#include ATTN_VEC_HEADER

namespace {

constexpr int kRB = 8;       // rows (query head x query token) per row block
constexpr int64_t kBc = 64;  // keys per block
// Keys per split (when the caller does not choose): long splits when there
// are enough of them to keep 16+ threads busy (a split's first block has no
// prefetch ahead of it, so longer splits read faster; bench/NOTES.md#decode-kernel),
// short ones otherwise, and half-short ones when short splits would give a
// call fewer than kMinShortItems items (three 512-key items on two threads
// leave one idle a third of the time; bench/NOTES.md#decode-kernel). Depends on
// the shape only, never on the thread count.
constexpr int64_t kSplitShort = 512, kSplitLong = 2048, kMinLongItems = 32, kMinShortItems = 4;

// Index helpers, per-sequence geometry and visibility: attn_fast/seq.h.
#include "storage.h"         // ld / put
#include "toolkit.h"         // NEG_INF, online_softmax_row, ThreadArena
#include "decode_rows.h"     // row loads, prefetch policy, QK / PV micro-kernels
#include "decode_sources.h"  // KvBlockSource: layouts x encodings

// Row block geometry: rows r0 .. r0+nr-1 of the (Lq * G) rows of one kv head,
// row r = i * G + g (query token i, group member g).
template <typename T>
inline void block_range(const DecodeArgs<T>& a, const SeqInfo& s, int64_t G, int64_t r0, int64_t nr,
                        int64_t* jlo, int64_t* jhi) {
  int64_t lo = s.k_len, hi = 0;
  for (int64_t i = r0 / G; i <= (r0 + nr - 1) / G; ++i) {
    int64_t l, h;
    row_range(a, s, i, &l, &h);
    if (h > l) {
      lo = imin(lo, l);
      hi = imax(hi, h);
    }
  }
  *jlo = lo;
  *jhi = hi;
}

// The query token i and group member m of a row block's rows r0, r0 + 1, ...
// (row = i * G + m), walked with one division per block instead of two per row.
struct RowCursor {
  int64_t i, m, G;
  RowCursor(int64_t r0, int64_t g) : i(r0 / g), m(r0 % g), G(g) {}
  void next() {
    if (++m == G) {
      m = 0;
      ++i;
    }
  }
};

// One (row block, kv head) of a sequence: a "group", whose visible keys
// [jlo, jhi) are cut into `nsplit` splits (work items item0 .. item0+nsplit-1
// of the current slice).
struct Group {
  int64_t b, r0, nr, hk, jlo, jhi, nsplit, item0;
};

// holds the scores, keys outside [lo, hi) are masked; on return srow holds
// P = exp(s - m_new) (0 where masked), *m and *l are updated and the row's
// O_acc (dvp elements) is rescaled by exp(m_old - m_new): the toolkit's
// online_softmax_row (one chain), shared with the fused kernel. Returns
// whether the mask cut through the block (then PV must skip zero weights).
template <typename T>
inline bool softmax_row(T* srow, int64_t cols, int64_t lo, int64_t hi, T* m, T* l, T* orow,
                        int64_t dvp) {
  constexpr int W = Vec<T>::W;
  bool partial = false;
  if (lo > 0 || hi < cols) {
    partial = true;
    for (int64_t c = 0; c < cols; ++c)
      if (c < lo || c >= hi) srow[c] = NEG_INF<T>;
  }
  const int64_t cols_p = round_up(cols, W);
  for (int64_t c = cols; c < cols_p; ++c) srow[c] = NEG_INF<T>;
  online_softmax_row<T, 1>(srow, cols, cols_p, *m, *l, orow, dvp);
  return partial;
}

// Process keys [c0, c1) of group g from source Src (a KvBlockSource); write
// the unnormalised partial (O_acc rows into Op[kRB][dvp], m, l). Returns early
// (partial garbage) when the call is cancelled.
template <class Src, typename ST = typename Src::ST, typename T = typename Src::T>
void run_split(const DecodeArgs<ST>& a, const Group& g, int64_t c0, int64_t c1,
               const typename Src::Sc& sc, T* Op, T* mp, T* lp, CancelToken& tok) {
  using Enc = typename Src::Enc;
  constexpr int W = Vec<T>::W;
  const int64_t G = a.Hq / a.Hkv, d = a.d, dv = a.dv;
  const int64_t dp = round_up(d, W), dvp = round_up(dv, W);
  const SeqInfo s = seq_info(a, g.b);
  const int nr = static_cast<int>(g.nr);
  const T scale = static_cast<T>(a.scale);
  RowCursor rc(g.r0, G);
  for (int r = 0; r < nr; ++r, rc.next()) {  // the rows' Q, visible ranges and (m, l)
    const int64_t i = rc.i, h = g.hk * G + rc.m;
    Enc::load_q(a.q + g.b * a.sq.b + h * a.sq.h + i * a.sq.l, a.sq.d, d, dp, scale, sc.Qs + r * dp);
    row_range(a, s, i, &sc.lo[r], &sc.hi[r]);
    mp[r] = NEG_INF<T>;
    lp[r] = T(0);
  }
  std::memset(Op, 0, sizeof(T) * nr * dvp);  // rows nr .. kRB - 1 are never read

  const Src src(a, g.b, g.hk, s.k0);
  int64_t cols = 0;
  for (int64_t j0 = c0, blk = 0; j0 < c1; j0 += cols, ++blk) {
    // Long splits (a capped split count, see decode_impl) look for Ctrl-C
    // every 16 blocks, not only between items.
    if (blk % 16 == 15 && tok.poll()) return;
    const typename Src::Block bk = src.block(j0, imin(kBc, c1 - j0), sc, nr, dp);
    cols = bk.cols;
    Pf pf, pfv;
    src.hints(bk, j0, c0, c1, sc, &pf, &pfv);
    Enc::qk(nr, sc, bk.e, cols, d, dp, scale, src.stag ? &pfv : &pf);  // S = Q K^T
    bool partial = false;                                              // masks and online softmax
    for (int r = 0; r < nr; ++r)
      partial |= softmax_row(sc.S + r * kBc, cols, sc.lo[r] - j0, sc.hi[r] - j0, &mp[r], &lp[r],
                             Op + r * dvp, dvp);
    Enc::weight_v(nr, sc, bk.e, cols, Op, dv, dvp);
    if (!partial) {  // O += P V
      pv_dispatch<T, typename Src::KV>(nr, sc.S, kBc, sc.vrow, cols, dv, Op, dvp, &pf);
    } else {  // skip zero weights: a NaN in a masked V row must not leak
      for (int r = 0; r < nr; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const T p = sc.S[r * kBc + c];
          if (p == T(0)) continue;
          T* orow = Op + r * dvp;
          const auto* vr = sc.vrow[c];
          for (int64_t e = 0; e < dv; ++e) orow[e] += p * ld(vr + e);
        }
    }
  }
}

// Merge the nsplit partials of group g in order; write O (rounded once to the
// storage type) and lse. Ob: dv compute-type elements of scratch (only read
// when the group has splits).
template <typename S, typename T = compute_t<S>>
void merge_group(const DecodeArgs<S>& a, const Group& g, const T* Opart, const T* mpart,
                 const T* lpart, T* Ob) {
  constexpr int W = Vec<T>::W;
  const T NaN = std::numeric_limits<T>::quiet_NaN();
  const int64_t G = a.Hq / a.Hkv, dvp = round_up(a.dv, W);
  RowCursor rc(g.r0, G);
  for (int64_t r = 0; r < g.nr; ++r, rc.next()) {
    const int64_t i = rc.i, h = g.hk * G + rc.m;
    S* dst = a.o + g.b * a.so.b + h * a.so.h + i * a.so.l;
    T* lse = a.lse ? a.lse + (g.b * a.Hq + h) * a.Lq + i : nullptr;
    T m = NEG_INF<T>;
    bool nan = false;  // a NaN partial max (a NaN score) makes the row NaN
    for (int64_t sp = 0; sp < g.nsplit; ++sp) {
      const T ms = mpart[(g.item0 + sp) * kRB + r];
      m = ms > m ? ms : m;
      nan = nan || ms != ms;
    }
    // One split: its m, its l and its O_acc / l, exactly (exp(0) = 1 in the general
    // sums below), so a short call pays no exp and no copy through Ob.
    const bool one = g.nsplit == 1;
    T l = T(0);
    if (nan) {
      l = NaN;
    } else if (one) {
      l = lpart[g.item0 * kRB + r];
    } else if (m != NEG_INF<T>) {
      for (int64_t sp = 0; sp < g.nsplit; ++sp) {
        const int64_t it = (g.item0 + sp) * kRB + r;
        if (mpart[it] != NEG_INF<T>) l += lpart[it] * std::exp(mpart[it] - m);
      }
    }
    if (m == NEG_INF<T> || !(l > T(0))) {  // empty row (0, -inf) or NaN row (NaN, NaN)
      for (int64_t e = 0; e < a.dv; ++e) put(dst + e * a.so.d, l != l ? l : T(0));
      if (lse) *lse = l != l ? l : NEG_INF<T>;
      continue;
    }
    const T inv = T(1) / l;
    if (one) {
      const T* src = Opart + (g.item0 * kRB + r) * dvp;
      if (a.so.d == 1)
        for (int64_t e = 0; e < a.dv; ++e) put(dst + e, src[e] * inv);
      else
        for (int64_t e = 0; e < a.dv; ++e) put(dst + e * a.so.d, src[e] * inv);
      if (lse) *lse = m + std::log(l);
      continue;
    }
    // First split writes, later ones accumulate (in order).
    bool first = true;
    for (int64_t sp = 0; sp < g.nsplit; ++sp) {
      const int64_t it = g.item0 + sp;
      const T ms = mpart[it * kRB + r];
      if (ms == NEG_INF<T>) continue;
      const T f = std::exp(ms - m) * inv;
      const T* src = Opart + (it * kRB + r) * dvp;
      if (first) {
        for (int64_t e = 0; e < a.dv; ++e) Ob[e] = src[e] * f;
        first = false;
      } else {
        for (int64_t e = 0; e < a.dv; ++e) Ob[e] += src[e] * f;
      }
    }
    for (int64_t e = 0; e < a.dv; ++e) put(dst + e * a.so.d, Ob[e]);
    if (lse) *lse = m + std::log(l);
  }
}

// Memory: the partials of all splits of a call grow like Lq * Lk * dv / split
// (a 32k-row chunk against 32k keys needed 149 MiB), so the groups are taken
// in slices whose partials fit kPartBytes (at least kMinSliceItems items, at
// most kMaxSliceGroups groups), and a group never has more splits than fit a
// slice (its split grows instead: beyond ~2^21 keys per row block for
// float32, dv = 128, default split; ~2^20 for float64). The scratch of a
// call is then O(dv) per item and thread, whatever Lq and Lk.
constexpr int64_t kPartBytes = int64_t(4) << 20, kMinSliceItems = 64, kMaxSliceGroups = 4096;

// A call's work: the row blocks, the split length (by shape only, never the
// thread count), the slice sizes and the thread count.
struct Plan {
  int64_t G, rows, upb, n_groups, split, slice_items, slice_groups;
  int nt;
};

template <typename ST>
Plan plan_call(const DecodeArgs<ST>& a) {
  using T = compute_t<ST>;
  Plan p;
  p.G = a.Hq / a.Hkv;
  p.rows = a.Lq * p.G;               // rows per (sequence, kv head)
  p.upb = (p.rows + kRB - 1) / kRB;  // row blocks per sequence
  p.n_groups = a.B * p.upb * a.Hkv;  // group x = (b * upb + row block) * Hkv + hk
  // One pass: the items of long and of short splits, the longest range, the work.
  int64_t long_items = 0, short_items = 0, max_range = 0;
  double work = 0;
  for (int64_t b = 0; b < a.B; ++b) {
    const SeqInfo s = seq_info(a, b);
    for (int64_t r0 = 0; r0 < p.rows; r0 += kRB) {
      const int64_t nr = imin(kRB, p.rows - r0);
      int64_t jlo, jhi;
      block_range(a, s, p.G, r0, nr, &jlo, &jhi);
      const int64_t range = imax(0, jhi - jlo);
      max_range = imax(max_range, range);
      if (long_items < kMinLongItems) long_items += (range + kSplitLong - 1) / kSplitLong * a.Hkv;
      if (short_items < kMinShortItems)
        short_items += (range + kSplitShort - 1) / kSplitShort * a.Hkv;
      work += static_cast<double>(range) * nr * a.Hkv * static_cast<double>(a.d + a.dv);
    }
  }
  p.split = a.split > 0                     ? a.split
            : long_items >= kMinLongItems   ? kSplitLong
            : short_items >= kMinShortItems ? kSplitShort
                                            : kSplitShort / 2;
  const int64_t dvp = round_up(a.dv, Vec<T>::W);
  const int64_t item_bytes = kRB * (dvp + 2) * static_cast<int64_t>(sizeof(T));
  const int64_t max_items = imax(kMinSliceItems, kPartBytes / item_bytes);
  if (max_range / p.split >= max_items) p.split = round_up(max_range / max_items + 1, kBc);
  int64_t n_items = 0;  // over the whole call
  for (int64_t b = 0; b < a.B && n_items < max_items; ++b) {
    const SeqInfo s = seq_info(a, b);
    for (int64_t r0 = 0; r0 < p.rows && n_items < max_items; r0 += kRB) {
      int64_t jlo, jhi;
      block_range(a, s, p.G, r0, imin(kRB, p.rows - r0), &jlo, &jhi);
      if (jhi > jlo) n_items += (jhi - jlo + p.split - 1) / p.split * a.Hkv;
    }
  }
  p.slice_items = imax(1, imin(n_items, max_items));
  p.slice_groups = imin(p.n_groups, kMaxSliceGroups);
  p.nt = a.num_threads > 0 ? a.num_threads : 1;
  if (imax(n_items, p.n_groups) < p.nt) p.nt = static_cast<int>(imax(1, imax(n_items, p.n_groups)));
  // Small steps run on the calling thread, as in the prefill kernel: waking a
  // team costs more than it saves, and its spinning workers fight NumPy's BLAS
  // between calls (bench/NOTES.md#decode-python). The decode bar is a quarter of
  // the prefill's (about 35 us of one thread's work): a decode step's items are
  // already split by shape, so a second thread pays from there on.
  if (work < kSerialWork / 4) p.nt = 1;
  return p;
}

// Slice k of a call uses buffer k % 2: its groups, their done counters, ng
// groups and ni items; last: no slice follows (decided when it is built, so
// every thread agrees). build() fills it with the next groups that fit.
struct Slice {
  Group* groups;
  int64_t* done;
  int64_t ng, ni;
  bool last;
};

template <typename ST>
void build_slice(const DecodeArgs<ST>& a, const Plan& p, int64_t* x_next, Slice& S,
                 const CancelToken& tok) {
  S.ng = S.ni = 0;
  while (*x_next < p.n_groups && S.ng < p.slice_groups && !tok.cancelled()) {
    const int64_t x = *x_next, u = x / a.Hkv;
    Group& g = S.groups[S.ng];
    g.b = u / p.upb;
    g.r0 = (u % p.upb) * kRB;
    g.nr = imin(kRB, p.rows - g.r0);
    g.hk = x % a.Hkv;
    block_range(a, seq_info(a, g.b), p.G, g.r0, g.nr, &g.jlo, &g.jhi);
    g.nsplit = g.jhi > g.jlo ? (g.jhi - g.jlo + p.split - 1) / p.split : 0;
    if (S.ng > 0 && S.ni + g.nsplit > p.slice_items) break;
    g.item0 = S.ni;
    S.ni += g.nsplit;
    S.done[S.ng] = 0;
    ++S.ng;
    ++*x_next;
  }
  S.last = *x_next >= p.n_groups || tok.cancelled();
}

// The group of item w: the last group with item0 <= w that has items.
inline int64_t group_of(const Slice& S, int64_t w) {
  int64_t lo = 0, hi = S.ng;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (S.groups[mid].item0 <= w)
      lo = mid;
    else
      hi = mid;
  }
  while (S.groups[lo].nsplit == 0 || w >= S.groups[lo].item0 + S.groups[lo].nsplit) ++lo;
  return lo;
}

// The shared buffers of a call, carved from one allocation (64-byte aligned
// parts): the partials of one slice and the two group tables.
template <typename T>
struct CallBuffers {
  unsigned char* block;
  T *Opart, *mpart, *lpart;
  Group* gbuf;
  int64_t* dbuf;
};

template <typename T>
bool alloc_buffers(const Plan& p, int64_t dvp, CallBuffers<T>* cb) {
  const int64_t n_part = p.slice_items * kRB, ng2 = 2 * p.slice_groups;
  const int64_t sizes[5] = {
      n_part * dvp * static_cast<int64_t>(sizeof(T)), n_part * static_cast<int64_t>(sizeof(T)),
      n_part * static_cast<int64_t>(sizeof(T)), ng2 * static_cast<int64_t>(sizeof(Group)),
      ng2 * static_cast<int64_t>(sizeof(int64_t))};
  int64_t off[5], total = 0;
  for (int i = 0; i < 5; ++i) {
    off[i] = total;
    total += round_up(sizes[i], 64);
  }
  cb->block = alloc_scratch<unsigned char>(total);
  if (!cb->block) return false;
  cb->Opart = reinterpret_cast<T*>(cb->block + off[0]);
  cb->mpart = reinterpret_cast<T*>(cb->block + off[1]);
  cb->lpart = reinterpret_cast<T*>(cb->block + off[2]);
  cb->gbuf = reinterpret_cast<Group*>(cb->block + off[3]);
  cb->dbuf = reinterpret_cast<int64_t*>(cb->block + off[4]);
  return true;
}

// One call with rows of encoding Enc. The shared buffers are allocated here;
// each thread carves its own scratch as it starts (overlapping the team's
// wake-up), and one that cannot takes no items: the call then throws
// std::bad_alloc after the region. The group tables are double-buffered: the
// next slice is built while the last items of this one still read theirs.
// A one-thread plan (plan_call: small steps, or one thread asked for) runs
// the same items in the same order on the calling thread without entering a
// parallel region, whose start and end cost about as much as a 16-key step.
template <class Enc>
void decode_impl(const DecodeArgs<typename Enc::ST>& a) {
  using T = typename Enc::T;
  if (a.B <= 0 || a.Hq <= 0 || a.Lq <= 0) return;
  const Plan p = plan_call(a);
  const int64_t dvp = round_up(a.dv, Vec<T>::W);
  CallBuffers<T> cb;
  if (!alloc_buffers(p, dvp, &cb)) throw std::bad_alloc();
  T *Opart = cb.Opart, *mpart = cb.mpart, *lpart = cb.lpart;
  CancelToken tok;
  Slice sl[2] = {{cb.gbuf, cb.dbuf, 0, 0, false},
                 {cb.gbuf + p.slice_groups, cb.dbuf + p.slice_groups, 0, 0, false}};
  int64_t x_next = 0;  // first group not yet in a slice
  build_slice(a, p, &x_next, sl[0], tok);
  // Work item w of slice S: its split, then the group's merge when it was the
  // group's last split to finish.
  auto item = [&](const Slice& S, int64_t w, typename Enc::Sc& sc) {
    const int64_t gi = group_of(S, w);
    const Group& g = S.groups[gi];
    const int64_t c0 = g.jlo + (w - g.item0) * p.split, c1 = imin(g.jhi, c0 + p.split);
    T *Ow = Opart + w * kRB * dvp, *mw = mpart + w * kRB, *lw = lpart + w * kRB;
    if (a.block_table)
      run_split<KvBlockSource<Pages, Enc>>(a, g, c0, c1, sc, Ow, mw, lw, tok);
    else
      run_split<KvBlockSource<Slots, Enc>>(a, g, c0, c1, sc, Ow, mw, lw, tok);
    if (__atomic_add_fetch(&S.done[gi], 1, __ATOMIC_ACQ_REL) == g.nsplit && !tok.cancelled())
      merge_group(a, g, Opart, mpart, lpart, sc.Ob);
  };
  int failed = 0;
  if (p.nt == 1) {
    ThreadArena arena;
    typename Enc::Sc sc;
    const bool ok = carve_scratch(arena, sc, a.d, a.dv);
    failed = ok ? 0 : 1;
    for (int cur = 0; ok; cur ^= 1) {
      const Slice& S = sl[cur];
      for (int64_t x = 0; x < S.ng; ++x)
        if (S.groups[x].nsplit == 0)
          merge_group(a, S.groups[x], Opart, mpart, lpart, static_cast<T*>(nullptr));
      for (int64_t w = 0; w < S.ni && !tok.poll(); ++w) item(S, w, sc);
      if (S.last) break;
      build_slice(a, p, &x_next, sl[cur ^ 1], tok);
    }
  } else {
#pragma omp parallel num_threads(p.nt) reduction(+ : failed)
    {
      ThreadArena arena;
      typename Enc::Sc sc;
      const bool ok = carve_scratch(arena, sc, a.d, a.dv);
      failed += ok ? 0 : 1;
      for (int cur = 0;; cur ^= 1) {
        const Slice& S = sl[cur];
        // Groups without visible keys: write their zero rows now.
#pragma omp for schedule(static) nowait
        for (int64_t x = 0; x < S.ng; ++x)
          if (S.groups[x].nsplit == 0)
            merge_group(a, S.groups[x], Opart, mpart, lpart, static_cast<T*>(nullptr));
        // Splits; the thread that finishes the last split of a group merges it
        // (no barrier between the two phases).
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t w = 0; w < S.ni; ++w) {
          if (!ok || tok.poll()) continue;  // Ctrl-C: skip the rest (the call raises)
          item(S, w, sc);
        }
        tok.finish_share();  // the calling thread keeps polling until the team is done
        if (S.last) break;
        // The next slice, into the other buffer; the barrier that ends the
        // single also keeps its items from overwriting partials still in use.
#pragma omp single
        build_slice(a, p, &x_next, sl[cur ^ 1], tok);
      }
    }
  }
  std::free(cb.block);
  if (failed) throw std::bad_alloc();
}

}  // namespace

// The entry points: the rows' encoding is chosen here, once per call.
#if defined(ATTN_DOT_BF16)
// The bf16-dot object: the bf16 decode with its dot-product Q K^T; every other
// storage type of that ISA runs the plain object.
void decode_forward_bf16(const DecodeArgs<bf16_t>& a) { decode_impl<Bf16DotEncoding>(a); }
#else
void decode_forward_f32(const DecodeArgs<float>& a) {
  if (!with_encoding(a.coding, CodedEncodings{}, [&](auto e) { decode_impl<decltype(e)>(a); }))
    decode_impl<FloatEncoding<float>>(a);
}
const KvEncodingDesc* kv_encoding(const char* name, int* tag) {
  return find_encoding(name, tag, CodedEncodings{});
}
void decode_forward_f64(const DecodeArgs<double>& a) { decode_impl<FloatEncoding<double>>(a); }
void decode_forward_bf16(const DecodeArgs<bf16_t>& a) { decode_impl<FloatEncoding<bf16_t>>(a); }
void decode_forward_f16(const DecodeArgs<fp16_t>& a) { decode_impl<FloatEncoding<fp16_t>>(a); }
#endif

}  // namespace ATTN_NS
}  // namespace attn_fast
