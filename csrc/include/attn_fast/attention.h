// attn_fast public C++ interface: argument structs and entry points.
//
// Shape legend (used in every file of csrc/):
//   B      batch (or number of packed sequences for varlen)
//   Hq     query heads          Hkv  key/value heads (Hq % Hkv == 0; GQA)
//   Lq     query length         Lk   key/value length
//   d      query/key head dim   dv   value head dim
//
// Every tensor is read through element strides (not bytes), so (B, H, L, d),
// (B, L, H, d) and any other view needs no copy. Strides may be zero
// (broadcast) for masks. All index arithmetic is 64-bit.
//
// No SIMD types appear here: this header is included by the baseline-compiled
// dispatch and bindings as well as by every per-ISA kernel.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace attn_fast {

struct Strides4 {
  int64_t b = 0, h = 0, l = 0, d = 0;
};

// 16-bit storage types: the bits of a bfloat16 / IEEE binary16 value. They are
// storage only: kernels read them into fp32 (compute_t), accumulate and take
// the softmax in fp32, and round back once when writing O.
struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};
template <typename S>
struct compute_type {
  using type = S;
};
template <>
struct compute_type<bf16_t> {
  using type = float;
};
template <>
struct compute_type<fp16_t> {
  using type = float;
};
// The type a kernel computes in for storage type S (bf16/fp16 -> float).
template <typename S>
using compute_t = typename compute_type<S>::type;

// Everything one call of the fused forward kernel needs. T is the storage type
// of q, k, v and o: float, double, bf16_t or fp16_t. lse, bias, alibi and
// sinks are in the compute type compute_t<T> (fp32 for the 16-bit types).
//
// Visibility of key j for query i of sequence s (all must hold):
//   j < k_len(s)                                   (padding / varlen)
//   causal:        j <= i + off(s)
//   window_left:   j >= i + off(s) - window_left   (if window_left  >= 0)
//   window_right:  j <= i + off(s) + window_right  (if window_right >= 0)
//   layout[b][h][i / layout_bq][j / layout_bk] != 0  (block-sparse, if given)
//   mask[b][h][i][j] != 0                            (dense boolean, if given)
// where off(s) = k_len(s) - q_len(s) for bottom-right alignment (FlashAttention,
// KV caches) and 0 for top-left alignment (torch's is_causal).
// Score of a visible pair:
//   s = scale * <q_i, k_j>;  if softcap > 0: s = softcap * tanh(s / softcap)
//   s += -alibi[h] * |i + off(s) - j|   (if alibi given)
//   s += bias[b][h][i][j]               (if bias given; -inf masks the pair)
// Rows of sequence s at i >= q_len(s) (padding) and rows with no visible key
// get O = 0 and lse = -inf. A per-head sink logit (sinks[h]) joins the
// softmax denominator only.
template <typename T>
struct AttnArgs {
  const T* q = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  T* o = nullptr;
  compute_t<T>* lse = nullptr;  // optional, contiguous (B, Hq, Lq) / (Hq, total_q) for varlen

  int64_t B = 0, Hq = 0, Hkv = 0, Lq = 0, Lk = 0, d = 0, dv = 0;
  Strides4 sq, sk, sv, so;
  double scale = 1.0;

  bool causal = false;
  bool top_left = false;  // causal/window alignment: false = bottom-right
  int64_t window_left = -1, window_right = -1;

  const int64_t* q_lens = nullptr;   // (B,) valid query rows per batch; rest -> 0
  const int64_t* kv_lens = nullptr;  // (B,) valid keys per batch

  // varlen packing: sequences s = 0..B-1 occupy rows cu_q[s]..cu_q[s+1] of the
  // (single) batch entry 0. When set, Lq / Lk are the packed totals.
  const int64_t* cu_q = nullptr;
  const int64_t* cu_k = nullptr;

  const uint8_t* layout = nullptr;
  int64_t layout_bq = 1, layout_bk = 1, layout_nq = 0, layout_nk = 0;
  Strides4 slayout;  // b, h, query block, key block

  const uint8_t* mask = nullptr;  // dense boolean, 1 = attend
  Strides4 smask;
  const compute_t<T>* bias = nullptr;  // dense additive
  Strides4 sbias;

  const compute_t<T>* alibi = nullptr;  // (Hq,) slopes
  double softcap = 0.0;
  const compute_t<T>* sinks = nullptr;  // (Hq,) logits

  int num_threads = 1;
  // Tiling override for tests (0 = kernel default). Results do not depend on it
  // beyond float rounding.
  int block_q = 0, block_k = 0;
};

// Statistics reported by the kernel (for tests and benchmarks).
// Calls with fewer multiply-adds than this (tens of microseconds) run on the
// calling thread in both kernels: waking an OpenMP team costs more than it
// saves, and between NumPy BLAS calls it fights BLAS's spinning workers.
constexpr double kSerialWork = double(1 << 21);

// The class of a tile (a block of query rows x a block of keys) under the
// masks: nothing visible (skipped), some pairs visible (masked element by
// element), every pair visible. The same numbering as Python's
// attn_fast.masks.BLOCK_MASKED / BLOCK_PARTIAL / BLOCK_VISIBLE (exported by
// the bindings as _core.BLOCK_*) and the tiles of masks.block_summary.
enum class TileClass : int8_t { masked = 0, partial = 1, visible = 2 };

struct AttnStats {
  int64_t tiles_computed = 0;  // (Br x Bc) tiles whose scores were computed
  int64_t tiles_skipped = 0;   // tiles inside the key range skipped by a mask
  // The tile actually used (Br x Bc): block_q is honoured as asked, block_k is
  // rounded up to the active path's key-panel width (kNR * W) and both are
  // capped by the problem size. 0 when no tile was chosen (empty call).
  int64_t block_q = 0, block_k = 0;
};

// What a coded KV encoding (decode_sources.h's CodedEncodings) stores beside
// its one-byte codes, for the binding's checks: the codes' signedness and its
// float32 side arrays, each per slot (.., R) or per key group and channel
// (.., R / group, d), named as the Python record names them.
constexpr int kKvMaxAux = 4;
struct KvAux {
  const char* name;
  bool per_group;  // (.., R / group, d), else (.., R)
};
struct KvEncodingDesc {
  const char* name;  // the spelling of _core.decode's encoding=
  bool code_signed;  // int8 codes, else uint8
  bool grouped;      // takes group= (slots per key group), else group 1
  int naux;
  KvAux aux[kKvMaxAux];
};
// The coded encoding named `name` (its DecodeArgs::coding is then *tag), or
// null; with a null name, the one of tag *tag (1, 2, ...) or null.
const KvEncodingDesc* kv_encoding(const char* name, int* tag);

// Split-KV decode (flash-decoding) over a plain K/V array or a KV cache's
// storage, possibly a ring buffer. T is the storage type of q, k, v and o:
// float, double, bf16_t or fp16_t (read into fp32 as loaded; lse in
// compute_t<T>, fp32 for the 16-bit types).
//   k (B, Hkv, R, d), v (B, Hkv, R, dv): R slots per sequence; logical key j
//   of sequence b is slot (kv_start[b] + j) mod R, for j < kv_lens[b].
// Visibility and empty rows exactly as AttnArgs (causal/top_left,
// window_left/right, q_lens, kv_lens on logical key indices); no user masks,
// biases or score transforms. lse, if given, is contiguous (B, Hq, Lq).
template <typename T>
struct DecodeArgs {
  const T* q = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  T* o = nullptr;
  compute_t<T>* lse = nullptr;
  int64_t B = 0, Hq = 0, Hkv = 0, Lq = 0, R = 0, d = 0, dv = 0;
  Strides4 sq, sk, sv, so;
  double scale = 1.0;
  bool causal = false;
  bool top_left = false;
  int64_t window_left = -1, window_right = -1;
  const int64_t* q_lens = nullptr;    // (B,) or null = Lq
  const int64_t* kv_lens = nullptr;   // (B,) or null = R
  const int64_t* kv_start = nullptr;  // (B,) slots in [0, R), or null = 0
  int num_threads = 1;
  int64_t split = 0;  // keys per split (0 = kernel default); results depend on it only by rounding
  // Paged K/V (PagedKVCache; not with kv_start). When block_table is
  // set, k and v are not read: the pool is a list of chunks of chunk_blocks
  // blocks, k_chunks[c] (chunk_blocks, Hkv, block_size, d) and v_chunks[c]
  // (chunk_blocks, Hkv, block_size, dv), all with the strides sk / sv (sk.b,
  // sv.b: from one block to the next). Logical key j of sequence b is row
  // j % block_size of block
  //   g = block_table[b * max_blocks + j / block_size],
  // which lives in chunk g / chunk_blocks at block g % chunk_blocks. R is
  // max_blocks * block_size (kv_lens[b] <= R). The kernel's key blocks are
  // cut at block_size boundaries (none are cut when block_size is a multiple
  // of 64 and the key ranges start at one: then the result is bit-identical
  // to the contiguous layout's).
  const int64_t* block_table = nullptr;
  int64_t max_blocks = 0, block_size = 0, chunk_blocks = 0;
  const T* const* k_chunks = nullptr;
  const T* const* v_chunks = nullptr;
  // Coded K/V (a quantised KVCache: dtype="int8", ...; T = float only):
  // `coding` names an encoding of decode_sources.h's CodedEncodings list (its
  // index + 1, from kv_encoding(name); 0: rows of T), whose block says what a
  // row's codes and side arrays mean. k and v are not read: the codes are kc
  // (B, Hkv, R, d) and vc (B, Hkv, R, dv), one byte each, with the strides sk
  // / sv (element stride 1); aux[i] is the encoding's i-th side array
  // (KvEncodingDesc::aux), float32, contiguous (B, Hkv, R / group, d) or (B,
  // Hkv, R); group: slots per key group (R a multiple of it). With a
  // block_table: chunk c holds kc_chunks[c], vc_chunks[c] (chunk_blocks, Hkv,
  // block_size, d / dv) and aux_chunks[i][c] (chunk_blocks, Hkv, block_size /
  // group, d) or (chunk_blocks, Hkv, block_size): a block is laid out as the
  // contiguous cache's (B = 1, R = block_size).
  int coding = 0;
  const void* kc = nullptr;
  const void* vc = nullptr;
  const float* aux[kKvMaxAux] = {};
  int64_t group = 0;
  const void* const* kc_chunks = nullptr;
  const void* const* vc_chunks = nullptr;
  const float* const* aux_chunks[kKvMaxAux] = {};
  // How the kernel asks for the next key block's K/V lines (hints only: the
  // results never depend on it). Filled in by decode_forward from
  // decode_prefetch(); a caller's value is ignored.
  //   l1: prefetcht0, and a touch pass over each block's lines first (AMD);
  //   l2: prefetcht1 and no touch pass (Intel: a core's L1 fill buffers cap
  //       its misses in flight, the L2 streamer does not; bench/NOTES.md).
  bool prefetch_l2 = false;
};

// avx512_bf16: the avx512 kernels, plus vdpbf16ps micro-kernels for bf16
// storage (CPUID.(7,1):EAX bit 5). Other dtypes run the avx512 kernels.
// amx: AMX-BF16 tiles for the bf16 forward (CPUID.(7,0):EDX bits 22/24, XCR0
// bits 17/18, Linux permission; chosen by default after a self-check);
// amx_emu: the same kernel with the tile ops emulated by vdpbf16ps (runs where
// avx512_bf16 does; never chosen by default: for tests). Every other call of
// either runs the avx512 kernels.
enum class Isa : int {
  scalar = 0,
  avx2 = 1,
  avx512 = 2,
  avx512_bf16 = 3,
  amx = 4,
  amx_emu = 5,
  neon = 6,       // aarch64 Advanced SIMD (every ARMv8-A CPU)
  neon_bf16 = 7,  // aarch64 FEAT_BF16 + FEAT_I8MM: BFDOT bf16 forward and decode
};

const char* isa_name(Isa isa);
// ISAs compiled into this build AND supported by this CPU/OS, in ascending order.
std::vector<Isa> available_isas();
std::vector<Isa> compiled_isas();
Isa active_isa();
// Throws std::runtime_error if the ISA is not compiled in or not supported.
void set_active_isa(Isa isa);
Isa parse_isa(const std::string& name);  // throws std::invalid_argument
// Why amx is or is not the default here (CPUID, XCR0, the kernel's permission,
// the self-check): one line for show_config().
std::string amx_status();
// The one-time self-check of a tile ISA (amx or amx_emu) against the avx512
// path on a small bf16 attention; true when it agrees, with a line in *why.
bool amx_self_check(Isa isa, std::string* why);
// One TDPBF16PS of the amx / amx_emu object on caller memory (tests):
// c[16][16] += a[16][32 bf16] . b[16 pair-rows][16 pairs]; throws if unavailable.
void tdpbf16ps_tile(Isa isa, const uint16_t* a, const uint16_t* b, float* c);

void set_num_threads(int n);
int get_num_threads();
// The thread count for a kernel call starting now (get_num_threads(), which is
// 1 in a forked child of a process that ran parallel regions with libgomp);
// records that a multi-threaded region is about to run.
int threads_for_call();
bool forked_child_serial();
bool openmp_enabled();
std::string openmp_runtime();

// Entry points: dispatch to the active ISA's fused kernel.
AttnStats flash_forward(const AttnArgs<float>& a);
AttnStats flash_forward(const AttnArgs<double>& a);

// 16-bit storage: q, k, v, o in bf16 / fp16, everything else fp32.
// Without AVX512-BF16 (or when the probe finds it slower) the fused kernel
// converts on pack and runs the fp32 kernel.
AttnStats flash_forward(const AttnArgs<bf16_t>& a);
AttnStats flash_forward(const AttnArgs<fp16_t>& a);
void reference_forward(const AttnArgs<bf16_t>& a);
void reference_forward(const AttnArgs<fp16_t>& a);
// bf16 calls take the vdpbf16ps path when the active ISA is avx512_bf16: the
// default where AVX512-BF16 is present and this short timing probe (run once,
// vdpbf16ps vs fp32 FMA; ATTN_FAST_BF16_PROBE=0/1 overrides it) finds the dot
// product faster; set_active_isa / ATTN_FAST_ISA choose either way.
bool bf16_dot_preferred();

// Plain-loop reference kernel (two-pass softmax in double): the slow readable
// fallback and second oracle. Same arguments and semantics.
void reference_forward(const AttnArgs<float>& a);
void reference_forward(const AttnArgs<double>& a);

// The decode kernel's prefetch policy (DecodeArgs::prefetch_l2): l1 or l2 as
// chosen (set_decode_prefetch, ATTN_FAST_DECODE_PREFETCH at import), or by
// the CPU (auto: l2 on GenuineIntel and on AMD Zen 4, l1 elsewhere).
enum class DecodePrefetch : int { auto_ = 0, l1 = 1, l2 = 2 };
void set_decode_prefetch(DecodePrefetch p);
DecodePrefetch decode_prefetch();  // the policy in effect: l1 or l2, never auto
// CPUID's vendor string and display family / model ("", 0, 0 off x86).
struct CpuSignature {
  std::string vendor;
  int family = 0, model = 0;
};
CpuSignature cpu_signature();

// Split-KV decode kernel (csrc/kernels/decode.cpp), dispatched per ISA.
void decode_forward(const DecodeArgs<float>& a);
void decode_forward(const DecodeArgs<double>& a);
void decode_forward(const DecodeArgs<bf16_t>& a);  // avx512_bf16: vdpbf16ps Q K^T
void decode_forward(const DecodeArgs<fp16_t>& a);

// Streaming-read bandwidth probe: `threads` threads each read their share of
// an nbytes buffer (first-touched by the same thread) `reps` times; returns
// the best GB/s (1e9 bytes/s) over the repetitions.
double stream_read_gbps(int threads, int64_t nbytes, int reps);

// Register-only FMA loop used by the benchmark to measure the machine's peak.
// Returns FLOPs performed; runs on `threads` threads for about `seconds`.
double fma_peak_gflops(int threads, double seconds);

// Streaming-read probe used by the benchmark to measure memory bandwidth:
// reads a `bytes` buffer (first touched by the reading threads) on `threads`
// threads, repeatedly for about `seconds`; returns the best pass in GB/s.
double read_bandwidth_gbs(int threads, int64_t bytes, double seconds);

// ---------------------------------------------------------------- backward
// FlashAttention-2 backward (csrc/kernels/flash_bwd.cpp), dispatched per ISA.
// f holds everything the forward call had (geometry, masks, score options,
// alignment, varlen offsets, block sizes, threads) with f.o = the forward's
// output O and f.lse = its lse (both read only; lse is required). Computes
//   dq (like q), dk (like k), dv (like v): written in full (keys past a
//   sequence's length and rows that see nothing get 0); GQA dk/dv summed
//   over the group; no gradient for masks or biases;
//   dsinks (Hq,) when f.sinks is set: -sum_i exp(sinks[h] - lse_i) D_i.
// O and lse may come from elsewhere (ring attention: a global O and lse with
// one block of the keys): then the result is that key block's contribution.
// Results are bit-for-bit identical for any thread count.
template <typename T>
struct BwdArgs {
  AttnArgs<T> f;
  const T* dout = nullptr;  // (B, Hq, Lq, dv) like o
  Strides4 sdo;
  T* dq = nullptr;
  T* dk = nullptr;
  T* dv = nullptr;
  Strides4 sdq, sdk, sdv;
  compute_t<T>* dsinks = nullptr;  // (Hq,), written when f.sinks is set (fp32 for 16-bit T)
};

void flash_backward(const BwdArgs<float>& a);
void flash_backward(const BwdArgs<double>& a);
// 16-bit storage: q, k, v, o, dout, dq, dk, dv in bf16 / fp16; lse, bias,
// alibi, sinks and dsinks fp32. Computed in fp32 (the fp32 kernel on widened
// values); dq, dk, dv rounded once at the end.
void flash_backward(const BwdArgs<bf16_t>& a);
void flash_backward(const BwdArgs<fp16_t>& a);

// ---------------------------------------------------------------- int8 KV cache
// Quantise one appended chunk into an int8 KV cache (csrc/kv_quant.cpp, plain
// loops, OpenMP over (sequence, kv head)); the layout DecodeArgs::k8 reads.
// Position p of sequence b lives in slot p mod R (R a multiple of G = kgroup).
// Asymmetric 8-bit codes q in [-128, 127], x = q * scale + off with
// scale = (max - min) / 255, off = min + 128 * scale (scale 0: x = off):
//   keys per channel over the valid slots of each group of G slots,
//   values per token (over dv).
// stage (B, Hkv, G, d) holds the float32 keys of the group being filled (row
// p mod G); stage_grp[b] is the absolute group (position / G) it belongs to,
// -1 for none. A group is requantised from stage when it closes and at the
// end of each append. Rows of the group that stage does not hold (the
// ring's older keys in the same slots, or a group reopened by truncate or a
// resize) are first refilled from their dequantised codes.
struct KvQuantArgs {
  const float* k = nullptr;  // (B, Hkv, L, d) chunk, strides sk
  const float* v = nullptr;  // (B, Hkv, L, dv) chunk, strides sv
  Strides4 sk, sv;
  int64_t B = 0, Hkv = 0, L = 0, d = 0, dv = 0, R = 0, G = 0;
  int8_t* k8 = nullptr;      // (B, Hkv, R, d) contiguous
  int8_t* v8 = nullptr;      // (B, Hkv, R, dv) contiguous
  float* k_scale = nullptr;  // (B, Hkv, R / G, d)
  float* k_off = nullptr;
  float* v_scale = nullptr;  // (B, Hkv, R)
  float* v_off = nullptr;
  float* stage = nullptr;                 // (B, Hkv, G, d)
  int64_t* stage_grp = nullptr;           // (B,), updated
  const int64_t* pos0 = nullptr;          // (B,) position of each sequence's first new row
  const int64_t* count = nullptr;         // (B,) rows of the chunk to store
  const int64_t* first_before = nullptr;  // (B,) oldest stored position before the append
  const int64_t* first_after = nullptr;   // (B,) and after it
  int num_threads = 1;
};
// Throws std::invalid_argument (nothing written) if a row to store holds inf
// or NaN.
void kv_quant_append(const KvQuantArgs& a);

}  // namespace attn_fast
