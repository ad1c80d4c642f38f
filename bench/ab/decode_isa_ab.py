"""bf16 decode, the avx512 kernel against the avx512_bf16 one (vdpbf16ps Q K^T), in one process.

    python bench/ab/decode_isa_ab.py [--threads 2] [--rounds 15] [--shapes 1x4096 1x32768 8x4096]

A ``KVCache(B, 8, 128)`` in float32 and one in bfloat16 hold the same L tokens per sequence
(H_q = 32, GQA 4); one decode step (q: (B, 32, 1, 128)) is timed three ways per round, the
order rotating: the fp32 cache, the bf16 cache under ``set_isa("avx512")`` and under
``set_isa("avx512_bf16")`` (best of n calls each, ~0.3 GB of reads). Printed: medians over
the rounds, and medians of the per-round ratios (fp32 time / bf16 time, and avx512_bf16 /
avx512). Both bf16 results are checked against the float64 oracle on two heads first.
Needs a CPU with AVX512-BF16 (the ISA's own check refuses otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

import attn_fast as af
from attn_fast._checks import BF16
from attn_fast._config import config

# bench_paged.py (its shapes, check and timer) is a sibling folder's script, not a package.
BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")
sys.path.insert(0, BENCHMARKS)
from bench_paged import HKV, HQ, best_time, check, tokens  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--shapes", nargs="+", default=["1x4096", "1x32768", "8x4096"])
    args = p.parse_args(argv)
    af.set_num_threads(args.threads)
    old = af.get_isa()
    D = 128
    print(f"attn_fast {config()['version']}  threads {args.threads}  CPU {config()['cpu']}")
    for shape in args.shapes:
        B, L = (int(x) for x in shape.split("x"))
        caches = {}
        for name, dt in (("float32", np.dtype(np.float32)), ("bfloat16", BF16)):
            rng = np.random.default_rng(0)
            kv, q = tokens(rng, (B, HKV, L, D), dt), tokens(rng, (B, HQ, 1, D), dt)
            c = af.KVCache(B, HKV, D, capacity=L, dtype=name)
            c.append(kv, kv)
            caches[name] = (c, q)
        c16, q16 = caches["bfloat16"]
        for isa in ("avx512", "avx512_bf16"):
            af.set_isa(isa)
            check(c16.attend(q16), q16, c16.keys(0), c16.values(0), 2e-2)
        runs = {
            "fp32": ("avx512_bf16", caches["float32"]),
            "bf16 avx512": ("avx512", caches["bfloat16"]),
            "bf16 avx512_bf16": ("avx512_bf16", caches["bfloat16"]),
        }
        n = max(3, min(30, int(3e8 / (B * L * HKV * 2 * D * 2))))
        t = {k: [] for k in runs}
        keys = list(runs)
        for r in range(args.rounds):
            for k in keys[r % 3 :] + keys[: r % 3]:
                isa, (c, q) = runs[k]
                af.set_isa(isa)
                t[k].append(best_time(lambda c=c, q=q: c.attend(q), n))
        af.set_isa(old)
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}

        def ratio(a, b, t=t):
            return statistics.median(x / y for x, y in zip(t[a], t[b]))

        print(
            f"{B}x{L}: fp32 {med['fp32']:.3f} ms | bf16 avx512 {med['bf16 avx512']:.3f} ms "
            f"({ratio('fp32', 'bf16 avx512'):.2f}x fp32) | bf16 avx512_bf16 "
            f"{med['bf16 avx512_bf16']:.3f} ms ({ratio('fp32', 'bf16 avx512_bf16'):.2f}x fp32) | "
            f"avx512_bf16 / avx512 {ratio('bf16 avx512_bf16', 'bf16 avx512'):.3f}"
        )


if __name__ == "__main__":
    main()
