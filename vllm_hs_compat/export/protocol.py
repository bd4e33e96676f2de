"""Wire format of the control plane: length-prefixed frames holding msgpack (or JSON) maps.

Frame: ``b"HX"`` | version (1 byte, = 1) | codec (1 byte: ``b"m"`` msgpack, ``b"j"`` JSON) | body length
(4 bytes, big endian) | body.  Bodies decode to plain maps of str/int/float/bool/None/list/map; byte strings
(NIXL agent metadata) travel base64-encoded in str fields, so both codecs carry the same messages.
Nothing received from the network is ever unpickled.  Every read has a deadline and a size limit.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any, Final

from vllm_hs_compat.errors import ExportConfigError, ExportTimeoutError, ProtocolError, UnknownRecordError

try:  # msgpack is an optional extra; JSON is always available.
    import msgpack as _msgpack
except ImportError:  # pragma: no cover - exercised only where msgpack is absent
    _msgpack = None

MAGIC: Final = b"HX"
VERSION: Final = 1
HEADER: Final = struct.Struct("!2sBcI")
CODEC_MSGPACK: Final = b"m"
CODEC_JSON: Final = b"j"
#: Requests are small; responses may carry a batch of descriptors.
MAX_REQUEST_BYTES: Final = 1 << 20
MAX_RESPONSE_BYTES: Final = 32 << 20


def default_codec() -> bytes:
    return CODEC_MSGPACK if _msgpack is not None else CODEC_JSON


def local_codecs() -> list[str]:
    """Codecs this process can decode, best first (advertised in the challenge)."""
    return ["m", "j"] if _msgpack is not None else ["j"]


def pick_codec(offered: object) -> bytes:
    """The best codec both sides speak; JSON is always common."""
    if isinstance(offered, list) and "m" in offered and _msgpack is not None:
        return CODEC_MSGPACK
    return CODEC_JSON


def encode(msg: Mapping[str, Any], codec: bytes | None = None) -> bytes:
    """One frame holding ``msg``."""
    codec = codec or default_codec()
    if codec == CODEC_MSGPACK and _msgpack is not None:
        body = bytes(_msgpack.packb(msg, use_bin_type=True))
    elif codec == CODEC_JSON:
        body = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()
    else:
        raise ProtocolError(f"codec {codec!r} is not available here; expected b'm' (msgpack installed) or b'j'")
    return HEADER.pack(MAGIC, VERSION, codec, len(body)) + body


def decode(codec: bytes, body: bytes) -> dict[str, Any]:
    """Decode a frame body into a plain map; anything else is a :class:`ProtocolError`."""
    try:
        if codec == CODEC_MSGPACK:
            if _msgpack is None:
                raise ProtocolError("peer sent msgpack but msgpack is not installed here; install msgpack")
            obj = _msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
        elif codec == CODEC_JSON:
            obj = json.loads(body.decode("utf-8"))
        else:
            raise ProtocolError(f"unknown codec byte {codec!r}; expected b'm' or b'j'")
    except ProtocolError:
        raise
    except Exception as e:  # msgpack/json raise many types on garbage
        raise ProtocolError(f"control message body does not decode ({type(e).__name__}: {e})") from None
    # Both decoders can only produce None/bool/int/float/str/list/dict with str keys here (msgpack: bin and
    # ext types refused, strict_map_key), so no per-element walk is needed on top.
    if not isinstance(obj, dict):
        raise ProtocolError(f"control message must be a map, found {type(obj).__name__}")
    return obj


class PeerClosedError(ProtocolError):
    """The peer closed the connection cleanly between two frames."""


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ExportTimeoutError(
                f"timed out reading {what}: got {len(buf)} of {n} bytes before the deadline; "
                "the peer is stalled or the network is down"
            )
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except TimeoutError:
            continue
        except OSError as e:
            raise ProtocolError(f"connection failed while reading {what}: {e}") from None
        if not chunk:
            if not buf and what == "frame header":
                raise PeerClosedError("the peer closed the connection")
            raise ProtocolError(
                f"connection closed after {len(buf)} of {n} bytes of {what} (truncated message or peer gone)"
            )
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket, deadline: float, max_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """Read one frame; returns ``(codec, message)``."""
    head = _recv_exact(sock, HEADER.size, deadline, "frame header")
    magic, version, codec, length = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"frame starts with {magic!r}, expected {MAGIC!r}; not a vllm-hs-compat peer")
    if version != VERSION:
        raise ProtocolError(f"frame version {version}, this build speaks {VERSION}; upgrade the older side")
    if length > max_bytes:
        raise ProtocolError(f"frame announces {length} bytes, the limit is {max_bytes}; refusing to read it")
    body = _recv_exact(sock, length, deadline, "frame body")
    return codec, decode(codec, body)


def write_frame(sock: socket.socket, msg: Mapping[str, Any], deadline: float, codec: bytes | None = None) -> None:
    data = encode(msg, codec)
    left = deadline - time.monotonic()
    if left <= 0:
        raise ExportTimeoutError("deadline passed before a control message could be sent")
    sock.settimeout(left)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise ExportTimeoutError("timed out sending a control message; the peer does not read") from None
    except OSError as e:
        raise ProtocolError(f"connection failed while sending a control message: {e}") from None


# --- field helpers: strict validation of received maps ------------------------------------------------------
def get_str(msg: Mapping[str, Any], key: str, max_chars: int = 4096) -> str:
    v = msg.get(key)
    if not isinstance(v, str) or len(v) > max_chars:
        raise ProtocolError(f"field {key!r} must be a str of at most {max_chars} chars, found {type(v).__name__}")
    return v


def get_int(msg: Mapping[str, Any], key: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    v = msg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ProtocolError(f"field {key!r} must be an int in [{lo}, {hi}], found {v!r}")
    return v


def get_float(msg: Mapping[str, Any], key: str, lo: float, hi: float) -> float:
    v = msg.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= float(v) <= hi:
        raise ProtocolError(f"field {key!r} must be a number in [{lo}, {hi}], found {v!r}")
    return float(v)


def get_list(msg: Mapping[str, Any], key: str, max_len: int) -> list[Any]:
    v = msg.get(key)
    if not isinstance(v, list) or len(v) > max_len:
        raise ProtocolError(f"field {key!r} must be a list of at most {max_len} entries, found {type(v).__name__}")
    return v


def get_map(msg: Mapping[str, Any], key: str) -> dict[str, Any]:
    v = msg.get(key)
    if not isinstance(v, dict):
        raise ProtocolError(f"field {key!r} must be a map, found {type(v).__name__}")
    return v


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise ProtocolError(f"{what} is not valid base64: {e}") from None


PARAMS_KEY: Final = "hs_export"


@dataclasses.dataclass(frozen=True)
class ExportTicket:
    """Where one record can be fetched: the ``kv_transfer_params["hs_export"]`` entry (version 1).

    The entry names the record and the producer, never a credential: ``kv_transfer_params`` reach whoever sent
    the request.  ``token`` (the producer's trainer credential) is kept for in-process use only and is not part
    of :meth:`kv_transfer_params`; a consumer brings its own (``ExportConsumer.from_params(params, token=...)``
    or the token file, see :func:`vllm_hs_compat.export.control.read_token`).
    """

    record_id: str
    endpoint: str
    token: str | None
    producer: str
    backend: str
    nbytes: int

    def kv_transfer_params(self) -> dict[str, Any]:
        return {
            PARAMS_KEY: {
                "v": 1,
                "record_id": self.record_id,
                "endpoint": self.endpoint,
                "producer": self.producer,
                "backend": self.backend,
                "nbytes": self.nbytes,
            }
        }

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> ExportTicket:
        """Read a ticket from ``kv_transfer_params`` (or from its ``hs_export`` entry), validating every field.
        The returned ticket carries no token."""
        if not isinstance(params, Mapping):
            raise ExportConfigError(f"kv_transfer_params must be a mapping, found {type(params).__name__}")
        entry = params.get(PARAMS_KEY, params)
        if not isinstance(entry, Mapping) or entry.get("v") != 1:
            raise ExportConfigError(
                f"kv_transfer_params lacks a version-1 {PARAMS_KEY!r} entry "
                f"(found keys {sorted(map(str, params))}); "
                "was the server started with the vllm-hs-compat connector and export enabled?"
            )
        d = dict(entry)
        if "error" in d:
            raise UnknownRecordError(
                f"the producer could not export record {d.get('record_id')!r}: {d.get('error')}: "
                f"{d.get('message')} (counted in the producer's stats)"
            )
        return cls(
            record_id=get_str(d, "record_id", 512),
            endpoint=get_str(d, "endpoint", 300),
            token=None,
            producer=get_str(d, "producer", 64),
            backend=get_str(d, "backend", 16),
            nbytes=get_int(d, "nbytes"),
        )
