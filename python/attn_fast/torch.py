"""attn_fast as a differentiable torch op (``import attn_fast.torch``).

    import attn_fast.torch as aft
    out = aft.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()   # the fused FlashAttention-2 backward

``scaled_dot_product_attention`` mirrors ``torch.nn.functional.
scaled_dot_product_attention``; it is one ``torch.library.custom_op``
(``attn_fast::sdpa``, returning out and lse) with ``register_fake`` (shapes,
so torch.compile traces it with ``fullgraph=True``) and ``register_autograd``,
whose backward is a second custom op (``attn_fast::sdpa_backward``). Works
under ``torch.func.grad``; ``vmap`` is not supported.

Dtypes: CPU float32, float64, float16 and bfloat16 tensors (q, k, v of one
dtype). The output and the gradients of q, k, v have the input dtype; 16-bit
calls compute in float32 (attn_fast's 16-bit forward and backward: fp32
accumulation, one rounding of each result) and their internal lse is
float32. ALiBi slopes and sinks are used in float32 for 16-bit inputs; the
gradient of sinks comes back in the sinks tensor's own dtype.

Differences from torch's function, on purpose:
  * ``is_causal`` follows torch: aligned **top-left** (query i sees keys
    j <= i). attn_fast's NumPy ``scaled_dot_product_attention`` aligns
    bottom-right (j <= i + Lk - Lq); the two agree when Lq == Lk.
  * ``attn_mask`` and ``is_causal`` may be given together (intersection).
  * rows that see no key give 0 (torch gives NaN), with zero gradient.
  * ``dropout_p > 0`` raises ValueError (no dropout).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from . import _core
from . import masks as _masks
from .backward import scaled_dot_product_attention_backward as _np_backward
from .functional import _PLANS
from .functional import scaled_dot_product_attention as _np_sdpa

__all__ = ["scaled_dot_product_attention"]

_OPTIONS = ("window_size", "softcap", "alibi_slopes", "sinks")


_planned_call = _core.run_plan  # a name of its own: tests switch it off

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, torch.float64) + _HALF


def _np(t):
    """A tensor as the NumPy layer reads it: a NumPy view of its memory, or for
    bfloat16 (no NumPy dtype) the tensor itself, which the layer reads zero-copy."""
    if t is None:
        return None
    t = t.detach()
    return t if t.dtype == torch.bfloat16 else t.numpy()


def _tensor(x):
    """A NumPy layer result as a tensor (bfloat16 results already are one)."""
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))


def _compute_dtype(dtype):
    """What lse, slopes, sinks and dsinks use for inputs of `dtype`: float32 for 16-bit."""
    return torch.float32 if dtype in _HALF else dtype


# The nine options that follow q, k, v in both ops (after dout, q, k, v, out, lse in the
# backward), in this order everywhere: the schemas, _kwargs, the autograd context. An op's
# body takes them as *opts.
_OPTS_SCHEMA = (
    "Tensor? attn_mask, bool is_causal, float scale, bool enable_gqa, SymInt window_left, "
    "SymInt window_right, float softcap, Tensor? alibi_slopes, Tensor? sinks"
)
_N_OPTS = _OPTS_SCHEMA.count(",") + 1


def _kwargs(
    attn_mask, is_causal, scale, enable_gqa, window_left, window_right, softcap, alibi_slopes, sinks
):
    """The options as the NumPy layer's keyword arguments."""
    masks = []
    if attn_mask is not None:  # a 16-bit additive mask is exact in float32
        masks.append(_np(attn_mask.float() if attn_mask.dtype in _HALF else attn_mask))
    if is_causal:
        masks.append(_masks.Causal("top_left"))
    kw = dict(
        attn_mask=masks or None,
        scale=scale,
        enable_gqa=enable_gqa,
        alibi_slopes=_np(alibi_slopes),
        sinks=_np(None if sinks is None else sinks.to(_compute_dtype(sinks.dtype))),
    )
    if window_left >= 0 or window_right >= 0:
        kw["window_size"] = (window_left, window_right)
    if softcap > 0:
        kw["softcap"] = softcap
    return kw


def _sdpa_impl(q, k, v, *opts, want_lse=True):
    """The forward on the NumPy layer: (out, lse), lse None unless want_lse (the op wants
    it for its backward; the direct call of an inference step does not). The kernel
    writes the same out either way."""
    kw = _kwargs(*opts)
    if not want_lse:
        return _tensor(_np_sdpa(_np(q), _np(k), _np(v), **kw)), None
    out, lse = _np_sdpa(_np(q), _np(k), _np(v), return_lse=True, **kw)
    return _tensor(out), _tensor(lse)


@torch.library.custom_op(
    "attn_fast::sdpa",
    mutates_args=(),
    device_types="cpu",
    schema=f"(Tensor q, Tensor k, Tensor v, {_OPTS_SCHEMA}) -> (Tensor, Tensor)",
)
def _sdpa_op(q, k, v, *opts):
    return _sdpa_impl(q, k, v, *opts)


def _direct_ok(tensors: tuple) -> bool:
    """Whether a call may run ``_sdpa_impl`` directly instead of through the op.

    The op's dispatcher, autograd wrapper and schema checks cost more than a
    one-token decode kernel (about 100 µs per call, bench/benchmarks/bench_latency.py).
    They do nothing for plain CPU tensors outside any tracing, transform or
    mode when no gradient will be asked for: then the direct call gives the
    same out and raises the same errors (it is the op's own body). Anything
    else (torch.compile / export tracing, functorch transforms, dispatch or
    torch-function modes, tensor subclasses such as FakeTensor, tensors off
    the CPU, a tensor that requires grad with grad mode on) takes the op.
    """
    if (
        torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
    ):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (
            type(t) is not torch.Tensor or not t.is_cpu or (grad and t.requires_grad)
        ):
            return False
    return True


@_sdpa_op.register_fake
def _(q, k, v, *opts):
    lse = q.new_empty(q.shape[:-1], dtype=_compute_dtype(q.dtype))
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), lse


@torch.library.custom_op(
    "attn_fast::sdpa_backward",
    mutates_args=(),
    device_types="cpu",
    schema=(
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        f"{_OPTS_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
)
def _sdpa_backward_op(dout, q, k, v, out, lse, *opts):
    sinks = opts[-1]
    res = _np_backward(_np(dout), _np(q), _np(k), _np(v), _np(out), _np(lse), **_kwargs(*opts))
    dsinks = res[3] if sinks is not None else torch.zeros(0, dtype=_compute_dtype(q.dtype))
    return tuple(_tensor(x) for x in (res[0], res[1], res[2], dsinks))


@_sdpa_backward_op.register_fake
def _(dout, q, k, v, out, lse, *opts):
    sinks = opts[-1]
    ns = sinks.shape[0] if sinks is not None else 0
    dsinks = q.new_empty((ns,), dtype=_compute_dtype(q.dtype))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, is_causal, scale, enable_gqa, wl, wr, softcap, alibi, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, alibi, sinks)
    ctx.opts = (is_causal, scale, enable_gqa, wl, wr, softcap)
    ctx.mark_non_differentiable(lse)  # internal output: the public function drops it


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_mask, alibi, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _sdpa_backward_op(
        dout.contiguous(), q, k, v, out, lse, attn_mask, *ctx.opts, alibi, sinks
    )
    # No gradient for the options but sinks (the last).
    return (
        (dq, dk, dv)
        + (None,) * (_N_OPTS - 1)
        + (dsinks.to(sinks.dtype) if sinks is not None else None,)
    )


_sdpa_op.register_autograd(_backward, setup_context=_setup_context)


class _SdpaFunction(torch.autograd.Function):
    """The same op and backward as an autograd.Function with setup_context:
    the form torch.func transforms (grad, vjp) accept (custom ops' generated
    autograd functions are refused there in torch 2.13)."""

    @staticmethod
    def forward(*args):
        return _sdpa_op(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, dout, dlse):
        with torch.no_grad():  # first order only: the backward op has no autograd formula
            return _backward(ctx, dout, dlse)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | Any | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **attn_fast_options: Any,
) -> torch.Tensor:
    """torch's ``scaled_dot_product_attention`` on attn_fast's fused CPU kernels, differentiable.

    query (…, Hq, Lq, d), key (…, Hkv, Lk, d), value (…, Hkv, Lk, dv): CPU
    tensors of one dtype (float32, float64, float16 or bfloat16), 2-D to
    4-D, any strides; GQA with ``enable_gqa=True`` (Hq % Hkv == 0, no
    repeat). Mixed dtypes raise TypeError with a cast hint.

    attn_mask : None, a boolean tensor (True = attend) or an additive float
        tensor broadcastable to (…, Hq, Lq, Lk), no gradient; or an
        ``attn_fast.masks`` object, materialised here as a dense boolean
        mask (O(Lq·Lk) bytes per batch and head).

    dropout_p : must be 0 (ValueError otherwise).
    is_causal : top-left aligned, as torch (see the module docstring).
    scale : default 1/sqrt(d).

    attn_fast_options : ``window_size`` (left, right) (bottom-right aligned,
        as in attn_fast), ``softcap`` (float), ``alibi_slopes`` (Hq,) (no
        gradient), ``sinks`` (Hq,) logits (with gradient).

    Returns out (…, Hq, Lq, dv), a new tensor of query's dtype. Gradients
    flow to query, key, value (in their dtype) and sinks. 16-bit inputs are
    computed in float32 and each result rounded once (see the module
    docstring).
    """
    if (
        attn_mask is None
        and not attn_fast_options
        and is_causal is False
        and dropout_p == 0.0
        and not torch.compiler.is_compiling()  # the C call below is opaque to tracing
    ):
        # The plain inference call (a decode step's): the direct call below without the
        # option handling. The NumPy layer checks the tensors and keeps a plan of them;
        # once it has one, the planned call runs in C (the same views, kernel call and
        # result; None when the tensors or torch's modes need the checks).
        if scale is not None and type(scale) is not float:
            scale = float(scale)
        enable_gqa = bool(enable_gqa)
        out = _planned_call(_PLANS, query, key, value, False, enable_gqa, scale)
        if out is not None:
            return out
        if (
            type(query) is torch.Tensor
            and type(key) is torch.Tensor
            and type(value) is torch.Tensor
            and query.dtype in _FLOATS
            and key.dtype in _FLOATS
            and value.dtype in _FLOATS
            and _direct_ok((query, key, value))
        ):
            return _np_sdpa(query, key, value, scale=scale, enable_gqa=enable_gqa)
    unknown = set(attn_fast_options) - set(_OPTIONS)
    if unknown:
        raise TypeError(
            f"unexpected keyword arguments {sorted(unknown)}; attn_fast options are "
            f"{list(_OPTIONS)}"
        )
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0 (attn_fast has no dropout), got {dropout_p}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(attn_mask, _masks.Mask):
        attn_mask = _dense_mask(attn_mask, query, key)
    elif attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        attn_mask = torch.as_tensor(np.asarray(attn_mask))
    if attn_mask is not None and attn_mask.requires_grad:
        attn_mask = attn_mask.detach()
    d = query.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    window = attn_fast_options.get("window_size")
    wl, wr = (-1, -1)
    if window is not None:
        wl, wr = (-1 if w is None else int(w) for w in window)
    softcap = attn_fast_options.get("softcap")
    alibi = attn_fast_options.get("alibi_slopes")
    sinks = attn_fast_options.get("sinks")
    cdt = _compute_dtype(query.dtype)  # float32 slopes and sinks for 16-bit queries
    if alibi is not None:
        alibi = torch.as_tensor(alibi, dtype=cdt).detach()
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        sinks = torch.as_tensor(sinks, dtype=cdt)
    args = (
        query,
        key,
        value,
        attn_mask,
        bool(is_causal),
        scale,
        bool(enable_gqa),
        wl,
        wr,
        float(softcap) if softcap is not None else 0.0,
        alibi,
        sinks,
    )
    if _direct_ok((query, key, value, attn_mask, alibi, sinks)):
        if (
            attn_mask is None
            and not args[4]  # is_causal (top-left: a one-row query would see key 0 only)
            and wl == wr == -1
            and not args[9]  # softcap
            and alibi is None
            and sinks is None
            and query.dtype in _FLOATS
            and key.dtype in _FLOATS
            and value.dtype in _FLOATS
        ):
            # Nothing for _kwargs to translate: the NumPy layer on the tensors themselves
            # (read zero-copy, a tensor back), what _sdpa_impl computes without its views.
            return _np_sdpa(query, key, value, scale=scale, enable_gqa=args[6])
        return _sdpa_impl(*args, want_lse=False)[0]
    if torch._C._are_functorch_transforms_active():
        out, _ = _SdpaFunction.apply(*args)
    else:
        out, _ = _sdpa_op(*args)
    return out


def _dense_mask(mask, query, key):
    """A masks.Mask object as a dense boolean tensor (B, Hq, Lq, Lk)."""
    Lq, Lk = query.shape[-2], key.shape[-2]
    B = query.shape[0] if query.dim() == 4 else 1
    H = query.shape[-3] if query.dim() >= 3 else 1
    cdt = _compute_dtype(query.dtype)
    args = mask.kernel_args(B=B, H=H, Lq=Lq, Lk=Lk, dtype=np.dtype(str(cdt).replace("torch.", "")))
    vis = _masks.visibility(args, B, H, Lq, Lk)
    vis = np.ascontiguousarray(np.broadcast_to(vis, (B, H, Lq, Lk)))
    return torch.from_numpy(vis[(0,) * (4 - query.dim())])
