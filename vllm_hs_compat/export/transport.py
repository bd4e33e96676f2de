"""The two halves every data transport implements (shared-memory ring, NIXL).

Both only move bytes: leases are claimed and released over the control plane, whatever the transport, so the
producer learns each record's outcome (delivered, checksum failed, abandoned) and a consumer learns whether its
lease was still held when it finished reading.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from vllm_hs_compat.export.protocol import NixlInfo, ShmInfo


def host_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed CPU byte buffer, pinned where CUDA exists (never on a CPU-only host, where pinning fails)."""
    pin = bool(torch.cuda.is_available())
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    buf.zero_()
    return buf


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

    A transport that copies with the CPU may also offer ``read_checked(items, algorithm, deadline) -> digests``
    (:meth:`ShmConsumerTransport.read_checked <vllm_hs_compat.export.shm.ShmConsumerTransport.read_checked>`):
    the copy with each range's checksum computed on the way; the consumer uses it when it is there."""

    kind: str
    #: where records land, a 1-D CPU uint8 tensor
    landing: torch.Tensor

    def attach(self, info: Mapping[str, Any] | ShmInfo | NixlInfo) -> None:
        """(Re)connect to the pool described by a producer's ``describe()``; forgets any earlier producer."""
        ...

    def read(self, items: Sequence[tuple[int, int, int]], notif: bytes, deadline: float) -> None:
        """Copy ``(remote_offset, local_offset, nbytes)`` ranges from the pool into ``landing``; ``notif`` (if
        not empty) goes to the producer when the reads are complete, where the transport supports it."""
        ...

    def close(self) -> None: ...
