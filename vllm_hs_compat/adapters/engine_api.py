"""vLLM's offline engine entry points, for the tools that run an engine (``demo``, ``verify``).

The faces never spell a vLLM module path; they build engines and sampling parameters through these functions.
``LLM``, ``SamplingParams`` and ``KVTransferConfig`` sit where they are on every supported release (0.17-0.34), so
no era module needs to own a delta here.  vLLM is imported on the first call, never at import.
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
