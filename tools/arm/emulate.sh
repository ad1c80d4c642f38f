#!/usr/bin/env bash
# attn_fast on aarch64, tested here under QEMU user emulation, in one command:
#
#   tools/arm/emulate.sh [--subset ci|all] [--paths "neon neon_bf16"] [-- pytest args]
#
# From a clean x86-64 Debian/Ubuntu machine (root, or sudo without a password):
#   1. apt-get installs debootstrap, qemu-user-static, binfmt-support and the cross
#      compiler g++-aarch64-linux-gnu (with its binutils: aarch64-linux-gnu-objdump);
#   2. debootstrap builds an arm64 Debian bookworm root (cached under $ATTN_ARM_ROOT,
#      default .arm/bookworm-arm64, ignored by git; reused while its .ready stamp is
#      there) with python3, python3-venv, python3-dev and the C++ runtime, copies the
#      host's CA bundle into it (so pip works behind a TLS-inspecting proxy) and makes a
#      venv there with the test dependencies (PyPI's aarch64 wheels);
#   3. cross-compiles attn_fast on the host (aarch64-linux-gnu-g++, the root's Python
#      headers, Ninja; -Werror) into build/arm64 and stages the package in the root;
#   4. runs pytest inside the root once per ARM path, ATTN_FAST_ISA forcing the path and
#      QEMU_CPU choosing the emulated CPU: neoverse-n1 for neon (ARMv8.2, no BF16),
#      max for neon_bf16 (BF16, I8MM, SVE, SME). --subset ci (the default) runs the
#      subset CI runs (tools/arm/ci_subset_<path>.txt), --subset all the whole suite.
#
# Cross-compiling takes about a minute where building inside the emulated root took
# nine. Not on x86-64 Linux with apt-get: prints SKIP and exits 0 (nothing to emulate
# with). Environment: ATTN_ARM_ROOT (the root's folder), ATTN_ARM_MIRROR (the Debian
# mirror, default deb.debian.org), ATTN_FAST_WERROR=0 (build without -Werror),
# ATTN_ARM_OPENMP=OFF (build without OpenMP, into build/arm64-noomp: the single-threaded
# build of a Mac without libomp).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
SUBSET=ci
PATHS="neon neon_bf16"
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --subset) SUBSET=$2; shift 2 ;;
    --paths) PATHS=$2; shift 2 ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    *) echo "usage: $0 [--subset ci|all] [--paths 'neon neon_bf16'] [-- pytest args]" >&2; exit 2 ;;
  esac
done
log() { echo "== arm: $*"; }

# --- 0. can this machine emulate aarch64 at all? ---
if [ "$(uname -s)" != Linux ] || [ "$(uname -m)" != x86_64 ] || ! command -v apt-get >/dev/null; then
  log "SKIP: needs x86-64 Linux with apt-get (this is $(uname -s) $(uname -m)); nothing run"
  exit 0
fi
SUDO=
if [ "$(id -u)" != 0 ]; then
  if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    log "SKIP: needs root or password-less sudo (apt-get, debootstrap, chroot); nothing run"
    exit 0
  fi
fi
ROOT=${ATTN_ARM_ROOT:-$REPO/.arm/bookworm-arm64}
MIRROR=${ATTN_ARM_MIRROR:-http://deb.debian.org/debian}
SECONDS=0

# --- 1. host packages ---
need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
command -v update-binfmts >/dev/null || need+=(binfmt-support)
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v aarch64-linux-gnu-objdump >/dev/null || need+=(binutils-aarch64-linux-gnu)
command -v ninja >/dev/null || need+=(ninja-build)
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need[@]}"
fi
# binfmt_misc: the kernel runs aarch64 ELF files through qemu-aarch64-static (flag F:
# the interpreter is opened at registration, so it works inside the chroot too).
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
  $SUDO mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  $SUDO update-binfmts --enable qemu-aarch64 || true
fi
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  log "SKIP: binfmt_misc has no qemu-aarch64 entry (update-binfmts --enable qemu-aarch64 failed)"
  exit 0
fi

# --- 2. the arm64 root (cached) ---
mounted=()
cleanup() {
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do $SUDO umount -l "${mounted[$i]}" || true; done
}
trap cleanup EXIT
mount_root() {
  for m in proc dev; do
    if ! mountpoint -q "$ROOT/$m"; then
      if [ $m = proc ]; then $SUDO mount -t proc proc "$ROOT/proc"; else $SUDO mount --bind /dev "$ROOT/dev"; fi
      mounted+=("$ROOT/$m")
    fi
  done
}
in_root() {  # run a command in the root, with the host's proxy settings and CA bundle
  $SUDO chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/opt/venv/bin:/usr/bin:/bin \
    LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    ${http_proxy:+http_proxy=$http_proxy} ${https_proxy:+https_proxy=$https_proxy} \
    ${HTTP_PROXY:+HTTP_PROXY=$HTTP_PROXY} ${HTTPS_PROXY:+HTTPS_PROXY=$HTTPS_PROXY} \
    ${no_proxy:+no_proxy=$no_proxy} "$@"
}
if [ ! -e "$ROOT/.ready" ]; then
  log "debootstrap arm64 bookworm into $ROOT (once; cached)"
  $SUDO rm -rf "$ROOT"
  mkdir -p "$(dirname "$ROOT")"
  # One stage: with binfmt registered, debootstrap runs the arm64 second stage itself.
  $SUDO debootstrap --arch=arm64 --variant=minbase \
    --include=ca-certificates,python3,python3-venv,python3-dev,libstdc++6,libgomp1 \
    bookworm "$ROOT" "$MIRROR"
  $SUDO mkdir -p "$ROOT/etc/ssl/certs"
  $SUDO cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
  $SUDO cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  mount_root
  log "venv with the test dependencies in the root (aarch64 wheels from PyPI)"
  in_root python3 -m venv /opt/venv
  in_root /opt/venv/bin/python -m pip install -q --upgrade pip
  in_root /opt/venv/bin/python -m pip install -q numpy pytest hypothesis threadpoolctl ml_dtypes
  $SUDO touch "$ROOT/.ready"
  log "root ready after ${SECONDS} s"
fi
mount_root
$SUDO cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"

# --- 3. cross-compile on the host, stage the package in the root ---
PYINC=$(ls -d "$ROOT"/usr/include/python3.* | head -1)
PYVER=${PYINC##*/python}
HOSTPY=${ATTN_ARM_HOST_PYTHON:-}
if [ -z "$HOSTPY" ]; then  # a host venv with the build requirements (pybind11, Cython)
  HOSTPY=$REPO/.arm/host-venv/bin/python
  if [ ! -x "$HOSTPY" ]; then
    log "host build venv (.arm/host-venv): cmake ninja pybind11 cython cython-cmake"
    python3 -m venv "$REPO/.arm/host-venv"
    "$HOSTPY" -m pip install -q --upgrade pip
    "$HOSTPY" -m pip install -q cmake ninja pybind11 'cython>=3.1' 'cython-cmake>=0.3' pytest
  fi
fi
HOSTBIN=$(dirname "$HOSTPY")
WERROR=ON
case "${ATTN_FAST_WERROR:-1}" in 0 | off | OFF | no) WERROR=OFF ;; esac
OPENMP=${ATTN_ARM_OPENMP:-ON}
BUILD=$REPO/build/arm64
[ "$OPENMP" = ON ] || BUILD=$REPO/build/arm64-noomp
log "cross-compile with $(aarch64-linux-gnu-g++ --version | head -1), Python $PYVER headers of the root, -Werror $WERROR, OpenMP $OPENMP"
t0=$SECONDS
PATH=$HOSTBIN:$PATH cmake -S "$REPO" -B "$BUILD" -G Ninja -Wno-dev \
  -DCMAKE_TOOLCHAIN_FILE="$REPO/tools/arm/aarch64-linux-gnu.cmake" \
  -DPython_EXECUTABLE="$HOSTPY" -DPython_INCLUDE_DIR="$PYINC" \
  -DCMAKE_CXX_FLAGS="-idirafter $ROOT/usr/include" \
  -DATTN_FAST_WERROR=$WERROR -DATTN_FAST_OPENMP="$OPENMP" >"$BUILD.configure.log" 2>&1 || { cat "$BUILD.configure.log"; exit 1; }
PATH=$HOSTBIN:$PATH cmake --build "$BUILD" -j "$(nproc)"
log "built in $((SECONDS - t0)) s"
# The package as the wheel would lay it out: the Python sources and the two
# extension modules, named with the root's (aarch64) extension suffix.
STAGE=$ROOT/opt/attn_fast
$SUDO rm -rf "$STAGE"
$SUDO mkdir -p "$STAGE"
$SUDO cp -r "$REPO/python/attn_fast" "$STAGE/attn_fast"
$SUDO find "$STAGE" -name '*.so' -delete
SUFFIX=".cpython-${PYVER/./}-aarch64-linux-gnu.so"
for mod in _core _cyloops; do
  $SUDO cp "$(ls "$BUILD"/$mod.*so | head -1)" "$STAGE/attn_fast/$mod$SUFFIX"
done
$SUDO rm -rf "$STAGE/tests" "$STAGE/README.md" "$STAGE/bench"
$SUDO cp -r "$REPO/tests" "$STAGE/tests"
$SUDO cp -r "$REPO/bench" "$STAGE/bench"
$SUDO cp "$REPO/README.md" "$REPO/pyproject.toml" "$STAGE/"
$SUDO find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +

# The aarch64 objdump guard on the host, over build/arm64 (tests/test_baseline_isa_arm.py;
# --noconftest: the host has no aarch64 attn_fast to import).
log "objdump guard: no BF16/I8MM outside neon_bf16, no SVE/SME anywhere"
(cd "$REPO" && "$HOSTPY" -m pytest -q --noconftest -p no:cacheprovider tests/test_baseline_isa_arm.py)

# --- 4. the suite per ARM path, under emulation ---
# ci_subset_<path>.txt: a file or node id per line, "!node id" to deselect one (a test
# whose sizes take minutes under emulation), "#" comments.
selection() {  # the pytest arguments of path $1
  SEL=()
  case "$SUBSET" in
    ci)
      while read -r line; do
        case "$line" in
          '' | '#'*) ;;
          '!'*) SEL+=(--deselect "${line#!}") ;;
          *) SEL+=("$line") ;;
        esac
      done <"$REPO/tools/arm/ci_subset_$1.txt"
      ;;
    all) SEL=(tests) ;;
    *) echo "--subset must be ci or all" >&2; exit 2 ;;
  esac
}
status=0
for isa in $PATHS; do
  case "$isa" in
    neon) cpu=neoverse-n1 ;;
    neon_bf16) cpu=max ;;
    *) echo "unknown ARM path $isa (neon, neon_bf16)" >&2; exit 2 ;;
  esac
  selection "$isa"
  log "pytest on $isa (QEMU_CPU=$cpu), subset $SUBSET: ${SEL[*]}"
  t0=$SECONDS
  rc=0
  in_root /usr/bin/env QEMU_CPU=$cpu ATTN_FAST_ISA=$isa PYTHONPATH=/opt/attn_fast ATTN_FAST_QEMU_USER=1 \
    HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
    sh -c 'cd /opt/attn_fast && python -c "import attn_fast as af; af.show_config()" &&
           exec python -m pytest -q -p no:cacheprovider --durations=15 "$@"' sh \
    "${SEL[@]}" "${PYTEST_ARGS[@]}" || rc=$?
  [ $rc = 0 ] || status=$rc
  log "$isa: pytest exit $rc after $((SECONDS - t0)) s"
done
# The benchmark command an ARM user runs, in its seconds-long form (figures meaningless here).
log "python -m attn_fast bench --tiny (QEMU_CPU=max): the command runs on aarch64"
in_root /usr/bin/env QEMU_CPU=max PYTHONPATH=/opt/attn_fast python -m attn_fast bench --tiny \
  >"$BUILD.bench-tiny.log" 2>&1 || { cat "$BUILD.bench-tiny.log"; status=1; }
tail -3 "$BUILD.bench-tiny.log"
# The default path of each emulated CPU (the dispatch's choice, no ATTN_FAST_ISA).
for cpu in neoverse-n1 max; do
  in_root /usr/bin/env QEMU_CPU=$cpu PYTHONPATH=/opt/attn_fast \
    python -c "import attn_fast as af; print('== arm: default ISA on QEMU_CPU=$cpu:', af.get_isa(), '| available:', *af._core.available_isas())"
done
log "done in ${SECONDS} s, status $status"
exit $status
