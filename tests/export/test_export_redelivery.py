"""At-least-once delivery (issue 15, item 8): a claimed record whose lease expires unread goes back to the queue.

Unit level on :class:`LeasePool` (injected clock), then against a real producer: a stale lease is refused on
every path while the requeued record is read intact under its new lease, and the kill test -- consumers in forked
processes SIGKILLed at random points while the producer keeps publishing -- loses nothing with redelivery and
loses records without it (the negative control).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from hsx_harness import ledger_balanced, wait_until
from hsx_testdata import Clock, digest, make_finite_rows, make_meta, make_rows, meta

from vllm_hs_compat import errors as E
from vllm_hs_compat.export import ExportConsumer, ExportProducer, LeaseExpiredError, PoolFullError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.pool import REQUEUED, LeasePool
from vllm_hs_compat.trainer import HiddenStatesDataset
from vllm_hs_compat.trainer.dataset import _Recent

MiB = 1 << 20
Make = Callable[..., ExportProducer]


def put(pool: LeasePool, rid: str, nbytes: int = 64) -> None:
    pool.publish(pool.allocate(rid, nbytes), meta(rid), f"wire:{rid}".encode())


# --- the pool -----------------------------------------------------------------------------------------------------
def test_an_expired_claim_comes_back_under_a_new_lease_and_the_old_one_is_dead() -> None:
    clock = Clock()
    pool = LeasePool(8, 64, lease_ttl_s=2.0, ready_ttl_s=None, clock=clock)
    pool.rewire = lambda lease: f"{lease.record_id}:{lease.lease_id}:{lease.nonce}".encode()
    put(pool, "a", 100)
    put(pool, "b")
    (old,) = pool.claim_next(1, 1 << 20, 0.0)
    clock.t += 2.5
    assert pool.expire() == 1
    st = pool.stats()
    assert (st["redelivered"], st["expired_claimed"], st["leases_ready"], st["leases_claimed"]) == (1, 0, 2, 0)
    assert pool.occupancy() == 3  # a's two slots are kept: the bytes stay as published
    # the old lease: no read, no release, told it expired
    assert pool.lease(old.lease_id, old.nonce) is None
    assert pool.fate(old.lease_id, old.nonce) == REQUEUED
    assert pool.settle(old.lease_id, old.nonce, "delivered") == "expired"
    assert pool.settle(old.lease_id, old.nonce, "abandoned") == "expired"
    assert pool.stats()["stale_releases"] == 2 and pool.stats()["leases_ready"] == 2
    # the record went to the back of the queue (b first), same slots, new lease id and nonce, new descriptor
    b, new = pool.claim_next(2, 1 << 20, 0.0)
    assert (b.record_id, new.record_id) == ("b", "a")
    assert new.lease_id != old.lease_id and new.nonce != old.nonce
    assert (new.offset, new.first_slot, new.n_slots, new.nbytes) == (old.offset, old.first_slot, 2, 100)
    assert new.meta is old.meta and new.redeliveries == 1
    assert new.wire == f"a:{new.lease_id}:{new.nonce}".encode()
    assert old.wire == b"wire:a"  # the old lease object never changes (claim_next hands out live leases)
    assert pool.settle(old.lease_id, new.nonce) == "unknown"  # the new nonce does not open the old lease
    assert pool.settle(new.lease_id, old.nonce) == "unknown"  # nor the old nonce the new one
    assert pool.settle(new.lease_id, new.nonce) == "released" and pool.settle(b.lease_id, b.nonce) == "released"
    st = pool.stats()
    assert (st["delivered"], st["claimed"], st["redelivered"], st["unaccounted"], st["used_slots"]) == (2, 3, 1, 0, 0)


def test_redeliveries_are_bounded_then_the_record_ends_expired_claimed() -> None:
    clock = Clock()
    pool = LeasePool(4, 64, lease_ttl_s=1.0, ready_ttl_s=None, clock=clock, max_redeliveries=2)
    put(pool, "poison")
    for n in range(3):
        (c,) = pool.claim_next(1, 1 << 20, 0.0)
        assert c.redeliveries == n
        clock.t += 1.5
        pool.expire()
    st = pool.stats()
    assert (st["claimed"], st["redelivered"], st["expired_claimed"], st["used_slots"]) == (3, 2, 1, 0)
    assert pool.fate(c.lease_id, c.nonce) == "expired_claimed"
    assert pool.claim_next(1, 1 << 20, 0.0) == [] and st["unaccounted"] == 0 and st["max_redeliveries"] == 2


def test_max_redeliveries_zero_is_at_most_once() -> None:
    clock = Clock()
    pool = LeasePool(4, 64, lease_ttl_s=1.0, clock=clock, max_redeliveries=0)
    put(pool, "a")
    pool.claim("a")
    clock.t += 1.5
    pool.expire()
    st = pool.stats()
    assert (st["redelivered"], st["expired_claimed"], st["used_slots"]) == (0, 1, 0)


def test_a_requeued_record_gets_a_fresh_ready_clock() -> None:
    """The documented choice: ``ready_ttl_s`` counts from the requeue, not from the publication."""
    clock = Clock()
    pool = LeasePool(4, 64, lease_ttl_s=3.0, ready_ttl_s=5.0, clock=clock)
    put(pool, "a")
    clock.t += 4.0
    pool.claim("a")  # one second before its ready deadline
    clock.t += 3.5  # the lease runs out at t+7: requeued, ready again until t+12
    pool.expire()
    assert pool.stats()["leases_ready"] == 1
    clock.t += 4.9
    pool.expire()
    assert pool.stats()["leases_ready"] == 1  # 11.9 s after its publication, 4.9 s after the requeue
    clock.t += 0.2
    pool.expire()
    st = pool.stats()
    assert (st["expired_ready"], st["redelivered"], st["used_slots"], st["unaccounted"]) == (1, 1, 0, 0)


def test_a_requeue_wakes_a_waiting_claim_and_the_long_poll_hook() -> None:
    pool = LeasePool(4, 64, lease_ttl_s=0.05, ready_ttl_s=None)
    woken: list[int] = []
    put(pool, "a")
    pool.on_ready = lambda: woken.append(1)
    pool.claim("a")
    got: list[str] = []
    th = threading.Thread(target=lambda: got.extend(x.record_id for x in pool.claim_next(1, 1 << 20, 5.0)))
    th.start()
    time.sleep(0.1)
    pool.expire()  # the pump's sweep: requeues, then calls the hook outside the lock
    th.join(5)
    assert got == ["a"] and woken


def test_a_descriptor_that_cannot_be_re_encoded_ends_the_record_instead() -> None:
    clock = Clock()
    pool = LeasePool(4, 64, lease_ttl_s=1.0, clock=clock)

    def broken(lease: Any) -> bytes:
        raise E.ProtocolError("truncated")

    pool.rewire = broken
    put(pool, "a")
    c = pool.claim("a")
    clock.t += 1.5
    pool.expire()
    st = pool.stats()
    assert (st["redelivered"], st["expired_claimed"], st["used_slots"], st["unaccounted"]) == (0, 1, 0, 0)
    assert pool.fate(c.lease_id, c.nonce) == "expired_claimed"


def test_close_discards_a_requeued_record_once() -> None:
    clock = Clock()
    pool = LeasePool(4, 64, lease_ttl_s=1.0, clock=clock)
    put(pool, "a")
    pool.claim("a")
    clock.t += 1.5
    pool.expire()
    pool.close()
    st = pool.stats()
    assert (st["discarded_at_close"], st["redelivered"], st["used_slots"], st["unaccounted"]) == (1, 1, 0, 0)


# --- a real producer ----------------------------------------------------------------------------------------------
def publish(p: ExportProducer, rid: str, seed: int, tokens: int = 16) -> str:
    rows = make_rows(seed, tokens, 2, 64, "bfloat16")
    p.publish(make_meta(rid, rows, seed), rows)
    return digest(rows)


def test_a_slow_consumer_is_refused_and_the_next_one_reads_the_record_intact(backend: str, make_producer: Make) -> None:
    """A consumer alive but slower than lease_ttl_s: its read and release are refused (it raises nothing, the
    record is not handed out twice from that lease), a ticket holder's too (its bytes came with its claim; their
    release names the dead lease), and the requeued record is read intact under its new lease.  Counts: the slow
    consumer ``lease_expired``; the producer ``stale_releases`` (one per refused release) and ``redelivered``,
    ``delivered`` once per record."""
    p = make_producer(lease_ttl_s=0.3)
    h = publish(p, "slow", 1)
    rows2 = make_rows(2, 16, 2, 64, "bfloat16")
    h2 = digest(rows2)
    issued = p.publish(make_meta("slow-ticket", rows2, 2), rows2)  # the ticket bound to this publication
    rows3 = make_rows(3, 16, 2, 64, "bfloat16")
    issued3 = p.publish(make_meta("slow-read", rows3, 3), rows3)
    with ExportConsumer(p.endpoint, p.token, landing_bytes=MiB) as slow:
        (old,) = slow.claim_next(1, wait_s=1.0)
        wait_until(lambda: p.stats()["redelivered"] == 1, 5.0, "the lease to expire and be requeued")
        (res,) = slow.read([old])
        assert isinstance(res, LeaseExpiredError)
        assert slow.stats()["lease_expired"] == 1
        with ExportConsumer(p.endpoint, p.token, landing_bytes=MiB) as fresh:
            new = fresh.claim("slow")  # (by id: the requeued record is behind slow-ticket in the queue)
            assert (new.record_id, new.offset) == ("slow", old.offset)
            assert (new.lease, new.nonce) != (old.lease, old.nonce)
            rec = fresh.read([new])[0]
            assert not isinstance(rec, Exception) and digest(rec.hidden_states) == h
    ticket = P.ExportTicket.parse(issued.kv_transfer_params())
    with ExportConsumer(ticket.endpoint, None, ticket=ticket) as t:  # reads over the control plane
        c = t.claim("slow-ticket")
        wait_until(lambda: p.stats()["redelivered"] == 2, 5.0, "the ticket holder's lease to be requeued")
        assert c.inline is not None  # the bytes came with the claim: its release is what names the dead lease
        (res,) = t.read([c])  # refused, expired
        assert isinstance(res, LeaseExpiredError)
        assert digest(t.fetch("slow-ticket").hidden_states) == h2  # the same ticket fetches it again
    ticket3 = P.ExportTicket.parse(issued3.kv_transfer_params())
    with ExportConsumer(ticket3.endpoint, None, ticket=ticket3, inline_bytes=0) as t3:  # bytes by `read` requests
        c3 = t3.claim("slow-read")
        assert c3.inline is None
        wait_until(lambda: p.stats()["redelivered"] == 3, 5.0, "the reading holder's lease to be requeued")
        (res,) = t3.read([c3])  # the `read` names the dead lease: refused, expired (no release sent)
        assert isinstance(res, LeaseExpiredError)
        assert digest(t3.fetch("slow-read").hidden_states) == digest(rows3)
    st = p.stats()
    assert (st["delivered"], st["redelivered"], st["expired_claimed"], st["stale_releases"]) == (3, 3, 0, 2)
    ledger_balanced(st)


# --- the kill test --------------------------------------------------------------------------------------------------
KILL_POINTS = ("after_claim", "mid_batch", "before_release", "anywhere")
#: a child that should have killed itself and is still alive this long after its start is a hang: killed, failed
OVERDUE_S = 15.0


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _consumer_child(conn: Any, endpoint: str, token: str, point: str, after: int, batch: int, seed: int) -> None:
    """A trainer worker in a forked process: streams with claim_next, and reports the ids it verified through
    ``conn`` *before* their release leaves (a trainer acknowledges what it has; the report is one pipe write under
    PIPE_BUF, so a kill never tears it).  After ``after`` batches it SIGKILLs itself at ``point``; "anywhere": the
    parent kills it at a random moment."""
    # A fork of a multi-threaded parent: an OpenMP team the parent started is gone here, and a parallel region
    # (a 1 MiB zero_) would wait for it forever; one thread runs every op here (as DataLoader workers do).
    torch.set_num_threads(1)
    rng = random.Random(seed)
    c = ExportConsumer(endpoint, token, landing_bytes=MiB, timeout_s=10.0)
    real = c._releases.release
    done = [0]

    def release(entries: Any, claimed_at: float, names: Any) -> Any:
        conn.send([n for n, e in zip(names, entries, strict=True) if e[2] == "delivered"])
        if point == "before_release" and done[0] >= after:
            _die()  # verified and reported, never released: it must come back, and be dropped as a duplicate
        return real(entries, claimed_at, names)

    c._releases.release = release  # type: ignore[method-assign]
    while True:
        claims = c.claim_next(max_records=batch, wait_s=0.2)
        if not claims:
            continue
        if done[0] >= after:
            if point == "after_claim":
                _die()
            if point == "mid_batch":
                c.read(claims[: rng.randrange(len(claims))])
                _die()
        c.read(claims)
        done[0] += 1


def run_kills(
    max_redeliveries: int, kills: int, seed: int, parallel: int = 2, tokens: int = 8
) -> tuple[ExportProducer, set[str], list[str], dict[str, int]]:
    """Publish continuously while consumers are forked and SIGKILLed until ``kills`` died; then drain what is
    left with a HiddenStatesDataset in this process.  Returns the producer, the ids published, every id reported
    (duplicates included, in arrival order: the forked consumers' reports, then the drain's items) and counts."""
    rng = random.Random(seed)
    p = ExportProducer(
        backend="shm",
        num_slots=256,
        slot_bytes=4096,
        lease_ttl_s=0.3,
        ready_ttl_s=None,
        on_full="wait",
        wait_timeout_s=0.2,
        max_redeliveries=max_redeliveries,
    )
    published: set[str] = set()
    stop = threading.Event()
    # whatever the children import or start lazily is done here, before the publisher thread runs (a fork taken
    # while that thread held an import lock would hang the child on it)
    publish(p, "warm-up", 0, tokens)
    with ExportConsumer(p.endpoint, p.token, landing_bytes=MiB) as c:
        published.add(c.fetch("warm-up").meta.record_id)
    seen: list[str] = ["warm-up"]

    def publisher() -> None:
        n = 0
        while not stop.is_set():
            rid = f"k{n}"
            rows = make_finite_rows(n, tokens, 2, 64, "bfloat16")  # read through the dataset: finite or failed
            try:
                p.publish(make_meta(rid, rows, n), rows)
            except PoolFullError:
                continue  # refused before publication (counted dropped_full): offer the same id again
            published.add(rid)
            n += 1
            if n % 16 == 0:
                time.sleep(0.002)

    counts = dict.fromkeys((*KILL_POINTS, "overdue"), 0)
    ctx = multiprocessing.get_context("fork")
    live: dict[Any, tuple[Any, Any, float, str]] = {}  # sentinel -> (process, conn, kill_at, kill point)
    pub = threading.Thread(target=publisher, daemon=True)
    pub.start()
    died = started = 0
    try:
        while died < kills:
            while len(live) < parallel and started < kills:
                point = KILL_POINTS[started % len(KILL_POINTS)] if started < 8 else rng.choice(KILL_POINTS)
                r, w = ctx.Pipe(duplex=False)
                args = (w, p.endpoint, p.token, point, rng.randint(0, 3), rng.randint(1, 8), rng.randrange(1 << 30))
                proc = ctx.Process(target=_consumer_child, args=args, daemon=True)
                proc.start()
                w.close()
                counts[point] += 1
                # the parent kills "anywhere" at a random moment; the others kill themselves (overdue: a hang)
                kill_at = time.monotonic() + (rng.uniform(0.05, 0.4) if point == "anywhere" else OVERDUE_S)
                live[proc.sentinel] = (proc, r, kill_at, point)
                started += 1
            conns = [conn for _, conn, _, _ in live.values()]
            for ready in multiprocessing.connection.wait([*conns, *live], timeout=0.02):
                if ready in conns:
                    try:
                        seen.extend(ready.recv())  # type: ignore[union-attr]
                    except EOFError:
                        pass  # it died: reaped below
            now = time.monotonic()
            for sentinel, (proc, conn, kill_at, point) in list(live.items()):
                if now >= kill_at:
                    counts["overdue"] += point != "anywhere"  # a self-killing child that never got there
                    proc.kill()  # (SIGKILL; a no-op for one already reaped)
                if not proc.is_alive():
                    while conn.poll():  # what it reported before it died
                        try:
                            seen.extend(conn.recv())
                        except EOFError:
                            break
                    proc.join()
                    conn.close()
                    assert proc.exitcode == -signal.SIGKILL, f"a consumer exited {proc.exitcode}, not killed"
                    del live[sentinel]
                    died += 1
    finally:
        stop.set()
        pub.join(10)
        for proc, conn, _, _ in live.values():
            proc.kill()
            proc.join()
            conn.close()
    # the dead consumers' last leases run out (<= lease_ttl_s): requeued, or lost without redelivery
    wait_until(lambda: p.stats()["leases_claimed"] == 0, 5.0, "the dead consumers' leases to end")
    ds = HiddenStatesDataset.from_export(p.endpoint, p.token, wait_s=0.5, batch=16, layout="planes")
    seen.extend(item["record_id"] for item in ds)
    counts["drained"] = ds.stats["records"]
    counts["died"] = died
    return p, published, seen, counts


def test_consumers_sigkilled_at_random_points_lose_no_record() -> None:
    t0 = time.monotonic()
    p, published, seen, counts = run_kills(max_redeliveries=3, kills=60, seed=15)  # 3: the default
    try:
        st = p.stats()
        assert counts["died"] >= 50 and all(counts[k] > 0 for k in KILL_POINTS) and counts["overdue"] == 0, counts
        assert set(seen) >= published and len(published) > 500  # every record reached some consumer
        assert set(seen) == published  # and nothing else
        assert st["expired_claimed"] == 0 and st["expired_ready"] == 0  # zero lost
        assert st["delivered"] == st["published"] == len(published) and st["redelivered"] > 0
        assert st["leases_ready"] == st["leases_claimed"] == 0
        ledger_balanced(st)
        # duplicates (reported, then killed before the release) are there, and the dataset's memory drops them
        assert len(seen) > len(published)
        recent, once = _Recent(1 << 16), []
        for rid in seen:
            if rid not in recent:
                recent.add(rid)
                once.append(rid)
        assert sorted(once) == sorted(published)
    finally:
        p.close()
    print(
        f"kill test: {counts}, {len(published)} records, {st['redelivered']} redelivered, "
        f"{len(seen) - len(published)} duplicates, {time.monotonic() - t0:.1f}s"
    )


def test_without_redelivery_the_same_kills_lose_records() -> None:
    """The negative control: ``max_redeliveries=0`` is the old at-most-once behaviour."""
    p, published, seen, counts = run_kills(max_redeliveries=0, kills=12, seed=16)
    try:
        st = p.stats()
        lost = published - set(seen)
        assert counts["overdue"] == 0, counts
        assert st["redelivered"] == 0 and st["expired_claimed"] > 0 and lost
        assert len(lost) <= st["expired_claimed"]  # killed before their release; reported ones may expire too
        ledger_balanced(st)
    finally:
        p.close()
    print(
        f"without redelivery: {len(lost)} of {len(published)} never reached a consumer, {st['expired_claimed']} "
        f"expired_claimed, {counts}"
    )
