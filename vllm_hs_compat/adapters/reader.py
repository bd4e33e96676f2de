"""The one place that reads vLLM's objects: configs, KV-cache groups, scheduler output, requests, parallel state.

Everything the connector and :mod:`vllm_hs_compat.api` know about a vLLM object comes through a method here,
returned as a neutral core type.  An era that reads an object differently overrides the method in its module.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from vllm_hs_compat.core.capture import FinishedRequest, ScheduledCached, ScheduledNew, StepInfo
from vllm_hs_compat.core.groups import GroupInfo
from vllm_hs_compat.errors import CaptureConfigError, CaptureGroupError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, UniformTypeKVCacheSpecs
    from vllm.v1.request import Request

CAPTURE_LAYER_PREFIX = "cache_only_layers."


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in vLLM's parallel layout."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    def describe(self) -> str:
        return f"tp {self.tp_rank}/{self.tp_size} pp {self.pp_rank}/{self.pp_size} dp {self.dp_rank}/{self.dp_size}"


def _kv_iface() -> Any:
    return importlib.import_module("vllm.v1.kv_cache_interface")


def _ids(blocks: Iterable[Iterable[int]] | None) -> tuple[tuple[int, ...], ...] | None:
    if blocks is None:
        return None
    return tuple(tuple(int(b) for b in group) for group in blocks)


def _token_ids(tokens: Any) -> tuple[int, ...]:
    """A request's token ids as a tuple of ints.  Sliced whole first: vLLM's ``ConstantList`` hands the slice to the
    container it wraps, a ``list`` (0.17-0.33) or, from 0.34, a ``TokenBuffer`` (``array('i')``) whose slice is one
    block copy and ``tolist()`` -- 2.5 ms instead of 16.5 ms per token on a 131,072-token request (0.34.0,
    measured).  Anything else is read token by token."""
    ids = tokens[:]
    return tuple(ids) if type(ids) is list else tuple(int(t) for t in ids)


def _float_or_none(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


class VllmReader:
    """Reads vLLM objects into core types.  Mixed into every adapter."""

    capture_spec_types: ClassVar[frozenset[str]]

    # --- KV-cache config -----------------------------------------------------------------------------------
    def _spec_name(self, spec: object) -> str:
        """Class name of a spec; a vendor subclass of a capture spec reports the capture spec's name."""
        for klass in type(spec).__mro__:
            if klass.__name__ in self.capture_spec_types:
                return klass.__name__
        return type(spec).__name__

    def group_infos(self, kv_cache_config: KVCacheConfig) -> list[GroupInfo]:
        """Describe ``kv_cache_config.kv_cache_groups`` as neutral :class:`GroupInfo` records."""
        uniform = _kv_iface().UniformTypeKVCacheSpecs
        infos = []
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            merged = isinstance(spec, uniform)
            specs = cast("UniformTypeKVCacheSpecs", spec).kv_cache_specs if merged else {}
            per_layer = {name: self._spec_name(s) for name, s in specs.items()}
            infos.append(
                GroupInfo(
                    index=index,
                    layer_names=tuple(group.layer_names),
                    spec_type=type(spec).__name__ if merged else self._spec_name(spec),
                    block_size=int(spec.block_size),
                    merged=merged,
                    layer_spec_types=per_layer,
                    page_size_padded=getattr(spec, "page_size_padded", None),
                )
            )
        return infos

    def capture_layer_names(self, kv_cache_config: KVCacheConfig | None) -> list[str]:
        """Every ``cache_only_layers.<n>`` layer the KV-cache groups hold, sorted."""
        if kv_cache_config is None:
            raise CaptureGroupError(
                "no kv_cache_config was given: vLLM passes it to the connector's constructor (required from "
                "0.21.0, optional before); declare __init__(self, vllm_config, role, kv_cache_config) and pass it on"
            )
        return sorted(
            {
                str(n)
                for g in kv_cache_config.kv_cache_groups
                for n in g.layer_names
                if str(n).startswith(CAPTURE_LAYER_PREFIX)
            }
        )

    def num_blocks(self, kv_cache_config: KVCacheConfig) -> int:
        return int(kv_cache_config.num_blocks)

    def kv_cache_layout(self, vllm_config: VllmConfig | None, kv_cache_config: KVCacheConfig | None) -> str | None:
        """Name of the resolved KV-cache layout (0.29.0+); None before 0.29 (the layout is the shape)."""
        if not getattr(self, "kv_cache_layout_module", False):
            return None
        name = getattr(kv_cache_config, "kv_cache_layout", None)
        if name is None and vllm_config is not None:
            name = getattr(vllm_config.cache_config, "kv_cache_layout", None)
        return None if name is None else str(getattr(name, "name", name))

    # --- model and speculative config ----------------------------------------------------------------------
    def has_model(self, vllm_config: VllmConfig | None) -> bool:
        return vllm_config is not None and getattr(vllm_config, "model_config", None) is not None

    def num_hidden_layers(self, vllm_config: VllmConfig) -> int:
        return int(vllm_config.model_config.hf_text_config.num_hidden_layers)

    def hidden_size(self, vllm_config: VllmConfig) -> int:
        return int(vllm_config.model_config.hf_text_config.hidden_size)

    def model_dtype(self, vllm_config: VllmConfig) -> torch.dtype:
        dtype = vllm_config.model_config.dtype
        return dtype if isinstance(dtype, torch.dtype) else torch.bfloat16

    def capture_layer_name(self, vllm_config: VllmConfig) -> str:
        """``cache_only_layers.<num_hidden_layers of the verifier>`` (0.17+)."""
        return f"{CAPTURE_LAYER_PREFIX}{self.num_hidden_layers(vllm_config)}"

    def configured_layer_ids(self, vllm_config: VllmConfig) -> list[int]:
        spec = vllm_config.speculative_config
        if spec is None or getattr(spec, "method", None) != "extract_hidden_states":
            raise CaptureGroupError(
                "speculative_config.method is not 'extract_hidden_states'; start vLLM with "
                '--speculative-config \'{"method": "extract_hidden_states", "num_speculative_tokens": 1, '
                '"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}\''
            )
        hf = spec.draft_model_config.hf_config
        return [int(i) for i in getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or []]

    def connector_extra_config(self, vllm_config: VllmConfig) -> dict[str, Any]:
        ktc = vllm_config.kv_transfer_config
        extra = getattr(ktc, "kv_connector_extra_config", None) or {}
        if not isinstance(extra, Mapping):
            raise CaptureConfigError(f"kv_connector_extra_config must be a map, found {type(extra).__name__}")
        return dict(extra)

    def cuda_graph_padding(self, vllm_config: VllmConfig) -> bool:
        """Whether the runner may pad a step's tokens (CUDA graphs on a CUDA device)."""
        if bool(getattr(vllm_config.model_config, "enforce_eager", False)):
            return False
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda")
        return str(device) == "cuda"

    def async_scheduling(self, vllm_config: VllmConfig) -> bool:
        """Whether the engine schedules a step before it has processed the previous one's output
        (``scheduler_config.async_scheduling``; vLLM turns it on by itself on CUDA where it can, extraction of
        hidden states included, and always off on CPU).  Then a request's ``num_computed_tokens`` in a
        ``SchedulerOutput`` counts its last step's draft tokens as accepted, and the GPU worker moves it back by the
        ones rejected before it writes (``GPUModelRunner._update_states``' deferred correction): the scheduler
        cannot know where such a step writes."""
        return bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))

    # --- parallel state -------------------------------------------------------------------------------------
    def parallel_ranks(self, vllm_config: VllmConfig | None) -> Ranks:
        """This process's TP/PP rank (0 when vLLM's parallel state is not initialised: a single process)."""
        pc = getattr(vllm_config, "parallel_config", None)
        dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
        dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
        tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        ps = importlib.import_module("vllm.distributed.parallel_state")
        if not ps.model_parallel_is_initialized():
            return Ranks(0, tp_size, 0, pp_size, dp_rank, dp_size)
        tp, pp = ps.get_tp_group(), ps.get_pp_group()
        return Ranks(
            int(tp.rank_in_group), int(tp.world_size), int(pp.rank_in_group), int(pp.world_size), dp_rank, dp_size
        )

    # --- scheduler side -------------------------------------------------------------------------------------
    def read_step(self, scheduler_output: SchedulerOutput) -> StepInfo:
        """One ``SchedulerOutput`` as a :class:`StepInfo`.  0.17-0.33 name the requests resumed after preemption in
        ``CachedRequestData.resumed_req_ids``; 0.34 has no such field and sends them again as new requests (the
        adapter's ``resumed_field``), so an absent field means none resumed among the cached ones."""
        new = tuple(
            ScheduledNew(str(r.req_id), _ids(r.block_ids) or (), int(r.num_computed_tokens))
            for r in scheduler_output.scheduled_new_reqs
        )
        c = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(c, "resumed_req_ids", ()) or ())
        cached = tuple(
            ScheduledCached(str(rid), _ids(blocks), rid in resumed, int(n))
            for rid, blocks, n in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, strict=True)
        )
        return StepInfo(
            new=new,
            cached=cached,
            num_scheduled_tokens={str(k): int(v) for k, v in scheduler_output.num_scheduled_tokens.items()},
            preempted=frozenset(str(r) for r in (getattr(scheduler_output, "preempted_req_ids", None) or ())),
            finished=frozenset(str(r) for r in scheduler_output.finished_req_ids),
            spec_tokens={str(k): len(v) for k, v in (scheduler_output.scheduled_spec_decode_tokens or {}).items() if v},
        )

    def read_finished(self, request: Request) -> FinishedRequest:
        """A request handed to ``request_finished``."""
        status = request.status
        name = str(getattr(status, "name", status))
        params = getattr(request, "kv_transfer_params", None)
        return FinishedRequest(
            req_id=str(request.request_id),
            num_computed_tokens=int(request.num_computed_tokens),
            num_prompt_tokens=int(request.num_prompt_tokens),
            token_ids=_token_ids(request.all_token_ids),
            aborted=name in ("FINISHED_ABORTED", "FINISHED_ERROR"),
            status=name,
            params=params if isinstance(params, Mapping) else None,
            arrival_time=_float_or_none(getattr(request, "arrival_time", None)),
            # vLLM's own count of a request's tokens of steps in flight (its async scheduler commits prefix-cache
            # blocks only up to num_computed_tokens minus these); 0 where nothing is scheduled ahead
            num_output_placeholders=int(getattr(request, "num_output_placeholders", 0) or 0),
        )

    def parallel_sampling_child(self, req_id: str) -> tuple[str, int] | None:
        """``(parent request id, choice index)`` when ``req_id`` names a child of an ``n > 1`` request, else None.

        vLLM runs such a request as ``n`` children named ``f"{index}_{parent}"`` (``ParentRequest.get_child_info``
        in ``vllm/v1/engine/parallel_sampling.py``, every supported release), each with ``n=1``, and answers with
        the ``kv_transfer_params`` of the child that finished last (``RequestState.make_request_output``)."""
        head, sep, parent = req_id.partition("_")
        if not sep or not parent or not (head.isascii() and head.isdigit()) or (len(head) > 1 and head[0] == "0"):
            return None
        return parent, int(head)

    def step_engine(self, llm: Any) -> None:
        """One step of an offline ``LLM``'s in-process engine."""
        llm.llm_engine.step()

    # --- worker side ----------------------------------------------------------------------------------------
    def layer_slot_mapping(self, layer_name: str, attn_metadata: Any) -> torch.Tensor | None:
        """The slot mapping vLLM wrote ``layer_name`` with in this step (the forward context's per-layer dict,
        0.17+), or None where the runner does not expose it."""
        fc_mod = importlib.import_module("vllm.forward_context")
        try:
            ctx = fc_mod.get_forward_context()
        except (AssertionError, RuntimeError):
            ctx = None
        mapping = getattr(ctx, "slot_mapping", None)
        if isinstance(mapping, Mapping):
            got = mapping.get(layer_name)
            if isinstance(got, torch.Tensor):
                return got
        meta = attn_metadata.get(layer_name) if isinstance(attn_metadata, Mapping) else attn_metadata
        got = getattr(meta, "slot_mapping", None)
        return got if isinstance(got, torch.Tensor) else None
