"""Each drafter trainer's format as data (:class:`FormatSpec`, :data:`FORMATS`), and the layer ids its drafter
config needs (:class:`LayerMap`, :func:`trainer_layer_ids`, :func:`check_drafter_config`).

Layer numbering.  A record's ids are vLLM's (``eagle_aux_hidden_state_layer_ids``): id ``i`` is the residual
stream *entering* decoder layer ``i`` (HF ``hidden_states[i]``), and ``num_hidden_layers`` is the last layer's
output before the final norm.  speculators uses the same numbering (``--target-layer-ids``, without the base).
SGLang/SpecForge (``set_eagle3_layers_to_capture`` adds one) and ModelOpt (forward hooks on ``layers[i]``) name
layer *outputs*: their id ``j`` is vLLM's ``j + 1``.  :func:`trainer_layer_ids` converts;
:func:`check_drafter_config` refuses a drafter config whose ids are off by one.

Pure Python.  Re-exported by :mod:`vllm_hs_compat.trainer.formats` (whose writers follow these specs), where users
import them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from vllm_hs_compat.errors import FormatError, LayerNumberingError


@dataclass(frozen=True)
class FormatSpec:
    """What a trainer format needs and how its trainer numbers layers."""

    name: str
    trainer: str
    #: trainer id = vLLM id - ``shift``
    shift: int
    #: the base plane's norm state in this format: ``"pre"``, ``"post"``, or None (no separate base plane)
    base_norm: str | None
    #: where the ids go in the trainer's drafter config
    config_key: str
    #: how the trainer finds the files
    reads: str
    #: the trainer's training command, for the summary
    command: str


FORMATS: Final[Mapping[str, FormatSpec]] = {
    "native": FormatSpec(
        "native",
        "vllm-hs-compat",
        0,
        "pre",
        "eagle_aux_hidden_state_layer_ids (vLLM)",
        "<record>.json + <record>.safetensors",
        "HiddenStatesDataset.from_files(OUT) / RecordFileDataset(OUT)",
    ),
    "speculators": FormatSpec(
        "speculators",
        "speculators 0.9",
        0,
        "pre",
        "--target-layer-ids (speculators train; the base layer is not listed)",
        "load_from_disk(OUT) rows + OUT/hidden_states/hs_<i>.safetensors",
        "speculators train --data-path OUT --verifier-name-or-path MODEL --target-layer-ids {ids} --on-missing raise",
    ),
    "specforge-eagle3": FormatSpec(
        "specforge-eagle3",
        "SpecForge 0.2 (EAGLE-3)",
        1,
        "post",
        "eagle_config.eagle_aux_hidden_state_layer_ids (draft config) / model.aux_hidden_state_layer_ids",
        "OUT/**/*.ckpt[.gz] (OfflineManifestReader)",
        "specforge train --config RUN.yaml data.hidden_states_path=OUT model.target_model_path=MODEL "
        "model.aux_hidden_state_layer_ids={ids}",
    ),
    "specforge-dflash": FormatSpec(
        "specforge-dflash",
        "SpecForge 0.2 (DFlash)",
        1,
        None,
        "dflash_config.target_layer_ids (draft config)",
        "OUT/**/*.ckpt[.gz] (OfflineManifestReader, strategy dflash)",
        "specforge train --config RUN.yaml data.hidden_states_path=OUT (draft config: dflash_config.target_layer_ids"
        "={ids})",
    ),
    "modelopt": FormatSpec(
        "modelopt",
        "ModelOpt 0.47 (EAGLE offline)",
        1,
        "pre",
        "eagle_architecture_config.eagle_aux_hidden_state_layer_ids",
        "OUT/*.pt (OfflineSupervisedDataset)",
        "examples/speculative_decoding/main.py --offline-data OUT --eagle_config "
        "'{{\"eagle_aux_hidden_state_layer_ids\": {ids}}}' ...",
    ),
}


def check_format(name: str) -> FormatSpec:
    """The :class:`FormatSpec` of ``name`` or :class:`FormatError`."""
    try:
        return FORMATS[name]
    except KeyError:
        raise FormatError(f"format must be one of {list(FORMATS)}, found {name!r}") from None


@dataclass(frozen=True)
class LayerMap:
    """The layer ids of one output, in vLLM's numbering and in the trainer's."""

    format: str
    vllm_ids: tuple[int, ...]
    num_hidden_layers: int
    #: the planes the drafter config lists (aux planes; every plane for DFlash), vLLM numbering
    config_vllm_ids: tuple[int, ...]
    #: the same planes in the trainer's numbering: what its drafter config must say
    trainer_ids: tuple[int, ...]
    #: vLLM id of the base plane (``num_hidden_layers``), None when the format has no base plane
    base_id: int | None

    def line(self) -> str:
        """One human line: which ids go where."""
        spec = FORMATS[self.format]
        conv = "vLLM's numbering" if spec.shift == 0 else "layer-output numbering: vLLM id - 1"
        base = f"; base plane = vLLM id {self.base_id} ({spec.base_norm}-norm)" if self.base_id is not None else ""
        return (
            f"{spec.trainer}: {spec.config_key} = {list(self.trainer_ids)} ({conv}; records' vLLM ids "
            f"{list(self.vllm_ids)}{base})"
        )

    def to_dict(self) -> dict[str, Any]:
        spec = FORMATS[self.format]
        return {
            "vllm_layer_ids": list(self.vllm_ids),
            "num_hidden_layers": self.num_hidden_layers,
            "trainer_layer_ids": list(self.trainer_ids),
            "trainer_config_key": spec.config_key,
            "trainer_numbering": "vllm (residual entering layer i)"
            if spec.shift == 0
            else "layer outputs (vLLM id - 1)",
            "base_layer_id": self.base_id,
            "base_plane_norm": spec.base_norm,
        }


def trainer_layer_ids(fmt: str, vllm_ids: Sequence[int], num_layers: int) -> LayerMap:
    """The ids a ``fmt`` trainer's drafter config needs for records with planes ``vllm_ids`` of a verifier with
    ``num_layers`` decoder layers.  Raises :class:`FormatError` when the planes do not fit the format (EAGLE
    formats need the base plane, id ``num_layers``, last; layer-output numbering cannot name id 0)."""
    spec = check_format(fmt)
    ids = tuple(int(i) for i in vllm_ids)
    if list(ids) != sorted(set(ids)):
        raise FormatError(f"layer ids must be strictly ascending, found {list(ids)}")
    if ids and ids[-1] > num_layers:
        raise FormatError(f"layer id {ids[-1]} is past the verifier's num_hidden_layers = {num_layers}")
    base: int | None = None
    if spec.base_norm is not None and fmt != "native":
        if len(ids) < 2 or ids[-1] != num_layers:
            raise FormatError(
                f"the {fmt!r} format needs the auxiliary planes and the base plane (layer id num_hidden_layers = "
                f"{num_layers}, the last one), found layer ids {list(ids)}: capture with "
                f"eagle_aux_hidden_state_layer_ids listing the aux layers and {num_layers}"
            )
        base = num_layers
        listed = ids[:-1]
    elif fmt == "native":
        base = num_layers if ids and ids[-1] == num_layers else None
        listed = ids[:-1] if base is not None else ids
    else:
        listed = ids
    if spec.shift and listed and listed[0] < spec.shift:
        raise FormatError(
            f"{spec.trainer} numbers layer outputs (vLLM id - 1): vLLM id {listed[0]} (the embeddings) has no id "
            "there; capture other layers"
        )
    return LayerMap(fmt, ids, num_layers, listed, tuple(i - spec.shift for i in listed), base)


# --- drafter configs ---------------------------------------------------------------------------------------------
_CONFIG_PATHS: Final = (
    ("eagle_config", "eagle_aux_hidden_state_layer_ids"),
    ("eagle_architecture_config", "eagle_aux_hidden_state_layer_ids"),
    ("eagle_aux_hidden_state_layer_ids",),
    ("dflash_config", "target_layer_ids"),
    ("model", "aux_hidden_state_layer_ids"),
    ("aux_hidden_state_layer_ids",),
    ("target_layer_ids",),
)


def drafter_config_ids(config: Mapping[str, Any]) -> tuple[str, list[int]] | None:
    """``(key path, ids)`` of the layer ids a drafter config lists, or None when it lists none."""
    for path in _CONFIG_PATHS:
        node: Any = config
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        if isinstance(node, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in node) and node:
            return ".".join(path), list(node)
    return None


def check_drafter_config(config: Mapping[str, Any] | str | os.PathLike[str], layer_map: LayerMap) -> str:
    """Compare a drafter config's layer ids with what ``layer_map`` says its trainer needs.

    Returns a one-line verdict when they agree (or the config lists none: it then uses the trainer's defaults,
    stated).  Raises :class:`LayerNumberingError` when they differ, naming the off-by-one case explicitly."""
    if not isinstance(config, Mapping):
        path = Path(config)
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise LayerNumberingError(f"cannot read the drafter config {path} ({exc})") from None
        if not isinstance(config, Mapping):
            raise LayerNumberingError(f"the drafter config {path} is not a JSON object")
    found = drafter_config_ids(config)
    want = list(layer_map.trainer_ids)
    spec = FORMATS[layer_map.format]
    if found is None:
        return (
            f"the drafter config lists no layer ids: {spec.trainer} then uses its defaults; set "
            f"{spec.config_key} = {want}"
        )
    key, ids = found
    if ids == want:
        return f"drafter config {key} = {ids}: matches the records ({spec.trainer} numbering)"
    vllm = list(layer_map.config_vllm_ids)
    if spec.shift and ids == vllm:
        raise LayerNumberingError(
            f"drafter config {key} = {ids} uses vLLM's numbering (residual entering layer i); {spec.trainer} "
            f"numbers layer outputs, so these records' planes are {want} there: off by one.  Set {key} = {want}"
        )
    if [i - 1 for i in ids] == want or [i + 1 for i in ids] == want:
        raise LayerNumberingError(
            f"drafter config {key} = {ids} is off by one from the records' planes, which are {want} in "
            f"{spec.trainer}'s numbering (vLLM ids {vllm}).  Set {key} = {want}"
        )
    raise LayerNumberingError(
        f"drafter config {key} = {ids} differs from the records' planes {want} ({spec.trainer} numbering; vLLM ids "
        f"{vllm}): capture the layers the drafter was configured for, or change the config"
    )
