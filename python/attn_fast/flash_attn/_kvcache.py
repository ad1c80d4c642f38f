"""flash_attn_with_kvcache: the new k / v appended in place, rotary, then attention to the cache."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from .. import _dispatch
from .._args import score_args as _score_args
from ._common import (
    Opts,
    alibi_split,
    call,
    check_alibi,
    check_heads,
    check_tensor,
    cu_array,
    define_op,
    lse_dtype,
    mask_args,
    no_lse,
    np4,
    paged_attend,
    same_dtype,
)
from .rotary import rotate

# ---------------------------------------------------------------- KV cache


def _seqlens(x: Any, B: int, name: str, upper: int) -> np.ndarray:
    """x (an int, or an int tensor / array of shape (B,)) as a new (B,) int64 array whose
    values lie in [0, upper]. (The bounds are read through a list: two NumPy reductions
    cost more than a decode step's kernel on a short cache.)"""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            raise TypeError(f"{name} must be an int or an int32 tensor, got {x.dtype}")
        x = x.numpy() if x.is_cpu else x.cpu().numpy()  # an int tensor never requires grad
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an int or an int32 tensor of shape ({B},), got {a.dtype}")
    if a.ndim == 0:
        vals = [int(a)] * B
        a = np.array(vals, dtype=np.int64)
    else:
        if a.shape != (B,):
            raise ValueError(f"{name} must be an int or shape ({B},), got shape {a.shape}")
        a = a.astype(np.int64)
        vals = a.tolist()
    if vals and (min(vals) < 0 or max(vals) > upper):
        raise ValueError(
            f"{name} must lie in [0, {upper}], got values in [{min(vals)}, {max(vals)}]"
        )
    return a


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """flash-attn's ``flash_attn_with_kvcache``: decoding against a KV cache (no backward).

    Parameters
    ----------
    q : (B, Lq, H, d); Lq >= 1 query tokens per sequence (decode, chunked
        prefill, speculative verification of Lq drafts).
    k_cache, v_cache : (B_cache, L_cache, H_kv, d) / (.., dv), or with
        block_table a paged pool (num_blocks, page_block_size, H_kv, d / dv),
        any page size. Read in place, never copied.
    k, v : (B, L_new, H_kv, d / dv) or None
        Written **in place** into the cache at positions cache_seqlens[b] ..
        cache_seqlens[b] + L_new - 1 (after rotary on k), then attended with
        the rest.
    rotary_cos, rotary_sin : (L_ro, r / 2) or None
        Needs k, v. The new k is rotated at its positions cache_seqlens[b] + i; q too, at the same
        positions when causal or windowed, else all at cache_seqlens[b].
    rotary_interleaved : rotate pairs (0, 1), (2, 3) ... instead of (0, r/2) ...
    cache_seqlens : int or (B,) int32
        Keys already in the cache per sequence;
        None = the whole cache (L_cache). Sequence b attends to its first
        cache_seqlens[b] + L_new keys.
    cache_batch_idx : (B,) int32 or None
        The cache row of each sequence.
    cache_leftpad : (B,) int32 or None
        Sequence b's keys start at this slot (earlier slots are padding).
    block_table : (B, max_blocks) int32 or None
        The blocks of each sequence in order.
    softmax_scale : default 1 / sqrt(d).
    causal, window_size : aligned bottom-right on each sequence's keys.
    softcap, alibi_slopes : as in ``flash_attn_func``
        alibi_slopes (H,) or (B, H). With block_table: one tiled-kernel call per run
        of consecutive blocks, merged by lse (the pages are read in place).
    num_splits : accepted; the split-KV decode kernel sizes its own splits.
    return_softmax_lse : also return lse (B, H, Lq) float32.

    Returns
    -------
    out (B, Lq, H, dv) (a new tensor of q's dtype), or (out, lse).
    Rows that see no key: 0 (lse -inf). Not differentiable (as in flash-attn).
    """
    check_tensor(q, "q", 4, "(batch_size, seqlen, nheads, headdim)")
    what = (
        "(num_blocks, page_block_size, nheads_k, headdim)"
        if block_table is not None
        else "(batch_size_cache, seqlen_cache, nheads_k, headdim)"
    )
    check_tensor(k_cache, "k_cache", 4, what)
    check_tensor(v_cache, "v_cache", 4, what)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or neither)")
    if k is not None:
        check_tensor(k, "k", 4, "(batch_size, seqlen_new, nheads_k, headdim)")
        check_tensor(v, "v", 4, "(batch_size, seqlen_new, nheads_k, headdim)")
    if isinstance(num_splits, bool) or int(num_splits) < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    B, _, H, d = q.shape
    opts = Opts.of(d, softmax_scale, causal, window_size, softcap)
    alibi = check_alibi(alibi_slopes, B, H)
    ints = (cache_seqlens, cache_batch_idx, cache_leftpad, block_table)
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, *ints, *opts.op_args())
    tensors = (*args[:7], alibi, *[x for x in ints if isinstance(x, torch.Tensor)])
    out, lse = call(
        _kvcache_op,
        _with_kvcache,
        tensors,
        *args,
        bool(rotary_interleaved),
        alibi,
        bool(return_softmax_lse),
        to_op=_int_tensors,
    )
    return (out, lse) if return_softmax_lse else out


def _int_tensors(args: tuple) -> tuple:
    """cache_seqlens, cache_batch_idx, cache_leftpad, block_table (args 7 to 10) given as
    ints or int sequences, as the tensors the op takes (values are checked inside it)."""
    return tuple(
        torch.as_tensor(a)
        if 7 <= i <= 10 and a is not None and not isinstance(a, torch.Tensor)
        else a
        for i, a in enumerate(args)
    )


def _with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor],  # noqa: UP045 (custom_op reads the annotations at run time)
    v: Optional[torch.Tensor],  # noqa: UP045
    rotary_cos: Optional[torch.Tensor],  # noqa: UP045
    rotary_sin: Optional[torch.Tensor],  # noqa: UP045
    cache_seqlens: Optional[torch.Tensor],  # noqa: UP045
    cache_batch_idx: Optional[torch.Tensor],  # noqa: UP045
    cache_leftpad: Optional[torch.Tensor],  # noqa: UP045
    block_table: Optional[torch.Tensor],  # noqa: UP045
    scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    alibi_slopes: Optional[torch.Tensor],  # noqa: UP045
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The body of ``flash_attn_with_kvcache`` (and of the op attn_fast::flash_attn_with_kvcache,
    which mutates k_cache and v_cache): the checks that read values, the append, the kernel.
    Returns (out, lse), lse None unless return_lse. The int arguments may also be ints
    or int sequences here (the direct call)."""

    paged = block_table is not None
    same_dtype(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    B, Lq, H, d = q.shape
    Hkv = k_cache.shape[2]
    check_heads(H, Hkv, d, k_cache.shape[3], tuple(v_cache.shape), tuple(k_cache.shape))
    opts = Opts.from_op(scale, causal, window_left, window_right, softcap)
    shared, rows = alibi_split(alibi_slopes)
    if paged:
        if cache_batch_idx is not None or cache_leftpad is not None:
            raise ValueError(
                "block_table cannot be combined with cache_batch_idx or cache_leftpad "
                "(as in flash-attn): the block table already says where each sequence lives"
            )
        table = cu_array(block_table, "block_table")
        L_cache = (table.shape[1] if table.ndim == 2 else 0) * k_cache.shape[1]
    else:
        table = None
        L_cache = k_cache.shape[1]
    if not paged and v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"k_cache has shape {tuple(k_cache.shape)} but v_cache {tuple(v_cache.shape)}"
        )
    if paged and (table.ndim != 2 or table.shape[0] != B):
        raise ValueError(
            f"block_table must be ({B}, max_num_blocks_per_seq), got {tuple(table.shape)}"
        )
    L_new = 0 if k is None else _check_new_kv(k, v, B, Hkv, d, v_cache, cache_seqlens)
    if cache_seqlens is None:
        seqlens = np.full(B, L_cache, dtype=np.int64)
    else:
        seqlens = _seqlens(cache_seqlens, B, "cache_seqlens", L_cache - L_new)
    bidx = None
    if cache_batch_idx is not None:
        bidx = _seqlens(cache_batch_idx, B, "cache_batch_idx", k_cache.shape[0] - 1)
    elif not paged and k_cache.shape[0] < B:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences but q has batch {B}")
    leftpad = None
    if cache_leftpad is not None:
        leftpad = _seqlens(cache_leftpad, B, "cache_leftpad", L_cache)
    seqlen_k = seqlens + L_new
    if leftpad is not None and (leftpad > np.maximum(seqlens, seqlen_k)).any():
        raise ValueError(
            f"cache_leftpad {leftpad.tolist()} exceeds cache_seqlens {seqlens.tolist()}"
        )

    if rotary_cos is not None or rotary_sin is not None:
        q, k = _rotate_new(q, k, rotary_cos, rotary_sin, rotary_interleaved, seqlens, opts)

    kc, vc = np4(k_cache, "k_cache"), np4(v_cache, "v_cache")
    if k is not None and L_new:  # the in-place append: only the new rows are written
        _append(kc, np4(k, "k"), seqlens, bidx, table)
        _append(vc, np4(v, "v"), seqlens, bidx, table)

    dv = v_cache.shape[3]
    out = q.new_empty((B, Lq, H, dv))
    lse_np = (
        np.empty((B, H, Lq), dtype=np.float64 if q.dtype == torch.float64 else np.float32)
        if return_lse
        else None
    )
    plain = opts.softcap is None and shared is None and rows is None
    kv_lens = seqlen_k - (0 if leftpad is None else leftpad)
    if B and Lq:
        if paged:
            mask = mask_args(opts, kv_lens=kv_lens)
            paged_attend(q, out, lse_np, k_cache, v_cache, table, opts, mask, shared, rows)
        else:
            _cache_attend(q, out, lse_np, kc, vc, opts, shared, rows, plain, bidx, leftpad, kv_lens)
    elif lse_np is not None:
        lse_np[...] = -np.inf
    return out, (None if lse_np is None else torch.from_numpy(lse_np))


_kvcache_op = define_op("flash_attn_with_kvcache", _with_kvcache, ("k_cache", "v_cache"))


@_kvcache_op.register_fake
def _(q, k_cache, v_cache, *args):
    B, Lq, H, _ = q.shape
    lse = q.new_empty((B, H, Lq), dtype=lse_dtype(q.dtype)) if args[-1] else no_lse(q)
    return q.new_empty((B, Lq, H, v_cache.shape[-1])), lse


def _check_new_kv(k, v, B: int, Hkv: int, d: int, v_cache, cache_seqlens) -> int:
    """The new k (B, L_new, H_kv, d) and v (B, L_new, H_kv, dv) against q and the cache;
    returns L_new."""
    L_new = k.shape[1]
    if k.shape[:3] != (B, L_new, Hkv) or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"k and v must be ({B}, seqlen_new, {Hkv}, d/dv) to match q and the cache, got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if v.shape[3] != v_cache.shape[3]:
        raise ValueError(f"v has head dim {v.shape[3]} but v_cache has {v_cache.shape[3]}")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required when k and v are appended to the cache")
    return L_new


def _rotate_new(q, k, rotary_cos, rotary_sin, interleaved: bool, seqlens, opts):
    """flash-attn's rotary on the new k (positions seqlens + 0..L_new-1) and on q (the same
    positions when causal or windowed, else every query at position seqlens); new tensors."""
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError("rotary_cos / rotary_sin apply to the appended k: pass k and v too")
    B, Lq = q.shape[:2]
    start = torch.from_numpy(seqlens).reshape(B, 1)
    k = rotate(k.detach(), rotary_cos, rotary_sin, start + torch.arange(k.shape[1]), interleaved)
    if opts.causal or opts.window is not None:
        pos_q = start + torch.arange(Lq)
    else:
        pos_q = start.expand(B, Lq)
    return rotate(q.detach(), rotary_cos, rotary_sin, pos_q, interleaved), k


def _append(cache: np.ndarray, x: np.ndarray, starts, bidx, table) -> None:
    """cache keys starts[b] .. starts[b] + L_new - 1 of sequence b = x[b], in place, on the
    (B_cache, H_kv, L_cache, d) NumPy views of the tensors (np4; the paged pool's
    (num_blocks, H_kv, page, d)): one slice copy per sequence (contiguous) or per page
    touched (paged). (torch's advanced-index assignment costs tens of milliseconds on a
    large cache, a torch slice copy under no_grad several times a NumPy one.)"""
    B, n = x.shape[0], x.shape[2]
    for b in range(B):
        s = int(starts[b])
        if table is None:
            row = b if bidx is None else int(bidx[b])
            cache[row, :, s : s + n] = x[b]
            continue
        page, j = cache.shape[2], s
        while j < s + n:
            off = j % page
            m = min(page - off, s + n - j)
            cache[int(table[b, j // page]), :, off : off + m] = x[b, :, j - s : j - s + m]
            j += m


def _cache_attend(q, out, lse, kc, vc, opts, shared, rows, plain, bidx, leftpad, kv_lens):
    """Attention over a contiguous cache, read in place: kc, vc its (B_cache, H_kv, L_cache,
    d / dv) NumPy views (np4)."""
    B, Lq, H, _ = q.shape
    q4, o4 = np4(q, "q"), np4(out, "out")
    if plain and bidx is None:
        # One call over the first B cache rows; padding on the left is a ring start.
        start = None if leftpad is None else leftpad.copy()
        mask = mask_args(opts, kv_lens=kv_lens.copy())
        keys = _dispatch.KEYS_RING if start is not None else _dispatch.KEYS_CACHE
        n = max(kv_lens.tolist())
        kernel = _dispatch.choose_kernel(Lq=Lq, Lk=n, mask=mask, keys=keys)
        k4, v4 = kc[:B], vc[:B]
        if start is None:
            # the stored prefix as a view: the decode kernel splits keys, not the cache's
            # empty tail (a ring start needs the whole row)
            k4, v4 = k4[:, :, :n], v4[:, :, :n]
        _dispatch.attend(kernel, q4, k4, v4, o4, lse, scale=opts.scale, mask=mask, kv_start=start)
        return
    if plain and leftpad is None:
        # cache_batch_idx: the cache as a pool of one page per row, the index as block table.
        mask = mask_args(opts, kv_lens=kv_lens.copy())
        pages = _dispatch.PagedArgs([kc], [vc], np.ascontiguousarray(bidx.reshape(B, 1)))
        _dispatch.attend_paged(q4, pages, o4, lse, scale=opts.scale, mask=mask)
        return
    # Score transforms (softcap, ALiBi) with batch indices or left padding: one call per
    # sequence on its own key range (a view), the tiled or the decode kernel as they fit.
    cdt = np.float64 if q.dtype == torch.float64 else np.float32
    for b in range(B):
        row = b if bidx is None else int(bidx[b])
        lo = 0 if leftpad is None else int(leftpad[b])
        hi = lo + int(kv_lens[b])
        slopes = shared if rows is None else rows[b]
        score = _score_args(H, cdt, opts.softcap, slopes, None)
        mask = mask_args(opts)
        kb, vb = kc[row : row + 1, :, lo:hi], vc[row : row + 1, :, lo:hi]
        kernel = _dispatch.choose_kernel(Lq=Lq, Lk=hi - lo, mask=mask, score=score)
        lb = None if lse is None else lse[b : b + 1]
        if hi == lo:
            o4[b] = 0
            if lb is not None:
                lb[...] = -np.inf
            continue
        _dispatch.attend(
            kernel,
            q4[b : b + 1],
            kb,
            vb,
            o4[b : b + 1],
            lb,
            scale=opts.scale,
            mask=mask,
            score=score,
        )
