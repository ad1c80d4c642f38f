// The machine probes' inner loops, compiled once per ISA like the kernels
// (isa.h): the FP32 FMA peak, the streaming-read bandwidth and, in the
// avx512_bf16 object, the vdpbf16ps throughput (neon_bf16: BFDOT). The timing around them (threads,
// buffers, clocks) is baseline code: csrc/probes.cpp.

#include <cmath>
#include <cstdint>

#include "attn_fast/attention.h"
#include "attn_fast/half.h"
#include "attn_fast/kernel_entries.h"

#include "isa.h"

namespace attn_fast {
namespace ATTN_NS {

#include ATTN_VEC_HEADER

#if defined(ATTN_ISA_AVX512_BF16)
ATTN_BF16DOT_ENTRY_POINTS

// 10 independent vdpbf16ps accumulator chains in registers; returns the
// FLOPs done (2 per bf16 pair).
double dpbf16_loop(int64_t iters) {
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80);  // (1.0, 1.0)
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x33803380);  // (2^-24, 2^-24)
  __m512 c0 = _mm512_set1_ps(0.f), c1 = _mm512_set1_ps(1e-3f), c2 = _mm512_set1_ps(2e-3f),
         c3 = _mm512_set1_ps(3e-3f), c4 = _mm512_set1_ps(4e-3f), c5 = _mm512_set1_ps(5e-3f),
         c6 = _mm512_set1_ps(6e-3f), c7 = _mm512_set1_ps(7e-3f), c8 = _mm512_set1_ps(8e-3f),
         c9 = _mm512_set1_ps(9e-3f);
  for (int64_t it = 0; it < iters; ++it) {
    c0 = _mm512_dpbf16_ps(c0, a, b);
    c1 = _mm512_dpbf16_ps(c1, a, b);
    c2 = _mm512_dpbf16_ps(c2, a, b);
    c3 = _mm512_dpbf16_ps(c3, a, b);
    c4 = _mm512_dpbf16_ps(c4, a, b);
    c5 = _mm512_dpbf16_ps(c5, a, b);
    c6 = _mm512_dpbf16_ps(c6, a, b);
    c7 = _mm512_dpbf16_ps(c7, a, b);
    c8 = _mm512_dpbf16_ps(c8, a, b);
    c9 = _mm512_dpbf16_ps(c9, a, b);
  }
  const __m512 sum =
      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                    _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7)),
                                  _mm512_add_ps(c8, c9)));
  const float sink = _mm512_reduce_add_ps(sum);
  return sink == 12345.f ? 0.0 : 2.0 * 10 * 32 * static_cast<double>(iters);
}
#elif defined(ATTN_ISA_NEON_BF16)
ATTN_BF16DOT_ENTRY_POINTS

// 10 independent BFDOT accumulator chains in registers (DotBf16, vec_neon.h);
// returns the FLOPs done (2 per bf16 pair).
double dpbf16_loop(int64_t iters) {
  using V = Vec<float>;
  using D = DotBf16;
  const D::B a = D::set1(0x3F803F80u);  // (1.0, 1.0)
  const D::B b = D::set1(0x33803380u);  // (2^-24, 2^-24)
  V::R c0 = V::set1(0.f), c1 = V::set1(1e-3f), c2 = V::set1(2e-3f), c3 = V::set1(3e-3f),
       c4 = V::set1(4e-3f), c5 = V::set1(5e-3f), c6 = V::set1(6e-3f), c7 = V::set1(7e-3f),
       c8 = V::set1(8e-3f), c9 = V::set1(9e-3f);
  for (int64_t it = 0; it < iters; ++it) {
    c0 = D::dot(c0, a, b);
    c1 = D::dot(c1, a, b);
    c2 = D::dot(c2, a, b);
    c3 = D::dot(c3, a, b);
    c4 = D::dot(c4, a, b);
    c5 = D::dot(c5, a, b);
    c6 = D::dot(c6, a, b);
    c7 = D::dot(c7, a, b);
    c8 = D::dot(c8, a, b);
    c9 = D::dot(c9, a, b);
  }
  const float sink =
      V::hsum(V::add(V::add(V::add(c0, c1), V::add(c2, c3)),
                     V::add(V::add(V::add(c4, c5), V::add(c6, c7)), V::add(c8, c9))));
  return sink == 12345.f ? 0.0 : 2.0 * 10 * 2 * V::W * static_cast<double>(iters);
}
#else
ATTN_ISA_ENTRY_POINTS

// Peak-FMA probe: 10 independent accumulator chains held in registers (named
// variables, not an array, so the compiler never spills them), no memory.
double fma_loop(int64_t iters) {
  using V = Vec<float>;
  typename V::R c0 = V::set1(0.f), c1 = V::set1(1e-3f), c2 = V::set1(2e-3f), c3 = V::set1(3e-3f),
                c4 = V::set1(4e-3f), c5 = V::set1(5e-3f), c6 = V::set1(6e-3f), c7 = V::set1(7e-3f),
                c8 = V::set1(8e-3f), c9 = V::set1(9e-3f);
  const typename V::R a = V::set1(0.999999f), b = V::set1(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
    c0 = V::fma(c0, a, b);
    c1 = V::fma(c1, a, b);
    c2 = V::fma(c2, a, b);
    c3 = V::fma(c3, a, b);
    c4 = V::fma(c4, a, b);
    c5 = V::fma(c5, a, b);
    c6 = V::fma(c6, a, b);
    c7 = V::fma(c7, a, b);
    c8 = V::fma(c8, a, b);
    c9 = V::fma(c9, a, b);
  }
  const float sink =
      V::hsum(V::add(V::add(V::add(c0, c1), V::add(c2, c3)),
                     V::add(V::add(V::add(c4, c5), V::add(c6, c7)), V::add(c8, c9))));
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
