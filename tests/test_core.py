"""The fused kernel against the float64 oracle: shapes, layouts, numerics, threads."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import assert_attention, assert_close, randn, random_mask, run_python, run_sdpa

import attn_fast as af
from attn_fast import reference as ref


def run(q, k, v, causal=False, dtype=np.float32, **kw):
    """Call the kernel on a poisoned output buffer and return (out, lse)."""
    return run_sdpa(q, k, v, dtype, is_causal=causal, **kw)


def check(q, k, v, causal=False, dtype=np.float32, **kw):
    o, lse = run(q, k, v, causal=causal, dtype=dtype, **kw)
    Lq, Lk = q.shape[-2], k.shape[-2]
    mask = ref.causal_mask(Lq, Lk) if causal else None
    O, LSE = ref.sdpa(q, k, v, mask=mask, return_lse=True)
    assert o.dtype == dtype and lse.dtype == dtype
    assert_attention(o, lse, O, LSE, dtype)
    return o


# Shape grid: tails (L not a multiple of any block), tiny and odd head dims, Lq != Lk.
SHAPES = [
    # B, H, Lq, Lk, d, dv
    (1, 1, 1, 1, 1, 1),
    (1, 1, 7, 7, 3, 3),
    (2, 3, 7, 7, 5, 5),
    (1, 2, 129, 129, 80, 80),
    (1, 1, 129, 129, 64, 64),
    (1, 1, 1000, 1000, 64, 64),
    (1, 1, 65, 65, 256, 256),
    (1, 2, 100, 37, 128, 128),
    (1, 2, 37, 100, 64, 16),
    (2, 1, 1, 300, 64, 64),
    (1, 1, 300, 1, 5, 7),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_against_oracle(isa, rng, shape, causal, dtype):
    B, H, Lq, Lk, d, dv = shape
    q, k, v = (
        randn(rng, (B, H, Lq, d), dtype),
        randn(rng, (B, H, Lk, d), dtype),
        randn(rng, (B, H, Lk, dv), dtype),
    )
    check(q, k, v, causal, dtype)


@pytest.mark.parametrize("shape", [(1, 2, 7, 7, 5, 5), (2, 2, 129, 100, 64, 80)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_reference_backend(rng, shape, causal):
    B, H, Lq, Lk, d, dv = shape
    q, k, v = (
        randn(rng, (B, H, Lq, d), np.float32),
        randn(rng, (B, H, Lk, d), np.float32),
        randn(rng, (B, H, Lk, dv), np.float32),
    )
    check(q, k, v, causal, np.float32, backend="reference")


@pytest.mark.parametrize("ndim", [2, 3, 4])
def test_ranks(isa, rng, ndim):
    shape = (2, 3, 33, 16)[4 - ndim :]
    q, k, v = (randn(rng, shape, np.float32) for _ in range(3))
    o = af.scaled_dot_product_attention(q, k, v)
    assert o.shape == shape
    assert_close(o, ref.sdpa(q, k, v), np.float32)


def test_non_contiguous_and_transposed(isa, rng):
    # (B, L, H, d) storage read as (B, H, L, d) through strides; every-other-row slices.
    B, L, H, d = 2, 70, 3, 24
    qb, kb, vb = (randn(rng, (B, L, H, d), np.float32) for _ in range(3))
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (qb, kb, vb))
    assert not q.flags.c_contiguous
    check(q, k, v, causal=True)
    big = randn(rng, (B, H, 2 * L, 2 * d), np.float32)
    check(big[:, :, ::2, ::2], big[:, :, 1::2, ::2], big[:, :, ::2, 1::2], causal=False)
    # Fortran order and negative strides.
    f = np.asfortranarray(randn(rng, (1, 2, 40, 8), np.float32))
    check(f, f[:, :, ::-1], f[..., ::-1])


def test_broadcast_zero_stride_kv(isa, rng):
    q = randn(rng, (3, 2, 20, 8), np.float32)
    k1 = randn(rng, (1, 2, 20, 8), np.float32)
    k = np.broadcast_to(k1, (3, 2, 20, 8))
    check(q, k, k)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_extreme_magnitudes(isa, rng, dtype):
    # Scores of about +-1e4: no overflow, no NaN.
    q = randn(rng, (1, 2, 50, 16), dtype, scale=60)
    k = randn(rng, (1, 2, 50, 16), dtype, scale=60)
    v = randn(rng, (1, 2, 50, 16), dtype)
    o, lse = run(q, k, v, dtype=dtype)
    assert np.abs(np.einsum("bhid,bhjd->bhij", q, k) / 4).max() > 5e3
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
    O, LSE = ref.sdpa(q, k, v, return_lse=True)
    # fp32 scores of 1e4 carry an absolute rounding error of about 1e-3, which
    # exp() turns into a relative error of the same size in the weights.
    t = 2e-2 if dtype == np.float32 else 1e-9
    np.testing.assert_allclose(o, O, rtol=t, atol=t)
    np.testing.assert_allclose(lse, LSE, rtol=t)


def test_fully_invisible_rows(isa, rng):
    # Lq > Lk, bottom-right causal: the first Lq - Lk rows see no key.
    q, k, v = (
        randn(rng, (1, 2, 90, 16), np.float32),
        randn(rng, (1, 2, 30, 16), np.float32),
        randn(rng, (1, 2, 30, 8), np.float32),
    )
    o, lse = run(q, k, v, causal=True)
    assert np.all(o[:, :, :60] == 0) and np.all(np.isneginf(lse[:, :, :60]))
    assert not np.any(np.isnan(o))
    check(q, k, v, causal=True)


def test_empty_sequences(isa, rng):
    q, k, v = (
        randn(rng, (1, 2, 0, 8), np.float32),
        randn(rng, (1, 2, 0, 8), np.float32),
        randn(rng, (1, 2, 0, 8), np.float32),
    )
    assert af.scaled_dot_product_attention(q, k, v).shape == (1, 2, 0, 8)
    # Queries but no keys: zeros, lse -inf.
    q = randn(rng, (1, 2, 5, 8), np.float32)
    o, lse = run(q, k, v)
    assert np.all(o == 0) and np.all(np.isneginf(lse))


def test_threads_bitwise_identical(isa, rng):
    q, k, v = (randn(rng, (2, 4, 300, 64), np.float32) for _ in range(3))
    old = af.get_num_threads()
    try:
        af.set_num_threads(1)
        a1 = af.scaled_dot_product_attention(q, k, v, is_causal=True)
        af.set_num_threads(2)
        a2 = af.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        af.set_num_threads(old)
    np.testing.assert_array_equal(a1, a2)


@pytest.mark.parametrize("bq,bk", [(1, 1), (6, 16), (7, 33), (200, 300)])
def test_block_sizes_do_not_change_result(isa, rng, bq, bk):
    q, k, v = (randn(rng, (1, 2, 150, 24), np.float64) for _ in range(3))
    o = af.scaled_dot_product_attention(q, k, v, is_causal=True, block_q=bq, block_k=bk)
    assert_close(o, ref.sdpa(q, k, v, mask=ref.causal_mask(150, 150)), np.float64)


def test_causal_bottom_right_vs_torch_top_left(rng):
    q, k, v = (
        randn(rng, (1, 1, 4, 8), np.float64),
        randn(rng, (1, 1, 10, 8), np.float64),
        randn(rng, (1, 1, 10, 8), np.float64),
    )
    o = af.scaled_dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(
        o, ref.sdpa(q, k, v, mask=ref.causal_mask(4, 10, "bottom_right")), atol=1e-12
    )
    assert not np.allclose(o, ref.sdpa(q, k, v, mask=ref.causal_mask(4, 10, "top_left")))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_textbook_api(isa, rng, dtype, causal):
    X = randn(rng, (37, 20), dtype)
    Wq, Wk, Wv = randn(rng, (8, 20), dtype), randn(rng, (8, 20), dtype), randn(rng, (5, 20), dtype)
    O = af.attention(X, Wq, Wk, Wv, causal=causal)
    assert O.shape == (37, 5) and O.dtype == dtype
    assert_close(O, ref.attention(X, Wq, Wk, Wv, causal), dtype)
    Xb = randn(rng, (3, 11, 20), dtype)
    Ob = af.attention(Xb, Wq, Wk, Wv, causal=causal)
    for b in range(3):
        assert_close(Ob[b], ref.attention(Xb[b], Wq, Wk, Wv, causal), dtype)


def test_scale_argument(rng):
    q, k, v = (randn(rng, (1, 1, 20, 8), np.float64) for _ in range(3))
    o = af.scaled_dot_product_attention(q, k, v, scale=0.3)
    np.testing.assert_allclose(o, ref.sdpa(q, k, v, scale=0.3), atol=1e-12)


# ---------------------------------------------------------------- bad input


def test_error_dtypes():
    x32 = np.ones((4, 8), np.float32)
    with pytest.raises(TypeError, match="float32 or float64"):
        af.scaled_dot_product_attention(np.ones((4, 8), np.int64), x32, x32)
    with pytest.raises(TypeError, match="float32 or float64"):
        af.scaled_dot_product_attention(x32.astype(np.complex64), x32, x32)
    with pytest.raises(TypeError, match="mixed dtypes"):
        af.scaled_dot_product_attention(x32, x32.astype(np.float64), x32)
    with pytest.raises(TypeError, match="float32 or float64"):
        af.scaled_dot_product_attention(np.array([["a"]], dtype=object), x32, x32)
    with pytest.raises(TypeError, match="mixed dtypes"):
        af.attention(x32, np.ones((2, 8)), np.ones((2, 8)), np.ones((2, 8)))


def test_error_shapes():
    q = np.ones((2, 4, 16, 8), np.float32)
    with pytest.raises(ValueError, match=r"k has shape \(2, 4, 16, 7\) but q has head dim 8"):
        af.scaled_dot_product_attention(
            q, np.ones((2, 4, 16, 7), np.float32), np.ones((2, 4, 16, 7), np.float32)
        )
    with pytest.raises(ValueError, match="same number of dimensions"):
        af.scaled_dot_product_attention(q, q[0], q[0])
    with pytest.raises(ValueError, match="batch"):
        af.scaled_dot_product_attention(q, q[:1], q[:1])
    with pytest.raises(ValueError, match="must match"):
        af.scaled_dot_product_attention(q, q, q[:, :, :5])
    with pytest.raises(ValueError, match="enable_gqa"):
        af.scaled_dot_product_attention(q, q[:, :2], q[:, :2])
    with pytest.raises(ValueError, match="not a multiple"):
        af.scaled_dot_product_attention(q, q[:, :3], q[:, :3], enable_gqa=True)
    with pytest.raises(ValueError, match="2, 3 or 4 dimensions"):
        af.scaled_dot_product_attention(q[0, 0, 0], q[0, 0, 0], q[0, 0, 0])
    with pytest.raises(ValueError, match="head dim d must be at least 1"):
        af.scaled_dot_product_attention(q[..., :0], q[..., :0], q)
    with pytest.raises(ValueError, match=r"Wk must be \(d, D\)"):
        af.attention(np.ones((4, 8)), np.ones((2, 8)), np.ones((2, 9)), np.ones((2, 8)))
    with pytest.raises(ValueError, match=r"X must be"):
        af.attention(np.ones(8), np.ones((2, 8)), np.ones((2, 8)), np.ones((2, 8)))


def test_error_out_argument():
    q = np.ones((1, 2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="out has shape"):
        af.scaled_dot_product_attention(q, q, q, out=np.empty((1, 2, 4, 7), np.float32))
    with pytest.raises(TypeError, match="out has dtype"):
        af.scaled_dot_product_attention(q, q, q, out=np.empty((1, 2, 4, 8), np.float64))
    ro = np.empty((1, 2, 4, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        af.scaled_dot_product_attention(q, q, q, out=ro)


def test_error_other_arguments():
    q = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match="scale must be finite"):
        af.scaled_dot_product_attention(q, q, q, scale=float("inf"))
    with pytest.raises(ValueError, match="backend"):
        af.scaled_dot_product_attention(q, q, q, backend="gpu")
    with pytest.raises(ValueError, match="n must be >= 1"):
        af.set_num_threads(0)
    with pytest.raises(TypeError):
        af.set_num_threads("2")
    with pytest.raises(ValueError, match="ISA must be one of"):
        af.set_isa("sse9")


def test_big_endian_and_readonly_inputs(rng):
    q = randn(rng, (1, 1, 9, 4), np.float64)
    qbe = q.astype(">f8")
    qbe.flags.writeable = False
    np.testing.assert_allclose(
        af.scaled_dot_product_attention(qbe, qbe, qbe), ref.sdpa(q, q, q), atol=1e-12
    )


def test_misaligned_buffer(rng):
    raw = np.zeros(4 * 64 + 1, np.uint8)[1:].view(np.float32).reshape(1, 1, 8, 8)
    raw[...] = randn(rng, (1, 1, 8, 8), np.float32)
    assert not raw.flags.aligned or raw.ctypes.data % 4
    assert_close(
        af.scaled_dot_product_attention(raw, raw, raw), ref.sdpa(raw, raw, raw), np.float32
    )


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("name", ["scalar", "avx2", "avx512", "neon", "neon_bf16"])
def test_isa_env_variable(name):
    r = run_python("import attn_fast as af; print(af.get_isa())", ATTN_FAST_ISA=name)
    if name in af._core.available_isas():
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == name
    else:
        assert r.returncode != 0
        assert f"cannot use ISA '{name}'" in r.stderr


def test_omp_num_threads_respected():
    r = run_python("import attn_fast as af; print(af.get_num_threads())", OMP_NUM_THREADS="1")
    assert r.returncode == 0 and r.stdout.strip() == "1"


def test_show_config(capsys):
    af.show_config()
    text = capsys.readouterr().out
    for key in ("version", "isa", "available_isas", "openmp", "num_threads"):
        assert key in text
    assert af.get_isa() in text


def test_gil_released_concurrent_calls(rng):
    import threading

    q, k, v = (randn(rng, (1, 2, 200, 32), np.float32) for _ in range(3))
    expect = af.scaled_dot_product_attention(q, k, v, is_causal=True)
    results = [None] * 4

    def work(i):
        results[i] = af.scaled_dot_product_attention(q, k, v, is_causal=True)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for r in results:
        np.testing.assert_array_equal(r, expect)


def test_all_isas_agree(rng):
    q, k, v = (randn(rng, (1, 3, 77, 40), np.float32) for _ in range(3))
    old = af.get_isa()
    outs = {}
    try:
        for name in af._core.available_isas():
            af.set_isa(name)
            outs[name] = af.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        af.set_isa(old)
    for a, b in itertools.combinations(outs.values(), 2):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- score options


def test_window_softcap_alibi_sinks(isa, rng):
    B, H, Lq, Lk, d = 2, 3, 70, 90, 16
    q, k, v = (
        randn(rng, (B, H, Lq, d), np.float64),
        randn(rng, (B, H, Lk, d), np.float64),
        randn(rng, (B, H, Lk, 12), np.float64),
    )
    win = ref.window_mask(Lq, Lk, 10, 3)
    o = af.scaled_dot_product_attention(q, k, v, window_size=(10, 3))
    np.testing.assert_allclose(o, ref.sdpa(q, k, v, mask=win), atol=1e-11)
    o = af.scaled_dot_product_attention(q, k, v, window_size=(10, None), is_causal=True)
    np.testing.assert_allclose(
        o, ref.sdpa(q, k, v, mask=ref.window_mask(Lq, Lk, 10, 0)), atol=1e-11
    )
    o = af.scaled_dot_product_attention(q * 10, k, v, softcap=5.0)
    np.testing.assert_allclose(o, ref.sdpa(q * 10, k, v, softcap=5.0), atol=1e-11)
    slopes = rng.uniform(0.01, 0.5, H)
    i = np.arange(Lq)[:, None] + (Lk - Lq)
    j = np.arange(Lk)[None, :]
    bias = -slopes[:, None, None] * np.abs(i - j)
    o = af.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, is_causal=True)
    np.testing.assert_allclose(
        o, ref.sdpa(q, k, v, bias=bias, mask=ref.causal_mask(Lq, Lk)), atol=1e-11
    )
    sinks = rng.standard_normal(H) * 3
    o, lse = af.scaled_dot_product_attention(q, k, v, sinks=sinks, is_causal=True, return_lse=True)
    O, LSE = ref.sdpa(q, k, v, sinks=sinks, mask=ref.causal_mask(Lq, Lk), return_lse=True)
    np.testing.assert_allclose(o, O, atol=1e-11)
    np.testing.assert_allclose(lse, LSE, atol=1e-11)


def test_dense_masks(isa, rng):
    B, H, Lq, Lk, d = 2, 2, 40, 50, 8
    q, k, v = (
        randn(rng, (B, H, Lq, d), np.float32),
        randn(rng, (B, H, Lk, d), np.float32),
        randn(rng, (B, H, Lk, d), np.float32),
    )
    mask = random_mask(rng, (B, 1, Lq, Lk), 0.3)
    mask[0, 0, 5] = False  # a fully masked row
    o = af.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close(o, ref.sdpa(q, k, v, mask=mask), np.float32)
    assert np.all(o[0, :, 5] == 0)
    bias = rng.standard_normal((Lq, Lk)).astype(np.float32)
    o = af.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=True)
    assert_close(o, ref.sdpa(q, k, v, bias=bias, mask=ref.causal_mask(Lq, Lk)), np.float32)
    with pytest.raises(ValueError, match="not broadcastable"):
        af.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., :3])
    with pytest.raises(TypeError, match="boolean"):
        af.scaled_dot_product_attention(q, k, v, attn_mask=mask.astype(np.int32))


def test_score_option_errors():
    q = np.ones((1, 2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="window_size"):
        af.scaled_dot_product_attention(q, q, q, window_size=(-3, 0))
    with pytest.raises(ValueError, match="window_size must be a pair"):
        af.scaled_dot_product_attention(q, q, q, window_size=5)
    with pytest.raises(ValueError, match="softcap"):
        af.scaled_dot_product_attention(q, q, q, softcap=-1)
    with pytest.raises(ValueError, match=r"alibi_slopes must have one value per query head \(2,\)"):
        af.scaled_dot_product_attention(q, q, q, alibi_slopes=[1.0, 2.0, 3.0])
