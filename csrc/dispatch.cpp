// CPU detection (once, cached), ISA choice and thread count; compiled at the
// baseline ISA. Forwards each entry point to the chosen per-ISA kernel.
#include <atomic>
#include <chrono>
#include <new>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <iterator>
#include <string>
#include <utility>
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
#if defined(__aarch64__) || defined(_M_ARM64)
#define ATTN_ARM64 1
#ifdef __linux__
#include <sys/auxv.h>  // getauxval(AT_HWCAP / AT_HWCAP2)
#endif
#ifdef __APPLE__
#include <sys/sysctl.h>  // sysctlbyname("hw.optional.arm.FEAT_BF16")
#endif
#endif
#ifdef __linux__
#include <dirent.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#endif
#include <cmath>

#include "attn_fast/attention.h"
#include "attn_fast/half.h"
#include "dispatch.h"

namespace attn_fast {

namespace {

struct CpuFeatures {
  bool avx2 = false, avx512 = false;
  bool avx512_bf16 = false;  // CPUID.(EAX=7, ECX=1):EAX bit 5, on top of avx512
  // AMX (issue 19): CPUID.(7,0):EDX bits 24 (AMX-TILE) and 22 (AMX-BF16); XCR0
  // bits 17/18 (XTILECFG / XTILEDATA enabled by the OS); Linux's per-process
  // permission for XTILEDATA (arch_prctl, granted once, inherited by fork).
  bool amx_cpu = false, amx_os = false, amx_perm = false;
  bool amx = false;          // all of the above, on top of avx512_bf16
  const char* amx_why = "";  // why amx is unavailable ("" when it is available)
  int amx_errno = 0;         // arch_prctl's errno when the permission was refused
  // aarch64: Advanced SIMD (HWCAP_ASIMD; every ARMv8-A Linux CPU, always on
  // macOS), and FEAT_BF16 with FEAT_I8MM and FEAT_FP16 (the neon_bf16 object's
  // -march: HWCAP2_BF16, HWCAP2_I8MM, HWCAP_ASIMDHP; hw.optional.arm.FEAT_BF16,
  // FEAT_I8MM, FEAT_FP16 on macOS) for neon_bf16.
  bool neon = false, neon_bf16 = false;
};

#ifdef ATTN_ARM64
#ifdef __APPLE__
bool sysctl_flag(const char* name) {
  int v = 0;
  size_t n = sizeof(v);
  return sysctlbyname(name, &v, &n, nullptr, 0) == 0 && v != 0;
}
#endif
void detect_arm(CpuFeatures* f) {
#if defined(__linux__)
  // The bit numbers of the Linux uapi (arch/arm64/include/uapi/asm/hwcap.h),
  // spelled out so that older C libraries' headers build too.
  constexpr unsigned long kHwcapAsimd = 1ul << 1, kHwcapAsimdhp = 1ul << 10;
  constexpr unsigned long kHwcap2I8mm = 1ul << 13, kHwcap2Bf16 = 1ul << 14;
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  f->neon = (hw & kHwcapAsimd) != 0;
  f->neon_bf16 = f->neon && (hw & kHwcapAsimdhp) && (hw2 & kHwcap2Bf16) && (hw2 & kHwcap2I8mm);
#elif defined(__APPLE__)
  f->neon = true;  // every Apple arm64 CPU
  f->neon_bf16 = sysctl_flag("hw.optional.arm.FEAT_BF16") &&
                 sysctl_flag("hw.optional.arm.FEAT_I8MM") &&
                 sysctl_flag("hw.optional.arm.FEAT_FP16");
#else
  f->neon = true;  // Advanced SIMD is part of ARMv8-A; no BF16 query on this OS
#endif
}
#endif

// Linux: ask once for the AMX tile-data state (XFEATURE_XTILEDATA = 18) with
// arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023), then read it back with
// ARCH_GET_XCOMP_PERM (0x1022). Without the permission the first tile
// instruction faults (SIGILL); old kernels, or a sigaltstack too small for the
// 8 KiB tile state, refuse it. The permission belongs to the process and is
// inherited by fork()ed children.
[[maybe_unused]] bool request_amx_permission(int* err) {  // x86 only
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr long kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022, kXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0) {
    *err = errno;
    return false;
  }
  unsigned long bits = 0;
  if (syscall(SYS_arch_prctl, kGetXcompPerm, &bits) != 0) {
    *err = errno;
    return false;
  }
  return (bits >> kXtiledata) & 1u;
#else
  *err = 0;
  return false;
#endif
}

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
  const bool amx_tile = d & (1u << 24), amx_bf16 = d & (1u << 22);
  if (f.avx512 && max_subleaf7 >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d))
    f.avx512_bf16 = a & (1u << 5);
  f.amx_cpu = f.avx512_bf16 && amx_tile && amx_bf16;
  f.amx_os = (xcr0 & (3u << 17)) == (3u << 17);
  if (!f.amx_cpu) {
    f.amx_why = "the CPU has no AMX-TILE/AMX-BF16 (CPUID.(7,0):EDX bits 24/22) with AVX512-BF16";
  } else if (!f.amx_os) {
    f.amx_why = "the OS has not enabled the AMX tile state (XCR0 bits 17/18)";
  } else if (!(f.amx_perm = request_amx_permission(&f.amx_errno))) {
    f.amx_why = "Linux refused the tile-data permission (arch_prctl(ARCH_REQ_XCOMP_PERM))";
  }
  f.amx = f.amx_cpu && f.amx_os && f.amx_perm;
#else
  f.amx_why = "not an x86-64 CPU";
#endif
#ifdef ATTN_ARM64
  detect_arm(&f);
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
    case Isa::amx:
      return features().amx;
    case Isa::amx_emu:  // the emulated tile ops are vdpbf16ps
      return features().avx512_bf16;
    case Isa::neon:
      return features().neon;
    case Isa::neon_bf16:
      return features().neon_bf16;
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
#ifdef ATTN_HAVE_AMX
    case Isa::amx:
      return true;
#endif
#ifdef ATTN_HAVE_AMX_EMU
    case Isa::amx_emu:
      return true;
#endif
#ifdef ATTN_HAVE_NEON
    case Isa::neon:
      return true;
#endif
#ifdef ATTN_HAVE_NEON_BF16
    case Isa::neon_bf16:
      return true;
#endif
    default:
      return false;
  }
}

// Compiled into this build and runnable on this CPU / OS.
bool available(Isa isa) { return compiled(isa) && supported(isa); }

bool amx_default_ok();  // the self-check, once (below)

// The tile ISA the default choice considers: amx, or amx_emu standing in for
// it under ATTN_FAST_AMX_CANDIDATE=amx_emu (tests: the choice, the self-check
// and the status line then run on CPUs without AMX).
Isa amx_candidate() {
  const char* e = std::getenv("ATTN_FAST_AMX_CANDIDATE");
  return e && std::string(e) == "amx_emu" ? Isa::amx_emu : Isa::amx;
}

Isa best_isa() {
  Isa best = Isa::scalar;
  for (Isa i : {Isa::avx2, Isa::avx512})
    if (compiled(i) && supported(i)) best = i;
  // amx where the CPU, the OS and the self-check allow it (amx_emu never,
  // unless a test makes it the candidate).
  const Isa cand = amx_candidate();
  if (best == Isa::avx512 && compiled(cand) && supported(cand) && amx_default_ok()) return cand;
  // avx512_bf16 only where its dot product measured faster (dispatch's end).
  if (best == Isa::avx512 && compiled(Isa::avx512_bf16) && supported(Isa::avx512_bf16) &&
      bf16_dot_preferred())
    best = Isa::avx512_bf16;
  // aarch64: neon_bf16 wherever FEAT_BF16 + FEAT_I8MM are there (no timing
  // probe: BFDOT does twice the multiply-adds of an fp32 FMLA per instruction
  // on every core that has it, and only the bf16 calls leave the neon object).
  for (Isa i : {Isa::neon, Isa::neon_bf16})
    if (compiled(i) && supported(i)) best = i;
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

// Every Isa in enum order (attention.h numbers them 0, 1, ...), with its name
// in ATTN_FAST_ISA, set_isa and the tests.
constexpr std::pair<Isa, const char*> kIsas[] = {
    {Isa::scalar, "scalar"}, {Isa::avx2, "avx2"},
    {Isa::avx512, "avx512"}, {Isa::avx512_bf16, "avx512_bf16"},
    {Isa::amx, "amx"},       {Isa::amx_emu, "amx_emu"},
    {Isa::neon, "neon"},     {Isa::neon_bf16, "neon_bf16"},
};
static_assert([] {
  for (int i = 0; i < static_cast<int>(std::size(kIsas)); ++i)
    if (static_cast<int>(kIsas[i].first) != i) return false;
  return true;
}());
}  // namespace

const char* isa_name(Isa isa) {
  const auto i = static_cast<size_t>(isa);
  return i < std::size(kIsas) ? kIsas[i].second : "?";
}

Isa parse_isa(const std::string& name) {
  std::string known;
  for (size_t i = 0; i < std::size(kIsas); ++i) {
    if (name == kIsas[i].second) return kIsas[i].first;
    if (i > 0) known += i + 1 < std::size(kIsas) ? ", " : " or ";
    known += kIsas[i].second;
  }
  throw std::invalid_argument("unknown ISA '" + name + "' (expected " + known + ")");
}

std::vector<Isa> compiled_isas() {
  std::vector<Isa> out;
  for (const auto& entry : kIsas)
    if (compiled(entry.first)) out.push_back(entry.first);
  return out;
}

std::vector<Isa> available_isas() {
  std::vector<Isa> out;
  for (Isa i : compiled_isas())
    if (available(i)) out.push_back(i);
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
                             "' is not supported by this CPU/OS (" +
                             (isa == Isa::neon || isa == Isa::neon_bf16
                                  ? "HWCAP/HWCAP2 or sysctl hw.optional.arm: neon_bf16 needs "
                                    "FEAT_BF16, FEAT_I8MM and FEAT_FP16"
                                  : "CPUID/XCR0") +
                             ")" + (isa == Isa::amx ? std::string(": ") + amx_status() : ""));
  g_isa.store(static_cast<int>(isa));
}

CpuSignature cpu_signature() {
  CpuSignature sig;
#ifdef ATTN_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return sig;
  char v[13];
  std::memcpy(v, &b, 4);
  std::memcpy(v + 4, &d, 4);
  std::memcpy(v + 8, &c, 4);
  v[12] = 0;
  sig.vendor = v;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return sig;
  // Display family and model (Intel SDM / AMD APM, CPUID Fn0000_0001 EAX).
  const int base_family = static_cast<int>((a >> 8) & 0xf);
  sig.family = base_family + (base_family == 0xf ? static_cast<int>((a >> 20) & 0xff) : 0);
  sig.model = static_cast<int>((a >> 4) & 0xf);
  if (base_family == 0xf || base_family == 0x6) sig.model |= static_cast<int>((a >> 16) & 0xf) << 4;
#endif
  return sig;
}

namespace {
std::atomic<int> g_decode_pf{static_cast<int>(DecodePrefetch::auto_)};
}  // namespace

void set_decode_prefetch(DecodePrefetch p) { g_decode_pf.store(static_cast<int>(p)); }

DecodePrefetch decode_prefetch() {
  const auto p = static_cast<DecodePrefetch>(g_decode_pf.load());
  if (p != DecodePrefetch::auto_) return p;
  // l2 on Intel and on AMD Zen 4 (family 19h with the avx512 ISA available;
  // Zen 3 is family 19h without it): there the AVX-512 decode read 0.64-0.82x
  // (fp32) and 0.73-0.85x (bf16) of the l1 policy's time. l1 on Zen 3 and Zen 5
  // (family 1Ah), for which it was tuned (bench/notes_archive.md, dec4, dec6, zen4).
  static const DecodePrefetch by_cpu = [] {
    const CpuSignature s = cpu_signature();
    const bool zen4 = s.vendor == "AuthenticAMD" && s.family == 0x19 && available(Isa::avx512);
    return s.vendor == "GenuineIntel" || zen4 ? DecodePrefetch::l2 : DecodePrefetch::l1;
  }();
  return by_cpu;
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
// (kernel_entries.h), forwarded to the active ISA's object. bf16 calls on the
// ISAs with pair-product kernels take those (bf16_dot); every other call of
// such an ISA runs its base object (ATTN_DISPATCH: avx512, neon).
//
// bf16_dot<S>(): which pair-product kernel serves a forward, decode and
// backward call of storage S on the active ISA; nullptr: the base object's. The forward: each such
// ISA's own (AMX tiles on amx and amx_emu). Decode: vdpbf16ps Q K^T on avx512_bf16 only (amx and
// amx_emu keep the avx512 one: on Sapphire Rapids vdpbf16ps runs at half the fp32 FMA rate,
// README). The backward forms S as its forward did (kernels/flash_bwd_pairs.h): on avx512_bf16, amx
// and amx_emu by the avx512_bf16 object's vdpbf16ps pair sums (amx_emu's tiles add the same pairs
// in the same order; AMX hardware may add a pair's two products in the other
// order, amx_tiles.h), on neon_bf16 by that object's BFDOT sums.
template <typename S>
struct Bf16Dot {
  AttnStats (*forward)(const AttnArgs<S>&) = nullptr;
  void (*decode)(const DecodeArgs<S>&) = nullptr;
  void (*backward)(const BwdArgs<S>&) = nullptr;
};
template <typename S>
inline Bf16Dot<S> bf16_dot() {  // storage types other than bf16: none
  return {};
}
template <>
inline Bf16Dot<bf16_t> bf16_dot<bf16_t>() {
  const Isa isa = active_isa();
  Bf16Dot<bf16_t> t;
#ifdef ATTN_HAVE_AVX512_BF16
  if (isa == Isa::avx512_bf16)
    t = {isa_avx512_bf16::flash_forward_bf16, isa_avx512_bf16::decode_forward_bf16,
         isa_avx512_bf16::flash_backward_bf16};
  if (isa == Isa::amx || isa == Isa::amx_emu) t.backward = isa_avx512_bf16::flash_backward_bf16;
#endif
#ifdef ATTN_HAVE_AMX
  if (isa == Isa::amx) t.forward = isa_amx::flash_forward_bf16;
#endif
#ifdef ATTN_HAVE_AMX_EMU
  if (isa == Isa::amx_emu) t.forward = isa_amx_emu::flash_forward_bf16;
#endif
#ifdef ATTN_HAVE_NEON_BF16
  if (isa == Isa::neon_bf16)
    t = {isa_neon_bf16::flash_forward_bf16, isa_neon_bf16::decode_forward_bf16,
         isa_neon_bf16::flash_backward_bf16};
#endif
  (void)isa;
  return t;
}

#define ATTN_DEFINE_FORWARD(sfx, S)                        \
  AttnStats flash_forward(const AttnArgs<S>& a) {          \
    if (const auto f = bf16_dot<S>().forward) return f(a); \
    ATTN_DISPATCH(flash_forward_##sfx, a)                  \
  }
#define ATTN_DEFINE_DECODE(sfx, S)                           \
  void decode_forward(const DecodeArgs<S>& args) {           \
    DecodeArgs<S> a = args;                                  \
    a.prefetch_l2 = decode_prefetch() == DecodePrefetch::l2; \
    if (const auto f = bf16_dot<S>().decode) return f(a);    \
    ATTN_DISPATCH(decode_forward_##sfx, a)                   \
  }
#define ATTN_DEFINE_BACKWARD(sfx, S)                        \
  void flash_backward(const BwdArgs<S>& a) {                \
    if (const auto f = bf16_dot<S>().backward) return f(a); \
    ATTN_DISPATCH(flash_backward_##sfx, a)                  \
  }
ATTN_FORWARD_TYPES(ATTN_DEFINE_FORWARD)
ATTN_DECODE_TYPES(ATTN_DEFINE_DECODE)
// The coded KV encodings are ISA-free declarations: the baseline object's list.
const KvEncodingDesc* kv_encoding(const char* name, int* tag) {
  return isa_scalar::kv_encoding(name, tag);
}
ATTN_BACKWARD_TYPES(ATTN_DEFINE_BACKWARD)

// --- AMX: the tile product for tests, the self-check, the status line ---

void tdpbf16ps_tile(Isa isa, const uint16_t* a, const uint16_t* b, float* c) {
  if (isa != Isa::amx && isa != Isa::amx_emu)
    throw std::invalid_argument(std::string("tdpbf16ps_tile: '") + isa_name(isa) +
                                "' is not a tile ISA (amx or amx_emu)");
  if (!compiled(isa) || !supported(isa))
    throw std::runtime_error(std::string("ISA '") + isa_name(isa) + "' is not available here: " +
                             (isa == Isa::amx ? amx_status() : "no AVX512-BF16"));
#ifdef ATTN_HAVE_AMX
  if (isa == Isa::amx) return isa_amx::tdpbf16ps_tile(a, b, c);
#endif
#ifdef ATTN_HAVE_AMX_EMU
  if (isa == Isa::amx_emu) return isa_amx_emu::tdpbf16ps_tile(a, b, c);
#endif
  (void)a;
  (void)b;
  (void)c;
}

// The self-check of a tile path, run once before amx becomes the default (a
// path nobody could run where it was written must prove itself where it
// runs): a small bf16 attention with every feature the tile code touches
// (Lq = Lk = 37: row and key tails; d = 80: a padded pair tile; GQA 4 -> 2
// heads; causal plus a dense mask: partial tiles and panel column ranges) on
// the tile object and on the avx512 conversion path, compared within bf16
// rounding (O is rounded to bf16 and the tile path rounds P to bf16: a layout
// or packing error is O(1)). About 0.5 M multiply-adds: well under a
// millisecond.
bool amx_self_check(Isa isa, std::string* why) {
  if ((isa != Isa::amx && isa != Isa::amx_emu) || !compiled(isa) || !supported(isa)) {
    *why = std::string("self-check: '") + isa_name(isa) + "' is not an available tile ISA";
    return false;
  }
#ifdef ATTN_HAVE_AVX512
  constexpr int64_t Hq = 4, Hkv = 2, L = 37, D = 80;
  try {
    std::vector<bf16_t> q(Hq * L * D), k(Hkv * L * D), v(Hkv * L * D), o1(Hq * L * D),
        o2(Hq * L * D);
    std::vector<float> lse1(Hq * L), lse2(Hq * L);
    std::vector<uint8_t> mask(L * L);
    uint32_t state = 0x9E3779B9u;  // a fixed LCG: the same inputs in every process
    auto next = [&state] {
      state = state * 1664525u + 1013904223u;
      return static_cast<float>(state >> 8) * (4.0f / 16777216.0f) - 2.0f;  // [-2, 2)
    };
    for (auto* x : {&q, &k, &v})
      for (bf16_t& e : *x) e.bits = f32_to_bf16(next());
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < L; ++j) mask[i * L + j] = (i * 7 + j * 13) % 5 != 0;
    AttnArgs<bf16_t> a;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.B = 1;
    a.Hq = Hq;
    a.Hkv = Hkv;
    a.Lq = a.Lk = L;
    a.d = a.dv = D;
    a.sq = a.so = Strides4{Hq * L * D, L * D, D, 1};
    a.sk = a.sv = Strides4{Hkv * L * D, L * D, D, 1};
    a.scale = 1.0 / std::sqrt(static_cast<double>(D));
    a.causal = true;
    a.mask = mask.data();
    a.smask = Strides4{0, 0, L, 1};
    a.num_threads = 1;
    a.o = o1.data();
    a.lse = lse1.data();
#ifdef ATTN_HAVE_AMX
    if (isa == Isa::amx) isa_amx::flash_forward_bf16(a);
#endif
#ifdef ATTN_HAVE_AMX_EMU
    if (isa == Isa::amx_emu) isa_amx_emu::flash_forward_bf16(a);
#endif
    // ATTN_FAST_AMX_SELFCHECK=corrupt (tests): one output off by 1, as a wrong
    // tile kernel would be, to show that the check and the fallback work.
    if (const char* e = std::getenv("ATTN_FAST_AMX_SELFCHECK"))
      if (std::string(e) == "corrupt") {
        bf16_t& x = o1[o1.size() / 2];
        x.bits = f32_to_bf16(bf16_to_f32(x.bits) + 1.0f);
      }
    a.o = o2.data();
    a.lse = lse2.data();
    isa_avx512::flash_forward_bf16(a);
    double worst = 0;
    bool ok = true;
    for (size_t i = 0; i < o1.size(); ++i) {
      const double x = bf16_to_f32(o1[i].bits), y = bf16_to_f32(o2[i].bits);
      const double err = std::fabs(x - y);
      if (!(err <= 0.03 + 0.02 * std::fabs(y))) ok = false;  // NaN fails too
      if (err > worst || err != err) worst = err;
    }
    for (size_t i = 0; i < lse1.size(); ++i)
      if (!(lse1[i] == lse2[i] || std::fabs(lse1[i] - lse2[i]) <= 1e-2f)) ok = false;
    *why = std::string("self-check ") + (ok ? "passed" : "FAILED") +
           " (bf16, L = 37, d = 80, GQA, causal + mask, against avx512: max |O error| " +
           std::to_string(worst) + ")";
    return ok;
  } catch (const std::exception& e) {
    *why = std::string("self-check FAILED: ") + e.what();
    return false;
  }
#else
  *why = "self-check: no avx512 object to compare with";
  return false;
#endif
}

namespace {

struct AmxCheck {
  bool ok = false;
  std::string why;
};
AmxCheck& amx_check() {
  static AmxCheck c;
  return c;
}

bool amx_default_ok() {
  static const bool ok = [] {
    std::string why;
    const bool pass = amx_self_check(amx_candidate(), &why);
    amx_check().why = why;
    amx_check().ok = pass;
    return pass;
  }();
  return ok;
}

}  // namespace

std::string amx_status() {
  if (amx_candidate() == Isa::amx_emu) {
    std::string s = "amx_emu stands in for amx (ATTN_FAST_AMX_CANDIDATE=amx_emu, tests only); ";
    if (amx_check().why.empty()) return s + "the self-check runs when the default is chosen";
    return s + amx_check().why + (amx_check().ok ? "" : "; fell back to avx512_bf16 / avx512");
  }
  if (!compiled(Isa::amx))
    return "not compiled into this build (the compiler lacks -mamx-tile -mamx-bf16)";
  const CpuFeatures& f = features();
  if (!f.amx) {
    std::string s = std::string("unavailable: ") + f.amx_why;
#ifdef __linux__
    if (f.amx_cpu && f.amx_os && f.amx_errno) s += std::string(": ") + std::strerror(f.amx_errno);
#endif
    return s + "; bf16 runs avx512_bf16 or avx512";
  }
  if (amx_check().why.empty())
    return "available (CPUID, XCR0, permission); the self-check runs when amx is chosen by "
           "default";
  return std::string("available; ") + amx_check().why +
         (amx_check().ok ? "" : "; fell back to avx512_bf16 / avx512");
}

}  // namespace attn_fast
