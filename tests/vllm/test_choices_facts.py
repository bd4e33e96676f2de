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


def _parent(request_id: str, params: Any) -> Any:
    """vLLM's ``ParentRequest`` for ``request_id`` (its constructor takes the request, or its id and params)."""
    mod = importlib.import_module("vllm.v1.engine.parallel_sampling")
    cls = mod.ParentRequest
    names = list(inspect.signature(cls.__init__).parameters)[1:]
    if names[:1] == ["request"]:
        from types import SimpleNamespace

        req = SimpleNamespace(request_id=request_id, external_req_id=request_id, params=params, sampling_params=params)
        return cls(req)
    return cls(request_id, params)


def test_the_adapter_takes_vllms_child_ids_apart() -> None:
    from vllm import SamplingParams

    adapter = api.get_adapter()
    for parent_id in ("cmpl-8f2a-1b2c3d4e", "0_x", "batch_7"):
        parent = _parent(parent_id, SamplingParams(n=N))
        ids = [parent.get_child_info(i)[0] for i in range(N)]
        assert [adapter.parallel_sampling_child(c) for c in ids] == [(parent_id, i) for i in range(N)]
    assert adapter.parallel_sampling_child("cmpl-8f2a-1b2c3d4e") is None  # a request of its own


def test_children_share_the_arrival_time_read_finished_reads() -> None:
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

    fields = set(getattr(EngineCoreRequest, "__struct_fields__", ()))  # as sched_harness.make_request builds one
    kw: dict[str, Any] = {
        "request_id": "p-1",
        "prompt_token_ids": [1, 2, 3, 4, 5],
        "mm_features": None,
        "sampling_params": SamplingParams(n=1, max_tokens=2),
        "pooling_params": None,
        "eos_token_id": None,
        "arrival_time": 1764670000.125,
        "lora_request": None,
        "cache_salt": None,
        "data_parallel_rank": None,
    }
    base = EngineCoreRequest(**{k: v for k, v in kw.items() if k in fields})
    adapter = api.get_adapter()
    times = []
    for i in range(N):  # as the engine client fans a request out: copies of one processed request
        child = copy.copy(base)
        child.request_id = f"{i}_p-1"
        req = Request.from_engine_core_request(child, None)  # no block hasher: prefix caching plays no part here
        times.append(adapter.read_finished(req).arrival_time)
    assert times == [1764670000.125] * N
