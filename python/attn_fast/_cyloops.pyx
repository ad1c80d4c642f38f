# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""The Python layer's small numeric loops, in Cython over NumPy buffers.

Each function here replaces a NumPy formula that stays in the calling module
as the readable reference (``positional._rope_numpy``, ``_kv_store._write_numpy``,
``masks._summary_numpy``, ...); the tests compare the two. One pass over the
data, no temporaries, the GIL released, OpenMP ``prange`` over the independent
rows when there is enough work to share.

``num_threads`` is the OpenMP team size (the callers pass
``attn_fast._loops.threads()``, the C++ kernels' rule); small inputs run on
the calling thread whatever it says.

Ctrl-C: a loop over more than ``CHUNK_WORK`` elements runs in chunks of about
that size; between chunks it takes the GIL back and calls
``PyErr_CheckSignals``, so SIGINT raises KeyboardInterrupt within a chunk
(a few milliseconds) however big the array. What was written before the
interrupt stays written (an interrupted in-place RoPE leaves x partly rotated).

These are private kernels: the public callers check dtypes, shapes and ranges
and build the strided 4-D views; only the cheap checks that guard memory
safety (index ranges, matching extents) are repeated here.

Shape legend: B batch, L positions, H heads, d head dim, r rotary dims
(r/2 frequencies), R ring slots, n table rows.
"""

from cython.parallel cimport prange
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport int64_t
import numpy as np

ctypedef fused floating:
    float
    double

# Below this many elements a loop runs on the calling thread: waking the
# OpenMP team (tens of microseconds, more on busy cores) costs more than the
# work saved. Copies (cache writes) are bound by memory bandwidth and gain
# little from a second thread, so they need far more work to be shared.
cdef Py_ssize_t PAR_MIN_WORK = 1 << 18
cdef Py_ssize_t PAR_MIN_COPY = 1 << 23
# Elements per chunk between two signal checks (Ctrl-C): a few milliseconds of
# work, far more than the cost of a GIL round trip and a team wake-up.
cdef Py_ssize_t CHUNK_WORK = 1 << 22


cdef inline Py_ssize_t _chunk_rows(Py_ssize_t rows, Py_ssize_t work) noexcept nogil:
    """Rows per chunk so that a chunk holds about CHUNK_WORK of `work` elements (>= 1)."""
    if rows <= 0 or work <= CHUNK_WORK:
        return rows if rows > 0 else 1
    cdef Py_ssize_t per_row = (work + rows - 1) // rows
    cdef Py_ssize_t n = CHUNK_WORK // (per_row if per_row > 0 else 1)
    return n if n > 0 else 1


cdef inline void _rotate_row(const floating* src, floating* dst, Py_ssize_t ssd, Py_ssize_t dsd,
                             const floating* c, const floating* s, Py_ssize_t half,
                             Py_ssize_t sa, Py_ssize_t ob, Py_ssize_t r, Py_ssize_t d,
                             bint copy_tail) noexcept nogil:
    """One head vector: pairs (i*sa, i*sa + ob) rotated by (c[i], s[i]).

    The tail r..d-1 is copied if asked.
    """
    cdef Py_ssize_t i, ia, ib
    cdef floating xa, xb
    if ssd == 1 and dsd == 1:  # unit stride: loops the compiler vectorises
        if sa == 1:  # rotate-half: a = i, b = i + half
            for i in range(half):
                xa = src[i]
                xb = src[i + half]
                dst[i] = xa * c[i] - xb * s[i]
                dst[i + half] = xb * c[i] + xa * s[i]
        else:  # interleaved: a = 2i, b = 2i + 1
            for i in range(half):
                xa = src[2 * i]
                xb = src[2 * i + 1]
                dst[2 * i] = xa * c[i] - xb * s[i]
                dst[2 * i + 1] = xb * c[i] + xa * s[i]
        if copy_tail:
            for i in range(r, d):
                dst[i] = src[i]
        return
    for i in range(half):
        ia = i * sa
        ib = ia + ob
        xa = src[ia * ssd]
        xb = src[ib * ssd]
        dst[ia * dsd] = xa * c[i] - xb * s[i]
        dst[ib * dsd] = xb * c[i] + xa * s[i]
    if copy_tail:
        for i in range(r, d):
            dst[i * dsd] = src[i * ssd]


def _check_pos(const int64_t[:, :] pos, Py_ssize_t n, Py_ssize_t B, Py_ssize_t L):
    cdef Py_ssize_t b, l
    cdef int64_t p
    if pos.shape[1] != L or (pos.shape[0] != 1 and pos.shape[0] != B):
        raise ValueError(f"positions have shape ({pos.shape[0]}, {pos.shape[1]}), "
                         f"expected (1 or {B}, {L})")
    for b in range(pos.shape[0]):
        for l in range(L):
            p = pos[b, l]
            if p < 0 or p >= n:
                raise ValueError(f"position {p} is outside the cos/sin table of {n} rows")


def rope(const floating[:, :, :, :] x, floating[:, :, :, :] y,
         const floating[:, :, :, :] x2, floating[:, :, :, :] y2,
         const floating[:, ::1] cos, const floating[:, ::1] sin,
         const int64_t[:, :] pos, bint interleaved, int num_threads=1):
    """Rotate x into y (and x2 into y2, when given) in one pass over (b, l).

    x, y : (B, L, H, d) views, any strides (y may be x: in place).
    x2, y2 : None, or a second pair (B, L, H2, d) with the same B, L, d (q and
        k of one layer share each cos/sin row as it is loaded).
    cos, sin : (n, r/2) tables; pos : (1 or B, L) int64 table rows.
    interleaved : pairs (2i, 2i+1); else rotate-half, pairs (i, i + r/2).
    """
    cdef Py_ssize_t B = x.shape[0], L = x.shape[1], H = x.shape[2], d = x.shape[3]
    cdef Py_ssize_t half = cos.shape[1], r = 2 * half
    cdef Py_ssize_t H2 = 0
    cdef bint two = x2 is not None
    if y.shape[0] != B or y.shape[1] != L or y.shape[2] != H or y.shape[3] != d:
        raise ValueError("rope: x and y extents differ")
    if two:
        H2 = x2.shape[2]
        if x2.shape[0] != B or x2.shape[1] != L or x2.shape[3] != d:
            raise ValueError("rope: the second array's (B, L, d) differ from the first's")
        if (y2 is None or y2.shape[0] != B or y2.shape[1] != L or y2.shape[2] != H2
                or y2.shape[3] != d):
            raise ValueError("rope: x2 and y2 extents differ")
    if sin.shape[0] != cos.shape[0] or sin.shape[1] != half or r > d:
        raise ValueError(f"rope: tables ({cos.shape[0]}, {half}) do not fit head dim {d}")
    _check_pos(pos, cos.shape[0], B, L)
    if B == 0 or L == 0 or d == 0 or (H == 0 and H2 == 0):
        return
    cdef Py_ssize_t isz = sizeof(floating)
    cdef Py_ssize_t sa = 2 if interleaved else 1
    cdef Py_ssize_t ob = 1 if interleaved else half
    cdef Py_ssize_t pb = 0 if pos.shape[0] == 1 else 1
    cdef Py_ssize_t bl, b, l, h
    cdef int64_t p
    cdef const floating* xp = NULL
    cdef floating* yp = NULL
    cdef const floating* xp2 = NULL
    cdef floating* yp2 = NULL
    if H:
        xp = &x[0, 0, 0, 0]
        yp = &y[0, 0, 0, 0]
    cdef Py_ssize_t xs0 = x.strides[0] // isz, xs1 = x.strides[1] // isz
    cdef Py_ssize_t xs2 = x.strides[2] // isz, xs3 = x.strides[3] // isz
    cdef Py_ssize_t ys0 = y.strides[0] // isz, ys1 = y.strides[1] // isz
    cdef Py_ssize_t ys2 = y.strides[2] // isz, ys3 = y.strides[3] // isz
    cdef Py_ssize_t zs0 = 0, zs1 = 0, zs2 = 0, zs3 = 0, ws0 = 0, ws1 = 0, ws2 = 0, ws3 = 0
    cdef bint tail = <const void*>xp != <const void*>yp and r < d
    cdef bint tail2 = False
    if two and H2:
        xp2 = &x2[0, 0, 0, 0]
        yp2 = &y2[0, 0, 0, 0]
        zs0, zs1 = x2.strides[0] // isz, x2.strides[1] // isz
        zs2, zs3 = x2.strides[2] // isz, x2.strides[3] // isz
        ws0, ws1 = y2.strides[0] // isz, y2.strides[1] // isz
        ws2, ws3 = y2.strides[2] // isz, y2.strides[3] // isz
        tail2 = <const void*>xp2 != <const void*>yp2 and r < d
    cdef const floating* cp = &cos[0, 0]
    cdef const floating* sp = &sin[0, 0]
    cdef const int64_t* pp = &pos[0, 0]
    cdef Py_ssize_t ps0 = pos.strides[0] // sizeof(int64_t), ps1 = pos.strides[1] // sizeof(int64_t)
    cdef Py_ssize_t work = B * L * (H + H2) * d
    cdef Py_ssize_t step = _chunk_rows(B * L, work), c0, c1
    for c0 in range(0, B * L, step):
        c1 = min(B * L, c0 + step)
        with nogil:
            for bl in prange(c0, c1, schedule="static",
                             use_threads_if=num_threads > 1 and work >= PAR_MIN_WORK,
                             num_threads=num_threads if num_threads > 1 else 1):
                b = bl // L
                l = bl % L
                p = pp[b * pb * ps0 + l * ps1]
                for h in range(H):
                    _rotate_row(xp + b * xs0 + l * xs1 + h * xs2,
                                yp + b * ys0 + l * ys1 + h * ys2, xs3, ys3,
                                cp + p * half, sp + p * half, half, sa, ob, r, d, tail)
                for h in range(H2):
                    _rotate_row(xp2 + b * zs0 + l * zs1 + h * zs2,
                                yp2 + b * ws0 + l * ws1 + h * ws2, zs3, ws3,
                                cp + p * half, sp + p * half, half, sa, ob, r, d, tail2)
        if c1 < B * L:
            PyErr_CheckSignals()  # raises KeyboardInterrupt on Ctrl-C


def cache_write(floating[:, :, :, :] dst, const floating[:, :, :, :] src,
                const int64_t[::1] first_slot, const int64_t[::1] count,
                const floating[:, ::1] cos=None, const floating[:, ::1] sin=None,
                const int64_t[::1] pos0=None, bint interleaved=False, int num_threads=1):
    """Copy rows src[b, :, :count[b]] into ring slots (first_slot[b] + t) % R of dst.

    dst : (B, H, R, d) storage; src : (B, H, L, d) chunk, any strides.
    first_slot, count : (B,) int64, 0 <= first_slot < R, 0 <= count <= min(L, R).
    cos, sin, pos0 : optional RoPE on the way in: row t of sequence b is
        rotated at position pos0[b] + t with the (n, r/2) tables.
    """
    cdef Py_ssize_t B = dst.shape[0], H = dst.shape[1], R = dst.shape[2], d = dst.shape[3]
    cdef Py_ssize_t L = src.shape[2]
    cdef Py_ssize_t b, t, h, j, slot, bh
    if src.shape[0] != B or src.shape[1] != H or src.shape[3] != d:
        raise ValueError("cache_write: chunk "
                         f"({src.shape[0]}, {src.shape[1]}, {L}, {src.shape[3]}) "
                         f"does not match storage ({B}, {H}, {R}, {d})")
    if first_slot.shape[0] != B or count.shape[0] != B:
        raise ValueError(f"cache_write: first_slot and count must have shape ({B},)")
    for b in range(B):
        if (first_slot[b] < 0 or (first_slot[b] >= R and count[b] > 0) or count[b] < 0
                or count[b] > L or count[b] > R):
            raise ValueError(f"cache_write: sequence {b}: "
                             f"first slot {first_slot[b]}, count {count[b]} "
                             f"do not fit {R} slots and a chunk of {L}")
    cdef bint rot = cos is not None
    cdef Py_ssize_t half = 0, n = 0
    if rot:
        if (sin is None or pos0 is None or sin.shape[0] != cos.shape[0]
                or sin.shape[1] != cos.shape[1]):
            raise ValueError("cache_write: cos, sin and pos0 go together, "
                             "with equal table shapes")
        half, n = cos.shape[1], cos.shape[0]
        if 2 * half > d or pos0.shape[0] != B:
            raise ValueError(f"cache_write: tables of {half} frequencies or pos0 "
                             f"do not fit d={d}, B={B}")
        for b in range(B):
            if count[b] > 0 and (pos0[b] < 0 or pos0[b] + count[b] > n):
                raise ValueError(f"cache_write: positions {pos0[b]}..{pos0[b] + count[b] - 1} "
                                 f"outside the table of {n} rows")
    if B == 0 or H == 0 or d == 0 or L == 0 or R == 0:
        return
    cdef Py_ssize_t isz = sizeof(floating)
    cdef floating* dp = &dst[0, 0, 0, 0]
    cdef const floating* sp_ = &src[0, 0, 0, 0]
    cdef Py_ssize_t ds0 = dst.strides[0] // isz, ds1 = dst.strides[1] // isz
    cdef Py_ssize_t ds2 = dst.strides[2] // isz, ds3 = dst.strides[3] // isz
    cdef Py_ssize_t ss0 = src.strides[0] // isz, ss1 = src.strides[1] // isz
    cdef Py_ssize_t ss2 = src.strides[2] // isz, ss3 = src.strides[3] // isz
    cdef Py_ssize_t sa = 2 if interleaved else 1
    cdef Py_ssize_t ob = 1 if interleaved else half
    cdef Py_ssize_t i, ia, ib
    cdef floating xa, xb, c, s
    cdef const floating* cp = NULL
    cdef const floating* snp = NULL
    if rot and n:
        cp = &cos[0, 0]
        snp = &sin[0, 0]
    cdef const floating* row
    cdef floating* out
    cdef int64_t p
    cdef Py_ssize_t work = 0, tmax = 0
    for b in range(B):
        work += count[b]
        tmax = max(tmax, <Py_ssize_t>count[b])
    work *= H * d
    # Chunks of rows t0 .. t1-1 of every (b, h), a signal check between chunks.
    cdef Py_ssize_t tstep = _chunk_rows(tmax, work), t0, t1
    for t0 in range(0, tmax, tstep):
        t1 = min(tmax, t0 + tstep)
        with nogil:
            for bh in prange(B * H, schedule="static",
                             use_threads_if=num_threads > 1 and work >= PAR_MIN_COPY,
                             num_threads=num_threads if num_threads > 1 else 1):
                b = bh // H
                h = bh % H
                for t in range(t0, min(t1, <Py_ssize_t>count[b])):
                    slot = (first_slot[b] + t) % R
                    row = sp_ + b * ss0 + h * ss1 + t * ss2
                    out = dp + b * ds0 + h * ds1 + slot * ds2
                    if rot:
                        p = pos0[b] + t
                        for i in range(half):
                            ia = i * sa
                            ib = ia + ob
                            xa = row[ia * ss3]
                            xb = row[ib * ss3]
                            c = cp[p * half + i]
                            s = snp[p * half + i]
                            out[ia * ds3] = xa * c - xb * s
                            out[ib * ds3] = xb * c + xa * s
                        for j in range(2 * half, d):
                            out[j * ds3] = row[j * ss3]
                    else:
                        for j in range(d):
                            out[j * ds3] = row[j * ss3]
        if t1 < tmax:
            PyErr_CheckSignals()  # raises KeyboardInterrupt on Ctrl-C


def block_summary(const unsigned char[:, :, :, :] mask, Py_ssize_t block, int num_threads=1):
    """Per block x block tile of a boolean mask: 0 all masked, 1 partial, 2 all visible.

    mask : (B, H, Lq, Lk) uint8 (0 / nonzero), any strides. Returns int8
    (B, H, ceil(Lq/block), ceil(Lk/block)); a tail tile counts only its
    in-range entries.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    cdef Py_ssize_t B = mask.shape[0], H = mask.shape[1], Lq = mask.shape[2], Lk = mask.shape[3]
    cdef Py_ssize_t nq = (Lq + block - 1) // block, nk = (Lk + block - 1) // block
    out_arr = np.zeros((B, H, nq, nk), dtype=np.int8)
    if B == 0 or H == 0 or Lq == 0 or Lk == 0:
        return out_arr
    cdef signed char[:, :, :, ::1] out = out_arr
    cdef const unsigned char* mp = &mask[0, 0, 0, 0]
    cdef Py_ssize_t ms0 = mask.strides[0], ms1 = mask.strides[1]
    cdef Py_ssize_t ms2 = mask.strides[2], ms3 = mask.strides[3]
    cdef Py_ssize_t task, b, h, bi, bj, i, j, i1, j1, vis, tot
    cdef const unsigned char* rowp
    cdef Py_ssize_t ntask = B * H * nq
    cdef Py_ssize_t step = _chunk_rows(ntask, B * H * Lq * Lk), c0, c1
    for c0 in range(0, ntask, step):
        c1 = min(ntask, c0 + step)
        with nogil:
            for task in prange(c0, c1, schedule="static",
                               use_threads_if=(num_threads > 1
                                               and B * H * Lq * Lk >= 4 * PAR_MIN_WORK),
                               num_threads=num_threads if num_threads > 1 else 1):
                bi = task % nq
                h = (task // nq) % H
                b = task // (nq * H)
                i1 = min(Lq, (bi + 1) * block)
                for bj in range(nk):
                    j1 = min(Lk, (bj + 1) * block)
                    vis = 0
                    for i in range(bi * block, i1):
                        rowp = mp + b * ms0 + h * ms1 + i * ms2
                        if ms3 == 1:  # contiguous rows: a loop the compiler vectorises
                            for j in range(bj * block, j1):
                                vis = vis + (rowp[j] != 0)
                        else:
                            for j in range(bj * block, j1):
                                vis = vis + (rowp[j * ms3] != 0)
                    tot = (i1 - bi * block) * (j1 - bj * block)
                    out[b, h, bi, bj] = 0 if vis == 0 else (2 if vis == tot else 1)
        if c1 < ntask:
            PyErr_CheckSignals()  # raises KeyboardInterrupt on Ctrl-C
    return out_arr


def band_layout(Py_ssize_t n, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t stride, bint absolute,
                int num_threads=1):
    """(n, n) bool block layout over query block x and key block y.

    Keeps (x, y) when lo <= x - y <= hi (the band), or, with stride > 0, when
    dist >= 0 and dist % stride == 0, where dist = x - y, or |x - y| if
    ``absolute`` (the strided pattern of masks.BlockSparse.strided).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    out_arr = np.zeros((n, n), dtype=np.bool_)
    if n == 0:
        return out_arr
    cdef unsigned char[:, ::1] out = out_arr.view(np.uint8)
    cdef Py_ssize_t x, y, dist
    cdef Py_ssize_t step = _chunk_rows(n, n * n), c0, c1
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        with nogil:
            for x in prange(c0, c1, schedule="static",
                            use_threads_if=num_threads > 1 and n * n >= PAR_MIN_WORK,
                            num_threads=num_threads if num_threads > 1 else 1):
                for y in range(n):
                    dist = x - y
                    if lo <= dist <= hi:
                        out[x, y] = 1
                    elif stride > 0:
                        if absolute and dist < 0:
                            dist = -dist
                        if dist >= 0 and dist % stride == 0:
                            out[x, y] = 1
        if c1 < n:
            PyErr_CheckSignals()  # raises KeyboardInterrupt on Ctrl-C
    return out_arr
