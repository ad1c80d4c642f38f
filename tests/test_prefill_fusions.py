"""The prefill kernel's fused steps give the bits of the unfused ones.

flash_fwd.cpp packs unit-stride rows with register transposes (fp32 Q and K;
the bf16 pairs of Q, K and V on the vdpbf16ps path) and element by element
otherwise; on a tile that no mask or score transform touches it takes the row
max from the QK micro-kernel's store instead of a pass over S, and on the
vdpbf16ps path it rounds P to bf16 inside the softmax instead of a pass after
it. Each of these is meant to change no bit, so the tests compare the fast
layout / tile against the slow one bit for bit, on every ISA, and both against
the float64 oracle:

- the same values as contiguous rows, as rows with padding between them
  (unit stride, not dense) and as a last axis of stride 2 (the element loops);
- the same scores with and without an additive mask of zeros (a transform:
  the tile then takes the unfused max and softmax), on whole tiles and on
  tiles the causal mask, windows or the padding columns cut.

One path is not bit for bit on purpose: the AMX tile path (amx, and amx_emu,
its emulation) with bf16 inputs and no transform keeps S unscaled and folds
the scale into the softmax's exponent, with the degree-4 exp2 of bf16 weights
(flash_fwd.cpp, raw scores), where a transform takes the scaled scores. There
the two agree to one bf16 rounding of O and lse to 1e-5 (same_result).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, f64, ml_dtypes, need, strided, torch

import attn_fast as af
from attn_fast import masks
from attn_fast import reference as ref

sdpa = af.scaled_dot_product_attention

# (L, d, dv): tails of the 16-key groups and 64-key panels, d below / above the
# 32 dims of one pair transpose and not a multiple of it, dv below one 16-wide strip.
SHAPES = [(1, 64, 64), (7, 33, 17), (17, 32, 16), (129, 80, 80), (64, 95, 40), (70, 256, 5)]


def padded_rows(x):
    """`x` (..., L, d) as a view whose rows are 3 elements apart beyond d (unit stride)."""
    buf = np.zeros(x.shape[:-1] + (x.shape[-1] + 3,), x.dtype)
    buf[..., : x.shape[-1]] = x
    return buf[..., : x.shape[-1]]


def as_source(x, src):
    """float32 NumPy `x` as `src`: float32 NumPy, ml_dtypes.bfloat16 NumPy or torch.bfloat16."""
    if src == "float32":
        return np.asarray(x, np.float32)
    if src == "ml_bf16":
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16)


def relaid(x, src, layout):
    """The values of `x` in `src`, laid out as `layout` (contiguous, padded, strided)."""
    if layout == "contiguous":
        return as_source(x, src)
    if src == "torch_bf16":
        t = as_source(x, src)
        if layout == "padded":
            buf = torch.zeros(t.shape[:-1] + (t.shape[-1] + 3,), dtype=t.dtype)
            buf[..., : t.shape[-1]] = t
            return buf[..., : t.shape[-1]]
        buf = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)
        buf[..., ::2] = t
        return buf[..., ::2]
    y = as_source(x, src)
    return padded_rows(y) if layout == "padded" else strided(y)


def raw_scores_path(isa, src):
    """Whether a bf16 call without a score transform takes the tile path's raw-score softmax."""
    return isa in ("amx", "amx_emu") and src != "float32"


def same_result(isa, src, o1, lse1, o2, lse2):
    """o1/lse1 (no transform) against o2/lse2 (a zero bias): the same bits, except on the
    raw-score tile path (one bf16 rounding of O apart, lse to 1e-5; NaN where NaN)."""
    if not raw_scores_path(isa, src):
        np.testing.assert_array_equal(bits(o1), bits(o2))
        np.testing.assert_array_equal(np.asarray(lse1), np.asarray(lse2))
        return
    a, b = f64(o1), f64(o2)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_allclose(a, b, rtol=2.0**-7, atol=2.0**-9)
    np.testing.assert_allclose(np.asarray(lse1), np.asarray(lse2), rtol=1e-5, atol=1e-5)


def bits(o):
    """A result as a NumPy array of its raw bits."""
    if torch is not None and isinstance(o, torch.Tensor):
        return o.view(torch.int16).numpy().copy()
    o = np.asarray(o)
    return o.view(np.uint16 if o.itemsize == 2 else np.uint32).copy()


def rounded(rng, src, *shapes):
    """Standard normal float32 inputs, rounded to bf16 when `src` is a bf16 source."""
    out = []
    for s in shapes:
        x = rng.standard_normal(s).astype(np.float32)
        out.append(f64(as_source(x, src)).astype(np.float32) if src != "float32" else x)
    return out


SOURCES = ["float32", "ml_bf16", "torch_bf16"]


def skip_missing(src):
    if src != "float32":
        need(src)


def check_oracle(o, q, k, v, src, causal):
    L = q.shape[-2]
    want = ref.sdpa(f64(q), f64(k), f64(v), mask=ref.causal_mask(L, L) if causal else None)
    if src == "float32":
        assert_close(o, want, np.float32)
    else:  # one rounding of O and of P to bf16 (tests/test_dtypes.py)
        got = f64(o)
        A = ref.sdpa(f64(q), f64(k), np.abs(f64(v)), mask=ref.causal_mask(L, L) if causal else None)
        bad = ~(np.abs(got - want) <= 2.0**-8 * (np.abs(want) + A) + 2e-5)
        assert not bad.any(), f"{bad.sum()} of {bad.size} off"


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L, d, dv", SHAPES)
def test_row_layouts_give_the_same_bits(isa, rng, src, causal, L, d, dv):
    """Contiguous, padded-row and stride-2 inputs: the packed panels, so every bit, agree."""
    skip_missing(src)
    q, k, v = rounded(rng, src, (2, 3, L, d), (2, 3, L, d), (2, 3, L, dv))
    outs = {}
    for layout in ["contiguous", "padded", "strided"]:
        o = sdpa(
            relaid(q, src, layout),
            relaid(k, src, layout),
            relaid(v, src, layout),
            is_causal=causal,
        )
        outs[layout] = bits(o)
    np.testing.assert_array_equal(outs["padded"], outs["contiguous"])
    np.testing.assert_array_equal(outs["strided"], outs["contiguous"])
    check_oracle(
        sdpa(as_source(q, src), as_source(k, src), as_source(v, src), is_causal=causal),
        q,
        k,
        v,
        src,
        causal,
    )


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L, d", [(64, 64), (129, 5), (256, 80), (320, 64), (300, 128)])
def test_zero_bias_changes_no_bit(isa, rng, src, causal, L, d):
    """A tile with an additive mask of zeros takes the unfused row max and softmax; without
    it, whole tiles take the fused ones: the same bits (and lse), and the oracle's values."""
    skip_missing(src)
    q, k, v = rounded(rng, src, (1, 2, L, d), (1, 2, L, d), (1, 2, L, d))
    # Scores spread so that the row max moves between key blocks and lies in any panel.
    q = q * np.float32(2.0)
    Q, K, V = (as_source(x, src) for x in (q, k, v))
    o1, lse1 = sdpa(Q, K, V, is_causal=causal, return_lse=True)
    zero = np.zeros((L, L), np.float32)
    o2, lse2 = sdpa(Q, K, V, attn_mask=zero, is_causal=causal, return_lse=True)
    same_result(isa, src, o1, lse1, o2, lse2)
    check_oracle(o1, q, k, v, src, causal)


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("window", [(40, 0), (100, 30), (None, 60), (7, 7)])
@pytest.mark.parametrize("L", [129, 300])
def test_zero_bias_changes_no_bit_under_windows(isa, rng, src, window, L):
    """Sliding windows cut tiles on both sides (the fused max counts only each row's visible
    columns [lo, hi), rows with none left at -inf): the bits of the unfused path."""
    skip_missing(src)
    d = 64
    q, k, v = rounded(rng, src, (1, 2, L, d), (1, 2, L, d), (1, 2, L, d))
    Q, K, V = (as_source(x, src) for x in (q, k, v))
    o1, lse1 = sdpa(Q, K, V, window_size=window, return_lse=True)
    zero = np.zeros((L, L), np.float32)
    o2, lse2 = sdpa(Q, K, V, attn_mask=zero, window_size=window, return_lse=True)
    same_result(isa, src, o1, lse1, o2, lse2)
    left, right = (L if w is None else w for w in window)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    vis = (j >= i - left) & (j <= i + right)
    want = ref.sdpa(f64(q), f64(k), f64(v), mask=vis)
    tol = 2e-5 if src == "float32" else 2.0**-7
    np.testing.assert_allclose(f64(o1), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("src", SOURCES)
def test_fused_tiles_with_nan_query_and_padding_keys(isa, rng, src):
    """Keys past kv_len = 128 hold NaN in K and V (never packed: the tile stops at the last
    visible key, a whole panel, so it stays fused); one query row holds a NaN (its scores
    are NaN, so is its row): the bits of the unfused path, the oracle's values elsewhere."""
    skip_missing(src)
    L, d, n = 192, 64, 128
    q, k, v = rounded(rng, src, (1, 2, L, d), (1, 2, L, d), (1, 2, L, d))
    k[..., n:, :] = np.nan
    v[..., n:, :] = np.nan
    q[0, 1, 5, 3] = np.nan
    Q, K, V = (as_source(x, src) for x in (q, k, v))
    pad = masks.Padding(kv_lens=[n], q_lens=[L])
    o1, lse1 = sdpa(Q, K, V, attn_mask=pad, return_lse=True)
    zero = np.zeros((1, 2, L, L), np.float32)
    o2, lse2 = sdpa(Q, K, V, attn_mask=[zero, pad], return_lse=True)
    same_result(isa, src, o1, lse1, o2, lse2)
    got, lse = f64(o1), np.asarray(lse1)
    assert np.isnan(got[0, 1, 5]).all() and np.isnan(lse[0, 1, 5])
    got[0, 1, 5] = 0.0
    want = ref.sdpa(f64(q), f64(k)[..., :n, :], f64(v)[..., :n, :])
    want[0, 1, 5] = 0.0
    tol = 2e-5 if src == "float32" else 2.0**-7
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
