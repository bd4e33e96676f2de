"""Pinned host memory for a connector's step reads, allocated once, before the engine's first step.

A batched read of one step copies a few hundred MiB of rows to pinned host memory (the records of the requests that
finished); torch's pinned allocator (``pin_memory=True``) makes a new block with ``cudaHostAlloc`` each time none of
the size class is free, on the engine's thread, and its blocks come free only once every record of their step went
through the sink.  On an H100 host those calls took 0.56-1.73 s of a 10 s capture, up to 0.73 s each, all in its
first steps (docs/gpu.md).  :class:`PinnedArena` pins one slab when the connector starts and hands out contiguous
pieces of it; a piece is a tensor of its own (``torch.frombuffer`` over a ``ctypes`` array at its address), so it
goes back to the arena when no tensor references its memory any more -- whatever still holds a record's rows (a
sink, a callback, a trainer) keeps its piece, exactly as with torch's blocks.  A request the arena cannot place
(larger than the slab, or no gap left) gets None: the caller allocates as before.

Pure: torch and the standard library.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
import weakref
from typing import Any

import torch

from vllm_hs_compat.errors import TransferError

#: Pieces start at multiples of this many bytes (the widest element a gather writes is 16 bytes; a page keeps the
#: pieces' first stores apart).
ALIGN = 4096


class PinnedArena:
    """Contiguous pieces of one pinned host slab of ``nbytes`` (``pin=False``: ordinary memory, for a host without
    CUDA), handed out first-fit from where the last one ended (a ring, as reads come and go in step order), each
    reusable once nothing references its memory.  Thread-safe: pieces are taken on the engine's thread and given
    back in whichever thread drops their last reference."""

    def __init__(self, nbytes: int, *, pin: bool = True) -> None:
        if nbytes <= 0:
            raise TransferError(f"a pinned arena of {nbytes} bytes: expected a positive size")
        t0 = time.perf_counter()
        self.slab = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.alloc_s = time.perf_counter() - t0
        """Seconds the slab took to allocate (``cudaHostAlloc``), at start."""
        self.nbytes = nbytes
        self._base = self.slab.data_ptr()
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # offset -> bytes of each piece handed out and not yet back
        self._head = 0
        self.stats = {"pieces": 0, "misses": 0, "live_peak_bytes": 0}

    @property
    def live_bytes(self) -> int:
        """Bytes of the pieces handed out and still referenced."""
        with self._lock:
            return sum(self._live.values())

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A contiguous tensor of ``shape`` and ``dtype`` in the slab (uninitialised), or None where no gap holds it
        (counted in ``stats["misses"]``)."""
        size = math.prod(shape) * dtype.itemsize
        need = max(ALIGN, -(-size // ALIGN) * ALIGN)
        with self._lock:
            at = self._place(need)
            if at is None:
                self.stats["misses"] += 1
                return None
            self._live[at] = need
            self._head = at + need
            self.stats["pieces"] += 1
            live = sum(self._live.values())
            self.stats["live_peak_bytes"] = max(self.stats["live_peak_bytes"], live)
        memory: Any = (ctypes.c_char * need).from_address(self._base + at)
        weakref.finalize(memory, self._give, at)  # when the last tensor over this piece is gone
        return torch.frombuffer(memory, dtype=torch.uint8)[:size].view(dtype).view(shape)

    def _place(self, need: int) -> int | None:
        """The first offset from the ring's head (then from the slab's start) where ``need`` bytes overlap no live
        piece; None when there is none."""
        if need > self.nbytes:
            return None
        live = sorted(self._live.items())
        ends = [at + n for at, n in live]
        ahead = [self._head] + [e for e in ends if e > self._head]
        for start in [*ahead, 0, *(e for e in ends if e <= self._head)]:
            if start + need <= self.nbytes and all(start + need <= at or at + n <= start for at, n in live):
                return start
        return None

    def _give(self, at: int) -> None:
        with self._lock:
            self._live.pop(at, None)

    def describe(self) -> dict[str, float]:
        """Its size, what allocating it took, and how it was used (logged by the connector at shutdown)."""
        with self._lock:
            return {
                "gib": self.nbytes / 2**30,
                "alloc_s": self.alloc_s,
                "pieces": float(self.stats["pieces"]),
                "misses": float(self.stats["misses"]),
                "live_peak_gib": self.stats["live_peak_bytes"] / 2**30,
            }
