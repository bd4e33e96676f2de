"""The facade: :class:`ExportConsumer`, the user's one class, made of the consumer's layers.

Its constructor, lifecycle (``close``, ``stats``) and the one-record calls (``fetch``, ``release``) are here; the
jobs are in the layers it stacks (see the package docstring): streams, batches, reads, claims, releases, channel.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import CaptureRecord
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.batch import RecordBatch
from vllm_hs_compat.export.consumer.channel import ControlChannel
from vllm_hs_compat.export.consumer.claims import INLINE_BYTES
from vllm_hs_compat.export.consumer.landing import PAGE
from vllm_hs_compat.export.consumer.streams import _Streams
from vllm_hs_compat.export.credentials import read_token, server_key
from vllm_hs_compat.export.nixl_backend import UcxSettings
from vllm_hs_compat.export.shm import DEFAULT_SHM_DIR
from vllm_hs_compat.export.transport import ConsumerTransport

log = logging.getLogger(__package__)  # one logger for the whole consumer: vllm_hs_compat.export.consumer


class ExportConsumer(_Streams):
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
        if backend not in ("auto", "shm", "nixl"):
            raise E.ExportConfigError(f"backend must be 'auto', 'shm' or 'nixl', found {backend!r}")
        if landing_bytes < PAGE or landing_bytes % PAGE:
            raise E.ExportConfigError(f"landing_bytes must be a positive multiple of {PAGE}, found {landing_bytes}")
        if token is None and (ticket is None or ticket.cap is None or ticket.server_key is None):
            raise E.ExportConfigError(
                "an export consumer needs the trainer token (token=, $VLLM_HS_COMPAT_EXPORT_TOKEN or the token "
                "file) or a ticket carrying a capability (kv_transfer_params['hs_export'] from a vllm-hs-compat "
                "producer of this release)"
            )
        self.endpoint = endpoint
        self._ticket = ticket if token is None else None
        self._want = backend
        self._landing_bytes = landing_bytes
        self.timeout_s = timeout_s
        self._shm_dir = shm_dir
        self._ucx = ucx
        #: Checksum verification is on by default.  Turning it off saves one memory pass over every record
        #: and leaves the size checks and the token ids' checksum: do it only where the transport is trusted.
        self.verify_checksum = verify_checksum
        #: Checksum a large read piece by piece while a reader thread transfers the next piece (see
        #: :meth:`_transfer`).  Off by default: it needs a free core, and on the 2-vCPU box it was measured on
        #: (docs/benchmarks.md) it was slower than verifying after the transfer.
        self.overlap_verification = overlap_verification
        #: Release without waiting for the answer while the leases are far from their deadline (see
        #: :meth:`_release`): one control round trip less per read.  ``False``: wait for every verdict.
        self.defer_releases = defer_releases
        self._unsettled: dict[bytes, list[str]] = {}
        if not 0 <= inline_bytes <= P.MAX_READ_BYTES:
            raise E.ExportConfigError(f"inline_bytes must be in [0, {P.MAX_READ_BYTES}], found {inline_bytes!r}")
        #: A record claimed by id whose bytes are at most this many (and within the producer's ``max_read_bytes``)
        #: comes in the claim's answer: one round trip, no transfer after it.  Larger records, streams and batches
        #: are read over the transport.  ``0``: always claim, then read.
        self.inline_bytes = inline_bytes
        self._fetch_op: bool | None = None  # whether the producer knows the ``fetch`` op (None: not asked yet)
        if not 0.0 <= lend_fraction <= 1.0:
            raise E.ExportConfigError(f"lend_fraction must be in [0, 1], found {lend_fraction!r}")
        #: How much of the landing buffer owned records (``copy=True``) may keep: such a record's tensor views
        #: its landing space, which comes back when the tensor is garbage collected.  A record is lent its space
        #: only while the lent total stays within this share and the space left free still holds another
        #: record of its size; otherwise (and always with 0) it is copied into freshly allocated memory.
        self.lend_bytes = int(landing_bytes * lend_fraction)
        if spill_bytes is None:
            spill_bytes = 4 * landing_bytes
        if spill_bytes < 0:
            raise E.ExportConfigError(f"spill_bytes must be >= 0 (0: no spill arenas), found {spill_bytes!r}")
        #: How much memory spill arenas may take: owned records past the lending share are read into arenas
        #: registered with the transport and recycled when the records are dropped (see :class:`_Landing`),
        #: instead of being copied into fresh memory.  ``0``: copy them (the behaviour before spill arenas).
        self.spill_bytes = spill_bytes
        self._transport: ConsumerTransport | None = None
        self._landing = self._new_landing()
        self._held: dict[int, tuple[CaptureRecord | RecordBatch, int, int]] = {}
        self.producer: str | None = None
        self.hello: dict[str, Any] = {}
        self._hello: P.HelloReply | None = None
        self.counters = {
            "handshakes": 0,
            "producer_changes": 0,
            "records": 0,
            "batches": 0,
            "bytes": 0,
            "checksum_failures": 0,
            "read_failures": 0,
            "abandoned": 0,
            "bad_descriptors": 0,
            "inline_records": 0,
            "lease_expired": 0,
            "quarantined_bytes": 0,
            "deferred_releases": 0,
            "late_verdicts": 0,
            "unanswered_releases": 0,
            "direct_switches": 0,
            "direct_failures": 0,
            "direct_fallbacks": 0,
            "plain_switches": 0,
        }
        #: a trainer moves its control calls to the producer's direct endpoint (past the gate) when offered
        self._direct_wanted = direct
        self._channel = ControlChannel(endpoint, token, max_reply_bytes, self.counters, plain=plain)
        self._reader: Any = None  # concurrent.futures.ThreadPoolExecutor, made on the first pipelined read
        self._raw, self._raw_key = memoryview(b""), (0, 0)
        try:
            self._channel.open(timeout_s, ticket.server_key if ticket is not None else None)
            self._connect()
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

    def release(self, record: CaptureRecord | RecordBatch) -> None:
        """Free the landing space of a record or batch read with ``copy=False`` (its tensors are invalid
        afterwards).  One read with ``copy=True`` owns its memory: nothing to do (its landing space, if it was
        lent one, comes back when its tensor is garbage collected)."""
        held = self._held.pop(id(record), None)
        if held is not None:
            self._landing.free(held[1], held[2])

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

    def stats(self) -> dict[str, int]:
        """This consumer's counters and landing-buffer use."""
        self._reconcile()
        return {
            **self.counters,
            "landing_pages_in_use": self._landing.in_use(),
            "held_records": len(self._held),
            "lent_bytes": self._landing.lent + self._landing.spill_lent,
            "spill_lent_bytes": self._landing.spill_lent,
            "spill_arena_bytes": self._landing.spill_bytes,
        }

    def remote_stats(self) -> dict[str, Any]:
        """The producer's counters (trainer only)."""
        rep = self._call(P.StatsReq())
        if not isinstance(rep, P.StatsReply):
            raise E.ProtocolError(f"stats answered with {type(rep).__name__}")
        return dict(rep.stats)

    def close(self) -> None:
        """Close the connection and the transport (held records become invalid).  Waits up to
        ``CLOSE_COLLECT_S`` for the answers to posted releases (``unanswered_releases`` counts the rest: their
        leases expire at the producer)."""
        self._collect_posted()
        self._channel.close()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._held.clear()

    def __enter__(self) -> ExportConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
