"""Record batches (``ExportConsumer.iter_batches`` / ``next_batches``) on both transports: bit-exact against what
was published, in both landing layouts (small records read whole and packed by a row gather; large ones read
straight into the packed layout), every failure of one record its own named error, nothing lost uncounted."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch
from hsx_harness import ledger_balanced, wait_until
from hsx_testdata import make_meta, make_rows

from vllm_hs_compat.core.records import RecordMeta
from vllm_hs_compat.export import (
    ChecksumMismatchError,
    DescriptorError,
    ExportConfigError,
    ExportConsumer,
    ExportProducer,
    LeaseExpiredError,
    RecordTooLargeError,
)
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.batch import RecordBatch
from vllm_hs_compat.export.consumer import batches as consumer_batches
from vllm_hs_compat.export.consumer import landing as consumer_landing
from vllm_hs_compat.export.consumer import reads as consumer_reads

MiB = 1 << 20
Make = Callable[..., ExportProducer]

#: (tokens, planes, hidden, dtype): odd row sizes (21 bytes), one row, several schemas
SHAPES = [(5, 3, 7, "uint8"), (1, 2, 64, "bfloat16"), (33, 2, 64, "bfloat16"), (7, 3, 128, "float16")]


@pytest.fixture(params=["packed", "direct"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Force one landing layout for every NIXL batch: ``direct`` (two descriptors per record, read in place) or
    ``packed`` (one descriptor per record, then two memmoves; shm batches are always read in place)."""
    monkeypatch.setattr(consumer_batches, "BATCH_DIRECT_MIN_BYTES", 0 if request.param == "direct" else 1 << 40)
    return str(request.param)


def publish_all(p: ExportProducer, n: int, shapes: list[tuple[int, int, int, str]] = SHAPES) -> dict[str, Any]:
    """``n`` records cycling through ``shapes``; their rows and metadata by id, in publish order."""
    out: dict[str, Any] = {}
    for i in range(n):
        t, planes, hidden, dtype = shapes[i % len(shapes)]
        rows = make_rows(100 + i, t + i % 3, planes, hidden, dtype)
        meta = msgspec.structs.replace(make_meta(f"r-{i}", rows, i), start=i, num_prompt_tokens=2 * i + 1)
        p.publish(meta, rows)
        out[meta.record_id] = (rows, meta)
    return out


def split(got: list[Any]) -> tuple[list[RecordBatch], list[Any]]:
    """``next_batches``' answer: its batches and its errors, each in order."""
    return [g for g in got if isinstance(g, RecordBatch)], [g for g in got if not isinstance(g, RecordBatch)]


def check_batch(b: RecordBatch, sent: dict[str, Any]) -> None:
    """Every record of ``b`` is bit-exact with what was published: rows, token ids, positions, metadata."""
    assert b.cu_tokens[0] == 0 and b.cu_tokens[-1] == b.num_tokens == b.hidden_states.shape[0]
    for i, rid in enumerate(b.record_ids):
        rows, meta = sent[rid]
        a, z = int(b.cu_tokens[i]), int(b.cu_tokens[i + 1])
        assert torch.equal(b.hidden_states[a:z].view(torch.uint8), rows.view(torch.uint8))
        assert b.token_ids[a:z].tolist() == list(meta.token_ids)
        assert (int(b.start[i]), int(b.num_prompt_tokens[i])) == (meta.start, meta.num_prompt_tokens)
        rec = b[i]
        rec.check()  # the record view's checksum matches its bytes
        assert rec.meta == msgspec.structs.replace(meta, checksum=rec.meta.checksum)
        assert rec.meta.checksum == b.checksums[i]


def test_batches_are_bit_exact_and_grouped_by_schema_in_order(backend: str, make_producer: Make, layout: str) -> None:
    p = make_producer(num_slots=64, slot_bytes=64 << 10)
    sent = publish_all(p, 24)
    with ExportConsumer(p.endpoint, p.token, landing_bytes=4 * MiB) as c:
        batches = list(c.iter_batches(max_records=10, wait_s=0.2, idle_timeout_s=0.5))
        seen = [rid for b in batches for rid in b.record_ids]
        assert sorted(seen) == sorted(sent)  # every record exactly once
        for b in batches:
            check_batch(b, sent)
            s = b.schema
            assert {(sent[r][1].dtype, sent[r][1].shape[1:]) for r in b.record_ids} == {(s.dtype, (s.planes, s.hidden))}
            order = [int(r.split("-")[1]) for r in b.record_ids]
            assert order == sorted(order)  # publish order within a batch
        st = c.stats()
        assert (st["records"], st["checksum_failures"], st["bad_descriptors"]) == (24, 0, 0)
        assert st["batches"] == len(batches) == 3 * 3  # 3 claims (10, 10, 4), each with the 3 schemas of SHAPES
    wait_until(lambda: p.occupancy() == 0, 5.0, "every lease to be released")
    st = p.stats()
    assert st["delivered"] == 24
    ledger_balanced(st)


def test_a_damaged_record_fails_alone_and_its_batch_keeps_the_others(
    backend: str, make_producer: Make, layout: str
) -> None:
    p = make_producer()
    shapes = [(9, 2, 64, "bfloat16")]
    sent = publish_all(p, 6, shapes)
    buf = p.transport.buffer
    hit = p.pool._by_record["r-1"]  # a flipped bit in its hidden states
    buf[hit.offset + 5] ^= 0x10
    ids = p.pool._by_record["r-4"]  # a flipped bit in its token ids
    buf[ids.offset + P.decode_descriptor(ids.wire).ids_offset + 1] ^= 0x01
    with ExportConsumer(p.endpoint, p.token) as c:
        got = c.next_batches(max_records=16, wait_s=0.5)
        (b,), errors = split(got)
        assert b.record_ids == ("r-0", "r-2", "r-3", "r-5")
        check_batch(b, sent)
        assert [type(e) for e in errors] == [ChecksumMismatchError, ChecksumMismatchError]
        assert "'r-1'" in str(errors[0]) and "token ids" in str(errors[1]) and "'r-4'" in str(errors[1])
        assert c.stats()["checksum_failures"] == 2
        assert c.stats()["landing_pages_in_use"] == 0  # the dropped rows' space is free (a compacting copy)
    wait_until(lambda: p.occupancy() == 0, 5.0, "every lease to be released")
    st = p.stats()
    assert (st["delivered"], st["checksum_failed"]) == (4, 2)
    ledger_balanced(st)


def test_on_error_raise_hands_each_error_out_after_its_claims_batches(backend: str, make_producer: Make) -> None:
    p = make_producer()
    sent = publish_all(p, 3, [(4, 2, 64, "bfloat16")])
    p.transport.buffer[p.pool._by_record["r-0"].offset] ^= 0xFF
    with ExportConsumer(p.endpoint, p.token) as c:
        stream = c.iter_batches(max_records=8, wait_s=0.2, idle_timeout_s=0.5)
        b = next(stream)
        assert b.record_ids == ("r-1", "r-2")
        check_batch(b, sent)
        with pytest.raises(ChecksumMismatchError, match="'r-0'"):
            next(stream)
        assert list(stream) == []  # the stream survives its error and ends when idle
    skip = make_producer()
    publish_all(skip, 2, [(4, 2, 64, "bfloat16")])
    skip.transport.buffer[skip.pool._by_record["r-1"].offset] ^= 0xFF
    with ExportConsumer(skip.endpoint, skip.token) as c:
        got = list(c.iter_batches(max_records=8, wait_s=0.2, idle_timeout_s=0.5, on_error="skip"))
        assert [b.record_ids for b in got] == [("r-0",)]
        assert c.stats()["checksum_failures"] == 1


def test_a_refused_descriptor_fails_its_record_alone_and_gives_its_lease_back(
    backend: str, make_producer: Make
) -> None:
    p = make_producer()
    sent = publish_all(p, 4, [(3, 2, 64, "bfloat16")])
    lease = p.pool._by_record["r-2"]
    desc = P.decode_descriptor(lease.wire)
    lease.wire = P.encode(msgspec.structs.replace(desc, nbytes=desc.nbytes + 8))  # disagrees with its shape
    with ExportConsumer(p.endpoint, p.token) as c:
        got = c.next_batches(max_records=8, wait_s=0.5)
        batches, errors = split(got)
        assert [b.record_ids for b in batches] == [("r-0", "r-1", "r-3")]
        check_batch(batches[0], sent)
        assert len(errors) == 1 and isinstance(errors[0], DescriptorError) and "'r-2'" in str(errors[0])
        assert c.stats()["bad_descriptors"] == 1 and c.stats()["abandoned"] == 1
    wait_until(lambda: p.occupancy() == 0, 5.0, "the refused record's lease to be given back")
    st = p.stats()
    assert (st["delivered"], st["abandoned"]) == (3, 1)
    ledger_balanced(st)


def test_undecodable_descriptors_fall_back_to_one_by_one(backend: str, make_producer: Make) -> None:
    p = make_producer()
    sent = publish_all(p, 3, [(3, 2, 64, "bfloat16")])
    p.pool._by_record["r-1"].wire = b"\xc1garbage"  # not msgpack: its lease cannot be named, the TTL takes it
    with ExportConsumer(p.endpoint, p.token) as c:
        got = c.next_batches(max_records=8, wait_s=0.5)
        (b,), (err,) = split(got)
        assert b.record_ids == ("r-0", "r-2")
        check_batch(b, sent)
        assert isinstance(err, DescriptorError) and "expires at the producer" in str(err)
        assert c.stats()["bad_descriptors"] == 1


def test_a_batch_is_split_to_fit_the_landing_buffer_and_a_record_too_large_fails_alone(
    backend: str, make_producer: Make, layout: str
) -> None:
    p = make_producer()
    sent = publish_all(p, 6, [(1024, 1, 128, "bfloat16")])  # 256 KiB each
    big = make_rows(7, 4096, 1, 256, "bfloat16")  # 2 MiB: more than the landing buffer
    p.publish(make_meta("big", big, 3), big)
    with ExportConsumer(p.endpoint, p.token, landing_bytes=1 * MiB) as c:
        got: list[Any] = []
        for _ in range(20):
            got += c.next_batches(max_records=16, wait_s=0.2)
            if sum(len(b) if isinstance(b, RecordBatch) else 1 for b in got) == 7:
                break
        batches, errors = split(got)
        assert sorted(r for b in batches for r in b.record_ids) == sorted(sent)
        assert max(len(b) for b in batches) < 6  # split: 6 x 256 KiB do not fit in 1 MiB at once
        for b in batches:
            check_batch(b, sent)
        assert [type(e) for e in errors] == [RecordTooLargeError] and "'big'" in str(errors[0])
    wait_until(lambda: p.occupancy() == 0, 5.0, "every lease to be released")
    assert p.stats()["abandoned"] == 1


def test_copy_false_views_the_landing_buffer_until_release_and_lent_space_comes_back(
    backend: str, make_producer: Make
) -> None:
    p = make_producer()
    sent = publish_all(p, 4, [(512, 2, 64, "bfloat16")])  # 128 KiB each: the direct layout
    with ExportConsumer(p.endpoint, p.token, landing_bytes=8 * MiB) as c:
        (b,) = c.next_batches(max_records=2, wait_s=0.5, copy=False)
        assert isinstance(b, RecordBatch)
        check_batch(b, sent)
        landing = c._landing.transport.landing if c._landing.transport is not None else None
        assert landing is not None
        lo, hi = landing.data_ptr(), landing.data_ptr() + landing.numel()
        assert lo <= b.hidden_states.data_ptr() < hi  # a view of the landing buffer
        assert c.stats()["held_records"] == 1 and c.stats()["landing_pages_in_use"] > 0
        c.release(b)
        assert c.stats()["held_records"] == 0 and c.stats()["landing_pages_in_use"] == 0
        (owned,) = c.next_batches(max_records=2, wait_s=0.5)  # copy=True: lent its landing space
        assert isinstance(owned, RecordBatch)
        check_batch(owned, sent)
        assert c.stats()["lent_bytes"] > 0
        del owned
        gc.collect()
        assert c.stats()["landing_pages_in_use"] == 0 and c.stats()["lent_bytes"] == 0


def test_a_lease_that_expired_before_the_release_fails_every_record_of_it(
    backend: str, make_producer: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    p = make_producer(lease_ttl_s=0.3, max_redeliveries=0)  # at-most-once: the expired leases end the records
    publish_all(p, 3, [(3, 2, 64, "bfloat16")])
    with ExportConsumer(p.endpoint, p.token) as c:
        assert c._landing.transport is not None
        real = c._landing.transport.read

        def slow(*a: Any, **kw: Any) -> None:
            real(*a, **kw)
            time.sleep(0.6)  # the leases run out while the bytes are "in flight"

        monkeypatch.setattr(c._landing.transport, "read", slow)
        got = c.next_batches(max_records=8, wait_s=0.5)
        assert [type(g) for g in got] == [LeaseExpiredError] * 3
        assert c.stats()["lease_expired"] == 3 and c.stats()["records"] == 0
        assert c.stats()["landing_pages_in_use"] == 0
    st = p.stats()
    assert st["expired_claimed"] == 3
    ledger_balanced(st)


def test_a_record_view_of_a_batch_is_a_full_record() -> None:
    rows = make_rows(1, 3, 2, 8)
    meta = make_meta("x", rows).with_checksum(5)
    from vllm_hs_compat.export.batch import BatchSchema

    s = BatchSchema(meta.layer_ids, True, "bfloat16", 2, 8, "xxh3_64", meta.vllm_version, meta.adapter)
    b = RecordBatch(
        s,
        ("x",),
        rows,
        torch.tensor(meta.token_ids),
        torch.tensor([0, 3]),
        torch.tensor([0]),
        torch.tensor([0]),
        (5,),
    )
    assert len(b) == 1 and b[-1].meta == meta and isinstance(b[0].meta, RecordMeta)
    with pytest.raises(IndexError):
        b[1]
    from vllm_hs_compat.errors import RecordFormatError

    with pytest.raises(RecordFormatError, match="inconsistent"):
        RecordBatch(s, ("x", "y"), rows, torch.tensor(meta.token_ids), torch.tensor([0, 3]), torch.tensor([0]),
                    torch.tensor([0]), (5,))  # fmt: skip


def test_many_ranges_in_one_read_are_checked_and_copied_exactly(backend: str, make_producer: Make) -> None:
    """A read of many ranges (the numpy descriptor path of NIXL, the memmove path of shm) copies each range to its
    place, and one range outside the pool refuses the whole read before anything moves."""
    import time

    p = make_producer()
    rows = make_rows(3, 4096, 1, 128, "uint8")  # 512 KiB of random bytes in the pool
    p.publish(make_meta("src", rows), rows)
    lease = p.pool._by_record["src"]
    with ExportConsumer(p.endpoint, p.token, landing_bytes=4 * MiB) as c:
        t = c._landing.transport
        assert t is not None
        items = [(lease.offset + 4099 * k, 8192 * k + k, 517 + k) for k in range(40)]
        t.read(items, time.monotonic() + 10)
        src = p.transport.buffer
        for r, lo, n in items:
            assert torch.equal(t.landing[lo : lo + n], src[r : r + n])
        t.landing.zero_()
        bad = [*items[:30], (p.pool.pool_bytes - 8, 0, 64), *items[30:]]
        with pytest.raises(DescriptorError, match="outside the pool"):
            t.read(bad, time.monotonic() + 10)
        assert int(t.landing.count_nonzero()) == 0


@pytest.mark.parametrize("backend", ["shm"])
def test_shm_copy_checksums_on_the_way_across_chunk_boundaries(
    backend: str, make_producer: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shm copy that checksums each chunk right after copying it gives the checksum of exactly the first
    ``checked`` bytes of each range as they landed, for ranges that are not whole chunks (pieces copied by torch
    and, below 64 KiB, by a buffer copy)."""
    import time

    from vllm_hs_compat.core.records import checksum_bytes
    from vllm_hs_compat.export import shm

    monkeypatch.setattr(shm, "COPY_CHUNK_BYTES", 96 << 10)  # pieces of 96 KiB: a 2 MiB record crosses many
    p = make_producer()
    rows = make_rows(4, 4096, 2, 256, "uint8")  # 2 MiB
    p.publish(make_meta("src", rows), rows)
    lease = p.pool._by_record["src"]
    chunk = shm.COPY_CHUNK_BYTES
    with ExportConsumer(p.endpoint, p.token, landing_bytes=8 * MiB) as c:
        t = c._landing.transport
        assert isinstance(t, shm.ShmConsumerTransport)
        items = [(lease.offset, 0, 2 * chunk + 77, chunk + 5), (lease.offset + 13, 3 * chunk, chunk - 1, chunk - 1)]
        got = t.read_checked(items, "xxh3_64", time.monotonic() + 10)
        src = p.transport.buffer
        for (r, lo, n, k), digest in zip(items, got, strict=True):
            assert torch.equal(t.landing[lo : lo + n], src[r : r + n])
            assert digest == checksum_bytes(bytes(src[r : r + k].numpy()), "xxh3_64")
        with pytest.raises(DescriptorError):
            t.read_checked([(lease.offset, 0, 16, 17)], "xxh3_64", time.monotonic() + 10)


def test_a_descriptor_whose_nonce_is_not_hex_fails_its_record_alone_on_both_paths(
    backend: str, make_producer: Make
) -> None:
    """The nonce's hex pattern is checked by the consumer (not by the descriptor decoder): a bad one fails its
    record alone, and no release names it (the producer would refuse that release whole)."""
    p = make_producer(lease_ttl_s=0.5, max_redeliveries=0)  # (a requeue would re-encode, and so mend, the nonce)
    sent = publish_all(p, 6, [(3, 2, 64, "bfloat16")])
    for rid in ("r-1", "r-4"):
        lease = p.pool._by_record[rid]
        lease.wire = P.encode(msgspec.structs.replace(P.decode_descriptor(lease.wire), nonce="z" * 16))
    with ExportConsumer(p.endpoint, p.token) as c:
        got = c.next_batches(max_records=3, wait_s=0.5)  # the batch path: r-0, r-1, r-2
        (b,), (err,) = split(got)
        assert b.record_ids == ("r-0", "r-2")
        check_batch(b, sent)
        assert isinstance(err, DescriptorError) and "'r-1'" in str(err) and "expires at the producer" in str(err)
        rest = list(c.iter_records(batch=3, wait_s=0.2, idle_timeout_s=0.5, on_error="skip"))  # the record path
        assert [r.meta.record_id for r in rest] == ["r-3", "r-5"]
        assert c.stats()["bad_descriptors"] == 2 and c.stats()["abandoned"] == 0
    wait_until(lambda: p.occupancy() == 0, 5.0, "the two leases to expire")
    st = p.stats()
    assert (st["delivered"], st["expired_claimed"]) == (4, 2)
    ledger_balanced(st)


# --- releases posted without waiting for their answers ----------------------------------------------------------
def test_releases_far_from_the_deadline_are_posted_and_the_ledger_still_settles_exactly(
    backend: str, make_producer: Make
) -> None:
    p = make_producer(num_slots=64, slot_bytes=64 << 10)
    sent = publish_all(p, 12, [(5, 2, 64, "bfloat16")])
    with ExportConsumer(p.endpoint, p.token) as c:
        recs = [c.fetch(f"r-{i}") for i in range(4)]  # one posted release each
        assert [r.meta.record_id for r in recs] == ["r-0", "r-1", "r-2", "r-3"]
        batches = [b for b in c.next_batches(max_records=8, wait_s=0.5) if isinstance(b, RecordBatch)]
        for b in batches:
            check_batch(b, sent)
        assert c.stats()["deferred_releases"] == 12
        assert c.settle_pending(5.0) == 0  # every answer arrived
        assert c.stats()["late_verdicts"] == 0
        st = p.stats()
        assert (st["delivered"], st["leases_claimed"]) == (12, 0)
        ledger_balanced(st)


def test_close_collects_the_answers_of_posted_releases(backend: str, make_producer: Make) -> None:
    p = make_producer()
    publish_all(p, 3, [(5, 2, 64, "bfloat16")])
    with ExportConsumer(p.endpoint, p.token) as c:
        for i in range(3):
            c.fetch(f"r-{i}")
    assert c.stats()["unanswered_releases"] == 0 and c.stats()["deferred_releases"] == 3
    st = p.stats()  # no waiting: close() collected the answers, so the producer had settled them
    assert (st["delivered"], st["leases_claimed"]) == (3, 0)
    ledger_balanced(st)


def test_a_release_near_the_deadline_waits_for_its_verdict(
    backend: str, make_producer: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    p = make_producer(lease_ttl_s=1.0)
    sent = publish_all(p, 2, [(5, 2, 64, "bfloat16")])
    with ExportConsumer(p.endpoint, p.token) as c:
        assert c._landing.transport is not None
        for name in ("read", "read_checked"):
            real = getattr(c._landing.transport, name, None)
            if real is not None:

                def slow(*a: Any, _real: Any = real, **kw: Any) -> Any:
                    out = _real(*a, **kw)
                    time.sleep(0.6)  # past half the TTL since the claim: the verdict must be waited for
                    return out

                monkeypatch.setattr(c._landing.transport, name, slow)
        (b,) = c.next_batches(max_records=4, wait_s=0.5)
        assert isinstance(b, RecordBatch) and b.record_ids == ("r-0", "r-1")
        check_batch(b, sent)
        assert c.stats()["deferred_releases"] == 0
        assert p.stats()["delivered"] == 2  # settled before next_batches returned


def test_a_posted_release_answered_otherwise_is_counted_and_logged(
    backend: str, make_producer: Make, caplog: pytest.LogCaptureFixture
) -> None:
    import time

    p = make_producer()
    publish_all(p, 1, [(5, 2, 64, "bfloat16")])
    with ExportConsumer(p.endpoint, p.token) as c:
        claim = c.claim("r-0")
        got = c._releases.release([(claim.lease, "0" * 16, "delivered")], time.monotonic(), ["r-0"])  # a wrong nonce
        assert got == ["released"]  # taken as released at once (posted) ...
        with caplog.at_level("ERROR"):
            assert c.settle_pending(5.0) == 0
        assert c.stats()["late_verdicts"] == 1  # ... and the producer's "unknown" is counted when it arrives
        assert "'r-0'" in caplog.text and "unknown" in caplog.text
        c.abandon([claim])
    wait_until(lambda: p.occupancy() == 0, 5.0, "the lease to be given back")


def test_fetch_batch_reads_the_ids_asked_for_in_their_order_and_fails_the_others_alone(
    backend: str, make_producer: Make, layout: str
) -> None:
    """40 ids (two claim messages of at most 32) in an order of the caller's, an id given twice, one never
    published and one the producer knows failed: one batch in the order asked, one named error per bad id,
    every lease released delivered."""
    from vllm_hs_compat.export import RecordFailedError, UnknownRecordError

    p = make_producer(num_slots=64, slot_bytes=64 << 10)
    sent = publish_all(p, 40, [(3, 2, 64, "bfloat16")])
    p.fail("gone", "capture_failed", "its blocks were freed")
    want = [f"r-{i}" for i in (7, 3, 39, 0, *range(8, 39), 1, 2, 4, 5, 6)]
    assert sorted(want) == sorted(sent)
    with ExportConsumer(p.endpoint, p.token) as c:
        calls: list[int] = []
        call = c._session.call

        def counted(req: P.Request, timeout_s: float | None = None) -> P.Reply:
            if isinstance(req, P.ClaimReq):
                calls.append(len(req.ids))
            return call(req, timeout_s)

        c._session.call = counted  # type: ignore[method-assign]
        got = c.fetch_batch([*want, "nope", "r-3", "gone"])
        (b,), errors = split(got)
        assert list(b.record_ids) == want
        check_batch(b, sent)
        assert calls == [32, 10]  # 42 distinct ids: the last 10 in a second claim message
        assert [type(e) for e in errors] == [RecordFailedError, UnknownRecordError]
        assert "'gone'" in str(errors[0]) and "blocks were freed" in str(errors[0]) and "'nope'" in str(errors[1])
        assert c.stats()["batches"] == 1 and c.stats()["records"] == 40
        (alone,) = c.fetch_batch(["nope"])
        assert isinstance(alone, UnknownRecordError)
    wait_until(lambda: p.occupancy() == 0, 5.0, "every lease to be released")
    st = p.stats()
    assert st["delivered"] == 40
    ledger_balanced(st)


def test_fetch_batch_waits_for_records_published_after_it_was_called(backend: str, make_producer: Make) -> None:
    import threading

    p = make_producer()
    rows = [make_rows(7 + i, 4, 2, 64, "bfloat16") for i in range(3)]
    metas = [make_meta(f"late-{i}", r, i) for i, r in enumerate(rows)]
    p.publish(metas[0], rows[0])
    later = threading.Timer(0.3, lambda: [p.publish(m, r) for m, r in zip(metas[1:], rows[1:], strict=True)])
    later.start()
    try:
        with ExportConsumer(p.endpoint, p.token) as c:
            got = c.fetch_batch([m.record_id for m in metas], wait_s=10.0)
            assert all(isinstance(g, RecordBatch) for g in got)
            recs = {rid: b[i] for b in got if isinstance(b, RecordBatch) for i, rid in enumerate(b.record_ids)}
            assert sorted(recs) == [m.record_id for m in metas]
            for m, r in zip(metas, rows, strict=True):
                assert torch.equal(recs[m.record_id].hidden_states.view(torch.uint8), r.view(torch.uint8))
            with pytest.raises(ExportConfigError):
                c.fetch_batch([""])
    finally:
        later.cancel()
        later.join()


def test_a_large_batch_is_verified_piece_by_piece_as_it_lands(
    backend: str, make_producer: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records of 1.5 MiB (a batch of 6 MiB) are read straight into the packed layout and checksummed on the way:
    over NIXL in posted READs of ``CHECK_PIECE_BYTES`` (here an odd size, so pieces cut records anywhere), over shm by
    the copy that checksums each chunk.  Exact bytes, and a flipped bit fails its record alone."""
    from vllm_hs_compat.export import shm

    monkeypatch.setattr(consumer_reads, "CHECK_PIECE_BYTES", 300_001)
    p = make_producer()
    rows = [make_rows(50 + i, 768, 2, 512, "bfloat16") for i in range(4)]  # 1.5 MiB each
    metas = [make_meta(f"big-{i}", r, i) for i, r in enumerate(rows)]
    for m, r in zip(metas, rows, strict=True):
        p.publish(m, r)
    p.transport.buffer[p.pool._by_record["big-2"].offset + 1_000_003] ^= 0x04
    with ExportConsumer(p.endpoint, p.token) as c:
        t = c._landing.transport
        assert t is not None
        reads: list[int] = []
        on_shm = isinstance(t, shm.ShmConsumerTransport)
        name = "read_checked" if on_shm else "post_read"  # NIXL: each piece's READ posted, a window in flight
        orig = getattr(t, name)

        def spy(items: Any, *a: Any) -> Any:
            reads.append(len(items))
            return orig(items, *a)

        monkeypatch.setattr(t, name, spy)
        (b,), errors = split(c.fetch_batch([m.record_id for m in metas]))
        assert b.record_ids == ("big-0", "big-1", "big-3")
        for i, k in enumerate((0, 1, 3)):
            a, z = int(b.cu_tokens[i]), int(b.cu_tokens[i + 1])
            assert torch.equal(b.hidden_states[a:z].view(torch.uint8), rows[k].view(torch.uint8))
        assert [type(e) for e in errors] == [ChecksumMismatchError] and "'big-2'" in str(errors[0])
        # shm: one checked copy of 8 ranges; NIXL: ceil((6 MiB of rows + 12,288 B of token ids) / 300,001 B) = 22 READs
        # (posted up to READ_WINDOW at a time)
        assert (reads == [8]) if on_shm else (len(reads) == 22)
    wait_until(lambda: p.occupancy() == 0, 5.0, "every lease to be released")
    st = p.stats()
    assert (st["delivered"], st["checksum_failed"]) == (3, 1)
    ledger_balanced(st)


def test_fetch_batch_reads_what_it_claimed_when_the_control_plane_fails_midway(
    backend: str, make_producer: Make
) -> None:
    """The second claim message of 40 ids times out: the 32 records claimed by the first are still read and
    delivered, the 8 others each get the timeout (their records stay published, unclaimed)."""
    from vllm_hs_compat.export import ExportTimeoutError

    p = make_producer(num_slots=64, slot_bytes=64 << 10)
    sent = publish_all(p, 40, [(3, 2, 64, "bfloat16")])
    with ExportConsumer(p.endpoint, p.token) as c:
        call = c._session.call
        claims = 0

        def flaky(req: P.Request, timeout_s: float | None = None) -> P.Reply:
            nonlocal claims
            if isinstance(req, P.ClaimReq):
                claims += 1
                if claims == 2:
                    raise ExportTimeoutError("no answer (injected)")
            return call(req, timeout_s)

        c._session.call = flaky  # type: ignore[method-assign]
        (b,), errors = split(c.fetch_batch(list(sent)))
        assert list(b.record_ids) == list(sent)[:32]
        check_batch(b, sent)
        assert len(errors) == 8 and all(isinstance(e, ExportTimeoutError) for e in errors)
        c._session.call = call  # type: ignore[method-assign]
        (rest,) = c.fetch_batch(list(sent)[32:])  # nothing was lost: they are still there
        assert isinstance(rest, RecordBatch) and len(rest) == 8
    wait_until(lambda: p.occupancy() == 0, 5.0, "every lease to be released")
    st = p.stats()
    assert st["delivered"] == 40
    ledger_balanced(st)


# --- iter_records of small records: read as batches, handed out as records ---------------------------------------
def _stream_keeping_firsts(c: ExportConsumer, sent: dict[str, Any], batch: int) -> tuple[list[str], list[str]]:
    """Stream every record with ``iter_records`` (defaults: copy=True), keeping the first record of each claim and
    dropping the others; after each record, check every kept one against what was published.  Returns the ids in
    stream order and the faults seen."""
    kept: list[Any] = []
    order: list[str] = []
    faults: list[str] = []
    for rec in c.iter_records(batch=batch, wait_s=0.2, idle_timeout_s=0.5):
        rid = rec.meta.record_id
        if len(order) % batch == 0:
            kept.append(rec)
        order.append(rid)
        del rec  # (no cycles: a batch's space comes back as soon as no record of it is referenced)
        for k in kept:
            rows, meta = sent[k.meta.record_id]
            if not torch.equal(k.hidden_states.view(torch.uint8), rows.view(torch.uint8)):
                faults.append(f"{k.meta.record_id} overwritten after {rid}")
            elif k.meta != msgspec.structs.replace(meta, checksum=k.meta.checksum):
                faults.append(f"{k.meta.record_id}: metadata differs")
    return order, faults


def test_small_records_of_iter_records_come_from_batches_and_stay_intact_while_kept(
    backend: str, make_producer: Make, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``iter_records`` reads a claim of small records of one schema as one batch and splits it: the records come
    oldest first with their full metadata, each viewing its batch's tensor, and a kept record is never overwritten
    by later claims while the others of its batch are dropped.  Negative control: a landing allocator that hands
    the same space out again is caught by the same checks (where the records view landing space)."""
    if backend == "shm" and layout == "packed":
        pytest.skip("shm batches are always read in place: the direct case covers it")
    p = make_producer(num_slots=64, slot_bytes=64 << 10)
    sent = publish_all(p, 24, [(3, 2, 64, "bfloat16")])
    with ExportConsumer(p.endpoint, p.token, landing_bytes=256 << 10) as c:
        order, faults = _stream_keeping_firsts(c, sent, 8)
        assert order == [f"r-{i}" for i in range(24)] and faults == []
        assert c.stats()["batches"] == 3 and c.stats()["records"] == 24  # one batch per claim
    wait_until(lambda: p.occupancy() == 0, 5.0, "every lease to be released")
    ledger_balanced(p.stats())
    if backend == "nixl" and layout == "packed":
        return  # packed batches are copies: no landing space to hand out twice
    sent = publish_all(p, 24, [(3, 2, 64, "bfloat16")])
    real = consumer_landing._Landing.alloc

    def same_place(self: Any, nbytes: int) -> int | None:
        got = real(self, nbytes)
        if got is not None:
            self.free(got, nbytes)
        return 0 if got is not None else None

    monkeypatch.setattr(consumer_landing._Landing, "alloc", same_place)
    with ExportConsumer(p.endpoint, p.token, landing_bytes=256 << 10, lend_fraction=1.0) as c:
        _, faults = _stream_keeping_firsts(c, sent, 8)
        assert faults, "the checks must catch a kept record whose space was handed out again"
