// Per-sequence geometry, structural visibility and the index and allocation
// helpers, shared by the fused kernels (compiled once per ISA) and the
// reference kernel. The per-ISA part of the kernel toolkit (NEG_INF, the
// online-softmax row update, the per-thread scratch arena) is
// csrc/kernels/toolkit.h, which includes this header.
//
// Everything here lives in an anonymous namespace on purpose: each translation
// unit, compiled with its own ISA flags, gets its own copy, so the linker can
// never pick an AVX-512 compiled body for the baseline path (see PyTorch's
// aten/src/ATen/native/cpu/README.md on per-ISA objects).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "attn_fast/attention.h"

namespace attn_fast {
namespace {

// One sequence's view of the packed/padded batch.
struct SeqInfo {
  int64_t b = 0;       // batch index used to address q/k/v/o and masks
  int64_t q0 = 0;      // first query row in the tensor (varlen offset)
  int64_t q_len = 0;   // valid query rows
  int64_t q_rows = 0;  // rows to write (valid + padding rows that get zeros)
  int64_t k0 = 0;      // first key row in the tensor (varlen offset)
  int64_t k_len = 0;   // valid keys
  int64_t off = 0;     // causal diagonal: query i aligns with key i + off
};

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
// x rounded up to a multiple of m (x >= 0, m > 0).
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// n elements of T, 64-byte aligned (at least one cache line), or nullptr when
// n is negative, the size overflows, or memory is short: callers check and
// throw std::bad_alloc (MemoryError in Python). Freed with std::free.
template <typename T>
T* alloc_scratch(int64_t n) {
  constexpr int64_t kMax = (int64_t(1) << 62) / static_cast<int64_t>(sizeof(T));
  if (n < 0 || n > kMax) return nullptr;
  const int64_t bytes = round_up(imax(n, 1) * static_cast<int64_t>(sizeof(T)), 64);
  return static_cast<T*>(std::aligned_alloc(64, static_cast<size_t>(bytes)));
}

template <typename T>
inline SeqInfo seq_info(const AttnArgs<T>& a, int64_t s) {
  SeqInfo si;
  if (a.cu_q) {
    si.b = 0;
    si.q0 = a.cu_q[s];
    si.q_len = a.cu_q[s + 1] - a.cu_q[s];
    si.q_rows = si.q_len;
    si.k0 = a.cu_k[s];
    si.k_len = a.cu_k[s + 1] - a.cu_k[s];
  } else {
    si.b = s;
    si.q_rows = a.Lq;
    si.q_len = a.q_lens ? imax(0, imin(a.Lq, a.q_lens[s])) : a.Lq;
    si.k_len = a.kv_lens ? imax(0, imin(a.Lk, a.kv_lens[s])) : a.Lk;
  }
  si.off = a.top_left ? 0 : si.k_len - si.q_len;
  return si;
}

// Half-open range [lo, hi) of keys that the structural masks (lengths, causal,
// window) leave visible to local query row i. Empty when hi <= lo. Args:
// AttnArgs<T> (the fused kernels) or DecodeArgs<T> (decode: logical keys of
// the cache), which name these fields alike.
template <typename Args>
inline void row_range(const Args& a, const SeqInfo& si, int64_t i, int64_t* lo, int64_t* hi) {
  int64_t l = 0, h = si.k_len;
  const int64_t diag = i + si.off;
  if (a.causal) h = imin(h, diag + 1);
  if (a.window_left >= 0) l = imax(l, diag - a.window_left);
  if (a.window_right >= 0) h = imin(h, diag + a.window_right + 1);
  if (i >= si.q_len) h = l;  // padding row: nothing visible
  *lo = l;
  *hi = h;
}

}  // namespace
}  // namespace attn_fast

// ---- decode (DecodeArgs, csrc/kernels/decode.cpp): the same geometry over a
// KV cache's R slots per sequence. SeqInfo::k0 is then the ring slot of
// logical key 0 (kv_start[b]); q0 is 0 and q_rows is Lq.
namespace attn_fast {
namespace {

template <typename T>
inline SeqInfo seq_info(const DecodeArgs<T>& a, int64_t b) {
  SeqInfo si;
  si.b = b;
  si.q_rows = a.Lq;
  si.q_len = a.q_lens ? imax(0, imin(a.Lq, a.q_lens[b])) : a.Lq;
  si.k_len = a.kv_lens ? imax(0, imin(a.R, a.kv_lens[b])) : a.R;
  si.k0 = a.kv_start ? a.kv_start[b] : 0;
  si.off = a.top_left ? 0 : si.k_len - si.q_len;
  return si;
}

// row_range (above) serves DecodeArgs too.

}  // namespace
}  // namespace attn_fast
