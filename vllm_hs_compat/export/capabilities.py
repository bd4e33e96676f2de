"""Per-record capabilities: the right to fetch one record, safe to hand to whoever sent the request.

The trainer token opens everything (streaming, any record, stats).  It never leaves the trainer's side.  A ticket
in ``kv_transfer_params`` instead carries a capability for its own record::

    key = derive_key(token, producer_instance)      # in the producer; "k1." + 43 base64url characters
    cap = mint(key, record_id)                      # pure; vLLM's scheduler calls it for each ticket
    # cap == "c1." + base64url(HMAC-SHA256(key, "hs-compat record v1" 0x00 record_id))[:43]

The producer accepts ``cap`` for ``record_id`` only: claim, read and release of that one record.  The key is
derived per producer instance, so a capability does not open a record of the same id on another producer that
shares the token (DP ranks of one deployment), nor on a restarted producer.

The key travels from the worker to vLLM's scheduler inside the export sink's locator (vLLM's own start-up
handshake, pickled between its processes).  It is a :class:`CapabilityKey`, a ``str`` whose ``repr``, ``str``
and ``format`` print ``CapabilityKey(<redacted>)``, so logging the locator does not reveal it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any, Final

from vllm_hs_compat.errors import ExportConfigError

KEY_PREFIX: Final = "k1."
CAP_PREFIX: Final = "c1."
_KEY_LABEL: Final = b"hs-compat capability v1"
_RECORD_LABEL: Final = b"hs-compat record v1"
_REDACTED: Final = "CapabilityKey(<redacted>)"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


class CapabilityKey(str):
    """The producer's capability key.  A ``str`` (so any serializer carries it) that never prints itself."""

    __slots__ = ()

    def __repr__(self) -> str:
        return _REDACTED

    def __str__(self) -> str:
        return _REDACTED

    def __format__(self, spec: str) -> str:
        return _REDACTED

    def __reduce__(self) -> tuple[Any, ...]:
        return (CapabilityKey, (str.__str__(self),))


def derive_key(token: str, producer: str) -> CapabilityKey:
    """The capability key of producer instance ``producer`` whose trainer token is ``token``:
    ``HMAC-SHA256(token, "hs-compat capability v1" 0x00 producer)``."""
    mac = hmac.new(token.encode(), _KEY_LABEL + b"\x00" + producer.encode(), hashlib.sha256).digest()
    return CapabilityKey(KEY_PREFIX + _b64(mac))


def _key_bytes(key: str) -> bytes:
    raw = str.__str__(key) if isinstance(key, str) else None
    if raw is None or not raw.startswith(KEY_PREFIX) or len(raw) != len(KEY_PREFIX) + 43:
        raise ExportConfigError(
            "a capability key looks like 'k1.' + 43 base64url characters (from the export sink's locator, "
            f"'capability_key'); found a {type(key).__name__} of {len(raw) if raw is not None else 0} characters"
        )
    try:
        return base64.urlsafe_b64decode(raw[len(KEY_PREFIX) :] + "=")
    except ValueError:
        raise ExportConfigError("the capability key is not base64url; take it from the locator unchanged") from None


def mint(key: str, record_id: str) -> str:
    """The capability for ``record_id`` (a pure function of the key and the id)."""
    if not isinstance(record_id, str) or not record_id:
        raise ExportConfigError(f"record_id must be a non-empty str, found {record_id!r}")
    mac = hmac.new(
        _key_bytes(key), _RECORD_LABEL + b"\x00" + record_id.encode("utf-8", "surrogatepass"), hashlib.sha256
    )
    return CAP_PREFIX + _b64(mac.digest())


def verify(key: str, record_id: str, capability: object) -> bool:
    """True if ``capability`` is the one :func:`mint` gives for ``record_id``.  Never raises on odd input
    (non-ASCII, wrong type): the comparison is of UTF-8 bytes, in constant time."""
    if not isinstance(capability, str) or not isinstance(record_id, str) or not record_id:
        return False
    want = mint(key, record_id).encode("ascii")
    return hmac.compare_digest(want, capability.encode("utf-8", "surrogatepass"))
