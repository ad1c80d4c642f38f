// The machine probes' inner loops, compiled once per ISA like the kernels
// (isa.h): the FP32 FMA peak, the streaming-read bandwidth and, in the
// avx512_bf16 object, the vdpbf16ps throughput (neon_bf16: BFDOT). The timing around them (threads,
// buffers, clocks) is baseline code: csrc/machine_probes.cpp.

#include <cmath>
#include <cstdint>

#include "attn_fast/attention.h"
#include "attn_fast/half.h"
#include "attn_fast/kernel_entries.h"

#include "isa.h"

namespace attn_fast {
namespace ATTN_NS {

#include ATTN_VEC_HEADER

// 10 independent accumulator chains c = step(c) held in registers (named
// variables, not an array, so the compiler never spills them), no memory;
// returns their sum, kept so that the loop is not dead code.
template <typename Step>
inline float ten_chains(int64_t iters, Step step) {
  using V = Vec<float>;
  typename V::R c0 = V::set1(0.f), c1 = V::set1(1e-3f), c2 = V::set1(2e-3f), c3 = V::set1(3e-3f),
                c4 = V::set1(4e-3f), c5 = V::set1(5e-3f), c6 = V::set1(6e-3f), c7 = V::set1(7e-3f),
                c8 = V::set1(8e-3f), c9 = V::set1(9e-3f);
  for (int64_t it = 0; it < iters; ++it) {
    c0 = step(c0);
    c1 = step(c1);
    c2 = step(c2);
    c3 = step(c3);
    c4 = step(c4);
    c5 = step(c5);
    c6 = step(c6);
    c7 = step(c7);
    c8 = step(c8);
    c9 = step(c9);
  }
  return V::hsum(V::add(V::add(V::add(c0, c1), V::add(c2, c3)),
                        V::add(V::add(V::add(c4, c5), V::add(c6, c7)), V::add(c8, c9))));
}

#if defined(ATTN_DOT_BF16)
ATTN_BF16DOT_ENTRY_POINTS

// Peak bf16-pair probe: ten_chains of vdpbf16ps / BFDOT (DotBf16); returns
// the FLOPs done (2 per bf16 pair).
double dpbf16_loop(int64_t iters) {
  using D = DotBf16;
  const D::B a = D::set1(0x3F803F80u);  // (1.0, 1.0)
  const D::B b = D::set1(0x33803380u);  // (2^-24, 2^-24)
  const float sink = ten_chains(iters, [&](Vec<float>::R c) { return D::dot(c, a, b); });
  return sink == 12345.f ? 0.0 : 2.0 * 10 * 2 * Vec<float>::W * static_cast<double>(iters);
}
#else
ATTN_ISA_ENTRY_POINTS

// Peak-FMA probe: ten_chains of FMAs; returns the FLOPs done.
double fma_loop(int64_t iters) {
  using V = Vec<float>;
  const typename V::R a = V::set1(0.999999f), b = V::set1(1e-7f);
  const float sink = ten_chains(iters, [&](typename V::R c) { return V::fma(c, a, b); });
  return sink == 12345.f ? 0.0 : 2.0 * 10 * V::W * static_cast<double>(iters);
}

// Streaming-read probe: the sum of n floats, four independent vector
// accumulators so the loop is bound by the loads alone; the tail (n not a
// multiple of 4 W) element by element.
double read_loop(const float* p, int64_t n) {
  using V = Vec<float>;
  constexpr int W = V::W;
  typename V::R a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    a0 = V::add(a0, V::load(p + i));
    a1 = V::add(a1, V::load(p + i + W));
    a2 = V::add(a2, V::load(p + i + 2 * W));
    a3 = V::add(a3, V::load(p + i + 3 * W));
  }
  double s = V::hsum(V::add(V::add(a0, a1), V::add(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
}
#endif

}  // namespace ATTN_NS
}  // namespace attn_fast
