"""Scaling study: time and peak memory vs sequence length for the attention family.

    python bench/benchmarks/scaling.py            # L = 512 ... 65536, about 5-10 min on 2 cores
    python bench/benchmarks/scaling.py --quick    # L = 256 ... 2048, a smoke test (< 1 min)

Cases (B = 1, H heads, d = dv = 64, float32, self-attention Lq = Lk = L):
    textbook       the chapter in NumPy: S = QKᵀ/√d, softmax, ·V (L×L matrix)
    full           attn_fast.scaled_dot_product_attention
    causal         ... is_causal=True
    window256      ... is_causal=True, window_size=(255, 0)   (256 keys per row)
    sparse         ... attn_mask=BlockSparse.strided(L, 64, stride=√(L/64)) & Causal()
                   (Sparse Transformer: local band + every stride-th block, O(L√L))
    linformer256   attn_fast.variants.linformer_attention, k = 256
    linear         attn_fast.variants.linear_attention (elu+1), non-causal
    linear_causal  ... causal=True (the C++ prefix-sum sweep)

Each (case, L) runs in a fresh subprocess with --threads threads (default 1,
for attn_fast and BLAS alike). time is the process's CPU time (all its threads;
equal to wall time on an idle machine with one thread, and unlike wall time not
inflated when other jobs share the cores), best of a few runs (one run when a
run takes > 0.5 s); the wall time is kept in the JSON. Peak memory is the growth of the
process's peak RSS over its RSS just before the first call (inputs already
allocated). textbook is skipped where its L×L matrices would pass
--mem-limit-gb. The slope of log(time) vs log(L) is fitted over L >= 2048
(quick: all points). Then the accuracy of every case against (a) softmax
attention with the same causality and (b) its own float64 definition, at one
L; and the float32 stability of causal linear attention at the largest L.

Writes bench/results/scaling.{json,png} (and --png elsewhere if asked).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = [
    "textbook",
    "full",
    "causal",
    "window256",
    "sparse",
    "linformer256",
    "linear",
    "linear_causal",
]
CAUSAL_CASES = {"causal", "window256", "sparse", "linear_causal"}
SPARSE_BLOCK = 64
LINFORMER_K = 256


# ----------------------------------------------------------------------------- cases


def textbook(q, k, v):
    """The chapter's formula in float32 NumPy, batched over heads."""
    S = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])  # (B, H, L, L)
    P = np.exp(S - S.max(-1, keepdims=True))
    return (P / P.sum(-1, keepdims=True)) @ v


def sparse_mask(L):
    import attn_fast as af

    nb = -(-L // SPARSE_BLOCK)
    stride = max(2, int(round(math.sqrt(nb))))
    return af.masks.BlockSparse.strided(L, SPARSE_BLOCK, stride) & af.masks.Causal()


def projections(L, seed=7):
    rng = np.random.default_rng(seed)
    std = math.sqrt(2.0 / (L + LINFORMER_K))  # Xavier normal, as variants.Linformer
    E = rng.standard_normal((LINFORMER_K, L), dtype=np.float32) * np.float32(std)
    F = rng.standard_normal((LINFORMER_K, L), dtype=np.float32) * np.float32(std)
    return E, F


def make_case(name, q, k, v):
    """A zero-argument callable that runs `name` on (q, k, v) (setup done here)."""
    import attn_fast as af

    sdpa = af.scaled_dot_product_attention
    L = q.shape[-2]
    if name == "textbook":
        return lambda: textbook(q, k, v)
    if name == "full":
        return lambda: sdpa(q, k, v)
    if name == "causal":
        return lambda: sdpa(q, k, v, is_causal=True)
    if name == "window256":
        return lambda: sdpa(q, k, v, is_causal=True, window_size=(255, 0))
    if name == "sparse":
        m = sparse_mask(L)
        return lambda: sdpa(q, k, v, attn_mask=m)
    if name == "linformer256":
        E, F = projections(L)
        return lambda: af.variants.linformer_attention(q, k, v, E, F)
    if name == "linear":
        return lambda: af.variants.linear_attention(q, k, v)
    if name == "linear_causal":
        return lambda: af.variants.linear_attention(q, k, v, causal=True)
    raise ValueError(name)


def inputs(L, H, d, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, H, L, d), dtype=np.float32) for _ in range(3))


def textbook_bytes(L, H):
    # measured: peak RSS growth is ~6 float32 (H, L, L) arrays (QKᵀ, /√d, - max,
    # exp, / sum, and BLAS/ufunc temporaries): 12.3 GiB at L = 16384, H = 2
    return 6 * H * L * L * 4


# ----------------------------------------------------------------------------- worker


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_free_heap():
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def worker(name, L, H, d, threads):
    import attn_fast as af

    af.set_num_threads(threads)
    q, k, v = inputs(L, H, d)
    fn = make_case(name, q, k, v)
    release_free_heap()  # so that memory freed by the setup cannot hide the call's allocations
    base = rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def timed():
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - w0, time.process_time() - c0

    first = timed()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    runs = [first]
    while first[0] < 0.5 and sum(r[0] for r in runs) < 1.5 and len(runs) < 15:
        runs.append(timed())
    if len(runs) > 1:
        runs = runs[1:]  # the first run is the warm-up
    json.dump(
        {
            "time_s": min(r[1] for r in runs),
            "wall_s": min(r[0] for r in runs),
            "extra_mb": max(0, peak - base) / 2**20,
            "setup_peak_mb": peak_before / 2**20,
            "runs": len(runs),
        },
        sys.stdout,
    )


def run_worker(name, L, H, d, threads, timeout):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        name,
        str(L),
        str(H),
        str(d),
        str(threads),
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        OPENBLAS_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
    )
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"skipped": f"timeout {timeout}s"}
    if r.returncode != 0:
        return {
            "skipped": "failed: " + r.stderr.strip().splitlines()[-1]
            if r.stderr.strip()
            else "failed"
        }
    return json.loads(r.stdout)


# ----------------------------------------------------------------------------- accuracy


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def accuracy(L, H, d):
    """Relative error of each case vs softmax attention and vs its own float64 definition."""
    import attn_fast as af
    from attn_fast.reference import sdpa as sdpa64

    q, k, v = inputs(L, H, d, seed=1)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    full = sdpa64(q64, k64, v64)
    causal = sdpa64(q64, k64, v64, mask=af.reference.causal_mask(L, L))
    window = sdpa64(q64, k64, v64, mask=af.reference.window_mask(L, L, 255, 0))
    sparse = sdpa64(q64, k64, v64, mask=sparse_mask(L).to_dense(1, 1, L, L))
    E, F = projections(L)
    linformer = sdpa64(q64, E.astype(np.float64) @ k64, F.astype(np.float64) @ v64)

    def lin64(causal_):
        phi = lambda x: np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))  # noqa: E731
        A = phi(q64) @ np.swapaxes(phi(k64), -1, -2)
        if causal_:
            A = np.tril(A)
        return (A @ v64) / (A.sum(-1, keepdims=True) + 1e-6)

    exact = {
        "textbook": full,
        "full": full,
        "causal": causal,
        "window256": window,
        "sparse": sparse,
        "linformer256": linformer,
        "linear": lin64(False),
        "linear_causal": lin64(True),
    }
    out = {}
    for name in CASES:
        o = make_case(name, q, k, v)()
        softmax_ref = causal if name in CAUSAL_CASES else full
        out[name] = {"vs_softmax": rel(o, softmax_ref), "vs_own_definition": rel(o, exact[name])}
    return out


def stability(L, d):
    """Causal linear attention in float32 at length L against a float64 prefix sum.

    Also shows what plain float32 running sums (np.cumsum, sequential) would
    give: the reason the C++ sweep keeps its state in float64."""
    import attn_fast as af

    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, L, d), dtype=np.float32) for _ in range(3))
    o = af.variants.linear_attention(q, k, v, causal=True)[0]
    fq = af.variants.feature_map(q[0])  # float32 features, as the kernel sees them
    fk = af.variants.feature_map(k[0])
    vv = v[0]
    res = {}
    for dt in (np.float64, np.float32):
        kv = np.zeros((d, d), dt)
        z = np.zeros(d, dt)
        ref = np.empty((L, d), np.float64)
        for c0 in range(0, L, 512):
            c1 = min(L, c0 + 512)
            a, b, qq = fk[c0:c1].astype(dt), vv[c0:c1].astype(dt), fq[c0:c1].astype(dt)
            kvc = np.cumsum(a[:, :, None] * b[:, None, :], axis=0, dtype=dt) + kv
            zc = np.cumsum(a, axis=0, dtype=dt) + z
            num = np.einsum("ld,lde->le", qq, kvc)
            den = np.einsum("ld,ld->l", qq, zc) + dt(1e-6)
            ref[c0:c1] = num / den[:, None]
            kv, z = kvc[-1], zc[-1]
        res[np.dtype(dt).name] = ref
    exact = res["float64"]
    return {
        "L": L,
        "d": d,
        "attn_fast_float32_vs_float64": rel(o, exact),
        "attn_fast_max_abs_err": float(np.abs(o - exact).max()),
        "float32_running_sums_vs_float64": rel(res["float32"], exact),
    }


# ----------------------------------------------------------------------------- report


def fit_slope(Ls, ts):
    x, y = np.log(np.asarray(Ls, float)), np.log(np.asarray(ts, float))
    return float(np.polyfit(x, y, 1)[0]) if len(x) >= 2 else float("nan")


def plot(results, Ls, path_list, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name in CASES:
        pts = [(L, results[name][str(L)]) for L in Ls if "time_s" in results[name][str(L)]]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ax1.loglog(
            xs,
            [p[1]["time_s"] for p in pts],
            "o-",
            label=f"{name} (slope {results[name]['slope']:.2f})",
        )
        ax2.loglog(xs, [max(p[1]["extra_mb"], 0.1) for p in pts], "o-", label=name)
    for ax, yl in ((ax1, "CPU time [s]"), (ax2, "peak RSS growth [MiB]")):
        ax.set_xlabel("sequence length L")
        ax.set_ylabel(yl)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xscale("log", base=2)
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    for p in path_list:
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        fig.savefig(p, dpi=90)
    plt.close(fig)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, name, L, H, d, threads = sys.argv
        worker(name, int(L), int(H), int(d), int(threads))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="L = 256 ... 2048, a smoke test")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=65536)
    ap.add_argument("--mem-limit-gb", type=float, default=8.0)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads for attn_fast and BLAS in every case (default 1: the slopes are the point, "
        "and one thread keeps a shared machine's scheduling noise out of them)",
    )
    ap.add_argument("--timeout", type=int, default=600, help="per (case, L) subprocess")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    ap.add_argument("--png", action="append", default=[], help="extra path for the plot")
    args = ap.parse_args()

    import attn_fast as af

    H, d = args.heads, args.dim
    if args.quick:
        Ls, fit_from, acc_L, stab_L = [256, 512, 1024, 2048], 0, 512, 4096
    else:
        Ls = [L for L in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536) if L <= args.max_len]
        fit_from, acc_L, stab_L = 2048, 2048, Ls[-1]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    header = (
        f"attn_fast {af.__version__} | isa {af.get_isa()} | threads {args.threads} | {cpu} | "
        f"B=1 H={H} d=dv={d} float32"
    )
    print(header, flush=True)

    results = {name: {} for name in CASES}
    t_start = time.time()
    for L in Ls:
        for name in CASES:
            if name == "textbook" and textbook_bytes(L, H) > args.mem_limit_gb * 2**30:
                r = {
                    "skipped": f"L×L matrices {textbook_bytes(L, H) / 2**30:.0f} GiB "
                    f"> {args.mem_limit_gb:g} GiB"
                }
            else:
                r = run_worker(name, L, H, d, args.threads, args.timeout)
            results[name][str(L)] = r
            cell = (
                f"{r['time_s'] * 1e3:10.2f} ms {r['extra_mb']:9.1f} MiB"
                if "time_s" in r
                else f"skipped ({r['skipped']})"
            )
            print(f"  L={L:6d} {name:14s} {cell}", flush=True)
    for name in CASES:
        pts = [
            (L, results[name][str(L)]["time_s"])
            for L in Ls
            if L >= fit_from and "time_s" in results[name][str(L)]
        ]
        results[name]["slope"] = fit_slope([p[0] for p in pts], [p[1] for p in pts])
        results[name]["fit_range"] = [pts[0][0], pts[-1][0]] if pts else []

    print(f"\nacc: relative error ||o - ref|| / ||ref|| at L = {acc_L} (H={H}, d={d})", flush=True)
    acc = accuracy(acc_L, H, d)
    print(f"stability: causal linear attention, float32, L = {stab_L}, d = dv = {d}", flush=True)
    stab = stability(stab_L, d)

    # --- the table
    print(
        f"\n{header}\nCPU time [ms] (peak RSS growth [MiB]); slope = d log t / d log L over L >= "
        f"{Ls[0] if fit_from == 0 else fit_from}"
    )
    cols = "".join(f"{L:>18d}" for L in Ls)
    print(f"{'case':14s}{cols}   slope  err_vs_softmax  err_vs_own_def")
    for name in CASES:
        cells = ""
        for L in Ls:
            r = results[name][str(L)]
            cells += (
                f"{r['time_s'] * 1e3:10.1f} ({r['extra_mb']:5.0f})"
                if "time_s" in r
                else f"{'—':>18s}"
            )
        a = acc[name]
        print(
            f"{name:14s}{cells}   {results[name]['slope']:5.2f}  {a['vs_softmax']:14.2e}  "
            f"{a['vs_own_definition']:14.2e}"
        )
    print(
        "\nerr_vs_softmax: vs float64 softmax attention with the same causality (full or "
        f"causal), L = {acc_L}"
    )
    print(
        "err_vs_own_def: vs the case's own float64 definition (its mask / projection / feature map)"
    )
    print(
        f"causal linear attention float32 at L = {stab['L']}: rel err "
        f"{stab['attn_fast_float32_vs_float64']:.2e} "
        f"(max abs {stab['attn_fast_max_abs_err']:.2e}) vs float64; plain float32 running sums "
        "would give "
        f"{stab['float32_running_sums_vs_float64']:.2e}"
    )
    print(f"study took {time.time() - t_start:.0f} s")

    os.makedirs(args.out, exist_ok=True)
    tag = "scaling_quick" if args.quick else "scaling"
    with open(os.path.join(args.out, tag + ".json"), "w") as f:
        json.dump(
            {
                "header": header,
                "lengths": Ls,
                "results": results,
                "accuracy": acc,
                "stability": stab,
            },
            f,
            indent=1,
        )
    pngs = [os.path.join(args.out, tag + ".png")] + args.png
    plot(results, Ls, pngs, header)
    print("plot: " + ", ".join(pngs))


if __name__ == "__main__":
    main()
