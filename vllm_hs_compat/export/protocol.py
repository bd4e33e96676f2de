"""The export control plane's wire schema, version 4: the one place that defines every message.

Transport: ZeroMQ over TCP with CURVE (the gate's public socket, or the trainer's direct socket: see
:mod:`vllm_hs_compat.export.server` and :mod:`vllm_hs_compat.export.client`), or the trainer's plain channel
(:mod:`vllm_hs_compat.export.plain`: the same frames, concatenated behind a length).  A request is three frames, a
reply four::

    request:  HEADER | rid (16 random bytes) | msgpack(Request)
    reply:    HEADER | rid (echoed)          | producer instance id (ASCII) | msgpack(Reply)

``HEADER`` carries the wire version: a peer of another version is answered ``wire_version``
(:class:`~vllm_hs_compat.errors.WireVersionError`, naming both versions) before any body is decoded.
Bodies are msgpack maps decoded straight into the typed :class:`msgspec.Struct` classes below, which carry
every type, length, range and pattern constraint: a message is decoded and validated in one step, and anything
that does not fit is a :class:`~vllm_hs_compat.errors.ProtocolError` before any handler runs.  Nothing from the
network is unpickled.

Record descriptors travel as separately encoded msgpack byte strings inside a claim reply, so one malformed
(even truncated) descriptor fails its own record only and never the reply around it.  A descriptor is small and
of bounded size (token ids are not in it: they lie in the pool after the hidden states and are read, checksummed
and verified with them), and every reply is bounded by its encoded size, which the client states in each claim.
A descriptor carries the record's :class:`~vllm_hs_compat.core.records.RecordMeta` itself (the one metadata type
from the connector to the trainer), validated once, as it is decoded.

Wire version history (the header's last byte; docs/export.md "Wire version history" says more):

=======  ==========  ===========================================================================================
version  date        what changed
=======  ==========  ===========================================================================================
1        2026-11-30  first export: ``hello``, ``ping``, ``claim``, ``claim_next``, ``release``, ``read``, ``stats``
2        2026-12-01  pyzmq + msgspec bodies, per-record capabilities (tickets v2, v3), token ids in the pool;
                     ``direct`` added later as an optional op
3        2026-12-02  the trainer's ``hello`` describes an unnamed shm pool (``ShmInfo.socket``, ``key``);
                     ``fetch`` (small records' bytes in the claim's answer)
4        2026-12-03  a descriptor's ``meta`` is the record's ``RecordMeta`` (every field encoded, ``record_id``
                     instead of ``request_id``, ``token_ids`` empty); the descriptor's own ``record_id`` is gone
                     (it was a copy of the metadata's); later ``plain`` and ``transfer_settings`` as optional ops
=======  ==========  ===========================================================================================
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Final, Literal

import msgspec

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import RecordMeta, decode_typed
from vllm_hs_compat.core.vocabulary import EXPORT_KEY
from vllm_hs_compat.errors import (
    ExportConfigError,
    ProtocolError,
    RecordFormatError,
    UnknownRecordError,
    WireVersionError,
)

__all__ = ["PARAMS_KEY", "WIRE_VERSION", "ExportTicket", "ProtocolError"]

WIRE_VERSION: Final = 4
HEADER: Final = b"hsx\x00\x04"
HEADER_PREFIX: Final = b"hsx\x00"
RID_BYTES: Final = 16

#: Largest request a server reads (libzmq refuses a longer frame before allocating it: ``zmq.MAXMSGSIZE``).
MAX_REQUEST_BYTES: Final = 32 << 10
#: Default and bounds of the reply size a client accepts (its ``zmq.MAXMSGSIZE`` is this plus the envelope).
DEFAULT_REPLY_BYTES: Final = 16 << 20
MIN_REPLY_BYTES: Final = 64 << 10
MAX_REPLY_BYTES: Final = 64 << 20
#: Bytes of a reply that are not payload (envelope frames, map keys, the CURVE box): kept free in every budget.
REPLY_OVERHEAD: Final = 4096
MAX_BATCH: Final = 1024
MAX_CLAIM_IDS: Final = 32
MAX_RELEASES: Final = 512
MAX_READ_BYTES: Final = 8 << 20
#: What a producer serves per ``read`` (and advertises in ``hello.max_read_bytes``; consumers read in pieces of
#: it): it bounds the replies a ticket holder can have queued, see docs/export.md "Per-peer bounds".
SERVED_READ_BYTES: Final = 1 << 20
MAX_WAIT_S: Final = 30.0
MAX_ID_CHARS: Final = 512
#: The message of a claim error for an id left unclaimed because the reply reached the client's size budget
#: (the id is fine: claim it again).
REPLY_FULL: Final = "not claimed: the reply is full; claim it again"

# --- constrained field types ----------------------------------------------------------------------------------
RecordId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
InstanceId = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern="^[0-9a-f]+$")]
Nonce = Annotated[str, msgspec.Meta(min_length=16, max_length=16, pattern="^[0-9a-f]+$")]
LeaseId = Annotated[int, msgspec.Meta(ge=1, le=1 << 62)]
#: A ticket's capability: ``c2.`` + publication + ``.`` + MAC, 69 characters (see
#: :mod:`vllm_hs_compat.export.capabilities`).  The schema also lets an older ``c1.`` capability (46 characters)
#: through, so the producer can refuse it by name rather than as a malformed request.
Capability = Annotated[str, msgspec.Meta(min_length=46, max_length=69, pattern="^c[0-9]\\.[A-Za-z0-9_.-]+$")]
#: A CURVE public key, Z85-encoded (40 characters).
CurveKey = Annotated[
    str, msgspec.Meta(min_length=40, max_length=40, pattern="^[0-9a-zA-Z.:+=^!/*?&<>()\\[\\]{}@%$#-]+$")
]
Offset = Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]
Size = Annotated[int, msgspec.Meta(ge=1, le=1 << 48)]
#: msgpack integers stop at 2**64 - 1, so ``ge=0`` is the whole unsigned 64-bit range.
U64 = Annotated[int, msgspec.Meta(ge=0)]
Outcome = Literal["delivered", "checksum_failed", "abandoned"]
Settled = Literal["released", "expired", "unknown"]
Principal = Literal["trainer", "record"]


# --- requests (client -> producer) ----------------------------------------------------------------------------
class _Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    pass


class HelloReq(_Request, tag="hello"):
    """Who the producer is and (for the trainer) how to reach its pool."""


class PingReq(_Request, tag="ping"):
    """Liveness (any principal)."""


class ClaimReq(_Request, tag="claim"):
    """Lease records by id.  With ``cap`` (a ticket's capability) exactly one id, the ticket's own."""

    ids: Annotated[list[RecordId], msgspec.Meta(min_length=1, max_length=MAX_CLAIM_IDS)]
    max_reply_bytes: Annotated[int, msgspec.Meta(ge=MIN_REPLY_BYTES, le=MAX_REPLY_BYTES)] = DEFAULT_REPLY_BYTES
    cap: Capability | None = None


class FetchReq(ClaimReq, tag="fetch"):
    """A claim by id whose answer also carries the bytes of the leased records that fit in ``inline_bytes``
    (together, in request order): a small record reaches its reader in one round trip, with no transfer after the
    claim.  Its own op, not a field of ``claim``: requests forbid unknown fields, so an older producer answers this
    op with a ``protocol`` error and the consumer claims as before (docs/export.md, "Small records in the
    claim's answer")."""

    inline_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_READ_BYTES)] = 0


class ClaimNextReq(_Request, tag="claim_next"):
    """Lease the oldest published records (trainer only), long-polling up to ``wait_s`` for the first."""

    max_records: Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH)]
    max_bytes: Size
    wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_WAIT_S)]
    max_reply_bytes: Annotated[int, msgspec.Meta(ge=MIN_REPLY_BYTES, le=MAX_REPLY_BYTES)] = DEFAULT_REPLY_BYTES


class ReleaseItem(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """``[lease, nonce, outcome]``: what became of a claimed record at the consumer."""

    lease: LeaseId
    nonce: Nonce
    outcome: Outcome


class ReleaseReq(_Request, tag="release"):
    """Give leases back, each with its outcome.  The whole request is validated before any lease is freed."""

    leases: Annotated[list[ReleaseItem], msgspec.Meta(min_length=1, max_length=MAX_RELEASES)]
    cap: Capability | None = None


class ReadReq(_Request, tag="read"):
    """Bytes of a claimed record through the control plane (how a ticket holder, who never gets the pool's
    transport metadata, reads its record)."""

    lease: LeaseId
    nonce: Nonce
    offset: Offset
    length: Annotated[int, msgspec.Meta(ge=1, le=MAX_READ_BYTES)]
    cap: Capability | None = None


class StatsReq(_Request, tag="stats"):
    """The producer's counters (trainer only)."""


class DirectReq(_Request, tag="direct"):
    """Where the trainer may reach the producer's own socket, past the gate (trainer only).  Its own op, not a
    field of ``hello``: replies forbid unknown fields, so an older consumer could not decode such a hello; an
    older producer answers this op with a ``protocol`` error, and the consumer stays on the gate."""


class PlainReq(_Request, tag="plain"):
    """Where the trainer may reach the producer's plain control channel (trainer only; see
    :mod:`vllm_hs_compat.export.plain`).  Its own op, as ``direct``: an older producer answers it with a
    ``protocol`` error, and the consumer uses the direct socket or the gate."""


#: A setting's name and value in :class:`TransferSettingsReq` (``UCX_...``; sizes as counts of bytes).
SettingName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern="^UCX_[A-Z0-9_]+$")]
SettingValue = Annotated[str, msgspec.Meta(max_length=64)]
Settings = Annotated[dict[SettingName, SettingValue], msgspec.Meta(max_length=16)]


class TransferSettingsReq(_Request, tag="transfer_settings"):
    """The settings the consumer's transfers depend on (UCX's TCP segment sizes, which UCX does not negotiate), sent
    after ``hello`` and before the consumer loads the producer's agent metadata (trainer only).  The producer answers
    with its own and counts a mismatch; the consumer refuses a mismatch before any transfer.  Its own op, as
    ``direct``: an older producer answers it with a ``protocol`` error, and the consumer goes on unchecked."""

    settings: Settings


Request = (
    HelloReq
    | PingReq
    | ClaimReq
    | FetchReq
    | ClaimNextReq
    | ReleaseReq
    | ReadReq
    | StatsReq
    | DirectReq
    | PlainReq
    | TransferSettingsReq
)


# --- transport descriptions (in the trainer's hello) ----------------------------------------------------------
class ShmInfo(msgspec.Struct, tag_field="kind", tag="shm", forbid_unknown_fields=True):
    """The shared-memory pool, reached one of two ways (exactly one of ``path`` and ``socket`` is set):

    * ``socket`` + ``key`` (handoff ``"fd"``, the default): the pool has no name; its descriptor is handed over
      on the abstract Unix socket ``socket`` to a same-user peer that presents ``key`` (both only ever in the
      trainer's ``hello``, over CURVE);
    * ``path`` (handoff ``"path"``): the named file in the shm directory, its liveness its ``flock``.

    ``pid`` is the owner's, for people."""

    size: Size
    path: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    pid: Annotated[int, msgspec.Meta(ge=0, le=1 << 32)] = 0
    socket: Annotated[str, msgspec.Meta(max_length=100)] = ""
    key: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class NixlInfo(msgspec.Struct, tag_field="kind", tag="nixl", forbid_unknown_fields=True):
    """The NIXL pool: the producer's agent name and metadata and the registered address range."""

    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    metadata: Annotated[bytes, msgspec.Meta(min_length=1, max_length=4 << 20)]
    base: Annotated[int, msgspec.Meta(ge=1)]
    size: Size


TransportInfo = ShmInfo | NixlInfo


# --- record descriptors -----------------------------------------------------------------------------------------
class RecordDesc(msgspec.Struct, forbid_unknown_fields=True):
    """A leased record: where it lies in the pool and what it is.  ``[offset, offset + extent)`` holds the hidden
    states (``nbytes``) and, from ``ids_offset`` on, the token ids as little-endian uint32 (``ids_checksum``).

    ``meta`` is the record's :class:`~vllm_hs_compat.core.records.RecordMeta` itself, without its token ids (they
    travel in the pool: ``RecordMeta.without_token_ids``); it is validated as it is decoded, once, and its
    ``record_id`` is the record's id (:attr:`record_id`).  The other fields are the transport's: the lease, its
    nonce, the places and the second checksum.

    ``nonce`` and ``producer`` carry their lengths here but not their hex patterns (a regular expression per
    string cost 1.4 us of a 2.8 us descriptor decode, per record): the consumer checks the nonce with
    :func:`is_nonce` before it uses it and requires ``producer`` to equal the instance it attached to."""

    lease: LeaseId
    nonce: Annotated[str, msgspec.Meta(min_length=16, max_length=16)]
    offset: Offset
    nbytes: Size
    ids_offset: Offset
    extent: Size
    ids_checksum: U64
    producer: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    meta: RecordMeta

    @property
    def record_id(self) -> str:
        """The record's id (its metadata's)."""
        return self.meta.record_id


class LeaseRef(msgspec.Struct):
    """The lenient reading of a descriptor that failed :class:`RecordDesc`: enough to give its lease back."""

    lease: int = 0
    nonce: str = ""
    meta: Any = None

    @property
    def record_id(self) -> str:
        """The record's id, if the descriptor's metadata is readable that far (else ``""``)."""
        rid = self.meta.get("record_id") if isinstance(self.meta, dict) else None
        return rid if isinstance(rid, str) else ""


# --- replies (producer -> client) -----------------------------------------------------------------------------
class _Reply(msgspec.Struct, tag_field="t", forbid_unknown_fields=True):
    pass


class HelloReply(_Reply, tag="hello"):
    """Who the producer is and who the caller is; ``transport`` only for the trainer."""

    producer: InstanceId
    backend: Annotated[str, msgspec.Meta(max_length=16)]
    principal: Principal
    pool_bytes: Size
    slot_bytes: Size
    lease_ttl_s: Annotated[float, msgspec.Meta(gt=0.0)]
    max_read_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_READ_BYTES)]
    transport: TransportInfo | None = None


class PongReply(_Reply, tag="pong"):
    """The answer to :class:`PingReq`."""

    producer: InstanceId


class ClaimError(msgspec.Struct, forbid_unknown_fields=True):
    """Why one id of a claim was not leased (not published yet, gone, or failed at the producer)."""

    record_id: RecordId
    code: Literal["unknown_record", "failed_record"]
    message: Annotated[str, msgspec.Meta(max_length=4096)]


class ClaimReply(_Reply, tag="claim"):
    """``records``: one encoded :class:`RecordDesc` each (a byte string: decoded one by one).  ``more``: records
    were left READY because the reply reached the client's size budget."""

    records: Annotated[list[bytes], msgspec.Meta(max_length=MAX_BATCH)]
    errors: Annotated[list[ClaimError], msgspec.Meta(max_length=MAX_CLAIM_IDS)] = []
    more: bool = False


class FetchReply(_Reply, tag="fetch"):
    """The answer to :class:`FetchReq`: a :class:`ClaimReply` whose ``data[i]`` holds record i's bytes (its extent:
    hidden states, then token ids) or is empty when they did not fit (read them as after a claim).  The lease is
    the same as a claim's: the record is released with its outcome once its checksums are verified.  ``data`` is
    decoded as views of the received message (no copy; a view keeps the message alive) and encoded from views of
    the producer's pool."""

    records: Annotated[list[bytes], msgspec.Meta(max_length=MAX_BATCH)]
    data: Annotated[
        list[Annotated[memoryview, msgspec.Meta(max_length=MAX_READ_BYTES)]], msgspec.Meta(max_length=MAX_BATCH)
    ]
    errors: Annotated[list[ClaimError], msgspec.Meta(max_length=MAX_CLAIM_IDS)] = []
    more: bool = False


class ReleaseReply(_Reply, tag="release"):
    """One entry per released lease, in request order: ``released`` (it was still claimed: the slots are free and
    the outcome counted), ``expired`` (its TTL ran out first: the bytes read may be another record's),
    ``unknown`` (no such lease, or a wrong nonce)."""

    results: Annotated[list[Settled], msgspec.Meta(max_length=MAX_RELEASES)]


class ReadReply(_Reply, tag="read"):
    """The bytes a :class:`ReadReq` asked for."""

    data: Annotated[bytes, msgspec.Meta(max_length=MAX_READ_BYTES)]


class StatsReply(_Reply, tag="stats"):
    """The producer's counters (``ExportProducer.stats()``)."""

    stats: dict[str, int | float | str]


class DirectReply(_Reply, tag="direct"):
    """The trainer's direct endpoint (``host:port``), or None when the producer serves none."""

    endpoint: Annotated[str, msgspec.Meta(max_length=512)] | None = None


class PlainReply(_Reply, tag="plain"):
    """The trainer's plain control endpoint (``host:port``), or None when the producer serves none."""

    endpoint: Annotated[str, msgspec.Meta(max_length=512)] | None = None


class TransferSettingsReply(_Reply, tag="transfer_settings"):
    """The producer's settings of :class:`TransferSettingsReq` (those its transport's agent runs with)."""

    settings: Settings


class ErrorReply(_Reply, tag="error"):
    """A failed request: ``code`` names the error class (``control.ERROR_CODES``)."""

    code: Annotated[str, msgspec.Meta(max_length=64)]
    message: Annotated[str, msgspec.Meta(max_length=8192)]


Reply = (
    HelloReply
    | PongReply
    | ClaimReply
    | FetchReply
    | ReleaseReply
    | ReadReply
    | StatsReply
    | DirectReply
    | PlainReply
    | TransferSettingsReply
    | ErrorReply
)

# --- codecs -------------------------------------------------------------------------------------------------------
ENCODER: Final = msgspec.msgpack.Encoder()
_REQUEST_DECODER: Final = msgspec.msgpack.Decoder(Request)
_REPLY_DECODER: Final = msgspec.msgpack.Decoder(Reply)
_DESC_DECODER: Final = msgspec.msgpack.Decoder(RecordDesc)
_DESC_LIST_DECODER: Final = msgspec.msgpack.Decoder(list[RecordDesc])
_LEASE_REF_DECODER: Final = msgspec.msgpack.Decoder(LeaseRef)


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of a request, reply or descriptor."""
    return ENCODER.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder[Any], body: bytes | memoryview, what: str) -> Any:
    try:
        return decode_typed(decoder, body)  # (a descriptor's RecordMeta: validated once, see decode_typed)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"{what} does not fit the wire-{WIRE_VERSION} schema: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"{what} is not msgpack: {e}") from None
    except RecordFormatError:
        raise  # a descriptor whose metadata fits the schema but describes no record (RecordMeta.validate)
    except Exception as e:  # RecursionError, MemoryError, anything else: the message's fault, never the caller's
        raise ProtocolError(f"{what} could not be decoded ({type(e).__name__}: {str(e)[:200]})") from None


#: Deepest container nesting a request may have.  The schema needs 3 (request map > ``leases`` array >
#: ``ReleaseItem`` array); msgspec decodes nesting recursively, so a body nested a thousand deep is refused before
#: it reaches the decoder.
MAX_REQUEST_DEPTH: Final = 8
#: msgpack type bytes that open a container (fixmap, fixarray, array16/32, map16/32).
_CONTAINER_BYTES: Final = bytes(range(0x80, 0xA0)) + b"\xdc\xdd\xde\xdf"
#: ``bytes.translate`` table: a container type byte -> 1, any other byte -> 0.
_MARK_CONTAINERS: Final = bytes(1 if b in _CONTAINER_BYTES else 0 for b in range(256))
#: Bytes that follow a msgpack type byte before the next item, for the fixed-size types (0xc1 is never used).
_FIXED_TAIL: Final = {
    0xC0: 0, 0xC1: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,
}  # fmt: skip
#: Length-prefixed types: (bytes of the length, extra bytes after it) -- bin, ext (one type byte), str.
_SIZED: Final = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),
                 0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0)}  # fmt: skip


def check_depth(body: bytes, limit: int = MAX_REQUEST_DEPTH) -> None:
    """Raise :class:`ProtocolError` if the msgpack ``body`` nests containers deeper than ``limit``.

    Costs one C pass (``bytes.translate``) for any body with at most ``limit`` container type bytes in it, which
    is every request but a long release; only those are walked item by item (a truncated body stops the walk: the
    decoder names that)."""
    if body.translate(_MARK_CONTAINERS).count(1) <= limit:
        return  # fewer container bytes than the limit: no nesting can pass it
    n = len(body)
    i = 0
    stack = [1]  # items left at each open level; the body is one item
    while stack:
        if stack[-1] == 0:
            stack.pop()
            continue
        stack[-1] -= 1
        if i >= n:
            return
        t = body[i]
        i += 1
        if t <= 0x7F or t >= 0xE0:
            continue
        if t <= 0x9F:
            count = (t & 0x0F) * (2 if t <= 0x8F else 1)
        elif t <= 0xBF:
            i += t & 0x1F
            continue
        elif t in (0xDC, 0xDD, 0xDE, 0xDF):
            width = 2 if t in (0xDC, 0xDE) else 4
            count = int.from_bytes(body[i : i + width], "big") * (2 if t >= 0xDE else 1)
            i += width
        elif t in _SIZED:
            width, extra = _SIZED[t]
            i += width + extra + int.from_bytes(body[i : i + width], "big")
            continue
        else:
            i += _FIXED_TAIL.get(t, 0)
            continue
        stack.append(count)
        if len(stack) > limit + 1:
            raise ProtocolError(
                f"request nests containers deeper than {limit} levels (the wire-{WIRE_VERSION} schema needs 3); "
                "send a request built from the protocol's structs"
            )


def decode_request(body: bytes | memoryview, *, check_nesting: bool = True) -> Request:
    """Decode and validate a request body in one step; anything that does not fit, whatever the decoder raises
    (``RecursionError`` included), is a :class:`ProtocolError`.  With ``check_nesting`` (the default; the server
    leaves it on for every peer but the trainer, who holds the token) the nesting is bounded first by
    :func:`check_depth`, so an untrusted body never reaches the recursive decoder more than
    :data:`MAX_REQUEST_DEPTH` deep."""
    raw = body if isinstance(body, bytes) else bytes(body)
    if check_nesting:
        check_depth(raw)
    req: Request = _decode(_REQUEST_DECODER, raw, "request")
    return req


def decode_reply(body: bytes | memoryview) -> Reply:
    """Decode and validate a reply body in one step; anything else is a :class:`ProtocolError`."""
    rep: Reply = _decode(_REPLY_DECODER, body, "reply")
    return rep


def decode_descriptor(raw: bytes | memoryview) -> RecordDesc:
    """One record descriptor of a claim reply: :class:`ProtocolError` if it does not fit the schema,
    :class:`RecordFormatError` if its metadata does not describe a record."""
    desc: RecordDesc = _decode(_DESC_DECODER, raw, "record descriptor")
    return desc


def decode_descriptors(raws: Sequence[bytes]) -> list[RecordDesc]:
    """Every descriptor of a claim reply in one decoder call (they are concatenated under one msgpack array
    header).  Raises :class:`ProtocolError` (or :class:`RecordFormatError`) if any of them does not fit; decode
    them one by one (:func:`decode_descriptor`) to learn which."""
    n = len(raws)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    descs: list[RecordDesc] = _decode(_DESC_LIST_DECODER, head + b"".join(raws), "record descriptors")
    return descs


def decode_lease_ref(raw: bytes | memoryview) -> LeaseRef | None:
    """The lease of a descriptor that failed :func:`decode_descriptor`, if that much of it is readable."""
    try:
        ref = _LEASE_REF_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if not isinstance(ref.lease, int) or isinstance(ref.lease, bool) or not 1 <= ref.lease <= 1 << 62:
        return None
    if not isinstance(ref.nonce, str) or len(ref.nonce) != 16 or not is_hex(ref.nonce):
        return None
    return ref


def is_hex(s: str) -> bool:
    """``s`` is lowercase hex digits only (the empty string too)."""
    return not s.strip("0123456789abcdef")


def is_nonce(s: str) -> bool:
    """``s`` is a lease nonce: 16 lowercase hex digits (what :data:`Nonce` requires)."""
    return len(s) == 16 and is_hex(s)


def check_header(frame: bytes) -> None:
    """Raise :class:`WireVersionError` (or :class:`ProtocolError`) unless ``frame`` is this version's header."""
    if frame == HEADER:
        return
    if len(frame) == len(HEADER) and frame.startswith(HEADER_PREFIX):
        raise WireVersionError(
            f"peer speaks export wire version {frame[-1]}, this side speaks {WIRE_VERSION}; run the same "
            "vllm-hs-compat release on the serving and the training side"
        )
    raise ProtocolError(f"first frame is {bytes(frame[:16])!r}, expected the export header {HEADER!r}")


def new_rid() -> bytes:
    """A request id: 16 random bytes (a retried request keeps its id, so the producer answers it once)."""
    return secrets.token_bytes(RID_BYTES)


def ids_layout(nbytes: int, tokens: int) -> tuple[int, int]:
    """``(ids_offset, extent)`` of a record: token ids start at the first multiple of 8 after the hidden states,
    4 bytes each."""
    ids_offset = -(-nbytes // 8) * 8
    return ids_offset, ids_offset + 4 * tokens


def convert_transport(info: Mapping[str, Any] | ShmInfo | NixlInfo) -> ShmInfo | NixlInfo:
    """A transport description from its plain-dict form (``ProducerTransport.describe()``), validated."""
    if isinstance(info, ShmInfo | NixlInfo):
        return info
    try:
        out: ShmInfo | NixlInfo = msgspec.convert(dict(info), TransportInfo)
    except (msgspec.ValidationError, TypeError) as e:
        raise ProtocolError(f"transport description does not fit the wire-{WIRE_VERSION} schema: {e}") from None
    return out


# --- the ticket (kv_transfer_params["hs_export"]) -------------------------------------------------------------
PARAMS_KEY: Final = EXPORT_KEY  # the kv_transfer_params key (core.vocabulary)
#: 3: the capability is bound to one publication of the record (``c2.``); 2 carried ``c1.`` capabilities, which
#: producers of this release refuse; 1 carried no capability (the trainer token opens it).
TICKET_VERSION: Final = 3


class _TicketEntry(msgspec.Struct):
    v: Literal[1, 2, 3]
    record_id: RecordId
    endpoint: Annotated[str, msgspec.Meta(min_length=3, max_length=300)]
    producer: InstanceId
    backend: Annotated[str, msgspec.Meta(max_length=16)]
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]
    server_key: CurveKey | None = None
    cap: Capability | None = None


@dataclasses.dataclass(frozen=True)
class ExportTicket:
    """Where one record can be fetched, and the right to fetch that record only: the
    ``kv_transfer_params["hs_export"]`` entry (version 3).

    ``cap`` is a per-publication capability (see :mod:`vllm_hs_compat.export.capabilities`): it opens this
    publication of this record (claim, read, release) and nothing else -- not a later record published under the
    same id -- so it may travel in ``kv_transfer_params``, which reach whoever sent the request.  ``server_key``
    is the producer's public CURVE key (not a secret), which lets the holder check it talks to the real producer.
    ``token`` (the trainer credential) is kept for in-process use only and is never part of
    :meth:`kv_transfer_params`.
    """

    record_id: str
    endpoint: str
    token: str | None
    producer: str
    backend: str
    nbytes: int
    server_key: str | None = None
    cap: str | None = None

    def kv_transfer_params(self) -> dict[str, Any]:
        """The JSON-safe ``{"hs_export": {...}}`` entry (no trainer token, ever)."""
        entry: dict[str, Any] = {
            "v": TICKET_VERSION,
            "record_id": self.record_id,
            "endpoint": self.endpoint,
            "producer": self.producer,
            "backend": self.backend,
            "nbytes": self.nbytes,
        }
        if self.server_key is not None:
            entry["server_key"] = self.server_key
        if self.cap is not None:
            entry["cap"] = self.cap
        return {PARAMS_KEY: entry}

    @property
    def publication(self) -> str | None:
        """The publication nonce the capability is bound to (None without a ``c2.`` capability): hand it to
        :meth:`ExportProducer.publish_nowait` / ``publish`` / ``fail`` with the record this ticket is for."""
        from vllm_hs_compat.export.capabilities import publication_of

        return publication_of(self.cap)

    @classmethod
    def from_locator(cls, locator: Mapping[str, Any], record_id: str, nbytes: int, publication: str) -> ExportTicket:
        """The ticket of publication ``publication`` (a fresh :func:`~.capabilities.new_publication`, which must
        travel with the record to the producer) of ``record_id``, built from an export sink's locator (in vLLM's
        scheduler process, which has no producer): the capability is minted from the locator's capability key."""
        from vllm_hs_compat.export.capabilities import mint

        key = locator.get("capability_key")
        return cls(
            record_id=record_id,
            endpoint=str(locator["endpoint"]),
            token=None,
            producer=str(locator["producer"]),
            backend=str(locator["backend"]),
            nbytes=int(nbytes),
            server_key=locator.get("server_key"),
            cap=mint(key, record_id, publication) if key else None,
        )

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> ExportTicket:
        """Read a ticket from ``kv_transfer_params`` (or from its ``hs_export`` entry), validating every field.
        The returned ticket carries no token."""
        if not isinstance(params, Mapping):
            raise ExportConfigError(f"kv_transfer_params must be a mapping, found {type(params).__name__}")
        entry = params.get(PARAMS_KEY, params)
        if not isinstance(entry, Mapping) or entry.get("v") not in (1, 2, 3):
            raise ExportConfigError(
                f"kv_transfer_params lacks a version-1 to -3 {PARAMS_KEY!r} entry "
                f"(found keys {sorted(map(str, params))}); "
                "was the server started with the vllm-hs-compat connector and export enabled?"
            )
        if "error" in entry:
            raise UnknownRecordError(
                f"the producer could not export record {entry.get('record_id')!r}: {entry.get('error')}: "
                f"{entry.get('message')} (counted in the producer's stats)"
            )
        try:
            e = msgspec.convert(dict(entry), _TicketEntry)
        except (msgspec.ValidationError, TypeError) as exc:
            raise ExportConfigError(f"malformed {PARAMS_KEY!r} ticket: {exc}") from None
        if e.cap is not None and (e.v < TICKET_VERSION or not e.cap.startswith("c2.")):
            raise ExportConfigError(
                f"this {PARAMS_KEY!r} ticket (version {e.v}) carries a {e.cap[:2]} capability; producers of this "
                f"release accept only c2 capabilities (ticket version {TICKET_VERSION}), each bound to one "
                "publication of its record, because a c1 capability also opened any later record published under "
                "the same id. Ask the server for a new ticket (send the request again) or use the trainer token."
            )
        return cls(
            record_id=e.record_id,
            endpoint=e.endpoint,
            token=None,
            producer=e.producer,
            backend=e.backend,
            nbytes=e.nbytes,
            server_key=e.server_key,
            cap=e.cap,
        )


# --- errors and endpoints on the wire -----------------------------------------------------------------------
#: error code on the wire <-> exception class.  Unlisted codes become RemoteError.
ERROR_CODES: Final[dict[str, type[E.ExportError]]] = {
    "auth": E.AuthError,
    "capability": E.CapabilityError,
    "wire_version": E.WireVersionError,
    "protocol": E.ProtocolError,
    "unknown_record": E.UnknownRecordError,
    "failed_record": E.RecordFailedError,
    "lease_expired": E.LeaseExpiredError,
    "config": E.ExportConfigError,
    "timeout": E.ExportTimeoutError,
    "closed": E.ExportClosedError,
    "stale": E.StaleMetadataError,
    "descriptor": E.DescriptorError,
}


def remote_error(rep: ErrorReply) -> E.ExportError:
    """The named error an ``error`` answer carries (:class:`RemoteError` for a code this side does not know)."""
    return ERROR_CODES.get(rep.code, E.RemoteError)(rep.message)


def error_code(exc: BaseException) -> str:
    """The wire code of an export error (the most specific class listed in :data:`ERROR_CODES`)."""
    for code, cls in ERROR_CODES.items():
        if type(exc) is cls:
            return code
    for code, cls in ERROR_CODES.items():
        if isinstance(exc, cls):
            return code
    return "internal"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or either with ZeroMQ's ``tcp://`` prefix -> ``(host, port)``."""
    if not isinstance(endpoint, str) or ":" not in endpoint:
        raise E.ExportConfigError(f"endpoint must look like 'host:port', found {endpoint!r}")
    address = endpoint[len("tcp://") :] if endpoint.startswith("tcp://") else endpoint
    host, _, port_s = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_s)
    except ValueError:
        raise E.ExportConfigError(f"endpoint {endpoint!r} has a non-numeric port") from None
    if not 0 < port < 65536 or not host:
        raise E.ExportConfigError(f"endpoint {endpoint!r} needs a host and a port in 1..65535")
    return host, port


def zmq_address(host: str, port: int | str) -> str:
    """ZeroMQ's ``tcp://`` address of ``host`` and ``port`` (an IPv6 host in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
