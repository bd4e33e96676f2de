"""The connector's slot checks on the capture layer's GPU (runs where CUDA exists; skipped elsewhere).

``SlotChecks.submit`` queues a step's checks on the writing stream: the engine's thread must not wait for the GPU
there (inside the forward a wait blocks the host until the GPU reaches the capture layer, and under async
scheduling takes away the host's one-step lead).  Held with torch's sync debug mode set to raise; its control: the
check as the connector ran it before (``bool()`` of a device comparison) raises under the same mode.  The verdicts
must be those of the host reading: a check whose slot vLLM did not write names it, its neighbour passes; while the
GPU is still busy with work queued before the check, ``poll`` returns without a verdict and the publisher's
``take(wait=True)`` waits for it -- without holding the engine's thread, which submits and polls meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from vllm_hs_compat.connector.slot_checks import SlotChecks
from vllm_hs_compat.core.capture import SlotCheck

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)")

BLOCK, NUM_SLOTS = 16, 4096
_cuda: Any = torch.cuda  # torch.cuda._sleep is untyped


def _check(req: str, blocks: tuple[int, ...], start: int, n: int) -> tuple[SlotCheck, torch.Tensor]:
    slots = torch.tensor([blocks[(start + i) // BLOCK] * BLOCK + (start + i) % BLOCK for i in range(n)])
    return SlotCheck(req, blocks, start, n), slots


@contextmanager
def raise_on_sync() -> Iterator[None]:
    """torch raises on any operation that waits for the GPU (tensors are made before: an upload from pageable
    memory waits)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _step() -> tuple[list[tuple[SlotCheck, int]], torch.Tensor, torch.Tensor]:
    """Two checks (each with the offset of its slots in the step's concatenation), their slots, the slot mapping."""
    bad, bad_slots = _check("bad", (3, 7), 0, 20)
    good, good_slots = _check("good", (4, 9), 0, 20)
    written = torch.cat([bad_slots, good_slots, torch.full((24,), -1)])
    written[5] = 5000  # "bad" position 5 written elsewhere (garbage past the cache: treated as padding)
    return [(bad, 0), (good, 20)], torch.cat([bad_slots, good_slots]), written.cuda()


def test_submit_never_waits_for_the_gpu_and_the_verdicts_name_the_unwritten_slot() -> None:
    failures: list[tuple[str, str]] = []
    checks = SlotChecks(lambda req, msg: failures.append((req, msg)))
    step = _step()
    with raise_on_sync():
        checks.submit(*step, num_slots=NUM_SLOTS)  # raises if it waited
    assert checks.take("good", wait=True) is None
    msg = checks.take("bad", wait=True)
    assert msg == "position 5 maps to slot 53, which vLLM did not write in this step (1 of 20 positions missing)"
    assert failures == [("bad", msg)] and checks.pending() == 0


def test_control_the_old_check_waits_and_the_mode_catches_it() -> None:
    _, slots, written = _step()
    ours = slots[:20].cuda()
    with raise_on_sync(), pytest.raises(RuntimeError, match="synchroniz"):
        bool((~torch.isin(ours, written)).any())


def test_a_busy_gpu_leaves_the_verdict_in_flight_until_the_publisher_waits() -> None:
    checks = SlotChecks(lambda req, msg: None)
    step = _step()
    _cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued before the check on the same stream
    t0 = time.perf_counter()
    checks.submit(*step, num_slots=NUM_SLOTS)
    checks.poll()
    assert time.perf_counter() - t0 < 0.5 and checks.pending() == 1  # nothing waited, the verdict not here yet
    assert checks.take("bad", wait=True) is not None and checks.pending() == 0


def test_a_publisher_waiting_for_a_verdict_never_holds_the_engines_thread() -> None:
    checks = SlotChecks(lambda req, msg: None)
    step = _step()
    _cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued before the check
    checks.submit(*step, num_slots=NUM_SLOTS)
    got: list[str | None] = []
    publisher = threading.Thread(target=lambda: got.append(checks.take("bad", wait=True)))
    publisher.start()
    time.sleep(0.1)  # the publisher is in its wait for the GPU
    t0 = time.perf_counter()
    checks.submit(*step, num_slots=NUM_SLOTS)  # the engine's next step, and its poll
    checks.poll()
    held = time.perf_counter() - t0
    assert publisher.is_alive() and held < 0.3, held  # control: with the wait under the lock, ~0.9 s
    publisher.join(10)
    assert got and got[0] is not None and "position 5" in got[0]
