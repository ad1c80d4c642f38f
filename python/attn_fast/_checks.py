"""Argument checking shared by the public functions: dtypes, shapes, layout.

Every error names the argument and the shapes involved.

Array interop: ``as_array`` reads NumPy arrays, CPU torch tensors and anything
exposing ``__array_interface__``, the buffer protocol or DLPack (JAX CPU arrays,
CuPy's CPU peers, ...) as a NumPy view of the same memory, through its strides,
without copying. Memory that is not on the CPU raises TypeError.
"""

from __future__ import annotations

import math
import operator

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_DLPACK_CPU = 1  # DLDeviceType.kDLCPU


_TORCH_TYPES: set = set()  # tensor types seen, so the check is one set lookup per call


def _is_torch_tensor(x):
    """True for torch.Tensor and its subclasses (Parameter, ...), without importing torch."""
    t = type(x)
    if t in _TORCH_TYPES:
        return True
    if any(c.__module__ == "torch" and c.__name__ == "Tensor" for c in t.__mro__):
        _TORCH_TYPES.add(t)
        return True
    return False


def _check_on_cpu(x, name):
    """TypeError unless `x` (not a NumPy array) lives in CPU memory."""
    if _is_torch_tensor(x):
        if x.device.type != "cpu":
            raise TypeError(f"{name} is a torch tensor on device {x.device}; attn_fast computes on the CPU only (use .cpu())")
        if str(x.layout) != "torch.strided":  # sparse layouts have no strides to read
            raise TypeError(f"{name} is a torch tensor with layout {x.layout}; only dense (strided) tensors are supported")
        return
    if hasattr(x, "__cuda_array_interface__"):
        raise TypeError(f"{name} ({type(x).__name__}) lives in GPU memory; attn_fast computes on the CPU only")
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
    gradient), and objects exposing ``__array_interface__``, the buffer protocol
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
        try:
            return t.numpy()  # shares memory, keeps strides
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"{name}: cannot read a torch tensor of dtype {t.dtype} as an array ({e})") from None
    if (
        hasattr(x, "__dlpack__")
        and not hasattr(x, "__array_interface__")
        and not hasattr(x, "__array_struct__")
        and not _has_buffer(x)
    ):
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError) as e:
            raise TypeError(f"{name}: cannot read {type(x).__name__} through DLPack ({e})") from None
    try:
        return np.asarray(x)
    except Exception as e:  # noqa: BLE001 - report what the object was
        raise TypeError(f"{name}: cannot read {type(x).__name__} as an array ({e})") from None


def _has_buffer(x):
    try:
        memoryview(x)
    except TypeError:
        return False
    return True


def as_float_array(x, name):
    """View `x` as a NumPy float32/float64 array without copying when possible.

    Accepts what ``as_array`` accepts. Copies only big-endian or misaligned
    data. Raises TypeError for other dtypes and non-CPU memory.
    """
    arr = as_array(x, name)
    if arr.dtype.kind != "f" or arr.dtype.itemsize not in (4, 8):
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
            f"{name} is a torch tensor that requires grad; attn_fast writes results without autograd, "
            "pass a tensor that does not require grad"
        )
    o = as_array(out, name)
    if not isinstance(out, np.ndarray) and o.base is None:
        # np.asarray made a fresh copy (a list, say): results written there would be lost.
        raise TypeError(f"{name} must be a numpy.ndarray (or expose its memory), got {type(out).__name__}")
    if not o.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return o


def check_same_dtype(**arrays):
    dts = {name: a.dtype for name, a in arrays.items() if a is not None}
    if len(set(dts.values())) > 1:
        desc = ", ".join(f"{n} {d}" for n, d in dts.items())
        raise TypeError(f"mixed dtypes are not supported ({desc}); cast them to one float dtype")


def shape_str(a):
    return str(tuple(a.shape))


# ---------------------------------------------------------------- scalars and options


class ArgumentTypeError(TypeError, ValueError):
    """A scalar argument of the wrong type (a float where a count goes, a string
    where a scale goes). A TypeError, and a ValueError as well for callers that
    caught what ``int(x)`` / ``float(x)`` used to raise."""


def check_int(x, name, minimum=None, maximum=None):
    """`x` as a Python int: TypeError unless it is an integer (bool, numpy.bool_,
    floats and strings are refused, so 2.5 is never silently truncated to 2),
    ValueError outside [minimum, maximum]."""
    if isinstance(x, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be an int, got bool {x!r}")
    try:
        x = operator.index(x)  # ints, NumPy integers, 0-d integer arrays; not floats
    except TypeError:
        raise ArgumentTypeError(f"{name} must be an int, got {type(x).__name__} {x!r}") from None
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    if maximum is not None and x > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {x}")
    return x


def check_real(x, name, *, minimum=None, positive=False):
    """`x` as a finite Python float: TypeError for what is not a real number
    (bool and strings included), ValueError for NaN, inf, x < minimum, or
    x <= 0 when ``positive``."""
    if isinstance(x, (bool, np.bool_, str, bytes)) or np.iscomplexobj(x):
        raise ArgumentTypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    try:
        x = float(x)  # floats, ints, NumPy scalars, 0-d arrays
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}") from None
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
    if dtype is not None and abs(scale) > float(np.finfo(dtype).max):
        raise ValueError(f"scale = {scale!r} overflows {np.dtype(dtype)} (the inputs' dtype; largest {np.finfo(dtype).max})")
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
        raise TypeError(f"{name} has dtype {o.dtype}, expected {np.dtype(dtype)}")
    if not o.flags.aligned or not o.dtype.isnative:
        raise ValueError(f"{name} must be aligned and in native byte order")
    if self_overlapping(o):
        raise ValueError(f"{name} has overlapping memory (strides {o.strides} for shape {shape_str(o)})")
    return o


def alias_safe(o, *inputs):
    """(o, target): a temporary to write into when `o` shares memory with an
    input (target is then the caller's array, to copy the result to), else (o, None)."""
    if any(isinstance(x, np.ndarray) and np.may_share_memory(o, x) for x in inputs):
        return np.empty(o.shape, dtype=o.dtype), o
    return o, None
