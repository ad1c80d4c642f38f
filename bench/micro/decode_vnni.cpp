// A measurement, not a kernel: what an exact AVX-512-VNNI int8 decode step
// would cost on this CPU (issue #20's int8 >= 3x target; bench/notes_archive.md,
// zen4 step 5). Standalone intrinsics, no library code.
//
// The layout it assumes (not the cache's today): key codes in 16-slot column
// tiles, byte ((s / 16) * d/4 + c / 4) * 64 + (s % 16) * 4 + c % 4, so that one
// 64-byte load holds 4 channels of 16 keys and QK needs no horizontal sums;
// value codes interleaved by 4 tokens, byte ((s / 4) * dv + c) * 4 + s % 4, so
// that one load holds 16 channels of 4 tokens. Codes as unsigned bytes (the
// first operand of vpdpbusd), the other operand signed bytes.
// Exactness: attn_fast promises fp32 rounding against the dequantised K/V, so
// the fp32 side (q with the key group's scales folded in, per 64-key group;
// p * value scale, per block) becomes 24-bit block fixed point per row, split
// into 3 balanced base-256 digits (3 vpdpbusd per 64 MACs and row; 2 digits
// would leave errors near 2^-16 of the row's largest element).
// 4 query rows (GQA 32/8, one token), d = dv = 128, 64-key blocks, the K / V
// of NB blocks in L2, one thread; core cycles per key and kv head as
// bench/micro/decode_loops.cpp counts them (its int8 rows: QK 42, P V 36 on
// Zen 4). DIGITS=0 in the environment leaves out the digit splits (the loops'
// floor). The check compares every S and O against a double-precision sum.
//
//   g++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -std=c++17
//     bench/micro/decode_vnni.cpp -o /tmp/dv && /tmp/dv   (one line)
#include <immintrin.h>
#include <x86intrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "cycles.h"  // cycles_per_tick

namespace {

constexpr int kD = 128, kD4 = kD / 4, kBc = 64, kNB = 32, kRows = 4;
// Largest fixed-point magnitude: 0x7F7F00, so that x + 0x808080 stays in 24 bits
// even if the product rounds one unit up.
constexpr float kFix = 8355584.0f;

alignas(64) uint8_t K[kNB * kBc * kD], Vt[kNB * kBc * kD];
alignas(64) float Qg[kRows * kD], S[kRows * kBc], P[kRows * kBc], O[kRows * kD], VS[kNB * kBc];
alignas(64) int8_t Qd[3][kRows][kD], Pd[3][kRows][kBc];
float qsc[kRows], psc[kRows];
int32_t qsum[kRows], psum[kRows];
bool digits_on = true;

// GCC 12 turns the vpdpbusd intrinsic in these loops into register copies and
// stack stores each iteration (2.2x the cycles of P V); the instruction itself,
// with the signed operand broadcast from memory:
inline __attribute__((always_inline)) void dp(__m512i& acc, __m512i u8, const void* s8x4) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u8), "m"(*(const int32_t*)s8x4));
}
// vpmovdb with a memory destination is slow on Zen 4; GCC folds the store in.
inline __attribute__((always_inline)) __m128i pmovdb(__m512i x) {
  __m128i r;
  __asm__("vpmovdb %1, %0" : "=v"(r) : "v"(x));
  return r;
}

// n floats (n % 16 == 0) as x = round(v * kFix / max|v|) = 65536 a2 + 256 a1 + a0,
// a_i in [-128, 127]: the bytes of x + 0x808080 are a_i + 128, so those of
// (x + 0x808080) ^ 0x808080 are the a_i as signed bytes. sc: the value of one
// unit, sum: the sum of x (for the -128 of unsigned codes).
void digits(const float* v, int n, int8_t* d0, int8_t* d1, int8_t* d2, float* sc, int32_t* sum) {
  __m512 mx = _mm512_setzero_ps();
  for (int e = 0; e < n; e += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(v + e)));
  const float m = _mm512_reduce_max_ps(mx);
  const __m512 f = _mm512_set1_ps(m > 0 ? kFix / m : 0.0f);
  *sc = m > 0 ? m / kFix : 0.0f;
  const __m512i bias = _mm512_set1_epi32(0x808080);
  __m512i s = _mm512_setzero_si512();
  for (int e = 0; e < n; e += 16) {
    const __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + e), f));
    s = _mm512_add_epi32(s, x);
    const __m512i z = _mm512_xor_si512(_mm512_add_epi32(x, bias), bias);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d0 + e), pmovdb(z));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d1 + e), pmovdb(_mm512_srli_epi32(z, 8)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d2 + e), pmovdb(_mm512_srli_epi32(z, 16)));
  }
  *sum = _mm512_reduce_add_epi32(s);
}

// S[r][c] = Qg[r] . (K_c - 128) for the 64 keys of one block (4 tiles).
__attribute__((noinline)) void qk_block(const uint8_t* kt) {
  if (digits_on)
    for (int r = 0; r < kRows; ++r)
      digits(Qg + r * kD, kD, Qd[0][r], Qd[1][r], Qd[2][r], &qsc[r], &qsum[r]);
  for (int t = 0; t < kBc / 16; ++t) {
    const uint8_t* tile = kt + t * kD4 * 64;
    __m512i acc[kRows][3];
    for (int r = 0; r < kRows; ++r)
      for (int g = 0; g < 3; ++g) acc[r][g] = _mm512_setzero_si512();
    for (int c4 = 0; c4 < kD4; ++c4) {
      const __m512i kv = _mm512_load_si512(tile + c4 * 64);
      for (int r = 0; r < kRows; ++r)
        for (int g = 0; g < 3; ++g) dp(acc[r][g], kv, &Qd[g][r][c4 * 4]);
    }
    for (int r = 0; r < kRows; ++r) {
      __m512 s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][2]), _mm512_set1_ps(65536.f * qsc[r]),
                                 _mm512_set1_ps(-128.f * qsum[r] * qsc[r]));
      s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_set1_ps(256.f * qsc[r]), s);
      s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_set1_ps(qsc[r]), s);
      _mm512_store_ps(S + r * kBc + t * 16, s);
    }
  }
}

// O[r] += sum_c P[r][c] vs[c] (V_c - 128) for the 64 keys of one block.
__attribute__((noinline)) void pv_block(const uint8_t* vt, const float* vs) {
  if (digits_on)
    for (int r = 0; r < kRows; ++r) {
      alignas(64) float pp[kBc];
      for (int c = 0; c < kBc; c += 16)
        _mm512_store_ps(pp + c,
                        _mm512_mul_ps(_mm512_load_ps(P + r * kBc + c), _mm512_loadu_ps(vs + c)));
      digits(pp, kBc, Pd[0][r], Pd[1][r], Pd[2][r], &psc[r], &psum[r]);
    }
  for (int ch = 0; ch < kD; ch += 32) {  // 2 x 16 channels: 24 accumulators
    __m512i acc[kRows][3][2];
    for (int r = 0; r < kRows; ++r)
      for (int g = 0; g < 3; ++g) acc[r][g][0] = acc[r][g][1] = _mm512_setzero_si512();
    for (int tq = 0; tq < kBc / 4; ++tq) {
      const __m512i v0 = _mm512_load_si512(vt + (tq * kD + ch) * 4);
      const __m512i v1 = _mm512_load_si512(vt + (tq * kD + ch + 16) * 4);
      for (int r = 0; r < kRows; ++r)
        for (int g = 0; g < 3; ++g) {
          dp(acc[r][g][0], v0, &Pd[g][r][tq * 4]);
          dp(acc[r][g][1], v1, &Pd[g][r][tq * 4]);
        }
    }
    for (int r = 0; r < kRows; ++r)
      for (int h = 0; h < 2; ++h) {
        float* o = O + r * kD + ch + h * 16;
        __m512 s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][2][h]),
                                   _mm512_set1_ps(65536.f * psc[r]), _mm512_load_ps(o));
        s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1][h]), _mm512_set1_ps(256.f * psc[r]), s);
        s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0][h]), _mm512_set1_ps(psc[r]), s);
        _mm512_store_ps(o, _mm512_add_ps(s, _mm512_set1_ps(-128.f * psum[r] * psc[r])));
      }
  }
}

// Largest |S - exact| and |O - exact| over block 0, relative to the largest
// |term| sum (the scale of an fp32 dot product's rounding error).
void check() {
  digits_on = true;
  for (int i = 0; i < kRows * kD; ++i) O[i] = 0;
  qk_block(K);
  pv_block(Vt, VS);
  double es = 0, eo = 0;
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kBc; ++c) {
      double x = 0, mag = 0;
      for (int e = 0; e < kD; ++e) {
        const double t = double(Qg[r * kD + e]) *
                         (int(K[(c / 16 * kD4 + e / 4) * 64 + c % 16 * 4 + e % 4]) - 128);
        x += t, mag += std::fabs(t);
      }
      es = std::max(es, std::fabs(S[r * kBc + c] - x) / mag);
    }
  for (int r = 0; r < kRows; ++r)
    for (int e = 0; e < kD; ++e) {
      double x = 0, mag = 0;
      for (int c = 0; c < kBc; ++c) {
        const double t =
            double(P[r * kBc + c]) * VS[c] * (int(Vt[(c / 4 * kD + e) * 4 + c % 4]) - 128);
        x += t, mag += std::fabs(t);
      }
      eo = std::max(eo, std::fabs(O[r * kD + e] - x) / mag);
    }
  std::printf("check: max |error| / sum |terms|: S %.2e, O %.2e (fp32 unit roundoff 6.0e-08)\n", es,
              eo);
}

}  // namespace

int main() {
  const double cpt = cycles_per_tick(3, 100000000);
  uint32_t st = 12345;  // fresh pseudo-random codes, q, p and scales
  auto rnd = [&st] { return (st = st * 1664525u + 1013904223u) >> 8; };
  for (auto& x : K) x = rnd() & 255;
  for (auto& x : Vt) x = rnd() & 255;
  for (auto& x : Qg) x = float(int(rnd() % 20001) - 10000) * 1e-4f;
  for (auto& x : P) x = float(rnd() % 10001) * 1e-4f;
  for (auto& x : VS) x = 0.01f + float(rnd() % 1000) * 1e-5f;
  check();
  digits_on = std::getenv("DIGITS") == nullptr || std::getenv("DIGITS")[0] != '0';
  for (int which = 1; which <= 3; ++which) {
    double best = 1e30;
    for (int rep = 0; rep < 200; ++rep) {
      const unsigned long t0 = __rdtsc();
      for (int b = 0; b < kNB; ++b) {
        if (which & 1) qk_block(K + b * kBc * kD);
        if (which & 2) pv_block(Vt + b * kBc * kD, VS + b * kBc);
      }
      best = std::min(best, double(__rdtsc() - t0));
    }
    std::printf("%-4s %5.1f cycles per key (4 rows, d = dv = %d%s)\n",
                which == 1   ? "QK"
                : which == 2 ? "PV"
                             : "both",
                best * cpt / (kNB * kBc), kD, digits_on ? "" : ", no digit splits");
  }
  return 0;
}
