#!/usr/bin/env bash
# Build the libFuzzer harness fuzz/fuzz_forward.cpp (CMake preset `fuzz`: clang,
# AddressSanitizer + UndefinedBehaviorSanitizer, no OpenMP, no Python; the kernel
# objects and their ISA flags are the ones CMakeLists.txt builds for the wheel)
# and run it for a fixed time.
#   fuzz/run.sh [seconds=60]        exit 0: no finding; non-zero: crash/mismatch
# Needs cmake >= 3.21 and clang++ with libFuzzer (Debian: apt-get install clang).
# Crash inputs land in the build folder as crash-*; rerun one with
# build/preset-fuzz/fuzz_forward FILE. FUZZ_BUILD_DIR overrides the build folder;
# FUZZ_CMAKE_ARGS adds configure arguments (-DATTN_FAST_WERROR=ON, -DCMAKE_CXX_COMPILER=...).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
OUT=${FUZZ_BUILD_DIR:-build/preset-fuzz}
# shellcheck disable=SC2086
mkdir -p "$(dirname "$OUT")"
cmake --preset fuzz -B "$OUT" ${FUZZ_CMAKE_ARGS:-} >"$OUT.configure.log" 2>&1 ||
  { cat "$OUT.configure.log" >&2; exit 1; }
cmake --build "$OUT" --target fuzz_forward -j "${FUZZ_JOBS:-2}"
mkdir -p "$OUT/corpus"
echo "== fuzz_forward for ${SECS}s"
"$OUT/fuzz_forward" -max_total_time="$SECS" -print_final_stats=1 -artifact_prefix="$OUT/" \
  -rss_limit_mb=4096 -max_len=512 -len_control=0 "$OUT/corpus" fuzz/regressions
