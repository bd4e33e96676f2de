"""The wire schema (msgspec structs) and the control plane's client and server against misbehaving peers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import RecordMeta
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.control import Call, ControlClient, ControlServer, curve_keys, parse_endpoint, server_key

TOKEN = "s" * 20
CAP = "c2." + "A" * 22 + "." + "A" * 43  # the shape of a capability (the longest the schema takes)

REQUESTS: list[P.Request] = [
    P.HelloReq(),
    P.PingReq(),
    P.ClaimReq(["a", "b" * 512], max_reply_bytes=P.MIN_REPLY_BYTES, cap=CAP),
    P.ClaimNextReq(max_records=64, max_bytes=1 << 40, wait_s=30.0),
    P.ReleaseReq([P.ReleaseItem(1, "0123456789abcdef", "checksum_failed")], cap=None),
    P.ReadReq(lease=3, nonce="0123456789abcdef", offset=0, length=P.MAX_READ_BYTES),
    P.StatsReq(),
]


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: type(r).__name__)
def test_every_request_round_trips_and_stays_under_the_request_limit(req: P.Request) -> None:
    body = P.encode(req)
    assert P.decode_request(body) == req
    assert len(body) <= P.MAX_REQUEST_BYTES


def test_the_largest_valid_requests_fit_the_request_limit() -> None:
    claim = P.ClaimReq(["x" * P.MAX_ID_CHARS] * P.MAX_CLAIM_IDS, cap=CAP)
    release = P.ReleaseReq([P.ReleaseItem((1 << 62), "f" * 16, "checksum_failed")] * P.MAX_RELEASES, cap=CAP)
    for req in (claim, release):
        assert len(P.encode(req)) <= P.MAX_REQUEST_BYTES


@pytest.mark.parametrize(
    "body",
    [
        msgspec.msgpack.encode({"op": "claim", "ids": "keep"}),  # a str, not a list
        msgspec.msgpack.encode({"op": "claim", "ids": []}),  # empty
        msgspec.msgpack.encode({"op": "claim", "ids": ["x"] * (P.MAX_CLAIM_IDS + 1)}),
        msgspec.msgpack.encode({"op": "claim", "ids": ["x" * (P.MAX_ID_CHARS + 1)]}),
        msgspec.msgpack.encode({"op": "claim", "ids": ["x"], "extra": 1}),  # unknown field
        msgspec.msgpack.encode({"op": "release", "leases": [["x", 1]]}),
        msgspec.msgpack.encode({"op": "release", "leases": [[1, "é" * 16, "delivered"]]}),  # non-ASCII nonce
        msgspec.msgpack.encode({"op": "release", "leases": [[1, "0123456789abcdef\n", "delivered"]]}),
        msgspec.msgpack.encode({"op": "release", "leases": [[0, "0123456789abcdef", "delivered"]]}),
        msgspec.msgpack.encode({"op": "release", "leases": [[1, "0123456789abcdef", "eaten"]]}),
        msgspec.msgpack.encode({"op": "claim_next", "max_records": -1, "max_bytes": 1, "wait_s": 0}),
        msgspec.msgpack.encode({"op": "claim_next", "max_records": 1, "max_bytes": 1, "wait_s": 31.0}),
        msgspec.msgpack.encode({"op": "claim_next", "max_records": True, "max_bytes": 1, "wait_s": 0}),
        msgspec.msgpack.encode({"op": "read", "lease": 1, "nonce": "0123456789abcdef", "offset": 0, "length": 0}),
        msgspec.msgpack.encode({"op": "claim", "ids": ["x"], "cap": "c1.short"}),
        msgspec.msgpack.encode({"op": "format_disk"}),
        msgspec.msgpack.encode([1, 2, 3]),
        b"\xc1" * 12,  # not msgpack
        b"\x81\xa2op\xd4\x01\x00",  # an extension type
        b"\x81\xc4\x02op\xa5hello",  # a bytes map key
        b"",
    ],
)
def test_the_schema_refuses_what_it_does_not_describe(body: bytes) -> None:
    with pytest.raises(E.ProtocolError):
        P.decode_request(body)


def test_headers_name_the_wire_version() -> None:
    P.check_header(P.HEADER)
    with pytest.raises(E.WireVersionError, match="version 9"):
        P.check_header(P.HEADER_PREFIX + b"\x09")
    with pytest.raises(E.ProtocolError):
        P.check_header(b"GET / HTTP/1.1")


def test_a_wire_3_peer_is_refused_by_name_and_its_descriptor_cannot_be_misread() -> None:
    """Wire 4 carries the record's RecordMeta in the descriptor; a release of wire 3 (MetaWire, request_id) is
    refused at its header naming both versions and the fix, and even a wire-3 descriptor that got past the header
    would not decode as a wire-4 one (the control: the same record as wire 4 writes it decodes)."""
    assert (P.WIRE_VERSION, P.HEADER) == (4, b"hsx\x00\x04")
    with pytest.raises(E.WireVersionError, match="wire version 3, this side speaks 4; run the same vllm-hs-compat"):
        P.check_header(P.HEADER_PREFIX + b"\x03")
    meta = RecordMeta("r", (), (0,), True, "uint8", (1, 1, 8), checksum=3)
    transport = {"lease": 1, "nonce": "ab" * 8, "offset": 0, "nbytes": 8, "ids_offset": 8, "extent": 12}
    transport |= {"ids_checksum": 5, "producer": "ab"}
    v3_meta = {"schema_version": 2, "request_id": "r", "layer_ids": [0], "pre_norm": True, "dtype": "uint8"}
    v3_meta |= {"shape": [1, 1, 8], "checksum": 3, "checksum_algorithm": "xxh3_64"}
    with pytest.raises(E.ProtocolError):
        P.decode_descriptor(msgspec.msgpack.encode({"record_id": "r", **transport, "meta": v3_meta}))
    assert P.decode_descriptor(P.encode(P.RecordDesc(meta=meta, **transport))).meta == meta


def test_the_ticket_is_plain_json_data_and_validated() -> None:
    t = P.ExportTicket("r", "127.0.0.1:5", "t" * 40, "ab" * 8, "shm", 10, server_key(TOKEN), CAP)
    params = t.kv_transfer_params()
    assert "t" * 40 not in str(params) and params["hs_export"]["v"] == 3
    back = P.ExportTicket.parse(params)
    assert back.token is None and back.cap == t.cap and back.server_key == t.server_key
    for bad in (
        {**params["hs_export"], "cap": "c1.x"},
        {**params["hs_export"], "nbytes": "10"},
        {**params["hs_export"], "cap": "c1." + "A" * 43},  # an older capability in a version-3 ticket
        {**params["hs_export"], "v": 2},  # a version-2 ticket carrying this release's capability
    ):
        with pytest.raises(E.ExportConfigError):
            P.ExportTicket.parse({"hs_export": bad})
    v1 = {k: v for k, v in params["hs_export"].items() if k not in ("cap", "server_key")} | {"v": 1}
    assert P.ExportTicket.parse({"hs_export": v1}).cap is None  # an older ticket: the trainer token opens it


# --- client against misbehaving servers ---------------------------------------------------------------------------
@pytest.fixture
def router() -> Iterator[Callable[[Callable[[zmq.Socket[bytes]], None], bytes | None], str]]:
    """A hand-driven CURVE ROUTER keyed like a producer of TOKEN (or by another key)."""
    ctx = zmq.Context()
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(behaviour: Callable[[zmq.Socket[bytes]], None], secret: bytes | None = None) -> str:
        s = ctx.socket(zmq.ROUTER)
        s.linger = 0
        s.curve_server = True
        s.curve_secretkey = secret or curve_keys(TOKEN, "server")[1]
        port = s.bind_to_random_port("tcp://127.0.0.1")

        def run() -> None:
            try:
                while not stop.is_set():
                    if s.poll(50):
                        behaviour(s)
            finally:
                s.close(0)

        th = threading.Thread(target=run, daemon=True)
        th.start()
        threads.append(th)
        return f"127.0.0.1:{port}"

    yield start  # type: ignore[misc]
    stop.set()
    for th in threads:
        th.join(2)
    ctx.destroy(0)


def test_a_silent_server_hits_the_deadline(router: Callable[..., str]) -> None:
    ep = router(lambda s: s.recv_multipart())  # reads, never answers
    c = ControlClient(ep, TOKEN, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(E.ExportTimeoutError) as exc:
        c.call(P.PingReq())
    assert not isinstance(exc.value, E.ProducerUnreachableError)  # it connected; it just never answered
    assert time.monotonic() - t0 < 2.0
    c.close()


def test_no_producer_at_all_is_named_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = ControlClient(f"127.0.0.1:{port}", TOKEN, timeout_s=0.4)
    with pytest.raises(E.ProducerUnreachableError, match="no connection"):
        c.call(P.PingReq())
    c.close()


def test_garbled_or_foreign_answers_are_protocol_errors(router: Callable[..., str]) -> None:
    answers = [
        lambda ident, rid: [ident, P.HEADER, rid, b"ab", b"\xc1"],  # body not msgpack
        lambda ident, rid: [ident, P.HEADER, rid, b"ab", msgspec.msgpack.encode({"t": "pong"})],  # missing field
        lambda ident, rid: [ident, P.HEADER_PREFIX + bytes([P.WIRE_VERSION + 1]), rid, b"ab", b""],  # another version
    ]
    errors = (E.ProtocolError, E.ProtocolError, E.WireVersionError)
    for make, err in zip(answers, errors, strict=True):

        def reply(s: zmq.Socket[bytes], make: Callable[[bytes, bytes], list[bytes]] = make) -> None:
            ident, _, rid, _ = s.recv_multipart()
            s.send_multipart(make(ident, rid))

        c = ControlClient(router(reply), TOKEN, timeout_s=2)
        with pytest.raises(err):
            c.call(P.PingReq())
        c.close()


def test_an_impostor_server_cannot_complete_the_handshake(router: Callable[..., str]) -> None:
    """A process that grabbed the port but does not hold the producer key (derived from the token)."""
    ep = router(lambda s: s.recv_multipart(), secret=zmq.curve_keypair()[1])
    c = ControlClient(ep, TOKEN, timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(E.AuthError, match="prove"):
        c.call(P.PingReq())
    assert time.monotonic() - t0 < 3.0  # named at the first failed handshakes, not at the deadline
    c.close()


def test_request_errors_and_late_answers_do_not_break_the_connection() -> None:
    def handler(req: P.Request, call: Call) -> P.Reply:
        if isinstance(req, P.StatsReq):
            raise ValueError("bug in a handler")
        if isinstance(req, P.HelloReq):
            time.sleep(0.5)
        return P.PongReply("ab")

    srv = ControlServer(handler, TOKEN, producer="ab")
    try:
        c = ControlClient(srv.endpoint, TOKEN)
        assert isinstance(c.call(P.PingReq())[0], P.PongReply)
        with pytest.raises(E.RemoteError, match="bug in a handler"):
            c.call(P.StatsReq())
        assert isinstance(c.call(P.PingReq())[0], P.PongReply)
        with pytest.raises(E.ExportTimeoutError):
            c.call(P.HelloReq(), timeout_s=0.1)
        # the late answer to the hello arrives while the next request waits: recognised by its id, dropped
        rep, producer = c.call(P.PingReq(), timeout_s=5)
        assert isinstance(rep, P.PongReply) and producer == "ab" and c.stale_replies == 1
        assert srv.counters["internal_errors"] == 1
        c.close()
    finally:
        srv.close()


def test_a_client_without_curve_never_reaches_the_handler() -> None:
    seen: list[P.Request] = []

    def handler(req: P.Request, call: Call) -> P.Reply:
        seen.append(req)
        return P.PongReply("ab")

    srv = ControlServer(handler, TOKEN, producer="ab")
    ctx = zmq.Context()
    try:
        d = ctx.socket(zmq.DEALER)  # NULL mechanism: no CURVE
        d.linger = 0
        d.connect(f"tcp://{srv.endpoint}")
        d.send_multipart([P.HEADER, P.new_rid(), P.encode(P.PingReq())])
        assert d.poll(1000) == 0
        d.close(0)
        deadline = time.monotonic() + 5
        while srv.counters["handshake_failures_protocol"] + srv.counters["handshake_failures_other"] == 0:
            assert time.monotonic() < deadline, srv.counters
            time.sleep(0.02)
        assert seen == [] and srv.counters["requests"] == 0
    finally:
        ctx.destroy(0)
        srv.close()


def test_a_lost_request_is_resent_with_its_id_after_a_reconnect() -> None:
    """A claim whose connection dropped is sent again with the same request id; the server answers it once."""
    calls: list[bytes] = []

    def handler(req: P.Request, call: Call) -> P.Reply:
        calls.append(call.rid)
        return P.PongReply("ab")

    srv = ControlServer(handler, TOKEN, producer="ab")
    port = srv.address[1]
    c = ControlClient(srv.endpoint, TOKEN, timeout_s=10)
    try:
        assert isinstance(c.call(P.PingReq())[0], P.PongReply)
        srv.close()  # the producer goes away; a new one binds the same port a moment later
        result: list[object] = []
        th = threading.Thread(target=lambda: result.append(c.call(P.PingReq(), timeout_s=10)))
        th.start()
        time.sleep(0.5)
        srv = ControlServer(handler, TOKEN, port=port, producer="ab")
        th.join(12)
        assert result and isinstance(result[0], tuple) and isinstance(result[0][0], P.PongReply)
        assert len(calls) >= 2 and len(set(calls[1:])) == 1  # however often it arrived, it was one request id
    finally:
        c.close()
        srv.close()


def test_endpoint_parsing() -> None:
    assert parse_endpoint("10.0.0.2:5000") == ("10.0.0.2", 5000)
    assert parse_endpoint("[::1]:7") == ("::1", 7)
    assert parse_endpoint("tcp://10.0.0.2:5000") == ("10.0.0.2", 5000)  # ZeroMQ's form, as printed in logs
    assert parse_endpoint("tcp://[::1]:7") == ("::1", 7)
    for bad in ("nohost", ":80", "h:0", "h:x", "tcp://:80"):
        with pytest.raises(E.ExportConfigError):
            parse_endpoint(bad)
