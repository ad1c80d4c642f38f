"""``TransformerBlock`` and ``TinyTransformerLM`` (transformer.py): argument
and token errors, and failing calls (a bad cache, a bad weight) that leave
every layer as it was (docs/HARDENING.md)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    assert_same_cache,
    bad_weights,
    randn,
    snapshot_cache,
)

import attn_fast as af

# ---------------------------------------------------------------- TransformerBlock


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(d_ff=-1), ValueError, "d_ff must be >= 1"),  # was numpy's "negative dimensions"
        (dict(d_ff=0), ValueError, "d_ff must be >= 1"),
        (dict(d_ff=16.0), TypeError, "d_ff must be an int"),
        (dict(eps=np.nan), ValueError, "eps must be finite"),  # was a NaN output
        (dict(eps=-1e-5), ValueError, "eps must be >= 0"),
        (dict(norm="batchnorm"), ValueError, "norm must be one of"),
        (dict(ffn="relu"), ValueError, "ffn must be one of"),
        (dict(dtype=np.int32), TypeError, "dtype must be float32, float64, float16 or bfloat16"),
        (dict(num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
    ],
)
def test_block_constructor_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        af.TransformerBlock(8, 2, **kw)


def test_block_call_errors(rng):
    blk = af.TransformerBlock(8, 2, rng=0)
    x = randn(rng, (2, 5, 8))
    with pytest.raises(ValueError, match="context= is required"):
        blk(x, context=x)
    with pytest.raises(TypeError, match="x has dtype float64"):
        blk(x.astype(F64))
    with pytest.raises(ValueError, match=r"got shape \(2, 5, 4\)"):
        blk(x[..., :4])
    cross = af.TransformerBlock(8, 2, cross_attention=True, rng=0)
    with pytest.raises(ValueError, match="context= is required"):
        cross(x)
    with pytest.raises(ValueError, match="batch sizes differ"):
        cross(x, context=x[:1])


def test_block_load_weights_is_all_or_nothing():
    blk = af.TransformerBlock(8, 2, rng=0)
    sd = {k: v.copy() for k, v in blk.state_dict().items()}
    with pytest.raises(ValueError, match=r"ffn.W2 has shape \(1, 1\)"):
        blk.load_weights(bad_weights(sd, "ffn.W2", np.ones((1, 1), F32)))
    for k, v in blk.state_dict().items():
        np.testing.assert_array_equal(v, sd[k])


# ---------------------------------------------------------------- TinyTransformerLM


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(vocab_size=0), ValueError, "vocab_size must be >= 1"),
        (dict(vocab_size=11.0), TypeError, "vocab_size must be an int"),
        (dict(num_layers=2.5), TypeError, "num_layers must be an int"),  # was int(2.5) = 2 layers
        (dict(num_layers=0), ValueError, "num_layers must be >= 1"),
        (dict(num_heads=True), TypeError, "num_heads must be an int"),
        (dict(positional="alibi"), ValueError, "positional must be"),
        (dict(head_dim=4.0), TypeError, "head_dim must be an int"),
        (dict(dtype=np.complex64), TypeError, "dtype must be float32, float64, float16 or bf"),
    ],
)
def test_lm_constructor_errors(kw, exc, match):
    args = dict(vocab_size=11, d_model=8, num_layers=2, num_heads=2)
    args.update(kw)
    with pytest.raises(exc, match=match):
        af.TinyTransformerLM(**args)


@pytest.fixture(scope="module")
def lm():
    return af.TinyTransformerLM(11, 8, 2, 2, num_kv_heads=1, seed=3)


@pytest.mark.parametrize(
    "tokens, exc, match",
    [
        (np.array([1.0, 2.0]), TypeError, "tokens must be an integer array"),
        (np.array([True, False]), TypeError, "tokens must be an integer array"),
        (np.array([1, 11]), ValueError, r"\[0, vocab_size=11\)"),
        (np.array([-1, 2]), ValueError, r"\[0, vocab_size=11\)"),
        (np.ones((1, 1, 2), int), ValueError, r"\(L,\) or \(B, L\)"),
        (np.int64(3), ValueError, r"\(L,\) or \(B, L\)"),
    ],
)
def test_lm_token_errors(lm, tokens, exc, match):
    with pytest.raises(exc, match=match):
        lm.forward(tokens)


def test_lm_generate_errors(lm):
    for bad, exc in [
        (2.5, TypeError),
        (True, TypeError),
        (-1, ValueError),
    ]:  # 2.5 and True used to run
        with pytest.raises(exc, match="max_new_tokens"):
            lm.generate([1, 2], bad)
    for bad, exc in [(np.nan, ValueError), (-0.5, ValueError), ("hot", TypeError)]:
        with pytest.raises(exc, match="temperature"):
            lm.generate([1, 2], 2, temperature=bad)
    with pytest.raises(ValueError, match="at least one token"):
        lm.generate(np.zeros((2, 0), int), 2)
    np.testing.assert_array_equal(lm.generate(np.array([3, 4], np.uint8), 0), [3, 4])


def test_lm_forward_bad_cache_leaves_every_layer_unchanged(lm, rng):
    good = lm.make_cache(1, 8)
    lm.forward(np.array([[1, 2, 3]]), cache=good)
    snaps = [snapshot_cache(c) for c in good]
    odd = [
        good[0],
        af.KVCache(1, 1, 4, capacity=8, dtype=F64),
    ]  # layer 1's cache has the wrong dtype
    with pytest.raises(ValueError, match=r"cache\[1\]"):
        lm.forward(np.array([[4]]), cache=odd)
    with pytest.raises(ValueError, match="cache has 1 layers"):
        lm.forward(np.array([[4]]), cache=[good[0]])
    with pytest.raises(ValueError, match="cache has"):
        lm.forward(np.array([[4], [5]]), cache=good)  # batch 2, cache batch 1
    with pytest.raises(TypeError, match=r"cache\[1\]: cache must be a KVCache"):
        lm.forward(np.array([[4]]), cache=[good[0], None])
    fixed = af.LayerCaches(2, 1, 1, 4, capacity=4, growable=False)
    lm.forward(np.array([[1, 2]]), cache=fixed)
    fixed_snaps = [snapshot_cache(c) for c in fixed]
    mixed = [fixed[0], good[1]]
    with pytest.raises(ValueError, match="different positions"):
        lm.forward(np.array([[4]]), cache=mixed)
    with pytest.raises(ValueError, match=r"cache\[0\] .* no room for 3 more"):
        lm.forward(np.array([[4, 5, 6]]), cache=fixed)
    for c, s in zip(list(good) + list(fixed), snaps + fixed_snaps):
        assert_same_cache(c, s)
    # Layer 0 could take the chunk, layer 1's fixed ring cannot: neither changes.
    ring = [af.KVCache(1, 1, 4), af.KVCache(1, 1, 4, window=2, ring=2, growable=False)]
    with pytest.raises(ValueError, match=r"cache\[1\]: a chunk of 2 tokens does not fit"):
        lm.forward(np.array([[4, 5]]), cache=ring)
    assert len(ring[0]) == len(ring[1]) == 0


def test_lm_load_weights_is_all_or_nothing(lm):
    sd = {k: v.copy() for k, v in lm.state_dict().items()}
    with pytest.raises(ValueError, match="contains NaN"):
        lm.load_weights(bad_weights(sd, "norm.weight", np.full(8, np.nan, F32)))
    with pytest.raises(KeyError, match="unknown weights: extra"):
        lm.load_weights({**sd, "extra": np.ones(1)})
    for k, v in lm.state_dict().items():
        np.testing.assert_array_equal(v, sd[k])
