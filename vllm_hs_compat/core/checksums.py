"""Record checksums: a transport-integrity check over a record's bytes, not a defence against deliberate tampering.

* ``xxh3_64`` (default): XXH3, 64 bits, from the maintained ``xxhash`` library; memory speed (about the cost of
  one pass over the bytes, see docs/export.md for the figure against memcpy).  Any changed, swapped, truncated or
  misplaced bytes change it with probability 1 - 2**-64.
* ``crc32``: zlib's CRC-32, about 4x slower, for readers that only have zlib.

Pure: torch, xxhash (a hard dependency of the package, imported on first use) and zlib.  Re-exported by
:mod:`vllm_hs_compat.core.records`, where users import them.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable
from typing import Any, Final

import torch

from ..errors import RecordFormatError

CHECKSUM_ALGORITHMS: Final = ("xxh3_64", "crc32")
DEFAULT_CHECKSUM: Final = "xxh3_64"
#: The largest checksum a record carries (msgpack's integers stop at 2**64 - 1).
MAX_CHECKSUM: Final = (1 << 64) - 1


def byte_view(data: torch.Tensor) -> memoryview:
    """Zero-copy buffer over a contiguous CPU tensor's bytes (no numpy needed).  Keep ``data`` alive while
    used."""
    n = data.numel() * data.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(data.data_ptr())).cast("B")


def _xxhash() -> Any:
    """The ``xxhash`` module (a dependency of this package; imported on first use, so an environment set up with
    ``--no-deps`` fails here with the fix, not at import)."""
    try:
        import xxhash
    except ImportError:
        raise RecordFormatError(
            "the xxh3_64 record checksum needs the 'xxhash' package (a dependency of vllm-hs-compat): pip install "
            "xxhash"
        ) from None
    return xxhash


class ChecksumState:
    """Incremental checksum over consecutive chunks of one byte string of ``total_bytes`` bytes (lets a reader
    verify chunk ``k`` while chunk ``k + 1`` is still in flight)."""

    def __init__(self, algorithm: str, total_bytes: int) -> None:
        if algorithm not in CHECKSUM_ALGORITHMS:
            raise RecordFormatError(
                f"unknown checksum algorithm {algorithm!r}; expected one of {CHECKSUM_ALGORITHMS} "
                "(bsum64 was removed: it missed swapped words; re-export with xxh3_64)"
            )
        self.algorithm = algorithm
        self.total = total_bytes
        self.seen = 0
        self._xxh = _xxhash().xxh3_64() if algorithm == "xxh3_64" else None
        self._crc = 0

    def update(self, data: torch.Tensor) -> ChecksumState:
        """Feed the next chunk: a 1-D contiguous CPU ``uint8`` tensor."""
        if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous() or data.device.type != "cpu":
            raise RecordFormatError(
                f"checksum input must be a 1-D contiguous CPU uint8 tensor, got dtype={data.dtype} "
                f"dim={data.dim()} contiguous={data.is_contiguous()} device={data.device}; "
                "pass tensor.contiguous().view(torch.uint8).reshape(-1).cpu()"
            )
        n = data.numel()
        if self.seen + n > self.total:
            raise RecordFormatError(f"checksum fed {self.seen + n} bytes, expected {self.total}")
        if self._xxh is not None:
            self._xxh.update(byte_view(data))
        else:
            self._crc = zlib.crc32(byte_view(data), self._crc)
        self.seen += n
        return self

    def update_bytes(self, data: bytes | bytearray | memoryview) -> ChecksumState:
        """Feed the next chunk as a byte buffer (what :meth:`update` does after its tensor checks)."""
        n = len(data)
        if self.seen + n > self.total:
            raise RecordFormatError(f"checksum fed {self.seen + n} bytes, expected {self.total}")
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)
        self.seen += n
        return self

    def digest(self) -> int:
        """The checksum (an int in ``[0, 2**64)``); every byte must have been fed."""
        if self.seen != self.total:
            raise RecordFormatError(f"checksum fed {self.seen} of {self.total} bytes")
        if self._xxh is not None:
            return int(self._xxh.intdigest())
        return self._crc & 0xFFFFFFFF


def checksum_bytes(data: bytes | bytearray | memoryview, algorithm: str = DEFAULT_CHECKSUM) -> int:
    """Checksum of a byte string (same values as :func:`compute_checksum` of the same bytes)."""
    if algorithm == "xxh3_64":
        return int(_xxhash().xxh3_64_intdigest(data))
    if algorithm == "crc32":
        return zlib.crc32(data) & 0xFFFFFFFF
    raise RecordFormatError(f"unknown checksum algorithm {algorithm!r}; expected one of {CHECKSUM_ALGORITHMS}")


def checksum_function(algorithm: str) -> Callable[[bytes | bytearray | memoryview], int]:
    """The function :func:`checksum_bytes` calls for ``algorithm`` (looked up once for a loop over many
    records)."""
    if algorithm == "xxh3_64":
        fn: Callable[[bytes | bytearray | memoryview], int] = _xxhash().xxh3_64_intdigest
        return fn
    if algorithm == "crc32":
        return _crc32
    raise RecordFormatError(f"unknown checksum algorithm {algorithm!r}; expected one of {CHECKSUM_ALGORITHMS}")


def _crc32(data: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def compute_checksum(data: torch.Tensor, algorithm: str = DEFAULT_CHECKSUM) -> int:
    """Checksum of a 1-D contiguous CPU ``uint8`` tensor (see the module docstring for the algorithms)."""
    if not isinstance(data, torch.Tensor):
        raise RecordFormatError(f"checksum input must be a torch.Tensor, found {type(data).__name__}")
    return ChecksumState(algorithm, data.numel()).update(data).digest()
