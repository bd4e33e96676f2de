"""The batched read (one step's records at once) against the per-request path, on CPU."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hs_compat.core import ViewOrder, describe_capture_view, gather_rows, manager_slots
from vllm_hs_compat.core.layout import row_table
from vllm_hs_compat.core.slots import batch_slots
from vllm_hs_compat.core.transfer import RowReader, copy_requests_async
from vllm_hs_compat.errors import BlockCoverageError, BlockRangeError, SlotError


@settings(max_examples=80, deadline=None)
@given(
    bs=st.sampled_from([1, 3, 16]),
    ranges=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=7),
    seed=st.integers(0, 2**31),
)
def test_batch_slots_equal_per_request_slots(bs: int, ranges: list[tuple[int, int]], seed: int) -> None:
    rng = random.Random(seed)
    nmb = 200
    requests = []
    for k, (start, num) in enumerate(ranges):
        need = -(-(start + num) // bs)
        blocks = [rng.randrange(nmb) for _ in range(need + rng.choice([0, 0, 1]))]
        if rng.random() < 0.15 and blocks:
            blocks = blocks[:-1] if num else blocks  # too few blocks: this request alone fails
        if rng.random() < 0.1 and num and start // bs < len(blocks):
            blocks[start // bs] = nmb + 3  # out of range: this request alone fails
        requests.append((f"r{k}", blocks, start, num))
    slots, where = batch_slots(requests, group_block_size=bs, num_manager_blocks=nmb)
    assert slots.dtype == torch.int64
    total = 0
    for (rid, blocks, start, num), at in zip(requests, where, strict=True):
        try:
            want = manager_slots(rid, blocks, group_block_size=bs, num_tokens=num, start=start, num_manager_blocks=nmb)
        except SlotError as e:
            assert isinstance(at, type(e)) and str(at) == str(e)
            continue
        assert at == total
        assert torch.equal(slots[total : total + num], want)
        total += num
    assert slots.numel() == total


def test_one_bad_request_fails_alone() -> None:
    cache = torch.arange(6 * 4 * 2 * 3, dtype=torch.float32).view(6, 4, 2, 3)
    view = describe_capture_view(cache, num_planes=2, group_block_size=4, order=ViewOrder.BLOCK_TOKEN_PLANE)
    got = copy_requests_async(
        cache, view, [("a", [5, 2], 0, 6), ("short", [1], 0, 6), ("far", [9], 0, 2), ("b", [3], 1, 2)]
    )
    assert isinstance(got[1], BlockCoverageError) and isinstance(got[2], BlockRangeError)
    a, b = got[0], got[3]
    assert not isinstance(a, SlotError) and not isinstance(b, SlotError)
    assert a.done() and torch.equal(a.wait(), torch.cat([cache[5], cache[2, :2]]))
    assert torch.equal(b.wait(), cache[3, 1:3])
    reader = RowReader(cache, view)
    many = reader.read_many([("a", [5, 2], 0, 6)])[0]
    assert not isinstance(many, SlotError)
    assert torch.equal(many.wait(), reader.read("a", [5, 2], start=0, num_tokens=6).wait())


@pytest.mark.parametrize(
    ("order", "physical", "identity", "per_token"),
    [
        (ViewOrder.BLOCK_TOKEN_PLANE, "packed", True, 1),
        (ViewOrder.BLOCK_PLANE_TOKEN, "token_major", True, 1),  # LBNHC
        (ViewOrder.BLOCK_PLANE_TOKEN, "plane_major", False, 4),  # LBHNC
    ],
)
@pytest.mark.parametrize("split", [1, 4])
def test_row_table_describes_every_layout(
    order: ViewOrder, physical: str, identity: bool, per_token: int, split: int
) -> None:
    """vLLM's layouts read through the row table (one index_select), not the indexed fallback."""
    nb, n, p, c = 5 * split, 16 // split, 4, 8
    if physical == "plane_major":
        cache = torch.randn(nb, p, n, c)
    else:
        cache = torch.randn(nb, n, p, c)
        cache = cache if order is ViewOrder.BLOCK_TOKEN_PLANE else cache.permute(0, 2, 1, 3)
    view = describe_capture_view(cache, num_planes=p, group_block_size=16, order=order)
    table = row_table(cache, view)
    assert table is not None and table.identity is identity and table.rows_per_token == per_token
    slots = manager_slots("r", [4, 1, 3], group_block_size=16, num_tokens=40, start=3)
    blk, off = slots // n, slots % n
    want = cache[blk, off] if order is ViewOrder.BLOCK_TOKEN_PLANE else cache[blk, :, off]
    assert torch.equal(gather_rows(cache, view, slots), want)
