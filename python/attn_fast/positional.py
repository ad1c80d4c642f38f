"""Positional encodings: the original Transformer's sinusoids and rotary (RoPE).

Attention by itself is blind to order (permute the rows of X and the output
rows permute the same way), so positions are injected as vector arithmetic:

* additive (``sinusoidal``): a fixed table PE (L, D) added to the embeddings, ::

      PE[p, 2i]   = sin(p / base^(2i/D))
      PE[p, 2i+1] = cos(p / base^(2i/D))

* rotary (``RoPE``): each pair of query/key features is rotated by an angle
  proportional to the token's position, ::

      θ_i = base^(-2i/r),  i = 0 … r/2-1      (r = rotary dims, r <= d)
      (x_a, x_b) -> (x_a cos pθ_i - x_b sin pθ_i,  x_b cos pθ_i + x_a sin pθ_i)

  so <R(m) q, R(n) k> depends on m - n only. Which two features form pair i
  is a convention; both in use are supported::

      rotate-half (GPT-NeoX, Llama):  a = i,    b = i + r/2
      interleaved (GPT-J, RoFormer):  a = 2i,   b = 2i + 1

  Features r … d-1 are left unrotated (partial rotary: GPT-NeoX's rotary_pct,
  GPT-J's rotary_dim).

Shape legend: B batch, L positions, H heads, d head dim, r rotary dims.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _cyloops, _loops
from ._checks import (
    HALF_DTYPES,
    _BF16Bits,
    as_array,
    as_float_array,
    as_out_array,
    check_int,
    check_real,
    check_same_dtype,
    dtype_name,
    from_float,
    self_overlapping,
    shape_str,
    to_float,
    to_input_kind,
)
from ._lowp import layer_dtype

__all__ = ["sinusoidal", "RoPE", "rope_reference"]

# Positions RoPE accepts (offset + L included): below 2^31, as the kernels'
# position arithmetic and the KV cache expect.
MAX_POSITION = 2**31
# RoPE caches cos/sin for positions 0 .. TABLE_MAX - 1 at most (doubling as
# needed; 8192 x 64 frequencies x (cos, sin) is 8 MiB in float64). Calls that
# reach past it compute cos/sin for the positions they rotate only, O(tokens * r)
# per call: memory stays bounded however long a generation runs.
TABLE_MAX = 8192


def sinusoidal(
    L: int,
    D: int,
    *,
    base: float = 10000.0,
    offset: int | ArrayLike = 0,
    dtype: DTypeLike = np.float32,
) -> np.ndarray:
    """The original Transformer's position table, to be added to embeddings.

    L : number of positions; D : model dim (odd D allowed: the last column is
    a sine). offset : int, or an int array of shape (B,) of per-sequence start
    positions (decode with a cache). base : a finite number > 0. Returns
    (L, D), or (B, L, D) when offset is an array; computed in float64 and
    returned in ``dtype``: float32, float64, float16 or bfloat16 (given as
    "bfloat16", ``ml_dtypes.bfloat16`` or torch.bfloat16; returned as an
    ``ml_dtypes.bfloat16`` NumPy array, which needs ml_dtypes), rounded once.
    Non-integer L, D or offset, or another dtype, raise TypeError; L < 0,
    D < 1 or a bad base raise ValueError.
    """
    L, D = check_int(L, "L"), check_int(D, "D")
    if L < 0 or D < 1:
        raise ValueError(f"sinusoidal needs L >= 0 and D >= 1, got L={L}, D={D}")
    base = check_real(base, "base", positive=True)
    dtype = layer_dtype(dtype)  # float32 / float64 / float16 / ml_dtypes.bfloat16
    off = np.asarray(offset)
    if off.dtype.kind not in "iu":
        raise TypeError(f"offset must be an int or an int array, got dtype {off.dtype}")
    if off.ndim > 1:
        raise ValueError(f"offset must be an int or a (B,) int array, got shape {shape_str(off)}")
    pos = off[..., None].astype(np.float64) + np.arange(L, dtype=np.float64)  # (L,) or (B, L)
    inv_freq = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)  # (ceil(D/2),)
    angle = pos[..., None] * inv_freq  # (…, L, ceil(D/2))
    pe = np.empty(pos.shape + (D,), dtype=np.float64)
    pe[..., 0::2] = np.sin(angle)
    pe[..., 1::2] = np.cos(angle[..., : D // 2])
    return pe.astype(dtype, copy=False)


def _inv_freq(rotary_dim, base):
    """θ_i = base^(-2i/r), i = 0 … r/2-1, float64."""
    return base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


class RoPE:
    """Rotary position embedding, vectorised; cos/sin tables cached on the object.

    Parameters
    ----------
    head_dim : d, the per-head feature count of the arrays it will rotate.
    base : θ base (10000 for the original RoPE and Llama 2, 500000 for Llama 3).
    rotary_dim : r, the number of leading features rotated (even, <= d);
        default d. The remaining d - r features pass through unchanged.

    interleaved : False for rotate-half (GPT-NeoX, Llama: pairs (i, i + r/2)),
        True for GPT-J / RoFormer (pairs (2i, 2i+1)).

    Notes
    -----
    The tables cos(pθ_i), sin(pθ_i) (positions p × r/2 frequencies) are
    computed in float64 (the angle p·θ_i too: at p = 10^6 float32 would be off
    by radians) and cached per dtype for positions below ``TABLE_MAX``; they
    grow (doubling) up to it. A call that reaches a larger position computes
    cos/sin for its own positions only (O(tokens · r), nothing cached), with
    the same formula, so results are identical. ``rope(x, offset=...)``
    rotates a block of consecutive positions (a slice of the table, no
    gather); ``positions=`` takes an explicit int array for ragged batches or
    ring buffers.
    """

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        rotary_dim: int | None = None,
        interleaved: bool = False,
    ) -> None:
        head_dim = check_int(head_dim, "head_dim", 1)
        rotary_dim = head_dim if rotary_dim is None else check_int(rotary_dim, "rotary_dim")
        if rotary_dim < 0 or rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(
                f"rotary_dim must be even and in [0, head_dim={head_dim}], got {rotary_dim}"
            )
        base = check_real(base, "base")
        if not base > 1.0:
            raise ValueError(f"base must be > 1, got {base}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = base
        self.interleaved = bool(interleaved)
        self.inv_freq = _inv_freq(rotary_dim, base) if rotary_dim else np.zeros(0)
        self._n = 0  # positions covered by the tables
        self._tables = {}  # dtype -> (cos, sin), each (n, r/2)

    def __repr__(self) -> str:
        conv = "interleaved" if self.interleaved else "rotate_half"
        return (
            f"RoPE(head_dim={self.head_dim}, base={self.base:g}, "
            f"rotary_dim={self.rotary_dim}, {conv})"
        )

    # -- tables -------------------------------------------------------------
    def cos_sin(self, n: int, dtype: DTypeLike = np.float64) -> tuple[np.ndarray, np.ndarray]:
        """Tables for positions 0 … n-1: (cos, sin), each (n, r/2) of dtype.

        Views of the cache when n <= ``TABLE_MAX``; computed (and not kept)
        beyond it.
        """
        dtype = np.dtype(dtype)
        n = int(n)
        if n > TABLE_MAX:
            return self._cos_sin_at(np.arange(n, dtype=np.int64), dtype)
        if n > self._n:
            size = min(max(n, 2 * self._n, 64), TABLE_MAX)
            c, s = self._cos_sin_at(np.arange(size, dtype=np.int64), np.float64)
            self._tables = {np.dtype(np.float64): (c, s)}
            self._n = size
        if dtype not in self._tables:
            c, s = self._tables[np.dtype(np.float64)]
            self._tables[dtype] = (c.astype(dtype), s.astype(dtype))
        c, s = self._tables[dtype]
        return c[:n], s[:n]

    def _cos_sin_at(self, pos, dtype):
        """cos, sin of p·θ_i for the int64 positions pos (any shape): pos.shape + (r/2,), dtype.

        The angle is formed in float64 (as the cached tables are), then cast."""
        angle = pos.astype(np.float64)[..., None] * self.inv_freq
        c, s = np.cos(angle), np.sin(angle)
        return c.astype(dtype, copy=False), s.astype(dtype, copy=False)

    def _rows(self, pos, dtype):
        """(cos, sin, idx): tables and int64 row indices, idx.shape == pos.shape, with
        cos[idx] the cosines at pos. The cached tables when every position is below
        ``TABLE_MAX`` (idx = pos), else rows computed for pos alone (idx = 0 … pos.size-1)."""
        if pos.size == 0 or int(pos.max()) < TABLE_MAX:
            c, s = self.cos_sin(int(pos.max()) + 1 if pos.size else 0, dtype)
            return c, s, pos
        c, s = self._cos_sin_at(pos.reshape(-1), dtype)
        return c, s, np.arange(pos.size, dtype=np.int64).reshape(pos.shape)

    def _positions(self, L, offset, positions):
        """Validated int64 positions (1 or B, L) and whether they are per sequence."""
        if positions is not None:
            pos = np.asarray(positions)
            if pos.dtype.kind not in "iu":
                raise TypeError(f"positions must be an int array, got dtype {pos.dtype}")
            if pos.ndim not in (1, 2) or pos.shape[-1] != L:
                raise ValueError(
                    f"positions must have shape (L,) or (B, L) with L = {L}, got {shape_str(pos)}"
                )
            if pos.size and pos.min() < 0:
                raise ValueError("positions must be >= 0")
            if pos.size and pos.max() >= MAX_POSITION:
                raise ValueError(f"positions must be < {MAX_POSITION}, got {pos.max()}")
            return pos.astype(np.int64, copy=False).reshape(-1, L), pos.ndim == 2
        off = np.asarray(offset)
        if off.dtype.kind not in "iu":
            raise TypeError(f"offset must be an int or an int array, got dtype {off.dtype}")
        if off.ndim == 0:
            o = int(off)
            if o < 0:
                raise ValueError(f"offset must be >= 0, got {o}")
            if o + L > MAX_POSITION:
                raise ValueError(f"offset + L must be <= {MAX_POSITION}, got {o} + {L}")
            return (o + np.arange(L, dtype=np.int64))[None], False
        if off.ndim != 1:
            raise ValueError(
                f"offset must be an int or a (B,) int array, got shape {shape_str(off)}"
            )
        if off.size and off.min() < 0:
            raise ValueError("offset must be >= 0")
        if off.size and int(off.max()) + L > MAX_POSITION:
            raise ValueError(f"offset + L must be <= {MAX_POSITION}, got {int(off.max())} + {L}")
        if off.size and np.all(off == off[0]):
            return self._positions(L, int(off[0]), None)
        return off.astype(np.int64)[:, None] + np.arange(L, dtype=np.int64), True

    def _angles_for(self, L, offset, positions, dtype):
        """cos, sin of shape (L, r/2) or (B, L, r/2) for the requested positions."""
        pos, per_seq = self._positions(L, offset, positions)
        c, s, idx = self._rows(pos, dtype)
        if positions is None and not per_seq:
            o = int(idx[0, 0]) if L else 0
            return c[o : o + L], s[o : o + L]  # a slice of the table: no gather
        if not per_seq:
            return c[idx[0]], s[idx[0]]
        return c[idx], s[idx]

    # -- application --------------------------------------------------------
    def _check_x(self, x, seq_axis, name="x"):
        if not isinstance(x, np.ndarray):
            x = as_array(x, name)  # a tensor that requires grad is read detached
        seq_axis = check_int(seq_axis, "seq_axis")
        if x.dtype.kind != "f":
            raise TypeError(f"{name} must be a float array, got dtype {x.dtype}")
        if x.ndim < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{name} has shape {shape_str(x)}, expected last axis head_dim = {self.head_dim}"
            )
        ax = seq_axis + x.ndim if seq_axis < 0 else seq_axis
        if not 0 <= ax < x.ndim - 1:
            raise ValueError(
                f"seq_axis={seq_axis} is not a position axis of {name} with shape {shape_str(x)}"
            )
        return x, ax

    def _target(self, x, out, inplace, name="x"):
        """The array the result goes to: x itself, out, or a new C-contiguous
        one (not yet filled)."""
        if inplace:
            if out is not None:
                raise ValueError("pass either inplace=True or out=, not both")
            if not x.flags.writeable:
                raise ValueError(f"{name} is read-only; cannot rotate in place")
            if self_overlapping(x):
                raise ValueError(
                    f"{name} has overlapping memory (strides {x.strides}); cannot rotate in place"
                )
            return x
        if out is not None:
            if not isinstance(out, np.ndarray) or out.shape != x.shape or out.dtype != x.dtype:
                raise ValueError(
                    f"out has shape {shape_str(out)} dtype {getattr(out, 'dtype', None)}, "
                    f"expected {shape_str(x)} {x.dtype}"
                )
            if not out.flags.writeable:
                raise ValueError("out is read-only")
            if self_overlapping(out):
                raise ValueError(
                    f"out has overlapping memory (strides {out.strides} for shape {shape_str(out)})"
                )
            return out
        return np.empty(x.shape, dtype=x.dtype)

    def __call__(
        self,
        x: ArrayLike,
        *,
        offset: int | ArrayLike = 0,
        positions: ArrayLike | None = None,
        seq_axis: int = -3,
        out: ArrayLike | None = None,
        inplace: bool = False,
    ) -> Any:
        """Rotate x by its positions; returns the rotated array.

        x : float32/float64 array whose last axis is head_dim and whose
            ``seq_axis`` indexes positions: (B, L, H, d) or (L, H, d) with the
            default seq_axis=-3; (B, H, L, d) or (L, d) with seq_axis=-2.
            Any strides.
        offset : position of x's first token along seq_axis (an int), or a
            (B,) int array of per-sequence offsets (e.g. ``cache.positions``).
        positions : an explicit int array, (L,) or (B, L), instead of offset.
        inplace : rotate x itself (it must be writeable) and return it.
        out : write the result into this array (same shape and dtype as x).
        Otherwise a new C-contiguous array is returned. Computed in x's dtype,
        in one pass by ``_cyloops.rope`` (float32/float64 in the layouts
        above), else by the NumPy formula ``_rope_numpy``.

        16-bit x (NumPy float16, ``ml_dtypes.bfloat16``, torch.float16 /
        torch.bfloat16) is rotated in float32 from its values and rounded once
        to its dtype; the result has x's dtype and kind (a torch tensor for
        torch input; with ``inplace`` or ``out`` that object itself).
        """
        if _is_half(x) or (out is not None and _is_half(out)):
            return self._call_half(x, offset, positions, seq_axis, out, inplace)
        x, ax = self._check_x(x, seq_axis)
        y = self._target(x, out, inplace)
        if self.rotary_dim and x.size and _loops.USE_CYTHON:
            if self._rope_cython([(x, y)], ax, offset, positions):
                return y
        if y is not x:
            y[...] = x
        if self.rotary_dim == 0 or x.size == 0:
            return y
        return self._rope_numpy(y, ax, offset, positions)

    def rotate_qk(
        self,
        q: ArrayLike,
        k: ArrayLike,
        *,
        offset: int | ArrayLike = 0,
        positions: ArrayLike | None = None,
        seq_axis: int = -3,
        inplace: bool = False,
    ) -> tuple[Any, Any]:
        """Rotate queries and keys at the same positions, in one pass; returns (q_rot, k_rot).

        q : (…, L, H_q, d) and k : (…, L, H_kv, d) with seq_axis=-3 (or
        (B, H, L, d) with seq_axis=-2): the same layout, dtype and positions,
        head counts may differ (GQA). Each cos/sin row is loaded once for
        both. inplace=True rotates q and k themselves; otherwise new
        C-contiguous arrays are returned. Same result as two ``__call__``.
        """
        if _is_half(q) or _is_half(k):  # float32 from the values, one rounding (see __call__)
            check_same_dtype(
                q=as_float_array(q, "q", half=True), k=as_float_array(k, "k", half=True)
            )
            kw = dict(offset=offset, positions=positions, seq_axis=seq_axis, inplace=inplace)
            if inplace and _overlap(
                *(as_float_array(x, n, half=True) for x, n in ((q, "q"), (k, "k")))
            ):
                raise ValueError("q and k share memory: rotate_qk(inplace=True) would rotate twice")
            return self(q, **kw), self(k, **kw)
        q, ax = self._check_x(q, seq_axis, "q")
        k, axk = self._check_x(k, seq_axis, "k")
        if q.dtype != k.dtype:
            raise TypeError(f"q has dtype {q.dtype} but k has dtype {k.dtype}")
        if q.ndim != k.ndim or q.shape[ax] != k.shape[axk]:
            raise ValueError(
                f"q has shape {shape_str(q)} but k has shape {shape_str(k)}: positions differ"
            )
        if inplace and _overlap(q, k):
            raise ValueError(
                "q and k share memory: rotate_qk(inplace=True) would rotate those elements twice; "
                "pass disjoint arrays (e.g. the q and k slices of a packed qkv) or inplace=False"
            )
        if self.rotary_dim and q.size and k.size and _loops.USE_CYTHON:
            qy, ky = self._target(q, None, inplace, "q"), self._target(k, None, inplace, "k")
            if self._rope_cython([(q, qy), (k, ky)], ax, offset, positions):
                return qy, ky
        kw = dict(offset=offset, positions=positions, seq_axis=seq_axis, inplace=inplace)
        return self(q, **kw), self(k, **kw)

    def _call_half(self, x, offset, positions, seq_axis, out, inplace):
        """__call__ for 16-bit x: rotated in float32, rounded once to x's dtype."""
        like = x
        a = as_float_array(x, "x", half=True)  # float16, or bfloat16 bits; x's memory if it can
        if a.dtype not in HALF_DTYPES:
            raise TypeError(
                f"out has a 16-bit dtype but x has dtype {a.dtype}; pass an out of x's dtype"
            )
        y = from_float(
            self(to_float(a, np.float32), offset=offset, positions=positions, seq_axis=seq_axis),
            a.dtype,
        )
        if inplace:
            if out is not None:
                raise ValueError("pass either inplace=True or out=, not both")
            base = as_array(x, "x")
            if not (base.flags.writeable and np.shares_memory(a, base)):
                raise ValueError("x is read-only (or not aligned); cannot rotate in place")
            a[...] = y
            return x
        if out is not None:
            o = as_out_array(out)
            if o.shape != a.shape or o.dtype != a.dtype:
                raise ValueError(
                    f"out has shape {shape_str(o)} dtype {dtype_name(o.dtype)}, expected "
                    f"{shape_str(a)} {dtype_name(a.dtype)}"
                )
            o[...] = y
            return out
        return to_input_kind(y, like)

    def _rope_cython(self, pairs, ax, offset, positions):
        """Rotate each (src, dst) pair with ``_cyloops.rope``; False (nothing
        done) if a layout needs NumPy."""
        x0 = pairs[0][0]
        if x0.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            return False
        views = [(_loops.as_blhd(x, ax), _loops.as_blhd(y, ax)) for x, y in pairs]
        if any(v is None for pair in views for v in pair):
            return False
        L = x0.shape[ax]
        pos, per_seq = self._positions(L, offset, positions)
        if per_seq:
            if ax == 0:
                raise ValueError("per-sequence positions need a batch axis before seq_axis")
            for x, _ in pairs:
                if pos.shape[0] != x.shape[0]:
                    raise ValueError(
                        f"offset/positions give {pos.shape[0]} sequences but x has shape "
                        f"{shape_str(x)}"
                    )
        c, s, pos = self._rows(pos, x0.dtype)
        srcs = []
        for (x, y), (xv, yv) in zip(pairs, views):
            if y is not x and np.may_share_memory(
                x, y
            ):  # overlapping out=: copy, then rotate in place
                y[...] = x
                xv = yv
            srcs.append((xv, yv))
        if len(srcs) == 2 and srcs[0][0].shape[:2] == srcs[1][0].shape[:2]:
            (xq, yq), (xk, yk) = srcs
            _cyloops.rope(xq, yq, xk, yk, c, s, pos, self.interleaved, num_threads=_loops.threads())
        else:
            for xv, yv in srcs:
                _cyloops.rope(
                    xv, yv, None, None, c, s, pos, self.interleaved, num_threads=_loops.threads()
                )
        return True

    def _rope_numpy(self, y, ax, offset, positions):
        """The NumPy formula (the reference the Cython loop is tested against):
        rotate y in place."""
        r = self.rotary_dim
        L = y.shape[ax]
        c, s = self._angles_for(L, offset, positions, y.dtype)  # (L, r/2) or (B, L, r/2)
        # Broadcast the tables against y: positions on axis `ax`, batch (if
        # any) on axis 0, frequencies last, ones elsewhere.
        shape = [1] * y.ndim
        shape[ax], shape[-1] = L, r // 2
        if c.ndim == 3:
            if ax == 0:
                raise ValueError("per-sequence positions need a batch axis before seq_axis")
            if c.shape[0] != y.shape[0]:
                raise ValueError(
                    f"offset/positions give {c.shape[0]} sequences but x has shape {shape_str(y)}"
                )
            shape[0] = c.shape[0]
        c, s = c.reshape(shape), s.reshape(shape)
        if self.interleaved:
            a, b = y[..., 0:r:2], y[..., 1:r:2]
        else:
            a, b = y[..., : r // 2], y[..., r // 2 : r]
        new_a = a * c - b * s
        b *= c
        b += a * s
        a[...] = new_a
        return y


def _is_half(x):
    """True for 16-bit float data: NumPy float16, ml_dtypes.bfloat16, torch.float16 /
    torch.bfloat16 (or bfloat16 bits tagged by attn_fast)."""
    if isinstance(x, _BF16Bits):
        return True
    dt = getattr(x, "dtype", None)
    if isinstance(dt, np.dtype):  # any byte order
        return (dt.kind == "f" and dt.itemsize == 2) or dt.name == "bfloat16"
    return str(dt) in ("torch.float16", "torch.bfloat16")


def _overlap(a, b):
    """True if a and b have an element in common (exactly, for disjoint slices of
    one packed array too); True as well when that is too costly to decide."""
    try:
        return bool(np.shares_memory(a, b, max_work=10**6))
    except np.exceptions.TooHardError:
        return True


def rope_reference(
    x: ArrayLike,
    positions: ArrayLike,
    *,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    interleaved: bool = False,
) -> np.ndarray:
    """The rotation written out with complex numbers, in float64 (the oracle).

    x : (…, L, d) with positions (L,). Pair i of features (a_i, b_i) is the
    complex number z_i = x_a + i x_b; RoPE multiplies it by e^{i p θ_i}.
    """
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    r = d if rotary_dim is None else rotary_dim
    theta = base ** (-np.arange(0, r, 2) / r)  # (r/2,)
    p = np.asarray(positions, dtype=np.float64)[:, None]  # (L, 1)
    rot = np.exp(1j * p * theta)  # (L, r/2)
    ia = np.arange(0, r, 2) if interleaved else np.arange(r // 2)
    ib = ia + 1 if interleaved else ia + r // 2
    z = (x[..., ia] + 1j * x[..., ib]) * rot
    y = x.copy()
    y[..., ia], y[..., ib] = z.real, z.imag
    return y
