"""The aarch64 build runs on every ARMv8-A CPU: no BF16, I8MM, SVE or SME instruction
outside the neon_bf16 kernels (the twin of test_baseline_isa.py, SIGILL on a
Cortex-A72 otherwise).

objdump disassembles the aarch64 objects of a CMake build tree (build/*/ with
attn_k_neon objects: the cross build of tools/arm/emulate.sh, build/arm64, on an
x86-64 host with aarch64-linux-gnu-objdump; a native build tree on aarch64 with
objdump) and the extension module built there. Only attn_k_neon_bf16's objects,
and in the module only functions of attn_fast::isa_neon_bf16, may hold the BF16 /
I8MM instructions; SVE and SME appear nowhere (no SVE path is built).
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OBJDUMP = (
    shutil.which("objdump")
    if platform.machine() in ("aarch64", "arm64")
    else shutil.which("aarch64-linux-gnu-objdump")
)
pytestmark = pytest.mark.skipif(
    OBJDUMP is None, reason="no aarch64 objdump (Debian: binutils-aarch64-linux-gnu)"
)

# FEAT_BF16 (BFDOT, BFMMLA, BFMLALB/T, BFCVT, BFCVTN/N2; not the base bitfield
# BFI / BFXIL / BFM / BFC), FEAT_I8MM (SMMLA, UMMLA, USMMLA, USDOT, SUDOT); SVE / SME
# by their registers (z0-z31, p0-p15 predicates, za) or their own mnemonics.
EXT = re.compile(r"^(bfdot|bfmmla|bfmlal[bt]?|bfcvtn?2?|[us]mmla|usmmla|usdot|sudot)$")
SVE_OPERANDS = re.compile(r"\bz\d+\.[bhsdq]\b|\bp\d+/[mz]\b|\bp\d+\.[bhsd]\b|\bza\w*\b")
SVE_MNEMONICS = re.compile(r"^(ptrue\w*|whilel[eot]\w*|smstart|smstop|ld1r[bhwd]|cnt[bhwd])$")
LINE = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")


def is_ext(mnemonic, operands):
    """A BF16 / I8MM instruction (what neon_bf16 may hold)."""
    return bool(EXT.match(mnemonic))


def is_sve(mnemonic, operands):
    return bool(SVE_MNEMONICS.match(mnemonic) or SVE_OPERANDS.search(operands))


def disassembly(path):
    """[(address, mnemonic, operands)] of the code of `path`."""
    out = subprocess.run(
        [OBJDUMP, "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return [
        (int(m.group(1), 16), m.group(2), m.group(3))
        for m in map(LINE.match, out.splitlines())
        if m
    ]


def arm_trees():
    build = ROOT / "build"
    if not build.is_dir():
        return []
    return [
        d
        for d in sorted(build.glob("*"))
        if (d / "CMakeFiles").is_dir() and any(d.glob("CMakeFiles/attn_k_neon.dir/**/*.o"))
    ]


def test_arm_objects_keep_extensions_in_neon_bf16():
    trees = arm_trees()
    if not trees:
        pytest.skip("no aarch64 CMake build tree (tools/arm/emulate.sh makes build/arm64)")
    for tree in trees:
        objs = sorted(tree.glob("CMakeFiles/*.dir/**/*.o"))
        ext = [o for o in objs if "attn_k_neon_bf16" in str(o)]
        base = [o for o in objs if o not in ext]
        assert any("attn_k_neon.dir" in str(o) for o in base), tree
        for obj in objs:
            code = disassembly(obj)
            sve = [c for c in code if is_sve(c[1], c[2])]
            assert not sve, f"{obj}: SVE/SME instructions {sve[:3]}"
            n = sum(is_ext(mn, ops) for _, mn, ops in code)
            if obj in base:
                assert n == 0, f"{obj}: {n} BF16/I8MM instructions in a baseline object"
        # not vacuous: the pair kernels do use BFDOT
        assert any(mn == "bfdot" for o in ext for _, mn, _ in disassembly(o)), tree


def test_arm_extension_module_keeps_extensions_in_neon_bf16():
    trees = [t for t in arm_trees() if any(t.glob("_core.*so"))]
    if not trees:
        pytest.skip("no aarch64 extension module in a build tree")
    for tree in trees:
        so = next(tree.glob("_core.*so"))
        out = subprocess.run([OBJDUMP, "-t", "-C", str(so)], capture_output=True, text=True).stdout
        funcs = []
        for line in out.splitlines():
            m = re.match(r"^([0-9a-f]+) (.{7}) (\S+)\s+([0-9a-f]+)\s+(.*)$", line)
            if m and "F" in m.group(2) and m.group(3).startswith(".text") and int(m.group(4), 16):
                start = int(m.group(1), 16)
                funcs.append((start, start + int(m.group(4), 16), m.group(5)))
        assert any("isa_neon::flash_forward_f32" in f for _, _, f in funcs), so
        code = disassembly(so)
        assert not [c for c in code if is_sve(c[1], c[2])], f"{so}: SVE/SME instructions"
        ext = [a for a, mn, ops in code if is_ext(mn, ops)]
        bad = {
            name
            for start, end, name in funcs
            if "attn_fast::isa_neon_bf16::" not in name and any(start <= a < end for a in ext)
        }
        assert not bad, f"BF16/I8MM instructions outside isa_neon_bf16 in {so.name}: {bad}"
        assert ext, "no BF16 instruction at all: the check would be vacuous"
