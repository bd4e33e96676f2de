"""The capture's output tree (SKELETON: interface only, the implementation follows on this branch).

See docs/capture.md, section "Output tree".
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_hs_compat.errors import CaptureStoreError, CircuitOpenError

__all__ = [
    "Breaker",
    "CaptureStore",
    "CaptureStoreError",
    "CircuitOpenError",
    "IndexRow",
    "Retry",
    "SampleInfo",
    "Summary",
    "read_index",
    "read_summary",
]


@dataclass(frozen=True, slots=True)
class SampleInfo:
    """What the store needs to know of one sample: its id, where it came from, its token counts, free metadata and
    the token ids the engine was given (``input_ids``: a record is adopted only when its token ids begin with
    exactly these)."""

    sample_id: str
    source: str
    num_tokens: int
    loss_tokens: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    input_ids: tuple[int, ...] | None = None

    @classmethod
    def of(cls, sample: Any) -> SampleInfo:
        """From a :class:`vllm_hs_compat.capture.samples.Sample`."""
        raise NotImplementedError("skeleton")


@dataclass(frozen=True, slots=True)
class IndexRow:
    """One row of the index (the columns of ``index/rank-R-part-NNNNN.parquet``)."""

    sample_id: str
    source: str
    status: str  # "ok" | "failed"
    reason: str | None
    message: str | None
    record: str | None  # manifest path relative to the tree's root (posix), None for a failure
    tokens: int
    loss_tokens: int | None
    bytes: int
    rank: int
    checksum: int | None
    metadata: str  # JSON text of the sample's metadata


@dataclass
class Summary:
    """Counters of one rank's run, or merged over ranks (:func:`read_summary`)."""

    rows_read: int = 0
    captured: int = 0
    skipped: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    loss_tokens: int = 0
    bytes: int = 0
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    ranks: list[int] = field(default_factory=list)
    closed: bool = False


class Retry:
    """How many times one sample may be tried (``max_attempts`` in all) for which failure reasons."""

    def __init__(self, max_attempts: int = 3, *, retry_on: Collection[str] | None = None) -> None:
        raise NotImplementedError("skeleton")

    def allow(self, sample_id: str, reason: str) -> bool:
        """Count a failed attempt of ``sample_id``; True when it may be tried again."""
        raise NotImplementedError("skeleton")


class Breaker:
    """Stops the run after ``max_consecutive`` failures in a row (:class:`CircuitOpenError`)."""

    def __init__(self, max_consecutive: int = 20) -> None:
        raise NotImplementedError("skeleton")

    def success(self) -> None:
        raise NotImplementedError("skeleton")

    def failure(self, reason: str, message: str = "") -> None:
        raise NotImplementedError("skeleton")


class CaptureStore:
    """The output tree of one rank; many ranks (processes) may share one tree."""

    def __init__(
        self,
        out: str | Path,
        *,
        run_config: Mapping[str, Any],
        rank: int = 0,
        world_size: int = 1,
        records_per_shard: int = 1000,
    ) -> None:
        raise NotImplementedError("skeleton")

    def owns(self, sample_id: str) -> bool:
        raise NotImplementedError("skeleton")

    def done(self, sample_id: str) -> bool:
        raise NotImplementedError("skeleton")

    def staging_dir(self) -> Path:
        raise NotImplementedError("skeleton")

    def adopt(self, sample: SampleInfo, manifest: Path) -> IndexRow:
        raise NotImplementedError("skeleton")

    def fail(self, sample: SampleInfo, reason: str, message: str) -> IndexRow:
        raise NotImplementedError("skeleton")

    def note_rows(self, *, read: int = 0, skipped: int = 0) -> None:
        raise NotImplementedError("skeleton")

    def close(self) -> Summary:
        raise NotImplementedError("skeleton")


def read_index(out: str | Path) -> Any:
    """Every index part of every rank merged into one ``pyarrow.Table`` (one row per sample)."""
    raise NotImplementedError("skeleton")


def read_summary(out: str | Path) -> Summary:
    raise NotImplementedError("skeleton")


_ = (CaptureStoreError, CircuitOpenError)
