"""16-bit (float16 / bfloat16) arithmetic for the NumPy layers.

The layers (``MultiHeadAttention``, the norms and feed-forwards of
``transformer``, ``TinyTransformerLM``) take their weights' dtype from
``dtype=``: float32, float64, or a 16-bit one, float16 (NumPy's) or bfloat16
(``ml_dtypes.bfloat16``: NumPy has no bfloat16, so 16-bit bfloat16 layers
need the optional ml_dtypes package). A 16-bit layer keeps its weights in
that dtype and takes inputs of that dtype only (NumPy float16 arrays,
``ml_dtypes.bfloat16`` arrays, torch.float16 / torch.bfloat16 tensors); its
attention runs through the 16-bit kernel. NumPy has no 16-bit matrix product
with fp32 accumulation, so each product is done in float32 (both operands
upcast for that product) and its result rounded to the 16-bit dtype once;
element-wise steps (norms, activations, residual adds) likewise compute in
float32 from 16-bit operands and round their result. Between steps every
activation is 16-bit, as in a torch model run in that dtype.

Internally a bfloat16 activation is an ``ml_dtypes.bfloat16`` array (the
attention functions read it zero-copy); ``as_layer_input`` converts the
other input kinds at the edge.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._checks import (
    BF16,
    F16,
    FLOAT_DTYPES,
    _BF16Bits,
    _ml_bfloat16,
    as_float_array,
    bf16_to_f32,
    dtype_name,
    shape_str,
)

F32 = np.dtype(np.float32)


def _torch_name(dtype: Any) -> str | None:
    name = str(dtype)
    return name[len("torch.") :] if name.startswith("torch.") else None


def layer_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    """The weights' dtype for ``dtype=``: float32, float64, float16 or bfloat16
    (given as "bfloat16", ``ml_dtypes.bfloat16`` or torch.bfloat16; returned as
    ``np.dtype(ml_dtypes.bfloat16)``). TypeError for anything else, ImportError
    for bfloat16 without ml_dtypes."""
    tname = _torch_name(dtype)
    if tname is not None:
        dtype = tname
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        dt = None
    else:
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise TypeError(
                f"{name} must be float32, float64, float16 or bfloat16, got {dtype!r}"
            ) from None
        if dt in FLOAT_DTYPES or dt == F16:
            return dt
        if dt.name != "bfloat16":
            raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {dt}")
    bf = _ml_bfloat16()
    if bf is None:
        raise ImportError(
            f"{name}=bfloat16 layers keep their weights as ml_dtypes.bfloat16 arrays (NumPy has "
            "no bfloat16): pip install ml_dtypes, or use float16 / float32"
        )
    return bf


def is_half(dt: Any) -> bool:
    """True for the 16-bit layer dtypes (float16, ml_dtypes.bfloat16)."""
    dt = np.dtype(dt)
    return dt == F16 or dt.name == "bfloat16"


def cast_hint(dt: np.dtype) -> str:
    """How to cast an input to a layer of dtype `dt`."""
    if dt.name == "bfloat16":
        return "x.to(torch.bfloat16) / x.astype(ml_dtypes.bfloat16)"
    if dt == F16:
        return "x.to(torch.float16) / x.astype(np.float16)"
    return f"x.to(torch.{dt}) / x.astype(np.{dt})"


def as_layer_input(
    x: Any, name: str, dt: np.dtype, what: str = "the layer's weights"
) -> np.ndarray:
    """`x` as a NumPy array of the layer dtype `dt` (bfloat16: an ml_dtypes view of the
    same memory), or TypeError naming both dtypes with a cast hint."""
    a = as_float_array(x, name, half=True)  # big-endian / misaligned data: copied once
    if a.dtype == BF16:
        bf = _ml_bfloat16()
        a = a.view(np.ndarray).view(bf) if bf is not None else a.view(np.ndarray)
    if a.dtype != dt:
        raise TypeError(
            f"{name} has dtype {dtype_name(a.dtype)} but {what} are {dtype_name(dt)}; "
            f"cast it ({cast_hint(dt)}) or build the layer with dtype={dtype_name(a.dtype)}"
        )
    return a


def bf16_values(x: Any) -> Any:
    """`x` with bfloat16 data replaced by its float32 values (exact): a torch.bfloat16
    tensor becomes a float32 tensor, an ``ml_dtypes.bfloat16`` array (or tagged
    bfloat16 bits) a float32 array; anything else is returned as it is. For the
    small float operands (ALiBi slopes, sinks, a Dense bias) that NumPy cannot
    read from a torch.bfloat16 tensor."""
    if isinstance(x, _BF16Bits):
        return bf16_to_f32(x.view(np.ndarray))
    if isinstance(x, np.ndarray):
        return x.astype(F32) if x.dtype.name == "bfloat16" else x
    if str(getattr(x, "dtype", "")) == "torch.bfloat16" and hasattr(x, "float"):
        return x.detach().float()
    return x


def f32(a: np.ndarray) -> np.ndarray:
    """A 16-bit array's values in float32 (exact: a copy)."""
    return a.astype(F32)


def linear(
    x: np.ndarray, W: np.ndarray, b: np.ndarray | None = None, *, fp32: bool = False
) -> np.ndarray:
    """y = x Wᵀ (+ b), torch's Linear. Native dtypes: in place of the product.
    16-bit: the product (and the bias add) in float32, rounded once to W's dtype,
    or kept in float32 with ``fp32=True`` (the caller rounds after a further
    float32 step, RoPE for instance)."""
    if not is_half(W.dtype):
        y = x @ W.T
        if b is not None:
            y += b
        return y
    if x.dtype != W.dtype:  # internal: the callers check inputs first
        raise TypeError(f"x has dtype {x.dtype} but W has {W.dtype} (shape {shape_str(W)})")
    y = f32(x) @ f32(W).T
    if b is not None:
        y += f32(b)
    return y if fp32 else y.astype(W.dtype)


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b; 16-bit: in float32, rounded once (a residual add)."""
    if not is_half(a.dtype):
        return a + b
    return (f32(a) + f32(b)).astype(a.dtype)
