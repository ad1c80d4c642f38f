"""The benchmark suite: `python -m attn_fast bench --full` (or `--quick`).

Measures, in one run and one process:
  - this machine's limits: the FP32 FMA peak (a register-only FMA loop in the
    extension) and the streaming-read memory bandwidth (a large read), for
    each thread count;
  - attn_fast against its peers on prefill, GQA-prefill and decode cases:
    the textbook NumPy code, torch's scaled_dot_product_attention (CPU) and
    onnxruntime's MultiHeadAttention / GroupQueryAttention contrib ops when
    they are installed (`pip install 'attn_fast[bench]'`; missing peers are
    skipped with a note).

Every result is first checked against the float64 oracle (a slice of heads
and query rows); that call is also the warm-up. Implementations are then
timed interleaved (one call of each per round, rotating the order, with a
pause before each call so that the previous library's spinning worker
threads have gone idle: COOLDOWN_S, then untimed calls of the same
implementation for 10 ms so that the idle machine is awake again: WARM_S;
not for calls of 0.25 s or more); the table shows medians and
attn_fast's min-max, the JSON file every sample.
An implementation slower than max_seconds in total stops after 3 samples.
Prefill is reported in GFLOP/s and % of the FMA peak
(FLOPs = 4·B·Hq·Lq·Lk·d, half of that for causal); decode in GB/s and % of
the read bandwidth (bytes = the K and V caches read once). Ratios are
peer time / attn_fast time (above 1: attn_fast is faster). Peak memory per
case is the RSS high-water mark (VmHWM) of a fresh subprocess running one
call, minus its RSS just before the call, the mark reset first (clear_refs
5: making the inputs, fp32 rounded to bf16, would otherwise count). (Not
ru_maxrss: Linux carries the parent's high-water mark into a child.)

`--dtype bf16` / `--dtype fp16` add, after each float32 case, the same case
with q, k, v in that dtype: attn_fast against torch in the same dtype (the
NumPy and onnxruntime peers are float32 only: skipped), checked against the
float64 oracle on the same rounded inputs, timed interleaved in the same run.
Their rows carry the dtype in the name; decode GB/s count the bytes actually
read (2 per element), and the JSON's bf16-decode check compares its tokens/s
with the float32 row of the same shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from . import _core, reference
from ._checks import bf16_bits, f32_to_bf16, to_float
from ._config import config, get_num_threads, set_num_threads
from .functional import scaled_dot_product_attention

IMPLS = ("attn_fast", "numpy", "torch", "onnxruntime")
DTYPES = ("fp32", "bf16", "fp16")
_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Case:
    kind: str  # "prefill" (Hq == Hkv), "gqa" (prefill, Hq > Hkv) or "decode" (Lq == 1)
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lk: int
    d: int
    causal: bool
    dtype: str = "fp32"  # of q, k, v and the output: "fp32", "bf16" or "fp16"

    @property
    def name(self):
        h = f"{self.Hq}" if self.Hq == self.Hkv else f"{self.Hq}/{self.Hkv}"
        L = f"{self.Lq}" if self.kind != "decode" else f"kv{self.Lk}"
        dt = "" if self.dtype == "fp32" else f" {self.dtype}"
        return f"{self.kind} ({self.B},{h},{L},{self.d}){' causal' if self.causal else ''}{dt}"

    @property
    def flops(self):
        """4·B·Hq·Lq·Lk·d, counting only the unmasked half for causal prefill."""
        f = 4.0 * self.B * self.Hq * self.Lq * self.Lk * self.d
        return f * 0.5 if self.causal and self.Lq == self.Lk else f

    @property
    def kv_bytes(self):
        """Bytes of the K and V caches, read once (2 per element for the 16-bit dtypes)."""
        return float(_ITEMSIZE[self.dtype]) * self.B * self.Hkv * self.Lk * 2 * self.d


def with_dtypes(cases, dtypes):
    """Each case, followed by its copies in the 16-bit `dtypes` ("bf16",
    "fp16"; "fp32" is always there)."""
    extra = [dt for dt in dict.fromkeys(dtypes) if dt != "fp32"]
    return [c2 for c in cases for c2 in [c] + [replace(c, dtype=dt) for dt in extra]]


PREFILL_SHAPES = [
    (1, 12, 512, 64),
    (1, 16, 2048, 64),
    (1, 32, 2048, 128),
    (4, 8, 1024, 128),
    (1, 8, 8192, 64),
]


def full_cases():
    cases = [
        Case("prefill", B, H, H, L, L, d, c)
        for (B, H, L, d) in PREFILL_SHAPES
        for c in (False, True)
    ]
    cases.append(Case("gqa", 1, 32, 8, 2048, 2048, 128, True))
    cases += [
        Case("decode", B, 32, 8, 1, Lk, 128, False)
        for (B, Lk) in ((1, 4096), (1, 32768), (8, 4096))
    ]
    cases += LATENCY_CASES
    return cases


# Latency rows: one generated token against a short cache, where the fixed cost of a
# call (argument handling, dispatch, the thread team) is most of its time (issue 38;
# bench/benchmarks/bench_latency.py times every entry point).
LATENCY_CASES = [
    Case("decode", 1, 9, 3, 1, 512, 64, False),  # SmolLM2-135M's heads
    Case("decode", 1, 32, 8, 1, 16, 128, False),
]


def quick_cases():
    cases = [
        Case("prefill", B, H, H, L, L, d, c)
        for (B, H, L, d) in PREFILL_SHAPES[:2]
        for c in (False, True)
    ]
    cases.append(Case("decode", 1, 32, 8, 1, 4096, 128, False))
    cases.append(LATENCY_CASES[0])
    return cases


def tiny_cases():
    """`--tiny`: one small case of each kind, to check that the command runs (seconds)."""
    cases = [Case("prefill", 1, 2, 2, 64, 64, 16, c) for c in (False, True)]
    cases.append(Case("gqa", 1, 4, 2, 64, 64, 16, True))
    cases.append(Case("decode", 1, 4, 2, 1, 96, 16, False))
    return cases


INSTALL_HINT = "pip install 'attn_fast[bench]'"


# --------------------------------------------------------------------------- peers


class Skip(Exception):
    """A peer cannot run this case (not installed, unsupported, too big)."""


def make_inputs(case, seed=0):
    """q, k, v as NumPy arrays of the case's dtype: float32, float16, or
    bfloat16 bits (``bf16_bits``)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((case.B, case.Hq, case.Lq, case.d), dtype=np.float32)
    k = rng.standard_normal((case.B, case.Hkv, case.Lk, case.d), dtype=np.float32)
    v = rng.standard_normal((case.B, case.Hkv, case.Lk, case.d), dtype=np.float32)
    if case.dtype == "fp16":
        return tuple(x.astype(np.float16) for x in (q, k, v))
    if case.dtype == "bf16":
        return tuple(bf16_bits(f32_to_bf16(x)) for x in (q, k, v))
    return q, k, v


def _f64(x):
    """A result or input (NumPy of any of the dtypes, bf16 bits, torch tensor) as float64 NumPy."""
    if hasattr(x, "detach"):  # torch
        return x.detach().double().numpy()
    x = np.asarray(x)
    return to_float(x.view(np.ndarray)) if x.dtype == np.uint16 else x.astype(np.float64)


def _torch_view(x, torch):
    """A NumPy input as a torch tensor sharing its memory (bfloat16 bits as torch.bfloat16)."""
    if x.dtype == np.uint16:
        return torch.from_numpy(x.view(np.ndarray).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def numpy_textbook(q, k, v, causal):
    """The chapter's code, batched over (B, H): softmax(QKᵀ/√d) V, float32."""
    S = q @ np.swapaxes(k, -1, -2) / np.float32(np.sqrt(q.shape[-1]))
    if causal:
        Lq, Lk = S.shape[-2:]
        S = np.where(np.tril(np.ones((Lq, Lk), dtype=bool), Lk - Lq), S, np.float32(-1e9))
    S = S - S.max(axis=-1, keepdims=True)
    e = np.exp(S)
    return (e / e.sum(axis=-1, keepdims=True)) @ v


def _import(name):
    try:
        return __import__(name)
    except Exception:  # noqa: BLE001 - any import failure means "no peer"
        return None


def prepare(impl, case, q, k, v, threads):
    """Return a zero-argument callable computing O as a (B, Hq, Lq, d) array."""
    group = case.Hq // case.Hkv
    if case.dtype != "fp32" and impl in ("numpy", "onnxruntime"):
        raise Skip("float32 only")
    if impl == "attn_fast":
        set_num_threads(threads)
        return lambda: scaled_dot_product_attention(
            q, k, v, is_causal=case.causal, enable_gqa=group > 1
        )
    if impl == "numpy":
        if case.B * case.Hq * case.Lq * case.Lk * 4 > (1 << 30):
            raise Skip("score matrix over 1 GiB")
        kk, vv = (np.repeat(x, group, axis=1) if group > 1 else x for x in (k, v))
        return lambda: numpy_textbook(q, kk, vv, case.causal)
    if impl == "torch":
        torch = _import("torch")
        if torch is None:
            raise Skip("torch not installed")
        torch.set_num_threads(threads)
        F = torch.nn.functional.scaled_dot_product_attention
        tq, tk, tv = (_torch_view(x, torch) for x in (q, k, v))
        kw = {"enable_gqa": True} if group > 1 else {}

        def run():
            with torch.no_grad():
                o = F(tq, tk, tv, is_causal=case.causal, **kw)
                return o.numpy() if case.dtype == "fp32" else o  # 16-bit: converted by check() only

        return run
    if impl == "onnxruntime":
        return _prepare_ort(case, q, k, v, threads)
    raise ValueError(impl)


def _bsh(x):
    """(B, H, L, d) -> contiguous (B, L, H*d), onnxruntime's layout."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1))


def _prepare_ort(case, q, k, v, threads):
    ort, onnx = _import("onnxruntime"), _import("onnx")
    if ort is None or onnx is None:
        raise Skip("onnxruntime/onnx not installed")
    from onnx import TensorProto, helper

    F = TensorProto.FLOAT
    ms = "com.microsoft"
    if case.Hq == case.Hkv and case.kind != "decode":
        node = helper.make_node(
            "MultiHeadAttention",
            ["q", "k", "v"],
            ["o"],
            domain=ms,
            num_heads=case.Hq,
            unidirectional=int(case.causal),
        )
        inputs = [helper.make_tensor_value_info(n, F, ["B", "L", case.Hq * case.d]) for n in "qkv"]
        outputs = [helper.make_tensor_value_info("o", F, None)]
        feed = {"q": _bsh(q), "k": _bsh(k), "v": _bsh(v)}
    else:
        # GroupQueryAttention is causal by definition; decode passes the cache
        # as past_key/past_value (Lk - 1 keys) plus the newest key, and the op
        # also writes the grown cache (present_key/value): ORT's decode API.
        if not case.causal and case.kind != "decode":
            raise Skip("GroupQueryAttention is causal only")
        hkv = case.Hkv * case.d
        decode = case.kind == "decode"
        names = [
            "q",
            "k",
            "v",
            "pk" if decode else "",
            "pv" if decode else "",
            "seqlens_k",
            "total_len",
        ]
        node = helper.make_node(
            "GroupQueryAttention",
            names,
            ["o", "present_k", "present_v"],
            domain=ms,
            num_heads=case.Hq,
            kv_num_heads=case.Hkv,
        )
        inputs = [
            helper.make_tensor_value_info("q", F, ["B", "S", case.Hq * case.d]),
            helper.make_tensor_value_info("k", F, ["B", "S", hkv]),
            helper.make_tensor_value_info("v", F, ["B", "S", hkv]),
        ]
        if decode:
            inputs += [
                helper.make_tensor_value_info(n, F, ["B", case.Hkv, "P", case.d])
                for n in ("pk", "pv")
            ]
        inputs += [
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
            helper.make_tensor_value_info("total_len", TensorProto.INT32, []),
        ]
        outputs = [
            helper.make_tensor_value_info(n, F, None) for n in ("o", "present_k", "present_v")
        ]
        L = case.Lk
        feed = {"seqlens_k": np.full(case.B, L - 1, np.int32), "total_len": np.array(L, np.int32)}
        if decode:
            feed.update(
                q=_bsh(q),
                k=_bsh(k[:, :, -1:]),
                v=_bsh(v[:, :, -1:]),
                pk=np.ascontiguousarray(k[:, :, :-1]),
                pv=np.ascontiguousarray(v[:, :, :-1]),
            )
        else:
            feed.update(q=_bsh(q), k=_bsh(k), v=_bsh(v))
    graph = helper.make_graph([node], "attn", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)]
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    try:
        sess = ort.InferenceSession(
            model.SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
    except Exception as e:  # noqa: BLE001 - an op this ORT build lacks is a skip
        raise Skip(f"onnxruntime: {str(e).splitlines()[0][:80]}") from None
    B, Lq, Hq, d = case.B, case.Lq, case.Hq, case.d
    return lambda: sess.run(["o"], feed)[0].reshape(B, Lq, Hq, d).transpose(0, 2, 1, 3)


# --------------------------------------------------------------------------- checks and timing


# Largest max-abs error against the oracle accepted per dtype (16-bit: the one
# rounding of O, and torch's own bf16 arithmetic).
_CHECK_TOL = {"fp32": 2e-3, "fp16": 1e-2, "bf16": 5e-2}


def check(o, case, q, k, v):
    """Max abs error against the float64 oracle on <= 2 heads and <= 128 query rows
    (16-bit cases: the oracle on the same rounded inputs)."""
    rows = np.unique(np.linspace(0, case.Lq - 1, min(case.Lq, 128)).astype(int))
    h = min(2, case.Hq)
    group = case.Hq // case.Hkv
    hk = [i // group for i in range(h)]
    mask = reference.causal_mask(case.Lq, case.Lk)[rows] if case.causal else None
    O = reference.sdpa(_f64(q[:1, :h][:, :, rows]), _f64(k[:1, hk]), _f64(v[:1, hk]), mask=mask)
    err = float(np.abs(_f64(o[:1, :h][:, :, rows]) - O).max())
    if not err < _CHECK_TOL[case.dtype]:
        raise RuntimeError(f"{case.name}: result differs from the float64 oracle by {err:.2e}")
    return err


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


# --------------------------------------------------------------------------- peak memory


_MEM_SNIPPET = r"""
import json, sys
import numpy as np
from attn_fast.bench_suite import Case, make_inputs, prepare
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


def _fmt_ms(s):
    return f"{s * 1e3:8.1f}" if s < 10 else f"{s:7.1f}s"


def run(
    cases,
    thread_counts,
    repeats=5,
    memory=True,
    impls=IMPLS,
    out=None,
    max_seconds=20.0,
    probe_seconds=0.3,
    probe_bytes=512 << 20,
):
    """Measure `cases` at each of `thread_counts`; print the tables to `out`;
    return the result dict.

    One section per thread count: each row is printed as its case finishes
    (times, rates and peer ratios), and the machine's limits are probed before
    the section and next to every case. The limits of a section are the
    highest of its probes (other processes can only lower a probe); they are
    printed once per section, in the final table of % of the limits. The
    attn_fast thread count in effect before the call is restored afterwards.
    """
    out = sys.stdout if out is None else out
    cfg = config()
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("torch", "onnxruntime", "onnx"):
        m = _import(mod) if mod in impls or mod == "onnx" else None
        versions[mod] = getattr(m, "__version__", None) if m else None
    result = {
        "machine": {
            "cpu": cfg["cpu"],
            "cpu_id": cfg["cpu_id"],
            "cores": os.cpu_count(),
            "isa": cfg["isa"],
            "available_isas": cfg["available_isas"],
            "openmp": cfg["openmp"],
            "platform": platform.platform(),
        },
        "versions": {"attn_fast": cfg["version"], **versions},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "repeats": repeats,
        "limits": {},
        "results": [],
        "notes": [],
    }
    cpu_about = ", ".join(x for x in (cfg["cpu_id"], f"{os.cpu_count()} cores") if x)
    print(
        f"attn_fast {cfg['version']}  ISA {cfg['isa']}  decode prefetch {cfg['decode_prefetch']}  "
        f"CPU {cfg['cpu']} ({cpu_about})",
        file=out,
    )
    print("  " + "  ".join(f"{k} {v}" for k, v in versions.items() if v), file=out)
    active = [i for i in impls]
    for peer, mod in (("torch", "torch"), ("onnxruntime", "onnxruntime")):
        if peer in active and _import(mod) is None:
            note = f"{peer} not installed: its column is skipped ({INSTALL_HINT})"
            print(note, file=out)
            result["notes"].append(note)
            active.remove(peer)
    threads_before = get_num_threads()
    try:
        _run_sections(
            result,
            cases,
            thread_counts,
            repeats,
            active,
            out,
            max_seconds,
            probe_seconds,
            probe_bytes,
        )
    finally:
        set_num_threads(threads_before)
    measured = measured_impls(result)
    print(
        "\n== % of this machine's limits: prefill of the FP32 FMA peak, decode of the read "
        "bandwidth "
        "(each section: the highest of its probes)",
        file=out,
    )
    for nt in thread_counts:
        lim = result["limits"][str(nt)]
        print(
            f"-- {nt} thread(s): FP32 FMA peak {lim['fma_peak_gflops']:.0f} GFLOP/s, "
            f"read bandwidth {lim['read_bandwidth_gbs']:.1f} GB/s",
            file=out,
        )
        hdr = f"{'case':34s} | {'rate':>10s} | " + " ".join(f"{p[:11]:>11s}" for p in measured)
        print(hdr, file=out)
        for row in result["results"]:
            if row["threads"] == nt:
                print(_format_pct_row(row, measured), file=out)
    if memory:
        nt = max(thread_counts)
        print(
            f"\n== peak memory of one call (fresh process, RSS above inputs, {nt} threads), MiB",
            file=out,
        )
        print(f"{'case':34s} | " + " ".join(f"{p[:11]:>11s}" for p in active), file=out, flush=True)
        for case in cases:
            mem = {}
            for impl in active:
                row = next(
                    r for r in result["results"] if r["name"] == case.name and r["threads"] == nt
                )
                mem[impl] = None if "skipped" in row["impls"][impl] else peak_memory(case, impl, nt)
                row["impls"][impl]["peak_extra_rss_bytes"] = mem[impl]
            print(
                f"{case.name:34s} | "
                + " ".join(
                    f"{m / 2**20:11.1f}" if m is not None else f"{'-':>11s}" for m in mem.values()
                ),
                file=out,
                flush=True,
            )
    print(
        "\nx = peer time / attn_fast time (above 1: attn_fast is faster); rate: attn_fast's "
        "GFLOP/s "
        "(prefill) or GB/s of K and V read (decode)",
        file=out,
    )
    # The maintainers' performance checks, judged on this run: kept in the JSON only.
    result["targets"] = evaluate_targets(result)
    return result


def _run_sections(
    result, cases, thread_counts, repeats, active, out, max_seconds, probe_seconds, probe_bytes
):
    for nt in thread_counts:
        peak, bw = machine_limits(nt, probe_seconds, nbytes=probe_bytes)
        print(f"\n== {nt} thread(s)", file=out)
        hdr = f"{'case':34s} | {'attn_fast ms [min-max]':>25s} {'rate':>10s}" + "".join(
            f" | {p[:11]:>11s} {'x':>5s}" for p in active if p != "attn_fast"
        )
        print(hdr, file=out)
        print("-" * len(hdr), file=out, flush=True)
        for case in cases:
            if getattr(out, "isatty", lambda: False)():
                print(f"{case.name:34s} | running ...", end="\r", file=out, flush=True)
            q, k, v = make_inputs(case)
            fns, row = {}, {"case": asdict(case), "name": case.name, "threads": nt, "impls": {}}
            for impl in active:
                try:
                    fn = prepare(impl, case, q, k, v, nt)
                    err = check(fn(), case, q, k, v)
                    fns[impl] = fn
                    row["impls"][impl] = {"oracle_max_abs_err": err}
                except Skip as e:
                    row["impls"][impl] = {"skipped": str(e)}
            set_num_threads(nt)
            # Probe the limit next to every case: the load from other processes
            # changes by the minute, and only lowers a probe, so the section's
            # limit is the highest probe seen (the final table uses it).
            if case.kind == "decode":
                row["probe_read_bandwidth_gbs"] = _core.read_bandwidth_gbs(
                    nt, probe_bytes, probe_seconds / 2
                )
                bw = max(bw, row["probe_read_bandwidth_gbs"])
            else:
                row["probe_fma_peak_gflops"] = _core.fma_peak_gflops(nt, probe_seconds / 2)
                peak = max(peak, row["probe_fma_peak_gflops"])
            # The oracle check above was each callable's warm-up call.
            samples = time_interleaved(fns, repeats, warmup=0, max_seconds=max_seconds)
            for impl, ts in samples.items():
                r = row["impls"][impl]
                r.update(summarise(ts))
                if impl != "attn_fast" and "attn_fast" in samples:
                    r["speedup_attn_fast"] = r["median_s"] / row["impls"]["attn_fast"]["median_s"]
            _rates(row, peak, bw)
            result["results"].append(row)
            print(_format_row(row, active), file=out, flush=True)
        result["limits"][str(nt)] = {"fma_peak_gflops": peak, "read_bandwidth_gbs": bw}
        for row in result["results"]:  # % of the section's final limits, the only ones printed
            if row["threads"] == nt:
                _rates(row, peak, bw)


def measured_impls(result):
    """Implementations with at least one timed result, in IMPLS order."""
    seen = {
        impl for row in result["results"] for impl, r in row["impls"].items() if "median_s" in r
    }
    return [impl for impl in IMPLS if impl in seen]


def _rates(row, peak, bw):
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


def _format_row(row, active):
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


def _format_pct_row(row, impls):
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
    pairs = []
    for r in at:
        c = r["case"]
        if c["causal"] and c["kind"] == "prefill":
            nc = next((x for x in at if x["case"] == {**c, "causal": False}), None)
            if nc:
                pairs.append(
                    (
                        r["name"],
                        r["impls"]["attn_fast"]["median_s"] / nc["impls"]["attn_fast"]["median_s"],
                    )
                )
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
        ratio = f32["impls"]["attn_fast"]["median_s"] / a["median_s"]
        add(f"{r['name']}: >= 1.8x float32 decode tokens/s", ratio >= 1.8, f"{ratio:.2f}x")
        add(
            f"{r['name']}: >= 80% of the read bandwidth",
            a["pct_limit"] >= 80,
            f"{a['pct_limit']:.0f}%",
        )
    if len(counts) > 1 and counts[0] == 1:
        ups = []
        for r in at:
            one = next((x for x in res if x["threads"] == 1 and x["name"] == r["name"]), None)
            if one:
                ups.append(
                    (
                        r["name"],
                        one["impls"]["attn_fast"]["median_s"] / r["impls"]["attn_fast"]["median_s"],
                    )
                )
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


def main(argv=None, prog=None):
    """`bench --full` / `--quick` / `--tiny`; returns the process exit code."""
    prog = prog or "python -m attn_fast bench"
    p = argparse.ArgumentParser(
        prog=f"{prog} --full|--quick",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--full", action="store_true", help="every case, 1 and all threads, peak memory")
    p.add_argument(
        "--quick", action="store_true", help="a few cases at all threads (about a minute)"
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="one tiny case of each kind, 1 repeat, short probes: checks that the command runs "
        "(seconds); its figures mean nothing",
    )
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="thread counts (default: attn_fast.get_num_threads(), which honours OMP_NUM_THREADS; "
        "--full also runs 1)",
    )
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--cases", default=None, help="only cases whose name contains this text")
    p.add_argument(
        "--dtype",
        nargs="+",
        choices=DTYPES,
        default=["fp32"],
        help="also run every case with q, k, v in bf16 / fp16 (attn_fast vs torch in that dtype, "
        "rows beside the float32 ones)",
    )
    p.add_argument("--out", default="bench/results", help="folder for the JSON and PNG files")
    args = p.parse_args(argv)
    if args.threads and min(args.threads) < 1:
        p.error(f"--threads must be >= 1, got {' '.join(map(str, args.threads))}")
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if "attn_fast" not in args.impls:
        p.error("--impls must include attn_fast (the peers are timed against it)")
    mode = "tiny" if args.tiny else "quick" if args.quick and not args.full else "full"
    cases = with_dtypes(
        {"tiny": tiny_cases, "quick": quick_cases, "full": full_cases}[mode](), args.dtype
    )
    if args.cases:
        cases = [c for c in cases if args.cases in c.name]
        if not cases:
            p.error(f"--cases {args.cases!r} matches no case of --{mode}")
    nt = get_num_threads()  # set_num_threads(), else OMP_NUM_THREADS, else all cores
    threads = args.threads or ([nt] if mode != "full" else sorted({1, nt}))
    repeats = args.repeats or {"tiny": 1, "quick": 3, "full": 5}[mode]
    probes = {"probe_seconds": 0.02, "probe_bytes": 8 << 20} if mode == "tiny" else {}
    t0 = time.perf_counter()
    result = run(
        cases,
        threads,
        repeats=repeats,
        memory=mode == "full" and not args.no_memory,
        impls=args.impls,
        max_seconds={"tiny": 1.0, "quick": 4.0, "full": 20.0}[mode],
        **probes,
    )
    result["wall_s"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(args.out, f"suite-{mode}-{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    msg = f"\nwrote {base}.json"
    try:
        plot(result, base + ".png")
        msg += f" and {base}.png"
    except ImportError:
        msg += f" (matplotlib not installed: no plot; {INSTALL_HINT})"
    print(msg + f"  ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
