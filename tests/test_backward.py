"""The fused backward (scaled_dot_product_attention_backward, varlen) against
the float64 textbook backward of tests/oracle.py, which is itself checked
against finite differences of the forward oracle."""

from __future__ import annotations

import numpy as np
import oracle
import pytest
from helpers import needs_rlimit_as, poisoned, qkv, randn, random_bias, random_mask, run_json

import attn_fast as af
from attn_fast import _core, masks
from attn_fast import reference as ref

TOL = {np.float32: dict(rtol=2e-4, atol=2e-5), np.float64: dict(rtol=1e-9, atol=1e-11)}


def _inputs(rng, B, Hq, Hkv, Lq, Lk, d, dv, dtype):
    q, k, v = qkv(rng, B, Hq, Hkv, Lq, Lk, d, dv, dtype)
    return q, k, v, randn(rng, (B, Hq, Lq, dv), dtype)


def _run(q, k, v, do, **kw):
    """Forward with return_lse, then the backward with the same arguments."""
    o, lse = af.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    return af.scaled_dot_product_attention_backward(do, q, k, v, o, lse, **kw)


def _close(got, want, dtype, names=("dq", "dk", "dv", "dsinks")):
    # fp32: the kernel's exp and products round; compare relative to the gradient's size
    for name, g in zip(names, got):
        w = want[name]
        assert np.all(np.isfinite(g)), name
        t = TOL[np.dtype(dtype).type]
        scale = max(1.0, float(np.abs(w).max(initial=0.0)))
        np.testing.assert_allclose(g, w, rtol=t["rtol"], atol=t["atol"] * scale, err_msg=name)


# ---------------------------------------------------------------- the oracle itself


def _fd_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + eps
        fp = f()
        x[idx] = old - eps
        fm = f()
        x[idx] = old
        g[idx] = (fp - fm) / (2 * eps)
    return g


@pytest.mark.parametrize("variant", ["plain", "causal_gqa", "softcap_bias", "sinks_masked_row"])
def test_oracle_backward_matches_finite_differences(rng, variant):
    B, Hq, Hkv, Lq, Lk, d, dv = 1, 2, 1 if variant == "causal_gqa" else 2, 3, 4, 3, 2
    q, k, v, do = _inputs(rng, B, Hq, Hkv, Lq, Lk, d, dv, np.float64)
    kw = {}
    if variant == "causal_gqa":
        kw["mask"] = ref.causal_mask(Lq, Lk)
    if variant == "softcap_bias":
        kw["softcap"] = 1.5
        kw["bias"] = rng.standard_normal((Lq, Lk))
    sinks = None
    if variant == "sinks_masked_row":
        m = np.ones((Lq, Lk), bool)
        m[1] = False
        kw["mask"] = m
        sinks = rng.standard_normal(Hq)

    def loss():
        kk, vv = np.repeat(k, Hq // Hkv, axis=1), np.repeat(v, Hq // Hkv, axis=1)
        return float(np.sum(do * ref.sdpa(q, kk, vv, sinks=sinks, **kw)))

    got = oracle.sdpa_backward(q, k, v, do, sinks=sinks, **kw)
    for name, x in (("dq", q), ("dk", k), ("dv", v)):
        np.testing.assert_allclose(got[name], _fd_grad(loss, x), rtol=1e-6, atol=1e-8, err_msg=name)
    if sinks is not None:
        np.testing.assert_allclose(got["dsinks"], _fd_grad(loss, sinks), rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------- every mask kind


def _case(name, rng, B, Hq, Lq, Lk, dtype):
    """(api kwargs, oracle kwargs) for one mask / score option."""
    if name == "none":
        return {}, {}
    if name == "causal_bottom_right":
        return {"is_causal": True}, {"mask": ref.causal_mask(Lq, Lk)}
    if name == "causal_top_left":
        return {"attn_mask": masks.Causal("top_left")}, {
            "mask": ref.causal_mask(Lq, Lk, "top_left")
        }
    if name == "window":
        return {"window_size": (3, 2)}, {"mask": ref.window_mask(Lq, Lk, 3, 2)}
    if name == "causal_window":
        return {"is_causal": True, "window_size": (5, 0)}, {"mask": ref.window_mask(Lq, Lk, 5, 0)}
    if name == "padding":
        kv_lens = rng.integers(0, Lk + 1, B)
        q_lens = rng.integers(0, Lq + 1, B)
        kv_lens[0], q_lens[0] = Lk, Lq
        i = np.arange(Lq)[:, None]
        j = np.arange(Lk)[None, :]
        m = (i[None] < q_lens[:, None, None]) & (j[None] < kv_lens[:, None, None])
        return {"attn_mask": masks.Padding(kv_lens, q_lens)}, {"mask": m[:, None]}
    if name == "bool_mask":
        m = random_mask(rng, (B, 1, Lq, Lk), 0.6, dead_rows=[0])
        return {"attn_mask": m}, {"mask": m}
    if name == "additive_mask":
        bias = random_bias(rng, (B, Hq, Lq, Lk), 0.3, dtype)
        return {"attn_mask": bias}, {"bias": bias}
    if name == "block_sparse":
        bq, bk = 4, 8
        lay = rng.random((Hq, -(-Lq // bq), -(-Lk // bk))) < 0.5
        dense = np.repeat(np.repeat(lay, bq, axis=1), bk, axis=2)[:, :Lq, :Lk]
        return {"attn_mask": masks.BlockSparse(lay, bq, bk)}, {"mask": dense[None]}
    if name == "softcap":
        return {"softcap": 2.0, "is_causal": True}, {
            "softcap": 2.0,
            "mask": ref.causal_mask(Lq, Lk),
        }
    if name == "alibi":
        slopes = rng.random(Hq).astype(dtype)
        dist = np.abs(np.arange(Lq)[:, None] + Lk - Lq - np.arange(Lk)[None, :])
        return {"alibi_slopes": slopes}, {"bias": -slopes.astype(np.float64)[:, None, None] * dist}
    if name == "sinks":
        sinks = rng.standard_normal(Hq).astype(dtype)
        return {"sinks": sinks, "is_causal": True}, {
            "sinks": sinks,
            "mask": ref.causal_mask(Lq, Lk),
        }
    raise AssertionError(name)


CASES = [
    "none",
    "causal_bottom_right",
    "causal_top_left",
    "window",
    "causal_window",
    "padding",
    "bool_mask",
    "additive_mask",
    "block_sparse",
    "softcap",
    "alibi",
    "sinks",
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_backward_matches_oracle(isa, rng, case, dtype):
    # GQA (4 query heads on 2 kv heads), Lq != Lk, dv != d, tails of every block size
    B, Hq, Hkv, Lq, Lk, d, dv = 2, 4, 2, 37, 71, 20, 12
    q, k, v, do = _inputs(rng, B, Hq, Hkv, Lq, Lk, d, dv, dtype)
    api, ora = _case(case, rng, B, Hq, Lq, Lk, dtype)
    got = _run(q, k, v, do, enable_gqa=True, **api)
    want = oracle.sdpa_backward(q, k, v, do, **ora)
    assert len(got) == (4 if case == "sinks" else 3)
    for g, x in zip(got, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    _close(got, want, dtype)


@pytest.mark.parametrize("case", ["none", "causal_bottom_right", "sinks"])
def test_backward_lq_longer_than_lk(isa, rng, case):
    B, Hq, Hkv, Lq, Lk, d, dv = 1, 2, 1, 50, 9, 8, 8
    q, k, v, do = _inputs(rng, B, Hq, Hkv, Lq, Lk, d, dv, np.float64)
    api, ora = _case(case, rng, B, Hq, Lq, Lk, np.float64)
    _close(
        _run(q, k, v, do, enable_gqa=True, **api),
        oracle.sdpa_backward(q, k, v, do, **ora),
        np.float64,
    )


@pytest.mark.parametrize("L", [1, 7, 129])
@pytest.mark.parametrize("d", [1, 5, 80])
def test_backward_odd_sizes(isa, rng, L, d):
    q, k, v, do = _inputs(rng, 1, 2, 2, L, L, d, d, np.float32)
    got = _run(q, k, v, do, is_causal=True)
    _close(got, oracle.sdpa_backward(q, k, v, do, mask=ref.causal_mask(L, L)), np.float32)


def test_backward_2d_and_3d_inputs(rng):
    q, k, v, do = _inputs(rng, 1, 1, 1, 9, 11, 4, 3, np.float64)
    want = oracle.sdpa_backward(q, k, v, do)
    for sl in (np.s_[0, 0], np.s_[0]):
        got = _run(q[sl], k[sl], v[sl], do[sl])
        for g, name in zip(got, ("dq", "dk", "dv")):
            np.testing.assert_allclose(g, want[name][sl], rtol=1e-10, atol=1e-12)


def test_backward_block_sizes_do_not_matter(isa, rng):
    q, k, v, do = _inputs(rng, 1, 2, 1, 100, 150, 16, 8, np.float64)
    want = oracle.sdpa_backward(q, k, v, do, mask=ref.causal_mask(100, 150))
    for bq, bk in [(1, 1), (7, 13), (64, 256), (4096, 4096)]:
        o, lse = af.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, return_lse=True
        )
        got = af.scaled_dot_product_attention_backward(
            do, q, k, v, o, lse, is_causal=True, enable_gqa=True, block_q=bq, block_k=bk
        )
        _close(got, want, np.float64)


@pytest.mark.parametrize("mode", ["causal", "window"])
def test_backward_bits_do_not_depend_on_block_q(isa, rng, mode):
    # Tiles the causal diagonal or a window's edges cut take ranged products that
    # skip the zero terms; every query-block height cuts the micro-tiles at other
    # rows, and the gradients must be the same bits (and the oracle's values).
    Lq, Lk = 61, 75
    q, k, v, do = _inputs(rng, 1, 2, 1, Lq, Lk, 24, 16, np.float32)
    if mode == "causal":
        api, mask = {"is_causal": True}, ref.causal_mask(Lq, Lk)
    else:
        api, mask = {"window_size": (9, 4)}, ref.window_mask(Lq, Lk, 9, 4)
    want = oracle.sdpa_backward(q, k, v, do, mask=mask)
    o, lse = af.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **api)
    first = None
    for bq in (1, 5, 6, 7, 13, 64):
        got = af.scaled_dot_product_attention_backward(
            do, q, k, v, o, lse, enable_gqa=True, block_q=bq, block_k=24, **api
        )
        _close(got, want, np.float32)
        if first is None:
            first = got
        for g, f in zip(got, first):
            assert np.array_equal(g.view(np.uint32), f.view(np.uint32)), bq


def test_fully_masked_rows_get_zero_gradient(isa, rng):
    B, H, Lq, Lk, d = 2, 2, 20, 30, 8
    q, k, v, do = _inputs(rng, B, H, H, Lq, Lk, d, d, np.float32)
    m = random_mask(rng, (B, H, Lq, Lk), 0.5, dead_rows=[0, 7, 19])
    got = _run(q, k, v, do, attn_mask=m)
    assert all(np.all(np.isfinite(g)) for g in got)
    assert np.all(got[0][:, :, [0, 7, 19]] == 0)
    _close(got, oracle.sdpa_backward(q, k, v, do, mask=m), np.float32)
    # keys nobody sees get zero dk, dv; padding rows zero dq
    got = _run(q, k, v, do, attn_mask=masks.Padding([Lk, 5], [Lq, 3]))
    assert np.all(got[1][1, :, 5:] == 0) and np.all(got[2][1, :, 5:] == 0)
    assert np.all(got[0][1, :, 3:] == 0)
    # nothing visible at all (kv_lens 0): all zero
    got = _run(q, k, v, do, attn_mask=masks.Padding([0, 0]))
    assert all(np.all(g == 0) for g in got)


def test_nan_in_masked_keys_does_not_leak(isa, rng):
    B, H, Lq, Lk, d = 1, 2, 16, 24, 8
    q, k, v, do = _inputs(rng, B, H, H, Lq, Lk, d, d, np.float64)
    m = np.ones((B, H, Lq, Lk), bool)
    m[..., 5] = False
    want = oracle.sdpa_backward(q, k, v, do, mask=m)
    k[:, :, 5] = np.nan
    v[:, :, 5] = np.inf
    got = _run(q, k, v, do, attn_mask=m)
    assert np.all(got[1][:, :, 5] == 0) and np.all(got[2][:, :, 5] == 0)
    _close(got, want, np.float64)


def test_poisoned_gradient_buffers_are_fully_written(isa, rng):
    B, H, Lq, Lk, d, dv = 2, 2, 13, 17, 6, 5
    q, k, v, do = _inputs(rng, B, H, H, Lq, Lk, d, dv, np.float32)
    kv_lens, q_lens = np.array([17, 9]), np.array([13, 4])
    o, lse = af.scaled_dot_product_attention(
        q, k, v, attn_mask=masks.Padding(kv_lens, q_lens), return_lse=True
    )
    dq, dk, dv_ = poisoned(q.shape, q.dtype), poisoned(k.shape, q.dtype), poisoned(v.shape, q.dtype)
    _core.backward(
        do,
        q,
        k,
        v,
        o,
        lse,
        dq,
        dk,
        dv_,
        scale=d**-0.5,
        q_lens=kv_lens * 0 + q_lens,
        kv_lens=kv_lens,
    )
    i, j = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
    m = (i[None] < q_lens[:, None, None]) & (j[None] < kv_lens[:, None, None])
    _close((dq, dk, dv_), oracle.sdpa_backward(q, k, v, do, mask=m[:, None]), np.float32)


def test_bit_identical_for_any_thread_count(isa, rng):
    # few (sequence, kv head) pairs: keys split into chunks; many pairs: no split
    for B, Hq, Hkv in [(1, 2, 1), (2, 16, 8)]:
        q, k, v, do = _inputs(rng, B, Hq, Hkv, 200, 300, 32, 16, np.float32)
        old = af.get_num_threads()
        res = []
        try:
            for n in (1, 2, 3):
                af.set_num_threads(n)
                res.append(_run(q, k, v, do, is_causal=True, enable_gqa=True))
        finally:
            af.set_num_threads(old)
        for other in res[1:]:
            for a, b in zip(res[0], other):
                assert a.tobytes() == b.tobytes()


def test_non_contiguous_inputs(isa, rng):
    B, H, L, d = 2, 3, 33, 16
    base = rng.standard_normal((4, B, L, H, d))  # (B, L, H, d) views, transposed to (B, H, L, d)
    q, k, v, do = (base[i].transpose(0, 2, 1, 3) for i in range(4))
    o, lse = af.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    o_t = np.ascontiguousarray(o.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # strided out
    got = af.scaled_dot_product_attention_backward(do, q, k, v, o_t, lse, is_causal=True)
    _close(got, oracle.sdpa_backward(q, k, v, do, mask=ref.causal_mask(L, L)), np.float64)
    assert not q.flags.c_contiguous and got[0].flags.c_contiguous


def test_ring_attention_key_blocks_sum_to_the_full_gradient(isa, rng):
    B, H, Lq, Lk, d = 1, 2, 24, 40, 8
    q, k, v, do = _inputs(rng, B, H, H, Lq, Lk, d, d, np.float64)
    m = random_mask(rng, (B, H, Lq, Lk), 0.7)
    o, lse = af.scaled_dot_product_attention(q, k, v, attn_mask=m, return_lse=True)
    full = af.scaled_dot_product_attention_backward(do, q, k, v, o, lse, attn_mask=m)
    dq = np.zeros_like(q)
    dks, dvs = [], []
    for sl in (slice(0, 15), slice(15, 40)):
        part = af.scaled_dot_product_attention_backward(
            do, q, k[:, :, sl], v[:, :, sl], o, lse, attn_mask=m[..., sl]
        )
        dq += part[0]
        dks.append(part[1])
        dvs.append(part[2])
    np.testing.assert_allclose(dq, full[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.concatenate(dks, axis=2), full[1], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.concatenate(dvs, axis=2), full[2], rtol=1e-10, atol=1e-12)


def test_torch_in_torch_out(rng):
    torch = pytest.importorskip("torch")
    q, k, v, do = (torch.from_numpy(x) for x in _inputs(rng, 1, 2, 2, 5, 6, 4, 4, np.float64))
    o, lse = af.scaled_dot_product_attention(q, k, v, return_lse=True)
    got = af.scaled_dot_product_attention_backward(do, q, k, v, o, lse)
    assert all(isinstance(g, torch.Tensor) for g in got)


def test_argument_errors(rng):
    q, k, v, do = _inputs(rng, 1, 2, 2, 5, 6, 4, 3, np.float64)
    o, lse = af.scaled_dot_product_attention(q, k, v, return_lse=True)
    bwd = af.scaled_dot_product_attention_backward
    with pytest.raises(ValueError, match=r"dout has shape \(1, 2, 4, 3\)"):
        bwd(do[:, :, :4], q, k, v, o, lse)
    with pytest.raises(ValueError, match=r"lse has shape \(1, 2, 5, 1\)"):
        bwd(do, q, k, v, o, lse[..., None])
    with pytest.raises(ValueError, match=r"out has shape \(1, 2, 5, 4\)"):
        bwd(do, q, k, v, np.zeros((1, 2, 5, 4)), lse)
    with pytest.raises(TypeError, match="mixed dtypes"):
        bwd(do.astype(np.float32), q, k, v, o, lse)
    with pytest.raises(ValueError, match="enable_gqa"):
        bwd(do, q, k[:, :1], v[:, :1], o, lse)
    with pytest.raises(ValueError, match="sinks must have one value per query head"):
        bwd(do, q, k, v, o, lse, sinks=np.zeros(3))
    with pytest.raises(TypeError, match="v must be an array"):
        bwd(do, q, k, None, o, lse)


# ---------------------------------------------------------------- varlen


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"causal": True},
        {"causal": True, "window_size": (4, 0), "softcap": 3.0},
        {"sinks": True, "causal": True},
        {"causal": True, "block_q": 4, "block_k": 8},
    ],
)  # small blocks: keys in chunks
def test_varlen_backward_matches_per_sequence_oracle(isa, rng, opts):
    Hq, Hkv, d, dv = 4, 2, 8, 6
    lq, lk = [5, 0, 17, 1], [9, 3, 17, 0]
    cu_q, cu_k = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    q = rng.standard_normal((cu_q[-1], Hq, d))
    k = rng.standard_normal((cu_k[-1], Hkv, d))
    v = rng.standard_normal((cu_k[-1], Hkv, dv))
    do = rng.standard_normal((cu_q[-1], Hq, dv))
    kw = dict(opts)
    sinks = rng.standard_normal(Hq) if kw.pop("sinks", False) else None
    o, lse = af.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, sinks=sinks, **kw)
    got = af.varlen_attention_backward(do, q, k, v, o, lse, cu_q, cu_k, sinks=sinks, **kw)
    dsinks = np.zeros(Hq)
    for s in range(len(lq)):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        t = lambda x: x.transpose(1, 0, 2)  # noqa: E731
        mask = None
        if kw.get("causal"):
            mask = ref.causal_mask(lq[s], lk[s])
        if "window_size" in kw:
            mask = mask & ref.window_mask(lq[s], lk[s], *kw["window_size"])
        want = oracle.sdpa_backward(
            t(q[qs]),
            t(k[ks]),
            t(v[ks]),
            t(do[qs]),
            mask=mask,
            softcap=kw.get("softcap"),
            sinks=sinks,
        )
        for g, name, sl in zip(got, ("dq", "dk", "dv"), (qs, ks, ks)):
            np.testing.assert_allclose(g[sl], t(want[name]), rtol=1e-9, atol=1e-11, err_msg=name)
        if sinks is not None:
            dsinks += want["dsinks"]
    if sinks is not None:
        np.testing.assert_allclose(got[3], dsinks, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------- resources


def test_backward_no_leak_over_many_calls():
    report = run_json("""
        import ctypes, gc, json
        import numpy as np
        import attn_fast as af

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
            ).split()]
        try:
            _mi = ctypes.CDLL(None).mallinfo2
            _mi.restype = MallInfo2
            heap = lambda: _mi().uordblks + _mi().hblkhd
        except (OSError, AttributeError):
            heap = lambda: 0
        rng = np.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((1, 2, 16, 8)).astype(np.float32) for _ in range(4))
        m = rng.random((16, 16)) < 0.7
        o, lse = af.scaled_dot_product_attention(
            q, k, v, attn_mask=m, sinks=[0.5, -1.0], return_lse=True
        )
        qp = rng.standard_normal((16, 2, 8)).astype(np.float32)
        cu = np.array([0, 5, 16])
        op, lp = af.varlen_attention(qp, qp, qp, cu, cu, causal=True, return_lse=True)
        calls = {
            "backward": lambda: af.scaled_dot_product_attention_backward(
                do, q, k, v, o, lse, attn_mask=m, sinks=[0.5, -1.0]
            ),
            "varlen_backward": lambda: af.varlen_attention_backward(
                qp, qp, qp, qp, op, lp, cu, cu, causal=True
            ),
        }
        af.set_num_threads(1)
        for f in calls.values():
            for _ in range(500):
                f()
        report = {}
        for name, f in calls.items():
            gc.collect()
            before = heap()
            for _ in range(5000):
                f()
            gc.collect()
            report[name] = (heap() - before) / 1024
        print(json.dumps(report))
    """)
    # 64 KiB over 5000 calls: ~13 bytes per call
    assert all(kib <= 64 for kib in report.values()), report


def test_backward_peak_memory_is_linear_in_L():
    r = run_json("""
        import json, resource
        import numpy as np
        import attn_fast as af
        L, d = 32768, 64
        rng = np.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((1, 1, L, d), dtype=np.float32) for _ in range(4))
        o, lse = af.scaled_dot_product_attention(
            q, k, v, is_causal=True, window_size=(255, 0), return_lse=True
        )
        af.scaled_dot_product_attention_backward(do[..., :8, :], q[..., :8, :], k, v, o[..., :8, :],
                                                 lse[..., :8])  # warm up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        g = af.scaled_dot_product_attention_backward(
            do, q, k, v, o, lse, is_causal=True, window_size=(255, 0)
        )
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(dict(
            extra_kib=after - before, grad_kib=3 * q.nbytes // 1024, dq_kib=q.nbytes // 1024,
            finite=all(bool(np.isfinite(x).all()) for x in g), threads=af.get_num_threads(),
        )))
    """)
    assert r["finite"]
    # dq, dk, dv themselves, at most 7 key-chunk dQ buffers (kMaxSplit - 1), per-thread tiles;
    # the textbook's L x L scores alone would be 4 GiB.
    assert r["extra_kib"] < r["grad_kib"] + 7 * r["dq_kib"] + r["threads"] * 4096 + 8192, r


ALLOC_FAIL_BWD = """
import resource, numpy as np, attn_fast as af
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
one = np.{dt}(0.5)
# d = 2^28: dq and dk take 2 GiB in float32 (float16: 1 GiB, and dq's fp32 accumulator 1 GiB
# more); the kernel's scratch (K, K^T, the dK accumulator, a Q block, ...: at least five
# d-sized fp32 rows of a key block) cannot fit in what is left.
q = np.broadcast_to(one, (1, 1, 1, 2**28))
v = np.ones((1, 1, 1, 4), np.{dt})
o, lse = np.zeros((1, 1, 1, 4), np.{dt}), np.zeros((1, 1, 1), np.float32)
try:
    af.scaled_dot_product_attention_backward(o, q, q, v, o, lse)
    print("no error")
except MemoryError:
    print("MemoryError")
"""


@needs_rlimit_as
@pytest.mark.skipif(
    "libasan" in __import__("os").environ.get("LD_PRELOAD", ""),
    reason="ASan reserves more address space than the limit",
)
@pytest.mark.parametrize("dt", ["float32", "float16"])
def test_backward_allocation_failure_is_memory_error(dt):
    import subprocess
    import sys

    code = ALLOC_FAIL_BWD.replace("{dt}", dt)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["MemoryError"], r.stdout


def test_backward_from_python_threads(rng):
    # The binding releases the GIL: concurrent calls from Python threads give each caller its own
    # result.
    from concurrent.futures import ThreadPoolExecutor

    inputs = [_inputs(rng, 1, 2, 1, 64, 80, 16, 8, np.float64) for _ in range(4)]

    def one(x):
        q, k, v, do = x
        return _run(q, k, v, do, is_causal=True, enable_gqa=True)

    serial = [one(x) for x in inputs]
    with ThreadPoolExecutor(4) as ex:
        threaded = list(ex.map(one, inputs))
    for a, b in zip(serial, threaded):
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()


def test_permuting_keys_permutes_their_gradients(isa, rng):
    q, k, v, do = _inputs(rng, 1, 2, 2, 20, 33, 8, 8, np.float64)
    perm = rng.permutation(33)
    a = _run(q, k, v, do)
    b = _run(q, k[:, :, perm], v[:, :, perm], do)
    np.testing.assert_allclose(b[0], a[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b[1], a[1][:, :, perm], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b[2], a[2][:, :, perm], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("Lq, Lk, d, dv", [(0, 5, 4, 4), (5, 0, 4, 4), (5, 6, 4, 0), (0, 0, 3, 3)])
def test_empty_shapes_give_zero_gradients(rng, Lq, Lk, d, dv):
    q, k, v, do = _inputs(rng, 1, 2, 2, Lq, Lk, d, dv, np.float64)
    got = _run(q, k, v, do, is_causal=True)
    for g, x in zip(got, (q, k, v)):
        assert g.shape == x.shape and np.all(g == 0)


def test_read_only_inputs(rng):
    q, k, v, do = _inputs(rng, 1, 2, 2, 9, 12, 4, 4, np.float64)
    o, lse = af.scaled_dot_product_attention(q, k, v, return_lse=True)
    want = af.scaled_dot_product_attention_backward(do, q, k, v, o, lse)
    for x in (q, k, v, do, o, lse):
        x.flags.writeable = False
    got = af.scaled_dot_product_attention_backward(do, q, k, v, o, lse)
    for a, b in zip(got, want):
        assert a.tobytes() == b.tobytes()
