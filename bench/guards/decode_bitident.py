"""Bit-identity check of the decode kernel over a fixed set of calls.

``python bench/guards/decode_bitident.py save FILE`` writes the fp32/fp64 outputs (O and lse) of a
fixed, seeded set of ``_core.decode`` calls, on every ISA this CPU runs, to FILE (.npz);
``python bench/guards/decode_bitident.py check FILE`` recomputes them and reports any array that is
not bit-for-bit identical. Used for refactors that must not change results (issue #17).
"""

import sys

import numpy as np

from attn_fast import _core

CASES = [  # B, Hq, Hkv, Lq, R, d, dv, causal, window_left, split, ring start
    (1, 4, 1, 1, 129, 64, 64, True, -1, 0, 0),
    (2, 8, 2, 3, 700, 80, 80, True, -1, 0, 5),
    (1, 32, 8, 1, 4100, 128, 128, True, -1, 0, 0),
    (3, 6, 3, 4, 257, 5, 7, True, 100, 128, 200),
    (2, 2, 2, 2, 1, 1, 1, False, -1, 0, 0),
    (1, 12, 4, 9, 333, 256, 256, True, -1, 64, 17),
]


def run_all():
    out = {}
    for isa in _core.available_isas():
        _core.set_isa(isa)
        for dt in (np.float32, np.float64):
            for n, (B, Hq, Hkv, Lq, R, d, dv, causal, wl, split, st) in enumerate(CASES):
                rng = np.random.default_rng(1000 + n)
                q = rng.standard_normal((B, Hq, Lq, d)).astype(dt)
                k = rng.standard_normal((B, Hkv, R, d)).astype(dt)
                v = rng.standard_normal((B, Hkv, R, dv)).astype(dt)
                kv_lens = np.array([max(1, R - 3 * b) for b in range(B)], dtype=np.int64)
                start = np.full(B, st % R, dtype=np.int64)
                o = np.empty((B, Hq, Lq, dv), dtype=dt)
                lse = np.empty((B, Hq, Lq), dtype=dt)
                _core.decode(
                    q,
                    k,
                    v,
                    o,
                    lse,
                    scale=d**-0.5,
                    causal=causal,
                    window_left=wl,
                    kv_lens=kv_lens,
                    kv_start=start,
                    split=split,
                )
                out[f"{isa}_{np.dtype(dt).name}_{n}_o"] = o
                out[f"{isa}_{np.dtype(dt).name}_{n}_lse"] = lse
    return out


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    res = run_all()
    if mode == "save":
        np.savez(path, **res)
        print(f"saved {len(res)} arrays")
    else:
        ref = np.load(path)
        bad = [k for k in res if not np.array_equal(res[k], ref[k], equal_nan=True)]
        print(f"{len(res) - len(bad)}/{len(res)} identical", *bad)
        sys.exit(1 if bad else 0)
