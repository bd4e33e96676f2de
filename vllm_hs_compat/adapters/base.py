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

from vllm_hs_compat.core.groups import GroupInfo
from vllm_hs_compat.core.layout import ViewOrder
from vllm_hs_compat.errors import CaptureGroupError

CAPTURE_LAYER_PREFIX = "cache_only_layers."


@dataclass(frozen=True)
class ProbeResult:
    name: str
    question: str
    expected: object
    observed: object

    @property
    def ok(self) -> bool:
        return self.expected == self.observed


@dataclass(frozen=True)
class Probe:
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


def _handle_preemptions_arg() -> str:
    base = _connector_base()
    if not hasattr(base, "handle_preemptions"):
        return "absent"
    params = [p for p in inspect.signature(base.handle_preemptions).parameters if p != "self"]
    return params[0] if params else "none"


PROBES: tuple[Probe, ...] = (
    Probe(
        "backend_get_kv_cache_shape",
        "does AttentionBackend.get_kv_cache_shape exist (view shape from the backend)?",
        _backend_has_shape,
    ),
    Probe(
        "kv_cache_layout_module",
        "does vllm.v1.kv_cache_layout exist (strided [nb, P, N, C] views)?",
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
)


class VllmAdapter:
    """Answers for one era of vLLM releases.  Subclasses set the class attributes."""

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

    def __init__(self, version: Version) -> None:
        self.version = version

    def since(self, release: str) -> bool:
        """True when the installed release includes a change introduced in ``release``."""
        return self.version >= Version(release)

    # --- facts that vary inside an era (each names the release that introduced it) --------------
    @property
    def get_kv_cache_groups_module(self) -> str:
        """0.33.0: ``get_kv_cache_groups`` moved to ``vllm.v1.core.kv_cache_planning``."""
        return "vllm.v1.core.kv_cache_planning" if self.since("0.33.0") else "vllm.v1.core.kv_cache_utils"

    @property
    def connector_ctor_requires_kv_cache_config(self) -> bool:
        """0.21.0: out-of-tree connectors must accept ``kv_cache_config`` (2-arg ctor raises)."""
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
        """0.30.0: the runner calls ``get_transfer_results`` (the default wraps ``get_finished``)."""
        return self.since("0.30.0")

    @property
    def requires_kv_delivery(self) -> bool:
        """0.27.0: ``requires_kv_delivery`` property (True for producers by default)."""
        return self.since("0.27.0")

    @property
    def padding_slots_write(self) -> str:
        """0.25.0: padding slots (-1) are clamped to the null block 0 (before: the last slot of the
        last block, an allocatable block)."""
        return "null-block-0" if self.since("0.25.0") else "last-slot-of-last-block"

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

    # --- probes ----------------------------------------------------------------------------------
    def expected(self) -> dict[str, object]:
        return {
            "backend_get_kv_cache_shape": self.backend_get_kv_cache_shape,
            "kv_cache_layout_module": self.kv_cache_layout_module,
            "hidden_state_cache_spec": self.hidden_state_cache_spec,
            "uniform_type_specs": True,
            "get_kv_cache_groups_module": self.get_kv_cache_groups_module,
            "connector_ctor_requires_kv_cache_config": self.connector_ctor_requires_kv_cache_config,
            "cross_layer_hooks": self.cross_layer_hooks,
            "handle_preemptions_arg": self.handle_preemptions_arg,
            "get_transfer_results": self.get_transfer_results,
        }

    def run_probes(self) -> list[ProbeResult]:
        expected = self.expected()
        results = []
        for probe in PROBES:
            try:
                observed = probe.observe()
            except Exception as exc:  # a probe that cannot run is an observation too
                observed = f"error: {type(exc).__name__}: {exc}"
            results.append(ProbeResult(probe.name, probe.question, expected[probe.name], observed))
        return results

    # --- reading vLLM objects ---------------------------------------------------------------------
    def _spec_name(self, spec: object) -> str:
        """Class name of a spec; a vendor subclass of a capture spec reports the capture spec's name."""
        for klass in type(spec).__mro__:
            if klass.__name__ in self.capture_spec_types:
                return klass.__name__
        return type(spec).__name__

    def group_infos(self, kv_cache_config: Any) -> list[GroupInfo]:
        """Describe ``kv_cache_config.kv_cache_groups`` as neutral :class:`GroupInfo` records."""
        iface = _kv_iface()
        uniform = iface.UniformTypeKVCacheSpecs
        infos = []
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            merged = isinstance(spec, uniform)
            per_layer = {name: self._spec_name(s) for name, s in spec.kv_cache_specs.items()} if merged else {}
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

    def check_capture_group(self, group_index: int) -> None:
        """Refuse capture-group shapes this release writes incorrectly."""
        if self.proposer_uses_group0_slots and group_index != 0:
            raise CaptureGroupError(
                f"vLLM {self.version} puts the capture layer in group {group_index} (a hybrid verifier with "
                "the hybrid KV-cache manager forced on), but releases before 0.22.0 write hidden states with "
                "group 0's slot mapping, so the captured rows would belong to other tokens. Drop "
                "--no-disable-hybrid-kv-cache-manager, or upgrade to vLLM >= 0.22.0."
            )

    def kv_cache_layout(self, vllm_config: Any, kv_cache_config: Any) -> str | None:
        """Name of the resolved KV-cache layout (0.29.0+); None before 0.29 (layout is the shape)."""
        if not self.kv_cache_layout_module:
            return None
        name = getattr(kv_cache_config, "kv_cache_layout", None)
        if name is None and vllm_config is not None:
            name = getattr(vllm_config.cache_config, "kv_cache_layout", None)
        return None if name is None else str(getattr(name, "name", name))

    def capture_layer_name(self, vllm_config: Any) -> str:
        """``cache_only_layers.<num_hidden_layers of the verifier>`` (0.17+)."""
        return f"{CAPTURE_LAYER_PREFIX}{vllm_config.model_config.hf_text_config.num_hidden_layers}"

    def configured_layer_ids(self, vllm_config: Any) -> list[int]:
        spec = vllm_config.speculative_config
        if spec is None or getattr(spec, "method", None) != "extract_hidden_states":
            raise CaptureGroupError(
                "speculative_config.method is not 'extract_hidden_states'; start vLLM with "
                '--speculative-config \'{"method": "extract_hidden_states", "num_speculative_tokens": 1, '
                '"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}\''
            )
        hf = spec.draft_model_config.hf_config
        return [int(i) for i in getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or []]

    def describe(self) -> str:
        return f"{self.name} (vLLM {self.versions}) for installed vLLM {self.version}"
