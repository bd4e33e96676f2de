"""The dtypes a record can carry, by their wire names (``str(torch.dtype)`` without the ``torch.`` prefix).

Pure: torch only.  Re-exported by :mod:`vllm_hs_compat.core.records`, where users import them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import torch

from ..errors import RecordFormatError

#: dtype name on the wire -> torch dtype.
DTYPES: Final[Mapping[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}

#: dtype name on the wire -> bytes per element (its keys are exactly :data:`DTYPES`'s).
ITEMSIZE: Final[Mapping[str, int]] = {
    name: int(torch.empty((), dtype=dt).element_size()) for name, dt in DTYPES.items()
}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype; raises :class:`RecordFormatError` for dtypes records cannot carry."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise RecordFormatError(
        f"dtype {dtype} cannot be carried in a record; expected one of {sorted(DTYPES)}; "
        "cast the hidden states before exporting"
    )


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a wire dtype name (:class:`RecordFormatError` for an unknown one)."""
    torch_dtype(name)
    return ITEMSIZE[name]


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a wire dtype name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise RecordFormatError(
            f"unknown dtype name {name!r}; expected one of {sorted(DTYPES)}; "
            "producer and consumer may run different vllm-hs-compat versions"
        ) from None
