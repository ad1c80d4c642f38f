"""KVCache.attend's fast paths (a repeated plain call, KVStore._planned): the same bits as
the checked path, and the same errors, for every chunk length, ring layout and input kind."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import qkv, torch
from test_kv_cache import oracle

import attn_fast as af


def _checked(cache, q, causal):
    """attend through the checked path: out= keeps a call off the fast paths."""
    B, Hq, Lq, _ = q.shape
    out = np.empty((B, Hq, Lq, cache.v_head_dim), dtype=cache.dtype)
    return cache.attend(q, causal=causal, out=out)


@pytest.mark.parametrize("window", [None, 6], ids=["full", "win6"])
@pytest.mark.parametrize("Lq", [1, 3, 4, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_repeated_attend_same_bits_as_checked_path(isa, rng, window, Lq, dtype, causal):
    B, Hq, Hkv, L, d, dv = 1, 6, 2, 23, 5, 7
    q, k, v = qkv(rng, B, Hq, Hkv, L, L, d, dv, dtype)
    O, LSE = oracle(q, k, v, window)
    cache = af.KVCache(B, Hkv, d, capacity=4, v_head_dim=dv, dtype=dtype, window=window)
    for t in range(0, L, Lq):  # the ring wraps on the way (window, and growth without)
        kc, vc = k[:, :, t : t + Lq], v[:, :, t : t + Lq]
        cache.append(kc, vc)
        qc = np.ascontiguousarray(q[:, :, t : t + kc.shape[2]])
        first = cache.attend(qc, causal=causal)  # checks, then the plan
        again = cache.attend(qc, causal=causal)  # the plan
        np.testing.assert_array_equal(again, first)
        np.testing.assert_array_equal(again, _checked(cache, qc, causal))
        if causal:
            n = kc.shape[2]
            ref_o = O[:, :, t : t + n]
            np.testing.assert_allclose(again, ref_o, rtol=1e-4, atol=1e-5)


# torch is optional (the sanitizer leg runs without it): its tests skip, the rest run.
needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


@needs_torch
def test_ragged_batch_torch_input_same_bits(isa, rng):
    """B = 2 with ragged appends (lengths=) and torch input: the plan reads the last
    append's per-sequence lengths as q_lens, as the checked path does."""
    B, Hq, Hkv, d = 2, 4, 2, 16
    cache = af.KVCache(B, Hkv, d, capacity=8)
    for step in range(12):
        L = 1 + step % 3
        k = rng.standard_normal((B, Hkv, L, d)).astype(np.float32)
        v = rng.standard_normal((B, Hkv, L, d)).astype(np.float32)
        cache.append(k, v, lengths=[L, max(1, L - 1)])
        q = torch.from_numpy(rng.standard_normal((B, Hq, L, d)).astype(np.float32))
        first = cache.attend(q)
        again = cache.attend(q)
        assert isinstance(again, torch.Tensor)
        np.testing.assert_array_equal(again.numpy(), first.numpy())
        np.testing.assert_array_equal(again.numpy(), _checked(cache, q.numpy(), True))


def test_planned_call_raises_the_checked_errors(rng):
    """A plan never hides an error: rows that would see past the stored keys, a new
    dtype or shape go through the checks and raise what a fresh cache raises."""
    B, Hq, Hkv, d = 1, 4, 2, 8
    q = rng.standard_normal((B, Hq, 1, d)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, 1, d)).astype(np.float32)
    fresh = af.KVCache(B, Hkv, d)
    with pytest.raises(ValueError) as want:
        fresh.attend(q)
    cache = af.KVCache(B, Hkv, d)
    cache.append(k, k)
    cache.attend(q)
    cache.attend(q)  # planned
    cache.reset()
    with pytest.raises(ValueError) as got:
        cache.attend(q)
    assert str(got.value) == str(want.value)
    with pytest.raises(TypeError, match="q"):
        cache.attend(q.astype(np.float64))
    with pytest.raises(ValueError, match="head dim"):
        cache.attend(q[..., :-1])


@needs_torch
@pytest.mark.parametrize("dtype_name", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("Lq, Lk", [(1, 16), (1, 129), (3, 7), (4, 64)])
def test_torch_op_plain_call_same_bits_as_the_op(isa, dtype_name, Lq, Lk):
    """attn_fast.torch's plain inference call (no mask, options or grad) gives the op's bits
    and the NumPy layer's errors."""
    import attn_fast.torch as aft

    dtype = getattr(torch, dtype_name)

    g = torch.Generator().manual_seed(Lq * 1000 + Lk)
    q = torch.randn(2, 6, Lq, 5, generator=g).to(dtype)
    k = torch.randn(2, 2, Lk, 5, generator=g).to(dtype)
    v = torch.randn(2, 2, Lk, 3, generator=g).to(dtype)
    fast = aft.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    again = aft.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # the NumPy layer's plan
    qg = q.clone().requires_grad_(True)  # the custom op (grad wanted)
    op = aft.scaled_dot_product_attention(qg, k, v, enable_gqa=True).detach()
    assert fast.dtype == dtype and fast.shape == (2, 6, Lq, 3)
    assert torch.equal(fast, op) and torch.equal(again, op)
    with pytest.raises(ValueError) as want:
        aft.scaled_dot_product_attention(qg, k[..., :-1], v, enable_gqa=True)
    with pytest.raises(ValueError) as got:
        aft.scaled_dot_product_attention(q, k[..., :-1], v, enable_gqa=True)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("window", [None, 5], ids=["full", "win5"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"], ids=str)
def test_repeated_append_same_state_as_checked_path(rng, window, dtype):
    """append's planned path (one sequence, chunks of one layout) leaves the storage and the
    counters the checked path leaves (lengths= keeps a call on the checked path), through
    ring growth and wrap-around."""
    Hkv, d = 2, 6
    a = af.KVCache(1, Hkv, d, capacity=4, dtype=dtype, window=window)
    b = af.KVCache(1, Hkv, d, capacity=4, dtype=dtype, window=window)
    if dtype == "bfloat16" and torch is None:
        pytest.skip("torch not installed (bfloat16 input)")
    for step in range(40):
        L = (1, 1, 2, 1, 3)[step % 5]
        k = rng.standard_normal((1, Hkv, L, d)).astype(np.float32)
        v = rng.standard_normal((1, Hkv, L, d)).astype(np.float32)
        if dtype == "bfloat16":
            k, v = torch.from_numpy(k).bfloat16(), torch.from_numpy(v).bfloat16()
        else:
            k, v = k.astype(dtype), v.astype(dtype)
        a.append(k, v)
        b.append(k, v, lengths=[L])
        assert a.capacity == b.capacity
        for name in ("_n", "_pos", "_start", "_last_new"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert a._last_L == b._last_L
        assert a._k.tobytes() == b._k.tobytes() and a._v.tobytes() == b._v.tobytes()
        q = rng.standard_normal((1, 4, L, d)).astype(np.float32)
        if dtype != "bfloat16":
            q = q.astype(dtype)
            np.testing.assert_array_equal(a.attend(q), b.attend(q))


def _decode_steps(cache, rng, Hq, steps, dtype):
    """Yield (q, fast, checked) over one-token decode steps: chunks of 1 to 3 tokens
    appended, then a one-row query (the last append's lengths or a uniform Lq = 1)."""
    Hkv, d, dv = cache.num_kv_heads, cache.head_dim, cache.v_head_dim
    B = cache.batch
    for step in range(steps):
        L = (1, 1, 3, 1, 2)[step % 5]
        k = rng.standard_normal((B, Hkv, L, d)).astype(dtype)
        v = rng.standard_normal((B, Hkv, L, dv)).astype(dtype)
        cache.append(k, v)
        q = rng.standard_normal((B, Hq, 1, d)).astype(dtype)
        cache.attend(q)  # checks, then the plan
        fast = cache.attend(q)
        yield q, fast, _checked(cache, q, True)


@pytest.mark.parametrize("window", [None, 5], ids=["full", "win5"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16], ids=str)
def test_bound_ring_same_bits_through_growth_reset_truncate_copy(isa, rng, window, dtype):
    """The decode plan binds the cache's arrays once (_core.DecodeRing): it gives the
    checked path's bits while the ring grows (new arrays), wraps, is reset or truncated,
    and a copy of the cache reads its own arrays, not the original's."""
    import copy

    cache = af.KVCache(1, 2, 6, capacity=4, v_head_dim=3, dtype=dtype, window=window)
    for _, fast, checked in _decode_steps(cache, rng, 6, 12, dtype):
        np.testing.assert_array_equal(fast, checked)
    cache.reset()
    for _, fast, checked in _decode_steps(cache, rng, 6, 4, dtype):
        np.testing.assert_array_equal(fast, checked)
    if window is None:
        cache.truncate(2)
        q = rng.standard_normal((1, 6, 1, 6)).astype(dtype)
        np.testing.assert_array_equal(cache.attend(q), _checked(cache, q, True))
    twin = copy.deepcopy(cache)
    for _, fast, checked in _decode_steps(twin, rng, 6, 6, dtype):  # grows the copy only
        np.testing.assert_array_equal(fast, checked)
        assert twin._k is not cache._k
    q = rng.standard_normal((1, 6, 1, 6)).astype(dtype)
    cache.attend(q)
    np.testing.assert_array_equal(cache.attend(q), _checked(cache, q, True))


def test_state_without_a_bound_ring_attends(rng):
    """A cache pickled before the bound ring existed has no ``_ring`` in its state: it
    unpickles, attends with the checked path's bits, and binds its own ring."""
    import pickle

    cache = af.KVCache(1, 2, 8, capacity=16)
    k = rng.standard_normal((1, 2, 9, 8)).astype(np.float32)
    cache.append(k, k)
    state = pickle.loads(pickle.dumps(cache)).__dict__
    del state["_ring"]  # what unpickling an older cache gives: its __dict__, no _ring
    old = af.KVCache.__new__(af.KVCache)
    old.__dict__.update(state)
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    np.testing.assert_array_equal(old.attend(q), _checked(old, q, True))
    np.testing.assert_array_equal(old.attend(q), cache.attend(q))
    assert old._ring is not None and old._k is not cache._k


@pytest.mark.parametrize("threads", [1, 2])
def test_bound_ring_honours_thread_count(rng, threads):
    """The bound ring reads the thread count per call: set_num_threads between calls gives
    the checked path's bits at that count."""
    old = af.get_num_threads()
    cache = af.KVCache(2, 2, 16, capacity=600)
    try:
        k = rng.standard_normal((2, 2, 520, 16)).astype(np.float32)
        cache.append(k, k)
        q = rng.standard_normal((2, 8, 1, 16)).astype(np.float32)
        cache.attend(q)
        af.set_num_threads(threads)
        np.testing.assert_array_equal(cache.attend(q), _checked(cache, q, True))
    finally:
        af.set_num_threads(old)


def test_bound_ring_errors():
    """The bound call checks what can change per call: q's dtype, shape and strides, the
    lengths and the scale, with the binding's messages."""
    from attn_fast import _dispatch

    k = np.zeros((1, 2, 8, 4), dtype=np.float32)
    v = np.zeros((1, 2, 8, 3), dtype=np.float32)
    ring = _dispatch.decode_ring(k, v)
    n, s = np.array([3]), np.array([0])
    q = np.ones((1, 4, 1, 4), dtype=np.float32)
    o = ring(q, 0.5, True, -1, np.array([1]), n, s)
    assert o.shape == (1, 4, 1, 3) and o.dtype == np.float32
    q4 = np.ones((1, 4, 4, 4), dtype=np.float32)  # 4 rows, 3 stored keys: None if causal
    assert ring(q4, 0.5, True, -1, np.array([4]), n, s) is None
    assert ring(q4, 0.5, False, -1, np.array([4]), n, s).shape == (1, 4, 4, 3)
    with pytest.raises(TypeError, match="share one dtype"):
        ring(q.astype(np.float64), 0.5, True, -1, None, n, s)
    with pytest.raises(ValueError, match="inconsistent"):
        ring(q[..., :3], 0.5, True, -1, None, n, s)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        ring(q[:, :3], 0.5, True, -1, None, n, s)
    with pytest.raises(ValueError, match="kv_start entries"):
        ring(q, 0.5, True, -1, None, n, np.array([8]))
    with pytest.raises(ValueError, match="kv_lens: expected 1 elements"):
        ring(q, 0.5, True, -1, None, np.array([1, 2]), s)
    with pytest.raises(ValueError, match="out of the range"):
        ring(q, 1e300, True, -1, None, n, s)
    with pytest.raises(TypeError, match="share one dtype"):
        _dispatch.decode_ring(k, v.astype(np.float64))
    with pytest.raises(ValueError, match="but v has shape"):
        _dispatch.decode_ring(k, v[:, :, :5])


@pytest.mark.parametrize("Lk", [1, 16, 129])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16], ids=str)
def test_numpy_api_plan_same_bits_as_checked_call(isa, rng, Lk, dtype):
    """The NumPy API's plan (a bound kernel call) gives the checked call's bits (return_lse
    keeps a call off the plan) and its errors."""
    q, k, v = qkv(rng, 1, 6, 2, 1, Lk, 8, 5, dtype)
    first = af.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    again = af.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    checked, _ = af.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True)
    assert type(again) is np.ndarray and again.dtype == dtype
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(again, checked)
    with pytest.raises(ValueError) as want:
        af.scaled_dot_product_attention(q, k[..., :-1], v, enable_gqa=True, return_lse=True)
    with pytest.raises(ValueError) as got:
        af.scaled_dot_product_attention(q, k[..., :-1], v, enable_gqa=True)
    assert str(got.value) == str(want.value)


# ---- KVCache._step: append + attend of one row per sequence in one C call -------------


def _rows(rng, dtype, *shape):
    """Random rows of a cache dtype (bfloat16: torch tensors, which the cache reads as bits)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "bfloat16":
        return torch.from_numpy(x).bfloat16()
    return x.astype(dtype)


def _same_state(a, b):
    """a and b hold the same counters and the same stored rows in the same slots."""
    assert a.capacity == b.capacity and a._last_L == b._last_L
    for name in ("_n", "_pos", "_start", "_last_new"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a._k.tobytes() == b._k.tobytes() and a._v.tobytes() == b._v.tobytes()


def _bits(x):
    return x.view(torch.int16).numpy() if torch is not None and torch.is_tensor(x) else x


@pytest.mark.parametrize("window", [None, 5], ids=["full", "win5"])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, "bfloat16"], ids=str)
def test_step_same_bits_and_state_as_append_attend(isa, rng, window, B, dtype):
    """_step gives append() + attend()'s result bit for bit and leaves the same storage and
    counters, through growth (a full ring without window: None, then the pair grows it),
    wrap-around of a window ring, longer chunks in between, reset and truncate."""
    if dtype == "bfloat16" and torch is None:
        pytest.skip("torch not installed (bfloat16 input)")
    Hq, Hkv, d, dv = 6, 2, 5, 3
    kw = dict(capacity=4, v_head_dim=dv, dtype=dtype, window=window)
    a, b = af.KVCache(B, Hkv, d, **kw), af.KVCache(B, Hkv, d, **kw)
    fast = fell_back = 0
    for t in range(30):
        if t == 20:
            a.reset(), b.reset()
        if t == 25 and window is None:
            a.truncate(1), b.truncate(1)
        L = 3 if t % 7 == 3 else 1
        k, v, q = (_rows(rng, dtype, B, h, L, e) for h, e in ((Hkv, d), (Hkv, dv), (Hq, d)))
        scale = None if t % 2 else 0.37
        o = a._step(q, k, v, scale)
        if o is None:  # the pair on the same cache, as the transformers backend does
            fell_back += 1
            a.append(k, v)
            o = a.attend(q, scale=scale)
        else:
            fast += 1
            assert L == 1 and type(o) is type(q) and tuple(o.shape) == (B, Hq, 1, dv)
        b.append(k, v)
        np.testing.assert_array_equal(_bits(o), _bits(b.attend(q, scale=scale)))
        _same_state(a, b)
        # the next plain attend reads the last append's lengths as q_lens in both
        np.testing.assert_array_equal(_bits(a.attend(q)), _bits(b.attend(q)))
    assert fast >= 15
    # longer chunks always fall back; without window so does a step into a full ring
    assert fell_back >= (5 if window is None else 4)


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_step_tensors_and_heads_last(rng, dtype):
    """Tensor rows give a tensor of their dtype; heads_last gives (B, 1, H_q, dv) with the
    same bits; the NumPy views of the same rows give the same bits as an array."""
    tdt = getattr(torch, dtype)
    B, Hq, Hkv, d = 2, 4, 2, 8
    caches = [af.KVCache(B, Hkv, d, dtype=dtype) for _ in range(3)]
    for _ in range(5):
        k, v, q = (torch.randn(B, h, 1, d, dtype=tdt) for h in (Hkv, Hkv, Hq))
        o1 = caches[0]._step(q, k, v, None)
        o2 = caches[1]._step(q, k, v, None, heads_last=True)
        assert torch.is_tensor(o1) and o1.dtype == tdt and tuple(o1.shape) == (B, Hq, 1, d)
        assert tuple(o2.shape) == (B, 1, Hq, d) and o2.is_contiguous()
        assert torch.equal(o1.reshape(B, 1, Hq, d), o2)
        if dtype != "bfloat16":
            o3 = caches[2]._step(q.numpy(), k.numpy(), v.numpy(), None)
            assert isinstance(o3, np.ndarray)
            np.testing.assert_array_equal(o3, o1.numpy())


def _declines(cache, q, k, v, scale=None):
    """_step returns None and changes nothing."""
    before = {n: getattr(cache, n).copy() for n in ("_n", "_pos", "_start", "_last_new")}
    kb, vb = cache._k.tobytes(), cache._v.tobytes()
    assert cache._step(q, k, v, scale) is None
    for n, x in before.items():
        np.testing.assert_array_equal(getattr(cache, n), x, err_msg=n)
    assert cache._k.tobytes() == kb and cache._v.tobytes() == vb


def test_step_declines_what_the_pair_takes_elsewhere(rng):
    """Anything but one float row per sequence of the cache's dtype and shapes, with a
    float scale in range, leaves the cache untouched and returns None (append / attend then
    raise for what is wrong, or take their general paths)."""
    B, Hq, Hkv, d = 2, 4, 2, 8
    cache = af.KVCache(B, Hkv, d, capacity=8)
    f = np.float32

    def rows(*shape, dt=f):
        return rng.standard_normal(shape).astype(dt)

    k, v, q = rows(B, Hkv, 1, d), rows(B, Hkv, 1, d), rows(B, Hq, 1, d)
    assert cache._step(q, k, v, None) is not None  # the rows fit
    for bad in (
        (rows(B, Hq, 2, d), rows(B, Hkv, 2, d), rows(B, Hkv, 2, d)),  # two rows
        (q, rows(B, Hkv, 1, d, dt=np.float64), v),  # dtype
        (q.astype(np.float64), k, v),
        (rows(B, 3, 1, d), k, v),  # H_q not a multiple of H_kv
        (q, rows(B, Hkv + 1, 1, d), v),
        (q, k, rows(B, Hkv, 1, d + 1)),  # dv of another cache
        (rows(B + 1, Hq, 1, d), k, v),
        (q[..., :-1], k, v),  # d
        (q, k[:, :, :, None], v),  # rank
        (q, np.ma.masked_array(k), v),  # an ndarray subclass
        (q, k.tolist(), v),
    ):
        _declines(cache, *bad)
    for scale in (1, np.float32(0.5), float("nan"), float("inf"), 1e300):
        _declines(cache, q, k, v, scale)
    if torch is not None:
        t = [torch.from_numpy(x) for x in (q, k, v)]
        _declines(cache, t[0], t[1].requires_grad_(), t[2])
        _declines(cache, q, *t[1:])  # mixed kinds
    for _ in range(7):  # fill it: without window a full ring must grow
        assert cache._step(q, k, v, None) is not None
    assert cache.lengths.tolist() == [8, 8]
    _declines(cache, q, k, v)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3"])
def test_step_declines_a_coded_cache(rng, dtype):
    """Quantised storage is written by its encoding: _step leaves it to append / attend."""
    cache = af.KVCache(1, 2, 8, dtype=dtype)
    k, q = rng.standard_normal((1, 2, 1, 8)).astype(np.float32), np.ones((1, 2, 1, 8), np.float32)
    assert cache._step(q, k, k, None) is None and cache.lengths.tolist() == [0]
