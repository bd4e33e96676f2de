"""Producer: owns the registered pool, hands each finished record a lease, serves the control plane.

Caller: the capture connector's worker process, once per finished request::

    producer = ExportProducer(backend="auto", num_slots=64, slot_bytes=16 << 20)
    ticket = producer.publish(meta, rows)            # rows: CPU or GPU tensor [tokens, planes, hidden]
    return ticket.kv_transfer_params()               # -> {"hs_export": {endpoint, token, record_id, ...}}

``publish`` fails only its own record (named errors, counted in ``stats()``); it never stops the producer.
"""

from __future__ import annotations

import collections
import logging
import secrets
import socket
import threading
import time
from typing import Any

import torch

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import CHECKSUM_ALGORITHMS, DEFAULT_CHECKSUM, RecordMeta, compute_checksum
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.control import ControlServer, check_token, new_token
from vllm_hs_compat.export.nixl_backend import NixlProducerTransport, UcxSettings, nixl_available
from vllm_hs_compat.export.pool import Lease, LeasePool
from vllm_hs_compat.export.shm import DEFAULT_SHM_DIR, ShmProducerTransport
from vllm_hs_compat.export.transport import ProducerTransport, decode_release

log = logging.getLogger(__name__)

BACKENDS = ("auto", "shm", "nixl")
MAX_BATCH = 1024
#: Failed record ids remembered so a consumer waiting for one learns why (oldest forgotten first).
MAX_FAILED = 4096


def lease_descriptor(lease: Lease, instance: str) -> dict[str, Any]:
    if lease.meta is None:
        raise E.ExportError(f"lease {lease.lease_id} has no metadata")
    return {
        "record_id": lease.record_id,
        "lease": lease.lease_id,
        "nonce": lease.nonce,
        "offset": lease.offset,
        "nbytes": lease.nbytes,
        "producer": instance,
        "meta": lease.meta.to_dict(),
    }


class ExportProducer:
    def __init__(
        self,
        *,
        backend: str = "auto",
        num_slots: int = 64,
        slot_bytes: int = 16 << 20,
        lease_ttl_s: float = 30.0,
        ready_ttl_s: float | None = 300.0,
        on_full: str = "drop",
        wait_timeout_s: float = 1.0,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        advertise_host: str | None = None,
        checksum: str = DEFAULT_CHECKSUM,
        shm_dir: str = DEFAULT_SHM_DIR,
        ucx: UcxSettings | None = None,
        poll_interval_s: float = 200e-6,
        idle_poll_interval_s: float = 5e-3,
    ) -> None:
        if backend not in BACKENDS:
            raise E.ExportConfigError(f"backend must be one of {BACKENDS}, found {backend!r}")
        if checksum not in CHECKSUM_ALGORITHMS:
            raise E.ExportConfigError(f"checksum must be one of {CHECKSUM_ALGORITHMS}, found {checksum!r}")
        self._closed = False
        self.pool = LeasePool(num_slots, slot_bytes, lease_ttl_s, ready_ttl_s, on_full, wait_timeout_s)
        self.instance = secrets.token_hex(8)
        self.token = check_token(token) if token is not None else new_token()
        self.checksum = checksum
        self._poll_s = poll_interval_s
        self._idle_poll_s = idle_poll_interval_s
        self._expiry_interval_s = 0.02
        self._counters = {
            "bad_records": 0,
            "bad_notifications": 0,
            "pump_errors": 0,
            "control_releases": 0,
            "failed_records": 0,
        }
        self._counter_lock = threading.Lock()
        self._failed: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._last_activity = 0.0
        if backend == "auto":
            backend = "nixl" if nixl_available() else "shm"
        self.transport: ProducerTransport
        if backend == "nixl":
            self.transport = NixlProducerTransport(self.pool.pool_bytes, self.instance, ucx)
        else:
            self.transport = ShmProducerTransport(self.pool.pool_bytes, self.instance, shm_dir)
        self.backend = backend
        self._buf = self.transport.buffer
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._pump_loop, name="hsx-export-pump", daemon=True)
        self._pump.start()
        try:
            self._server = ControlServer(self._handle, self._hello, self.token, host, port)
        except BaseException:
            self._stop.set()
            self._pump.join(2.0)
            self.transport.close()
            raise
        # What clients are told to dial: the bind address, unless it is a wildcard (then the host name) or an
        # explicit advertise_host is given (NAT, several NICs).
        bound_host, bound_port = self._server.address
        adv = advertise_host or (socket.gethostname() if bound_host in ("0.0.0.0", "::", "") else bound_host)
        self.endpoint = f"[{adv}]:{bound_port}" if ":" in adv else f"{adv}:{bound_port}"

    def _count(self, key: str, n: int = 1) -> None:
        with self._counter_lock:
            self._counters[key] += n

    @staticmethod
    def error_params(record_id: str, error: BaseException) -> dict[str, Any]:
        """``kv_transfer_params`` for a record that could not be exported (e.g. :class:`PoolFullError`), so
        the client learns why instead of waiting for a record that will never come."""
        return {
            P.PARAMS_KEY: {
                "v": 1,
                "record_id": record_id,
                "error": type(error).__name__,
                "message": str(error)[:1000],
            }
        }

    # --- serving side ---------------------------------------------------------------------------------------
    def publish(self, meta: RecordMeta, rows: torch.Tensor) -> P.ExportTicket:
        """Copy ``rows`` into a leased run of slots, checksum it, make it fetchable.  Raises (and counts)
        :class:`RecordFormatError`, :class:`RecordTooLargeError`, :class:`PoolFullError`,
        :class:`DuplicateRecordError` for this record only."""
        if self._closed:
            raise E.ExportClosedError("publish() after close()")
        if not isinstance(meta, RecordMeta) or not isinstance(rows, torch.Tensor):
            self._count("bad_records", 1)
            raise E.RecordFormatError(
                f"publish(meta, rows) takes a RecordMeta and a torch.Tensor, found "
                f"{type(meta).__name__} and {type(rows).__name__}"
            )
        if tuple(rows.shape) != meta.shape or rows.dtype != meta.torch_dtype:
            self._count("bad_records", 1)
            raise E.RecordFormatError(
                f"record {meta.request_id!r}: rows are {tuple(rows.shape)} {rows.dtype}, metadata says "
                f"{meta.shape} {meta.dtype}; build the metadata with RecordMeta.for_tensor(rows, ...)"
            )
        nbytes = meta.nbytes
        lease = self.pool.allocate(meta.request_id, nbytes)
        try:
            dst = self._buf[lease.offset : lease.offset + nbytes]
            dst.view(rows.dtype).view(rows.shape).copy_(rows)  # GPU rows: synchronous DtoH into the pool
            checksum = compute_checksum(dst, self.checksum)
            self.pool.publish(lease, meta.with_checksum(checksum, self.checksum))
        except BaseException:
            self.pool.abort(lease)
            raise
        return P.ExportTicket(meta.request_id, self.endpoint, self.token, self.instance, self.backend, nbytes)

    def fail(self, record_id: str, reason: str, message: str) -> None:
        """Record that ``record_id`` will never be published, so a consumer asking for it is told why
        (:class:`RecordFailedError`) instead of waiting.  Counted in ``stats()["failed_records"]``."""
        with self._counter_lock:
            self._counters["failed_records"] += 1
            self._failed[record_id] = (reason, message[:1000])
            self._failed.move_to_end(record_id)
            while len(self._failed) > MAX_FAILED:
                self._failed.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        return {
            **self.pool.stats(),
            **self._counters,
            **{f"control_{k}": v for k, v in self._server.counters.items()},
            "backend": self.backend,
        }

    def occupancy(self) -> int:
        return self.pool.occupancy()

    # --- pump: notifications + expiry -----------------------------------------------------------------------
    def _pump_loop(self) -> None:
        next_expiry = 0.0
        while not self._stop.is_set():
            busy = False
            try:
                for msg in self.transport.poll_notifications():
                    busy = True
                    items = decode_release(msg)
                    if items is None:
                        self._count("bad_notifications", 1)
                        continue
                    for lease_id, nonce in items:
                        self.pool.release(lease_id, nonce)
                if time.monotonic() >= next_expiry:
                    self.pool.expire()
                    next_expiry = time.monotonic() + self._expiry_interval_s
            except E.ExportError as e:
                self._count("pump_errors", 1)
                log.warning("export pump: %s", e)
            except Exception:
                self._count("pump_errors", 1)
                log.exception("export pump failed; continuing")
            now = time.monotonic()
            if busy:
                self._last_activity = now
            hot = now - self._last_activity < 0.5 or self.pool.claimed_count() > 0
            if self.backend == "shm":  # nothing to poll, only expiry
                self._stop.wait(self._expiry_interval_s)
            elif hot:
                time.sleep(self._poll_s)
            else:
                self._stop.wait(self._idle_poll_s)

    # --- control plane --------------------------------------------------------------------------------------
    def _hello(self) -> dict[str, Any]:
        return {
            "producer": self.instance,
            "backend": self.backend,
            "pool_bytes": self.pool.pool_bytes,
            "slot_bytes": self.pool.slot_bytes,
            "lease_ttl_s": self.pool.lease_ttl_s,
            "transport": self.transport.describe(),
        }

    def _handle(self, op: str, msg: dict[str, Any]) -> dict[str, Any]:
        self._last_activity = time.monotonic()
        if self._closed:
            raise E.ExportClosedError("the producer is shutting down")
        if op == "claim":
            ids = P.get_list(msg, "ids", MAX_BATCH)
            out: list[dict[str, Any]] = []
            errors: list[dict[str, Any]] = []
            for rid in ids:
                if not isinstance(rid, str) or not 0 < len(rid) <= 512:
                    raise E.ProtocolError(f"record ids must be non-empty str, found {rid!r}")
                with self._counter_lock:
                    failed = self._failed.get(rid)
                if failed is not None:
                    errors.append({"record_id": rid, "error": "failed_record", "message": f"{failed[0]}: {failed[1]}"})
                    continue
                try:
                    out.append(lease_descriptor(self.pool.claim(rid), self.instance))
                except E.UnknownRecordError as e:
                    errors.append({"record_id": rid, "error": "unknown_record", "message": str(e)})
            return {"records": out, "errors": errors}
        if op == "claim_next":
            max_records = P.get_int(msg, "max_records", 1, MAX_BATCH)
            max_bytes = P.get_int(msg, "max_bytes", 1, 1 << 48)
            wait_s = P.get_float(msg, "wait_s", 0.0, 30.0)
            leases = self.pool.claim_next(max_records, max_bytes, wait_s)
            return {"records": [lease_descriptor(lease, self.instance) for lease in leases], "errors": []}
        if op == "release":
            items = P.get_list(msg, "leases", MAX_BATCH)
            ok = 0
            for item in items:
                if (
                    not isinstance(item, list)
                    or len(item) != 2
                    or isinstance(item[0], bool)
                    or not isinstance(item[0], int)
                    or not isinstance(item[1], str)
                ):
                    raise E.ProtocolError(f"release entries must be [lease_id, nonce], found {item!r}")
                ok += int(self.pool.release(item[0], item[1]))
            self._count("control_releases", ok)
            return {"released": ok}
        if op == "stats":
            return {"stats": {k: v for k, v in self.stats().items() if isinstance(v, int | str)}}
        if op == "ping":
            return {"producer": self.instance}
        raise E.ProtocolError(f"unknown op {op!r}; expected claim, claim_next, release, stats or ping")

    # --- lifecycle ------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed or not hasattr(self, "_server"):
            return
        self._closed = True
        self.pool.close()
        self._server.close()
        self._stop.set()
        self._pump.join(timeout=5.0)
        self._buf = torch.empty(0, dtype=torch.uint8)
        self.transport.close()

    def __enter__(self) -> ExportProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
