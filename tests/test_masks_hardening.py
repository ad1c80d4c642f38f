"""The mask objects (masks.py): constructor errors, errors raised inside
``scaled_dot_product_attention``, dense masks in unusual memory layouts,
broadcast views and NaN bias rows (docs/HARDENING.md)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import F32, UNUSUAL_LAYOUTS, assert_close, randn, random_mask

import attn_fast as af
from attn_fast import masks
from attn_fast import reference as ref

# ---------------------------------------------------------------- masks


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: masks.SlidingWindow(-1), ValueError, "left must be >= 0"),
        (lambda: masks.SlidingWindow(2.5), ValueError, "left must be an integer"),
        (lambda: masks.SlidingWindow(True), ValueError, "left must be an integer"),
        (lambda: masks.SlidingWindow(2, -3), ValueError, "right must be >= 0"),
        (lambda: masks.Causal("top"), ValueError, "align must be one of"),
        (
            lambda: masks.BlockSparse(np.ones((2, 2), np.int8), 4),
            TypeError,
            "must be a boolean array",
        ),
        (lambda: masks.BlockSparse(np.ones(4, bool), 4), ValueError, r"got shape \(4,\)"),
        (lambda: masks.BlockSparse(np.ones((2, 2), bool), 0), ValueError, "block_q must be >= 1"),
        (
            lambda: masks.BlockSparse(np.ones((2, 2), bool), 4, 2.0),
            ValueError,
            "block_k must be an integer",
        ),
        (lambda: masks.BlockSparse.local(-3, 4, 1), ValueError, "seq_len must be >= 1"),
        (lambda: masks.BlockSparse.local(16, 4, 0), ValueError, "width must be >= 1"),
        (lambda: masks.BlockSparse.strided(16, 4, 1.5), ValueError, "stride must be an integer"),
        (
            lambda: masks.BlockSparse.global_tokens(16, 4, [7]),
            ValueError,
            "global_blocks must be block indices",
        ),
        (
            lambda: masks.BlockSparse.global_tokens(16, 4, 2.5),
            TypeError,
            "global_blocks must be an int",
        ),  # was [2]
        (
            lambda: masks.BlockSparse.global_tokens(16, 4, [True]),
            TypeError,
            "global_blocks must be an int",
        ),
        (lambda: masks.Dense(np.ones((4, 4), np.int32)), TypeError, "boolean .* or float"),
        (lambda: masks.Dense(np.ones((4, 4), np.complex64)), TypeError, "boolean .* or float"),
        (lambda: masks.Dense(np.float32(1.0)), ValueError, "broadcastable"),
        (lambda: masks.Dense(np.ones((1, 1, 1, 4, 4), bool)), ValueError, "broadcastable"),
    ],
)
def test_mask_constructor_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.parametrize(
    "mask, exc, match",
    [
        (masks.Padding(np.array([3, 9])), ValueError, r"kv_lens must lie in \[0, 7\]"),
        (masks.Padding(np.array([3, -1])), ValueError, r"kv_lens must lie in \[0, 7\]"),
        (masks.Padding(np.array([3, 4, 5])), ValueError, r"shape \(2,\), got shape \(3,\)"),
        (masks.Padding(np.array([3.0, 4.0])), TypeError, "kv_lens must hold integers"),
        (masks.Padding(np.array([True, False])), TypeError, "kv_lens must hold integers"),
        (masks.Padding(3, q_lens=np.array([1, 6])), ValueError, r"q_lens must lie in \[0, 5\]"),
        (masks.BlockSparse(np.ones((1, 1), bool), 4), ValueError, r"covers \(4, 4\) positions"),
        (
            masks.BlockSparse(np.ones((4, 2, 2), bool), 4),
            ValueError,
            r"not broadcastable to \(B, H, nq, nk\)",
        ),
        (
            masks.Dense(np.ones((5, 6), bool)),
            ValueError,
            r"\(5, 6\), not broadcastable to \(B, H, Lq, Lk\)",
        ),
        (masks.Dense(np.zeros((3, 1, 5, 7))), ValueError, r"\(3, 1, 5, 7\), not broadcastable"),
        (masks.Causal("top_left") & masks.SlidingWindow(2), ValueError, "alignment"),
    ],
)
def test_mask_errors_in_sdpa(rng, mask, exc, match):
    q, k = randn(rng, (2, 3, 5, 4)), randn(rng, (2, 3, 7, 4))
    with pytest.raises(exc, match=match):
        af.scaled_dot_product_attention(q, k, k, attn_mask=mask)


@pytest.mark.parametrize("layout", sorted(UNUSUAL_LAYOUTS))
@pytest.mark.parametrize("kind", ["bool", "bias"])
def test_dense_mask_unusual_layouts(rng, layout, kind):
    """Boolean masks and float biases read misaligned, big-endian, reversed,
    Fortran-ordered or read-only, inside Dense and combined with other masks."""
    q, k, v = randn(rng, (2, 3, 9, 5)), randn(rng, (2, 3, 11, 5)), randn(rng, (2, 3, 11, 4))
    if kind == "bool":
        m = random_mask(rng, (3, 9, 11), 0.7)
        want = dict(mask=m & ref.causal_mask(9, 11))
    else:
        m = randn(rng, (3, 9, 11))
        want = dict(bias=m, mask=ref.causal_mask(9, 11))
    lens = np.array([11, 11])
    mask = (
        masks.Dense(UNUSUAL_LAYOUTS[layout](m))
        & masks.Padding(UNUSUAL_LAYOUTS[layout](lens))
        & masks.Causal()
    )
    o, lse = af.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    O, LSE = ref.sdpa(q, k, v, return_lse=True, **want)
    assert_close(o, O, F32)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(LSE))


def test_broadcast_mask_views(rng):
    """Zero-stride (broadcast) mask and bias views: read through their strides."""
    q, k, v = randn(rng, (2, 3, 6, 4)), randn(rng, (2, 3, 8, 4)), randn(rng, (2, 3, 8, 4))
    row = rng.random(8) < 0.6
    row[0] = True
    m = np.broadcast_to(row, (2, 3, 6, 8))
    bias = np.broadcast_to(randn(rng, (1, 8)), (6, 8))
    o = af.scaled_dot_product_attention(q, k, v, attn_mask=[masks.Dense(m), bias])
    assert_close(o, ref.sdpa(q, k, v, mask=m, bias=bias), F32)


@pytest.mark.parametrize("wrap", ["list", "Dense", "Dense & Causal"])
def test_out_sharing_memory_with_a_wrapped_bias(rng, wrap):
    """out overlapping a bias handed over in a list or a Dense object goes through
    a temporary, as it did for a bare bias array (it was overwritten while being read)."""
    L = 48
    q, k, v = randn(rng, (1, 2, L, L)), randn(rng, (1, 2, L, L)), randn(rng, (1, 2, L, L))
    bias = randn(rng, (1, 2, L, L))
    causal = ref.causal_mask(L, L) if "Causal" in wrap else None
    want = ref.sdpa(q, k, v, bias=bias.copy(), mask=causal)
    mask = {
        "list": [bias, np.ones((L, L), bool)],
        "Dense": masks.Dense(bias),
        "Dense & Causal": masks.Dense(bias) & masks.Causal(),
    }[wrap]
    out = bias.swapaxes(-1, -2)  # row i of out is column i of the bias
    assert af.scaled_dot_product_attention(q, k, v, attn_mask=mask, out=out) is out
    assert_close(out, want, F32)


def test_mask_nan_bias_rows(rng):
    """A NaN in a bias makes only the rows that see it NaN; a NaN under False is never read."""
    q, k, v = randn(rng, (1, 2, 5, 4)), randn(rng, (1, 2, 6, 4)), randn(rng, (1, 2, 6, 4))
    bias = randn(rng, (5, 6))
    bias[1, 2] = np.nan
    bias[3, 4] = np.nan
    vis = np.ones((5, 6), bool)
    vis[3, 4] = False
    o = af.scaled_dot_product_attention(q, k, v, attn_mask=[bias, vis])
    assert np.isnan(o[:, :, 1]).all()
    rows = [0, 2, 3, 4]
    assert_close(
        o[:, :, rows], ref.sdpa(q, k, v, bias=np.where(vis, bias, -np.inf))[:, :, rows], F32
    )
