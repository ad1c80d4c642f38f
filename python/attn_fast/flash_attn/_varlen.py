"""flash_attn_varlen_func and its packed forms: (total, H, d) tensors with cu_seqlens."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ..backward import varlen_attention_backward as _varlen_backward
from ..functional import varlen_attention as _varlen
from ._common import (
    Opts,
    alibi_split,
    call,
    check_call,
    cu_array,
    define_op,
    flash_returns,
    lse_dtype,
    mask_args,
    no_lse,
    paged_attend,
    refuse_grad,
    register_backward,
    unpack,
)

# ---------------------------------------------------------------- varlen


def _seq_slices(cu_q: np.ndarray, cu_k: np.ndarray):
    return [
        (slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1])))
        for s in range(cu_q.size - 1)
    ]


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],  # noqa: UP045 (custom_op reads it at run time)
    block_table: Optional[torch.Tensor],  # noqa: UP045
    need_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (total_q, H, dv) and lse (H, total_q) (None unless need_lse): the varlen kernel,
    or with block_table the decode kernel on the paged pool."""
    opts = Opts.from_op(scale, causal, window_left, window_right, softcap)
    cu_q, cu_k = cu_array(cu_seqlens_q, "cu_seqlens_q"), cu_array(cu_seqlens_k, "cu_seqlens_k")
    shared, rows = alibi_split(alibi_slopes)
    if block_table is not None:
        return _paged(q, k, v, cu_q, cu_k, block_table, opts, shared, rows, need_lse)
    Tq, H, _ = q.shape
    out = torch.empty((Tq, H, v.shape[-1]), dtype=q.dtype)
    lse = torch.empty((H, Tq), dtype=lse_dtype(q.dtype)) if need_lse else None
    kw = dict(causal=opts.causal, return_lse=need_lse, **opts.sdpa_kw())
    if rows is None:
        res = _varlen(
            q.detach(),
            k.detach(),
            v.detach(),
            cu_q,
            cu_k,
            max_seqlen_q,
            max_seqlen_k,
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


def _backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],  # noqa: UP045 (custom_op reads it at run time)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv: new contiguous tensors like q, k, v."""
    opts = Opts.from_op(scale, causal, window_left, window_right, softcap)
    cu_q, cu_k = cu_array(cu_seqlens_q, "cu_seqlens_q"), cu_array(cu_seqlens_k, "cu_seqlens_k")
    shared, rows = alibi_split(alibi_slopes)
    kw = dict(causal=opts.causal, **opts.sdpa_kw())
    dout, q, k, v, out = (t.detach() for t in (dout, q, k, v, out))
    if rows is None:
        g = _varlen_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            cu_q,
            cu_k,
            max_seqlen_q,
            max_seqlen_k,
            alibi_slopes=shared,
            **kw,
        )
        return tuple(x.contiguous() for x in g[:3])
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


_forward_op = define_op("flash_attn_varlen_fwd", _forward)
_backward_op = define_op("flash_attn_varlen_bwd", _backward)


@_forward_op.register_fake
def _(q, k, v, *args):
    Tq, H, _ = q.shape
    lse = q.new_empty((H, Tq), dtype=lse_dtype(q.dtype)) if args[-1] else no_lse(q)
    return q.new_empty((Tq, H, v.shape[-1])), lse


@_backward_op.register_fake
def _(dout, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


register_backward(_forward_op, _backward_op, n_forward_only=2)


def _paged(q, k_cache, v_cache, cu_q, cu_k, block_table, opts, shared, rows, need_lse):
    """Varlen queries against a paged K/V pool (num_blocks, page, H_kv, d): the decode kernel."""
    Tq, H, d = q.shape
    if cu_q.ndim != 1 or cu_k.shape != cu_q.shape or cu_q[0] != 0 or cu_q[-1] != Tq:
        raise ValueError(
            f"cu_seqlens_q {cu_q.tolist()} and cu_seqlens_k {cu_k.tolist()} must be (B + 1,) "
            f"cumulative lengths, cu_seqlens_q ending at total_q = {Tq}"
        )
    if np.any(np.diff(cu_q) < 0) or np.any(np.diff(cu_k) < 0) or cu_k[0] != 0:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must start at 0 and be non-decreasing")
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
    mask = mask_args(opts, q_lens=q_lens.astype(np.int64), kv_lens=kv_lens.astype(np.int64))
    lse_arg = lse_p if need_lse else None
    paged_attend(qp, op, lse_arg, k_cache, v_cache, block_table, opts, mask, shared, rows)
    lse = None
    if (q_lens == Lq).all():
        out = op.reshape(Tq, H, -1)
        if need_lse:
            lse = torch.from_numpy(lse_p).permute(1, 0, 2).reshape(H, Tq)
    else:
        out = torch.empty((Tq, H, v_cache.shape[-1]), dtype=q.dtype)
        lse = torch.empty((H, Tq), dtype=lse_dtype(q.dtype)) if need_lse else None
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
    flash,
    return_attn_probs,
    block_table=None,
    names=("q", "k", "v"),
):
    """The flash-attn varlen call; flash: the public function's (dropout_p, softmax_scale,
    causal, window_size, softcap, alibi_slopes)."""
    kv_what = (
        "(total_k, nheads_k, headdim)"
        if block_table is None
        else "(num_blocks, page_block_size, nheads_k, headdim)"
    )
    opts, alibi, need_lse = check_call(
        names,
        (q, k, v),
        ("(total_q, nheads, headdim)", kv_what),
        flash,
        lambda: _num_seqs(cu_seqlens_q),
        return_attn_probs,
    )
    cu_q, cu_k = (
        x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
        for x in (cu_seqlens_q, cu_seqlens_k)
    )
    if block_table is not None:
        refuse_grad("flash_attn_varlen_func with block_table", q, k, v)
        if not isinstance(block_table, torch.Tensor):
            block_table = torch.as_tensor(block_table)
    args = (q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, *opts.op_args(), alibi)
    tensors = (*args[:5], alibi, block_table)
    out, lse = call(_forward_op, _forward, tensors, *args, block_table, need_lse)
    return flash_returns(out, lse, return_attn_probs)


def _num_seqs(cu: Any) -> int:
    """B from cu_seqlens (B + 1,) (its shape, never its values)."""
    return (cu.shape[0] if isinstance(cu, torch.Tensor) else len(cu)) - 1


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
        rows of its blocks. Forward only (NotImplementedError under grad);
        softcap / alibi_slopes run the tiled kernel per run of consecutive
        blocks, merged by lse.
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
        (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes),
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
    k, v = unpack(kv, "kv", 1, 2, "(total_k, 2, nheads_k, headdim)")
    return _attn_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes),
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
    return _attn_varlen(
        *unpack(qkv, "qkv", 1, 3, "(total, 3, nheads, headdim)"),
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes),
        return_attn_probs,
        names=("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"),
    )
