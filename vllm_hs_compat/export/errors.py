"""Named errors of the export API.  Every message says what was found, what was expected and how to fix it."""

from __future__ import annotations

from vllm_hs_compat.core.records import ChecksumMismatchError, RecordFormatError
from vllm_hs_compat.errors import HsCompatError

__all__ = [
    "AuthError",
    "ChecksumMismatchError",
    "ControlPlaneError",
    "DescriptorError",
    "DuplicateRecordError",
    "ExportClosedError",
    "ExportConfigError",
    "ExportError",
    "ExportTimeoutError",
    "LandingBufferFullError",
    "LeaseExpiredError",
    "PoolFullError",
    "ProtocolError",
    "RecordFormatError",
    "RecordTooLargeError",
    "RemoteDisconnectedError",
    "RemoteError",
    "StaleMetadataError",
    "TransportError",
    "TransportUnavailableError",
    "UnknownRecordError",
]


class ExportError(HsCompatError):
    """Base class of every export error."""


class ExportConfigError(ExportError):
    """A producer or consumer setting is invalid."""


class ExportClosedError(ExportError):
    """The producer or consumer was used after close()."""


class ExportTimeoutError(ExportError, TimeoutError):
    """A wait ran past its deadline."""


# --- producer side: the record fails, the producer keeps serving --------------------------------------------
class RecordTooLargeError(ExportError):
    """A record needs more bytes than the whole pool (or the consumer's landing buffer) holds."""


class PoolFullError(ExportError):
    """No free slots for a record (policy ``drop``, or ``wait`` ran past its timeout).  The record is
    counted."""


class DuplicateRecordError(ExportError):
    """A record id is already held in the pool."""


# --- consumer side ------------------------------------------------------------------------------------------
class UnknownRecordError(ExportError):
    """The producer holds no record with this id (never published, already taken, expired or dropped)."""


class LeaseExpiredError(ExportError):
    """The lease on a record ran out before the consumer finished with it; its slots may hold other data
    now."""


class LandingBufferFullError(ExportError):
    """The consumer's landing buffer has no room: release records fetched with ``copy=False``."""


# --- control plane ------------------------------------------------------------------------------------------
class ControlPlaneError(ExportError):
    """The control connection failed (refused, reset, closed)."""


class AuthError(ControlPlaneError):
    """Authentication failed (wrong or missing token, or the server could not prove it knows the token)."""


class ProtocolError(ControlPlaneError):
    """A control message is malformed, truncated, oversized or of an unknown kind."""


class RemoteError(ControlPlaneError):
    """The peer answered a request with an error it could not map to a more specific class."""


# --- data plane ---------------------------------------------------------------------------------------------
class TransportError(ExportError):
    """The data transport (NIXL or shared memory) failed."""


class TransportUnavailableError(TransportError):
    """The requested transport cannot be used here (e.g. ``nixl`` is not installed)."""


class RemoteDisconnectedError(TransportError):
    """The peer agent went away during or before a transfer."""


class StaleMetadataError(TransportError):
    """The transport metadata or a descriptor belongs to an earlier producer instance."""


class DescriptorError(TransportError):
    """A descriptor points outside the registered memory, or lengths disagree."""
