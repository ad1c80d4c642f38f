"""The AMX-BF16 tile path of the bfloat16 forward (issue 19): amx and amx_emu.

amx_emu is the amx kernel with its tile operations emulated by vdpbf16ps
(csrc/kernels/amx_tiles.h); it runs wherever avx512_bf16 does, so the tile
path's packing, indexing, tails, masks and GQA are tested on CPUs without AMX.
Each test runs once per tile ISA (`tile_isa`): amx_emu where AVX512-BF16 is,
amx where the CPU and the OS grant AMX (skipped elsewhere with the reason
from show_config's amx line; on an AMX CPU it must run, not skip).

The oracle is float64 on the same bf16-rounded inputs; the tolerance is
test_dtypes' (one rounding of O, fp32 accumulation, P rounded to bf16 for the
P V tile product).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from test_dtypes import check_lse, close, f64, gen, make, need, orc, torch

import attn_fast as af
from attn_fast import masks
from attn_fast import reference as ref
from attn_fast._checks import to_input_kind

_core = af._core
sdpa = af.scaled_dot_product_attention
TILE_ISAS = ("amx_emu", "amx")
SRC = "torch_bf16" if torch is not None else "ml_bf16"


def _tile_isa_available(name):
    if name not in _core.compiled_isas():
        return False, f"{name} is not compiled into this build"
    if name not in _core.available_isas():
        why = _core.amx_status() if name == "amx" else "no AVX512-BF16 on this CPU"
        return False, f"{name} cannot run here: {why}"
    forced = os.environ.get("ATTN_FAST_ISA", "").strip()
    if forced and forced != name:
        return False, f"ATTN_FAST_ISA={forced} runs the suite on that ISA alone"
    return True, ""


@pytest.fixture(params=TILE_ISAS)
def tile_isa(request):
    """Each tile ISA this CPU runs, active for the test."""
    ok, why = _tile_isa_available(request.param)
    if not ok:
        pytest.skip(why)
    old = af.get_isa()
    af.set_isa(request.param)
    yield request.param
    af.set_isa(old)


def _bf16_bits(x):
    """float64 -> bf16 bits (round to nearest even), and the rounded values."""
    f = np.ascontiguousarray(x, np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _vnni(b):
    """(32, 16) matrix -> the (16, 32) VNNI tile: row k2 holds (b[2k2, n], b[2k2+1, n]) pairs."""
    return np.ascontiguousarray(b.reshape(16, 2, 16).transpose(0, 2, 1).reshape(16, 32))


# ---------------------------------------------------------------- one TDPBF16PS


def test_tdpbf16ps_tile_matches_float64_loop(tile_isa, rng):
    """c += a . b on one tile of the amx / amx_emu object equals a float64 loop within fp32
    rounding (bf16 products are exact in fp32; only the fp32 sums round)."""
    a_bits, a = _bf16_bits(rng.standard_normal((16, 32)))
    b_bits, b = _bf16_bits(rng.standard_normal((32, 16)))
    c0 = rng.standard_normal((16, 16)).astype(np.float32)
    want = c0.astype(np.float64).copy()
    for m in range(16):
        for n in range(16):
            for k in range(32):
                want[m, n] += a[m, k] * b[k, n]
    c = c0.copy()
    _core.tdpbf16ps_tile(tile_isa, a_bits, _vnni(b_bits), c)
    bound = 32 * 2.0**-23 * (np.abs(c0) + np.abs(a) @ np.abs(b))  # 32 fp32 roundings at most
    assert (np.abs(c - want) <= bound + 1e-30).all(), np.abs(c - want).max()
    assert not np.array_equal(c, c0)  # the product was added


def test_tdpbf16ps_tile_pairs_and_rows_are_not_mixed_up(tile_isa):
    """Unit vectors pick single elements: a = e_(m, k), b = e_(k, n) adds 1 to c[m, n] only,
    for every (m, k, n) in a sample that covers both halves of each pair and every tile row."""
    one = np.uint16(0x3F80)  # bf16 1.0
    for m, k, n in [(0, 0, 0), (15, 31, 15), (3, 1, 7), (9, 30, 2), (15, 0, 8), (1, 17, 15)]:
        a = np.zeros((16, 32), np.uint16)
        b = np.zeros((32, 16), np.uint16)
        a[m, k] = one
        b[k, n] = one
        c = np.zeros((16, 16), np.float32)
        _core.tdpbf16ps_tile(tile_isa, a, _vnni(b), c)
        want = np.zeros((16, 16), np.float32)
        want[m, n] = 1.0
        np.testing.assert_array_equal(c, want, err_msg=f"m={m} k={k} n={n}")


def test_tdpbf16ps_tile_rejects_bad_arguments():
    c = np.zeros((16, 16), np.float32)
    a = np.zeros((16, 32), np.uint16)
    with pytest.raises(ValueError, match="tdpbf16ps_tile"):
        _core.tdpbf16ps_tile("amx_emu", a[:8], a, c)
    with pytest.raises(ValueError, match="tdpbf16ps_tile"):
        _core.tdpbf16ps_tile("amx_emu", a, a, c.astype(np.float64))
    with pytest.raises(ValueError, match="tdpbf16ps_tile"):
        _core.tdpbf16ps_tile("amx_emu", a, a, np.zeros((16, 32), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="not a tile ISA"):
        _core.tdpbf16ps_tile("avx512", a, a, c)
    with pytest.raises(ValueError, match="unknown ISA"):
        _core.tdpbf16ps_tile("amx_fp16", a, a, c)
    if "amx" not in _core.available_isas():
        with pytest.raises(RuntimeError, match="amx"):
            _core.tdpbf16ps_tile("amx", a, a, c)


# ---------------------------------------------------------------- the attention forward


SHAPES = [  # (Lq, Lk, d, dv): row tails (16-row tiles), key tails (64-key panels), d tails
    (1, 1, 64, 64),
    (7, 7, 5, 5),
    (16, 16, 64, 64),
    (17, 17, 80, 80),
    (129, 129, 128, 128),
    (300, 300, 256, 256),
    (17, 129, 1, 1),
    (129, 17, 80, 48),
    (7, 300, 256, 80),
    (300, 129, 5, 24),
    (16, 65, 33, 17),
]


@pytest.mark.parametrize("causal", [None, "bottom_right", "top_left"])
@pytest.mark.parametrize("Lq, Lk, d, dv", SHAPES)
def test_matches_oracle(tile_isa, rng, causal, Lq, Lk, d, dv):
    q, k, v = gen(rng, SRC, (1, 2, Lq, d), (1, 2, Lk, d), (1, 2, Lk, dv))
    mask = None if causal is None else masks.Causal(align=causal)
    o, lse = sdpa(q, k, v, attn_mask=mask, return_lse=True, backend="fused")
    cm = None if causal is None else ref.causal_mask(Lq, Lk, align=causal)
    O, LSE = orc(f64(q), f64(k), f64(v), mask=cm, return_lse=True)
    close(o, O, SRC)
    check_lse(lse, LSE)


def test_windows_masks_gqa_lq_ne_lk(tile_isa, rng):
    """A sliding window, a dense boolean mask and 6 query heads on 2 kv heads, Lq != Lk,
    through transposed (non-contiguous) inputs."""
    B, Hq, Hkv, Lq, Lk, d = 2, 6, 2, 70, 131, 80
    q, k, v = gen(rng, SRC, (B, Lq, Hq, d), (B, Lk, Hkv, d), (B, Lk, Hkv, 40))
    tr = (lambda x: x.transpose(1, 2)) if SRC.startswith("torch") else (lambda x: x.swapaxes(1, 2))
    q, k, v = tr(q), tr(k), tr(v)
    keep = rng.random((B, Hq, Lq, Lk)) < 0.8
    o = sdpa(
        q, k, v, attn_mask=[keep, masks.SlidingWindow(40, 9)], enable_gqa=True, backend="fused"
    )
    rep = lambda x: np.repeat(f64(x), Hq // Hkv, axis=1)  # noqa: E731
    vis = keep & ref.window_mask(Lq, Lk, 40, 9)
    close(o, orc(f64(q), rep(k), rep(v), mask=vis), SRC)


def test_score_transforms_and_varlen(tile_isa, rng):
    """softcap, ALiBi, sinks and packed varlen sequences run on the tile path unchanged."""
    need(SRC)
    H, d = 2, 64
    lens = [5, 40, 17]
    tot = sum(lens)
    q, k, v = gen(rng, SRC, (tot, H, d), (tot, H, d), (tot, H, d))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    o = af.varlen_attention(q, k, v, cu, cu, causal=True)
    for s in range(len(lens)):
        a, b = cu[s], cu[s + 1]
        sq, sk, sv = (f64(x)[a:b].transpose(1, 0, 2)[None] for x in (q, k, v))
        want = orc(sq, sk, sv, mask=ref.causal_mask(b - a, b - a))
        got = f64(o)[a:b].transpose(1, 0, 2)[None]
        close(got, want, SRC, what=f"sequence {s}")
    q, k, v = gen(rng, SRC, (1, H, 33, d), (1, H, 70, d), (1, H, 70, d))
    slopes = np.array([0.25, 0.5], np.float32)
    o = sdpa(q, k, v, softcap=5.0, alibi_slopes=slopes, is_causal=True, backend="reference")
    got = sdpa(q, k, v, softcap=5.0, alibi_slopes=slopes, is_causal=True, backend="fused")
    np.testing.assert_allclose(f64(got), f64(o), rtol=2e-2, atol=2e-2)


def test_fully_masked_rows_nan_in_masked_v_and_poisoned_out(tile_isa, rng):
    """Rows that see nothing give zeros and lse = -inf; NaN/inf in masked V rows never leak
    (the non-finite block takes the guarded product: AMX also gives 0 x NaN = NaN); every
    element of a NaN-poisoned out buffer is written."""
    need(SRC)
    B, H, L, d = 1, 2, 70, 80
    q = make(rng.standard_normal((B, H, L, d)), SRC)
    kf, vf = rng.standard_normal((B, H, L, d)), rng.standard_normal((B, H, L, d))
    kf[..., 60:, :] = np.nan
    vf[..., 60:, :] = np.nan
    vf[..., 3, :] = np.inf
    k, v = make(kf, SRC), make(vf, SRC)
    keep = np.ones((B, H, L, L), bool)
    keep[..., 3] = False
    keep[:, :, 5, :] = False
    keep[:, :, 40:56, :] = False  # a whole 16-row tile sees nothing
    out = make(np.full((B, L, H, d), np.nan, np.float32), SRC)
    o_view = out.transpose(1, 2) if SRC.startswith("torch") else out.swapaxes(1, 2)
    o, lse = sdpa(
        q,
        k,
        v,
        attn_mask=[keep, masks.Padding(kv_lens=[60], q_lens=[L])],
        return_lse=True,
        out=o_view,
        backend="fused",
    )
    o = f64(o)
    assert np.isfinite(o).all()
    lse = np.asarray(lse)
    assert (o[:, :, 5] == 0).all() and np.isneginf(lse[:, :, 5]).all()
    assert (o[:, :, 40:56] == 0).all() and np.isneginf(lse[:, :, 40:56]).all()
    vis = keep & (np.arange(L) < 60)
    K, V = (np.where(np.isfinite(f64(x)), f64(x), 0.0) for x in (k, v))
    O, LSE = orc(f64(q), K, V, mask=vis, return_lse=True)
    close(o, O, SRC)
    check_lse(lse, LSE)


def test_block_sizes_and_threads(tile_isa, rng):
    """The result does not depend on the tiling asked for or the thread count beyond
    rounding; block_k is rounded up to the 64-key panel."""
    q, k, v = gen(rng, SRC, (1, 4, 150, 96), (1, 4, 200, 96), (1, 4, 200, 96))
    want = orc(f64(q), f64(k), f64(v), mask=ref.causal_mask(150, 200))
    old = af.get_num_threads()
    try:
        for bq, bk, nt in [(0, 0, 1), (16, 64, 2), (33, 100, 2), (150, 256, 1)]:
            af.set_num_threads(nt)
            o = sdpa(q, k, v, is_causal=True, block_q=bq, block_k=bk, backend="fused")
            close(o, want, SRC, what=f"block_q={bq} block_k={bk} threads={nt}")
    finally:
        af.set_num_threads(old)


def test_emulated_tiles_equal_the_vdpbf16ps_path_bit_for_bit(rng):
    """amx_emu does the same fp32 products in the same order as avx512_bf16's vdpbf16ps
    kernel (padding pairs add exact zeros), with P rounded to bf16 in both: the same bits,
    where both take the scaled-score softmax (a score transform, here softcap, keeps the
    tile path off its raw-score exponent) with the same blocks (the tile path's default
    blocks are larger). (Real AMX may sum each pair's two products in another order: not
    compared bit for bit.)"""
    for name in ("amx_emu", "avx512_bf16"):
        if name not in _core.available_isas():
            pytest.skip(f"{name} cannot run here")
    q, k, v = gen(rng, SRC, (2, 4, 77, 80), (2, 2, 140, 80), (2, 2, 140, 72))
    got = {}
    old = af.get_isa()
    try:
        for name in ("amx_emu", "avx512_bf16"):
            af.set_isa(name)
            got[name] = f64(
                sdpa(
                    q,
                    k,
                    v,
                    is_causal=True,
                    enable_gqa=True,
                    window_size=(60, 5),
                    softcap=30.0,
                    block_q=48,
                    block_k=256,
                    backend="fused",
                )
            )
    finally:
        af.set_isa(old)
    np.testing.assert_array_equal(got["amx_emu"], got["avx512_bf16"])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 4, 129, 64), (1, 4, 200, 128), (1, 2, 77, 80)])
def test_error_within_1p5x_of_torch_bf16(tile_isa, rng, causal, shape):
    """The tile path's bf16 error against the float64 oracle is at most 1.5x torch's bf16
    SDPA error on the same inputs (RMS and max)."""
    if torch is None:
        pytest.skip("torch not installed")
    q, k, v = gen(rng, "torch_bf16", shape, shape, shape)
    L = shape[2]
    ours = f64(to_input_kind(sdpa(q, k, v, is_causal=causal, backend="fused"), q))
    theirs = f64(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
    O = ref.sdpa(f64(q), f64(k), f64(v), mask=ref.causal_mask(L, L) if causal else None)
    e_ours, e_torch = np.abs(ours - O), np.abs(theirs - O)
    assert np.sqrt(np.mean(e_ours**2)) <= 1.5 * np.sqrt(np.mean(e_torch**2))
    assert e_ours.max() <= 1.5 * e_torch.max()


def test_other_calls_run_the_avx512_kernels(tile_isa, rng):
    """On a tile ISA only the bf16 forward changes: fp32, fp16 and the decode kernel give the
    avx512 object's bits."""
    if "avx512" not in _core.available_isas():
        pytest.skip("no avx512 here")
    q32, k32, v32 = (rng.standard_normal((1, 2, 40, 24)).astype(np.float32) for _ in range(3))
    q16, k16, v16 = (x.astype(np.float16) for x in (q32, k32, v32))
    runs = {}
    for name in (tile_isa, "avx512"):
        af.set_isa(name)
        runs[name] = [
            sdpa(q32, k32, v32, is_causal=True),
            sdpa(q16, k16, v16, is_causal=True),
            sdpa(q32[:, :, :1], k32, v32, backend="decode"),
        ]
    af.set_isa(tile_isa)
    for a, b in zip(runs[tile_isa], runs["avx512"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_decode_and_backward_take_the_documented_objects(tile_isa, rng):
    """dispatch.cpp's bf16_dot: on a tile ISA the bf16 decode is the avx512 object's and the
    bf16 backward the avx512_bf16 object's vdpbf16ps pair sums (bits equal to those ISAs'
    own calls, and the backward's bits differ from the avx512 FMA backward's)."""
    if "avx512" not in _core.available_isas():
        pytest.skip("no avx512 here")
    q, k, v, do = gen(rng, SRC, (1, 2, 70, 64), (1, 2, 90, 64), (1, 2, 90, 64), (1, 2, 70, 64))
    af.set_isa("avx512")  # one forward for every backward below
    o, lse = sdpa(q, k, v, is_causal=True, return_lse=True)
    bits = {}
    for name in (tile_isa, "avx512", "avx512_bf16"):
        af.set_isa(name)
        dec = sdpa(q[:, :, :1], k, v, backend="decode")
        grads = af.scaled_dot_product_attention_backward(do, q, k, v, o, lse, is_causal=True)
        bits[name] = (f64(dec).tobytes(), [f64(g).tobytes() for g in grads])
    af.set_isa(tile_isa)
    assert bits[tile_isa][0] == bits["avx512"][0]
    assert bits[tile_isa][1] == bits["avx512_bf16"][1]
    assert bits[tile_isa][1] != bits["avx512"][1]


# ---------------------------------------------------------------- dispatch, self-check, status


def test_self_check_passes_on_the_tile_path(tile_isa):
    ok, why = _core.amx_self_check(tile_isa)
    assert ok, why
    assert "passed" in why


def test_self_check_refuses_non_tile_isas():
    ok, why = _core.amx_self_check("avx2")
    assert not ok and "not an available tile ISA" in why


def test_show_config_reports_amx(capsys):
    if "neon" in _core.compiled_isas():
        pytest.skip("an aarch64 build: no AMX line (tests/test_arm_config.py)")
    status = _core.amx_status()
    assert af._config.config()["amx"] == status
    af.show_config()
    assert status in capsys.readouterr().out
    if "amx" in _core.available_isas():
        assert status.startswith("available")
    else:
        assert status.startswith(("unavailable", "not compiled"))


def test_amx_emu_listed_but_never_the_default():
    isas = _core.available_isas()
    if "avx512_bf16" in isas and "amx_emu" in _core.compiled_isas():
        assert "amx_emu" in isas
    assert _default_isa() != "amx_emu"


def _default_isa(**env):
    out = subprocess.run(
        [sys.executable, "-c", "import attn_fast as af; print(af.get_isa())"],
        env={**os.environ, "ATTN_FAST_ISA": "", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_forcing_amx_without_it_is_a_clear_error():
    if "amx" in _core.available_isas():
        pytest.skip("this CPU runs amx")
    out = subprocess.run(
        [sys.executable, "-c", "import attn_fast"],
        env={**os.environ, "ATTN_FAST_ISA": "amx"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "cannot use ISA 'amx'" in out.stderr and "Available here" in out.stderr
    if "amx" in _core.compiled_isas():
        assert _core.amx_status().split(";")[0] in out.stderr  # the reason, from CPUID/XCR0/OS


def _status_in_subprocess(**env):
    code = "import attn_fast as af; print(af.get_isa()); print(af._core.amx_status())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "ATTN_FAST_ISA": "", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    isa, status = out.stdout.strip().split("\n", 1)
    return isa, status


def test_default_choice_takes_a_tile_isa_that_passes_its_self_check():
    """The default-ISA choice with amx_emu standing in for amx (ATTN_FAST_AMX_CANDIDATE):
    the self-check runs, passes, the tile ISA becomes the default and show_config says so."""
    if "amx_emu" not in _core.available_isas():
        pytest.skip("amx_emu cannot run here (no AVX512-BF16)")
    isa, status = _status_in_subprocess(ATTN_FAST_AMX_CANDIDATE="amx_emu")
    assert isa == "amx_emu", status
    assert "stands in for amx" in status and "self-check passed" in status


def test_default_choice_falls_back_when_the_self_check_fails():
    """A tile kernel that gives a wrong answer (ATTN_FAST_AMX_SELFCHECK=corrupt puts one
    output off by 1) is not chosen: the default falls back and show_config says why."""
    if "amx_emu" not in _core.available_isas():
        pytest.skip("amx_emu cannot run here (no AVX512-BF16)")
    isa, status = _status_in_subprocess(
        ATTN_FAST_AMX_CANDIDATE="amx_emu", ATTN_FAST_AMX_SELFCHECK="corrupt"
    )
    assert isa in ("avx512", "avx512_bf16"), status
    assert "self-check FAILED" in status and "fell back" in status


def test_amx_is_the_default_where_it_runs():
    """On an AMX machine the default is amx after the self-check (or the status says why
    not); everywhere else this is the skip."""
    if "amx" not in _core.available_isas():
        pytest.skip(f"amx cannot run here: {_core.amx_status()}")
    default = _default_isa()
    status = subprocess.run(
        [
            sys.executable,
            "-c",
            "import attn_fast as af; af.get_isa(); print(af._core.amx_status())",
        ],
        env={**os.environ, "ATTN_FAST_ISA": ""},
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "self-check passed" in status, status
    assert default == "amx", status


def test_set_isa_names():
    assert af._config.ISA_NAMES == (
        "scalar",
        "avx2",
        "avx512",
        "avx512_bf16",
        "amx",
        "amx_emu",
        "neon",
        "neon_bf16",
    )
    with pytest.raises(ValueError, match="amx_emu"):
        af.set_isa("amx-bf16")
