"""Where rows come from: JSONL / JSON / Parquet files, a folder of them, or ``hf:NAME[:split]`` (``datasets``).

Each row is yielded with its :class:`SourceRef` (file and 0-based row); a line that cannot be parsed is yielded
as a :class:`~vllm_hs_compat.capture.samples.RowError` (reason ``malformed``) and the reading goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SourceRef:
    """Where a row came from: ``file`` as given (or ``hf:NAME:split``) and its 0-based row (line) number."""

    file: str
    row: int

    def __str__(self) -> str:
        return f"{self.file}:{self.row}"


@dataclass(frozen=True, slots=True)
class RawRow:
    """One parsed row (a JSON object) and where it came from."""

    source: SourceRef
    row: dict[str, Any]


def iter_rows(src: str) -> Iterator[Any]:
    """The rows of ``src`` in a deterministic order (skeleton: implemented in a later commit)."""
    raise NotImplementedError("skeleton")
