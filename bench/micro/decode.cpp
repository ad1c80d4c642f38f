// The split-KV decode kernel outside Python: one token of 32 query heads
// against 8 kv heads of L cached keys (d = dv = 128, fp32), one thread,
// K/V on transparent huge pages as NumPy's large arrays are. Reports the
// best and median K+V bytes read per second (bench/notes_archive.md, issue3b-decode).
//
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -Icsrc/include -Icsrc/kernels \
//       bench/micro/decode.cpp csrc/interrupt.cpp -o /tmp/md && /tmp/md 32768 20
//   args: L [repeats [split]]
#define ATTN_ISA_AVX2 1
#include "../../csrc/kernels/decode.cpp"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

using namespace attn_fast;

static float* huge_alloc(size_t n) {
  const size_t two_mib = size_t(2) << 20;
  const size_t bytes = (n * sizeof(float) + two_mib - 1) / two_mib * two_mib;
  void* p = std::aligned_alloc(two_mib, bytes);
  madvise(p, bytes, MADV_HUGEPAGE);
  return static_cast<float*>(p);
}

int main(int argc, char** argv) {
  const int64_t L = argc > 1 ? std::atol(argv[1]) : 32768;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 20;
  const int64_t Hq = 32, Hkv = 8, d = 128;
  float* q = huge_alloc(Hq * d);
  float* k = huge_alloc(Hkv * L * d);
  float* v = huge_alloc(Hkv * L * d);
  float* o = huge_alloc(Hq * d);
  float* lse = huge_alloc(Hq);
  for (int64_t i = 0; i < Hkv * L * d; i++) {
    k[i] = ((i * 2654435761u) % 1000) / 1000.f - 0.5f;
    v[i] = ((i * 40503u) % 1000) / 1000.f - 0.5f;
  }
  for (int64_t i = 0; i < Hq * d; i++) q[i] = ((i * 7919u) % 1000) / 1000.f - 0.5f;
  DecodeArgs<float> a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.o = o;
  a.lse = lse;
  a.B = 1;
  a.Hq = Hq;
  a.Hkv = Hkv;
  a.Lq = 1;
  a.R = L;
  a.d = d;
  a.dv = d;
  a.sq = {Hq * d, d, d, 1};
  a.sk = {Hkv * L * d, L * d, d, 1};
  a.sv = a.sk;
  a.so = a.sq;
  a.scale = 1 / std::sqrt(128.0);
  a.split = argc > 3 ? std::atol(argv[3]) : 0;
  std::vector<double> ts;
  for (int r = 0; r < reps; r++) {
    auto t0 = std::chrono::steady_clock::now();
    isa_avx2::decode_forward_f32(a);
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  const double bytes = 2.0 * Hkv * L * d * sizeof(float);
  std::printf("L=%ld: best %.3f ms %.1f GB/s, median %.1f GB/s (o[3] = %g)\n", static_cast<long>(L),
              ts[0] * 1e3, bytes / ts[0] / 1e9, bytes / ts[ts.size() / 2] / 1e9, double(o[3]));
}
