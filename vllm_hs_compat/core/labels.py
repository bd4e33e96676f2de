"""Plane labels: which verifier layer id each captured plane holds.

vLLM stores planes in ascending layer-id order, not in the order the user listed them (the verifier
appends an auxiliary state while walking its layers; 0.30+ also sorts the id tuple).  Layer id ``k``
means the output of decoder layer ``k-1`` (``hidden_states + residual``, before the final norm); id 0 is
the embedding output and id ``num_hidden_layers`` the last layer's un-normalised output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import LayerIdError


@dataclass(frozen=True)
class PlaneLabels:
    layer_ids: tuple[int, ...]
    """``layer_ids[i]`` is the verifier layer id stored in plane ``i``."""
    pre_norm: bool = True
    """Every plane is taken before the final norm (true for every supported release)."""

    @property
    def num_planes(self) -> int:
        return len(self.layer_ids)

    def plane_of(self, layer_id: int) -> int:
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise LayerIdError(
                f"layer id {layer_id} is not captured; captured ids are {list(self.layer_ids)}"
            ) from None


def plane_labels(
    configured_ids: Sequence[int],
    *,
    num_hidden_layers: int | None = None,
    min_id: int = 0,
    max_id: int | None = None,
) -> PlaneLabels:
    """Label planes from the configured ``eagle_aux_hidden_state_layer_ids``.

    ``min_id``/``max_id`` are the release's valid bounds (the adapter supplies them: 0.17 accepts only
    ``1 .. num_hidden_layers - 1``).  Duplicates are refused: vLLM would produce fewer states than planes.
    """
    ids = [int(i) for i in configured_ids]
    if not ids:
        raise LayerIdError(
            "eagle_aux_hidden_state_layer_ids is empty; list at least one verifier layer id in "
            "speculative_config.draft_model_config.hf_config"
        )
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise LayerIdError(
            f"eagle_aux_hidden_state_layer_ids {ids} repeats {dupes}; vLLM captures each layer once, so the "
            "cache would hold fewer planes than configured. Remove the duplicates."
        )
    hi = max_id if max_id is not None else num_hidden_layers
    bad = [i for i in ids if i < min_id or (hi is not None and i > hi)]
    if bad:
        raise LayerIdError(
            f"layer ids {bad} are outside the range this vLLM release captures ({min_id} .. {hi}); "
            f"configured ids: {ids}"
        )
    return PlaneLabels(layer_ids=tuple(sorted(ids)))
