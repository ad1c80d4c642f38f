"""Rotary embeddings with flash-attn's ``apply_rotary_emb`` signature (CPU, pure torch).

``flash_attn.layers.rotary.apply_rotary_emb`` is what model code imports next to
the attention kernels; this is the same function for CPU tensors, differentiable
(plain torch operations). Shape legend: B batch, L length, H heads, D head dim,
r = rotary_dim = 2 * cos.shape[-1] (the first r channels are rotated, the rest
pass through).
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary_emb"]


def _positions(
    B: int, L: int, offsets: int | torch.Tensor, name: str = "seqlen_offsets"
) -> torch.Tensor:
    """(B, L) int64 positions offsets[b] + i."""
    ar = torch.arange(L, dtype=torch.int64)
    if isinstance(offsets, torch.Tensor):
        if offsets.dim() == 0:
            return (ar + int(offsets)).expand(B, L)
        if offsets.shape != (B,):
            raise ValueError(f"{name} must be an int or shape ({B},), got {tuple(offsets.shape)}")
        return offsets.to(torch.int64).reshape(B, 1) + ar
    return (ar + int(offsets)).expand(B, L)


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x (B, L, H, D) rotated at positions pos (B, L): a new tensor of x's dtype.

    cos, sin : (L_ro, r / 2). Computed in float32 (float64 for float64 x) and
    rounded once, as flash-attn's kernel does.
    """
    r = 2 * cos.shape[-1]
    D = x.shape[-1]
    if r > D:
        raise ValueError(f"rotary_dim = 2 * cos.shape[-1] = {r} exceeds the head dim {D}")
    if cos.shape != sin.shape or cos.dim() != 2:
        raise ValueError(
            f"rotary cos and sin must both be (seqlen_ro, rotary_dim / 2), got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if pos.numel() and int(pos.max()) >= cos.shape[0]:
        raise ValueError(
            f"rotary cos/sin have {cos.shape[0]} positions but position {int(pos.max())} is needed"
        )
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos.to(cdt)[pos].unsqueeze(2)  # (B, L, 1, r/2)
    s = sin.to(cdt)[pos].unsqueeze(2)
    xr = x[..., :r].to(cdt)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., r:]), dim=-1)


def apply_rotary_emb(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """flash-attn's ``apply_rotary_emb``: rotary position embedding of x.

    Parameters
    ----------
    x : (B, L, H, D), or (total, H, D) with cu_seqlens
        cu_seqlens (B + 1,): packed sequences, each starting at position 0.
    cos, sin : (L_ro, r / 2), r <= D
        The first r channels are rotated.
    interleaved : rotate pairs (0, 1), (2, 3), ... (GPT-J)
        instead of (0, r/2), (1, r/2 + 1), ... (GPT-NeoX).
    inplace : write the result into x and return x.
    seqlen_offsets : int or (B,) tensor
        Token i of sequence b is at position seqlen_offsets[b] + i (decoding
        with a KV cache).
    cu_seqlens : (B + 1,) int tensor or None.
    max_seqlen : accepted (flash-attn's kernel grid size); not needed here.

    Returns
    -------
    A new tensor of x's dtype and shape (x itself when inplace).
    Differentiable with respect to x (not in place).
    """
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"x must be (batch, seqlen, nheads, headdim), got {tuple(x.shape)}")
        pos = _positions(x.shape[0], x.shape[1], seqlen_offsets)
        out = rotate(x, cos, sin, pos, interleaved)
    else:
        if x.dim() != 3:
            raise ValueError(
                f"with cu_seqlens, x must be (total, nheads, headdim), got {tuple(x.shape)}"
            )
        cu = cu_seqlens.to(torch.int64)
        lens = cu[1:] - cu[:-1]
        seq = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        pos = torch.arange(x.shape[0], dtype=torch.int64) - cu[:-1][seq]
        if isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets.dim() == 1:
            pos = pos + seqlen_offsets.to(torch.int64)[seq]
        else:
            pos = pos + int(seqlen_offsets)
        out = rotate(x.unsqueeze(0), cos, sin, pos.unsqueeze(0), interleaved)[0]
    if inplace:
        x.copy_(out)
        return x
    return out
