#!/usr/bin/env bash
# Build the libFuzzer harness fuzz/fuzz_forward.cpp (clang, AddressSanitizer +
# UndefinedBehaviorSanitizer, no OpenMP) and run it for a fixed time.
#   fuzz/run.sh [seconds=60]        exit 0: no finding; non-zero: crash/mismatch
# Needs clang++ with libFuzzer (Debian: apt-get install clang). Crash inputs
# land in build/fuzz/ as crash-*; rerun one with build/fuzz/fuzz_forward FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
OUT=${FUZZ_BUILD_DIR:-build/fuzz}
CXX=${FUZZ_CXX:-clang++}
mkdir -p "$OUT/corpus"
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
FLAGS="-std=c++17 -O1 -g $SAN -fsanitize=fuzzer-no-link -Icsrc/include -Icsrc/kernels -Wno-unknown-pragmas"
DEFS=""
OBJS=()
# Every per-ISA kernel source: read from ATTN_KERNEL_SRC in CMakeLists.txt, so a new
# kernel file needs no edit here.
mapfile -t KERNELS < <(sed -n 's#.*ATTN_KERNEL_SRC csrc/kernels/\([a-z0-9_]*\)\.cpp.*#\1#p' CMakeLists.txt | sort -u)
[ "${#KERNELS[@]}" -gt 0 ] || { echo "fuzz/run.sh: no kernel sources found in CMakeLists.txt" >&2; exit 1; }
isa_objects() {  # isa-name define flags...
  local name=$1 def=$2
  shift 2
  for k in "${KERNELS[@]}"; do
    "$CXX" $FLAGS "-D$def" "$@" -c "csrc/kernels/$k.cpp" -o "$OUT/${k}_$name.o"
    OBJS+=("$OUT/${k}_$name.o")
  done
}
isa_objects scalar ATTN_ISA_SCALAR
if [ "$(uname -m)" = x86_64 ]; then
  isa_objects avx2 ATTN_ISA_AVX2 -mavx2 -mfma -mf16c
  isa_objects avx512 ATTN_ISA_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c
  DEFS="-DATTN_HAVE_AVX2 -DATTN_HAVE_AVX512"
fi
"$CXX" $FLAGS $DEFS -c csrc/dispatch.cpp -o "$OUT/dispatch.o"
"$CXX" $FLAGS -c csrc/reference.cpp -o "$OUT/reference.o"
"$CXX" $FLAGS -c csrc/interrupt.cpp -o "$OUT/interrupt.o"
"$CXX" $FLAGS -c fuzz/fuzz_forward.cpp -o "$OUT/fuzz_forward.o"
"$CXX" $SAN -fsanitize=fuzzer "${OBJS[@]}" "$OUT/dispatch.o" "$OUT/reference.o" "$OUT/interrupt.o" "$OUT/fuzz_forward.o" \
  -o "$OUT/fuzz_forward" -ldl -lpthread
echo "== fuzz_forward for ${SECS}s"
"$OUT/fuzz_forward" -max_total_time="$SECS" -print_final_stats=1 -artifact_prefix="$OUT/" \
  -rss_limit_mb=4096 -max_len=512 -len_control=0 "$OUT/corpus" fuzz/regressions
