"""The trainer's plain control channel: control requests and answers over a bare TCP connection, past ZeroMQ.

A ZeroMQ request crosses six threads (the caller, its socket's I/O thread, the producer's I/O thread, the serving
thread, and back) and CURVE encrypts both ways; on two vCPUs that is most of a small fetch (a 64 KiB answer's round
trip between two Python processes, nothing else: CURVE ``DEALER``/``ROUTER`` 0.44 ms, the same over a bare TCP
socket 0.06 ms; docs/benchmarks.md "Seventh round").  This channel carries the same frames between the caller's
thread and the producer's serving thread, nothing in between.  It serves the trainer only (the token holder);
ticket holders always go through the gate.

**What it protects, and what not.**  The connection is authenticated both ways before any request is read: the
producer sends a fresh 32-byte challenge, the trainer answers ``HMAC-SHA256(k, "c" | server nonce | client
nonce)`` with its own nonce, the producer proves itself with ``HMAC-SHA256(k, "s" | client nonce | server
nonce)``; ``k`` is derived from the token (:func:`plain_key`), which never crosses the connection.  Nobody without
the token is served, and the trainer knows it reached a producer of its token.  The frames are neither encrypted
nor MACed: the channel carries what the data plane (NIXL over TCP, or same-host memory) carries -- record bytes,
their metadata, the trainer's own leases -- with the data plane's protection, none against an on-path attacker who
reads or rewrites TCP.  Where the trainer reaches the producer over a network it does not trust, turn it off:
``ExportProducer(plain_port=None)`` or ``ExportConsumer(plain=False)`` (CURVE all the way, as the data then needs
its own protection too).

Wire (after the handshake), little-endian: a request is ``u32 n`` then ``n`` bytes: the wire header, the request
id, the msgpack body (the CURVE path's three frames, concatenated); an answer is ``u32 n`` then the header, the
request id, ``u8 m`` and the producer instance id (``m`` bytes), the body.

**Bounds** (the port is reachable by anyone who reaches the control port): at most ``MAX_PENDING`` connections
mid-handshake (more are closed at once), each given ``handshake_s`` and exactly its 64 answer bytes; after it, a
frame longer than the control plane's request bound closes the connection, and so does a reply backlog past the
trainer's ``reply_backlog_bytes_trainer``; at most ``MAX_CONNECTIONS`` authenticated connections.  Every drop is
counted (``plain_*``).  Nothing here can abort the process: no libzmq, only the standard library's sockets.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Final

from vllm_hs_compat import errors as E
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.client import PostedRequests
from vllm_hs_compat.export.credentials import check_token, plain_key
from vllm_hs_compat.export.protocol import parse_endpoint

log = logging.getLogger(__name__)

#: What the producer sends first: this magic and its 32-byte challenge.
MAGIC: Final = b"hsxP1"
NONCE_BYTES: Final = 32
MAC_BYTES: Final = 32
#: Connections mid-handshake at once; more are closed as they are accepted (counted ``plain_refused``).
MAX_PENDING: Final = 64
#: Authenticated connections at once (a trainer opens one per consumer: ranks x DataLoader workers x producers).
MAX_CONNECTIONS: Final = 4096
_LEN = struct.Struct("<I")
_RECV_BYTES = 1 << 18

#: The counters a :class:`PlainServer` keeps (reported with the control plane's).
PLAIN_COUNTERS: Final = (
    "plain_accepted",
    "plain_authenticated",
    "plain_refused",
    "plain_bad_handshakes",
    "plain_handshake_timeouts",
    "plain_bad_frames",
    "plain_backlog_drops",
    "plain_requests",
    "plain_replies_dropped",
)


def _mac(key: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.digest(key, role + a + b, "sha256")


class _Conn:
    __slots__ = ("authed", "deadline", "fd", "id", "inbuf", "nonce", "out", "out_bytes", "sock")

    def __init__(self, sock: socket.socket, deadline: float, conn_id: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        #: never reused (a descriptor is): an answer for a closed connection never reaches a later one
        self.id = conn_id
        self.authed = False
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.deadline = deadline
        self.inbuf = bytearray()
        self.out: list[bytes | memoryview] = []
        self.out_bytes = 0


#: ``(connection id, header, request id, body)`` of one request read from a connection.
PlainRequest = tuple[int, bytes, bytes, bytes]


class PlainServer:
    """The producer's side: a listening socket and its connections, served from the control plane's serving
    thread (``watch(fd, events)`` / ``unwatch(fd)`` register descriptors with its ``select.poll``; every method
    is called from that thread)."""

    def __init__(
        self,
        host: str,
        port: int,
        key: bytes,
        *,
        handshake_s: float,
        max_frame: int,
        backlog_bytes: int,
        watch: Callable[[int, int], None],
        unwatch: Callable[[int], None],
    ) -> None:
        self._key = key
        self._handshake_s = handshake_s
        self._max_frame = max_frame
        self._backlog = backlog_bytes
        self._watch, self._unwatch = watch, unwatch
        self.counters: dict[str, int] = dict.fromkeys(PLAIN_COUNTERS, 0)
        self._conns: dict[int, _Conn] = {}  # by descriptor
        self._by_id: dict[int, _Conn] = {}
        self._next_id = 0
        self._pending = 0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        ls = socket.socket(family, socket.SOCK_STREAM)
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((host, port))
            ls.listen(128)
            ls.setblocking(False)
        except OSError as e:
            ls.close()
            raise E.ExportConfigError(
                f"control plane cannot bind its plain channel on {host}:{port}: {e}; pass plain_port=0 for an "
                "ephemeral port, or plain_port=None for none"
            ) from None
        self._listener = ls
        self.fd = ls.fileno()
        self.port: int = ls.getsockname()[1]

    def owns(self, fd: int) -> bool:
        """Whether ``fd`` is this server's (its listener or a connection)."""
        return fd == self.fd or fd in self._conns

    def ready(self, fd: int, events: int, out: list[PlainRequest]) -> None:
        """Serve what the poller reported for ``fd`` (``events``: ``select.poll``'s bits); complete
        requests are appended to ``out``."""
        if fd == self.fd:
            self._accept()
            return
        conn = self._conns.get(fd)
        if conn is None:
            return
        if events & select.POLLOUT:
            self._flush(conn)
        if events & (select.POLLIN | select.POLLERR | select.POLLHUP) and fd in self._conns:
            self._read(conn, out)

    def expire(self, now: float) -> None:
        """Close connections whose handshake ran past its deadline."""
        if not self._pending:
            return
        for conn in [c for c in self._conns.values() if not c.authed and now >= c.deadline]:
            self.counters["plain_handshake_timeouts"] += 1
            self._drop(conn)

    def next_deadline(self) -> float | None:
        """The earliest handshake deadline (None when no handshake is pending)."""
        if not self._pending:
            return None
        return min(c.deadline for c in self._conns.values() if not c.authed)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: the listener stays; the peer sees a reset
                log.warning("plain control channel: accept failed: %s", e)
                return
            self.counters["plain_accepted"] += 1
            if self._pending >= MAX_PENDING or len(self._conns) >= MAX_CONNECTIONS:
                self.counters["plain_refused"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._next_id += 1
            conn = _Conn(sock, time.monotonic() + self._handshake_s, self._next_id)
            self._conns[conn.fd] = conn
            self._by_id[conn.id] = conn
            self._pending += 1
            self._watch(conn.fd, select.POLLIN)
            self._queue(conn, [MAGIC + conn.nonce])

    def _read(self, conn: _Conn, out: list[PlainRequest]) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            self._drop(conn)
            return
        buf = conn.inbuf
        buf += data
        if not conn.authed:
            need = NONCE_BYTES + MAC_BYTES
            if len(buf) < need:
                return
            theirs, mac = bytes(buf[:NONCE_BYTES]), bytes(buf[NONCE_BYTES:need])
            if len(buf) > need or not self._accepts(conn.nonce, theirs, mac):
                self.counters["plain_bad_handshakes"] += 1
                self._drop(conn)
                return
            del buf[:need]
            conn.authed = True
            self._pending -= 1
            self.counters["plain_authenticated"] += 1
            self._queue(conn, [_mac(self._key, b"s", theirs, conn.nonce)])
            return
        head = len(P.HEADER) + P.RID_BYTES
        at = 0
        while len(buf) - at >= 4:
            (n,) = _LEN.unpack_from(buf, at)
            if n < head or n > self._max_frame:
                self.counters["plain_bad_frames"] += 1
                self._drop(conn)
                return
            if len(buf) - at - 4 < n:
                break
            frame = bytes(buf[at + 4 : at + 4 + n])
            at += 4 + n
            self.counters["plain_requests"] += 1
            out.append((conn.id, frame[: len(P.HEADER)], frame[len(P.HEADER) : head], frame[head:]))
        if at:
            del buf[:at]

    def _accepts(self, nonce: bytes, theirs: bytes, mac: bytes) -> bool:
        """Whether ``mac`` answers this server's challenge ``nonce`` (with the client's ``theirs``) under the key."""
        return hmac.compare_digest(mac, _mac(self._key, b"c", nonce, theirs))

    def send(self, conn_id: int, rid: bytes, producer: bytes, body: bytes) -> None:
        """Queue an answer on connection ``conn_id``; one for a connection that is gone is dropped and counted
        (``plain_replies_dropped``: the trainer sends the request again through the gate, by request id)."""
        conn = self._by_id.get(conn_id)
        if conn is None or not conn.authed:
            self.counters["plain_replies_dropped"] += 1
            return
        n = len(P.HEADER) + len(rid) + 1 + len(producer) + len(body)
        self._queue(conn, [_LEN.pack(n) + P.HEADER + rid + bytes((len(producer),)) + producer, body])

    def _queue(self, conn: _Conn, parts: list[bytes]) -> None:
        """Send ``parts`` now, as far as the socket takes them; the rest waits for POLLOUT, within the backlog."""
        rest: list[bytes | memoryview] = list(parts)
        if not conn.out:
            try:
                sent = conn.sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(conn)
                return
            while rest and sent >= len(rest[0]):
                sent -= len(rest.pop(0))
            if rest:
                rest[0] = memoryview(rest[0])[sent:]
                self._watch(conn.fd, select.POLLIN | select.POLLOUT)
        conn.out.extend(rest)
        conn.out_bytes += sum(len(p) for p in rest)
        if conn.out_bytes > self._backlog:
            self.counters["plain_backlog_drops"] += 1
            log.warning("plain control channel: a trainer connection left %d reply bytes unread; dropped it",
                        conn.out_bytes)  # fmt: skip
            self._drop(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            try:
                sent = conn.sock.send(conn.out[0])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(conn)
                return
            head = conn.out[0]
            conn.out_bytes -= sent
            if sent < len(head):
                conn.out[0] = memoryview(head)[sent:]
                return
            conn.out.pop(0)
        self._watch(conn.fd, select.POLLIN)

    def _drop(self, conn: _Conn) -> None:
        if self._by_id.pop(conn.id, None) is None:
            return
        self._conns.pop(conn.fd, None)
        if not conn.authed:
            self._pending -= 1
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._unwatch(conn.fd)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def close(self) -> None:
        """Close every connection and the listener."""
        for conn in list(self._conns.values()):
            self._drop(conn)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._unwatch(self.fd)
        with contextlib.suppress(OSError):
            self._listener.close()


class PlainClient(PostedRequests):
    """The trainer's side: one authenticated connection to a producer's plain channel, with
    :class:`~vllm_hs_compat.export.control.ControlClient`'s interface (``call``, ``post``, ``collect``,
    ``answers``, ``adopt``).  No reconnection: any failure closes it and raises
    :class:`ProducerUnreachableError` (a timeout :class:`ExportTimeoutError`), and the consumer's channel goes back
    to the CURVE connection with the same request id.  Not thread-safe: one client per thread."""

    principal: Final = "trainer"

    def __init__(self, endpoint: str, token: str, timeout_s: float, *, max_reply_bytes: int) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.max_reply_bytes = max_reply_bytes
        self.stale_replies = 0
        self._key = plain_key(check_token(token))
        self._max_frame = max_reply_bytes + 2 * P.REPLY_OVERHEAD
        host, port = parse_endpoint(endpoint)
        deadline = time.monotonic() + timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as e:
            raise E.ProducerUnreachableError(f"no plain control connection to {endpoint}: {e}") from None
        self._sock: socket.socket | None = sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            greeting = self._exact(len(MAGIC) + NONCE_BYTES, deadline)
            if bytes(greeting[: len(MAGIC)]) != MAGIC:
                raise E.AuthError(f"{endpoint} is not a vllm-hs-compat plain control channel (it greeted otherwise)")
            theirs, mine = bytes(greeting[len(MAGIC) :]), secrets.token_bytes(NONCE_BYTES)
            self._send_all(mine + _mac(self._key, b"c", theirs, mine), deadline)
            proof = self._exact(MAC_BYTES, deadline)
            if not hmac.compare_digest(bytes(proof), _mac(self._key, b"s", mine, theirs)):
                raise E.AuthError(f"the plain control channel at {endpoint} is not keyed by this token")
        except E.ProducerUnreachableError as e:  # closed during the handshake: the token was refused
            self.close()
            raise E.AuthError(
                f"the plain control channel at {endpoint} closed the handshake ({e}): the token does not match the "
                "producer listening there"
            ) from None
        except BaseException:
            self.close()
            raise

    # --- the socket -----------------------------------------------------------------------------------------------
    def _broken(self, why: str) -> E.ProducerUnreachableError:
        self.close()
        return E.ProducerUnreachableError(f"the plain control connection to {self.endpoint} {why}")

    def _exact(self, n: int, deadline: float) -> memoryview:
        sock = self._sock
        if sock is None:
            raise E.ExportClosedError("plain control client is closed")
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout()
            sock.settimeout(left)
            try:
                k = sock.recv_into(view[got:], n - got)
            except TimeoutError:
                raise self._timeout() from None
            except OSError as e:
                raise self._broken(f"failed: {e}") from None
            if k == 0:
                raise self._broken("was closed by the producer")
            got += k
        return view

    def _timeout(self) -> E.ExportTimeoutError:
        # a frame may be half read: the stream cannot be trusted any more
        self.close()
        return E.ExportTimeoutError(f"no answer on the plain control connection to {self.endpoint} in time")

    def _send_all(self, data: bytes, deadline: float) -> None:
        sock = self._sock
        if sock is None:
            raise E.ExportClosedError("plain control client is closed")
        sock.settimeout(max(1e-3, deadline - time.monotonic()))
        try:
            sock.sendall(data)
        except TimeoutError:
            raise self._timeout() from None
        except OSError as e:
            raise self._broken(f"failed: {e}") from None

    def _frame(self, frames: list[bytes]) -> bytes:
        n = sum(len(f) for f in frames)
        return _LEN.pack(n) + b"".join(frames)

    def _next(self, deadline: float) -> tuple[bytes, tuple[P.Reply, str] | E.HsCompatError]:
        """The next answer on the connection: its request id and the reply (or the error it carries)."""
        (n,) = _LEN.unpack(self._exact(4, deadline))
        head = len(P.HEADER) + P.RID_BYTES
        if n < head + 1 or n > self._max_frame:
            raise self._broken(f"sent a frame of {n} bytes (expected {head + 1}..{self._max_frame})")
        view = self._exact(n, deadline)
        try:
            P.check_header(bytes(view[: len(P.HEADER)]))
        except E.ProtocolError as e:
            self.close()
            raise e from None
        rid = bytes(view[len(P.HEADER) : head])
        m = view[head]
        producer = bytes(view[head + 1 : head + 1 + m]).decode("ascii", "replace")
        try:
            rep = P.decode_reply(view[head + 1 + m :])
        except E.HsCompatError as e:
            return rid, e
        if isinstance(rep, P.ErrorReply):
            return rid, P.remote_error(rep)
        return rid, (rep, producer)

    # --- ControlClient's interface -----------------------------------------------------------------------------
    def call(self, req: P.Request, timeout_s: float | None = None, rid: bytes | None = None) -> tuple[P.Reply, str]:
        """Send one request and wait for its answer: ``(reply, producer instance)``; an error answer raises the
        mapped named error."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        rid = P.new_rid() if rid is None else rid
        deadline = time.monotonic() + timeout
        self._send_all(self._frame([P.HEADER, rid, P.encode(req)]), deadline)
        while True:
            got, answer = self._next(deadline)
            if got == rid:
                if isinstance(answer, E.HsCompatError):
                    raise answer
                return answer
            if not self._file(got, answer):
                self.stale_replies += 1

    def post(self, req: P.Request) -> bytes:
        """Send ``req`` without waiting; its answer is collected by a later :meth:`call` or :meth:`collect`."""
        rid = P.new_rid()
        frames = [P.HEADER, rid, P.encode(req)]
        self._posted[rid] = frames
        self._send_all(self._frame(frames), time.monotonic() + self.timeout_s)
        return rid

    def collect(self, timeout_s: float = 0.0) -> None:
        """Receive answers to posted requests for up to ``timeout_s`` (until none is outstanding)."""
        deadline = time.monotonic() + timeout_s
        if self._sock is None:
            return
        waiter = select.poll()
        waiter.register(self._sock, select.POLLIN)
        while self._posted and self._sock is not None:
            if not waiter.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                return
            got, answer = self._next(time.monotonic() + self.timeout_s)  # a frame has begun: read it whole
            if not self._file(got, answer):
                self.stale_replies += 1

    def adopt(self, other: PostedRequests) -> None:
        """Take over ``other``'s posted requests (sent again here, with their ids) and the answers it holds."""
        for frames in self._take_posted(other):
            self._send_all(self._frame(frames), time.monotonic() + self.timeout_s)

    def close(self) -> None:
        """Close the connection (pending answers are dropped)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
