// The entry points of the per-ISA kernel objects, declared once.
//
// Each ISA object (csrc/kernels/*.cpp compiled with one ISA's flags, see
// CMakeLists.txt and kernels/isa.h) defines these functions in its namespace
// attn_fast::isa_<name>; dispatch.cpp and machine_probes.cpp declare them for every
// ISA compiled into the build and call the active one. Adding a storage type
// to a kernel is one X(...) line in its list (plus the type's traits block in
// kernels/storage.h); adding an ISA is one ATTN_ISA_ENTRY_POINTS namespace in
// the dispatcher, one attn_add_isa() line in CMakeLists.txt, a vector header
// and its isa.h branch.
//
// No SIMD types: included by the baseline-compiled dispatcher as well.
#pragma once

#include <cstdint>

#include "attn_fast/attention.h"

// X(suffix, S): the storage types of the fused forward and of the decode
// kernel (flash_forward_<suffix>, decode_forward_<suffix>).
#define ATTN_FORWARD_TYPES(X) X(f32, float) X(f64, double) X(bf16, bf16_t) X(f16, fp16_t)
#define ATTN_DECODE_TYPES(X) X(f32, float) X(f64, double) X(bf16, bf16_t) X(f16, fp16_t)
// ... and of the backward (flash_backward_<suffix>).
#define ATTN_BACKWARD_TYPES(X) X(f32, float) X(f64, double) X(bf16, bf16_t) X(f16, fp16_t)

#define ATTN_DECLARE_FORWARD(sfx, S) AttnStats flash_forward_##sfx(const AttnArgs<S>& a);
#define ATTN_DECLARE_DECODE(sfx, S) void decode_forward_##sfx(const DecodeArgs<S>& a);
#define ATTN_DECLARE_BACKWARD(sfx, S) void flash_backward_##sfx(const BwdArgs<S>& a);

// What every ISA object defines (flash_fwd.cpp, decode.cpp, flash_bwd.cpp,
// probe_loops.cpp). The probe loops (kernels/probe_loops.cpp): fma_loop runs `iters`
// rounds of 10 independent W-lane FMA chains and returns the FLOPs done;
// read_loop returns the sum of n floats (any n), read as a stream. kv_encoding
// (decode.cpp): the coded KV encodings' descriptors (the same in every object).
#define ATTN_ISA_ENTRY_POINTS                  \
  ATTN_FORWARD_TYPES(ATTN_DECLARE_FORWARD)     \
  ATTN_DECODE_TYPES(ATTN_DECLARE_DECODE)       \
  ATTN_BACKWARD_TYPES(ATTN_DECLARE_BACKWARD)   \
  double fma_loop(int64_t iters);              \
  double read_loop(const float* p, int64_t n); \
  const KvEncodingDesc* kv_encoding(const char* name, int* tag);

// What the avx512_bf16 and neon_bf16 objects define (flash_fwd.cpp, decode.cpp,
// flash_bwd.cpp and probe_loops.cpp): the pair-product (vdpbf16ps, BFDOT)
// forward, decode and backward for bf16 storage (the backward's S is the
// forward's pair sums: kernels/flash_bwd_pairs.h) and the throughput probe
// (the shape of fma_loop, 2 FLOPs per bf16 pair). Every other call of these
// ISAs runs the avx512 / neon object.
#define ATTN_BF16DOT_ENTRY_POINTS                          \
  AttnStats flash_forward_bf16(const AttnArgs<bf16_t>& a); \
  void decode_forward_bf16(const DecodeArgs<bf16_t>& a);   \
  void flash_backward_bf16(const BwdArgs<bf16_t>& a);      \
  double dpbf16_loop(int64_t iters);

// What the amx and amx_emu objects define (flash_fwd.cpp only, kernels/amx_tiles.h):
// the AMX-BF16 tile forward for bf16 storage and one tile product
// c[16][16] += a[16][32 bf16] . b[16 pair-rows][16 bf16 pairs] (TDPBF16PS, for
// the tests). Every other call of these ISAs runs the avx512 object.
#define ATTN_AMX_ENTRY_POINTS                              \
  AttnStats flash_forward_bf16(const AttnArgs<bf16_t>& a); \
  void tdpbf16ps_tile(const uint16_t* a, const uint16_t* b, float* c);
