"""Context-parallel attention over torch.distributed: the ring and all-to-all (Ulysses).

The sequence of length L is split over the P ranks of a process group; each
rank holds its shard of q, k and v, shape (B, H, L/P, d), as CPU torch tensors.

    ring_attention      K/V blocks travel round the ring (isend/irecv to the
                        next rank, from the previous one) while the local block
                        is computed; partial outputs are merged with the lse
                        rule. Memory per rank: O(L/P), never the whole sequence.
    ulysses_attention   all_to_all from sequence shards to head shards, one
                        local attn_fast call on the whole sequence for H/P
                        heads (any mask it supports), all_to_all back.

Shape legend: B batch, H query heads, H_kv key/value heads (GQA), L the global
sequence length, n = L/P the shard length, d and dv the head dims.

Layouts (``layout``) say which global positions a rank's n rows hold::

    "contiguous"  rank r holds [r·n, (r+1)·n)
    "zigzag"      the sequence is cut into 2P chunks of c = n/2 rows; rank r
                  holds chunk r then chunk 2P−1−r (n must be even). With a
                  causal mask every rank then sees the same number of
                  (query, key) pairs, (2P−1)·c² + c(c+1), so no rank waits
                  for the others (the contiguous layout gives rank P−1 about
                  2P−1 times the work of rank 0).

Masks are over global positions, aligned as in ``scaled_dot_product_attention``
(bottom-right, which for a self-attention Lq = Lk is the usual causal mask):
query position i sees key position j iff j <= i (is_causal) and
i − left <= j <= i + right (window_size = (left, right)). In the ring each
(query chunk, key chunk) pair is then a band of the block: fully visible,
partly visible (the diagonal, the window's edges), or empty, which is skipped
without being sent to the kernel. A partly visible band is cut to the rows and
keys it touches and handed to the kernel as a bottom-right window, so the
kernel computes no tile the mask leaves empty.

Gradients: both functions are ``torch.autograd.Function`` subclasses. The ring backward
uses the global out and lse (saved by the forward) and passes K/V round the ring
again, with dK/dV accumulators (float32 for float32 inputs, float64 for
float64) travelling one step behind, so they end at the rank owning the block.

This module needs torch and is imported on its own (``import
attn_fast.distributed``), not by ``import attn_fast``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from numpy.typing import ArrayLike

from ._checks import _is_torch_tensor, check_int
from ._dist_common import (  # noqa: F401  (LAYOUTS: the layout names, for command lines)
    LAYOUTS,
    check_layout,
    check_tensors,
    group_info,
    positions,
    prepare,
)
from ._dist_ring import RingFn, RingStats
from ._dist_ulysses import UlyssesFn, mask_heads

__all__ = [
    "ring_attention",
    "ulysses_attention",
    "RingStats",
    "shard_sequence",
    "gather_sequence",
    "positions",
]


# ---------------------------------------------------------------- layouts


def _seq_kind(x, name):
    """'torch' or 'numpy' for a torch tensor or NumPy array `x`, else TypeError naming it."""
    if _is_torch_tensor(x):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    raise TypeError(f"{name} must be a torch tensor or a NumPy array, got {type(x).__name__}")


def _seq_axis(x, dim, name):
    """`dim` as an axis of `x` (negative counts from the end), or ValueError."""
    dim = check_int(dim, "dim")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim = {dim} is not an axis of {name} of shape {tuple(x.shape)}")
    return dim


def shard_sequence(
    x: torch.Tensor | np.ndarray,
    rank: int,
    world_size: int,
    layout: str = "zigzag",
    dim: int = -2,
) -> torch.Tensor | np.ndarray:
    """This rank's shard of a whole-sequence tensor x (sequence on axis `dim`): a copy, L/P rows.

    x: a torch tensor or NumPy array (any dtype); the shard is of the same kind and dtype."""
    kind = _seq_kind(x, "x")
    dim = _seq_axis(x, dim, "x")
    world_size = check_int(world_size, "world_size", 1)
    rank = check_int(rank, "rank", 0)
    if rank >= world_size:
        raise ValueError(f"rank = {rank} must be below world_size = {world_size}")
    check_layout(layout)
    L = x.shape[dim]
    if L % world_size or (layout == "zigzag" and L % (2 * world_size)):
        need = 2 * world_size if layout == "zigzag" else world_size
        raise ValueError(
            f"sequence length {L} (axis {dim} of shape {tuple(x.shape)}) is not a multiple of "
            f"{need}"
        )
    idx = positions(rank, world_size, L // world_size, layout)
    if kind == "numpy":
        return np.take(x, idx, axis=dim)
    return x.index_select(dim, torch.from_numpy(idx))


def gather_sequence(
    shards: Sequence[torch.Tensor] | Sequence[np.ndarray], layout: str = "zigzag", dim: int = -2
) -> torch.Tensor | np.ndarray:
    """The whole-sequence tensor from the list of all ranks' shards (inverse of shard_sequence).

    shards: one shard per rank, in rank order, all torch tensors or all NumPy arrays of
    the same shape; the result is of their kind."""
    shards = list(shards)
    if not shards:
        raise ValueError("shards is empty: pass one shard per rank")
    kinds = {_seq_kind(t, f"shards[{i}]") for i, t in enumerate(shards)}
    if len(kinds) > 1:
        raise TypeError("shards mixes torch tensors and NumPy arrays: pass one kind")
    dim = _seq_axis(shards[0], dim, "shards[0]")
    if any(tuple(t.shape) != tuple(shards[0].shape) for t in shards):
        raise ValueError(
            "shards must all have one shape, got " + ", ".join(str(tuple(t.shape)) for t in shards)
        )
    check_layout(layout)
    P = len(shards)
    n = shards[0].shape[dim]
    pos = np.concatenate([positions(r, P, n, layout) for r in range(P)])
    order = np.argsort(pos)
    if kinds == {"numpy"}:
        return np.take(np.concatenate(shards, axis=dim), order, axis=dim)
    return torch.cat(shards, dim=dim).index_select(dim, torch.from_numpy(order))


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    group: Any = None,
    layout: str = "zigzag",
    window_size: tuple[int | None, int | None] | None = None,
    return_lse: bool = False,
    return_stats: bool = False,
) -> Any:
    """Context-parallel attention: this rank's shard of softmax(scale·q kᵀ + mask) v.

    q : (B, H, n, d) float32/float64 CPU torch tensor, this rank's n = L/P rows
        of the query sequence in `layout` (see ``shard_sequence``).

    k : (B, H_kv, n, d), v : (B, H_kv, n, dv): the same rows of keys/values.
        Every rank of `group` must pass the same shapes, dtype and options
        (checked with one small all_gather; a mismatch raises ValueError on
        every rank).

    is_causal : key position j visible to query position i iff j <= i (global).
    scale : default 1/sqrt(d).  enable_gqa : H_kv < H, H % H_kv == 0.

    group : a torch.distributed process group (default: the world); it must
        be initialised (RuntimeError otherwise). Any backend with isend/irecv
        for CPU tensors (gloo).

    layout : "zigzag" (default; rank r holds chunks r and 2P−1−r, balancing
        causal work; n even) or "contiguous" (rank r holds [r·n, (r+1)·n)).

    window_size : (left, right) or None: key j visible to query i iff
        i − left <= j <= i + right over global positions (None/-1 =
        unbounded); combines with is_causal (e.g. (255, 0)).

    return_lse : also return lse (B, H, n), log Σ exp(scores) over all keys.
    return_stats : also return a ``RingStats`` of this rank's forward.

    K/V of each rank travel round the ring (P−1 steps of isend to the next
    rank / irecv from the previous), each step's transfer overlapping the
    attention of the block already here; blocks the mask leaves empty are
    skipped. Partial results are merged in float64 with the lse rule, so the
    output matches one-process attention on the whole sequence to the
    rounding of q's dtype. Rows that see no key: zeros, lse = −inf.

    Differentiable in q, k and v (not in lse). Returns out (B, H, n, dv) of
    q's dtype, or a tuple (out, lse, stats) of those asked for.
    """
    cfg = prepare(
        q, k, v, is_causal, scale, enable_gqa, group, layout, window_size, extra_codes=(0,)
    )
    stats = [] if return_stats else None
    out, lse = RingFn.apply(q, k, v, cfg, stats)
    extra = ([lse] if return_lse else []) + ([stats[0]] if return_stats else [])
    return (out, *extra) if extra else out


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Any = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    group: Any = None,
    layout: str = "zigzag",
    window_size: tuple[int | None, int | None] | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | ArrayLike | None = None,
    sinks: torch.Tensor | ArrayLike | None = None,
) -> Any:
    """Context-parallel attention by all-to-all (DeepSpeed-Ulysses): this
    rank's shard of the output.

    q : (B, H, n, d), k : (B, H_kv, n, d), v : (B, H_kv, n, dv): this rank's
        n = L/P rows of the sequence in `layout`, float32/float64 CPU torch
        tensors, the same shapes on every rank (checked).

    H % P must be 0 (ValueError otherwise). If H_kv % P != 0 (GQA with fewer
    kv heads than ranks), K/V heads are repeated to H before the exchange
    (more bytes sent; gradients are summed back over the repeats).

    One all_to_all turns the sequence shards into head shards (B, H/P, L, ·)
    in global order, one ``scaled_dot_product_attention`` call computes those
    heads over the whole sequence, and one all_to_all turns the result back.
    attn_mask, is_causal, window_size, softcap, alibi_slopes and sinks mean
    what they mean there, over global positions (Lq = Lk = L). attn_mask must
    not vary over heads (head axis of size 1), except a plain array / tensor
    of shape (B or 1, H, L, L) (alone or in a list), which is sliced to this
    rank's heads; alibi_slopes and sinks (H,) are sliced too. scale,
    enable_gqa, group and layout (default "zigzag") are as in
    ``ring_attention``; the shard-shape check is the same all_gather.

    Differentiable in q, k, v with every option (the fused backward kernel on
    the head shards); attn_mask, softcap, alibi_slopes and sinks are
    constants (no gradient: a sinks tensor that requires grad raises
    ValueError).
    Returns out (B, H, n, dv) of q's dtype, or (out, lse) with lse (B, H, n).
    """
    check_tensors(q, k, v, enable_gqa)
    rank, world = group_info(group)
    H, Hkv = q.shape[1], k.shape[1]
    if H % world:
        raise ValueError(
            f"q has {H} heads, not a multiple of the {world} ranks: ulysses_attention shards "
            "heads (H % P == 0)"
        )
    rep = 1 if Hkv % world == 0 else H // Hkv
    # 1 = Ulysses (0 = ring: a rank calling the other function fails the check instead of hanging)
    used = tuple(x is not None for x in (attn_mask, softcap, alibi_slopes, sinks))
    cfg = prepare(
        q, k, v, is_causal, scale, enable_gqa, group, layout, window_size, extra_codes=(1, *used)
    )
    if rep > 1:
        cfg = dataclasses.replace(cfg, enable_gqa=False)
    h = H // world
    heads = slice(rank * h, (rank + 1) * h)
    sdpa_kw = {}
    if isinstance(sinks, torch.Tensor) and sinks.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "ulysses_attention takes sinks as constants (no gradient); pass sinks.detach(), "
            "or attn_fast.torch.scaled_dot_product_attention on one process for their gradient"
        )
    if attn_mask is not None:
        sdpa_kw["attn_mask"] = mask_heads(attn_mask, H, heads)
    if softcap is not None:
        sdpa_kw["softcap"] = softcap
    for name, val in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if val is not None:
            arr = np.asarray(val.detach() if isinstance(val, torch.Tensor) else val).reshape(-1)
            if arr.shape != (H,):
                raise ValueError(
                    f"{name} must have one value per query head ({H},), got shape {np.shape(val)}"
                )
            sdpa_kw[name] = arr[heads]
    out, lse = UlyssesFn.apply(q, k, v, cfg, rep, sdpa_kw, bool(return_lse))
    return (out, lse) if return_lse else out
