"""vLLM 0.29.0 - 0.34.x: logical view ``BLOCK_PLANE_TOKEN``, strided into one shared backing buffer.

0.29.0 (KV-cache layout refactor) deleted ``AttentionBackend.get_kv_cache_shape``, added
``vllm.v1.kv_cache_layout`` (default LBNHC, token-major; LBHNC and block-outermost BL* layouts exist),
removed the cross-layer hooks (the connector defines neither) and made Model Runner V2 the default (its hook
order differs, and it hands resumed requests back as new ones with their full block list).
0.30.0: the runner calls ``get_transfer_results`` (its base default wraps ``get_finished``, which the
connector implements: no shim).  0.33.0: ``get_kv_cache_groups`` moved to ``kv_cache_planning``.
0.34.0: Model Runner V1 deleted (``v1_runner``; resumed requests always arrive as new, ``resumed_field`` absent),
``CacheConfig.DEFAULT_BLOCK_SIZE`` 64 and the extensible KV cache on by default (``default_block_size``,
``extensible_kv_cache``); the view, the layouts and the grouping are unchanged, so the era goes on.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from vllm_hs_compat import releases
from vllm_hs_compat.adapters.base import VllmAdapter
from vllm_hs_compat.adapters.shims import NoKvDelivery, PpAwareHandshake, PreemptionsByMetadata, Shim
from vllm_hs_compat.core.layout import ViewOrder


class Adapter(VllmAdapter):
    name = "v0_29"
    versions = SpecifierSet(releases.era_range("v0_29"))
    capture_spec_types = frozenset({"HiddenStateCacheSpec"})
    hidden_state_cache_spec = True
    # 0.29.0: the V2 model runner is the default (extract_hidden_states supported there from 0.29.0); the only one
    # from 0.34.0 (``v1_runner``).
    default_runner = "v2"
    view_order = ViewOrder.BLOCK_PLANE_TOKEN
    backend_get_kv_cache_shape = False
    kv_cache_layout_module = True
    cross_layer_hooks = False
    supports_hma = True
    shims = (Shim(PreemptionsByMetadata), Shim(PpAwareHandshake), Shim(NoKvDelivery))
