"""Bad and unusual input for every public entry point beyond sdpa itself.

tests/test_hardening.py covers ``scaled_dot_product_attention`` and
``attention``; this file does the same for masks, varlen_attention,
attention_weights, KVCache / LayerCaches / merge_attention_states, the
positional encodings, MultiHeadAttention, TransformerBlock,
TinyTransformerLM, the variants, set_num_threads and the C++ bindings called
directly. Every case is a clear exception naming the argument, or a result
checked against a float64 oracle; a call that fails on a cache or a module
leaves it unchanged. The decisions are listed in docs/HARDENING.md.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tol

import attn_fast as af
from attn_fast import _core, masks, positional, variants
from attn_fast import reference as ref

F32, F64 = np.float32, np.float64


def randn(rng, shape, dtype=F32):
    return rng.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------- unusual layouts of valid data


def misaligned(a):
    """A copy of `a` whose data starts at an odd byte address (np.frombuffer offset=1)."""
    buf = np.zeros(a.nbytes + 1, np.uint8)
    out = np.frombuffer(buf.data, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    out[...] = a
    assert not out.flags.aligned or a.itemsize == 1
    return out


def big_endian(a):
    return a.astype(a.dtype.newbyteorder(">"))


def reversed_view(a):
    """A negative-stride view (every axis reversed) holding the same values as `a`."""
    return np.flip(np.flip(a).copy())


def fortran(a):
    return np.asfortranarray(a)


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


LAYOUTS = {
    "misaligned": misaligned,
    "big_endian": big_endian,
    "neg_stride": reversed_view,
    "fortran": fortran,
    "readonly": readonly,
}


def close(got, want, dtype=F32):
    np.testing.assert_allclose(got, want, **tol(dtype))


# Values that are not ints where a count is expected, and what each raises.
NOT_INTS = [
    (2.5, TypeError),
    (True, TypeError),
    (np.True_, TypeError),
    ("3", TypeError),
    (None, TypeError),
]


# ---------------------------------------------------------------- varlen_attention


def _varlen_oracle(q, k, v, cu_q, cu_k, causal):
    out = np.zeros(q.shape[:2] + (v.shape[-1],))
    for s in range(len(cu_q) - 1):
        qs, ks, vs = (
            x.transpose(1, 0, 2)
            for x in (q[cu_q[s] : cu_q[s + 1]], k[cu_k[s] : cu_k[s + 1]], v[cu_k[s] : cu_k[s + 1]])
        )
        mask = ref.causal_mask(qs.shape[1], ks.shape[1]) if causal else None
        rep = qs.shape[0] // ks.shape[0]
        out[cu_q[s] : cu_q[s + 1]] = ref.sdpa(
            qs, np.repeat(ks, rep, 0), np.repeat(vs, rep, 0), mask=mask
        ).transpose(1, 0, 2)
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_varlen_unusual_layouts(rng, layout):
    cu_q, cu_k = np.array([0, 3, 3, 10]), np.array([0, 5, 6, 13])
    q, k, v = randn(rng, (10, 4, 5)), randn(rng, (13, 2, 5)), randn(rng, (13, 2, 3))
    f = LAYOUTS[layout]
    o = af.varlen_attention(f(q), f(k), f(v), f(cu_q), f(cu_k), causal=True)
    close(o, _varlen_oracle(q, k, v, cu_q, cu_k, True))


@pytest.mark.parametrize(
    "cu_q, match",
    [
        (
            np.array([0, 5, 3, 10], np.uint64),
            "non-decreasing",
        ),  # a uint64 diff used to wrap: accepted
        (np.array([0, 5, 3, 10], np.int32), "non-decreasing"),
        (np.array([1, 5, 10]), "must start at 0"),
        (np.array([0, 5, 11]), "must end at the packed length 10"),
        (np.array([0, 2**64 - 1], np.uint64), "beyond int64"),
        (np.array([[0, 10]]), r"1-D \(num_seqs \+ 1,\), got shape \(1, 2\)"),
        (np.array([0.0, 10.0]), "integer array"),
        (np.array([False, True]), "integer array"),
    ],
)
def test_varlen_bad_cu_seqlens(rng, cu_q, match):
    q = randn(rng, (10, 2, 4))
    cu_k = (
        np.array([0, 4, 7, 10])
        if cu_q.ndim == 1 and cu_q.size == 4
        else np.array([0, 10][: cu_q.size])
    )
    with pytest.raises(ValueError, match=match):
        af.varlen_attention(q, q, q, cu_q, cu_k if cu_k.size == cu_q.size else np.array([0, 10]))


@pytest.mark.parametrize("window_size", [(2.5, 0), (True, 0), (0, np.float64(1.0)), (3, "0")])
def test_window_size_entries_must_be_ints(rng, window_size):
    """window_size=(2.5, 0) was int(2.5) = a window of 2, silently."""
    q = randn(rng, (6, 2, 4))
    with pytest.raises(TypeError, match=r"window_size\[[01]\] must be an int"):
        af.scaled_dot_product_attention(q, q, q, window_size=window_size)
    with pytest.raises(TypeError, match=r"window_size\[[01]\] must be an int"):
        af.varlen_attention(q, q, q, [0, 6], [0, 6], window_size=window_size)


def test_varlen_bad_arguments(rng):
    q = randn(rng, (10, 2, 4))
    cu = np.array([0, 4, 10])
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        af.varlen_attention(q, q, q, cu, cu, max_seqlen_q=6.5)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        af.varlen_attention(q, q, q, cu, cu, max_seqlen_k=True)
    with pytest.raises(ValueError, match=r"k has shape \(10, 2, 5\) but q has head dim 4"):
        af.varlen_attention(q, randn(rng, (10, 2, 5)), q, cu, cu)
    with pytest.raises(ValueError, match="total length and heads must match"):
        af.varlen_attention(q, q, q[:9], cu, cu)
    with pytest.raises(TypeError, match="mixed dtypes"):
        af.varlen_attention(q, q, q.astype(F64), cu, cu)
    with pytest.raises(TypeError, match="mixed dtypes"):  # float16 itself is supported
        af.varlen_attention(q.astype(np.float16), q, q, cu, cu)
    with pytest.raises(TypeError, match="float32 or float64"):
        af.varlen_attention(q.astype(np.int16), q, q, cu, cu)
    with pytest.raises(ValueError, match="2 sequences but cu_seqlens_k has 1"):
        af.varlen_attention(q, q, q, cu, np.array([0, 10]))
    with pytest.raises(ValueError, match="scale must be finite"):
        af.varlen_attention(q, q, q, cu, cu, scale=np.inf)
    with pytest.raises(ValueError, match="out is read-only"):
        af.varlen_attention(q, q, q, cu, cu, out=readonly(np.empty_like(q)))


# ---------------------------------------------------------------- attention_weights


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_attention_weights_unusual_layouts(rng, layout):
    q, k = randn(rng, (2, 3, 5, 4)), randn(rng, (2, 3, 7, 4))
    bias = randn(rng, (5, 7))
    f = LAYOUTS[layout]
    P = af.attention_weights(f(q), f(k), attn_mask=f(bias), is_causal=True)
    S = (q.astype(F64) @ np.swapaxes(k, -1, -2)) / 2.0 + bias
    S = np.where(ref.causal_mask(5, 7), S, -np.inf)
    close(P, ref.softmax(S))


def test_attention_weights_bad_input(rng):
    q = randn(rng, (2, 3, 5, 4))
    with pytest.raises(ValueError, match=r"k has shape \(2, 3, 7, 3\) but q has head dim 4"):
        af.attention_weights(q, randn(rng, (2, 3, 7, 3)))
    with pytest.raises(TypeError, match="float32 or float64"):
        af.attention_weights(q.astype(np.complex64), q)
    with pytest.raises(TypeError, match="mixed dtypes"):
        af.attention_weights(q, q.astype(F64))
    with pytest.raises(ValueError, match="not broadcastable"):
        af.attention_weights(q, q, attn_mask=np.ones((4, 5), bool))
    with pytest.raises(ValueError, match="max_elements"):
        af.attention_weights(q, q, max_elements=10)
    with pytest.raises(TypeError, match="max_elements must be an int"):
        af.attention_weights(q, q, max_elements=True)
    with pytest.raises(ValueError, match="scale must be finite"):
        af.attention_weights(q, q, scale=float("nan"))


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


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", ["bool", "bias"])
def test_dense_mask_unusual_layouts(rng, layout, kind):
    """Boolean masks and float biases read misaligned, big-endian, reversed,
    Fortran-ordered or read-only, inside Dense and combined with other masks."""
    q, k, v = randn(rng, (2, 3, 9, 5)), randn(rng, (2, 3, 11, 5)), randn(rng, (2, 3, 11, 4))
    if kind == "bool":
        m = rng.random((3, 9, 11)) < 0.7
        want = dict(mask=m & ref.causal_mask(9, 11))
    else:
        m = randn(rng, (3, 9, 11))
        want = dict(bias=m, mask=ref.causal_mask(9, 11))
    lens = np.array([11, 11])
    mask = masks.Dense(LAYOUTS[layout](m)) & masks.Padding(LAYOUTS[layout](lens)) & masks.Causal()
    o, lse = af.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    O, LSE = ref.sdpa(q, k, v, return_lse=True, **want)
    close(o, O)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(LSE))


def test_broadcast_mask_views(rng):
    """Zero-stride (broadcast) mask and bias views: read through their strides."""
    q, k, v = randn(rng, (2, 3, 6, 4)), randn(rng, (2, 3, 8, 4)), randn(rng, (2, 3, 8, 4))
    row = rng.random(8) < 0.6
    row[0] = True
    m = np.broadcast_to(row, (2, 3, 6, 8))
    bias = np.broadcast_to(randn(rng, (1, 8)), (6, 8))
    o = af.scaled_dot_product_attention(q, k, v, attn_mask=[masks.Dense(m), bias])
    close(o, ref.sdpa(q, k, v, mask=m, bias=bias))


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
    close(out, want)


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
    close(o[:, :, rows], ref.sdpa(q, k, v, bias=np.where(vis, bias, -np.inf))[:, :, rows])


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


# ---------------------------------------------------------------- KVCache: correct results on odd inputs


def _cache_oracle(q, k, v, window=None):
    Lq, Lk = q.shape[-2], k.shape[-2]
    mask = ref.causal_mask(Lq, Lk) if window is None else ref.window_mask(Lq, Lk, window - 1, 0)
    return ref.sdpa(q, k, v, mask=mask, return_lse=True)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("window", [None, 4])
def test_kv_cache_unusual_layouts(rng, layout, window):
    B, Hq, Hkv, L, d, dv = 2, 4, 2, 11, 5, 3
    q, k, v = randn(rng, (B, Hq, L, d)), randn(rng, (B, Hkv, L, d)), randn(rng, (B, Hkv, L, dv))
    f = LAYOUTS[layout]
    cache = af.KVCache(B, Hkv, d, capacity=3, v_head_dim=dv, window=window)
    outs, lses = [], []
    for t0, t1 in [(0, 6), (6, 7), (7, 11)]:
        cache.append(f(k[:, :, t0:t1]), f(v[:, :, t0:t1]))
        o, lse = cache.attend(f(q[:, :, t0:t1]), return_lse=True)
        outs.append(o)
        lses.append(lse)
    O, LSE = _cache_oracle(q, k, v, window)
    close(np.concatenate(outs, axis=2), O)
    close(np.concatenate(lses, axis=2), LSE)


def test_kv_cache_broadcast_inputs(rng):
    """Zero-stride k / v / q views are read through their strides."""
    B, H, L, d = 2, 2, 6, 4
    k = np.broadcast_to(randn(rng, (1, H, L, d)), (B, H, L, d))
    v = np.broadcast_to(randn(rng, (B, 1, L, d)), (B, H, L, d))
    q = np.broadcast_to(randn(rng, (1, 1, L, d)), (B, H, L, d))
    cache = af.KVCache(B, H, d)
    o = cache.forward(q, k, v)
    close(o, _cache_oracle(q, k, v)[0])


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
    """A NaN key reaches exactly the rows that see it; once the window drops it, rows are exact again."""
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
        close(
            o[:, :, :4], _cache_oracle(q[:, :, :4], k[:, :, :4], v[:, :, :4], window)[0]
        )  # before the NaN key
        if window is None:
            assert np.isnan(o[:, :, 4:]).all()
        else:
            assert np.isnan(o[:, :, 4 : 4 + w]).all()  # rows 4, 5, 6 see the NaN key 4
            # Rows 7.. no longer see key 4; rows 7, 8 see the inf in v[6, 1] (in that column only).
            O, _ = _cache_oracle(
                q, k, v, window
            )  # the oracle multiplies masked weights by 0: compare finite columns
            close(o[:, :, 4 + w :, [0, 2, 3]], O[:, :, 4 + w :, [0, 2, 3]])
            assert not np.isfinite(o[:, :, 7:9, 1]).any()
            v9 = v.copy()
            v9[:, :, 6] = 0
            close(o[:, :, 9], _cache_oracle(q, k, v9, window)[0][:, :, 9])


# ---------------------------------------------------------------- KVCache: errors leave it unchanged


def _snapshot(cache):
    return (
        len(cache),
        cache.lengths,
        cache.positions,
        cache.capacity,
        [(cache.keys(b).copy(), cache.values(b).copy()) for b in range(cache.batch)],
    )


def _assert_same(cache, snap):
    now = _snapshot(cache)
    assert now[0] == snap[0] and now[3] == snap[3]
    np.testing.assert_array_equal(now[1], snap[1])
    np.testing.assert_array_equal(now[2], snap[2])
    for (k0, v0), (k1, v1) in zip(snap[4], now[4]):
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)


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
    snap = _snapshot(cache)
    for name, (exc, match), call in _bad_append_calls(rng):
        with pytest.raises(exc, match=match):
            call(cache)
        _assert_same(cache, snap)


@pytest.mark.parametrize("window", [None, 3])
def test_kv_cache_failing_truncate_leaves_it_unchanged(rng, window):
    cache = _filled_cache(rng, window)
    if window is not None:  # let the ring drop its oldest keys first
        for _ in range(4):
            cache.append(randn(rng, (2, 2, 1, 4)), randn(rng, (2, 2, 1, 3)))
    snap = _snapshot(cache)
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
        _assert_same(cache, snap)


def test_kv_cache_failing_capacity_and_ring(rng):
    fixed = _filled_cache(rng, growable=False)
    snap = _snapshot(fixed)
    with pytest.raises(ValueError, match="fixed capacity 8"):
        fixed.append(randn(rng, (2, 2, 5, 4)), randn(rng, (2, 2, 5, 3)))
    _assert_same(fixed, snap)
    ring = _filled_cache(rng, window=3, growable=False)  # ring 6: at most 4 per append
    snap = _snapshot(ring)
    with pytest.raises(ValueError, match="does not fit the ring of 6 slots"):
        ring.append(randn(rng, (2, 2, 5, 4)), randn(rng, (2, 2, 5, 3)))
    _assert_same(ring, snap)


@pytest.mark.parametrize("window", [None, 3])
def test_kv_cache_failing_forward_leaves_it_unchanged(rng, window):
    """forward() checks everything (scale included) before it appends."""
    cache = _filled_cache(rng, window)
    snap = _snapshot(cache)
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
        _assert_same(cache, snap)


def test_kv_cache_attend_errors(rng):
    cache = _filled_cache(rng)
    snap = _snapshot(cache)
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
    _assert_same(cache, snap)


def test_kv_cache_window_attend_needs_keys_the_ring_dropped(rng):
    """Queries reaching back past what the ring holds raise (they used to be
    answered silently over the keys that were left)."""
    B, H, d, w = 1, 1, 3, 2
    k, v, q = randn(rng, (B, H, 4, d)), randn(rng, (B, H, 4, d)), randn(rng, (B, H, 4, d))
    cache = af.KVCache(B, H, d, window=w, ring=2)
    cache.append(k[:, :, :2], v[:, :, :2])  # grows the ring to 3 slots
    cache.append(k[:, :, 2:], v[:, :, 2:])  # holds positions 1, 2, 3
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="reach back to positions \\[0\\]"):
        cache.attend(q[:, :, 1:], q_lens=3)  # row at position 1 needs key 0
    _assert_same(cache, snap)
    o = cache.attend(q[:, :, 2:], q_lens=2)  # rows at positions 2, 3: keys 1..3 suffice
    close(o, ref.sdpa(q[:, :, 2:], k, v, mask=ref.window_mask(2, 4, w - 1, 0)))


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
    close(out, want)
    qq = randn(rng, (2, 4, 2, 4))
    want = cache.attend(qq.copy(), causal=False)
    res = cache.attend(qq, causal=False, out=qq[..., :3])
    close(res, want)


def test_kv_cache_attend_matches_oracle_after_truncate_and_ragged(rng):
    B, H, d = 2, 2, 4
    k, v, q = randn(rng, (B, H, 9, d)), randn(rng, (B, H, 9, d)), randn(rng, (B, 2 * H, 9, d))
    cache = af.KVCache(B, H, d, capacity=2)
    cache.append(k[:, :, :6], v[:, :, :6], lengths=np.array([6, 4], np.uint8))
    cache.truncate(np.array([5, 2], np.int16))
    np.testing.assert_array_equal(cache.lengths, [5, 2])
    o = cache.attend(q[:, :, :1], causal=False)
    for b, n in enumerate([5, 2]):
        close(
            o[b], ref.sdpa(q[b, :, :1], np.repeat(k[b, :, :n], 2, 0), np.repeat(v[b, :, :n], 2, 0))
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
    snaps = [_snapshot(c) for c in caches]
    with pytest.raises(ValueError, match="no longer hold"):
        caches.truncate(4)
    for c, s in zip(caches, snaps):
        _assert_same(c, s)


# ---------------------------------------------------------------- merge_attention_states


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_merge_unusual_layouts(rng, layout):
    q, k, v = (
        randn(rng, (2, 3, 4, 5), F64),
        randn(rng, (2, 3, 9, 5), F64),
        randn(rng, (2, 3, 9, 6), F64),
    )
    o_a, l_a = ref.sdpa(q, k[:, :, :4], v[:, :, :4], return_lse=True)
    o_b, l_b = ref.sdpa(q, k[:, :, 4:], v[:, :, 4:], return_lse=True)
    f = LAYOUTS[layout]
    o, lse = af.merge_attention_states(f(o_a), f(l_a), f(o_b), f(l_b))
    O, LSE = ref.sdpa(q, k, v, return_lse=True)
    close(o, O, F64)
    close(lse, LSE, F64)


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
    close(o[0], o_a[0])
    close(o[1], o_b[1])
    assert np.isnan(o[2]).all() and np.isnan(lse[2])  # NaN lse: IEEE
    np.testing.assert_array_equal(o[3], 0)
    assert np.isneginf(lse[3])


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
            "dtype must be float32 or float64",
        ),  # was truncated to ints
        (dict(L=3, D=4, dtype=np.complex64), TypeError, "dtype must be float32 or float64"),
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


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_unusual_layouts(rng, layout, interleaved):
    x = randn(rng, (2, 7, 3, 8))
    rope = positional.RoPE(8, interleaved=interleaved, rotary_dim=6)
    want = positional.rope_reference(
        x.transpose(0, 2, 1, 3), np.arange(5, 12), rotary_dim=6, interleaved=interleaved
    ).transpose(0, 2, 1, 3)
    got = rope(LAYOUTS[layout](x), offset=5)
    close(got, want)
    q, k = rope.rotate_qk(LAYOUTS[layout](x), LAYOUTS[layout](x[:, :, :1]), offset=5)
    close(q, want)
    close(k, want[:, :, :1])


def test_rope_misaligned_in_place(rng):
    x = randn(rng, (5, 2, 4), F64)
    y = misaligned(x)
    rope = positional.RoPE(4)
    assert rope(y, inplace=True) is y
    close(y, positional.rope_reference(x.transpose(1, 0, 2), np.arange(5)).transpose(1, 0, 2), F64)


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


# ---------------------------------------------------------------- MultiHeadAttention


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(d_model=8.0, num_heads=2), TypeError, "d_model must be an int"),  # was int(8.0)
        (dict(d_model=8, num_heads=True), TypeError, "num_heads must be an int"),
        (dict(d_model=8, num_heads=0), ValueError, "num_heads must be >= 1"),
        (dict(d_model=8, num_heads=4, num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
        (dict(d_model=8, num_heads=4, num_kv_heads=2.0), TypeError, "num_kv_heads must be an int"),
        (dict(d_model=8, num_heads=3), ValueError, "not divisible"),
        (dict(d_model=8, num_heads=2, head_dim=-1), ValueError, "head_dim must be >= 1"),
        (dict(d_model=8, num_heads=2, kv_dim=0), ValueError, "kv_dim must be >= 1"),
        (
            dict(d_model=8, num_heads=2, scale=np.nan),
            ValueError,
            "scale must be finite",
        ),  # was a NaN output
        (
            dict(d_model=8, num_heads=2, dtype=np.float16),
            TypeError,
            "dtype must be float32 or float64",
        ),
        (dict(d_model=8, num_heads=2, positional="alibi"), ValueError, "positional must be"),
        (
            dict(d_model=8, num_heads=2, positional=positional.RoPE(6)),
            ValueError,
            "RoPE has head_dim 6",
        ),
        (dict(d_model=8, num_heads=2, rng=True), TypeError, "rng must be"),
        (dict(d_model=8, num_heads=2, rng=1.5), TypeError, "rng must be"),
    ],
)
def test_mha_constructor_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        af.MultiHeadAttention(**kw)


def _mha_oracle(m, x, causal=False, context=None):
    x = x.astype(F64)
    c = x if context is None else context.astype(F64)
    H, Hkv, dh = m.num_heads, m.num_kv_heads, m.head_dim
    q = (x @ m.Wq.T.astype(F64)).reshape(x.shape[0], -1, H, dh).transpose(0, 2, 1, 3)
    k = (c @ m.Wk.T.astype(F64)).reshape(c.shape[0], -1, Hkv, dh).transpose(0, 2, 1, 3)
    v = (c @ m.Wv.T.astype(F64)).reshape(c.shape[0], -1, Hkv, dh).transpose(0, 2, 1, 3)
    mask = ref.causal_mask(q.shape[2], k.shape[2]) if causal else None
    o = ref.sdpa(q, k, v, mask=mask, scale=m.scale)
    return o.transpose(0, 2, 1, 3).reshape(x.shape[0], -1, H * dh) @ m.Wo.T.astype(F64)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mha_unusual_layouts(rng, layout):
    m = af.MultiHeadAttention(12, 4, 2, rng=1)
    x, ctx = randn(rng, (2, 5, 12)), randn(rng, (2, 7, 12))
    f = LAYOUTS[layout]
    close(m(f(x), causal=True), _mha_oracle(m, x, causal=True))
    close(m(f(x), context=f(ctx)), _mha_oracle(m, x, context=ctx))


def test_mha_call_errors(rng):
    m = af.MultiHeadAttention(8, 2, rng=0)
    x = randn(rng, (2, 5, 8))
    with pytest.raises(TypeError, match="x has dtype float64"):
        m(x.astype(F64))
    with pytest.raises(TypeError, match="x must be float32 or float64"):
        m(np.ones((2, 5, 8), np.int64))
    with pytest.raises(
        ValueError, match=r"x must be \(L, 8\) or \(B, L, 8\), got shape \(2, 5, 7\)"
    ):
        m(x[..., :7])
    with pytest.raises(ValueError, match=r"got shape \(1, 2, 5, 8\)"):
        m(x[None])
    with pytest.raises(ValueError, match="batch sizes differ"):
        m(x, context=x[:1])
    with pytest.raises(ValueError, match="not broadcastable"):
        m(x, mask=np.ones((5, 6), bool))
    with pytest.raises(ValueError, match="positions= is only meaningful"):
        m(x, positions=np.arange(5))
    with pytest.raises(
        TypeError, match="cache must be a KVCache"
    ):  # was AttributeError: no 'append'
        m(x, cache=af.LayerCaches(1, 2, 2, 4))
    with pytest.raises(ValueError, match="cache has .* = \\(2, 1, 4, 4, float32\\)"):
        m(x, cache=af.KVCache(2, 1, 4))
    with pytest.raises(ValueError, match="cache has"):
        m(x, cache=af.KVCache(2, 2, 4, dtype=F64))


def test_mha_zero_length_and_nan_rows(rng):
    m = af.MultiHeadAttention(8, 2, rng=0)
    assert m(randn(rng, (2, 0, 8))).shape == (2, 0, 8)
    assert m(randn(rng, (0, 3, 8))).shape == (0, 3, 8)
    x = randn(rng, (1, 6, 8))
    x[0, 3, 1] = np.nan
    y = m(x, causal=True)
    assert np.isnan(y[0, 3:]).all()  # rows that see token 3
    close(y[0, :3], _mha_oracle(m, x[:, :3], causal=True)[0])


def test_mha_cache_failure_leaves_cache_unchanged(rng):
    m = af.MultiHeadAttention(8, 2, positional="rope", rng=0)
    cache = af.KVCache(1, 2, 4, capacity=4, growable=False)
    m(randn(rng, (1, 3, 8)), cache=cache, causal=True)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="fixed capacity"):
        m(randn(rng, (1, 2, 8)), cache=cache, causal=True)
    with pytest.raises(ValueError, match="mask= cannot be combined"):
        m(randn(rng, (1, 1, 8)), cache=cache, mask=np.ones((1, 4), bool))
    with pytest.raises(TypeError, match="x has dtype"):
        m(randn(rng, (1, 1, 8), F64), cache=cache)
    _assert_same(cache, snap)


def _bad_weights(sd, name, value):
    w = {k: v.copy() for k, v in sd.items()}
    w[name] = value
    first = next(iter(sd))
    if first != name:
        w[first] = np.full_like(sd[first], 7)  # a good weight that must not be copied either
    return w


@pytest.mark.parametrize(
    "value, exc, match",
    [
        (np.ones((3, 3), F32), ValueError, r"has shape \(3, 3\), expected \(8, 8\)"),
        ("nan", ValueError, "contains NaN or inf"),
        ("complex", TypeError, "real numeric array"),
        ("bool", TypeError, "real numeric array"),
    ],
)
def test_mha_load_weights_is_all_or_nothing(value, exc, match):
    m = af.MultiHeadAttention(8, 2, rng=0)
    sd = {k: v.copy() for k, v in m.state_dict().items()}
    shape = sd["Wo"].shape
    value = (
        {
            "nan": np.full(shape, np.nan, F32),
            "complex": np.ones(shape, np.complex64),
            "bool": np.ones(shape, bool),
        }.get(value, value)
        if isinstance(value, str)
        else value
    )
    with pytest.raises(exc, match=match):
        m.load_weights(_bad_weights(sd, "Wo", value))  # Wq was copied before Wo failed
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, sd[k])


# ---------------------------------------------------------------- TransformerBlock


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(d_ff=-1), ValueError, "d_ff must be >= 1"),  # was numpy's "negative dimensions"
        (dict(d_ff=0), ValueError, "d_ff must be >= 1"),
        (dict(d_ff=16.0), TypeError, "d_ff must be an int"),
        (dict(eps=np.nan), ValueError, "eps must be finite"),  # was a NaN output
        (dict(eps=-1e-5), ValueError, "eps must be >= 0"),
        (dict(norm="batchnorm"), ValueError, "norm must be one of"),
        (dict(ffn="relu"), ValueError, "ffn must be one of"),
        (dict(dtype=np.int32), TypeError, "dtype must be float32 or float64"),
        (dict(num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
    ],
)
def test_block_constructor_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        af.TransformerBlock(8, 2, **kw)


def test_block_call_errors(rng):
    blk = af.TransformerBlock(8, 2, rng=0)
    x = randn(rng, (2, 5, 8))
    with pytest.raises(ValueError, match="context= is required"):
        blk(x, context=x)
    with pytest.raises(TypeError, match="x has dtype float64"):
        blk(x.astype(F64))
    with pytest.raises(ValueError, match=r"got shape \(2, 5, 4\)"):
        blk(x[..., :4])
    cross = af.TransformerBlock(8, 2, cross_attention=True, rng=0)
    with pytest.raises(ValueError, match="context= is required"):
        cross(x)
    with pytest.raises(ValueError, match="batch sizes differ"):
        cross(x, context=x[:1])


def test_block_load_weights_is_all_or_nothing():
    blk = af.TransformerBlock(8, 2, rng=0)
    sd = {k: v.copy() for k, v in blk.state_dict().items()}
    with pytest.raises(ValueError, match=r"ffn.W2 has shape \(1, 1\)"):
        blk.load_weights(_bad_weights(sd, "ffn.W2", np.ones((1, 1), F32)))
    for k, v in blk.state_dict().items():
        np.testing.assert_array_equal(v, sd[k])


# ---------------------------------------------------------------- TinyTransformerLM


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(vocab_size=0), ValueError, "vocab_size must be >= 1"),
        (dict(vocab_size=11.0), TypeError, "vocab_size must be an int"),
        (dict(num_layers=2.5), TypeError, "num_layers must be an int"),  # was int(2.5) = 2 layers
        (dict(num_layers=0), ValueError, "num_layers must be >= 1"),
        (dict(num_heads=True), TypeError, "num_heads must be an int"),
        (dict(positional="alibi"), ValueError, "positional must be"),
        (dict(head_dim=4.0), TypeError, "head_dim must be an int"),
        (dict(dtype=np.float16), TypeError, "dtype must be float32 or float64"),
    ],
)
def test_lm_constructor_errors(kw, exc, match):
    args = dict(vocab_size=11, d_model=8, num_layers=2, num_heads=2)
    args.update(kw)
    with pytest.raises(exc, match=match):
        af.TinyTransformerLM(**args)


@pytest.fixture(scope="module")
def lm():
    return af.TinyTransformerLM(11, 8, 2, 2, num_kv_heads=1, seed=3)


@pytest.mark.parametrize(
    "tokens, exc, match",
    [
        (np.array([1.0, 2.0]), TypeError, "tokens must be an integer array"),
        (np.array([True, False]), TypeError, "tokens must be an integer array"),
        (np.array([1, 11]), ValueError, r"\[0, vocab_size=11\)"),
        (np.array([-1, 2]), ValueError, r"\[0, vocab_size=11\)"),
        (np.ones((1, 1, 2), int), ValueError, r"\(L,\) or \(B, L\)"),
        (np.int64(3), ValueError, r"\(L,\) or \(B, L\)"),
    ],
)
def test_lm_token_errors(lm, tokens, exc, match):
    with pytest.raises(exc, match=match):
        lm.forward(tokens)


def test_lm_generate_errors(lm):
    for bad, exc in [
        (2.5, TypeError),
        (True, TypeError),
        (-1, ValueError),
    ]:  # 2.5 and True used to run
        with pytest.raises(exc, match="max_new_tokens"):
            lm.generate([1, 2], bad)
    for bad, exc in [(np.nan, ValueError), (-0.5, ValueError), ("hot", TypeError)]:
        with pytest.raises(exc, match="temperature"):
            lm.generate([1, 2], 2, temperature=bad)
    with pytest.raises(ValueError, match="at least one token"):
        lm.generate(np.zeros((2, 0), int), 2)
    np.testing.assert_array_equal(lm.generate(np.array([3, 4], np.uint8), 0), [3, 4])


def test_lm_forward_bad_cache_leaves_every_layer_unchanged(lm, rng):
    good = lm.make_cache(1, 8)
    lm.forward(np.array([[1, 2, 3]]), cache=good)
    snaps = [_snapshot(c) for c in good]
    odd = [
        good[0],
        af.KVCache(1, 1, 4, capacity=8, dtype=F64),
    ]  # layer 1's cache has the wrong dtype
    with pytest.raises(ValueError, match=r"cache\[1\]"):
        lm.forward(np.array([[4]]), cache=odd)
    with pytest.raises(ValueError, match="cache has 1 layers"):
        lm.forward(np.array([[4]]), cache=[good[0]])
    with pytest.raises(ValueError, match="cache has"):
        lm.forward(np.array([[4], [5]]), cache=good)  # batch 2, cache batch 1
    with pytest.raises(TypeError, match=r"cache\[1\]: cache must be a KVCache"):
        lm.forward(np.array([[4]]), cache=[good[0], None])
    fixed = af.LayerCaches(2, 1, 1, 4, capacity=4, growable=False)
    lm.forward(np.array([[1, 2]]), cache=fixed)
    fixed_snaps = [_snapshot(c) for c in fixed]
    mixed = [fixed[0], good[1]]
    with pytest.raises(ValueError, match="different positions"):
        lm.forward(np.array([[4]]), cache=mixed)
    with pytest.raises(ValueError, match=r"cache\[0\] .* no room for 3 more"):
        lm.forward(np.array([[4, 5, 6]]), cache=fixed)
    for c, s in zip(list(good) + list(fixed), snaps + fixed_snaps):
        _assert_same(c, s)
    # Layer 0 could take the chunk, layer 1's fixed ring cannot: neither changes.
    ring = [af.KVCache(1, 1, 4), af.KVCache(1, 1, 4, window=2, ring=2, growable=False)]
    with pytest.raises(ValueError, match=r"cache\[1\]: a chunk of 2 tokens does not fit"):
        lm.forward(np.array([[4, 5]]), cache=ring)
    assert len(ring[0]) == len(ring[1]) == 0


def test_lm_load_weights_is_all_or_nothing(lm):
    sd = {k: v.copy() for k, v in lm.state_dict().items()}
    with pytest.raises(ValueError, match="contains NaN"):
        lm.load_weights(_bad_weights(sd, "norm.weight", np.full(8, np.nan, F32)))
    with pytest.raises(KeyError, match="unknown weights: extra"):
        lm.load_weights({**sd, "extra": np.ones(1)})
    for k, v in lm.state_dict().items():
        np.testing.assert_array_equal(v, sd[k])


# ---------------------------------------------------------------- variants


def _lin_oracle(q, k, v, causal, eps=1e-6):
    fq = np.where(q > 0, q + 1.0, np.exp(np.minimum(q, 0))).astype(F64)
    fk = np.where(k > 0, k + 1.0, np.exp(np.minimum(k, 0))).astype(F64)
    A = fq @ np.swapaxes(fk, -1, -2)
    if causal:
        A = np.tril(A)
    return (A @ v.astype(F64)) / (A.sum(-1, keepdims=True) + eps)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_variants_unusual_layouts(rng, layout):
    f = LAYOUTS[layout]
    q, k, v = randn(rng, (2, 3, 6, 4)), randn(rng, (2, 3, 9, 4)), randn(rng, (2, 3, 9, 5))
    E = randn(rng, (4, 9))
    Kp, Vp = E.astype(F64) @ k, E.astype(F64) @ v
    close(variants.linformer_attention(f(q), f(k), f(v), f(E)), ref.sdpa(q, Kp, Vp))
    k6, v6 = k[:, :, :6], v[:, :, :6]
    close(variants.linear_attention(f(q), f(k6), f(v6), causal=True), _lin_oracle(q, k6, v6, True))
    o, _ = variants.linear_attention_step(f(q[:, :, 0]), f(k6[:, :, 0]), f(v6[:, :, 0]))
    close(o, _lin_oracle(q[:, :, :1], k6[:, :, :1], v6[:, :, :1], True)[:, :, 0])


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (
            lambda q: variants.linformer_attention(q, q, q, np.ones((2, 5), np.int32)),
            TypeError,
            "E must be float32",
        ),
        (
            lambda q: variants.linformer_attention(q, q, q, np.ones((2, 4), F32)),
            ValueError,
            r"E must be \(k, 5\)",
        ),
        (
            lambda q: variants.linformer_attention(q, q, q, np.ones(5, F32)),
            ValueError,
            r"E must be a \(k, L\)",
        ),
        (
            lambda q: variants.linformer_attention(
                q, q, q, np.ones((2, 5), F32), np.ones((3, 5), F32)
            ),
            ValueError,
            "same k",
        ),
        (
            lambda q: variants.linformer_attention(q, q[:1], q[:1], np.ones((2, 5), F32)),
            ValueError,
            "batch and heads",
        ),
        (lambda q: variants.linear_attention(q, q, q.astype(F64)), TypeError, "mixed dtypes"),
        (lambda q: variants.linear_attention(q, q[..., :2, :], q), ValueError, "must match"),
        (
            lambda q: variants.linear_attention(q, q, q, eps=np.nan),
            ValueError,
            "eps must be finite",
        ),
        (lambda q: variants.linear_attention(q, q, q, eps=-1.0), ValueError, "eps must be >= 0"),
        (
            lambda q: variants.linear_attention(q, q, q, feature_map="softmax"),
            ValueError,
            "unknown feature_map",
        ),
        (
            lambda q: variants.linear_attention(q, q, q, state=(1, 2)),
            TypeError,
            "LinearAttentionState",
        ),
        (
            lambda q: variants.linear_attention(
                q,
                q,
                q,
                state=variants.LinearAttentionState(
                    np.zeros((2, 3, 4, 4)), np.zeros((2, 3, 4)), 2.5
                ),
            ),
            TypeError,
            "state.length must be an int",
        ),
        (
            lambda q: variants.linear_attention_step(q[0, 0, 0], np.float32(1), q[0, 0, 0]),
            ValueError,
            r"k must be one token.*got shape \(\)",
        ),  # was IndexError
        (lambda q: variants.linear_attention_step(q, q, q), ValueError, "q must be one token"),
        (
            lambda q: variants.linear_attention_step(q[0, :, 0], q[0, :, 0], q[0, 0, 0]),
            ValueError,
            "must all be",
        ),
    ],
)
def test_variants_errors(rng, call, exc, match):
    with pytest.raises(exc, match=match):
        call(randn(rng, (2, 3, 5, 4)))


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(d_model=8.0), TypeError, "d_model must be an int"),  # was int(8.0)
        (dict(n_heads=True), TypeError, "n_heads must be an int"),
        (dict(seq_len=0), ValueError, "seq_len must be >= 1"),
        (dict(k=2.5), TypeError, "k must be an int"),
        (dict(n_heads=3), ValueError, "multiple of n_heads"),
        (dict(dtype=np.float16), TypeError, "dtype must be float32 or float64"),
    ],
)
def test_linformer_constructor_errors(kw, exc, match):
    args = dict(d_model=8, n_heads=2, seq_len=6, k=3)
    args.update(kw)
    with pytest.raises(exc, match=match):
        variants.Linformer(**args)


def test_linformer_layer_errors(rng):
    layer = variants.Linformer(8, 2, 6, 3, seed=0)
    with pytest.raises(ValueError, match="built for seq_len = 6"):
        layer(randn(rng, (7, 8)))
    with pytest.raises(ValueError, match=r"got shape \(5, 7\)"):
        layer(randn(rng, (5, 7)))
    with pytest.raises(TypeError, match="float32 or float64"):
        layer(np.ones((5, 8), np.int64))


# ---------------------------------------------------------------- set_num_threads


@pytest.mark.parametrize(
    "bad, exc",
    [
        (2.0, TypeError),
        (True, TypeError),
        (np.True_, TypeError),
        ("2", TypeError),
        (0, ValueError),
        (-1, ValueError),
        (2**31, ValueError),
    ],
)
def test_set_num_threads_errors_keep_the_setting(bad, exc):
    before = af.get_num_threads()
    with pytest.raises(exc, match="n must"):
        af.set_num_threads(bad)
    assert af.get_num_threads() == before


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
        close(o, ref.sdpa(q, k, v, scale=0.5))
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
        close(o, ref.sdpa(q, k, v, scale=0.5))
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
