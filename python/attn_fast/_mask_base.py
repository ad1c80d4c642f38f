"""The base of every mask object (``Mask``, its ``&``), ``as_mask``, and ``Dense``,
the mask that is an array (what ``as_mask`` makes of a NumPy array).

``mask_array`` and ``broadcast4`` read and broadcast a mask's array argument,
shared with ``BlockSparse`` (``_mask_block_sparse``). Re-exported by
``attn_fast.masks``, whose docstring describes the mask kinds and their rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ._checks import ArgumentTypeError, detached
from ._lowp import bf16_values
from ._mask_record import MaskArgs, shape_str, visibility


def mask_array(
    x: ArrayLike,
    dtype_ok: Callable[[np.dtype], bool],
    min_ndim: int,
    bad_dtype: str,
    bad_shape: str,
) -> np.ndarray:
    """`x` (read detached) as a NumPy array of an accepted dtype (ArgumentTypeError:
    `bad_dtype`, got dtype ...) with min_ndim to 4 dimensions (ValueError:
    `bad_shape`, got shape ...)."""
    a = np.asarray(detached(x))
    if not dtype_ok(a.dtype):
        raise ArgumentTypeError(f"{bad_dtype}, got dtype {a.dtype}")
    if a.ndim < min_ndim or a.ndim > 4:
        raise ValueError(f"{bad_shape}, got shape {shape_str(a.shape)}")
    return a


def broadcast4(arr: np.ndarray, shape: tuple[int, ...], name: str, what: str) -> np.ndarray:
    """View `arr` (ndim <= 4) broadcast to the 4-D `shape` (zero strides, no copy)."""
    if arr.ndim > 4:
        raise ValueError(f"{name} has shape {shape_str(arr.shape)}: at most 4 dimensions ({what})")
    try:
        return np.broadcast_to(arr.reshape((1,) * (4 - arr.ndim) + arr.shape), shape)
    except ValueError:
        raise ValueError(
            f"{name} has shape {shape_str(arr.shape)}, not broadcastable to {what} = "
            f"{shape_str(shape)}"
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
        ``ArgumentTypeError`` for arguments that do not fit the shapes."""
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
        self.array = mask_array(
            bf16_values(array),  # a bfloat16 bias: its float32 values (exact)
            lambda dt: dt == np.bool_ or dt.kind == "f",
            1,
            "attn_mask must be a boolean (True = attend) or float (additive) array",
            "attn_mask must be broadcastable to (B, H, Lq, Lk)",
        )

    def _args(self, B: int, H: int, Lq: int, Lk: int, dtype: np.dtype) -> MaskArgs:
        a = self.array
        if a.dtype == np.bool_:
            view = broadcast4(a, (B, H, Lq, Lk), "attn_mask", "(B, H, Lq, Lk)")
            return MaskArgs(mask=view.view(np.uint8))
        if a.dtype != dtype or not a.flags.aligned:
            a = a.astype(dtype)  # at the array's own shape, before broadcasting (aligned, native)
        return MaskArgs(bias=broadcast4(a, (B, H, Lq, Lk), "attn_mask", "(B, H, Lq, Lk)"))

    def __repr__(self) -> str:
        return f"Dense({self.array.dtype}, shape {shape_str(self.array.shape)})"
