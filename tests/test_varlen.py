"""varlen_attention (packed sequences) against one call per sequence and the oracle."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, poisoned, randn

import attn_fast as af
from attn_fast import reference as ref


def packed(rng, lens_q, lens_k, Hq, Hkv, d, dv, dtype=np.float64):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)])
    cu_k = np.concatenate([[0], np.cumsum(lens_k)])
    q = randn(rng, (cu_q[-1], Hq, d), dtype)
    k = randn(rng, (cu_k[-1], Hkv, d), dtype)
    v = randn(rng, (cu_k[-1], Hkv, dv), dtype)
    return q, k, v, cu_q, cu_k


def per_sequence(q, k, v, cu_q, cu_k, **kw):
    """One sdpa call per sequence on (H, L, d) views; returns (out, lse) packed like varlen."""
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s] : cu_q[s + 1]].transpose(1, 0, 2)
        ks = k[cu_k[s] : cu_k[s + 1]].transpose(1, 0, 2)
        vs = v[cu_k[s] : cu_k[s + 1]].transpose(1, 0, 2)
        o, lse = af.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True, return_lse=True, **kw)
        outs.append(o.transpose(1, 0, 2))
        lses.append(lse)
    return np.concatenate(outs, axis=0), np.concatenate(lses, axis=1)


CASES = [
    # lens_q, lens_k (self-attention, cross-attention, empty sequences, tails)
    ([7, 1, 129, 50], [7, 1, 129, 50]),
    ([10, 0, 33], [40, 5, 33]),
    ([60, 3], [20, 0]),
    ([1], [300]),
]


@pytest.mark.parametrize(
    "lens", CASES, ids=lambda c: "-".join(map(str, c[0])) + "_" + "-".join(map(str, c[1]))
)
@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"causal": True},
        {"causal": True, "window_size": (8, 0)},
        {"window_size": (5, 3)},
        {"softcap": 3.0, "causal": True},
        {"alibi": True, "causal": True},
        {"sinks": True},
    ],
    ids=["full", "causal", "mistral", "window", "softcap", "alibi", "sinks"],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_varlen_equals_separate_calls(isa, rng, lens, opts, dtype):
    Hq, Hkv, d, dv = 4, 2, 16, 12
    q, k, v, cu_q, cu_k = packed(rng, *lens, Hq, Hkv, d, dv, dtype)
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = rng.uniform(0.05, 0.5, Hq)
    if opts.pop("sinks", False):
        opts["sinks"] = rng.standard_normal(Hq)
    out = poisoned((cu_q[-1], Hq, dv), dtype)
    o, lse = af.varlen_attention(q, k, v, cu_q, cu_k, out=out, return_lse=True, **opts)
    assert o is out and lse.shape == (Hq, cu_q[-1]) and o.dtype == dtype
    sep_opts = dict(opts)
    sep_opts["is_causal"] = sep_opts.pop("causal", False)
    O, LSE = per_sequence(q, k, v, cu_q, cu_k, **sep_opts)
    assert_close(o, O, dtype)
    assert_lse_close(lse, LSE, dtype)
    assert not np.any(np.isnan(o))


def test_varlen_against_oracle_block_diagonal(rng):
    """The packed batch is one attention with a block-diagonal (per-sequence causal) mask."""
    lens = [5, 17, 9]
    q, k, v, cu, _ = packed(rng, lens, lens, 2, 2, 8, 8)
    T = cu[-1]
    mask = np.zeros((T, T), bool)
    for s in range(len(lens)):
        a, b = cu[s], cu[s + 1]
        mask[a:b, a:b] = np.tril(np.ones((b - a, b - a), bool))
    o = af.varlen_attention(q, k, v, cu, cu, causal=True)
    O = ref.sdpa(q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), mask=mask)
    np.testing.assert_allclose(o, O.transpose(1, 0, 2), atol=1e-12)


def test_varlen_strided_inputs_and_nan_isolation(rng):
    # q, k, v as views into one packed (T, 3, H, d) qkv buffer, as a fused projection gives.
    lens = [30, 11, 40]
    cu = np.concatenate([[0], np.cumsum(lens)])
    qkv = rng.standard_normal((cu[-1], 3, 2, 16))
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    assert not q.flags.c_contiguous
    o = af.varlen_attention(q, k, v, cu, cu, causal=True)
    O, _ = per_sequence(
        np.ascontiguousarray(q),
        np.ascontiguousarray(k),
        np.ascontiguousarray(v),
        cu,
        cu,
        is_causal=True,
    )
    np.testing.assert_allclose(o, O, atol=1e-12)
    # A NaN in one sequence's keys and values stays in that sequence.
    k2, v2 = k.copy(), v.copy()
    k2[cu[1] : cu[2]] = np.nan
    v2[cu[1] : cu[2]] = np.nan
    o2 = af.varlen_attention(q, k2, v2, cu, cu, causal=True)
    np.testing.assert_array_equal(o2[: cu[1]], o[: cu[1]])
    np.testing.assert_array_equal(o2[cu[2] :], o[cu[2] :])


def test_varlen_empty_and_keyless():
    q = np.ones((0, 2, 4))
    o = af.varlen_attention(q, q, q, [0], [0])
    assert o.shape == (0, 2, 4)
    # queries whose sequence has no keys: zeros, lse -inf
    q = np.ones((5, 2, 4))
    k = np.ones((3, 2, 4))
    o, lse = af.varlen_attention(q, k, k, [0, 2, 5], [0, 0, 3], return_lse=True)
    assert np.all(o[:2] == 0) and np.all(np.isneginf(lse[:, :2]))
    assert np.all(np.isfinite(lse[:, 2:]))


def test_varlen_stats(rng):
    lens = [64, 64, 64, 64]
    q, k, v, cu, _ = packed(rng, lens, lens, 1, 1, 8, 8, np.float32)
    _, s = af.varlen_attention(q, k, v, cu, cu, return_stats=True, block_q=64, block_k=64)
    per_seq = -(-64 // s.block_q) * -(-64 // s.block_k)  # the tile used (block_k may be rounded up)
    assert s.tiles_computed == 4 * per_seq  # only each sequence's own tiles: no cross-sequence work
    _, s = af.scaled_dot_product_attention(
        q.transpose(1, 0, 2),
        k.transpose(1, 0, 2),
        v.transpose(1, 0, 2),
        return_stats=True,
        block_q=64,
        block_k=64,
    )
    assert s.tiles_computed == -(-256 // s.block_q) * -(-256 // s.block_k)


def test_varlen_errors():
    q = np.ones((10, 2, 4))
    va = af.varlen_attention
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        va(q, q, q, [0, 6, 4, 10], [0, 3, 6, 10])
    with pytest.raises(ValueError, match="cu_seqlens_k must end at the packed length 10"):
        va(q, q, q, [0, 5, 10], [0, 5, 9])
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        va(q, q, q, [1, 5, 10], [0, 5, 10])
    with pytest.raises(ValueError, match="cu_seqlens_q has 2 sequences but cu_seqlens_k has 1"):
        va(q, q, q, [0, 5, 10], [0, 10])
    with pytest.raises(ValueError, match="cu_seqlens_q must be an integer array"):
        va(q, q, q, [0.0, 10.0], [0, 10])
    with pytest.raises(ValueError, match="cu_seqlens_k must be 1-D"):
        va(q, q, q, [0, 10], [[0, 10]])
    with pytest.raises(ValueError, match=r"q must be \(total, heads, dim\)"):
        va(q[None], q, q, [0, 10], [0, 10])
    with pytest.raises(ValueError, match="not a multiple"):
        va(q, np.ones((10, 3, 4)), np.ones((10, 3, 4)), [0, 10], [0, 10])
    with pytest.raises(ValueError, match="max_seqlen_q = 4 is shorter than the longest sequence"):
        va(q, q, q, [0, 5, 10], [0, 5, 10], 4, 5)
    with pytest.raises(ValueError, match="window_size"):
        va(q, q, q, [0, 10], [0, 10], window_size=(-2, 0))
