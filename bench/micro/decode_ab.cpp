// Paired A/B of versions of the split-KV decode kernel (csrc/kernels/decode.cpp)
// in one process, across commits whose DecodeArgs differ: each version is
// built into a shared library of its own (this file with -DAB_LIB, against
// that version's headers), and the driver (this file without it) dlopens them
// all (RTLD_LOCAL: each keeps its own copy of the kernel) and times them in
// turn on the same K/V, round after round, the order rotating; per version it
// prints the median time over the rounds and the median of the per-round
// ratios to the first library (1 thread or more: ratios taken in the same
// round see the same machine). Every version's output is compared bit for bit
// with the first's. One token of 32 query heads against 8 kv heads of L keys,
// d = dv = 128 (AB_SHAPE="Hq,Hkv,d" another shape), K/V on transparent huge
// pages; wall time (AB_CLOCK=cpu: the thread's CPU time, for 1 thread on a
// loaded machine). The AVX2 object, or with
// -DATTN_ISA_AVX512 and the AVX-512 flags the AVX-512 one (the wheel's avx512
// build: the amx ISAs decode with it too), or with -DATTN_ISA_AVX512_BF16 and
// -mavx512bf16 added the avx512_bf16 one (mode 1 only: its bf16 decode, QK by
// vdpbf16ps); a library of an ISA the CPU lacks is refused before it runs
// (dec_isa).
//
//   FL="-O3 -mavx2 -mfma -mf16c -std=c++17 -fopenmp"
//   (AVX-512: FL="-O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma
//   -mf16c -std=c++17 -fopenmp -DATTN_ISA_AVX512")
//   mkdir -p /tmp/base && git archive REV csrc | tar -x -C /tmp/base
//   for t in /tmp/base .; do n=$(basename $(realpath $t)); g++ $FL -fPIC -shared
//     -fvisibility=hidden -DAB_LIB -I$t -I$t/csrc/include -I$t/csrc/kernels
//     bench/micro/decode_ab.cpp $t/csrc/interrupt.cpp -o /tmp/dab_$n.so; done  (one line)
//   g++ -O2 -std=c++17 bench/micro/decode_ab.cpp -ldl -o /tmp/dab
//   /tmp/dab MODE L THREADS ROUNDS /tmp/dab_base.so /tmp/dab_main.so
//   MODE: 0 fp32, 1 bf16, 2 int8 (KVCache's layout: keys per channel over
//   64-slot groups, values per token), 3 fp16. A commit before the int8 cache
//   (or the bf16 decode) builds with -DAB_FP32_ONLY and runs mode 0 only.
//   A library named NAME.so@p runs paged (PagedKVCache's layout: one chunk of
//   L / 64 pages of 64 slots, (pages, 8, 64, d), the pages in a fixed shuffled
//   order; AB_PAGE=P in the environment: pages of P slots, a multiple of 64
//   dividing L); NAME.so@c runs the paged code path over the contiguous K / V (the
//   pages of a kv head one after the other, in order). Same values, so every
//   variant's output is compared bit for bit with the first's as well.
//   A library built with -DAB_L2 runs the l2 prefetch policy
//   (DecodeArgs::prefetch_l2), without it the l1 policy, whatever the CPU.
#include <cstdio>
#include <cstdlib>
// Slots per page of the paged runs: AB_PAGE, else 64 (the driver checks it).
static long ab_page() {
  const char* e = std::getenv("AB_PAGE");
  return e && *e ? std::atol(e) : 64;
}
// The shape: AB_SHAPE="Hq,Hkv,d" in the environment (d = dv), else 32,8,128.
static void ab_shape(long* hq, long* hkv, long* d) {
  *hq = 32, *hkv = 8, *d = 128;
  const char* e = std::getenv("AB_SHAPE");
  if (e && *e) std::sscanf(e, "%ld,%ld,%ld", hq, hkv, d);
}
#if defined(AB_LIB)
#if !defined(ATTN_ISA_AVX512)
#define ATTN_ISA_AVX2 1
#endif
#include "csrc/kernels/decode.cpp"
#include <cmath>
#include <type_traits>
using namespace attn_fast;
// The object's ISA, for the driver to check against the CPU before any call
// (no vector code here).
extern "C" __attribute__((visibility("default"))) const char* dec_isa() {
#if defined(ATTN_ISA_AVX512_BF16)
  return "avx512_bf16";
#elif defined(ATTN_ISA_AVX512)
  return "avx512";
#else
  return "avx2";
#endif
}
extern "C" __attribute__((visibility("default"))) int dec_run(int mode, const void* q,
                                                              const void* k, const void* v, void* o,
                                                              float* lse, const float* const* sc,
                                                              long L, int nt, const long* table) {
  long Hq, Hkv, d;
  ab_shape(&Hq, &Hkv, &d);
  // mode + 16: paged, but the pages of a kv head lie one after the other as
  // in the contiguous cache (table in order; only the codes, the scales are
  // in the pool's layout): the paged code path over contiguous memory.
  const bool flat = mode >= 16;
  mode &= 15;
  auto fill = [&](auto& a) {
    a.lse = lse;
    a.B = 1, a.Hq = Hq, a.Hkv = Hkv, a.Lq = 1, a.R = L, a.d = d, a.dv = d;
    a.sq = {Hq * d, d, d, 1};
    a.sk = {Hkv * L * d, L * d, d, 1};
    a.sv = a.sk;
    a.so = a.sq;
    a.scale = 1 / std::sqrt(static_cast<double>(d));
    a.num_threads = nt;
#if defined(AB_L2)  // the l2 prefetch policy (decode.cpp, DecodeArgs::prefetch_l2)
    a.prefetch_l2 = true;
#endif
  };
  // Paged (table != null): k / v (and sc) are one chunk of L / P pages of P
  // slots (P = ab_page()), (L / P, Hkv, P, d); logical block j lives in page table[j].
  static const void* kc[1];
  static const void* vc[1];
  static const float* scc[4][1];
  auto page = [&](auto& a) {
    if (!table) return;
    a.block_table = reinterpret_cast<const int64_t*>(table);
    const long P = ab_page();
    a.max_blocks = L / P, a.block_size = P, a.chunk_blocks = L / P;
    a.sk = flat ? Strides4{P * d, L * d, d, 1} : Strides4{Hkv * P * d, P * d, d, 1};
    a.sv = a.sk;
    kc[0] = k, vc[0] = v;
    for (int i = 0; i < 4; i++) scc[i][0] = sc[i];
  };
#if !defined(AB_FP32_ONLY)
  // 16-bit K/V (mode 1 bf16, 3 fp16): the same call in the storage type S.
  auto run16 = [&](auto* tag, auto forward) {
    using S = std::remove_pointer_t<decltype(tag)>;
    DecodeArgs<S> a;
    fill(a);
    a.q = static_cast<const S*>(q), a.o = static_cast<S*>(o);
    a.k = static_cast<const S*>(k), a.v = static_cast<const S*>(v);
    page(a);
    if (table) {
      a.k_chunks = reinterpret_cast<const S* const*>(kc);
      a.v_chunks = reinterpret_cast<const S* const*>(vc);
    }
    forward(a);
    return 0;
  };
  if (mode == 1) return run16(static_cast<bf16_t*>(nullptr), ATTN_NS::decode_forward_bf16);
#if defined(ATTN_ISA_AVX512_BF16)
  return 1;  // the avx512_bf16 object decodes bf16 only
#else
  if (mode == 3) return run16(static_cast<fp16_t*>(nullptr), ATTN_NS::decode_forward_f16);
#endif
#endif
#if !defined(ATTN_ISA_AVX512_BF16)
  DecodeArgs<float> a;
  fill(a);
  a.q = static_cast<const float*>(q), a.o = static_cast<float*>(o);
  if (mode == 2) {
#if defined(AB_FP32_ONLY)
    return 1;
#else
    a.coding = 1;  // Int8Encoding, first in CodedEncodings
    a.kc = k, a.vc = v, a.group = 64;
    for (int i = 0; i < 4; ++i) a.aux[i] = sc[i];
    page(a);
    if (table) {
      a.kc = a.vc = nullptr;
      a.kc_chunks = reinterpret_cast<const void* const*>(kc);
      a.vc_chunks = reinterpret_cast<const void* const*>(vc);
      for (int i = 0; i < 4; ++i) a.aux[i] = nullptr, a.aux_chunks[i] = scc[i];
    }
#endif
  } else if (mode == 0) {
    a.k = static_cast<const float*>(k), a.v = static_cast<const float*>(v);
    page(a);
    if (table) {
      a.k_chunks = reinterpret_cast<const float* const*>(kc);
      a.v_chunks = reinterpret_cast<const float* const*>(vc);
    }
  } else {
    return 1;
  }
  ATTN_NS::decode_forward_f32(a);
  return 0;
#endif
}
#else
#include <dlfcn.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

typedef int (*Fn)(int, const void*, const void*, const void*, void*, float*, const float* const*,
                  long, int, const long*);

static void* huge_alloc(size_t bytes) {
  const size_t two = size_t(2) << 20;
  bytes = (bytes + two - 1) / two * two;
  void* p = std::aligned_alloc(two, bytes);
  if (!p) std::abort();
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 0, bytes);
  return p;
}

// Wall time, or with AB_CLOCK=cpu this thread's CPU time (one thread on a
// loaded machine: what the call itself costs).
static double now() {
  static const bool cpu = std::getenv("AB_CLOCK") && std::string(std::getenv("AB_CLOCK")) == "cpu";
  timespec t;
  clock_gettime(cpu ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static uint16_t bf16_bits(float x) {  // truncation is enough for test data
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>(u >> 16);
}
// |x| < 1 to IEEE half by truncation (tiny values flush to zero): test data.
static uint16_t f16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int e = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
  if (e <= 0) return static_cast<uint16_t>(sign);
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(e) << 10) | ((u >> 13) & 0x3ffu));
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s MODE L THREADS ROUNDS LIB.so [LIB.so ...]\n", argv[0]);
    return 2;
  }
  const int mode = std::atoi(argv[1]), th = std::atoi(argv[3]), rounds = std::atoi(argv[4]);
  const long L = std::atol(argv[2]);
  if (mode < 0 || mode > 3 || L < 64 || L % 64 || th < 1 || rounds < 1) {
    std::fprintf(stderr, "MODE 0..3, L a multiple of 64, THREADS and ROUNDS >= 1\n");
    return 2;
  }
  std::vector<Fn> fns;
  std::vector<std::string> names;
  std::vector<int> paged;  // 0 contiguous, 1 paged (NAME.so@p), 2 paged in order (NAME.so@c)
  for (int i = 5; i < argc; i++) {
    std::string file(argv[i]);
    if (file.size() > 2 && file[file.size() - 2] == '@') file.resize(file.size() - 2);
    void* h = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      std::fprintf(stderr, "%s\n", dlerror());
      return 1;
    }
    // Older libraries have no dec_isa: AVX2.
    typedef const char* (*IsaFn)();
    const IsaFn isa_fn = reinterpret_cast<IsaFn>(dlsym(h, "dec_isa"));
    const std::string isa = isa_fn ? isa_fn() : "avx2";
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const bool ok = isa == "avx512_bf16" ? avx512 && __builtin_cpu_supports("avx512bf16")
                    : isa == "avx512"
                        ? avx512
                        : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (!ok) {
      std::fprintf(stderr, "%s: an %s object, and this CPU lacks %s\n", file.c_str(), isa.c_str(),
                   isa.c_str());
      return 1;
    }
    fns.push_back(reinterpret_cast<Fn>(dlsym(h, "dec_run")));
    names.push_back(argv[i]);
    const size_t len = std::strlen(argv[i]);
    const char* tail = len > 2 ? argv[i] + len - 2 : "";
    paged.push_back(!std::strcmp(tail, "@p") ? 1 : !std::strcmp(tail, "@c") ? 2 : 0);
  }
  long Hq, Hkv, d;
  ab_shape(&Hq, &Hkv, &d);
  const long n = Hkv * L * d;
  const size_t es = mode == 0 ? 4 : mode == 2 ? 1 : 2;
  char* k = static_cast<char*>(huge_alloc(n * es));
  char* v = static_cast<char*>(huge_alloc(n * es));
  float* q = static_cast<float*>(huge_alloc(Hq * d * 4));
  float* o = static_cast<float*>(huge_alloc(Hq * d * 4));
  float* o0 = static_cast<float*>(huge_alloc(Hq * d * 4));
  float* lse = static_cast<float*>(huge_alloc(Hq * 4));
  const long ng = Hkv * L / 64 * d;
  float* sc[4] = {static_cast<float*>(huge_alloc(ng * 4)), static_cast<float*>(huge_alloc(ng * 4)),
                  static_cast<float*>(huge_alloc(Hkv * L * 4)),
                  static_cast<float*>(huge_alloc(Hkv * L * 4))};
  for (long i = 0; i < n; i++) {
    const float a = ((i * 2654435761u) % 1000) / 1000.f - 0.5f;
    const float b = ((i * 40503u) % 1000) / 1000.f - 0.5f;
    if (mode == 0) {
      reinterpret_cast<float*>(k)[i] = a, reinterpret_cast<float*>(v)[i] = b;
    } else if (mode == 1) {
      reinterpret_cast<uint16_t*>(k)[i] = bf16_bits(a);
      reinterpret_cast<uint16_t*>(v)[i] = bf16_bits(b);
    } else if (mode == 3) {
      reinterpret_cast<uint16_t*>(k)[i] = f16_bits(a);
      reinterpret_cast<uint16_t*>(v)[i] = f16_bits(b);
    } else {
      reinterpret_cast<int8_t*>(k)[i] = static_cast<int8_t>(a * 250);
      reinterpret_cast<int8_t*>(v)[i] = static_cast<int8_t>(b * 250);
    }
  }
  for (long i = 0; i < ng; i++) sc[0][i] = 0.004f, sc[1][i] = 0.001f;
  for (long i = 0; i < Hkv * L; i++) sc[2][i] = 0.004f, sc[3][i] = -0.001f;
  for (long i = 0; i < Hq * d; i++) {
    const float a = ((i * 7919u) % 1000) / 1000.f - 0.5f;
    if (mode == 1 || mode == 3)
      reinterpret_cast<uint16_t*>(q)[i] = mode == 1 ? bf16_bits(a) : f16_bits(a);
    else
      q[i] = a;
  }
  // The paged copy (a library named NAME.so@p): L / P pages of P slots in a
  // shuffled order (a fixed permutation), the same values as k / v.
  const long P = ab_page(), nb = L / P;
  if (P < 64 || P % 64 || L % P) {
    std::fprintf(stderr, "AB_PAGE must be a multiple of 64 dividing L, got %ld\n", P);
    return 2;
  }
  std::vector<long> table(nb);
  for (long j = 0; j < nb; j++) table[j] = j;
  uint64_t seed = 12345;
  for (long j = nb - 1; j > 0; j--) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(table[j], table[(seed >> 33) % (j + 1)]);
  }
  // The scales of k / v (KVCache's layout) in a pool's layout, logical block j
  // of kv head h in page tab[j].
  auto pool_scales = [&](const std::vector<long>& tab, float** dst) {
    for (int i = 0; i < 4; i++)
      dst[i] = static_cast<float*>(huge_alloc((i < 2 ? ng : Hkv * L) * 4));
    for (long h = 0; h < Hkv; h++)
      for (long j = 0; j < nb; j++) {
        const long bh = tab[j] * Hkv + h, gp = P / 64;  // key groups per page
        for (int i = 0; i < 2; i++)
          std::memcpy(dst[i] + bh * gp * d, sc[i] + (h * (L / 64) + j * gp) * d, gp * d * 4);
        for (int i = 2; i < 4; i++) std::memcpy(dst[i] + bh * P, sc[i] + h * L + j * P, P * 4);
      }
  };
  char* kp = static_cast<char*>(huge_alloc(n * es));
  char* vp = static_cast<char*>(huge_alloc(n * es));
  for (long h = 0; h < Hkv; h++)
    for (long j = 0; j < nb; j++) {
      const long src = (h * L + j * P) * d, dst = (table[j] * Hkv + h) * P * d;
      std::memcpy(kp + dst * es, k + src * es, P * d * es);
      std::memcpy(vp + dst * es, v + src * es, P * d * es);
    }
  float* scp[4];
  pool_scales(table, scp);
  // NAME.so@c: the paged code path over k / v themselves (pages in order,
  // a kv head's pages one after the other), the scales in the pool's layout.
  std::vector<long> order(nb);
  for (long j = 0; j < nb; j++) order[j] = j;
  float* sco[4];
  pool_scales(order, sco);
  auto call = [&](size_t j) {
    return paged[j] == 1   ? fns[j](mode, q, kp, vp, o, lse, scp, L, th, table.data())
           : paged[j] == 2 ? fns[j](mode + 16, q, k, v, o, lse, sco, L, th, order.data())
                           : fns[j](mode, q, k, v, o, lse, sc, L, th, nullptr);
  };
  const size_t nf = fns.size();
  if (call(0)) {
    std::fprintf(stderr, "%s cannot run mode %d\n", names[0].c_str(), mode);
    return 1;
  }
  const size_t os = mode == 1 || mode == 3 ? 2 : 4;  // bytes per output element
  std::memcpy(o0, o, Hq * d * os);
  for (size_t j = 0; j < nf; j++) {
    if (call(j)) {
      std::fprintf(stderr, "%s cannot run mode %d\n", names[j].c_str(), mode);
      return 1;
    }
    if (std::memcmp(o, o0, Hq * d * os))
      std::printf("# %s: output differs from the first's\n", names[j].c_str());
  }
  std::vector<std::vector<double> > t(nf), ratio(nf);
  for (int r = 0; r < rounds; r++) {
    std::vector<double> tr(nf);
    for (size_t s = 0; s < nf; s++) {
      const size_t j = r % 2 == 0 ? (s + r) % nf : (nf - 1 - s + r) % nf;
      double best = 1e30;
      for (int rep = 0; rep < 3; rep++) {
        const double t0 = now();
        call(j);
        best = std::min(best, now() - t0);
      }
      tr[j] = best;
    }
    for (size_t j = 0; j < nf; j++) t[j].push_back(tr[j]), ratio[j].push_back(tr[j] / tr[0]);
  }
  const double bytes = mode == 2 ? Hkv * L * (2.0 * d + 8 + 8.0 * d / 64) : 2.0 * n * es;
  std::printf("mode %d L %ld threads %d rounds %d (best of 3 calls per round)\n", mode, L, th,
              rounds);
  for (size_t j = 0; j < nf; j++) {
    std::vector<double> a = t[j], b = ratio[j];
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    const double med = a[a.size() / 2];
    std::printf("%-32s median %.3f ms (%.1f GB/s)  / first: %.3f [%.3f-%.3f]\n", names[j].c_str(),
                med * 1e3, bytes / med / 1e9, b[b.size() / 2], b[b.size() / 4],
                b[3 * b.size() / 4]);
  }
  return 0;
}
#endif
