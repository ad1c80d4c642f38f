"""flash-attn's ``bert_padding`` helpers: padded batches to packed (varlen) tokens and back.

``unpad_input`` turns a padded (B, L, ...) batch and its (B, L) attention mask
into the packed (total, ...) tokens that the varlen functions read, with the
``cu_seqlens`` they need; ``pad_input`` scatters packed results back. Plain
torch indexing (differentiable); CPU or any device torch indexes.
"""

from __future__ import annotations

import torch

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x[indices] along the first axis (a new tensor)."""
    return x[indices]


def index_put_first_axis(
    values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int
) -> torch.Tensor:
    """A zero tensor of first_axis_dim rows with values written at rows `indices`."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    out[indices] = values
    return out


def unpad_input(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    unused_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Packed tokens of a padded batch (flash-attn 2.6+'s five results).

    hidden_states : (B, L, ...); attention_mask : (B, L) bool or 0/1 ints, 1 =
    a valid token; unused_mask : (B, L) or None, tokens allocated but not
    attended (they are packed too, and counted in ``seqused``'s complement).

    Returns (hidden_states (total, ...), indices (total,) int64 into the
    flattened (B * L) tokens, cu_seqlens (B + 1,) int32, max_seqlen_in_batch
    int, seqused (B,) int32: the tokens of attention_mask alone per sequence).
    """
    all_masks = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu, max_seqlen, used


def pad_input(
    hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int
) -> torch.Tensor:
    """(total, ...) packed tokens back to a zero-padded (batch, seqlen, ...) tensor."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
