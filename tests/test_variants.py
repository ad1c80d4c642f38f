"""Linformer and linear attention against float64 NumPy transcriptions."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, poisoned, randn

import attn_fast as af
from attn_fast import variants as V
from attn_fast.reference import sdpa

# --------------------------------------------------------------------------
# float64 oracles, written as plainly as the formulas
# --------------------------------------------------------------------------


def linformer_oracle(q, k, v, E, F, scale=None):
    """softmax(q (E k)ᵀ · scale) (F v) in float64."""
    E, F = np.asarray(E, np.float64), np.asarray(F, np.float64)
    Kp = E @ np.asarray(k, np.float64)  # (…, kp, d)
    Vp = F @ np.asarray(v, np.float64)  # (…, kp, dv)
    return sdpa(q, Kp, Vp, scale=scale)


def phi64(x, fm):
    x = np.asarray(x, np.float64)
    if fm == "elu1":
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))
    if fm == "relu":
        return np.maximum(x, 0)
    return np.asarray(fm(x), np.float64)


def linear_oracle(q, k, v, fm="elu1", causal=False, eps=1e-6, kv0=None, z0=None):
    """The O(L²) formula: A = φ(Q)φ(K)ᵀ (lower-triangular if causal),
    O = A V / (A 1 + eps), plus an optional prefix state (kv0, z0)."""
    fq, fk, v = phi64(q, fm), phi64(k, fm), np.asarray(v, np.float64)
    A = fq @ np.swapaxes(fk, -1, -2)  # (…, L, L)
    if causal:
        A = A * np.tril(np.ones(A.shape[-2:]))
    num = A @ v
    den = A.sum(-1) + eps
    if kv0 is not None:
        num = num + fq @ kv0
        den = den + (fq @ z0[..., None])[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den[..., None] != 0, num / den[..., None], 0.0)


def pos_features(x):
    """A callable feature map with r = 2d (positive random-feature style)."""
    x = np.asarray(x)
    return np.concatenate([np.exp(0.5 * x), np.exp(-0.5 * x)], axis=-1) / np.sqrt(2)


# --------------------------------------------------------------------------
# Linformer
# --------------------------------------------------------------------------

LINFORMER_CASES = [
    # (lead, Lq, Lk, d, dv, kp)
    ((), 7, 7, 5, 5, 3),
    ((3,), 129, 129, 80, 16, 32),
    ((2, 3), 33, 65, 1, 7, 8),
    ((1, 2), 1, 40, 16, 16, 64),  # kp > Lk: fine, just not cheaper
    ((2, 1), 64, 64, 64, 64, 1),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", LINFORMER_CASES)
def test_linformer_matches_oracle(case, dtype, rng):
    lead, Lq, Lk, d, dv, kp = case
    q = randn(rng, lead + (Lq, d), dtype)
    k = randn(rng, lead + (Lk, d), dtype)
    v = randn(rng, lead + (Lk, dv), dtype)
    E = randn(rng, (kp, Lk), dtype) / np.sqrt(Lk)
    F = randn(rng, (kp, Lk), dtype) / np.sqrt(Lk)
    o = V.linformer_attention(q, k, v, E, F)
    assert o.shape == lead + (Lq, dv) and o.dtype == dtype
    assert_close(o, linformer_oracle(q, k, v, E, F), dtype)
    # shared projection (F = None) and an explicit scale
    o2 = V.linformer_attention(q, k, v, E, scale=0.3)
    assert_close(o2, linformer_oracle(q, k, v, E, E, scale=0.3), dtype)


def test_linformer_every_isa_and_strided_inputs(isa, rng):
    B, H, L, d, kp = 2, 3, 100, 24, 20
    # (B, L, H, d) storage seen as (B, H, L, d); E in Fortran order
    q = randn(rng, (B, L, H, d), np.float32).transpose(0, 2, 1, 3)
    k = randn(rng, (B, L, H, d), np.float32).transpose(0, 2, 1, 3)
    v = randn(rng, (B, L, H, 2 * d), np.float32)[..., ::2].transpose(0, 2, 1, 3)
    E = np.asfortranarray(randn(rng, (kp, L), np.float32) / 10)
    F = randn(rng, (L, kp), np.float32).T / 10
    o = V.linformer_attention(q, k, v, E, F)
    assert_close(o, linformer_oracle(q, k, v, E, F), np.float32)


def test_linformer_with_identity_projection_is_full_attention(rng):
    """E = F = I (k = L): Linformer is exactly full attention."""
    q, k, v = (randn(rng, (2, 50, 8), np.float64) for _ in range(3))
    eye = np.eye(50)
    assert_close(V.linformer_attention(q, k, v, eye, eye), sdpa(q, k, v), np.float64)


def linformer_layer_oracle(layer, X):
    X = np.asarray(X, np.float64)
    H, D = layer.n_heads, layer.d_model
    dh, L = D // H, X.shape[-2]
    W = {n: np.asarray(getattr(layer, n), np.float64) for n in ("Wq", "Wk", "Wv", "Wo", "E", "F")}
    out = np.zeros(X.shape)
    for h in range(H):
        sl = slice(h * dh, (h + 1) * dh)
        q, k, v = X @ W["Wq"][sl].T, X @ W["Wk"][sl].T, X @ W["Wv"][sl].T
        Kp, Vp = W["E"][:, :L] @ k, W["F"][:, :L] @ v
        S = q @ np.swapaxes(Kp, -1, -2) / np.sqrt(dh)
        P = np.exp(S - S.max(-1, keepdims=True))
        P /= P.sum(-1, keepdims=True)
        out += (P @ Vp) @ W["Wo"][:, sl].T
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linformer_layer(dtype, rng):
    layer = V.Linformer(48, 4, seq_len=90, k=16, dtype=dtype, seed=1)
    X = randn(rng, (2, 90, 48), dtype)
    Y = layer(X)
    assert Y.shape == X.shape and Y.dtype == dtype
    assert_close(Y, linformer_layer_oracle(layer, X), dtype)
    # a shorter sequence equals zero-padding it to seq_len (keys/values of zero rows are zero)
    Xs = X[0, :61]
    pad = np.concatenate([Xs, np.zeros((29, 48), dtype)])
    assert_close(layer(Xs), layer(pad)[:61], dtype)
    shared = V.Linformer(48, 4, seq_len=90, k=16, share_kv=True, seed=2)
    assert shared.F is shared.E
    assert_close(shared(X[1]), linformer_layer_oracle(shared, X[1]), np.float32)


def test_linformer_errors(rng):
    q = randn(rng, (2, 32, 8), np.float32)
    E = randn(rng, (4, 32), np.float32)
    with pytest.raises(ValueError, match=r"E has shape \(4, 31\) but k has length Lk = 32"):
        V.linformer_attention(q, q, q, E[:, :31], E)
    with pytest.raises(ValueError, match=r"F has shape \(4, 33\)"):
        V.linformer_attention(q, q, q, E, np.zeros((4, 33), np.float32))
    with pytest.raises(ValueError, match="same k"):
        V.linformer_attention(q, q, q, E, E[:3])
    with pytest.raises(ValueError, match=r"E must be a \(k, L\) matrix"):
        V.linformer_attention(q, q, q, E[None], E)
    with pytest.raises(TypeError, match="E must be float32 or float64"):
        V.linformer_attention(q, q, q, E.astype(np.int32), E)
    with pytest.raises(ValueError, match="built for seq_len = 16"):
        V.Linformer(8, 2, seq_len=16, k=4)(np.zeros((17, 8), np.float32))
    with pytest.raises(ValueError, match="multiple of n_heads"):
        V.Linformer(10, 4, seq_len=16)


# --------------------------------------------------------------------------
# Linear attention
# --------------------------------------------------------------------------

LINEAR_SHAPES = [
    # (lead, L, d, dv)
    ((), 1, 1, 1),
    ((), 7, 5, 3),
    ((3,), 129, 80, 16),
    ((2, 3), 33, 16, 64),
    ((1, 1), 200, 64, 64),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fm", ["elu1", "relu", pos_features])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_linear_attention_matches_oracle(shape, dtype, fm, causal, rng):
    lead, L, d, dv = shape
    q, k = randn(rng, lead + (L, d), dtype), randn(rng, lead + (L, d), dtype)
    v = randn(rng, lead + (L, dv), dtype)
    o = V.linear_attention(q, k, v, fm, causal)
    assert o.shape == lead + (L, dv) and o.dtype == dtype
    assert np.all(np.isfinite(o))
    assert_close(o, linear_oracle(q, k, v, fm, causal), dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_strided_inputs(causal, rng):
    B, H, L, d = 2, 3, 70, 12
    q = randn(rng, (B, L, H, d), np.float32).transpose(0, 2, 1, 3)
    k = randn(rng, (B, H, d, L), np.float32).swapaxes(-1, -2)
    v = randn(rng, (B, H, L, 3 * d), np.float32)[..., 1::3]
    o = V.linear_attention(q, k, v, causal=causal)
    assert_close(o, linear_oracle(q, k, v, causal=causal), np.float32)


@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.5])
def test_linear_attention_eps_and_empty_rows(eps, rng):
    """relu features can vanish: with eps = 0 such rows give zeros, not NaN."""
    L, d = 40, 6
    q, k, v = (
        randn(rng, (L, d), np.float64),
        randn(rng, (L, d), np.float64),
        randn(rng, (L, 5), np.float64),
    )
    q[::3] = -np.abs(q[::3])  # phi(q) = 0 for every third row
    k[:4] = -np.abs(k[:4])  # and the first keys contribute nothing
    for causal in (False, True):
        o = V.linear_attention(q, k, v, "relu", causal, eps=eps)
        assert np.all(np.isfinite(o))
        assert_close(o, linear_oracle(q, k, v, "relu", causal, eps), np.float64)
        if eps == 0.0:
            assert np.all(o[::3] == 0)


def test_linear_kernel_writes_every_output_and_ignores_threads(rng):
    B, H, L, d, dv = 2, 3, 150, 9, 11
    fq = np.abs(randn(rng, (B, H, L, d), np.float32))
    fk = np.abs(randn(rng, (B, H, L, d), np.float32))
    v = randn(rng, (B, H, L, dv), np.float32)
    old = af.get_num_threads()
    try:
        for causal in (False, True):
            outs = []
            for n in (1, 2, 3):
                af.set_num_threads(n)
                o = poisoned((B, H, L, dv), np.float32)
                af._core.linear_attention(fq, fk, v, o, causal=causal, eps=1e-6)
                outs.append(o)
            assert np.all(np.isfinite(outs[0]))
            assert_close(outs[0], linear_oracle(fq, fk, v, lambda x: x, causal), np.float32)
            for o in outs[1:]:
                np.testing.assert_array_equal(o, outs[0])
    finally:
        af.set_num_threads(old)


@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_state_continues(causal, rng):
    """Chunked prefill with a state equals one call; the state is the plain sum."""
    B, H, L, d, dv = 2, 2, 60, 8, 5
    q, k = randn(rng, (B, H, L, d), np.float64), randn(rng, (B, H, L, d), np.float64)
    v = randn(rng, (B, H, L, dv), np.float64)
    o_all, st_all = V.linear_attention(q, k, v, causal=causal, return_state=True)
    fk = phi64(k, "elu1")
    np.testing.assert_allclose(st_all.kv, np.swapaxes(fk, -1, -2) @ v, rtol=1e-12)
    np.testing.assert_allclose(st_all.k_sum, fk.sum(-2), rtol=1e-12)
    assert st_all.length == L
    o1, st = V.linear_attention(
        q[:, :, :23], k[:, :, :23], v[:, :, :23], causal=causal, return_state=True
    )
    kv_before = st.kv.copy()
    o2, st2 = V.linear_attention(
        q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], causal=causal, state=st, return_state=True
    )
    np.testing.assert_array_equal(st.kv, kv_before)  # the input state is not modified
    assert st2.length == L
    if causal:
        assert_close(np.concatenate([o1, o2], axis=2), o_all, np.float64)
    else:  # the second chunk sees the first chunk's keys through the state
        ref = linear_oracle(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], kv0=st.kv, z0=st.k_sum)
        assert_close(o2, ref, np.float64)
    np.testing.assert_allclose(st2.kv, st_all.kv, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fm", ["elu1", pos_features])
def test_decode_step_reproduces_causal_form(dtype, fm, rng):
    H, L, d, dv, n0 = 3, 25, 16, 8, 10
    q, k = randn(rng, (H, L, d), dtype), randn(rng, (H, L, d), dtype)
    v = randn(rng, (H, L, dv), dtype)
    o_causal = V.linear_attention(q, k, v, fm, causal=True)
    # token by token from an empty state
    st = None
    for t in range(L):
        o_t, st = V.linear_attention_step(q[:, t], k[:, t], v[:, t], st, fm)
        assert o_t.shape == (H, dv) and o_t.dtype == dtype
        assert_close(o_t, o_causal[:, t], dtype)
    assert st.length == L
    # after a prefill of n0 tokens
    _, st = V.linear_attention(q[:, :n0], k[:, :n0], v[:, :n0], fm, True, return_state=True)
    for t in range(n0, L):
        o_t, st = V.linear_attention_step(q[:, t], k[:, t], v[:, t], st, fm)
        assert_close(o_t, o_causal[:, t], dtype)
    # single head, (d,) tokens
    o0, _ = V.linear_attention_step(q[0, 0], k[0, 0], v[0, 0], feature_map=fm)
    assert_close(o0, o_causal[0, 0], dtype)


def test_linear_attention_float32_long_sequence(rng):
    """L = 65536 in float32 against the float64 prefix-sum formula on the same inputs."""
    L, d, dv = 65536, 8, 8
    q, k, v = (randn(rng, (1, L, n), np.float32) for n in (d, d, dv))
    o = V.linear_attention(q, k, v, causal=True)
    fq, fk = phi64(q.astype(np.float32), "elu1"), phi64(k, "elu1")
    # the same formula, O(L d dv) via float64 cumulative sums
    kv = np.cumsum(fk[..., :, :, None] * v.astype(np.float64)[..., :, None, :], axis=-3)
    z = np.cumsum(fk, axis=-2)
    ref = np.einsum("hld,hlde->hle", fq, kv) / (np.einsum("hld,hld->hl", fq, z)[..., None] + 1e-6)
    err = np.abs(o - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err


def test_linear_attention_errors(rng):
    x = randn(rng, (2, 16, 4), np.float32)
    with pytest.raises(ValueError, match="unknown feature_map 'softmax'"):
        V.linear_attention(x, x, x, "softmax")
    with pytest.raises(ValueError, match="negative features"):
        V.linear_attention(x, x, x, lambda t: t)
    with pytest.raises(ValueError, match="non-finite"):
        V.linear_attention(x, x, x, lambda t: np.full(t.shape, np.inf))
    with pytest.raises(ValueError, match="keep every axis but the last"):
        V.linear_attention(x, x, x, lambda t: np.abs(t).sum(-1))
    with pytest.raises(TypeError, match="name or a callable"):
        V.linear_attention(x, x, x, 3)
    with pytest.raises(ValueError, match="batch, heads and length must match"):
        V.linear_attention(x, x[:, :15], x[:, :15])
    with pytest.raises(ValueError, match="head dim"):
        V.linear_attention(x, x[..., :3], x)
    with pytest.raises(ValueError, match="eps"):
        V.linear_attention(x, x, x, eps=-1)
    with pytest.raises(TypeError, match="float32 or float64"):
        V.linear_attention(x.astype(np.int64), x, x)
    with pytest.raises(TypeError, match="mixed dtypes"):
        V.linear_attention(x, x.astype(np.float64), x)
    _, st = V.linear_attention(x, x, x, causal=True, return_state=True)
    with pytest.raises(ValueError, match=r"state has kv \(2, 4, 4\)"):
        V.linear_attention(x, x, x[..., :3], causal=True, state=st)
    with pytest.raises(TypeError, match="LinearAttentionState"):
        V.linear_attention_step(x[:, 0], x[:, 0], x[:, 0], state=(st.kv, st.k_sum))
    with pytest.raises(ValueError, match="one token"):
        V.linear_attention_step(x[None, None], x[None, None], x[None, None])


def test_permuting_keys_and_values_together_changes_nothing(rng):
    """Non-causal linear attention sees a set of keys;
    Linformer too, once E's and F's columns follow."""
    q, k = randn(rng, (2, 45, 8), np.float64), randn(rng, (2, 45, 8), np.float64)
    v = randn(rng, (2, 45, 6), np.float64)
    E, F = randn(rng, (5, 45), np.float64), randn(rng, (5, 45), np.float64)
    p = rng.permutation(45)
    np.testing.assert_allclose(
        V.linear_attention(q, k[:, p], v[:, p]), V.linear_attention(q, k, v), rtol=1e-12
    )
    np.testing.assert_allclose(
        V.linformer_attention(q, k[:, p], v[:, p], E[:, p], F[:, p]),
        V.linformer_attention(q, k, v, E, F),
        rtol=1e-12,
    )
