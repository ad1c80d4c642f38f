"""FlashAttention 2's public functions on attn_fast's CPU kernels.

The signatures, argument order, defaults, layouts and return conventions are
those of ``flash_attn/flash_attn_interface.py`` (Dao-AILab/flash-attention,
v2): (B, L, H, d) tensors, (total, H, d) packed varlen tensors with int32
``cu_seqlens``, lse (B, H, Lq) or (H, total_q) in float32, causal aligned
bottom-right. Shape legend: B batch, L / Lq / Lk lengths, H query heads, H_kv
key/value heads (H % H_kv == 0: MQA / GQA, K and V never repeated), d head dim
of q and k, dv of v.

Every function reads its inputs in place through their strides: the (B, L, H, d)
layout is handed to the kernels as its (B, H, L, d) transpose (a view), the
packed forms as views of their slices, a paged cache as a (num_blocks, H_kv,
page, d) view of its pool. The outputs are new contiguous tensors in
flash-attn's layout. Nothing of the K/V caches is copied: the new keys and
values of ``flash_attn_with_kvcache`` are written into them in place.

Dtypes: CPU float16, bfloat16 and float32 tensors (float64 too), q, k, v of one
dtype. 16-bit inputs compute in float32 and round the output once; lse is
float32 (float64 for float64 inputs).

Differences from flash-attn, on purpose (each raises rather than computing
something else): ``dropout_p`` must be 0 (attn_fast has no dropout); a paged
K/V cache (``block_table``) takes no ``alibi_slopes`` or ``softcap`` (the
kernel that reads pages has no score transforms) and no gradient; rows that see
no key give lse = -inf (flash-attn's CUDA kernel writes +inf), out = 0 as in
flash-attn. ``return_attn_probs=True`` returns ``S_dmask`` as an empty tensor, as
flash-attn 2 does when dropout_p = 0. ``deterministic`` and ``num_splits`` are
accepted: attn_fast's backward is deterministic for any thread count, and the
split-KV decode kernel sizes its own splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import _dispatch
from ..backward import scaled_dot_product_attention_backward as _sdpa_backward
from ..backward import varlen_attention_backward as _varlen_backward
from ..functional import _score_args
from ..functional import varlen_attention as _varlen
from ..masks import MaskArgs
from .rotary import rotate

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------- checks


def _check_tensor(x: Any, name: str, ndim: int, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {what}, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise TypeError(
            f"{name} is on {x.device}; attn_fast.flash_attn computes on CPU tensors "
            "(use the real flash-attn on a GPU)"
        )
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {what}, got shape {tuple(x.shape)}")
    return x


def _same_dtype(**tensors: torch.Tensor | None) -> None:
    got = {n: t.dtype for n, t in tensors.items() if t is not None}
    if len(set(got.values())) > 1:
        desc = ", ".join(f"{n} {str(d).replace('torch.', '')}" for n, d in got.items())
        raise TypeError(f"q, k, v (and caches) must have one dtype, got {desc}")


def _check_heads(H: int, Hkv: int, d: int, dk: int, dv_shape: tuple, k_shape: tuple) -> None:
    if dk != d:
        raise ValueError(f"k has shape {k_shape} but q has head dim {d}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"q has {H} heads and k / v have {Hkv}: the number of query heads must be a "
            "multiple of the number of key/value heads (MQA / GQA)"
        )
    if dv_shape[:-1] != k_shape[:-1]:
        raise ValueError(f"k has shape {k_shape} but v has shape {dv_shape}")


def _check_dropout(dropout_p: Any) -> None:
    if float(dropout_p) != 0.0:
        raise ValueError(
            f"dropout_p={dropout_p!r}: attn_fast.flash_attn has no attention dropout; pass "
            "dropout_p=0.0 (as flash-attn code does in eval mode, e.g. "
            "dropout_p=self.dropout if self.training else 0.0 with model.eval())"
        )


def _window(window_size: Any) -> tuple[int, int]:
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0 or -1 (unbounded), got {window_size!r}")
    return left, right


@dataclass(frozen=True)
class _Opts:
    """The options every attention call shares, checked once."""

    scale: float
    causal: bool
    window: tuple[int | None, int | None] | None  # attn_fast's window_size (None = unbounded)
    softcap: float | None

    @classmethod
    def of(cls, d: int, softmax_scale: Any, causal: Any, window_size: Any, softcap: Any) -> _Opts:
        scale = d ** (-0.5) if softmax_scale is None else float(softmax_scale)
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
        left, right = _window(window_size)
        window = None
        if left >= 0 or right >= 0:
            window = (left if left >= 0 else None, right if right >= 0 else None)
        cap = float(softcap)
        if cap < 0 or not math.isfinite(cap):
            raise ValueError(f"softcap must be >= 0 (0 = off) and finite, got {softcap!r}")
        return cls(scale, bool(causal), window, cap if cap > 0 else None)

    def window_lr(self) -> tuple[int, int]:
        """(left, right) with -1 for unbounded, causal folded in (right = 0)."""
        left, right = (-1, -1) if self.window is None else self.window
        left = -1 if left is None else left
        right = -1 if right is None else right
        if self.causal:
            right = 0 if right < 0 else min(right, 0)
        return left, right

    def sdpa_kw(self) -> dict[str, Any]:
        return dict(scale=self.scale, window_size=self.window, softcap=self.softcap)


def _alibi(alibi_slopes: Any, B: int, H: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(slopes (H,), None) when one set serves every batch entry, (None, rows (B, H)) when
    the rows differ (the call then runs once per batch entry), (None, None) when absent."""
    if alibi_slopes is None:
        return None, None
    t = torch.as_tensor(alibi_slopes).detach()
    if t.device.type != "cpu" or not t.is_floating_point():
        raise TypeError(f"alibi_slopes must be a float CPU tensor, got {t.dtype} on {t.device}")
    t = t.to(torch.float32) if t.dtype != torch.float64 else t
    if t.shape == (H,):
        return t.contiguous(), None
    if t.shape == (B, H):
        if B == 0 or bool((t == t[:1]).all()):
            return (t[0].contiguous() if B else None), None
        return None, t
    raise ValueError(f"alibi_slopes must be ({H},) or ({B}, {H}), got shape {tuple(t.shape)}")


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _cu(cu: Any, name: str) -> np.ndarray:
    if isinstance(cu, torch.Tensor):
        if cu.is_floating_point():
            raise TypeError(f"{name} must be an int32 tensor, got {cu.dtype}")
        cu = cu.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(cu), dtype=np.int64)


def _refuse_grad(name: str, *tensors: torch.Tensor | None) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise NotImplementedError(
            f"{name} has no backward here (a paged K/V cache is read by the decode kernel "
            "only); call it under torch.no_grad() or with tensors that do not require grad"
        )


# ---------------------------------------------------------------- (B, L, H, d) forward / backward


def _t(x: torch.Tensor) -> torch.Tensor:
    """(B, L, H, d) -> (B, H, L, d): a view."""
    return x.detach().transpose(1, 2)


def _batches(B: int, rows: torch.Tensor | None, shared: torch.Tensor | None):
    """(slice, slopes) per kernel call: one call for all, or one per batch entry."""
    if rows is None:
        return [(slice(None), shared)]
    return [(slice(b, b + 1), rows[b]) for b in range(B)]


def _dense_forward(q, k, v, opts, shared, rows, need_lse):
    """The kernel chosen by ``_dispatch.choose_kernel`` on (B, H, L, d) views, writing a new
    (B, Lq, H, dv) out through its transpose; what ``attn_fast.scaled_dot_product_attention``
    runs for the same arguments, without its argument parsing."""
    B, Lq, H, _ = q.shape
    out = torch.empty((B, Lq, H, v.shape[-1]), dtype=q.dtype)
    lse = torch.empty((B, H, Lq), dtype=_lse_dtype(q.dtype)) if need_lse else None
    if not out.numel() and not (need_lse and lse.numel()):
        return out, lse
    q4, k4, v4, o4 = _np4(q, "q"), _np4(k, "k"), _np4(v, "v"), _np4(out, "out")
    lse4 = lse.numpy() if need_lse else None
    cdt = np.float64 if q.dtype == torch.float64 else np.float32
    mask = _mask(opts)
    for sl, slopes in _batches(B, rows, shared):
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


def _dense_backward(dout, q, k, v, out, lse, opts, shared, rows):
    B = q.shape[0]
    grads = None
    for sl, slopes in _batches(B, rows, shared):
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
        g = [x.transpose(1, 2) for x in g[:3]]
        if rows is None:
            return g
        if grads is None:
            grads = [torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v)]
        for dst, src in zip(grads, g):
            dst[sl] = src
    if grads is None:
        grads = [torch.zeros(t.shape, dtype=t.dtype) for t in (q, k, v)]
    return grads


class _FlashAttnFunction(torch.autograd.Function):
    """out, lse of (B, L, H, d) q, k, v; backward: attn_fast's fused FlashAttention-2 backward."""

    @staticmethod
    def forward(ctx, q, k, v, opts, shared, rows, need_lse):
        out, lse = _dense_forward(q, k, v, opts, shared, rows, need_lse)
        ctx.opts, ctx.shared, ctx.rows = opts, shared, rows
        if lse is None:
            lse = torch.empty(0, dtype=_lse_dtype(q.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _dense_backward(dout, q, k, v, out, lse, ctx.opts, ctx.shared, ctx.rows)
        return dq, dk, dv, None, None, None, None


def _wants_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _attn_dense(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    return_attn_probs,
    names=("q", "k", "v"),
):
    _check_dropout(dropout_p)
    for name, t in zip(names, (q, k, v)):
        _check_tensor(t, name, 4, "(batch_size, seqlen, nheads, headdim)")
    _same_dtype(**dict(zip(names, (q, k, v))))
    B, Lq, H, d = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"q has shape {tuple(q.shape)} but k has {tuple(k.shape)}: batch differs")
    _check_heads(H, k.shape[2], d, k.shape[3], tuple(v.shape), tuple(k.shape))
    opts = _Opts.of(d, softmax_scale, causal, window_size, softcap)
    shared, rows = _alibi(alibi_slopes, B, H)
    if _wants_grad(q, k, v):
        out, lse = _FlashAttnFunction.apply(q, k, v, opts, shared, rows, True)
    else:  # inference: no autograd node (apply() costs as much as a small kernel call)
        out, lse = _dense_forward(q, k, v, opts, shared, rows, bool(return_attn_probs))
    if return_attn_probs:
        return out, lse, torch.empty(0, dtype=q.dtype)
    return out


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
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
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
    _check_tensor(kv, "kv", 5, "(batch_size, seqlen, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise ValueError(
            f"kv must be (batch_size, seqlen, 2, nheads_k, headdim), got {tuple(kv.shape)}"
        )
    return _attn_dense(
        q,
        kv[:, :, 0],
        kv[:, :, 1],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
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
    _check_tensor(qkv, "qkv", 5, "(batch_size, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise ValueError(
            f"qkv must be (batch_size, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}"
        )
    return _attn_dense(
        qkv[:, :, 0],
        qkv[:, :, 1],
        qkv[:, :, 2],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        return_attn_probs,
        names=("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"),
    )


# ---------------------------------------------------------------- varlen


def _seq_slices(cu_q: np.ndarray, cu_k: np.ndarray):
    return [
        (slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1])))
        for s in range(cu_q.size - 1)
    ]


def _varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, opts, shared, rows, need_lse):
    Tq, H, _ = q.shape
    out = torch.empty((Tq, H, v.shape[-1]), dtype=q.dtype)
    lse = torch.empty((H, Tq), dtype=_lse_dtype(q.dtype)) if need_lse else None
    kw = dict(causal=opts.causal, return_lse=need_lse, **opts.sdpa_kw())
    if rows is None:
        res = _varlen(
            q.detach(),
            k.detach(),
            v.detach(),
            cu_q,
            cu_k,
            max_q,
            max_k,
            out=out,
            alibi_slopes=shared,
            **kw,
        )
        if need_lse:
            lse.copy_(res[1])
        return out, lse
    for s, (sq, sk) in enumerate(_seq_slices(cu_q, cu_k)):
        n, m = sq.stop - sq.start, sk.stop - sk.start
        res = _varlen(
            q.detach()[sq],
            k.detach()[sk],
            v.detach()[sk],
            [0, n],
            [0, m],
            out=out[sq],
            alibi_slopes=rows[s],
            **kw,
        )
        if need_lse:
            lse[:, sq] = res[1]
    return out, lse


def _varlen_backward_all(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, opts, shared, rows):
    kw = dict(causal=opts.causal, **opts.sdpa_kw())
    if rows is None:
        return _varlen_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, alibi_slopes=shared, **kw
        )[:3]
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype) for t in (q, k, v))
    for s, (sq, sk) in enumerate(_seq_slices(cu_q, cu_k)):
        n, m = sq.stop - sq.start, sk.stop - sk.start
        g = _varlen_backward(
            dout[sq],
            q[sq],
            k[sk],
            v[sk],
            out[sq],
            lse[:, sq].contiguous(),
            [0, n],
            [0, m],
            alibi_slopes=rows[s],
            **kw,
        )
        dq[sq], dk[sk], dv[sk] = g[0], g[1], g[2]
    return dq, dk, dv


class _FlashAttnVarlenFunction(torch.autograd.Function):
    """out, lse of packed (total, H, d) q, k, v with cu_seqlens; fused backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, opts, shared, rows, need_lse):
        out, lse = _varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, opts, shared, rows, need_lse)
        ctx.args = (cu_q, cu_k, max_q, max_k, opts, shared, rows)
        if lse is None:
            lse = torch.empty(0, dtype=_lse_dtype(q.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _varlen_backward_all(
            dout, q.detach(), k.detach(), v.detach(), out, lse, *ctx.args
        )
        return (dq, dk, dv) + (None,) * 8


def _varlen_paged(q, k_cache, v_cache, cu_q, cu_k, block_table, opts, shared, rows, need_lse):
    """Varlen queries against a paged K/V pool (num_blocks, page, H_kv, d): the decode kernel."""
    if opts.softcap is not None or shared is not None or rows is not None:
        raise NotImplementedError(
            "block_table (a paged K/V cache) with softcap or alibi_slopes is not supported: the "
            "kernel that reads pages in place has no score transforms; pass a contiguous K/V"
        )
    Tq, H, d = q.shape
    B = cu_q.size - 1
    q_lens = np.diff(cu_q)
    kv_lens = np.diff(cu_k)
    Lq = int(q_lens.max(initial=0))
    if (q_lens == Lq).all():  # every sequence has Lq queries: (B, Lq, H, d) is a view
        qp = q.detach().reshape(B, Lq, H, d)
    else:  # pad the queries (not the cache) into (B, Lq, H, d)
        qp = q.new_zeros((B, Lq, H, d))
        for s, (sq, _) in enumerate(_seq_slices(cu_q, cu_k)):
            qp[s, : sq.stop - sq.start] = q.detach()[sq]
    op = torch.empty((B, Lq, H, v_cache.shape[-1]), dtype=q.dtype)
    lse_p = np.empty((B, H, Lq), dtype=np.float64 if q.dtype == torch.float64 else np.float32)
    mask = _mask(opts, q_lens=q_lens.astype(np.int64), kv_lens=kv_lens.astype(np.int64))
    _paged(qp, op, lse_p if need_lse else None, k_cache, v_cache, block_table, opts, mask)
    lse = None
    if (q_lens == Lq).all():
        out = op.reshape(Tq, H, -1)
        if need_lse:
            lse = torch.from_numpy(lse_p).permute(1, 0, 2).reshape(H, Tq)
    else:
        out = torch.empty((Tq, H, v_cache.shape[-1]), dtype=q.dtype)
        lse = torch.empty((H, Tq), dtype=_lse_dtype(q.dtype)) if need_lse else None
        lt = torch.from_numpy(lse_p)
        for s, (sq, _) in enumerate(_seq_slices(cu_q, cu_k)):
            n = sq.stop - sq.start
            out[sq] = op[s, :n]
            if need_lse:
                lse[:, sq] = lt[s, :, :n]
    return out, lse


def _attn_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    return_attn_probs,
    block_table=None,
    names=("q", "k", "v"),
):
    _check_dropout(dropout_p)
    paged = block_table is not None
    _check_tensor(q, names[0], 3, "(total_q, nheads, headdim)")
    kv_what = (
        "(num_blocks, page_block_size, nheads_k, headdim)"
        if paged
        else "(total_k, nheads_k, headdim)"
    )
    for name, t in zip(names[1:], (k, v)):
        _check_tensor(t, name, 4 if paged else 3, kv_what)
    _same_dtype(**dict(zip(names, (q, k, v))))
    Tq, H, d = q.shape
    _check_heads(H, k.shape[-2], d, k.shape[-1], tuple(v.shape), tuple(k.shape))
    cu_q, cu_k = _cu(cu_seqlens_q, "cu_seqlens_q"), _cu(cu_seqlens_k, "cu_seqlens_k")
    opts = _Opts.of(d, softmax_scale, causal, window_size, softcap)
    B = cu_q.size - 1
    shared, rows = _alibi(alibi_slopes, B, H)
    if paged:
        _refuse_grad("flash_attn_varlen_func with block_table", q, k, v)
        if cu_q.ndim != 1 or cu_k.shape != cu_q.shape or cu_q[0] != 0 or cu_q[-1] != Tq:
            raise ValueError(
                f"cu_seqlens_q {cu_q.tolist()} and cu_seqlens_k {cu_k.tolist()} must be (B + 1,) "
                f"cumulative lengths, cu_seqlens_q ending at total_q = {Tq}"
            )
        if np.any(np.diff(cu_q) < 0) or np.any(np.diff(cu_k) < 0) or cu_k[0] != 0:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must start at 0 and be non-decreasing")
        out, lse = _varlen_paged(
            q, k, v, cu_q, cu_k, block_table, opts, shared, rows, bool(return_attn_probs)
        )
    else:
        need_lse = bool(return_attn_probs) or _wants_grad(q, k, v)
        out, lse = _FlashAttnVarlenFunction.apply(
            q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, opts, shared, rows, need_lse
        )
    if return_attn_probs:
        return out, lse, torch.empty(0, dtype=q.dtype)
    return out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> Any:
    """flash-attn's ``flash_attn_varlen_func``: packed variable-length sequences.

    Parameters
    ----------
    q, k, v : (total_q, H, d), (total_k, H_kv, d), (total_k, H_kv, dv) tensors
        Sequence s is rows cu_seqlens_q[s]:cu_seqlens_q[s+1] of q and
        cu_seqlens_k[s]:cu_seqlens_k[s+1] of k and v (read as views).
    cu_seqlens_q, cu_seqlens_k : (B + 1,) int32 tensors (any integer dtype).
    max_seqlen_q, max_seqlen_k : ints, at least the longest sequence.
    block_table : (B, max_blocks) int32 or None. When given, k and v are a
        paged pool (num_blocks, page_block_size, H_kv, d), any page size;
        sequence s's keys are the first cu_seqlens_k[s+1] - cu_seqlens_k[s]
        rows of its blocks. Forward only, no softcap / alibi_slopes
        (NotImplementedError).
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes
        As in ``flash_attn_func``, applied per sequence (causal and windows
        aligned bottom-right per sequence; alibi_slopes (H,) or (B, H)).
    deterministic, return_attn_probs
        As in ``flash_attn_func``.

    Returns
    -------
    out (total_q, H, dv), or (out, softmax_lse (H, total_q) float32,
    S_dmask (empty)). Differentiable (without block_table).
    """
    return _attn_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        return_attn_probs,
        block_table,
    )


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """``flash_attn_varlen_func`` with kv (total_k, 2, H_kv, d) packed (views)."""
    _check_tensor(kv, "kv", 4, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        raise ValueError(f"kv must be (total_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    return _attn_varlen(
        q,
        kv[:, 0],
        kv[:, 1],
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        return_attn_probs,
        names=("q", "kv[:, 0]", "kv[:, 1]"),
    )


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """``flash_attn_varlen_func`` with qkv (total, 3, H, d) packed (views), one
    cu_seqlens for queries and keys."""
    _check_tensor(qkv, "qkv", 4, "(total, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must be (total, 3, nheads, headdim), got {tuple(qkv.shape)}")
    return _attn_varlen(
        qkv[:, 0],
        qkv[:, 1],
        qkv[:, 2],
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        return_attn_probs,
        names=("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"),
    )


# ---------------------------------------------------------------- KV cache


def _mask(opts: _Opts, **lens: Any) -> MaskArgs:
    left, right = opts.window_lr()
    return MaskArgs(causal=opts.causal, window_left=left, window_right=right, **lens)


def _np4(x: torch.Tensor, name: str) -> np.ndarray:
    """(B, L, H, d) tensor -> its (B, H, L, d) NumPy view (bfloat16 as its uint16 bits, as
    the kernels read it). The tensors were checked (CPU, float dtype) by the callers; a
    view of a tensor is element-aligned, so this never copies."""
    t = x.detach().transpose(1, 2)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _paged(q4, o4, lse, k_cache, v_cache, block_table, opts, mask):
    """q4 (B, Lq, H, d) against the paged pool through block_table, writing o4 and lse."""
    table = _cu(block_table, "block_table")
    if table.ndim != 2 or table.shape[0] != q4.shape[0]:
        raise ValueError(
            f"block_table must be (batch_size, max_num_blocks_per_seq) = ({q4.shape[0]}, ...), "
            f"got shape {tuple(table.shape)}"
        )
    nblocks, page = k_cache.shape[:2]
    if table.size and (table.min() < 0 or table.max() >= nblocks):
        raise ValueError(f"block_table holds block ids outside [0, {nblocks})")
    if (
        mask.kv_lens is not None
        and mask.kv_lens.size
        and mask.kv_lens.max() > table.shape[1] * page
    ):
        raise ValueError(
            f"a sequence of {int(mask.kv_lens.max())} keys does not fit its block_table row of "
            f"{table.shape[1]} blocks of {page}"
        )
    pages = _dispatch.PagedArgs(
        [_np4(k_cache, "k_cache")], [_np4(v_cache, "v_cache")], np.ascontiguousarray(table)
    )
    kernel = _dispatch.choose_kernel(
        Lq=q4.shape[1], Lk=table.shape[1] * page, mask=mask, keys=_dispatch.KEYS_PAGED
    )
    assert kernel == _dispatch.DECODE
    _dispatch.attend_paged(_np4(q4, "q"), pages, _np4(o4, "out"), lse, scale=opts.scale, mask=mask)


def _seqlens(x: Any, B: int, name: str, upper: int) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            raise TypeError(f"{name} must be an int or an int32 tensor, got {x.dtype}")
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an int or an int32 tensor of shape ({B},), got {a.dtype}")
    a = np.broadcast_to(a, (B,)).astype(np.int64) if a.ndim == 0 else a.astype(np.int64)
    if a.shape != (B,):
        raise ValueError(f"{name} must be an int or shape ({B},), got shape {a.shape}")
    if a.size and (a.min() < 0 or a.max() > upper):
        raise ValueError(f"{name} must lie in [0, {upper}], got values in [{a.min()}, {a.max()}]")
    return a


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_with_kvcache``: decoding against a KV cache (no backward).

    Parameters
    ----------
    q : (B, Lq, H, d); Lq >= 1 query tokens per sequence (decode, chunked
        prefill, speculative verification of Lq drafts).
    k_cache, v_cache : (B_cache, L_cache, H_kv, d) / (.., dv), or with
        block_table a paged pool (num_blocks, page_block_size, H_kv, d / dv),
        any page size. Read in place, never copied.
    k, v : (B, L_new, H_kv, d / dv) or None
        Written **in place** into the cache at positions cache_seqlens[b] ..
        cache_seqlens[b] + L_new - 1 (after rotary on k), then attended with
        the rest.
    rotary_cos, rotary_sin : (L_ro, r / 2) or None
        Needs k, v. The new k is rotated at its positions cache_seqlens[b] + i; q too, at the same
        positions when causal or windowed, else all at cache_seqlens[b].
    rotary_interleaved : rotate pairs (0, 1), (2, 3) ... instead of (0, r/2) ...
    cache_seqlens : int or (B,) int32
        Keys already in the cache per sequence;
        None = the whole cache (L_cache). Sequence b attends to its first
        cache_seqlens[b] + L_new keys.
    cache_batch_idx : (B,) int32 or None
        The cache row of each sequence.
    cache_leftpad : (B,) int32 or None
        Sequence b's keys start at this slot (earlier slots are padding).
    block_table : (B, max_blocks) int32 or None
        The blocks of each sequence in order.
    softmax_scale : default 1 / sqrt(d).
    causal, window_size : aligned bottom-right on each sequence's keys.
    softcap, alibi_slopes : as in ``flash_attn_func``
        alibi_slopes (H,) or (B, H); neither with block_table (NotImplementedError).
    num_splits : accepted; the split-KV decode kernel sizes its own splits.
    return_softmax_lse : also return lse (B, H, Lq) float32.

    Returns
    -------
    out (B, Lq, H, dv) (a new tensor of q's dtype), or (out, lse).
    Rows that see no key: 0 (lse -inf). Not differentiable (as in flash-attn).
    """
    _check_tensor(q, "q", 4, "(batch_size, seqlen, nheads, headdim)")
    paged = block_table is not None
    what = (
        "(num_blocks, page_block_size, nheads_k, headdim)"
        if paged
        else "(batch_size_cache, seqlen_cache, nheads_k, headdim)"
    )
    _check_tensor(k_cache, "k_cache", 4, what)
    _check_tensor(v_cache, "v_cache", 4, what)
    _same_dtype(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    B, Lq, H, d = q.shape
    Hkv = k_cache.shape[2]
    _check_heads(H, Hkv, d, k_cache.shape[3], tuple(v_cache.shape), tuple(k_cache.shape))
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or neither)")
    if isinstance(num_splits, bool) or int(num_splits) < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    opts = _Opts.of(d, softmax_scale, causal, window_size, softcap)
    shared, rows = _alibi(alibi_slopes, B, H)
    if paged:
        if cache_batch_idx is not None or cache_leftpad is not None:
            raise ValueError(
                "block_table cannot be combined with cache_batch_idx or cache_leftpad "
                "(as in flash-attn): the block table already says where each sequence lives"
            )
        table = _cu(block_table, "block_table")
        L_cache = (table.shape[1] if table.ndim == 2 else 0) * k_cache.shape[1]
    else:
        table = None
        L_cache = k_cache.shape[1]
    if not paged and v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"k_cache has shape {tuple(k_cache.shape)} but v_cache {tuple(v_cache.shape)}"
        )
    if paged and (table.ndim != 2 or table.shape[0] != B):
        raise ValueError(
            f"block_table must be ({B}, max_num_blocks_per_seq), got {tuple(table.shape)}"
        )
    L_new = 0
    if k is not None:
        _check_tensor(k, "k", 4, "(batch_size, seqlen_new, nheads_k, headdim)")
        _check_tensor(v, "v", 4, "(batch_size, seqlen_new, nheads_k, headdim)")
        L_new = k.shape[1]
        if k.shape[:3] != (B, L_new, Hkv) or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
            raise ValueError(
                f"k and v must be ({B}, seqlen_new, {Hkv}, d/dv) to match q and the cache, got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        if v.shape[3] != v_cache.shape[3]:
            raise ValueError(f"v has head dim {v.shape[3]} but v_cache has {v_cache.shape[3]}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when k and v are appended to the cache")
    if cache_seqlens is None:
        seqlens = np.full(B, L_cache, dtype=np.int64)
    else:
        seqlens = _seqlens(cache_seqlens, B, "cache_seqlens", L_cache - L_new)
    bidx = None
    if cache_batch_idx is not None:
        bidx = _seqlens(cache_batch_idx, B, "cache_batch_idx", k_cache.shape[0] - 1)
    elif not paged and k_cache.shape[0] < B:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences but q has batch {B}")
    leftpad = None
    if cache_leftpad is not None:
        leftpad = _seqlens(cache_leftpad, B, "cache_leftpad", L_cache)
    seqlen_k = seqlens + L_new
    if leftpad is not None and (leftpad > np.maximum(seqlens, seqlen_k)).any():
        raise ValueError(
            f"cache_leftpad {leftpad.tolist()} exceeds cache_seqlens {seqlens.tolist()}"
        )

    rope = rotary_cos is not None or rotary_sin is not None
    if rope:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("rotary_cos and rotary_sin must be given together")
        if k is None:
            raise ValueError("rotary_cos / rotary_sin apply to the appended k: pass k and v too")
        pos_k = torch.from_numpy(seqlens).reshape(B, 1) + torch.arange(L_new)
        k = rotate(k.detach(), rotary_cos, rotary_sin, pos_k, bool(rotary_interleaved))
        if opts.causal or opts.window is not None:
            pos_q = torch.from_numpy(seqlens).reshape(B, 1) + torch.arange(Lq)
        else:
            pos_q = torch.from_numpy(seqlens).reshape(B, 1).expand(B, Lq)
        q = rotate(q.detach(), rotary_cos, rotary_sin, pos_q, bool(rotary_interleaved))

    if k is not None and L_new:  # the in-place append: only the new rows are written
        _append(k_cache, k, seqlens, bidx, table)
        _append(v_cache, v, seqlens, bidx, table)

    dv = v_cache.shape[3]
    out = torch.empty((B, Lq, H, dv), dtype=q.dtype)
    lse_np = (
        np.empty((B, H, Lq), dtype=np.float64 if q.dtype == torch.float64 else np.float32)
        if return_softmax_lse
        else None
    )
    plain = opts.softcap is None and shared is None and rows is None
    kv_lens = seqlen_k - (0 if leftpad is None else leftpad)
    if B and Lq:
        if paged:
            if not plain:
                raise NotImplementedError(
                    "block_table (a paged K/V cache) with softcap or alibi_slopes is not "
                    "supported: the kernel that reads pages in place has no score transforms"
                )
            _paged(q, out, lse_np, k_cache, v_cache, table, opts, _mask(opts, kv_lens=kv_lens))
        else:
            _cache_attend(
                q, out, lse_np, k_cache, v_cache, opts, shared, rows, plain, bidx, leftpad, kv_lens
            )
    elif lse_np is not None:
        lse_np[...] = -np.inf
    if return_softmax_lse:
        return out, torch.from_numpy(lse_np)
    return out


def _append(cache: torch.Tensor, x: torch.Tensor, starts, bidx, table) -> None:
    """cache rows starts[b] .. starts[b] + L_new - 1 of sequence b = x[b], in place: one slice
    copy per sequence (contiguous) or per page touched (paged). (torch's advanced-index
    assignment costs tens of milliseconds on a large cache; slice copies cost microseconds.)"""
    B, n = x.shape[:2]
    x = x.detach()
    with torch.no_grad():
        for b in range(B):
            s = int(starts[b])
            if table is None:
                row = b if bidx is None else int(bidx[b])
                cache[row, s : s + n].copy_(x[b])
                continue
            page, j = cache.shape[1], s
            while j < s + n:
                off = j % page
                m = min(page - off, s + n - j)
                cache[int(table[b, j // page]), off : off + m].copy_(x[b, j - s : j - s + m])
                j += m


def _cache_attend(q, out, lse, k_cache, v_cache, opts, shared, rows, plain, bidx, leftpad, kv_lens):
    """Attention over a contiguous cache (B_cache, L_cache, H_kv, d), read in place."""
    B, Lq, H, _ = q.shape
    q4, o4 = _np4(q, "q"), _np4(out, "out")
    kc, vc = _np4(k_cache, "k_cache"), _np4(v_cache, "v_cache")
    if plain and bidx is None:
        # One call over the first B cache rows; padding on the left is a ring start.
        start = None if leftpad is None else leftpad.copy()
        mask = _mask(opts, kv_lens=kv_lens.copy())
        keys = _dispatch.KEYS_RING if start is not None else _dispatch.KEYS_CACHE
        kernel = _dispatch.choose_kernel(Lq=Lq, Lk=int(kv_lens.max()), mask=mask, keys=keys)
        k4, v4 = kc[:B], vc[:B]
        if start is None:  # the stored prefix as a view: the decode kernel splits keys, not
            n = int(kv_lens.max())  # the cache's empty tail (a ring start needs the whole row)
            k4, v4 = k4[:, :, :n], v4[:, :, :n]
        _dispatch.attend(kernel, q4, k4, v4, o4, lse, scale=opts.scale, mask=mask, kv_start=start)
        return
    if plain and leftpad is None:
        # cache_batch_idx: the cache as a pool of one page per row, the index as block table.
        mask = _mask(opts, kv_lens=kv_lens.copy())
        pages = _dispatch.PagedArgs([kc], [vc], np.ascontiguousarray(bidx.reshape(B, 1)))
        _dispatch.attend_paged(q4, pages, o4, lse, scale=opts.scale, mask=mask)
        return
    # Score transforms (softcap, ALiBi) with batch indices or left padding: one call per
    # sequence on its own key range (a view), the tiled or the decode kernel as they fit.
    cdt = np.float64 if q.dtype == torch.float64 else np.float32
    for b in range(B):
        row = b if bidx is None else int(bidx[b])
        lo = 0 if leftpad is None else int(leftpad[b])
        hi = lo + int(kv_lens[b])
        slopes = shared if rows is None else rows[b]
        score = _score_args(H, cdt, opts.softcap, slopes, None)
        mask = _mask(opts)
        kb, vb = kc[row : row + 1, :, lo:hi], vc[row : row + 1, :, lo:hi]
        kernel = _dispatch.choose_kernel(Lq=Lq, Lk=hi - lo, mask=mask, score=score)
        lb = None if lse is None else lse[b : b + 1]
        if hi == lo:
            o4[b] = 0
            if lb is not None:
                lb[...] = -np.inf
            continue
        _dispatch.attend(
            kernel,
            q4[b : b + 1],
            kb,
            vb,
            o4[b : b + 1],
            lb,
            scale=opts.scale,
            mask=mask,
            score=score,
        )
