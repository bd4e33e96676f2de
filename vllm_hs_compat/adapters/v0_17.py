"""vLLM 0.17.0 - 0.21.x: capture spec is ``MLAAttentionSpec``, view ``BLOCK_TOKEN_PLANE``.

Deltas inside the era: 0.18.0 layer ids 0 and N capturable; 0.19.0 ``handle_preemptions(metadata)``;
0.20.0 ``kv_connector_module_path`` wins over the registry; 0.21.0 the 3-argument constructor is required.
HMA is forced off whenever a connector is set, so the connector is not ``SupportsHMA`` here (vLLM refuses a
hybrid KV-cache manager forced on with a non-HMA connector, which is what we want: the proposer of this era
writes a split capture group with group 0's slots).  Removable when the supported floor reaches 0.22.0.
"""

from __future__ import annotations

from typing import Any

from packaging.specifiers import SpecifierSet

from vllm_hs_compat import releases
from vllm_hs_compat.adapters.base import VllmAdapter
from vllm_hs_compat.adapters.shims import CrossLayerHooksOff, PreemptionsByMetadata, Shim, ShimTargets
from vllm_hs_compat.core.layout import ViewOrder


class PreemptionsBySet(ShimTargets):
    """0.14-0.18: ``handle_preemptions(preempted_req_ids: set[str])``; 0.19.0 passes the metadata instead.
    Delete when the supported floor reaches 0.19.0."""

    def handle_preemptions(self, preempted_req_ids: set[str] | Any) -> None:
        self.capture_on_preemptions()


class Adapter(VllmAdapter):
    name = "v0_17"
    versions = SpecifierSet(releases.era_range("v0_17"))
    # 0.17.0: CacheOnlyAttentionLayer.get_kv_cache_spec returns MLAAttentionSpec(num_kv_heads=P, head_size=C).
    capture_spec_types = frozenset({"MLAAttentionSpec"})
    # 0.17.0: CacheOnlyAttentionBackend.get_kv_cache_shape = (nb, block_size, P, C), identity stride order.
    hidden_state_cache_spec = False
    default_runner = "v1"
    view_order = ViewOrder.BLOCK_TOKEN_PLANE
    backend_get_kv_cache_shape = True
    kv_cache_layout_module = False
    # 0.12.0 - 0.28.x: cross-layer hooks exist; the connector must keep prefer_cross_layer_blocks False.
    cross_layer_hooks = True
    supports_hma = False
    shims = (
        Shim(CrossLayerHooksOff),
        Shim(PreemptionsBySet, until="0.19.0"),
        Shim(PreemptionsByMetadata, since="0.19.0"),
    )
