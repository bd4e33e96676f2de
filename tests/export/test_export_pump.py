"""The producer's pump over UCX's TCP transport (two-sided: a READ is answered only while the producer's process
progresses UCX, and the pump is what progresses it): a claim wakes the idle pump at once, and an idle producer
does not spin.  Each case runs in its own processes (``hsx_pump_probe.py``), because UCX reads ``UCX_TLS`` once
per process."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hsx_harness import NIXL_REASON, run_script  # noqa: E402

from vllm_hs_compat import errors as E  # noqa: E402
from vllm_hs_compat.export import ExportProducer, nixl_available  # noqa: E402


def _probe(*args: str) -> dict[str, Any]:
    return run_script("hsx_pump_probe.py", list(args), {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}, 90)


@pytest.fixture(scope="module")
def probes() -> Iterator[dict[str, dict[str, Any]]]:
    if not nixl_available():
        pytest.skip(NIXL_REASON)
    with ThreadPoolExecutor(3) as ex:  # the fixes and their negative controls side by side: ~8 s together
        fixed, deaf, as_read = ex.submit(_probe), ex.submit(_probe, "--deaf"), ex.submit(_probe, "--inline-as-read")
        yield {"fixed": fixed.result(), "deaf": deaf.result(), "inline_as_read": as_read.result()}


@pytest.mark.nixl
def test_a_claim_wakes_the_idle_pump_so_a_tcp_read_is_answered_at_once(probes: dict[str, dict[str, Any]]) -> None:
    # the pump waits 1.5 s when idle; a fetch after the hot window needs the pump to answer its READ
    assert probes["fixed"]["lone_fetch_s"] < 0.5, probes
    assert probes["fixed"]["pump_errors"] == 0
    # negative control: the same fetch when a claim does not wake the pump waits for the pump's next poll (its
    # 1.5 s idle wait began at r0's release, a release keeps nothing hot: 1.5 - 0.8 s later)
    assert probes["deaf"]["lone_fetch_s"] > 0.5, probes


@pytest.mark.nixl
def test_an_idle_producer_does_not_spin_and_a_claimed_one_polls(probes: dict[str, dict[str, Any]]) -> None:
    fixed = probes["fixed"]
    # every lease released, no request for over the hot window: the pump waits (below 5% of a core, the whole
    # process: pump, control plane and the consumer)
    assert fixed["idle_cpu"] < 0.05, fixed
    # control: the measurement sees a polling pump -- a claimed lease, never read, keeps it polling back to back
    assert fixed["claimed_cpu"] > max(0.05, 3 * fixed["idle_cpu"]), fixed


@pytest.mark.nixl
def test_a_lease_answered_with_its_bytes_leaves_the_pump_waiting(probes: dict[str, dict[str, Any]]) -> None:
    # a small record fetched by id came in its claim's answer: no READ will come, so its claimed lease does not
    # make the pump poll (it would take the CPU and the GIL the control plane answers with)
    fixed = probes["fixed"]
    assert fixed["inline_claimed_cpu"] < 0.05, fixed
    # negative control: the same lease counted as one a READ may come for (as before) keeps the pump polling
    control = probes["inline_as_read"]
    assert control["inline_claimed_cpu"] > max(0.05, 3 * fixed["inline_claimed_cpu"]), probes


@pytest.mark.parametrize(
    "kw",
    [
        {"claimed_poll_interval_s": -1.0},
        {"claimed_spin_s": float("nan")},
        {"idle_poll_interval_s": -0.001},
        {"poll_interval_s": float("nan")},
    ],
)
def test_pump_intervals_are_checked(kw: dict[str, Any]) -> None:
    with pytest.raises(E.ExportConfigError, match="must be a number of seconds >= 0"):
        ExportProducer(backend="shm", num_slots=2, slot_bytes=4096, **kw)
