"""The landing: the consumer's data transport and the space records land in.

:class:`Landing` (the component the consumer holds) owns the transport, made for the kind of pool the producer
describes (NIXL, or the ``/dev/shm`` ring), the landing space and the records held with ``copy=False``.  The space
is :class:`_Landing`: the landing buffer (region 0) and the spill arenas past it, in pages; it allocates and frees,
places a claim (its record lent the space, or copied out afterwards), locates a local offset in its buffer, lends
space to owned tensors (given back when they are garbage collected) and names the error of a record that does not
fit.
"""

from __future__ import annotations

import collections
import ctypes
import weakref
from collections.abc import Callable

import torch

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.checksums import byte_view
from vllm_hs_compat.core.records import CaptureRecord
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export.batch import RecordBatch
from vllm_hs_compat.export.nixl_backend import NixlConsumerTransport, UcxSettings
from vllm_hs_compat.export.shm import ShmConsumerTransport
from vllm_hs_compat.export.transport import REGION_MASK, REGION_SHIFT, ConsumerTransport, host_buffer

#: the landing space's unit of allocation
PAGE = 4096
#: An owned record smaller than this is copied (malloc'd memory, already faulted in: a copy costs about what
#: lending costs), so small records a caller keeps do not fragment the landing buffer.
LEND_MIN_BYTES = 64 << 10
#: Spill arenas (see :class:`_Landing`) are at least a quarter of the landing buffer and a multiple of this.
SPILL_ROUND_BYTES = 2 << 20


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
        self.nbytes = nbytes
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
        """Take ``buf`` (registered with the transport as region ``k``) as a spill arena."""
        self.spill[k] = _Arena(buf)
        self.spill_bytes += self.spill[k].pages * PAGE

    def free(self, offset: int, nbytes: int) -> None:
        """Give back the space of ``nbytes`` at local offset ``offset`` (any region)."""
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

    def spill_alloc(self, nbytes: int, limit: int, transport: ConsumerTransport | None) -> int | None:
        """Space for an owned record in a spill arena: an existing one, else a new one (registered with
        ``transport``) while the arenas stay within ``limit`` bytes; ``None`` otherwise."""
        off = self.alloc_spill(nbytes)
        if off is not None or transport is None:
            return off
        need = -(-nbytes // PAGE) * PAGE
        size = max(-(-nbytes // SPILL_ROUND_BYTES) * SPILL_ROUND_BYTES, self.nbytes // 4 // PAGE * PAGE)
        room = limit - self.spill_bytes
        size = min(size, room // PAGE * PAGE)
        if size < need:
            return None
        buf = host_buffer(size)  # zeroed: its pages are touched once, here, not on every record
        k = transport.add_region(buf)
        self.add_arena(k, buf)
        return self.alloc_spill(nbytes)

    def place(
        self,
        extent: int,
        nbytes: int,
        copy: bool,
        pending: int,
        lend_limit: int,
        spill_limit: int,
        transport: ConsumerTransport | None,
    ) -> tuple[int | None, bool]:
        """Where a claim of ``extent`` bytes (``nbytes`` of hidden states) lands and whether its record will be
        lent that space (``copy=True``, large records): the landing buffer while lending stays within
        ``lend_limit`` (``pending``: bytes of it already promised to records of this read) and leaves room for
        another record of this size, else a spill arena (within ``spill_limit``), else the landing buffer with a
        copy afterwards."""
        if copy and nbytes >= LEND_MIN_BYTES:
            self._drain()
            pages = -(-extent // PAGE) * PAGE
            if self.lent + pending + extent <= lend_limit and self.free_bytes() - pages >= extent + PAGE:
                off = self.alloc(extent)
                if off is not None:
                    return off, True
            if spill_limit and lend_limit:  # (lend_fraction=0: owned records are always copies)
                off = self.spill_alloc(extent, spill_limit, transport)
                if off is not None:
                    return off, True
        return self.alloc(extent), False

    def locate(self, off: int, transport: ConsumerTransport | None) -> tuple[torch.Tensor, int]:
        """The buffer a local offset lies in (the landing buffer, ``transport.landing``, or a spill arena) and
        the offset in it."""
        k = off >> REGION_SHIFT
        if k == 0:
            if transport is None:
                raise E.ExportClosedError("consumer is closed")
            return transport.landing, off
        return self.spill[k].buf, off & REGION_MASK

    def lend(self, region: torch.Tensor, at: int, off: int, extent: int, nbytes: int) -> torch.Tensor:
        """An owned byte tensor over the ``nbytes`` at local offset ``off`` (``at`` in ``region``: the landing
        buffer or a spill arena): no copy, no page faults.  Its storage is exactly those bytes (not the whole
        buffer); the ``extent`` bytes of space are given back when the storage is freed (until then the
        finalizer keeps ``region`` alive)."""
        buf = (ctypes.c_char * nbytes).from_address(region.data_ptr() + at)
        weakref.finalize(buf, _give_back, self.deferred, off, extent, region)
        if off >> REGION_SHIFT:
            self.spill_lent += extent
        else:
            self.lent += extent
        return torch.frombuffer(buf, dtype=torch.uint8)

    def no_room(self, record_id: str, size: int, held: int, batches: bool) -> HsCompatError:
        """The error of a record that needs ``size`` bytes the landing buffer does not have (``held``: records,
        or with ``batches`` records or batches, held with ``copy=False``): full for now, or too large ever."""
        busy = (held or self.lent) and size <= self.nbytes
        cls = E.LandingBufferFullError if busy else E.RecordTooLargeError
        if batches:
            return cls(
                f"record {record_id!r} needs {size} bytes; the landing buffer has {self.nbytes} bytes "
                f"with {held} record(s) or batch(es) held (copy=False) and {self.lent} bytes "
                "lent to owned records still alive; release held records, drop old ones or raise landing_bytes"
            )
        return cls(
            f"record {record_id!r} needs {size} bytes; the landing buffer has "
            f"{self.nbytes} bytes with {held} record(s) held (copy=False) and "
            f"{self.lent} bytes lent to owned records still alive; release held records, drop "
            "old records or raise landing_bytes"
        )


class Landing:
    """The consumer's data transport and its landing space (one owner of both): the transport made for the
    producer's kind of pool (:meth:`renew`), the pages records land in and are lent from, and the records or
    batches held with ``copy=False`` until :meth:`release`.

    ``lend_limit`` (``lend_fraction`` of the landing buffer): how much of it owned records (``copy=True``) may keep;
    past it, or while the space left free would no longer hold another record of that size, an owned record is read
    into a spill arena (up to ``spill_limit`` bytes of them; 0: none) or copied out."""

    def __init__(
        self, nbytes: int, lend_fraction: float, spill_bytes: int | None, ucx: UcxSettings | None, shm_dir: str
    ) -> None:
        if nbytes < PAGE or nbytes % PAGE:
            raise E.ExportConfigError(f"landing_bytes must be a positive multiple of {PAGE}, found {nbytes}")
        if not 0.0 <= lend_fraction <= 1.0:
            raise E.ExportConfigError(f"lend_fraction must be in [0, 1], found {lend_fraction!r}")
        if spill_bytes is None:
            spill_bytes = 4 * nbytes
        if spill_bytes < 0:
            raise E.ExportConfigError(f"spill_bytes must be >= 0 (0: no spill arenas), found {spill_bytes!r}")
        self.nbytes = nbytes
        self.lend_limit = int(nbytes * lend_fraction)
        self.spill_limit = spill_bytes
        self._ucx = ucx
        self._shm_dir = shm_dir
        self.transport: ConsumerTransport | None = None
        self.space = self._new_space()
        #: records and batches read with ``copy=False``, by ``id``: (the object, local offset, extent)
        self.held: dict[int, tuple[CaptureRecord | RecordBatch, int, int]] = {}
        self._raw, self._raw_key = memoryview(b""), (0, 0)

    def _new_space(self) -> _Landing:
        space = _Landing(self.nbytes)
        space.on_drop = self._drop_region
        return space

    def _drop_region(self, k: int) -> None:
        if self.transport is not None:
            self.transport.drop_region(k)

    def renew(self, kind: str) -> ConsumerTransport:
        """A new transport of ``kind`` (``"nixl"`` or ``"shm"``) with its own landing buffer, replacing any earlier
        one (records lent from the old buffers keep them)."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None
            self.space = self._new_space()
        if kind == "nixl":
            self.transport = NixlConsumerTransport(self.nbytes, self._ucx)
        else:
            self.transport = ShmConsumerTransport(self.nbytes, self._shm_dir)
        return self.transport

    # --- the space ------------------------------------------------------------------------------------------
    @property
    def lent(self) -> int:
        """Bytes of the landing buffer lent to owned records still alive."""
        return self.space.lent

    @property
    def spill_lent(self) -> int:
        """Bytes of the spill arenas lent to owned records still alive."""
        return self.space.spill_lent

    def alloc(self, nbytes: int) -> int | None:
        """Space in the landing buffer (region 0): its local offset, or ``None``."""
        return self.space.alloc(nbytes)

    def free(self, offset: int, nbytes: int) -> None:
        """Give back the space of ``nbytes`` at local offset ``offset`` (any region)."""
        self.space.free(offset, nbytes)

    def free_bytes(self) -> int:
        """Free bytes of the landing buffer (region 0)."""
        return self.space.free_bytes()

    def place(self, extent: int, nbytes: int, copy: bool, pending: int) -> tuple[int | None, bool]:
        """Where a claim of ``extent`` bytes lands and whether its record will be lent that space (see
        :meth:`_Landing.place`; ``pending``: landing-buffer bytes already promised to records of this read)."""
        return self.space.place(extent, nbytes, copy, pending, self.lend_limit, self.spill_limit, self.transport)

    def locate(self, off: int) -> tuple[torch.Tensor, int]:
        """The buffer a local offset lies in and the offset in it."""
        return self.space.locate(off, self.transport)

    def arena_view(self, k: int) -> memoryview:
        """The byte view of spill arena ``k``."""
        return self.space.spill[k].view

    def lend(self, region: torch.Tensor, at: int, off: int, extent: int, nbytes: int) -> torch.Tensor:
        """An owned byte tensor over the space at ``off`` (see :meth:`_Landing.lend`)."""
        return self.space.lend(region, at, off, extent, nbytes)

    def lendable(self, size: int) -> bool:
        """Whether ``size`` more bytes of the landing buffer may be lent (the share, and room left for another)."""
        return self.space.lent + size <= self.lend_limit and self.space.free_bytes() >= size + PAGE

    def no_room(self, record_id: str, size: int, batches: bool) -> HsCompatError:
        """The error of a record that needs ``size`` bytes the landing buffer does not have."""
        return self.space.no_room(record_id, size, len(self.held), batches)

    def bytes_of(self, buf: torch.Tensor) -> memoryview:
        """A byte view of a whole contiguous uint8 buffer (the landing buffer's is kept: slicing it costs less
        than a tensor slice per record)."""
        key = (buf.data_ptr(), buf.numel())
        if key != self._raw_key:
            self._raw, self._raw_key = byte_view(buf), key
        return self._raw

    # --- held records ---------------------------------------------------------------------------------------
    def hold(self, obj: CaptureRecord | RecordBatch, off: int, extent: int) -> None:
        """Keep the space of a record or batch read with ``copy=False`` until :meth:`release`."""
        self.held[id(obj)] = (obj, off, extent)

    def release(self, obj: CaptureRecord | RecordBatch) -> None:
        """Free the space of a held record or batch (nothing for one that owns its memory)."""
        held = self.held.pop(id(obj), None)
        if held is not None:
            self.space.free(held[1], held[2])

    def stats(self) -> dict[str, int]:
        """Pages in use, held records, lent bytes, spill arenas."""
        space = self.space
        return {
            "landing_pages_in_use": space.in_use(),
            "held_records": len(self.held),
            "lent_bytes": space.lent + space.spill_lent,
            "spill_lent_bytes": space.spill_lent,
            "spill_arena_bytes": space.spill_bytes,
        }

    def close(self) -> None:
        """Close the transport (held records become invalid; lent ones keep their buffers)."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.held.clear()


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
