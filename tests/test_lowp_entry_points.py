"""The 16-bit audit (issue 19): every public entry point with float16 / bfloat16 inputs.

``AUDIT`` classifies every public name of the public modules (their
``__all__``): "works" (called here with each 16-bit source kind: NumPy
float16, ``ml_dtypes.bfloat16``, torch.float16 and torch.bfloat16 tensors;
the result has the input's dtype and kind and matches the float64 oracle on
the same rounded inputs), "refuses" (a TypeError naming the dtype, with a
cast hint) or "n/a: why" (no floating-point array input). A public name that
is not classified fails ``test_every_public_name_is_audited``, so a new entry
point must be looked at.

Tolerances: one rounding of the result to the 16-bit dtype (u = 2^-8
bfloat16, 2^-11 float16, both twice the half-ulp bound), fp32 accumulation,
and for the attention kernels test_dtypes' term for P rounded to bfloat16;
the layers follow test_layers_16bit (a few u of the output's size, one per
rounded step).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from helpers import HALF_SOURCES, UNUSUAL_LAYOUTS, f64, gen, kind_of, make, ml_dtypes, need, torch
from oracle import sdpa_backward
from test_dtypes import close, orc
from test_variants import linear_oracle

import attn_fast as af
from attn_fast import masks, positional, variants
from attn_fast import reference as ref

U = {"f16": 2.0**-11, "bf16": 2.0**-8}

MODULES = [
    "attn_fast",
    "attn_fast.functional",
    "attn_fast.masks",
    "attn_fast.variants",
    "attn_fast.kv_cache",
    "attn_fast.paged_cache",
    "attn_fast.multihead",
    "attn_fast.transformer",
    "attn_fast.backward",
    "attn_fast.torch",
    "attn_fast.distributed",
    "attn_fast.positional",
    "attn_fast.integrations.transformers",
    "attn_fast.integrations.transformers_cache",
]

NO_ARRAYS = "n/a: takes no floating-point arrays"
AUDIT = {
    # the kernels
    "scaled_dot_product_attention": "works",
    "attention": "works",
    "attention_weights": "works",
    "varlen_attention": "works",
    "scaled_dot_product_attention_backward": "works",
    "varlen_attention_backward": "works",
    "KernelStats": "n/a: a result record (counters)",
    # caches
    "KVCache": "works",
    "LayerCaches": "works",
    "PagedKVCache": "works",
    "PagedLayerCaches": "works",
    "merge_attention_states": "refuses",
    # masks: only Dense holds floating-point values
    "Dense": "works",
    "Mask": NO_ARRAYS,
    "MaskArgs": NO_ARRAYS,
    "Causal": NO_ARRAYS,
    "SlidingWindow": NO_ARRAYS,
    "Padding": NO_ARRAYS,
    "BlockSparse": NO_ARRAYS,
    "MaskTypeError": NO_ARRAYS,
    "as_mask": NO_ARRAYS,
    # variants
    "linformer_attention": "works",
    "Linformer": "works",
    "linear_attention": "works",
    "linear_attention_step": "works",
    "feature_map": "works",
    "LinearAttentionState": "n/a: the running state, float64 for every input dtype",
    # layers
    "MultiHeadAttention": "works",
    "TransformerBlock": "works",
    "TinyTransformerLM": "works",
    "LayerNorm": "works",
    "RMSNorm": "works",
    "MLP": "works",
    "SwiGLU": "works",
    # positions
    "sinusoidal": "works",
    "RoPE": "works",
    "rope_reference": "n/a: the float64 oracle of RoPE",
    # torch, distributed, transformers
    "attn_fast.torch.scaled_dot_product_attention": "works",
    "ring_attention": "refuses",
    "ulysses_attention": "refuses",
    "shard_sequence": "works",
    "gather_sequence": "works",
    "positions": NO_ARRAYS,
    "RingStats": "n/a: a result record (counters)",
    "attention_forward": "works",
    "attention_mask": "n/a: builds boolean masks",
    "register": NO_ARRAYS,
    "AttnFastCache": "works: tested in test_transformers_cache.py (bf16 / fp16 models)",
    "AttnFastLayer": "works: tested in test_transformers_cache.py (bf16 / fp16 models)",
    "AttnFastPagedCache": "works: tested in test_paged_transformers.py (bf16 model, 16-bit pages)",
    "AttnFastPagedLayer": "works: tested in test_paged_transformers.py (bf16 model, 16-bit pages)",
    "NAME": NO_ARRAYS,
    # configuration, modules, the demo
    "__version__": NO_ARRAYS,
    "set_num_threads": NO_ARRAYS,
    "get_num_threads": NO_ARRAYS,
    "set_isa": NO_ARRAYS,
    "get_isa": NO_ARRAYS,
    "set_decode_prefetch": NO_ARRAYS,
    "get_decode_prefetch": NO_ARRAYS,
    "show_config": NO_ARRAYS,
    "explain": "n/a: the chapter's demo, every intermediate in float64 by design",
    "reference": "n/a: the float64 NumPy oracle module",
    "masks": "n/a: a module (its names are audited)",
    "variants": "n/a: a module (its names are audited)",
    "positional": "n/a: a module (its names are audited)",
}


def _imported():
    """The MODULES that import here (torch / transformers are optional dependencies)."""
    out = []
    for m in MODULES:
        try:
            out.append(importlib.import_module(m))
        except ImportError:  # pragma: no cover - an optional dependency is missing
            continue
    return out


def _public_names():
    for mod in _imported():
        for n in mod.__all__:
            yield mod.__name__, n


def _key(m, n):
    return f"{m}.{n}" if f"{m}.{n}" in AUDIT else n


def test_every_public_name_is_audited():
    missing = sorted({f"{m}.{n}" for m, n in _public_names() if _key(m, n) not in AUDIT})
    assert not missing, f"public names with no 16-bit audit entry: {missing}"
    seen = {_key(m, n) for m, n in _public_names()}
    stale = sorted(set(AUDIT) - seen)
    # Without an optional dependency (torch, transformers) some modules do not import, and
    # their names look stale: the check is complete only where every module imports.
    if len(_imported()) == len(MODULES):
        assert not stale, f"audit entries for names that are not public: {stale}"
    assert all(
        s in ("works", "refuses") or s.startswith(("n/a: ", "works: tested in "))
        for s in AUDIT.values()
    )


# ---------------------------------------------------------------- checks


def dtype_of(src):
    """The layer / cache dtype= for a source kind."""
    if src == "numpy_f16":
        return np.float16
    if src == "ml_bf16":
        return ml_dtypes.bfloat16
    return torch.float16 if src == "torch_f16" else torch.bfloat16


def same_kind(got, src):
    """`got` has the input's dtype and kind: a torch tensor for torch input."""
    if src.startswith("torch"):
        want = torch.float16 if src == "torch_f16" else torch.bfloat16
        assert isinstance(got, torch.Tensor) and got.dtype == want, (type(got), got.dtype)
    else:
        want = np.float16 if src == "numpy_f16" else ml_dtypes.bfloat16
        assert isinstance(got, np.ndarray) and got.dtype == want, (type(got), got.dtype)


def near(got, want, src, c=1.0, what="out"):
    """|got - want| <= u |want| + c u max|want| (+ 2e-5): the layers' tolerance."""
    u, g, w = U[kind_of(src)], f64(got), np.asarray(want, np.float64)
    assert g.shape == w.shape, (what, g.shape, w.shape)
    big = float(np.abs(w).max()) if w.size else 0.0
    bad = ~(np.abs(g - w) <= u * np.abs(w) + c * u * big + 2e-5)
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} off, max {np.abs(g - w).max():.3g}"


def lse_f32(lse, LSE):
    assert str(lse.dtype) in ("float32", "torch.float32"), lse.dtype
    np.testing.assert_allclose(f64(lse), LSE, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the kernels


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_sdpa_with_every_option(isa, rng, src):
    """GQA, Lq != Lk, a window, softcap, ALiBi and sinks given in the input's 16-bit kind."""
    q, k, v = gen(rng, src, (2, 4, 7, 80), (2, 2, 129, 80), (2, 2, 129, 5))
    slopes, sinks = gen(rng, src, (4,), (4,))
    o, lse = af.scaled_dot_product_attention(
        q,
        k,
        v,
        enable_gqa=True,
        window_size=(50, 0),
        softcap=5.0,
        alibi_slopes=slopes,
        sinks=sinks,
        return_lse=True,
    )
    same_kind(o, src)
    dist = np.abs(np.arange(7)[:, None] + (129 - 7) - np.arange(129)[None, :])
    kw = dict(
        mask=ref.window_mask(7, 129, 50, 0),
        bias=-f64(slopes)[:, None, None] * dist,  # ALiBi, bottom-right aligned
        softcap=5.0,
        sinks=f64(sinks),
        return_lse=True,
    )
    kr, vr = (np.repeat(f64(x), 2, axis=1) for x in (k, v))
    O, LSE = orc(f64(q), kr, vr, **kw)
    close(o, O, src)
    lse_f32(lse, LSE)


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_dense_mask_of_16bit_values(isa, rng, src):
    """masks.Dense holding a 16-bit additive bias (and -inf holes) reads its values."""
    q, k, v = gen(rng, src, (1, 2, 9, 16), (1, 2, 9, 16), (1, 2, 9, 16))
    (bias,) = gen(rng, src, (9, 9))
    if src.startswith("torch"):
        bias[2, ::2] = -float("inf")
    else:
        bias[2, ::2] = -np.inf
    o = af.scaled_dot_product_attention(q, k, v, attn_mask=masks.Dense(bias))
    same_kind(o, src)
    close(o, orc(f64(q), f64(k), f64(v), bias=f64(bias)), src)


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_attention_and_attention_weights(rng, src):
    X, Wq, Wk, Wv = gen(rng, src, (7, 12), (8, 12), (8, 12), (5, 12))
    o = af.attention(X, Wq, Wk, Wv, causal=True)
    same_kind(o, src)
    # the projections: float32 products rounded once to the dtype, as the function does
    Q, K, V = (make(f64(X) @ f64(W).T, src) for W in (Wq, Wk, Wv))
    O = ref.sdpa(f64(Q), f64(K), f64(V), mask=ref.causal_mask(7, 7), scale=1 / np.sqrt(8))
    near(o, O, src, c=2)
    q, k = gen(rng, src, (2, 3, 7, 16), (2, 3, 9, 16))
    w = af.attention_weights(q, k, is_causal=True)
    same_kind(w, src)
    s = f64(q) @ np.swapaxes(f64(k), -1, -2) / 4.0
    s = np.where(ref.causal_mask(7, 9), s, -np.inf)
    near(w, ref.softmax(s), src)


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_varlen_forward_and_backward(isa, rng, src):
    cu = np.array([0, 1, 8, 20])
    q, k, v, dout = gen(rng, src, (20, 2, 24), (20, 2, 24), (20, 2, 24), (20, 2, 24))
    o, lse = af.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    same_kind(o, src)
    dq, dk, dv = af.varlen_attention_backward(dout, q, k, v, o, lse, cu, cu, causal=True)
    for g in (dq, dk, dv):
        same_kind(g, src)
    for a, b in zip(cu[:-1], cu[1:]):

        def seq(x, a=a, b=b):
            return np.swapaxes(f64(x)[a:b], 0, 1)[None]  # (1, H, L, d)

        L = b - a
        O, LSE = orc(seq(q), seq(k), seq(v), mask=ref.causal_mask(L, L), return_lse=True)
        close(seq(o), O, src)
        lse_f32(lse[:, a:b][None], LSE)  # lse (H, total)
        want = sdpa_backward(seq(q), seq(k), seq(v), seq(dout), mask=ref.causal_mask(L, L))
        for got, name in zip((dq, dk, dv), ("dq", "dk", "dv")):
            near(seq(got), want[name], src, c=4, what=name)


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_sdpa_backward(isa, rng, src):
    q, k, v, dout = gen(rng, src, (1, 2, 33, 16), (1, 2, 33, 16), (1, 2, 33, 8), (1, 2, 33, 8))
    o, lse = af.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    grads = af.scaled_dot_product_attention_backward(dout, q, k, v, o, lse, is_causal=True)
    want = sdpa_backward(f64(q), f64(k), f64(v), f64(dout), mask=ref.causal_mask(33, 33))
    for got, name in zip(grads, ("dq", "dk", "dv")):
        same_kind(got, src)
        near(got, want[name], src, c=4, what=name)


def test_torch_op(isa, rng):
    need("torch_bf16")
    import attn_fast.torch as aft

    for src in ("torch_f16", "torch_bf16"):
        q, k, v = gen(rng, src, (1, 2, 9, 16), (1, 2, 12, 16), (1, 2, 12, 16))
        o = aft.scaled_dot_product_attention(q, k, v, is_causal=True)  # torch's: top-left
        same_kind(o, src)
        close(o, orc(f64(q), f64(k), f64(v), mask=np.tril(np.ones((9, 12), bool))), src)


# ---------------------------------------------------------------- caches


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_kv_caches(isa, rng, src):
    """KVCache, LayerCaches and PagedKVCache of a 16-bit dtype: append, then attend."""
    k, v, q = gen(rng, src, (1, 2, 70, 16), (1, 2, 70, 16), (1, 4, 3, 16))
    kr, vr = (np.repeat(f64(x), 2, axis=1) for x in (k, v))
    O, LSE = orc(f64(q), kr, vr, mask=ref.causal_mask(3, 70), return_lse=True)
    cache = af.KVCache(1, 2, 16, dtype=dtype_of(src))
    cache.append(k, v)
    o, lse = cache.attend(q, return_lse=True)
    same_kind(o, src)
    close(o, O, src)
    lse_f32(lse, LSE)
    layers = af.LayerCaches(2, 1, 2, 16, dtype=dtype_of(src))
    layers[1].append(k, v)
    o = layers[1].attend(q)
    same_kind(o, src)
    close(o, O, src)
    paged = af.PagedKVCache(2, 16, dtype=dtype_of(src), block_size=64)
    sid = paged.add_sequence()
    paged.append([sid], k, v)
    o = paged.attend([sid], q)
    same_kind(o, src)
    close(o, O, src)
    paged_layers = af.PagedLayerCaches(2, 2, 16, dtype=dtype_of(src), block_size=64)
    sid = paged_layers.add_sequence()
    paged_layers[1].append([sid], k, v)
    o = paged_layers[1].attend([sid], q)
    same_kind(o, src)
    close(o, O, src)


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_merge_attention_states_refuses_with_cast_hint(rng, src):
    (o,) = gen(rng, src, (1, 2, 3, 8))
    lse = np.zeros((1, 2, 3), np.float32)
    with pytest.raises(TypeError, match=r"o_a must be float32 or float64.*cast to float32"):
        af.merge_attention_states(o, lse, o, lse)


# ---------------------------------------------------------------- variants


@pytest.mark.parametrize("src", HALF_SOURCES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fm", ["elu1", "relu"])
@pytest.mark.parametrize("shape", [((), 1, 1, 1), ((3,), 7, 5, 80), ((2, 2), 129, 80, 5)])
def test_linear_attention(rng, src, causal, fm, shape):
    lead, L, d, dv = shape
    q, k, v = gen(rng, src, lead + (L, d), lead + (L, d), lead + (L, dv))
    o = variants.linear_attention(q, k, v, fm, causal)
    same_kind(o, src)
    close_linear(o, linear_oracle(f64(q), f64(k), f64(v), fm, causal), src)


def close_linear(got, want, src):
    """One rounding of the float64 quotient (float32 features): u |want| + 2e-5."""
    u, g = U[kind_of(src)], f64(got)
    bad = ~(np.abs(g - want) <= u * np.abs(want) + 2e-5)
    assert not bad.any(), f"{bad.sum()} of {bad.size} off, max {np.abs(g - want).max():.3g}"


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_linear_attention_state_step_and_strides(rng, src):
    """Chunked prefill, then one-token steps, on transposed 16-bit inputs: the causal form."""
    q, k, v = gen(rng, src, (2, 20, 3, 8), (2, 20, 3, 8), (2, 20, 3, 6))
    if src.startswith("torch"):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    else:
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    want = linear_oracle(f64(q), f64(k), f64(v), causal=True)
    o1, st = variants.linear_attention(
        q[:, :, :12], k[:, :, :12], v[:, :, :12], causal=True, return_state=True
    )
    o2, st = variants.linear_attention(
        q[:, :, 12:18], k[:, :, 12:18], v[:, :, 12:18], causal=True, state=st, return_state=True
    )
    assert st.kv.dtype == np.float64 and st.length == 18
    same_kind(o1, src)
    close_linear(o1, want[:, :, :12], src)
    close_linear(o2, want[:, :, 12:18], src)
    for t in (18, 19):
        o, st = variants.linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], st)
        same_kind(o, src)
        close_linear(o, want[:, :, t], src)


def test_linear_attention_rounds_once(rng):
    """The 16-bit output is the float64 kernel's output on the same values, rounded once:
    equal, or (features in float32, not float64) one unit in the last place off."""
    need("ml_bf16")
    q, k, v = (rng.standard_normal((2, 3, 40, 16)).astype(np.float32) for _ in range(3))
    for dt in (np.float16, ml_dtypes.bfloat16):
        q16, k16, v16 = (x.astype(dt) for x in (q, k, v))
        for causal in (False, True):
            o16 = variants.linear_attention(q16, k16, v16, causal=causal)
            o64 = variants.linear_attention(*(f64(x) for x in (q16, k16, v16)), causal=causal)
            got = o16.view(np.int16).astype(np.int64)
            want = o64.astype(dt).view(np.int16).astype(np.int64)
            assert np.abs(got - want).max() <= 1
            assert (got == want).mean() > 0.99


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_linear_attention_fully_zero_rows_and_poisoned_kernel_output(rng, src):
    """relu features that vanish with eps = 0 give zeros, never NaN; the kernel writes
    every element of a NaN-filled 16-bit output."""
    q, k, v = gen(rng, src, (9, 4), (9, 4), (9, 3))
    q[::3] = -abs(q[::3])
    o = variants.linear_attention(q, k, v, "relu", True, eps=0.0)
    assert np.all(f64(o)[::3] == 0) and np.all(np.isfinite(f64(o)))
    close_linear(o, linear_oracle(f64(q), f64(k), f64(v), "relu", True, 0.0), src)
    f = np.abs(rng.standard_normal((1, 2, 9, 4))).astype(np.float32)
    vv = rng.standard_normal((1, 2, 9, 3)).astype(np.float16)
    out = np.full((1, 2, 9, 3), np.nan, np.float16)
    af._core.linear_attention(f, f, vv, out, causal=False, eps=1e-6)
    assert np.all(np.isfinite(out))


def test_linear_attention_mixed_dtypes_raise_with_cast_hint(rng):
    need("ml_bf16")
    q = rng.standard_normal((2, 5, 4)).astype(np.float16)
    for other in (q.astype(ml_dtypes.bfloat16), q.astype(np.float32)):
        with pytest.raises(TypeError, match=r"mixed dtypes.*cast"):
            variants.linear_attention(q, other, q)
        with pytest.raises(TypeError, match=r"mixed dtypes.*cast"):
            variants.linear_attention_step(q[:, 0], q[:, 0], other[:, 0])


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_feature_map(rng, src):
    (x,) = gen(rng, src, (3, 5))
    for fm in ("elu1", "relu"):
        y = variants.feature_map(x, fm)
        same_kind(y, src)
        xf = f64(x)
        want = (
            np.where(xf > 0, xf + 1, np.exp(np.minimum(xf, 0))) if fm == "elu1" else xf * (xf > 0)
        )
        near(y, want, src, c=0)


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_linformer(isa, rng, src):
    q, k, v = gen(rng, src, (2, 9, 8), (2, 20, 8), (2, 20, 8))
    E = rng.standard_normal((5, 20)).astype(np.float32)
    o = variants.linformer_attention(q, k, v, E)
    same_kind(o, src)
    Kp, Vp = (make(E.astype(np.float64) @ f64(x), src) for x in (k, v))
    close(o, orc(f64(q), f64(Kp), f64(Vp)), src)
    layer = variants.Linformer(16, 2, seq_len=24, k=5, dtype=dtype_of(src), seed=3)
    (X,) = gen(rng, src, (19, 16))
    y = layer(X)
    same_kind(y, src)
    twin = variants.Linformer(16, 2, seq_len=24, k=5, dtype=np.float64, seed=3)
    for n in ("Wq", "Wk", "Wv", "Wo", "E", "F"):
        setattr(twin, n, f64(getattr(layer, n)))
    near(y, twin(f64(X)), src, c=6)


# ---------------------------------------------------------------- layers


def twin64(layer, build):
    m = build(np.float64)
    m.load_weights(layer.state_dict())
    return m


LAYERS = {
    "MultiHeadAttention": (
        lambda dt: af.MultiHeadAttention(16, 4, 2, positional="rope", dtype=dt),
        4,
    ),
    "TransformerBlock": (lambda dt: af.TransformerBlock(16, 4, 2, dtype=dt, rng=1), 6),
    "LayerNorm": (lambda dt: af.LayerNorm(16, dtype=dt), 1),
    "RMSNorm": (lambda dt: af.RMSNorm(16, dtype=dt), 1),
    "MLP": (lambda dt: __import__("attn_fast.transformer").transformer.MLP(16, 24, 2, dtype=dt), 3),
    "SwiGLU": (
        lambda dt: __import__("attn_fast.transformer").transformer.SwiGLU(16, 24, 2, dtype=dt),
        3,
    ),
}


@pytest.mark.parametrize("src", HALF_SOURCES)
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layers(isa, rng, src, name):
    build, c = LAYERS[name]
    need(src)
    layer = build(dtype_of(src))
    (X,) = gen(rng, src, (2, 7, 16))
    y = layer(X)
    same_kind(y, src)
    twin = twin64(layer, build)
    near(y, twin(f64(X)), src, c=c)


@pytest.mark.parametrize("src", ["numpy_f16", "ml_bf16", "torch_bf16"])
def test_tiny_lm(isa, rng, src):
    """Token ids in, logits of the model's dtype out (NumPy: the ids carry no dtype)."""
    need(src)

    def build(dt):
        return af.TinyTransformerLM(31, 16, 2, 4, 2, dtype=dt, seed=0)

    lm = build(dtype_of(src))
    tokens = rng.integers(0, 31, (2, 9))
    logits = lm(tokens)
    assert logits.dtype == np.dtype(lm.dtype if hasattr(lm, "dtype") else logits.dtype)
    assert np.dtype(logits.dtype).itemsize == 2
    near(logits, twin64(lm, build)(tokens), src, c=10)


# ---------------------------------------------------------------- positions


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_rope(rng, src):
    (x,) = gen(rng, src, (2, 9, 3, 8))  # (B, L, H, d): seq_axis -3
    rope = positional.RoPE(8)
    y = rope(x, offset=4)
    same_kind(y, src)
    want = np.swapaxes(positional.rope_reference(np.swapaxes(f64(x), 1, 2), np.arange(4, 13)), 1, 2)
    near(y, want, src, c=0)


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_sinusoidal(src):
    need(src)
    table = positional.sinusoidal(9, 8, offset=3, dtype=dtype_of(src))
    assert isinstance(table, np.ndarray)
    want = np.float16 if kind_of(src) == "f16" else ml_dtypes.bfloat16
    assert table.dtype == want
    near(table, positional.sinusoidal(9, 8, offset=3, dtype=np.float64), src, c=0)


# ---------------------------------------------------------------- torch-only helpers


def test_ring_and_ulysses_refuse_16bit_with_cast_hint(rng):
    need("torch_bf16")
    from attn_fast import distributed

    for src in ("torch_f16", "torch_bf16"):
        q, k, v = gen(rng, src, (1, 2, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8))
        for f in (distributed.ring_attention, distributed.ulysses_attention):
            with pytest.raises(
                TypeError, match=r"q has dtype torch\.b?float16.*cast with q\.float"
            ):
                f(q, k, v)


def test_shard_and_gather_keep_the_dtype(rng):
    need("torch_bf16")
    from attn_fast import distributed

    for src in ("torch_f16", "torch_bf16"):
        (x,) = gen(rng, src, (1, 2, 8, 4))
        shards = [distributed.shard_sequence(x, r, 2) for r in range(2)]
        for s in shards:
            same_kind(s, src)
        back = distributed.gather_sequence(shards)
        same_kind(back, src)
        assert torch.equal(back, x)


def test_transformers_backend(rng):
    """attention_forward (the registered backend) in bf16 / fp16: the output in the
    tensors' dtype, (B, Lq, H, dv) layout."""
    need("torch_bf16")
    pytest.importorskip("transformers")
    from attn_fast.integrations import transformers as aft

    class Module:
        is_causal = True
        training = False

    for src in ("torch_f16", "torch_bf16"):
        q, k, v = gen(rng, src, (1, 4, 6, 16), (1, 2, 6, 16), (1, 2, 6, 16))
        o, _ = aft.attention_forward(Module(), q, k, v, None, scaling=0.25)
        same_kind(o, src)
        kr, vr = (np.repeat(f64(x), 2, axis=1) for x in (k, v))
        O = orc(f64(q), kr, vr, mask=ref.causal_mask(6, 6), scale=0.25)
        close(np.swapaxes(f64(o), 1, 2), O, src)


@pytest.mark.parametrize("src", HALF_SOURCES)
def test_rope_out_inplace_and_rotate_qk(rng, src):
    """out= and inplace= write the caller's 16-bit object; rotate_qk rotates both."""
    x, k = gen(rng, src, (9, 2, 8), (9, 2, 8))
    rope = positional.RoPE(8)
    want = rope(x, offset=2)
    out = x.clone() * 0 if src.startswith("torch") else np.zeros_like(x)
    assert rope(x, offset=2, out=out) is out
    np.testing.assert_array_equal(f64(out), f64(want))
    y = x.clone() if src.startswith("torch") else x.copy()
    assert rope(y, offset=2, inplace=True) is y
    np.testing.assert_array_equal(f64(y), f64(want))
    qr, kr = rope.rotate_qk(x, k, offset=2)
    same_kind(qr, src)
    np.testing.assert_array_equal(f64(qr), f64(want))
    np.testing.assert_array_equal(f64(kr), f64(rope(k, offset=2)))


def test_mixed_dtypes_raise_with_cast_hint(rng):
    """Every entry point that takes two 16-bit arrays: a float16 / bfloat16 / float32 mix
    raises TypeError naming the dtypes and how to cast."""
    need("ml_bf16")
    a = rng.standard_normal((1, 2, 8, 8)).astype(np.float16)
    b = a.astype(ml_dtypes.bfloat16)
    c = a.astype(np.float32)
    calls = {
        "sdpa": lambda x, y: af.scaled_dot_product_attention(x, y, x),
        "attention_weights": lambda x, y: af.attention_weights(x, y),
        "linear_attention": lambda x, y: variants.linear_attention(x, y, x),
        "linformer_attention": lambda x, y: variants.linformer_attention(
            x, y, x, np.ones((2, 8), np.float32)
        ),
        "backward": lambda x, y: af.scaled_dot_product_attention_backward(
            x, x, y, x, x, np.zeros((1, 2, 8), np.float32)
        ),
        "rotate_qk": lambda x, y: positional.RoPE(8).rotate_qk(x[0], y[0]),
    }
    for f in calls.values():
        for x, y in ((a, b), (b, a), (a, c), (c, b)):
            with pytest.raises(TypeError, match=r"(mixed dtypes|dtype).*(cast|astype|\.to\()"):
                f(x, y)
    for layer in (af.LayerNorm(8, dtype=np.float16), af.MultiHeadAttention(8, 2, dtype="bfloat16")):
        with pytest.raises(TypeError, match=r"has dtype .* cast it"):
            layer(c[0, 0])


@pytest.mark.parametrize("layout", sorted(UNUSUAL_LAYOUTS))
def test_unusual_layouts_of_16bit_data(rng, layout):
    """Misaligned, big-endian, negative-stride, Fortran and read-only float16 data give
    the same bits as the contiguous array (linear attention, RoPE)."""
    q, k, v = (rng.standard_normal((2, 9, 4)).astype(np.float16) for _ in range(3))
    f = UNUSUAL_LAYOUTS[layout]
    o = variants.linear_attention(f(q), f(k), f(v), causal=True)
    assert o.dtype == np.float16 and o.dtype.isnative
    np.testing.assert_array_equal(o, variants.linear_attention(q, k, v, causal=True))
    rope = positional.RoPE(4)
    r = rope(f(q), seq_axis=-2)
    assert r.dtype == np.float16 and r.dtype.isnative
    np.testing.assert_array_equal(r, rope(q, seq_axis=-2))


def test_the_oracle_reads_16bit_torch_tensors(rng):
    """attn_fast.reference (the float64 oracle) takes torch tensors of any dtype, bfloat16
    included (NumPy cannot read those): the same float64 result as the tensors' values."""
    need("torch")
    q, k, v = (rng.standard_normal((1, 4, 5, 8)) for _ in range(3))
    bias = rng.standard_normal((5, 5))
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        tq, tk, tv, tb = (torch.from_numpy(a).to(dt) for a in (q, k, v, bias))
        vals = [t.double().numpy() for t in (tq, tk, tv, tb)]
        got = ref.sdpa(tq, tk[:, :2], tv[:, :2], bias=tb, sinks=torch.ones(4, dtype=dt))
        want = ref.sdpa(*vals[:1], vals[1][:, :2], vals[2][:, :2], bias=vals[3], sinks=np.ones(4))
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(ref.softmax(tb), ref.softmax(vals[3]))
    X, W = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    np.testing.assert_array_equal(
        ref.attention(X, W, W, W, causal=True),
        ref.attention(X.double().numpy(), *(W.double().numpy(),) * 3, causal=True),
    )
