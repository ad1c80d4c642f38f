// Scalar loads and stores of a storage type S (float, double, bf16_t, fp16_t)
// in its compute type compute_t<S>: the one definition the kernels share.
// Included by each per-ISA kernel source inside its ISA namespace, after
// ATTN_VEC_HEADER (it uses Vec<float>'s conversions), like the vector headers:
// no static data, nothing outside the namespace.
#pragma once

inline float ld(const float* p) { return *p; }
inline double ld(const double* p) { return *p; }
inline float ld(const bf16_t* p) { return Vec<float>::from_bf16(p->bits); }
inline float ld(const fp16_t* p) { return Vec<float>::from_f16(p->bits); }
inline void put(float* p, float x) { *p = x; }
inline void put(double* p, double x) { *p = x; }
inline void put(bf16_t* p, float x) { p->bits = Vec<float>::to_bf16(x); }
inline void put(fp16_t* p, float x) { p->bits = Vec<float>::to_f16(x); }
inline const uint16_t* bits_of(const bf16_t* p) { return reinterpret_cast<const uint16_t*>(p); }
inline const uint16_t* bits_of(const fp16_t* p) { return reinterpret_cast<const uint16_t*>(p); }
inline uint16_t* bits_of(bf16_t* p) { return reinterpret_cast<uint16_t*>(p); }
inline uint16_t* bits_of(fp16_t* p) { return reinterpret_cast<uint16_t*>(p); }
