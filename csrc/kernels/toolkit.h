// The kernel toolkit: what the fused forward, the backward and the decode
// kernel share beyond the index helpers of attn_fast/seq.h (imin, imax,
// round_up, alloc_scratch, SeqInfo, seq_info, row_range).
//
//   NEG_INF<T>                 -inf in the compute type
//   online_softmax_row<T, C>   one row's step of the online softmax
//   ThreadArena                one thread's scratch: one aligned allocation,
//                              carved, checked, reused across calls
//
// Included by each per-ISA kernel source inside its ISA namespace and its
// anonymous namespace, after <cmath>, <cstdlib>, <limits>, attn_fast/seq.h
// and ATTN_VEC_HEADER (it uses Vec<T>), like storage.h and scores.h: each ISA
// object has its own copy, and its own thread-local arena slot.
#pragma once

template <typename T>
constexpr T NEG_INF = -std::numeric_limits<T>::infinity();

// online_softmax_row's two ends, shared with the fused forward's variant
// (flash_fwd.cpp softmax_row_fused), so both round alike.
// A row whose max is still -inf (nothing visible so far, or only NaN): P = 0
// over [0, cols_p), and m = l = NaN if a score in [0, cols) is NaN.
template <typename T>
inline void softmax_row_none_visible(T* s, int64_t cols, int64_t cols_p, T& m, T& l) {
  bool nan = false;
  for (int64_t c = 0; c < cols; ++c) nan = nan || s[c] != s[c];
  if (nan) m = l = std::numeric_limits<T>::quiet_NaN();
  for (int64_t c = 0; c < cols_p; ++c) s[c] = T(0);
}
// l := l * exp(m_old - m_new) + rowsum, o := o * exp(m_old - m_new) (skipped
// when the max did not move), m := m_new.
template <typename T>
inline void softmax_row_rescale(T m_old, T m_new, T rowsum, T& m, T& l, T* o, int64_t dvp) {
  using V = Vec<T>;
  if (m_new != m_old) {
    const T alpha = m_old == NEG_INF<T> ? T(0) : std::exp(m_old - m_new);
    l = l * alpha + rowsum;
    const typename V::R va = V::set1(alpha);
    for (int64_t e = 0; e < dvp; e += V::W) V::store(o + e, V::mul(V::load(o + e), va));
  } else {
    l += rowsum;
  }
  m = m_new;
}

// One row of the online softmax (FlashAttention-2), for one block of keys:
//   m_new = max(m, rowmax(s)); s := P = 2^((s - m_new) log2 e) (exp2_neg);
//   l := l * exp(m - m_new) + rowsum(P); o := o * exp(m - m_new) (skipped
//   when the max did not move); m := m_new.
// s[0, cols_p): the row's scores, the columns [cols, cols_p) already -inf;
//   cols_p a multiple of W (Vec<T>::W). o[0, dvp): the row's unnormalised
//   output, dvp a multiple of W.
// A row that has seen nothing but -inf so far keeps m = -inf, l = 0 and gets
//   P = 0 over [0, cols_p); if a score in [0, cols) is NaN (max() drops NaN,
//   so it is looked for here) the row becomes NaN: m = l = NaN.
// kChains: independent accumulator chains for the max and the sum (1 or 2;
//   with 2, cols_p pairs of W are taken first). The order of the sum, and so
//   the bits of P's sum, depend on it: the fused forward uses 2 (its cols_p is
//   a multiple of 2W whenever kNR >= 2), the decode kernel 1.
template <typename T, int kChains>
inline void online_softmax_row(T* s, int64_t cols, int64_t cols_p, T& m, T& l, T* o, int64_t dvp) {
  static_assert(kChains == 1 || kChains == 2, "one or two chains");
  using V = Vec<T>;
  constexpr int W = V::W;
  typename V::R vm = V::set1(NEG_INF<T>), vm1 = vm;
  int64_t j = 0;
  if constexpr (kChains == 2) {
    for (; j + 2 * W <= cols_p; j += 2 * W) {
      vm = V::max(vm, V::load(s + j));
      vm1 = V::max(vm1, V::load(s + j + W));
    }
  }
  for (; j < cols_p; j += W) vm = V::max(vm, V::load(s + j));
  const T mx = kChains == 2 ? V::hmax(V::max(vm, vm1)) : V::hmax(vm);
  const T m_old = m;
  const T m_new = mx > m_old ? mx : m_old;  // a NaN m_old stays (NaN row)
  if (m_new == NEG_INF<T>) {                // nothing visible in this row so far, or only NaN
    softmax_row_none_visible(s, cols, cols_p, m, l);
    return;
  }
  // P = 2^((S - m) * log2 e): the same rounding as exp(S - m), cheaper; the
  // argument is <= 0 (or NaN), see exp2_neg.
  const typename V::R vmn = V::set1(m_new);
  const typename V::R vl2e = V::set1(static_cast<T>(1.44269504088896340736));
  typename V::R vs = V::zero(), vs1 = V::zero();
  j = 0;
  if constexpr (kChains == 2) {
    for (; j + 2 * W <= cols_p; j += 2 * W) {
      const typename V::R p = V::exp2_neg(V::mul(V::sub(V::load(s + j), vmn), vl2e));
      const typename V::R p1 = V::exp2_neg(V::mul(V::sub(V::load(s + j + W), vmn), vl2e));
      V::store(s + j, p);
      V::store(s + j + W, p1);
      vs = V::add(vs, p);
      vs1 = V::add(vs1, p1);
    }
  }
  for (; j < cols_p; j += W) {
    const typename V::R p = V::exp2_neg(V::mul(V::sub(V::load(s + j), vmn), vl2e));
    V::store(s + j, p);
    vs = V::add(vs, p);
  }
  const T rowsum = kChains == 2 ? V::hsum(V::add(vs, vs1)) : V::hsum(vs);
  softmax_row_rescale(m_old, m_new, rowsum, m, l, o, dvp);
}

// One thread's scratch for one kernel call: the pieces are planned first
// (plan<T>(n) returns each one's offset, 64-byte aligned), then acquire()
// provides one 64-byte aligned block of their total size and at<T>(offset)
// the pieces. The block is kept in a thread-local slot between calls (freed
// when the thread ends) and reused by the next call that fits in it; a block
// above kKeepBytes is freed when the arena goes out of scope instead, so a
// long-sequence call does not pin its K/V cache. acquire() returns false when
// the size overflows or the allocation fails: the caller computes nothing and
// the call throws std::bad_alloc (MemoryError) after its parallel region.
// Contents are not initialised (reused blocks hold the previous call's data).
class ThreadArena {
 public:
  static constexpr int64_t kKeepBytes = int64_t(4) << 20;

  ThreadArena() = default;
  ThreadArena(const ThreadArena&) = delete;
  ThreadArena& operator=(const ThreadArena&) = delete;
  ~ThreadArena() { release(); }

  template <typename T>
  int64_t plan(int64_t n) {
    const int64_t off = bytes_;
    constexpr int64_t kMax = (int64_t(1) << 60) / static_cast<int64_t>(sizeof(T));
    if (n < 0 || n > kMax || bytes_ > (int64_t(1) << 61)) {
      overflow_ = true;
      return 0;
    }
    bytes_ += round_up(imax(n, 1) * static_cast<int64_t>(sizeof(T)), 64);
    return off;
  }

  bool acquire() {
    if (overflow_) return false;
    Slot& s = slot();
    if (!s.busy && s.ptr && s.cap >= bytes_) {
      s.busy = true;
      base_ = s.ptr;
      owned_ = false;
      return true;
    }
    base_ = std::aligned_alloc(64, static_cast<size_t>(imax(bytes_, 64)));
    if (!base_) return false;
    if (!s.busy && bytes_ <= kKeepBytes) {  // becomes the thread's block
      std::free(s.ptr);
      s.ptr = base_;
      s.cap = bytes_;
      s.busy = true;
      owned_ = false;
    } else {
      owned_ = true;
    }
    return true;
  }

  template <typename T>
  T* at(int64_t off) const {
    return reinterpret_cast<T*>(static_cast<char*>(base_) + off);
  }

 private:
  struct Slot {
    void* ptr = nullptr;
    int64_t cap = 0;
    bool busy = false;  // an arena of this thread holds it (a nested call allocates its own)
    ~Slot() { std::free(ptr); }
  };
  static Slot& slot() {
    thread_local Slot s;
    return s;
  }
  void release() {
    if (!base_) return;
    if (owned_)
      std::free(base_);
    else
      slot().busy = false;
    base_ = nullptr;
  }

  int64_t bytes_ = 0;
  bool overflow_ = false;
  void* base_ = nullptr;
  bool owned_ = false;
};
