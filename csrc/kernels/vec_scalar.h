// Portable "vector" of one lane: the baseline path for any CPU. Same interface
// as vec_avx2.h / vec_avx512.h so the kernel source is shared.
// exp and exp2_neg are libm's (the SIMD headers share vec_math.h instead).
#pragma once
#include <cmath>
#include <cstdint>

// Register blocking of the fused kernels' micro-tiles (4 x 4 scalars).
struct IsaTraits {
  static constexpr int kMR = 4, kNR = 4;
};

template <typename T>
struct Vec {
  static constexpr int W = 1;
  using R = T;
  static R zero() { return T(0); }
  static R set1(T x) { return x; }
  static R load(const T* p) { return *p; }
  static void store(T* p, R x) { *p = x; }
  static R fma(R a, R b, R c) { return a * b + c; }
  static R mul(R a, R b) { return a * b; }
  static R add(R a, R b) { return a + b; }
  static R sub(R a, R b) { return a - b; }
  static R max(R a, R b) { return a > b ? a : b; }
  static T hmax(R a) { return a; }
  static T hsum(R a) { return a; }
  static void hsum4(const R* a, T* out) {
    for (int i = 0; i < 4; ++i) out[i] = a[i];
  }
  // One int8 code as the compute type (the int8 KV cache).
  static R load_i8(const int8_t* p) { return static_cast<R>(*p); }
  static R exp(R x) { return std::exp(x); }
  static R exp2_neg(R t) { return std::exp2(t); }  // t <= 0: softmax weights
  // 16-bit storage <-> fp32 (T = float only): W elements, and one element.
  // Bit manipulation (attn_fast/half.h): round to nearest even, NaN kept.
  static R load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static R load_f16(const uint16_t* p) { return fp16_to_f32(*p); }
  static void store_bf16(uint16_t* p, R x) { *p = f32_to_bf16(x); }
  static void store_f16(uint16_t* p, R x) { *p = f32_to_fp16(x); }
  static float from_bf16(uint16_t h) { return bf16_to_f32(h); }
  static float from_f16(uint16_t h) { return fp16_to_f32(h); }
  static uint16_t to_bf16(float x) { return f32_to_bf16(x); }
  static uint16_t to_f16(float x) { return f32_to_fp16(x); }
};
