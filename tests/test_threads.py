"""Threads: concurrent Python callers, the thread-count setting, other OpenMP
runtimes in the process (torch, threadpoolctl) and fork()."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
from helpers import randn, run_python

import attn_fast as af


def test_concurrent_callers_while_thread_count_changes(rng):
    # Four Python threads call at once with different shapes, dtypes and options
    # while a fifth keeps changing set_num_threads: every result is bit-for-bit
    # the single-caller result (results do not depend on the thread count).
    cases = []
    for i in range(4):
        dtype = (np.float32, np.float64)[i % 2]
        L = 40 + 17 * i
        q, k, v = (
            randn(rng, (1, 2, L, 16), dtype),
            randn(rng, (1, 2, L + 5, 16), dtype),
            randn(rng, (1, 2, L + 5, 8), dtype),
        )
        kw = dict(is_causal=bool(i % 2), window_size=(9, None) if i == 2 else None)
        cases.append((q, k, v, kw, af.scaled_dot_product_attention(q, k, v, **kw)))
    old = af.get_num_threads()
    stop = threading.Event()
    errors = []

    def caller(i):
        q, k, v, kw, expect = cases[i]
        try:
            for _ in range(60):
                np.testing.assert_array_equal(
                    af.scaled_dot_product_attention(q, k, v, **kw), expect
                )
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def toggler():
        n = 0
        while not stop.is_set():
            af.set_num_threads(1 + n % 2)
            n += 1

    try:
        t = threading.Thread(target=toggler)
        t.start()
        callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
        for c in callers:
            c.start()
        for c in callers:
            c.join()
        stop.set()
        t.join()
    finally:
        af.set_num_threads(old)
    assert not errors, errors[0]


def test_gil_is_released_during_the_kernel(rng):
    # The main thread counts while a worker is inside one long kernel call; the
    # worker reads the count as soon as the call returns. Had the call held the
    # GIL, the main thread could not have counted during it. A long switch
    # interval keeps the interpreter from handing the GIL over on its own
    # while the worker runs Python code.
    q = randn(rng, (1, 1, 1500, 64))
    count, seen, done = [0], [], threading.Event()

    def work():
        count[0] = 0
        af.scaled_dot_product_attention(q, q, q, backend="reference")
        seen.append(count[0])
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    try:
        t = threading.Thread(target=work)
        t.start()
        while not done.is_set():
            count[0] += 1
        t.join()
    finally:
        sys.setswitchinterval(old)
    assert seen[0] > 1000


def test_thread_count_is_per_process():
    old = af.get_num_threads()
    seen = []
    try:
        af.set_num_threads(1)
        t = threading.Thread(target=lambda: seen.append(af.get_num_threads()))
        t.start()
        t.join()
        af.set_num_threads(2)
        t = threading.Thread(
            target=lambda: (seen.append(af.get_num_threads()), af.set_num_threads(1))
        )
        t.start()
        t.join()
        seen.append(af.get_num_threads())  # set in the other thread, seen here
    finally:
        af.set_num_threads(old)
    assert seen == [1, 2, 1]


FORK_CODE = """
    import multiprocessing as mp, numpy as np, attn_fast as af
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 4, 300, 32)).astype(np.float32)
    q1 = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
    kv = rng.standard_normal((1, 8, 4096, 128)).astype(np.float32)
    calls = {{
        "prefill": lambda: af.scaled_dot_product_attention(q, q, q, is_causal=True),
        "decode": lambda: af.scaled_dot_product_attention(q1, kv, kv, enable_gqa=True),
        "linear": lambda: af.variants.linear_attention(q, q, q, causal=True),
    }}
    call = calls["{entry}"]
    af.set_num_threads(2)
    expect = call()  # starts the OpenMP pool

    def child(_):
        o = call()
        return bool(np.array_equal(o, expect)), af.get_num_threads(), af._core.forked_child_serial()

    with mp.get_context("fork").Pool(2) as pool:
        print(pool.map(child, range(4)))
    print(af._core.forked_child_serial(), af.get_num_threads())
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
@pytest.mark.parametrize("entry", ["prefill", "decode", "linear"])
def test_fork_after_a_threaded_call_does_not_hang(entry):
    # GNU libgomp's thread pool does not survive fork(): a child that opens a
    # parallel region hangs. attn_fast runs single-threaded in such a child,
    # whichever kernel started the pool.
    r = run_python(FORK_CODE.format(entry=entry), timeout=90, OMP_NUM_THREADS="2")
    assert r.returncode == 0, r.stderr
    children, parent = r.stdout.strip().splitlines()
    results = eval(children)  # noqa: S307 - our own subprocess's repr
    assert all(same for same, _, _ in results)
    if "libgomp" in af._core.openmp_runtime():
        assert all(n == 1 and serial for _, n, serial in results)
    assert parent == "False 2"


THREADPOOLCTL_CODE = """
    import numpy as np, attn_fast as af
    from threadpoolctl import threadpool_info, threadpool_limits
    q = np.ones((1, 2, 64, 16), np.float32)
    af.scaled_dot_product_attention(q, q, q)
    omp = [i for i in threadpool_info() if i["user_api"] == "openmp"]
    print(sorted(set(i["prefix"] for i in omp)))
    print(af.get_num_threads())
    with threadpool_limits(limits=1, user_api="openmp"):
        print(af.get_num_threads())
        af.scaled_dot_product_attention(q, q, q)
    print(af.get_num_threads())
"""


def test_threadpoolctl_lists_and_limits_openmp():
    pytest.importorskip("threadpoolctl")
    if not af._core.openmp_enabled():
        pytest.skip("built without OpenMP")
    r = run_python(THREADPOOLCTL_CODE, OMP_NUM_THREADS="2")
    assert r.returncode == 0, r.stderr
    prefixes, before, inside, after = r.stdout.strip().splitlines()
    assert "libgomp" in prefixes or "libomp" in prefixes or "libiomp" in prefixes
    assert (before, inside, after) == ("2", "1", "2")


TORCH_CODE = """
    import numpy as np
    if {torch_first}:
        import torch, attn_fast as af
    else:
        import attn_fast as af, torch
    from threadpoolctl import threadpool_info
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, 100, 32)) for _ in range(3))
    mine = af.scaled_dot_product_attention(q, k, v, is_causal=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), is_causal=True).numpy()
    again = af.scaled_dot_product_attention(q, k, v, is_causal=True)
    print(float(np.abs(mine - theirs).max()), bool(np.array_equal(mine, again)))
    print(sorted(i["filepath"] for i in threadpool_info() if i["user_api"] == "openmp"))
"""


@pytest.mark.parametrize("torch_first", [True, False], ids=["torch-first", "attn_fast-first"])
def test_torch_in_the_same_process(torch_first):
    pytest.importorskip("torch")
    pytest.importorskip("threadpoolctl")
    r = run_python(TORCH_CODE.format(torch_first=torch_first), timeout=300, OMP_NUM_THREADS="2")
    assert r.returncode == 0, r.stderr
    diff, same = r.stdout.strip().splitlines()[0].split()
    assert float(diff) < 1e-10 and same == "True"
    assert "libgomp" in r.stdout.splitlines()[1] or "libomp" in r.stdout.splitlines()[1]
