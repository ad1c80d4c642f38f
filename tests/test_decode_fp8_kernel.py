"""fp8 K/V rows through the decode binding (the kernel side of the fp8 encoding).

``_core.decode`` with uint8 k / v codes and ``encoding="e4m3"`` (OCP, ml_dtypes.float8_e4m3fn) or
``"e5m2"`` (ml_dtypes.float8_e5m2), one float32 scale per token and kv head (k_scale, v_scale
(B, H_kv, R)): the stored values are decode(code) * scale, decoded exactly. Oracle: the float64
attention (tests/oracle.py) over those stored values, on every ISA (ATTN_FAST_ISA).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import tol
from oracle import causal_mask, sdpa

from attn_fast import _core

F32 = np.float32
FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def quantize(rng, shape, fmt):
    """Codes and per-token scales of N(0, 1) rows, as a cache stores them: scale = max|x| /
    the format's largest value, codes = fp8(x / scale) (every code a finite value)."""
    x = rng.standard_normal(shape)
    scale = (np.abs(x).max(axis=-1) / float(ml_dtypes.finfo(FORMATS[fmt]).max)).astype(F32)
    codes = (x / scale[..., None]).astype(FORMATS[fmt]).view(np.uint8)
    return codes, scale


def stored(codes, scale, fmt):
    """The float64 values the cache stores: decode(code) * scale (per token)."""
    return codes.view(FORMATS[fmt]).astype(np.float64) * scale[..., None]


def run(q, kc, vc, ks, vs, fmt, **kw):
    B, H, Lq, _ = q.shape
    o = np.full((B, H, Lq, vc.shape[-1]), np.nan, F32)
    lse = np.full((B, H, Lq), np.nan, F32)
    _core.decode(q, kc, vc, o, lse, scale=kw.pop("scale"), encoding=fmt, aux=(ks, vs), **kw)
    return o, lse


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("L", [1, 7, 129])
@pytest.mark.parametrize("d", [1, 5, 80, 256])
def test_fp8_decode_matches_the_oracle_of_the_stored_values(rng, fmt, L, d):
    B, Hkv, G, Lq = 2, 2, 3, 2
    (kc, ks), (vc, vs) = quantize(rng, (B, Hkv, L, d), fmt), quantize(rng, (B, Hkv, L, d), fmt)
    q = rng.standard_normal((B, Hkv * G, Lq, d)).astype(F32)
    scale = d**-0.5
    o, lse = run(q, kc, vc, ks, vs, fmt, scale=scale, causal=True)
    K, V = stored(kc, ks, fmt), stored(vc, vs, fmt)
    mask = causal_mask(Lq, L)
    O, LSE = sdpa(q.astype(np.float64), K, V, mask=mask, scale=scale, return_lse=True)
    np.testing.assert_allclose(o, O, **tol(F32))
    np.testing.assert_allclose(lse, LSE, **tol(F32))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fp8_ring_lengths_and_splits(rng, fmt):
    """A ring (kv_start, wrapping inside a key block), per-sequence lengths and short splits."""
    B, Hkv, G, R, d = 2, 1, 4, 300, 64
    (kc, ks), (vc, vs) = quantize(rng, (B, Hkv, R, d), fmt), quantize(rng, (B, Hkv, R, d), fmt)
    q = rng.standard_normal((B, Hkv * G, 1, d)).astype(F32)
    start, lens = np.array([290, 5], np.int64), np.array([300, 171], np.int64)
    o, _ = run(q, kc, vc, ks, vs, fmt, scale=0.1, kv_start=start, kv_lens=lens, split=64)
    K, V = stored(kc, ks, fmt), stored(vc, vs, fmt)
    for b in range(B):
        slots = (start[b] + np.arange(lens[b])) % R
        O = sdpa(q[b].astype(np.float64), K[b][:, slots], V[b][:, slots], scale=0.1)
        np.testing.assert_allclose(o[b], O, **tol(F32), err_msg=f"sequence {b}")


def test_every_code_decodes_exactly(rng):
    """One key per code (values = one-hot rows): O reads back decode(code) * scale exactly."""
    for fmt, dt in FORMATS.items():
        codes = np.arange(256, dtype=np.uint8)
        finite = np.isfinite(codes.view(dt).astype(np.float64))
        codes = codes[finite]
        n = codes.size
        # q . k = 0 for every key (k all zero codes): uniform weights 1/n over n keys; V one
        # code per key in column 0, so O[0] = mean of the decoded values (float32 sums), and
        # with a single key (L = 1) O is the decoded value itself, bit for bit.
        for i in range(n):
            vc = np.zeros((1, 1, 1, 1), np.uint8)
            vc[..., 0, 0] = codes[i]
            kc = np.zeros((1, 1, 1, 1), np.uint8)
            one = np.ones((1, 1, 1), F32)
            o, _ = run(np.ones((1, 1, 1, 1), F32), kc, vc, one, one, fmt, scale=1.0)
            want = np.float32(codes[i : i + 1].view(dt).astype(np.float64)[0])
            assert o[0, 0, 0, 0] == want or (want == 0 and o[0, 0, 0, 0] == 0), (fmt, codes[i])


def test_fp8_argument_errors(rng):
    q, o = np.zeros((1, 2, 1, 8), F32), np.empty((1, 2, 1, 8), F32)
    c = np.zeros((1, 1, 64, 8), np.uint8)
    s = np.ones((1, 1, 64), F32)
    with pytest.raises(ValueError, match="encoding must be 'int8', 'e4m3', 'e5m2'"):
        _core.decode(q, c, c, o, scale=1.0, encoding="e3m4", aux=(s, s))
    with pytest.raises(TypeError, match="float32 q"):
        _core.decode(q.astype(np.float64), c, c, o, scale=1.0, encoding="e4m3", aux=(s, s))
    with pytest.raises(TypeError, match="uint8 codes"):
        _core.decode(q, c.view(np.int8), c, o, scale=1.0, encoding="e4m3", aux=(s, s))
    with pytest.raises(ValueError, match="k_scale"):
        _core.decode(q, c, c, o, scale=1.0, encoding="e5m2", aux=(s[..., :3], s))
    with pytest.raises(ValueError, match="v_scale is required"):
        _core.decode(q, c, c, o, scale=1.0, encoding="e5m2", aux=(s,))
    with pytest.raises(ValueError, match="k_scale"):  # a pool's scales: (C, Hkv, block) chunks
        _core.decode(q, [c], [c], o, scale=1.0, encoding="e4m3", aux=(s, s),
                     block_table=np.zeros((1, 1), np.int64), kv_lens=np.array([1]))  # fmt: skip
