"""Paired A/B of two builds of attn_fast in one process: this one against a base build.

    git archive REV | tar -x -C /tmp/base_src             # the base commit's tree
    pip wheel --no-deps /tmp/base_src -w /tmp/base_wheel  # its wheel (built as any user would)
    python bench/ab/ab_versions.py --base-wheel /tmp/base_wheel/attn_fast-*.whl \\
        [--threads 2] [--pairs 7] [--cases full|quick|prefill|decode] [--isa avx2] \\
        [--dtype fp32|bf16|fp16] [--kv-cache float32|bfloat16|int8]

The base wheel is unpacked into a temporary folder and imported under another
name (``attn_fast_base``; the package's imports are relative and its extension
modules are found by file, so both builds live side by side in one process).
For each case of the benchmark suite (``--cases``, in ``--dtype``), both builds run
``scaled_dot_product_attention`` on the same NumPy inputs, first checked
against each other (the largest |new - base|, 0 when bit-identical) and the
float64 oracle on one head (``--kv-cache``: one decode step through each
build's KVCache of that storage, filled with the same tokens; checked against
each other only), then timed in ABBA order: each pair is one call of
each, back to back, and its figure is new / base. Printed per case: the
median ratio of wall time over the pairs with its quartiles, the same for the
process's CPU time, and each build's median milliseconds. A ratio below 1
means this build is faster. Pairs taken back to back see the same machine
(load, clock, the host's other tenants), which is why the ratio is trusted
where absolute times drift.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zipfile
from dataclasses import replace

import numpy as np

import attn_fast as af
from attn_fast import reference
from attn_fast._bench import cases as bs


def load_base(wheel, where):
    """Unpack `wheel` into `where` and import its package as ``attn_fast_base``."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(where)
    src = os.path.join(where, "attn_fast")
    if not os.path.isdir(src):
        raise SystemExit(f"--base-wheel {wheel}: no attn_fast package inside")
    shutil.move(src, os.path.join(where, "attn_fast_base"))
    sys.path.insert(0, where)
    return importlib.import_module("attn_fast_base")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def select_cases(which, dtype):
    full = [replace(c, dtype=dtype) for c in bs.full_cases()]
    if which == "full":
        return full
    if which == "quick":
        return [replace(c, dtype=dtype) for c in bs.quick_cases()]
    if which == "prefill":
        return [c for c in full if c.kind != "decode"]
    if which == "decode":
        return [c for c in full if c.kind == "decode"]
    raise SystemExit(f"--cases must be full, quick, prefill or decode, got {which!r}")


def oracle_error(o, case, q, k, v):
    """max |o - float64 oracle| on the first (batch, head), relative to max |oracle|."""
    mask = reference.causal_mask(case.Lq, case.Lk) if case.causal else None
    q, k, v, o = (bs.f64(x[:1, :1]) for x in (q, k, v, o))
    ref = reference.sdpa(q, k, v, mask=mask)
    return float(np.abs(o - ref).max() / max(np.abs(ref).max(), 1e-30))


def timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def run_case(case, new, base, pairs, threads):
    q, k, v = bs.make_inputs(case)
    if case.dtype == "bf16":  # as ml_dtypes arrays: each build knows only its own bits wrapper
        import ml_dtypes

        q, k, v = (np.asarray(x).view(np.ndarray).view(ml_dtypes.bfloat16) for x in (q, k, v))
    gqa = case.Hq > case.Hkv
    calls = {}
    for name, mod in (("new", new), ("base", base)):
        mod.set_num_threads(threads)
        calls[name] = lambda mod=mod: mod.scaled_dot_product_attention(
            q, k, v, is_causal=case.causal, enable_gqa=gqa
        )
    o_new, o_base = calls["new"](), calls["base"]()
    diff = float(np.abs(bs.f64(o_new) - bs.f64(o_base)).max())
    err = max(oracle_error(o, case, q, k, v) for o in (o_new, o_base))
    if err > (1e-4 if case.dtype == "fp32" else 2e-2):
        raise SystemExit(f"{case.name}: a build is off the float64 oracle by {err:.2e}")
    del o_new, o_base
    return _time_pairs(calls, pairs, diff)


def _time_pairs(calls, pairs, diff):
    wall_r, cpu_r, t_new, t_base = [], [], [], []
    for i in range(pairs):
        order = ("new", "base") if i % 2 == 0 else ("base", "new")  # ABBA
        got = {n: timed(calls[n]) for n in order}
        wall_r.append(got["new"][0] / got["base"][0])
        cpu_r.append(got["new"][1] / got["base"][1])
        t_new.append(got["new"][0])
        t_base.append(got["base"][0])
    return {
        "wall": quartiles(wall_r),
        "cpu": quartiles(cpu_r),
        "new_ms": 1e3 * statistics.median(t_new),
        "base_ms": 1e3 * statistics.median(t_base),
        "diff": diff,
    }


def run_kv_case(case, new, base, pairs, threads, storage):
    """One decode step through each build's KVCache of `storage` ("float32",
    "bfloat16" or "int8"), filled with the same float32 tokens."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((case.B, case.Hkv, case.Lk, case.d), dtype=np.float32)
    v = rng.standard_normal((case.B, case.Hkv, case.Lk, case.d), dtype=np.float32)
    q = rng.standard_normal((case.B, case.Hq, 1, case.d), dtype=np.float32)
    calls = {}
    for name, mod in (("new", new), ("base", base)):
        mod.set_num_threads(threads)
        c = mod.KVCache(case.B, case.Hkv, case.d, capacity=case.Lk + 1, dtype=storage)
        if storage == "bfloat16":
            import ml_dtypes

            c.append(k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16))
            qq = q.astype(ml_dtypes.bfloat16)
        else:
            c.append(k, v)
            qq = q
        calls[name] = lambda c=c, qq=qq: c.attend(qq)
    diff = float(np.abs(bs.f64(calls["new"]()) - bs.f64(calls["base"]())).max())
    return _time_pairs(calls, pairs, diff)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-wheel", required=True, help="a wheel of the base build")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=7, help="ABBA pairs per case (>= 2)")
    ap.add_argument("--cases", default="full", help="full, quick, prefill or decode")
    ap.add_argument("--isa", default=None, help="force this ISA in both builds")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument(
        "--kv-cache",
        default=None,
        choices=("float32", "bfloat16", "int8"),
        help="decode cases through KVCache of this storage instead of sdpa",
    )
    args = ap.parse_args(argv)
    if args.pairs < 2:
        ap.error(f"--pairs must be >= 2, got {args.pairs}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    cases = select_cases(args.cases, args.dtype)
    where = tempfile.mkdtemp(prefix="attn_fast_base.")
    try:
        base = load_base(args.base_wheel, where)
        if args.isa:
            af.set_isa(args.isa)
            base.set_isa(args.isa)
        print(
            f"# new {os.path.dirname(af.__file__)} (isa {af.get_isa()}) vs base "
            f"{os.path.basename(args.base_wheel)} (isa {base.get_isa()}); {cpu_model()}; "
            f"threads {args.threads}; {args.pairs} ABBA pairs per case"
        )
        print("# ratio = new / base per pair: median [quartiles]; < 1 means new is faster")
        hdr = f"{'case':34} | {'wall new/base':>22} | {'cpu new/base':>22} | {'new ms':>9} | "
        print(hdr + f"{'base ms':>9} | max|new-base|")
        for case in cases:
            if args.kv_cache:
                if case.kind != "decode":
                    continue
                r = run_kv_case(case, af, base, args.pairs, args.threads, args.kv_cache)
            else:
                r = run_case(case, af, base, args.pairs, args.threads)
            w, c = r["wall"], r["cpu"]
            print(
                f"{case.name:34} | {w[1]:6.3f} [{w[0]:.3f}-{w[2]:.3f}] | "
                f"{c[1]:6.3f} [{c[0]:.3f}-{c[2]:.3f}] | {r['new_ms']:9.2f} | "
                f"{r['base_ms']:9.2f} | {r['diff']:.1e}",
                flush=True,
            )
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
