"""float16 and bfloat16 inputs: every source kind, every ISA, against the float64 oracle.

The oracle runs in float64 on the *same rounded* 16-bit inputs, so what is
left is the kernel's own error: fp32 accumulation plus one rounding of O to
the 16-bit dtype (half an ulp: 2^-9 relative for bfloat16, 2^-12 for float16),
and for bfloat16 on avx512_bf16 the rounding of P to bfloat16 for the
vdpbf16ps P V product (as torch's bf16 SDPA does), at most 2^-9 of
Σ_j P_ij |v_j|, which the oracle computes too (`A`). lse is float32. Sources:
torch.bfloat16 / torch.float16 tensors, NumPy float16 arrays and
ml_dtypes.bfloat16 arrays (each skipped where its library is missing).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
from helpers import f64, gen, kind_of, make, ml_dtypes, need, random_mask, torch

import attn_fast as af
from attn_fast import masks
from attn_fast import reference as ref
from attn_fast._checks import _BF16Bits, to_input_kind

sdpa = af.scaled_dot_product_attention

SOURCES = ["numpy_f16", "torch_f16", "torch_bf16", "ml_bf16"]
# |got - O| <= RTOL |O| + PTOL A + ATOL: one rounding of O, fp32 accumulation,
# and (bf16) P rounded to bf16, A = Σ_j P_ij |v_j|.
RTOL = {"f16": 2.0**-11, "bf16": 2.0**-8}
PTOL = {"f16": 0.0, "bf16": 2.0**-8}
ATOL = 2e-5


class Want(NamedTuple):
    O: np.ndarray
    A: np.ndarray  # Σ_j P_ij |v_j|


def orc(q, k, v, return_lse=False, **kw):
    """The float64 oracle (reference.sdpa) on float64 inputs, with A beside O."""
    O, LSE = ref.sdpa(q, k, v, return_lse=True, **kw)
    want = Want(O, ref.sdpa(q, k, np.abs(v), **kw))
    return (want, LSE) if return_lse else want


def close(got, want, src, what="out"):
    kind = kind_of(src)
    got, A, want = f64(got), np.asarray(want.A, np.float64), np.asarray(want.O, np.float64)
    bad = ~(np.abs(got - want) <= RTOL[kind] * np.abs(want) + PTOL[kind] * A + ATOL)
    assert not bad.any(), (
        f"{what}: {bad.sum()} of {bad.size} off, max err {np.nanmax(np.abs(got - want)):.3g}"
    )


def check_lse(lse, LSE):
    assert np.asarray(lse).dtype == np.float32
    np.testing.assert_allclose(np.asarray(lse, np.float64), LSE, rtol=1e-5, atol=1e-5)


def result_dtype_ok(o, src):
    """NumPy result of the input's dtype
    (the lead's wrapper turns torch input into torch output)."""
    o = to_input_kind(o, make(np.zeros(1), src))
    if src == "numpy_f16":
        assert isinstance(o, np.ndarray) and o.dtype == np.float16
    elif src == "ml_bf16":
        assert isinstance(o, np.ndarray) and o.dtype == ml_dtypes.bfloat16
    else:
        assert isinstance(o, torch.Tensor) and o.dtype == (
            torch.float16 if src == "torch_f16" else torch.bfloat16
        )


# ---------------------------------------------------------------- shapes


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "Lq, Lk, d, dv",
    [
        (1, 1, 64, 64),
        (7, 7, 80, 80),
        (129, 129, 128, 128),
        (7, 129, 256, 256),
        (129, 7, 48, 40),
        (33, 65, 40, 72),
        (1, 300, 64, 64),
        (5, 9, 1, 1),
        (3, 70, 5, 3),
        (20, 20, 33, 17),
    ],
)
def test_matches_oracle(isa, rng, src, causal, Lq, Lk, d, dv):
    q, k, v = gen(rng, src, (2, 3, Lq, d), (2, 3, Lk, d), (2, 3, Lk, dv))
    o, lse = sdpa(q, k, v, is_causal=causal, return_lse=True)
    result_dtype_ok(o, src)
    O, LSE = orc(
        f64(q), f64(k), f64(v), mask=ref.causal_mask(Lq, Lk) if causal else None, return_lse=True
    )
    close(o, O, src)
    check_lse(lse, LSE)


@pytest.mark.parametrize("src", SOURCES)
def test_reference_backend(rng, src):
    q, k, v = gen(rng, src, (1, 2, 9, 24), (1, 2, 13, 24), (1, 2, 13, 8))
    o, lse = sdpa(q, k, v, is_causal=True, return_lse=True, backend="reference")
    O, LSE = orc(f64(q), f64(k), f64(v), mask=ref.causal_mask(9, 13), return_lse=True)
    close(o, O, src)
    check_lse(lse, LSE)


@pytest.mark.parametrize("src", SOURCES)
def test_short_queries_use_decode_kernel(isa, rng, src):
    """Lq <= 4 against long keys goes to the split-KV decode kernel for 16-bit q too."""
    q, k, v = gen(rng, src, (2, 4, 1, 64), (2, 2, 200, 64), (2, 2, 200, 64))
    o = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    O = orc(f64(q), f64(k), f64(v), mask=ref.causal_mask(1, 200))
    close(o, O, src)
    forced = sdpa(q, k, v, is_causal=True, enable_gqa=True, backend="decode")
    np.testing.assert_array_equal(f64(o), f64(forced))  # the same kernel, the same bits
    result_dtype_ok(forced, src)


@pytest.mark.parametrize("src", SOURCES)
def test_non_contiguous_and_gqa(isa, rng, src):
    """(B, L, H, d) buffers read as their (B, H, L, d) transposes; 4 query heads on 2 kv heads."""
    q, k, v = gen(rng, src, (2, 17, 4, 80), (2, 23, 2, 80), (2, 23, 2, 56))
    tr = (
        (lambda x: x.transpose(1, 2))
        if src.startswith("torch")
        else (lambda x: x.transpose(0, 2, 1, 3))
    )
    qt, kt, vt = tr(q), tr(k), tr(v)
    o = sdpa(qt, kt, vt, enable_gqa=True, window_size=(5, 3))
    O = orc(f64(qt), f64(kt), f64(vt), mask=ref.window_mask(17, 23, 5, 3))
    close(o, O, src)


@pytest.mark.parametrize("src", ["torch_bf16", "ml_bf16", "numpy_f16"])
def test_out_written_in_place(isa, rng, src):
    q, k, v = gen(rng, src, (1, 2, 10, 16), (1, 2, 10, 16), (1, 2, 10, 16))
    out = make(np.full((1, 10, 2, 16), np.nan, np.float32), src)
    o_view = out.transpose(1, 2) if src.startswith("torch") else out.transpose(0, 2, 1, 3)
    got = sdpa(q, k, v, is_causal=True, out=o_view)
    assert got is o_view
    close(o_view, orc(f64(q), f64(k), f64(v), mask=ref.causal_mask(10, 10)), src)


def test_torch_result_shares_memory():
    if torch is None:
        pytest.skip("torch not installed")
    x = torch.randn(1, 2, 5, 8).bfloat16()
    o, lse = sdpa(x, x, x, return_lse=True)  # torch in, torch out
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and o.shape == (1, 2, 5, 8)
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    xn = x.view(torch.int16).numpy().view(np.uint16)
    on = np.asarray(sdpa(xn.view(_BF16Bits), xn.view(_BF16Bits), xn.view(_BF16Bits))).view(
        np.uint16
    )
    np.testing.assert_array_equal(o.view(torch.int16).numpy().view(np.uint16), on)
    t = to_input_kind(on, x)
    assert t.dtype == torch.bfloat16 and t.shape == (1, 2, 5, 8)
    assert t.data_ptr() == on.__array_interface__["data"][0]  # no copy
    assert to_input_kind(t, x) is t  # tensors pass through


# ---------------------------------------------------------------- masks and scores


@pytest.mark.parametrize("src", SOURCES)
def test_masks_and_score_transforms(isa, rng, src):
    B, H, Lq, Lk, d = 2, 2, 19, 37, 32
    q, k, v = gen(rng, src, (B, H, Lq, d), (B, H, Lk, d), (B, H, Lk, d))
    Q, K, V = f64(q), f64(k), f64(v)
    keep = random_mask(rng, (B, H, Lq, Lk), 0.6)
    bias = rng.standard_normal((B, 1, Lq, Lk)).astype(np.float32)
    kv_lens = np.array([Lk, 20])
    pad = np.arange(Lk)[None, None, None, :] < kv_lens[:, None, None, None]

    close(sdpa(q, k, v, attn_mask=keep), orc(Q, K, V, mask=keep), src, "bool mask")
    close(sdpa(q, k, v, attn_mask=bias), orc(Q, K, V, bias=bias), src, "additive mask")
    close(
        sdpa(q, k, v, attn_mask=masks.Padding(kv_lens=kv_lens)),
        orc(Q, K, V, mask=pad),
        src,
        "padding",
    )
    close(
        sdpa(q, k, v, attn_mask=[keep, bias]),
        orc(Q, K, V, mask=keep, bias=bias),
        src,
        "mask + bias",
    )
    sinks = np.array([0.5, -1.0])
    o, lse = sdpa(q, k, v, softcap=3.0, sinks=sinks, return_lse=True)
    O, LSE = orc(Q, K, V, softcap=3.0, sinks=sinks, return_lse=True)
    close(o, O, src, "softcap + sinks")
    check_lse(lse, LSE)
    slopes = np.array([0.25, 0.5])
    dist = np.abs(np.arange(Lq)[:, None] + (Lk - Lq) - np.arange(Lk)[None, :])
    close(
        sdpa(q, k, v, alibi_slopes=slopes),
        orc(Q, K, V, bias=-slopes[:, None, None] * dist),
        src,
        "alibi",
    )


@pytest.mark.parametrize("src", ["torch_bf16", "torch_f16", "ml_bf16"])
def test_additive_mask_in_input_dtype(rng, src):
    """An additive mask of q's own 16-bit dtype is used (in float32)."""
    q, k, v = gen(rng, src, (1, 2, 6, 16), (1, 2, 9, 16), (1, 2, 9, 16))
    bias = make(rng.standard_normal((1, 1, 6, 9)), src)
    close(sdpa(q, k, v, attn_mask=bias), orc(f64(q), f64(k), f64(v), bias=f64(bias)), src)


@pytest.mark.parametrize("src", SOURCES)
def test_fully_masked_rows_and_nan_in_masked_v(isa, rng, src):
    B, H, L, d = 1, 2, 40, 24
    need(src)
    q = make(rng.standard_normal((B, H, L, d)), src)
    kf, vf = rng.standard_normal((B, H, L, d)), rng.standard_normal((B, H, L, d))
    kf[..., 30:, :] = np.nan  # padding keys past kv_len = 30 hold garbage
    vf[..., 30:, :] = np.nan
    vf[..., 3, :] = np.inf  # a key that the boolean mask hides from every query
    k, v = make(kf, src), make(vf, src)
    keep = np.ones((B, H, L, L), bool)
    keep[..., 3] = False
    keep[:, :, 5, :] = False  # row 5 sees nothing
    o, lse = sdpa(
        q, k, v, attn_mask=[keep, masks.Padding(kv_lens=[30], q_lens=[L])], return_lse=True
    )
    o = f64(o)
    assert np.isfinite(o).all()
    assert (o[:, :, 5] == 0).all() and np.isneginf(np.asarray(lse)[:, :, 5]).all()
    vis = keep & (np.arange(L) < 30)
    # the oracle multiplies P by V densely: give it zeros where the kernel must never look
    K, V = (np.where(np.isfinite(f64(x)), f64(x), 0.0) for x in (k, v))
    O, LSE = orc(f64(q), K, V, mask=vis, return_lse=True)
    close(o, O, src)
    check_lse(lse, LSE)


# ---------------------------------------------------------------- conversions, exactly


@pytest.mark.parametrize("src", SOURCES)
def test_one_key_returns_v_bit_exact(isa, rng, src):
    """One visible key: O = V exactly, so every 16-bit value (subnormals, inf, NaN, extremes)
    survives the widen-on-pack and the round-on-write unchanged (NaN stays NaN;
    assert_array_equal matches NaNs)."""
    need(src)
    if kind_of(src) == "f16":
        vals = np.array(
            [0, -0.0, 6e-8, -6e-8, 3e-5, 65504, -65504, 1 / 3, np.inf, -np.inf, np.nan], np.float32
        )
    else:
        vals = np.array(
            [0, -0.0, 1e-40, -1e-40, 1e-38, 3e38, -3e38, 1 / 3, np.inf, -np.inf, np.nan], np.float32
        )
    dv = 80
    vrow = np.resize(vals, dv) * np.where(rng.random(dv) < 0.5, 1, -1).astype(np.float32)
    q, k = (
        make(rng.standard_normal((1, 1, 3, 8)), src),
        make(rng.standard_normal((1, 1, 1, 8)), src),
    )
    v = make(vrow.reshape(1, 1, 1, dv), src)
    o = sdpa(q, k, v)
    np.testing.assert_array_equal(f64(o), np.broadcast_to(f64(v), (1, 1, 3, dv)))


@pytest.mark.parametrize("src", SOURCES)
def test_output_rounds_to_nearest_even(isa, rng, src):
    """Two keys of equal score: O = (v1 + v2) / 2 in fp32, then one rounding to the dtype,
    ties to even (compared with NumPy's / torch's own conversion)."""
    need(src)
    dv = 96
    v = make(rng.standard_normal((1, 1, 2, dv)), src)
    q, k = make(np.zeros((1, 1, 2, 8)), src), make(np.ones((1, 1, 2, 8)), src)
    o = sdpa(q, k, v)
    vv = f64(v).astype(np.float32)
    want = (vv[:, :, 0] + vv[:, :, 1]) * np.float32(0.5)
    np.testing.assert_array_equal(f64(o)[:, :, 0], f64(make(want, src)))


# ---------------------------------------------------------------- errors


def test_mixed_dtypes_raise_with_cast_hint(rng):
    q32 = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    q16 = q32.astype(np.float16)
    with pytest.raises(TypeError, match=r"mixed dtypes .*q float16, k float32.*astype\(q.dtype\)"):
        sdpa(q16, q32, q32)
    if torch is not None:
        t = torch.from_numpy(q32)
        with pytest.raises(
            TypeError, match=r"mixed dtypes .*q bfloat16, k float16.*\.to\(q.dtype\)"
        ):
            sdpa(t.bfloat16(), t.half(), t.half())
        with pytest.raises(TypeError, match=r"out has dtype float16, expected bfloat16"):
            sdpa(t.bfloat16(), t.bfloat16(), t.bfloat16(), out=t.half())
    with pytest.raises(
        TypeError, match="float32 or float64, got dtype uint16"
    ):  # uint16 is not bfloat16
        sdpa(q32.view(np.uint16)[..., :8], q32, q32)


def test_float32_cache_refuses_16bit_with_cast_hint():
    if torch is None:
        pytest.skip("torch not installed")
    x = torch.randn(1, 2, 4, 8).bfloat16()
    cache = af.KVCache(1, 2, 8)
    with pytest.raises(
        TypeError,
        match=r"k has dtype bfloat16 but the cache stores float32; "
        r"cast it first .*to\(torch.float32\)",
    ):
        cache.append(x, x)
    with pytest.raises(TypeError, match="float16 but the cache stores float32"):
        cache.attend(x.half())


# ---------------------------------------------------------------- varlen and the textbook function


@pytest.mark.parametrize("src", SOURCES)
def test_varlen(isa, rng, src):
    cu = np.array([0, 5, 5, 22])
    q, k, v = gen(rng, src, (22, 4, 40), (22, 2, 40), (22, 2, 24))
    o, lse = af.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    assert np.asarray(lse).dtype == np.float32
    Q, K, V = f64(q), f64(k), f64(v)
    for s in range(3):
        a, b = cu[s], cu[s + 1]
        if a == b:
            continue
        O = orc(
            Q[a:b].transpose(1, 0, 2),
            K[a:b].transpose(1, 0, 2),
            V[a:b].transpose(1, 0, 2),
            mask=ref.causal_mask(b - a, b - a),
        )
        close(f64(o)[a:b].transpose(1, 0, 2), O, src)


@pytest.mark.parametrize("src", SOURCES)
def test_textbook_attention(rng, src):
    X, Wq, Wk, Wv = gen(rng, src, (9, 16), (8, 16), (8, 16), (6, 16))
    o = af.attention(X, Wq, Wk, Wv, causal=True)
    # Projections in fp32, rounded to the dtype (as a 16-bit matmul would), then attention.
    P = [
        f64(make(f64(X).astype(np.float32) @ f64(W).astype(np.float32).T, src))
        for W in (Wq, Wk, Wv)
    ]
    close(o, orc(*P, mask=ref.causal_mask(9, 9)), src)


# ---------------------------------------------------------------- against torch's own bf16 SDPA


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 129, 64), (1, 8, 256, 128), (1, 2, 77, 80)])
def test_error_within_1p5x_of_torch_bf16(isa, rng, causal, shape):
    """attn_fast's bf16 error against the float64 oracle (on the same bf16 inputs) is at most
    1.5x that of torch's bf16 scaled_dot_product_attention, by RMS and by max."""
    if torch is None:
        pytest.skip("torch not installed")
    q, k, v = gen(rng, "torch_bf16", shape, shape, shape)
    L = shape[2]
    ours = f64(to_input_kind(sdpa(q, k, v, is_causal=causal), q))
    theirs = f64(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
    O = ref.sdpa(f64(q), f64(k), f64(v), mask=ref.causal_mask(L, L) if causal else None)
    e_ours, e_torch = np.abs(ours - O), np.abs(theirs - O)
    assert np.sqrt(np.mean(e_ours**2)) <= 1.5 * np.sqrt(np.mean(e_torch**2))
    assert e_ours.max() <= 1.5 * e_torch.max()


# ---------------------------------------------------------------- threads and ISA choice


@pytest.mark.parametrize("src", ["numpy_f16", "ml_bf16", "torch_bf16"])
def test_thread_count_does_not_change_bits(isa, rng, src):
    q, k, v = gen(rng, src, (2, 4, 150, 64), (2, 4, 150, 64), (2, 4, 150, 64))
    old = af.get_num_threads()
    try:
        af.set_num_threads(1)
        o1 = f64(sdpa(q, k, v, is_causal=True))
        af.set_num_threads(3)
        o3 = f64(sdpa(q, k, v, is_causal=True))
    finally:
        af.set_num_threads(old)
    np.testing.assert_array_equal(o1, o3)


def _isa_in_subprocess(**env):
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import attn_fast as af; print(af.get_isa())"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_avx512_bf16_choice():
    """avx512_bf16 is listed where CPUID says AVX512-BF16; the probe can be overridden; the
    environment variable forces either path."""
    isas = af._core.available_isas()
    if "avx512_bf16" not in isas:
        assert af.get_isa() != "avx512_bf16"
        pytest.skip("no AVX512-BF16 on this CPU (or not compiled)")
    assert "avx512" in isas
    amx = "amx" in isas  # where it runs, amx is the default whatever the probe (test_amx.py)
    want0, want1 = ("amx", "amx") if amx else ("avx512", "avx512_bf16")
    assert _isa_in_subprocess(ATTN_FAST_BF16_PROBE="0", ATTN_FAST_ISA="") == want0
    assert _isa_in_subprocess(ATTN_FAST_BF16_PROBE="1", ATTN_FAST_ISA="") == want1
    assert (
        _isa_in_subprocess(ATTN_FAST_ISA="avx512_bf16", ATTN_FAST_BF16_PROBE="0") == "avx512_bf16"
    )
    assert _isa_in_subprocess(ATTN_FAST_ISA="avx512") == "avx512"


# ---------------------------------------------------------------- the split-KV decode kernel


def _raw(x):
    """The kernel's own array for a 16-bit input: float16, or uint16 bits for bfloat16."""
    from attn_fast._checks import as_float_array

    return as_float_array(x, "x", half=True)


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "Lq, Lk, d, dv",
    [
        (1, 1, 64, 64),
        (1, 129, 80, 80),
        (4, 7, 5, 3),
        (3, 300, 256, 256),
        (2, 1100, 1, 1),
        (1, 700, 128, 96),
    ],
)
def test_decode_matches_oracle(isa, rng, src, causal, Lq, Lk, d, dv):
    """backend='decode' on 16-bit q/k/v (GQA 4 on 2): O in q's dtype written over a NaN-poisoned
    out, lse float32; Lk = 1100 / 700 take several splits (merged in float32)."""
    q, k, v = gen(rng, src, (2, 4, Lq, d), (2, 2, Lk, d), (2, 2, Lk, dv))
    out = make(np.full((2, 4, Lq, dv), np.nan, np.float32), src)
    o, lse = sdpa(
        q, k, v, is_causal=causal, enable_gqa=True, backend="decode", return_lse=True, out=out
    )
    assert o is out
    Q, K, V = f64(q), f64(k).repeat(2, axis=1), f64(v).repeat(2, axis=1)
    O, LSE = orc(Q, K, V, mask=ref.causal_mask(Lq, Lk) if causal else None, return_lse=True)
    close(o, O, src)
    check_lse(lse, LSE)


@pytest.mark.parametrize("G", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("d", [1, 5, 31, 32, 33, 80, 256])
def test_decode_bf16_keys_strided_and_every_row_count(isa, rng, G, d):
    """bfloat16 decode (on avx512_bf16 its Q K^T is vdpbf16ps on the raw bf16 q and k, the scale
    on the fp32 scores): K read through a stride along d (packed first) and in place, d not a
    multiple of the 32-value pairs (a masked tail: the NaN that follows every key row in memory
    is never read), 1..8 query rows per kv head; lse to fp32 rounding of the oracle's, and the
    strided and contiguous keys give the same bits."""
    from attn_fast import _core

    need("ml_bf16")
    Hkv, Lk, dv = 2, 150, 24
    q = make(rng.standard_normal((1, Hkv * G, 1, d)), "ml_bf16")
    k = make(rng.standard_normal((1, Hkv, Lk, d)), "ml_bf16")
    v = make(rng.standard_normal((1, Hkv, Lk, dv)), "ml_bf16")
    wide = np.full((1, Hkv, Lk, 2 * d + 1), np.nan, np.float32)
    wide[..., : 2 * d : 2] = f64(k)
    kw = make(wide, "ml_bf16")  # k with a stride of 2 along d, NaN in between and after
    padded = np.full((1, Hkv, Lk, d + 32), np.nan, np.float32)
    padded[..., :d] = f64(k)
    kp = make(padded, "ml_bf16")  # k in place, each row followed by NaN
    outs = []
    for keys in (_raw(kw)[..., : 2 * d : 2], _raw(kp)[..., :d], _raw(k)):
        o = np.full((1, Hkv * G, 1, dv), 0xFFFF, np.uint16)
        lse = np.full((1, Hkv * G, 1), np.nan, np.float32)
        _core.decode(_raw(q), keys, _raw(v), o, lse, scale=d**-0.5, causal=False)
        outs.append((o, lse))
    O, LSE = orc(f64(q), f64(k).repeat(G, axis=1), f64(v).repeat(G, axis=1), return_lse=True)
    for o, lse in outs:
        close(o, O, "ml_bf16")
        check_lse(lse, LSE)
    for o, lse in outs[1:]:
        assert np.array_equal(o, outs[0][0]) and np.array_equal(lse, outs[0][1])


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("split", [0, 64])
def test_decode_ring_ragged_window(isa, rng, src, split):
    """The kernel on a ring of R slots (logical key j of sequence b in slot (kv_start[b] + j) % R),
    ragged kv_lens (one sequence empty: zeros, lse -inf), q_lens, a sliding window, NaN in the
    slots no query sees; split = 64 forces several splits per row block."""
    from attn_fast import _core

    B, Hq, Hkv, Lq, R, d, dv = 3, 6, 2, 3, 200, 40, 24
    need(src)
    q = make(rng.standard_normal((B, Hq, Lq, d)), src)
    kf, vf = rng.standard_normal((B, Hkv, R, d)), rng.standard_normal((B, Hkv, R, dv))
    kv_lens, kv_start, q_lens = np.array([150, 0, 200]), np.array([120, 0, 37]), np.array([3, 3, 2])
    for b in range(B):  # slots past kv_len hold garbage the kernel must not read into any row
        dead = (kv_start[b] + np.arange(kv_lens[b], R)) % R
        kf[b, :, dead] = np.nan
        vf[b, :, dead] = np.nan
    k, v = make(kf, src), make(vf, src)
    o = _raw(make(np.full((B, Hq, Lq, dv), np.nan, np.float32), src))
    lse = np.full((B, Hq, Lq), np.nan, np.float32)
    _core.decode(
        _raw(q),
        _raw(k),
        _raw(v),
        o,
        lse,
        scale=d**-0.5,
        causal=True,
        window_left=50,
        q_lens=q_lens,
        kv_lens=kv_lens,
        kv_start=kv_start,
        split=split,
    )
    o = f64(o)
    Q, K, V = f64(q), f64(k), f64(v)
    for b in range(B):
        n = kv_lens[b]
        slots = (kv_start[b] + np.arange(n)) % R
        Kb, Vb = K[b][:, slots].repeat(3, axis=0), V[b][:, slots].repeat(3, axis=0)
        for i in range(Lq):
            if i >= q_lens[b] or n == 0:
                assert (o[b, :, i] == 0).all() and np.isneginf(lse[b, :, i]).all()
                continue
            diag = i + n - q_lens[b]
            vis = (np.arange(n) <= diag) & (np.arange(n) >= diag - 50)
            Kv, Vv = Kb[:, vis], Vb[:, vis]
            O, LSE = orc(Q[b][:, i : i + 1], Kv, Vv, return_lse=True)
            close(o[b, :, i : i + 1], O, src)
            check_lse(lse[b, :, i : i + 1], LSE)


@pytest.mark.parametrize("src", SOURCES)
def test_decode_nan_in_masked_v_and_empty_rows(isa, rng, src):
    """Through sdpa's routing: padding keys and window-hidden keys hold NaN / inf in V and K
    (in blocks the mask cuts through); a sequence of kv_len 0 gives zeros and lse -inf."""
    B, H, Lq, Lk, d = 2, 2, 2, 160, 24
    need(src)
    q = make(rng.standard_normal((B, H, Lq, d)), src)
    kf, vf = rng.standard_normal((B, H, Lk, d)), rng.standard_normal((B, H, Lk, d))
    kf[0, :, 100:], vf[0, :, 100:] = np.nan, np.nan  # past kv_len = 100
    vf[0, :, 10] = np.inf  # left of the window of every query
    k, v = make(kf, src), make(vf, src)
    pad = masks.Padding(kv_lens=[100, 0])
    o, lse = sdpa(q, k, v, attn_mask=pad, is_causal=True, window_size=(40, 0), return_lse=True)
    o = f64(o)
    assert np.isfinite(o).all()
    assert (o[1] == 0).all() and np.isneginf(np.asarray(lse)[1]).all()
    diag = np.arange(Lq)[:, None] + 100 - Lq
    vis = (np.arange(100)[None, :] <= diag) & (np.arange(100)[None, :] >= diag - 40)
    V = np.where(np.isfinite(f64(v)), f64(v), 0.0)  # the oracle multiplies P by V densely
    O, LSE = orc(f64(q)[:1], f64(k)[:1, :, :100], V[:1, :, :100], mask=vis, return_lse=True)
    close(o[:1], O, src)
    check_lse(np.asarray(lse)[:1], LSE)


@pytest.mark.parametrize("src", SOURCES)
def test_decode_one_visible_key_bit_exact(isa, rng, src):
    """window (0, 0): each query sees exactly one key, so O = that V row exactly: every 16-bit
    value (subnormals, extremes, inf, NaN) survives the widen-on-load and the one rounding."""
    need(src)
    if kind_of(src) == "f16":
        vals = np.array(
            [0, -0.0, 6e-8, -6e-8, 3e-5, 65504, -65504, 1 / 3, np.inf, -np.inf, np.nan], np.float32
        )
    else:
        vals = np.array(
            [0, -0.0, 1e-40, -1e-40, 1e-38, 3e38, -3e38, 1 / 3, np.inf, -np.inf, np.nan], np.float32
        )
    Lk, dv = 90, 80
    vrows = np.resize(vals, (Lk, dv)) * np.where(rng.random((Lk, dv)) < 0.5, 1, -1).astype(
        np.float32
    )
    q, k = (
        make(rng.standard_normal((1, 1, 3, 8)), src),
        make(rng.standard_normal((1, 1, Lk, 8)), src),
    )
    v = make(vrows.reshape(1, 1, Lk, dv), src)
    o = sdpa(q, k, v, window_size=(0, 0), backend="decode")
    np.testing.assert_array_equal(f64(o), f64(v)[:, :, Lk - 3 :])


# ---------------------------------------------------------------- KVCache in 16 bits

CACHE_DTYPE = {
    "numpy_f16": np.float16,
    "torch_f16": "float16",
    "torch_bf16": "bfloat16",
    "ml_bf16": "bfloat16",
}


def _sl(x, t0, t1):
    return x[:, :, t0:t1]


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("window", [None, 24])
def test_cache_prefill_decode_matches_oracle(isa, rng, src, window):
    """A 16-bit KVCache (GQA 6 on 2, ragged lengths, ring window): prefill, then decode steps; every
    attend against the oracle on the stored (rounded) keys; O in the cache's dtype, lse float32; the
    storage is half of float32's."""
    B, Hq, Hkv, d, dv, L0, steps = 2, 6, 2, 80, 40, 37, 5
    need(src)
    cache = af.KVCache(B, Hkv, d, capacity=8, v_head_dim=dv, dtype=CACHE_DTYPE[src], window=window)
    ref32 = af.KVCache(B, Hkv, d, capacity=8, v_head_dim=dv, window=window)
    Ltot = L0 + steps
    q, k, v = gen(rng, src, (B, Hq, Ltot, d), (B, Hkv, Ltot, d), (B, Hkv, Ltot, dv))
    lens = np.array([L0, 30])
    cache.append(_sl(k, 0, L0), _sl(v, 0, L0), lengths=lens)
    ref32.append(
        f64(k)[:, :, :L0].astype(np.float32), f64(v)[:, :, :L0].astype(np.float32), lengths=lens
    )
    assert cache.nbytes * 2 == ref32.nbytes
    Q, K, V = f64(q), f64(k).repeat(3, axis=1), f64(v).repeat(3, axis=1)

    def want(b, qpos, kpos):  # queries at positions qpos of sequence b against keys at kpos
        keys = np.array(kpos)
        vis = keys[None, :] <= np.array(qpos)[:, None]
        if window is not None:
            vis &= keys[None, :] > np.array(qpos)[:, None] - window
        return orc(
            Q[b : b + 1][:, :, qpos],
            K[b : b + 1][:, :, keys],
            V[b : b + 1][:, :, keys],
            mask=vis,
            return_lse=True,
        )

    o, lse = cache.attend(_sl(q, 0, L0), return_lse=True)
    result_dtype_ok(o, src)
    assert np.asarray(lse).dtype == np.float32
    for b in range(B):
        n = int(lens[b])
        O, LSE = want(b, list(range(n)), list(range(n)))
        close(f64(o)[b : b + 1, :, :n], O, src)
        check_lse(np.asarray(lse)[b : b + 1, :, :n], LSE)
    pos = lens.copy()
    for _ in range(steps):
        # sequence b's next token is input row pos[b] (gathered per sequence)
        kt = make(np.stack([f64(k)[b, :, pos[b] : pos[b] + 1] for b in range(B)]), src)
        vt = make(np.stack([f64(v)[b, :, pos[b] : pos[b] + 1] for b in range(B)]), src)
        qt = make(np.stack([Q[b, :, pos[b] : pos[b] + 1] for b in range(B)]), src)
        cache.append(kt, vt)
        o, lse = cache.attend(qt, return_lse=True)
        result_dtype_ok(o, src)
        for b in range(B):
            p = int(pos[b])
            O, LSE = want(b, [p], list(range(p + 1)))
            close(f64(o)[b : b + 1], O, src)
            check_lse(np.asarray(lse)[b : b + 1], LSE)
        pos += 1


@pytest.mark.parametrize("src", SOURCES)
def test_cache_rope_truncate_forward(isa, rng, src):
    """RoPE on append (rotated in float32, rounded once), truncate,
    forward() in ring pieces, LayerCaches."""
    B, Hkv, Hq, d, L = 1, 2, 2, 32, 20
    need(src)
    rope = af.positional.RoPE(d)
    q, k, v = gen(rng, src, (B, Hq, L, d), (B, Hkv, L, d), (B, Hkv, L, d))
    cache = af.KVCache(B, Hkv, d, dtype=CACHE_DTYPE[src])
    cache.append(k, v, rope=rope)
    rot = f64(make(rope(f64(k).astype(np.float32), seq_axis=-2), src))  # what the cache must hold
    np.testing.assert_array_equal(f64(cache.keys(0)), rot[0])
    np.testing.assert_array_equal(f64(cache.values(0)), f64(v)[0])
    cache.truncate(12)
    o = cache.attend(_sl(q, 0, 2), q_lens=2)  # the last two of the 12 kept positions
    vis = np.arange(12)[None, :] <= np.array([10, 11])[:, None]
    close(o, orc(f64(q)[:, :, :2], rot[:, :, :12], f64(v)[:, :, :12], mask=vis), src)

    layers = af.LayerCaches(2, B, Hkv, d, dtype=CACHE_DTYPE[src], window=6, ring=8)
    o, lse = layers[1].forward(q, k, v, return_lse=True)  # pieces of ring - window + 1 = 3 tokens
    result_dtype_ok(o, src)
    O, LSE = orc(f64(q), f64(k), f64(v), mask=ref.window_mask(L, L, 5, 0), return_lse=True)
    close(o, O, src)
    check_lse(lse, LSE)
    assert layers.nbytes == 2 * B * Hkv * 8 * 2 * d * 2
    with pytest.raises(TypeError, match="cast it first"):
        layers[0].append(f64(k).astype(np.float32), f64(v).astype(np.float32))
