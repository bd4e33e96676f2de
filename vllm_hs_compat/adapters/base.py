"""Shared machinery of the version adapters.

An adapter answers every version question by name (``adapter.view_order``,
``adapter.handle_preemptions_takes_metadata`` ...).  Each era module (``v0_17``, ``v0_22``, ``v0_29``)
declares the facts of its releases; a fact that changed *inside* an era is a :func:`since` delta that
names the release that introduced it.  Every adapter is confirmed by feature probes before use.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_hs_compat.adapters.reader import CAPTURE_LAYER_PREFIX, Ranks, VllmReader
from vllm_hs_compat.adapters.shims import Shim, ShimTargets
from vllm_hs_compat.core.layout import ViewOrder
from vllm_hs_compat.errors import CaptureGroupError

__all__ = [
    "CAPTURE_LAYER_PREFIX",
    "PROBES",
    "KvCacheMargin",
    "Probe",
    "ProbeResult",
    "Ranks",
    "VllmAdapter",
    "ensure_platform",
]


@dataclass(frozen=True)
class ProbeResult:
    """One probe's answer next to the value the adapter declares."""

    name: str
    question: str
    expected: object
    observed: object

    @property
    def ok(self) -> bool:
        return self.expected == self.observed


@dataclass(frozen=True)
class KvCacheMargin:
    """What vLLM keeps free beside a KV cache it commits after warm-up from the memory it measured free (the
    extensible KV cache): ``fraction`` of the measured transient peak, at least ``floor_bytes``, of which
    ``non_torch_bytes`` are held back from torch's allocator for kernel scratch and communication buffers."""

    fraction: float
    floor_bytes: int
    non_torch_bytes: int


@dataclass(frozen=True)
class Probe:
    """A feature probe: ``observe()`` must equal the adapter attribute named ``name`` (its expected value)."""

    name: str
    question: str
    observe: Callable[[], object]


def ensure_platform() -> None:
    """Select vLLM's CPU platform when no platform resolves (no accelerator; vLLM < 0.28 ignores
    ``VLLM_TARGET_DEVICE``).  Used by the doctor, which only reads vLLM's modules."""
    platforms: Any = importlib.import_module("vllm.platforms")
    if platforms.current_platform.is_unspecified():
        cpu = importlib.import_module("vllm.platforms.cpu")
        platforms._current_platform = cpu.CpuPlatform()


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _kv_iface() -> Any:
    return importlib.import_module("vllm.v1.kv_cache_interface")


def _connector_base() -> Any:
    mod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    return mod.KVConnectorBase_V1


def _groups_module() -> str:
    # 0.33.0 moved get_kv_cache_groups from vllm.v1.core.kv_cache_utils to kv_cache_planning.
    if _module_exists("vllm.v1.core.kv_cache_planning"):
        mod = importlib.import_module("vllm.v1.core.kv_cache_planning")
        if hasattr(mod, "get_kv_cache_groups"):
            return "vllm.v1.core.kv_cache_planning"
    return "vllm.v1.core.kv_cache_utils"


def _backend_has_shape() -> bool:
    mod = importlib.import_module("vllm.v1.attention.backend")
    return hasattr(mod.AttentionBackend, "get_kv_cache_shape")


def _ctor_requires_kv_cache_config() -> bool:
    param = inspect.signature(_connector_base().__init__).parameters.get("kv_cache_config")
    if param is None:
        return False
    return param.default is inspect.Parameter.empty


def _resumed_field() -> str:
    import dataclasses

    mod = importlib.import_module("vllm.v1.core.sched.output")
    names = {f.name for f in dataclasses.fields(mod.CachedRequestData)}
    for candidate in ("resumed_req_ids", "resumed_from_preemption"):
        if candidate in names:
            return candidate
    return "absent"


def _handle_preemptions_arg() -> str:
    base = _connector_base()
    if not hasattr(base, "handle_preemptions"):
        return "absent"
    params = [p for p in inspect.signature(base.handle_preemptions).parameters if p != "self"]
    return params[0] if params else "none"


def _two_token_feedback() -> int:
    """Model Runner V1's ``ExtractHiddenStatesProposer.prepare_next_token_ids_padded`` called on the CPU for one
    request whose step emitted two valid tokens; returns the token count it reports for that row."""
    import numpy as np
    import torch

    proposer = importlib.import_module("vllm.v1.spec_decode.extract_hidden_states").ExtractHiddenStatesProposer
    method = proposer.prepare_next_token_ids_padded

    class _Buffer:  # the CpuGpuBuffer interface the method uses, both sides on the CPU
        def __init__(self, n: int) -> None:
            self.cpu = torch.zeros(n, dtype=torch.int32)
            self.np = self.cpu.numpy()
            self.gpu = torch.zeros(n, dtype=torch.int32)

        def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
            self.gpu.copy_(self.cpu)
            return self.gpu

    class _Owner:
        backup_next_token_ids = _Buffer(1)
        device = torch.device("cpu")

    class _Request:
        @staticmethod
        def get_token_id(index: int) -> int:
            return 7

    class _Batch:
        num_reqs = 1
        req_ids = ["r"]
        vocab_size = 100
        num_tokens_no_spec = np.array([3], dtype=np.int32)

    class _Metadata:
        seq_lens_cpu = torch.tensor([3], dtype=torch.int32)

    offered: dict[str, Any] = {
        "common_attn_metadata": _Metadata(),
        "sampled_token_ids": torch.tensor([[15, 18]], dtype=torch.int32),
        "requests": {"r": _Request()},
        "gpu_input_batch": _Batch(),
        "discard_request_mask": torch.zeros(1, dtype=torch.bool),
    }
    named = [p for p in inspect.signature(method).parameters.values() if p.name != "self"]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    unknown = [p.name for p in named if p.kind not in variadic and p.name not in offered and p.default is p.empty]
    if unknown:
        raise TypeError(f"prepare_next_token_ids_padded takes {unknown}, which this check does not know")
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in named):
        given = offered
    else:
        given = {p.name: offered[p.name] for p in named if p.name in offered}
    _, counts = method(_Owner(), **given)
    return int(counts[0])


PROBES: tuple[Probe, ...] = (
    Probe(
        "backend_get_kv_cache_shape",
        "does AttentionBackend.get_kv_cache_shape exist (view shape from the backend)?",
        _backend_has_shape,
    ),
    Probe(
        "kv_cache_layout_module",
        "does vllm.v1.kv_cache_layout exist (strided BLOCK_PLANE_TOKEN views)?",
        lambda: _module_exists("vllm.v1.kv_cache_layout"),
    ),
    Probe(
        "hidden_state_cache_spec",
        "does kv_cache_interface define HiddenStateCacheSpec?",
        lambda: hasattr(_kv_iface(), "HiddenStateCacheSpec"),
    ),
    Probe(
        "uniform_type_specs",
        "does kv_cache_interface define UniformTypeKVCacheSpecs (merged groups)?",
        lambda: hasattr(_kv_iface(), "UniformTypeKVCacheSpecs"),
    ),
    Probe("get_kv_cache_groups_module", "where does get_kv_cache_groups live?", _groups_module),
    Probe(
        "connector_ctor_requires_kv_cache_config",
        "is KVConnectorBase_V1.__init__'s kv_cache_config argument required?",
        _ctor_requires_kv_cache_config,
    ),
    Probe(
        "cross_layer_hooks",
        "does KVConnectorBase_V1 have register_cross_layers_kv_cache?",
        lambda: hasattr(_connector_base(), "register_cross_layers_kv_cache"),
    ),
    Probe(
        "handle_preemptions_arg",
        "what is the argument of KVConnectorBase_V1.handle_preemptions?",
        _handle_preemptions_arg,
    ),
    Probe(
        "get_transfer_results",
        "does KVConnectorBase_V1 have get_transfer_results?",
        lambda: hasattr(_connector_base(), "get_transfer_results"),
    ),
    Probe(
        "requires_kv_delivery",
        "does KVConnectorBase_V1 have the requires_kv_delivery property?",
        lambda: hasattr(_connector_base(), "requires_kv_delivery"),
    ),
    Probe(
        "handshake_pp_aware",
        "does KVConnectorBase_V1 have set_xfer_handshake_metadata_pp_aware?",
        lambda: hasattr(_connector_base(), "set_xfer_handshake_metadata_pp_aware"),
    ),
    Probe(
        "resumed_field",
        "which CachedRequestData field names the requests resumed after preemption?",
        _resumed_field,
    ),
    Probe(
        "v1_runner",
        "does Model Runner V1 exist (vllm.v1.worker.gpu_model_runner)?",
        lambda: _module_exists("vllm.v1.worker.gpu_model_runner"),
    ),
)


class VllmAdapter(VllmReader):
    """Answers for one era of vLLM releases.  Subclasses (one per era module) set the class attributes.

    Every fact a probe confirms is an attribute named like the probe; a fact that changed inside an era is a
    property naming the release that introduced it.
    """

    name: ClassVar[str]
    versions: ClassVar[SpecifierSet]
    view_order: ClassVar[ViewOrder]
    capture_spec_types: ClassVar[frozenset[str]]
    backend_get_kv_cache_shape: ClassVar[bool]
    kv_cache_layout_module: ClassVar[bool]
    cross_layer_hooks: ClassVar[bool]
    """``prefer_cross_layer_blocks`` / ``register_cross_layers_kv_cache`` exist (must stay False/unused)."""
    hidden_state_cache_spec: ClassVar[bool]
    """The capture layer's spec is ``HiddenStateCacheSpec`` (0.22.0+; before: ``MLAAttentionSpec``)."""
    default_runner: ClassVar[str]
    """Model runner that drives extract_hidden_states by default ("v1"; "v2" from 0.29.0)."""
    supports_hma: ClassVar[bool]
    """The connector subclasses ``SupportsHMA`` (0.22.0+), which keeps the hybrid KV-cache manager on."""
    shims: ClassVar[tuple[Shim, ...]]
    """Connector hooks of this era's calling conventions (see :mod:`vllm_hs_compat.adapters.shims`)."""
    uniform_type_specs: ClassVar[bool] = True
    """``UniformTypeKVCacheSpecs`` exists (every supported release): dense verifiers merge the capture layer."""

    def __init__(self, version: Version, *, untested: bool = False) -> None:
        self.version = version
        self.untested = untested
        """The release lies outside the tested range (newer than every era, or a fork chosen by name): it runs
        only when every probe agrees, and with :attr:`check_every_request`."""

    @property
    def check_every_request(self) -> bool:
        """The connector checks every request's derived slots against the slot mapping vLLM writes with, not only
        the first ``check_requests``: on a release the matrix has not proven (:attr:`untested`)."""
        return self.untested

    def since(self, release: str) -> bool:
        """True when the installed release includes a change introduced in ``release``."""
        return self.version >= Version(release)

    # --- facts that vary inside an era (each names the release that introduced it) --------------
    @property
    def get_kv_cache_groups_module(self) -> str:
        """0.33.0: ``get_kv_cache_groups`` moved to ``vllm.v1.core.kv_cache_planning``."""
        return "vllm.v1.core.kv_cache_planning" if self.since("0.33.0") else "vllm.v1.core.kv_cache_utils"

    @property
    def resumed_field(self) -> str:
        """0.34.0: ``CachedRequestData.resumed_req_ids`` is gone: with Model Runner V1 deleted, every request resumed
        after preemption arrives again in ``scheduled_new_reqs`` with its whole block list, as Model Runner V2 has
        always been sent it (0.17-0.33: ``resumed_req_ids`` names them).  The reader takes both forms."""
        return "absent" if self.since("0.34.0") else "resumed_req_ids"

    @property
    def v1_runner(self) -> bool:
        """0.34.0: Model Runner V1 (``vllm.v1.worker.gpu_model_runner``) is deleted; V2 is the only runner and
        ``VLLM_USE_V2_MODEL_RUNNER=0`` raises."""
        return not self.since("0.34.0")

    @property
    def model_runners(self) -> tuple[str, ...]:
        """The model runners that can drive ``extract_hidden_states`` on this release, the default first: V1
        (0.17-0.28), V2 then V1 (0.29-0.33: V1 with ``VLLM_USE_V2_MODEL_RUNNER=0``), V2 alone (0.34.0+)."""
        if not self.v1_runner:
            return ("v2",)
        return ("v2", "v1") if self.default_runner == "v2" else ("v1",)

    def model_runner_in_use(self, vllm_config: Any) -> str:
        """The runner this engine's workers build: ``vllm_config.use_v2_model_runner`` where the config decides
        (0.2x+: ``VLLM_USE_V2_MODEL_RUNNER``, then the model and feature checks), else the environment flag
        (0.17-0.2x, default V1); V2 alone from 0.34.0."""
        if not self.v1_runner:
            return "v2"
        try:
            v2 = getattr(vllm_config, "use_v2_model_runner", None)
        except Exception:  # the property raises for a configuration V2 refuses: the engine will not start anyway
            v2 = None
        if v2 is None:
            v2 = bool(getattr(importlib.import_module("vllm.envs"), "VLLM_USE_V2_MODEL_RUNNER", False))
        return "v2" if v2 else "v1"

    def v1_draft_feedback(self) -> int | None:
        """How many tokens Model Runner V1's ``extract_hidden_states`` proposer reports for a request whose step
        emitted two (its draft accepted, then the bonus token): vLLM's own ``prepare_next_token_ids_padded`` run on
        the CPU with one such row.  1 on every release so far (it reads the first column only,
        vllm-project/vllm#56417); 2 once fixed; None when V1 is absent or the call cannot run here."""
        observed = self.v1_draft_feedback_observed()
        return observed if isinstance(observed, int) else None

    def v1_draft_feedback_observed(self) -> int | str | None:
        """:meth:`v1_draft_feedback` with the reason when it cannot be observed (``"error: ..."``; what
        ``vllm-hs-compat doctor`` prints)."""
        if not self.v1_runner or not _module_exists("vllm.v1.spec_decode.extract_hidden_states"):
            return None
        try:
            return _two_token_feedback()
        except Exception as exc:  # a reworked method (a GPU kernel, new arguments) cannot be judged here
            return f"error: {type(exc).__name__}: {exc}"

    def generated_rows_need_sync_scheduling(self) -> bool:
        """Whether a capture of generated positions must turn async scheduling off before the engine exists (the
        ``capture`` and ``serve-args`` faces): this release can run Model Runner V1 and its proposer is not known to
        count both tokens of a two-token step (:meth:`async_drafts_misplace_rows` decides per engine)."""
        return self.v1_runner and self.v1_draft_feedback() != 2

    def async_drafts_misplace_rows(self, vllm_config: Any) -> str | None:
        """Why this engine writes some generated positions' rows at wrong positions, or None when it does not.

        Under async scheduling the V1 runner moves a request's next positions back by the drafts it believes
        rejected, taking the count of tokens each step emitted from the proposer; where the proposer reports one
        token for a step that emitted two (:meth:`v1_draft_feedback`), the following steps run (and write their
        hidden states) one position short.  Measured on an H100 with vLLM 0.26.0: rows off only after such a
        step, every row right with async scheduling off (docs/gpu.md)."""
        if not self.async_scheduling(vllm_config) or self.model_runner_in_use(vllm_config) != "v1":
            return None
        feedback = self.v1_draft_feedback()
        if feedback is not None and feedback >= 2:
            return None
        found = "counts one token" if feedback == 1 else "could not be checked on this install"
        return (
            f"vLLM {self.version} schedules ahead of its outputs (async scheduling) with Model Runner V1, whose "
            f"extract_hidden_states proposer {found} for a step that emits two (vllm-project/vllm#56417): after "
            "such a step the engine computes and writes the request's next positions one place short"
        )

    @property
    def default_block_size(self) -> int:
        """The KV block size (tokens) vLLM uses when ``--block-size`` is not given: 0.34.0 raised
        ``CacheConfig.DEFAULT_BLOCK_SIZE`` from 16 to 64."""
        return 64 if self.since("0.34.0") else 16

    @property
    def extensible_kv_cache(self) -> bool:
        """0.34.0: the extensible KV cache is on by default on CUDA and ROCm: vLLM commits the KV cache after warm-up
        from the memory measured free, keeping only a margin, and ``gpu_memory_utilization`` defaults to 1.0.
        Device memory a connector allocates after that comes out of the margin (``serve-args`` says how much)."""
        return self.since("0.34.0")

    @property
    def kv_cache_margin(self) -> KvCacheMargin | None:
        """The margin the extensible KV cache leaves on CUDA (0.34.0: ``KV_CACHE_MARGIN_FRACTION`` 0.75,
        ``KV_CACHE_MARGIN_FLOOR_BYTES`` 1 GiB, ``KV_CACHE_NON_TORCH_RESERVE_BYTES`` 512 MiB in
        ``vllm/v1/worker/extensible_kv_cache.py``; ROCm keeps 3 GiB and 1 GiB); None where vLLM sizes the KV
        cache from ``gpu_memory_utilization`` before warm-up."""
        return KvCacheMargin(0.75, 1 << 30, 512 << 20) if self.extensible_kv_cache else None

    @property
    def connector_ctor_requires_kv_cache_config(self) -> bool:
        """0.21.0: out-of-tree connectors must accept ``kv_cache_config`` (2-arg ctor raises).  The connector
        always declares ``(vllm_config, role, kv_cache_config)``, so no shim is needed."""
        return self.since("0.21.0")

    @property
    def connector_module_path_wins(self) -> bool:
        """0.20.0: ``kv_connector_module_path`` wins over the registry (before: registry first)."""
        return self.since("0.20.0")

    @property
    def handle_preemptions_takes_metadata(self) -> bool:
        """0.19.0: ``handle_preemptions(kv_connector_metadata)`` (0.14-0.18: ``preempted_req_ids: set``)."""
        return self.since("0.19.0")

    @property
    def handle_preemptions_arg(self) -> str:
        return "kv_connector_metadata" if self.handle_preemptions_takes_metadata else "preempted_req_ids"

    @property
    def hma_with_connector(self) -> str:
        """0.22.0 (with HiddenStateCacheSpec): HMA stays on iff the connector is ``SupportsHMA``
        (0.17-0.21: forced off whenever a connector is set)."""
        return "on-if-SupportsHMA" if self.hidden_state_cache_spec else "forced-off"

    @property
    def get_transfer_results(self) -> bool:
        """0.30.0: the runner calls ``get_transfer_results``, whose base default wraps ``get_finished``: the
        connector implements ``get_finished`` only."""
        return self.since("0.30.0")

    @property
    def requires_kv_delivery(self) -> bool:
        """0.27.0: ``requires_kv_delivery`` property (True for producers by default; the connector says False)."""
        return self.since("0.27.0")

    @property
    def handshake_pp_aware(self) -> bool:
        """0.23.0: handshake metadata keyed by ``(pp_rank, tp_rank)`` (``set_xfer_handshake_metadata_pp_aware``)."""
        return self.since("0.23.0")

    @property
    def padding_slots_write(self) -> str:
        """0.25.0: padding slots (-1) are clamped to the null block 0 (before: the last slot of the
        last block, an allocatable block)."""
        return "null-block-0" if self.since("0.25.0") else "last-slot-of-last-block"

    def padding_clobbered_slot(self, num_manager_blocks: int, group_block_size: int) -> int | None:
        """The manager slot a padded token overwrites, where that slot can belong to a request (before
        0.25.0: the last slot of the last block); None where padding lands in the never-allocated null block."""
        if self.padding_slots_write == "null-block-0":
            return None
        return num_manager_blocks * group_block_size - 1

    @property
    def proposer_uses_group0_slots(self) -> bool:
        """Fixed in 0.22.0: the V1 proposer took the capture slots from group 0, wrong when the capture
        layer has a group of its own (hybrid verifier with HMA forced on)."""
        return not self.hidden_state_cache_spec

    @property
    def required_kvcache_layout(self) -> str:
        """0.29.0: layouts are named LBNHC/LBHNC/... (before: NHD/HND)."""
        return "LBNHC" if self.kv_cache_layout_module else "NHD"

    def layer_id_bounds(self, num_hidden_layers: int) -> tuple[int, int]:
        """0.18.0: ids 0 (embeddings) and ``num_hidden_layers`` (last layer) became capturable."""
        if self.since("0.18.0"):
            return 0, num_hidden_layers
        return 1, num_hidden_layers - 1

    def capture_owner(self, ranks: Ranks, holds_capture_layer: bool) -> bool:
        """Whether this worker writes the records: TP rank 0 of the pipeline stage whose KV caches hold the
        capture layer.  Every TP rank holds the whole capture cache (it is not sharded), so one writer is
        enough; on stock releases extract_hidden_states runs without PP, and vLLM's PP support (an open PR,
        vllm#57197) runs the extractor on the last stage -- the stage that registers the capture layer."""
        return holds_capture_layer and ranks.tp_rank == 0

    # --- the connector's base classes ------------------------------------------------------------------
    def connector_bases(self) -> tuple[type, ...]:
        """This era's shims, :class:`~vllm_hs_compat.adapters.shims.ShimTargets` (the no-op methods they forward
        to: ``capture_on_preemptions``, ``capture_on_handshake``), then vLLM's ``KVConnectorBase_V1`` (and
        ``SupportsHMA`` from 0.22.0)."""
        mod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        bases: list[type] = [s.mixin for s in self.shims if s.applies(self.version)]
        bases.append(ShimTargets)
        bases.append(mod.KVConnectorBase_V1)
        if self.supports_hma:
            bases.append(mod.SupportsHMA)
        return tuple(bases)

    def metadata_base(self) -> type:
        """vLLM's ``KVConnectorMetadata`` (scheduler -> worker, every release)."""
        return importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base").KVConnectorMetadata  # type: ignore[no-any-return]

    def handshake_base(self) -> type:
        """vLLM's ``KVConnectorHandshakeMetadata`` (worker -> scheduler at start-up, every release)."""
        mod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        return mod.KVConnectorHandshakeMetadata  # type: ignore[no-any-return]

    # --- probes ----------------------------------------------------------------------------------------
    def run_probes(self) -> list[ProbeResult]:
        """Every probe, observed against the installed vLLM, next to this adapter's declared value."""
        results = []
        for probe in PROBES:
            try:
                observed = probe.observe()
            except Exception as exc:  # a probe that cannot run is an observation too
                observed = f"error: {type(exc).__name__}: {exc}"
            results.append(ProbeResult(probe.name, probe.question, getattr(self, probe.name), observed))
        return results

    def check_capture_group(self, group_index: int) -> None:
        """Refuse capture-group shapes this release writes incorrectly."""
        if self.proposer_uses_group0_slots and group_index != 0:
            raise CaptureGroupError(
                f"vLLM {self.version} puts the capture layer in group {group_index} (a hybrid verifier with "
                "the hybrid KV-cache manager forced on), but releases before 0.22.0 write hidden states with "
                "group 0's slot mapping, so the captured rows would belong to other tokens. Drop "
                "--no-disable-hybrid-kv-cache-manager, or upgrade to vLLM >= 0.22.0."
            )

    def align_cpu_attention_isa(self, vllm_config: Any) -> tuple[str, ...]:
        """Make the verifier's attention layers write the KV cache in the layout their kernels read it with, where
        this release's CPU attention chooses the two apart (:mod:`~vllm_hs_compat.adapters.v0_22`); the names of
        the layers changed.  No-op here: the other eras choose once (0.17-0.21 in the metadata, 0.29+ the
        metadata builder sets its layers' choice)."""
        return ()

    def describe(self) -> str:
        untested = ", UNTESTED: newer than the tested range, judged by its probes" if self.untested else ""
        return f"{self.name} (vLLM {self.versions}) for installed vLLM {self.version}{untested}"
