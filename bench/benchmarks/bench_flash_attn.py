"""attn_fast.flash_attn against attn_fast's own entry points and torch SDPA, same run.

    python bench/benchmarks/bench_flash_attn.py [--threads 2] [--reps 15] [--only paged]

Rows: prefill (flash_attn_func, causal, GQA) and decode (flash_attn_with_kvcache,
one query token per sequence against a (B, L_cache, H_kv, d) cache, with and
without appending the new k, v); ``--only paged``: decode with ALiBi on a paged
cache (one tiled-kernel call per run of consecutive blocks, merged by lse)
against the same keys in a contiguous cache and the plain paged decode kernel.
Each contender first checks its result against the others, then all are timed
interleaved (``reps`` rounds, each in a fresh random order) and the median is
reported with the ratio to the first contender of its row. Each line carries
the ISA, thread count and CPU model.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import attn_fast as af
from attn_fast.flash_attn import flash_attn_func, flash_attn_with_kvcache


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def interleaved(fns: dict, reps: int) -> dict:
    for fn in fns.values():  # warm-up
        fn()
    times = {name: [] for name in fns}
    rng = np.random.default_rng(0)
    names = list(fns)
    for _ in range(reps):  # a fresh order each round: no contender always follows torch's
        for name in rng.permutation(names):  # spinning OpenMP threads, or another's cache
            fn = fns[name]
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def check(results: dict, base: str, tol: float) -> None:
    ref = results[base].float()
    for name, r in results.items():
        err = (r.float() - ref).abs().max().item()
        assert err <= tol, f"{name} differs from {base} by {err}"


def prefill(dtype, B, L, H, Hkv, d, reps):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, L, H, d, generator=g).to(dtype)
    k = torch.randn(B, L, Hkv, d, generator=g).to(dtype)
    v = torch.randn(B, L, Hkv, d, generator=g).to(dtype)
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # (B, H, L, d) copies
    buf = torch.empty(B, L, H, d, dtype=dtype)
    fns = {
        "flash_attn_func": lambda: flash_attn_func(q, k, v, causal=True),
        "af.sdpa (B,L,H,d) views, out=": lambda: af.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=True,
            out=buf.transpose(1, 2),
        ),
        "af.sdpa (B,H,L,d) contiguous": lambda: af.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, enable_gqa=True
        ),
        "torch SDPA (B,H,L,d)": lambda: F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, enable_gqa=True
        ),
    }
    res = {n: f() for n, f in fns.items()}
    res["af.sdpa (B,L,H,d) views, out="] = buf.clone()
    res = {n: (r.transpose(1, 2) if "(B,H,L,d)" in n else r) for n, r in res.items()}
    check(res, "flash_attn_func", 2e-2 if dtype != torch.float32 else 1e-4)
    return interleaved(fns, reps)


def decode_inputs(seed, dtype, B, Lc, H, Hkv, d):
    """One decode step's tensors in flash-attn's layout: the caches k_cache, v_cache
    (B, Lc, H_kv, d), the query (B, 1, H, d) and the new key and value (B, 1, H_kv, d)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, Lc, Hkv, d), (B, Lc, Hkv, d), (B, 1, H, d), (B, 1, Hkv, d), (B, 1, Hkv, d))
    return tuple(torch.randn(*s, generator=g).to(dtype) for s in shapes)


def decode(dtype, B, Lc, n, H, Hkv, d, reps, append):
    kc, vc, q, k1, v1 = decode_inputs(1, dtype, B, Lc, H, Hkv, d)
    seqlens = torch.full((B,), n - 1 if append else n, dtype=torch.int32)
    kw = dict(cache_seqlens=seqlens, causal=True)
    if append:
        kw.update(k=k1, v=v1)
    # attn_fast's own KV cache, filled with the same n keys in its own (B, H_kv, cap, d) layout
    cache = af.KVCache(
        B, Hkv, d, capacity=Lc, dtype="float32" if dtype == torch.float32 else "bfloat16"
    )
    kn, vn = kc[:, :n].clone(), vc[:, :n].clone()
    if append:
        kn[:, n - 1], vn[:, n - 1] = k1[:, 0], v1[:, 0]
    cache.append(kn[:, : n - 1].transpose(1, 2), vn[:, : n - 1].transpose(1, 2))
    qh = q.transpose(1, 2)

    def own_cache():
        if append:
            cache.truncate(n - 1)
            cache.append(kn[:, n - 1 :].transpose(1, 2), vn[:, n - 1 :].transpose(1, 2))
        return cache.attend(qh)

    if not append:
        cache.append(kn[:, n - 1 :].transpose(1, 2), vn[:, n - 1 :].transpose(1, 2))
    kview, vview = kc[:, :n].transpose(1, 2), vc[:, :n].transpose(1, 2)
    fns = {
        "flash_attn_with_kvcache": lambda: flash_attn_with_kvcache(q, kc, vc, **kw),
        "af.sdpa on the cache views": lambda: af.scaled_dot_product_attention(
            qh, kview, vview, is_causal=True, enable_gqa=True
        ),
        "af.KVCache.attend": own_cache,
        "torch SDPA on the cache views": lambda: F.scaled_dot_product_attention(
            qh, kview, vview, enable_gqa=True
        ),
    }
    if append:  # the others read the keys as stored after flash_attn's append
        flash_attn_with_kvcache(q, kc, vc, **kw)
    res = {n_: f() for n_, f in fns.items()}
    res = {
        n_: (
            r
            if n_ == "flash_attn_with_kvcache"
            else torch.as_tensor(np.asarray(r)).transpose(1, 2)
            if not isinstance(r, torch.Tensor)
            else r.transpose(1, 2)
        )
        for n_, r in res.items()
    }
    check(res, "flash_attn_with_kvcache", 2e-2 if dtype != torch.float32 else 1e-4)
    return interleaved(fns, reps)


def paged_alibi(dtype, B, n, page, H, Hkv, d, reps):
    g = torch.Generator().manual_seed(2)
    nb = B * (n // page)
    pool_k = torch.randn(nb, page, Hkv, d, generator=g).to(dtype)
    pool_v = torch.randn(nb, page, Hkv, d, generator=g).to(dtype)
    q = torch.randn(B, 1, H, d, generator=g).to(dtype)
    slopes = torch.rand(H, generator=g) * 0.1
    seqlens = torch.full((B,), n, dtype=torch.int32)
    consecutive = torch.arange(nb, dtype=torch.int32).reshape(B, -1)
    fragmented = torch.randperm(nb, generator=g).to(torch.int32).reshape(B, -1)
    kc = pool_k[consecutive.long()].reshape(B, n, Hkv, d)  # the same keys, contiguous
    vc = pool_v[consecutive.long()].reshape(B, n, Hkv, d)
    kw = dict(cache_seqlens=seqlens, causal=True)
    fns = {
        "contiguous cache, ALiBi": lambda: flash_attn_with_kvcache(
            q, kc, vc, alibi_slopes=slopes, **kw
        ),
        "paged consecutive, ALiBi": lambda: flash_attn_with_kvcache(
            q, pool_k, pool_v, block_table=consecutive, alibi_slopes=slopes, **kw
        ),
        "paged fragmented, ALiBi": lambda: flash_attn_with_kvcache(
            q, pool_k, pool_v, block_table=fragmented, alibi_slopes=slopes, **kw
        ),
        "paged fragmented, no ALiBi": lambda: flash_attn_with_kvcache(
            q, pool_k, pool_v, block_table=fragmented, **kw
        ),
    }
    tol = 2e-2 if dtype != torch.float32 else 1e-5
    res = {name: fns[name]() for name in list(fns)[:2]}
    check(res, "contiguous cache, ALiBi", tol)
    kf = pool_k[fragmented.long()].reshape(B, n, Hkv, d)  # the fragmented table's keys
    vf = pool_v[fragmented.long()].reshape(B, n, Hkv, d)
    res = {
        "contiguous": flash_attn_with_kvcache(q, kf, vf, alibi_slopes=slopes, **kw),
        "paged": fns["paged fragmented, ALiBi"](),
    }
    check(res, "contiguous", tol)
    return interleaved(fns, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", choices=["all", "paged"], default="all")
    args = ap.parse_args()
    af.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    head = f"# {cpu_model()}, ISA {af.get_isa()}, {args.threads} threads, medians of {args.reps}"
    print(head)
    rows = []
    if args.only == "paged":
        for dtype in (torch.float32, torch.bfloat16):
            for page in (16, 256):
                rows.append(
                    (
                        f"paged decode {str(dtype)[6:]} B=4 n=2048 page={page} H=32 H_kv=8 d=128",
                        paged_alibi(dtype, 4, 2048, page, 32, 8, 128, args.reps),
                    )
                )
        report(rows)
        return
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        rows.append(
            (
                f"prefill {name} B=1 L=1024 H=16 H_kv=4 d=128 causal",
                prefill(dtype, 1, 1024, 16, 4, 128, args.reps),
            )
        )
        for append in (False, True):
            what = "append+attend" if append else "attend"
            rows.append(
                (
                    f"decode {what} {name} B=4 n=2048 of 4096 H=32 H_kv=8 d=128",
                    decode(dtype, 4, 4096, 2048, 32, 8, 128, args.reps, append),
                )
            )
    # tiny calls: the per-call overhead of each entry point (the kernels' work is negligible)
    rows.append(
        (
            "tiny prefill float32 B=1 L=16 H=2 d=64 causal",
            prefill(torch.float32, 1, 16, 2, 2, 64, 10 * args.reps),
        )
    )
    rows.append(
        (
            "tiny decode float32 B=1 n=64 of 128 H=2 d=64",
            decode(torch.float32, 1, 128, 64, 2, 2, 64, 10 * args.reps, False),
        )
    )
    report(rows)


def report(rows) -> None:
    for title, t in rows:
        base = next(iter(t.values()))
        print(f"\n{title}")
        for name, s in t.items():
            print(f"  {name:32s} {s * 1e3:9.3f} ms   x{s / base:5.2f} of the first")
    with open("/proc/loadavg") as f:
        print(f"\nload average (1, 5, 15 min) at the end: {f.read().split()[:3]}")


if __name__ == "__main__":
    main()
