"""Tokens/s of TinyTransformerLM.generate with the KV cache vs without it.

    python bench/benchmarks/bench_generate.py            # 4 layers, D 256, 8 heads, 2 kv heads,
                                              # prompt 512, 128 new tokens, greedy
    python bench/benchmarks/bench_generate.py --threads 1 --new 64

"with cache": prefill the prompt once into a LayerCaches, then one token per
step (each step attends one query to the cached keys).
"without cache": re-run forward() on the whole growing sequence every step
(prefill of Lp + t tokens for step t): the quadratic baseline.

Both runs are checked first: the same greedy tokens, and the cached logits of
the first steps equal the recomputed ones to 1e-4. Then each is timed once
(wall clock, after a short warm-up). tokens/s counts new tokens only, over the
whole generate() call (prefill included); the cached run's prefill and decode
times are also shown separately. The result line carries the ISA, thread count
and CPU model.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import attn_fast as af
from attn_fast._config import config


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0 = leave as is)")
    ap.add_argument("--skip-nocache", action="store_true", help="time only the cached run")
    args = ap.parse_args(argv)
    if args.threads:
        af.set_num_threads(args.threads)

    lm = af.TinyTransformerLM(
        args.vocab, args.d_model, args.layers, args.heads, args.kv_heads, seed=0
    )
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, args.vocab, size=(args.batch, args.prompt))

    # -- validate: cached logits == recomputed logits, same greedy tokens
    cache = lm.make_cache(args.batch, args.prompt + 4)
    seq = prompt
    logits = lm.forward(prompt, cache=cache)[:, -1]
    for _ in range(4):
        full = lm.forward(seq)[:, -1]
        err = float(np.max(np.abs(logits - full)))
        assert err < 1e-4, f"cached logits differ from recomputed ones by {err}"
        nxt = np.argmax(full, axis=-1)
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
        logits = lm.forward(nxt[:, None], cache=cache)[:, -1]
    check_new = min(args.new, 8)
    assert np.array_equal(
        lm.generate(prompt, check_new), lm.generate(prompt, check_new, use_cache=False)
    )

    # -- time
    c = config()
    print(
        f"TinyTransformerLM: layers={args.layers} d_model={args.d_model} heads={args.heads} "
        f"kv_heads={args.kv_heads} vocab={args.vocab} batch={args.batch} prompt={args.prompt} "
        f"new={args.new} float32 greedy"
    )
    print(f"isa={c['isa']} threads={c['num_threads']} cpu={c['cpu']}")
    lm.generate(prompt[:, :16], 4)  # warm-up

    t0 = time.perf_counter()
    cache = lm.make_cache(args.batch, args.prompt + args.new)
    logits = lm.forward(prompt, cache=cache)[:, -1]
    t_prefill = time.perf_counter() - t0
    toks = [np.argmax(logits, axis=-1)]
    for _ in range(args.new - 1):
        logits = lm.forward(toks[-1][:, None], cache=cache)[:, -1]
        toks.append(np.argmax(logits, axis=-1))
    t_cache = time.perf_counter() - t0
    n = args.new * args.batch
    t_decode = t_cache - t_prefill
    decode_rate = (args.new - 1) * args.batch / max(t_decode, 1e-9)
    print(
        f"with cache:    {t_cache:8.3f} s  {n / t_cache:9.1f} tokens/s   "
        f"(prefill {t_prefill:.3f} s, decode {t_decode:.3f} s = {decode_rate:.1f} tokens/s)"
    )
    if not args.skip_nocache:
        t0 = time.perf_counter()
        out = lm.generate(prompt, args.new, use_cache=False)
        t_nocache = time.perf_counter() - t0
        assert np.array_equal(out[:, args.prompt :], np.stack(toks, axis=1)), (
            "tokens differ with and without cache"
        )
        print(
            f"without cache: {t_nocache:8.3f} s  {n / t_nocache:9.1f} tokens/s   "
            "(forward on the growing sequence)"
        )
        print(f"speed-up: {t_nocache / t_cache:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
