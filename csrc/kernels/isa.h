// Per-ISA compilation of a kernel source (flash_fwd.cpp, decode.cpp,
// flash_bwd.cpp, probe_loops.cpp): the build compiles each once with
// ATTN_ISA_SCALAR, ATTN_ISA_AVX2 or ATTN_ISA_AVX512 defined (CMakeLists.txt);
// flash_fwd.cpp and probe_loops.cpp once more with ATTN_ISA_AVX512 and
// ATTN_ISA_AVX512_BF16 (the vdpbf16ps bf16 kernel and its probe).
// flash_fwd.cpp alone twice more with ATTN_ISA_AVX512, ATTN_ISA_AVX512_BF16
// and ATTN_ISA_AMX or ATTN_ISA_AMX_EMU (the AMX tile bf16 kernel, real or
// emulated: kernels/amx_tiles.h). What each
// object defines is listed once, in attn_fast/kernel_entries.h. This header
// picks the namespace the source's code goes into and the vector header
// (register type, primitives, IsaTraits; vec_math.h for the math over them)
// to include inside it:
//
//   #include "isa.h"
//   namespace attn_fast {
//   namespace ATTN_NS {
//   #include ATTN_VEC_HEADER
//   ...
//
// Not `#pragma once`: each kernel source is its own translation unit.
#if defined(ATTN_ISA_AVX2) || defined(ATTN_ISA_AVX512)
#include <immintrin.h>
#endif
// aarch64 (CMakeLists.txt): ATTN_ISA_NEON (baseline ARMv8-A Advanced SIMD) for
// every kernel source; flash_fwd.cpp, decode.cpp and probe_loops.cpp once more with
// ATTN_ISA_NEON and ATTN_ISA_NEON_BF16 (FEAT_BF16 + FEAT_I8MM: BFDOT).
// ATTN_DOT_BF16 names the objects whose bf16 forward and decode run the pair
// kernels over DotBf16 (vdpbf16ps on x86, BFDOT on ARM).
#if defined(ATTN_ISA_AVX512_BF16) || defined(ATTN_ISA_NEON_BF16)
#define ATTN_DOT_BF16 1
#endif
#include "attn_fast/half.h"  // scalar bf16 / fp16 conversions used by the vector headers

#if defined(ATTN_ISA_AMX) || defined(ATTN_ISA_AMX_EMU)
// AMX-BF16 tiles (real or emulated, kernels/amx_tiles.h), defined together
// with ATTN_ISA_AVX512 and ATTN_ISA_AVX512_BF16; flash_fwd.cpp only.
#define ATTN_AMX_TILES 1
#if defined(ATTN_ISA_AMX)
#define ATTN_NS isa_amx
#else
#define ATTN_NS isa_amx_emu
#endif
#define ATTN_VEC_HEADER "vec_avx512.h"
#elif defined(ATTN_ISA_AVX512_BF16)  // defined together with ATTN_ISA_AVX512 (CMakeLists.txt)
#define ATTN_NS isa_avx512_bf16
#define ATTN_VEC_HEADER "vec_avx512.h"
#elif defined(ATTN_ISA_AVX512)
#define ATTN_NS isa_avx512
#define ATTN_VEC_HEADER "vec_avx512.h"
#elif defined(ATTN_ISA_NEON_BF16)  // defined together with ATTN_ISA_NEON
#define ATTN_NS isa_neon_bf16
#define ATTN_VEC_HEADER "vec_neon.h"
#elif defined(ATTN_ISA_NEON)
#define ATTN_NS isa_neon
#define ATTN_VEC_HEADER "vec_neon.h"
#elif defined(ATTN_ISA_AVX2)
#define ATTN_NS isa_avx2
#define ATTN_VEC_HEADER "vec_avx2.h"
#else
#define ATTN_NS isa_scalar
#define ATTN_VEC_HEADER "vec_scalar.h"
#endif
