"""attn_fast.torch: the differentiable custom op (forward, backward, gradcheck,
torch.compile, torch.func) against torch's own scaled_dot_product_attention."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attn_fast.torch as aft  # noqa: E402
from attn_fast import masks  # noqa: E402

F = torch.nn.functional


def _qkv(seed, B, Hq, Hkv, Lq, Lk, d, dv, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return mk(B, Hq, Lq, d), mk(B, Hkv, Lk, d), mk(B, Hkv, Lk, dv)


def _grads(fn, q, k, v, seed=0):
    out = fn(q, k, v)
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["none", "causal_top_left", "bool_mask", "additive_mask", "gqa"])
def test_matches_torch_sdpa(isa, case, dtype):
    Lq, Lk = (13, 21) if case != "causal_top_left" else (21, 13)
    Hkv = 1 if case == "gqa" else 2
    q, k, v = _qkv(1, 2, 2, Hkv, Lq, Lk, 8, 6, dtype)
    kw = {}
    if case == "causal_top_left":
        kw["is_causal"] = True
    if case == "bool_mask":
        kw["attn_mask"] = torch.rand(2, 1, Lq, Lk, generator=torch.Generator().manual_seed(3)) < 0.7
        kw["attn_mask"][..., 0] = True  # torch gives NaN on rows that see nothing
    if case == "additive_mask":
        kw["attn_mask"] = torch.randn(1, 2, Lq, Lk, dtype=dtype)
    if case == "gqa":
        kw["enable_gqa"] = True
    got = _grads(lambda q, k, v: aft.scaled_dot_product_attention(q, k, v, **kw), q, k, v)
    want = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw), q, k, v)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


def _gradcheck_case(case, Lq, Lk, H):
    if case == "none":
        return {}
    if case == "causal":
        return {"is_causal": True}
    if case == "bool_mask":
        m = torch.rand(1, H, Lq, Lk, generator=torch.Generator().manual_seed(5)) < 0.6
        m[0, 0, 1] = False  # a fully masked row: zero output and gradient
        return {"attn_mask": m}
    if case == "additive_mask":
        b = torch.randn(
            1, H, Lq, Lk, dtype=torch.float64, generator=torch.Generator().manual_seed(6)
        )
        b[0, 0, 0, 2] = -float("inf")
        return {"attn_mask": b}
    if case == "window":
        return {"window_size": (2, 1)}
    if case == "padding":
        return {"attn_mask": masks.Padding([Lk - 2], [Lq - 1])}
    if case == "block_sparse":
        return {"attn_mask": masks.BlockSparse(np.array([[True, False], [True, True]]), 3, 4)}
    if case == "softcap":
        return {"softcap": 1.5, "is_causal": True}
    if case == "alibi":
        return {"alibi_slopes": torch.tensor([0.5, 0.25], dtype=torch.float64)}
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "none",
        "causal",
        "bool_mask",
        "additive_mask",
        "window",
        "padding",
        "block_sparse",
        "softcap",
        "alibi",
        "sinks",
    ],
)
def test_gradcheck_float64(case):
    Lq, Lk, H = 5, 7, 2
    q, k, v = _qkv(2, 1, H, H, Lq, Lk, 3, 2)
    if case == "sinks":
        sinks = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)

        def fn(q, k, v, s):
            return aft.scaled_dot_product_attention(q, k, v, is_causal=True, sinks=s)

        assert torch.autograd.gradcheck(fn, (q, k, v, sinks))
        return
    kw = _gradcheck_case(case, Lq, Lk, H)
    assert torch.autograd.gradcheck(
        lambda q, k, v: aft.scaled_dot_product_attention(q, k, v, **kw), (q, k, v)
    )


def test_gradcheck_gqa_lq_ne_lk_dv_ne_d():
    q, k, v = _qkv(4, 2, 4, 2, 6, 3, 4, 2)
    assert torch.autograd.gradcheck(
        lambda q, k, v: aft.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        (q, k, v),
    )


def test_torch_compile_fullgraph():
    q, k, v = _qkv(7, 1, 2, 2, 9, 9, 4, 4)

    def f(q, k, v):
        return (aft.scaled_dot_product_attention(q, k, v, is_causal=True) ** 2).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_torch_func_grad():
    q, k, v = _qkv(8, 1, 2, 2, 6, 8, 4, 3)
    g = torch.func.grad(
        lambda q, k: aft.scaled_dot_product_attention(q, k, v).sum(), argnums=(0, 1)
    )(q, k)
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v).sum(), (q, k))
    for a, b in zip(g, want):
        torch.testing.assert_close(a, b)


def test_opcheck():
    q, k, v = _qkv(9, 1, 2, 2, 5, 6, 4, 3)
    torch.library.opcheck(
        torch.ops.attn_fast.sdpa.default, (q, k, v, None, True, 0.5, False, -1, -1, 0.0, None, None)
    )


def test_errors():
    q, k, v = _qkv(10, 1, 1, 1, 3, 3, 2, 2)
    with pytest.raises(ValueError, match="dropout_p"):
        aft.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        aft.scaled_dot_product_attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        aft.scaled_dot_product_attention(q.detach().numpy(), k, v)
