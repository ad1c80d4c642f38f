import numpy as np

def forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray | None = ...,
    scale: float = ...,  # required: the default (NaN) is refused
    causal: bool = ...,
    top_left: bool = ...,
    window_left: int = ...,
    window_right: int = ...,
    q_lens: np.ndarray | None = ...,
    kv_lens: np.ndarray | None = ...,
    cu_q: np.ndarray | None = ...,
    cu_k: np.ndarray | None = ...,
    layout: np.ndarray | None = ...,
    layout_bq: int = ...,
    layout_bk: int = ...,
    mask: np.ndarray | None = ...,
    bias: np.ndarray | None = ...,
    alibi: np.ndarray | None = ...,
    softcap: float = ...,
    sinks: np.ndarray | None = ...,
    block_q: int = ...,
    block_k: int = ...,
    reference: bool = ...,
) -> tuple[int, int, int, int]: ...  # (tiles_computed, tiles_skipped, block_q, block_k)
def active_isa() -> str: ...
def set_isa(name: str, /) -> None: ...
def set_decode_prefetch(name: str) -> None: ...
def decode_prefetch() -> str: ...
def cpu_signature() -> tuple[str, int, int]: ...
def available_isas() -> list[str]: ...
def compiled_isas() -> list[str]: ...
def amx_status() -> str: ...
def amx_self_check(isa: str) -> tuple[bool, str]: ...
def tdpbf16ps_tile(isa: str, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None: ...
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
    kv: np.ndarray | None = ...,
    k_sum: np.ndarray | None = ...,
    *,
    causal: bool = ...,
    eps: float = ...,
) -> None: ...
def decode(
    q: np.ndarray,
    k: np.ndarray | list[np.ndarray],
    v: np.ndarray | list[np.ndarray],
    o: np.ndarray,
    lse: np.ndarray | None = ...,
    scale: float = ...,  # required: the default (NaN) is refused
    causal: bool = ...,
    top_left: bool = ...,
    window_left: int = ...,
    window_right: int = ...,
    q_lens: np.ndarray | None = ...,
    kv_lens: np.ndarray | None = ...,
    kv_start: np.ndarray | None = ...,
    split: int = ...,
    block_table: np.ndarray | None = ...,
    encoding: str = ...,  # a coded encoding's name ("int8", ...); "" = rows of q's dtype
    aux: tuple | list | None = ...,  # its side arrays (or lists of pool chunks), in order
    group: int = ...,
) -> None: ...

class DecodeRing:
    def __init__(self, k: np.ndarray, v: np.ndarray) -> None: ...
    def __call__(
        self,
        q: np.ndarray,
        scale: float,
        causal: bool,
        window_left: int,
        q_lens: np.ndarray | None,
        kv_lens: np.ndarray | None,
        kv_start: np.ndarray | None,
    ) -> np.ndarray | None: ...  # None: causal and some q_lens[b] > kv_lens[b]

class BoundDecode:
    def __init__(
        self,
        causal: bool,
        top_left: bool,
        window_left: int,
        window_right: int,
        q_lens: np.ndarray | None,
        kv_lens: np.ndarray | None,
    ) -> None: ...
    def __call__(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray, scale: float
    ) -> None: ...

def kv_quant_append(
    k: np.ndarray,
    v: np.ndarray,
    k8: np.ndarray,
    v8: np.ndarray,
    k_scale: np.ndarray,
    k_off: np.ndarray,
    v_scale: np.ndarray,
    v_off: np.ndarray,
    stage: np.ndarray,
    stage_grp: np.ndarray,
    pos0: np.ndarray,
    count: np.ndarray,
    first_before: np.ndarray,
    first_after: np.ndarray,
) -> None: ...
def stream_read_gbps(threads: int, nbytes: int, reps: int = ...) -> float: ...
def forked_child_serial() -> bool: ...
def threads_for_call() -> int: ...
def plan_key(
    q: object,
    k: object,
    v: object,
    out: object,
    is_causal: bool,
    enable_gqa: bool,
    scale: float | None,
    bits16: bool = ...,
) -> bytes | None: ...
def set_torch(
    tensor: type,
    f32: object,
    f64: object,
    f16: object,
    bf16: object,
    strided: object,
    from_numpy: object,
    functorch_active: object,
    dispatch_stack_len: object,
    function_mode_on: object,
    dlpack_api: object = ...,
) -> None: ...
def lk_free_key(key: bytes) -> bytes | None: ...
def tensor_views(q: object, k: object, v: object) -> tuple[np.ndarray, ...] | None: ...
def cache_step(
    ring: DecodeRing,
    q: object,
    k: object,
    v: object,
    scale: float | None,
    window_left: int,
    n: np.ndarray,
    start: np.ndarray,
    pos: np.ndarray,
    last_new: np.ndarray,
    heads_last: bool,
) -> object: ...
def run_plan(
    plans: dict,
    q: object,
    k: object,
    v: object,
    is_causal: bool,
    enable_gqa: bool,
    scale: float | None,
) -> object | None: ...
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
    dsinks: np.ndarray | None = ...,
    scale: float = ...,  # required: the default (NaN) is refused
    causal: bool = ...,
    top_left: bool = ...,
    window_left: int = ...,
    window_right: int = ...,
    q_lens: np.ndarray | None = ...,
    kv_lens: np.ndarray | None = ...,
    cu_q: np.ndarray | None = ...,
    cu_k: np.ndarray | None = ...,
    layout: np.ndarray | None = ...,
    layout_bq: int = ...,
    layout_bk: int = ...,
    mask: np.ndarray | None = ...,
    bias: np.ndarray | None = ...,
    alibi: np.ndarray | None = ...,
    softcap: float = ...,
    sinks: np.ndarray | None = ...,
    block_q: int = ...,
    block_k: int = ...,
) -> None: ...

# Tile classes (C++ TileClass), as attn_fast.masks.BLOCK_*.
BLOCK_MASKED: int
BLOCK_PARTIAL: int
BLOCK_VISIBLE: int
