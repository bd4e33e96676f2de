"""vLLM 0.22.0 - 0.28.x: capture spec is ``HiddenStateCacheSpec``, view ``BLOCK_TOKEN_PLANE``.

0.22.0 introduced ``HiddenStateCacheSpec`` and gives the capture layer a group of its own on hybrid
verifiers with HMA on (block size ``page // (P*C*dtype)``, padded page; 0.28.0: largest divisor of the
groups' gcd); HMA stays on iff the connector is ``SupportsHMA``, so the connector is from here on.
Deltas inside the era: 0.23.0 PP-aware handshake; 0.25.0 padding slots clamped to block 0; 0.27.0
``requires_kv_delivery``.  Removable when the supported floor reaches 0.29.0.

CPU attention (vLLM's CPU build, found by fact: its attention layers carry an ``isa`` of their own, 0.26.0 -
0.28.x; not 0.22.1) chooses its kernel family twice from ``cache_config.block_size``: each layer when the model
is built (the configured block size: 32 -> ``amx`` on a CPU with AMX, else ``vec``) and the metadata builders
after the engine set that block size to the smallest KV-cache group's -- on a hybrid verifier the capture layer's
own group (10 tokens for the tiny e2e verifier -> ``vec16``).  The layers write the KV cache in one family's layout
and the kernels read it in the other's: with AMX every row after the embeddings is wrong, and so is the engine's
output.  :meth:`Adapter.align_cpu_attention_isa` gives the layers the builders' choice (0.29.0 lets the builder
set it on its layers).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

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

log = logging.getLogger("vllm.vllm_hs_compat.adapters")


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

    def align_cpu_attention_isa(self, vllm_config: Any) -> tuple[str, ...]:
        """On vLLM's CPU platform: every attention layer whose own kernel family (``impl.isa``) differs from the one
        CPU attention's metadata builder picks now -- vLLM's own ``_get_attn_isa`` over the engine's current
        ``cache_config.block_size``, the builders' inputs -- gets the builder's, so the KV cache is written and read
        in one layout (module docstring).  Call it on the worker after the engine has settled its block size and
        before the first step (the connector's worker construction: ``api.resolve_capture_group``).  Returns the
        layers changed; a warning names them.  Nothing changes where the two agree (no separate capture group,
        TP workers in their own processes, releases whose layers have no ``isa``)."""
        platforms: Any = importlib.import_module("vllm.platforms")
        if not platforms.current_platform.is_cpu():
            return ()
        try:
            cpu_attn: Any = importlib.import_module("vllm.v1.attention.backends.cpu_attn")
        except ImportError:  # no CPU attention in this build: no CPU attention layers either
            return ()
        impl_cls = getattr(cpu_attn, "CPUAttentionBackendImpl", None)
        choose = getattr(cpu_attn, "_get_attn_isa", None)
        block_size = vllm_config.cache_config.block_size
        if impl_cls is None or choose is None or not isinstance(block_size, int):
            return ()
        changed: dict[str, tuple[str, str]] = {}  # layer -> (its choice, the builders')
        for name, layer in vllm_config.compilation_config.static_forward_context.items():
            impl = getattr(layer, "impl", None)
            if not isinstance(impl, impl_cls) or not isinstance(getattr(impl, "isa", None), str):
                continue
            isa = choose(vllm_config.model_config.dtype, block_size, impl.head_size, impl.kv_cache_dtype)
            if impl.isa != isa:
                changed[name] = (impl.isa, isa)
                impl.isa = isa
        if changed:
            was = "/".join(sorted({old for old, _ in changed.values()}))
            now = "/".join(sorted({new for _, new in changed.values()}))
            log.warning(
                "vLLM %s CPU attention: %d attention layers chose kernel family %s when the model was built, but "
                "the engine has since set the KV-cache block size to %d (the smallest KV-cache group's: the capture "
                "layer's own on a hybrid verifier) and CPU attention's metadata builders choose %s, so the layers "
                "would write the KV cache in one layout and the kernels read it in another (wrong rows and output on "
                "a CPU with AMX). The layers now use %s too (vLLM 0.29.0 chooses once per group): %s",
                self.version,
                len(changed),
                was,
                block_size,
                now,
                now,
                ", ".join(sorted(changed)),
            )
        return tuple(sorted(changed))
