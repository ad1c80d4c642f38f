"""The cheaper attention families: low rank (Linformer) and linear attention.

Full softmax attention costs O(L²) time (the fused kernel already keeps the
memory O(L)). The chapter names four ways to cut the L² bill:

- sliding window: ``scaled_dot_product_attention(..., window_size=(w, 0))``, exact
  for its mask, O(L·w);
- block-sparse patterns: ``attn_mask=`` a block layout, exact for its mask;
- low rank (Linformer, Wang et al. 2020): :func:`linformer_attention`,
  :class:`Linformer`. K and V are projected along the sequence axis to k rows,
  then exact softmax attention runs on those k rows: O(L·k). An approximation;
  **not causal by construction** (every projected row mixes all positions, the
  future included), so it suits encoders, not autoregressive decoding;
- linear attention (associativity, Katharopoulos et al. 2020):
  :func:`linear_attention`, :func:`linear_attention_step`. softmax(QKᵀ) is
  replaced by a kernel φ(Q)φ(K)ᵀ, and the product is taken right to left,
  φ(Q)(φ(K)ᵀV), so it costs O(L·r·dv) (r = feature dim). A different model,
  not an approximation of a given softmax layer.

Layouts follow :func:`attn_fast.scaled_dot_product_attention`: q is (L, d),
(H, L, d) or (B, H, L, d), read through its strides; results are new
C-contiguous arrays of q's dtype: float32, float64, or a 16-bit one (NumPy
float16, ``ml_dtypes.bfloat16``, torch.float16 / torch.bfloat16 CPU tensors,
read zero-copy), whose arithmetic is float32 or wider and whose result is
rounded once to the 16-bit dtype. Torch input gives torch output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _core
from ._checks import (
    BF16,
    HALF_DTYPES,
    as_float_array,
    bf16_bits,
    check_bool,
    check_int,
    check_qkv,
    check_real,
    from_float,
    shape_str,
    to4,
    to_float,
    to_input_kind,
)
from ._lowp import as_layer_input, is_half, layer_dtype, linear
from .functional import scaled_dot_product_attention

__all__ = [
    "linformer_attention",
    "Linformer",
    "linear_attention",
    "linear_attention_step",
    "LinearAttentionState",
    "feature_map",
]


# --------------------------------------------------------------------------
# Linformer: low-rank projection of K and V along the sequence axis
# --------------------------------------------------------------------------


def _check_projection(P, name, Lk, dtype):
    P = as_float_array(P, name, half=True)
    if P.ndim != 2 or P.shape[0] < 1:
        raise ValueError(f"{name} must be a (k, L) matrix with k >= 1, got shape {shape_str(P)}")
    if P.shape[1] != Lk:
        raise ValueError(
            f"{name} has shape {shape_str(P)} but k has length Lk = {Lk}; {name} must be (k, {Lk})"
        )
    if P.dtype in HALF_DTYPES:  # 16-bit (bfloat16 as bits): its values
        return to_float(P, dtype)
    return P.astype(dtype, copy=False)


def linformer_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    E: ArrayLike,
    F: ArrayLike | None = None,
    *,
    scale: float | None = None,
) -> Any:
    """Linformer attention: softmax(q (E k)ᵀ · scale) (F v), exact on k rows.

    q : (L, d), (H, L, d) or (B, H, L, d): float32, float64, float16 or
        bfloat16 (torch / ml_dtypes).

    k : (…, Lk, d), v : (…, Lk, dv), same leading dims and dtype as q.

    E, F : (kp, Lk) projection matrices (F=None shares E, Linformer's
        "shared key-value" variant). They are cast to q's dtype (16-bit q:
        to float32; the projections E k and F v are float32 products of the
        upcast operands, rounded once to q's dtype).

    scale : float, default 1/sqrt(d).

    Computes K' = E k (…, kp, d) and V' = F v (…, kp, dv) with one matrix
    product each (O(Lk·kp·d)), then exact softmax attention of the L queries
    over the kp projected rows through the fused kernel (O(L·kp·d)).
    Returns (…, L, dv) in q's dtype (a new array).

    Not causal by construction: each projected row is a mixture of all Lk
    positions, so a query sees (a summary of) the future. There is no
    ``is_causal``; use sliding-window or linear attention for decoders.
    """
    like = q
    q, k, v = check_qkv(q, k, v, half=True, enable_gqa=None)[:3]
    Lk = k.shape[-2]
    half = q.dtype in HALF_DTYPES
    pdt = np.float32 if half else q.dtype
    E = _check_projection(E, "E", Lk, pdt)
    F = E if F is None else _check_projection(F, "F", Lk, pdt)
    if E.shape[0] != F.shape[0]:
        raise ValueError(
            f"E has shape {shape_str(E)} but F has shape {shape_str(F)}: both must project to the "
            "same k"
        )
    if half:  # float32 products, one rounding each; bfloat16 travels as tagged bits
        tag = bf16_bits if q.dtype == np.uint16 else np.asarray
        Kp = tag(from_float(np.matmul(E, to_float(k, np.float32)), q.dtype))
        Vp = tag(from_float(np.matmul(F, to_float(v, np.float32)), q.dtype))
        return to_input_kind(scaled_dot_product_attention(tag(q), Kp, Vp, scale=scale), like)
    Kp = np.matmul(E, k)  # (kp, Lk) @ (…, Lk, d) -> (…, kp, d)
    Vp = np.matmul(F, v)  # (…, kp, dv)
    return to_input_kind(scaled_dot_product_attention(q, Kp, Vp, scale=scale), like)


class Linformer:
    """A multi-head Linformer self-attention layer (NumPy weights, fused core).

    Linformer(d_model, n_heads, seq_len, k=256, share_kv=False, dtype=float32, seed=None)

    Weights: Wq, Wk, Wv, Wo (d_model, d_model) ~ N(0, 1/d_model); E and F
    (k, seq_len) ~ N(0, 2/(seq_len + k)) (Xavier normal, as the authors'
    code initialises its nn.Linear(seq_len, k)); one E, F shared by all heads
    (the paper's head-wise sharing). With ``share_kv`` F is E. Every weight is
    a plain attribute you may overwrite with trained values.

    __call__(X): X (L, d_model) or (B, L, d_model) with L <= seq_len, returns
    the same shape in ``dtype``. A shorter sequence uses E[:, :L], F[:, :L],
    which equals zero-padding it to seq_len (the paper's padding). Not causal.

    ``dtype``: float32 (default) or float64, whose inputs are cast to it; or
    16-bit float16 / bfloat16 (``ml_dtypes``), whose weights are stored in it
    and whose inputs must have it (TypeError with a cast hint otherwise): each
    product in float32 from the upcast operands, rounded once; attention in
    the 16-bit kernel.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        seq_len: int,
        k: int = 256,
        *,
        share_kv: bool = False,
        dtype: DTypeLike = np.float32,
        seed: int | None = None,
    ) -> None:
        d_model, n_heads = check_int(d_model, "d_model", 1), check_int(n_heads, "n_heads", 1)
        seq_len, k = check_int(seq_len, "seq_len", 1), check_int(k, "k", 1)
        if d_model % n_heads != 0:
            raise ValueError(
                f"d_model = {d_model} must be a positive multiple of n_heads = {n_heads}"
            )
        if seq_len < 1 or k < 1:
            raise ValueError(f"seq_len and k must be >= 1, got seq_len = {seq_len}, k = {k}")
        dtype = layer_dtype(dtype)
        rng = np.random.default_rng(seed)
        self.d_model, self.n_heads, self.seq_len, self.k, self.dtype = (
            d_model,
            n_heads,
            seq_len,
            k,
            dtype,
        )
        w = 1.0 / math.sqrt(d_model)
        self.Wq, self.Wk, self.Wv, self.Wo = (
            (rng.standard_normal((d_model, d_model)) * w).astype(dtype) for _ in range(4)
        )
        p = math.sqrt(2.0 / (seq_len + k))
        self.E = (rng.standard_normal((k, seq_len)) * p).astype(dtype)
        self.F = self.E if share_kv else (rng.standard_normal((k, seq_len)) * p).astype(dtype)

    def __call__(self, X: ArrayLike) -> Any:
        like = X
        if is_half(self.dtype):
            X = as_layer_input(X, "X", self.dtype, "the Linformer's weights")
        else:
            X = as_float_array(X, "X").astype(self.dtype, copy=False)
        if X.ndim not in (2, 3) or X.shape[-1] != self.d_model:
            raise ValueError(
                f"X must be (L, {self.d_model}) or (B, L, {self.d_model}), got shape {shape_str(X)}"
            )
        L = X.shape[-2]
        if not 1 <= L <= self.seq_len:
            raise ValueError(
                f"X has length {L} but this layer was built for seq_len = {self.seq_len}"
            )
        H, dh = self.n_heads, self.d_model // self.n_heads

        def heads(Y):  # (…, L, D) -> (…, H, L, dh), a view
            return np.swapaxes(Y.reshape(Y.shape[:-1] + (H, dh)), -2, -3)

        q, k, v = (heads(linear(X, W)) for W in (self.Wq, self.Wk, self.Wv))
        E = self.E[:, :L]
        F = E if self.F is self.E else self.F[:, :L]
        if is_half(self.dtype):  # the projections in float32 (E, F read as their values)
            E, F = E.astype(np.float32), F.astype(np.float32)
        o = linformer_attention(q, k, v, E, F)  # (…, H, L, dh)
        o = np.swapaxes(o, -2, -3).reshape(X.shape[:-1] + (self.d_model,))
        return to_input_kind(linear(o, self.Wo), like)


# --------------------------------------------------------------------------
# Linear attention: phi(Q) (phi(K)^T V), the associativity trick
# --------------------------------------------------------------------------


def _elu1(x):
    # elu(x) + 1 = x + 1 for x > 0, exp(x) otherwise: strictly positive.
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def _relu(x):
    return np.maximum(x, 0)


_FEATURE_MAPS = {"elu1": _elu1, "relu": _relu}


def feature_map(x: ArrayLike, fm: str | Callable[[np.ndarray], ArrayLike] = "elu1") -> Any:
    """Apply a linear-attention feature map to (…, d) and check it.

    x : (…, d) float32, float64 or 16-bit (NumPy float16, ``ml_dtypes.bfloat16``,
        torch.float16 / torch.bfloat16; a 16-bit x is mapped in float32 and the
        features rounded once to its dtype).

    fm : "elu1" (elu(x) + 1, Katharopoulos et al.; strictly positive),
        "relu" (max(x, 0); a row may be all zeros) or a callable mapping a
        (…, d) NumPy array (float32 for 16-bit x) to a (…, r) array of
        non-negative finite values (random features, say; r may differ from
        d). Returns an array of x's dtype (a torch tensor for torch input).

    Raises ValueError for an unknown name, a wrong shape, or negative or
    non-finite features (the normaliser φ(q)ᵀΣφ(k) must stay non-negative);
    TypeError for an x that is not a float array.
    """
    like = x
    a = as_float_array(x, "x", half=True)
    if a.dtype in HALF_DTYPES:
        y = from_float(_feature_map(to_float(a, np.float32), fm), a.dtype)
        return to_input_kind(y, like)
    return to_input_kind(_feature_map(a, fm), like)


def _feature_map(x: np.ndarray, fm: str | Callable[[np.ndarray], ArrayLike]) -> np.ndarray:
    """feature_map on a checked float32 / float64 NumPy array: features of x's dtype."""
    if isinstance(fm, str):
        try:
            f = _FEATURE_MAPS[fm]
        except KeyError:
            raise ValueError(
                f"unknown feature_map {fm!r}; use one of {sorted(_FEATURE_MAPS)} or a callable"
            ) from None
        return f(x)
    if not callable(fm):
        raise TypeError(f"feature_map must be a name or a callable, got {type(fm).__name__}")
    y = np.asarray(fm(x))
    if y.dtype.kind not in "fiu":
        raise TypeError(f"feature_map returned dtype {y.dtype}; expected real numbers")
    if y.ndim != x.ndim or y.shape[:-1] != x.shape[:-1] or y.shape[-1] < 1:
        raise ValueError(
            f"feature_map mapped shape {shape_str(x)} to {shape_str(y)}; it must keep every axis "
            "but the last"
        )
    y = y.astype(x.dtype, copy=False)
    if not np.all(np.isfinite(y)):
        raise ValueError("feature_map returned non-finite values")
    lo = y.min() if y.size else 0
    if lo < 0:
        raise ValueError(
            f"feature_map returned negative features (min {lo:.3g}); linear attention needs "
            "phi(x) >= 0 so that the normaliser phi(q)^T sum phi(k) stays non-negative"
        )
    return y


@dataclass
class LinearAttentionState:
    """The running state of causal linear attention after n positions.

    kv : (…, r, dv) float64, Σ_t φ(k_t) v_tᵀ
    k_sum : (…, r) float64, Σ_t φ(k_t)
    length : int, positions seen
    (… = q's leading dims: (), (H,) or (B, H).) O(r·dv) whatever the length.
    """

    kv: np.ndarray
    k_sum: np.ndarray
    length: int = 0

    def copy(self) -> LinearAttentionState:
        return LinearAttentionState(self.kv.copy(), self.k_sum.copy(), self.length)

    def __repr__(self) -> str:
        # Short: shapes, dtypes and the position, never the arrays themselves.
        def desc(x):
            shape = getattr(x, "shape", None)
            if shape is None:
                return type(x).__name__
            return f"{shape_str(x)} {getattr(x, 'dtype', '')}".rstrip()

        return (
            f"LinearAttentionState(kv {desc(self.kv)}, k_sum {desc(self.k_sum)}, "
            f"length={self.length!r})"
        )


def _check_state(state, lead, r, dv):
    if not isinstance(state, LinearAttentionState):
        raise TypeError(f"state must be a LinearAttentionState, got {type(state).__name__}")
    if state.kv.shape != lead + (r, dv) or state.k_sum.shape != lead + (r,):
        raise ValueError(
            f"state has kv {shape_str(state.kv)} and k_sum {shape_str(state.k_sum)}, "
            f"expected {lead + (r, dv)} and {lead + (r,)}"
        )
    return LinearAttentionState(
        np.array(state.kv, dtype=np.float64, order="C"),
        np.array(state.k_sum, dtype=np.float64, order="C"),
        check_int(state.length, "state.length", 0),
    )


def linear_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    feature_map: str | Callable[[np.ndarray], ArrayLike] = "elu1",
    causal: bool = False,
    *,
    eps: float = 1e-6,
    state: LinearAttentionState | None = None,
    return_state: bool = False,
) -> Any:
    """Linear attention O = φ(Q)(φ(K)ᵀV) / (φ(Q)(φ(K)ᵀ1) + eps), right to left.

    q, k : (L, d), (H, L, d) or (B, H, L, d); v : (…, L, dv), same leading
        dims (no GQA) and one dtype: float32, float64, or 16-bit (NumPy
        float16, ``ml_dtypes.bfloat16``, torch.float16 / torch.bfloat16 CPU
        tensors). No softmax scale: the kernel φ(q)ᵀφ(k) replaces
        exp(qᵀk/√d). Mixed dtypes raise TypeError with a cast hint.

    feature_map : "elu1" (default), "relu" or a callable, see
        :func:`attn_fast.variants.feature_map`. For 16-bit q, k it is applied
        in float32 to their values and the features stay float32 (not
        rounded to 16 bits); v is read in its 16-bit dtype, zero-copy, and
        widened as the kernel loads each block of tokens.

    causal : row i uses keys t <= i only: a running prefix sum of φ(k_t)v_tᵀ
        and φ(k_t) (the C++ sweep, parallel over batch and heads).

    eps : added to the denominator (1e-6, as the authors' code); a row whose
        denominator is exactly 0 (eps = 0 and φ(q)ᵀΣφ(k) = 0) gets zeros.

    state : a :class:`LinearAttentionState` of positions already seen (not
        modified): the call continues from it (chunked prefill). With
        causal=False the state's keys are visible to every row too.

    return_state : also return the state after the last position.

    Cost O(L·r·dv) time and O(r·dv) extra memory per (batch, head); the L×L
    matrix never exists. The state is accumulated in float64 for every
    dtype, so float32 and 16-bit inputs stay accurate for long sequences (see
    csrc/linear_attn.cpp). Returns (…, L, dv) in q's dtype (16-bit: rounded
    once from the float64 quotient; torch input gives a torch tensor), and
    the state (float64 whatever the dtype) if asked.
    """
    like = q
    causal = check_bool(causal, "causal")
    return_state = check_bool(return_state, "return_state")
    q, k, v = check_qkv(q, k, v, half=True, enable_gqa=None, same_len=True)[:3]
    eps = check_real(eps, "eps", minimum=0.0)
    if q.dtype in HALF_DTYPES:  # features in float32 from the 16-bit values
        fq, fk = _feature(to_float(q, np.float32), to_float(k, np.float32), feature_map)
    else:
        fq, fk = _feature(q, k, feature_map)
    lead, r, dv, L = q.shape[:-2], fq.shape[-1], v.shape[-1], q.shape[-2]
    if state is None:
        st = LinearAttentionState(np.zeros(lead + (r, dv)), np.zeros(lead + (r,)), 0)
    else:
        st = _check_state(state, lead, r, dv)
    o = np.empty(q.shape[:-1] + (dv,), dtype=v.dtype)  # q's dtype (checked), bf16 as bits
    if o.size or st.kv.size:
        _core.linear_attention(
            to4(fq, "q"),
            to4(fk, "k"),
            to4(v, "v"),
            to4(o, "out"),
            st.kv,
            st.k_sum,
            causal=bool(causal),
            eps=eps,
        )
    st.length += L
    o = to_input_kind(o, like)
    return (o, st) if return_state else o


def _feature(q, k, fm):
    fq = _feature_map(q, fm)
    fk = _feature_map(k, fm)
    if fq.shape[-1] != fk.shape[-1]:
        raise ValueError(
            f"feature_map gave q features {shape_str(fq)} but k features {shape_str(fk)}"
        )
    return fq, fk


def linear_attention_step(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    state: LinearAttentionState | None = None,
    feature_map: str | Callable[[np.ndarray], ArrayLike] = "elu1",
    *,
    eps: float = 1e-6,
) -> tuple[Any, LinearAttentionState]:
    """One decode step of causal linear attention: O(r·dv), whatever the length.

    q, k : (d,), (H, d) or (B, H, d) — one new token; v : (…, dv). One
        dtype, as :func:`linear_attention` takes (float32, float64, 16-bit).

    state : the :class:`LinearAttentionState` so far (None = empty); not
        modified.

    Returns (o, new_state): o (…, dv) in q's dtype (a torch tensor for torch
    input), equal to row n of ``linear_attention(..., causal=True)`` over the
    n + 1 tokens so far; the state is float64.
    """
    like = q
    # bfloat16 comes back as uint16 bits: tagged so linear_attention reads it as bfloat16
    q, k, v = (
        _tag_bf16(as_float_array(x, name, half=True)) for x, name in ((q, "q"), (k, "k"), (v, "v"))
    )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim not in (1, 2, 3):
            raise ValueError(
                f"{name} must be one token, (d,), (H, d) or (B, H, d), got shape {shape_str(x)}"
            )
    o, st = linear_attention(
        q[..., None, :],
        k[..., None, :],
        v[..., None, :],
        feature_map,
        True,
        eps=eps,
        state=state,
        return_state=True,
    )
    return to_input_kind(np.ascontiguousarray(o[..., 0, :]), like), st


def _tag_bf16(a: np.ndarray) -> np.ndarray:
    """`a`, with bfloat16 bits (uint16) tagged so that ``as_float_array`` reads them as bfloat16."""
    return bf16_bits(a) if a.dtype == BF16 else a
