"""attn_fast.torch in bfloat16 and float16: the differentiable op's outputs and
gradients against the float64 oracle on the same 16-bit inputs, against torch's
own 16-bit SDPA backward, its fake (meta) shapes and dtypes, and a tiny bf16
training loop. torch.autograd.gradcheck needs float64, so the 16-bit checks
are comparisons; tolerances in units of the dtype's unit roundoff u."""

from __future__ import annotations

import numpy as np
import oracle
import pytest

torch = pytest.importorskip("torch")

import attn_fast.torch as aft  # noqa: E402
from attn_fast import masks  # noqa: E402
from attn_fast import reference as ref  # noqa: E402

F = torch.nn.functional
DTYPES = [torch.bfloat16, torch.float16]
U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # |x - round(x)| <= u |x|


def _qkv(seed, B, Hq, Hkv, Lq, Lk, d, dv, dtype):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return mk(B, Hq, Lq, d), mk(B, Hkv, Lk, d), mk(B, Hkv, Lk, dv)


def f64(t):
    return t.detach().double().numpy()


def _case(case, Lq, Lk, H, dtype):
    """(op kwargs, oracle kwargs) for one mask / score option (torch's is_causal: top-left)."""
    g = torch.Generator().manual_seed(11)
    if case == "none":
        return {}, {}
    if case == "causal_top_left":
        return {"is_causal": True}, {"mask": ref.causal_mask(Lq, Lk, "top_left")}
    if case == "bool_mask":
        m = torch.rand(2, 1, Lq, Lk, generator=g) < 0.6
        m[0, 0, 1] = False  # a fully masked row: zero output and gradient
        return {"attn_mask": m}, {"mask": m.numpy()}
    if case == "additive_mask":  # in the input dtype, as torch takes it
        b = torch.randn(1, H, Lq, Lk, generator=g).to(dtype)
        return {"attn_mask": b}, {"bias": f64(b)}
    if case == "window":
        return {"window_size": (3, 1)}, {"mask": ref.window_mask(Lq, Lk, 3, 1)}
    if case == "padding":
        return {"attn_mask": masks.Padding([Lk - 2, Lk], [Lq - 1, Lq])}, {
            "mask": (np.arange(Lq)[:, None] < np.array([Lq - 1, Lq])[:, None, None, None])
            & (np.arange(Lk) < np.array([Lk - 2, Lk])[:, None, None, None])
        }
    if case == "softcap":
        return {"softcap": 1.5, "is_causal": True}, {
            "softcap": 1.5,
            "mask": ref.causal_mask(Lq, Lk, "top_left"),
        }
    if case == "alibi":
        slopes = torch.rand(H, generator=g)
        dist = np.abs(np.arange(Lq)[:, None] + Lk - Lq - np.arange(Lk)[None, :])
        return {"alibi_slopes": slopes}, {"bias": -slopes.double().numpy()[:, None, None] * dist}
    raise AssertionError(case)


CASES = [
    "none",
    "causal_top_left",
    "bool_mask",
    "additive_mask",
    "window",
    "padding",
    "softcap",
    "alibi",
]


def _close(got, want, dtype, what, spread=0.25):
    """|g - w| <= u |w| + spread u max|w| (one rounding of an fp32-accurate value)."""
    u = U[dtype]
    g = f64(got)
    big = float(np.abs(want).max(initial=0.0))
    bad = ~(np.abs(g - want) <= u * np.abs(want) + spread * u * big + 1e-30)
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} off, max {np.abs(g - want).max():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_outputs_and_gradients_match_oracle(isa, case, dtype):
    B, H, Hkv, Lq, Lk, d, dv = 2, 4, 2, 13, 21, 16, 8
    q, k, v = _qkv(1, B, H, Hkv, Lq, Lk, d, dv, dtype)
    kw, ora = _case(case, Lq, Lk, H, dtype)
    out = aft.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    assert out.dtype == dtype and out.shape == (B, H, Lq, dv)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    dq, dk, dv_ = torch.autograd.grad(out, (q, k, v), do)
    for g, x in zip((dq, dk, dv_), (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape
    kk, vv = (np.repeat(f64(x), H // Hkv, axis=1) for x in (k, v))
    O = ref.sdpa(f64(q), kk, vv, **ora)
    # the forward: one rounding of O plus fp32 accumulation
    # (and, for bf16 on avx512_bf16, P rounded to bf16 for P V: within 2 u max|O|)
    _close(out, O, dtype, "out", spread=2.0)
    # the backward given its own inputs (the 16-bit O included): one rounding per gradient
    want = oracle.sdpa_backward(f64(q), f64(k), f64(v), f64(do), out=f64(out), **ora)
    for name, g in zip(("dq", "dk", "dv"), (dq, dk, dv_)):
        _close(g, want[name], dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_gradient_in_the_sinks_dtype(isa, dtype):
    H, Lq, Lk = 2, 9, 11
    q, k, v = _qkv(3, 1, H, H, Lq, Lk, 8, 8, dtype)
    for sdt in (dtype, torch.float32):
        sinks = torch.tensor([0.3, -0.7], dtype=sdt, requires_grad=True)
        out = aft.scaled_dot_product_attention(q, k, v, is_causal=True, sinks=sinks)
        do = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
        dq, ds = torch.autograd.grad(out, (q, sinks), do)
        assert dq.dtype == dtype and ds.dtype == sdt
        s64 = sinks.detach().double().numpy()  # the op uses the sinks' values in float32
        mask = ref.causal_mask(Lq, Lk, "top_left")
        want = oracle.sdpa_backward(
            f64(q), f64(k), f64(v), f64(do), out=f64(out), mask=mask, sinks=s64
        )
        # dsinks is fp32-accurate; rounded to the sinks' dtype when that is 16-bit
        u = U[dtype] if sdt == dtype else 1e-5
        np.testing.assert_allclose(f64(ds), want["dsinks"], rtol=2 * u, atol=1e-5)
        _close(dq, want["dq"], dtype, "dq")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_error_within_1p5x_of_torch(isa, dtype, causal):
    """End to end (each library's own forward), against the float64 oracle on the same
    16-bit inputs: the RMS error of our gradients is at most 1.5x torch's."""
    q, k, v = _qkv(5, 2, 4, 4, 129, 129, 64, 64, dtype)
    do = torch.randn(2, 4, 129, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    ours = torch.autograd.grad(
        aft.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), do
    )
    theirs = torch.autograd.grad(
        F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), do
    )
    mask = ref.causal_mask(129, 129) if causal else None
    want = oracle.sdpa_backward(f64(q), f64(k), f64(v), f64(do), mask=mask)
    for name, a, b in zip(("dq", "dk", "dv"), ours, theirs):
        assert a.dtype == b.dtype == dtype
        e_ours, e_torch = f64(a) - want[name], f64(b) - want[name]
        assert np.sqrt(np.mean(e_ours**2)) <= 1.5 * np.sqrt(np.mean(e_torch**2)), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    """The fake (meta) kernels give the real ones' shapes and dtypes (lse and dsinks in
    float32 for 16-bit inputs), and the autograd registration holds."""
    q, k, v = _qkv(9, 1, 2, 2, 5, 6, 4, 3, dtype)
    sinks = torch.tensor([0.2, -0.1], requires_grad=True)
    args = (q, k, v, None, True, 0.5, False, -1, -1, 0.0, None, sinks)
    torch.library.opcheck(torch.ops.attn_fast.sdpa.default, args)
    out, lse = torch.ops.attn_fast.sdpa.default(*args)
    assert out.dtype == dtype and lse.dtype == torch.float32
    do = torch.ones_like(out)
    bargs = (do, q.detach(), k.detach(), v.detach(), out.detach(), lse, None, True, 0.5, False)
    bargs += (-1, -1, 0.0, None, sinks.detach())
    torch.library.opcheck(torch.ops.attn_fast.sdpa_backward.default, bargs)
    dq, dk, dv, ds = torch.ops.attn_fast.sdpa_backward.default(*bargs)
    assert (dq.dtype, dk.dtype, dv.dtype, ds.dtype) == (dtype, dtype, dtype, torch.float32)


def test_torch_compile_fullgraph_bf16():
    q, k, v = _qkv(7, 1, 2, 2, 9, 9, 8, 8, torch.bfloat16)

    def f(q, k, v):
        return (aft.scaled_dot_product_attention(q, k, v, is_causal=True).float() ** 2).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_mixed_dtypes_raise_with_cast_hint():
    q, k, v = _qkv(10, 1, 1, 1, 3, 3, 2, 2, torch.bfloat16)
    with pytest.raises(TypeError, match=r"mixed dtypes.*k float32.*x\.to\(q\.dtype\)"):
        aft.scaled_dot_product_attention(q, k.float(), v)
    with pytest.raises(TypeError, match="mixed dtypes"):
        aft.scaled_dot_product_attention(q, k, v.half())


def test_training_loop_in_bf16_decreases_the_loss():
    """A one-layer attention model, weights and activations in bfloat16, plain SGD: the
    loss (computed in float32) falls well below where it started."""
    g = torch.Generator().manual_seed(12)
    B, L, D, H = 4, 16, 32, 4
    X = torch.randn(B, L, D, generator=g).bfloat16()
    Y = torch.randn(B, L, D, generator=g)  # a fixed target, float32
    W = [(torch.randn(D, D, generator=g) / D**0.5).bfloat16().requires_grad_() for _ in range(4)]
    opt = torch.optim.SGD(W, lr=0.5)

    def heads(t):
        return t.view(B, L, H, D // H).transpose(1, 2)

    losses = []
    for _ in range(40):
        q, k, v = (heads(X @ w) for w in W[:3])
        o = aft.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert o.dtype == torch.bfloat16
        pred = o.transpose(1, 2).reshape(B, L, D) @ W[3]
        loss = F.mse_loss(pred.float(), Y)
        opt.zero_grad()
        loss.backward()
        assert all(w.grad.dtype == torch.bfloat16 and torch.isfinite(w.grad).all() for w in W)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    assert min(losses[-5:]) < min(losses[:5]), losses


def test_torch_func_grad_bf16():
    q, k, v = _qkv(13, 1, 2, 2, 6, 8, 4, 4, torch.bfloat16)
    g = torch.func.grad(lambda q: aft.scaled_dot_product_attention(q, k, v).float().sum())(q)
    want = torch.autograd.grad(aft.scaled_dot_product_attention(q, k, v).float().sum(), q)[0]
    assert g.dtype == torch.bfloat16
    torch.testing.assert_close(g, want, rtol=0, atol=0)
