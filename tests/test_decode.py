"""The split-KV decode kernel against the float64 oracle: shapes, GQA, masks, rings, splits."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from helpers import assert_attention, assert_close, poisoned, randn

import attn_fast as af
from attn_fast import _core
from attn_fast import reference as ref


def decode(q, k, v, lse=True, **kw):
    """Call _core.decode on poisoned o/lse buffers."""
    B, Hq, Lq, _ = q.shape
    o = poisoned((B, Hq, Lq, v.shape[-1]), q.dtype)
    l = poisoned((B, Hq, Lq), q.dtype) if lse else None
    kw.setdefault("scale", 1.0 / np.sqrt(q.shape[-1]))
    _core.decode(q, k, v, o, l, **kw)
    return o, l


def check(o, lse, O, LSE, dtype=np.float32):
    assert_attention(o, lse, O, LSE, dtype)


SHAPES = [
    # B, Hq, Hkv, Lq, Lk, d, dv
    (1, 1, 1, 1, 1, 1, 1),
    (1, 4, 1, 1, 1000, 128, 128),
    (2, 8, 2, 1, 777, 5, 7),
    (2, 6, 3, 3, 129, 80, 80),
    (1, 2, 2, 4, 1500, 64, 16),
    (3, 32, 8, 2, 300, 16, 16),
    (1, 3, 1, 7, 70, 3, 3),  # 21 rows: several row blocks
    (1, 2, 1, 20, 20, 8, 8),  # Lq == Lk
    (1, 8, 2, 1, 333, 40, 24),  # G = 4: 4-row kernels, dv = one 3-vector pass
    (1, 9, 3, 1, 203, 64, 64),  # G = 3: 3-row kernels, 4-key passes then a pair and a key
    (2, 3, 1, 1, 130, 37, 20),  # G = 3 with a d tail
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_against_oracle(isa, rng, shape, causal, dtype):
    B, Hq, Hkv, Lq, Lk, d, dv = shape
    q, k, v = (
        randn(rng, (B, Hq, Lq, d), dtype),
        randn(rng, (B, Hkv, Lk, d), dtype),
        randn(rng, (B, Hkv, Lk, dv), dtype),
    )
    o, lse = decode(q, k, v, causal=causal, split=256)
    O, LSE = ref.sdpa(q, k, v, mask=ref.causal_mask(Lq, Lk) if causal else None, return_lse=True)
    check(o, lse, O, LSE, dtype)
    # through the public API: backend="decode", and the automatic choice
    o2, lse2 = af.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=True, return_lse=True, backend="decode"
    )
    check(o2, lse2, O, LSE, dtype)
    o3 = af.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert_close(o3, O, dtype)


@pytest.mark.parametrize("window", [(0, 0), (5, 0), (40, 3), (-1, 2)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_windows_and_top_left(isa, rng, window, causal):
    B, Hq, Hkv, Lq, Lk, d = 2, 4, 2, 3, 200, 16
    q, k, v = randn(rng, (B, Hq, Lq, d)), randn(rng, (B, Hkv, Lk, d)), randn(rng, (B, Hkv, Lk, d))
    left, right = window
    for align in ("bottom_right", "top_left"):
        mask = ref.window_mask(
            Lq, Lk, None if left < 0 else left, None if right < 0 else right, align=align
        )
        if causal:
            mask = mask & ref.causal_mask(Lq, Lk, align=align)
        o, lse = decode(
            q,
            k,
            v,
            causal=causal,
            top_left=align == "top_left",
            window_left=left,
            window_right=right,
            split=64,
        )
        O, LSE = ref.sdpa(q, k, v, mask=mask, return_lse=True)
        check(o, lse, O, LSE)


def test_ragged_lengths_and_empty_rows(isa, rng):
    """Per-sequence kv_lens / q_lens; padding rows and sequences with no keys give 0 and -inf."""
    B, Hq, Hkv, Lq, Lk, d = 4, 4, 2, 3, 600, 8
    q, k, v = randn(rng, (B, Hq, Lq, d)), randn(rng, (B, Hkv, Lk, d)), randn(rng, (B, Hkv, Lk, d))
    kv_lens = np.array([600, 1, 0, 333])
    q_lens = np.array([3, 1, 2, 0])
    o, lse = decode(q, k, v, causal=True, kv_lens=kv_lens, q_lens=q_lens, split=100)
    for b in range(B):
        n, m = int(kv_lens[b]), int(q_lens[b])
        if n == 0:  # no keys at all
            assert (o[b] == 0).all() and np.isneginf(lse[b]).all()
            continue
        O, LSE = ref.sdpa(
            q[b, :, :m], k[b, :, :n], v[b, :, :n], mask=ref.causal_mask(m, n), return_lse=True
        )
        check(o[b, :, :m], lse[b, :, :m], O, LSE)
        assert (o[b, :, m:] == 0).all() and np.isneginf(lse[b, :, m:]).all()


def test_ring_addressing(isa, rng):
    """Logical key j of sequence b at slot (start[b] + j) mod R equals the unrolled arrays."""
    B, Hq, Hkv, Lq, R, d = 3, 4, 2, 2, 300, 16
    q, k, v = randn(rng, (B, Hq, Lq, d)), randn(rng, (B, Hkv, R, d)), randn(rng, (B, Hkv, R, d))
    start = np.array([0, 250, 299])
    kv_lens = np.array([300, 120, 77])
    o, lse = decode(q, k, v, causal=True, kv_start=start, kv_lens=kv_lens, window_left=50, split=32)
    for b in range(B):
        idx = (start[b] + np.arange(kv_lens[b])) % R
        kb, vb = k[b][:, idx], v[b][:, idx]
        mask = ref.window_mask(Lq, len(idx), 50, 0)
        O, LSE = ref.sdpa(q[b], kb, vb, mask=mask, return_lse=True)
        check(o[b], lse[b], O, LSE)


def test_non_contiguous_and_strided_head_dim(isa, rng):
    B, Hq, Hkv, Lq, Lk, d = 2, 4, 2, 1, 300, 24
    q = randn(rng, (B, Lq, Hq, d)).transpose(0, 2, 1, 3)
    k = randn(rng, (B, Lk, Hkv, 2 * d))[..., ::2].transpose(0, 2, 1, 3)  # d stride 2
    v = randn(rng, (B, Hkv, d, Lk)).transpose(0, 1, 3, 2)  # dv stride Lk
    o, lse = decode(q, k, v, causal=True)
    O, LSE = ref.sdpa(q, k, v, return_lse=True)
    check(o, lse, O, LSE)


def test_split_and_thread_invariance(rng):
    B, Hq, Hkv, Lq, Lk, d = 1, 8, 2, 1, 3000, 64
    q, k, v = randn(rng, (B, Hq, Lq, d)), randn(rng, (B, Hkv, Lk, d)), randn(rng, (B, Hkv, Lk, d))
    O, LSE = ref.sdpa(q, k, v, return_lse=True)
    outs = {}
    for split in (64, 100, 512, 5000):
        o, lse = decode(q, k, v, split=split)
        check(o, lse, O, LSE)
        outs[split] = o
    old = af.get_num_threads()
    try:
        af.set_num_threads(1)
        o1, _ = decode(q, k, v, split=100)
        af.set_num_threads(3)
        o3, _ = decode(q, k, v, split=100)
    finally:
        af.set_num_threads(old)
    np.testing.assert_array_equal(o1, outs[100])
    np.testing.assert_array_equal(o3, outs[100])


@pytest.mark.parametrize(
    "B, Hkv, Lk, split",
    [
        (1, 3, 512, 256),  # three 512-key items: fewer than four, so half-short splits
        (1, 1, 700, 256),  # two
        (1, 2, 1024, 512),  # four: short splits
        (2, 2, 300, 512),  # four (two sequences)
        (1, 4, 4096, 512),  # 32 items of 512, 8 of 2048: still short
        (1, 16, 4096, 2048),  # 32 items of 2048: long
    ],
)
def test_default_split_is_a_rule_on_the_shape(isa, rng, B, Hkv, Lk, split):
    """The kernel's own split (split=0) is the rule's, on every ISA and thread count: the
    same bits as that split asked for explicitly, and not those of the other candidates
    (the splits of these shapes merge differently, so a wrong choice shows in the bits)."""
    Hq, d = 3 * Hkv, 64
    q, k, v = randn(rng, (B, Hq, 1, d)), randn(rng, (B, Hkv, Lk, d)), randn(rng, (B, Hkv, Lk, d))
    chosen, _ = decode(q, k, v)
    want, _ = decode(q, k, v, split=split)
    np.testing.assert_array_equal(chosen, want)
    for other in {256, 512, 2048} - {split}:
        if Lk > min(other, split):
            assert not np.array_equal(chosen, decode(q, k, v, split=other)[0]), other
    old = af.get_num_threads()
    try:
        af.set_num_threads(3 - min(old, 2))  # the other of one and two (or more) threads
        np.testing.assert_array_equal(decode(q, k, v)[0], want)
    finally:
        af.set_num_threads(old)


def test_nan_in_masked_value_does_not_leak(isa, rng):
    B, Hq, Hkv, Lq, Lk, d = 1, 2, 1, 3, 100, 8
    q, k, v = randn(rng, (B, Hq, Lq, d)), randn(rng, (B, Hkv, Lk, d)), randn(rng, (B, Hkv, Lk, d))
    v[:, :, -1] = np.nan  # the last key: visible only to the last query row
    o, _ = decode(q, k, v, causal=True)
    assert np.isfinite(o[:, :, :-1]).all() and np.isnan(o[:, :, -1]).all()
    O = ref.sdpa(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], mask=ref.causal_mask(Lq - 1, Lk - 1))
    assert_close(o[:, :, :-1], O, np.float32)


def test_decode_backend_rejects_what_it_lacks(rng):
    q, k, v = randn(rng, (1, 2, 1, 8)), randn(rng, (1, 2, 100, 8)), randn(rng, (1, 2, 100, 8))
    with pytest.raises(ValueError, match="backend='decode' supports"):
        af.scaled_dot_product_attention(q, k, v, softcap=5.0, backend="decode")
    with pytest.raises(ValueError, match="backend='decode' supports"):
        af.scaled_dot_product_attention(
            q, k, v, attn_mask=np.ones((1, 100), bool), backend="decode"
        )
    # the automatic path falls back to the tiled kernel for those, and stays exact
    O = ref.sdpa(q, k, v, softcap=5.0)
    assert_close(af.scaled_dot_product_attention(q, k, v, softcap=5.0), O, np.float32)


def test_stream_read_probe():
    gbps = _core.stream_read_gbps(1, 1 << 20, 2)
    assert np.isfinite(gbps) and gbps > 0


@pytest.mark.parametrize("d, dv", [(5, 7), (80, 80), (256, 128)], ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_next_block_prefetch_across_blocks_and_ring_wrap(isa, rng, d, dv, dtype):
    """Splits of several 64-key blocks (each block prefetches the next one's rows), a ring that
    wraps inside a block, L not a multiple of 64 and row lengths that are not whole lines."""
    B, Hq, Hkv, Lq, R = 2, 8, 2, 1, 600
    q = randn(rng, (B, Hq, Lq, d), dtype=dtype)
    k, v = randn(rng, (B, Hkv, R, d), dtype=dtype), randn(rng, (B, Hkv, R, dv), dtype=dtype)
    start = np.array([570, 0])  # sequence 0 wraps at key 30, mid-block
    kv_lens = np.array([589, 589])
    o, lse = decode(q, k, v, causal=True, kv_start=start, kv_lens=kv_lens, split=256)
    for b in range(B):
        idx = (start[b] + np.arange(kv_lens[b])) % R
        O, LSE = ref.sdpa(q[b], k[b][:, idx], v[b][:, idx], return_lse=True)
        check(o[b], lse[b], O, LSE, dtype)


@pytest.fixture(params=["l1", "l2"])
def prefetch(request):
    """Run the test once per decode prefetch policy (a hint: both run on every x86 CPU)."""
    old = af.get_decode_prefetch()
    af.set_decode_prefetch(request.param)
    yield request.param
    af.set_decode_prefetch(old)


def _cache_of(rng, dtype, paged, Hkv=2, d=80, lens=(700, 131)):
    """A KVCache or PagedKVCache of `dtype` holding two ragged sequences of random tokens
    (int8: quantised on append from float32)."""
    import ml_dtypes

    store = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    src = store.get(dtype, np.float32)
    k = randn(rng, (2, Hkv, max(lens), d)).astype(src)
    v = randn(rng, (2, Hkv, max(lens), d)).astype(src)
    if paged:
        c = af.PagedKVCache(Hkv, d, block_size=64, dtype=dtype)
        ids = [c.add_sequence() for _ in lens]
        c.append(ids, k, v, lengths=np.array(lens))
        return c, ids, src
    c = af.KVCache(2, Hkv, d, capacity=max(lens) + 1, dtype=dtype)
    c.append(k, v, lengths=np.array(lens))
    return c, None, src


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_prefetch_policies_give_the_same_bits(isa, rng, prefetch, dtype, paged):
    """l1 (prefetcht0 with a touch pass, or staggered) and l2 (prefetcht1, no touch pass)
    only change how the next block's lines are requested: the result is bit-identical to the
    other policy's and matches the oracle on the stored (rounded / dequantised) K/V."""
    c, ids, src = _cache_of(rng, dtype, paged)
    q = randn(rng, (2, 8, 1, 80)).astype(src)

    def attend():
        return np.asarray(c.attend(ids, q) if paged else c.attend(q), np.float64)

    o = attend()
    af.set_decode_prefetch("l2" if prefetch == "l1" else "l1")
    try:
        o2 = attend()
    finally:
        af.set_decode_prefetch(prefetch)
    np.testing.assert_array_equal(o, o2)
    for b in range(2):
        k = np.asarray(c.keys(ids[b] if paged else b), np.float64)
        v = np.asarray(c.values(ids[b] if paged else b), np.float64)
        O = ref.sdpa(np.asarray(q[b], np.float64), k, v)
        # one rounding of O to the storage type (16-bit), else float32 rounding
        t16 = {"bfloat16": dict(rtol=2e-2, atol=1e-2), "float16": dict(rtol=4e-3, atol=2e-3)}
        assert_close(o[b], O, np.float32, **t16.get(dtype, {}))


def _auto_prefetch():
    """The policy "auto" documents: l2 on Intel and on AMD Zen 4 (family 19h with
    the avx512 ISA available), l1 elsewhere."""
    vendor, family, _model = _core.cpu_signature()
    zen4 = vendor == "AuthenticAMD" and family == 0x19 and "avx512" in _core.available_isas()
    return "l2" if vendor == "GenuineIntel" or zen4 else "l1"


def test_cpu_signature():
    vendor, family, model = _core.cpu_signature()
    assert isinstance(vendor, str) and isinstance(family, int) and isinstance(model, int)
    if platform.machine() in ("x86_64", "AMD64"):
        assert len(vendor) == 12 and family >= 6 and 0 <= model <= 0xFF
        try:
            with open("/proc/cpuinfo") as f:
                info = f.read()
        except OSError:
            return
        fields = {}
        for line in info.splitlines():
            if not line.strip():
                break  # the first processor's block only
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        if "vendor_id" in fields:  # Linux prints the same three CPUID values
            assert fields["vendor_id"] == vendor
            assert int(fields["cpu family"]) == family
            assert int(fields["model"]) == model
        assert af._config.config()["cpu_id"] == f"{vendor} family {family:x}h model {model:x}h"


def test_decode_prefetch_setting():
    old = af.get_decode_prefetch()
    try:
        assert old in ("l1", "l2")
        for name in ("l1", "l2", " L2 "):
            af.set_decode_prefetch(name)
            assert af.get_decode_prefetch() == name.strip().lower()
        af.set_decode_prefetch("auto")  # by the CPU
        assert af.get_decode_prefetch() == _auto_prefetch()
        assert af._config.config()["decode_prefetch"] == af.get_decode_prefetch()
        for bad in ("l3", "", None, 2):
            with pytest.raises(ValueError, match="decode prefetch must be one of"):
                af.set_decode_prefetch(bad)
        assert af.get_decode_prefetch() == _auto_prefetch()
    finally:
        af.set_decode_prefetch(old)


def test_decode_prefetch_environment_variable():
    import os
    import subprocess
    import sys

    code = "import attn_fast as af; print(af.get_decode_prefetch())"
    for name in ("l1", "l2"):
        env = {**os.environ, "ATTN_FAST_DECODE_PREFETCH": name}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == name
    env = {**os.environ, "ATTN_FAST_DECODE_PREFETCH": "l9"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "decode prefetch must be one of" in out.stderr
