"""Static instruction mix of the aarch64 micro-kernels' inner loops, from the disassembly.

    python bench/micro/arm_imix.py [build/arm64]

Disassembles the neon and neon_bf16 kernel objects of an aarch64 build tree (the cross
build of tools/arm/emulate.sh) with aarch64-linux-gnu-objdump (objdump on aarch64),
finds every innermost loop (a backward branch whose body holds no other backward
branch) and prints those whose body is mostly multiply-adds: per loop, the
instructions, the FMLA / BFDOT / BFMMLA count and share, the loads per
multiply-add and any scalar floating point. The fp32 prefill micro-kernel is the
loop with 24 FMLA (6 rows x 4 vectors, IsaTraits in vec_neon.h), the bf16 one the
loop with 24 BFDOT in the neon_bf16 object's flash_fwd.cpp.o.
"""

from __future__ import annotations

import argparse
import platform
import re
import shutil
import subprocess
from pathlib import Path

LINE = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")
FUNC = re.compile(r"^([0-9a-f]+) <(.*)>:$")
BRANCH = re.compile(r"^(b(\.\w+)?|cbn?z|tbn?z)$")
MAC = re.compile(r"^(fmla|bfdot|bfmmla|bfmlal[bt])$")


def objdump_tool() -> str:
    tool = "objdump" if platform.machine() in ("aarch64", "arm64") else "aarch64-linux-gnu-objdump"
    if shutil.which(tool) is None:
        raise SystemExit(f"{tool} not found (Debian: apt-get install binutils-aarch64-linux-gnu)")
    return tool


def functions(path: Path):
    """{demangled function name: [(address, mnemonic, operands)]}."""
    out = subprocess.run(
        [objdump_tool(), "-d", "-C", "--no-show-raw-insn", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    funcs, cur = {}, None
    for line in out.splitlines():
        m = FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(2), [])
            continue
        m = LINE.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return funcs


def inner_loops(code):
    """Bodies [start, branch] of backward branches that contain no other backward branch."""
    loops = []
    for i, (addr, mn, ops) in enumerate(code):
        if not BRANCH.match(mn):
            continue
        target = re.search(r"\b([0-9a-f]+) <", ops)
        if not target:
            continue
        t = int(target.group(1), 16)
        if t >= addr:
            continue
        body = [c for c in code[: i + 1] if t <= c[0] <= addr]
        loops.append(body)
    inner = []
    for body in loops:
        nested = any(
            other is not body and body[0][0] <= other[0][0] and other[-1][0] < body[-1][0]
            for other in loops
        )
        if not nested:
            inner.append(body)
    return inner


def mix(body):
    n = len(body)
    macs = sum(bool(MAC.match(mn)) for _, mn, _ in body)
    loads = sum(mn.startswith("ld") for _, mn, _ in body)
    # a load pair (ldp) brings two registers
    load_regs = sum(2 if mn.startswith("ldp") else 1 for _, mn, _ in body if mn.startswith("ld"))
    scalar_fp = [
        mn
        for _, mn, ops in body
        if mn.startswith("f") and re.match(r"^[sdh]\d+,", ops) and not mn.startswith("fmov")
    ]
    kinds = {}
    for _, mn, _ in body:
        if MAC.match(mn):
            kinds[mn] = kinds.get(mn, 0) + 1
    return n, macs, loads, load_regs, scalar_fp, kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tree", nargs="?", default="build/arm64")
    ap.add_argument("--min-macs", type=int, default=16)
    args = ap.parse_args()
    tree = Path(args.tree)
    print(
        "| object | function (innermost loop) | insns | MAC (kind) | MAC share | "
        "loads (regs) / MAC | scalar FP |"
    )
    print("|---|---|---|---|---|---|---|")
    for isa in ("neon", "neon_bf16"):
        for obj in sorted(tree.glob(f"CMakeFiles/attn_k_{isa}.dir/csrc/kernels/*.o")):
            for name, code in functions(obj).items():
                for body in inner_loops(code):
                    n, macs, loads, regs, sfp, kinds = mix(body)
                    if macs < args.min_macs:
                        continue
                    short = re.sub(r"\(.*", "", name.replace("(anonymous namespace)::", ""))[:90]
                    kind = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
                    print(
                        f"| {isa}/{obj.name.split('.')[0]} | {short} | {n} | {kind} | "
                        f"{macs / n:.0%} | {loads} ({regs}) / {macs} = {loads / macs:.2f} | "
                        f"{len(sfp)} |"
                    )


if __name__ == "__main__":
    main()
