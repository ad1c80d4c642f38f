"""Switch between the Cython loops (``_cyloops``) and their NumPy references.

``positional``, ``kv_cache`` and ``masks`` keep each loop's NumPy formula as
the readable reference and call the compiled version when ``USE_CYTHON`` is
true (the default). Set the environment variable ``ATTN_FAST_NUMPY_LOOPS=1``
before import, or assign ``attn_fast._loops.USE_CYTHON = False``, to run the
NumPy formulas instead (tests and ``bench/benchmarks/bench_cython.py`` compare both).
"""

from __future__ import annotations

import os

from . import _core, _cyloops  # noqa: F401  (_cyloops: fails loudly if the build lacks it)

USE_CYTHON = os.environ.get("ATTN_FAST_NUMPY_LOOPS", "0").strip() in ("", "0")


def threads():
    """OpenMP threads for a loop: the same rule as the C++ kernels (``attn_fast.set_num_threads``,
    1 in a forked child of a threaded process, see ``_core.forked_child_serial``)."""
    return _core.threads_for_call()


def as_blhd(a, ax):
    """A (B, L, H, d) strided view of a, whose position axis is ax, or None.

    (L, d) with ax 0, (L, H, d) with ax 0, (B, L, d) with ax 1, (B, L, H, d)
    with ax 1, (B, H, L, d) with ax 2. None for other layouts and for strides
    that are not whole elements or data that is not aligned (the callers then
    use the NumPy formula).
    """
    if not a.flags.aligned or any(s % a.itemsize for s in a.strides):
        return None  # misaligned views (np.frombuffer(..., offset=1)) take the NumPy path
    if a.ndim == 2 and ax == 0:
        return a[None, :, None, :]
    if a.ndim == 3:
        return a[None] if ax == 0 else a[:, :, None, :]
    if a.ndim == 4:
        if ax == 1:
            return a
        if ax == 2:
            return a.transpose(0, 2, 1, 3)
    return None
