// Private to the baseline-compiled dispatcher (dispatch.cpp, machine_probes.cpp): the
// per-ISA entry points of every ISA object in this build, and the switch that
// calls the active one. Kernel sources never include this.
#pragma once

#include "attn_fast/attention.h"
#include "attn_fast/kernel_entries.h"

namespace attn_fast {

namespace isa_scalar {
ATTN_ISA_ENTRY_POINTS
}  // namespace isa_scalar
#ifdef ATTN_HAVE_AVX2
namespace isa_avx2 {
ATTN_ISA_ENTRY_POINTS
}  // namespace isa_avx2
#endif
#ifdef ATTN_HAVE_AVX512
namespace isa_avx512 {
ATTN_ISA_ENTRY_POINTS
}  // namespace isa_avx512
#endif
#ifdef ATTN_HAVE_AVX512_BF16
namespace isa_avx512_bf16 {
ATTN_BF16DOT_ENTRY_POINTS
}  // namespace isa_avx512_bf16
#endif
#ifdef ATTN_HAVE_AMX_EMU
namespace isa_amx_emu {
ATTN_AMX_ENTRY_POINTS
}  // namespace isa_amx_emu
#endif
#ifdef ATTN_HAVE_AMX
namespace isa_amx {
ATTN_AMX_ENTRY_POINTS
}  // namespace isa_amx
#endif

#ifdef ATTN_HAVE_NEON
namespace isa_neon {
ATTN_ISA_ENTRY_POINTS
}  // namespace isa_neon
#endif
#ifdef ATTN_HAVE_NEON_BF16
namespace isa_neon_bf16 {
ATTN_BF16DOT_ENTRY_POINTS
}  // namespace isa_neon_bf16
#endif

// Records that a multi-threaded region is about to run outside the kernels'
// own calls (the probes): the fork guard of dispatch.cpp must know.
void note_pool_used();

}  // namespace attn_fast

// `return isa_<active>::fn(args...)`; avx512_bf16, amx and amx_emu run the
// avx512 object (their own objects hold only bf16 kernels), neon_bf16 the neon
// object (its own holds the bf16 forward, decode and backward).
#define ATTN_DISPATCH(fn, ...)            \
  switch (active_isa()) {                 \
    ATTN_AVX512_CASE(fn, __VA_ARGS__)     \
    ATTN_AVX2_CASE(fn, __VA_ARGS__)       \
    ATTN_NEON_CASE(fn, __VA_ARGS__)       \
    default:                              \
      return isa_scalar::fn(__VA_ARGS__); \
  }
#ifdef ATTN_HAVE_AVX512
#define ATTN_AVX512_CASE(fn, ...) \
  case Isa::avx512:               \
  case Isa::avx512_bf16:          \
  case Isa::amx:                  \
  case Isa::amx_emu:              \
    return isa_avx512::fn(__VA_ARGS__);
#else
#define ATTN_AVX512_CASE(fn, ...)
#endif
#ifdef ATTN_HAVE_AVX2
#define ATTN_AVX2_CASE(fn, ...) \
  case Isa::avx2:               \
    return isa_avx2::fn(__VA_ARGS__);
#else
#define ATTN_AVX2_CASE(fn, ...)
#endif
#ifdef ATTN_HAVE_NEON
#define ATTN_NEON_CASE(fn, ...) \
  case Isa::neon:               \
  case Isa::neon_bf16:          \
    return isa_neon::fn(__VA_ARGS__);
#else
#define ATTN_NEON_CASE(fn, ...)
#endif
