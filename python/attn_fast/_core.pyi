from typing import Optional, Tuple

import numpy as np

def forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: Optional[np.ndarray] = ...,
    *,
    scale: float,
    causal: bool = ...,
    top_left: bool = ...,
    window_left: int = ...,
    window_right: int = ...,
    q_lens: Optional[np.ndarray] = ...,
    kv_lens: Optional[np.ndarray] = ...,
    cu_q: Optional[np.ndarray] = ...,
    cu_k: Optional[np.ndarray] = ...,
    layout: Optional[np.ndarray] = ...,
    layout_bq: int = ...,
    layout_bk: int = ...,
    mask: Optional[np.ndarray] = ...,
    bias: Optional[np.ndarray] = ...,
    alibi: Optional[np.ndarray] = ...,
    softcap: float = ...,
    sinks: Optional[np.ndarray] = ...,
    block_q: int = ...,
    block_k: int = ...,
    reference: bool = ...,
) -> Tuple[int, int]: ...
def active_isa() -> str: ...
def set_isa(name: str) -> None: ...
def available_isas() -> list[str]: ...
def compiled_isas() -> list[str]: ...
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
def openmp_enabled() -> bool: ...
def openmp_runtime() -> str: ...
def fma_peak_gflops(threads: int, seconds: float = ...) -> float: ...
def linear_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    kv: Optional[np.ndarray] = ...,
    k_sum: Optional[np.ndarray] = ...,
    *,
    causal: bool = ...,
    eps: float = ...,
) -> None: ...
def decode(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: Optional[np.ndarray] = ...,
    *,
    scale: float,
    causal: bool = ...,
    top_left: bool = ...,
    window_left: int = ...,
    window_right: int = ...,
    q_lens: Optional[np.ndarray] = ...,
    kv_lens: Optional[np.ndarray] = ...,
    kv_start: Optional[np.ndarray] = ...,
    split: int = ...,
) -> None: ...
def stream_read_gbps(threads: int, nbytes: int, reps: int = ...) -> float: ...
def forked_child_serial() -> bool: ...
def threads_for_call() -> int: ...
def read_bandwidth_gbs(threads: int, bytes: int = ..., seconds: float = ...) -> float: ...
def backward(
    dout: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    dsinks: Optional[np.ndarray] = ...,
    *,
    scale: float,
    causal: bool = ...,
    top_left: bool = ...,
    window_left: int = ...,
    window_right: int = ...,
    q_lens: Optional[np.ndarray] = ...,
    kv_lens: Optional[np.ndarray] = ...,
    cu_q: Optional[np.ndarray] = ...,
    cu_k: Optional[np.ndarray] = ...,
    layout: Optional[np.ndarray] = ...,
    layout_bq: int = ...,
    layout_bk: int = ...,
    mask: Optional[np.ndarray] = ...,
    bias: Optional[np.ndarray] = ...,
    alibi: Optional[np.ndarray] = ...,
    softcap: float = ...,
    sinks: Optional[np.ndarray] = ...,
    block_q: int = ...,
    block_k: int = ...,
) -> None: ...

# Tile classes (C++ TileClass), as attn_fast.masks.BLOCK_*.
BLOCK_MASKED: int
BLOCK_PARTIAL: int
BLOCK_VISIBLE: int
