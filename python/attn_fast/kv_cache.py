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

fp8 storage (``dtype="float8_e4m3"`` or ``"float8_e5m2"``, also
``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2`` and torch's float8 dtypes): OCP
8-bit float codes with one float32 scale per token and kv head for keys and for
values (``x = fp8(code) * scale``, scale = max|row| / the format's largest
value, rounding to nearest even), d + dv + 8 bytes per token and kv head.
Chunks, queries and results are float32; ``attend`` equals exact attention over
``keys(b)`` / ``values(b)``. PagedKVCache stores it the same way, per block.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _cyloops, _dispatch, _loops
from ._checks import (
    BF16,
    as_float_array,
    bf16_bits,
    check_int,
    check_same_dtype,
    check_scale,
    check_seq_lens,
    compute_dtype,
    dtype_name,
    fast_view,
    shape_str,
    to_input_kind,
)
from ._kv_store import KGROUP, KVStore, LayerStack, _write_numpy, huge_arrays  # noqa: F401 (KGROUP)
from .positional import RoPE

__all__ = ["KVCache", "LayerCaches", "merge_attention_states"]

# What choose_kernel reads of a cache's visibility record: causal / window / lengths,
# never an element mask (the records _run builds all have that form).
_CACHE_MASK = _dispatch.MaskArgs(causal=True)


@functools.lru_cache(maxsize=64)
def _decodes(Lq: int) -> bool:
    """Whether ``_run`` gives an Lq-row chunk over a float cache to the decode kernel at
    every stored length and ring layout (choose_kernel's rule for a cache: keyed by Lq
    only, so attend's fast path asks once per Lq)."""
    return all(
        _dispatch.choose_kernel(Lq=Lq, Lk=Lk, mask=_CACHE_MASK, keys=keys) == _dispatch.DECODE
        for keys in (_dispatch.KEYS_CACHE, _dispatch.KEYS_RING)
        for Lk in (0, 1, _dispatch.DECODE_MIN_LK, 1 << 20)
    )


@functools.lru_cache(maxsize=64)
def _uniform_lens(B: int, Lq: int) -> np.ndarray:
    """(B,) int64 filled with Lq, read-only and shared: q_lens for the decode kernel, which
    only reads them (a fresh ``np.full`` per call shows at a few microseconds a call)."""
    a = np.full(B, Lq, dtype=np.int64)
    a.flags.writeable = False
    return a


class KVCache(KVStore):
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
        rounded up to a multiple of ``KGROUP`` = 64. Or "float8_e4m3" /
        "float8_e5m2": fp8 codes (``self.dtype`` uint8) with per-token scales.
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
        transparent huge pages (Linux; ``_kv_store.huge_arrays``), which reserves up
        to 2 MiB more address space than this, never touched.
    io_dtype : the dtype of chunks, queries and results (float32 for int8,
        else ``dtype``).
    """

    _ring = None  # the storage bound for the decode kernel (_alloc resets; old pickles lack it)

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
        self._set_encoding(dtype)
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
        B, H = self.batch, self.num_kv_heads
        self._alloc(self.encoding.round_slots(cap))
        # a quantised encoding's staging tail: the float32 keys of the group being filled
        self._stage, self._stage_grp = self.encoding.stage((B, H), self.head_dim)
        self._start = np.zeros(B, dtype=np.int64)  # ring slot of the oldest stored key
        self._n = np.zeros(B, dtype=np.int64)  # stored keys
        self._pos = np.zeros(B, dtype=np.int64)  # absolute position of the next token
        self._last_new = np.zeros(B, dtype=np.int64)  # per-sequence length of the last append
        self._last_L = 0  # chunk length of the last append
        self._plan_key = None  # attend's fast path (KVStore._planned)
        self._append_key = None  # the same for append's k, v chunks

    def _alloc(self, cap):
        """Fresh storage of cap slots per sequence (the arrays only; counters untouched):
        K, V and the encoding's aux arrays, (B, H_kv, cap, ...) each."""
        lead, d, dv = (self.batch, self.num_kv_heads), self.head_dim, self.v_head_dim
        specs = [(lead + (cap, d), self.dtype), (lead + (cap, dv), self.dtype)]
        self._k, self._v, *aux = huge_arrays(specs + self.encoding.aux_specs(lead, cap, d, dv))
        self._aux = tuple(aux)
        self._ring = None  # these arrays bound for the decode kernel (_decode_planned)

    def _arrays(self, q):
        return (q, self._k, self._v, *self._aux)

    def __getstate__(self) -> dict:
        # copy / deepcopy / pickle: the ring binds this cache's arrays, so a copy rebuilds
        # its own (a _core object neither copies nor pickles).
        return {**self.__dict__, "_ring": None}

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
        stage = 0 if self._stage is None else self._stage.nbytes
        return sum(a.nbytes for a in (self._k, self._v, *self._aux)) + stage

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
        if self._stage_grp is not None:
            self._stage_grp[:] = -1

    def keys(self, b: int) -> np.ndarray:
        """Stored keys of sequence b in position order, (H_kv, lengths[b], d) (a copy if the
        ring wraps); bfloat16 as an ``ml_dtypes.bfloat16`` array when ml_dtypes is importable,
        else its uint16 bits; int8: the dequantised float32 keys (what ``attend`` reads)."""
        return self._decoded("k", self._k[b], tuple(a[b] for a in self._aux), self._rows(b))

    def values(self, b: int) -> np.ndarray:
        """Stored values of sequence b in position order, (H_kv, lengths[b], dv) (bfloat16 as
        for keys; int8: the dequantised float32 values)."""
        return self._decoded("v", self._v[b], tuple(a[b] for a in self._aux), self._rows(b))

    def _rows(self, b):
        """Slots of sequence b's stored keys in position order: a slice unless the ring wraps."""
        s, n, R = int(self._start[b]), int(self._n[b]), self.capacity
        return slice(s, s + n) if s + n <= R else (s + np.arange(n)) % R

    # ---- writing ---------------------------------------------------------------
    def _resize(self, new_cap):
        """Reallocate to new_cap slots per sequence (rounded up to the encoding's group):
        keys in order from slot 0, or position p in slot p mod new_cap (anchored encodings)."""
        enc, R = self.encoding, self.capacity
        new_cap = enc.round_slots(new_cap)
        old = (self._k, self._v, *self._aux)
        self._alloc(new_cap)
        for b in range(self.batch):
            n, pos = int(self._n[b]), int(self._pos[b])
            p = np.arange(pos - n, pos)
            so = (int(self._start[b]) + np.arange(n)) % R  # = p mod R when anchored
            sn = p % new_cap if enc.anchored else np.arange(n)
            for a_old, a_new, r in zip(old, (self._k, self._v, *self._aux), (1, 1, *enc.aux_rows)):
                if r == 1:
                    a_new[b][:, sn] = a_old[b][:, so]
                else:  # one entry per group of r positions: move the groups' first positions
                    g = np.unique(p // r) * r
                    a_new[b][:, (g % new_cap) // r] = a_old[b][:, (g % R) // r]
        anchored = (self._pos - self._n) % new_cap
        self._start = anchored if enc.anchored else np.zeros_like(self._start)

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
            # chunks of a layout whose checks passed (attend's _plan_key), whole, no RoPE
            k, v = fk[0], fv[0]
            if self.batch == 1 and self._append_one(k, v):
                return
            new = np.full(self.batch, k.shape[2], dtype=np.int64)
        else:
            k, v, new = self._check_append(k, v, self.batch, lengths, rope)
            if key is not None:
                self._append_key = key
        L = k.shape[2]
        self._make_room(new)
        pos = None  # the positions of the rows to rotate (B, L_new)
        if rope is not None and rope.rotary_dim and L:
            pos = self._pos[:, None] + np.arange(L, dtype=np.int64)
        if self.encoding.quantised:
            self._append_coded(k, v, new, rope, pos)
        else:
            self._append_plain(k, v, new, rope, pos)
        self._last_new = new
        self._last_L = L

    def _append_one(self, k, v):
        """append's planned path for one sequence of plain storage whose chunk fits the ring
        without growing it or wrapping: the rows copied by NumPy (the same bits as
        cache_write: a copy), the counters updated on Python ints. False (nothing done)
        when the chunk needs the general path."""
        if self.encoding.quantised or k.dtype != self._k.dtype or v.dtype != self._v.dtype:
            return False
        R, L = self.capacity, k.shape[2]
        n, s = int(self._n[0]), int(self._start[0])
        room = R - n if self.window is None else R - self.window + 1
        first = (s + n) % R
        # decode-sized chunks only: a longer one takes cache_write, which is parallel and
        # stops on Ctrl-C inside its loop (a NumPy copy is neither)
        if L > 64 or L > room or first + L > R:
            return False
        self._k[0, :, first : first + L] = k[0]
        self._v[0, :, first : first + L] = v[0]
        n_new = min(R, n + L)  # a full window ring lets its oldest rows go
        self._start[0] = (s + n + L - n_new) % R
        self._n[0] = n_new
        self._pos[0] += L
        self._last_new = np.full(1, L, dtype=np.int64)
        self._last_L = L
        return True

    def _make_room(self, new):
        """Grow the storage (or raise) so that new[b] more rows fit each sequence."""
        R = self.capacity
        if self.window is None:
            need = int((self._n + new).max())
            if need > R:
                if not self.growable:
                    raise ValueError(
                        f"appending {new.tolist()} tokens to lengths {self._n.tolist()} "
                        f"exceeds the fixed capacity {R} (growable=False)"
                    )
                self._resize(max(2 * R, need))
        else:
            room = R - self.window + 1
            big = int(new.max())
            if big > room:
                if not self.growable:
                    raise ValueError(
                        f"a chunk of {big} tokens does not fit the ring of {R} slots "
                        f"with window {self.window} (at most ring - window + 1 = {room} per "
                        "append; use forward() or smaller chunks, or growable=True)"
                    )
                self._resize(self.window - 1 + big)

    def _append_plain(self, k, v, new, rope, pos):
        """append() for plain storage: copy rows (RoPE fused into the Cython copy)."""
        R, enc = self.capacity, self.encoding
        first = (self._start + self._n) % R  # first slot to write, per sequence
        cython = _loops.USE_CYTHON and enc.copyable  # the Cython copy is float32/float64 only

        def copy(buf, x):
            if cython:
                _cyloops.cache_write(buf, x, first, new, num_threads=_loops.threads())
            else:
                _write_numpy(buf, x, first, new)

        try:
            if pos is not None and cython:
                # Row t of sequence b is at position pos[b] + t; beyond RoPE's cached
                # table the rows are computed for these B x L positions only.
                c, s, idx = rope._rows(pos, self.dtype)
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
                copy(self._k, k if pos is None else enc.rotate(k, rope, pos))
            copy(self._v, v)
        except KeyboardInterrupt:
            # Ctrl-C inside the copy (the Cython loops check for it between chunks):
            # the counters still say the chunk is not stored. Only a full ring may
            # have lost its oldest keys to the new rows: drop them, keep the rest.
            over = np.maximum(0, self._n + new - R)
            self._start = (self._start + over) % R
            self._n = self._n - over
            raise
        self._advance(new)

    def _append_coded(self, k, v, new, rope, pos):
        """append() for a quantised encoding: encode in C++ (position p -> slot p mod R)."""
        enc = self.encoding
        if pos is not None:
            k = enc.rotate(k, rope, pos)
        n_new = np.minimum(self.capacity, self._n + new)
        first = self._pos - self._n
        last = self._pos + new - n_new
        enc.write(
            k,
            v,
            self._k,
            self._v,
            self._aux,
            self._stage,
            self._stage_grp,
            self._pos.copy(),
            new,
            first,
            last,
        )
        self._advance(new)

    def _advance(self, new):
        """The counters after new[b] rows were stored (the oldest leave a full ring)."""
        n_new = np.minimum(self.capacity, self._n + new)
        self._start = (self._start + self._n + new - n_new) % self.capacity
        self._n = n_new
        self._pos = self._pos + new

    def truncate(self, n: ArrayLike | int) -> None:
        """Roll back to n tokens (int, or (B,) ints): drop every position >= n.

        For rejected speculative tokens. n must be <= positions. With a window,
        the ring must still hold the window before position n (roll back at
        most ``ring - window`` tokens after the ring filled). On error nothing
        changes.
        """
        n = check_seq_lens(n, "n", self.batch)
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
        if self.encoding.anchored:  # position p stays in slot p mod R
            self._start = (n - keep) % self.capacity
        else:
            self._start = np.where(keep == 0, 0, self._start)
        self._last_new = np.zeros(self.batch, dtype=np.int64)
        self._last_L = 0

    # ---- reading ---------------------------------------------------------------
    def _released(self, first):
        return (
            f"the ring of {self.capacity} slots (a larger one: ring=) holds only positions "
            f"from {first.tolist()} on"
        )

    def attend(
        self,
        q: ArrayLike,
        scale: float | None = None,
        causal: bool = True,
        q_lens: ArrayLike | int | None = None,
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
        fq, key = self._planned(q, scale, q_lens is None and out is None and return_lse is False)
        if fq is not None:  # the stored lengths are checked as on every call
            o = self._decode_planned(fq, scale, causal)
            if o is not None:
                return o if fq is like else to_input_kind(o, like)
            ql = self._default_q_lens(fq.shape[2])
            if not self._unseen(ql, self._n, self._pos, causal):
                return to_input_kind(self._run_planned(fq, ql, scale, causal, None), like)
        q = self._check_query(q, self.batch)
        ql = self._default_q_lens(q.shape[2]) if q_lens is None else None
        return self._attend(
            q, like, scale, causal, q_lens, return_lse, out, self._n, self._pos, ql, None, key
        )

    def _decode_planned(self, q, scale, causal):
        """attend's fastest path: a planned query (``_planned``) whose chunk the decode
        kernel takes (``_decodes``) over a float cache, the kernel called as ``_run``
        calls it, the q_lens not copied (the kernel reads them during the call only).
        A new (B, H_q, L_new, dv) array, or None when the call needs ``_run_planned`` or
        the checked path (a quantised cache, a longer chunk, rows that would see past the
        stored keys: the checked path raises for them)."""
        Lq = q.shape[2]
        if not _decodes(Lq) or (self._aux and self.encoding.quant_args(self._aux)):
            return None
        ql = self._last_new if Lq == self._last_L else _uniform_lens(self.batch, Lq)
        # rows past the stored keys (causal): the ring call returns None for them
        if self.window is not None and self._unseen(ql, self._n, self._pos, causal):
            return None
        ring = self._ring
        if ring is None:
            ring = self._ring = _dispatch.decode_ring(self._k, self._v)
        return ring(
            q,
            self._plan_scale if scale is None else scale,
            bool(causal),
            -1 if self.window is None else self.window - 1,
            ql,
            self._n,
            self._start,
        )

    def _step(self, q, k, v, scale, heads_last=False):
        """``append(k, v)``, ``attend(q, scale=scale)`` of one row per sequence in one C call
        (``_dispatch.cache_step``): the same storage, counters and bits, or None (nothing changed)
        where that pair takes its checked paths. heads_last: (B, 1, H_q, dv) for (B, H_q, 1, dv)."""
        if self.encoding.quantised or not _decodes(1):
            return None
        if self._ring is None:
            self._ring = _dispatch.decode_ring(self._k, self._v)
        wl = -1 if self.window is None else self.window - 1
        args = (wl, self._n, self._start, self._pos, self._last_new, heads_last)
        o = _dispatch.cache_step(self._ring, q, k, v, scale, *args)
        if o is not None:
            self._last_L = 1
        return o

    def _default_q_lens(self, Lq):
        """attend's q_lens when none is given: the last append's per-sequence lengths if q
        has its chunk length, else Lq for every sequence; (B,) int64, a fresh array."""
        if Lq == self._last_L:
            return self._last_new.copy()
        return np.full(self.batch, Lq, dtype=np.int64)

    def _run(self, q, o, lse, ql, scale, causal, sel):
        wl = -1 if self.window is None else self.window - 1
        quant = self._aux and self.encoding.quant_args(self._aux)  # what the kernel reads
        if not quant:
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
                # Split-KV decode kernel on the ring in place (key j of sequence b in slot
                # (start[b] + j) mod capacity) with what MaskArgs(...).kernel_kwargs() would
                # give, no record; the counters uncopied (read during the call only).
                _dispatch.decode_step(
                    q, self._k, self._v, o, lse, scale, bool(causal), (wl, -1), ql, n, start
                )
                return
        kv_lens = self._n.copy()
        mask = _dispatch.MaskArgs(causal=bool(causal), q_lens=ql, kv_lens=kv_lens, window_left=wl)
        if quant:  # every chunk length: the split-KV kernel reads the codes in place
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
        q = self._check_query(q, self.batch)
        k = self._check_chunk(k, "k", self.batch, self.head_dim)
        v = self._check_chunk(v, "v", self.batch, self.v_head_dim)
        # checked before anything is appended
        scale = check_scale(scale, self.head_dim, self.io_dtype)
        L = q.shape[2]
        if k.shape[2] != L or v.shape[2] != L:
            raise ValueError(
                "q, k, v must hold the same tokens: "
                f"q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}"
            )
        step = L if self.window is None else max(1, self.capacity - self.window + 1)
        o = np.empty(q.shape[:3] + (self.v_head_dim,), dtype=self.io_dtype)
        lse = np.empty(q.shape[:3], dtype=compute_dtype(self.io_dtype)) if return_lse else None
        # checked arrays back in as bfloat16
        tag = bf16_bits if self.dtype == BF16 else (lambda x: x)
        for t in range(0, max(L, 1), step):
            sl = slice(t, min(L, t + step))
            self.append(tag(k[:, :, sl]), tag(v[:, :, sl]))
            res = self.attend(tag(q[:, :, sl]), scale=scale, return_lse=return_lse, out=o[:, :, sl])
            if return_lse:
                lse[:, :, sl] = res[1]
        return to_input_kind((o, lse) if return_lse else o, like)


class LayerCaches(LayerStack):
    """One KVCache per layer of a model: ``LayerCaches(num_layers, <KVCache args>)``.

    Indexable (``caches[i]``, IndexError out of range), iterable, ``len()`` =
    num_layers; ``nbytes`` sums all layers; ``positions`` is layer 0's;
    ``reset()`` and ``truncate(n)`` apply to every layer.
    """

    def __init__(self, num_layers: int, *args: Any, **kwargs: Any) -> None:
        num_layers = check_int(num_layers, "num_layers", 1)
        self._caches = [KVCache(*args, **kwargs) for _ in range(num_layers)]

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
