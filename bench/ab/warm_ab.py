"""The benchmark suite's timing with and without its warm-up after the cooldown pause.

    python bench/ab/warm_ab.py [--threads 2] [--runs 4] [--repeats 5]

For a few short cases (decode, and the smallest prefill), attn_fast and torch are timed with
the suite's own ``prepare`` and ``time_interleaved``, alternating runs with the warm-up off
(``WARM_MAX_S = 0``: only the pause) and on (the default), and the medians of each printed
with the torch / attn_fast ratio. What it showed: bench/notes_archive.md, zen4 step 6.
"""

from __future__ import annotations

import argparse
import statistics

import attn_fast._bench.measure as bs
from attn_fast._bench.cases import Case, make_inputs
from attn_fast._bench.peers import prepare

CASES = [
    Case("decode", 1, 32, 8, 1, 4096, 128, False),
    Case("decode", 1, 32, 8, 1, 32768, 128, False),
    Case("decode", 8, 32, 8, 1, 4096, 128, False),
    Case("prefill", 1, 12, 12, 512, 512, 64, False),
    Case("prefill", 1, 12, 12, 512, 512, 64, True),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=4, help="runs per setting, alternating")
    ap.add_argument("--repeats", type=int, default=5, help="rounds per run")
    a = ap.parse_args(argv)
    for name in ("threads", "runs", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    warm_max = bs.WARM_MAX_S
    for case in CASES:
        q, k, v = make_inputs(case)
        fns = {i: prepare(i, case, q, k, v, a.threads) for i in ("attn_fast", "torch")}
        for f in fns.values():
            f()
        med = {m: {i: [] for i in fns} for m in ("off", "on")}
        for run in range(2 * a.runs):
            mode = ("off", "on")[(run + run // 2) % 2]  # off on on off off on ...
            bs.WARM_MAX_S = 0.0 if mode == "off" else warm_max
            s = bs.time_interleaved(fns, a.repeats, warmup=0)
            for i in fns:
                med[mode][i].append(statistics.median(s[i]))
        bs.WARM_MAX_S = warm_max
        line = f"{case.name:30s}"
        for m in ("off", "on"):
            af, t = (statistics.median(med[m][i]) for i in ("attn_fast", "torch"))
            line += f" | warm {m}: attn_fast {af * 1e3:6.2f} ms, torch {t * 1e3:6.2f} ms"
            line += f", {t / af:.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
