"""Shared fixtures: per-ISA runs and fresh seeded RNGs.

The plain helpers (inputs, poisoned buffers, tolerances, the oracle assertion)
live in tests/helpers.py; `poisoned` and `tol` are re-exported here for the
files that still import them from conftest.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from helpers import poisoned, tol  # noqa: F401  (re-exported)

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
