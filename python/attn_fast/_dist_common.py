"""Plumbing shared by the ring and the all-to-all (Ulysses) attention of
``attn_fast.distributed``: the layouts' chunks and ``positions``, the argument and
process-group checks, the per-call record ``prepare`` returns, and the local
backward of one block given the global out and lse.

The module docstring of ``attn_fast.distributed`` states the layouts, the masks
over global positions and the shape legend these functions use.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

import attn_fast as af

from ._checks import check_int, check_qkv, check_scale

LAYOUTS = ("zigzag", "contiguous")
_FLOAT = (torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class Cfg:
    is_causal: bool
    scale: float
    enable_gqa: bool
    window: tuple | None  # (left, right) with None = unbounded, or None
    layout: str
    group: object
    rank: int
    world: int


# ---------------------------------------------------------------- layouts


def chunks(rank, P, n, layout):
    """The rank's shard as [(local start, length, global start)], in local order."""
    if layout == "contiguous":
        return [(0, n, rank * n)]
    c = n // 2
    return [(0, c, rank * c), (c, c, (2 * P - 1 - rank) * c)]


def positions(rank: int, world_size: int, n: int, layout: str = "zigzag") -> np.ndarray:
    """Global positions (n,) int64 of the n rows rank `rank` holds in `layout`."""
    check_layout(layout)
    if layout == "zigzag" and n % 2:
        raise ValueError(f"the zigzag layout needs an even shard length, got n = {n}")
    return np.concatenate(
        [np.arange(g, g + m) for _, m, g in chunks(rank, world_size, n, layout)]
        or [np.zeros(0, np.int64)]
    ).astype(np.int64)


# ---------------------------------------------------------------- checks


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check_window(window_size):
    if window_size is None:
        return None
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    out = []
    for name, x in (("window_size[0]", left), ("window_size[1]", right)):
        x = None if x is None else check_int(x, name)
        if x is not None and x < -1:
            raise ValueError(
                f"window_size entries must be >= 0 (or -1/None for unbounded), got {window_size!r}"
            )
        out.append(None if x is None or x == -1 else x)
    return tuple(out)


def group_info(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "(e.g. backend='gloo' under torchrun) before ring_attention / ulysses_attention"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the process group passed as `group`")
    return rank, dist.get_world_size(group)


def check_tensors(q, k, v, enable_gqa):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor (this rank's CPU shard), got {type(x).__name__}"
            )
        if x.device.type != "cpu":
            raise TypeError(
                f"{name} is on device {x.device}; attn_fast.distributed computes on the CPU (use "
                ".cpu())"
            )
        if x.layout != torch.strided:
            raise TypeError(
                f"{name} has layout {x.layout}; only dense (strided) tensors are supported"
            )
        if x.dtype not in _FLOAT:
            raise TypeError(
                f"{name} has dtype {x.dtype}; float32 or float64 is supported (16-bit ring / "
                f"Ulysses attention is not: cast with {name}.float())"
            )
        if x.ndim != 4:
            raise ValueError(f"{name} must be (B, H, L/P, d), got shape {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    # How the shapes relate: the one q/k/v checker (reads the tensors as NumPy views).
    *_, (B, H, Hkv, n, nk, d, dv) = check_qkv(q, k, v, enable_gqa=enable_gqa)
    if nk != n:
        raise ValueError(
            f"k has shape {tuple(k.shape)} but q has shape {tuple(q.shape)}: context-parallel "
            "self-attention needs q and k/v shards of the same length"
        )


def _check_shards(q, k, v, cfg_codes, group, world):
    """One small all_gather: every rank must pass the same shapes, dtype and options."""
    mine = torch.tensor([*q.shape, *k.shape, *v.shape, *cfg_codes], dtype=torch.float64)
    allv = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(allv, mine, group=group)
    if any(not torch.equal(a, mine) for a in allv):
        rows = [a.tolist() for a in allv]
        desc = "; ".join(
            f"rank {r}: q {tuple(int(x) for x in a[0:4])} k {tuple(int(x) for x in a[4:8])} "
            f"v {tuple(int(x) for x in a[8:12])} options {a[12:]}"
            for r, a in enumerate(rows)
        )
        raise ValueError(f"the ranks' shards or options differ (all must match): {desc}")


def prepare(q, k, v, is_causal, scale, enable_gqa, group, layout, window_size, extra_codes=()):
    check_tensors(q, k, v, enable_gqa)
    check_layout(layout)
    window = _check_window(window_size)
    rank, world = group_info(group)
    n = q.shape[2]
    if layout == "zigzag" and n % 2:
        raise ValueError(
            "the zigzag layout needs an even shard length (two chunks per rank), got q shape "
            f"{tuple(q.shape)}"
        )
    scale = check_scale(scale, q.shape[-1], q.detach().numpy().dtype)
    w = (-2, -2) if window is None else tuple(-1 if x is None else x for x in window)
    extra = (tuple(extra_codes) + (0,) * 8)[
        :8
    ]  # a fixed length: all_gather needs one size on every rank
    codes = (
        _FLOAT.index(q.dtype),
        LAYOUTS.index(layout),
        bool(is_causal),
        bool(enable_gqa),
        scale,
        *w,
        *extra,
    )
    _check_shards(q, k, v, codes, group, world)
    return Cfg(bool(is_causal), scale, bool(enable_gqa), window, layout, group, rank, world)


def local_backward(
    dout, q, k, v, out, lse, *, is_causal, scale, enable_gqa, window_size, **options
):
    """One block's contribution to (dq, dk, dv) given the *global* out and lse.

    dout, q, out (B, H, Lq, ·); k (B, H_kv, Lk, d), v (B, H_kv, Lk, dv); lse
    (B, H, Lq); torch CPU tensors (views). is_causal / window_size are aligned
    bottom-right within the block, as in the forward. With D = rowsum(dO∘O)
    and P = exp(S − lse) (0 where masked or lse = −inf):
        dV = Pᵀ dO,  dS = P∘(dO Vᵀ − D),  dQ = scale·dS K,  dK = scale·dSᵀ Q,
    computed by the fused kernel (``attn_fast.scaled_dot_product_attention_backward``)
    on NumPy views. ``options`` (attn_mask, softcap, alibi_slopes, sinks) go to
    it as they went to the forward; a dsinks result is dropped (sinks are
    constants here). Returns torch tensors of q's dtype.
    """
    dt = q.dtype
    res = af.scaled_dot_product_attention_backward(
        dout.detach().to(dt).numpy(),
        q.detach().numpy(),
        k.detach().numpy(),
        v.detach().numpy(),
        out.detach().to(dt).numpy(),
        lse.detach().to(dt).numpy(),
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        window_size=window_size,
        **options,
    )
    return tuple(torch.from_numpy(np.asarray(x)) for x in res[:3])
