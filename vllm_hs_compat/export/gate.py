"""The export control plane's gate: the process that holds the public CURVE socket.

Why a process: libzmq buffers the frames of a multipart message that has not finished without any bound (the
high-water marks count whole messages, ``MAXMSGSIZE`` one frame), so a peer that completed the handshake can grow
the process holding the socket by any amount, and libzmq aborts the whole process on some I/O errors.  The gate
runs that socket where neither can take the model worker with it: it runs under an address-space limit
(``RLIMIT_AS``), and the producer (:class:`vllm_hs_compat.export.control.ControlServer`) restarts it on the same
port with the same keys whenever it dies; clients reconnect and resend by themselves.

What the gate does, and nothing more: the CURVE handshake and the ZAP decision (``trainer`` or ``record``),
per-connection bounds (replies queued, requests in flight; a connection over either is dropped: its TCP stream
is shut down and whatever it still sends is discarded, counted), and forwarding.  A complete request of the right
shape (header, 16-byte request id, body; each frame already bounded by ``MAXMSGSIZE``) goes to the producer with
its connection id and principal over a private ``ipc://`` socket in a ``0700`` directory; replies come back the
same way.  It never decodes a body.  Counters go to the producer as JSON lines on stdout; EOF on stdin (the
producer died or closed it) ends the gate.

Run as a file (``python -P .../gate.py``), not with ``-m``: importing the package would import torch.  Its
configuration, secret key included, arrives as one JSON line on stdin (never on the command line).
"""

from __future__ import annotations

import hmac
import json
import os
import resource
import signal
import socket
import struct
import sys
import time
from collections import OrderedDict, deque
from typing import Any

import zmq
from zmq.utils import z85

#: Connections remembered as dropped (their later messages are discarded without a lookup miss).
MAX_DROPPED = 4096
#: How often changed counters are reported to the producer.
REPORT_S = 0.05
# Plain ints: pyzmq's flag enums cost an enum operation per use, and the loop uses several per frame.
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)

_POLLIN = int(zmq.POLLIN)


def _recv(sock: zmq.Socket[bytes]) -> list[zmq.Frame] | None:
    """The next whole message of ``sock`` (its frames, not copied), or None when none is queued."""
    if not int(sock.getsockopt(zmq.EVENTS)) & _POLLIN:
        return None
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


def _send(sock: zmq.Socket[bytes], frames: list[Any]) -> None:
    """Send one message without blocking (``zmq.Again``/``ZMQError`` as ``send_multipart`` raises them; a ROUTER
    refuses a message at its first frame, so nothing is left half sent)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, _MORE if i < last else _NOBLOCK, copy=False)


_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_EVENT_COUNTERS = {
    zmq.EVENT_ACCEPTED: "connections",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshakes",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failures_protocol",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_failures_auth",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failures_other",
    zmq.EVENT_DISCONNECTED: "disconnects",
}
COUNTERS = (
    "connections",
    "handshakes",
    "handshake_failures_protocol",
    "handshake_failures_auth",
    "handshake_failures_other",
    "disconnects",
    "zap_trainer",
    "zap_record",
    "bad_frames",
    "replies_dropped",
    "replies_backlogged",
    "peers_dropped",
    "peers_dropped_reply_queue",
    "peers_dropped_inflight",
    "dropped_messages",
    "producer_busy",
)


def _msgpack_str(s: str) -> bytes:
    b = s.encode("utf-8", "replace")[:8000]
    if len(b) < 32:
        return bytes((0xA0 | len(b),)) + b
    if len(b) < 256:
        return b"\xd9" + bytes((len(b),)) + b
    return b"\xda" + len(b).to_bytes(2, "big") + b


def error_body(code: str, message: str) -> bytes:
    """msgpack of the protocol's ``ErrorReply`` (``{"t": "error", "code", "message"}``), built without msgspec."""
    return b"\x83" + b"".join(_msgpack_str(x) for x in ("t", "error", "code", code, "message", message))


def _socket_of(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of libzmq's descriptor ``fd`` (closing it closes the duplicate only), or
    None when ``fd`` is closed or is not a socket any more."""
    try:
        copy = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return None


def _peer_name(fd: int) -> tuple[Any, ...] | None:
    """The TCP peer (host, port[, ...]) of libzmq's descriptor ``fd``, or None when it cannot be read."""
    s = _socket_of(fd)
    if s is None:
        return None
    try:
        return tuple(s.getpeername())
    except OSError:
        return None
    finally:
        s.close()


class _Peer:
    __slots__ = ("addr", "backlog", "backlog_bytes", "backlog_limit", "fd", "inflight", "limit", "principal")

    def __init__(self, fd: int, addr: tuple[Any, ...] | None, principal: bytes, limit: int, backlog_limit: int) -> None:
        self.fd = fd
        #: the connection's TCP peer (host, port): what tells this connection's descriptor from a later one that
        #: reuses the number (the host alone does not: every client on one machine shares it)
        self.addr = addr
        self.inflight = 0
        self.principal = principal  # fixed by the handshake: the same for every message of a connection
        self.limit = limit
        #: replies that found the connection's queue (``ZMQ_SNDHWM``) full, oldest first, and their bytes
        self.backlog: deque[list[Any]] = deque()
        self.backlog_bytes = 0
        self.backlog_limit = backlog_limit


class Gate:
    """The public socket, its ZAP handler and monitor, and the private socket to the producer."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.header: bytes = bytes.fromhex(cfg["header"])
        self.rid_bytes = int(cfg["rid_bytes"])
        self.producer: bytes = cfg["producer"].encode("ascii")
        self.max_inflight = int(cfg["max_inflight"])
        self.max_inflight_trainer = int(cfg["max_inflight_trainer"])
        self.backlog_bytes = int(cfg["reply_backlog_bytes"])
        self.backlog_bytes_trainer = int(cfg["reply_backlog_bytes_trainer"])
        self.backlogged: set[bytes] = set()
        self.trainer_key = z85.decode(cfg["trainer_key"].encode("ascii"))
        self.counters = dict.fromkeys(COUNTERS, 0)
        #: requests forwarded (reported with the counters, kept out of them: it changes with every request, and the
        #: loop compares the counters to decide whether an event must be reported now)
        self.forwarded = 0
        self.peers: dict[bytes, _Peer] = {}
        self.by_fd: dict[int, bytes] = {}
        self.dropped: OrderedDict[bytes, None] = OrderedDict()
        self.ctx = zmq.Context(io_threads=1)
        self.zap = self.ctx.socket(zmq.REP)
        self.zap.linger = 0
        self.zap.bind("inproc://zeromq.zap.01")
        pub = self.ctx.socket(zmq.ROUTER)
        self.pub = pub
        pub.linger = 0
        host = cfg["host"]
        if ":" in host:
            pub.ipv6 = True
        pub.curve_server = True
        pub.curve_secretkey = cfg["secret"].encode("ascii")
        pub.zap_domain = b"hsx"
        pub.setsockopt(zmq.MAXMSGSIZE, int(cfg["maxmsgsize"]))
        pub.setsockopt(zmq.HANDSHAKE_IVL, int(cfg["handshake_ms"]))
        pub.setsockopt(zmq.ROUTER_MANDATORY, 1)
        pub.setsockopt(zmq.SNDHWM, int(cfg["reply_queue"]))
        # RCVHWM 0 (no limit), never a finite one, and never ROUTER_HANDOVER: libzmq 4.3.5 (and master) aborts the
        # process when a connection's engine stops reading (its session pipe full at RCVHWM, or none after a
        # handover) and the peer resets: stream_engine_base.cpp in_event_internal sets _io_error (l. 249) and
        # keeps the engine; the next heartbeat tick (timer_event, l. 737) or a buffered PING (zmtp_engine.cpp
        # l. 527) calls out_event, which asserts !_io_error (l. 310).  A peer fills a pipe by pipelining, or at
        # once by announcing a routing id already connected (the ROUTER never reads that pipe).  Requests in
        # flight are bounded by this gate's own count per connection; what libzmq holds unread (a duplicate-id
        # connection's pipe, an unfinished multipart message) by the gate's address-space limit.
        pub.setsockopt(zmq.RCVHWM, 0)
        pub.setsockopt(zmq.TCP_KEEPALIVE, 1)
        pub.setsockopt(zmq.HEARTBEAT_IVL, int(cfg["heartbeat_ms"]))
        pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * int(cfg["heartbeat_ms"]))
        self.mon = pub.get_monitor_socket(_EVENTS)
        port = int(cfg["port"])
        addr = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
        pub.bind(f"{addr}:{port if port else '*'}")
        self.port = int(pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        back = self.ctx.socket(zmq.DEALER)
        self.back = back
        back.linger = 0
        back.setsockopt(zmq.SNDHWM, 10_000)
        back.setsockopt(zmq.RCVHWM, 0)  # a finite RCVHWM can abort a process when its peer dies (see above)
        back.connect(cfg["backend"])

    # --- the public side ------------------------------------------------------------------------------------
    def serve_zap(self) -> None:
        for _ in range(256):
            try:
                frames = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            req_id = frames[1] if len(frames) > 1 else b""
            if len(frames) < 6:
                self.zap.send_multipart([b"1.0", req_id, b"500", b"malformed ZAP request", b"", b""])
                continue
            key = frames[6] if len(frames) > 6 and frames[5] == b"CURVE" else b""
            trainer = len(key) == 32 and hmac.compare_digest(key, self.trainer_key)
            self.counters["zap_trainer" if trainer else "zap_record"] += 1
            self.zap.send_multipart([b"1.0", req_id, b"200", b"OK", b"trainer" if trainer else b"record", b""])

    def drain_monitor(self) -> None:
        for _ in range(1024):
            try:
                msg = self.mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(msg[0]) < 6:
                continue
            event, value = struct.unpack("=HI", msg[0][:6])
            key = _EVENT_COUNTERS.get(event)
            if key is not None:
                self.counters[key] += 1
            if event == zmq.EVENT_DISCONNECTED:
                conn = self.by_fd.pop(value, None)
                if conn is not None:
                    self.peers.pop(conn, None)

    def inbound(self) -> None:
        for _ in range(256):  # ZMQ_EVENTS, not a recv that fails: a raised zmq.Again costs more than the recv
            frames = _recv(self.pub)
            if frames is None:
                return
            self._one(frames)

    def _one(self, frames: list[zmq.Frame]) -> None:
        conn = frames[0].bytes
        if conn in self.dropped:
            self.counters["dropped_messages"] += 1
            return
        peer = self.peers.get(conn)
        if peer is None:
            last = frames[-1]
            fd = int(last.get(zmq.SRCFD))
            old = self.by_fd.get(fd)
            if old is not None:  # the descriptor was another connection's: that one has gone
                self.peers.pop(old, None)
            trainer = last.get("User-Id") == "trainer"
            limit = self.max_inflight_trainer if trainer else self.max_inflight
            backlog = self.backlog_bytes_trainer if trainer else self.backlog_bytes
            peer = _Peer(fd, _peer_name(fd), b"trainer" if trainer else b"record", limit, backlog)
            self.peers[conn] = peer
            self.by_fd[fd] = conn
        if len(frames) != 4 or len(frames[2]) != self.rid_bytes:
            self.counters["bad_frames"] += 1
            if len(frames) >= 3:
                msg = f"expected 3 frames (header, rid, body), got {len(frames) - 1}"
                self.reply(conn, [conn, self.header, frames[2].bytes, self.producer, error_body("protocol", msg)])
            return
        if peer.inflight >= peer.limit:
            self.drop(conn, "inflight")
            self.counters["dropped_messages"] += 1
            return
        try:
            _send(self.back, [conn, peer.principal, frames[1], frames[2], frames[3]])
        except zmq.Again:
            self.counters["producer_busy"] += 1
            rid = frames[2].bytes
            busy = error_body("timeout", "the producer's control queue is full; retry")
            self.reply(conn, [conn, self.header, rid, self.producer, busy])
            return
        peer.inflight += 1
        self.forwarded += 1

    def reply(self, conn: bytes, frames: list[Any]) -> None:
        peer = self.peers.get(conn)
        if peer is not None and peer.backlog:  # keep the order: behind the replies already waiting
            self._backlog(conn, peer, frames)
            return
        try:
            _send(self.pub, frames)
        except zmq.Again:  # this connection's queue is full: wait in its backlog, bounded in bytes
            if peer is None:
                self.counters["replies_dropped"] += 1
            else:
                self._backlog(conn, peer, frames)
        except zmq.ZMQError:  # the connection is gone (EHOSTUNREACH): the client resends after reconnecting
            self.counters["replies_dropped"] += 1
            self._forget(conn)

    def _backlog(self, conn: bytes, peer: _Peer, frames: list[Any]) -> None:
        size = sum(len(f) for f in frames)
        if peer.backlog and peer.backlog_bytes + size > peer.backlog_limit:  # it does not read its replies
            self.counters["replies_dropped"] += 1 + len(peer.backlog)
            self.drop(conn, "reply_queue")
            return
        peer.backlog.append(frames)
        peer.backlog_bytes += size
        self.backlogged.add(conn)
        self.counters["replies_backlogged"] += 1

    def flush_backlogs(self) -> None:
        """Send what waits in backlogs, as far as each connection's queue takes it."""
        for conn in list(self.backlogged):
            peer = self.peers.get(conn)
            while peer is not None and peer.backlog:
                frames = peer.backlog[0]
                try:
                    _send(self.pub, frames)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    self.counters["replies_dropped"] += len(peer.backlog)
                    self._forget(conn)
                    break
                peer.backlog.popleft()
                peer.backlog_bytes -= sum(len(f) for f in frames)
            if peer is None or not peer.backlog:
                self.backlogged.discard(conn)

    def _forget(self, conn: bytes) -> None:
        peer = self.peers.pop(conn, None)
        self.backlogged.discard(conn)
        if peer is not None:
            self.by_fd.pop(peer.fd, None)

    def drop(self, conn: bytes, why: str) -> None:
        """Stop serving ``conn``: discard what it sends from now on, and shut its TCP stream down so libzmq frees
        its queues (ZeroMQ has no call that disconnects one peer of a ROUTER)."""
        self.dropped[conn] = None
        while len(self.dropped) > MAX_DROPPED:
            self.dropped.popitem(last=False)
        self.counters["peers_dropped"] += 1
        self.counters[f"peers_dropped_{why}"] += 1
        peer = self.peers.pop(conn, None)
        self.backlogged.discard(conn)
        if peer is None:
            return
        self.by_fd.pop(peer.fd, None)
        s = _socket_of(peer.fd)
        if s is None:
            return
        try:
            if peer.addr is None or s.getpeername() != peer.addr:
                return  # the descriptor now belongs to another connection (or was never known): leave it
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()  # the duplicate only: libzmq closes its own descriptor when it sees the stream end

    # --- the producer's side --------------------------------------------------------------------------------
    def outbound(self) -> None:
        for _ in range(256):
            frames = _recv(self.back)
            if frames is None:
                return
            if len(frames) < 2:
                continue
            conn = frames[0].bytes
            peer = self.peers.get(conn)
            if peer is not None and peer.inflight > 0:
                peer.inflight -= 1
            if conn in self.dropped:
                self.counters["replies_dropped"] += 1
                continue
            self.reply(conn, frames)

    def report(self) -> None:
        try:  # stdout is non-blocking: a producer that does not read loses a report, never stalls the gate
            os.write(1, json.dumps({"c": {**self.counters, "forwarded": self.forwarded}}).encode() + b"\n")
        except OSError:  # BlockingIOError, or BrokenPipeError: the producer is gone (stdin's EOF ends the gate)
            pass

    def run(self) -> int:
        poller = zmq.Poller()
        for s in (self.pub, self.zap, self.mon, self.back):
            poller.register(s, zmq.POLLIN)
        poller.register(0, zmq.POLLIN)
        pub, zap, mon, back = self.pub, self.zap, self.mon, self.back
        reported = dict(self.counters)
        sent = self.forwarded
        next_report = 0.0
        while True:
            ready = dict(poller.poll(5 if self.backlogged else 100))
            if zap in ready:
                self.serve_zap()
            if mon in ready:
                self.drain_monitor()
            # Events are reported before the requests that follow them are forwarded, so the producer has counted
            # a connection's handshake by the time it answers that connection.
            if self.counters != reported:
                self.report()
                reported, sent = dict(self.counters), self.forwarded
            if back in ready:
                self.outbound()
            if pub in ready:
                self.inbound()
            if self.backlogged:
                self.flush_backlogs()
            if 0 in ready and not os.read(0, 4096):  # the producer closed the pipe or died
                deadline = time.monotonic() + 0.2
                while time.monotonic() < deadline and back.poll(20):
                    self.outbound()  # the last answers (parked long polls answered at close)
                self.report()
                return 0
            if self.counters != reported:
                self.report()
                reported, sent = dict(self.counters), self.forwarded
            elif self.forwarded != sent:  # requests only: at most one report per REPORT_S
                now = time.monotonic()
                if now >= next_report:
                    self.report()
                    sent, next_report = self.forwarded, now + REPORT_S


def _read_config() -> dict[str, Any]:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = os.read(0, 65536)
        if not chunk:
            raise SystemExit(0)  # the producer went away before configuring the gate
        buf += chunk
    cfg: dict[str, Any] = json.loads(buf)
    return cfg


def main() -> int:
    """Configure from stdin, bind, report ``{"port": N}`` (or ``{"error": ...}``), serve until stdin ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the producer's to handle
    cfg = _read_config()
    limit = int(cfg.get("memory_bytes") or 0)
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        gate = Gate(cfg)
    except (zmq.ZMQError, OSError, ValueError, KeyError) as e:
        os.write(1, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        return 2
    os.write(1, json.dumps({"port": gate.port, "pid": os.getpid()}).encode() + b"\n")
    os.set_blocking(1, False)
    try:
        return gate.run()
    except MemoryError:
        os.write(2, b"hsx gate: out of memory (its RLIMIT_AS); exiting for the producer to restart it\n")
        os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
