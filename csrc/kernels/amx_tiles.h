// The AMX-BF16 tile layer of the bf16 forward (flash_fwd.cpp, issue 19): one
// tile plan, the two micro-kernels written against it, and two implementations
// of the tile operations that share every line above them.
//
//   amx      (ATTN_ISA_AMX, -mamx-tile -mamx-bf16): ldtilecfg / tileloadd /
//            tdpbf16ps / tilestored / tilezero / tilerelease.
//   amx_emu  (ATTN_ISA_AMX_EMU, AVX512-BF16 only): the same operations on an
//            in-memory register file of 8 tiles x 16 rows x 64 bytes, held by
//            the thread's AmxTiles object. It exists so that the packing,
//            indexing and tails of the tile path are tested on CPUs without
//            AMX (it is never chosen by default).
//
// Not `#pragma once`: included once, inside the ISA namespace of flash_fwd.cpp
// (after vec_avx512.h, whose Vec<float> and DotBf16 it uses). Defines nothing
// outside the two AMX objects except kAmxTiles = false.
//
// Tile plan (every tile configured 16 rows x 64 bytes, palette 1):
//   tmm0-3  C: fp32 accumulators, 16 rows x 16 columns each, 4 side by side =
//           one 64-key panel of S (Q K^T) or one 64-column strip of O (P V)
//   tmm4    A: 16 rows x 32 bf16 (Q rows x 32 dims, or P rows x 32 keys)
//   tmm5-6  B: 16 pair-rows x 16 columns of bf16 pairs (VNNI: one 32-bit word
//           holds the two values of consecutive reduction indices), loaded
//           alternately so a load can overlap the previous product
//   tmm7    A of a second row panel (P V over two row panels: amx_pv_panel2,
//           where C is 2 row panels x 2 column tiles and each B tile, the V
//           read from L2, serves both panels)
// Layouts (flash_fwd.cpp packs them):
//   Q  row-major bf16 pairs, Qw[r * d2p + k2] = (q[r][2k2], q[r][2k2+1]);
//      d2p = the pair count padded to a multiple of 16 (d to 32) with zeros
//   K  the vdpbf16ps path's panels of 64 keys, pair-major: word (k2, c) of a
//      panel at Kw[k2 * 64 + c] = (k[c][2k2], k[c][2k2+1]): the 32-bit-word
//      transpose of K, which is TDPBF16PS's B layout as it stands
//   P  the vdpbf16ps path's in-place bf16 rows of S: row r's word c2 =
//      (p[r][2c2], p[r][2c2+1]), row stride lds words: the A layout
//   V  the vdpbf16ps path's strips (64 columns, then 16-column tails), word
//      (c2, e) = (v[2c2][e], v[2c2+1][e]): key pairs interleaved, the B layout
//   O  the fp32 accumulator rows (stride dvp), loaded into C and stored back
//
// Numerics. TDPBF16PS computes, per C element, C += a0 b0 + a1 b1 over each
// pair (products of bf16 values are exact in fp32), treats bf16 denormals as
// zero and flushes fp32 denormal results, rounding to nearest even. The
// emulation does each pair with vdpbf16ps, which has the same rules; the one
// difference allowed by the two instructions' descriptions is the order in
// which the pair's two products and the accumulator are added (one rounding
// either way, but not necessarily the same bits). Tests therefore compare the
// emulated and real products to a float64 loop within fp32 rounding, never
// bit for bit across the two.

#if defined(ATTN_ISA_AMX) || defined(ATTN_ISA_AMX_EMU)
constexpr bool kAmxTiles = true;

// The tile shapes, once (the kernels below and the pack routines use these).
struct AmxPlan {
  static constexpr int kRows = 16;   // rows of every tile: query rows per micro-panel
  static constexpr int kPairs = 16;  // pair-rows of a B tile: 32 bf16 of reduction per product
  static constexpr int kCols = 16;   // fp32 columns of a C tile
  static constexpr int kPanel = 64;  // keys (QK^T) or output columns (PV) per 4 C tiles
  static constexpr int kA = 4, kB0 = 5, kB1 = 6, kA1 = 7;
};

// The 64-byte LDTILECFG block (palette 1), every tile used 16 x 64 bytes.
struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  AmxConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = AmxPlan::kRows;
    }
  }
};
static_assert(sizeof(AmxConfig) == 64 && offsetof(AmxConfig, colsb) == 16 &&
                  offsetof(AmxConfig, rows) == 48,
              "the LDTILECFG layout: palette, start row, 14 reserved, colsb[16], rows[16]");

#if defined(ATTN_ISA_AMX)
// The real tile registers: configured by the constructor (once per thread, at
// the start of the parallel region), released by the destructor. The tile
// numbers must be literals in GCC's intrinsics: the templates pick them.
#define ATTN_TILE_EACH(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
class AmxTiles {
 public:
  AmxTiles() {
    const AmxConfig cfg;  // on the stack: no static data in the ISA objects
    _tile_loadconfig(&cfg);
  }
  ~AmxTiles() { _tile_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;

  template <int T>
  void load(const void* p, int64_t stride_bytes) {
#define ATTN_TILE_LOAD(n) \
  if constexpr (T == n) _tile_loadd(n, p, stride_bytes);
    ATTN_TILE_EACH(ATTN_TILE_LOAD)
#undef ATTN_TILE_LOAD
  }
  template <int T>
  void store(void* p, int64_t stride_bytes) {
#define ATTN_TILE_STORE(n) \
  if constexpr (T == n) _tile_stored(n, p, stride_bytes);
    ATTN_TILE_EACH(ATTN_TILE_STORE)
#undef ATTN_TILE_STORE
  }
  template <int T>
  void zero() {
#define ATTN_TILE_ZERO(n) \
  if constexpr (T == n) _tile_zero(n);
    ATTN_TILE_EACH(ATTN_TILE_ZERO)
#undef ATTN_TILE_ZERO
  }
  // C += A . B (TDPBF16PS): A is tmm4 or tmm7, B is tmm5 or tmm6, C one of tmm0-3.
  template <int C, int A, int B>
  void dp() {
    static_assert((A == AmxPlan::kA || A == AmxPlan::kA1) &&
                      (B == AmxPlan::kB0 || B == AmxPlan::kB1) && C >= 0 && C < 4,
                  "the tile plan: C in tmm0-3, A = tmm4 or tmm7, B = tmm5 or tmm6");
#define ATTN_TILE_DP(c)                                       \
  if constexpr (C == c) {                                     \
    if constexpr (A == AmxPlan::kA && B == AmxPlan::kB0)      \
      _tile_dpbf16ps(c, 4, 5);                                \
    else if constexpr (A == AmxPlan::kA && B == AmxPlan::kB1) \
      _tile_dpbf16ps(c, 4, 6);                                \
    else if constexpr (B == AmxPlan::kB0)                     \
      _tile_dpbf16ps(c, 7, 5);                                \
    else                                                      \
      _tile_dpbf16ps(c, 7, 6);                                \
  }
    ATTN_TILE_DP(0) ATTN_TILE_DP(1) ATTN_TILE_DP(2) ATTN_TILE_DP(3)
#undef ATTN_TILE_DP
  }
};
#undef ATTN_TILE_EACH
#else
// The emulated tile registers: 8 tiles x 16 rows x 64 bytes in memory, with
// the configured rows / bytes per row of each tile (AmxConfig), the parts a
// load does not write zeroed as on the hardware.
class AmxTiles {
 public:
  AmxTiles() {
    const AmxConfig cfg;
    for (int t = 0; t < 8; ++t) {
      rows_[t] = cfg.rows[t];
      colsb_[t] = cfg.colsb[t];
    }
  }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;

  template <int T>
  void load(const void* p, int64_t stride_bytes) {
    const __mmask64 m = colsb_mask(T);
    for (int r = 0; r < 16; ++r) {
      const __m512i x =
          r < rows_[T] ? _mm512_maskz_loadu_epi8(m, static_cast<const char*>(p) + r * stride_bytes)
                       : _mm512_setzero_si512();
      _mm512_store_si512(t_[T][r], x);
    }
  }
  template <int T>
  void store(void* p, int64_t stride_bytes) const {
    const __mmask64 m = colsb_mask(T);
    for (int r = 0; r < rows_[T]; ++r)
      _mm512_mask_storeu_epi8(static_cast<char*>(p) + r * stride_bytes, m,
                              _mm512_load_si512(t_[T][r]));
  }
  template <int T>
  void zero() {
    for (int r = 0; r < 16; ++r) _mm512_store_si512(t_[T][r], _mm512_setzero_si512());
  }
  // C[m][:] += sum over pair-rows k of A[m][pair k] . B[k][:] (TDPBF16PS),
  // each pair with one vdpbf16ps: M = rows of C, K = bytes per row of A / 4.
  template <int C, int A, int B>
  void dp() {
    static_assert(C != A && C != B, "TDPBF16PS needs three distinct tiles");
    const int M = rows_[C], K = colsb_[A] / 4;
    for (int m = 0; m < M; ++m) {
      Vec<float>::R acc = _mm512_load_ps(reinterpret_cast<const float*>(t_[C][m]));
      for (int k = 0; k < K; ++k)
        acc = DotBf16::dot(acc, DotBf16::set1(t_[A][m][k]), DotBf16::load(t_[B][k]));
      _mm512_store_ps(reinterpret_cast<float*>(t_[C][m]), acc);
    }
  }

 private:
  __mmask64 colsb_mask(int t) const {
    return colsb_[t] >= 64 ? ~__mmask64(0) : (__mmask64(1) << colsb_[t]) - 1;
  }
  alignas(64) uint32_t t_[8][16][16];
  int rows_[8] = {};
  int colsb_[8] = {};
};
#endif

// The C tiles 0-3 (a 16 x 64 fp32 panel) += the A tile (16 rows of kPairs
// bf16 pairs at a, row stride lda bytes) . four 16-column B panels side by
// side at b (pair-rows of row stride ldb bytes), loaded alternately into the
// two B tiles so each load overlaps the previous product.
inline void amx_dp_panel(AmxTiles& t, const uint32_t* a, int64_t lda, const uint32_t* b,
                         int64_t ldb) {
  t.load<AmxPlan::kA>(a, lda);
  t.load<AmxPlan::kB0>(b, ldb);
  t.dp<0, AmxPlan::kA, AmxPlan::kB0>();
  t.load<AmxPlan::kB1>(b + 16, ldb);
  t.dp<1, AmxPlan::kA, AmxPlan::kB1>();
  t.load<AmxPlan::kB0>(b + 32, ldb);
  t.dp<2, AmxPlan::kA, AmxPlan::kB0>();
  t.load<AmxPlan::kB1>(b + 48, ldb);
  t.dp<3, AmxPlan::kA, AmxPlan::kB1>();
}

// The C tiles 0-3 to a 16 x 64 fp32 panel at c (row stride ldc bytes).
inline void amx_store_panel(AmxTiles& t, float* c, int64_t ldc) {
  t.store<0>(c, ldc);
  t.store<1>(c + 16, ldc);
  t.store<2>(c + 32, ldc);
  t.store<3>(c + 48, ldc);
}

// C tiles 0-3 = Q rows . K panel^T: Qw 16 rows of d2p pairs (row-major), Kw
// one 64-key panel (d2p pair-rows x 64 words).
inline void amx_qk_tiles(AmxTiles& t, const uint32_t* Qw, int64_t d2p, const uint32_t* Kw) {
  constexpr int64_t kP = AmxPlan::kPanel;
  t.zero<0>();
  t.zero<1>();
  t.zero<2>();
  t.zero<3>();
  for (int64_t k2 = 0; k2 < d2p; k2 += AmxPlan::kPairs)
    amx_dp_panel(t, Qw + k2, d2p * 4, Kw + k2 * kP, kP * 4);
}

// S[16][64] = scale * (Q rows . K panel^T), S row stride lds floats. The scale
// multiplies S in fp32 after the product (scale * Q is never rounded to bf16).
inline void amx_qk_panel(AmxTiles& t, const uint32_t* Qw, int64_t d2p, const uint32_t* Kw,
                         float scale, float* S, int64_t lds) {
  constexpr int64_t kP = AmxPlan::kPanel;
  amx_qk_tiles(t, Qw, d2p, Kw);
  amx_store_panel(t, S, lds * 4);
  using V = Vec<float>;
  const V::R vs = V::set1(scale);
  for (int r = 0; r < AmxPlan::kRows; ++r)
    for (int n = 0; n < kP; n += V::W)
      V::store(S + r * lds + n, V::mul(V::load(S + r * lds + n), vs));
}

// S[16][64] = Q rows . K panel^T unscaled (the softmax folds the scale into its
// exponent: flash_fwd.cpp's raw scores); rmax (or nullptr): each row's maximum
// over the panel folded into its vector, rmax[r * 16 ..] = max(rmax[r * 16 ..],
// the row's 4 vectors), read back while the stored panel is in L1.
inline void amx_qk_panel_raw(AmxTiles& t, const uint32_t* Qw, int64_t d2p, const uint32_t* Kw,
                             float* S, int64_t lds, float* rmax) {
  amx_qk_tiles(t, Qw, d2p, Kw);
  amx_store_panel(t, S, lds * 4);
  if (!rmax) return;
  using V = Vec<float>;
  for (int r = 0; r < AmxPlan::kRows; ++r) {
    const float* s = S + r * lds;
    const V::R x =
        V::max(V::max(V::load(s), V::load(s + 16)), V::max(V::load(s + 32), V::load(s + 48)));
    V::store(rmax + r * V::W, V::max(V::load(rmax + r * V::W), x));
  }
}

// O[16][dvp] += P[16][2 c2lo .. 2 c2hi) . V over the strips of a packed V block
// (64-column strips: four C tiles; 16-column tail strips: one). Pw: the panel's
// bf16 P rows (row stride ldp words); c2lo, c2hi multiples of 16 pairs; Vw the
// block's strips (strip at column c0 starts at word c0 * Bc / 2).
inline void amx_pv_panel(AmxTiles& t, const uint32_t* Pw, int64_t ldp, int64_t c2lo, int64_t c2hi,
                         const uint32_t* Vw, int64_t Bc, int64_t dvp, float* O) {
  constexpr int64_t kP = AmxPlan::kPanel;
  for (int64_t c0 = 0; c0 < dvp;) {
    const int64_t width = c0 + kP <= dvp ? kP : AmxPlan::kCols;
    const uint32_t* strip = Vw + c0 * Bc / 2;
    float* Oc = O + c0;
    if (width == kP) {
      t.load<0>(Oc, dvp * 4);
      t.load<1>(Oc + 16, dvp * 4);
      t.load<2>(Oc + 32, dvp * 4);
      t.load<3>(Oc + 48, dvp * 4);
      for (int64_t c2 = c2lo; c2 < c2hi; c2 += AmxPlan::kPairs)
        amx_dp_panel(t, Pw + c2, ldp * 4, strip + c2 * kP, kP * 4);
      amx_store_panel(t, Oc, dvp * 4);
    } else {
      t.load<0>(Oc, dvp * 4);
      for (int64_t c2 = c2lo; c2 < c2hi; c2 += AmxPlan::kPairs) {
        t.load<AmxPlan::kA>(Pw + c2, ldp * 4);
        t.load<AmxPlan::kB0>(strip + c2 * AmxPlan::kCols, AmxPlan::kCols * 4);
        t.dp<0, AmxPlan::kA, AmxPlan::kB0>();
      }
      t.store<0>(Oc, dvp * 4);
    }
    c0 += width;
  }
}

// P V over two row panels (amx_pv_panel2, below) as a job issued a few
// k-steps at a time (step), so that the softmax of the next row panels can run
// between its tile instructions (flash_fwd.cpp's softmax_pv_interleaved).
struct AmxPvJob {
  const uint32_t* Pw0 = nullptr;
  const uint32_t* Pw1 = nullptr;
  int64_t ldp = 0, c2lo = 0, c2hi = 0;
  const uint32_t* Vw = nullptr;
  int64_t Bc = 0, dvp = 0;
  float* O0 = nullptr;
  float* O1 = nullptr;
  int64_t c0 = 0, h = 0, c2 = 0;  // the next k-step: strip c0, half h, pairs c2
  bool open = false;              // the C tiles hold O of (c0, h)

  AmxPvJob() = default;  // no products (done())
  AmxPvJob(const uint32_t* pw0, const uint32_t* pw1, int64_t ld, int64_t lo, int64_t hi,
           const uint32_t* vw, int64_t bc, int64_t dv, float* o0, float* o1)
      : Pw0(pw0), Pw1(pw1), ldp(ld), c2lo(lo), c2hi(hi), Vw(vw), Bc(bc), dvp(dv), O0(o0), O1(o1) {}

  bool done() const { return c2hi <= c2lo || c0 >= dvp; }
  // The k-steps of the whole job (4 products each, 2 on a 16-column tail strip).
  int64_t total_steps() const {
    if (c2hi <= c2lo) return 0;
    const int64_t per = (c2hi - c2lo) / AmxPlan::kPairs;
    const int64_t full = dvp / AmxPlan::kPanel, tails = (dvp % AmxPlan::kPanel) / AmxPlan::kCols;
    return per * (2 * full + tails);
  }
  // op(C tile, its O address) for the C tiles of the (c0, h) block: tmm0 /
  // tmm2 the first 16 columns of row panels 0 / 1, tmm1 / tmm3 the next 16
  // when the strip is full.
  template <typename Op>
  static void c_tiles(float* a0, float* a1, bool full, Op op) {
    op(std::integral_constant<int, 0>{}, a0);
    op(std::integral_constant<int, 2>{}, a1);
    if (full) {
      op(std::integral_constant<int, 1>{}, a0 + AmxPlan::kCols);
      op(std::integral_constant<int, 3>{}, a1 + AmxPlan::kCols);
    }
  }
  // Up to n k-steps (n < 0: all that is left).
  void step(AmxTiles& t, int64_t n) {
    constexpr int64_t kP = AmxPlan::kPanel, kC = AmxPlan::kCols;
    constexpr int kA = AmxPlan::kA, kA1 = AmxPlan::kA1, kB0 = AmxPlan::kB0, kB1 = AmxPlan::kB1;
    const int64_t lda = ldp * 4, ldo = dvp * 4;
    while (n != 0 && !done()) {
      const bool full = c0 + kP <= dvp;
      const uint32_t* strip = Vw + c0 * Bc / 2;
      float* a0 = O0 + c0 + h;
      float* a1 = O1 + c0 + h;
      if (!open) {
        c_tiles(a0, a1, full, [&](auto c, float* p) { t.load<decltype(c)::value>(p, ldo); });
        c2 = c2lo;
        open = true;
      }
      for (; n != 0 && c2 < c2hi; c2 += AmxPlan::kPairs, --n) {
        if (full) {
          const uint32_t* b = strip + c2 * kP + h;
          t.load<kA>(Pw0 + c2, lda);
          t.load<kB0>(b, kP * 4);
          t.dp<0, kA, kB0>();
          t.load<kB1>(b + kC, kP * 4);
          t.dp<1, kA, kB1>();
          t.load<kA1>(Pw1 + c2, lda);
          t.dp<2, kA1, kB0>();
          t.dp<3, kA1, kB1>();
        } else {
          t.load<kA>(Pw0 + c2, lda);
          t.load<kB0>(strip + c2 * kC, kC * 4);
          t.dp<0, kA, kB0>();
          t.load<kA1>(Pw1 + c2, lda);
          t.dp<2, kA1, kB0>();
        }
      }
      if (c2 < c2hi) return;  // n ran out inside this (c0, h)
      c_tiles(a0, a1, full, [&](auto c, float* p) { t.store<decltype(c)::value>(p, ldo); });
      open = false;
      if (full && h == 0) {
        h = 2 * kC;
      } else {
        h = 0;
        c0 += full ? kP : kC;
      }
    }
  }
};

// amx_pv_panel for two row panels at once (rows 0-15: P rows Pw0, O rows O0;
// rows 16-31: Pw1, O1), over one column range [2 c2lo, 2 c2hi) of keys: C is
// 2 row panels x 2 column tiles, so each V B tile (read from L2: a V block
// exceeds L1) serves both panels, half the V traffic of two amx_pv_panel
// calls. The sums per element are in the same order as amx_pv_panel's.
inline void amx_pv_panel2(AmxTiles& t, const uint32_t* Pw0, const uint32_t* Pw1, int64_t ldp,
                          int64_t c2lo, int64_t c2hi, const uint32_t* Vw, int64_t Bc, int64_t dvp,
                          float* O0, float* O1) {
  AmxPvJob(Pw0, Pw1, ldp, c2lo, c2hi, Vw, Bc, dvp, O0, O1).step(t, -1);
}

// One TDPBF16PS on caller memory, for the tests (and the real object's first
// use): c[16][16] += a[16][32 bf16] . b[16 pair-rows][16 words], unit-stride
// rows (64 bytes each).
inline void amx_tile_product(const uint16_t* a, const uint16_t* b, float* c) {
  AmxTiles t;
  t.load<0>(c, 64);
  t.load<AmxPlan::kA>(a, 64);
  t.load<AmxPlan::kB0>(b, 64);
  t.dp<0, AmxPlan::kA, AmxPlan::kB0>();
  t.store<0>(c, 64);
}
#else
constexpr bool kAmxTiles = false;
#endif
