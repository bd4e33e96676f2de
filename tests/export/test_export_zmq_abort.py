"""No peer can abort the producer through libzmq 4.3.5's ``Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)`` (issue 15, item 2).

The trigger, minimised (any ticket holder: the server key and any CURVE key pair): two connections that announce
the same ZMTP routing id.  The ROUTER ignores the second one's pipe (a duplicate id without ``ROUTER_HANDOVER``),
so nothing ever reads it; once it holds ``RCVHWM`` messages the engine stops reading the TCP socket.  The second
connection then resets (RST): the error arrives as EPOLLERR while input is stopped, ``in_event_internal`` records
``_io_error`` and leaves the engine alive, and the next heartbeat tick calls ``out_event`` (``timer_event`` does
not check ``_io_error``), whose first line asserts.  A server whose request queue is unbounded (``RCVHWM`` 0)
never stops input, so ``_io_error`` is never set.

The public socket lives in the gate, a child process of the producer: an abort there would not take the producer
with it, but would cost every client a reconnect, so the test asserts the gate itself survives (same pid, no
restart counted) 20 times, with a 0.1 s heartbeat so that a tick follows each reset at once.  The negative
control runs the same sequence against a plain CURVE ROUTER with the ``RCVHWM`` of 1000 that the server used
before, in a child process: it must abort (exit -SIGABRT), which shows the sequence still finds the fault in
this libzmq.
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
OLD_RCVHWM = 1000


def _serve_old(q: Any) -> None:
    """The child of the negative control: a CURVE ROUTER with the options the server had before (RCVHWM 1000),
    reading every message as a server does."""
    public, secret = zmq.curve_keypair()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.linger = 0
    s.curve_server = True
    s.curve_secretkey = secret
    s.setsockopt(zmq.ROUTER_MANDATORY, 1)
    s.setsockopt(zmq.SNDHWM, 1000)
    s.setsockopt(zmq.RCVHWM, OLD_RCVHWM)
    s.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * HEARTBEAT_S * 1000))
    s.bind("tcp://127.0.0.1:*")
    q.put((s.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://"), public.decode("ascii")))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if s.poll(100):
            s.recv_multipart()


@contextmanager
def _old_router() -> Iterator[tuple[Any, str, str]]:
    mc = mp.get_context("spawn")
    q = mc.Queue()
    proc = mc.Process(target=_serve_old, args=(q,), daemon=True)
    proc.start()
    try:
        endpoint, key = q.get(timeout=30)
        yield proc, endpoint, key
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
    # A flood send that cannot proceed for 2 s raises zmq.Again instead of blocking the test for ever: the
    # server stopped taking messages, which is what the flood is for (see _attack).
    s.sndtimeo = 2_000
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
        # Stop the monitor before closing its reading end: libzmq's I/O thread sends monitor events blocking, so
        # an event with no reader (a reconnect after the gate drops this connection) would wedge every socket of
        # this context.
        s.disable_monitor()
        mon.close(linger=0)
    raise TimeoutError(f"no CURVE handshake with {endpoint} within 10 s")


def _reset(s: zmq.Socket[bytes], fd: int) -> None:
    """Close ``s`` so that its peer sees a TCP RST: SO_LINGER 0 on the connection's fd (set through a dup, which
    shares the open file), then libzmq closes it."""
    try:
        copy = os.dup(fd)
    except OSError:  # libzmq already closed the connection (the server dropped it): there is nothing to reset
        s.close(linger=0)
        return
    try:
        dup = socket.socket(fileno=copy)
    except OSError:  # the number now names something that is not a socket: nothing of ours to reset
        os.close(copy)
        s.close(linger=0)
        return
    try:
        dup.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:  # the number was reused by something that is not this connection's socket
        pass
    finally:
        dup.close()
    s.close(linger=0)


def _attack(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, server_key: str) -> None:
    """The minimised trigger: a second connection with a taken routing id floods FLOOD requests, then resets."""
    first, _ = _dealer(ctx, endpoint, server_key)
    second, fd = _dealer(ctx, endpoint, server_key)
    for _ in range(FLOOD):
        try:
            second.send_multipart([P.HEADER, os.urandom(P.RID_BYTES), P.encode(P.PingReq())])
        except zmq.Again:  # nothing drains the connection any more: the server stopped reading it
            break
    time.sleep(0.05)  # let the flood reach the server before the reset
    _reset(second, fd)
    time.sleep(ABORT_WINDOW_S)
    first.close(linger=0)


def test_duplicate_routing_id_flood_and_reset_never_aborts_the_gate() -> None:
    token = new_token()
    srv = ControlServer(lambda req, call: P.PongReply(producer="ab12"), token, producer="ab12", heartbeat_s=HEARTBEAT_S)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        pid = srv.gate_pid
        for run in range(RUNS):
            _attack(ctx, srv.endpoint, srv.server_key)
            assert srv.gate_pid == pid and srv.counters["gate_restarts"] == 0, (
                f"run {run}: the gate died ({srv.gate_last_exit}) and was restarted"
            )
        client = ControlClient(srv.endpoint, token, timeout_s=10)
        try:
            rep, _ = client.call(P.PingReq())
        finally:
            client.close()
        assert isinstance(rep, P.PongReply)
        assert srv.gate_pid == pid and srv.counters["gate_restarts"] == 0
    finally:
        ctx.destroy(linger=0)
        srv.close()


def test_the_same_sequence_aborts_a_router_with_a_finite_rcvhwm() -> None:
    """Negative control: the sequence finds the fault in this libzmq when RCVHWM is finite (the old option)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with _old_router() as (proc, endpoint, key):
            for _ in range(RUNS):
                try:
                    _attack(ctx, endpoint, key)
                except TimeoutError:  # no handshake: the server aborted during the previous run, after the check
                    proc.join(5)
                    if proc.is_alive():
                        raise
                    break
                proc.join(0.2)  # an abort within the run's window is reaped here
                if not proc.is_alive():
                    break
            proc.join(5)
            assert proc.exitcode == -signal.SIGABRT, (
                f"negative control: {RUNS} runs against RCVHWM {OLD_RCVHWM} did not abort (exit {proc.exitcode}); "
                "the test finds nothing"
            )
    finally:
        ctx.destroy(linger=0)
