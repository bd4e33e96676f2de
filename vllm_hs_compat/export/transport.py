"""The two halves every data transport implements (shared-memory ring, NIXL)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

#: Prefix of release notifications: ``b"hsx1:r:" + b",".join(b"<lease hex>.<nonce>")``.
RELEASE_PREFIX = b"hsx1:r:"
MAX_RELEASES_PER_NOTIF = 512


def host_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed CPU byte buffer, pinned where CUDA exists (never on a CPU-only host, where pinning fails)."""
    pin = bool(torch.cuda.is_available())
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    buf.zero_()
    return buf


def encode_release(items: Sequence[tuple[int, str]]) -> bytes:
    return RELEASE_PREFIX + b",".join(f"{lease:x}.{nonce}".encode() for lease, nonce in items)


def decode_release(msg: bytes) -> list[tuple[int, str]] | None:
    """Parse a release notification; ``None`` if it is not one (malformed ones are not trusted)."""
    if not msg.startswith(RELEASE_PREFIX) or len(msg) > 64 * MAX_RELEASES_PER_NOTIF:
        return None
    out: list[tuple[int, str]] = []
    try:
        for part in msg[len(RELEASE_PREFIX) :].decode("ascii").split(","):
            lease_s, _, nonce = part.partition(".")
            if not nonce or len(nonce) > 64 or len(lease_s) > 16:
                return None
            out.append((int(lease_s, 16), nonce))
    except (UnicodeDecodeError, ValueError):
        return None
    return out


class ProducerTransport(Protocol):
    kind: str
    #: the registered pool, a 1-D CPU uint8 tensor
    buffer: torch.Tensor

    def describe(self) -> dict[str, Any]:
        """Plain (JSON-safe) facts a consumer needs to reach the pool."""
        ...

    def poll_notifications(self) -> list[bytes]:
        """Notifications received since the last call (the pump thread is the only caller)."""
        ...

    def close(self) -> None: ...


class ConsumerTransport(Protocol):
    kind: str
    #: where records land, a 1-D CPU uint8 tensor
    landing: torch.Tensor
    #: True when a read's notification releases the leases (NIXL); False when the consumer must send a release
    releases_by_notification: bool

    def attach(self, info: dict[str, Any]) -> None:
        """(Re)connect to the pool described by a producer's ``describe()``; forgets any earlier producer."""
        ...

    def read(self, items: Sequence[tuple[int, int, int]], notif: bytes, deadline: float) -> None:
        """Copy ``(remote_offset, local_offset, nbytes)`` ranges from the pool into ``landing``; ``notif``
        goes to
        the producer when the reads are complete (where the transport supports it)."""
        ...

    def close(self) -> None: ...
