"""The kernel's visibility record: ``MaskArgs``, how two records intersect, the
same rule in NumPy (``visibility``), and the block summary of a dense mask.

Every mask object of ``attn_fast.masks`` describes itself as one ``MaskArgs``
(``Mask.kernel_args``); the kernels (``attn_fast._dispatch``), the weights path
and ``visibility`` read it. The names without a leading underscore are shared
with the mask modules (``attn_fast.masks``, ``_mask_base``, ``_mask_block_sparse``);
the public ones are re-exported by ``attn_fast.masks``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Callable, TypeVar

import numpy as np

from . import _core, _cyloops, _loops
from ._checks import ArgumentTypeError, check_int


def shape_str(shape: tuple[int, ...]) -> str:
    return str(tuple(int(s) for s in shape))


# ---------------------------------------------------------------- kernel arguments

_ALIGN_FREE: frozenset[str] = frozenset()
_TOP_LEFT: frozenset[str] = frozenset({"top_left"})


@dataclass(frozen=True, eq=False)
class MaskArgs:
    """The kernel's visibility arguments (the mask half of attention.h's AttnArgs), one record.

    Every mask object produces one (``Mask.kernel_args``), ``is_causal`` and
    ``window_size`` too; ``merge`` intersects two of them; the kernels
    (``attn_fast._dispatch``), the weights path and ``visibility`` read them.
    Immutable: a merge or a block summary makes a new record; the arrays are
    shared, never copied (they are read-only views where they are broadcast).

    causal : query i sees keys j <= i + off (off: the alignment's diagonal).

    window_left, window_right : keys in [i + off - left, i + off + right];
        -1 leaves that side unbounded.

    q_lens, kv_lens : (B,) int64 valid lengths per batch entry, or None (all).

    layout : (B, H, nq, nk) uint8 block layout (nonzero = kept), or None;
        layout_bq, layout_bk its block sizes in tokens.

    mask : (B, H, Lq, Lk) uint8 view (nonzero = attend), or None.
    bias : (B, H, Lq, Lk) float view added to the scores (-inf = masked), or None.

    aligns : the alignments the parts asked for ("bottom_right", "top_left");
        empty when none depends on it. ``resolve`` leaves at most one.
    """

    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    q_lens: np.ndarray | None = None
    kv_lens: np.ndarray | None = None
    layout: np.ndarray | None = None
    layout_bq: int = 1
    layout_bk: int = 1
    mask: np.ndarray | None = None
    bias: np.ndarray | None = None
    aligns: frozenset[str] = _ALIGN_FREE

    @property
    def top_left(self) -> bool:
        """True when the diagonal is top-left aligned (off = 0)."""
        return self.aligns == _TOP_LEFT

    @property
    def elementwise(self) -> bool:
        """True when a block layout, a dense mask or a bias is set (what the
        split-KV decode kernel does not read)."""
        return self.layout is not None or self.mask is not None or self.bias is not None

    def merge(self, other: MaskArgs) -> MaskArgs:
        """The intersection of two records: a pair is visible if both let it through.

        Causal if either is; windows intersect side by side; lengths take
        the element-wise minimum; block layouts (at the gcd of their block
        sizes) and boolean masks are AND-ed; additive biases add up;
        alignments are collected (``resolve`` checks that they agree).
        """
        if other is _EVERYTHING:
            return self
        if self.layout is None or other.layout is None:
            mine = self if other.layout is None else other
            layout = dict(layout=mine.layout, layout_bq=mine.layout_bq, layout_bk=mine.layout_bk)
        else:
            layout = _merge_layouts(self, other)
        return record(
            causal=self.causal or other.causal,
            window_left=_min_window(self.window_left, other.window_left),
            window_right=_min_window(self.window_right, other.window_right),
            q_lens=_either(self.q_lens, other.q_lens, np.minimum),
            kv_lens=_either(self.kv_lens, other.kv_lens, np.minimum),
            mask=_either(self.mask, other.mask, _and_broadcast),
            bias=_either(self.bias, other.bias, _add_broadcast),
            aligns=self.aligns | other.aligns,
            **layout,
        )

    def resolve(self, B: int, Lq: int, Lk: int) -> MaskArgs:
        """This record with one alignment at most; ValueError when its parts ask
        for both bottom-right and top-left and the two differ here (they
        coincide when every sequence has k_len == q_len)."""
        if len(self.aligns) <= 1:
            return self
        q_len = np.full(B, Lq) if self.q_lens is None else self.q_lens
        k_len = np.full(B, Lk) if self.kv_lens is None else self.kv_lens
        if np.any(np.asarray(k_len) != np.asarray(q_len)):
            raise ValueError(
                "masks combine bottom-right and top-left alignment, which differ here "
                f"(Lq = {Lq}, Lk = {Lk}, or padded lengths differ); use one alignment"
            )
        return replace(self, aligns=frozenset({"bottom_right"}))

    @classmethod
    def combine(cls, parts: Iterable[MaskArgs], B: int, Lq: int, Lk: int) -> MaskArgs:
        """The resolved intersection of `parts` (an empty list: everything visible)."""
        it = iter(parts)
        out = next(it, _EVERYTHING)
        for p in it:
            out = out.merge(p)
        return out.resolve(B, Lq, Lk)

    def set_fields(self) -> list[str]:
        """The names of the arguments this record sets (for error messages)."""
        names = [
            n
            for n in ("q_lens", "kv_lens", "layout", "mask", "bias")
            if getattr(self, n) is not None
        ]
        if self.causal:
            names.append("causal")
        if self.top_left:
            names.append("top_left")
        names += [n for n in ("window_left", "window_right") if getattr(self, n) >= 0]
        return sorted(names)


_EVERYTHING = MaskArgs()  # no restriction: every pair is visible (records are immutable)
_DEFAULTS = dict(vars(_EVERYTHING))


def record(**kw: Any) -> MaskArgs:
    """``MaskArgs(**kw)`` without the frozen dataclass's per-field __init__
    (the merge runs on every call): the same record, built by filling its dict."""
    obj = object.__new__(MaskArgs)
    vars(obj).update(_DEFAULTS, **kw)
    return obj


# ---------------------------------------------------------------- combination

T = TypeVar("T")


def _either(a: T | None, b: T | None, both: Callable[[T, T], T]) -> T | None:
    """`a` or `b` where only one is set, ``both(a, b)`` where both are."""
    if a is None:
        return b
    if b is None:
        return a
    return both(a, b)


def _min_window(a: int, b: int) -> int:
    """Intersection of two window sides (-1 = unbounded)."""
    if a < 0:
        return b
    if b < 0:
        return a
    return min(a, b)


def _compact(x: np.ndarray) -> np.ndarray:
    """The un-broadcast core of a broadcast view: zero-stride axes become size 1."""
    return x[tuple(slice(0, 1) if st == 0 else slice(None) for st in x.strides)]


def refine(lay, fq, fk):
    """Layout at blocks fq (fk) times smaller: each block becomes fq x fk."""
    return np.repeat(np.repeat(lay, fq, axis=-2), fk, axis=-1)


def _and_broadcast(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """AND of two broadcast 4-D uint8 views, materialised at their common shape."""
    return np.broadcast_to(np.logical_and(_compact(x), _compact(y)).view(np.uint8), x.shape)


def _add_broadcast(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Sum of two broadcast 4-D float views, materialised at their common shape."""
    return np.broadcast_to(_compact(x) + _compact(y), x.shape)


def _merge_layouts(a: MaskArgs, b: MaskArgs) -> dict[str, Any]:
    """Two block layouts AND-ed at the gcd of their block sizes (cropped to the
    smaller cover), broadcast over a's (B, H)."""
    gq, gk = math.gcd(a.layout_bq, b.layout_bq), math.gcd(a.layout_bk, b.layout_bk)
    merged = None
    for m in (a, b):
        fq, fk = m.layout_bq // gq, m.layout_bk // gk
        compact = _compact(m.layout).astype(bool)
        if fq > 1 or fk > 1:
            compact = refine(compact, fq, fk)
        if merged is None:
            merged = compact
        else:
            nq = min(merged.shape[-2], compact.shape[-2])
            nk = min(merged.shape[-1], compact.shape[-1])
            merged = merged[..., :nq, :nk] & compact[..., :nq, :nk]
    B, H = a.layout.shape[:2]
    view = np.broadcast_to(merged, (B, H) + merged.shape[-2:])
    return dict(layout=view.view(np.uint8), layout_bq=gq, layout_bk=gk)


# ---------------------------------------------------------------- dense view


def visibility(args: MaskArgs, B: int, H: int, Lq: int, Lk: int) -> np.ndarray:
    """The rule of attention.h's AttnArgs, in NumPy: boolean (B, H|1, Lq, Lk).

    args : the kernel's visibility arguments (``Mask.kernel_args``).
    Reads causal, top_left, window_left/right, q_lens, kv_lens, layout, mask
    and bias (-inf = masked). Materialises Lq x Lk per batch entry.
    """
    q_len = np.asarray(np.full(B, Lq) if args.q_lens is None else args.q_lens, dtype=np.int64)
    k_len = np.asarray(np.full(B, Lk) if args.kv_lens is None else args.kv_lens, dtype=np.int64)
    q_len, k_len = q_len.reshape(B, 1, 1, 1), k_len.reshape(B, 1, 1, 1)
    off = np.zeros_like(k_len) if args.top_left else k_len - q_len
    i = np.arange(Lq).reshape(1, 1, Lq, 1)
    j = np.arange(Lk).reshape(1, 1, 1, Lk)
    diag = i + off
    vis = (j < k_len) & (i < q_len)
    if args.causal:
        vis = vis & (j <= diag)
    if args.window_left >= 0:
        vis = vis & (j >= diag - args.window_left)
    if args.window_right >= 0:
        vis = vis & (j <= diag + args.window_right)
    if args.layout is not None:
        lay = args.layout.astype(bool)
        rows = np.arange(Lq) // args.layout_bq
        cols = np.arange(Lk) // args.layout_bk
        vis = vis & lay[:, :, rows][:, :, :, cols]
    if args.mask is not None:
        vis = vis & args.mask.astype(bool)
    if args.bias is not None:
        vis = vis & (args.bias > -np.inf)
    return vis


# ---------------------------------------------------------------- block summary

SUMMARY_BLOCK = 16


def add_block_summary(args: MaskArgs, block: int = SUMMARY_BLOCK) -> MaskArgs:
    """Give a dense boolean mask a block layout summarising it, so the kernel
    skips its all-False tiles by looking at a few layout bytes instead of
    scanning Br x Bc mask bytes once per (batch, head, tile).

    The layout is "any visible in this block x block square": AND-ing it with
    the mask changes nothing, so results are identical. It is computed once, at
    the mask's own (un-broadcast) shape. Added only when the call has no
    layout of its own (so no re-blocking at a gcd is ever needed) and the mask
    is at least 4 x 4 blocks.
    """
    m = args.mask
    if m is None or args.layout is not None:
        return args
    B, H, Lq, Lk = m.shape
    if Lq < 4 * block or Lk < 4 * block:
        return args
    summary = block_summary(_compact(m), block) != BLOCK_MASKED
    # A broadcast row (column) axis of the mask stays one summary row (column),
    # broadcast again (stride 0) over the whole sequence.
    layout = np.broadcast_to(summary, (B, H, -(-Lq // block), -(-Lk // block)))
    return replace(args, layout=layout.view(np.uint8), layout_bq=block, layout_bk=block)


# Tile classes: the numbering of the C++ kernels' TileClass (attention.h).
BLOCK_MASKED, BLOCK_PARTIAL, BLOCK_VISIBLE = (
    _core.BLOCK_MASKED,
    _core.BLOCK_PARTIAL,
    _core.BLOCK_VISIBLE,
)


def block_summary(mask, block=SUMMARY_BLOCK):
    """Classify each block x block tile of a boolean mask, in one pass.

    mask : (B, H, Lq, Lk) bool or uint8 (nonzero = attend), any strides (a
        broadcast view is read at its full shape: pass the compact array).
    Returns int8 (B, H, ceil(Lq/block), ceil(Lk/block)): BLOCK_MASKED (0)
    where the tile has no visible pair, BLOCK_VISIBLE (2) where every pair is
    visible, BLOCK_PARTIAL (1) otherwise; a tail tile counts only its
    in-range pairs. ``_cyloops.block_summary``, or ``summary_numpy``.
    """
    m = np.asarray(mask)
    if m.dtype not in (np.dtype(np.bool_), np.dtype(np.uint8)):
        raise ArgumentTypeError(f"mask must be a bool or uint8 array, got dtype {m.dtype}")
    if m.ndim != 4:
        raise ValueError(f"mask must be (B, H, Lq, Lk), got shape {shape_str(m.shape)}")
    block = check_int(block, "block", 1)
    if _loops.USE_CYTHON:
        return _cyloops.block_summary(m.view(np.uint8), block, num_threads=_loops.threads())
    return summary_numpy(m, block)


def summary_numpy(m, block):
    """NumPy reference of ``block_summary``: pad to whole tiles, count per tile."""
    cb, ch, lq, lk = m.shape
    nq, nk = -(-lq // block), -(-lk // block)
    padded = np.zeros((cb, ch, nq * block, nk * block), bool)
    padded[:, :, :lq, :lk] = m
    vis = padded.reshape(cb, ch, nq, block, nk, block).sum(axis=(3, 5))
    inside = np.zeros((nq * block, nk * block), np.int64)
    inside[:lq, :lk] = 1
    tot = inside.reshape(nq, block, nk, block).sum(axis=(1, 3))
    return np.where(
        vis == 0, BLOCK_MASKED, np.where(vis == tot, BLOCK_VISIBLE, BLOCK_PARTIAL)
    ).astype(np.int8)
