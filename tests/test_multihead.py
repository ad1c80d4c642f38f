"""MultiHeadAttention against single-head float64 oracle calls, concatenated, then Wo."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close

import attn_fast as af
import attn_fast.multihead as mh
from attn_fast import reference as ref
from attn_fast.positional import RoPE, rope_reference


def oracle_mha(m, x, context=None, mask=None, causal=False, rope_offset=0):
    """Per-head oracle: for each head h, ref.sdpa on its slice; concat; Wo. float64."""
    W = {n: np.asarray(a, dtype=np.float64) for n, a in m.state_dict().items()}
    x = np.asarray(x, dtype=np.float64)
    c = x if context is None else np.asarray(context, dtype=np.float64)
    H, Hkv, dh = m.num_heads, m.num_kv_heads, m.head_dim
    Q = x @ W["Wq"].T + (W["bq"] if m.bias else 0)
    K = c @ W["Wk"].T + (W["bk"] if m.bias else 0)
    V = c @ W["Wv"].T + (W["bv"] if m.bias else 0)
    Lq, Lk = x.shape[-2], c.shape[-2]
    dense = ref.causal_mask(Lq, Lk) if causal else None
    if mask is not None:
        if mask.dtype == bool:
            dense = mask if dense is None else dense & mask
    outs = []
    for h in range(H):
        g = h // (H // Hkv)  # the kv head this query head reads
        q = Q[..., h * dh : (h + 1) * dh]
        k = K[..., g * dh : (g + 1) * dh]
        v = V[..., g * dh : (g + 1) * dh]
        if m.rope is not None and context is None:
            r = m.rope
            q = rope_reference(
                q,
                np.arange(Lq) + rope_offset,
                base=r.base,
                rotary_dim=r.rotary_dim,
                interleaved=r.interleaved,
            )
            k = rope_reference(
                k,
                np.arange(Lk) + rope_offset,
                base=r.base,
                rotary_dim=r.rotary_dim,
                interleaved=r.interleaved,
            )
        bias = mask if (mask is not None and mask.dtype != bool) else None
        outs.append(ref.sdpa(q, k, v, mask=dense, bias=bias, scale=m.scale))
    return np.concatenate(outs, axis=-1) @ W["Wo"].T + (W["bo"] if m.bias else 0)


CONFIGS = [
    # D, H, H_kv, d_h, L, batched
    (8, 1, None, None, 1, False),
    (20, 4, None, None, 7, True),
    (24, 6, 2, None, 7, True),  # GQA
    (32, 4, 1, None, 129, False),  # MQA
    (30, 3, 3, 5, 33, True),  # head_dim given, H·d_h != D
    (64, 2, 2, 80, 9, True),  # d_h = 80 > D / H
]


@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: "D{}H{}kv{}dh{}L{}{}".format(*c[:5], "B" if c[5] else "")
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_mha_equals_concat_of_heads(rng, cfg, causal, dtype):
    D, H, Hkv, dh, L, batched = cfg
    m = af.MultiHeadAttention(D, H, Hkv, dh, bias=(H % 2 == 0), rng=rng, dtype=dtype)
    if m.bias:  # non-zero biases
        for n in ("bq", "bk", "bv", "bo"):
            m.state_dict()[n][...] = rng.standard_normal(m.state_dict()[n].shape)
    x = rng.standard_normal((2, L, D) if batched else (L, D)).astype(dtype)
    y = m(x, causal=causal)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y, oracle_mha(m, x, causal=causal), dtype)


def test_gqa_equals_mha_with_repeated_kv_heads(rng):
    D, H, Hkv = 48, 8, 2
    gqa = af.MultiHeadAttention(D, H, Hkv, rng=rng)
    mha = af.MultiHeadAttention(D, H, rng=rng)
    dh, rep = gqa.head_dim, H // Hkv
    w = gqa.state_dict()

    # kv head g serves query heads g·rep … g·rep + rep - 1: repeat its rows
    def rep_rows(W):
        return np.repeat(W.reshape(Hkv, dh, D), rep, axis=0).reshape(H * dh, D)

    mha.load_weights(
        {"Wq": w["Wq"], "Wk": rep_rows(w["Wk"]), "Wv": rep_rows(w["Wv"]), "Wo": w["Wo"]}
    )
    x = rng.standard_normal((3, 17, D)).astype(np.float32)
    for causal in (False, True):
        np.testing.assert_allclose(
            gqa(x, causal=causal), mha(x, causal=causal), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("kv_dim", [None, 12])
@pytest.mark.parametrize("Lq, Lk", [(5, 17), (33, 3), (1, 64)])
def test_cross_attention(rng, kv_dim, Lq, Lk):
    D = 16
    m = af.MultiHeadAttention(D, 4, 2, bias=True, kv_dim=kv_dim, rng=rng)
    x = rng.standard_normal((2, Lq, D)).astype(np.float32)
    ctx = rng.standard_normal((2, Lk, kv_dim or D)).astype(np.float32)
    y = m(x, context=ctx)
    assert y.shape == (2, Lq, D)
    assert_close(y, oracle_mha(m, x, context=ctx), np.float32)
    # unbatched
    np.testing.assert_allclose(m(x[1], context=ctx[1]), y[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "rope",
    ["rope", RoPE(8, base=500.0, rotary_dim=4, interleaved=True)],
    ids=["neox", "gptj_partial"],
)
def test_rope_inside_attention(rng, rope):
    m = af.MultiHeadAttention(32, 4, 2, positional=rope, rng=rng)
    x = rng.standard_normal((2, 11, 32)).astype(np.float32)
    assert_close(m(x, causal=True), oracle_mha(m, x, causal=True), np.float32)


def test_masks(rng):
    D, L = 16, 9
    m = af.MultiHeadAttention(D, 2, rng=rng, dtype=np.float64)
    x = rng.standard_normal((2, L, D))
    keep = rng.random((L, L)) < 0.7
    keep[3] = False  # a fully masked row -> zeros before Wo
    y = m(x, mask=keep)
    assert_close(y, oracle_mha(m, x, mask=keep), np.float64)
    assert np.all(np.isfinite(y))
    additive = rng.standard_normal((L, L))
    assert_close(m(x, mask=additive), oracle_mha(m, x, mask=additive), np.float64)
    # mask combined with causal
    assert_close(m(x, mask=keep, causal=True), oracle_mha(m, x, mask=keep, causal=True), np.float64)


def test_heads_split_by_strides_not_copies(rng, monkeypatch):
    """q, k, v reach the kernel as strided views of one projection buffer."""
    seen = {}
    real = mh.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.update(q=q, k=k, v=v, out=kw["out"])
        return real(q, k, v, **kw)

    monkeypatch.setattr(mh, "scaled_dot_product_attention", spy)
    m = af.MultiHeadAttention(24, 4, 2, positional="rope", rng=rng)
    x = rng.standard_normal((2, 5, 24)).astype(np.float32)
    y = m(x)
    q, k, v, out = seen["q"], seen["k"], seen["v"], seen["out"]
    assert q.shape == (2, 4, 5, 6) and k.shape == v.shape == (2, 2, 5, 6)
    assert (
        not q.flags.c_contiguous and np.may_share_memory(q, k) and np.may_share_memory(k, v)
    )  # one buffer
    assert out.strides[1] < out.strides[2]  # written through a (B, L, H, d_h) buffer
    assert_close(y, oracle_mha(m, x), np.float32)


def test_load_weights_and_errors(rng):
    m = af.MultiHeadAttention(16, 4, 2, bias=True, rng=rng)
    w = {n: rng.standard_normal(a.shape) for n, a in m.state_dict().items()}
    m2 = af.MultiHeadAttention(16, 4, 2, bias=True, weights=w)
    for n, a in m2.state_dict().items():
        np.testing.assert_allclose(a, w[n].astype(np.float32))
    assert m2.Wk.shape == (8, 16) and m2.Wo.shape == (16, 16)
    with pytest.raises(KeyError, match="missing weights: Wv, bo"):
        m.load_weights({n: a for n, a in w.items() if n not in ("Wv", "bo")})
    m.load_weights({"Wq": w["Wq"]}, strict=False)
    np.testing.assert_allclose(m.Wq, w["Wq"].astype(np.float32))
    bad = dict(w, Wk=np.zeros((16, 16)))
    with pytest.raises(ValueError, match=r"Wk has shape \(16, 16\), expected \(8, 16\)"):
        m.load_weights(bad)
    with pytest.raises(ValueError, match="NaN"):
        m.load_weights(dict(w, Wo=np.full((16, 16), np.nan)))
    with pytest.raises(
        KeyError, match=r"unknown weights: bk, bo, bq, bv \(biases need bias=True\)"
    ):
        af.MultiHeadAttention(16, 4, 2).load_weights(w)
    with pytest.raises(KeyError, match="unknown weights: Wqq"):
        m.load_weights(dict(w, Wqq=w["Wq"]))
    with pytest.raises(ValueError, match=r"attn.Wq has shape"):
        m.load_weights(
            dict({"attn." + n: a for n, a in w.items()}, **{"attn.Wq": np.zeros(3)}), prefix="attn."
        )


def test_bad_arguments(rng):
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        af.MultiHeadAttention(16, 4, 3)
    with pytest.raises(ValueError, match="not divisible"):
        af.MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match="positional"):
        af.MultiHeadAttention(16, 4, positional="alibi")
    with pytest.raises(ValueError, match="head_dim"):
        af.MultiHeadAttention(16, 4, positional=RoPE(8))
    with pytest.raises(TypeError, match="dtype"):
        af.MultiHeadAttention(16, 4, dtype=np.int32)
    m = af.MultiHeadAttention(16, 4, rng=rng)
    with pytest.raises(
        ValueError, match=r"x must be \(L, 16\) or \(B, L, 16\), got shape \(3, 5, 12\)"
    ):
        m(np.zeros((3, 5, 12), np.float32))
    with pytest.raises(ValueError, match="got shape"):
        m(np.zeros((1, 3, 5, 16), np.float32))
    with pytest.raises(TypeError, match="float64 but the attention's weights are float32"):
        m(np.zeros((5, 16)))
    with pytest.raises(ValueError, match="batch sizes differ"):
        m(np.zeros((2, 5, 16), np.float32), context=np.zeros((3, 4, 16), np.float32))
    with pytest.raises(ValueError, match="attn_mask"):
        m(np.zeros((2, 5, 16), np.float32), mask=np.ones((4, 4), bool))
    cross = af.MultiHeadAttention(16, 4, kv_dim=8)
    with pytest.raises(ValueError, match="pass context"):
        cross(np.zeros((5, 16), np.float32))


@pytest.mark.parametrize("positional", [None, "rope"])
def test_kv_cache_prefill_and_decode_equal_full_causal(rng, positional):
    """Chunks through a KVCache (keys stored rotated at their absolute
    positions) give the rows of one full causal call."""
    m = af.MultiHeadAttention(32, 4, 2, positional=positional, rng=rng)
    x = rng.standard_normal((2, 12, 32)).astype(np.float32)
    full = m(x, causal=True)
    assert_close(full, oracle_mha(m, x, causal=True), np.float32)
    cache = af.KVCache(2, 2, 8, capacity=5)
    parts = [m(x[:, :5], cache=cache, causal=True), m(x[:, 5:9], cache=cache, causal=True)]
    parts += [m(x[:, t : t + 1], cache=cache, causal=True) for t in range(9, 12)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.positions, [12, 12])
    with pytest.raises(ValueError, match="mask= cannot be combined with cache="):
        m(x[:, :1], cache=cache, mask=np.ones((1, 13), bool))


def test_explicit_rope_positions(rng):
    """positions= shifts every token by the same amount: for causal attention
    only distances matter, so the output is unchanged; per-sequence positions
    equal separate calls."""
    m = af.MultiHeadAttention(16, 2, positional="rope", rng=rng, dtype=np.float64)
    x = rng.standard_normal((2, 6, 16))
    base = m(x, causal=True)
    np.testing.assert_allclose(
        m(x, causal=True, positions=np.arange(6) + 100), base, rtol=1e-9, atol=1e-9
    )
    pos = np.array([[0, 1, 2, 3, 4, 5], [7, 9, 10, 11, 12, 13]])  # a gap in sequence 1
    y = m(x, causal=True, positions=pos)
    np.testing.assert_allclose(y[0], base[0], rtol=1e-9, atol=1e-9)
    assert not np.allclose(y[1], base[1])
    np.testing.assert_allclose(y[1], m(x[1], causal=True, positions=pos[1]), rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="only meaningful with positional RoPE"):
        af.MultiHeadAttention(16, 2, dtype=np.float64)(x, positions=np.arange(6))
