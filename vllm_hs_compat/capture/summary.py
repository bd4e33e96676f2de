"""The capture's counters: one rank's run (``summary-rank-R.json``), merged over ranks with the tree's totals
(``summary.json``, :func:`read_summary`).

Pure Python (the tree's totals through :func:`~vllm_hs_compat.capture.index.read_index`, so pyarrow).  Re-exported
by :mod:`vllm_hs_compat.capture.store`, where users import them.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_hs_compat.errors import CaptureStoreError

from .index import read_index

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass
class Summary:
    """Counters of one rank's latest run, or merged over ranks (:func:`read_summary`), plus the tree's totals from
    the merged index (``tree_*``: what a trainer will find, whatever runs made it)."""

    rows_read: int = 0
    """Rows of the rank's share read from the source in the run, whatever became of them (skipped included)."""
    captured: int = 0
    skipped: int = 0
    """Of those, rows whose sample was already done at start (reported through
    :meth:`CaptureStore.note_rows <vllm_hs_compat.capture.store.CaptureStore.note_rows>`)."""
    failed: dict[str, int] = field(default_factory=dict)
    """Samples (rows) of the run that ended failed, by reason: a failed attempt that a later attempt of the same
    run captured is not counted."""
    tokens: int = 0
    loss_tokens: int = 0
    bytes: int = 0
    elapsed_s: float = 0.0
    """Wall time of the run (merged: the longest rank's, ranks run side by side)."""
    engine_start_s: float = 0.0
    """Time the run's engine took to start (merged: the longest rank's); 0 when none started."""
    capture_s: float = 0.0
    """Time from a ready engine to the last record adopted (merged: the longest rank's)."""
    tokens_per_s: float = 0.0
    """Tokens captured per second of capture (``tokens / capture_s``; engine start-up not counted)."""
    engine_s: float = 0.0
    """Of ``capture_s``, seconds in the engine: ``generate`` and the flush that brings each batch's records to the
    staging folder (merged: summed over ranks, like the three below)."""
    adopt_s: float = 0.0
    """Seconds adopting records (waiting for their files, reading and verifying them, moving them into shards, the
    index parts and their syncs, failed rows), in the adopter thread while the engine runs the next batch."""
    adopt_wait_s: float = 0.0
    """Of ``adopt_s``, the seconds the engine waited for adoption (idle): near 0 when the engine bounds the run,
    near ``adopt_s`` when adoption does (all of it when serial: ``--adoption``)."""
    overlap_s: float = 0.0
    """Of ``adopt_s``, the seconds it ran while the engine ran (0 when serial: ``--adoption``)."""
    ranks: list[int] = field(default_factory=list)
    world_size: int = 1
    closed: bool = False
    """True when every rank summarised closed its store (False: a rank still runs, or was killed)."""
    tree_records: int = 0
    tree_failed: dict[str, int] = field(default_factory=dict)
    tree_tokens: int = 0
    tree_loss_tokens: int = 0
    tree_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Summary:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


def _tree_totals(index: pa.Table, summary: Summary) -> None:
    status = index.column("status").to_pylist()
    reasons = index.column("reason").to_pylist()
    tokens = index.column("tokens").to_pylist()
    loss = index.column("loss_tokens").to_pylist()
    nbytes = index.column("bytes").to_pylist()
    failed: Counter[str] = Counter()
    for st, reason, tok, lt, nb in zip(status, reasons, tokens, loss, nbytes, strict=True):
        if st == "ok":
            summary.tree_records += 1
            summary.tree_tokens += tok
            summary.tree_loss_tokens += lt or 0
            summary.tree_bytes += nb
        else:
            failed[reason or "unknown"] += 1
    summary.tree_failed = dict(sorted(failed.items()))


def read_summary(out: str | os.PathLike[str]) -> Summary:
    """The runs' counters merged over ranks (every ``summary-rank-R.json``: each rank's latest run) plus the tree's
    totals from :func:`~vllm_hs_compat.capture.index.read_index`.  ``elapsed_s`` and ``capture_s`` are the longest
    rank's, ``engine_s``, ``adopt_s``, ``adopt_wait_s`` and ``overlap_s`` summed, and ``tokens_per_s`` = tokens /
    ``capture_s``."""
    root = Path(out)
    merged = Summary()
    failed: Counter[str] = Counter()
    closed = True
    found = False
    for p in sorted(root.glob("summary-rank-*.json")):
        try:
            s = Summary.from_dict(json.loads(p.read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise CaptureStoreError(f"{p} cannot be read ({e}); it is rewritten by the next run of that rank") from None
        found = True
        merged.rows_read += s.rows_read
        merged.captured += s.captured
        merged.skipped += s.skipped
        failed.update(s.failed)
        merged.tokens += s.tokens
        merged.loss_tokens += s.loss_tokens
        merged.bytes += s.bytes
        merged.elapsed_s = max(merged.elapsed_s, s.elapsed_s)
        merged.engine_start_s = max(merged.engine_start_s, s.engine_start_s)
        merged.capture_s = max(merged.capture_s, s.capture_s)
        merged.engine_s += s.engine_s
        merged.adopt_s += s.adopt_s
        merged.adopt_wait_s += s.adopt_wait_s
        merged.overlap_s += s.overlap_s
        merged.ranks.extend(s.ranks)
        merged.world_size = max(merged.world_size, s.world_size)
        closed = closed and s.closed
    merged.failed = dict(sorted(failed.items()))
    merged.ranks.sort()
    merged.closed = closed and found
    merged.tokens_per_s = merged.tokens / merged.capture_s if merged.capture_s > 0 else 0.0
    _tree_totals(read_index(root), merged)
    return merged
