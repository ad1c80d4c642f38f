#!/usr/bin/env python3
"""Where the kernel's time goes, robust to a busy machine: sample shares.

Runs one prefill case on one thread under `perf record -e cpu-clock` (this VM
has no hardware counters, but software sampling works), finds the kernel's
hot loops in the extension's disassembly (the QK/PV micro-kernel loops: a
backward branch over >= 12 vfmadd231ps and >= 6 vbroadcastss; the softmax exp
loop: a loop with vpslld and FMAs) and prints each one's share of the
samples inside the extension. Shares do not depend on how many other
processes share the cores, unlike wall or CPU time.

    python bench/benchmarks/perf_profile.py 64            # (1, 4, 2048, 64) non-causal
    python bench/benchmarks/perf_profile.py 128 --causal
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

RUN = """
import sys, numpy as np, attn_fast as af
af.set_num_threads(1)
d, causal, reps = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 4, 2048, d), dtype=np.float32) for _ in range(3))
for _ in range(reps):
    af.scaled_dot_product_attention(q, k, v, is_causal=causal)
"""


def loops(so):
    dis = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", so], capture_output=True, text=True
    ).stdout
    lines = dis.splitlines()
    addr = re.compile(r"\s+([0-9a-f]+):\s+(\S+)\s*(.*)")
    parsed = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(addr.match, lines) if m]
    found = []
    for i, (a, op, arg) in enumerate(parsed):
        if op != "jne":
            continue
        try:
            start = int(arg.split()[0], 16)
        except ValueError:
            continue
        if start >= a:
            continue
        body = [p for p in parsed[max(0, i - 80) : i] if p[0] >= start]
        nf = sum(p[1] == "vfmadd231ps" for p in body)
        nb = sum(p[1] == "vbroadcastss" for p in body)
        if nf >= 12 and nb >= 6:
            found.append((start, a + 6, "micro-kernel"))
        elif any(p[1] == "vpslld" for p in body) and any(p[1].startswith("vfmadd") for p in body):
            found.append((start, a + 6, "softmax exp"))
    return found


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("d", type=int, nargs="?", default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--reps", type=int, default=8)
    args = p.parse_args()
    import attn_fast._core as core

    so = core.__file__
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        subprocess.run(
            [
                "perf",
                "record",
                "-q",
                "-e",
                "cpu-clock",
                "-F",
                "4000",
                "-o",
                data,
                sys.executable,
                "-c",
                RUN,
                str(args.d),
                "1" if args.causal else "0",
                str(args.reps),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        rep = subprocess.run(
            ["perf", "report", "-i", data, "--stdio", "--sort", "dso,sym", "--percent-limit", "0"],
            capture_output=True,
            text=True,
        ).stdout
    ranges = loops(so)
    share = collections.Counter()
    for line in rep.splitlines():
        if line.startswith("#") or "%" not in line or os.path.basename(so) not in line:
            continue
        f = line.split()
        pct = float(f[0].rstrip("%"))
        try:
            a = int(f[-1], 16)
        except ValueError:
            share["other (named symbols)"] += pct
            continue
        name = next((n for lo, hi, n in ranges if lo <= a < hi), "other")
        share[name] += pct
    total = sum(share.values())
    print(
        f"(1, 4, 2048, {args.d}) {'causal' if args.causal else 'non-causal'}, 1 thread: "
        f"{total:.1f}% of all samples in the extension, of which"
    )
    for k, v in share.most_common():
        print(f"  {k:24s} {100 * v / total:5.1f}%")


if __name__ == "__main__":
    main()
