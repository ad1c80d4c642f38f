"""The wheel runs on every x86-64 CPU: no AVX outside the AVX kernels.

objdump disassembles the built extension. Only functions of the isa_avx2,
isa_avx512, isa_avx512_bf16, isa_amx and isa_amx_emu namespaces may use
VEX/EVEX instructions, and only isa_amx the AMX tile instructions; everything else (the
scalar kernel, dispatch, bindings, the reference kernel, pybind11 and library
code) must be plain x86-64. Global and weak (COMDAT) functions matter most:
an inline function emitted by an AVX object as well as by a baseline one is
merged by the linker into one copy, which may be the AVX one, and the
baseline code calling it would then fault with SIGILL on an older CPU. When
the CMake build tree is at hand, its per-ISA object files are checked too.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import attn_fast as af

pytestmark = [
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only"),
    pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump not installed"),
]

AVX_NAMESPACES = (
    "attn_fast::isa_avx2::",
    "attn_fast::isa_avx512::",
    "attn_fast::isa_avx512_bf16::",
    "attn_fast::isa_amx::",
    "attn_fast::isa_amx_emu::",
)
# AMX tile instructions (issue 19): only the amx object's code may hold them
# (amx_emu emulates them with vdpbf16ps and must hold none).
AMX_NAMESPACE = "attn_fast::isa_amx::"
AMX_MNEMONICS = re.compile(
    r"^(ldtilecfg|sttilecfg|tileloadd(t1)?|tilestored|tilezero|tilerelease|tdp\w+)$"
)
LINE = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")


def is_avx(mnemonic, operands):
    """A VEX/EVEX-encoded instruction:
    v* mnemonics (not the legacy verr/verw) or ymm/zmm/mask registers."""
    if mnemonic.startswith("v") and mnemonic not in ("verr", "verw"):
        return True
    return bool(re.search(r"%[yz]mm\d|%k[0-7]\b", operands))


def avx_addresses(path, test=None):
    """Addresses of all AVX instructions (or those `test(mnemonic, operands)` picks) in the
    code of `path`."""
    test = test or is_avx
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    addrs = []
    for line in out.splitlines():
        m = LINE.match(line)
        if m and test(m.group(2), m.group(3)):
            addrs.append(int(m.group(1), 16))
    return addrs


def is_amx(mnemonic, operands):
    return bool(AMX_MNEMONICS.match(mnemonic)) or "%tmm" in operands


def amx_addresses(path):
    return avx_addresses(path, is_amx)


def function_symbols(path, dynamic):
    """[(start, end, demangled name, binding)] of the sized function symbols."""
    flag = "-T" if dynamic else "-t"
    out = subprocess.run(["objdump", flag, "-C", str(path)], capture_output=True, text=True).stdout
    syms = []
    for line in out.splitlines():
        # 0000000000012340 g    DF .text  00000000000000a1  Base        name
        m = re.match(r"^([0-9a-f]+) (.{7}) (\S+)\s+([0-9a-f]+)\s+(.*)$", line)
        if not m or "F" not in m.group(2) or not m.group(3).startswith(".text"):
            continue
        start, size = int(m.group(1), 16), int(m.group(4), 16)
        name = re.sub(r"^(?:Base|\(Base\)|\.hidden)\s+", "", m.group(5).strip())
        if size:
            syms.append((start, start + size, name, m.group(2)[0]))
    return syms


def avx_by_function(path, dynamic):
    addrs = avx_addresses(path)
    found = {}
    for start, end, name, bind in function_symbols(path, dynamic):
        n = sum(start <= a < end for a in addrs)
        found[name] = (n, bind)
    return found


def test_extension_has_avx_only_in_avx_kernels():
    # The installed .so may be stripped: its exported (dynamic) symbols with
    # their sizes say which code is which. Every sized function outside the
    # AVX namespaces (the scalar kernel, dispatch, reference, bindings,
    # pybind11 and std code that is exported) must be free of AVX.
    so = Path(af._core.__file__)
    found = avx_by_function(so, dynamic=True)
    assert any("isa_scalar::flash_forward_f32" in f for f in found), (
        "scalar kernel symbol not exported"
    )
    bad = {f: n for f, (n, _) in found.items() if n and not any(ns in f for ns in AVX_NAMESPACES)}
    assert not bad, f"AVX instructions outside the AVX kernels of {so.name}: {bad}"
    if "avx2" in af._core.compiled_isas():  # the check sees AVX where it is: not vacuous
        assert any(n for f, (n, _) in found.items() if "isa_avx2::" in f)


def build_trees():
    """The x86-64 CMake build trees (an aarch64 cross build, build/arm64 of
    tools/arm/emulate.sh, is test_baseline_isa_arm.py's)."""
    root = Path(__file__).resolve().parents[1] / "build"
    if not root.is_dir():
        return []
    return [
        d
        for d in sorted(root.glob("*"))
        if (d / "CMakeFiles").is_dir() and not (d / "CMakeFiles/attn_k_neon.dir").is_dir()
    ]


def objects(tree):
    objs = sorted(tree.glob("CMakeFiles/*.dir/**/*.o"))
    avx = [o for o in objs if re.search(r"attn_k_(avx|amx)", str(o))]
    return avx, [o for o in objs if o not in avx]


def test_build_tree_baseline_objects_have_no_avx():
    trees = [t for t in build_trees() if any(objects(t))]
    if not trees:
        pytest.skip("no CMake build tree next to the tests (installed from a wheel)")
    for tree in trees:
        avx, baseline = objects(tree)
        assert any("attn_k_scalar" in str(o) for o in baseline), tree
        for obj in baseline:
            n = len(avx_addresses(obj))
            assert n == 0, f"{obj}: {n} AVX instructions in a baseline object"
        for obj in avx:
            assert avx_addresses(obj), f"{obj}: an AVX kernel object without AVX instructions?"


def test_build_tree_no_comdat_shared_with_avx_objects():
    # A weak (COMDAT) function that an AVX object defines and a baseline object
    # also defines is merged by the linker into ONE copy, possibly the AVX one:
    # the baseline caller would then fault on an older CPU. There must be none.
    trees = [t for t in build_trees() if any(objects(t))]
    if not trees:
        pytest.skip("no CMake build tree next to the tests (installed from a wheel)")

    def defined(obj, kinds):
        out = subprocess.run(
            ["nm", "--defined-only", str(obj)], capture_output=True, text=True
        ).stdout
        return {
            ln.split()[-1]
            for ln in out.splitlines()
            if len(ln.split()) == 3 and ln.split()[1] in kinds
        }

    for tree in trees:
        avx, baseline = objects(tree)
        base_syms = set().union(*(defined(o, "TtWw") for o in baseline))
        for obj in avx:
            shared = defined(obj, "Ww") & base_syms
            assert not shared, (
                f"{obj}: weak functions also defined at baseline: {sorted(shared)[:5]}"
            )


NO_AVX_CODE = """
import numpy as np, attn_fast as af
from attn_fast import reference as ref
isas = af._core.available_isas()
assert af.get_isa() == "scalar" and isas == ["scalar"], isas
rng = np.random.default_rng(0)
worst = 0.0
for dtype in (np.float32, np.float64):
    q, k, v = (rng.standard_normal((2, 2, 37, 9)).astype(dtype) for _ in range(3))
    mask = rng.random((37, 37)) < 0.7
    for kw, oracle in (
        (dict(is_causal=True), dict(mask=ref.causal_mask(37, 37))),
        (dict(attn_mask=mask, softcap=4.0), dict(mask=mask, softcap=4.0)),
        (dict(backend="reference"), {}),
    ):
        o = af.scaled_dot_product_attention(q, k, v, **kw)
        worst = max(worst, float(np.abs(o - ref.sdpa(q, k, v, **oracle)).max()))
W = q[0, 0, :4]  # (4, 9): d = 4, D = 9
o = af.attention(q[0, 0], W, W, W, causal=True)
assert o.shape == (37, 4)
af.set_num_threads(1); af.show_config()
print("max error", worst)
assert worst < 1e-4
"""


@pytest.mark.skipif(
    shutil.which("qemu-x86_64") is None,
    reason="qemu-user not installed (apt-get install qemu-user)",
)
def test_runs_on_a_cpu_without_avx(tmp_path):
    # User-mode QEMU emulating a Nehalem (SSE4.2, no AVX) raises SIGILL on any
    # VEX instruction: import, dispatch, bindings and the scalar kernels must
    # never execute one. First prove that the emulator does trap AVX.
    import sys

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc:
        src = tmp_path / "avx.c"
        src.write_text(
            "#include <immintrin.h>\nint main(int c, char** v) {"
            " volatile __m256 a = _mm256_set1_ps((float)c);"
            " a = _mm256_add_ps(a, a); return 0; }\n"
        )
        subprocess.run([cc, "-O1", "-mavx", str(src), "-o", str(tmp_path / "avx")], check=True)
        probe = subprocess.run(
            ["qemu-x86_64", "-cpu", "Nehalem", str(tmp_path / "avx")], capture_output=True
        )
        assert probe.returncode != 0, (
            "this QEMU does not trap AVX on a Nehalem: the check would be vacuous"
        )
    r = subprocess.run(
        ["qemu-x86_64", "-cpu", "Nehalem", sys.executable, "-c", NO_AVX_CODE],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "max error" in r.stdout


def test_amx_instructions_only_in_the_amx_kernel():
    # Tile instructions fault without the OS's permission: only isa_amx code may hold them,
    # and (where the amx object is compiled) it does, so the check is not vacuous.
    so = Path(af._core.__file__)
    addrs = amx_addresses(so)
    syms = function_symbols(so, dynamic=True)
    bad = {
        name: n
        for start, end, name, _ in syms
        if AMX_NAMESPACE not in name and (n := sum(start <= a < end for a in addrs))
    }
    assert not bad, f"AMX instructions outside isa_amx in {so.name}: {bad}"
    if "amx" in af._core.compiled_isas():
        assert any(
            AMX_NAMESPACE in name and any(start <= a < end for a in addrs)
            for start, end, name, _ in syms
        ), "the amx kernel holds no tile instruction?"
    trees = [t for t in build_trees() if any(objects(t))]
    for tree in trees:
        for obj in sorted(tree.glob("CMakeFiles/*.dir/**/*.o")):
            n = len(amx_addresses(obj))
            if "attn_k_amx.dir" in str(obj):
                assert n, f"{obj}: the amx object without tile instructions?"
            else:
                assert n == 0, f"{obj}: {n} AMX instructions outside the amx object"
