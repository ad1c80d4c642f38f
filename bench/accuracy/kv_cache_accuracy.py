"""Accuracy of each KVCache storage type against the float32 cache (issue #20).

    python bench/accuracy/kv_cache_accuracy.py [--length 4096] [--batch 1]

Shapes: H_q = 32, H_kv = 8, d = dv = 128, one query token after L cached
ones. Two kinds of keys: plain N(0, 1), and "LLM-like" keys with a per-channel
offset (N(0, 3) per channel) and four outlier channels scaled by 8 (the
structure that makes per-channel key scales necessary). Values N(0, 1). For
each storage type the table gives the decode output's max |error| and its
relative RMS error against the float32 cache on the same tokens, and, for the
quantised caches (every quantised encoding: int8, ...), the max |error| of the
kernel against the float64 oracle on the cache's dequantised K/V (float32
rounding). 16-bit results are rounded once
to their dtype, which bounds their error from below.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import attn_fast as af
from attn_fast import reference
from attn_fast._checks import BF16, bf16_bits, from_float, to_float
from attn_fast._kv_store import ENCODINGS

HQ, HKV, D = 32, 8, 128
CODED = tuple(e.label for e in ENCODINGS if e.quantised)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)
    B, L = args.batch, args.length
    rng = np.random.default_rng(0)
    print(f"decode after {L} cached tokens, B={B} H_q={HQ} H_kv={HKV} d=dv={D}")
    hdr = (
        f"{'keys':>9} {'storage':>11} | {'max|err| vs fp32':>16} {'rel RMS':>9} | {'vs oracle':>10}"
    )
    print(hdr)
    print("-" * len(hdr))
    for kind in ("N(0,1)", "LLM-like"):
        k = rng.standard_normal((B, HKV, L, D)).astype(np.float32)
        if kind == "LLM-like":
            k += (3 * rng.standard_normal(D)).astype(np.float32)
            k[..., :4] *= 8
        v = rng.standard_normal((B, HKV, L, D)).astype(np.float32)
        q = (rng.standard_normal((B, HQ, 1, D)) / 4).astype(np.float32)
        c32 = af.KVCache(B, HKV, D, capacity=L)
        c32.append(k, v)
        o32 = c32.attend(q)
        for name in ("bfloat16", "float16", *CODED):
            c = af.KVCache(B, HKV, D, capacity=L, dtype=name)
            orc = "-"
            if name in CODED:
                c.append(k, v)
                o = c.attend(q).astype(np.float64)
                O = reference.sdpa(q[0].astype(np.float64), c.keys(0), c.values(0))
                orc = f"{np.abs(O - o[0]).max():.1e}"
            else:
                dt = BF16 if name == "bfloat16" else np.dtype(np.float16)
                tag = bf16_bits if name == "bfloat16" else (lambda x: x)
                c.append(tag(from_float(k, dt)), tag(from_float(v, dt)))
                o = np.asarray(c.attend(tag(from_float(q, dt)))).view(np.ndarray)
                o = to_float(o) if name == "bfloat16" else o.astype(np.float64)
            err = np.abs(o - o32)
            rel = np.sqrt((err**2).mean() / (o32.astype(np.float64) ** 2).mean())
            print(f"{kind:>9} {name:>11} | {err.max():16.2e} {rel:9.2e} | {orc:>10}")
    # The choice of codes: the keys' relative error under other schemes (NumPy, same keys).
    print("key codes on the LLM-like keys (relative RMS error of the dequantised keys):")
    k = k[0, 0].astype(np.float64)  # (L, d) of the last kind

    def codes(x, axis, symmetric):
        if symmetric:
            s = np.abs(x).max(axis, keepdims=True) / 127
            return np.clip(np.rint(x / np.where(s > 0, s, 1)), -127, 127) * s
        mn, mx = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
        s = (mx - mn) / 255
        m = mn + 128 * s
        return np.clip(np.rint((x - m) / np.where(s > 0, s, 1)), -128, 127) * s + m

    G = 64
    for label, axis, sym in (
        ("per channel, 64-token groups, asymmetric (attn_fast)", 0, False),
        ("per channel, 64-token groups, symmetric", 0, True),
        ("per token, asymmetric", 1, False),
    ):
        kq = np.concatenate([codes(k[t : t + G], axis, sym) for t in range(0, len(k), G)])
        print(f"  {label:<54} {np.linalg.norm(kq - k) / np.linalg.norm(k):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
