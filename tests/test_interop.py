"""Array interop: torch tensors, buffer protocol, __array_interface__, DLPack.

Inputs are read in place through their strides (checked at the kernel
boundary: the array the C++ core receives points at the caller's memory);
`out=` may be a NumPy array or a CPU torch tensor and is written in place;
memory that is not on the CPU raises TypeError.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, poisoned, randn

import attn_fast as af
from attn_fast import _checks
from attn_fast import reference as ref


@pytest.fixture
def kernel_inputs(monkeypatch):
    """Record (data pointer, strides) of every q, k, v, o the C++ core receives."""
    seen = []
    real = af._core.forward

    def spy(q, k, v, o, *args, **kw):
        seen.append(
            {n: (a.ctypes.data, a.strides) for n, a in (("q", q), ("k", k), ("v", v), ("o", o))}
        )
        return real(q, k, v, o, *args, **kw)

    monkeypatch.setattr(af._core, "forward", spy)
    return seen


class ArrayInterface:
    """Exposes only __array_interface__ (as e.g. older array libraries do)."""

    def __init__(self, a):
        self._a = a  # keeps the memory alive
        self.__array_interface__ = a.__array_interface__


class DLPackOnly:
    """Exposes only the DLPack protocol (as JAX and other array-API libraries do)."""

    def __init__(self, a, device=(1, 0)):
        self._a, self._device = a, device

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._device


class CudaArrayInterface:
    __cuda_array_interface__ = {"shape": (4, 8), "typestr": "<f4", "data": (0, False), "version": 3}


def ptr(a):
    return np.asarray(a).ctypes.data


# --------------------------------------------------------------------- NumPy-side protocols


def test_buffer_protocol_read_only_zero_copy(rng, kernel_inputs):
    # A read-only buffer (bytes) viewed as (H, L, d) through memoryview: read in place.
    q = randn(rng, (2, 9, 8))
    mv = memoryview(q.tobytes()).cast("B").cast("f", q.shape)
    o = af.scaled_dot_product_attention(mv, mv, mv)
    assert_close(o, ref.sdpa(q, q, q), np.float32)
    assert kernel_inputs[-1]["q"][0] == ptr(mv)


def test_array_interface_zero_copy(rng, kernel_inputs):
    base = randn(rng, (2, 3, 11, 16))
    qi = ArrayInterface(base[:, :, :, ::2])  # strided view
    o = af.scaled_dot_product_attention(qi, qi, qi, is_causal=True)
    x = base[:, :, :, ::2]
    assert_close(o, ref.sdpa(x, x, x, mask=ref.causal_mask(11, 11)), np.float32)
    assert kernel_inputs[-1]["q"] == (x.ctypes.data, x.strides)


def test_dlpack_zero_copy(rng, kernel_inputs):
    q, k, v = (
        randn(rng, (1, 2, 5, 8), np.float64),
        randn(rng, (1, 2, 7, 8), np.float64),
        randn(rng, (1, 2, 7, 3), np.float64),
    )
    o = af.scaled_dot_product_attention(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v))
    assert_close(o, ref.sdpa(q, k, v), np.float64)
    rec = kernel_inputs[-1]
    assert (rec["q"][0], rec["k"][0], rec["v"][0]) == (q.ctypes.data, k.ctypes.data, v.ctypes.data)


def test_non_cpu_memory_is_a_type_error():
    x = np.ones((4, 8), np.float32)
    with pytest.raises(TypeError, match=r"q .*DLPack device 2:0.*CPU only"):
        af.scaled_dot_product_attention(DLPackOnly(x, device=(2, 0)), x, x)  # kDLCUDA
    with pytest.raises(TypeError, match="k .*GPU memory"):
        af.scaled_dot_product_attention(x, CudaArrayInterface(), x)
    with pytest.raises(TypeError, match=r"v \(value\) must be an array, got None"):
        af.scaled_dot_product_attention(x, x, None)


def test_out_read_only_or_wrong_is_an_error():
    q = np.ones((1, 2, 4, 8), np.float32)
    ro = np.empty((1, 2, 4, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        af.scaled_dot_product_attention(q, q, q, out=ArrayInterface(ro))


# --------------------------------------------------------------------- torch

torch = pytest.importorskip("torch", reason="torch not installed (pip install torch==2.13.0)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_torch_tensors_read_in_place(rng, kernel_inputs, dtype):
    # (B, L, H, d) projections read as (B, H, L, d) through strides, as transformers lays them out.
    B, Lq, Lk, H, Hkv, d = 2, 7, 129, 4, 2, 80
    qb = torch.from_numpy(randn(rng, (B, Lq, H, d), np.float64)).to(dtype)
    kb = torch.from_numpy(randn(rng, (B, Lk, Hkv, d), np.float64)).to(dtype)
    vb = torch.from_numpy(randn(rng, (B, Lk, Hkv, d), np.float64)).to(dtype)
    q, k, v = qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2)
    assert not q.is_contiguous()
    o, lse = af.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True, return_lse=True
    )
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)  # torch in, torch out
    assert (
        o.dtype == q.dtype
        and lse.dtype == q.dtype
        and o.shape == (B, H, Lq, d)
        and lse.shape == (B, H, Lq)
    )
    o, lse = o.numpy(), lse.numpy()  # zero-copy views of the same result
    qn, kn, vn = q.numpy(), np.repeat(k.numpy(), 2, axis=1), np.repeat(v.numpy(), 2, axis=1)
    O, LSE = ref.sdpa(qn, kn, vn, mask=ref.causal_mask(Lq, Lk), return_lse=True)
    assert_close(o, O, o.dtype)
    assert_close(lse, LSE, o.dtype)
    rec = kernel_inputs[-1]
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert rec[name] == (t.data_ptr(), tuple(s * t.element_size() for s in t.stride())), name


def test_torch_out_written_in_place(rng, kernel_inputs):
    # A (B, Lq, H, dv) output buffer written through its (B, H, Lq, dv) transpose: no allocation.
    B, H, Lq, Lk, d = 2, 3, 9, 20, 16
    q, k, v = (torch.from_numpy(randn(rng, (B, H, L, d))) for L in (Lq, Lk, Lk))
    buf = torch.from_numpy(poisoned((B, Lq, H, d), np.float32))
    before = buf.data_ptr()
    res = af.scaled_dot_product_attention(q, k, v, out=buf.transpose(1, 2))
    assert isinstance(res, torch.Tensor) and res.data_ptr() == before and buf.data_ptr() == before
    assert kernel_inputs[-1]["o"][0] == before
    expect = ref.sdpa(q.numpy(), k.numpy(), v.numpy())
    assert_close(buf.transpose(1, 2).numpy(), expect, np.float32)
    # A contiguous tensor as out, with lse: the same tensor comes back.
    out = torch.full((B, H, Lq, d), float("nan"))
    res, lse = af.scaled_dot_product_attention(q, k, v, out=out, return_lse=True)
    assert res is out
    assert_close(out.numpy(), expect, np.float32)


def test_torch_requires_grad_policy(rng):
    q = torch.from_numpy(randn(rng, (1, 2, 6, 8))).requires_grad_()
    o = af.scaled_dot_product_attention(q, q, q)  # read through detach(): a tensor with no gradient
    assert isinstance(o, torch.Tensor) and not o.requires_grad
    qd = q.detach().numpy()
    assert_close(o.numpy(), ref.sdpa(qd, qd, qd), np.float32)
    with pytest.raises(TypeError, match="out is a torch tensor that requires grad"):
        af.scaled_dot_product_attention(q, q, q, out=torch.empty(1, 2, 6, 8, requires_grad=True))


def test_torch_errors():
    x = torch.ones(1, 2, 4, 8)
    with pytest.raises(TypeError, match="q is a torch tensor on device meta.*CPU only"):
        af.scaled_dot_product_attention(torch.ones(1, 2, 4, 8, device="meta"), x, x)
    with pytest.raises(TypeError, match="k .*layout torch.sparse_coo"):
        af.scaled_dot_product_attention(x, x.to_sparse(), x)
    # bfloat16 / float16 are supported (tests/test_dtypes.py), not mixed with float32
    with pytest.raises(TypeError, match=r"mixed dtypes .*q bfloat16, k float32"):
        af.scaled_dot_product_attention(x.bfloat16(), x, x)
    with pytest.raises(TypeError, match=r"mixed dtypes .*q float16, k float32"):
        af.scaled_dot_product_attention(x.half(), x, x)
    with pytest.raises(TypeError, match="out has dtype float64"):
        af.scaled_dot_product_attention(x, x, x, out=torch.empty(1, 2, 4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="out has shape"):
        af.scaled_dot_product_attention(x, x, x, out=torch.empty(1, 2, 4, 7))
    with pytest.raises(TypeError, match="out is a torch tensor on device meta"):
        af.scaled_dot_product_attention(x, x, x, out=torch.empty(1, 2, 4, 8, device="meta"))


def test_torch_textbook_api_and_mask(rng):
    X = torch.from_numpy(randn(rng, (10, 8), np.float64))
    W = [torch.from_numpy(randn(rng, (4, 8), np.float64)) for _ in range(3)]
    O = af.attention(X, *W, causal=True)
    assert_close(O, ref.attention(X.numpy(), *(w.numpy() for w in W), causal=True), np.float64)
    # A boolean torch mask (True = attend), broadcast over heads and queries.
    q = torch.from_numpy(randn(rng, (2, 3, 5, 8)))
    keep = torch.from_numpy(rng.random((2, 1, 1, 5)) < 0.7)
    keep[..., 0] = True
    o = af.scaled_dot_product_attention(q, q, q, attn_mask=keep)
    m = np.broadcast_to(keep.numpy(), (2, 3, 5, 5))
    assert_close(o, ref.sdpa(q.numpy(), q.numpy(), q.numpy(), mask=m), np.float32)


def test_as_array_shares_memory_for_torch():
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)[:, ::2]
    a = _checks.as_float_array(t, "q")
    assert a.ctypes.data == t.data_ptr() and a.strides == tuple(s * 4 for s in t.stride())
    t[0, 0, 0] = -1.0  # one memory: a change through torch is seen through the view
    assert a[0, 0, 0] == -1.0


@pytest.mark.parametrize("uint16", [True, False])
def test_bfloat16_tensor_bits_either_way(rng, monkeypatch, uint16):
    """A bfloat16 tensor is read as its uint16 bits, zero-copy, through torch.uint16 where
    this torch converts it to NumPy and through the int16 view where it does not."""
    monkeypatch.setattr(_checks, "_TORCH_FAST", {})
    if not uint16:
        monkeypatch.delattr(torch, "uint16", raising=False)
    t = torch.from_numpy(randn(rng, (2, 3, 5, 8))).bfloat16()
    want = t.view(torch.int16).numpy().view(np.uint16)
    assert _checks._is_torch_tensor(t)  # fast_view reads the tensor types seen so far
    for a in (_checks.fast_view(t)[0], _checks.as_array(t, "q")):
        assert a.dtype == np.uint16 and np.array_equal(a, want)
        assert np.shares_memory(a, want)
    if not uint16:  # the fallback was taken
        assert _checks._TORCH_FAST["bits"].__name__ == "as_int16"
    q, k, v = (torch.from_numpy(randn(rng, (1, 2, n, 8))).bfloat16() for n in (3, 9, 9))
    got = af.scaled_dot_product_attention(q, k, v)
    assert got.dtype == torch.bfloat16
    O = ref.sdpa(*(x.float().numpy().astype(np.float64) for x in (q, k, v)))
    assert_close(got.float().numpy(), O, np.float32, rtol=2e-2, atol=2e-2)
