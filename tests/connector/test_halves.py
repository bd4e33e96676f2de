"""Both connector halves without vLLM: hand-written facts (what the adapter resolves from a live engine's configs),
requests and steps in the package's own core types, a CPU capture tensor, and real sinks (the file sink, a real
export producer).  The release matrix (tests/vllm) proves the version facts against vLLM's own code; these prove the
logic in seconds: every refusal and its reason, block coverage, the padding slot, slot checks, the worker's backlog
and its sink failures.  Each decision has its control: the same request with the one fact changed is accepted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_hs_compat import envs
from vllm_hs_compat.adapters import adapter_for_version
from vllm_hs_compat.adapters.base import VllmAdapter
from vllm_hs_compat.adapters.reader import Ranks
from vllm_hs_compat.connector import worker as worker_module
from vllm_hs_compat.connector.config import ConnectorConfig
from vllm_hs_compat.connector.scheduler import CaptureScheduler, SchedulerFacts
from vllm_hs_compat.connector.worker import CaptureWorker, WorkerFacts
from vllm_hs_compat.core import vocabulary as V
from vllm_hs_compat.core.capture import FinishedRequest, ScheduledCached, ScheduledNew, StepInfo, StepPlan
from vllm_hs_compat.core.groups import CaptureGroup
from vllm_hs_compat.core.labels import PlaneLabels
from vllm_hs_compat.errors import CaptureConfigError, CaptureGroupError, RecordFailedError
from vllm_hs_compat.export import files

BLOCK = 4
NUM_BLOCKS = 16
PLANES, HIDDEN = 2, 8
LAYER = "cache_only_layers.4"
#: BLOCK_TOKEN_PLANE [blocks, tokens, planes, hidden] (the 0.22-0.28 era's view of a plain tensor)
RELEASE = "0.27.1"


def _group(view: str) -> CaptureGroup:
    return CaptureGroup(0, BLOCK, LAYER, merged=True, view=view, capture_spec_type=None)  # type: ignore[arg-type]


def _facts(clobbered: int | None = None) -> SchedulerFacts:
    return SchedulerFacts(
        group=_group("scheduler"),
        labels=PlaneLabels((1, 3)),
        num_blocks=NUM_BLOCKS,
        bytes_per_token=PLANES * HIDDEN * 4,
        clobbered_slot=clobbered,
    )


def _adapter(release: str = RELEASE) -> VllmAdapter:
    """The release's real adapter; only ``read_step`` is replaced: the tests hand it the core ``StepInfo`` that it
    would have read out of vLLM's ``SchedulerOutput``."""
    adapter = adapter_for_version(release)
    adapter.read_step = lambda step: step  # type: ignore[method-assign,assignment,return-value]
    return adapter


def _scheduler(extra: dict[str, Any] | None = None, clobbered: int | None = None) -> CaptureScheduler:
    return CaptureScheduler(_adapter(), ConnectorConfig.from_extra(extra or {}), _facts(clobbered))


def _request(
    rid: str = "r1", prompt: int = 6, generated: int = 3, *, params: dict[str, Any] | None = None, **kw: Any
) -> FinishedRequest:
    tokens = tuple(range(100, 100 + prompt + generated))
    fields: dict[str, Any] = dict(
        req_id=rid,
        num_computed_tokens=len(tokens) - 1,
        num_prompt_tokens=prompt,
        token_ids=tokens,
        aborted=False,
        status="FINISHED_LENGTH_CAPPED",
        params=params,
    )
    fields.update(kw)
    return FinishedRequest(**fields)


def _entry(params: dict[str, Any]) -> dict[str, Any]:
    entry = params[V.RESULT_KEY]
    assert isinstance(entry, dict)
    return entry


# --- the scheduler half -----------------------------------------------------------------------------------------
def test_a_finished_request_is_queued_with_its_positions_blocks_and_tokens() -> None:
    s = _scheduler({"capture": "all"})
    hold, params = s.finished(_request(), [3, 7, 9])
    entry = _entry(params)
    assert hold is True and entry["status"] == V.STATUS_QUEUED
    assert (entry["start"], entry["num_tokens"], entry["num_prompt_tokens"]) == (0, 8, 6)  # 9 tokens, 8 computed
    plan = s.build_plan(StepInfo((), (), {}))
    (save,) = plan.saves
    assert save.block_ids == (3, 7) and (save.start, save.stop) == (0, 8)
    assert save.token_ids == tuple(range(100, 108)) and save.publication
    assert s.held == 1 and s.build_plan(StepInfo((), (), {})).saves == []  # sent once


def test_a_step_in_flight_at_finish_is_left_out_of_the_record() -> None:
    """Async scheduling (vLLM's default on CUDA): when a request finishes, ``num_computed_tokens`` also counts a step
    already scheduled after it, whose positions are not final (on an H100: 29 computed for a request of 28 tokens,
    its last row another token's); the record ends at the positions the scheduler confirmed, ``num_computed_tokens``
    minus vLLM's ``num_output_placeholders``.  Control: the same count without placeholders (a synchronous engine
    whose last draft was accepted) keeps every position."""
    s = _scheduler({"capture": "all"})
    _, params = s.finished(_request("ahead", num_computed_tokens=10, num_output_placeholders=2), [3, 7, 9])
    assert _entry(params)["num_tokens"] == 8  # 9 tokens; 10 counted, 2 of them in flight: positions 0-7
    _, params = s.finished(_request("synchronous", num_computed_tokens=9), [3, 7, 9])
    assert _entry(params)["num_tokens"] == 9


@pytest.mark.parametrize(
    ("request_kw", "blocks", "reason", "status"),
    [
        (dict(aborted=True, status="FINISHED_ABORTED"), [3, 7, 9], V.REASON_ABORTED, V.STATUS_FAILED),
        (dict(params={"hs_capture": {"capture": "everything"}}), [3, 7, 9], V.REASON_BAD_PARAMS, V.STATUS_FAILED),
        (dict(params={"hs_capture": {"enabled": False}}), [3, 7, 9], V.REASON_DISABLED, V.STATUS_SKIPPED),
        (dict(params={"hs_capture": {"window": [3, 3]}}), [3, 7, 9], V.REASON_EMPTY, V.STATUS_FAILED),
        (dict(num_computed_tokens=4), [3, 7, 9], V.REASON_PROMPT_INCOMPLETE, V.STATUS_FAILED),
        ({}, [3], V.REASON_BLOCKS, V.STATUS_FAILED),  # 6 prompt positions need 2 blocks of 4
        ({}, [3, NUM_BLOCKS], V.REASON_BLOCKS, V.STATUS_FAILED),  # past the cache
        ({}, [3, -1], V.REASON_BLOCKS, V.STATUS_FAILED),
    ],
    ids=["aborted", "bad_params", "disabled", "empty", "prompt_incomplete", "too_few_blocks", "past_cache", "neg"],
)
def test_each_refusal_names_its_reason_holds_nothing_and_its_control_is_queued(
    request_kw: dict[str, Any], blocks: list[int], reason: str, status: str
) -> None:
    s = _scheduler()
    hold, params = s.finished(_request(**request_kw), blocks)
    entry = _entry(params)
    assert (hold, entry["status"], entry["reason"]) == (False, status, reason), entry
    assert entry["message"] and s.held == 0 and s.build_plan(StepInfo((), (), {})).saves == []
    assert reason in V.REASONS
    # control: the plain request with enough blocks inside the cache is queued by the same scheduler
    hold, params = s.finished(_request("control"), [3, 7, 9])
    assert hold is True and _entry(params)["status"] == V.STATUS_QUEUED


def test_the_clobbered_padding_slot_refuses_only_records_that_read_it() -> None:
    clobbered = 7 * BLOCK + 3  # the last slot of block 7
    s = _scheduler(clobbered=clobbered)
    hold, params = s.finished(_request(), [3, 7, 9])  # positions 0-5: block 7 holds 4..7, position 7 unread
    assert hold is True, _entry(params)  # control: block 7's last slot lies past the prompt
    hold, params = s.finished(_request("long", prompt=8), [3, 7, 9])  # position 7 = block 7 slot 3
    entry = _entry(params)
    assert (hold, entry["reason"]) == (False, V.REASON_PADDING) and "position 7" in entry["message"]


def test_slot_checks_follow_the_first_requests_through_their_steps() -> None:
    s = _scheduler({"check_requests": 1})
    first = ScheduledNew("a", ((3, 7),), 0)
    second = ScheduledNew("b", ((5,),), 0)
    plan = s.build_plan(StepInfo((first, second), (), {"a": 6, "b": 2}))
    assert [(c.req_id, c.block_ids, c.start, c.num_tokens) for c in plan.checks] == [("a", (3, 7), 0, 6)]
    assert s.counters["slot_checks_sent"] == 1
    # the finished request's blocks differ from the ones followed: counted, the finish's blocks win
    hold, _ = s.finished(_request("a"), [3, 8, 9])
    assert hold and s.counters["tracking_mismatch"] == 1
    assert s.build_plan(StepInfo((), (), {})).saves[0].block_ids == (3, 8)


def test_an_untested_release_checks_the_slots_of_every_request() -> None:
    """A release newer than every era (the adapter is ``untested``): every request is followed, whatever
    ``check_requests`` says; the control is the tested release's adapter, which follows only the first."""
    batch = StepInfo(tuple(ScheduledNew(r, ((i + 1,),), 0) for i, r in enumerate("abcd")), (), {r: 2 for r in "abcd"})
    untested = _adapter("9.1.0")
    assert untested.untested and untested.check_every_request
    s = CaptureScheduler(untested, ConnectorConfig.from_extra({"check_requests": 1}), _facts())
    assert [c.req_id for c in s.build_plan(batch).checks] == list("abcd")
    control = _scheduler({"check_requests": 1})
    assert not control.adapter.check_every_request
    assert [c.req_id for c in control.build_plan(batch).checks] == ["a"]


MISPLACED = "Model Runner V1 counts one token for a step that emits two"


def test_an_engine_that_misplaces_drafts_says_so_at_start(caplog: pytest.LogCaptureFixture) -> None:
    """An engine whose adapter says it writes generated rows after a two-token step one place short (async
    scheduling, Model Runner V1, vllm-project/vllm#56417) warns at start how to keep such records; control: an
    engine without it -- async scheduling alone included -- stays quiet."""
    with caplog.at_level("WARNING", logger="vllm.vllm_hs_compat.connector"):
        CaptureScheduler(
            _adapter(), ConnectorConfig.from_extra({}), dataclasses.replace(_facts(), async_scheduling=True)
        )
    assert not [r for r in caplog.records if "--no-async-scheduling" in r.getMessage()]
    with caplog.at_level("WARNING", logger="vllm.vllm_hs_compat.connector"):
        CaptureScheduler(
            _adapter(),
            ConnectorConfig.from_extra({}),
            dataclasses.replace(_facts(), async_scheduling=True, misplaced_drafts=MISPLACED),
        )
    said = [r.getMessage() for r in caplog.records if "--no-async-scheduling" in r.getMessage()]
    assert said and MISPLACED in said[0] and V.REASON_ASYNC_DRAFTS in said[0]


def _repeating(rid: str, generated: tuple[int, ...], **kw: Any) -> FinishedRequest:
    """A request of 6 prompt tokens (100-105) that generated ``generated``."""
    tokens = tuple(range(100, 106)) + generated
    return _request(rid, token_ids=tokens, num_computed_tokens=len(tokens) - 1, **kw)


@pytest.mark.parametrize("misplaced", [MISPLACED, None], ids=["misplacing_engine", "control"])
def test_records_past_a_two_token_step_fail_by_name_where_the_engine_misplaces_them(misplaced: str | None) -> None:
    """On the H100 (vLLM 0.26.0, async scheduling) generated rows were off only after a generated token repeated
    the one before it -- the mark of a step that emitted two tokens, since extract_hidden_states drafts the last
    sampled token.  Where the engine misplaces them, a record reaching past that position fails
    (``async_drafts``), naming it and the fix; one ending before it, prompt records and outputs without a repeat
    are queued.  Control: the same requests on an engine that places them right are all queued."""
    facts = dataclasses.replace(_facts(), async_scheduling=True, misplaced_drafts=misplaced)
    s = CaptureScheduler(_adapter(), ConnectorConfig.from_extra({"capture": "all"}), facts)
    # generated 200 201 201 ...: position 8 repeats position 7 (a prompt token equal to the first output is no mark)
    repeats = (200, 201, 201, 202)
    hold, params = s.finished(_repeating("past", repeats), [3, 7, 9])
    entry = _entry(params)
    if misplaced is None:
        assert hold and entry["status"] == V.STATUS_QUEUED
    else:
        assert (hold, entry["status"], entry["reason"]) == (False, V.STATUS_FAILED, V.REASON_ASYNC_DRAFTS)
        assert "position 8" in entry["message"] and MISPLACED in entry["message"]
        assert "--no-async-scheduling" in entry["message"]
    queued = [
        _repeating("before", repeats, params={"hs_capture": {"window": [0, 8]}}),  # positions 0-7
        _repeating("prompt", repeats, params={"hs_capture": {"capture": "prompt"}}),
        _repeating("no_repeat", (105, 200, 201, 202)),  # the first output equals the last prompt token: no mark
    ]
    for fr in queued:
        hold, params = s.finished(fr, [3, 7, 9])
        assert hold and _entry(params)["status"] == V.STATUS_QUEUED, (fr.req_id, _entry(params))


def test_the_first_generated_repeat_is_found_among_generated_tokens_only() -> None:
    assert _repeating("a", (200, 201, 201, 201)).first_generated_repeat == 8
    assert _repeating("b", (105, 200, 201)).first_generated_repeat is None  # prompt's last == first output
    assert _repeating("c", (200, 200)).first_generated_repeat == 7
    assert _repeating("d", ()).first_generated_repeat is None


def test_a_shutdown_with_unsent_records_leaves_an_error_file_per_record(tmp_path: Path) -> None:
    s = _scheduler({"sink": "file", "file": {"path": str(tmp_path)}})
    assert s.finished(_request("lost"), [3, 7, 9])[0]
    s.shutdown()
    with pytest.raises(RecordFailedError, match=f"{V.REASON_ENGINE_STOPPED}: the engine stopped"):
        files.read_record(files.record_paths(tmp_path, "lost")[2])
    assert s.counters["records_lost_at_shutdown"] == 1


# --- the worker half --------------------------------------------------------------------------------------------
def _cache() -> torch.Tensor:
    """[blocks, tokens, planes, hidden], each row's values naming its slot and plane."""
    slots = torch.arange(NUM_BLOCKS * BLOCK, dtype=torch.float32).view(NUM_BLOCKS, BLOCK, 1, 1)
    planes = torch.arange(PLANES, dtype=torch.float32).view(1, 1, PLANES, 1) / 10
    return (slots + planes).expand(NUM_BLOCKS, BLOCK, PLANES, HIDDEN).contiguous()


@pytest.fixture
def make_worker() -> Iterator[Any]:
    made: list[CaptureWorker] = []

    def make(extra: dict[str, Any], *, owner_tp_rank: int = 0) -> CaptureWorker:
        facts = WorkerFacts(
            group=_group("worker"), labels=PlaneLabels((1, 3)), hidden_size=HIDDEN, ranks=Ranks(tp_rank=owner_tp_rank)
        )
        w = CaptureWorker(adapter_for_version(RELEASE), ConnectorConfig.from_extra(extra), facts)
        w.register_kv_caches({LAYER: _cache()})
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown(10)


def _save(s: CaptureScheduler, rid: str, blocks: list[int], **kw: Any) -> StepPlan:
    assert s.finished(_request(rid, **kw), blocks)[0]
    return s.build_plan(StepInfo((), (), {}))


def _drain(w: CaptureWorker) -> set[str]:
    assert w.drain(10)
    return w.finished()


def test_the_worker_reads_each_saved_record_exactly_into_the_file_sink(make_worker: Any, tmp_path: Path) -> None:
    w = make_worker({"sink": "file", "file": {"path": str(tmp_path)}})
    s = _scheduler({"capture": "all"})
    w.on_step(_save(s, "r1", [3, 7, 9]))
    assert _drain(w) == {"r1"}
    record = files.read_record(files.record_paths(tmp_path, "r1")[1])
    slots = [3 * BLOCK + i for i in range(4)] + [7 * BLOCK + i for i in range(4)]
    want = torch.tensor([[slot + p / 10 for p in range(PLANES)] for slot in slots]).unsqueeze(-1).expand(8, 2, 8)
    assert torch.equal(record.hidden_states, want)
    assert list(record.meta.token_ids) == list(range(100, 108)) and record.meta.layer_ids == (1, 3)
    # control: another request's blocks give other rows
    w.on_step(_save(s, "r2", [4, 5, 6]))
    _drain(w)
    other = files.read_record(files.record_paths(tmp_path, "r2")[1])
    assert not torch.equal(other.hidden_states, want)


def test_the_worker_times_its_stages_and_logs_them_at_shutdown(
    make_worker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the worker's time goes (docs/gpu.md, "Throughput"): issuing the reads, the copy, the NaN/Inf check,
    the record and the sink's write each add up; the control is a worker that published nothing (all zero)."""
    idle = make_worker({"sink": "file", "file": {"path": str(tmp_path / "idle")}})
    assert set(idle.seconds.values()) == {0.0}
    w = make_worker({"sink": "file", "file": {"path": str(tmp_path)}})
    s = _scheduler({"capture": "all"})
    w.on_step(_save(s, "r1", [3, 7, 9]))
    _drain(w)
    assert all(w.seconds[k] > 0 for k in ("issue", "finite", "record", "sink")), w.seconds
    with caplog.at_level("INFO", logger="vllm.vllm_hs_compat.connector"):
        w.shutdown()
    assert any("vllm-hs-compat worker seconds: {'issue'" in r.getMessage() for r in caplog.records)


def test_the_self_test_hook_corrupts_exactly_the_named_record_before_its_checksum(
    make_worker: Any, tmp_path: Path
) -> None:
    """``"self_test": {"corrupt_record": 1}`` (``demo --corrupt-record``): the second record built has one row of its
    first plane negated and a checksum that matches the corrupted rows (it reads back without error); the records
    around it are exact.  Control: the same saves without the hook give the exact rows for all three."""
    got: dict[str, dict[str, torch.Tensor]] = {}
    for name, extra in (("hook", {"self_test": {"corrupt_record": 1}}), ("control", {})):
        out = tmp_path / name
        w = make_worker({"sink": "file", "file": {"path": str(out)}, **extra})
        s = _scheduler({"capture": "all"})
        for rid, blocks in (("r0", [3, 7, 9]), ("r1", [4, 5, 6]), ("r2", [8, 2, 1])):
            w.on_step(_save(s, rid, blocks))
            assert _drain(w) == {rid}
        got[name] = {
            rid: files.read_record(files.record_paths(out, rid)[1]).hidden_states for rid in ("r0", "r1", "r2")
        }
    hook, control = got["hook"], got["control"]
    assert torch.equal(hook["r0"], control["r0"]) and torch.equal(hook["r2"], control["r2"])
    diff = (hook["r1"] != control["r1"]).nonzero().tolist()
    mid = control["r1"].shape[0] // 2
    assert {(r, p) for r, p, _ in diff} == {(mid, 0)}, diff
    assert torch.equal(hook["r1"][mid, 0], -control["r1"][mid, 0])


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_rows_holding_nan_or_inf_fail_the_record_as_non_finite_before_it_is_made(
    make_worker: Any, tmp_path: Path, value: float
) -> None:
    """One value of one capture row made NaN (or Inf) in the cache: the record reading that row fails by the
    vocabulary's ``non_finite`` (an error file naming the position and layer id, no record file, counted); a
    record of other blocks is made.  Without the worker's check the file sink would write the record with a
    checksum of the NaN rows, which verifies."""
    w = make_worker({"sink": "file", "file": {"path": str(tmp_path)}})
    assert w.reader is not None
    w.reader.cache[7, 1, 1, 5] = value  # block 7, token 1: position 5 of a request holding blocks [3, 7, ...]
    s = _scheduler({"capture": "all"})
    w.on_step(_save(s, "bad", [3, 7, 9]))
    w.on_step(_save(s, "good", [4, 5, 6]))
    assert _drain(w) == {"bad", "good"}
    tensors, manifest, error = files.record_paths(tmp_path, "bad")
    assert not tensors.exists() and not manifest.exists()
    with pytest.raises(RecordFailedError, match=f"{V.REASON_NON_FINITE}: 1 of 8 token rows hold NaN/Inf") as err:
        files.read_record(error)
    assert "the first at position 5, layer ids [3]" in str(err.value)
    assert w.counters["records_non_finite"] == 1
    assert files.read_record(files.record_paths(tmp_path, "good")[1]).hidden_states.isfinite().all()  # control


def test_a_non_owner_reports_saves_done_and_writes_nothing(make_worker: Any, tmp_path: Path) -> None:
    w = make_worker({"sink": "file", "file": {"path": str(tmp_path)}}, owner_tp_rank=1)
    assert not w.owner
    w.on_step(_save(_scheduler(), "r1", [3, 7, 9]))
    assert w.finished() == {"r1"} and not list(tmp_path.iterdir())


def test_a_failed_slot_check_fails_that_record_and_its_control_passes(
    make_worker: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = make_worker({"sink": "file", "file": {"path": str(tmp_path)}, "check_requests": 2})
    s = _scheduler({"check_requests": 2})
    plan = s.build_plan(StepInfo((ScheduledNew("bad", ((3, 7),), 0), ScheduledNew("good", ((4, 5),), 0)), (), {
        "bad": 6, "good": 6,
    }))  # fmt: skip
    written = [3 * BLOCK + i for i in range(4)] + [7 * BLOCK]  # "bad" position 5 (slot 29) was not written
    written += [4 * BLOCK + i for i in range(4)] + [5 * BLOCK + i for i in range(2)]
    monkeypatch.setattr(w.adapter, "layer_slot_mapping", lambda name, meta: torch.tensor(written))
    w.on_capture_written(LAYER, None, plan)
    assert w.counters["slot_checks"] == 2 and w.counters["slot_checks_failed"] == 1
    w.on_step(_save(s, "bad", [3, 7, 9]))
    w.on_step(_save(s, "good", [4, 5, 9]))
    assert _drain(w) == {"bad", "good"}
    with pytest.raises(RecordFailedError, match=f"{V.REASON_SLOT_CHECK}: position 5 maps to slot 29"):
        files.read_record(files.record_paths(tmp_path, "bad")[2])
    assert len(files.read_record(files.record_paths(tmp_path, "good")[1]).meta.token_ids) == 6


def _blocked_sink(w: CaptureWorker) -> threading.Event:
    """Make ``w``'s sink wait in every write until the returned event is set (a sink slower than the engine)."""
    sink = w.sink
    assert sink is not None
    release = threading.Event()
    write = sink.write

    def slow(record: Any, publication: Any) -> None:
        assert release.wait(10)
        write(record, publication)

    sink.write = slow  # type: ignore[method-assign,assignment]
    return release


def test_saves_past_the_backlog_wait_in_their_blocks_and_are_read_later(
    make_worker: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sink slower than the engine: once the records on their way to it pass the backlog bound, the next saves
    are not read (their blocks stay held: vLLM schedules around them) and not failed; a later step reads them once
    the sink caught up.  Nothing is lost.  Control: under a bound with room, the same save is read at once."""
    w = make_worker({"sink": "file", "file": {"path": str(tmp_path)}})
    s = _scheduler({"capture": "all"})
    monkeypatch.setattr(worker_module, "MAX_BACKLOG_BYTES", 8 * PLANES * HIDDEN * 4)  # one record of 8 rows
    release = _blocked_sink(w)
    w.on_step(_save(s, "first", [3, 7, 9]))  # alone: read whatever the bound
    w.on_step(_save(s, "second", [4, 5, 6]))
    assert w.finished() == {"first"}  # the first is read (on CPU at issue); the second waits
    assert w.counters["saves_waited"] == 1 and w.counters["records_failed"] == 0
    w.on_step(s.build_plan(StepInfo((), (), {})))  # a step while the sink still holds the first: still waiting
    assert w.finished() == set() and w.counters["saves_waited"] == 1
    release.set()
    assert w.drain(10)
    w.on_step(s.build_plan(StepInfo((), (), {})))  # the next step reads it
    assert _drain(w) == {"second"}
    assert w.counters["records"] == 2 and w.counters["records_failed"] == 0
    for rid in ("first", "second"):
        assert len(files.read_record(files.record_paths(tmp_path, rid)[1]).meta.token_ids) == 8
    # control: with room for both, the second is read in its own step, the sink still blocked
    w2 = make_worker({"sink": "file", "file": {"path": str(tmp_path / "roomy")}})
    monkeypatch.setattr(worker_module, "MAX_BACKLOG_BYTES", 16 * PLANES * HIDDEN * 4)
    release2 = _blocked_sink(w2)
    w2.on_step(_save(s, "a", [3, 7, 9]))
    w2.on_step(_save(s, "b", [4, 5, 6]))
    assert w2.finished() == {"a", "b"} and w2.counters["saves_waited"] == 0
    release2.set()
    _drain(w2)


def test_saves_still_waiting_when_the_engine_stops_fail_by_name(
    make_worker: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted, never silent: a save the engine stopped before reading fails as ``backlog`` in its own file."""
    w = make_worker({"sink": "file", "file": {"path": str(tmp_path)}})
    s = _scheduler({"capture": "all"})
    monkeypatch.setattr(worker_module, "MAX_BACKLOG_BYTES", 8 * PLANES * HIDDEN * 4)
    release = _blocked_sink(w)
    w.on_step(_save(s, "first", [3, 7, 9]))
    w.on_step(_save(s, "stuck", [4, 5, 6]))
    release.set()
    w.shutdown(10)
    assert w.counters["records"] == 1 and w.counters["records_failed"] == 1
    with pytest.raises(RecordFailedError, match=f"{V.REASON_BACKLOG}: the engine stopped"):
        files.read_record(files.record_paths(tmp_path, "stuck")[2])
    assert len(files.read_record(files.record_paths(tmp_path, "first")[1]).meta.token_ids) == 8  # control


@pytest.mark.parametrize("writers", [3, 1])
def test_native_file_records_are_written_by_several_threads_at_once(
    make_worker: Any, tmp_path: Path, writers: int
) -> None:
    """``file.writers``: native records are files of their own, written by that many publisher threads at once (a
    GPU engine's records come faster than one thread writes them).  Each write here waits until three are in
    progress together: with 3 writers all three records are written; control, with 1 writer no second write ever
    starts beside the first, so each record fails (named) instead."""
    w = make_worker({"sink": "file", "file": {"path": str(tmp_path), "writers": writers}})
    sink = w.sink
    assert sink is not None and sink.writers == writers
    together = threading.Barrier(3, timeout=1.5)
    write = sink.write

    def side_by_side(record: Any, publication: Any) -> None:
        together.wait()
        write(record, publication)

    sink.write = side_by_side  # type: ignore[method-assign,assignment]
    s = _scheduler({"capture": "all"})
    for rid, blocks in (("a", [3, 7, 9]), ("b", [4, 5, 6]), ("c", [10, 11, 12])):
        w.on_step(_save(s, rid, blocks))
    assert _drain(w) == {"a", "b", "c"}
    if writers == 3:
        assert w.counters["records"] == 3 and w.counters["records_failed"] == 0
        for rid in ("a", "b", "c"):
            assert len(files.read_record(files.record_paths(tmp_path, rid)[1]).meta.token_ids) == 8
    else:
        assert w.counters["records"] == 0 and w.counters["records_failed"] == 3


def test_file_writers_are_checked_and_a_trainer_format_takes_one(tmp_path: Path) -> None:
    from vllm_hs_compat.errors import CaptureConfigError

    for bad in (0, 65, True, "4"):
        with pytest.raises(CaptureConfigError, match="file.writers must be an integer in 1..64"):
            ConnectorConfig.from_extra({"sink": "file", "file": {"path": str(tmp_path), "writers": bad}})
    with pytest.raises(CaptureConfigError, match="takes one writer"):
        ConnectorConfig.from_extra(
            {"sink": "file", "file": {"path": str(tmp_path), "format": "speculators", "writers": 2}}
        )
    ConnectorConfig.from_extra({"sink": "file", "file": {"path": str(tmp_path), "writers": 8}})  # control


def test_a_plan_for_another_group_stops_the_worker_loudly(make_worker: Any, tmp_path: Path) -> None:
    w = make_worker({"sink": "file", "file": {"path": str(tmp_path)}})
    with pytest.raises(CaptureGroupError, match="block size 16"):
        w.on_step(StepPlan(0, 0, 16, []))
    w.on_step(StepPlan(1, 0, BLOCK, []))  # control: the right group passes


def test_a_full_export_pool_fails_the_record_as_pool_full_at_fetch(make_worker: Any) -> None:
    """The worker's sink error reaches the ticket's fetch named by the vocabulary (``pool_full``), as the docs say;
    the record that found a slot is fetched whole."""
    from vllm_hs_compat.export import ExportConsumer

    export = {"backend": "shm", "num_slots": 1, "slot_bytes": 4096, "on_full": "drop"}
    w = make_worker({"sink": "export", "export": export})
    info = w.handshake_info()
    assert info is not None
    s = _scheduler()
    s.on_handshake([info])
    tickets = {}
    for rid in ("first", "second"):
        hold, params = s.finished(_request(rid), [3, 7, 9])
        assert hold
        tickets[rid] = params
        w.on_step(s.build_plan(StepInfo((), (), {})))
    assert _drain(w) == {"first", "second"}
    with ExportConsumer.from_params(tickets["first"]) as c:
        assert c.fetch("first", wait_s=5).hidden_states.shape == (6, PLANES, HIDDEN)
    with ExportConsumer.from_params(tickets["second"]) as c, pytest.raises(RecordFailedError) as info2:
        c.fetch("second", wait_s=5)
    assert f"{V.REASON_POOL_FULL}: PoolFullError" in str(info2.value)
    assert json.dumps(tickets["second"])  # the params a client receives are plain JSON
    assert dataclasses.is_dataclass(w.facts)


# --- one record's metadata from the connector to the trainer ----------------------------------------------------
#: a request whose record sets every metadata field away from its default (window: rows are positions 2..7)
SAMPLED = {
    "hs_capture": {
        "capture": "all",
        "window": [2, None],
        "sample": {"id": "row-17", "source": "chat.jsonl:17", "loss_mask_spans": [[3, 6]], "metadata": {"k": [1]}},
    }
}


def _published(make_worker: Any, tmp_path: Path, rids: list[str]) -> tuple[Any, dict[str, Any]]:
    """A worker with a real export sink (shm) publishes one record per id from ``SAMPLED`` requests; returns its
    producer and each record as the connector made it (its metadata before the producer adds the checksum)."""
    w = make_worker({"sink": "export", "export": {"backend": "shm", "token_file": str(tmp_path / "token")}})
    made: dict[str, Any] = {}
    record = w._record

    def spy(save: Any, rows: torch.Tensor) -> Any:  # observes the connector's record, changes nothing
        rec = record(save, rows)
        made[rec.meta.record_id] = rec
        return rec

    w._record = spy
    s = _scheduler()
    for rid in rids:
        w.on_step(_save(s, rid, [3, 7, 9], params=SAMPLED))
    assert _drain(w) == set(rids)
    return w.sink.producer, made


def _differences(got: Any, want: Any) -> list[str]:
    """The metadata fields in which ``got`` differs from ``want`` (every field of the one record type)."""
    from vllm_hs_compat.core.records import RecordMeta

    return [f for f in RecordMeta.__struct_fields__ if getattr(got, f) != getattr(want, f)]


def test_a_records_metadata_reaches_the_consumer_and_the_trainer_item_unchanged(
    make_worker: Any, tmp_path: Path
) -> None:
    """connector (RecordMeta.for_tensor in the worker) -> wire (the descriptor in the producer's pool) -> consumer
    (fetch, and a batch's records) -> trainer item (HiddenStatesDataset): every field arrives as the connector made
    it, the producer's checksum added.  The negative control is the next test: a field dropped on the wire."""
    from vllm_hs_compat.export import ExportConsumer
    from vllm_hs_compat.export import protocol as P
    from vllm_hs_compat.trainer import HiddenStatesDataset

    producer, made = _published(make_worker, tmp_path, ["item"])
    want = made["item"].meta
    assert want.start == 2 and want.sample_id == "row-17" and want.loss_mask_spans == ((3, 6),)  # fields set
    wire = P.decode_descriptor(producer.pool._by_record["item"].wire).meta
    assert wire.checksum is not None and not wire.token_ids
    assert _differences(wire, want.with_checksum(wire.checksum).without_token_ids()) == []
    (item,) = list(
        HiddenStatesDataset.from_export(producer.endpoint, producer.token, layout="planes", max_records=1, wait_s=5)
    )
    assert item["record_id"] == want.record_id and item["sample_id"] == want.sample_id
    assert (item["start"], item["num_prompt_tokens"]) == (want.start, want.num_prompt_tokens)
    assert item["layer_ids"].tolist() == list(want.layer_ids) and item["input_ids"].tolist() == list(want.token_ids)
    assert item["loss_mask_from"] == "record" and torch.equal(item["loss_mask"], want.loss_mask())
    assert torch.equal(item["hidden_states"], made["item"].hidden_states)

    producer, made = _published(make_worker, tmp_path / "2", ["fetched", "batched"])
    with ExportConsumer(producer.endpoint, producer.token) as c:
        rec = c.fetch("fetched", wait_s=5)
        assert _differences(rec.meta, made["fetched"].meta.with_checksum(rec.meta.checksum or 0)) == []
        (batch,) = c.fetch_batch(["batched"], wait_s=5)
        (brec,) = batch.records()  # type: ignore[union-attr]
        assert _differences(brec.meta, made["batched"].meta.with_checksum(brec.meta.checksum or 0)) == []
        assert torch.equal(brec.hidden_states, made["batched"].hidden_states)


#: metadata fields dropped from a descriptor's map on the wire by the negative control (all but layer_ids have defaults)
DROPPED = [
    "sample_id",
    "source",
    "loss_mask_spans",
    "metadata_json",
    "start",
    "num_prompt_tokens",
    "adapter",
    "layer_ids",
]


def test_negative_control_a_field_dropped_on_the_wire_is_caught(make_worker: Any, tmp_path: Path) -> None:
    """Each record's descriptor with one metadata field removed from its map on the wire: a field with a default
    comes back at its default, which the comparison above names (and only it); a field without one makes the
    descriptor undecodable, which the consumer refuses by name."""
    import msgspec

    from vllm_hs_compat.errors import DescriptorError
    from vllm_hs_compat.export import ExportConsumer

    producer, made = _published(make_worker, tmp_path, DROPPED)
    for field in DROPPED:
        lease = producer.pool._by_record[field]
        desc = msgspec.msgpack.decode(lease.wire)
        del desc["meta"][field]
        lease.wire = msgspec.msgpack.encode(desc)
    found: dict[str, Any] = {}
    with ExportConsumer(producer.endpoint, producer.token) as c:
        for field in DROPPED:
            try:
                rec = c.fetch(field, wait_s=5)
            except DescriptorError as e:
                found[field] = "layer_ids" in str(e) and "DescriptorError"
            else:
                found[field] = _differences(rec.meta, made[field].meta.with_checksum(rec.meta.checksum or 0))
    assert found == {f: [f] for f in DROPPED[:-1]} | {"layer_ids": "DescriptorError"}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_async_scheduling_leaves_the_steps_after_drafts_unchecked(
    make_worker: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    """Async scheduling (vLLM's default on CUDA): a decode step's start counts the request's last drafts as
    accepted, and the GPU worker moves it back by the rejected ones (on an H100, 0.26.0: every capture=all record
    failed its check for it).  Such a step is not checked (counted); the prompt and the first decode step, whose
    starts are certain, are.  The control: without async scheduling the same step is checked, and the worker's
    moved-back writes fail it -- as they must, since there the scheduler's start is exact."""
    w = make_worker({"sink": "file", "file": {"path": str(tmp_path)}, "check_requests": 1})
    facts = dataclasses.replace(_facts(), async_scheduling=async_scheduling)
    s = CaptureScheduler(_adapter(), ConnectorConfig.from_extra({"check_requests": 1}), facts)
    prompt = s.build_plan(StepInfo((ScheduledNew("a", ((3, 7),), 0),), (), {"a": 4}))  # positions 0-3
    first = s.build_plan(StepInfo((), (ScheduledCached("a", None, False, 4),), {"a": 2}, spec_tokens={"a": 1}))
    after = s.build_plan(StepInfo((), (ScheduledCached("a", None, False, 6),), {"a": 2}, spec_tokens={"a": 1}))
    assert [(c.start, c.num_tokens) for c in prompt.checks + first.checks] == [(0, 4), (4, 2)]
    assert [(c.start, c.num_tokens) for c in after.checks] == ([] if async_scheduling else [(6, 2)])
    assert s.counters["slot_checks_uncertain"] == int(async_scheduling)
    written = [7 * BLOCK + 1, 7 * BLOCK + 2]  # positions 5-6: the draft at 5 was rejected, the worker went back
    monkeypatch.setattr(w.adapter, "layer_slot_mapping", lambda name, meta: torch.tensor(written))
    w.on_capture_written(LAYER, None, after)
    assert (w.counters["slot_checks"], w.counters["slot_checks_failed"]) == ((0, 0) if async_scheduling else (1, 1))


def test_a_records_host_rows_are_let_go_once_the_sink_wrote_it(make_worker: Any, tmp_path: Path) -> None:
    """No thread of the worker keeps a published record's rows (on CUDA a view of its step's pinned host block,
    which torch's allocator hands out again only once nothing references it) while it waits for the next one.
    Control: while the sink still holds the record, its rows are alive."""
    import weakref

    w = make_worker({"sink": "file", "file": {"path": str(tmp_path)}})
    assert w.reader is not None
    seen: list[weakref.ref[torch.Tensor]] = []
    read_many = w.reader.read_many

    def watched(requests: Any) -> Any:
        got = read_many(requests)
        for p in got:
            assert not isinstance(p, Exception)
            seen.append(weakref.ref(p.rows if p.rows._base is None else p.rows._base))
        return got

    w.reader.read_many = watched  # type: ignore[method-assign]
    release = _blocked_sink(w)
    s = _scheduler({"capture": "all"})
    w.on_step(_save(s, "r1", [3, 7, 9]))
    assert len(seen) == 1 and seen[0]() is not None  # control: in the sink's hands
    release.set()
    w.on_step(_save(s, "r2", [4, 5, 6]))
    assert _drain(w) == {"r1", "r2"}
    assert len(seen) == 2 and [r() for r in seen] == [None, None]
    assert w.counters["records"] == 2


def test_the_worker_reads_its_arena_size_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(envs.PINNED_MIB, "lots")
    with pytest.raises(CaptureConfigError, match="VLLM_HS_COMPAT_PINNED_MIB='lots'"):
        worker_module._pinned_arena()
    monkeypatch.setenv(envs.PINNED_MIB, "0")
    assert worker_module._pinned_arena() is None
    if not torch.cuda.is_available():  # a host that cannot pin: the reads allocate as they go, said in the log
        monkeypatch.setenv(envs.PINNED_MIB, "1")
        with caplog.at_level(logging.WARNING, logger="vllm.vllm_hs_compat.connector"):
            assert worker_module._pinned_arena() is None
        assert "no pinned arena of 1 MiB" in caplog.text
