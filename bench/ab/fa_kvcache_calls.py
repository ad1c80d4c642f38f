"""Per-call cost of flash_attn_with_kvcache against attn_fast's own calls for the same work.

    python bench/ab/fa_kvcache_calls.py [--rounds 9] [--stub]

One decode step, B 1, Hq 9 / Hkv 3, d 64, caches of 512 and 4096 keys, fp32 and bf16,
1 thread, the calling thread's CPU time (``time.thread_time``: on a shared machine the
wall clock measures the scheduler). Contenders, each checked against the first:

    fa_kvcache      flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=<int32
                    tensor>, causal=True): append one token in place, then attend
    fa_kvcache_int  the same with cache_seqlens a Python int
    fa_noappend     flash_attn_with_kvcache on the full cache, nothing appended
    KVCache         attn_fast.KVCache: truncate, append the token, attend (the same work
                    in attn_fast's own cache)
    sdpa_views      attn_fast.scaled_dot_product_attention on the cache's (B, H, L, d)
                    views (no append)

Each round runs every contender's burst of 200 calls in a rotated order; the table shows
the median per-call µs over the rounds. ``--stub`` replaces the decode kernel by a no-op:
what is left is each path's Python side. For an A/B of two builds, run the script under
each (alternating processes) and compare the same rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import attn_fast as af
from attn_fast import _core
from attn_fast.flash_attn import flash_attn_with_kvcache

# bench_flash_attn.py (its decode inputs) is a sibling folder's script.
BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")
sys.path.insert(0, BENCHMARKS)
from bench_flash_attn import decode_inputs  # noqa: E402


def contenders(dtype, L, B=1, H=9, Hkv=3, d=64):
    kc, vc, q, k1, v1 = decode_inputs(0, dtype, B, L, H, Hkv, d)
    n = L - 1
    seq = torch.full((B,), n, dtype=torch.int32)
    kind = "float32" if dtype == torch.float32 else "bfloat16"
    cache = af.KVCache(B, Hkv, d, capacity=L, dtype=kind)
    cache.append(kc[:, :n].transpose(1, 2), vc[:, :n].transpose(1, 2))
    qh, k1h, v1h = q.transpose(1, 2), k1.transpose(1, 2), v1.transpose(1, 2)
    kview, vview = kc.transpose(1, 2), vc.transpose(1, 2)

    def own():
        cache.truncate(n)
        cache.append(k1h, v1h)
        return cache.attend(qh)

    calls = {
        "fa_kvcache": lambda: flash_attn_with_kvcache(
            q, kc, vc, k1, v1, cache_seqlens=seq, causal=True
        ),
        "fa_kvcache_int": lambda: flash_attn_with_kvcache(
            q, kc, vc, k1, v1, cache_seqlens=n, causal=True
        ),
        "fa_noappend": lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=L, causal=True),
        "KVCache": own,
        "sdpa_views": lambda: af.scaled_dot_product_attention(
            qh, kview, vview, is_causal=True, enable_gqa=True
        ),
    }
    # Check: the appending contenders against each other (same keys), then the others.
    ref = calls["fa_kvcache"]().float()
    for name in ("fa_kvcache_int", "fa_noappend"):
        err = (calls[name]().float() - ref).abs().max().item()
        assert err < 2e-2, f"{name} differs from fa_kvcache by {err}"
    for name in ("KVCache", "sdpa_views"):
        got = torch.as_tensor(calls[name]()).float().transpose(1, 2)
        err = (got - ref).abs().max().item()
        assert err < 2e-2, f"{name} differs from fa_kvcache by {err}"
    return calls


def time_calls(calls, rounds, m=200):
    per = {name: [] for name in calls}
    names = list(calls)
    for f in calls.values():
        for _ in range(20):
            f()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            f = calls[name]
            t0 = time.thread_time()
            for _ in range(m):
                f()
            per[name].append((time.thread_time() - t0) / m)
    return {name: statistics.median(v) for name, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--stub", action="store_true", help="the decode kernel as a no-op")
    args = ap.parse_args()
    af.set_num_threads(1)
    torch.set_num_threads(1)
    print(f"# ISA {af.get_isa()}, 1 thread, thread CPU time, µs per call")
    for dtype in (torch.float32, torch.bfloat16):
        for L in (512, 4096):
            calls = contenders(dtype, L)
            decode = _core.decode
            if args.stub:
                _core.decode = lambda *a: None
            try:
                t = time_calls(calls, args.rounds)
            finally:
                _core.decode = decode
            row = "  ".join(f"{k} {v * 1e6:6.1f}" for k, v in t.items())
            print(f"{str(dtype)[6:]:8s} L={L:5d}  {row}", flush=True)


if __name__ == "__main__":
    main()
