"""PagedKVCache: a pool of blocks, per-sequence block tables, read in place by the decode kernel.

Oracles: the float64 attention (tests/oracle.py) over each sequence's stored keys and values
(``keys(i)`` / ``values(i)``), and the contiguous ``KVCache`` holding the same tokens, which
decode (chunks of up to ``DECODE_MAX_LQ`` rows) must match bit for bit: with block sizes that
are multiples of 64 the kernel cuts the keys at the same places in both layouts.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import poisoned, tol
from oracle import causal_mask, sdpa

import attn_fast as af
from attn_fast import _core
from attn_fast._dispatch import DECODE_MAX_LQ
from attn_fast.positional import RoPE

F32 = np.float32
DTYPES = {
    "float32": F32,
    "float64": np.float64,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}
# Against the float64 oracle: float32 rounding, or one rounding of O to 16 bits.
TOL16 = {"float16": dict(rtol=4e-3, atol=2e-3), "bfloat16": dict(rtol=2e-2, atol=1e-2)}


def randn(rng, shape, dtype=F32):
    return rng.standard_normal(shape).astype(dtype)


def tolerance(name):
    return TOL16.get(name) or tol(DTYPES[name])


def oracle_seq(q, K, V, q_len, causal=True, scale=None):
    """Attention of q (Hq, Lq, d)'s first q_len rows over K, V (H_kv, n, d), float64, the
    queries bottom-right aligned (the last q_len positions)."""
    q, K, V = (np.asarray(x, np.float64) for x in (q[:, :q_len], K, V))
    mask = causal_mask(q_len, K.shape[1]) if causal else None
    return sdpa(q, K, V, mask=mask, scale=scale, return_lse=True)


def check_oracle(cache, ids, q, o, lse, q_lens, name="float32", causal=True):
    for b, i in enumerate(ids):
        ql = int(q_lens[b])
        O, LSE = oracle_seq(q[b], cache.keys(i), cache.values(i), ql, causal)
        got = np.asarray(o[b, :, :ql], np.float64)
        np.testing.assert_allclose(got, O, **tolerance(name), err_msg=f"sequence {i}")
        np.testing.assert_allclose(lse[b, :, :ql], LSE, **tol(F32), err_msg=f"lse of {i}")
        np.testing.assert_array_equal(np.asarray(o[b, :, ql:], np.float64), 0)  # padding rows
        assert np.isneginf(lse[b, :, ql:]).all()


# ---------------------------------------------------------------- the oracle

CONFIGS = [  # Hq, Hkv, d, dv, per-sequence lengths of the first append, then chunk lengths
    (1, 1, 1, 1, [1, 7], [1, 1]),
    (4, 2, 5, 7, [1, 63, 64, 65, 129], [1, 3]),
    (8, 2, 80, 80, [200, 7], [1, 7]),
    (2, 2, 256, 256, [257, 1], [1]),
    (4, 1, 16, 16, [129, 300, 64], [4, 1]),
]


@pytest.mark.parametrize("Hq, Hkv, d, dv, first, chunks", CONFIGS)
def test_attend_matches_oracle(isa, rng, Hq, Hkv, d, dv, first, chunks):
    """Ragged lengths from 1 to over three blocks (not multiples of the block size), GQA,
    d in {1, 5, 80, 256}, poisoned outputs; decode steps and short chunks, lse."""
    cache = af.PagedKVCache(Hkv, d, v_head_dim=dv, num_blocks=3, block_size=64)
    ids = [cache.add_sequence() for _ in first]
    B, L = len(ids), max(first)
    cache.append(ids, randn(rng, (B, Hkv, L, d)), randn(rng, (B, Hkv, L, dv)), lengths=first)
    q = randn(rng, (B, Hq, L, d))
    out = poisoned((B, Hq, L, dv), F32)
    o, lse = cache.attend(ids, q, out=out, return_lse=True)
    assert o is out
    check_oracle(cache, ids, q, o, lse, first)
    for c in chunks:
        cache.append(ids, randn(rng, (B, Hkv, c, d)), randn(rng, (B, Hkv, c, dv)))
        q = randn(rng, (B, Hq, c, d))
        o, lse = cache.attend(ids, q, out=poisoned((B, Hq, c, dv), F32), return_lse=True)
        check_oracle(cache, ids, q, o, lse, [c] * B)
    assert cache.lengths == {i: n + sum(chunks) for i, n in zip(ids, first)}


def test_stored_tokens_are_the_appended_ones(rng):
    H, d, dv = 3, 6, 5
    cache = af.PagedKVCache(H, d, v_head_dim=dv, num_blocks=2, block_size=64)
    a, b = cache.add_sequence(), cache.add_sequence()
    ks, vs = {a: [], b: []}, {a: [], b: []}
    for L, lens in [(70, [70, 3]), (1, [1, 1]), (130, [0, 130]), (64, [64, 64])]:
        k, v = randn(rng, (2, H, L, d)), randn(rng, (2, H, L, dv))
        cache.append([a, b], k, v, lengths=lens)
        for j, i in enumerate((a, b)):
            ks[i].append(k[j, :, : lens[j]])
            vs[i].append(v[j, :, : lens[j]])
    for i in (a, b):
        np.testing.assert_array_equal(cache.keys(i), np.concatenate(ks[i], axis=1))
        np.testing.assert_array_equal(cache.values(i), np.concatenate(vs[i], axis=1))


def test_prefill_chunk_and_non_causal(isa, rng):
    """A long chunk (129 rows, above DECODE_MAX_LQ) runs the decode kernel too; causal=False
    sees every stored key."""
    H, Hq, d = 2, 4, 16
    cache = af.PagedKVCache(H, d, block_size=64)
    ids = [cache.add_sequence() for _ in range(2)]
    cache.append(ids, randn(rng, (2, H, 40, d)), randn(rng, (2, H, 40, d)), lengths=[40, 5])
    k, v = randn(rng, (2, H, 129, d)), randn(rng, (2, H, 129, d))
    cache.append(ids, k, v, lengths=[129, 100])
    q = randn(rng, (2, Hq, 129, d))
    o, lse = cache.attend(ids, q, return_lse=True)  # q_lens: the last append's, [129, 100]
    check_oracle(cache, ids, q, o, lse, [129, 100])
    o, lse = cache.attend(ids, q, causal=False, q_lens=[3, 129], return_lse=True)
    check_oracle(cache, ids, q, o, lse, [3, 129], causal=False)


def test_non_contiguous_inputs(isa, rng):
    H, Hq, d, L = 2, 4, 8, 70
    cache = af.PagedKVCache(H, d, block_size=64)
    ids = [cache.add_sequence() for _ in range(2)]
    k = randn(rng, (2, L, H, d)).transpose(0, 2, 1, 3)  # (B, H, L, d) view of (B, L, H, d)
    v = randn(rng, (2, H, d, 2 * L))[..., ::2].transpose(0, 1, 3, 2)[:, :, :L]
    cache.append(ids, k, v)
    np.testing.assert_array_equal(cache.keys(ids[1]), k[1])
    q = randn(rng, (2, 1, Hq, d)).transpose(0, 2, 1, 3)
    o, lse = cache.attend(ids, q, return_lse=True)
    check_oracle(cache, ids, q, o, lse, [1, 1], causal=True)
    out = poisoned((2, 1, Hq, d), F32).transpose(0, 2, 1, 3)  # a strided out
    assert cache.attend(ids, q, out=out) is out
    np.testing.assert_array_equal(out, o)


def test_empty_sequence_and_padding_rows(isa, rng):
    """A sequence with no keys gets zero rows and lse = -inf; so do rows past q_lens."""
    H, d = 1, 4
    cache = af.PagedKVCache(H, d, block_size=64)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append([a], randn(rng, (1, H, 10, d)), randn(rng, (1, H, 10, d)))
    q = randn(rng, (2, 2, 3, d))
    o, lse = cache.attend(
        [a, b], q, q_lens=[2, 0], out=poisoned((2, 2, 3, d), F32), return_lse=True
    )
    check_oracle(cache, [a, b], q, o, lse, [2, 0])
    o, lse = cache.attend([b], q[1:], causal=False, return_lse=True)
    np.testing.assert_array_equal(o, 0)
    assert np.isneginf(lse).all()


# ---------------------------------------------------------------- against the contiguous cache


@pytest.mark.parametrize("name", list(DTYPES))
def test_bit_identical_to_contiguous_cache(isa, rng, name):
    """Same tokens in a KVCache and a PagedKVCache: decode and short chunks give the same bits
    (each dtype; both run the split-KV decode kernel over the same key blocks)."""
    dt = DTYPES[name]
    B, H, Hq, d = 3, 2, 8, 32
    lens = [1, 100, 300]
    ref = af.KVCache(B, H, d, dtype=dt)
    cache = af.PagedKVCache(H, d, dtype=dt, num_blocks=4, block_size=64)
    ids = [cache.add_sequence() for _ in range(B)]
    k, v = randn(rng, (B, H, 300, d), dt), randn(rng, (B, H, 300, d), dt)
    ref.append(k, v, lengths=lens)
    cache.append(ids, k, v, lengths=lens)
    for c in [1, 1, DECODE_MAX_LQ, 1]:
        k, v, q = (randn(rng, (B, h, c, d), dt) for h in (H, H, Hq))
        ref.append(k, v)
        cache.append(ids, k, v)
        o1, lse1 = ref.attend(q, return_lse=True)
        o2, lse2 = cache.attend(ids, q, return_lse=True)
        assert o2.dtype == o1.dtype
        np.testing.assert_array_equal(o2.view(np.uint8), o1.view(np.uint8))
        np.testing.assert_array_equal(lse2, lse1)
    for i, b in zip(ids, range(B)):
        np.testing.assert_array_equal(cache.keys(i).view(np.uint8), ref.keys(b).view(np.uint8))


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_half_dtypes_against_oracle(isa, rng, name):
    dt = DTYPES[name]
    H, Hq, d = 2, 4, 80
    cache = af.PagedKVCache(H, d, dtype=name, block_size=64)
    assert cache.dtype == (np.uint16 if name == "bfloat16" else np.float16)
    ids = [cache.add_sequence() for _ in range(2)]
    cache.append(
        ids, randn(rng, (2, H, 150, d), dt), randn(rng, (2, H, 150, d), dt), lengths=[150, 9]
    )
    q = randn(rng, (2, Hq, 1, d), dt)
    o, lse = cache.attend(ids, q, return_lse=True)
    assert o.dtype == dt and lse.dtype == F32
    check_oracle(cache, ids, q, o, lse, [1, 1], name=name)


@pytest.mark.parametrize("name", ["float32", "int8"])
def test_default_block_size_is_256_and_gives_the_64_row_bits(isa, rng, name):
    """The default pool (256-row blocks, 64 per chunk) against 64-row blocks: the same decode
    bits over sequences that span several default blocks."""
    H, d, lens = 2, 16, [1, 255, 600, 257]
    f32 = DTYPES["float32"]
    k, v = randn(rng, (4, H, 600, d), f32), randn(rng, (4, H, 600, d), f32)
    q = randn(rng, (4, 2 * H, 1, d), f32)
    default = af.PagedKVCache(H, d, dtype=name)
    assert (default.block_size, default.num_blocks) == (256, 64)
    outs = []
    for cache in (default, af.PagedKVCache(H, d, dtype=name, block_size=64)):
        ids = [cache.add_sequence() for _ in lens]
        cache.append(ids, k, v, lengths=lens)
        cache.append(ids, k[:, :, :1], v[:, :, :1])
        outs.append(cache.attend(ids, q))
    assert default.free_blocks == default.num_blocks - sum(-(-(n + 1) // 256) for n in lens)
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("block_size", [128, 192])
def test_result_does_not_depend_on_block_size(isa, rng, block_size):
    H, d, lens = 2, 16, [1, 64, 500, 129]
    k, v = randn(rng, (4, H, 500, d)), randn(rng, (4, H, 500, d))
    q = randn(rng, (4, 2 * H, 2, d))
    outs = []
    for bs in (64, block_size):
        cache = af.PagedKVCache(H, d, block_size=bs, num_blocks=2)
        ids = [cache.add_sequence() for _ in lens]
        cache.append(ids, k, v, lengths=lens)
        cache.append(ids, k[:, :, :2], v[:, :, :2])
        outs.append(cache.attend(ids, q))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_rope_on_append_matches_contiguous_cache(rng):
    H, d = 2, 16
    rope = RoPE(d)
    ref = af.KVCache(2, H, d)
    cache = af.PagedKVCache(H, d, block_size=64)
    ids = [cache.add_sequence() for _ in range(2)]
    for L, lens in [(70, [70, 5]), (1, [1, 1]), (3, [3, 3])]:
        k, v = randn(rng, (2, H, L, d)), randn(rng, (2, H, L, d))
        ref.append(k, v, lengths=lens, rope=rope)
        cache.append(ids, k, v, lengths=lens, rope=rope)
    for b, i in enumerate(ids):
        np.testing.assert_allclose(cache.keys(i), ref.keys(b), rtol=1e-6, atol=1e-6)


def test_torch_in_torch_out(rng):
    torch = pytest.importorskip("torch")
    H, d = 2, 8
    cache = af.PagedKVCache(H, d, dtype=torch.bfloat16, block_size=64)
    i = cache.add_sequence()
    k = torch.from_numpy(randn(rng, (1, H, 9, d))).to(torch.bfloat16)
    cache.append(i, k, k)
    q = torch.from_numpy(randn(rng, (1, 4, 1, d))).to(torch.bfloat16)
    o = cache.attend(i, q)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and o.shape == (1, 4, 1, d)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int8"])
def test_planned_attend_equals_the_checked_path(isa, rng, name):
    """attend's fast path (a query of the layout, kind and scale the last checked call had:
    KVStore._planned) gives the bits of the checked path, step after step, for any set of
    sequences; a query of another batch, dtype or layout is checked again."""
    dt = {"float32": F32, "bfloat16": ml_dtypes.bfloat16, "int8": F32}[name]
    H, Hq, d = 2, 6, 16
    caches = [af.PagedKVCache(H, d, dtype=name, block_size=64) for _ in range(2)]
    ids = [[c.add_sequence() for _ in range(3)] for c in caches]
    k = randn(rng, (3, H, 70, d), dt)
    for c, i in zip(caches, ids):
        c.append(i, k, k, lengths=[70, 5, 64])
    for step in range(4):
        k1, q = randn(rng, (3, H, 1, d), dt), randn(rng, (3, Hq, 1, d), dt)
        sel = [0, 2] if step % 2 else [0, 1, 2]  # another set of sequences, the same layout
        outs = []
        for fast, c, i in zip((True, False), caches, ids):
            c.append(i, k1, k1)
            if not fast:
                c._plan_key = None
            outs.append(c.attend([i[j] for j in sel], q[sel[0] : sel[0] + len(sel)]))
        # (ml_dtypes bfloat16 arrays are checked every call: fast_view takes NumPy float
        # arrays and tensors)
        assert (caches[0]._plan_key is not None) == (name != "bfloat16")
        np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    c, i = caches[0], ids[0]
    q = randn(rng, (2, Hq, 1, d), dt)
    c.attend(i[:2], q)
    with pytest.raises(ValueError, match="batch 2 but seq_ids names 3"):
        c.attend(i, q)
    with pytest.raises(TypeError, match="q has dtype float64"):
        c.attend(i[:2], q.astype(np.float64))
    with pytest.raises(ValueError, match="head dim 8"):
        c.attend(i[:2], np.ascontiguousarray(q[..., :8]))


# ---------------------------------------------------------------- many sequences in one call


def test_batch_of_64_ragged_sequences_in_one_call(isa, rng):
    """64 sequences of lengths 16 .. 16384 decode in one attend call."""
    H, d = 1, 4
    lens = np.unique(np.geomspace(16, 16384, 64).astype(int))
    lens = np.concatenate([lens, 16 + np.arange(64 - len(lens))])[:64]
    assert len(lens) == 64 and lens.min() == 16 and lens.max() == 16384
    cache = af.PagedKVCache(H, d, num_blocks=512, block_size=64)
    ids = [cache.add_sequence() for _ in lens]
    for i, n in zip(ids, lens):
        cache.append(i, randn(rng, (1, H, n, d)), randn(rng, (1, H, n, d)))
    step = randn(rng, (64, H, 1, d))
    cache.append(ids, step, step)
    q = randn(rng, (64, 2, 1, d))
    o, lse = cache.attend(ids, q, out=poisoned((64, 2, 1, d), F32), return_lse=True)
    check_oracle(cache, ids, q, o, lse, [1] * 64)
    used = sum(-(-(int(n) + 1) // 64) for n in lens)
    assert cache.num_blocks - cache.free_blocks == used


# ---------------------------------------------------------------- fork, free, growth


def test_fork_and_diverging_appends_leave_the_parent_unchanged(isa, rng):
    H, Hq, d = 2, 4, 8
    cache = af.PagedKVCache(H, d, num_blocks=8, block_size=64)
    p = cache.add_sequence()
    k0, v0 = randn(rng, (1, H, 100, d)), randn(rng, (1, H, 100, d))  # one full block + 36 rows
    cache.append(p, k0, v0)
    before = cache.free_blocks
    c = cache.fork(p)
    assert cache.free_blocks == before  # nothing copied by fork
    np.testing.assert_array_equal(cache.block_table(c), cache.block_table(p))
    kc, vc = randn(rng, (1, H, 3, d)), randn(rng, (1, H, 3, d))
    cache.append(c, kc, vc)  # copy-on-write of the shared partial block
    assert cache.free_blocks == before - 1
    tp, tc = cache.block_table(p)[0], cache.block_table(c)[0]
    assert tp[0] == tc[0] and tp[1] != tc[1]  # the full block stays shared
    np.testing.assert_array_equal(cache.keys(p), k0[0])
    kp, vp = randn(rng, (1, H, 1, d)), randn(rng, (1, H, 1, d))
    cache.append(p, kp, vp)  # the parent now owns its partial block alone: written in place
    assert cache.free_blocks == before - 1
    np.testing.assert_array_equal(cache.keys(p), np.concatenate([k0, kp], axis=2)[0])
    np.testing.assert_array_equal(cache.keys(c), np.concatenate([k0, kc], axis=2)[0])
    np.testing.assert_array_equal(cache.values(c), np.concatenate([v0, vc], axis=2)[0])
    q = randn(rng, (2, Hq, 1, d))
    o, lse = cache.attend([p, c], q, return_lse=True)
    check_oracle(cache, [p, c], q, o, lse, [1, 1])
    for seq, ks, vs in [(p, kp, vp), (c, kc, vc)]:  # each equals a cache of its own tokens
        ref = af.KVCache(1, H, d)
        ref.append(np.concatenate([k0, ks], axis=2), np.concatenate([v0, vs], axis=2))
        np.testing.assert_array_equal(
            cache.attend(seq, q[:1], q_lens=1), ref.attend(q[:1], q_lens=1)
        )


def test_fork_at_a_block_boundary_copies_nothing(rng):
    H, d = 1, 4
    cache = af.PagedKVCache(H, d, num_blocks=8, block_size=64)
    p = cache.add_sequence()
    cache.append(p, randn(rng, (1, H, 128, d)), randn(rng, (1, H, 128, d)))
    c = cache.fork(p)
    free = cache.free_blocks
    cache.append([p, c], randn(rng, (2, H, 1, d)), randn(rng, (2, H, 1, d)))
    assert cache.free_blocks == free - 2  # one fresh block each, no copy
    assert cache.lengths == {p: 129, c: 129}


def test_free_then_reuse_blocks(isa, rng):
    H, d = 2, 8
    cache = af.PagedKVCache(H, d, num_blocks=6, growable=False, block_size=64)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append([a, b], randn(rng, (2, H, 192, d)), randn(rng, (2, H, 192, d)))
    assert cache.free_blocks == 0
    f = cache.fork(b)
    cache.free(b)  # f still holds b's blocks
    assert cache.free_blocks == 0
    cache.free(a)
    assert cache.free_blocks == 3 and a not in cache and len(cache) == 1
    c = cache.add_sequence()
    k, v = randn(rng, (1, H, 150, d)), randn(rng, (1, H, 150, d))
    cache.append(c, k, v)  # reuses a's blocks (their old rows must not show)
    assert cache.free_blocks == 0 and cache.num_blocks == 6
    np.testing.assert_array_equal(cache.keys(c), k[0])
    q = randn(rng, (2, 4, 1, d))
    o, lse = cache.attend([c, f], q, q_lens=1, return_lse=True)
    check_oracle(cache, [c, f], q, o, lse, [1, 1])


def test_pool_grows_by_chunks_without_moving_blocks(rng):
    H, d = 1, 4
    cache = af.PagedKVCache(H, d, num_blocks=2, block_size=64)
    i = cache.add_sequence()
    k, v = randn(rng, (1, H, 1000, d)), randn(rng, (1, H, 1000, d))
    cache.append(i, k[:, :, :100], v[:, :, :100])
    first = cache._kc[0]
    cache.append(i, k[:, :, 100:], v[:, :, 100:])
    assert cache.num_blocks == 16 and cache._kc[0] is first  # 16 blocks: 8 chunks of 2
    np.testing.assert_array_equal(cache.keys(i), k[0])
    assert cache.nbytes == 16 * H * 64 * (d + d) * 4
    q = randn(rng, (1, 1, 1, d))
    o, lse = cache.attend(i, q, q_lens=1, return_lse=True)
    check_oracle(cache, [i], q, o, lse, [1])


def test_nbytes_is_the_pool_and_used_nbytes_the_held_blocks(rng):
    H, d, dv = 8, 128, 64
    cache = af.PagedKVCache(H, d, v_head_dim=dv, dtype="bfloat16", num_blocks=64, block_size=64)
    assert cache.nbytes == 64 * H * 64 * (d + dv) * 2
    ids = [cache.add_sequence() for _ in range(3)]
    lens = [1000, 65, 7]
    x = randn(rng, (3, H, 1000, d), ml_dtypes.bfloat16)
    cache.append(ids, x, x[..., :dv], lengths=lens)
    token = H * (d + dv) * 2
    assert sum(lens) * token <= cache.used_nbytes < (sum(lens) + 3 * 64) * token


# ---------------------------------------------------------------- errors


def test_bad_constructor_arguments():
    with pytest.raises(TypeError, match="float32, float64, float16, bfloat16 or int8"):
        af.PagedKVCache(1, 4, dtype=np.int32)
    with pytest.raises(TypeError, match="float32, float64, float16, bfloat16 or int8"):
        af.PagedKVCache(1, 4, dtype="float8")
    with pytest.raises(ValueError, match="block_size must be a multiple of 64"):
        af.PagedKVCache(1, 4, block_size=100)
    with pytest.raises(ValueError, match="num_blocks"):
        af.PagedKVCache(1, 4, num_blocks=0)
    with pytest.raises(ValueError, match="head_dim"):
        af.PagedKVCache(1, 0)


def test_pool_exhausted_with_a_fixed_pool_changes_nothing(rng):
    H, d = 1, 4
    cache = af.PagedKVCache(H, d, num_blocks=2, growable=False, block_size=64)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, randn(rng, (1, H, 100, d)), randn(rng, (1, H, 100, d)))
    keys = cache.keys(a)
    with pytest.raises(ValueError, match=r"pool exhausted.*needs 2 free blocks, 0 of 2"):
        cache.append([a, b], randn(rng, (2, H, 30, d)), randn(rng, (2, H, 30, d)))
    assert cache.lengths == {a: 100, b: 0} and cache.free_blocks == 0
    np.testing.assert_array_equal(cache.keys(a), keys)
    cache.append(a, randn(rng, (1, H, 28, d)), randn(rng, (1, H, 28, d)))  # fits its block
    assert cache.lengths[a] == 128


def test_block_table_overflow(rng):
    cache = af.PagedKVCache(1, 4, max_seq_len=128, block_size=64)
    i = cache.add_sequence()
    cache.append(i, randn(rng, (1, 1, 120, 4)), randn(rng, (1, 1, 120, 4)))
    with pytest.raises(ValueError, match="block table overflow.*max_seq_len = 128"):
        cache.append(i, randn(rng, (1, 1, 9, 4)), randn(rng, (1, 1, 9, 4)))
    assert cache.lengths == {i: 120}


def test_unknown_and_freed_sequences(rng):
    cache = af.PagedKVCache(1, 4, block_size=64)
    a = cache.add_sequence()
    x = randn(rng, (1, 1, 2, 4))
    with pytest.raises(ValueError, match="unknown sequence 5"):
        cache.free(5)
    cache.free(a)
    with pytest.raises(ValueError, match="sequence 0 was freed"):
        cache.free(a)
    with pytest.raises(ValueError, match="sequence 0 was freed"):
        cache.append(a, x, x)
    with pytest.raises(ValueError, match="sequence 0 was freed"):
        cache.attend([a], x)
    with pytest.raises(ValueError, match="sequence 0 was freed"):
        cache.fork(a)
    with pytest.raises(TypeError, match="seq_id must be an int"):
        cache.free("0")
    with pytest.raises(TypeError, match="seq_ids must be an int or a 1-D sequence of ints"):
        cache.attend([[0]], x)
    b = cache.add_sequence()
    assert b == 1  # ids are not reused
    with pytest.raises(ValueError, match="must not repeat"):
        cache.append([b, b], np.concatenate([x, x]), np.concatenate([x, x]))


def test_mismatched_shapes_and_dtypes(rng):
    H, d = 2, 8
    cache = af.PagedKVCache(H, d, v_head_dim=6, block_size=64)
    ids = [cache.add_sequence() for _ in range(2)]
    k, v = randn(rng, (2, H, 3, d)), randn(rng, (2, H, 3, 6))
    with pytest.raises(ValueError, match=r"k has shape \(1, 2, 3, 8\), expected"):
        cache.append(ids, k[:1], v)
    with pytest.raises(ValueError, match=r"v has shape \(2, 2, 3, 8\)"):
        cache.append(ids, k, randn(rng, (2, H, 3, d)))
    with pytest.raises(ValueError, match="lengths differ"):
        cache.append(ids, k, v[:, :, :2])
    with pytest.raises(TypeError, match="has dtype float64 but the cache stores float32"):
        cache.append(ids, k.astype(np.float64), v)
    with pytest.raises(ValueError, match="lengths must be <= 3"):
        cache.append(ids, k, v, lengths=[4, 1])
    cache.append(ids, k, v)
    with pytest.raises(ValueError, match="batch 1 but seq_ids names 2 sequences"):
        cache.attend(ids, randn(rng, (1, 4, 1, d)))
    with pytest.raises(ValueError, match="head dim 5 but the cache stores keys of dim 8"):
        cache.attend(ids, randn(rng, (2, 4, 1, 5)))
    with pytest.raises(ValueError, match="3 heads is not a multiple of the cache's 2 kv heads"):
        cache.attend(ids, randn(rng, (2, 3, 1, d)))
    with pytest.raises(TypeError, match="q has dtype float16"):
        cache.attend(ids, randn(rng, (2, 4, 1, d), np.float16))
    with pytest.raises(ValueError, match="exceed the stored lengths"):
        cache.attend(ids, randn(rng, (2, 4, 4, d)))
    with pytest.raises(ValueError, match="out has shape"):
        cache.attend(ids, randn(rng, (2, 4, 1, d)), out=np.empty((2, 4, 1, d), F32))
    with pytest.raises(ValueError, match="scale"):
        cache.attend(ids, randn(rng, (2, 4, 1, d)), scale=float("nan"))


def test_kernel_binding_refuses_what_it_would_read_out_of_bounds(rng):
    """_core.decode with a block table checks the table, the lengths and the chunks' shapes
    itself."""
    H, d, bs = 1, 4, 64
    kc = [np.zeros((2, H, bs, d), F32), np.zeros((2, H, bs, d), F32)]
    q, o = randn(rng, (1, 1, 1, d)), np.empty((1, 1, 1, d), F32)
    run = lambda table, n, k=kc, v=kc: _core.decode(  # noqa: E731
        q,
        k,
        v,
        o,
        block_table=np.asarray(table, np.int64),
        kv_lens=np.asarray([n], np.int64),
        scale=1.0,
    )
    run([[3, 0]], 65)  # in bounds: the four blocks of two chunks
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 4 is not a block"):
        run([[3, 4]], 65)
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = -1"):
        run([[-1, 0]], 1)
    with pytest.raises(ValueError, match="kv_lens.*outside"):
        run([[0, 1]], 129)
    with pytest.raises(ValueError, match="share one set of strides"):
        run([[0]], 1, k=[kc[0], np.asfortranarray(kc[1])])
    with pytest.raises(ValueError, match="chunk 1 has shape"):
        run([[0]], 1, k=[kc[0], np.zeros((3, H, bs, d), F32)])
    with pytest.raises(TypeError, match="dtype"):
        run([[0]], 1, v=[x.astype(np.float64) for x in kc])
    with pytest.raises(ValueError, match="block_table must be"):
        run([0, 1], 1)


def _random_append(cache, model, rng, H, d):
    """The random-ops tests' append: up to 3 sequences, ragged lengths, mirrored in `model`
    (id -> (K, V) of every position appended)."""
    ids = [int(i) for i in rng.choice(list(model), size=min(3, len(model)), replace=False)]
    L = int(rng.choice([1, 2, 63, 64, 65, 130]))
    lens = rng.integers(0, L + 1, size=len(ids))
    k, v = randn(rng, (len(ids), H, L, d)), randn(rng, (len(ids), H, L, d))
    cache.append(ids, k, v, lengths=lens)
    for j, i in enumerate(ids):
        K, V = model[i]
        model[i] = (
            np.concatenate([K, k[j, :, : lens[j]]], 1),
            np.concatenate([V, v[j, :, : lens[j]]], 1),
        )


def _add_fork_or_free(op, cache, model, rng, empty):
    """The random-ops tests' shared steps: op 0 adds a sequence, 1 forks one, 2 frees one
    (while two or more are held), each on the cache and its model; False for any other op."""
    if op == 0:
        model[cache.add_sequence()] = (empty, empty)
    elif op == 1:
        src = int(rng.choice(list(model)))
        model[cache.fork(src)] = model[src]
    elif op == 2 and len(model) > 1:
        i = int(rng.choice(list(model)))
        cache.free(i)
        del model[i]
    else:
        return False
    return True


def test_random_add_append_fork_free_keep_every_sequence_intact(isa, rng):
    """Random operations against a model (each sequence's token list): stored keys and values,
    block accounting (every block free or held, reference counts = holders) and attention."""
    H, d = 1, 3
    cache = af.PagedKVCache(H, d, num_blocks=4, block_size=64)
    model = {}  # seq_id -> (keys (H, n, d), values (H, n, d))
    empty = np.zeros((H, 0, d), F32)
    for _ in range(150):
        op = rng.integers(4) if model else 0
        if not _add_fork_or_free(op, cache, model, rng, empty):
            _random_append(cache, model, rng, H, d)
        held = {}
        for i, (K, V) in model.items():
            np.testing.assert_array_equal(cache.keys(i), K)
            np.testing.assert_array_equal(cache.values(i), V)
            for g in cache.block_table(i)[0, : -(-K.shape[1] // 64)]:
                held[int(g)] = held.get(int(g), 0) + 1
        assert cache.free_blocks + len(held) == cache.num_blocks
        assert all(cache._ref[g] == n for g, n in held.items())
    ids = list(model)
    ql = [min(1, model[i][0].shape[1]) for i in ids]  # a sequence with no keys: no query row
    q = randn(rng, (len(ids), 2, 1, d))
    o, lse = cache.attend(ids, q, q_lens=ql, out=poisoned((len(ids), 2, 1, d), F32),
                          return_lse=True)  # fmt: skip
    check_oracle(cache, ids, q, o, lse, ql)


# ---------------------------------------------------------------- int8 pages


@pytest.mark.parametrize("Hq, Hkv, d, dv, first, chunks", CONFIGS)
def test_int8_attend_matches_oracle_on_dequantised(isa, rng, Hq, Hkv, d, dv, first, chunks):
    """int8 pages: the kernel against the float64 oracle on the dequantised K/V (``keys`` /
    ``values``), ragged lengths, decode steps and chunks, poisoned outputs."""
    cache = af.PagedKVCache(Hkv, d, v_head_dim=dv, num_blocks=3, dtype="int8", block_size=64)
    assert cache.io_dtype == F32
    ids = [cache.add_sequence() for _ in first]
    B, L = len(ids), max(first)
    cache.append(ids, randn(rng, (B, Hkv, L, d)), randn(rng, (B, Hkv, L, dv)), lengths=first)
    q = randn(rng, (B, Hq, L, d))
    o, lse = cache.attend(ids, q, out=poisoned((B, Hq, L, dv), F32), return_lse=True)
    check_oracle(cache, ids, q, o, lse, first)
    for c in chunks:
        cache.append(ids, randn(rng, (B, Hkv, c, d)), randn(rng, (B, Hkv, c, dv)))
        q = randn(rng, (B, Hq, c, d))
        o, lse = cache.attend(ids, q, out=poisoned((B, Hq, c, dv), F32), return_lse=True)
        check_oracle(cache, ids, q, o, lse, [c] * B)


def test_int8_bit_identical_to_contiguous_int8_cache(isa, rng):
    """The same tokens in KVCache(dtype="int8") and int8 pages: the same codes and scales
    (a key group never crosses a block), so the same decode bits."""
    B, H, Hq, d = 3, 2, 8, 32
    lens = [1, 100, 300]
    ref = af.KVCache(B, H, d, dtype="int8")
    cache = af.PagedKVCache(H, d, dtype="int8", num_blocks=2, block_size=64)
    ids = [cache.add_sequence() for _ in range(B)]
    k, v = randn(rng, (B, H, 300, d)), randn(rng, (B, H, 300, d))
    ref.append(k, v, lengths=lens)
    cache.append(ids, k, v, lengths=lens)
    for c in [1, 1, DECODE_MAX_LQ, 1, 70, 1]:
        k, v, q = (randn(rng, (B, h, c, d)) for h in (H, H, Hq))
        ref.append(k, v)
        cache.append(ids, k, v)
        for b, i in enumerate(ids):
            np.testing.assert_array_equal(cache.keys(i), ref.keys(b))
            np.testing.assert_array_equal(cache.values(i), ref.values(b))
        if c <= DECODE_MAX_LQ:
            o1, lse1 = ref.attend(q, return_lse=True)
            o2, lse2 = cache.attend(ids, q, return_lse=True)
            np.testing.assert_array_equal(o2, o1)
            np.testing.assert_array_equal(lse2, lse1)


def test_int8_fork_copy_on_write_and_free(isa, rng):
    H, d = 2, 8
    cache = af.PagedKVCache(H, d, dtype="int8", num_blocks=4, block_size=64)
    p = cache.add_sequence()
    k0, v0 = randn(rng, (1, H, 100, d)), randn(rng, (1, H, 100, d))
    cache.append(p, k0, v0)
    keys_p, vals_p = cache.keys(p), cache.values(p)
    c = cache.fork(p)
    kc, vc = randn(rng, (1, H, 5, d)) * 10, randn(rng, (1, H, 5, d))  # widens the key ranges
    cache.append(c, kc, vc)
    np.testing.assert_array_equal(cache.keys(p), keys_p)  # the parent's codes and scales intact
    np.testing.assert_array_equal(cache.values(p), vals_p)
    ref = af.KVCache(1, H, d, dtype="int8")  # the child equals a cache of its own tokens
    ref.append(np.concatenate([k0, kc], axis=2), np.concatenate([v0, vc], axis=2))
    np.testing.assert_array_equal(cache.keys(c), ref.keys(0))
    q = randn(rng, (2, 4, 1, d))
    o, lse = cache.attend([p, c], q, q_lens=1, return_lse=True)
    check_oracle(cache, [p, c], q, o, lse, [1, 1])
    cache.free(p)
    n = cache.add_sequence()
    cache.append(n, k0[:, :, :70], v0[:, :, :70])  # reuses p's unshared block
    np.testing.assert_array_equal(cache.keys(c), ref.keys(0))
    o, lse = cache.attend([n, c], q, q_lens=1, return_lse=True)
    check_oracle(cache, [n, c], q, o, lse, [1, 1])


def test_int8_errors_and_bytes(rng):
    H, d = 2, 128
    cache = af.PagedKVCache(H, d, dtype=np.int8, num_blocks=4, block_size=64)
    i = cache.add_sequence()
    with pytest.raises(TypeError, match="an int8 cache takes float32 k, v and q"):
        cache.append(i, randn(rng, (1, H, 2, d), np.float16), randn(rng, (1, H, 2, d)))
    k = randn(rng, (1, H, 2, d))
    k[0, 0, 1, 3] = np.nan
    with pytest.raises(ValueError, match="inf or NaN"):
        cache.append(i, k, randn(rng, (1, H, 2, d)))
    per_block = H * (64 * (2 * d + 8) + 8 * d)  # codes, value scales / offsets, key groups
    assert cache.nbytes == 4 * per_block + H * 64 * d * 4  # + one sequence's staging tail
    assert cache.used_nbytes == 0


# ---------------------------------------------------------------- sliding windows


def window_oracle(q, K, V, q_len, pos, window, causal=True):
    """float64 attention of q (Hq, Lq, d)'s first q_len rows, at positions pos - q_len ..,
    over K, V (H_kv, n, d) at positions pos - n .., each query seeing its own position and
    the window - 1 before it (and nothing later when causal)."""
    n = K.shape[1]
    qp = pos - q_len + np.arange(q_len)
    kp = pos - n + np.arange(n)
    rel = qp[:, None] - kp[None, :]
    mask = rel <= window - 1
    if causal:
        mask &= rel >= 0
    q, K, V = (np.asarray(x, np.float64) for x in (q[:, :q_len], K, V))
    return sdpa(q, K, V, mask=mask, return_lse=True)


def check_window(cache, ids, q, o, lse, q_lens, name="float32", causal=True):
    for b, i in enumerate(ids):
        ql = int(q_lens[b])
        O, LSE = window_oracle(
            q[b], cache.keys(i), cache.values(i), ql, cache.positions[i], cache.window, causal
        )
        np.testing.assert_allclose(np.asarray(o[b, :, :ql], np.float64), O, **tolerance(name))
        np.testing.assert_allclose(lse[b, :, :ql], LSE, **tol(F32), err_msg=f"lse of {i}")


WINDOWS = [  # window, block size, first lengths, chunk lengths
    (1, 64, [1, 64, 70], [1] * 3 + [3]),
    (5, 64, [7, 129], [1] * 70),
    (64, 64, [63, 65, 200], [1] * 5 + [4, 1]),
    (100, 64, [1, 130, 300], [1] * 40 + [3, 1]),
    (200, 128, [129, 257], [1] * 10 + [2, 1]),
]


@pytest.mark.parametrize("window, bs, first, chunks", WINDOWS)
def test_window_matches_oracle_and_releases_blocks(isa, rng, window, bs, first, chunks):
    """Windows smaller and larger than a block, lengths not multiples of 64: against the
    float64 oracle with the window over the full history; the keys still stored are the last
    ones; a sequence holds at most ceil((window - 1 + c) / bs) + 1 blocks after a c-token
    append, and the released blocks go back to the pool."""
    Hq, H, d = 4, 2, 16
    cache = af.PagedKVCache(H, d, block_size=bs, num_blocks=4, window=window)
    ids = [cache.add_sequence() for _ in first]
    B, L = len(ids), max(first)
    hist_k = [np.zeros((H, 0, d), F32) for _ in ids]
    hist_v = [np.zeros((H, 0, d), F32) for _ in ids]

    def step(c, lens):
        k, v, q = randn(rng, (B, H, c, d)), randn(rng, (B, H, c, d)), randn(rng, (B, Hq, c, d))
        cache.append(ids, k, v, lengths=lens)
        for b, n in enumerate(lens):
            hist_k[b] = np.concatenate([hist_k[b], k[b, :, :n]], axis=1)
            hist_v[b] = np.concatenate([hist_v[b], v[b, :, :n]], axis=1)
        o, lse = cache.attend(ids, q, out=poisoned((B, Hq, c, d), F32), return_lse=True)
        check_window(cache, ids, q, o, lse, lens)
        for b, i in enumerate(ids):  # the stored keys: the last ones of the full history
            pos, n = cache.positions[i], cache.lengths[i]
            assert pos == hist_k[b].shape[1] and n <= pos
            np.testing.assert_array_equal(cache.keys(i), hist_k[b][:, pos - n :])
            np.testing.assert_array_equal(cache.values(i), hist_v[b][:, pos - n :])
            assert n >= min(pos, window - 1 + lens[b])  # the window of every new query
            assert cache.block_table(i).shape[1] <= -(-(window - 1 + max(lens[b], 1)) // bs) + 1
            O, _ = window_oracle(
                q[b], hist_k[b], hist_v[b], lens[b], pos, window
            )  # over the whole history: the released keys were outside every window
            np.testing.assert_allclose(o[b, :, : lens[b]], O, **tol(F32))

    step(L, first)
    for c in chunks:
        step(c, [c] * B)
    held = sum(cache.block_table(i).shape[1] for i in ids)
    assert cache.num_blocks - cache.free_blocks == held  # nothing leaked
    for i in ids:
        cache.free(i)
    assert cache.free_blocks == cache.num_blocks


def test_window_memory_stays_bounded_in_a_fixed_pool(isa, rng):
    """A long generation with a window in a pool too small for the whole history."""
    H, d, w = 2, 8, 70
    cache = af.PagedKVCache(H, d, num_blocks=2 * 3, growable=False, window=w, block_size=64)
    ids = [cache.add_sequence() for _ in range(2)]
    for _ in range(400):  # 400 tokens: 7 blocks each without the window, 12 for both
        cache.append(ids, randn(rng, (2, H, 1, d)), randn(rng, (2, H, 1, d)))
        assert all(cache.block_table(i).shape[1] <= -(-w // 64) + 1 for i in ids)
    q = randn(rng, (2, 4, 1, d))
    o, lse = cache.attend(ids, q, return_lse=True)
    check_window(cache, ids, q, o, lse, [1, 1])
    assert cache.positions == {ids[0]: 400, ids[1]: 400}
    assert all(w - 1 < n < w + 64 for n in cache.lengths.values())


@pytest.mark.parametrize("name", [*DTYPES, "int8"])
def test_window_every_storage_type(isa, rng, name):
    """Every storage type: the window against the oracle on the stored (int8: dequantised)
    K/V, and the same keys and results as the contiguous KVCache(window=...) for the float
    types (int8: its codes are per block, the contiguous ring's per ring slot group)."""
    H, Hq, d, w = 2, 4, 16, 90
    dt = "int8" if name == "int8" else DTYPES[name]
    io = F32 if name == "int8" else DTYPES[name]
    cache = af.PagedKVCache(H, d, dtype=dt, num_blocks=2, window=w, block_size=64)
    ids = [cache.add_sequence() for _ in range(2)]
    ref = af.KVCache(2, H, d, dtype=dt, window=w, ring=256)
    for c, lens in [(150, [150, 33]), *[(1, [1, 1])] * 80, (3, [3, 3])]:
        k, v, q = randn(rng, (2, H, c, d), io), randn(rng, (2, H, c, d), io), None
        q = randn(rng, (2, Hq, c, d), io)
        cache.append(ids, k, v, lengths=lens)
        ref.append(k, v, lengths=lens)
        o, lse = cache.attend(ids, q, return_lse=True)
        check_window(cache, ids, q, o, lse, lens, "float32" if name == "int8" else name)
        if name != "int8":
            o_ref = ref.attend(q)
            for b, i in enumerate(ids):
                n = cache.lengths[i]
                np.testing.assert_array_equal(
                    np.asarray(cache.keys(i)), np.asarray(ref.keys(b))[:, -n:]
                )
                np.testing.assert_allclose(
                    np.asarray(o[b, :, : lens[b]], np.float64),
                    np.asarray(o_ref[b, :, : lens[b]], np.float64),
                    **tolerance(name),
                )


def test_window_after_fork(isa, rng):
    """fork then window: both sequences release the shared blocks as they pass them (a
    block returns to the pool only when neither holds it); each matches the oracle."""
    H, d, w = 2, 8, 40
    cache = af.PagedKVCache(H, d, num_blocks=8, window=w, block_size=64)
    a = cache.add_sequence()
    ka, va = randn(rng, (1, H, 150, d)), randn(rng, (1, H, 150, d))
    cache.append(a, ka, va)
    c = cache.fork(a)
    assert cache.block_table(c).tolist() == cache.block_table(a).tolist()
    used = cache.num_blocks - cache.free_blocks
    hist = {a: [ka[0], va[0]], c: [ka[0], va[0]]}
    for t in range(80):
        step = [a] if t < 50 else [a, c]  # c lags behind, holding the shared blocks longer
        k, v = randn(rng, (len(step), H, 1, d)), randn(rng, (len(step), H, 1, d))
        cache.append(step, k, v)
        for j, i in enumerate(step):
            hist[i] = [np.concatenate([hist[i][0], k[j]], 1), np.concatenate([hist[i][1], v[j]], 1)]
        q = randn(rng, (len(step), 4, 1, d))
        o, lse = cache.attend(step, q, return_lse=True)
        check_window(cache, step, q, o, lse, [1] * len(step))
    for i in (a, c):
        n = cache.lengths[i]
        np.testing.assert_array_equal(cache.keys(i), hist[i][0][:, -n:])
    assert cache.lengths[c] <= w - 1 + 64
    shared = set(cache.block_table(a)[0]) & set(cache.block_table(c)[0])
    assert cache.num_blocks - cache.free_blocks == (
        cache.block_table(a).shape[1] + cache.block_table(c).shape[1] - len(shared)
    )
    assert cache.num_blocks - cache.free_blocks <= used + 2
    cache.free(a)
    cache.free(c)
    assert cache.free_blocks == cache.num_blocks


def test_window_attend_reaching_back_to_released_blocks_raises(isa, rng):
    H, d = 1, 4
    cache = af.PagedKVCache(H, d, window=8, block_size=64)
    i = cache.add_sequence()
    cache.append(i, randn(rng, (1, H, 100, d)), randn(rng, (1, H, 100, d)))
    cache.append(i, randn(rng, (1, H, 1, d)), randn(rng, (1, H, 1, d)))  # releases block 0
    assert cache.lengths[i] == 101 - 64 and cache.positions[i] == 101
    cache.attend(i, randn(rng, (1, H, 30, d)), q_lens=30)  # from position 71: keys 64 on
    with pytest.raises(ValueError, match="reach back to positions"):
        cache.attend(i, randn(rng, (1, H, 36, d)), q_lens=36)  # needs keys 58 on


@pytest.mark.parametrize("bad, err", [(0, ValueError), (-3, ValueError), (2.5, TypeError)])
def test_bad_window(bad, err):
    with pytest.raises(err, match="window"):
        af.PagedKVCache(1, 4, window=bad)


# ---------------------------------------------------------------- truncate and positions


@pytest.mark.parametrize("name", [*DTYPES, "int8"])
def test_truncate_across_a_shared_block(isa, rng, name):
    """truncate inside a block a fork shares: the block loses only this sequence's
    reference; the next append copies it (copy-on-write), the fork is unchanged; the blocks
    past the kept tokens return to the pool; attend matches the oracle afterwards."""
    H, d = 2, 16
    dt = "int8" if name == "int8" else DTYPES[name]
    io = F32 if name == "int8" else DTYPES[name]
    cache = af.PagedKVCache(H, d, dtype=dt, num_blocks=8, block_size=64)
    a = cache.add_sequence()
    k0, v0 = randn(rng, (1, H, 150, d), io), randn(rng, (1, H, 150, d), io)
    cache.append(a, k0, v0)
    keys_a, vals_a = np.asarray(cache.keys(a)), np.asarray(cache.values(a))
    c = cache.fork(a)
    assert cache.num_blocks - cache.free_blocks == 3
    cache.truncate(c, 70)  # c keeps blocks 0 (full) and 1 (6 rows), both shared with a
    assert cache.lengths[c] == cache.positions[c] == 70
    assert cache.block_table(c).tolist() == [cache.block_table(a)[0, :2].tolist()]
    assert cache.num_blocks - cache.free_blocks == 3  # block 2 still held by a
    k1, v1 = randn(rng, (1, H, 10, d), io), randn(rng, (1, H, 10, d), io)
    cache.append(c, k1, v1)
    assert cache.num_blocks - cache.free_blocks == 4  # c's copy of block 1
    assert cache.block_table(c)[0, 0] == cache.block_table(a)[0, 0]
    assert cache.block_table(c)[0, 1] != cache.block_table(a)[0, 1]
    np.testing.assert_array_equal(np.asarray(cache.keys(a)), keys_a)  # a unchanged
    np.testing.assert_array_equal(np.asarray(cache.values(a)), vals_a)
    kc = np.asarray(cache.keys(c))
    if name == "int8":  # the reopened group is requantised: within a code step of before
        step = (np.abs(k0).max() + np.abs(k1).max()) * 2 / 255
        np.testing.assert_allclose(kc[:, :70], keys_a[:, :70], atol=step)
    else:
        np.testing.assert_array_equal(kc[:, :70], keys_a[:, :70])
        np.testing.assert_array_equal(kc[:, 70:], np.asarray(k1[0]))
    q = randn(rng, (2, 4, 3, d), io)
    o, lse = cache.attend([a, c], q, q_lens=3, return_lse=True)
    check_oracle(cache, [a, c], q, o, lse, [3, 3], "float32" if name == "int8" else name)
    cache.truncate(a, 0)  # a releases its blocks; block 0 stays with c
    assert cache.lengths[a] == 0 and cache.num_blocks - cache.free_blocks == 2
    cache.free(c)
    assert cache.free_blocks == cache.num_blocks
    cache.append(a, k0[:, :, :5], v0[:, :, :5])
    np.testing.assert_allclose(
        np.asarray(cache.keys(a), np.float64),
        np.asarray(k0[0, :, :5], np.float64),
        atol=0 if name != "int8" else 0.05,
    )


def test_truncate_equals_a_fresh_cache_and_matches_kvcache(isa, rng):
    """truncate then append gives what a cache that never held the dropped tokens gives,
    bit for bit (float32), and KVCache.truncate's result."""
    H, d = 2, 8
    cache = af.PagedKVCache(H, d, num_blocks=4, block_size=64)
    fresh = af.PagedKVCache(H, d, num_blocks=4, block_size=64)
    ref = af.KVCache(2, H, d)
    ids, fids = [cache.add_sequence() for _ in range(2)], [fresh.add_sequence() for _ in range(2)]
    k, v = randn(rng, (2, H, 200, d)), randn(rng, (2, H, 200, d))
    cache.append(ids, k, v, lengths=[200, 130])
    ref.append(k, v, lengths=[200, 130])
    cache.truncate(ids[0], 128)
    cache.truncate(ids[1], 129)
    ref.truncate([128, 129])
    fresh.append(fids, k, v, lengths=[128, 129])
    assert cache.positions == {ids[0]: 128, ids[1]: 129}
    k1, v1, q = randn(rng, (2, H, 1, d)), randn(rng, (2, H, 1, d)), randn(rng, (2, 4, 1, d))
    for c in (cache, fresh):
        c.append(ids if c is cache else fids, k1, v1)
    ref.append(k1, v1)
    o = cache.attend(ids, q)
    np.testing.assert_array_equal(o, fresh.attend(fids, q))
    np.testing.assert_array_equal(o, ref.attend(q))
    assert cache.num_blocks - cache.free_blocks == 3 + 3  # 4 + 3 blocks; truncate freed one


def test_truncate_with_a_window(isa, rng):
    H, d, w = 1, 4, 10
    cache = af.PagedKVCache(H, d, window=w, block_size=64)
    i = cache.add_sequence()
    cache.append(i, randn(rng, (1, H, 130, d)), randn(rng, (1, H, 130, d)))
    cache.append(i, randn(rng, (1, H, 1, d)), randn(rng, (1, H, 1, d)))  # keys 64 .. 130 stored
    cache.truncate(i, 100)  # needs keys 91 on: still stored
    assert cache.positions[i] == 100 and cache.lengths[i] == 36
    with pytest.raises(ValueError, match="were released"):
        cache.truncate(i, 70)  # needs keys 61 on
    assert cache.positions[i] == 100  # unchanged
    cache.append(i, randn(rng, (1, H, 1, d)), randn(rng, (1, H, 1, d)))
    q = randn(rng, (1, 2, 1, d))
    o, lse = cache.attend(i, q, return_lse=True)
    check_window(cache, [i], q, o, lse, [1])


def test_truncate_errors(rng):
    cache = af.PagedKVCache(1, 4, block_size=64)
    i = cache.add_sequence()
    cache.append(i, randn(rng, (1, 1, 5, 4)), randn(rng, (1, 1, 5, 4)))
    with pytest.raises(ValueError, match="to 6 tokens: it holds 5"):
        cache.truncate(i, 6)
    with pytest.raises(ValueError, match="n must be"):
        cache.truncate(i, -1)
    with pytest.raises(TypeError, match="n must be an integer"):
        cache.truncate(i, 2.0)
    with pytest.raises(ValueError, match="unknown sequence 7"):
        cache.truncate(7, 1)
    cache.free(i)
    with pytest.raises(ValueError, match="sequence 0 was freed"):
        cache.truncate(i, 1)


@pytest.mark.parametrize("name", [*DTYPES, "int8"])
def test_rope_on_append_every_storage_type(rng, name):
    """RoPE on append for every storage type, at the absolute positions (``positions``),
    window or not: the keys equal the rotated keys (16-bit: rotated in float32, rounded
    once; int8: within the quantisation step)."""
    H, d, w = 2, 16, 50
    rope = RoPE(d)
    dt = "int8" if name == "int8" else DTYPES[name]
    io = F32 if name == "int8" else DTYPES[name]
    cache = af.PagedKVCache(H, d, dtype=dt, window=w, block_size=64)
    i = cache.add_sequence()
    allk = []
    for L in (70, 1, 3, 60, 1):
        k = randn(rng, (1, H, L, d), io)
        cache.append(i, k, randn(rng, (1, H, L, d), io), rope=rope)
        allk.append(k[0])
    pos = cache.positions[i]
    assert pos == 135
    rot = rope(np.concatenate(allk, 1).astype(F32), positions=np.arange(pos), seq_axis=-2)
    n = cache.lengths[i]
    assert n < pos  # the window released block 0
    got = np.asarray(cache.keys(i), np.float64)
    want = np.asarray(rot[:, -n:], np.float64)
    atol = {"float16": 2e-3, "bfloat16": 2e-2, "int8": 0.05}.get(name, 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-2 if atol > 1e-5 else 1e-5, atol=atol)


# ---------------------------------------------------------------- many layers


def test_paged_layer_caches_share_one_id_space(isa, rng):
    H, d, layers = 2, 8, 3
    caches = af.PagedLayerCaches(layers, H, d, num_blocks=4, window=[None, 70, None], block_size=64)
    assert len(caches) == layers and caches[1].window == 70 and caches[-1].window is None
    a, b = caches.add_sequence(), caches.add_sequence()
    assert caches.seq_ids == [a, b] and all(c.seq_ids == [a, b] for c in caches)
    for c in caches:
        c.append([a, b], randn(rng, (2, H, 150, d)), randn(rng, (2, H, 150, d)), lengths=[150, 9])
    f = caches.fork(a)
    assert all(c.lengths[f] == c.lengths[a] for c in caches) and f in caches
    caches.truncate(f, 100)
    assert caches.positions[f] == 100 and all(c.positions[f] == 100 for c in caches)
    caches.free(b)
    assert b not in caches and all(b not in c for c in caches)
    assert caches.nbytes == sum(c.nbytes for c in caches)
    assert caches.used_nbytes == sum(c.used_nbytes for c in caches)
    for c in caches:
        c.append([a, f], randn(rng, (2, H, 1, d)), randn(rng, (2, H, 1, d)))
        q = randn(rng, (2, 4, 1, d))
        o, lse = c.attend([a, f], q, return_lse=True)
        if c.window is None:
            check_oracle(c, [a, f], q, o, lse, [1, 1])
        else:
            check_window(c, [a, f], q, o, lse, [1, 1])
    assert "PagedLayerCaches(3 layers" in repr(caches)


def test_paged_layer_caches_errors(rng):
    caches = af.PagedLayerCaches(2, 1, 4, window=[None, 8], block_size=64)
    with pytest.raises(IndexError, match="layer index 2 out of range for 2 layers"):
        caches[2]
    with pytest.raises(IndexError, match="layer index -3 out of range"):
        caches[-3]
    with pytest.raises(TypeError, match="layer index must be an int"):
        caches["0"]
    with pytest.raises(ValueError, match="window has 3 entries but there are 2 layers"):
        af.PagedLayerCaches(2, 1, 4, window=[None, 8, 8])
    with pytest.raises(ValueError, match="num_layers"):
        af.PagedLayerCaches(0, 1, 4)
    with pytest.raises(ValueError, match="window"):
        af.PagedLayerCaches(2, 1, 4, window=[0, 8])
    i = caches.add_sequence()
    for c in caches:
        c.append(i, randn(rng, (1, 1, 130, 4)), randn(rng, (1, 1, 130, 4)))
        c.append(i, randn(rng, (1, 1, 1, 4)), randn(rng, (1, 1, 1, 4)))
    # layer 1's window released block 0: truncating to 30 fails there, so no layer changes
    with pytest.raises(ValueError, match="were released"):
        caches.truncate(i, 30)
    assert [c.positions[i] for c in caches] == [131, 131]
    for bad in (5, "x"):
        with pytest.raises((ValueError, TypeError)):
            caches.fork(bad)
        with pytest.raises((ValueError, TypeError)):
            caches.free(bad)
    caches.free(i)
    with pytest.raises(ValueError, match="was freed"):
        caches.truncate(i, 1)
    caches[0].add_sequence()  # changed behind the group's back
    with pytest.raises(RuntimeError, match="different ids"):
        caches.add_sequence()
    with pytest.raises(TypeError, match="stores"):
        af.PagedLayerCaches(2, 1, 4, dtype="complex64", block_size=64)
    f16 = af.PagedLayerCaches(2, 1, 4, dtype="float16", block_size=64)
    j = f16.add_sequence()
    with pytest.raises(TypeError, match="float16"):  # a float32 chunk for a float16 layer
        f16[1].append(j, randn(rng, (1, 1, 2, 4)), randn(rng, (1, 1, 2, 4)))
    assert f16[1].lengths[j] == 0


@pytest.mark.parametrize("window", [None, 30, 100])
def test_random_ops_with_truncate_and_windows(isa, rng, window):
    """Random add / append / fork / free / truncate against a model (each sequence's full
    history): the stored keys are its last ``lengths`` tokens, every block is free or held
    with reference count = holders, truncate fails exactly when the window's keys before n
    were released (and then changes nothing); attention against the oracle at the end."""
    H, d, bs = 1, 3, 64
    cache = af.PagedKVCache(H, d, num_blocks=4, window=window, block_size=64)
    model = {}  # seq_id -> full history (keys (H, pos, d), values (H, pos, d))
    empty = np.zeros((H, 0, d), F32)
    for _ in range(150):
        op = rng.integers(5) if model else 0
        if _add_fork_or_free(op, cache, model, rng, empty):
            pass
        elif op == 3:
            i = int(rng.choice(list(model)))
            pos = model[i][0].shape[1]
            n = int(rng.integers(0, pos + 1))
            gone = pos - cache.lengths[i]  # positions released by the window
            if window is not None and gone > max(0, n - (window - 1)):
                with pytest.raises(ValueError, match="were released"):
                    cache.truncate(i, n)
            else:
                cache.truncate(i, n)
                model[i] = (model[i][0][:, :n], model[i][1][:, :n])
        else:
            _random_append(cache, model, rng, H, d)
        held = {}
        for i, (K, V) in model.items():
            pos, n = K.shape[1], cache.lengths[i]
            assert cache.positions[i] == pos and (n == pos or window is not None)
            np.testing.assert_array_equal(cache.keys(i), K[:, pos - n :])
            np.testing.assert_array_equal(cache.values(i), V[:, pos - n :])
            for g in cache.block_table(i)[0, : -(-n // bs)]:
                held[int(g)] = held.get(int(g), 0) + 1
        assert cache.free_blocks + len(held) == cache.num_blocks
        assert all(cache._ref[g] == c for g, c in held.items())
    ids = list(model)
    cache.append(ids, randn(rng, (len(ids), H, 1, d)), randn(rng, (len(ids), H, 1, d)))
    q = randn(rng, (len(ids), 2, 1, d))
    o, lse = cache.attend(ids, q, out=poisoned((len(ids), 2, 1, d), F32), return_lse=True)
    if window is None:
        check_oracle(cache, ids, q, o, lse, [1] * len(ids))
    else:
        check_window(cache, ids, q, o, lse, [1] * len(ids))


def test_window_non_causal_and_non_contiguous(isa, rng):
    """causal=False with a window: the window still bounds the left side; transposed views
    of k, v and q."""
    H, Hq, d, w = 2, 4, 16, 20
    cache = af.PagedKVCache(H, d, window=w, block_size=64)
    ids = [cache.add_sequence() for _ in range(2)]
    k = randn(rng, (2, 100, H, d)).transpose(0, 2, 1, 3)
    v = randn(rng, (2, d, H, 100)).transpose(0, 2, 3, 1)
    cache.append(ids, k, v, lengths=[100, 70])
    cache.append(ids, k[:, :, :5], v[:, :, :5])  # releases block 0 of the longer one
    assert cache.lengths == {ids[0]: 105 - 64, ids[1]: 75}
    q = randn(rng, (2, 5, Hq, d)).transpose(0, 2, 1, 3)
    for causal in (True, False):
        o, lse = cache.attend(ids, q, causal=causal, return_lse=True)
        check_window(cache, ids, q, o, lse, [5, 5], causal=causal)
