"""``set_num_threads`` (_config.py): a value that is not a positive int of
reasonable size raises, and the setting stays what it was (docs/HARDENING.md)."""

from __future__ import annotations

import numpy as np
import pytest

import attn_fast as af

# ---------------------------------------------------------------- set_num_threads


@pytest.mark.parametrize(
    "bad, exc",
    [
        (2.0, TypeError),
        (True, TypeError),
        (np.True_, TypeError),
        ("2", TypeError),
        (0, ValueError),
        (-1, ValueError),
        (2**31, ValueError),
    ],
)
def test_set_num_threads_errors_keep_the_setting(bad, exc):
    before = af.get_num_threads()
    with pytest.raises(exc, match="n must"):
        af.set_num_threads(bad)
    assert af.get_num_threads() == before
