"""Streams: published records handed out one claim after another, as records or as batches.

:class:`_Stream` is the iterator (errors in place, an idle timeout); the :class:`_Streams` layer makes the
consumer's streams on top of its claims, reads and batches.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import CaptureRecord
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.batch import RecordBatch
from vllm_hs_compat.export.consumer.batches import _Batches, _same_schema
from vllm_hs_compat.export.consumer.claims import Claim
from vllm_hs_compat.export.consumer.landing import LEND_MIN_BYTES

log = logging.getLogger(__package__)  # one logger for the whole consumer: vllm_hs_compat.export.consumer
_T = TypeVar("_T")


def _records_of(items: Sequence[RecordBatch | HsCompatError]) -> list[CaptureRecord | HsCompatError]:
    """Batches split into their records (:meth:`RecordBatch.records`: each record's tensor a view of its batch's
    owned tensor); errors kept."""
    out: list[CaptureRecord | HsCompatError] = []
    for b in items:
        if isinstance(b, RecordBatch):
            out.extend(b.records())
        else:
            out.append(b)
    return out


class _Streams(_Batches):
    """The consumer's streams of records and of batches."""

    def iter_records(
        self,
        batch: int = 64,
        wait_s: float = 1.0,
        idle_timeout_s: float | None = None,
        copy: bool = True,
        on_error: str = "raise",
    ) -> Iterator[CaptureRecord]:
        """Stream published records oldest first (trainer only).  Stops after ``idle_timeout_s`` without a record
        (``None``: never).  ``on_error="raise"`` raises each failed record's error (the stream survives; call
        ``next`` again), ``"skip"`` logs and counts it.

        With ``copy=True`` a claim of small records (under ``LEND_MIN_BYTES``) of one schema is read as one batch
        (:meth:`next_batches`, less work per record) and split: each record's tensor is then a view of its
        batch's owned tensor (kept alive while any record of the batch is), and a failed record's error comes
        after the records of its claim instead of in place."""

        def fetch(wait: float) -> list[CaptureRecord | HsCompatError]:
            raws, sent = self._claim_next_reply(batch, wait, self._landing_bytes)
            if copy and raws and self._transport is not None:
                try:
                    descs = P.decode_descriptors(raws)
                except (E.ProtocolError, E.RecordFormatError):
                    descs = []  # one of them is bad: the path below names it
                m0 = descs[0].meta if descs else None
                if (  # small records of one schema (their order kept): read as one batch, then split
                    m0 is not None
                    and max(d.nbytes for d in descs) < LEND_MIN_BYTES
                    and all(_same_schema(d.meta, m0) for d in descs)
                ):
                    return _records_of(self._batches(raws, sent, True, None, [], decoded=descs))
            items = self._parse(raws, sent)
            claims = [it for it in items if isinstance(it, Claim)]
            results = iter(self.read(claims, copy) if claims else [])
            return [next(results) if isinstance(it, Claim) else it for it in items]  # bad descriptors in place

        return _Stream(fetch, wait_s, idle_timeout_s, on_error)

    def iter_batches(
        self,
        max_records: int = 256,
        wait_s: float = 1.0,
        idle_timeout_s: float | None = None,
        copy: bool = True,
        on_error: str = "raise",
    ) -> Iterator[RecordBatch]:
        """Stream published records as :class:`RecordBatch` objects, oldest first (trainer only; see
        :meth:`next_batches`).  Stops after ``idle_timeout_s`` without a record (``None``: never).  A record that
        failed is not in any batch: ``on_error="raise"`` raises its error after the batches of its claim (the
        stream survives; call ``next`` again), ``"skip"`` logs it (it is counted either way)."""
        return _Stream(lambda wait: self.next_batches(max_records, wait, copy), wait_s, idle_timeout_s, on_error)


class _Stream(Iterator[_T]):
    """Items (records or batches) from successive claims, errors handed out in place (``on_error``), stopping
    after ``idle_timeout_s`` without an item."""

    def __init__(
        self,
        fetch: Callable[[float], Sequence[_T | HsCompatError]],
        wait_s: float,
        idle_timeout_s: float | None,
        on_error: str,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise E.ExportConfigError(f"on_error must be 'raise' or 'skip', found {on_error!r}")
        self._fetch = fetch
        self._wait_s = wait_s
        self._idle = idle_timeout_s
        self._on_error = on_error
        self._buf: collections.deque[_T | HsCompatError] = collections.deque()
        self._last = time.monotonic()

    def __iter__(self) -> _Stream[_T]:
        return self

    def __next__(self) -> _T:
        while True:
            while self._buf:
                item = self._buf.popleft()
                if not isinstance(item, HsCompatError):
                    self._last = time.monotonic()  # idle means: no item for idle_timeout_s
                    return item
                if self._on_error == "raise":
                    raise item
                log.warning("skipping a record: %s", item)
            if self._idle is not None and time.monotonic() - self._last > self._idle:
                raise StopIteration
            wait = self._wait_s if self._idle is None else min(self._wait_s, max(0.0, self._idle))
            items = self._fetch(wait)
            if items:
                self._buf.extend(items)
                self._last = time.monotonic()
