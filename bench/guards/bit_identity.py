"""Bit-identity check of the kernels: a fixed set of calls on fixed seeded inputs.

Each call's outputs are hashed (sha256 of dtype, shape and the C-order bytes),
so a refactor of the C++ kernels can show that it changed no bit of any
result on any instruction set. Usage:

    python bench/guards/bit_identity.py                    # the active ISA, JSON to stdout
    python bench/guards/bit_identity.py --isa all --out bench/guards/bit_identity_base.json
    python bench/guards/bit_identity.py --check bench/guards/bit_identity_base.json
    python bench/guards/bit_identity.py --isa all --merge bench/guards/bit_identity_base.json

``--isa all`` runs every ISA this CPU and build support (amx_emu included
wherever AVX512-BF16 runs), each in its own subprocess with ``ATTN_FAST_ISA``
set (the kernel is chosen at import).
``--check FILE`` recomputes the ISAs named in FILE that this machine runs and
exits 1 on any mismatch, missing or extra case (listing them), 0 when all agree.
``--merge FILE`` adds to FILE what it lacks (an ISA it has no entry for, a
case new to the set) and changes nothing it holds: it exits 1, writing
nothing, if a case it holds now hashes differently (regenerate the whole file
with ``--out`` only for a change of numerics meant and said).

The set: scaled_dot_product_attention in float32 and float64 (plain, causal,
window, padding, varlen, bool and additive masks, block-sparse, GQA,
Lq != Lk, softcap, ALiBi, sinks, return_lse, non-contiguous inputs,
d = 1, 5, 80, 256 x L = 1, 7, 129), KVCache decode and backend="decode",
the backward, linear attention, and bfloat16 / float16 inputs (sdpa,
decode, and linear attention). Threads are
left at their default: the kernels are bit-for-bit identical for any count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

import numpy as np


def _digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        a = np.asarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _cases():
    """Yields (name, thunk); each thunk returns the arrays to hash."""
    import attn_fast as af
    from attn_fast import masks
    from attn_fast.backward import scaled_dot_product_attention_backward
    from attn_fast.variants import linear_attention

    sdpa = af.scaled_dot_product_attention

    def rnd(seed, *shape, dtype=np.float32):
        return np.random.default_rng(seed).standard_normal(shape).astype(dtype)

    for dt in (np.float32, np.float64):
        tag = np.dtype(dt).name
        B, H, L, d = 2, 3, 129, 80
        q, k, v = (rnd(s, B, H, L, d, dtype=dt) for s in (1, 2, 3))

        yield f"{tag}/plain", lambda q=q, k=k, v=v: [sdpa(q, k, v)]
        yield f"{tag}/causal", lambda q=q, k=k, v=v: [sdpa(q, k, v, is_causal=True)]
        yield (
            f"{tag}/window",
            lambda q=q, k=k, v=v: [sdpa(q, k, v, window_size=(16, 4))],
        )
        yield (
            f"{tag}/padding",
            lambda q=q, k=k, v=v: [
                sdpa(
                    q,
                    k,
                    v,
                    attn_mask=masks.Causal() & masks.Padding(kv_lens=[100, 129], q_lens=[90, 7]),
                )
            ],
        )
        bool_mask = np.random.default_rng(4).random((B, H, L, L)) > 0.3
        bool_mask[0, 0, 5] = False  # one fully masked row
        yield (
            f"{tag}/bool_mask",
            lambda q=q, k=k, v=v, m=bool_mask: list(sdpa(q, k, v, attn_mask=m, return_lse=True)),
        )
        add_mask = rnd(5, 1, H, L, L, dtype=dt)
        add_mask[..., ::7] = -np.inf
        yield (
            f"{tag}/additive_mask",
            lambda q=q, k=k, v=v, m=add_mask: [sdpa(q, k, v, attn_mask=m)],
        )
        yield (
            f"{tag}/block_sparse",
            lambda q=q, k=k, v=v, L=L: [
                sdpa(q, k, v, attn_mask=masks.BlockSparse.local(L, 32, 1, causal=True))
            ],
        )
        kg, vg = rnd(6, B, 1, L, d, dtype=dt), rnd(7, B, 1, L, d, dtype=dt)
        yield (
            f"{tag}/gqa",
            lambda q=q, kg=kg, vg=vg: [sdpa(q, kg, vg, enable_gqa=True, is_causal=True)],
        )
        qs = rnd(8, B, H, 7, d, dtype=dt)
        yield (
            f"{tag}/lq_ne_lk",
            lambda qs=qs, k=k, v=v: list(sdpa(qs, k, v, is_causal=True, return_lse=True)),
        )
        slopes = np.linspace(0.05, 0.4, H).astype(np.float32)
        sinks = np.array([0.5, -1.0, np.inf], dtype=np.float32)[:H]
        yield (
            f"{tag}/softcap_alibi_sinks",
            lambda q=q, k=k, v=v, sl=slopes, sk=sinks: list(
                sdpa(
                    q,
                    k,
                    v,
                    is_causal=True,
                    softcap=20.0,
                    alibi_slopes=sl,
                    sinks=sk,
                    return_lse=True,
                )
            ),
        )
        yield (
            f"{tag}/lse",
            lambda q=q, k=k, v=v: list(sdpa(q, k, v, return_lse=True)),
        )
        qt = rnd(9, B, L, H, d, dtype=dt).transpose(0, 2, 1, 3)  # non-contiguous
        yield (
            f"{tag}/strided",
            lambda qt=qt, k=k, v=v: [sdpa(qt, k[..., ::-1], v[:, :, ::-1], is_causal=True)],
        )
        for dd in (1, 5, 80, 256):
            for LL in (1, 7, 129):
                a, b, c = (rnd(100 + s + dd + LL, 1, 2, LL, dd, dtype=dt) for s in range(3))
                yield (
                    f"{tag}/d{dd}_L{LL}",
                    lambda a=a, b=b, c=c: [
                        sdpa(a, b, c),
                        *sdpa(a, b, c, is_causal=True, return_lse=True),
                    ],
                )
        # varlen: three packed sequences
        cu = np.array([0, 7, 60, 129], dtype=np.int64)
        qv, kv_, vv = (rnd(s, 129, H, d, dtype=dt) for s in (11, 12, 13))
        yield (
            f"{tag}/varlen",
            lambda qv=qv, kv_=kv_, vv=vv, cu=cu: list(
                af.varlen_attention(qv, kv_, vv, cu, cu, causal=True, return_lse=True)
            ),
        )
        # decode: a KV cache with two appends, then single-token attends
        kc, vc = rnd(14, 2, 2, 300, 64, dtype=dt), rnd(15, 2, 2, 300, 64, dtype=dt)
        q1 = rnd(16, 2, 4, 1, 64, dtype=dt)
        q3 = rnd(17, 2, 4, 3, 64, dtype=dt)

        def decode(kc=kc, vc=vc, q1=q1, q3=q3, dt=dt):
            cache = af.KVCache(2, 2, 64, capacity=512, dtype=dt)
            cache.append(kc[:, :, :250], vc[:, :, :250])
            o1, l1 = cache.attend(q1, return_lse=True)
            cache.append(kc[:, :, 250:253], vc[:, :, 250:253])
            o3 = cache.attend(q3)
            o4 = sdpa(q1, kc, vc, enable_gqa=True, backend="decode")
            return [o1, l1, o3, o4]

        yield f"{tag}/decode", decode

        def ring(kc=kc, vc=vc, q1=q1, dt=dt):
            cache = af.KVCache(2, 2, 64, dtype=dt, window=100)
            cache.append(kc[:, :, :150], vc[:, :, :150])
            cache.append(kc[:, :, 150:170], vc[:, :, 150:170])
            return [cache.attend(q1)]

        yield f"{tag}/decode_ring", ring

        # decode at a GQA group of 3 (the 3-row micro-kernels), every block tail mod 4
        q9 = rnd(25, 1, 9, 1, 64, dtype=dt)
        k3, v3 = rnd(26, 1, 3, 203, 64, dtype=dt), rnd(27, 1, 3, 203, 64, dtype=dt)
        yield (
            f"{tag}/decode_gqa3",
            lambda q9=q9, k3=k3, v3=v3: [
                sdpa(q9, k3[:, :, :n], v3[:, :, :n], enable_gqa=True, backend="decode")
                for n in (1, 7, 66, 129, 203)
            ],
        )

        # backward
        qb, kb, vb = (rnd(s, 1, 2, 37, 24, dtype=dt) for s in (18, 19, 20))
        dout = rnd(21, 1, 2, 37, 24, dtype=dt)

        def backward(qb=qb, kb=kb, vb=vb, dout=dout):
            out = []
            for causal in (False, True):
                o, lse = sdpa(qb, kb, vb, is_causal=causal, return_lse=True)
                out += [o, lse]
                out += list(
                    scaled_dot_product_attention_backward(
                        dout, qb, kb, vb, o, lse, is_causal=causal
                    )
                )
            return out

        yield f"{tag}/backward", backward

        # linear attention
        ql, kl, vl = (rnd(s, 2, 2, 33, 16, dtype=dt) for s in (22, 23, 24))
        yield (
            f"{tag}/linear",
            lambda ql=ql, kl=kl, vl=vl: [
                linear_attention(ql, kl, vl),
                linear_attention(ql, kl, vl, causal=True),
            ],
        )

    # 16-bit storage
    import ml_dtypes

    for name, dt in (("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)):
        q, k, v = (rnd(30 + s, 2, 2, 129, 80).astype(dt) for s in range(3))
        yield f"{name}/plain", lambda q=q, k=k, v=v: [sdpa(q, k, v)]
        yield (
            f"{name}/causal_lse",
            lambda q=q, k=k, v=v: list(sdpa(q, k, v, is_causal=True, return_lse=True)),
        )
        q1 = rnd(40, 2, 2, 1, 80).astype(dt)
        yield f"{name}/decode", lambda q1=q1, k=k, v=v: [sdpa(q1, k, v, backend="decode")]
        q9 = rnd(41, 1, 6, 1, 80).astype(dt)  # a GQA group of 3, d 80
        yield (
            f"{name}/decode_gqa3",
            lambda q9=q9, k=k, v=v: [
                sdpa(q9, k[:1, :, :n], v[:1, :, :n], enable_gqa=True, backend="decode")
                for n in (5, 66, 129)
            ],
        )
        # the tile path's shapes (amx / amx_emu: d a multiple of 32, tails, GQA, masks)
        for dd, LL in ((64, 200), (128, 33)):
            qt, kt, vt = (
                rnd(50 + s + dd, 1, h, LL, dd).astype(dt) for s, h in enumerate((4, 2, 2))
            )
            keep = np.random.default_rng(60 + dd).random((1, 4, LL, LL)) > 0.2
            keep[0, 1, 3] = False  # one fully masked row
            yield (
                f"{name}/tile_d{dd}_gqa_masks",
                lambda qt=qt, kt=kt, vt=vt, keep=keep: [
                    *sdpa(qt, kt, vt, is_causal=True, enable_gqa=True, return_lse=True),
                    sdpa(qt, kt, vt, attn_mask=keep, enable_gqa=True),
                    sdpa(qt, kt, vt, window_size=(40, 9), enable_gqa=True),
                    sdpa(qt[:, :, :7], kt, vt, is_causal=True, enable_gqa=True),
                ],
            )
        ql, kl, vl = (rnd(22 + s, 2, 2, 33, 16).astype(dt) for s in range(3))
        yield (
            f"{name}/linear",
            lambda ql=ql, kl=kl, vl=vl: [
                linear_attention(ql, kl, vl),
                linear_attention(ql, kl, vl, causal=True),
            ],
        )


def run_here():
    """{case: sha256} for the ISA this process runs."""
    out = {}
    for name, thunk in _cases():
        out[name] = _digest(*thunk())
    return out


def run_isa(isa):
    env = dict(os.environ, ATTN_FAST_ISA=isa)
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--isa", "here"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise SystemExit(f"bit_identity: ISA {isa} failed:\n{r.stderr}")
    return json.loads(r.stdout)["results"][isa]


def available_isas():
    from attn_fast import _core

    return list(_core.available_isas())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--isa", default="active", help="'active', 'all', 'here' or an ISA name")
    p.add_argument("--out", help="write the JSON here (default: stdout)")
    p.add_argument("--check", metavar="FILE", help="compare against a saved JSON; exit 1 on a diff")
    p.add_argument(
        "--merge",
        metavar="FILE",
        help="add the ISAs and cases FILE lacks; exit 1 (writing nothing) if a held case differs",
    )
    args = p.parse_args(argv)

    if args.isa == "here":
        import attn_fast as af

        print(json.dumps({"results": {af.get_isa(): run_here()}}))
        return 0

    if args.check:
        with open(args.check) as f:
            base = json.load(f)["results"]
        isas = [i for i in base if i in available_isas()]
        bad = 0
        for isa in isas:
            got = run_isa(isa)
            for case in sorted(set(base[isa]) | set(got)):
                want, have = base[isa].get(case), got.get(case)
                if want != have:
                    bad += 1
                    what = "missing" if have is None else "new" if want is None else "differs"
                    print(f"MISMATCH {isa} {case}: {what}")
            print(f"{isa}: {len(got)} cases checked")
        skipped = sorted(set(base) - set(isas))
        if skipped:
            print(f"not run here (CPU/build lacks them): {', '.join(skipped)}")
        print("bit-identical" if bad == 0 else f"{bad} mismatches")
        return 1 if bad else 0

    if args.isa == "all":
        isas = available_isas()
    elif args.isa == "active":
        import attn_fast as af

        isas = [af.get_isa()]
    else:
        isas = [args.isa]
    doc = {"results": {isa: run_isa(isa) for isa in isas}}
    if args.merge:
        return merge(args.merge, doc["results"])
    text = json.dumps(doc, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


def merge(path, results):
    """Add to the JSON at `path` the ISAs and cases of `results` it lacks; 1 (and
    nothing written) if a case it already holds hashes differently now."""
    with open(path) as f:
        base = json.load(f)
    held = base["results"]
    differ = [
        f"{isa} {case}"
        for isa, got in results.items()
        for case, h in got.items()
        if held.get(isa, {}).get(case, h) != h
    ]
    if differ:
        for d in differ:
            print(f"MISMATCH {d}: differs (not merged)")
        print(f"{len(differ)} mismatches: {path} left unchanged")
        return 1
    added = 0
    for isa, got in results.items():
        have = held.setdefault(isa, {})
        for case, h in got.items():
            if case not in have:
                have[case] = h
                added += 1
    with open(path, "w") as f:
        f.write(json.dumps(base, indent=1, sort_keys=True) + "\n")
    print(f"{added} entries added to {path} ({', '.join(sorted(results))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
