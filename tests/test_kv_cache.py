"""KVCache, LayerCaches and merge_attention_states against the float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_attention, assert_close, qkv, randn

import attn_fast as af
from attn_fast import reference as ref


def oracle(q, k, v, window=None, causal=True):
    """Full attention of all L queries over all L keys (one sequence batch)."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    if window is not None:
        mask = ref.window_mask(Lq, Lk, window - 1, 0 if causal else None)
    else:
        mask = ref.causal_mask(Lq, Lk) if causal else None
    return ref.sdpa(q, k, v, mask=mask, return_lse=True)


def check(o, lse, O, LSE, dtype=np.float32):
    assert_attention(o, lse, O, LSE, dtype)


CONFIGS = [
    # B, Hq, Hkv, L, d, dv
    (1, 1, 1, 7, 5, 5),
    (2, 4, 4, 33, 16, 16),  # MHA
    (2, 8, 2, 40, 64, 48),  # GQA
    (1, 6, 1, 45, 80, 80),  # MQA, odd head dim
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("window", [None, 5], ids=["full", "win5"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_token_by_token_equals_full_causal(isa, rng, cfg, window, dtype):
    B, Hq, Hkv, L, d, dv = cfg
    q, k, v = qkv(rng, B, Hq, Hkv, L, L, d, dv, dtype)
    O, LSE = oracle(q, k, v, window)
    cache = af.KVCache(B, Hkv, d, capacity=4, v_head_dim=dv, dtype=dtype, window=window)
    for t in range(L):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        o, lse = cache.attend(q[:, :, t : t + 1], return_lse=True)
        check(o[:, :, 0], lse[:, :, 0], O[:, :, t], LSE[:, :, t], dtype)
    assert len(cache) == L
    np.testing.assert_array_equal(cache.positions, [L] * B)
    if window is None:
        np.testing.assert_array_equal(cache.lengths, [L] * B)
    else:
        assert cache.capacity == 2 * window and (cache.lengths <= 2 * window).all()


@pytest.mark.parametrize("chunk", [1, 7, 64, 129])
@pytest.mark.parametrize("window", [None, 9, 50], ids=["full", "win9", "win50"])
def test_chunked_prefill_equals_one_shot(rng, chunk, window):
    B, Hq, Hkv, L, d, dv = 2, 4, 2, 100, 32, 24
    q, k, v = qkv(rng, B, Hq, Hkv, L, L, d, dv)
    O, LSE = oracle(q, k, v, window)
    cache = af.KVCache(B, Hkv, d, capacity=16, v_head_dim=dv, window=window)
    outs, lses = [], []
    for t in range(0, L, chunk):
        cache.append(k[:, :, t : t + chunk], v[:, :, t : t + chunk])
        o, lse = cache.attend(q[:, :, t : t + chunk], return_lse=True)
        outs.append(o)
        lses.append(lse)
    check(np.concatenate(outs, 2), np.concatenate(lses, 2), O, LSE)
    if chunk != 7:
        return
    # forward() does the same without growing a window ring
    c2 = af.KVCache(B, Hkv, d, capacity=16, v_head_dim=dv, window=window, growable=window is None)
    o2 = c2.forward(q, k, v)
    assert_close(o2, O, np.float32)
    if window is not None:
        assert c2.capacity == 2 * window


@pytest.mark.parametrize("window", [None, 6])
def test_ragged_batch(rng, window):
    """Sequences with different prompt lengths, then decode: each equals its own full attention."""
    B, Hq, Hkv, d, dv = 3, 4, 2, 16, 8
    prompt = np.array([5, 1, 12])
    steps = 9
    total = prompt + steps
    Lmax = int(total.max())
    q, k, v = qkv(rng, B, Hq, Hkv, Lmax, Lmax, d, dv)
    cache = af.KVCache(B, Hkv, d, capacity=8, v_head_dim=dv, window=window)
    P = int(prompt.max())
    cache.append(k[:, :, :P], v[:, :, :P], lengths=prompt)
    o_pre, lse_pre = cache.attend(
        q[:, :, :P], return_lse=True
    )  # q_lens default: the append's lengths
    np.testing.assert_array_equal(cache.positions, prompt)
    dec = []
    for t in range(steps):
        kt = np.stack([k[b, :, prompt[b] + t] for b in range(B)])[:, :, None]
        vt = np.stack([v[b, :, prompt[b] + t] for b in range(B)])[:, :, None]
        qt = np.stack([q[b, :, prompt[b] + t] for b in range(B)])[:, :, None]
        cache.append(kt, vt)
        dec.append(cache.attend(qt, return_lse=True))
    for b in range(B):
        n = int(total[b])
        O, LSE = oracle(q[b, :, :n], k[b, :, :n], v[b, :, :n], window)
        p = int(prompt[b])
        check(o_pre[b, :, :p], lse_pre[b, :, :p], O[:, :p], LSE[:, :p])
        assert (o_pre[b, :, p:] == 0).all() and np.isneginf(lse_pre[b, :, p:]).all()  # padding rows
        for t in range(steps):
            check(dec[t][0][b, :, 0], dec[t][1][b, :, 0], O[:, p + t], LSE[:, p + t])


@pytest.mark.parametrize("window", [None, 8])
def test_truncate_then_continue(rng, window):
    """Speculative decoding: append 5 drafts, keep 2, continue: equals the accepted sequence."""
    B, Hq, Hkv, d = 2, 4, 2, 16
    L = 30
    q, k, v = qkv(rng, B, Hq, Hkv, L, L, d, d)
    junk_k, junk_v = randn(rng, (B, Hkv, 5, d)), randn(rng, (B, Hkv, 5, d))
    O, LSE = oracle(q, k, v, window)
    cache = af.KVCache(B, Hkv, d, capacity=8, window=window)
    cache.append(k[:, :, :20], v[:, :, :20])
    cache.append(junk_k, junk_v)  # rejected drafts
    cache.truncate(20)
    assert len(cache) == 20
    np.testing.assert_array_equal(cache.positions, [20, 20])
    for t in range(20, L):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        o, lse = cache.attend(q[:, :, t : t + 1], return_lse=True)
        check(o[:, :, 0], lse[:, :, 0], O[:, :, t], LSE[:, :, t])
    # per-sequence truncate
    cache.truncate(np.array([25, 28]))
    np.testing.assert_array_equal(cache.positions, [25, 28])


def test_growth_keeps_contents(rng):
    B, H, d = 2, 3, 8
    k, v = randn(rng, (B, H, 100, d)), randn(rng, (B, H, 100, d))
    cache = af.KVCache(B, H, d, capacity=3)
    caps = set()
    for t in range(0, 100, 7):
        cache.append(k[:, :, t : t + 7], v[:, :, t : t + 7])
        caps.add(cache.capacity)
    assert cache.capacity >= 100 and len(caps) > 2
    for b in range(B):
        np.testing.assert_array_equal(cache.keys(b), k[b])
        np.testing.assert_array_equal(cache.values(b), v[b])
    assert cache.nbytes == 2 * B * H * cache.capacity * d * 4


def test_window_ring_is_bounded(rng):
    B, H, d, w = 1, 2, 4, 16
    cache = af.KVCache(B, H, d, window=w, growable=False)
    k = randn(rng, (B, H, 1000, d))
    for t in range(1000):
        cache.append(k[:, :, t : t + 1], k[:, :, t : t + 1])
    assert cache.capacity == 2 * w and cache.nbytes == 2 * B * H * 2 * w * d * 4
    assert len(cache) == 1000 and cache.lengths[0] == 2 * w
    np.testing.assert_array_equal(cache.keys(0), k[0, :, 1000 - 2 * w :])


def test_non_contiguous_inputs(rng):
    B, Hq, Hkv, L, d = 2, 4, 2, 20, 16
    # (B, L, H, d) storage viewed as (B, H, L, d)
    q = randn(rng, (B, L, Hq, d)).transpose(0, 2, 1, 3)
    k = randn(rng, (B, L, Hkv, d)).transpose(0, 2, 1, 3)
    v = randn(rng, (B, L, Hkv, 2 * d))[..., ::2].transpose(0, 2, 1, 3)
    O, LSE = oracle(q, k, v)
    cache = af.KVCache(B, Hkv, d)
    cache.append(k[:, :, :13], v[:, :, :13])
    o1 = cache.attend(q[:, :, :13])
    cache.append(k[:, :, 13:], v[:, :, 13:])
    o2 = cache.attend(q[:, :, 13:])
    assert_close(np.concatenate([o1, o2], 2), O, np.float32)


def test_non_causal_attend(rng):
    B, Hq, Hkv, L, d = 1, 2, 1, 10, 8
    q, k, v = qkv(rng, B, Hq, Hkv, L, L, d, d)
    cache = af.KVCache(B, Hkv, d)
    cache.append(k, v)
    O, _ = oracle(q[:, :, :3], k, v, causal=False)
    assert_close(cache.attend(q[:, :, :3], causal=False), O, np.float32)


def test_bad_input_leaves_cache_unchanged(rng):
    B, H, d = 2, 2, 8
    cache = af.KVCache(B, H, d, capacity=10, growable=False)
    k, v = randn(rng, (B, H, 6, d)), randn(rng, (B, H, 6, d))
    cache.append(k, v)
    before = (cache.lengths, cache.positions, cache.keys(0).copy(), cache.nbytes)

    def same():
        np.testing.assert_array_equal(cache.lengths, before[0])
        np.testing.assert_array_equal(cache.positions, before[1])
        np.testing.assert_array_equal(cache.keys(0), before[2])
        assert cache.nbytes == before[3]

    with pytest.raises(ValueError, match=r"k has shape \(2, 3, 1, 8\)"):
        cache.append(randn(rng, (B, 3, 1, d)), randn(rng, (B, 3, 1, d)))  # wrong heads
    with pytest.raises(ValueError, match="k has shape"):
        cache.append(randn(rng, (B, H, 1, d + 1)), randn(rng, (B, H, 1, d)))  # wrong dim
    with pytest.raises(ValueError, match="v has shape"):
        cache.append(randn(rng, (B, H, 1, d)), randn(rng, (B, H, 1, d + 2)))
    with pytest.raises(ValueError, match="lengths differ"):
        cache.append(randn(rng, (B, H, 2, d)), randn(rng, (B, H, 1, d)))
    with pytest.raises(TypeError, match="dtype"):
        cache.append(k[:, :, :1].astype(np.float64), v[:, :, :1].astype(np.float64))
    with pytest.raises(ValueError, match="fixed capacity 10"):
        cache.append(k, v)  # 6 + 6 > 10
    with pytest.raises(ValueError, match="lengths must be <= 6"):
        cache.append(k, v, lengths=[7, 1])
    with pytest.raises(ValueError, match="beyond the current lengths"):
        cache.truncate(7)
    with pytest.raises(ValueError, match="batch 3"):
        cache.attend(randn(rng, (3, H, 1, d)))
    with pytest.raises(ValueError, match="head dim 4"):
        cache.attend(randn(rng, (B, H, 1, 4)))
    with pytest.raises(ValueError, match="3 heads"):
        cache.attend(randn(rng, (B, 3, 1, d)))
    with pytest.raises(ValueError, match="exceed the stored lengths"):
        cache.attend(randn(rng, (B, H, 7, d)))
    same()
    with pytest.raises(ValueError, match="window"):
        af.KVCache(1, 1, 4, window=8, ring=4)
    with pytest.raises(TypeError, match="batch must be an int"):
        af.KVCache(1.5, 1, 4)
    wc = af.KVCache(1, 1, 4, window=4, growable=False)  # ring 8: chunks of at most 5
    with pytest.raises(ValueError, match="does not fit the ring"):
        wc.append(randn(rng, (1, 1, 6, 4)), randn(rng, (1, 1, 6, 4)))
    assert len(wc) == 0


def test_reset_and_layer_caches(rng):
    caches = af.LayerCaches(3, 2, 2, 8, capacity=4)
    assert len(caches) == 3 and caches.nbytes == 3 * 2 * 2 * 2 * 4 * 8 * 4
    k = randn(rng, (2, 2, 3, 8))
    for c in caches:
        c.append(k, k)
    assert [len(c) for c in caches] == [3, 3, 3]
    caches[2].truncate(2)
    with pytest.raises(ValueError, match="beyond the current lengths"):
        caches.truncate(3)  # fine for layers 0 and 1, not for layer 2: nothing changes
    assert [len(c) for c in caches] == [3, 3, 2]
    caches.truncate(1)
    assert [len(c) for c in caches] == [1, 1, 1]
    np.testing.assert_array_equal(caches.positions, [1, 1])
    caches.reset()
    assert len(caches[1]) == 0 and caches.nbytes == 3 * 2 * 2 * 2 * 4 * 8 * 4


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_attention_states(rng, dtype):
    B, H, Lq, Lk, d, dv = 2, 3, 5, 40, 16, 12
    q, k, v = (
        randn(rng, (B, H, Lq, d), dtype),
        randn(rng, (B, H, Lk, d), dtype),
        randn(rng, (B, H, Lk, dv), dtype),
    )
    perm = rng.permutation(Lk)
    a, b = perm[:13], perm[13:]
    o_a, lse_a = af.scaled_dot_product_attention(q, k[:, :, a], v[:, :, a], return_lse=True)
    o_b, lse_b = af.scaled_dot_product_attention(q, k[:, :, b], v[:, :, b], return_lse=True)
    o, lse = af.merge_attention_states(o_a, lse_a, o_b, lse_b)
    O, LSE = ref.sdpa(q, k, v, return_lse=True)
    assert o.dtype == dtype and lse.dtype == dtype
    check(o, lse, O, LSE, dtype)
    # an empty part (-inf lse) is the identity; both empty gives 0 and -inf
    empty_o, empty_lse = np.full_like(o_a, np.nan), np.full_like(lse_a, -np.inf)
    o2, lse2 = af.merge_attention_states(
        o_a, lse_a, empty_o, empty_lse
    )  # empty part's o is ignored
    check(o2, lse2, o_a, lse_a, dtype)
    o3, lse3 = af.merge_attention_states(empty_o, empty_lse, empty_o, empty_lse)
    assert (o3 == 0).all() and np.isneginf(lse3).all()
    with pytest.raises(ValueError, match="o_a has shape"):
        af.merge_attention_states(o_a, lse_a, o_b[..., :3], lse_b)
    with pytest.raises(ValueError, match="lse_a"):
        af.merge_attention_states(o_a, lse_a[..., :2], o_b, lse_b)


hyp = pytest.importorskip("hypothesis")
st = hyp.strategies


@hyp.settings(max_examples=15, deadline=None)
@hyp.given(
    B=st.integers(1, 3),
    Hkv=st.integers(1, 3),
    G=st.integers(1, 4),
    L=st.integers(1, 40),
    d=st.integers(1, 20),
    window=st.one_of(st.none(), st.integers(1, 12)),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    seed=st.integers(0, 2**31),
)
def test_property_cache_equals_full_causal(B, Hkv, G, L, d, window, chunks, seed):
    """Any chunking of any sequence through the cache equals one full (windowed) causal call."""
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, B, Hkv * G, Hkv, L, L, d, d)
    O, LSE = oracle(q, k, v, window)
    cache = af.KVCache(B, Hkv, d, capacity=2, window=window)
    t, i = 0, 0
    while t < L:
        c = chunks[i % len(chunks)]
        i += 1
        cache.append(k[:, :, t : t + c], v[:, :, t : t + c])
        o, lse = cache.attend(q[:, :, t : t + c], return_lse=True)
        check(o, lse, O[:, :, t : t + c], LSE[:, :, t : t + c])
        t += c
    assert len(cache) == L


# ---------------------------------------------------------------- huge-page storage


def test_huge_arrays_are_zeroed_aligned_views_of_one_mapping():
    """_huge_arrays: arrays of >= 2 MiB together share one mapping whose start is 2 MiB-aligned
    (each array on a 64-byte boundary, zero-filled, writable, C-contiguous, the shapes and dtypes
    asked); arrays that fill less than a huge page are plain separate np.zeros arrays."""
    import mmap

    from attn_fast._kv_store import huge_arrays as _huge_arrays

    specs = [((3, 5, 7), np.float32), ((1 << 20,), np.int8), ((4, 1 << 18), np.uint16)]
    arrays = _huge_arrays(specs)
    for a, (shape, dt) in zip(arrays, specs):
        assert a.shape == shape and a.dtype == dt and a.flags.c_contiguous and a.flags.writeable
        assert not a.any()
        assert a.__array_interface__["data"][0] % 64 == 0
        a[...] = 1  # writable to the last element
    assert [int(a.sum()) for a in arrays] == [3 * 5 * 7, 1 << 20, 1 << 20]
    if hasattr(mmap, "MADV_HUGEPAGE"):
        addr = [a.__array_interface__["data"][0] for a in arrays]
        assert addr[0] % (2 << 20) == 0
        assert addr[0] < addr[1] < addr[2] < addr[0] + (4 << 20)  # one mapping, in order
        assert not np.shares_memory(arrays[0], arrays[1])
    small = _huge_arrays([((8,), np.float32), ((2, 3), np.int8)])
    assert [a.shape for a in small] == [(8,), (2, 3)] and not any(a.any() for a in small)
    assert all(a.base is None for a in small)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_caches_big_enough_live_on_one_mapping(dtype):
    """A KVCache and a PagedKVCache chunk of several MiB keep their arrays in one mapping (the
    huge-page layout of _huge_arrays), still separate arrays to the kernel: results equal a
    small cache's, which uses plain arrays."""
    import mmap

    rng = np.random.default_rng(7)
    H, d, n = 2, 64, 300
    k, v = rng.standard_normal((2, 1, H, n, d), dtype=np.float32)
    q = rng.standard_normal((1, 4, 1, d), dtype=np.float32)
    big = af.KVCache(1, H, d, capacity=8192, dtype=dtype)
    small = af.KVCache(1, H, d, capacity=n, dtype=dtype)
    paged = af.PagedKVCache(H, d, dtype=dtype, num_blocks=64)
    for c in (big, small):
        c.append(k, v)
    seq = paged.add_sequence()
    paged.append([seq], k, v)
    want = np.asarray(small.attend(q))
    assert np.array_equal(np.asarray(big.attend(q)), want)
    assert np.array_equal(np.asarray(paged.attend([seq], q)), want)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert big._k.base is not None and big._k.base is big._v.base
        assert paged._kc[0].base is paged._vc[0].base
        assert big._k.__array_interface__["data"][0] % (2 << 20) == 0
