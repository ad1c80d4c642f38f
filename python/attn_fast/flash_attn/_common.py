"""Checks, the option record and kernel plumbing shared by the flash-attn functions (private)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import _dispatch
from .._args import score_args as _score_args
from ..masks import MaskArgs
from ..torch import _direct_ok

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------- checks


def check_tensor(x: Any, name: str, ndim: int, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {what}, got {type(x).__name__}")
    if not x.is_cpu:
        raise TypeError(
            f"{name} is on {x.device}; attn_fast.flash_attn computes on CPU tensors "
            "(use the real flash-attn on a GPU)"
        )
    if x.dtype not in DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {what}, got shape {tuple(x.shape)}")
    return x


def same_dtype(**tensors: torch.Tensor | None) -> None:
    got = {n: t.dtype for n, t in tensors.items() if t is not None}
    if len(set(got.values())) > 1:
        desc = ", ".join(f"{n} {str(d).replace('torch.', '')}" for n, d in got.items())
        raise TypeError(f"q, k, v (and caches) must have one dtype, got {desc}")


def check_heads(H: int, Hkv: int, d: int, dk: int, dv_shape: tuple, k_shape: tuple) -> None:
    if dk != d:
        raise ValueError(f"k has shape {k_shape} but q has head dim {d}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"q has {H} heads and k / v have {Hkv}: the number of query heads must be a "
            "multiple of the number of key/value heads (MQA / GQA)"
        )
    if dv_shape[:-1] != k_shape[:-1]:
        raise ValueError(f"k has shape {k_shape} but v has shape {dv_shape}")


def check_dropout(dropout_p: Any) -> None:
    if float(dropout_p) != 0.0:
        raise ValueError(
            f"dropout_p={dropout_p!r}: attn_fast.flash_attn has no attention dropout; pass "
            "dropout_p=0.0 (as flash-attn code does in eval mode, e.g. "
            "dropout_p=self.dropout if self.training else 0.0 with model.eval())"
        )


def unpack(x: Any, name: str, axis: int, n: int, what: str) -> tuple[torch.Tensor, ...]:
    """The n views ``x.select(axis, i)`` of flash-attn's packed qkv / kv tensor `x`, checked
    to be `what`: a layout string such as "(total_k, 2, nheads_k, headdim)" (one axis per
    comma-separated name) with n entries on `axis`."""
    check_tensor(x, name, what.count(",") + 1, what)
    if x.shape[axis] != n:
        raise ValueError(f"{name} must be {what}, got {tuple(x.shape)}")
    return tuple(x.select(axis, i) for i in range(n))


def check_call(
    names: tuple[str, str, str],
    qkv: tuple[Any, Any, Any],
    whats: tuple[str, str],
    flash: tuple[Any, Any, Any, Any, Any, Any],
    batch: Any,
    return_attn_probs: Any,
) -> tuple[Opts, torch.Tensor | None, bool]:
    """What every flash-attn attention function checks first: no dropout; q, k, v CPU
    tensors of the layout strings `whats` (q's, then k's and v's, as in ``unpack``) and one
    dtype, named `names` in errors; q's heads a multiple of k's, matching head dims; the
    options `flash`, flash-attn's (dropout_p, softmax_scale, causal, window_size, softcap,
    alibi_slopes) as the caller got them; ALiBi slopes (H,) or (batch(), H), batch() called
    once the tensors are known good. Returns (options, slopes, whether lse is needed: asked
    for, or a gradient)."""
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes = flash
    check_dropout(dropout_p)
    for name, t, what in zip(names, qkv, (whats[0], whats[1], whats[1])):
        check_tensor(t, name, what.count(",") + 1, what)
    same_dtype(**dict(zip(names, qkv)))
    q, k, v = qkv
    H, d = q.shape[-2:]
    check_heads(H, k.shape[-2], d, k.shape[-1], tuple(v.shape), tuple(k.shape))
    opts = Opts.of(d, softmax_scale, causal, window_size, softcap)
    alibi = check_alibi(alibi_slopes, batch(), H)
    return opts, alibi, bool(return_attn_probs) or wants_grad(q, k, v)


def flash_returns(out: torch.Tensor, lse: torch.Tensor, return_attn_probs: Any) -> Any:
    """out, or flash-attn's (out, softmax_lse, S_dmask): S_dmask empty (no dropout here)."""
    if return_attn_probs:
        return out, lse, torch.empty(0, dtype=out.dtype)
    return out


def window_pair(window_size: Any) -> tuple[int, int]:
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0 or -1 (unbounded), got {window_size!r}")
    return left, right


class Opts(NamedTuple):
    """The options every attention call shares, checked once (a tuple: built twice per
    call, by ``of`` and ``from_op``, and a tuple's construction costs the least)."""

    scale: float
    causal: bool
    window: tuple[int | None, int | None] | None  # attn_fast's window_size (None = unbounded)
    softcap: float | None

    @classmethod
    def of(cls, d: int, softmax_scale: Any, causal: Any, window_size: Any, softcap: Any) -> Opts:
        scale = d ** (-0.5) if softmax_scale is None else float(softmax_scale)
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
        left, right = window_pair(window_size)
        window = None
        if left >= 0 or right >= 0:
            window = (left if left >= 0 else None, right if right >= 0 else None)
        cap = float(softcap)
        if cap < 0 or not math.isfinite(cap):
            raise ValueError(f"softcap must be >= 0 (0 = off) and finite, got {softcap!r}")
        return cls(scale, bool(causal), window, cap if cap > 0 else None)

    def op_args(self) -> tuple[float, bool, int, int, float]:
        """(scale, causal, window_left, window_right, softcap) as the torch ops take them
        (-1 = unbounded, softcap 0 = off); ``Opts.of(d, *op_args[:2], op_args[2:4], ...)``
        rebuilds the record (``from_op``)."""
        left, right = (-1, -1) if self.window is None else self.window
        left = -1 if left is None else left
        right = -1 if right is None else right
        return self.scale, self.causal, left, right, self.softcap or 0.0

    @classmethod
    def from_op(cls, scale, causal, window_left, window_right, softcap) -> Opts:
        """The record from ``op_args()`` (already checked by ``of``; no checks again)."""
        window = None
        if window_left >= 0 or window_right >= 0:
            window = (
                window_left if window_left >= 0 else None,
                window_right if window_right >= 0 else None,
            )
        return cls(scale, causal, window, softcap if softcap > 0 else None)

    def window_lr(self) -> tuple[int, int]:
        """(left, right) with -1 for unbounded, causal folded in (right = 0)."""
        _, _, left, right, _ = self.op_args()
        if self.causal:
            right = 0 if right < 0 else min(right, 0)
        return left, right

    def sdpa_kw(self) -> dict[str, Any]:
        return dict(scale=self.scale, window_size=self.window, softcap=self.softcap)


def check_alibi(alibi_slopes: Any, B: int, H: int) -> torch.Tensor | None:
    """alibi_slopes as a (H,) or (B, H) float32 (float64 kept) CPU tensor, or None; checks
    its type and shape only (no values: this runs while torch.compile traces)."""
    if alibi_slopes is None:
        return None
    t = torch.as_tensor(alibi_slopes).detach()
    if t.device.type != "cpu" or not t.is_floating_point():
        raise TypeError(f"alibi_slopes must be a float CPU tensor, got {t.dtype} on {t.device}")
    if t.shape != (H,) and t.shape != (B, H):
        raise ValueError(f"alibi_slopes must be ({H},) or ({B}, {H}), got shape {tuple(t.shape)}")
    return t.to(torch.float32) if t.dtype != torch.float64 else t


def alibi_split(t: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Checked slopes -> (slopes (H,), None) when one set serves every batch entry,
    (None, rows (B, H)) when the rows differ (the call then runs once per batch entry),
    (None, None) when absent. Reads the values: inside the ops only."""
    if t is None:
        return None, None
    if t.dim() == 1:
        return t.contiguous(), None
    if t.shape[0] == 0 or bool((t == t[:1]).all()):
        return (t[0].contiguous() if t.shape[0] else None), None
    return None, t


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def cu_array(cu: Any, name: str) -> np.ndarray:
    if isinstance(cu, torch.Tensor):
        if cu.is_floating_point():
            raise TypeError(f"{name} must be an int32 tensor, got {cu.dtype}")
        cu = cu.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(cu), dtype=np.int64)


def refuse_grad(name: str, *tensors: torch.Tensor | None) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise NotImplementedError(
            f"{name} has no backward here (a paged K/V cache is read by the decode kernel "
            "only); call it under torch.no_grad() or with tensors that do not require grad"
        )


def wants_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def mask_args(opts: Opts, **lens: Any) -> MaskArgs:
    left, right = opts.window_lr()
    return MaskArgs(causal=opts.causal, window_left=left, window_right=right, **lens)


def np4(x: torch.Tensor, name: str) -> np.ndarray:
    """(B, L, H, d) tensor -> its (B, H, L, d) NumPy view (bfloat16 as its uint16 bits, as
    the kernels read it). The tensors were checked (CPU, float dtype) by the callers; a
    view of a tensor is element-aligned, so this never copies. (Transposed on the NumPy
    side: a torch view and detach cost more than the kernel of a short decode step.)"""
    t = x.detach() if x.requires_grad else x
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).transpose(0, 2, 1, 3)
    return t.numpy().transpose(0, 2, 1, 3)


def paged_attend(q4, o4, lse, k_cache, v_cache, block_table, opts, mask, shared=None, rows=None):
    """q4 (B, Lq, H, d) against the paged pool through block_table, writing o4 and lse:
    the decode kernel, or with softcap / ALiBi (shared (H,) or rows (B, H) slopes)
    ``paged_attend_scored``. mask carries kv_lens (and q_lens)."""
    table = cu_array(block_table, "block_table")
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
    if opts.softcap is not None or shared is not None or rows is not None:
        paged_attend_scored(
            q4, o4, lse, k_cache, v_cache, table, opts, shared, rows, mask.kv_lens, mask.q_lens
        )
        return
    pages = _dispatch.PagedArgs(
        [np4(k_cache, "k_cache")], [np4(v_cache, "v_cache")], np.ascontiguousarray(table)
    )
    kernel = _dispatch.choose_kernel(
        Lq=q4.shape[1], Lk=table.shape[1] * page, mask=mask, keys=_dispatch.KEYS_PAGED
    )
    assert kernel == _dispatch.DECODE
    _dispatch.attend_paged(np4(q4, "q"), pages, np4(o4, "out"), lse, scale=opts.scale, mask=mask)


def call(op, impl, tensors: tuple, *args: Any, to_op=None) -> Any:
    """``impl(*args)`` directly when nothing needs the torch op (plain CPU tensors, no
    tracing, transform or mode, no gradient wanted: ``attn_fast.torch._direct_ok``), else
    the op ``op(*args)`` (the same body, plus fake kernel, autograd and schema). The op's
    dispatch costs about as much as a one-token decode kernel, so the eager inference
    path never pays it. ``to_op(args)`` converts the arguments for the op (ints to
    tensors) when given. Returns (out, lse); lse is None from the direct call when it was
    not asked for."""
    if _direct_ok(tensors):
        return impl(*args)
    return op(*(args if to_op is None else to_op(args)))


def _block_runs(blocks: np.ndarray, viewable: bool) -> list[tuple[int, int, int]]:
    """(first table slot, first block id, block count) per run of consecutive block ids in a
    sequence's table row (a run is one strided view of the pool); every block its own run
    when the pool's pages are not laid out back to back."""
    if not blocks.size:
        return []
    cut = np.flatnonzero(np.diff(blocks) != 1) + 1 if viewable else np.arange(1, blocks.size)
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [blocks.size]))
    return [(int(a), int(blocks[a]), int(b - a)) for a, b in zip(starts, ends)]


def paged_attend_scored(q4, o4, lse, k_cache, v_cache, table, opts, shared, rows, kv_lens, q_lens):
    """Softcap and / or ALiBi on a paged pool, read in place: the decode kernel that reads
    pages has no score transforms, so each run of consecutive blocks of a sequence is a
    strided (1, H_kv, n, d) view handed to the tiled forward kernel (softcap as its score
    transform; ALiBi and the causal / window limits, which depend on a key's position in
    the whole sequence, as an additive (1, H, Lq, n) bias), and the runs' partial results
    are merged by their lse. One kernel call per run: a fragmented table costs one call per
    block. q4 (B, Lq, H, d), o4 (B, Lq, H, dv) tensors; lse (B, H, Lq) NumPy or None;
    sequence b has q_lens[b] (None: Lq) queries, aligned bottom-right on its kv_lens[b]
    keys. With several runs the partial outputs are in q's dtype before the merge (16-bit:
    one more rounding than the contiguous path)."""
    B, Lq, H, _ = q4.shape
    page = k_cache.shape[1]
    # consecutive blocks are one view when a block's rows follow the previous block's
    viewable = all(c.stride(0) == page * c.stride(1) for c in (k_cache, v_cache))
    f64 = q4.dtype == torch.float64
    cdt = torch.float64 if f64 else torch.float32
    left, right = opts.window_lr()
    score = _score_args(H, np.float64 if f64 else np.float32, opts.softcap, None, None)
    for b in range(B):
        n, nq = int(kv_lens[b]), Lq if q_lens is None else int(q_lens[b])
        slopes = shared if rows is None else rows[b]
        parts = []
        for slot, blk, count in _block_runs(table[b, : -(-n // page)], viewable):
            j0 = slot * page  # the run's first key in the sequence
            m = min(count * page, n - j0)
            kr = k_cache[blk : blk + count].reshape(count * page, *k_cache.shape[2:])[:m]
            vr = v_cache[blk : blk + count].reshape(count * page, *v_cache.shape[2:])[:m]
            dist = torch.arange(nq).reshape(-1, 1) + (n - nq - j0) - torch.arange(m)
            hidden = torch.zeros(dist.shape, dtype=torch.bool)
            if right >= 0:
                hidden |= dist < -right
            if left >= 0:
                hidden |= dist > left
            if bool(hidden.all()):
                continue
            bias = torch.zeros((1, H, nq, m), dtype=cdt)
            if slopes is not None:
                bias -= slopes.to(cdt).reshape(1, H, 1, 1) * dist.abs().to(cdt)
            bias.masked_fill_(hidden, float("-inf"))
            o_r = torch.empty((1, nq, H, vr.shape[-1]), dtype=q4.dtype)
            l_r = torch.empty((1, H, nq), dtype=cdt)
            mask = MaskArgs(bias=bias.numpy())
            kernel = _dispatch.choose_kernel(Lq=nq, Lk=m, mask=mask, score=score)
            _dispatch.attend(
                kernel,
                np4(q4[b : b + 1, :nq], "q"),
                np4(kr[None], "k_cache"),
                np4(vr[None], "v_cache"),
                np4(o_r, "out"),
                l_r.numpy(),
                scale=opts.scale,
                mask=mask,
                score=score,
            )
            parts.append((o_r[0], l_r[0]))
        if not parts:
            o4[b, :nq] = 0
            if lse is not None:
                lse[b, :, :nq] = -np.inf
            continue
        if len(parts) == 1:
            o_b, l_b = parts[0]
        else:
            ls = torch.stack([p[1] for p in parts])  # (runs, H, nq)
            l_b = torch.logsumexp(ls, dim=0)
            w = torch.exp(ls - l_b).nan_to_num(0.0)  # rows no run sees: -inf - -inf
            w = w.permute(0, 2, 1).unsqueeze(-1)  # (runs, nq, H, 1)
            o_b = (torch.stack([p[0] for p in parts]).to(cdt) * w).sum(0)
        o4[b, :nq] = o_b
        if lse is not None:
            lse[b, :, :nq] = l_b.numpy()


def define_op(name: str, impl, mutates_args: tuple = ()):
    """The torch op ``attn_fast::<name>`` whose schema is impl's annotations and whose body
    is impl with an lse of None (not asked for) returned as an empty tensor (an op returns
    tensors)."""
    schema = torch.library.infer_schema(impl, mutates_args=mutates_args)

    def body(*args):
        return tuple(no_lse(args[0]) if x is None else x for x in impl(*args))

    body.__name__ = impl.__name__
    return torch.library.custom_op(
        f"attn_fast::{name}", body, mutates_args=mutates_args, device_types="cpu", schema=schema
    )


def register_backward(forward_op, backward_op, n_forward_only: int) -> None:
    """forward_op(q, k, v, *rest, *forward_only) -> (out, lse) gets the gradient
    backward_op(dout, q, k, v, out, lse, *rest) -> (dq, dk, dv), rest being the forward's
    inputs after v without its last n_forward_only (need_lse, block_table). lse is not
    differentiable (flash-attn's convention)."""

    def setup_context(ctx, inputs, output):
        rest = inputs[3 : len(inputs) - n_forward_only]
        ctx.where = [i for i, x in enumerate(rest) if isinstance(x, torch.Tensor)]
        ctx.rest = list(rest)
        for i in ctx.where:  # tensors travel through save_for_backward
            ctx.rest[i] = None
        ctx.n_inputs = len(inputs)
        ctx.save_for_backward(*inputs[:3], *output, *(rest[i] for i in ctx.where))
        ctx.mark_non_differentiable(output[1])

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        if not lse.numel() and out.numel():
            raise RuntimeError("the forward ran with need_lse=False: it has no backward")
        rest = list(ctx.rest)
        for i, t in zip(ctx.where, saved):
            rest[i] = t
        dq, dk, dv = backward_op(dout, q, k, v, out, lse, *rest)
        return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)

    forward_op.register_autograd(backward, setup_context=setup_context)


def no_lse(q: torch.Tensor) -> torch.Tensor:
    """The lse output of an op call that did not ask for it."""
    return q.new_empty((0,), dtype=lse_dtype(q.dtype))


def transposed_like(x: torch.Tensor) -> torch.Tensor:
    """A new (B, L, H, d) tensor with the strides of a (B, H, L, d) contiguous one
    transposed: the layout the (B, H, L, d) kernels write gradients in."""
    return x.new_empty((x.shape[0], x.shape[2], x.shape[1], x.shape[3])).transpose(1, 2)
