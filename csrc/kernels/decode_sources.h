// Where the decode kernel's key blocks come from (csrc/kernels/decode.cpp):
// one source type, KvBlockSource<Layout, Encoding, Prefetch>, gives run_split
// each 64-key block as row pointers plus the encoding's per-block state, and
// sets up the hints (touch pass, next-block prefetch walk) for it.
//
//   Layout    where logical key j of sequence b lives:
//             Slots  one array of R slots per sequence (a plain K/V array,
//                    or a KV cache's ring: slot (kv_start[b] + j) mod R);
//             Pages  a block table over a pool of pages (PagedKVCache): a
//                    key block never crosses a page (cut at its end), so each
//                    block reads from one base pointer as Slots does. With
//                    pages a multiple of 64 keys and splits starting at
//                    multiples of 64 nothing is cut: bit-identical to Slots.
//   Encoding  how K / V rows are stored and read (one traits block each, in
//             the style of storage.h): the element type KV and its page
//             addresses (contiguous / page), the Q rows' load (load_q), the
//             block cut (cut), the per-block Q fold (begin), the row pointers
//             (rows), Q K^T (qk), the V weighting (weight_v) and the side data
//             to prefetch (prefetch_side).
//             FloatEncoding<S>   f32, f64, f16, bf16 rows as stored (S)
//             Bf16DotEncoding    bf16 on the avx512_bf16 / neon_bf16 object:
//                                Q K^T by the bf16 dot product on raw Q and K
//             Int8Encoding       int8 codes with fp32 scales (KVCache int8)
//             Fp8Encoding<F>     e4m3 / e5m2 codes with a per-token fp32 scale
//   Prefetch  PrefetchPolicy<T, KV> (decode_rows.h).
//
// A new coded encoding is one traits block here (with its KvEncodingDesc: the
// binding's checks) and its name in CodedEncodings: DecodeArgs carries any
// coded encoding's arrays (kc, vc, aux), and run_split and the driver never
// name a storage type.
//
// Included by decode.cpp inside its ISA namespace and anonymous namespace,
// after decode_rows.h.
#pragma once

// ---- per-thread scratch: one ThreadArena block (carve_scratch).
// ST: the storage type of q and o; KV: the encoding's row element type.
template <typename ST, typename KV, typename T = compute_t<ST>>
struct DScratch {
  T* Qs;            // kRB x dp query rows (scaled; or raw bf16 for the dot product)
  T* S;             // kRB x kBc scores / probabilities
  ST* Kpack;        // kBc x dp packed K block (only for strided d)
  ST* Vpack;        // kBc x dvp packed V block (only for strided dv)
  const KV** krow;  // the block's K rows (in the cache, or in Kpack)
  const KV** vrow;  // the block's V rows
  int64_t* lo;      // kRB: each row's visible key range [lo, hi)
  int64_t* hi;
  T* touch_sum;  // the touch pass's loads summed and stored, so the compiler keeps them
  T* Ob;         // dvp: one output row while the merge sums the splits (rounded once)
  T* Qg;         // kRB x dp: int8, Q with the block's key-group scales folded in
  T* qb;         // kRB: int8, Q . (the group's key offsets)
  T* pvs;        // kBc: int8, the block's value scales / offsets when the ring
  T* pvo;        //      wraps inside the block (copied in order)
};

template <typename ST, typename KV>
bool carve_scratch(ThreadArena& ar, DScratch<ST, KV>& sc, int64_t d, int64_t dv) {
  using T = compute_t<ST>;
  constexpr int W = Vec<T>::W;
  const int64_t dp = round_up(d, W), dvp = round_up(dv, W);
  const int64_t oQs = ar.plan<T>(kRB * dp), oS = ar.plan<T>(kRB * kBc);
  const int64_t oKp = ar.plan<ST>(kBc * dp), oVp = ar.plan<ST>(kBc * dvp);
  const int64_t okr = ar.plan<const KV*>(kBc), ovr = ar.plan<const KV*>(kBc);
  const int64_t olo = ar.plan<int64_t>(kRB), ohi = ar.plan<int64_t>(kRB);
  const int64_t ots = ar.plan<T>(1), oOb = ar.plan<T>(dvp), oQg = ar.plan<T>(kRB * dp);
  const int64_t oqb = ar.plan<T>(kRB), ops = ar.plan<T>(kBc), opo = ar.plan<T>(kBc);
  if (!ar.acquire()) return false;
  sc = {ar.at<T>(oQs),         ar.at<T>(oS),          ar.at<ST>(oKp),      ar.at<ST>(oVp),
        ar.at<const KV*>(okr), ar.at<const KV*>(ovr), ar.at<int64_t>(olo), ar.at<int64_t>(ohi),
        ar.at<T>(ots),         ar.at<T>(oOb),         ar.at<T>(oQg),       ar.at<T>(oqb),
        ar.at<T>(ops),         ar.at<T>(opo)};
  sc.touch_sum[0] = T(0);
  return true;
}

// Where one key block's rows start: row 0 of kv head hk of a sequence (Slots)
// or of a page (Pages), and the encoding's side data there.
template <typename KV, typename Side>
struct Page {
  const KV* k;
  const KV* v;
  Side side;
};
struct NoSide {};

// ---- encodings

// Rows stored as S (float, double, bf16_t, fp16_t), widened to compute_t<S>
// in registers as they are loaded (ldv). Strided rows (element stride != 1)
// are packed into Kpack / Vpack per block.
template <typename S>
struct FloatEncoding {
  using ST = S;
  using KV = S;
  using T = compute_t<S>;
  using Side = NoSide;
  using Pg = Page<KV, Side>;
  using Sc = DScratch<S, KV>;
  struct Blk {};
  static constexpr bool kPacks = true;

  static Pg contiguous(const DecodeArgs<S>& a, int64_t b, int64_t hk) {
    return {a.k + b * a.sk.b + hk * a.sk.h, a.v + b * a.sv.b + hk * a.sv.h, {}};
  }
  static Pg page(const DecodeArgs<S>& a, int64_t c, int64_t i, int64_t hk) {
    return {a.k_chunks[c] + i * a.sk.b + hk * a.sk.h, a.v_chunks[c] + i * a.sv.b + hk * a.sv.h, {}};
  }
  // One query row, scaled (Q K^T then needs no per-score multiply), zero-padded to dp.
  static void load_q(const S* src, int64_t sd, int64_t d, int64_t dp, T scale, T* dst) {
    for (int64_t e = 0; e < d; ++e) dst[e] = ld(src + e * sd) * scale;
    for (int64_t e = d; e < dp; ++e) dst[e] = T(0);
  }
  static int64_t cut(const DecodeArgs<S>&, int64_t, int64_t cols) { return cols; }
  static void begin(const DecodeArgs<S>&, const Sc&, const Pg&, int64_t, int, int64_t) {}
  static void rows(const DecodeArgs<S>& a, const Sc& sc, const Pg& pg, int64_t slot, int64_t cols,
                   bool kpack, bool vpack, Blk*) {
    if (!kpack && !vpack && slot + cols <= a.R) {  // in place, no wrap: a pointer walk
      const S* k = pg.k + slot * a.sk.l;
      const S* v = pg.v + slot * a.sv.l;
      for (int64_t c = 0; c < cols; ++c, k += a.sk.l, v += a.sv.l) sc.krow[c] = k, sc.vrow[c] = v;
      return;
    }
    const int64_t dp = round_up(a.d, Vec<T>::W), dvp = round_up(a.dv, Vec<T>::W);
    for (int64_t c = 0; c < cols; ++c) {
      sc.krow[c] =
          kpack ? pack(pg.k + slot * a.sk.l, a.sk.d, a.d, sc.Kpack + c * dp) : pg.k + slot * a.sk.l;
      sc.vrow[c] = vpack ? pack(pg.v + slot * a.sv.l, a.sv.d, a.dv, sc.Vpack + c * dvp)
                         : pg.v + slot * a.sv.l;
      if (++slot == a.R) slot = 0;
    }
  }
  static const S* pack(const S* src, int64_t sd, int64_t n, S* dst) {
    for (int64_t e = 0; e < n; ++e) dst[e] = src[e * sd];
    return dst;
  }
  static void qk(int nr, const Sc& sc, const Blk&, int64_t cols, int64_t d, int64_t dp, T, Pf* pf) {
    qk_dispatch<T, KV>(nr, sc.Qs, dp, sc.krow, cols, d, sc.S, kBc, pf);
  }
  static void weight_v(int, const Sc&, const Blk&, int64_t, T*, int64_t, int64_t) {}
  static void prefetch_side(const DecodeArgs<S>&, const Pg&, int64_t, int64_t, bool) {}
};

#if defined(ATTN_DOT_BF16)
// bf16 rows on the object with a bf16 dot product (avx512_bf16: vdpbf16ps;
// neon_bf16: BFDOT): Q K^T on the raw bf16 Q and K (qk_rows_dot: no widening,
// half the instructions), the scale applied to the fp32 scores; P V as
// FloatEncoding's (P is never rounded to bf16). Q rows keep their bf16 bits,
// 2 dp values per row of Qs, zero-padded.
struct Bf16DotEncoding : FloatEncoding<bf16_t> {
  static void load_q(const bf16_t* src, int64_t sd, int64_t d, int64_t dp, float, float* q) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(q);
    for (int64_t e = 0; e < d; ++e) std::memcpy(dst + e, src + e * sd, sizeof(uint16_t));
    for (int64_t e = d; e < 2 * dp; ++e) dst[e] = 0;
  }
  static void qk(int nr, const Sc& sc, const Blk&, int64_t cols, int64_t d, int64_t dp, float scale,
                 Pf* pf) {
    qk_dispatch_dot(nr, reinterpret_cast<const uint16_t*>(sc.Qs), 2 * dp, sc.krow, cols, d, scale,
                    sc.S, kBc, pf);
  }
};
#endif

// int8 codes (KVCache(dtype="int8")): keys x = q8 * ks
// + ko per channel over groups of `group` slots, values x = q8 * vs + vo per
// token. The scales never enter the d-long loops: a block is cut at its key
// group's end and the group's ks is folded into the block's Q rows (Qg = Qs *
// ks) and its ko into one bias per row (qb = Qs . ko, added to S); P * vs is
// the P V weight and (P . vo) is added to every O column. Bytes per key and
// kv head: d + dv codes + 8 + 8 d / kgroup (bench/NOTES.md#decode-int8).
// The types of an encoding of 8-bit codes with float32 scales beside them
// (float32 q, o and arithmetic; rows read in place at element stride 1, which
// the binding checks).
template <typename Code, typename SideT>
struct CodedTypes {
  using ST = float;
  using KV = Code;
  using T = float;
  using Side = SideT;
  using Pg = Page<KV, Side>;
  using Sc = DScratch<float, KV>;
  static constexpr bool kPacks = false;
};

struct Int8Side {
  const float* ks;  // (slots / kgroup, d) key scales / offsets
  const float* ko;
  const float* vs;  // (slots,) value scales / offsets
  const float* vo;
};
struct Int8Encoding : CodedTypes<int8_t, Int8Side> {
  static constexpr KvEncodingDesc kDesc = {
      "int8",
      true,
      true,
      4,
      {{"k_scale", true}, {"k_off", true}, {"v_scale", false}, {"v_off", false}}};
  struct Blk {
    const float* vs;  // the block's value scales / offsets, one per key
    const float* vo;
  };

  static Pg contiguous(const DecodeArgs<float>& a, int64_t b, int64_t hk) {
    const int64_t bh = b * a.Hkv + hk, per = (a.R / a.group) * a.d;
    return {static_cast<const KV*>(a.kc) + b * a.sk.b + hk * a.sk.h,
            static_cast<const KV*>(a.vc) + b * a.sv.b + hk * a.sv.h,
            {a.aux[0] + bh * per, a.aux[1] + bh * per, a.aux[2] + bh * a.R, a.aux[3] + bh * a.R}};
  }
  // A pool block is laid out as the contiguous cache's (B = 1, R = block_size).
  static Pg page(const DecodeArgs<float>& a, int64_t c, int64_t i, int64_t hk) {
    const int64_t bh = i * a.Hkv + hk, per = (a.block_size / a.group) * a.d;
    return {static_cast<const KV*>(a.kc_chunks[c]) + i * a.sk.b + hk * a.sk.h,
            static_cast<const KV*>(a.vc_chunks[c]) + i * a.sv.b + hk * a.sv.h,
            {a.aux_chunks[0][c] + bh * per, a.aux_chunks[1][c] + bh * per,
             a.aux_chunks[2][c] + bh * a.block_size, a.aux_chunks[3][c] + bh * a.block_size}};
  }
  static void load_q(const float* src, int64_t sd, int64_t d, int64_t dp, float scale, float* dst) {
    FloatEncoding<float>::load_q(src, sd, d, dp, scale, dst);
  }
  // key: the block's first key's slot position before the ring's modulo.
  static int64_t cut(const DecodeArgs<float>& a, int64_t key, int64_t cols) {
    return imin(cols, a.group - key % a.group);
  }
  // The block's key group: its scales folded into Qg, its offsets into qb
  // (W-lane vectors: a scalar bias chain was a tenth of a step).
  static void begin(const DecodeArgs<float>& a, const Sc& sc, const Pg& pg, int64_t slot, int nr,
                    int64_t dp) {
    using V = Vec<float>;
    constexpr int W = V::W;
    const int64_t d = a.d;
    const float* ks = pg.side.ks + slot / a.group * d;
    const float* ko = pg.side.ko + slot / a.group * d;
    for (int r = 0; r < nr; ++r) {
      const float* qs = sc.Qs + r * dp;
      float* qg = sc.Qg + r * dp;
      V::R bv = V::zero();
      int64_t e = 0;
      for (; e + W <= d; e += W) {
        const V::R qv = V::load(qs + e);
        V::store(qg + e, V::mul(qv, V::load(ks + e)));
        bv = V::fma(qv, V::load(ko + e), bv);
      }
      float b = V::hsum(bv);
      for (; e < d; ++e) {
        qg[e] = qs[e] * ks[e];
        b += qs[e] * ko[e];
      }
      for (; e < dp; ++e) qg[e] = 0.0f;
      sc.qb[r] = b;
    }
  }
  // Row pointers; the value scales read in place unless the ring wraps inside
  // the block (then copied in order).
  static void rows(const DecodeArgs<float>& a, const Sc& sc, const Pg& pg, int64_t slot,
                   int64_t cols, bool, bool, Blk* bk) {
    if (slot + cols <= a.R) {
      bk->vs = pg.side.vs + slot;
      bk->vo = pg.side.vo + slot;
      for (int64_t c = 0; c < cols; ++c) {
        sc.krow[c] = pg.k + (slot + c) * a.sk.l;
        sc.vrow[c] = pg.v + (slot + c) * a.sv.l;
      }
      return;
    }
    bk->vs = sc.pvs;
    bk->vo = sc.pvo;
    for (int64_t c = 0; c < cols; ++c) {
      sc.krow[c] = pg.k + slot * a.sk.l;
      sc.vrow[c] = pg.v + slot * a.sv.l;
      sc.pvs[c] = pg.side.vs[slot];
      sc.pvo[c] = pg.side.vo[slot];
      if (++slot == a.R) slot = 0;
    }
  }
  static void qk(int nr, const Sc& sc, const Blk&, int64_t cols, int64_t d, int64_t dp, float,
                 Pf* pf) {
    qk_dispatch<float, KV>(nr, sc.Qg, dp, sc.krow, cols, d, sc.S, kBc, pf);
    for (int r = 0; r < nr; ++r)
      for (int64_t c = 0; c < cols; ++c) sc.S[r * kBc + c] += sc.qb[r];
  }
  // P := P * vs, and O += (P . vo) 1 (vectors, as begin's fold).
  static void weight_v(int nr, const Sc& sc, const Blk& bk, int64_t cols, float* Op, int64_t dv,
                       int64_t dvp) {
    using V = Vec<float>;
    constexpr int W = V::W;
    for (int r = 0; r < nr; ++r) {
      float* prow = sc.S + r * kBc;
      V::R xv = V::zero();
      int64_t c = 0;
      for (; c + W <= cols; c += W) {
        const V::R pv = V::load(prow + c);
        xv = V::fma(pv, V::load(bk.vo + c), xv);
        V::store(prow + c, V::mul(pv, V::load(bk.vs + c)));
      }
      float ex = V::hsum(xv);
      for (; c < cols; ++c) {
        ex += prow[c] * bk.vo[c];
        prow[c] *= bk.vs[c];
      }
      float* orow = Op + r * dvp;
      for (int64_t e = 0; e < dv; ++e) orow[e] += ex;
    }
  }
  // The next block's scales and offsets when it starts a key group (other
  // arrays than the codes: no hardware stream covers them on a new page).
  static void prefetch_side(const DecodeArgs<float>& a, const Pg& pg, int64_t slot, int64_t cols,
                            bool l2) {
    if (slot % a.group != 0) return;
    prefetch_lines(pg.side.ks + slot / a.group * a.d, a.d, l2);
    prefetch_lines(pg.side.ko + slot / a.group * a.d, a.d, l2);
    prefetch_lines(pg.side.vs + slot, cols, l2);
    prefetch_lines(pg.side.vo + slot, cols, l2);
  }
};

// fp8 codes (e4m3 or e5m2 as uint8) with one fp32 scale per token and kv
// head: x = decode(code) * scale, decode exact (every fp8 value is an fp32).
// The key scales multiply the block's scores (S = (Q . row) * ks * kFold),
// the value scales its P V weights (P * vs * kFold).
//
// A row is read as fp16 values decode(code) / kFold: an fp8 code's fields
// moved into fp16's place (e5m2 is fp16's top byte; e4m3's exponent and
// mantissa sit 7 bits up, bias 7 instead of 15, hence kFold = 2^8), widened by
// vcvtph2ps where the ISA has F16C. Exact for every code, subnormals included
// (a power-of-two fold commutes with rounding short of under- or overflow).
// Caches hold finite codes only (the encoder saturates, non-finite input is
// refused), so e4m3's NaN code S.1111.111 is not tested for: every ISA reads
// it as +-480 (no compare and blend per vector); e5m2's inf and
// NaN codes are fp16's.
// Every code's decode(code) / kFold as an exact fp32 (the fp16 value of
// half_bits): the row load of the objects without F16C (scalar, NEON) and the
// row tails, one table read per element.
struct Fp8Table {
  float v[256];
};
constexpr float pow2f(int e) {
  float r = 1.0f;
  for (; e > 0; --e) r *= 2.0f;
  for (; e < 0; ++e) r *= 0.5f;
  return r;
}
constexpr float half_value(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const float mag = e == 31  ? (m ? std::numeric_limits<float>::quiet_NaN()
                                  : std::numeric_limits<float>::infinity())
                    : e == 0 ? static_cast<float>(m) * pow2f(-24)
                             : static_cast<float>(1024 + m) * pow2f(e - 25);
  return (h >> 15) ? -mag : mag;
}

template <int E>
struct Fp8Format {
  uint8_t bits;
  static constexpr float kFold = E == 4 ? 256.0f : 1.0f;
  static constexpr const char* kName = E == 4 ? "e4m3" : "e5m2";
  // the fp16 bits of decode(b) / kFold
  static constexpr uint16_t half_bits(uint8_t b) {
    if (E == 5) return static_cast<uint16_t>(b << 8);
    return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7f) << 7));
  }
  static constexpr Fp8Table table() {
    Fp8Table t{};
    for (int c = 0; c < 256; ++c) t.v[c] = half_value(half_bits(static_cast<uint8_t>(c)));
    return t;
  }
  static constexpr Fp8Table kTable = table();
};
using Fp8E4M3 = Fp8Format<4>;
using Fp8E5M2 = Fp8Format<5>;

// W codes widened: 16-bit lanes of half_bits, then vcvtph2ps (F16C); else
// the table.
template <typename F>
inline Vec<float>::R decode_fp8(const F* p) {
#if defined(__AVX512F__)
  // sign-extended: e4m3's sign lands in bit 15 of (c << 7), its own bit 14 is cleared
  const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i h = _mm256_slli_epi16(c, 8);
  if constexpr (F::kFold != 1.0f) {
    h = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(short(0xbf80)));
  }
  return _mm512_cvtph_ps(h);
#elif defined(__AVX2__)
  const __m128i c = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i h = _mm_slli_epi16(c, 8);
  if constexpr (F::kFold != 1.0f) {  // as above
    h = _mm_and_si128(_mm_slli_epi16(c, 7), _mm_set1_epi16(short(0xbf80)));
  }
  return _mm256_cvtph_ps(h);
#else
  alignas(64) float t[Vec<float>::W];
  for (int i = 0; i < Vec<float>::W; ++i) t[i] = F::kTable.v[p[i].bits];
  return Vec<float>::load(t);
#endif
}
inline Vec<float>::R ldv(const Fp8E4M3* p) { return decode_fp8(p); }
inline Vec<float>::R ldv(const Fp8E5M2* p) { return decode_fp8(p); }
inline float ld(const Fp8E4M3* p) { return Fp8E4M3::kTable.v[p->bits]; }
inline float ld(const Fp8E5M2* p) { return Fp8E5M2::kTable.v[p->bits]; }

struct Fp8Side {
  const float* ks;  // (slots,) key / value scales
  const float* vs;
};
template <typename F>
struct Fp8Encoding : CodedTypes<F, Fp8Side> {
  using Pg = typename CodedTypes<F, Fp8Side>::Pg;  // (a dependent base's names)
  using Sc = typename CodedTypes<F, Fp8Side>::Sc;
  using KV = F;
  struct Blk {
    const float* ks;  // the block's key / value scales, one per key
    const float* vs;
  };

  static constexpr KvEncodingDesc kDesc = {
      F::kName, false, false, 2, {{"k_scale", false}, {"v_scale", false}}};

  static Pg contiguous(const DecodeArgs<float>& a, int64_t b, int64_t hk) {
    const int64_t bh = b * a.Hkv + hk;
    return {static_cast<const F*>(a.kc) + b * a.sk.b + hk * a.sk.h,
            static_cast<const F*>(a.vc) + b * a.sv.b + hk * a.sv.h,
            {a.aux[0] + bh * a.R, a.aux[1] + bh * a.R}};
  }
  static Pg page(const DecodeArgs<float>& a, int64_t c, int64_t i, int64_t hk) {
    const int64_t bh = i * a.Hkv + hk;
    return {static_cast<const F*>(a.kc_chunks[c]) + i * a.sk.b + hk * a.sk.h,
            static_cast<const F*>(a.vc_chunks[c]) + i * a.sv.b + hk * a.sv.h,
            {a.aux_chunks[0][c] + bh * a.block_size, a.aux_chunks[1][c] + bh * a.block_size}};
  }
  static void load_q(const float* src, int64_t sd, int64_t d, int64_t dp, float scale, float* dst) {
    FloatEncoding<float>::load_q(src, sd, d, dp, scale, dst);
  }
  static int64_t cut(const DecodeArgs<float>&, int64_t, int64_t cols) { return cols; }
  static void begin(const DecodeArgs<float>&, const Sc&, const Pg&, int64_t, int, int64_t) {}
  // Row pointers; the scales read in place unless the ring wraps inside the
  // block (then copied in order).
  static void rows(const DecodeArgs<float>& a, const Sc& sc, const Pg& pg, int64_t slot,
                   int64_t cols, bool, bool, Blk* bk) {
    const bool wraps = slot + cols > a.R;
    bk->ks = wraps ? sc.pvs : pg.side.ks + slot;
    bk->vs = wraps ? sc.pvo : pg.side.vs + slot;
    for (int64_t c = 0; c < cols; ++c) {
      sc.krow[c] = pg.k + slot * a.sk.l;
      sc.vrow[c] = pg.v + slot * a.sv.l;
      if (wraps) {
        sc.pvs[c] = pg.side.ks[slot];
        sc.pvo[c] = pg.side.vs[slot];
      }
      if (++slot == a.R) slot = 0;
    }
  }
  static void qk(int nr, const Sc& sc, const Blk& bk, int64_t cols, int64_t d, int64_t dp, float,
                 Pf* pf) {
    qk_dispatch<float, KV>(nr, sc.Qs, dp, sc.krow, cols, d, sc.S, kBc, pf);
    for (int r = 0; r < nr; ++r)
      for (int64_t c = 0; c < cols; ++c) sc.S[r * kBc + c] *= bk.ks[c] * F::kFold;
  }
  static void weight_v(int nr, const Sc& sc, const Blk& bk, int64_t cols, float*, int64_t,
                       int64_t) {
    for (int r = 0; r < nr; ++r)
      for (int64_t c = 0; c < cols; ++c) sc.S[r * kBc + c] *= bk.vs[c] * F::kFold;
  }
  static void prefetch_side(const DecodeArgs<float>&, const Pg&, int64_t, int64_t, bool) {}
};

// The coded encodings, in DecodeArgs::coding order (tag = index + 1): a new
// one is its block above and its name here.
template <class... E>
struct EncodingList {};
using CodedEncodings = EncodingList<Int8Encoding, Fp8Encoding<Fp8E4M3>, Fp8Encoding<Fp8E5M2>>;

// f(Enc{}) for the encoding of tag `tag` in the list (false: no such tag).
template <class F, class E0, class... E>
bool with_encoding(int tag, EncodingList<E0, E...>, F&& f) {
  if (tag == 1) return f(E0{}), true;
  if constexpr (sizeof...(E) > 0) return with_encoding(tag - 1, EncodingList<E...>{}, f);
  return false;
}
// The descriptor of the encoding named `name` and its tag (null: none); with
// a null name, that of tag *tag.
template <class... E>
const KvEncodingDesc* find_encoding(const char* name, int* tag, EncodingList<E...>) {
  const KvEncodingDesc* d[] = {&E::kDesc...};
  constexpr int n = static_cast<int>(sizeof...(E));
  if (!name) return *tag >= 1 && *tag <= n ? d[*tag - 1] : nullptr;
  for (int i = 0; i < n; ++i)
    if (std::strcmp(d[i]->name, name) == 0) return *tag = i + 1, d[i];
  return nullptr;
}

// ---- layouts: the page holding key j of sequence b, the block cut at its
// end (cols), and the row slot of key j in it.

struct Slots {
  static constexpr bool kPaged = false;
  template <class Enc, class Pg = typename Enc::Pg>
  static Pg group(const DecodeArgs<typename Enc::ST>& a, int64_t b, int64_t hk) {
    return Enc::contiguous(a, b, hk);
  }
  template <class Enc, class Pg = typename Enc::Pg>
  static void locate(const DecodeArgs<typename Enc::ST>& a, int64_t, int64_t, int64_t k0, int64_t j,
                     const Pg& grp, Pg* pg, int64_t* slot, int64_t*) {
    *pg = grp;
    *slot = (k0 + j) % a.R;
  }
};

struct Pages {
  static constexpr bool kPaged = true;
  template <class Enc, class Pg = typename Enc::Pg>
  static Pg group(const DecodeArgs<typename Enc::ST>&, int64_t, int64_t) {
    return Pg{};
  }
  template <class Enc, class Pg = typename Enc::Pg>
  static void locate(const DecodeArgs<typename Enc::ST>& a, int64_t b, int64_t hk, int64_t,
                     int64_t j, const Pg&, Pg* pg, int64_t* slot, int64_t* cols) {
    *cols = imin(*cols, a.block_size - j % a.block_size);
    const int64_t g = a.block_table[b * a.max_blocks + j / a.block_size];
    *pg = Enc::page(a, g / a.chunk_blocks, g % a.chunk_blocks, hk);
    *slot = j % a.block_size % a.R;
  }
};

// ---- the source: one (sequence, kv head)'s key blocks.
template <class Layout, class Encoding,
          class Prefetch = PrefetchPolicy<typename Encoding::T, typename Encoding::KV>>
struct KvBlockSource {
  using Enc = Encoding;
  using ST = typename Enc::ST;
  using KV = typename Enc::KV;
  using T = typename Enc::T;
  using Pg = typename Enc::Pg;
  using Sc = typename Enc::Sc;
  struct Block {
    Pg pg;
    int64_t slot, cols;  // the row slot of its first key; its keys
    typename Enc::Blk e;
  };

  const DecodeArgs<ST>& a;
  const int64_t b, hk, k0;
  const Pg grp;
  const bool kpack, vpack, stag;

  KvBlockSource(const DecodeArgs<ST>& args, int64_t b_, int64_t hk_, int64_t k0_)
      : a(args),
        b(b_),
        hk(hk_),
        k0(k0_),
        grp(Layout::template group<Enc>(args, b_, hk_)),
        kpack(Enc::kPacks && args.sk.d != 1),
        vpack(Enc::kPacks && args.sv.d != 1),
        stag(Prefetch::kStagger && !args.prefetch_l2 && !kpack && !vpack) {}

  // Keys j0 .. j0 + cols - 1 (at most `cols`: cut by the encoding and the
  // layout): row pointers in sc.krow / sc.vrow, the encoding's block state.
  Block block(int64_t j0, int64_t cols, const Sc& sc, int nr, int64_t dp) const {
    Block bk;
    bk.cols = Enc::cut(a, k0 + j0, cols);
    Layout::template locate<Enc>(a, b, hk, k0, j0, grp, &bk.pg, &bk.slot, &bk.cols);
    Enc::begin(a, sc, bk.pg, bk.slot, nr, dp);
    Enc::rows(a, sc, bk.pg, bk.slot, bk.cols, kpack, vpack, &bk.e);
    return bk;
  }

  // The hints for block bk of a split [c0, c1) starting at j0: the touch pass
  // over its rows, and the prefetch walks: pf (the next block's K and V rows;
  // staggered: its K rows only, in P V) and pfv (staggered: this block's V
  // rows, during QK). Hints only: no result depends on them.
  void hints(const Block& bk, int64_t j0, int64_t c0, int64_t c1, const Sc& sc, Pf* pf,
             Pf* pfv) const {
    const int64_t cols = bk.cols;
    if constexpr (Prefetch::kTouch) {
      if (stag) {
        if (j0 == c0) sc.touch_sum[0] += touch_lines(sc.krow, cols, a.d);
      } else if (!a.prefetch_l2) {
        sc.touch_sum[0] += touch_lines(sc.krow, cols, a.d) + touch_lines(sc.vrow, cols, a.dv);
      }
    }
    *pf =
        Pf{nullptr,      nullptr, nullptr, nullptr, 0, 0, 0, 0, 0, 0, Prefetch::per(a.prefetch_l2),
           a.prefetch_l2};
    *pfv = *pf;
    if (stag)
      pf_runs(bk.pg.v, bk.slot, imin(cols, a.R - bk.slot), a.sv.l, a.dv, &pfv->k, &pfv->ks,
              &pfv->klen, &pfv->kn);
    if (kpack || vpack || j0 + cols >= c1) return;
    const int64_t jn = j0 + cols;
    int64_t ncols = imin(kBc, c1 - jn), ns;
    Pg np;
    Layout::template locate<Enc>(a, b, hk, k0, jn, grp, &np, &ns, &ncols);
    Enc::prefetch_side(a, np, ns, ncols, a.prefetch_l2 && Layout::kPaged);
    const int64_t rows = imin(ncols, a.R - ns);  // a ring's wrap ends the walk (a hint only)
    pf_runs(np.k, ns, rows, a.sk.l, a.d, &pf->k, &pf->ks, &pf->klen, &pf->kn);
    if (!stag) pf_runs(np.v, ns, rows, a.sv.l, a.dv, &pf->v, &pf->vs, &pf->vlen, &pf->vn);
  }
};
