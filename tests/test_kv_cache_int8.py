"""KVCache(dtype="int8"): quantised on append, read in place by the decode kernel.

Two oracles: the float64 attention over the cache's *dequantised* keys and
values (``keys(b)`` / ``values(b)``), which the kernel must match to float32
rounding, and the float32 cache, from which the int8 error is bounded (half a
code step per element; see ``quantise`` for the codes).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import poisoned, tol

import attn_fast as af
from attn_fast import reference as ref
from attn_fast.kv_cache import KGROUP
from attn_fast.positional import RoPE

F32 = np.float32


def randn(rng, shape, offset=0.0):
    return (rng.standard_normal(shape) + offset).astype(F32)


def quantise(x, axis):
    """NumPy reference of the int8 codes: asymmetric over [min, max] along axis, float32 math
    in the order of csrc/kv_quant.cpp. Returns the dequantised values."""
    mn, mx = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    s = (mx - mn) / F32(255)
    m = mn + F32(128) * s
    inv = np.where(s > 0, F32(1) / np.where(s > 0, s, F32(1)), F32(0)).astype(F32)
    c = np.clip(np.rint((x - m) * inv), -128, 127).astype(np.int8)
    return c.astype(F32) * s + m


def quantise_keys(k, first=0):
    """Keys (H, n, d) of positions first .. first+n-1, per channel, groups of KGROUP positions."""
    out = np.empty_like(k)
    n = k.shape[1]
    t = 0
    while t < n:
        e = min(n, t + KGROUP - (first + t) % KGROUP)
        out[:, t:e] = quantise(k[:, t:e], 1)
        t = e
    return out


def oracle_seq(q, K, V, q_len, window=None, causal=True):
    """Attention of q (Hq, Lq, d)'s first q_len rows over K, V (H, n, d) of one sequence, float64,
    bottom-right aligned (the cache's semantics)."""
    q, K, V = (np.asarray(x, np.float64) for x in (q[:, :q_len], K, V))
    n = K.shape[1]
    if window is not None:
        mask = ref.window_mask(q_len, n, window - 1, 0 if causal else None)
    else:
        mask = ref.causal_mask(q_len, n) if causal else None
    return ref.sdpa(q, K, V, mask=mask, return_lse=True)


def check_against_dequantised(cache, q, o, lse, q_lens, window=None, causal=True):
    for b in range(cache.batch):
        ql = int(q_lens[b])
        K, V = cache.keys(b), cache.values(b)
        if ql == 0:
            continue
        if window is not None:  # the ring may hold more than the window needs: oracle on all
            pass
        O, LSE = oracle_seq(q[b], K, V, ql, window, causal)
        np.testing.assert_allclose(o[b, :, :ql], O, **tol(F32))
        np.testing.assert_allclose(lse[b, :, :ql], LSE, **tol(F32))
        np.testing.assert_array_equal(o[b, :, ql:], 0)  # padding rows
        assert np.isneginf(lse[b, :, ql:]).all()


CONFIGS = [  # B, Hq, Hkv, d, dv, chunk schedule
    (1, 1, 1, 1, 1, [1, 1, 7]),
    (2, 4, 2, 5, 7, [7, 1, 1, 129, 1]),
    (1, 8, 2, 80, 80, [129, 1, 1, 1, 64, 3]),
    (2, 4, 1, 128, 128, [200, 1, 2]),
    (1, 2, 1, 256, 256, [65, 1]),
]


@pytest.mark.parametrize("B, Hq, Hkv, d, dv, sched", CONFIGS)
def test_attend_matches_oracle_on_dequantised(isa, rng, B, Hq, Hkv, d, dv, sched):
    cache = af.KVCache(B, Hkv, d, capacity=16, v_head_dim=dv, dtype="int8")
    for L in sched:
        k, v = randn(rng, (B, Hkv, L, d), 0.5), randn(rng, (B, Hkv, L, dv))
        q = randn(rng, (B, Hq, L, d))
        cache.append(k, v)
        out = poisoned((B, Hq, L, dv), F32)
        o, lse = cache.attend(q, out=out, return_lse=True)
        assert o is out and o.dtype == F32 and lse.dtype == F32
        check_against_dequantised(cache, q, o, lse, np.full(B, L))


def test_codes_equal_one_shot_quantisation(rng):
    """However the tokens arrive (chunks across group ends, single tokens), each closed key group
    is quantised from its float32 keys exactly as all at once; values per token."""
    B, H, d, dv, n = 2, 3, 24, 16, 300
    k, v = randn(rng, (B, H, n, d), 2.0), randn(rng, (B, H, n, dv))
    k[..., 3] *= 20  # an outlier channel
    cache = af.KVCache(B, H, d, capacity=64, v_head_dim=dv, dtype="int8")
    t = 0
    for L in [1, 63, 1, 5, 100, 1, 1, 64, 64]:
        cache.append(k[:, :, t : t + L], v[:, :, t : t + L])
        t += L
    assert t == n
    for b in range(B):
        np.testing.assert_array_equal(cache.keys(b), quantise_keys(k[b]))
        np.testing.assert_array_equal(cache.values(b), quantise(v[b], 2))


def test_error_against_float32_is_half_a_step(rng):
    B, H, Hq, d, n = 1, 2, 8, 64, 500
    k, v = randn(rng, (B, H, n, d), 1.0), randn(rng, (B, H, n, d))
    k[..., :2] *= 10
    c8 = af.KVCache(B, H, d, dtype="int8")
    c32 = af.KVCache(B, H, d)
    c8.append(k, v)
    c32.append(k, v)
    for g in range(0, n, KGROUP):
        kg = k[0, :, g : g + KGROUP]
        step = (kg.max(1) - kg.min(1)) / 255  # (H, d)
        err = np.abs(c8.keys(0)[:, g : g + KGROUP] - kg).max(1)
        assert (err <= 0.5 * step * (1 + 1e-3) + 1e-6).all()
    vstep = (v[0].max(-1) - v[0].min(-1)) / 255
    assert (np.abs(c8.values(0) - v[0]).max(-1) <= 0.5 * vstep * (1 + 1e-3) + 1e-6).all()
    # The output's error follows from the codes': a score moves by at most
    # D = max_j |q . (k8_j - k_j)| * scale, so every weight p_j by a factor
    # within exp(+-2 D), and sum_j |p8_j - p_j| |v_j| <= (exp(2 D) - 1) max |v|;
    # the values add at most their half step.
    q = randn(rng, (B, Hq, 1, d))
    err = np.abs(c8.attend(q) - c32.attend(q))[0, :, 0].max(-1)  # (Hq,)
    g = Hq // H
    dk = (c8.keys(0) - k[0]).astype(np.float64)  # (H, n, d)
    shift = np.abs(np.einsum("hgd,hnd->hgn", q[0, :, 0].reshape(H, g, d), dk)).max(-1) / np.sqrt(d)
    vmax = np.abs(v[0]).max((1, 2))[:, None]
    bound = np.expm1(2 * shift) * vmax + 0.5 * vstep.max(-1)[:, None] * (1 + 1e-3) + 1e-5
    assert (err <= bound.reshape(Hq)).all(), (err, bound)


def test_ragged_lengths_and_padding_rows(isa, rng):
    B, Hq, Hkv, d = 3, 4, 2, 32
    cache = af.KVCache(B, Hkv, d, dtype="int8")
    cache.append(randn(rng, (B, Hkv, 70, d)), randn(rng, (B, Hkv, 70, d)), lengths=[70, 3, 0])
    lens = np.array([2, 1, 2])
    k, v = randn(rng, (B, Hkv, 2, d)), randn(rng, (B, Hkv, 2, d))
    cache.append(k, v, lengths=lens)
    assert cache.lengths.tolist() == [72, 4, 2]
    q = randn(rng, (B, Hq, 2, d))
    o, lse = cache.attend(q, return_lse=True)
    check_against_dequantised(cache, q, o, lse, lens)


@pytest.mark.parametrize("window, ring", [(5, None), (64, None), (40, 100)])
def test_ring_window(isa, rng, window, ring):
    """A sliding window over an int8 ring (positions wrap the slots many times)."""
    B, Hq, Hkv, d = 2, 4, 2, 16
    cache = af.KVCache(B, Hkv, d, window=window, ring=ring, dtype="int8")
    assert cache.capacity % KGROUP == 0
    hist_k, hist_v = [], []
    for L in [3, 1, 1, 30, 1, 7] + [1] * 150 + [9, 1]:
        k, v = randn(rng, (B, Hkv, L, d)), randn(rng, (B, Hkv, L, d))
        q = randn(rng, (B, Hq, L, d))
        cache.append(k, v)
        o, lse = cache.attend(q, return_lse=True)
        for b in range(B):
            K, V = cache.keys(b), cache.values(b)
            O, LSE = oracle_seq(q[b], K, V, L, window)
            np.testing.assert_allclose(o[b], O, **tol(F32))
            np.testing.assert_allclose(lse[b], LSE, **tol(F32))
        hist_k.append(k)
        hist_v.append(v)
    # What the ring holds is the quantised recent history (within half a step of the keys).
    allk = np.concatenate(hist_k, axis=2)
    n = int(cache.lengths[0])
    assert n >= window
    assert np.abs(cache.keys(0) - allk[0, :, -n:]).max() < 0.05


def test_truncate_into_a_closed_group(isa, rng):
    B, Hq, Hkv, d = 1, 2, 1, 16
    cache = af.KVCache(B, Hkv, d, dtype="int8")
    k, v = randn(rng, (B, Hkv, 150, d)), randn(rng, (B, Hkv, 150, d))
    cache.append(k, v)
    before = cache.keys(0)
    cache.truncate(100)  # back into the group of positions 64..127, closed since
    assert cache.positions.tolist() == [100] and cache.lengths.tolist() == [100]
    np.testing.assert_array_equal(cache.keys(0), before[:, :100])
    k2 = randn(rng, (B, Hkv, 40, d), 3.0)  # widens the group's ranges: requantised
    cache.append(k2, randn(rng, (B, Hkv, 40, d)))
    q = randn(rng, (B, Hq, 40, d))
    o, lse = cache.attend(q, return_lse=True)
    check_against_dequantised(cache, q, o, lse, [40])
    ref_k = np.concatenate([k[0, :, :100], k2[0]], axis=1)
    step = (ref_k[:, 64:128].max(1) - ref_k[:, 64:128].min(1)) / 255
    # one extra rounding for the keys refilled from their codes: at most a step
    assert (np.abs(cache.keys(0)[:, 64:128] - ref_k[:, 64:128]).max(1) <= step * 1.01 + 1e-6).all()
    cache.truncate(0)
    cache.append(k[:, :, :3], v[:, :, :3])
    np.testing.assert_array_equal(cache.keys(0), quantise_keys(k[0, :, :3]))


def test_truncate_within_the_open_group_keeps_the_originals(rng):
    B, Hkv, d = 1, 2, 8
    cache = af.KVCache(B, Hkv, d, dtype="int8")
    k, v = randn(rng, (B, Hkv, 50, d)), randn(rng, (B, Hkv, 50, d))
    cache.append(k[:, :, :40], v[:, :, :40])
    cache.truncate(20)
    cache.append(k[:, :, 20:50], v[:, :, 20:50])
    np.testing.assert_array_equal(cache.keys(0), quantise_keys(k[0]))


def test_rope_on_append_and_positions(isa, rng):
    B, Hq, Hkv, d = 2, 4, 2, 32
    rope = RoPE(d)
    c8 = af.KVCache(B, Hkv, d, dtype="int8")
    c32 = af.KVCache(B, Hkv, d)
    for L in [10, 1, 60]:
        k, v = randn(rng, (B, Hkv, L, d)), randn(rng, (B, Hkv, L, d))
        c8.append(k, v, rope=rope)
        c32.append(k, v, rope=rope)
    assert c8.positions.tolist() == [71, 71]
    for b in range(B):
        np.testing.assert_array_equal(c8.keys(b), quantise_keys(c32.keys(b)))
    q = randn(rng, (B, Hq, 60, d))
    o, lse = c8.attend(q, return_lse=True)
    check_against_dequantised(c8, q, o, lse, [60, 60])


def test_growth_keeps_the_codes(rng):
    B, Hkv, d = 2, 1, 8
    cache = af.KVCache(B, Hkv, d, capacity=64, dtype="int8")
    cache.append(randn(rng, (B, Hkv, 60, d)), randn(rng, (B, Hkv, 60, d)))
    k0, v0 = cache.keys(1), cache.values(1)
    cache.append(randn(rng, (B, Hkv, 10, d)), randn(rng, (B, Hkv, 10, d)), lengths=[10, 0])
    assert cache.capacity == 128
    np.testing.assert_array_equal(cache.keys(1), k0)
    np.testing.assert_array_equal(cache.values(1), v0)
    with pytest.raises(ValueError, match="fixed capacity"):
        af.KVCache(1, 1, 8, capacity=64, dtype="int8", growable=False).append(
            randn(rng, (1, 1, 65, 8)), randn(rng, (1, 1, 65, 8))
        )


def test_forward_prefill_and_layer_caches(isa, rng):
    B, Hq, Hkv, d, L = 1, 4, 2, 16, 129
    layers = af.LayerCaches(2, B, Hkv, d, dtype="int8")
    q, k, v = randn(rng, (B, Hq, L, d)), randn(rng, (B, Hkv, L, d)), randn(rng, (B, Hkv, L, d))
    o, lse = layers[0].forward(q, k, v, return_lse=True)
    check_against_dequantised(layers[0], q, o, lse, [L])
    layers[1].forward(q, k, v)
    assert layers.nbytes == 2 * layers[0].nbytes
    layers.truncate(7)
    assert layers.positions.tolist() == [7]
    # window ring: forward splits a long chunk into pieces that fit; each piece sees the cache
    # as it is then (its key group requantised as the group fills)
    c = af.KVCache(B, Hkv, d, window=8, dtype="int8", growable=False)
    o = c.forward(q, k, v)
    manual = af.KVCache(B, Hkv, d, window=8, dtype="int8", growable=False)
    step = manual.capacity - 8 + 1
    for t in range(0, L, step):
        sl = slice(t, min(L, t + step))
        manual.append(k[:, :, sl], v[:, :, sl])
        om, lm = manual.attend(q[:, :, sl], return_lse=True)
        np.testing.assert_array_equal(o[:, :, sl], om)
        O, LSE = oracle_seq(q[0, :, sl], manual.keys(0), manual.values(0), sl.stop - t, window=8)
        np.testing.assert_allclose(om[0], O, **tol(F32))


def test_non_contiguous_inputs(isa, rng):
    B, Hq, Hkv, d = 2, 4, 2, 40
    k = randn(rng, (B, 9, Hkv, d)).transpose(0, 2, 1, 3)  # (B, Hkv, L, d) view
    v = randn(rng, (B, Hkv, 9, 2 * d))[..., ::2]
    q = randn(rng, (B, 9, Hq, d)).transpose(0, 2, 1, 3)
    cache = af.KVCache(B, Hkv, d, dtype="int8")
    cache.append(k, v)
    for b in range(B):
        np.testing.assert_array_equal(cache.keys(b), quantise_keys(np.ascontiguousarray(k[b])))
    out = np.full((B, 9, Hq, d), np.nan, F32).transpose(0, 2, 1, 3)
    o, lse = cache.attend(q, out=out, return_lse=True)
    check_against_dequantised(cache, q, o, lse, [9, 9])


def test_nbytes_within_3_percent_of_theory():
    B, H, d, dv, cap = 2, 8, 128, 128, 32768
    c = af.KVCache(B, H, d, capacity=cap, dtype="int8")
    per_token = d + dv + 8 + 8 * d / KGROUP  # codes, v scale + offset, k scales + offsets
    theory = B * H * cap * per_token
    assert c.nbytes == theory + B * H * KGROUP * d * 4  # + the float32 staging tail
    assert abs(c.nbytes / theory - 1) < 0.03
    assert c.nbytes < 0.3 * af.KVCache(B, H, d, capacity=cap).nbytes


def test_bad_input(rng):
    with pytest.raises(TypeError, match="or int8"):
        af.KVCache(1, 1, 8, dtype="int4")
    with pytest.raises(TypeError, match="or int8"):
        af.KVCache(1, 1, 8, dtype=np.uint8)
    c = af.KVCache(1, 1, 8, dtype="int8")
    assert c.dtype == np.int8 and c.io_dtype == np.float32
    with pytest.raises(TypeError, match="float32"):
        c.append(randn(rng, (1, 1, 2, 8)).astype(np.float16), randn(rng, (1, 1, 2, 8)))
    k = randn(rng, (1, 1, 3, 8))
    k[0, 0, 2, 5] = np.inf
    with pytest.raises(ValueError, match="inf or NaN"):
        c.append(k, randn(rng, (1, 1, 3, 8)))
    v = randn(rng, (1, 1, 3, 8))
    v[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="inf or NaN"):
        c.append(randn(rng, (1, 1, 3, 8)), v)
    assert c.lengths.tolist() == [0] and c.positions.tolist() == [0]
    c.append(randn(rng, (1, 1, 3, 8)), randn(rng, (1, 1, 3, 8)))
    with pytest.raises(TypeError, match="float32"):
        c.attend(randn(rng, (1, 2, 1, 8)).astype(np.float64))
    with pytest.raises(ValueError, match="head dim"):
        c.attend(randn(rng, (1, 2, 1, 4)))
    # the raw kernel binding checks the scale arrays
    q, o = randn(rng, (1, 1, 1, 8)), np.empty((1, 1, 1, 8), F32)
    k8 = np.zeros((1, 1, 64, 8), np.int8)
    s = np.ones((1, 1, 1, 8), F32)
    t = np.ones((1, 1, 64), F32)
    with pytest.raises(ValueError, match="k_scale"):
        af._core.decode(q, k8, k8, o, scale=1.0, encoding="int8", aux=(s[..., :4], s, t, t),
                        group=64)  # fmt: skip
    with pytest.raises(ValueError, match="group must be"):
        af._core.decode(q, k8, k8, o, scale=1.0, encoding="int8", aux=(s, s, t, t), group=48)
    with pytest.raises(ValueError, match="v_off is required"):
        af._core.decode(q, k8, k8, o, scale=1.0, encoding="int8", aux=(s, s, t), group=64)
    with pytest.raises(TypeError, match="float32 q"):
        af._core.decode(q.astype(np.float64), k8, k8, o, scale=1.0, encoding="int8",
                        aux=(s, s, t, t), group=64)  # fmt: skip
    with pytest.raises(TypeError, match="int8 codes"):
        af._core.decode(q, k8.view(np.uint8), k8, o, scale=1.0, encoding="int8",
                        aux=(s, s, t, t), group=64)  # fmt: skip


def test_constant_channels_and_values(rng):
    """A zero range (constant channel, constant value row) has scale 0 and is stored exactly."""
    k = np.ones((1, 1, 70, 4), F32) * F32(0.3)
    k[..., 1] = randn(rng, (1, 1, 70))
    v = np.full((1, 1, 70, 4), -2.5, F32)
    c = af.KVCache(1, 1, 4, dtype="int8")
    c.append(k, v)
    np.testing.assert_array_equal(c.keys(0)[..., 0], k[0, ..., 0])
    np.testing.assert_array_equal(c.values(0), v[0])


def test_model_runs_on_int8_caches(rng):
    """A TinyTransformerLM prefills and decodes through int8 LayerCaches (float32 activations);
    its logits stay close to the float32 caches' run."""
    m = af.TinyTransformerLM(97, 32, 2, 4, 2, seed=1)
    tokens = rng.integers(0, 97, (2, 20))
    logits = {}
    for dt in ("float32", "int8"):
        caches = af.LayerCaches(m.num_layers, 2, m.num_kv_heads, m.head_dim, dtype=dt)
        out = [m.forward(tokens, cache=caches)[:, -1]]
        for t in range(3):
            out.append(m.forward(tokens[:, t : t + 1], cache=caches)[:, -1])
        logits[dt] = np.stack(out)
        assert caches.positions.tolist() == [23, 23]
    a, b = logits["float32"], logits["int8"]
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()


def test_ring_truncate_non_causal_and_reset(isa, rng):
    """Speculative rollback on a wrapped int8 ring, non-causal attend, then reset."""
    B, Hq, Hkv, d, w = 2, 2, 1, 8, 30
    c = af.KVCache(B, Hkv, d, window=w, dtype="int8")
    for _ in range(5):
        c.append(randn(rng, (B, Hkv, 40, d)), randn(rng, (B, Hkv, 40, d)))
    c.truncate([195, 190])  # back past a group end (positions 192..199 opened group 3)
    assert c.positions.tolist() == [195, 190]
    k, v = randn(rng, (B, Hkv, 4, d)), randn(rng, (B, Hkv, 4, d))
    c.append(k, v)
    q = randn(rng, (B, Hq, 4, d))
    for causal in (True, False):
        o, lse = c.attend(q, causal=causal, return_lse=True)
        for b in range(B):
            O, LSE = oracle_seq(q[b], c.keys(b), c.values(b), 4, window=w, causal=causal)
            np.testing.assert_allclose(o[b], O, **tol(F32))
            np.testing.assert_allclose(lse[b], LSE, **tol(F32))
        # the newest stored keys are this append's, within half a code step
        assert np.abs(c.keys(0)[:, -4:] - k[0]).max() < 0.02
    c.reset()
    assert c.lengths.tolist() == [0, 0]
    c.append(k, v)
    np.testing.assert_array_equal(c.keys(1), quantise_keys(k[1]))


@pytest.mark.parametrize("d, dv", [(5, 7), (80, 80), (128, 128)], ids=str)
def test_long_decode_contiguous_and_paged(isa, rng, d, dv):
    """One-token decode over many key groups (each block prefetches the next block's codes and,
    when it starts a key group, its scales): the oracle on the dequantised K/V, and a paged cache
    of 128-token pages (two key groups per page) bit-identical to the contiguous one."""
    B, Hq, Hkv, L = 2, 8, 2, 589
    k, v = randn(rng, (B, Hkv, L, d), 0.5), randn(rng, (B, Hkv, L, dv))
    cache = af.KVCache(B, Hkv, d, v_head_dim=dv, dtype="int8")
    paged = af.PagedKVCache(Hkv, d, v_head_dim=dv, block_size=128, num_blocks=4, dtype="int8")
    ids = [paged.add_sequence() for _ in range(B)]
    for t0, t1 in [(0, 300), (300, 301), (301, L)]:
        cache.append(k[:, :, t0:t1], v[:, :, t0:t1])
        paged.append(ids, k[:, :, t0:t1], v[:, :, t0:t1])
    q = randn(rng, (B, Hq, 1, d))
    o, lse = cache.attend(q, out=poisoned((B, Hq, 1, dv), F32), return_lse=True)
    check_against_dequantised(cache, q, o, lse, np.ones(B, np.int64))
    op, lsep = paged.attend(ids, q, return_lse=True)
    np.testing.assert_array_equal(op, o)
    np.testing.assert_array_equal(lsep, lse)
