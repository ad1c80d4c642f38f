"""What the test files share: seeded inputs, layouts, poisoned buffers, the oracle assertion.

Fixtures stay in conftest.py (``isa``, ``rng``); this module is plain functions,
imported as ``from helpers import ...`` (pytest puts tests/ on sys.path).

- Inputs: ``randn`` (one array) and ``qkv`` (q, k, v in (B, H, L, d) layout,
  any dtype, contiguous or one of the ``relayout`` memory layouts, the values
  unchanged by the layout); ``random_mask`` (boolean, with fully masked rows
  where asked) and ``random_bias`` (additive, with -inf holes).
- ``poisoned``: an output buffer full of NaN, so an element the kernel skips
  shows.
- The oracle assertion: ``assert_close`` (``np.testing.assert_allclose`` with
  the per-dtype tolerances of ``tol``, whose message names the largest error
  and where it is), ``assert_lse_close`` (the -inf pattern of fully masked rows
  exactly, the finite entries within tolerance) and ``assert_attention`` (both).
- ``run_sdpa``: the public kernel called on a poisoned ``out=``; ``run_python`` and
  ``run_json``: a script in a fresh interpreter (its own environment, threads, limits).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attn_fast as af

F32, F64 = np.float32, np.float64

# ---------------------------------------------------------------- tolerances


def tol(dtype):
    """rtol/atol of a float32 (or float64) kernel result against the float64 oracle."""
    return (
        dict(rtol=2e-4, atol=2e-5)
        if np.dtype(dtype) == np.float32
        else dict(rtol=1e-10, atol=1e-11)
    )


# ---------------------------------------------------------------- inputs


def randn(rng, shape, dtype=np.float32, scale=1.0):
    """Standard normal values of `shape`, times `scale`, cast to `dtype` (drawn in float64)."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def misaligned(a):
    """A copy of `a` whose data starts at an odd byte address (np.frombuffer offset=1)."""
    buf = np.zeros(a.nbytes + 1, np.uint8)
    out = np.frombuffer(buf.data, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    out[...] = a
    assert not out.flags.aligned or a.itemsize == 1
    return out


def big_endian(a):
    """A copy of `a` in big-endian byte order."""
    return a.astype(a.dtype.newbyteorder(">"))


def reversed_view(a):
    """A negative-stride view (every axis reversed) holding the same values as `a`."""
    return np.flip(np.flip(a).copy())


def fortran(a):
    """A column-major copy of `a`."""
    return np.asfortranarray(a)


def readonly(a):
    """A copy of `a` that cannot be written."""
    a = a.copy()
    a.flags.writeable = False
    return a


def transposed(a):
    """A view with the same values whose last-but-one axis is not the contiguous one:
    the data is stored (..., L, H, d) and viewed as (..., H, L, d). Needs ndim >= 3."""
    return np.ascontiguousarray(np.swapaxes(a, -2, -3)).swapaxes(-2, -3)


def strided(a):
    """A view with the same values whose last axis has stride 2 elements."""
    buf = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    buf[..., ::2] = a
    return buf[..., ::2]


# Unusual layouts of valid data (the hardening tests run every public entry point
# on each); the values are those of the input, only the memory differs.
UNUSUAL_LAYOUTS = {
    "misaligned": misaligned,
    "big_endian": big_endian,
    "neg_stride": reversed_view,
    "fortran": fortran,
    "readonly": readonly,
}
LAYOUTS = {"contiguous": np.asarray, "transposed": transposed, "strided": strided}
LAYOUTS.update(UNUSUAL_LAYOUTS)


def relayout(a, layout):
    """`a` with the same shape and values in the memory layout named `layout` (a key of LAYOUTS)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    return LAYOUTS[layout](a)


def qkv(rng, B=2, Hq=3, Hkv=None, Lq=9, Lk=11, d=5, dv=7, dtype=np.float32, layout="contiguous"):
    """Seeded q (B, Hq, Lq, d), k (B, Hkv, Lk, d), v (B, Hkv, Lk, dv) of `dtype`.

    Hkv defaults to Hq. Drawn in that order with ``randn``; `layout` (a key of
    LAYOUTS) changes the memory of each, not its values.
    """
    Hkv = Hq if Hkv is None else Hkv
    q = randn(rng, (B, Hq, Lq, d), dtype)
    k = randn(rng, (B, Hkv, Lk, d), dtype)
    v = randn(rng, (B, Hkv, Lk, dv), dtype)
    return relayout(q, layout), relayout(k, layout), relayout(v, layout)


def random_mask(rng, shape, keep=0.7, dead_rows=()):
    """Boolean visibility of `shape` (..., Lq, Lk), True = attend: each (query, key)
    pair visible with probability `keep` (drawn as ``rng.random(shape) < keep``); the
    query rows listed in `dead_rows` see no key at all (fully masked rows)."""
    m = rng.random(shape) < keep
    if len(dead_rows):
        m[..., list(dead_rows), :] = False
    return m


def random_bias(rng, shape, holes=0.2, dtype=np.float64):
    """Additive float mask of `shape`: standard normal in `dtype`, with -inf (a masked
    pair) at each entry with probability `holes` (drawn after the values)."""
    b = randn(rng, shape, dtype)
    b[rng.random(shape) < holes] = -np.inf
    return b


# Values that are not ints where a count is expected, and what each raises.
NOT_INTS = [
    (2.5, TypeError),
    (True, TypeError),
    (np.True_, TypeError),
    ("3", TypeError),
    (None, TypeError),
]


def poisoned(shape, dtype):
    """An output buffer full of NaN, so any element the kernel skips is caught."""
    return np.full(shape, np.nan, dtype=dtype)


# ---------------------------------------------------------------- state of caches and modules


def snapshot_cache(cache):
    """What a KVCache holds (lengths, positions, capacity, every key and value), copied."""
    return (
        len(cache),
        cache.lengths,
        cache.positions,
        cache.capacity,
        [(cache.keys(b).copy(), cache.values(b).copy()) for b in range(cache.batch)],
    )


def assert_same_cache(cache, snap):
    """The cache holds what `snap` (a ``snapshot_cache``) recorded:
    a failed call changed nothing."""
    now = snapshot_cache(cache)
    assert now[0] == snap[0] and now[3] == snap[3]
    np.testing.assert_array_equal(now[1], snap[1])
    np.testing.assert_array_equal(now[2], snap[2])
    for (k0, v0), (k1, v1) in zip(snap[4], now[4]):
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)


def bad_weights(sd, name, value):
    """A copy of state dict `sd` with `name` set to `value` (and another, good weight
    changed, which a rejected load must not copy either)."""
    w = {k: v.copy() for k, v in sd.items()}
    w[name] = value
    first = next(iter(sd))
    if first != name:
        w[first] = np.full_like(sd[first], 7)  # a good weight that must not be copied either
    return w


# ---------------------------------------------------------------- the oracle assertion


def _as_f64(x):
    x = np.asarray(x)
    return x if x.dtype == np.float64 else x.astype(np.float64)


def assert_close(got, want, dtype=None, *, what="out", where=None, rtol=None, atol=None):
    """``np.testing.assert_allclose(got, want, **tol(dtype))`` with a message that says where.

    dtype: the kernel's dtype, choosing the tolerances (default: got's dtype);
    rtol/atol override them. NaN must face NaN and ±inf the same infinity.
    where: optional boolean array of got's shape; only those entries are compared.
    On failure the message names `what`, how many entries are off, and the
    worst one: its index, both values, its absolute and relative error.
    """
    got_a, want_a = np.asarray(got), np.asarray(want)
    if got_a.shape != want_a.shape and want_a.ndim and got_a.ndim:
        raise AssertionError(f"{what}: shape {got_a.shape} but the oracle has {want_a.shape}")
    t = tol(got_a.dtype if dtype is None else dtype)
    rtol = t["rtol"] if rtol is None else rtol
    atol = t["atol"] if atol is None else atol
    g, w = np.broadcast_arrays(_as_f64(got_a), _as_f64(want_a))
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(g - w)
        near = np.isfinite(g) & np.isfinite(w) & (err <= atol + rtol * np.abs(w))
        ok = (np.isnan(g) & np.isnan(w)) | (g == w) | near
    if where is not None:
        ok = ok | ~np.broadcast_to(np.asarray(where, bool), ok.shape)
    if ok.all():
        return
    bad = ~ok
    err = np.where(bad, np.nan_to_num(err, nan=np.inf), -1.0)
    worst = np.unravel_index(int(np.argmax(err)), err.shape) if err.ndim else ()
    gw, ww, ew = g[worst], w[worst], err[worst]
    rel = ew / abs(ww) if ww != 0 and np.isfinite(ww) else np.inf
    raise AssertionError(
        f"{what}: {int(bad.sum())} of {bad.size} entries differ from the oracle beyond "
        f"rtol={rtol:g}, atol={atol:g}; worst at index {tuple(int(i) for i in worst)}: "
        f"got {float(gw)!r}, oracle {float(ww)!r}, abs error {ew:.3g}, rel error {rel:.3g}"
    )


def assert_lse_close(lse, LSE, dtype=None, *, what="lse", rtol=None, atol=None):
    """The log-sum-exp against the oracle's: finite at the same places, -inf (rows
    that see no key) at the same places, the finite entries within ``tol(dtype)``
    (or rtol/atol). A NaN or +inf of the oracle's must face a NaN or +inf."""
    lse_a, LSE_a = np.asarray(lse), np.asarray(LSE)
    if lse_a.shape != LSE_a.shape:
        raise AssertionError(f"{what}: shape {lse_a.shape} but the oracle has {LSE_a.shape}")
    g, w = _as_f64(lse_a), _as_f64(LSE_a)
    for name, test in (("-inf (a row that sees no key)", np.isneginf), ("not finite", _nonfinite)):
        differ = test(g) != test(w)
        if differ.any():
            diff = np.argwhere(differ)
            i = tuple(int(j) for j in diff[0])
            raise AssertionError(
                f"{what}: {name} at {len(diff)} place(s) where the oracle disagrees; "
                f"first at index {i}: got {float(g[i])!r}, oracle {float(w[i])!r}"
            )
    assert_close(lse_a, LSE_a, dtype, what=what, where=np.isfinite(w), rtol=rtol, atol=atol)


def _nonfinite(x):
    return ~np.isfinite(x)


def assert_attention(o, lse, O, LSE, dtype=None, *, rtol=None, atol=None):
    """Output and (when `lse` is not None) log-sum-exp against the oracle's O, LSE."""
    assert_close(o, O, dtype, what="out", rtol=rtol, atol=atol)
    if lse is not None:
        assert_lse_close(lse, LSE, dtype, rtol=rtol, atol=atol)


# ---------------------------------------------------------------- calls


def run_sdpa(q, k, v, dtype=None, **kw):
    """``scaled_dot_product_attention(q, k, v, return_lse=True, **kw)`` written into a
    poisoned ``out=`` of `dtype` (default q's); returns (out, lse)."""
    dtype = q.dtype if dtype is None else dtype
    out = poisoned(q.shape[:-1] + (v.shape[-1],), dtype)
    o, lse = af.scaled_dot_product_attention(q, k, v, out=out, return_lse=True, **kw)
    assert o is out
    return o, lse


def run_python(code, timeout=120, **env):
    """Run `code` (dedented) in a fresh interpreter, `env` added to this process's
    environment; returns the CompletedProcess (text stdout/stderr)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=timeout,
    )


def run_json(code, timeout=600, **env):
    """``run_python``, exit status 0 asserted (stderr shown); the last stdout line as JSON."""
    r = run_python(code, timeout=timeout, **env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------- 16-bit inputs
# The four ways a user hands 16-bit data in ("numpy_f16", "torch_f16",
# "torch_bf16", "ml_bf16"), for the dtype, backward and layer tests.
try:
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None
try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is optional
    ml_dtypes = None

HALF_SOURCES = ["numpy_f16", "torch_f16", "torch_bf16", "ml_bf16"]


def kind_of(src):
    return "bf16" if src.endswith("bf16") else "f16"


def need(src):
    if src.startswith("torch") and torch is None:
        pytest.skip("torch not installed")
    if src.startswith("ml") and ml_dtypes is None:
        pytest.skip("ml_dtypes not installed")


def make(x, src):
    """float32 NumPy `x` rounded to the 16-bit dtype, as the source kind."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if src == "numpy_f16":
        return x.astype(np.float16)
    if src == "ml_bf16":
        return x.astype(ml_dtypes.bfloat16)
    t = torch.from_numpy(x)
    return t.to(torch.float16 if src == "torch_f16" else torch.bfloat16)


def f64(x):
    """Any result or input (torch tensor, ml_dtypes, float16, bf16 uint16 bits) as float64 NumPy."""
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().double().numpy()
    x = np.asarray(x)
    if x.dtype == np.uint16:  # bfloat16 bits (no ml_dtypes)
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def gen(rng, src, *shapes):
    need(src)
    return [make(rng.standard_normal(s), src) for s in shapes]


# qemu-user (tools/arm/emulate.sh sets ATTN_FAST_QEMU_USER=1) does not apply a guest's
# RLIMIT_AS: it keeps the emulator's own address space out of the guest's reach. The tests
# that cap the address space to make an allocation fail would allocate the uncapped GiB.
needs_rlimit_as = pytest.mark.skipif(
    os.environ.get("ATTN_FAST_QEMU_USER") == "1",
    reason="qemu-user ignores the guest's RLIMIT_AS (tools/arm/emulate.sh)",
)
