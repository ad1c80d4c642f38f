"""A transformers ``Cache`` backed by ``attn_fast.KVCache`` (or ``PagedKVCache``), one per layer.

    import attn_fast.integrations.transformers as af_hf
    af_hf.register()
    model.set_attn_implementation("attn_fast")
    cache = af_hf.AttnFastCache(model.config, dtype="bfloat16")   # or float16 / float32 / None
    out = model.generate(input_ids, attention_mask=am, cache=cache, max_new_tokens=64)
    # (transformers < 5.40 also takes past_key_values=cache, with a deprecation warning)

Shape legend: B batch, H_q query heads, H_kv key/value heads, Lq new tokens
of this forward pass, P tokens the model has seen before it (padding
included), d head dim, dv value head dim.

How it works
------------
transformers calls ``cache.update(k, v, layer_idx)`` with the new chunk's
keys and values (B, H_kv, Lq, d) *before* the layer's attention function, and
the attention function receives whatever ``update`` returned. A KV cache that
stores only the valid tokens of each sequence (no left padding: ragged
lengths, as ``KVCache`` is built for) cannot be handed back as dense
(B, H_kv, P + Lq, d) tensors without a gather copy. So ``update`` only
records the chunk and returns it tagged with its layer; the attn_fast
attention function (``attention_forward``) sees the tag and does both halves
at once, because only it sees the layer's mask:

1. From the mask (the per-key padding attached by attn_fast's mask builder)
   it takes, per sequence, how many of the Lq new tokens are valid: they must
   be a suffix (left padding; every token generate adds is valid), and the
   valid past tokens must be the ones the cache holds (else ValueError).
2. ``KVCache.append`` stores the valid new keys and values in the storage
   dtype (one copy; a left-padded chunk is first right-aligned, one more copy
   of the prefill chunk), and ``KVCache.attend`` computes attention of the
   queries against each sequence's own keys: the split-KV decode kernel for
   Lq <= ``attn_fast._dispatch.DECODE_MAX_LQ`` (every generated token), the
   tiled kernel for a prefill. K/V are never materialised as dense tensors and
   padding keys are never read.

Padded query rows (the left padding of a prefill) get zeros.

Storage dtype
-------------
``dtype`` is passed straight to ``KVCache`` (float32, float64, "float16",
"bfloat16", and whatever else KVCache accepts); None (default) stores the
model's own dtype. Chunks and queries are cast to the storage dtype before
they reach the cache (so a float32 model with a bfloat16 cache also rounds
its queries to bfloat16; the kernels accumulate and take the softmax in
float32), and the attention output is cast back to the model's dtype. A
storage dtype that is not a float type (int8, which KVCache quantises on
append) gets float32 chunks and queries.

Paged storage
-------------
``AttnFastPagedCache(model.config, dtype=..., block_size=256)`` is the same
cache with one ``attn_fast.PagedKVCache`` pool per layer, one sequence per
batch row: the same mask handling, storage types (int8 included) and
errors. Every chunk, prefill included, runs the split-KV decode kernel
through the block tables; sliding-window layers use ``PagedKVCache(window=w)``,
which returns the blocks before the window to the pool. Beam search
(``reorder_cache``) and ``batch_repeat_interleave`` fork the kept sequences
(copy-on-write: no K/V copied, any storage type) and free the others;
``crop`` truncates each sequence. In float32 it gives the same greedy and
beam tokens as the contiguous cache and as sdpa (``tests/test_paged_transformers.py``).

What it supports, and what raises
---------------------------------
Full-attention and sliding-window layers (``KVCache(window=w)``, the ring
keeps O(w) keys), GQA, batches with left padding, greedy, sampling and beam
search (``reorder_cache``: the kept sequences are copied into a new KVCache),
``crop`` (assisted generation), ``reset``. CPU tensors only.

Misuse raises instead of computing something else: a model whose attention
implementation is not attn_fast (transformers' sdpa/eager would see only the
new chunk): ValueError at the first ``update``; a chunk that no attn_fast
attention call consumed: RuntimeError at the next ``update``; softcap, sinks,
``position_bias``, non-causal layers, a custom 4-D mask, right or interior
padding: NotImplementedError / ValueError naming the argument. After an
exception inside a forward pass the cache's state is undefined: ``reset()`` it.

The tagging relies on the model passing the tensors ``cache.update`` returned
straight to the attention function, as every transformers decoder written
against the attention interface does (Llama, Mistral, Qwen2, ... tested). A
model that transforms them in between would hand the attention function an
untagged chunk: that forward pass would attend to the chunk alone, and the
next ``update`` of the layer raises RuntimeError (the chunk was never
stored), so a generation cannot silently continue.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from .. import _checks
from ..kv_cache import KVCache
from ..paged_cache import PagedKVCache
from ._hf_shared import LAYER_ATTR, is_backend, mask_spec

__all__ = ["AttnFastCache", "AttnFastLayer", "AttnFastPagedCache", "AttnFastPagedLayer"]

# KVCache storage dtype (``KVCache.dtype``) -> the torch dtype of the chunks and queries it takes.
_TORCH_OF = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    _checks.F16: torch.float16,
    _checks.BF16: torch.bfloat16,
}
_EXACT_COPY = tuple(_TORCH_OF)  # storage dtypes whose keys()/values() round-trip exactly
# Chunk dtypes the KVCache fast paths take as NumPy arrays (cheaper than tensors there);
# bfloat16 has no NumPy dtype and goes as the tensor.
_AS_NUMPY = (torch.float32, torch.float64, torch.float16)


def _storage_arg(dtype):
    """A dtype for KVCache(dtype=...): torch dtypes by name ("float32", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype


class AttnFastLayer(CacheLayerMixin):
    """One decoder layer's cache: an ``attn_fast.KVCache`` created at the first ``update``.

    dtype : storage dtype for KVCache, or None for the dtype of the first keys.

    window : int or None, sliding window (a query sees itself and the
        window - 1 keys before it), as transformers' sliding-window layers.

    capacity : initial slots per sequence (the KVCache doubles when full).
    owner : the AttnFastCache (for the attention-implementation check).

    ``get_seq_length()`` counts tokens in transformers' padded coordinates
    (what the position ids and masks are built from); the KVCache holds only
    the valid ones (``valid``: (B,) per-sequence counts).
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = True

    def __init__(self, dtype=None, window=None, capacity=256, owner=None):
        super().__init__()
        self.storage_dtype = dtype
        self.window = window
        self.is_sliding = window is not None
        self.capacity = int(capacity)
        self.owner = owner
        self.layer_idx = None
        self.kv = None  # attn_fast.KVCache
        self.seen = 0  # tokens seen, padding included
        self.valid = None  # (B,) int64 valid tokens stored per sequence
        self.pending = None  # (key, value) returned by update, not yet attended
        self.io_dtype = None  # the torch dtype of the chunks and queries the storage takes

    def __repr__(self):
        return f"AttnFastLayer({self.kv!r}, seen={self.seen})"

    # ---- transformers' layer interface ---------------------------------------
    def lazy_initialization(self, key_states, value_states):
        B, H, _, d = key_states.shape
        dv = value_states.shape[-1]
        dtype = key_states.dtype if self.storage_dtype is None else self.storage_dtype
        kw = dict(capacity=self.capacity) if self.window is None else dict(window=self.window)
        self.kv = KVCache(B, H, d, v_head_dim=dv, dtype=_storage_arg(dtype), **kw)
        self.io_dtype = _TORCH_OF.get(self.kv.dtype, torch.float32)
        self.device = torch.device("cpu")
        self.valid = np.zeros(B, dtype=np.int64)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Record the chunk (B, H_kv, Lq, d) / (B, H_kv, Lq, dv); returns it tagged.

        The chunk is stored by the attn_fast attention function of the same
        layer, which sees the mask (see the module docstring).
        """
        # Layer 0 is updated first in every forward pass: the check runs once per pass.
        if self.owner is not None and (self.layer_idx == 0 or not self.owner._impl_checked):
            self.owner._check_implementation()
        if self.pending is not None:
            raise RuntimeError(
                f"AttnFastCache layer {self.layer_idx}: the chunk of the previous update() was "
                "never attended by the attn_fast attention function (did something other than "
                "attn_fast.integrations.transformers.attention_forward consume it?); its keys "
                "are not stored"
            )
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor) or not t.is_cpu or t.ndim != 4:
                raise TypeError(
                    f"AttnFastCache.update: {name} must be a 4-D CPU tensor (B, H_kv, L, d), got "
                    f"{type(t).__name__} {getattr(t, 'shape', '')} on {getattr(t, 'device', '?')}"
                )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H = self.kv.batch, self.kv.num_kv_heads
        if key_states.shape[:2] != (B, H) or value_states.shape[:3] != key_states.shape[:3]:
            raise ValueError(
                f"AttnFastCache layer {self.layer_idx}: key_states {tuple(key_states.shape)} and "
                f"value_states {tuple(value_states.shape)} do not fit the cache of batch {B}, "
                f"{H} kv heads"
            )
        k, v = (
            key_states.view_as(key_states),
            value_states.view_as(value_states),
        )  # taggable aliases
        setattr(k, LAYER_ATTR, self)
        setattr(v, LAYER_ATTR, self)
        self.pending = (k, v)
        self.seen += key_states.shape[2]
        return k, v

    def step(self, query, key, value, scaling):
        """``attend_cached``'s output for a one-token chunk without mask, bias, sinks or
        softcap, causal: the chunk stored and attended in one C call (``KVCache._step``), or
        None where ``attend_cached`` must run (its checks raise for what is wrong)."""
        p = self.pending
        if p is None or p[0] is not key or p[1] is not value:
            return None
        try:
            o = self.kv._step(query, key, value, scaling, heads_last=True)
        except BaseException:  # Ctrl-C in the kernel: stored, as in attend_cached
            self.pending = None
            raise
        if o is not None:
            self.pending = None
            self.valid += 1
        return o

    def get_mask_sizes(self, query_length):
        # Called before update(): the mask covers the past and the new chunk, padding included.
        return self.seen + query_length, 0

    def get_seq_length(self):
        return self.seen

    def get_max_length(self):
        return -1

    def offload(self):  # CPU storage: nothing to move
        pass

    def prefetch(self):
        pass

    def reset(self):
        if self.kv is not None:
            self.kv.reset()
            self.valid[:] = 0
        self.seen = 0
        self.pending = None

    def crop(self, tokens_to_remove):
        """Drop the last ``-tokens_to_remove`` tokens (negative, as DynamicLayer.crop takes)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative number of tokens to remove, got {tokens_to_remove}"
            )
        r = min(-int(tokens_to_remove), self.seen)
        if r == 0 or self.kv is None:
            return
        # Padding is on the left only, so the last r positions are each sequence's last valid ones.
        keep = np.maximum(self.valid - r, 0)
        self.kv.truncate(self.kv.positions - (self.valid - keep))
        self.valid = keep
        self.seen -= r
        self.pending = None

    def reorder_cache(self, beam_idx):
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats):
        if self.kv is not None:
            self._select(np.repeat(np.arange(self.kv.batch), int(repeats)))

    def batch_select_indices(self, indices):
        if self.kv is not None:
            idx = torch.as_tensor(indices).cpu().numpy()
            if idx.dtype == np.bool_:
                idx = np.flatnonzero(idx)
            self._select(idx.astype(np.int64).reshape(-1))

    # ---- helpers ------------------------------------------------------------------
    def _select(self, idx):
        """Replace the KVCache by one holding sequences ``idx`` of it (beam search, repeats)."""
        old = self.kv
        if idx.size and (idx.min() < 0 or idx.max() >= old.batch):
            raise IndexError(f"batch indices {idx.tolist()} out of range for batch {old.batch}")
        if old.dtype not in _EXACT_COPY:
            raise NotImplementedError(
                f"reordering an AttnFastCache with {_checks.dtype_name(old.dtype)} storage (beam "
                "search) is not supported: its stored keys cannot be copied exactly"
            )
        kw = dict(capacity=old.capacity) if old.window is None else dict(window=old.window)
        new = KVCache(
            max(1, idx.size),
            old.num_kv_heads,
            old.head_dim,
            v_head_dim=old.v_head_dim,
            dtype=old.dtype,
            **kw,
        )
        n = old.lengths[idx]
        L = int(n.max()) if n.size else 0
        if L:
            kb = np.zeros((idx.size, old.num_kv_heads, L, old.head_dim), dtype=old.dtype)
            vb = np.zeros((idx.size, old.num_kv_heads, L, old.v_head_dim), dtype=old.dtype)
            for i, b in enumerate(idx):
                kb[i, :, : n[i]] = np.asarray(old.keys(b)).view(old.dtype)
                vb[i, :, : n[i]] = np.asarray(old.values(b)).view(old.dtype)
            if old.dtype == _checks.BF16:
                kb, vb = _checks.bf16_bits(kb), _checks.bf16_bits(vb)
            new.append(kb, vb, lengths=n)
        self.kv = new
        self.valid = self.valid[idx].copy()
        self.pending = None

    def chunk_dtype(self):
        """The torch dtype the KVCache takes chunks and queries in (``io_dtype``)."""
        return self.io_dtype


def _layer_windows(config, name="AttnFastCache"):
    """Per decoder layer: None (full attention) or its sliding window."""
    text = config.get_text_config(decoder=True)
    windows = []
    for i, (kind, kw) in enumerate(zip(*get_layer_types_and_kwargs(text))):
        if kind == "full_attention":
            windows.append(None)
        elif kind == "sliding_attention":
            windows.append(int(kw["sliding_window"]))
        else:
            raise NotImplementedError(
                f"{name}: layer {i} is a {kind!r} layer; only full_attention and "
                "sliding_attention layers are supported"
            )
    return windows


def _keep_config(cache, config, name):
    """cache.config = the model's config (TypeError for anything else); the attention
    implementation it names is checked at the first update of each forward pass."""
    if config is None or not hasattr(config, "get_text_config"):
        raise TypeError(
            f"{name} needs the model's config (model.config), got {type(config).__name__}"
        )
    cache.config = config
    cache._impl_checked = False


class AttnFastCache(Cache):
    """A transformers Cache whose layers are ``attn_fast.KVCache`` objects.

    Parameters
    ----------
    config : the model's config (``model.config``): number of layers, which
        are sliding-window layers, and the attention implementation (checked
        to be attn_fast at each ``update``).

    dtype : KVCache storage dtype (float32, "float16", "bfloat16", ... or a
        torch/NumPy dtype); None = the model's dtype.

    capacity : initial slots per sequence and layer (default 256; grows by
        doubling).

    Notes
    -----
    Use with ``attn_implementation="attn_fast"`` (after
    ``attn_fast.integrations.transformers.register()``) and pass it to
    ``model.generate(..., cache=cache)`` or ``model(..., cache=cache,
    use_cache=True)``. One cache serves one generation: ``reset()`` it (or
    make a new one) before the next prompt. ``nbytes``: bytes of K/V storage
    allocated over all layers.
    """

    def __init__(self, config, dtype=None, capacity=256):
        _keep_config(self, config, "AttnFastCache")
        layers = []
        for i, window in enumerate(_layer_windows(config)):
            layer = AttnFastLayer(dtype=dtype, window=window, capacity=capacity, owner=self)
            layer.layer_idx = i
            layers.append(layer)
        if dtype is not None:
            KVCache(
                1, 1, 1, capacity=1, dtype=_storage_arg(dtype)
            )  # an unknown dtype raises here, not mid-generate
        super().__init__(layers=layers)

    def _check_implementation(self):
        impl = getattr(self.config, "_attn_implementation", None)
        fn = AttentionInterface().get(impl) if isinstance(impl, str) else None
        self._impl_checked = is_backend(fn)
        if not self._impl_checked:
            raise ValueError(
                "AttnFastCache works with the attn_fast attention implementation only, but the "
                f"model uses {impl!r}: call attn_fast.integrations.transformers.register() and "
                "model.set_attn_implementation('attn_fast'), or use transformers' DynamicCache"
            )

    @property
    def nbytes(self):
        return sum(layer.kv.nbytes for layer in self.layers if layer.kv is not None)


# --------------------------------------------------------------------------- paged


class _PagedBatch:
    """The B sequences of one generation in a PagedKVCache (one id per batch row), with the
    KVCache batch interface that AttnFastLayer and ``attend_cached`` use."""

    def __init__(self, cache, B):
        self.cache = cache
        self.ids = [cache.add_sequence() for _ in range(B)]

    def __repr__(self):
        return f"sequences {self.ids} of {self.cache!r}"

    @property
    def batch(self):
        return len(self.ids)

    @property
    def num_kv_heads(self):
        return self.cache.num_kv_heads

    @property
    def dtype(self):
        return self.cache.dtype

    @property
    def nbytes(self):
        return self.cache.nbytes

    @property
    def lengths(self):
        return self.cache.lengths_of(self.ids)

    @property
    def positions(self):
        return self.cache.positions_of(self.ids)

    def append(self, k, v, lengths=None):
        self.cache.append(self.ids, k, v, lengths=lengths)

    def attend(self, q, scale=None, q_lens=None):
        return self.cache.attend(self.ids, q, scale=scale, q_lens=q_lens)

    def truncate(self, n):
        n = np.broadcast_to(np.asarray(n, dtype=np.int64), (self.batch,))
        c = self.cache
        checked = [c._check_truncate(c._seq(i), i, int(m)) for i, m in zip(self.ids, n)]
        for i, m in zip(self.ids, checked):  # every sequence checked first: all or nothing
            c.truncate(i, m)

    def reset(self):
        B = self.batch
        for i in self.ids:
            self.cache.free(i)
        self.ids = [self.cache.add_sequence() for _ in range(B)]

    def select(self, idx):
        """Batch row i becomes a fork of row idx[i] (copy-on-write: no K/V copied); the old
        sequences are freed (blocks that no fork kept return to the pool)."""
        new = [self.cache.fork(self.ids[int(b)]) for b in idx]
        for i in self.ids:
            self.cache.free(i)
        self.ids = new


class AttnFastPagedLayer(AttnFastLayer):
    """One decoder layer's cache: a ``PagedKVCache`` (one sequence per batch row), created at
    the first ``update``.

    dtype : PagedKVCache storage dtype, or None for the dtype of the first keys.

    window : int or None, sliding window (blocks before it return to the pool).

    block_size, num_blocks : PagedKVCache's (rows per block; blocks per pool chunk).

    owner : the AttnFastPagedCache.

    ``kv`` is the batch's view of the pool (``kv.cache`` the PagedKVCache,
    ``kv.ids`` the sequence of each batch row). Beam search and
    ``batch_repeat_interleave`` fork sequences (copy-on-write, every
    storage type, int8 included) instead of copying them.
    """

    def __init__(self, dtype=None, window=None, block_size=256, num_blocks=16, owner=None):
        super().__init__(dtype=dtype, window=window, owner=owner)
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)

    def lazy_initialization(self, key_states, value_states):
        B, H, _, d = key_states.shape
        dtype = key_states.dtype if self.storage_dtype is None else self.storage_dtype
        pool = PagedKVCache(
            H,
            d,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            v_head_dim=value_states.shape[-1],
            dtype=_storage_arg(dtype),
            window=self.window,
        )
        self.kv = _PagedBatch(pool, B)
        self.io_dtype = _TORCH_OF.get(pool.dtype, torch.float32)
        self.device = torch.device("cpu")
        self.valid = np.zeros(B, dtype=np.int64)
        self.is_initialized = True

    def step(self, query, key, value, scaling):
        """None: a token of a paged layer takes ``attend_cached`` (the pool's own fast paths)."""
        return None

    def _select(self, idx):
        if idx.size and (idx.min() < 0 or idx.max() >= self.kv.batch):
            raise IndexError(f"batch indices {idx.tolist()} out of range for batch {self.kv.batch}")
        self.kv.select(idx)
        self.valid = self.valid[idx].copy()
        self.pending = None


class AttnFastPagedCache(AttnFastCache):
    """A transformers Cache whose layers are ``attn_fast.PagedKVCache`` pools.

    Parameters
    ----------
    config : the model's config (``model.config``), as for AttnFastCache.

    dtype : PagedKVCache storage dtype: float32, "float16", "bfloat16",
        "int8" (8-bit codes, float32 chunks and queries), ... or a
        torch/NumPy dtype; None = the model's dtype.

    block_size : token rows per block (a multiple of 64; default 256, as
        PagedKVCache's).

    num_blocks : blocks per pool chunk (default 16, 4096 tokens at the
        default block size; the pool grows by chunks).

    Notes
    -----
    Used as AttnFastCache (``attn_implementation="attn_fast"``,
    ``model.generate(..., cache=cache)``), with the same mask handling and
    errors (module docstring). Each layer's pool holds one sequence per
    batch row: decode reads the blocks in place through the block tables
    (``_core.decode`` with a block table), prefill chunks run the same decode kernel.
    Sliding-window layers release the blocks before their window as the
    sequences grow. Beam search (``reorder_cache``) forks the kept
    sequences (copy-on-write, so no K/V is copied; int8 works too) and frees
    the rest; ``crop`` truncates each sequence.
    """

    def __init__(self, config, dtype=None, block_size=256, num_blocks=16):
        _keep_config(self, config, "AttnFastPagedCache")
        # Bad dtype / block_size / num_blocks raise here, not mid-generate.
        PagedKVCache(
            1,
            1,
            block_size=block_size,
            num_blocks=num_blocks,
            dtype=_storage_arg("float32" if dtype is None else dtype),
        )
        layers = []
        for i, window in enumerate(_layer_windows(config, "AttnFastPagedCache")):
            layer = AttnFastPagedLayer(
                dtype=dtype, window=window, block_size=block_size, num_blocks=num_blocks, owner=self
            )
            layer.layer_idx = i
            layers.append(layer)
        Cache.__init__(self, layers=layers)


# --------------------------------------------------------------------------- attention


def _valid_new(layer, mask, B, Lq):
    """None when every sequence takes all Lq new tokens, else (B,) int64 valid new tokens per
    sequence, from the layer's mask (left padding only; ValueError / NotImplementedError for
    anything else). What the mask's key padding implies is computed once per mask (every
    layer of a forward pass receives the same one); each layer compares it with its own
    counts."""
    if mask is None:  # the builder skipped it: no padding, causal
        return None
    P = layer.seen - Lq
    spec = mask_spec(mask)
    if spec is None or spec.shape != (B, 1, Lq, P + Lq):
        raise NotImplementedError(
            f"AttnFastCache takes the causal masks attn_fast's mask builder makes (padding from "
            f"the 2-D attention_mask); got a custom attention_mask of shape {tuple(mask.shape)} "
            f"for {B} sequences, {Lq} new and {P} past tokens"
        )
    want = (-1, -1) if layer.window is None else (layer.window - 1, -1)
    if not (spec.causal or Lq == 1) or spec.window != want:
        raise NotImplementedError(
            f"AttnFastCache layer {layer.layer_idx}: the mask is causal={spec.causal}, window="
            f"{spec.window}, but the cache computes causal attention with window {want}"
        )
    if spec.key_mask is None:
        return None
    got = spec.memo.get("valid_new")
    if got is None or got[0] != P:
        km = spec.key_mask.reshape(B, P + Lq)
        new = km[:, P:]
        c = new.sum(axis=1).astype(np.int64)
        suffix = np.arange(Lq)[None, :] >= (Lq - c)[:, None]
        if not np.array_equal(new, suffix):
            raise ValueError(
                "AttnFastCache supports left padding only: the attention_mask of the new tokens "
                f"is {new.astype(int).tolist()}, not 0s then 1s per sequence"
            )
        got = (P, None if (c == Lq).all() else c, km[:, :P].sum(axis=1))
        spec.memo["valid_new"] = got
    if not np.array_equal(got[2], layer.valid):
        raise ValueError(
            f"attention_mask marks {got[2].tolist()} valid past tokens per sequence but the "
            f"AttnFastCache holds {layer.valid.tolist()}: the mask of earlier tokens changed"
        )
    return got[1]


def _refuse_features(a):
    """NotImplementedError naming what the cache cannot compute (a: the call's CallArgs)."""
    if a.softcap or a.s_aux is not None or a.position_bias is not None or not a.causal:
        unsupported = [
            n
            for n, bad in (
                ("softcap", bool(a.softcap)),
                ("s_aux (sinks)", a.s_aux is not None),
                ("position_bias", a.position_bias is not None),
                ("is_causal=False", not a.causal),
            )
            if bad
        ]
        raise NotImplementedError(
            f"AttnFastCache does not support {', '.join(unsupported)}; use transformers' "
            "DynamicCache with attn_implementation='attn_fast'"
        )


def _arg(t):
    """A chunk or query for the KVCache: the tensor's NumPy view where one exists (the
    cache's fast path reads a NumPy array as it is), else the tensor."""
    if t.dtype in _AS_NUMPY:
        f = _checks.fast_view(t)
        if f is not None:
            return f[0]
    return t


def _store_and_attend(kv, query, key, value, scaling):
    """Every sequence takes the whole chunk: append it, attend. (B, H_q, Lq, dv) tensor."""
    kv.append(_arg(key), _arg(value))
    o = kv.attend(_arg(query), scale=scaling)
    return torch.from_numpy(o) if isinstance(o, np.ndarray) else o


def _store_and_attend_padded(kv, query, key, value, scaling, c):
    """A left-padded chunk (c (B,) valid rows, a suffix of each): the valid rows are
    right-aligned (one copy of the chunk), appended and attended; padded query rows get zeros."""
    B, Hq, Lq, _ = query.shape
    k2, v2, q2 = (torch.zeros_like(t) for t in (key, value, query))
    for b in np.flatnonzero(c):
        p = Lq - int(c[b])
        k2[b, :, : c[b]] = key[b, :, p:]
        v2[b, :, : c[b]] = value[b, :, p:]
        q2[b, :, : c[b]] = query[b, :, p:]
    kv.append(k2, v2, lengths=c)
    o2 = kv.attend(q2, scale=scaling, q_lens=c)
    o = o2.new_zeros((B, Hq, Lq, value.shape[-1]))
    for b in np.flatnonzero(c):
        o[b, :, Lq - int(c[b]) :] = o2[b, :, : c[b]]
    return o


def attend_cached(layer, query, key, value, a):
    """The attention call of a layer with an AttnFastCache: store the chunk, attend.

    query (B, H_q, Lq, d) CPU tensor; key/value: the tensors ``layer.update``
    returned; a: the call's ``CallArgs``. Returns the output (B, Lq, H_q, dv)
    contiguous in query's dtype (for Lq = 1 a view of the kernel's output, else a copy).
    """
    if layer.pending is None or layer.pending[0] is not key or layer.pending[1] is not value:
        raise RuntimeError(
            f"AttnFastCache layer {layer.layer_idx}: key/value are not the chunk of the last "
            "update() of this layer"
        )
    layer.pending = None
    B, Hq, Lq, _ = query.shape
    try:
        _refuse_features(a)
        c = _valid_new(layer, a.mask, B, Lq)
    except Exception:
        layer.seen -= Lq  # the chunk is not stored
        raise
    query_dtype, sd = query.dtype, layer.io_dtype
    if query.dtype is not sd or key.dtype is not sd or value.dtype is not sd:
        query, key, value = query.to(sd), key.to(sd), value.to(sd)
    if c is None:
        o = _store_and_attend(layer.kv, query, key, value, a.scaling)
        layer.valid += Lq
    else:
        o = _store_and_attend_padded(layer.kv, query, key, value, a.scaling, c)
        layer.valid = layer.valid + c
    # (B, H_q, Lq, dv) -> (B, Lq, H_q, dv): for one row the same memory order (a view)
    o = o.reshape(B, 1, Hq, o.shape[-1]) if Lq == 1 else o.transpose(1, 2).contiguous()
    return o if o.dtype is query_dtype else o.to(query_dtype)
