"""Bad and unusual input for ``set_num_threads`` (_config.py): a rejected value keeps the setting.

Every case is a clear exception naming the argument, or a result checked
against a float64 oracle. Split by module from tests/test_hardening_api.py;
the decisions are listed in docs/HARDENING.md ("Every other entry point").
"""

from __future__ import annotations

import attn_fast as af
import numpy as np
import pytest

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
