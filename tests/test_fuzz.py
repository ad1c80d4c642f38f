"""Hypothesis fuzzing of scaled_dot_product_attention against the float64 oracle.

Each example draws shapes (zero sizes included), a storage layout per array
(axis permutation, steps of +-1/2, broadcast views, Fortran order, big-endian,
misaligned), the score options (causal, window, softcap, ALiBi, sinks, dense
boolean or additive masks of any broadcastable shape, scale), an output
buffer, backend, tile sizes and the ISA; then either compares with the oracle
or, when one argument was deliberately spoiled, expects the documented error.

CI runs a few dozen examples; ATTN_FAST_FUZZ_EXAMPLES=20000 runs a long fuzz.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import ISAS
from helpers import assert_attention, random_bias, random_mask

import attn_fast as af
from attn_fast import reference as ref

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

N_EXAMPLES = int(os.environ.get("ATTN_FAST_FUZZ_EXAMPLES", "60"))

SPOILERS = ["none"] * 6 + [
    "head_dim",
    "dtype",
    "mixed",
    "mask_shape",
    "gqa_flag",
    "out_shape",
    "block",
    "ndim",
]


def lay_out(data, x, name, allow_broadcast_axes=()):
    """Return an array equal to x stored in a drawn layout (a view, usually)."""
    kind = data.draw(
        st.sampled_from(["c", "perm", "steps", "fortran", "broadcast", "bigendian", "misaligned"]),
        label=f"{name} layout",
    )
    if kind == "perm":
        perm = data.draw(st.permutations(range(x.ndim)), label=f"{name} perm")
        store = np.empty([x.shape[p] for p in perm], x.dtype)
        view = store.transpose(np.argsort(perm))
        view[...] = x
        return view
    if kind == "steps":
        steps = [
            data.draw(st.sampled_from([1, 2, -1, -2]), label=f"{name} step") for _ in range(x.ndim)
        ]
        big = np.full([n * abs(s) + 1 for n, s in zip(x.shape, steps)], np.nan, x.dtype)
        view = big[tuple(slice(None, None, s) for s in steps)]
        view = view[tuple(slice(0, n) for n in x.shape)]
        view[...] = x
        return view
    if kind == "fortran":
        return np.asfortranarray(x)
    if kind == "broadcast" and allow_broadcast_axes and x.size:
        ax = data.draw(st.sampled_from(allow_broadcast_axes), label=f"{name} bcast axis")
        if ax < x.ndim:
            # Make x constant along `ax` and hand over a zero-stride view.
            base = np.take(x, [0], axis=ax)
            x[...] = base
            return np.broadcast_to(base, x.shape)
        return x
    if kind == "bigendian":
        return x.astype(x.dtype.newbyteorder(">"))
    if kind == "misaligned":
        raw = np.empty(x.nbytes + 1, np.uint8)
        y = raw[1:].view(x.dtype).reshape(x.shape)
        y[...] = x
        return y
    return x


@st.composite
def problems(draw):
    data = draw(st.data())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    dtype = draw(st.sampled_from([np.float32, np.float64]), label="dtype")
    ndim = draw(st.sampled_from([2, 3, 4]), label="ndim")
    B = draw(st.integers(0, 3), label="B") if ndim == 4 else 1
    Hkv = draw(st.integers(1, 3), label="Hkv") if ndim >= 3 else 1
    group = draw(st.integers(1, 3), label="group") if ndim >= 3 else 1
    Hq = Hkv * group
    Lq = draw(st.integers(0, 70), label="Lq")
    Lk = draw(st.integers(0, 70), label="Lk")
    d = draw(st.integers(1, 20), label="d")
    dv = draw(st.integers(0, 20), label="dv")
    lead_q = (B, Hq)[4 - ndim :] if ndim > 2 else ()
    lead_k = (B, Hkv)[4 - ndim :] if ndim > 2 else ()
    q = rng.standard_normal(lead_q + (Lq, d)).astype(dtype)
    k = rng.standard_normal(lead_k + (Lk, d)).astype(dtype)
    v = rng.standard_normal(lead_k + (Lk, dv)).astype(dtype)
    # Storage layouts; k and v may be broadcast over batch, heads or length.
    bc = tuple(range(ndim - 1))
    q = lay_out(data, q, "q", bc)
    k = lay_out(data, k, "k", bc)
    v = lay_out(data, v, "v", bc)

    kw = {"is_causal": draw(st.booleans(), label="causal"), "enable_gqa": group > 1}
    if draw(st.booleans(), label="has window"):
        side = st.one_of(st.none(), st.integers(0, 80))
        kw["window_size"] = (draw(side, label="left"), draw(side, label="right"))
    if draw(st.integers(0, 3), label="softcap?") == 0:
        kw["softcap"] = draw(st.floats(0.5, 30), label="softcap")
    if draw(st.integers(0, 3), label="alibi?") == 0:
        kw["alibi_slopes"] = rng.uniform(0, 0.5, Hq)
    if draw(st.integers(0, 3), label="sinks?") == 0:
        kw["sinks"] = rng.standard_normal(Hq) * 2
    if draw(st.booleans(), label="scale?"):
        kw["scale"] = draw(st.floats(-2, 2), label="scale")
    mask_kind = draw(st.sampled_from(["none", "none", "bool", "float"]), label="mask")
    if mask_kind != "none":
        full = (B, Hq, Lq, Lk)
        mshape = tuple(n if draw(st.booleans(), label="mask axis full") else 1 for n in full)
        mshape = mshape[4 - draw(st.integers(2, 4), label="mask ndim") :]
        if mask_kind == "bool":
            kw["attn_mask"] = random_mask(rng, mshape, 0.7)
        else:
            bias_dtype = draw(st.sampled_from([np.float32, np.float64]), label="bias dtype")
            kw["attn_mask"] = random_bias(rng, mshape, 0.2, bias_dtype)
    kw["return_lse"] = draw(st.booleans(), label="lse")
    kw["backend"] = draw(st.sampled_from(["fused", "fused", "reference"]), label="backend")
    kw["block_q"] = draw(st.sampled_from([0, 1, 5, 48, 200]), label="block_q")
    kw["block_k"] = draw(st.sampled_from([0, 1, 7, 64, 300]), label="block_k")
    out_shape = q.shape[:-1] + (dv,)
    if draw(st.booleans(), label="out?"):
        big = np.full(out_shape[:-1] + (2 * dv + 1,), np.nan, dtype)
        kw["out"] = big[..., 1::2] if draw(st.booleans(), label="out strided") else big[..., :dv]
    isa = draw(st.sampled_from(ISAS), label="isa")
    spoil = draw(st.sampled_from(SPOILERS), label="spoil")
    return q, k, v, kw, isa, spoil, (B, Hq, Lq, Lk)


def spoiled(q, k, v, kw, spoil):
    """Apply one deliberate error; return the exception type it must raise."""
    if spoil == "head_dim":
        return q, np.concatenate([k, k[..., :1]], axis=-1), v, kw, ValueError
    if spoil == "dtype":
        return q, k.astype(np.float16), v, kw, TypeError
    if spoil == "mixed":
        other = np.float64 if q.dtype.itemsize == 4 else np.float32
        return q, k, v.astype(other), kw, TypeError
    if spoil == "mask_shape":
        kw = dict(kw, attn_mask=np.ones(q.shape[:-1] + (k.shape[-2] + 2,), bool))
        return q, k, v, kw, ValueError
    if spoil == "gqa_flag" and kw["enable_gqa"]:
        return q, k, v, dict(kw, enable_gqa=False), ValueError
    if spoil == "out_shape":
        return (
            q,
            k,
            v,
            dict(kw, out=np.empty(q.shape[:-1] + (v.shape[-1] + 1,), q.dtype)),
            ValueError,
        )
    if spoil == "block":
        return q, k, v, dict(kw, block_k=-3), ValueError
    if spoil == "ndim":
        return q[..., None], k, v, kw, ValueError
    return q, k, v, kw, None


def oracle(q, k, v, kw, dims):
    B, Hq, Lq, Lk = dims
    q4, k4, v4 = (
        np.asarray(x, np.float64).reshape((1,) * (4 - x.ndim) + x.shape) for x in (q, k, v)
    )
    vis = np.ones((Lq, Lk), bool)
    if kw["is_causal"]:
        vis &= ref.causal_mask(Lq, Lk)
    if "window_size" in kw:
        vis &= ref.window_mask(Lq, Lk, *kw["window_size"])
    mask, bias = vis[None, None], np.zeros((1, 1, Lq, Lk))
    m = kw.get("attn_mask")
    if m is not None:
        m4 = m.reshape((1,) * (4 - m.ndim) + m.shape)
        if m.dtype == np.bool_:
            mask = mask & m4
        else:
            bias = bias + m4.astype(q.dtype).astype(
                np.float64
            )  # the kernel adds the bias in q's dtype
    if "alibi_slopes" in kw:
        i = np.arange(Lq)[:, None] + (Lk - Lq)
        j = np.arange(Lk)[None, :]
        slopes = np.asarray(kw["alibi_slopes"]).astype(q.dtype).astype(np.float64)
        bias = bias - slopes[None, :, None, None] * np.abs(i - j)
    sinks = kw.get("sinks")
    if sinks is not None:
        sinks = np.asarray(sinks).astype(q.dtype).astype(np.float64)
    return ref.sdpa(
        q4,
        k4,
        v4,
        mask=mask,
        bias=bias,
        scale=kw.get("scale"),
        softcap=kw.get("softcap"),
        sinks=sinks,
        return_lse=True,
    )


@settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(problems())
def test_fuzz_against_oracle(problem):
    q, k, v, kw, isa, spoil, dims = problem
    q, k, v, kw, error = spoiled(q, k, v, kw, spoil)
    old = af.get_isa()
    af.set_isa(isa)
    try:
        if error is not None:
            with pytest.raises(error):
                af.scaled_dot_product_attention(q, k, v, **kw)
            return
        res = af.scaled_dot_product_attention(q, k, v, **kw)
    finally:
        af.set_isa(old)
    o, lse = res if kw["return_lse"] else (res, None)
    if "out" in kw:
        assert o is kw["out"]
    assert o.dtype == q.dtype.newbyteorder("=") and o.shape == q.shape[:-1] + (v.shape[-1],)
    O, LSE = oracle(q, k, v, kw, dims)
    t = dict(rtol=3e-4, atol=3e-5) if q.dtype.itemsize == 4 else dict(rtol=1e-9, atol=1e-10)
    assert_attention(
        o.reshape(O.shape), None if lse is None else lse.reshape(LSE.shape), O, LSE, **t
    )


# ---------------------------------------------------------------- KVCache


@st.composite
def cache_programs(draw):
    """A cache configuration and a random sequence of append / attend / truncate / bad calls."""
    cfg = dict(
        B=draw(st.integers(1, 3)),
        Hkv=draw(st.integers(1, 2)),
        G=draw(st.integers(1, 3)),
        d=draw(st.sampled_from([1, 3, 8])),
        dv=draw(st.sampled_from([1, 4])),
        dtype=draw(st.sampled_from([np.float32, np.float64])),
        window=draw(st.one_of(st.none(), st.integers(1, 6))),
        capacity=draw(st.integers(1, 8)),
        growable=draw(st.booleans()),
    )
    if cfg["window"] is not None:
        cfg["ring"] = draw(st.one_of(st.none(), st.integers(cfg["window"], 2 * cfg["window"] + 2)))
    ops = []
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["append"] * 3 + ["attend"] * 3 + ["truncate", "bad"]))
        if kind == "append":
            L = draw(st.integers(0, 6))
            lens = draw(
                st.one_of(
                    st.none(), st.lists(st.integers(0, L), min_size=cfg["B"], max_size=cfg["B"])
                )
            )
            ops.append(("append", L, lens))
        elif kind == "attend":
            ops.append(
                (
                    "attend",
                    draw(st.integers(1, 5)),
                    draw(st.booleans()),
                    draw(st.integers(0, 2**31)),
                )
            )
        elif kind == "truncate":
            ops.append(
                (
                    "truncate",
                    draw(st.lists(st.integers(0, 4), min_size=cfg["B"], max_size=cfg["B"])),
                )
            )
        else:
            ops.append(
                ("bad", draw(st.sampled_from(["dtype", "heads", "lengths", "scale", "q_dim"])))
            )
    return cfg, ops, draw(st.integers(0, 2**31))


def _cache_attend_oracle(q, hist_k, hist_v, pos, ql, window, causal):
    """Rows i < ql[b] of sequence b sit at positions pos[b] - ql[b] + i;
    the rest get zeros / -inf."""
    B, Hq, Lq, _ = q.shape
    O = np.zeros((B, Hq, Lq, hist_v[0].shape[-1]))
    LSE = np.full((B, Hq, Lq), -np.inf)
    for b in range(B):
        n = ql[b]
        if n == 0:
            continue
        p = pos[b] - n + np.arange(n)[:, None]
        j = np.arange(pos[b])[None, :]
        vis = j <= p if causal else np.ones_like(j <= p)
        if window is not None:
            vis = vis & (j >= p - window + 1)
        O[b, :, :n], LSE[b, :, :n] = ref.sdpa(
            q[b, :, :n], hist_k[b][:, : pos[b]], hist_v[b][:, : pos[b]], mask=vis, return_lse=True
        )
    return O, LSE


@settings(
    max_examples=max(1, N_EXAMPLES // 2), deadline=None, suppress_health_check=list(HealthCheck)
)
@given(cache_programs())
def test_fuzz_kv_cache_against_oracle(program):
    """Random append / attend / truncate sequences against per-sequence histories
    (concatenated arrays): lengths, positions, stored keys and attention all
    match, and every call that raises leaves the cache unchanged."""
    cfg, ops, seed = program
    rng = np.random.default_rng(seed)
    B, Hkv, d, dv, dt, w = cfg["B"], cfg["Hkv"], cfg["d"], cfg["dv"], cfg["dtype"], cfg["window"]
    Hq = Hkv * cfg["G"]
    kw = dict(capacity=cfg["capacity"], v_head_dim=dv, dtype=dt, window=w, growable=cfg["growable"])
    if w is not None and cfg.get("ring") is not None:
        kw["ring"] = cfg["ring"]
    cache = af.KVCache(B, Hkv, d, **kw)
    hist_k = [np.zeros((Hkv, 0, d)) for _ in range(B)]  # every key ever appended, by position
    hist_v = [np.zeros((Hkv, 0, dv)) for _ in range(B)]
    pos = np.zeros(B, np.int64)  # the model's positions and stored lengths
    n = np.zeros(B, np.int64)
    t = dict(rtol=3e-4, atol=3e-5) if dt == np.float32 else dict(rtol=1e-9, atol=1e-10)

    def check_state():
        np.testing.assert_array_equal(cache.positions, pos)
        np.testing.assert_array_equal(cache.lengths, n)
        assert len(cache) == int(pos.max())
        for b in range(B):
            np.testing.assert_array_equal(
                cache.keys(b), hist_k[b][:, pos[b] - n[b] : pos[b]].astype(dt)
            )
            np.testing.assert_array_equal(
                cache.values(b), hist_v[b][:, pos[b] - n[b] : pos[b]].astype(dt)
            )

    for op in ops:
        if op[0] == "append":
            _, L, lens = op
            k = rng.standard_normal((B, Hkv, L, d)).astype(dt)
            v = rng.standard_normal((B, Hkv, L, dv)).astype(dt)
            new = np.full(B, L) if lens is None else np.array(lens)
            room = cache.capacity - (w or 1) + 1 if w is not None else None
            fits = cache.growable or (
                int((n + new).max()) <= cache.capacity if w is None else int(new.max()) <= room
            )
            if not fits:
                with pytest.raises(ValueError):
                    cache.append(k, v, lengths=lens)
            else:
                cache.append(k, v, lengths=lens)
                for b in range(B):
                    hist_k[b] = np.concatenate([hist_k[b], k[b, :, : new[b]]], axis=1)
                    hist_v[b] = np.concatenate([hist_v[b], v[b, :, : new[b]]], axis=1)
                pos = pos + new
                n = n + new if w is None else np.minimum(cache.capacity, n + new)
        elif op[0] == "attend":
            _, Lq, causal, qseed = op
            if w is not None and not causal:
                # a windowed non-causal attend is bounded by the stored keys: not modelled here
                causal = True
            qrng = np.random.default_rng(qseed)
            ql = np.minimum(qrng.integers(0, Lq + 1, B), n if causal else Lq)
            q = qrng.standard_normal((B, Hq, Lq, d)).astype(dt)
            if w is not None and ((ql > 0) & (np.maximum(0, pos - ql - (w - 1)) < pos - n)).any():
                with pytest.raises(
                    ValueError, match="reach back"
                ):  # the ring dropped keys these rows see
                    cache.attend(q, q_lens=ql, causal=causal)
                check_state()
                continue
            o, lse = cache.attend(q, q_lens=ql, causal=causal, return_lse=True)
            O, LSE = _cache_attend_oracle(q, hist_k, hist_v, pos, ql, w, causal)
            assert_attention(o, lse, O, LSE, **t)
        elif op[0] == "truncate":
            target = np.maximum(pos - np.array(op[1]), 0)
            keep = n - (pos - target)
            ok = (keep >= 0).all() and (w is None or (keep >= np.minimum(target, w - 1)).all())
            if not ok:
                with pytest.raises(ValueError):
                    cache.truncate(target)
            else:
                cache.truncate(target)
                pos, n = target, keep
                hist_k = [h[:, :p] for h, p in zip(hist_k, pos)]
                hist_v = [h[:, :p] for h, p in zip(hist_v, pos)]
        else:
            kind = op[1]
            k1 = rng.standard_normal((B, Hkv, 1, d)).astype(dt)
            v1 = rng.standard_normal((B, Hkv, 1, dv)).astype(dt)
            with pytest.raises((TypeError, ValueError)):
                if kind == "dtype":
                    cache.append(k1.astype(np.float16), v1)
                elif kind == "heads":
                    cache.append(np.concatenate([k1, k1], axis=1), np.concatenate([v1, v1], axis=1))
                elif kind == "lengths":
                    cache.append(k1, v1, lengths=[2] * B)
                elif kind == "scale":
                    cache.forward(
                        rng.standard_normal((B, Hq, 1, d)).astype(dt), k1, v1, scale=float("nan")
                    )
                else:
                    cache.forward(rng.standard_normal((B, Hq, 1, d + 1)).astype(dt), k1, v1)
        check_state()


# ---------------------------------------------------------------- forked child

FORK_FUZZ_CODE = """
    import os, sys, time, traceback
    sys.path.insert(0, {tests_dir!r})
    import numpy as np
    import attn_fast as af
    from attn_fast import positional
    from hypothesis import HealthCheck, given, settings
    import test_fuzz as tf

    af.set_num_threads(2)
    q = np.random.default_rng(0).standard_normal((1, 4, 512, 64)).astype(np.float32)
    af.scaled_dot_product_attention(q, q, q, is_causal=True)  # libgomp's pool, started by a kernel
    positional.RoPE(64)(np.ones((1, 4096, 8, 64), np.float32))  # ... and used by a Cython loop
    few = settings(
        max_examples={n}, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    runs = [few(given(tf.problems())(tf.test_fuzz_against_oracle.hypothesis.inner_test)),
            few(given(tf.cache_programs())(tf.test_fuzz_kv_cache_against_oracle.hypothesis.inner_test))]
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            for run in runs:
                run()
            if {libgomp} and not af._core.forked_child_serial():
                code = 3
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    t0 = time.monotonic()
    while time.monotonic() - t0 < {deadline}:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print(os.waitstatus_to_exitcode(status))
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("hang")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_fuzz_in_a_forked_child_after_threaded_calls():
    # A few examples of both fuzzers in a child forked after a threaded kernel
    # call and a threaded Cython loop (libgomp's pool does not survive fork:
    # attn_fast must run serially there, with the same answers).
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        FORK_FUZZ_CODE.format(
            tests_dir=os.path.dirname(os.path.abspath(__file__)),
            n=max(4, N_EXAMPLES // 8),
            libgomp="libgomp" in af._core.openmp_runtime(),
            deadline=240,
        )
    )
    env = dict(os.environ, OMP_NUM_THREADS="2")
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0", r.stdout + r.stderr
