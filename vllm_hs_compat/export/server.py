"""The control plane's server: :class:`ControlServer`, one serving thread that answers every request -- those the
gate forwards (the gate process is :mod:`~vllm_hs_compat.export.gate`, started and restarted by
:mod:`~vllm_hs_compat.export.supervisor`), those of the trainer's direct socket (here, with its ZAP handler) and
those of its plain channel (:mod:`~vllm_hs_compat.export.plain`) -- and routes each answer back the way its request
came (see :mod:`vllm_hs_compat.export.control` for the security model)."""

from __future__ import annotations

import dataclasses
import errno
import hmac
import logging
import os
import select
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

import msgspec
import zmq
from zmq.utils import z85

from vllm_hs_compat import errors as E
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.credentials import check_token, curve_keys, plain_key
from vllm_hs_compat.export.plain import PlainRequest, PlainServer
from vllm_hs_compat.export.protocol import error_code, zmq_address
from vllm_hs_compat.export.supervisor import GATE_MIN_MEMORY, GateSupervisor

log = logging.getLogger("vllm_hs_compat.export.control")


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
    route: tuple[bytes, bytes]  # (gate, connection)
    req: P.Request
    call: Call
    deadline: float


@dataclasses.dataclass(frozen=True, slots=True)
class ControlLimits:
    """Per-connection bounds of the control plane (see docs/export.md, "Per-peer bounds").  A connection over the
    reply queue or the requests-in-flight bound is dropped (counted ``control_peers_dropped``)."""

    #: replies queued towards one connection (``ZMQ_SNDHWM`` of the public socket); more wait in its backlog
    reply_queue: int = 4
    #: bytes of replies waiting in one ticket holder's backlog; a reply past it drops the connection (a backlog
    #: always takes one reply, whatever its size)
    reply_backlog_bytes: int = 2 << 20
    #: the same for a trainer's connection (claim replies are up to its ``max_reply_bytes``)
    reply_backlog_bytes_trainer: int = 256 << 20
    #: requests of one ticket holder's connection at the producer, unanswered (parked long polls included)
    max_inflight: int = 16
    #: the same for a trainer's connection (it holds the token; posted releases can come in bursts)
    max_inflight_trainer: int = 4096
    #: long polls one connection may have parked (more are answered at once, empty)
    max_parked_per_peer: int = 4
    #: bytes one ``read`` serves (advertised in ``hello``; consumers read in pieces of it)
    max_read_bytes: int = P.SERVED_READ_BYTES
    #: the gate process's address-space limit (``RLIMIT_AS``), 0 for none
    gate_memory_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        for name, lo, hi in (
            ("reply_queue", 1, 1 << 16),
            ("max_inflight", 1, 1 << 16),
            ("max_inflight_trainer", 1, 1 << 16),
            ("reply_backlog_bytes", 0, 1 << 40),
            ("reply_backlog_bytes_trainer", 0, 1 << 40),
            ("max_parked_per_peer", 0, 1 << 16),
            ("max_read_bytes", 4096, P.MAX_READ_BYTES),
            ("gate_memory_bytes", 0, 1 << 48),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or not lo <= value <= hi:
                raise E.ExportConfigError(f"ControlLimits.{name} must be an int in [{lo}, {hi}], found {value!r}")
        if 0 < self.gate_memory_bytes < GATE_MIN_MEMORY:
            raise E.ExportConfigError(
                f"ControlLimits.gate_memory_bytes={self.gate_memory_bytes} is below the {GATE_MIN_MEMORY} bytes the "
                "gate needs to start (Python, libzmq and its threads); raise it, or pass 0 for no limit"
            )


_OWN_COUNTERS: Final = (
    "requests",
    "bad_frames",
    "request_errors",
    "capability_refusals",
    "internal_errors",
    "parked",
    "parked_over_peer_limit",
    "replies_dropped",
    "restarts",
    "direct_requests",
    "direct_zap_accepted",
    "direct_zap_denied",
    "direct_bad_frames",
    "direct_replies_dropped",
)
#: The ZAP domain of the producer's direct socket (the trainer's path past the gate).
DIRECT_DOMAIN: Final = b"hsx-direct"
#: The route's first part of a request that came on the direct socket (a gate's routing id is never empty).
_DIRECT: Final = b""
_PLAIN: Final = b"plain"  # a gate's routing id is 5 bytes (ZeroMQ's own: 0 + 4 bytes), never this


class ControlServer:
    """The producer's control endpoint.

    The public CURVE socket, its ZAP handler and the per-connection bounds live in a supervised child process,
    the gate (:mod:`vllm_hs_compat.export.gate`), so that no peer can grow or abort the process this server runs
    in; the gate forwards complete, size-checked requests with their principal over a private ``ipc://`` socket
    to this server's thread, which decodes them and runs ``handler``.  A gate that dies is restarted on the same
    port with the same keys (counted ``gate_restarts``, the reason in :attr:`gate_last_exit`); clients reconnect
    and resend by themselves.  ``producer`` (the instance id) is stamped on every reply, so a client notices a
    restarted producer at its first answer."""

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
        limits: ControlLimits | None = None,
        direct: bool = True,
        direct_port: int = 0,
        plain: bool = True,
        plain_port: int = 0,
    ) -> None:
        self._handler = handler
        token = check_token(token)
        self.limits = limits if limits is not None else ControlLimits()
        self._producer = producer.encode("ascii")
        trainer_public = curve_keys(token, "trainer")[0]
        public, secret = curve_keys(token, "server")
        self.server_key = public.decode("ascii")
        self._max_parked = max_parked
        self._parked: OrderedDict[tuple[str, bytes], _Parked] = OrderedDict()
        self._parked_per_route: dict[tuple[bytes, bytes], int] = {}
        #: bumped by every wake() (any thread); the serving thread re-checks a long poll it has just parked if
        #: this moved while it was answering it (a publish in between found nothing parked to wake)
        self._wakes = 0
        self._wake_pending = False  # a byte is in the wake pipe that the serving thread has not read yet
        self._recheck = False
        self._stopping = False
        self._own: dict[str, int] = dict.fromkeys(_OWN_COUNTERS, 0)
        # the standard library's poll, not zmq.Poller: ZeroMQ sockets are watched through their ZMQ_FD (see _serve);
        # zmq.Poller's wake-up after an idle spell cost ~0.1 ms more than select.poll's on the 2-vCPU box
        self._poller = select.poll()
        self._dir = tempfile.mkdtemp(prefix="hsx-gate-")  # 0700: only this user can reach the private socket
        self._backend = f"ipc://{self._dir}/control"
        gate_cfg: dict[str, Any] = {
            "header": P.HEADER.hex(),
            "rid_bytes": P.RID_BYTES,
            "producer": producer,
            "trainer_key": trainer_public.decode("ascii"),
            "secret": secret.decode("ascii"),
            "host": host,
            "maxmsgsize": _SERVER_MAXMSGSIZE,
            "handshake_ms": int(handshake_timeout_s * 1000),
            "heartbeat_ms": int(heartbeat_s * 1000),
            "reply_queue": self.limits.reply_queue,
            "max_inflight": self.limits.max_inflight,
            "max_inflight_trainer": self.limits.max_inflight_trainer,
            "reply_backlog_bytes": self.limits.reply_backlog_bytes,
            "reply_backlog_bytes_trainer": self.limits.reply_backlog_bytes_trainer,
            "memory_bytes": self.limits.gate_memory_bytes,
            "backend": self._backend,
        }
        self._gate = GateSupervisor(gate_cfg, self._poller.register, self._poller.unregister)
        self._trainer_key = z85.decode(trainer_public)
        self._ctx = zmq.Context(io_threads=1)
        self._zap: zmq.Socket[bytes] | None = None
        self._direct: zmq.Socket[bytes] | None = None
        #: the direct socket's bound port (0: none)
        self.direct_port = 0
        self._plain: PlainServer | None = None
        #: the plain channel's bound port (0: none; see :mod:`vllm_hs_compat.export.plain`)
        self.plain_port = 0
        try:
            s = self._ctx.socket(zmq.ROUTER)
            self._sock = s
            s.linger = 0
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            s.setsockopt(zmq.MAXMSGSIZE, _SERVER_MAXMSGSIZE)
            s.setsockopt(zmq.SNDHWM, 10_000)
            # RCVHWM 0: a finite one lets libzmq abort this process (the producer's!) when the gate dies while
            # this socket has stopped reading from it (see gate.py, the public socket's options)
            s.setsockopt(zmq.RCVHWM, 0)
            try:
                s.bind(self._backend)
            except zmq.ZMQError as e:
                raise E.ExportConfigError(
                    f"control plane cannot bind its private socket {self._backend}: {e}; point TMPDIR at a short "
                    "path (an ipc:// path has at most 107 bytes)"
                ) from None
            if direct:
                self._bind_direct(host, direct_port, secret, handshake_timeout_s, heartbeat_s)
            if plain:
                self._plain = PlainServer(
                    host,
                    plain_port,
                    plain_key(token),
                    handshake_s=handshake_timeout_s,
                    max_frame=P.MAX_REQUEST_BYTES + 256,
                    backlog_bytes=self.limits.reply_backlog_bytes_trainer,
                    watch=self._poller.register,
                    unwatch=self._poller.unregister,
                )
                self.plain_port = self._plain.port
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._wake_lock = threading.Lock()
            self._gate.start(port)
            if self._gate.port <= 0:  # pragma: no cover - start raises instead
                raise E.GateError("the control gate reported no port")
            self.address: tuple[str, int] = (host, self._gate.port)
        except BaseException:
            self._gate.stop()
            if self._plain is not None:
                self._plain.close()
            self._ctx.destroy(linger=0)
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._thread = threading.Thread(target=self._run, name="hsx-control", daemon=True)
        self._thread.start()

    def _bind_direct(self, host: str, port: int, secret: bytes, handshake_s: float, heartbeat_s: float) -> None:
        """The trainer's direct socket: a CURVE ROUTER in this process whose ZAP handler (this context's, served
        by the serving thread) accepts the trainer's key only, so no other peer ever delivers a message here.
        Its options are the gate's public socket's (RCVHWM 0, never ROUTER_HANDOVER: see gate.py)."""
        zap = self._ctx.socket(zmq.REP)
        self._zap = zap
        zap.linger = 0
        zap.bind(ZAP_ENDPOINT)  # before any socket of this context accepts a connection
        d = self._ctx.socket(zmq.ROUTER)
        self._direct = d
        d.linger = 0
        if ":" in host:
            d.ipv6 = True
        d.curve_server = True
        d.curve_secretkey = secret
        d.zap_domain = DIRECT_DOMAIN
        d.setsockopt(zmq.MAXMSGSIZE, _SERVER_MAXMSGSIZE)
        d.setsockopt(zmq.HANDSHAKE_IVL, int(handshake_s * 1000))
        d.setsockopt(zmq.ROUTER_MANDATORY, 1)
        d.setsockopt(zmq.SNDHWM, 10_000)
        d.setsockopt(zmq.RCVHWM, 0)  # never a finite one, never ROUTER_HANDOVER (gate.py says why)
        d.setsockopt(zmq.TCP_KEEPALIVE, 1)
        d.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        d.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * int(heartbeat_s * 1000))
        try:
            d.bind(f"{zmq_address(host, port if port else '*')}")
        except zmq.ZMQError as e:
            raise E.ExportConfigError(
                f"control plane cannot bind its direct socket on {host}:{port}: {e}; pass direct_port=0 for an "
                "ephemeral port, or direct=False"
            ) from None
        self.direct_port = int(d.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])

    def _zap_allows(self, domain: bytes, mechanism: bytes, key: bytes) -> bytes | None:
        """The ZAP verdict of this process's context: the user id to stamp, or None to deny.  On the direct
        socket only the trainer's CURVE key; the private socket to the gate (``ipc://``, NULL mechanism, no
        domain) as without a handler."""
        if domain == DIRECT_DOMAIN:
            if mechanism == b"CURVE" and len(key) == 32 and hmac.compare_digest(key, self._trainer_key):
                return b"trainer"
            return None
        return b"" if mechanism == b"NULL" and domain == b"" else None

    def _serve_zap(self) -> None:
        zap = self._zap
        if zap is None:
            return
        for _ in range(256):
            try:
                frames = zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            req_id = frames[1] if len(frames) > 1 else b""
            if len(frames) < 6:
                zap.send_multipart([b"1.0", req_id, b"500", b"malformed ZAP request", b"", b""])
                continue
            domain, mechanism = frames[2], frames[5]
            user = self._zap_allows(domain, mechanism, frames[6] if len(frames) > 6 else b"")
            if domain == DIRECT_DOMAIN:
                self._own["direct_zap_accepted" if user is not None else "direct_zap_denied"] += 1
            if user is None:
                zap.send_multipart([b"1.0", req_id, b"400", b"denied", b"", b""])
            else:
                zap.send_multipart([b"1.0", req_id, b"200", b"OK", user, b""])

    def _serve_direct(self) -> None:
        d = self._direct
        if d is None:
            return
        for _ in range(256):
            try:
                frames = d.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            # [connection, header, rid, body]; only the trainer passes this socket's ZAP handler
            if len(frames) != 4 or len(frames[2].bytes) != P.RID_BYTES:
                self._own["direct_bad_frames"] += 1
                continue
            self._own["direct_requests"] += 1
            gated = [frames[0], frames[0], b"trainer", frames[1], frames[2], frames[3]]
            try:
                self._one(gated, direct=True)
            except Exception as e:  # as in _serve_requests: the request fails alone
                self._own["internal_errors"] += 1
                log.exception("export control request (direct) failed")
                rep = P.ErrorReply("internal", f"{type(e).__name__}: {e}"[:8000])
                try:
                    self._send((_DIRECT, frames[0].bytes), frames[2].bytes, rep)
                except Exception:
                    log.exception("export control: the error reply could not be sent either")

    @property
    def endpoint(self) -> str:
        """``host:port`` of the bind address."""
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def counters(self) -> dict[str, int]:
        """This server's counters and the gates' (summed over every gate this server has run)."""
        out = dict(self._own)
        if self._plain is not None:
            out.update(self._plain.counters)
        for k, v in self._gate.reported().items():
            out[k] = out.get(k, 0) + v
        return out

    @property
    def gate_pid(self) -> int:
        """The running gate's pid (0 while none runs)."""
        return self._gate.pid

    @property
    def gate_last_exit(self) -> str:
        """Why the last gate ended (``""`` while none has): ``exit N`` or ``signal SIGNAME``."""
        return self._gate.last_exit

    def wake(self) -> None:
        """Retry parked long polls now (the producer calls it after each publish; any thread; a no-op once
        closed).  Costs a pipe write (and a wake-up of the serving thread) only when a long poll is parked and
        no wake-up is pending already: a publish with nobody waiting costs an increment."""
        self._wakes += 1
        if not self._parked or self._wake_pending:
            return
        self._poke()

    def _poke(self) -> None:
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
        failures = 0
        while not self._stopping:
            try:
                self._serve()
            except Exception:  # the loop itself failed: log, count, and serve again (never end silently)
                failures += 1
                self._own["restarts"] += 1
                log.exception("export control loop failed (restart %d); serving again", failures)
                time.sleep(min(1.0, 0.01 * 2 ** min(failures, 7)))
        try:  # shutting down: answer every parked long poll (empty), then stop
            self._retry_parked(float("inf"))
        except Exception:
            log.exception("export control plane: answering parked long polls at close failed")
        finally:
            self._gate.stop()
            if self._plain is not None:
                self._plain.close()
            for sock in (self._sock, self._direct, self._zap):
                if sock is None:
                    continue
                try:
                    sock.close(linger=0)
                except zmq.ZMQError:
                    pass

    def _serve(self) -> None:
        poller = self._poller
        # ZeroMQ sockets through their ZMQ_FD: it signals (edge-triggered) that ZMQ_EVENTS may have changed, so
        # each socket's ZMQ_EVENTS is read before every wait (a socket left with messages -- 256 served per turn,
        # or an edge consumed by a send -- makes the wait 0) and after it
        zsocks = [z for z in (self._zap, self._direct, self._sock) if z is not None]
        for z in zsocks:
            poller.register(int(z.getsockopt(zmq.FD)), select.POLLIN)  # twice (after a restart) only updates the flags
        poller.register(self._wake_r, select.POLLIN)
        plain = self._plain
        if plain is not None:
            poller.register(plain.fd, select.POLLIN)
        plain_in: list[PlainRequest] = []
        next_retry = 0.0
        while not self._stopping:
            now = time.monotonic()
            gate = self._gate
            if gate.due(now):
                gate.restart()
            timeout_ms = 50 if self._parked or gate.proc is None else 200
            if self._parked:
                first = min(p.deadline for p in self._parked.values())
                timeout_ms = max(0, min(timeout_ms, int((first - now) * 1000) + 1))
            if plain is not None and (hs := plain.next_deadline()) is not None:
                timeout_ms = max(0, min(timeout_ms, int((hs - now) * 1000) + 1))
            if any(_readable(z) for z in zsocks):
                timeout_ms = 0
            ready = dict(poller.poll(timeout_ms))
            woke = False
            gate_fd = gate.fd()
            if gate_fd is not None and gate_fd in ready:
                gate.readable()
            if self._wake_r in ready:
                woke = True
                self._wake_pending = False  # before draining: a wake() from now on writes again
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            if self._zap is not None and _readable(self._zap):
                self._serve_zap()
            if self._direct is not None and _readable(self._direct):
                self._serve_direct()
            if _readable(self._sock):
                self._serve_requests()
            if plain is not None:
                for fd, events in ready.items():
                    if plain.owns(fd):
                        plain.ready(fd, events, plain_in)
                if plain_in:
                    self._serve_plain(plain_in)
                plain.expire(time.monotonic())
            if self._recheck:
                self._recheck = False
                woke = True
            now = time.monotonic()
            if self._parked and (woke or now >= next_retry):
                self._retry_parked(now)
                next_retry = now + 0.05

    def _serve_requests(self) -> None:
        for _ in range(256):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._one(frames)
            except Exception as e:  # one request's failure, wherever it happened, fails that request alone
                self._own["internal_errors"] += 1
                log.exception("export control request failed")
                if len(frames) == 6:
                    route = (frames[0].bytes, frames[1].bytes)
                    rep = P.ErrorReply("internal", f"{type(e).__name__}: {e}"[:8000])
                    try:
                        self._send(route, frames[4].bytes, rep)
                    except Exception:
                        log.exception("export control: the error reply could not be sent either")

    def _serve_plain(self, todo: list[PlainRequest]) -> None:
        """Answer the requests read from plain connections (authenticated: the trainer's)."""
        for conn, header, rid, body in todo:
            route = (_PLAIN, conn.to_bytes(8, "little"))
            try:
                self._one_request(route, "trainer", header, rid, body)
            except Exception as e:  # as in _serve_requests: the request fails alone
                self._own["internal_errors"] += 1
                log.exception("export control request (plain) failed")
                try:
                    self._send(route, rid, P.ErrorReply("internal", f"{type(e).__name__}: {e}"[:8000]))
                except Exception:
                    log.exception("export control: the error reply could not be sent either")
        todo.clear()

    def _one(self, frames: list[Any], direct: bool = False) -> None:
        if len(frames) != 6:  # [gate, connection, principal, header, rid, body]: the gate sends nothing else
            self._own["bad_frames"] += 1
            return
        route = (_DIRECT, frames[1].bytes) if direct else (frames[0].bytes, frames[1].bytes)
        principal = "trainer" if direct or frames[2].bytes == b"trainer" else "record"
        self._one_request(route, principal, frames[3].bytes, frames[4].bytes, frames[5].bytes)

    def _one_request(self, route: tuple[bytes, bytes], principal: str, header: bytes, rid: bytes, body: bytes) -> None:
        try:
            P.check_header(header)
            # the nesting walk only for ticket holders: a trainer's long releases would pay ~1.8 us per lease for
            # it, and a trainer (who holds the token) meets the decoder's own recursion limit, caught in _decode
            req = P.decode_request(body, check_nesting=principal != "trainer")
        except E.ProtocolError as e:
            self._own["bad_frames"] += 1
            self._send(route, rid, P.ErrorReply(error_code(e), str(e)[:8000]))
            return
        self._own["requests"] += 1
        key = (principal, rid)
        parked = self._parked.get(key)
        if parked is not None:  # the client resent a parked long poll (it reconnected): answer the new route
            self._unpark_route(parked.route)
            parked.route = route
            self._parked_per_route[route] = self._parked_per_route.get(route, 0) + 1
            return
        wait = float(getattr(req, "wait_s", 0.0))
        call = Call(principal, rid, final=wait <= 0.0)
        wakes = self._wakes
        rep = self._answer(req, call)
        if rep is None:
            per_route = self._parked_per_route.get(route, 0)
            if len(self._parked) >= self._max_parked or per_route >= self.limits.max_parked_per_peer:
                if per_route >= self.limits.max_parked_per_peer:
                    self._own["parked_over_peer_limit"] += 1
                call.final = True
                rep = self._answer(req, call)
            else:
                self._own["parked"] += 1
                self._parked[key] = _Parked(route, req, call, time.monotonic() + wait)
                self._parked_per_route[route] = per_route + 1
                if self._wakes != wakes:  # published while answering: nothing was parked to wake yet
                    self._recheck = True
                return
        if rep is not None:  # _answer never leaves a final call unanswered
            self._send(route, rid, rep)

    def _unpark_route(self, route: tuple[bytes, bytes]) -> None:
        n = self._parked_per_route.get(route, 0) - 1
        if n > 0:
            self._parked_per_route[route] = n
        else:
            self._parked_per_route.pop(route, None)

    def _answer(self, req: P.Request, call: Call) -> P.Reply | None:
        try:
            rep = self._handler(req, call)
            if rep is None and call.final:
                raise E.ExportError(f"handler left a final {type(req).__name__} unanswered")
            return rep
        except E.ExportError as e:
            self._own["request_errors"] += 1
            if isinstance(e, E.CapabilityError):
                self._own["capability_refusals"] += 1
            return P.ErrorReply(error_code(e), str(e)[:8000])
        except Exception as e:  # a bad request fails alone, never the producer
            self._own["internal_errors"] += 1
            log.exception("control request %s failed", type(req).__name__)
            return P.ErrorReply("internal", f"{type(e).__name__}: {e}"[:8000])

    def _retry_parked(self, now: float) -> None:
        for key in list(self._parked):
            p = self._parked[key]
            p.call.final = now >= p.deadline or self._stopping
            rep = self._answer(p.req, p.call)
            if rep is not None:
                del self._parked[key]
                self._unpark_route(p.route)
                self._send(p.route, key[1], rep)

    def _send(self, route: tuple[bytes, bytes], rid: bytes, rep: P.Reply) -> None:
        try:
            body = P.encode(rep)
        except (msgspec.EncodeError, TypeError, ValueError, OverflowError) as e:
            self._own["internal_errors"] += 1
            log.error("cannot encode a %s reply: %s", type(rep).__name__, e)
            body = P.encode(P.ErrorReply("internal", f"reply could not be encoded: {e}"[:8000]))
        if route[0] == _PLAIN:
            if self._plain is not None:  # (a plain route exists only while the channel does)
                self._plain.send(int.from_bytes(route[1], "little"), rid, self._producer, body)
            return
        if route[0] == _DIRECT:
            d = self._direct
            try:
                if d is None:
                    raise zmq.ZMQError(errno.ENOTSOCK)
                d.send_multipart([route[1], P.HEADER, rid, self._producer, body], zmq.NOBLOCK)
            except zmq.ZMQError:  # the trainer's connection is gone: it resends by request id, or via the gate
                self._own["direct_replies_dropped"] += 1
            return
        try:
            self._sock.send_multipart([route[0], route[1], P.HEADER, rid, self._producer, body], zmq.NOBLOCK)
        except zmq.ZMQError:  # the gate that carried the request is gone: the client resends by request id
            self._own["replies_dropped"] += 1

    def close(self) -> None:
        """Answer parked long polls, stop the gate and the thread (within a few seconds), close the sockets."""
        self._stopping = True
        self._poke()
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():  # pragma: no cover - a handler stuck past the deadline
            log.error("export control thread did not stop within 10s")
        self._ctx.destroy(linger=0)
        with self._wake_lock:  # after the thread: no one polls the pipe any more, and wake() becomes a no-op
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
        shutil.rmtree(self._dir, ignore_errors=True)


def _readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether a ZeroMQ socket holds a message now (``ZMQ_EVENTS``; reading it also re-arms its ``ZMQ_FD``)."""
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
