"""The ring of ``attn_fast.distributed.ring_attention``: K/V blocks travel round
the ring (isend to the next rank, irecv from the previous one) while the local
block is computed, and partial outputs are merged with the lse rule; the
backward passes K/V round again with dK/dV travelling one step behind.

Each (query chunk, key chunk) block is a band of visible pairs (``_band``): empty
blocks are skipped, partly visible ones are cut to the rows and keys they touch.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

import attn_fast as af

from ._dist_common import chunks, local_backward

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
    for qs, qn, qg in chunks(cfg.rank, cfg.world, n, cfg.layout):
        for ks, kn, kg in chunks(src, cfg.world, n, cfg.layout):
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
            gq, gk, gv = local_backward(
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


class RingFn(torch.autograd.Function):
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
