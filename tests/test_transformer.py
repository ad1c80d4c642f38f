"""TransformerBlock and TinyTransformerLM against a float64 NumPy transcription."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tol
from test_multihead import oracle_mha

import attn_fast as af
from attn_fast.positional import sinusoidal


# ---------------------------------------------------------------- float64 transcription
def ln64(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def rms64(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def norm64(mod, x):
    w = np.float64(mod.weight)
    if isinstance(mod, af.LayerNorm):
        return ln64(x, w, np.float64(mod.bias), mod.eps)
    return rms64(x, w, mod.eps)


def ffn64(f, x):
    sd = {n: np.asarray(a, np.float64) for n, a in f.state_dict().items()}
    if "W1" in sd:
        h = x @ sd["W1"].T + sd["b1"]
        g = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
        return g @ sd["W2"].T + sd["b2"]
    g, u = x @ sd["W_gate"].T, x @ sd["W_up"].T
    return (g / (1 + np.exp(-g)) * u) @ sd["W_down"].T


def block64(blk, x, context=None, causal=True):
    x = np.asarray(x, np.float64)
    h = x + oracle_mha(blk.attn, norm64(blk.norm1, x), causal=causal)
    if blk.cross is not None:
        h = h + oracle_mha(blk.cross, norm64(blk.norm_cross, h), context=context)
    return h + ffn64(blk.ffn, norm64(blk.norm2, h))


def lm64(lm, tokens):
    x = np.asarray(lm.embed, np.float64)[tokens]
    if lm.positional == "sinusoidal":
        x = x + sinusoidal(tokens.shape[-1], lm.d_model, dtype=np.float64)
    for blk in lm.blocks:
        x = block64(blk, x)
    return norm64(lm.norm, x) @ np.asarray(lm.lm_head, np.float64).T


def randomise(mod, rng):
    """Non-trivial norms and biases (they start at ones / zeros)."""
    for n, a in mod.state_dict().items():
        if a.ndim == 1:
            a[...] = rng.standard_normal(a.shape) * 0.3 + (1.0 if n.endswith("weight") else 0.0)


# ---------------------------------------------------------------- block
BLOCKS = [
    dict(norm="layernorm", ffn="gelu", bias=True),
    dict(norm="rmsnorm", ffn="swiglu", num_kv_heads=2, positional="rope"),
    dict(norm="layernorm", ffn="swiglu", cross_attention=True, kv_dim=12),
    dict(norm="rmsnorm", ffn="gelu", num_kv_heads=1, head_dim=5, d_ff=7),
]


@pytest.mark.parametrize("kw", BLOCKS, ids=lambda k: "-".join(f"{v}" for v in k.values()))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("L", [1, 7, 129])
def test_block_against_transcription(rng, kw, dtype, L):
    D = 24
    blk = af.TransformerBlock(D, 4, rng=rng, dtype=dtype, **kw)
    randomise(blk, rng)
    x = rng.standard_normal((2, L, D)).astype(dtype)
    ctx = rng.standard_normal((2, 9, 12)).astype(dtype) if kw.get("cross_attention") else None
    y = blk(x, context=ctx)
    assert y.shape == x.shape and y.dtype == dtype
    t = tol(dtype)
    np.testing.assert_allclose(y, block64(blk, x, ctx), rtol=t["rtol"] * 5, atol=t["atol"] * 10)
    # encoder-style (bidirectional) and unbatched
    y1 = blk(x[0], context=None if ctx is None else ctx[0], causal=False)
    np.testing.assert_allclose(
        y1,
        block64(blk, x[:1], None if ctx is None else ctx[:1], causal=False)[0],
        rtol=t["rtol"] * 5,
        atol=t["atol"] * 10,
    )


def test_block_decode_with_caches_equals_full(rng):
    """A decoder block with cross-attention, fed one token at a time through
    a self-attention cache and a cross-attention cache, equals the full call."""
    D, L = 16, 6
    blk = af.TransformerBlock(
        D,
        4,
        2,
        norm="rmsnorm",
        ffn="swiglu",
        positional="rope",
        cross_attention=True,
        kv_dim=10,
        rng=rng,
    )
    x = rng.standard_normal((2, L, D)).astype(np.float32)
    ctx = rng.standard_normal((2, 13, 10)).astype(np.float32)
    full = blk(x, context=ctx)
    cache, cross = af.KVCache(2, 2, 4, capacity=4), af.KVCache(2, 2, 4, capacity=13)
    steps = [blk(x[:, :3], context=ctx, cache=cache, cross_cache=cross)]  # prefill 3
    steps += [
        blk(x[:, t : t + 1], context=ctx, cache=cache, cross_cache=cross) for t in range(3, L)
    ]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)
    assert len(cross) == 13 and len(cache) == L
    with pytest.raises(ValueError, match="reset"):
        blk(x[:, :1], context=ctx[:, :5], cache=cache, cross_cache=cross)


def test_block_errors(rng):
    with pytest.raises(ValueError, match="norm must be"):
        af.TransformerBlock(16, 4, norm="batchnorm")
    with pytest.raises(ValueError, match="ffn must be"):
        af.TransformerBlock(16, 4, ffn="relu")
    blk = af.TransformerBlock(16, 4, rng=rng)
    with pytest.raises(ValueError, match="context"):
        blk(np.zeros((3, 16), np.float32), context=np.zeros((3, 16), np.float32))
    with pytest.raises(ValueError, match=r"got shape \(3, 12\)"):
        blk(np.zeros((3, 12), np.float32))
    w = blk.state_dict()
    assert {
        "norm1.weight",
        "norm1.bias",
        "attn.Wq",
        "attn.Wo",
        "norm2.weight",
        "ffn.W1",
        "ffn.b2",
    } <= set(w)
    with pytest.raises(ValueError, match=r"ffn.W1 has shape \(3, 3\), expected \(64, 16\)"):
        blk.load_weights(dict(w, **{"ffn.W1": np.zeros((3, 3))}))
    with pytest.raises(KeyError, match="unknown weights: ffn.W_gate"):
        blk.load_weights(dict(w, **{"ffn.W_gate": np.zeros((3, 3))}))


# ---------------------------------------------------------------- language model
@pytest.mark.parametrize("positional", ["rope", "sinusoidal"])
def test_lm_forward_against_transcription(rng, positional):
    lm = af.TinyTransformerLM(
        37, 32, 2, 4, 2, positional=positional, seed=int(rng.integers(1 << 30))
    )
    randomise(lm, rng)
    tokens = rng.integers(0, 37, size=(2, 19))
    logits = lm.forward(tokens)
    assert logits.shape == (2, 19, 37) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, lm64(lm, tokens), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(lm.forward(tokens[1]), logits[1])


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(positional="sinusoidal", norm="layernorm", ffn="gelu", tie_embeddings=True),
        dict(rope_interleaved=True, rotary_dim=4, rope_base=500.0, num_kv_heads=1),
    ],
    ids=["llama", "gpt2", "gptj_mqa"],
)
def test_generate_cache_equals_recompute(rng, kw):
    kw = {"num_kv_heads": 2, **kw}
    lm = af.TinyTransformerLM(41, 32, 3, 4, seed=int(rng.integers(1 << 30)), **kw)
    prompt = rng.integers(0, 41, size=(2, 13))
    # step by step: the cached logits equal forward() on the growing sequence
    cache = lm.make_cache(2, capacity=8)  # grows on the way
    seq = prompt
    logits = lm.forward(prompt, cache=cache)[:, -1]
    for _ in range(6):
        full = lm.forward(seq)[:, -1]
        np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)
        nxt = np.argmax(full, axis=-1)
        np.testing.assert_array_equal(np.argmax(logits, axis=-1), nxt)
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
        logits = lm.forward(nxt[:, None], cache=cache)[:, -1]
    # and generate() gives the same tokens either way
    g1 = lm.generate(prompt, 8, use_cache=True)
    g0 = lm.generate(prompt, 8, use_cache=False)
    assert g1.shape == (2, 21) and g1.dtype == np.int64
    np.testing.assert_array_equal(g1, g0)
    np.testing.assert_array_equal(g1[:, :13], prompt)
    np.testing.assert_array_equal(g1[:, :19], seq)
    np.testing.assert_array_equal(lm.generate(prompt[0], 8), g1[0])


def test_generate_sampling(rng):
    lm = af.TinyTransformerLM(23, 16, 1, 2, seed=3)
    p = rng.integers(0, 23, size=5)
    a = lm.generate(p, 12, temperature=1.0, seed=7)
    np.testing.assert_array_equal(a, lm.generate(p, 12, temperature=1.0, seed=7))
    np.testing.assert_array_equal(a, lm.generate(p, 12, temperature=1.0, seed=7, use_cache=False))
    assert a.min() >= 0 and a.max() < 23
    draws = {tuple(lm.generate(p, 12, temperature=5.0, seed=s)[5:]) for s in range(4)}
    assert len(draws) > 1  # hot sampling differs between seeds
    np.testing.assert_array_equal(
        lm.generate(p, 12, temperature=1e-6, seed=1), lm.generate(p, 12)
    )  # cold = greedy
    np.testing.assert_array_equal(lm.generate(p, 0), p)


def test_lm_weights_roundtrip_npz(rng, tmp_path):
    lm = af.TinyTransformerLM(29, 16, 2, 4, 2, seed=1)
    randomise(lm, rng)
    path = tmp_path / "lm.npz"
    np.savez(path, **lm.state_dict())
    other = af.TinyTransformerLM(29, 16, 2, 4, 2, seed=2)
    tokens = rng.integers(0, 29, size=11)
    assert not np.allclose(other.forward(tokens), lm.forward(tokens))
    with np.load(path) as f:
        other.load_weights(f)
    np.testing.assert_array_equal(other.forward(tokens), lm.forward(tokens))
    names = set(lm.state_dict())
    assert {
        "embed.weight",
        "blocks.1.attn.Wk",
        "blocks.0.ffn.W_down",
        "norm.weight",
        "lm_head.weight",
    } <= names
    sd = {n: np.array(a) for n, a in lm.state_dict().items()}
    with pytest.raises(KeyError, match="missing weights: blocks.1.attn.Wv"):
        other.load_weights({n: a for n, a in sd.items() if n != "blocks.1.attn.Wv"})
    with pytest.raises(ValueError, match=r"embed.weight has shape \(30, 16\), expected \(29, 16\)"):
        other.load_weights(dict(sd, **{"embed.weight": np.zeros((30, 16))}))
    with pytest.raises(KeyError, match="unknown weights: blocks.2.norm1.weight"):
        other.load_weights(dict(sd, **{"blocks.2.norm1.weight": np.zeros(16)}))
    tied = af.TinyTransformerLM(29, 16, 1, 4, tie_embeddings=True)
    assert "lm_head.weight" not in tied.state_dict()


def test_lm_errors(rng):
    lm = af.TinyTransformerLM(10, 16, 1, 4)
    with pytest.raises(ValueError, match=r"\[0, vocab_size=10\)"):
        lm.forward(np.array([1, 2, 10]))
    with pytest.raises(TypeError, match="integer"):
        lm.forward(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"\(L,\) or \(B, L\)"):
        lm.forward(np.zeros((1, 2, 3), dtype=int))
    with pytest.raises(ValueError, match="at least one token"):
        lm.generate(np.zeros((1, 0), dtype=int), 3)
    with pytest.raises(ValueError, match="temperature"):
        lm.generate(np.array([1]), 3, temperature=-1)
    with pytest.raises(ValueError, match="positional"):
        af.TinyTransformerLM(10, 16, 1, 4, positional="alibi")
    with pytest.raises(ValueError, match="layers"):
        lm.forward(np.array([1]), cache=af.LayerCaches(2, 1, 4, 4))


def test_activations_finite_for_large_inputs():
    from attn_fast.transformer import gelu, silu

    x = np.array([-1e4, -100.0, -1.0, 0.0, 1.0, 100.0, 1e4], dtype=np.float32)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(
        silu(x), x64 * np.exp(-np.logaddexp(0.0, -x64)), rtol=1e-6, atol=1e-30
    )  # x·sigmoid(x)
    np.testing.assert_allclose(gelu(x)[[0, 1, 5, 6]], [0, 0, 100, 1e4], atol=1e-6)


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("layer", ["layernorm", "rmsnorm", "gelu", "swiglu"])
def test_float_norms_and_feed_forwards_take_torch_tensors(rng, dt, layer):
    """A float32 / float64 layer given a torch tensor of its dtype returns a torch tensor
    (the float64 transcription's values); another dtype: TypeError with a cast hint."""
    torch = pytest.importorskip("torch")
    mods = {
        "layernorm": lambda: af.LayerNorm(12, dtype=dt),
        "rmsnorm": lambda: af.RMSNorm(12, dtype=dt),
        "gelu": lambda: af.transformer.MLP(12, 20, rng=rng, dtype=dt),
        "swiglu": lambda: af.transformer.SwiGLU(12, 20, rng=rng, dtype=dt),
    }
    mod = mods[layer]()
    if layer in ("layernorm", "rmsnorm"):
        randomise(mod, rng)
    x = rng.standard_normal((2, 5, 12)).astype(dt)
    y = mod(torch.from_numpy(x)[:, ::2])  # non-contiguous
    assert isinstance(y, torch.Tensor) and y.dtype == torch.from_numpy(x).dtype
    x64 = x[:, ::2].astype(np.float64)
    want = norm64(mod, x64) if layer in ("layernorm", "rmsnorm") else ffn64(mod, x64)
    np.testing.assert_allclose(y.numpy(), want, **tol(dt))
    np.testing.assert_array_equal(y.numpy(), mod(x[:, ::2]))  # the NumPy call's values
    other = torch.float64 if dt == np.float32 else torch.float32
    with pytest.raises(TypeError, match="cast it"):
        mod(torch.from_numpy(x).to(other))
