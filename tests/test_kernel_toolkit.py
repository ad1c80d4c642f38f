"""The kernel toolkit of issue 17: the per-thread scratch arena, the tile-class
numbering shared by C++ and Python, the one read-bandwidth probe and the
bit-identity script (bench/guards/bit_identity.py) that guards refactors of csrc/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import poisoned, tol
from oracle import causal_mask, sdpa

import attn_fast as af
from attn_fast import _core, masks
from attn_fast._mask_record import summary_numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "guards", "bit_identity.py")


def _inputs(rng, B, H, Lq, Lk, d, dv, dtype):
    return (
        rng.standard_normal((B, H, Lq, d)).astype(dtype),
        rng.standard_normal((B, H, Lk, d)).astype(dtype),
        rng.standard_normal((B, H, Lk, dv)).astype(dtype),
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scratch_reused_across_shapes(isa, rng, dtype):
    # The thread's scratch block is kept between calls and reused when it is
    # large enough: calls that grow, shrink, exceed the kept size (a long Lk:
    # K/V cache above 4 MiB) and change d must each match the oracle, with no
    # stale data from the previous call showing through (poisoned out=).
    shapes = [
        (1, 2, 129, 129, 80, 80),
        (1, 1, 7, 7, 5, 3),
        (1, 2, 65, 9000, 64, 64),  # K/V cache of this call > the kept size
        (2, 3, 33, 257, 256, 1),
        (1, 1, 1, 1, 1, 1),
        (1, 2, 129, 129, 80, 80),
    ]
    for B, H, Lq, Lk, d, dv in shapes:
        q, k, v = _inputs(rng, B, H, Lq, Lk, d, dv, dtype)
        out = poisoned((B, H, Lq, dv), dtype)
        af.scaled_dot_product_attention(q, k, v, is_causal=True, out=out)
        want = sdpa(q, k, v, mask=causal_mask(Lq, Lk))
        np.testing.assert_allclose(out, want, **tol(dtype), err_msg=str((B, H, Lq, Lk, d, dv)))


def test_scratch_per_thread_concurrent_calls(isa, rng):
    # Calls from several Python threads at once (the GIL is released): each
    # thread has its own scratch, so the results are those of serial calls.
    cases = [
        _inputs(rng, 1, 2, 96 + 17 * i, 200 + 31 * i, 40 + 8 * i, 24, np.float32) for i in range(4)
    ]
    serial = [af.scaled_dot_product_attention(q, k, v, is_causal=True) for q, k, v in cases]
    got = [None] * len(cases)

    def run(i):
        q, k, v = cases[i]
        for _ in range(5):
            got[i] = af.scaled_dot_product_attention(q, k, v, is_causal=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(got, serial):
        np.testing.assert_array_equal(a, b)


def test_backward_scratch_reused(isa, rng):
    # The backward carves its scratch the same way: two shapes in a row, each
    # against the float64 oracle of the backward.
    from oracle import sdpa_backward

    for L, d in ((37, 24), (7, 5), (129, 80)):
        q, k, v = _inputs(rng, 1, 2, L, L, d, d, np.float64)
        dout = rng.standard_normal((1, 2, L, d))
        o, lse = af.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
        got = af.scaled_dot_product_attention_backward(dout, q, k, v, o, lse, is_causal=True)
        want = sdpa_backward(q, k, v, dout, mask=causal_mask(L, L))
        for g, name in zip(got, ("dq", "dk", "dv")):
            np.testing.assert_allclose(g, want[name], rtol=1e-9, atol=1e-10, err_msg=name)


def test_tile_class_numbering_is_shared():
    # One numbering: the C++ TileClass, exported by the bindings, is what
    # masks.BLOCK_* and the block summaries use.
    assert (masks.BLOCK_MASKED, masks.BLOCK_PARTIAL, masks.BLOCK_VISIBLE) == (
        _core.BLOCK_MASKED,
        _core.BLOCK_PARTIAL,
        _core.BLOCK_VISIBLE,
    )
    assert len({_core.BLOCK_MASKED, _core.BLOCK_PARTIAL, _core.BLOCK_VISIBLE}) == 3
    m = np.zeros((1, 1, 8, 12), dtype=bool)
    m[..., :4, 4:8] = True  # tile (0, 1) all visible
    m[..., 5, 9] = True  # tile (1, 2) partial
    summary = masks.block_summary(m, 4)
    assert summary[0, 0, 0, 1] == masks.BLOCK_VISIBLE
    assert summary[0, 0, 1, 2] == masks.BLOCK_PARTIAL
    assert summary[0, 0, 0, 0] == masks.BLOCK_MASKED
    np.testing.assert_array_equal(summary, summary_numpy(m, 4))


def test_kernel_skips_masked_tiles(isa, rng):
    # The kernel's own tile classes: a block-sparse layout with empty tiles
    # has them skipped (masked), the others computed, and the output matches
    # the oracle with the layout expanded to a dense mask.
    L, blk = 256, 64
    layout = np.eye(L // blk, dtype=bool)
    layout[2, 0] = True
    q, k, v = _inputs(rng, 1, 2, L, L, 32, 32, np.float32)
    o, st = af.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=masks.BlockSparse(layout, blk),
        return_stats=True,
        block_q=blk,
        block_k=blk,
    )
    if st.block_k == blk:  # tiles the size of the layout's blocks
        assert st.tiles_skipped > 0 and st.tiles_computed > 0
    dense = np.kron(layout, np.ones((blk, blk), dtype=bool))
    np.testing.assert_allclose(o, sdpa(q, k, v, mask=dense), **tol(np.float32))


@pytest.mark.parametrize("nbytes", [100, 4096 + 12, 1 << 20])
@pytest.mark.parametrize("threads", [1, 3])
def test_one_read_probe_two_signatures(nbytes, threads):
    # stream_read_gbps and read_bandwidth_gbs are one measurement; any size
    # (tails, more threads than cores) gives a finite positive figure or 0
    # for a buffer too small to share.
    a = _core.stream_read_gbps(threads, nbytes, 2)
    b = _core.read_bandwidth_gbs(threads, nbytes, 0.0)
    assert np.isfinite(a) and a >= 0
    assert np.isfinite(b) and b > 0  # read_bandwidth_gbs reads at least 256 KiB
    if nbytes >= 16 * 4 * threads:
        assert a > 0


def _run_script(*args):
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""), reason="slow under ASan; CI runs it per ISA"
)
def test_bit_identity_script_detects_a_change(tmp_path):
    # The script's --check passes on its own output and fails (exit 1, the
    # case named) when one hash differs or a case is missing.
    isa = af.get_isa()
    path = tmp_path / "bits.json"
    r = _run_script("--isa", isa, "--out", str(path))
    assert r.returncode == 0, r.stderr
    doc = json.loads(path.read_text())
    cases = doc["results"][isa]
    assert len(cases) > 50 and all(len(h) == 64 for h in cases.values())
    r = _run_script("--check", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit-identical" in r.stdout

    name = sorted(cases)[0]
    cases[name] = "0" * 64
    del cases[sorted(cases)[-1]]
    path.write_text(json.dumps(doc))
    r = _run_script("--check", str(path))
    assert r.returncode == 1
    assert f"MISMATCH {isa} {name}: differs" in r.stdout
    assert "new" in r.stdout  # the deleted case is computed but not in the file
