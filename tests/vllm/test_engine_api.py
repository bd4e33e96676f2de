"""``adapters/engine_api``'s calls into the offline engine, against the installed release's own classes.

``capture`` queues its requests with ``LLMEngine.add_request(request_id, prompt, params)``, steps with
``LLMEngine.step()`` and asks ``LLMEngine.has_unfinished_requests()`` (the calls ``LLM.generate`` makes), and reports
each request once with ``RequestOutputKind.FINAL_ONLY``.  A release that moved any of them would break ``capture``
at its first batch; here it fails by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def positional(fn: Callable[..., Any], names: list[str]) -> str | None:
    """None when ``fn`` takes ``names`` as its first positional parameters after ``self`` and needs no other
    argument; else what differs."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    got = [p.name for p in params[: len(names)]]
    if got != names:
        return f"first parameters {got}, expected {names}"
    for p in params[: len(names)]:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return f"{p.name} is {p.kind.description}, not positional"
    required = [p.name for p in params[len(names) :] if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    return f"also requires {required}" if required else None


def test_llm_engine_calls_capture_makes_exist_with_their_arguments() -> None:
    from vllm.v1.engine.llm_engine import LLMEngine

    assert positional(LLMEngine.add_request, ["request_id", "prompt", "params"]) is None
    assert positional(LLMEngine.step, []) is None
    assert positional(LLMEngine.has_unfinished_requests, []) is None
    # the negative control: the checker refuses an order capture does not call with
    assert positional(LLMEngine.add_request, ["prompt", "request_id", "params"]) is not None


def test_final_only_is_set_on_the_releases_sampling_params() -> None:
    from vllm.sampling_params import RequestOutputKind

    from vllm_hs_compat.adapters import engine_api

    params = engine_api.sampling_params(max_tokens=1, temperature=0.0)
    assert params.output_kind != RequestOutputKind.FINAL_ONLY  # the release's default: every step reported
    assert engine_api.final_only(params) is params
    assert params.output_kind == RequestOutputKind.FINAL_ONLY
