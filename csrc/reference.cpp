// The slow readable kernel: plain loops, two-pass softmax in double.
//
// Same arguments and semantics as the fused kernel (see attention.h); it is
// the fallback users can select and the second oracle the tests compare the
// fused kernel against. Scratch: one row of Lk scores per thread.
#include <cmath>
#include <limits>
#include <memory>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attn_fast/attention.h"
#include "attn_fast/half.h"
#include "attn_fast/interrupt.h"
#include "attn_fast/seq.h"

namespace attn_fast {
namespace {

// Storage types read as double; results rounded once into the storage type
// (the 16-bit types through fp32: a double rounding that can differ from a
// direct one only on exact ties of the fp32 value, immaterial for an oracle).
inline double dbl(float x) { return x; }
inline double dbl(double x) { return x; }
inline double dbl(bf16_t x) { return bf16_to_f32(x.bits); }
inline double dbl(fp16_t x) { return fp16_to_f32(x.bits); }
template <typename S>
inline S from_dbl(double x) {
  return static_cast<S>(x);
}
template <>
inline bf16_t from_dbl<bf16_t>(double x) {
  return bf16_t{f32_to_bf16(static_cast<float>(x))};
}
template <>
inline fp16_t from_dbl<fp16_t>(double x) {
  return fp16_t{f32_to_fp16(static_cast<float>(x))};
}

template <typename T>
void reference_impl(const AttnArgs<T>& a) {
  using C = compute_t<T>;  // lse, bias, alibi, sinks
  const double NEG_INF = -std::numeric_limits<double>::infinity();
  // Scratch for every thread, allocated before any thread starts: a failed
  // allocation throws std::bad_alloc here (MemoryError in Python) instead of
  // terminating the process from inside a parallel region.
  const int nt = a.num_threads > 0 ? a.num_threads : 1;
  const int64_t per = (a.Lk > 0 ? a.Lk : 1) + (a.dv > 0 ? a.dv : 1);
  std::unique_ptr<double[]> scratch(new double[static_cast<size_t>(per) * static_cast<size_t>(nt)]);
  CancelToken tok;  // Ctrl-C, polled per query row
  for (int64_t s = 0; s < a.B && !tok.cancelled(); ++s) {
    const SeqInfo si = seq_info(a, s);
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(dynamic) nowait
      for (int64_t h = 0; h < a.Hq; ++h) {
        const int64_t hk = h / (a.Hq / a.Hkv);
#ifdef _OPENMP
        double* score = scratch.get() + per * omp_get_thread_num();
#else
        double* score = scratch.get();
#endif
        double* out = score + (a.Lk > 0 ? a.Lk : 1);
        for (int64_t i = 0; i < si.q_rows; ++i) {
          if (tok.poll()) break;  // the call raises; the rest stays unwritten
          const T* q = a.q + si.b * a.sq.b + h * a.sq.h + (si.q0 + i) * a.sq.l;
          T* o = a.o + si.b * a.so.b + h * a.so.h + (si.q0 + i) * a.so.l;
          int64_t lo, hi;
          row_range(a, si, i, &lo, &hi);
          // Pass 1: scores of visible keys (masked ones are -inf).
          double m = NEG_INF;
          bool nan = false;
          for (int64_t j = 0; j < si.k_len; ++j) {
            bool vis = j >= lo && j < hi;
            if (vis && a.layout)
              vis =
                  a.layout[si.b * a.slayout.b + h * a.slayout.h + (i / a.layout_bq) * a.slayout.l +
                           (j / a.layout_bk) * a.slayout.d] != 0;
            if (vis && a.mask)
              vis = a.mask[si.b * a.smask.b + h * a.smask.h + i * a.smask.l + j * a.smask.d] != 0;
            if (!vis) {
              score[j] = NEG_INF;
              continue;
            }
            const T* k = a.k + si.b * a.sk.b + hk * a.sk.h + (si.k0 + j) * a.sk.l;
            double dot = 0;
            for (int64_t e = 0; e < a.d; ++e) dot += dbl(q[e * a.sq.d]) * dbl(k[e * a.sk.d]);
            double sc = a.scale * dot;
            if (a.softcap > 0) sc = a.softcap * std::tanh(sc / a.softcap);
            if (a.alibi) sc -= double(a.alibi[h]) * std::fabs(double(i + si.off - j));
            if (a.bias) {
              const double bj =
                  double(a.bias[si.b * a.sbias.b + h * a.sbias.h + i * a.sbias.l + j * a.sbias.d]);
              if (bj == NEG_INF) {  // masked by the bias: never read, even if the score is NaN
                score[j] = NEG_INF;
                continue;
              }
              sc += bj;
            }
            score[j] = sc;
            if (sc > m) m = sc;
            if (sc != sc) nan = true;
          }
          if (nan) m = std::numeric_limits<double>::quiet_NaN();  // a NaN score: NaN row
          // A padding row (i >= q_len) is no query: no sink either (O = 0, lse = -inf).
          const bool sink = a.sinks && i < si.q_len;
          if (sink && double(a.sinks[h]) > m) m = double(a.sinks[h]);
          // Pass 2: weights and output, skipping invisible keys entirely.
          double l = 0;
          for (int64_t e = 0; e < a.dv; ++e) out[e] = 0;
          if (m != NEG_INF) {
            for (int64_t j = 0; j < si.k_len; ++j) {
              if (score[j] == NEG_INF) continue;
              const double p = std::exp(score[j] - m);
              l += p;
              const T* v = a.v + si.b * a.sv.b + hk * a.sv.h + (si.k0 + j) * a.sv.l;
              for (int64_t e = 0; e < a.dv; ++e) out[e] += p * dbl(v[e * a.sv.d]);
            }
          }
          const double visible_l = l;
          if (sink && double(a.sinks[h]) == -NEG_INF && !nan && visible_l == visible_l) {
            l = 1;  // a +inf sink takes all the weight: O = 0 (visible_l is 0), lse = +inf
          } else if (sink && m != NEG_INF) {
            l += std::exp(double(a.sinks[h]) - m);
          }
          for (int64_t e = 0; e < a.dv; ++e)
            o[e * a.so.d] = from_dbl<T>((visible_l == 0) ? 0.0 : out[e] / l);
          if (a.lse) {
            C* lse = a.cu_q ? a.lse + h * a.Lq + si.q0 + i : a.lse + (si.b * a.Hq + h) * a.Lq + i;
            *lse = (l > 0 || l != l) ? C(m + std::log(l)) : C(NEG_INF);
          }
        }
      }
      tok.finish_share();  // the calling thread keeps polling until the team is done
    }
  }
}

}  // namespace

void reference_forward(const AttnArgs<float>& a) { reference_impl<float>(a); }
void reference_forward(const AttnArgs<double>& a) { reference_impl<double>(a); }
void reference_forward(const AttnArgs<bf16_t>& a) { reference_impl<bf16_t>(a); }
void reference_forward(const AttnArgs<fp16_t>& a) { reference_impl<fp16_t>(a); }

}  // namespace attn_fast
