"""The suite's cases (prefill, GQA prefill, decode; float32 and the 16-bit dtypes), their
inputs, and the check of a result against the float64 oracle."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import reference
from .._checks import bf16_bits, f32_to_bf16, to_float

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


def f64(x):
    """A result or input (NumPy of any of the dtypes, bf16 bits, torch tensor) as float64 NumPy."""
    if hasattr(x, "detach"):  # torch
        return x.detach().double().numpy()
    x = np.asarray(x)
    return to_float(x.view(np.ndarray)) if x.dtype == np.uint16 else x.astype(np.float64)


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
    O = reference.sdpa(f64(q[:1, :h][:, :, rows]), f64(k[:1, hk]), f64(v[:1, hk]), mask=mask)
    err = float(np.abs(f64(o[:1, :h][:, :, rows]) - O).max())
    if not err < _CHECK_TOL[case.dtype]:
        raise RuntimeError(f"{case.name}: result differs from the float64 oracle by {err:.2e}")
    return err
