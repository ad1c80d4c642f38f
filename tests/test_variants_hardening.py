"""Linformer and linear attention (variants.py): unusual layouts against the
float64 oracle, and argument errors of the functions and the Linformer
layer (docs/HARDENING.md)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    UNUSUAL_LAYOUTS,
    assert_close,
    randn,
)

from attn_fast import reference as ref
from attn_fast import variants

# ---------------------------------------------------------------- variants


def _lin_oracle(q, k, v, causal, eps=1e-6):
    fq = np.where(q > 0, q + 1.0, np.exp(np.minimum(q, 0))).astype(F64)
    fk = np.where(k > 0, k + 1.0, np.exp(np.minimum(k, 0))).astype(F64)
    A = fq @ np.swapaxes(fk, -1, -2)
    if causal:
        A = np.tril(A)
    return (A @ v.astype(F64)) / (A.sum(-1, keepdims=True) + eps)


@pytest.mark.parametrize("layout", sorted(UNUSUAL_LAYOUTS))
def test_variants_unusual_layouts(rng, layout):
    f = UNUSUAL_LAYOUTS[layout]
    q, k, v = randn(rng, (2, 3, 6, 4)), randn(rng, (2, 3, 9, 4)), randn(rng, (2, 3, 9, 5))
    E = randn(rng, (4, 9))
    Kp, Vp = E.astype(F64) @ k, E.astype(F64) @ v
    assert_close(variants.linformer_attention(f(q), f(k), f(v), f(E)), ref.sdpa(q, Kp, Vp), F32)
    k6, v6 = k[:, :, :6], v[:, :, :6]
    assert_close(
        variants.linear_attention(f(q), f(k6), f(v6), causal=True),
        _lin_oracle(q, k6, v6, True),
        F32,
    )
    o, _ = variants.linear_attention_step(f(q[:, :, 0]), f(k6[:, :, 0]), f(v6[:, :, 0]))
    assert_close(o, _lin_oracle(q[:, :, :1], k6[:, :, :1], v6[:, :, :1], True)[:, :, 0], F32)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (
            lambda q: variants.linformer_attention(q, q, q, np.ones((2, 5), np.int32)),
            TypeError,
            "E must be float32",
        ),
        (
            lambda q: variants.linformer_attention(q, q, q, np.ones((2, 4), F32)),
            ValueError,
            r"E must be \(k, 5\)",
        ),
        (
            lambda q: variants.linformer_attention(q, q, q, np.ones(5, F32)),
            ValueError,
            r"E must be a \(k, L\)",
        ),
        (
            lambda q: variants.linformer_attention(
                q, q, q, np.ones((2, 5), F32), np.ones((3, 5), F32)
            ),
            ValueError,
            "same k",
        ),
        (
            lambda q: variants.linformer_attention(q, q[:1], q[:1], np.ones((2, 5), F32)),
            ValueError,
            "batch and heads",
        ),
        (lambda q: variants.linear_attention(q, q, q.astype(F64)), TypeError, "mixed dtypes"),
        (lambda q: variants.linear_attention(q, q[..., :2, :], q), ValueError, "must match"),
        (
            lambda q: variants.linear_attention(q, q, q, eps=np.nan),
            ValueError,
            "eps must be finite",
        ),
        (lambda q: variants.linear_attention(q, q, q, eps=-1.0), ValueError, "eps must be >= 0"),
        (
            lambda q: variants.linear_attention(q, q, q, feature_map="softmax"),
            ValueError,
            "unknown feature_map",
        ),
        (
            lambda q: variants.linear_attention(q, q, q, state=(1, 2)),
            TypeError,
            "LinearAttentionState",
        ),
        (
            lambda q: variants.linear_attention(
                q,
                q,
                q,
                state=variants.LinearAttentionState(
                    np.zeros((2, 3, 4, 4)), np.zeros((2, 3, 4)), 2.5
                ),
            ),
            TypeError,
            "state.length must be an int",
        ),
        (
            lambda q: variants.linear_attention_step(q[0, 0, 0], np.float32(1), q[0, 0, 0]),
            ValueError,
            r"k must be one token.*got shape \(\)",
        ),  # was IndexError
        (lambda q: variants.linear_attention_step(q, q, q), ValueError, "q must be one token"),
        (
            lambda q: variants.linear_attention_step(q[0, :, 0], q[0, :, 0], q[0, 0, 0]),
            ValueError,
            "must all be",
        ),
    ],
)
def test_variants_errors(rng, call, exc, match):
    with pytest.raises(exc, match=match):
        call(randn(rng, (2, 3, 5, 4)))


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(d_model=8.0), TypeError, "d_model must be an int"),  # was int(8.0)
        (dict(n_heads=True), TypeError, "n_heads must be an int"),
        (dict(seq_len=0), ValueError, "seq_len must be >= 1"),
        (dict(k=2.5), TypeError, "k must be an int"),
        (dict(n_heads=3), ValueError, "multiple of n_heads"),
        (dict(dtype=np.int16), TypeError, "dtype must be float32, float64, float16 or bf"),
    ],
)
def test_linformer_constructor_errors(kw, exc, match):
    args = dict(d_model=8, n_heads=2, seq_len=6, k=3)
    args.update(kw)
    with pytest.raises(exc, match=match):
        variants.Linformer(**args)


def test_linformer_layer_errors(rng):
    layer = variants.Linformer(8, 2, 6, 3, seed=0)
    with pytest.raises(ValueError, match="built for seq_len = 6"):
        layer(randn(rng, (7, 8)))
    with pytest.raises(ValueError, match=r"got shape \(5, 7\)"):
        layer(randn(rng, (5, 7)))
    with pytest.raises(TypeError, match="float32 or float64"):
        layer(np.ones((5, 8), np.int64))
