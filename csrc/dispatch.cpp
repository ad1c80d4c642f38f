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
#include "dispatch.h"

namespace attn_fast {

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

void note_pool_used() { g_pool_used.store(true); }

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

// The entry points: one overload per storage type of each kernel's list
// (kernel_entries.h), forwarded to the active ISA's object. bf16 forward calls
// on avx512_bf16 take that object's vdpbf16ps kernel (bf16_dot_forward); every
// other call of that ISA runs the avx512 object (ATTN_DISPATCH).
template <typename S>
inline bool bf16_dot_forward(const AttnArgs<S>&, AttnStats*) {
  return false;
}
inline bool bf16_dot_forward(const AttnArgs<bf16_t>& a, AttnStats* st) {
#ifdef ATTN_HAVE_AVX512_BF16
  if (active_isa() == Isa::avx512_bf16) {
    *st = isa_avx512_bf16::flash_forward_bf16(a);
    return true;
  }
#endif
  (void)a;
  (void)st;
  return false;
}

#define ATTN_DEFINE_FORWARD(sfx, S)               \
  AttnStats flash_forward(const AttnArgs<S>& a) { \
    AttnStats st;                                 \
    if (bf16_dot_forward(a, &st)) return st;      \
    ATTN_DISPATCH(flash_forward_##sfx, a)         \
  }
#define ATTN_DEFINE_DECODE(sfx, S) \
  void decode_forward(const DecodeArgs<S>& a) { ATTN_DISPATCH(decode_forward_##sfx, a) }
#define ATTN_DEFINE_BACKWARD(sfx, S) \
  void flash_backward(const BwdArgs<S>& a) { ATTN_DISPATCH(flash_backward_##sfx, a) }
ATTN_FORWARD_TYPES(ATTN_DEFINE_FORWARD)
ATTN_DECODE_TYPES(ATTN_DEFINE_DECODE)
ATTN_BACKWARD_TYPES(ATTN_DEFINE_BACKWARD)

}  // namespace attn_fast
