"""The capture's engine and its adoption side by side: :class:`Pipeline`.

``vllm-hs-compat capture`` runs one batch in the engine while ONE adopter thread adopts the batch before it (reads
and verifies each staged record, moves it into its shard, indexes it durably: the same ``CaptureStore.adopt`` as a
serial run, record after record in the batch's order), then follows the engine into the batch it runs: a batch's
adoption is handed over before the engine runs it and takes each record as the engine finishes its request
(:class:`~vllm_hs_compat.capture.batches.OutcomeStream`), so the adopter is not idle while the engine runs and the
last batch's adoption ends soon after the engine's last step.  Records are adopted one at a time, in order: the
memory and staging disk held are those of two batches, as before.  The pipeline keeps the time each side spent and
how long the engine waited on the adopter (the summary's ``engine_s``, ``adopt_s``, ``adopt_wait_s`` and
``overlap_s``: docs/capture.md); an adoption's time waiting for the engine to finish its records is not adoption.

Pure Python (``concurrent.futures``).  An exception in the adopter is raised again, itself, in the thread that waits
for it (:meth:`Pipeline.wait`), never swallowed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
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
    and its syncs, failed rows (not the time an adoption waited for the engine to finish a record's request)."""
    adopt_wait_s: float = 0.0
    """Of ``adopt_s``, the part the engine waited through: a batch adopted before the next one could start, or the
    rest of an adoption the engine's next batch finished before."""
    overlap_s: float = 0.0
    """Of ``adopt_s``, the part that ran while the engine ran its next batch."""

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in asdict(self).items()}


def _overlap(span: tuple[float, float], other: tuple[float, float]) -> float:
    return max(0.0, min(span[1], other[1]) - max(span[0], other[0]))


@dataclass
class _Held(Generic[_A]):
    """One batch's adoption handed to the adopter: its future, its span (start and end, written by the adopter) and
    the seconds it waited for the engine (``idle``, read once it is done)."""

    future: Future[_A]
    span: list[float]
    idle: Callable[[], float] | None
    since: float


#: Batches the adopter holds at most: the one it adopts and the one it follows the engine into.
DEPTH = 2


class Pipeline(Generic[_A]):
    """Runs engine work in the calling thread and adoption work in one adopter thread.

    ``overlap=False``: every adoption runs in the calling thread before anything else (a serial run, for
    comparison).  :meth:`engine` times the engine's work; :meth:`adopt_later` hands a batch's adoption to the adopter,
    which adopts the batches it holds one after the other in the order handed over (:data:`DEPTH` at most: refused
    past that); :meth:`wait` waits for the oldest and returns its result or raises its exception; :meth:`adopt_now`
    adopts in the calling thread; :meth:`close` ends the adopter (``abandon``: it stops after the record it is
    adopting, see :attr:`stopping`)."""

    def __init__(self, *, overlap: bool = True) -> None:
        self.overlap = overlap
        self.timings = Timings()
        #: Set by :meth:`close` with ``abandon``: an adoption checks it between records and stops.
        self.stopping = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture-adopter") if overlap else None
        self._held: deque[_Held[_A]] = deque()
        self._engine_spans: list[tuple[float, float]] = []  # engine work since the oldest held adoption was handed over
        self._engine_end = 0.0  # when the engine's latest work returned
        self._adopt_end = 0.0  # when the latest adoption ended
        #: Seconds from the engine's last work returning to the end of the last adoption (set by :meth:`close`):
        #: the run's tail, what adoption adds after the engine is done.
        self.tail_s = 0.0

    @property
    def busy(self) -> bool:
        """True while the adopter holds a batch (adopting it, or done and not yet waited for)."""
        return bool(self._held)

    @property
    def held(self) -> int:
        """Batches the adopter holds (adopting, waiting to be adopted, or done and not yet waited for)."""
        return len(self._held)

    def engine(self, work: Callable[[], _T]) -> _T:
        """Run ``work`` (the engine's part of a batch) here, timed as engine time."""
        t0 = time.monotonic()
        try:
            return work()
        finally:
            t1 = time.monotonic()
            self.timings.engine_s += t1 - t0
            self._engine_end = t1
            if self._held:
                self._engine_spans.append((t0, t1))

    def adopt_now(self, work: Callable[[], _A]) -> _A:
        """Adopt a batch here, the engine idle meanwhile (the adopter must hold none)."""
        if self._held:
            raise CaptureStoreError(
                "Pipeline.adopt_now: the adopter still holds a batch; wait() for it first (adoption stays in order)"
            )
        t0 = time.monotonic()
        try:
            return work()
        finally:
            self._adopt_end = time.monotonic()
            spent = self._adopt_end - t0
            self.timings.adopt_s += spent
            self.timings.adopt_wait_s += spent

    def adopt_later(self, work: Callable[[], _A], *, idle: Callable[[], float] | None = None) -> None:
        """Hand a batch's adoption to the adopter, after those it holds; the caller goes on (to the engine).
        ``idle``: the seconds the adoption spent waiting for the engine (read when it is done; not adoption)."""
        if self._pool is None:
            raise CaptureStoreError("Pipeline(overlap=False) has no adopter thread: use adopt_now")
        if len(self._held) >= DEPTH:
            raise CaptureStoreError(
                f"Pipeline.adopt_later: the adopter still holds {len(self._held)} batches; wait() for the oldest "
                f"first ({DEPTH} at most: the one it adopts and the one it follows the engine into)"
            )
        span: list[float] = []

        def timed() -> _A:
            span.append(time.monotonic())
            try:
                return work()
            finally:
                span.append(time.monotonic())

        if not self._held:
            self._engine_spans = []
        self._held.append(_Held(self._pool.submit(timed), span, idle, time.monotonic()))

    def wait(self) -> _A:
        """Wait for the oldest batch the adopter holds; its result, or its exception raised here."""
        if not self._held:
            raise CaptureStoreError("Pipeline.wait: the adopter holds no batch (hand one over with adopt_later)")
        held = self._held.popleft()
        t0 = time.monotonic()
        try:
            return held.future.result()
        finally:
            t1 = time.monotonic()
            self.timings.adopt_wait_s += t1 - t0
            if len(held.span) == 2:
                span = (held.span[0], held.span[1])
                self._adopt_end = max(self._adopt_end, span[1])
                idle = min(span[1] - span[0], held.idle()) if held.idle is not None else 0.0
                self.timings.adopt_s += span[1] - span[0] - idle
                overlap = sum(_overlap(span, e) for e in self._engine_spans)
                self.timings.overlap_s += max(0.0, overlap - idle)  # the engine ran through every wait for it
            # keep the engine's spans the adoptions still held may overlap
            since = self._held[0].since if self._held else t1
            self._engine_spans = [e for e in self._engine_spans if e[1] > since]

    def close(self, *, abandon: bool = False) -> BaseException | None:
        """End the adopter, waiting for the batches it holds; ``abandon``: it stops after the record it is at (the
        rest are not adopted, the run's ``not_run``).  Returns the first exception a held batch's adoption raised,
        if any (the caller is already on its way out with one of its own).  Idempotent."""
        if abandon:
            self.stopping.set()
        error: BaseException | None = None
        while self._held:
            try:
                self.wait()
            except BaseException as exc:  # noqa: BLE001  # handed back: the caller names it beside its own
                error = error if error is not None else exc
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._engine_end and self._adopt_end:
            self.tail_s = max(0.0, self._adopt_end - self._engine_end)
        return error
