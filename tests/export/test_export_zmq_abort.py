"""No peer can abort the producer through libzmq 4.3.5's ``Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)`` (issue 15, item 2).

The trigger, minimised (any ticket holder: the server key and any CURVE key pair): two connections that announce
the same ZMTP routing id.  The ROUTER ignores the second one's pipe (a duplicate id without ``ROUTER_HANDOVER``),
so nothing ever reads it; once it holds ``RCVHWM`` messages the engine stops reading the TCP socket.  The second
connection then resets (RST): the error arrives as EPOLLERR while input is stopped, ``in_event_internal`` records
``_io_error`` and leaves the engine alive, and the next heartbeat tick calls ``out_event`` (``timer_event`` does
not check ``_io_error``), whose first line asserts.  A server whose request queue is unbounded (``RCVHWM`` 0)
never stops input, so ``_io_error`` is never set.

The producer runs in a child process (an abort must not take the test runner with it) with a 0.1 s heartbeat so
that a tick follows each reset at once; the ``old-options`` case applies the ``RCVHWM`` of 1000 that the server
used before and must abort (exit -SIGABRT): the negative control that shows the sequence still finds the fault.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq
import zmq.utils.monitor

from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.control import ControlClient, ControlServer, new_token

RUNS = 20
HEARTBEAT_S = 0.1
#: a reset is followed by a heartbeat tick within HEARTBEAT_S; an abort shows up well inside this window
ABORT_WINDOW_S = 4 * HEARTBEAT_S
#: more complete messages than the old RCVHWM (1000), so the old server stops reading the duplicate's socket
FLOOD = 1100
OLD_OPTIONS = {int(zmq.RCVHWM): 1000}


def _serve(token: str, q: Any, overrides: dict[int, int]) -> None:
    """The child: a real ControlServer; ``overrides`` replace the values it sets on its ROUTER socket."""
    if overrides:
        original = zmq.Socket.setsockopt

        def setsockopt(self: zmq.Socket[bytes], option: int, value: Any) -> None:
            if self.type == zmq.ROUTER and option in overrides:
                value = overrides[option]
            original(self, option, value)

        zmq.Socket.setsockopt = setsockopt  # type: ignore[assignment]
    srv = ControlServer(lambda req, call: P.PongReply(producer="ab12"), token, producer="ab12", heartbeat_s=HEARTBEAT_S)
    q.put((srv.endpoint, srv.server_key))
    time.sleep(600)


@contextmanager
def _producer(overrides: dict[int, int]) -> Iterator[tuple[Any, str, str, str]]:
    token = new_token()
    mc = mp.get_context("spawn")
    q = mc.Queue()
    proc = mc.Process(target=_serve, args=(token, q, overrides), daemon=True)
    proc.start()
    try:
        endpoint, key = q.get(timeout=30)
        yield proc, endpoint, key, token
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, server_key: str) -> tuple[zmq.Socket[bytes], int]:
    """A CURVE client with a fresh key pair and the routing id b"dup"; returns it with its TCP fd, handshaken."""
    public, secret = zmq.curve_keypair()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.curve_serverkey = server_key.encode()
    s.curve_publickey = public
    s.curve_secretkey = secret
    s.routing_id = b"dup"
    mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    s.connect(f"tcp://{endpoint}")
    fd, deadline = -1, time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            if mon.poll(100):
                ev = zmq.utils.monitor.recv_monitor_message(mon)
                if ev["event"] == zmq.EVENT_CONNECTED:
                    fd = int(ev["value"])
                elif ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return s, fd
    finally:
        mon.close(linger=0)
    raise TimeoutError(f"no CURVE handshake with {endpoint} within 10 s")


def _reset(s: zmq.Socket[bytes], fd: int) -> None:
    """Close ``s`` so that its peer sees a TCP RST: SO_LINGER 0 on the connection's fd (set through a dup, which
    shares the open file), then libzmq closes it."""
    dup = socket.socket(fileno=os.dup(fd))
    dup.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    dup.close()
    s.close(linger=0)


def _attack(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, server_key: str) -> None:
    """The minimised trigger: a second connection with a taken routing id floods FLOOD requests, then resets."""
    first, _ = _dealer(ctx, endpoint, server_key)
    second, fd = _dealer(ctx, endpoint, server_key)
    for _ in range(FLOOD):
        second.send_multipart([P.HEADER, os.urandom(P.RID_BYTES), P.encode(P.PingReq())])
    time.sleep(0.05)  # let the flood reach the server before the reset
    _reset(second, fd)
    time.sleep(ABORT_WINDOW_S)
    first.close(linger=0)


@pytest.mark.parametrize(
    ("overrides", "aborts"),
    [pytest.param({}, False, id="current"), pytest.param(OLD_OPTIONS, True, id="old-options-abort")],
)
def test_duplicate_routing_id_flood_and_reset_never_aborts_the_producer(
    overrides: dict[int, int], aborts: bool
) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with _producer(overrides) as (proc, endpoint, key, token):
            for run in range(RUNS):
                _attack(ctx, endpoint, key)
                if aborts and not proc.is_alive():
                    proc.join(5)
                    got = proc.exitcode
                    assert got == -signal.SIGABRT, f"run {run}: expected the libzmq abort, got exit code {got}"
                    return
                assert proc.is_alive(), f"run {run}: the producer died with exit code {proc.exitcode}"
            assert not aborts, f"negative control: {RUNS} runs with {overrides} did not abort; the test finds nothing"
            client = ControlClient(endpoint, token, timeout_s=10)
            try:
                rep, _ = client.call(P.PingReq())
            finally:
                client.close()
            assert isinstance(rep, P.PongReply)
            assert proc.is_alive()
    finally:
        ctx.destroy(linger=0)
