// int8 KV cache: quantise an appended chunk (KVCache(dtype="int8")).
//
// Shapes: k (B, Hkv, L, d), v (B, Hkv, L, dv) float32 chunks; the cache holds
//   k8 (B, Hkv, R, d), v8 (B, Hkv, R, dv) int8 codes with key scales and
//   offsets per channel and group of G slots, (B, Hkv, R / G, d), and value
//   scales and offsets per slot, (B, Hkv, R). Position p lives in slot p mod R.
//
// Why keys per channel and values per token: key outliers sit in a few
//   channels (KIVI, KVQuant), so a per-token key scale wastes the 8 bits of
//   every other channel; values have no such structure and are consumed per
//   token (P V), so a per-token scale folds into the weight P. A key group is
//   G = 64 slots, the decode kernel's key block: one block reads one group's
//   2 x d scale floats (1/8 byte per key element more at d = 128) and folds
//   them into Q once per block.
// Asymmetric codes (x = q * scale + off over [min, max]) use the full 8 bits
//   for channels whose values are not centred at 0 (key channels rarely are);
//   the offset costs one dot product per block and row in the kernel (Q . off
//   for keys, P . off for values). On Gaussian keys with per-channel offsets
//   (bench/NOTES.md) it halved the key error of symmetric codes.
// The open group: a group's channel range is known only once it is full, so
//   the float32 keys of the group being filled are kept in `stage` and the
//   group is requantised from them at the end of each append (and when it
//   fills). Attention therefore always sees the dequantised keys, the newest
//   ones included; once a group closes its stage row is reused.
//
// Plain loops compiled at the baseline ISA: an append quantises L x (d + dv)
// values per kv head, negligible next to the decode that reads the cache.

#include <cmath>
#include <cstdint>
#include <stdexcept>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attn_fast/attention.h"

namespace attn_fast {
namespace {

// Codes q of n values x[e * inc] with one scale and offset.
inline void quant_row(const float* x, int64_t inc, int64_t n, int8_t* q, float* scale, float* off) {
  float mn = x[0], mx = x[0];
  for (int64_t e = 1; e < n; ++e) {
    mn = x[e * inc] < mn ? x[e * inc] : mn;
    mx = x[e * inc] > mx ? x[e * inc] : mx;
  }
  const float s = (mx - mn) / 255.0f, m = mn + 128.0f * s;
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  for (int64_t e = 0; e < n; ++e) {
    float c = std::nearbyint((x[e * inc] - m) * inv);
    c = c < -128.0f ? -128.0f : (c > 127.0f ? 127.0f : c);
    q[e] = static_cast<int8_t>(c);
  }
  *scale = s;
  *off = m;
}

// The latest position < pos stored in slot `slot` (mod R), or -1.
inline int64_t latest_in_slot(int64_t slot, int64_t pos, int64_t R) {
  if (pos - 1 < slot) return -1;
  return slot + (pos - 1 - slot) / R * R;
}

struct Head {
  const KvQuantArgs& a;
  int64_t b, h;
  int8_t* k8() const { return a.k8 + (b * a.Hkv + h) * a.R * a.d; }
  float* ks() const { return a.k_scale + (b * a.Hkv + h) * (a.R / a.G) * a.d; }
  float* ko() const { return a.k_off + (b * a.Hkv + h) * (a.R / a.G) * a.d; }
  float* stage() const { return a.stage + (b * a.Hkv + h) * a.G * a.d; }
};

// Stage rows of absolute group g that hold a valid key of another group than
// `held` (what stage held): filled from their codes. pos: positions < pos are
// written, first: the oldest stored one.
void refill(const Head& hd, int64_t g, int64_t held, int64_t pos, int64_t first) {
  const KvQuantArgs& a = hd.a;
  const int64_t G = a.G, d = a.d, slot0 = (g * G) % a.R, gs = slot0 / G;
  for (int64_t w = 0; w < G; ++w) {
    const int64_t p = latest_in_slot(slot0 + w, pos, a.R);
    if (p < first || p / G == held) continue;
    const int8_t* q = hd.k8() + (slot0 + w) * d;
    const float* s = hd.ks() + gs * d;
    const float* o = hd.ko() + gs * d;
    float* dst = hd.stage() + w * d;
    for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<float>(q[e]) * s[e] + o[e];
  }
}

// Requantise the slot group of absolute group g from stage over its valid
// rows (positions in [first, pos)).
void requant(const Head& hd, int64_t g, int64_t pos, int64_t first) {
  const KvQuantArgs& a = hd.a;
  const int64_t G = a.G, d = a.d, slot0 = (g * G) % a.R, gs = slot0 / G;
  bool valid[512];  // G <= 512 (checked by the binding)
  bool any = false;
  for (int64_t w = 0; w < G; ++w) {
    const int64_t p = latest_in_slot(slot0 + w, pos, a.R);
    valid[w] = p >= first;
    any = any || valid[w];
  }
  if (!any) return;
  const float* st = hd.stage();
  float* ks = hd.ks() + gs * d;
  float* ko = hd.ko() + gs * d;
  int8_t* q = hd.k8() + slot0 * d;
  for (int64_t e = 0; e < d; ++e) {
    float mn = INFINITY, mx = -INFINITY;
    for (int64_t w = 0; w < G; ++w)
      if (valid[w]) {
        const float x = st[w * d + e];
        mn = x < mn ? x : mn;
        mx = x > mx ? x : mx;
      }
    const float s = (mx - mn) / 255.0f, m = mn + 128.0f * s;
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (int64_t w = 0; w < G; ++w) {
      if (!valid[w]) continue;
      float c = std::nearbyint((st[w * d + e] - m) * inv);
      c = c < -128.0f ? -128.0f : (c > 127.0f ? 127.0f : c);
      q[w * d + e] = static_cast<int8_t>(c);
    }
    ks[e] = s;
    ko[e] = m;
  }
}

}  // namespace

void kv_quant_append(const KvQuantArgs& a) {
  // Finite inputs only (an int8 code has no inf / NaN): checked before anything is written.
  bool finite = true;
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.Hkv; ++h)
      for (int64_t t = 0; t < a.count[b]; ++t) {
        const float* kr = a.k + b * a.sk.b + h * a.sk.h + t * a.sk.l;
        const float* vr = a.v + b * a.sv.b + h * a.sv.h + t * a.sv.l;
        for (int64_t e = 0; e < a.d; ++e) finite = finite && std::isfinite(kr[e * a.sk.d]);
        for (int64_t e = 0; e < a.dv; ++e) finite = finite && std::isfinite(vr[e * a.sv.d]);
      }
  if (!finite) throw std::invalid_argument("inf or NaN");
  const int64_t n_heads = a.B * a.Hkv;
  [[maybe_unused]] int nt = a.num_threads > 0 ? a.num_threads : 1;  // OpenMP builds only
  double work = 0;
  for (int64_t b = 0; b < a.B; ++b) work += static_cast<double>(a.count[b]) * a.Hkv * a.G * a.d;
  if (work < kSerialWork) nt = 1;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t x = 0; x < n_heads; ++x) {
    const int64_t b = x / a.Hkv, h = x % a.Hkv, n = a.count[b];
    if (n <= 0) continue;
    const Head hd{a, b, h};
    const int64_t G = a.G, d = a.d, dv = a.dv, p0 = a.pos0[b];
    int64_t held = a.stage_grp[b];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t p = p0 + t, slot = p % a.R, w = p % G, g = p / G;
      if (g != held) {  // a new (or reopened) group: its other keys from their codes
        refill(hd, g, held, p, a.first_before[b]);
        held = g;
      }
      const float* kr = a.k + b * a.sk.b + h * a.sk.h + t * a.sk.l;
      float* st = hd.stage() + w * d;
      for (int64_t e = 0; e < d; ++e) st[e] = kr[e * a.sk.d];
      if (w == G - 1 || t == n - 1) requant(hd, g, p + 1, a.first_after[b]);
      // Values: per token.
      const float* vr = a.v + b * a.sv.b + h * a.sv.h + t * a.sv.l;
      const int64_t bh = b * a.Hkv + h;
      quant_row(vr, a.sv.d, dv, a.v8 + (bh * a.R + slot) * dv, a.v_scale + bh * a.R + slot,
                a.v_off + bh * a.R + slot);
    }
  }
  for (int64_t b = 0; b < a.B; ++b)
    if (a.count[b] > 0) a.stage_grp[b] = (a.pos0[b] + a.count[b] - 1) / a.G;
}

}  // namespace attn_fast
