"""flash_attn_func and its packed forms: (B, L, H, d) tensors, forward and backward."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from .. import _dispatch
from .._args import score_args as _score_args
from ..backward import scaled_dot_product_attention_backward as _sdpa_backward
from ._common import (
    Opts,
    alibi_split,
    call,
    check_call,
    define_op,
    flash_returns,
    lse_dtype,
    mask_args,
    no_lse,
    np4,
    register_backward,
    transposed_like,
    unpack,
)

# ---------------------------------------------------------------- (B, L, H, d) forward / backward


def _t(x: torch.Tensor) -> torch.Tensor:
    """(B, L, H, d) -> (B, H, L, d): a view."""
    return x.detach().transpose(1, 2)


def _batches(alibi: torch.Tensor | None, B: int):
    """(slice, slopes) per kernel call: one call for all, or one per batch entry when the
    ALiBi rows differ."""
    shared, rows = alibi_split(alibi)
    if rows is None:
        return [(slice(None), shared)]
    return [(slice(b, b + 1), rows[b]) for b in range(B)]


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],  # noqa: UP045 (custom_op reads it at run time)
    need_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel chosen by ``_dispatch.choose_kernel`` on (B, H, L, d) views, writing a new
    (B, Lq, H, dv) out through its transpose; what ``attn_fast.scaled_dot_product_attention``
    runs for the same arguments, without its argument parsing. lse (B, H, Lq), or None
    when not need_lse."""
    opts = Opts.from_op(scale, causal, window_left, window_right, softcap)
    B, Lq, H, _ = q.shape
    out = torch.empty((B, Lq, H, v.shape[-1]), dtype=q.dtype)
    lse = torch.empty((B, H, Lq), dtype=lse_dtype(q.dtype)) if need_lse else None
    if not out.numel() and not (need_lse and lse.numel()):
        return out, lse
    q4, k4, v4, o4 = np4(q, "q"), np4(k, "k"), np4(v, "v"), np4(out, "out")
    lse4 = lse.numpy() if need_lse else None
    cdt = np.float64 if q.dtype == torch.float64 else np.float32
    mask = mask_args(opts)
    for sl, slopes in _batches(alibi_slopes, B):
        score = _score_args(H, cdt, opts.softcap, slopes, None)
        kernel = _dispatch.choose_kernel(Lq=Lq, Lk=k.shape[1], mask=mask, score=score)
        _dispatch.attend(
            kernel,
            q4[sl],
            k4[sl],
            v4[sl],
            o4[sl],
            None if lse4 is None else lse4[sl],
            scale=opts.scale,
            mask=mask,
            score=score,
        )
    return out, lse


def _backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],  # noqa: UP045 (custom_op reads it at run time)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv: new (B, L, H, d) tensors in the transposed (B, H, L, d) layout."""
    opts = Opts.from_op(scale, causal, window_left, window_right, softcap)
    grads = [transposed_like(t) for t in (q, k, v)]
    if not any(g.numel() for g in grads):
        return tuple(grads)
    batches = _batches(alibi_slopes, q.shape[0])
    for sl, slopes in batches:
        g = _sdpa_backward(
            _t(dout[sl]),
            _t(q[sl]),
            _t(k[sl]),
            _t(v[sl]),
            _t(out[sl]),
            lse[sl],
            is_causal=opts.causal,
            enable_gqa=True,
            alibi_slopes=slopes,
            **opts.sdpa_kw(),
        )
        if len(batches) == 1:
            return tuple(x.transpose(1, 2) for x in g[:3])
        for dst, src in zip(grads, g):
            dst[sl] = src.transpose(1, 2)
    return tuple(grads)


_forward_op = define_op("flash_attn_fwd", _forward)
_backward_op = define_op("flash_attn_bwd", _backward)


@_forward_op.register_fake
def _(q, k, v, scale, causal, window_left, window_right, softcap, alibi_slopes, need_lse):
    B, Lq, H, _ = q.shape
    lse = q.new_empty((B, H, Lq), dtype=lse_dtype(q.dtype)) if need_lse else no_lse(q)
    return q.new_empty((B, Lq, H, v.shape[-1])), lse


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, scale, causal, window_left, window_right, softcap, alibi_slopes):
    return tuple(transposed_like(t) for t in (q, k, v))


register_backward(_forward_op, _backward_op, n_forward_only=1)


def _attn_dense(q, k, v, flash, return_attn_probs, names=("q", "k", "v")):
    """The flash-attn dense call on (B, L, H, d) q, k, v; flash: the public function's
    (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)."""
    opts, alibi, need_lse = check_call(
        names,
        (q, k, v),
        ("(batch_size, seqlen, nheads, headdim)",) * 2,
        flash,
        lambda: q.shape[0],
        return_attn_probs,
    )
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"q has shape {tuple(q.shape)} but k has {tuple(k.shape)}: batch differs")
    args = (q, k, v, *opts.op_args(), alibi, need_lse)
    out, lse = call(_forward_op, _forward, (q, k, v, alibi), *args)
    return flash_returns(out, lse, return_attn_probs)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_func`` on the CPU, differentiable.

    Parameters
    ----------
    q, k, v : (B, Lq, H, d), (B, Lk, H_kv, d), (B, Lk, H_kv, dv) tensors
        CPU float16 / bfloat16 / float32 (float64) tensors of one dtype, any
        strides (read in place). H % H_kv == 0 (MQA / GQA).
    dropout_p : must be 0.0 (ValueError otherwise: no dropout here).
    softmax_scale : default 1 / sqrt(d).
    causal : bottom-right aligned: query i sees keys j <= i + Lk - Lq.
    window_size : (left, right), -1 = unbounded: query i sees keys in
        [i + Lk - Lq - left, i + Lk - Lq + right].
    softcap : > 0 scores become softcap * tanh(score / softcap); 0 = off.
    alibi_slopes : (H,) or (B, H)
        bias ``-slope * abs(i + Lk - Lq - j)`` (no gradient).
    deterministic : accepted (the backward is always deterministic).
    return_attn_probs : also return softmax_lse (B, H, Lq) float32 and S_dmask
        (an empty tensor: flash-attn 2 fills it only with dropout).

    Returns
    -------
    out (B, Lq, H, dv), a new contiguous tensor of q's dtype (rows that
    see no key: 0), or (out, softmax_lse, S_dmask). Gradients flow to q, k, v.
    """
    return _attn_dense(
        q,
        k,
        v,
        (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes),
        return_attn_probs,
    )


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """``flash_attn_func`` with kv (B, Lk, 2, H_kv, d) packed: k = kv[:, :, 0] and
    v = kv[:, :, 1] are read as views. Same options and returns; the gradient of
    kv is assembled from dk and dv."""
    k, v = unpack(kv, "kv", 2, 2, "(batch_size, seqlen, 2, nheads_k, headdim)")
    return _attn_dense(
        q,
        k,
        v,
        (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes),
        return_attn_probs,
        names=("q", "kv[:, :, 0]", "kv[:, :, 1]"),
    )


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """``flash_attn_func`` with qkv (B, L, 3, H, d) packed (q, k, v as views; same
    number of heads). Same options and returns; the gradient of qkv is assembled
    from dq, dk, dv."""
    return _attn_dense(
        *unpack(qkv, "qkv", 2, 3, "(batch_size, seqlen, 3, nheads, headdim)"),
        (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes),
        return_attn_probs,
        names=("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"),
    )
