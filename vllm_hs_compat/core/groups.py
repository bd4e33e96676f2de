"""Find the KV-cache group that holds the capture layer, over a neutral description of the groups.

The adapters turn vLLM's ``KVCacheConfig.kv_cache_groups`` into :class:`GroupInfo` records; this module
decides.  Two shapes of the same config exist at run time:

* the **worker view** (the connector of role WORKER): a dense or MLA verifier puts every layer *and* the
  capture layer into one merged ``UniformTypeKVCacheSpecs`` group whose per-layer spec dict survives;
* the **scheduler view** (role SCHEDULER): a deep copy in which every merged group spec was flattened to
  its first per-layer spec (a plain ``FullAttentionSpec``) -- but ``layer_names`` are kept.

A hybrid verifier with HMA on gives the capture layer a group of its own (appended last, small block
size, padded page).  Both views must name the same group index and block size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..errors import CaptureGroupError

ViewKind = Literal["worker", "scheduler"]


@dataclass(frozen=True)
class GroupInfo:
    """One KV-cache group, described without vLLM types."""

    index: int
    layer_names: tuple[str, ...]
    spec_type: str
    block_size: int
    merged: bool = False
    """True when the group spec is a merged uniform-type spec (``UniformTypeKVCacheSpecs``)."""
    layer_spec_types: Mapping[str, str] = field(default_factory=dict)
    """Per-layer spec class names, when the group spec carries them (worker view of a merged group)."""
    page_size_padded: int | None = None

    def summary(self) -> str:
        inner = ""
        if self.layer_spec_types:
            kinds = sorted(set(self.layer_spec_types.values()))
            inner = "{" + ",".join(kinds) + "}"
        pad = f", page_size_padded={self.page_size_padded}" if self.page_size_padded else ""
        return (
            f"group {self.index}: {self.spec_type}{inner} block_size={self.block_size} "
            f"layers={len(self.layer_names)}{pad}"
        )


@dataclass(frozen=True)
class CaptureGroup:
    """The resolved capture group."""

    index: int
    block_size: int
    layer_name: str
    merged: bool
    """True when the capture layer shares the group (and its block table) with verifier layers."""
    view: ViewKind
    capture_spec_type: str | None
    """Spec class of the capture layer itself, when the view shows it (None in a flattened view)."""

    def describe(self) -> str:
        kind = "merged with the verifier layers" if self.merged else "a group of its own"
        spec = self.capture_spec_type or "flattened"
        return (
            f"capture layer {self.layer_name!r} in group {self.index} ({kind}), block_size={self.block_size}, "
            f"spec={spec}, {self.view} view"
        )


def _all_groups(groups: Sequence[GroupInfo]) -> str:
    return "; ".join(g.summary() for g in groups) or "no groups"


def resolve_capture_group(
    groups: Sequence[GroupInfo],
    capture_layer: str,
    *,
    capture_spec_types: frozenset[str],
    view: ViewKind,
) -> CaptureGroup:
    """Return the group whose ``layer_names`` holds ``capture_layer``.

    ``capture_spec_types`` are the class names the release uses for the capture layer's spec (the adapter
    reports them).  Where the view shows the capture layer's spec (its own group, or a merged group with
    its per-layer dict), that spec must be one of them; a flattened scheduler view is checked by name only.
    """
    holders = [g for g in groups if capture_layer in g.layer_names]
    if not holders:
        raise CaptureGroupError(
            f"no KV-cache group holds the capture layer {capture_layer!r} ({view} view; {_all_groups(groups)}). "
            "Is speculative_config method 'extract_hidden_states' set, and is the layer name the one the "
            "adapter reports (cache_only_layers.<num_hidden_layers>)?"
        )
    if len(holders) > 1:
        raise CaptureGroupError(
            f"the capture layer {capture_layer!r} appears in {len(holders)} KV-cache groups "
            f"({view} view; {_all_groups(groups)}); expected exactly one."
        )
    g = holders[0]
    merged = len(g.layer_names) > 1
    if g.layer_spec_types:
        spec_type: str | None = g.layer_spec_types.get(capture_layer)
        if spec_type is None:
            raise CaptureGroupError(
                f"{g.summary()} lists {capture_layer!r} in layer_names but its per-layer spec dict has no "
                f"entry for it ({view} view)"
            )
    elif g.merged:
        spec_type = None
    elif view == "worker" or not merged:
        spec_type = g.spec_type
    else:
        spec_type = None  # scheduler view of a merged group: flattened to the first layer's spec
    if spec_type is not None and spec_type not in capture_spec_types:
        raise CaptureGroupError(
            f"the capture layer {capture_layer!r} is in {g.summary()} but its spec is {spec_type}; "
            f"expected one of {sorted(capture_spec_types)} for this vLLM release ({view} view). The "
            "layer name may belong to another model component, or the adapter does not match this build."
        )
    if g.block_size <= 0:
        raise CaptureGroupError(f"{g.summary()} has a non-positive block size ({view} view)")
    return CaptureGroup(
        index=g.index,
        block_size=g.block_size,
        layer_name=capture_layer,
        merged=merged,
        view=view,
        capture_spec_type=spec_type,
    )


def check_views_agree(worker: CaptureGroup, scheduler: CaptureGroup) -> None:
    """Raise unless both views name the same capture group with the same block size."""
    if (worker.index, worker.block_size, worker.layer_name) != (
        scheduler.index,
        scheduler.block_size,
        scheduler.layer_name,
    ):
        raise CaptureGroupError(
            "the worker and scheduler views disagree on the capture group: worker says "
            f"{worker.describe()}; scheduler says {scheduler.describe()}. Block ids from the scheduler would "
            "address the wrong cache rows."
        )
