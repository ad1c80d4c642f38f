"""The Cython loops (attn_fast._cyloops) against the NumPy formulas they replace.

Each public entry point (RoPE.__call__ / rotate_qk, KVCache.append, the
BlockSparse constructors, masks.block_summary) is run twice, once with
``_loops.USE_CYTHON`` on and once off, and both are compared with a float64
oracle (positional.rope_reference, plain slot arithmetic, triple loops).
"""

import zlib

import numpy as np
import pytest

from attn_fast import _cyloops, _loops
from attn_fast._mask_record import summary_numpy
from attn_fast.kv_cache import KVCache, _write_numpy
from attn_fast.masks import (
    BLOCK_MASKED,
    BLOCK_PARTIAL,
    BLOCK_VISIBLE,
    BlockSparse,
    MaskTypeError,
    block_summary,
)
from attn_fast.positional import RoPE, rope_reference

TOL = {np.float32: 2e-5, np.float64: 1e-12}


@pytest.fixture(params=["cython", "numpy"])
def path(request, monkeypatch):
    monkeypatch.setattr(_loops, "USE_CYTHON", request.param == "cython")
    return request.param


def _noncontig(rng, shape, dtype):
    """Random values in a view with strides in every axis
    (every other element of a bigger array)."""
    big = rng.standard_normal(tuple(2 * s for s in shape)).astype(dtype)
    return big[tuple(slice(None, None, 2) for _ in shape)]


def _oracle(x, pos, ax, rope):
    """float64 rotation of x (positions (L,) or (B, L) along axis ax), by rope_reference."""
    xm = np.moveaxis(np.asarray(x, np.float64), ax, -2)  # (..., L, d)
    kw = dict(base=rope.base, rotary_dim=rope.rotary_dim, interleaved=rope.interleaved)
    if pos.ndim == 1:
        y = rope_reference(xm, pos, **kw)
    else:
        y = np.stack([rope_reference(xm[b], pos[b], **kw) for b in range(xm.shape[0])])
    return np.moveaxis(y, -2, ax)


# ---------------------------------------------------------------- RoPE


LAYOUTS = {  # name: (shape from (B, L, H, d), seq_axis)
    "BLHD": (lambda B, L, H, d: (B, L, H, d), -3),
    "BHLD": (lambda B, L, H, d: (B, H, L, d), -2),
    "LHD": (lambda B, L, H, d: (L, H, d), -3),
    "LD": (lambda B, L, H, d: (L, d), -2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d,r", [(8, 8), (5, 4), (80, 32), (2, 2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("contig", [True, False])
def test_rope_matches_oracle(path, layout, interleaved, d, r, dtype, contig):
    rng = np.random.default_rng(zlib.crc32(repr((layout, interleaved, d, r, contig)).encode()))
    B, L, H = 3, 7, 2
    mk, seq_axis = LAYOUTS[layout]
    shape = mk(B, L, H, d)
    x = (
        _noncontig(rng, shape, dtype)
        if contig is False
        else rng.standard_normal(shape).astype(dtype)
    )
    x0 = x.copy()
    rope = RoPE(d, base=500.0, rotary_dim=r, interleaved=interleaved)
    ax = seq_axis + x.ndim
    tol = TOL[dtype]
    # offset int: positions 11 .. 11+L-1
    y = rope(x, offset=11, seq_axis=seq_axis)
    np.testing.assert_allclose(y, _oracle(x, 11 + np.arange(L), ax, rope), rtol=tol, atol=tol)
    np.testing.assert_array_equal(x, x0)  # not modified
    assert y.flags.c_contiguous
    # explicit, unordered positions (a ring buffer's), into a NaN-poisoned out=
    pos = rng.integers(0, 5000, size=L)
    out = np.full(shape, np.nan, dtype)
    assert rope(x, positions=pos, seq_axis=seq_axis, out=out) is out
    np.testing.assert_allclose(out, _oracle(x, pos, ax, rope), rtol=tol, atol=tol * 10)
    if ax > 0:  # per-sequence offsets (ragged batch), in place on a strided view
        nb = x.shape[0]
        offs = rng.integers(0, 100, size=nb)
        want = _oracle(x, offs[:, None] + np.arange(L), ax, rope)
        xi = x.copy() if contig else _noncontig(rng, shape, dtype)
        xi[...] = x
        assert rope(xi, offset=offs, seq_axis=seq_axis, inplace=True) is xi
        np.testing.assert_allclose(xi, want, rtol=tol, atol=tol)


def test_rope_cython_equals_numpy_formula(monkeypatch):
    """The two paths on the same odd-sized strided input (not only each against the oracle)."""
    rng = np.random.default_rng(5)
    x = _noncontig(rng, (2, 129, 3, 80), np.float32).transpose(
        0, 2, 1, 3
    )  # (B, H, L, d), no unit stride
    for interleaved in (False, True):
        rope = RoPE(80, rotary_dim=64, interleaved=interleaved)
        pos = rng.integers(0, 4096, size=(2, 129))
        monkeypatch.setattr(_loops, "USE_CYTHON", True)
        a = rope(x, positions=pos, seq_axis=-2)
        monkeypatch.setattr(_loops, "USE_CYTHON", False)
        b = rope(x, positions=pos, seq_axis=-2)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(a[..., 64:], x[..., 64:])  # unrotated tail copied exactly


@pytest.mark.parametrize("seq_axis", [-3, -2])
@pytest.mark.parametrize("inplace", [False, True])
def test_rotate_qk(path, seq_axis, inplace):
    rng = np.random.default_rng(7)
    B, L, Hq, Hk, d = 2, 9, 6, 2, 12
    rope = RoPE(d, rotary_dim=10, interleaved=seq_axis == -2)
    shape = (lambda h: (B, L, h, d)) if seq_axis == -3 else (lambda h: (B, h, L, d))
    q = rng.standard_normal(shape(Hq))
    k = _noncontig(rng, shape(Hk), np.float64)
    offs = np.array([3, 40])
    want_q, want_k = (
        rope(q, offset=offs, seq_axis=seq_axis),
        rope(k, offset=offs, seq_axis=seq_axis),
    )
    q1, k1 = rope.rotate_qk(
        q.copy() if inplace else q,
        k.copy() if inplace else k,
        offset=offs,
        seq_axis=seq_axis,
        inplace=inplace,
    )
    np.testing.assert_allclose(q1, want_q, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(k1, want_k, rtol=1e-13, atol=1e-13)
    ax = seq_axis + 4
    np.testing.assert_allclose(
        k1, _oracle(k, offs[:, None] + np.arange(L), ax, rope), rtol=1e-12, atol=1e-12
    )


def test_rope_fallback_layouts(path):
    """Layouts the Cython loop does not take (5-D, float16) still go through the NumPy formula."""
    rng = np.random.default_rng(3)
    rope = RoPE(6)
    x = rng.standard_normal((2, 2, 4, 3, 6))
    np.testing.assert_allclose(rope(x, offset=2), _oracle(x, 2 + np.arange(4), 2, rope), atol=1e-12)
    h = x[0].astype(np.float16)
    np.testing.assert_allclose(
        rope(h, offset=2).astype(np.float64), _oracle(h, 2 + np.arange(4), 1, rope), atol=1e-2
    )


def test_rope_bad_inputs(path):
    rope = RoPE(8)
    x = np.ones((2, 5, 3, 8), np.float32)
    with pytest.raises(TypeError, match="float array"):
        rope(np.ones((2, 5, 3, 8), np.int32))
    with pytest.raises(ValueError, match="head_dim = 8"):
        rope(np.ones((2, 5, 3, 7), np.float32))
    with pytest.raises(ValueError, match=">= 0"):
        rope(x, positions=np.array([0, 1, -2, 3, 4]))
    with pytest.raises(ValueError, match=r"shape \(L,\) or \(B, L\) with L = 5"):
        rope(x, positions=np.arange(4))
    with pytest.raises(TypeError, match="positions must be an int array"):
        rope(x, positions=np.arange(5.0))
    with pytest.raises(ValueError, match="3 sequences"):
        rope(x, offset=np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="out has shape"):
        rope(x, out=np.empty((2, 5, 3, 8), np.float64))
    with pytest.raises(ValueError, match="batch axis"):
        rope(np.ones((5, 3, 8)), positions=np.zeros((1, 5), int))
    with pytest.raises(TypeError, match="k has dtype float64"):
        rope.rotate_qk(x, x.astype(np.float64))
    with pytest.raises(ValueError, match="read-only"):
        x.flags.writeable = False
        rope(x, inplace=True)


def test_cyloops_rope_guards():
    """The kernel itself refuses positions outside the table and mismatched extents."""
    x = np.ones((1, 3, 2, 4))
    c = np.ones((5, 2))
    with pytest.raises(ValueError, match="outside the cos/sin table of 5 rows"):
        _cyloops.rope(x, x, None, None, c, c, np.array([[0, 1, 5]]), False)
    with pytest.raises(ValueError, match="extents differ"):
        _cyloops.rope(x, np.ones((1, 3, 2, 5)), None, None, c, c, np.array([[0, 1, 2]]), False)
    with pytest.raises(ValueError, match="Buffer dtype mismatch"):
        _cyloops.rope(
            x,
            x,
            None,
            None,
            c.astype(np.float32),
            c.astype(np.float32),
            np.array([[0, 1, 2]]),
            False,
        )


# ---------------------------------------------------------------- KV cache writes


def _oracle_cache(chunks, window, ring, B):
    """Keys per sequence in position order, by plain list appends (the last `ring` of them kept)."""
    seqs = [[] for _ in range(B)]
    for k, lens in chunks:
        for b in range(B):
            seqs[b].extend(k[b, :, t] for t in range(lens[b]))
    if window is not None:
        seqs = [s[max(0, len(s) - ring) :] for s in seqs]
    return seqs


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_append_ragged_ring(path, window, dtype):
    rng = np.random.default_rng(11)
    B, H, d, dv, ring = 3, 2, 5, 3, 9
    cache = KVCache(
        B,
        H,
        d,
        capacity=4,
        v_head_dim=dv,
        dtype=dtype,
        window=window,
        ring=ring if window else None,
    )
    chunks, vchunks = [], []
    for L in [3, 1, 4, 2, 5, 1, 1, 3]:  # wraps the ring several times
        k = _noncontig(rng, (B, H, L, d), dtype)
        v = rng.standard_normal((B, L, H, dv)).astype(dtype).transpose(0, 2, 1, 3)
        lens = rng.integers(0, L + 1, size=B)
        cache.append(k, v, lengths=lens)
        chunks.append((k, lens))
        vchunks.append((v, lens))
    ring_now = cache.capacity
    want_k = _oracle_cache(chunks, window, ring_now, B)
    want_v = _oracle_cache(vchunks, window, ring_now, B)
    for b in range(B):
        assert cache.lengths[b] == len(want_k[b])
        np.testing.assert_array_equal(cache.keys(b), np.stack(want_k[b], axis=1).reshape(H, -1, d))
        np.testing.assert_array_equal(
            cache.values(b), np.stack(want_v[b], axis=1).reshape(H, -1, dv)
        )


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("window", [None, 4])
def test_append_with_rope(path, interleaved, window):
    rng = np.random.default_rng(13)
    B, H, d = 2, 3, 10
    rope = RoPE(d, rotary_dim=6, interleaved=interleaved)
    a = KVCache(B, H, d, dtype=np.float64, window=window)
    ref = KVCache(B, H, d, dtype=np.float64, window=window)
    for L in [5, 1, 3, 1, 1]:
        k = _noncontig(rng, (B, H, L, d), np.float64)
        v = rng.standard_normal((B, H, L, d))
        lens = np.array([L, max(0, L - 1)])
        k0 = k.copy()
        pos = ref.positions[:, None] + np.arange(L)
        a.append(k, v, lengths=lens, rope=rope)
        np.testing.assert_array_equal(k, k0)  # the caller's keys are not rotated
        ref.append(_oracle(k, pos, 2, rope), v, lengths=lens)
    for b in range(B):
        np.testing.assert_allclose(a.keys(b), ref.keys(b), rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(a.values(b), ref.values(b))


def test_cache_write_equals_numpy_reference():
    rng = np.random.default_rng(17)
    dst1 = rng.standard_normal((3, 2, 7, 5))
    dst2 = dst1.copy()
    src = _noncontig(rng, (3, 2, 6, 5), np.float64)
    first, count = np.array([0, 4, 6]), np.array([6, 5, 0])
    _cyloops.cache_write(dst1, src, first, count)
    _write_numpy(dst2, src, first, count)
    np.testing.assert_array_equal(dst1, dst2)


def test_cache_write_bad_inputs(path):
    cache = KVCache(2, 2, 4)
    with pytest.raises(TypeError, match="dtype float64 but the cache stores float32"):
        cache.append(np.ones((2, 2, 1, 4)), np.ones((2, 2, 1, 4)))
    with pytest.raises(ValueError, match="expected"):
        cache.append(np.ones((2, 3, 1, 4), np.float32), np.ones((2, 3, 1, 4), np.float32))
    with pytest.raises(ValueError, match="head_dim 4"):
        cache.append(
            np.ones((2, 2, 1, 4), np.float32), np.ones((2, 2, 1, 4), np.float32), rope=RoPE(6)
        )
    assert cache.lengths.tolist() == [0, 0]  # nothing changed
    dst = np.zeros((2, 2, 5, 4))
    with pytest.raises(ValueError, match="do not fit 5 slots"):
        _cyloops.cache_write(dst, np.ones((2, 2, 3, 4)), np.array([0, 5]), np.array([1, 1]))
    with pytest.raises(ValueError, match="does not match storage"):
        _cyloops.cache_write(dst, np.ones((2, 2, 3, 3)), np.array([0, 0]), np.array([1, 1]))
    with pytest.raises(ValueError, match="Buffer dtype mismatch"):
        _cyloops.cache_write(
            dst, np.ones((2, 2, 3, 4), np.float32), np.array([0, 0]), np.array([1, 1])
        )
    c = np.ones((3, 2))
    with pytest.raises(ValueError, match="outside the table of 3 rows"):
        _cyloops.cache_write(
            dst, np.ones((2, 2, 3, 4)), np.array([0, 0]), np.array([2, 2]), c, c, np.array([0, 2])
        )


# ---------------------------------------------------------------- masks


def _summary_loops(m, block):
    """Triple-loop oracle of block_summary."""
    B, H, Lq, Lk = m.shape
    nq, nk = -(-Lq // block), -(-Lk // block)
    out = np.empty((B, H, nq, nk), np.int8)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                for j in range(nk):
                    t = m[b, h, i * block : (i + 1) * block, j * block : (j + 1) * block]
                    out[b, h, i, j] = (
                        BLOCK_MASKED if not t.any() else BLOCK_VISIBLE if t.all() else BLOCK_PARTIAL
                    )
    return out


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 7, 33), (1, 2, 40, 17)])
@pytest.mark.parametrize("block", [1, 3, 16])
def test_block_summary(path, shape, block):
    rng = np.random.default_rng(19)
    for density in (0.0, 0.05, 0.97, 1.0):
        m = rng.random(shape) < density
        m[..., : shape[2] // 2, : shape[3] // 3] = True  # some all-visible tiles
        want = _summary_loops(m, block)
        np.testing.assert_array_equal(block_summary(m, block), want)
        np.testing.assert_array_equal(summary_numpy(m, block), want)
        t = np.ascontiguousarray(m.transpose(0, 1, 3, 2)).transpose(
            0, 1, 3, 2
        )  # column-major tiles
        np.testing.assert_array_equal(block_summary(t.view(np.uint8), block), want)


def test_block_summary_bad_inputs():
    with pytest.raises(MaskTypeError, match="bool or uint8"):
        block_summary(np.ones((1, 1, 4, 4), np.float32))
    with pytest.raises(ValueError, match=r"\(B, H, Lq, Lk\)"):
        block_summary(np.ones((4, 4), bool))
    with pytest.raises(ValueError, match="block"):
        block_summary(np.ones((1, 1, 4, 4), bool), 0)


@pytest.mark.parametrize("causal", [False, True])
def test_layout_constructors(monkeypatch, causal):
    """Cython band layouts equal the NumPy formulas for every small size and width."""
    for seq_len in (1, 5, 16, 47):
        for block in (1, 4):
            for w in (1, 2, 3, 7):
                got, want = [], []
                for use, acc in ((True, got), (False, want)):
                    monkeypatch.setattr(_loops, "USE_CYTHON", use)
                    acc.append(BlockSparse.local(seq_len, block, w, causal=causal).layout)
                    acc.append(BlockSparse.strided(seq_len, block, w, causal=causal).layout)
                    acc.append(
                        BlockSparse.global_tokens(
                            seq_len,
                            block,
                            global_blocks=2,
                            width=w - 1,
                            random_blocks=1,
                            causal=causal,
                        ).layout
                    )
                for g, e in zip(got, want):
                    assert g.dtype == np.bool_
                    np.testing.assert_array_equal(g, e)


def test_threads_do_not_change_results():
    """Inputs above the OpenMP thresholds give bit-identical results with 1 and 2 threads."""
    import attn_fast as af

    rng = np.random.default_rng(23)
    x = rng.standard_normal((2, 67, 16, 128)).astype(np.float32)  # > 2^18 elements: threaded
    pos = rng.integers(0, 9000, size=(2, 67))
    m = rng.random((1, 2, 700, 750)) < 0.3
    rope = RoPE(128, rotary_dim=96)
    dst = np.zeros((2, 16, 600, 128), np.float32)
    src = rng.standard_normal((2, 16, 600, 128)).astype(np.float32)
    saved = af.get_num_threads()
    res = []
    try:
        for n in (1, 2):
            af.set_num_threads(n)
            _cyloops.cache_write(dst, src, np.array([0, 100]), np.array([600, 17]), num_threads=n)
            res.append(
                (
                    rope(x, positions=pos),
                    block_summary(m),
                    BlockSparse.local(2048, 1, 5).layout,
                    dst.copy(),
                )
            )
    finally:
        af.set_num_threads(saved)
    for a, b in zip(*res):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(res[0][1], summary_numpy(m, 16))
