"""The faults of issue #7, each tried the way an attacker or an unlucky deployment on this host would, and the
ledger under a random fault workload.  Producer and consumer run in two processes unless a test says otherwise;
every loop has a count and every wait a deadline.
"""

from __future__ import annotations

import array
import hashlib
import logging
import os
import random
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from hsx_harness import Peer, ledger_balanced, process_memory, wait_until
from hsx_testdata import digest, make_meta, make_rows

from vllm_hs_compat.export import (
    CapabilityError,
    ExportConsumer,
    ExportProducer,
    ExportTicket,
    LeaseExpiredError,
    PoolFullError,
    ProtocolError,
)
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.control import ControlClient
from vllm_hs_compat.export.server import _SERVER_MAXMSGSIZE

MiB = 1 << 20
TOKEN = "t" * 40
Make = Callable[..., ExportProducer]


@pytest.fixture
def make_producer(backend: str) -> Iterator[Make]:
    made: list[ExportProducer] = []

    def make(**kw: Any) -> ExportProducer:
        kw.setdefault("num_slots", 16)
        kw.setdefault("slot_bytes", MiB)
        kw.setdefault("backend", backend)
        p = ExportProducer(**kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def shm_producer() -> Iterator[Make]:
    """Producers of the control-plane tests: the control plane is the same whatever the transport."""
    made: list[ExportProducer] = []

    def make(**kw: Any) -> ExportProducer:
        p = ExportProducer(backend="shm", **{"num_slots": 16, "slot_bytes": MiB, **kw})
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def publish(p: ExportProducer, rid: str, tokens: int, planes: int = 2, hidden: int = 64, seed: int = 0) -> str:
    rows = make_rows(seed, tokens, planes, hidden)
    p.publish(make_meta(rid, rows, seed), rows)
    return digest(rows)


# --- 1. one token opened every record ---------------------------------------------------------------------------
def test_a_ticket_opens_its_own_record_and_nothing_else(
    backend: str, make_producer: Make, peers: dict[str, Peer]
) -> None:
    p = make_producer(token=TOKEN)
    ticket_a = p.ticket("req-A").kv_transfer_params()  # minted first (as the connector's scheduler does)
    rows_a = make_rows(1, 20, 2, 64)
    p.publish(make_meta("req-A", rows_a, 1), rows_a, ExportTicket.parse(ticket_a).publication)
    h_a = digest(rows_a)
    h_b = publish(p, "req-B", 20, seed=2)
    assert TOKEN not in str(ticket_a)
    client = peers["no-token"]  # whoever sent request A: its ticket, nothing else (no token in its environment)
    ans = client.ok("ticket_consumer", params=ticket_a, timeout_s=10.0)
    assert ans["principal"] == "record"
    assert ans["hello"]["transport"] is None  # no pool address, no NIXL metadata: nothing to READ the pool with
    res = client.ok("fetch", ids=["req-A", "req-B"])["results"]
    assert res[0]["ok"] and res[0]["sha256"] == h_a
    assert res[1]["ok"] is False and res[1]["error"] == "CapabilityError", res[1]
    (streamed,) = client.ok("iter", idle_s=0.3, max=1)["results"]  # claim_next: the trainer's alone
    assert streamed["error"] == "CapabilityError"
    assert client.call("remote_stats")["error"] == "CapabilityError"
    cap_a = ticket_a["hs_export"]["cap"]
    with ExportConsumer(p.endpoint, p.token) as trainer:
        claim_b = trainer.claim("req-B")
        anon = ControlClient(p.endpoint, server_key=p.server_key, timeout_s=5)
        try:  # knowing B's lease id and nonce is not enough: the capability names record A
            for req in (
                P.ReleaseReq([P.ReleaseItem(claim_b.lease, claim_b.nonce, "abandoned")], cap=cap_a),
                P.ReadReq(claim_b.lease, claim_b.nonce, 0, 16, cap=cap_a),
                P.ClaimReq(["req-A", "req-B"], cap=cap_a),
                P.ClaimReq(["req-B"], cap=cap_a),
                P.ClaimNextReq(max_records=1, max_bytes=MiB, wait_s=0.0),
                P.StatsReq(),
            ):
                with pytest.raises(CapabilityError):
                    anon.call(req)
        finally:
            anon.close()
        assert p.stats()["leases_claimed"] == 1  # B is still the trainer's
        (rec,) = trainer.read([claim_b])
        assert not isinstance(rec, Exception) and digest(rec.hidden_states) == h_b
    # the same record id on another producer sharing the token (a DP rank): A's capability does not open it
    q = make_producer(token=TOKEN)
    publish(q, "req-A", 20, seed=3)
    moved = {**ticket_a["hs_export"], "endpoint": q.endpoint, "producer": q.instance}
    with ExportConsumer(q.endpoint, None, ticket=ExportTicket.parse({"hs_export": moved})) as c:
        with pytest.raises(CapabilityError):
            c.fetch("req-A")
    st = p.stats()
    assert st["delivered"] == 2 and st["control_capability_refusals"] >= 9
    ledger_balanced(st)


# --- 2. unauthenticated sockets locked real consumers out -------------------------------------------------------
GREETING_CURVE = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\x00" + b"\0" * 31


def test_300_idle_unauthenticated_sockets_leave_a_real_consumer_served_every_time(shm_producer: Make) -> None:
    p = shm_producer(handshake_timeout_s=4.0)
    host, port = p.endpoint.rsplit(":", 1)
    idle: list[socket.socket] = []
    try:
        for i in range(300):
            s = socket.create_connection((host, int(port)), timeout=5)
            if i % 3 == 1:
                s.sendall(GREETING_CURVE[:10])  # half a greeting
            elif i % 3 == 2:
                s.sendall(GREETING_CURVE)  # a greeting, then nothing
            idle.append(s)
        wait_until(lambda: p.stats()["control_connections"] >= 300, 10.0, "300 idle connections to be accepted")
        served = []
        with ExportConsumer(p.endpoint, p.token, landing_bytes=4 * MiB, timeout_s=5.0) as c:
            for i in range(22):
                h = publish(p, f"r{i}", 8, seed=i)
                t0 = time.monotonic()
                if digest(c.fetch(f"r{i}").hidden_states) == h:
                    served.append(time.monotonic() - t0)
        assert len(served) == 22, f"served {len(served)} of 22"
        assert max(served) < 2.0
        # the idle sockets are dropped at the handshake deadline, and counted
        wait_until(
            lambda: (
                p.stats()["control_handshake_failures_other"] + p.stats()["control_handshake_failures_protocol"] >= 300
            ),
            15.0,
            "the idle sockets' handshake timeouts to be counted",
        )
        assert p.stats()["control_requests"] >= 22 + 22  # claim + release per fetch, all from the one consumer
    finally:
        for s in idle:
            s.close()


# --- 3. pre-auth memory ---------------------------------------------------------------------------------------
def test_64_half_sent_frames_before_the_handshake_hold_at_most_a_few_mib(tmp_path: Any) -> None:
    srv = Peer()
    try:
        ans = srv.ok("producer", backend="shm", num_slots=4, slot_bytes=MiB, token=TOKEN, handshake_timeout_s=20.0)
        host, port = ans["endpoint"].rsplit(":", 1)
        time.sleep(0.5)
        gate = srv.ok("pstats")["stats"]["control_gate_pid"]  # the process that holds the public socket
        rss0, threads0 = process_memory(gate)
        socks = []
        try:
            for i in range(64):  # each announces the largest frame the server reads, and sends half of it
                s = socket.create_connection((host, int(port)), timeout=5)
                flags = 0x06 if i % 2 else 0x02  # a command frame, or a message frame before any handshake
                s.sendall(GREETING_CURVE + bytes([flags]) + struct.pack(">Q", _SERVER_MAXMSGSIZE))
                s.sendall(b"\x5a" * (_SERVER_MAXMSGSIZE // 2))
                socks.append(s)
            wait_until(lambda: srv.ok("pstats")["stats"]["control_connections"] >= 64, 10.0, "64 connections accepted")
            time.sleep(0.5)
            rss1, threads1 = process_memory(gate)
            assert srv.ok("pstats")["stats"]["control_gate_pid"] == gate  # the same gate, never restarted
            grown = rss1 - rss0
            # Measured 3.93-4.05 MiB on the 2-core box (the same before and after unrelated changes to the export
            # modules, which move it by ~0.1 MiB): mostly libzmq's per-connection state, ~62 KiB each.  The bound
            # leaves that noise room (a server buffering whole announced frames and more would pass 5 MiB); a thread
            # per connection is caught by the thread count below.
            assert grown <= 5.0, f"64 half-sent frames grew the gate process by {grown:.2f} MiB"
            assert threads1 == threads0  # no thread per connection
            # a frame announced past the limit is refused as soon as its header arrives
            big = socket.create_connection((host, int(port)), timeout=5)
            big.sendall(GREETING_CURVE + b"\x06" + struct.pack(">Q", 1 << 30))
            big.settimeout(5)
            got = b""
            try:
                while len(got) < 4096:
                    chunk = big.recv(4096)
                    if not chunk:
                        break
                    got += chunk
            except OSError:
                pass
            big.close()
            assert len(got) <= 64  # the server's greeting at most, then the connection is closed
            # and a real consumer is served meanwhile
            srv.ok("publish", record_id="meanwhile", seed=4, tokens=6, planes=2, hidden=64)
            with ExportConsumer(ans["endpoint"], TOKEN, landing_bytes=MiB, timeout_s=10) as c:
                assert digest(c.fetch("meanwhile").hidden_states) == digest(make_rows(4, 6, 2, 64))
        finally:
            for s in socks:
                s.close()
    finally:
        srv.close()


# --- 4. a non-ASCII release nonce -----------------------------------------------------------------------------
def test_a_malformed_release_fails_whole_and_frees_nothing(
    shm_producer: Make, caplog: pytest.LogCaptureFixture
) -> None:
    p = shm_producer()
    publish(p, "x", 4, seed=1)
    publish(p, "y", 4, seed=2)
    c = ControlClient(p.endpoint, p.token, timeout_s=5)
    try:
        rep, _ = c.call(P.ClaimReq(["x", "y"]))
        assert isinstance(rep, P.ClaimReply)
        x, y = (P.decode_descriptor(r) for r in rep.records)
        caplog.set_level(logging.DEBUG, logger="vllm_hs_compat")
        for bad in ("é" * 16, "\u0000" * 16, "0123456789ABCDEF", "0123456789abcde\u00e9"):
            with pytest.raises(ProtocolError):
                c.call(
                    P.ReleaseReq(
                        [P.ReleaseItem(x.lease, x.nonce, "delivered"), P.ReleaseItem(y.lease, bad, "delivered")]
                    )
                )
        st = p.stats()
        assert st["leases_claimed"] == 2 and st["released"] == 0  # the good entry before the bad one was not freed
        assert st["control_internal_errors"] == 0
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
        rep, _ = c.call(
            P.ReleaseReq([P.ReleaseItem(x.lease, x.nonce, "delivered"), P.ReleaseItem(y.lease, y.nonce, "abandoned")])
        )
        assert isinstance(rep, P.ReleaseReply) and rep.results == ["released", "released"]
    finally:
        c.close()
    st = p.stats()
    assert (st["delivered"], st["abandoned"]) == (1, 1)
    ledger_balanced(st)


# --- 5. long contexts ----------------------------------------------------------------------------------------
LONG = 131_072


def test_long_context_records_stream_in_full_with_the_default_batch(
    backend: str, make_producer: Make, peer: Peer
) -> None:
    n, first = 130, 70  # 70 records ready before the stream starts: more than a default batch of 64
    slot = 640 * 1024  # 128 KiB of rows + 512 KiB of token ids
    p = make_producer(num_slots=first, slot_bytes=slot, on_full="wait", wait_timeout_s=120, lease_ttl_s=60)
    want = []
    for i in range(n):
        rows = make_rows(i, LONG, 1, 1, "uint8")
        meta = make_meta(f"long-{i}", rows, i)
        want.append((meta.record_id, digest(rows), _ids_digest(meta.token_ids)))
        if i == first:  # the pool is full: start streaming, keep publishing as room comes back
            peer.ok("consumer", endpoint=p.endpoint, token=p.token, landing_bytes=64 * MiB, timeout_s=30.0)
            peer.send("iter", default_batch=True, wait_s=1.0, idle_s=15.0, max=n, brief=True)
        p.publish(meta, rows)
    ans = peer.answer(timeout_s=180)
    assert ans["ok"], ans
    got = [(r.get("record_id"), r.get("sha256"), r.get("ids_sha256")) for r in ans["results"]]
    assert len(got) == n and got == want, [r for r in ans["results"] if not r["ok"]][:3]
    st = p.stats()
    assert st["delivered"] == n and st["expired_claimed"] == st["expired_ready"] == 0
    ledger_balanced(st)


def test_a_claim_sent_twice_with_one_request_id_is_answered_once(shm_producer: Make) -> None:
    """What a client does when its connection drops with a claim in flight: the same request id again."""
    p = shm_producer()
    for i in range(6):
        publish(p, f"i{i}", 4, seed=i)
    c = ControlClient(p.endpoint, p.token, timeout_s=5)
    try:
        for req in (
            P.ClaimNextReq(max_records=4, max_bytes=MiB, wait_s=0.0),
            P.ClaimReq(["i5", "nope"]),
            P.ClaimNextReq(max_records=4, max_bytes=MiB, wait_s=0.0),  # one record left
        ):
            frames = [P.HEADER, P.new_rid(), P.encode(req)]
            answers = []
            for _ in range(2):
                c._sock.send_multipart(frames)
                assert c._sock.poll(5000)
                answers.append(P.decode_reply(c._sock.recv_multipart()[3]))
            assert answers[0] == answers[1], answers  # the same leases (and errors), not a second batch
        st = p.stats()
        assert st["claimed"] == 6 and st["leases_claimed"] == 6 and st["claim_retries"] == 3
    finally:
        c.close()


def _ids_digest(ids: tuple[int, ...]) -> str:
    return hashlib.sha256(array.array("I", ids).tobytes()).hexdigest()


# --- 6. a producer in another pid namespace ------------------------------------------------------------------
@pytest.fixture
def private_shm() -> Iterator[str]:
    """A directory of our own on the tmpfs: sweeps here touch no other process's pool."""
    d = tempfile.mkdtemp(prefix="hsx-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _dead_pid() -> int:
    """A small pid that no process of this namespace has."""
    for pid in range(3, 1 << 15):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise RuntimeError("no free pid")


def _foreign_producer_survives_the_sweep(peer: Peer, shm_dir: str, name_pid: int, started: bool = False) -> None:
    if not started:
        peer.ok(
            "producer", backend="shm", num_slots=2, slot_bytes=MiB, token=TOKEN, shm_dir=shm_dir, shm_handoff="path"
        )
    (name,) = [f for f in os.listdir(shm_dir) if f.endswith(".pool")]
    path = os.path.join(shm_dir, name)
    endpoint = peer.ok("pstats")["endpoint"]
    assert os.path.basename(path).startswith(f"hsx2-{name_pid}-")
    with pytest.raises(ProcessLookupError):
        os.kill(name_pid, 0)  # the pid in its name is dead here: a pid-based sweep would unlink the live pool
    peer.ok("publish", record_id="live", seed=5, tokens=6, planes=2, hidden=64)
    with ExportProducer(backend="shm", num_slots=2, slot_bytes=MiB, shm_dir=shm_dir):  # its start-up sweep
        assert os.path.exists(path)
    with ExportConsumer(endpoint, TOKEN, landing_bytes=MiB, shm_dir=shm_dir, timeout_s=10) as c:
        assert digest(c.fetch("live").hidden_states) == digest(make_rows(5, 6, 2, 64))


def test_a_live_producer_in_another_pid_namespace_keeps_its_pool(private_shm: str) -> None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root (the simulated namespace test runs everywhere)")
    pid = _dead_pid()
    # In a fresh pid namespace pids count from 1: burn pid-2 of them so the peer's pid there is ``pid``.
    burn = f'i=2; while [ "$i" -lt {pid} ]; do /bin/true; i=$((i+1)); done; "$0" "$@"'
    peer = Peer(prefix=["unshare", "--pid", "--fork", "sh", "-c", burn])
    try:
        assert peer.pid == pid, f"peer has pid {peer.pid} in its namespace, expected {pid}"
        _foreign_producer_survives_the_sweep(peer, private_shm, pid)
    finally:
        peer.close()


def test_a_live_producer_whose_pid_means_nothing_here_keeps_its_pool(private_shm: str, peers: dict[str, Peer]) -> None:
    """The simulated foreign namespace: the producer names its file with a pid that is dead in this one."""
    pid = _dead_pid()
    peer = peers["main"]
    try:
        peer.ok(
            "producer",
            fake_pid=pid,
            backend="shm",
            num_slots=2,
            slot_bytes=MiB,
            token=TOKEN,
            shm_dir=private_shm,
            shm_handoff="path",
        )
        _foreign_producer_survives_the_sweep(peer, private_shm, pid, started=True)
    finally:
        peer.ok("close_producer")


def test_the_pool_of_a_killed_producer_is_swept(private_shm: str) -> None:
    peer = Peer()
    try:
        path = peer.ok("producer", backend="shm", num_slots=1, slot_bytes=MiB, shm_dir=private_shm, shm_handoff="path")[
            "path"
        ]
        peer.kill()  # SIGKILL: no close(); the kernel drops its lock
    finally:
        peer.close()
    assert os.path.exists(path)
    with ExportProducer(backend="shm", num_slots=1, slot_bytes=MiB, shm_dir=private_shm, shm_handoff="path") as p:
        assert not os.path.exists(path)
        assert sorted(os.listdir(private_shm)) == [os.path.basename(p.transport.describe()["path"])]


# --- 7. one bad descriptor ---------------------------------------------------------------------------------
def test_a_bad_descriptor_fails_its_record_alone(backend: str, make_producer: Make, peer: Peer) -> None:
    p = make_producer(lease_ttl_s=1.0)
    hs = [publish(p, f"d{i}", 8, seed=i) for i in range(4)]
    # d1: msgpack of the schema's shape but inconsistent (layer ids of 1 plane for 2: no RecordMeta can be made of
    # it, so it is edited as a map); d3: truncated bytes.  As a producer bug or a corrupted reply would make them.
    l1, l3 = p.pool._by_record["d1"], p.pool._by_record["d3"]
    d1 = msgspec.msgpack.decode(l1.wire)
    d1["meta"]["layer_ids"] = d1["meta"]["layer_ids"][:1]
    l1.wire = msgspec.msgpack.encode(d1)
    l3.wire = l3.wire[: len(l3.wire) // 2]
    peer.ok("consumer", endpoint=p.endpoint, token=p.token, landing_bytes=4 * MiB, timeout_s=10.0)
    res = peer.ok("iter", batch=8, idle_s=0.5)["results"]
    assert [(r["ok"], r.get("record_id"), r.get("error")) for r in res] == [
        (True, "d0", None),
        (False, None, "DescriptorError"),
        (True, "d2", None),
        (False, None, "DescriptorError"),
    ]
    assert [res[0]["sha256"], res[2]["sha256"]] == [hs[0], hs[2]]
    assert peer.ok("cstats")["stats"]["bad_descriptors"] == 2
    # d1's lease was given back at once; d3's could not be read and expires at the producer
    wait_until(lambda: p.stats()["leases_claimed"] == 0, 5.0, "the unreadable descriptor's lease to expire")
    st = p.stats()
    assert (st["delivered"], st["abandoned"], st["expired_claimed"]) == (2, 1, 1)
    ledger_balanced(st)


# --- also: expiry, close, stats ---------------------------------------------------------------------------------
def test_a_read_after_the_lease_expired_is_lease_expired(backend: str, make_producer: Make, tmp_path: Any) -> None:
    p = make_producer(lease_ttl_s=0.3, max_redeliveries=0)  # the requeue is tests/export/test_export_redelivery.py's
    publish(p, "late", 8, seed=1)
    rows = make_rows(2, 8, 2, 64)
    ticket = p.publish(make_meta("late-ticket", rows, 2), rows)
    with ExportConsumer(p.endpoint, p.token, landing_bytes=MiB) as c:
        claim = c.claim("late")
        wait_until(lambda: p.stats()["expired_claimed"] == 1, 5.0, "the lease to expire")  # the slot is untouched
        (res,) = c.read([claim])
        assert isinstance(res, LeaseExpiredError)
    ticket = P.ExportTicket.parse(ticket.kv_transfer_params())
    with ExportConsumer(ticket.endpoint, None, ticket=ticket) as t:  # a ticket holder: reads over the control plane
        claim = t.claim("late-ticket")
        wait_until(lambda: p.stats()["expired_claimed"] == 2, 5.0, "the ticket holder's lease to expire")
        (res,) = t.read([claim])
        assert isinstance(res, LeaseExpiredError)
    st = p.stats()
    assert st["delivered"] == 0 and st["expired_claimed"] == 2
    ledger_balanced(st)


def test_close_counts_what_it_discards(backend: str, make_producer: Make) -> None:
    p = make_producer()
    for i in range(3):
        publish(p, f"c{i}", 4, seed=i)
    with ExportConsumer(p.endpoint, p.token, landing_bytes=MiB) as c:
        c.claim("c0")
        p.close()
    st = p.stats()
    assert st["discarded_at_close"] == 3 and st["leases_ready"] == st["leases_claimed"] == 0
    ledger_balanced(st)


# --- the ledger under a random fault workload ---------------------------------------------------------------------
ACTIONS = ("stream", "read", "abandon", "corrupt", "expire", "kill", "idle")


@pytest.mark.parametrize("seed", [7])
def test_the_ledger_balances_under_random_faults(backend: str, make_producer: Make, peer: Peer, seed: int) -> None:
    """>= 1,000 records through bursts that overflow the pool, a streaming peer, a trainer that reads, abandons,
    lets leases run out or reads corrupted slots, a trainer SIGKILLed with leases held, and idle spells in which
    published records expire.  The ledger balances after every step, and the producer's ``delivered`` is exactly
    the number of records the consumers handed out."""
    rng = random.Random(seed)
    ttl = 0.5
    # at-most-once (every fate must occur; redelivery has its own random-kill ledger test in test_export_redelivery)
    p = make_producer(
        num_slots=48, slot_bytes=16 * 1024, lease_ttl_s=ttl, ready_ttl_s=1.0, on_full="drop", max_redeliveries=0
    )
    peer.ok("consumer", endpoint=p.endpoint, token=p.token, landing_bytes=2 * MiB, timeout_s=10.0)
    trainer = ExportConsumer(p.endpoint, p.token, landing_bytes=2 * MiB, timeout_s=10.0)

    def handed_out() -> int:
        return int(trainer.stats()["records"]) + int(peer.ok("cstats")["stats"]["records"])

    offered = n = 0
    deadline = time.monotonic() + 150
    try:
        for rnd in range(80):
            assert time.monotonic() < deadline, "the workload ran past its deadline"
            for _ in range(rng.randint(30, 90)):  # a burst; a full pool drops the rest
                n += 1
                offered += 1
                rows = make_rows(n, rng.randint(1, 40), 2, 64)
                try:
                    p.publish(make_meta(f"w{n}", rows, n), rows)
                except PoolFullError:
                    pass
            # every action once, then at random (a kill only once: a new process costs seconds)
            action = ACTIONS[rnd] if rnd < len(ACTIONS) else rng.choice([a for a in ACTIONS if a != "kill"])
            if action == "stream":
                peer.ok("iter", batch=rng.randint(1, 32), idle_s=0.2, max=rng.randint(5, 80))
            elif action == "kill":
                victim = Peer()
                try:
                    victim.ok("consumer", endpoint=p.endpoint, token=p.token, landing_bytes=MiB, timeout_s=10.0)
                    for _ in range(30):  # its start took longer than ready_ttl_s: publish for it now
                        n += 1
                        offered += 1
                        rows = make_rows(n, 8, 2, 64)
                        try:
                            p.publish(make_meta(f"w{n}", rows, n), rows)
                        except PoolFullError:
                            pass
                    assert victim.ok("claim_next", n=rng.randint(5, 30))["n"] > 0
                    victim.kill()  # holding its leases
                finally:
                    victim.close()
            elif action == "idle":  # nobody claims for a while: published records expire
                time.sleep(1.1)
            else:
                claims = trainer.claim_next(rng.randint(1, 40), wait_s=0.1)
                if action == "abandon":
                    trainer.abandon(claims)
                elif action == "expire":  # dropped on the floor: the leases run out
                    wait_until(lambda: p.stats()["leases_claimed"] == 0, ttl + 5, "dropped leases to expire")
                else:
                    if action == "corrupt":
                        for c in claims[: rng.randint(1, 3)]:
                            p.transport.buffer[c.offset + rng.randrange(c.nbytes)] ^= 0x40
                    trainer.read(claims)
            st = p.stats()
            ledger_balanced(st)  # after every step, not only when quiet
            if st["leases_claimed"] == 0:
                assert st["delivered"] == handed_out()
            if offered >= 1000 and rnd >= len(ACTIONS):
                break
        assert offered >= 1000
        wait_until(lambda: p.stats()["leases_claimed"] == 0, ttl + 5, "the last leases to end")
        st = p.stats()
        assert st["delivered"] == handed_out()
        for key in ("delivered", "checksum_failed", "abandoned", "expired_ready", "expired_claimed", "dropped_full"):
            assert st[key] > 0, f"the workload produced no {key}: {st}"
        p.close()
        st = p.stats()
        ledger_balanced(st)
        assert st["leases_ready"] == st["leases_claimed"] == 0 and st["offered"] == offered
    finally:
        trainer.close()
