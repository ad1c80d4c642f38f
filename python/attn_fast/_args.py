"""The arguments of the attention functions, checked, as the kernel's records.

What ``scaled_dot_product_attention``, ``varlen_attention``, ``attention_weights``, their
backward and the flash_attn API share: the mask arguments (attn_mask, is_causal,
window_size) as one ``MaskArgs``, the score options (softcap, ALiBi slopes, sinks) as one
``ScoreArgs``, tile sizes, torch's argument names, and the packed varlen inputs. Each
raises ValueError / TypeError naming the argument.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _dispatch, masks
from ._checks import (
    as_float_array,
    check_heads,
    check_int,
    check_real,
    check_same_dtype,
    detached,
    shape_str,
)
from ._dispatch import ScoreArgs
from ._lowp import bf16_values
from .masks import MaskArgs

BACKENDS = ("fused", "reference", "decode")  # which kernel runs: _dispatch.choose_kernel


def mask_arrays(attn_mask: Any) -> list[np.ndarray]:
    """The arrays an attn_mask argument reads (alone, in a list, inside Dense /
    BlockSparse objects), for the check that `out` does not overlap them."""
    if attn_mask is None:
        return []
    if isinstance(attn_mask, (list, tuple)):
        return [a for m in attn_mask for a in mask_arrays(m)]
    if isinstance(attn_mask, masks.Mask):
        return [
            a
            for p in attn_mask._parts()
            for a in (getattr(p, "array", None), getattr(p, "layout", None))
            if isinstance(a, np.ndarray)
        ]
    try:
        return [
            np.asarray(detached(attn_mask))
        ]  # a tensor or other array-like: the memory the kernel will read
    except Exception:  # noqa: BLE001 - reported by the mask checks themselves
        return []


def block_size(b: Any, name: str) -> int:
    """A tile size in [0, 4096] (0 = the kernel's default)."""
    return check_int(b, name, 0, 4096)


def window_args(window_size: Any) -> MaskArgs:
    """FlashAttention's window_size=(left, right) as a MaskArgs (bottom-right)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    left = -1 if left is None else check_int(left, "window_size[0]")  # 2.5 and True are not sizes
    right = -1 if right is None else check_int(right, "window_size[1]")
    if left < -1 or right < -1:
        raise ValueError(
            f"window_size entries must be >= 0 (or -1/None for unbounded), got {window_size!r}"
        )
    return masks.window_args(
        None if left < 0 else left, None if right < 0 else right, "bottom_right"
    )


def score_args(Hq: int, dtype: DTypeLike, softcap: Any, alibi_slopes: Any, sinks: Any) -> ScoreArgs:
    """softcap, ALiBi slopes and sinks, checked, as a ScoreArgs record."""
    cap = 0.0
    if softcap is not None:
        cap = float(softcap)
        if not (cap > 0 and math.isfinite(cap)):
            raise ValueError(f"softcap must be a positive finite number, got {cap}")
    arrays = []
    for name, val in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        arr = None
        if val is not None:
            val = bf16_values(detached(val))  # torch.bfloat16: NumPy cannot read it
            if np.iscomplexobj(val):  # np.asarray(dtype=float) would drop the imaginary part
                raise TypeError(f"{name} must be real, got a complex {type(val).__name__}")
            arr = np.ascontiguousarray(np.asarray(val, dtype=dtype).reshape(-1))
            if arr.shape != (Hq,):
                raise ValueError(
                    f"{name} must have one value per query head ({Hq},), got shape {np.shape(val)}"
                )
        arrays.append(arr)
    if not cap and all(a is None for a in arrays):
        return _dispatch.PLAIN
    return ScoreArgs(cap, *arrays)


CAUSAL = MaskArgs(causal=True, aligns=frozenset({"bottom_right"}))  # is_causal=True


def mask_args(
    attn_mask: Any,
    is_causal: bool,
    window_size: Any,
    B: int,
    Hq: int,
    Lq: int,
    Lk: int,
    dtype: DTypeLike,
) -> MaskArgs:
    """attn_mask (array, Mask object or list of them), is_causal and
    window_size combined into one MaskArgs (their intersection), with the
    block summary of a dense boolean mask."""
    parts = []
    if attn_mask is not None:
        parts.append(masks.as_mask(attn_mask).kernel_args(B=B, H=Hq, Lq=Lq, Lk=Lk, dtype=dtype))
    if window_size is not None:
        parts.append(window_args(window_size))
    if is_causal:
        parts.append(CAUSAL)
    return masks.add_block_summary(MaskArgs.combine(parts, B, Lq, Lk))


def half_mask(attn_mask: Any) -> Any:
    """A float16 / bfloat16 additive attn_mask tensor or array (torch, ml_dtypes;
    NumPy float16 is read as is), which the mask objects cannot read, as float32
    (a copy at its own shape); anything else unchanged."""
    if attn_mask is None or isinstance(attn_mask, (list, tuple, masks.Mask)):
        return attn_mask
    if type(attn_mask).__module__.startswith("torch") and str(getattr(attn_mask, "dtype", "")) in (
        "torch.bfloat16",
        "torch.float16",
    ):
        return attn_mask.detach().float().cpu().numpy()
    if isinstance(attn_mask, np.ndarray) and attn_mask.dtype.name == "bfloat16":
        return attn_mask.astype(np.float32)
    return attn_mask


def check_backend(backend: Any) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def qkv_names(q: Any, k: Any, v: Any, query: Any, key: Any, value: Any) -> list[Any]:
    """q/k/v given positionally (or as q=, k=, v=) or under torch's names query=, key=, value=."""
    got = []
    for short, long_name, a, b in (
        ("q", "query", q, query),
        ("k", "key", k, key),
        ("v", "value", v, value),
    ):
        if a is not None and b is not None:
            raise TypeError(f"got both {short} and {long_name}; pass one of them")
        got.append(a if b is None else b)
    for name, x in zip(("q (query)", "k (key)", "v (value)"), got):
        if x is None:
            raise TypeError(f"{name} must be an array, got None")
    return got


def check_dropout(dropout_p: Any) -> float:
    p = check_real(dropout_p, "dropout_p", minimum=0.0)
    if p != 0.0:
        raise ValueError(
            "dropout_p must be 0 (attn_fast computes exact attention, it has no dropout), got "
            f"{dropout_p!r}; "
            "apply dropout to the output or call torch's own SDPA when training with attention "
            "dropout"
        )
    return p


# ---------------------------------------------------------------- varlen


def cu_seqlens(cu: ArrayLike, name: str, total: int) -> np.ndarray:
    a = np.asarray(cu)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.ndim != 1 or a.size < 1:
        raise ValueError(f"{name} must be 1-D (num_seqs + 1,), got shape {shape_str(a)}")
    if a.dtype == np.uint64 and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds values beyond int64, max {a.max()}")
    a = a.astype(np.int64)  # before diff: a uint64 diff wraps around instead of going negative
    if a[0] != 0:
        raise ValueError(f"{name} must start at 0, got {a[0]}")
    if np.any(np.diff(a) < 0):
        raise ValueError(f"{name} must be non-decreasing, got {a.tolist() if a.size <= 20 else a}")
    if a[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {a[-1]}")
    return np.ascontiguousarray(a)


def check_varlen(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    half: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Packed (total, heads, dim) q, k, v and their cu_seqlens, checked (shared by the
    forward and the backward): returns (q, k, v, cu_q, cu_k) as NumPy arrays."""
    q = as_float_array(q, "q", half=half)
    k = as_float_array(k, "k", half=half)
    v = as_float_array(v, "v", half=half)
    check_same_dtype(q=q, k=k, v=v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(
                f"{name} must be (total, heads, dim) for varlen attention, got shape {shape_str(x)}"
            )
    Tq, Hq, d = q.shape
    Tk, Hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"k has shape {shape_str(k)} but q has head dim {d}")
    if d == 0:
        raise ValueError(f"q has shape {shape_str(q)}: head dim d must be at least 1")
    if v.shape[:2] != (Tk, Hkv):
        raise ValueError(
            f"k has shape {shape_str(k)} but v has shape {shape_str(v)}: total length and heads "
            "must match"
        )
    check_heads(Hq, Hkv, True)
    cu_q = cu_seqlens(cu_seqlens_q, "cu_seqlens_q", Tq)
    cu_k = cu_seqlens(cu_seqlens_k, "cu_seqlens_k", Tk)
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"cu_seqlens_q has {cu_q.size - 1} sequences but cu_seqlens_k has {cu_k.size - 1}: "
            "they must match"
        )
    for name, mx, cu in (
        ("max_seqlen_q", max_seqlen_q, cu_q),
        ("max_seqlen_k", max_seqlen_k, cu_k),
    ):
        if mx is not None and cu.size > 1 and check_int(mx, name, 0) < int(np.diff(cu).max()):
            raise ValueError(
                f"{name} = {mx} is shorter than the longest sequence ({int(np.diff(cu).max())})"
            )
    return q, k, v, cu_q, cu_k


def varlen_args(causal: bool, window_size: Any) -> MaskArgs:
    """MaskArgs of varlen's causal flag and window (aligned per sequence, bottom-right,
    which the kernel does for cu_seqlens calls: no alignment is recorded)."""
    args = MaskArgs(causal=causal)
    if window_size is not None:
        w = window_args(window_size)
        args = MaskArgs(causal=causal, window_left=w.window_left, window_right=w.window_right)
    return args
