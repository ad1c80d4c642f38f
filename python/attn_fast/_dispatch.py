"""The one seam between the Python layer and the C++ attention kernels.

Every call of ``_core.forward``, ``_core.decode`` (every layout) and ``_core.backward``
goes through this module, with typed arguments: a ``masks.MaskArgs`` record
(the visibility rule) and a ``ScoreArgs`` record (softcap, ALiBi slopes,
sinks) instead of a keyword dict. The kernel is chosen here once, by
``choose_kernel``:

    PREFILL    the tiled FlashAttention kernel (flash_fwd.cpp), any mask;
    DECODE     the split-KV decode kernel (decode.cpp): short query chunks
               against long keys, structural masks only (causal, window,
               lengths), keys read in place from a KV cache's ring;
    REFERENCE  the plain-loop C++ kernel (reference.cpp), for tests.

Shape legend: B batch, H query heads, H_kv key/value heads, Lq queries,
Lk keys, d query/key head dim, dv value head dim. The callers check the
arguments (``_checks``); this module only routes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import _core
from .masks import MaskArgs

PREFILL, DECODE, REFERENCE = "prefill", "decode", "reference"

# The split-KV decode kernel serves short query chunks against long keys when
# no feature it lacks is asked for; backend="decode" forces it.
# Crossover measured with H_q=32, H_kv=8, d=128, Lk=4096 (2-core Zen 3): the
# decode kernel is ~2x faster for Lq <= 4, the tiled kernel from Lq = 8 on.
# Below DECODE_MIN_LK keys the tiled kernel's fixed cost decides for 2 to 4
# query rows, but one query row (a generated token) takes the decode kernel at
# any Lk: 0.05-0.2x the tiled kernel's time at Lk = 1..128 (Zen 4, 1 and 2
# threads, H_q / H_kv / d = 9 / 3 / 64 and 32 / 8 / 128; bench/NOTES.md, lat).
DECODE_MAX_LQ = 4
DECODE_MIN_LK = 64

# Where the keys live, for choose_kernel: a caller's arrays, a KV cache's
# storage read as one contiguous view, or a ring that wraps (or starts at a
# different slot per sequence), which only the decode kernel reads, or int8
# codes with their scales (a quantised cache), which only the decode kernel reads.
KEYS_ARRAY, KEYS_CACHE, KEYS_RING, KEYS_CODES = "array", "cache", "ring", "codes"
# A paged cache's blocks (PagedKVCache), read through a block table by the decode kernel only.
KEYS_PAGED = "paged"


@dataclass(frozen=True, eq=False)
class QuantArgs:
    """A coded KV encoding's arrays for attention.h's DecodeArgs, one record.

    encoding : the kernel's name of the encoding (``_core.decode``'s encoding=: "int8",
        ...); the K/V arrays hold its one-byte codes.
    aux : its float32 side arrays in the encoding's order (int8: k_scale, k_off, v_scale,
        v_off), each (B, H_kv, capacity / group, d) or (B, H_kv, capacity); for a pool,
        lists of (chunk_blocks, H_kv, block_size / group, d) or (.., block_size) chunks.
    group : positions per key group (1 where the encoding has none).
    """

    encoding: str
    aux: tuple
    group: int = 1


@dataclass(frozen=True, eq=False)
class ScoreArgs:
    """The score transforms of attention.h's AttnArgs, one record.

    softcap : scores become softcap · tanh(score / softcap); 0 = off.
    alibi : (H,) slopes in the compute dtype, contiguous, or None.
    sinks : (H,) sink logits in the compute dtype, contiguous, or None.
    """

    softcap: float = 0.0
    alibi: np.ndarray | None = None
    sinks: np.ndarray | None = None

    @property
    def plain(self) -> bool:
        """True when no transform is set (what the decode kernel supports)."""
        return not self.softcap and self.alibi is None and self.sinks is None

    def set_fields(self) -> list[str]:
        """The names of the arguments this record sets (for error messages)."""
        names = ["softcap"] if self.softcap else []
        return names + [n for n in ("alibi", "sinks") if getattr(self, n) is not None]


PLAIN = ScoreArgs()


def choose_kernel(
    *,
    Lq: int,
    Lk: int,
    mask: MaskArgs,
    score: ScoreArgs = PLAIN,
    backend: str = "fused",
    same_batch: bool = True,
    block_sizes: tuple[int, int] = (0, 0),
    stats: bool = False,
    keys: str = KEYS_ARRAY,
    packed: bool = False,
) -> str:
    """PREFILL, DECODE or REFERENCE for one call: the only place that decides.

    backend : "fused" (choose), "decode" (force the split-KV kernel: ValueError
        when the call asks for what it lacks) or "reference".
    same_batch : k has q's batch size (the decode kernel does not broadcast).
    block_sizes : the (block_q, block_k) asked for; the decode kernel has no tiles.
    stats : KernelStats are wanted (the decode kernel reports none).
    keys : KEYS_ARRAY (a caller's arrays), KEYS_CACHE (a KV cache read as one
        view: short chunks decode whatever Lk) or KEYS_RING (a wrapped ring:
        always the decode kernel, which reads it in place) or KEYS_CODES (int8
        codes: always the decode kernel, which dequantises them in registers) or
        KEYS_PAGED (a paged cache's blocks: always the decode kernel).
    packed : varlen (cu_seqlens) sequences, which the tiled kernels read only.
    """
    fits = (
        not mask.elementwise
        and score.plain
        and same_batch
        and tuple(block_sizes) == (0, 0)
        and not stats
        and not packed
    )
    if backend == REFERENCE:
        return REFERENCE
    if backend == DECODE:
        if not fits:
            got = sorted(mask.set_fields() + score.set_fields())
            raise ValueError(
                "backend='decode' supports causal, window_size and kv/q lengths only (no dense "
                "masks, biases, ALiBi, softcap, sinks, block sizes or return_stats); "
                f"got {got}"
            )
        return DECODE
    if keys in (KEYS_RING, KEYS_CODES, KEYS_PAGED):
        return DECODE
    short = Lq <= DECODE_MAX_LQ and (keys == KEYS_CACHE or Lq == 1 or Lk >= DECODE_MIN_LK)
    return DECODE if fits and short else PREFILL


def decode_step(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray | None,
    scale: float,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    q_lens: np.ndarray | None = None,
    kv_lens: np.ndarray | None = None,
    kv_start: np.ndarray | None = None,
) -> None:
    """The decode kernel with only the structural arguments, writing o (and lse).

    ``attend(DECODE, ...)`` for callers that build no MaskArgs record (the
    fast paths of ``KVCache.attend`` and of the transformers backend):
    causal, a (left, right) window (-1 = unbounded), q_lens / kv_lens /
    kv_start (B,) int64. The binding's arguments are passed by position
    (``_core.decode``'s order: no keyword lookups), the values
    ``attend(DECODE, ...)`` passes for the same record, so the results are
    the same bits. Shapes, strides, dtypes and the scale are checked by the
    binding. Positional or keyword arguments (a per-layer caller passes them by
    position: no keyword parsing).
    """
    _core.decode(
        q, k, v, o, lse, scale, causal, False, window[0], window[1], q_lens, kv_lens, kv_start
    )


def decode_ring(k: np.ndarray, v: np.ndarray) -> Any:
    """A KV cache's ring of slots k (B, H_kv, R, d), v (B, H_kv, R, dv) of one float dtype,
    checked and held (not copied) by a ``_core.DecodeRing``: ``ring(q, scale, causal,
    window_left, q_lens, kv_lens, kv_start)`` is ``decode_step``'s kernel on those arrays
    (no lse, no right window) and returns a new o (B, H_q, L_new, dv) of q's dtype, or
    None without a kernel call when causal and some q_lens[b] > kv_lens[b]. For
    ``KVCache.attend``'s planned path, where a call costs a few microseconds: the call
    parses seven arguments and checks only q, the scale and the lengths. The GIL is
    released while the kernel runs."""
    return _core.DecodeRing(k, v)


def cache_step(ring: Any, q: Any, k: Any, v: Any, scale: float | None, *args: Any) -> Any:
    """``KVCache._step``'s kernel call: ``_core.cache_step(ring, q, k, v, scale, window_left,
    n, start, pos, last_new, heads_last)`` (args in that order) on a ``decode_ring``:
    one row per sequence stored in the ring and attended (the decode kernel), the
    counters updated in place; the result, or None with nothing changed."""
    return _core.cache_step(ring, q, k, v, scale, *args)


def attend(
    kernel: str,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray | None,
    *,
    scale: float,
    mask: MaskArgs,
    score: ScoreArgs = PLAIN,
    block_q: int = 0,
    block_k: int = 0,
    cu_q: np.ndarray | None = None,
    cu_k: np.ndarray | None = None,
    kv_start: np.ndarray | None = None,
    quant: QuantArgs | None = None,
) -> tuple[int, int, int, int]:
    """Run the forward `kernel` (from ``choose_kernel``), writing o and lse.

    q (B, H, Lq, d), k (B, H_kv, Lk, d), v (B, H_kv, Lk, dv), o (B, H, Lq, dv)
    and lse (B, H, Lq) or None, any strides (varlen: B = 1 with cu_q / cu_k;
    a KV cache's ring: kv_start, DECODE only; int8 k/v codes: quant, DECODE
    only). Returns the tile counts
    (tiles_computed, tiles_skipped, block_q, block_k); zeros for DECODE.
    The GIL is released while the kernel runs.
    """
    if kernel == DECODE:  # choose_kernel made sure the record has only what decode reads
        _decode(q, k, v, o, lse, scale, mask, kv_start=kv_start, quant=quant)
        return (0, 0, 0, 0)
    if kv_start is not None or quant is not None:
        raise ValueError(
            "kv_start (a ring of keys) and int8 codes are read by the decode kernel only"
        )
    args = _kernel_args(mask, score, cu_q, cu_k, block_q, block_k)
    return tuple(_core.forward(q, k, v, o, lse, scale, *args, kernel == REFERENCE))


def bound(kernel: str, mask: MaskArgs) -> Callable[..., None]:
    """``run(q, k, v, o, scale)``: ``attend(kernel, q, k, v, o, None, scale=scale,
    mask=mask)`` with the kernel and the record bound once (a plan's call, where attend's
    keyword lookups and routing show at a few microseconds a call); the same kernel call."""
    if kernel == DECODE:  # _decode's call, its record fields bound once in C
        return _core.BoundDecode(*_decode_fields(mask))

    def run(q, k, v, o, scale):
        attend(kernel, q, k, v, o, None, scale=scale, mask=mask)

    return run


def _kernel_args(mask, score, cu_q, cu_k, block_q, block_k):
    """The mask and score arguments of ``_core.forward`` / ``_core.backward`` (C++ MaskCall),
    by position in the bindings' order: one record, gathered once, with no keyword lookups."""
    return _decode_fields(mask) + (
        cu_q,
        cu_k,
        mask.layout,
        mask.layout_bq,
        mask.layout_bk,
        mask.mask,
        mask.bias,
        score.alibi,
        score.softcap,
        score.sinks,
        block_q,
        block_k,
    )


def _decode_fields(mask: MaskArgs) -> tuple:
    """A decode-only record's fields as ``_core.decode`` (and ``_core.BoundDecode``) take
    them after the scale, by position in the binding's order: causal, top_left,
    window_left, window_right, q_lens, kv_lens; also the head of ``_kernel_args`` (the
    same six fields lead ``MaskCall``)."""
    return (
        mask.causal,
        mask.top_left,
        mask.window_left,
        mask.window_right,
        mask.q_lens,
        mask.kv_lens,
    )


def _decode(q, k, v, o, lse, scale, mask, kv_start=None, block_table=None, quant=None):
    """``_core.decode`` on a decode-only record (causal, alignment, window, lengths): its
    arguments by position, in the binding's order; k / v arrays, or lists of pool chunks with
    block_table; quant (a QuantArgs) a coded encoding's side arrays."""
    qa = (quant.encoding, quant.aux, quant.group) if quant else ()
    _core.decode(q, k, v, o, lse, scale, *_decode_fields(mask), kv_start, 0, block_table, *qa)


def backward(
    dout: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    dsinks: np.ndarray | None,
    *,
    scale: float,
    mask: MaskArgs,
    score: ScoreArgs = PLAIN,
    block_q: int = 0,
    block_k: int = 0,
    cu_q: np.ndarray | None = None,
    cu_k: np.ndarray | None = None,
) -> None:
    """The FlashAttention-2 backward: writes dq, dk, dv (and dsinks) from dout.

    4-D (B, H, L, ·) views as in ``attend``; lse (B, H, Lq) from the forward.
    """
    args = _kernel_args(mask, score, cu_q, cu_k, block_q, block_k)
    _core.backward(dout, q, k, v, out, lse, dq, dk, dv, dsinks, scale, *args)


@dataclass(frozen=True, eq=False)
class PagedArgs:
    """A paged KV cache's pool and block table (attention.h's DecodeArgs::block_table), one record.

    k_chunks, v_chunks : lists of the pool's chunks, (chunk_blocks, H_kv, block_size, d) and
        (chunk_blocks, H_kv, block_size, dv), one dtype, shape and set of strides each;
        physical block g is block g % chunk_blocks of chunk g // chunk_blocks.
    block_table : (B, max_blocks) int64, C-contiguous: row b lists the blocks of sequence b
        in order (logical key j is row j % block_size of block_table[b, j // block_size]).
    quant : a coded pool's encoding and side array chunks (QuantArgs, aux as lists of
        chunks); None for the float pools.
    """

    k_chunks: list[np.ndarray]
    v_chunks: list[np.ndarray]
    block_table: np.ndarray
    quant: QuantArgs | None = None


def attend_paged(
    q: np.ndarray,
    pages: PagedArgs,
    o: np.ndarray,
    lse: np.ndarray | None,
    *,
    scale: float,
    mask: MaskArgs,
) -> None:
    """The split-KV decode kernel over a paged cache (``choose_kernel(keys=KEYS_PAGED)``).

    q (B, H, Lq, d), o (B, H, Lq, dv), lse (B, H, Lq) or None; the mask record carries
    causal / window and the per-sequence q_lens and kv_lens (kv_lens required). The keys
    are read in place through the block table (no gather); the GIL is released.
    """
    _decode(
        q,
        pages.k_chunks,
        pages.v_chunks,
        o,
        lse,
        scale,
        mask,
        block_table=pages.block_table,
        quant=pages.quant,
    )
