// What a tile of the flash forward (flash_fwd.cpp) sees: the structural key
// range of each query row, the class of a tile under the structural and user
// masks (TileClass, attention.h), and the key columns of each micro-panel that
// the products compute (the rest are skipped, not multiplied by zero).
//
// Not `#pragma once`: included once, inside flash_fwd.cpp's ISA namespace,
// after Scratch and kMR.

// Tile classification against the block-sparse layout and the dense mask
// (TileClass, attention.h: the numbering Python's masks.block_summary uses).
template <typename T>
TileClass classify_user_masks(const AttnArgs<T>& a, const SeqInfo& si, int64_t h, int64_t i0,
                              int64_t rows, int64_t j0, int64_t cols) {
  bool any = false, all = true;
  if (a.layout) {
    const uint8_t* L = a.layout + si.b * a.slayout.b + h * a.slayout.h;
    const int64_t qb0 = i0 / a.layout_bq, qb1 = (i0 + rows - 1) / a.layout_bq;
    const int64_t kb0 = j0 / a.layout_bk, kb1 = (j0 + cols - 1) / a.layout_bk;
    for (int64_t x = qb0; x <= qb1; ++x)
      for (int64_t y = kb0; y <= kb1; ++y) {
        const bool vis = L[x * a.slayout.l + y * a.slayout.d] != 0;
        any = any || vis;
        all = all && vis;
      }
    if (!any) return TileClass::masked;
  }
  if (a.mask) {
    // A mask broadcast over the query axis (a key-padding mask: stride 0) is
    // the same row for every query: one row says it. Each row is an OR / AND
    // reduction without branches; the scan stops once the tile is known mixed.
    bool many = false, mall = true;
    const uint8_t* M = a.mask + si.b * a.smask.b + h * a.smask.h;
    const int64_t nr = a.smask.l == 0 ? imin(rows, 1) : rows;
    for (int64_t r = 0; r < nr && !(many && !mall); ++r) {
      const uint8_t* row = M + (i0 + r) * a.smask.l + j0 * a.smask.d;
      unsigned any_v = 0, all_v = 1;
      if (a.smask.d == 1) {
        for (int64_t c = 0; c < cols; ++c) {
          const unsigned vis = row[c] != 0;
          any_v |= vis;
          all_v &= vis;
        }
      } else {
        for (int64_t c = 0; c < cols; ++c) {
          const unsigned vis = row[c * a.smask.d] != 0;
          any_v |= vis;
          all_v &= vis;
        }
      }
      many = many || any_v;
      mall = mall && all_v;
    }
    if (!many) return TileClass::masked;
    all = all && mall;
  }
  return all ? TileClass::visible : TileClass::partial;
}

// Per-row structural key ranges [sc.lo[r], sc.hi[r]) of rows i0 .. i0+rows-1
// and their union [*jlo, *jhi) (empty: *jhi <= *jlo).
template <typename S, typename T>
void row_ranges(const AttnArgs<S>& a, const SeqInfo& si, int64_t i0, int64_t rows, Scratch<T>& sc,
                int64_t* jlo, int64_t* jhi) {
  int64_t lo = si.k_len, hi = 0;
  for (int64_t r = 0; r < rows; ++r) {
    row_range(a, si, i0 + r, &sc.lo[r], &sc.hi[r]);
    if (sc.hi[r] > sc.lo[r]) {
      lo = imin(lo, sc.lo[r]);
      hi = imax(hi, sc.hi[r]);
    }
  }
  *jlo = lo;
  *jhi = hi;
}

// The class of the tile (rows i0 .. i0+rows-1) x (keys j0 .. j0+cols-1):
// partial when a structural mask cuts it (rows are monotone in lo/hi) or the
// user masks make it mixed, masked when the user masks hide all of it.
template <typename S, typename T>
TileClass classify_tile(const AttnArgs<S>& a, const SeqInfo& si, int64_t h, int64_t i0,
                        int64_t rows, int64_t j0, int64_t cols, const Scratch<T>& sc) {
  bool partial = false;
  for (int64_t r = 0; r < rows; ++r)
    if (sc.lo[r] > j0 || sc.hi[r] < j0 + cols) {
      partial = true;
      break;
    }
  if (a.layout || a.mask) {
    const TileClass c = classify_user_masks(a, si, h, i0, rows, j0, cols);
    if (c == TileClass::masked) return c;
    partial = partial || c == TileClass::partial;
  }
  return partial ? TileClass::partial : TileClass::visible;
}

// 2. Panel column ranges: micro-panel p (rows p*kMR .. p*kMR + kMR-1) sees
// only the tile columns [sc.pc[2p], sc.pc[2p+1]) (all of [0, cols_p) on a
// tile no mask cuts); S = Q K^T and O += P V skip the rest.
template <typename T>
void panel_columns(Scratch<T>& sc, int64_t rows, int64_t rows_p, int64_t j0, int64_t cols,
                   int64_t cols_p, bool partial) {
  const int64_t npanels = rows_p / kMR;
  for (int64_t p = 0; p < npanels; ++p) {
    int64_t c_lo = cols_p, c_hi = 0;
    if (!partial) {
      c_lo = 0;
      c_hi = cols_p;
    } else {
      for (int64_t r = p * kMR; r < imin(rows, (p + 1) * kMR); ++r) {
        const int64_t lo = imax(sc.lo[r] - j0, 0), hi = imin(sc.hi[r] - j0, cols);
        if (hi > lo) {
          c_lo = imin(c_lo, lo);
          c_hi = imax(c_hi, hi);
        }
      }
    }
    if (c_hi <= c_lo) c_lo = c_hi = 0;
    sc.pc[2 * p] = c_lo;
    sc.pc[2 * p + 1] = c_hi;
  }
}
