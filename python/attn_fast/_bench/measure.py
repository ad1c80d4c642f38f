"""The machine's limits (FMA peak, read bandwidth), interleaved timing of several
implementations, and the peak memory of one call in a fresh process."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict

from .. import _core


def machine_limits(threads, seconds=0.3, tries=2, nbytes=512 << 20):
    """Best of a few probes: noise from other processes only lowers them."""
    peak = max(_core.fma_peak_gflops(threads, seconds) for _ in range(tries))
    bw = max(_core.read_bandwidth_gbs(threads, nbytes, seconds) for _ in range(tries))
    return peak, bw


# Seconds to wait before each timed call. After a call, the previous library's
# worker threads keep spinning for a while, waiting for more work: libgomp's
# (attn_fast and torch) briefly, onnxruntime's thread pool for tens of ms,
# OpenBLAS's (the NumPy peer's matmuls) for up to 2^28 cycles, 0.1 s or more.
# Timed straight after, the next implementation shares the cores with them.
# Measured on 2 cores, (1, 12, 512, 64) at 2 threads: attn_fast took 24 ms
# 0.02 s after an onnxruntime call, 10.5 ms 0.1 s after; 12.5 ms 0.1 s after
# the NumPy peer, 10.8 ms 0.3 s after. Every implementation waits the same way.
COOLDOWN_S = {"numpy": 0.3}
COOLDOWN_DEFAULT_S = 0.1
# After that pause the machine is idle, and on a VM an idle vCPU takes
# milliseconds to run at full speed again: a 2-thread (1, 32/8, 4096) decode
# step, 1.0-1.1 ms back to back, took 2.0-3.9 ms (median of 11) straight after
# 0.1 s of sleep and 1.1 ms after 4 untimed calls; (1, 32/8, 32768), 9-10 ms,
# 0.5-2 ms more (AMD Zen 4 KVM guest, bench/notes_archive.md, zen4 step 6). That fixed
# wait is not the implementation's and compresses every short row's ratio. So
# after the pause each implementation first runs untimed for WARM_S (at least
# one call), unless its calls take WARM_MAX_S or more (the wait is then under
# 1 %): the sample times the steady state, as back-to-back calls (a generation
# loop's decode steps) see it. Every implementation is warmed the same way.
WARM_S = 0.01
WARM_MAX_S = 0.25


def time_interleaved(fns, repeats, warmup=1, max_seconds=20.0, cooldown=True):
    """fns: {name: callable}. Rounds of one call each, rotating the order.

    An implementation whose calls are slow stops early (>= 3 samples) once it
    has spent max_seconds. Before each call, waits for the worker threads of
    the previous call to go idle (COOLDOWN_S), then runs the implementation
    untimed for WARM_S (WARM_MAX_S: not when its calls are long); cooldown=False
    does neither. Returns {name: [seconds, ...]}."""
    names = list(fns)
    samples = {n: [] for n in names}
    spent = {n: 0.0 for n in names}
    last = {n: 0.0 for n in names}  # the latest call's seconds (0: none yet)
    prev = None
    for rnd in range(warmup + repeats):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for n in order:
            if rnd >= warmup and len(samples[n]) >= 3 and spent[n] > max_seconds:
                continue
            if cooldown and prev is not None:
                time.sleep(COOLDOWN_S.get(prev, COOLDOWN_DEFAULT_S))
            if cooldown and last[n] < WARM_MAX_S:
                end = time.perf_counter() + WARM_S
                while True:
                    t0 = time.perf_counter()
                    fns[n]()
                    t1 = time.perf_counter()
                    spent[n] += t1 - t0
                    if t1 >= end or t1 - t0 >= WARM_MAX_S:
                        break
            prev = n
            t0 = time.perf_counter()
            fns[n]()
            dt = time.perf_counter() - t0
            last[n] = dt
            spent[n] += dt
            if rnd >= warmup:
                samples[n].append(dt)
    return samples


def summarise(ts):
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "samples_s": ts}


_MEM_SNIPPET = r"""
import json, sys
import numpy as np
from attn_fast._bench.cases import Case, make_inputs
from attn_fast._bench.peers import prepare
case = Case(**json.loads(sys.argv[1])); impl = sys.argv[2]; threads = int(sys.argv[3])
q, k, v = make_inputs(case)
fn = prepare(impl, case, q, k, v, threads)
def status(key):  # VmRSS / VmHWM of this process, bytes
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
try:  # reset the high-water mark: making the inputs (fp32, then rounded) may have set it higher
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
before = status("VmRSS")
fn()
peak = status("VmHWM")
print(json.dumps({"before": before, "peak": peak}))
"""


def peak_memory(case, impl, threads, timeout=300):
    """Extra RSS (bytes) of one call in a fresh process, or None if it failed."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", _MEM_SNIPPET, json.dumps(asdict(case)), impl, str(threads)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        m = json.loads(r.stdout.strip().splitlines()[-1])
        return max(0, m["peak"] - m["before"])
    except Exception:  # noqa: BLE001 - a skipped peer or a crash gives no figure
        return None


# --------------------------------------------------------------------------- the run
