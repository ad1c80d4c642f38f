"""`python -m attn_fast bench`: prefill throughput of attn_fast vs its peers.

Peers, measured in the same run and interleaved: the textbook NumPy code
(float32, materialises the L x L matrix) and torch's
scaled_dot_product_attention on the CPU when torch is importable. Each result
is checked against the float64 oracle before it is timed. Times are medians of
several repeats after a warm-up; FLOPs count 4·B·H·Lq·Lk·d (QKᵀ and PV), half
of that for causal.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from .. import _core, reference
from .._config import config, get_num_threads, set_num_threads
from ..functional import scaled_dot_product_attention
from . import common
from .common import INSTALL_HINT, median_time, numpy_textbook, settle

DEFAULT_CASES = [
    # B, H, L, d, causal
    (1, 12, 512, 64, False),
    (1, 12, 512, 64, True),
    (1, 16, 2048, 64, False),
    (1, 16, 2048, 64, True),
    (1, 32, 2048, 128, True),
]

# `--tiny`: checks that the command runs, in seconds; the figures mean nothing
TINY_CASES = [(1, 2, 64, 16, False), (1, 2, 64, 16, True)]


def check_against_oracle(o, q, k, v, causal):
    # Validate on a slice of heads to keep the float64 oracle cheap.
    h = min(2, q.shape[1])
    mask = reference.causal_mask(q.shape[2], k.shape[2]) if causal else None
    O = reference.sdpa(q[:1, :h], k[:1, :h], v[:1, :h], mask=mask)
    err = float(np.abs(np.asarray(o)[:1, :h] - O).max())
    if not err < 1e-3:
        raise RuntimeError(f"result differs from the float64 oracle by {err:.2e}")
    return err


def run(cases, repeats=5, threads=None, include_numpy=True, out=None, probe_seconds=0.3):
    """Time `cases` ((B, H, L, d, causal) tuples); print a table to `out`; return the figures.

    threads: attn_fast's and torch's thread count for the run (default:
    attn_fast.get_num_threads(), which honours OMP_NUM_THREADS); the count in
    effect before is restored afterwards.
    """
    out = sys.stdout if out is None else out
    threads_before = get_num_threads()
    try:
        return _run(cases, repeats, threads, include_numpy, out, probe_seconds)
    finally:
        set_num_threads(threads_before)


def _run(cases, repeats, threads, include_numpy, out, probe_seconds):
    if threads:
        set_num_threads(threads)
    nt = get_num_threads()
    torch = common.import_peer("torch")
    if torch is not None:
        torch.set_num_threads(nt)
    cfg = config()
    print(f"attn_fast {cfg['version']}  ISA {cfg['isa']}  threads {nt}  CPU {cfg['cpu']}", file=out)
    peak = _core.fma_peak_gflops(nt, probe_seconds)
    print(f"measured FP32 FMA peak on {nt} thread(s): {peak:.0f} GFLOP/s", file=out)
    if torch is None:
        print(f"torch not installed: its column is skipped ({INSTALL_HINT})", file=out)
    hdr = (
        f"{'B':>2} {'H':>3} {'L':>5} {'d':>4} {'causal':>6} | "
        f"{'attn_fast ms':>12} {'GFLOP/s':>8} {'%peak':>6} | "
        f"{'numpy ms':>9} {'x':>6} | {'torch ms':>9} {'x':>6}"
    )
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    rows = []
    rng = np.random.default_rng(0)
    for B, H, L, d, causal in cases:
        q, k, v = (rng.standard_normal((B, H, L, d), dtype=np.float32) for _ in range(3))
        o = scaled_dot_product_attention(q, k, v, is_causal=causal)
        check_against_oracle(o, q, k, v, causal)
        flops = 4.0 * B * H * L * L * d * (0.5 if causal else 1.0)
        settle()
        t_af = median_time(
            lambda q=q, k=k, v=v, c=causal: scaled_dot_product_attention(q, k, v, is_causal=c),
            repeats,
        )
        row = {
            "B": B,
            "H": H,
            "L": L,
            "d": d,
            "causal": causal,
            "attn_fast_s": t_af[0],
            "attn_fast_gflops": flops / t_af[0] / 1e9,
        }
        t_np = t_th = None
        if include_numpy and B * H * L * L * 4 <= 2 << 30:
            check_against_oracle(numpy_textbook(q, k, v, causal), q, k, v, causal)
            settle()
            t_np = median_time(
                lambda q=q, k=k, v=v, c=causal: numpy_textbook(q, k, v, c), max(1, repeats // 2)
            )
            row["numpy_s"] = t_np[0]
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
            F = torch.nn.functional.scaled_dot_product_attention
            with torch.no_grad():
                check_against_oracle(F(tq, tk, tv, is_causal=causal).numpy(), q, k, v, causal)
                settle()
                t_th = median_time(
                    lambda F=F, tq=tq, tk=tk, tv=tv, c=causal: F(tq, tk, tv, is_causal=c), repeats
                )
            row["torch_s"] = t_th[0]
        rows.append(row)
        np_s = f"{t_np[0] * 1e3:9.1f} {t_np[0] / t_af[0]:5.2f}x" if t_np else f"{'-':>9} {'-':>6}"
        th_s = f"{t_th[0] * 1e3:9.1f} {t_th[0] / t_af[0]:5.2f}x" if t_th else f"{'-':>9} {'-':>6}"
        print(
            f"{B:>2} {H:>3} {L:>5} {d:>4} {str(causal):>6} | {t_af[0] * 1e3:12.1f} "
            f"{row['attn_fast_gflops']:8.1f} "
            f"{100 * row['attn_fast_gflops'] / peak:5.0f}% | {np_s} | {th_s}",
            file=out,
            flush=True,
        )
    print("x = peer time / attn_fast time (higher means attn_fast is faster)", file=out)
    return {"config": cfg, "threads": nt, "peak_gflops": peak, "rows": rows}


def main(argv=None, prog=None):
    """`bench [--threads N] [--repeats N] [--no-numpy] [--tiny]`; `--full` /
    `--quick` run the suite."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or "python -m attn_fast bench"
    if (
        "--full" in argv or "--quick" in argv or "--dtype" in argv
    ):  # --dtype: the suite's 16-bit rows
        from .suite import main as suite_main

        return suite_main(argv, prog=prog)
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for attn_fast and torch (default: attn_fast.get_num_threads(), "
        "which honours OMP_NUM_THREADS)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-numpy", action="store_true", help="skip the textbook NumPy peer")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="two tiny cases and a short probe: checks that the command runs (seconds); "
        "its figures mean nothing",
    )
    p.add_argument("--full", action="store_true", help=f"the full suite ({prog} --full -h)")
    p.add_argument("--quick", action="store_true", help="the suite's quick subset (about a minute)")
    p.add_argument(
        "--dtype", nargs="+", help="bf16 / fp16 rows in the suite (--full unless --quick)"
    )
    args = p.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.tiny:
        run(
            TINY_CASES,
            repeats=min(args.repeats, 1),
            threads=args.threads,
            include_numpy=not args.no_numpy,
            probe_seconds=0.02,
        )
    else:
        run(
            DEFAULT_CASES,
            repeats=args.repeats,
            threads=args.threads,
            include_numpy=not args.no_numpy,
        )
    return 0
