"""fork() after a multi-threaded call, whoever started the OpenMP pool.

GNU libgomp's worker pool does not survive fork(): a child that opens a
parallel region with more than one thread waits forever. attn_fast's
``pthread_atfork`` handler marks the child of a threaded parent, and there
every parallel call (C++ kernels, the Cython prange loops, the probes) runs
on one thread. Each scenario starts the pool one way in a fresh interpreter,
forks, and checks that the child's parallel-sized calls give the parent's
results within a deadline; a hang is killed and reported as a failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import attn_fast as af

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")

LIBGOMP = "libgomp" in af._core.openmp_runtime()
DEADLINE = 60  # seconds for one child; the calls take well under a second

# The expected results are computed with one thread (results do not depend on
# the thread count), so that nothing but the origin under test starts a pool.
PRELUDE = """
    import os, signal, sys, time
    import numpy as np
    import attn_fast as af
    from attn_fast import _core, masks, positional
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 512, 64)).astype(np.float32)     # prefill: threaded
    x = rng.standard_normal((1, 4096, 8, 64)).astype(np.float32)    # RoPE: 2M elements, threaded
    kc = rng.standard_normal((1, 8, 16384, 64)).astype(np.float32)  # append: 8M elements, threaded
    rope = positional.RoPE(64)
    af.set_num_threads(1)
    expect = (af.scaled_dot_product_attention(q, q, q, is_causal=True), rope(x),
              masks.BlockSparse.local(8192, 16, 3).layout)

    def cache_rows():
        c = af.KVCache(1, 8, 64, capacity=16384)
        c.append(kc, kc)
        return c.keys(0)

    def child_work():
        '''The child's parallel-sized calls; True if every one matches the parent's.'''
        got = (af.scaled_dot_product_attention(q, q, q, is_causal=True), rope(x),
               masks.BlockSparse.local(8192, 16, 3).layout)
        ok = all(np.array_equal(a, b) for a, b in zip(got, expect))
        ok = ok and np.array_equal(cache_rows(), kc[0])
        _core.read_bandwidth_gbs(2, 1 << 22, 0.01)
        return ok

    def run_child(work, deadline):
        '''Fork, run work() in the child, exit 0 if it returned True;
        the child's exit code, or "hang".'''
        pid = os.fork()
        if pid == 0:
            try:
                code = 0 if work() else 3
            except BaseException as e:  # noqa: BLE001
                print("child:", repr(e), file=sys.stderr, flush=True)
                code = 4
            os._exit(code)
        t0 = time.monotonic()
        while time.monotonic() - t0 < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "hang"

    af.set_num_threads(2)
"""

ORIGINS = {
    "own_kernel": "af.scaled_dot_product_attention(q, q, q)",
    "cython_rope": "positional.RoPE(64)(np.random.rand(1, 4096, 8, 64).astype(np.float32))",
    "kv_cache_append": "cache_rows()",
    "blocksparse_constructor": "masks.BlockSparse.local(8192, 16, 3)",
    "torch_parallel_op": (
        "import torch; torch.set_num_threads(2); torch.rand(4_000_000).exp_().sum()"
    ),
    "fma_probe": "_core.fma_peak_gflops(2, 0.02)",
    "read_probe": "_core.read_bandwidth_gbs(2, 1 << 22, 0.01)",
    "stream_probe": "_core.stream_read_gbps(2, 1 << 22, 2)",
}


def run_script(body, timeout=2 * DEADLINE + 60):
    """Run PRELUDE + body in a fresh interpreter (own session: a hung grandchild is killed too)."""
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    env = dict(
        os.environ, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="1"
    )  # only the origin starts threads
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"the script hung (killed after {timeout} s)\n{err}")
    return p.returncode, out, err


@pytest.mark.parametrize("origin", sorted(ORIGINS))
def test_child_after_each_pool_origin_finishes_with_the_right_answer(origin):
    if origin == "torch_parallel_op":
        pytest.importorskip("torch")
    body = f"""
    {ORIGINS[origin]}
    print(run_child(lambda: child_work() and af.get_num_threads() == (1 if {LIBGOMP} else 2)
                    and _core.forked_child_serial() == {LIBGOMP}, {DEADLINE}))
    print(_core.forked_child_serial(), af.get_num_threads())
    """
    rc, out, err = run_script(body)
    assert rc == 0, err
    child, parent = out.split()[0], out.split()[1:]
    assert child == "0", (
        f"child of a process after {origin}: {child} (3 = wrong answer or thread count)\n{err}"
    )
    assert parent == ["False", "2"]  # the parent itself keeps its threads


def test_grandchild_of_a_threaded_process_finishes():
    # The child inherits the dead pool; its own children must stay serial too
    # (the child itself has one thread, so only the inherited mark says so).
    body = f"""
    positional.RoPE(64)(x)
    grandchild = lambda: run_child(child_work, {DEADLINE}) == 0 and child_work()
    print(run_child(grandchild, {DEADLINE} + 10))
    """
    rc, out, err = run_script(body)
    assert rc == 0, err
    assert out.split() == ["0"], err


def test_multiprocessing_fork_pool_after_rope():
    body = """
    import multiprocessing as mp
    positional.RoPE(64)(np.random.rand(1, 4096, 8, 64).astype(np.float32))

    def job(i):
        return child_work(), af.get_num_threads()

    with mp.get_context("fork").Pool(2) as pool:
        res = pool.map_async(job, range(4)).get(timeout=DEADLINE_S)
    print(all(ok for ok, _ in res), sorted(set(n for _, n in res)))
    """.replace("DEADLINE_S", str(DEADLINE))
    rc, out, err = run_script(body)
    assert rc == 0, err
    ok, threads = out.strip().split(" ", 1)
    assert ok == "True", err
    if LIBGOMP:
        assert threads == "[1]"


def test_child_of_a_single_threaded_parent_keeps_its_threads():
    # The rule is about the parent: nothing threaded ran and only one thread
    # existed (no BLAS pool started: OPENBLAS_NUM_THREADS=1), so the child is
    # not marked and runs its own fresh pool.
    code = textwrap.dedent("""
        import os, numpy as np, attn_fast as af
        assert len(os.listdir("/proc/self/task")) == 1, os.listdir("/proc/self/task")
        pid = os.fork()
        if pid == 0:
            q = np.random.default_rng(0).standard_normal((1, 4, 512, 64)).astype(np.float32)
            af.scaled_dot_product_attention(q, q, q)
            os._exit(0 if af.get_num_threads() == 2 and not af._core.forked_child_serial() else 3)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc to count threads")
    env = dict(os.environ, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="1", OMP_WAIT_POLICY="passive")
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    if "AssertionError" in r.stderr:
        pytest.skip(
            f"the interpreter starts threads at import here: {r.stderr.strip().splitlines()[-1]}"
        )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"
