"""Positional encodings: the original Transformer's sinusoids and rotary (RoPE).

Attention by itself is blind to order (permute the rows of X and the output
rows permute the same way), so positions are injected as vector arithmetic:

* additive (``sinusoidal``): a fixed table PE (L, D) added to the embeddings,
      PE[p, 2i]   = sin(p / base^(2i/D))
      PE[p, 2i+1] = cos(p / base^(2i/D))
* rotary (``RoPE``): each pair of query/key features is rotated by an angle
  proportional to the token's position,
      θ_i = base^(-2i/r),  i = 0 … r/2-1      (r = rotary dims, r <= d)
      (x_a, x_b) -> (x_a cos pθ_i - x_b sin pθ_i,  x_b cos pθ_i + x_a sin pθ_i)
  so <R(m) q, R(n) k> depends on m - n only. Which two features form pair i
  is a convention; both in use are supported:
      rotate-half (GPT-NeoX, Llama):  a = i,    b = i + r/2
      interleaved (GPT-J, RoFormer):  a = 2i,   b = 2i + 1
  Features r … d-1 are left unrotated (partial rotary: GPT-NeoX's rotary_pct,
  GPT-J's rotary_dim).

Shape legend: B batch, L positions, H heads, d head dim, r rotary dims.
"""

from __future__ import annotations

import numpy as np

from ._checks import shape_str

__all__ = ["sinusoidal", "RoPE", "rope_reference"]


def sinusoidal(L, D, *, base=10000.0, offset=0, dtype=np.float32):
    """The original Transformer's position table, to be added to embeddings.

    L : number of positions; D : model dim (odd D allowed: the last column is
    a sine). offset : int, or an int array of shape (B,) of per-sequence start
    positions (decode with a cache). Returns (L, D), or (B, L, D) when offset
    is an array; computed in float64 and returned in ``dtype``.
    """
    L, D = int(L), int(D)
    if L < 0 or D < 1:
        raise ValueError(f"sinusoidal needs L >= 0 and D >= 1, got L={L}, D={D}")
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

    The tables cos(pθ_i), sin(pθ_i) (positions p × r/2 frequencies) are
    computed once in float64 and cached per dtype; they grow (doubling) when a
    larger position is asked for. ``rope(x, offset=...)`` rotates a block of
    consecutive positions (a slice of the table, no gather); ``positions=``
    takes an explicit int array for ragged batches or ring buffers.
    """

    def __init__(self, head_dim, base=10000.0, rotary_dim=None, interleaved=False):
        head_dim = int(head_dim)
        rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        if rotary_dim < 0 or rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in [0, head_dim={head_dim}], got {rotary_dim}")
        base = float(base)
        if not base > 1.0:
            raise ValueError(f"base must be > 1, got {base}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = base
        self.interleaved = bool(interleaved)
        self.inv_freq = _inv_freq(rotary_dim, base) if rotary_dim else np.zeros(0)
        self._n = 0  # positions covered by the tables
        self._tables = {}  # dtype -> (cos, sin), each (n, r/2)

    def __repr__(self):
        conv = "interleaved" if self.interleaved else "rotate_half"
        return f"RoPE(head_dim={self.head_dim}, base={self.base:g}, rotary_dim={self.rotary_dim}, {conv})"

    # -- tables -------------------------------------------------------------
    def cos_sin(self, n, dtype=np.float64):
        """The cached tables for positions 0 … n-1: (cos, sin), each (n, r/2)."""
        dtype = np.dtype(dtype)
        if n > self._n:
            size = max(int(n), 2 * self._n, 64)
            angle = np.arange(size, dtype=np.float64)[:, None] * self.inv_freq  # (size, r/2)
            self._tables = {np.dtype(np.float64): (np.cos(angle), np.sin(angle))}
            self._n = size
        if dtype not in self._tables:
            c, s = self._tables[np.dtype(np.float64)]
            self._tables[dtype] = (c.astype(dtype), s.astype(dtype))
        c, s = self._tables[dtype]
        return c[:n], s[:n]

    def _angles_for(self, L, offset, positions, dtype):
        """cos, sin of shape (L, r/2) or (B, L, r/2) for the requested positions."""
        if positions is not None:
            pos = np.asarray(positions)
            if pos.dtype.kind not in "iu":
                raise TypeError(f"positions must be an int array, got dtype {pos.dtype}")
            if pos.ndim not in (1, 2) or pos.shape[-1] != L:
                raise ValueError(f"positions must have shape (L,) or (B, L) with L = {L}, got {shape_str(pos)}")
            if pos.size and pos.min() < 0:
                raise ValueError("positions must be >= 0")
            c, s = self.cos_sin(int(pos.max()) + 1 if pos.size else 0, dtype)
            return c[pos], s[pos]
        off = np.asarray(offset)
        if off.dtype.kind not in "iu":
            raise TypeError(f"offset must be an int or an int array, got dtype {off.dtype}")
        if off.ndim == 0:
            o = int(off)
            if o < 0:
                raise ValueError(f"offset must be >= 0, got {o}")
            c, s = self.cos_sin(o + L, dtype)
            return c[o:], s[o:]  # a slice of the table: no gather
        if off.ndim != 1:
            raise ValueError(f"offset must be an int or a (B,) int array, got shape {shape_str(off)}")
        if off.size and off.min() < 0:
            raise ValueError("offset must be >= 0")
        if off.size and np.all(off == off[0]):
            return self._angles_for(L, int(off[0]), None, dtype)
        pos = off[:, None] + np.arange(L)  # (B, L)
        return self._angles_for(L, 0, pos, dtype)

    # -- application --------------------------------------------------------
    def __call__(self, x, *, offset=0, positions=None, seq_axis=-3, out=None, inplace=False):
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
        Otherwise a new C-contiguous array is returned. Computed in x's dtype.
        """
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        if x.dtype.kind != "f":
            raise TypeError(f"x must be a float array, got dtype {x.dtype}")
        if x.ndim < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x has shape {shape_str(x)}, expected last axis head_dim = {self.head_dim}")
        ax = seq_axis + x.ndim if seq_axis < 0 else seq_axis
        if not 0 <= ax < x.ndim - 1:
            raise ValueError(f"seq_axis={seq_axis} is not a position axis of x with shape {shape_str(x)}")
        if inplace:
            if out is not None:
                raise ValueError("pass either inplace=True or out=, not both")
            if not x.flags.writeable:
                raise ValueError("x is read-only; cannot rotate in place")
            y = x
        elif out is not None:
            if out.shape != x.shape or out.dtype != x.dtype:
                raise ValueError(f"out has shape {shape_str(out)} dtype {out.dtype}, expected {shape_str(x)} {x.dtype}")
            out[...] = x
            y = out
        else:
            y = np.array(x, order="C")
        r = self.rotary_dim
        if r == 0 or x.size == 0:
            return y
        L = x.shape[ax]
        c, s = self._angles_for(L, offset, positions, x.dtype)  # (L, r/2) or (B, L, r/2)
        # Broadcast the tables against y: positions on axis `ax`, batch (if
        # any) on axis 0, frequencies last, ones elsewhere.
        shape = [1] * x.ndim
        shape[ax], shape[-1] = L, r // 2
        if c.ndim == 3:
            if ax == 0:
                raise ValueError("per-sequence positions need a batch axis before seq_axis")
            if c.shape[0] != x.shape[0]:
                raise ValueError(f"offset/positions give {c.shape[0]} sequences but x has shape {shape_str(x)}")
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


def rope_reference(x, positions, *, base=10000.0, rotary_dim=None, interleaved=False):
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
