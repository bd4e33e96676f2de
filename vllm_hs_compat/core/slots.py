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


def check_blocks(
    req_id: str,
    block_ids: Sequence[int],
    *,
    group_block_size: int,
    num_tokens: int,
    start: int = 0,
    num_manager_blocks: int | None = None,
) -> tuple[int, int]:
    """Validate that ``block_ids`` address tokens ``[start, start + num_tokens)``; returns the range
    ``[first, need)`` of block-list entries they use.  Raises the errors :func:`manager_slots` documents."""
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
    first = start // group_block_size
    if num_tokens == 0:
        return first, first
    used = block_ids[first:need]
    lo, hi = min(used), max(used)
    if lo < 0 or (num_manager_blocks is not None and hi >= num_manager_blocks):
        bad = lo if lo < 0 else hi
        limit = f"[0, {num_manager_blocks})" if num_manager_blocks is not None else "non-negative"
        raise BlockRangeError(
            req_id,
            f"block id {bad} lies outside the capture cache ({limit}). The block ids belong to another "
            "KV-cache group, or the cache was re-allocated.",
        )
    return first, need


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
    first, need = check_blocks(
        req_id,
        block_ids,
        group_block_size=group_block_size,
        num_tokens=num_tokens,
        start=start,
        num_manager_blocks=num_manager_blocks,
    )
    if num_tokens == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    bs = group_block_size
    used = torch.tensor(block_ids[first:need], dtype=torch.int64)
    head = start - first * bs
    slots = (used.view(-1, 1) * bs + _offsets(bs)).view(-1)[head : head + num_tokens]
    return slots if device is None else slots.to(device)


_OFFSETS: dict[int, torch.Tensor] = {}


def _offsets(bs: int) -> torch.Tensor:
    """``arange(bs)`` (int64, CPU), cached: read-only."""
    ar = _OFFSETS.get(bs)
    if ar is None:
        ar = _OFFSETS[bs] = torch.arange(bs, dtype=torch.int64)
    return ar


def batch_slots(
    requests: Sequence[tuple[str, Sequence[int], int, int]],
    *,
    group_block_size: int,
    num_manager_blocks: int | None = None,
) -> tuple[torch.Tensor, list[int | SlotError]]:
    """Slots of many requests' token ranges ``(req_id, block_ids, start, num_tokens)``, concatenated (int64,
    CPU), with a few whole-batch tensor operations instead of several per request.

    Returns the slots and, per request, the offset of its first slot in them -- or the :class:`SlotError`
    that request raised (its slots are left out; the others are unaffected).
    """
    bs = group_block_size
    used: list[int] = []
    shift: list[int] = []
    lengths: list[int] = []
    where: list[int | SlotError] = []
    total = 0
    for req_id, block_ids, start, num_tokens in requests:
        try:
            first, need = check_blocks(
                req_id,
                block_ids,
                group_block_size=bs,
                num_tokens=num_tokens,
                start=start,
                num_manager_blocks=num_manager_blocks,
            )
        except SlotError as e:
            where.append(e)
            continue
        where.append(total)
        if num_tokens == 0:
            continue
        # Slot of output position ``total + i`` is ``expanded[total + i + shift]``.
        shift.append(len(used) * bs + start - first * bs - total)
        lengths.append(num_tokens)
        used.extend(block_ids[first:need])
        total += num_tokens
    if total == 0:
        return torch.empty(0, dtype=torch.int64), where
    expanded = (torch.tensor(used, dtype=torch.int64).view(-1, 1) * bs + _offsets(bs)).view(-1)
    if len(lengths) == 1:
        return expanded[shift[0] : shift[0] + total], where
    index = torch.repeat_interleave(
        torch.tensor(shift, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64), output_size=total
    )
    index += torch.arange(total, dtype=torch.int64)
    return expanded[index], where


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


def unwritten_slots(
    slots: torch.Tensor, ranges: torch.Tensor, starts: torch.Tensor, written: torch.Tensor, *, num_slots: int
) -> torch.Tensor:
    """Which of ``slots`` a step's slot mapping ``written`` lacks, per range of consecutive slots.

    ``slots``: int64, in ``[0, num_slots)`` (validated manager slots); ``ranges[j]``: the range slot ``j`` belongs
    to (``0 .. k-1``, ascending); ``starts[i]``: the index in ``slots`` where range ``i`` begins; ``written``:
    vLLM's slot mapping of the step (may hold its padding slot -1; values outside ``[-1, num_slots)`` count as
    padding).  Returns int64 ``[k, 3]``: per range the number of its slots ``written`` lacks, the offset of the
    first of them within the range and that slot (where none is missing: 0, 0 and the range's first slot; an empty
    range's slot is any).  Tensor operations on ``slots``' device only, no host synchronization: on CUDA the
    result is ready once the stream reaches it.
    """
    device = slots.device
    k, total = int(starts.numel()), int(slots.numel())
    seen = torch.zeros(num_slots + 2, dtype=torch.bool, device=device)  # slot s at s + 1; -1 (padding) at 0
    seen.index_fill_(0, written.reshape(-1).to(torch.int64).clamp(-1, num_slots) + 1, True)
    missing = ~seen.index_select(0, slots + 1)
    count = torch.zeros(k, dtype=torch.int64, device=device).index_add_(0, ranges, missing.to(torch.int64))
    at = torch.where(missing, torch.arange(total, dtype=torch.int64, device=device), total)
    first = torch.full((k,), total, dtype=torch.int64, device=device).scatter_reduce_(0, ranges, at, "amin")
    first = torch.where(count > 0, first, starts)
    slot = slots.index_select(0, first.clamp(max=total - 1)) if total else torch.zeros_like(first)
    return torch.stack([count, first - starts, slot], dim=1)
