"""The lone-request read's whole-block gather (``ChunkPlan``) reads exactly what the per-token gather reads.

The CUDA path (``LoneReads``: pinned index buffer, side stream) is raced in tests/gpu; the index arithmetic and the
rearrangement of gathered blocks into token order are plain tensor code and are checked here, on CPU, for every
layout, kernel split, padding between blocks and token range.
"""

from __future__ import annotations

import ctypes
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hs_compat.core import ViewOrder, describe_capture_view, gather_rows, manager_slots
from vllm_hs_compat.core.layout import chunk_plan, row_table


def make_view(order: ViewOrder, physical: str, nb_k: int, n: int, p: int, c: int, pad: int) -> torch.Tensor:
    """A capture view of logical shape per ``order`` over a buffer laid out as ``physical``, random bits."""
    if order is ViewOrder.BLOCK_TOKEN_PLANE:
        shape, inner = (nb_k, n, p, c), (p * c, c, 1)
    else:
        shape = (nb_k, p, n, c)
        inner = (c, p * c, 1) if physical == "token_major" else (n * c, c, 1)  # LBNHC vs LBHNC
    page = n * p * c + pad
    backing = torch.randint(-(2**15), 2**15, (nb_k * page + 8,), dtype=torch.int16).view(torch.bfloat16)
    return backing.as_strided(shape, (page, *inner), storage_offset=8)


@settings(max_examples=80, deadline=None)
@given(
    order=st.sampled_from(list(ViewOrder)),
    physical=st.sampled_from(["token_major", "plane_major"]),
    kbs=st.sampled_from([1, 2, 4, 16]),
    ratio=st.sampled_from([1, 2, 4]),
    p=st.integers(1, 4),
    c=st.sampled_from([1, 3, 8]),
    pad=st.sampled_from([0, 0, 8, 5, -1]),  # -1: a gap of one block between blocks
    length=st.integers(1, 90),
    aligned=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_whole_block_gather_reads_the_requests_rows(
    order: ViewOrder,
    physical: str,
    kbs: int,
    ratio: int,
    p: int,
    c: int,
    pad: int,
    length: int,
    aligned: bool,
    seed: int,
) -> None:
    rng = random.Random(seed)
    bs = kbs * ratio
    length = -(-length // bs) * bs if aligned else length  # whole blocks from 0: the copy arranges the rows
    pad = kbs * p * c if pad < 0 else pad
    num_blocks = -(-length // bs) + 3
    cache = make_view(order, physical, num_blocks * ratio, kbs, p, c, pad)
    view = describe_capture_view(cache, num_planes=p, group_block_size=bs, order=order, hidden_size=c)
    table = row_table(cache, view)
    plan = chunk_plan(table, view) if table is not None else None
    if pad == 0 and c > 1:
        assert plan is not None, f"no chunk plan for a packed cache: {view.describe()}"
    if plan is None:
        return
    start = 0 if aligned else rng.randint(0, length - 1)
    blocks = rng.sample(range(num_blocks), -(-length // bs))
    first, need = start // bs, -(-length // bs)
    used = blocks[first:need]
    idx = torch.tensor(plan.indices(used), dtype=torch.int64)
    out = torch.empty((length - start, p, c), dtype=torch.bfloat16)
    plan.copy_into(idx, need - first, start - first * bs, length - start, out)
    slots = manager_slots("r", blocks, group_block_size=bs, num_tokens=length - start, start=start)
    want = gather_rows(cache, view, slots)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@settings(max_examples=30, deadline=None)
@given(
    physical=st.sampled_from(["token_major", "plane_major"]),
    ratio=st.sampled_from([1, 2, 4]),
    gap=st.booleans(),
    k=st.integers(1, 200),
    python_max=st.sampled_from([0, 512]),
)
def test_indices_stored_from_python_equal_the_tensor_computation(
    physical: str, ratio: int, gap: bool, k: int, python_max: int
) -> None:
    n = 16 // ratio
    cache = make_view(ViewOrder.BLOCK_PLANE_TOKEN, physical, 300 * ratio, n, 4, 8, n * 4 * 8 if gap else 0)
    view = describe_capture_view(cache, num_planes=4, group_block_size=16, order=ViewOrder.BLOCK_PLANE_TOKEN)
    table = row_table(cache, view)
    assert table is not None
    plan = chunk_plan(table, view)
    assert plan is not None
    used = random.Random(k).sample(range(300), k)
    buf = torch.full((k * len(plan.offsets),), -1, dtype=torch.int64)
    words = (ctypes.c_int64 * buf.numel()).from_address(buf.data_ptr())
    plan.fill(used, buf, words, python_max=python_max)
    assert buf.tolist() == plan.indices(used)
