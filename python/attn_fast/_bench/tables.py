"""The suite's printed rows, the performance targets judged on a run, and its plot."""

from __future__ import annotations

import numpy as np

from .cases import Case
from .peers import IMPLS


def _fmt_ms(s):
    return f"{s * 1e3:8.1f}" if s < 10 else f"{s:7.1f}s"


def measured_impls(result):
    """Implementations with at least one timed result, in IMPLS order."""
    seen = {
        impl for row in result["results"] for impl, r in row["impls"].items() if "median_s" in r
    }
    return [impl for impl in IMPLS if impl in seen]


def set_rates(row, peak, bw):
    case = row["case"]
    for r in row["impls"].values():
        if "median_s" not in r:
            continue
        if case["kind"] == "decode":
            r["gbs"] = Case(**case).kv_bytes / r["median_s"] / 1e9
            r["pct_limit"] = 100 * r["gbs"] / bw
            if row.get("probe_read_bandwidth_gbs"):  # the probe taken just before this case
                r["pct_case_probe"] = 100 * r["gbs"] / row["probe_read_bandwidth_gbs"]
        else:
            r["gflops"] = Case(**case).flops / r["median_s"] / 1e9
            r["pct_limit"] = 100 * r["gflops"] / peak


def format_row(row, active):
    a = row["impls"]["attn_fast"]
    rate = (
        f"{a['gbs']:6.1f} GB/s" if row["case"]["kind"] == "decode" else f"{a['gflops']:5.0f} GF/s"
    )
    cols = []
    for p in active:
        if p == "attn_fast":
            continue
        r = row["impls"][p]
        cols.append(
            f"{_fmt_ms(r['median_s']):>11s} {r['speedup_attn_fast']:4.2f}x"
            if "median_s" in r
            else f"{'skip':>11s} {'-':>5s}"
        )
    span = f"{_fmt_ms(a['median_s'])} [{a['min_s'] * 1e3:.0f}-{a['max_s'] * 1e3:.0f}]"
    return f"{row['name']:34s} | {span:>25s} {rate:>10s}" + "".join(" | " + c for c in cols)


def format_pct_row(row, impls):
    a = row["impls"]["attn_fast"]
    rate = (
        f"{a['gbs']:6.1f} GB/s" if row["case"]["kind"] == "decode" else f"{a['gflops']:5.0f} GF/s"
    )
    cols = [
        f"{row['impls'][p]['pct_limit']:10.0f}%"
        if "pct_limit" in row["impls"].get(p, {})
        else f"{'-':>11s}"
        for p in impls
    ]
    line = f"{row['name']:34s} | {rate:>10s} | " + " ".join(cols)
    if "pct_case_probe" in a:
        # This host's read moves between ~30 and ~60 GB/s from minute to minute
        # (other tenants), so the section's highest probe may come from another
        # minute than the case: also the share of the probe taken just before it.
        line += (
            f"   (attn_fast: {a['pct_case_probe']:.0f}% of the"
            f" {row['probe_read_bandwidth_gbs']:.1f} GB/s probed before the case)"
        )
    return line


def _af_s(row):
    """attn_fast's median seconds in a result row."""
    return row["impls"]["attn_fast"]["median_s"]


def _partners(rows, among, match):
    """(row, the first x of `among` with match(row, x)) for each row that has one."""
    found = ((r, next((x for x in among if match(r, x)), None)) for r in rows)
    return [(r, x) for r, x in found if x is not None]


def evaluate_targets(result):
    """The issue's performance targets, judged on this run's figures."""
    res = result["results"]
    counts = sorted(int(t) for t in result["limits"])
    nt = counts[-1]
    at = [
        r
        for r in res
        if r["threads"] == nt
        and r["case"]["kind"] != "decode"
        and r["case"].get("dtype", "fp32") == "fp32"
    ]
    out = []

    def add(target, ok, detail):
        out.append({"target": target, "met": bool(ok), "detail": detail})

    for d, want in ((64, 80.0), (128, 85.0)):
        rows = [
            r
            for r in at
            if not r["case"]["causal"] and r["case"]["Lq"] >= 2048 and r["case"]["d"] == d
        ]
        if rows:
            got = [r["impls"]["attn_fast"]["pct_limit"] for r in rows]
            add(
                f"non-causal L>=2048 d={d}: >= {want:.0f}% of FMA peak at {nt} threads",
                min(got) >= want,
                ", ".join(f"{r['name']}: {g:.0f}%" for r, g in zip(rows, got)),
            )
    causal = [r for r in at if r["case"]["causal"] and r["case"]["kind"] == "prefill"]
    pairs = [
        (r["name"], _af_s(r) / _af_s(nc))
        for r, nc in _partners(causal, at, lambda r, x: x["case"] == {**r["case"], "causal": False})
    ]
    if pairs:
        add(
            "causal time <= 0.55 x non-causal time",
            all(p <= 0.55 for _, p in pairs),
            ", ".join(f"{n}: {p:.2f}" for n, p in pairs),
        )
    for peer, want in (("torch", 1.25), ("onnxruntime", 1.0)):
        sp = [
            (r["name"], r["impls"][peer].get("speedup_attn_fast")) for r in at if peer in r["impls"]
        ]
        sp = [(n, s) for n, s in sp if s is not None]
        if sp:
            add(
                f"every prefill case >= {want:.2f}x {peer}",
                all(s >= want for _, s in sp),
                f"min {min(s for _, s in sp):.2f}x ({min(sp, key=lambda x: x[1])[0]})",
            )
    for r in res:  # bf16 decode over a bf16 cache vs float32 decode of the same shape
        c = r["case"]
        if c["kind"] != "decode" or c.get("dtype") != "bf16" or r["threads"] != nt:
            continue
        f32 = next(
            (x for x in res if x["threads"] == nt and x["case"] == {**c, "dtype": "fp32"}), None
        )
        if f32 is None or "median_s" not in r["impls"]["attn_fast"]:
            continue
        a = r["impls"]["attn_fast"]
        ratio = _af_s(f32) / a["median_s"]
        add(f"{r['name']}: >= 1.8x float32 decode tokens/s", ratio >= 1.8, f"{ratio:.2f}x")
        add(
            f"{r['name']}: >= 80% of the read bandwidth",
            a["pct_limit"] >= 80,
            f"{a['pct_limit']:.0f}%",
        )
    if len(counts) > 1 and counts[0] == 1:
        ups = [
            (r["name"], _af_s(one) / _af_s(r))
            for r, one in _partners(
                at, res, lambda r, x: x["threads"] == 1 and x["name"] == r["name"]
            )
        ]
        if ups:
            add(
                f"1 -> {nt} threads speed-up >= {0.95 * nt:.2f}x",
                all(u >= 0.95 * nt for _, u in ups),
                f"min {min(u for _, u in ups):.2f}x ({min(ups, key=lambda x: x[1])[0]}), "
                f"max {max(u for _, u in ups):.2f}x",
            )
    return out


def plot_figure(result):
    """Bar chart: % of the machine limit per case and implementation, one panel per thread count.

    Only implementations with at least one measured case get bars and a
    legend entry. Returns a matplotlib Figure (no pyplot state).
    """
    from matplotlib.figure import Figure

    counts = sorted({r["threads"] for r in result["results"]})
    names = list(dict.fromkeys(r["name"] for r in result["results"]))
    impls = measured_impls(result)
    fig = Figure(figsize=(max(8, 0.9 * len(names)), 4 * len(counts)), layout="tight")
    axes = fig.subplots(len(counts), 1, squeeze=False)
    w = 0.8 / max(1, len(impls))
    for ax, nt in zip(axes[:, 0], counts):
        rows = {r["name"]: r for r in result["results"] if r["threads"] == nt}
        for i, impl in enumerate(impls):
            ys = [
                rows[n]["impls"].get(impl, {}).get("pct_limit", 0) if n in rows else 0
                for n in names
            ]
            ax.bar(np.arange(len(names)) + (i - (len(impls) - 1) / 2) * w, ys, w, label=impl)
        ax.set_xticks(np.arange(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        lim = result["limits"][str(nt)]
        ax.set_ylabel("% of limit")
        ax.set_title(
            f"{nt} thread(s): prefill as % of FMA peak ({lim['fma_peak_gflops']:.0f} GFLOP/s), "
            f"decode as % of read bandwidth ({lim['read_bandwidth_gbs']:.1f} GB/s)",
            fontsize=9,
        )
        ax.axhline(100, color="grey", lw=0.5)
        if impls:
            ax.legend(fontsize=8)
    return fig


def plot(result, path):
    """Save plot_figure(result) to `path` (needs matplotlib)."""
    plot_figure(result).savefig(path, dpi=110)
