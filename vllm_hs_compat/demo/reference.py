"""Moved to :mod:`vllm_hs_compat.reference.forward`.

This name keeps working for one release, with a ``DeprecationWarning``."""

import warnings
from typing import Any

import vllm_hs_compat.reference.forward as _moved

warnings.warn(
    "vllm_hs_compat.demo.reference moved to vllm_hs_compat.reference.forward: import it from there "
    "(the old name goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
