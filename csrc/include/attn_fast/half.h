// Scalar bfloat16 / binary16 <-> fp32 conversions by bit manipulation, for
// every build (the baseline path, the reference kernel) and for the scalar
// tails of the vector paths. Round to nearest even; NaN stays NaN (quieted),
// overflow gives inf, fp16 subnormals are exact both ways.
//
// In an anonymous namespace on purpose, as seq.h: each per-ISA translation
// unit gets its own copy.
#pragma once

#include <cstdint>
#include <cstring>

namespace attn_fast {
namespace {

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// bf16 is the top half of an fp32: widening is a 16-bit shift.
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u)
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >>
                               16);  // ties to even; inf stays inf
}

inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (mant << 13));  // inf / NaN (payload kept)
  if (e != 0) return bits_f32(sign | ((e + 112u) << 23) | (mant << 13));
  // zero or subnormal: mant * 2^-24, exact in fp32
  return bits_f32(sign | f32_bits(static_cast<float>(mant) * 5.9604644775390625e-08f));
}

inline uint16_t f32_to_fp16(float f) {
  uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((x >> 13) & 0x3FFu));  // NaN
  if (x >= 0x477FF000u)
    return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: inf (ties to even)
  if (x < 0x38800000u) {
    // below 2^-14: subnormal or zero. Adding 0.5 puts round(|f| * 2^24) (ties
    // to even, by the FPU) in the low mantissa bits of the sum.
    const float s = bits_f32(x) + 0.5f;
    return static_cast<uint16_t>(sign | (f32_bits(s) - 0x3F000000u));
  }
  x += 0xC8000FFFu + ((x >> 13) & 1u);  // rebias (15 - 127) << 23, round to nearest even
  return static_cast<uint16_t>(sign | (x >> 13));
}

}  // namespace
}  // namespace attn_fast
