// attn_fast linear attention (Katharopoulos et al. 2020): argument struct and
// entry points. Shape legend as in attention.h (B, H, L, d, dv).
//
// The caller applies the feature map phi; this kernel sees phi(q) and phi(k)
// (non-negative by contract) and computes, per (b, h):
//
//   non-causal:  KV = KV0 + sum_t phi(k_t) v_t^T     (d x dv)
//                z  = z0  + sum_t phi(k_t)           (d)
//                o_i = phi(q_i)^T KV / (phi(q_i)^T z + eps)
//   causal:      KV_i = KV0 + sum_{t<=i} phi(k_t) v_t^T,  z_i likewise
//                o_i = phi(q_i)^T KV_i / (phi(q_i)^T z_i + eps)
//
// (KV0, z0) is an optional running state (a prefix already seen); when given
// it is read first and overwritten with the state after the last position, so
// a prefill followed by one-token calls is the recurrent decode of the causal
// form at O(d * dv) per token. A row whose denominator is exactly 0 (possible
// only with eps = 0) gets zeros, never NaN.
//
// Numerics: the state (KV, z) is accumulated in double whatever T is, so the
// prefix sums over L = 65536 float32 positions lose nothing to cancellation or
// to the growth of z; only phi(q), phi(k) (to F), v and o (to T) are rounded.
//
// Storage: T is float, double, bf16_t or fp16_t (v and o); F is the feature
// type of phi(q), phi(k): T itself for float / double, float for the 16-bit
// types (the Python layer applies phi in float32 to the 16-bit values, so the
// features are not rounded to 16 bits). 16-bit v is widened to double as each
// block of tokens is loaded; o is rounded once from double to T (to nearest
// even, without double rounding through float).
#pragma once

#include <cstdint>

#include "attn_fast/attention.h"

namespace attn_fast {

template <typename T, typename F = T>
struct LinearAttnArgs {
  const F* q = nullptr;  // phi(q) (B, H, L, d), strided
  const F* k = nullptr;  // phi(k) (B, H, L, d), strided
  const T* v = nullptr;  // (B, H, L, dv), strided
  T* o = nullptr;        // (B, H, L, dv), strided
  int64_t B = 0, H = 0, L = 0, d = 0, dv = 0;
  Strides4 sq, sk, sv, so;
  bool causal = false;
  double eps = 0.0;
  double* kv = nullptr;     // optional state (B, H, d, dv), C-contiguous, in/out
  double* k_sum = nullptr;  // optional state (B, H, d), C-contiguous, in/out (with kv)
  int num_threads = 1;
};

// Compiled at the baseline ISA; OpenMP over (b, h) (and over row blocks for the
// non-causal read-out). Results do not depend on the thread count.
void linear_attention_forward(const LinearAttnArgs<float>& a);
void linear_attention_forward(const LinearAttnArgs<double>& a);
void linear_attention_forward(const LinearAttnArgs<bf16_t, float>& a);
void linear_attention_forward(const LinearAttnArgs<fp16_t, float>& a);

}  // namespace attn_fast
