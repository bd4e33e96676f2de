"""A request's ``kv_transfer_params["hs_capture"]["sample"]`` through vLLM's own ``Request`` and ``Scheduler``:
the sample fields land in that request's record (spans clipped to its rows, a null stop = through its last row),
and a bad entry fails that request's record alone (``bad_params``), never the engine or the other requests."""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any

import pytest
import sched_harness as sh
import torch

from vllm_hs_compat.core.capture import RecordFailure

pytestmark = pytest.mark.vllm

GOOD_META = {"lang": "de", "turns": [1, 2]}


def _plans() -> list[sh.RequestPlan]:
    rng = random.Random(19)

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(sh.VOCAB) for _ in range(n))

    sample = {"id": "row-0", "source": "chat.jsonl:0", "loss_mask_spans": [[5, 10], [40, None]], "metadata": GOOD_META}
    return [
        # everything captured; the generated part (from 40 on, null stop) and one prompt span are trained
        sh.RequestPlan("good-all", prompt(40), 8, 0, hs_capture={"capture": "all", "sample": sample}),
        # a window narrows the record to positions 10..19: the spans are clipped to it
        sh.RequestPlan(
            "good-window",
            prompt(30),
            4,
            0,
            hs_capture={"window": [10, 20], "sample": {"id": "row-1", "loss_mask_spans": [[0, 15], [18, 25]]}},
        ),
        # no sample entry: a schema-2 record without sample fields (no mask given)
        sh.RequestPlan("plain", prompt(20), 4, 0),
        # bad entries: refused when parsed, or when the spans meet the request's length
        sh.RequestPlan("bad-overlap", prompt(20), 4, 0, hs_capture={"sample": {"loss_mask_spans": [[5, 10], [8, 12]]}}),
        sh.RequestPlan("bad-past-end", prompt(20), 4, 1, hs_capture={"sample": {"loss_mask_spans": [[0, 999]]}}),
        sh.RequestPlan("bad-key", prompt(20), 4, 1, hs_capture={"sample": {"idd": "x"}}),
        sh.RequestPlan("bad-meta", prompt(20), 4, 1, hs_capture={"sample": {"metadata": {"x": "y" * 5000}}}),
    ]


BAD = {
    "bad-overlap": "sorted and not overlap",
    "bad-past-end": "runs past the request's 2[34] tokens",
    "bad-key": r"unknown keys \['idd'\]",
    "bad-meta": "at most 4096 allowed",
}


def test_request_sample_fields_reach_the_record_and_bad_ones_fail_only_their_own() -> None:
    sh.take_records()
    v2 = not sh.has_v1_runner()  # a V1 engine where the release has one (as before), else V2 (0.34+)
    spec = sh.EngineSpec(
        num_blocks=sh.min_num_blocks("dense", True, v2, 64, 4) * 2, extra_config={"capture": "prompt"}, v2=v2
    )
    engine = sh.build_engine(spec)
    try:
        trace = sh.run_schedule(engine, _plans())
        finished = dict(engine.finished_params)
        free_at_end = engine.free_blocks()
    finally:
        engine.close()
    records = sh.take_records()
    assert not [r for r in records if isinstance(r, RecordFailure)]
    by_id = {r.meta.record_id: r for r in records}
    assert sorted(by_id) == ["good-all", "good-window", "plain"], sorted(by_id)
    for rid, needle in BAD.items():
        entry = finished[rid][1]["hs_record"]
        assert (entry["status"], entry["reason"]) == ("failed", "bad_params"), entry
        assert trace.requests[rid].output_params["hs_record"] == entry  # what the client gets back
        assert re.search(needle, entry["message"]), (rid, entry["message"])

    m = by_id["good-all"].meta
    stop = m.start + m.shape[0]
    assert (m.schema_version, m.sample_id, m.source, m.metadata) == (2, "row-0", "chat.jsonl:0", GOOD_META)
    assert m.start == 0 and stop > 40 and m.loss_mask_spans == ((5, 10), (40, stop))
    mask = m.loss_mask()
    assert mask is not None and mask.sum().item() == 5 + (stop - 40) and mask[40:].all() and not mask[10:40].any()

    w = by_id["good-window"].meta
    assert (w.start, w.shape[0], w.sample_id, w.source) == (10, 10, "row-1", "")
    assert w.loss_mask_spans == ((10, 15), (18, 20))
    assert torch.equal(w.loss_mask(), torch.tensor([1] * 5 + [0] * 3 + [1] * 2))  # type: ignore[arg-type]

    p = by_id["plain"].meta
    assert (p.schema_version, p.sample_id, p.loss_mask_spans, p.metadata) == (2, "", None, {})
    assert p.loss_mask() is None
    for rec in by_id.values():
        rec.check()
        assert (
            rec.meta.token_ids
            == tuple(trace.requests[rec.meta.record_id].token_ids_at_finish)[
                rec.meta.start : rec.meta.start + rec.meta.shape[0]
            ]
        )
    assert free_at_end == engine.initial_free_blocks  # the refused requests' blocks were never held


def test_negative_control_a_worker_that_drops_the_sample_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above fails when the record does not carry what the request sent."""
    from vllm_hs_compat.connector import worker

    real = worker.CaptureWorker._record

    def forgetful(self: Any, save: Any, rows: torch.Tensor) -> Any:
        return real(self, dataclasses.replace(save, sample=None), rows)

    monkeypatch.setattr(worker.CaptureWorker, "_record", forgetful)
    with pytest.raises(AssertionError, match="row-0"):
        test_request_sample_fields_reach_the_record_and_bad_ones_fail_only_their_own()
