"""The capture's engine and its adoption side by side: :class:`Pipeline`.

``vllm-hs-compat capture`` runs one batch in the engine while ONE adopter thread adopts the batch before it (reads
and verifies each staged record, moves it into its shard, indexes it durably: the same ``CaptureStore.adopt`` as a
serial run, record after record in the batch's order).  At most one batch is in adoption while one runs in the
engine, so the memory and staging disk held are those of two batches.  The pipeline keeps the time each side spent
and how long the engine waited on the adopter (the summary's ``engine_s``, ``adopt_s``, ``adopt_wait_s`` and
``overlap_s``: docs/capture.md).

Pure Python (``concurrent.futures``).  An exception in the adopter is raised again, itself, in the thread that waits
for it (:meth:`Pipeline.wait`), never swallowed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Generic, TypeVar

from vllm_hs_compat.errors import CaptureStoreError

_T = TypeVar("_T")
_A = TypeVar("_A")


@dataclass
class Timings:
    """Where a run's time went, in seconds (the run summary's fields of the same names)."""

    engine_s: float = 0.0
    """In the engine: ``generate`` and the flush that brings every record to its staging files."""
    adopt_s: float = 0.0
    """Adopting records: waiting for their files, reading and verifying them, moving them into shards, the index
    and its syncs, failed rows."""
    adopt_wait_s: float = 0.0
    """Of ``adopt_s``, the part the engine waited through: a batch adopted before the next one could start, or the
    rest of an adoption the engine's next batch finished before."""
    overlap_s: float = 0.0
    """Of ``adopt_s``, the part that ran while the engine ran its next batch."""

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in asdict(self).items()}


def _overlap(span: tuple[float, float], other: tuple[float, float]) -> float:
    return max(0.0, min(span[1], other[1]) - max(span[0], other[0]))


class Pipeline(Generic[_A]):
    """Runs engine work in the calling thread and adoption work in one adopter thread, one batch of each at most.

    ``overlap=False``: every adoption runs in the calling thread before anything else (a serial run, for
    comparison).  :meth:`engine` times the engine's work; :meth:`adopt_later` hands a batch's adoption to the adopter
    (refused while it still holds one); :meth:`wait` waits for it and returns its result or raises its exception;
    :meth:`adopt_now` adopts in the calling thread; :meth:`close` ends the adopter (``abandon``: it stops after the
    record it is adopting, see :attr:`stopping`)."""

    def __init__(self, *, overlap: bool = True) -> None:
        self.overlap = overlap
        self.timings = Timings()
        #: Set by :meth:`close` with ``abandon``: an adoption checks it between records and stops.
        self.stopping = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture-adopter") if overlap else None
        self._held: Future[_A] | None = None
        self._held_span: list[float] = []  # the held adoption's start and end, written by the adopter
        self._engine_spans: list[tuple[float, float]] = []  # engine work since the held adoption started

    @property
    def busy(self) -> bool:
        """True while the adopter holds a batch (adopting it, or done and not yet waited for)."""
        return self._held is not None

    def engine(self, work: Callable[[], _T]) -> _T:
        """Run ``work`` (the engine's part of a batch) here, timed as engine time."""
        t0 = time.monotonic()
        try:
            return work()
        finally:
            t1 = time.monotonic()
            self.timings.engine_s += t1 - t0
            if self._held is not None:
                self._engine_spans.append((t0, t1))

    def adopt_now(self, work: Callable[[], _A]) -> _A:
        """Adopt a batch here, the engine idle meanwhile (the adopter must hold none)."""
        self._refuse_if_busy("adopt_now")
        t0 = time.monotonic()
        try:
            return work()
        finally:
            spent = time.monotonic() - t0
            self.timings.adopt_s += spent
            self.timings.adopt_wait_s += spent

    def adopt_later(self, work: Callable[[], _A]) -> None:
        """Hand a batch's adoption to the adopter; the caller goes on (to the engine's next batch)."""
        self._refuse_if_busy("adopt_later")
        if self._pool is None:
            raise CaptureStoreError("Pipeline(overlap=False) has no adopter thread: use adopt_now")
        span: list[float] = []

        def timed() -> _A:
            span.append(time.monotonic())
            try:
                return work()
            finally:
                span.append(time.monotonic())

        self._held_span, self._engine_spans = span, []
        self._held = self._pool.submit(timed)

    def wait(self) -> _A:
        """Wait for the adopter's batch; its result, or its exception raised here (the adopter is free again)."""
        held = self._held
        if held is None:
            raise CaptureStoreError("Pipeline.wait: the adopter holds no batch (hand one over with adopt_later)")
        t0 = time.monotonic()
        try:
            return held.result()
        finally:
            t1 = time.monotonic()
            self._held = None
            self.timings.adopt_wait_s += t1 - t0
            if len(self._held_span) == 2:
                span = (self._held_span[0], self._held_span[1])
                self.timings.adopt_s += span[1] - span[0]
                self.timings.overlap_s += sum(_overlap(span, e) for e in self._engine_spans)
            self._engine_spans = []

    def close(self, *, abandon: bool = False) -> BaseException | None:
        """End the adopter, waiting for the batch it holds; ``abandon``: it stops after the record it is at (the
        rest are not adopted, the run's ``not_run``).  Returns the exception the held batch's adoption raised, if
        any (the caller is already on its way out with one of its own).  Idempotent."""
        if abandon:
            self.stopping.set()
        error: BaseException | None = None
        if self._held is not None:
            try:
                self.wait()
            except BaseException as exc:  # noqa: BLE001  # handed back: the caller names it beside its own
                error = exc
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        return error

    def _refuse_if_busy(self, what: str) -> None:
        if self._held is not None:
            raise CaptureStoreError(
                f"Pipeline.{what}: the adopter still holds a batch; wait() for it first (one batch in adoption at most)"
            )
