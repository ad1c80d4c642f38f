"""Tile paths of the tuned kernel against the float64 oracle: packed V strips and
their tails, the per-thread K/V block cache (reuse across query blocks and GQA
heads, ring reuse when a sequence does not fit), key blocks aligned below a
window start, NaN-safe cached V blocks, the softmax exp over its whole range;
and smoke tests of the benchmark probes and suite."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import assert_attention, assert_close, randn, run_sdpa

import attn_fast as af
from attn_fast import reference as ref


def sdpa_checked(q, k, v, dtype, mask=None, **kw):
    o, lse = run_sdpa(q, k, v, dtype, **kw)
    group = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    O, LSE = ref.sdpa(q, kk, vv, mask=mask, return_lse=True)
    assert_attention(o, lse, O, LSE, dtype)
    return o


# dv around the strip width (16 floats for AVX2, 64 for AVX-512) and its tails.
@pytest.mark.parametrize("dv", [1, 8, 16, 24, 40, 72, 130])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_value_strip_tails(isa, rng, dv, dtype):
    q, k = randn(rng, (1, 2, 77, 20), dtype), randn(rng, (1, 2, 150, 20), dtype)
    v = randn(rng, (1, 2, 150, dv), dtype)
    for causal in (False, True):
        mask = ref.causal_mask(77, 150) if causal else None
        sdpa_checked(q, k, v, dtype, mask=mask, is_causal=causal)
        sdpa_checked(q, k, v, dtype, mask=mask, is_causal=causal, block_q=7, block_k=33)


def test_cache_reuse_across_query_blocks_and_gqa(isa, rng):
    # Many query blocks and 4 q heads per kv head: each thread packs a key block
    # once and reuses it; strided (B, L, H, d) storage is read through strides.
    q = randn(rng, (2, 300, 8, 48)).transpose(0, 2, 1, 3)
    k = randn(rng, (2, 310, 2, 48)).transpose(0, 2, 1, 3)
    v = randn(rng, (2, 310, 2, 40)).transpose(0, 2, 1, 3)
    for causal in (False, True):
        mask = ref.causal_mask(300, 310) if causal else None
        sdpa_checked(q, k, v, np.float32, mask=mask, is_causal=causal, enable_gqa=True, block_q=16)


def test_cache_ring_when_sequence_does_not_fit(isa, rng):
    # d = dv = 256 and 13000 keys need about 26 MiB of packed blocks per thread,
    # more than the cache holds: slots are reused as a ring, and the second q
    # head of the group finds its blocks evicted.
    q = randn(rng, (1, 2, 9, 256))
    k, v = randn(rng, (1, 1, 13000, 256)), randn(rng, (1, 1, 13000, 256))
    sdpa_checked(
        q, k, v, np.float32, mask=ref.causal_mask(9, 13000), is_causal=True, enable_gqa=True
    )


def test_window_start_inside_a_key_block(isa, rng):
    q, k, v = (randn(rng, (1, 2, 500, 32), np.float64) for _ in range(3))
    for left, right in ((37, 0), (200, 45)):
        mask = ref.window_mask(500, 500, left, right)
        sdpa_checked(q, k, v, np.float64, mask=mask, window_size=(left, right))
        sdpa_checked(
            q, k, v, np.float64, mask=mask, window_size=(left, right), block_q=20, block_k=50
        )


def test_nonfinite_value_in_cached_block(isa, rng):
    # V row 150 is inf: causal rows before it must stay exact and finite, while
    # the block holding it is reused by many query blocks.
    q, k, v = (randn(rng, (1, 2, 200, 16)) for _ in range(3))
    v[:, :, 150, 3] = np.inf
    o = af.scaled_dot_product_attention(q, k, v, is_causal=True, block_q=8)
    O = ref.sdpa(q[:, :, :150], k[:, :, :150], v[:, :, :150], mask=ref.causal_mask(150, 150))
    assert_close(o[:, :, :150], O, np.float32)
    assert not np.any(np.isnan(o[:, :, 150:, :3]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_softmax_weights_over_the_exp_range(isa, rng, dtype):
    # Score gaps from 0 to about -300 (weights down to the denormal range and
    # exact zeros) and scores of both signs around a large offset.
    q = randn(rng, (1, 2, 64, 8), dtype, scale=6)
    k = randn(rng, (1, 2, 96, 8), dtype, scale=6)
    v = randn(rng, (1, 2, 96, 8), dtype)
    sdpa_checked(q, k, v, dtype)
    sdpa_checked(q + dtype(3), k, v, dtype, mask=ref.causal_mask(64, 96), is_causal=True)


def test_probes():
    assert af._core.fma_peak_gflops(1, 0.01) > 0
    bw = af._core.read_bandwidth_gbs(1, 1 << 20, 0.01)
    assert np.isfinite(bw) and bw > 0


def test_suite_smoke(tmp_path):
    from attn_fast._bench import cases as bs
    from attn_fast._bench.suite import run

    cases = [bs.Case("prefill", 1, 2, 2, 64, 64, 16, c) for c in (False, True)]
    cases.append(bs.Case("decode", 1, 4, 2, 1, 50, 16, False))
    with open(tmp_path / "log.txt", "w") as log:
        res = run(cases, [1], repeats=1, memory=False, impls=("attn_fast", "numpy"), out=log)
    assert [r["name"] for r in res["results"]] == [c.name for c in cases]
    for r in res["results"]:
        for impl in ("attn_fast", "numpy"):
            assert r["impls"][impl]["oracle_max_abs_err"] < 2e-3
            assert r["impls"][impl]["median_s"] > 0
    assert res["limits"]["1"]["fma_peak_gflops"] > 0
    json.dumps(res)  # every figure is JSON-serialisable
    assert any("causal time" in t["target"] for t in res["targets"])


def test_tall_query_blocks_for_long_kv(isa, rng):
    # K/V of a head over 2 MiB: the default query block grows to 96 rows;
    # 200 rows leave a tail block, causal bottom-right with Lq < Lk.
    q = randn(rng, (1, 1, 200, 128))
    k, v = randn(rng, (1, 1, 4100, 128)), randn(rng, (1, 1, 4100, 128))
    sdpa_checked(q, k, v, np.float32)
    sdpa_checked(q, k, v, np.float32, mask=ref.causal_mask(200, 4100), is_causal=True)


# Q panels: unit-stride rows are packed by registers on AVX-512 (6 rows x W
# columns interleaved at once), strided rows element by element. Both compute
# the same products, so the outputs must agree bit for bit, and the oracle.
@pytest.mark.parametrize("d", [1, 5, 16, 80, 256])
@pytest.mark.parametrize("L", [1, 7, 129])
def test_q_panels_from_unit_and_strided_rows_agree(isa, rng, d, L):
    q = randn(rng, (2, 3, L, d))
    q_strided = np.zeros((2, 3, L, 2 * d), np.float32)[..., ::2]  # element stride 2
    q_strided[...] = q
    k, v = randn(rng, (2, 3, 140, d)), randn(rng, (2, 3, 140, 24))
    for causal in (False, True):
        mask = ref.causal_mask(L, 140) if causal else None
        o = sdpa_checked(q, k, v, np.float32, mask=mask, is_causal=causal)
        o_strided, _ = run_sdpa(q_strided, k, v, np.float32, is_causal=causal)
        np.testing.assert_array_equal(o, o_strided)


# K panels: unit-stride key rows are transposed 16 keys x 16 dims at a time in
# registers on AVX-512, strided ones copied element by element; the panels hold
# the same values, so the outputs agree bit for bit (key tails: Lk % 16 != 0).
@pytest.mark.parametrize("d", [1, 5, 16, 80, 256])
@pytest.mark.parametrize("Lk", [1, 7, 129])
def test_k_panels_from_unit_and_strided_rows_agree(isa, rng, d, Lk):
    q, k, v = randn(rng, (2, 2, 33, d)), randn(rng, (2, 2, Lk, d)), randn(rng, (2, 2, Lk, 20))
    k_strided = np.zeros((2, 2, Lk, 3 * d), np.float32)[..., ::3]  # element stride 3
    k_strided[...] = k
    for causal in (False, True):
        mask = ref.causal_mask(33, Lk) if causal else None
        o = sdpa_checked(q, k, v, np.float32, mask=mask, is_causal=causal)
        o_strided, _ = run_sdpa(q, k_strided, v, np.float32, is_causal=causal)
        np.testing.assert_array_equal(o, o_strided)


# The schedule hands whole (sequence, kv head) groups to a thread while there
# are at least 2 per thread, then single query blocks for the last groups:
# every row must still be computed exactly once, with the bits of one thread.
@pytest.mark.parametrize(
    "B, Hq, Hkv, L", [(3, 8, 4, 100), (1, 12, 12, 150), (2, 4, 1, 130), (5, 2, 2, 97)]
)
def test_group_schedule_is_bit_identical_across_thread_counts(isa, rng, B, Hq, Hkv, L):
    q = randn(rng, (B, Hq, L, 24))
    k, v = randn(rng, (B, Hkv, L, 24)), randn(rng, (B, Hkv, L, 24))
    old = af.get_num_threads()
    try:
        for causal in (False, True):
            outs = []
            for nt in (1, 2, 3):
                af.set_num_threads(nt)
                o, lse = run_sdpa(q, k, v, np.float32, is_causal=causal, enable_gqa=True)
                outs.append((o, lse))
            mask = ref.causal_mask(L, L) if causal else None
            g = Hq // Hkv
            O, LSE = ref.sdpa(
                q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1), mask=mask, return_lse=True
            )
            assert_attention(*outs[0], O, LSE, np.float32)
            for o, lse in outs[1:]:
                np.testing.assert_array_equal(o, outs[0][0])
                np.testing.assert_array_equal(lse, outs[0][1])
    finally:
        af.set_num_threads(old)
