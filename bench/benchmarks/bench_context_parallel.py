"""Ring attention on this host: per-rank compute, communication and their overlap, P = 1, 2, 4.

    python bench/benchmarks/bench_context_parallel.py         # L = 8192, H = 4, d = 64, causal
    python bench/benchmarks/bench_context_parallel.py --seq-len 4096 --ps 1,2 --reps 3

For each P, P ranks are forked (after the imports, before any compute) into one
gloo group on 127.0.0.1, and each rank first checks a small ring call against
one-process attention on the whole sequence, then times, median of --reps:

    ring       ring_attention(is_causal=True) on its shard: total, compute
               (local attention + merges, RingStats.compute_s) and wait (time
               left waiting for K/V after a step's compute)
    alone      the same blocks computed with no communication at all (the
               rank's K/V standing in for every other rank's), one rank at a
               time (the others wait at a barrier): wall time and CPU time of
               the computing thread (the work itself, whatever the load)
    comm       the P−1 ring steps of K/V alone (isend/irecv, no compute)

and reports per rank the visible (query, key) pairs it computed (the work,
exact), and per (P, layout): the slowest rank's work over the mean (pairs,
CPU time alone, compute time inside the ring), ring time over the slowest
rank's compute alone (wall; P ranks on
2 shared cores inflate it), the part of the communication hidden under compute,
1 − mean(wait) / mean(comm), and F
(FLOP/s per rank: 2(d + dv) FLOPs per visible pair over CPU time alone) and β (bytes/s per link,
K/V bytes per step over the time of one step of comm alone) for the model in
bench/README.md. Every rank runs one thread (attn_fast and torch).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import attn_fast as af
from attn_fast import _dist_ring
from attn_fast import distributed as cp
from attn_fast._dist_common import Cfg


def _cpu():
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compute_alone(q, k, v, cfg):
    """The ring's local work with no communication: every step's blocks against this rank's own K/V.

    Returns (wall seconds, CPU seconds of this thread: one thread per rank, so
    this is the work itself, not inflated by other jobs sharing the cores)."""
    B, H, n, _ = q.shape
    o = torch.zeros((B, H, n, v.shape[-1]), dtype=torch.float64)
    lse = torch.full((B, H, n), -np.inf, dtype=torch.float64)
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    t0, c0 = time.perf_counter(), time.thread_time()
    for step in range(cfg.world):
        for qs, ks, band, _ in _dist_ring._blocks(cfg, n, (cfg.rank - step) % cfg.world):
            if band is None:
                continue
            r0, r1, s0, s1, window = band
            ob, lb = af.scaled_dot_product_attention(
                qn[:, :, qs + r0 : qs + r1],
                kn[:, :, ks + s0 : ks + s1],
                vn[:, :, ks + s0 : ks + s1],
                return_lse=True,
                **_dist_ring._sdpa_kwargs(cfg, window),
            )
            _dist_ring._merge_(
                o[:, :, qs + r0 : qs + r1],
                lse[:, :, qs + r0 : qs + r1],
                torch.from_numpy(ob),
                torch.from_numpy(lb),
            )
    return time.perf_counter() - t0, time.thread_time() - c0


def _comm_alone(k, v, cfg):
    bufs = [_dist_ring._pack(k, v), None]
    bufs[1] = torch.empty_like(bufs[0])
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(cfg.world - 1):
        _dist_ring._wait(
            _dist_ring._exchange(cfg, bufs[step % 2], bufs[(step + 1) % 2], _dist_ring._TAG_KV)
        )
    return time.perf_counter() - t0


def _rank(rank, P, port, a, layout, queue):
    try:
        torch.set_num_threads(1)
        af.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P
        )
        # 1. validate: a small ring call against one process on the whole sequence
        g = torch.Generator().manual_seed(0)
        small = [torch.randn((1, a.heads, 2 * P * 16, a.head_dim), generator=g) for _ in range(3)]
        o = cp.ring_attention(
            *(cp.shard_sequence(x, rank, P, layout) for x in small), is_causal=True, layout=layout
        )
        one = af.scaled_dot_product_attention(*(x.numpy() for x in small), is_causal=True)
        err = float(np.abs(o.numpy() - one[:, :, cp.positions(rank, P, o.shape[2], layout)]).max())
        if err > 1e-4:
            raise RuntimeError(f"validation failed on rank {rank}: max error {err:.2e}")
        # 2. time
        n = a.seq_len // P
        g = torch.Generator().manual_seed(1 + rank)
        q, k, v = (torch.randn((a.batch, a.heads, n, a.head_dim), generator=g) for _ in range(3))
        cfg = Cfg(True, 1 / a.head_dim**0.5, False, None, layout, None, rank, P)
        ring, comp, wait, alone, cpu, comm = [], [], [], [], [], []
        for rep in range(a.reps + 1):  # the first is a warm-up
            dist.barrier()
            _, st = cp.ring_attention(q, k, v, is_causal=True, layout=layout, return_stats=True)
            for turn in range(P):  # one rank at a time, the others idle at the barrier
                dist.barrier()
                if turn == rank:
                    t_alone = _compute_alone(q, k, v, cfg)
            dist.barrier()
            t_comm = _comm_alone(k, v, cfg) if P > 1 else 0.0
            if rep:
                ring.append(st.total_s)
                comp.append(st.compute_s)
                wait.append(st.wait_s)
                alone.append(t_alone[0])
                cpu.append(t_alone[1])
                comm.append(t_comm)
        med = statistics.median
        queue.put(
            dict(
                rank=rank,
                err=err,
                pairs=st.pairs,
                bytes_step=(k.numel() + v.numel()) * k.element_size(),
                ring=med(ring),
                compute=med(comp),
                wait=med(wait),
                alone=med(alone),
                cpu=med(cpu),
                comm=med(comm),
            )
        )
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        queue.put(dict(rank=rank, error=f"{type(e).__name__}: {e}"))


def run(P, a, layout):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, P, port, a, layout, queue)) for r in range(P)]
    for p in procs:
        p.start()
    rows = []
    try:
        for _ in range(P):
            rows.append(queue.get(timeout=a.timeout))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    bad = [r["error"] for r in rows if "error" in r]
    if bad:
        raise SystemExit("; ".join(bad))
    return sorted(rows, key=lambda r: r["rank"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ps", default="1,2,4")
    ap.add_argument("--layouts", default="zigzag,contiguous")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--timeout", type=float, default=600, help="seconds to wait for each rank's result"
    )
    a = ap.parse_args()
    d = a.head_dim
    print(
        f"attn_fast {af.__version__} | isa {af.get_isa()} | 1 thread per rank | {_cpu()} | "
        f"{os.cpu_count()} CPUs | gloo on 127.0.0.1"
    )
    print(
        f"L={a.seq_len} B={a.batch} H=H_kv={a.heads} d=dv={d} float32 causal | median of {a.reps}"
    )
    print(
        f"{'P':>2} {'layout':>10} {'rank':>4} {'pairs':>11} {'alone[s]':>9} {'cpu[s]':>8} "
        f"{'ring[s]':>9} "
        f"{'compute':>9} {'wait':>8} {'comm[s]':>8}"
    )
    summary = []
    for P in (int(x) for x in a.ps.split(",")):
        for layout in a.layouts.split(","):
            if P == 1 and layout != "zigzag":
                continue  # one rank: the layouts are the same
            rows = run(P, a, layout)
            for r in rows:
                print(
                    f"{P:2d} {layout:>10} {r['rank']:4d} {r['pairs']:11d} {r['alone']:9.3f} "
                    f"{r['cpu']:8.3f} "
                    f"{r['ring']:9.3f} {r['compute']:9.3f} {r['wait']:8.3f} {r['comm']:8.3f}"
                )
            pairs = [r["pairs"] for r in rows]
            alone = [r["alone"] for r in rows]
            cpu = [r["cpu"] for r in rows]
            comp = [r["compute"] for r in rows]
            ring = max(r["ring"] for r in rows)
            comm = max(r["comm"] for r in rows)
            # the share of the K/V traffic that did not show up as waiting in the ring
            hidden = (
                float("nan")
                if P == 1
                else max(
                    0.0, 1 - np.mean([r["wait"] for r in rows]) / np.mean([r["comm"] for r in rows])
                )
            )
            F = statistics.median(2 * (d + d) * r["pairs"] / r["cpu"] for r in rows)
            beta = float("nan") if P == 1 else rows[0]["bytes_step"] * (P - 1) / comm
            summary.append(
                (
                    P,
                    layout,
                    max(pairs) / np.mean(pairs),
                    max(cpu) / np.mean(cpu),
                    max(comp) / np.mean(comp),
                    ring / max(alone),
                    hidden,
                    F,
                    beta,
                )
            )
    print()
    print(
        f"{'P':>2} {'layout':>10} {'pairs max/mean':>15} {'cpu max/mean':>15} "
        f"{'ring-compute max/mean':>22} "
        f"{'ring / alone':>13} {'comm hidden':>12} {'F [GFLOP/s]':>12} {'beta [GB/s]':>12}"
    )
    for P, layout, bp, ba, bc, ratio, hidden, F, beta in summary:
        print(
            f"{P:2d} {layout:>10} {bp:15.3f} {ba:15.3f} {bc:22.3f} {ratio:13.3f} {hidden:12.2f} "
            f"{F / 1e9:12.2f} {beta / 1e9:12.2f}"
        )


if __name__ == "__main__":
    main()
