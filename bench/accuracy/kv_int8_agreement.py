"""Greedy-token agreement of TinyTransformerLM with quantised KV caches vs float32.

    python bench/accuracy/kv_int8_agreement.py [--prompts 8] [--prompt 256] [--new 64]
        [--dtypes int8 ...]  # default: every quantised encoding

A randomly initialised TinyTransformerLM (4 layers, D = 256, 8 heads, 2 kv
heads, vocab 4096, RoPE) prefills each random prompt into a LayerCaches and
decodes greedily, once with float32 and once with each quantised dtype's caches
(``dtype="int8"``, or another quantised dtype, is all a model needs). Each
quantised run is teacher-forced on the float32 run's tokens, so every step compares
the two argmaxes on the same history: the figure is the fraction of steps
whose argmax agrees (and the median relative logit error). A random model's
logits are flatter than a trained one's, so ties flip more easily: a
pessimistic figure. Not measured here: a real pretrained model.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import attn_fast as af
from attn_fast._kv_store import ENCODINGS
from attn_fast.kv_cache import LayerCaches


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--dtypes", nargs="+", default=[e.label for e in ENCODINGS if e.quantised])
    args = p.parse_args(argv)
    for dt in args.dtypes:
        agreement(args, dt)
    return 0


def agreement(args, qdt):
    """Print the argmax agreement of the `qdt` caches with the float32 ones."""
    m = af.TinyTransformerLM(4096, 256, 4, 8, 2, seed=0)
    rng = np.random.default_rng(0)
    agree = total = 0
    rel = []
    for _ in range(args.prompts):
        prompt = rng.integers(0, 4096, (1, args.prompt))
        caches = {
            dt: LayerCaches(m.num_layers, 1, m.num_kv_heads, m.head_dim, capacity=512, dtype=dt)
            for dt in ("float32", qdt)
        }
        lg = {dt: m.forward(prompt, cache=c)[:, -1] for dt, c in caches.items()}
        for _ in range(args.new):
            a, b = lg["float32"], lg[qdt]
            agree += int(a.argmax() == b.argmax())
            total += 1
            rel.append(float(np.abs(a - b).max() / np.abs(a).max()))
            nxt = a.argmax(-1)[:, None]  # teacher-forced: both follow the float32 tokens
            lg = {dt: m.forward(nxt, cache=c)[:, -1] for dt, c in caches.items()}
    print(
        f"{qdt:>11}: {args.prompts} prompts x {args.new} greedy steps (prompt {args.prompt}): "
        f"argmax agreement {agree}/{total} = {100 * agree / total:.1f} %, "
        f"median max|logit err| / max|logit| {np.median(rel):.1e}"
    )


if __name__ == "__main__":
    sys.exit(main())
