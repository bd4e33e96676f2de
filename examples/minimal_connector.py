"""A complete hidden-state capture connector in one file, built on vllm-hs-compat's public API.

This is what a connector author writes when they want their own KV connector (their own storage, their own
request bookkeeping) but not their own version handling.  Every release-dependent answer comes from the
package: which KV-cache group holds the capture layer and its block size (``api.resolve_capture_group``), the
capture view's axis order (``api.describe_capture_view``), which cache rows belong to a request
(``api.read_request``, by the request's own block ids), the planes' layer ids (``api.plane_labels``), the
connector base classes and per-release hook shims (``adapter.connector_bases()``), and the neutral reading of
vLLM's ``Request`` (``adapter.read_finished``).

What it does: at ``request_finished`` the scheduler keeps the request's blocks (returns True) and sends the
request's capture-group block ids to the worker in the next step's metadata; the worker reads the prompt's rows
``[tokens, planes, hidden]`` in ``get_finished`` (a hook vLLM calls in every step, forward or not, on every
release and both model runners), writes ``<path>/<request id>.safetensors`` (``hidden_states``, ``token_ids``)
and reports the request finished so vLLM frees its blocks.

Load it (this file's directory on ``PYTHONPATH``)::

    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29, 32]}}}'
    --kv-transfer-config '{"kv_connector": "MinimalCaptureConnector", "kv_connector_module_path":
        "minimal_connector", "kv_role": "kv_producer", "kv_connector_extra_config": {"path": "/data/hs"}}'

Deliberately left out (``vllm_hs_compat.connector.HiddenStatesCaptureConnector`` has them): reads overlapped
with the next forward on a side stream, an export to trainers, capture modes and windows, slot checks against
vLLM's slot mapping, a per-request failure instead of an exception.  The read here runs on the current stream
in ``get_finished`` and waits for it: correct on GPUs (the stream that wrote the rows), but it stalls the step.
It is tested on real engines (``tests/e2e``): each file equals a transformers forward of the same weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vllm_hs_compat import api

ADAPTER = api.get_adapter()  # the installed release's adapter, confirmed by its probes
_Bases: Any = type("_MinimalBases", ADAPTER.connector_bases(), {})
_MetadataBase: Any = ADAPTER.metadata_base()


class MinimalMetadata(_MetadataBase):  # type: ignore[misc]
    """Scheduler -> worker, every step: the step's number and the requests to read, as
    ``(request id, block ids, token ids)``."""

    def __init__(self, step: int, reads: list[tuple[str, list[int], list[int]]]) -> None:
        self.step = step
        self.reads = reads


class MinimalCaptureConnector(_Bases):  # type: ignore[misc]
    """Writes each finished request's prompt hidden states to ``<path>/<request id>.safetensors``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._path = Path(ADAPTER.connector_extra_config(vllm_config).get("path", "hs_records"))
        self._labels = api.plane_labels(vllm_config)
        self._is_scheduler = str(getattr(role, "name", role)) == "SCHEDULER"
        view = "scheduler" if self._is_scheduler else "worker"
        self._group = api.resolve_capture_group(kv_cache_config, view=view, vllm_config=vllm_config)
        self._pending: list[tuple[str, list[int], list[int]]] = []  # scheduler: reads for the next step
        self._held = 0  # scheduler: requests whose blocks vLLM keeps for us
        self._step = 0  # scheduler: metadata sent; worker: the last metadata read
        ranks = ADAPTER.parallel_ranks(vllm_config)
        self._cache: Any = None  # worker: the capture layer's view
        self._view: Any = None
        self._owner = False
        self._ranks = ranks

    # --- scheduler side -----------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # nothing is loaded from outside

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> MinimalMetadata:
        self._step += 1
        meta, self._pending = MinimalMetadata(self._step, self._pending), []
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a request whose prompt was computed; say in its params where the file will be."""
        req = ADAPTER.read_finished(request)
        n = min(req.num_valid, req.num_prompt_tokens)  # positions whose hidden states exist, prompt only
        if req.aborted or n == 0:
            return False, None
        # With the hybrid KV-cache manager (0.22+) vLLM passes one block list per group.
        ids = list(block_ids[self._group.index] if isinstance(block_ids, tuple) else block_ids)
        self._pending.append((req.req_id, ids, list(req.token_ids[:n])))
        self._held += 1
        return True, {"hidden_states_path": str(self._path / f"{req.req_id}.safetensors")}

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> Any:
        return self.request_finished(request, block_ids)  # SupportsHMA (0.22+)

    def update_connector_output(self, connector_output: Any) -> None:
        self._held -= len(getattr(connector_output, "finished_sending", None) or ())

    def has_pending_block_frees(self) -> bool:
        return self._held > 0  # 0.30+: vLLM waits for our frees instead of preempting

    # --- worker side --------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        cache = kv_caches.get(self._group.layer_name)
        self._owner = ADAPTER.capture_owner(self._ranks, cache is not None)  # one writer: TP rank 0
        if cache is not None:
            self._cache = cache
            self._view = api.describe_capture_view(cache, self._group, num_planes=self._labels.num_planes)
        if self._owner:
            self._path.mkdir(parents=True, exist_ok=True)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Every step: read the requests the scheduler sent, report each one once (every rank reports)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, MinimalMetadata) or meta.step <= self._step:
            return None, None  # some releases hand one step's metadata to more than one call: report once
        self._step = meta.step
        done: set[str] = set()
        for req_id, block_ids, token_ids in meta.reads:
            if self._owner:
                rows = api.read_request(self._cache, self._view, req_id, block_ids, len(token_ids))
                tmp = self._path / f".{req_id}.{os.getpid()}.tmp"
                save_file(
                    {"hidden_states": rows.cpu().contiguous(), "token_ids": torch.tensor(token_ids)},
                    str(tmp),
                    metadata={"layer_ids": ",".join(map(str, self._labels.layer_ids)), "pre_norm": "true"},
                )
                tmp.replace(self._path / f"{req_id}.safetensors")  # complete files only
            done.add(req_id)
        return (done or None), None
