"""Kernel promises that broke under adversarial testing (issue 16, issue 15 item 8).

- the decode kernel's memory: every allocation checked (MemoryError, never a
  crash), scratch bounded whatever Lq and Lk (query rows taken in slices);
- the decode kernel's NaN rules: those of the fused kernel (IEEE formula);
- the range of the unnormalised accumulator (|v| * Lk below the dtype's max);
- a scale finite as a double but not in float32;
- a +inf sink.

Written down in docs/HARDENING.md ("Kernel limits and non-finite corners").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, needs_rlimit_as, poisoned, randn

import attn_fast as af
from attn_fast import _core
from attn_fast import reference as ref

sdpa = af.scaled_dot_product_attention
DTYPES = [np.float32, np.float64]
ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")


# ---------------------------------------------------------------- decode memory

# A child process with an address-space cap runs `call`: it must either finish
# (printing "done") or still be running (computing, not crashed) when the
# parent sends SIGINT, and then stop with KeyboardInterrupt. Before the fix
# these calls dereferenced a NULL partial buffer: SIGSEGV.
CAPPED_CHILD = r"""
import resource, sys, numpy as np, attn_fast as af
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # 6 GiB of address space
one = np.float32(0.5)
case = sys.argv[1]
if case == "long_chunk":  # Lq = Lk = 2^19 through the decode kernel: the partials asked for 32 GiB
    x = np.zeros((1, 1, 1 << 19, 64), np.float32)
    call = lambda: af.scaled_dot_product_attention(x, x, x, backend="decode")
elif case == "broadcast_2_36":  # one query, 2^36 broadcast keys
    q = np.ones((1, 1, 1, 8), np.float32)
    k = np.broadcast_to(one, (1, 1, 1 << 36, 8))
    call = lambda: af.scaled_dot_product_attention(q, k, k, backend="decode")
elif case == "dv_1024":  # 2^31 + 7 keys, dv = 1024
    q = np.ones((1, 1, 1, 4), np.float32)
    k = np.broadcast_to(one, (1, 1, (1 << 31) + 7, 4))
    v = np.broadcast_to(one, (1, 1, (1 << 31) + 7, 1024))
    call = lambda: af.scaled_dot_product_attention(q, k, v, backend="decode")
print("started", flush=True)
try:
    call()
    print("done", flush=True)
except MemoryError:
    print("MemoryError", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@needs_rlimit_as
@pytest.mark.skipif(ASAN, reason="ASan reserves more address space than the limit")
@pytest.mark.parametrize("case", ["long_chunk", "broadcast_2_36", "dv_1024"])
def test_decode_huge_calls_never_crash(case):
    p = subprocess.Popen(
        [sys.executable, "-c", CAPPED_CHILD, case],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "started", p.stderr.read()
        time.sleep(1.5)  # the old kernel crashed within milliseconds (allocation)
        if p.poll() is None:
            os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, f"child died with {p.returncode}: {err}"
    assert out.split() in (["done"], ["MemoryError"], ["interrupted"]), (out, err)


SPLIT1_CHILD = r"""
import resource, numpy as np, attn_fast as af
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
R = 1 << 26  # split = 1: 2^26 splits per row, whose partials asked for ~20 GiB
q = np.full((1, 1, 1, 1), 0.25, np.float32)
k = np.broadcast_to(np.float32(2.0), (1, 1, R, 1))
v = np.broadcast_to(np.float32(-1.5), (1, 1, R, 1))
o = np.full((1, 1, 1, 1), np.nan, np.float32)
lse = np.full(1, np.nan, np.float32)
af._core.decode(q, k, v, o, lse, scale=1.0, split=1)
print(repr(float(o.ravel()[0])), repr(float(lse[0])))
"""


@needs_rlimit_as
@pytest.mark.skipif(ASAN, reason="ASan reserves more address space than the limit")
def test_decode_split_1_over_2_26_keys():
    r = subprocess.run(
        [sys.executable, "-c", SPLIT1_CHILD], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    o, lse = map(float, r.stdout.split())
    # Every key has the score 0.25 * 2 = 0.5 and the value -1.5.
    assert o == pytest.approx(-1.5, rel=1e-5)
    assert lse == pytest.approx(0.5 + 26 * np.log(2), rel=1e-5)


PEAK_CHILD = r"""
import resource, numpy as np, attn_fast as af
L, d = 4096, 64
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, L, d)).astype(np.float32) for _ in range(3))
o = np.zeros((1, 1, L, d), np.float32)
lse = np.zeros(L, np.float32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
# split = 64: 4096 / 8 row blocks x 64 splits of partials, 64 MiB in one buffer before the fix
af._core.decode(q, k, v, o, lse, scale=0.125, split=64)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
ref = af.scaled_dot_product_attention(q, k, v, backend="fused")
print(grown, float(np.abs(o - ref).max()))
"""


@pytest.mark.skipif(ASAN, reason="ASan's shadow memory and quarantine count in the RSS")
def test_decode_scratch_bounded_for_a_long_chunk():
    # The partial (O, m, l) buffers grew like Lq * Lk * dv / split; the query
    # rows are now taken in slices whose partials fit a few MiB.
    r = subprocess.run(
        [sys.executable, "-c", PEAK_CHILD], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    grown_kib, err = r.stdout.split()
    assert int(grown_kib) < 24 * 1024, (
        f"peak RSS grew by {int(grown_kib) // 1024} MiB (the old buffers: 64 MiB)"
    )
    assert float(err) < 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_slices_match_reference(isa, rng, dtype):
    # Many slices (small split, long chunk, GQA, causal, ragged lengths) give
    # the reference result, and every row is written (poisoned out).
    B, Hq, Hkv, Lq, Lk, d, dv = 2, 4, 2, 130, 400, 5, 80
    q, k, v = (
        randn(rng, (B, Hq, Lq, d), dtype),
        randn(rng, (B, Hkv, Lk, d), dtype),
        randn(rng, (B, Hkv, Lk, dv), dtype),
    )
    q_lens, kv_lens = np.array([130, 77], np.int64), np.array([400, 201], np.int64)
    for split in (1, 64, 0):
        o, lse = poisoned((B, Hq, Lq, dv), dtype), poisoned((B * Hq * Lq,), dtype)
        _core.decode(
            q, k, v, o, lse, scale=0.4, causal=True, q_lens=q_lens, kv_lens=kv_lens, split=split
        )
        o_r, lse_r = poisoned((B, Hq, Lq, dv), dtype), poisoned((B * Hq * Lq,), dtype)
        _core.forward(
            q,
            k,
            v,
            o_r,
            lse_r,
            scale=0.4,
            causal=True,
            q_lens=q_lens,
            kv_lens=kv_lens,
            reference=True,
        )
        assert_close(o, o_r, dtype)
        assert_lse_close(lse, lse_r, dtype)


# ---------------------------------------------------------------- decode NaN rules


def _decode_and_reference(q, k, v, **kw):
    o, lse = sdpa(q, k, v, return_lse=True, backend="decode", **kw)
    O, LSE = sdpa(q, k, v, return_lse=True, backend="reference", **kw)
    return o, lse, O, LSE


def _same_ieee(o, O, lse, LSE, dtype):
    np.testing.assert_array_equal(np.isnan(o), np.isnan(O))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(LSE))
    assert_close(o, O, dtype)
    assert_close(lse, LSE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_nan_block_of_keys(isa, dtype):
    # The reproducer: a whole 64-key block of NaN keys was treated as empty
    # (lse 5.21 where the formula gives NaN).
    rng = np.random.default_rng(7)
    q, k, v = (
        randn(rng, (1, 1, 1, 16), dtype),
        randn(rng, (1, 1, 128, 16), dtype),
        randn(rng, (1, 1, 128, 16), dtype),
    )
    k[0, 0, :64] = np.nan
    o, lse, O, LSE = _decode_and_reference(q, k, v)
    assert np.isnan(lse).all() and np.isnan(LSE).all()
    assert np.isnan(o).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "where", ["k_visible", "k_masked", "q", "v_visible", "v_masked", "k_split"]
)
def test_decode_nan_follows_fused_rules(isa, rng, dtype, where):
    # GQA (2 query heads per kv head), 3 query tokens, causal over 1500 keys:
    # several splits and blocks per row.
    B, Hq, Hkv, Lq, Lk, d, dv = 1, 4, 2, 3, 1500, 8, 5
    q, k, v = (
        randn(rng, (B, Hq, Lq, d), dtype),
        randn(rng, (B, Hkv, Lk, d), dtype),
        randn(rng, (B, Hkv, Lk, dv), dtype),
    )
    if where == "k_visible":
        k[0, 1, 64:128] = np.nan  # a whole block: kv head 1, every row
    elif where == "k_masked":
        k[0, 0, Lk - 1] = np.nan  # visible to the last query token only (causal)
    elif where == "q":
        q[0, 2, 1] = np.nan  # one query row: NaN, lse NaN (was zeros, lse -inf)
    elif where == "v_visible":
        v[0, 0, 700, 2] = np.nan
    elif where == "v_masked":
        v[0, 1, Lk - 1] = np.nan  # only the last token sees it
    else:
        k[0, 0, 1000:1500] = np.nan  # every block of the last split(s)
    o, lse, O, LSE = _decode_and_reference(q, k, v, is_causal=True, enable_gqa=True)
    _same_ieee(o, O, lse, LSE, dtype)
    fused = sdpa(q, k, v, return_lse=True, backend="fused", is_causal=True, enable_gqa=True)
    _same_ieee(o, fused[0], lse, fused[1], dtype)
    if where == "q":
        assert np.isnan(o[0, 2, 1]).all() and np.isnan(lse[0, 2, 1])
        assert np.isfinite(o[0, 2, 0]).all()
    if where in ("k_masked", "v_masked"):
        assert np.isfinite(o[:, :, :-1]).all()  # rows that do not see the key stay exact


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_nan_query_with_a_kv_cache(isa, rng, dtype):
    # KVCache.attend on a wrapped ring uses the decode kernel: a NaN query row
    # is NaN there too, the other rows exact.
    cache = af.KVCache(batch=1, num_kv_heads=1, head_dim=4, capacity=200, dtype=dtype)
    k, v = randn(rng, (1, 1, 150, 4), dtype), randn(rng, (1, 1, 150, 4), dtype)
    cache.append(k, v)
    q = randn(rng, (1, 1, 2, 4), dtype)
    q[0, 0, 0] = np.nan
    o, lse = cache.attend(q, causal=False, return_lse=True)
    assert np.isnan(o[0, 0, 0]).all() and np.isnan(lse[0, 0, 0])
    assert_close(o[0, 0, 1], ref.sdpa(q[..., 1:, :], k, v)[0, 0, 0], dtype)


# ---------------------------------------------------------------- accumulator range


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["fused", "decode", "reference"])
def test_value_range_boundary(isa, dtype, backend):
    # The unnormalised accumulator sum_j p_j v_j reaches |v| * (number of keys
    # of weight ~1). Documented range: |v| * Lk below the dtype's max. At half
    # of it, equal keys give v exactly (finite) on every backend.
    Lk = 1000
    big = np.finfo(dtype).max / Lk / 2
    q = np.zeros((1, 1, 1, 4), dtype)
    k = np.zeros((1, 1, Lk, 4), dtype)
    v = np.full((1, 1, Lk, 3), big, dtype)
    v[..., 1] = -big
    o = sdpa(q, k, v, backend=backend)
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o[0, 0, 0], [big, -big, big], rtol=1e-5)


# ---------------------------------------------------------------- scale and sinks


@pytest.mark.parametrize("backend", ["fused", "decode", "reference"])
def test_scale_beyond_float32_rejected(backend):
    x = np.ones((1, 1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="scale"):
        sdpa(x, x, x, scale=1e300, backend=backend)
    with pytest.raises(ValueError, match="scale"):
        sdpa(x, x, x, scale=-1e39, backend=backend)
    with pytest.raises(
        ValueError, match="scale"
    ):  # the bindings' safety net (KVCache passes no dtype)
        _core.forward(x, x, x, np.empty_like(x), scale=1e300)
    with pytest.raises(ValueError, match="scale"):
        _core.decode(x, x, x, np.empty_like(x), scale=1e300)
    with pytest.raises(ValueError, match="scale"):
        af.varlen_attention(
            x[0].transpose(1, 0, 2),
            x[0].transpose(1, 0, 2),
            x[0].transpose(1, 0, 2),
            np.array([0, 4]),
            np.array([0, 4]),
            scale=1e300,
        )
    with pytest.raises(
        ValueError, match="scale"
    ):  # checked at construction, with the module's dtype
        af.MultiHeadAttention(8, 2, scale=1e300, dtype=np.float32)
    af.MultiHeadAttention(8, 2, scale=1e300, dtype=np.float64)
    # The same value is fine in float64, and the largest float32 in float32.
    y = x.astype(np.float64)
    assert np.isfinite(sdpa(y, y, y, scale=1e300, backend=backend)).all()
    assert np.isfinite(
        sdpa(x * 0, x, x, scale=float(np.finfo(np.float32).max), backend=backend)
    ).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_sink_plus_inf_takes_all_weight(isa, rng, dtype, backend):
    # The limit of a sink logit -> +inf: O = 0, lse = +inf (was NaN, inf - inf).
    B, H, Lq, Lk, d = 2, 3, 7, 130, 5
    q, k, v = (
        randn(rng, (B, H, Lq, d), dtype),
        randn(rng, (B, H, Lk, d), dtype),
        randn(rng, (B, H, Lk, d), dtype),
    )
    sinks = np.array([np.inf, 0.5, -np.inf], dtype)
    mask = np.ones((Lq, Lk), bool)
    mask[3] = False  # a row that sees no key: the sink alone
    mask[4, ::2] = False
    o, lse = sdpa(q, k, v, attn_mask=mask, sinks=sinks, return_lse=True, backend=backend)
    assert np.all(o[:, 0] == 0)
    assert np.all(np.isposinf(lse[:, 0]))
    # The other heads are what they were.
    O, LSE = ref.sdpa(q[:, 1:], k[:, 1:], v[:, 1:], mask=mask, sinks=sinks[1:], return_lse=True)
    assert_close(o[:, 1:], O, dtype)
    assert_close(lse[:, 1:], LSE, dtype)
    # A NaN row stays NaN under a +inf sink, as does a row with a +inf score.
    qn = q.copy()
    qn[0, 0, 2] = np.nan
    qn[1, 0, 5] = np.inf
    o, lse = sdpa(qn, k, v, sinks=sinks, return_lse=True, backend=backend)
    assert np.isnan(o[0, 0, 2]).all() and np.isnan(lse[0, 0, 2])
    assert np.isnan(o[1, 0, 5]).all() and np.isnan(lse[1, 0, 5])
    assert np.all(o[0, 0, :2] == 0) and np.all(np.isposinf(lse[0, 0, :2]))
