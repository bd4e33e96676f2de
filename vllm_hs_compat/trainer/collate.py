"""Batching items of different lengths: right-pad along the token axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm_hs_compat.errors import DatasetConfigError

#: Keys of an item whose first axis is the token axis (padded); ``lengths`` is concatenated.
TOKEN_KEYS = (
    "input_ids",
    "loss_mask",
    "hidden_states",
    "aux_hidden_states",
    "verifier_last_hidden_states",
    "position_ids",
)


def collate_padded(items: Sequence[dict[str, Any]], pad_token_id: int = 0) -> dict[str, Any]:
    """Stack items of any layout into a batch, right-padding every token-axis tensor to the longest item.

    Returns the item keys with a leading batch axis (``[B, T_max, ...]``; ``input_ids`` padded with
    ``pad_token_id``, everything else with 0, so ``loss_mask`` is 0 on padding), ``lengths`` ``[B]``,
    ``attention_mask`` ``[B, T_max]`` (1 on real tokens), and the per-record fields as lists (``record_id``,
    ``sample_id``, ``loss_mask_from``, ``num_prompt_tokens``, ``start``) or a list of tensors (``layer_ids``).
    Use it as ``DataLoader(ds, batch_size=8, collate_fn=collate_padded)``."""
    if not items:
        raise DatasetConfigError("collate_padded got an empty batch")
    keys = set(items[0])
    for it in items[1:]:
        if set(it) != keys:
            raise DatasetConfigError(
                f"items of one batch must share their keys (one layout), found {sorted(keys)} and {sorted(it)}"
            )
    lengths = [int(it["input_ids"].shape[0]) for it in items]
    t_max = max(lengths)
    out: dict[str, Any] = {}
    for key in TOKEN_KEYS:
        if key not in keys:
            continue
        first = items[0][key]
        batch = torch.full(
            (len(items), t_max, *first.shape[1:]),
            pad_token_id if key == "input_ids" else 0,
            dtype=first.dtype,
        )
        for i, it in enumerate(items):
            batch[i, : lengths[i]] = it[key]
        out[key] = batch
    out["lengths"] = torch.tensor(lengths, dtype=torch.int64)
    out["attention_mask"] = (torch.arange(t_max)[None, :] < out["lengths"][:, None]).to(torch.int64)
    for key in ("record_id", "sample_id", "loss_mask_from", "num_prompt_tokens", "start", "layer_ids"):
        if key in keys:
            out[key] = [it[key] for it in items]
    return out
