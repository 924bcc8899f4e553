"""Lazy imports of optional extras with an error that names the extra."""

from __future__ import annotations

import importlib
from types import ModuleType

from ._errors import MissingExtraError

# import name -> extra that installs it
K_EXTRAS = {
    "ucxx": "ucx",
    "cupy": "gpu",
    "matplotlib": "bench",
    "vllm": "vllm",
    "torch": "vllm",
    "tokenizers": "vllm",
}


def require(module: str) -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtraError` naming its extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise MissingExtraError(top, K_EXTRAS.get(top, top)) from exc


def available(module: str) -> bool:
    """Whether ``module`` imports, without raising."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True
