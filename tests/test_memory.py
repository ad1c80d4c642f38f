"""Memory: no leaks over many calls, and O(L) peak memory for one long call.

Both run in a fresh subprocess that reports resident-set figures, so the test
process's own allocations do not blur them. Set ATTN_FAST_SLOW_TESTS=1 to
add the full (unwindowed) L = 65536 call, about a minute on two cores.
"""

from __future__ import annotations

import os

import pytest
from helpers import run_json

LEAK_CODE = """
    import contextlib, ctypes, gc, io, json, os
    import numpy as np
    import attn_fast as af

    PAGE = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
        ).split()]

    try:
        _mallinfo2 = ctypes.CDLL(None).mallinfo2
        _mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        _mallinfo2 = None

    def heap():
        # Bytes malloc has handed out and not got back (C, C++ and NumPy data).
        if _mallinfo2 is None:
            return 0
        mi = _mallinfo2()
        return mi.uordblks + mi.hblkhd

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 16, 8)).astype(np.float32) for _ in range(3))
    out = np.empty_like(q)
    mask = rng.random((16, 16)) < 0.7
    bias = rng.standard_normal((1, 2, 16, 16)).astype(np.float32)
    X, W = rng.standard_normal((16, 12)), rng.standard_normal((8, 12))
    sink = io.StringIO()
    # The other entry points (decode kernel, KV cache, layers, variants).
    q1 = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    kl, vl = (rng.standard_normal((1, 2, 96, 8)).astype(np.float32) for _ in range(2))
    cache = af.KVCache(1, 2, 8, capacity=64)
    k1, v1 = kl[:, :, :2], vl[:, :, :2]

    def kv_step():
        if len(cache) >= 60:
            cache.truncate(4)
        cache.append(k1, v1)
        cache.attend(q1)

    o1, lse1 = af.scaled_dot_product_attention(q1, kl, vl, enable_gqa=True, return_lse=True)
    qp = rng.standard_normal((16, 2, 8)).astype(np.float32)
    cu = np.array([0, 5, 16], np.int32)
    E = rng.standard_normal((4, 16)).astype(np.float32)
    rope = af.positional.RoPE(8)
    mha = af.MultiHeadAttention(16, 4, 2, rng=0)
    xm = rng.standard_normal((1, 6, 16)).astype(np.float32)
    lm = af.TinyTransformerLM(50, 16, 1, 2, 1)
    tokens = np.array([[1, 2, 3, 4]])

    def error(f):
        try:
            f()
        except (TypeError, ValueError, RuntimeError):
            pass

    def show():
        with contextlib.redirect_stdout(sink):
            af.show_config()
        sink.seek(0)
        sink.truncate()

    calls = {
        "sdpa": lambda: af.scaled_dot_product_attention(q, k, v),
        "sdpa_causal_lse_out": lambda: af.scaled_dot_product_attention(
            q, k, v, is_causal=True, return_lse=True, out=out),
        "sdpa_reference": lambda: af.scaled_dot_product_attention(
            q, k, v, backend="reference", return_lse=True),
        "sdpa_options": lambda: af.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, window_size=(5, 2), softcap=3.0, alibi_slopes=[0.1, 0.2],
            sinks=[0.5, -1.0]),
        "sdpa_bias": lambda: af.scaled_dot_product_attention(q, k, v, attn_mask=bias),
        "sdpa_float64_strided": lambda: af.scaled_dot_product_attention(
            X[None, ::2], X[None, 1::2], X[None, ::2]),
        "attention": lambda: af.attention(X, W, W, W, causal=True),
        "error_python": lambda: error(lambda: af.scaled_dot_product_attention(q, k[..., :3], v)),
        "error_core": lambda: error(lambda: af._core.forward(q, k, v, out[..., :3], scale=1.0)),
        "threads": lambda: (af.set_num_threads(af.get_num_threads()),),
        "isa": lambda: af.set_isa(af.get_isa()),
        "show_config": show,
        "decode_gqa": lambda: af.scaled_dot_product_attention(q1, kl, vl, enable_gqa=True),
        "kv_cache": kv_step,
        "merge_states": lambda: af.merge_attention_states(o1, lse1, o1, lse1),
        "varlen": lambda: af.varlen_attention(qp, qp, qp, cu, cu, causal=True),
        "attention_weights": lambda: af.attention_weights(q, k, is_causal=True),
        "linear_attention": lambda: af.variants.linear_attention(q, k, v, causal=True),
        "linear_step": lambda: af.variants.linear_attention_step(
            q[:, :, 0], k[:, :, 0], v[:, :, 0]),
        "linformer": lambda: af.variants.linformer_attention(q, k, v, E),
        "rope": lambda: rope(q),
        "mha": lambda: mha(xm),
        "tiny_lm": lambda: lm.forward(tokens),
    }
    af.set_num_threads(1)  # leaks do not depend on it; waking threads on a busy machine does
    for name, f in calls.items():  # warm up every path (allocator pools, caches) first
        for _ in range(1000):
            f()
    report = {}
    for name, f in calls.items():
        gc.collect()
        before = rss(), heap()
        for _ in range(N_CALLS):
            f()
        gc.collect()
        report[name] = ((rss() - before[0]) / 1024, (heap() - before[1]) / 1024)
    print(json.dumps(report))
"""

PEAK_CODE = """
    import json, resource
    import numpy as np
    import attn_fast as af

    L, d = {L}, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, L, d), dtype=np.float32) for _ in range(3))
    out = np.ones((1, 1, L, d), np.float32)
    lse = af.scaled_dot_product_attention(q[..., :8, :], k, v, return_lse=True)[1]  # warm up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    o, lse = af.scaled_dot_product_attention(
        q, k, v, out=out, return_lse=True, window_size={window}
    )
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(dict(before_kib=before, after_kib=after, extra_kib=after - before,
                          inputs_kib=(q.nbytes * 4) // 1024, textbook_scores_kib=L * L * 4 // 1024,
                          finite=bool(np.isfinite(o).all()), threads=af.get_num_threads())))
"""


@pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""),
    reason="ASan's quarantine and shadow memory grow the RSS (the sanitizer checks leaks itself)",
)
def test_no_leak_over_10k_calls():
    report = run_json(LEAK_CODE.replace("N_CALLS", "10_000"), timeout=600)
    print("growth over 10k calls, (RSS, malloc in use) in KiB:", report)
    # RSS moves in steps of up to ~1 MiB as malloc grows and trims its heap,
    # whatever the calls do; a leak of 200 bytes per call would add 2 MiB.
    # The bytes malloc has handed out are exact: 64 KiB is 6 bytes per call.
    grown = {name: kib for name, (kib, _) in report.items() if kib > 2048}
    assert not grown, f"RSS grew over 10k calls (KiB): {grown}"
    leaked = {name: kib for name, (_, kib) in report.items() if kib > 64}
    assert not leaked, f"malloc'd memory grew over 10k calls (KiB): {leaked}"


@pytest.mark.parametrize(
    "window",
    [
        pytest.param("(255, 0)", id="window"),
        pytest.param(
            "None",
            id="full",
            marks=pytest.mark.skipif(
                os.environ.get("ATTN_FAST_SLOW_TESTS") != "1",
                reason="set ATTN_FAST_SLOW_TESTS=1 (about a minute)",
            ),
        ),
    ],
)
def test_peak_memory_is_linear_in_L(window):
    # One call at L = 65536, H = 1, d = 64: the textbook score matrix alone is
    # L^2 * 4 B = 16 GiB; the fused kernel's extra memory is per-thread tiles
    # plus the (L,) lse. The window variant runs the same kernel with the same
    # scratch, in a fraction of the time.
    r = run_json(PEAK_CODE.format(L=65536, window=window), timeout=900)
    print(f"L=65536 window={window}:", r)
    assert r["finite"]
    # Per thread: tiles of a few hundred KiB plus the packed K/V block cache,
    # capped at 24 MiB (kCacheBytes in flash_fwd.cpp) whatever L is; 16 GiB
    # for the textbook's scores.
    assert r["extra_kib"] < r["threads"] * 25 * 1024 + 8 * 1024, r
