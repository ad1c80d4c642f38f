// Linear attention, O(L * d * dv): the associativity trick of the chapter.
//
//   softmax attention   O = softmax(Q K^T) V          costs L^2 (the L x L matrix)
//   linear attention    O = phi(Q) (phi(K)^T V) / (phi(Q) (phi(K)^T 1))
//                       computed right to left, it never forms L x L.
//
// Shapes: phi(q), phi(k) (B, H, L, d); v, o (B, H, L, dv), all strided;
//         state kv (B, H, d, dv) and k_sum (B, H, d), double, C-contiguous.
//
// Two passes, one per form (see linear_attn.h for the formulas):
//   non-causal  1. per (b, h): KV += phi(k_t) v_t^T, z += phi(k_t) over all t
//               2. per (b, h, block of Br rows): o_i = phi(q_i)^T KV / (phi(q_i)^T z + eps)
//   causal      per (b, h), one sweep over t (the recurrence / prefix sum):
//               KV += phi(k_t) v_t^T; z += phi(k_t);
//               o_t = phi(q_t)^T KV / (phi(q_t)^T z + eps)
//               fused so each row KV[i, :] is updated and read in the same
//               pass; KV (d * dv doubles, 32 KiB at d = dv = 64) stays in L1.
// Register blocking: a pass holds kJB columns of KV in registers while it
// walks the d rows, for kTc = 2 tokens (causal), kTa = 4 tokens (accumulation)
// or kR = 4 rows (read-out), so each KV element is loaded and stored once per
// 2-4 tokens, not once per token: the rank-1 updates stop being bound by L1
// traffic. Fixed-size inner loops the compiler unrolls and vectorises at the
// baseline ISA (plain C++, no intrinsics).
//
// Numerics: KV and z are double accumulators for float and double inputs.
// z is a sum of L non-negative terms (it grows like L) and KV a sum of signed
// terms; in float32 both would carry a relative error up to ~L * 2^-24
// (4e-3 at L = 65536). In double the state error is ~L * 1e-16, so a float32
// output is within a few ulps of the exact formula on the rounded inputs.
// 16-bit (bf16 / fp16) v and o: v is widened to double as each block of
// tokens is loaded (no fp32 copy of the whole input), the features phi(q),
// phi(k) arrive in float (computed by the Python layer from the 16-bit
// values), and o is rounded once, from double, to nearest even.
//
// Threads: OpenMP over (b, h) for the sweep (each state belongs to one thread,
// summed in a fixed order), over (b, h, row block) for the non-causal
// read-out: bit-for-bit identical results for any thread count.
// Plain C++, no Python: the bindings release the GIL around this.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <utility>
#include <cstdint>
#include <new>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attn_fast/half.h"
#include "attn_fast/interrupt.h"
#include "attn_fast/linear_attn.h"

namespace attn_fast {
namespace {

constexpr int64_t kBr = 64;           // rows per read-out work item (non-causal)
constexpr int kJB = 4;                // columns of KV held in registers per pass
constexpr int kTc = 2;                // tokens per step of the causal sweep
constexpr int kTa = 4;                // tokens per step of the non-causal accumulation
constexpr int kR = 4;                 // rows per step of the non-causal read-out
constexpr int64_t kPollTokens = 256;  // Ctrl-C is looked for every 256 tokens of a sweep

// Per-thread scratch vectors, sized inside a parallel region: an allocation
// failure there must not escape the region (std::terminate), so it is caught
// and reported; the caller throws std::bad_alloc after the region.
inline bool sized(std::initializer_list<std::pair<std::vector<double>*, int64_t>> vs) {
  try {
    for (const auto& p : vs) p.first->assign(static_cast<size_t>(p.second), 0.0);
  } catch (const std::bad_alloc&) {
    return false;
  } catch (const std::length_error&) {
    return false;
  }
  return true;
}

template <typename T>
inline const T* row(const T* base, const Strides4& s, int64_t b, int64_t h, int64_t t) {
  return base + b * s.b + h * s.h + t * s.l;
}

// Storage -> double on load (exact for every type: 16-bit widens through fp32).
inline double widen(float x) { return x; }
inline double widen(double x) { return x; }
inline double widen(bf16_t x) { return bf16_to_f32(x.bits); }
inline double widen(fp16_t x) { return fp16_to_f32(x.bits); }

// double -> storage, rounded once to nearest even. For the 16-bit types the
// double is first rounded to float *to odd* (truncate, then set the last bit
// if anything was dropped): float has more than 2p + 2 bits for p = 8 (bf16)
// and p = 11 (fp16), so rounding that float to 16 bits equals rounding the
// double directly (no double rounding at a tie). NaN stays NaN, overflow inf.
inline float to_float_odd(double x) {
  float f = static_cast<float>(x);
  if (f == x || x != x) return f;  // exact, or NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  // Rounded away from zero: one step back toward zero (inf -> FLT_MAX too); f is not 0
  // here (a double that rounds to a float 0 has |x| < |f| false).
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) u -= 1u;
  u |= 1u;  // sticky: the dropped bits were not all zero
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <typename T>
inline T narrow(double x) {
  return static_cast<T>(x);
}
template <>
inline bf16_t narrow<bf16_t>(double x) {
  return bf16_t{f32_to_bf16(to_float_odd(x))};
}
template <>
inline fp16_t narrow<fp16_t>(double x) {
  return fp16_t{f32_to_fp16(to_float_odd(x))};
}

template <typename T>
inline void load(double* dst, const T* src, int64_t stride, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i * stride]);
}

// The register-blocked pieces. Each touches columns [j0, j0 + JB) of the
// d x dv state KV, holding them in registers while it walks the d rows, so
// one row block of KV is loaded (and stored) once for NT tokens instead of
// once per token. Summation order per element is the same whatever NT and
// JB, so results do not depend on the blocking.

// Causal step for NT consecutive tokens (kb, qb: NT x d; vb, num: NT x dv):
//   KV[i, j] += k_t[i] v_t[j]; num_t[j] = sum_i q_t[i] KV_t[i, j], t in order.
template <int NT, int JB>
inline void causal_cols(double* __restrict kv, const double* __restrict kb,
                        const double* __restrict qb, const double* __restrict vb,
                        double* __restrict num, int64_t d, int64_t dv, int64_t j0) {
  double vv[NT][JB], acc[NT][JB];
  for (int t = 0; t < NT; ++t)
    for (int jj = 0; jj < JB; ++jj) {
      vv[t][jj] = vb[t * dv + j0 + jj];
      acc[t][jj] = 0.0;
    }
  for (int64_t i = 0; i < d; ++i) {
    double* __restrict s = kv + i * dv + j0;
    double x[JB];
    for (int jj = 0; jj < JB; ++jj) x[jj] = s[jj];
    for (int t = 0; t < NT; ++t) {
      const double a = kb[t * d + i], c = qb[t * d + i];
      for (int jj = 0; jj < JB; ++jj) {
        x[jj] += a * vv[t][jj];
        acc[t][jj] += c * x[jj];
      }
    }
    for (int jj = 0; jj < JB; ++jj) s[jj] = x[jj];
  }
  for (int t = 0; t < NT; ++t)
    for (int jj = 0; jj < JB; ++jj) num[t * dv + j0 + jj] = acc[t][jj];
}

// KV[i, j] += sum_t k_t[i] v_t[j] over NT tokens (no read-out).
template <int NT, int JB>
inline void accum_cols(double* __restrict kv, const double* __restrict kb,
                       const double* __restrict vb, int64_t d, int64_t dv, int64_t j0) {
  double vv[NT][JB];
  for (int t = 0; t < NT; ++t)
    for (int jj = 0; jj < JB; ++jj) vv[t][jj] = vb[t * dv + j0 + jj];
  for (int64_t i = 0; i < d; ++i) {
    double* __restrict s = kv + i * dv + j0;
    double x[JB];
    for (int jj = 0; jj < JB; ++jj) x[jj] = s[jj];
    for (int t = 0; t < NT; ++t) {
      const double a = kb[t * d + i];
      for (int jj = 0; jj < JB; ++jj) x[jj] += a * vv[t][jj];
    }
    for (int jj = 0; jj < JB; ++jj) s[jj] = x[jj];
  }
}

// num_r[j] = sum_i q_r[i] KV[i, j] for NR rows (qb: NR x d; num: NR x dv).
template <int NR, int JB>
inline void readout_cols(const double* __restrict kv, const double* __restrict qb,
                         double* __restrict num, int64_t d, int64_t dv, int64_t j0) {
  double acc[NR][JB];
  for (int r = 0; r < NR; ++r)
    for (int jj = 0; jj < JB; ++jj) acc[r][jj] = 0.0;
  for (int64_t i = 0; i < d; ++i) {
    const double* __restrict s = kv + i * dv + j0;
    double x[JB];
    for (int jj = 0; jj < JB; ++jj) x[jj] = s[jj];
    for (int r = 0; r < NR; ++r) {
      const double c = qb[r * d + i];
      for (int jj = 0; jj < JB; ++jj) acc[r][jj] += c * x[jj];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int jj = 0; jj < JB; ++jj) num[r * dv + j0 + jj] = acc[r][jj];
}

// All dv columns: full JB-wide blocks, then single columns for the tail.
template <int NT>
inline void causal_step(double* kv, const double* kb, const double* qb, const double* vb,
                        double* num, int64_t d, int64_t dv) {
  int64_t j0 = 0;
  for (; j0 + kJB <= dv; j0 += kJB) causal_cols<NT, kJB>(kv, kb, qb, vb, num, d, dv, j0);
  for (; j0 < dv; ++j0) causal_cols<NT, 1>(kv, kb, qb, vb, num, d, dv, j0);
}
template <int NT>
inline void accum_step(double* kv, const double* kb, const double* vb, int64_t d, int64_t dv) {
  int64_t j0 = 0;
  for (; j0 + kJB <= dv; j0 += kJB) accum_cols<NT, kJB>(kv, kb, vb, d, dv, j0);
  for (; j0 < dv; ++j0) accum_cols<NT, 1>(kv, kb, vb, d, dv, j0);
}
template <int NR>
inline void readout_step(const double* kv, const double* qb, double* num, int64_t d, int64_t dv) {
  int64_t j0 = 0;
  for (; j0 + kJB <= dv; j0 += kJB) readout_cols<NR, kJB>(kv, qb, num, d, dv, j0);
  for (; j0 < dv; ++j0) readout_cols<NR, 1>(kv, qb, num, d, dv, j0);
}

// o_r = num_r / den_r with den_r = q_r . z + eps; zeros if den_r is 0.
template <typename T, typename F>
inline void write_rows(const LinearAttnArgs<T, F>& a, int64_t b, int64_t h, int64_t t0, int nt,
                       const double* num, const double* den) {
  for (int t = 0; t < nt; ++t) {
    T* o = a.o + b * a.so.b + h * a.so.h + (t0 + t) * a.so.l;
    const double dn = den[t];
    const double inv = dn != 0.0 ? 1.0 / dn : 0.0;
    for (int64_t j = 0; j < a.dv; ++j)
      o[j * a.so.d] = narrow<T>(dn != 0.0 ? num[t * a.dv + j] * inv : 0.0);
  }
}

template <typename T, typename F>
void causal_sweep(const LinearAttnArgs<T, F>& a) {
  const int64_t BH = a.B * a.H, d = a.d, dv = a.dv;
  CancelToken tok;  // Ctrl-C: polled every kPollTokens tokens
  int failed = 0;
#pragma omp parallel num_threads(a.num_threads) reduction(+ : failed)
  {
    // Per-thread scratch: state (if the caller keeps none), kTc rows of each input.
    std::vector<double> own_kv, own_z, qb, kb, vb, num;
    const bool ok = sized({{&own_kv, a.kv ? 0 : d * dv},
                           {&own_z, a.kv ? 0 : d},
                           {&qb, kTc * d},
                           {&kb, kTc * d},
                           {&vb, kTc * dv},
                           {&num, kTc * dv}});
    failed += ok ? 0 : 1;
    double den[kTc];
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t bh = 0; bh < BH; ++bh) {
      if (!ok || tok.poll()) continue;
      const int64_t b = bh / a.H, h = bh % a.H;
      double* kv = a.kv ? a.kv + bh * d * dv : own_kv.data();
      double* z = a.kv ? a.k_sum + bh * d : own_z.data();
      if (!a.kv) {
        std::fill(own_kv.begin(), own_kv.end(), 0.0);
        std::fill(own_z.begin(), own_z.end(), 0.0);
      }
      for (int64_t t0 = 0; t0 < a.L; t0 += kTc) {
        if (t0 % kPollTokens == kPollTokens - kTc && tok.poll()) break;
        const int nt = static_cast<int>(std::min<int64_t>(kTc, a.L - t0));
        for (int t = 0; t < nt; ++t) {
          load(kb.data() + t * d, row(a.k, a.sk, b, h, t0 + t), a.sk.d, d);
          load(qb.data() + t * d, row(a.q, a.sq, b, h, t0 + t), a.sq.d, d);
          load(vb.data() + t * dv, row(a.v, a.sv, b, h, t0 + t), a.sv.d, dv);
          // z_t = z_{t-1} + k_t; den_t = q_t . z_t + eps
          den[t] = a.eps;
          for (int64_t i = 0; i < d; ++i) {
            z[i] += kb[t * d + i];
            den[t] += qb[t * d + i] * z[i];
          }
        }
        if (nt == kTc)
          causal_step<kTc>(kv, kb.data(), qb.data(), vb.data(), num.data(), d, dv);
        else
          causal_step<1>(kv, kb.data(), qb.data(), vb.data(), num.data(), d, dv);
        write_rows(a, b, h, t0, nt, num.data(), den);
      }
    }
    tok.finish_share();  // the calling thread keeps polling until the team is done
  }
  if (failed) throw std::bad_alloc();
}

template <typename T, typename F>
void non_causal(const LinearAttnArgs<T, F>& a) {
  const int64_t BH = a.B * a.H, d = a.d, dv = a.dv;
  // 1. the state of every (b, h): the caller's (updated in place) or ours.
  std::vector<double> own;
  double* kv_all = a.kv;
  double* z_all = a.k_sum;
  if (!kv_all) {
    own.assign(static_cast<size_t>(BH * (d * dv + d)), 0.0);
    kv_all = own.data();
    z_all = own.data() + BH * d * dv;
  }
  CancelToken tok;  // Ctrl-C: polled every kPollTokens tokens and between row blocks
  int failed = 0;
#pragma omp parallel num_threads(a.num_threads) reduction(+ : failed)
  {
    std::vector<double> kb, vb;
    const bool ok = sized({{&kb, kTa * d}, {&vb, kTa * dv}});
    failed += ok ? 0 : 1;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t bh = 0; bh < BH; ++bh) {
      if (!ok || tok.poll()) continue;
      const int64_t b = bh / a.H, h = bh % a.H;
      double* kv = kv_all + bh * d * dv;
      double* z = z_all + bh * d;
      for (int64_t t0 = 0; t0 < a.L; t0 += kTa) {
        if (t0 % kPollTokens == kPollTokens - kTa && tok.poll()) break;
        const int nt = static_cast<int>(std::min<int64_t>(kTa, a.L - t0));
        for (int t = 0; t < nt; ++t) {
          load(kb.data() + t * d, row(a.k, a.sk, b, h, t0 + t), a.sk.d, d);
          load(vb.data() + t * dv, row(a.v, a.sv, b, h, t0 + t), a.sv.d, dv);
          for (int64_t i = 0; i < d; ++i) z[i] += kb[t * d + i];
        }
        if (nt == kTa)
          accum_step<kTa>(kv, kb.data(), vb.data(), d, dv);
        else
          for (int t = 0; t < nt; ++t)
            accum_step<1>(kv, kb.data() + t * d, vb.data() + t * dv, d, dv);
      }
    }
    tok.finish_share();  // the calling thread keeps polling until the team is done
  }
  if (failed) throw std::bad_alloc();
  if (tok.cancelled()) return;
  // 2. read-out, parallel over (b, h, block of kBr rows), kR rows at a time.
  const int64_t nblk = (a.L + kBr - 1) / kBr;
#pragma omp parallel num_threads(a.num_threads) reduction(+ : failed)
  {
    std::vector<double> qb, num;
    const bool ok = sized({{&qb, kR * d}, {&num, kR * dv}});
    failed += ok ? 0 : 1;
    double den[kR];
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t w = 0; w < BH * nblk; ++w) {
      if (!ok || tok.poll()) continue;
      const int64_t bh = w / nblk, blk = w % nblk;
      const int64_t b = bh / a.H, h = bh % a.H;
      const double* kv = kv_all + bh * d * dv;
      const double* z = z_all + bh * d;
      const int64_t t1 = std::min(a.L, (blk + 1) * kBr);
      for (int64_t t0 = blk * kBr; t0 < t1; t0 += kR) {
        const int nt = static_cast<int>(std::min<int64_t>(kR, t1 - t0));
        for (int t = 0; t < nt; ++t) {
          load(qb.data() + t * d, row(a.q, a.sq, b, h, t0 + t), a.sq.d, d);
          den[t] = a.eps;
          for (int64_t i = 0; i < d; ++i) den[t] += qb[t * d + i] * z[i];
        }
        if (nt == kR)
          readout_step<kR>(kv, qb.data(), num.data(), d, dv);
        else
          for (int t = 0; t < nt; ++t)
            readout_step<1>(kv, qb.data() + t * d, num.data() + t * dv, d, dv);
        write_rows(a, b, h, t0, nt, num.data(), den);
      }
    }
    tok.finish_share();  // the calling thread keeps polling until the team is done
  }
  if (failed) throw std::bad_alloc();
}

template <typename T, typename F>
void forward_t(const LinearAttnArgs<T, F>& a) {
  if (a.B <= 0 || a.H <= 0 || a.d <= 0 || a.dv <= 0) return;
  if (a.causal)
    causal_sweep(a);
  else
    non_causal(a);
}

}  // namespace

void linear_attention_forward(const LinearAttnArgs<float>& a) { forward_t(a); }
void linear_attention_forward(const LinearAttnArgs<double>& a) { forward_t(a); }
void linear_attention_forward(const LinearAttnArgs<bf16_t, float>& a) { forward_t(a); }
void linear_attention_forward(const LinearAttnArgs<fp16_t, float>& a) { forward_t(a); }

}  // namespace attn_fast
