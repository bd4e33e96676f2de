"""Consumer client: fetch records by id (or stream them) into its own registered landing buffer.

::

    with ExportConsumer.from_params(response["kv_transfer_params"]) as c:
        rec = c.fetch(response["kv_transfer_params"]["hs_export"]["record_id"])
        rec.hidden_states  # [tokens, planes, hidden], checksum and shape verified

    for rec in ExportConsumer(endpoint, token).iter_records(batch=64, idle_timeout_s=30):
        ...

Not thread-safe: one consumer per thread or process.  With ``copy=False`` a record's tensor is a view of the
landing buffer, valid until :meth:`ExportConsumer.release`; with ``copy=True`` (default) it is owned.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import CaptureRecord, RecordMeta, compute_checksum
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.control import ControlClient, read_token
from vllm_hs_compat.export.nixl_backend import NixlConsumerTransport, UcxSettings
from vllm_hs_compat.export.producer import MAX_BATCH
from vllm_hs_compat.export.shm import DEFAULT_SHM_DIR, ShmConsumerTransport
from vllm_hs_compat.export.transport import MAX_RELEASES_PER_NOTIF, ConsumerTransport, encode_release

log = logging.getLogger(__name__)

PAGE = 4096


@dataclasses.dataclass(frozen=True)
class Claim:
    """A leased record: where it lies in the producer's pool and what it is."""

    record_id: str
    lease: int
    nonce: str
    offset: int
    nbytes: int
    producer: str
    meta: RecordMeta

    @classmethod
    def parse(cls, d: Any) -> Claim:
        if not isinstance(d, dict):
            raise E.ProtocolError(f"record descriptor must be a map, found {type(d).__name__}")
        meta = RecordMeta.from_dict(P.get_map(d, "meta"))
        claim = cls(
            record_id=P.get_str(d, "record_id", 512),
            lease=P.get_int(d, "lease", 1),
            nonce=P.get_str(d, "nonce", 64),
            offset=P.get_int(d, "offset", 0),
            nbytes=P.get_int(d, "nbytes", 1),
            producer=P.get_str(d, "producer", 64),
            meta=meta,
        )
        if meta.request_id != claim.record_id:
            raise E.RecordFormatError(f"descriptor for {claim.record_id!r} carries metadata of {meta.request_id!r}")
        if meta.nbytes != claim.nbytes:
            raise E.RecordFormatError(
                f"record {claim.record_id!r}: descriptor says {claim.nbytes} bytes, its shape {meta.shape} "
                f"{meta.dtype} needs {meta.nbytes}"
            )
        if meta.checksum is None:
            raise E.RecordFormatError(f"record {claim.record_id!r} arrived without a checksum")
        return claim


class _Landing:
    """First-fit page allocator over the landing buffer."""

    def __init__(self, nbytes: int) -> None:
        self.pages = nbytes // PAGE
        self._used = bytearray(self.pages)

    def alloc(self, nbytes: int) -> int | None:
        n = max(1, -(-nbytes // PAGE))
        i = self._used.find(bytes(n))
        if i < 0:
            return None
        self._used[i : i + n] = b"\x01" * n
        return i * PAGE

    def free(self, offset: int, nbytes: int) -> None:
        n = max(1, -(-nbytes // PAGE))
        i = offset // PAGE
        self._used[i : i + n] = bytes(n)

    def in_use(self) -> int:
        return self.pages - self._used.count(0)


class ExportConsumer:
    def __init__(
        self,
        endpoint: str,
        token: str,
        *,
        backend: str = "auto",
        landing_bytes: int = 256 << 20,
        timeout_s: float = 10.0,
        shm_dir: str = DEFAULT_SHM_DIR,
        ucx: UcxSettings | None = None,
        verify_checksum: bool = True,
    ) -> None:
        if backend not in ("auto", "shm", "nixl"):
            raise E.ExportConfigError(f"backend must be 'auto', 'shm' or 'nixl', found {backend!r}")
        if landing_bytes < PAGE or landing_bytes % PAGE:
            raise E.ExportConfigError(f"landing_bytes must be a positive multiple of {PAGE}, found {landing_bytes}")
        self.endpoint = endpoint
        self._token = token
        self._want = backend
        self._landing_bytes = landing_bytes
        self.timeout_s = timeout_s
        self._shm_dir = shm_dir
        self._ucx = ucx
        #: Checksum verification is on by default.  Turning it off saves one memory pass over every record
        #: (about 3.5 ms per 64 MiB on the CI machine) and leaves only the shape/size checks: do it only where
        #: the transport is trusted end to end.
        self.verify_checksum = verify_checksum
        self._client: ControlClient | None = None
        self._client_broken = False
        self._transport: ConsumerTransport | None = None
        self._landing = _Landing(landing_bytes)
        self._held: dict[int, tuple[CaptureRecord, int, int]] = {}
        self.producer: str | None = None
        self.hello: dict[str, Any] = {}
        self.counters = {
            "handshakes": 0,
            "producer_changes": 0,
            "records": 0,
            "bytes": 0,
            "checksum_failures": 0,
            "read_failures": 0,
            "abandoned": 0,
        }
        try:
            self._connect()
        except BaseException:
            self.close()  # do not leave a NIXL agent or a landing buffer behind
            raise

    @classmethod
    def from_params(cls, params: Mapping[str, Any], token: str | None = None, **kw: Any) -> ExportConsumer:
        """A consumer of the producer a ticket names.  ``token`` is the trainer credential (never part of the
        ticket); without it, :func:`~vllm_hs_compat.export.control.read_token` finds it."""
        p = P.ExportTicket.parse(params)
        return cls(p.endpoint, token if token is not None else read_token(), **kw)

    # --- connection -----------------------------------------------------------------------------------------
    def _connect(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        client = ControlClient(self.endpoint, self._token, self.timeout_s)
        try:
            hello = client.hello
            producer = P.get_str(hello, "producer", 64)
            info = P.get_map(hello, "transport")
            kind = P.get_str(info, "kind", 16)
            if self._want != "auto" and kind != self._want:
                raise E.TransportUnavailableError(
                    f"producer at {self.endpoint} serves transport {kind!r}, this consumer was asked for "
                    f"{self._want!r}; use backend='auto' or start the producer with backend={self._want!r}"
                )
            if self._transport is None or self._transport.kind != kind:
                if self._transport is not None:
                    self._transport.close()
                    self._transport = None
                if kind == "nixl":
                    self._transport = NixlConsumerTransport(self._landing_bytes, self._ucx)
                elif kind == "shm":
                    self._transport = ShmConsumerTransport(self._landing_bytes, self._shm_dir)
                else:
                    raise E.TransportUnavailableError(f"producer offers unknown transport {kind!r}")
                self.producer = None
            if producer != self.producer:
                if self.producer is not None:
                    self.counters["producer_changes"] += 1
                    log.info(
                        "producer at %s changed (%s -> %s); re-attaching",
                        self.endpoint,
                        self.producer,
                        producer,
                    )
                self._transport.attach(info)
                self.producer = producer
        except BaseException:
            client.close()
            raise
        self.hello = hello
        self._client = client
        self._client_broken = False
        self.counters["handshakes"] += 1

    def _call(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """One request; a broken connection (reset, truncated, timed out) is re-established once."""
        for attempt in (0, 1):
            if self._client is None or self._client_broken:
                self._connect()
            client = self._client
            if client is None:  # pragma: no cover - _connect raises instead
                raise E.ControlPlaneError("no control connection")
            try:
                return client.call(msg, timeout_s)
            except E.ExportError as e:
                if not client.broken:
                    raise  # the producer answered with an error: not a connection problem
                self._client_broken = True
                if attempt == 1:
                    raise
                log.info("control connection to %s failed (%s); reconnecting", self.endpoint, e)
        raise E.ControlPlaneError("unreachable")  # pragma: no cover

    # --- claims ---------------------------------------------------------------------------------------------
    def claim(self, record_id: str, timeout_s: float | None = None, wait_s: float = 0.0) -> Claim:
        """Lease one record by id.  A record not yet published is asked for again until ``wait_s`` has passed
        (the capture connector returns the ticket before the worker publishes the record); then
        :class:`UnknownRecordError`.  A record the producer knows failed raises :class:`RecordFailedError`."""
        deadline = time.monotonic() + wait_s
        pause = 0.005
        while True:
            ans = self._call({"op": "claim", "ids": [record_id]}, timeout_s or self.timeout_s)
            errs = P.get_list(ans, "errors", MAX_BATCH)
            if not errs:
                break
            e0 = errs[0] if isinstance(errs[0], dict) else {}
            msg = e0.get("message")
            text = msg if isinstance(msg, str) else f"record {record_id!r} unknown"
            if e0.get("error") == "failed_record":
                raise E.RecordFailedError(f"record {record_id!r} will not be published: {text}")
            if time.monotonic() + pause > deadline:
                raise E.UnknownRecordError(text)
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
        recs = P.get_list(ans, "records", MAX_BATCH)
        if len(recs) != 1:
            raise E.ProtocolError(f"claim of one record answered with {len(recs)} descriptors")
        return Claim.parse(recs[0])

    def claim_next(self, max_records: int = 1, wait_s: float = 1.0, max_bytes: int | None = None) -> list[Claim]:
        """Lease up to ``max_records`` published records (oldest first), waiting up to ``wait_s`` for one."""
        max_bytes = max_bytes or self._landing_bytes
        ans = self._call(
            {
                "op": "claim_next",
                "max_records": min(max_records, MAX_BATCH),
                "max_bytes": max_bytes,
                "wait_s": wait_s,
            },
            wait_s + self.timeout_s,
        )
        return [Claim.parse(d) for d in P.get_list(ans, "records", MAX_BATCH)]

    def abandon(self, claims: Sequence[Claim]) -> None:
        """Give leases back without reading them (best effort; the producer's TTL covers the rest)."""
        live = [c for c in claims if c.producer == self.producer]
        self.counters["abandoned"] += len(claims)
        if not live:
            return
        try:
            self._call({"op": "release", "leases": [[c.lease, c.nonce] for c in live]}, self.timeout_s)
        except E.ExportError as e:
            log.info("abandoning %d lease(s) failed (%s); the producer's TTL reclaims them", len(live), e)

    # --- reads ----------------------------------------------------------------------------------------------
    def _check(self, c: Claim) -> None:
        if c.producer != self.producer:
            raise E.StaleMetadataError(
                f"record {c.record_id!r} was leased from producer {c.producer}, now attached to "
                f"{self.producer}; "
                "the producer restarted and the record is gone"
            )
        pool = self.hello.get("pool_bytes")
        if not isinstance(pool, int) or c.offset + c.nbytes > pool:
            raise E.DescriptorError(
                f"record {c.record_id!r}: descriptor [{c.offset}, {c.offset + c.nbytes}) lies outside the "
                f"producer's {pool}-byte pool; refusing to read it"
            )

    def read(
        self, claims: Sequence[Claim], copy: bool = True, timeout_s: float | None = None
    ) -> list[CaptureRecord | HsCompatError]:
        """Read claimed records (one transfer per landing-buffer-full), verify each, release the leases.
        Returns one entry per claim: the record, or the named error that failed it."""
        transport = self._transport
        if transport is None:
            raise E.ExportClosedError("consumer is closed")
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        results: list[CaptureRecord | HsCompatError | None] = [None] * len(claims)
        todo: collections.deque[tuple[int, Claim]] = collections.deque()
        for i, c in enumerate(claims):
            try:
                self._check(c)
                todo.append((i, c))
            except E.ExportError as e:
                results[i] = e
                self.abandon([c])
        while todo:
            group: list[tuple[int, Claim, int]] = []
            while todo and len(group) < MAX_RELEASES_PER_NOTIF:
                i, c = todo[0]
                off = self._landing.alloc(c.nbytes)
                if off is None:
                    break
                todo.popleft()
                group.append((i, c, off))
            if not group:
                i, c = todo.popleft()
                cls = E.LandingBufferFullError if self._held else E.RecordTooLargeError
                results[i] = cls(
                    f"record {c.record_id!r} needs {c.nbytes} bytes; the landing buffer has "
                    f"{self._landing_bytes} bytes with {len(self._held)} record(s) held (copy=False); "
                    "release held records or raise landing_bytes"
                )
                self.abandon([c])
                continue
            items = [(c.offset, off, c.nbytes) for _, c, off in group]
            notif = encode_release([(c.lease, c.nonce) for _, c, _ in group])
            try:
                transport.read(items, notif, deadline)
            except E.ExportError as e:
                self.counters["read_failures"] += len(group)
                for i, c, off in group:
                    results[i] = e
                    self._landing.free(off, c.nbytes)
                if isinstance(e, E.RemoteDisconnectedError | E.StaleMetadataError):
                    self._client_broken = True  # re-handshake on the next call
                else:
                    self.abandon([c for _, c, _ in group])
                continue
            if not transport.releases_by_notification:
                try:
                    self._call({"op": "release", "leases": [[c.lease, c.nonce] for _, c, _ in group]}, self.timeout_s)
                except E.ExportError as e:
                    log.info("release failed (%s); the producer's TTL reclaims the slots", e)
            for i, c, off in group:
                results[i] = self._finish(c, off, copy)
        return [r if r is not None else E.ExportError("internal: no result") for r in results]

    def _finish(self, c: Claim, off: int, copy: bool, checksum: int | None = None) -> CaptureRecord | HsCompatError:
        transport = self._transport
        if transport is None:
            return E.ExportClosedError("consumer closed")
        raw = transport.landing[off : off + c.nbytes]
        got = compute_checksum(raw, c.meta.checksum_algorithm) if self.verify_checksum else c.meta.checksum
        if got != c.meta.checksum:
            self._landing.free(off, c.nbytes)
            self.counters["checksum_failures"] += 1
            return E.ChecksumMismatchError(
                f"record {c.record_id!r}: {c.meta.checksum_algorithm} of the {c.nbytes} bytes read is "
                f"{got:#010x}, "
                f"the producer computed {c.meta.checksum:#010x}; the slot was overwritten or the "
                "transfer torn "
                "(was the lease held past its TTL?)"
            )
        t = raw.view(c.meta.torch_dtype).view(c.meta.shape)
        self.counters["records"] += 1
        self.counters["bytes"] += c.nbytes
        if copy:
            rec = CaptureRecord(c.meta, t.clone())
            self._landing.free(off, c.nbytes)
        else:
            rec = CaptureRecord(c.meta, t)
            self._held[id(rec)] = (rec, off, c.nbytes)
        return rec

    def release(self, record: CaptureRecord) -> None:
        """Free the landing space of a record fetched with ``copy=False`` (its tensor is invalid
        afterwards)."""
        held = self._held.pop(id(record), None)
        if held is not None:
            self._landing.free(held[1], held[2])

    def fetch(
        self, record_id: str, copy: bool = True, timeout_s: float | None = None, wait_s: float = 0.0
    ) -> CaptureRecord:
        """Claim, read, verify and release one record; raises the named error that failed it.  ``wait_s``: how
        long to wait for a record that is not published yet (see :meth:`claim`)."""
        (res,) = self.read([self.claim(record_id, timeout_s, wait_s)], copy, timeout_s)
        if isinstance(res, HsCompatError):
            raise res
        return res

    def iter_records(
        self,
        batch: int = 64,
        wait_s: float = 1.0,
        idle_timeout_s: float | None = None,
        copy: bool = True,
        on_error: str = "raise",
    ) -> Iterator[CaptureRecord]:
        """Stream published records oldest first.  Stops after ``idle_timeout_s`` without a record (``None``:
        never).  ``on_error="raise"`` raises each failed record's error (the stream survives; call ``next``
        again), ``"skip"`` logs and counts it."""
        if on_error not in ("raise", "skip"):
            raise E.ExportConfigError(f"on_error must be 'raise' or 'skip', found {on_error!r}")
        return _RecordStream(self, batch, wait_s, idle_timeout_s, copy, on_error)

    # --- lifecycle ------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {
            **self.counters,
            "landing_pages_in_use": self._landing.in_use(),
            "held_records": len(self._held),
        }

    def remote_stats(self) -> dict[str, Any]:
        return P.get_map(self._call({"op": "stats"}, self.timeout_s), "stats")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._held.clear()

    def __enter__(self) -> ExportConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RecordStream(Iterator[CaptureRecord]):
    def __init__(
        self,
        consumer: ExportConsumer,
        batch: int,
        wait_s: float,
        idle_timeout_s: float | None,
        copy: bool,
        on_error: str,
    ) -> None:
        self._c = consumer
        self._batch = batch
        self._wait_s = wait_s
        self._idle = idle_timeout_s
        self._copy = copy
        self._on_error = on_error
        self._buf: collections.deque[CaptureRecord | HsCompatError] = collections.deque()
        self._last = time.monotonic()

    def __iter__(self) -> _RecordStream:
        return self

    def __next__(self) -> CaptureRecord:
        while True:
            while self._buf:
                item = self._buf.popleft()
                if isinstance(item, CaptureRecord):
                    return item
                if self._on_error == "raise":
                    raise item
                log.warning("skipping a record: %s", item)
            if self._idle is not None and time.monotonic() - self._last > self._idle:
                raise StopIteration
            wait = self._wait_s if self._idle is None else min(self._wait_s, max(0.0, self._idle))
            claims = self._c.claim_next(self._batch, wait)
            if claims:
                self._last = time.monotonic()
                self._buf.extend(self._c.read(claims, self._copy))
