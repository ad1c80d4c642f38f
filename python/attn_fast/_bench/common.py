"""What both bench commands use: the textbook NumPy peer, optional peer imports, timers."""

from __future__ import annotations

import statistics
import time

import numpy as np

INSTALL_HINT = "pip install 'attn_fast[bench]'"


def import_peer(name):
    """The module `name`, or None when it cannot be imported (the peer is then skipped)."""
    try:
        return __import__(name)
    except Exception:  # noqa: BLE001 - any import failure means "no peer"
        return None


def numpy_textbook(q, k, v, causal):
    """The chapter's code, batched over (B, H): softmax(QKᵀ/√d) V, float32; causal aligned
    bottom-right (top-left when Lq == Lk, the prefill table's only case)."""
    S = q @ np.swapaxes(k, -1, -2) / np.float32(np.sqrt(q.shape[-1]))
    if causal:
        Lq, Lk = S.shape[-2:]
        S = np.where(np.tril(np.ones((Lq, Lk), dtype=bool), Lk - Lq), S, np.float32(-1e9))
    S = S - S.max(axis=-1, keepdims=True)
    e = np.exp(S)
    return (e / e.sum(axis=-1, keepdims=True)) @ v


def time_runs(fn, repeats, warmup=1):
    """Wall times (s) of `repeats` calls of fn() after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def median_time(fn, repeats, warmup=1):
    ts = time_runs(fn, repeats, warmup)
    return statistics.median(ts), min(ts), max(ts)


def settle(seconds=0.15):
    """Wait for other libraries' worker threads to stop spinning.

    After a NumPy matmul (the oracle, the textbook peer) OpenBLAS's threads
    spin for up to 2^28 cycles (~0.1 s) waiting for more work; onnxruntime's
    and libgomp's for less. A kernel timed during that window shares the cores
    with them."""
    time.sleep(seconds)
