"""Runtime configuration: instruction set, threads, and show_config()."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Any

from . import _core

__all__ = [
    "set_isa",
    "get_isa",
    "set_num_threads",
    "get_num_threads",
    "set_decode_prefetch",
    "get_decode_prefetch",
    "show_config",
    "config",
]


ISA_NAMES = ("scalar", "avx2", "avx512", "avx512_bf16", "amx", "amx_emu", "neon", "neon_bf16")


def set_isa(name: str) -> None:
    """Force the kernel instruction set: "scalar", "avx2", "avx512",
    "avx512_bf16" (avx512 plus vdpbf16ps micro-kernels for bfloat16 calls;
    chosen by default only where a timing probe finds them faster), "amx"
    (AMX-BF16 tiles for bfloat16 forward calls; chosen by default where the CPU,
    the OS and a one-time self-check allow it, see ``show_config()``) or
    "amx_emu" (the amx kernel with its tile operations emulated by vdpbf16ps:
    runs wherever avx512_bf16 does, slower; for tests, never the default).
    On avx512_bf16 every call other than the bfloat16 forward and the bfloat16
    decode (its Q K^T by vdpbf16ps) runs the avx512 kernels; on amx and amx_emu
    every call other than the bfloat16 forward. On aarch64: "neon" (Advanced
    SIMD, every ARMv8-A CPU) or "neon_bf16" (FEAT_BF16 + FEAT_I8MM: the
    bfloat16 forward and decode by BFDOT, everything else as neon; the default
    where the CPU has them).

    Raises ValueError for an unknown name and RuntimeError when this CPU/OS
    (CPUID and XCR0; for amx also Linux's tile-data permission; on aarch64
    HWCAP/HWCAP2 or macOS's hw.optional.arm sysctls) or this build does not
    support it. Affects the whole process; the environment variable
    ATTN_FAST_ISA does the same at import.
    """
    name = str(name).strip().lower()
    if name not in ISA_NAMES:
        raise ValueError(
            "ISA must be one of " + ", ".join(repr(n) for n in ISA_NAMES) + f", got {name!r}"
        )
    try:
        _core.set_isa(name)
    except RuntimeError as e:
        raise RuntimeError(
            f"attn_fast: cannot use ISA {name!r}: {e}. Available here: "
            f"{', '.join(_core.available_isas())}"
        ) from None


def get_isa() -> str:
    """The instruction set the kernels run with now."""
    return _core.active_isa()


DECODE_PREFETCH_NAMES = ("auto", "l1", "l2")


def set_decode_prefetch(name: str) -> None:
    """How the decode kernel (KVCache / PagedKVCache ``attend``, ``decode``) asks
    for the next key block's K/V lines. A performance hint only: results are
    bit-identical under every policy.

    "l1": ``prefetcht0`` plus a pass that touches each block's lines first
    (tuned on AMD Zen 3 / Zen 5); "l2": ``prefetcht1`` (into L2) and no touch
    pass (tuned on Intel Sapphire Rapids, where the L1 fill buffers cap the
    misses in flight; also the faster one on AMD Zen 4); "auto" (the default):
    "l2" on Intel CPUs and on AMD Zen 4 (CPUID family 19h with AVX-512), "l1"
    elsewhere. Raises ValueError for another name. Affects the whole process;
    the environment variable ATTN_FAST_DECODE_PREFETCH does the same at import.
    """
    name = str(name).strip().lower()
    if name not in DECODE_PREFETCH_NAMES:
        raise ValueError(
            "decode prefetch must be one of "
            + ", ".join(repr(n) for n in DECODE_PREFETCH_NAMES)
            + f", got {name!r}"
        )
    _core.set_decode_prefetch(name)


def get_decode_prefetch() -> str:
    """The decode prefetch policy in effect: "l1" or "l2" (see set_decode_prefetch)."""
    return _core.decode_prefetch()


def set_num_threads(n: int) -> None:
    """Set the number of OpenMP threads attn_fast's kernels use (per process)."""
    if isinstance(n, bool) or not isinstance(n, int) and not hasattr(n, "__index__"):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    n = int(n)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n > 2**31 - 1:
        raise ValueError(f"n must fit in a C int, got {n}")
    _core.set_num_threads(n)


def get_num_threads() -> int:
    """Threads the kernels will use: set_num_threads(), else OMP_NUM_THREADS, else all cores."""
    return _core.get_num_threads()


# Arm Ltd. cores by /proc/cpuinfo's "CPU part" (implementer 0x41), for the label of
# benchmark results on aarch64 Linux, which has no "model name" line.
_ARM_PARTS = {
    "0xd0c": "Neoverse N1",
    "0xd40": "Neoverse V1",
    "0xd49": "Neoverse N2",
    "0xd4f": "Neoverse V2",
    "0xd8e": "Neoverse N3",
    "0xd84": "Neoverse V3",
}


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo's "model name" (x86), its "CPU part" on
    aarch64 Linux, sysctl's machdep.cpu.brand_string on macOS ("Apple M2")."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                fields.setdefault(key.strip(), val.strip())
    except OSError:
        pass
    if fields.get("model name"):
        return fields["model name"]
    if "CPU part" in fields:
        impl, part = fields.get("CPU implementer", "?"), fields["CPU part"]
        name = _ARM_PARTS.get(part) if impl == "0x41" else None
        return name or f"ARM implementer {impl} part {part}"
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def cpu_id() -> str:
    """CPUID's vendor, family and model ("GenuineIntel family 6h model 8fh"), which
    the decode prefetch's "auto" reads; the model name of a VM is often masked."""
    vendor, family, model = _core.cpu_signature()
    return f"{vendor} family {family:x}h model {model:x}h" if vendor else ""


def config() -> dict[str, Any]:
    """The configuration as a dict (what show_config prints)."""
    from . import __version__

    compiled = list(_core.compiled_isas())
    cfg = {
        "version": __version__,
        "isa": _core.active_isa(),
        "available_isas": list(_core.available_isas()),
        "compiled_isas": compiled,
        "openmp": _core.openmp_runtime(),
        "num_threads": _core.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_id": cpu_id(),
        "cores": os.cpu_count(),
        "amx": _core.amx_status(),  # x86 builds only (removed below on ARM)
        "decode_prefetch": _core.decode_prefetch(),
        "ATTN_FAST_ISA": os.environ.get("ATTN_FAST_ISA", ""),
        "ATTN_FAST_DECODE_PREFETCH": os.environ.get("ATTN_FAST_DECODE_PREFETCH", ""),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", ""),
    }
    if "neon" in compiled:  # an aarch64 build: AMX is an x86 feature
        del cfg["amx"]
    return cfg


def show_config() -> None:
    """Print version, chosen ISA, available ISAs, OpenMP runtime and thread count."""
    cfg = config()
    width = max(len(key) for key in cfg)
    for key, val in cfg.items():
        if isinstance(val, list):
            val = ", ".join(val)
        print(f"{key:>{width}}: {val}")
