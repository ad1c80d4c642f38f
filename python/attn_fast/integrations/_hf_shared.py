"""What the transformers backend and its caches share (private; no transformers import).

``transformers.py`` (the attention function and the mask builder) and
``transformers_cache.py`` (AttnFastCache) meet at three points: the mask
builder attaches a ``MaskSpec`` to the masks it verified, ``update`` tags the
key/value tensors it returns with their cache layer, and a cache checks that
the model's attention function is attn_fast's. Those names live here so
that neither module imports the other inside a function.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

SPEC_ATTR = "_attn_fast_spec"  # set on a verified dense mask: its MaskSpec
LAYER_ATTR = "_attn_fast_layer"  # set on the tensors AttnFastLayer.update returns
BACKEND_ATTR = "_attn_fast_backend"  # True on attn_fast's attention function


class MaskSpec:
    """What a verified dense mask is: flags for the kernel instead of B·Lq·Lk bools.

    causal, window (left, right) as in ``scaled_dot_product_attention``
    (bottom-right aligned, -1 = unbounded); key_mask: (B, 1, 1, Lk) bool
    NumPy array of valid keys, or None when every key is valid; shape: the
    dense mask's (B, 1, Lq, Lk). Every layer of a forward pass receives the
    same mask, so what is derived from it is computed once (``memo``).
    """

    __slots__ = ("causal", "window", "key_mask", "shape", "memo")

    def __init__(self, causal, window, key_mask, shape):
        self.causal, self.window, self.key_mask, self.shape = causal, window, key_mask, shape
        self.memo = {}

    def key_runs(self):
        """(kv_start, kv_lens) int64 (B,) when each row's valid keys are one run
        [kv_start, kv_start + kv_lens) (left or right padding), else False."""
        runs = self.memo.get("runs")
        if runs is None:
            m = self.key_mask.reshape(self.key_mask.shape[0], -1)
            Lk = m.shape[1]
            first = m.argmax(axis=1)
            last = Lk - m[:, ::-1].argmax(axis=1)
            lens = np.where(m.any(axis=1), last - first, 0)
            runs = False
            if (m.sum(axis=1) == lens).all():
                runs = (first.astype(np.int64), lens.astype(np.int64))
            self.memo["runs"] = runs
        return runs


def mask_spec(mask):
    """The MaskSpec attached to `mask` by attn_fast's mask builder, or None."""
    return None if mask is None else getattr(mask, SPEC_ATTR, None)


def cache_layer(key):
    """The AttnFastLayer a key tensor came from (returned by its ``update``), or None."""
    return getattr(key, LAYER_ATTR, None)


def is_backend(fn):
    """Whether `fn` (what transformers' AttentionInterface holds) is attn_fast's attention
    function."""
    return getattr(fn, BACKEND_ATTR, False) is True


class CallArgs(NamedTuple):
    """One attention call's arguments besides query/key/value, as attention_forward received
    them (``is_causal`` resolved against the module's flag): what the generic path
    (``transformers._attention``) and the cache path (``transformers_cache.attend_cached``)
    both take."""

    mask: Any  # None, a (B, 1 or H, Lq, Lk) bool / additive float tensor (maybe with a MaskSpec)
    scaling: Any  # None (1/sqrt(d)) or a float
    causal: bool
    softcap: Any
    s_aux: Any  # None or (H,) sink logits
    position_bias: Any  # None or a tensor broadcastable to (B, H, Lq, Lk)
