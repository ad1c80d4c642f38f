"""The Cython loops (attn_fast._cyloops) vs the NumPy formulas they replace.

    python bench/benchmarks/bench_cython.py          # one line per function, then the
                                                     # tiny LM decode step
    python bench/benchmarks/bench_cython.py --quick  # smaller shapes, fewer repeats

Each line first checks that both paths agree (to float32 rounding), then
times each one: best of ``--repeat`` wall-clock runs after a warm-up (the
minimum is the least disturbed by other jobs on shared cores). "numpy" is the
same public call with ``attn_fast._loops.USE_CYTHON = False`` (what
``ATTN_FAST_NUMPY_LOOPS=1`` does at import). The last lines time one decode
step of TinyTransformerLM (RoPE on q and k, KV-cache append, attention, MLP)
with each path. Result lines carry the ISA, thread count and CPU model.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import attn_fast as af
from attn_fast import _loops
from attn_fast._config import config
from attn_fast.kv_cache import KVCache
from attn_fast.masks import BlockSparse, block_summary
from attn_fast.positional import RoPE


def best_of(fn, repeat):
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def both(fn, repeat, check=None):
    """(numpy time, cython time); check(numpy result, cython result) first."""
    _loops.USE_CYTHON = False
    r_np = fn()
    t_np = best_of(fn, repeat)
    _loops.USE_CYTHON = True
    r_cy = fn()
    t_cy = best_of(fn, repeat)
    if check is not None:
        check(r_np, r_cy)
    return t_np, t_cy


def close(tol):
    def check(a, b):
        a = a if isinstance(a, tuple) else (a,)
        b = b if isinstance(b, tuple) else (b,)
        for x, y in zip(a, b):
            err = (
                float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                if x.size
                else 0.0
            )
            assert err <= tol, f"Cython and NumPy paths differ by {err}"

    return check


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="OpenMP threads (0 = leave as is)")
    args = ap.parse_args(argv)
    if args.threads:
        af.set_num_threads(args.threads)
    rep = args.repeat or (3 if args.quick else 7)
    L = 1024 if args.quick else 4096
    rng = np.random.default_rng(0)
    c = config()
    print(f"attn_fast {af.__version__} | isa {c['isa']} | threads {c['num_threads']} | {c['cpu']}")
    print(f"{'function':58s} {'numpy [ms]':>11s} {'cython [ms]':>12s} {'speed-up':>9s}")
    rows = []

    def row(name, t_np, t_cy):
        rows.append(name)
        print(f"{name:58s} {t_np * 1e3:11.3f} {t_cy * 1e3:12.3f} {t_np / t_cy:8.1f}x", flush=True)

    # -- RoPE
    x = rng.standard_normal((1, L, 32, 128), dtype=np.float32)
    rope = RoPE(128)
    row(
        f"RoPE rotate-half (1, {L}, 32, 128) f32 -> new array",
        *both(lambda: rope(x, offset=7), rep, close(1e-5)),
    )
    ropei = RoPE(128, interleaved=True, rotary_dim=64)
    xt = x.transpose(0, 2, 1, 3)  # (B, H, L, d) view
    row(
        f"RoPE interleaved r=64 (1, 32, {L}, 128) view f32 -> new",
        *both(lambda: ropei(xt, offset=7, seq_axis=-2), rep, close(1e-5)),
    )
    pos = rng.integers(0, 100_000, size=(1, L))
    buf = x.copy()
    row(
        f"RoPE in place, positions= (1, {L}) gather, f32",
        *both(lambda: rope(buf, positions=pos, inplace=True), rep),
    )
    q = rng.standard_normal((1, L, 32, 128))
    k = rng.standard_normal((1, L, 8, 128))
    row(
        f"RoPE rotate_qk q (1, {L}, 32, 128) k (1, {L}, 8, 128) f64",
        *both(lambda: rope.rotate_qk(q, k, offset=3), rep, close(1e-12)),
    )
    q1 = rng.standard_normal((4, 1, 32, 128), dtype=np.float32)
    k1 = rng.standard_normal((4, 1, 8, 128), dtype=np.float32)
    offs = np.array([100, 205, 3000, 17])
    row(
        "RoPE decode rotate_qk q (4, 1, 32, 128) k (4, 1, 8, 128) ragged",
        *both(lambda: rope.rotate_qk(q1, k1, offset=offs), 50 * rep, close(1e-5)),
    )

    # -- KV cache writes
    B, H, d = 4, 8, 128
    chunk = rng.standard_normal((B, H, 64, d), dtype=np.float32)
    lens = np.array([64, 40, 63, 1])

    def appends(rope_=None, n=16):
        cache = KVCache(B, H, d, window=512, ring=600, growable=False)
        for _ in range(n):  # wraps the ring
            cache.append(chunk, chunk, lengths=lens, rope=rope_)
        return cache.keys(0), cache.keys(2)

    row(
        f"KVCache.append x16, ring 600, ({B}, {H}, 64, {d}) ragged f32",
        *both(appends, rep, close(0)),
    )
    row(
        "KVCache.append x16 + RoPE on the keys, same",
        *both(lambda: appends(rope), rep, close(1e-5)),
    )
    one = rng.standard_normal((B, H, 1, d), dtype=np.float32)
    cache1 = KVCache(B, H, d, capacity=1 << 16, growable=False)
    row(
        f"KVCache.append decode token ({B}, {H}, 1, {d}) + RoPE",
        *both(lambda: cache1.append(one, one, rope=rope), 50 * rep),
    )

    # -- masks
    m = rng.random((1, 1, L, L)) < 0.5
    m[..., :, : L // 3] = False
    row(
        f"block_summary 16x16 of a dense (1, 1, {L}, {L}) bool mask",
        *both(lambda: block_summary(m), rep, close(0)),
    )
    n = 8 * L
    row(
        f"BlockSparse.local({n}, 4, width=8) -> ({n // 4}, {n // 4}) layout",
        *both(lambda: BlockSparse.local(n, 4, 8).layout, rep, close(0)),
    )
    row(
        f"BlockSparse.strided({n}, 4, stride=45) causal",
        *both(lambda: BlockSparse.strided(n, 4, 45).layout, rep, close(0)),
    )

    # -- tiny LM decode step, NumPy loops vs Cython loops. The two paths
    # alternate step by step on two caches (same prompt, same tokens), so both
    # see the same load on shared cores; the tokens must agree.
    lm = af.TinyTransformerLM(4096, 256, 4, 8, 2, seed=0)
    prompt = rng.integers(0, 4096, size=(1, 512))
    steps = 16 if args.quick else 96
    state = {}
    for use in (False, True):
        _loops.USE_CYTHON = use
        cache = lm.make_cache(1, 512 + steps + 1)
        logits = lm.forward(prompt, cache=cache)[:, -1]
        state[use] = [cache, np.argmax(logits, axis=-1)[:, None], []]
    for _ in range(steps):
        for use in (False, True):
            _loops.USE_CYTHON = use
            cache, tok, ts = state[use]
            t0 = time.perf_counter()
            logits = lm.forward(tok, cache=cache)[:, -1]
            ts.append(time.perf_counter() - t0)
            state[use][1] = np.argmax(logits, axis=-1)[:, None]
        assert np.array_equal(state[False][1], state[True][1]), (
            "the two paths generate different tokens"
        )
    for use in (False, True):
        ts = np.array(state[use][2])
        name = "cython" if use else "numpy (before)"
        print(
            "TinyTransformerLM decode step (4 layers, D 256, 8/2 heads, RoPE, after 512 tokens), "
            f"{name:15s}: "
            f"median {np.median(ts) * 1e3:.3f} ms, best {ts.min() * 1e3:.3f} ms over {steps} steps"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
