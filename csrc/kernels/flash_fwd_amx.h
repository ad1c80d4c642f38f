// The AMX tile product path of the flash forward (flash_fwd.cpp): the amx and
// amx_emu objects run bf16 storage through it, over the tile plan and tile
// micro-kernels of amx_tiles.h. K and V keep the pair path's layouts
// (flash_fwd_dot.h) with the pair count of d padded to whole B tiles; Q is
// row-major pairs (a unit-stride row is its pairs already, so it is copied).
//
//   S = Q K^T    amx_qk_panel per (16 query rows, 64-key panel): 4 C tiles, Q
//                as the A tile in chunks of 32 dims
//   raw scores   no softcap, ALiBi or bias and scale > 0 (the usual case): S
//                stays unscaled, each row's maximum is folded at the tile store
//                on whole tiles (amx_qk_panel_raw), and the softmax computes
//                P = 2^(s scale log2 e - m log2 e) by one FMA and the degree-4
//                exp2 of bf16 weights, writing P as bf16 pairs in its pass
//   O += P V     two row panels at a time (amx_pv_panel2: each V tile serves
//                both), on the raw path issued between the next pair's softmax
//                rows (softmax_pv); a V block with an inf/NaN takes the guarded
//                product (AMX multiplies 0 x NaN = NaN too)
// Blocks default to Br = 96, Bc = 512: the fixed costs per key block and row
// and the K/V tile loads per product halve (bench/NOTES.md, #prefill-amx).
//
// Not `#pragma once`: included once, inside flash_fwd.cpp's ISA namespace of
// the two AMX objects, after flash_fwd_dot.h.

// The hardware invariants the generic kernel's shapes must meet (not tuning knobs).
static_assert(kMR == AmxPlan::kRows, "a micro-panel is one tile's rows of queries");
static_assert(kNR * Vec<float>::W == AmxPlan::kPanel, "a key panel is the 4 C tiles' columns");
static_assert(2 * AmxPlan::kPairs == 32, "an A tile holds 32 bf16 of reduction: 32 keys of P");

// The column range, in pairs of whole 32-key A tiles, of row panels p and p + 1
// together (P is exactly 0 outside each row's keys, element_masks); empty: lo == hi.
inline void pair_columns(const int64_t* pc, int64_t p, int64_t* c2lo, int64_t* c2hi) {
  const bool e0 = pc[2 * p + 1] <= pc[2 * p], e1 = pc[2 * p + 3] <= pc[2 * p + 2];
  if (e0 && e1) {
    *c2lo = *c2hi = 0;
    return;
  }
  const int64_t lo = e0 ? pc[2 * p + 2] : e1 ? pc[2 * p] : imin(pc[2 * p], pc[2 * p + 2]);
  const int64_t hi = e0 ? pc[2 * p + 3] : e1 ? pc[2 * p + 1] : imax(pc[2 * p + 1], pc[2 * p + 3]);
  *c2lo = lo / 32 * 16;
  *c2hi = (hi + 31) / 32 * 16;
}

// O += P V for one row panel at i over its columns, whole 32-key A tiles
// (the weights outside are exactly 0).
inline void amx_pv_single(Scratch<float>& sc, int64_t i, const uint32_t* Pw, const uint32_t* Vw,
                          int64_t Bc, int64_t dvp) {
  const int64_t c_lo = sc.pc[2 * (i / kMR)], c_hi = sc.pc[2 * (i / kMR) + 1];
  if (c_hi > c_lo)
    amx_pv_panel(*sc.tiles, Pw + i * sc.lds, sc.lds, c_lo / 32 * 16, (c_hi + 31) / 32 * 16, Vw, Bc,
                 dvp, sc.O + i * dvp);
}

// The path's interface to the generic kernel (flash_fwd.cpp, ProductPath).
struct AmxPath : PairPacking<AmxPlan::kPairs> {
  static constexpr int W = Vec<float>::W;
  static constexpr bool kFuseMax = false;  // the raw path folds its maxima in the tile store
  static constexpr bool kPairs = true, kRaw = true;
  static constexpr int64_t kBlockK = 512;
  static constexpr bool kTallQ = true;

  // Floats per key slot and Q row: the padded pairs need more than d when d < 16.
  static int64_t k_elems(int64_t d) { return imax(d, pairs(d)); }

  // Row-major unscaled bf16 pairs, padded to pairs(d): the A tiles of amx_qk_panel.
  static void pack_q(const AttnArgs<S>& a, const S* qbase, int64_t i0, int64_t rows, int64_t rows_p,
                     T* Qp) {
    const int64_t d = a.d, d2p = pairs(d);
    uint32_t* Qw = reinterpret_cast<uint32_t*>(Qp);
    for (int64_t r = 0; r < rows_p; ++r) {
      const S* src = qbase + (i0 + r) * a.sq.l;
      uint32_t* dst = Qw + r * d2p;
      if (r < rows && a.sq.d == 1) {  // a unit-stride row is its pairs already
        std::memcpy(dst, src, sizeof(S) * d);
        uint16_t* h = reinterpret_cast<uint16_t*>(dst);
        for (int64_t e = d; e < 2 * d2p; ++e) h[e] = 0;
        continue;
      }
      for (int64_t k2 = 0; k2 < d2p; ++k2)
        dst[k2] = r < rows && 2 * k2 < d ? bf16_pair(src, a.sq.d, 2 * k2, d) : 0u;
    }
  }
  // raw: S unscaled, with the row maxima folded into sc.rmax when fuse_max.
  template <bool kMax = false>
  static void qk_panel(const AttnArgs<S>& a, Scratch<T>& sc, const T* Kt, int64_t i, int64_t jv,
                       bool raw, bool fuse_max, const int32_t* /*lim*/ = nullptr) {
    static_assert(!kMax, "the tile path folds its row maxima at the tile store");
    const int64_t d2p = pairs(a.d);
    const uint32_t* Qw = reinterpret_cast<const uint32_t*>(sc.Qp) + i * d2p;
    const uint32_t* Kw = reinterpret_cast<const uint32_t*>(Kt) + jv * d2p;
    if (raw)
      amx_qk_panel_raw(*sc.tiles, Qw, d2p, Kw, sc.S + i * sc.lds + jv, sc.lds,
                       fuse_max ? sc.rmax + i * W : nullptr);
    else
      amx_qk_panel(*sc.tiles, Qw, d2p, Kw, static_cast<float>(a.scale), sc.S + i * sc.lds + jv,
                   sc.lds);
  }

  // O += P V: two row panels at a time over the union of their column ranges,
  // then a last single one.
  static void pv_tile(Scratch<T>& sc, const T* Vp, int64_t rows, int64_t rows_p, int64_t cols,
                      int64_t cols_p, int64_t Bc, int64_t dvp, bool nonfinite, bool pairs) {
    if (nonfinite) {
      pv_block_guarded_dot(sc.S, sc.lds, rows, cols, Vp, Bc, dvp, sc.O);
      return;
    }
    if (!pairs) p_to_bf16(sc.S, sc.lds, rows_p, cols_p);
    const uint32_t* Pw = reinterpret_cast<const uint32_t*>(sc.S);
    const uint32_t* Vw = reinterpret_cast<const uint32_t*>(Vp);
    int64_t i = 0;
    for (; i + 2 * kMR <= rows_p; i += 2 * kMR) {
      int64_t c2lo, c2hi;
      pair_columns(sc.pc, i / kMR, &c2lo, &c2hi);
      if (c2hi <= c2lo) continue;
      amx_pv_panel2(*sc.tiles, Pw + i * sc.lds, Pw + (i + kMR) * sc.lds, sc.lds, c2lo, c2hi, Vw, Bc,
                    dvp, sc.O + i * dvp, sc.O + (i + kMR) * dvp);
    }
    for (; i < rows_p; i += kMR) amx_pv_single(sc, i, Pw, Vw, Bc, dvp);
  }

  // The softmax and P V of a tile on the raw path with P as pairs (no inf/NaN
  // in the V block): the rows two row panels at a time (softmax_row(r) for
  // r < rows, the padding rows' P = 0), and between the rows of each pair the
  // k-steps of the previous pair's P V (AmxPvJob), so that the tile unit
  // multiplies while the vector units compute exponentials. Each output
  // element gets the sums of pv_tile in the same order: the same bits.
  template <typename RowFn>
  static void softmax_pv(Scratch<T>& sc, int64_t rows, int64_t rows_p, int64_t cols_p, int64_t dvp,
                         const T* Vp, int64_t Bc, RowFn&& softmax_row) {
    AmxTiles& t = *sc.tiles;
    const uint32_t* Pw = reinterpret_cast<const uint32_t*>(sc.S);
    const uint32_t* Vw = reinterpret_cast<const uint32_t*>(Vp);
    AmxPvJob job;
    int64_t per_row = 0;
    const int64_t npan = rows_p / kMR;
    for (int64_t p = 0; p < npan; p += 2) {
      const int64_t r0 = p * kMR, r1 = imin(rows_p, r0 + 2 * kMR);
      for (int64_t r = r0; r < r1; ++r) {
        if (r < rows)
          softmax_row(r);
        else
          for (int64_t j = 0; j < cols_p; ++j) sc.S[r * sc.lds + j] = 0.f;
        job.step(t, per_row);
      }
      job.step(t, -1);  // the previous pair's products, all of them
      if (p + 1 < npan) {
        int64_t c2lo, c2hi;
        pair_columns(sc.pc, p, &c2lo, &c2hi);
        job = AmxPvJob(Pw + r0 * sc.lds, Pw + (r0 + kMR) * sc.lds, sc.lds, c2lo, c2hi, Vw, Bc, dvp,
                       sc.O + r0 * dvp, sc.O + (r0 + kMR) * dvp);
        const int64_t next_rows = imin(rows_p, r0 + 4 * kMR) - imin(rows_p, r0 + 2 * kMR);
        per_row = next_rows > 0 ? (job.total_steps() + next_rows - 1) / next_rows : -1;
      } else {
        amx_pv_single(sc, r0, Pw, Vw, Bc, dvp);  // a last single panel
      }
    }
    job.step(t, -1);
  }
};
