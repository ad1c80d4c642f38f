"""The oracle: attention written as plainly as the textbook, in float64.

Every test compares attn_fast against these functions. They materialise the
full (Lq, Lk) score matrix on purpose: they are meant to be read, not to be
fast. Masks are dense boolean arrays here (True = attend).

    S = Q Kᵀ / √d        scores, (…, Lq, Lk)
    P = softmax(S)       row by row
    O = P V              (…, Lq, dv)
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "softmax",
    "attention",
    "sdpa",
    "causal_mask",
    "window_mask",
]


def _f64(a: ArrayLike) -> np.ndarray:
    """`a`'s values as a float64 NumPy array. A torch tensor (any dtype, bfloat16
    included, which NumPy cannot read) goes through ``.double()`` first."""
    if type(a).__module__.startswith("torch") and hasattr(a, "double"):
        a = a.detach().cpu().double().numpy()
    return np.asarray(a, dtype=np.float64)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """The textbook softmax: subtract the row max, exponentiate, normalise.

    x: a NumPy array (its float dtype is kept) or anything else array-like (read
    as float64; torch tensors of any dtype included)."""
    if not isinstance(x, np.ndarray):
        x = _f64(x)
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def attention(
    X: ArrayLike, Wq: ArrayLike, Wk: ArrayLike, Wv: ArrayLike, causal: bool = False
) -> np.ndarray:
    """The chapter's ten lines, in float64. X (L, D), each W (d, D) -> (L, dv)."""
    X, Wq, Wk, Wv = (_f64(a) for a in (X, Wq, Wk, Wv))
    Q, K, V = X @ Wq.T, X @ Wk.T, X @ Wv.T  # (L,D) -> (L,d): three personas
    S = Q @ K.T / np.sqrt(Q.shape[-1])  # (L,L): first matrix product
    if causal:
        S = np.where(np.tril(np.ones_like(S)), S, -1e9)  # lower-triangular pass
    return softmax(S) @ V  # second and third steps


def causal_mask(Lq: int, Lk: int, align: str = "bottom_right") -> np.ndarray:
    """Boolean (Lq, Lk): query i sees key j iff j <= i + offset.

    offset = Lk - Lq for bottom-right alignment (KV caches, FlashAttention),
    0 for top-left (torch's is_causal)."""
    off = Lk - Lq if align == "bottom_right" else 0
    i = np.arange(Lq)[:, None]
    j = np.arange(Lk)[None, :]
    return j <= i + off


def window_mask(
    Lq: int, Lk: int, left: int | None, right: int | None = 0, align: str = "bottom_right"
) -> np.ndarray:
    """Boolean (Lq, Lk): query i sees keys in [i+off-left, i+off+right]."""
    off = Lk - Lq if align == "bottom_right" else 0
    i = np.arange(Lq)[:, None] + off
    j = np.arange(Lk)[None, :]
    vis = np.ones((Lq, Lk), dtype=bool)
    if left is not None:
        vis &= j >= i - left
    if right is not None:
        vis &= j <= i + right
    return vis


def sdpa(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: ArrayLike | None = None,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: ArrayLike | None = None,
    return_lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Dense float64 attention for (…, Lq, d) / (…, Lk, d) / (…, Lk, dv).

    mask: boolean, broadcastable to (…, Lq, Lk), True = attend.
    bias: additive, broadcastable to (…, Lq, Lk) (-inf masks a pair).
    k and v may have fewer heads than q (axis -3): they are repeated (GQA).
    sinks: per-head logits (axis -3 of q) joining the softmax denominator.
    Rows that see nothing return 0 and lse = -inf; a NaN or +inf visible
    score makes its row NaN (IEEE arithmetic of the formula).
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    if q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = np.repeat(k, rep, axis=-3)
        v = np.repeat(v, rep, axis=-3)
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    S = (q @ np.swapaxes(k, -1, -2)) * scale
    if softcap:
        S = softcap * np.tanh(S / softcap)
    if bias is not None:
        bias = _f64(bias)
        S = np.where(np.isneginf(bias), -np.inf, S + bias)  # -inf masks the pair, even a NaN score
    if mask is not None:
        S = np.where(np.asarray(mask, dtype=bool), S, -np.inf)
    m = S.max(axis=-1, keepdims=True, initial=-np.inf)  # Lk = 0: no key, m = -inf
    if sinks is not None:
        sk = _f64(sinks).reshape(-1, 1, 1)
        m = np.maximum(m, np.broadcast_to(sk, m.shape))
    dead = ~np.isfinite(m) & (m < 0)  # rows with nothing visible (and no sink)
    m_safe = np.where(dead, 0.0, m)
    E = np.exp(S - m_safe)
    l = E.sum(axis=-1, keepdims=True)
    visible_l = l
    if sinks is not None:
        l = l + np.exp(sk - m_safe)
    with np.errstate(invalid="ignore", divide="ignore"):
        # `== 0` rather than `> 0`: a NaN score makes l NaN, and its row NaN (IEEE).
        P = np.where(visible_l == 0, 0.0, E / l)
        O = P @ v
        lse = np.where(l == 0, -np.inf, m_safe + np.log(l))[..., 0]
    if return_lse:
        return O, lse
    return O
