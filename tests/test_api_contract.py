"""What a torch user expects of the API: torch's positional order, strict flags,
and results in the kind of array that went in (NumPy in, NumPy out; torch in,
torch out, zero-copy)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, randn

import attn_fast as af
from attn_fast import reference as ref

torch = pytest.importorskip("torch")

sdpa = af.scaled_dot_product_attention


# ---------------------------------------------------------------- torch's positional order


def test_positional_order_is_torchs(rng):
    """(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa), as
    torch.nn.functional.scaled_dot_product_attention: the same call gives the same answer."""
    q, k, v = (randn(rng, (2, 4, 9, 16)) for _ in range(3))
    kv2 = randn(rng, (2, 2, 9, 16)), randn(rng, (2, 2, 9, 16))
    F = torch.nn.functional.scaled_dot_product_attention
    t = torch.from_numpy
    # torch's C signature makes scale and enable_gqa keyword-only; its documented
    # order (which attn_fast accepts positionally) puts them 7th and 8th.
    for args, scale in [
        ((None, 0.0, True), None),
        ((None, 0.0, False, 0.3), 0.3),
        ((None, 0.0, True, None), None),
    ]:
        expect = F(t(q), t(k), t(v), *args[:3], scale=scale).numpy()
        assert_close(sdpa(q, k, v, *args), expect, np.float32)
    o = sdpa(q, *kv2, None, 0.0, True, 0.25, True)  # enable_gqa as the 8th positional
    expect = F(t(q), t(kv2[0]), t(kv2[1]), None, 0.0, True, scale=0.25, enable_gqa=True).numpy()
    assert_close(o, expect, np.float32)
    # the causal flag really is the 6th positional: it changes the result
    assert not np.allclose(sdpa(q, k, v, None, 0.0, True), sdpa(q, k, v, None, 0.0, False))


def test_torch_keyword_names(rng):
    q, k, v = (randn(rng, (1, 2, 5, 8)) for _ in range(3))
    base = sdpa(q, k, v, is_causal=True)
    np.testing.assert_array_equal(sdpa(query=q, key=k, value=v, is_causal=True), base)
    np.testing.assert_array_equal(sdpa(q, key=k, value=v, is_causal=True, dropout_p=0.0), base)
    np.testing.assert_array_equal(sdpa(q=q, k=k, v=v, is_causal=True, dropout_p=0), base)
    with pytest.raises(TypeError, match="both q and query"):
        sdpa(q, k, v, query=q)
    with pytest.raises(TypeError, match=r"k \(key\) must be an array, got None"):
        sdpa(q, value=v)


@pytest.mark.parametrize("p", [0.1, 1e-9, 0.5, 1.0])
def test_dropout_is_refused(rng, p):
    """sdpa(q, k, v, None, 0.1) once landed in is_causal; now it says what it is."""
    q = randn(rng, (1, 1, 4, 8))
    with pytest.raises(ValueError, match="dropout_p must be 0"):
        sdpa(q, q, q, None, p)
    with pytest.raises(ValueError, match="dropout_p must be 0"):
        sdpa(q, q, q, dropout_p=p)


@pytest.mark.parametrize("bad", [True, "0", None, complex(0, 0), float("nan"), -0.5])
def test_dropout_must_be_a_real_zero(rng, bad):
    q = randn(rng, (1, 1, 4, 8))
    with pytest.raises((TypeError, ValueError), match="dropout_p"):
        sdpa(q, q, q, dropout_p=bad)


@pytest.mark.parametrize(
    "name", ["is_causal", "enable_gqa", "return_lse", "return_weights", "return_stats"]
)
@pytest.mark.parametrize("bad", ["yes", 1, 0.1, None, np.array([True, False])])
def test_flags_must_be_bools(rng, name, bad):
    q = randn(rng, (1, 1, 4, 8))
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        sdpa(q, q, q, **{name: bad})


def test_numpy_bools_are_bools(rng):
    q, k, v = (randn(rng, (1, 2, 6, 8)) for _ in range(3))
    np.testing.assert_array_equal(
        sdpa(q, k, v, is_causal=np.bool_(True)), sdpa(q, k, v, is_causal=True)
    )
    o, lse = sdpa(q, k, v, return_lse=np.True_)
    assert lse.shape == (1, 2, 6)


def test_other_entry_points_check_flags(rng):
    q = randn(rng, (6, 2, 8))
    cu = np.array([0, 6])
    with pytest.raises(TypeError, match="causal must be a bool"):
        af.varlen_attention(q, q, q, cu, cu, causal="yes")
    X = randn(rng, (4, 8))
    W = randn(rng, (3, 8))
    with pytest.raises(TypeError, match="causal must be a bool"):
        af.attention(X, W, W, W, causal=1)
    with pytest.raises(TypeError, match="causal must be a bool"):
        af.variants.linear_attention(q, q, q, causal=0.5)


# ---------------------------------------------------------------- the kind of the result


def test_numpy_in_numpy_out(rng):
    q, k, v = (randn(rng, (1, 2, 7, 8)) for _ in range(3))
    o, lse = sdpa(q, k, v, return_lse=True)
    assert type(o) is np.ndarray and type(lse) is np.ndarray


def test_torch_in_torch_out_zero_copy(rng):
    qn, kn, vn = (randn(rng, (2, 3, 7, 8)) for _ in range(3))
    q, k, v = map(torch.from_numpy, (qn, kn, vn))
    o, lse, stats = sdpa(q, k, v, is_causal=True, return_lse=True, return_stats=True)
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert isinstance(stats, af.KernelStats)
    O, LSE = ref.sdpa(qn, kn, vn, mask=ref.causal_mask(7, 7), return_lse=True)
    assert_close(o.numpy(), O, np.float32)
    assert_close(lse.numpy(), LSE, np.float32)
    # zero-copy: the tensor is a view of the result's memory, writable, not a copy of a copy
    a = o.numpy()
    assert a.ctypes.data == o.data_ptr() and a.flags.writeable
    w = sdpa(q, k, v, return_weights=True)[1]
    assert isinstance(w, torch.Tensor) and w.shape == (2, 3, 7, 7)


def test_torch_out_given_is_returned_as_is(rng):
    q, k, v = (torch.from_numpy(randn(rng, (1, 2, 5, 8))) for _ in range(3))
    buf = torch.empty(1, 2, 5, 8)
    res, lse = sdpa(q, k, v, out=buf, return_lse=True)
    assert res is buf and isinstance(lse, torch.Tensor)
    nbuf = np.empty((1, 2, 5, 8), np.float32)
    assert sdpa(q, k, v, out=nbuf) is nbuf  # the caller's own object, whatever q is


def test_torch_kind_follows_every_entry_point(rng):
    t = torch.from_numpy
    q3 = randn(rng, (9, 2, 8))
    cu = np.array([0, 4, 9])
    o, lse = af.varlen_attention(t(q3), t(q3), t(q3), cu, cu, causal=True, return_lse=True)
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert_close(o.numpy(), af.varlen_attention(q3, q3, q3, cu, cu, causal=True), np.float32)

    X, W = randn(rng, (5, 8)), [randn(rng, (4, 8)) for _ in range(3)]
    O = af.attention(t(X), *map(t, W), causal=True)
    assert isinstance(O, torch.Tensor) and O.shape == (5, 4)
    assert_close(O.numpy(), af.attention(X, *W, causal=True), np.float32)

    cache = af.KVCache(1, 2, 8)
    kk, vv = randn(rng, (1, 2, 6, 8)), randn(rng, (1, 2, 6, 8))
    cache.append(t(kk), t(vv))
    qq = randn(rng, (1, 2, 6, 8))
    o, lse = cache.attend(t(qq), return_lse=True)
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert isinstance(cache.attend(qq), np.ndarray)
    fresh = af.KVCache(1, 2, 8)
    assert isinstance(fresh.forward(t(qq), t(kk), t(vv)), torch.Tensor)

    oa, la = sdpa(qq, kk, vv, return_lse=True)
    m = af.merge_attention_states(t(oa), t(la), t(oa), t(la))
    assert all(isinstance(x, torch.Tensor) for x in m)

    q4 = randn(rng, (1, 2, 6, 8))
    assert isinstance(af.variants.linear_attention(t(q4), t(q4), t(q4)), torch.Tensor)
    o, st = af.variants.linear_attention_step(t(q4[:, :, 0]), t(q4[:, :, 0]), t(q4[:, :, 0]))
    assert isinstance(o, torch.Tensor) and o.shape == (1, 2, 8)
    E = randn(rng, (3, 6))
    assert isinstance(af.variants.linformer_attention(t(q4), t(q4), t(q4), E), torch.Tensor)

    mha = af.MultiHeadAttention(16, 2, rng=0)
    x = randn(rng, (1, 5, 16))
    y = mha(t(x), causal=True)
    assert isinstance(y, torch.Tensor)
    assert_close(y.numpy(), mha(x, causal=True), np.float32)
    block = af.TransformerBlock(16, 2, rng=0)
    assert isinstance(block(t(x)), torch.Tensor)
    assert isinstance(block(x), np.ndarray)
