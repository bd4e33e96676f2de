"""The ``n > 1`` facts the adapter states (docs/connector.md, "``n > 1``"), against vLLM's own code per release:
vLLM's ``ParentRequest`` names the children, the adapter takes each name apart into the parent and the index; the
engine core's ``Request`` built from a child carries the parent's arrival time, which ``read_finished`` reads."""

from __future__ import annotations

import copy
import importlib
import inspect
from typing import Any

import pytest

from vllm_hs_compat import api

pytestmark = pytest.mark.vllm

N = 3
ARRIVAL = 1764670000.125


def _engine_core_request(request_id: str, n: int) -> Any:
    """A real ``EngineCoreRequest`` (built as ``sched_harness.make_request`` builds one)."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    fields = set(getattr(EngineCoreRequest, "__struct_fields__", ()))
    kw: dict[str, Any] = {
        "request_id": request_id,
        "external_req_id": request_id,
        "prompt_token_ids": [1, 2, 3, 4, 5],
        "mm_features": None,
        "sampling_params": SamplingParams(n=n, max_tokens=2),
        "pooling_params": None,
        "eos_token_id": None,
        "arrival_time": ARRIVAL,
        "lora_request": None,
        "cache_salt": None,
        "data_parallel_rank": None,
    }
    return EngineCoreRequest(**{k: v for k, v in kw.items() if k in fields})


def _parent(request_id: str) -> Any:
    """vLLM's ``ParentRequest`` of an ``n = N`` request (its constructor takes the request, or its id and params)."""
    cls = importlib.import_module("vllm.v1.engine.parallel_sampling").ParentRequest
    req = _engine_core_request(request_id, N)
    if list(inspect.signature(cls.__init__).parameters)[1:2] == ["request"]:
        return cls(req)
    return cls(request_id, req.sampling_params)


def test_the_adapter_takes_vllms_child_ids_apart() -> None:
    adapter = api.get_adapter()
    for parent_id in ("cmpl-8f2a-1b2c3d4e", "0_x", "batch_7"):
        parent = _parent(parent_id)
        ids = [parent.get_child_info(i)[0] for i in range(N)]
        assert [adapter.parallel_sampling_child(c) for c in ids] == [(parent_id, i) for i in range(N)]
    assert adapter.parallel_sampling_child("cmpl-8f2a-1b2c3d4e") is None  # a request of its own


def test_children_share_the_arrival_time_read_finished_reads() -> None:
    from vllm.v1.request import Request

    base = _engine_core_request("p-1", 1)
    adapter = api.get_adapter()
    times = []
    for i in range(N):  # as the engine client fans a request out: copies of one processed request
        child = copy.copy(base)
        child.request_id = f"{i}_p-1"
        req = Request.from_engine_core_request(child, None)  # no block hasher: prefix caching plays no part here
        times.append(adapter.read_finished(req).arrival_time)
    assert times == [ARRIVAL] * N


def test_read_finished_ends_a_record_at_the_positions_the_async_scheduler_confirmed() -> None:
    """vLLM's ``Request`` counts the tokens of steps scheduled ahead in ``num_output_placeholders`` (its async
    scheduler adds them when it schedules a step, takes them off when it sees the step's output, and commits
    prefix-cache blocks only up to ``num_computed_tokens`` minus them).  ``read_finished`` reads that attribute: a
    rename would make the connector count a step in flight as final (the rows an H100 showed wrong)."""
    from vllm.v1.request import Request

    req = Request.from_engine_core_request(_engine_core_request("r-1", 1), None)
    assert req.num_output_placeholders == 0  # the fact, on this release's own class
    adapter = api.get_adapter()
    req.append_output_token_ids([7, 8])  # 5 prompt + 2 generated tokens
    req.num_computed_tokens = 8  # 6 confirmed + a step of 2 in flight
    req.num_output_placeholders = 2
    assert adapter.read_finished(req).num_valid == 6
    req.num_output_placeholders = 0  # control: nothing in flight, every token computed
    assert adapter.read_finished(req).num_valid == 7
