# Habits of every build: -Werror on attn_fast's own sources when asked (CI sets
# ATTN_FAST_WERROR; generated Cython code is not ours and stays warning-tolerant),
# and the sanitizer flags of the fuzz harness. Included after flags.cmake.

# Without OpenMP the `#pragma omp` lines are unknown pragmas by design, not a defect.
if(NOT ATTN_OPENMP_FOUND AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  list(APPEND ATTN_WARNINGS -Wno-unknown-pragmas)
endif()

if(ATTN_FAST_WERROR)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    list(APPEND ATTN_WARNINGS -Werror)
  elseif(MSVC)
    list(APPEND ATTN_WARNINGS /WX)
  endif()
endif()

if(ATTN_FAST_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "ATTN_FAST_FUZZ needs clang++ with libFuzzer (cmake --preset fuzz sets "
                        "CMAKE_CXX_COMPILER=clang++; Debian: apt-get install clang)")
  endif()
  # every object the harness links is instrumented for libFuzzer's coverage
  list(APPEND ATTN_SAN_FLAGS -fsanitize=fuzzer-no-link)
endif()

# Called once after the per-ISA kernel objects exist (CMakeLists.txt).
function(attn_checks_after_kernels)
  # GCC 12's own AVX-512 headers initialise _mm512_undefined_*() with `__Y = __Y`,
  # and once inlined into our loops -W(maybe-)uninitialized reports that line of the
  # header hundreds of times (GCC bug 105593, fixed in GCC 13). Silenced for the
  # AVX-512 objects on GCC < 13 only, so -Werror keeps its meaning everywhere else.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
    foreach(tgt attn_k_avx512 attn_k_avx512_bf16 attn_k_amx attn_k_amx_emu)
      if(TARGET ${tgt})
        target_compile_options(${tgt} PRIVATE -Wno-maybe-uninitialized -Wno-uninitialized)
      endif()
    endforeach()
  endif()
  include(cmake/fuzz.cmake)  # ATTN_FAST_FUZZ: fuzz_forward over the same kernel objects
endfunction()
