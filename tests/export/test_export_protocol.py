"""Control-plane framing and the client's deadlines against misbehaving servers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from vllm_hs_compat import errors as E
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.control import ControlClient, ControlServer, parse_endpoint


@pytest.mark.parametrize("codec", [b"m", b"j"])
def test_both_codecs_carry_the_same_messages(codec: bytes) -> None:
    if codec.decode() not in P.local_codecs():
        pytest.skip("msgpack is not installed (the JSON codec still runs)")
    msg = {"op": "x", "n": 3, "f": 0.5, "l": [1, "a", None, True], "m": {"k": [1]}}
    a, b = socket.socketpair()
    with a, b:
        P.write_frame(a, msg, time.monotonic() + 2, codec)
        assert P.read_frame(b, time.monotonic() + 2, 1 << 10) == (codec, msg)


def test_codec_rejects_what_json_cannot_say() -> None:
    with pytest.raises(P.ProtocolError):
        P.decode(b"j", b'{"a": NaN')
    with pytest.raises(P.ProtocolError):
        P.decode(b"x", b"{}")
    with pytest.raises(P.ProtocolError):
        P.decode(b"m", b"\x81\x01\x02")  # int map key
    with pytest.raises(P.ProtocolError):
        P.unb64("***", "metadata")


@pytest.fixture
def server() -> Iterator[Callable[[Callable[[socket.socket], None]], str]]:
    socks: list[socket.socket] = []

    def start(behaviour: Callable[[socket.socket], None]) -> str:
        srv = socket.create_server(("127.0.0.1", 0))
        socks.append(srv)

        def run() -> None:
            conn, _ = srv.accept()
            socks.append(conn)
            behaviour(conn)

        threading.Thread(target=run, daemon=True).start()
        return f"127.0.0.1:{srv.getsockname()[1]}"

    yield start
    for s in socks:
        s.close()


def test_silent_server_hits_the_deadline(server: Callable[[Callable[[socket.socket], None]], str]) -> None:
    ep = server(lambda c: time.sleep(5))
    t0 = time.monotonic()
    with pytest.raises(E.ExportTimeoutError):
        ControlClient(ep, "t" * 32, timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0


def test_truncated_answer_is_a_protocol_error(
    server: Callable[[Callable[[socket.socket], None]], str],
) -> None:
    frame = P.encode({"op": "challenge", "proto": 1, "nonce": "ab" * 16}, b"j")
    ep = server(lambda c: (c.sendall(frame[:-5]), c.close()))
    with pytest.raises(E.ProtocolError, match="truncated"):
        ControlClient(ep, "t" * 32, timeout_s=2)


def test_impostor_server_cannot_prove_the_token(
    server: Callable[[Callable[[socket.socket], None]], str],
) -> None:
    def impostor(c: socket.socket) -> None:
        P.write_frame(c, {"op": "challenge", "proto": 1, "nonce": "cd" * 16}, time.monotonic() + 2)
        P.read_frame(c, time.monotonic() + 2, 1 << 16)
        P.write_frame(c, {"ok": True, "mac": "0" * 64, "hello": {}}, time.monotonic() + 2)

    ep = server(impostor)
    with pytest.raises(E.AuthError, match="prove"):
        ControlClient(ep, "t" * 32, timeout_s=2)


def test_server_request_errors_do_not_break_the_connection() -> None:
    def handler(op: str, msg: dict[str, object]) -> dict[str, object]:
        if op == "boom":
            raise ValueError("bug in a handler")
        if op == "slow":
            time.sleep(0.5)
        return {"echo": op}

    srv = ControlServer(handler, lambda: {"hi": 1}, "s" * 20)
    try:
        c = ControlClient(srv.endpoint, "s" * 20)
        assert c.hello == {"hi": 1}
        with pytest.raises(E.RemoteError, match="bug in a handler"):
            c.call({"op": "boom"})
        assert c.call({"op": "ok"})["echo"] == "ok"
        with pytest.raises(E.ExportTimeoutError):
            c.call({"op": "slow"}, timeout_s=0.1)
        assert c.broken  # a late answer could be mistaken for the next one: the connection is dropped
        c2 = ControlClient(srv.endpoint, "s" * 20)
        assert c2.call({"op": "again"})["echo"] == "again"
        c2.close()
    finally:
        srv.close()


def test_endpoint_parsing() -> None:
    assert parse_endpoint("10.0.0.2:5000") == ("10.0.0.2", 5000)
    assert parse_endpoint("[::1]:7") == ("::1", 7)
    for bad in ("nohost", ":80", "h:0", "h:x"):
        with pytest.raises(E.ExportConfigError):
            parse_endpoint(bad)


def test_client_speaks_json_to_a_server_without_msgpack(
    server: Callable[[Callable[[socket.socket], None]], str],
) -> None:
    seen: list[bytes] = []

    def json_only(c: socket.socket) -> None:
        P.write_frame(
            c,
            {"op": "challenge", "proto": 1, "nonce": "cd" * 16, "codecs": ["j"]},
            time.monotonic() + 2,
            b"j",
        )
        codec, _ = P.read_frame(c, time.monotonic() + 2, 1 << 16)
        seen.append(codec)
        P.write_frame(c, {"ok": False, "error": "auth", "message": "stop here"}, time.monotonic() + 2, b"j")

    ep = server(json_only)
    with pytest.raises(E.AuthError, match="stop here"):
        ControlClient(ep, "t" * 32, timeout_s=2)
    assert seen == [b"j"]


def test_challenge_is_json_and_offers_msgpack_when_installed() -> None:
    srv = ControlServer(lambda op, msg: {}, lambda: {}, "s" * 20)
    try:
        host, port = srv.address
        with socket.create_connection((host, port), timeout=2) as s:
            codec, challenge = P.read_frame(s, time.monotonic() + 2, 1 << 16)
        assert codec == b"j" and challenge["codecs"] == P.local_codecs()
        c = ControlClient(srv.endpoint, "s" * 20)
        assert c._codec == (b"m" if "m" in P.local_codecs() else b"j")
        c.close()
    finally:
        srv.close()
