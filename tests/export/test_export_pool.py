"""LeasePool bookkeeping with an injected clock (no sleeping, no second process)."""

from __future__ import annotations

import threading

import pytest
from hsx_testdata import Clock, meta
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hs_compat import errors as E
from vllm_hs_compat.export.pool import LeasePool


def put(pool: LeasePool, rid: str, nbytes: int) -> int:
    lease = pool.allocate(rid, nbytes)
    pool.publish(lease, meta(rid))
    return lease.lease_id


def test_ttls_reclaim_ready_and_claimed_leases() -> None:
    clock = Clock()
    pool = LeasePool(8, 64, lease_ttl_s=2.0, ready_ttl_s=5.0, clock=clock, max_redeliveries=0)  # at-most-once
    put(pool, "a", 100)
    put(pool, "b", 64)
    claimed = pool.claim("a")
    assert pool.occupancy() == 3
    clock.t += 2.5
    assert pool.expire() == 1  # a's lease ran out; b still waits for a consumer
    assert not pool.release(claimed.lease_id, claimed.nonce)  # a late release is ignored and counted
    clock.t += 3.0
    assert pool.expire() == 1
    st = pool.stats()
    assert (st["expired_claimed"], st["expired_ready"], st["stale_releases"], st["used_slots"]) == (
        1,
        1,
        1,
        0,
    )


def test_release_needs_the_nonce() -> None:
    pool = LeasePool(4, 64)
    put(pool, "a", 10)
    c = pool.claim("a")
    assert not pool.release(c.lease_id, "0" * 16)
    assert pool.occupancy() == 1
    assert pool.release(c.lease_id, c.nonce)
    assert pool.occupancy() == 0
    with pytest.raises(E.UnknownRecordError):
        pool.claim("a")


def test_claim_next_is_fifo_and_bounded_by_bytes() -> None:
    pool = LeasePool(16, 64)
    for i in range(6):
        put(pool, f"r{i}", 64)
    got = pool.claim_next(4, 64 * 3, 0.0)
    assert [g.record_id for g in got] == ["r0", "r1", "r2"]
    assert [g.record_id for g in pool.claim_next(10, 1 << 20, 0.0)] == ["r3", "r4", "r5"]
    assert pool.claim_next(1, 1 << 20, 0.0) == []


def test_an_oversized_head_record_is_still_handed_out_so_the_stream_cannot_stall() -> None:
    pool = LeasePool(16, 64)
    put(pool, "huge", 640)
    put(pool, "small", 64)
    assert [g.record_id for g in pool.claim_next(8, 128, 0.0)] == ["huge"]  # the consumer refuses it, named
    assert [g.record_id for g in pool.claim_next(8, 128, 0.0)] == ["small"]


def test_wait_policy_is_woken_by_a_release() -> None:
    pool = LeasePool(1, 64, on_full="wait", wait_timeout_s=10.0)
    put(pool, "a", 64)
    c = pool.claim("a")
    got: list[str] = []
    th = threading.Thread(target=lambda: got.append(pool.allocate("b", 64).record_id))
    th.start()
    th.join(0.2)
    assert th.is_alive()
    pool.release(c.lease_id, c.nonce)
    th.join(5)
    assert got == ["b"] and pool.stats()["waited_full"] == 1


def test_bad_settings_are_named() -> None:
    for kw in (
        {"num_slots": 0},
        {"slot_bytes": 100},
        {"on_full": "block"},
        {"lease_ttl_s": 0},
        {"max_redeliveries": -1},
        {"max_redeliveries": True},
        {"max_redeliveries": 1.0},
    ):
        args = {"num_slots": 4, "slot_bytes": 64, **kw}
        with pytest.raises(E.ExportConfigError):
            LeasePool(**args)  # type: ignore[arg-type]


@settings(max_examples=120, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["put", "claim", "release", "tick", "stale", "abandon"]), st.integers(1, 300)),
        max_size=80,
    ),
    st.integers(0, 3),
)
def test_slots_never_overlap_and_are_always_accounted(ops: list[tuple[str, int]], redeliveries: int) -> None:
    """Random claim / release / expiry sequences, with requeues of expired claims (``max_redeliveries`` 0..3):
    slots never overlap, a requeued record keeps its slots and its bytes (a fake pool memory, written at
    publication, is checked at every claim), one live lease per record, a dead lease never settles, and the
    ledger is exact after every step."""
    clock = Clock()
    pool = LeasePool(12, 64, lease_ttl_s=3.0, ready_ttl_s=7.0, clock=clock, max_redeliveries=redeliveries)
    memory = bytearray(12 * 64)
    claims = []
    dead: list = []  # leases whose TTL ran out under their claimant
    n = 0
    for op, x in ops:
        if op == "put":
            n += 1
            try:
                lease = pool.allocate(f"r{n}", x)
            except E.PoolFullError:
                continue
            memory[lease.offset : lease.offset + x] = bytes([n % 251]) * x
            pool.publish(lease, meta(f"r{n}"))
        elif op == "claim":
            for c in pool.claim_next(1 + x % 3, 1 << 20, 0.0):
                k = int(c.record_id[1:]) % 251
                assert memory[c.offset : c.offset + c.nbytes] == bytes([k]) * c.nbytes  # the bytes as published
                claims.append(c)
        elif op in ("release", "abandon") and claims:
            c = claims.pop(x % len(claims))
            verdict = pool.settle(c.lease_id, c.nonce, "delivered" if op == "release" else "abandoned")
            if verdict == "expired":
                dead.append(c)
            else:
                assert verdict == "released"
        elif op == "stale" and dead:
            c = dead[x % len(dead)]
            assert pool.settle(c.lease_id, c.nonce, "delivered") == "expired"
            assert pool.lease(c.lease_id, c.nonce) is None
        else:
            clock.t += x / 100
            pool.expire()
            live_ids = {lease.lease_id for lease in pool._by_id.values()}
            dead += [c for c in claims if c.lease_id not in live_ids]
            claims = [c for c in claims if c.lease_id in live_ids]
        live = list(pool._by_id.values())
        assert len({lease.record_id for lease in live}) == len(live)  # one live lease per record
        cover = [0] * pool.num_slots
        for lease in live:
            assert lease.n_slots * pool.slot_bytes >= lease.nbytes and lease.redeliveries <= redeliveries
            for s in range(lease.first_slot, lease.first_slot + lease.n_slots):
                cover[s] += 1
        assert max(cover, default=0) <= 1
        assert sum(cover) == pool.occupancy()
        st_ = pool.stats()
        ended = st_["released"] + st_["expired_ready"] + st_["expired_claimed"]
        assert st_["published"] == ended + st_["leases_ready"] + st_["leases_claimed"] and st_["unaccounted"] == 0
        # every claim ended exactly one way: released, requeued, lost, or it is still held
        assert st_["claimed"] == st_["released"] + st_["redelivered"] + st_["expired_claimed"] + st_["leases_claimed"]
        assert st_["released"] == st_["delivered"] + st_["abandoned"]
        if redeliveries == 0:
            assert st_["redelivered"] == 0


def test_release_outcomes_are_counted_apart_and_a_late_release_is_told_expired() -> None:
    clock = Clock()
    pool = LeasePool(8, 64, lease_ttl_s=2.0, ready_ttl_s=None, clock=clock, max_redeliveries=0)
    for rid in ("a", "b", "c", "d"):
        put(pool, rid, 64)
    a, b, c, d = (pool.claim(r) for r in "abcd")
    assert pool.settle(a.lease_id, a.nonce, "delivered") == "released"
    assert pool.settle(a.lease_id, a.nonce, "delivered") == "released"  # a retried release: same verdict, once
    assert pool.settle(b.lease_id, b.nonce, "checksum_failed") == "released"
    assert pool.settle(c.lease_id, c.nonce, "abandoned") == "released"
    assert pool.settle(d.lease_id, "f" * 16, "delivered") == "unknown"  # wrong nonce
    clock.t += 2.5  # d's lease runs out before its release arrives (no sweep ran in between)
    assert pool.settle(d.lease_id, d.nonce, "delivered") == "expired"
    st_ = pool.stats()
    assert (st_["delivered"], st_["checksum_failed"], st_["abandoned"], st_["expired_claimed"]) == (1, 1, 1, 1)
    assert st_["released"] == 3 and st_["unaccounted"] == 0
    with pytest.raises(E.ProtocolError):
        pool.settle(d.lease_id, d.nonce, "eaten")


def test_a_non_ascii_nonce_is_refused_without_raising() -> None:
    pool = LeasePool(4, 64)
    put(pool, "a", 10)
    c = pool.claim("a")
    assert pool.settle(c.lease_id, "é" * 16, "delivered") == "unknown"
    assert not pool.release(c.lease_id, "\udcff" * 16)
    assert pool.lease(c.lease_id, "é" * 16) is None
    assert pool.occupancy() == 1 and pool.settle(c.lease_id, c.nonce) == "released"


def test_close_discards_ready_and_claimed_records_and_counts_them() -> None:
    pool = LeasePool(8, 64)
    for rid in ("a", "b", "c"):
        put(pool, rid, 10)
    pool.claim("a")
    writing = pool.allocate("w", 10)
    pool.close()
    st_ = pool.stats()
    assert st_["discarded_at_close"] == 3 and st_["leases_ready"] == st_["leases_claimed"] == 0
    assert st_["published"] == 3 and st_["unaccounted"] == 0
    with pytest.raises(E.ExportClosedError):
        pool.publish(writing, meta("w"))  # a record still being written when the pool closed is refused
    pool.abort(writing)
    assert pool.stats()["aborted"] == 1 and pool.occupancy() == 0


def test_claim_next_stops_at_the_reply_budget_and_leaves_the_rest_ready() -> None:
    pool = LeasePool(16, 64)
    for i in range(6):
        put(pool, f"r{i}", 64)
    got = pool.claim_next(10, 1 << 20, 0.0, budget=250, cost=lambda lease: 100)
    assert [g.record_id for g in got] == ["r0", "r1"]
    assert pool.stats()["leases_ready"] == 4
    assert [g.record_id for g in pool.claim_next(10, 1 << 20, 0.0, budget=1 << 20, cost=lambda lease: 100)] == [
        "r2",
        "r3",
        "r4",
        "r5",
    ]


def test_leases_answered_with_their_bytes_are_not_counted_as_awaiting_a_read() -> None:
    # the producer's pump polls the transport while read_claimed_count() > 0: a lease whose bytes went out in its
    # claim's answer (mark_inline) is left out, until it is settled, expires or is requeued
    clock = Clock()
    pool = LeasePool(8, 64, lease_ttl_s=2.0, ready_ttl_s=None, clock=clock, max_redeliveries=1)
    for rid in ("a", "b", "c", "d"):
        put(pool, rid, 64)
    a, b, c = pool.claim("a"), pool.claim("b"), pool.claim("c")
    # control: claimed leases count, whether or not their bytes went anywhere yet
    assert (pool.claimed_count(), pool.read_claimed_count()) == (3, 3)
    pool.mark_inline([a.lease_id, b.lease_id, 999])  # an id that is not claimed is ignored
    assert (pool.claimed_count(), pool.read_claimed_count()) == (3, 1)
    assert pool.settle_many([(a.lease_id, a.nonce, "delivered")]) == ["released"]
    assert (pool.claimed_count(), pool.read_claimed_count()) == (2, 1)
    pool.mark_inline([a.lease_id])  # settled already: not counted twice
    assert pool.read_claimed_count() == 1
    clock.t += 2.5  # b (inline) and c (not) expire and are requeued: neither is claimed now
    assert pool.expire() == 2
    assert (pool.claimed_count(), pool.read_claimed_count()) == (0, 0)
    d, b2 = pool.claim("d"), pool.claim("b")  # b's new lease, claimed again: a READ may come for it
    assert b2.lease_id != b.lease_id
    assert pool.read_claimed_count() == 2
    pool.mark_inline([d.lease_id])
    assert pool.read_claimed_count() == 1
    del c
