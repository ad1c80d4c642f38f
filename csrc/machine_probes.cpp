// The machine probes, compiled at the baseline ISA: the timing, threads and
// buffers around the per-ISA loops of kernels/probe_loops.cpp (fma_loop,
// read_loop, dpbf16_loop), chosen like every entry point (dispatch.h).
//   fma_peak_gflops     FP32 FMA peak of `threads` threads (the benchmark's
//                       roofline for prefill)
//   stream_read_gbps,   streaming-read bandwidth (the roofline for decode):
//   read_bandwidth_gbs  two signatures of one measurement, measure_read_gbs
//   bf16_dot_preferred  whether vdpbf16ps beats fp32 FMA on this core
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <new>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attn_fast/attention.h"
#include "dispatch.h"

namespace attn_fast {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double fma_loop_active(int64_t iters) { ATTN_DISPATCH(fma_loop, iters) }
double read_loop_active(const float* p, int64_t n) { ATTN_DISPATCH(read_loop, p, n) }

// Threads for a probe: 1 in a forked child that must stay serial (dispatch.cpp).
int probe_threads(int threads) {
  if (threads < 1 || forked_child_serial()) threads = 1;
  if (threads > 1) note_pool_used();
  return threads;
}

// The streaming-read measurement: `threads` threads each read their share of
// an nbytes buffer (first touched by the same thread), all together, at least
// min_passes times and until min_seconds have passed; returns the best pass
// in GB/s (1e9 bytes/s; a pass lasts until the slowest thread is done).
double measure_read_gbs(int threads, int64_t nbytes, int min_passes, double min_seconds) {
  threads = probe_threads(threads);
  if (min_passes < 1) min_passes = 1;
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(float)) / threads / 16 * 16;
  if (n <= 0) return 0.0;
  float* buf =
      static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(n * threads) * sizeof(float)));
  if (!buf) throw std::bad_alloc();
  double best = 0, total = 0, sink = 0;
  int passes = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num();
#else
    const int t = 0;
#endif
    float* mine = buf + static_cast<int64_t>(t) * n;
    for (int64_t i = 0; i < n; ++i) mine[i] = static_cast<float>(i & 7);  // first touch
    std::chrono::steady_clock::time_point t0;
    // passes and total are written by the master between two barriers and
    // read by every thread after the second: the loop ends together.
    while (passes < min_passes || total < min_seconds) {
#pragma omp barrier
#pragma omp master
      t0 = std::chrono::steady_clock::now();
#pragma omp barrier
      sink += read_loop_active(mine, n);
#pragma omp barrier
#pragma omp master
      {  // the barrier above waited for the slowest thread
        const double dt = seconds_since(t0);
        const double gbs = static_cast<double>(n) * threads * sizeof(float) / dt * 1e-9;
        if (gbs > best) best = gbs;
        total += dt;
        ++passes;
      }
#pragma omp barrier
    }
  }
  std::free(buf);
  return sink == -1.0 ? 0.0 : best;
}

}  // namespace

double fma_peak_gflops(int threads, double seconds) {
  threads = probe_threads(threads);
  // Calibrate on one thread, then run the same count on every thread.
  int64_t iters = 1 << 20;
  double el = 0;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    fma_loop_active(iters);
    el = seconds_since(t0);
    if (el > 0.02 || iters > (int64_t(1) << 40)) break;
    iters *= 4;
  }
  iters = static_cast<int64_t>(iters * (seconds / (el > 0 ? el : 1e-3)));
  if (iters < 1) iters = 1;
  double flops = 0;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
  {
    flops += fma_loop_active(iters);
  }
  return flops / seconds_since(t0) * 1e-9;
}

double stream_read_gbps(int threads, int64_t nbytes, int reps) {
  return measure_read_gbs(threads, nbytes, reps, 0.0);
}

double read_bandwidth_gbs(int threads, int64_t bytes, double seconds) {
  const int64_t kMinBytes = int64_t(256) << 10;  // at least 64 Ki floats in all
  return measure_read_gbs(threads, bytes > kMinBytes ? bytes : kMinBytes, 3, seconds);
}

// Whether vdpbf16ps beats fp32 FMA on this core, measured once: the same
// register-only loop shape (10 independent chains) for both, best of three
// short runs each (~10 ms in all), vdpbf16ps counted as 2 FLOPs per bf16 pair.
// It wins by ~2x on AMD Zen 4 and loses by ~2x on Sapphire Rapids, where the
// flag alone would pick the slow path. ATTN_FAST_BF16_PROBE=0/1 skips the
// measurement (forces the convert path / the vdpbf16ps path).
// Decides whether the default ISA is avx512_bf16 rather than avx512 (at the
// first kernel call or get_isa()); ATTN_FAST_ISA=avx512 / avx512_bf16 choose
// without measuring.
static bool measure_bf16_dot() {
#ifdef ATTN_HAVE_AVX512_BF16
  bool have = false;
  for (Isa i : available_isas()) have = have || i == Isa::avx512_bf16;
  if (!have) return false;
  if (const char* env = std::getenv("ATTN_FAST_BF16_PROBE")) {
    if (env[0] == '0') return false;
    if (env[0] == '1') return true;
  }
  auto rate = [](double (*loop)(int64_t)) {
    const int64_t iters = int64_t(1) << 17;
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      const double flops = loop(iters);
      const double dt = seconds_since(t0);
      if (dt > 0 && flops / dt > best) best = flops / dt;
    }
    return best;
  };
  const double fma = rate(&isa_avx512::fma_loop);
  const double dot = rate(&isa_avx512_bf16::dpbf16_loop);
  // The dot product must win clearly: it only speeds up S = Q K^T (P V stays fp32).
  return dot > 1.3 * fma;
#else
  return false;
#endif
}

bool bf16_dot_preferred() {
  static const bool preferred = measure_bf16_dot();
  return preferred;
}

}  // namespace attn_fast
