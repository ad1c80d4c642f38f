// The decode kernel's two inner loops alone (csrc/kernels/decode.cpp: qk_rows,
// pv_rows; 4 query rows, d = dv = 128, 64-key blocks, the prefetch walk empty),
// in core cycles per key and kv head, for fp32, bf16 and int8 K/V rows in L1
// (one block) and in L2 (NB blocks, 8 or 16 KiB each per K and V). The clock
// comes from a chain of dependent adds (one per cycle) timed against the same
// TSC. Against the FMA floor (4 rows x d / W FMAs per key in each loop; one
// 512-bit FMA per cycle on Zen 4, two on Zen 5 / Sapphire Rapids, two 256-bit
// on Zen 3) it tells how much of a compute-bound decode step (int8) the loops
// themselves take, and how much the rest (bench/notes_archive.md, zen4 step 2).
//
//   AVX-512: g++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c
//     -std=c++17 -DATTN_ISA_AVX512 -I. -Icsrc/include -Icsrc/kernels
//     bench/micro/decode_loops.cpp csrc/interrupt.cpp -o /tmp/dl && /tmp/dl   (one line)
//   AVX2: the same with -O3 -mavx2 -mfma -mf16c and without -DATTN_ISA_AVX512.
#if !defined(ATTN_ISA_AVX512)
#define ATTN_ISA_AVX2 1
#endif
#include "csrc/kernels/decode.cpp"

#include <x86intrin.h>

#include "cycles.h"  // cycles_per_tick

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

using namespace attn_fast;
using namespace ATTN_NS;

constexpr int64_t kD = 128, kCols = 64, kMaxBlocks = 64;

// Cycles per key (4 rows) of QK (which & 1) and / or P V (which & 2) over nb
// blocks in turn; the best of 200 rounds of 128 blocks.
template <typename KV>
double cycles(int which, int nb, double cpt) {
  alignas(64) static float Qs[4 * kD], S[4 * kCols], P[4 * kCols], O[4 * kD];
  alignas(64) static KV K[kMaxBlocks * kCols * kD], V[kMaxBlocks * kCols * kD];
  static const KV* kp[kMaxBlocks * kCols];
  static const KV* vp[kMaxBlocks * kCols];
  std::memset(K, 0x3c, sizeof K);  // small finite values in every type
  std::memset(V, 0x3c, sizeof V);
  for (int i = 0; i < 4 * kD; ++i) Qs[i] = 0.001f * i, O[i] = 0;
  for (int i = 0; i < 4 * kCols; ++i) P[i] = 1e-6f;
  for (int64_t c = 0; c < kMaxBlocks * kCols; ++c) kp[c] = K + c * kD, vp[c] = V + c * kD;
  Pf pf{};  // empty walk: pf_step checks and returns
  pf.per = 1;
  double best = 1e30;
  for (int r = 0; r < 200; ++r) {
    const unsigned long t0 = __rdtsc();
    for (int it = 0; it < 128; ++it) {
      const int64_t b = (it % nb) * kCols;
      if (which & 1) qk_rows<float, KV, 4, 4>(Qs, kD, kp + b, kCols, kD, S, kCols, &pf);
      if (which & 2) pv_rows<float, KV, 4, 4>(P, kCols, vp + b, kCols, kD, O, kD, &pf);
    }
    best = std::min(best, double(__rdtsc() - t0) / (128.0 * kCols));
  }
  if (O[0] == 12345.f) std::printf(" ");  // keep the results live
  return best * cpt;
}

template <typename KV>
void row(const char* name, double cpt) {
  for (int nb : {1, 16, static_cast<int>(kMaxBlocks)})
    std::printf("%-5s %2d block(s): QK %5.1f  P V %5.1f  both %5.1f cycles per key\n", name, nb,
                cycles<KV>(1, nb, cpt), cycles<KV>(2, nb, cpt), cycles<KV>(3, nb, cpt));
}

int main() {
  const double cpt = cycles_per_tick();
  const int W = Vec<float>::W;
  std::printf("%d-lane vectors; core clock / TSC %.3f; FMA instructions per key: %d per loop\n", W,
              cpt, static_cast<int>(4 * kD / W));
  row<float>("fp32", cpt);
  row<bf16_t>("bf16", cpt);
  row<int8_t>("int8", cpt);
}
