"""The facade: :class:`ExportConsumer`, the user's one class, holding the consumer's parts.

It makes the parts (see the package docstring for what each owns), wires each to the ones it uses, and hands every
public call to the part that does it; it holds no state of its own but them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import CaptureRecord
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.batch import RecordBatch
from vllm_hs_compat.export.consumer.batches import Batches
from vllm_hs_compat.export.consumer.channel import ControlChannel
from vllm_hs_compat.export.consumer.claims import INLINE_BYTES, Claim, Claims
from vllm_hs_compat.export.consumer.landing import Landing
from vllm_hs_compat.export.consumer.reads import Reads
from vllm_hs_compat.export.consumer.releases import Releases
from vllm_hs_compat.export.consumer.session import Session
from vllm_hs_compat.export.consumer.streams import Streams
from vllm_hs_compat.export.credentials import read_token, server_key
from vllm_hs_compat.export.nixl_backend import UcxSettings
from vllm_hs_compat.export.shm import DEFAULT_SHM_DIR

log = logging.getLogger(__package__)  # one logger for the whole consumer: vllm_hs_compat.export.consumer

#: ``stats()`` keys, in this order: every part's counters (summed where two parts count the same thing)
COUNTERS = (
    "handshakes",
    "producer_changes",
    "records",
    "batches",
    "bytes",
    "checksum_failures",
    "read_failures",
    "abandoned",
    "bad_descriptors",
    "inline_records",
    "lease_expired",
    "quarantined_bytes",
    "deferred_releases",
    "late_verdicts",
    "unanswered_releases",
    "direct_switches",
    "direct_failures",
    "direct_fallbacks",
    "plain_switches",
)


class ExportConsumer:
    """Fetches and streams records from one producer (see the package docstring)."""

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        *,
        ticket: P.ExportTicket | None = None,
        backend: str = "auto",
        landing_bytes: int = 256 << 20,
        timeout_s: float = 10.0,
        shm_dir: str = DEFAULT_SHM_DIR,
        ucx: UcxSettings | None = None,
        verify_checksum: bool = True,
        max_reply_bytes: int = P.DEFAULT_REPLY_BYTES,
        lend_fraction: float = 0.75,
        overlap_verification: bool = False,
        defer_releases: bool = True,
        spill_bytes: int | None = None,
        direct: bool = True,
        inline_bytes: int = INLINE_BYTES,
        plain: bool = True,
    ) -> None:
        """``verify_checksum``, ``overlap_verification``: the reads' (:class:`.reads.Reads`); ``defer_releases``:
        the releases' (:class:`.releases.Releases`); ``inline_bytes``: the claims' (:class:`.claims.Claims`);
        ``landing_bytes``, ``lend_fraction``, ``spill_bytes``, ``ucx``, ``shm_dir``: the landing's
        (:class:`.landing.Landing`); ``direct``, ``plain``, ``max_reply_bytes``: the connection's; ``backend``,
        ``timeout_s``: the session's.  Each part checks its own."""
        if token is None and (ticket is None or ticket.cap is None or ticket.server_key is None):
            raise E.ExportConfigError(
                "an export consumer needs the trainer token (token=, $VLLM_HS_COMPAT_EXPORT_TOKEN or the token "
                "file) or a ticket carrying a capability (kv_transfer_params['hs_export'] from a vllm-hs-compat "
                "producer of this release)"
            )
        self.endpoint = endpoint
        self._landing = Landing(landing_bytes, lend_fraction, spill_bytes, ucx, shm_dir)
        self._channel = ControlChannel(endpoint, token, max_reply_bytes, plain=plain)
        self._session = Session(
            self._channel,
            self._landing,
            ticket=ticket if token is None else None,
            want=backend,
            direct=direct,
            timeout_s=timeout_s,
        )
        self._releases = Releases(self._session, defer_releases)
        self._claims = Claims(self._session, self._releases, self._landing, inline_bytes)
        self._reads = Reads(
            self._session,
            self._claims,
            self._releases,
            self._landing,
            verify_checksum=verify_checksum,
            overlap_verification=overlap_verification,
        )
        self._batches = Batches(self._session, self._claims, self._releases, self._reads, self._landing)
        self._streams = Streams(self._claims, self._reads, self._batches, self._landing)
        try:
            self._channel.open(timeout_s, ticket.server_key if ticket is not None else None)
            self._session.connect()
        except BaseException:
            self.close()  # do not leave a NIXL agent, a socket or a landing buffer behind
            raise

    @classmethod
    def from_params(cls, params: Mapping[str, Any], token: str | None = None, **kw: Any) -> ExportConsumer:
        """A consumer of the producer a ticket names.  The credential: ``token`` if given, else the trainer token
        (:func:`~vllm_hs_compat.export.control.read_token`) if one is found and belongs to this producer, else
        the ticket's own capability (which opens that one record only)."""
        p = P.ExportTicket.parse(params)
        if token is None:
            try:
                found = read_token()
            except E.ExportConfigError:
                found = None
            if found is not None and p.cap is not None and p.server_key is not None:
                if server_key(found) != p.server_key:
                    log.info("the trainer token found here is not this producer's; using the ticket's capability")
                    found = None
            token = found
        return cls(p.endpoint, token, ticket=p, **kw)

    # --- who, and how ------------------------------------------------------------------------------------------
    @property
    def principal(self) -> str:
        """``"trainer"`` (token) or ``"record"`` (a ticket's capability)."""
        return self._session.principal

    @property
    def direct(self) -> bool:
        """Whether control calls go past the gate (the producer's plain channel or direct endpoint)."""
        return self._channel.direct

    @property
    def producer(self) -> str | None:
        """The attached producer's instance id."""
        return self._session.producer

    @property
    def hello(self) -> dict[str, Any]:
        """The producer's latest hello answer (plain data)."""
        return self._session.hello

    @property
    def timeout_s(self) -> float:
        """The default deadline of a call (and of a read)."""
        return self._session.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._session.timeout_s = value

    @property
    def verify_checksum(self) -> bool:
        """Whether every record's hidden states are checksummed (the token ids always are)."""
        return self._reads.verify_checksum

    @verify_checksum.setter
    def verify_checksum(self, value: bool) -> None:
        self._reads.verify_checksum = value

    @property
    def overlap_verification(self) -> bool:
        """Whether a large read is checksummed piece by piece while a reader thread transfers the next piece."""
        return self._reads.overlap_verification

    @overlap_verification.setter
    def overlap_verification(self, value: bool) -> None:
        self._reads.overlap_verification = value

    @property
    def defer_releases(self) -> bool:
        """Whether a release far from its leases' deadline is posted without waiting for its answer."""
        return self._releases.defer

    @defer_releases.setter
    def defer_releases(self, value: bool) -> None:
        self._releases.defer = value

    @property
    def inline_bytes(self) -> int:
        """A record claimed by id up to this many bytes comes in the claim's answer."""
        return self._claims.inline_bytes

    @inline_bytes.setter
    def inline_bytes(self, value: int) -> None:
        self._claims.inline_bytes = value

    @property
    def lend_bytes(self) -> int:
        """How much of the landing buffer owned records may keep (``lend_fraction`` of it)."""
        return self._landing.lend_limit

    @property
    def spill_bytes(self) -> int:
        """How much memory spill arenas may take."""
        return self._landing.spill_limit

    # --- records -----------------------------------------------------------------------------------------------
    def claim(self, record_id: str, timeout_s: float | None = None, wait_s: float = 0.0) -> Claim:
        """Lease one record by id (see :meth:`.claims.Claims.claim`)."""
        return self._claims.claim(record_id, timeout_s, wait_s)

    def claim_next(self, max_records: int = 1, wait_s: float = 1.0, max_bytes: int | None = None) -> list[Claim]:
        """Lease up to ``max_records`` published records, oldest first (see :meth:`.claims.Claims.claim_next`)."""
        return self._claims.claim_next(max_records, wait_s, max_bytes)

    def abandon(self, claims: Sequence[Claim]) -> None:
        """Give leases back without reading them (see :meth:`.claims.Claims.abandon`)."""
        self._claims.abandon(claims)

    def read(
        self, claims: Sequence[Claim], copy: bool = True, timeout_s: float | None = None
    ) -> list[CaptureRecord | HsCompatError]:
        """Read claimed records, verify each, release each lease with its outcome; one entry per claim: the record,
        or the named error that failed it (see :meth:`.reads.Reads.read`)."""
        return self._reads.read(claims, copy, timeout_s)

    def fetch(
        self, record_id: str, copy: bool = True, timeout_s: float | None = None, wait_s: float = 0.0
    ) -> CaptureRecord:
        """Claim, read, verify and release one record; raises the named error that failed it.  ``wait_s``: how
        long to wait for a record that is not published yet (see :meth:`claim`).  ``copy=True``: the record owns
        its memory (lent landing space or a copy, see the package docstring); ``copy=False``: a view valid until
        :meth:`release`."""
        (res,) = self.read([self.claim(record_id, timeout_s, wait_s)], copy, timeout_s)
        if isinstance(res, HsCompatError):
            raise res
        return res

    def release(self, record: CaptureRecord | RecordBatch) -> None:
        """Free the landing space of a record or batch read with ``copy=False`` (its tensors are invalid
        afterwards).  One read with ``copy=True`` owns its memory: nothing to do (its landing space, if it was
        lent one, comes back when its tensor is garbage collected)."""
        self._landing.release(record)

    def next_records(
        self, max_records: int = 64, wait_s: float = 1.0, copy: bool = True
    ) -> list[CaptureRecord | HsCompatError]:
        """Claim up to ``max_records`` published records (oldest first, trainer only; waiting up to ``wait_s`` for
        one), read, verify and release them: one entry per claimed record, in claim order, each the record or the
        named error that failed it (a refused descriptor's too).  Empty when nothing was published within
        ``wait_s``.  The round :meth:`iter_records` streams, each record read as itself; the records' sibling of
        :meth:`next_batches`."""
        return self._streams.next_records(max_records, wait_s, copy)

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
        return self._streams.iter_records(batch, wait_s, idle_timeout_s, copy, on_error)

    # --- batches -----------------------------------------------------------------------------------------------
    def next_batches(
        self, max_records: int = 256, wait_s: float = 1.0, copy: bool = True, timeout_s: float | None = None
    ) -> list[RecordBatch | HsCompatError]:
        """Claim up to ``max_records`` published records (oldest first, trainer only), read, verify and release
        them together; the records that passed as :class:`RecordBatch` objects (one per schema among them), each
        failed record as its own named error after them (see :meth:`.batches.Batches.next_batches`)."""
        return self._batches.next_batches(max_records, wait_s, copy, timeout_s)

    def fetch_batch(
        self, record_ids: Sequence[str], copy: bool = True, timeout_s: float | None = None, wait_s: float = 0.0
    ) -> list[RecordBatch | HsCompatError]:
        """Claim, read, verify and release the records ``record_ids`` together (trainer only): batches in the order
        asked, then one named error per id that failed (see :meth:`.batches.Batches.fetch_batch`)."""
        return self._batches.fetch_batch(record_ids, copy, timeout_s, wait_s)

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
        return self._streams.iter_batches(max_records, wait_s, idle_timeout_s, copy, on_error)

    # --- the ledger, counters, lifecycle -----------------------------------------------------------------------
    def settle_pending(self, timeout_s: float | None = None) -> int:
        """Wait until the producer has answered every posted release (or ``timeout_s``, default the consumer's
        timeout); returns how many are still unanswered.  Not needed for correctness (a release is posted only far
        from its leases' deadline): for a caller that wants the producer's ledger settled now, e.g. before reading
        its stats."""
        return self._releases.pending(timeout_s)

    @property
    def counters(self) -> dict[str, int]:
        """This consumer's counters (a new dict: every part's, see :data:`COUNTERS`)."""
        parts = (
            self._session.counters,
            self._channel.counters,
            self._claims.counters,
            self._reads.counters,
            self._batches.counters,
            self._releases.counters,
        )
        return {k: sum(part.get(k, 0) for part in parts) for k in COUNTERS}

    def stats(self) -> dict[str, int]:
        """This consumer's counters and landing-buffer use."""
        self._releases.reconcile()
        return {**self.counters, **self._landing.stats()}

    def remote_stats(self) -> dict[str, Any]:
        """The producer's counters (trainer only)."""
        rep = self._session.call(P.StatsReq())
        if not isinstance(rep, P.StatsReply):
            raise E.ProtocolError(f"stats answered with {type(rep).__name__}")
        return dict(rep.stats)

    def close(self) -> None:
        """Close the connection and the transport (held records become invalid).  Waits up to
        ``CLOSE_COLLECT_S`` for the answers to posted releases (``unanswered_releases`` counts the rest: their
        leases expire at the producer)."""
        self._releases.close()
        self._channel.close()
        self._reads.close()
        self._landing.close()

    def __enter__(self) -> ExportConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
