// The additive score terms and the user masks of one row, shared by the fused
// forward and the backward (attention.h states the rule). Included by those per-ISA kernel
// sources inside their ISA namespace, after attn_fast/seq.h and
// ATTN_VEC_HEADER, like the vector headers: no static data.
#pragma once

// ALiBi and the additive bias of one row of scores s[0, cols) (query row i of
// sequence si, keys j0 .. j0 + cols - 1, head h), as the forward and the
// backward add them (attention.h: s -= slope * |i + off - j|; s += bias). A
// -inf bias masks the pair even when the score is NaN (a NaN in a masked-out
// K row must not leak): assign, do not add.
template <typename S, typename T>
inline void add_alibi_bias(const AttnArgs<S>& a, const SeqInfo& si, int64_t h, int64_t i,
                           int64_t j0, int64_t cols, T* s) {
  if (a.alibi) {
    const T slope = a.alibi[h];
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t dist = i + si.off - (j0 + j);
      s[j] -= slope * static_cast<T>(dist < 0 ? -dist : dist);
    }
  }
  if (a.bias) {
    const T neg_inf = -std::numeric_limits<T>::infinity();
    const T* brow = a.bias + si.b * a.sbias.b + h * a.sbias.h + i * a.sbias.l + j0 * a.sbias.d;
    for (int64_t j = 0; j < cols; ++j) {
      const T bj = brow[j * a.sbias.d];
      s[j] = bj == neg_inf ? neg_inf : s[j] + bj;
    }
  }
}

// The user masks of one row of scores s[0, cols) (query row i, keys j0 ..
// j0 + cols - 1, head h): keys the block-sparse layout or the dense mask hide
// become -inf. The layout block by block (no division per key), the dense
// mask as a select (vectorised where its keys are unit-stride).
template <typename S, typename T>
inline void mask_user_row(const AttnArgs<S>& a, const SeqInfo& si, int64_t h, int64_t i, int64_t j0,
                          int64_t cols, T* s) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  if (a.layout) {
    const uint8_t* L =
        a.layout + si.b * a.slayout.b + h * a.slayout.h + (i / a.layout_bq) * a.slayout.l;
    const int64_t bk = a.layout_bk;
    for (int64_t kb = j0 / bk; kb * bk < j0 + cols; ++kb)
      if (!L[kb * a.slayout.d])
        for (int64_t j = imax(kb * bk - j0, 0); j < imin((kb + 1) * bk - j0, cols); ++j)
          s[j] = neg_inf;
  }
  if (a.mask) {
    const uint8_t* M = a.mask + si.b * a.smask.b + h * a.smask.h + i * a.smask.l + j0 * a.smask.d;
    if (a.smask.d == 1) {
      for (int64_t j = 0; j < cols; ++j) s[j] = M[j] ? s[j] : neg_inf;
    } else {
      for (int64_t j = 0; j < cols; ++j)
        if (!M[j * a.smask.d]) s[j] = neg_inf;
    }
  }
}
