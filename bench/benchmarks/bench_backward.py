"""Forward + backward of attn_fast against torch SDPA's CPU backward.

    python bench/benchmarks/bench_backward.py             # quick: 2 prefill shapes x causal, ~1 min
    python bench/benchmarks/bench_backward.py --full      # every prefill shape of the suite
    python bench/benchmarks/bench_backward.py --threads 2 --repeats 5 --no-memory
    python bench/benchmarks/bench_backward.py --dtype bfloat16  # 16-bit rows (float16 too)

For each prefill case of the benchmark suite (attn_fast._bench.cases,
float32): first checks that both give the same gradients (relative error
of dq, dk, dv), then times, interleaved in the same run (rotating order,
one call each per round), the medians of
  attn_fast : sdpa(..., return_lse=True) + scaled_dot_product_attention_backward
  torch     : F.scaled_dot_product_attention + torch.autograd.grad
and the backward alone (attn_fast's kernel on the saved out and lse; torch's
autograd on a retained graph), with its GFLOP/s (10·B·H·Lq·Lk·d, ×½ causal)
and % of the FMA peak measured in the same run, and the peak RSS growth of
one forward+backward in a fresh process. Then one
training step (forward, loss, backward, AdamW step) of a small torch
Transformer whose attention is torch's SDPA or attn_fast.torch's op.
Each line carries the ISA, thread count and CPU; on a shared machine quote
medians and the same-run ratio only.

``--dtype bfloat16`` / ``float16``: for the same cases, the backward alone
in that dtype, interleaved in one run: attn_fast 16-bit, attn_fast float32
(the same values), torch 16-bit and torch float32 (autograd on a retained
graph), with the 16-bit same-run ratios; and the accuracy of both 16-bit
backwards: the RMS error of dq, dk, dv (worst of the three, relative to the
gradient's RMS) against torch's float64 backward on the same rounded inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import attn_fast as af
from attn_fast._bench import cases as bs
from attn_fast._bench.measure import machine_limits, time_interleaved


def make_fns(case, threads):
    import torch

    torch.set_num_threads(threads)
    af.set_num_threads(threads)
    q, k, v = bs.make_inputs(case)
    do = np.random.default_rng(1).standard_normal(q.shape[:-1] + (v.shape[-1],), dtype=np.float32)

    def run_af():
        o, lse = af.scaled_dot_product_attention(q, k, v, is_causal=case.causal, return_lse=True)
        return af.scaled_dot_product_attention_backward(do, q, k, v, o, lse, is_causal=case.causal)

    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    tdo = torch.from_numpy(do)

    def run_torch():
        o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=case.causal)
        return torch.autograd.grad(o, (tq, tk, tv), tdo)

    return run_af, run_torch


def make_bwd_fns(case, threads):
    """The backward alone: attn_fast's kernel on a saved (out, lse); torch's autograd on a
    saved graph (retain_graph), both after one forward outside the timing."""
    import torch

    torch.set_num_threads(threads)
    af.set_num_threads(threads)
    q, k, v = bs.make_inputs(case)
    do = np.random.default_rng(1).standard_normal(q.shape[:-1] + (v.shape[-1],), dtype=np.float32)
    o, lse = af.scaled_dot_product_attention(q, k, v, is_causal=case.causal, return_lse=True)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    tdo = torch.from_numpy(do)
    to = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=case.causal)

    def bwd_af():
        return af.scaled_dot_product_attention_backward(do, q, k, v, o, lse, is_causal=case.causal)

    def bwd_torch():
        return torch.autograd.grad(to, (tq, tk, tv), tdo, retain_graph=True)

    return bwd_af, bwd_torch


def backward_flops(case):
    """10·B·H·Lq·Lk·d multiply-adds counted as FLOPs (five products of 2·Lq·Lk·d), ×½ causal."""
    f = 10.0 * case.B * case.Hq * case.Lq * case.Lk * case.d
    return f / 2 if case.causal else f


def check(run_af, run_torch):
    a = run_af()
    b = [x.numpy() for x in run_torch()]
    return max(float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)) for x, y in zip(a, b))


_MEM = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("bench_backward", sys.argv[4])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
make_fns = mod.make_fns
from attn_fast._bench.cases import Case
case = Case(**json.loads(sys.argv[1])); threads = int(sys.argv[3])
fns = dict(zip(("attn_fast", "torch"), make_fns(case, threads)))
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
before = status("VmRSS")
fns[sys.argv[2]]()
print(json.dumps({"grow": status("VmHWM") - before}))
"""


def peak_memory(case, impl, threads):
    import dataclasses

    try:
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                _MEM,
                json.dumps(dataclasses.asdict(case)),
                impl,
                str(threads),
                os.path.abspath(__file__),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        return max(0, json.loads(r.stdout.strip().splitlines()[-1])["grow"])
    except Exception:  # noqa: BLE001 - no figure when the child fails
        return None


def training_step_bench(threads, repeats, B=4, L=256, D=256, H=8, layers=4, vocab=512):
    """Median seconds of one training step of a small pre-norm causal Transformer per backend."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import attn_fast.torch as aft

    torch.set_num_threads(threads)
    af.set_num_threads(threads)

    class Block(nn.Module):
        def __init__(self, attn):
            super().__init__()
            self.attn = attn
            self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
            x = x + self.o(self.attn(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D))
            return x + self.ff(self.n2(x))

    def model(attn):
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Embedding(vocab, D),
            *[Block(attn) for _ in range(layers)],
            nn.LayerNorm(D),
            nn.Linear(D, vocab),
        )

    ids = torch.randint(0, vocab, (B, L + 1), generator=torch.Generator().manual_seed(0))
    steps, losses = {}, {}
    for name, attn in (
        ("torch", F.scaled_dot_product_attention),
        ("attn_fast", aft.scaled_dot_product_attention),
    ):
        m = model(attn)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

        def step(m=m, opt=opt, name=name):
            opt.zero_grad()
            loss = F.cross_entropy(m(ids[:, :-1]).reshape(-1, vocab), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            losses.setdefault(name, []).append(float(loss.detach()))

        steps[name] = step
    ts = time_interleaved(steps, repeats, warmup=1, cooldown=False)
    return {n: statistics.median(t) for n, t in ts.items()}, losses


def half_fns(case, threads, dtype):
    """The backward alone in 16-bit and in float32, for attn_fast and torch, on the same
    16-bit-rounded inputs (attn_fast reads the torch tensors zero-copy); and the worst
    relative RMS error of (attn_fast, torch) 16-bit gradients against float64."""
    import torch

    torch.set_num_threads(threads)
    af.set_num_threads(threads)
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    q, k, v = bs.make_inputs(case)  # float32, rounded below
    do = np.random.default_rng(1).standard_normal(q.shape[:-1] + (v.shape[-1],), dtype=np.float32)
    half = [torch.from_numpy(x).to(tdt) for x in (q, k, v, do)]
    f32 = [x.float() for x in half]  # the same values in float32
    fns, grads = {}, {}
    for tag, (tq, tk, tv, tdo) in (("16", half), ("32", f32)):
        o, lse = af.scaled_dot_product_attention(tq, tk, tv, is_causal=case.causal, return_lse=True)
        fns[f"af{tag}"] = lambda tq=tq, tk=tk, tv=tv, tdo=tdo, o=o, lse=lse: (
            af.scaled_dot_product_attention_backward(tdo, tq, tk, tv, o, lse, is_causal=case.causal)
        )
        lq, lk, lv = (x.clone().requires_grad_() for x in (tq, tk, tv))
        to = torch.nn.functional.scaled_dot_product_attention(lq, lk, lv, is_causal=case.causal)
        fns[f"torch{tag}"] = lambda to=to, g=(lq, lk, lv), tdo=tdo: torch.autograd.grad(
            to, g, tdo, retain_graph=True
        )
    l64 = [x.double().requires_grad_() for x in half[:3]]
    o64 = torch.nn.functional.scaled_dot_product_attention(*l64, is_causal=case.causal)
    want = torch.autograd.grad(o64, l64, half[3].double())

    def err(gs):
        return max(
            float(((g.double() - w).square().mean() / w.square().mean()).sqrt())
            for g, w in zip(gs, want)
        )

    grads = {"af": err(fns["af16"]()), "torch": err(fns["torch16"]())}
    return fns, grads


def half_main(a, cases):
    peak, _ = machine_limits(a.threads)
    print(
        f"attn_fast {af.__version__} | isa {af.get_isa()} | threads {a.threads} | "
        f"{af._config.cpu_model()} | backward in {a.dtype} vs float32 | medians of {a.repeats} "
        "interleaved runs (shared machine: compare ratios) | FP32 FMA peak "
        f"{peak:.0f} GFLOP/s"
    )
    print(
        f"{'case':34s} {'rms err af':>10s} {'torch':>8s} {'x':>5s} | {'af16 ms':>8s} "
        f"{'af32 ms':>8s} {'t16 ms':>8s} {'t32 ms':>8s} | {'af16 GF/s':>9s} {'af32/af16':>9s} "
        f"{'t16/af16':>8s}"
    )
    for case in cases:
        fns, e = half_fns(case, a.threads, a.dtype)
        ts = time_interleaved(fns, a.repeats, warmup=1, cooldown=False)
        m = {n: statistics.median(t) for n, t in ts.items()}
        gf = backward_flops(case) / m["af16"] / 1e9
        print(
            f"{case.name:34s} {e['af']:10.2e} {e['torch']:8.2e} {e['af'] / e['torch']:5.2f} | "
            f"{m['af16'] * 1e3:8.1f} {m['af32'] * 1e3:8.1f} {m['torch16'] * 1e3:8.1f} "
            f"{m['torch32'] * 1e3:8.1f} | {gf:9.1f} {m['af32'] / m['af16']:8.2f}x "
            f"{m['torch16'] / m['af16']:7.2f}x"
        )
        sys.stdout.flush()


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--full", action="store_true", help="every prefill shape of the suite (slow)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--no-train", action="store_true")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="float32: the table above; 16-bit: the backward in that dtype vs float32",
    )
    a = p.parse_args(argv)
    shapes = bs.PREFILL_SHAPES if a.full else bs.PREFILL_SHAPES[:2]
    cases = [
        bs.Case("prefill", B, H, H, L, L, d, c) for (B, H, L, d) in shapes for c in (False, True)
    ]
    if a.dtype != "float32":
        return half_main(a, cases)
    peak, _ = machine_limits(a.threads)
    print(
        f"attn_fast {af.__version__} | isa {af.get_isa()} | threads {a.threads} | "
        f"{af._config.cpu_model()} | float32 | "
        f"medians of {a.repeats} interleaved runs (shared machine: compare ratios) | FP32 FMA "
        f"peak {peak:.0f} GFLOP/s"
    )
    print(
        f"{'case':34s} {'max rel err':>11s} | {'fwd+bwd af ms':>13s} {'torch ms':>9s} {'x':>6s} | "
        f"{'bwd af ms':>9s} {'torch ms':>9s} {'x':>6s} {'af GF/s':>8s} {'%peak':>5s} | "
        f"{'af MiB':>6s} {'torch MiB':>9s}"
    )
    for case in cases:
        run_af, run_torch = make_fns(case, a.threads)
        err = check(run_af, run_torch)
        ts = time_interleaved(
            {"attn_fast": run_af, "torch": run_torch}, a.repeats, warmup=1, cooldown=False
        )
        med = {n: statistics.median(t) for n, t in ts.items()}
        bwd_af, bwd_torch = make_bwd_fns(case, a.threads)
        tb = time_interleaved(
            {"attn_fast": bwd_af, "torch": bwd_torch}, a.repeats, warmup=1, cooldown=False
        )
        mb = {n: statistics.median(t) for n, t in tb.items()}
        gf = backward_flops(case) / mb["attn_fast"] / 1e9
        mem = (
            {n: None for n in med}
            if a.no_memory
            else {n: peak_memory(case, n, a.threads) for n in med}
        )
        fmt = lambda b: "—" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
        print(
            f"{case.name:34s} {err:11.1e} | {med['attn_fast'] * 1e3:13.1f} "
            f"{med['torch'] * 1e3:9.1f} "
            f"{med['torch'] / med['attn_fast']:5.2f}x | {mb['attn_fast'] * 1e3:9.1f} "
            f"{mb['torch'] * 1e3:9.1f} "
            f"{mb['torch'] / mb['attn_fast']:5.2f}x {gf:8.1f} {100 * gf / peak:4.0f}% | "
            f"{fmt(mem['attn_fast']):>6s} {fmt(mem['torch']):>9s}"
        )
        sys.stdout.flush()
    if not a.no_train:
        t0 = time.perf_counter()
        med, losses = training_step_bench(a.threads, a.repeats)
        print(
            f"training step, 4-layer Transformer (B=4, L=256, D=256, 8 heads, causal, AdamW): "
            f"torch SDPA {med['torch'] * 1e3:.1f} ms, attn_fast.torch "
            f"{med['attn_fast'] * 1e3:.1f} ms "
            f"({med['torch'] / med['attn_fast']:.2f}x); first-step loss {losses['torch'][0]:.5f} "
            "vs "
            f"{losses['attn_fast'][0]:.5f} [{time.perf_counter() - t0:.0f} s]"
        )


if __name__ == "__main__":
    main()
