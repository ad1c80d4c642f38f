// The bf16 pair product of S = Q K^T, shared by the forward's vdpbf16ps /
// BFDOT path (flash_fwd_dot.h; bf16_pair also packs the AMX path's panels) and
// the backward's scores on the same objects (flash_bwd_pairs.h): one 32-bit
// word holds two consecutive bf16 values of the reduction index d, and one
// DotBf16::dot adds W lanes x 2 exact products to fp32 accumulators.
//
// Invariant (why the backward calls this and not its FMA product): every
// element's sum starts at zero and adds its d2 pairs in order k = 0, 1, ...,
// one dot each, so its bits depend on its Q row and K column only, never on
// the tile shape or the layout around them (amx_emu's tiles add the same
// pairs in the same order, amx_tiles.h). The backward's S then equals the
// forward's bit for bit, and P = exp(S - lse) is exactly 1 where the
// forward's row had one visible key.
//
// Not `#pragma once`: included inside the ISA namespace of the pair-product
// objects (ATTN_DOT_BF16), after the vector header (DotBf16).

// The bf16 pair (x[e], x[e + 1]) of a strided row as one word; e + 1 == d pads with 0.
inline uint32_t bf16_pair(const bf16_t* x, int64_t stride, int64_t e, int64_t d) {
  const uint32_t lo = x[e * stride].bits, hi = e + 1 < d ? x[(e + 1) * stride].bits : 0u;
  return lo | (hi << 16);
}

// acc[r][n] += sum over the K pairs of A's row r . B columns n W .. n W + W - 1,
// in order k = 0, 1, ..., one dot each: word (k, r) of A at A[k * ak + r * ar],
// word (k, c) of B at B[k * ldb + c]. The one pair loop of S = Q K^T and O += P V.
template <int MR, int NR>
inline void pair_dot_acc(const uint32_t* __restrict A, int64_t ak, int64_t ar, int64_t K,
                         const uint32_t* __restrict B, int64_t ldb, Vec<float>::R (&acc)[MR][NR]) {
  using D = DotBf16;
  constexpr int W = Vec<float>::W;
  for (int64_t k = 0; k < K; ++k) {
    D::B b[NR];
    for (int n = 0; n < NR; ++n) b[n] = D::load(B + k * ldb + n * W);
    for (int r = 0; r < MR; ++r) {
      const D::B a = D::set1(A[k * ak + r * ar]);
      for (int n = 0; n < NR; ++n) acc[r][n] = D::dot(acc[r][n], a, b[n]);
    }
  }
}

// acc[r][n] = sum over the d2 pairs of Q row r . K columns n W .. n W + W - 1
// (unscaled): Qw a micro-panel of MR rows, word (k, r) at Qw[k * MR + r]; Kw
// pair-rows of ldk words, word (k, c) at Kw[k * ldk + c].
template <int MR, int NR>
inline void qk_pair_sums(const uint32_t* __restrict Qw, int64_t d2, const uint32_t* __restrict Kw,
                         int64_t ldk, Vec<float>::R (&acc)[MR][NR]) {
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = Vec<float>::zero();
  pair_dot_acc<MR, NR>(Qw, MR, 1, d2, Kw, ldk, acc);
}
