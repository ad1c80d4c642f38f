"""Mask objects, GQA and cross-attention shapes against the float64 oracle.

Every mask is checked against ``reference.sdpa`` fed with the equivalent dense
boolean mask, built here from first principles (not from attn_fast.masks).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    assert_attention,
    assert_close,
    poisoned,
    qkv,
    randn,
    random_bias,
    random_mask,
    run_sdpa,
    tol,
)

import attn_fast as af
from attn_fast import masks as M
from attn_fast import reference as ref

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is in the test extras
    given = None


# ---------------------------------------------------------------- dense equivalents


def dense_causal(
    B, Lq, Lk, q_len=None, k_len=None, align="bottom_right", left=None, right=0, causal=True
):
    """(B, 1, Lq, Lk) visibility of causal/window/padding, one sequence at a time."""
    q_len = [Lq] * B if q_len is None else list(q_len)
    k_len = [Lk] * B if k_len is None else list(k_len)
    out = np.zeros((B, 1, Lq, Lk), bool)
    for b in range(B):
        off = k_len[b] - q_len[b] if align == "bottom_right" else 0
        i = np.arange(q_len[b])[:, None] + off  # aligned query position
        j = np.arange(k_len[b])[None, :]
        ok = np.ones((q_len[b], k_len[b]), bool)
        if causal:
            ok &= j <= i
        if left is not None:
            ok &= j >= i - left
        if right is not None:
            ok &= j <= i + right
        out[b, 0, : q_len[b], : k_len[b]] = ok
    return out


def dense_layout(layout, bq, bk, Lq, Lk):
    """Expand a (..., nq, nk) block layout to (..., Lq, Lk)."""
    return np.repeat(np.repeat(layout, bq, axis=-2), bk, axis=-1)[..., :Lq, :Lk]


def run_and_check(q, k, v, mask_arg, dense, bias=None, dtype=np.float64, row_valid=None, **kw):
    """Kernel (poisoned out) vs oracle; rows the oracle says see nothing are zeros, lse -inf."""
    o, lse = run_sdpa(q, k, v, dtype, attn_mask=mask_arg, **kw)
    O, LSE = ref.sdpa(q, k, v, mask=dense, bias=bias, return_lse=True)
    if row_valid is not None:  # padding rows: zeros and -inf whatever the oracle says
        O = np.where(row_valid[..., None], O, 0.0)
        LSE = np.where(row_valid, LSE, -np.inf)
    assert not np.any(np.isnan(o)) and not np.any(np.isnan(lse))
    assert_attention(o, lse, O, LSE, dtype)
    dead = np.isneginf(LSE)
    assert np.all(o[dead] == 0)
    return o, lse


SHAPES = [
    # B, Hq, Hkv, Lq, Lk, d, dv: tails, Lq != Lk both ways, dv != d, GQA
    (2, 3, 3, 7, 7, 5, 5),
    (1, 4, 2, 129, 100, 80, 64),
    (2, 2, 1, 37, 150, 16, 8),
    (1, 1, 1, 1, 33, 3, 3),
    (1, 2, 2, 90, 30, 8, 12),
]
SID = ["x".join(map(str, s)) for s in SHAPES]


@pytest.mark.parametrize("shape", SHAPES, ids=SID)
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_causal(isa, rng, shape, align):
    B, Hq, Hkv, Lq, Lk, d, dv = shape
    q, k, v = qkv(rng, *shape, np.float64)
    dense = dense_causal(B, Lq, Lk, align=align, right=None)
    run_and_check(q, k, v, M.Causal(align), dense, enable_gqa=True)


@pytest.mark.parametrize("shape", SHAPES, ids=SID)
@pytest.mark.parametrize("left,right", [(0, 0), (3, 0), (10, 4), (None, 2), (50, None)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_sliding_window(isa, rng, shape, left, right, dtype):
    B, Hq, Hkv, Lq, Lk, d, dv = shape
    q, k, v = qkv(rng, *shape, dtype=dtype)
    dense = dense_causal(B, Lq, Lk, left=left, right=right, causal=False)
    run_and_check(q, k, v, M.SlidingWindow(left, right), dense, dtype=dtype, enable_gqa=True)
    # The same through window_size, and with Causal (Mistral's local attention).
    if right == 0:
        run_and_check(
            q, k, v, M.SlidingWindow(left) & M.Causal(), dense, dtype=dtype, enable_gqa=True
        )
        run_and_check(
            q,
            k,
            v,
            None,
            dense,
            dtype=dtype,
            enable_gqa=True,
            is_causal=True,
            window_size=(left, None),
        )


def test_sliding_window_top_left(rng):
    q, k, v = qkv(rng, 1, 2, 2, 40, 70, 8, 8, np.float64)
    dense = dense_causal(1, 40, 70, align="top_left", left=5, right=2, causal=False)
    run_and_check(q, k, v, M.SlidingWindow(5, 2, align="top_left"), dense)


@pytest.mark.parametrize("shape", SHAPES, ids=SID)
def test_padding(isa, rng, shape):
    B, Hq, Hkv, Lq, Lk, d, dv = shape
    q, k, v = qkv(rng, *shape, np.float64)
    kv_lens = rng.integers(0, Lk + 1, B)
    q_lens = rng.integers(0, Lq + 1, B)
    # keys only: with Lq == Lk the queries are the same padded tokens (q_lens = kv_lens)
    q_default = kv_lens if Lq == Lk else np.full(B, Lq)
    dense = dense_causal(B, Lq, Lk, q_default, kv_lens, causal=False, right=None)
    valid0 = np.arange(Lq).reshape(1, 1, Lq) < q_default.reshape(B, 1, 1)
    run_and_check(
        q,
        k,
        v,
        M.Padding(kv_lens),
        dense,
        row_valid=np.broadcast_to(valid0, (B, Hq, Lq)),
        enable_gqa=True,
    )
    # queries and keys, with causal: each sequence has its own diagonal
    dense = dense_causal(B, Lq, Lk, q_lens, kv_lens)
    valid = np.arange(Lq).reshape(1, 1, Lq) < q_lens.reshape(B, 1, 1)
    o, lse = run_and_check(
        q,
        k,
        v,
        M.Padding(kv_lens, q_lens) & M.Causal(),
        dense,
        row_valid=np.broadcast_to(valid, (B, Hq, Lq)),
        enable_gqa=True,
    )
    assert np.all(o[~np.broadcast_to(valid, (B, Hq, Lq))] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_causal_and_kv_padding_is_what_torch_gives(rng, isa, dtype):
    """Causal() & Padding(kv_lens=lens) on a right-padded self-attention batch (Lq == Lk):
    valid query i of sequence b sees keys j <= i, j < lens[b], as torch and transformers
    compute it; the padding rows are zeros. (It once aligned each sequence's queries to
    the end of its keys, so the first rows of a short sequence saw nothing.)"""
    B, H, L, d = 3, 2, 64, 16
    lens = np.array([30, 64, 1])
    q, k, v = qkv(rng, B, H, H, L, L, d, d, dtype)
    for mask in (
        M.Causal() & M.Padding(kv_lens=lens),
        M.Padding(lens) & M.Causal(),
        [M.Padding(lens), M.Causal()],
    ):
        o, lse = af.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
        o2 = af.scaled_dot_product_attention(q, k, v, attn_mask=M.Padding(lens), is_causal=True)
        np.testing.assert_array_equal(o, o2)
        vis = np.tril(np.ones((L, L), bool))[None] & (
            np.arange(L)[None, None, :] < lens[:, None, None]
        )
        O, LSE = ref.sdpa(q, k, v, mask=vis[:, None], return_lse=True)
        for b, n in enumerate(lens):
            assert_close(o[b, :, :n], O[b, :, :n], dtype)
            assert_close(lse[b, :, :n], LSE[b, :, :n], dtype)
            assert np.all(o[b, :, n:] == 0) and np.all(np.isneginf(lse[b, :, n:]))
    torch = pytest.importorskip("torch")
    t = torch.from_numpy
    vis_t = t(vis[:, None].copy())
    want = torch.nn.functional.scaled_dot_product_attention(
        t(q), t(k), t(v), attn_mask=vis_t
    ).numpy()
    for b, n in enumerate(lens):
        np.testing.assert_allclose(
            o[b, :, :n],
            want[b, :, :n],
            **tol(dtype) if dtype == np.float64 else dict(rtol=1e-4, atol=1e-5),
        )


def test_kv_padding_with_fewer_queries_stays_bottom_right(rng):
    """Lq != Lk (a chunk of queries against a padded cache): all Lq rows are valid and the
    last query row of sequence b is aligned with its last valid key."""
    B, H, Lq, Lk, d = 2, 2, 4, 40, 8
    lens = np.array([40, 23])
    q, k, v = qkv(rng, B, H, H, Lq, Lk, d, d, np.float64)
    o = af.scaled_dot_product_attention(q, k, v, attn_mask=M.Causal() & M.Padding(lens))
    for b, n in enumerate(lens):
        one = af.scaled_dot_product_attention(q[b], k[b, :, :n], v[b, :, :n], is_causal=True)
        np.testing.assert_allclose(o[b], one, rtol=1e-12, atol=1e-12)
    dense = dense_causal(B, Lq, Lk, [Lq] * B, lens)
    run_and_check(q, k, v, M.Causal() & M.Padding(lens), dense)


def test_padded_decoder_batch_equals_separate_calls(rng):
    """Right-padded batch + causal = each sequence alone (bottom-right per sequence)."""
    B, H, L, d = 3, 2, 50, 16
    lens = np.array([50, 17, 33])
    q, k, v = qkv(rng, B, H, H, L, L, d, d, np.float64)
    o = af.scaled_dot_product_attention(q, k, v, attn_mask=M.Padding(lens, lens), is_causal=True)
    for b, n in enumerate(lens):
        one = af.scaled_dot_product_attention(q[b, :, :n], k[b, :, :n], v[b, :, :n], is_causal=True)
        np.testing.assert_allclose(o[b, :, :n], one, rtol=1e-12, atol=1e-12)
        assert np.all(o[b, :, n:] == 0)


@pytest.mark.parametrize("shape", SHAPES, ids=SID)
@pytest.mark.parametrize("bq,bk", [(1, 1), (7, 5), (16, 64), (200, 3)])
def test_block_sparse(isa, rng, shape, bq, bk):
    B, Hq, Hkv, Lq, Lk, d, dv = shape
    q, k, v = qkv(rng, *shape, np.float64)
    nq, nk = -(-Lq // bq) + 1, -(-Lk // bk)  # one spare query block: layouts may over-cover
    layout = rng.random((B, 1, nq, nk)) < 0.4
    dense = dense_layout(layout, bq, bk, Lq, Lk)
    run_and_check(q, k, v, M.BlockSparse(layout, bq, bk), dense, enable_gqa=True)
    # per-head layout (H, nq, nk), with causal on top
    layout = rng.random((Hq, nq, nk)) < 0.5
    dense = dense_layout(layout, bq, bk, Lq, Lk)[None] & dense_causal(B, Lq, Lk, right=None)
    run_and_check(q, k, v, M.BlockSparse(layout, bq, bk) & M.Causal(), dense, enable_gqa=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_dense_masks(isa, rng, dtype):
    B, Hq, Hkv, Lq, Lk, d, dv = 2, 4, 2, 71, 130, 24, 16
    q, k, v = qkv(rng, B, Hq, Hkv, Lq, Lk, d, dv, dtype)
    # Blocks of False (whole tiles skipped) plus scattered False.
    mask = random_mask(rng, (B, Hq, Lq, Lk), 0.7)
    mask[:, :, :, 64:128] = False
    mask[0, 1, 3] = False
    run_and_check(q, k, v, mask, mask, dtype=dtype, enable_gqa=True)
    run_and_check(q, k, v, M.Dense(mask[:, :1]), mask[:, :1], dtype=dtype, enable_gqa=True)
    # Additive bias, of the other precision, broadcast from (Lq, Lk), with -inf holes.
    bias = random_bias(rng, (Lq, Lk), 0.2)
    run_and_check(q, k, v, bias, None, bias=bias, dtype=dtype, enable_gqa=True)
    # attn_mask and is_causal together (torch refuses the pair): they intersect.
    dense = mask & dense_causal(B, Lq, Lk, right=None)
    run_and_check(q, k, v, mask, dense, dtype=dtype, enable_gqa=True, is_causal=True)


def test_bias_of_other_dtype_is_not_broadcast_copied(rng):
    # A float64 (Lq, Lk) bias with float32 q must be cast at its own shape.
    q, k, v = qkv(rng, 4, 8, 8, 33, 33, 8, 8, np.float32)
    bias = rng.standard_normal((33, 33))
    args = M.Dense(bias).kernel_args(B=4, H=8, Lq=33, Lk=33, dtype=np.float32)
    assert args.bias.dtype == np.float32 and args.bias.strides[:2] == (0, 0)
    run_and_check(q, k, v, bias, None, bias=bias, dtype=np.float32)


def test_combination_of_every_kind(isa, rng):
    B, Hq, Hkv, Lq, Lk, d, dv = 2, 4, 2, 83, 120, 16, 8
    q, k, v = qkv(rng, B, Hq, Hkv, Lq, Lk, d, dv, np.float64)
    kv_lens, q_lens = np.array([120, 77]), np.array([83, 60])
    layout = rng.random((Hq, 6, 8)) < 0.7
    mask = random_mask(rng, (B, 1, Lq, Lk), 0.8)
    bias = rng.standard_normal((Hq, Lq, Lk)) * 0.5
    combo = (
        M.Causal()
        & M.SlidingWindow(40)
        & M.Padding(kv_lens, q_lens)
        & M.BlockSparse(layout, 16, 16)
    )
    combo = combo & mask & M.Dense(bias)
    dense = (
        dense_causal(B, Lq, Lk, q_lens, kv_lens, left=40)
        & dense_layout(layout, 16, 16, Lq, Lk)[None]
        & mask
    )
    valid = np.broadcast_to((np.arange(Lq) < q_lens.reshape(B, 1, 1)), (B, Hq, Lq))
    run_and_check(q, k, v, combo, dense, bias=bias[None], row_valid=valid, enable_gqa=True)
    # The same parts as a list, and an array on the left of &.
    run_and_check(
        q,
        k,
        v,
        [
            mask,
            M.Causal(),
            M.SlidingWindow(40),
            M.Padding(kv_lens, q_lens),
            M.BlockSparse(layout, 16, 16),
            M.Dense(bias),
        ],
        dense,
        bias=bias[None],
        row_valid=valid,
        enable_gqa=True,
    )
    run_and_check(
        q, k, v, mask & M.Causal(), mask & dense_causal(B, Lq, Lk, right=None), enable_gqa=True
    )


def test_merge_rules(rng):
    B, H, Lq, Lk, d = 2, 2, 60, 60, 8
    q, k, v = qkv(rng, B, H, H, Lq, Lk, d, d, np.float64)
    # two windows: intersection
    dense = dense_causal(B, Lq, Lk, left=5, right=3, causal=False)
    run_and_check(q, k, v, M.SlidingWindow(9, 3) & M.SlidingWindow(5, 7), dense)
    run_and_check(q, k, v, M.SlidingWindow(5, None), dense, window_size=(20, 3))
    # two boolean masks: AND;  two biases: sum
    m1, m2 = random_mask(rng, (Lq, Lk), 0.6), random_mask(rng, (B, 1, Lq, Lk), 0.6)
    run_and_check(q, k, v, M.Dense(m1) & m2, m1 & m2)
    b1, b2 = rng.standard_normal((Lq, Lk)), rng.standard_normal((H, Lq, Lk))
    run_and_check(q, k, v, M.Dense(b1) & M.Dense(b2), None, bias=b1 + b2)
    # two paddings: element-wise minimum (Lq == Lk: of the query rows too)
    p = M.Padding([60, 20]) & M.Padding([30, 50])
    n = np.array([30, 20])
    dense = np.arange(Lk).reshape(1, 1, 1, Lk) < n.reshape(B, 1, 1, 1)
    rows = np.broadcast_to(np.arange(Lq).reshape(1, 1, Lq) < n.reshape(B, 1, 1), (B, H, Lq))
    run_and_check(q, k, v, p, np.broadcast_to(dense, (B, 1, Lq, Lk)), row_valid=rows)
    # two layouts with different block sizes: AND at gcd(block sizes)
    l1, l2 = rng.random((4, 4)) < 0.7, rng.random((10, 6)) < 0.7
    dense = dense_layout(l1, 15, 15, Lq, Lk) & dense_layout(l2, 6, 10, Lq, Lk)
    run_and_check(q, k, v, M.BlockSparse(l1, 15) & M.BlockSparse(l2, 6, 10), dense)
    # union of layouts
    u = M.BlockSparse(l1, 15) | M.BlockSparse(l2, 6, 10)
    dense = dense_layout(l1, 15, 15, Lq, Lk) | dense_layout(l2, 6, 10, Lq, Lk)
    run_and_check(q, k, v, u, dense)
    # top-left and bottom-right coincide when Lq == Lk: no error
    run_and_check(
        q, k, v, M.Causal("top_left") & M.SlidingWindow(4), dense_causal(B, Lq, Lk, left=4)
    )


def test_alignment_conflict(rng):
    q, k, v = qkv(rng, 1, 1, 1, 10, 20, 4, 4, np.float64)
    with pytest.raises(ValueError, match="alignment"):
        af.scaled_dot_product_attention(q, k, v, attn_mask=M.Causal("top_left"), is_causal=True)
    with pytest.raises(ValueError, match="alignment"):
        af.scaled_dot_product_attention(
            q, k, v, attn_mask=M.Causal("top_left") & M.SlidingWindow(3)
        )
    with pytest.raises(ValueError, match="alignment"):
        af.scaled_dot_product_attention(q, k, v, attn_mask=M.Causal("top_left"), window_size=(3, 0))
    # Same lengths but queries and keys padded differently: the diagonals differ, so it is refused
    # too.
    q2, k2, v2 = qkv(rng, 2, 1, 1, 10, 10, 4, 4, np.float64)
    with pytest.raises(ValueError, match="alignment"):
        af.scaled_dot_product_attention(
            q2,
            k2,
            v2,
            attn_mask=M.Causal("top_left") & M.Padding([10, 4], [10, 10]),
            is_causal=True,
        )
    # kv_lens alone with Lq == Lk: q_lens = kv_lens, both diagonals are i = j, no conflict
    o = af.scaled_dot_product_attention(
        q2, k2, v2, attn_mask=M.Causal("top_left") & M.Padding([10, 4]), is_causal=True
    )
    np.testing.assert_allclose(
        o,
        af.scaled_dot_product_attention(q2, k2, v2, attn_mask=M.Padding([10, 4]), is_causal=True),
        rtol=1e-12,
        atol=1e-12,
    )


def test_alibi_softcap_sinks_with_masks(isa, rng):
    B, Hq, Hkv, Lq, Lk, d, dv = 2, 4, 1, 45, 64, 16, 16
    q, k, v = qkv(rng, B, Hq, Hkv, Lq, Lk, d, dv, np.float64)
    slopes = rng.uniform(0.05, 0.5, Hq)
    kv_lens = np.array([64, 50])
    mask = M.Padding(kv_lens) & M.Causal()
    dense = dense_causal(B, Lq, Lk, k_len=kv_lens, right=None)
    off = (kv_lens - Lq).reshape(B, 1, 1, 1)
    i, j = np.arange(Lq).reshape(1, 1, Lq, 1), np.arange(Lk).reshape(1, 1, 1, Lk)
    alibi = -slopes.reshape(1, Hq, 1, 1) * np.abs(i + off - j)
    o = af.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, alibi_slopes=slopes, softcap=2.0, enable_gqa=True
    )
    # oracle: softcap first, then the ALiBi bias
    kk = np.repeat(k, Hq, axis=1)
    S = 2.0 * np.tanh(q @ kk.swapaxes(-1, -2) / np.sqrt(d) / 2.0) + alibi
    S = np.where(dense, S, -np.inf)
    P = np.exp(S - S.max(-1, keepdims=True))
    P = np.where(dense, P, 0)
    P /= P.sum(-1, keepdims=True)
    np.testing.assert_allclose(o, P @ np.repeat(v, Hq, axis=1), atol=1e-11)
    sinks = rng.standard_normal(Hq)
    o, lse = af.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, sinks=sinks, enable_gqa=True, return_lse=True
    )
    O, LSE = ref.sdpa(q, k, v, mask=dense, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(o, O, atol=1e-11)
    np.testing.assert_allclose(lse, LSE, atol=1e-11)


# ---------------------------------------------------------------- GQA


@pytest.mark.parametrize("ratio", [1, 2, 4, 8, 32])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_gqa_ratios(isa, rng, ratio, dtype):
    Hq = 32
    Hkv = Hq // ratio
    B, Lq, Lk, d, dv = 2, 19, 41, 8, 6
    q, k, v = qkv(rng, B, Hq, Hkv, Lq, Lk, d, dv, dtype)
    dense = dense_causal(B, Lq, Lk, left=9)
    o, _ = run_and_check(
        q, k, v, M.Causal() & M.SlidingWindow(9), dense, dtype=dtype, enable_gqa=True
    )
    # torch's order: head h reads kv head h // ratio (repeat_interleave, not tile)
    for h in (0, Hq - 1, Hq // 2):
        one = af.scaled_dot_product_attention(
            q[:, h], k[:, h // ratio], v[:, h // ratio], attn_mask=M.Causal() & M.SlidingWindow(9)
        )
        assert_close(o[:, h], one, dtype)


def test_gqa_kv_not_copied(rng):
    # K/V views with odd strides go to the kernel as they are: the same result
    # from a (B, L, Hkv, d) buffer seen through transpose as from a copy.
    B, Hq, Hkv, L, d = 1, 8, 2, 30, 16
    q = randn(rng, (B, Hq, L, d), np.float64)
    kb, vb = randn(rng, (B, L, Hkv, d), np.float64), randn(rng, (B, L, Hkv, d), np.float64)
    k, v = kb.transpose(0, 2, 1, 3), vb.transpose(0, 2, 1, 3)
    o = af.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    o2 = af.scaled_dot_product_attention(
        q, np.ascontiguousarray(k), np.ascontiguousarray(v), enable_gqa=True, is_causal=True
    )
    np.testing.assert_array_equal(o, o2)


# ---------------------------------------------------------------- semantics


def _fully_masked_cases(B, H, Lq, Lk):
    """(name, mask argument): each leaves some query rows with nothing visible and
    (except causal) some keys that no query of a (batch, head) sees."""
    mask = np.ones((B, 1, Lq, Lk), bool)
    mask[0, 0, 2] = False
    mask[:, :, :, 5] = False
    bias = np.zeros((Lq, Lk))
    bias[4] = -np.inf
    bias[:, 5] = -np.inf
    layout = np.ones((-(-Lq // 4), -(-Lk // 8)), bool)
    layout[1] = False  # query rows 4..7
    layout[:, 1] = False  # keys 8..15
    return [
        ("causal", M.Causal()),  # Lq > Lk: the first Lq - Lk rows
        ("window", M.SlidingWindow(0, 0) & M.Padding([Lk, 3])),
        ("padding_k", M.Padding([0, Lk])),
        ("padding_q", M.Padding([Lk, 9], [Lq, 5])),
        ("block", M.BlockSparse(layout, 4, 8)),
        ("bool", mask),
        ("bias", bias),
    ]


@pytest.mark.parametrize("case", range(7))
@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_fully_masked_rows_and_nan_in_masked_kv(isa, rng, case, backend):
    """Rows that see nothing: zeros and lse = -inf; NaN/inf in masked K/V rows never leak."""
    B, H, Lq, Lk, d = 2, 2, 24, 16, 8
    name, m = _fully_masked_cases(B, H, Lq, Lk)[case]
    q, k, v = qkv(rng, B, H, H, Lq, Lk, d, d, np.float32)
    dense = M.as_mask(m).to_dense(B, H, Lq, Lk)
    unseen = ~dense.any(axis=2)  # (B, H, Lk): keys no query of (b, h) sees
    assert name == "causal" or unseen.any()
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[unseen] = np.nan
    v_bad[unseen] = np.inf
    expect = ref.sdpa(q, k, v, mask=dense)
    for kk, vv in ((k, v), (k_bad, v), (k, v_bad), (k_bad, v_bad)):
        out = poisoned((B, H, Lq, d), np.float32)
        o, lse = af.scaled_dot_product_attention(
            q, kk, vv, attn_mask=m, out=out, return_lse=True, backend=backend
        )
        assert not np.any(np.isnan(o)), name
        dead = ~dense.any(axis=-1)
        assert dead.any(), name
        assert np.all(o[dead] == 0) and np.all(np.isneginf(lse[dead]))
        assert not np.any(np.isnan(lse))
        assert_close(o, expect, np.float32)


def test_nan_in_k_masked_by_bias_does_not_leak(isa, rng):
    """Regression: a -inf bias used to be *added* to a NaN score, giving NaN rows."""
    q, k, v = qkv(rng, 1, 2, 2, 40, 40, 8, 8, np.float32)
    k[:, :, 20] = np.nan
    bias = np.zeros((40, 40), np.float32)
    bias[:, 20] = -np.inf
    for backend in ("fused", "reference"):
        o = af.scaled_dot_product_attention(q, k, v, attn_mask=bias, backend=backend)
        assert not np.any(np.isnan(o))
        k0 = k.copy()
        k0[:, :, 20] = 0
        assert_close(o, ref.sdpa(q, k0, v, bias=bias), np.float32)


# ---------------------------------------------------------------- constructors


def test_block_sparse_constructors():
    loc = M.BlockSparse.local(100, 10, 2)
    assert loc.layout.shape == (10, 10) and loc.block_q == loc.block_k == 10
    x, y = np.indices((10, 10))
    np.testing.assert_array_equal(loc.layout, np.abs(x - y) < 2)
    np.testing.assert_array_equal(
        M.BlockSparse.local(100, 10, 3, causal=True).layout, (x - y >= 0) & (x - y < 3)
    )
    st_ = M.BlockSparse.strided(64, 8, 3)
    np.testing.assert_array_equal(
        st_.layout, (x[:8, :8] >= y[:8, :8]) & (((x - y)[:8, :8] < 3) | ((x - y)[:8, :8] % 3 == 0))
    )
    assert st_.layout[7, 1] and not st_.layout[7, 3] and not st_.layout[1, 7]
    g = M.BlockSparse.global_tokens(95, 10, global_blocks=[0, 5], width=1)
    assert g.layout.shape == (10, 10)
    expect = np.eye(10, dtype=bool)
    expect[[0, 5], :] = True
    expect[:, [0, 5]] = True
    np.testing.assert_array_equal(g.layout, expect)
    r = M.BlockSparse.global_tokens(
        100, 10, global_blocks=1, width=2, random_blocks=2, seed=3, causal=True
    )
    assert not np.any(np.triu(r.layout, 1))
    r2 = M.BlockSparse.global_tokens(
        100, 10, global_blocks=1, width=2, random_blocks=2, seed=3, causal=True
    )
    np.testing.assert_array_equal(r.layout, r2.layout)
    assert 0 < r.density < 1


@pytest.mark.parametrize("ctor", ["local", "strided", "global"])
def test_block_sparse_constructors_run(isa, rng, ctor):
    L, blk = 150, 16
    m = {
        "local": M.BlockSparse.local(L, blk, 2, causal=True),
        "strided": M.BlockSparse.strided(L, blk, 3),
        "global": M.BlockSparse.global_tokens(L, blk, 1, width=1, random_blocks=1, seed=1),
    }[ctor]
    q, k, v = qkv(rng, 1, 2, 2, L, L, 8, 8, np.float64)
    dense = dense_layout(m.layout, blk, blk, L, L)[None, None] & dense_causal(1, L, L, right=None)
    run_and_check(q, k, v, m & M.Causal(), dense)


# ---------------------------------------------------------------- kernel statistics


# The kernel reports the tile it used (KernelStats.block_q / block_k): block_q
# as asked, block_k rounded up to the active path's key-panel width. Every
# expected count below is computed from the reported tile, never from the
# sizes asked, so the tests hold on every ISA and dtype.


def kernel_tiles(kept, Br, Bc):
    """Number of (Br x Bc) tiles of an (Lq, Lk) boolean array holding any True."""
    Lq, Lk = kept.shape
    rows = np.logical_or.reduceat(kept, np.arange(0, Lq, Br), axis=0)
    return int(np.logical_or.reduceat(rows, np.arange(0, Lk, Bc), axis=1).sum())


def band_tiles(L, Br, Bc, left):
    """Key blocks the kernel walks for a causal band of `left` keys (Lq == Lk):
    each query block [i0, i1) visits the Bc-aligned blocks covering [i0 - left, i1)."""
    n = 0
    for i0 in range(0, L, Br):
        lo, hi = max(0, i0 - left), min(L, i0 + Br)
        n += -(-hi // Bc) - lo // Bc
    return n


def check_reported_tile(s, block_q, block_k, L):
    """The tile used: block_q as asked, block_k the smallest allowed multiple >= the ask."""
    assert s.block_q == min(block_q, L)
    assert s.block_k >= min(block_k, L) and s.block_k % 4 == 0  # panel widths are multiples of 4


def test_stats_count_kept_blocks_exactly(rng):
    """tiles_computed = tiles holding a kept layout block; + skipped = all tiles."""
    B, H, L, d, blk = 1, 2, 256, 8, 64
    q, k, v = qkv(rng, B, H, H, L, L, d, d, np.float32)
    n = L // blk
    layout = rng.random((H, n, n)) < 0.5
    layout[:, 0, 0] = True
    _, s = af.scaled_dot_product_attention(
        q, k, v, attn_mask=M.BlockSparse(layout, blk), return_stats=True, block_q=blk, block_k=blk
    )
    check_reported_tile(s, blk, blk, L)
    Br, Bc = s.block_q, s.block_k
    kept = [dense_layout(layout[h], blk, blk, L, L) for h in range(H)]
    assert s.tiles_computed == B * sum(kernel_tiles(kp, Br, Bc) for kp in kept)
    all_tiles = -(-L // Br) * -(-L // Bc)
    assert s.tiles_computed + s.tiles_skipped == all_tiles * H * B
    _, full = af.scaled_dot_product_attention(q, k, v, return_stats=True, block_q=blk, block_k=blk)
    assert full == af.KernelStats(all_tiles * H * B, 0, Br, Bc)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stats_report_the_tile_used(rng, isa, dtype):
    """block_q is honoured as asked; block_k is rounded up (never down) to the path's
    panel width; the defaults are reported too; results do not depend on the tile."""
    L, d = 300, 8
    q, k, v = qkv(rng, 1, 2, 2, L, L, d, d, dtype)
    base = af.scaled_dot_product_attention(q, k, v, is_causal=True)
    for bq, bk in [(1, 1), (7, 5), (32, 32), (48, 100), (0, 0), (4096, 4096)]:
        o, s = af.scaled_dot_product_attention(
            q, k, v, is_causal=True, return_stats=True, block_q=bq, block_k=bk
        )
        assert 1 <= s.block_q <= L and 1 <= s.block_k <= 4096
        if bq:
            assert s.block_q == min(bq, L)
        if bk:
            assert s.block_k >= min(bk, L)
        # causal, Lq == Lk: exactly the tiles on or below the diagonal
        assert s.tiles_computed == 2 * kernel_tiles(np.tri(L, dtype=bool), s.block_q, s.block_k)
        assert_close(o, base, dtype)
    o, s = af.scaled_dot_product_attention(q[:, :, :0], k, v, return_stats=True)
    assert s == af.KernelStats(0, 0, 0, 0)
    _, s = af.scaled_dot_product_attention(q, k, v, return_stats=True, backend="reference")
    assert s == af.KernelStats(0, 0, 0, 0)


def test_stats_window_grows_linearly(rng):
    """Window w: the tiles visited grow as L * w, not L^2."""
    H, d, w, blk = 1, 8, 32, 32
    counts = []
    for L in (256, 512, 1024):
        q, k, v = qkv(rng, 1, H, H, L, L, d, d, np.float32)
        _, s = af.scaled_dot_product_attention(
            q, k, v, attn_mask=M.SlidingWindow(w), return_stats=True, block_q=blk, block_k=blk
        )
        check_reported_tile(s, blk, blk, L)
        counts.append(s.tiles_computed)
        # the key blocks covering each query block's band, and no others
        assert s.tiles_computed == band_tiles(L, s.block_q, s.block_k, w)
    assert counts[1] <= 2 * counts[0] + 2 and counts[2] <= 2 * counts[1] + 2
    _, dense = af.scaled_dot_product_attention(q, k, v, return_stats=True, block_q=blk, block_k=blk)
    assert (
        dense.tiles_computed
        == -(-1024 // dense.block_q) * -(-1024 // dense.block_k)
        > 4 * counts[2]
    )


def _check_stats_fall_with_density(data_layouts, blk=16):
    rng = np.random.default_rng(0)
    L = blk * data_layouts[0].shape[-1]
    q, k, v = qkv(rng, 1, 1, 1, L, L, 4, 4, np.float32)
    stats = [
        af.scaled_dot_product_attention(
            q, k, v, attn_mask=M.BlockSparse(lay, blk), return_stats=True, block_q=blk, block_k=blk
        )[1]
        for lay in data_layouts
    ]
    counts = [s.tiles_computed for s in stats]
    # nested layouts (each a subset of the next): computed tiles never rise as blocks are removed
    assert counts == sorted(counts)
    assert counts == [
        kernel_tiles(dense_layout(lay, blk, blk, L, L), s.block_q, s.block_k)
        for lay, s in zip(data_layouts, stats)
    ]


if given is not None:

    @settings(max_examples=25, deadline=None)
    @given(n=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
    def test_property_tiles_fall_with_kept_fraction(n, seed):
        r = np.random.default_rng(seed)
        keys = r.random((n, n))
        # thresholds 0 .. 1: nested layouts keeping a growing fraction of blocks
        layouts = [keys < t for t in (0.0, 0.25, 0.5, 0.75, 1.01)]
        _check_stats_fall_with_density(layouts)


def test_tiles_fall_with_kept_fraction_fixed():
    keys = np.random.default_rng(1).random((8, 8))
    _check_stats_fall_with_density([keys < t for t in (0.0, 0.1, 0.3, 0.6, 1.01)])


# ---------------------------------------------------------------- bad masks


def test_mask_errors():
    q = np.ones((2, 2, 16, 8))
    sd = af.scaled_dot_product_attention
    with pytest.raises(ValueError, match="SlidingWindow left"):
        M.SlidingWindow(-1)
    with pytest.raises(ValueError, match="SlidingWindow right"):
        M.SlidingWindow(3, -2)
    with pytest.raises(ValueError, match="align"):
        M.Causal("bottom-right")
    with pytest.raises(ValueError, match="does not cover|covers"):
        sd(q, q, q, attn_mask=M.BlockSparse(np.ones((3, 4), bool), 4, 4))
    with pytest.raises(ValueError, match="BlockSparse layout"):
        M.BlockSparse(np.ones(4, bool), 4)
    with pytest.raises(ValueError, match="BlockSparse layout must be a boolean"):
        M.BlockSparse(np.ones((4, 4)), 4)
    with pytest.raises(TypeError, match="BlockSparse layout must be a boolean"):
        M.BlockSparse(np.ones((4, 4), np.int8), 4)
    with pytest.raises(ValueError, match="not broadcastable"):
        sd(q, q, q, attn_mask=M.BlockSparse(np.ones((3, 4, 4), bool), 4))
    with pytest.raises(ValueError, match="block_q"):
        M.BlockSparse(np.ones((4, 4), bool), 0)
    with pytest.raises(ValueError, match="kv_lens must have one length per batch entry"):
        sd(q, q, q, attn_mask=M.Padding([1, 2, 3]))
    with pytest.raises(ValueError, match=r"kv_lens must lie in \[0, 16\]"):
        sd(q, q, q, attn_mask=M.Padding([1, 17]))
    with pytest.raises(ValueError, match=r"q_lens must lie in"):
        sd(q, q, q, attn_mask=M.Padding([1, 1], [-1, 3]))
    with pytest.raises(ValueError, match="kv_lens must hold integers"):
        sd(q, q, q, attn_mask=M.Padding([1.5, 2]))
    with pytest.raises(ValueError, match=r"attn_mask has shape \(3, 16, 16\), not broadcastable"):
        sd(q, q, q, attn_mask=np.ones((3, 16, 16), bool))
    with pytest.raises(ValueError, match="attn_mask must be a boolean"):
        sd(q, q, q, attn_mask=np.ones((16, 16), np.int32))
    with pytest.raises(ValueError, match="attn_mask must be broadcastable"):
        sd(q, q, q, attn_mask=np.ones((1, 1, 1, 16, 16), bool))
    with pytest.raises(ValueError, match="width"):
        M.BlockSparse.local(64, 8, 0)
    with pytest.raises(ValueError, match="global_blocks"):
        M.BlockSparse.global_tokens(64, 8, global_blocks=[9])


def test_to_dense_matches_kernel(rng):
    m = M.Causal() & M.SlidingWindow(3, 1) & M.Padding([9, 5], [7, 7])
    d = m.to_dense(2, 3, 7, 9)
    assert d.shape == (2, 3, 7, 9) and d.dtype == bool
    np.testing.assert_array_equal(
        d[:, 0], dense_causal(2, 7, 9, [7, 7], [9, 5], left=3, right=0)[:, 0]
    )
    assert "Causal" in repr(m) and "SlidingWindow" in repr(m)


# ---------------------------------------------------------------- torch


try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


@needs_torch
def test_torch_causal_lower_right_and_upper_left(rng):
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    B, H, Lq, Lk, d = 2, 3, 37, 90, 16
    q, k, v = qkv(rng, B, H, H, Lq, Lk, d, d, np.float64)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    F = torch.nn.functional.scaled_dot_product_attention
    expect = F(tq, tk, tv, attn_mask=causal_lower_right(Lq, Lk)).numpy()
    np.testing.assert_allclose(
        af.scaled_dot_product_attention(q, k, v, is_causal=True), expect, atol=1e-12
    )
    np.testing.assert_allclose(
        af.scaled_dot_product_attention(q, k, v, attn_mask=M.Causal()), expect, atol=1e-12
    )
    expect = F(tq, tk, tv, is_causal=True).numpy()  # torch's is_causal: top-left
    np.testing.assert_allclose(
        af.scaled_dot_product_attention(q, k, v, attn_mask=M.Causal("top_left")), expect, atol=1e-12
    )
    expect = F(tq, tk, tv, attn_mask=causal_upper_left(Lq, Lk)).numpy()
    np.testing.assert_allclose(
        af.scaled_dot_product_attention(q, k, v, attn_mask=M.Causal("top_left")), expect, atol=1e-12
    )


@needs_torch
@pytest.mark.parametrize("ratio", [1, 2, 4, 8, 32])
def test_torch_enable_gqa(rng, ratio):
    B, Hq, Lq, Lk, d, dv = 1, 32, 20, 33, 16, 8
    q, k, v = qkv(rng, B, Hq, Hq // ratio, Lq, Lk, d, dv, np.float64)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    F = torch.nn.functional.scaled_dot_product_attention
    mask = random_mask(rng, (B, 1, Lq, Lk), 0.7)
    expect = F(tq, tk, tv, attn_mask=torch.from_numpy(mask), enable_gqa=True).numpy()
    o = af.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    np.testing.assert_allclose(o, expect, atol=1e-12)
    bias = rng.standard_normal((Lq, Lk))
    expect = F(tq, tk, tv, attn_mask=torch.from_numpy(bias), enable_gqa=True, scale=0.3).numpy()
    np.testing.assert_allclose(
        af.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True, scale=0.3),
        expect,
        atol=1e-12,
    )


if given is not None:

    @settings(max_examples=25, deadline=None)
    @given(
        Lq=st.integers(1, 70),
        Lk=st.integers(1, 70),
        causal=st.sampled_from([None, "bottom_right", "top_left"]),
        left=st.one_of(st.none(), st.integers(0, 20)),
        right=st.one_of(st.none(), st.integers(0, 20)),
        pad=st.booleans(),
        blk=st.one_of(st.none(), st.integers(1, 20)),
        seed=st.integers(0, 2**31 - 1),
    )
    def test_property_random_combinations(Lq, Lk, causal, left, right, pad, blk, seed):
        """Any combination of mask kinds equals the oracle with the dense equivalent."""
        r = np.random.default_rng(seed)
        B, H = 2, 2
        q, k, v = qkv(r, B, H, H, Lq, Lk, 4, 3, np.float64)
        align = causal or "bottom_right"
        q_len = r.integers(0, Lq + 1, B) if pad else np.array([Lq] * B)
        k_len = r.integers(0, Lk + 1, B) if pad else np.array([Lk] * B)
        parts, dense = [], np.ones((B, 1, Lq, Lk), bool)
        if causal:
            parts.append(M.Causal(causal))
        if left is not None or right is not None:
            parts.append(M.SlidingWindow(left, right, align=align))
        dense &= dense_causal(
            B, Lq, Lk, q_len, k_len, align, left, right, causal=causal is not None
        )
        if pad:
            parts.append(M.Padding(k_len, q_len))
        if blk:
            lay = r.random((H, -(-Lq // blk), -(-Lk // blk))) < 0.6
            parts.append(M.BlockSparse(lay, blk))
            dense = dense & dense_layout(lay, blk, blk, Lq, Lk)[None]
        valid = np.broadcast_to(np.arange(Lq) < q_len.reshape(B, 1, 1), (B, H, Lq))
        run_and_check(q, k, v, parts or None, dense, row_valid=valid)


@pytest.mark.parametrize(
    "shape", [(2, 1, 1, 200), (1, 1, 150, 1), (1, 3, 150, 200), (150, 200)], ids=str
)
def test_dense_mask_block_summary_changes_nothing(isa, rng, shape, monkeypatch):
    """The block summary of a dense boolean mask only lets the kernel skip
    empty tiles sooner: same result bit for bit, same tile counts, and the
    broadcast axes of the mask (key-padding (B,1,1,Lk), per-query (Lq,1)) stay broadcast."""
    B, H, Lq, Lk, d = 2, 3, 150, 200, 16
    q, k, v = qkv(rng, B, H, H, Lq, Lk, d, d, np.float32)
    mask = random_mask(rng, shape, 0.5)
    if len(shape) == 4 and shape[-1] > 1:
        mask[..., 64:160] = False  # whole empty tiles
    args = af._args.mask_args(mask, False, None, B, H, Lq, Lk, np.float32)
    assert args.layout_bq == M.SUMMARY_BLOCK and args.layout.shape == (B, H, 10, 13)
    o1, s1 = af.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_stats=True)
    monkeypatch.setattr(M, "add_block_summary", lambda kw: kw)
    o2, s2 = af.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_stats=True)
    np.testing.assert_array_equal(o1, o2)
    assert s1 == s2
    dense = np.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape), (B, H, Lq, Lk))
    assert_close(o1, ref.sdpa(q, k, v, mask=dense), np.float32)
