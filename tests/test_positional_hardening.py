"""The positional encodings (positional.py): ``sinusoidal`` and ``RoPE``
argument errors, unusual and misaligned layouts, and non-finite values that
stay in their own row (docs/HARDENING.md)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    UNUSUAL_LAYOUTS,
    assert_close,
    misaligned,
    randn,
    readonly,
)

from attn_fast import positional

# ---------------------------------------------------------------- positional


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(L=2.5, D=4), TypeError, "L must be an int"),  # was silently int(2.5) = 2 rows
        (dict(L=True, D=4), TypeError, "L must be an int"),
        (dict(L=3, D=np.float64(4)), TypeError, "D must be an int"),
        (dict(L=-1, D=4), ValueError, "L >= 0"),
        (dict(L=3, D=0), ValueError, "D >= 1"),
        (dict(L=3, D=4, base=0.0), ValueError, "base must be > 0"),  # was a NaN table
        (dict(L=3, D=4, base=np.nan), ValueError, "base must be finite"),
        (dict(L=3, D=4, base="1e4"), TypeError, "base must be a real number"),
        (
            dict(L=3, D=4, dtype=np.int32),
            TypeError,
            "dtype must be float32, float64, float16 or bfloat16",
        ),  # was truncated to ints
        (
            dict(L=3, D=4, dtype=np.complex64),
            TypeError,
            "dtype must be float32, float64, float16 or bfloat16",
        ),
        (dict(L=3, D=4, offset=1.5), TypeError, "offset"),
        (dict(L=3, D=4, offset=np.array([True])), TypeError, "offset"),
        (dict(L=3, D=4, offset=np.zeros((2, 2), int)), ValueError, "offset"),
    ],
)
def test_sinusoidal_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        positional.sinusoidal(**kw)


def test_sinusoidal_zero_length_and_offsets():
    assert positional.sinusoidal(0, 5).shape == (0, 5)
    pe = positional.sinusoidal(4, 5, offset=np.array([0, 7], np.uint8), dtype=F64)
    p = np.array([[0, 1, 2, 3], [7, 8, 9, 10]], F64)[..., None]
    i = np.arange(0, 5, 2)
    np.testing.assert_allclose(
        pe[..., 0::2], np.sin(p / 10000.0 ** (i / 5)), rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(
        pe[..., 1::2], np.cos(p / 10000.0 ** (i[:2] / 5)), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(head_dim=8.0), TypeError, "head_dim must be an int"),  # was int(8.0)
        (dict(head_dim=True), TypeError, "head_dim must be an int"),
        (dict(head_dim=0), ValueError, "head_dim must be >= 1"),
        (dict(head_dim=8, rotary_dim=4.0), TypeError, "rotary_dim must be an int"),
        (dict(head_dim=8, rotary_dim=3), ValueError, "rotary_dim must be even"),
        (dict(head_dim=8, rotary_dim=10), ValueError, "rotary_dim must be even"),
        (dict(head_dim=8, base=1.0), ValueError, "base must be > 1"),
        (dict(head_dim=8, base=np.nan), ValueError, "base must be finite"),
        (dict(head_dim=8, base=None), TypeError, "base must be a real number"),
    ],
)
def test_rope_constructor_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        positional.RoPE(**kw)


@pytest.mark.parametrize("layout", sorted(UNUSUAL_LAYOUTS))
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_unusual_layouts(rng, layout, interleaved):
    x = randn(rng, (2, 7, 3, 8))
    rope = positional.RoPE(8, interleaved=interleaved, rotary_dim=6)
    want = positional.rope_reference(
        x.transpose(0, 2, 1, 3), np.arange(5, 12), rotary_dim=6, interleaved=interleaved
    ).transpose(0, 2, 1, 3)
    got = rope(UNUSUAL_LAYOUTS[layout](x), offset=5)
    assert_close(got, want, F32)
    q, k = rope.rotate_qk(
        UNUSUAL_LAYOUTS[layout](x), UNUSUAL_LAYOUTS[layout](x[:, :, :1]), offset=5
    )
    assert_close(q, want, F32)
    assert_close(k, want[:, :, :1], F32)


def test_rope_misaligned_in_place(rng):
    x = randn(rng, (5, 2, 4), F64)
    y = misaligned(x)
    rope = positional.RoPE(4)
    assert rope(y, inplace=True) is y
    assert_close(
        y, positional.rope_reference(x.transpose(1, 0, 2), np.arange(5)).transpose(1, 0, 2), F64
    )


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda r, x: r(x.astype(np.int32)), TypeError, "must be a float array"),
        (lambda r, x: r(x.astype(np.complex64)), TypeError, "must be a float array"),
        (
            lambda r, x: r(x[..., :4]),
            ValueError,
            r"shape \(2, 5, 3, 4\), expected last axis head_dim = 8",
        ),
        (lambda r, x: r(x[0, 0, 0]), ValueError, "expected last axis"),
        (lambda r, x: r(x, seq_axis=3), ValueError, "seq_axis=3"),
        (lambda r, x: r(x, offset=-1), ValueError, "offset must be >= 0"),
        (lambda r, x: r(x, offset=1.5), TypeError, "offset must be an int"),
        (lambda r, x: r(x, offset=np.array([1, 2, 3])), ValueError, "3 sequences"),
        (lambda r, x: r(x, positions=np.arange(4)), ValueError, "positions must have shape"),
        (lambda r, x: r(x, positions=np.arange(5.0)), TypeError, "positions must be an int array"),
        (lambda r, x: r(x, positions=-np.arange(5)), ValueError, "positions must be >= 0"),
        (
            lambda r, x: r(x, offset=np.uint64(2**64 - 1)),
            ValueError,
            "offset \\+ L must be <=",
        ),  # was OverflowError
        (lambda r, x: r(x, offset=2**62), ValueError, "offset \\+ L must be <="),
        (lambda r, x: r(x, offset=np.array([0, 2**40])), ValueError, "offset \\+ L must be <="),
        (lambda r, x: r(x, positions=np.full(5, 2**40)), ValueError, "positions must be <"),
        (lambda r, x: r(x, out=readonly(x)), ValueError, "out is read-only"),
        (lambda r, x: r(x, out=x[..., :4]), ValueError, "out has shape"),
        (lambda r, x: r(readonly(x), inplace=True), ValueError, "read-only"),
        (lambda r, x: r(x, out=np.empty_like(x), inplace=True), ValueError, "either inplace"),
        (
            lambda r, x: r(
                x, out=np.lib.stride_tricks.as_strided(np.zeros(8, F32), x.shape, (0, 0, 0, 4))
            ),
            ValueError,
            "out has overlapping memory",
        ),  # was written by racing threads
        (
            lambda r, x: r(
                np.lib.stride_tricks.as_strided(x, x.shape, (0, 32, 0, 4)), inplace=True
            ),
            ValueError,
            "overlapping memory",
        ),
        (
            lambda r, x: r.rotate_qk(x, x.astype(F64)),
            TypeError,
            "q has dtype float32 but k has dtype float64",
        ),
        (lambda r, x: r.rotate_qk(x, x[:, :4]), ValueError, "positions differ"),
    ],
)
def test_rope_call_errors(rng, call, exc, match):
    with pytest.raises(exc, match=match):
        call(positional.RoPE(8), randn(rng, (2, 5, 3, 8)))


def test_rope_nonfinite_stays_in_its_row(rng):
    x = randn(rng, (6, 2, 8))
    x[3, 1, 2] = np.nan
    x[4, 0, 6] = np.inf
    y = positional.RoPE(8)(x)
    bad = ~np.isfinite(y)
    assert bad[3, 1].any() and bad[4, 0].any()
    bad[3, 1] = bad[4, 0] = False
    assert not bad.any()  # every other (position, head) row stays finite
