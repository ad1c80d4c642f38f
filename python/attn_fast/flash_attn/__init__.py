"""FlashAttention 2's Python API on the CPU: ``from attn_fast.flash_attn import flash_attn_func``.

    from attn_fast.flash_attn import flash_attn_func, flash_attn_with_kvcache
    out = flash_attn_func(q, k, v, causal=True)          # (B, L, H, d) CPU tensors

The functions have flash-attn 2's signatures, defaults, layouts and return
conventions (``attn_fast.flash_attn.interface`` says what differs, and every
difference raises rather than computing something else). For code that does
``import flash_attn`` and cannot be edited, ``install()`` registers this
package under flash-attn's module names, on machines where flash-attn is not
installed; ``ATTN_FAST_FLASH_ATTN=1`` does the same when ``attn_fast.flash_attn``
is first imported.

Module names ``install()`` registers:

    flash_attn                          this package (the functions below)
    flash_attn.flash_attn_interface     attn_fast.flash_attn.interface
    flash_attn.bert_padding             attn_fast.flash_attn.bert_padding
    flash_attn.layers                   a package holding ``rotary``
    flash_attn.layers.rotary            attn_fast.flash_attn.rotary

Needs torch (``attn_fast`` itself does not).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings

from . import bert_padding, interface, rotary
from .interface import *  # noqa: F403 (the flash-attn functions: interface.__all__)

__all__ = [
    *interface.__all__,  # the flash-attn functions
    "install",
    "uninstall",
    "installed",
    "bert_padding",
    "interface",
    "rotary",
]

# flash-attn's version this API follows (some model code checks flash_attn.__version__).
FLASH_ATTN_VERSION = "2.8.3"

ENV_SWITCH = "ATTN_FAST_FLASH_ATTN"

_NAMES = (
    "flash_attn",
    "flash_attn.flash_attn_interface",
    "flash_attn.bert_padding",
    "flash_attn.layers",
    "flash_attn.layers.rotary",
)


class FlashAttnShadowError(ImportError):
    """A real flash-attn is importable: ``install()`` refuses to hide it."""


def _real_flash_attn() -> str | None:
    """Where a real flash-attn package lives, or None (our own registration does not count)."""
    mod = sys.modules.get("flash_attn")
    if mod is not None and not getattr(mod, "__attn_fast__", False):
        return getattr(mod, "__file__", None) or repr(mod)
    if mod is not None:  # ours: look past it on the path
        return None
    spec = importlib.machinery.PathFinder.find_spec("flash_attn")
    return None if spec is None else (spec.origin or str(spec.submodule_search_locations))


def installed() -> bool:
    """True when ``import flash_attn`` gives this package (after ``install()``)."""
    return getattr(sys.modules.get("flash_attn"), "__attn_fast__", False)


def install(force: bool = False) -> None:
    """Make ``import flash_attn`` (and the submodules listed in the module docstring)
    resolve to this package, for code that imports flash-attn and cannot be edited.

    Raises FlashAttnShadowError (an ImportError) when a real flash-attn is
    importable (installed, or already imported), naming where it lives: the
    real kernels are never hidden silently. ``force=True`` registers ours
    anyway (with a RuntimeWarning naming the real one). Idempotent; undo with
    ``uninstall()``. Only ``sys.modules`` changes: nothing is written to disk.
    """
    if installed():
        return
    real = _real_flash_attn()
    if real is not None:
        if not force:
            raise FlashAttnShadowError(
                f"a real flash-attn is importable ({real}); attn_fast.flash_attn.install() will "
                "not shadow it. Use it, or import attn_fast.flash_attn directly, or pass "
                "force=True to register the CPU version under the name flash_attn anyway"
            )
        warnings.warn(
            f"attn_fast.flash_attn.install(force=True) shadows the real flash-attn at {real}",
            RuntimeWarning,
            stacklevel=2,
        )
    top = sys.modules[__name__]
    layers = types.ModuleType(
        "flash_attn.layers", "attn_fast.flash_attn's stand-in for flash_attn.layers"
    )
    layers.__path__ = []  # a package, so that flash_attn.layers.rotary imports
    layers.rotary = rotary
    layers.__attn_fast__ = True
    for mod in (top, interface, bert_padding, rotary):
        mod.__attn_fast__ = True
    top.__version__ = FLASH_ATTN_VERSION
    top.flash_attn_interface = interface
    top.layers = layers
    for name, mod in zip(_NAMES, (top, interface, bert_padding, layers, rotary)):
        sys.modules[name] = mod


def uninstall() -> None:
    """Remove the module names ``install()`` registered (only ours)."""
    for name in _NAMES:
        if getattr(sys.modules.get(name), "__attn_fast__", False):
            del sys.modules[name]


if os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes", "on"):
    try:
        install()
    except FlashAttnShadowError as e:  # the real one wins; say so once
        warnings.warn(f"{ENV_SWITCH} is set but {e}", RuntimeWarning, stacklevel=2)
