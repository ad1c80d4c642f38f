"""Paged vs contiguous KV cache decode: the same tokens, the same run, paired rounds.

    python bench/benchmarks/bench_paged.py [--threads N] [--rounds 21]
        [--dtype float32|bfloat16|float16|int8] [--shapes 1x32768 8x4096] [--ragged 64]
        [--no-shuffle] [--block-size 256] [--clock wall|cpu]

Shapes: H_q = 32, H_kv = 8 (GQA), d = dv = 128; "BxL" is B sequences of L cached tokens.
For each shape a ``KVCache(B, 8, 128)`` and a ``PagedKVCache(8, 128)`` (256-token blocks, the
default, or ``--block-size``) hold the same L tokens per sequence; one decode step (q: (B, 32,
1, 128)) is timed on each.
The paged pool's free list is shuffled first (``--no-shuffle`` keeps it in order), so a
sequence's blocks lie in random order in the pool, as after many sequences came and went.
Before timing, the paged result is checked bit for bit against the contiguous one and both
against the float64 oracle on two heads.

Timing: ``--rounds`` paired rounds; each round times contiguous and paged back to back (best
of n calls each, n chosen for ~0.5 GB of reads; the order alternates); the table gives the
medians over rounds and the median of the per-round ratios paged / contiguous (the machine
may be shared: pairs within a round see the same load). GB/s = K and V bytes read per step /
step time, % of a streaming read of 512 MiB measured in the same run on the same threads.

``--ragged N``: N sequences with lengths spaced geometrically from 16 to 16384 (one decode
step for all of them in one ``attend`` call), paged only (a contiguous cache would need
N x 16384 slots); its GB/s on the bytes actually read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import attn_fast as af
from attn_fast import _core, reference
from attn_fast._bench.common import settle
from attn_fast._checks import BF16, F16, bf16_bits, from_float, to_float
from attn_fast._config import config

HQ, HKV, D = 32, 8, 128
DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": BF16,
    "float16": F16,
    "int8": np.dtype(np.int8),
}


def bytes_per_token(dt):
    """K and V bytes read per token and kv head (int8: codes, value scales and offsets, and
    the key groups' 2 x d floats per 64 tokens)."""
    return 2 * D + 8 + 8 * D // 64 if dt == np.int8 else 2 * D * dt.itemsize


CLOCK = time.perf_counter


def best_time(fn, repeats):
    """Fastest of `repeats` calls after one warm-up, on CLOCK (wall, or this process's CPU
    time with --clock cpu: time spent descheduled on a shared machine is not counted)."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        ts.append(CLOCK() - t0)
    return min(ts)


def paired(fa, fb, rounds, repeats):
    """Per-round best-of-`repeats` times of fa and fb, timed back to back; the order
    alternates between rounds so that neither always runs first."""
    settle()  # the oracle check's OpenBLAS threads spin for ~0.1 s after it
    ta, tb = [], []
    for r in range(rounds):
        if r % 2:
            tb.append(best_time(fb, repeats))
            ta.append(best_time(fa, repeats))
        else:
            ta.append(best_time(fa, repeats))
            tb.append(best_time(fb, repeats))
    return ta, tb


def f64(x):
    x = np.asarray(x)
    return to_float(x.view(np.ndarray)) if x.dtype == np.uint16 else x.astype(np.float64)


def check(o, q, K, V, tol):
    """The first two query heads (kv head 0) of sequence 0 against the float64 oracle."""
    O = reference.sdpa(f64(q[0, :2]), f64(K[:1]), f64(V[:1]))
    err = float(np.abs(f64(o[0, :2]) - O).max())
    if not err < tol:
        raise RuntimeError(f"result differs from the float64 oracle by {err:.2e}")


def tokens(rng, shape, dt):
    """Random tokens as the cache takes them (bfloat16 as ml_dtypes.bfloat16 / tagged bits)."""
    x = rng.standard_normal(shape, dtype=np.float32)
    if dt in (np.float32, np.int8):  # an int8 cache takes float32 and quantises it
        return x
    return bf16_bits(from_float(x, dt)) if dt == BF16 else x.astype(dt)


def paged_cache(dtype_name, shuffle, rng, num_tokens, block_size):
    cache = af.PagedKVCache(
        HKV,
        D,
        block_size=block_size,
        dtype=dtype_name,
        num_blocks=-(-num_tokens // block_size),
    )
    if shuffle:
        rng.shuffle(cache._free)  # blocks handed out in random pool order
    return cache


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--shapes", nargs="+", default=["1x32768", "8x4096"])
    p.add_argument("--ragged", type=int, default=64, help="sequences of the ragged batch (0: none)")
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument(
        "--block-size", type=int, default=256, help="token rows per block (PagedKVCache's default)"
    )
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or process CPU time (use with --threads 1 on a shared machine)",
    )
    args = p.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        af.set_num_threads(args.threads)
    nt = af.get_num_threads()
    dt = DTYPES[args.dtype]
    cfg = config()
    tag = (
        f"ISA {cfg['isa']}  prefetch {cfg['decode_prefetch']}  threads {nt}  CPU {cfg['cpu']}  "
        f"{args.dtype}  {args.clock} clock"
    )
    print(f"attn_fast {cfg['version']}  {tag}")
    bwn = _core.stream_read_gbps(nt, 512 << 20, 5)
    print(f"stream read (512 MiB, best of 5): {bwn:.1f} GB/s on {nt} threads")
    print(
        f"decode: H_q={HQ} H_kv={HKV} d=dv={D}, one query token per sequence, "
        f"block {args.block_size};"
    )
    print(f"medians of {args.rounds} paired rounds (contiguous then paged, best of n each)")
    hdr = (
        f"{'B':>2} {'L':>6} | {'contig ms':>9} {'GB/s':>6} {'%str':>5} | "
        f"{'paged ms':>9} {'GB/s':>6} {'%str':>5} | {'paged/contig':>12} {'min..max':>11}"
    )
    print(hdr)
    print("-" * len(hdr))
    rng = np.random.default_rng(0)
    tol = 1e-3 if dt in (np.float32, np.int8) else 2e-2  # int8: on the dequantised K/V
    for shape in args.shapes:
        B, L = (int(x) for x in shape.split("x"))
        kv = tokens(rng, (B, HKV, L, D), dt)
        q = tokens(rng, (B, HQ, 1, D), dt)
        contig = af.KVCache(B, HKV, D, capacity=L, dtype=args.dtype)
        paged = paged_cache(args.dtype, not args.no_shuffle, rng, B * L, args.block_size)
        ids = [paged.add_sequence() for _ in range(B)]
        kin, vin = kv, kv[:, :, ::-1]
        contig.append(kin, vin)
        bs = args.block_size
        for t in range(0, L, bs):  # interleaved across sequences, one block at a time
            paged.append(ids, kin[:, :, t : t + bs], vin[:, :, t : t + bs])
        del kv, kin, vin
        qin = q
        oc, op = contig.attend(qin), paged.attend(ids, qin)
        if not np.array_equal(np.asarray(oc).view(np.uint8), np.asarray(op).view(np.uint8)):
            raise RuntimeError("paged and contiguous results differ")
        check(op, q, paged.keys(ids[0]), paged.values(ids[0]), tol)
        nbytes = B * HKV * L * bytes_per_token(dt)
        reps = max(3, min(30, int(5e8 / nbytes)))
        tc, tp = paired(
            lambda c=contig, qq=qin: c.attend(qq),
            lambda c=paged, i=ids, qq=qin: c.attend(i, qq),
            args.rounds,
            reps,
        )
        ratios = [b / a for a, b in zip(tc, tp)]
        mc, mp, mr = statistics.median(tc), statistics.median(tp), statistics.median(ratios)
        gc, gp = nbytes / mc / 1e9, nbytes / mp / 1e9
        print(
            f"{B:>2} {L:>6} | {mc * 1e3:9.3f} {gc:6.1f} {100 * gc / bwn:4.0f}% | "
            f"{mp * 1e3:9.3f} {gp:6.1f} {100 * gp / bwn:4.0f}% | {mr:11.3f}x "
            f"{min(ratios):5.3f}..{max(ratios):5.3f}",
            flush=True,
        )
        contig = paged = None  # free both before the next shape's
    if args.ragged:
        N = args.ragged
        lens = np.geomspace(16, 16384, N).astype(np.int64)
        paged = paged_cache(
            args.dtype,
            not args.no_shuffle,
            rng,
            int(lens.sum()) + args.block_size * N,
            args.block_size,
        )
        ids = [paged.add_sequence() for _ in range(N)]
        for i, n in zip(ids, lens):
            x = tokens(rng, (1, HKV, int(n), D), dt)
            paged.append(i, x, x[:, :, ::-1])
        q = tokens(rng, (N, HQ, 1, D), dt)
        qin = q
        o = paged.attend(ids, qin)
        check(o[-1:], q[-1:], paged.keys(ids[-1]), paged.values(ids[-1]), tol)
        nbytes = int(lens.sum()) * HKV * bytes_per_token(dt)
        reps = max(3, min(30, int(5e8 / nbytes)))
        settle()
        ts = [best_time(lambda: paged.attend(ids, qin), reps) for _ in range(args.rounds)]
        mt = statistics.median(ts)
        g = nbytes / mt / 1e9
        print(
            f"ragged batch: {N} sequences, lengths {lens.min()}..{lens.max()} "
            f"({int(lens.sum())} tokens), one call: {mt * 1e3:.3f} ms, {g:.1f} GB/s, "
            f"{100 * g / bwn:.0f}% of the streaming read"
        )
    print("GB/s = K and V bytes read per step / step time; %str = of the streaming read. " + tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
