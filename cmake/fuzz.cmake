# fuzz_forward: the libFuzzer harness fuzz/fuzz_forward.cpp, linked against the
# very per-ISA kernel objects (attn_k_<isa>, their flags from attn_add_isa) and
# the baseline sources of _core that the C++ entry points need. No ISA flag is
# written here. Build: cmake --preset fuzz && cmake --build --preset fuzz;
# run: fuzz/run.sh [seconds]. Included by attn_checks_after_kernels().
if(ATTN_FAST_FUZZ)
  find_package(Threads REQUIRED)
  add_executable(fuzz_forward fuzz/fuzz_forward.cpp ${ATTN_BASELINE_SRC} ${ATTN_ISA_OBJECTS})
  target_include_directories(fuzz_forward PRIVATE csrc/include csrc/kernels)
  target_compile_definitions(fuzz_forward PRIVATE ${ATTN_ISA_DEFS})
  target_compile_options(fuzz_forward PRIVATE ${ATTN_WARNINGS} ${ATTN_BASELINE_FLAGS})
  attn_apply_common(fuzz_forward)
  target_link_options(fuzz_forward PRIVATE -fsanitize=fuzzer)
  target_link_libraries(fuzz_forward PRIVATE Threads::Threads ${CMAKE_DL_LIBS})
endif()
