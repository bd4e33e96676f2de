"""Per-publication capabilities: the right to fetch one publication of one record, safe to hand to whoever sent
the request.

The trainer token opens everything (streaming, any record, stats).  It never leaves the trainer's side.  A ticket
in ``kv_transfer_params`` instead carries a capability for its own record::

    key = derive_key(token, producer_instance)      # in the producer; "k1." + 43 base64url characters
    pub = new_publication()                         # 16 random bytes, 22 base64url characters
    cap = mint(key, record_id, pub)                 # pure; vLLM's scheduler calls it for each ticket
    # cap == "c2." + pub + "." + base64url(HMAC-SHA256(key, "hs-compat record v2" 0x00 pub 0x00 record_id))

Whoever mints the ticket draws the publication nonce ``pub`` (the connector's scheduler in ``request_finished``,
before the record exists; :meth:`ExportProducer.ticket` / ``publish`` for direct users), and the nonce travels
with the record to the producer, which keeps it with the record's lease (or its failure entry).  The producer
accepts ``cap`` only for ``record_id`` *and* only while the live publication of that id is ``pub``: claim, read
and release of that one record.  A ticket of a delivered record therefore opens nothing when a later record is
published under the same id (vLLM request ids can be chosen by the caller): that record has its own nonce.  The
key is derived per producer instance, so a capability opens nothing on another producer that shares the token
(DP ranks of one deployment), nor on a restarted producer.

``c1.`` capabilities (ticket version 2 and older: the MAC of the record id alone) are refused by name.

The key travels from the worker to vLLM's scheduler inside the export sink's locator (vLLM's own start-up
handshake, pickled between its processes).  It is a :class:`CapabilityKey`, a ``str`` whose ``repr``, ``str``
and ``format`` print ``CapabilityKey(<redacted>)``, so logging the locator does not reveal it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from typing import Any, Final

from vllm_hs_compat.errors import ExportConfigError

KEY_PREFIX: Final = "k1."
CAP_PREFIX: Final = "c2."
#: Characters of a publication nonce (16 random bytes, base64url without padding).
PUBLICATION_CHARS: Final = 22
#: Characters of a capability: prefix, publication, ".", 43 characters of HMAC-SHA256.
CAP_CHARS: Final = len(CAP_PREFIX) + PUBLICATION_CHARS + 1 + 43
#: Characters of a ``c1.`` capability (older releases), still let through the wire schema so it is refused by name.
OLD_CAP_CHARS: Final = 46
_KEY_LABEL: Final = b"hs-compat capability v1"
_RECORD_LABEL: Final = b"hs-compat record v2"
_REDACTED: Final = "CapabilityKey(<redacted>)"
_PUBLICATION = re.compile(r"[A-Za-z0-9_-]{22}")
_CAP = re.compile(r"c2\.([A-Za-z0-9_-]{22})\.[A-Za-z0-9_-]{43}")


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


def new_publication() -> str:
    """A fresh publication nonce (16 random bytes as 22 base64url characters): one per ticket and its record."""
    return secrets.token_urlsafe(16)


def _mac(key: str, record_id: str, publication: str) -> str:
    msg = _RECORD_LABEL + b"\x00" + publication.encode("ascii") + b"\x00"
    return _b64(hmac.new(_key_bytes(key), msg + record_id.encode("utf-8", "surrogatepass"), hashlib.sha256).digest())


def mint(key: str, record_id: str, publication: str) -> str:
    """The capability for publication ``publication`` (from :func:`new_publication`) of ``record_id`` (a pure
    function of the key, the id and the nonce)."""
    if not isinstance(record_id, str) or not record_id:
        raise ExportConfigError(f"record_id must be a non-empty str, found {record_id!r}")
    if not isinstance(publication, str) or not _PUBLICATION.fullmatch(publication):
        raise ExportConfigError(
            f"a publication nonce is {PUBLICATION_CHARS} base64url characters (capabilities.new_publication()), "
            f"found {type(publication).__name__} {str(publication)[:40]!r}"
        )
    return f"{CAP_PREFIX}{publication}.{_mac(key, record_id, publication)}"


def publication_of(capability: object) -> str | None:
    """The publication nonce a well-formed ``c2.`` capability names (None for anything else).  Says nothing about
    whether the capability is genuine: that is :func:`verify`."""
    if not isinstance(capability, str):
        return None
    m = _CAP.fullmatch(capability)
    return m.group(1) if m is not None else None


def verify(key: str, record_id: str, publication: str, capability: object) -> bool:
    """True if ``capability`` is the one :func:`mint` gives for ``record_id`` and ``publication``.  Never raises
    on odd input (non-ASCII, wrong type, an old ``c1.`` capability): the comparison is of UTF-8 bytes, in
    constant time."""
    if not isinstance(capability, str) or not isinstance(record_id, str) or not record_id:
        return False
    if not isinstance(publication, str) or not _PUBLICATION.fullmatch(publication):
        return False
    want = mint(key, record_id, publication).encode("ascii")
    return hmac.compare_digest(want, capability.encode("utf-8", "surrogatepass"))


def same_publication(a: str, b: str) -> bool:
    """Constant-time equality of two publication nonces (any ``str``; never raises)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))
