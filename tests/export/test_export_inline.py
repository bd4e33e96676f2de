"""Small records in the claim's answer (the ``fetch`` op): a record claimed by id whose bytes fit the consumer's
``inline_bytes`` (and the producer's ``max_read_bytes``) comes with its descriptor, one round trip, no transfer
after it; it is verified and released like a transferred one (see docs/export.md, "Small records in the claim's
answer").

On shm and NIXL, as the trainer and as a ticket holder: the bytes equal what was published, the ledger settles
(delivered, nothing claimed), and the counters say which path each record took.  A trainer on shm maps the pool
and copies out of it, which beats any answer carrying the bytes: it never asks for them.  Negative controls: with
``inline_bytes=0`` the same fetch takes the transport (the counters would not tell the paths apart otherwise);
bytes altered between the pool and the consumer are caught by the checksum and released ``checksum_failed``;
a producer that answers the op with a protocol error is claimed from the old way.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hsx_harness import ledger_balanced, wait_until
from hsx_testdata import digest, make_meta, make_rows

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import CaptureRecord
from vllm_hs_compat.export import ExportConsumer, ExportProducer
from vllm_hs_compat.export import protocol as P

Make = Callable[..., ExportProducer]
MiB = 1 << 20


def _publish(p: ExportProducer, rid: str, seed: int, tokens: int = 50) -> P.ExportTicket:
    rows = make_rows(seed, tokens, 2, 64)  # 50 tokens x 2 planes x 64 x bf16 = 12.5 KiB
    ticket = p.publish(make_meta(rid, rows, seed), rows)
    return P.ExportTicket.parse(json.loads(json.dumps(ticket.kv_transfer_params())))


def _settled(p: ExportProducer, delivered: int) -> None:
    wait_until(lambda: p.stats()["leases_claimed"] == 0, 5, "every lease released")
    st = p.stats()
    assert st["delivered"] == delivered, st
    ledger_balanced(st)


def test_a_small_record_comes_in_the_claims_answer(make_producer: Make, backend: str) -> None:
    inline = 0 if backend == "shm" else 1
    p = make_producer()
    _publish(p, "small", 1)
    _publish(p, "large", 2, tokens=2100)  # 525 KiB: over the default inline_bytes (256 KiB)
    with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=4 * MiB) as c:
        small = c.fetch("small")
        large = c.fetch("large")
        assert digest(small.hidden_states) == digest(make_rows(1, 50, 2, 64))
        assert digest(large.hidden_states) == digest(make_rows(2, 2100, 2, 64))
        assert small.meta.token_ids == make_meta("small", make_rows(1, 50, 2, 64), 1).token_ids
        assert c.stats()["inline_records"] == inline and c.stats()["records"] == 2
        c.settle_pending()
    assert p.stats()["inline_claims"] == inline
    _settled(p, 2)


def test_negative_control_inline_off_takes_the_transport(make_producer: Make) -> None:
    p = make_producer()
    _publish(p, "small", 1)
    with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=4 * MiB, inline_bytes=0) as c:
        assert digest(c.fetch("small").hidden_states) == digest(make_rows(1, 50, 2, 64))
        assert c.stats()["inline_records"] == 0
        c.settle_pending()
    assert p.stats()["inline_claims"] == 0
    _settled(p, 1)


def test_a_ticket_holder_gets_its_record_in_one_answer(make_producer: Make) -> None:
    p = make_producer()
    ticket = _publish(p, "mine", 3)
    with ExportConsumer.from_params(ticket.kv_transfer_params(), timeout_s=10) as c:
        rec = c.fetch("mine")
        assert digest(rec.hidden_states) == digest(make_rows(3, 50, 2, 64))
        assert c.stats()["inline_records"] == 1
    st = p.stats()
    assert st["inline_claims"] == 1 and st["inline_reads"] == 0, st  # no `read` op after the claim
    _settled(p, 1)  # a ticket holder waits for its release's verdict: nothing left claimed when it exits


def test_altered_inline_bytes_fail_the_checksum_and_are_released_so(make_producer: Make, backend: str) -> None:
    p = make_producer()
    ticket = _publish(p, "bad", 4)
    reply = p._fetch_reply

    def altered(req: P.FetchReq, leases: list, errors: list) -> P.FetchReply:  # type: ignore[type-arg]
        rep = reply(req, leases, errors)
        data = bytearray(rep.data[0])
        data[100] ^= 0xFF  # inside the hidden states
        return P.FetchReply(rep.records, [bytes(data)], rep.errors)

    p._fetch_reply = altered  # type: ignore[method-assign]
    # the trainer asks for the bytes over NIXL; on shm a ticket holder does
    c = (
        ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=4 * MiB)
        if backend == "nixl"
        else ExportConsumer.from_params(ticket.kv_transfer_params(), timeout_s=10)
    )
    with c:
        with pytest.raises(E.ChecksumMismatchError):
            c.fetch("bad")
        c.settle_pending()
    wait_until(lambda: p.stats()["leases_claimed"] == 0, 5, "the lease released")
    assert p.stats()["checksum_failed"] == 1


def test_a_producer_without_fetch_is_claimed_from_the_old_way(make_producer: Make, backend: str) -> None:
    p = make_producer()
    ticket = _publish(p, "o", 5)
    _publish(p, "o2", 6)
    handler = p._server._handler
    seen: list[str] = []

    def older(req: P.Request, call: object) -> P.Reply | None:
        seen.append(type(req).__name__)
        if isinstance(req, P.FetchReq):  # what a decoder without the op answers
            raise P.ProtocolError("request does not fit the wire schema: Invalid value 'fetch'")
        return handler(req, call)  # type: ignore[arg-type]

    p._server._handler = older
    with ExportConsumer.from_params(ticket.kv_transfer_params(), timeout_s=10) as holder:  # asks on every backend
        assert digest(holder.fetch("o").hidden_states) == digest(make_rows(5, 50, 2, 64))
        assert holder.stats()["inline_records"] == 0
    with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=MiB) as c:
        assert digest(c.fetch("o2").hidden_states) == digest(make_rows(6, 50, 2, 64))
        assert c.stats()["inline_records"] == 0
        c.settle_pending()
    # each consumer asks once, then claims (a trainer on shm never asks)
    assert seen.count("FetchReq") == (2 if backend == "nixl" else 1), seen
    _settled(p, 2)


def test_the_producers_read_bound_caps_what_is_inlined(make_producer: Make) -> None:
    from vllm_hs_compat.export.control import ControlLimits

    p = make_producer(control_limits=ControlLimits(max_read_bytes=8192))
    ticket = _publish(p, "over", 7)  # 12.5 KiB of hidden states: over the producer's 8 KiB per answer
    with ExportConsumer.from_params(ticket.kv_transfer_params(), timeout_s=10) as c:
        assert digest(c.fetch("over").hidden_states) == digest(make_rows(7, 50, 2, 64))
        assert c.stats()["inline_records"] == 0
        c.settle_pending()
    _settled(p, 1)


@pytest.mark.parametrize("who", ["trainer", "ticket"])
def test_a_record_from_an_answer_owns_its_bytes(make_producer: Make, backend: str, who: str) -> None:
    """The answer's bytes are decoded as views of the received message and the pool's slots are reused once
    released: a record must hold its own writable memory, unchanged by the answers after it and by later
    publications into its slot, and made without a warning (torch warns of a read-only buffer).  Control (run by
    hand, stop 24): the plain client receiving every answer into one reused buffer and the record made over the
    answer's view, not a copy, fails the trainer-over-NIXL case."""
    import warnings

    p = make_producer(num_slots=2, slot_bytes=64 << 10)  # two slots: the second round reuses the first's

    def fetch_round(seeds: list[int]) -> list[CaptureRecord]:
        tickets = [_publish(p, f"r{s}", s) for s in seeds]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. torch's "The given buffer is not writable"
            if who == "trainer":
                with ExportConsumer(p.endpoint, p.token, timeout_s=10, landing_bytes=MiB) as c:
                    recs = [c.fetch(f"r{s}") for s in seeds]
                    c.settle_pending()
            else:
                recs = []
                for s, t in zip(seeds, tickets, strict=True):
                    with ExportConsumer.from_params(t.kv_transfer_params(), timeout_s=10) as holder:
                        recs.append(holder.fetch(f"r{s}"))
        wait_until(lambda: p.stats()["leases_claimed"] == 0, 5, "every lease released")
        return recs

    first = fetch_round([11, 12])
    second = fetch_round([13, 14])  # into the slots the first round's records were read from
    for rec, seed in zip(first + second, [11, 12, 13, 14], strict=True):
        assert digest(rec.hidden_states) == digest(make_rows(seed, 50, 2, 64)), seed
    a, b = first
    before = digest(b.hidden_states)  # (bytes compared: random rows may hold NaNs)
    a.hidden_states[0, 0, 0] = 7.0  # writable, and a's memory alone
    assert float(a.hidden_states[0, 0, 0]) == 7.0
    assert digest(b.hidden_states) == before
    _settled(p, 4)
