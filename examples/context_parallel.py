"""Context-parallel causal attention over a long sequence, one shard per rank.

    torchrun --standalone --nproc-per-node=2 examples/context_parallel.py
    torchrun --standalone --nproc-per-node=4 examples/context_parallel.py --seq-len 32768 --check
    # across hosts, unchanged (run on every host):
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 \\
        examples/context_parallel.py --seq-len 262144

Each rank holds L/P rows of q, k, v (the zigzag layout by default: chunks r
and 2P-1-r of 2P), runs ``attn_fast.distributed.ring_attention`` (or
``ulysses_attention`` with --method ulysses) and prints its time, compute
time, time spent waiting for K/V, bytes sent and (query, key) pairs computed.
--check gathers the output on rank 0 and compares it with single-process
attn_fast on the whole sequence (needs the whole sequence in memory there);
--backward also times the backward pass. The process group is gloo (CPU
tensors); set GLOO_SOCKET_IFNAME to pick the network interface across hosts.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist

import attn_fast as af
from attn_fast import distributed as cp


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--seq-len", type=int, default=16384, help="global sequence length L (multiple of 2P)"
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA); default: --heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--method", choices=("ring", "ulysses"), default="ring")
    ap.add_argument("--layout", choices=cp.LAYOUTS, default="zigzag")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--threads", type=int, default=1, help="attn_fast / torch threads per rank")
    ap.add_argument(
        "--check", action="store_true", help="compare with one-process attention on rank 0"
    )
    ap.add_argument("--backward", action="store_true", help="time the backward pass too")
    a = ap.parse_args()

    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(a.threads)
    af.set_num_threads(a.threads)
    H, Hkv, d, L = a.heads, a.kv_heads or a.heads, a.head_dim, a.seq_len
    dt = getattr(torch, a.dtype)
    if L % (2 * P):
        raise SystemExit(f"--seq-len {L} must be a multiple of 2P = {2 * P}")
    n = L // P

    def make(heads, seed):
        """This rank's shard of one global tensor (and, with --check, the whole tensor)."""
        if a.check:  # the same whole tensor on every rank, then this rank's rows of it
            whole = torch.randn(
                (a.batch, heads, L, d), generator=torch.Generator().manual_seed(seed), dtype=dt
            )
            return cp.shard_sequence(whole, rank, P, a.layout), whole
        # otherwise only the shard itself: memory O(L/P) per rank
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        return torch.randn((a.batch, heads, n, d), generator=g, dtype=dt), None

    (q, qw), (k, kw), (v, vw) = make(H, 1), make(Hkv, 2), make(Hkv, 3)
    if a.backward:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    kwargs = dict(is_causal=True, layout=a.layout, enable_gqa=Hkv != H)

    dist.barrier()
    t0 = time.perf_counter()
    if a.method == "ring":
        out, stats = cp.ring_attention(q, k, v, return_stats=True, **kwargs)
    else:
        out, stats = cp.ulysses_attention(q, k, v, **kwargs), None
    t_fwd = time.perf_counter() - t0
    t_bwd = float("nan")
    if a.backward:
        t0 = time.perf_counter()
        out.sum().backward()
        t_bwd = time.perf_counter() - t0
    row = dict(rank=rank, fwd_s=t_fwd, bwd_s=t_bwd)
    if stats is None:  # Ulysses: q, k, v out and o back, each all_to_all keeping 1/P of it here
        nbytes = sum(x.numel() * x.element_size() for x in (q, k, v, out))
        row.update(sent_mb=nbytes * (P - 1) / P / 2**20)
    else:
        row.update(
            compute_s=stats.compute_s,
            wait_s=stats.wait_s,
            sent_mb=stats.bytes_sent / 2**20,
            pairs=stats.pairs,
        )
    rows = [None] * P
    dist.all_gather_object(rows, row)

    outs = [torch.empty_like(out) for _ in range(P)] if a.check else None
    if a.check:
        dist.all_gather(outs, out.detach().contiguous())
    if rank == 0:
        print(
            f"attn_fast {af.__version__} | {a.method} | P={P} | L={L} B={a.batch} H={H} "
            f"H_kv={Hkv} d={d} "
            f"{a.dtype} causal | layout {a.layout} | isa {af.get_isa()} | threads/rank {a.threads}"
        )
        print(
            f"{'rank':>4} {'fwd [s]':>9} {'compute':>9} {'wait':>9} {'sent MiB':>9} {'pairs':>13} "
            f"{'bwd [s]':>9}"
        )
        for r in rows:
            print(
                f"{r['rank']:4d} {r['fwd_s']:9.3f} {r.get('compute_s', float('nan')):9.3f} "
                f"{r.get('wait_s', float('nan')):9.3f} {r.get('sent_mb', float('nan')):9.2f} "
                f"{r.get('pairs', 0):13d} {r['bwd_s']:9.3f}"
            )
        if stats is not None:
            comp = [r["compute_s"] for r in rows]
            print(
                f"compute: slowest rank / mean = {max(comp) / np.mean(comp):.3f}; "
                "pairs: max / mean = "
                f"{max(r['pairs'] for r in rows) / np.mean([r['pairs'] for r in rows]):.3f}"
            )
        if a.check:
            whole = cp.gather_sequence(outs, a.layout)
            one = af.scaled_dot_product_attention(
                qw.numpy(), kw.numpy(), vw.numpy(), is_causal=True, enable_gqa=Hkv != H
            )
            err = float(np.abs(whole.numpy() - one).max())
            print(f"check: max |{a.method} - one process| = {err:.2e}")
            if err > (1e-4 if a.dtype == "float32" else 1e-10):
                raise SystemExit("check failed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
