"""Per-call latency of one decode step (one query token against L cached keys, GQA).

    python bench/benchmarks/bench_latency.py  # both shapes, L = 16, 512, 4096, 2 threads
    python bench/benchmarks/bench_latency.py --threads 1 --rounds 21
    python bench/benchmarks/bench_latency.py --profile  # + cProfile of one call of each entry point
    python bench/benchmarks/bench_latency.py --grow 512  # one key more per call (a growing cache)

Entry points, each on the same tensors (B = 1, fp32):

    numpy      attn_fast.scaled_dot_product_attention(q, k, v, enable_gqa=True), NumPy arrays
    kvcache    KVCache.attend(q) on a cache holding the L keys (append done once, outside)
    torch_op   attn_fast.torch.scaled_dot_product_attention(..., enable_gqa=True), torch tensors
    hf         the transformers backend's attention function (attention_forward) under
               torch.no_grad(), mask None, is_causal=True (what a decode step of a model with
               DynamicCache calls)
    hf_sdpa    transformers' own sdpa attention function (sdpa_attention_forward) on the same
               call: what "hf" replaces in a model (the last column is hf / hf_sdpa)
    torch      torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)

``--grow N``: the calls of each entry point cycle through key counts L, L + 1, ..., L + N - 1
(prefix views of one (1, H_kv, L + N, d) buffer, made once), as a decode loop over a cache
that grows by a token per step does: plans keyed by exact shapes miss at every call there
(N above functional's 256 plans: no key count recurs before its plan is dropped; the mean
key count is then L + N / 2). ``kvcache`` keeps its L keys (its plan does not depend on
them), so its column is not comparable with the others there.

Each result is first checked against the float64 oracle. Timing:
``--rounds`` rounds; in each round every entry point runs a burst of calls (enough for about
2 ms), in a rotated order, so the entry points share whatever load the machine has; a
round's per-call time is the burst's mean, and the table shows the median over rounds and
each entry point's ratio to torch's median in the same run. The result lines carry the ISA,
thread count and CPU model. ``--clock cpu`` (with ``--threads 1``) times the calling
thread's CPU time instead of the wall clock: on a machine shared with other jobs the wall
clock mostly measures the scheduler (a 2-thread OpenMP or ATen team waits for a descheduled
worker), the CPU time of a one-thread call does not.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import statistics
import time

import numpy as np
import torch

import attn_fast as af
import attn_fast.torch as aft
from attn_fast._config import config
from attn_fast.integrations import transformers as af_hf

try:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
except ImportError:  # transformers is what af_hf imports: this module exists in every version
    sdpa_attention_forward = None  # it supports (>= 4.48)

SHAPES = ((9, 3, 64), (32, 8, 128))
LENGTHS = (16, 512, 4096)


class _Module:
    is_causal = True
    training = False

    def __init__(self, groups):
        self.num_key_value_groups = groups  # read by transformers' sdpa function


def entry_points(Hq, Hkv, d, L, seed=0, grow=0):
    """{name: zero-argument callable} for one shape, all on the same data (with grow > 0
    the key count of each entry point's calls cycles through L .. L + grow - 1)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, Hq, 1, d)).astype(np.float32)
    kb = rng.standard_normal((1, Hkv, L + grow, d)).astype(np.float32)
    vb = rng.standard_normal((1, Hkv, L + grow, d)).astype(np.float32)
    k, v = kb[:, :, :L], vb[:, :, :L]
    qt = torch.from_numpy(q)
    cache = af.KVCache(1, Hkv, d, capacity=L + 64)
    cache.append(k, v)
    mod = _Module(Hq // Hkv)
    scale = d**-0.5  # a Python float, as transformers passes module.scaling

    def hf(kt, vt):
        with torch.no_grad():
            return af_hf.attention_forward(mod, qt, kt, vt, None, scaling=scale, is_causal=True)[0]

    def hf_sdpa(kt, vt):
        with torch.no_grad():
            return sdpa_attention_forward(mod, qt, kt, vt, None, scaling=scale, is_causal=True)[0]

    on_keys = {  # name: (call on (k, v), whether it takes tensors)
        "numpy": (lambda k, v: af.scaled_dot_product_attention(q, k, v, enable_gqa=True), False),
        "torch_op": (
            lambda k, v: aft.scaled_dot_product_attention(qt, k, v, enable_gqa=True),
            True,
        ),
        "hf": (hf, True),
        "hf_sdpa": (hf_sdpa, True),
        "torch": (
            lambda k, v: torch.nn.functional.scaled_dot_product_attention(
                qt, k, v, enable_gqa=True
            ),
            True,
        ),
    }
    # The key / value arguments of successive calls: one pair, or prefixes growing by a key.
    np_kv = [(kb[:, :, :n], vb[:, :, :n]) for n in range(L, L + max(grow, 1))]
    t_kv = [tuple(torch.from_numpy(x) for x in pair) for pair in np_kv]

    def call(f, kv):
        if len(kv) == 1:
            return lambda: f(*kv[0])
        steps = itertools.cycle(kv)
        return lambda: f(*next(steps))

    calls = {"kvcache": lambda: cache.attend(q)}
    for name, (f, tensors) in on_keys.items():
        calls[name] = call(f, t_kv if tensors else np_kv)
    # Validate: every entry point against the float64 oracle, at L keys.
    g = Hq // Hkv
    kr, vr = np.repeat(k, g, axis=1).astype(np.float64), np.repeat(v, g, axis=1).astype(np.float64)
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), kr) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), vr)
    for name in calls:
        if name == "kvcache":
            got = cache.attend(q)
        else:
            f, tensors = on_keys[name]
            got = f(*(t_kv if tensors else np_kv)[0])
        got = np.asarray(got, dtype=np.float64)
        if name in ("hf", "hf_sdpa"):
            got = got.transpose(0, 2, 1, 3)  # (B, Lq, H, dv) -> (B, H, Lq, dv)
        err = float(np.max(np.abs(got - ref)))
        assert err < 1e-4, f"{name} differs from the oracle by {err} at {(Hq, Hkv, d, L)}"
    return {n: calls[n] for n in ("numpy", "kvcache", "torch_op", "hf", "hf_sdpa", "torch")}


def time_calls(calls, rounds, burst_s=0.002, clock=time.perf_counter):
    """{name: median seconds per call} over `rounds` interleaved rounds, timed by `clock`."""
    names = list(calls)
    reps = {}
    for n in names:  # size each burst to ~burst_s (after a warm-up)
        f = calls[n]
        for _ in range(3):
            f()
        t0 = time.perf_counter()
        f()
        reps[n] = max(1, min(200, int(burst_s / max(time.perf_counter() - t0, 1e-7))))
    per = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            f, m = calls[n], reps[n]
            t0 = clock()
            for _ in range(m):
                f()
            per[n].append((clock() - t0) / m)
    return {n: statistics.median(v) for n, v in per.items()}


def profile_one(calls, n=2000, top=14, timer=None):
    """cProfile text of `n` calls of each entry point (tottime per call, µs); timer: the
    profiler's clock (None: its default wall clock; time.thread_time for --clock cpu)."""
    out = io.StringIO()
    for name, f in calls.items():
        pr = cProfile.Profile(timer) if timer else cProfile.Profile()
        pr.enable()
        for _ in range(n):
            f()
        pr.disable()
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s)
        st.sort_stats("tottime")
        total = sum(v[2] for v in st.stats.values())
        out.write(f"--- {name}: {total / n * 1e6:.1f} µs/call under cProfile; top by tottime\n")
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
        for (fn, line, func), (_cc, nc, tt, ct, _) in rows:
            where = f"{fn.split('/')[-1]}:{line}({func})"
            out.write(
                f"  {tt / n * 1e6:7.2f} µs tot {ct / n * 1e6:7.2f} µs cum {nc / n:5.1f}x  {where}\n"
            )
    return out.getvalue()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--profile", action="store_true", help="cProfile one call of each (L = 512)")
    ap.add_argument(
        "--grow",
        type=int,
        default=0,
        help="N > 0: each entry point's calls cycle through L .. L + N - 1 keys (kvcache: L)",
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: perf_counter; cpu: the calling thread's CPU time (time.thread_time), "
        "which a loaded machine does not inflate; meaningful with --threads 1 only, where "
        "both libraries run the whole call on the calling thread",
    )
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1 (a team's work runs on other threads)")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    af.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    c = config()
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(
        f"attn_fast decode latency | isa {c['isa']} | threads {c['num_threads']} | cpu {c['cpu']}"
        f" | torch {torch.__version__} | fp32 B=1 Lq=1 | {args.clock} clock | load {load}"
        + (f" | keys L .. L + {args.grow - 1}, one more per call" if args.grow else "")
    )
    names = ("torch", "numpy", "kvcache", "torch_op", "hf", "hf_sdpa")
    print(
        f"{'(Hq, Hkv, d), L':<22}"
        + "".join(f"{n:>11}" for n in names)
        + "".join(f"{n + '/t':>12}" for n in names[1:-1])
        + f"{'hf/hf_sdpa':>12}"
    )
    for Hq, Hkv, d in SHAPES:
        for L in args.lengths:
            calls = entry_points(Hq, Hkv, d, L, grow=args.grow)
            med = time_calls(calls, args.rounds, clock=clock)
            t = med["torch"]
            print(
                f"{str((Hq, Hkv, d)) + ', ' + str(L):<22}"
                + "".join(f"{med[n] * 1e6:9.1f}µs" for n in names)
                + "".join(f"{med[n] / t:11.2f}x" for n in names[1:-1])
                + f"{med['hf'] / med['hf_sdpa']:11.2f}x",
                flush=True,
            )
    if args.profile:
        for Hq, Hkv, d in SHAPES:
            print(f"\ncProfile, (Hq, Hkv, d) = {(Hq, Hkv, d)}, L = 512")
            timer = time.thread_time if args.clock == "cpu" else None
            print(profile_one(entry_points(Hq, Hkv, d, 512, grow=args.grow), timer=timer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
