"""The worker's slot checks in flight: a step's checks compared on the capture layer's device, their verdicts read
without the engine's thread ever waiting for the GPU.

A slot check (docs/connector.md, ``check_requests``) compares the slots a request's block ids give for the positions
written in a step with the slot mapping vLLM wrote the capture layer with.  Inside the forward, a ``bool()`` of a
device tensor would block the host until the GPU reached the capture layer -- every step a request is checked, and
under async scheduling (vLLM's default on CUDA) it takes away the host's one-step lead.  So the comparison of all
of a step's checks is queued on the writing stream (one index upload, :func:`~vllm_hs_compat.core.slots.
unwritten_slots`, one small copy back to pinned memory behind an event) and its verdicts are read later: each step,
those whose event completed (never waiting), and for a record about to be published, in the publisher's thread
(its rows were read after the step's write event, which the worker records after queueing the checks: by then the
verdict is there).  On CPU the verdict is read at once.  A failure is kept per request until its record takes it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hs_compat.core.capture import SlotCheck
from vllm_hs_compat.core.slots import unwritten_slots
from vllm_hs_compat.core.transfer import host_waited_event


@dataclass(eq=False)  # compared by identity (it holds tensors)
class _InFlight:
    """One step's checks: their verdicts (``[k, 3]`` int64 on the host, valid once ``event`` completed; no event:
    valid now) and the tensors the queued copies use."""

    checks: list[SlotCheck]
    verdicts: torch.Tensor
    event: Any
    keep: tuple[torch.Tensor, ...] = ()

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())


class SlotChecks:
    """Checks queued on the device and the failures their verdicts found, by request id.  ``on_failure(req_id,
    message)`` is called once per failed check (the worker counts and logs it).  Thread-safe: the engine's thread
    submits and polls, the publisher's takes a record's verdict."""

    def __init__(self, on_failure: Callable[[str, str], None]) -> None:
        self._on_failure = on_failure
        self._in_flight: list[_InFlight] = []
        self._failed: dict[str, str] = {}
        self._lock = threading.Lock()

    def submit(
        self, checks: Sequence[tuple[SlotCheck, int]], slots: torch.Tensor, written: torch.Tensor, *, num_slots: int
    ) -> None:
        """Queue the comparison of each check's slots with ``written`` (the step's slot mapping, on the capture
        layer's device) on the current stream.  ``slots``: every check's slots concatenated (host int64, validated:
        :func:`~vllm_hs_compat.core.slots.batch_slots`); each check comes with the offset of its first slot."""
        if not checks:
            return
        lengths = torch.tensor([c.num_tokens for c, _ in checks], dtype=torch.int64)
        starts = torch.tensor([at for _, at in checks], dtype=torch.int64)
        total = int(slots.numel())
        ranges = torch.repeat_interleave(torch.arange(len(checks)), lengths, output_size=total)
        packed = torch.cat([slots, ranges, starts])
        device = written.device
        if device.type != "cuda":
            verdicts = unwritten_slots(packed[:total], packed[total : 2 * total], packed[2 * total :], written,
                                       num_slots=num_slots)  # fmt: skip
            flight = _InFlight([c for c, _ in checks], verdicts, None)
        else:
            host = packed.pin_memory()
            on_device = host.to(device, non_blocking=True)
            found = unwritten_slots(on_device[:total], on_device[total : 2 * total], on_device[2 * total :],
                                    written, num_slots=num_slots)  # fmt: skip
            verdicts = torch.empty(found.shape, dtype=torch.int64, pin_memory=True)
            verdicts.copy_(found, non_blocking=True)
            event = host_waited_event()  # the publisher may wait for it (take(wait=True))
            event.record()
            flight = _InFlight([c for c, _ in checks], verdicts, event, (host, on_device, found))
        with self._lock:
            self._in_flight.append(flight)
            self._read_ready()

    def fail(self, req_id: str, message: str) -> None:
        """A check that failed before it could be queued (its block ids cannot address the positions)."""
        with self._lock:
            self._failed[req_id] = message
        self._on_failure(req_id, message)

    def poll(self) -> None:
        """Read the verdicts whose copy completed; never waits."""
        with self._lock:
            self._read_ready()

    def take(self, req_id: str, *, wait: bool) -> str | None:
        """The failure found for ``req_id`` (handed out once), or None.  ``wait``: first wait for the verdicts
        still in flight that check it (the publisher's thread); else only those ready are read.  The wait holds no
        lock: the engine's thread submits and polls meanwhile (it never waits for the GPU, not even behind a
        publisher that does)."""
        if wait:
            with self._lock:
                mine = [f for f in self._in_flight if any(c.req_id == req_id for c in f.checks)]
            for flight in mine:
                if flight.event is not None:
                    flight.event.synchronize()
        with self._lock:
            self._read_ready()  # the flights waited for above are ready now (read once, by whichever thread)
            return self._failed.pop(req_id, None)

    def pending(self) -> int:
        """Steps whose verdicts are not read yet."""
        with self._lock:
            return len(self._in_flight)

    def _read_ready(self) -> None:
        ready: list[_InFlight] = []
        still: list[_InFlight] = []
        for flight in self._in_flight:
            (ready if flight.ready() else still).append(flight)
        self._in_flight = still
        for flight in ready:
            self._read(flight)

    def _read(self, flight: _InFlight) -> None:
        for check, (missing, first, slot) in zip(flight.checks, flight.verdicts.tolist(), strict=True):
            if missing:
                message = (
                    f"position {check.start + first} maps to slot {slot}, which vLLM did not write in this step "
                    f"({missing} of {check.num_tokens} positions missing)"
                )
                self._failed[check.req_id] = message
                self._on_failure(check.req_id, message)
