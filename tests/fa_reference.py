"""A port of flash-attn's own test reference and tolerance rule (tests/test_flash_attn.py of
Dao-AILab/flash-attention), written afresh for the CPU tests of attn_fast.flash_attn.

flash-attn's acceptance rule: an implementation passes when its largest error
against an fp32 reference (16-bit inputs upcast) is at most a small multiple
of the largest error of a plain torch implementation run in the 16-bit dtype
itself (``upcast=False``, with the scaling moved onto k: ``reorder=True``).
Shape legend: B batch, Lq / Lk lengths, H heads, H_kv key/value heads, d head dim.
"""

from __future__ import annotations

import math

import torch


def local_mask(Lq, Lk, window, q_pad=None, k_pad=None, leftpad=None):
    """True where query i must NOT see key j: outside [i + sk - sq - left, i + sk - sq + right],
    sk / sq the valid lengths (from the padding masks), keys renumbered from leftpad[b]."""
    row = torch.arange(Lq).reshape(-1, 1)
    col = torch.arange(Lk)
    if leftpad is not None:
        lp = leftpad.to(torch.int64).reshape(-1, 1, 1, 1)
        col = col.reshape(1, 1, 1, -1).expand(lp.shape[0], 1, 1, Lk)
        col = torch.where(col >= lp, col - lp, 2**32)
    sk = Lk if k_pad is None else k_pad.sum(-1).reshape(-1, 1, 1, 1)
    sq = Lq if q_pad is None else q_pad.sum(-1).reshape(-1, 1, 1, 1)
    diag = row + sk - sq
    left, right = window
    hidden = col > diag + right if right >= 0 else torch.zeros_like(col > diag)
    if left >= 0:
        hidden = hidden | (col < diag - left)
    return hidden


def alibi_bias(slopes, Lq, Lk, q_pad=None, k_pad=None, causal=False, leftpad=None):
    """-slope * |i + sk - sq - j| as (B, H, Lq, Lk) (causal: the same up to a per-row constant)."""
    s = slopes.reshape(*slopes.shape, 1, 1)
    if causal:
        return torch.arange(-Lk + 1, 1, dtype=torch.float32) * s
    row = torch.arange(Lq).reshape(-1, 1)
    col = torch.arange(Lk)
    if leftpad is not None:
        lp = leftpad.to(torch.int64).reshape(-1, 1, 1, 1)
        col = torch.where(col >= lp, col - lp, 2**32)
    sk = Lk if k_pad is None else k_pad.sum(-1).reshape(-1, 1, 1, 1)
    sq = Lq if q_pad is None else q_pad.sum(-1).reshape(-1, 1, 1, 1)
    return -s * (row + sk - sq - col).abs().to(s.dtype)


def attention_ref(
    q,
    k,
    v,
    q_pad=None,
    k_pad=None,
    bias=None,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    upcast=True,
    reorder=False,
    leftpad=None,
):
    """Dense attention of (B, Lq, H, d) q and (B, Lk, H_kv, d) k, v; returns out (B, Lq, H, dv)
    in q's dtype. Rows that see no key give 0, padded query rows give 0."""
    window = (int(window[0]), int(window[1]))
    if causal:
        window = (window[0], 0)
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    Lq, Lk = q.shape[1], k.shape[1]
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if reorder:
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k * scale)
    else:
        scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if k_pad is not None:
        scores = scores.masked_fill(~k_pad.reshape(k_pad.shape[0], 1, 1, Lk), float("-inf"))
    hidden = None
    if window != (-1, -1):
        hidden = local_mask(Lq, Lk, window, q_pad, k_pad, leftpad)
        scores = scores.masked_fill(hidden, float("-inf"))
    if bias is not None:
        scores = scores + bias
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    if hidden is not None:
        p = p.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)
    if k_pad is not None:  # a sequence with no valid key at all: 0, not NaN
        p = p.nan_to_num(0.0)
    if q_pad is not None:
        p = p.masked_fill(~q_pad.reshape(q_pad.shape[0], 1, Lq, 1), 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    if q_pad is not None:
        out = out.masked_fill(~q_pad.reshape(q_pad.shape[0], Lq, 1, 1), 0.0)
    return out.to(dtype)


def max_err(a, b):
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def within(got, ref, pt, mult, atol=0.0):
    """flash-attn's rule: err(got) <= mult * err(torch in the low dtype) + atol. Returns
    (ok, err, bound) for the assertion message."""
    err, bound = max_err(got, ref), mult * max_err(pt, ref) + atol
    return err <= bound, err, bound
