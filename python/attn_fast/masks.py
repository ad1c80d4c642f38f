"""Mask objects the fused kernel reads block by block.

A mask says which keys each query may see. Passing one as ``attn_mask`` to
``scaled_dot_product_attention`` never builds the (Lq, Lk) matrix (except
``Dense``, which *is* a matrix): the kernel asks each object, for every tile of
Br queries x Bc keys, "is anything visible here?" and skips the tile when the
answer is no, so a masked-out block costs nothing. ::

    Causal(align="bottom_right")     query i sees keys j <= i + off
    SlidingWindow(left, right=0)     keys in [i + off - left, i + off + right]
    Padding(kv_lens, q_lens=None)    per-batch valid lengths (B,)
    BlockSparse(layout, bq, bk)      a boolean (Lq/bq, Lk/bk) block layout,
                                     with constructors local / strided / global_tokens
    Dense(array)                     a boolean (True = attend) or additive float
                                     array broadcastable to (B, H, Lq, Lk)

Objects combine with ``&`` (the intersection: a pair is visible if every part
lets it through); a NumPy array on either side of ``&`` becomes ``Dense``.
``BlockSparse`` layouts also combine with ``|`` (the union of their blocks).

Alignment. ``off`` is the causal diagonal: ``off = k_len - q_len`` for
bottom-right alignment (FlashAttention, KV caches: the last query sees the last
key), ``0`` for top-left (torch's ``is_causal``). With ``Padding`` the lengths
are per batch entry, so each sequence gets its own diagonal. Every part of a
combination that depends on the alignment (``Causal``, ``SlidingWindow``) must
use the same one, unless the two coincide (``off = 0`` for every sequence).
ALiBi distances are measured from the same diagonal.

Semantics shared by every kind: a query row that sees no key gets zeros and
lse = -inf (never NaN), and masked-out keys are never read into the result, so
a NaN/inf in a masked K or V row cannot leak into the output. Bad arguments
raise ``ValueError`` naming the argument (a wrong dtype raises ``MaskTypeError``,
which is both a ``TypeError`` and a ``ValueError``).

Each object describes itself to the kernel as a ``MaskArgs`` record
(``Mask.kernel_args``); ``MaskArgs.merge`` is the intersection, and
``visibility`` is the same rule in NumPy.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from ._checks import ArgumentTypeError, check_int, check_seq_lens
from ._mask_base import Dense, Mask, as_mask
from ._mask_block_sparse import BlockSparse

# Besides __all__, the kernel-facing names (BLOCK_*, SUMMARY_BLOCK, add_block_summary,
# block_summary, visibility) are reached as attn_fast.masks.X by the dispatcher, the
# torch adapter, the benchmarks and the tests.
from ._mask_record import (  # noqa: F401
    BLOCK_MASKED,
    BLOCK_PARTIAL,
    BLOCK_VISIBLE,
    SUMMARY_BLOCK,
    MaskArgs,
    add_block_summary,
    block_summary,
    record,
    visibility,
)

__all__ = [
    "Mask",
    "MaskArgs",
    "Causal",
    "SlidingWindow",
    "Padding",
    "BlockSparse",
    "Dense",
    "MaskTypeError",
    "as_mask",
]

_ALIGNS = ("bottom_right", "top_left")


MaskTypeError = ArgumentTypeError
"""A mask argument of the wrong dtype or type: ``_checks.ArgumentTypeError``,
both a TypeError and a ValueError (one class for every argument checker)."""


def _check_side(x: int | None, name: str) -> int | None:
    """A window side: None (unbounded) or an int >= 0."""
    return None if x is None else check_int(x, name, 0)


def _check_align(align: str) -> str:
    if align not in _ALIGNS:
        raise ValueError(f"align must be one of {_ALIGNS}, got {align!r}")
    return align


_CAUSAL = {a: MaskArgs(causal=True, aligns=frozenset({a})) for a in _ALIGNS}


class Causal(Mask):
    """Causal mask: query i sees keys j <= i + off.

    align="bottom_right" (default): off = k_len - q_len, the last query sees
    the last key (KV caches, chunked prefill; ``is_causal=True`` in attn_fast).
    align="top_left": off = 0, torch's ``is_causal`` (and
    ``torch.nn.attention.bias.causal_upper_left``). The two agree when
    Lq == Lk. With Lq > Lk bottom-right, the first Lq - Lk rows see nothing and
    return zeros (lse = -inf).
    """

    def __init__(self, align: str = "bottom_right") -> None:
        self.align = _check_align(align)

    def _args(self, B: int, H: int, Lq: int, Lk: int, dtype: np.dtype) -> MaskArgs:
        return _CAUSAL[self.align]

    def __repr__(self) -> str:
        return f"Causal(align={self.align!r})"


class SlidingWindow(Mask):
    """Local attention: query i sees keys j with i' - left <= j <= i' + right.

    i' = i + off is the query's aligned position (see ``Causal`` for align).
    ``left`` counts keys strictly before the diagonal: Mistral's window of W
    tokens (the query itself included) is ``SlidingWindow(W - 1)``.
    ``right=0`` (default) makes it causal; ``right=None`` or ``left=None``
    leaves that side unbounded. The kernel visits only the key blocks inside
    the band, so the cost grows as Lq * (left + right + 1), not Lq * Lk.
    """

    def __init__(
        self, left: int | None, right: int | None = 0, align: str = "bottom_right"
    ) -> None:
        self.left = _check_side(left, "SlidingWindow left")
        self.right = _check_side(right, "SlidingWindow right")
        self.align = _check_align(align)

    def _args(self, B: int, H: int, Lq: int, Lk: int, dtype: np.dtype) -> MaskArgs:
        return window_args(self.left, self.right, self.align)

    def __repr__(self) -> str:
        return f"SlidingWindow(left={self.left}, right={self.right}, align={self.align!r})"


def window_args(left: int | None, right: int | None, align: str) -> MaskArgs:
    """A sliding window's record: keys in [i' - left, i' + right] (None: unbounded).

    Sides wider than any sequence (even >= 2**63) are clamped to 2**62: the
    same result, and the kernel's int64 arithmetic cannot overflow.
    """
    return MaskArgs(
        window_left=-1 if left is None else min(left, 2**62),
        window_right=-1 if right is None else min(right, 2**62),
        aligns=frozenset({align}),
    )


class Padding(Mask):
    """Per-batch valid lengths of a padded batch.

    kv_lens : (B,) integers in [0, Lk] (or one integer for all): keys j >=
        kv_lens[b] are padding and never seen.

    q_lens : (B,) integers in [0, Lq], or None: query rows i >= q_lens[b]
        are padding and get zeros (lse = -inf). None means:

        - Lq == Lk (self-attention over a padded batch): the queries are the
          sequence's own tokens, so q_lens = kv_lens;
        - Lq != Lk (cross-attention, a chunk against a longer cache): all Lq
          rows are valid.

    Valid tokens are at the start of each row (right padding). With ``Causal``
    or ``SlidingWindow`` aligned bottom-right, sequence b's diagonal is
    off = kv_lens[b] - q_lens[b]. So for a right-padded batch with Lq == Lk,
    ``Causal() & Padding(kv_lens=lens)`` is what torch and transformers give:
    valid query i of sequence b sees keys j <= i, j < lens[b] (off = 0);
    its padding rows are zeros. With Lq != Lk the last query row of sequence
    b is aligned with its last valid key (bottom-right; KV caches)::

        lens = np.array([30, 64])                       # x: (2, H, 64, d)
        o = sdpa(x, x, x, attn_mask=Causal() & Padding(lens))   # rows >= 30 of b=0: 0
        # a 4-query chunk against 64 cached keys, of which lens are valid:
        o = sdpa(q4, k, v, attn_mask=Causal() & Padding(lens))  # query 3 sees keys < lens[b]
    """

    def __init__(self, kv_lens: ArrayLike, q_lens: ArrayLike | None = None) -> None:
        self.kv_lens = np.asarray(kv_lens)
        self.q_lens = None if q_lens is None else np.asarray(q_lens)

    def _args(self, B: int, H: int, Lq: int, Lk: int, dtype: np.dtype) -> MaskArgs:
        kv = check_seq_lens(self.kv_lens, "kv_lens", B, Lk)
        if self.q_lens is not None:
            ql = check_seq_lens(self.q_lens, "q_lens", B, Lq)
        elif Lq == Lk:  # self-attention over a padded batch: the queries are the same tokens
            ql = kv.copy()
        else:
            ql = None
        return record(q_lens=ql, kv_lens=kv)

    def __repr__(self) -> str:
        q = "" if self.q_lens is None else f", q_lens={self.q_lens.tolist()}"
        return f"Padding(kv_lens={self.kv_lens.tolist()}{q})"
