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
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from numpy.typing import ArrayLike

import attn_fast as af

from ._checks import _is_torch_tensor, check_int, check_qkv, check_scale

__all__ = [
    "ring_attention",
    "ulysses_attention",
    "RingStats",
    "shard_sequence",
    "gather_sequence",
    "positions",
]

LAYOUTS = ("zigzag", "contiguous")
_FLOAT = (torch.float32, torch.float64)
_TAG_KV, _TAG_DKV = (
    11,
    12,
)  # distinct tags: K/V and dK/dV between the same pair of ranks in flight at once


class RingStats(NamedTuple):
    """What one ring_attention forward did on this rank (``return_stats=True``).

    compute_s : seconds in the local attention calls and merges.

    wait_s : seconds spent waiting for K/V blocks after the compute of a step
        was done (communication that did not hide under compute).

    total_s : wall time of the whole forward on this rank.
    pairs : visible (query, key) pairs computed by this rank (the work, exact).
    blocks : (query chunk, key chunk) blocks sent to the kernel.
    skipped : blocks skipped because the mask leaves them empty.
    bytes_sent : bytes this rank sent (K/V blocks).
    """

    compute_s: float
    wait_s: float
    total_s: float
    pairs: int
    blocks: int
    skipped: int
    bytes_sent: int


@dataclasses.dataclass(frozen=True)
class _Cfg:
    is_causal: bool
    scale: float
    enable_gqa: bool
    window: tuple | None  # (left, right) with None = unbounded, or None
    layout: str
    group: object
    rank: int
    world: int


# ---------------------------------------------------------------- layouts


def _chunks(rank, P, n, layout):
    """The rank's shard as [(local start, length, global start)], in local order."""
    if layout == "contiguous":
        return [(0, n, rank * n)]
    c = n // 2
    return [(0, c, rank * c), (c, c, (2 * P - 1 - rank) * c)]


def positions(rank: int, world_size: int, n: int, layout: str = "zigzag") -> np.ndarray:
    """Global positions (n,) int64 of the n rows rank `rank` holds in `layout`."""
    _check_layout(layout)
    if layout == "zigzag" and n % 2:
        raise ValueError(f"the zigzag layout needs an even shard length, got n = {n}")
    return np.concatenate(
        [np.arange(g, g + m) for _, m, g in _chunks(rank, world_size, n, layout)]
        or [np.zeros(0, np.int64)]
    ).astype(np.int64)


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
    _check_layout(layout)
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
    _check_layout(layout)
    P = len(shards)
    n = shards[0].shape[dim]
    pos = np.concatenate([positions(r, P, n, layout) for r in range(P)])
    order = np.argsort(pos)
    if kinds == {"numpy"}:
        return np.take(np.concatenate(shards, axis=dim), order, axis=dim)
    return torch.cat(shards, dim=dim).index_select(dim, torch.from_numpy(order))


# ---------------------------------------------------------------- bands


def _band(nq, nk, lo, hi):
    """The visible part of a block where (local key j) − (local query i) ∈ [lo, hi].

    lo / hi None = unbounded. Returns None when nothing is visible, else
    (r0, r1, s0, s1, window): query rows [r0, r1) and keys [s0, s1) hold every
    visible pair, and inside that sub-block the band is the bottom-right
    window `window` = (left, right) (None = no mask at all)."""
    if nq == 0 or nk == 0:
        return None
    if lo is not None and lo <= -(nq - 1):
        lo = None  # every pair already has j - i >= -(nq - 1)
    if hi is not None and hi >= nk - 1:
        hi = None
    if lo is not None and hi is not None and lo > hi:
        return None
    r0 = 0 if hi is None else max(0, -hi)
    r1 = nq if lo is None else min(nq, nk - lo)
    if r0 >= r1:
        return None
    s0 = 0 if lo is None else max(0, r0 + lo)
    s1 = nk if hi is None else min(nk, r1 + hi)
    if s0 >= s1:
        return None
    if lo is None and hi is None:
        return r0, r1, s0, s1, None
    off = (s1 - s0) - (r1 - r0)  # the sub-block's bottom-right diagonal
    left = None if lo is None else off - (lo + r0 - s0)
    right = None if hi is None else (hi + r0 - s0) - off
    return r0, r1, s0, s1, (left, right)


def _band_pairs(nq, nk, lo, hi):
    """Visible pairs in a block with j − i ∈ [lo, hi] (None = unbounded), exact."""
    i = np.arange(nq, dtype=np.int64)
    first = np.zeros(nq, np.int64) if lo is None else np.maximum(0, i + lo)
    last = np.full(nq, nk - 1, np.int64) if hi is None else np.minimum(nk - 1, i + hi)
    return int(np.maximum(0, last - first + 1).sum())


def _pair_bounds(cfg, qg, kg):
    """(lo, hi) of j − i for a query chunk at global start qg and keys at kg."""
    o = qg - kg  # j_global - i_global = (j - i) - o
    lo = hi = None
    if cfg.window is not None:
        left, right = cfg.window
        lo = None if left is None else o - left
        hi = None if right is None else o + right
    if cfg.is_causal:
        hi = o if hi is None else min(hi, o)
    return lo, hi


def _blocks(cfg, n, src):
    """The (query chunk, key chunk) blocks of this rank against rank src's K/V:
    [(q start, k start, band, pairs)] in local rows, empty blocks as band None."""
    out = []
    for qs, qn, qg in _chunks(cfg.rank, cfg.world, n, cfg.layout):
        for ks, kn, kg in _chunks(src, cfg.world, n, cfg.layout):
            lo, hi = _pair_bounds(cfg, qg, kg)
            band = _band(qn, kn, lo, hi)
            out.append((qs, ks, band, 0 if band is None else _band_pairs(qn, kn, lo, hi)))
    return out


def _sdpa_kwargs(cfg, window):
    kw = dict(scale=cfg.scale, enable_gqa=cfg.enable_gqa)
    if window is None:
        kw["is_causal"] = False
    elif window[0] is None and window[1] == 0:
        kw["is_causal"] = True  # the diagonal block: plain causal
    else:
        kw["is_causal"] = False
        kw["window_size"] = window
    return kw


# ---------------------------------------------------------------- checks


def _check_layout(layout):
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


def _group_info(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "(e.g. backend='gloo' under torchrun) before ring_attention / ulysses_attention"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the process group passed as `group`")
    return rank, dist.get_world_size(group)


def _check_tensors(q, k, v, enable_gqa):
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


def _prepare(q, k, v, is_causal, scale, enable_gqa, group, layout, window_size, extra_codes=()):
    _check_tensors(q, k, v, enable_gqa)
    _check_layout(layout)
    window = _check_window(window_size)
    rank, world = _group_info(group)
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
    return _Cfg(bool(is_causal), scale, bool(enable_gqa), window, layout, group, rank, world)


# ---------------------------------------------------------------- merge


def _merge_(o_acc, lse_acc, o_b, lse_b):
    """In place: (o_acc, lse_acc) <- the exact merge with (o_b, lse_b) (lse rule).

    o (..., n, dv), lse (..., n); a part with lse = -inf adds nothing (its o
    is not read); both empty stays o = 0, lse = -inf; a NaN lse gives NaN."""
    lse_new = torch.logaddexp(lse_acc, lse_b)
    empty = torch.isneginf(lse_new)
    safe = torch.where(empty, torch.zeros_like(lse_new), lse_new)
    wa = torch.where(torch.isneginf(lse_acc), torch.zeros_like(safe), torch.exp(lse_acc - safe))
    wb = torch.where(torch.isneginf(lse_b), torch.zeros_like(safe), torch.exp(lse_b - safe))
    o_acc.mul_(wa.unsqueeze(-1))
    o_acc.add_(
        torch.where(
            (wb > 0).unsqueeze(-1) | torch.isnan(wb).unsqueeze(-1), o_b * wb.unsqueeze(-1), 0.0
        )
    )
    lse_acc.copy_(lse_new)


# ---------------------------------------------------------------- point to point


def _peer(cfg, delta):
    r = (cfg.rank + delta) % cfg.world
    return dist.get_global_rank(cfg.group, r) if cfg.group is not None else r


def _exchange(cfg, send_buf, recv_buf, tag):
    """Start sending send_buf to the next rank and receiving recv_buf from the previous one."""
    return [
        dist.isend(send_buf, _peer(cfg, 1), group=cfg.group, tag=tag),
        dist.irecv(recv_buf, _peer(cfg, -1), group=cfg.group, tag=tag),
    ]


def _wait(reqs):
    for r in reqs:
        r.wait()


def _pack(*ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf, shapes):
    out, at = [], 0
    for s in shapes:
        m = int(np.prod(s))
        out.append(buf[at : at + m].view(s))
        at += m
    return out


# ---------------------------------------------------------------- ring


def _ring_forward(q, k, v, cfg, stats):
    t_start = time.perf_counter()
    B, H, n, _ = q.shape
    dv = v.shape[-1]
    o_acc = torch.zeros((B, H, n, dv), dtype=torch.float64)
    lse_acc = torch.full((B, H, n), -np.inf, dtype=torch.float64)
    shapes = (tuple(k.shape), tuple(v.shape))
    bufs = [_pack(k, v), None]
    if cfg.world > 1:
        bufs[1] = torch.empty_like(bufs[0])
    qn = q.detach().numpy()
    compute = wait = 0.0
    pairs = blocks = skipped = sent = 0
    for step in range(cfg.world):
        cur = bufs[step % 2]
        reqs = []
        if step < cfg.world - 1:
            reqs = _exchange(cfg, cur, bufs[(step + 1) % 2], _TAG_KV)
            sent += cur.numel() * cur.element_size()
        t0 = time.perf_counter()
        kb, vb = (x.numpy() for x in _unpack(cur, shapes))
        for qs, ks, band, npairs in _blocks(cfg, n, (cfg.rank - step) % cfg.world):
            if band is None:
                skipped += 1
                continue
            r0, r1, s0, s1, window = band
            ob, lb = af.scaled_dot_product_attention(
                qn[:, :, qs + r0 : qs + r1],
                kb[:, :, ks + s0 : ks + s1],
                vb[:, :, ks + s0 : ks + s1],
                return_lse=True,
                **_sdpa_kwargs(cfg, window),
            )
            _merge_(
                o_acc[:, :, qs + r0 : qs + r1],
                lse_acc[:, :, qs + r0 : qs + r1],
                torch.from_numpy(ob),
                torch.from_numpy(lb),
            )
            blocks += 1
            pairs += npairs
        t1 = time.perf_counter()
        _wait(reqs)
        compute += t1 - t0
        wait += time.perf_counter() - t1
    if stats is not None:
        stats.append(
            RingStats(
                compute, wait, time.perf_counter() - t_start, pairs * B * H, blocks, skipped, sent
            )
        )
    return o_acc, lse_acc


def _ring_backward(dout, q, k, v, out, lse, cfg):
    B, H, n, d = q.shape
    gdt = torch.float64 if q.dtype == torch.float64 else torch.float32  # what dK/dV travel in
    shapes = (tuple(k.shape), tuple(v.shape))
    kv = [_pack(k, v), None]
    dkv = [torch.zeros(kv[0].numel(), dtype=gdt), None]
    if cfg.world > 1:
        kv[1] = torch.empty_like(kv[0])
        dkv[1] = torch.empty_like(dkv[0])
    dq = torch.zeros(q.shape, dtype=gdt)
    kv_reqs, dkv_send, dkv_recv = [], [], []
    for step in range(cfg.world):
        cur = kv[step % 2]
        kv_reqs = _exchange(cfg, cur, kv[(step + 1) % 2], _TAG_KV) if step < cfg.world - 1 else []
        _wait(dkv_recv)  # the accumulator of this step's block, from the previous rank
        acc = dkv[step % 2]
        kb, vb = _unpack(cur, shapes)
        dkb, dvb = _unpack(acc, shapes)
        for qs, ks, band, _ in _blocks(cfg, n, (cfg.rank - step) % cfg.world):
            if band is None:
                continue
            r0, r1, s0, s1, window = band
            rq, rk = slice(qs + r0, qs + r1), slice(ks + s0, ks + s1)
            kw = _sdpa_kwargs(cfg, window)
            gq, gk, gv = _local_backward(
                dout[:, :, rq],
                q[:, :, rq],
                kb[:, :, rk],
                vb[:, :, rk],
                out[:, :, rq],
                lse[:, :, rq],
                is_causal=kw["is_causal"],
                scale=cfg.scale,
                enable_gqa=cfg.enable_gqa,
                window_size=kw.get("window_size"),
            )
            dq[:, :, rq] += gq
            dkb[:, :, rk] += gk
            dvb[:, :, rk] += gv
        if cfg.world > 1:
            _wait(dkv_send)  # the other buffer is free again
            dkv_send, dkv_recv = (lambda r: ([r[0]], [r[1]]))(
                _exchange(cfg, acc, dkv[(step + 1) % 2], _TAG_DKV)
            )
        _wait(kv_reqs)
    _wait(dkv_recv)
    _wait(dkv_send)
    dk, dv = _unpack(dkv[cfg.world % 2 if cfg.world > 1 else 0], shapes)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def _local_backward(
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


class _RingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg, stats):
        o64, lse64 = _ring_forward(q.detach(), k.detach(), v.detach(), cfg, stats)
        out, lse = o64.to(q.dtype), lse64.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse64)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse64 = ctx.saved_tensors
        if dout is None:
            return None, None, None, None, None
        dq, dk, dv = _ring_backward(
            dout.contiguous(), q.detach(), k.detach(), v.detach(), out, lse64, ctx.cfg
        )
        return dq, dk, dv, None, None


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
    cfg = _prepare(
        q, k, v, is_causal, scale, enable_gqa, group, layout, window_size, extra_codes=(0,)
    )
    stats = [] if return_stats else None
    out, lse = _RingFn.apply(q, k, v, cfg, stats)
    extra = ([lse] if return_lse else []) + ([stats[0]] if return_stats else [])
    return (out, *extra) if extra else out


# ---------------------------------------------------------------- ulysses


def _seq_to_heads(x, cfg):
    """(B, h·P, n, e) sequence shard -> (B, h, L, e) head shard, global order."""
    B, Hx, n, e = x.shape
    P = cfg.world
    h = Hx // P
    send = x.reshape(B, P, h, n, e).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    if P > 1:
        dist.all_to_all_single(recv, send, group=cfg.group)
    else:
        recv = send
    y = recv.permute(1, 2, 0, 3, 4).reshape(B, h, P * n, e)  # rank order
    return y.index_select(2, _order(cfg, n))


def _heads_to_seq(y, cfg, n):
    """(B, h, L, e) head shard in global order -> (B, h·P, n, e) sequence shard."""
    B, h, L, e = y.shape
    P = cfg.world
    inv = torch.from_numpy(np.argsort(_order(cfg, n).numpy()))
    y = y.index_select(2, inv).reshape(B, h, P, n, e)  # rank order
    send = y.permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    if P > 1:
        dist.all_to_all_single(recv, send, group=cfg.group)
    else:
        recv = send
    return recv.permute(1, 0, 2, 3, 4).reshape(B, P * h, n, e)


def _order(cfg, n):
    """Index into the rank-ordered concatenation of shards, in global position order."""
    pos = np.concatenate([positions(r, cfg.world, n, cfg.layout) for r in range(cfg.world)])
    return torch.from_numpy(np.argsort(pos))


def _mask_heads(m, H, heads):
    """attn_mask for this rank's heads: (B|1, H, L, L) arrays / tensors sliced, in lists too."""
    if isinstance(m, (list, tuple)):
        return [_mask_heads(x, H, heads) for x in m]
    if isinstance(m, (np.ndarray, torch.Tensor)) and m.ndim == 4 and m.shape[1] == H and H > 1:
        return m[:, heads]
    return m


class _UlyssesFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg, rep, sdpa_kw, want_lse):
        n = q.shape[2]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        qh, kh, vh = (_seq_to_heads(x.detach(), cfg) for x in (q, k, v))
        oh, lh = af.scaled_dot_product_attention(
            qh.numpy(),
            kh.numpy(),
            vh.numpy(),
            is_causal=cfg.is_causal,
            scale=cfg.scale,
            enable_gqa=cfg.enable_gqa,
            window_size=cfg.window,
            return_lse=True,
            **sdpa_kw,
        )
        oh, lh = torch.from_numpy(oh), torch.from_numpy(lh)
        out = _heads_to_seq(oh, cfg, n)
        # lse back to sequence shards only when asked for (the backward uses the head shards)
        lse = _heads_to_seq(lh.unsqueeze(-1), cfg, n).squeeze(-1) if want_lse else lh.new_empty(0)
        ctx.save_for_backward(qh, kh, vh, oh, lh)
        ctx.cfg, ctx.rep, ctx.n, ctx.sdpa_kw = cfg, rep, n, sdpa_kw
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        if dout is None:
            return None, None, None, None, None, None, None
        qh, kh, vh, oh, lh = ctx.saved_tensors
        cfg, n = ctx.cfg, ctx.n
        doh = _seq_to_heads(dout.contiguous(), cfg)
        gq, gk, gv = _local_backward(
            doh,
            qh,
            kh,
            vh,
            oh,
            lh,
            is_causal=cfg.is_causal,
            scale=cfg.scale,
            enable_gqa=cfg.enable_gqa,
            window_size=cfg.window,
            **ctx.sdpa_kw,
        )
        dq, dk, dv = (_heads_to_seq(g.to(qh.dtype).contiguous(), cfg, n) for g in (gq, gk, gv))
        if ctx.rep > 1:
            B, Hr, _, _ = dk.shape
            dk = dk.view(B, Hr // ctx.rep, ctx.rep, n, -1).sum(2)
            dv = dv.view(B, Hr // ctx.rep, ctx.rep, n, -1).sum(2)
        return dq, dk, dv, None, None, None, None


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
    _check_tensors(q, k, v, enable_gqa)
    rank, world = _group_info(group)
    H, Hkv = q.shape[1], k.shape[1]
    if H % world:
        raise ValueError(
            f"q has {H} heads, not a multiple of the {world} ranks: ulysses_attention shards "
            "heads (H % P == 0)"
        )
    rep = 1 if Hkv % world == 0 else H // Hkv
    # 1 = Ulysses (0 = ring: a rank calling the other function fails the check instead of hanging)
    used = tuple(x is not None for x in (attn_mask, softcap, alibi_slopes, sinks))
    cfg = _prepare(
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
        sdpa_kw["attn_mask"] = _mask_heads(attn_mask, H, heads)
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
    out, lse = _UlyssesFn.apply(q, k, v, cfg, rep, sdpa_kw, bool(return_lse))
    return (out, lse) if return_lse else out
