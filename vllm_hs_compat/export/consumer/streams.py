"""Streams: published records handed out one claim after another, as records or as batches.

:class:`Streams` makes one round (one ``claim_next`` and its reads: :meth:`Streams.next_records`) and the consumer's
streams of them; :class:`_Stream` is the iterator (errors in place, an idle timeout).  :class:`Sweep` takes rounds
from several consumers in turn (one per producer): the trainer's dataset streams through it.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import CaptureRecord
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.batch import RecordBatch
from vllm_hs_compat.export.consumer.batches import Batches, _same_schema
from vllm_hs_compat.export.consumer.claims import Claim, Claims
from vllm_hs_compat.export.consumer.landing import LEND_MIN_BYTES, Landing
from vllm_hs_compat.export.consumer.reads import Reads

log = logging.getLogger(__package__)  # one logger for the whole consumer: vllm_hs_compat.export.consumer
_T = TypeVar("_T")
#: :class:`Sweep`: how long a consumer whose producer answered a claim with nothing is skipped.
EMPTY_BACKOFF_S = 0.05


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


class Streams:
    """The consumer's rounds and streams of records and of batches."""

    def __init__(self, claims: Claims, reads: Reads, batches: Batches, landing: Landing) -> None:
        self._claims = claims
        self._reads = reads
        self._batches = batches
        self._landing = landing

    def next_records(
        self, max_records: int, wait_s: float, copy: bool = True, pack_small: bool = False
    ) -> list[CaptureRecord | HsCompatError]:
        """One round: claim up to ``max_records`` published records (waiting up to ``wait_s`` for one), read,
        verify and release them; one entry per claimed record, in claim order, a record's named error in its place
        (a refused descriptor's :class:`DescriptorError` too).

        ``pack_small`` (with ``copy``): a claim of small records (under ``LEND_MIN_BYTES``) of one schema is read as
        one batch (less work per record) and split: each record's tensor is then a view of its batch's owned tensor,
        and a failed record's error comes after the records of its claim instead of in place."""
        raws, sent = self._claims.next_reply(max_records, wait_s)
        if pack_small and copy and raws and self._landing.transport is not None:
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
                return _records_of(self._batches.batches(raws, sent, True, None, [], decoded=descs))
        items = self._claims.parse(raws, sent)
        claims = [it for it in items if isinstance(it, Claim)]
        results = iter(self._reads.read(claims, copy) if claims else [])
        return [next(results) if isinstance(it, Claim) else it for it in items]  # bad descriptors in place

    def iter_records(
        self,
        batch: int = 64,
        wait_s: float = 1.0,
        idle_timeout_s: float | None = None,
        copy: bool = True,
        on_error: str = "raise",
    ) -> Iterator[CaptureRecord]:
        """Rounds of :meth:`next_records` of ``batch`` records, small ones packed, as one stream (the facade's
        ``iter_records`` says what a caller sees)."""
        return _Stream(
            lambda wait: self.next_records(batch, wait, copy, pack_small=True), wait_s, idle_timeout_s, on_error
        )

    def iter_batches(
        self,
        max_records: int = 256,
        wait_s: float = 1.0,
        idle_timeout_s: float | None = None,
        copy: bool = True,
        on_error: str = "raise",
    ) -> Iterator[RecordBatch]:
        """Rounds of :meth:`Batches.next_batches` as one stream (the facade's ``iter_batches`` says what a caller
        sees)."""
        batches = self._batches
        return _Stream(lambda wait: batches.next_batches(max_records, wait, copy), wait_s, idle_timeout_s, on_error)


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


class RecordSource(Protocol):
    """What :class:`Sweep` takes rounds from (an :class:`~vllm_hs_compat.export.ExportConsumer`)."""

    def next_records(
        self, max_records: int = 64, wait_s: float = 1.0, copy: bool = True
    ) -> list[CaptureRecord | HsCompatError]: ...


class Sweep:
    """Rounds of records from several consumers (one per producer: the engines of ``--data-parallel-size N``,
    several servers), or from one.

    One consumer: each round long-polls it.  Several: a round claims without waiting from the consumers in turn,
    starting after the one that answered last, and takes the first non-empty answer; a consumer whose producer was
    empty is skipped for ``EMPTY_BACKOFF_S`` (no round trip to an idle server per claim; its new records wait at most
    that long while the others have records).  When none had a record, it long-polls one consumer (the next in
    turn) for ``wait_s / len(consumers)``, so a record published on any producer is seen within ``wait_s`` of an
    idle stream.  ``first``: the consumer the first round starts at (streams of several workers or ranks spread
    their first claims over the producers).  The producers' claims hand each record to one claimant, whichever
    stream of whichever rank asks."""

    def __init__(self, consumers: Sequence[RecordSource], first: int = 0) -> None:
        if not consumers:
            raise E.ExportConfigError("a sweep needs at least one consumer")
        self.consumers = list(consumers)
        self._turn = first % len(self.consumers)
        self._empty_until = [0.0] * len(self.consumers)

    def next_records(
        self, max_records: int, wait_s: float, last_look: bool = False
    ) -> list[CaptureRecord | HsCompatError]:
        """One round (see the class docstring): the records of one consumer's claim (:meth:`next_records` of that
        consumer, errors in place), or nothing.  ``last_look``: every consumer is asked, skipped ones too."""
        cs = self.consumers
        n = len(cs)
        if n == 1:
            return cs[0].next_records(max_records, wait_s)
        if last_look:
            self._empty_until = [0.0] * n
        now = time.monotonic()
        turn = self._turn
        for j in range(n):
            k = (turn + j) % n
            if self._empty_until[k] > now:
                continue
            got = cs[k].next_records(max_records, 0.0)
            if got:
                self._turn = (k + 1) % n
                return got
            self._empty_until[k] = now + EMPTY_BACKOFF_S
        got = cs[turn].next_records(max_records, wait_s / n)  # every producer is empty: wait on one
        if got:
            self._empty_until[turn] = 0.0
        self._turn = (turn + 1) % n
        return got
