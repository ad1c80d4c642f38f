"""What KVCache and PagedKVCache share: the storage encodings, their arrays, the checks of
chunks and queries, and the one ``attend`` core (visibility checks, out=, result).

Shape legend: B sequences of a call, H_kv key/value heads, H_q query heads, d key dim,
dv value dim, R slots (a contiguous cache's capacity, or a page's block_size).

An *encoding* is one object per storage kind: float32, float64, float16, bfloat16 and
int8 (codes with scales). It knows the dtype of the K/V arrays and of the chunks,
queries and results, the arrays it keeps beside K/V (``aux``: int8's scales and
offsets), the bytes per token and kv head, how a chunk is rotated and written
(quantised), how the stored values read back, and the record the decode kernel gets.
The two caches are two layouts of the same arrays (one slab of R slots per sequence,
or a pool of pages), so a new encoding is a new ``Encoding`` subclass registered in
``ENCODINGS``; no cache method tests which encoding it has.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from . import _core, _dispatch
from ._checks import (
    BF16,
    F16,
    HALF_DTYPES,
    Output,
    as_float_array,
    check_scale,
    check_seq_lens,
    compute_dtype,
    dtype_name,
    fast_view,
    from_float,
    half_result,
    shape_str,
    to_float,
)
from .positional import RoPE

KGROUP = 64  # positions per key quantisation group of an int8 cache (the decode key block)

_HUGE = 2 << 20  # bytes of a transparent huge page (x86-64, Linux)


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


def huge_arrays(specs: list[tuple[tuple[int, ...], Any]]) -> list[np.ndarray]:
    """Zero-filled C-contiguous arrays of the given (shape, dtype) specs, in order, each
    starting on a 64-byte boundary: views of one private anonymous mapping whose start is
    2 MiB-aligned and whose whole 2 MiB pages are advised for transparent huge pages
    (MADV_HUGEPAGE), where the platform has it and the arrays fill at least one huge page;
    else one np.zeros array per spec. A partly filled last huge page is left to 4 KiB pages,
    so no memory beyond the arrays' own is touched.

    Why: every decode step reads the caches' arrays, and the int8 scales in small strided
    pieces; NumPy advises huge pages only for allocations of 4 MiB or more and not from a
    2 MiB boundary, so the scale arrays stayed on 4 KiB pages and their TLB misses showed
    in decode time (bench/notes_archive.md, zen4 step 10).
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


# ---------------------------------------------------------------- encodings


class Encoding:
    """How a cache stores K and V (the base is plain storage: values as given).

    dtype : the K/V arrays' element type; io_dtype : chunks, queries and results.
    group : slots per alignment unit. Capacities and pages are multiples of it, and when
        it is above 1 position p always lives in slot p mod R (a key group never
        straddles the ring's wrap or a page).
    aux_rows : for each array kept beside K/V (``aux_specs`` order), the positions one
        entry along its slot axis covers (int8: key scales per group, value scales per slot).
    """

    dtype: np.dtype
    io_dtype: np.dtype
    names: tuple[str, ...] = ()  # spellings accepted as dtype= besides the dtype itself
    group = 1
    aux_rows: tuple[int, ...] = ()
    quantised = False  # chunks are encoded in C++ (write), with a staging tail
    by_dtype = True  # dtype= may name it by its NumPy dtype (not bits standing in for a type)
    copyable = False  # the Cython copy loops (_cyloops.cache_write) take this dtype

    def __init__(self, dtype: Any, names: tuple[str, ...] = (), by_dtype: bool = True) -> None:
        self.dtype = self.io_dtype = np.dtype(dtype)
        self.names, self.by_dtype = names, by_dtype
        self.copyable = self.dtype.kind == "f" and self.dtype.itemsize >= 4

    @property
    def label(self) -> str:
        """The encoding's name in messages (its first dtype= spelling)."""
        return self.names[0] if self.names else dtype_name(self.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label})"

    @property
    def anchored(self) -> bool:
        """Whether position p lives in slot p mod R (groups of positions share scales)."""
        return self.group > 1

    def round_slots(self, n: int) -> int:
        return -(-n // self.group) * self.group

    def bytes_per_token_head(self, d: int, dv: int) -> float:
        """Bytes one token of one kv head takes in the arrays (K, V and aux)."""
        return (d + dv) * self.dtype.itemsize

    def aux_specs(self, lead: tuple[int, ...], R: int, d: int, dv: int) -> list:
        """(shape, dtype) of the arrays kept beside K/V for `lead` + R slots."""
        return []

    def stage(self, lead: tuple[int, ...], d: int) -> tuple[Any, Any]:
        """(staging tail, its group) of a quantised encoding; (None, None) for plain."""
        return None, None

    def dtype_error(self, name: str, x: np.ndarray) -> TypeError:
        """The TypeError for a chunk or query `x` whose dtype is not io_dtype."""
        dt = self.io_dtype
        hint = (
            "x.to(torch.bfloat16) / x.astype(ml_dtypes.bfloat16)"
            if dt == BF16
            else f"x.to(torch.{dt.name}) / x.astype(np.{dt.name})"
        )
        return TypeError(
            f"{name} has dtype {dtype_name(x.dtype)} but the cache stores {dtype_name(dt)}; "
            f"cast it first ({hint})"
        )

    def rotate(self, k: np.ndarray, rope: RoPE, pos: np.ndarray) -> np.ndarray:
        """k (B, H_kv, L, d) rotated at positions pos (B, L), in io_dtype (16-bit keys
        rotated in float32 and rounded once)."""
        if self.dtype in HALF_DTYPES:
            return from_float(rope(to_float(k, np.float32), positions=pos, seq_axis=-2), self.dtype)
        return np.asarray(rope(k, positions=pos, seq_axis=-2), dtype=self.io_dtype)

    def check_values(self, k: np.ndarray, v: np.ndarray, new: np.ndarray) -> None:
        """Raise ValueError for chunk rows the encoding cannot store (rows < new[b])."""

    def decode(self, which: str, x: np.ndarray, aux: tuple, rows: Any) -> np.ndarray:
        """The stored keys (which = "k") or values ("v") at slot `rows` (a slice or an
        index array) of x (H_kv, R, dim), aux the per-sequence aux arrays (H_kv, ...);
        in io form (float32 for int8; bfloat16 bits, made ml_dtypes by half_result)."""
        return x[:, rows]

    def quant_args(self, aux: tuple) -> _dispatch.QuantArgs | None:
        """The record the decode kernel reads the aux arrays through (None: plain); aux the
        arrays of a contiguous cache, or lists of chunks of a pool."""
        return None

    def paged_args(self, kc: list, vc: list, table: np.ndarray, aux: tuple) -> Any:
        """The record the paged decode kernel reads a pool through."""
        return _dispatch.PagedArgs(kc, vc, table, self.quant_args(aux))


class Int8(Encoding):
    """int8 codes, asymmetric (``x = code * scale + offset``): keys per channel over groups
    of KGROUP positions, values per token; float32 scales and offsets beside them. Chunks,
    queries and results are float32; ``_core.kv_quant_append`` encodes (module docstring
    of kv_cache: the staging tail of the open key group)."""

    group = KGROUP
    aux_rows = (KGROUP, KGROUP, 1, 1)  # k_scale, k_off, v_scale, v_off
    quantised = True

    def __init__(self) -> None:
        super().__init__(np.int8, ("int8",))
        self.io_dtype = np.dtype(np.float32)
        self.copyable = False

    def bytes_per_token_head(self, d: int, dv: int) -> float:
        return d + dv + 8 + 8 * d / KGROUP

    def aux_specs(self, lead, R, d, dv):
        ks = (lead + (R // KGROUP, d), np.float32)
        vs = (lead + (R,), np.float32)
        return [ks, ks, vs, vs]

    def stage(self, lead, d):
        return np.zeros(lead + (KGROUP, d), np.float32), np.full(lead[0], -1, np.int64)

    def dtype_error(self, name, x):
        return TypeError(
            f"{name} has dtype {dtype_name(x.dtype)} but an int8 cache takes float32 k, v "
            "and q; cast it first (x.to(torch.float32) / x.astype(np.float32))"
        )

    def check_values(self, k, v, new):
        # checked before anything changes: kv_quant_append checks only the rows it is given
        rows = np.arange(k.shape[2]) < new[:, None]  # (B, L): the rows to store
        if (
            not (np.isfinite(k).all(-1).all(1) | ~rows).all()
            or not (np.isfinite(v).all(-1).all(1) | ~rows).all()
        ):
            raise ValueError(
                f"k or v holds inf or NaN: a {self.label} cache stores finite values only "
                "(nothing was stored)"
            )

    def write(self, k, v, kc, vc, aux, stage, stage_grp, pos0, count, before, after):
        """Encode k (B, H_kv, L, d), v into the codes kc, vc and aux of B sequences of R
        slots, rows t < count[b] at positions pos0[b] + t (slot p mod R); the first stored
        position goes from before[b] to after[b] (the rows that leave the ring)."""
        _core.kv_quant_append(
            k,
            v,
            kc,
            vc,
            *aux,
            stage,
            stage_grp,
            pos0=pos0,
            count=count,
            first_before=before,
            first_after=after,
        )

    def decode(self, which, x, aux, rows):
        rows = np.arange(x.shape[1])[rows]
        if which == "k":
            g = rows // KGROUP
            return x[:, rows].astype(np.float32) * aux[0][:, g] + aux[1][:, g]
        return x[:, rows].astype(np.float32) * aux[2][:, rows, None] + aux[3][:, rows, None]

    def quant_args(self, aux):
        return _dispatch.QuantArgs("int8", aux, KGROUP)


def _fp8_values(exp_bits: int) -> np.ndarray:
    """The float64 values of the 128 non-negative fp8 codes with `exp_bits` exponent bits
    (OCP 8-bit formats: e4m3fn, bias 7, no inf, 0x7f NaN; e5m2, bias 15, IEEE-like).
    Finite codes increase with their value; the others are NaN here."""
    man_bits = 7 - exp_bits
    bias = (1 << (exp_bits - 1)) - 1
    code = np.arange(128)
    e, m = code >> man_bits, code & ((1 << man_bits) - 1)
    frac = m / (1 << man_bits)
    vals = np.where(e == 0, frac * 2.0 ** (1 - bias), (1 + frac) * 2.0 ** (e - bias))
    top = e == (1 << exp_bits) - 1
    vals[top & (m == (1 << man_bits) - 1) if exp_bits == 4 else top] = np.nan
    return vals


class Fp8(Encoding):
    """fp8 codes (OCP e4m3fn or e5m2, as uint8) with one float32 scale per token and kv head
    for keys and for values (as vLLM and SGLang store fp8 KV): ``x = fp8(code) * scale``,
    scale = max|row| / the format's largest finite value, codes rounded to nearest (ties to
    even). Chunks, queries and results are float32; no position groups, so slot p mod R
    holds position p (``anchored``) as int8's does."""

    quantised = True
    aux_rows = (1, 1)  # k_scale, v_scale: one per slot

    def __init__(self, fmt: str, names: tuple[str, ...]) -> None:
        super().__init__(np.uint8, names, by_dtype=False)
        self.io_dtype = np.dtype(np.float32)
        self.copyable = False
        self.fmt = fmt
        vals = _fp8_values(4 if fmt == "e4m3" else 5)
        self._values = vals  # decode table of the non-negative codes
        self._finite = np.flatnonzero(np.isfinite(vals))  # codes in increasing value
        self._max = float(vals[self._finite[-1]])

    @property
    def anchored(self) -> bool:
        return True  # per-token scales: a resize or truncate keeps position p in slot p mod R

    def bytes_per_token_head(self, d: int, dv: int) -> float:
        return d + dv + 8

    def aux_specs(self, lead, R, d, dv):
        return [(lead + (R,), np.float32), (lead + (R,), np.float32)]

    def dtype_error(self, name, x):
        return TypeError(
            f"{name} has dtype {dtype_name(x.dtype)} but an fp8 cache takes float32 k, v "
            "and q; cast it first (x.to(torch.float32) / x.astype(np.float32))"
        )

    check_values = Int8.check_values  # finite values only, checked before anything changes

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(codes uint8 (..., dim), scales float32 (...)) of finite float32 rows x (..., dim)."""
        amax = np.abs(x).max(axis=-1)
        scale = np.where(amax > 0, amax / np.float32(self._max), 1).astype(np.float32)
        a = np.minimum(np.abs(x) / scale[..., None].astype(np.float64), self._max)
        vals = self._values[self._finite]
        hi = np.minimum(np.searchsorted(vals, a), len(vals) - 1)  # first value >= a
        lo = np.maximum(hi - 1, 0)
        dl, dh = a - vals[lo], vals[hi] - a
        up = (dh < dl) | ((dh == dl) & (self._finite[hi] % 2 == 0))  # ties to the even code
        code = self._finite[np.where(up, hi, lo)].astype(np.uint8)
        return code | (np.signbit(x).astype(np.uint8) << 7), scale

    def write(self, k, v, kc, vc, aux, stage, stage_grp, pos0, count, before, after):
        """Encode rows t < count[b] of k (B, H_kv, L, d), v at positions pos0[b] + t into
        slot (pos0[b] + t) mod R of kc, vc and their scales aux (only the last R rows stay)."""
        self.check_values(k, v, count)  # before any slot changes
        R = kc.shape[2]
        for b in range(k.shape[0]):
            t = np.arange(max(0, int(count[b]) - R), int(count[b]))
            slots = (pos0[b] + t) % R
            for x, codes, scales in ((k, kc, aux[0]), (v, vc, aux[1])):
                codes[b][:, slots], scales[b][:, slots] = self.encode(x[b][:, t])

    def decode(self, which, x, aux, rows):
        s = aux[0] if which == "k" else aux[1]
        sign = np.where(x[:, rows] >> 7, -1.0, 1.0)
        mag = self._values[x[:, rows] & 0x7F]
        return (sign * mag * s[:, rows, None]).astype(np.float32)

    def quant_args(self, aux):
        return _dispatch.QuantArgs(self.fmt, aux)


ENCODINGS: list[Encoding] = [
    Encoding(np.float32, ("float32",)),  # names: torch.float32 too
    Encoding(np.float64, ("float64",)),
    Encoding(F16, ("float16", "half", "fp16")),
    Encoding(BF16, ("bfloat16", "bf16"), by_dtype=False),  # uint16 bits: bfloat16 by name
    Int8(),
    Fp8("e4m3", ("float8_e4m3", "float8_e4m3fn", "fp8_e4m3")),  # ml_dtypes / torch names
    Fp8("e5m2", ("float8_e5m2", "fp8_e5m2")),
]
PLAIN_NAMES = ", ".join(e.label for e in ENCODINGS if not e.quantised)
CODED_NAMES = ", ".join(e.label for e in ENCODINGS if e.quantised)


def encoding_for(dtype: Any) -> Encoding:
    """The encoding of a cache's dtype=: one of an encoding's names, its NumPy dtype, or a
    user-defined NumPy dtype of that name (ml_dtypes: bfloat16), or a torch dtype (by its
    name). TypeError naming the dtypes there are otherwise."""
    names = {str(dtype).replace("torch.", "")}
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is not None and dt.isbuiltin == 2:  # a user-defined type (ml_dtypes)
        names.add(dt.name)
    for e in ENCODINGS:
        if names.intersection(e.names) or (e.by_dtype and dt is not None and dt == e.dtype):
            return e
    plain = PLAIN_NAMES.rsplit(", ", 1)
    raise TypeError(
        f"dtype must be {' or '.join(plain)} (or {CODED_NAMES}, quantised), got {dtype!r}"
    )


# ---------------------------------------------------------------- the shared base


class KVStore:
    """The state and ``attend`` core both cache layouts share.

    A subclass sets encoding, dtype, io_dtype, num_kv_heads, head_dim, v_head_dim and
    window, and supplies ``_run`` (the kernel call), ``_arrays`` (every storage array, for
    out='s alias check) and ``_released`` (the window message's phrase).
    """

    encoding: Encoding
    window: int | None
    # (q's kind, shape, strides, scale) of the last attend whose checks passed, and the
    # checked scale: a plain call with the same key needs none of them again (_planned).
    _plan_key: Any = None
    _plan_scale = 0.0

    def _set_encoding(self, dtype: Any, unknown: str | None = None) -> None:
        """The encoding of dtype=; TypeError `unknown` (default: encoding_for's) for a dtype
        no encoding has."""
        try:
            enc = encoding_for(dtype)
        except TypeError:
            if unknown is None:
                raise
            raise TypeError(f"{unknown}, got dtype={dtype!r}") from None
        self.encoding = enc
        self.dtype, self.io_dtype = enc.dtype, enc.io_dtype

    def _check_chunk(self, x, name, B, dim):
        """A k / v chunk (B, H_kv, L_new, dim) of io_dtype, read as an array."""
        x = as_float_array(x, name, half=True)
        H = self.num_kv_heads
        if x.ndim != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != dim:
            raise ValueError(
                f"{name} has shape {shape_str(x)}, expected "
                f"(batch, num_kv_heads, L_new, {'d' if name == 'k' else 'dv'})"
                f" = ({B}, {H}, L_new, {dim})"
            )
        if x.dtype != self.io_dtype:
            raise self.encoding.dtype_error(name, x)
        return x

    def _check_append(self, k, v, B, lengths, rope):
        """append's arguments checked: (k, v as arrays, (B,) int64 rows per sequence)."""
        k = self._check_chunk(k, "k", B, self.head_dim)
        v = self._check_chunk(v, "v", B, self.v_head_dim)
        L = k.shape[2]
        if v.shape[2] != L:
            raise ValueError(
                f"k has shape {shape_str(k)} but v has shape {shape_str(v)}: lengths differ"
            )
        if rope is not None and not isinstance(rope, RoPE):
            raise TypeError(f"rope must be a positional.RoPE, got {type(rope).__name__}")
        if rope is not None and rope.head_dim != self.head_dim:
            raise ValueError(f"rope must be a RoPE with head_dim {self.head_dim}, got {rope!r}")
        new = np.full(B, L, dtype=np.int64) if lengths is None else None
        return k, v, check_seq_lens(lengths, "lengths", B, L) if new is None else new

    def _check_query(self, q, B, holds="the cache holds"):
        """q (B, H_q, L_new, d) of io_dtype with H_q a multiple of H_kv, read as an array.

        holds: how the message names where the B sequences come from."""
        q = as_float_array(q, "q", half=True)
        if q.ndim != 4:
            raise ValueError(f"q must be (B, H_q, L_new, d), got shape {shape_str(q)}")
        Bq, Hq, Lq, dq = q.shape
        if Bq != B:
            raise ValueError(f"q has shape {shape_str(q)}: batch {Bq} but {holds} {B} sequences")
        if dq != self.head_dim:
            raise ValueError(
                f"q has shape {shape_str(q)}: head dim {dq} but the cache stores keys of dim "
                f"{self.head_dim}"
            )
        if Hq % self.num_kv_heads != 0:
            raise ValueError(
                f"q has shape {shape_str(q)}: {Hq} heads is not a multiple "
                f"of the cache's {self.num_kv_heads} kv heads"
            )
        if q.dtype != self.io_dtype:
            raise self.encoding.dtype_error("q", q)
        return q

    def _unseen(self, ql, n, pos, causal):
        """0 when every valid query row's keys are stored; 1 when q_lens exceed the stored
        lengths n (causal), 2 when a row reaches back past what a window kept (pos: the
        sequences' positions). (B,) int64 arrays."""
        if self.window is None and len(ql) == 1:  # the same test on Python ints (cheaper)
            return 1 if causal and int(ql[0]) > int(n[0]) else 0
        if causal and (ql > n).any():
            return 1
        if self.window is not None:
            # The first query row of sequence b sits at position pos - ql and sees keys
            # from pos - ql - (window - 1) on, causal or not: they must still be stored.
            needed = np.maximum(0, pos - ql - (self.window - 1))
            if ((ql > 0) & (needed < pos - n)).any():
                return 2
        return 0

    def _planned(self, q, scale, plain):
        """attend's fast path. (q as an array, key): q is None unless the call is plain (no
        q_lens, out or lse) and its query's kind, shape and strides and its scale are the
        last checked call's (``_plan_key``), so that none of the query's checks need to run
        again; key is the plan key (None: the call cannot take the fast path)."""
        fast = fast_view(q) if plain and (scale is None or type(scale) is float) else None
        if fast is None:
            return None, None
        key = (fast[1], fast[0].shape, fast[0].strides, scale)
        return (fast[0] if key == self._plan_key else None), key

    def _run_planned(self, q, ql, scale, causal, sel):
        """The kernel on a planned query (``_planned``): a new (B, H_q, L_new, dv) array."""
        o = np.empty(q.shape[:3] + (self.v_head_dim,), dtype=self.io_dtype)
        if o.size:
            self._run(q, o, None, ql, self._plan_scale if scale is None else scale, causal, sel)
        return o

    def _attend(self, q, like, scale, causal, q_lens, return_lse, out, n, pos, ql0, sel, key):
        """attend after q was checked: q_lens (ql0 when None), the visibility
        checks, the scale, out= and the result. n, pos: (B,) stored lengths and positions;
        sel: what ``_run`` needs to find the sequences (and names them in messages); key:
        the plan key stored once the checks passed (``_planned``)."""
        B, Hq, Lq, d = q.shape
        ql = ql0 if q_lens is None else check_seq_lens(q_lens, "q_lens", B, Lq)
        unseen = self._unseen(ql, n, pos, causal)
        of = "" if sel is None else f" of sequences {sel[0]}"
        if unseen == 1:
            raise ValueError(
                f"q_lens {ql.tolist()} exceed the stored lengths {n.tolist()}{of}: "
                "append the chunk first"
            )
        if unseen == 2:
            needed = np.maximum(0, pos - ql - (self.window - 1))
            raise ValueError(
                f"q_lens {ql.tolist()}{of} reach back to positions {needed.tolist()}, but "
                f"{self._released(pos - n)} (window {self.window}); attend right after "
                "appending the chunk"
            )
        scale = check_scale(scale, d, self.io_dtype)
        if key is not None:
            self._plan_key, self._plan_scale = key, scale
        shape = (B, Hq, Lq, self.v_head_dim)
        res = Output.prepare(out, shape, self.io_dtype, like, self._arrays(q))
        lse = np.empty((B, Hq, Lq), dtype=compute_dtype(self.io_dtype)) if return_lse else None
        if res.array.size or (lse is not None and lse.size):
            self._run(q, res.array, lse, ql, scale, bool(causal), sel)
        return res.result(lse) if return_lse else res.result()

    def _decoded(self, which, x, aux, rows):
        """Stored keys / values through the encoding, bfloat16 as ml_dtypes where it can."""
        return half_result(self.encoding.decode(which, x, aux, rows))


class LayerStack:
    """One cache per layer of a model (``_caches``, set by the subclass): indexable
    (``caches[i]``, TypeError for a non-int, IndexError out of range), iterable,
    ``len()`` = num_layers; ``nbytes`` sums all layers; ``positions`` is layer 0's
    (every layer has the same after each step)."""

    _caches: list

    def __getitem__(self, i: int) -> Any:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"layer index must be an int, got {i!r}")
        n = len(self._caches)
        if not -n <= int(i) < n:
            raise IndexError(f"layer index {int(i)} out of range for {n} layers")
        return self._caches[int(i)]

    def __len__(self) -> int:
        return len(self._caches)

    def __iter__(self) -> Any:
        return iter(self._caches)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} layers, {self._caches[0]!r})"

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._caches)

    @property
    def positions(self) -> Any:
        return self._caches[0].positions
