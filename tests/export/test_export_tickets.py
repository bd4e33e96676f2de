"""Tickets as the capture connector builds them: the worker's locator, the scheduler's ``sink_ticket``, a client
holding nothing but the ticket."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from hsx_harness import ledger_balanced, producer_factory, wait_until
from hsx_testdata import digest, make_meta, make_rows

from vllm_hs_compat.connector.sinks import ExportSink, FileSink, sink_ticket
from vllm_hs_compat.core.capture import RecordFailure
from vllm_hs_compat.core.records import CaptureRecord
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import (
    CapabilityError,
    CapabilityKey,
    ExportConfigError,
    ExportConsumer,
    ExportProducer,
    mint,
)
from vllm_hs_compat.export import producer as producer_module
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.capabilities import CAP_CHARS, derive_key, new_publication, publication_of, verify
from vllm_hs_compat.export.control import TOKEN_ENV, TOKEN_FILE_ENV, ControlClient
from vllm_hs_compat.export.pool import LeasePool

Make = Callable[..., ExportProducer]
MiB = 1 << 20
TOKEN = "q" * 32


def test_capabilities_are_pure_per_publication_and_per_producer() -> None:
    key = derive_key("t" * 32, "ab" * 8)
    pub, pub2 = new_publication(), new_publication()
    assert pub != pub2 and publication_of(mint(key, "r", pub)) == pub
    cap = mint(key, "cmpl-1", pub)
    assert cap == mint(str.__str__(key), "cmpl-1", pub)  # a plain str of the key mints the same
    assert cap.startswith("c2.") and len(cap) == CAP_CHARS
    assert msgspec.convert(cap, P.Capability) == cap  # fits the wire pattern
    assert cap != mint(key, "cmpl-2", pub) and cap != mint(derive_key("t" * 32, "cd" * 8), "cmpl-1", pub)
    assert cap != mint(key, "cmpl-1", pub2)  # another publication of the same id: another capability
    assert verify(key, "cmpl-1", pub, cap)
    assert not verify(key, "cmpl-2", pub, cap) and not verify(key, "cmpl-1", pub2, cap)
    forged = cap[:3] + pub2 + cap[3 + len(pub2) :]  # the MAC of one publication under another's nonce
    assert publication_of(forged) == pub2 and not verify(key, "cmpl-1", pub2, forged)
    for odd in ("é" * 69, cap[:-1], 3, None, b"c2.", "c1." + "A" * 43):
        assert not verify(key, "cmpl-1", pub, odd)  # never raises
    for bad_pub in ("", "x" * 21, "é" * 22, None):
        assert not verify(key, "cmpl-1", bad_pub, cap)  # type: ignore[arg-type]
        with pytest.raises(ExportConfigError):
            mint(key, "cmpl-1", bad_pub)  # type: ignore[arg-type]


def test_the_capability_key_never_prints_itself(caplog: pytest.LogCaptureFixture) -> None:
    key = derive_key("t" * 32, "ab" * 8)
    raw = str.__str__(key)
    locator = {"endpoint": "h:1", "capability_key": key}
    caplog.set_level(logging.INFO)
    logging.getLogger("hsx-test").info("sink %s %r", locator, key)
    for text in (repr(key), str(key), f"{key}", f"{key:>60}", "%s" % key, str(locator), caplog.text):  # noqa: UP031
        assert raw not in text and "redacted" in text
    back = pickle.loads(pickle.dumps(locator))  # vLLM's start-up handshake pickles it between its processes
    assert isinstance(back["capability_key"], CapabilityKey) and str.__str__(back["capability_key"]) == raw
    assert raw not in str(back)


def test_the_connector_ticket_opens_its_record_for_a_client_without_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    sink = ExportSink({"backend": "shm", "num_slots": 4, "slot_bytes": 1 << 20, "token_file": str(tmp_path / "tok")})
    late = threading.Timer(0, lambda: None)
    try:
        locator = pickle.loads(pickle.dumps(sink.locator()))  # worker -> scheduler
        token = (tmp_path / "tok").read_text().strip()
        assert token not in str(locator)
        rows = make_rows(3, 12, 2, 64)
        other = make_rows(4, 12, 2, 64)
        pub = new_publication()  # the scheduler draws it with the ticket; it travels in the SaveRequest
        params = sink_ticket("export", locator, "cmpl-7", rows.numel() * 2, pub)  # the scheduler, before the publish
        json.dumps(params)
        assert token not in json.dumps(params) and str.__str__(locator["capability_key"]) not in json.dumps(params)
        assert params["hs_export"]["v"] == P.TICKET_VERSION and P.ExportTicket.parse(params).publication == pub
        sink.write(CaptureRecord(make_meta("cmpl-8", other), other), new_publication())
        monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "no-token-here"))  # the client has no trainer token
        # the client gets its ticket before the worker publishes: fetch(wait_s=) waits for the record
        late = threading.Timer(0.3, lambda: sink.write(CaptureRecord(make_meta("cmpl-7", rows), rows), pub))
        with ExportConsumer.from_params(params, timeout_s=5) as c:
            assert c.principal == "record"
            late.start()
            t0 = time.monotonic()
            assert digest(c.fetch(params["hs_export"]["record_id"], wait_s=10).hidden_states) == digest(rows)
            assert time.monotonic() - t0 >= 0.25
            with pytest.raises(CapabilityError):
                c.fetch("cmpl-8")
        with ExportConsumer.from_params(params, token=token) as trainer:  # the trainer streams the rest
            assert [r.meta.record_id for r in trainer.iter_records(wait_s=0.2, idle_timeout_s=0.5)] == ["cmpl-8"]
        ledger_balanced(sink.producer.stats())
    finally:
        if late.ident is not None:  # started: let its publish finish before the producer closes
            late.join(5)
        sink.close()


# --- a capability opens one publication (issue 15, items 6 and 7) -----------------------------------------------
@pytest.fixture
def shm_producer() -> Iterator[Make]:
    with producer_factory("shm") as make:
        yield make


def _holder(ticket: P.ExportTicket) -> ExportConsumer:
    """A consumer holding nothing but ``ticket`` as a client gets it (JSON, no token)."""
    t = P.ExportTicket.parse(json.loads(json.dumps(ticket.kv_transfer_params())))
    return ExportConsumer(t.endpoint, None, ticket=t, timeout_s=5, landing_bytes=MiB)


def _outcome(c: ExportConsumer, record_id: str, wait_s: float = 0.0) -> str:
    """The digest of the record fetched, or the named error and its message."""
    try:
        return digest(c.fetch(record_id, wait_s=wait_s).hidden_states)
    except HsCompatError as e:
        return f"{type(e).__name__}: {e}"


def _raw_claim(client: ControlClient, rid: bytes, req: P.Request) -> P.Reply:
    """One request under a request id of our choosing, as a raw CURVE peer sends it."""
    client._sock.send_multipart([P.HEADER, rid, P.encode(req)])
    assert client._sock.poll(5000)
    return P.decode_reply(client._sock.recv_multipart()[3])


def _old_ticket_meets_a_new_record(p: ExportProducer) -> tuple[P.ExportTicket, P.ExportTicket, str, str, str]:
    """Record "cmpl-1" is delivered to its ticket's holder; then a new record is published under the same id (a
    caller-chosen request id), while the old ticket's holder waits for it (``wait_s``).  Returns both tickets,
    what the old ticket got once its record was gone (the reference: nothing there), what it got while waiting
    across the new publication, and the digest of the new record."""
    rows1, rows2 = make_rows(1, 6, 2, 64), make_rows(2, 6, 2, 64)
    old = p.publish(make_meta("cmpl-1", rows1, 1), rows1)
    with _holder(old) as c:
        assert _outcome(c, "cmpl-1") == digest(rows1)  # delivered
        gone = _outcome(c, "cmpl-1")
        new = p.ticket("cmpl-1", rows2.numel() * 2)  # minted before its record exists, as the connector does
        late = threading.Timer(0.2, lambda: p.publish_nowait(make_meta("cmpl-1", rows2, 2), rows2, new.publication))
        late.start()
        try:
            t0 = time.monotonic()
            during = _outcome(c, "cmpl-1", wait_s=0.8)
            if during.startswith("UnknownRecordError"):
                assert time.monotonic() - t0 >= 0.75  # it waited: the record appeared and was checked then
        finally:
            late.join(5)
    assert p.flush(5)
    return old, new, gone, during, digest(rows2)


def test_an_old_ticket_opens_nothing_published_later_under_its_id(backend: str, make_producer: Make) -> None:
    p = make_producer(token=TOKEN)
    old, new, gone, during, want = _old_ticket_meets_a_new_record(p)
    assert old.cap != new.cap and old.publication != new.publication
    assert gone.startswith("UnknownRecordError") and during == gone  # the same answer: nothing about the new one
    assert p.stats()["leases_ready"] == 1  # the new record was not touched
    forged = P.ExportTicket.parse(new.kv_transfer_params())
    forged = P.ExportTicket(**{**forged.__dict__, "cap": mint(derive_key("w" * 32, p.instance), "cmpl-1", "A" * 22)})
    with _holder(forged) as c:  # a capability that is not genuine does not get to wait: refused at once
        t0 = time.monotonic()
        assert _outcome(c, "cmpl-1", wait_s=5.0).startswith("CapabilityError")
        assert time.monotonic() - t0 < 4.0  # not the 5 s wait (a loaded 2-core machine takes over 2 s at times)
    with _holder(new) as c:
        claim = c.claim("cmpl-1")
        anon = ControlClient(p.endpoint, server_key=p.server_key, timeout_s=5)
        try:  # the old capability neither reads nor releases the new record's lease, even knowing its nonce
            for req in (
                P.ReadReq(claim.lease, claim.nonce, 0, 16, cap=old.cap),
                P.ReleaseReq([P.ReleaseItem(claim.lease, claim.nonce, "abandoned")], cap=old.cap),
            ):
                with pytest.raises(CapabilityError):
                    anon.call(req)
        finally:
            anon.close()
        (res,) = c.read([claim])
        assert not isinstance(res, HsCompatError) and digest(res.hidden_states) == want  # the new ticket works
    wait_until(lambda: p.stats()["delivered"] == 2, 5.0, "both records to be delivered")
    ledger_balanced(p.stats())


def test_negative_control_a_producer_that_ignores_the_nonce_lets_the_old_ticket_in(
    shm_producer: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim, check = LeasePool.claim, ExportProducer._check_cap  # the claim, and the read/release checks, of the nonce
    monkeypatch.setattr(LeasePool, "claim", lambda self, record_id, publication=None: claim(self, record_id))
    monkeypatch.setattr(
        ExportProducer, "_check_cap", lambda self, cap, rid, what, pub=None: check(self, cap, rid, what)
    )
    p = shm_producer(token=TOKEN)
    _, _, gone, during, want = _old_ticket_meets_a_new_record(p)
    assert gone.startswith("UnknownRecordError") and during == want  # the c1 scheme's hole: the test above sees it


def _failure_seen_by(p: ExportProducer) -> tuple[str, str, str]:
    """Record "cmpl-f" is delivered to its ticket; a second request of the same id gets a ticket and fails.  What
    the old ticket, the failed record's own ticket and the trainer are told."""
    rows = make_rows(3, 4, 2, 64)
    old = p.publish(make_meta("cmpl-f", rows, 3), rows)
    with _holder(old) as c:
        assert _outcome(c, "cmpl-f") == digest(rows)
    new = p.ticket("cmpl-f")
    p.fail("cmpl-f", "blocks", "secret reason 7f3a", new.publication)
    with _holder(old) as c:
        seen_old = _outcome(c, "cmpl-f", wait_s=0.3)
    with _holder(new) as c:
        seen_new = _outcome(c, "cmpl-f", wait_s=5.0)
    with ExportConsumer(p.endpoint, p.token, landing_bytes=MiB) as t:
        seen_trainer = _outcome(t, "cmpl-f")
    return seen_old, seen_new, seen_trainer


def test_a_failed_records_reason_reaches_its_own_ticket_only(shm_producer: Make) -> None:
    p = shm_producer(token=TOKEN)
    seen_old, seen_new, seen_trainer = _failure_seen_by(p)
    assert seen_old.startswith("UnknownRecordError") and "7f3a" not in seen_old and "blocks" not in seen_old
    assert seen_new.startswith("RecordFailedError") and "blocks: secret reason 7f3a" in seen_new
    assert seen_trainer.startswith("RecordFailedError") and "7f3a" in seen_trainer
    # the writer's failures carry the publication too: a duplicate id fails its own ticket, not the first one's
    rows = make_rows(4, 4, 2, 64)
    first = p.publish(make_meta("cmpl-d", rows, 4), rows)
    dup = p.ticket("cmpl-d")
    p.publish_nowait(make_meta("cmpl-d", rows, 4), rows, dup.publication)
    assert p.flush(5)
    with _holder(dup) as c:
        assert _outcome(c, "cmpl-d").startswith("RecordFailedError: record 'cmpl-d' will not be published: sink: Dupl")
    with _holder(first) as c:
        assert _outcome(c, "cmpl-d") == digest(rows)
    assert p.stats()["failed_records"] == 2


def test_negative_control_a_failure_entry_without_its_nonce_tells_every_ticket(
    shm_producer: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(producer_module, "same_publication", lambda a, b: True)
    seen_old, _, _ = _failure_seen_by(shm_producer(token=TOKEN))
    assert "secret reason 7f3a" in seen_old  # what the test above would catch


def _replay_of_anothers_request_id(p: ExportProducer) -> tuple[P.Reply, P.Reply, P.Reply, P.Reply]:
    """Holders X and Y (raw CURVE peers, nothing but their tickets).  X claims its record under request id R; Y
    then sends its own claim, and a claim of X's record, under R; X retries R.  The four replies."""
    rx, ry = make_rows(5, 4, 2, 64), make_rows(6, 4, 2, 64)
    tx = p.publish(make_meta("rec-x", rx, 5), rx)
    ty = p.publish(make_meta("rec-y", ry, 6), ry)
    x = ControlClient(p.endpoint, server_key=p.server_key, timeout_s=5)
    y = ControlClient(p.endpoint, server_key=p.server_key, timeout_s=5)
    try:
        rid = P.new_rid()
        first = _raw_claim(x, rid, P.ClaimReq(["rec-x"], cap=tx.cap))
        y_own = _raw_claim(y, rid, P.ClaimReq(["rec-y"], cap=ty.cap))
        y_theirs = _raw_claim(y, rid, P.ClaimReq(["rec-x"], cap=ty.cap))
        x_again = _raw_claim(x, rid, P.ClaimReq(["rec-x"], cap=tx.cap))
        if isinstance(y_own, P.ClaimReply) and y_own.records:  # Y reads and releases what it was given
            d = P.decode_descriptor(y_own.records[0])
            data = _raw_claim(y, P.new_rid(), P.ReadReq(d.lease, d.nonce, 0, d.nbytes, cap=ty.cap))
            if d.record_id == "rec-y":
                assert isinstance(data, P.ReadReply) and hashlib.sha256(data.data).hexdigest() == digest(ry)
        return first, y_own, y_theirs, x_again
    finally:
        x.close()
        y.close()


def test_a_claim_retry_is_answered_only_to_the_same_credential(shm_producer: Make) -> None:
    p = shm_producer(token=TOKEN)
    first, y_own, y_theirs, x_again = _replay_of_anothers_request_id(p)
    assert isinstance(first, P.ClaimReply) and isinstance(y_own, P.ClaimReply)
    (dx,) = [P.decode_descriptor(r) for r in first.records]
    (dy,) = [P.decode_descriptor(r) for r in y_own.records]
    assert dx.record_id == "rec-x" and dy.record_id == "rec-y" and dy.lease != dx.lease  # Y's own record, claimed
    assert isinstance(y_theirs, P.ErrorReply) and y_theirs.code == "capability" and "rec-x" not in str(y_own)
    assert x_again == first  # X's retry still gets X's answer, not a second claim
    st = p.stats()
    assert st["claimed"] == 2 and st["claim_retries"] == 1


def test_negative_control_claims_remembered_by_request_id_alone_leak_across_holders(
    shm_producer: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ExportProducer, "_claim_key", staticmethod(lambda call, credential: (call.principal, call.rid)))
    first, y_own, _, _ = _replay_of_anothers_request_id(shm_producer(token=TOKEN))
    assert isinstance(y_own, P.ClaimReply) and y_own.records == first.records  # type: ignore[union-attr]


def _c1(p: ExportProducer, record_id: str) -> str:
    """The capability an older release minted for ``record_id``: HMAC of the id alone."""
    key = base64.urlsafe_b64decode(str.__str__(p.capability_key)[3:] + "=")
    mac = hmac.new(key, b"hs-compat record v1\x00" + record_id.encode(), hashlib.sha256).digest()
    return "c1." + base64.urlsafe_b64encode(mac).decode().rstrip("=")


def test_an_old_c1_capability_is_refused_naming_the_version(shm_producer: Make) -> None:
    p = shm_producer(token=TOKEN)
    rows = make_rows(7, 4, 2, 64)
    t = p.publish(make_meta("cmpl-old", rows, 7), rows)
    c1 = _c1(p, "cmpl-old")
    assert len(c1) == 46 and msgspec.convert(c1, P.Capability) == c1  # the schema lets it reach the producer
    v2 = {**t.kv_transfer_params()["hs_export"], "v": 2, "cap": c1}  # the ticket an older release wrote
    with pytest.raises(ExportConfigError, match="version 2.*c1 capability.*c2"):
        P.ExportTicket.parse({"hs_export": v2})
    anon = ControlClient(p.endpoint, server_key=p.server_key, timeout_s=5)
    try:
        with pytest.raises(CapabilityError, match="c1 capability .*ticket version 2.*c2 capabilities"):
            anon.call(P.ClaimReq(["cmpl-old"], cap=c1))
        (rep, _) = anon.call(P.ClaimReq(["cmpl-old"], cap=t.cap))  # control: this release's ticket claims it
        assert isinstance(rep, P.ClaimReply) and len(rep.records) == 1
        d = P.decode_descriptor(rep.records[0])
        for req in (
            P.ReadReq(d.lease, d.nonce, 0, 16, cap=c1),
            P.ReleaseReq([P.ReleaseItem(d.lease, d.nonce, "delivered")], cap=c1),
        ):
            with pytest.raises(CapabilityError, match="c1 capability"):
                anon.call(req)
    finally:
        anon.close()


def test_the_connector_path_binds_each_ticket_to_its_own_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests of one id through the sink as the connector drives it (scheduler: ticket + nonce in the
    SaveRequest; worker: write / fail with the nonce): each ticket opens its own record only."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    sink = ExportSink({"backend": "shm", "num_slots": 4, "slot_bytes": 1 << 20, "token_file": str(tmp_path / "tok")})
    try:
        locator = pickle.loads(pickle.dumps(sink.locator()))
        rows1, rows2 = make_rows(8, 3, 2, 64), make_rows(9, 3, 2, 64)
        pub1, pub2, pub3 = new_publication(), new_publication(), new_publication()
        params1 = sink_ticket("export", locator, "cmpl-9", rows1.numel() * 2, pub1)
        sink.write(CaptureRecord(make_meta("cmpl-9", rows1), rows1), pub1)
        t1 = P.ExportTicket.parse(params1)
        with _holder(t1) as c:
            assert _outcome(c, "cmpl-9") == digest(rows1)
        params2 = sink_ticket("export", locator, "cmpl-9", rows2.numel() * 2, pub2)
        sink.write(CaptureRecord(make_meta("cmpl-9", rows2), rows2), pub2)
        with _holder(t1) as c:
            assert _outcome(c, "cmpl-9").startswith("UnknownRecordError")
        with _holder(P.ExportTicket.parse(params2)) as c:
            assert _outcome(c, "cmpl-9") == digest(rows2)
        params3 = sink_ticket("export", locator, "cmpl-9", 0, pub3)
        sink.fail(RecordFailure("cmpl-9", "cmpl-9", "blocks", "gone 51c", pub3))
        with _holder(P.ExportTicket.parse(params3)) as c:
            assert "gone 51c" in _outcome(c, "cmpl-9", wait_s=5.0)
        with _holder(t1) as c:
            assert "gone 51c" not in _outcome(c, "cmpl-9")
        ledger_balanced(sink.producer.stats())
    finally:
        sink.close()
    files = FileSink(str(tmp_path / "files"))  # the other sinks take the nonce and ignore it
    assert "hs_export" not in sink_ticket("file", files.locator(), "cmpl-9", 0, pub1)
    files.write(CaptureRecord(make_meta("cmpl-9", rows1), rows1), pub1)
    assert (tmp_path / "files" / "cmpl-9.json").exists()
