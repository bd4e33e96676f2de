"""vLLM's offline engine entry points, for the tools that run an engine (``demo``, ``verify``, ``capture``).

The faces never spell a vLLM module path; they build engines and sampling parameters through these functions.
``LLM``, ``SamplingParams``, ``RequestOutputKind`` and ``KVTransferConfig`` sit where they are on every supported
release (0.17-0.34), and ``LLM.llm_engine`` is the v1 ``LLMEngine`` whose ``add_request(request_id, prompt, params)``,
``step()`` and ``has_unfinished_requests()`` ``LLM.generate`` itself calls (tests/vllm/test_engine_api.py holds their
signatures per release), so no era module needs to own a delta here.  vLLM is imported on the first call, never at
import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def offline_llm(args: Mapping[str, Any], kv_transfer_config: Mapping[str, Any]) -> Any:
    """``vllm.LLM(**args, kv_transfer_config=KVTransferConfig(**kv_transfer_config))``."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(**args, kv_transfer_config=KVTransferConfig(**kv_transfer_config))


def sampling_params(**kwargs: Any) -> Any:
    """``vllm.SamplingParams(**kwargs)``."""
    from vllm import SamplingParams

    return SamplingParams(**kwargs)


def final_only(params: Any) -> Any:
    """``params`` set to report a request once, when it finishes (``RequestOutputKind.FINAL_ONLY``, what
    ``LLM.generate`` sets on the requests it adds); returns ``params``."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


def add_request(llm: Any, request_id: str, prompt: Mapping[str, Any], params: Any) -> None:
    """Queue one request in an offline ``LLM``'s in-process engine without running it (the call ``LLM.generate``
    makes per prompt).  Raises what vLLM raises for a request it refuses (``ValueError``, ``TypeError``: e.g. a
    prompt longer than the context); the engine and its other requests are untouched then.  Releases whose
    ``LLM.generate`` renders prompts first (0.34 among them) render a plain ``{"prompt_token_ids": ...}`` here the
    same way and log once that raw prompts are deprecated; a release that drops them needs an era module's own
    rendering."""
    llm.llm_engine.add_request(request_id, prompt, params)


def step(llm: Any) -> list[Any]:
    """One step of an offline ``LLM``'s in-process engine: the ``RequestOutput`` of each request it finished."""
    return [out for out in llm.llm_engine.step() if getattr(out, "finished", False)]


def has_unfinished(llm: Any) -> bool:
    """Whether an offline ``LLM``'s engine holds requests not finished yet."""
    return bool(llm.llm_engine.has_unfinished_requests())


def plain_llm(args: Mapping[str, Any]) -> Any:
    """``vllm.LLM(**args)``: an engine without the capture connector (``evaluate --backend vllm``: vLLM's own
    speculative decoding, with its statistics on)."""
    from vllm import LLM

    return LLM(**{"disable_log_stats": False, **args})


#: vLLM's speculative-decoding counters (Prometheus names of the v1 engine; read on 0.29.0 and 0.32.0), summed
#: over their labels.
SPEC_DECODE_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}
SPEC_DECODE_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_decode_counts(llm: Any) -> dict[str, Any]:
    """vLLM's own speculative-decoding counters now (``LLM.get_metrics()``): ``drafts``, ``draft_tokens``,
    ``accepted`` and ``accepted_per_pos`` (a list; empty when the release does not report it).  The counters are
    the process's: callers take the difference of two readings around their requests."""
    out: dict[str, Any] = {key: 0 for key in SPEC_DECODE_COUNTERS}
    per_pos: list[int] = []
    names = {v: k for k, v in SPEC_DECODE_COUNTERS.items()}
    for m in llm.get_metrics():
        name = str(getattr(m, "name", ""))
        if name in names:
            out[names[name]] += int(getattr(m, "value", 0))
        elif name == SPEC_DECODE_PER_POSITION:
            vals = [int(v) for v in getattr(m, "values", [])]
            per_pos += [0] * (len(vals) - len(per_pos))
            for i, v in enumerate(vals):
                per_pos[i] += v
    out["accepted_per_pos"] = per_pos
    return out
