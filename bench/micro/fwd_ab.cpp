// Paired A/B of two versions of the prefill kernel (csrc/kernels/flash_fwd.cpp
// and the headers it includes) in one process: A is this tree's, B another
// commit's (extracted to a directory of its own), each compiled into its own
// namespace by renaming the ISA namespace with -D. The two run alternately
// (ABBA) on the same inputs; the figure is the median of the per-pair ratios of
// process CPU time (robust to other processes taking the cores of a shared
// machine), with its quartiles, the same for wall time (what a schedule change
// can move; noisy here), and the largest |A - B| of the outputs (0 when the
// change is bit-identical). With several threads set OMP_WAIT_POLICY=passive,
// or the CPU time counts the threads' spinning while they wait.
//
//   ISA=avx512; FL="-O3 -std=c++17 -fopenmp -mavx512f -mavx512bw -mavx512vl -mavx512dq \
//       -mavx2 -mfma -mf16c -DATTN_ISA_AVX512"
//   (AVX2: ISA=avx2 and -mavx2 -mfma -mf16c -DATTN_ISA_AVX2 instead of the AVX-512 flags)
//   mkdir -p /tmp/base && git archive main csrc | tar -x -C /tmp/base
//   g++ $FL -Icsrc/include -c csrc/kernels/flash_fwd.cpp -o /tmp/a.o
//   g++ $FL -I/tmp/base/csrc/include -Disa_$ISA=isa_${ISA}_base \
//       -c /tmp/base/csrc/kernels/flash_fwd.cpp -o /tmp/b.o
//   g++ $FL -Icsrc/include -DAB_A=isa_$ISA -DAB_B=isa_${ISA}_base bench/micro/fwd_ab.cpp \
//       /tmp/a.o /tmp/b.o csrc/interrupt.cpp -o /tmp/ab && /tmp/ab 2048 64 0 15 1
//   args: L d causal pairs threads [H [B [block_q block_k]]]   (fp32, H = Hkv = 2 threads)
//
// bf16 (the vdpbf16ps kernel of the avx512_bf16 object): ISA=avx512_bf16, the
// AVX-512 flags plus -mavx512bf16 -DATTN_ISA_AVX512_BF16, and -DAB_BF16 on the
// fwd_ab.cpp line; the inputs are the same numbers rounded to bf16.
// AMX tiles (the amx object): ISA=amx, the avx512_bf16 flags plus -mamx-tile
// -mamx-bf16 -DATTN_ISA_AMX on the kernel lines, and -DAB_BF16 -DAB_AMX on the
// fwd_ab.cpp line (it asks Linux for the tile-data permission first, as
// dispatch.cpp does at import).
#include <omp.h>
#include <time.h>
#if defined(AB_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "attn_fast/attention.h"
#include "attn_fast/half.h"

namespace attn_fast {
#if defined(AB_BF16)
using Elem = bf16_t;
#define AB_FORWARD flash_forward_bf16
#else
using Elem = float;
#define AB_FORWARD flash_forward_f32
#endif
namespace AB_A {
AttnStats AB_FORWARD(const AttnArgs<Elem>& a);
}
namespace AB_B {
AttnStats AB_FORWARD(const AttnArgs<Elem>& a);
}
}  // namespace attn_fast

using namespace attn_fast;

static float to_float(float x) { return x; }
static float to_float(bf16_t x) { return bf16_to_f32(x.bits); }
static void from_float(float x, float* e) { *e = x; }
static void from_float(float x, bf16_t* e) { e->bits = f32_to_bf16(x); }

static double wall_now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static double cpu_now() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s L d causal pairs threads [H [B [block_q block_k]]]\n", argv[0]);
    return 2;
  }
#if defined(AB_AMX)
  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): without it the
  // first tile instruction faults.
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::perror("arch_prctl(ARCH_REQ_XCOMP_PERM)");
    return 1;
  }
#endif
  const int64_t L = std::atol(argv[1]), d = std::atol(argv[2]);
  const int causal = std::atoi(argv[3]), pairs = std::atoi(argv[4]), threads = std::atoi(argv[5]);
  const int64_t H = argc > 6 ? std::atol(argv[6]) : 2 * threads;
  const int64_t B = argc > 7 ? std::atol(argv[7]) : 1;
  const int bq = argc > 9 ? std::atoi(argv[8]) : 0, bk = argc > 9 ? std::atoi(argv[9]) : 0;
  const int64_t n = B * H * L * d;
  std::vector<Elem> q(n), k(n), v(n), o[2] = {std::vector<Elem>(n), std::vector<Elem>(n)};
  uint32_t x = 1;
  auto rnd = [&]() {
    x = x * 1664525u + 1013904223u;
    return ((x >> 8) / 16777216.f - 0.5f) * 3.4f;
  };
  for (auto* p : {&q, &k, &v})
    for (auto& e : *p) from_float(rnd(), &e);
  AttnArgs<Elem> a;
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.B = B;
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
  a.num_threads = threads;
  a.block_q = bq;
  a.block_k = bk;
  std::vector<double> t[2], ratio, wratio;
  for (int r = 0; r < pairs + 1; r++) {  // the first pair warms up, not counted
    double tt[2], tw[2];
    for (int c0 = 0; c0 < 2; c0++) {
      const int c = (r & 1) ? 1 - c0 : c0;  // ABBA: neither side always goes first
      a.o = o[c].data();
      const double w0 = wall_now(), t0 = cpu_now();
      if (c == 0)
        AB_A::AB_FORWARD(a);
      else
        AB_B::AB_FORWARD(a);
      tt[c] = cpu_now() - t0;
      tw[c] = wall_now() - w0;
    }
    if (r == 0) continue;
    for (int c = 0; c < 2; c++) t[c].push_back(tt[c]);
    ratio.push_back(tt[0] / tt[1]);
    wratio.push_back(tw[0] / tw[1]);
  }
  double maxdiff = 0;
  for (int64_t i = 0; i < n; i++)
    maxdiff = std::max(maxdiff, double(std::fabs(to_float(o[0][i]) - to_float(o[1][i]))));
  for (auto& ts : t) std::sort(ts.begin(), ts.end());
  std::sort(ratio.begin(), ratio.end());
  std::sort(wratio.begin(), wratio.end());
  const double fl = 4.0 * B * H * L * L * d * (causal ? 0.5 : 1);
  std::printf(
      "(%ld,%ld,%ld,%ld)%s threads=%d: A %.1f, B %.1f cpu-GFLOP/s (medians); "
      "cpu time A/B median %.3f [quartiles %.3f %.3f], wall %.3f [%.3f %.3f] n=%d; "
      "max|A-B| %.3g\n",
      static_cast<long>(B), static_cast<long>(H), static_cast<long>(L), static_cast<long>(d),
      causal ? " causal" : "", threads, fl / t[0][pairs / 2] / 1e9, fl / t[1][pairs / 2] / 1e9,
      ratio[pairs / 2], ratio[pairs / 4], ratio[3 * pairs / 4], wratio[pairs / 2],
      wratio[pairs / 4], wratio[3 * pairs / 4], pairs, maxdiff);
}
