// A pure streaming read of 256 MiB cut into runs of RUN bytes, read in order
// and in a shuffled order (as a paged cache's blocks after many sequences came
// and went), then shuffled with a software prefetch of the next run (or the
// one after) spread over the current run's loads: what scattered runs cost the
// memory system with no arithmetic, and whether a prefetch distance recovers it
// (bench/notes_archive.md, "paged block size"). THREADS threads split the runs.
//
//   g++ -O2 -mavx2 -fopenmp -std=c++17 bench/micro/read_runs.cpp -o /tmp/rr
//   for r in 8192 16384 32768 65536; do /tmp/rr $r 2; done
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s RUN_BYTES THREADS\n", argv[0]);
    return 2;
  }
  const size_t total = size_t(256) << 20, run = std::atol(argv[1]);
  const int th = std::atoi(argv[2]);
  if (run < 128 || run % 128 || total % run || th < 1) {
    std::fprintf(stderr, "RUN_BYTES a multiple of 128 dividing 256 MiB, THREADS >= 1\n");
    return 2;
  }
  char* A = static_cast<char*>(std::aligned_alloc(size_t(2) << 20, total));
  if (!A) return 1;
  madvise(A, total, MADV_HUGEPAGE);
  std::memset(A, 1, total);
  const size_t nrun = total / run;
  std::vector<size_t> in_order(nrun), shuffled(nrun);
  for (size_t i = 0; i < nrun; i++) in_order[i] = shuffled[i] = i;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(1));
  // 0 in order, 1 shuffled, 2 shuffled + prefetch of the next run, 3 of the one after
  double best[4] = {1e30, 1e30, 1e30, 1e30};
  for (int rep = 0; rep < 10; rep++)
    for (int m = 0; m < 4; m++) {
      const std::vector<size_t>& order = m ? shuffled : in_order;
      const size_t dist = m >= 2 ? m - 1 : 0;
      const auto t0 = std::chrono::steady_clock::now();
      float sink = 0;
#pragma omp parallel num_threads(th) reduction(+ : sink)
      {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        const int t = omp_get_thread_num();
        const size_t lo = nrun * t / th, hi = nrun * (t + 1) / th;
        for (size_t c = lo; c < hi; c++) {
          const float* p = reinterpret_cast<const float*>(A + order[c] * run);
          const char* next = dist && c + dist < hi ? A + order[c + dist] * run : nullptr;
          for (size_t i = 0; i < run / 4; i += 32) {  // two 64-byte lines per iteration
            if (next) {
              __builtin_prefetch(next + i * 4, 0, 3);
              __builtin_prefetch(next + i * 4 + 64, 0, 3);
            }
            a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
            a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 16));
          }
        }
        float x[8];
        _mm256_storeu_ps(x, _mm256_add_ps(a0, a1));
        sink += x[0];
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best[m] = std::min(best[m], s);
      if (sink == 12345) std::puts("");  // keep the loads
    }
  std::printf(
      "run %zu B, %d threads: in order %.1f GB/s, shuffled %.1f GB/s (%.3fx the time); "
      "shuffled + prefetch of the next run %.3fx, of the one after %.3fx (best of 10)\n",
      run, th, total / best[0] / 1e9, total / best[1] / 1e9, best[1] / best[0], best[2] / best[0],
      best[3] / best[0]);
  std::free(A);
  return 0;
}
