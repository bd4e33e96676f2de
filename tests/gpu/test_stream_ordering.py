"""CUDA stream-ordering stress for copy_rows_async (runs where CUDA exists; skipped elsewhere).

Each case races the side-stream copy against the compute stream: the side stream is held back with a
spin kernel while the compute stream (a) keeps writing hidden states and (b) churns its caching allocator
with garbage.  The safe path must return exactly the rows written; two negative controls -- the index
tensor made on the compute stream, and no wait on the "written" event -- must be caught corrupting data,
which proves the harness can see the bug class at all.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from vllm_hs_compat.core import ViewOrder, describe_capture_view, gather_rows, manager_slots
from vllm_hs_compat.core.transfer import copy_requests_async, copy_rows_async

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_views import NB, N, P, churn, expected, make_cache, write  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")

SPIN = 2_000_000  # cycles the side stream is held back


def run(order: ViewOrder, mode: str, iters: int = 40, path: str = "staged") -> int:
    cache = make_cache(order)
    view = describe_capture_view(cache, num_planes=P, group_block_size=N, order=order)
    gen = torch.Generator().manual_seed(0)
    bad = 0
    for it in range(iters):
        tokens = 256
        blocks = (torch.randperm(NB - 1, generator=gen)[: tokens // N] + 1).tolist()
        slots = manager_slots(f"r{it}", blocks, group_block_size=N, num_tokens=tokens)
        value = float(it % 50 + 1)
        side = torch.cuda.Stream()
        # Device copies of the slots made up front: a copy from pageable memory blocks the host until its
        # stream drains, which would serialise the race away.
        slots_dev = slots.cuda()
        with torch.cuda.stream(side):
            side_idx = slots.to("cuda")
        torch.cuda.synchronize()
        if mode == "unsafe_no_wait":
            # The compute stream writes late; a copy that does not wait for the write reads stale rows.
            with torch.cuda.stream(side):
                torch.cuda._sleep(SPIN // 4)
            torch.cuda._sleep(SPIN)
            write(cache, order, slots_dev, value)
            with torch.cuda.stream(side):
                got = gather_rows(cache, view, side_idx).cpu()
            torch.cuda.synchronize()
        elif mode == "unsafe_compute_stream_index":
            write(cache, order, slots_dev, value)
            idx = slots.cuda()  # born on the compute stream ...
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(side):
                side.wait_event(ready)
                torch.cuda._sleep(SPIN)
                rows = gather_rows(cache, view, idx)  # ... read later on the side stream
            del idx  # freed to the compute stream's pool while the side stream still needs it
            churn(tokens)
            torch.cuda.synchronize()
            got = rows.cpu()
        else:
            torch.cuda._sleep(SPIN // 4)
            write(cache, order, slots_dev, value)
            with torch.cuda.stream(side):
                torch.cuda._sleep(SPIN)  # the copy is held back behind the churn below
            if mode == "safe_batch":  # the step's batched read: this request among others
                other = (torch.randperm(NB - 1, generator=gen)[:3] + 1).tolist()
                batch = copy_requests_async(
                    cache,
                    view,
                    [("o1", other, 0, 40), (f"r{it}", blocks, 0, tokens), ("o2", other, 5, 3)],
                    stream=side,
                    path=path,
                )
                pending = batch[1]
                assert not isinstance(pending, Exception)
            else:
                pending = copy_rows_async(cache, view, slots, stream=side, path=path)
            churn(tokens)
            write(cache, order, torch.tensor([0], device="cuda"), -1.0)  # the compute stream keeps working
            got = pending.wait()
        if not torch.equal(got, expected(value, tokens)):
            bad += 1
    return bad


@pytest.mark.parametrize("path", ["staged", "direct"])
@pytest.mark.parametrize("mode", ["safe", "safe_batch"])
@pytest.mark.parametrize("order", list(ViewOrder))
def test_side_stream_copy_returns_exactly_the_written_rows(order: ViewOrder, mode: str, path: str) -> None:
    assert run(order, mode, path=path) == 0


@pytest.mark.parametrize("order", list(ViewOrder))
@pytest.mark.parametrize("mode", ["unsafe_no_wait", "unsafe_compute_stream_index"])
def test_negative_controls_are_caught(order: ViewOrder, mode: str) -> None:
    # If these ever read clean the stress no longer exercises the race: the safe test proves nothing.
    assert run(order, mode) > 0
