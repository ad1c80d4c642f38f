"""Multi-head attention (MHA, GQA, MQA; self- and cross-attention) in NumPy.

The chapter's picture: cut D into H slices of d_h features, run attention in
each slice independently, concatenate the H outputs and project with Wo. ::

    x (B, L, D) ─ x Wqᵀ ─> (B, L, H·d_h) ─ reshape ─> (B, L, H, d_h)
                                                       │ .transpose(0, 2, 1, 3): a strided view
                                                       ▼
                            fused kernel on (B, H, L, d_h) views, K/V with H_kv heads
                                                       │ written through a (B, L, H, d_h) buffer
                                                       ▼
    out (B, L, D) <─ · Woᵀ ─ (B, L, H·d_h) <─ reshape (free: the buffer is already in that order)

Splitting and merging heads never copies: the projections are computed into
(B, L, H, d_h) order and the kernel reads and writes them through strides.
Weights follow torch's Linear convention, y = x Wᵀ + b, as the textbook's
Q = X Wqᵀ::

    Wq (H·d_h, D)       Wk, Wv (H_kv·d_h, D_kv)       Wo (D, H·d_h)
    bq (H·d_h,)         bk, bv (H_kv·d_h,)            bo (D,)          (bias=True)

D_kv = ``kv_dim`` (default D) is the feature size of the cross-attention
context. When D_kv == D, Wq, Wk and Wv are rows of one (H·d_h + 2·H_kv·d_h, D)
array so self-attention takes one matrix product; the attributes Wq/Wk/Wv are
views into it.

Shape legend: B batch, L query length, Lk key length, D model dim, H query
heads, H_kv key/value heads (H % H_kv == 0), d_h head dim.

16-bit layers (``dtype=np.float16`` or ``"bfloat16"``, see ``_lowp``): the
weights are stored in that dtype and inputs must have it; each projection is a
float32 product of the upcast operands rounded once to the dtype (RoPE is
applied in float32 before that rounding), attention runs in the 16-bit kernel
(fp32 softmax and accumulation) and the output has the input's dtype and kind.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ._checks import (
    check_int,
    check_scale,
    dtype_name,
    shape_str,
    to_input_kind,
)
from ._lowp import as_layer_input, is_half, layer_dtype, linear
from ._module import Module, as_rng
from .functional import scaled_dot_product_attention
from .kv_cache import KVCache
from .positional import RoPE

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(Module):
    """Multi-head attention on (L, D) or (B, L, D) arrays, calling the fused kernel.

    Parameters
    ----------
    d_model : D, the input and output feature size.
    num_heads : H, query heads.
    num_kv_heads : H_kv, key/value heads (default H). H_kv < H is grouped-query
        attention (GQA), H_kv = 1 multi-query (MQA); K and V are never repeated.
    head_dim : d_h (default D // H; D need not equal H·d_h when given).
    bias : add bq, bk, bv, bo.
    positional : None, "rope" (rotate-half RoPE on all of d_h, base 10000) or a
        ``attn_fast.positional.RoPE`` object. Applied to q and k in
        self-attention only (cross-attention positions live in two different
        sequences).
    kv_dim : D_kv, the context's feature size for cross-attention (default D).
    scale : softmax scale (default 1/sqrt(d_h)).
    weights : optional dict of arrays, as ``load_weights`` takes.
    rng : seed or ``numpy.random.Generator`` for the initial weights
        (normal with std 1/sqrt(fan_in); biases zero).
    dtype : the weights' dtype, and the dtype inputs must have: float32
        (default), float64, float16 or bfloat16 ("bfloat16" or
        ``ml_dtypes.bfloat16``; needs ml_dtypes). 16-bit layers compute each
        product in float32 and round its result (module docstring).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = False,
        positional: str | RoPE | None = None,
        *,
        kv_dim: int | None = None,
        scale: float | None = None,
        weights: Mapping[str, ArrayLike] | None = None,
        rng: int | np.random.Generator | None = None,
        dtype: DTypeLike = np.float32,
    ) -> None:
        D, H = check_int(d_model, "d_model", 1), check_int(num_heads, "num_heads", 1)
        Hkv = H if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads", 1)
        if H % Hkv:
            raise ValueError(f"num_heads={H} must be a multiple of num_kv_heads={num_kv_heads}")
        if head_dim is None:
            if D % H:
                raise ValueError(f"d_model={D} is not divisible by num_heads={H}; pass head_dim")
            head_dim = D // H
        dh = check_int(head_dim, "head_dim", 1)
        Dkv = D if kv_dim is None else check_int(kv_dim, "kv_dim", 1)
        self.dtype = layer_dtype(dtype)
        self._half = is_half(self.dtype)
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.kv_dim = (
            D,
            H,
            Hkv,
            dh,
            Dkv,
        )
        self.scale = check_scale(scale, dh, np.float32 if self._half else self.dtype)
        if positional is None:
            self.rope = None
        elif isinstance(positional, str):
            if positional != "rope":
                raise ValueError(
                    f"positional must be None, 'rope' or a RoPE object, got {positional!r}"
                )
            self.rope = RoPE(dh)
        elif isinstance(positional, RoPE):
            if positional.head_dim != dh:
                raise ValueError(
                    f"RoPE has head_dim {positional.head_dim} but the attention has head_dim {dh}"
                )
            self.rope = positional
        else:
            raise TypeError(
                f"positional must be None, 'rope' or a RoPE object, got {type(positional).__name__}"
            )

        nq, nkv = H * dh, Hkv * dh
        dt = self.dtype
        # Parameters. Wq/Wk/Wv are views into one input-projection buffer.
        if Dkv == D:
            self._w_qkv = np.zeros((nq + 2 * nkv, D), dtype=dt)
            self._w_q, self._w_kv = self._w_qkv[:nq], self._w_qkv[nq:]
        else:
            self._w_qkv = None
            self._w_q, self._w_kv = np.zeros((nq, D), dtype=dt), np.zeros((2 * nkv, Dkv), dtype=dt)
        self._w_o = np.zeros((D, nq), dtype=dt)
        self.bias = bool(bias)
        if self.bias:
            self._b_qkv = np.zeros(nq + 2 * nkv, dtype=dt)
            self._b_q, self._b_kv = self._b_qkv[:nq], self._b_qkv[nq:]
            self._b_o = np.zeros(D, dtype=dt)
        self._params = {
            "Wq": self._w_q,
            "Wk": self._w_kv[:nkv],
            "Wv": self._w_kv[nkv:],
            "Wo": self._w_o,
        }
        if self.bias:
            self._params.update(
                bq=self._b_q, bk=self._b_kv[:nkv], bv=self._b_kv[nkv:], bo=self._b_o
            )
        gen = as_rng(rng)
        for name in ("Wq", "Wk", "Wv", "Wo"):
            p = self._params[name]
            p[...] = gen.standard_normal(p.shape) / math.sqrt(p.shape[1])
        if weights is not None:
            self.load_weights(weights)

    # -- parameters ---------------------------------------------------------
    Wq = property(lambda self: self._params["Wq"], doc="(H·d_h, D) query projection (a view).")
    Wk = property(lambda self: self._params["Wk"], doc="(H_kv·d_h, D_kv) key projection (a view).")
    Wv = property(
        lambda self: self._params["Wv"], doc="(H_kv·d_h, D_kv) value projection (a view)."
    )
    Wo = property(lambda self: self._params["Wo"], doc="(D, H·d_h) output projection.")

    def _own(self) -> dict[str, np.ndarray]:
        """Wq, Wk, Wv, Wo and, with bias=True, bq, bk, bv, bo (views; see
        ``Module.state_dict`` and ``Module.load_weights``)."""
        return dict(self._params)

    def _unknown_hint(self) -> str:
        return "" if self.bias else " (biases need bias=True)"

    def __repr__(self) -> str:
        return (
            f"MultiHeadAttention(d_model={self.d_model}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, bias={self.bias}, "
            f"rope={self.rope!r}, dtype={dtype_name(self.dtype)})"
        )

    # -- forward ------------------------------------------------------------
    def _check_input(self, x: ArrayLike, name: str, dim: int) -> np.ndarray:
        # big-endian / misaligned data: copied once; bfloat16 as an ml_dtypes view
        x = as_layer_input(x, name, self.dtype, "the attention's weights")
        if x.ndim not in (2, 3) or x.shape[-1] != dim:
            raise ValueError(
                f"{name} must be (L, {dim}) or (B, L, {dim}), got shape {shape_str(x)}"
            )
        return x

    def _check_cache(self, cache: Any, B: int) -> None:
        """TypeError / ValueError unless `cache` is a KVCache this layer can use
        (checked before anything runs)."""
        if not isinstance(cache, KVCache):
            raise TypeError(
                "cache must be a KVCache (one per layer; index a LayerCaches), got "
                f"{type(cache).__name__}"
            )
        want = (B, self.num_kv_heads, self.head_dim, self.head_dim, dtype_name(self.dtype))
        io = getattr(cache, "io_dtype", cache.dtype)  # an int8 cache takes float32 (issue #20)
        got = (cache.batch, cache.num_kv_heads, cache.head_dim, cache.v_head_dim, dtype_name(io))
        if got != want:
            raise ValueError(
                "cache has (batch, num_kv_heads, head_dim, v_head_dim, dtype) = "
                f"({got[0]}, {got[1]}, {got[2]}, {got[3]}, {got[4]}) but this call needs "
                f"({want[0]}, {want[1]}, {want[2]}, {want[3]}, {want[4]})"
            )

    def _heads(self, y: np.ndarray, n_heads: int) -> np.ndarray:
        """(B, L, n·d_h) -> (B, L, n, d_h): a reshape, no copy."""
        return y.reshape(y.shape[0], y.shape[1], n_heads, self.head_dim)

    def __call__(
        self,
        x: ArrayLike,
        context: ArrayLike | None = None,
        mask: Any = None,
        cache: KVCache | None = None,
        *,
        causal: bool = False,
        positions: ArrayLike | None = None,
    ) -> Any:
        """Attention of x over itself (or over ``context``), then Wo.

        x : (L, D) or (B, L, D) in the module's dtype (NumPy, ml_dtypes or torch).
        context : None (self-attention) or (Lk, D_kv) / (B, Lk, D_kv):
            cross-attention, Q from x and K, V from context (Lk may differ from L).
        mask : what ``scaled_dot_product_attention``'s attn_mask takes
            (boolean True = attend, or additive float, broadcastable to
            (B, H, L, Lk); or an ``attn_fast.masks`` object).
        causal : bottom-right causal mask (query i sees keys j <= i + Lk - L).
        cache : an ``attn_fast.KVCache`` (batch B, H_kv heads, d_h). Self-
            attention: this call's keys (rotated at their absolute positions
            ``cache.positions + arange(L)`` when RoPE is on) and values are
            appended, and q attends to everything cached, causally if
            ``causal``. Cross-attention: the context's K/V are projected and
            appended on the first call (empty cache) and reused afterwards.
            ``mask`` cannot be combined with a cache.
        positions : optional (L,) or (B, L) int array, the RoPE positions of
            x's tokens (left-padded batches, custom offsets); default
            ``arange(L)``, or ``cache.positions + arange(L)`` with a cache.

        Returns (L, D) or (B, L, D), a new array of x's dtype (a torch tensor for
        torch input).
        """
        like = x
        x = self._check_input(x, "x", self.d_model)
        squeeze = x.ndim == 2
        x3 = x[None] if squeeze else x
        B, L, _ = x3.shape
        H, Hkv, dh = self.num_heads, self.num_kv_heads, self.head_dim
        nq, nkv = H * dh, Hkv * dh
        if cache is not None and mask is not None:
            raise ValueError(
                "mask= cannot be combined with cache= (the cache attends causally or fully)"
            )
        if cache is not None:
            self._check_cache(cache, B)

        rope_on_append = None  # a RoPE the cache applies to the keys as it stores them
        if context is None:
            if self._w_qkv is None:
                raise ValueError(
                    f"this attention was built for cross-attention with kv_dim={self.kv_dim} != "
                    f"d_model={self.d_model}; pass context="
                )
            # (B, L, (H + 2 H_kv) d_h), one product; 16-bit: float32 until after RoPE
            qkv = linear(x3, self._w_qkv, self._b_qkv if self.bias else None, fp32=True)
            q = self._heads(qkv[..., :nq], H)  # (B, L, H, d_h) views
            k = self._heads(qkv[..., nq : nq + nkv], Hkv)
            v = self._heads(qkv[..., nq + nkv :], Hkv)
            if self.rope is not None:
                offset = 0 if cache is None else np.asarray(cache.positions)
                if isinstance(cache, KVCache) and positions is None and not self._half:
                    # keys are rotated by the cache write itself (one pass, at cache.positions)
                    self.rope(q, offset=offset, seq_axis=1, inplace=True)
                    rope_on_append = self.rope
                else:
                    self.rope.rotate_qk(
                        q, k, offset=offset, positions=positions, seq_axis=1, inplace=True
                    )
            elif positions is not None:
                raise ValueError("positions= is only meaningful with positional RoPE")
            if self._half:  # the projection's one rounding, after RoPE
                qkv = qkv.astype(self.dtype)
                q = self._heads(qkv[..., :nq], H)
                k = self._heads(qkv[..., nq : nq + nkv], Hkv)
                v = self._heads(qkv[..., nq + nkv :], Hkv)
        else:
            if positions is not None:
                raise ValueError("positions= is not used by cross-attention (no RoPE there)")
            c = self._check_input(context, "context", self.kv_dim)
            c3 = c[None] if c.ndim == 2 else c
            if c3.shape[0] != B:
                raise ValueError(
                    f"context has shape {shape_str(c)} but x has shape {shape_str(x)}: batch "
                    "sizes differ"
                )
            q = self._heads(linear(x3, self._w_q, self._b_q if self.bias else None), H)
            k = v = None
            if cache is None or len(cache) == 0:
                # (B, Lk, 2 H_kv d_h)
                kv = linear(c3, self._w_kv, self._b_kv if self.bias else None)
                k, v = self._heads(kv[..., :nkv], Hkv), self._heads(kv[..., nkv:], Hkv)
            elif np.any(np.asarray(cache.lengths) != c3.shape[1]):
                raise ValueError(
                    f"the cross-attention cache holds {np.asarray(cache.lengths).tolist()} keys "
                    f"but context has length {c3.shape[1]}; reset() the cache for a new context"
                )

        # (B, L, H, d_h) -> (B, H, L, d_h) as strided views for the kernel.
        qT = q.transpose(0, 2, 1, 3)
        if cache is not None:
            if k is not None:
                if rope_on_append is None:
                    cache.append(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
                else:
                    cache.append(
                        k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), rope=rope_on_append
                    )
            o = cache.attend(
                qT, scale=self.scale, causal=bool(causal) and context is None
            )  # (B, H, L, d_h)
            merged = o.transpose(0, 2, 1, 3).reshape(B, L, nq)  # copies L·H·d_h values
        else:
            buf = np.empty((B, L, H, dh), dtype=self.dtype)
            scaled_dot_product_attention(
                qT,
                k.transpose(0, 2, 1, 3),
                v.transpose(0, 2, 1, 3),
                attn_mask=mask,
                is_causal=bool(causal),
                scale=self.scale,
                enable_gqa=Hkv != H,
                out=buf.transpose(0, 2, 1, 3),
            )
            merged = buf.reshape(B, L, nq)  # heads concatenated: no copy
        y = linear(merged, self._w_o, self._b_o if self.bias else None)
        return to_input_kind(y[0] if squeeze else y, like)
