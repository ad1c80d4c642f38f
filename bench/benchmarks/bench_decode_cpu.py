"""Decode cost per key on one thread, by thread CPU time: fp32, bf16 and int8 KV caches.

    python bench/benchmarks/bench_decode_cpu.py [--shape 32 8 128] [--lengths 192 2048 32768]
        [--rounds 5]

For each cache length L, three KVCaches (float32, bfloat16, int8) hold the same tokens; one
decode step ``cache.attend(q)`` (B = 1, one query token) of each is timed in turn, ``--rounds``
times, by the calling thread's CPU time (``time.thread_time_ns``; with one kernel thread the
kernel runs on the calling thread), best of n within a round, medians of the rounds. CPU time
leaves out the time a loaded machine gives to other processes, so the figures hold on a shared
host where wall-clock ratios do not.

Printed per dtype: ms per step, ns per key and kv head, the bytes read per CPU second (the
rate one thread could feed: fp32 4 and bf16 2 bytes per element, int8 d + dv codes and
8 + 8 d / 64 bytes of scales per key), and fp32 time / that time. Read it as: a dtype whose
ns per key is the same with K/V in L2/L3 (small L) as from DRAM (large L) is compute-bound,
and two threads of it can feed at most twice its GB/s; the streaming-read probe (one and two
threads, printed first) is the memory side. Every result is checked against the float64 oracle
of the stored (rounded or dequantised) K/V before it is timed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import attn_fast as af
from attn_fast import _core, reference
from attn_fast._config import cpu_model

DTYPES = ("float32", "bfloat16", "int8")


def bytes_per_key(dtype, d):
    """K and V bytes one step reads per key and kv head (d = dv)."""
    return {"float32": 8 * d, "bfloat16": 4 * d, "int8": 2 * d + 8 + 8 * d / 64}[dtype]


def check(cache, q, out, hkv):
    """The first query heads of kv head 0 against the float64 oracle of the stored K/V."""
    g = q.shape[1] // hkv
    k = np.asarray(cache.keys(0)[:1], dtype=np.float64)[None]
    v = np.asarray(cache.values(0)[:1], dtype=np.float64)[None]
    ref = reference.sdpa(np.asarray(q[:1, :g], dtype=np.float64), k, v)
    err = float(np.abs(np.asarray(out[:1, :g], dtype=np.float64) - ref).max())
    if not err < 1e-3:
        raise SystemExit(f"{cache.dtype}: max |err| {err:.2e} against the oracle")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
    p.add_argument("--lengths", type=int, nargs="+", default=[192, 2048, 32768])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    hq, hkv, d = args.shape
    af.set_num_threads(1)
    bw1 = _core.stream_read_gbps(1, 512 << 20, 5)
    bw2 = _core.stream_read_gbps(2, 512 << 20, 5)
    print(
        f"attn_fast {af.__version__}  ISA {_core.active_isa()}  1 kernel thread, thread CPU time  "
        f"CPU {cpu_model()}\nstreaming read probe: {bw1:.1f} GB/s (1 thread), "
        f"{bw2:.1f} GB/s (2 threads); H_q {hq} H_kv {hkv} d = dv = {d}, B = 1"
    )
    rng = np.random.default_rng(0)
    for L in args.lengths:
        kv = rng.standard_normal((1, hkv, L, d), dtype=np.float32)
        q32 = rng.standard_normal((1, hq, 1, d), dtype=np.float32)
        caches, qs = {}, {}
        for dt in DTYPES:
            x = kv.astype(ml_dtypes.bfloat16) if dt == "bfloat16" else kv
            qs[dt] = q32.astype(ml_dtypes.bfloat16) if dt == "bfloat16" else q32
            caches[dt] = af.KVCache(1, hkv, d, capacity=L + 1, dtype=dt)
            caches[dt].append(x, x[:, :, ::-1])
            check(caches[dt], qs[dt], caches[dt].attend(qs[dt]), hkv)
        del kv
        reps = max(3, int(2e9 // (L * hkv * d * 8)))
        best = {dt: [] for dt in DTYPES}
        for _ in range(args.rounds):
            for dt in DTYPES:
                c, q = caches[dt], qs[dt]
                ts = []
                for _ in range(reps):
                    t0 = time.thread_time_ns()
                    c.attend(q)
                    ts.append(time.thread_time_ns() - t0)
                best[dt].append(min(ts))
        med = {dt: statistics.median(v) for dt, v in best.items()}
        keys = L * hkv
        print(f"L {L} ({args.rounds} rounds, best of {reps}):")
        for dt in DTYPES:
            gbs = bytes_per_key(dt, d) * keys / med[dt]
            print(
                f"  {dt:9s} {med[dt] / 1e6:8.3f} ms  {med[dt] / keys:6.2f} ns/key  "
                f"{gbs:6.1f} GB/s  vs fp32 {med['float32'] / med[dt]:.2f}x"
            )


if __name__ == "__main__":
    main()
