"""Benchmark of the masks the fused kernel skips block by block.

1. Sliding window (Mistral's local attention, causal, W = 256 keys including
   the query itself: ``Causal() & SlidingWindow(255)``) at L = 4096, 16384,
   65536, B = 1, H = 8, d = 64, float32. The time per query token should stay
   flat (cost L·W, not L²); full causal attention is timed next to it where it
   is affordable, and torch's SDPA with the equivalent dense boolean mask at
   L = 4096 (it has no sliding-window kernel on the CPU).
2. Grouped-query attention, 32 query heads over 8 KV heads, L = 2048, d = 128,
   B = 1, float32, against torch's ``enable_gqa=True``, causal and not.

Every result is checked against the float64 oracle (on a slice) before it is
timed. Times are medians of --repeats runs after one warm-up. GFLOP/s count
the useful work only: 4·d per visible (query, key) pair (QKᵀ and PV).

    python bench/benchmarks/bench_masks.py [--threads N] [--repeats R] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

import attn_fast as af
from attn_fast import masks as M
from attn_fast import reference as ref
from attn_fast._bench.common import settle, time_runs
from attn_fast._config import config


def median_time(fn, repeats, warmup=1):
    settle()  # other libraries' worker threads stop spinning first
    return statistics.median(time_runs(fn, repeats, warmup))


def _torch():
    try:
        import torch

        return torch
    except Exception:  # noqa: BLE001 - no torch, no peer column
        return None


def check_rows(o, q, k, v, rows, mask_rows, h=(0,), hk=(0,)):
    """Oracle on a few query rows of a few heads: (len(rows), Lk) mask."""
    for hq, hkv in zip(h, hk):
        O = ref.sdpa(q[0, hq, rows], k[0, hkv], v[0, hkv], mask=mask_rows)
        err = float(np.abs(o[0, hq, rows] - O).max())
        if not err < 1e-3:
            raise RuntimeError(f"result differs from the float64 oracle by {err:.2e}")


def window_pairs(L, W):
    """Visible (query, key) pairs of a causal window of W keys (self included)."""
    n = min(L, W)
    return n * (n + 1) // 2 + (L - n) * W


def bench_window(Ls, W, H, d, repeats, torch, out):
    print(
        f"\n## Sliding window: Causal() & SlidingWindow({W - 1}) = {W} keys per query, B=1 H={H} "
        f"d={d} float32",
        file=out,
    )
    hdr = (
        f"{'L':>6} | {'window ms':>10} {'us/token':>9} {'GFLOP/s':>8} {'tiles':>8} | "
        f"{'causal ms':>10} {'us/token':>9} {'tiles':>8} | {'torch dense-mask ms':>19}"
    )
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    rng = np.random.default_rng(0)
    mask = M.Causal() & M.SlidingWindow(W - 1)
    for L in Ls:
        q, k, v = (rng.standard_normal((1, H, L, d), dtype=np.float32) for _ in range(3))
        o, stats = af.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_stats=True)
        rows = np.r_[0:3, L // 2 : L // 2 + 3, L - 3 : L]
        check_rows(o, q, k, v, rows, ref.window_mask(L, L, W - 1, 0)[rows])
        t = median_time(
            lambda q=q, k=k, v=v, mask=mask: af.scaled_dot_product_attention(
                q, k, v, attn_mask=mask
            ),
            repeats,
        )
        gflops = 4.0 * d * H * window_pairs(L, W) / t / 1e9
        line = (
            f"{L:>6} | {t * 1e3:10.1f} {t / L * 1e6:9.2f} {gflops:8.1f} "
            f"{stats.tiles_computed:>8} | "
        )
        if L <= 16384:
            _, sc = af.scaled_dot_product_attention(q, k, v, is_causal=True, return_stats=True)
            # expensive and only for contrast: one run (the call above warmed up)
            tc = median_time(
                lambda q=q, k=k, v=v: af.scaled_dot_product_attention(q, k, v, is_causal=True),
                1,
                warmup=0,
            )
            line += f"{tc * 1e3:10.1f} {tc / L * 1e6:9.2f} {sc.tiles_computed:>8} | "
        else:
            line += f"{'-':>10} {'-':>9} {'-':>8} | "
        if torch is not None and L <= 4096:
            dense = torch.from_numpy(ref.window_mask(L, L, W - 1, 0))
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
            F = torch.nn.functional.scaled_dot_product_attention
            with torch.no_grad():
                to = F(tq, tk, tv, attn_mask=dense).numpy()
                check_rows(to, q, k, v, rows, ref.window_mask(L, L, W - 1, 0)[rows])
                tt = median_time(
                    lambda F=F, tq=tq, tk=tk, tv=tv, dense=dense: F(tq, tk, tv, attn_mask=dense),
                    max(1, repeats // 2),
                    warmup=0,
                )
            line += f"{tt * 1e3:19.1f}"
        else:
            line += f"{'-':>19}"
        print(line, file=out, flush=True)


def bench_gqa(L, Hq, Hkv, d, repeats, torch, out):
    print(f"\n## GQA {Hq}/{Hkv}: B=1 L={L} d={d} float32 (K/V never repeated)", file=out)
    hdr = (
        f"{'causal':>6} | {'attn_fast ms':>12} {'GFLOP/s':>8} | "
        f"{'torch enable_gqa ms':>19} {'x':>6}"
    )
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, Hq, L, d), dtype=np.float32)
    k, v = (rng.standard_normal((1, Hkv, L, d), dtype=np.float32) for _ in range(2))
    g = Hq // Hkv
    rows = np.r_[0:4, L - 4 : L]
    for causal in (False, True):
        o = af.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        cm = ref.causal_mask(L, L)[rows] if causal else None
        check_rows(o, q, k, v, rows, cm, h=(0, Hq - 1), hk=(0, (Hq - 1) // g))
        t = median_time(
            lambda q=q, k=k, v=v, causal=causal: af.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=True
            ),
            repeats,
        )
        pairs = L * (L + 1) // 2 if causal else L * L
        line = f"{str(causal):>6} | {t * 1e3:12.1f} {4.0 * d * Hq * pairs / t / 1e9:8.1f} | "
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
            F = torch.nn.functional.scaled_dot_product_attention
            with torch.no_grad():
                to = F(tq, tk, tv, is_causal=causal, enable_gqa=True).numpy()
                check_rows(to, q, k, v, rows, cm, h=(0, Hq - 1), hk=(0, (Hq - 1) // g))
                tt = median_time(
                    lambda F=F, tq=tq, tk=tk, tv=tv, causal=causal: F(
                        tq, tk, tv, is_causal=causal, enable_gqa=True
                    ),
                    repeats,
                )
            line += f"{tt * 1e3:19.1f} {tt / t:5.2f}x"
        else:
            line += f"{'-':>19} {'-':>6}"
        print(line, file=out, flush=True)
    print("x = torch time / attn_fast time (higher means attn_fast is faster)", file=out)


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    args = p.parse_args(argv)
    if args.threads:
        af.set_num_threads(args.threads)
    torch = _torch()
    if torch is not None:
        torch.set_num_threads(af.get_num_threads())
    cfg = config()
    print(
        f"attn_fast {cfg['version']}  ISA {cfg['isa']}  threads {af.get_num_threads()}  CPU "
        f"{cfg['cpu']}"
        + (f"  torch {torch.__version__}" if torch is not None else "  (torch not installed)")
    )
    if args.quick:
        bench_window([1024, 2048, 4096], 256, 2, 64, 1, torch, sys.stdout)
        bench_gqa(256, 8, 2, 64, 1, torch, sys.stdout)
    else:
        bench_window([4096, 16384, 65536], 256, 8, 64, args.repeats, torch, sys.stdout)
        bench_gqa(2048, 32, 8, 128, args.repeats, torch, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
