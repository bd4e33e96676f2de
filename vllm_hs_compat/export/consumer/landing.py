"""The landing space: the landing buffer (region 0) and the spill arenas past it, in pages.

:class:`_Landing` allocates and frees that space, places a claim (its record lent the space, or copied out
afterwards), locates a local offset in its buffer, lends space to owned tensors (given back when they are garbage
collected) and names the error of a record that does not fit.
"""

from __future__ import annotations

import collections
import ctypes
import weakref
from collections.abc import Callable

import torch

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import byte_view
from vllm_hs_compat.errors import HsCompatError
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
