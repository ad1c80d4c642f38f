// Core cycles per TSC tick, for the micro-benchmarks that count cycles
// (decode_loops.cpp, decode_vnni.cpp): a chain of 4 dependent adds per
// iteration, one per cycle, timed against the TSC; the best of `reps` runs.
#pragma once

#include <x86intrin.h>

#include <algorithm>

inline double cycles_per_tick(int reps = 5, long n = 200000000) {
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const unsigned long t0 = __rdtsc();
    __asm__ volatile(
        "mov %0, %%rcx\n1: add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n"
        " sub $4, %%rcx\n jnz 1b\n" ::"r"(n)
        : "rax", "rcx", "cc");
    best = std::max(best, double(n) / double(__rdtsc() - t0));
  }
  return best;
}
