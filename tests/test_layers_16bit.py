"""The NumPy layers in float16 and bfloat16 (MultiHeadAttention, the norms and
feed-forwards, TransformerBlock, TinyTransformerLM) against the float64 oracle:
the same layer built in float64 with the 16-bit layer's own weights (exact in
float64), run on the same 16-bit inputs. Each 16-bit product, norm and
residual add rounds once (u = 2^-8 bfloat16, 2^-11 float16), so the
tolerances are a few u of the output's size, growing with the number of
rounded steps: u |y| + c u max|y| with c = 4 for attention, 6 for a block and
10 for a two-layer model."""

from __future__ import annotations

import numpy as np
import pytest

import attn_fast as af
from attn_fast.transformer import (
    MLP,
    LayerNorm,
    RMSNorm,
    SwiGLU,
    TinyTransformerLM,
    TransformerBlock,
)

try:
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None
ml_dtypes = pytest.importorskip("ml_dtypes")

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
DTYPES = [F16, BF16]
U = {F16: 2.0**-11, BF16: 2.0**-8}
ids = lambda dt: np.dtype(dt).name  # noqa: E731


def f64(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().double().numpy()
    return np.asarray(x).astype(np.float64)


def close(got, want, dt, c, what="out"):
    u = U[np.dtype(dt)]
    g = f64(got)
    big = float(np.abs(want).max())
    bad = ~(np.abs(g - want) <= u * np.abs(want) + c * u * big)
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} off, max {np.abs(g - want).max():.3g}"


def twin64(layer, make):
    """The float64 copy of `layer` (built by `make(dtype)`) with the same weights."""
    m = make(np.float64)
    m.load_weights(layer.state_dict())
    return m


def jitter_biases(layer, rng):
    sd = layer.state_dict()
    layer.load_weights(
        {
            n: p + 0.1 * rng.standard_normal(p.shape) if n.split(".")[-1][0] == "b" else p
            for n, p in sd.items()
        }
    )


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("dt", DTYPES, ids=ids)
@pytest.mark.parametrize(
    "cfg",
    [
        dict(num_kv_heads=None, bias=False, positional=None, causal=False),
        dict(num_kv_heads=2, bias=True, positional="rope", causal=True),
        dict(num_kv_heads=1, bias=True, positional=None, causal=False, mask=True),
    ],
)
def test_mha_matches_float64_twin(isa, rng, dt, cfg):
    cfg = dict(cfg)
    causal, use_mask = cfg.pop("causal"), cfg.pop("mask", False)

    def make(dtype):
        return af.MultiHeadAttention(48, 4, head_dim=12, rng=1, dtype=dtype, **cfg)

    m = make(dt)
    assert all(p.dtype == dt for p in m.state_dict().values())
    jitter_biases(m, rng)
    m64 = twin64(m, make)
    x = rng.standard_normal((2, 37, 48)).astype(dt)
    mask = rng.random((37, 37)) < 0.7 if use_mask else None
    y = m(x, mask=mask, causal=causal)
    assert isinstance(y, np.ndarray) and y.dtype == dt and y.shape == x.shape
    close(y, m64(f64(x), mask=mask, causal=causal), dt, 4)
    y2 = m(x[0], mask=mask, causal=causal)  # (L, D) input
    assert y2.shape == (37, 48) and y2.dtype == dt
    np.testing.assert_array_equal(f64(y2), f64(y[0]))


@pytest.mark.parametrize("dt", DTYPES, ids=ids)
def test_mha_cross_attention(isa, rng, dt):
    def make(dtype):
        return af.MultiHeadAttention(32, 4, 2, bias=True, kv_dim=20, rng=2, dtype=dtype)

    m = make(dt)
    jitter_biases(m, rng)
    m64 = twin64(m, make)
    x, ctx = rng.standard_normal((2, 9, 32)).astype(dt), rng.standard_normal((2, 15, 20)).astype(dt)
    close(m(x, context=ctx), m64(f64(x), context=f64(ctx)), dt, 4)


@pytest.mark.parametrize("dt", DTYPES, ids=ids)
def test_mha_torch_tensors_in_and_out(rng, dt):
    if torch is None:
        pytest.skip("torch not installed")
    m = af.MultiHeadAttention(32, 4, 2, positional="rope", rng=3, dtype=dt)
    x = rng.standard_normal((2, 11, 32)).astype(dt)
    xt = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16 if dt == BF16 else torch.float16)
    yt = m(xt, causal=True)
    assert isinstance(yt, torch.Tensor) and yt.dtype == xt.dtype
    np.testing.assert_array_equal(f64(yt), f64(m(x, causal=True)))


@pytest.mark.parametrize("dt", DTYPES, ids=ids)
def test_mha_kv_cache_prefill_then_decode(isa, rng, dt):
    """A 16-bit cache: prefill then one token at a time equals causal attention over all."""

    def make(dtype):
        return af.MultiHeadAttention(32, 4, 2, positional="rope", rng=4, dtype=dtype)

    m = make(dt)
    m64 = twin64(m, make)
    x = rng.standard_normal((2, 21, 32)).astype(dt)
    cache = af.KVCache(2, 2, 8, capacity=32, dtype=dt)
    parts = [m(x[:, :16], cache=cache, causal=True)]
    parts += [m(x[:, i : i + 1], cache=cache, causal=True) for i in range(16, 21)]
    assert all(p.dtype == dt for p in parts)
    close(np.concatenate([f64(p) for p in parts], axis=1), m64(f64(x), causal=True), dt, 4)


def test_mixed_dtypes_raise_with_cast_hint(rng):
    m16 = af.MultiHeadAttention(16, 2, rng=0, dtype="bfloat16")
    m32 = af.MultiHeadAttention(16, 2, rng=0)
    x = rng.standard_normal((3, 16))
    with pytest.raises(
        TypeError, match=r"x has dtype float32 but .* bfloat16; cast it .*ml_dtypes"
    ):
        m16(x.astype(np.float32))
    with pytest.raises(TypeError, match=r"x has dtype float16 but .* bfloat16"):
        m16(x.astype(np.float16))
    with pytest.raises(TypeError, match=r"x has dtype bfloat16 but .* float32; cast it"):
        m32(x.astype(BF16))
    with pytest.raises(TypeError, match=r"context has dtype float32 but .* bfloat16"):
        af.MultiHeadAttention(16, 2, kv_dim=8, dtype=BF16)(
            x.astype(BF16), context=np.zeros((2, 8), np.float32)
        )
    with pytest.raises(ValueError, match=r"cache has .*float32\) but this call needs .*bfloat16"):
        m16(x.astype(BF16)[None], cache=af.KVCache(1, 2, 8, capacity=8), causal=True)
    if torch is not None:
        with pytest.raises(TypeError, match="x has dtype float16 but .* bfloat16"):
            m16(torch.zeros(3, 16, dtype=torch.float16))


def test_dtype_argument(rng):
    for spec in ("bfloat16", BF16, ml_dtypes.bfloat16):
        assert af.MultiHeadAttention(8, 2, dtype=spec).dtype == BF16
    if torch is not None:
        assert af.MultiHeadAttention(8, 2, dtype=torch.bfloat16).dtype == BF16
        assert af.MultiHeadAttention(8, 2, dtype=torch.float16).dtype == F16
    assert "dtype=bfloat16" in repr(af.MultiHeadAttention(8, 2, dtype="bfloat16"))
    with pytest.raises(TypeError, match="dtype must be float32, float64, float16 or bfloat16"):
        af.MultiHeadAttention(8, 2, dtype="int8")


def test_load_weights_rounds_to_the_layer_dtype(rng):
    m = af.MultiHeadAttention(8, 2, dtype=BF16)
    sd = {n: rng.standard_normal(p.shape) for n, p in m.state_dict().items()}
    m.load_weights(sd)  # float64 sources: rounded to nearest even
    for n, p in m.state_dict().items():
        np.testing.assert_array_equal(f64(p), f64(sd[n].astype(np.float32).astype(BF16)))
    m2 = af.MultiHeadAttention(8, 2, dtype=np.float32)
    m2.load_weights(m.state_dict())  # bfloat16 sources: exact in float32
    for n, p in m2.state_dict().items():
        np.testing.assert_array_equal(p, f64(m.state_dict()[n]))
    if torch is not None:
        m3 = af.MultiHeadAttention(8, 2, dtype=BF16)
        m3.load_weights({n: torch.from_numpy(f64(p)).bfloat16() for n, p in m.state_dict().items()})
        for n, p in m3.state_dict().items():
            np.testing.assert_array_equal(f64(p), f64(m.state_dict()[n]))


# ---------------------------------------------------------------- transformer layers


@pytest.mark.parametrize("dt", DTYPES, ids=ids)
def test_norms_and_feed_forwards(rng, dt):
    x = rng.standard_normal((3, 5, 24)).astype(dt)
    for make in (
        lambda d: LayerNorm(24, dtype=d),
        lambda d: RMSNorm(24, dtype=d),
        lambda d: MLP(24, 40, rng=5, dtype=d),
        lambda d: SwiGLU(24, 40, rng=5, dtype=d),
    ):
        layer = make(dt)
        sd = layer.state_dict()
        layer.load_weights({n: p + 0.1 * rng.standard_normal(p.shape) for n, p in sd.items()})
        y = layer(x)
        assert y.dtype == dt and y.shape == x.shape
        close(y, twin64(layer, make)(f64(x)), dt, 3, what=type(layer).__name__)


@pytest.mark.parametrize("dt", DTYPES, ids=ids)
@pytest.mark.parametrize(
    "cfg",
    [
        dict(norm="rmsnorm", ffn="swiglu", positional="rope"),
        dict(norm="layernorm", ffn="gelu", bias=True),
        dict(norm="layernorm", ffn="gelu", cross_attention=True, kv_dim=16),
    ],
)
def test_transformer_block_matches_float64_twin(isa, rng, dt, cfg):
    def make(dtype):
        return TransformerBlock(32, 4, 2, rng=6, dtype=dtype, **cfg)

    b = make(dt)
    jitter_biases(b, rng)
    b64 = twin64(b, make)
    x = rng.standard_normal((2, 19, 32)).astype(dt)
    kw, kw64 = {}, {}
    if cfg.get("cross_attention"):
        ctx = rng.standard_normal((2, 7, 16)).astype(dt)
        kw, kw64 = {"context": ctx}, {"context": f64(ctx)}
    y = b(x, **kw)
    assert isinstance(y, np.ndarray) and y.dtype == dt and y.shape == x.shape
    close(y, b64(f64(x), **kw64), dt, 6)


@pytest.mark.parametrize("dt", DTYPES, ids=ids)
@pytest.mark.parametrize("positional", ["rope", "sinusoidal"])
def test_tiny_lm_logits_cache_and_generate(isa, rng, dt, positional):
    def make(dtype):
        return TinyTransformerLM(40, 32, 2, 4, 2, positional=positional, seed=0, dtype=dtype)

    lm = make(dt)
    lm64 = twin64(lm, make)
    t = rng.integers(0, 40, (2, 17))
    logits = lm(t)
    assert logits.dtype == dt and logits.shape == (2, 17, 40)
    want = lm64(t)
    close(logits, want, dt, 10)
    cache = lm.make_cache(2, 32)
    assert cache[0].dtype.itemsize == 2  # the model's 16-bit dtype
    stepped = [lm(t[:, :12], cache=cache)] + [
        lm(t[:, i : i + 1], cache=cache) for i in range(12, 17)
    ]
    close(np.concatenate([f64(s) for s in stepped], axis=1), want, dt, 10)
    out = lm.generate(t[:, :4], 5)
    assert out.shape == (2, 9) and out.dtype == np.int64 and np.array_equal(out[:, :4], t[:, :4])
    assert ((0 <= out) & (out < 40)).all()
    slow = lm.generate(t[:, :4], 5, use_cache=False)  # forward on the whole prefix each step
    np.testing.assert_array_equal(slow[:, 4], np.argmax(f64(lm(t[:, :4])[:, -1]), axis=-1))


# ---------------------------------------------------------------- Linformer


@pytest.mark.parametrize("dt", DTYPES, ids=ids)
def test_linformer_attention_and_layer(isa, rng, dt):
    from attn_fast import variants

    q, k, v = (rng.standard_normal((2, 3, 20, 8)).astype(dt) for _ in range(3))
    E = rng.standard_normal((6, 20)).astype(np.float32)
    o = variants.linformer_attention(q, k, v, E)
    assert o.dtype == dt and o.shape == (2, 3, 20, 8)
    # the oracle: the projections in float64, rounded to the dtype as the layer does (one
    # rounding each), then exact attention
    Kp, Vp = (np.matmul(E.astype(np.float64), f64(x)).astype(np.float32).astype(dt) for x in (k, v))
    want = af.reference.sdpa(f64(q), f64(Kp), f64(Vp))
    close(o, want, dt, 2)

    def make(dtype):
        return variants.Linformer(16, 2, seq_len=24, k=5, dtype=dtype, seed=7)

    layer = make(dt)
    assert all(getattr(layer, n).dtype == dt for n in ("Wq", "Wk", "Wv", "Wo", "E", "F"))
    twin = make(np.float64)
    for n in ("Wq", "Wk", "Wv", "Wo", "E", "F"):
        setattr(twin, n, f64(getattr(layer, n)))
    X = rng.standard_normal((2, 19, 16)).astype(dt)
    y = layer(X)
    assert y.dtype == dt and y.shape == X.shape
    close(y, twin(f64(X)), dt, 6)
    with pytest.raises(TypeError, match="X has dtype float32 but the Linformer's weights"):
        layer(X.astype(np.float32))
