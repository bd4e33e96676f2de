"""Turn a request's block ids into manager slots, with validation by request id.

A token at position ``t`` of a request lives at manager slot ``block_ids[t // bs] * bs + t % bs`` with
``bs`` the capture **group's** block size.  Never derive it from the request's position in the batch:
vLLM fills holes, reorders (V1) and re-sorts every step (V2).  Slots address the view through
:func:`vllm_hs_compat.core.layout.gather_rows`, which uses the view's own token axis (kernel-split safe).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import BlockCoverageError, BlockRangeError, SlotError
from .layout import CaptureView


def manager_slots(
    req_id: str,
    block_ids: Sequence[int],
    *,
    group_block_size: int,
    num_tokens: int,
    start: int = 0,
    num_manager_blocks: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Slots of tokens ``[start, start + num_tokens)`` of request ``req_id`` (int64, on ``device``).

    Raises :class:`BlockCoverageError` when the blocks cannot hold the tokens and
    :class:`BlockRangeError` when a needed block id is negative or ``>= num_manager_blocks``.
    """
    if group_block_size <= 0:
        raise SlotError(req_id, f"group block size must be positive, got {group_block_size}")
    if start < 0 or num_tokens < 0:
        raise SlotError(req_id, f"token range start={start} num_tokens={num_tokens} must be non-negative")
    end = start + num_tokens
    need = -(-end // group_block_size)
    if need > len(block_ids):
        raise BlockCoverageError(
            req_id,
            f"{len(block_ids)} blocks of {group_block_size} tokens cover {len(block_ids) * group_block_size} "
            f"tokens, but tokens up to {end} were requested. Use the capture group's block ids (the group "
            "whose layer_names hold the capture layer) and that group's block size.",
        )
    if num_tokens == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    first = start // group_block_size
    used = torch.as_tensor(list(block_ids[first:need]), dtype=torch.int64)
    lo, hi = int(used.min()), int(used.max())
    if lo < 0 or (num_manager_blocks is not None and hi >= num_manager_blocks):
        bad = lo if lo < 0 else hi
        limit = f"[0, {num_manager_blocks})" if num_manager_blocks is not None else "non-negative"
        raise BlockRangeError(
            req_id,
            f"block id {bad} lies outside the capture cache ({limit}). The block ids belong to another "
            "KV-cache group, or the cache was re-allocated.",
        )
    pos = torch.arange(start, end, dtype=torch.int64)
    slots = used[pos // group_block_size - first] * group_block_size + pos % group_block_size
    return slots if device is None else slots.to(device)


def request_slots(
    req_id: str,
    block_ids: Sequence[int],
    view: CaptureView,
    *,
    num_tokens: int,
    start: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """:func:`manager_slots` bounded by the capture view's size."""
    return manager_slots(
        req_id,
        block_ids,
        group_block_size=view.group_block_size,
        num_tokens=num_tokens,
        start=start,
        num_manager_blocks=view.num_manager_blocks,
        device=device,
    )
