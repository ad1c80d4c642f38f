"""The chapter's claims about attention, as property tests on random inputs.

Each test states one sentence of the chapter and checks it on the fused kernel
(attn_fast.attention / scaled_dot_product_attention), with explain() or the
float64 oracle where the claim is about S or P. RoPE comes from
attn_fast.positional, the KV cache from attn_fast.KVCache.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attn_fast as af
from attn_fast import reference as ref

TOL = dict(rtol=1e-10, atol=1e-11)  # float64 kernel vs float64 oracle

seeds = st.integers(0, 2**32 - 1)
lengths = st.integers(1, 40)
dims = st.integers(1, 24)
scales = st.sampled_from([0.1, 1.0, 3.0, 10.0])  # input scale: from flat to very peaked softmax


def claim(n=25):
    return settings(max_examples=n, deadline=None)


def textbook_inputs(rng, L, D, d, dv, scale=1.0):
    X = rng.standard_normal((L, D)) * scale
    Wq, Wk = (rng.standard_normal((d, D)) for _ in range(2))
    Wv = rng.standard_normal((dv, D))
    return X, Wq, Wk, Wv


# ---------------------------------------------------------------------------
# "把输入的行随便洗牌,输出跟着同样洗牌,分数一分不变": attention commutes with permutations
# ---------------------------------------------------------------------------


@claim()
@given(seed=seeds, L=lengths, D=dims, d=dims)
def test_permutation_equivariance(seed, L, D, d):
    rng = np.random.default_rng(seed)
    X, Wq, Wk, Wv = textbook_inputs(rng, L, D, d, d)
    perm = rng.permutation(L)
    O = af.attention(X, Wq, Wk, Wv)
    np.testing.assert_allclose(af.attention(X[perm], Wq, Wk, Wv), O[perm], **TOL)
    # the scores are the same numbers, rows and columns shuffled alike
    S, S_perm = af.explain(X, Wq, Wk, Wv).S, af.explain(X[perm], Wq, Wk, Wv).S
    np.testing.assert_allclose(S_perm, S[perm][:, perm], rtol=1e-12, atol=1e-12)


@claim()
@given(seed=seeds, L=st.integers(2, 40), D=dims, d=dims)
def test_a_different_word_order_is_the_same_bag_of_words(seed, L, D, d):
    """「猫追狗」和「狗追猫」: each token gets the same output whatever the order."""
    rng = np.random.default_rng(seed)
    X, Wq, Wk, Wv = textbook_inputs(rng, L, D, d, d)
    rev = X[::-1]
    np.testing.assert_allclose(
        af.attention(rev, Wq, Wk, Wv)[::-1], af.attention(X, Wq, Wk, Wv), **TOL
    )


def rope_attention(q, k, v, positions):
    """Self-attention with RoPE: q and k (L, d) rotated by their tokens' positions."""
    rope = af.positional.RoPE(q.shape[-1])
    q_r = rope(q, positions=positions, seq_axis=-2)
    k_r = rope(k, positions=positions, seq_axis=-2)
    return af.scaled_dot_product_attention(q_r, k_r, v)


@claim()
@given(seed=seeds, L=st.integers(2, 40), half_d=st.integers(1, 12))
def test_rope_breaks_permutation_equivariance(seed, L, half_d):
    """「位置信息必须手动注入」: with RoPE the same tokens in another order give other outputs."""
    rng = np.random.default_rng(seed)
    d = 2 * half_d
    q, k, v = rng.standard_normal((3, L, d))  # one row per token, whatever its position
    perm = rng.permutation(L)
    if (perm == np.arange(L)).all():
        perm[[0, 1]] = perm[[1, 0]]
    pos = np.arange(L)
    # without positions: shuffled tokens, shuffled outputs (the claim above)
    O = af.scaled_dot_product_attention(q, k, v)
    np.testing.assert_allclose(
        af.scaled_dot_product_attention(q[perm], k[perm], v[perm]), O[perm], **TOL
    )
    # with RoPE, each token is rotated by where it stands: the shuffle changes the outputs
    O_rope = rope_attention(q, k, v, pos)
    O_rope_shuffled = rope_attention(q[perm], k[perm], v[perm], pos)
    moved = np.abs(O_rope_shuffled - O_rope[perm]).max()
    assert moved > 1e-6 * np.abs(v).max(), moved
    # what RoPE keeps is relative position: the same order started further along gives the same
    # outputs
    start = int(rng.integers(1, 1000))
    np.testing.assert_allclose(rope_attention(q, k, v, pos + start), O_rope, rtol=1e-8, atol=1e-9)


# ---------------------------------------------------------------------------
# "每行变成非负、和为 1 的注意力权重", "输出不会跑出各 V 围成的凸包"
# ---------------------------------------------------------------------------


@claim()
@given(seed=seeds, L=lengths, D=dims, d=dims, dv=dims, scale=scales, causal=st.booleans())
def test_weights_are_a_distribution_and_outputs_stay_in_the_hull(seed, L, D, d, dv, scale, causal):
    rng = np.random.default_rng(seed)
    X, Wq, Wk, Wv = textbook_inputs(rng, L, D, d, dv, scale)
    ex = af.explain(X, Wq, Wk, Wv, causal=causal)
    assert (ex.P >= 0).all()
    np.testing.assert_allclose(ex.P.sum(axis=-1), 1.0, rtol=0, atol=1e-12)

    O = af.attention(X, Wq, Wk, Wv, causal=causal)  # the fused kernel
    # witness: O is P V with P a distribution per row. With peaked inputs the scores reach
    # 1e3-1e4, whose float64 rounding (a few ulps of |S|) moves each weight by that much
    # relative, so an output element near 0 among |V| ~ 1e2 is only that close in absolute
    # terms (seen: 1.8e-11 off at |S| ~ 1e3): the absolute tolerance scales with |S| |V|.
    s_max = np.abs(ex.S[np.isfinite(ex.S)]).max()
    atol = TOL["atol"] + 1e-15 * s_max * np.abs(ex.V).max()
    np.testing.assert_allclose(O, ex.P @ ex.V, rtol=TOL["rtol"], atol=atol)
    # and, independently of P, no direction u sees o beyond the extreme values of V:
    # min_j u·v_j <= u·o <= max_j u·v_j (a supporting-hyperplane test of hull membership)
    U = np.concatenate([np.eye(dv), -np.eye(dv), rng.standard_normal((16, dv))])
    proj_o = O @ U.T  # (L, n_dirs)
    proj_v = ex.V @ U.T  # (L, n_dirs): rows are the hull's vertices
    slack = 1e-9 * (1 + np.abs(proj_v).max())
    if causal:  # row i mixes only V[:i+1]
        hi = np.maximum.accumulate(proj_v, axis=0)
        lo = np.minimum.accumulate(proj_v, axis=0)
    else:
        hi, lo = proj_v.max(axis=0), proj_v.min(axis=0)
    assert (proj_o <= hi + slack).all() and (proj_o >= lo - slack).all()


# ---------------------------------------------------------------------------
# "不除掉 √d ... softmax 的指数会把预算全部砸给最高分": entropy collapse without the scale
# ---------------------------------------------------------------------------


def mean_row_entropy(q, k, scale):
    """Mean over query rows of H(P_i) = -Σ_j p_ij log p_ij, from the fused kernel.

    H_i = lse_i - Σ_j p_ij s_ij and Σ_j p_ij s_ij = scale · q_i · (Σ_j p_ij k_j),
    which is the kernel's output row when V = K.
    """
    o, lse = af.scaled_dot_product_attention(q, k, k, scale=scale, return_lse=True)
    s = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    return float(np.mean(lse - s * np.sum(q * o, axis=-1)))


def test_entropy_identity_matches_the_oracle(rng):
    q, k = rng.standard_normal((2, 33, 16))
    for scale in (None, 1.0):
        s = 0.25 if scale is None else scale
        P = ref.softmax(q @ k.T * s)
        H = -np.sum(P * np.log(P), axis=-1).mean()
        assert mean_row_entropy(q, k, scale) == pytest.approx(H, rel=1e-9)


@claim(6)
@given(seed=seeds)
def test_sqrt_d_keeps_softmax_entropy_flat(seed):
    rng = np.random.default_rng(seed)
    L, dims_ = 128, (16, 64, 256, 1024)
    flat, raw = [], []
    for d in dims_:
        q, k = rng.standard_normal((2, L, d))  # unit-variance entries: q·k has std √d
        flat.append(mean_row_entropy(q, k, scale=None))  # the default, 1/√d
        raw.append(mean_row_entropy(q, k, scale=1.0))  # no scale
    log_L = np.log(L)
    # with 1/√d the scores keep unit variance whatever d: entropy stays high and flat
    assert max(flat) - min(flat) < 0.15, flat
    assert min(flat) > log_L - 1.0, flat
    # without it the entropy collapses as d grows: the top score takes the whole budget
    assert raw[0] > raw[1] > raw[2], raw
    assert raw[3] < 0.1 * log_L and raw[3] < 0.1 * flat[3], raw


# ---------------------------------------------------------------------------
# "在 softmax 前把分数表的上三角填上 −∞(softmax 后精确为 0)"
# ---------------------------------------------------------------------------


@claim()
@given(seed=seeds, L=lengths, d=dims, scale=scales)
def test_causal_weights_above_the_diagonal_are_exactly_zero(seed, L, d, scale):
    rng = np.random.default_rng(seed)
    X, Wq, Wk, Wv = textbook_inputs(rng, L, d, d, d, scale)
    P = af.explain(X, Wq, Wk, Wv, causal=True).P
    upper = np.triu(np.ones((L, L), dtype=bool), 1)
    assert (P[upper] == 0.0).all()  # exactly, not approximately
    assert (P[~upper] > 0).all() or scale > 1  # below: everyone gets a share (unless it underflows)

    # in the fused kernel: row i cannot depend on the future at all. Replacing every
    # key and value after position i changes nothing in rows <= i, bit for bit.
    q, k, v = (rng.standard_normal((1, 1, L, d)) * scale for _ in range(3))
    i = int(rng.integers(0, L))
    k2, v2 = k.copy(), v.copy()
    k2[..., i + 1 :, :] = rng.standard_normal(k2[..., i + 1 :, :].shape) * 100
    v2[..., i + 1 :, :] = rng.standard_normal(v2[..., i + 1 :, :].shape) * 100
    for isa in af._core.available_isas():
        old = af.get_isa()
        af.set_isa(isa)
        try:
            o = af.scaled_dot_product_attention(q, k, v, is_causal=True)
            o2 = af.scaled_dot_product_attention(q, k2, v2, is_causal=True)
        finally:
            af.set_isa(old)
        np.testing.assert_array_equal(o2[..., : i + 1, :], o[..., : i + 1, :])


# ---------------------------------------------------------------------------
# "把 D 维切成 H 份 ... 各自独立跑一遍注意力 ... 最后把 H 份输出拼回 D 维"
# ---------------------------------------------------------------------------


@claim()
@given(seed=seeds, L=lengths, H=st.integers(1, 6), dh=st.integers(1, 12), causal=st.booleans())
def test_multi_head_is_h_single_heads_concatenated(seed, L, H, dh, causal):
    rng = np.random.default_rng(seed)
    D = H * dh
    X = rng.standard_normal((L, D))
    Wq, Wk, Wv = (rng.standard_normal((D, D)) for _ in range(3))

    # one call with H heads: (L, D) -> (L, H, dh) -> (H, L, dh), each head scaled by 1/√dh
    def split(Y):
        return Y.reshape(L, H, dh).transpose(1, 0, 2)

    O_heads = af.scaled_dot_product_attention(
        split(X @ Wq.T), split(X @ Wk.T), split(X @ Wv.T), is_causal=causal
    )
    O_multi = O_heads.transpose(1, 0, 2).reshape(L, D)  # concatenate the heads back

    # H independent single-head attentions, each with its slice of the projections
    def rows(W, h):
        return W[h * dh : (h + 1) * dh]

    singles = [
        af.attention(X, rows(Wq, h), rows(Wk, h), rows(Wv, h), causal=causal) for h in range(H)
    ]
    np.testing.assert_allclose(O_multi, np.concatenate(singles, axis=-1), **TOL)
    # and both agree with the textbook, head by head
    for h in range(H):
        np.testing.assert_allclose(
            singles[h],
            ref.attention(X, rows(Wq, h), rows(Wk, h), rows(Wv, h), causal=causal),
            **TOL,
        )


# ---------------------------------------------------------------------------
# "历史 token 的 K、V 不随新词改变,存下来复用,每步只算新词的 Q 去点积历史 K"
# ---------------------------------------------------------------------------


@claim(15)
@given(
    seed=seeds,
    B=st.integers(1, 2),
    H_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    d=dims,
    prompt=st.integers(1, 20),
    steps=st.integers(1, 8),
    capacity=st.integers(1, 32),
)
def test_kv_cache_decode_equals_full_recomputation(
    seed, B, H_kv, group, d, prompt, steps, capacity
):
    rng = np.random.default_rng(seed)
    H, L = H_kv * group, prompt + steps
    q = rng.standard_normal((B, H, L, d))
    k, v = rng.standard_normal((2, B, H_kv, L, d))
    cache = af.KVCache(B, H_kv, d, capacity=capacity, dtype=np.float64)
    # prefill: the whole prompt at once, causal inside it
    cache.append(k[:, :, :prompt], v[:, :, :prompt])
    o_prefill = cache.attend(q[:, :, :prompt])
    full = af.scaled_dot_product_attention(
        q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], is_causal=True, enable_gqa=True
    )
    np.testing.assert_allclose(o_prefill, full, **TOL)
    # decode: one new token per step; only its q, k, v are computed, the past is reused
    steps_out = []
    for t in range(prompt, L):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        o_step = cache.attend(q[:, :, t : t + 1])  # (B, H, 1, d)
        # full recomputation over the prefix 0..t, from scratch, keeping its last row
        recomputed = af.scaled_dot_product_attention(
            q[:, :, : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], is_causal=True, enable_gqa=True
        )[:, :, -1:]
        np.testing.assert_allclose(o_step, recomputed, **TOL)
        steps_out.append(o_step)
    # and the float64 textbook over the whole sequence (kv heads repeated per query head)
    oracle = ref.sdpa(q, k, v, mask=ref.causal_mask(L, L))
    np.testing.assert_allclose(np.concatenate([o_prefill, *steps_out], axis=2), oracle, **TOL)


# ---------------------------------------------------------------------------
# "交叉注意力:Q 来自一个序列、K/V 来自另一个 ... 机制一字不差"
# ---------------------------------------------------------------------------


@claim()
@given(seed=seeds, La=lengths, Lb=lengths, D=dims, d=dims, dv=dims)
def test_cross_attention_is_the_same_mechanism(seed, La, Lb, D, d, dv):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((La, D))  # e.g. the translation being written
    B = rng.standard_normal((Lb, D))  # e.g. the source sentence
    Wq, Wk = (rng.standard_normal((d, D)) for _ in range(2))
    Wv = rng.standard_normal((dv, D))
    q, k, v = A @ Wq.T, B @ Wk.T, B @ Wv.T
    O = af.scaled_dot_product_attention(q, k, v)  # (La, dv): one row per query of A
    assert O.shape == (La, dv)
    # the same three steps as self-attention
    P = ref.softmax(q @ k.T / np.sqrt(d))
    np.testing.assert_allclose(O, P @ v, **TOL)
    # self-attention is the special case B = A
    np.testing.assert_allclose(
        af.scaled_dot_product_attention(q, A @ Wk.T, A @ Wv.T), af.attention(A, Wq, Wk, Wv), **TOL
    )
    # shuffling B (keys and values together) changes nothing; shuffling A shuffles the output
    pb, pa = rng.permutation(Lb), rng.permutation(La)
    np.testing.assert_allclose(af.scaled_dot_product_attention(q, k[pb], v[pb]), O, **TOL)
    np.testing.assert_allclose(af.scaled_dot_product_attention(q[pa], k, v), O[pa], **TOL)
    # every output row is a convex mix of B's values, not A's
    U = np.concatenate([np.eye(dv), -np.eye(dv)])
    slack = 1e-9 * (1 + np.abs(v).max())
    assert ((O @ U.T) <= (v @ U.T).max(axis=0) + slack).all()
