"""Argument checking shared by the public functions: dtypes, shapes, layout.

Every error names the argument and the shapes involved.

Array interop: ``as_array`` reads NumPy arrays, CPU torch tensors and anything
exposing ``__array_interface__``, the buffer protocol or DLPack (JAX CPU arrays,
CuPy's CPU peers, ...) as a NumPy view of the same memory, through its strides,
without copying. Memory that is not on the CPU raises TypeError.

16-bit dtypes (``as_float_array(..., half=True)``): float16 (NumPy, torch) is
read as NumPy float16; bfloat16 (torch.bfloat16, ``ml_dtypes.bfloat16``),
which NumPy lacks, is read zero-copy as its uint16 bit patterns: after
``as_float_array`` a uint16 array (``BF16``) means bfloat16. ``to_float``,
``from_float``, ``half_result`` and ``to_input_kind`` convert at the edges.
"""

from __future__ import annotations

import math
import operator
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
F16 = np.dtype(np.float16)
BF16 = np.dtype(np.uint16)  # bfloat16 held as its bit patterns (after as_float_array)
HALF_DTYPES = (F16, BF16)
_HALF_HINT = (
    "bfloat16 and float16 are supported by scaled_dot_product_attention, attention, "
    "varlen_attention, their backward, KVCache, PagedKVCache, attn_fast.torch, the "
    "variants, RoPE and the layers (dtype=) only; cast to float32 here (x.float() / "
    "x.astype(np.float32))"
)


def _ml_bfloat16():
    """ml_dtypes.bfloat16 when ml_dtypes is importable (optional), else None."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


class _BF16Bits(np.ndarray):
    """Internal: uint16 data that holds bfloat16 bits, passed from one public
    function to another (attention -> scaled_dot_product_attention)."""


def bf16_bits(a):
    """Tag a uint16 array of bfloat16 bits so ``as_float_array`` reads it as bfloat16."""
    return np.asarray(a).view(_BF16Bits)


def dtype_name(dt):
    """The name of a kernel dtype, bfloat16 for BF16 bits."""
    dt = np.dtype(dt)
    return "bfloat16" if dt == BF16 else str(dt)


def compute_dtype(dt):
    """What lse, biases, ALiBi slopes and sinks use for storage dtype dt:
    float32 for the 16-bit types."""
    dt = np.dtype(dt)
    return np.dtype(np.float32) if dt in HALF_DTYPES else dt


def bf16_to_f32(bits):
    """float32 values of uint16 bfloat16 bit patterns (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """uint16 bfloat16 bits of float32 values, round to nearest even, NaN kept
    NaN (as the kernels)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, ((u >> 16) | np.uint32(0x40)).astype(np.uint16), r)


def to_float(a, dtype=np.float64):
    """`a` (a kernel array: float16/32/64 or BF16 bits) as floating values of `dtype` (a copy)."""
    a = np.asarray(a)
    if a.dtype == BF16:
        return bf16_to_f32(a).astype(dtype)
    return a.astype(dtype)


def from_float(x, dtype):
    """Float values `x` in the kernel dtype `dtype` (BF16 bits: rounded to nearest even)."""
    if np.dtype(dtype) == BF16:
        return f32_to_bf16(np.asarray(x, dtype=np.float32))
    return np.asarray(x).astype(dtype)


def half_result(a):
    """A result array for NumPy callers: BF16 bits become an ``ml_dtypes.bfloat16``
    view (no copy) when ml_dtypes is importable, else stay uint16 bits; any other
    array is returned unchanged."""
    if isinstance(a, np.ndarray) and a.dtype == BF16:
        bf = _ml_bfloat16()
        return a.view(np.ndarray).view(bf) if bf is not None else a.view(np.ndarray)
    return a


def to_input_kind(result, like):
    """`result` (a NumPy array from attn_fast, or a tuple of them) in the kind of
    the caller's input `like`: a torch tensor for torch input (bfloat16 bits /
    ml_dtypes bfloat16 become a torch.bfloat16 tensor sharing the memory,
    float16 a torch.float16 one), an ``ml_dtypes.bfloat16`` array for ml_dtypes
    input, else unchanged. Tensors and non-arrays (KernelStats, None) pass
    through; a plain tuple is converted element by element."""
    t = type(result)
    if t is np.ndarray and result.dtype in _FAST_NP_DTYPES:  # the common cases, first
        if type(like) in _TORCH_TYPES:
            return sys.modules["torch"].from_numpy(result)
        if type(like) is np.ndarray:  # what half_result gives a float32/64/16 array
            return result
    if type(result) is tuple:
        return tuple(to_input_kind(r, like) for r in result)
    if not isinstance(result, np.ndarray):
        return result
    if _is_torch_tensor(like):
        import torch

        a = result.view(np.ndarray)
        if a.dtype == BF16 or _np_is_bf16(a.dtype):
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    return half_result(result)


_DLPACK_CPU = 1  # DLDeviceType.kDLCPU


_TORCH_TYPES: set = set()  # tensor types seen, so the check is one set lookup per call


def _is_torch_tensor(x):
    """True for torch.Tensor and its subclasses (Parameter, ...), without importing torch."""
    t = type(x)
    if t in _TORCH_TYPES:
        return True
    if any(c.__module__ == "torch" and c.__name__ == "Tensor" for c in t.__mro__):
        _TORCH_TYPES.add(t)
        if not _TORCH_FAST:  # the fast paths' torch kinds (and _core's), once
            _torch_fast_kinds()
        return True
    return False


_TORCH_CONST: dict = {}  # torch.bfloat16, torch.strided, ... once torch is imported


def _torch_attr(x, name):
    """torch.<name> (torch.bfloat16, torch.strided) for a torch tensor `x`, from the module
    that defined its type (imported, since `x` exists): an identity test instead of str()."""
    v = _TORCH_CONST.get(name)
    if v is None:
        v = _TORCH_CONST[name] = getattr(sys.modules["torch"], name)
    return v


_NP_BF16_NAMES: dict = {}  # NumPy dtype -> whether it is a bfloat16 dtype (ml_dtypes), cached


def _np_is_bf16(dt) -> bool:
    """Whether NumPy dtype `dt` is bfloat16 (ml_dtypes), one dict lookup after the first."""
    r = _NP_BF16_NAMES.get(dt)
    if r is None:
        r = _NP_BF16_NAMES[dt] = dt.name == "bfloat16"
    return r


def detached(x):
    """`x`, or ``x.detach()`` for a torch tensor that requires grad (read, never
    differentiated: q, k, v, masks, slopes, sinks, scales and RoPE inputs alike)."""
    if _is_torch_tensor(x) and x.requires_grad:
        return x.detach()
    return x


def _check_on_cpu(x, name):
    """TypeError unless `x` (not a NumPy array) lives in CPU memory."""
    if _is_torch_tensor(x):
        if x.device.type != "cpu":
            raise TypeError(
                f"{name} is a torch tensor on device {x.device}; attn_fast computes on the CPU "
                "only (use .cpu())"
            )
        if x.layout is not _torch_attr(x, "strided"):  # sparse layouts have no strides to read
            raise TypeError(
                f"{name} is a torch tensor with layout {x.layout}; only dense (strided) tensors "
                "are supported"
            )
        return
    if hasattr(x, "__cuda_array_interface__"):
        raise TypeError(
            f"{name} ({type(x).__name__}) lives in GPU memory; attn_fast computes on the CPU only"
        )
    dl_device = getattr(x, "__dlpack_device__", None)
    if dl_device is not None:
        try:
            dev_type, dev_id = dl_device()
        except Exception:  # noqa: BLE001 - a broken __dlpack_device__ is reported below when reading
            return
        if int(dev_type) != _DLPACK_CPU:
            raise TypeError(
                f"{name} ({type(x).__name__}) lives on DLPack device {dev_type!s}:{dev_id}; "
                "attn_fast computes on the CPU only"
            )


def as_array(x, name):
    """A NumPy array reading `x`'s memory through its strides, without copying.

    Accepts NumPy arrays, CPU torch tensors (a tensor that requires grad is
    read through ``detach()``: the result is a NumPy array and carries no
    gradient; a view with torch's lazy negation or conjugation bit is read as its
    values, a copy), and objects exposing ``__array_interface__``, the buffer protocol
    or ``__dlpack__`` on the CPU. Other sequences (lists) are converted by
    ``np.asarray`` (a copy). Any dtype; read-only inputs stay read-only.
    Raises TypeError for GPU / non-CPU memory and for unreadable objects.
    """
    if isinstance(x, np.ndarray):
        return x
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    _check_on_cpu(x, name)
    if _is_torch_tensor(x):
        t = x.detach() if x.requires_grad else x
        if t.is_neg() or t.is_conj():  # Tensor.numpy() and a dtype view refuse the lazy bits
            t = t.resolve_conj().resolve_neg()
        if t.dtype is _torch_attr(t, "bfloat16"):  # NumPy has no bfloat16: its bits, same memory
            return (_TORCH_FAST or _torch_fast_kinds())["bits"](t)
        try:
            return t.numpy()  # shares memory, keeps strides
        except (TypeError, RuntimeError) as e:
            raise TypeError(
                f"{name}: cannot read a torch tensor of dtype {t.dtype} as an array ({e})"
            ) from None
    if (
        hasattr(x, "__dlpack__")
        and not hasattr(x, "__array_interface__")
        and not hasattr(x, "__array_struct__")
        and not _has_buffer(x)
    ):
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError) as e:
            raise TypeError(
                f"{name}: cannot read {type(x).__name__} through DLPack ({e})"
            ) from None
    try:
        return np.asarray(x)
    except Exception as e:  # noqa: BLE001 - report what the object was
        raise TypeError(f"{name}: cannot read {type(x).__name__} as an array ({e})") from None


# Fast paths (KVCache.attend, scaled_dot_product_attention, the torch op) take
# the arrays whose metadata a checked call of the same shapes already accepted.
# These are the input kinds they read; anything else takes the checked path.
_FAST_NP_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.float16))


def fast_view(x):
    """(view, kind) for a fast path, or None when `x` needs the checked path.

    view: the NumPy array ``as_float_array(x, half=True)`` would return, read
    without its checks: an exact ``numpy.ndarray`` of float32 / float64 /
    float16, aligned, or a CPU strided torch tensor that does not require grad
    (torch.bfloat16 as its uint16 bits, as ``as_array`` reads it). kind: what
    the checked path's acceptance depended on besides the view's shape and
    strides (the NumPy dtype, or the torch dtype), for a plan's key. Costs a
    few attribute reads; never raises for a tensor (None instead).
    """
    t = type(x)
    if t is np.ndarray:
        if x.dtype in _FAST_NP_DTYPES and x.flags.aligned:
            return x, x.dtype
        return None
    if t in _TORCH_TYPES:
        kinds = _TORCH_FAST or _torch_fast_kinds()
        try:
            dt = x.dtype
            bits = kinds.get(dt)  # None: not a float dtype; True: bfloat16, read as bits
            if bits is None:
                return None
            if bits:
                a = kinds["bits"](x)
            else:
                a = x.numpy()  # raises for grad, non-CPU, sparse, conj / neg bits
        except (TypeError, RuntimeError):
            return None
        return (a, dt) if a.flags.aligned else None
    return None


# fast_view's torch dtypes: {torch dtype: read as bits}, and "bits": a bfloat16 tensor's
# memory as a NumPy uint16 array.
_TORCH_FAST: dict = {}


def _torch_fast_kinds():
    import torch

    def as_uint16(t):  # torch >= 2.3 converts its uint16 to NumPy: one view fewer
        return t.view(torch.uint16).numpy()

    def as_int16(t):
        return t.view(torch.int16).numpy().view(np.uint16)

    try:
        probe = as_uint16(torch.zeros(1, dtype=torch.bfloat16))
        bits = as_uint16 if probe.dtype == np.uint16 else None
    except (AttributeError, TypeError, RuntimeError):
        bits = None
    _TORCH_FAST.update(
        {torch.float32: False, torch.float64: False, torch.float16: False, torch.bfloat16: True}
    )
    _TORCH_FAST["bits"] = bits or as_int16
    _hand_torch_to_core()
    return _TORCH_FAST


def _hand_torch_to_core(dlpack=True):
    """Hand torch's kinds to _core, whose planned calls read tensors in C (the same kinds
    fast_view reads). With ``dlpack`` a tensor's dtype, sizes, strides and data come from
    torch's DLPack exchange table (torch.Tensor.__dlpack_c_exchange_api__, DLPack 1.2+) in
    one C call; without it, or on a torch without the table, from its Python attributes
    (tests run both readers)."""
    import torch

    from . import _core

    _core.set_torch(
        torch.Tensor,
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.strided,
        torch.from_numpy,
        torch._C._are_functorch_transforms_active,
        torch._C._len_torch_dispatch_stack,
        torch._C._is_torch_function_mode_enabled,
        getattr(torch.Tensor, "__dlpack_c_exchange_api__", None) if dlpack else None,
    )


def _is_bf16_input(x, arr):
    """True when `x` (read as `arr` by as_array) holds bfloat16."""
    if isinstance(x, _BF16Bits) or _np_is_bf16(arr.dtype):
        return True
    return _is_torch_tensor(x) and x.dtype is _torch_attr(x, "bfloat16")


def _has_buffer(x):
    try:
        memoryview(x)
    except TypeError:
        return False
    return True


def as_float_array(x, name, half=False):
    """View `x` as a NumPy float32/float64 array without copying when possible.

    Accepts what ``as_array`` accepts. Copies only big-endian or misaligned
    data. Raises TypeError for other dtypes and non-CPU memory.
    With ``half=True`` float16 (NumPy or torch) and bfloat16 (torch.bfloat16,
    ``ml_dtypes.bfloat16``) are accepted too, zero-copy: float16 as a NumPy
    float16 array, bfloat16 as a uint16 array of its bits (``BF16``).
    Without it they raise TypeError with a cast hint.
    """
    arr = as_array(x, name)
    if _is_bf16_input(x, arr):
        if not half:
            raise TypeError(f"{name} must be float32 or float64, got dtype bfloat16 ({_HALF_HINT})")
        arr = arr.view(np.ndarray).view(np.uint16)
        if not arr.flags.aligned or any(s % 2 for s in arr.strides):
            arr = arr.copy()
        return arr
    if arr.dtype.kind == "f" and arr.dtype.itemsize == 2:
        if not half:
            raise TypeError(f"{name} must be float32 or float64, got dtype float16 ({_HALF_HINT})")
    elif arr.dtype.kind != "f" or arr.dtype.itemsize not in (4, 8):
        raise TypeError(f"{name} must be float32 or float64, got dtype {arr.dtype}")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if not arr.flags.aligned or any(s % arr.itemsize for s in arr.strides):
        arr = arr.copy()  # a fresh allocation is aligned
    return arr


def as_out_array(out, name="out"):
    """A writeable NumPy view of a caller-provided output array or tensor.

    Accepts a NumPy array, a CPU torch tensor that does not require grad, or
    any writeable object ``as_array`` reads; the result shares its memory, so
    writing the view writes `out`. Raises ValueError if it is read-only,
    TypeError if it requires grad or is not on the CPU.
    """
    if _is_torch_tensor(out) and out.requires_grad:
        raise TypeError(
            f"{name} is a torch tensor that requires grad; attn_fast writes results without "
            "autograd, "
            "pass a tensor that does not require grad"
        )
    if _is_torch_tensor(out) and (out.is_neg() or out.is_conj()):  # as_array would copy it
        raise TypeError(
            f"{name} is a torch view with a lazy negation / conjugation bit (its memory does "
            "not hold its values): pass a tensor without it (out.resolve_neg())"
        )
    o = as_array(out, name)
    if _np_is_bf16(o.dtype):  # ml_dtypes: its bits, the same memory
        o = o.view(np.uint16)
    if not isinstance(out, np.ndarray) and o.base is None:
        # np.asarray made a fresh copy (a list, say): results written there would be lost.
        raise TypeError(
            f"{name} must be a numpy.ndarray (or expose its memory), got {type(out).__name__}"
        )
    if not o.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return o


def check_same_dtype(**arrays):
    dts = {name: a.dtype for name, a in arrays.items() if a is not None}
    if len(set(dts.values())) > 1:
        desc = ", ".join(f"{n} {dtype_name(d)}" for n, d in dts.items())
        first = next(iter(dts))
        raise TypeError(
            f"mixed dtypes are not supported ({desc}); cast them to one float dtype, "
            f"e.g. x.to({first}.dtype) for torch tensors or x.astype({first}.dtype) for NumPy "
            "arrays"
        )


def shape_str(a):
    return str(tuple(a.shape))


# ---------------------------------------------------------------- scalars and options


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type or dtype (a float where a count goes, a
    string where a scale goes, float lengths, a non-boolean mask layout). A
    TypeError, and a ValueError as well for callers that caught what
    ``int(x)`` / ``float(x)`` used to raise or what the mask checks raised
    (``masks.MaskTypeError`` is this class)."""


def check_int(x: Any, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """`x` as a Python int: ArgumentTypeError (a TypeError and a ValueError)
    unless it is an integer (bool, numpy.bool_, floats and strings are
    refused, so 2.5 is never silently truncated to 2), ValueError outside
    [minimum, maximum]."""
    if isinstance(x, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be an integer, got bool {x!r}")
    try:
        x = operator.index(x)  # ints, NumPy integers, 0-d integer arrays; not floats
    except TypeError:
        raise ArgumentTypeError(
            f"{name} must be an integer, got {type(x).__name__} {x!r}"
        ) from None
    low = minimum is not None and x < minimum
    high = maximum is not None and x > maximum
    if (low or high) and minimum is not None and maximum is not None:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {x}")
    if low:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    if high:
        raise ValueError(f"{name} must be <= {maximum}, got {x}")
    return x


def check_seq_lens(x: Any, name: str, B: int, upper: int | None = None) -> np.ndarray:
    """Per-sequence lengths: an int (the same for every sequence) or a (B,)
    integer array, as a fresh (B,) int64 array (aligned, native, contiguous:
    the kernels read it raw) with every value in [0, upper]. The one validator
    of per-sequence lengths (masks, the caches' q_lens / lengths / n).

    ArgumentTypeError (a TypeError and a ValueError) for a non-integer dtype
    (bool and float included), ValueError for a wrong shape or a value out of
    range (uint64 values beyond int64 included), naming `name`, the bound
    broken and the shapes.
    """
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise ArgumentTypeError(
            f"{name} must hold integers ({name} must be an int, or one per sequence: "
            f"shape ({B},)), got dtype {a.dtype}"
        )
    if a.size and a.dtype == np.uint64 and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds values beyond int64, max {a.max()}")
    if a.ndim == 0:
        a = np.full(B, a, dtype=np.int64)
    if a.shape != (B,):
        raise ValueError(
            f"{name} must have one length per batch entry, shape ({B},), got shape {shape_str(a)}"
        )
    a = a.astype(np.int64)  # a fresh copy
    if a.size and (a.min() < 0 or (upper is not None and a.max() > upper)):
        got = f"got values in [{a.min()}, {a.max()}]"
        if upper is None:
            raise ValueError(f"{name} must be >= 0, {got}")
        broken = ">= 0" if a.min() < 0 else f"<= {upper}"
        raise ValueError(f"{name} must lie in [0, {upper}], {got} ({name} must be {broken})")
    return a


def check_real(x, name, *, minimum=None, positive=False):
    """`x` as a finite Python float: TypeError for what is not a real number
    (bool and strings included), ValueError for NaN, inf, x < minimum, or
    x <= 0 when ``positive``. A torch scalar that requires grad is read detached."""
    x = detached(x)
    if isinstance(x, (bool, np.bool_, str, bytes)) or np.iscomplexobj(x):
        raise ArgumentTypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    try:
        x = float(x)  # floats, ints, NumPy scalars, 0-d arrays
    except (TypeError, ValueError):
        raise ArgumentTypeError(
            f"{name} must be a real number, got {type(x).__name__} {x!r}"
        ) from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    if positive and not x > 0:
        raise ValueError(f"{name} must be > 0, got {x}")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return x


def check_scale(scale, d, dtype=None):
    """The softmax scale: 1/sqrt(d) when None, else a finite real number.

    With ``dtype`` (the inputs' float dtype) the scale must also be finite in
    that dtype: ``scale=1e300`` with float32 inputs is a ValueError (the
    kernels multiply q by float32(scale) = inf, so every score was inf or NaN).
    The C++ bindings refuse it too, for callers that pass no dtype.
    """
    if scale is None:
        return 1.0 / math.sqrt(d)
    scale = check_real(scale, "scale")
    if dtype is not None:
        dt = compute_dtype(dtype)  # 16-bit inputs are computed in float32
        if abs(scale) > float(np.finfo(dt).max):
            raise ValueError(
                f"scale = {scale!r} overflows {dt} (the inputs' compute dtype; largest "
                f"{np.finfo(dt).max})"
            )
    return scale


def check_float_dtype(dtype, name="dtype"):
    """np.dtype(dtype), which must be float32 or float64 (TypeError otherwise)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be float32 or float64, got {dtype!r}") from None
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or float64, got {dt}")
    return dt


# ---------------------------------------------------------------- out= arrays


def self_overlapping(a):
    """True unless the strides prove that no two elements of `a` share memory.

    Sorted by stride, each axis must step past everything the smaller axes
    span; zero strides (broadcast views) and as_strided tricks fail this.
    """
    if a.size <= 1:
        return False
    extent = a.itemsize
    for stride, n in sorted((abs(st), n) for st, n in zip(a.strides, a.shape) if n > 1):
        if stride < extent:
            return True
        extent += stride * (n - 1)
    return False


def check_out(out, shape, dtype, name="out"):
    """A writeable view of a caller's `out` (array or CPU tensor) that a kernel
    may write in place: the given shape and dtype, aligned, native byte order,
    no two elements sharing memory. ValueError / TypeError naming the shapes."""
    o = as_out_array(out, name)
    if o.shape != tuple(shape):
        raise ValueError(f"{name} has shape {shape_str(o)}, expected {tuple(shape)}")
    if o.dtype != dtype:
        raise TypeError(f"{name} has dtype {dtype_name(o.dtype)}, expected {dtype_name(dtype)}")
    if not o.flags.aligned or not o.dtype.isnative:
        raise ValueError(f"{name} must be aligned and in native byte order")
    if self_overlapping(o):
        raise ValueError(
            f"{name} has overlapping memory (strides {o.strides} for shape {shape_str(o)})"
        )
    return o


def alias_safe(o, *inputs):
    """(o, target): a temporary to write into when `o` shares memory with an
    input (target is then the caller's array, to copy the result to), else (o, None)."""
    if any(isinstance(x, np.ndarray) and np.may_share_memory(o, x) for x in inputs):
        return np.empty(o.shape, dtype=o.dtype), o
    return o, None


# ---------------------------------------------------------------- flags and results


def check_bool(x, name):
    """`x` as a Python bool: True/False or a NumPy bool; anything else (0.1, 1,
    "yes", None) is a TypeError naming the argument, never a silent truth test."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise ArgumentTypeError(f"{name} must be a bool (True or False), got {type(x).__name__} {x!r}")


# ---------------------------------------------------------------- q, k, v


def to4(x: np.ndarray, name: str) -> np.ndarray:
    """(L, d), (H, L, d) or (B, H, L, d) as a 4-D view (B, H, L, d); ValueError otherwise."""
    if x.ndim == 2:
        return x[None, None]
    if x.ndim == 3:
        return x[None]
    if x.ndim == 4:
        return x
    raise ValueError(
        f"{name} must have 2, 3 or 4 dimensions ((L, d), (H, L, d) or (B, H, L, d)), "
        f"got shape {shape_str(x)}"
    )


class QKV(NamedTuple):
    """q, k, v as checked by ``check_qkv``: NumPy arrays of the callers' shapes,
    their 4-D (B, H, L, d) views, and the sizes (B, Hq, Hkv, Lq, Lk, d, dv)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray | None
    q4: np.ndarray
    k4: np.ndarray
    v4: np.ndarray | None
    dims: tuple[int, int, int, int, int, int, int]


def check_heads(Hq: int, Hkv: int, enable_gqa: bool) -> None:
    """ValueError unless Hkv == Hq, or (grouped-query) Hq is a multiple of Hkv."""
    if Hkv != Hq:
        if not enable_gqa:
            raise ValueError(
                f"q has {Hq} heads but k/v have {Hkv}; "
                "pass enable_gqa=True for grouped-query attention"
            )
        if Hkv == 0 or Hq % Hkv != 0:
            raise ValueError(f"q has {Hq} heads, not a multiple of k/v's {Hkv} heads")


def check_qkv(
    q: Any,
    k: Any,
    v: Any,
    *,
    half: bool = False,
    enable_gqa: bool | None = False,
    same_len: bool = False,
) -> QKV:
    """The one q/k/v checker: (L, d), (H, L, d) or (B, H, L, d) arrays of one dtype.

    q (…, Lq, d), k (…, Lk, d), v (…, Lk, dv) or None (the weights need no v),
    the same number of dimensions. Read by ``as_float_array`` (16-bit dtypes
    with ``half``). k and v agree on batch, heads and length; q and k on the
    head dim d >= 1 and the batch. Heads: ``enable_gqa`` True allows
    H_kv | H (grouped-query), False asks for it when they differ, None
    (functions without GQA) requires the same heads. ``same_len``: Lq == Lk
    too (only with ``enable_gqa=None``; linear attention). ValueError /
    TypeError naming the shapes.
    """
    q = as_float_array(q, "q", half=half)
    k = as_float_array(k, "k", half=half)
    if v is not None:
        v = as_float_array(v, "v", half=half)
    check_same_dtype(q=q, k=k, v=v)
    if not (q.ndim == k.ndim and (v is None or v.ndim == q.ndim)):
        vs = "" if v is None else f", v {shape_str(v)}"
        raise ValueError(
            "q, k and v must all be (L, d), (H, L, d) or (B, H, L, d) with the same number "
            f"of dimensions, got q {shape_str(q)}, k {shape_str(k)}{vs}"
        )
    q4, k4 = to4(q, "q"), to4(k, "k")
    B, Hq, Lq, d = q4.shape
    Bk, Hkv, Lk, dk = k4.shape
    if dk != d:
        raise ValueError(f"k has shape {shape_str(k)} but q has head dim {d}")
    if d == 0:
        raise ValueError(f"q has shape {shape_str(q)}: head dim d must be at least 1")
    dv, v4 = d, None
    if v is not None:
        v4 = to4(v, "v")
        Bv, Hv, Lv, dv = v4.shape
        if (Bk, Hkv, Lk) != (Bv, Hv, Lv):
            raise ValueError(
                f"k has shape {shape_str(k)} but v has shape {shape_str(v)}: "
                "batch, heads and length must match"
            )
    if enable_gqa is None:  # no grouped-query heads: batch and heads (and length) as q's
        if (Bk, Hkv) != (B, Hq) or (same_len and Lk != Lq):
            what = "batch, heads and length" if same_len else "batch and heads"
            raise ValueError(
                f"q has shape {shape_str(q)} but k has shape {shape_str(k)}: {what} must match"
            )
    if Bk != B:
        raise ValueError(
            f"k has shape {shape_str(k)} but q has shape {shape_str(q)}: batch sizes differ"
        )
    if enable_gqa is not None:
        check_heads(Hq, Hkv, enable_gqa)
    return QKV(q, k, v, q4, k4, v4, (B, Hq, Hkv, Lq, Lk, d, dv))


# ---------------------------------------------------------------- results


@dataclass
class Output:
    """Where a kernel writes its result and how that reaches the caller.

    ``prepare`` gives ``array``, the (C-contiguous new, or the caller's
    checked ``out``) array the kernel writes; when ``out`` shares memory with
    an input the kernel writes a temporary instead, copied to ``out`` by
    ``result``. ``result(*extra)`` returns the caller's own ``out`` object
    (extras in the input's kind) or the new array, as a torch tensor for
    torch input (``to_input_kind``), with the extras (lse, stats, ...) after
    it in a tuple when there are any.
    """

    array: np.ndarray
    out: Any = None
    target: np.ndarray | None = None
    like: Any = None

    @classmethod
    def prepare(
        cls, out: Any, shape: tuple[int, ...], dtype: np.dtype, like: Any, reads: tuple = ()
    ) -> Output:
        """The output of a call whose input (for the result's kind) is `like` and
        which reads the arrays `reads` (checked for aliasing with ``out``)."""
        if out is None:
            return cls(np.empty(shape, dtype=dtype), like=like)
        o, target = alias_safe(check_out(out, shape, dtype), *reads)
        return cls(o, out, target, like)

    def result(self, *extra: Any) -> Any:
        """The call's return value: out (or the new array), then `extra` if any."""
        if self.target is not None:
            self.target[...] = self.array
        if self.out is not None:  # the caller's own object back (ndarray or tensor)
            return (self.out, *to_input_kind(tuple(extra), self.like)) if extra else self.out
        return to_input_kind((self.array, *extra) if extra else self.array, self.like)
