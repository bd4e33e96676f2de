"""Claims: leasing records, by id or the next published ones, and :class:`Claim`, a leased record's descriptor.

:class:`Claims` asks the producer for leases through the session; each descriptor is checked on its own as it is
parsed (a bad one fails its record alone, its lease given back through the releases) and leases not read are
abandoned here too.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import RecordMeta
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.consumer.landing import Landing
from vllm_hs_compat.export.consumer.releases import Entry, Releases
from vllm_hs_compat.export.consumer.session import Session

log = logging.getLogger(__package__)  # one logger for the whole consumer: vllm_hs_compat.export.consumer

MAX_BATCH = P.MAX_BATCH
#: A record claimed by id (``fetch``, ``claim``) whose bytes are at most this many comes in the claim's answer
#: (one round trip, no transfer; see :class:`ExportConsumer`'s ``inline_bytes``).
INLINE_BYTES = 256 << 10


@dataclasses.dataclass(frozen=True)
class Claim:
    """A leased record: its descriptor (``desc``: where it lies in the producer's pool, its lease, and ``meta``, its
    :class:`~vllm_hs_compat.core.records.RecordMeta` without the token ids, which are read with the hidden states),
    when it was claimed and, when they came in the claim's answer, its bytes.  The descriptor's fields read
    through (``claim.lease``, ``claim.meta``, ...): nothing of it is copied."""

    desc: P.RecordDesc
    #: when the claim was sent (``time.monotonic()``; 0: unknown): its lease cannot expire before
    #: ``claimed_at + lease_ttl_s``, which lets a release far from that point go without waiting for its answer
    claimed_at: float = 0.0
    #: the record's bytes (its extent), when they came in the claim's answer (``FetchReq``); else None
    inline: bytes | memoryview | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def record_id(self) -> str:
        """The record's id (its metadata's)."""
        return self.desc.meta.record_id

    @property
    def lease(self) -> int:
        """The lease id."""
        return self.desc.lease

    @property
    def nonce(self) -> str:
        """The lease's nonce (16 hex digits)."""
        return self.desc.nonce

    @property
    def offset(self) -> int:
        """Where the record starts in the producer's pool."""
        return self.desc.offset

    @property
    def nbytes(self) -> int:
        """Bytes of the hidden states."""
        return self.desc.nbytes

    @property
    def ids_offset(self) -> int:
        """Where the token ids start, from ``offset``."""
        return self.desc.ids_offset

    @property
    def extent(self) -> int:
        """Bytes of the record: hidden states, then token ids."""
        return self.desc.extent

    @property
    def ids_checksum(self) -> int:
        """Checksum of the token ids' bytes."""
        return self.desc.ids_checksum

    @property
    def producer(self) -> str:
        """The producer instance that leased it."""
        return self.desc.producer

    @property
    def meta(self) -> RecordMeta:
        """The record's metadata, without its token ids."""
        return self.desc.meta

    @classmethod
    def from_desc(cls, d: P.RecordDesc, claimed_at: float = 0.0) -> Claim:
        """A claim from a decoded descriptor, after the transport's checks that need no bytes (the metadata was
        validated as it was decoded; any failure is this record's alone: :class:`RecordFormatError`)."""
        m = d.meta
        if not P.is_nonce(d.nonce):
            raise E.RecordFormatError(f"descriptor for {d.record_id!r} carries a nonce that is not 16 hex digits")
        if m.checksum is None or m.token_ids:
            raise E.RecordFormatError(
                f"record {d.record_id!r}: a descriptor's metadata has a checksum and no token ids (they lie in the "
                f"pool), found checksum={m.checksum} and {len(m.token_ids)} token ids"
            )
        want = m.nbytes
        if d.nbytes != want:
            raise E.RecordFormatError(
                f"record {d.record_id!r}: descriptor says {d.nbytes} bytes, its shape {list(m.shape)} {m.dtype} "
                f"needs {want}"
            )
        if (d.ids_offset, d.extent) != P.ids_layout(d.nbytes, m.shape[0]):
            raise E.RecordFormatError(
                f"record {d.record_id!r}: token ids at [{d.ids_offset}, {d.extent}) do not follow {m.shape[0]} rows "
                f"of {d.nbytes} bytes (expected {P.ids_layout(d.nbytes, m.shape[0])})"
            )
        return cls(d, claimed_at)

    @classmethod
    def parse(cls, d: Any) -> Claim:
        """A claim from an encoded descriptor (bytes) or its plain-dict form; raises :class:`ProtocolError` or
        :class:`RecordFormatError`."""
        if isinstance(d, bytes | bytearray | memoryview):
            desc = P.decode_descriptor(bytes(d))
        else:
            try:
                desc = msgspec.convert(d, P.RecordDesc)
            except (msgspec.ValidationError, TypeError) as e:
                raise E.ProtocolError(f"record descriptor does not fit the schema: {e}") from None
        return cls.from_desc(desc)


class Claims:
    """Claiming records and giving back the leases not read.  ``inline_bytes``: a record claimed by id whose bytes
    are at most this many (and within the producer's ``max_read_bytes``) comes in the claim's answer (0: always
    claim, then read)."""

    def __init__(self, session: Session, releases: Releases, landing: Landing, inline_bytes: int) -> None:
        if not 0 <= inline_bytes <= P.MAX_READ_BYTES:
            raise E.ExportConfigError(f"inline_bytes must be in [0, {P.MAX_READ_BYTES}], found {inline_bytes!r}")
        self._session = session
        self._releases = releases
        self._landing = landing
        self.inline_bytes = inline_bytes
        self._fetch_op: bool | None = None  # whether the producer knows the ``fetch`` op (None: not asked yet)
        self.counters = {"abandoned": 0, "bad_descriptors": 0}

    def claim(self, record_id: str, timeout_s: float | None = None, wait_s: float = 0.0) -> Claim:
        """Lease one record by id.  A record not yet published is asked for again until ``wait_s`` has passed
        (the capture connector returns the ticket before the worker publishes the record); then
        :class:`UnknownRecordError`.  A record the producer knows failed raises :class:`RecordFailedError`."""
        deadline = time.monotonic() + wait_s
        pause = 0.005
        while True:
            sent = time.monotonic()
            rep = self._claim_one(record_id, timeout_s)
            if not rep.errors:
                break
            e0 = rep.errors[0]
            if e0.code == "failed_record":
                raise E.RecordFailedError(f"record {record_id!r} will not be published: {e0.message}")
            if time.monotonic() + pause > deadline:
                raise E.UnknownRecordError(e0.message)
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
        if len(rep.records) != 1:
            raise E.ProtocolError(f"claim of one record answered with {len(rep.records)} descriptors")
        (item,) = self.parse(rep.records, sent)
        if isinstance(item, HsCompatError):
            raise item
        data = rep.data[0] if isinstance(rep, P.FetchReply) and rep.data else b""
        if data:
            if len(data) != item.extent:
                self.abandon([item])
                raise E.ProtocolError(
                    f"record {record_id!r}: the claim's answer carries {len(data)} bytes, its descriptor says "
                    f"{item.extent}"
                )
            item = dataclasses.replace(item, inline=data)
        return item

    def _claim_one(self, record_id: str, timeout_s: float | None) -> P.ClaimReply | P.FetchReply:
        """One claim of ``record_id``: with its bytes in the answer when they may fit (``inline_bytes``) and the
        producer knows the ``fetch`` op (an older one answers it with a protocol error: asked once)."""
        room = self.inline_bytes
        hello = self._session.reply
        if hello is not None:
            room = min(room, hello.max_read_bytes)
        transport = self._landing.transport
        if transport is not None and transport.kind == "shm":
            room = 0  # the pool is mapped here: a copy out of it beats any answer carrying the bytes
        if room > 0 and self._fetch_op is not False:
            session = self._session
            req = P.FetchReq([record_id], max_reply_bytes=session.budget(), cap=session.cap, inline_bytes=room)
            try:
                rep = session.call(req, timeout_s)
            except E.ProtocolError as e:
                if self._fetch_op is not None:
                    raise
                log.info("producer %s does not answer 'fetch' (%s): claims, then reads", self._session.endpoint, e)
                self._fetch_op = False
            else:
                self._fetch_op = True
                if not isinstance(rep, P.FetchReply):
                    raise E.ProtocolError(f"fetch answered with {type(rep).__name__}")
                return rep
        session = self._session
        rep = session.call(P.ClaimReq([record_id], max_reply_bytes=session.budget(), cap=session.cap), timeout_s)
        if not isinstance(rep, P.ClaimReply):
            raise E.ProtocolError(f"claim answered with {type(rep).__name__}")
        return rep

    def parse(self, raws: Sequence[bytes], claimed_at: float = 0.0) -> list[Claim | HsCompatError]:
        """Each descriptor on its own: a bad one fails its record alone (its lease is given back if it can be
        read, else the producer's TTL reclaims it)."""
        out: list[Claim | HsCompatError] = []
        bad: list[tuple[int, str, str]] = []
        for raw in raws:
            try:
                desc = P.decode_descriptor(raw)
            except (E.ProtocolError, E.RecordFormatError) as e:
                out.append(self.refused(raw, e, bad))
                continue
            try:
                out.append(Claim.from_desc(desc, claimed_at))
            except E.RecordFormatError as e:
                out.append(self.refused(desc, e, bad))
        self.give_back(bad)
        return out

    def refused(self, what: bytes | P.RecordDesc, e: HsCompatError, bad: list[Entry]) -> E.DescriptorError:
        """A descriptor that cannot be read (raw bytes) or whose record cannot be (a decoded one): counted, its
        lease noted in ``bad`` to be given back when it can be read."""
        self.counters["bad_descriptors"] += 1
        ref = P.decode_lease_ref(what) if isinstance(what, bytes) else what
        if ref is not None and not P.is_nonce(ref.nonce):
            ref = None  # a release naming it would be refused whole: its TTL reclaims it
        if ref is not None:
            bad.append((ref.lease, ref.nonce, "abandoned"))
        name = ref.record_id if ref is not None and ref.record_id else "?"
        fate = "its lease is given back" if ref is not None else "its lease expires at the producer"
        return E.DescriptorError(f"record {name!r}: descriptor refused ({e}); {fate}")

    def give_back(self, bad: list[Entry]) -> None:
        """Give back the leases of refused descriptors (``abandoned``)."""
        if bad:
            self._releases.settle(bad)
            self.counters["abandoned"] += len(bad)

    def next_reply(self, max_records: int, wait_s: float, max_bytes: int | None = None) -> tuple[list[bytes], float]:
        """One ``claim_next`` (``max_bytes``: the landing buffer's size unless given): the encoded descriptors and
        when the claim was sent (``time.monotonic()``)."""
        sent = time.monotonic()
        session = self._session
        rep = session.call(
            P.ClaimNextReq(
                max_records=max(1, min(max_records, MAX_BATCH)),
                max_bytes=max_bytes or self._landing.nbytes,
                wait_s=min(max(wait_s, 0.0), P.MAX_WAIT_S),
                max_reply_bytes=session.budget(),
            ),
            wait_s + session.timeout_s,
        )
        if not isinstance(rep, P.ClaimReply):
            raise E.ProtocolError(f"claim_next answered with {type(rep).__name__}")
        return rep.records, sent

    def claim_next(self, max_records: int = 1, wait_s: float = 1.0, max_bytes: int | None = None) -> list[Claim]:
        """Lease up to ``max_records`` published records (oldest first), waiting up to ``wait_s`` for one.  The
        producer bounds the answer by its encoded size; a record whose descriptor is malformed is given back
        (counted ``bad_descriptors``) and the others are returned.  Trainer only."""
        items = self.parse(*self.next_reply(max_records, wait_s, max_bytes))
        for it in items:
            if isinstance(it, HsCompatError):
                log.warning("claim_next: %s", it)
        return [it for it in items if isinstance(it, Claim)]

    def abandon(self, claims: Sequence[Claim]) -> None:
        """Give leases back without reading them (counted ``abandoned`` on both sides; if the producer cannot be
        reached its TTL reclaims them)."""
        live = [c for c in claims if c.producer == self._session.producer]
        self.counters["abandoned"] += len(claims)
        if live:
            self._releases.settle([(c.lease, c.nonce, "abandoned") for c in live])

    def abandon_leases(self, descs: Sequence[P.RecordDesc]) -> None:
        """Give back the leases of claimed descriptors not read (counted ``abandoned``)."""
        self.counters["abandoned"] += len(descs)
        self._releases.settle([(d.lease, d.nonce, "abandoned") for d in descs])
