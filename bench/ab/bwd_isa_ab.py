"""The fp32 backward on several ISA objects and torch SDPA's backward, in one process.

    python bench/ab/bwd_isa_ab.py [--isas avx2 avx512] [--threads 2] [--rounds 9] [--full]
    python bench/ab/bwd_isa_ab.py --threads 1 --clock cpu   # the thread's CPU time: busy hosts

For the prefill cases of bench_backward.py (quick: (1,12,512,64) and (1,16,2048,64), causal
and not; ``--full``: every prefill shape of the suite), each round times, in a rotating
order, attn_fast's backward alone under ``set_isa(isa)`` for each ISA of ``--isas`` and
torch's backward (autograd on a retained graph), then forward + backward of each: attn_fast
(sdpa with return_lse, then the backward) under each ISA and torch (SDPA + autograd.grad).
Printed per case: the median milliseconds and the medians of the per-round ratios torch /
attn_fast (above 1: attn_fast faster) and of the first ISA against the others. Ratios of one
round see the same machine, which is why they are trusted where absolute times drift (the
ISAs' objects share nothing but the process). The gradients of every ISA are checked against
torch's first. ``--probe``: the backward only, and each call's GFLOP/s (10·B·H·Lq·Lk·d,
×½ causal) as a share of the FMA probe taken just before and after it (0.15 s each, same
threads): the share of the machine's peak each backward reaches, which load does not move
much. Forcing avx2 on an AVX-512 CPU runs the AVX2 object on that core: it measures
the AVX2 code, not an AVX2-only CPU's memory system or clocks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import attn_fast as af
from attn_fast._bench import cases as bs

# bench_backward.py (its cases and timed functions) is a sibling folder's script.
BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")
sys.path.insert(0, BENCHMARKS)
from bench_backward import backward_flops, check, make_bwd_fns, make_fns  # noqa: E402


def probed(fn, threads, flops):
    """fn's GFLOP/s over the mean of the FMA probes taken just before and after it."""
    p0 = af._core.fma_peak_gflops(threads, 0.15)
    t = timed(fn)
    p1 = af._core.fma_peak_gflops(threads, 0.15)
    return flops / t / 1e9 / ((p0 + p1) / 2)


CLOCK = time.perf_counter  # --clock cpu: the calling thread's CPU time (one thread only)


def timed(fn):
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--isas", nargs="+", default=["avx2", "avx512"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--full", action="store_true")
    p.add_argument("--probe", action="store_true", help="backward's share of the FMA probe")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the thread's CPU time (needs --threads 1; the other tenants' time is not ours)",
    )
    args = p.parse_args(argv)
    if args.clock == "cpu":
        if args.threads != 1:
            raise SystemExit("--clock cpu: needs --threads 1 (CPU time of the calling thread)")
        global CLOCK
        CLOCK = time.thread_time
    avail = af._core.available_isas()
    for isa in args.isas:
        if isa not in avail:
            raise SystemExit(f"--isas: {isa} does not run on this CPU (available: {avail})")
    load = open("/proc/loadavg").read().split()[:3]
    print(
        f"attn_fast {af.__version__} | isas {' '.join(args.isas)} | threads {args.threads} | "
        f"{af._config.cpu_model()} | load {' '.join(load)} | "
        f"{args.clock} clock | medians of {args.rounds} rounds; x = torch / attn_fast, same round"
    )
    names = args.isas + ["torch"]
    head = "  ".join(f"{n + ' ms':>11s}" for n in names)
    ratios = "  ".join(f"{'x ' + n:>10s}" for n in args.isas)
    if not args.probe:
        print(f"{'case':32s} {'':8s} {head}  {ratios}  {args.isas[0] + '/other':>14s}")
    shapes = bs.PREFILL_SHAPES if args.full else bs.PREFILL_SHAPES[:2]
    cases = [
        bs.Case("prefill", B, H, H, L, L, d, c) for (B, H, L, d) in shapes for c in (False, True)
    ]
    for case in cases:
        bwd_af, bwd_torch = make_bwd_fns(case, args.threads)
        run_af, run_torch = make_fns(case, args.threads)
        for isa in args.isas:
            af._core.set_isa(isa)
            err = check(run_af, run_torch)
            if not err < 1e-4:
                raise SystemExit(f"{case.name} on {isa}: gradients differ from torch's ({err:.1e})")
        if args.probe:
            share = {n: [] for n in names}
            for r in range(args.rounds):
                for n in names[r % len(names) :] + names[: r % len(names)]:
                    if n != "torch":
                        af._core.set_isa(n)
                    fn = bwd_torch if n == "torch" else bwd_af
                    share[n].append(probed(fn, args.threads, backward_flops(case)))
            cells = "  ".join(f"{n} {statistics.median(share[n]):4.0%}" for n in names)
            print(f"{case.name:32s} bwd, share of the FMA probe: {cells}", flush=True)
            continue
        for label, fa, ft in (("bwd", bwd_af, bwd_torch), ("fwd+bwd", run_af, run_torch)):
            t = {n: [] for n in names}
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for n in order:
                    if n == "torch":
                        t[n].append(timed(ft))
                    else:
                        af._core.set_isa(n)
                        t[n].append(timed(fa))
            med = "  ".join(f"{1e3 * statistics.median(t[n]):11.1f}" for n in names)
            xs = "  ".join(
                f"{statistics.median(a / b for a, b in zip(t['torch'], t[n])):9.2f}x"
                for n in args.isas
            )
            rel = " ".join(
                f"{statistics.median(a / b for a, b in zip(t[args.isas[0]], t[n])):.2f}"
                for n in args.isas[1:]
            )
            print(f"{case.name:32s} {label:8s} {med}  {xs}  {rel:>14s}", flush=True)
    print(f"load after: {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
