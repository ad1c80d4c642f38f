"""KVCache(dtype="float8_e4m3" / "float8_e5m2"): fp8 codes with one float32 scale per token and
kv head, encoded on append, read in place by the decode kernel.

Two oracles: the float64 attention over the cache's stored values (``keys(b)`` /
``values(b)``: fp8(code) * scale, exact in float32), which the kernel must match to float32
rounding, and ml_dtypes' own float8 rounding, which the encoder must reproduce code for code.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import tol

import attn_fast as af
from attn_fast import reference as ref
from attn_fast._kv_store import encoding_for
from attn_fast.positional import RoPE

F32 = np.float32
FORMATS = {"float8_e4m3": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def randn(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F32)


def stored(cache, b):
    return cache.keys(b).astype(np.float64), cache.values(b).astype(np.float64)


def oracle(q, K, V, q_len, causal=True, window=None):
    """Float64 attention of q (Hq, Lq, d)'s first q_len rows over K, V (H, n, ·), bottom-right."""
    q = np.asarray(q[:, :q_len], np.float64)
    n = K.shape[1]
    if window is not None:
        mask = ref.window_mask(q_len, n, window - 1, 0)
    else:
        mask = ref.causal_mask(q_len, n) if causal else None
    return ref.sdpa(q, K, V, mask=mask, return_lse=True)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_encoder_rounds_as_ml_dtypes(rng, name):
    """Codes equal ml_dtypes' float8 rounding of x / scale (nearest, ties to even), over normal
    values, subnormals, exact ties, zeros of both signs and the saturating maximum."""
    enc, mdt = encoding_for(name), FORMATS[name]
    finite = np.arange(256, dtype=np.uint8).view(mdt).astype(np.float64)
    finite = np.unique(finite[np.isfinite(finite)])
    mids = (finite[:-1] + finite[1:]) / 2  # exact ties between neighbours
    row = np.concatenate([finite, mids, [0.0, -0.0]])
    x = np.stack([row, row * 0.37, rng.standard_normal(row.size) * 1e-3]).astype(F32)
    codes, scale = enc.encode(x)
    assert codes.dtype == np.uint8 and scale.dtype == F32 and scale.shape == (3,)
    want = (x.astype(np.float64) / scale[:, None]).astype(mdt).view(np.uint8)
    np.testing.assert_array_equal(codes, want)
    assert np.isfinite(codes.view(mdt).astype(F32)).all()


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("L", [1, 7, 129])
@pytest.mark.parametrize("d", [1, 5, 80, 256])
def test_decode_matches_the_oracle_of_the_stored_values(rng, name, L, d):
    B, Hkv, G = 2, 2, 3
    cache = af.KVCache(batch=B, num_kv_heads=Hkv, head_dim=d, dtype=name)
    assert cache.dtype == np.uint8 and cache.io_dtype == F32
    k, v = randn(rng, (B, Hkv, L, d)), randn(rng, (B, Hkv, L, d), 4.0)
    cache.append(k, v)
    q = randn(rng, (B, Hkv * G, 1, d))
    o, lse = cache.attend(q, return_lse=True)
    for b in range(B):
        K, V = stored(cache, b)
        O, LSE = oracle(q[b], np.repeat(K, G, 0), np.repeat(V, G, 0), 1)
        np.testing.assert_allclose(o[b], O, rtol=2e-6, atol=2e-6 * np.abs(O).max())
        np.testing.assert_allclose(lse[b], LSE, **tol(F32))
        # what is stored is the encoder's rounding of what was appended
        kc, ks = encoding_for(name).encode(k[b])
        want = kc.view(FORMATS[name]).astype(np.float64) * ks[..., None]
        np.testing.assert_array_equal(K, want.astype(F32))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_chunks_ring_window_truncate_and_growth(rng, name):
    """Prefill chunks with q_lens, a window ring that wraps, truncate and growth: after each step
    the output equals the oracle over the stored values of exactly the visible positions."""
    d, Hkv, G = 32, 2, 2
    ring = af.KVCache(batch=2, num_kv_heads=Hkv, head_dim=d, dtype=name, window=24, ring=40)
    grow = af.KVCache(batch=2, num_kv_heads=Hkv, head_dim=d, dtype=name, capacity=8)
    for step, L in enumerate([5, 17, 1, 30, 1, 9]):
        lengths = np.array([L, max(1, L - 3)])
        k, v = randn(rng, (2, Hkv, L, d)), randn(rng, (2, Hkv, L, d))
        q = randn(rng, (2, Hkv * G, L, d))
        for cache, window in ((ring, 24), (grow, None)):
            cache.append(k, v, lengths=lengths)
            o = cache.attend(q, q_lens=lengths)
            for b in range(2):
                K, V = stored(cache, b)
                O, _ = oracle(
                    q[b], np.repeat(K, G, 0), np.repeat(V, G, 0), lengths[b], window=window
                )
                np.testing.assert_allclose(o[b, :, : lengths[b]], O, **tol(F32))
        if step == 3:
            for cache in (ring, grow):
                n = cache.positions - 2
                before = [stored(cache, b)[0][:, -5:-2] for b in range(2)]
                cache.truncate(n)
                for b in range(2):
                    np.testing.assert_array_equal(stored(cache, b)[0][:, -3:], before[b])


def test_rope_and_spellings(rng):
    """Keys are rotated in float32 before they are encoded; ml_dtypes and torch dtypes name the
    same encodings as the strings."""
    rope = RoPE(16)
    a = af.KVCache(batch=1, num_kv_heads=1, head_dim=16, dtype="float8_e4m3")
    b = af.KVCache(batch=1, num_kv_heads=1, head_dim=16, dtype=ml_dtypes.float8_e4m3fn)
    k, v = randn(rng, (1, 1, 9, 16)), randn(rng, (1, 1, 9, 16))
    a.append(k, v, rope=rope)
    b.append(k, v, rope=rope)
    rotated = rope(k.astype(np.float64), seq_axis=-2).astype(F32)
    codes, scales = a.encoding.encode(rotated[0])
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * scales[..., None]
    np.testing.assert_allclose(a.keys(0), want.astype(F32), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(a.keys(0), b.keys(0))
    assert type(encoding_for(ml_dtypes.float8_e5m2)) is type(a.encoding)
    torch = pytest.importorskip("torch")
    assert encoding_for(torch.float8_e4m3fn) is a.encoding
    assert encoding_for(torch.float8_e5m2) is encoding_for("float8_e5m2")


def test_bytes_per_token_head_and_errors(rng):
    d = dv = 128
    cache = af.KVCache(batch=1, num_kv_heads=2, head_dim=d, dtype="float8_e5m2", capacity=64)
    assert cache.encoding.bytes_per_token_head(d, dv) <= (d + dv) * 1.07
    assert cache.nbytes == 2 * 64 * (d + dv + 8)
    k = randn(rng, (1, 2, 3, d))
    with pytest.raises(TypeError, match="fp8 cache takes float32"):
        cache.append(k.astype(np.float64), k)
    bad = k.copy()
    bad[0, 1, 2, 5] = np.inf
    with pytest.raises(ValueError, match="inf or NaN"):
        cache.append(bad, k)
    assert cache.positions.tolist() == [0]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_paged_equals_contiguous_and_the_oracle(rng, name):
    """A PagedKVCache of fp8 blocks (ragged sequences over several pages, a fork that shares
    pages, a decode step and a chunk) stores the same codes as a KVCache of the same rows and
    its attention equals the oracle over its stored values."""
    Hkv, G, d, dv = 2, 3, 80, 48
    paged = af.PagedKVCache(Hkv, d, v_head_dim=dv, num_blocks=4, block_size=64, dtype=name)
    assert paged.dtype == np.uint8 and paged.io_dtype == F32
    ids = [paged.add_sequence() for _ in range(3)]
    first = np.array([150, 1, 64])
    k, v = randn(rng, (3, Hkv, 150, d)), randn(rng, (3, Hkv, 150, dv), 3.0)
    paged.append(ids, k, v, lengths=first)
    ids.append(paged.fork(ids[0]))
    for L in (1, 9):
        kn, vn = randn(rng, (4, Hkv, L, d)), randn(rng, (4, Hkv, L, dv))
        paged.append(ids, kn, vn)
        q = randn(rng, (4, Hkv * G, L, d))
        o, lse = paged.attend(ids, q, return_lse=True)
        for b, i in enumerate(ids):
            K = paged.keys(i).astype(np.float64)
            V = paged.values(i).astype(np.float64)
            O, LSE = oracle(q[b], np.repeat(K, G, 0), np.repeat(V, G, 0), L)
            np.testing.assert_allclose(o[b], O, **tol(F32))
            np.testing.assert_allclose(lse[b], LSE, **tol(F32))
    flat = af.KVCache(batch=1, num_kv_heads=Hkv, head_dim=d, v_head_dim=dv, dtype=name)
    flat.append(k[:1], v[:1])
    np.testing.assert_array_equal(paged.keys(ids[0])[:, :150], flat.keys(0))
    np.testing.assert_array_equal(paged.values(ids[0])[:, :150], flat.values(0))
