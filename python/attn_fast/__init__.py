"""attn_fast: exact softmax attention for NumPy, with a fused C++ core.

    import attn_fast as af
    O = af.attention(X, Wq, Wk, Wv, causal=True)          # the textbook's API
    O = af.scaled_dot_product_attention(q, k, v, is_causal=True)  # torch's names

The kernel is chosen once at import for the best instruction set the CPU
supports (AVX-512, AVX2+FMA or portable scalar); ``ATTN_FAST_ISA`` forces one.
"""

from __future__ import annotations

import os as _os

from . import _core as _core  # the extension (attn_fast._core), re-exported
from ._config import (
    get_decode_prefetch,
    get_isa,
    get_num_threads,
    set_decode_prefetch,
    set_isa,
    set_num_threads,
    show_config,
)
from .functional import (
    KernelStats,
    attention,
    attention_weights,
    scaled_dot_product_attention,
    varlen_attention,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "attention",
    "scaled_dot_product_attention",
    "set_num_threads",
    "get_num_threads",
    "set_isa",
    "get_isa",
    "set_decode_prefetch",
    "get_decode_prefetch",
    "show_config",
    "reference",
    "masks",
    "attention_weights",
    "varlen_attention",
    "KernelStats",
]

_forced = _os.environ.get("ATTN_FAST_ISA", "").strip().lower()
if _forced:
    set_isa(_forced)  # raises a clear error if the CPU lacks it
_prefetch = _os.environ.get("ATTN_FAST_DECODE_PREFETCH", "").strip().lower()
if _prefetch:
    set_decode_prefetch(_prefetch)  # ValueError for an unknown name

# masks: Causal, SlidingWindow, Padding, BlockSparse, Dense; reference: the oracle;
# variants: Linformer, linear attention.
from . import masks, reference, variants  # noqa: E402

__all__ += ["variants"]

from .kv_cache import KVCache, LayerCaches, merge_attention_states  # noqa: E402

__all__ += ["KVCache", "LayerCaches", "merge_attention_states"]

from .paged_cache import PagedKVCache, PagedLayerCaches  # noqa: E402

__all__ += ["PagedKVCache", "PagedLayerCaches"]

# Layers: positions, multi-head attention, Transformer block, a tiny LM.
from . import positional  # noqa: E402
from .multihead import MultiHeadAttention  # noqa: E402
from .transformer import LayerNorm, RMSNorm, TinyTransformerLM, TransformerBlock  # noqa: E402

__all__ += [
    "positional",
    "MultiHeadAttention",
    "TransformerBlock",
    "TinyTransformerLM",
    "LayerNorm",
    "RMSNorm",
]

# The chapter's demo: every intermediate (Q, K, V, S, P, O) of one attention call.
from .demo import explain  # noqa: E402

__all__ += ["explain"]

# Gradients (the fused FlashAttention-2 backward); the torch op is attn_fast.torch.
from .backward import scaled_dot_product_attention_backward, varlen_attention_backward  # noqa: E402

__all__ += ["scaled_dot_product_attention_backward", "varlen_attention_backward"]
