"""The shared test helpers catch what they are there to catch (tests/helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    LAYOUTS,
    assert_attention,
    assert_close,
    assert_lse_close,
    poisoned,
    qkv,
    randn,
    random_bias,
    random_mask,
    relayout,
    run_sdpa,
    tol,
)

from attn_fast import reference as ref


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_assert_close_names_the_worst_entry(rng, dtype):
    want = rng.standard_normal((2, 3, 4))
    got = want.astype(dtype)
    assert_close(got, want, dtype)  # within tolerance: passes
    off = 50 * tol(dtype)["atol"] + 50 * tol(dtype)["rtol"] * abs(want[1, 2, 3])
    got[1, 2, 3] += off
    got[0, 0, 0] += off / 10
    with pytest.raises(AssertionError, match=r"out: 2 of 24 entries .* index \(1, 2, 3\)"):
        assert_close(got, want, dtype)
    assert_close(got, want, dtype, where=np.arange(24).reshape(2, 3, 4) > 100)  # none compared


def test_assert_close_nan_and_inf_must_face_their_own_kind():
    assert_close(np.array([np.nan, np.inf, -np.inf]), np.array([np.nan, np.inf, -np.inf]))
    for got, want in [(np.nan, 1.0), (1.0, np.nan), (np.inf, -np.inf), (np.inf, 1e308)]:
        with pytest.raises(AssertionError, match="index"):
            assert_close(np.array([0.0, got]), np.array([0.0, want]))
    with pytest.raises(AssertionError, match="shape"):
        assert_close(np.zeros((2, 3)), np.zeros((3, 2)))


def test_assert_lse_close_checks_the_fully_masked_rows():
    LSE = np.array([[0.5, -np.inf], [1.0, 2.0]])
    assert_lse_close(LSE.astype(np.float32), LSE, np.float32)
    with pytest.raises(AssertionError, match=r"-inf .* index \(1, 0\)"):
        assert_lse_close(np.array([[0.5, -np.inf], [-np.inf, 2.0]]), LSE)
    with pytest.raises(AssertionError, match=r"-inf .* index \(0, 1\)"):
        assert_lse_close(np.array([[0.5, 0.0], [1.0, 2.0]]), LSE)
    with pytest.raises(AssertionError, match="not finite"):
        assert_lse_close(np.array([[0.5, -np.inf], [np.nan, 2.0]]), LSE)
    with pytest.raises(AssertionError, match=r"lse: 1 of 4"):
        assert_lse_close(np.array([[0.5, -np.inf], [1.0, 2.1]]), LSE)
    with pytest.raises(AssertionError, match="out"):
        assert_attention(np.ones(3), None, np.zeros(3), None)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_keep_the_values(rng, layout):
    a = randn(rng, (2, 3, 5, 4), np.float64)
    b = relayout(a, layout)
    assert b.shape == a.shape
    np.testing.assert_array_equal(b, a)
    if layout in ("transposed", "strided", "neg_stride"):
        assert not b.flags.c_contiguous
    with pytest.raises(ValueError, match="layout"):
        relayout(a, "diagonal")


def test_qkv_shapes_dtype_and_seed(rng):
    q, k, v = qkv(rng, 2, 4, 2, 7, 9, 5, 3, np.float64, layout="transposed")
    assert (q.shape, k.shape, v.shape) == ((2, 4, 7, 5), (2, 2, 9, 5), (2, 2, 9, 3))
    assert q.dtype == k.dtype == v.dtype == np.float64 and not q.flags.c_contiguous
    again = qkv(np.random.default_rng(1), Lq=1, d=1, dv=1)
    same = qkv(np.random.default_rng(1), Lq=1, d=1, dv=1)
    for a, b in zip(again, same):
        np.testing.assert_array_equal(a, b)
    assert again[0].shape == (2, 3, 1, 1) and again[1].shape == (2, 3, 11, 1)


def test_poisoned_and_run_sdpa(rng):
    p = poisoned((2, 3), np.float32)
    assert p.dtype == np.float32 and np.isnan(p).all()
    q, k, v = qkv(rng, 1, 2, 1, 7, 129, 80, 5, np.float32)
    o, lse = run_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert o.shape == (1, 2, 7, 5) and lse.shape == (1, 2, 7)
    O, LSE = ref.sdpa(q, k, v, mask=ref.causal_mask(7, 129), return_lse=True)
    assert_attention(o, lse, O, LSE, np.float32)


def test_random_mask_and_bias(rng):
    m = random_mask(rng, (2, 3, 129, 7), 0.5, dead_rows=[0, 128])
    assert m.dtype == bool and m.shape == (2, 3, 129, 7)
    assert not m[..., [0, 128], :].any() and m[..., 1:128, :].any(axis=-1).mean() > 0.9
    assert 0.4 < m[..., 1:128, :].mean() < 0.6
    assert random_mask(rng, 11).shape == (11,)
    b = random_bias(rng, (64, 65), 0.25, np.float32)
    assert b.dtype == np.float32 and 0.15 < np.isneginf(b).mean() < 0.35
    assert np.isfinite(b[~np.isneginf(b)]).all()
