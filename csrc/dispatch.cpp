// CPU detection (once, cached), ISA choice and thread count; compiled at the
// baseline ISA. Forwards each entry point to the chosen per-ISA kernel.
#include <atomic>
#include <chrono>
#include <new>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#define ATTN_X86 1
#include <cpuid.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#include <pthread.h>
#define ATTN_POSIX 1
#endif
#ifdef __linux__
#include <dirent.h>
#endif

#include "attn_fast/attention.h"

namespace attn_fast {

#define ATTN_DECLARE_ISA(ns)                               \
  namespace ns {                                           \
  AttnStats flash_forward_f32(const AttnArgs<float>& a);   \
  AttnStats flash_forward_f64(const AttnArgs<double>& a);  \
  double fma_loop(int64_t iters);                          \
  void decode_forward_f32(const DecodeArgs<float>& a);     \
  void decode_forward_f64(const DecodeArgs<double>& a);    \
  void decode_forward_bf16(const DecodeArgs<bf16_t>& a);   \
  void decode_forward_f16(const DecodeArgs<fp16_t>& a);    \
  float stream_read(const float* p, int64_t n);            \
  double read_loop(const float* p, int64_t n);             \
  AttnStats flash_forward_bf16(const AttnArgs<bf16_t>& a); \
  AttnStats flash_forward_f16(const AttnArgs<fp16_t>& a);  \
  void flash_backward_f32(const BwdArgs<float>& a);        \
  void flash_backward_f64(const BwdArgs<double>& a);       \
  }
ATTN_DECLARE_ISA(isa_scalar)
#ifdef ATTN_HAVE_AVX2
ATTN_DECLARE_ISA(isa_avx2)
#endif
#ifdef ATTN_HAVE_AVX512
ATTN_DECLARE_ISA(isa_avx512)
#endif
#ifdef ATTN_HAVE_AVX512_BF16
// The vdpbf16ps object: only the bf16 fused kernel and its probe loop.
namespace isa_avx512_bf16 {
AttnStats flash_forward_bf16(const AttnArgs<bf16_t>& a);
double dpbf16_loop(int64_t iters);
}  // namespace isa_avx512_bf16
#endif

namespace {

struct CpuFeatures {
  bool avx2 = false, avx512 = false;
  bool avx512_bf16 = false;  // CPUID.(EAX=7, ECX=1):EAX bit 5, on top of avx512
};

#ifdef ATTN_X86
uint64_t read_xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#ifdef ATTN_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = read_xcr0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6;
  const bool os_zmm = (xcr0 & 0xE6) == 0xE6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = b & (1u << 5);
  const bool f512 = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  f.avx2 = os_ymm && avx2 && fma;
  f.avx512 = f.avx2 && os_zmm && f512 && dq && bw && vl;
  const unsigned max_subleaf7 = a;  // EAX of leaf 7, subleaf 0
  if (f.avx512 && max_subleaf7 >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d))
    f.avx512_bf16 = a & (1u << 5);
#endif
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = detect();
  return f;
}

bool supported(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return true;
    case Isa::avx2:
      return features().avx2;
    case Isa::avx512:
      return features().avx512;
    case Isa::avx512_bf16:
      return features().avx512_bf16;
  }
  return false;
}

bool compiled(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return true;
#ifdef ATTN_HAVE_AVX2
    case Isa::avx2:
      return true;
#endif
#ifdef ATTN_HAVE_AVX512
    case Isa::avx512:
      return true;
#endif
#ifdef ATTN_HAVE_AVX512_BF16
    case Isa::avx512_bf16:
      return true;
#endif
    default:
      return false;
  }
}

Isa best_isa() {
  Isa best = Isa::scalar;
  for (Isa i : {Isa::avx2, Isa::avx512})
    if (compiled(i) && supported(i)) best = i;
  // avx512_bf16 only where its dot product measured faster (dispatch's end).
  if (best == Isa::avx512 && compiled(Isa::avx512_bf16) && supported(Isa::avx512_bf16) &&
      bf16_dot_preferred())
    best = Isa::avx512_bf16;
  return best;
}

std::atomic<int> g_isa{-1};
std::atomic<int> g_threads{0};

// fork() safety. GNU libgomp keeps its worker threads in a pool that does not
// survive fork(): a forked child that opens a parallel region with more than
// one thread waits forever for workers that no longer exist (LLVM's libomp
// re-initialises itself in an atfork handler instead). The pool may have been
// started by anyone sharing the runtime: these kernels, the Cython prange
// loops of attn_fast._cyloops, torch, the bandwidth probes. So the prepare
// handler (run in the parent, just before fork) notes whether the parent had
// more than one thread (libgomp's workers are threads, whoever started them),
// or ran a pool here, or was itself a serial child; in the child of such a
// parent everything runs single-threaded (a one-thread region never touches
// the pool), and so do the child's own children. The thread count is an
// over-approximation (OpenBLAS or Python threads count too): a child of a
// threaded parent runs serially even when no OpenMP pool existed. libgomp
// offers no way to ask whether the forking thread owns a pool.
std::atomic<bool> g_pool_used{false};
std::atomic<bool> g_forked_child{false};
[[maybe_unused]] std::atomic<bool> g_fork_parent_threaded{false};  // used with OpenMP only

#if defined(ATTN_POSIX) && defined(_OPENMP)
bool runtime_is_libgomp() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&omp_get_max_threads), &info) && info.dli_fname)
    return std::string(info.dli_fname).find("libgomp") != std::string::npos;
  return true;  // unknown: assume the fork-unsafe runtime
}
// True unless this process is known to have exactly one thread (the caller).
bool process_has_other_threads() {
#ifdef __linux__
  DIR* dir = opendir("/proc/self/task");  // one entry per thread
  if (!dir) return true;
  int n = 0;
  while (const dirent* e = readdir(dir))
    if (e->d_name[0] != '.' && ++n > 1) break;
  closedir(dir);
  return n != 1;
#else
  return true;  // no cheap count: assume threads
#endif
}
void on_fork_prepare() {
  g_fork_parent_threaded.store(g_pool_used.load() || g_forked_child.load() ||
                               process_has_other_threads());
}
void on_fork_child() {
  if (g_fork_parent_threaded.load()) g_forked_child.store(true);
}
struct ForkGuard {
  ForkGuard() {
    if (runtime_is_libgomp()) pthread_atfork(&on_fork_prepare, nullptr, &on_fork_child);
  }
};
const ForkGuard g_fork_guard;
#endif

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return "scalar";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
    case Isa::avx512_bf16:
      return "avx512_bf16";
  }
  return "?";
}

Isa parse_isa(const std::string& name) {
  if (name == "scalar") return Isa::scalar;
  if (name == "avx2") return Isa::avx2;
  if (name == "avx512") return Isa::avx512;
  if (name == "avx512_bf16") return Isa::avx512_bf16;
  throw std::invalid_argument("unknown ISA '" + name +
                              "' (expected scalar, avx2, avx512 or avx512_bf16)");
}

std::vector<Isa> compiled_isas() {
  std::vector<Isa> out;
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16})
    if (compiled(i)) out.push_back(i);
  return out;
}

std::vector<Isa> available_isas() {
  std::vector<Isa> out;
  for (Isa i : compiled_isas())
    if (supported(i)) out.push_back(i);
  return out;
}

Isa active_isa() {
  int v = g_isa.load();
  if (v < 0) {
    v = static_cast<int>(best_isa());
    g_isa.store(v);
  }
  return static_cast<Isa>(v);
}

void set_active_isa(Isa isa) {
  if (!compiled(isa))
    throw std::runtime_error(std::string("ISA '") + isa_name(isa) +
                             "' is not compiled into this build of attn_fast");
  if (!supported(isa))
    throw std::runtime_error(std::string("ISA '") + isa_name(isa) +
                             "' is not supported by this CPU/OS (CPUID/XCR0)");
  g_isa.store(static_cast<int>(isa));
}

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("num_threads must be >= 1");
  g_threads.store(n);
}

int get_num_threads() {
  if (g_forked_child.load()) return 1;  // see ForkGuard
  int n = g_threads.load();
  if (n > 0) return n;
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

int threads_for_call() {
  const int n = get_num_threads();
  if (n > 1) g_pool_used.store(true);
  return n;
}

bool forked_child_serial() { return g_forked_child.load(); }

bool openmp_enabled() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

std::string openmp_runtime() {
#ifdef _OPENMP
  std::string s = "OpenMP " + std::to_string(_OPENMP);
#if defined(__unix__) || defined(__APPLE__)
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&omp_get_max_threads), &info) && info.dli_fname)
    s += std::string(" (") + info.dli_fname + ")";
#endif
  return s;
#else
  return "none (built without OpenMP: single-threaded)";
#endif
}

#define ATTN_DISPATCH(fn, ...)            \
  switch (active_isa()) {                 \
    AVX512_CASE(fn, __VA_ARGS__)          \
    AVX2_CASE(fn, __VA_ARGS__)            \
    default:                              \
      return isa_scalar::fn(__VA_ARGS__); \
  }
#ifdef ATTN_HAVE_AVX512
#define AVX512_CASE(fn, ...) \
  case Isa::avx512:          \
  case Isa::avx512_bf16:     \
    return isa_avx512::fn(__VA_ARGS__);
#else
#define AVX512_CASE(fn, ...)
#endif
#ifdef ATTN_HAVE_AVX2
#define AVX2_CASE(fn, ...) \
  case Isa::avx2:          \
    return isa_avx2::fn(__VA_ARGS__);
#else
#define AVX2_CASE(fn, ...)
#endif

AttnStats flash_forward(const AttnArgs<float>& a){ATTN_DISPATCH(flash_forward_f32, a)} AttnStats
    flash_forward(const AttnArgs<double>& a) {
  ATTN_DISPATCH(flash_forward_f64, a)
}

static double fma_loop_active(int64_t iters) { ATTN_DISPATCH(fma_loop, iters) }

double fma_peak_gflops(int threads, double seconds) {
  if (threads < 1 || g_forked_child.load()) threads = 1;
  if (threads > 1) g_pool_used.store(true);
  // Calibrate on one thread, then run the same count on every thread.
  int64_t iters = 1 << 20;
  double el = 0;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    fma_loop_active(iters);
    el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return flops / dt * 1e-9;
}

void decode_forward(const DecodeArgs<float>& a) { ATTN_DISPATCH(decode_forward_f32, a) }
void decode_forward(const DecodeArgs<double>& a) { ATTN_DISPATCH(decode_forward_f64, a) }
// 16-bit storage: avx512_bf16 runs the avx512 kernel (AVX512_CASE); the
// decode is bound by reading K/V, not by the dot products.
void decode_forward(const DecodeArgs<bf16_t>& a) { ATTN_DISPATCH(decode_forward_bf16, a) }
void decode_forward(const DecodeArgs<fp16_t>& a) { ATTN_DISPATCH(decode_forward_f16, a) }

static float stream_read_active(const float* p, int64_t n) { ATTN_DISPATCH(stream_read, p, n) }

double stream_read_gbps(int threads, int64_t nbytes, int reps) {
  if (threads < 1 || g_forked_child.load()) threads = 1;  // see ForkGuard
  if (threads > 1) g_pool_used.store(true);
  if (reps < 1) reps = 1;
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(float)) / threads / 16 * 16;
  if (n <= 0) return 0.0;
  float* buf =
      static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(n * threads) * sizeof(float)));
  if (!buf) throw std::bad_alloc();
  double best = 0;
  float sink = 0;
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
    for (int r = 0; r < reps; ++r) {
#pragma omp barrier
#pragma omp master
      t0 = std::chrono::steady_clock::now();
#pragma omp barrier
      sink += stream_read_active(mine, n);
#pragma omp barrier
#pragma omp master
      {  // the barrier above waited for the slowest thread
        const double dt =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double gbps = static_cast<double>(n) * threads * sizeof(float) / dt * 1e-9;
        if (gbps > best) best = gbps;
      }
    }
  }
  std::free(buf);
  return sink == 1.2345e30f ? -1.0 : best;
}

static double read_loop_active(const float* p, int64_t n) { ATTN_DISPATCH(read_loop, p, n) }

double read_bandwidth_gbs(int threads, int64_t bytes, double seconds) {
  if (threads < 1 || g_forked_child.load()) threads = 1;  // see ForkGuard
  if (threads > 1) g_pool_used.store(true);
  const int64_t chunk = 64 * 1024;  // floats per work unit, a multiple of 4 * W
  int64_t n = bytes / static_cast<int64_t>(sizeof(float)) / chunk * chunk;
  if (n < chunk) n = chunk;
  const int64_t units = n / chunk;
  float* buf = static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(n) * sizeof(float)));
  if (!buf) throw std::bad_alloc();
  // First touch by the thread that will read the unit (same static split).
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t u = 0; u < units; ++u)
    for (int64_t i = 0; i < chunk; ++i) buf[u * chunk + i] = 1.0f;
  double sink = 0, best = 0, total = 0;
  int passes = 0;
  while (passes < 3 || total < seconds) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : sink)
    for (int64_t u = 0; u < units; ++u) sink += read_loop_active(buf + u * chunk, chunk);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    total += dt;
    ++passes;
    const double gbs = static_cast<double>(n) * sizeof(float) / dt * 1e-9;
    if (gbs > best) best = gbs;
  }
  std::free(buf);
  return sink == -1.0 ? 0.0 : best;
}

// ---------------------------------------------------------------- 16-bit storage

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
  if (!features().avx512_bf16) return false;
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
      const double dt =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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

// bf16 on avx512_bf16: the vdpbf16ps object; on every other ISA (avx512
// included) the convert-on-pack kernel of that ISA.
AttnStats flash_forward(const AttnArgs<bf16_t>& a) {
#ifdef ATTN_HAVE_AVX512_BF16
  if (active_isa() == Isa::avx512_bf16) return isa_avx512_bf16::flash_forward_bf16(a);
#endif
  ATTN_DISPATCH(flash_forward_bf16, a)
}
AttnStats flash_forward(const AttnArgs<fp16_t>& a) { ATTN_DISPATCH(flash_forward_f16, a) }
void flash_backward(const BwdArgs<float>& a) { ATTN_DISPATCH(flash_backward_f32, a) }
void flash_backward(const BwdArgs<double>& a) { ATTN_DISPATCH(flash_backward_f64, a) }

}  // namespace attn_fast
