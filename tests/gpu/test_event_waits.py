"""A host thread waiting for the GPU sleeps instead of spinning a core (runs where CUDA exists; skipped elsewhere).

The connector's copies' thread waits for each step read's event (``PendingRows.wait``) and a publisher for its slot
checks' verdicts (``SlotChecks.take(wait=True)``), beside the engine's own threads.  With CUDA's default schedule
(more cores than contexts: spin) such a wait burns a core for as long as the GPU is busy; the events these threads
wait for are made with blocking sync (``core.transfer.host_waited_event``), so the wait costs the thread almost no
CPU time.  Each case holds the GPU ~1 s ahead of the event and measures the waiting thread's CPU time; the control
waits the same way on a plain event, which must spin (else the cases could not tell the two apart).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from vllm_hs_compat.connector.slot_checks import SlotChecks
from vllm_hs_compat.core import ViewOrder, describe_capture_view, manager_slots
from vllm_hs_compat.core.capture import SlotCheck
from vllm_hs_compat.core.transfer import PinnedIndexPool, copy_rows_async, host_waited_event, row_table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_views import N, P, expected, make_cache, write  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")

_cuda: Any = torch.cuda  # torch.cuda._sleep is untyped
BUSY = 2_000_000_000  # cycles of GPU time queued ahead of the event (~1 s)


def _timed(wait: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of ``wait()``."""
    t0, c0 = time.perf_counter(), time.thread_time()
    wait()
    return time.perf_counter() - t0, time.thread_time() - c0


def test_control_a_plain_event_spins_while_the_gpu_is_busy() -> None:
    torch.cuda.synchronize()
    _cuda._sleep(BUSY)
    plain = _cuda.Event()
    plain.record()
    wall, cpu = _timed(plain.synchronize)
    assert wall > 0.3 and cpu > 0.5 * wall, (wall, cpu)


def test_a_host_waited_event_sleeps_while_the_gpu_is_busy() -> None:
    torch.cuda.synchronize()
    _cuda._sleep(BUSY)
    event = host_waited_event()
    event.record()
    wall, cpu = _timed(event.synchronize)
    assert wall > 0.3 and cpu < 0.1 * wall, (wall, cpu)


def test_the_copies_thread_sleeps_in_a_step_reads_wait_and_gets_the_rows() -> None:
    order = ViewOrder.BLOCK_TOKEN_PLANE
    cache = make_cache(order)
    view = describe_capture_view(cache, num_planes=P, group_block_size=N, order=order)
    blocks = list(range(1, 17))
    slots = manager_slots("r", blocks, group_block_size=N, num_tokens=256)
    table = row_table(cache, view)  # made once per cache, where the connector binds it
    write(cache, order, slots.cuda(), 3.0)
    pool = PinnedIndexPool()
    copy_rows_async(cache, view, slots, table=table, pool=pool).wait()  # warm: a first pinned allocation syncs
    torch.cuda.synchronize()
    _cuda._sleep(BUSY)  # the "written" point of the read comes after ~1 s of GPU work
    t0 = time.perf_counter()
    pending = copy_rows_async(cache, view, slots, table=table, pool=pool)
    issued = time.perf_counter() - t0
    wall, cpu = _timed(pending.wait)
    assert issued < 0.3 and wall > 0.3 and cpu < 0.1 * wall, (issued, wall, cpu)
    assert torch.equal(pending.rows, expected(3.0, 256))


def test_a_publisher_sleeps_in_its_wait_for_a_slot_check() -> None:
    checks = SlotChecks(lambda req, msg: None)
    slots = torch.arange(32, 52)
    written = slots.cuda()  # before the busy GPU: an upload from pageable memory waits for its stream
    check = [(SlotCheck("r", (2, 3), 0, 20), 0)]
    checks.submit(check, slots, written, num_slots=4096)  # warm: a first pinned allocation syncs
    checks.take("r", wait=True)
    torch.cuda.synchronize()
    _cuda._sleep(BUSY)
    checks.submit(check, slots, written, num_slots=4096)
    wall, cpu = _timed(lambda: checks.take("r", wait=True))
    assert wall > 0.3 and cpu < 0.1 * wall, (wall, cpu)
    assert checks.pending() == 0
