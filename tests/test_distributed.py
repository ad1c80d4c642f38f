"""Context-parallel attention (attn_fast.distributed) on 2 and 4 gloo ranks over loopback.

A module-scoped cluster of P ranks (this file run as a script, ``--launch``,
which imports torch once and forks the ranks) joins one gloo process group on
127.0.0.1 and then serves test cases sent over the launcher's stdin, one JSON
line each; every rank answers one JSON line. Each case builds the whole
sequence from a seed on every rank, shards it, runs the distributed function
and compares its shard with single-process attn_fast and the float64 oracle
(gradients: with torch autograd through a float64 reference). Every exchange
has a deadline; on a timeout or a dead worker all workers are killed and the
test fails, so nothing hangs CI.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attn_fast as af  # noqa: E402
from attn_fast import reference as ref  # noqa: E402

STARTUP_S = 60  # one torch import and P gloo joins on 2 shared cores
CASE_S = 30

# ---------------------------------------------------------------- the worker side


def _inputs(seed, B, H, Hkv, L, d, dv, dtype):
    g = np.random.default_rng(seed)
    q = g.standard_normal((B, H, L, d))
    k = g.standard_normal((B, Hkv, L, d))
    v = g.standard_normal((B, Hkv, L, dv))
    dt = torch.float32 if dtype == "float32" else torch.float64
    return [torch.from_numpy(x).to(dt) for x in (q, k, v)]


def _vis(L, causal, window):
    vis = np.ones((L, L), dtype=bool)
    if causal:
        vis &= ref.causal_mask(L, L)
    if window is not None:
        left, right = window
        vis &= ref.window_mask(L, L, left, right)
    return vis


def _tols(dtype):
    return dict(rtol=2e-4, atol=2e-5) if dtype == "float32" else dict(rtol=1e-10, atol=1e-11)


def _call(fn, q, k, v, causal, layout, window, gqa, **kw):
    from attn_fast import distributed as cp

    f = cp.ring_attention if fn == "ring" else cp.ulysses_attention
    return f(
        q,
        k,
        v,
        is_causal=causal,
        layout=layout,
        window_size=None if window is None else tuple(window),
        enable_gqa=gqa,
        **kw,
    )


def case_forward(rank, P, seed, B, H, Hkv, L, d, dv, dtype, causal, layout, window, fn="ring"):
    from attn_fast import distributed as cp

    q, k, v = _inputs(seed, B, H, Hkv, L, d, dv, dtype)
    sh = [cp.shard_sequence(x, rank, P, layout) for x in (q, k, v)]
    sh = [
        x.transpose(-1, -2).contiguous().transpose(-1, -2) if i == 1 else x
        for i, x in enumerate(sh)
    ]  # strided k
    out, lse = _call(fn, *sh, causal, layout, window, Hkv != H, return_lse=True)
    assert out.dtype == q.dtype and out.shape == (B, H, L // P, dv) and lse.shape == (B, H, L // P)
    one, one_lse = af.scaled_dot_product_attention(
        q.numpy(),
        k.numpy(),
        v.numpy(),
        is_causal=causal,
        window_size=None if window is None else tuple(window),
        enable_gqa=Hkv != H,
        return_lse=True,
    )
    o64, l64 = ref.sdpa(
        q.numpy(), k.numpy(), v.numpy(), mask=_vis(L, causal, window), return_lse=True
    )
    pos = cp.positions(rank, P, L // P, layout)
    tl = _tols(dtype)
    np.testing.assert_allclose(out.numpy(), one[:, :, pos], **tl)
    np.testing.assert_allclose(lse.numpy(), one_lse[:, :, pos], **tl)
    np.testing.assert_allclose(out.numpy(), o64[:, :, pos], **tl)
    np.testing.assert_allclose(lse.numpy(), l64[:, :, pos], **tl)
    return {"err": float(np.abs(out.numpy() - o64[:, :, pos]).max())}


def _torch_reference(q, k, v, causal, window, g):
    """Whole-sequence attention in torch ops (autograd), float64."""
    L, d = q.shape[-2], q.shape[-1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    S = q @ k.transpose(-1, -2) / d**0.5
    S = S.masked_fill(~torch.from_numpy(_vis(L, causal, window)), float("-inf"))
    return torch.softmax(S, dim=-1) @ v


def case_grad(rank, P, seed, B, H, Hkv, L, d, dv, dtype, causal, layout, window, fn="ring"):
    from attn_fast import distributed as cp

    q, k, v = _inputs(seed, B, H, Hkv, L, d, dv, dtype)
    dout = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal((B, H, L, dv)))
    q64, k64, v64 = (x.detach().clone().double().requires_grad_() for x in (q, k, v))
    (_torch_reference(q64, k64, v64, causal, window, H // Hkv) * dout).sum().backward()
    sh = [cp.shard_sequence(x, rank, P, layout).requires_grad_() for x in (q, k, v)]
    out = _call(fn, *sh, causal, layout, window, Hkv != H)
    (out * cp.shard_sequence(dout, rank, P, layout).to(out.dtype)).sum().backward()
    tl = _tols(dtype) if dtype == "float64" else dict(rtol=1e-3, atol=1e-4)
    for name, mine, full in zip("qkv", sh, (q64, k64, v64)):
        assert mine.grad is not None and mine.grad.dtype == mine.dtype, name
        np.testing.assert_allclose(
            mine.grad.numpy(),
            cp.shard_sequence(full.grad, rank, P, layout).numpy(),
            err_msg=f"d{name}",
            **tl,
        )
    return {}


def case_stats(rank, P, L, causal, layout, window=None):
    from attn_fast import distributed as cp

    q, k, v = _inputs(7, 1, 2, 2, L, 8, 8, "float32")
    sh = [cp.shard_sequence(x, rank, P, layout) for x in (q, k, v)]
    _, st = cp.ring_attention(
        *sh,
        is_causal=causal,
        layout=layout,
        return_stats=True,
        window_size=None if window is None else tuple(window),
    )
    return {
        "pairs": st.pairs,
        "blocks": st.blocks,
        "skipped": st.skipped,
        "bytes_sent": st.bytes_sent,
        "nbytes_kv": (sh[1].numel() + sh[2].numel()) * 4,
    }


def case_mask(rank, P, seed, L):
    """Ulysses with mask objects, a per-head additive array and ALiBi:
    the local call does it all."""
    from attn_fast import distributed as cp
    from attn_fast import masks

    B, H = 2, 2 * P
    q, k, v = _inputs(seed, B, H, H, L, 8, 8, "float64")
    g = np.random.default_rng(seed + 2)
    bias = g.standard_normal((1, H, L, L))
    slopes = g.uniform(0.01, 0.5, H)
    kv_lens = np.array([L, L - 3])
    mask = [masks.Padding(kv_lens=kv_lens) & masks.Causal(), bias]
    sh = [cp.shard_sequence(x, rank, P, "zigzag") for x in (q, k, v)]
    pos = cp.positions(rank, P, L // P, "zigzag")
    with torch.no_grad():
        out = cp.ulysses_attention(*sh, mask, alibi_slopes=slopes)
    one = af.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), mask, alibi_slopes=slopes
    )
    np.testing.assert_allclose(out.numpy(), one[:, :, pos], rtol=1e-10, atol=1e-11)
    # Gradients with the same mask, ALiBi and a softcap: the single-process fused backward
    # (itself checked against the textbook oracle in test_backward.py) on the whole sequence.
    opts = dict(alibi_slopes=slopes, softcap=3.0)
    sh = [x.clone().requires_grad_() for x in sh]
    out = cp.ulysses_attention(*sh, mask, **opts)
    dout = torch.from_numpy(g.standard_normal((B, H, L, 8)))
    (out * dout[:, :, pos]).sum().backward()
    o1, l1 = af.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), mask, return_lse=True, **opts
    )
    grads = af.scaled_dot_product_attention_backward(
        dout.numpy(), q.numpy(), k.numpy(), v.numpy(), o1, l1, mask, **opts
    )
    for name, mine, full in zip("qkv", sh, grads):
        np.testing.assert_allclose(
            mine.grad.numpy(), full[:, :, pos], rtol=1e-9, atol=1e-11, err_msg=f"d{name}"
        )
    return {}


def case_error(rank, P, what):
    """Run one bad call (the same on every rank unless `what` says otherwise);
    report the exception."""
    from attn_fast import distributed as cp

    q, k, v = _inputs(3, 1, 4, 4, 8 * P, 4, 4, "float32")
    sh = [cp.shard_sequence(x, rank, P, "contiguous") for x in (q, k, v)]
    kw = dict(layout="contiguous")
    fn = cp.ring_attention
    if what == "shapes":  # rank 0 holds a longer shard than the others
        sh = [x[:, :, :6] if rank else x for x in sh]
    elif what == "options":
        kw["is_causal"] = rank == 0
    elif what == "function":  # rank 0 calls the ring, the others Ulysses
        fn = cp.ring_attention if rank == 0 else cp.ulysses_attention
    elif what == "odd_zigzag":
        sh, kw = [x[:, :, :3] for x in sh], {"layout": "zigzag"}
    elif what == "layout":
        kw["layout"] = "striped"
    elif what == "numpy":
        sh[0] = sh[0].numpy()
    elif what == "device":
        sh[2] = torch.empty(sh[2].shape, device="meta")
    elif what == "int":
        sh[1] = sh[1].to(torch.int32)
    elif what == "gqa":
        sh[1], sh[2] = sh[1][:, :2], sh[2][:, :2]
    elif what == "qk_len":
        sh[0] = sh[0][:, :, :4]
    elif what == "heads":
        fn = cp.ulysses_attention
        sh = [x[:, :3] for x in sh]
    elif what == "window":
        kw["window_size"] = (2.5, 0)
    elif what == "ulysses_grad_sinks":
        fn = cp.ulysses_attention
        kw["sinks"] = torch.zeros(sh[0].shape[1], requires_grad=True)
    try:
        fn(*sh, **kw)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return {"type": type(e).__name__, "msg": str(e)}
    return {"type": None, "msg": ""}


_SUBGROUPS: dict = {}


def case_subgroup(rank, P, seed, fn):
    """Two halves of the world, each its own group: ranks are group ranks, peers global ranks."""
    import torch.distributed as dist

    from attn_fast import distributed as cp

    if P not in _SUBGROUPS:  # every rank creates every group, once
        _SUBGROUPS[P] = [
            dist.new_group(list(range(P // 2))),
            dist.new_group(list(range(P // 2, P))),
        ]
    half = rank // (P // 2)
    group, grank, gP = _SUBGROUPS[P][half], rank % (P // 2), P // 2
    q, k, v = _inputs(seed + half, 1, 2, 2, 4 * gP, 4, 4, "float64")
    f = cp.ring_attention if fn == "ring" else cp.ulysses_attention
    out = f(*(cp.shard_sequence(x, grank, gP) for x in (q, k, v)), is_causal=True, group=group)
    one = af.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), is_causal=True)
    np.testing.assert_allclose(
        out.numpy(), one[:, :, cp.positions(grank, gP, 4)], rtol=1e-10, atol=1e-11
    )
    return {}


def case_hang(rank, P, seconds):
    """Rank 0 stalls (as a rank stuck in a collective would): the parent must kill everything."""
    if rank == 0:
        time.sleep(seconds)
    return {}


CASES = {
    f.__name__[5:]: f
    for f in (case_forward, case_grad, case_stats, case_mask, case_error, case_hang, case_subgroup)
}


def _worker(rank, P, port, rfile, wfile):
    """One rank: join the gloo group, then answer each case line of rfile with one line on wfile."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    af.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=P,
        timeout=datetime.timedelta(seconds=CASE_S),
    )
    wfile.write("ready\n")
    wfile.flush()
    for line in rfile:
        case = json.loads(line)
        try:
            res = {"ok": True, **CASES[case["name"]](rank, P, **case["args"])}
        except Exception as e:  # noqa: BLE001 - reported to the parent
            res = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "tb": traceback.format_exc()[-3000:],
            }
        wfile.write(json.dumps(res) + "\n")
        wfile.flush()


def _launcher(P, port):
    """Import torch once, fork the P ranks, relay each case to all of them and their answers back.

    Forking after the imports (before any compute, so no thread pool exists
    yet) starts the ranks in well under a second instead of P torch imports.
    The parent kills this process group on a timeout, ranks included."""
    kids = []
    for r in range(P):
        from_parent, to_r = os.pipe()  # (read end, write end)
        from_r, to_parent = os.pipe()
        if os.fork() == 0:
            os.close(to_r)
            os.close(from_r)
            for _, a, b in kids:
                a.close()
                b.close()
            code = 0
            try:
                _worker(r, P, port, os.fdopen(from_parent, "r"), os.fdopen(to_parent, "w"))
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(from_parent)
        os.close(to_parent)
        kids.append((r, os.fdopen(to_r, "w"), os.fdopen(from_r, "r")))

    def answers():
        out = []
        for r, _, rf in kids:
            line = rf.readline()
            if not line:
                raise SystemExit(f"rank {r} exited")
            out.append(line)
        return out

    answers()
    print("@@READY", flush=True)
    for line in sys.stdin:
        for _, wf, _ in kids:
            wf.write(line)
            wf.flush()
        print("@@RESULT [" + ",".join(x.strip() for x in answers()) + "]", flush=True)
    for _, wf, _ in kids:
        wf.close()
    for _ in kids:
        os.wait()


# ---------------------------------------------------------------- the parent side


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """P ranks in one gloo group behind one launcher process; run() sends a case to all, returns
    their answers."""

    def __init__(self, P):
        self.P = P
        env = dict(
            os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1"
        )
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--launch", str(P), str(_free_port())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=env,
            start_new_session=True,
        )
        self.buf = b""
        self.dead = False
        self._read("@@READY", STARTUP_S)

    def _fail(self, why):
        self.close(kill=True)
        self.err.seek(0)
        tail = self.err.read()[-4000:]
        self.err.close()
        pytest.fail(f"{why}\n--- workers' stderr ---\n{tail}")

    def _read(self, prefix, timeout):
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                if line.startswith(prefix.encode()):
                    return line[len(prefix) :].decode().strip()
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(
                    f"timeout after {timeout} s waiting for {prefix} from the {self.P} ranks"
                )
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    self._fail(
                        f"the ranks' launcher exited (code {self.proc.poll()}) before {prefix}"
                    )
                self.buf += chunk

    def run(self, name, timeout=CASE_S, **args):
        if self.dead:
            pytest.fail("the cluster was killed by an earlier failure")
        try:
            self.proc.stdin.write((json.dumps({"name": name, "args": args}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._fail("the ranks' launcher died")
        return json.loads(self._read("@@RESULT", timeout))

    def check(self, name, **args):
        res = self.run(name, **args)
        bad = [f"rank {r}: {x['error']}\n{x['tb']}" for r, x in enumerate(res) if not x["ok"]]
        if bad:
            pytest.fail("\n".join(bad))
        return res

    def close(self, kill=False):
        if self.dead:
            return
        self.dead = True
        try:
            self.proc.stdin.close()
            if not kill:
                self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None or kill:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the launcher and every rank it forked
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc.stdout.close()


_CLUSTERS: dict = {}


@pytest.fixture(params=[2, 4], ids=["P2", "P4"])
def cluster(request):
    """The P-rank cluster, started once per module and again after a failure killed it."""
    P = request.param
    c = _CLUSTERS.get(P)
    if c is None or c.dead:
        try:
            c = Cluster(P)
        except (
            pytest.fail.Exception
        ):  # e.g. the free port was taken before rank 0 bound it: once more
            c = Cluster(P)
        _CLUSTERS[P] = c
    yield c


def teardown_module(module):
    for c in _CLUSTERS.values():
        c.close()
        c.err.close()
    _CLUSTERS.clear()


def _seed(*parts):
    return zlib.crc32(repr(parts).encode()) % (1 << 30)


# ---------------------------------------------------------------- tests: exactness

# (B, H, H_kv, L / (2P) chunk, d, dv)
_SHAPES = {"mha": (1, 2, 2, 3, 8, 8), "gqa": (2, 4, 2, 2, 5, 3), "odd_d": (1, 1, 1, 5, 1, 7)}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", list(_SHAPES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_ring_forward_matches_single_process(cluster, layout, causal, shape, dtype):
    B, H, Hkv, c, d, dv = _SHAPES[shape]
    L = 2 * cluster.P * c
    cluster.check(
        "forward",
        seed=_seed(layout, causal, shape, dtype, cluster.P),
        B=B,
        H=H,
        Hkv=Hkv,
        L=L,
        d=d,
        dv=dv,
        dtype=dtype,
        causal=causal,
        layout=layout,
        window=None,
    )


@pytest.mark.parametrize("window", [(3, 0), (2, 5), (0, 0), (None, 1), (1, None), (100, 100)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_window_over_global_positions(cluster, window, causal, layout):
    cluster.check(
        "forward",
        seed=_seed(window, causal, layout),
        B=1,
        H=2,
        Hkv=1,
        L=4 * cluster.P * 3,
        d=4,
        dv=4,
        dtype="float64",
        causal=causal,
        layout=layout,
        window=list(window),
    )


def test_ring_long_shard_float32(cluster):
    # Shards longer than a kernel tile: the diagonal block runs the kernel's own causal path.
    cluster.check(
        "forward",
        seed=5,
        B=1,
        H=2,
        Hkv=2,
        L=cluster.P * 2 * 129,
        d=80,
        dv=80,
        dtype="float32",
        causal=True,
        layout="zigzag",
        window=None,
    )


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", ["mha", "gqa"])
def test_ulysses_forward_matches_single_process(cluster, layout, causal, shape):
    B, _, _, c, d, dv = _SHAPES[shape]
    H, Hkv = (
        (cluster.P, cluster.P) if shape == "mha" else (2 * cluster.P, 1)
    )  # GQA with H_kv < P: K/V repeated
    cluster.check(
        "forward",
        seed=_seed("u", layout, causal, shape),
        B=B,
        H=H,
        Hkv=Hkv,
        L=2 * cluster.P * c,
        d=d,
        dv=dv,
        dtype="float32",
        causal=causal,
        layout=layout,
        window=None,
        fn="ulysses",
    )


def test_ulysses_window_and_gqa_sharded_kv(cluster):
    P = cluster.P
    cluster.check(
        "forward",
        seed=11,
        B=1,
        H=2 * P,
        Hkv=P,
        L=4 * P,
        d=4,
        dv=6,
        dtype="float64",
        causal=True,
        layout="zigzag",
        window=[2, 0],
        fn="ulysses",
    )


def test_ulysses_masks_bias_alibi(cluster):
    cluster.check("mask", seed=_seed("mask", cluster.P), L=4 * cluster.P)


@pytest.mark.parametrize("fn", ["ring", "ulysses"])
def test_process_subgroups(cluster, fn):
    cluster.check("subgroup", seed=_seed("sub", fn, cluster.P), fn=fn)


# ---------------------------------------------------------------- tests: gradients


@pytest.mark.parametrize("fn", ["ring", "ulysses"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gradients_match_torch_autograd(cluster, fn, layout, causal):
    P = cluster.P
    H, Hkv = (2 * P, P) if fn == "ulysses" else (4, 2)
    cluster.check(
        "grad",
        seed=_seed("g", fn, layout, causal, P),
        B=1,
        H=H,
        Hkv=Hkv,
        L=4 * P,
        d=5,
        dv=3,
        dtype="float64",
        causal=causal,
        layout=layout,
        window=None,
        fn=fn,
    )


@pytest.mark.parametrize("fn", ["ring", "ulysses"])
def test_gradients_window_gqa_float32(cluster, fn):
    P = cluster.P
    cluster.check(
        "grad",
        seed=_seed("gw", fn, P),
        B=2,
        H=2 * P,
        Hkv=1,
        L=6 * P,
        d=4,
        dv=4,
        dtype="float32",
        causal=True,
        layout="zigzag",
        window=[3, 0],
        fn=fn,
    )


# ---------------------------------------------------------------- tests: work and skipping


def test_zigzag_causal_balances_visible_pairs(cluster):
    P, c = cluster.P, 8
    res = cluster.check("stats", L=2 * P * c, causal=True, layout="zigzag")
    pairs = [x["pairs"] for x in res]
    # Every rank sees (2P - 1) c^2 + c (c + 1) pairs per (batch, head): exactly balanced.
    assert pairs == [2 * ((2 * P - 1) * c * c + c * (c + 1))] * P
    assert sum(pairs) == 2 * (2 * P * c) * (2 * P * c + 1) // 2  # all causal pairs, each once
    # Per step 4 (query chunk, key chunk) blocks; the fully masked ones are skipped.
    assert all(x["blocks"] + x["skipped"] == 4 * P for x in res)
    assert (
        sum(x["blocks"] for x in res) == 2 * P * (2 * P + 1) // 2
    )  # the chunk pairs with key chunk <= query chunk
    assert all(x["bytes_sent"] == (P - 1) * x["nbytes_kv"] for x in res)


def test_contiguous_causal_is_unbalanced_and_skips(cluster):
    P, n = cluster.P, 8
    res = cluster.check("stats", L=P * n, causal=True, layout="contiguous")
    assert [x["blocks"] for x in res] == [r + 1 for r in range(P)]  # rank r sees ranks 0..r
    assert [x["skipped"] for x in res] == [P - 1 - r for r in range(P)]
    assert [x["pairs"] for x in res] == [2 * (r * n * n + n * (n + 1) // 2) for r in range(P)]


def test_window_skips_far_blocks(cluster):
    P = cluster.P
    res = cluster.check("stats", L=2 * P * 4, causal=True, layout="contiguous", window=[3, 0])
    assert [x["blocks"] for x in res] == [1] + [2] * (P - 1)  # own block and the previous one
    assert sum(x["pairs"] for x in res) == 2 * int(_vis(2 * P * 4, True, (3, 0)).sum())


# ---------------------------------------------------------------- tests: errors


@pytest.mark.parametrize(
    "what, exc, words",
    [
        ("shapes", "ValueError", "differ"),
        ("options", "ValueError", "differ"),
        ("function", "ValueError", "differ"),
        ("odd_zigzag", "ValueError", "even"),
        ("layout", "ValueError", "layout"),
        ("numpy", "TypeError", "torch.Tensor"),
        ("device", "TypeError", "meta"),
        ("int", "TypeError", "int32"),
        ("gqa", "ValueError", "enable_gqa"),
        ("qk_len", "ValueError", "same length"),
        ("heads", "ValueError", "H % P"),
        ("window", "ArgumentTypeError", "window_size[0]"),  # a TypeError and a ValueError
        ("ulysses_grad_sinks", "ValueError", "sinks as constants"),
    ],
)
def test_clear_errors_on_every_rank(cluster, what, exc, words):
    res = cluster.check("error", what=what)
    for r, x in enumerate(res):
        assert x["type"] == exc and words in x["msg"], f"rank {r}: {x}"
    # The group still works after the errors (no rank left waiting in a collective).
    cluster.check("stats", L=2 * cluster.P * 2, causal=True, layout="zigzag")


def _live_in_group(pgid):
    """Processes of process group pgid that are not zombies (Linux /proc; [] elsewhere)."""
    live = []
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(d))
    return live


def test_a_stalled_rank_is_killed_not_waited_for():
    c = Cluster(2)
    try:
        assert c.check("hang", seconds=0)[0]["ok"]
        assert len(_live_in_group(c.proc.pid)) == 3  # the launcher and its two ranks
        with pytest.raises(pytest.fail.Exception, match="timeout after 1 s"):
            c.run("hang", timeout=1, seconds=60)
        assert c.dead and c.proc.poll() is not None
        deadline = time.monotonic() + 5
        while _live_in_group(c.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _live_in_group(c.proc.pid)  # no rank of the group is left running
    finally:
        c.close(kill=True)
        c.err.close()


def test_not_initialised_raises():
    import torch.distributed as dist

    from attn_fast import distributed as cp

    assert not dist.is_initialized()
    q = torch.zeros(1, 1, 4, 2)
    for f in (cp.ring_attention, cp.ulysses_attention):
        with pytest.raises(RuntimeError, match="not initialised"):
            f(q, q, q)


# ---------------------------------------------------------------- tests: in-process pieces


def test_band_matches_dense_mask():
    from attn_fast._dist_ring import _band, _band_pairs

    for nq in range(1, 6):
        for nk in range(1, 6):
            for lo in [None, *range(-6, 7)]:
                for hi in [None, *range(-6, 7)]:
                    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
                    want = np.ones((nq, nk), bool)
                    if lo is not None:
                        want &= j - i >= lo
                    if hi is not None:
                        want &= j - i <= hi
                    got = np.zeros_like(want)
                    b = _band(nq, nk, lo, hi)
                    if b is not None:
                        r0, r1, s0, s1, w = b
                        sub = np.ones((r1 - r0, s1 - s0), bool)
                        if w is not None:
                            sub = ref.window_mask(r1 - r0, s1 - s0, w[0], w[1])
                            assert all(x is None or x >= 0 for x in w)
                        got[r0:r1, s0:s1] = sub
                    assert (got == want).all(), (nq, nk, lo, hi, b)
                    assert _band_pairs(nq, nk, lo, hi) == want.sum()


def test_merge_matches_merge_attention_states(rng):
    from attn_fast._dist_ring import _merge_

    oa, ob = rng.standard_normal((2, 3, 7, 5))
    la, lb = rng.standard_normal((2, 3, 7)) * 3
    la[0, :2] = -np.inf
    lb[0, 1:3] = -np.inf
    ob[0, 1] = np.nan  # an empty part's o is not read
    want_o, want_l = af.merge_attention_states(oa, la, ob, lb)
    acc_o, acc_l = torch.from_numpy(oa.copy()), torch.from_numpy(la.copy())
    acc_o[0, :2] = 0  # an accumulator with lse = -inf holds zeros
    _merge_(acc_o, acc_l, torch.from_numpy(ob), torch.from_numpy(lb))
    np.testing.assert_allclose(acc_o.numpy(), want_o, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(
        acc_l.numpy(), want_l, rtol=1e-14, atol=1e-14
    )  # -inf where both are empty
    assert torch.isneginf(acc_l[0, 1]) and (acc_o[0, 1] == 0).all()


@pytest.mark.parametrize("window", [None, (None, 0), (2, 1), (0, None)])
def test_local_backward_is_torch_autograd_of_the_block(rng, window):
    """local_backward (the fused kernel on NumPy views) gives torch autograd's
    dq, dk, dv for one block."""
    from attn_fast._dist_common import local_backward

    q, dout = (torch.from_numpy(rng.standard_normal((1, 4, 5, 3))) for _ in range(2))
    k, v = (torch.from_numpy(rng.standard_normal((1, 2, 7, 3))) for _ in range(2))
    causal = window == (None, 0)
    kw = dict(is_causal=causal, scale=0.4, enable_gqa=True, window_size=None if causal else window)
    out, lse = af.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), return_lse=True, **kw
    )
    got = local_backward(dout, q, k, v, torch.from_numpy(out), torch.from_numpy(lse), **kw)
    q2, k2, v2 = (x.clone().requires_grad_() for x in (q, k, v))
    S = q2 @ k2.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.4
    vis = torch.from_numpy(ref.window_mask(5, 7, *(window or (None, None))))
    (
        torch.softmax(S.masked_fill(~vis, float("-inf")), -1)
        @ v2.repeat_interleave(2, dim=1)
        * dout
    ).sum().backward()
    for a, b in zip(got, (q2.grad, k2.grad, v2.grad)):
        assert isinstance(a, torch.Tensor) and a.dtype == torch.float64
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_and_gather_round_trip(layout):
    from attn_fast import distributed as cp

    x = torch.arange(2 * 24 * 3, dtype=torch.float64).view(2, 24, 3)
    shards = [cp.shard_sequence(x, r, 4, layout) for r in range(4)]
    assert torch.equal(cp.gather_sequence(shards, layout), x)
    pos = np.concatenate([cp.positions(r, 4, 6, layout) for r in range(4)])
    assert sorted(pos.tolist()) == list(range(24))
    if layout == "zigzag":
        assert cp.positions(1, 4, 6).tolist() == [3, 4, 5, 18, 19, 20]  # chunks 1 and 2P-1-1 = 6
    with pytest.raises(ValueError, match="multiple of 8"):
        cp.shard_sequence(x[:, :20], 0, 4, layout="zigzag")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_and_gather_numpy_arrays(layout, rng):
    """NumPy arrays shard and gather like tensors (same rows, same dtype, NumPy out)."""
    from attn_fast import distributed as cp

    x = rng.standard_normal((2, 3, 16, 5)).astype(np.float32)
    shards = [cp.shard_sequence(x, r, 2, layout) for r in range(2)]
    for r, sh in enumerate(shards):
        assert isinstance(sh, np.ndarray) and sh.dtype == np.float32 and sh.shape == (2, 3, 8, 5)
        want = cp.shard_sequence(torch.from_numpy(x), r, 2, layout).numpy()
        assert np.array_equal(sh, want)
    back = cp.gather_sequence(shards, layout)
    assert isinstance(back, np.ndarray) and np.array_equal(back, x)
    xt = x.transpose(0, 2, 1, 3)  # the sequence on axis 1, non-contiguous
    assert np.array_equal(
        cp.gather_sequence(
            [cp.shard_sequence(xt, r, 2, layout, dim=1) for r in range(2)], layout, dim=1
        ),
        xt,
    )


def test_shard_and_gather_bad_input():
    from attn_fast import distributed as cp

    x = np.zeros((1, 8, 4), np.float32)
    with pytest.raises(TypeError, match="x must be a torch tensor or a NumPy array"):
        cp.shard_sequence(x.tolist(), 0, 2)
    with pytest.raises(ValueError, match="rank = 2 must be below world_size = 2"):
        cp.shard_sequence(x, 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        cp.shard_sequence(x, 0, 0)
    with pytest.raises(ValueError, match="dim = 3 is not an axis of x"):
        cp.shard_sequence(x, 0, 2, dim=3)
    with pytest.raises(ValueError, match="shards is empty"):
        cp.gather_sequence([])
    with pytest.raises(TypeError, match="mixes torch tensors and NumPy arrays"):
        cp.gather_sequence([x, torch.from_numpy(x)])
    with pytest.raises(ValueError, match="one shape"):
        cp.gather_sequence([x, x[:, :4]])


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--launch":
    _launcher(int(sys.argv[2]), int(sys.argv[3]))
