"""Bit-identity check of the Python seam: one SHA-256 per fixed call.

Runs a fixed set of calls through every route from the public API to the
kernels (mask objects and their combinations, the prefill / decode /
reference choice, varlen, the weights path, the KV cache and its ring, the
backward, out= aliasing, the layers) on seeded inputs and prints, per call,
a digest of every output's bytes (arrays, lse, KernelStats). Two runs of
the same build print the same lines; run it before and after a change of
the Python layer, on each ISA, and diff::

    ATTN_FAST_ISA=avx512 python bench/guards/seam_bitcheck.py > after.txt
    diff before.txt after.txt        # no output: bit-identical

The calls validate nothing themselves (the test suite does); this only
proves that the results did not move by one bit.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

import attn_fast as af
from attn_fast import masks as M

F32, F64 = np.float32, np.float64


def digest(*outs) -> str:
    h = hashlib.sha256()
    for x in outs:
        if isinstance(x, (tuple, list)):
            h.update(digest(*x).encode())
        elif isinstance(x, np.ndarray):
            a = np.ascontiguousarray(x)
            h.update(str((a.shape, a.dtype.str)).encode())
            h.update(a.view(np.uint8).tobytes())
        else:
            h.update(repr(x).encode())
    return h.hexdigest()[:16]


def qkv(rng, B, Hq, Hkv, Lq, Lk, d, dv, dt):
    def r(*s):
        return rng.standard_normal(s).astype(dt)

    return r(B, Hq, Lq, d), r(B, Hkv, Lk, d), r(B, Hkv, Lk, dv)


def calls(dt):
    rng = np.random.default_rng(1234)
    sdpa = af.scaled_dot_product_attention
    q, k, v = qkv(rng, 2, 4, 2, 129, 129, 80, 80, dt)
    qs, ks, vs = qkv(rng, 2, 4, 2, 7, 150, 5, 3, dt)
    yield "plain", sdpa(q, k, v, enable_gqa=True, return_lse=True, return_stats=True)
    yield "causal_lq_ne_lk", sdpa(qs, ks, vs, is_causal=True, enable_gqa=True, return_lse=True)
    yield "window", sdpa(q, k, v, is_causal=True, window_size=(5, 3), enable_gqa=True)
    yield (
        "topleft_padding",
        sdpa(
            qs,
            ks,
            vs,
            attn_mask=M.Causal("top_left") & M.Padding([150, 90], [7, 3]),
            enable_gqa=True,
            return_lse=True,
        ),
    )
    qm, km, vm = qkv(rng, 2, 3, 3, 150, 200, 16, 16, dt)
    boolmask = rng.random((2, 1, 150, 200)) < 0.6
    boolmask[..., 64:160] = False
    yield "dense_bool_summary", sdpa(qm, km, vm, attn_mask=boolmask, return_stats=True)
    bias = rng.standard_normal((150, 200)).astype(F64)
    lay = rng.random((3, 10, 13)) < 0.7
    yield (
        "bias_layout_causal",
        sdpa(
            qm,
            km,
            vm,
            attn_mask=[bias, M.BlockSparse(lay, 16), M.Causal()],
            return_lse=True,
            return_stats=True,
        ),
    )
    bs = M.BlockSparse.local(200, 8, 3) | M.BlockSparse.strided(200, 12, 4)
    yield (
        "layout_union_window",
        sdpa(qm[:, :, :150], km, vm, attn_mask=bs & M.SlidingWindow(40, 7), return_stats=True),
    )
    yield (
        "scores",
        sdpa(
            q,
            k,
            v,
            is_causal=True,
            enable_gqa=True,
            softcap=2.5,
            alibi_slopes=np.linspace(0.1, 0.7, 4),
            sinks=np.array([0.5, -1.0, 2.0, 0.0]),
            return_lse=True,
        ),
    )
    qd, kd, vd = qkv(rng, 3, 8, 2, 1, 257, 64, 48, dt)
    lens = np.array([257, 100, 3])
    yield (
        "decode_auto",
        sdpa(
            qd, kd, vd, attn_mask=M.Padding(lens), is_causal=True, enable_gqa=True, return_lse=True
        ),
    )
    yield "decode_forced", sdpa(qd, kd, vd, enable_gqa=True, backend="decode", return_lse=True)
    yield "decode_stats", sdpa(qd, kd, vd, enable_gqa=True, return_stats=True, return_lse=True)
    yield "reference", sdpa(qs, ks, vs, enable_gqa=True, backend="reference", return_lse=True)
    yield "tiles", sdpa(q, k, v, enable_gqa=True, block_q=16, block_k=40, return_stats=True)
    cu = np.array([0, 5, 5, 60, 129])
    packed_q = rng.standard_normal((129, 4, 80)).astype(dt)
    packed_k = rng.standard_normal((129, 2, 80)).astype(dt)
    packed_v = rng.standard_normal((129, 2, 80)).astype(dt)
    yield (
        "varlen",
        af.varlen_attention(
            packed_q,
            packed_k,
            packed_v,
            cu,
            cu,
            causal=True,
            window_size=(17, 0),
            return_lse=True,
            return_stats=True,
        ),
    )
    yield (
        "weights",
        af.attention_weights(
            qs,
            ks,
            attn_mask=M.Padding([150, 40]),
            enable_gqa=True,
            alibi_slopes=[0.1, 0.2, 0.3, 0.4],
        ),
    )
    o_alias = q.copy()
    sdpa(o_alias, k, v, enable_gqa=True, is_causal=True, out=o_alias)
    yield "out_alias", o_alias
    o_strided = np.zeros((2, 129, 4, 80), dt)
    sdpa(q, k, v, enable_gqa=True, out=o_strided.transpose(0, 2, 1, 3))
    yield "out_strided", o_strided
    # KV cache: prefill, decode steps, a window ring that wraps.
    for window in (None, 9):
        cache = af.KVCache(2, 2, 32, capacity=64, dtype=dt, window=window)
        qc, kc, vc = qkv(rng, 2, 4, 2, 20, 20, 32, 32, dt)
        outs = [cache.forward(qc, kc, vc, return_lse=True)]
        for _ in range(30):
            q1, k1, v1 = qkv(rng, 2, 4, 2, 1, 1, 32, 32, dt)
            cache.append(k1, v1)
            outs.append(cache.attend(q1, return_lse=True))
        q6, k6, v6 = qkv(rng, 2, 4, 2, 6, 6, 32, 32, dt)
        cache.append(k6, v6)
        outs.append(cache.attend(q6))
        yield f"kv_cache_window{window}", outs
    # Backward.
    qb, kb, vb = qkv(rng, 2, 4, 2, 33, 47, 16, 8, dt)
    kwb = dict(
        is_causal=True,
        enable_gqa=True,
        window_size=(20, 3),
        sinks=np.array([0.1, 0.2, -0.3, 1.0]),
        attn_mask=M.Padding([47, 30], [33, 20]),
    )
    ob, lseb = sdpa(qb, kb, vb, return_lse=True, **kwb)
    dout = rng.standard_normal(ob.shape).astype(dt)
    yield "backward", af.scaled_dot_product_attention_backward(dout, qb, kb, vb, ob, lseb, **kwb)
    op, lsep = af.varlen_attention(
        packed_q, packed_k, packed_v, cu, cu, causal=True, return_lse=True
    )
    dop = rng.standard_normal(op.shape).astype(dt)
    yield (
        "varlen_backward",
        af.varlen_attention_backward(
            dop, packed_q, packed_k, packed_v, op, lsep, cu, cu, causal=True
        ),
    )
    # Layers.
    mha = af.MultiHeadAttention(32, 4, 2, rng=7, dtype=dt, positional="rope", bias=True)
    x = rng.standard_normal((2, 11, 32)).astype(dt)
    yield "mha", mha(x, causal=True)
    lm = af.TinyTransformerLM(50, 32, 2, 4, 2, seed=3, dtype=dt)
    yield "generate", lm.generate(np.array([[1, 2, 3], [4, 5, 6]]), 8)
    yield "lm_logits", lm.forward(np.array([[1, 2, 3, 9, 7]]))


def main() -> None:
    print(f"# isa={af.get_isa()} threads={af.get_num_threads()}")
    for dt in (F32, F64):
        for name, out in calls(dt):
            print(f"{np.dtype(dt).name:8s} {name:22s} {digest(out)}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
