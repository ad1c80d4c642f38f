"""The benchmark suite: `python -m attn_fast bench --full` (or `--quick`).

Measures, in one run and one process:
  - this machine's limits: the FP32 FMA peak (a register-only FMA loop in the
    extension) and the streaming-read memory bandwidth (a large read), for
    each thread count;
  - attn_fast against its peers on prefill, GQA-prefill and decode cases:
    the textbook NumPy code, torch's scaled_dot_product_attention (CPU) and
    onnxruntime's MultiHeadAttention / GroupQueryAttention contrib ops when
    they are installed (`pip install 'attn_fast[bench]'`; missing peers are
    skipped with a note).

Every result is first checked against the float64 oracle (a slice of heads
and query rows); that call is also the warm-up. Implementations are then
timed interleaved (one call of each per round, rotating the order, with a
pause before each call so that the previous library's spinning worker
threads have gone idle: COOLDOWN_S, then untimed calls of the same
implementation for 10 ms so that the idle machine is awake again: WARM_S;
not for calls of 0.25 s or more); the table shows medians and
attn_fast's min-max, the JSON file every sample.
An implementation slower than max_seconds in total stops after 3 samples.
Prefill is reported in GFLOP/s and % of the FMA peak
(FLOPs = 4·B·Hq·Lq·Lk·d, half of that for causal); decode in GB/s and % of
the read bandwidth (bytes = the K and V caches read once). Ratios are
peer time / attn_fast time (above 1: attn_fast is faster). Peak memory per
case is the RSS high-water mark (VmHWM) of a fresh subprocess running one
call, minus its RSS just before the call, the mark reset first (clear_refs
5: making the inputs, fp32 rounded to bf16, would otherwise count). (Not
ru_maxrss: Linux carries the parent's high-water mark into a child.)

`--dtype bf16` / `--dtype fp16` add, after each float32 case, the same case
with q, k, v in that dtype: attn_fast against torch in the same dtype (the
NumPy and onnxruntime peers are float32 only: skipped), checked against the
float64 oracle on the same rounded inputs, timed interleaved in the same run.
Their rows carry the dtype in the name; decode GB/s count the bytes actually
read (2 per element), and the JSON's bf16-decode check compares its tokens/s
with the float32 row of the same shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from dataclasses import asdict

import numpy as np

from .. import _core
from .._config import config, get_num_threads, set_num_threads
from . import common
from .cases import DTYPES, check, full_cases, make_inputs, quick_cases, tiny_cases, with_dtypes
from .common import INSTALL_HINT
from .measure import machine_limits, peak_memory, summarise, time_interleaved
from .peers import IMPLS, Skip, prepare
from .tables import evaluate_targets, format_pct_row, format_row, measured_impls, plot, set_rates


def run(
    cases,
    thread_counts,
    repeats=5,
    memory=True,
    impls=IMPLS,
    out=None,
    max_seconds=20.0,
    probe_seconds=0.3,
    probe_bytes=512 << 20,
):
    """Measure `cases` at each of `thread_counts`; print the tables to `out`;
    return the result dict.

    One section per thread count: each row is printed as its case finishes
    (times, rates and peer ratios), and the machine's limits are probed before
    the section and next to every case. The limits of a section are the
    highest of its probes (other processes can only lower a probe); they are
    printed once per section, in the final table of % of the limits. The
    attn_fast thread count in effect before the call is restored afterwards.
    """
    out = sys.stdout if out is None else out
    cfg = config()
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("torch", "onnxruntime", "onnx"):
        m = common.import_peer(mod) if mod in impls or mod == "onnx" else None
        versions[mod] = getattr(m, "__version__", None) if m else None
    result = {
        "machine": {
            "cpu": cfg["cpu"],
            "cpu_id": cfg["cpu_id"],
            "cores": os.cpu_count(),
            "isa": cfg["isa"],
            "available_isas": cfg["available_isas"],
            "openmp": cfg["openmp"],
            "platform": platform.platform(),
        },
        "versions": {"attn_fast": cfg["version"], **versions},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "repeats": repeats,
        "limits": {},
        "results": [],
        "notes": [],
    }
    cpu_about = ", ".join(x for x in (cfg["cpu_id"], f"{os.cpu_count()} cores") if x)
    print(
        f"attn_fast {cfg['version']}  ISA {cfg['isa']}  decode prefetch {cfg['decode_prefetch']}  "
        f"CPU {cfg['cpu']} ({cpu_about})",
        file=out,
    )
    print("  " + "  ".join(f"{k} {v}" for k, v in versions.items() if v), file=out)
    active = [i for i in impls]
    for peer, mod in (("torch", "torch"), ("onnxruntime", "onnxruntime")):
        if peer in active and common.import_peer(mod) is None:
            note = f"{peer} not installed: its column is skipped ({INSTALL_HINT})"
            print(note, file=out)
            result["notes"].append(note)
            active.remove(peer)
    threads_before = get_num_threads()
    try:
        _run_sections(
            result,
            cases,
            thread_counts,
            repeats,
            active,
            out,
            max_seconds,
            probe_seconds,
            probe_bytes,
        )
    finally:
        set_num_threads(threads_before)
    measured = measured_impls(result)
    print(
        "\n== % of this machine's limits: prefill of the FP32 FMA peak, decode of the read "
        "bandwidth "
        "(each section: the highest of its probes)",
        file=out,
    )
    for nt in thread_counts:
        lim = result["limits"][str(nt)]
        print(
            f"-- {nt} thread(s): FP32 FMA peak {lim['fma_peak_gflops']:.0f} GFLOP/s, "
            f"read bandwidth {lim['read_bandwidth_gbs']:.1f} GB/s",
            file=out,
        )
        hdr = f"{'case':34s} | {'rate':>10s} | " + " ".join(f"{p[:11]:>11s}" for p in measured)
        print(hdr, file=out)
        for row in result["results"]:
            if row["threads"] == nt:
                print(format_pct_row(row, measured), file=out)
    if memory:
        nt = max(thread_counts)
        print(
            f"\n== peak memory of one call (fresh process, RSS above inputs, {nt} threads), MiB",
            file=out,
        )
        print(f"{'case':34s} | " + " ".join(f"{p[:11]:>11s}" for p in active), file=out, flush=True)
        for case in cases:
            mem = {}
            for impl in active:
                row = next(
                    r for r in result["results"] if r["name"] == case.name and r["threads"] == nt
                )
                mem[impl] = None if "skipped" in row["impls"][impl] else peak_memory(case, impl, nt)
                row["impls"][impl]["peak_extra_rss_bytes"] = mem[impl]
            print(
                f"{case.name:34s} | "
                + " ".join(
                    f"{m / 2**20:11.1f}" if m is not None else f"{'-':>11s}" for m in mem.values()
                ),
                file=out,
                flush=True,
            )
    print(
        "\nx = peer time / attn_fast time (above 1: attn_fast is faster); rate: attn_fast's "
        "GFLOP/s "
        "(prefill) or GB/s of K and V read (decode)",
        file=out,
    )
    # The maintainers' performance checks, judged on this run: kept in the JSON only.
    result["targets"] = evaluate_targets(result)
    return result


def _run_sections(
    result, cases, thread_counts, repeats, active, out, max_seconds, probe_seconds, probe_bytes
):
    for nt in thread_counts:
        peak, bw = machine_limits(nt, probe_seconds, nbytes=probe_bytes)
        print(f"\n== {nt} thread(s)", file=out)
        hdr = f"{'case':34s} | {'attn_fast ms [min-max]':>25s} {'rate':>10s}" + "".join(
            f" | {p[:11]:>11s} {'x':>5s}" for p in active if p != "attn_fast"
        )
        print(hdr, file=out)
        print("-" * len(hdr), file=out, flush=True)
        for case in cases:
            if getattr(out, "isatty", lambda: False)():
                print(f"{case.name:34s} | running ...", end="\r", file=out, flush=True)
            q, k, v = make_inputs(case)
            fns, row = {}, {"case": asdict(case), "name": case.name, "threads": nt, "impls": {}}
            for impl in active:
                try:
                    fn = prepare(impl, case, q, k, v, nt)
                    err = check(fn(), case, q, k, v)
                    fns[impl] = fn
                    row["impls"][impl] = {"oracle_max_abs_err": err}
                except Skip as e:
                    row["impls"][impl] = {"skipped": str(e)}
            set_num_threads(nt)
            # Probe the limit next to every case: the load from other processes
            # changes by the minute, and only lowers a probe, so the section's
            # limit is the highest probe seen (the final table uses it).
            if case.kind == "decode":
                row["probe_read_bandwidth_gbs"] = _core.read_bandwidth_gbs(
                    nt, probe_bytes, probe_seconds / 2
                )
                bw = max(bw, row["probe_read_bandwidth_gbs"])
            else:
                row["probe_fma_peak_gflops"] = _core.fma_peak_gflops(nt, probe_seconds / 2)
                peak = max(peak, row["probe_fma_peak_gflops"])
            # The oracle check above was each callable's warm-up call.
            samples = time_interleaved(fns, repeats, warmup=0, max_seconds=max_seconds)
            for impl, ts in samples.items():
                r = row["impls"][impl]
                r.update(summarise(ts))
                if impl != "attn_fast" and "attn_fast" in samples:
                    r["speedup_attn_fast"] = r["median_s"] / row["impls"]["attn_fast"]["median_s"]
            set_rates(row, peak, bw)
            result["results"].append(row)
            print(format_row(row, active), file=out, flush=True)
        result["limits"][str(nt)] = {"fma_peak_gflops": peak, "read_bandwidth_gbs": bw}
        for row in result["results"]:  # % of the section's final limits, the only ones printed
            if row["threads"] == nt:
                set_rates(row, peak, bw)


def main(argv=None, prog=None):
    """`bench --full` / `--quick` / `--tiny`; returns the process exit code."""
    prog = prog or "python -m attn_fast bench"
    p = argparse.ArgumentParser(
        prog=f"{prog} --full|--quick",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--full", action="store_true", help="every case, 1 and all threads, peak memory")
    p.add_argument(
        "--quick", action="store_true", help="a few cases at all threads (about a minute)"
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="one tiny case of each kind, 1 repeat, short probes: checks that the command runs "
        "(seconds); its figures mean nothing",
    )
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="thread counts (default: attn_fast.get_num_threads(), which honours OMP_NUM_THREADS; "
        "--full also runs 1)",
    )
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--cases", default=None, help="only cases whose name contains this text")
    p.add_argument(
        "--dtype",
        nargs="+",
        choices=DTYPES,
        default=["fp32"],
        help="also run every case with q, k, v in bf16 / fp16 (attn_fast vs torch in that dtype, "
        "rows beside the float32 ones)",
    )
    p.add_argument("--out", default="bench/results", help="folder for the JSON and PNG files")
    args = p.parse_args(argv)
    if args.threads and min(args.threads) < 1:
        p.error(f"--threads must be >= 1, got {' '.join(map(str, args.threads))}")
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if "attn_fast" not in args.impls:
        p.error("--impls must include attn_fast (the peers are timed against it)")
    mode = "tiny" if args.tiny else "quick" if args.quick and not args.full else "full"
    cases = with_dtypes(
        {"tiny": tiny_cases, "quick": quick_cases, "full": full_cases}[mode](), args.dtype
    )
    if args.cases:
        cases = [c for c in cases if args.cases in c.name]
        if not cases:
            p.error(f"--cases {args.cases!r} matches no case of --{mode}")
    nt = get_num_threads()  # set_num_threads(), else OMP_NUM_THREADS, else all cores
    threads = args.threads or ([nt] if mode != "full" else sorted({1, nt}))
    repeats = args.repeats or {"tiny": 1, "quick": 3, "full": 5}[mode]
    probes = {"probe_seconds": 0.02, "probe_bytes": 8 << 20} if mode == "tiny" else {}
    t0 = time.perf_counter()
    result = run(
        cases,
        threads,
        repeats=repeats,
        memory=mode == "full" and not args.no_memory,
        impls=args.impls,
        max_seconds={"tiny": 1.0, "quick": 4.0, "full": 20.0}[mode],
        **probes,
    )
    result["wall_s"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(args.out, f"suite-{mode}-{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    msg = f"\nwrote {base}.json"
    try:
        plot(result, base + ".png")
        msg += f" and {base}.png"
    except ImportError:
        msg += f" (matplotlib not installed: no plot; {INSTALL_HINT})"
    print(msg + f"  ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
