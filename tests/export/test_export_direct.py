"""The trainer's direct control path: a CURVE ROUTER in the producer's own process, past the gate, whose ZAP
handler admits the trainer's key only (see docs/export.md, "The trainer's direct path").

Real CURVE peers throughout: a trainer consumer moves to the direct socket after hello and gets the same
results; a raw peer with any other key is denied at ZAP and delivers nothing, even with the duplicate-id flood
and reset of test_export_zmq_abort.py (the producer, in its own process, stays up and does not grow); an
unreachable direct endpoint leaves the consumer on the gate, and one that drops mid-session sends the
request again through the gate.  Negative control: a ZAP verdict that admits any key lets the raw peer's
message through, which the same probe detects.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq
from hsx_harness import Peer, free_port, process_memory, wait_until
from hsx_testdata import digest, make_meta, make_rows
from test_export_zmq_abort import FLOOD, _reset

from vllm_hs_compat.export import ExportConsumer, ExportProducer
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.consumer import channel as consumer_channel
from vllm_hs_compat.export.control import ControlClient, ControlServer, new_token

Make = Callable[..., ExportProducer]
MiB = 1 << 20


def _publish(p: ExportProducer, rid: str, seed: int) -> P.ExportTicket:
    rows = make_rows(seed, 50, 2, 64)
    ticket = p.publish(make_meta(rid, rows, seed), rows)
    return P.ExportTicket.parse(json.loads(json.dumps(ticket.kv_transfer_params())))


def _direct_counters(st: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in st.items() if k.startswith("control_direct") or k == "control_forwarded"}


def test_trainer_requests_go_direct_with_identical_results(make_producer: Make) -> None:
    p = make_producer()
    for i in range(5):
        _publish(p, f"r{i}", i)
    assert p.direct_endpoint is not None
    # plain=False: the CURVE direct socket (the plain channel comes first otherwise: test_export_plain.py)
    with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=4 * MiB, plain=False) as c:
        assert c.direct and c.stats()["direct_switches"] == 1
        # the gate reports its forward count every 50 ms
        wait_until(lambda: p.stats()["control_forwarded"] >= 2, 5, "the gate's report of hello and direct")
        got = [digest(c.fetch(f"r{i}").hidden_states) for i in range(3)]
        got += [digest(r.hidden_states) for r in c.iter_records(batch=2, wait_s=0.2, idle_timeout_s=0.5)]  # type: ignore[union-attr]
        c.settle_pending()
        time.sleep(0.2)
        st = p.stats()
        # after hello (and the `direct` op) nothing more went through the gate
        assert st["control_forwarded"] == 2, _direct_counters(st)
        assert st["control_direct_requests"] >= 5 and st["control_direct_zap_accepted"] == 1, _direct_counters(st)
        assert st["control_direct_zap_denied"] == 0
    with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=4 * MiB, direct=False) as g:
        assert not g.direct
        # the same records through the gate (re-published: the first consumer consumed them)
        for i in range(5):
            _publish(p, f"g{i}", i)
        expected = [digest(g.fetch(f"g{i}").hidden_states) for i in range(5)]
    assert got == expected == [digest(make_rows(i, 50, 2, 64)) for i in range(5)]
    # a ticket holder never switches, and the producer refuses it the endpoint
    ticket = _publish(p, "r5", 5)
    with ExportConsumer(ticket.endpoint, None, ticket=ticket, timeout_s=5, landing_bytes=MiB) as h:
        assert not h.direct and h.stats()["direct_switches"] == 0
        assert digest(h.fetch("r5").hidden_states) == digest(make_rows(5, 50, 2, 64))
    holder = ControlClient(p.endpoint, server_key=p.server_key, timeout_s=5)
    try:
        with pytest.raises(Exception, match="needs the trainer token"):
            holder.call(P.DirectReq())
    finally:
        holder.close()


def _raw_probe(endpoint: str, server_key: str, wait_s: float = 1.5) -> tuple[bool, int]:
    """A CURVE peer with a fresh (non-trainer) key sends a ping to ``endpoint``: (answered, auth failures seen)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        public, secret = zmq.curve_keypair()
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.curve_serverkey = server_key.encode()
        s.curve_publickey, s.curve_secretkey = public, secret
        mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        s.connect(f"tcp://{endpoint}")
        s.send_multipart([P.HEADER, os.urandom(P.RID_BYTES), P.encode(P.PingReq())])
        answered = bool(s.poll(int(wait_s * 1000)))
        denied = 0
        while mon.poll(0):
            mon.recv_multipart()
            denied += 1
        mon.close(linger=0)
        return answered, denied
    finally:
        ctx.destroy(linger=0)


def _denied_attack(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, server_key: str) -> None:
    """test_export_zmq_abort's sequence, aimed at the direct port with non-trainer keys: two connections with
    the routing id b"dup", the second floods FLOOD requests and resets.  The handshakes fail at ZAP."""
    socks = []
    for _ in range(2):
        public, secret = zmq.curve_keypair()
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.curve_serverkey = server_key.encode()
        s.curve_publickey, s.curve_secretkey = public, secret
        s.routing_id = b"dup"
        mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        s.connect(f"tcp://{endpoint}")
        fd, failed, deadline = -1, False, time.monotonic() + 10
        while not failed and time.monotonic() < deadline:
            if mon.poll(100):
                ev = zmq.utils.monitor.recv_monitor_message(mon)
                if ev["event"] == zmq.EVENT_CONNECTED:
                    fd = int(ev["value"])
                else:
                    failed = True
        mon.close(linger=0)
        assert failed, f"a non-trainer key was not refused at {endpoint} within 10 s"
        socks.append((s, fd))
    second, fd = socks[1]
    for _ in range(FLOOD):  # queued at the client while it reconnects (a refused peer never sends them)
        try:
            second.send_multipart([P.HEADER, os.urandom(P.RID_BYTES), P.encode(P.PingReq())], zmq.NOBLOCK)
        except zmq.Again:
            break
    time.sleep(0.05)
    try:
        _reset(second, fd)  # the fd may already be closed by the refusal: then this only closes the socket
    except OSError:
        second.close(linger=0)
    time.sleep(0.2)
    socks[0][0].close(linger=0)


def test_other_keys_are_denied_at_zap_and_deliver_nothing() -> None:
    peer = Peer()
    try:
        info = peer.ok("producer", backend="shm", num_slots=4, slot_bytes=MiB, token="d" * 40)
        direct, pid = info["direct"], peer.proc.pid
        st0 = peer.ok("pstats")["stats"]
        answered, denied = _raw_probe(direct, _server_key("d" * 40))
        assert not answered and denied >= 1
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            _denied_attack(ctx, direct, _server_key("d" * 40))  # warm-up (allocator, first connections)
            rss0, _ = process_memory(pid)
            for _ in range(5):
                _denied_attack(ctx, direct, _server_key("d" * 40))
        finally:
            ctx.destroy(linger=0)
        rss1, _ = process_memory(pid)
        st = peer.ok("pstats")["stats"]
        assert peer.proc.poll() is None, "the producer process died"
        assert st["control_direct_requests"] == st0["control_direct_requests"] == 0, _direct_counters(st)
        assert st["control_direct_bad_frames"] == 0 and st["control_requests"] == st0["control_requests"]
        assert st["control_direct_zap_denied"] >= 1 + 12, _direct_counters(st)  # probe + 6 attacks x 2 keys
        assert rss1 - rss0 < 8, f"the producer grew {rss1 - rss0:.1f} MiB under denied connections"
        # the trainer is still served there
        with ExportConsumer(info["endpoint"], "d" * 40, timeout_s=10, landing_bytes=MiB) as c:
            assert c.direct
    finally:
        peer.close()


def _server_key(token: str) -> str:
    from vllm_hs_compat.export.control import server_key

    return server_key(token)


def test_negative_control_a_zap_that_admits_any_key_lets_the_message_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe above detects a leak: with the ZAP verdict admitting every key, the raw peer is answered."""
    monkeypatch.setattr(ControlServer, "_zap_allows", lambda self, domain, mechanism, key: b"trainer")
    token = new_token()
    srv = ControlServer(lambda req, call: P.PongReply(producer="ab12"), token, producer="ab12")
    try:
        answered, denied = _raw_probe(f"127.0.0.1:{srv.direct_port}", srv.server_key, wait_s=5)
        assert answered and denied == 0
        assert srv.counters["direct_requests"] == 1 and srv.counters["direct_zap_denied"] == 0
    finally:
        srv.close()


def test_unreachable_direct_endpoint_keeps_the_gate(make_producer: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(consumer_channel, "DIRECT_CONFIRM_S", 0.5)
    p = make_producer()
    _publish(p, "a", 1)
    p.direct_endpoint = f"127.0.0.1:{free_port()}"  # advertised, nothing listens there
    with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=MiB, plain=False) as c:
        assert not c.direct and c.stats()["direct_failures"] == 1
        assert digest(c.fetch("a").hidden_states) == digest(make_rows(1, 50, 2, 64))
    assert p.stats()["control_direct_requests"] == 0


class _Relay:
    """A TCP relay in front of the direct port (the test's handle to make it unreachable mid-session)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                a, _ = self.lsock.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            self.conns += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(x, y), daemon=True).start()

    @staticmethod
    def _pipe(x: socket.socket, y: socket.socket) -> None:
        try:
            while data := x.recv(65536):
                y.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.closed = True
        self.lsock.close()
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


@pytest.mark.parametrize("channel", ["direct", "plain"])
def test_direct_endpoint_lost_mid_session_falls_back_to_the_gate(make_producer: Make, channel: str) -> None:
    """The CURVE direct socket, or the plain channel (test_export_plain.py), lost mid-session."""
    p = make_producer()
    for i in range(3):
        _publish(p, f"m{i}", i)
    plain = channel == "plain"
    relay = _Relay(("127.0.0.1", p._server.plain_port if plain else p._server.direct_port))
    if plain:
        p.plain_endpoint = f"127.0.0.1:{relay.port}"
    else:
        p.direct_endpoint = f"127.0.0.1:{relay.port}"
    try:
        with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=MiB, plain=plain) as c:
            assert c.direct and c.stats()["plain_switches"] == int(plain)
            assert digest(c.fetch("m0").hidden_states) == digest(make_rows(0, 50, 2, 64))
            relay.close()  # the direct endpoint becomes unreachable
            t0 = time.monotonic()
            assert digest(c.fetch("m1").hidden_states) == digest(make_rows(1, 50, 2, 64))
            assert time.monotonic() - t0 < 5, "the fall-back waited for a timeout"
            st = c.stats()
            assert st["direct_fallbacks"] == 1 and not c.direct, st
            assert digest(c.fetch("m2").hidden_states) == digest(make_rows(2, 50, 2, 64))
        wait_until(lambda: p.stats()["leases_claimed"] == 0, 5, "every lease released")
    finally:
        relay.close()


def test_hello_reply_is_unchanged_and_an_older_producer_keeps_the_gate(make_producer: Make) -> None:
    # the hello reply carries no new field: a reply as an older producer encodes it decodes, and an older
    # consumer (replies forbid unknown fields) would refuse a hello that carried one (why `direct` is an op)
    old = {"t": "hello", "producer": "ab" * 8, "backend": "shm", "principal": "trainer", "pool_bytes": 4096,
           "slot_bytes": 4096, "lease_ttl_s": 30.0, "max_read_bytes": 4096, "transport": None}  # fmt: skip
    assert isinstance(P.decode_reply(msgspec.msgpack.encode(old)), P.HelloReply)
    with pytest.raises(P.ProtocolError):
        P.decode_reply(msgspec.msgpack.encode({**old, "direct": "127.0.0.1:1"}))
    p = make_producer()
    _publish(p, "o", 3)
    _as_older_producer(p, P.DirectReq, "direct")
    with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=MiB, plain=False) as c:
        assert not c.direct and c.stats()["direct_failures"] == 0
        assert digest(c.fetch("o").hidden_states) == digest(make_rows(3, 50, 2, 64))


def _as_older_producer(p: ExportProducer, op: type[P.Request], name: str) -> None:
    """``p`` answers the request type ``op`` as a producer that does not know it: a ``protocol`` error."""
    handler = p._server._handler

    def older(req: P.Request, call: object) -> P.Reply | None:
        if isinstance(req, op):  # what an older producer's decoder answers to an unknown op
            raise P.ProtocolError(f"request does not fit the wire-4 schema: Invalid value {name!r}")
        return handler(req, call)  # type: ignore[arg-type]

    p._server._handler = older


def test_a_killed_gate_does_not_interrupt_a_direct_trainer(make_producer: Make) -> None:
    p = make_producer()
    _publish(p, "k1", 1)
    with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=MiB) as c:
        assert c.direct
        os.kill(p.stats()["control_gate_pid"], signal.SIGKILL)
        t0 = time.monotonic()
        assert digest(c.fetch("k1").hidden_states) == digest(make_rows(1, 50, 2, 64))
        assert time.monotonic() - t0 < 1.0 and c.direct and c.stats()["direct_fallbacks"] == 0
        wait_until(lambda: p.stats()["control_gate_restarts"] == 1, 10, "the gate restarted")
