"""Pick the kernel set for an array module: NumPy reference or CuPy RawKernels."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["array_module", "kernels_for"]


def array_module(a: Any) -> ModuleType:
    """``numpy`` for host arrays, ``cupy`` for CuPy arrays (imported only then)."""
    if type(a).__module__.startswith("cupy"):
        from .._optional import require

        return require("cupy")
    return np


def kernels_for(xp: ModuleType) -> ModuleType:
    """The module of kernels for ``xp``.

    Both modules export ``rms_norm``, ``rope_``, ``kv_write`` and
    ``extend_attention`` with identical signatures.

    Raises:
        MissingExtraError: for CuPy when the ``gpu`` extra is not installed.
    """
    if xp is np:
        from . import _reference

        return _reference
    from . import _cuda

    return _cuda
