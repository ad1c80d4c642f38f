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

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Callable, TypeVar

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _core, _cyloops, _loops
from ._checks import ArgumentTypeError, check_int, check_seq_lens, detached
from ._lowp import bf16_values

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


def _shape_str(shape: tuple[int, ...]) -> str:
    return str(tuple(int(s) for s in shape))


def _check_side(x: int | None, name: str) -> int | None:
    """A window side: None (unbounded) or an int >= 0."""
    return None if x is None else check_int(x, name, 0)


def _check_align(align: str) -> str:
    if align not in _ALIGNS:
        raise ValueError(f"align must be one of {_ALIGNS}, got {align!r}")
    return align


def _mask_array(
    x: ArrayLike,
    dtype_ok: Callable[[np.dtype], bool],
    min_ndim: int,
    bad_dtype: str,
    bad_shape: str,
) -> np.ndarray:
    """`x` (read detached) as a NumPy array of an accepted dtype (MaskTypeError:
    `bad_dtype`, got dtype ...) with min_ndim to 4 dimensions (ValueError:
    `bad_shape`, got shape ...)."""
    a = np.asarray(detached(x))
    if not dtype_ok(a.dtype):
        raise MaskTypeError(f"{bad_dtype}, got dtype {a.dtype}")
    if a.ndim < min_ndim or a.ndim > 4:
        raise ValueError(f"{bad_shape}, got shape {_shape_str(a.shape)}")
    return a


def _broadcast4(arr: np.ndarray, shape: tuple[int, ...], name: str, what: str) -> np.ndarray:
    """View `arr` (ndim <= 4) broadcast to the 4-D `shape` (zero strides, no copy)."""
    if arr.ndim > 4:
        raise ValueError(f"{name} has shape {_shape_str(arr.shape)}: at most 4 dimensions ({what})")
    try:
        return np.broadcast_to(arr.reshape((1,) * (4 - arr.ndim) + arr.shape), shape)
    except ValueError:
        raise ValueError(
            f"{name} has shape {_shape_str(arr.shape)}, not broadcastable to {what} = "
            f"{_shape_str(shape)}"
        ) from None


class Mask:
    """Base class: a visibility rule the kernel understands block by block.

    Subclasses describe themselves as a ``MaskArgs`` record
    (``kernel_args``); ``a & b`` combines them. ``to_dense(B, H, Lq, Lk)``
    materialises the equivalent boolean (B, H, Lq, Lk) array (True =
    visible), for plots, tests and debugging.
    """

    # Make `ndarray & mask` call Mask.__rand__ instead of an element-wise ufunc.
    __array_ufunc__ = None

    def _parts(self) -> tuple[Mask, ...]:
        return (self,)

    def _args(self, B: int, H: int, Lq: int, Lk: int, dtype: np.dtype) -> MaskArgs:
        raise NotImplementedError  # pragma: no cover - abstract

    def __and__(self, other: Any) -> Mask:
        return _All(self._parts() + as_mask(other)._parts())

    def __rand__(self, other: Any) -> Mask:
        return _All(as_mask(other)._parts() + self._parts())

    def kernel_args(self, *, B: int, H: int, Lq: int, Lk: int, dtype: DTypeLike) -> MaskArgs:
        """The kernel's visibility arguments for a (B, H, Lq, Lk) call whose
        scores are computed in `dtype` (a ``Dense`` bias is cast to it): the
        resolved intersection of this mask's parts. Raises ValueError /
        ``MaskTypeError`` for arguments that do not fit the shapes."""
        dt = np.dtype(dtype)
        return MaskArgs.combine([p._args(B, H, Lq, Lk, dt) for p in self._parts()], B, Lq, Lk)

    def to_dense(self, B: int, H: int, Lq: int, Lk: int) -> np.ndarray:
        """Boolean (B, H, Lq, Lk) array: True where query i may see key j.

        An additive ``Dense`` bias counts as visible where it is > -inf.
        Materialises Lq x Lk per (batch, head); meant for small sizes.
        """
        args = self.kernel_args(B=B, H=H, Lq=Lq, Lk=Lk, dtype=np.float64)
        return np.broadcast_to(visibility(args, B, H, Lq, Lk), (B, H, Lq, Lk))


def as_mask(x: Any) -> Mask:
    """A Mask as is; a NumPy array (boolean or float) as ``Dense(x)``; a list or
    tuple of masks and arrays as their intersection."""
    if isinstance(x, Mask):
        return x
    # A list holding mask objects or NumPy arrays is their intersection (as
    # scaled_dot_product_attention documents); a nested list of numbers is one array.
    if isinstance(x, (list, tuple)) and x and any(isinstance(e, (Mask, np.ndarray)) for e in x):
        out = None
        for e in x:
            out = as_mask(e) if out is None else out & e
        return out
    return Dense(x)


class _All(Mask):
    """The intersection of several masks (built by ``&``)."""

    def __init__(self, parts: Iterable[Mask]) -> None:
        self.parts = tuple(parts)

    def _parts(self) -> tuple[Mask, ...]:
        return self.parts

    def __repr__(self) -> str:
        return " & ".join(map(repr, self.parts))


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
        return _record(q_lens=ql, kv_lens=kv)

    def __repr__(self) -> str:
        q = "" if self.q_lens is None else f", q_lens={self.q_lens.tolist()}"
        return f"Padding(kv_lens={self.kv_lens.tolist()}{q})"


class BlockSparse(Mask):
    """Block-sparse layout: query block x sees key block y iff layout[..., x, y].

    layout : boolean array (..., nq, nk), broadcastable over (B, H), i.e. of
        shape (nq, nk), (H, nq, nk), (B, H, nq, nk) or with 1s for broadcast.
        Query i belongs to block i // block_q, key j to block j // block_k.
        Must cover the sequences: nq * block_q >= Lq and nk * block_k >= Lk.
    block_q, block_k : block sizes in tokens (>= 1). They are independent of
        the kernel's own tile sizes: a kernel tile that meets no kept block is
        skipped, one that meets only kept blocks runs unmasked.

    Kept blocks are dense: combine with ``Causal()`` for the token-level
    triangle inside diagonal blocks. ``a | b`` is the union of two layouts.
    Constructors for the classic patterns: ``local``, ``strided``,
    ``global_tokens``.
    """

    def __init__(self, layout: ArrayLike, block_q: int, block_k: int | None = None) -> None:
        self.layout = _mask_array(
            layout,
            lambda dt: dt == np.bool_,
            2,
            "BlockSparse layout must be a boolean array",
            "BlockSparse layout must be (nq, nk), (H, nq, nk) or (B, H, nq, nk)",
        )
        self.block_q = check_int(block_q, "block_q", 1)
        self.block_k = self.block_q if block_k is None else check_int(block_k, "block_k", 1)

    @property
    def density(self) -> float:
        """Fraction of blocks kept (over the whole layout)."""
        return float(self.layout.mean()) if self.layout.size else 0.0

    def _args(self, B: int, H: int, Lq: int, Lk: int, dtype: np.dtype) -> MaskArgs:
        nq, nk = self.layout.shape[-2:]
        if nq * self.block_q < Lq or nk * self.block_k < Lk:
            raise ValueError(
                f"BlockSparse layout of shape {_shape_str(self.layout.shape)} with "
                f"block_q={self.block_q}, "
                f"block_k={self.block_k} covers ({nq * self.block_q}, {nk * self.block_k}) "
                "positions, "
                f"but (Lq, Lk) = ({Lq}, {Lk})"
            )
        view = _broadcast4(self.layout, (B, H, nq, nk), "BlockSparse layout", "(B, H, nq, nk)")
        return MaskArgs(layout=view.view(np.uint8), layout_bq=self.block_q, layout_bk=self.block_k)

    def __or__(self, other: BlockSparse) -> BlockSparse:
        if not isinstance(other, BlockSparse):
            return NotImplemented
        a, b = _common_blocks(self, other)
        nq = max(a.layout.shape[-2], b.layout.shape[-2])
        nk = max(a.layout.shape[-1], b.layout.shape[-1])
        return BlockSparse(
            _pad_layout(a.layout, nq, nk) | _pad_layout(b.layout, nq, nk), a.block_q, a.block_k
        )

    def __repr__(self) -> str:
        return (
            f"BlockSparse(layout {_shape_str(self.layout.shape)}, block_q={self.block_q}, "
            f"block_k={self.block_k}, density={self.density:.3f})"
        )

    # ------------------------------------------------------------ constructors

    @staticmethod
    def _grid(seq_len: int, block: int) -> tuple[int, np.ndarray, np.ndarray]:
        seq_len = check_int(seq_len, "seq_len", 1)
        block = check_int(block, "block", 1)
        n = -(-seq_len // block)
        x = np.arange(n)[:, None]  # query block
        y = np.arange(n)[None, :]  # key block
        return block, x, y

    @classmethod
    def local(cls, seq_len: int, block: int, width: int, causal: bool = False) -> BlockSparse:
        """Band of blocks (self-attention, Lq = Lk = seq_len): (nb, nb) layout.

        Query block x sees key blocks y with ``|x - y|`` < width, or
        0 <= x - y < width if causal. width >= 1 blocks.
        """
        block, x, y = cls._grid(seq_len, block)
        width = check_int(width, "width", 1)
        if _loops.USE_CYTHON:
            lo = 0 if causal else 1 - width
            keep = _cyloops.band_layout(
                x.shape[0], lo, width - 1, 0, False, num_threads=_loops.threads()
            )
        else:
            keep = _local_numpy(x, y, width, causal)
        return cls(keep, block, block)

    @classmethod
    def strided(cls, seq_len: int, block: int, stride: int, causal: bool = True) -> BlockSparse:
        """Sparse Transformer's strided pattern (Child et al. 2019), in blocks.

        Query block x sees the previous ``stride`` blocks (x - stride < y <= x)
        and every stride-th block before it ((x - y) % stride == 0), so any
        two positions are linked in two steps. Without causal the pattern is
        mirrored (``|x - y|`` instead of x - y). stride >= 1 blocks.
        """
        block, x, y = cls._grid(seq_len, block)
        stride = check_int(stride, "stride", 1)
        if _loops.USE_CYTHON:
            lo = 0 if causal else 1 - stride
            keep = _cyloops.band_layout(
                x.shape[0], lo, stride - 1, stride, not causal, num_threads=_loops.threads()
            )
        else:
            keep = _strided_numpy(x, y, stride, causal)
        return cls(keep, block, block)

    @classmethod
    def global_tokens(
        cls,
        seq_len: int,
        block: int,
        global_blocks: int | ArrayLike = 1,
        width: int = 1,
        random_blocks: int = 0,
        causal: bool = False,
        seed: Any = 0,
    ) -> BlockSparse:
        """Longformer / BigBird pattern: global anchors + local band (+ random).

        global_blocks : int n (the first n blocks) or a list of block indices.
            A global block attends to every block and every block attends to it.

        width : local band half-width in blocks (``|x - y|`` < width; 0 for none).

        random_blocks : BigBird's r random key blocks per query block, drawn
            with ``np.random.default_rng(seed)``.

        causal : keep only blocks y <= x.
        Returns an (nb, nb) layout for self-attention with Lq = Lk = seq_len.
        """
        block, x, y = cls._grid(seq_len, block)
        n = x.shape[0]
        width = check_int(width, "width", 0)
        random_blocks = check_int(random_blocks, "random_blocks", 0)
        if isinstance(global_blocks, numbers.Integral) and not isinstance(
            global_blocks, (bool, np.bool_)
        ):
            g = np.arange(min(check_int(global_blocks, "global_blocks", 0), n))
        else:
            g = np.asarray(global_blocks)
            if g.size and (g.dtype.kind not in "iu"):  # 2.5 or [True] are not block indices
                raise MaskTypeError(
                    f"global_blocks must be an int or block indices, got {global_blocks!r}"
                )
            g = g.astype(np.int64).reshape(-1)
            if g.size and (g.min() < 0 or g.max() >= n):
                raise ValueError(
                    f"global_blocks must be block indices in [0, {n}), got {g.tolist()}"
                )
        if _loops.USE_CYTHON:
            keep = _cyloops.band_layout(
                n, 1 - width, width - 1, 0, False, num_threads=_loops.threads()
            )
        else:
            keep = (x - y < width) & (y - x < width)
        keep[g, :] = True
        keep[:, g] = True
        if random_blocks:
            rng = np.random.default_rng(seed)
            for row in range(n):
                keep[row, rng.choice(n, size=min(random_blocks, n), replace=False)] = True
        if causal:
            keep &= y <= x
        return cls(keep, block, block)


def _local_numpy(x, y, width, causal):
    """NumPy reference of the band layout: |x - y| < width (0 <= x - y < width if causal)."""
    keep = (x - y < width) & (y - x < width)
    if causal:
        keep &= y <= x
    return keep


def _strided_numpy(x, y, stride, causal):
    """NumPy reference of the strided layout (see ``BlockSparse.strided``)."""
    dist = x - y if causal else np.abs(x - y)
    return (dist >= 0) & ((dist < stride) | (dist % stride == 0))


def _pad_layout(lay, nq, nk):
    pad = [(0, 0)] * (lay.ndim - 2) + [(0, nq - lay.shape[-2]), (0, nk - lay.shape[-1])]
    return np.pad(lay, pad)


def _refine(lay, fq, fk):
    """Layout at blocks fq (fk) times smaller: each block becomes fq x fk."""
    return np.repeat(np.repeat(lay, fq, axis=-2), fk, axis=-1)


def _common_blocks(a, b):
    """Both layouts at the common block size gcd(block sizes)."""
    gq, gk = math.gcd(a.block_q, b.block_q), math.gcd(a.block_k, b.block_k)
    out = []
    for m in (a, b):
        lay = m.layout
        if (m.block_q, m.block_k) != (gq, gk):
            lay = _refine(lay, m.block_q // gq, m.block_k // gk)
        out.append(BlockSparse(lay, gq, gk))
    return out


class Dense(Mask):
    """A dense mask array, read by the kernel tile by tile (never copied whole).

    array : broadcastable to (B, H, Lq, Lk), of either dtype
        - bool: True = attend (torch's convention); False masks the pair;
        - float: an additive bias on the scores; -inf masks the pair.

    A float array of another precision than q is cast once at its own
    (broadcast) shape. Tiles where a boolean mask is all False are skipped:
    a 16 x 16 block summary of the mask ("anything visible here?") is built
    once per call at the mask's own shape (see ``add_block_summary``), so the
    kernel finds empty tiles without scanning them once per head.
    """

    def __init__(self, array: ArrayLike) -> None:
        self.array = _mask_array(
            bf16_values(array),  # a bfloat16 bias: its float32 values (exact)
            lambda dt: dt == np.bool_ or dt.kind == "f",
            1,
            "attn_mask must be a boolean (True = attend) or float (additive) array",
            "attn_mask must be broadcastable to (B, H, Lq, Lk)",
        )

    def _args(self, B: int, H: int, Lq: int, Lk: int, dtype: np.dtype) -> MaskArgs:
        a = self.array
        if a.dtype == np.bool_:
            view = _broadcast4(a, (B, H, Lq, Lk), "attn_mask", "(B, H, Lq, Lk)")
            return MaskArgs(mask=view.view(np.uint8))
        if a.dtype != dtype or not a.flags.aligned:
            a = a.astype(dtype)  # at the array's own shape, before broadcasting (aligned, native)
        return MaskArgs(bias=_broadcast4(a, (B, H, Lq, Lk), "attn_mask", "(B, H, Lq, Lk)"))

    def __repr__(self) -> str:
        return f"Dense({self.array.dtype}, shape {_shape_str(self.array.shape)})"


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
        return _record(
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

    def kernel_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``_core.forward`` / ``_core.decode`` /
        ``_core.backward`` this record sets: the fields that differ from the
        defaults (which are the bindings' defaults), ``aligns`` as top_left.
        Only what is set is passed: every keyword costs the binding a lookup."""
        kw = {}
        for n, v in vars(self).items():
            d = _DEFAULTS[n]
            if v is d or (n in _SCALARS and v == d):
                continue
            kw[n] = v
        if kw.pop("aligns", None) is not None:
            kw["top_left"] = self.top_left
        return kw

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
_SCALARS = {"causal", "window_left", "window_right", "layout_bq", "layout_bk", "aligns"}


def _record(**kw: Any) -> MaskArgs:
    """``MaskArgs(**kw)`` without the frozen dataclass's per-field __init__
    (the merge runs on every call): the same record, built by filling its dict."""
    obj = object.__new__(MaskArgs)
    vars(obj).update(_DEFAULTS, **kw)
    return obj


_CAUSAL = {a: MaskArgs(causal=True, aligns=frozenset({a})) for a in _ALIGNS}

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
            compact = _refine(compact, fq, fk)
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
    in-range pairs. ``_cyloops.block_summary``, or ``_summary_numpy``.
    """
    m = np.asarray(mask)
    if m.dtype not in (np.dtype(np.bool_), np.dtype(np.uint8)):
        raise MaskTypeError(f"mask must be a bool or uint8 array, got dtype {m.dtype}")
    if m.ndim != 4:
        raise ValueError(f"mask must be (B, H, Lq, Lk), got shape {_shape_str(m.shape)}")
    block = check_int(block, "block", 1)
    if _loops.USE_CYTHON:
        return _cyloops.block_summary(m.view(np.uint8), block, num_threads=_loops.threads())
    return _summary_numpy(m, block)


def _summary_numpy(m, block):
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
