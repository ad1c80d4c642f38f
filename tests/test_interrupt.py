"""Ctrl-C: a SIGINT stops every long kernel call with KeyboardInterrupt.

A child process starts a call that runs for many seconds (broadcast inputs
keep the memory small), prints "started", and the parent sends SIGINT half
a second later. The call must raise KeyboardInterrupt soon after (the
kernels poll a cancellation token, attn_fast/interrupt.h), with its threads
joined; the child then checks that nothing half-done is visible (a KV cache
is unchanged) and that the next call works. The bound on the time to stop is
generous on purpose: this is a correctness test (the failure modes are "ran
to the end" and "hung"), not a timing assertion.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

CHILD = r"""
import signal, sys, time, numpy as np, attn_fast as af
# Python keeps SIGINT ignored when it starts with it ignored (a background job
# of a shell without job control, `nohup`): ask for KeyboardInterrupt.
signal.signal(signal.SIGINT, signal.default_int_handler)
case = sys.argv[1]
sdpa = af.scaled_dot_product_attention
one = np.float32(0.5)
rng = np.random.default_rng(0)
check = None
if case in ("prefill", "reference"):
    # 131072 queries x keys, 2 heads: ~9 TFLOP for the fused kernel
    x1 = rng.standard_normal((1, 1, 1 << 17, 64)).astype(np.float32)
    x = np.broadcast_to(x1, (1, 2, 1 << 17, 64))
    call = lambda: sdpa(x, x, x, backend="fused" if case == "prefill" else "reference")
elif case == "backward":
    L = 1 << 17
    x = np.broadcast_to(rng.standard_normal((1, 1, L, 64)).astype(np.float32), (1, 2, L, 64))
    o, lse = np.zeros((1, 2, L, 64), np.float32), np.zeros((1, 2, L), np.float32)
    call = lambda: af.scaled_dot_product_attention_backward(x, x, x, x, o, lse)
elif case == "varlen":
    x = np.broadcast_to(rng.standard_normal((1 << 17, 1, 64)).astype(np.float32), (1 << 17, 2, 64))
    cu = np.array([0, 1 << 16, 1 << 17])
    call = lambda: af.varlen_attention(x, x, x, cu, cu, causal=False)
elif case == "decode":
    q = np.ones((1, 1, 1, 64), np.float32)
    k = np.broadcast_to(one, (1, 1, 1 << 34, 64))  # 2^34 keys
    call = lambda: sdpa(q, k, k, backend="decode")
elif case == "linear":
    # one (batch, head): a sweep the threads cannot share; 2^20 tokens, d = 4096
    x = np.broadcast_to(one, (1, 1, 1 << 20, 4096))
    v = np.broadcast_to(one, (1, 1, 1 << 20, 16))
    o = np.empty((1, 1, 1 << 20, 16), np.float32)
    call = lambda: af._core.linear_attention(x, x, v, o, causal=True)
elif case == "kv_cache":
    L = 1 << 15
    cache = af.KVCache(batch=1, num_kv_heads=4, head_dim=64, capacity=L, dtype=np.float32)
    kv = rng.standard_normal((1, 4, L, 64)).astype(np.float32)
    cache.append(kv, kv)
    state = (len(cache), cache.lengths.copy(), cache.positions.copy())
    q = np.broadcast_to(kv[:, :1], (1, 16, L, 64))
    call = lambda: cache.attend(q, causal=False)
    def check():
        now = (len(cache), list(cache.lengths), list(cache.positions))
        assert now == (state[0], list(state[1]), list(state[2]))
        o = cache.attend(kv[:, :, -1:], causal=False)  # the cache still works
        assert np.isfinite(o).all()
print("started", flush=True)
t0 = time.perf_counter()
try:
    call()
    print("finished", flush=True)
except KeyboardInterrupt:
    if check is not None:
        check()
    x1 = np.ones((1, 1, 3, 4), np.float32)
    assert np.allclose(sdpa(x1, x1, x1), 1.0)  # the next call works
    print("interrupted", flush=True)
"""


def _interrupt(case):
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, case],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline().strip()
        assert line == "started", (line, p.stderr.read())
        time.sleep(0.5)
        t = time.monotonic()
        os.kill(p.pid, signal.SIGINT)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            pytest.fail(f"{case}: still running 30 s after SIGINT (hung, or the signal is ignored)")
        waited = time.monotonic() - t
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, f"{case}: exit status {p.returncode}\n{err}"
    assert out.split() == ["interrupted"], f"{case}: {out!r} {err}"
    # Generous: the point is that it stopped, not how fast (0.05-0.2 s here).
    # Every call runs for tens of seconds uninterrupted; one that ignored the
    # signal would raise KeyboardInterrupt only after it returned.
    assert waited < 5, f"{case}: took {waited:.1f} s to stop after SIGINT"


@pytest.mark.parametrize(
    "case", ["prefill", "varlen", "reference", "decode", "linear", "kv_cache", "backward"]
)
def test_sigint_stops_a_long_call(case):
    _interrupt(case)
