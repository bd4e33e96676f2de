"""Moved to :mod:`vllm_hs_compat.drafter.head`.

This name keeps working for one release, with a ``DeprecationWarning``."""

import warnings
from typing import Any

import vllm_hs_compat.drafter.head as _moved

warnings.warn(
    "vllm_hs_compat.demo.drafter moved to vllm_hs_compat.drafter.head: import it from there "
    "(the old name goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
