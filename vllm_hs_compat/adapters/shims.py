"""Connector hooks whose form changed across releases and that more than one era needs.

A shim is a mixin placed before vLLM's ``KVConnectorBase_V1`` in the connector's bases; the era modules list
the shims their releases need (:class:`Shim`, with the release range each applies to).  A shim only adapts
vLLM's calling convention and forwards to the connector's own method (:class:`ShimTargets` names them); the
behaviour lives in the connector.
Shims used by a single era live in that era's module, so deleting the module removes them too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

from vllm_hs_compat.errors import CaptureViewError


@dataclass(frozen=True)
class Shim:
    """A mixin and the releases it applies to: ``since <= version < until`` (either bound open)."""

    mixin: type
    since: str | None = None
    until: str | None = None

    def applies(self, version: Version) -> bool:
        return (self.since is None or version >= Version(self.since)) and (
            self.until is None or version < Version(self.until)
        )


class ShimTargets:
    """What the shims forward to, as no-ops: every connector built on ``connector_bases()`` has them and
    overrides the ones it needs.  Always among the bases, after the era's shims."""

    def capture_on_preemptions(self) -> None:
        """vLLM preempted requests this step (``handle_preemptions``, whatever its release's signature)."""

    def capture_on_handshake(self, metadata: dict[Any, Any]) -> None:
        """The workers' handshake metadata reached the scheduler: ``{key: KVConnectorHandshakeMetadata}`` (key
        ``tp_rank`` before 0.23, ``(pp_rank, tp_rank)`` from 0.23)."""


class CrossLayerHooksOff:
    """0.12-0.28: vLLM asks ``prefer_cross_layer_blocks``; True would hand one cross-layer tensor to
    ``register_cross_layers_kv_cache`` instead of the capture layer's own view.  Keep it False and refuse the
    cross-layer call.  Delete when the supported floor reaches 0.29 (0.29 removed both hooks)."""

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        raise CaptureViewError(
            "vLLM offered one cross-layer KV-cache tensor; the capture connector needs the capture layer's own "
            "view (prefer_cross_layer_blocks is False). Is another connector wrapping this one?"
        )


class PreemptionsByMetadata(ShimTargets):
    """0.19+: ``handle_preemptions(kv_connector_metadata)`` (0.14-0.18 passed the preempted ids).  Stays while
    vLLM keeps the hook; its ``since`` bound in v0_17 goes when the supported floor reaches 0.19."""

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self.capture_on_preemptions()


class NoKvDelivery:
    """0.27+: ``requires_kv_delivery`` defaults to True for producers, which makes vLLM drop a preempted
    request's in-flight output to protect a pending hand-off.  The capture connector reads only finished
    requests' blocks (never preempted) and a preempted request recomputes its rows before it can finish, so
    nothing is in flight to protect: False keeps vLLM's default delivery.  Applies from 0.27.0 (harmless
    before: the attribute is not read); its ``since`` bound in v0_22 goes with that era module."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False


class PpAwareHandshake(ShimTargets):
    """0.23+: the engine hands handshake metadata keyed by ``(pp_rank, tp_rank)``; the base refuses
    ``pp_rank > 0``, but the capture owner may sit on the last pipeline stage.  Applies from 0.23.0; its
    ``since`` bound in v0_22 goes with that era module."""

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Mapping[tuple[int, int], Any]) -> None:
        self.capture_on_handshake(dict(metadata))
