"""Type stub of the Cython module _cyloops (python/attn_fast/_cyloops.pyx).

OpenMP loops over NumPy buffers, released from the GIL. Float arguments are
float32 or float64 (one fused type per call); integer tables are int64.
tests/test_stubs.py checks these names and parameters against the compiled
module.
"""

import numpy as np

def _check_pos(pos: np.ndarray, n: int, B: int, L: int) -> None: ...
def rope(
    x: np.ndarray,
    y: np.ndarray,
    x2: np.ndarray | None,
    y2: np.ndarray | None,
    cos: np.ndarray,
    sin: np.ndarray,
    pos: np.ndarray,
    interleaved: bool,
    num_threads: int = ...,
) -> None: ...
def cache_write(
    dst: np.ndarray,
    src: np.ndarray,
    first_slot: np.ndarray,
    count: np.ndarray,
    cos: np.ndarray | None = ...,
    sin: np.ndarray | None = ...,
    pos0: np.ndarray | None = ...,
    interleaved: bool = ...,
    num_threads: int = ...,
) -> None: ...
def block_summary(mask: np.ndarray, block: int, num_threads: int = ...) -> np.ndarray: ...
def band_layout(
    n: int, lo: int, hi: int, stride: int, absolute: bool, num_threads: int = ...
) -> np.ndarray: ...
