"""bf16 / fp16 vs fp32 attn_fast in one run: medians of interleaved repetitions.

    python bench/ab/bf16_vs_fp32.py [--reps 7] [--isa avx512_bf16] [--threads 1] [--sleep 0.1]

Each line: shape, causal, ISA, threads, median ms per dtype and the fp32/x
ratio. Every dtype is first checked against the float64 oracle on a slice.
``--sleep S`` idles S seconds before every call, as the benchmark suite does
between peers (its cooldown): short calls then pay the wake-up of an idle
machine, which the back-to-back default does not show.
Inputs are torch tensors when torch is importable (torch.bfloat16), else
ml_dtypes arrays. Timings on a shared machine are noisy: compare ratios
from the same run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

import attn_fast as af

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def inputs(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    if dtype == "fp32":
        return xs
    if torch is not None:
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
        return [torch.from_numpy(x).to(tdt) for x in xs]
    if dtype == "fp16":
        return [x.astype(np.float16) for x in xs]
    import ml_dtypes

    return [x.astype(ml_dtypes.bfloat16) for x in xs]


def as_f64(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.double().numpy()
    return np.asarray(x).astype(np.float64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--isa", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds idle before each call")
    args = ap.parse_args()
    if args.sleep < 0:
        ap.error(f"--sleep must be >= 0, got {args.sleep}")
    if args.threads:
        af.set_num_threads(args.threads)
    if args.isa:
        af.set_isa(args.isa)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    print(f"# ISA {af.get_isa()}, threads {af.get_num_threads()}, CPU {cpu}, sleep {args.sleep}")
    for shape, causal in [
        ((1, 12, 512, 64), False),
        ((1, 12, 512, 64), True),
        ((1, 16, 2048, 64), False),
        ((1, 16, 2048, 64), True),
        ((4, 8, 1024, 128), False),
        ((4, 8, 1024, 128), True),
    ]:
        data = {dt: inputs(shape, dt) for dt in ("fp32", "bf16", "fp16")}
        for dt, (q, k, v) in data.items():  # validate first: a slice against the oracle
            o = af.scaled_dot_product_attention(q[:1, :1], k[:1, :1], v[:1, :1], is_causal=causal)
            f = [as_f64(x[:1, :1]) for x in (q, k, v)]
            o = as_f64(o)
            L = shape[2]
            O = af.reference.sdpa(*f, mask=af.reference.causal_mask(L, L) if causal else None)
            err = np.abs(o - O).max()
            assert err < (1e-4 if dt == "fp32" else 2e-2), (dt, err)
        times = {dt: [] for dt in data}
        for _ in range(args.reps):  # interleaved, so drift hits every dtype alike
            for dt, (q, k, v) in data.items():
                if args.sleep:
                    time.sleep(args.sleep)
                t0 = time.perf_counter()
                af.scaled_dot_product_attention(q, k, v, is_causal=causal)
                times[dt].append(time.perf_counter() - t0)
        med = {dt: statistics.median(t) * 1e3 for dt, t in times.items()}
        print(
            f"{str(shape):18s} causal={causal!s:5s} fp32 {med['fp32']:7.1f} ms  bf16 "
            f"{med['bf16']:7.1f} ms "
            f"(x{med['fp32'] / med['bf16']:.2f})  fp16 {med['fp16']:7.1f} ms "
            f"(x{med['fp32'] / med['fp16']:.2f})"
        )


if __name__ == "__main__":
    main()
