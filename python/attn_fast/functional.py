"""The functional API: scaled_dot_product_attention and the textbook attention().

Layouts: q is (L, d), (H, L, d) or (B, H, L, d); k and v have the same number
of dimensions, with Lk keys and, for grouped-query attention, H_kv heads.
Arrays are read through their strides (no copy); the result is a new
C-contiguous array of q's dtype, or is written into `out`.

Dtypes: float32 and float64, and (scaled_dot_product_attention, attention,
varlen_attention, attention_weights) float16 and bfloat16: torch.float16 /
torch.bfloat16 CPU tensors and NumPy float16 arrays read zero-copy, NumPy
arrays of ``ml_dtypes.bfloat16`` too (ml_dtypes is optional). 16-bit inputs
are widened to fp32 as the kernel packs them, scores, softmax and the
accumulation run in fp32, the output is rounded once to q's dtype; lse is
float32, and float additive masks, ALiBi slopes and sinks are used in float32
(cast from any float dtype). float16 is never rounded to bfloat16 or back.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from . import _core, _dispatch, masks
from ._args import (
    block_size,
    check_backend,
    check_dropout,
    check_varlen,
    half_mask,
    mask_args,
    mask_arrays,
    qkv_names,
    score_args,
    varlen_args,
)
from ._checks import (
    HALF_DTYPES,
    Output,
    alias_safe,
    as_float_array,
    bf16_bits,
    check_bool,
    check_int,
    check_qkv,
    check_same_dtype,
    check_scale,
    compute_dtype,
    fast_view,
    from_float,
    half_result,
    shape_str,
    to4,
    to_float,
    to_input_kind,
)
from ._dispatch import ScoreArgs
from .masks import MaskArgs

__all__ = [
    "scaled_dot_product_attention",
    "attention",
    "attention_weights",
    "varlen_attention",
    "KernelStats",
]


class KernelStats(NamedTuple):
    """What the fused kernel did, for FLOP accounting and tests.

    tiles_computed : (Br x Bc) query-by-key tiles whose scores were computed.

    tiles_skipped : tiles inside the structural key range that a block-sparse
        layout or a dense boolean mask left empty, skipped without computing.

    block_q, block_k : the tile (Br x Bc) the kernel actually used. ``block_q``
        is honoured as asked; ``block_k`` is rounded up to a multiple of the
        active instruction set's key-panel width (for float32: 4 on scalar, 16
        on AVX2, 64 on AVX-512; half that for float64), and both are capped by
        the problem size (and 4096). The defaults (0) pick the kernel's own
        sizes, reported here. Count tiles with these, never with the sizes asked.

    Tiles outside the causal / window / length range are never visited and are
    counted in neither. FLOPs ~= tiles_computed * Br * Bc * 2 * (d + dv).
    The reference backend, and calls with nothing to compute, report
    (0, 0, 0, 0).
    """

    tiles_computed: int
    tiles_skipped: int
    block_q: int = 0
    block_k: int = 0


# Plans of plain calls (no mask object or options; 4-D arrays; out= or not): the
# key holds everything the checked path's acceptance and choices depended on (each
# array's kind, shape and strides via _checks.fast_view, is_causal, enable_gqa,
# scale), the plan what it decided (the kernel call bound to its mask record, checked
# scale, output shape and dtype). A call with a known key runs the same kernel call
# without the checks (out's writeability and its overlap with the inputs are still
# looked at, as they depend on more than the key); the first call of a key takes the
# checked path, so bad input raises there as before. A call without out= runs its plan
# in C (_core.run_plan: the same key, views and result; tensors read without
# Tensor.numpy()); _plain_key and _run_plan serve calls with out=.
_PLANS: dict = {}
_MAX_PLANS = 256


def _plain_key(
    q: Any, k: Any, v: Any, out: Any, is_causal: bool, enable_gqa: bool, scale: Any
) -> Any:
    """(key, views) of a plain call, or None when an array is not a fast-path kind.

    The key: ``_core.plan_key``'s bytes of the flags, the scale and each array's dtype,
    shape and strides. NumPy arrays are their own views; other inputs (torch tensors) are
    read by _checks.fast_view and their key starts with b"t" (a plan serves one kind of
    input: its result goes back to that kind)."""
    key = _core.plan_key(q, k, v, out, is_causal, enable_gqa, scale)
    if key is not None:
        return key, ((q, k, v) if out is None else (q, k, v, out))
    fq, fk, fv = fast_view(q), fast_view(k), fast_view(v)
    fo = None if out is None else fast_view(out)
    if fq is None or fk is None or fv is None or (out is not None and fo is None):
        return None
    views = (fq[0], fk[0], fv[0]) if fo is None else (fq[0], fk[0], fv[0], fo[0])
    # bits16: fast_view reads a bfloat16 tensor as its uint16 bits
    o = None if fo is None else fo[0]
    key = _core.plan_key(fq[0], fk[0], fv[0], o, is_causal, enable_gqa, scale, True)
    return None if key is None else (b"t" + key, views)


def _store_plan(plan_key: Any, plan: tuple) -> None:
    """Store a plan under its key; a one-row decode plan also under _core.lk_free_key's,
    which run_plan looks up when the exact key has no plan: a decode step whose cache grew
    by a token (another Lk, other k / v strides) then runs without the checks."""
    if len(_PLANS) >= _MAX_PLANS - 1:
        _PLANS.clear()  # bounded: a workload of many shapes rebuilds its plans
    _PLANS[plan_key[0]] = plan
    if type(plan[0]) is _core.BoundDecode:
        free = _core.lk_free_key(plan_key[0])
        if free is not None:
            _PLANS[free] = plan


def _run_plan(plan: tuple, plan_key: Any, like: Any, out: Any, scale: float | None) -> Any:
    """The kernel call a checked call of the same key made, on this call's arrays; None when
    `out` is read-only (the checked path raises)."""
    run, checked_scale, shape, dtype = plan
    scale = checked_scale if scale is None else scale
    views = plan_key[1]
    q, k, v = views[:3]
    target = None
    if out is None:
        o = np.empty(shape, dtype=dtype)
    else:
        if not views[3].flags.writeable:
            return None
        o, target = alias_safe(views[3], q, k, v)
    if o.size:
        run(q, k, v, o, scale)
    if out is None:  # a NumPy input's result is its own kind (to_input_kind's first case)
        return o if type(like) is np.ndarray else to_input_kind(o, like)
    if target is not None:
        target[...] = o
    return out


def scaled_dot_product_attention(
    q: ArrayLike | None = None,
    k: ArrayLike | None = None,
    v: ArrayLike | None = None,
    attn_mask: masks.Mask | ArrayLike | list | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    query: ArrayLike | None = None,
    key: ArrayLike | None = None,
    value: ArrayLike | None = None,
    return_lse: bool = False,
    return_weights: bool = False,
    return_stats: bool = False,
    out: ArrayLike | None = None,
    window_size: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    backend: str = "fused",
    block_q: int = 0,
    block_k: int = 0,
) -> Any:
    """softmax(scale · q kᵀ + mask) v, exact, computed block by block.

    The positional order is torch's: ``(query, key, value, attn_mask=None,
    dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)``; everything
    after it is keyword-only. q, k, v may also be passed as ``query=``,
    ``key=``, ``value=``.

    Parameters
    ----------
    q : (L, d), (H, L, d) or (B, H, L, d) float32/float64/float16/bfloat16
        array: NumPy (bfloat16 as ``ml_dtypes.bfloat16``), a CPU torch
        tensor, or anything exposing the buffer protocol,
        ``__array_interface__`` or DLPack on the CPU; read in place through its
        strides, never copied (GPU memory raises TypeError). 16-bit inputs
        compute in fp32 (see the module docstring).
    k : (Lk, d), (H_kv, Lk, d) or (B, H_kv, Lk, d), same dtype and ndim as q.
        Lk may differ from Lq either way (cross-attention).
    v : (Lk, dv), (H_kv, Lk, dv) or (B, H_kv, Lk, dv); dv may differ from d.
    attn_mask : None; a boolean array (True = attend, torch's convention) or
        an additive float array, broadcastable to (B, H, Lq, Lk) and read tile
        by tile (tiles that are all False are skipped); a mask object from
        ``attn_fast.masks`` (``Causal``, ``SlidingWindow``, ``Padding``,
        ``BlockSparse``, ``Dense``, combined with ``&``); or a list of these
        and arrays, meaning their intersection. Combines with ``is_causal``
        and ``window_size`` (torch refuses attn_mask with is_causal; here they
        intersect, which is what a padded decoder batch needs).
    dropout_p : must be 0 (accepted for torch's positional order; any other
        value raises ValueError: attn_fast computes exact attention).
    is_causal : bool (a NumPy bool is fine; anything else is a TypeError).
        Causal mask aligned bottom-right: query i sees keys
        j <= i + Lk - Lq (FlashAttention and KV-cache convention). torch's
        ``is_causal`` is aligned top-left instead (``masks.Causal("top_left")``);
        the two agree when Lq == Lk.
    scale : float, default 1/sqrt(d).
    enable_gqa : bool; allow H_kv < H (H % H_kv == 0); head h reads kv head
        h // (H // H_kv), torch's order. K and V are not copied or repeated.
    window_size : (left, right) or None. Sliding window: query i sees keys
        j with i' - left <= j <= i' + right, where i' = i + Lk - Lq is the
        query's aligned position; None or -1 on a side means unbounded
        (FlashAttention's convention). Combine with is_causal for Mistral's
        local attention, e.g. window_size=(255, 0). Same as
        ``masks.SlidingWindow(left, right)``.
    softcap : float > 0 or None. Scores become softcap · tanh(score / softcap)
        (after scaling, before masks and biases), as Gemma 2 does.
    alibi_slopes : (H,) array or None. Adds -slope_h · ``|i' - j|`` to the scores.
    sinks : (H,) array or None. Per-head "attention sink" logits that join the
        softmax denominator only (gpt-oss style): rows are scaled by
        Σ exp(s) / (Σ exp(s) + exp(sink)). A row that sees no key then puts
        all its weight on the sink: O = 0 and lse = sink.
    return_lse : also return lse = log Σ_j exp(scores), shape q.shape[:-1].
    return_weights : also return the attention weights P, shape
        q.shape[:-1] + (Lk,), computed by ``attention_weights`` (float64
        NumPy; raises above its size limit).
    return_stats : also return a ``KernelStats`` (tiles computed / skipped).
    out : optional writeable array of shape (…, Lq, dv) and q's dtype to
        write the result into: a NumPy array or a CPU torch tensor (any
        strides, e.g. a (B, Lq, H, dv) buffer passed as its (B, H, Lq, dv)
        transpose); it is written in place and returned as is.
    backend : "fused" (the SIMD kernels; short query chunks, Lq <= 4, against
        Lk >= 64 keys go to the split-KV decode kernel when only causal /
        window / length masks are used and no stats are asked for; float16 /
        bfloat16 too, read as stored and accumulated in float32), "decode"
        (force the split-KV decode kernel; any of the four dtypes) or
        "reference" (the plain-loop C++ kernel, slow; for testing).
    block_q, block_k : tile sizes in [0, 4096] (0 = default); results do not
        depend on them beyond float rounding. ``block_k`` is rounded up to the
        active path's key-panel width; ``return_stats`` reports the sizes used
        (``KernelStats.block_q``, ``.block_k``).

    Non-finite inputs follow IEEE arithmetic of the formula: a NaN or +inf
    visible score makes its row NaN; keys a row does not see are never read
    into it (see docs/HARDENING.md). An ``out`` that shares memory with an
    input is filled through a temporary; one whose elements overlap raises.
    The result is finite when |v| * Lk stays below q's dtype's largest value
    (the unnormalised accumulator); ``scale`` must be finite in q's dtype.

    Ctrl-C (SIGINT, on the main thread) stops a long call within a few tens
    of milliseconds with KeyboardInterrupt: the kernel's threads are joined
    and no new array is returned, but a caller's ``out`` may be partly
    written.

    Returns
    -------
    out : (…, Lq, dv) array of q's dtype (a new array unless ``out`` given;
        for bfloat16 NumPy input an ``ml_dtypes.bfloat16`` array when
        ml_dtypes is importable, else its uint16 bits). lse is float32 for
        16-bit q. The kind follows q: NumPy arrays for NumPy (or other
        array-like) input, torch tensors sharing the result's memory
        (zero-copy) for a torch tensor q; lse and weights likewise; a given
        ``out`` is returned as the caller's own object. With any of
        return_lse / return_weights / return_stats, a tuple (out, lse,
        weights, stats) holding only the ones asked for, in that order.
        Query rows that see no key (for any mask kind) get zeros and
        lse = -inf, never NaN; a NaN or inf in a masked-out K/V row never
        reaches the output.
    """
    plan_key = None
    if (
        attn_mask is None
        and query is None
        and key is None
        and value is None
        and type(dropout_p) is float
        and dropout_p == 0.0
        and type(is_causal) is bool
        and type(enable_gqa) is bool
        and (scale is None or type(scale) is float)
        and return_lse is False
        and return_weights is False
        and return_stats is False
        and window_size is None
        and softcap is None
        and alibi_slopes is None
        and sinks is None
        and backend == "fused"
        and block_q == 0
        and block_k == 0
    ):
        if out is None:  # the planned call in C
            res = _core.run_plan(_PLANS, q, k, v, is_causal, enable_gqa, scale)
            if res is not None:
                return res
        plan_key = _plain_key(q, k, v, out, is_causal, enable_gqa, scale)
        plan = _PLANS.get(plan_key[0]) if plan_key is not None else None
        if plan is not None:
            res = _run_plan(plan, plan_key, q, out, scale)
            if res is not None:
                return res
    q, k, v = qkv_names(q, k, v, query, key, value)
    check_dropout(dropout_p)
    is_causal, enable_gqa = check_bool(is_causal, "is_causal"), check_bool(enable_gqa, "enable_gqa")
    return_lse = check_bool(return_lse, "return_lse")
    return_weights = check_bool(return_weights, "return_weights")
    return_stats = check_bool(return_stats, "return_stats")
    like = q
    q, k, v, q4, k4, v4, (B, Hq, Hkv, Lq, Lk, d, dv) = check_qkv(
        q, k, v, half=True, enable_gqa=enable_gqa
    )
    scale = check_scale(scale, d, q4.dtype)
    check_backend(backend)

    half = q.dtype in HALF_DTYPES
    cdt = compute_dtype(q.dtype)  # lse, biases, slopes, sinks
    if half:
        attn_mask = half_mask(attn_mask)
    block_q, block_k = block_size(block_q, "block_q"), block_size(block_k, "block_k")
    reads = (q, k, v, *mask_arrays(attn_mask), alibi_slopes, sinks)
    res = Output.prepare(out, q.shape[:-1] + (dv,), q.dtype, like, reads)
    lse = np.empty(q.shape[:-1], dtype=cdt) if return_lse else None

    mask = mask_args(attn_mask, is_causal, window_size, B, Hq, Lq, Lk, cdt)
    score = score_args(Hq, cdt, softcap, alibi_slopes, sinks)
    kernel = _dispatch.choose_kernel(
        Lq=Lq,
        Lk=Lk,
        mask=mask,
        score=score,
        backend=backend,
        same_batch=B == k4.shape[0],
        block_sizes=(block_q, block_k),
        stats=return_stats,
    )
    if plan_key is not None and q.ndim == 4:
        run = _dispatch.bound(kernel, mask)
        _store_plan(plan_key, (run, scale, res.array.shape, res.array.dtype))
    stats = KernelStats(0, 0, 0, 0)
    if res.array.size or (lse is not None and lse.size):
        stats = KernelStats(
            *_dispatch.attend(
                kernel,
                q4,
                k4,
                v4,
                to4(res.array, "out"),
                lse,
                scale=scale,
                mask=mask,
                score=score,
                block_q=block_q,
                block_k=block_k,
            )
        )
    extra = []
    if return_lse:
        extra.append(lse)
    if return_weights:
        w = _weights(q4, k4, mask, score, scale, max_elements=_MAX_WEIGHTS, force=False)
        extra.append(half_result(from_float(w, q.dtype).reshape(q.shape[:-1] + (Lk,))))
    if return_stats:
        extra.append(stats)
    return res.result(*extra)


# ---------------------------------------------------------------- weights

_MAX_WEIGHTS = 1 << 22


def _weights(
    q4: np.ndarray,
    k4: np.ndarray,
    mask: MaskArgs,
    score: ScoreArgs,
    scale: float,
    max_elements: int,
    force: bool,
) -> np.ndarray:
    """P in float64 (B, Hq, Lq, Lk) for q4 (B, Hq, Lq, d) and k4 (B, Hkv, Lk, d),
    following attention.h's rules (the same records the kernel reads)."""
    (B, Hq, Lq, d), Lk = q4.shape, k4.shape[2]
    n = B * Hq * Lq * Lk
    if n > max_elements and not force:
        raise ValueError(
            f"the attention weights would have B*H*Lq*Lk = {B}*{Hq}*{Lq}*{Lk} = {n} elements, "
            "above "
            f"max_elements = {max_elements}; pass force=True (or a larger max_elements) to build "
            "them anyway"
        )
    Hkv = k4.shape[1]
    g = Hq // Hkv
    qf = to_float(q4).reshape(B, Hkv, g, Lq, d)
    kf = to_float(k4)
    S = np.einsum("bhgid,bhjd->bhgij", qf, kf).reshape(B, Hq, Lq, Lk) * scale
    if score.softcap:
        c = score.softcap
        S = c * np.tanh(S / c)
    if score.alibi is not None:
        q_len = np.asarray(np.full(B, Lq) if mask.q_lens is None else mask.q_lens)
        k_len = np.asarray(np.full(B, Lk) if mask.kv_lens is None else mask.kv_lens)
        q_len, k_len = q_len.reshape(B, 1, 1, 1), k_len.reshape(B, 1, 1, 1)
        off = 0 if mask.top_left else k_len - q_len
        dist = np.abs(np.arange(Lq).reshape(1, 1, Lq, 1) + off - np.arange(Lk).reshape(1, 1, 1, Lk))
        S = S - score.alibi.astype(np.float64).reshape(1, Hq, 1, 1) * dist
    if mask.bias is not None:
        S = S + mask.bias.astype(np.float64)
    vis = masks.visibility(mask, B, Hq, Lq, Lk)
    S = np.where(vis, S, -np.inf)
    m = S.max(axis=-1, keepdims=True) if Lk else np.full((B, Hq, Lq, 1), -np.inf)
    sink = None
    if score.sinks is not None:
        sink = np.broadcast_to(score.sinks.astype(np.float64).reshape(1, Hq, 1, 1), m.shape)
        m = np.maximum(m, np.where(np.any(vis, axis=-1, keepdims=True), sink, -np.inf))
    dead = np.isneginf(m)
    m = np.where(dead, 0.0, m)
    E = np.exp(S - m)
    den = E.sum(axis=-1, keepdims=True)
    if sink is not None:
        den = den + np.where(dead, 0.0, np.exp(sink - m))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, E / den, 0.0)


def attention_weights(
    q: ArrayLike,
    k: ArrayLike,
    attn_mask: masks.Mask | ArrayLike | list | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    window_size: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    max_elements: int = _MAX_WEIGHTS,
    force: bool = False,
) -> Any:
    """The attention weights P = softmax(scale · q kᵀ + mask), materialised.

    For teaching, plots and debugging on small inputs: this builds the whole
    (…, Lq, Lk) matrix (in float64 NumPy, not the fused kernel), which the
    fused kernel never does. Arguments mean exactly what they mean in
    ``scaled_dot_product_attention`` (q, k shapes, attn_mask objects and
    arrays, is_causal bottom-right, GQA, window, softcap, ALiBi, sinks), so
    ``attention_weights(q, k, ...) @ v`` equals ``sdpa(q, k, v, ...)`` up to
    rounding (for GQA, with v's heads repeated).

    Returns (…, Lq, Lk) of q's dtype (q.shape[:-1] + (Lk,)). Rows that see no
    key are all zeros; with sinks, rows sum to less than 1 (the sink's share).
    Raises ValueError if B·H·Lq·Lk > max_elements (default 2**22) unless
    force=True.
    """
    like = q
    is_causal, enable_gqa = check_bool(is_causal, "is_causal"), check_bool(enable_gqa, "enable_gqa")
    q, _, _, q4, k4, _, (B, Hq, Hkv, Lq, Lk, d, dv) = check_qkv(
        q, k, None, half=True, enable_gqa=enable_gqa
    )
    scale = check_scale(scale, d, q.dtype)
    cdt = compute_dtype(q.dtype)
    if q.dtype in HALF_DTYPES:
        attn_mask = half_mask(attn_mask)
    mask = mask_args(attn_mask, is_causal, window_size, B, Hq, Lq, Lk, cdt)
    score = score_args(Hq, cdt, softcap, alibi_slopes, sinks)
    P = _weights(
        q4, k4, mask, score, scale, check_int(max_elements, "max_elements", 0), bool(force)
    )
    return to_input_kind(from_float(P, q.dtype).reshape(q.shape[:-1] + (Lk,)), like)


def varlen_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    window_size: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_lse: bool = False,
    return_stats: bool = False,
    out: ArrayLike | None = None,
    backend: str = "fused",
    block_q: int = 0,
    block_k: int = 0,
) -> Any:
    """Attention over a packed batch of variable-length sequences (no padding).

    FlashAttention's ``flash_attn_varlen_func`` convention: the sequences are
    concatenated along the length axis, and sequence s occupies query rows
    cu_seqlens_q[s]:cu_seqlens_q[s+1] and key rows cu_seqlens_k[s]:cu_seqlens_k[s+1].
    Each sequence attends only within itself; ``causal`` and ``window_size``
    apply per sequence, aligned bottom-right (its last query sees its last key).

    q : (total_q, H, d) float32/float64/float16/bfloat16 (as in
        ``scaled_dot_product_attention``);  k : (total_k, H_kv, d);  v : (total_k, H_kv, dv).
        H % H_kv == 0 (grouped-query heads are always allowed here). Any strides.

    cu_seqlens_q, cu_seqlens_k : (num_seqs + 1,) integers, starting at 0,
        non-decreasing (empty sequences allowed), ending at total_q / total_k.

    max_seqlen_q, max_seqlen_k : accepted for FlashAttention compatibility;
        if given, must be >= the longest sequence.

    causal, window_size, scale, softcap, alibi_slopes, sinks, backend,
    block_q, block_k : as in ``scaled_dot_product_attention`` (per sequence).

    Returns out (total_q, H, dv) in q's dtype (or ``out``); with return_lse /
    return_stats a tuple (out, lse, stats) of those asked for, lse of shape
    (H, total_q) as in FlashAttention. Rows that see no key: zeros, lse -inf.
    A torch tensor q gives torch tensors back (zero-copy), as
    ``scaled_dot_product_attention`` does.
    """
    causal = check_bool(causal, "causal")
    return_lse, return_stats = (
        check_bool(return_lse, "return_lse"),
        check_bool(return_stats, "return_stats"),
    )
    like = q
    q, k, v, cu_q, cu_k = check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, half=True
    )
    (Tq, Hq, d), dv = q.shape, v.shape[2]
    scale = check_scale(scale, d, q.dtype)
    check_backend(backend)
    if backend == "decode":
        raise ValueError("varlen_attention supports backend='fused' or 'reference', not 'decode'")

    block_q, block_k = block_size(block_q, "block_q"), block_size(block_k, "block_k")
    res = Output.prepare(out, (Tq, Hq, dv), q.dtype, like, (q, k, v, alibi_slopes, sinks))
    o = res.array
    cdt = compute_dtype(q.dtype)  # lse, slopes, sinks: float32 for 16-bit q
    lse = np.empty((Hq, Tq), dtype=cdt) if return_lse else None
    mask = varlen_args(causal, window_size)
    score = score_args(Hq, cdt, softcap, alibi_slopes, sinks)
    kernel = _dispatch.choose_kernel(
        Lq=Tq, Lk=k.shape[0], mask=mask, score=score, backend=backend, packed=True
    )
    stats = KernelStats(0, 0, 0, 0)
    if cu_q.size > 1 and (o.size or (lse is not None and lse.size)):
        # (total, H, d) -> (1, H, total, d): views, the kernel reads the strides.
        stats = KernelStats(
            *_dispatch.attend(
                kernel,
                q.transpose(1, 0, 2)[None],
                k.transpose(1, 0, 2)[None],
                v.transpose(1, 0, 2)[None],
                o.transpose(1, 0, 2)[None],
                lse,
                cu_q=cu_q,
                cu_k=cu_k,
                scale=scale,
                mask=mask,
                score=score,
                block_q=block_q,
                block_k=block_k,
            )
        )
    elif o.size:
        o[...] = 0
        if lse is not None:
            lse[...] = -np.inf
    return res.result(*[x for x, want in ((lse, return_lse), (stats, return_stats)) if want])


def check_textbook_args(
    X: ArrayLike, Wq: ArrayLike, Wk: ArrayLike, Wv: ArrayLike
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Read and check the textbook's arguments: X (L, D) or (B, L, D), Wq and
    Wk (d, D), Wv (dv, D), one float dtype. Returns them as NumPy arrays."""
    X = as_float_array(X, "X", half=True)
    Wq = as_float_array(Wq, "Wq", half=True)
    Wk = as_float_array(Wk, "Wk", half=True)
    Wv = as_float_array(Wv, "Wv", half=True)
    check_same_dtype(X=X, Wq=Wq, Wk=Wk, Wv=Wv)
    if X.ndim not in (2, 3):
        raise ValueError(f"X must be (L, D) or (B, L, D), got shape {shape_str(X)}")
    D = X.shape[-1]
    for name, W in (("Wq", Wq), ("Wk", Wk), ("Wv", Wv)):
        if W.ndim != 2 or W.shape[1] != D:
            raise ValueError(
                f"{name} must be (d, D) with D = {D} (X has shape {shape_str(X)}), got shape "
                f"{shape_str(W)}"
            )
    if Wq.shape[0] != Wk.shape[0]:
        raise ValueError(
            f"Wq has shape {shape_str(Wq)} but Wk has shape {shape_str(Wk)}: d must match"
        )
    return X, Wq, Wk, Wv


def attention(
    X: ArrayLike, Wq: ArrayLike, Wk: ArrayLike, Wv: ArrayLike, causal: bool = False
) -> Any:
    """The textbook's single-head attention, fused.

    X : (L, D) or (B, L, D); Wq, Wk : (d, D); Wv : (dv, D), all one float dtype.
    Computes Q = X Wqᵀ, K = X Wkᵀ, V = X Wvᵀ, then softmax(Q Kᵀ / √d) V with a
    causal mask if asked. Returns (L, dv) or (B, L, dv) in X's dtype: a NumPy
    array, or a torch tensor (zero-copy) when X is one. For float16 /
    bfloat16 the projections are computed in float32 and rounded to X's
    dtype (as a 16-bit matmul would), the attention as in
    ``scaled_dot_product_attention``.
    """
    like = X
    causal = check_bool(causal, "causal")
    X, Wq, Wk, Wv = check_textbook_args(X, Wq, Wk, Wv)
    if X.dtype in HALF_DTYPES:
        Xf, dt = to_float(X, np.float32), X.dtype
        Q, K, V = (from_float(Xf @ to_float(W, np.float32).T, dt) for W in (Wq, Wk, Wv))
        if dt not in (np.float16,):
            Q, K, V = bf16_bits(Q), bf16_bits(K), bf16_bits(V)
    else:
        Q, K, V = X @ Wq.T, X @ Wk.T, X @ Wv.T  # (…, L, d): three personas
    # (…, L, d) -> (…, 1, L, d): one head, a view.
    O = scaled_dot_product_attention(
        Q[..., None, :, :], K[..., None, :, :], V[..., None, :, :], is_causal=causal
    )
    return to_input_kind(np.ascontiguousarray(O[..., 0, :, :]), like)
