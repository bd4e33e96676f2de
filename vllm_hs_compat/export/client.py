"""The control plane's client: one CURVE ``DEALER`` connection to a producer (the gate's public socket, or a
trainer's direct socket), and the bookkeeping of requests posted without waiting that both clients (this one and
the plain channel's, :mod:`vllm_hs_compat.export.plain`) share."""

from __future__ import annotations

import os
import threading
import time
from typing import Final

import zmq

from vllm_hs_compat import errors as E
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.credentials import check_token, curve_keys
from vllm_hs_compat.export.protocol import parse_endpoint, zmq_address

PROTO: Final = P.WIRE_VERSION


_HANDSHAKE_FAILURES: Final = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)


def _monitor_event(msg: list[bytes]) -> int:
    """The event number of a socket-monitor message (``zmq.utils.monitor`` is imported here, on first use: it
    pulls in ``zmq.asyncio`` and ``asyncio``)."""
    from zmq.utils.monitor import parse_monitor_message

    return int(parse_monitor_message(msg)["event"])


_MONITOR_EVENTS: Final = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class PostedRequests:
    """Requests sent without waiting for their answers (``post``) and the answers received, as both control
    clients keep them (:class:`PlainClient`, :class:`~vllm_hs_compat.export.control.ControlClient`)."""

    def __init__(self) -> None:
        #: requests sent with ``post`` whose answers have not arrived: rid -> frames (sent again after a drop)
        self._posted: dict[bytes, list[bytes]] = {}
        #: answers to posted requests, in arrival order: (rid, (reply, producer) or the error it raised)
        self._answers: list[tuple[bytes, tuple[P.Reply, str] | E.HsCompatError]] = []

    def answers(self) -> list[tuple[bytes, tuple[P.Reply, str] | E.HsCompatError]]:
        """Answers to posted requests received so far (each handed out once)."""
        out, self._answers = self._answers, []
        return out

    @property
    def outstanding(self) -> int:
        """Posted requests not answered yet."""
        return len(self._posted)

    def _file(self, rid: bytes, answer: tuple[P.Reply, str] | E.HsCompatError) -> bool:
        """Keep ``answer`` if it answers a posted request (True), else it is nobody's (False)."""
        if self._posted.pop(rid, None) is None:
            return False
        self._answers.append((rid, answer))
        return True

    def _take_posted(self, other: PostedRequests) -> list[list[bytes]]:
        """Move ``other``'s posted requests and answers here; the frames of the requests, to send again."""
        self._answers.extend(other.answers())
        self._posted.update(other._posted)
        frames = list(other._posted.values())
        other._posted.clear()
        return frames


_client_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
_client_pid = 0
_client_lock = threading.Lock()


def _context() -> zmq.Context[zmq.Socket[bytes]]:
    """This process's client context (re-made after a fork: a ZeroMQ context must not cross one)."""
    global _client_ctx, _client_pid
    with _client_lock:
        if _client_ctx is None or _client_pid != os.getpid():
            _client_ctx = zmq.Context(io_threads=1)
            _client_pid = os.getpid()
        return _client_ctx


class ControlClient(PostedRequests):
    """One CURVE DEALER connection to a producer.  Not thread-safe: one client per thread.

    With ``token`` the client is the trainer (CURVE keys derived from the token).  Without it, it is a ticket
    holder: an ephemeral key pair and the ticket's ``server_key``.  The connection is made in the background and
    re-made after a drop; a request lost in a drop is sent again with the same request id (the producer answers
    a request id once), and an answer to an earlier request that timed out is recognised by its id and dropped.
    """

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        timeout_s: float = 10.0,
        *,
        server_key: str | None = None,
        max_reply_bytes: int = P.DEFAULT_REPLY_BYTES,
        fail_on_disconnect: bool = False,
    ) -> None:
        self.endpoint = endpoint
        #: raise :class:`ProducerUnreachableError` from :meth:`call` as soon as the connection drops, instead of
        #: waiting for it to be re-made (the trainer's direct connection: the caller falls back to the gate)
        self.fail_on_disconnect = fail_on_disconnect
        self.disconnected = False
        self.timeout_s = timeout_s
        if not P.MIN_REPLY_BYTES <= max_reply_bytes <= P.MAX_REPLY_BYTES:
            raise E.ExportConfigError(
                f"max_reply_bytes must lie in [{P.MIN_REPLY_BYTES}, {P.MAX_REPLY_BYTES}], found {max_reply_bytes}"
            )
        self.max_reply_bytes = max_reply_bytes
        host, port = parse_endpoint(endpoint)
        if token is not None:
            token = check_token(token)
            public, secret = curve_keys(token, "trainer")
            derived = curve_keys(token, "server")[0]
            if server_key is not None and server_key.encode("ascii", "replace") != derived:
                raise E.AuthError(
                    f"the producer at {endpoint} is keyed by another token (the ticket's server_key is not the key "
                    "this token gives): use the token file of that deployment"
                )
            skey = derived
        elif server_key is not None:
            public, secret = zmq.curve_keypair()
            skey = server_key.encode("ascii", "replace")
        else:
            raise E.ExportConfigError(
                "a control client needs the trainer token, or a ticket's server_key (and capability)"
            )
        super().__init__()
        self.principal = "trainer" if token is not None else "record"
        self.stale_replies = 0
        self.resends = 0
        self._handshakes = 0
        self._failures = 0
        sock = _context().socket(zmq.DEALER)
        self._sock = sock
        try:
            sock.linger = 0
            if ":" in host:
                sock.ipv6 = True
            sock.curve_serverkey = skey
            sock.curve_publickey = public
            sock.curve_secretkey = secret
            sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes + 2 * P.REPLY_OVERHEAD)
            sock.setsockopt(zmq.SNDHWM, 64)
            sock.setsockopt(zmq.RCVHWM, 64)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.setsockopt(zmq.HEARTBEAT_IVL, 10_000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30_000)
            self._mon = sock.get_monitor_socket(_MONITOR_EVENTS)
            sock.connect(zmq_address(host, port))
        except zmq.ZMQError as e:
            self.close()
            raise E.ExportConfigError(f"cannot set up a connection to {endpoint}: {e}") from None
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._mon, zmq.POLLIN)

    def _events(self) -> bool:
        """Drain connection events; True if a connection was re-made (a pending request must be resent)."""
        remade = False
        while True:
            try:
                msg = self._mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return remade
            event = _monitor_event(msg)
            if event == zmq.EVENT_DISCONNECTED:
                self.disconnected = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.disconnected = False
                remade = self._handshakes > 0
                self._handshakes += 1
                self._failures = 0
            elif event in _HANDSHAKE_FAILURES:
                self._failures += 1
                definitive = event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                if definitive or self._failures >= 2:
                    raise E.AuthError(
                        f"the CURVE handshake with {self.endpoint} failed ({self._failures} attempt(s)): the "
                        f"{'token' if self.principal == 'trainer' else 'ticket'} does not match the producer "
                        "listening there (it could not prove it holds the producer key), or it is not a "
                        f"vllm-hs-compat producer of wire version {PROTO}"
                    )

    def call(self, req: P.Request, timeout_s: float | None = None, rid: bytes | None = None) -> tuple[P.Reply, str]:
        """Send one request and wait for its answer: ``(reply, producer instance)``.  An error answer raises the
        mapped named error; no answer by the deadline raises :class:`ExportTimeoutError`
        (:class:`ProducerUnreachableError` when no connection was ever made, or, with ``fail_on_disconnect``,
        when the connection drops).  ``rid``: the request id (a request sent again over another connection keeps
        its id, so the producer answers it once); a fresh one by default."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        rid = P.new_rid() if rid is None else rid
        frames = [P.HEADER, rid, P.encode(req)]
        deadline = time.monotonic() + timeout
        sent = False
        while True:
            if not sent:
                try:
                    self._sock.send_multipart(frames, zmq.NOBLOCK)
                    sent = True
                except zmq.Again:
                    pass  # the queue towards an unconnected producer is full: try again below
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = dict(self._poller.poll(max(1, min(int(left * 1000) + 1, 100 if not sent else 1000))))
            if self._mon in ready and self._events():
                self._resend_posted()
                if sent:
                    self.resends += 1  # the connection was re-made: the request may have been lost with the old one
                    sent = False
                    continue
            if self.fail_on_disconnect and self.disconnected:
                raise E.ProducerUnreachableError(
                    f"the connection to {self.endpoint} dropped while {type(req).__name__} was in flight"
                )
            if self._sock not in ready:
                continue
            reply = self._receive(rid)
            if reply is not None:
                return reply
        if self._handshakes == 0:
            raise E.ProducerUnreachableError(
                f"no connection to the export producer at {self.endpoint} within {timeout:.1f}s: is it running, "
                "and is this the endpoint from the ticket (kv_transfer_params['hs_export'])?"
            )
        raise E.ExportTimeoutError(
            f"no answer from {self.endpoint} to {type(req).__name__} within {timeout:.1f}s; the producer is "
            "stalled or the network is down"
        )

    def _receive(self, rid: bytes | None) -> tuple[P.Reply, str] | None:
        while True:
            try:
                got = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            if len(got) == 4 and got[1] in self._posted and got[1] != rid:
                del self._posted[got[1]]
                try:
                    self._answers.append((got[1], self._decode(got)))
                except E.HsCompatError as e:
                    self._answers.append((got[1], e))
                continue
            if rid is None or len(got) != 4 or got[1] != rid:
                if len(got) >= 2:
                    P.check_header(got[0])
                self.stale_replies += 1  # the answer to an earlier request that timed out, or a duplicate
                continue
            return self._decode(got)

    @staticmethod
    def _decode(got: list[bytes]) -> tuple[P.Reply, str]:
        P.check_header(got[0])
        rep = P.decode_reply(got[3])
        producer = got[2].decode("ascii", "replace")
        if isinstance(rep, P.ErrorReply):
            raise P.remote_error(rep)
        return rep, producer

    # --- requests whose answers are collected later ---------------------------------------------------------
    def post(self, req: P.Request) -> bytes:
        """Send ``req`` without waiting for its answer; returns its request id.  Its answer is collected by any
        later :meth:`call` or :meth:`collect` and handed out by :meth:`answers`; a request lost in a dropped
        connection is sent again (the producer answers a request id once).  For requests whose answer only
        confirms what the caller already knows (a release far from its lease's deadline)."""
        rid = P.new_rid()
        frames = [P.HEADER, rid, P.encode(req)]
        self._posted[rid] = frames
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass  # the queue towards an unconnected producer is full: sent again when the connection is made
        return rid

    def adopt(self, other: PostedRequests) -> None:
        """Take over ``other``'s posted requests (sent again here, with their ids) and the answers it holds."""
        self._take_posted(other)
        self._resend_posted()

    def _resend_posted(self) -> None:
        for frames in self._posted.values():
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                break

    def collect(self, timeout_s: float = 0.0) -> None:
        """Receive answers to posted requests for up to ``timeout_s`` (until none is outstanding)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._poller.poll(0):
                if self._events():
                    self._resend_posted()
                self._receive(None)
            left = deadline - time.monotonic()
            if not self._posted or left <= 0:
                return
            self._poller.poll(max(1, min(int(left * 1000) + 1, 100)))

    def close(self) -> None:
        """Close the connection (pending answers are dropped)."""
        sock = getattr(self, "_sock", None)
        if sock is None:
            return
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        mon = getattr(self, "_mon", None)
        if mon is not None:
            mon.close(linger=0)
        sock.close(linger=0)
        self._sock = None  # type: ignore[assignment]
