// Storage types S of q, k, v, o (float, double, bf16_t, fp16_t) and their
// compute type compute_t<S>: one traits block per type, the only place the
// kernels learn how a type is read and written.
//
//   Storage<S>::kNative   S is its own compute type (rows are copied as they are)
//   Storage<S>::ld(p)     one element, as compute_t<S>
//   Storage<S>::put(p, x) one compute_t<S> value rounded to S (16-bit: round to
//                         nearest even, NaN kept)
//   Storage<S>::load(p)   W consecutive elements as one Vec<compute_t<S>> register
//   Storage<S>::store(p, x)
//
// A new storage type is one block here (with its compute_type in
// attn_fast/attention.h when it is not its own compute type) and one line in
// the type lists of attn_fast/kernel_entries.h. ld / put are the spellings
// the kernels use.
//
// Included by each per-ISA kernel source inside its ISA namespace, after
// ATTN_VEC_HEADER (the 16-bit types use Vec<float>'s conversions), like the
// vector headers: no static data, nothing outside the namespace.
#pragma once

inline const uint16_t* bits_of(const bf16_t* p) { return reinterpret_cast<const uint16_t*>(p); }
inline const uint16_t* bits_of(const fp16_t* p) { return reinterpret_cast<const uint16_t*>(p); }
inline uint16_t* bits_of(bf16_t* p) { return reinterpret_cast<uint16_t*>(p); }
inline uint16_t* bits_of(fp16_t* p) { return reinterpret_cast<uint16_t*>(p); }

template <typename S>
struct Storage;

// float and double: their own compute type.
template <typename T>
struct NativeStorage {
  static constexpr bool kNative = true;
  using V = Vec<T>;
  static T ld(const T* p) { return *p; }
  static void put(T* p, T x) { *p = x; }
  static typename V::R load(const T* p) { return V::load(p); }
  static void store(T* p, typename V::R x) { V::store(p, x); }
};
template <>
struct Storage<float> : NativeStorage<float> {};
template <>
struct Storage<double> : NativeStorage<double> {};

// The 16-bit types, through Vec<float>'s conversions of their format:
// bfloat16 widened by a 16-bit shift, IEEE binary16 by F16C where the ISA has
// it (narrowing: round to nearest even, NaN kept).
template <typename S>
struct HalfStorage {
  static constexpr bool kNative = false;
  static constexpr bool kBf16 = std::is_same<S, bf16_t>::value;
  using V = Vec<float>;
  static float ld(const S* p) { return kBf16 ? V::from_bf16(p->bits) : V::from_f16(p->bits); }
  static void put(S* p, float x) { p->bits = kBf16 ? V::to_bf16(x) : V::to_f16(x); }
  static V::R load(const S* p) {
    return kBf16 ? V::load_bf16(bits_of(p)) : V::load_f16(bits_of(p));
  }
  static void store(S* p, V::R x) {
    if constexpr (kBf16)
      V::store_bf16(bits_of(p), x);
    else
      V::store_f16(bits_of(p), x);
  }
};
template <>
struct Storage<bf16_t> : HalfStorage<bf16_t> {};
template <>
struct Storage<fp16_t> : HalfStorage<fp16_t> {};

template <typename S>
inline compute_t<S> ld(const S* p) {
  return Storage<S>::ld(p);
}
template <typename S>
inline void put(S* p, compute_t<S> x) {
  Storage<S>::put(p, x);
}
