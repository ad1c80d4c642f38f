// The AMX tile micro-kernels of kernels/amx_tiles.h alone, on one core: cycles
// (TSC) per TDPBF16PS for the QK^T panel (with and without its store and row
// max) and the P V panel (one or two row panels at a time), with the B operand
// (K or V) resident in L1 or streamed from L2, against the tile peak of 16
// cycles per TDPBF16PS (16 x 16 x 32 multiply-adds: 1024 FLOPs per cycle).
// The answer to "is the tile path limited by the tiles, their loads, or the
// fp32 work between them" (bench/notes_archive.md, amx5).
//
//   g++ -O3 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx2 \
//       -mfma -mf16c -mamx-tile -mamx-bf16 -DATTN_ISA_AVX512 -DATTN_ISA_AVX512_BF16 \
//       -DATTN_ISA_AMX -Icsrc/include -Icsrc/kernels bench/micro/amx_tiles.cpp -o /tmp/amx_tiles
//   taskset -c 0 /tmp/amx_tiles [d [Bc]]        (defaults 128, 512)
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <type_traits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "attn_fast/attention.h"
#include "attn_fast/seq.h"

#include "isa.h"

namespace attn_fast {
namespace ATTN_NS {
#include ATTN_VEC_HEADER
namespace {
#include "toolkit.h"
#include "amx_tiles.h"
}  // namespace
}  // namespace ATTN_NS
}  // namespace attn_fast

using namespace attn_fast::ATTN_NS;

template <typename F>
static double cycles_per_dp(F&& f, int64_t dps, int reps) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const uint64_t t0 = __rdtsc();
    f();
    t.push_back(double(__rdtsc() - t0) / dps);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::perror("arch_prctl(ARCH_REQ_XCOMP_PERM)");
    return 1;
  }
  const int64_t d = argc > 1 ? std::atol(argv[1]) : 128, Bc = argc > 2 ? std::atol(argv[2]) : 512;
  const int64_t d2p = (d / 2 + 15) / 16 * 16, dvp = d, lds = Bc + 16;
  const int64_t rows = 96;  // one Q block of the kernel's default
  auto words = [](int64_t n) {
    auto* p = static_cast<uint32_t*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64));
    for (int64_t i = 0; i < n; ++i) p[i] = 0x3F803F80u ^ (uint32_t(i * 2654435761u) & 0x00070007u);
    return p;
  };
  uint32_t* Q = words(rows * d2p);
  uint32_t* K = words(Bc * d2p);      // Bc / 64 panels of d2p pair-rows x 64 words
  uint32_t* V = words(Bc / 2 * dvp);  // strips of 64 columns, Bc / 2 pair-rows each
  float* S = static_cast<float*>(std::aligned_alloc(64, rows * lds * 4));
  float* O = static_cast<float*>(std::aligned_alloc(64, rows * dvp * 4));
  float* rmax = static_cast<float*>(std::aligned_alloc(64, rows * 16 * 4));
  std::memset(S, 0, rows * lds * 4);
  std::memset(O, 0, rows * dvp * 4);
  for (int64_t i = 0; i < rows * 16; ++i) rmax[i] = -1e30f;
  AmxTiles t;
  const int reps = 51;
  const int64_t npan = Bc / 64, nrp = rows / 16;
  const int64_t qk_dps = npan * nrp * 4 * (d2p / 16);
  const int64_t pv_dps = nrp * (dvp / 16) * (Bc / 32);
  std::printf("d = %ld, Bc = %ld, %ld query rows; TSC ticks per TDPBF16PS\n", static_cast<long>(d),
              static_cast<long>(Bc), static_cast<long>(rows));
  // QK^T as the kernel runs it: key panel outer (that panel, 64 x d2p words, in L1),
  // the 6 row panels inner.
  const double qk_tiles = cycles_per_dp(
      [&] {
        for (int64_t p = 0; p < npan; ++p)
          for (int64_t i = 0; i < nrp; ++i) {
            amx_qk_tiles(t, Q + i * 16 * d2p, d2p, K + p * 64 * d2p);
            amx_store_panel(t, S + i * 16 * lds + p * 64, lds * 4);
          }
      },
      qk_dps, reps);
  const double qk_raw = cycles_per_dp(
      [&] {
        for (int64_t p = 0; p < npan; ++p)
          for (int64_t i = 0; i < nrp; ++i)
            amx_qk_panel_raw(t, Q + i * 16 * d2p, d2p, K + p * 64 * d2p, S + i * 16 * lds + p * 64,
                             lds, rmax + i * 16 * 16);
      },
      qk_dps, reps);
  const double qk_scaled = cycles_per_dp(
      [&] {
        for (int64_t p = 0; p < npan; ++p)
          for (int64_t i = 0; i < nrp; ++i)
            amx_qk_panel(t, Q + i * 16 * d2p, d2p, K + p * 64 * d2p, 0.125f,
                         S + i * 16 * lds + p * 64, lds);
      },
      qk_dps, reps);
  // The products alone: the same panel over and over (everything in L1), no store.
  const double qk_l1 = cycles_per_dp(
      [&] {
        for (int64_t p = 0; p < npan * nrp; ++p) amx_qk_tiles(t, Q, d2p, K);
      },
      qk_dps, reps);
  const double qk_kstream = cycles_per_dp(
      [&] {
        for (int64_t p = 0; p < npan; ++p)
          for (int64_t i = 0; i < nrp; ++i)
            amx_qk_tiles(t, Q + i * 16 * d2p, d2p, K + p * 64 * d2p);
      },
      qk_dps, reps);
  const double qk_store_l1 = cycles_per_dp(
      [&] {
        for (int64_t p = 0; p < npan; ++p)
          for (int64_t i = 0; i < nrp; ++i) {
            amx_qk_tiles(t, Q + i * 16 * d2p, d2p, K + p * 64 * d2p);
            amx_store_panel(t, S, lds * 4);
          }
      },
      qk_dps, reps);
  std::printf("QK  K panels streamed, no store %.1f | store to one L1 panel %.1f\n", qk_kstream,
              qk_store_l1);
  std::printf(
      "QK  tiles + store %.1f | + row max (raw) %.1f | + scale pass %.1f | "
      "products only, one K panel %.1f\n",
      qk_tiles, qk_raw, qk_scaled, qk_l1);
  const uint32_t* P = reinterpret_cast<const uint32_t*>(S);
  const double pv1 = cycles_per_dp(
      [&] {
        for (int64_t i = 0; i < nrp; ++i)
          amx_pv_panel(t, P + i * 16 * lds, lds, 0, Bc / 2, V, Bc, dvp, O + i * 16 * dvp);
      },
      pv_dps, reps);
  const double pv2 = cycles_per_dp(
      [&] {
        for (int64_t i = 0; i < nrp; i += 2)
          amx_pv_panel2(t, P + i * 16 * lds, P + (i + 1) * 16 * lds, lds, 0, Bc / 2, V, Bc, dvp,
                        O + i * 16 * dvp, O + (i + 1) * 16 * dvp);
      },
      pv_dps, reps);
  // V of 64 keys only (in L1), the same number of products.
  const double pv_l1 = cycles_per_dp(
      [&] {
        for (int64_t i = 0; i < nrp * (Bc / 64); ++i) amx_pv_panel(t, P, lds, 0, 32, V, 64, dvp, O);
      },
      pv_dps, reps);
  std::printf("PV  one panel %.1f | two panels (pv_panel2) %.1f | 64-key V in L1 %.1f\n", pv1, pv2,
              pv_l1);
  // The tile unit alone: four C tiles, A and B resident, no loads.
  const double dp_only = cycles_per_dp(
      [&] {
        t.load<AmxPlan::kA>(Q, 64);
        t.load<AmxPlan::kB0>(K, 256);
        t.load<AmxPlan::kB1>(K + 16, 256);
        t.load<AmxPlan::kA1>(Q + 256, 64);
        for (int64_t i = 0; i < qk_dps / 4; ++i) {
          t.dp<0, AmxPlan::kA, AmxPlan::kB0>();
          t.dp<1, AmxPlan::kA, AmxPlan::kB1>();
          t.dp<2, AmxPlan::kA1, AmxPlan::kB0>();
          t.dp<3, AmxPlan::kA1, AmxPlan::kB1>();
        }
      },
      qk_dps, reps);
  // 2 x 2 with the four loads first, then the four products (k outer), one row
  // pair, B from the V strip: as amx_pv_panel2 but loads grouped.
  const double pv2_grouped = cycles_per_dp(
      [&] {
        for (int64_t i = 0; i < nrp; i += 2)
          for (int64_t c0 = 0; c0 < dvp; c0 += 32) {
            const uint32_t* strip = V + (c0 / 64 * 64) * Bc / 2 + c0 % 64;
            float* a0 = O + i * 16 * dvp + c0;
            float* a1 = a0 + 16 * dvp;
            t.load<0>(a0, dvp * 4);
            t.load<1>(a0 + 16, dvp * 4);
            t.load<2>(a1, dvp * 4);
            t.load<3>(a1 + 16, dvp * 4);
            for (int64_t c2 = 0; c2 < Bc / 2; c2 += 16) {
              t.load<AmxPlan::kA>(P + i * 16 * lds + c2, lds * 4);
              t.load<AmxPlan::kA1>(P + (i + 1) * 16 * lds + c2, lds * 4);
              t.load<AmxPlan::kB0>(strip + c2 * 64, 256);
              t.load<AmxPlan::kB1>(strip + c2 * 64 + 16, 256);
              t.dp<0, AmxPlan::kA, AmxPlan::kB0>();
              t.dp<1, AmxPlan::kA, AmxPlan::kB1>();
              t.dp<2, AmxPlan::kA1, AmxPlan::kB0>();
              t.dp<3, AmxPlan::kA1, AmxPlan::kB1>();
            }
            t.store<0>(a0, dvp * 4);
            t.store<1>(a0 + 16, dvp * 4);
            t.store<2>(a1, dvp * 4);
            t.store<3>(a1 + 16, dvp * 4);
          }
      },
      pv_dps, reps);
  // 2 x 2 QK^T: rows i, i + 16 x keys 32 at a time, loads grouped, k outer.
  const double qk2 = cycles_per_dp(
      [&] {
        for (int64_t p = 0; p < npan; ++p)
          for (int64_t i = 0; i < nrp; i += 2)
            for (int64_t h = 0; h < 64; h += 32) {
              t.zero<0>();
              t.zero<1>();
              t.zero<2>();
              t.zero<3>();
              const uint32_t* Kp = K + p * 64 * d2p + h;
              for (int64_t k2 = 0; k2 < d2p; k2 += 16) {
                t.load<AmxPlan::kA>(Q + i * 16 * d2p + k2, d2p * 4);
                t.load<AmxPlan::kA1>(Q + (i + 1) * 16 * d2p + k2, d2p * 4);
                t.load<AmxPlan::kB0>(Kp + k2 * 64, 256);
                t.load<AmxPlan::kB1>(Kp + k2 * 64 + 16, 256);
                t.dp<0, AmxPlan::kA, AmxPlan::kB0>();
                t.dp<1, AmxPlan::kA, AmxPlan::kB1>();
                t.dp<2, AmxPlan::kA1, AmxPlan::kB0>();
                t.dp<3, AmxPlan::kA1, AmxPlan::kB1>();
              }
              float* s0 = S + i * 16 * lds + p * 64 + h;
              t.store<0>(s0, lds * 4);
              t.store<1>(s0 + 16, lds * 4);
              t.store<2>(s0 + 16 * lds, lds * 4);
              t.store<3>(s0 + 16 * lds + 16, lds * 4);
            }
      },
      qk_dps, reps);
  std::printf(
      "tile unit alone %.1f | PV 2x2 loads grouped %.1f | QK 2x2 loads grouped + store %.1f\n",
      dp_only, pv2_grouped, qk2);
  // Overlap: the softmax-like vector pass of 32 rows (exp2 of bf16 weights, P stored as
  // pairs, the row sum) alone, one pair's P V job alone, and the two interleaved a
  // share of the job's k-steps after each row (flash_fwd.cpp's softmax_pv_interleaved).
  // Separate buffers (the job reads P from S, the vector pass reads X, writes Y).
  float* X = static_cast<float*>(std::aligned_alloc(64, 32 * lds * 4));
  float* Y = static_cast<float*>(std::aligned_alloc(64, 32 * lds * 4));
  for (int64_t i = 0; i < 32 * lds; ++i) X[i] = -0.001f * float(i % 977);
  float sink = 0;
  auto sm_row = [&](int64_t r) {
    using V = Vec<float>;
    float* x = X + r * lds;
    const V::R vc = V::set1(0.18f), vb = V::set1(-0.5f);
    V::R acc = V::zero();
    for (int64_t j = 0; j < Bc; j += 32) {
      const V::R p0 = V::exp2_neg_bf16(V::fma(V::load(x + j), vc, vb));
      const V::R p1 = V::exp2_neg_bf16(V::fma(V::load(x + j + 16), vc, vb));
      DotBf16::store_pairs(reinterpret_cast<uint16_t*>(Y + r * lds) + j, p0, p1);
      acc = V::add(acc, V::add(p0, p1));
    }
    sink += V::hsum(acc);
  };
  auto make_job = [&] {
    AmxPvJob job;
    job.Pw0 = P;
    job.Pw1 = P + 16 * lds;
    job.ldp = lds;
    job.c2lo = 0;
    job.c2hi = Bc / 2;
    job.Vw = V;
    job.Bc = Bc;
    job.dvp = dvp;
    job.O0 = O;
    job.O1 = O + 16 * dvp;
    return job;
  };
  const int64_t job_dps = 2 * (dvp / 16) * (Bc / 32);
  const double t_sm = cycles_per_dp(
      [&] {
        for (int64_t r = 0; r < 32; ++r) sm_row(r);
      },
      1, reps);
  const double t_job = cycles_per_dp([&] { make_job().step(t, -1); }, 1, reps);
  for (int div : {1, 2, 4}) {
    const double t_both = cycles_per_dp(
        [&] {
          AmxPvJob job = make_job();
          const int64_t per = (job.total_steps() + 32 * div - 1) / (32 * div);
          for (int64_t r = 0; r < 32; ++r) {
            sm_row(r);
            for (int k = 0; k < div; ++k) job.step(t, per);
          }
          job.step(t, -1);
        },
        1, reps);
    std::printf(
        "overlap (%ld products): vector pass %.0f, P V job %.0f, interleaved (%d step "
        "groups a row) %.0f ticks (sum %.0f, max %.0f)\n",
        static_cast<long>(job_dps), t_sm, t_job, div, t_both, t_sm + t_job, std::max(t_sm, t_job));
  }
  std::printf("(%g)\n", sink > 0 ? 0.0 : 1.0);
  return 0;
}
