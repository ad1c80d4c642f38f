// Micro-benchmark of the prefill kernel's register-blocked QK^T and PV loops
// on L1/L2-resident panels, outside the kernel (no softmax, no packing, no
// threads). Tells how close the loops themselves come to the FMA peak, and
// how much of the kernel's gap is elsewhere (bench/NOTES.md).
//
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -I. -Icsrc/include -Icsrc/kernels \
//       bench/micro/kernels.cpp csrc/interrupt.cpp -o /tmp/mk && /tmp/mk
//   g++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c -std=c++17 \
//       -DATTN_ISA_AVX512 -I. -Icsrc/include -Icsrc/kernels \
//       bench/micro/kernels.cpp csrc/interrupt.cpp -o /tmp/mk512 && /tmp/mk512
//
// The ISA is the kernel source's (ATTN_ISA_AVX2 unless ATTN_ISA_AVX512 is
// defined), and so are the tile (kMR x kNR vectors, IsaTraits) and W.
//
// Prints, per (d, Br, Bc, S padding), the median and best of 15 interleaved
// trials in GFLOP/s for one thread; compare with
// `python -c "import attn_fast._core as c; print(c.fma_peak_gflops(1))"`.
#if !defined(ATTN_ISA_AVX512) && !defined(ATTN_ISA_AVX2)
#define ATTN_ISA_AVX2 1
#endif
#include "../../csrc/kernels/flash_fwd.cpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

using namespace attn_fast::ATTN_NS;
constexpr int kW = Vec<float>::W;

struct Cfg {
  int d, Br, Bc, pad;
  std::vector<double> qk, pv;
};

int main() {
  std::vector<Cfg> cf;
  for (int d : {64, 128})
    for (int pad : {0, 16})
      for (int Bc : {128, 256}) cf.push_back({d, 48, Bc, pad, {}, {}});
  float* Qp = static_cast<float*>(std::aligned_alloc(64, 96 * 128 * 4));
  float* Kp = static_cast<float*>(std::aligned_alloc(64, 256 * 128 * 4));
  float* Vp = static_cast<float*>(std::aligned_alloc(64, 256 * 128 * 4));
  float* S = static_cast<float*>(std::aligned_alloc(64, 96 * 300 * 4));
  float* O = static_cast<float*>(std::aligned_alloc(64, 96 * 128 * 4));
  for (int i = 0; i < 96 * 128; i++) Qp[i] = 1e-3f * (i % 7), O[i] = 0;
  for (int i = 0; i < 256 * 128; i++) Kp[i] = 1e-3f * (i % 5), Vp[i] = 1e-2f * (i % 3);
  for (int i = 0; i < 96 * 300; i++) S[i] = 1e-3f;
  for (int trial = 0; trial < 15; trial++)
    for (auto& c : cf) {
      const int d = c.d, Br = c.Br, Bc = c.Bc, ldS = Bc + c.pad;
      const int reps = 2000 * 64 / d * 128 / Bc;
      const double fl = 2.0 * Br * Bc * d * reps;
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; r++)
        for (int jv = 0; jv < Bc; jv += kNR * kW)
          for (int i = 0; i < Br; i += kMR)
            qk_micro<float, kMR, kNR>(Qp + i * d, d, Kp + jv * d, S + i * ldS + jv, ldS);
      auto t1 = std::chrono::steady_clock::now();
      int64_t pc[2 * 16];
      for (int p = 0; p < Br / kMR; p++)
        pc[2 * p] = 0, pc[2 * p + 1] = Bc;  // every panel sees the whole tile
      for (int r = 0; r < reps; r++) pv_block<float>(S, ldS, Br, pc, Vp, Bc, d, O);
      auto t2 = std::chrono::steady_clock::now();
      c.qk.push_back(fl / std::chrono::duration<double>(t1 - t0).count() / 1e9);
      c.pv.push_back(fl / std::chrono::duration<double>(t2 - t1).count() / 1e9);
    }
  for (auto& c : cf) {
    std::sort(c.qk.begin(), c.qk.end());
    std::sort(c.pv.begin(), c.pv.end());
    std::printf(
        "d=%3d Br=%d Bc=%d pad=%2d  QK med %5.1f best %5.1f | PV med %5.1f best %5.1f GFLOP/s "
        "(%g)\n",
        c.d, c.Br, c.Bc, c.pad, c.qk[7], c.qk.back(), c.pv[7], c.pv.back(), double(S[5] + O[3]));
  }
}
