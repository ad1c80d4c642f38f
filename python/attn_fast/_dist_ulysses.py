"""The all-to-all of ``attn_fast.distributed.ulysses_attention``
(DeepSpeed-Ulysses): sequence shards become head shards in global order, one
local attn_fast call computes those heads over the whole sequence (and its
backward), and the result goes back to sequence shards.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import attn_fast as af

from ._dist_common import local_backward, positions


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


def mask_heads(m, H, heads):
    """attn_mask for this rank's heads: (B|1, H, L, L) arrays / tensors sliced, in lists too."""
    if isinstance(m, (list, tuple)):
        return [mask_heads(x, H, heads) for x in m]
    if isinstance(m, (np.ndarray, torch.Tensor)) and m.ndim == 4 and m.shape[1] == H and H > 1:
        return m[:, heads]
    return m


class UlyssesFn(torch.autograd.Function):
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
        gq, gk, gv = local_backward(
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
