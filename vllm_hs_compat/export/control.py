"""The export control plane on ZeroMQ: one ROUTER socket per producer process served by one thread (no thread
per connection), DEALER clients; messages are the typed structs of :mod:`vllm_hs_compat.export.protocol`.

Security (see docs/export.md, "Security model"):

* **CURVE** on every connection.  The producer's key pair is derived from the trainer token, so a trainer that
  holds the token knows the producer's public key and the producer proves it holds the token by completing the
  handshake (a process that grabbed a recycled port cannot).  A ticket carries the producer's *public* key for
  ticket holders.  Messages are encrypted and authenticated (the hidden states themselves move over the data
  transport, in clear).
* **Who is asking** is decided in the handshake by a ZAP handler on the server's own thread: a client whose
  CURVE key is the one derived from the token is the ``trainer``; any other client that completes the handshake
  is a ``record`` principal, which may only present a ticket's capability for one record.  Peers that do not
  complete the handshake within ``handshake_timeout_s`` never deliver a message; they are counted.
* **Bounded before allocation**: ``zmq.MAXMSGSIZE`` (32 KiB + the CURVE box) refuses a longer frame as soon as
  its header arrives, high-water marks bound queues, replies never block the serving thread (``ROUTER_MANDATORY``
  + non-blocking sends: a reply that cannot be queued is counted and dropped, the client retries by request id).

A long poll (``claim_next`` with ``wait_s``) is parked, not slept on: the handler answers ``None``, the request
waits in a bounded queue and is retried when the producer signals a publish (:meth:`ControlServer.wake`) or its
deadline passes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Final

import msgspec
import zmq
from zmq.utils import z85

from vllm_hs_compat import errors as E
from vllm_hs_compat.export import protocol as P

log = logging.getLogger(__name__)

PROTO: Final = P.WIRE_VERSION
MIN_TOKEN_CHARS: Final = 16

#: error code on the wire <-> exception class.  Unlisted codes become RemoteError.
ERROR_CODES: Final[dict[str, type[E.ExportError]]] = {
    "auth": E.AuthError,
    "capability": E.CapabilityError,
    "wire_version": E.WireVersionError,
    "protocol": E.ProtocolError,
    "unknown_record": E.UnknownRecordError,
    "failed_record": E.RecordFailedError,
    "lease_expired": E.LeaseExpiredError,
    "config": E.ExportConfigError,
    "timeout": E.ExportTimeoutError,
    "closed": E.ExportClosedError,
    "stale": E.StaleMetadataError,
    "descriptor": E.DescriptorError,
}


def error_code(exc: BaseException) -> str:
    """The wire code of an export error (the most specific class listed in :data:`ERROR_CODES`)."""
    for code, cls in ERROR_CODES.items():
        if type(exc) is cls:
            return code
    for code, cls in ERROR_CODES.items():
        if isinstance(exc, cls):
            return code
    return "internal"


def new_token() -> str:
    """A fresh trainer token (``secrets.token_urlsafe(32)``)."""
    import secrets

    return secrets.token_urlsafe(32)


#: The trainer credential: the token itself, or the file holding it.
TOKEN_ENV = "VLLM_HS_COMPAT_EXPORT_TOKEN"
TOKEN_FILE_ENV = "VLLM_HS_COMPAT_EXPORT_TOKEN_FILE"


def default_token_file() -> Path:
    """``$VLLM_HS_COMPAT_EXPORT_TOKEN_FILE``, else ``~/.cache/vllm-hs-compat/export.token``."""
    env = os.environ.get(TOKEN_FILE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "vllm-hs-compat" / "export.token"


def load_or_create_token(path: str | os.PathLike[str] | None = None) -> tuple[str, Path | None]:
    """The producer's token: ``$VLLM_HS_COMPAT_EXPORT_TOKEN`` if set, else the token file (created ``0600``
    with a fresh token when absent, so every producer of one deployment and its trainers share it).  Returns
    the token and the file it lives in (None when it came from the environment)."""
    env = os.environ.get(TOKEN_ENV)
    if env:
        return check_token(env), None
    file = Path(path) if path is not None else default_token_file()
    file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token(file), file
    with os.fdopen(fd, "w") as f:
        token = new_token()
        f.write(token + "\n")
    return token, file


def read_token(path: str | os.PathLike[str] | None = None) -> str:
    """The trainer credential: ``$VLLM_HS_COMPAT_EXPORT_TOKEN``, else the token file (``path``, or
    :func:`default_token_file`).  Raises :class:`ExportConfigError` naming both when neither exists."""
    env = os.environ.get(TOKEN_ENV)
    if env and path is None:
        return check_token(env)
    file = Path(path) if path is not None else default_token_file()
    try:
        text = file.read_text().strip()
    except FileNotFoundError:
        raise E.ExportConfigError(
            f"no export token: set {TOKEN_ENV}, or point {TOKEN_FILE_ENV} (or token_file=) at the token file the "
            f"serving worker writes (default {default_token_file()}; its path is logged at start-up)"
        ) from None
    return check_token(text)


def check_token(token: str) -> str:
    """``token`` if it is a str of at least 16 characters, else :class:`ExportConfigError`."""
    if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
        raise E.ExportConfigError(
            f"auth token must be a str of at least {MIN_TOKEN_CHARS} characters, found "
            f"{type(token).__name__} of length {len(token) if isinstance(token, str) else 0}; "
            "leave it unset to have one generated"
        )
    return token


def curve_keys(token: str, role: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` CURVE keys (Z85) of the ``"server"`` (every producer keyed by ``token``) or the
    ``"trainer"``, derived from the token: ``secret = HMAC-SHA256(token, "hs-compat curve <role> v1")``."""
    if role not in ("server", "trainer"):
        raise E.ExportConfigError(f"curve key role must be 'server' or 'trainer', found {role!r}")
    seed = hmac.new(token.encode(), b"hs-compat curve " + role.encode() + b" v1", hashlib.sha256).digest()
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


def server_key(token: str) -> str:
    """The public CURVE key (Z85 text) of producers keyed by ``token``: the ticket's ``server_key``."""
    return curve_keys(check_token(token), "server")[0].decode("ascii")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or either with ZeroMQ's ``tcp://`` prefix -> ``(host, port)``."""
    if not isinstance(endpoint, str) or ":" not in endpoint:
        raise E.ExportConfigError(f"endpoint must look like 'host:port', found {endpoint!r}")
    address = endpoint[len("tcp://") :] if endpoint.startswith("tcp://") else endpoint
    host, _, port_s = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_s)
    except ValueError:
        raise E.ExportConfigError(f"endpoint {endpoint!r} has a non-numeric port") from None
    if not 0 < port < 65536 or not host:
        raise E.ExportConfigError(f"endpoint {endpoint!r} needs a host and a port in 1..65535")
    return host, port


def _zmq_addr(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


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
#: Every frame a server accepts: the largest request plus the CURVE message box around it.
_SERVER_MAXMSGSIZE: Final = P.MAX_REQUEST_BYTES + 256
ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"


@dataclasses.dataclass(slots=True)
class Call:
    """One request as the handler sees it: who asks (``"trainer"`` or ``"record"``), its id, and whether this is
    the last try (``final``: the handler must answer, not park)."""

    principal: str
    rid: bytes
    final: bool


#: ``handler(request, call)`` answers a request, or returns None to park a long poll (only when not final).
Handler = Callable[[P.Request, Call], "P.Reply | None"]


@dataclasses.dataclass(slots=True)
class _Parked:
    ident: bytes
    req: P.Request
    call: Call
    deadline: float


class ControlServer:
    """The producer's control endpoint: a CURVE ROUTER socket and its ZAP handler, served by one thread.

    ``handler`` runs on that thread for every decoded, validated request.  ``producer`` (the instance id) is
    stamped on every reply, so a client notices a restarted producer at its first answer."""

    def __init__(
        self,
        handler: Handler,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        producer: str,
        handshake_timeout_s: float = 5.0,
        heartbeat_s: float = 10.0,
        max_parked: int = 1024,
    ) -> None:
        self._handler = handler
        token = check_token(token)
        self._producer = producer.encode("ascii")
        self._trainer_key = z85.decode(curve_keys(token, "trainer")[0])
        public, secret = curve_keys(token, "server")
        self.server_key = public.decode("ascii")
        self._max_parked = max_parked
        self._parked: OrderedDict[tuple[str, bytes], _Parked] = OrderedDict()
        #: bumped by every wake() (any thread); the serving thread re-checks a long poll it has just parked if
        #: this moved while it was answering it (a publish in between found nothing parked to wake)
        self._wakes = 0
        self._wake_pending = False  # a byte is in the wake pipe that the serving thread has not read yet
        self._recheck = False
        self._stopping = False
        self.counters: dict[str, int] = {
            "connections": 0,
            "handshakes": 0,
            "handshake_failures_protocol": 0,
            "handshake_failures_auth": 0,
            "handshake_failures_other": 0,
            "disconnects": 0,
            "zap_trainer": 0,
            "zap_record": 0,
            "requests": 0,
            "bad_frames": 0,
            "request_errors": 0,
            "capability_refusals": 0,
            "internal_errors": 0,
            "parked": 0,
            "replies_dropped": 0,
        }
        self._ctx = zmq.Context(io_threads=1)
        try:
            self._zap = self._ctx.socket(zmq.REP)
            self._zap.linger = 0
            self._zap.bind(ZAP_ENDPOINT)
            s = self._ctx.socket(zmq.ROUTER)
            self._sock = s
            s.linger = 0
            if ":" in host:
                s.ipv6 = True
            s.curve_server = True
            s.curve_secretkey = secret
            s.zap_domain = b"hsx"
            s.setsockopt(zmq.MAXMSGSIZE, _SERVER_MAXMSGSIZE)
            s.setsockopt(zmq.HANDSHAKE_IVL, int(handshake_timeout_s * 1000))
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            s.setsockopt(zmq.SNDHWM, 1000)
            # RCVHWM 0 (no limit), never a finite one, and never ROUTER_HANDOVER: libzmq 4.3.5 (and master) aborts
            # the process when a connection's engine stops reading (its session pipe is full at RCVHWM, or has
            # none after a handover) and the peer resets: stream_engine_base.cpp in_event_internal sets
            # _io_error (l. 249) and keeps the engine, and the next heartbeat tick (timer_event, l. 737) or a
            # buffered PING (zmtp_engine.cpp l. 527) calls out_event, which asserts !_io_error (l. 310).  A peer
            # fills a pipe by pipelining or, at once, by announcing a routing id already connected (the ROUTER
            # never reads that pipe).  Cost: a connection's unread requests are no longer capped at 1000 messages
            # (a duplicate-id connection's pipe grows until it disconnects): a byte bound per peer must come
            # from the serving pattern, never from RCVHWM.
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.TCP_KEEPALIVE, 1)
            s.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * heartbeat_s * 1000))
            self._mon = s.get_monitor_socket(_MONITOR_EVENTS)
            try:
                s.bind(_zmq_addr(host, port if port else "*"))
            except zmq.ZMQError as e:
                raise E.ExportConfigError(
                    f"control plane cannot bind {host}:{port}: {e}; pass port=0 for an ephemeral port, or another "
                    "bind address"
                ) from None
            last = s.getsockopt_string(zmq.LAST_ENDPOINT)
            self.address: tuple[str, int] = (host, int(last.rsplit(":", 1)[1]))
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._wake_lock = threading.Lock()
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="hsx-control", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """``host:port`` of the bind address."""
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def wake(self) -> None:
        """Retry parked long polls now (the producer calls it after each publish; any thread; a no-op once
        closed).  Costs a pipe write (and a wake-up of the serving thread) only when a long poll is parked and
        no wake-up is pending already: a publish with nobody waiting costs an increment."""
        self._wakes += 1
        if not self._parked or self._wake_pending:
            return
        with self._wake_lock:
            if self._wake_w < 0:
                return
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full: a retry is pending anyway

    # --- the serving thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_retry = 0.0
        try:
            while not self._stopping:
                now = time.monotonic()
                timeout_ms = 50 if self._parked else 200
                if self._parked:
                    first = min(p.deadline for p in self._parked.values())
                    timeout_ms = max(0, min(timeout_ms, int((first - now) * 1000) + 1))
                ready = dict(poller.poll(timeout_ms))
                woke = False
                if self._zap in ready:
                    self._serve_zap()
                if self._mon in ready:
                    self._drain_monitor()
                if self._wake_r in ready:
                    woke = True
                    self._wake_pending = False  # before draining: a wake() from now on writes again
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                if self._sock in ready:
                    self._serve_requests()
                if self._recheck:
                    self._recheck = False
                    woke = True
                now = time.monotonic()
                if self._parked and (woke or now >= next_retry):
                    self._retry_parked(now)
                    next_retry = now + 0.05
            # shutting down: answer every parked long poll (empty), then stop
            self._retry_parked(float("inf"))
        except Exception:  # the serving thread must never die silently
            log.exception("export control plane stopped")
        finally:
            for sock in (self._mon, self._sock, self._zap):
                try:
                    sock.close(linger=0)
                except zmq.ZMQError:
                    pass

    def _serve_zap(self) -> None:
        """ZAP (RFC 27): decide the principal of a connection that completed the CURVE handshake."""
        for _ in range(256):
            try:
                frames = self._zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            req_id = frames[1] if len(frames) > 1 else b""
            key = frames[6] if len(frames) > 6 and frames[5] == b"CURVE" else b""
            if len(frames) < 6:
                self._zap.send_multipart([b"1.0", req_id, b"500", b"malformed ZAP request", b"", b""])
                continue
            trainer = len(key) == 32 and hmac.compare_digest(key, self._trainer_key)
            self.counters["zap_trainer" if trainer else "zap_record"] += 1
            user = b"trainer" if trainer else b"record"
            self._zap.send_multipart([b"1.0", req_id, b"200", b"OK", user, b""])

    def _drain_monitor(self) -> None:
        names: dict[int, str] = {
            zmq.EVENT_ACCEPTED: "connections",
            zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshakes",
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failures_protocol",
            zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_failures_auth",
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failures_other",
            zmq.EVENT_DISCONNECTED: "disconnects",
        }
        for _ in range(1024):
            try:
                msg = self._mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = _monitor_event(msg)
            except Exception:  # a malformed monitor message is libzmq's bug, not a reason to stop serving
                continue
            key = names.get(event)
            if key is not None:
                self.counters[key] += 1

    def _serve_requests(self) -> None:
        for _ in range(256):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._one(frames)

    def _one(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        rid = frames[2].bytes if len(frames) >= 3 else b""
        if len(frames) != 4 or len(rid) != P.RID_BYTES:
            self.counters["bad_frames"] += 1
            if len(frames) >= 3:
                self._send(
                    ident,
                    rid,
                    P.ErrorReply("protocol", f"expected 3 frames (header, rid, body), got {len(frames) - 1}"),
                )
            return
        try:
            P.check_header(frames[1].bytes)
            req = P.decode_request(frames[3].buffer)
        except E.ProtocolError as e:
            self.counters["bad_frames"] += 1
            self._send(ident, rid, P.ErrorReply(error_code(e), str(e)))
            return
        self.counters["requests"] += 1
        principal = "trainer" if frames[3].get("User-Id") == "trainer" else "record"
        key = (principal, rid)
        parked = self._parked.get(key)
        if parked is not None:  # the client resent a parked long poll (it reconnected): answer the new route
            parked.ident = ident
            return
        wait = float(getattr(req, "wait_s", 0.0))
        call = Call(principal, rid, final=wait <= 0.0)
        wakes = self._wakes
        rep = self._answer(req, call)
        if rep is None:
            if len(self._parked) >= self._max_parked:
                call.final = True
                rep = self._answer(req, call)
            else:
                self.counters["parked"] += 1
                self._parked[key] = _Parked(ident, req, call, time.monotonic() + wait)
                if self._wakes != wakes:  # published while answering: nothing was parked to wake yet
                    self._recheck = True
                return
        if rep is not None:  # _answer never leaves a final call unanswered
            self._send(ident, rid, rep)

    def _answer(self, req: P.Request, call: Call) -> P.Reply | None:
        try:
            rep = self._handler(req, call)
            if rep is None and call.final:
                raise E.ExportError(f"handler left a final {type(req).__name__} unanswered")
            return rep
        except E.ExportError as e:
            self.counters["request_errors"] += 1
            if isinstance(e, E.CapabilityError):
                self.counters["capability_refusals"] += 1
            return P.ErrorReply(error_code(e), str(e)[:8000])
        except Exception as e:  # a bad request fails alone, never the producer
            self.counters["internal_errors"] += 1
            log.exception("control request %s failed", type(req).__name__)
            return P.ErrorReply("internal", f"{type(e).__name__}: {e}"[:8000])

    def _retry_parked(self, now: float) -> None:
        for key in list(self._parked):
            p = self._parked[key]
            p.call.final = now >= p.deadline or self._stopping
            rep = self._answer(p.req, p.call)
            if rep is not None:
                del self._parked[key]
                self._send(p.ident, key[1], rep)

    def _send(self, ident: bytes, rid: bytes, rep: P.Reply) -> None:
        try:
            body = P.encode(rep)
        except (msgspec.EncodeError, TypeError, ValueError, OverflowError) as e:
            self.counters["internal_errors"] += 1
            log.error("cannot encode a %s reply: %s", type(rep).__name__, e)
            body = P.encode(P.ErrorReply("internal", f"reply could not be encoded: {e}"[:8000]))
        try:
            self._sock.send_multipart([ident, P.HEADER, rid, self._producer, body], zmq.NOBLOCK)
        except zmq.ZMQError:  # peer gone (EHOSTUNREACH) or its queue is full (EAGAIN): it retries by request id
            self.counters["replies_dropped"] += 1

    def close(self) -> None:
        """Answer parked long polls, close the socket and stop the thread (within 5 s)."""
        self._stopping = True
        self.wake()
        self._thread.join(timeout=5.0)
        self._ctx.destroy(linger=0)
        with self._wake_lock:  # after the thread: no one polls the pipe any more, and wake() becomes a no-op
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1


# --- client -------------------------------------------------------------------------------------------------------
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


class ControlClient:
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
    ) -> None:
        self.endpoint = endpoint
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
        self.principal = "trainer" if token is not None else "record"
        self.stale_replies = 0
        self.resends = 0
        #: requests sent with :meth:`post` whose answers have not arrived: rid -> frames (resent after a drop)
        self._posted: dict[bytes, list[bytes]] = {}
        #: answers to posted requests, in arrival order: (rid, (reply, producer) or the error it raised)
        self._answers: list[tuple[bytes, tuple[P.Reply, str] | E.HsCompatError]] = []
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
            sock.connect(_zmq_addr(host, port))
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
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
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

    def call(self, req: P.Request, timeout_s: float | None = None) -> tuple[P.Reply, str]:
        """Send one request and wait for its answer: ``(reply, producer instance)``.  An error answer raises the
        mapped named error; no answer by the deadline raises :class:`ExportTimeoutError`
        (:class:`ProducerUnreachableError` when no connection was ever made)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        rid = P.new_rid()
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
            cls = ERROR_CODES.get(rep.code, E.RemoteError)
            raise cls(rep.message)
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

    def answers(self) -> list[tuple[bytes, tuple[P.Reply, str] | E.HsCompatError]]:
        """Answers to posted requests received so far (each handed out once)."""
        out, self._answers = self._answers, []
        return out

    @property
    def outstanding(self) -> int:
        """Posted requests not answered yet."""
        return len(self._posted)

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
