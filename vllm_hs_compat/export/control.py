"""Authenticated control plane: a small threaded TCP server (one per producer process) and its client.

Handshake (mutual, the token never crosses the wire):

1. server -> ``{"op": "challenge", "proto": 1, "nonce": S, "codecs": ["m", "j"]}`` (always JSON)
2. client -> ``{"op": "auth", "cnonce": C, "mac": HMAC-SHA256(token, "client|" S "|" C)}``
3. server checks the MAC with ``hmac.compare_digest``; on success it answers ``{"ok": true, "mac":
   HMAC-SHA256(token, "server|" C "|" S), "hello": {...}}`` and the client checks that MAC, so a process
   that grabbed a recycled port cannot serve descriptors either.  Any other first message, or a wrong MAC,
   is answered with ``{"ok": false, "error": "auth"}`` and the connection is closed.

After that every request is ``{"op": ..., ...}`` and every answer ``{"ok": true, ...}`` or ``{"ok": false,
"error": <code>, "message": <text>}``.  A failing request fails alone; the server keeps serving. The server
binds loopback unless given an explicit address; port 0 takes an ephemeral port (see ``address``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from vllm_hs_compat import errors as E
from vllm_hs_compat.export import protocol as P

log = logging.getLogger(__name__)

PROTO: Final = 1
MIN_TOKEN_CHARS: Final = 16

Handler = Callable[[str, dict[str, Any]], dict[str, Any]]

#: error code on the wire <-> exception class.  Unlisted codes become RemoteError.
ERROR_CODES: Final[dict[str, type[E.ExportError]]] = {
    "auth": E.AuthError,
    "protocol": E.ProtocolError,
    "unknown_record": E.UnknownRecordError,
    "lease_expired": E.LeaseExpiredError,
    "config": E.ExportConfigError,
    "timeout": E.ExportTimeoutError,
    "closed": E.ExportClosedError,
    "stale": E.StaleMetadataError,
}


def error_code(exc: BaseException) -> str:
    for code, cls in ERROR_CODES.items():
        if type(exc) is cls:
            return code
    for code, cls in ERROR_CODES.items():
        if isinstance(exc, cls):
            return code
    return "internal"


def new_token() -> str:
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
    if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
        raise E.ExportConfigError(
            f"auth token must be a str of at least {MIN_TOKEN_CHARS} characters, found "
            f"{type(token).__name__} of length {len(token) if isinstance(token, str) else 0}; "
            "leave it unset to have one generated"
        )
    return token


def _mac(token: str, role: bytes, a: str, b: str) -> str:
    return hmac.new(token.encode(), role + b"|" + a.encode() + b"|" + b.encode(), hashlib.sha256).hexdigest()


class ControlServer:
    """Threaded TCP control server.  ``handler(op, msg)`` answers authenticated requests."""

    def __init__(
        self,
        handler: Handler,
        hello: Callable[[], dict[str, Any]],
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        handshake_timeout_s: float = 5.0,
        idle_timeout_s: float = 300.0,
        max_connections: int = 256,
    ) -> None:
        self._handler = handler
        self._hello = hello
        self._token = check_token(token)
        self._handshake_timeout_s = handshake_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.counters: dict[str, int] = {
            "connections": 0,
            "auth_failures": 0,
            "bad_frames": 0,
            "requests": 0,
            "request_errors": 0,
            "refused_connections": 0,
        }
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host, port), family=family, backlog=128)
        except OSError as e:
            raise E.ExportConfigError(
                f"control plane cannot bind {host}:{port}: {e}; pass port=0 for an ephemeral port, or "
                "another "
                "bind address"
            ) from None
        self.address: tuple[str, int] = (host, int(self._sock.getsockname()[1]))
        self._thread = threading.Thread(target=self._accept_loop, name="hsx-control-accept", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._conns) >= self._max_connections:
                    self.counters["refused_connections"] += 1
                    conn.close()
                    continue
                self._conns.add(conn)
                self.counters["connections"] += 1
            threading.Thread(target=self._serve, args=(conn,), name="hsx-control-conn", daemon=True).start()

    def _reply_error(self, conn: socket.socket, codec: bytes, code: str, message: str) -> None:
        try:
            P.write_frame(conn, {"ok": False, "error": code, "message": message}, time.monotonic() + 1.0, codec)
        except E.ExportError:
            pass

    def _serve(self, conn: socket.socket) -> None:
        codec = P.CODEC_JSON  # until the client has spoken: every peer reads JSON
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            snonce = secrets.token_hex(16)
            deadline = time.monotonic() + self._handshake_timeout_s
            # The challenge is JSON, which every peer reads; the client then speaks the best codec both have.
            P.write_frame(
                conn,
                {"op": "challenge", "proto": PROTO, "nonce": snonce, "codecs": P.local_codecs()},
                deadline,
                P.CODEC_JSON,
            )
            try:
                codec, msg = P.read_frame(conn, deadline, P.MAX_REQUEST_BYTES)
            except E.ProtocolError as e:
                self._count("bad_frames")
                self._reply_error(conn, codec, "protocol", str(e))
                return
            mac = msg.get("mac")
            cnonce = msg.get("cnonce")
            ok = (
                msg.get("op") == "auth"
                and isinstance(mac, str)
                and isinstance(cnonce, str)
                and 16 <= len(cnonce) <= 128
                and hmac.compare_digest(mac.encode(), _mac(self._token, b"client", snonce, cnonce).encode())
            )
            if not ok:
                self._count("auth_failures")
                what = "wrong token" if msg.get("op") == "auth" else f"unauthenticated {msg.get('op')!r} request"
                self._reply_error(
                    conn,
                    codec,
                    "auth",
                    f"{what} refused; pass the token from kv_transfer_params['hs_export']",
                )
                return
            P.write_frame(
                conn,
                {
                    "ok": True,
                    "mac": _mac(self._token, b"server", str(cnonce), snonce),
                    "hello": self._hello(),
                },
                deadline,
                codec,
            )
            while True:
                try:
                    codec, msg = P.read_frame(conn, time.monotonic() + self._idle_timeout_s, P.MAX_REQUEST_BYTES)
                except E.ExportTimeoutError:
                    return
                except P.PeerClosedError:
                    return
                except E.ProtocolError as e:
                    self._count("bad_frames")
                    self._reply_error(conn, codec, "protocol", str(e))
                    return
                self._count("requests")
                op = msg.get("op")
                try:
                    if not isinstance(op, str):
                        raise E.ProtocolError(f"request lacks a str 'op', found {op!r}")
                    answer = self._handler(op, msg)
                    answer["ok"] = True
                except E.ExportError as e:
                    self._count("request_errors")
                    answer = {"ok": False, "error": error_code(e), "message": str(e)}
                except Exception as e:  # a bad request fails alone, never the producer
                    self._count("request_errors")
                    log.exception("control request %r failed", op)
                    answer = {"ok": False, "error": "internal", "message": f"{type(e).__name__}: {e}"}
                P.write_frame(conn, answer, time.monotonic() + self._handshake_timeout_s, codec)
        except E.ExportError as e:
            log.debug("control connection ended: %s", e)
        except OSError as e:
            log.debug("control connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                c.close()
            except OSError:
                pass
        self._thread.join(timeout=2.0)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``."""
    if not isinstance(endpoint, str) or ":" not in endpoint:
        raise E.ExportConfigError(f"endpoint must look like 'host:port', found {endpoint!r}")
    host, _, port_s = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_s)
    except ValueError:
        raise E.ExportConfigError(f"endpoint {endpoint!r} has a non-numeric port") from None
    if not 0 < port < 65536 or not host:
        raise E.ExportConfigError(f"endpoint {endpoint!r} needs a host and a port in 1..65535")
    return host, port


class ControlClient:
    """One authenticated connection.  Not thread-safe: one client per thread."""

    def __init__(self, endpoint: str, token: str, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.broken = False
        self._token = check_token(token)
        host, port = parse_endpoint(endpoint)
        deadline = time.monotonic() + timeout_s
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as e:
            raise E.ControlPlaneError(
                f"cannot connect to the export control plane at {endpoint}: {e}; is the producer running "
                "and the endpoint the one from kv_transfer_params?"
            ) from None
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _, challenge = P.read_frame(self._sock, deadline, P.MAX_REQUEST_BYTES)
            self._codec = P.pick_codec(challenge.get("codecs"))
            if challenge.get("op") != "challenge" or challenge.get("proto") != PROTO:
                raise E.ProtocolError(
                    f"expected a proto-{PROTO} challenge, found {challenge.get('op')!r} proto "
                    f"{challenge.get('proto')!r}; is {endpoint} a vllm-hs-compat producer of the same "
                    "version?"
                )
            snonce = P.get_str(challenge, "nonce", 128)
            cnonce = secrets.token_hex(16)
            P.write_frame(
                self._sock,
                {"op": "auth", "cnonce": cnonce, "mac": _mac(self._token, b"client", snonce, cnonce)},
                deadline,
                self._codec,
            )
            _, answer = P.read_frame(self._sock, deadline, P.MAX_RESPONSE_BYTES)
            self._raise_for(answer)
            smac = P.get_str(answer, "mac", 128)
            if not hmac.compare_digest(smac.encode(), _mac(self._token, b"server", cnonce, snonce).encode()):
                raise E.AuthError(f"the server at {endpoint} could not prove it knows the token; refusing to trust it")
            self.hello: dict[str, Any] = P.get_map(answer, "hello")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _raise_for(answer: dict[str, Any]) -> None:
        if answer.get("ok") is True:
            return
        code = answer.get("error")
        message = answer.get("message")
        text = message if isinstance(message, str) else f"malformed error answer {answer!r}"
        cls = ERROR_CODES.get(code, E.RemoteError) if isinstance(code, str) else E.ProtocolError
        raise cls(text)

    def call(self, msg: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
        """Send one request and wait for its answer.  A transport failure (reset, truncation, timeout)
        marks the
        connection ``broken`` before raising; an error *answer* from the server leaves it usable."""
        if self.broken:
            raise E.ControlPlaneError(f"connection to {self.endpoint} is broken; open a new ControlClient")
        deadline = time.monotonic() + timeout_s
        try:
            P.write_frame(self._sock, msg, deadline, self._codec)
            _, answer = P.read_frame(self._sock, deadline, P.MAX_RESPONSE_BYTES)
        except E.ExportError:
            self.broken = True
            self.close()
            raise
        self._raise_for(answer)
        return answer

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
