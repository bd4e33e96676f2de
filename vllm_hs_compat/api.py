"""Public API for connector authors.

Call these from your own ``KVConnectorBase_V1`` subclass; every version question goes to the adapter
chosen for the installed vLLM, so your connector carries no version branches::

    from vllm_hs_compat import api

    # worker role, in register_kv_caches(kv_caches):
    group = api.resolve_capture_group(self._kv_cache_config, view="worker")
    view = api.describe_capture_view(kv_caches[group.layer_name], group, num_planes=P)
    # per request, with the capture group's block ids from the scheduler:
    rows = api.read_request(kv_caches[group.layer_name], view, req_id, block_ids[group.index], num_tokens)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from vllm_hs_compat.core.groups import CaptureGroup, check_views_agree
from vllm_hs_compat.core.groups import resolve_capture_group as _resolve
from vllm_hs_compat.core.labels import PlaneLabels
from vllm_hs_compat.core.labels import plane_labels as _plane_labels
from vllm_hs_compat.core.layout import CaptureView, gather_rows
from vllm_hs_compat.core.layout import describe_capture_view as _describe
from vllm_hs_compat.core.slots import request_slots
from vllm_hs_compat.core.transfer import PendingRows, ReadOptions, read_request_async
from vllm_hs_compat.core.transfer import copy_requests_async as _copy_many
from vllm_hs_compat.errors import CaptureGroupError, SlotError

if TYPE_CHECKING:
    from vllm_hs_compat.adapters import VllmAdapter

__all__ = [
    "capture_layer_name",
    "check_views_agree",
    "copy_request_async",
    "copy_requests_async",
    "describe_capture_view",
    "gather_rows",
    "get_adapter",
    "kv_cache_layout",
    "plane_labels",
    "read_request",
    "request_slots",
    "resolve_capture_group",
]


def get_adapter() -> VllmAdapter:
    """The probed adapter for the installed vLLM (computed once per process; the adapters, and with them
    ``packaging``, are imported on this first call, not with this module)."""
    from vllm_hs_compat.adapters import get_adapter as _get

    return _get()


def _adapter(adapter: VllmAdapter | None) -> VllmAdapter:
    return adapter if adapter is not None else get_adapter()


def capture_layer_name(
    kv_cache_config: Any, vllm_config: Any | None = None, *, adapter: VllmAdapter | None = None
) -> str:
    """The capture layer's name: the one ``cache_only_layers.<n>`` layer in the KV-cache groups.

    With ``vllm_config`` the name is also derived from the verifier's ``num_hidden_layers`` and the two
    must agree.
    """
    ad = _adapter(adapter)
    names = ad.capture_layer_names(kv_cache_config)
    expected = ad.capture_layer_name(vllm_config) if vllm_config is not None and ad.has_model(vllm_config) else None
    if len(names) == 1 and expected in (None, names[0]):
        return names[0]
    if not names and expected is None:
        from vllm_hs_compat.adapters import CAPTURE_LAYER_PREFIX

        raise CaptureGroupError(
            f"no '{CAPTURE_LAYER_PREFIX}<n>' layer in the KV-cache groups; start vLLM with the "
            "extract_hidden_states speculative method"
        )
    raise CaptureGroupError(
        f"capture layers found in the KV-cache groups: {names}; expected exactly one"
        + (f" named {expected!r} (from the verifier's num_hidden_layers)" if expected else "")
    )


def resolve_capture_group(
    kv_cache_config: Any,
    *,
    view: Literal["worker", "scheduler"],
    layer_name: str | None = None,
    vllm_config: Any | None = None,
    adapter: VllmAdapter | None = None,
) -> CaptureGroup:
    """The KV-cache group that holds the capture layer, from the worker's or the scheduler's config.

    On the worker (``view="worker"`` with ``vllm_config``) this also makes a release whose CPU attention would read
    the verifier's KV cache in another layout than it wrote it choose one (:meth:`VllmAdapter.align_cpu_attention_isa`:
    vLLM 0.26-0.28 on CPU when the capture layer's group lowers the engine's block size, logged as a warning)."""
    ad = _adapter(adapter)
    name = layer_name or capture_layer_name(kv_cache_config, vllm_config, adapter=ad)
    infos = ad.group_infos(kv_cache_config)
    group = _resolve(infos, name, capture_spec_types=ad.capture_spec_types, view=view)
    ad.check_capture_group(group.index)
    if view == "worker" and vllm_config is not None:
        ad.align_cpu_attention_isa(vllm_config)
    return group


def describe_capture_view(
    tensor: torch.Tensor,
    group: CaptureGroup,
    *,
    num_planes: int,
    hidden_size: int | None = None,
    adapter: VllmAdapter | None = None,
) -> CaptureView:
    """Check the registered capture tensor against the adapter's declared axis order."""
    return _describe(
        tensor,
        num_planes=num_planes,
        group_block_size=group.block_size,
        order=_adapter(adapter).view_order,
        hidden_size=hidden_size,
    )


def read_request(
    tensor: torch.Tensor,
    view: CaptureView,
    req_id: str,
    block_ids: Sequence[int],
    num_tokens: int,
    *,
    start: int = 0,
) -> torch.Tensor:
    """The request's rows ``[num_tokens, P, C]`` (a new tensor on ``tensor``'s device)."""
    slots = request_slots(req_id, block_ids, view, num_tokens=num_tokens, start=start, device=tensor.device)
    return gather_rows(tensor, view, slots)


def copy_request_async(
    tensor: torch.Tensor,
    view: CaptureView,
    req_id: str,
    block_ids: Sequence[int],
    num_tokens: int,
    *,
    start: int = 0,
    out: torch.Tensor | None = None,
    options: ReadOptions | None = None,
) -> PendingRows:
    """Copy the request's rows to host (pinned where CUDA exists) on a side stream ordered after the
    compute stream; call on the compute stream once the rows are written (``wait_for_save``) and keep the
    request's blocks until ``PendingRows.done()``.  Synchronous on CPU.

    On CUDA the row table is kept per capture tensor and the request's blocks are gathered whole: one index upload
    from a pooled pinned buffer and one ``index_select`` (``options.lone_reads`` False, or
    ``VLLM_HS_COMPAT_LONE_READ=0`` when the tensor is first read without options: the per-token path).  A step's
    finished requests read together through :func:`copy_requests_async` cost the host less each."""
    return read_request_async(tensor, view, req_id, block_ids, num_tokens, start=start, out=out, options=options)


def copy_requests_async(
    tensor: torch.Tensor, view: CaptureView, requests: Sequence[tuple[str, Sequence[int], int, int]]
) -> list[PendingRows | SlotError]:
    """:func:`copy_request_async` for many ``(req_id, block_ids, start, num_tokens)`` at once (a step's finished
    requests): one index upload and one gather for all of them, each result a view of one pinned host tensor, or
    the :class:`~vllm_hs_compat.errors.SlotError` that request's block ids raised."""
    return _copy_many(tensor, view, requests)


def plane_labels(vllm_config: Any, *, adapter: VllmAdapter | None = None) -> PlaneLabels:
    """Which verifier layer id each plane holds (ascending), validated for the installed release."""
    ad = _adapter(adapter)
    n = ad.num_hidden_layers(vllm_config)
    lo, hi = ad.layer_id_bounds(n)
    return _plane_labels(ad.configured_layer_ids(vllm_config), num_hidden_layers=n, min_id=lo, max_id=hi)


def kv_cache_layout(vllm_config: Any, kv_cache_config: Any, *, adapter: VllmAdapter | None = None) -> str | None:
    """The resolved KV-cache layout name (0.29.0+), None where the view shape is the layout."""
    return _adapter(adapter).kv_cache_layout(vllm_config, kv_cache_config)
