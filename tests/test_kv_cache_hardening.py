"""``KVCache``, ``LayerCaches`` and ``merge_attention_states`` (kv_cache.py):
bad constructor arguments, odd but valid inputs against the float64 oracle,
and calls that fail without changing the cache (docs/HARDENING.md)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    NOT_INTS,
    UNUSUAL_LAYOUTS,
    assert_close,
    assert_same_cache,
    misaligned,
    randn,
    readonly,
    snapshot_cache,
)

import attn_fast as af
from attn_fast import positional
from attn_fast import reference as ref

# ---------------------------------------------------------------- KVCache: construction


@pytest.mark.parametrize(
    "arg", ["batch", "num_kv_heads", "head_dim", "capacity", "v_head_dim", "window"]
)
@pytest.mark.parametrize("bad, exc", NOT_INTS[:4] + [(0, ValueError), (-2, ValueError)])
def test_kv_cache_constructor_ints(arg, bad, exc):
    kw = dict(batch=1, num_kv_heads=2, head_dim=4)
    kw[arg] = bad
    with pytest.raises(exc, match=arg):
        af.KVCache(**kw)


@pytest.mark.parametrize(
    "dtype", [np.uint16, np.int32, np.complex64, bool, ">f4", ">f2", "not a dtype"]
)
def test_kv_cache_constructor_dtype(dtype):
    with pytest.raises(TypeError, match="dtype must be float32, float64, float16 or bfloat16"):
        af.KVCache(1, 2, 4, dtype=dtype)


def test_layer_caches_constructor():
    for bad, exc in NOT_INTS[:4] + [(0, ValueError)]:
        with pytest.raises(exc, match="num_layers"):
            af.LayerCaches(bad, 1, 2, 4)
    with pytest.raises(TypeError, match="capacity must be an int"):
        af.LayerCaches(2, 1, 2, 4, capacity=8.0)


# ----------------------------------------------------------- KVCache: correct results on odd inputs


def _cache_oracle(q, k, v, window=None):
    Lq, Lk = q.shape[-2], k.shape[-2]
    mask = ref.causal_mask(Lq, Lk) if window is None else ref.window_mask(Lq, Lk, window - 1, 0)
    return ref.sdpa(q, k, v, mask=mask, return_lse=True)


@pytest.mark.parametrize("layout", sorted(UNUSUAL_LAYOUTS))
@pytest.mark.parametrize("window", [None, 4])
def test_kv_cache_unusual_layouts(rng, layout, window):
    B, Hq, Hkv, L, d, dv = 2, 4, 2, 11, 5, 3
    q, k, v = randn(rng, (B, Hq, L, d)), randn(rng, (B, Hkv, L, d)), randn(rng, (B, Hkv, L, dv))
    f = UNUSUAL_LAYOUTS[layout]
    cache = af.KVCache(B, Hkv, d, capacity=3, v_head_dim=dv, window=window)
    outs, lses = [], []
    for t0, t1 in [(0, 6), (6, 7), (7, 11)]:
        cache.append(f(k[:, :, t0:t1]), f(v[:, :, t0:t1]))
        o, lse = cache.attend(f(q[:, :, t0:t1]), return_lse=True)
        outs.append(o)
        lses.append(lse)
    O, LSE = _cache_oracle(q, k, v, window)
    assert_close(np.concatenate(outs, axis=2), O, F32)
    assert_close(np.concatenate(lses, axis=2), LSE, F32)


def test_kv_cache_broadcast_inputs(rng):
    """Zero-stride k / v / q views are read through their strides."""
    B, H, L, d = 2, 2, 6, 4
    k = np.broadcast_to(randn(rng, (1, H, L, d)), (B, H, L, d))
    v = np.broadcast_to(randn(rng, (B, 1, L, d)), (B, H, L, d))
    q = np.broadcast_to(randn(rng, (1, 1, L, d)), (B, H, L, d))
    cache = af.KVCache(B, H, d)
    o = cache.forward(q, k, v)
    assert_close(o, _cache_oracle(q, k, v)[0], F32)


def test_kv_cache_zero_size(rng):
    cache = af.KVCache(2, 2, 4)
    cache.append(randn(rng, (2, 2, 0, 4)), randn(rng, (2, 2, 0, 4)))
    assert len(cache) == 0
    o, lse = cache.attend(randn(rng, (2, 2, 0, 4)), return_lse=True)
    assert o.shape == (2, 2, 0, 4) and lse.shape == (2, 2, 0)
    # No keys, non-causal: every row sees nothing -> zeros, lse = -inf.
    o, lse = cache.attend(randn(rng, (2, 4, 3, 4)), causal=False, return_lse=True)
    np.testing.assert_array_equal(o, 0)
    assert np.isneginf(lse).all()
    o = cache.attend(randn(rng, (2, 0, 3, 4)), causal=False)  # zero query heads
    assert o.shape == (2, 0, 3, 4)


def test_kv_cache_nonfinite(rng):
    """A NaN key reaches exactly the rows that see it;
    once the window drops it, rows are exact again."""
    B, H, L, d, w = 1, 2, 10, 4, 3
    q, k, v = randn(rng, (B, H, L, d)), randn(rng, (B, H, L, d)), randn(rng, (B, H, L, d))
    k[:, :, 4] = np.nan
    v[:, :, 6, 1] = np.inf
    for window in (None, w):
        cache = af.KVCache(B, H, d, window=window)
        o = np.concatenate(
            [
                cache.forward(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
                for t in range(L)
            ],
            2,
        )
        assert_close(
            o[:, :, :4], _cache_oracle(q[:, :, :4], k[:, :, :4], v[:, :, :4], window)[0], F32
        )  # before the NaN key
        if window is None:
            assert np.isnan(o[:, :, 4:]).all()
        else:
            assert np.isnan(o[:, :, 4 : 4 + w]).all()  # rows 4, 5, 6 see the NaN key 4
            # Rows 7.. no longer see key 4; rows 7, 8 see the inf in v[6, 1] (in that column only).
            O, _ = _cache_oracle(
                q, k, v, window
            )  # the oracle multiplies masked weights by 0: compare finite columns
            assert_close(o[:, :, 4 + w :, [0, 2, 3]], O[:, :, 4 + w :, [0, 2, 3]], F32)
            assert not np.isfinite(o[:, :, 7:9, 1]).any()
            v9 = v.copy()
            v9[:, :, 6] = 0
            assert_close(o[:, :, 9], _cache_oracle(q, k, v9, window)[0][:, :, 9], F32)


# --------------------------------------------------------------- KVCache: errors leave it unchanged


def _filled_cache(rng, window=None, growable=True):
    cache = af.KVCache(2, 2, 4, capacity=8, v_head_dim=3, window=window, growable=growable)
    cache.append(randn(rng, (2, 2, 4, 4)), randn(rng, (2, 2, 4, 3)), lengths=[4, 3])
    return cache


def _bad_append_calls(rng):
    k, v = randn(rng, (2, 2, 2, 4)), randn(rng, (2, 2, 2, 3))
    return [
        ("k 3-D", (ValueError, r"k has shape \(2, 2, 4\)"), lambda c: c.append(k[0], v)),
        (
            "k heads",
            (ValueError, r"k has shape \(2, 3, 2, 4\)"),
            lambda c: c.append(randn(rng, (2, 3, 2, 4)), v),
        ),
        (
            "v dim",
            (ValueError, r"v has shape \(2, 2, 2, 4\)"),
            lambda c: c.append(k, randn(rng, (2, 2, 2, 4))),
        ),
        ("k batch", (ValueError, r"k has shape \(1, 2, 2, 4\)"), lambda c: c.append(k[:1], v[:1])),
        ("L differ", (ValueError, "lengths differ"), lambda c: c.append(k, v[:, :, :1])),
        ("int k", (TypeError, "float32 or float64"), lambda c: c.append(k.astype(np.int32), v)),
        (
            "complex v",
            (TypeError, "float32 or float64"),
            lambda c: c.append(k, v.astype(np.complex64)),
        ),
        (
            "f16 k",
            (TypeError, "float16 but the cache stores float32; cast"),
            lambda c: c.append(k.astype(np.float16), v),
        ),
        (
            "f64 k",
            (TypeError, "the cache stores float32"),
            lambda c: c.append(k.astype(F64), v.astype(F64)),
        ),
        (
            "lengths > L",
            (ValueError, "lengths must be <= 2"),
            lambda c: c.append(k, v, lengths=[3, 1]),
        ),
        (
            "lengths < 0",
            (ValueError, "lengths must be >= 0"),
            lambda c: c.append(k, v, lengths=[-1, 1]),
        ),
        (
            "lengths float",
            (TypeError, "lengths must be an int"),
            lambda c: c.append(k, v, lengths=[1.0, 1.0]),
        ),
        (
            "lengths bool",
            (TypeError, "lengths must be an int"),
            lambda c: c.append(k, v, lengths=[True, False]),
        ),
        (
            "lengths shape",
            (ValueError, r"shape \(2,\)"),
            lambda c: c.append(k, v, lengths=[1, 1, 1]),
        ),
        (
            "rope dim",
            (ValueError, "rope must be a RoPE with head_dim 4"),
            lambda c: c.append(k, v, rope=positional.RoPE(6)),
        ),
        ("k None", (TypeError, "k must be an array"), lambda c: c.append(None, v)),
        (
            "rope duck",
            (TypeError, "rope must be a positional.RoPE"),  # was AttributeError
            lambda c: c.append(k, v, rope=type("FakeRoPE", (), {"head_dim": 4})()),
        ),
    ]


@pytest.mark.parametrize("window", [None, 3])
def test_kv_cache_failing_append_leaves_it_unchanged(rng, window):
    cache = _filled_cache(rng, window)
    snap = snapshot_cache(cache)
    for _name, (exc, match), call in _bad_append_calls(rng):
        with pytest.raises(exc, match=match):
            call(cache)
        assert_same_cache(cache, snap)


@pytest.mark.parametrize("window", [None, 3])
def test_kv_cache_failing_truncate_leaves_it_unchanged(rng, window):
    cache = _filled_cache(rng, window)
    if window is not None:  # let the ring drop its oldest keys first
        for _ in range(4):
            cache.append(randn(rng, (2, 2, 1, 4)), randn(rng, (2, 2, 1, 3)))
    snap = snapshot_cache(cache)
    pos = cache.positions
    bad = [
        ((ValueError, "beyond the current lengths"), pos + 1),
        ((ValueError, "n must be >= 0"), -1),
        ((ValueError, "n must be >= 0"), [2, -1]),
        ((TypeError, "n must be an int"), 2.0),
        ((TypeError, "n must be an int"), True),
        ((TypeError, "n must be an int"), np.array([1.5, 1.0])),
        ((ValueError, r"shape \(2,\)"), [1, 1, 1]),
        ((ValueError, "beyond int64"), np.uint64(2**64 - 1)),  # was OverflowError
    ]
    if window is not None:
        bad.append(((ValueError, "no longer hold"), 0))
    for (exc, match), n in bad:
        with pytest.raises(exc, match=match):
            cache.truncate(n)
        assert_same_cache(cache, snap)


def test_kv_cache_failing_capacity_and_ring(rng):
    fixed = _filled_cache(rng, growable=False)
    snap = snapshot_cache(fixed)
    with pytest.raises(ValueError, match="fixed capacity 8"):
        fixed.append(randn(rng, (2, 2, 5, 4)), randn(rng, (2, 2, 5, 3)))
    assert_same_cache(fixed, snap)
    ring = _filled_cache(rng, window=3, growable=False)  # ring 6: at most 4 per append
    snap = snapshot_cache(ring)
    with pytest.raises(ValueError, match="does not fit the ring of 6 slots"):
        ring.append(randn(rng, (2, 2, 5, 4)), randn(rng, (2, 2, 5, 3)))
    assert_same_cache(ring, snap)


@pytest.mark.parametrize("window", [None, 3])
def test_kv_cache_failing_forward_leaves_it_unchanged(rng, window):
    """forward() checks everything (scale included) before it appends."""
    cache = _filled_cache(rng, window)
    snap = snapshot_cache(cache)
    q, k, v = randn(rng, (2, 4, 3, 4)), randn(rng, (2, 2, 3, 4)), randn(rng, (2, 2, 3, 3))
    calls = [
        ((TypeError, "scale must be a real number"), lambda: cache.forward(q, k, v, scale="0.5")),
        ((ValueError, "scale must be finite"), lambda: cache.forward(q, k, v, scale=np.nan)),
        ((ValueError, "same tokens"), lambda: cache.forward(q[:, :, :2], k, v)),
        ((ValueError, "head dim 3"), lambda: cache.forward(q[..., :3], k, v)),
        ((TypeError, "q has dtype float64"), lambda: cache.forward(q.astype(F64), k, v)),
    ]
    for (exc, match), call in calls:
        with pytest.raises(exc, match=match):
            call()
        assert_same_cache(cache, snap)


def test_kv_cache_attend_errors(rng):
    cache = _filled_cache(rng)
    snap = snapshot_cache(cache)
    q = randn(rng, (2, 4, 1, 4))
    calls = [
        (
            (ValueError, "scale must be finite"),
            lambda: cache.attend(q, scale=float("inf")),
        ),  # was a silent NaN/0 result
        ((ValueError, "scale must be finite"), lambda: cache.attend(q, scale=np.float32("nan"))),
        ((TypeError, "scale must be a real number"), lambda: cache.attend(q, scale=1j)),
        (
            (ValueError, r"q must be \(B, H_q, L_new, d\), got shape \(4, 1, 4\)"),
            lambda: cache.attend(q[0]),
        ),
        (
            (TypeError, "float16 but the cache stores float32; cast"),
            lambda: cache.attend(q.astype(np.float16)),
        ),
        ((TypeError, "float32 or float64"), lambda: cache.attend(q.astype(np.int64))),
        ((ValueError, "q_lens must be <= 1"), lambda: cache.attend(q, q_lens=[2, 1])),
        ((TypeError, "q_lens must be an int"), lambda: cache.attend(q, q_lens=0.5)),
        ((ValueError, "exceed the stored lengths"), lambda: cache.attend(randn(rng, (2, 4, 5, 4)))),
    ]
    for (exc, match), call in calls:
        with pytest.raises(exc, match=match):
            call()
    assert_same_cache(cache, snap)


def test_kv_cache_window_attend_needs_keys_the_ring_dropped(rng):
    """Queries reaching back past what the ring holds raise (they used to be
    answered silently over the keys that were left)."""
    B, H, d, w = 1, 1, 3, 2
    k, v, q = randn(rng, (B, H, 4, d)), randn(rng, (B, H, 4, d)), randn(rng, (B, H, 4, d))
    cache = af.KVCache(B, H, d, window=w, ring=2)
    cache.append(k[:, :, :2], v[:, :, :2])  # grows the ring to 3 slots
    cache.append(k[:, :, 2:], v[:, :, 2:])  # holds positions 1, 2, 3
    snap = snapshot_cache(cache)
    with pytest.raises(ValueError, match="reach back to positions \\[0\\]"):
        cache.attend(q[:, :, 1:], q_lens=3)  # row at position 1 needs key 0
    assert_same_cache(cache, snap)
    o = cache.attend(q[:, :, 2:], q_lens=2)  # rows at positions 2, 3: keys 1..3 suffice
    assert_close(o, ref.sdpa(q[:, :, 2:], k, v, mask=ref.window_mask(2, 4, w - 1, 0)), F32)


def test_kv_cache_attend_out(rng):
    cache = _filled_cache(rng)
    q = randn(rng, (2, 4, 2, 4))
    want = cache.attend(q, causal=False)
    shape = (2, 4, 2, 3)
    with pytest.raises(ValueError, match="out is read-only"):
        cache.attend(q, causal=False, out=readonly(np.empty(shape, F32)))
    with pytest.raises(ValueError, match=r"out has shape \(2, 4, 2, 4\), expected \(2, 4, 2, 3\)"):
        cache.attend(q, causal=False, out=np.empty((2, 4, 2, 4), F32))
    with pytest.raises(TypeError, match="out has dtype float64"):
        cache.attend(q, causal=False, out=np.empty(shape, F64))
    with pytest.raises(ValueError, match="aligned"):
        cache.attend(q, causal=False, out=misaligned(np.empty(shape, F32)))
    with pytest.raises(TypeError, match="out has dtype >f4"):
        cache.attend(q, causal=False, out=np.empty(shape, ">f4"))
    overlapping = np.lib.stride_tricks.as_strided(
        np.zeros(8, F32), shape, (0, 0, 4, 4)
    )  # writeable, racy
    with pytest.raises(ValueError, match="overlapping memory"):
        cache.attend(q, causal=False, out=overlapping)
    # Any strides work, and an out that shares memory with q gets the right result.
    out = np.full((2, 2, 4, 3), np.nan, F32).transpose(0, 2, 1, 3)
    assert cache.attend(q, causal=False, out=out) is out
    assert_close(out, want, F32)
    qq = randn(rng, (2, 4, 2, 4))
    want = cache.attend(qq.copy(), causal=False)
    res = cache.attend(qq, causal=False, out=qq[..., :3])
    assert_close(res, want, F32)


def test_kv_cache_attend_matches_oracle_after_truncate_and_ragged(rng):
    B, H, d = 2, 2, 4
    k, v, q = randn(rng, (B, H, 9, d)), randn(rng, (B, H, 9, d)), randn(rng, (B, 2 * H, 9, d))
    cache = af.KVCache(B, H, d, capacity=2)
    cache.append(k[:, :, :6], v[:, :, :6], lengths=np.array([6, 4], np.uint8))
    cache.truncate(np.array([5, 2], np.int16))
    np.testing.assert_array_equal(cache.lengths, [5, 2])
    o = cache.attend(q[:, :, :1], causal=False)
    for b, n in enumerate([5, 2]):
        assert_close(
            o[b],
            ref.sdpa(q[b, :, :1], np.repeat(k[b, :, :n], 2, 0), np.repeat(v[b, :, :n], 2, 0)),
            F32,
        )


# ---------------------------------------------------------------- LayerCaches


def test_layer_caches_truncate_is_all_or_nothing(rng):
    """Layer 0 can roll back to position 4, layer 2's ring no longer can: no layer changes."""
    caches = af.LayerCaches(3, 1, 2, 4, window=2, ring=3)
    for i, c in enumerate(caches):
        for _ in range(5 if i < 2 else 7):
            c.append(randn(rng, (1, 2, 1, 4)), randn(rng, (1, 2, 1, 4)))
    caches[0].truncate(4)  # possible on its own (it changes layer 0)
    caches[0].append(randn(rng, (1, 2, 1, 4)), randn(rng, (1, 2, 1, 4)))
    snaps = [snapshot_cache(c) for c in caches]
    with pytest.raises(ValueError, match="no longer hold"):
        caches.truncate(4)
    for c, s in zip(caches, snaps):
        assert_same_cache(c, s)


# ---------------------------------------------------------------- merge_attention_states


@pytest.mark.parametrize("layout", sorted(UNUSUAL_LAYOUTS))
def test_merge_unusual_layouts(rng, layout):
    q, k, v = (
        randn(rng, (2, 3, 4, 5), F64),
        randn(rng, (2, 3, 9, 5), F64),
        randn(rng, (2, 3, 9, 6), F64),
    )
    o_a, l_a = ref.sdpa(q, k[:, :, :4], v[:, :, :4], return_lse=True)
    o_b, l_b = ref.sdpa(q, k[:, :, 4:], v[:, :, 4:], return_lse=True)
    f = UNUSUAL_LAYOUTS[layout]
    o, lse = af.merge_attention_states(f(o_a), f(l_a), f(o_b), f(l_b))
    O, LSE = ref.sdpa(q, k, v, return_lse=True)
    assert_close(o, O, F64)
    assert_close(lse, LSE, F64)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (
            ((3, 4), (3,), (3, 4), (3,), (F32, F32, F64, F64)),
            TypeError,
            "mixed dtypes",
        ),  # was silently promoted
        (((3, 4), (3,), (3, 4), (3,), (F32, F64, F32, F32)), TypeError, "mixed dtypes"),
        (((), (), (), (), (F32,) * 4), ValueError, "at least one axis"),
        (
            ((3, 4), (3,), (3, 5), (3,), (F32,) * 4),
            ValueError,
            r"o_a has shape \(3, 4\) but o_b has shape \(3, 5\)",
        ),
        (((3, 4), (4,), (3, 4), (3,), (F32,) * 4), ValueError, r"lse_a \(4,\)"),
        (((3, 4), (3,), (3, 4), (3,), (np.float16,) * 4), TypeError, "float32 or float64"),
        (((3, 4), (3,), (3, 4), (3,), (np.int32,) * 4), TypeError, "float32 or float64"),
    ],
)
def test_merge_errors(rng, args, exc, match):
    *shapes, dts = args
    arrays = [randn(rng, s).astype(dt) for s, dt in zip(shapes, dts)]
    with pytest.raises(exc, match=match):
        af.merge_attention_states(*arrays)


def test_merge_nonfinite(rng):
    o_a, o_b = randn(rng, (4, 3)), randn(rng, (4, 3))
    l_a = np.array([0.5, -np.inf, np.nan, -np.inf], F32)
    l_b = np.array([-np.inf, 1.0, 0.0, -np.inf], F32)
    o_a[1] = np.nan  # an empty part's o is never read
    o, lse = af.merge_attention_states(o_a, l_a, o_b, l_b)
    assert_close(o[0], o_a[0], F32)
    assert_close(o[1], o_b[1], F32)
    assert np.isnan(o[2]).all() and np.isnan(lse[2])  # NaN lse: IEEE
    np.testing.assert_array_equal(o[3], 0)
    assert np.isneginf(lse[3])
