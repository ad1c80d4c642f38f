// Paired A/B of two tilings (block_q, block_k) of the prefill kernel, one
// thread: the two run alternately, and the median of the per-pair time
// ratios is reported with its quartiles. On a shared machine whose speed
// drifts from one second to the next, pairing is what makes a 2 % change
// visible (bench/NOTES.md). The same loop compared two versions of
// flash_fwd.cpp by compiling each into its own namespace (sed the ATTN_NS
// define and the vec header's include guard).
//
//   g++ -O3 -mavx2 -mfma -std=c++17 -Icsrc/include -Icsrc/kernels \
//       bench/micro/tiles_ab.cpp -o /tmp/ab && /tmp/ab 2048 64 0 12 48 128 48 256
//   args: L d causal pairs  bqA bkA  bqB bkB      (B = 1, H = 2, fp32)
// For the AVX-512 kernel: -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma
// -mf16c -DATTN_ISA_AVX512 instead of -mavx2 -mfma (the kernel's namespace, tile
// and W follow the ISA). Two versions of the kernel: bench/micro/fwd_ab.cpp.
#if !defined(ATTN_ISA_AVX512) && !defined(ATTN_ISA_AVX2)
#define ATTN_ISA_AVX2 1
#endif
#include "../../csrc/kernels/flash_fwd.cpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

using namespace attn_fast;

int main(int argc, char** argv) {
  if (argc < 9) {
    std::fprintf(stderr, "usage: %s L d causal pairs bqA bkA bqB bkB\n", argv[0]);
    return 2;
  }
  const int64_t L = std::atol(argv[1]), d = std::atol(argv[2]), H = 2;
  const int causal = std::atoi(argv[3]), pairs = std::atoi(argv[4]);
  const int bq[2] = {std::atoi(argv[5]), std::atoi(argv[7])},
            bk[2] = {std::atoi(argv[6]), std::atoi(argv[8])};
  std::vector<float> q(H * L * d), k(H * L * d), v(H * L * d), o(H * L * d), lse(H * L);
  uint32_t x = 1;
  auto rnd = [&]() {
    x = x * 1664525u + 1013904223u;
    return ((x >> 8) / 16777216.f - 0.5f) * 3.4f;
  };
  for (auto* p : {&q, &k, &v})
    for (auto& e : *p) e = rnd();
  AttnArgs<float> a;
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.o = o.data();
  a.lse = lse.data();
  a.B = 1;
  a.Hq = H;
  a.Hkv = H;
  a.Lq = L;
  a.Lk = L;
  a.d = d;
  a.dv = d;
  a.sq = {H * L * d, L * d, d, 1};
  a.sk = a.sq;
  a.sv = a.sq;
  a.so = a.sq;
  a.scale = 1 / std::sqrt(double(d));
  a.causal = causal;
  std::vector<double> t[2], ratio;
  for (int r = 0; r < pairs; r++) {
    double tt[2];
    for (int c = 0; c < 2; c++) {
      a.block_q = bq[c];
      a.block_k = bk[c];
      auto t0 = std::chrono::steady_clock::now();
      ATTN_NS::flash_forward_f32(a);
      tt[c] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      t[c].push_back(tt[c]);
    }
    ratio.push_back(tt[0] / tt[1]);
  }
  for (auto& ts : t) std::sort(ts.begin(), ts.end());
  std::sort(ratio.begin(), ratio.end());
  const double fl = 4.0 * H * L * L * d * (causal ? 0.5 : 1);
  std::printf(
      "L=%ld d=%ld causal=%d: A(%d,%d) %.1f GF/s, B(%d,%d) %.1f GF/s (medians); "
      "time A/B median %.3f [quartiles %.3f %.3f]\n",
      static_cast<long>(L), static_cast<long>(d), causal, bq[0], bk[0], fl / t[0][pairs / 2] / 1e9,
      bq[1], bk[1], fl / t[1][pairs / 2] / 1e9, ratio[pairs / 2], ratio[pairs / 4],
      ratio[3 * pairs / 4]);
}
