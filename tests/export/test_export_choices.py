"""``n > 1`` (issue 16, item 2): every record a response causes is reachable from that response.

The package's own scheduler half (``CaptureScheduler.finished``, no engine: requests arrive as the core type the
adapter reads vLLM's ``Request`` into) with a real export producer behind it: the records are published under the
publications the scheduler drew (as the worker half does), then fetched by a client holding nothing but the params
of the child that finished last (vLLM's response carries exactly those), in another consumer with no token."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
from hsx_testdata import digest

from vllm_hs_compat import errors as E
from vllm_hs_compat.adapters import adapter_for_version
from vllm_hs_compat.connector.config import ConnectorConfig
from vllm_hs_compat.connector.scheduler import CaptureScheduler, SchedulerFacts
from vllm_hs_compat.connector.sinks import ExportSink
from vllm_hs_compat.core.capture import FinishedRequest
from vllm_hs_compat.core.choices import CHOICES_KEY
from vllm_hs_compat.core.groups import CaptureGroup
from vllm_hs_compat.core.labels import PlaneLabels
from vllm_hs_compat.core.records import RecordMeta
from vllm_hs_compat.core.vocabulary import RESULT_KEY
from vllm_hs_compat.export import ExportConsumer, ExportProducer
from vllm_hs_compat.export.protocol import PARAMS_KEY

MiB = 1 << 20
BLOCK = 4
PLANES, HIDDEN = 2, 16
PROMPT = (11, 12, 13, 14, 15, 16)
PARENT = "cmpl-abc123-9f8e7d6c"
ARRIVAL = 1764670000.25


@pytest.fixture
def producer() -> Iterator[ExportProducer]:
    with ExportProducer(backend="shm", num_slots=8, slot_bytes=MiB, direct_port=None) as p:
        yield p


def _scheduler(capture: str, producer: ExportProducer) -> CaptureScheduler:
    """The scheduler half without vLLM (hand-written facts), its sink locator handed over as the capture owner's
    handshake does."""
    facts = SchedulerFacts(
        group=CaptureGroup(0, BLOCK, "cache_only_layers.0", merged=False, view="scheduler", capture_spec_type=None),
        labels=PlaneLabels((1, 2)),
        num_blocks=64,
        bytes_per_token=PLANES * HIDDEN * 2,
    )
    s = CaptureScheduler(
        adapter_for_version("0.32.0"), ConnectorConfig.from_extra({"capture": capture, "check_requests": 0}), facts
    )
    sink = object.__new__(ExportSink)
    sink.producer = producer
    # the export sink's own locator (endpoint, capability key, ...), as the capture owner's handshake carries it
    s.on_handshake([{"owner": True, "group_index": 0, "group_block_size": BLOCK, "locator": sink.locator()}])
    return s


def _child(
    i: int, generated: tuple[int, ...], parent: str = PARENT, arrival: float | None = ARRIVAL
) -> FinishedRequest:
    tokens = PROMPT + generated
    return FinishedRequest(
        req_id=f"{i}_{parent}",
        num_computed_tokens=len(tokens) - 1,
        num_prompt_tokens=len(PROMPT),
        token_ids=tokens,
        aborted=False,
        status="FINISHED_LENGTH_CAPPED",
        arrival_time=arrival,
    )


def _rows(token_ids: tuple[int, ...]) -> torch.Tensor:
    """Rows that are a function of the token prefix (like a causal model): same prefix, same rows."""
    out = torch.empty(len(token_ids), PLANES, HIDDEN, dtype=torch.bfloat16)
    for p in range(len(token_ids)):
        g = torch.Generator().manual_seed(hash(token_ids[: p + 1]) & 0xFFFF_FFFF)
        out[p] = torch.randn(PLANES, HIDDEN, generator=g)
    return out


def _publish(s: CaptureScheduler, producer: ExportProducer, children: dict[str, FinishedRequest]) -> dict[str, str]:
    """What the worker half does with the step's saves: read the rows, publish under the save's publication.
    Returns each record's digest."""
    out = {}
    for save in s._pending:  # the saves queued for the next step's metadata
        fr = children[save.req_id]
        rows = _rows(fr.token_ids)[save.start : save.stop]
        meta = RecordMeta.for_tensor(
            save.record_id, rows, list(save.token_ids), (1, 2), pre_norm=True, vllm_version="0.32.0", adapter="v0_29"
        )
        meta = msgspec.structs.replace(meta, start=save.start, num_prompt_tokens=save.num_prompt_tokens)
        producer.publish(meta, rows, save.publication)
        out[save.record_id] = digest(rows)
    s._pending = []
    return out


def _fetch_all(params: dict[str, Any]) -> dict[int, str]:
    """A client holding only the response's params fetches every choice's record (no token anywhere)."""
    got = {}
    for entry in params[CHOICES_KEY]:
        with ExportConsumer.from_params(entry, token=None) as c:
            assert c.principal == "record"
            got[entry["index"]] = digest(c.fetch(entry[PARAMS_KEY]["record_id"]).hidden_states)
    return got


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_the_last_childs_params_reach_every_choices_record(producer: ExportProducer, order: tuple[int, ...]) -> None:
    s = _scheduler("all", producer)
    children = {f"{i}_{PARENT}": _child(i, (100 + i, 200 + i)) for i in range(3)}
    answers = [s.finished(children[f"{i}_{PARENT}"], list(range(8))) for i in order]
    assert all(hold for hold, _ in answers)
    # each child reports the siblings finished so far; the last (the response's params) all of them, in order
    assert [len(p[CHOICES_KEY]) for _, p in answers] == [1, 2, 3]
    last = answers[-1][1]
    assert [e["index"] for e in last[CHOICES_KEY]] == [0, 1, 2]
    digests = _publish(s, producer, children)
    assert len(digests) == 3  # "all": the choices differ, one record each
    assert _fetch_all(last) == {i: digests[f"{i}_{PARENT}"] for i in range(3)}
    # the old answer, for the record: the top-level ticket alone reaches one choice of three
    assert last[PARAMS_KEY]["record_id"] == f"{order[-1]}_{PARENT}"


def test_each_choices_ticket_opens_its_own_record_only(producer: ExportProducer) -> None:
    s = _scheduler("all", producer)
    children = {f"{i}_{PARENT}": _child(i, (100 + i, 200 + i)) for i in range(2)}
    _, p0 = s.finished(children[f"0_{PARENT}"], list(range(8)))
    _, p1 = s.finished(children[f"1_{PARENT}"], list(range(8)))
    _publish(s, producer, children)
    zero, one = p1[CHOICES_KEY]
    with ExportConsumer.from_params(zero, token=None) as c, pytest.raises(E.CapabilityError):
        c.fetch(one[PARAMS_KEY]["record_id"])  # choice 0's capability on choice 1's record
    assert p0[PARAMS_KEY]["cap"] == zero[PARAMS_KEY]["cap"]  # the same ticket a lone child would carry


def test_a_request_that_names_itself_like_a_child_gets_no_siblings(producer: ExportProducer) -> None:
    """Negative control: same parent id (a client may choose ids), another arrival time or another prompt: not a
    sibling, so the real family's tickets never reach it."""
    s = _scheduler("all", producer)
    _, real = s.finished(_child(0, (100,)), list(range(8)))
    _, other_time = s.finished(_child(1, (101,), arrival=ARRIVAL + 1e-6), list(range(8)))
    impostor = dataclasses.replace(_child(1, (101,)), token_ids=(99, *PROMPT[1:], 101))
    _, other_prompt = s.finished(impostor, list(range(8)))
    _, no_time = s.finished(_child(1, (101,), parent="x", arrival=None), list(range(8)))
    assert [e["index"] for e in real[CHOICES_KEY]] == [0]
    assert [e["index"] for e in other_time[CHOICES_KEY]] == [1]  # a family of its own: itself only
    assert CHOICES_KEY not in other_prompt and CHOICES_KEY not in no_time  # not grouped at all
    assert s._choices.counters["choices_not_grouped"] == 2


def test_capture_prompt_stores_the_shared_prompt_once(producer: ExportProducer) -> None:
    s = _scheduler("prompt", producer)
    children = {f"{i}_{PARENT}": _child(i, (100 + i, 200 + i)) for i in range(3)}
    answers = [s.finished(children[f"{i}_{PARENT}"], list(range(8))) for i in (1, 0, 2)]
    assert [hold for hold, _ in answers] == [True, False, False]  # only the first holds blocks
    digests = _publish(s, producer, children)
    assert list(digests) == [f"1_{PARENT}"]  # one record
    last = answers[-1][1]
    statuses = {e["index"]: (e[RESULT_KEY]["status"], e[RESULT_KEY].get("same_as")) for e in last[CHOICES_KEY]}
    assert statuses == {0: ("shared", f"1_{PARENT}"), 1: ("queued", None), 2: ("shared", f"1_{PARENT}")}
    # every choice's entry leads to the one record (fetched once: a record is delivered once)
    assert {e[PARAMS_KEY]["record_id"] for e in last[CHOICES_KEY]} == {f"1_{PARENT}"}
    with ExportConsumer.from_params(last[CHOICES_KEY][0], token=None) as c:
        assert digest(c.fetch(f"1_{PARENT}").hidden_states) == digests[f"1_{PARENT}"]
    assert s._choices.counters["choices_shared"] == 2


def test_negative_control_without_grouping_the_prompt_is_stored_per_choice(producer: ExportProducer) -> None:
    """The same children with the grouping off (as before): one record per child, duplicates of the same rows, and
    the response's params reach one of them."""
    s = _scheduler("prompt", producer)
    s.adapter.parallel_sampling_child = lambda req_id: None  # type: ignore[method-assign]
    children = {f"{i}_{PARENT}": _child(i, (100 + i,)) for i in range(2)}
    answers = [s.finished(children[f"{i}_{PARENT}"], list(range(8))) for i in range(2)]
    digests = _publish(s, producer, children)
    assert len(digests) == 2 and len(set(digests.values())) == 1
    assert CHOICES_KEY not in answers[-1][1]


def test_the_adapter_names_the_children() -> None:
    a = adapter_for_version("0.32.0")
    assert a.parallel_sampling_child("1_cmpl-x-ab12") == ("cmpl-x-ab12", 1)
    assert a.parallel_sampling_child("12_a_b") == ("a_b", 12)
    for not_child in ("cmpl-x", "_x", "1_", "01_x", "a_x", "²_x"):
        assert a.parallel_sampling_child(not_child) is None, not_child
