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
// The inner loops run over dv contiguous doubles with no loop-carried
// dependence, so the compiler vectorises them at the baseline ISA.
//
// Numerics: KV and z are double accumulators for float and double inputs.
// z is a sum of L non-negative terms (it grows like L) and KV a sum of signed
// terms; in float32 both would carry a relative error up to ~L * 2^-24
// (4e-3 at L = 65536). In double the state error is ~L * 1e-16, so a float32
// output is within a few ulps of the exact formula on the rounded inputs.
//
// Threads: OpenMP over (b, h) for the sweep (each state belongs to one thread,
// summed in a fixed order), over (b, h, row block) for the non-causal
// read-out: bit-for-bit identical results for any thread count.
// Plain C++, no Python: the bindings release the GIL around this.
#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attn_fast/linear_attn.h"

namespace attn_fast {
namespace {

constexpr int64_t kBr = 64;  // rows per read-out work item (non-causal)

template <typename T>
inline const T* row(const T* base, const Strides4& s, int64_t b, int64_t h, int64_t t) {
  return base + b * s.b + h * s.h + t * s.l;
}

// KV (d x dv) and z (d) += phi(k_t) v_t^T and phi(k_t): one position.
inline void accumulate(double* __restrict kv, double* __restrict z, const double* __restrict kb,
                       const double* __restrict vb, int64_t d, int64_t dv) {
  for (int64_t i = 0; i < d; ++i) {
    const double a = kb[i];
    double* __restrict kvi = kv + i * dv;
    for (int64_t j = 0; j < dv; ++j) kvi[j] += a * vb[j];
    z[i] += a;
  }
}

// o = phi(q)^T KV / (phi(q)^T z + eps), zeros if the denominator is 0.
template <typename T>
inline void read_out(const double* __restrict kv, const double* __restrict z, const double* __restrict qb,
                     double* __restrict num, T* o, int64_t so_d, int64_t d, int64_t dv, double eps) {
  std::fill(num, num + dv, 0.0);
  double den = eps;
  for (int64_t i = 0; i < d; ++i) {
    const double c = qb[i];
    const double* __restrict kvi = kv + i * dv;
    for (int64_t j = 0; j < dv; ++j) num[j] += c * kvi[j];
    den += c * z[i];
  }
  const double inv = den != 0.0 ? 1.0 / den : 0.0;
  for (int64_t j = 0; j < dv; ++j) o[j * so_d] = static_cast<T>(den != 0.0 ? num[j] * inv : 0.0);
}

template <typename T>
inline void load(double* dst, const T* src, int64_t stride, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<double>(src[i * stride]);
}

template <typename T>
void causal_sweep(const LinearAttnArgs<T>& a) {
  const int64_t BH = a.B * a.H, d = a.d, dv = a.dv;
#pragma omp parallel num_threads(a.num_threads)
  {
    // Per-thread scratch: state (if the caller keeps none), one row of each input.
    std::vector<double> own_kv(static_cast<size_t>(d * dv)), own_z(static_cast<size_t>(d));
    std::vector<double> qb(static_cast<size_t>(d)), kb(static_cast<size_t>(d));
    std::vector<double> vb(static_cast<size_t>(dv)), num(static_cast<size_t>(dv));
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < BH; ++bh) {
      const int64_t b = bh / a.H, h = bh % a.H;
      double* kv = a.kv ? a.kv + bh * d * dv : own_kv.data();
      double* z = a.kv ? a.k_sum + bh * d : own_z.data();
      if (!a.kv) {
        std::fill(own_kv.begin(), own_kv.end(), 0.0);
        std::fill(own_z.begin(), own_z.end(), 0.0);
      }
      for (int64_t t = 0; t < a.L; ++t) {
        load(kb.data(), row(a.k, a.sk, b, h, t), a.sk.d, d);
        load(vb.data(), row(a.v, a.sv, b, h, t), a.sv.d, dv);
        load(qb.data(), row(a.q, a.sq, b, h, t), a.sq.d, d);
        accumulate(kv, z, kb.data(), vb.data(), d, dv);
        T* o = a.o + b * a.so.b + h * a.so.h + t * a.so.l;
        read_out(kv, z, qb.data(), num.data(), o, a.so.d, d, dv, a.eps);
      }
    }
  }
}

template <typename T>
void non_causal(const LinearAttnArgs<T>& a) {
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
#pragma omp parallel num_threads(a.num_threads)
  {
    std::vector<double> kb(static_cast<size_t>(d)), vb(static_cast<size_t>(dv));
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < BH; ++bh) {
      const int64_t b = bh / a.H, h = bh % a.H;
      for (int64_t t = 0; t < a.L; ++t) {
        load(kb.data(), row(a.k, a.sk, b, h, t), a.sk.d, d);
        load(vb.data(), row(a.v, a.sv, b, h, t), a.sv.d, dv);
        accumulate(kv_all + bh * d * dv, z_all + bh * d, kb.data(), vb.data(), d, dv);
      }
    }
  }
  // 2. read-out, parallel over (b, h, row block).
  const int64_t nblk = (a.L + kBr - 1) / kBr;
#pragma omp parallel num_threads(a.num_threads)
  {
    std::vector<double> qb(static_cast<size_t>(d)), num(static_cast<size_t>(dv));
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < BH * nblk; ++w) {
      const int64_t bh = w / nblk, blk = w % nblk;
      const int64_t b = bh / a.H, h = bh % a.H;
      const int64_t t1 = std::min(a.L, (blk + 1) * kBr);
      for (int64_t t = blk * kBr; t < t1; ++t) {
        load(qb.data(), row(a.q, a.sq, b, h, t), a.sq.d, d);
        T* o = a.o + b * a.so.b + h * a.so.h + t * a.so.l;
        read_out(kv_all + bh * d * dv, z_all + bh * d, qb.data(), num.data(), o, a.so.d, d, dv, a.eps);
      }
    }
  }
}

template <typename T>
void forward_t(const LinearAttnArgs<T>& a) {
  if (a.B <= 0 || a.H <= 0 || a.d <= 0 || a.dv <= 0) return;
  if (a.causal)
    causal_sweep(a);
  else
    non_causal(a);
}

}  // namespace

void linear_attention_forward(const LinearAttnArgs<float>& a) { forward_t(a); }
void linear_attention_forward(const LinearAttnArgs<double>& a) { forward_t(a); }

}  // namespace attn_fast
