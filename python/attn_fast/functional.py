"""The functional API: scaled_dot_product_attention and the textbook attention().

Layouts: q is (L, d), (H, L, d) or (B, H, L, d); k and v have the same number
of dimensions, with Lk keys and, for grouped-query attention, H_kv heads.
Arrays are read through their strides (no copy); the result is a new
C-contiguous array of q's dtype, or is written into `out`.
"""

from __future__ import annotations

import math

import numpy as np

from . import _core
from ._checks import as_float_array, check_same_dtype, shape_str

__all__ = ["scaled_dot_product_attention", "attention"]

_BACKENDS = ("fused", "reference")


def _to4(x, name):
    if x.ndim == 2:
        return x[None, None]
    if x.ndim == 3:
        return x[None]
    if x.ndim == 4:
        return x
    raise ValueError(f"{name} must have 2, 3 or 4 dimensions ((L, d), (H, L, d) or (B, H, L, d)), got shape {shape_str(x)}")


def _dense_mask_kwargs(attn_mask, B, Hq, Lq, Lk, dtype):
    """Kernel arguments for a dense boolean or additive attn_mask array."""
    m = np.asarray(attn_mask)
    if m.dtype.kind == "f":  # before broadcasting, so a small bias is converted (not B*H copies)
        m = m.astype(dtype, copy=not (m.flags.aligned and m.dtype.isnative))
    if m.ndim > 4 or m.ndim < 1:
        raise ValueError(f"attn_mask must be broadcastable to (B, H, Lq, Lk) = {(B, Hq, Lq, Lk)}, got shape {shape_str(m)}")
    try:
        view = np.broadcast_to(m.reshape((1,) * (4 - m.ndim) + m.shape), (B, Hq, Lq, Lk))
    except ValueError:
        raise ValueError(
            f"attn_mask has shape {shape_str(m)}, not broadcastable to (B, H, Lq, Lk) = {(B, Hq, Lq, Lk)}"
        ) from None
    if m.dtype == np.bool_:
        return {"mask": view.view(np.uint8)}
    if m.dtype.kind == "f":
        return {"bias": view.astype(dtype, copy=False) if view.dtype != dtype else view}
    raise TypeError(f"attn_mask must be a boolean (True = attend) or float (additive) array, got dtype {m.dtype}")


def scaled_dot_product_attention(
    q,
    k,
    v,
    attn_mask=None,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    return_lse=False,
    out=None,
    window_size=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    backend="fused",
    block_q=0,
    block_k=0,
):
    """softmax(scale · q kᵀ + mask) v, exact, computed block by block.

    Parameters
    ----------
    q : (L, d), (H, L, d) or (B, H, L, d) float32/float64 array.
    k : (Lk, d), (H_kv, Lk, d) or (B, H_kv, Lk, d), same dtype and ndim as q.
    v : (Lk, dv), (H_kv, Lk, dv) or (B, H_kv, Lk, dv).
    attn_mask : None, a boolean array (True = attend, torch's convention) or
        an additive float array, broadcastable to (B, H, Lq, Lk); or a mask
        object from ``attn_fast.masks``. Combines with ``is_causal``.
    is_causal : bool. Causal mask aligned bottom-right: query i sees keys
        j <= i + Lk - Lq (FlashAttention and KV-cache convention). torch's
        ``is_causal`` is aligned top-left instead; the two agree when Lq == Lk.
    scale : float, default 1/sqrt(d).
    enable_gqa : allow H_kv < H (H % H_kv == 0); head h reads kv head
        h // (H // H_kv). K and V are not copied or repeated.
    window_size : (left, right) or None. Sliding window: query i sees keys
        j with i' - left <= j <= i' + right, where i' = i + Lk - Lq is the
        query's aligned position; None or -1 on a side means unbounded
        (FlashAttention's convention). Combine with is_causal for Mistral's
        local attention, e.g. window_size=(255, 0).
    softcap : float > 0 or None. Scores become softcap · tanh(score / softcap)
        (after scaling, before masks and biases), as Gemma 2 does.
    alibi_slopes : (H,) array or None. Adds -slope_h · |i' - j| to the scores.
    sinks : (H,) array or None. Per-head "attention sink" logits that join the
        softmax denominator only (gpt-oss style): rows are scaled by
        Σ exp(s) / (Σ exp(s) + exp(sink)).
    return_lse : also return lse = log Σ_j exp(scores), shape q.shape[:-1].
    out : optional writeable array of shape (…, Lq, dv) and q's dtype to
        write the result into (any strides whose elements do not overlap; if
        it shares memory with an input, the result goes through a temporary).
    backend : "fused" (the SIMD kernel) or "reference" (the plain-loop C++
        kernel, slow; for testing).
    block_q, block_k : tile sizes in [0, 4096] (0 = default); results do not
        depend on them beyond float rounding.

    Non-finite inputs follow IEEE arithmetic of the formula: a NaN or +inf
    visible score makes its row NaN; keys a row does not see are never read
    into it (see docs/HARDENING.md).

    Returns
    -------
    out : (…, Lq, dv) array of q's dtype (a new array unless ``out`` given);
        with ``return_lse``, the pair (out, lse). Query rows that see no key
        get zeros and lse = -inf, never NaN.
    """
    q = as_float_array(q, "q")
    k = as_float_array(k, "k")
    v = as_float_array(v, "v")
    check_same_dtype(q=q, k=k, v=v)
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"q, k and v must have the same number of dimensions, got q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}"
        )
    q4, k4, v4 = _to4(q, "q"), _to4(k, "k"), _to4(v, "v")
    B, Hq, Lq, d = q4.shape
    Bk, Hkv, Lk, dk = k4.shape
    Bv, Hv, Lv, dv = v4.shape
    if dk != d:
        raise ValueError(f"k has shape {shape_str(k)} but q has head dim {d}")
    if d == 0:
        raise ValueError(f"q has shape {shape_str(q)}: head dim d must be at least 1")
    if (Bk, Hkv, Lk) != (Bv, Hv, Lv):
        raise ValueError(f"k has shape {shape_str(k)} but v has shape {shape_str(v)}: batch, heads and length must match")
    if Bk != B:
        raise ValueError(f"k has shape {shape_str(k)} but q has shape {shape_str(q)}: batch sizes differ")
    if Hkv != Hq:
        if not enable_gqa:
            raise ValueError(
                f"q has {Hq} heads but k/v have {Hkv}; pass enable_gqa=True for grouped-query attention"
            )
        if Hkv == 0 or Hq % Hkv != 0:
            raise ValueError(f"q has {Hq} heads, not a multiple of k/v's {Hkv} heads")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    else:
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")

    block_q, block_k = _block_size(block_q, "block_q"), _block_size(block_k, "block_k")
    out_shape = q.shape[:-1] + (dv,)
    target = None  # the caller's `out` when the kernel writes into a temporary
    if out is None:
        o = np.empty(out_shape, dtype=q.dtype)
    else:
        o = out if isinstance(out, np.ndarray) else np.asarray(out)
        if o.base is None and not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy.ndarray (or expose its memory), got {type(out).__name__}")
        if o.shape != out_shape:
            raise ValueError(f"out has shape {shape_str(o)}, expected {out_shape}")
        if o.dtype != q.dtype:
            raise TypeError(f"out has dtype {o.dtype}, expected {q.dtype}")
        if not o.flags.writeable:
            raise ValueError("out is read-only")
        if not o.flags.aligned or not o.dtype.isnative:
            raise ValueError("out must be aligned and in native byte order")
        if _self_overlapping(o):
            raise ValueError(f"out has overlapping memory (strides {o.strides} for shape {shape_str(o)})")
        if any(
            isinstance(x, np.ndarray) and np.may_share_memory(o, x)
            for x in (q, k, v, attn_mask, alibi_slopes, sinks)
        ):
            target, o = o, np.empty(out_shape, dtype=q.dtype)  # out aliases an input
    lse = np.empty(q.shape[:-1], dtype=q.dtype) if return_lse else None

    kw = {}
    if attn_mask is not None:
        to_kernel = getattr(attn_mask, "_kernel_kwargs", None)
        if to_kernel is not None:
            kw.update(to_kernel(B=B, H=Hq, Lq=Lq, Lk=Lk, dtype=q.dtype))
        else:
            kw.update(_dense_mask_kwargs(attn_mask, B, Hq, Lq, Lk, q.dtype))
    if window_size is not None:
        try:
            left, right = window_size
        except (TypeError, ValueError):
            raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
        left = -1 if left is None else int(left)
        right = -1 if right is None else int(right)
        if left < -1 or right < -1:
            raise ValueError(f"window_size entries must be >= 0 (or -1/None for unbounded), got {window_size!r}")
        left, right = min(left, 2**62), min(right, 2**62)  # wider than any sequence: same result
        kw["window_left"], kw["window_right"] = left, right
    if softcap is not None:
        softcap = float(softcap)
        if not (softcap > 0 and math.isfinite(softcap)):
            raise ValueError(f"softcap must be a positive finite number, got {softcap}")
        kw["softcap"] = softcap
    for name, val in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if val is not None:
            arr = np.ascontiguousarray(np.asarray(val, dtype=q.dtype).reshape(-1))
            if arr.shape != (Hq,):
                raise ValueError(f"{name} must have one value per query head ({Hq},), got shape {np.shape(val)}")
            kw["alibi" if name == "alibi_slopes" else "sinks"] = arr
    if is_causal:
        if kw.get("causal") and kw.get("top_left"):
            raise ValueError("is_causal=True (bottom-right) conflicts with a top-left Causal mask")
        kw["causal"] = True
    if o.size == 0 and (lse is None or lse.size == 0):  # after every argument is checked
        return (o, lse) if return_lse else o
    _core.forward(
        q4, k4, v4, _to4(o, "out"), lse,
        scale=scale, block_q=block_q, block_k=block_k,
        reference=(backend == "reference"), **kw,
    )
    if target is not None:
        target[...] = o
        o = target
    return (o, lse) if return_lse else o


def _block_size(b, name):
    if isinstance(b, bool) or not hasattr(b, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(b).__name__}")
    b = int(b)
    if not 0 <= b <= 4096:
        raise ValueError(f"{name} must be in [0, 4096] (0 = default), got {b}")
    return b


def _self_overlapping(a):
    """True unless the strides prove that no two elements of `a` share memory.

    Sorted by stride, each axis must step past everything the smaller axes
    span; zero strides (broadcast views) and as_strided tricks fail this.
    """
    if a.size <= 1:
        return False
    extent = a.itemsize
    for stride, n in sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1):
        if stride < extent:
            return True
        extent += stride * (n - 1)
    return False


def attention(X, Wq, Wk, Wv, causal=False):
    """The textbook's single-head attention, fused.

    X : (L, D) or (B, L, D); Wq, Wk : (d, D); Wv : (dv, D), all one float dtype.
    Computes Q = X Wqᵀ, K = X Wkᵀ, V = X Wvᵀ, then softmax(Q Kᵀ / √d) V with a
    causal mask if asked. Returns (L, dv) or (B, L, dv) in X's dtype.
    """
    X = as_float_array(X, "X")
    Wq = as_float_array(Wq, "Wq")
    Wk = as_float_array(Wk, "Wk")
    Wv = as_float_array(Wv, "Wv")
    check_same_dtype(X=X, Wq=Wq, Wk=Wk, Wv=Wv)
    if X.ndim not in (2, 3):
        raise ValueError(f"X must be (L, D) or (B, L, D), got shape {shape_str(X)}")
    D = X.shape[-1]
    for name, W in (("Wq", Wq), ("Wk", Wk), ("Wv", Wv)):
        if W.ndim != 2 or W.shape[1] != D:
            raise ValueError(f"{name} must be (d, D) with D = {D} (X has shape {shape_str(X)}), got shape {shape_str(W)}")
    if Wq.shape[0] != Wk.shape[0]:
        raise ValueError(f"Wq has shape {shape_str(Wq)} but Wk has shape {shape_str(Wk)}: d must match")
    Q, K, V = X @ Wq.T, X @ Wk.T, X @ Wv.T  # (…, L, d): three personas
    # (…, L, d) -> (…, 1, L, d): one head, a view.
    O = scaled_dot_product_attention(Q[..., None, :, :], K[..., None, :, :], V[..., None, :, :], is_causal=causal)
    return O[..., 0, :, :]
