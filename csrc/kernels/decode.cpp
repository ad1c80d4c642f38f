// Split-KV decode kernel (flash-decoding): a few query tokens against a long
// KV cache, O = softmax(scale * Q K^T) V.
//
// Shapes: q (B, Hq, Lq, d), o (B, Hq, Lq, dv), lse (B, Hq, Lq);
//         k (B, Hkv, R, d), v (B, Hkv, R, dv) with R slots per sequence: a
//         plain array (R = Lk) or a KV cache's storage, possibly a ring:
//         logical key j of sequence b lives in slot (kv_start[b] + j) mod R.
//
// Why another kernel: decoding has Lq = 1..4 query rows per head, so the
//   prefill kernel's work items (sequence, head, query block) number B * Hq,
//   each reading a whole head of K/V: with B = 1 most cores idle, and with GQA
//   every query head re-reads its group's K/V. Here:
//   1. Group rows. The G = Hq / Hkv query heads sharing kv head hk and the
//      Lq query tokens form G * Lq rows; they are processed together in row
//      blocks of up to kRB rows, so one pass over a K/V row serves the whole
//      group (K/V read once per group, not once per query head).
//   2. Split the keys. The visible key range of a row block is cut into
//      splits of kSplitShort or kSplitLong keys (chosen by the shape, so
//      results do not depend on the thread count). Work item = (sequence,
//      row block, kv head, split); the items are spread over the threads
//      (OpenMP, dynamic).
//   3. Each item streams its keys in blocks of Bc = 64: S = Q_blk K_blk^T
//      (each K vector loaded once and FMA'd into every row's accumulator;
//      several keys per pass so that about 8 independent FMA chains hide the
//      latency; dot products reduced four at a time, or sixteen in one
//      tree for 4 rows x 4 keys on AVX-512), online softmax (m, l),
//      O_acc += P V_blk (each V vector loaded once per key and FMA'd into
//      every row's accumulator, N rows x E vectors held in registers across
//      the block). The partial (O_acc, m, l) is written unnormalised.
//   4. Merge: per row, m = max_s m_s, l = sum_s l_s exp(m_s - m),
//      O = sum_s O_s exp(m_s - m) / l, lse = m + log(l), the splits taken in
//      order (bit-for-bit identical for any thread count). This is the
//      log-sum-exp rule of attn_fast.merge_attention_states. The thread that
//      finishes the last split of a (row block, kv head) merges it (an atomic
//      counter, acquire/release), so the two phases need no barrier.
//
// Memory traffic: K and V are read exactly once per kv head (the point: a long
//   cache decode is memory-bound, about (d + dv) * 4 bytes per key per kv head
//   for fp32). Per-item scratch (Q rows, S block, O_acc) is a few KiB, in L1.
//   Each block's K and V rows (2 x 32 KiB at d = 128) are first touched by a
//   tight loop that loads one element per cache line: its misses overlap the
//   way a streaming read's do, and the compute loops then hit L1/L2. The
//   compute loops alone stall on every miss (few loads in flight per FMA);
//   in A/B runs on the 2-core Zen 3 the touch pass raised the achieved
//   bandwidth per CPU-second by about 1.7x for H_q = 32, H_kv = 8 at 32k keys.
//   int8 rows (2 lines at d = 128) skip the touch pass (0.95x without it on
//   Zen 5; on Zen 3, 0.75-0.91x with the prefetch below instead; pf_at).
//   The next block's lines are software-prefetched prefetch_per (fp32 3, bf16
//   2, int8 1 on AVX-512; fp32 1, bf16 1 on AVX2, whose blocks have twice the
//   inner iterations) per inner iteration of the QK / PV loops, enough for
//   the whole block, spread over the block's math (a burst of prefetches at
//   the block start measured worse); int8 on AVX2 one every other iteration
//   of the P V loop only; bf16 / fp16 on AVX2 staggered (this block's V rows
//   during QK, the next block's K rows during P V, no touch pass after a
//   split's first block: staggered()). The addresses are walked in
//   registers (Pf), not listed in memory; an int8 block that starts a key
//   group also prefetches the group's scales and offsets.
//   That is the l1 policy, tuned on AMD Zen 3 / Zen 5. On Intel (Sapphire
//   Rapids) it left fp32 at 75 % and bf16 at 67 % of the streaming read: a
//   prefetcht0 holds one of the core's L1 fill buffers until its line
//   arrives, so they cap the misses in flight, and the touch pass adds more.
//   The l2 policy (DecodeArgs::prefetch_l2, chosen by dispatch on Intel)
//   prefetches into L2 (prefetcht1; fp32 4 per iteration) and skips the touch
//   pass: fp32 0.78-0.80x, bf16 0.76-0.77x the time there, 95-101 % of the
//   probe; on AMD Zen 4 fp32 0.64-0.82x, bf16 0.73-0.85x (dispatch picks it
//   there too). On Zen 5 L2 prefetches were 1.05-1.23x slower (bench/notes_archive.md,
//   dec4, dec6, zen4).
//   An alternative that prefetched each next-block line from inside the loop
//   reading the matching line (K during QK, V during PV) and touched only a
//   split's first block was 15-30 % slower in paired runs at 4k-32k keys:
//   the V lines were requested too late.
//   Register blocking: 4 rows (GQA 32/8, one token) use 3 keys x 4 rows in QK
//   and 4 rows x 3 vectors per PV pass, 12 independent FMA chains (8, the
//   former shape, just covers the 4-cycle latency of the 2 FMA pipes):
//   1.03-1.16x in paired runs, together with exp2_neg and 2048-key splits.
//   On AVX-512 (32 registers) 4 rows use 4 keys per QK pass and 4 vectors per
//   PV pass (16 chains; bf16 0.86-0.89x, int8 0.93-0.95x of 3 / 3, the same
//   sums in the same order: bench/notes_archive.md, dec4 step 5).
//
// Masks: bottom-right (or top-left) causal and window_left/right on logical
//   key indices, exactly as AttnArgs documents (kv_lens / q_lens per sequence).
//   Rows with no visible key and padding rows (i >= q_len) get O = 0 and
//   lse = -inf. In blocks where a mask cuts through, keys of weight 0 are
//   skipped rather than multiplied, so a NaN in a masked V row cannot leak.
//   IEEE rules as the fused kernel (docs/HARDENING.md): a NaN visible score
//   (from q or k) makes the row NaN and its lse NaN, also when a whole
//   64-key block of the row is NaN (max() drops NaN, so that case is looked
//   for) and through the merge of the splits.
//
// Storage types: q, k, v, o are float, double, bf16_t or fp16_t (template
//   parameter S, compute type compute_t<S>, as flash_fwd.cpp). 16-bit K and V
//   rows are read as stored (half the bytes of fp32: the point for a
//   memory-bound decode) and widened to fp32 in registers as they are loaded
//   (ldv: bf16 by a 16-bit shift, fp16 by F16C); Q once, when its rows are
//   scaled. S, P, m, l, the partials and the merge are fp32; the merge sums the
//   splits into an fp32 row (DScratch::Ob) and rounds O once to the storage
//   type. lse is fp32. On the avx512_bf16 object (the avx512_bf16 ISA, chosen
//   where vdpbf16ps outruns fp32 FMA) bf16 keys take Q K^T by vdpbf16ps on the
//   raw bf16 Q and K (qk_rows_dot: no widening of K, half the instructions;
//   the scale multiplies the fp32 scores); P V stays fp32 FMA (P is never
//   rounded to bf16). Every other type of that ISA runs the avx512 object.
//   int8 K/V (KVCache(dtype="int8"), DecodeArgs<float>::k8; run_split's KV =
//   int8_t): codes are sign-extended and converted to fp32 in registers (ldv);
//   the scales never touch the d-long loops. Keys x = q8 * ks + ko per channel
//   over groups of kgroup (= kBc = 64) slots: a block is cut at its group's
//   end, and the group's ks is folded into the block's Q rows (Qg = Qs * ks,
//   dp multiplies per row and block) and its ko into one bias per row
//   (Qs . ko) added to S. Values x = q8 * vs + vo per token: P * vs is the PV
//   weight and (P . vo) is added to every O column. Bytes read per key and kv
//   head: d + dv codes + 8 + 8 d / kgroup scale bytes (280 at d = dv = 128,
//   1024 for fp32).
// Paged K/V (PagedKVCache, DecodeArgs::block_table): the keys of sequence b
//   live in pages of block_size rows taken from a pool (a list of chunks, so
//   the pool grows without moving its pages); a block table maps page j /
//   block_size of b to its physical block. A key block never crosses a page
//   (cols is cut at the page's end, as an int8 block is cut at its group's),
//   so each block reads its rows from one base pointer exactly as the
//   contiguous path does: no gather copy, one table lookup per 64 keys. With
//   block_size a multiple of 64 and splits starting at multiples of 64 (no
//   window) nothing is cut and the result is bit-identical to the contiguous
//   cache's. The prefetch of the next block looks its page up the same way.
// Scratch: bounded whatever Lq and Lk (see kPartBytes); every allocation is
//   checked (std::bad_alloc, thrown outside the parallel region).
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
// are enough of them to keep 16+ threads busy (a split's first block is read
// without prefetch: 2048-key splits measured ~6 % faster than 512 at 32k
// keys, paired A/B), short ones otherwise. Depends on the shape only, never
// on the thread count.
constexpr int64_t kSplitShort = 512, kSplitLong = 2048, kMinLongItems = 32;
// Prefetches per inner-loop iteration of the next block's K and V lines, by
// the bytes per element (both layouts). The QK / PV loops of a block have
// about 430 iterations at d = dv = 128 against 1024 lines of fp32 rows, 512 of
// bf16 and 256 of int8: 3, 2 and 1 per iteration cover the whole next block.
// One per iteration for every type (the former rule for the contiguous cache)
// left the rest to the hardware prefetcher, which the next page of a paged
// cache defeats; on one thread's CPU time 3 (fp32) and 2 (bf16) were 0.86x and
// 0.90x of 1 contiguous, 3 and 2 the best paged (bench/notes_archive.md, dec4).
// With the lines prefetched into L2 and no touch pass (DecodeArgs::prefetch_l2,
// Intel, Zen 4), fp32 takes 4: 0.92x of 3 on Sapphire Rapids, 2 threads (bf16
// 3 was 1.05-1.06x of 2; bench/notes_archive.md, dec6); on Zen 4 fp32 3 and 6 were
// 1.13-1.24x of 4, bf16 1 1.47-1.52x and 3 1.03-1.07x of 2 (zen4).
// Those counts are for 16-lane vectors (AVX-512). With 8 lanes (AVX2) a block
// has twice the inner iterations (about 750 at d = dv = 128, 4 rows), so half
// the rate covers it: fp32 1 (1.4 lines per iteration would cover all; the
// hardware prefetcher streams the rest), bf16 and int8 1. On Zen 3, 3 per
// iteration issued the next block's lines in a burst in the first third of
// the block: 1.17x the time of 1 at 2 threads, 1.22x at one (paired, in one
// process; bench/notes_archive.md, zen3); a paged cache at 2 measured no better than
// at 1 there (1.10-1.11x of contiguous either way). int8 rows on 8 lanes take
// their prefetches in the P V loop only (int8_on_8_lanes below). The l2
// policy on an 8-lane object (an Intel CPU without AVX-512) halves the same
// way, to fp32 2: a rule, not measured.
template <typename KV>
constexpr int prefetch_per(bool l2) {
  constexpr int w16 = sizeof(KV) >= 4 ? 3 : sizeof(KV) == 2 ? 2 : 1;  // l1, 16 lanes
  const int n = (l2 && sizeof(KV) >= 4 ? 4 : w16) * Vec<float>::W;
  return n <= 16 ? 1 : n / 16;
}

// int8 rows on 8 lanes (AVX2; Zen 3) prefetch the next block in the P V loop
// only, one line every other iteration (~512 iterations at dv = 128 against 256
// lines of codes): the next block's lines are requested evenly over the whole
// P V phase. The other types and widths use both loops at prefetch_per's rate.
// On Zen 3, against the touch pass with no prefetch (as before): 0.75x the time
// at 1 x 32768 on one thread, 0.80x on two, 0.84x at 4096 keys, 0.91-0.95x on
// data in L2 / L3 (L = 256, 2048); the same rate in both loops was 1.05-1.17x,
// and the whole block requested during QK (bursts or one per iteration) no
// better (bench/notes_archive.md, zen3b). Results are bit-identical (prefetch only).
template <typename T, typename KV>
constexpr bool int8_on_8_lanes() {
  return Vec<T>::W == 8 && sizeof(KV) == 1;
}
template <typename T, typename KV>
constexpr bool pf_at(int64_t c) {  // P V loop, key c
  return !int8_on_8_lanes<T, KV>() || (c & 1) != 0;
}
// 16-bit rows on 8 lanes (AVX2; Zen 3) under the l1 policy prefetch staggered:
// the QK loop requests this block's V rows, the P V loop the next block's K
// rows, one line per iteration (~350 and ~380 iterations at d = dv = 128
// against 256 lines each), and only a split's first block touches its K rows
// (nothing prefetched them). The lines in flight are half a block's, and
// L1 (32 KiB on Zen 3, one bf16 block of K and V) holds the rows being read
// and the rows being fetched instead of two whole blocks. Against the touch
// pass with the next block's K and V prefetched in both loops: bf16 0.87-0.91x
// the time (1 x 32768 on one and two threads, 1 x 4096), fp16 0.86-0.89x, paged
// (64-slot pages) 0.92x; fp32 rows (1024 lines a block) the same way 1.17-1.18x
// (1.01x on data in L3), int8 rows 1.09-1.40x (with their prefetch in QK at
// any rate): they keep theirs (bench/notes_archive.md, zen3c). Bit-identical
// (prefetches and loads only).
template <typename T, typename KV>
constexpr bool staggered() {
  return Vec<T>::W == 8 && sizeof(KV) == 2;
}

// Index helpers, per-sequence geometry and visibility: attn_fast/seq.h
// (imin / imax, SeqInfo / seq_info / row_range, shared with the fused kernels).
// round_up and alloc_scratch (checked, 64-byte aligned): attn_fast/seq.h too.

// Storage type S of q, k, v, o <-> compute type compute_t<S> (as flash_fwd.cpp):
// float and double are read as they are; bf16 / fp16 K and V rows are widened
// to fp32 in registers as they are loaded (ldv), Q once when its rows are
// scaled, and O is rounded once when the merge writes it (put).
#include "storage.h"  // ld / put
#include "toolkit.h"  // NEG_INF, online_softmax_row
// W consecutive elements of storage type S as one compute-type register.
template <typename T>
inline typename Vec<T>::R ldv(const T* p) {
  return Vec<T>::load(p);
}
inline Vec<float>::R ldv(const bf16_t* p) {
  return Vec<float>::load_bf16(reinterpret_cast<const uint16_t*>(p));
}
inline Vec<float>::R ldv(const fp16_t* p) {
  return Vec<float>::load_f16(reinterpret_cast<const uint16_t*>(p));
}
// int8 K/V (KVCache(dtype="int8")): W codes sign-extended and converted to fp32
// in registers (Vec<float>::load_i8); the scales are applied outside the dot
// products (run_split).
inline Vec<float>::R ldv(const int8_t* p) { return Vec<float>::load_i8(p); }
inline float ld(const int8_t* p) { return static_cast<float>(*p); }

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

// The next block's cache lines, prefetched `per` per inner-loop iteration of
// the compute loops (so the next block's misses overlap this block's math),
// walked in registers: its K rows, then its V rows, as runs of bytes, one
// run per row, or one run for all of them where the rows are packed (a
// cache's layout): a line address, an end, and a compare per prefetch.
struct Pf {
  const char* at;   // the next line (64-byte aligned)
  const char* end;  // the end of the current run
  const char* k;    // the next K run, then the next V run
  const char* v;
  int64_t ks, vs;      // bytes from one run to the next
  int64_t klen, vlen;  // bytes per run
  int64_t kn, vn;      // runs left
  int per;
  bool l2;  // prefetcht1 (into L2) instead of prefetcht0
};
// Rows r0 .. r0 + rows - 1 of len elements (row stride ld elements) from base,
// as runs for Pf: one run where the rows are packed, else one per row.
template <typename KV>
inline void pf_runs(const KV* base, int64_t r0, int64_t rows, int64_t ld, int64_t len,
                    const char** run, int64_t* step, int64_t* run_len, int64_t* n) {
  const int64_t bytes = len * static_cast<int64_t>(sizeof(KV));
  *run = reinterpret_cast<const char*>(base + r0 * ld);
  *step = ld * static_cast<int64_t>(sizeof(KV));
  const bool dense = *step == bytes;
  *n = dense ? 1 : rows;
  *run_len = dense ? rows * bytes : bytes;
}
// Every 64-byte line of n floats from p (the int8 cache's scales), into L1
// (prefetcht0), or into L2 (prefetcht1: l2 = a paged cache under the l2
// policy). A paged cache's scales lie in per-page records of the pool
// ((block, H_kv, ...)), and the lines fetched into L1 a block ahead were lost
// there before use: on Zen 4 (decode_ab int8, 2 threads, 64-slot pages
// shuffled, 5 runs) paged took 1.08-1.14x the contiguous time with t0 and
// 1.02-1.08x with t1 at 32k keys (1.013x and 1.003x at 4096). The contiguous
// cache keeps t0 (with t1 it read 0.98-1.02x, noise), as does the l1 policy
// (Zen 3 / Zen 5: not measured there). bench/notes_archive.md, zen4 step 7.
inline void prefetch_lines(const float* p, int64_t n, bool l2) {
  for (int64_t e = 0; e < n; e += 16) {
    if (l2)
      __builtin_prefetch(p + e, 0, 2);
    else
      __builtin_prefetch(p + e, 0, 3);
  }
}
// The next run into at / end; false when none is left.
inline bool pf_next_run(Pf* p) {
  const char* r;
  int64_t len;
  if (p->kn > 0) {
    r = p->k, len = p->klen, p->k += p->ks, --p->kn;
  } else if (p->vn > 0) {
    r = p->v, len = p->vlen, p->v += p->vs, --p->vn;
  } else {
    return false;
  }
  p->at = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(r) & ~uintptr_t(63));
  p->end = r + len;
  return true;
}
__attribute__((always_inline)) inline void pf_step(Pf* p) {
  for (int k = 0; k < p->per; ++k) {
    if (p->at >= p->end && !pf_next_run(p)) return;
    if (p->l2)
      __builtin_prefetch(p->at, 0, 2);
    else
      __builtin_prefetch(p->at, 0, 3);
    p->at += 64;
  }
}

// S[r][c] = <Qs[r], K_c> for N rows and `cols` keys (K rows via pointers, in
// the storage type SK; Qs and S in the compute type T).
// KC keys per pass: N * KC independent accumulator chains (enough to cover
// the FMA latency), each Q vector load serves KC keys, and the dot products
// are reduced four at a time (4 rows x 4 keys on AVX-512: all sixteen in one
// tree, Vec::hsum16: int8 0.91-0.93x, bf16 0.94-0.97x the time on Sapphire
// Rapids, 2 threads; a different summation order, so other bits than hsum4).
// flatten: everything inlined (GCC's inliner otherwise may leave Vec::hsum4 a
// call in the key loop: 1.25-1.65x slower steps, seen once in an A/B).
// The NK dot-product accumulators of a key pass reduced to NK sums: 16 of 16
// lanes (4 rows x 4 keys on AVX-512) in one tree, else four at a time.
template <typename T, int NK>
__attribute__((always_inline)) inline void reduce_dots(const typename Vec<T>::R* acc, T* sums) {
  using V = Vec<T>;
  if constexpr (NK == 16 && V::W == 16) {
    V::store(sums, V::hsum16(acc));
  } else {
    int i = 0;
    for (; i + 4 <= NK; i += 4) V::hsum4(acc + i, sums + i);
    for (; i < NK; ++i) sums[i] = V::hsum(acc[i]);
  }
}

template <typename T, typename SK, int N, int KC>
__attribute__((flatten)) inline void qk_rows(const T* Qs, int64_t ldq, const SK* const* kp,
                                             int64_t cols, int64_t d, T* S, int64_t lds, Pf* pf) {
  using V = Vec<T>;
  constexpr int W = V::W, NK = N * KC;
  const int64_t dvec = d / W * W;
  int64_t c = 0;
  for (; c + KC <= cols; c += KC) {
    const SK* kr[KC];
    for (int j = 0; j < KC; ++j) kr[j] = kp[c + j];
    typename V::R acc[NK];
    for (int i = 0; i < NK; ++i) acc[i] = V::zero();
    for (int64_t e = 0; e < dvec; e += W) {
      if constexpr (!int8_on_8_lanes<T, SK>()) pf_step(pf);
      typename V::R kx[KC];
      for (int j = 0; j < KC; ++j) kx[j] = ldv(kr[j] + e);
      for (int r = 0; r < N; ++r) {
        const typename V::R qv = V::load(Qs + r * ldq + e);
        for (int j = 0; j < KC; ++j) acc[r * KC + j] = V::fma(qv, kx[j], acc[r * KC + j]);
      }
    }
    alignas(64) T sums[NK];
    reduce_dots<T, NK>(acc, sums);
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < KC; ++j) {
        T x = sums[r * KC + j];
        for (int64_t e = dvec; e < d; ++e) x += Qs[r * ldq + e] * ld(kr[j] + e);
        S[r * lds + c + j] = x;
      }
  }
  if constexpr (KC > 1) {
    if (c < cols) qk_rows<T, SK, N, 1>(Qs, ldq, kp + c, cols - c, d, S + c, lds, pf);
  }
}

// bf16 keys on the avx512_bf16 object (dot_keys below): S[r][c] = scale *
// <Q[r], K_c> with Q the raw bf16 query rows (Qw, ldq bf16 values per row,
// zero-padded to a multiple of 32) and K_c bf16 rows, by vdpbf16ps on pairs
// along d (2 W products per instruction, twice the fp32 FMA's multiply-adds;
// no widening of K). The products of two bf16 values are exact in fp32 and
// accumulate in fp32, as the fp32 path's; the scale multiplies the fp32 sum
// (not Q), a different rounding than (scale Q) . K. vdpbf16ps treats bf16
// subnormal inputs and fp32 subnormal results as zero (|x| < 2^-126: scores
// that small change no softmax). A d tail (d % 32) is a masked load of K
// (lanes past d never read). The prefetch walk steps twice per 32 dims, the
// rate per dimension of the fp32-compute path. Same key passes and reduction
// trees as qk_rows.
#if defined(ATTN_DOT_BF16)
template <int N, int KC>
__attribute__((flatten)) inline void qk_rows_dot(const uint16_t* Qw, int64_t ldq,
                                                 const bf16_t* const* kp, int64_t cols, int64_t d,
                                                 float scale, float* S, int64_t lds, Pf* pf) {
  using V = Vec<float>;
  using D = DotBf16;
  constexpr int NK = N * KC;
  constexpr int64_t P = 2 * V::W;  // bf16 values per vdpbf16ps operand
  const int64_t dfull = d / P * P, rest = d - dfull;
  int64_t c = 0;
  for (; c + KC <= cols; c += KC) {
    const uint16_t* kr[KC];
    for (int j = 0; j < KC; ++j) kr[j] = reinterpret_cast<const uint16_t*>(kp[c + j]);
    typename V::R acc[NK];
    for (int i = 0; i < NK; ++i) acc[i] = V::zero();
    for (int64_t e = 0; e < dfull; e += P) {
      pf_step(pf);
      pf_step(pf);
      D::B kx[KC];
      for (int j = 0; j < KC; ++j) kx[j] = D::load_row(kr[j] + e);
      for (int r = 0; r < N; ++r) {
        const D::B qv = D::load_row(Qw + r * ldq + e);
        for (int j = 0; j < KC; ++j) acc[r * KC + j] = D::dot(acc[r * KC + j], qv, kx[j]);
      }
    }
    if (rest) {
      pf_step(pf);
      D::B kx[KC];
      for (int j = 0; j < KC; ++j) kx[j] = D::load_row(kr[j] + dfull, rest);
      for (int r = 0; r < N; ++r) {
        const D::B qv = D::load_row(Qw + r * ldq + dfull);
        for (int j = 0; j < KC; ++j) acc[r * KC + j] = D::dot(acc[r * KC + j], qv, kx[j]);
      }
    }
    alignas(64) float sums[NK];
    reduce_dots<float, NK>(acc, sums);
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < KC; ++j) S[r * lds + c + j] = sums[r * KC + j] * scale;
  }
  if constexpr (KC > 1) {
    if (c < cols) qk_rows_dot<N, 1>(Qw, ldq, kp + c, cols - c, d, scale, S + c, lds, pf);
  }
}
#endif
// Whether run_split takes qk_rows_dot: bf16 queries and keys on the
// avx512_bf16 object (the ISA chosen where vdpbf16ps outruns fp32 FMA).
template <typename S, typename KV>
constexpr bool dot_keys() {
#if defined(ATTN_DOT_BF16)
  return std::is_same<S, bf16_t>::value && std::is_same<KV, bf16_t>::value;
#else
  return false;
#endif
}

// O[r][e0:e1] += sum_c P[r][c] V_c[e0:e1] for N rows, E vectors of dv per
// pass (N * E accumulators kept in registers across the keys). Returns the
// first column not done (a multiple of E*W past e0).
template <typename T, typename SV, int N, int E>
__attribute__((flatten)) inline int64_t pv_cols(const T* P, int64_t ldp, const SV* const* vp,
                                                int64_t cols, int64_t e0, int64_t e1, T* O,
                                                int64_t ldo, Pf* pf) {
  using V = Vec<T>;
  constexpr int W = V::W, NE = N * E;
  int64_t e = e0;
  for (; e + E * W <= e1; e += E * W) {
    typename V::R acc[NE];
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < E; ++j) acc[r * E + j] = V::load(O + r * ldo + e + j * W);
    for (int64_t c = 0; c < cols; ++c) {
      if (pf_at<T, SV>(c)) pf_step(pf);
      const SV* vr = vp[c] + e;
      typename V::R vx[E];
      for (int j = 0; j < E; ++j) vx[j] = ldv(vr + j * W);
      for (int r = 0; r < N; ++r) {
        const typename V::R p = V::set1(P[r * ldp + c]);
        for (int j = 0; j < E; ++j) acc[r * E + j] = V::fma(p, vx[j], acc[r * E + j]);
      }
    }
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < E; ++j) V::store(O + r * ldo + e + j * W, acc[r * E + j]);
  }
  return e;
}

// bf16 V rows on AVX-512: pv_cols with each pair of W-lane accumulators
// holding the even and the odd columns of 2 W (Vec::load_bf16_eo: one load,
// a shift and a mask per 2 W values instead of two widening loads and two
// shifts; O's columns are split on the pass's load and merged on its store).
// The same products summed in the same order per column: bit-identical to
// pv_cols. EP pairs (2 EP vectors of dv) per pass, the passes of pv_cols<E =
// 2 EP>, so the prefetch walk sees the same calls. Returns the first column
// not done.
#if defined(ATTN_ISA_AVX512)
template <int N, int EP>
__attribute__((flatten)) inline int64_t pv_cols_eo(const float* P, int64_t ldp,
                                                   const bf16_t* const* vp, int64_t cols,
                                                   int64_t e0, int64_t e1, float* O, int64_t ldo,
                                                   Pf* pf) {
  using V = Vec<float>;
  constexpr int W = V::W, NE = N * EP;
  int64_t e = e0;
  for (; e + 2 * EP * W <= e1; e += 2 * EP * W) {
    typename V::R ev[NE], od[NE];
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < EP; ++j)
        V::load_eo(O + r * ldo + e + 2 * j * W, &ev[r * EP + j], &od[r * EP + j]);
    for (int64_t c = 0; c < cols; ++c) {
      pf_step(pf);
      const uint16_t* vr = reinterpret_cast<const uint16_t*>(vp[c]) + e;
      typename V::R xe[EP], xo[EP];
      for (int j = 0; j < EP; ++j) V::load_bf16_eo(vr + 2 * j * W, &xe[j], &xo[j]);
      for (int r = 0; r < N; ++r) {
        const typename V::R p = V::set1(P[r * ldp + c]);
        for (int j = 0; j < EP; ++j) {
          ev[r * EP + j] = V::fma(p, xe[j], ev[r * EP + j]);
          od[r * EP + j] = V::fma(p, xo[j], od[r * EP + j]);
        }
      }
    }
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < EP; ++j)
        V::store_eo(O + r * ldo + e + 2 * j * W, ev[r * EP + j], od[r * EP + j]);
  }
  return e;
}
#endif

// O[r][:dv] += sum_c P[r][c] V_c for N rows (O row stride ldo, padded to W).
template <typename T, typename SV, int N, int E>
inline void pv_rows(const T* P, int64_t ldp, const SV* const* vp, int64_t cols, int64_t dv, T* O,
                    int64_t ldo, Pf* pf) {
  constexpr int W = Vec<T>::W;
  const int64_t dvec = dv / W * W;
  int64_t e = 0;
#if defined(ATTN_ISA_AVX512)
  if constexpr (std::is_same<SV, bf16_t>::value && std::is_same<T, float>::value && E % 2 == 0)
    e = pv_cols_eo<N, E / 2>(P, ldp, vp, cols, 0, dvec, O, ldo, pf);
#endif
  e = pv_cols<T, SV, N, E>(P, ldp, vp, cols, e, dvec, O, ldo, pf);
  if constexpr (E > 1) e = pv_cols<T, SV, N, 1>(P, ldp, vp, cols, e, dvec, O, ldo, pf);
  for (; e < dv; ++e)
    for (int r = 0; r < N; ++r) {
      T x = O[r * ldo + e];
      for (int64_t c = 0; c < cols; ++c) x += P[r * ldp + c] * ld(vp[c] + e);
      O[r * ldo + e] = x;
    }
}

// Keys (QK) and value vectors (PV) per pass for N rows: about 8 accumulators.
// The row count nr (1..8, of a row block) as a compile-time pair (rows,
// key/column unroll) for the qk_rows / pv_rows micro-loops: f(rows, unroll)
// with std::integral_constant arguments.
template <typename F>
inline void by_rows(int nr, F&& f) {
  using std::integral_constant;
  switch (nr) {
    case 1:
      return f(integral_constant<int, 1>{}, integral_constant<int, 8>{});
    case 2:
      return f(integral_constant<int, 2>{}, integral_constant<int, 4>{});
    case 3:
      return f(integral_constant<int, 3>{}, integral_constant<int, 2>{});
    case 4:
      return f(integral_constant<int, 4>{}, integral_constant<int, 3>{});
    case 5:
      return f(integral_constant<int, 5>{}, integral_constant<int, 1>{});
    case 6:
      return f(integral_constant<int, 6>{}, integral_constant<int, 1>{});
    case 7:
      return f(integral_constant<int, 7>{}, integral_constant<int, 1>{});
    default:
      return f(integral_constant<int, 8>{}, integral_constant<int, 1>{});
  }
}

template <typename T, typename SK>
void qk_dispatch(int nr, const T* Qs, int64_t ldq, const SK* const* kp, int64_t cols, int64_t d,
                 T* S, int64_t lds, Pf* pf) {
  by_rows(nr, [&](auto R, auto U) {
    constexpr int N = decltype(R)::value;
    // 4 rows on AVX-512: 4 keys per pass (16 chains; 64-key blocks without a
    // 1-key tail); the same dot products, each reduced by the same tree.
    constexpr int KC = N == 4 && Vec<T>::W == 16 ? 4 : decltype(U)::value;
    qk_rows<T, SK, N, KC>(Qs, ldq, kp, cols, d, S, lds, pf);
  });
}

#if defined(ATTN_DOT_BF16)
inline void qk_dispatch_dot(int nr, const uint16_t* Qw, int64_t ldq, const bf16_t* const* kp,
                            int64_t cols, int64_t d, float scale, float* S, int64_t lds, Pf* pf) {
  by_rows(nr, [&](auto R, auto U) {
    constexpr int N = decltype(R)::value;
    constexpr int KC = N == 4 ? 4 : decltype(U)::value;  // as qk_dispatch on 16 lanes
    qk_rows_dot<N, KC>(Qw, ldq, kp, cols, d, scale, S, lds, pf);
  });
}
#endif

template <typename T, typename SV>
void pv_dispatch(int nr, const T* P, int64_t ldp, const SV* const* vp, int64_t cols, int64_t dv,
                 T* O, int64_t ldo, Pf* pf) {
  by_rows(nr, [&](auto R, auto U) {
    constexpr int N = decltype(R)::value;
    // 4 rows on AVX-512 (32 registers): 4 vectors per pass, 16 accumulators
    // (half the P broadcasts and passes of 3); the same sums in the same order.
    // 4 rows of int8 on AVX2 (16 registers): 2 vectors per pass. With 3, the
    // 12 accumulators, 3 widened V vectors and the P broadcast took all 16
    // registers and GCC kept one accumulator on the stack (a store-to-load
    // chain per key, found in the disassembly); 2 keep 8 chains, enough for
    // the 2 FMA pipes: the loop alone 0.95x, int8 steps 0.93x at 32k keys on
    // Zen 3 (paired, in one process). bf16 keeps 3 (2 measured 1.05-1.06x).
    // The same sums in the same order (E only groups the columns).
    constexpr int E = N == 4 && Vec<T>::W == 16            ? 4
                      : N == 4 && int8_on_8_lanes<T, SV>() ? 2
                                                           : decltype(U)::value;
    pv_rows<T, SV, N, E>(P, ldp, vp, cols, dv, O, ldo, pf);
  });
}

// Load one element of every 64-byte line of `cols` rows of `len` elements and
// sum them (so the loads are kept): brings the rows into the caches with many
// independent misses in flight.
template <typename S, typename T = compute_t<S>>
inline T touch_lines(const S* const* rows, int64_t cols, int64_t len) {
  if constexpr (!std::is_same<S, T>::value) {  // 16-bit: sum the raw bits (only the loads matter)
    constexpr int64_t L = 32;
    uint32_t t0 = 0, t1 = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const uint16_t* r = reinterpret_cast<const uint16_t*>(rows[c]);
      int64_t e = 0;
      for (; e + L < len; e += 2 * L) {
        t0 += r[e];
        t1 += r[e + L];
      }
      if (e < len) t0 += r[e];
    }
    return static_cast<T>(t0 + t1);
  }
  using V = Vec<T>;
  constexpr int64_t L = 64 / static_cast<int64_t>(sizeof(S));  // elements per line
  typename V::R t0 = V::zero(), t1 = V::zero();
  for (int64_t c = 0; c < cols; ++c) {
    const S* r = rows[c];
    int64_t e = 0;
    for (; e + L < len; e += 2 * L) {
      t0 = V::add(t0, V::set1(ld(r + e)));
      t1 = V::add(t1, V::set1(ld(r + e + L)));
    }
    if (e < len) t0 = V::add(t0, V::set1(ld(r + e)));
  }
  return V::hsum(V::add(t0, t1));
}

// One (row block, kv head) of a sequence: a "group", whose visible keys
// [jlo, jhi) are cut into `nsplit` splits (work items item0 .. item0+nsplit-1
// of the current slice).
struct Group {
  int64_t b, r0, nr, hk, jlo, jhi, nsplit, item0;
};

// ST: the storage type of q, k, v, o; T: the compute type.
template <typename ST, typename T = compute_t<ST>>
struct DScratch {
  T* Qs;            // kRB x dp, scaled query rows (padded)
  T* S;             // kRB x kBc scores / probabilities
  ST* Kpack;        // kBc x dp packed K block (only for strided d), storage type
  ST* Vpack;        // kBc x dvp packed V block (only for strided dv), storage type
  const ST** krow;  // the block's K rows (in the cache, or in Kpack)
  const ST** vrow;  // the block's V rows
  int64_t* lo;
  int64_t* hi;
  T* sink;
  T* Ob;  // dvp: one output row while the merge sums the splits (rounded once)
  // int8 K/V only: the block's K / V rows, the rows' Q with the block's key
  // group scales folded in, the group offsets' dot products, and the block's
  // per-token value scales and offsets.
  const int8_t** krow8;
  const int8_t** vrow8;
  T* Qg;   // kRB x dp
  T* qb;   // kRB
  T* pvs;  // kBc
  T* pvo;  // kBc
};

// The block's K / V row pointers of storage type KV (S itself, or int8_t).
template <typename KV, typename S>
const KV** krows_of(const DScratch<S>& sc) {
  if constexpr (std::is_same<KV, int8_t>::value)
    return sc.krow8;
  else
    return sc.krow;
}
template <typename KV, typename S>
const KV** vrows_of(const DScratch<S>& sc) {
  if constexpr (std::is_same<KV, int8_t>::value)
    return sc.vrow8;
  else
    return sc.vrow;
}

template <typename S>
void free_thread_scratch(DScratch<S>& sc) {
  std::free(sc.Qs);
  std::free(sc.S);
  std::free(sc.Kpack);
  std::free(sc.Vpack);
  std::free(sc.krow);
  std::free(sc.vrow);
  std::free(sc.lo);
  std::free(sc.hi);
  std::free(sc.sink);
  std::free(sc.Ob);
  std::free(sc.krow8);
  std::free(sc.vrow8);
  std::free(sc.Qg);
  std::free(sc.qb);
  std::free(sc.pvs);
  std::free(sc.pvo);
}

// All of one thread's scratch; false (and nothing left allocated) on failure.
template <typename S>
bool alloc_thread_scratch(DScratch<S>& sc, int64_t d, int64_t dv) {
  using T = compute_t<S>;
  constexpr int W = Vec<T>::W;
  const int64_t dp = round_up(d, W), dvp = round_up(dv, W);
  sc.Qs = alloc_scratch<T>(kRB * dp);
  sc.S = alloc_scratch<T>(kRB * kBc);
  sc.Kpack = alloc_scratch<S>(kBc * dp);
  sc.Vpack = alloc_scratch<S>(kBc * dvp);
  sc.krow = static_cast<const S**>(std::malloc(sizeof(S*) * kBc));
  sc.vrow = static_cast<const S**>(std::malloc(sizeof(S*) * kBc));
  sc.lo = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * kRB));
  sc.hi = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * kRB));
  sc.sink = alloc_scratch<T>(1);
  sc.Ob = alloc_scratch<T>(dvp);
  sc.krow8 = static_cast<const int8_t**>(std::malloc(sizeof(int8_t*) * kBc));
  sc.vrow8 = static_cast<const int8_t**>(std::malloc(sizeof(int8_t*) * kBc));
  sc.Qg = alloc_scratch<T>(kRB * dp);
  sc.qb = alloc_scratch<T>(kRB);
  sc.pvs = alloc_scratch<T>(kBc);
  sc.pvo = alloc_scratch<T>(kBc);
  if (sc.Qs && sc.S && sc.Kpack && sc.Vpack && sc.krow && sc.vrow && sc.lo && sc.hi && sc.sink &&
      sc.Ob && sc.krow8 && sc.vrow8 && sc.Qg && sc.qb && sc.pvs && sc.pvo) {
    sc.sink[0] = T(0);
    return true;
  }
  free_thread_scratch(sc);
  return false;
}

// The online-softmax update of one row over one key block: srow[0, cols)
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

// Paged K/V (DecodeArgs::block_table): the first K and V rows (row 0 of kv
// head hk) of the page that holds logical key j of sequence b.
template <typename S>
inline void page_base(const DecodeArgs<S>& a, int64_t b, int64_t hk, int64_t j, const S** kb,
                      const S** vb) {
  const int64_t g = a.block_table[b * a.max_blocks + j / a.block_size];
  const int64_t c = g / a.chunk_blocks, i = g % a.chunk_blocks;
  *kb = a.k_chunks[c] + i * a.sk.b + hk * a.sk.h;
  *vb = a.v_chunks[c] + i * a.sv.b + hk * a.sv.h;
}

// The same for paged int8 K/V: the page's codes and its key scales / offsets
// (block_size / kgroup groups) and value scales / offsets (block_size slots).
inline void page_base_q8(const DecodeArgs<float>& a, int64_t b, int64_t hk, int64_t j,
                         const int8_t** kb, const int8_t** vb, const float** ks, const float** ko,
                         const float** vs, const float** vo) {
  const int64_t g = a.block_table[b * a.max_blocks + j / a.block_size];
  const int64_t c = g / a.chunk_blocks, i = g % a.chunk_blocks;
  *kb = a.k8_chunks[c] + i * a.sk.b + hk * a.sk.h;
  *vb = a.v8_chunks[c] + i * a.sv.b + hk * a.sv.h;
  const int64_t bh = i * a.Hkv + hk, per = (a.block_size / a.kgroup) * a.d;
  *ks = a.ks_chunks[c] + bh * per;
  *ko = a.ko_chunks[c] + bh * per;
  *vs = a.vs_chunks[c] + bh * a.block_size;
  *vo = a.vo_chunks[c] + bh * a.block_size;
}

// Process keys [c0, c1) of group g; write the unnormalised partial (O_acc
// rows into Op[kRB][dvp], m, l). Returns early (partial garbage) when the
// call is cancelled. KV: the storage type of K and V, S or int8_t (then S is
// float and the codes come from a.k8 / a.v8, see DecodeArgs): a key group's
// scales are folded into Q once per block (S = (Q * ks) K8^T + Q . ko), the
// value scales into P (O += (P * vs) V8 + (P . vo) 1), and a block never
// crosses a key group (it is cut at the group's end).
template <typename S, typename KV = S, typename T = compute_t<S>>
void run_split(const DecodeArgs<S>& a, const Group& g, int64_t c0, int64_t c1,
               const DScratch<S>& sc, T* Op, T* mp, T* lp, CancelToken& tok) {
  using V = Vec<T>;
  constexpr int W = V::W;
  const int64_t G = a.Hq / a.Hkv, d = a.d, dv = a.dv, hk = g.hk;
  const int64_t dp = round_up(d, W), dvp = round_up(dv, W);
  const SeqInfo s = seq_info(a, g.b);
  const int nr = static_cast<int>(g.nr);

  // Rows: scaled Q (dot_keys: the raw bf16 rows, 2 dp values per row of Qs's
  // storage, zero-padded; the scale multiplies S), per-row ranges.
  constexpr bool DOT = dot_keys<S, KV>();
  const T scale = static_cast<T>(a.scale);
  for (int r = 0; r < nr; ++r) {
    const int64_t row = g.r0 + r, i = row / G, h = hk * G + row % G;
    const S* src = a.q + g.b * a.sq.b + h * a.sq.h + i * a.sq.l;
    if constexpr (DOT) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(sc.Qs + r * dp);
      for (int64_t e = 0; e < d; ++e) std::memcpy(dst + e, src + e * a.sq.d, sizeof(uint16_t));
      for (int64_t e = d; e < 2 * dp; ++e) dst[e] = 0;
    } else {
      T* dst = sc.Qs + r * dp;
      for (int64_t e = 0; e < d; ++e) dst[e] = ld(src + e * a.sq.d) * scale;
      for (int64_t e = d; e < dp; ++e) dst[e] = T(0);
    }
    row_range(a, s, i, &sc.lo[r], &sc.hi[r]);
    mp[r] = NEG_INF<T>;
    lp[r] = T(0);
  }
  std::memset(Op, 0, sizeof(T) * kRB * dvp);

  constexpr bool Q8 = std::is_same<KV, int8_t>::value;
  const KV* kbase;
  const KV* vbase;
  const T *ks_base = nullptr, *ko_base = nullptr, *vs_base = nullptr, *vo_base = nullptr;
  const bool paged = a.block_table != nullptr;
  if (paged) {  // each block's rows (and int8 scales) come from its page (page_base)
    kbase = vbase = nullptr;
  } else if constexpr (Q8) {
    kbase = a.k8 + g.b * a.sk.b + hk * a.sk.h;
    vbase = a.v8 + g.b * a.sv.b + hk * a.sv.h;
    const int64_t bh = g.b * a.Hkv + hk;
    ks_base = a.k_scale + bh * (a.R / a.kgroup) * d;
    ko_base = a.k_off + bh * (a.R / a.kgroup) * d;
    vs_base = a.v_scale + bh * a.R;
    vo_base = a.v_off + bh * a.R;
  } else {
    kbase = a.k + g.b * a.sk.b + hk * a.sk.h;
    vbase = a.v + g.b * a.sv.b + hk * a.sv.h;
  }
  const KV** krow = krows_of<KV>(sc);
  const KV** vrow = vrows_of<KV>(sc);
  const bool kpack = !Q8 && a.sk.d != 1, vpack = !Q8 && a.sv.d != 1;
  int64_t cols = 0;
  for (int64_t j0 = c0, blk = 0; j0 < c1; j0 += cols, ++blk) {
    // Long splits (a capped split count, see decode_impl) look for Ctrl-C
    // every 16 blocks, not only between items.
    if (blk % 16 == 15 && tok.poll()) return;
    cols = imin(kBc, c1 - j0);
    if constexpr (Q8) cols = imin(cols, a.kgroup - (s.k0 + j0) % a.kgroup);
    // Addresses of the block's K and V rows (ring: slot = (start + j) mod R;
    // paged: row slot of the page holding key j0, the block cut at its end).
    int64_t slot = s.k0 + j0;
    const KV* kb = kbase;
    const KV* vb = vbase;
    if (paged) {
      cols = imin(cols, a.block_size - j0 % a.block_size);
      if constexpr (Q8)
        page_base_q8(a, g.b, hk, j0, &kb, &vb, &ks_base, &ko_base, &vs_base, &vo_base);
      else
        page_base(a, g.b, hk, j0, &kb, &vb);
      slot = j0 % a.block_size;
    }
    slot %= a.R;
    const int64_t slot0 = slot;  // the row slot of key j0
    if constexpr (Q8) {
      // The block's key group: fold its scales into Q, its offsets into qb.
      const T* ks = ks_base + slot / a.kgroup * d;
      const T* ko = ko_base + slot / a.kgroup * d;
      // In W-lane vectors: the dependent scalar chain of the bias sum was a
      // tenth of an int8 step (bench/notes_archive.md, int8 decode profile).
      using V = Vec<T>;
      constexpr int W = V::W;
      for (int r = 0; r < nr; ++r) {
        const T* qs = sc.Qs + r * dp;
        T* qg = sc.Qg + r * dp;
        typename V::R bv = V::zero();
        int64_t e = 0;
        for (; e + W <= d; e += W) {
          const typename V::R qv = V::load(qs + e);
          V::store(qg + e, V::mul(qv, V::load(ks + e)));
          bv = V::fma(qv, V::load(ko + e), bv);
        }
        T b = V::hsum(bv);
        for (; e < d; ++e) {
          qg[e] = qs[e] * ks[e];
          b += qs[e] * ko[e];
        }
        for (; e < dp; ++e) qg[e] = T(0);
        sc.qb[r] = b;
      }
    }
    // int8: the block's value scales / offsets, read in place unless the ring
    // wraps inside the block (then copied in order).
    const T* vsc = sc.pvs;
    const T* voc = sc.pvo;
    bool rows_done = false;
    if constexpr (Q8) {
      if (slot + cols <= a.R) {
        vsc = vs_base + slot;
        voc = vo_base + slot;
        for (int64_t c = 0; c < cols; ++c) {
          krow[c] = kb + (slot + c) * a.sk.l;
          vrow[c] = vb + (slot + c) * a.sv.l;
        }
        rows_done = true;
      }
    }
    for (int64_t c = 0; c < cols && !rows_done; ++c) {
      if constexpr (Q8) {
        krow[c] = kb + slot * a.sk.l;
        vrow[c] = vb + slot * a.sv.l;
        sc.pvs[c] = vs_base[slot];
        sc.pvo[c] = vo_base[slot];
      } else {
        if (kpack) {
          S* dst = sc.Kpack + c * dp;
          const S* src = kb + slot * a.sk.l;
          for (int64_t e = 0; e < d; ++e) dst[e] = src[e * a.sk.d];
          sc.krow[c] = dst;
        } else {
          sc.krow[c] = kb + slot * a.sk.l;
        }
        if (vpack) {
          S* dst = sc.Vpack + c * dvp;
          const S* src = vb + slot * a.sv.l;
          for (int64_t e = 0; e < dv; ++e) dst[e] = src[e * a.sv.d];
          sc.vrow[c] = dst;
        } else {
          sc.vrow[c] = vb + slot * a.sv.l;
        }
      }
      if (++slot == a.R) slot = 0;
    }
    // Touch every cache line of the block's K and V rows first, in a tight
    // loop with many loads in flight (as a streaming read does): the misses
    // overlap, and QK / PV below then hit L1/L2. Not for int8 rows (2 lines
    // each at d = 128): the prefetch below covers them, and without the pass
    // a step took 0.95-0.96x the CPU time (bench/notes_archive.md, dec4).
    // With the prefetch into L2 (Intel) the pass only costs: fp32 0.93x
    // without it on Sapphire Rapids, bf16 0.95x (bench/notes_archive.md, dec6).
    // On AVX2 (Zen 3) the pass read int8 rows better than the prefetch spread
    // over both loops, but it waits for the block's misses before any math:
    // their prefetch spread over the P V loop alone overlaps them (pf_at).
    // 16-bit rows there prefetch staggered (staggered()): the pass only for a
    // split's first block's K rows.
    const bool stag = staggered<T, KV>() && !a.prefetch_l2 && !kpack && !vpack;
    if constexpr (!Q8) {
      if (stag) {
        if (j0 == c0) sc.sink[0] += touch_lines(krow, cols, d);
      } else if (!a.prefetch_l2) {
        sc.sink[0] += touch_lines(krow, cols, d) + touch_lines(vrow, cols, dv);
      }
    }
    // The next block's lines, prefetched prefetch_per<KV> per inner iteration
    // of QK / PV (a walk over its rows, see Pf); staggered, the next block's
    // K rows in P V (pf) and this block's V rows in QK (pfv).
    Pf pf{
        nullptr,      nullptr, nullptr, nullptr, 0, 0, 0, 0, 0, 0, prefetch_per<KV>(a.prefetch_l2),
        a.prefetch_l2};
    Pf pfv = pf;
    if (stag)
      pf_runs(vb, slot0, imin(cols, a.R - slot0), a.sv.l, dv, &pfv.k, &pfv.ks, &pfv.klen, &pfv.kn);
    if (!kpack && !vpack && j0 + cols < c1) {
      int64_t ns = s.k0 + j0 + cols;
      int64_t ncols = imin(kBc, c1 - j0 - cols);
      const KV* nkb = kbase;
      const KV* nvb = vbase;
      const T *nks = ks_base, *nko = ko_base, *nvs = vs_base, *nvo = vo_base;  // int8 only
      if (paged) {  // the next block starts a page or continues this one
        ncols = imin(ncols, a.block_size - ns % a.block_size);
        if constexpr (Q8)
          page_base_q8(a, g.b, hk, ns, &nkb, &nvb, &nks, &nko, &nvs, &nvo);
        else
          page_base(a, g.b, hk, ns, &nkb, &nvb);
        ns %= a.block_size;
      }
      ns %= a.R;
      if constexpr (Q8) {
        // A block that starts a key group: its scales and offsets now (a few
        // lines, in other arrays than the codes; on a new page the hardware
        // prefetcher has no stream for them: paged int8 0.92x with, contiguous
        // 0.96x).
        if (ns % a.kgroup == 0) {
          const bool l2s = a.prefetch_l2 && a.block_table != nullptr;
          prefetch_lines(nks + ns / a.kgroup * d, d, l2s);
          prefetch_lines(nko + ns / a.kgroup * d, d, l2s);
          prefetch_lines(nvs + ns, ncols, l2s);
          prefetch_lines(nvo + ns, ncols, l2s);
        }
      }
      const int64_t rows = imin(ncols, a.R - ns);  // a ring's wrap ends the walk (a hint only)
      pf_runs(nkb, ns, rows, a.sk.l, d, &pf.k, &pf.ks, &pf.klen, &pf.kn);
      if (!stag) pf_runs(nvb, ns, rows, a.sv.l, dv, &pf.v, &pf.vs, &pf.vlen, &pf.vn);
    }
    // S = Q K^T.
#if defined(ATTN_DOT_BF16)
    if constexpr (DOT)
      qk_dispatch_dot(nr, reinterpret_cast<const uint16_t*>(sc.Qs), 2 * dp, krow, cols, d, scale,
                      sc.S, kBc, stag ? &pfv : &pf);
    else
#endif
      qk_dispatch<T, KV>(nr, Q8 ? sc.Qg : sc.Qs, dp, krow, cols, d, sc.S, kBc, stag ? &pfv : &pf);
    if constexpr (Q8)
      for (int r = 0; r < nr; ++r)
        for (int64_t c = 0; c < cols; ++c) sc.S[r * kBc + c] += sc.qb[r];
    // Masks and online softmax.
    bool partial = false;
    for (int r = 0; r < nr; ++r)
      partial |= softmax_row(sc.S + r * kBc, cols, sc.lo[r] - j0, sc.hi[r] - j0, &mp[r], &lp[r],
                             Op + r * dvp, dvp);
    // int8 V: O += (P . vo) 1 now, and P * vs below.
    if constexpr (Q8)
      for (int r = 0; r < nr; ++r) {
        using V = Vec<T>;
        constexpr int W = V::W;
        T* prow = sc.S + r * kBc;
        typename V::R xv = V::zero();
        int64_t c = 0;
        for (; c + W <= cols; c += W) {  // vectors, as the key-group fold above
          const typename V::R pv = V::load(prow + c);
          xv = V::fma(pv, V::load(voc + c), xv);
          V::store(prow + c, V::mul(pv, V::load(vsc + c)));
        }
        T ex = V::hsum(xv);
        for (; c < cols; ++c) {
          ex += prow[c] * voc[c];
          prow[c] *= vsc[c];
        }
        T* orow = Op + r * dvp;
        for (int64_t e = 0; e < dv; ++e) orow[e] += ex;
      }
    // O += P V.
    if (!partial) {
      pv_dispatch<T, KV>(nr, sc.S, kBc, vrow, cols, dv, Op, dvp, &pf);
    } else {  // skip zero weights: a NaN in a masked V row must not leak
      for (int r = 0; r < nr; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const T p = sc.S[r * kBc + c];
          if (p == T(0)) continue;
          T* orow = Op + r * dvp;
          const KV* vr = vrow[c];
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
  for (int64_t r = 0; r < g.nr; ++r) {
    const int64_t row = g.r0 + r, i = row / G, h = g.hk * G + row % G;
    S* dst = a.o + g.b * a.so.b + h * a.so.h + i * a.so.l;
    T* lse = a.lse ? a.lse + (g.b * a.Hq + h) * a.Lq + i : nullptr;
    T m = NEG_INF<T>;
    bool nan = false;  // a NaN partial max (a NaN score) makes the row NaN
    for (int64_t sp = 0; sp < g.nsplit; ++sp) {
      const T ms = mpart[(g.item0 + sp) * kRB + r];
      m = ms > m ? ms : m;
      nan = nan || ms != ms;
    }
    T l = T(0);
    if (nan) {
      l = NaN;
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

template <typename ST>
void decode_impl(const DecodeArgs<ST>& a) {  // ST: storage type
  using T = compute_t<ST>;
  constexpr int W = Vec<T>::W;
  if (a.B <= 0 || a.Hq <= 0 || a.Lq <= 0) return;
  const int64_t G = a.Hq / a.Hkv, dvp = round_up(a.dv, W);
  const int64_t rows = a.Lq * G;               // rows per (sequence, kv head)
  const int64_t upb = (rows + kRB - 1) / kRB;  // row blocks per sequence
  const int64_t n_groups = a.B * upb * a.Hkv;  // group x = (b * upb + row block) * Hkv + hk
  // One pass over the row blocks: the split length (by shape only, never the
  // thread count), the longest key range, the work.
  int64_t long_items = 0, max_range = 0;
  double work = 0;
  for (int64_t b = 0; b < a.B; ++b) {
    const SeqInfo s = seq_info(a, b);
    for (int64_t r0 = 0; r0 < rows; r0 += kRB) {
      const int64_t nr = imin(kRB, rows - r0);
      int64_t jlo, jhi;
      block_range(a, s, G, r0, nr, &jlo, &jhi);
      const int64_t range = imax(0, jhi - jlo);
      max_range = imax(max_range, range);
      if (long_items < kMinLongItems) long_items += (range + kSplitLong - 1) / kSplitLong * a.Hkv;
      work += static_cast<double>(range) * nr * a.Hkv * static_cast<double>(a.d + a.dv);
    }
  }
  int64_t split = a.split > 0 ? a.split : long_items >= kMinLongItems ? kSplitLong : kSplitShort;
  const int64_t item_bytes = kRB * (dvp + 2) * static_cast<int64_t>(sizeof(T));
  const int64_t max_items = imax(kMinSliceItems, kPartBytes / item_bytes);
  if (max_range / split >= max_items) split = round_up(max_range / max_items + 1, kBc);
  int64_t n_items = 0;  // over the whole call
  for (int64_t b = 0; b < a.B && n_items < max_items; ++b) {
    const SeqInfo s = seq_info(a, b);
    for (int64_t r0 = 0; r0 < rows && n_items < max_items; r0 += kRB) {
      int64_t jlo, jhi;
      block_range(a, s, G, r0, imin(kRB, rows - r0), &jlo, &jhi);
      if (jhi > jlo) n_items += (jhi - jlo + split - 1) / split * a.Hkv;
    }
  }
  const int64_t slice_items = imax(1, imin(n_items, max_items));
  const int64_t slice_groups = imin(n_groups, kMaxSliceGroups);

  int nt = a.num_threads > 0 ? a.num_threads : 1;
  if (imax(n_items, n_groups) < nt) nt = static_cast<int>(imax(1, imax(n_items, n_groups)));
  // Small steps (a short cache: tens of microseconds of work) run on the
  // calling thread, as in the prefill kernel. Waking a team costs more than it
  // saves, and in a model that also calls NumPy's BLAS between attention
  // calls the two libraries' idle-spinning workers fight over the cores:
  // bench/benchmarks/bench_generate.py decoded 2.8x slower with a team per step.
  if (work < kSerialWork) nt = 1;

  // Every allocation is checked: a failure is std::bad_alloc (MemoryError),
  // never a crash or a terminate. The shared buffers are allocated here; each
  // thread allocates its own scratch as it starts (in parallel, overlapping
  // the team's wake-up), and one that cannot takes no items: the call then
  // throws after the region. The group tables are double-buffered: the next
  // slice is built while the last items of this one still read theirs.
  T* Opart = alloc_scratch<T>(slice_items * kRB * dvp);
  T* mpart = alloc_scratch<T>(slice_items * kRB);
  T* lpart = alloc_scratch<T>(slice_items * kRB);
  Group* gbuf =
      static_cast<Group*>(std::malloc(sizeof(Group) * static_cast<size_t>(2 * slice_groups)));
  int64_t* dbuf =
      static_cast<int64_t*>(std::malloc(sizeof(int64_t) * static_cast<size_t>(2 * slice_groups)));
  if (!(Opart && mpart && lpart && gbuf && dbuf)) {
    std::free(dbuf);
    std::free(gbuf);
    std::free(Opart);
    std::free(mpart);
    std::free(lpart);
    throw std::bad_alloc();
  }

  CancelToken tok;
  // Slice k uses buffer k % 2: groups, done counters, ng groups, ni items;
  // last: no slice follows (decided when it is built, so every thread agrees).
  struct Slice {
    Group* groups;
    int64_t* done;
    int64_t ng, ni;
    bool last;
  } sl[2] = {{gbuf, dbuf, 0, 0, false}, {gbuf + slice_groups, dbuf + slice_groups, 0, 0, false}};
  int64_t x_next = 0;           // first group not yet in a slice
  auto build = [&](Slice& S) {  // the next groups, as many as fit the partials
    S.ng = S.ni = 0;
    while (x_next < n_groups && S.ng < slice_groups && !tok.cancelled()) {
      const int64_t u = x_next / a.Hkv;
      Group& g = S.groups[S.ng];
      g.b = u / upb;
      g.r0 = (u % upb) * kRB;
      g.nr = imin(kRB, rows - g.r0);
      g.hk = x_next % a.Hkv;
      block_range(a, seq_info(a, g.b), G, g.r0, g.nr, &g.jlo, &g.jhi);
      g.nsplit = g.jhi > g.jlo ? (g.jhi - g.jlo + split - 1) / split : 0;
      if (S.ng > 0 && S.ni + g.nsplit > slice_items) break;
      g.item0 = S.ni;
      S.ni += g.nsplit;
      S.done[S.ng] = 0;
      ++S.ng;
      ++x_next;
    }
    S.last = x_next >= n_groups || tok.cancelled();
  };
  build(sl[0]);
  int failed = 0;
#pragma omp parallel num_threads(nt) reduction(+ : failed)
  {
    DScratch<ST> sc;
    const bool ok = alloc_thread_scratch(sc, a.d, a.dv);
    failed += ok ? 0 : 1;
    for (int cur = 0;; cur ^= 1) {
      const Slice& S = sl[cur];
      const Group* groups = S.groups;
      // Groups without visible keys: write their zero rows now.
#pragma omp for schedule(static) nowait
      for (int64_t x = 0; x < S.ng; ++x)
        if (groups[x].nsplit == 0)
          merge_group(a, groups[x], Opart, mpart, lpart, static_cast<T*>(nullptr));
      // Splits; the thread that finishes the last split of a group merges it
      // (no barrier between the two phases).
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t w = 0; w < S.ni; ++w) {
        if (!ok || tok.poll()) continue;  // Ctrl-C: skip the rest (the call raises)
        int64_t lo = 0, hi = S.ng;        // last group with item0 <= w (and items)
        while (hi - lo > 1) {
          const int64_t mid = (lo + hi) / 2;
          if (groups[mid].item0 <= w)
            lo = mid;
          else
            hi = mid;
        }
        while (groups[lo].nsplit == 0 || w >= groups[lo].item0 + groups[lo].nsplit) ++lo;
        const Group& g = groups[lo];
        const int64_t sp = w - g.item0;
        const int64_t c0 = g.jlo + sp * split, c1 = imin(g.jhi, c0 + split);
        T* Ow = Opart + w * kRB * dvp;
        if constexpr (std::is_same<ST, float>::value) {
          if (a.k8 || a.k8_chunks)
            run_split<ST, int8_t>(a, g, c0, c1, sc, Ow, mpart + w * kRB, lpart + w * kRB, tok);
          else
            run_split<ST>(a, g, c0, c1, sc, Ow, mpart + w * kRB, lpart + w * kRB, tok);
        } else {
          run_split<ST>(a, g, c0, c1, sc, Ow, mpart + w * kRB, lpart + w * kRB, tok);
        }
        if (__atomic_add_fetch(&S.done[lo], 1, __ATOMIC_ACQ_REL) == g.nsplit && !tok.cancelled())
          merge_group(a, g, Opart, mpart, lpart, sc.Ob);
      }
      tok.finish_share();  // the calling thread keeps polling until the team is done
      if (S.last) break;
      // The next slice, into the other buffer; the barrier that ends the
      // single also keeps its items from overwriting partials still in use.
#pragma omp single
      build(sl[cur ^ 1]);
    }
    if (ok) free_thread_scratch(sc);
  }
  std::free(dbuf);
  std::free(gbuf);
  std::free(Opart);
  std::free(mpart);
  std::free(lpart);
  if (failed) throw std::bad_alloc();
}

}  // namespace

#if defined(ATTN_DOT_BF16)
// The avx512_bf16 object: the bf16 decode with its vdpbf16ps Q K^T
// (qk_rows_dot); every other storage type of that ISA runs the avx512 object.
void decode_forward_bf16(const DecodeArgs<bf16_t>& a) { decode_impl<bf16_t>(a); }
#else
void decode_forward_f32(const DecodeArgs<float>& a) { decode_impl<float>(a); }
void decode_forward_f64(const DecodeArgs<double>& a) { decode_impl<double>(a); }
void decode_forward_bf16(const DecodeArgs<bf16_t>& a) { decode_impl<bf16_t>(a); }
void decode_forward_f16(const DecodeArgs<fp16_t>& a) { decode_impl<fp16_t>(a); }
#endif

}  // namespace ATTN_NS
}  // namespace attn_fast
