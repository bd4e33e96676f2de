"""The two halves every data transport implements (shared-memory ring, NIXL).

Both only move bytes: leases are claimed and released over the control plane, whatever the transport, so the
producer learns each record's outcome (delivered, checksum failed, abandoned) and a consumer learns whether its
lease was still held when it finished reading.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

import torch

from vllm_hs_compat import errors as E

if TYPE_CHECKING:
    from vllm_hs_compat.export.protocol import NixlInfo, ShmInfo


def host_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed CPU byte buffer, pinned where CUDA exists (never on a CPU-only host, where pinning fails)."""
    pin = bool(torch.cuda.is_available())
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    buf.zero_()
    return buf


#: A consumer's local offsets name a landing region and a place in it: ``region << REGION_SHIFT | offset``.
#: Region 0 is the landing buffer (so its offsets are plain offsets); more regions are added by
#: ``add_region`` (the consumer's spill arenas, see ``consumer/landing.py``).
REGION_SHIFT: Final = 40
REGION_MASK: Final = (1 << REGION_SHIFT) - 1


class LandingRegions:
    """The byte buffers a consumer transport reads into: region 0 is ``landing``; the consumer adds and drops the
    others.  :meth:`locate` checks a ``(local offset, nbytes)`` range and says which buffer holds it."""

    def __init__(self, landing: torch.Tensor) -> None:
        self.bufs: list[torch.Tensor | None] = [landing]

    def add(self, buf: torch.Tensor) -> int:
        """Add a 1-D contiguous CPU uint8 buffer; its region number (a free one is reused)."""
        for k in range(1, len(self.bufs)):
            if self.bufs[k] is None:
                self.bufs[k] = buf
                return k
        self.bufs.append(buf)
        return len(self.bufs) - 1

    def drop(self, k: int) -> None:
        if 0 < k < len(self.bufs):
            self.bufs[k] = None

    def locate(self, loff: int, n: int) -> tuple[torch.Tensor, int]:
        """The buffer holding local range ``[loff, loff + n)`` and the range's offset in it; a
        :class:`DescriptorError` when no region holds all of it."""
        k, lo = loff >> REGION_SHIFT, loff & REGION_MASK
        buf = self.bufs[k] if 0 <= k < len(self.bufs) else None
        if buf is None or loff < 0 or n < 0 or lo + n > buf.numel():
            cap = buf.numel() if buf is not None else 0
            raise E.DescriptorError(
                f"local range [{lo}:{lo + n}] of landing region {k} is outside it ({cap} bytes"
                f"{'' if buf is not None else ', no such region'})"
            )
        return buf, lo


class ProducerTransport(Protocol):
    """The serving side: a registered pool the consumers read from."""

    kind: str
    #: the registered pool, a 1-D CPU uint8 tensor
    buffer: torch.Tensor

    def describe(self) -> dict[str, Any]:
        """Plain facts a trainer needs to reach the pool (``protocol.ShmInfo`` / ``NixlInfo`` fields)."""
        ...

    def poll_notifications(self) -> list[bytes]:
        """Notifications received since the last call (the pump thread is the only caller)."""
        ...

    def close(self) -> None: ...


class ConsumerTransport(Protocol):
    """The trainer side: a landing buffer and reads into it.

    A transport that copies with the CPU may also offer :class:`CheckedReads`: ``read_checked(items, algorithm,
    deadline) -> digests``
    (:meth:`ShmConsumerTransport.read_checked <vllm_hs_compat.export.shm.ShmConsumerTransport.read_checked>`):
    the copy with each range's checksum computed on the way; the consumer uses it when it is there.

    A transport whose transfers run asynchronously may also offer posted reads, :class:`PostedReads` (the
    consumer's verified read then keeps a window of pieces in flight and checksums each as soon as it landed):

    * ``post_read(items) -> posted``: start a read of ``(remote, local, nbytes)`` ranges and return at once; the
      result's ``done`` says whether the bytes already moved while posting;
    * ``wait_read(posted, deadline, spin_s)``: return when it is done; a named error when it failed, an
      ``ExportTimeoutError`` (the read still in flight) at the deadline;
    * ``release_read(posted)``: always called by the poster, once the read is over or given up; a read released in
      flight may still write its landing range, which the caller then never reuses.

    (:meth:`NixlConsumerTransport.post_read <vllm_hs_compat.export.nixl_backend.NixlConsumerTransport.post_read>`.)
    """

    kind: str
    #: where records land, a 1-D CPU uint8 tensor
    landing: torch.Tensor

    def attach(self, info: Mapping[str, Any] | ShmInfo | NixlInfo) -> None:
        """(Re)connect to the pool described by a producer's ``describe()``; forgets any earlier producer."""
        ...

    def read(self, items: Sequence[tuple[int, int, int]], deadline: float) -> None:
        """Copy ``(remote_offset, local_offset, nbytes)`` ranges from the pool into ``landing`` (or another
        landing region, see ``REGION_SHIFT``) by ``deadline``."""
        ...

    def add_region(self, buf: torch.Tensor) -> int:
        """Make ``buf`` (a 1-D contiguous CPU uint8 tensor, kept alive by the caller) a landing region (registered
        for the transfers where the transport needs it); its region number."""
        ...

    def drop_region(self, k: int) -> None:
        """Forget (deregister) landing region ``k`` > 0; no transfer into it may be in flight."""
        ...

    def close(self) -> None: ...


class CheckedReads(Protocol):
    """A consumer transport's optional copy that checksums as it copies (see :class:`ConsumerTransport`)."""

    def read_checked(self, items: Sequence[tuple[int, int, int, int]], algorithm: str, deadline: float) -> list[int]:
        """Copy ``(remote, local, nbytes, checked)`` ranges; the ``algorithm`` checksum of each one's first
        ``checked`` bytes."""
        ...


class PostedRead(Protocol):
    """A read started by :meth:`PostedReads.post_read`."""

    #: whether the bytes already moved while it was posted
    done: bool


class PostedReads(Protocol):
    """A consumer transport's optional posted reads (see :class:`ConsumerTransport`)."""

    def post_read(self, items: Sequence[tuple[int, int, int]]) -> PostedRead:
        """Start a read of ``(remote, local, nbytes)`` ranges and return at once."""
        ...

    def wait_read(self, posted: PostedRead, deadline: float, spin_s: float) -> None:
        """Return when ``posted`` is done; its error, or an ``ExportTimeoutError`` at the deadline."""
        ...

    def release_read(self, posted: PostedRead) -> None:
        """Give ``posted`` up (once, after it is over or abandoned)."""
        ...


def checked_reads(transport: ConsumerTransport) -> CheckedReads | None:
    """``transport`` as one with :class:`CheckedReads`, or ``None`` when it has none."""
    return cast("CheckedReads", transport) if hasattr(transport, "read_checked") else None


def posted_reads(transport: ConsumerTransport) -> PostedReads | None:
    """``transport`` as one with :class:`PostedReads`, or ``None`` when it has none."""
    return cast("PostedReads", transport) if hasattr(transport, "post_read") else None
