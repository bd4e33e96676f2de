"""The connector's read path (``RowReader``: mark the capture write, read in a later step) under stream races.

vLLM writes the capture layer on whatever stream runs the model, which need not be the stream that is
current when the connector issues its reads a step later.  The writer here is a separate stream held back
by a spin kernel; the reader issues from the default stream while the allocator churns.  With the write
marked (``mark_written`` under the writer's stream, as ``save_kv_layer`` does) the rows must be exact, for
both view orders and a kernel-split view; the negative control (no mark: the copy orders itself after the
current stream only) must be caught reading stale rows.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from vllm_hs_compat.core import ViewOrder, describe_capture_view, manager_slots
from vllm_hs_compat.core.transfer import RowReader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_views import NB, N, P, expected, make_cache, write  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")

SPIN = 2_000_000


def run(order: ViewOrder, split: int, mark: bool, iters: int = 30) -> int:
    cache = make_cache(order, split)
    view = describe_capture_view(cache, num_planes=P, group_block_size=N, order=order)
    reader = RowReader(cache, view)
    writer = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(1)
    bad = 0
    for it in range(iters):
        tokens = 200
        blocks = (torch.randperm(NB - 1, generator=gen)[: -(-tokens // N)] + 1).tolist()
        slots = manager_slots(f"r{it}", blocks, group_block_size=N, num_tokens=tokens).cuda()
        value = float(it % 50 + 1)
        torch.cuda.synchronize()
        with torch.cuda.stream(writer):  # the model's stream: late, then the capture write
            torch.cuda._sleep(SPIN)
            write(cache, order, slots, value)
            if mark:
                reader.mark_written()  # what save_kv_layer does, on the writing stream
        # next step, on another (current) stream: the connector reads the finished request's rows
        pending = reader.read(f"r{it}", blocks, start=0, num_tokens=tokens)
        for _ in range(4):  # the caching allocator hands freed memory out again
            junk = torch.zeros((tokens,), dtype=torch.int64, device="cuda")
            junk += 0
            del junk
        got = pending.wait()
        torch.cuda.synchronize()
        if not torch.equal(got, expected(value, tokens)):
            bad += 1
    return bad


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("order", list(ViewOrder))
def test_marked_write_orders_the_read(order: ViewOrder, split: int) -> None:
    assert run(order, split, mark=True) == 0


@pytest.mark.parametrize("order", list(ViewOrder))
def test_negative_control_unmarked_write_is_caught(order: ViewOrder) -> None:
    # Without the mark the copy waits only for the current stream: it must be seen reading stale rows,
    # or the stress does not exercise the race and the test above proves nothing.
    assert run(order, 1, mark=False) > 0
