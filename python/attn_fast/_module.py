"""The base class of the NumPy layers: named parameters, state_dict, load_weights.

``MultiHeadAttention`` and the Transformer classes (``LayerNorm``, ``MLP``,
``TransformerBlock``, ``TinyTransformerLM``, ...) derive from ``Module``: a
module owns some arrays (``_own``) and holds sub-modules (``_children``); its
``state_dict`` lists them all by dotted name, and ``load_weights`` copies a
mapping back into them, every weight checked before any is copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._checks import shape_str


def as_rng(rng: Any) -> np.random.Generator:
    """A NumPy Generator from None, an int seed or a Generator (TypeError otherwise)."""
    if rng is None or isinstance(rng, (int, np.integer)) and not isinstance(rng, (bool, np.bool_)):
        return np.random.default_rng(rng)
    if isinstance(rng, np.random.Generator):
        return rng
    raise TypeError(
        f"rng must be None, an int seed or a numpy.random.Generator, got {type(rng).__name__}"
    )


def _checked_weight(dst: np.ndarray, src: Any, name: str) -> np.ndarray:
    """`src` as an array fit for parameter `dst` (shape, real dtype, finite), or a clear error.
    16-bit sources (float16, ``ml_dtypes.bfloat16``, torch.bfloat16 / float16 tensors) are
    read as their float32 values; copying into a 16-bit parameter rounds to nearest even."""
    if type(src).__module__.startswith("torch") and str(getattr(src, "dtype", "")) in (
        "torch.bfloat16",
        "torch.float16",
    ):
        src = src.detach().float().cpu().numpy()  # NumPy cannot read torch.bfloat16
    a = np.asarray(src)
    if a.dtype.name == "bfloat16":  # ml_dtypes (dtype kind "V"): its exact float32 values
        a = a.astype(np.float32)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"weight {name} must be a real numeric array, got dtype {a.dtype}")
    if a.shape != dst.shape:
        raise ValueError(f"weight {name} has shape {shape_str(a)}, expected {shape_str(dst)}")
    if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
        raise ValueError(f"weight {name} contains NaN or inf")
    return a


class Module:
    """Named parameters with ``state_dict`` / ``load_weights`` (prefix-aware).

    Subclasses override ``_own`` (name -> array this module owns directly)
    and ``_children`` (name -> sub-module); names join with dots.
    """

    def _own(self) -> dict[str, np.ndarray]:
        return {}

    def _children(self) -> dict[str, Module]:
        return {}

    def _unknown_hint(self) -> str:
        """Appended to the "unknown weights" error (why a name may be unknown)."""
        return ""

    def state_dict(self, prefix: str = "") -> dict[str, np.ndarray]:
        """All parameters by dotted name (views into the live arrays: copy them
        to keep a snapshot)."""
        sd = {prefix + n: p for n, p in self._own().items()}
        for cn, c in self._children().items():
            sd.update(c.state_dict(prefix=f"{prefix}{cn}."))
        return sd

    def load_weights(
        self, weights: Mapping[str, Any], *, prefix: str = "", strict: bool = True
    ) -> None:
        """Copy arrays from a mapping (dict, ``np.load(...npz)``, a safetensors
        dict) into the parameters, by the names ``state_dict`` lists, each
        preceded by ``prefix``.

        strict=True (default): every parameter must be present (KeyError
        listing all missing names) and no unknown name under ``prefix`` may
        appear (KeyError listing them). Shapes must match exactly
        (ValueError), dtypes be real and values finite. Every weight is
        checked before any is copied: on error nothing changes.
        """
        own = self.state_dict(prefix=prefix)
        if strict:
            missing = [n for n in own if n not in weights]
            if missing:
                raise KeyError(f"missing weights: {', '.join(missing)}")
            unknown = sorted(n for n in weights if n.startswith(prefix) and n not in own)
            if unknown:
                raise KeyError(f"unknown weights: {', '.join(unknown)}{self._unknown_hint()}")
        checked = [(p, _checked_weight(p, weights[n], n)) for n, p in own.items() if n in weights]
        for dst, a in checked:
            dst[...] = a
