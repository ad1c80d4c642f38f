"""attention_weights / return_weights: the materialised P, for small inputs."""

from __future__ import annotations

import numpy as np
import pytest

import attn_fast as af
from attn_fast import masks as M
from attn_fast import reference as ref


def oracle_P(q, k, mask=None, bias=None, **kw):
    """P from the oracle itself: attention with V = I returns the weights."""
    Lk = k.shape[-2]
    eye = np.broadcast_to(np.eye(Lk), k.shape[:-1] + (Lk,))
    return ref.sdpa(q, k, eye, mask=mask, bias=bias, **kw)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_weights_match_oracle_and_output(rng, dtype):
    B, Hq, Hkv, Lq, Lk, d, dv = 2, 4, 2, 13, 21, 8, 5
    q = rng.standard_normal((B, Hq, Lq, d)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Lk, d)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Lk, dv)).astype(dtype)
    bias = rng.standard_normal((Lq, Lk))
    m = M.Causal() & M.SlidingWindow(6) & M.Padding([21, 15], [13, 10]) & M.Dense(bias)
    P = af.attention_weights(q, k, attn_mask=m, enable_gqa=True)
    assert P.shape == (B, Hq, Lq, Lk) and P.dtype == dtype
    dense = m.to_dense(B, Hq, Lq, Lk)
    expect = oracle_P(q, k, mask=dense, bias=bias)
    t = 1e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(P, expect, atol=t)
    # rows sum to 1, or 0 where nothing is visible (padding rows of batch 1)
    sums = P.sum(-1)
    np.testing.assert_allclose(sums[dense.any(-1)], 1, atol=10 * t)
    assert np.all(P[1, :, 10:] == 0)
    o, P2 = af.scaled_dot_product_attention(
        q, k, v, attn_mask=m, enable_gqa=True, return_weights=True
    )
    np.testing.assert_array_equal(P, P2)
    np.testing.assert_allclose(P.astype(np.float64) @ np.repeat(v, 2, axis=1), o, atol=100 * t)


def test_weights_options(rng):
    H, L, d = 3, 9, 4
    q, k = rng.standard_normal((H, L, d)), rng.standard_normal((H, L, d))
    sinks = rng.standard_normal(H)
    P = af.attention_weights(q, k, is_causal=True, sinks=sinks, softcap=1.5, scale=0.7)
    expect = oracle_P(q, k, mask=ref.causal_mask(L, L), sinks=sinks, softcap=1.5, scale=0.7)
    np.testing.assert_allclose(P, expect, atol=1e-12)
    assert np.all(P.sum(-1) < 1)  # the sink takes its share
    slopes = rng.uniform(0.1, 1, H)
    P = af.attention_weights(q, k, alibi_slopes=slopes, window_size=(2, 2))
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    expect = oracle_P(
        q, k, mask=ref.window_mask(L, L, 2, 2), bias=-slopes[:, None, None] * np.abs(i - j)
    )
    np.testing.assert_allclose(P, expect, atol=1e-12)
    # block-sparse layouts, dense 2-D input
    lay = M.BlockSparse.strided(L, 2, 2)
    P = af.attention_weights(q[0], k[0], attn_mask=lay)
    np.testing.assert_allclose(
        P, oracle_P(q[0], k[0], mask=lay.to_dense(1, 1, L, L)[0, 0]), atol=1e-12
    )


def test_weights_size_limit(rng):
    q = np.ones((1, 2, 64, 8), np.float32)
    with pytest.raises(
        ValueError,
        match=r"1\*2\*64\*64 = 8192 elements, above max_elements = 1000; pass force=True",
    ):
        af.attention_weights(q, q, max_elements=1000)
    assert af.attention_weights(q, q, max_elements=1000, force=True).shape == (1, 2, 64, 64)
    big = np.ones((1, 1, 4096, 2), np.float32)
    with pytest.raises(ValueError, match="force=True"):
        af.scaled_dot_product_attention(big, big, big, return_weights=True)


def test_weights_fully_masked_and_nan(rng):
    q, k = rng.standard_normal((1, 1, 6, 4)), rng.standard_normal((1, 1, 6, 4))
    k[0, 0, 5] = np.nan
    mask = np.ones((6, 6), bool)
    mask[:, 5] = False
    mask[2] = False
    P = af.attention_weights(q, k, attn_mask=mask)
    assert not np.any(np.isnan(P)) and np.all(P[0, 0, 2] == 0) and np.all(P[..., 5] == 0)
