"""vLLM's offline engine entry points, for the tools that run an engine (``demo``, ``verify``).

The faces never spell a vLLM module path; they build engines and sampling parameters through these functions.
``LLM``, ``SamplingParams`` and ``KVTransferConfig`` sit where they are on every supported release (0.17-0.33), so
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
