"""``BlockSparse``: a boolean layout of (query block, key block) pairs, its union
``|`` and the constructors of the classic patterns (``local``, ``strided``,
``global_tokens``), with their NumPy references. Re-exported by ``attn_fast.masks``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _cyloops, _loops
from ._checks import ArgumentTypeError, check_int
from ._mask_base import Mask, broadcast4, mask_array
from ._mask_record import MaskArgs, refine, shape_str


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
        self.layout = mask_array(
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
                f"BlockSparse layout of shape {shape_str(self.layout.shape)} with "
                f"block_q={self.block_q}, "
                f"block_k={self.block_k} covers ({nq * self.block_q}, {nk * self.block_k}) "
                "positions, "
                f"but (Lq, Lk) = ({Lq}, {Lk})"
            )
        view = broadcast4(self.layout, (B, H, nq, nk), "BlockSparse layout", "(B, H, nq, nk)")
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
            f"BlockSparse(layout {shape_str(self.layout.shape)}, block_q={self.block_q}, "
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
                raise ArgumentTypeError(
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


def _common_blocks(a, b):
    """Both layouts at the common block size gcd(block sizes)."""
    gq, gk = math.gcd(a.block_q, b.block_q), math.gcd(a.block_k, b.block_k)
    out = []
    for m in (a, b):
        lay = m.layout
        if (m.block_q, m.block_k) != (gq, gk):
            lay = refine(lay, m.block_q // gq, m.block_k // gk)
        out.append(BlockSparse(lay, gq, gk))
    return out
