"""``MultiHeadAttention`` (multihead.py): constructor and call errors, unusual
layouts against a float64 oracle, and failures (a bad cache, a bad weight)
that leave the module as it was (docs/HARDENING.md)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    UNUSUAL_LAYOUTS,
    assert_close,
    assert_same_cache,
    bad_weights,
    randn,
    snapshot_cache,
)

import attn_fast as af
from attn_fast import positional
from attn_fast import reference as ref

# ---------------------------------------------------------------- MultiHeadAttention


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(d_model=8.0, num_heads=2), TypeError, "d_model must be an int"),  # was int(8.0)
        (dict(d_model=8, num_heads=True), TypeError, "num_heads must be an int"),
        (dict(d_model=8, num_heads=0), ValueError, "num_heads must be >= 1"),
        (dict(d_model=8, num_heads=4, num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
        (dict(d_model=8, num_heads=4, num_kv_heads=2.0), TypeError, "num_kv_heads must be an int"),
        (dict(d_model=8, num_heads=3), ValueError, "not divisible"),
        (dict(d_model=8, num_heads=2, head_dim=-1), ValueError, "head_dim must be >= 1"),
        (dict(d_model=8, num_heads=2, kv_dim=0), ValueError, "kv_dim must be >= 1"),
        (
            dict(d_model=8, num_heads=2, scale=np.nan),
            ValueError,
            "scale must be finite",
        ),  # was a NaN output
        (
            dict(d_model=8, num_heads=2, dtype=np.int32),  # float16 / bfloat16 are accepted
            TypeError,
            "dtype must be float32, float64, float16 or bfloat16",
        ),
        (dict(d_model=8, num_heads=2, positional="alibi"), ValueError, "positional must be"),
        (
            dict(d_model=8, num_heads=2, positional=positional.RoPE(6)),
            ValueError,
            "RoPE has head_dim 6",
        ),
        (dict(d_model=8, num_heads=2, rng=True), TypeError, "rng must be"),
        (dict(d_model=8, num_heads=2, rng=1.5), TypeError, "rng must be"),
    ],
)
def test_mha_constructor_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        af.MultiHeadAttention(**kw)


def _mha_oracle(m, x, causal=False, context=None):
    x = x.astype(F64)
    c = x if context is None else context.astype(F64)
    H, Hkv, dh = m.num_heads, m.num_kv_heads, m.head_dim
    q = (x @ m.Wq.T.astype(F64)).reshape(x.shape[0], -1, H, dh).transpose(0, 2, 1, 3)
    k = (c @ m.Wk.T.astype(F64)).reshape(c.shape[0], -1, Hkv, dh).transpose(0, 2, 1, 3)
    v = (c @ m.Wv.T.astype(F64)).reshape(c.shape[0], -1, Hkv, dh).transpose(0, 2, 1, 3)
    mask = ref.causal_mask(q.shape[2], k.shape[2]) if causal else None
    o = ref.sdpa(q, k, v, mask=mask, scale=m.scale)
    return o.transpose(0, 2, 1, 3).reshape(x.shape[0], -1, H * dh) @ m.Wo.T.astype(F64)


@pytest.mark.parametrize("layout", sorted(UNUSUAL_LAYOUTS))
def test_mha_unusual_layouts(rng, layout):
    m = af.MultiHeadAttention(12, 4, 2, rng=1)
    x, ctx = randn(rng, (2, 5, 12)), randn(rng, (2, 7, 12))
    f = UNUSUAL_LAYOUTS[layout]
    assert_close(m(f(x), causal=True), _mha_oracle(m, x, causal=True), F32)
    assert_close(m(f(x), context=f(ctx)), _mha_oracle(m, x, context=ctx), F32)


def test_mha_call_errors(rng):
    m = af.MultiHeadAttention(8, 2, rng=0)
    x = randn(rng, (2, 5, 8))
    with pytest.raises(TypeError, match="x has dtype float64"):
        m(x.astype(F64))
    with pytest.raises(TypeError, match="x must be float32 or float64"):
        m(np.ones((2, 5, 8), np.int64))
    with pytest.raises(
        ValueError, match=r"x must be \(L, 8\) or \(B, L, 8\), got shape \(2, 5, 7\)"
    ):
        m(x[..., :7])
    with pytest.raises(ValueError, match=r"got shape \(1, 2, 5, 8\)"):
        m(x[None])
    with pytest.raises(ValueError, match="batch sizes differ"):
        m(x, context=x[:1])
    with pytest.raises(ValueError, match="not broadcastable"):
        m(x, mask=np.ones((5, 6), bool))
    with pytest.raises(ValueError, match="positions= is only meaningful"):
        m(x, positions=np.arange(5))
    with pytest.raises(
        TypeError, match="cache must be a KVCache"
    ):  # was AttributeError: no 'append'
        m(x, cache=af.LayerCaches(1, 2, 2, 4))
    with pytest.raises(ValueError, match="cache has .* = \\(2, 1, 4, 4, float32\\)"):
        m(x, cache=af.KVCache(2, 1, 4))
    with pytest.raises(ValueError, match="cache has"):
        m(x, cache=af.KVCache(2, 2, 4, dtype=F64))


def test_mha_zero_length_and_nan_rows(rng):
    m = af.MultiHeadAttention(8, 2, rng=0)
    assert m(randn(rng, (2, 0, 8))).shape == (2, 0, 8)
    assert m(randn(rng, (0, 3, 8))).shape == (0, 3, 8)
    x = randn(rng, (1, 6, 8))
    x[0, 3, 1] = np.nan
    y = m(x, causal=True)
    assert np.isnan(y[0, 3:]).all()  # rows that see token 3
    assert_close(y[0, :3], _mha_oracle(m, x[:, :3], causal=True)[0], F32)


def test_mha_cache_failure_leaves_cache_unchanged(rng):
    m = af.MultiHeadAttention(8, 2, positional="rope", rng=0)
    cache = af.KVCache(1, 2, 4, capacity=4, growable=False)
    m(randn(rng, (1, 3, 8)), cache=cache, causal=True)
    snap = snapshot_cache(cache)
    with pytest.raises(ValueError, match="fixed capacity"):
        m(randn(rng, (1, 2, 8)), cache=cache, causal=True)
    with pytest.raises(ValueError, match="mask= cannot be combined"):
        m(randn(rng, (1, 1, 8)), cache=cache, mask=np.ones((1, 4), bool))
    with pytest.raises(TypeError, match="x has dtype"):
        m(randn(rng, (1, 1, 8), F64), cache=cache)
    assert_same_cache(cache, snap)


@pytest.mark.parametrize(
    "value, exc, match",
    [
        (np.ones((3, 3), F32), ValueError, r"has shape \(3, 3\), expected \(8, 8\)"),
        ("nan", ValueError, "contains NaN or inf"),
        ("complex", TypeError, "real numeric array"),
        ("bool", TypeError, "real numeric array"),
    ],
)
def test_mha_load_weights_is_all_or_nothing(value, exc, match):
    m = af.MultiHeadAttention(8, 2, rng=0)
    sd = {k: v.copy() for k, v in m.state_dict().items()}
    shape = sd["Wo"].shape
    value = (
        {
            "nan": np.full(shape, np.nan, F32),
            "complex": np.ones(shape, np.complex64),
            "bool": np.ones(shape, bool),
        }.get(value, value)
        if isinstance(value, str)
        else value
    )
    with pytest.raises(exc, match=match):
        m.load_weights(bad_weights(sd, "Wo", value))  # Wq was copied before Wo failed
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, sd[k])
