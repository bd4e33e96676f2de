"""Garbage from the network fails with our named errors only, and never takes a server down."""

from __future__ import annotations

import socket
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import RecordMeta
from vllm_hs_compat.errors import RecordFormatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.consumer import Claim
from vllm_hs_compat.export.control import ControlClient, ControlServer
from vllm_hs_compat.export.transport import decode_release

plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=10), kids, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([b"m", b"j", b"x"]), st.binary(max_size=200))
def test_decode_of_random_bytes_raises_only_protocol_error(codec: bytes, body: bytes) -> None:
    try:
        out = P.decode(codec, body)
    except E.ProtocolError:
        return
    assert isinstance(out, dict)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(list(RecordMeta.__dataclass_fields__) + ["x"]), plain, max_size=12))
def test_random_metadata_maps_raise_only_record_format_error(d: dict[str, Any]) -> None:
    try:
        RecordMeta.from_dict(d)
    except RecordFormatError:
        pass


@settings(max_examples=200, deadline=None)
@given(plain)
def test_random_descriptors_raise_only_named_errors(d: Any) -> None:
    good = {
        "record_id": "r",
        "lease": 1,
        "nonce": "ab" * 8,
        "offset": 0,
        "nbytes": 8,
        "producer": "p",
        "meta": RecordMeta("r", (1,), (0,), True, "uint8", (1, 1, 8), checksum=3).to_dict(),
    }
    for cand in (d, {**good, "meta": d}, {**good, "offset": d}, {**good, "nbytes": d}):
        try:
            Claim.parse(cand)
        except (E.ProtocolError, RecordFormatError):
            pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120))
def test_random_notifications_are_parsed_or_refused(msg: bytes) -> None:
    out = decode_release(msg)
    assert out is None or all(isinstance(a, int) and isinstance(b, str) for a, b in out)
    assert decode_release(b"hsx1:r:1f.00ff") == [(31, "00ff")]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=4))
def test_server_survives_random_bytes_before_and_after_auth(chunks: list[bytes]) -> None:
    srv = _SERVER
    for authed in (False, True):
        if authed:
            c = ControlClient(srv.endpoint, TOKEN, timeout_s=2)
            s = c._sock
        else:
            host, port = srv.address
            s = socket.create_connection((host, port), timeout=2)
        try:
            for ch in chunks:
                s.sendall(ch)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(2)
            while s.recv(4096):
                pass
        except OSError:
            pass
        finally:
            s.close()
    ok = ControlClient(srv.endpoint, TOKEN, timeout_s=2)  # still serving
    assert ok.call({"op": "ping"})["pong"] is True
    ok.close()


TOKEN = "f" * 24


def _handler(op: str, msg: dict[str, Any]) -> dict[str, Any]:
    if op == "ping":
        return {"pong": True}
    raise E.ProtocolError(f"unknown op {op!r}")


_SERVER = ControlServer(_handler, lambda: {}, TOKEN)


def teardown_module() -> None:
    _SERVER.close()
    time.sleep(0)
