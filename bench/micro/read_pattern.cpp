// The decode kernel's read pattern without its arithmetic: per kv head, per
// 64-key block, the block's K rows then its V rows (d = 128, fp32), one
// 32-byte load per 64-byte line, one thread. With bench/micro/decode.cpp it
// separates memory time from compute time (bench/notes_archive.md, issue3b-decode).
//
//   g++ -O2 -mavx2 -std=c++17 bench/micro/read_pattern.cpp -o /tmp/rp && /tmp/rp 32768
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  const long L = argc > 1 ? std::atol(argv[1]) : 32768;
  const int H = 8, d = 128;
  const size_t n = size_t(H) * L * d, two_mib = size_t(2) << 20;
  const size_t bytes = (n * 4 + two_mib - 1) / two_mib * two_mib;
  float* K = static_cast<float*>(std::aligned_alloc(two_mib, bytes));
  float* V = static_cast<float*>(std::aligned_alloc(two_mib, bytes));
  madvise(K, bytes, MADV_HUGEPAGE);
  madvise(V, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < n; i++) K[i] = V[i] = 1;
  std::vector<double> ts;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int rep = 0; rep < 15; rep++) {
    auto t0 = std::chrono::steady_clock::now();
    for (int h = 0; h < H; h++)
      for (long j = 0; j < L; j += 64) {
        const float* kb = K + size_t(h) * L * d + j * d;
        const float* vb = V + size_t(h) * L * d + j * d;
        for (int i = 0; i < 64 * d; i += 32) {
          a0 = _mm256_add_ps(a0, _mm256_load_ps(kb + i));
          a1 = _mm256_add_ps(a1, _mm256_load_ps(kb + i + 16));
        }
        for (int i = 0; i < 64 * d; i += 32) {
          a0 = _mm256_add_ps(a0, _mm256_load_ps(vb + i));
          a1 = _mm256_add_ps(a1, _mm256_load_ps(vb + i + 16));
        }
      }
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  float o[8];
  _mm256_storeu_ps(o, _mm256_add_ps(a0, a1));
  std::printf("L=%ld: best %.1f GB/s, median %.1f GB/s (%g)\n", L, 2.0 * n * 4 / ts[0] / 1e9,
              2.0 * n * 4 / ts[7] / 1e9, double(o[0]));
}
