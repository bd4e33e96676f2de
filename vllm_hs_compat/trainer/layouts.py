"""How one capture record becomes one training item, for each drafter trainer's convention.

A record's hidden states are ``[T, P, C]``: T tokens, P capture planes in ascending layer-id order, C = the
verifier's ``hidden_size``, taken before the final norm.  With vLLM's ``eagle_aux_hidden_state_layer_ids``
``[2, 16, 29, 32]`` on a 32-layer verifier, planes 0..2 are the EAGLE-3 auxiliary layers and plane 3
(the largest id, ``num_hidden_layers``) is the output of the last decoder layer: the *base* hidden state.

Layouts (every item also carries ``record_id`` (str), ``layer_ids`` (LongTensor ``[P]``), ``num_prompt_tokens``
and ``start`` (int), ``sample_id`` (str: the dataset sample the record was made for, ``""`` when not given) and
``loss_mask_from`` (str: which mask ``loss_mask`` is, see :func:`resolve_loss_mask`)):

``"eagle3"`` (SpecForge's names)
    ``input_ids`` LongTensor ``[T]``; ``hidden_states`` ``[T, C]``: the last plane (the base hidden, pre-norm);
    ``aux_hidden_states`` ``[T, (P-1)*C]``: the other planes concatenated in ascending layer-id order;
    ``loss_mask`` ``[T]``.  Needs ``P >= 2``.
``"speculators"`` (the per-sample dict of vllm-project/speculators' training datasets)
    ``input_ids`` ``[T]``; ``hidden_states`` ``[T, (P-1)*C]``: the auxiliary planes concatenated;
    ``verifier_last_hidden_states`` ``[T, C]``: the last plane; ``loss_mask`` ``[T]``; ``lengths``
    LongTensor ``[1]`` = ``[T]``; ``position_ids`` LongTensor ``[T]`` = ``start + arange(T)``.  Needs ``P >= 2``.
``"dflash"`` (the DFlash block-diffusion drafter: every selected target layer is context)
    ``input_ids`` ``[T]``; ``hidden_states`` ``[T, P*C]``: all planes concatenated in ascending layer-id
    order; ``loss_mask`` ``[T]``.
``"planes"``
    ``input_ids`` ``[T]``; ``hidden_states`` ``[T, P, C]`` as stored; ``loss_mask`` ``[T]``.

Layer ids are vLLM's (``eagle_aux_hidden_state_layer_ids``; the base plane's id is ``num_hidden_layers``); they
are passed through unchanged, never renumbered to another framework's convention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch

from vllm_hs_compat.core.records import CaptureRecord
from vllm_hs_compat.errors import DatasetConfigError, LayoutError

LAYOUTS: Final = ("eagle3", "speculators", "dflash", "planes")
LOSS_MASKS: Final = ("auto", "record", "all", "generated")
#: ``loss_mask_from`` of a mask computed by a caller's function.
FROM_CALLABLE: Final = "callable"

#: ``loss_mask`` given as a function of the record: returns a ``[T]`` tensor (any dtype; converted to the
#: dataset's mask dtype).
LossMaskFn = Callable[[CaptureRecord], torch.Tensor]


def check_layout(layout: str) -> str:
    """``layout`` if known, else :class:`DatasetConfigError`."""
    if layout not in LAYOUTS:
        raise DatasetConfigError(f"layout must be one of {LAYOUTS}, found {layout!r}")
    return layout


def check_loss_mask(loss_mask: str | LossMaskFn) -> str | LossMaskFn:
    """``loss_mask`` if valid, else :class:`DatasetConfigError`."""
    if isinstance(loss_mask, str) and loss_mask not in LOSS_MASKS:
        raise DatasetConfigError(f"loss_mask must be one of {LOSS_MASKS} or a callable, found {loss_mask!r}")
    if not isinstance(loss_mask, str) and not callable(loss_mask):
        raise DatasetConfigError(f"loss_mask must be one of {LOSS_MASKS} or a callable, found {loss_mask!r}")
    return loss_mask


def resolve_loss_mask(record: CaptureRecord, loss_mask: str | LossMaskFn) -> tuple[torch.Tensor, str]:
    """The ``[T]`` loss mask (int64 0/1) of ``record`` and which mask it is (``loss_mask_from``: ``"record"``,
    ``"all"``, ``"generated"`` or ``"callable"``).

    ``"auto"`` (the default): the record's own mask (its ``loss_mask_spans``, set by the request that made it,
    e.g. the assistant turns) when it carries one, else ``"all"`` -- the answer says which.  ``"record"``: the
    record's own mask; a record without one is refused (:class:`LayoutError`).  ``"all"``: every row.
    ``"generated"``: rows at sequence positions ``>= num_prompt_tokens`` (records captured with ``capture: "all"``
    or ``"output"``); a record without a prompt length (0) counts as all generated.  A callable gets the record and
    returns ``[T]`` values."""
    meta = record.meta
    t = meta.shape[0]
    if callable(loss_mask):
        mask = torch.as_tensor(loss_mask(record))
        if tuple(mask.shape) != (t,):
            raise LayoutError(
                f"record {meta.record_id!r}: the loss_mask function returned shape {tuple(mask.shape)}, expected ({t},)"
            )
        return mask.to(torch.int64), FROM_CALLABLE
    if loss_mask in ("auto", "record"):
        own = meta.loss_mask()
        if own is not None:
            return own, "record"
        if loss_mask == "record":
            raise LayoutError(
                f"record {meta.record_id!r} carries no loss mask (schema {meta.schema_version}, loss_mask_spans "
                "None): capture it with kv_transfer_params hs_capture.sample.loss_mask_spans, or ask for "
                "loss_mask='all', 'generated' or 'auto'"
            )
        return torch.ones(t, dtype=torch.int64), "all"
    if loss_mask == "all":
        return torch.ones(t, dtype=torch.int64), "all"
    positions = torch.arange(meta.start, meta.start + t, dtype=torch.int64)
    return (positions >= meta.num_prompt_tokens).to(torch.int64), "generated"


def make_loss_mask(record: CaptureRecord, loss_mask: str | LossMaskFn) -> torch.Tensor:
    """The ``[T]`` loss mask (int64 0/1) of ``record`` (:func:`resolve_loss_mask` without saying which)."""
    return resolve_loss_mask(record, loss_mask)[0]


def to_item(
    record: CaptureRecord,
    layout: str,
    loss_mask: str | LossMaskFn = "auto",
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """One training item of ``record`` in ``layout`` (see the module docstring for the keys and shapes).

    ``dtype``: cast the hidden states (``None`` keeps the record's dtype).  Raises :class:`LayoutError` when the
    record cannot take the layout."""
    meta = record.meta
    rows = record.hidden_states
    if tuple(rows.shape) != meta.shape:
        raise LayoutError(
            f"record {meta.record_id!r}: tensor shape {tuple(rows.shape)} differs from its metadata {meta.shape}"
        )
    t, p, c = meta.shape
    if dtype is not None:
        rows = rows.to(dtype)
    mask, mask_from = resolve_loss_mask(record, loss_mask)
    item: dict[str, Any] = {
        "record_id": meta.record_id,
        "layer_ids": torch.tensor(meta.layer_ids, dtype=torch.int64),
        "num_prompt_tokens": meta.num_prompt_tokens,
        "start": meta.start,
        "sample_id": meta.sample_id,
        "input_ids": torch.tensor(meta.token_ids, dtype=torch.int64),
        "loss_mask": mask,
        "loss_mask_from": mask_from,
    }
    if layout in ("eagle3", "speculators"):
        if p < 2:
            raise LayoutError(
                f"record {meta.record_id!r} has {p} plane (layer ids {list(meta.layer_ids)}); the {layout!r} layout "
                "needs the auxiliary layers and the base layer (>= 2 planes): capture with "
                "eagle_aux_hidden_state_layer_ids listing the aux layers and num_hidden_layers, or use "
                "layout='dflash' / 'planes'"
            )
        base = rows[:, p - 1].contiguous()
        aux = rows[:, : p - 1].reshape(t, (p - 1) * c)
        if layout == "eagle3":
            item["hidden_states"] = base
            item["aux_hidden_states"] = aux
        else:
            item["hidden_states"] = aux
            item["verifier_last_hidden_states"] = base
            item["lengths"] = torch.tensor([t], dtype=torch.int64)
            item["position_ids"] = torch.arange(meta.start, meta.start + t, dtype=torch.int64)
    elif layout == "dflash":
        item["hidden_states"] = rows.reshape(t, p * c)
    elif layout == "planes":
        item["hidden_states"] = rows
    else:
        raise DatasetConfigError(f"layout must be one of {LAYOUTS}, found {layout!r}")
    return item
