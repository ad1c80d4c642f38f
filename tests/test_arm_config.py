"""The aarch64 side of the configuration: ISA names, show_config without the x86 AMX line,
the CPU label on aarch64 Linux, and set_isa's errors for the ARM paths."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

import attn_fast as af
from attn_fast import _config

ARM_CPUINFO = (
    "processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd bf16 i8mm\n"
    "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU part\t: {part}\n\n"
)


@pytest.mark.parametrize(
    ("impl", "part", "name"),
    [
        ("0x41", "0xd4f", "Neoverse V2"),
        ("0x41", "0xd0c", "Neoverse N1"),
        ("0x41", "0x123", "ARM implementer 0x41 part 0x123"),
        ("0x61", "0x032", "ARM implementer 0x61 part 0x032"),  # Apple cores under Linux
    ],
)
def test_cpu_model_on_aarch64_linux(monkeypatch, impl, part, name):
    text = ARM_CPUINFO.format(part=part).replace("0x41", impl)
    real_open = open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/cpuinfo":
            return io.StringIO(text)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(_config, "open", fake_open, raising=False)
    assert _config.cpu_model() == name


def test_show_config_has_amx_only_on_x86(capsys):
    cfg = _config.config()
    arm = "neon" in cfg["compiled_isas"]
    assert ("amx" in cfg) is not arm
    af.show_config()
    out = capsys.readouterr().out
    assert ("amx:" in out) is not arm
    assert cfg["isa"] in cfg["available_isas"]


def test_arm_isas_named_and_refused_clearly():
    assert {"neon", "neon_bf16"} <= set(_config.ISA_NAMES)
    for name in ("neon", "neon_bf16"):
        if name in af._core.available_isas():
            continue
        with pytest.raises(RuntimeError, match=f"cannot use ISA '{name}'"):
            af.set_isa(name)
    assert af.get_isa() in af._core.available_isas()


def test_default_isa_on_arm_is_the_best_arm_path():
    runs = af._core.available_isas()
    if "neon" not in runs:
        pytest.skip("not an aarch64 build on an ARM CPU")
    # A fresh interpreter without ATTN_FAST_ISA: the dispatch's own choice.
    env = {k: v for k, v in os.environ.items() if k != "ATTN_FAST_ISA"}
    r = subprocess.run(
        [sys.executable, "-c", "import attn_fast as af; print(af.get_isa())"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("neon_bf16" if "neon_bf16" in runs else "neon")
