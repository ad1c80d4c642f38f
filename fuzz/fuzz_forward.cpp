// libFuzzer harness for the C++ entry points: flash_forward and decode_forward
// (each ISA the CPU runs) against reference_forward, under AddressSanitizer +
// UBSan. The decode problems (run_decode) cover its slices of partials,
// split counts, rings and NaN rules.
//
// The input bytes decode into one small problem: dtype, ISA, shapes
// (B, Hq = Hkv * group, Lq, Lk, d, dv; zeros allowed where the API allows
// them), a strided layout per tensor (axis order, padding, negative length
// stride, zero-stride broadcast of k/v), every option of AttnArgs (causal with
// either alignment, windows, q_lens/kv_lens out of range on purpose, varlen
// cu_seqlens, block-sparse layout, dense mask, additive bias with -inf, ALiBi,
// softcap, sinks, tile sizes) and a few non-finite values in q and k.
// Checks: no sanitizer report, both kernels write every output element and
// nothing outside it (guard-poisoned buffers), and they agree (NaN where the
// other is NaN, -inf lse together, numbers within tolerance).
//
// Build and run: fuzz/run.sh [seconds]   (needs clang with libFuzzer)
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

#include "attn_fast/attention.h"

using namespace attn_fast;

namespace {

constexpr double kGuard = 12345.678;  // value of elements outside every output view

struct Tensor {
  std::vector<double> store;  // storage in double; cast per dtype below
  int64_t base = 0;           // element offset of [0,0,0,0]
  Strides4 s;
  int64_t n[4] = {0, 0, 0, 0};
};

// Lay out an (n0, n1, n2, n3) tensor: axis order from `perm`, `pad` extra
// elements on the innermost stored axis, optional negative length stride,
// optional zero strides on the axes in `bcast` (bit i = axis i).
Tensor make_tensor(FuzzedDataProvider& fdp, const int64_t n[4], bool allow_bcast) {
  Tensor t;
  for (int i = 0; i < 4; ++i) t.n[i] = n[i];
  static const int perms[6][4] = {{0, 1, 2, 3}, {0, 2, 1, 3}, {1, 0, 2, 3},
                                  {0, 1, 3, 2}, {3, 2, 1, 0}, {2, 0, 3, 1}};
  const int* perm = perms[fdp.ConsumeIntegralInRange<int>(0, 5)];
  const int64_t pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  const uint8_t bcast = allow_bcast ? fdp.ConsumeIntegral<uint8_t>() & 0x7 : 0;
  const bool neg = fdp.ConsumeBool();
  int64_t st[4] = {0, 0, 0, 0}, stride = 1;
  for (int k = 3; k >= 0; --k) {  // perm[3] innermost
    const int ax = perm[k];
    if (bcast & (1 << ax)) continue;
    st[ax] = stride;
    stride *= (n[ax] > 0 ? n[ax] : 1) + (k == 3 ? pad : 0);
  }
  t.store.assign(static_cast<size_t>(stride), 0.0);
  t.base = 0;
  if (neg && n[2] > 1 && st[2] != 0) {
    t.base = (n[2] - 1) * st[2];
    st[2] = -st[2];
  }
  t.s = {st[0], st[1], st[2], st[3]};
  return t;
}

inline int64_t off(const Tensor& t, int64_t b, int64_t h, int64_t l, int64_t e) {
  return t.base + b * t.s.b + h * t.s.h + l * t.s.l + e * t.s.d;
}

uint64_t g_rng = 1;
double unit() {  // xorshift64*, uniform in [-1, 1)
  g_rng ^= g_rng >> 12;
  g_rng ^= g_rng << 25;
  g_rng ^= g_rng >> 27;
  return double((g_rng * 2685821657736338717ULL) >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

void fill(Tensor& t) {
  for (int64_t b = 0; b < t.n[0]; ++b)
    for (int64_t h = 0; h < t.n[1]; ++h)
      for (int64_t l = 0; l < t.n[2]; ++l)
        for (int64_t e = 0; e < t.n[3]; ++e) t.store[off(t, b, h, l, e)] = 2 * unit();
}

template <typename T>
std::vector<T> cast(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

char g_problem[512];  // the decoded problem, printed with a finding

template <typename T>
void describe(const AttnArgs<T>& a, Isa isa) {
  std::snprintf(
      g_problem, sizeof g_problem,
      "%s isa=%s B=%lld Hq=%lld Hkv=%lld Lq=%lld Lk=%lld d=%lld dv=%lld causal=%d top_left=%d "
      "window=(%lld,%lld) lens=%d varlen=%d layout=%d(%lldx%lld) mask=%d bias=%d alibi=%d "
      "softcap=%g sinks=%d block=(%d,%d) threads=%d scale=%g",
      sizeof(T) == 4 ? "f32" : "f64", isa_name(isa), (long long)a.B, (long long)a.Hq,
      (long long)a.Hkv, (long long)a.Lq, (long long)a.Lk, (long long)a.d, (long long)a.dv, a.causal,
      a.top_left, (long long)a.window_left, (long long)a.window_right, a.q_lens != nullptr,
      a.cu_q != nullptr, a.layout != nullptr, (long long)a.layout_bq, (long long)a.layout_bk,
      a.mask != nullptr, a.bias != nullptr, a.alibi != nullptr, a.softcap, a.sinks != nullptr,
      a.block_q, a.block_k, a.num_threads, a.scale);
}

[[noreturn]] void fail(const char* what, int64_t i, double a, double b) {
  std::fprintf(stderr, "MISMATCH %s at %lld: kernel %.9g reference %.9g\n  %s\n", what,
               (long long)i, a, b, g_problem);
  std::abort();
}

// Both outputs (o1: the kernel under test, o2: the reference) element by
// element over o's view; everything outside the view must keep kGuard.
template <typename T>
void compare(const Tensor& o, const int64_t no[4], const std::vector<T>& o1,
             const std::vector<T>& o2, bool want_lse, const std::vector<T>& l1,
             const std::vector<T>& l2, int64_t n_lse) {
  // Compare every element of the output view; the rest must keep kGuard.
  const double rtol = sizeof(T) == 4 ? 2e-3 : 1e-9, atol = sizeof(T) == 4 ? 2e-4 : 1e-10;
  std::vector<uint8_t> in_view(o.store.size(), 0);
  for (int64_t b = 0; b < no[0]; ++b)
    for (int64_t h = 0; h < no[1]; ++h)
      for (int64_t l = 0; l < no[2]; ++l)
        for (int64_t e = 0; e < no[3]; ++e) in_view[off(o, b, h, l, e)] = 1;
  for (size_t i = 0; i < o.store.size(); ++i) {
    const double x = o1[i], y = o2[i];
    if (!in_view[i]) {
      if (x != T(kGuard) || y != T(kGuard)) fail("write outside out", int64_t(i), x, y);
      continue;
    }
    if (x == T(kGuard)) fail("element not written", int64_t(i), x, y);
    if (std::isnan(x) != std::isnan(y)) fail("NaN pattern", int64_t(i), x, y);
    if (std::isnan(x)) continue;
    if (std::isinf(x) || std::isinf(y)) {
      if (x != y) fail("inf", int64_t(i), x, y);
      continue;
    }
    if (std::fabs(x - y) > atol + rtol * std::fabs(y)) fail("out", int64_t(i), x, y);
  }
  if (want_lse)
    for (int64_t i = 0; i < n_lse; ++i) {
      const double x = l1[i], y = l2[i];
      if (std::isnan(x) != std::isnan(y)) fail("lse NaN pattern", i, x, y);
      if (std::isnan(x)) continue;
      if (std::isinf(x) || std::isinf(y)) {
        if (x != y) fail("lse inf", i, x, y);
        continue;
      }
      if (std::fabs(x - y) > atol + rtol * std::fabs(y)) fail("lse", i, x, y);
    }
}

template <typename T>
void run(FuzzedDataProvider& fdp) {
  AttnArgs<T> a;
  const int64_t Hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t group = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const bool varlen = fdp.ConsumeIntegralInRange<int>(0, 4) == 0;
  const int64_t nseq = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  a.Hkv = Hkv;
  a.Hq = Hkv * group;
  a.d = fdp.ConsumeIntegralInRange<int64_t>(1, 24);
  a.dv = fdp.ConsumeIntegralInRange<int64_t>(0, 24);
  std::vector<int64_t> cu_q(nseq + 1, 0), cu_k(nseq + 1, 0);
  if (varlen) {
    for (int64_t s = 0; s < nseq; ++s) {
      cu_q[s + 1] = cu_q[s] + fdp.ConsumeIntegralInRange<int64_t>(0, 20);
      cu_k[s + 1] = cu_k[s] + fdp.ConsumeIntegralInRange<int64_t>(0, 20);
    }
    a.B = nseq;
    a.Lq = cu_q[nseq];
    a.Lk = cu_k[nseq];
  } else {
    a.B = fdp.ConsumeIntegralInRange<int64_t>(0, 3);
    a.Lq = fdp.ConsumeIntegralInRange<int64_t>(0, 40);
    a.Lk = fdp.ConsumeIntegralInRange<int64_t>(0, 40);
  }
  const int64_t Bt = varlen ? 1 : a.B;  // batch entries in the tensors
  const int64_t nq[4] = {Bt, a.Hq, a.Lq, a.d}, nk[4] = {Bt, Hkv, a.Lk, a.d},
                nv[4] = {Bt, Hkv, a.Lk, a.dv}, no[4] = {Bt, a.Hq, a.Lq, a.dv};
  Tensor q = make_tensor(fdp, nq, true), k = make_tensor(fdp, nk, true),
         v = make_tensor(fdp, nv, true), o = make_tensor(fdp, no, false);
  g_rng = fdp.ConsumeIntegral<uint64_t>() | 1;
  fill(q);
  fill(k);
  fill(v);
  // A few non-finite values in q and k (masked or not).
  const int n_bad =
      fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? fdp.ConsumeIntegralInRange<int>(1, 3) : 0;
  for (int i = 0; i < n_bad; ++i) {
    Tensor& t = fdp.ConsumeBool() ? q : k;
    if (t.store.empty()) continue;
    const double bad[3] = {std::numeric_limits<double>::quiet_NaN(), HUGE_VAL, -HUGE_VAL};
    t.store[fdp.ConsumeIntegralInRange<size_t>(0, t.store.size() - 1)] =
        bad[fdp.ConsumeIntegralInRange<int>(0, 2)];
  }

  a.scale = fdp.ConsumeIntegralInRange<int>(-8, 8) / 8.0;
  a.causal = fdp.ConsumeBool();
  a.top_left = fdp.ConsumeBool();
  a.window_left = fdp.ConsumeIntegralInRange<int64_t>(-1, 45);
  a.window_right = fdp.ConsumeIntegralInRange<int64_t>(-1, 45);
  std::vector<int64_t> q_lens(a.B), kv_lens(a.B);
  if (!varlen && fdp.ConsumeBool()) {
    for (auto& x : q_lens) x = fdp.ConsumeIntegralInRange<int64_t>(-2, a.Lq + 2);
    for (auto& x : kv_lens) x = fdp.ConsumeIntegralInRange<int64_t>(-2, a.Lk + 2);
    a.q_lens = q_lens.data();
    a.kv_lens = kv_lens.data();
  }
  if (varlen) {
    a.cu_q = cu_q.data();
    a.cu_k = cu_k.data();
  }
  // Masks are indexed by (batch entry, head, local row, local key); for varlen
  // the local rows/keys of every sequence index the same (0, h) plane.
  const int64_t mq = varlen ? 20 : a.Lq, mk = varlen ? 20 : a.Lk;
  std::vector<uint8_t> layout, mask;
  std::vector<T> bias, alibi(a.Hq), sinks(a.Hq);
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
    a.layout_bq = fdp.ConsumeIntegralInRange<int64_t>(1, 16);
    a.layout_bk = fdp.ConsumeIntegralInRange<int64_t>(1, 16);
    a.layout_nq = (mq + a.layout_bq - 1) / a.layout_bq;
    a.layout_nk = (mk + a.layout_bk - 1) / a.layout_bk;
    layout.resize(static_cast<size_t>(Bt * a.Hq * a.layout_nq * a.layout_nk) + 1);
    for (auto& x : layout) x = unit() > -0.4;
    a.slayout = {a.Hq * a.layout_nq * a.layout_nk, a.layout_nq * a.layout_nk, a.layout_nk, 1};
    a.layout = layout.data();
  }
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
    mask.resize(static_cast<size_t>(Bt * a.Hq * mq * mk) + 1);
    for (auto& x : mask) x = unit() > -0.5;
    const bool bh = fdp.ConsumeBool();  // broadcast over batch and heads
    a.smask = {bh ? 0 : a.Hq * mq * mk, bh ? 0 : mq * mk, mk, 1};
    a.mask = mask.data();
  }
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
    bias.resize(static_cast<size_t>(Bt * a.Hq * mq * mk) + 1);
    for (auto& x : bias) x = unit() < -0.8 ? -std::numeric_limits<T>::infinity() : T(2 * unit());
    a.sbias = {a.Hq * mq * mk, mq * mk, mk, 1};
    a.bias = bias.data();
  }
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
    for (auto& x : alibi) x = T(0.25 * (unit() + 1));
    a.alibi = alibi.data();
  }
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) a.softcap = 0.5 + 10 * (unit() + 1);
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
    for (auto& x : sinks) x = T(3 * unit());
    a.sinks = sinks.data();
  }
  a.block_q = fdp.ConsumeIntegralInRange<int>(0, 70);
  a.block_k = fdp.ConsumeIntegralInRange<int>(0, 70);
  a.num_threads = fdp.ConsumeIntegralInRange<int>(1, 2);
  const std::vector<Isa> isas = available_isas();
  const Isa isa = isas[fdp.ConsumeIntegralInRange<size_t>(0, isas.size() - 1)];

  // Same inputs for both kernels; outputs poisoned with kGuard / NaN.
  std::vector<T> qs = cast<T>(q.store), ks = cast<T>(k.store), vs = cast<T>(v.store);
  a.q = qs.data() + q.base;
  a.k = ks.data() + k.base;
  a.v = vs.data() + v.base;
  a.sq = q.s;
  a.sk = k.s;
  a.sv = v.s;
  a.so = o.s;
  const int64_t n_lse = a.Hq * (varlen ? a.Lq : a.B * a.Lq);
  std::vector<T> o1(o.store.size(), T(kGuard)), o2(o.store.size(), T(kGuard));
  std::vector<T> l1(static_cast<size_t>(n_lse), T(kGuard)),
      l2(static_cast<size_t>(n_lse), T(kGuard));
  const bool want_lse = fdp.ConsumeBool();

  a.o = o1.data() + o.base;
  a.lse = want_lse ? l1.data() : nullptr;
  describe(a, isa);
  set_active_isa(isa);
  flash_forward(a);
  a.o = o2.data() + o.base;
  a.lse = want_lse ? l2.data() : nullptr;
  reference_forward(a);

  compare<T>(o, no, o1, o2, want_lse, l1, l2, n_lse);
}

// The split-KV decode kernel against the reference kernel: a ring of R slots
// per sequence (kv_start), q_lens / kv_lens out of range on purpose, causal
// with either alignment, windows, GQA, any split (1 gives thousands of items:
// several slices of the partial buffers), strided and broadcast q/k/v, and
// NaN / inf in q, k and NaN in v, at visible and masked positions. The
// reference reads the ring unrolled into logical key order.
template <typename T>
void run_decode(FuzzedDataProvider& fdp) {
  DecodeArgs<T> a;
  a.Hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  a.Hq = a.Hkv * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  a.B = fdp.ConsumeIntegralInRange<int64_t>(0, 3);
  a.Lq = fdp.ConsumeIntegralInRange<int64_t>(0, 12);
  a.R = fdp.ConsumeIntegralInRange<int64_t>(0, 300);
  a.d = fdp.ConsumeIntegralInRange<int64_t>(1, 24);
  a.dv = fdp.ConsumeIntegralInRange<int64_t>(0, 24);
  const int64_t nq[4] = {a.B, a.Hq, a.Lq, a.d}, nk[4] = {a.B, a.Hkv, a.R, a.d},
                nv[4] = {a.B, a.Hkv, a.R, a.dv}, no[4] = {a.B, a.Hq, a.Lq, a.dv};
  Tensor q = make_tensor(fdp, nq, true), k = make_tensor(fdp, nk, true),
         v = make_tensor(fdp, nv, true), o = make_tensor(fdp, no, false);
  g_rng = fdp.ConsumeIntegral<uint64_t>() | 1;
  fill(q);
  fill(k);
  fill(v);
  const int n_bad =
      fdp.ConsumeIntegralInRange<int>(0, 2) == 0 ? fdp.ConsumeIntegralInRange<int>(1, 4) : 0;
  for (int i = 0; i < n_bad; ++i) {
    const int which = fdp.ConsumeIntegralInRange<int>(0, 2);
    Tensor& t = which == 0 ? q : which == 1 ? k : v;
    if (t.store.empty()) continue;
    const double bad[3] = {std::numeric_limits<double>::quiet_NaN(), HUGE_VAL, -HUGE_VAL};
    // v gets NaN only: an inf value times a weight that underflows differs
    // between float32 and the reference's double (0 * inf), a documented corner.
    const int kind = which == 2 ? 0 : fdp.ConsumeIntegralInRange<int>(0, 2);
    t.store[fdp.ConsumeIntegralInRange<size_t>(0, t.store.size() - 1)] = bad[kind];
  }
  // |scores| <= 0.25 * 24 * 4: no weight of a visible key underflows in float32.
  a.scale = fdp.ConsumeIntegralInRange<int>(-8, 8) / 32.0;
  a.causal = fdp.ConsumeBool();
  a.top_left = fdp.ConsumeBool();
  a.window_left = fdp.ConsumeIntegralInRange<int64_t>(-1, 320);
  a.window_right = fdp.ConsumeIntegralInRange<int64_t>(-1, 320);
  std::vector<int64_t> q_lens(a.B), kv_lens(a.B), kv_start(a.B, 0);
  if (fdp.ConsumeBool()) {
    for (auto& x : q_lens) x = fdp.ConsumeIntegralInRange<int64_t>(-2, a.Lq + 2);
    for (auto& x : kv_lens) x = fdp.ConsumeIntegralInRange<int64_t>(-2, a.R + 2);
    a.q_lens = q_lens.data();
    a.kv_lens = kv_lens.data();
  }
  if (a.R > 0 && fdp.ConsumeBool()) {
    for (auto& x : kv_start) x = fdp.ConsumeIntegralInRange<int64_t>(0, a.R - 1);
    a.kv_start = kv_start.data();
  }
  a.split = fdp.ConsumeIntegralInRange<int64_t>(0, 3) == 0
                ? 1
                : fdp.ConsumeIntegralInRange<int64_t>(0, 320);
  if (a.split > a.R) a.split = a.R;  // as the binding does
  a.num_threads = fdp.ConsumeIntegralInRange<int>(1, 2);
  const std::vector<Isa> isas = available_isas();
  const Isa isa = isas[fdp.ConsumeIntegralInRange<size_t>(0, isas.size() - 1)];

  std::vector<T> qs = cast<T>(q.store), ks = cast<T>(k.store), vs = cast<T>(v.store);
  a.q = qs.data() + q.base;
  a.k = ks.data() + k.base;
  a.v = vs.data() + v.base;
  a.sq = q.s;
  a.sk = k.s;
  a.sv = v.s;
  a.so = o.s;
  // The reference's arguments: the same problem with the ring unrolled.
  AttnArgs<T> r;
  r.B = a.B;
  r.Hq = a.Hq;
  r.Hkv = a.Hkv;
  r.Lq = a.Lq;
  r.Lk = a.R;
  r.d = a.d;
  r.dv = a.dv;
  std::vector<T> kl(static_cast<size_t>(a.B * a.Hkv * a.R * a.d) + 1),
      vl(static_cast<size_t>(a.B * a.Hkv * a.R * a.dv) + 1);
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.Hkv; ++h)
      for (int64_t j = 0; j < a.R; ++j) {
        const int64_t slot = (kv_start[b] + j) % a.R;
        for (int64_t e = 0; e < a.d; ++e)
          kl[((b * a.Hkv + h) * a.R + j) * a.d + e] = ks[off(k, b, h, slot, e)];
        for (int64_t e = 0; e < a.dv; ++e)
          vl[((b * a.Hkv + h) * a.R + j) * a.dv + e] = vs[off(v, b, h, slot, e)];
      }
  r.q = a.q;
  r.sq = a.sq;
  r.k = kl.data();
  r.sk = {a.Hkv * a.R * a.d, a.R * a.d, a.d, 1};
  r.v = vl.data();
  r.sv = {a.Hkv * a.R * a.dv, a.R * a.dv, a.dv, 1};
  r.so = a.so;
  r.scale = a.scale;
  r.causal = a.causal;
  r.top_left = a.top_left;
  r.window_left = a.window_left;
  r.window_right = a.window_right;
  r.q_lens = a.q_lens;
  r.kv_lens = a.kv_lens;
  r.num_threads = 1;

  const int64_t n_lse = a.B * a.Hq * a.Lq;
  std::vector<T> o1(o.store.size(), T(kGuard)), o2(o.store.size(), T(kGuard));
  std::vector<T> l1(static_cast<size_t>(n_lse), T(kGuard)),
      l2(static_cast<size_t>(n_lse), T(kGuard));
  const bool want_lse = fdp.ConsumeBool();
  a.o = o1.data() + o.base;
  a.lse = want_lse ? l1.data() : nullptr;
  r.o = o2.data() + o.base;
  r.lse = want_lse ? l2.data() : nullptr;
  std::snprintf(g_problem, sizeof g_problem,
                "decode %s isa=%s B=%lld Hq=%lld Hkv=%lld Lq=%lld R=%lld d=%lld dv=%lld causal=%d "
                "top_left=%d "
                "window=(%lld,%lld) lens=%d ring=%d split=%lld threads=%d scale=%g",
                sizeof(T) == 4 ? "f32" : "f64", isa_name(isa), (long long)a.B, (long long)a.Hq,
                (long long)a.Hkv, (long long)a.Lq, (long long)a.R, (long long)a.d, (long long)a.dv,
                a.causal, a.top_left, (long long)a.window_left, (long long)a.window_right,
                a.q_lens != nullptr, a.kv_start != nullptr, (long long)a.split, a.num_threads,
                a.scale);
  set_active_isa(isa);
  decode_forward(a);
  reference_forward(r);
  compare<T>(o, no, o1, o2, want_lse, l1, l2, n_lse);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  // Bit 0: float32 (1) or float64 (0), as the first byte always meant (old
  // inputs replay unchanged when bit 1 is clear); bit 1: the decode kernel.
  const int entry = fdp.ConsumeIntegralInRange<int>(0, 3);
  const bool f32 = entry & 1;
  if (entry & 2)
    f32 ? run_decode<float>(fdp) : run_decode<double>(fdp);
  else
    f32 ? run<float>(fdp) : run<double>(fdp);
  return 0;
}
