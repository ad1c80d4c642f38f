"""Hardening of the Python layer (issue 16): the sliding-window ring read
non-causally, RoPE memory at large positions, argument checks (requires-grad
tensors, complex slopes/sinks, huge windows, seq_axis, overlapping in-place
RoPE), and Ctrl-C in the long Cython loops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
from helpers import assert_close, randn

import attn_fast as af
from attn_fast import masks, positional
from attn_fast import reference as ref
from attn_fast.kv_cache import KVCache
from attn_fast.positional import RoPE, rope_reference

# ---------------------------------------------------------------- item 2: ring windows


def window_oracle(q, K, V, pos, ql, window, causal):
    """Full-history float64 answer: query row i of a sequence at position
    pos - ql + i sees keys j with j >= p_i - (window - 1), and j <= p_i if causal."""
    Lq = q.shape[2]
    p = pos - ql + np.arange(Lq)[:, None]
    j = np.arange(K.shape[2])[None, :]
    vis = j >= p - (window - 1)
    if causal:
        vis &= j <= p
    vis &= np.arange(Lq)[:, None] < ql
    return ref.sdpa(q, K, V, mask=vis)


def test_noncausal_read_of_a_wrapped_ring_raises_like_the_causal_one(rng):
    # The case: window 2, ring 3, three appends of 2; row 0 of 3 needs
    # position 2, which the ring dropped. It used to come back off by 0.13.
    cache = KVCache(1, 1, 4, window=2, ring=3, dtype=np.float64)
    for _ in range(3):
        k = randn(rng, (1, 1, 2, 4), np.float64)
        cache.append(k, k)
    q = randn(rng, (1, 1, 3, 4), np.float64)
    for causal in (True, False):
        with pytest.raises(ValueError, match="reach back to positions"):
            cache.attend(q, causal=causal)
    assert cache.lengths.tolist() == [3] and cache.positions.tolist() == [6]  # unchanged


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ring_reads_match_the_full_history_or_raise(rng, dtype):
    # Random appends into window caches with small rings; every attend,
    # causal or not, either matches the full-history oracle or raises.
    checked = raised = 0
    for trial in range(40):
        window = int(rng.integers(1, 5))
        ring = window + int(rng.integers(0, 4))
        B, H, d = int(rng.integers(1, 3)), 1, int(rng.choice([1, 5, 8]))
        cache = KVCache(B, H, d, window=window, ring=ring, dtype=dtype, growable=False)
        K = np.zeros((B, H, 0, d))
        for _ in range(int(rng.integers(1, 6))):
            L = int(rng.integers(1, ring - window + 2))
            k = randn(rng, (B, H, L, d), np.float64)
            cache.append(k.astype(dtype), k.astype(dtype))
            K = np.concatenate([K, k], axis=2)
        Lq = int(rng.integers(1, ring + 3))
        q = randn(rng, (B, H, Lq, d), np.float64)
        causal = bool(trial % 2)
        pos = int(cache.positions[0])
        try:
            got = cache.attend(q.astype(dtype), causal=causal, q_lens=Lq)
        except ValueError as e:
            assert "reach back" in str(e) or "exceed the stored lengths" in str(e)
            raised += 1
            # it raises only when a row really needs a dropped key
            assert max(0, pos - Lq - (window - 1)) < pos - int(cache.lengths[0]) or (
                causal and Lq > cache.lengths[0]
            )
            continue
        want = window_oracle(q, K, K, pos, Lq, window, causal)
        assert_close(got, want, dtype)
        checked += 1
    assert checked >= 5 and raised >= 5


# ---------------------------------------------------------------- item 3: RoPE memory


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_beyond_the_table_equals_the_table(rng, interleaved, monkeypatch):
    # The rows computed for the asked positions only are the table's rows,
    # bit for bit (the same float64 formula), for offsets, positions and the cache.
    x = randn(rng, (2, 37, 3, 16), np.float32)
    pos = rng.integers(0, 300, size=(2, 37))
    want = {}
    for kind in ("table", "direct"):
        rope = RoPE(16, rotary_dim=12, interleaved=interleaved)
        if kind == "direct":
            monkeypatch.setattr(positional, "TABLE_MAX", 8)
        cache = KVCache(2, 3, 16, dtype=np.float32)
        cache.append(x.transpose(0, 2, 1, 3), x.transpose(0, 2, 1, 3), rope=rope, lengths=[37, 20])
        want[kind] = (
            rope(x, offset=100),
            rope(x, positions=pos),
            rope(x.astype(np.float64), offset=[5, 250]),
            cache.keys(0),
            cache.keys(1),
            rope.cos_sin(50, np.float32)[0],
        )
        if kind == "direct":
            assert rope._n <= 8
    for a, b in zip(want["table"], want["direct"]):
        np.testing.assert_array_equal(a, b)


def test_rope_at_a_huge_position_builds_no_table(rng):
    rope = RoPE(128, base=500000.0)
    x = randn(rng, (1, 2, 4, 128), np.float32)
    p0 = 2**30
    tracemalloc.start()
    try:
        got = rope(x, offset=p0)
        got_pos = rope(x, positions=np.array([[7, p0 + 5]]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # a table up to 2^30 would be 2^30 x 64 x 8 B x 2 = 1 TiB; this call needs kilobytes
    assert peak < 4 << 20, peak
    assert rope._n <= positional.TABLE_MAX
    want = rope_reference(x.transpose(0, 2, 1, 3), np.arange(p0, p0 + 2), base=500000.0).transpose(
        0, 2, 1, 3
    )
    np.testing.assert_allclose(
        got, want, rtol=1e-4, atol=1e-4
    )  # float32 cos/sin of angles ~1e9 rad
    want2 = rope_reference(x.transpose(0, 2, 1, 3), np.array([7, p0 + 5]), base=500000.0).transpose(
        0, 2, 1, 3
    )
    np.testing.assert_allclose(got_pos, want2, rtol=1e-4, atol=1e-4)
    # float64 input: the angle p * theta is formed in float64, so exact to rounding
    got64 = rope(x.astype(np.float64), offset=p0)
    np.testing.assert_allclose(got64, want, rtol=1e-9, atol=1e-9)
    # the NumPy formula (the reference path) takes the same rows
    from attn_fast import _loops

    old = _loops.USE_CYTHON
    try:
        _loops.USE_CYTHON = False
        np.testing.assert_array_equal(rope(x, offset=p0), got)
    finally:
        _loops.USE_CYTHON = old
    # the largest accepted position, and the first refused one
    rope(x[:, :1], offset=positional.MAX_POSITION - 1)
    with pytest.raises(ValueError, match="offset"):
        rope(x[:, :1], offset=positional.MAX_POSITION)


def test_kv_cache_with_rope_at_a_large_position_stays_small(rng):
    # A sliding-window cache rotating keys on the way in, far into a generation:
    # nothing O(position) is built; the stored keys are the rotated ones.
    rope = RoPE(8)
    cache = KVCache(2, 1, 8, window=4, dtype=np.float64)
    start = 10**6
    cache.append(np.zeros((2, 1, 1, 8)), np.zeros((2, 1, 1, 8)))
    cache._pos[:] = (
        start  # jump ahead as if 10^6 tokens had been generated (the ring holds the last few)
    )
    tracemalloc.start()
    try:
        ks = []
        for _ in range(6):
            k = randn(rng, (2, 1, 1, 8), np.float64)
            ks.append(k)
            cache.append(k, k, rope=rope)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert rope._n <= positional.TABLE_MAX
    K = np.concatenate(ks, axis=2)  # positions start .. start + 5
    want = rope_reference(K, np.arange(start, start + 6))
    for b in range(2):
        stored = cache.keys(b)  # the last cache.lengths[b] (>= 6) keys, oldest first
        np.testing.assert_allclose(stored[:, -6:], want[b], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- item 4: argument checks


def test_requires_grad_tensors_are_read_detached(rng):
    torch = pytest.importorskip("torch")
    q = torch.from_numpy(randn(rng, (1, 2, 5, 8), np.float64))
    mask = torch.from_numpy(randn(rng, (5, 5), np.float64)).requires_grad_()
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.1, -1.0], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    plain = dict(
        attn_mask=mask.detach().numpy(),
        alibi_slopes=slopes.detach(),
        sinks=sinks.detach(),
        scale=0.3,
    )
    grad = dict(attn_mask=mask, alibi_slopes=slopes, sinks=sinks, scale=scale)
    want = np.asarray(af.scaled_dot_product_attention(q, q, q, **plain))
    got = np.asarray(af.scaled_dot_product_attention(q, q, q, **grad))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        np.asarray(af.attention_weights(q, q, **grad)),
        np.asarray(af.attention_weights(q, q, **plain)),
    )
    bmask = torch.ones(5, 5, dtype=torch.float64, requires_grad=True)
    np.testing.assert_array_equal(
        np.asarray(af.scaled_dot_product_attention(q, q, q, masks.Dense(bmask))),
        np.asarray(af.scaled_dot_product_attention(q, q, q, bmask.detach())),
    )
    cache = KVCache(1, 2, 8, dtype=np.float64)
    cache.append(q.numpy(), q.numpy())
    np.testing.assert_array_equal(
        cache.attend(q.numpy(), scale=scale), cache.attend(q.numpy(), scale=0.3)
    )
    rope = RoPE(8)
    x = torch.from_numpy(randn(rng, (5, 2, 8), np.float64)).requires_grad_()
    np.testing.assert_array_equal(np.asarray(rope(x)), rope(x.detach().numpy()))
    qr, kr = rope.rotate_qk(x, x * 2)
    np.testing.assert_array_equal(np.asarray(qr), rope(x.detach().numpy()))
    np.testing.assert_array_equal(np.asarray(kr), rope(2 * x.detach().numpy()))


def test_huge_sliding_window_is_no_window(rng):
    q = randn(rng, (1, 2, 7, 5), np.float32)
    for left, right, want_kw in [
        (2**63, 0, dict(is_causal=True)),
        (2**63, 2**70, {}),
        (None, 2**64, {}),
    ]:
        got = af.scaled_dot_product_attention(q, q, q, attn_mask=masks.SlidingWindow(left, right))
        np.testing.assert_array_equal(got, af.scaled_dot_product_attention(q, q, q, **want_kw))


def test_complex_slopes_and_sinks_raise(rng):
    q = randn(rng, (1, 2, 4, 8), np.float64)
    for name in ("alibi_slopes", "sinks"):
        for val in (np.array([1.0, 2.0 + 1j]), np.ones(2, np.complex64), [1j, 0]):
            with pytest.raises(TypeError, match=name):
                af.scaled_dot_product_attention(q, q, q, **{name: val})
            with pytest.raises(TypeError, match=name):
                af.attention_weights(q, q, **{name: val})
        qv = q[0].transpose(1, 0, 2).copy()  # (total, H, d)
        with pytest.raises(TypeError, match=name):
            af.varlen_attention(qv, qv, qv, [0, 4], [0, 4], **{name: np.ones(2) * 1j})


def test_rope_seq_axis_must_be_an_int(rng):
    rope = RoPE(8)
    x = randn(rng, (5, 2, 8), np.float64)
    for bad in (1.5, "1", None, True):
        with pytest.raises(TypeError, match="seq_axis"):
            rope(x, seq_axis=bad)
        with pytest.raises(TypeError, match="seq_axis"):
            rope.rotate_qk(x, x.copy(), seq_axis=bad)
    np.testing.assert_array_equal(rope(x, seq_axis=np.int64(0)), rope(x, seq_axis=0))


def test_rotate_qk_inplace_refuses_overlapping_q_and_k(rng):
    rope = RoPE(8)
    x = randn(rng, (5, 2, 8), np.float64)
    before = x.copy()
    with pytest.raises(ValueError, match="share memory"):
        rope.rotate_qk(x, x, inplace=True)
    with pytest.raises(ValueError, match="share memory"):
        rope.rotate_qk(x[:, :1], x[:, :1].view(), inplace=True)
    np.testing.assert_array_equal(x, before)  # nothing rotated
    # disjoint slices of one packed qkv array are fine, each rotated once
    qkv = randn(rng, (5, 3, 2, 8), np.float64)
    q, k = qkv[:, 0], qkv[:, 1]
    want_q, want_k = rope(q), rope(k)
    v_before = qkv[:, 2].copy()
    rq, rk = rope.rotate_qk(q, k, inplace=True)
    assert rq is q and rk is k
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(qkv[:, 2], v_before)
    # not in place, the same array for both is fine
    a, b = rope.rotate_qk(x, x)
    np.testing.assert_array_equal(a, rope(x))
    np.testing.assert_array_equal(b, rope(x))


# --------------------------------------------------------------- item 5: Ctrl-C in the Cython loops

# In a child: a watcher thread sends SIGINT to the process as soon as the loop
# has written its first element (the loops release the GIL while they run).
# KeyboardInterrupt must come out of the call before the loop finished (its
# last element still unwritten). Without the chunked checks it never does:
# the loop runs to its end and the interrupt comes after. With them, a signal
# sent while the loop runs stops it; a watcher scheduled too late on a busy
# machine only costs another attempt (the signal then lands in join()).
SIGINT_CODE = """
    import os, signal, sys, threading, time
    import numpy as np
    import attn_fast as af
    from attn_fast import _cyloops, masks, positional
    # Python keeps SIGINT ignored when it starts with it ignored (a background
    # job of a shell without job control, `nohup`): ask for KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    af.set_num_threads({threads})
    kind = "{kind}"
    captured = []

    class NpShim:  # _cyloops allocates its results with np.zeros: keep a handle on them
        def __getattr__(self, name):
            return getattr(np, name)

        def zeros(self, *a, **kw):
            captured.append(np.zeros(*a, **kw))
            return captured[-1]

    if kind == "rope":
        x = np.ones((1, 4096, 32, 128), np.float32)
        out = np.full_like(x, np.nan)
        reset = lambda: out.fill(np.nan)
        call = lambda: positional.RoPE(128)(x, out=out)
        started = lambda: not np.isnan(out[0, 0, 0, 0])
        finished = lambda: not np.isnan(out[0, -1, -1, -1])
    elif kind == "kv_append":
        cache = af.KVCache(1, 32, 128, capacity=4096 + 8)
        k0 = np.random.default_rng(0).standard_normal((1, 32, 8, 128)).astype(np.float32)
        cache.append(k0, k0)
        k = np.ones((1, 32, 4096, 128), np.float32)

        def reset():
            cache.truncate(8)
            cache._v[:, :, 8:] = np.nan

        call = lambda: cache.append(k, k)
        # the keys are written first, then the values
        started = lambda: not np.isnan(cache._v[0, 0, 8, 0])
        finished = lambda: not np.isnan(cache._v[0, -1, -1, -1])
    else:
        _cyloops.np = NpShim()
        reset = captured.clear
        if kind == "band_layout":
            call = lambda: masks.BlockSparse.local(8192 * 16, 16, 8192)  # every block kept
            started = lambda: bool(captured) and bool(captured[-1][0, 0])
            finished = lambda: bool(captured[-1][-1, -1])
        else:
            m = np.ones((1, 1, 8192, 8192), np.bool_)
            call = lambda: masks.block_summary(m, 16)
            started = lambda: bool(captured) and captured[-1][0, 0, 0, 0] == 2
            finished = lambda: captured[-1][0, 0, -1, -1] == 2

    def watcher():
        while not started():
            time.sleep(0.0001)
        os.kill(os.getpid(), signal.SIGINT)

    for attempt in range(40):
        reset()
        w = threading.Thread(target=watcher, daemon=True)
        try:
            w.start()
            call()
            w.join()  # the watcher was late: its signal is raised here
            time.sleep(1)
            sys.exit("no KeyboardInterrupt at all")
        except KeyboardInterrupt:
            w.join()
            if not finished():
                print("interrupted inside the loop", attempt)
                break
    else:
        print("never interrupted inside the loop")
    if kind == "kv_append":  # the cache is as before the interrupted append, and usable
        assert cache.lengths.tolist() == [8] and cache.positions.tolist() == [8]
        np.testing.assert_array_equal(cache.keys(0), k0[0])
        q = k0[:, :, -1:]
        want = af.scaled_dot_product_attention(q, k0, k0)
        np.testing.assert_allclose(cache.attend(q), want, rtol=1e-5, atol=1e-6)
        print("cache ok")
"""


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["rope", "kv_append", "band_layout", "block_summary"])
def test_ctrl_c_interrupts_the_long_cython_loops(kind, threads):
    code = textwrap.dedent(SIGINT_CODE.format(kind=kind, threads=threads))
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0].startswith("interrupted inside the loop"), (
        lines,
        r.stderr,
    )  # stopped before its end
    if kind == "kv_append":
        assert lines[1] == "cache ok"


def test_interrupted_append_into_a_full_ring_drops_only_overwritten_keys(rng, monkeypatch):
    # A Ctrl-C inside the copy into a full ring: the new rows are not stored and
    # the oldest keys whose slots were (maybe) overwritten are dropped; the
    # rest of the cache is intact and consistent.
    from attn_fast import kv_cache

    cache = KVCache(2, 1, 4, window=3, ring=6, dtype=np.float64, growable=False)
    ks = randn(rng, (2, 1, 5, 4), np.float64)
    cache.append(
        ks[:, :, :4], ks[:, :, :4], lengths=[4, 2]
    )  # seq 0 holds 4 of 6 slots, seq 1 holds 2
    real = kv_cache._cyloops.cache_write

    def interrupted(dst, src, first, count, *a, **kw):
        real(dst, src, first, count, *a, **kw)  # every row written, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(kv_cache._cyloops, "cache_write", interrupted)
    new = randn(rng, (2, 1, 3, 4), np.float64)
    with pytest.raises(KeyboardInterrupt):
        cache.append(new, new)
    monkeypatch.setattr(kv_cache._cyloops, "cache_write", real)
    # seq 0: 4 stored + 3 new > 6 slots: its oldest key was overwritten; seq 1 fits
    assert cache.positions.tolist() == [4, 2]
    assert cache.lengths.tolist() == [3, 2]
    np.testing.assert_array_equal(cache.keys(0), ks[0, :, 1:4])
    np.testing.assert_array_equal(cache.keys(1), ks[1, :, :2])
    q = randn(rng, (2, 1, 1, 4), np.float64)
    cache.append(new[:, :, :1], new[:, :, :1])
    got = cache.attend(q)
    for b, hist in enumerate(
        [
            np.concatenate([ks[0, :, 1:4], new[0, :, :1]], 1),
            np.concatenate([ks[1, :, :2], new[1, :, :1]], 1),
        ]
    ):
        hist = hist[:, -3:]  # the window: the query sees its last 3 positions
        np.testing.assert_allclose(got[b], ref.sdpa(q[b], hist, hist), rtol=1e-12, atol=1e-12)
