"""``varlen_attention`` and ``attention_weights`` (functional.py) on unusual
layouts of valid data (checked against the float64 oracle) and on bad
arguments (an error naming the argument; docs/HARDENING.md)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    UNUSUAL_LAYOUTS,
    assert_close,
    randn,
    readonly,
)

import attn_fast as af
from attn_fast import reference as ref

# ---------------------------------------------------------------- varlen_attention


def _varlen_oracle(q, k, v, cu_q, cu_k, causal):
    out = np.zeros(q.shape[:2] + (v.shape[-1],))
    for s in range(len(cu_q) - 1):
        qs, ks, vs = (
            x.transpose(1, 0, 2)
            for x in (q[cu_q[s] : cu_q[s + 1]], k[cu_k[s] : cu_k[s + 1]], v[cu_k[s] : cu_k[s + 1]])
        )
        mask = ref.causal_mask(qs.shape[1], ks.shape[1]) if causal else None
        rep = qs.shape[0] // ks.shape[0]
        out[cu_q[s] : cu_q[s + 1]] = ref.sdpa(
            qs, np.repeat(ks, rep, 0), np.repeat(vs, rep, 0), mask=mask
        ).transpose(1, 0, 2)
    return out


@pytest.mark.parametrize("layout", sorted(UNUSUAL_LAYOUTS))
def test_varlen_unusual_layouts(rng, layout):
    cu_q, cu_k = np.array([0, 3, 3, 10]), np.array([0, 5, 6, 13])
    q, k, v = randn(rng, (10, 4, 5)), randn(rng, (13, 2, 5)), randn(rng, (13, 2, 3))
    f = UNUSUAL_LAYOUTS[layout]
    o = af.varlen_attention(f(q), f(k), f(v), f(cu_q), f(cu_k), causal=True)
    assert_close(o, _varlen_oracle(q, k, v, cu_q, cu_k, True), F32)


@pytest.mark.parametrize(
    "cu_q, match",
    [
        (
            np.array([0, 5, 3, 10], np.uint64),
            "non-decreasing",
        ),  # a uint64 diff used to wrap: accepted
        (np.array([0, 5, 3, 10], np.int32), "non-decreasing"),
        (np.array([1, 5, 10]), "must start at 0"),
        (np.array([0, 5, 11]), "must end at the packed length 10"),
        (np.array([0, 2**64 - 1], np.uint64), "beyond int64"),
        (np.array([[0, 10]]), r"1-D \(num_seqs \+ 1,\), got shape \(1, 2\)"),
        (np.array([0.0, 10.0]), "integer array"),
        (np.array([False, True]), "integer array"),
    ],
)
def test_varlen_bad_cu_seqlens(rng, cu_q, match):
    q = randn(rng, (10, 2, 4))
    cu_k = (
        np.array([0, 4, 7, 10])
        if cu_q.ndim == 1 and cu_q.size == 4
        else np.array([0, 10][: cu_q.size])
    )
    with pytest.raises(ValueError, match=match):
        af.varlen_attention(q, q, q, cu_q, cu_k if cu_k.size == cu_q.size else np.array([0, 10]))


@pytest.mark.parametrize("window_size", [(2.5, 0), (True, 0), (0, np.float64(1.0)), (3, "0")])
def test_window_size_entries_must_be_ints(rng, window_size):
    """window_size=(2.5, 0) was int(2.5) = a window of 2, silently."""
    q = randn(rng, (6, 2, 4))
    with pytest.raises(TypeError, match=r"window_size\[[01]\] must be an int"):
        af.scaled_dot_product_attention(q, q, q, window_size=window_size)
    with pytest.raises(TypeError, match=r"window_size\[[01]\] must be an int"):
        af.varlen_attention(q, q, q, [0, 6], [0, 6], window_size=window_size)


def test_varlen_bad_arguments(rng):
    q = randn(rng, (10, 2, 4))
    cu = np.array([0, 4, 10])
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        af.varlen_attention(q, q, q, cu, cu, max_seqlen_q=6.5)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        af.varlen_attention(q, q, q, cu, cu, max_seqlen_k=True)
    with pytest.raises(ValueError, match=r"k has shape \(10, 2, 5\) but q has head dim 4"):
        af.varlen_attention(q, randn(rng, (10, 2, 5)), q, cu, cu)
    with pytest.raises(ValueError, match="total length and heads must match"):
        af.varlen_attention(q, q, q[:9], cu, cu)
    with pytest.raises(TypeError, match="mixed dtypes"):
        af.varlen_attention(q, q, q.astype(F64), cu, cu)
    with pytest.raises(TypeError, match="mixed dtypes"):  # float16 itself is supported
        af.varlen_attention(q.astype(np.float16), q, q, cu, cu)
    with pytest.raises(TypeError, match="float32 or float64"):
        af.varlen_attention(q.astype(np.int16), q, q, cu, cu)
    with pytest.raises(ValueError, match="2 sequences but cu_seqlens_k has 1"):
        af.varlen_attention(q, q, q, cu, np.array([0, 10]))
    with pytest.raises(ValueError, match="scale must be finite"):
        af.varlen_attention(q, q, q, cu, cu, scale=np.inf)
    with pytest.raises(ValueError, match="out is read-only"):
        af.varlen_attention(q, q, q, cu, cu, out=readonly(np.empty_like(q)))


# ---------------------------------------------------------------- attention_weights


@pytest.mark.parametrize("layout", sorted(UNUSUAL_LAYOUTS))
def test_attention_weights_unusual_layouts(rng, layout):
    q, k = randn(rng, (2, 3, 5, 4)), randn(rng, (2, 3, 7, 4))
    bias = randn(rng, (5, 7))
    f = UNUSUAL_LAYOUTS[layout]
    P = af.attention_weights(f(q), f(k), attn_mask=f(bias), is_causal=True)
    S = (q.astype(F64) @ np.swapaxes(k, -1, -2)) / 2.0 + bias
    S = np.where(ref.causal_mask(5, 7), S, -np.inf)
    assert_close(P, ref.softmax(S), F32)


def test_attention_weights_bad_input(rng):
    q = randn(rng, (2, 3, 5, 4))
    with pytest.raises(ValueError, match=r"k has shape \(2, 3, 7, 3\) but q has head dim 4"):
        af.attention_weights(q, randn(rng, (2, 3, 7, 3)))
    with pytest.raises(TypeError, match="float32 or float64"):
        af.attention_weights(q.astype(np.complex64), q)
    with pytest.raises(TypeError, match="mixed dtypes"):
        af.attention_weights(q, q.astype(F64))
    with pytest.raises(ValueError, match="not broadcastable"):
        af.attention_weights(q, q, attn_mask=np.ones((4, 5), bool))
    with pytest.raises(ValueError, match="max_elements"):
        af.attention_weights(q, q, max_elements=10)
    with pytest.raises(TypeError, match="max_elements must be an int"):
        af.attention_weights(q, q, max_elements=True)
    with pytest.raises(ValueError, match="scale must be finite"):
        af.attention_weights(q, q, scale=float("nan"))
