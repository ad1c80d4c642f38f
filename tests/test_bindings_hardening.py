"""The C++ bindings called directly (``attn_fast._core``, bindings.cpp) on bad input:
shapes, dtypes, cu_seqlens and length arrays are checked at the boundary and
raise ValueError/TypeError naming the argument (docs/HARDENING.md)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    assert_close,
    misaligned,
    randn,
    readonly,
)

from attn_fast import _core
from attn_fast import reference as ref

# ---------------------------------------------------------------- the bindings, called directly


def _core_args(rng, B=2, H=2, Lq=5, Lk=7, d=4):
    q, k, v = randn(rng, (B, H, Lq, d)), randn(rng, (B, H, Lk, d)), randn(rng, (B, H, Lk, d))
    return q, k, v, np.empty((B, H, Lq, d), F32)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (
            dict(mask=np.ones((1, 1, 1, 1), np.uint8)),
            ValueError,
            r"mask has shape \(1, 1, 1, 1\), expected \(2, 2, 5, 7\)",
        ),
        (dict(mask=np.ones((2, 2, 5, 6), np.uint8)), ValueError, "mask has shape"),
        (dict(mask=np.ones((2, 2, 5, 7), bool)), TypeError, "mask must be uint8"),
        (dict(bias=np.zeros((2, 2, 4, 7), F32)), ValueError, r"bias has shape \(2, 2, 4, 7\)"),
        (dict(bias=np.zeros((2, 1, 5, 7), F32)), ValueError, "bias has shape"),
        (dict(bias=np.zeros((2, 2, 5, 7), F64)), TypeError, "bias must have q's dtype"),
        (
            dict(layout=np.ones((2, 2, 1, 1), np.uint8), layout_bq=4, layout_bk=4),
            ValueError,
            "layout has shape",
        ),
        (
            dict(layout=np.ones((1, 2, 2, 2), np.uint8), layout_bq=4, layout_bk=4),
            ValueError,
            "layout has shape",
        ),
        (
            dict(layout=np.ones((2, 2, 2, 2), np.uint8), layout_bq=0, layout_bk=4),
            ValueError,
            ">= 1",
        ),
        (
            dict(layout=np.ones((2, 2, 1, 1), np.uint8), layout_bq=2**62, layout_bk=2**62 + 1),
            None,
            None,
        ),
        (dict(q_lens=np.array([1, 2, 3])), ValueError, "q_lens: expected 2 elements"),
        (dict(kv_lens=np.array([1.0, 2.0])), TypeError, "kv_lens"),
        (dict(kv_lens=np.array([1, 2], np.int32)), TypeError, "kv_lens"),
        (dict(alibi=np.ones(3, F32)), ValueError, "alibi_slopes: expected 2 elements"),
        (dict(sinks=np.ones(2, F64)), TypeError, "sinks"),
        (dict(lse=np.empty((2, 2, 4), F32)), ValueError, "lse must be"),
        (dict(cu_q=np.array([0, 5])), ValueError, "cu_seqlens_q needs cu_seqlens_k"),
        (dict(cu_k=np.array([0, 7])), ValueError, "cu_seqlens_k needs cu_seqlens_q"),
        (dict(window_left=2**63 - 1, window_right=2**63 - 1), None, None),  # clamped: no overflow
    ],
)
def test_core_forward_checks_shapes(rng, kw, exc, match):
    q, k, v, o = _core_args(rng)
    if exc is None:
        _core.forward(q, k, v, o, scale=0.5, **kw)
        assert_close(o, ref.sdpa(q, k, v, scale=0.5), F32)
        return
    with pytest.raises(exc, match=match):
        _core.forward(q, k, v, o, scale=0.5, **kw)


@pytest.mark.parametrize(
    "cu_q, cu_k, match",
    [
        ([0, 3, 9], [0, 4, 7], r"cu_seqlens_q must be non-decreasing within \[0, 5\]"),
        ([0, 3, 5], [0, 8, 7], r"cu_seqlens_k must be non-decreasing within \[0, 7\]"),
        ([0, 3, 5], [-1, 4, 7], "cu_seqlens_k"),
        ([0, 3, 5], [0, 7], "cu_seqlens_k: expected 3 elements"),
        ([], [0], "cu_seqlens_q is empty"),
    ],
)
def test_core_forward_checks_cu_seqlens(rng, cu_q, cu_k, match):
    q, k, v, o = _core_args(rng, B=1)
    with pytest.raises(ValueError, match=match):
        _core.forward(
            q, k, v, o, scale=0.5, cu_q=np.array(cu_q, np.int64), cu_k=np.array(cu_k, np.int64)
        )


def test_core_forward_varlen_batch(rng):
    q, _, _, o = _core_args(rng, B=1)
    k = randn(rng, (0, 2, 7, 4))  # k with no batch entry to read from
    with pytest.raises(ValueError, match="batch 1"):
        _core.forward(q, k, k, o, scale=0.5, cu_q=np.array([0, 5]), cu_k=np.array([0, 7]))


def test_core_misaligned_lengths(rng):
    q, k, v, o = _core_args(rng)
    lens = misaligned(np.array([3, 7], np.int64))
    with pytest.raises((ValueError, TypeError), match="kv_lens"):
        _core.forward(q, k, v, o, scale=0.5, kv_lens=lens)
    with pytest.raises((ValueError, TypeError), match="kv_lens"):
        _core.decode(q, k, v, o, scale=0.5, kv_lens=lens)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(q_lens=np.array([1])), ValueError, "q_lens: expected 2 elements"),
        (dict(kv_lens=np.array([1, 2, 3])), ValueError, "kv_lens: expected 2 elements"),
        (dict(kv_start=np.array([0, 7])), ValueError, r"kv_start entries must lie in \[0, R\)"),
        (dict(kv_start=np.array([-1, 0])), ValueError, "kv_start"),
        (dict(kv_start=np.array([0.0, 0.0])), TypeError, "kv_start"),
        (dict(lse=np.empty((2, 2, 5), F64)), ValueError, "lse must be"),
        (dict(split=2**62), None, None),  # a split longer than the keys: one split
        (dict(window_left=2**63 - 1), None, None),
    ],
)
def test_core_decode_checks(rng, kw, exc, match):
    q, k, v, o = _core_args(rng)
    if exc is None:
        _core.decode(q, k, v, o, scale=0.5, **kw)
        assert_close(o, ref.sdpa(q, k, v, scale=0.5), F32)
        return
    with pytest.raises(exc, match=match):
        _core.decode(q, k, v, o, scale=0.5, **kw)


def test_core_shape_mismatch(rng):
    q, k, v, o = _core_args(rng)
    with pytest.raises(ValueError, match="inconsistent"):
        _core.forward(q, k, v[:, :, :3], o, scale=0.5)
    with pytest.raises(ValueError, match="inconsistent"):
        _core.decode(q, k[:1], v[:1], o, scale=0.5)
    with pytest.raises(ValueError, match="4-D"):
        _core.forward(q[0], k[0], v[0], o[0], scale=0.5)
    with pytest.raises(ValueError, match="read-only"):
        _core.forward(q, k, v, readonly(o), scale=0.5)
    with pytest.raises(TypeError, match="one dtype"):
        _core.decode(q, k.astype(F64), v, o, scale=0.5)
