// The additive score terms of one row, shared by the fused forward and the
// backward (attention.h states the rule). Included by those per-ISA kernel
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
