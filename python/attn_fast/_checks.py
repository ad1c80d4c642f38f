"""Argument checking shared by the public functions: dtypes, shapes, layout.

Every error names the argument and the shapes involved.
"""

from __future__ import annotations

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def as_float_array(x, name):
    """View `x` as a NumPy float32/float64 array without copying when possible.

    Accepts NumPy arrays and anything NumPy can view (buffer protocol,
    __array_interface__, DLPack on the CPU). Copies only big-endian or
    misaligned data. Raises TypeError for other dtypes.
    """
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    dev = getattr(x, "device", None)
    if dev is not None and not isinstance(x, np.ndarray):
        dev_type = getattr(dev, "type", str(dev))
        if str(dev_type) not in ("cpu",) and not str(dev_type).startswith("cpu") and "Cpu" not in str(dev):
            raise TypeError(f"{name} lives on device {dev!s}; attn_fast computes on the CPU only")
    if not isinstance(x, np.ndarray):
        try:
            arr = np.asarray(x)
        except Exception as e:  # noqa: BLE001 - report what the object was
            raise TypeError(f"{name}: cannot read {type(x).__name__} as an array ({e})") from None
    else:
        arr = x
    if arr.dtype.kind != "f" or arr.dtype.itemsize not in (4, 8):
        raise TypeError(f"{name} must be float32 or float64, got dtype {arr.dtype}")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if not arr.flags.aligned or any(s % arr.itemsize for s in arr.strides):
        arr = arr.copy()  # a fresh allocation is aligned
    return arr


def check_same_dtype(**arrays):
    dts = {name: a.dtype for name, a in arrays.items() if a is not None}
    if len(set(dts.values())) > 1:
        desc = ", ".join(f"{n} {d}" for n, d in dts.items())
        raise TypeError(f"mixed dtypes are not supported ({desc}); cast them to one float dtype")


def shape_str(a):
    return str(tuple(a.shape))
