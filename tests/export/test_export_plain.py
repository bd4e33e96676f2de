"""The trainer's plain control channel (vllm_hs_compat/export/plain.py): the trainer's requests over a bare TCP
connection to the producer's serving thread, authenticated both ways by the token, past ZeroMQ.

Real producers and raw TCP peers throughout: a trainer consumer moves to the plain channel after hello and gets the
same records, with nothing more through the gate or the CURVE direct socket; a wrong token, garbage, silence,
a flood of half-open connections and oversized frames are refused and counted, with the producer process alive,
not grown, and still serving the trainer (a channel lost mid-session: test_export_direct.py, parametrized); an
older producer (no ``plain`` op) leaves the trainer on the CURVE direct socket.  Negative controls: a handshake
check that accepts any answer lets a wrong-token peer's request through, which the same probe detects; the
probe's own positive case (the right key) is answered.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from collections.abc import Callable

import pytest
from hsx_harness import Peer, process_memory, wait_until
from hsx_testdata import digest, make_rows
from test_export_direct import _as_older_producer, _publish

from vllm_hs_compat import errors as E
from vllm_hs_compat.export import ExportConsumer, ExportProducer
from vllm_hs_compat.export import plain as PL
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.control import ControlServer, new_token

Make = Callable[..., ExportProducer]
MiB = 1 << 20


def _plain_counters(st: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in st.items() if "plain" in k or "direct_requests" in k or k == "control_forwarded"}


def test_trainer_requests_go_plain_with_identical_results(make_producer: Make) -> None:
    p = make_producer()
    for i in range(5):
        _publish(p, f"r{i}", i)
    assert p.plain_endpoint is not None
    with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=4 * MiB) as c:
        assert c.direct and c.stats()["plain_switches"] == 1
        wait_until(lambda: p.stats()["control_forwarded"] >= 2, 5, "the gate's report of hello and plain")
        got = [digest(c.fetch(f"r{i}").hidden_states) for i in range(3)]
        got += [digest(r.hidden_states) for r in c.iter_records(batch=2, wait_s=0.2, idle_timeout_s=0.5)]  # type: ignore[union-attr]
        c.settle_pending()
        time.sleep(0.2)
        st = p.stats()
        # after hello (and the `plain` op) nothing more went through the gate, nor through the CURVE direct socket
        assert st["control_forwarded"] == 2, _plain_counters(st)
        assert st["control_direct_requests"] == 0, _plain_counters(st)
        assert st["control_plain_authenticated"] == 1 and st["control_plain_requests"] >= 6, _plain_counters(st)
    assert got == [digest(make_rows(i, 50, 2, 64)) for i in range(5)]
    assert p.stats()["delivered"] == 5 and p.stats()["leases_claimed"] == 0
    # negative control: plain=False keeps the trainer off the channel (its CURVE direct socket instead)
    _publish(p, "x", 7)
    before = p.stats()["control_plain_requests"]
    with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=MiB, plain=False) as g:
        assert g.direct and g.stats()["plain_switches"] == 0
        assert digest(g.fetch("x").hidden_states) == digest(make_rows(7, 50, 2, 64))
    st = p.stats()
    assert st["control_plain_requests"] == before and st["control_direct_requests"] >= 2, _plain_counters(st)
    # a ticket holder is refused the endpoint
    ticket = _publish(p, "t", 8)
    with ExportConsumer(ticket.endpoint, None, ticket=ticket, timeout_s=5, landing_bytes=MiB) as h:
        assert not h.direct and h.stats()["plain_switches"] == 0
        with pytest.raises(E.ExportError, match="needs the trainer token"):
            h._channel.exchange(P.PlainReq(), 5)


# --- raw peers ----------------------------------------------------------------------------------------------------
def _greeting(s: socket.socket) -> bytes:
    got = b""
    while len(got) < len(PL.MAGIC) + PL.NONCE_BYTES:
        chunk = s.recv(64)
        if not chunk:
            raise ConnectionError("closed during the greeting")
        got += chunk
    assert got[: len(PL.MAGIC)] == PL.MAGIC
    return got[len(PL.MAGIC) :]


def _handshake(s: socket.socket, token: str) -> None:
    """The trainer's side of the handshake by hand (``token``: the key it proves)."""
    theirs, mine = _greeting(s), os.urandom(PL.NONCE_BYTES)
    key = PL.plain_key(token)
    s.sendall(mine + hmac.digest(key, b"c" + theirs + mine, "sha256"))
    proof = b""
    while len(proof) < PL.MAC_BYTES:
        chunk = s.recv(PL.MAC_BYTES - len(proof))
        if not chunk:
            raise ConnectionError("the handshake was refused")
        proof += chunk
    assert hmac.compare_digest(proof, hmac.digest(key, b"s" + mine + theirs, "sha256"))


def _ping(s: socket.socket) -> bool:
    """Send a ping frame: whether a pong came back within 2 s."""
    body = P.HEADER + os.urandom(P.RID_BYTES) + P.encode(P.PingReq())
    try:
        s.sendall(struct.pack("<I", len(body)) + body)
        s.settimeout(2.0)
        return len(s.recv(4096)) > 0
    except OSError:
        return False


def _probe(endpoint: str, token: str) -> tuple[bool, str]:
    """A raw peer that answers the challenge with ``token``'s key and pings: (answered, how it ended)."""
    host, port = endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        theirs, mine = _greeting(s), os.urandom(PL.NONCE_BYTES)
        s.sendall(mine + hmac.digest(PL.plain_key(token), b"c" + theirs + mine, "sha256"))
        s.settimeout(2.0)
        try:
            proof = s.recv(PL.MAC_BYTES)
        except (TimeoutError, OSError) as e:
            return False, f"no proof ({e})"
        if not proof:
            return False, "closed after the answer"
        return _ping(s), "proof received"


def test_a_wrong_token_is_refused_before_any_request() -> None:
    token, other = new_token(), new_token()
    srv = ControlServer(lambda req, call: P.PongReply(producer="ab12"), token, producer="ab12")
    try:
        ep = f"127.0.0.1:{srv.plain_port}"
        answered, how = _probe(ep, other)
        assert not answered and how == "closed after the answer", how
        assert srv.counters["plain_bad_handshakes"] == 1 and srv.counters["plain_requests"] == 0
        with pytest.raises(E.AuthError, match="token does not match"):
            PL.PlainClient(ep, other, 5.0, max_reply_bytes=P.DEFAULT_REPLY_BYTES)
        # the probe's positive case: the right key is answered
        answered, how = _probe(ep, token)
        assert answered, how
        client = PL.PlainClient(ep, token, 5.0, max_reply_bytes=P.DEFAULT_REPLY_BYTES)
        try:
            rep, producer = client.call(P.PingReq())
            assert isinstance(rep, P.PongReply) and producer == "ab12"
        finally:
            client.close()
        assert srv.counters["plain_bad_handshakes"] == 2 and srv.counters["plain_authenticated"] == 2
    finally:
        srv.close()


def test_negative_control_a_handshake_that_accepts_any_answer_lets_the_peer_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe above detects a leak: with the producer's check accepting any answer, a wrong token is served."""
    monkeypatch.setattr(PL.PlainServer, "_accepts", lambda self, nonce, theirs, mac: True)
    token = new_token()
    srv = ControlServer(lambda req, call: P.PongReply(producer="ab12"), token, producer="ab12")
    try:
        answered, how = _probe(f"127.0.0.1:{srv.plain_port}", new_token())
        assert answered, how
        assert srv.counters["plain_requests"] == 1
    finally:
        srv.close()


def test_a_client_refuses_a_producer_of_another_token() -> None:
    """Mutual: a listener that cannot prove the token (here: keyed by another one) is refused by the trainer."""
    srv = ControlServer(lambda req, call: P.PongReply(producer="ab12"), new_token(), producer="ab12")
    try:
        with pytest.raises(E.AuthError):
            PL.PlainClient(f"127.0.0.1:{srv.plain_port}", new_token(), 5.0, max_reply_bytes=P.DEFAULT_REPLY_BYTES)
    finally:
        srv.close()


def test_hostile_connections_are_bounded_and_the_trainer_still_served() -> None:
    """In a producer process of its own: garbage, silence past the handshake deadline, more half-open connections
    than MAX_PENDING, an authenticated peer announcing a 1 GiB frame.  Each is dropped and counted; the process
    stays up, does not grow, and a trainer is served throughout (through the gate while the pending slots are full,
    on the plain channel again once they have timed out)."""
    peer = Peer()
    try:
        token = "p" * 40
        info = peer.ok("producer", backend="shm", num_slots=4, slot_bytes=MiB, token=token, handshake_timeout_s=1.0)
        host, port = info["plain"].rsplit(":", 1)
        pid = peer.proc.pid
        peer.ok("publish", record_id="h0", seed=0, tokens=50, planes=2, hidden=64)
        rss0, _ = process_memory(pid)
        # garbage instead of the handshake answer, and a longer answer than the handshake's 64 bytes
        for junk in (os.urandom(64), os.urandom(4096)):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                _greeting(s)
                s.sendall(junk)
                s.settimeout(2.0)
                assert s.recv(64) == b""  # closed, no proof
        # an authenticated peer announcing a frame far past the request bound
        with socket.create_connection((host, int(port)), timeout=5) as s:
            _handshake(s, token)
            s.sendall(struct.pack("<I", 1 << 30) + b"x" * 1024)
            s.settimeout(2.0)
            assert s.recv(64) == b""
        # silent connections: more than MAX_PENDING at once; the extra ones are closed at accept
        silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(PL.MAX_PENDING + 16)]
        try:
            wait_until(
                lambda: peer.ok("pstats")["stats"]["control_plain_refused"] >= 16, 5, "the extra connections refused"
            )
            # the trainer is served meanwhile: its plain connection is refused, it stays on a CURVE path
            with ExportConsumer(info["endpoint"], token, timeout_s=10, landing_bytes=MiB) as c:
                assert c.stats()["plain_switches"] == 0 and c.stats()["direct_failures"] == 1
                assert digest(c.fetch("h0").hidden_states) == digest(make_rows(0, 50, 2, 64))
            wait_until(
                lambda: peer.ok("pstats")["stats"]["control_plain_handshake_timeouts"] >= PL.MAX_PENDING,
                10,
                "the silent connections timed out",
            )
        finally:
            for s in silent:
                s.close()
        st = peer.ok("pstats")["stats"]
        assert peer.proc.poll() is None, "the producer process died"
        assert st["control_plain_bad_handshakes"] == 2 and st["control_plain_bad_frames"] == 1, _plain_counters(st)
        assert st["control_plain_requests"] == 0, _plain_counters(st)  # nothing of theirs reached the handler
        rss1, _ = process_memory(pid)
        assert rss1 - rss0 < 8, f"the producer grew {rss1 - rss0:.1f} MiB under hostile connections"
        # the slots are free again: the trainer is back on the plain channel
        peer.ok("publish", record_id="h1", seed=1, tokens=50, planes=2, hidden=64)
        with ExportConsumer(info["endpoint"], token, timeout_s=10, landing_bytes=MiB) as c:
            assert c.stats()["plain_switches"] == 1
            assert digest(c.fetch("h1").hidden_states) == digest(make_rows(1, 50, 2, 64))
    finally:
        peer.close()


def test_an_older_producer_without_the_op_leaves_the_trainer_on_its_direct_socket(make_producer: Make) -> None:
    p = make_producer()
    _publish(p, "o", 3)
    _as_older_producer(p, P.PlainReq, "plain")
    with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=MiB) as c:
        st = c.stats()
        assert c.direct and st["plain_switches"] == 0 and st["direct_failures"] == 0, st
        assert digest(c.fetch("o").hidden_states) == digest(make_rows(3, 50, 2, 64))
    assert p.stats()["control_direct_requests"] >= 1


def test_plain_key_is_the_tokens_and_never_the_token() -> None:
    token = new_token()
    key = PL.plain_key(token)
    assert key == hmac.new(token.encode(), b"hs-compat plain channel v1", hashlib.sha256).digest()
    assert token.encode() not in key and len(key) == 32
