"""``HiddenStatesCaptureConnector``: the ``KVConnectorBase_V1`` vLLM loads (``kv_connector_module_path =
"vllm_hs_compat.connector"``).  Importing this module imports vLLM: the adapter for the installed release
supplies the base classes (its era's shims, ``KVConnectorBase_V1`` and, from 0.22, ``SupportsHMA``).

The class only routes vLLM's hooks: the scheduler role to :class:`CaptureScheduler`, the worker role to
:class:`CaptureWorker` (the split of vLLM's own NixlConnector).  See docs/connector.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm_hs_compat.adapters import get_adapter, installed_vllm_version
from vllm_hs_compat.core.capture import StepPlan
from vllm_hs_compat.errors import CaptureConfigError

from .config import ConnectorConfig
from .scheduler import CaptureScheduler
from .worker import CaptureWorker

if TYPE_CHECKING:
    from vllm_hs_compat.adapters.vllm_types import KVCacheConfig, Request, SchedulerOutput, VllmConfig

_ADAPTER = get_adapter()
# The era's shims, KVConnectorBase_V1 and (0.22+) SupportsHMA; vLLM's types are opaque to mypy here.
_Bases: Any = type("_HiddenStatesCaptureBases", _ADAPTER.connector_bases(), {})
_MetadataBase: Any = _ADAPTER.metadata_base()
_HandshakeBase: Any = _ADAPTER.handshake_base()

log = logging.getLogger("vllm.vllm_hs_compat.connector")

__all__ = ["CaptureHandshake", "CaptureMetadata", "HiddenStatesCaptureConnector"]


class CaptureMetadata(_MetadataBase):  # type: ignore[misc]
    """Scheduler -> worker, once per step: the saves to read and the slot checks to run."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class CaptureHandshake(_HandshakeBase):  # type: ignore[misc]
    """Capture owner -> scheduler, once at start-up: the sink locator and the worker's capture group."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info


def _role_name(role: object) -> str:
    return str(getattr(role, "name", role))


class HiddenStatesCaptureConnector(_Bases):  # type: ignore[misc]
    """Captures each finished request's hidden states from vLLM's ``extract_hidden_states`` cache and hands
    the record to a sink (export, file or callback).  One class for every supported vLLM release."""

    def __init__(self, vllm_config: VllmConfig, role: Any, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        adapter = get_adapter()
        self._hs_config = ConnectorConfig.from_extra(adapter.connector_extra_config(vllm_config))
        self._hs_scheduler: CaptureScheduler | None = None
        self._hs_worker: CaptureWorker | None = None
        name = _role_name(role)
        if name == "SCHEDULER":
            self._hs_scheduler = CaptureScheduler.from_vllm(adapter, vllm_config, kv_cache_config, self._hs_config)
        elif name == "WORKER":
            self._hs_worker = CaptureWorker.from_vllm(
                adapter, vllm_config, kv_cache_config, self._hs_config, vllm_version=installed_vllm_version()
            )
        else:
            raise CaptureConfigError(f"unknown connector role {role!r}; expected SCHEDULER or WORKER")

    # --- helpers ----------------------------------------------------------------------------------------
    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, CaptureMetadata) else None

    def _sched(self) -> CaptureScheduler:
        if self._hs_scheduler is None:
            raise CaptureConfigError("a scheduler hook was called on the worker-role connector")
        return self._hs_scheduler

    def _work(self) -> CaptureWorker:
        if self._hs_worker is None:
            raise CaptureConfigError("a worker hook was called on the scheduler-role connector")
        return self._hs_worker

    # ======================================================================================================
    # scheduler side
    # ======================================================================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Nothing is loaded from outside: the capture connector only saves."""
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        """Nothing to do: block ids are read from the scheduler output and at finish."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CaptureMetadata:
        return CaptureMetadata(self._sched().build_plan(scheduler_output))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Without HMA (vLLM's only group holds the capture layer): hold the blocks if a record will be made."""
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """With HMA (0.22+): the capture group's ids are picked by the group that holds the capture layer."""
        return self._sched().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().on_finished_sending(set(getattr(connector_output, "finished_sending", None) or ()))

    def has_pending_block_frees(self) -> bool:
        """0.30+: held requests free their blocks within a step or two, so vLLM waits instead of preempting."""
        return self._sched().held > 0

    def set_xfer_handshake_metadata(self, metadata: Mapping[Any, Any]) -> None:
        self.capture_on_handshake(dict(metadata))

    def capture_on_handshake(self, metadata: dict[Any, Any]) -> None:
        """The workers' handshake metadata (every release's form, through the era's shims)."""
        infos = [m.info for m in metadata.values() if isinstance(m, CaptureHandshake)]
        self._sched().on_handshake(infos)

    def get_finished_count(self) -> int | None:
        """None (wait for every worker): every rank reports each held request once (non-owners at once), so
        the blocks are freed exactly when the owner has read them, whatever the TP/PP layout."""
        return None

    # ======================================================================================================
    # worker side
    # ======================================================================================================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> CaptureHandshake | None:
        info = self._work().handshake_info()
        return CaptureHandshake(info) if info is not None else None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Every step, before the forward: issue the reads of requests that finished earlier (their rows were
        written in earlier steps; the copy overlaps this step's forward)."""
        super().bind_connector_metadata(connector_metadata)
        if self._hs_worker is not None:
            self._hs_worker.on_step(self._plan())

    def capture_on_preemptions(self) -> None:
        """Nothing to do: held blocks belong to finished requests, which vLLM never preempts."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing is loaded."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing is loaded."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Called after each layer's cache write; for the capture layer, mark the write and run slot checks."""
        self._work().on_capture_written(layer_name, attn_metadata, self._plan())

    def wait_for_save(self) -> None:
        """Nothing to wait for: reads happen from held blocks of finished requests."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Called in every step on every release and runner (no-forward steps included): report held requests
        whose rows are read.  Issues this step's reads first if ``bind_connector_metadata`` did not."""
        worker = self._work()
        worker.on_step(self._plan())
        done = worker.finished()
        return (done or None), None

    def shutdown(self) -> None:
        if self._hs_worker is not None:
            self._hs_worker.shutdown()
        if self._hs_scheduler is not None:
            self._hs_scheduler.shutdown()
