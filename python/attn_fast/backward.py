"""Gradients of scaled_dot_product_attention and varlen_attention.

The fused FlashAttention-2 backward (csrc/kernels/flash_bwd.cpp): from the
forward's output ``out`` and log-sum-exp ``lse`` and the upstream gradient
``dout`` it recomputes the scores tile by tile (P = exp(S - lse)) and returns
dq, dk, dv (and dsinks), in O(L) memory, bit-identical for any thread count.

Every mask and score option of the forward is accepted with the same meaning
(masks get no gradient). ``out`` and ``lse`` may come from elsewhere: ring
attention passes the *global* out and lse with one block of the keys, and the
result is then that key block's contribution (dq to be summed over blocks;
dk, dv of the block's keys).

Dtypes: float32 and float64, and the 16-bit float16 and bfloat16 (NumPy
float16, torch.float16 / torch.bfloat16 tensors, ``ml_dtypes.bfloat16``
arrays) as in the forward. For 16-bit q, k, v, dout and out (one dtype) the
kernel computes in float32 (the fp32 backward on widened values) and rounds
dq, dk, dv to the input dtype once at the end; lse is float32 (what the
forward's ``return_lse`` gives), and so are dsinks, ALiBi slopes and sinks.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from numpy.typing import ArrayLike

from . import _dispatch, masks
from ._args import block_size, check_varlen, half_mask, mask_args, score_args, varlen_args
from ._checks import (
    HALF_DTYPES,
    as_float_array,
    check_bool,
    check_qkv,
    check_same_dtype,
    check_scale,
    compute_dtype,
    dtype_name,
    shape_str,
    to4,
    to_input_kind,
)

__all__ = ["scaled_dot_product_attention_backward", "varlen_attention_backward"]


class _Grads:
    """dq, dk, dv (new arrays of q's dtype) and dsinks when there are sinks (q's
    compute dtype: float32 for 16-bit q), written by the kernel (``run``) or
    zero when there is nothing to compute."""

    def __init__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, Hq: int, sinks: Any) -> None:
        self.arrays = [np.empty(x.shape, q.dtype) for x in (q, k, v)]
        self.arrays += [np.empty(Hq, compute_dtype(q.dtype))] if sinks is not None else []
        self.ran = False

    def run(self, view: Callable, dout, q, k, v, out, lse, **kw: Any) -> None:
        """The kernel on 4-D views (``view``) of the inputs and of dq, dk, dv."""
        dq, dk, dv = (view(a) for a in self.arrays[:3])
        dsinks = self.arrays[3] if len(self.arrays) > 3 else None
        _dispatch.backward(
            view(dout), view(q), view(k), view(v), view(out), lse, dq, dk, dv, dsinks, **kw
        )
        self.ran = True

    def result(self, like: Any) -> Any:
        """(dq, dk, dv) or (dq, dk, dv, dsinks), in the kind of `like`."""
        if not self.ran:  # nothing to compute: every gradient is zero
            for a in self.arrays:
                a[...] = 0
        return to_input_kind(tuple(self.arrays), like)


def _check_grad_inputs(dout, out, lse, q, out_shape, lse_shape):
    half = q.dtype in HALF_DTYPES
    dout = as_float_array(dout, "dout", half=half)
    out = as_float_array(out, "out", half=half)
    lse = as_float_array(lse, "lse", half=True)  # its dtype is checked here, with a hint
    if half:  # lse is float32 for 16-bit inputs, as the forward returns it
        check_same_dtype(q=q, dout=dout, out=out)
        if lse.dtype != compute_dtype(q.dtype):
            raise TypeError(
                f"lse must be float32 for {dtype_name(q.dtype)} q (what return_lse=True gives), "
                f"got {dtype_name(lse.dtype)}; pass the forward's lse or lse.astype(np.float32)"
            )
    else:
        check_same_dtype(q=q, dout=dout, out=out, lse=lse)
    if out.shape != out_shape:
        raise ValueError(
            f"out has shape {shape_str(out)}, expected {shape_str(np.empty(out_shape, np.int8))} "
            f"(q has shape {shape_str(q)})"
        )
    if dout.shape != out_shape:
        raise ValueError(f"dout has shape {shape_str(dout)} but out has shape {shape_str(out)}")
    if lse.shape != lse_shape:
        raise ValueError(
            f"lse has shape {shape_str(lse)}, expected {shape_str(np.empty(lse_shape, np.int8))} "
            f"(q has shape {shape_str(q)})"
        )
    if not out.flags.writeable:  # the kernel only reads it; its binding takes o as writeable
        out = out.copy()
    return dout, out, np.ascontiguousarray(lse)


def scaled_dot_product_attention_backward(
    dout: ArrayLike,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    out: ArrayLike,
    lse: ArrayLike,
    attn_mask: masks.Mask | ArrayLike | list | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    window_size: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    block_q: int = 0,
    block_k: int = 0,
) -> Any:
    """Gradients of ``scaled_dot_product_attention`` with respect to q, k, v.

    Parameters
    ----------
    dout : (…, Lq, dv), the gradient of the loss with respect to the output.
    q, k, v : as in ``scaled_dot_product_attention`` ((L, d), (H, L, d) or
        (B, H, L, d), one dtype: float32, float64, float16 or bfloat16; any
        strides, GQA with enable_gqa). dout has that dtype too.

    out : (…, Lq, dv) and lse : q.shape[:-1], what
        ``scaled_dot_product_attention(..., return_lse=True)`` returned for
        the same arguments, or a global out / lse (ring attention, see the
        module docstring). out has q's dtype; lse q's compute dtype (float32
        for float16 / bfloat16 q, else q's dtype).

    attn_mask, is_causal (bottom-right), scale, enable_gqa, window_size
        Exactly as in the forward call.
    softcap, alibi_slopes, sinks, block_q, block_k
        Exactly as in the forward call. Masks and biases get no gradient.

    Returns
    -------
    (dq, dk, dv) with the shapes of q, k, v (new C-contiguous arrays of q's
    dtype; torch tensors if q is one, ``ml_dtypes.bfloat16`` arrays for
    bfloat16 NumPy input), plus dsinks of shape (H,) when sinks are given:
    (dq, dk, dv, dsinks), dsinks in q's compute dtype (float32 for 16-bit q).
    16-bit gradients are computed in float32 and rounded once. GQA: dk, dv
    are summed over each group of query heads. Rows that see no key
    contribute nothing (their dq is 0); keys no query sees get dk = dv = 0.
    """
    if v is None:
        raise TypeError("v must be an array, got None")
    like = q
    is_causal, enable_gqa = check_bool(is_causal, "is_causal"), check_bool(enable_gqa, "enable_gqa")
    q, _, _, q4, k4, v4, (B, Hq, _, Lq, Lk, d, dv_) = check_qkv(
        q, k, v, half=True, enable_gqa=enable_gqa
    )
    k, v = as_float_array(k, "k", half=True), as_float_array(v, "v", half=True)
    scale = check_scale(scale, d, q.dtype)
    dout, out, lse = _check_grad_inputs(dout, out, lse, q, q.shape[:-1] + (dv_,), q.shape[:-1])
    block_q, block_k = block_size(block_q, "block_q"), block_size(block_k, "block_k")
    cdt = compute_dtype(q.dtype)  # biases, slopes, sinks: float32 for 16-bit q
    if q.dtype in HALF_DTYPES:
        attn_mask = half_mask(attn_mask)
    mask = mask_args(attn_mask, is_causal, window_size, B, Hq, Lq, Lk, cdt)
    score = score_args(Hq, cdt, softcap, alibi_slopes, sinks)
    kw = dict(scale=scale, mask=mask, score=score, block_q=block_q, block_k=block_k)
    grads = _Grads(q, k, v, Hq, sinks)
    if B * Hq:
        grads.run(lambda x: to4(x, "array"), dout, q, k, v, out, lse, **kw)
    return grads.result(like)


def varlen_attention_backward(
    dout: ArrayLike,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    out: ArrayLike,
    lse: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    window_size: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    block_q: int = 0,
    block_k: int = 0,
) -> Any:
    """Gradients of ``varlen_attention`` (packed variable-length sequences).

    dout, out : (total_q, H, dv); q : (total_q, H, d); k : (total_k, H_kv, d);
    v : (total_k, H_kv, dv); one dtype (float32, float64, float16 or
    bfloat16); lse : (H, total_q) in q's compute dtype (float32 for 16-bit
    q), as ``varlen_attention(..., return_lse=True)`` returned it.
    cu_seqlens_q / cu_seqlens_k and every option mean what they mean in
    ``varlen_attention``.

    Returns (dq, dk, dv) shaped like q, k, v in q's dtype, plus dsinks (H,)
    in the compute dtype when sinks are given; torch tensors if q is one.
    """
    like = q
    causal = check_bool(causal, "causal")
    q, k, v, cu_q, cu_k = check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, half=True
    )
    (Tq, Hq, d), dv_ = q.shape, v.shape[2]
    scale = check_scale(scale, d, q.dtype)
    dout, out, lse = _check_grad_inputs(dout, out, lse, q, (Tq, Hq, dv_), (Hq, Tq))
    block_q, block_k = block_size(block_q, "block_q"), block_size(block_k, "block_k")
    mask = varlen_args(causal, window_size)
    score = score_args(Hq, compute_dtype(q.dtype), softcap, alibi_slopes, sinks)
    kw = dict(scale=scale, mask=mask, score=score, block_q=block_q, block_k=block_k)
    grads = _Grads(q, k, v, Hq, sinks)
    if cu_q.size > 1 and Hq:
        # (total, H, d) -> (1, H, total, d): views, the kernel reads the strides.
        grads.run(
            lambda x: x.transpose(1, 0, 2)[None],
            dout,
            q,
            k,
            v,
            out,
            lse,
            cu_q=cu_q,
            cu_k=cu_k,
            **kw,
        )
    return grads.result(like)
