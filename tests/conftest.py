"""Shared fixtures: per-ISA runs, fresh seeded RNGs, poisoned output buffers."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

import attn_fast as af

ISAS = list(af._core.available_isas())
if os.environ.get("ATTN_FAST_ISA", "").strip():
    # A forced ISA (`ATTN_FAST_ISA=scalar pytest ...`, as .ci/run does) runs the
    # kernel tests on that ISA alone; import already failed if the CPU lacks it.
    ISAS = [af.get_isa()]


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test once per instruction set this CPU supports."""
    old = af.get_isa()
    af.set_isa(request.param)
    yield request.param
    af.set_isa(old)


@pytest.fixture
def rng(request):
    """A generator seeded from the test id: fresh inputs per test, reproducible."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def poisoned(shape, dtype):
    """An output buffer full of NaN, so any element the kernel skips is caught."""
    return np.full(shape, np.nan, dtype=dtype)


def tol(dtype):
    return (
        dict(rtol=2e-4, atol=2e-5)
        if np.dtype(dtype) == np.float32
        else dict(rtol=1e-10, atol=1e-11)
    )
