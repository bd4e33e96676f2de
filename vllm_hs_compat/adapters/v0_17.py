"""vLLM 0.17.0 - 0.21.x: capture spec is ``MLAAttentionSpec``, view ``[nb, N, P, C]``.

Removable when the supported floor reaches 0.22.0.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from vllm_hs_compat.adapters.base import VllmAdapter
from vllm_hs_compat.core.layout import ViewOrder


class Adapter(VllmAdapter):
    name = "v0_17"
    versions = SpecifierSet(">=0.17.0,<0.22.0")
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
