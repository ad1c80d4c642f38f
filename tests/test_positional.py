"""Positional encodings against their written-out formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_fast.positional import RoPE, rope_reference, sinusoidal


# ---------------------------------------------------------------- sinusoidal
@pytest.mark.parametrize("L, D", [(1, 1), (7, 5), (33, 16), (129, 80)])
def test_sinusoidal_formula(L, D):
    pe = sinusoidal(L, D, dtype=np.float64)
    assert pe.shape == (L, D) and pe.dtype == np.float64
    for p in range(L):
        for j in range(D):
            i2 = j - j % 2  # the "2i" of the paper
            angle = p / 10000 ** (i2 / D)
            want = math.sin(angle) if j % 2 == 0 else math.cos(angle)
            assert abs(pe[p, j] - want) < 1e-12, (p, j)


def test_sinusoidal_offset_and_batch():
    full = sinusoidal(40, 12, base=500.0, dtype=np.float64)
    np.testing.assert_array_equal(
        sinusoidal(5, 12, base=500.0, offset=30, dtype=np.float64), full[30:35]
    )
    per = sinusoidal(5, 12, base=500.0, offset=np.array([0, 30, 7]), dtype=np.float64)
    assert per.shape == (3, 5, 12)
    for b, o in enumerate([0, 30, 7]):
        np.testing.assert_array_equal(per[b], full[o : o + 5])
    assert sinusoidal(4, 6).dtype == np.float32


def test_sinusoidal_errors():
    with pytest.raises(ValueError, match="D >= 1"):
        sinusoidal(3, 0)
    with pytest.raises(TypeError, match="offset"):
        sinusoidal(3, 4, offset=1.5)


# ---------------------------------------------------------------- RoPE
def rope_written_out(x, positions, base, r, interleaved):
    """Per-pair loops with math.cos / math.sin: x (L, d) at positions (L,)."""
    y = np.array(x, dtype=np.float64)
    L, d = x.shape
    for t in range(L):
        for i in range(r // 2):
            theta = base ** (-2 * i / r)
            ang = positions[t] * theta
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
            xa, xb = float(x[t, a]), float(x[t, b])
            y[t, a] = xa * math.cos(ang) - xb * math.sin(ang)
            y[t, b] = xb * math.cos(ang) + xa * math.sin(ang)
    return y


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("d, r", [(2, 2), (8, 8), (10, 6), (80, 80), (64, 32), (5, 4), (6, 0)])
def test_rope_against_formula(rng, interleaved, d, r):
    base = 10000.0 if d != 80 else 500000.0
    L = 9
    x = rng.standard_normal((L, d))
    pos = np.arange(L) + 1000
    want = rope_written_out(x, pos, base, r, interleaved)
    rope = RoPE(d, base=base, rotary_dim=r, interleaved=interleaved)
    got = rope(x, offset=1000, seq_axis=-2)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(
        rope_reference(x, pos, base=base, rotary_dim=r, interleaved=interleaved),
        want,
        rtol=1e-9,
        atol=1e-9,
    )
    # float32: computed in float32, to float32 accuracy
    got32 = rope(x.astype(np.float32), positions=pos, seq_axis=-2)
    assert got32.dtype == np.float32
    np.testing.assert_allclose(got32, want, rtol=1e-5, atol=1e-5)
    if r < d:
        np.testing.assert_array_equal(got[:, r:], x[:, r:])  # pass-through features


@given(
    m=st.integers(0, 5000),
    n=st.integers(0, 5000),
    shift=st.integers(0, 5000),
    interleaved=st.booleans(),
    seed=st.integers(0, 2**31),
)
@settings(max_examples=60, deadline=None)
def test_rope_score_depends_on_distance_only(m, n, shift, interleaved, seed):
    """<R(m) q, R(n) k> = <R(m+s) q, R(n+s) k>: only m - n matters."""
    g = np.random.default_rng(seed)
    d = 16
    q, k = g.standard_normal((1, d)), g.standard_normal((1, d))
    rope = RoPE(d, interleaved=interleaved)
    s1 = (rope(q, offset=m, seq_axis=-2) @ rope(k, offset=n, seq_axis=-2).T).item()
    s2 = (rope(q, offset=m + shift, seq_axis=-2) @ rope(k, offset=n + shift, seq_axis=-2).T).item()
    assert abs(s1 - s2) <= 1e-8 * (1 + abs(s1))
    # and a rotation keeps lengths
    assert abs(np.linalg.norm(rope(q, offset=m, seq_axis=-2)) - np.linalg.norm(q)) < 1e-10


def test_rope_layouts_and_modes(rng):
    B, L, H, d = 2, 7, 3, 10
    rope = RoPE(d, rotary_dim=8, interleaved=False)
    x = rng.standard_normal((B, L, H, d)).astype(np.float32)
    want = np.stack(
        [
            np.stack(
                [rope_reference(x[b, :, h], np.arange(L) + 4, rotary_dim=8) for h in range(H)], 1
            )
            for b in range(B)
        ]
    )
    a = rope(x, offset=4)  # (B, L, H, d), seq_axis=-3
    np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-5)
    # (B, H, L, d) as a transposed, non-contiguous view
    xt = x.transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(rope(xt, offset=4, seq_axis=-2), a.transpose(0, 2, 1, 3))
    # in place on a strided view, and out=
    y = x.copy()
    r = rope(y.transpose(0, 2, 1, 3), offset=4, seq_axis=2, inplace=True)
    assert np.shares_memory(r, y)
    np.testing.assert_array_equal(y, a)
    buf = np.full_like(x, np.nan)
    assert rope(x, offset=4, out=buf) is buf
    np.testing.assert_array_equal(buf, a)
    np.testing.assert_array_equal(x, x.copy())  # input untouched


def test_rope_per_sequence_offsets_and_positions(rng):
    B, L, H, d = 3, 5, 2, 8
    rope = RoPE(d, interleaved=True)
    x = rng.standard_normal((B, L, H, d))
    offs = np.array([0, 17, 3])
    got = rope(x, offset=offs)
    for b in range(B):
        np.testing.assert_allclose(got[b], rope(x[b], offset=int(offs[b])), rtol=1e-12, atol=1e-12)
    pos = offs[:, None] + np.arange(L)
    np.testing.assert_array_equal(rope(x, positions=pos), got)
    # a ring buffer: arbitrary positions per token
    ring = np.array([7, 8, 9, 2, 3])
    got1 = rope(x, positions=ring)
    for t in range(L):
        np.testing.assert_allclose(
            got1[:, t], rope(x[:, t : t + 1], offset=int(ring[t]))[:, 0], rtol=1e-12, atol=1e-12
        )


def test_rope_tables_cached_and_grow():
    rope = RoPE(16)
    c1, _ = rope.cos_sin(10)
    c2, _ = rope.cos_sin(10)
    assert np.shares_memory(c1, c2)  # the same table, not recomputed
    big_c, big_s = rope.cos_sin(5000)  # grows
    assert big_c.shape == (5000, 8)
    ang = 4999 * 10000.0 ** (-np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(big_c[4999], np.cos(ang), rtol=1e-12)
    np.testing.assert_allclose(big_s[4999], np.sin(ang), rtol=1e-12)
    np.testing.assert_array_equal(big_c[:10], c1)


def test_rope_errors(rng):
    with pytest.raises(ValueError, match="rotary_dim"):
        RoPE(8, rotary_dim=5)
    with pytest.raises(ValueError, match="rotary_dim"):
        RoPE(8, rotary_dim=10)
    rope = RoPE(8)
    with pytest.raises(ValueError, match=r"head_dim = 8"):
        rope(rng.standard_normal((2, 3, 6)))
    with pytest.raises(TypeError, match="float"):
        rope(np.ones((3, 8), dtype=np.int32), seq_axis=-2)
    with pytest.raises(ValueError, match="positions must have shape"):
        rope(rng.standard_normal((4, 8)), positions=np.arange(3), seq_axis=-2)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        rope(rng.standard_normal((4, 8)), offset=-1, seq_axis=-2)
    with pytest.raises(ValueError, match="seq_axis"):
        rope(rng.standard_normal((4, 8)), seq_axis=-1)
    with pytest.raises(ValueError, match="sequences"):
        rope(rng.standard_normal((2, 4, 1, 8)), offset=np.array([1, 2, 3]))
    ro = rng.standard_normal((4, 8))
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        rope(ro, seq_axis=-2, inplace=True)
