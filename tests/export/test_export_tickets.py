"""Tickets as the capture connector builds them: the worker's locator, the scheduler's ``sink_ticket``, a client
holding nothing but the ticket."""

from __future__ import annotations

import json
import logging
import pickle
import threading
import time
from pathlib import Path

import msgspec
import pytest
from hsx_harness import ledger_balanced
from hsx_testdata import digest, make_meta, make_rows

from vllm_hs_compat.connector.sinks import ExportSink, sink_ticket
from vllm_hs_compat.core.records import CaptureRecord
from vllm_hs_compat.export import CapabilityError, CapabilityKey, ExportConsumer, mint
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.capabilities import derive_key, verify
from vllm_hs_compat.export.control import TOKEN_ENV, TOKEN_FILE_ENV


def test_capabilities_are_pure_per_record_and_per_producer() -> None:
    key = derive_key("t" * 32, "ab" * 8)
    cap = mint(key, "cmpl-1")
    assert cap == mint(str.__str__(key), "cmpl-1")  # a plain str of the key mints the same
    assert msgspec.convert(cap, P.Capability) == cap  # fits the wire pattern
    assert cap != mint(key, "cmpl-2") and cap != mint(derive_key("t" * 32, "cd" * 8), "cmpl-1")
    assert verify(key, "cmpl-1", cap) and not verify(key, "cmpl-2", cap)
    for odd in ("é" * 46, cap[:-1], 3, None, b"c1."):
        assert not verify(key, "cmpl-1", odd)  # never raises


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
        params = sink_ticket("export", locator, "cmpl-7", rows.numel() * 2)  # the scheduler, before the publish
        json.dumps(params)
        assert token not in json.dumps(params) and str.__str__(locator["capability_key"]) not in json.dumps(params)
        sink.write(CaptureRecord(make_meta("cmpl-8", other), other))
        monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "no-token-here"))  # the client has no trainer token
        # the client gets its ticket before the worker publishes: fetch(wait_s=) waits for the record
        late = threading.Timer(0.3, lambda: sink.write(CaptureRecord(make_meta("cmpl-7", rows), rows)))
        with ExportConsumer.from_params(params, timeout_s=5) as c:
            assert c.principal == "record"
            late.start()
            t0 = time.monotonic()
            assert digest(c.fetch(params["hs_export"]["record_id"], wait_s=10).hidden_states) == digest(rows)
            assert time.monotonic() - t0 >= 0.25
            with pytest.raises(CapabilityError):
                c.fetch("cmpl-8")
        with ExportConsumer.from_params(params, token=token) as trainer:  # the trainer streams the rest
            assert [r.meta.request_id for r in trainer.iter_records(wait_s=0.2, idle_timeout_s=0.5)] == ["cmpl-8"]
        ledger_balanced(sink.producer.stats())
    finally:
        if late.ident is not None:  # started: let its publish finish before the producer closes
            late.join(5)
        sink.close()
