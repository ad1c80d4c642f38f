"""Decode (one token against a KV cache) and prefill latency: attn_fast vs torch SDPA.

    python bench/benchmarks/bench_decode.py [--threads N] [--lengths 1024 4096 16384 32768]
        [--batches 1 8] [--png bench/tables/decode.png] [--dtype bf16|fp16|int8]

Shapes: H_q = 32, H_kv = 8 (GQA), d = dv = 128, float32. For each batch B and
cache length L, a KVCache is filled with L tokens and one decode step
``cache.attend(q)`` (q: (B, 32, 1, 128)) is timed; torch's
``scaled_dot_product_attention(q, K, V, enable_gqa=True)`` runs on the same
cached K/V arrays (zero-copy ``torch.from_numpy`` views). Every result is
checked against the float64 oracle (on a slice of heads) before it is timed.

Decode with a long cache is memory-bound: the table gives the achieved
bandwidth, K and V bytes read (B * H_kv * L * (d + dv) * 4) per step time,
next to a streaming read of a 512 MiB buffer measured in the same run on 1 and
on all threads (``_core.stream_read_gbps``). Times are the best of several
runs after warm-up, like the probe's. The PNG plots, against L, the time to
first token (one-shot causal prefill of an L-token prompt, B = 1) and the
time per generated token (one decode step with L cached tokens; for B = 8 the
step time divided by 8).

``--dtype bf16`` (or fp16): a second KVCache of that dtype holds the same
tokens (rounded); each row then times, in the same run, the float32 step, the
16-bit step (GB/s on the bytes it actually reads, 2 per element, and % of the
streaming read), their ratio (float32 time / 16-bit time: tokens/s gained),
and torch's SDPA in the same 16-bit dtype on the 16-bit cache's arrays. The
16-bit results are checked against the oracle on the same rounded inputs.

``--dtype int8``: float32, bfloat16 and int8 caches of the same tokens, each
step timed in the same run (paired: the three are timed in turn, ``--rounds``
times, and the medians of the per-round best-of times are printed). GB/s for
int8 counts the bytes it actually reads: codes, key scales and offsets (2 x d
floats per 64 keys) and value scales and offsets (2 floats per key),
B * H_kv * L * (d + dv + 8 + 8 d / 64). The int8 result is checked against the
oracle on the cache's dequantised K/V. Every round also runs the streaming-read
probe (``%str`` is the median of the per-round ratios to it) and torch's fp32
SDPA on the fp32 cache's arrays (``t/32``: torch time / attn_fast fp32 time).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import attn_fast as af
from attn_fast import _core, reference
from attn_fast._bench.common import settle, time_runs
from attn_fast._checks import BF16, bf16_bits, from_float, to_float
from attn_fast._config import config

# The committed plot and tables live in bench/tables/ (bench/README.md).
TABLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tables")

HQ, HKV, D = 32, 8, 128


def best_time(fn, repeats, warmup=2):
    """Fastest of `repeats` runs after warm-up (the streaming probe is best-of too)."""
    settle()  # the oracle check's OpenBLAS threads spin for ~0.1 s after it
    return min(time_runs(fn, repeats, warmup))


def f64(x):
    """NumPy / torch, float32 / float16 / bfloat16 (bits or ml_dtypes) -> float64 NumPy."""
    if hasattr(x, "detach"):
        return x.detach().double().numpy()
    x = np.asarray(x)
    return to_float(x.view(np.ndarray)) if x.dtype == np.uint16 else x.astype(np.float64)


def check(o, q, k, v, causal=True, tol=1e-3):
    """Compare the first two query heads (and their kv head) with the float64 oracle."""
    Lq, Lk = q.shape[2], k.shape[2]
    mask = reference.causal_mask(Lq, Lk) if causal else None
    O = reference.sdpa(f64(q[:1, :2]), f64(k[:1, :1]), f64(v[:1, :1]), mask=mask)
    err = float(np.abs(f64(o[:1, :2]) - O).max())
    if not err < tol:
        raise RuntimeError(f"result differs from the float64 oracle by {err:.2e}")


def repeats_for(nbytes):
    return max(5, min(50, int(2e9 / max(nbytes, 1))))


def rounded(x, dtype):
    """float32 x rounded to a cache dtype's values ("bfloat16": as uint16 bits)."""
    if dtype == "bfloat16":
        return bf16_bits(from_float(x, BF16))
    return x if dtype in ("float32", "int8") else from_float(x, np.dtype(dtype))


def filled_caches(rng, B, L, dtypes):
    """q (B, HQ, 1, D) float32 and a KVCache per dtype holding the same L random tokens
    (values: the keys reversed along the token axis), rounded to each cache's dtype."""
    kv = rng.standard_normal((B, HKV, L, D), dtype=np.float32)
    q = rng.standard_normal((B, HQ, 1, D), dtype=np.float32)
    caches = []
    for dt in dtypes:
        c = af.KVCache(B, HKV, D, capacity=L + 1, dtype=dt)
        x = rounded(kv, dt)
        c.append(x, x[:, :, ::-1])
        caches.append(c)
    return q, caches


def torch_step(torch, q, K, V, tol=1e-3):
    """torch's SDPA on the same arrays (16-bit ones as torch tensors of that dtype; uint16 bits
    as bfloat16), checked against the oracle: a function of no argument to time."""

    def tensor(x):
        x = np.ascontiguousarray(np.asarray(x).view(np.ndarray))
        if x.dtype == np.uint16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)

    F = torch.nn.functional.scaled_dot_product_attention
    tq, tk, tv = tensor(q), tensor(K), tensor(V)

    def step():
        with torch.no_grad():
            return F(tq, tk, tv, enable_gqa=True)

    check(step(), q, K, V, causal=False, tol=tol)
    return step


def setup(args):
    """Threads for attn_fast and torch (torch None when absent or --no-torch), the header line
    printed; returns (threads, torch module or None, the ISA / threads / CPU tag)."""
    if args.threads:
        af.set_num_threads(args.threads)
    nt = af.get_num_threads()
    torch = None
    if not args.no_torch:
        try:
            import torch

            torch.set_num_threads(nt)
        except ImportError:
            print("torch not installed: its column is skipped", file=sys.stderr)
    cfg = config()
    tag = f"ISA {cfg['isa']}  prefetch {cfg['decode_prefetch']}  threads {nt}  CPU {cfg['cpu']}"
    print(f"attn_fast {cfg['version']}  {tag}" + (f"  torch {torch.__version__}" if torch else ""))
    return nt, torch, tag


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument(
        "--prefill-max", type=int, default=4096, help="longest prefill timed for the plot"
    )
    p.add_argument("--png", default=os.path.join(TABLES, "decode.png"))
    p.add_argument("--no-torch", action="store_true")
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16", "int8"),
        default="fp32",
        help="also time a 16-bit (or int8) cache beside the float32 one (see above)",
    )
    p.add_argument("--rounds", type=int, default=3, help="paired rounds for --dtype int8")
    args = p.parse_args(argv)
    if args.dtype == "int8":
        return main_int8(args)
    if args.dtype != "fp32":
        return main_16bit(args)
    nt, torch, tag = setup(args)
    bw1 = _core.stream_read_gbps(1, 512 << 20, 5)
    bwn = _core.stream_read_gbps(nt, 512 << 20, 5)
    print(
        f"stream read (512 MiB, best of 5): {bw1:.1f} GB/s on 1 thread, {bwn:.1f} GB/s on {nt} "
        "threads"
    )
    print(f"decode: H_q={HQ} H_kv={HKV} d=dv={D} float32, one query token per sequence")
    hdr = (
        f"{'B':>2} {'L':>6} {'KV MB':>7} | {'attn_fast ms':>12} {'GB/s':>6} {'%stream':>7} | "
        f"{'torch ms':>9} {'GB/s':>6} {'x':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    rng = np.random.default_rng(0)
    decode_ms = {}
    for B in args.batches:
        for L in args.lengths:
            cache = af.KVCache(B, HKV, D, capacity=L + 1)
            kv = rng.standard_normal((B, HKV, L, D), dtype=np.float32)
            cache.append(kv, kv[:, :, ::-1])
            del kv
            q = rng.standard_normal((B, HQ, 1, D), dtype=np.float32)
            K, V = cache._k[:, :, :L], cache._v[:, :, :L]  # the cached arrays, no copy
            check(cache.attend(q), q, K, V)
            nbytes = K.nbytes + V.nbytes
            reps = repeats_for(nbytes)
            t = best_time(lambda cache=cache, q=q: cache.attend(q), reps)
            decode_ms[(B, L)] = t * 1e3
            gbs = nbytes / t / 1e9
            line = (
                f"{B:>2} {L:>6} {nbytes / 1e6:7.0f} | {t * 1e3:12.3f} {gbs:6.1f} "
                f"{100 * gbs / bwn:6.0f}% | "
            )
            if torch is not None:
                tt = best_time(torch_step(torch, q, K, V), max(3, reps // 3))
                line += f"{tt * 1e3:9.3f} {nbytes / tt / 1e9:6.1f} {tt / t:5.1f}x"
            else:
                line += f"{'-':>9} {'-':>6} {'-':>6}"
            print(line, flush=True)
            del cache, K, V
    print(
        "GB/s = K and V bytes read per step / step time; %stream = of the all-thread streaming "
        "read;"
    )
    print("x = torch time / attn_fast time (higher means attn_fast is faster). " + tag)

    # Prefill (one-shot causal, per token) vs decode (one step) at B = 1.
    pre_L = [
        L
        for L in sorted(set([256, 512, 1024, 2048, 4096, 8192] + args.lengths))
        if L <= args.prefill_max
    ]
    pre_ms = {}
    for L in pre_L:
        qkv = rng.standard_normal((3, 1, HQ, L, D), dtype=np.float32)
        q, k, v = qkv[0], qkv[1][:, :HKV], qkv[2][:, :HKV]
        t = best_time(
            lambda q=q, k=k, v=v: af.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            ),
            3,
            1,
        )
        pre_ms[L] = t * 1e3
    print(
        "prefill (B=1, causal, one shot, whole prompt): "
        + ", ".join(f"L={L}: {v:.1f} ms" for L, v in pre_ms.items())
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(
        list(pre_ms),
        list(pre_ms.values()),
        "s--",
        label="prefill: whole prompt (time to first token), B=1",
    )
    for B in args.batches:
        xs = [L for L in args.lengths if (B, L) in decode_ms]
        ax.plot(
            xs,
            [decode_ms[(B, L)] / B for L in xs],
            "o-",
            label=f"decode: per generated token, B={B}",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt / cache length L (tokens)")
    ax.set_ylabel("ms")
    ax.set_title(f"attn_fast, H_q={HQ} H_kv={HKV} d={D} fp32, {nt} threads", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"plot: {args.png}")
    return 0


def main_16bit(args):
    """--dtype bf16 / fp16: float32 and 16-bit decode steps on the same tokens, same run."""
    half = {"bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    nt, torch, tag = setup(args)
    bwn = _core.stream_read_gbps(nt, 512 << 20, 5)
    print(f"stream read (512 MiB, best of 5): {bwn:.1f} GB/s on {nt} threads")
    print(
        f"decode: H_q={HQ} H_kv={HKV} d=dv={D}, one query token per sequence; {args.dtype} vs "
        "float32"
    )
    hdr = (
        f"{'B':>2} {'L':>6} | {'fp32 ms':>8} {'GB/s':>6} | {args.dtype + ' ms':>8} {'GB/s':>6} "
        f"{'%stream':>7} "
        f"{'vs fp32':>7} | {'torch ' + args.dtype + ' ms':>13} {'x':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    rng = np.random.default_rng(0)
    tag16 = bf16_bits if half == "bfloat16" else (lambda x: x)
    for B in args.batches:
        for L in args.lengths:
            q, (c32, c16) = filled_caches(rng, B, L, ("float32", half))
            q16 = rounded(q, half)
            K, V = c32._k[:, :, :L], c32._v[:, :, :L]
            K16, V16 = tag16(c16._k[:, :, :L]), tag16(c16._v[:, :, :L])
            check(c32.attend(q), q, K, V)
            check(c16.attend(q16), q16, K16, V16, tol=1e-2)
            nb32, nb16 = K.nbytes + V.nbytes, K16.nbytes + V16.nbytes
            reps = repeats_for(nb32)
            t32 = best_time(lambda c32=c32, q=q: c32.attend(q), reps)
            t16 = best_time(lambda c16=c16, q16=q16: c16.attend(q16), reps)
            g16 = nb16 / t16 / 1e9
            line = (
                f"{B:>2} {L:>6} | {t32 * 1e3:8.3f} {nb32 / t32 / 1e9:6.1f} | {t16 * 1e3:8.3f} "
                f"{g16:6.1f} "
                f"{100 * g16 / bwn:6.0f}% {t32 / t16:6.2f}x | "
            )
            if torch is not None:
                tt = best_time(torch_step(torch, q16, K16, V16, tol=5e-2), max(3, reps // 3))
                line += f"{tt * 1e3:13.3f} {tt / t16:5.1f}x"
            else:
                line += f"{'-':>13} {'-':>6}"
            print(line, flush=True)
            del c32, c16, K, V, K16, V16
    print(
        "GB/s = K and V bytes actually read per step / step time (4 per element for fp32, 2 for "
        f"{args.dtype});"
    )
    print(
        f"%stream = of the all-thread streaming read; vs fp32 = fp32 time / {args.dtype} time "
        "(tokens/s gained);"
    )
    print(f"x = torch {args.dtype} time / attn_fast {args.dtype} time. " + tag)
    return 0


def main_int8(args):
    """--dtype int8: fp32, bf16 and int8 decode steps on the same tokens, paired rounds.

    Each round times, in turn: the streaming-read probe (512 MiB, best of 3), the fp32, bf16
    and int8 steps (best of n each) and torch's fp32 SDPA on the fp32 cache's arrays (unless
    --no-torch). The %str columns are medians of the per-round ratio to that round's probe (the
    VM's bandwidth drifts by 2x between runs), the ratios medians of per-round ratios.
    """
    nt, torch, tag = setup(args)
    print(f"decode: H_q={HQ} H_kv={HKV} d=dv={D}, one query token per sequence; medians of")
    print(
        f"{args.rounds} rounds (probe, fp32, bf16, int8, torch fp32 timed in turn, best of n "
        "within a round)"
    )
    hdr = (
        f"{'B':>2} {'L':>6} {'probe':>5} | {'fp32 ms':>8} {'GB/s':>5} {'%str':>4} | "
        f"{'bf16 ms':>7} {'GB/s':>5} {'%str':>4} {'vs32':>5} | {'int8 ms':>7} {'GB/s':>5} "
        f"{'%str':>4} {'vs32':>5} | {'torch ms':>8} {'t/32':>5}"
    )
    print(hdr)
    print("-" * len(hdr))
    rng = np.random.default_rng(0)
    med = np.median
    for B in args.batches:
        for L in args.lengths:
            q, (c32, c16, c8) = filled_caches(rng, B, L, ("float32", "bfloat16", "int8"))
            q16 = rounded(q, "bfloat16")
            K, V = c32._k[:, :, :L], c32._v[:, :, :L]
            check(c32.attend(q), q, K, V)
            check(c16.attend(q16), q16, bf16_bits(c16._k[:, :, :L]), bf16_bits(c16._v[:, :, :L]),
                  tol=1e-2)  # fmt: skip
            check(c8.attend(q), q, c8.keys(0)[None], c8.values(0)[None])
            nb32 = K.nbytes + V.nbytes
            nb16 = nb32 // 2
            nb8 = B * HKV * L * (2 * D + 8 + 8 * D // 64)
            reps = repeats_for(nb32)
            steps = {"32": (c32.attend, q), "16": (c16.attend, q16), "8": (c8.attend, q)}
            if torch is not None:
                step = torch_step(torch, q, K, V)
                steps["t"] = (lambda _, step=step: step(), None)
            ts = {key: [] for key in steps}
            bw = []
            for _ in range(args.rounds):
                bw.append(_core.stream_read_gbps(nt, 512 << 20, 3))
                for key, (f, qq) in steps.items():
                    ts[key].append(best_time(lambda f=f, qq=qq: f(qq), reps))
            t = {key: np.array(v) for key, v in ts.items()}
            bw = np.array(bw)
            del steps

            def cols(key, nb, t=t, bw=bw):
                g = nb / t[key] / 1e9  # per round
                return f"{med(t[key]) * 1e3:8.3f} {med(g):5.1f} {100 * med(g / bw):3.0f}%"

            line = (
                f"{B:>2} {L:>6} {med(bw):5.1f} | {cols('32', nb32)} | {cols('16', nb16)[1:]} "
                f"{med(t['32'] / t['16']):4.2f}x | {cols('8', nb8)[1:]} "
                f"{med(t['32'] / t['8']):4.2f}x | "
            )
            if "t" in t:
                line += f"{med(t['t']) * 1e3:8.3f} {med(t['t'] / t['32']):4.2f}x"
            else:
                line += f"{'-':>8} {'-':>5}"
            print(line, flush=True)
            del c32, c16, c8, K, V
    print(
        "probe = streaming read GB/s (all threads, median of the rounds); GB/s = bytes actually "
        "read per step / step time"
    )
    print(
        "(fp32 4, bf16 2 per element; int8 codes + scales); %str = median of per-round ratios "
        "to that round's probe;"
    )
    print("vs32 = fp32 time / that time; t/32 = torch fp32 SDPA time / attn_fast fp32 time. " + tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
