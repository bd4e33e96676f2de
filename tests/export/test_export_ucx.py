"""The UCX settings a transfer depends on travel in the handshake: peers that disagree are refused, not aborted.

UCX's TCP transport does not negotiate its segment sizes (``UCX_TCP_TX_SEG_SIZE`` / ``UCX_TCP_RX_SEG_SIZE``).  A
trainer whose segments are smaller than the producer's corrupts its heap on the first large READ (glibc aborts it:
``free(): invalid next size``) and the producer's UCX may then abort the producer (``Fatal: unexpected error:
Endpoint timeout``).  Both run here over TCP (``UCX_TLS=tcp,self``, as users without RDMA run), each in a process
of its own, so an abort ends a peer and fails the test instead of ending the test run.  Without the check (the
negative control, run by hand: ``_check_settings`` returning at once) the mismatch cases fail with the trainer
process killed by SIGABRT.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hsx_harness import NIXL_REASON, Peer, run_script

from vllm_hs_compat.export import nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason=NIXL_REASON)]

TCP = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
#: UCX's own defaults: what a library that leaves UCX alone (or pins its defaults) runs with
UCX_DEFAULT_SIZES = ("8k", "64k")
RECORD = {"record_id": "r0", "seed": 3, "tokens": 1024, "planes": 2, "hidden": 1024}  # 4 MiB: many segments


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[tuple[Peer, dict[str, object]]]:
    """A producer over UCX TCP in a process of its own (``request.param``: UCX segment sizes its environment sets,
    as vLLM's own NIXL setup or the deployment could; None: the package's defaults) with one record published."""
    sizes = request.param
    env: dict[str, str | None] = {**TCP}
    if sizes is not None:
        env["UCX_TCP_TX_SEG_SIZE"], env["UCX_TCP_RX_SEG_SIZE"] = sizes
    peer = Peer(env=env)
    try:
        info = peer.ok("producer", backend="nixl", num_slots=2, slot_bytes=8 << 20)
        peer.ok("publish", **RECORD)
        yield peer, info
    finally:
        peer.close()


def trainer(info: dict[str, object], sizes: tuple[str, str] | None) -> dict[str, Any]:
    """Run a trainer process that imported NIXL first (another library's agent, with ``sizes`` set by that library
    if given) and fetches the record: what it printed (a process UCX aborted fails the test)."""
    args = [str(info["endpoint"]), str(info["token"]), str(RECORD["record_id"]), *(sizes or ())]
    env: dict[str, str | None] = {**TCP, "UCX_TCP_TX_SEG_SIZE": None, "UCX_TCP_RX_SEG_SIZE": None}
    return run_script("hsx_nixl_first.py", args, env, 120)


def record_digest() -> str:
    from hsx_testdata import digest, make_rows

    return digest(make_rows(int(RECORD["seed"]), int(RECORD["tokens"]), int(RECORD["planes"]), int(RECORD["hidden"])))


@pytest.mark.parametrize(
    ("server", "sizes", "side"),
    [
        pytest.param(None, UCX_DEFAULT_SIZES, "trainer", id="trainer-smaller"),
        pytest.param(("1m", "1m"), None, "server", id="server-larger"),
    ],
    indirect=["server"],
)
def test_a_trainer_on_other_ucx_segment_sizes_is_refused_by_name_before_any_transfer(
    server: tuple[Peer, dict[str, object]], sizes: tuple[str, str] | None, side: str
) -> None:
    """The trainer imported NIXL first and another library set UCX's TCP segment sizes there (``trainer``), or
    the server's environment set others (``server``): the trainer's smaller receive segment would be overrun on
    the first READ.  The trainer refuses by name before loading the producer's metadata, the producer counts it
    and keeps serving; a trainer with the producer's sizes then gets the record."""
    peer, info = server
    got = trainer(info, sizes)
    assert got.get("error") == "TransportSettingsMismatchError", got
    assert "UCX_TCP_RX_SEG_SIZE" in str(got["message"]) and "at the producer" in str(got["message"])
    assert "stage" not in got  # refused while the consumer was being made: no claim, no transfer
    st = peer.ok("pstats")["stats"]
    assert st["transfer_settings_mismatches"] == 1
    assert (st["leases_ready"], st["leases_claimed"], st["delivered"]) == (1, 0, 0)
    # the producer serves on: a trainer that runs its sizes reads the record.  With the trainer's NIXL first and no
    # sizes set by the other library, that is the import order alone: UCX reads its environment when an agent is
    # made, and the package still sets its defaults after warning, so the trainer's agent runs the producer's sizes
    again = trainer(info, ("1m", "1m") if side == "server" else None)
    assert again.get("sha256") == record_digest(), again
    st = peer.ok("pstats")["stats"]
    assert (st["delivered"], st["transfer_settings_mismatches"]) == (1, 1)
