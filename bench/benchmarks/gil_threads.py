"""Speed-up of 2 Python threads over 1 on small single-threaded attn_fast calls.

The GIL is released inside the kernel, so two Python threads calling at once
run on two cores. Each call is kept single-threaded (set_num_threads(1)) so
that any speed-up comes from the Python threads alone.

    python bench/benchmarks/gil_threads.py [--calls 400] [--shape 1,4,256,64]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np

import attn_fast as af


def run(n_threads, calls, q):
    per = calls // n_threads
    barrier = threading.Barrier(n_threads + 1)

    def work():
        barrier.wait()
        for _ in range(per):
            af.scaled_dot_product_attention(q, q, q, is_causal=True)

    ts = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    for t in ts:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return per * n_threads / wall, cpu / wall  # calls/s, cores busy on average


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--shape", default="1,4,256,64")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    q = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    af.set_num_threads(1)
    expect = af.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert np.allclose(
        expect,
        af.reference.sdpa(q, q, q, mask=af.reference.causal_mask(shape[-2], shape[-2])),
        atol=1e-4,
    )
    best = {1: (0.0, 0.0), 2: (0.0, 0.0)}
    for _ in range(args.repeats):
        for n in (1, 2):
            best[n] = max(best[n], run(n, args.calls, q))
    cfg = af._config.config()
    print(
        f"shape {shape} float32 causal, kernel threads 1, isa {cfg['isa']}, {cfg['cpu']} "
        f"({cfg['cores']} cores)"
    )
    print(f"load average {os.getloadavg()[0]:.1f} (other processes compete for the cores)")
    print(f"1 Python thread : {best[1][0]:8.1f} calls/s, {best[1][1]:.2f} cores busy")
    print(
        f"2 Python threads: {best[2][0]:8.1f} calls/s, {best[2][1]:.2f} cores busy   speed-up "
        f"{best[2][0] / best[1][0]:.2f}x"
    )


if __name__ == "__main__":
    main()
