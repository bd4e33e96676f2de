"""vLLM 0.22.0 - 0.28.x: capture spec is ``HiddenStateCacheSpec``, view ``BLOCK_TOKEN_PLANE``.

0.22.0 introduced ``HiddenStateCacheSpec`` and gives the capture layer a group of its own on hybrid
verifiers with HMA on (block size ``page // (P*C*dtype)``, padded page; 0.28.0: largest divisor of the
groups' gcd); HMA stays on iff the connector is ``SupportsHMA``, so the connector is from here on.
Deltas inside the era: 0.23.0 PP-aware handshake; 0.25.0 padding slots clamped to block 0; 0.27.0
``requires_kv_delivery``.  Removable when the supported floor reaches 0.29.0.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from vllm_hs_compat import releases
from vllm_hs_compat.adapters.base import VllmAdapter
from vllm_hs_compat.adapters.shims import (
    CrossLayerHooksOff,
    NoKvDelivery,
    PpAwareHandshake,
    PreemptionsByMetadata,
    Shim,
)
from vllm_hs_compat.core.layout import ViewOrder


class Adapter(VllmAdapter):
    name = "v0_22"
    versions = SpecifierSet(releases.era_range("v0_22"))
    capture_spec_types = frozenset({"HiddenStateCacheSpec"})
    # Split path (own group): an as_strided view whose block stride is the padded page.
    # 0.22.0: HiddenStateCacheSpec(MLAAttentionSpec) marks the capture layer.
    hidden_state_cache_spec = True
    default_runner = "v1"
    view_order = ViewOrder.BLOCK_TOKEN_PLANE
    backend_get_kv_cache_shape = True
    kv_cache_layout_module = False
    cross_layer_hooks = True
    supports_hma = True
    shims = (
        Shim(CrossLayerHooksOff),
        Shim(PreemptionsByMetadata),
        Shim(PpAwareHandshake, since="0.23.0"),
        Shim(NoKvDelivery, since="0.27.0"),
    )
