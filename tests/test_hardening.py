"""Bad and unusual input: every case is a clear error or a correct result.

The decisions tested here are written down in docs/HARDENING.md: which
arguments are copied, which are rejected and with what, and what non-finite
values do (IEEE arithmetic of the textbook formula, as the float64 oracle
computes it, except that masked keys are never read into a row).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import (
    assert_attention,
    assert_close,
    assert_lse_close,
    needs_rlimit_as,
    poisoned,
    qkv,
    randn,
    random_mask,
)

import attn_fast as af
from attn_fast import reference as ref

sdpa = af.scaled_dot_product_attention
BACKENDS = ["fused", "reference"]


def check(o, q, k, v, lse=None, **kw):
    O, LSE = ref.sdpa(q, k, v, return_lse=True, **kw)
    assert_attention(o, lse, O, LSE, o.dtype)


# ---------------------------------------------------------------- ranks and shapes


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((8,), (8,), (8,)), "2, 3 or 4 dimensions"),
        (((1, 1, 1, 4, 8),) * 3, "2, 3 or 4 dimensions"),
        (((4, 8), (1, 4, 8), (1, 4, 8)), "same number of dimensions"),
        (
            ((2, 3, 4, 8), (2, 3, 5, 8), (2, 3, 6, 8)),
            r"k has shape \(2, 3, 5, 8\) but v has shape \(2, 3, 6, 8\)",
        ),
        (
            ((2, 3, 4, 8), (2, 3, 5, 9), (2, 3, 5, 8)),
            r"k has shape \(2, 3, 5, 9\) but q has head dim 8",
        ),
        (((2, 3, 4, 8), (1, 3, 5, 8), (1, 3, 5, 8)), "batch sizes differ"),
        (((2, 3, 4, 8), (2, 1, 5, 8), (2, 2, 5, 8)), "must match"),
        (((2, 3, 4, 8), (2, 1, 5, 8), (2, 1, 5, 8)), "enable_gqa"),
        (((2, 4, 4, 8), (2, 3, 5, 8), (2, 3, 5, 8)), "enable_gqa"),
        (((2, 3, 4, 0), (2, 3, 5, 0), (2, 3, 5, 8)), "head dim d must be at least 1"),
    ],
)
def test_shape_errors(shapes, match):
    q, k, v = (np.ones(s, np.float32) for s in shapes)
    with pytest.raises(ValueError, match=match):
        sdpa(q, k, v)


def test_gqa_shape_errors():
    q = np.ones((1, 4, 3, 8), np.float32)
    with pytest.raises(ValueError, match="not a multiple of k/v's 3 heads"):
        sdpa(q, q[:, :3], q[:, :3], enable_gqa=True)
    with pytest.raises(ValueError, match="not a multiple of k/v's 0 heads"):
        sdpa(q, q[:, :0], q[:, :0], enable_gqa=True)
    with pytest.raises(ValueError, match="not a multiple"):
        sdpa(q[:, :2], q, q, enable_gqa=True)  # more kv heads than q heads


def test_textbook_api_errors(rng):
    X, W = np.ones((5, 8)), np.ones((3, 8))
    with pytest.raises(ValueError, match=r"X must be \(L, D\) or \(B, L, D\)"):
        af.attention(np.ones((1, 1, 5, 8)), W, W, W)
    with pytest.raises(ValueError, match=r"Wq must be \(d, D\) with D = 8"):
        af.attention(X, np.ones(8), W, W)
    with pytest.raises(ValueError, match="d must match"):
        af.attention(X, W, np.ones((4, 8)), W)
    with pytest.raises(TypeError, match="float32 or float64"):
        af.attention(X.astype(np.int32), W, W, W)
    # Empty sequence and empty model dim are results, not errors.
    assert af.attention(np.ones((0, 8)), W, W, np.ones((2, 8))).shape == (0, 2)
    X0, W0 = np.ones((4, 0)), np.ones((3, 0))
    np.testing.assert_array_equal(af.attention(X0, W0, W0, W0), np.zeros((4, 3)))


# ---------------------------------------------------------------- dtypes


# float16 is a supported dtype (tests/test_dtypes.py); uint16 is not bfloat16
@pytest.mark.parametrize(
    "dtype",
    [np.uint16, np.int32, np.int64, np.uint8, np.bool_, np.complex128, object, "U3", "M8[s]"],
)
def test_non_float_dtypes_rejected(dtype):
    good = np.ones((4, 8), np.float32)
    bad = np.zeros((4, 8), dtype=dtype)
    for args in ((bad, good, good), (good, bad, good), (good, good, bad)):
        with pytest.raises(TypeError, match=r"must be float32 or float64, got dtype"):
            sdpa(*args)


def test_mixed_dtypes_rejected():
    a32, a64 = np.ones((4, 8), np.float32), np.ones((4, 8), np.float64)
    for args in ((a32, a64, a64), (a64, a32, a64), (a64, a64, a32)):
        with pytest.raises(TypeError, match="mixed dtypes"):
            sdpa(*args)
    with pytest.raises(TypeError, match="out has dtype float64, expected float32"):
        sdpa(a32, a32, a32, out=np.empty((4, 8), np.float64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_big_endian(rng, dtype):
    q, k, v = qkv(rng, dtype=dtype)
    be = [x.astype(np.dtype(dtype).newbyteorder(">")) for x in (q, k, v)]
    o, lse = sdpa(*be, return_lse=True, is_causal=True)
    assert o.dtype == dtype and o.dtype.isnative
    check(o, q, k, v, lse, mask=ref.causal_mask(9, 11))
    bias = randn(rng, (9, 11), dtype)
    o = sdpa(q, k, v, attn_mask=bias.astype(bias.dtype.newbyteorder(">")))
    check(o, q, k, v, bias=bias)
    # A big-endian out cannot be written in place: a clear TypeError.
    with pytest.raises(TypeError, match="out has dtype"):
        sdpa(q, k, v, out=np.empty(q.shape[:-1] + (7,), np.dtype(dtype).newbyteorder(">")))


# ---------------------------------------------------------------- memory layouts


def _aligned_off_by_one(x):
    """A copy of x whose data starts one byte past an aligned address."""
    raw = np.empty(x.nbytes + 1, np.uint8)
    y = raw[1:].view(x.dtype).reshape(x.shape)
    y[...] = x
    return y


@pytest.mark.parametrize("backend", BACKENDS)
def test_misaligned_inputs_and_mask(rng, backend):
    q, k, v = qkv(rng, dtype=np.float64)
    bias = randn(rng, (1, 3, 9, 11), np.float64)
    mq, mk, mv, mb = (_aligned_off_by_one(x) for x in (q, k, v, bias))
    assert not mq.flags.aligned
    o, lse = sdpa(mq, mk, mv, attn_mask=mb, return_lse=True, backend=backend)
    check(o, q, k, v, lse, bias=bias)


def test_misaligned_out_rejected(rng):
    q, k, v = qkv(rng)
    out = _aligned_off_by_one(np.zeros(q.shape[:-1] + (7,), np.float32))
    with pytest.raises(ValueError, match="out must be aligned"):
        sdpa(q, k, v, out=out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_zero_strides_fortran(isa, rng, backend):
    q, k, v = qkv(rng, B=2, Hq=2, Lq=13, Lk=17, d=6, dv=6)
    # Negative strides on every axis.
    nq, nk, nv = (x[::-1, ::-1, ::-1, ::-1] for x in (q, k, v))
    check(sdpa(nq, nk, nv, backend=backend), nq, nk, nv)
    # Zero strides (broadcast views) on every axis of q, and of k/v over batch and length.
    bq = np.broadcast_to(q[:1, :1, :1, :1], q.shape)
    bk = np.broadcast_to(k[:1, :, :1], k.shape)
    bv = np.broadcast_to(v[:, :, 3:4], v.shape)
    check(sdpa(bq, bk, bv, backend=backend), bq, bk, bv)
    check(sdpa(q, bk, v, backend=backend, is_causal=True), q, bk, v, mask=ref.causal_mask(13, 17))
    # Fortran order everywhere, including out.
    fq, fk, fv = (np.asfortranarray(x) for x in (q, k, v))
    out = np.asfortranarray(poisoned(q.shape[:-1] + (6,), np.float32))
    o = sdpa(fq, fk, fv, out=out, backend=backend)
    assert o is out
    check(o, q, k, v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_strided_view_leaves_rest_untouched(isa, rng, backend):
    q, k, v = qkv(rng, B=1, Hq=2, Lq=10, Lk=12, d=4, dv=5)
    big = poisoned((2, 4, 21, 11), np.float32)
    out = big[1, ::2, ::-2, 1::2]  # (2, 11, 5): wrong length first
    with pytest.raises(ValueError, match=r"out has shape \(2, 11, 5\), expected \(2, 10, 5\)"):
        sdpa(q[0], k[0], v[0], out=out)
    out = big[1, ::2, 1:-1:2, 1::2]  # (2, 10, 5)
    o = sdpa(q[0], k[0], v[0], out=out, backend=backend)
    assert o is out and np.shares_memory(o, big)
    check(o, q[0], k[0], v[0])
    written = np.zeros(big.shape, bool)
    written[1, ::2, 1:-1:2, 1::2] = True
    assert np.all(np.isnan(big[~written]))  # nothing outside the view was touched


def test_out_errors():
    q = np.ones((1, 2, 4, 8), np.float32)
    ro = np.empty((1, 2, 4, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        sdpa(q, q, q, out=ro)
    with pytest.raises(ValueError, match="read-only"):
        sdpa(q, q, q, out=np.broadcast_to(np.empty(8, np.float32), (1, 2, 4, 8)))
    # Writeable but self-overlapping (zero stride): the threads would race.
    over = np.lib.stride_tricks.as_strided(np.empty(8, np.float32), (1, 2, 4, 8), (0, 0, 0, 4))
    assert over.flags.writeable
    with pytest.raises(ValueError, match="out has overlapping memory"):
        sdpa(q, q, q, out=over)
    with pytest.raises(TypeError, match="out must be a numpy.ndarray"):
        sdpa(q, q, q, out=np.zeros((1, 2, 4, 8), np.float32).tolist())


@pytest.mark.parametrize("which", ["q", "k", "v", "mask"])
def test_out_aliasing_an_input(rng, which):
    # out that shares memory with an input is computed into a temporary first.
    B, H, L, d = 1, 2, 70, 8
    q, k, v = qkv(rng, B, H, H, L, L, d, d, np.float64)
    bias = randn(rng, (B, H, L, L), np.float64)
    expect = ref.sdpa(q, k, v, bias=bias)
    args = {"q": q.copy(), "k": k.copy(), "v": v.copy(), "mask": bias.copy()}
    out = args[which] if which != "mask" else args["mask"][..., :d]
    o = sdpa(args["q"], args["k"], args["v"], attn_mask=args["mask"], out=out)
    assert o is out
    assert_close(o, expect, np.float64)


# ---------------------------------------------------------------- empty axes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape",
    [
        (0, 2, 5, 5, 4, 4),
        (2, 0, 5, 5, 4, 4),
        (2, 2, 0, 5, 4, 4),
        (2, 2, 5, 0, 4, 4),
        (2, 2, 5, 5, 4, 0),
        (1, 1, 0, 0, 4, 0),
    ],
    ids=["B0", "H0", "Lq0", "Lk0", "dv0", "all0"],
)
def test_zero_size_axes(rng, backend, shape):
    B, H, Lq, Lk, d, dv = shape
    q, k, v = qkv(rng, B, H, H, Lq, Lk, d, dv)
    o, lse = sdpa(q, k, v, return_lse=True, backend=backend, is_causal=True)
    assert o.shape == (B, H, Lq, dv) and lse.shape == (B, H, Lq)
    O, LSE = ref.sdpa(q, k, v, mask=ref.causal_mask(Lq, Lk), return_lse=True)
    assert_close(o, O, np.float32)
    assert_lse_close(lse, LSE, np.float32)
    if Lk == 0:
        assert np.all(o == 0) and np.all(np.isneginf(lse))


# ---------------------------------------------------------------- masks


def test_mask_errors():
    q = np.ones((2, 3, 4, 8), np.float32)
    bad_shapes = [(4, 5), (3, 4, 4, 4), (2, 2, 4, 4), (1, 1, 1, 4, 4), ()]
    for shape in bad_shapes:
        with pytest.raises(ValueError, match="attn_mask"):
            sdpa(q, q, q, attn_mask=np.ones(shape, bool))
    for dtype in (np.int8, np.uint8, np.int64, np.complex64, object):
        with pytest.raises(TypeError, match="attn_mask must be a boolean"):
            sdpa(q, q, q, attn_mask=np.ones((4, 4), dtype))


def test_mask_broadcast_and_strided(isa, rng):
    q, k, v = qkv(rng, B=2, Hq=3, Lq=9, Lk=11)
    big = random_mask(rng, (2, 1, 30, 40), 0.6)
    mask = big[:, :, 3:30:3, ::-3][:, :, :, :11]  # (2, 1, 9, 11), odd strides
    check(sdpa(q, k, v, attn_mask=mask), q, k, v, mask=mask)
    row = random_mask(rng, 11, 0.5)  # 1-D: broadcast over everything
    check(sdpa(q, k, v, attn_mask=row.tolist()), q, k, v, mask=row)
    bias = randn(rng, (9, 11), np.float64)  # float64 bias with float32 q: converted once
    check(sdpa(q, k, v, attn_mask=bias), q, k, v, bias=bias)


# ---------------------------------------------------------------- scalar arguments


def test_scalar_argument_errors():
    q = np.ones((1, 2, 4, 8), np.float32)
    for scale in (float("nan"), float("-inf")):
        with pytest.raises(ValueError, match="scale must be finite"):
            sdpa(q, q, q, scale=scale)
    with pytest.raises(ValueError):
        sdpa(q, q, q, scale="big")
    for softcap in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap must be a positive finite number"):
            sdpa(q, q, q, softcap=softcap)
    for b in (-1, 4097, 2**40):
        with pytest.raises(ValueError, match=r"block_q must be in \[0, 4096\]"):
            sdpa(q, q, q, block_q=b)
        with pytest.raises(ValueError, match=r"block_k must be in \[0, 4096\]"):
            sdpa(q, q, q, block_k=b)
    with pytest.raises(TypeError, match="block_q must be an int"):
        sdpa(q, q, q, block_q=2.5)
    with pytest.raises(ValueError, match="sinks must have one value per query head"):
        sdpa(q, q, q, sinks=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="n must fit in a C int"):
        af.set_num_threads(2**40)


def test_scale_zero_and_huge_windows(isa, rng):
    q, k, v = qkv(rng, dtype=np.float64)
    o = sdpa(q, k, v, scale=0.0)
    np.testing.assert_allclose(
        o, np.broadcast_to(v.mean(axis=2, keepdims=True), o.shape), atol=1e-12
    )
    # A window wider than any sequence is the same as no window.
    o = sdpa(q, k, v, window_size=(2**70, 2**63))
    check(o, q, k, v)


# ---------------------------------------------------------------- 64-bit sizes


def test_sizes_beyond_32_bits(isa, rng):
    # k and v hold 2^31 + 7 keys (2^32 + 14 elements) as zero-stride views: no
    # memory, but every length and index passes through 64-bit arithmetic. The
    # window leaves the last 3 keys visible; ALiBi makes their weights depend
    # on the absolute key index, so lse has a closed form.
    Lk, d = 2**31 + 7, 2
    q = randn(rng, (1, 1, 1, d), np.float64)
    k1 = randn(rng, (1, 1, 1, d), np.float64)
    v1 = randn(rng, (1, 1, 1, 3), np.float64)
    k, v = np.broadcast_to(k1, (1, 1, Lk, d)), np.broadcast_to(v1, (1, 1, Lk, 3))
    assert k.size > 2**32
    slope = 0.25
    o, lse = sdpa(q, k, v, window_size=(2, 0), alibi_slopes=[slope], return_lse=True)
    s = float(q.ravel() @ k1.ravel()) / np.sqrt(d)
    expect = s + np.log(sum(np.exp(-slope * t) for t in range(3)))
    np.testing.assert_allclose(lse.ravel(), [expect], rtol=1e-12)
    np.testing.assert_allclose(o.ravel(), v1.ravel(), rtol=1e-12)
    # Bottom-right alignment puts the only query on the last key: a one-key
    # window sees key index 2^31 + 6 alone.
    o, lse = sdpa(q, k, v, window_size=(0, 0), return_lse=True)
    np.testing.assert_allclose(lse.ravel(), [s], rtol=1e-12)


# ---------------------------------------------------------------- non-finite values


def _expect_nan_rows(o, rows):
    """o is (B, H, Lq, dv); rows is a boolean (B, H, Lq): NaN rows, finite rest."""
    assert np.all(np.isnan(o[rows])), "rows that see a NaN score must be NaN"
    assert np.all(np.isfinite(o[~rows])), "NaN leaked into rows that do not see it"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_in_q_k_v(isa, rng, backend, dtype):
    B, H, L, d = 1, 2, 70, 8
    q, k, v = qkv(rng, B, H, H, L, L, d, d, dtype)
    causal = ref.causal_mask(L, L)
    # A NaN in query row 5: that row is NaN (also when it is the whole tile's
    # only visible content), every other row is exact.
    qn = q.copy()
    qn[0, 1, 5, 3] = np.nan
    o, lse = sdpa(qn, k, v, return_lse=True, backend=backend, is_causal=True)
    rows = np.zeros((B, H, L), bool)
    rows[0, 1, 5] = True
    _expect_nan_rows(o, rows)
    assert np.isnan(lse[0, 1, 5])
    assert_close(o[~rows], ref.sdpa(q, k, v, mask=causal)[~rows], dtype)
    # A NaN in key 40: causal rows i >= 40 see it and are NaN; rows < 40 are exact.
    kn = k.copy()
    kn[0, 0, 40, 0] = np.nan
    o = sdpa(q, kn, v, backend=backend, is_causal=True)
    rows = np.zeros((B, H, L), bool)
    rows[0, 0, 40:] = True
    _expect_nan_rows(o, rows)
    assert_close(o[~rows], ref.sdpa(q, k, v, mask=causal)[~rows], dtype)
    # NaN and inf in value 40: rows that see key 40 get NaN (inf - inf) or inf; the
    # masked rows (i < 40) never read it.
    vn = v.copy()
    vn[0, 0, 40, :2] = [np.nan, np.inf]
    o = sdpa(q, k, vn, backend=backend, is_causal=True)
    assert np.all(np.isnan(o[0, 0, 40:, 0])) and np.all(np.isposinf(o[0, 0, 40:, 1]))
    assert_close(o[0, 0, 40:, 2:], ref.sdpa(q, k, v, mask=causal)[0, 0, 40:, 2:], dtype)
    assert_close(o[0, 0, :40], ref.sdpa(q, k, v, mask=causal)[0, 0, :40], dtype)
    assert_close(o[0, 1], ref.sdpa(q, k, v, mask=causal)[0, 1], dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_scores_follow_oracle(isa, rng, backend):
    # Scores of +-inf and NaN through q, the bias and the scale: the result is
    # the oracle's IEEE result (NaN where it says NaN, the same numbers elsewhere).
    q, k, v = qkv(rng, 1, 2, 2, 20, 30, 4, 4, np.float64)
    q[0, 0, 3] = np.inf  # scores +-inf: row 3 is NaN (inf - inf)
    q[0, 1, 7] = [np.inf, 0, 0, 0]  # scores +-inf too
    bias = randn(rng, (1, 2, 20, 30), np.float64)
    bias[0, 0, 10, 4] = np.inf  # +inf score: NaN row
    bias[0, 0, 11, :] = -np.inf  # every key masked: zeros, lse -inf
    bias[0, 1, 12, ::2] = -np.inf  # half masked: exact
    bias[0, 1, 13, 5] = np.nan  # NaN score: NaN row
    o, lse = sdpa(q, k, v, attn_mask=bias, return_lse=True, backend=backend)
    with np.errstate(invalid="ignore"):  # the oracle's inf - inf is the point
        O, LSE = ref.sdpa(q, k, v, bias=bias, return_lse=True)
    np.testing.assert_array_equal(np.isnan(o), np.isnan(O))
    np.testing.assert_allclose(o, O, atol=1e-11, equal_nan=True)
    np.testing.assert_allclose(lse, LSE, atol=1e-11, equal_nan=True)
    assert np.all(o[0, 0, 11] == 0) and np.isneginf(lse[0, 0, 11])
    assert (
        np.isnan(o[0, 0, 3]).all() and np.isnan(o[0, 0, 10]).all() and np.isnan(o[0, 1, 13]).all()
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_only_in_masked_keys_never_leaks(isa, rng, backend):
    q, k, v = qkv(rng, 1, 1, 1, 50, 50, 8, 8)
    k[0, 0, 30:] = np.nan
    v[0, 0, 30:] = np.nan
    mask = np.ones((50, 50), bool)
    mask[:, 30:] = False
    o = sdpa(q, k, v, attn_mask=mask, backend=backend)
    assert np.all(np.isfinite(o))
    check(o, q, k[..., :30, :], v[..., :30, :])


# ---------------------------------------------------------------- C++ entry points


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_padding_rows_with_sinks_both_kernels(isa, rng, dtype):
    # Found by the native fuzzer: with q_lens and sinks, the reference kernel
    # gave padding rows (i >= q_len) the sink's lse instead of -inf. A padding
    # row is no query: O = 0 and lse = -inf in both kernels.
    B, H, Lq, Lk, d = 2, 2, 9, 12, 8
    q, k, v = qkv(rng, B, H, H, Lq, Lk, d, d, dtype)
    q_lens, kv_lens = np.array([5, 9], np.int64), np.array([12, 0], np.int64)
    sinks = np.array([2.4, -1.0], dtype)
    res = {}
    for name in ("fused", "reference"):
        o, lse = poisoned((B, H, Lq, d), dtype), poisoned((B, H, Lq), dtype)
        af._core.forward(
            q,
            k,
            v,
            o,
            lse,
            scale=0.35,
            q_lens=q_lens,
            kv_lens=kv_lens,
            sinks=sinks,
            causal=True,
            reference=name == "reference",
        )
        res[name] = (o, lse)
        assert np.all(o[0, :, 5:] == 0) and np.all(np.isneginf(lse[0, :, 5:])), name
        assert np.all(o[1] == 0), name  # no keys at all: zeros, lse = the sink
        assert_close(lse[1], np.broadcast_to(sinks[:, None], (H, Lq)), dtype)
    assert_close(res["fused"][0], res["reference"][0], dtype)
    assert_close(res["fused"][1], res["reference"][1], dtype)


ALLOC_FAIL_CODE = """
import resource, numpy as np, attn_fast as af
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # 8 GiB of address space
one = np.float32(0.5)
# Zero-stride views: no memory, but the kernels' scratch would not fit.
q, k = np.broadcast_to(one, (1, 1, 48, 2**28)), np.broadcast_to(one, (1, 1, 64, 2**28))
v = np.ones((1, 1, 64, 4), np.float32)
cases = {
    "fused": lambda: af.scaled_dot_product_attention(q, k, v),  # tiles of 48 x 2^28
    "reference": lambda: af.scaled_dot_product_attention(  # a row of 2^40 scores
        q[..., :1, :1], *(np.broadcast_to(one, (1, 1, 2**40, 1)),) * 2, backend="reference"),
}
for name, call in cases.items():
    try:
        call()
        print(name, "no error")
    except MemoryError:
        print(name, "MemoryError")
"""


@needs_rlimit_as
@pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""),
    reason="ASan reserves more address space than the limit",
)
def test_allocation_failure_is_memory_error():
    # Scratch that cannot be allocated raises MemoryError. It used to be a
    # null-pointer write in the fused kernel, and std::terminate from inside a
    # parallel region in the reference kernel.
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", ALLOC_FAIL_CODE], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["fused", "MemoryError", "reference", "MemoryError"], r.stdout
