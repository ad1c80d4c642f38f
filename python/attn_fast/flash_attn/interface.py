"""FlashAttention 2's public functions on attn_fast's CPU kernels.

The signatures, argument order, defaults, layouts and return conventions are
those of ``flash_attn/flash_attn_interface.py`` (Dao-AILab/flash-attention,
v2): (B, L, H, d) tensors, (total, H, d) packed varlen tensors with int32
``cu_seqlens``, lse (B, H, Lq) or (H, total_q) in float32, causal aligned
bottom-right. Shape legend: B batch, L / Lq / Lk lengths, H query heads, H_kv
key/value heads (H % H_kv == 0: MQA / GQA, K and V never repeated), d head dim
of q and k, dv of v.

Every function reads its inputs in place through their strides: the (B, L, H, d)
layout is handed to the kernels as its (B, H, L, d) transpose (a view), the
packed forms as views of their slices, a paged cache as a (num_blocks, H_kv,
page, d) view of its pool. The outputs are new contiguous tensors in
flash-attn's layout. Nothing of the K/V caches is copied: the new keys and
values of ``flash_attn_with_kvcache`` are written into them in place.

Dtypes: CPU float16, bfloat16 and float32 tensors (float64 too), q, k, v of one
dtype. 16-bit inputs compute in float32 and round the output once; lse is
float32 (float64 for float64 inputs).

The functions are torch.library ops (``attn_fast::flash_attn_fwd`` /
``_bwd``, ``attn_fast::flash_attn_varlen_fwd`` / ``_bwd``,
``attn_fast::flash_attn_with_kvcache``, which mutates k_cache and v_cache) with
fake kernels and autograd: they trace under ``torch.compile(fullgraph=True)``.
An eager call that wants no gradient runs the op's body directly, without the
op's dispatch. With a paged cache, ``softcap`` and ``alibi_slopes`` run the
tiled kernel on each run of consecutive blocks (a view) and merge the runs by
their lse.

Differences from flash-attn, on purpose (each raises rather than computing
something else): ``dropout_p`` must be 0 (attn_fast has no dropout); a paged
K/V cache (``block_table``) takes no gradient; rows that see
no key give lse = -inf (flash-attn's CUDA kernel writes +inf), out = 0 as in
flash-attn. ``return_attn_probs=True`` returns ``S_dmask`` as an empty tensor, as
flash-attn 2 does when dropout_p = 0. ``deterministic`` and ``num_splits`` are
accepted: attn_fast's backward is deterministic for any thread count, and the
split-KV decode kernel sizes its own splits.
"""

from __future__ import annotations

from ._dense import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from ._kvcache import flash_attn_with_kvcache
from ._varlen import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
