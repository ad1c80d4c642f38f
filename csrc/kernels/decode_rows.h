// The decode kernel's row layer (csrc/kernels/decode.cpp): how one key block's
// K / V rows are loaded (ldv / ld per element type), how the next block's
// lines are requested (the prefetch policy, PrefetchPolicy, and its register
// walk, Pf), and the register-blocked micro-kernels over the block's row
// pointers: S = Q K^T (qk_rows, qk_rows_dot) and O += P V (pv_rows).
//
// Everything here reads rows through pointers, never a layout or an
// encoding's scales: those are decode_sources.h's. Hints (prefetches, the
// touch pass) never change a result bit; the micro-kernels' summation order
// is part of the output and fixed per (ISA, row count).
//
// Included by decode.cpp inside its ISA namespace and anonymous namespace,
// after ATTN_VEC_HEADER, storage.h and toolkit.h.
#pragma once

// ---- row loads: W consecutive elements of a stored row as one fp32 (or
// double) register; ld: one element. float / double / bf16 / fp16 as
// storage.h reads them; int8 codes sign-extended to fp32 (their scales are
// applied by the int8 encoding, outside the d-long loops).
template <typename T>
inline typename Vec<T>::R ldv(const T* p) {
  return Vec<T>::load(p);
}
inline Vec<float>::R ldv(const bf16_t* p) { return Storage<bf16_t>::load(p); }
inline Vec<float>::R ldv(const fp16_t* p) { return Storage<fp16_t>::load(p); }
inline Vec<float>::R ldv(const int8_t* p) { return Vec<float>::load_i8(p); }
inline float ld(const int8_t* p) { return static_cast<float>(*p); }

// ---- the micro-loops' per-ISA choices, each measured on the ISA it is on
// (bench/NOTES.md#decode-kernel, #decode-16bit); the loops below branch on
// these, never on the ISA macros. None changes a bit within its ISA.
//   kHsum3x4   Vec<float>::hsum_3x4 exists: a 3-row QK pass takes 4 keys, its
//              twelve dot products reduced in one call (AVX-512).
//   kPin3Rows  3-row passes keep their K and Q vectors in registers (Vec::pin):
//              GCC otherwise folds a K load into each row's FMA, and the
//              loads bound the loop (AVX-512; no better elsewhere).
//   kBf16EvenOdd  bf16 P V by even / odd lanes (pv_cols_eo: Vec<float>::
//              load_bf16_eo, load_eo, store_eo; AVX-512; slower on AVX2).
//   kPfBurst   the prefetch walk of 8-lane 16-bit / int8 rows in bursts (AVX2).
//   kPfStop    a finished walk sets its rate to 0, so later steps test nothing
//              (AVX2; 1-9 % slower on the AVX-512 objects).
struct DecodeIsa {
#if defined(ATTN_ISA_AVX512)
  static constexpr bool kHsum3x4 = true, kPin3Rows = true, kBf16EvenOdd = true;
  static constexpr bool kPfBurst = false, kPfStop = false;
#elif defined(ATTN_ISA_AVX2)
  static constexpr bool kHsum3x4 = false, kPin3Rows = false, kBf16EvenOdd = false;
  static constexpr bool kPfBurst = true, kPfStop = true;
#else
  static constexpr bool kHsum3x4 = false, kPin3Rows = false, kBf16EvenOdd = false;
  static constexpr bool kPfBurst = false, kPfStop = false;
#endif
};

// ---- the prefetch policy of rows of element type KV read into compute type
// T (the policy, its counts and their measurements: bench/NOTES.md#decode-kernel).
// Invariants: per * (inner iterations of QK + PV) covers the next block's
// lines at d = dv = 128; hints only, so any value gives the same bits.
//   per(l2)   prefetches per inner iteration: on 16 lanes fp32 3, bf16 / fp16
//             2, int8 1 (l1 policy), fp32 4 under the l2 policy; 8 lanes
//             have twice the iterations per block, so half the rate (>= 1).
//   kPvOnly   int8 on 8 lanes: the next block is requested from the P V loop
//             only, one line every other key (at_pv), evenly over the phase.
//   kStagger  bf16 / fp16 on 8 lanes under l1: QK requests this block's V
//             rows, P V the next block's K rows, and only a split's first
//             block is touched (a bf16 block of K and V fills a 32 KiB L1).
//   kTouch    whether the rows are touched before the math (one load per
//             line, misses in flight like a streaming read); int8 rows (2
//             lines at d = 128) are covered by the prefetch alone.
template <typename T, typename KV>
struct PrefetchPolicy {
  static constexpr bool kPvOnly = Vec<T>::W == 8 && sizeof(KV) == 1;
  static constexpr bool kStagger = Vec<T>::W == 8 && sizeof(KV) == 2;
  static constexpr bool kTouch = sizeof(KV) > 1;
  static constexpr int per(bool l2) {
    constexpr int w16 = sizeof(KV) >= 4 ? 3 : sizeof(KV) == 2 ? 2 : 1;  // l1, 16 lanes
    const int n = (l2 && sizeof(KV) >= 4 ? 4 : w16) * Vec<float>::W;
    return n <= 16 ? 1 : n / 16;
  }
  static constexpr bool at_pv(int64_t c) { return !kPvOnly || (c & 1) != 0; }
  // kBurst    8 lanes, 16-bit and int8 rows: the walk is issued in bursts
  //           (pf_burst: one end test per burst, none in the FMA loop): a QK
  //           key pass's per * iterations lines before its d loop, P V's
  //           per * kPvLines lines every kBurst keys (kPvLines: at_pv's rate).
  //           Under the l2 policy only (under l1 they measured slower from
  //           DRAM). fp32 rows (twice the lines) and 16 lanes step per
  //           iteration (pf_step): fp32 bursts measured slower from DRAM.
  static constexpr int kBurst = DecodeIsa::kPfBurst && Vec<T>::W == 8 && sizeof(KV) <= 2 ? 8 : 1;
  static constexpr int kPvLines = kPvOnly ? kBurst / 2 : kBurst;
};

// The next block's cache lines, prefetched `per` per inner-loop iteration of
// the compute loops (so the next block's misses overlap this block's math),
// walked in registers: its K rows, then its V rows, as runs of bytes, one
// run per row, or one run for all of them where the rows are packed (a
// cache's layout): a line address, an end, and a compare per prefetch
// (pf_step) or per burst (pf_burst).
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
// Every 64-byte line of n floats from p (an encoding's side data: int8
// scales), into L1 (prefetcht0), or into L2 (prefetcht1: l2 = a paged cache
// under the l2 policy, whose per-page scale records were evicted from L1
// before use; bench/NOTES.md#decode-kernel).
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
    if (p->at >= p->end && !pf_next_run(p)) {
      if constexpr (DecodeIsa::kPfStop) p->per = 0;  // the walk is done: later steps test nothing
      return;
    }
    if (p->l2)
      __builtin_prefetch(p->at, 0, 2);
    else
      __builtin_prefetch(p->at, 0, 3);
    p->at += 64;
  }
}
// n lines of the walk (n = per * iterations): where the current run holds
// them, n prefetches and no test; else line by line across runs (pf_step).
inline void pf_burst(Pf* p, int64_t n) {
  const char* at = p->at;
  if (p->end - at >= 64 * n) {
    if (p->l2)
      for (int64_t i = 0; i < n; ++i) __builtin_prefetch(at + 64 * i, 0, 2);
    else
      for (int64_t i = 0; i < n; ++i) __builtin_prefetch(at + 64 * i, 0, 3);
    p->at = at + 64 * n;
    return;
  }
  const int per = p->per;
  for (int64_t i = 0; i < n && p->per != 0; i += per) pf_step(p);
}

// S[r][c] = <Qs[r], K_c> for N rows and `cols` keys (K rows via pointers, in
// the storage type SK; Qs and S in the compute type T).
// KC keys per pass: N * KC independent accumulator chains (enough to cover
// the FMA latency), each Q vector load serves KC keys, and the dot products
// are reduced four at a time (4 rows x 4 keys on AVX-512: all sixteen in one
// tree, Vec::hsum16, a summation order of its own; bench/NOTES.md#decode-kernel).
// flatten: everything inlined (GCC's inliner may otherwise leave Vec::hsum4 a
// call in the key loop).
// The NK dot-product accumulators of a key pass reduced to NK sums: 16 of 16
// lanes (4 rows x 4 keys on AVX-512) in one tree, 3 rows x 4 keys by
// hsum_3x4, else four at a time.
template <typename T, int NK, int N = 0>
__attribute__((always_inline)) inline void reduce_dots(const typename Vec<T>::R* acc, T* sums) {
  using V = Vec<T>;
  if constexpr (NK == 16 && V::W == 16) {
    V::store(sums, V::hsum16(acc));
  } else if constexpr (N == 3 && NK == 12 && DecodeIsa::kHsum3x4 && std::is_same<T, float>::value) {
    V::hsum_3x4(acc, sums);  // the trees of two 2-key passes: a 4-key pass would sum otherwise
  } else if constexpr (N == 3 && NK == 12) {
    static_assert(N != 3, "a 3-row 4-key pass needs Vec::hsum_3x4 (DecodeIsa::kHsum3x4)");
  } else {
    int i = 0;
    for (; i + 4 <= NK; i += 4) V::hsum4(acc + i, sums + i);
    for (; i < NK; ++i) sums[i] = V::hsum(acc[i]);
  }
}

// A loaded vector of a 3-row pass kept in its register (DecodeIsa::kPin3Rows).
template <typename V, int N>
__attribute__((always_inline)) inline void in_register(typename V::R& x) {
  if constexpr (N == 3 && DecodeIsa::kPin3Rows) V::pin(x);
  (void)x;
}

template <typename T, typename SK, int N, int KC>
__attribute__((flatten)) inline void qk_rows(const T* Qs, int64_t ldq, const SK* const* kp,
                                             int64_t cols, int64_t d, T* S, int64_t lds, Pf* pf) {
  using V = Vec<T>;
  constexpr int W = V::W, NK = N * KC;
  const int64_t dvec = d / W * W;
  Pf p = *pf;  // the walk in registers, not stored back at every prefetch
  int64_t c = 0;
  for (; c + KC <= cols; c += KC) {
    const SK* kr[KC];
    for (int j = 0; j < KC; ++j) kr[j] = kp[c + j];
    typename V::R acc[NK];
    for (int i = 0; i < NK; ++i) acc[i] = V::zero();
    using Pol = PrefetchPolicy<T, SK>;
    if constexpr (!Pol::kPvOnly && Pol::kBurst > 1) {
      if (p.l2) pf_burst(&p, p.per * (dvec / W));
    }
    for (int64_t e = 0; e < dvec; e += W) {
      if constexpr (!Pol::kPvOnly && Pol::kBurst == 1) {
        pf_step(&p);
      } else if constexpr (!Pol::kPvOnly) {
        if (!p.l2) pf_step(&p);
      }
      typename V::R kx[KC];
      for (int j = 0; j < KC; ++j) {
        kx[j] = ldv(kr[j] + e);
        in_register<V, N>(kx[j]);
      }
      for (int r = 0; r < N; ++r) {
        typename V::R qv = V::load(Qs + r * ldq + e);
        in_register<V, N>(qv);
        for (int j = 0; j < KC; ++j) acc[r * KC + j] = V::fma(qv, kx[j], acc[r * KC + j]);
      }
    }
    alignas(64) T sums[NK];
    reduce_dots<T, NK, N>(acc, sums);
    if (dvec == d) {  // no tail: the N x KC stores unrolled (a loop per score otherwise)
      for (int r = 0; r < N; ++r)
        for (int j = 0; j < KC; ++j) S[r * lds + c + j] = sums[r * KC + j];
    } else {
      for (int r = 0; r < N; ++r)
        for (int j = 0; j < KC; ++j) {
          T x = sums[r * KC + j];
          for (int64_t e = dvec; e < d; ++e) x += Qs[r * ldq + e] * ld(kr[j] + e);
          S[r * lds + c + j] = x;
        }
    }
  }
  *pf = p;
  if constexpr (N == 3 && KC == 4) {  // the tail as qk_rows<3, 2> would take it
    if (c < cols) qk_rows<T, SK, N, 2>(Qs, ldq, kp + c, cols - c, d, S + c, lds, pf);
  } else if constexpr (KC > 1) {
    if (c < cols) qk_rows<T, SK, N, 1>(Qs, ldq, kp + c, cols - c, d, S + c, lds, pf);
  }
}

// bf16 keys on the avx512_bf16 object (the bf16 encoding's Q K^T there): S[r][c] = scale *
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
    reduce_dots<float, NK, N>(acc, sums);
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < KC; ++j) S[r * lds + c + j] = sums[r * KC + j] * scale;
  }
  if constexpr (N == 3 && KC == 4) {  // the tail as qk_rows_dot<3, 2> would take it
    if (c < cols) qk_rows_dot<N, 2>(Qw, ldq, kp + c, cols - c, d, scale, S + c, lds, pf);
  } else if constexpr (KC > 1) {
    if (c < cols) qk_rows_dot<N, 1>(Qw, ldq, kp + c, cols - c, d, scale, S + c, lds, pf);
  }
}
#endif
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
      using Pol = PrefetchPolicy<T, SV>;
      if constexpr (Pol::kBurst > 1) {
        if (!pf->l2) {
          if (Pol::at_pv(c)) pf_step(pf);
        } else if (c % Pol::kBurst == 0) {
          pf_burst(pf, pf->per * Pol::kPvLines);
        }
      } else if (Pol::at_pv(c)) {
        pf_step(pf);
      }
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
// not done. (DecodeIsa::kBf16EvenOdd; T = float.)
template <typename T, int N, int EP>
__attribute__((flatten)) inline int64_t pv_cols_eo(const T* P, int64_t ldp, const bf16_t* const* vp,
                                                   int64_t cols, int64_t e0, int64_t e1, T* O,
                                                   int64_t ldo, Pf* pf) {
  using V = Vec<T>;
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

// O[r][:dv] += sum_c P[r][c] V_c for N rows (O row stride ldo, padded to W).
template <typename T, typename SV, int N, int E>
inline void pv_rows(const T* P, int64_t ldp, const SV* const* vp, int64_t cols, int64_t dv, T* O,
                    int64_t ldo, Pf* pf) {
  constexpr int W = Vec<T>::W;
  const int64_t dvec = dv / W * W;
  int64_t e = 0;
  if constexpr (DecodeIsa::kBf16EvenOdd && std::is_same<SV, bf16_t>::value &&
                std::is_same<T, float>::value && E % 2 == 0)
    e = pv_cols_eo<T, N, E / 2>(P, ldp, vp, cols, 0, dvec, O, ldo, pf);
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
    // 3 rows on AVX-512 (a GQA group of 3): 4 keys per pass (12 chains), the
    // twelve dot products reduced at once by the trees of 2-key passes
    // (Vec::hsum_3x4): the sums of qk_rows<3, 2>, half its reduction work.
    constexpr bool k3x4 = N == 3 && DecodeIsa::kHsum3x4 && std::is_same<T, float>::value;
    constexpr int KC = (N == 4 && Vec<T>::W == 16) || k3x4 ? 4 : decltype(U)::value;
    qk_rows<T, SK, N, KC>(Qs, ldq, kp, cols, d, S, lds, pf);
  });
}

#if defined(ATTN_DOT_BF16)
inline void qk_dispatch_dot(int nr, const uint16_t* Qw, int64_t ldq, const bf16_t* const* kp,
                            int64_t cols, int64_t d, float scale, float* S, int64_t lds, Pf* pf) {
  by_rows(nr, [&](auto R, auto U) {
    constexpr int N = decltype(R)::value;
    constexpr int KC = N == 4 || (N == 3 && DecodeIsa::kHsum3x4) ? 4 : decltype(U)::value;
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
    // 3 rows on AVX-512: 4 vectors per pass too (12 accumulators: half the
    // passes and P broadcasts of 2; bench/NOTES.md#decode-kernel).
    // 4 rows of int8 on AVX2 (16 registers): 2 vectors per pass, because with
    // 3 the accumulators, widened V vectors and the P broadcast need all 16
    // registers and one accumulator spills (bench/NOTES.md#decode-kernel).
    // The same sums in the same order (E only groups the columns).
    constexpr bool i8_on_8 = Vec<T>::W == 8 && sizeof(SV) == 1;
    constexpr int E = (N == 4 || N == 3) && Vec<T>::W == 16 ? 4
                      : N == 4 && i8_on_8                   ? 2
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
