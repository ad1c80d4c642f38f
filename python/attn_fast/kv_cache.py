"""KV cache for generation: prefill once, then decode token by token.

Shape legend: B batch, H_kv key/value heads, H_q query heads (a multiple of
H_kv), d query/key head dim, dv value head dim, L_new the length of a chunk. ::

    cache = KVCache(B, H_kv, d, capacity=4096)
    cache.append(k, v)                 # prefill: k (B, H_kv, L, d), v (B, H_kv, L, dv)
    o = cache.attend(q)                # q (B, H_q, L, d) -> (B, H_q, L, dv), causal
    for step in range(n):              # decode: one token at a time
        cache.append(k1, v1)           # (B, H_kv, 1, d)
        o1 = cache.attend(q1)          # (B, H_q, 1, dv)

Storage is preallocated (B, H_kv, capacity, d) and (B, H_kv, capacity, dv)
arrays; ``append`` copies each new key and value exactly once into it, and
``attend`` reads them in place (no gather, no concatenation). Each sequence
of the batch has its own length (ragged batches); the kernel reads only the
valid keys of each sequence.

Sliding window (``window=w``): query at absolute position p sees the keys at
positions p-w+1 .. p (itself and the w-1 before it; the same as
``scaled_dot_product_attention(..., window_size=(w-1, 0))`` and
``reference.window_mask(Lq, Lk, w-1, 0)`` over the full history). The cache
then is a ring buffer of ``ring`` slots (default 2w) that keeps only the most
recent ones: memory O(w) however long the generation runs. A chunk of L_new
tokens needs the w-1 keys before it plus itself, so it fits in the ring when
L_new <= ring - w + 1; a larger chunk grows the ring (or raises when
``growable=False``); ``forward(q, k, v)`` instead splits it into fitting
pieces and never grows the ring.

Positions: ``positions[b]`` is the absolute position of the next token of
sequence b (RoPE offsets use it); ``lengths[b]`` is how many keys are stored.
They differ once the ring dropped old keys or the window is in use. Keys are
stored as given: rotate them (RoPE) before ``append``.

16-bit storage (``dtype="bfloat16"`` or ``"float16"``): K and V are stored in
that dtype (bfloat16 as its uint16 bits, as the kernels read it: half the
bytes of float32), chunks and queries must come in it, and ``attend`` returns
it; the kernels widen K/V/q to float32 as they load them, accumulate and take
the softmax in float32, and round O once. lse is float32.

int8 storage (``dtype="int8"``): K and V are stored as 8-bit codes with
float32 scales beside them, about 280 bytes per token and kv head at
d = dv = 128 instead of 1024 (float32). Chunks, queries and results are
float32. The codes are asymmetric, ``x = code * scale + offset`` over each
slice's [min, max]: keys per channel over groups of ``KGROUP`` = 64
consecutive positions (KIVI-style: key outliers live in a few channels;
64 is the decode kernel's key block, so a block folds one group's scales into
q), values per token. ``append`` quantises in C++ (``_core.kv_quant_append``,
GIL released). A key group's channel ranges are known only once it is full,
so the float32 keys of the group being filled are kept beside the codes (a
staging tail of 64 x d floats per sequence and kv head) and the group is
requantised from them at the end of every append. What a query sees: the
dequantised keys and values of every stored position, its own chunk included
(a chunk is quantised on append, before ``attend`` reads it), so an int8
``attend`` equals exact attention over ``keys(b)`` / ``values(b)``, which
return the dequantised float32 values. ``truncate`` back into a group that had
already closed refills its staging rows from the dequantised codes (its kept
keys are requantised from those, at most half a code step more error, when
later keys widen its range). Capacity and ring are rounded up to multiples
of 64; position p lives in slot p mod capacity. Decode and prefill (any
chunk length) run the split-KV decode kernel, which reads the codes in place
and dequantises in registers.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _core, _cyloops, _dispatch, _loops
from ._checks import (
    BF16,
    F16,
    FLOAT_DTYPES,
    HALF_DTYPES,
    alias_safe,
    as_float_array,
    bf16_bits,
    check_int,
    check_out,
    check_same_dtype,
    check_scale,
    compute_dtype,
    dtype_name,
    fast_view,
    from_float,
    half_result,
    shape_str,
    to_float,
    to_input_kind,
)
from .positional import RoPE

__all__ = ["KVCache", "LayerCaches", "merge_attention_states"]

I8 = np.dtype(np.int8)
KGROUP = 64  # positions per key quantisation group of an int8 cache (the decode key block)

_HUGE = 2 << 20  # bytes of a transparent huge page (x86-64, Linux)


def _huge_arrays(specs: list[tuple[tuple[int, ...], Any]]) -> list[np.ndarray]:
    """Zero-filled C-contiguous arrays of the given (shape, dtype) specs, in order, each
    starting on a 64-byte boundary: views of one private anonymous mapping whose start is
    2 MiB-aligned and whose whole 2 MiB pages are advised for transparent huge pages
    (MADV_HUGEPAGE), where the platform has it and the arrays fill at least one huge page;
    else one np.zeros array per spec. A partly filled last huge page is left to 4 KiB pages,
    so no memory beyond the arrays' own is touched.

    Why: the caches' arrays are read by every decode step, and the int8 scales in small
    strided pieces. NumPy advises huge pages only for allocations of 4 MiB or more and from
    where its allocation starts (not 2 MiB-aligned), so the scale arrays of a cache stayed on
    4 KiB pages: on AMD Zen 4 an int8 decode step took 0.93-0.95x the time with its arrays on
    huge pages (contiguous cache), and a paged one about 1.0x the contiguous time instead of
    1.05-1.09x (bench/notes_archive.md, zen4 step 10).
    """
    sizes = [int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in specs]
    offs, total = [], 0
    for n in sizes:
        offs.append(total)
        total += -(-n // 64) * 64
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is None or total < _HUGE:
        return [np.zeros(shape, dt) for shape, dt in specs]
    # Anonymous and private (a shared mapping would be shmem, which THP leaves alone):
    # zero-filled, page-aligned.
    try:
        m = mmap.mmap(-1, total + _HUGE, flags=mmap.MAP_PRIVATE)
    except OSError as e:  # as NumPy's allocation failure would be
        raise MemoryError(f"cannot allocate {total} bytes for the cache's arrays: {e}") from e
    raw = np.frombuffer(m, dtype=np.uint8)
    start = -raw.__array_interface__["data"][0] % _HUGE
    try:
        m.madvise(advise, start, total // _HUGE * _HUGE)
    except OSError:  # a kernel without THP: the arrays still work on 4 KiB pages
        pass
    return [
        raw[start + o : start + o + n].view(dt).reshape(shape)
        for (shape, dt), o, n in zip(specs, offs, sizes)
    ]


# What choose_kernel reads of a cache's visibility record: causal / window / lengths,
# never an element mask (the records _run builds all have that form).
_CACHE_MASK = _dispatch.MaskArgs(causal=True)


def _cache_dtype(dtype):
    """The storage dtype for KVCache(dtype=...): float32, float64, float16, or BF16 (uint16 bits)
    for bfloat16 (given as "bfloat16", ml_dtypes.bfloat16 or torch.bfloat16).

    TypeError otherwise.
    """
    name = str(dtype).replace("torch.", "")
    if name == "int8":
        return I8
    if name in ("bfloat16", "bf16"):
        return BF16
    if name in ("float16", "half", "fp16"):
        return F16
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is not None and dt.name == "bfloat16":  # ml_dtypes.bfloat16
        return BF16
    if dt == I8:
        return I8
    if dt == F16:
        return F16
    if dt is None or dt not in FLOAT_DTYPES:
        raise TypeError(
            "dtype must be float32, float64, float16 or bfloat16 (or int8, quantised), "
            f"got {dtype!r}"
        )
    return dt


def _cast_hint(dt):
    if dt == BF16:
        return "x.to(torch.bfloat16) / x.astype(ml_dtypes.bfloat16)"
    return f"x.to(torch.{dt.name}) / x.astype(np.{dt.name})"


def _dtype_mismatch(name, x, dtype):
    """The TypeError for a chunk or query `x` whose dtype is not the cache's `dtype`."""
    return TypeError(
        f"{name} has dtype {dtype_name(x.dtype)} "
        f"but the cache stores {dtype_name(dtype)}; "
        f"cast it first ({_cast_hint(dtype)})"
    )


def _cache_dtype_error(name, x, q8, dtype):
    """The TypeError for a chunk or query `x` of the wrong dtype: an int8 cache
    (q8) takes float32, any other cache its own storage `dtype`."""
    if q8:
        return TypeError(
            f"{name} has dtype {dtype_name(x.dtype)} but an int8 cache takes float32 k, v "
            "and q; cast it first (x.to(torch.float32) / x.astype(np.float32))"
        )
    return _dtype_mismatch(name, x, dtype)


def _check_chunk4(x, name, B, H, dim, io_dtype, dtype_error):
    """A k / v chunk (B, H, L_new, dim) of io_dtype, read as an array (16-bit accepted).

    dtype_error(name, x) makes the TypeError for another dtype."""
    x = as_float_array(x, name, half=True)
    if x.ndim != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != dim:
        raise ValueError(
            f"{name} has shape {shape_str(x)}, expected "
            f"(batch, num_kv_heads, L_new, {'d' if name == 'k' else 'dv'})"
            f" = ({B}, {H}, L_new, {dim})"
        )
    if x.dtype != io_dtype:
        raise dtype_error(name, x)
    return x


def _check_query(q, B, H_kv, d, io_dtype, dtype_error, holds="the cache holds"):
    """q (B, H_q, L_new, d) of io_dtype with H_q a multiple of H_kv, read as an array.

    holds: how the message names where the B sequences come from."""
    q = as_float_array(q, "q", half=True)
    if q.ndim != 4:
        raise ValueError(f"q must be (B, H_q, L_new, d), got shape {shape_str(q)}")
    Bq, Hq, Lq, dq = q.shape
    if Bq != B:
        raise ValueError(f"q has shape {shape_str(q)}: batch {Bq} but {holds} {B} sequences")
    if dq != d:
        raise ValueError(
            f"q has shape {shape_str(q)}: head dim {dq} but the cache stores keys of dim {d}"
        )
    if Hq % H_kv != 0:
        raise ValueError(
            f"q has shape {shape_str(q)}: {Hq} heads is not a multiple "
            f"of the cache's {H_kv} kv heads"
        )
    if q.dtype != io_dtype:
        raise dtype_error("q", q)
    return q


def _per_seq(x, B, name, upper=None):
    """An int or (B,) int array -> (B,) int64 array, checked to lie in [0, upper]."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must be an int or an integer array of shape ({B},), got dtype {arr.dtype}"
        )
    if arr.size and arr.max() > np.iinfo(np.int64).max:  # uint64
        raise ValueError(f"{name} holds values beyond int64, max {arr.max()}")
    if arr.ndim == 0:
        arr = np.full(B, int(arr), dtype=np.int64)
    elif arr.shape != (B,):
        raise ValueError(
            f"{name} must be an int or have shape ({B},) (one per sequence), got shape {arr.shape}"
        )
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        raise ValueError(f"{name} must be >= 0, got {arr.tolist()}")
    if upper is not None and (arr > upper).any():
        raise ValueError(f"{name} must be <= {upper}, got {arr.tolist()}")
    return arr


def _write_numpy(buf, x, first, count):
    """The NumPy reference of ``_cyloops.cache_write``.

    buf[b, :, (first[b] + t) % R] = x[b, :, t], t < count[b].

    buf : (B, H, R, d) storage, x : (B, H, L, d) chunk; first, count : (B,).
    A chunk that runs past slot R - 1 wraps around to slot 0 (ring buffer).
    """
    R = buf.shape[2]
    for b in range(buf.shape[0]):
        c, w0 = int(count[b]), int(first[b])
        if c == 0:
            continue
        n1 = min(c, R - w0)
        buf[b, :, w0 : w0 + n1] = x[b, :, :n1]
        if n1 < c:  # wrap around (ring only)
            buf[b, :, : c - n1] = x[b, :, n1:c]


class KVCache:
    """Preallocated key/value storage for one attention layer.

    Parameters
    ----------
    batch : int, number of sequences B.
    num_kv_heads : int, H_kv.
    head_dim : int, d (keys and queries).
    capacity : int, initial slots per sequence (default 256). Without a
        window, appending beyond it doubles the storage (amortised O(1) per
        token) or raises ValueError when ``growable=False``.
    v_head_dim : int, dv (default: head_dim).
    dtype : storage dtype: float32 (default), float64, or 16-bit "float16" /
        "bfloat16" (np.float16, ml_dtypes.bfloat16, torch.float16 /
        torch.bfloat16 too), computed in float32; ``self.dtype`` is then
        float16, or uint16 for bfloat16 (the bits). Or "int8" (np.int8):
        8-bit codes with scales (module docstring); chunks, queries and
        results are float32 (``self.io_dtype``); capacity / ring are
        rounded up to a multiple of ``KGROUP`` = 64.
    window : int or None. Sliding-window attention over the last ``window``
        positions, kept in a ring buffer (see the module docstring).
    growable : bool, default True.
    ring : int, ring slots when ``window`` is set (default 2 * window; at
        least window).

    Attributes
    ----------
    lengths : (B,) int64, keys stored per sequence (a copy).
    positions : (B,) int64, absolute position of each sequence's next token.
    capacity : int, slots per sequence now allocated.
    nbytes : int, bytes of K and V storage allocated (half of float32's for
        the 16-bit dtypes; for int8 the codes, scales, offsets and the
        staging tail: capacity x (d + dv + 8 + 8 d / 64) + 256 d bytes per
        sequence and kv head). Storage of 2 MiB or more is one mapping on
        transparent huge pages (Linux; ``_huge_arrays``), which reserves up
        to 2 MiB more address space than this, never touched.
    io_dtype : the dtype of chunks, queries and results (float32 for int8,
        else ``dtype``).
    """

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int = 256,
        v_head_dim: int | None = None,
        dtype: DTypeLike | str = np.float32,
        window: int | None = None,
        growable: bool = True,
        ring: int | None = None,
    ) -> None:
        self.batch = check_int(batch, "batch", 1)
        self.num_kv_heads = check_int(num_kv_heads, "num_kv_heads", 1)
        self.head_dim = check_int(head_dim, "head_dim", 1)
        self.v_head_dim = (
            self.head_dim if v_head_dim is None else check_int(v_head_dim, "v_head_dim", 1)
        )
        self.dtype = _cache_dtype(dtype)
        self._half = self.dtype in HALF_DTYPES
        self._q8 = self.dtype == I8
        self.io_dtype = np.dtype(np.float32) if self._q8 else self.dtype
        self.growable = bool(growable)
        self.window = None if window is None else check_int(window, "window", 1)
        if self.window is None:
            if ring is not None:
                raise ValueError("ring is only meaningful with window=")
            cap = check_int(capacity, "capacity", 1)
        else:
            cap = 2 * self.window if ring is None else check_int(ring, "ring", 1)
            if cap < self.window:
                raise ValueError(f"ring ({cap}) must be >= window ({self.window})")
        if self._q8:
            cap = -(-cap // KGROUP) * KGROUP
        B, H = self.batch, self.num_kv_heads
        self._alloc(cap)
        if self._q8:  # the staging tail: float32 keys of the group being filled
            self._stage = np.zeros((B, H, KGROUP, self.head_dim), dtype=np.float32)
            self._stage_grp = np.full(B, -1, dtype=np.int64)
        self._start = np.zeros(B, dtype=np.int64)  # ring slot of the oldest stored key
        self._n = np.zeros(B, dtype=np.int64)  # stored keys
        self._pos = np.zeros(B, dtype=np.int64)  # absolute position of the next token
        self._last_new = np.zeros(B, dtype=np.int64)  # per-sequence length of the last append
        self._last_L = 0  # chunk length of the last append
        # (q's kind, shape, strides, scale) of the last attend whose checks passed, and the
        # checked scale: a query with the same key needs none of them again (attend).
        self._plan_key, self._plan_scale = None, 0.0
        self._append_key = None  # the same for append's k, v chunks

    def _alloc(self, cap):
        """Fresh storage of cap slots per sequence (the arrays only; counters untouched)."""
        B, H, d, dv = self.batch, self.num_kv_heads, self.head_dim, self.v_head_dim
        specs = [((B, H, cap, d), self.dtype), ((B, H, cap, dv), self.dtype)]
        if self._q8:  # codes x = code * scale + off: keys per (group, channel), values per slot
            specs += [((B, H, cap // KGROUP, d), np.float32)] * 2 + [((B, H, cap), np.float32)] * 2
            self._k, self._v, self._ks, self._ko, self._vs, self._vo = _huge_arrays(specs)
        else:
            self._k, self._v = _huge_arrays(specs)

    # ---- state -------------------------------------------------------------
    @property
    def capacity(self):
        return self._k.shape[2]

    @property
    def lengths(self):
        return self._n.copy()

    @property
    def positions(self):
        return self._pos.copy()

    @property
    def nbytes(self):
        n = self._k.nbytes + self._v.nbytes
        if self._q8:
            n += sum(a.nbytes for a in (self._ks, self._ko, self._vs, self._vo, self._stage))
        return n

    def __len__(self):
        """Tokens appended so far (the longest sequence's, for ragged batches)."""
        return int(self._pos.max())

    def __repr__(self):
        w = f", window={self.window}" if self.window is not None else ""
        return (
            f"KVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, "
            f"v_head_dim={self.v_head_dim}, capacity={self.capacity}{w}, "
            f"dtype={dtype_name(self.dtype)}, "
            f"lengths={self._n.tolist()})"
        )

    def reset(self) -> None:
        """Forget every token (storage is kept)."""
        self._start[:] = 0
        self._n[:] = 0
        self._pos[:] = 0
        self._last_new[:] = 0
        self._last_L = 0
        if self._q8:
            self._stage_grp[:] = -1

    def keys(self, b: int) -> np.ndarray:
        """Stored keys of sequence b in position order, (H_kv, lengths[b], d) (a copy if the
        ring wraps); bfloat16 as an ``ml_dtypes.bfloat16`` array when ml_dtypes is importable,
        else its uint16 bits; int8: the dequantised float32 keys (what ``attend`` reads)."""
        if self._q8:
            slots = self._slots(b)
            g = slots // KGROUP
            return self._k[b][:, slots].astype(np.float32) * self._ks[b][:, g] + self._ko[b][:, g]
        return half_result(self._gather(self._k, b))

    def values(self, b: int) -> np.ndarray:
        """Stored values of sequence b in position order, (H_kv, lengths[b], dv) (bfloat16 as
        for keys; int8: the dequantised float32 values)."""
        if self._q8:
            slots = self._slots(b)
            vs, vo = self._vs[b][:, slots, None], self._vo[b][:, slots, None]
            return self._v[b][:, slots].astype(np.float32) * vs + vo
        return half_result(self._gather(self._v, b))

    def _slots(self, b):
        """Slots of sequence b's stored keys in position order (int8: position p, slot p mod R)."""
        return (int(self._start[b]) + np.arange(int(self._n[b]))) % self.capacity

    def _gather(self, buf, b):
        s, n, R = int(self._start[b]), int(self._n[b]), self.capacity
        if s + n <= R:
            return buf[b, :, s : s + n]
        return np.concatenate([buf[b, :, s:], buf[b, :, : s + n - R]], axis=1)

    # ---- writing ---------------------------------------------------------------
    def _resize(self, new_cap):
        """Reallocate to new_cap slots per sequence, keys in order from slot 0 (int8: position p
        in slot p mod new_cap, new_cap rounded up to a multiple of KGROUP)."""
        if self._q8:
            return self._resize_q8(-(-new_cap // KGROUP) * KGROUP)
        B, H = self.batch, self.num_kv_heads
        k, v = _huge_arrays(
            [
                ((B, H, new_cap, self.head_dim), self.dtype),
                ((B, H, new_cap, self.v_head_dim), self.dtype),
            ]
        )
        for b in range(B):
            n = int(self._n[b])
            k[b, :, :n] = self._gather(self._k, b)
            v[b, :, :n] = self._gather(self._v, b)
        self._k, self._v = k, v
        self._start[:] = 0

    def _resize_q8(self, new_cap):
        old = {a: getattr(self, a) for a in ("_k", "_v", "_ks", "_ko", "_vs", "_vo")}
        R = self.capacity
        self._alloc(new_cap)
        for b in range(self.batch):
            n, pos = int(self._n[b]), int(self._pos[b])
            p = np.arange(pos - n, pos)
            so, sn = p % R, p % new_cap
            for a in ("_k", "_v", "_vs", "_vo"):
                getattr(self, a)[b][:, sn] = old[a][b][:, so]
            g = np.unique(p // KGROUP) * KGROUP  # the groups' first positions
            for a in ("_ks", "_ko"):
                getattr(self, a)[b][:, (g % new_cap) // KGROUP] = old[a][b][:, (g % R) // KGROUP]
        self._start = (self._pos - self._n) % new_cap

    def _dtype_error(self, name, x):
        return _cache_dtype_error(name, x, self._q8, self.dtype)

    def _check_chunk(self, x, name, dim):
        return _check_chunk4(
            x, name, self.batch, self.num_kv_heads, dim, self.io_dtype, self._dtype_error
        )

    def append(
        self,
        k: ArrayLike,
        v: ArrayLike,
        lengths: ArrayLike | int | None = None,
        rope: RoPE | None = None,
    ) -> None:
        """Store a chunk of new keys and values after each sequence's last one.

        k : (B, H_kv, L_new, d), v : (B, H_kv, L_new, dv), the cache's dtype
            (TypeError with a cast hint otherwise), any strides; keys already
            rotated if RoPE is used. L_new may be 0.
        lengths : optional int or (B,) ints <= L_new: sequence b appends only
            rows ``[:lengths[b]]`` (ragged batches); the rest is ignored.
        rope : optional ``positional.RoPE`` with head_dim d: the keys are
            rotated on the way in, row t of sequence b at position
            ``positions[b] + t`` (k itself is not modified). 16-bit keys are
            rotated in float32 and rounded once to the cache's dtype; int8
            keys are rotated (float32) before they are quantised.

        Each row is copied once into the storage (``_cyloops.cache_write``,
        or the NumPy reference ``_write_numpy``). On error nothing changes.
        """
        key = None
        if lengths is None and rope is None:
            fk, fv = fast_view(k), fast_view(v)
            if fk is not None and fv is not None:
                key = (fk[1], fk[0].shape, fk[0].strides, fv[1], fv[0].shape, fv[0].strides)
        if key is not None and key == self._append_key:
            k, v = fk[0], fv[0]  # chunks of a layout whose checks passed (attend's _plan_key)
        else:
            k = self._check_chunk(k, "k", self.head_dim)
            v = self._check_chunk(v, "v", self.v_head_dim)
            if v.shape[2] != k.shape[2]:
                raise ValueError(
                    f"k has shape {shape_str(k)} but v has shape {shape_str(v)}: lengths differ"
                )
            if key is not None:
                self._append_key = key
        L = k.shape[2]
        new = (
            np.full(self.batch, L, dtype=np.int64)
            if lengths is None
            else _per_seq(lengths, self.batch, "lengths", L)
        )
        if rope is not None and not isinstance(rope, RoPE):
            raise TypeError(f"rope must be a positional.RoPE, got {type(rope).__name__}")
        if rope is not None and rope.head_dim != self.head_dim:
            raise ValueError(f"rope must be a RoPE with head_dim {self.head_dim}, got {rope!r}")
        R = self.capacity
        if self.window is None:
            need = int((self._n + new).max())
            if need > R:
                if not self.growable:
                    raise ValueError(
                        f"appending {new.tolist()} tokens to lengths {self._n.tolist()} "
                        f"exceeds the fixed capacity {R}"
                        " (growable=False)"
                    )
                self._resize(max(2 * R, need))
        else:
            room = R - self.window + 1
            big = int(new.max())
            if big > room:
                if not self.growable:
                    raise ValueError(
                        f"a chunk of {big} tokens does not fit the ring of {R} slots "
                        f"with window {self.window}"
                        f" (at most ring - window + 1 = {room} per append; "
                        "use forward() or smaller chunks,"
                        " or growable=True)"
                    )
                self._resize(self.window - 1 + big)
        R = self.capacity
        first = (self._start + self._n) % R  # first slot to write, per sequence
        if self._q8:
            self._append_q8(k, v, new, rope)
            return
        try:
            if rope is not None and rope.rotary_dim and L and self._half:
                pos = self._pos[:, None] + np.arange(L)
                rk = rope(to_float(k, np.float32), positions=pos, seq_axis=-2)
                _write_numpy(self._k, from_float(rk, self.dtype), first, new)
            elif rope is not None and rope.rotary_dim and L:
                if _loops.USE_CYTHON:
                    # Row t of sequence b is at position pos[b] + t; beyond RoPE's cached
                    # table the rows are computed for these B x L positions only.
                    c, s, idx = rope._rows(
                        self._pos[:, None] + np.arange(L, dtype=np.int64), self.dtype
                    )
                    _cyloops.cache_write(
                        self._k,
                        k,
                        first,
                        new,
                        c,
                        s,
                        np.ascontiguousarray(idx[:, 0]),
                        rope.interleaved,
                        num_threads=_loops.threads(),
                    )
                else:
                    pos = self._pos[:, None] + np.arange(L)
                    _write_numpy(self._k, rope(k, positions=pos, seq_axis=-2), first, new)
            elif _loops.USE_CYTHON and not self._half:  # the Cython copy is float32/float64 only
                _cyloops.cache_write(self._k, k, first, new, num_threads=_loops.threads())
            else:
                _write_numpy(self._k, k, first, new)
            if _loops.USE_CYTHON and not self._half:
                _cyloops.cache_write(self._v, v, first, new, num_threads=_loops.threads())
            else:
                _write_numpy(self._v, v, first, new)
        except KeyboardInterrupt:
            # Ctrl-C inside the copy (the Cython loops check for it between chunks):
            # the counters still say the chunk is not stored. Only a full ring may
            # have lost its oldest keys to the new rows: drop them, keep the rest.
            over = np.maximum(0, self._n + new - R)
            self._start = (self._start + over) % R
            self._n = self._n - over
            raise
        n_new = np.minimum(R, self._n + new)
        self._start = (self._start + self._n + new - n_new) % R
        self._n = n_new
        self._pos += new
        self._last_new = new
        self._last_L = L

    def _append_q8(self, k, v, new, rope):
        """append() for an int8 cache: quantise in C++ (positions p -> slot p mod R)."""
        L = k.shape[2]
        if rope is not None and rope.rotary_dim and L:
            k = rope(k, positions=self._pos[:, None] + np.arange(L), seq_axis=-2)
            k = np.asarray(k, dtype=np.float32)
        n_new = np.minimum(self.capacity, self._n + new)
        _core.kv_quant_append(
            k,
            v,
            self._k,
            self._v,
            self._ks,
            self._ko,
            self._vs,
            self._vo,
            self._stage,
            self._stage_grp,
            pos0=self._pos.copy(),
            count=new,
            first_before=self._pos - self._n,
            first_after=self._pos + new - n_new,
        )
        self._start = (self._pos + new - n_new) % self.capacity
        self._n = n_new
        self._pos = self._pos + new
        self._last_new = new
        self._last_L = L

    def truncate(self, n: ArrayLike | int) -> None:
        """Roll back to n tokens (int, or (B,) ints): drop every position >= n.

        For rejected speculative tokens. n must be <= positions. With a window,
        the ring must still hold the window before position n (roll back at
        most ``ring - window`` tokens after the ring filled). On error nothing
        changes.
        """
        n = _per_seq(n, self.batch, "n")
        if (n > self._pos).any():
            raise ValueError(
                f"cannot truncate to {n.tolist()}: beyond the current lengths {self._pos.tolist()}"
            )
        drop = self._pos - n
        keep = self._n - drop
        if (keep < 0).any():
            raise ValueError(
                f"cannot truncate to {n.tolist()}: the ring no longer holds those positions"
            )
        if self.window is not None:
            need = np.minimum(n, self.window - 1)
            if (keep < need).any():
                raise ValueError(
                    f"cannot truncate to {n.tolist()}: "
                    f"the ring (stored {self._n.tolist()} of positions"
                    f" {self._pos.tolist()}) would no longer hold "
                    f"the {self.window - 1} keys before it"
                )
        self._n = keep
        self._pos = n.copy()
        if self._q8:  # position p stays in slot p mod R
            self._start = (n - keep) % self.capacity
        else:
            self._start = np.where(keep == 0, 0, self._start)
        self._last_new = np.zeros(self.batch, dtype=np.int64)
        self._last_L = 0

    # ---- reading ---------------------------------------------------------------
    def _check_q(self, q):
        return _check_query(
            q, self.batch, self.num_kv_heads, self.head_dim, self.io_dtype, self._dtype_error
        )

    def attend(
        self,
        q: ArrayLike,
        scale: float | None = None,
        causal: bool = True,
        q_lens: ArrayLike | None = None,
        return_lse: bool = False,
        out: Any = None,
    ) -> Any:
        """Attention of new queries against every stored key.

        q : (B, H_q, L_new, d), H_q a multiple of H_kv (GQA: head h reads kv
            head h // (H_q // H_kv)); the cache's dtype (float32 for int8);
            any strides.

        causal : bottom-right aligned per sequence: query row i of sequence b
            is at position positions[b] - q_lens[b] + i and sees the keys up to
            it, so after ``append`` of a chunk its own queries see the whole
            past and the chunk causally (chunked prefill, decode).
            With ``causal=False`` every stored key is visible (the window
            still bounds the left side).

        q_lens : int or (B,) ints: valid query rows per sequence (rows beyond
            get zeros and lse = -inf). Default: the per-sequence lengths of
            the last ``append`` if q has its chunk length (ragged batches),
            else L_new for every sequence.

        scale : default 1/sqrt(d).

        return_lse : also return lse (B, H_q, L_new), in the compute dtype
            (float32 for a 16-bit cache).

        out : optional writeable (B, H_q, L_new, dv) array (or CPU tensor) of
            the cache's dtype, any strides; written in place and returned.
            One that shares memory with q or the storage is filled through a
            temporary; one whose elements overlap raises ValueError.

        Returns (B, H_q, L_new, dv) in the cache's dtype (torch in, torch out;
        bfloat16 NumPy results as ``ml_dtypes.bfloat16`` when importable), or
        (out, lse). Rows that see no key get zeros and lse = -inf.
        """
        like = q
        plain = q_lens is None and out is None and return_lse is False
        fast = fast_view(q) if plain and (scale is None or type(scale) is float) else None
        key = None if fast is None else (fast[1], fast[0].shape, fast[0].strides, scale)
        if key is not None and key == self._plan_key:
            # The query's checks and the scale's passed for this key; the
            # stored lengths are checked below as on every call (_lengths_ok).
            q = fast[0]
            ql = self._default_q_lens(q.shape[2])
            if self._lengths_ok(ql, causal):
                o = np.empty(q.shape[:3] + (self.v_head_dim,), dtype=self.io_dtype)
                if o.size:
                    sc = self._plan_scale if scale is None else scale
                    self._run(q, o, None, ql, sc, causal)
                return to_input_kind(o, like)
        q = self._check_q(q)
        B, Hq, Lq, d = q.shape
        if q_lens is None:
            ql = self._default_q_lens(Lq)
        else:
            ql = _per_seq(q_lens, B, "q_lens", Lq)
        if (ql > self._n).any() and causal:
            raise ValueError(
                f"q_lens {ql.tolist()} exceed the stored lengths {self._n.tolist()}: "
                "append the chunk first"
            )
        if self.window is not None:
            # The first query row of sequence b sits at position pos - ql and sees
            # keys from pos - ql - (window - 1): the ring must still hold them.
            # Causal or not (causal=False only lifts the right side).
            first_needed = np.maximum(0, self._pos - ql - (self.window - 1))
            lost = (ql > 0) & (first_needed < self._pos - self._n)
            if lost.any():
                raise ValueError(
                    f"q_lens {ql.tolist()} reach back to positions {first_needed.tolist()}, "
                    "but the ring of "
                    f"{self.capacity} slots holds only positions from "
                    f"{(self._pos - self._n).tolist()} on "
                    f"(window {self.window}); attend right after appending the chunk, "
                    "or use a larger ring"
                )
        scale = check_scale(scale, d, self.io_dtype)
        if key is not None:
            self._plan_key, self._plan_scale = key, scale
        shape = (B, Hq, Lq, self.v_head_dim)
        target = None  # the caller's out when it shares memory with q or the storage
        if out is None:
            o = np.empty(shape, dtype=self.io_dtype)
        else:
            o, target = alias_safe(check_out(out, shape, self.io_dtype), q, self._k, self._v)
        lse = np.empty((B, Hq, Lq), dtype=compute_dtype(self.io_dtype)) if return_lse else None
        if o.size or (lse is not None and lse.size):
            self._run(q, o, lse, ql, scale, causal)
        if target is not None:
            target[...] = o
        if out is not None:  # the caller's own object back (ndarray or tensor)
            return (out, to_input_kind(lse, like)) if return_lse else out
        return to_input_kind((o, lse) if return_lse else o, like)

    def _default_q_lens(self, Lq):
        """attend's q_lens when none is given: the last append's per-sequence lengths if q
        has its chunk length, else Lq for every sequence; (B,) int64, a fresh array."""
        if Lq == self._last_L:
            return self._last_new.copy()
        return np.full(self.batch, Lq, dtype=np.int64)

    def _lengths_ok(self, ql, causal):
        """Whether every query row's keys are still stored (what attend raises about)."""
        if self.batch == 1 and self.window is None:  # the same test on Python ints (cheaper)
            return not causal or int(ql[0]) <= int(self._n[0])
        if causal and (ql > self._n).any():
            return False
        if self.window is not None:
            first_needed = np.maximum(0, self._pos - ql - (self.window - 1))
            if ((ql > 0) & (first_needed < self._pos - self._n)).any():
                return False
        return True

    def _run(self, q, o, lse, ql, scale, causal):
        wl = -1 if self.window is None else self.window - 1
        if not self._q8:
            start, n = self._start, self._n
            if self.batch == 1:  # the same tests on Python ints (cheaper)
                maxn = int(n[0])
                ring = int(start[0]) + maxn > self.capacity
            else:
                maxn = int(n.max())
                ring = (start + n > self.capacity).any() or (start != start[0]).any()
            kernel = _dispatch.choose_kernel(
                Lq=q.shape[2],
                Lk=maxn,
                mask=_CACHE_MASK,
                keys=_dispatch.KEYS_RING if ring else _dispatch.KEYS_CACHE,
            )
            if kernel == _dispatch.DECODE:
                # Split-KV decode kernel: reads the ring in place (logical key j of
                # sequence b is slot (start[b] + j) mod capacity); the keywords
                # MaskArgs(...).kernel_kwargs() would give, without the record.
                _dispatch.decode_step(
                    q,
                    self._k,
                    self._v,
                    o,
                    lse,
                    scale=scale,
                    causal=bool(causal),
                    window=(wl, -1),
                    q_lens=ql,
                    kv_lens=n.copy(),
                    kv_start=start.copy(),
                )
                return
        mask = _dispatch.MaskArgs(
            causal=bool(causal),
            q_lens=ql,
            kv_lens=self._n.copy(),
            window_left=wl,
        )
        if self._q8:  # every chunk length: the split-KV kernel reads the codes in place
            quant = _dispatch.QuantArgs(self._ks, self._ko, self._vs, self._vo, KGROUP)
            kernel = _dispatch.choose_kernel(
                Lq=q.shape[2], Lk=int(self._n.max()), mask=mask, keys=_dispatch.KEYS_CODES
            )
            _dispatch.attend(
                kernel,
                q,
                self._k,
                self._v,
                o,
                lse,
                scale=scale,
                mask=mask,
                kv_start=self._start.copy(),
                quant=quant,
            )
            return
        # A prefill-sized chunk over contiguous keys (_run's choice above): the tiled kernel
        # on a view.
        s, maxn = int(self._start[0]), int(self._n.max())
        k, v = self._k[:, :, s : s + maxn], self._v[:, :, s : s + maxn]
        kernel = _dispatch.choose_kernel(
            Lq=q.shape[2], Lk=maxn, mask=mask, keys=_dispatch.KEYS_CACHE
        )
        _dispatch.attend(kernel, q, k, v, o, lse, scale=scale, mask=mask)

    def forward(
        self,
        q: ArrayLike,
        k: ArrayLike,
        v: ArrayLike,
        scale: float | None = None,
        return_lse: bool = False,
    ) -> Any:
        """append(k, v) then attend(q), in pieces that fit a window ring.

        q (B, H_q, L, d), k (B, H_kv, L, d), v (B, H_kv, L, dv): the same L
        tokens. Equivalent to ``append(k, v); attend(q)`` but never grows a
        sliding-window ring: a chunk longer than the ring's room is split.
        """
        like = q
        q = self._check_q(q)
        k = self._check_chunk(k, "k", self.head_dim)
        v = self._check_chunk(v, "v", self.v_head_dim)
        scale = check_scale(
            scale, self.head_dim, self.io_dtype
        )  # checked before anything is appended
        L = q.shape[2]
        if k.shape[2] != L or v.shape[2] != L:
            raise ValueError(
                "q, k, v must hold the same tokens: "
                f"q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}"
            )
        step = L if self.window is None else max(1, self.capacity - self.window + 1)
        o = np.empty(q.shape[:3] + (self.v_head_dim,), dtype=self.io_dtype)
        lse = np.empty(q.shape[:3], dtype=compute_dtype(self.io_dtype)) if return_lse else None
        tag = (
            bf16_bits if self.dtype == BF16 else (lambda x: x)
        )  # checked arrays back in as bfloat16
        for t in range(0, max(L, 1), step):
            sl = slice(t, min(L, t + step))
            self.append(tag(k[:, :, sl]), tag(v[:, :, sl]))
            res = self.attend(tag(q[:, :, sl]), scale=scale, return_lse=return_lse, out=o[:, :, sl])
            if return_lse:
                lse[:, :, sl] = res[1]
        return to_input_kind((o, lse) if return_lse else o, like)


class LayerCaches:
    """One KVCache per layer of a model: ``LayerCaches(num_layers, <KVCache args>)``.

    Indexable (``caches[i]``), iterable, ``len()`` = num_layers; ``nbytes``
    sums all layers; ``reset()`` and ``truncate(n)`` apply to every layer.
    """

    def __init__(self, num_layers: int, *args: Any, **kwargs: Any) -> None:
        num_layers = check_int(num_layers, "num_layers", 1)
        self._caches = [KVCache(*args, **kwargs) for _ in range(num_layers)]

    def __getitem__(self, i):
        return self._caches[i]

    def __len__(self):
        return len(self._caches)

    def __iter__(self):
        return iter(self._caches)

    @property
    def nbytes(self):
        return sum(c.nbytes for c in self._caches)

    @property
    def positions(self):
        return self._caches[0].positions

    def reset(self) -> None:
        for c in self._caches:
            c.reset()

    def truncate(self, n: ArrayLike | int) -> None:
        """truncate(n) on every layer; if one raises, every layer is left unchanged."""
        names = ("_n", "_pos", "_start", "_last_new", "_last_L")
        states = [{a: getattr(c, a) for a in names} for c in self._caches]
        try:
            for c in self._caches:
                c.truncate(n)
        except Exception:
            for c, st in zip(self._caches, states):
                for a, val in st.items():
                    setattr(c, a, val)
            raise


def merge_attention_states(
    o_a: ArrayLike, lse_a: ArrayLike, o_b: ArrayLike, lse_b: ArrayLike
) -> tuple[Any, Any]:
    """Exact merge of two partial attentions over disjoint key sets.

    o_a, o_b : (..., dv) outputs, each normalised over its own keys;
    lse_a, lse_b : (...) their log-sum-exp of scores (-inf for an empty part).
    Returns (o, lse) for the union of the key sets::

        lse = log(exp(lse_a) + exp(lse_b)),
        o   = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b.

    A part with lse = -inf contributes nothing (its o is not read, even if
    NaN); both empty gives o = 0, lse = -inf; a NaN lse gives NaN o and lse.
    All four inputs share one dtype (float32 or float64; mixed dtypes raise
    TypeError), which the new arrays have.
    """
    like = o_a
    o_a, o_b = as_float_array(o_a, "o_a"), as_float_array(o_b, "o_b")
    lse_a, lse_b = as_float_array(lse_a, "lse_a"), as_float_array(lse_b, "lse_b")
    check_same_dtype(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    if o_a.ndim < 1:
        raise ValueError(f"o_a must have at least one axis (..., dv), got shape {shape_str(o_a)}")
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a has shape {shape_str(o_a)} but o_b has shape {shape_str(o_b)}")
    if lse_a.shape != o_a.shape[:-1] or lse_b.shape != o_a.shape[:-1]:
        raise ValueError(
            f"lse_a {shape_str(lse_a)} and lse_b {shape_str(lse_b)} "
            "must have o's shape without the last axis, "
            f"{o_a.shape[:-1]}"
        )
    dt = np.result_type(o_a, o_b, lse_a, lse_b)
    m = np.maximum(lse_a, lse_b)
    empty = np.isneginf(m)
    m_safe = np.where(empty, 0, m)
    with np.errstate(invalid="ignore", over="ignore"):
        wa = np.exp(lse_a - m_safe)
        wb = np.exp(lse_b - m_safe)
        tot = wa + wb
        inv = np.where(empty, 0, 1 / np.where(empty, 1, tot))
        # An empty part's o is ignored (as is one whose weight underflows to 0);
        # a NaN weight (NaN lse) is kept, so the result is NaN, not 0.
        ca = np.where(((wa > 0) | np.isnan(wa))[..., None], o_a * (wa * inv)[..., None], 0)
        cb = np.where(((wb > 0) | np.isnan(wb))[..., None], o_b * (wb * inv)[..., None], 0)
        o = (ca + cb).astype(dt, copy=False)
        lse = np.where(empty, -np.inf, m_safe + np.log(np.where(empty, 1, tot))).astype(
            dt, copy=False
        )
    return to_input_kind((o, lse), like)
