// The FMA product path of the flash forward (flash_fwd.cpp): S = Q K^T and
// O += P V as register-blocked FMA micro-tiles in the compute type
// compute_t<S> (float, double; bf16 / fp16 are widened to fp32 where they are
// packed, "convert on pack"). Every object runs it for every storage type
// except where a pair path takes bf16 (flash_fwd_dot.h, flash_fwd_amx.h).
//
// Layouts (k-major panels, so that each micro-kernel reads two streams):
//   Q  kMR-row panels, Qp[(r / kMR) * kMR * d + k * kMR + r % kMR], scaled
//   K  panels of kNR * W keys, Kt[(c / NRW) * d * NRW + k * NRW + c % NRW]
//   V  strips of kNR * W columns then W-wide tails, each a [Bc][width] panel
//      at col0 * Bc (vp_index)
// Hardware invariants (not tuning knobs): the micro-tile is IsaTraits
// (vec_*.h: MR x NR accumulators within the register file); the 16 x 16
// register transposes need W == 16 (AVX-512 float); a V chunk of pv_strip is
// at most one 32 KiB L1D. Why these shapes: bench/NOTES.md, #prefill-fp32.
//
// Not `#pragma once`: included once, inside flash_fwd.cpp's ISA namespace,
// after Scratch, kMR / kNR and ld_row.

// rmax[r*W ..] = max(rmax[r*W ..], row r of acc) for the fused row max of
// qk_micro / qk_micro_dot (max is exact: the same m as a pass over S). lim (or
// nullptr: every column counts): row r counts only the micro-tile's columns
// [lim[2r], lim[2r+1]) (0 <= lim <= NR*W), the others are masked for it.
template <int MR, int NR, typename R>
inline void fold_row_max(const R (&acc)[MR][NR], float* __restrict rmax,
                         const int32_t* __restrict lim) {
  using V = Vec<float>;
  for (int r = 0; r < MR; ++r) {
    R x = V::set1(NEG_INF<float>);
    if (!lim) {
      for (int n = 0; n < NR; ++n) x = V::max(x, acc[r][n]);
    } else {
#if defined(ATTN_ISA_AVX512)
      const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      const __m512i lo = _mm512_set1_epi32(lim[2 * r]), hi = _mm512_set1_epi32(lim[2 * r + 1]);
      for (int n = 0; n < NR; ++n) {
        const __m512i c = _mm512_add_epi32(iota, _mm512_set1_epi32(n * V::W));
        const __mmask16 vis = _mm512_cmpge_epi32_mask(c, lo) & _mm512_cmplt_epi32_mask(c, hi);
        x = _mm512_mask_max_ps(x, vis, x, acc[r][n]);
      }
#endif
    }
    V::store(rmax + r * V::W, V::max(V::load(rmax + r * V::W), x));
  }
}

// S[MR][NR*W] = Q[MR][d] * K^T for one micro-tile: Qp an MR-row panel, Kp a
// key panel (the layouts above); the inner loop is NR aligned loads, MR
// broadcasts and MR*NR FMAs. kMax: also the fused row max (fold_row_max).
template <typename T, int MR, int NR, bool kMax = false>
inline void qk_micro(const T* __restrict Qp, int64_t d, const T* __restrict Kp, T* __restrict S,
                     int64_t lds, T* __restrict rmax = nullptr,
                     const int32_t* __restrict lim = nullptr) {
  using V = Vec<T>;
  constexpr int W = V::W;
#if defined(ATTN_ISA_NEON)
  if constexpr (std::is_same<T, float>::value && MR == 6 && NR == 4 && !kMax)
    return qk_micro_neon_6x4(Qp, d, Kp, S, lds);  // the same sums (neon_tiles.h)
#endif
  typename V::R acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = V::zero();
  for (int64_t k = 0; k < d; ++k) {
    typename V::R b[NR];
    for (int n = 0; n < NR; ++n) b[n] = V::load(Kp + k * (NR * W) + n * W);
    for (int r = 0; r < MR; ++r) {
      const typename V::R a = V::set1(Qp[k * MR + r]);
      for (int n = 0; n < NR; ++n) acc[r][n] = V::fma(a, b[n], acc[r][n]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) V::store(S + r * lds + n * W, acc[r][n]);
  if constexpr (kMax) fold_row_max<MR, NR>(acc, rmax, lim);
}

// O[MR][NR*W] += P[MR][cols] * Vp[cols][ldv].
template <typename T, int MR, int NR>
inline void pv_micro(const T* __restrict P, int64_t ldp, int64_t cols, const T* __restrict Vp,
                     int64_t ldv, T* __restrict O, int64_t ldo) {
  using V = Vec<T>;
  constexpr int W = V::W;
  typename V::R acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = V::load(O + r * ldo + n * W);
  for (int64_t c = 0; c < cols; ++c) {
    typename V::R b[NR];
    for (int n = 0; n < NR; ++n) b[n] = V::load(Vp + c * ldv + n * W);
    for (int r = 0; r < MR; ++r) {
      const typename V::R a = V::set1(P[r * ldp + c]);
      for (int n = 0; n < NR; ++n) acc[r][n] = V::fma(a, b[n], acc[r][n]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) V::store(O + r * ldo + n * W, acc[r][n]);
}

// Element (c, e) of a packed V block (the strips above).
template <typename T>
inline int64_t vp_index(int64_t c, int64_t e, int64_t Bc, int64_t dvp) {
  constexpr int W = Vec<T>::W, NRW = kNR * W;
  int64_t col0 = e / NRW * NRW, width = NRW;
  if (col0 + NRW > dvp) {
    col0 = e / W * W;
    width = W;
  }
  return col0 * Bc + c * width + (e - col0);
}

// O += P V over one strip. Micro-panel p (rows p*kMR ..) reads only the
// columns [pc[2p], pc[2p+1]) (its weights outside are exactly zero). The keys
// go in chunks of kPvChunk (k0 outer, micro-panels inner) so that the chunk of
// the strip stays in L1 while every micro-panel reads it; O is stored and
// reloaded between chunks (exact) and each O element gets the same FMAs in
// the same key order, so the bits are those of one pass.
#ifndef ATTN_PV_CHUNK_BYTES
#define ATTN_PV_CHUNK_BYTES 32768
#endif
template <typename T, int NR>
constexpr int64_t kPvChunk = ATTN_PV_CHUNK_BYTES / (NR * Vec<T>::W * int64_t(sizeof(T))) > 64
                                 ? ATTN_PV_CHUNK_BYTES / (NR * Vec<T>::W * int64_t(sizeof(T)))
                                 : 64;
template <typename T, int NR>
inline void pv_strip(const T* P, int64_t ldp, int64_t rows_p, const int64_t* pc, const T* Vstrip,
                     T* O, int64_t ldo, int64_t col0) {
  constexpr int W = Vec<T>::W;
  int64_t c_max = 0;
  for (int64_t i = 0; i < rows_p; i += kMR) c_max = imax(c_max, pc[2 * (i / kMR) + 1]);
  for (int64_t k0 = 0; k0 < c_max; k0 += kPvChunk<T, NR>) {
    const int64_t k1 = k0 + kPvChunk<T, NR>;
    for (int64_t i = 0; i < rows_p; i += kMR) {
      const int64_t c_lo = imax(k0, pc[2 * (i / kMR)]), c_hi = imin(k1, pc[2 * (i / kMR) + 1]);
      if (c_hi > c_lo)
        pv_micro<T, kMR, NR>(P + i * ldp + c_lo, ldp, c_hi - c_lo, Vstrip + c_lo * NR * W, NR * W,
                             O + i * ldo + col0, ldo);
    }
  }
}

// O[rows_p][dvp] += P[rows_p][cols] * V[cols][dvp]; rows_p % kMR == 0,
// dvp % W == 0; pc: the column range of each micro-panel (pv_strip).
template <typename T>
void pv_block(const T* P, int64_t ldp, int64_t rows_p, const int64_t* pc, const T* Vp, int64_t Bc,
              int64_t dvp, T* O) {
  constexpr int W = Vec<T>::W;
  int64_t c0 = 0;
  for (; c0 + kNR * W <= dvp; c0 += kNR * W)
    pv_strip<T, kNR>(P, ldp, rows_p, pc, Vp + c0 * Bc, O, dvp, c0);
  for (; c0 < dvp; c0 += W) pv_strip<T, 1>(P, ldp, rows_p, pc, Vp + c0 * Bc, O, dvp, c0);
}

// NaN-safe P*V for tiles whose V block holds a non-finite value: weights that
// are exactly zero (masked pairs) are skipped instead of multiplied.
template <typename T>
void pv_block_guarded(const T* P, int64_t ldp, int64_t rows, int64_t cols, const T* Vp, int64_t Bc,
                      int64_t dvp, T* O) {
  using V = Vec<T>;
  constexpr int W = V::W;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const T p = P[r * ldp + c];
      if (p == T(0)) continue;
      const typename V::R a = V::set1(p);
      for (int64_t e = 0; e < dvp; e += W)
        V::store(O + r * dvp + e,
                 V::fma(a, V::load(Vp + vp_index<T>(c, e, Bc, dvp)), V::load(O + r * dvp + e)));
    }
}

// Rows [0, n_p) of a strided source (row r at base + r * ldr, element e at
// + e * sd) as k-major panels of PW rows: dst[(r / PW) * PW * d + e * PW +
// r % PW] = row r's element e (times scale when kScale); rows [n, n_p) zero.
// Any strides, one value at a time: the Q and K panels of the general case.
template <int PW, bool kScale, typename S, typename T>
void pack_panels_strided(const S* base, int64_t ldr, int64_t sd, int64_t n, int64_t n_p, int64_t d,
                         T scale, T* out) {
  for (int64_t r = 0; r < n_p; ++r) {
    T* dst = out + (r / PW) * PW * d + r % PW;
    if (r < n) {
      const S* src = base + r * ldr;
      for (int64_t e = 0; e < d; ++e)
        dst[e * PW] = kScale ? ld(src + e * sd) * scale : ld(src + e * sd);
    } else {
      for (int64_t e = 0; e < d; ++e) dst[e * PW] = T(0);
    }
  }
}

// Whether Vec<T> has store_transposed16 / store_interleaved6 (the AVX-512
// float vector does).
template <typename V, typename = void>
struct HasTranspose16 : std::false_type {};
template <typename V>
struct HasTranspose16<
    V, std::void_t<decltype(V::store_transposed16(static_cast<float*>(nullptr), int64_t(0),
                                                  static_cast<const typename V::R*>(nullptr)))>>
    : std::true_type {};
template <typename V, typename = void>
struct HasInterleave6 : std::false_type {};
template <typename V>
struct HasInterleave6<
    V, std::void_t<decltype(V::store_interleaved6(static_cast<float*>(nullptr),
                                                  static_cast<const typename V::R*>(nullptr)))>>
    : std::true_type {};

// The K panels from unit-stride key rows, 16 keys x 16 dims per register
// transpose (16 loads and 16 stores where the element loop does 256 of each);
// the values are copied (or widened exactly), so the panels are the same.
template <typename S, typename T>
void pack_k_rows16(const S* kbase, int64_t ldk, int64_t cols, int64_t cols_p, int64_t d, T* Kt) {
  using V = Vec<T>;
  constexpr int NRW = kNR * V::W;
  static_assert(V::W == 16 && NRW % 16 == 0, "16-key groups inside a panel");
  for (int64_t c0 = 0; c0 < cols_p; c0 += 16) {  // cols_p is a multiple of NRW
    T* panel = Kt + (c0 / NRW) * d * NRW + c0 % NRW;
    const int64_t n = imax(0, imin(16, cols - c0));  // real keys of this group
    int64_t e = 0;
    for (; e + 16 <= d; e += 16) {
      typename V::R x[16];
      for (int r = 0; r < 16; ++r)
        x[r] = r < n ? Storage<S>::load(kbase + (c0 + r) * ldk + e) : V::zero();
      V::store_transposed16(panel + e * NRW, NRW, x);
    }
    for (; e < d; ++e)
      for (int r = 0; r < 16; ++r)
        panel[e * NRW + r] = r < n ? ld(kbase + (c0 + r) * ldk + e) : T(0);
  }
}

// The six source rows of a 6-row Q panel starting at row i (rows past the n
// real ones point at the first: they are never read as values); returns n.
template <typename S>
inline int64_t panel_rows6(const S* qbase, int64_t ldq, int64_t i, int64_t left,
                           const S* (&src)[6]) {
  const int64_t n = imax(0, imin(6, left));
  for (int r = 0; r < 6; ++r) src[r] = qbase + (i + (r < n ? r : 0)) * ldq;
  return n;
}

// The Q panels from unit-stride rows, 6-row panels: W columns of the panel's
// six rows loaded, scaled and interleaved in registers (six stores instead of
// 6 W scalar ones); the same products as the element loop, so the same bits.
template <typename S>
void pack_q_rows6(const AttnArgs<S>& a, const S* qbase, int64_t i0, int64_t rows, int64_t rows_p,
                  compute_t<S>* Qp) {
  using T = compute_t<S>;
  using V = Vec<T>;
  constexpr int W = V::W;
  const int64_t d = a.d;
  const T scale = static_cast<T>(a.scale);
  const typename V::R vs = V::set1(scale);
  for (int64_t r0 = 0; r0 < rows_p; r0 += 6) {
    T* dst = Qp + r0 * d;
    const S* src[6];
    const int64_t n = panel_rows6(qbase, a.sq.l, i0 + r0, rows - r0, src);
    int64_t e = 0;
    for (; e + W <= d; e += W) {
      typename V::R x[6];
      for (int r = 0; r < 6; ++r)
        x[r] = r < n ? V::mul(Storage<S>::load(src[r] + e), vs) : V::zero();
      V::store_interleaved6(dst + e * 6, x);
    }
    for (; e < d; ++e)
      for (int r = 0; r < 6; ++r) dst[e * 6 + r] = r < n ? ld(src[r] + e) * scale : T(0);
  }
}

// The packed V strips of one block (keys [cols, cols_p) and columns past dv
// zero); returns whether the block holds an inf or NaN. x * 0 summed over the
// block is NaN iff some x is: four partial sums, so that the check is not one
// chain of dependent adds.
template <typename S>
bool pack_v_strips(const AttnArgs<S>& a, const S* vbase, int64_t cols, int64_t cols_p, int64_t Bc,
                   compute_t<S>* Vp) {
  using T = compute_t<S>;
  using V = Vec<T>;
  constexpr int W = V::W, NRW = kNR * W;
  const int64_t dv = a.dv, dvp = round_up(dv, W);
  typename V::R bad[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
  for (int64_t col0 = 0; col0 < dvp;) {
    const int64_t width = col0 + NRW <= dvp ? NRW : W;
    T* panel = Vp + col0 * Bc;
    for (int64_t c = 0; c < cols_p; ++c) {
      T* dst = panel + c * width;
      const int64_t n = c < cols ? imax(0, imin(width, dv - col0)) : 0;
      const S* src = vbase + c * a.sv.l + col0 * a.sv.d;
      if (a.sv.d == 1 && n == width) {  // a whole unit-stride row: copy and check in one pass
        for (int64_t e = 0, i = 0; e < width; e += W, i = (i + 1) & 3) {
          const typename V::R x = Storage<S>::load(src + e);
          V::store(dst + e, x);
          bad[i] = V::add(bad[i], V::mul(x, V::zero()));
        }
        continue;
      }
      if (a.sv.d == 1) {
        ld_row(src, dst, n);
      } else {
        for (int64_t e = 0; e < n; ++e) dst[e] = ld(src + e * a.sv.d);
      }
      for (int64_t e = n; e < width; ++e) dst[e] = T(0);
      for (int64_t e = 0; e < width; e += W)
        bad[0] = V::add(bad[0], V::mul(V::load(dst + e), V::zero()));
    }
    col0 += width;
  }
  const T b = V::hsum(V::add(V::add(bad[0], bad[1]), V::add(bad[2], bad[3])));
  return b != T(0) || b != b;
}

// The micro-tile's accumulators leave registers for the NR panel loads and a
// broadcast, so that the inner loop never spills (the scalar object has no
// register budget: its "vectors" are the compiler's).
template <typename Isa, typename = void>
struct FitsRegisters : std::true_type {};
template <typename Isa>
struct FitsRegisters<Isa, std::void_t<decltype(Isa::kRegs)>>
    : std::bool_constant<Isa::kMR * Isa::kNR + Isa::kNR + 1 <= Isa::kRegs> {};
static_assert(FitsRegisters<IsaTraits>::value,
              "the MR x NR accumulators, NR loads and one broadcast fit the register file");

// The path's interface to the generic kernel (flash_fwd.cpp, ProductPath).
template <typename S>
struct FmaPath {
  using T = compute_t<S>;
  static constexpr int W = Vec<T>::W, NRW = kNR * W;
  // The fused row max needs a masked vector max (AVX-512, fp32 compute).
  static constexpr bool kFuseMax = W == 16 && std::is_same<T, float>::value;
  static constexpr bool kPairs = false, kRaw = false;  // P stays T; S is always scaled
  static constexpr int64_t kBlockK = 256;              // keys per block (bench/NOTES.md)
  static constexpr bool kTallQ = false;                // Br = 48 unless K/V leave L2

  static int64_t k_elems(int64_t d) { return d; }

  // Q rows i0 .. i0+rows-1, scaled, as kMR-row panels; zero rows up to rows_p.
  static void pack_q(const AttnArgs<S>& a, const S* qbase, int64_t i0, int64_t rows, int64_t rows_p,
                     T* Qp) {
    if constexpr (HasInterleave6<Vec<T>>::value)
      if (kMR == 6 && a.sq.d == 1) return pack_q_rows6(a, qbase, i0, rows, rows_p, Qp);
    pack_panels_strided<kMR, true>(qbase + i0 * a.sq.l, a.sq.l, a.sq.d, rows, rows_p, a.d,
                                   static_cast<T>(a.scale), Qp);
  }
  // Keys [0, cols) of the block as panels, zero keys up to cols_p.
  static void pack_k(const AttnArgs<S>& a, const S* kbase, int64_t cols, int64_t cols_p, T* Kt) {
    if constexpr (HasTranspose16<Vec<T>>::value)
      if (a.sk.d == 1) return pack_k_rows16(kbase, a.sk.l, cols, cols_p, a.d, Kt);
    pack_panels_strided<NRW, false>(kbase, a.sk.l, a.sk.d, cols, cols_p, a.d, T(1), Kt);
  }
  static bool pack_v(const AttnArgs<S>& a, const S* vbase, int64_t cols, int64_t cols_p, int64_t Bc,
                     T* Vp) {
    return pack_v_strips(a, vbase, cols, cols_p, Bc, Vp);
  }

  // S for micro-panel i x key panel jv (scaled); kMax: with the fused row max.
  template <bool kMax = false>
  static void qk_panel(const AttnArgs<S>& a, Scratch<T>& sc, const T* Kt, int64_t i, int64_t jv,
                       bool /*raw*/, bool /*fuse_max*/, const int32_t* lim = nullptr) {
    const int64_t d = a.d;
    if constexpr (kMax)
      qk_micro<T, kMR, kNR, true>(sc.Qp + i * d, d, Kt + jv * d, sc.S + i * sc.lds + jv, sc.lds,
                                  sc.rmax + i * W, lim);
    else
      qk_micro<T, kMR, kNR>(sc.Qp + i * d, d, Kt + jv * d, sc.S + i * sc.lds + jv, sc.lds);
  }

  // O += P V; the NaN-safe product when the V block holds an inf/NaN.
  static void pv_tile(Scratch<T>& sc, const T* Vp, int64_t rows, int64_t rows_p, int64_t cols,
                      int64_t /*cols_p*/, int64_t Bc, int64_t dvp, bool nonfinite, bool /*pairs*/) {
    if (nonfinite)
      pv_block_guarded<T>(sc.S, sc.lds, rows, cols, Vp, Bc, dvp, sc.O);
    else
      pv_block<T>(sc.S, sc.lds, rows_p, sc.pc, Vp, Bc, dvp, sc.O);
  }
};
