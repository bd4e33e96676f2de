"""A publisher waiting for a step's slot-check verdicts must not hold the engine's thread: ``SlotChecks.take(wait=
True)`` waits for the verdict's event without the lock the engine's ``submit`` and ``poll`` take.  On CPU the event
is a stand-in whose ``synchronize`` blocks until released (a CUDA event the GPU has not reached); the same property
on a real CUDA stream is ``tests/gpu/test_slot_checks_on_device.py``."""

from __future__ import annotations

import threading
import time

import torch

from vllm_hs_compat.connector.slot_checks import SlotChecks, _InFlight
from vllm_hs_compat.core.capture import SlotCheck


class _Unreached:
    """An event the device has not reached until ``reached`` is set: ``query`` False, ``synchronize`` blocks."""

    def __init__(self) -> None:
        self.reached = threading.Event()

    def query(self) -> bool:
        return self.reached.is_set()

    def synchronize(self) -> None:
        self.reached.wait(10)


def test_the_engines_submit_and_poll_go_on_while_a_publisher_waits_for_a_verdict() -> None:
    failures: list[str] = []
    checks = SlotChecks(lambda req, msg: failures.append(req))
    event = _Unreached()
    verdict = torch.tensor([[1, 5, 53]], dtype=torch.int64)  # one position missing: "bad" fails
    checks._in_flight.append(_InFlight([SlotCheck("bad", (3, 7), 0, 20)], verdict, event))
    got: list[str | None] = []
    publisher = threading.Thread(target=lambda: got.append(checks.take("bad", wait=True)), daemon=True)
    publisher.start()
    time.sleep(0.1)  # the publisher is in its wait
    t0 = time.perf_counter()
    slots = torch.arange(16, dtype=torch.int64)  # the engine's next step: a check of 16 written slots, on CPU
    checks.submit([(SlotCheck("next", (0,), 0, 16), 0)], slots, slots.clone(), num_slots=4096)
    checks.poll()
    held = time.perf_counter() - t0
    assert publisher.is_alive() and not got  # still waiting for the verdict
    assert held < 0.5, f"the engine's thread waited {held:.2f} s behind the publisher"  # old: until released (10 s)
    assert checks.take("next", wait=False) is None  # the next step's verdict was read meanwhile (it passed)
    event.reached.set()
    publisher.join(5)
    assert got and got[0] is not None and got[0].startswith("position 5 maps to slot 53")
    assert failures == ["bad"] and checks.pending() == 0
