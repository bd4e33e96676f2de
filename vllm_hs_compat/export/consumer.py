"""Consumer client: fetch records by id (or stream them) into its own landing buffer.

::

    with ExportConsumer.from_params(response["kv_transfer_params"]) as c:       # trainer token, or the ticket
        rec = c.fetch(response["kv_transfer_params"]["hs_export"]["record_id"])
        rec.hidden_states  # [tokens, planes, hidden], checksum and shape verified

    for rec in ExportConsumer(endpoint, token).iter_records(batch=64, idle_timeout_s=30):   # trainer only
        ...

    for batch in ExportConsumer(endpoint, token).iter_batches(max_records=256):   # many small records, fast
        batch.hidden_states, batch.token_ids, batch.cu_tokens    # packed, see vllm_hs_compat.export.batch

Two kinds of consumer:

* a **trainer** (``token``): claims any record or streams them all, and reads over the producer's data
  transport (NIXL READ into a registered landing buffer, or a copy out of the ``/dev/shm`` pool);
* a **ticket holder** (``ticket`` with a capability, no token): fetches that one record, whose bytes come through
  the control plane (it is never given the pool's transport description, which would open every record).

Every read is verified (hidden-state checksum unless ``verify_checksum=False``; the token ids' checksum always)
and then released with its outcome; only a record whose lease was held through its read is handed out
(:class:`LeaseExpiredError` otherwise): the producer's answer to the release says so, or, for a release made
before half the lease TTL has passed since the claim was sent, the clock does (the release is then posted and its
answer checked later: ``defer_releases``, see docs/export.md "Ledger").  Not thread-safe: one consumer per thread
or process.  With ``copy=False`` a record's tensor is a view of the landing buffer, valid until
:meth:`ExportConsumer.release`; with ``copy=True`` (default) it is owned: valid as long as it is referenced, after
``release`` and ``close`` too.  An owned record is not copied while the landing buffer has room (``lend_fraction``,
three quarters of it by default): its tensor views the landing space it was read into, which comes back to the
consumer when the tensor is garbage collected.  Past that share it is copied into freshly allocated memory.
"""

from __future__ import annotations

import array
import collections
import ctypes
import dataclasses
import gc
import logging
import math
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import torch

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import (
    CHECKSUM_ALGORITHMS,
    SCHEMA_VERSIONS,
    CaptureRecord,
    ChecksumState,
    RecordMeta,
    byte_view,
    check_sample,
    checksum_bytes,
    checksum_function,
    dtype_itemsize,
)
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.batch import BatchSchema, RecordBatch
from vllm_hs_compat.export.control import ControlClient, read_token, server_key
from vllm_hs_compat.export.nixl_backend import NixlConsumerTransport, UcxSettings
from vllm_hs_compat.export.shm import DEFAULT_SHM_DIR, ShmConsumerTransport
from vllm_hs_compat.export.transport import REGION_MASK, REGION_SHIFT, ConsumerTransport, host_buffer

log = logging.getLogger(__name__)
_T = TypeVar("_T")

PAGE = 4096
MAX_BATCH = P.MAX_BATCH
#: With verification on, a read of at least this many bytes is cut into pieces, each checksummed as soon as it
#: landed (``CHECK_PIECE_BYTES``); with ``overlap_verification`` a reader thread transfers piece k + 1 (NIXL's
#: ``transfer`` releases the GIL) while this thread checksums piece k.
OVERLAP_MIN_BYTES = 4 << 20
#: A release is posted without waiting for its answer while less than this share of the lease TTL has passed
#: since its claim was sent (``defer_releases``).
DEFER_FRACTION = 0.5
#: How long :meth:`ExportConsumer.close` waits for the answers to posted releases.
CLOSE_COLLECT_S = 2.0
#: How long the first ping through an offered direct endpoint may take before the trainer stays on the gate.
DIRECT_CONFIRM_S = 2.0
#: pieces of a verified read without ``overlap_verification``: each checksummed right after it landed
CHECK_PIECE_BYTES = 2 << 20
#: pieces of a pipelined read: about an eighth of it, between these bounds
PIECE_MIN_BYTES = 1 << 20
PIECE_MAX_BYTES = 8 << 20
#: A verified read over a transport with posted reads (NIXL): this many pieces in flight at once, each
#: checksummed as soon as it landed, in order, on the calling thread (1: one piece after another)
READ_WINDOW = 16
#: while a piece is awaited its READ is polled without pause for this long (over UCX TCP only the polls move
#: the bytes), then with short sleeps (a stalled producer does not burn a core until the deadline)
PIECE_SPIN_S = 20e-3
#: An owned record smaller than this is copied (malloc'd memory, already faulted in: a copy costs about what
#: lending costs), so small records a caller keeps do not fragment the landing buffer.
LEND_MIN_BYTES = 64 << 10
#: Over NIXL, a batch whose records average at least this many bytes is read straight into its packed layout
#: (two descriptors per record: hidden states, token ids); smaller records are read whole (one descriptor each:
#: a descriptor costs a NIXL request about 2 us) and packed by two buffer copies each (cheaper than a descriptor).
#: Over shm every batch is copied straight into its packed layout.
BATCH_DIRECT_MIN_BYTES = 64 << 10
#: A record claimed by id (``fetch``, ``claim``) whose bytes are at most this many comes in the claim's answer
#: (one round trip, no transfer; see :class:`ExportConsumer`'s ``inline_bytes``).
INLINE_BYTES = 256 << 10
#: Spill arenas (see :class:`_Landing`) are at least a quarter of the landing buffer and a multiple of this.
SPILL_ROUND_BYTES = 2 << 20


@dataclasses.dataclass(frozen=True)
class Claim:
    """A leased record: where it lies in the producer's pool and what it is (``meta``: its metadata without the
    token ids, which are read with the hidden states)."""

    record_id: str
    lease: int
    nonce: str
    offset: int
    nbytes: int
    ids_offset: int
    extent: int
    ids_checksum: int
    producer: str
    meta: P.MetaWire
    #: when the claim was sent (``time.monotonic()``; 0: unknown): its lease cannot expire before
    #: ``claimed_at + lease_ttl_s``, which lets a release far from that point go without waiting for its answer
    claimed_at: float = 0.0
    #: the record's bytes (its extent), when they came in the claim's answer (``FetchReq``); else None
    inline: bytes | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_desc(cls, d: P.RecordDesc, claimed_at: float = 0.0) -> Claim:
        """A claim from a decoded descriptor, after the checks that need no bytes (any failure is this record's
        alone: :class:`RecordFormatError`)."""
        m = d.meta
        if m.request_id != d.record_id:
            raise E.RecordFormatError(f"descriptor for {d.record_id!r} carries metadata of {m.request_id!r}")
        if not P.is_nonce(d.nonce):
            raise E.RecordFormatError(f"descriptor for {d.record_id!r} carries a nonce that is not 16 hex digits")
        if m.checksum_algorithm not in CHECKSUM_ALGORITHMS:
            raise E.RecordFormatError(
                f"record {d.record_id!r}: unknown checksum algorithm {m.checksum_algorithm!r}; expected one of "
                f"{CHECKSUM_ALGORITHMS} (producer and consumer run different vllm-hs-compat releases?)"
            )
        want = math.prod(m.shape) * dtype_itemsize(m.dtype)
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
        if len(m.layer_ids) != m.shape[1] or any(a >= b for a, b in zip(m.layer_ids, m.layer_ids[1:], strict=False)):
            raise E.RecordFormatError(
                f"record {d.record_id!r}: layer ids {list(m.layer_ids)[:8]}... are not {m.shape[1]} ascending ids"
            )
        if not m.plain or (m.schema_version < 2 and (m.sample_id or m.source)):
            check_sample(
                m.sample(), start=m.start, tokens=m.shape[0], schema_version=m.schema_version, what=d.record_id
            )
        return cls(
            record_id=d.record_id,
            lease=d.lease,
            nonce=d.nonce,
            offset=d.offset,
            nbytes=d.nbytes,
            ids_offset=d.ids_offset,
            extent=d.extent,
            ids_checksum=d.ids_checksum,
            producer=d.producer,
            meta=m,
            claimed_at=claimed_at,
        )

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


class _Arena:
    """A spill arena: a landing region past the landing buffer (registered with the transport), its own pages."""

    __slots__ = ("buf", "pages", "used", "used_map", "view")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.pages = buf.numel() // PAGE
        self.used_map = bytearray(self.pages)
        self.used = 0
        self.view = byte_view(buf)


class _Landing:
    """First-fit page allocator over the landing buffer (region 0) and the spill arenas (regions 1...).

    Space lent to an owned record (``copy=True``, see :meth:`ExportConsumer.fetch`) comes back when that record's
    tensor is garbage collected, from whichever thread drops it: its finalizer only appends to ``deferred`` (a
    thread-safe deque), and the consumer's own thread frees the pages at its next allocation.

    Spill arenas hold the owned records that do not fit the landing buffer's lending share (a trainer that keeps
    several large records): each is allocated (and its pages touched) once, registered with the transport, and
    recycled as the records in it are dropped, so a loop that keeps K records reaches a steady state with no
    allocation, no page fault and no copy per fetch.  An arena with nothing in it is kept for the next record
    while it is the only empty one; further empty arenas are given back (``on_drop``)."""

    def __init__(self, nbytes: int) -> None:
        self.pages = nbytes // PAGE
        self._used = bytearray(self.pages)
        self.used = 0
        self.deferred: collections.deque[tuple[int, int]] = collections.deque()
        #: bytes of the landing buffer lent to owned records that are still alive
        self.lent = 0
        #: spill arenas by region number; their total size; bytes of them lent to owned records still alive
        self.spill: dict[int, _Arena] = {}
        self.spill_bytes = 0
        self.spill_lent = 0
        #: called with a region number when an empty spill arena is given back (the transport deregisters it)
        self.on_drop: Callable[[int], None] | None = None

    def _drain(self) -> None:
        if not self.deferred:
            return
        while self.deferred:
            off, n = self.deferred.popleft()
            self.free(off, n)
            if off >> REGION_SHIFT:
                self.spill_lent -= n
            else:
                self.lent -= n
        self._trim()

    def _trim(self) -> None:
        """Give back every empty spill arena but the largest one."""
        empty = sorted((k for k, a in self.spill.items() if a.used == 0), key=lambda k: -self.spill[k].pages)
        for k in empty[1:]:
            arena = self.spill.pop(k)
            self.spill_bytes -= arena.pages * PAGE
            if self.on_drop is not None:
                self.on_drop(k)

    def alloc(self, nbytes: int) -> int | None:
        """Space in the landing buffer (region 0)."""
        self._drain()
        n = max(1, -(-nbytes // PAGE))
        i = self._used.find(bytes(n))
        if i < 0:
            return None
        self._used[i : i + n] = b"\x01" * n
        self.used += n
        return i * PAGE

    def alloc_spill(self, nbytes: int) -> int | None:
        """Space in a spill arena (first fit, lowest region first): its local offset (``region << REGION_SHIFT |
        offset``), or ``None``."""
        self._drain()
        n = max(1, -(-nbytes // PAGE))
        for k in sorted(self.spill):
            a = self.spill[k]
            if a.pages - a.used < n:
                continue
            i = a.used_map.find(bytes(n))
            if i >= 0:
                a.used_map[i : i + n] = b"\x01" * n
                a.used += n
                return (k << REGION_SHIFT) | (i * PAGE)
        return None

    def add_arena(self, k: int, buf: torch.Tensor) -> None:
        self.spill[k] = _Arena(buf)
        self.spill_bytes += self.spill[k].pages * PAGE

    def free(self, offset: int, nbytes: int) -> None:
        n = max(1, -(-nbytes // PAGE))
        k = offset >> REGION_SHIFT
        if k:
            a = self.spill[k]
            i = (offset & REGION_MASK) // PAGE
            a.used_map[i : i + n] = bytes(n)
            a.used -= n
            return
        i = offset // PAGE
        self._used[i : i + n] = bytes(n)
        self.used -= n

    def free_bytes(self) -> int:
        """Free bytes of the landing buffer (region 0)."""
        return (self.pages - self.used) * PAGE

    def in_use(self) -> int:
        """Pages in use, landing buffer and spill arenas together."""
        self._drain()
        return self.used + sum(a.used for a in self.spill.values())


def _give_back(deferred: collections.deque[tuple[int, int]], off: int, n: int, keep: torch.Tensor) -> None:
    """An owned record's finalizer (any thread): its landing space is free again.  ``keep`` (the landing
    buffer) is held until then, so the record stays valid after the consumer closes."""
    deferred.append((off, n))


def _copied(t: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous CPU tensor ``t`` in fresh memory by one C memmove without the GIL (not ``clone()``:
    torch's intra-op threads wait for each other at every copy, which on a busy host costs 10-20x)."""
    out = torch.empty_like(t)
    ctypes.memmove(out.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
    return out


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


def _token_ids(raw: memoryview) -> tuple[int, ...]:
    ids = array.array("I")
    ids.frombytes(raw)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        ids.byteswap()
    return tuple(ids)


def _same_schema(a: P.MetaWire, b: P.MetaWire) -> bool:
    """The two records' rows can share one batch tensor (see :class:`BatchSchema`)."""
    return (
        a.shape[1] == b.shape[1]
        and a.shape[2] == b.shape[2]
        and a.dtype == b.dtype
        and a.layer_ids == b.layer_ids
        and a.pre_norm == b.pre_norm
        and a.checksum_algorithm == b.checksum_algorithm
        and a.schema_version == b.schema_version
        and a.vllm_version == b.vllm_version
        and a.adapter == b.adapter
    )


def _pack_uniform(
    landing: torch.Tensor, off: int, descs: Sequence[P.RecordDesc], slot: int, hidden: torch.Tensor, ids: torch.Tensor
) -> bool:
    """Pack records read whole into ``slot``-byte places from ``off`` on into ``hidden`` and ``ids`` with two
    strided copies (numpy's: one thread, no torch intra-op team), when every record has the same extent (the same
    token count: the usual small-record batch); False (nothing done) otherwise or without numpy."""
    d0 = descs[0]
    nb, at, extent = d0.nbytes, d0.ids_offset, d0.extent
    if any(d.extent != extent or d.nbytes != nb for d in descs):
        return False  # (records of one schema with the same nbytes have the same ids_offset)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - torch environments carry numpy
        return False
    n = len(descs)
    src = landing[off : off + n * slot].numpy().reshape(n, slot)
    np.copyto(hidden.numpy().reshape(n, nb), src[:, :nb])
    np.copyto(ids.numpy().view(np.uint8).reshape(n, extent - at), src[:, at:extent])
    return True


def _pieces(ranges: Sequence[tuple[int, int, int]], size: int) -> list[list[tuple[int, int, int, int, int]]]:
    """``(remote, local, nbytes)`` ranges cut into pieces of ``size`` bytes (the last one shorter), in order:
    each piece a list of ``(remote, local, nbytes, range index, offset in the range)``."""
    pieces: list[list[tuple[int, int, int, int, int]]] = [[]]
    room = size
    for k, (remote, local, nbytes) in enumerate(ranges):
        at = 0
        while at < nbytes:
            if room == 0:
                pieces.append([])
                room = size
            n = min(nbytes - at, room)
            pieces[-1].append((remote + at, local + at, n, k, at))
            room -= n
            at += n
    return pieces


class ExportConsumer:
    """Fetches and streams records from one producer (see the module docstring)."""

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
        }
        #: a trainer moves its control calls to the producer's direct endpoint (past the gate) when offered
        self._direct_wanted = direct
        self._token = token
        self._max_reply_bytes = max_reply_bytes
        self._client: ControlClient | None = None
        #: the connection through the gate (the ticket's endpoint); ``_client`` is it, or the direct one
        self._gate_client: ControlClient | None = None
        self._reader: Any = None  # concurrent.futures.ThreadPoolExecutor, made on the first pipelined read
        self._raw, self._raw_key = memoryview(b""), (0, 0)
        try:
            self._client = ControlClient(
                endpoint,
                token,
                timeout_s,
                server_key=ticket.server_key if ticket is not None else None,
                max_reply_bytes=max_reply_bytes,
            )
            self._gate_client = self._client
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

    # --- connection -----------------------------------------------------------------------------------------
    @property
    def principal(self) -> str:
        """``"trainer"`` (token) or ``"record"`` (a ticket's capability)."""
        return "record" if self._ticket is not None else "trainer"

    def _connect(self) -> None:
        rep, producer = self._exchange(P.HelloReq(), self._client.timeout_s if self._client is not None else None)
        if not isinstance(rep, P.HelloReply):
            raise E.ProtocolError(f"hello answered with {type(rep).__name__}")
        info = rep.transport
        if info is not None:
            kind = "shm" if isinstance(info, P.ShmInfo) else "nixl"
            if self._want != "auto" and kind != self._want:
                raise E.TransportUnavailableError(
                    f"producer at {self.endpoint} serves transport {kind!r}, this consumer was asked for "
                    f"{self._want!r}; use backend='auto' or start the producer with backend={self._want!r}"
                )
            if self._transport is None or self._transport.kind != kind:
                if self._transport is not None:
                    self._transport.close()
                    self._transport = None
                    self._landing = self._new_landing()  # records lent from the old buffers keep them
                if kind == "nixl":
                    self._transport = NixlConsumerTransport(self._landing_bytes, self._ucx)
                else:
                    self._transport = ShmConsumerTransport(self._landing_bytes, self._shm_dir)
                self.producer = None
            if rep.producer != self.producer:
                self._transport.attach(info)
        elif rep.principal == "trainer":
            raise E.ProtocolError("the producer sent the trainer no transport description")
        if self.producer is not None and rep.producer != self.producer:
            self.counters["producer_changes"] += 1
            log.info("producer at %s changed (%s -> %s); re-attached", self.endpoint, self.producer, rep.producer)
        self.producer = rep.producer
        self._hello = rep
        self.hello = msgspec.to_builtins(rep, builtin_types=(bytes,))
        self.counters["handshakes"] += 1
        if rep.principal == "trainer" and self._direct_wanted and self._ticket is None:
            self._go_direct()

    @property
    def direct(self) -> bool:
        """Whether control calls go to the producer's direct endpoint (the trainer's path past the gate)."""
        return self._client is not None and self._client is not self._gate_client

    def _go_direct(self) -> None:
        """After a hello through the gate: ask for the direct endpoint, confirm it with a ping (same producer
        instance), then send every control call there.  Any failure keeps the gate (counted ``direct_failures``
        when an offered endpoint did not answer)."""
        gate = self._gate_client
        if gate is None or self._client is not gate or self._token is None:
            return
        try:
            rep, _ = gate.call(P.DirectReq(), self.timeout_s)
        except E.ExportError as e:  # an older producer: `protocol` error; the gate stays
            log.debug("no direct endpoint from %s: %s", self.endpoint, e)
            return
        if not isinstance(rep, P.DirectReply) or rep.endpoint is None:
            return
        client: ControlClient | None = None
        try:
            client = ControlClient(
                rep.endpoint,
                self._token,
                min(self.timeout_s, DIRECT_CONFIRM_S),
                max_reply_bytes=self._max_reply_bytes,
                fail_on_disconnect=True,
            )
            pong, producer = client.call(P.PingReq())
            if not isinstance(pong, P.PongReply) or producer != self.producer:
                raise E.StaleMetadataError(f"direct endpoint {rep.endpoint} answered as {producer}")
        except HsCompatError as e:
            self.counters["direct_failures"] += 1
            log.info("direct endpoint %s not usable (%s); staying on the gate %s", rep.endpoint, e, self.endpoint)
            if client is not None:
                client.close()
            return
        client.timeout_s = self.timeout_s
        client.adopt(gate)
        self._client = client
        self.counters["direct_switches"] += 1

    def _fall_back(self, why: BaseException) -> ControlClient:
        """The direct connection failed: close it and use the gate again (its posted requests move there)."""
        direct, gate = self._client, self._gate_client
        if gate is None:
            raise E.ExportClosedError("consumer is closed")
        if direct is not None and direct is not gate:
            gate.adopt(direct)
            direct.close()
        self._client = gate
        self.counters["direct_fallbacks"] += 1
        log.info("direct control endpoint failed (%s); back to the gate %s", why, self.endpoint)
        return gate

    def _new_landing(self) -> _Landing:
        landing = _Landing(self._landing_bytes)
        landing.on_drop = self._drop_region
        return landing

    def _drop_region(self, k: int) -> None:
        if self._transport is not None:
            self._transport.drop_region(k)

    def _spill_alloc(self, nbytes: int) -> int | None:
        """Space for an owned record in a spill arena: an existing one, else a new one while the arenas stay
        within ``spill_bytes``; ``None`` otherwise."""
        landing = self._landing
        off = landing.alloc_spill(nbytes)
        if off is not None or self._transport is None:
            return off
        need = -(-nbytes // PAGE) * PAGE
        size = max(-(-nbytes // SPILL_ROUND_BYTES) * SPILL_ROUND_BYTES, self._landing_bytes // 4 // PAGE * PAGE)
        room = self.spill_bytes - landing.spill_bytes
        size = min(size, room // PAGE * PAGE)
        if size < need:
            return None
        buf = host_buffer(size)  # zeroed: its pages are touched once, here, not on every record
        k = self._transport.add_region(buf)
        landing.add_arena(k, buf)
        return landing.alloc_spill(nbytes)

    def _place(self, c: Claim, copy: bool, pending: int) -> tuple[int | None, bool]:
        """Where claim ``c`` lands and whether its record will be lent that space (``copy=True``, large records):
        the landing buffer while lending stays within its share (``pending``: bytes of it already promised to
        records of this read) and leaves room for another record of this size, else a spill arena, else the
        landing buffer with a copy afterwards."""
        landing = self._landing
        if copy and c.nbytes >= LEND_MIN_BYTES:
            landing._drain()
            pages = -(-c.extent // PAGE) * PAGE
            if landing.lent + pending + c.extent <= self.lend_bytes and landing.free_bytes() - pages >= c.extent + PAGE:
                off = landing.alloc(c.extent)
                if off is not None:
                    return off, True
            if self.spill_bytes and self.lend_bytes:  # (lend_fraction=0: owned records are always copies)
                off = self._spill_alloc(c.extent)
                if off is not None:
                    return off, True
        return landing.alloc(c.extent), False

    def _locate(self, off: int) -> tuple[torch.Tensor, int]:
        """The buffer a local offset lies in (the landing buffer or a spill arena) and the offset in it."""
        k = off >> REGION_SHIFT
        if k == 0:
            if self._transport is None:
                raise E.ExportClosedError("consumer is closed")
            return self._transport.landing, off
        return self._landing.spill[k].buf, off & REGION_MASK

    def _call(self, req: P.Request, timeout_s: float | None = None) -> P.Reply:
        """One request.  An answer from another producer instance than the attached one (the producer restarted)
        re-attaches first."""
        rep, producer = self._exchange(req, timeout_s if timeout_s is not None else self.timeout_s)
        if self._unsettled:
            self._reconcile()
        if producer != self.producer:
            self._connect()
        return rep

    def _exchange(self, req: P.Request, timeout: float | None) -> tuple[P.Reply, str]:
        """One request on the current connection; a direct one that fails sends it again through the gate."""
        client = self._client
        if client is None:
            raise E.ExportClosedError("consumer is closed")
        if client is self._gate_client:
            return client.call(req, timeout)
        rid = P.new_rid()
        try:
            return client.call(req, timeout, rid=rid)
        except (E.ExportTimeoutError, E.AuthError) as e:
            # the same request id through the gate: the producer answers it once (a claim keeps its leases)
            return self._fall_back(e).call(req, timeout, rid=rid)

    def _cap(self) -> str | None:
        return self._ticket.cap if self._ticket is not None else None

    def _budget(self) -> int:
        client = self._client
        return client.max_reply_bytes if client is not None else P.DEFAULT_REPLY_BYTES

    # --- claims ---------------------------------------------------------------------------------------------
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
        (item,) = self._parse(rep.records, sent)
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
        if self._hello is not None:
            room = min(room, self._hello.max_read_bytes)
        if self._transport is not None and self._transport.kind == "shm":
            room = 0  # the pool is mapped here: a copy out of it beats any answer carrying the bytes
        if room > 0 and self._fetch_op is not False:
            req = P.FetchReq([record_id], max_reply_bytes=self._budget(), cap=self._cap(), inline_bytes=room)
            try:
                rep = self._call(req, timeout_s)
            except E.ProtocolError as e:
                if self._fetch_op is not None:
                    raise
                log.info("producer %s does not answer 'fetch' (%s): claims, then reads", self.endpoint, e)
                self._fetch_op = False
            else:
                self._fetch_op = True
                if not isinstance(rep, P.FetchReply):
                    raise E.ProtocolError(f"fetch answered with {type(rep).__name__}")
                return rep
        rep = self._call(P.ClaimReq([record_id], max_reply_bytes=self._budget(), cap=self._cap()), timeout_s)
        if not isinstance(rep, P.ClaimReply):
            raise E.ProtocolError(f"claim answered with {type(rep).__name__}")
        return rep

    def _parse(self, raws: Sequence[bytes], claimed_at: float = 0.0) -> list[Claim | HsCompatError]:
        """Each descriptor on its own: a bad one fails its record alone (its lease is given back if it can be
        read, else the producer's TTL reclaims it)."""
        out: list[Claim | HsCompatError] = []
        bad: list[tuple[int, str, str]] = []
        for raw in raws:
            try:
                desc = P.decode_descriptor(raw)
            except E.ProtocolError as e:
                out.append(self._refused(raw, e, bad))
                continue
            try:
                out.append(Claim.from_desc(desc, claimed_at))
            except E.RecordFormatError as e:
                out.append(self._refused(desc, e, bad))
        self._give_back_refused(bad)
        return out

    def _refused(
        self, what: bytes | P.RecordDesc, e: HsCompatError, bad: list[tuple[int, str, str]]
    ) -> E.DescriptorError:
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

    def _give_back_refused(self, bad: list[tuple[int, str, str]]) -> None:
        if bad:
            self._settle(bad)
            self.counters["abandoned"] += len(bad)

    def _claim_next_reply(self, max_records: int, wait_s: float, max_bytes: int) -> tuple[list[bytes], float]:
        """One ``claim_next``: the encoded descriptors and when the claim was sent (``time.monotonic()``)."""
        sent = time.monotonic()
        rep = self._call(
            P.ClaimNextReq(
                max_records=max(1, min(max_records, MAX_BATCH)),
                max_bytes=max_bytes,
                wait_s=min(max(wait_s, 0.0), P.MAX_WAIT_S),
                max_reply_bytes=self._budget(),
            ),
            wait_s + self.timeout_s,
        )
        if not isinstance(rep, P.ClaimReply):
            raise E.ProtocolError(f"claim_next answered with {type(rep).__name__}")
        return rep.records, sent

    def _claim_next_items(
        self, max_records: int, wait_s: float, max_bytes: int | None = None
    ) -> list[Claim | HsCompatError]:
        raws, sent = self._claim_next_reply(max_records, wait_s, max_bytes or self._landing_bytes)
        return self._parse(raws, sent)

    def claim_next(self, max_records: int = 1, wait_s: float = 1.0, max_bytes: int | None = None) -> list[Claim]:
        """Lease up to ``max_records`` published records (oldest first), waiting up to ``wait_s`` for one.  The
        producer bounds the answer by its encoded size; a record whose descriptor is malformed is given back
        (counted ``bad_descriptors``) and the others are returned.  Trainer only."""
        items = self._claim_next_items(max_records, wait_s, max_bytes)
        for it in items:
            if isinstance(it, HsCompatError):
                log.warning("claim_next: %s", it)
        return [it for it in items if isinstance(it, Claim)]

    def _settle(self, entries: Sequence[tuple[int, str, str]]) -> list[str] | E.ExportError:
        """Release ``(lease, nonce, outcome)`` entries; the producer's verdict for each, or the error that kept
        it from answering."""
        out: list[str] = []
        try:
            for i in range(0, len(entries), P.MAX_RELEASES):
                part = entries[i : i + P.MAX_RELEASES]
                items = [P.ReleaseItem(lease, nonce, outcome) for lease, nonce, outcome in part]  # type: ignore[arg-type]
                rep = self._call(P.ReleaseReq(items, cap=self._cap()))
                if not isinstance(rep, P.ReleaseReply) or len(rep.results) != len(part):
                    raise E.ProtocolError(f"release of {len(part)} lease(s) answered with {type(rep).__name__}")
                out.extend(rep.results)
        except E.ExportError as e:
            log.info("release failed (%s); the producer's TTL reclaims the slots", e)
            return e
        return out

    def _release(
        self, entries: Sequence[tuple[int, str, str]], claimed_at: float, names: Sequence[str]
    ) -> list[str] | E.ExportError:
        """Release ``entries`` (of records ``names``) claimed at ``claimed_at``.  Far from the leases' deadline
        (``defer_releases``: before half their TTL has passed since the claim was sent) the release is posted and
        its verdict taken as ``released`` at once: no lease claimed then can have expired yet, so no byte read
        under it can be another record's, and the answer (collected by later calls) only confirms it; any other
        answer is counted (``late_verdicts``) and logged.  Otherwise this waits for the producer's verdicts."""
        client = self._client
        ttl = self._hello.lease_ttl_s if self._hello is not None else 0.0
        if (
            not self.defer_releases
            or client is None
            or claimed_at <= 0.0
            or time.monotonic() >= claimed_at + DEFER_FRACTION * ttl
        ):
            return self._settle(entries)
        for i in range(0, len(entries), P.MAX_RELEASES):
            part = entries[i : i + P.MAX_RELEASES]
            items = [P.ReleaseItem(lease, nonce, outcome) for lease, nonce, outcome in part]  # type: ignore[arg-type]
            rid = client.post(P.ReleaseReq(items, cap=self._cap()))
            self._unsettled[rid] = list(names[i : i + P.MAX_RELEASES])
        self.counters["deferred_releases"] += len(entries)
        return ["released"] * len(entries)

    def _reconcile(self) -> None:
        """Check the answers to posted releases that have arrived."""
        client = self._client
        if client is None or not self._unsettled:
            return
        for rid, answer in client.answers():
            names = self._unsettled.pop(rid, None)
            if names is None:
                continue
            if isinstance(answer, HsCompatError):
                self.counters["late_verdicts"] += len(names)
                log.error(
                    "a deferred release of %d record(s) (%s...) failed at the producer: %s; their leases expire "
                    "there (counted expired_claimed) although the records were delivered here",
                    len(names),
                    names[:3],
                    answer,
                )
                continue
            rep = answer[0]
            results = rep.results if isinstance(rep, P.ReleaseReply) else []
            bad: list[tuple[str, str]] = [(n, r) for n, r in zip(names, results, strict=False) if r != "released"]
            bad += [(n, "no answer") for n in names[len(results) :]]
            if bad:
                self.counters["late_verdicts"] += len(bad)
                log.error(
                    "deferred releases answered %s for record(s) %s, delivered here before the answer (their "
                    "leases were claimed less than half a TTL earlier: the producer restarted or its clock jumped?)",
                    sorted({r for _, r in bad}),
                    [n for n, _ in bad][:8],
                )

    def abandon(self, claims: Sequence[Claim]) -> None:
        """Give leases back without reading them (counted ``abandoned`` on both sides; if the producer cannot be
        reached its TTL reclaims them)."""
        live = [c for c in claims if c.producer == self.producer]
        self.counters["abandoned"] += len(claims)
        if live:
            self._settle([(c.lease, c.nonce, "abandoned") for c in live])

    # --- reads ----------------------------------------------------------------------------------------------
    def _check(self, c: Claim) -> None:
        if c.producer != self.producer:
            raise E.StaleMetadataError(
                f"record {c.record_id!r} was leased from producer {c.producer}, now attached to {self.producer}; "
                "the producer restarted and the record is gone"
            )
        pool = self._hello.pool_bytes if self._hello is not None else 0
        if c.offset + c.extent > pool:
            raise E.DescriptorError(
                f"record {c.record_id!r}: descriptor [{c.offset}, {c.offset + c.extent}) lies outside the "
                f"producer's {pool}-byte pool; refusing to read it"
            )

    def _verify(
        self, c: Claim, buf: torch.Tensor, off: int, digest: int | None = None
    ) -> tuple[RecordMeta | HsCompatError, str]:
        """Check the bytes at ``buf[off:]`` (``digest``: their hidden-state checksum, when it was computed while
        they were read): ``(metadata, "delivered")`` or ``(error, outcome)``."""
        algorithm = c.meta.checksum_algorithm
        raw = self._bytes_of(buf)
        if self.verify_checksum:
            got = checksum_bytes(raw[off : off + c.nbytes], algorithm) if digest is None else digest
            if got != c.meta.checksum:
                self.counters["checksum_failures"] += 1
                return (
                    E.ChecksumMismatchError(
                        f"record {c.record_id!r}: {algorithm} of the {c.nbytes} bytes read is {got:#018x}, the "
                        f"producer computed {c.meta.checksum:#018x}; the slot was overwritten or the transfer torn"
                    ),
                    "checksum_failed",
                )
        ids_raw = raw[off + c.ids_offset : off + c.extent]
        if checksum_bytes(ids_raw, algorithm) != c.ids_checksum:
            self.counters["checksum_failures"] += 1
            return (
                E.ChecksumMismatchError(
                    f"record {c.record_id!r}: the {c.meta.shape[0]} token ids read do not match their {algorithm} "
                    "checksum; the slot was overwritten or the transfer torn"
                ),
                "checksum_failed",
            )
        try:
            return P.meta_from_wire(c.meta, _token_ids(ids_raw)), "delivered"
        except E.RecordFormatError as e:
            return e, "abandoned"

    def _bytes_of(self, buf: torch.Tensor) -> memoryview:
        """A byte view of a whole contiguous uint8 buffer (the landing buffer's is kept: slicing it costs less
        than a tensor slice per record)."""
        key = (buf.data_ptr(), buf.numel())
        if key != self._raw_key:
            self._raw, self._raw_key = byte_view(buf), key
        return self._raw

    def _verdict(self, c: Claim, settled: str) -> HsCompatError | None:
        if settled == "released":
            return None
        if settled == "expired":
            self.counters["lease_expired"] += 1
            ttl = self._hello.lease_ttl_s if self._hello is not None else "?"
            return E.LeaseExpiredError(
                f"record {c.record_id!r}: its lease (lease_ttl_s={ttl}) expired before the read was released; the "
                "bytes read may be another record's, so it is not handed out here (the producer hands it out again "
                "while its max_redeliveries last; read faster, or raise lease_ttl_s)"
            )
        return E.StaleMetadataError(
            f"record {c.record_id!r}: the producer does not know lease {c.lease} any more (it restarted?)"
        )

    def read(
        self, claims: Sequence[Claim], copy: bool = True, timeout_s: float | None = None
    ) -> list[CaptureRecord | HsCompatError]:
        """Read claimed records (one transfer per landing-buffer-full), verify each, release each lease with its
        outcome.  Returns one entry per claim: the record, or the named error that failed it."""
        if self._client is None:
            raise E.ExportClosedError("consumer is closed")
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        results: list[CaptureRecord | HsCompatError | None] = [None] * len(claims)
        todo: collections.deque[tuple[int, Claim]] = collections.deque()
        for i, c in enumerate(claims):
            try:
                self._check(c)
                todo.append((i, c))
            except E.StaleMetadataError as e:
                results[i] = e  # a lease of a dead producer: nothing to give back
            except E.ExportError as e:
                results[i] = e
                self.abandon([c])
        if any(c.inline is not None for _, c in todo):
            rest: collections.deque[tuple[int, Claim]] = collections.deque()
            for i, c in todo:
                if c.inline is None:
                    rest.append((i, c))
                else:
                    results[i] = self._read_given(c, c.inline)
            todo = rest
        if self._transport is None:
            for i, c in todo:
                results[i] = self._read_inline(c, deadline)
            return [r if r is not None else E.ExportError("internal: no result") for r in results]
        transport = self._transport
        while todo:
            group: list[tuple[int, Claim, int]] = []
            lend: set[int] = set()
            pending = 0  # landing-buffer bytes promised to records of this group that will be lent
            while todo and len(group) < P.MAX_RELEASES:
                i, c = todo[0]
                off, lent = self._place(c, copy, pending)
                if off is None and not group and (self._landing.lent or self._landing.spill_lent):
                    gc.collect()  # owned records in reference cycles: give their lent space back first
                    off, lent = self._place(c, copy, pending)
                if off is None:
                    break
                if lent:
                    lend.add(i)
                    if not off >> REGION_SHIFT:
                        pending += c.extent
                todo.popleft()
                group.append((i, c, off))
            if not group:
                i, c = todo.popleft()
                busy = (self._held or self._landing.lent) and c.extent <= self._landing_bytes
                cls = E.LandingBufferFullError if busy else E.RecordTooLargeError
                results[i] = cls(
                    f"record {c.record_id!r} needs {c.extent} bytes; the landing buffer has "
                    f"{self._landing_bytes} bytes with {len(self._held)} record(s) held (copy=False) and "
                    f"{self._landing.lent} bytes lent to owned records still alive; release held records, drop "
                    "old records or raise landing_bytes"
                )
                self.abandon([c])
                continue
            try:
                digests = self._transfer(transport, group, deadline)
            except E.ExportError as e:
                self.counters["read_failures"] += len(group)
                for i, c, off in group:
                    results[i] = e
                    if isinstance(e, E.ExportTimeoutError):
                        # the transfer may still complete and write here: never reuse this space (it could be
                        # lent to an owned record, verified and handed out, before the late write lands)
                        self.counters["quarantined_bytes"] += c.extent
                    else:
                        self._landing.free(off, c.extent)
                if not isinstance(e, E.RemoteDisconnectedError | E.StaleMetadataError):
                    self.abandon([c for _, c, _ in group])
                continue
            checked = [
                (i, c, off, *self._verify(c, *self._locate(off), d))
                for (i, c, off), d in zip(group, digests, strict=True)
            ]
            settled = self._release(
                [(c.lease, c.nonce, outcome) for _, c, _, _, outcome in checked],
                min(c.claimed_at for _, c, _, _, _ in checked),
                [c.record_id for _, c, _, _, _ in checked],
            )
            for k, (i, c, off, meta, _) in enumerate(checked):
                bad = settled if isinstance(settled, E.ExportError) else self._verdict(c, settled[k])
                if isinstance(meta, HsCompatError) or bad is not None:
                    self._landing.free(off, c.extent)
                    # an expired lease explains whatever the bytes looked like: it comes first
                    expired = bad if isinstance(bad, E.LeaseExpiredError) else None
                    results[i] = expired or (meta if isinstance(meta, HsCompatError) else bad)
                    continue
                results[i] = self._finish(c, meta, off, copy, i in lend)
        return [r if r is not None else E.ExportError("internal: no result") for r in results]

    def _transfer(
        self, transport: ConsumerTransport, group: Sequence[tuple[int, Claim, int]], deadline: float
    ) -> list[int | None]:
        """Transfer the group's records into the landing buffer; their hidden-state checksums when they were
        computed on the way (verification on, a large read or a transport that checksums as it copies), else
        ``None`` each.

        With verification on, a read of at least ``OVERLAP_MIN_BYTES`` is cut into pieces and each piece is
        checksummed right after it landed, while it is still in cache (``CHECK_PIECE_BYTES``; measured on the
        2-vCPU box over NIXL/UCX loopback: a 64 MiB READ + xxh3 0.76x the bare READ, in 2 MiB pieces 0.87x; over
        NIXL the pieces are posted ``READ_WINDOW`` at a time, see :meth:`_read_checked`).  With
        ``overlap_verification`` the pieces are about an eighth of the read and a reader thread transfers piece
        k + 1 while this thread checksums piece k (it pays only where a core is free)."""
        total = sum(c.extent for _, c, _ in group)
        if not self.verify_checksum or (total < OVERLAP_MIN_BYTES and not hasattr(transport, "read_checked")):
            transport.read([(c.offset, off, c.extent) for _, c, off in group], b"", deadline)
            return [None] * len(group)
        return list(
            self._read_checked(
                transport,
                [(c.offset, off, c.extent, c.nbytes) for _, c, off in group],
                [c.meta.checksum_algorithm for _, c, _ in group],
                deadline,
                overlap=self.overlap_verification,
            )
        )

    def _read_checked(
        self,
        transport: ConsumerTransport,
        items: Sequence[tuple[int, int, int, int]],
        algorithms: Sequence[str],
        deadline: float,
        *,
        overlap: bool = False,
    ) -> list[int]:
        """Read ``(remote, local, nbytes, checked)`` ranges and return the checksum of each one's first ``checked``
        bytes (its own algorithm), taken on the way while the bytes are in cache: over shm by the copy that
        checksums each chunk right after copying it (one algorithm for all), else in ``CHECK_PIECE_BYTES`` reads
        (pieces cut ranges anywhere), each checksummed as soon as it landed, or with ``overlap`` in pieces of
        about an eighth of the read, a reader thread transferring piece k + 1 while this thread checksums piece k.

        With posted reads (NIXL) up to ``READ_WINDOW`` pieces are in flight; they are completed in order on this
        thread, each checksummed as soon as it landed (posting stops while a transport moves bytes as it posts:
        the piece is checksummed while in cache).  On a deadline every posted read is released (the caller
        quarantines the range: a cancelled READ may still land); after any other failure the reads still in flight
        are waited for first (a read still in flight at the deadline turns the failure into a timeout)."""
        shm_checked = getattr(transport, "read_checked", None)
        if shm_checked is not None and len(set(algorithms)) == 1:
            return list(shm_checked(items, algorithms[0], deadline))
        total = sum(n for _, _, n, _ in items)
        size = max(PIECE_MIN_BYTES, min(PIECE_MAX_BYTES, -(-total // 8))) if overlap else CHECK_PIECE_BYTES
        pieces = _pieces([(r, lo, n) for r, lo, n, _ in items], size)
        states = [ChecksumState(a, it[3]) for a, it in zip(algorithms, items, strict=True)]
        land = self._bytes_of(transport.landing)
        spill = self._landing.spill

        def check(piece: list[tuple[int, int, int, int, int]]) -> None:
            for _, lo, n, k, at in piece:
                checked = items[k][3]
                if at < checked:
                    view = land
                    if lo >> REGION_SHIFT:  # a spill arena
                        view, lo = spill[lo >> REGION_SHIFT].view, lo & REGION_MASK
                    states[k].update_bytes(view[lo : lo + min(n, checked - at)])

        if overlap:
            return self._read_overlapped(transport, pieces, check, states, total, deadline)
        post = getattr(transport, "post_read", None)
        if post is None or READ_WINDOW <= 1:  # a transport without posted reads: one piece after another
            for piece in pieces:
                transport.read([(r, lo, n) for r, lo, n, _, _ in piece], b"", deadline)
                check(piece)
            return [st.digest() for st in states]
        wait, release = transport.wait_read, transport.release_read  # type: ignore[attr-defined]
        posted: collections.deque[tuple[Any, list[tuple[int, int, int, int, int]]]] = collections.deque()
        nxt = 0
        try:
            while posted or nxt < len(pieces):
                while nxt < len(pieces) and len(posted) < READ_WINDOW:
                    posted.append((post([(r, lo, n) for r, lo, n, _, _ in pieces[nxt]]), pieces[nxt]))
                    nxt += 1
                    if posted[-1][0].done:  # moved as it was posted (same-host shared memory): checksum it while
                        break  # it is in cache before moving more
                wait(posted[0][0], deadline, PIECE_SPIN_S)
                handle, piece = posted.popleft()
                release(handle)
                check(piece)
        except E.ExportTimeoutError:
            for h, _ in posted:  # the caller quarantines the whole range: a late write lands in space never reused
                release(h)
            raise
        except BaseException as e:
            # the caller frees the range after any other failure: every posted READ must be over before that
            late: E.ExportTimeoutError | None = None
            for h, _ in posted:
                if late is None:
                    try:
                        wait(h, deadline, PIECE_SPIN_S)
                    except E.ExportTimeoutError as t:
                        late = t
                    except E.ExportError:
                        pass  # over: it failed
                release(h)
            if late is not None and isinstance(e, E.ExportError):  # the caller quarantines the range instead
                raise E.ExportTimeoutError(
                    f"a read of {total} bytes failed ({e}); its other pieces were still in flight at the deadline"
                ) from e
            raise
        return [st.digest() for st in states]

    def _read_overlapped(
        self,
        transport: ConsumerTransport,
        pieces: list[list[tuple[int, int, int, int, int]]],
        check: Any,
        states: list[ChecksumState],
        total: int,
        deadline: float,
    ) -> list[int]:
        reader = self._reader_pool()
        fut = reader.submit(transport.read, [(r, lo, n) for r, lo, n, _, _ in pieces[0]], b"", deadline)
        try:
            for p, piece in enumerate(pieces):
                fut.result(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
                fut = None
                if p + 1 < len(pieces):
                    nxt = [(r, lo, n) for r, lo, n, _, _ in pieces[p + 1]]
                    fut = reader.submit(transport.read, nxt, b"", deadline)
                check(piece)
        except TimeoutError:
            raise E.ExportTimeoutError(f"a read of {total} bytes is still in progress past its deadline") from None
        finally:
            if fut is not None:  # never leave a transfer writing into landing space that is about to be freed
                fut.exception()
        return [st.digest() for st in states]

    def _reader_pool(self) -> Any:
        if self._reader is None:
            from concurrent.futures import ThreadPoolExecutor

            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsx-reader")
        return self._reader

    def _read_inline(self, c: Claim, deadline: float) -> CaptureRecord | HsCompatError:
        """A ticket holder's read: the record's bytes through the control plane, in bounded chunks."""
        buf = torch.empty(c.extent, dtype=torch.uint8)
        view = byte_view(buf)
        limit = self._hello.max_read_bytes if self._hello is not None else P.MAX_READ_BYTES
        step = max(PAGE, min(limit, self._budget() - P.REPLY_OVERHEAD))
        pos = 0
        try:
            while pos < c.extent:
                n = min(step, c.extent - pos)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise E.ExportTimeoutError(f"record {c.record_id!r}: read past its deadline at byte {pos}")
                rep = self._call(P.ReadReq(c.lease, c.nonce, pos, n, cap=self._cap()), left)
                if not isinstance(rep, P.ReadReply) or len(rep.data) != n:
                    raise E.ProtocolError(f"read of {n} bytes answered with {type(rep).__name__}")
                view[pos : pos + n] = rep.data
                pos += n
        except E.LeaseExpiredError as e:
            self.counters["lease_expired"] += 1
            return e
        except E.ExportError as e:
            self.counters["read_failures"] += 1
            self.abandon([c])
            return e
        return self._settle_owned(c, buf)

    def _read_given(self, c: Claim, data: bytes) -> CaptureRecord | HsCompatError:
        """A record whose bytes came in its claim's answer: checked and released as :meth:`_settle_owned` does."""
        got = self._settle_owned(c, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if isinstance(got, CaptureRecord):
            self.counters["inline_records"] += 1
        return got

    def _settle_owned(self, c: Claim, buf: torch.Tensor) -> CaptureRecord | HsCompatError:
        """Verify a record read whole into ``buf`` (memory the record will own), release its lease with the
        outcome (posted as :meth:`_release` decides for the trainer; a ticket holder waits for the verdict, so one
        that exits right after its fetch leaves no lease behind), and return the record or what failed it."""
        meta, outcome = self._verify(c, buf, 0)
        entry = [(c.lease, c.nonce, outcome)]
        settled = self._release(entry, c.claimed_at, [c.record_id]) if self._ticket is None else self._settle(entry)
        bad = settled if isinstance(settled, E.ExportError) else self._verdict(c, settled[0])
        if isinstance(bad, E.LeaseExpiredError):
            return bad
        if isinstance(meta, HsCompatError):
            return meta
        if bad is not None:
            return bad
        self.counters["records"] += 1
        self.counters["bytes"] += c.nbytes
        return CaptureRecord(meta, buf[: c.nbytes].view(meta.torch_dtype).view(meta.shape))

    def _finish(self, c: Claim, meta: RecordMeta, off: int, copy: bool, lend: bool) -> CaptureRecord:
        """The record read at local offset ``off``: held (``copy=False``), lent its space (``lend``, decided by
        :meth:`_place`) or copied out."""
        buf, at = self._locate(off)
        self.counters["records"] += 1
        self.counters["bytes"] += c.nbytes
        if copy and lend:
            return CaptureRecord(meta, self._lend(buf, at, off, c.extent, c.nbytes, meta))
        t = buf[at : at + c.nbytes].view(meta.torch_dtype).view(meta.shape)
        if not copy:
            rec = CaptureRecord(meta, t)
            self._held[id(rec)] = (rec, off, c.extent)
        else:
            rec = CaptureRecord(meta, _copied(t))
            self._landing.free(off, c.extent)
        return rec

    def _lend(
        self, region: torch.Tensor, at: int, off: int, extent: int, nbytes: int, meta: RecordMeta
    ) -> torch.Tensor:
        """An owned tensor over the landing space at ``off`` (``at`` in ``region``: the landing buffer or a spill
        arena): no copy, no page faults.  Its storage is exactly the record's bytes (not the whole buffer); the
        space is given back when the storage is freed (until then the finalizer keeps ``region`` alive)."""
        buf = (ctypes.c_char * nbytes).from_address(region.data_ptr() + at)
        weakref.finalize(buf, _give_back, self._landing.deferred, off, extent, region)
        if off >> REGION_SHIFT:
            self._landing.spill_lent += extent
        else:
            self._landing.lent += extent
        return torch.frombuffer(buf, dtype=torch.uint8).view(meta.torch_dtype).view(meta.shape)

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
        its memory (lent landing space or a copy, see the module docstring); ``copy=False``: a view valid until
        :meth:`release`."""
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
                except E.ProtocolError:
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

    # --- batches --------------------------------------------------------------------------------------------
    def next_batches(
        self,
        max_records: int = 256,
        wait_s: float = 1.0,
        copy: bool = True,
        timeout_s: float | None = None,
    ) -> list[RecordBatch | HsCompatError]:
        """Claim up to ``max_records`` published records (oldest first, trainer only), read, verify and release
        them together; the records that passed come back as :class:`RecordBatch` objects (one per schema among
        them, usually one), each failed record as its own named error after them.  Empty when nothing was
        published within ``wait_s``.

        One claim message, one transfer request per batch (one descriptor per record for small records, two for
        large ones) and one release message; no per-record tensor or :class:`RecordMeta` is made.  ``copy``: as
        for :meth:`fetch` (``False``: the batch's tensors view the landing buffer until :meth:`release`)."""
        raws, claimed_at = self._claim_next_reply(max_records, wait_s, max(PAGE, self._landing.free_bytes() // 2))
        if not raws:
            return []
        return self._batches(raws, claimed_at, copy, timeout_s, [])

    def fetch_batch(
        self,
        record_ids: Sequence[str],
        copy: bool = True,
        timeout_s: float | None = None,
        wait_s: float = 0.0,
    ) -> list[RecordBatch | HsCompatError]:
        """Claim, read, verify and release the records ``record_ids`` together (trainer only): what
        :meth:`fetch` does for one id, with one claim message per ``MAX_CLAIM_IDS`` (32) ids, one transfer
        request and one release for all of them (so the claim's round trip is paid once, not per record).

        Returns, as :meth:`next_batches` does, the records that passed as :class:`RecordBatch` objects (one per
        schema, records in the order of ``record_ids``; ``batch.record_ids`` names them) and then one named error
        per id that failed: :class:`UnknownRecordError` for an id not published (after ``wait_s``, see
        :meth:`claim`), :class:`RecordFailedError` for one the producer knows failed, the control plane's error
        (a timeout...) for the ids whose claim it cut off, and the read's or the verification's error otherwise.
        Records claimed are read at once, not held while the ids still missing
        are waited for: those that turn up later come in batches of their own.  An id given twice is fetched
        once."""
        if self._transport is None:
            raise E.ExportConfigError(
                "fetch_batch needs the trainer token (a ticket holder fetches its one record with fetch())"
            )
        ids = list(dict.fromkeys(record_ids))
        for rid in ids:
            if not isinstance(rid, str) or not 0 < len(rid) <= P.MAX_ID_CHARS:
                raise E.ExportConfigError(f"record ids must be strings of 1..{P.MAX_ID_CHARS} characters: {rid!r}")
        order = {rid: k for k, rid in enumerate(ids)}
        out: list[RecordBatch | HsCompatError] = []
        errors: list[HsCompatError] = []
        until = time.monotonic() + wait_s
        pause = 0.005
        while ids:  # a round: claim every id still pending, then read what was claimed at once
            raws: list[bytes] = []
            claimed_at = 0.0
            missing: list[tuple[str, str]] = []
            again: list[str] = []
            cut: E.ExportError | None = None
            for i in range(0, len(ids), P.MAX_CLAIM_IDS):
                sent = time.monotonic()
                req = P.ClaimReq(ids[i : i + P.MAX_CLAIM_IDS], max_reply_bytes=self._budget())
                try:
                    rep = self._call(req, timeout_s)
                    if not isinstance(rep, P.ClaimReply):
                        raise E.ProtocolError(f"claim answered with {type(rep).__name__}")
                except E.ExportError as e:  # this and the later ids fail with it; what was claimed is still read
                    cut = e
                    errors.extend([e] * (len(ids) - i))
                    break
                if rep.records:
                    raws.extend(rep.records)
                    claimed_at = claimed_at or sent  # the oldest claim bounds when releases may be posted
                for err in rep.errors:
                    if err.code == "failed_record":
                        errors.append(E.RecordFailedError(f"record {err.record_id!r} will not be published: "
                                                          f"{err.message}"))  # fmt: skip
                    elif err.message == P.REPLY_FULL:
                        again.append(err.record_id)
                    else:
                        missing.append((err.record_id, err.message))
            if raws:  # read now: a claimed lease must not age while the other ids are waited for
                got = self._batches(raws, claimed_at, copy, timeout_s, [], order)
                out.extend(g for g in got if isinstance(g, RecordBatch))
                errors.extend(g for g in got if not isinstance(g, RecordBatch))
            if cut is not None:  # no more rounds: the control plane failed
                errors.extend([cut] * len(again))
                errors.extend(E.UnknownRecordError(message) for _, message in missing)
                break
            if missing and time.monotonic() + pause <= until:
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
                again.extend(rid for rid, _ in missing)
            else:
                errors.extend(E.UnknownRecordError(message) for _, message in missing)
            ids = sorted(again, key=order.__getitem__)
        return out + errors

    def _batches(
        self,
        raws: list[bytes],
        claimed_at: float,
        copy: bool,
        timeout_s: float | None,
        errors: list[HsCompatError],
        order: Mapping[str, int] | None = None,
        decoded: list[P.RecordDesc] | None = None,
    ) -> list[RecordBatch | HsCompatError]:
        """Decode (unless ``decoded``: ``raws`` decoded already), group by schema, read, verify and release claimed
        descriptors: batches, then errors."""
        try:
            descs = decoded if decoded is not None else P.decode_descriptors(raws)
        except E.ProtocolError:  # one of them is bad: learn which, one by one
            descs = []
            bad: list[tuple[int, str, str]] = []
            for raw in raws:
                try:
                    descs.append(P.decode_descriptor(raw))
                except E.ProtocolError as e:
                    errors.append(self._refused(raw, e, bad))
            self._give_back_refused(bad)
        if order is not None:
            descs.sort(key=lambda d: order.get(d.record_id, len(order)))
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        out: list[RecordBatch | HsCompatError] = []
        groups: list[list[P.RecordDesc]] = []  # by schema, in order of first appearance (usually one)
        last: list[P.RecordDesc] = []
        for d in descs:
            if not last or not _same_schema(d.meta, last[0].meta):
                last = next((g for g in groups if _same_schema(d.meta, g[0].meta)), [])
                if not last:
                    groups.append(last)
            last.append(d)
        for group in groups:
            out.extend(self._read_group(group, copy, deadline, errors, claimed_at))
        return out + errors

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

    def _schema(self, d: P.RecordDesc) -> BatchSchema:
        """The batch schema of a descriptor's record, checked once per distinct schema (a bad one fails every
        record of it: :class:`RecordFormatError`)."""
        m = d.meta
        if m.checksum_algorithm not in CHECKSUM_ALGORITHMS:
            raise E.RecordFormatError(
                f"unknown checksum algorithm {m.checksum_algorithm!r}; expected one of {CHECKSUM_ALGORITHMS} "
                "(producer and consumer run different vllm-hs-compat releases?)"
            )
        if m.schema_version not in SCHEMA_VERSIONS:
            raise E.RecordFormatError(
                f"record schema version {m.schema_version} is not supported (this build reads "
                f"{list(SCHEMA_VERSIONS)}); "
                "upgrade vllm-hs-compat on the side that reads it"
            )
        if len(m.layer_ids) != m.shape[1] or any(a >= b for a, b in zip(m.layer_ids, m.layer_ids[1:], strict=False)):
            raise E.RecordFormatError(f"layer ids {list(m.layer_ids)[:8]}... are not {m.shape[1]} ascending ids")
        dtype_itemsize(m.dtype)
        return BatchSchema(
            layer_ids=tuple(m.layer_ids),
            pre_norm=m.pre_norm,
            dtype=m.dtype,
            planes=m.shape[1],
            hidden=m.shape[2],
            checksum_algorithm=m.checksum_algorithm,
            vllm_version=m.vllm_version,
            adapter=m.adapter,
            schema_version=m.schema_version,
        )

    def _read_group(
        self,
        descs: list[P.RecordDesc],
        copy: bool,
        deadline: float,
        errors: list[HsCompatError],
        claimed_at: float = 0.0,
    ) -> list[RecordBatch]:
        """Check, read, verify and release records of one schema; their batches (several when the landing
        buffer cannot hold them at once).  Failed records' errors are appended to ``errors``."""
        try:
            schema = self._schema(descs[0])
        except E.RecordFormatError as e:
            bad: list[tuple[int, str, str]] = []
            errors.extend(self._refused(d, e, bad) for d in descs)
            self._give_back_refused(bad)
            return []
        rb = schema.planes * schema.hidden * dtype_itemsize(schema.dtype)
        pool = self._hello.pool_bytes if self._hello is not None else 0
        producer = self.producer
        # every nonce is 16 characters (the decoder checks lengths): all hex together, or check them one by one
        all_hex = P.is_hex("".join([d.nonce for d in descs]))
        is_nonce = P.is_nonce
        good: list[P.RecordDesc] = []
        refused: list[tuple[int, str, str]] = []
        for d in descs:
            m, nb = d.meta, d.nbytes
            t = m.shape[0]
            ids_at = (nb + 7) // 8 * 8
            fits = (
                d.producer == producer
                and m.request_id == d.record_id
                and (all_hex or is_nonce(d.nonce))
                and nb == t * rb
                and d.ids_offset == ids_at
                and d.extent == ids_at + 4 * t
                and d.offset + d.extent <= pool
            )
            if fits and m.plain and (m.schema_version >= 2 or not (m.sample_id or m.source)):
                good.append(d)
                continue
            try:  # name what is wrong: the per-record checks of fetch() (the sample fields' among them)
                c = Claim.from_desc(d)
                self._check(c)
                if fits:  # only its sample fields needed checking against the record, and they passed
                    good.append(d)
                    continue
                raise E.RecordFormatError(f"record {d.record_id!r}: descriptor disagrees with its batch schema")
            except E.StaleMetadataError as e:
                errors.append(e)  # a lease of another producer instance: nothing to give back
            except (E.RecordFormatError, E.DescriptorError) as e:
                errors.append(self._refused(d, e, refused))
        self._give_back_refused(refused)
        out: list[RecordBatch] = []
        todo = [good] if good else []
        while todo:
            part = todo.pop()
            got = self._read_part(schema, rb, part, copy, deadline, errors, claimed_at)
            if isinstance(got, RecordBatch):
                out.append(got)
            elif got is not None:  # did not fit the landing buffer: in halves, first half first
                half = len(part) // 2
                todo.extend([part[half:], part[:half]])
        return out

    def _read_part(
        self,
        schema: BatchSchema,
        rb: int,
        descs: list[P.RecordDesc],
        copy: bool,
        deadline: float,
        errors: list[HsCompatError],
        claimed_at: float = 0.0,
    ) -> RecordBatch | bool | None:
        """One batch: ``RecordBatch``, or ``True`` (split it: the landing buffer cannot hold it now), or ``None``
        (every record failed; the errors are in ``errors``)."""
        transport = self._transport
        if transport is None:
            raise E.ExportClosedError("consumer has no transport (a ticket holder cannot stream batches)")
        n = len(descs)
        lengths_l = [d.meta.shape[0] for d in descs]
        total = sum(lengths_l)
        hidden_bytes = total * rb
        # shm copies each part with a memmove anyway: straight into the packed layout, whatever the size
        direct = transport.kind == "shm" or hidden_bytes >= n * BATCH_DIRECT_MIN_BYTES
        if direct:  # [hidden states of every record][token ids of every record], read in place
            ids_at = -(-hidden_bytes // 8) * 8
            size = ids_at + 4 * total
        else:  # each record read whole (one descriptor), then packed into owned memory
            slots = [-(-d.extent // 8) * 8 for d in descs]
            size = sum(slots)
        off = self._landing.alloc(size)
        if off is None and self._landing.lent:
            gc.collect()  # owned records in reference cycles: give their lent space back first
            off = self._landing.alloc(size)
        if off is None:
            if n > 1:
                return True
            d = descs[0]
            busy = (self._held or self._landing.lent) and size <= self._landing_bytes
            cls = E.LandingBufferFullError if busy else E.RecordTooLargeError
            errors.append(
                cls(
                    f"record {d.record_id!r} needs {size} bytes; the landing buffer has {self._landing_bytes} bytes "
                    f"with {len(self._held)} record(s) or batch(es) held (copy=False) and {self._landing.lent} bytes "
                    "lent to owned records still alive; release held records, drop old ones or raise landing_bytes"
                )
            )
            self._abandon_leases(descs)
            return None
        landing = transport.landing
        cu_l = [0] * (n + 1)
        acc = 0
        for k, t in enumerate(lengths_l):
            acc += t
            cu_l[k + 1] = acc
        if direct:
            items = [(d.offset, off + cu_l[k] * rb, d.nbytes) for k, d in enumerate(descs)]
            items += [(d.offset + d.ids_offset, off + ids_at + 4 * cu_l[k], 4 * d.meta.shape[0])
                      for k, d in enumerate(descs)]  # fmt: skip
        else:
            places = [0] * n
            at = off
            for k, s in enumerate(slots):
                places[k] = at
                at += s
            items = [(d.offset, places[k], d.extent) for k, d in enumerate(descs)]
        algorithm = schema.checksum_algorithm
        verify = self.verify_checksum
        digests: list[int] | None = None  # the hidden states' checksums, when taken on the way
        try:
            if direct and verify and hidden_bytes >= OVERLAP_MIN_BYTES:  # checksummed on the way, as a large fetch()
                ranges = [(r, lo, m, m) for r, lo, m in items[:n]] + [(r, lo, m, 0) for r, lo, m in items[n:]]
                digests = self._read_checked(transport, ranges, [algorithm] * len(ranges), deadline)[:n]
            else:
                transport.read(items, b"", deadline)
        except E.ExportError as e:
            self.counters["read_failures"] += n
            if isinstance(e, E.ExportTimeoutError):
                self.counters["quarantined_bytes"] += size  # a late write may still land there: never reuse it
            else:
                self._landing.free(off, size)
            errors.extend([e] * n)
            if not isinstance(e, E.RemoteDisconnectedError | E.StaleMetadataError):
                self._abandon_leases(descs)
            return None
        lengths = torch.tensor(lengths_l, dtype=torch.int64)
        digest = checksum_function(algorithm)
        outcomes: list[tuple[int, str, str]] = []
        failed: dict[int, HsCompatError] = {}
        if direct:
            hidden = landing[off : off + hidden_bytes]
            ids32 = landing[off + ids_at : off + ids_at + 4 * total].view(torch.int32)
        else:  # packed into owned memory by buffer slice copies (a C memcpy each; no torch op per record)
            hidden = torch.empty(hidden_bytes, dtype=torch.uint8)
            ids32 = torch.empty(total, dtype=torch.int32)
            if not _pack_uniform(landing, off, descs, slots[0], hidden, ids32):
                hout, iout, lv = byte_view(hidden), byte_view(ids32), self._bytes_of(landing)
                for k, d in enumerate(descs):
                    a, b, at = cu_l[k], cu_l[k + 1], places[k]
                    hout[a * rb : b * rb] = lv[at : at + d.nbytes]
                    iout[4 * a : 4 * b] = lv[at + d.ids_offset : at + d.extent]
        # verify: the bytes handed out, record by record
        hv, iv = byte_view(hidden), byte_view(ids32)
        for k, d in enumerate(descs):
            a, b = cu_l[k], cu_l[k + 1]
            if verify and (digest(hv[a * rb : b * rb]) if digests is None else digests[k]) != d.meta.checksum:
                failed[k] = E.ChecksumMismatchError(
                    f"record {d.record_id!r}: {algorithm} of the {d.nbytes} bytes read does not match the "
                    "producer's checksum; the slot was overwritten or the transfer torn"
                )
            elif digest(iv[4 * a : 4 * b]) != d.ids_checksum:
                failed[k] = E.ChecksumMismatchError(
                    f"record {d.record_id!r}: the {b - a} token ids read do not match their {algorithm} checksum; "
                    "the slot was overwritten or the transfer torn"
                )
            outcomes.append((d.lease, d.nonce, "checksum_failed" if k in failed else "delivered"))
        self.counters["checksum_failures"] += len(failed)
        settled = self._release(outcomes, claimed_at, [d.record_id for d in descs])
        if isinstance(settled, E.ExportError):
            self._landing.free(off, size)
            errors.extend([settled] * n)
            return None
        for k, d in enumerate(descs):
            verdict = settled[k]
            if verdict != "released":  # an expired lease explains whatever the bytes looked like: it comes first
                failed[k] = self._verdict(Claim.from_desc(d), verdict) or failed.get(k) or E.ExportError("internal")
        errors.extend(failed[k] for k in sorted(failed))
        if len(failed) == n:
            self._landing.free(off, size)
            return None
        token_ids = ids32.to(torch.int64).bitwise_and_(0xFFFFFFFF)
        keep = descs
        if failed:  # rare: drop the failed records' rows (a copy; the landing space is free at once)
            kept = [k for k in range(n) if k not in failed]
            rows = torch.cat([torch.arange(cu_l[k], cu_l[k + 1], dtype=torch.int64) for k in kept])
            hidden = hidden.view(-1, rb).index_select(0, rows).view(-1)
            token_ids = token_ids.index_select(0, rows)
            keep = [descs[k] for k in kept]
            lengths = lengths.index_select(0, torch.tensor(kept, dtype=torch.int64))
            self._landing.free(off, size)
        elif not direct:
            self._landing.free(off, size)  # packed into owned memory
        cu = torch.zeros(len(keep) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=cu[1:])
        hs = hidden.view(schema.torch_dtype).view(-1, schema.planes, schema.hidden)
        batch = RecordBatch(
            schema,
            tuple(d.record_id for d in keep),
            hs,
            token_ids,
            cu,
            torch.tensor([d.meta.start for d in keep], dtype=torch.int64),
            torch.tensor([d.meta.num_prompt_tokens for d in keep], dtype=torch.int64),
            tuple(d.meta.checksum for d in keep),
            samples=None
            if all(d.meta.plain and not (d.meta.sample_id or d.meta.source) for d in keep)
            else tuple(d.meta.sample() for d in keep),
        )
        self.counters["records"] += len(keep)
        self.counters["bytes"] += sum(d.nbytes for d in keep)
        self.counters["batches"] += 1
        if direct and not failed:
            if not copy:
                self._held[id(batch)] = (batch, off, size)
            elif self._landing.lent + size <= self.lend_bytes and self._landing.free_bytes() >= size + PAGE:
                buf = (ctypes.c_char * hidden_bytes).from_address(landing.data_ptr() + off)
                weakref.finalize(buf, _give_back, self._landing.deferred, off, size, landing)
                self._landing.lent += size
                flat = torch.frombuffer(buf, dtype=torch.uint8)
                batch.hidden_states = flat.view(schema.torch_dtype).view(-1, schema.planes, schema.hidden)
            else:
                batch.hidden_states = _copied(hs)
                self._landing.free(off, size)
        return batch

    def _abandon_leases(self, descs: Sequence[P.RecordDesc]) -> None:
        self.counters["abandoned"] += len(descs)
        self._settle([(d.lease, d.nonce, "abandoned") for d in descs])

    # --- lifecycle ------------------------------------------------------------------------------------------
    def settle_pending(self, timeout_s: float | None = None) -> int:
        """Wait until the producer has answered every posted release (or ``timeout_s``, default the consumer's
        timeout); returns how many are still unanswered.  Not needed for correctness (see :meth:`_release`):
        for a caller that wants the producer's ledger settled now, e.g. before reading its stats."""
        client = self._client
        if client is None:
            return 0
        client.collect(self.timeout_s if timeout_s is None else timeout_s)
        self._reconcile()
        return sum(len(v) for v in self._unsettled.values())

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
        if self._client is not None:
            if self._unsettled:
                try:
                    self._client.collect(CLOSE_COLLECT_S)
                    self._reconcile()
                except HsCompatError as e:
                    log.info("collecting the answers to posted releases: %s", e)
                left = sum(len(v) for v in self._unsettled.values())
                if left:
                    self.counters["unanswered_releases"] += left
                    log.warning("%d posted release(s) unanswered at close; their leases expire at the producer", left)
                self._unsettled.clear()
            self._client.close()
            if self._gate_client is not None and self._gate_client is not self._client:
                self._gate_client.close()
            self._client = None
            self._gate_client = None
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
