"""The session: the producer a consumer is attached to, and every call to it.

:class:`Session` says hello over the control channel (:mod:`.channel`), learns who the producer is and who the
caller is (the trainer, or a ticket's holder), has the landing (:mod:`.landing`) make the transport the producer
describes, checks the settings its transfers depend on and loads the producer's pool description.  Its
:meth:`Session.call` is the one way the other parts talk to the producer: an answer from another producer instance
(the producer restarted) attaches again first.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from vllm_hs_compat import errors as E
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.consumer.channel import ControlChannel
from vllm_hs_compat.export.consumer.landing import Landing
from vllm_hs_compat.export.nixl_backend import settings_differ
from vllm_hs_compat.export.transport import ConsumerTransport

log = logging.getLogger(__package__)  # one logger for the whole consumer: vllm_hs_compat.export.consumer


class Session:
    """The attached producer: its instance id (``producer``), its hello (``reply``; ``hello`` as plain data), the
    caller's credential (the trainer token, or ``ticket``'s capability) and the calls.

    ``want``: the transport asked for (``"auto"``, ``"shm"``, ``"nixl"``); ``direct``: a trainer moves its calls past
    the gate when the producer offers a way; ``timeout_s``: the default deadline of a call."""

    def __init__(
        self,
        channel: ControlChannel,
        landing: Landing,
        *,
        ticket: P.ExportTicket | None,
        want: str,
        direct: bool,
        timeout_s: float,
    ) -> None:
        if want not in ("auto", "shm", "nixl"):
            raise E.ExportConfigError(f"backend must be 'auto', 'shm' or 'nixl', found {want!r}")
        self.channel = channel
        self.landing = landing
        self.ticket = ticket
        self.timeout_s = timeout_s
        self._want = want
        self._direct = direct
        #: the attached producer's instance id (None before the first hello)
        self.producer: str | None = None
        #: its latest hello answer, and the same as plain data
        self.reply: P.HelloReply | None = None
        self.hello: dict[str, Any] = {}
        self.counters = {"handshakes": 0, "producer_changes": 0}

    @property
    def principal(self) -> str:
        """``"trainer"`` (token) or ``"record"`` (a ticket's capability)."""
        return "record" if self.ticket is not None else "trainer"

    @property
    def cap(self) -> str | None:
        """The capability every request of a ticket holder carries (None for the trainer)."""
        return self.ticket.cap if self.ticket is not None else None

    @property
    def endpoint(self) -> str:
        return self.channel.endpoint

    def budget(self) -> int:
        """The largest answer the connection takes."""
        return self.channel.budget()

    @property
    def pool_bytes(self) -> int:
        """The attached producer's pool size (0 before hello)."""
        return self.reply.pool_bytes if self.reply is not None else 0

    def connect(self) -> None:
        """Say hello; on a new producer (or a new kind of pool) attach its transport."""
        client = self.channel.client
        rep, _ = self.channel.exchange(P.HelloReq(), client.timeout_s if client is not None else None)
        if not isinstance(rep, P.HelloReply):
            raise E.ProtocolError(f"hello answered with {type(rep).__name__}")
        info = rep.transport
        kind = ""
        if info is not None:
            kind = "shm" if isinstance(info, P.ShmInfo) else "nixl"
            if self._want != "auto" and kind != self._want:
                raise E.TransportUnavailableError(
                    f"producer at {self.endpoint} serves transport {kind!r}, this consumer was asked for "
                    f"{self._want!r}; use backend='auto' or start the producer with backend={self._want!r}"
                )
        elif rep.principal == "trainer":
            raise E.ProtocolError("the producer sent the trainer no transport description")
        transport = self.landing.transport
        renew = info is not None and (transport is None or transport.kind != kind)
        if self.producer is not None and rep.producer != self.producer and not renew:
            self.counters["producer_changes"] += 1
            log.info("producer at %s changed (%s -> %s); re-attached", self.endpoint, self.producer, rep.producer)
        self.reply = rep
        self.hello = msgspec.to_builtins(rep, builtin_types=(bytes,))
        self.counters["handshakes"] += 1
        if rep.principal == "trainer" and self._direct and self.ticket is None:
            self.channel.go_direct(rep.producer, self.timeout_s)
        if info is not None and (renew or rep.producer != self.producer):
            transport = self.landing.renew(kind) if renew or transport is None else transport
            self._check_settings(transport)
            transport.attach(info)
        self.producer = rep.producer

    def _check_settings(self, transport: ConsumerTransport) -> None:
        """Before the producer's agent metadata is loaded (no transfer yet): the settings a transfer depends on must
        be the producer's (see :mod:`~vllm_hs_compat.export.nixl_backend`), else
        :class:`TransportSettingsMismatchError`.  An older producer that does not know the request is not checked."""
        mine = getattr(transport, "settings", None)
        if not mine:
            return
        client = self.channel.client
        try:
            rep, _ = self.channel.exchange(
                P.TransferSettingsReq(dict(mine)), client.timeout_s if client is not None else None
            )
        except E.ProtocolError as e:  # an older producer: `protocol` error
            log.info("producer at %s does not compare transfer settings (%s); not checked", self.endpoint, e)
            return
        if not isinstance(rep, P.TransferSettingsReply):
            raise E.ProtocolError(f"transfer_settings answered with {type(rep).__name__}")
        differ = settings_differ(mine, rep.settings)
        if differ:
            mismatch = ", ".join(f"{k}: {a} bytes here, {b} at the producer" for k, (a, b) in differ.items())
            raise E.TransportSettingsMismatchError(
                f"this process and the producer at {self.endpoint} run different UCX settings that a transfer "
                f"depends on ({mismatch}); UCX's TCP transport does not negotiate them, and the first large read "
                "would abort a process.  Give both processes the same values in the environment before either "
                "imports NIXL (vllm-hs-compat sets 256k when they are unset; here another library or the "
                "environment set them first), or the same UcxSettings(tcp_seg_size=...) on both sides"
            )

    def call(self, req: P.Request, timeout_s: float | None = None) -> P.Reply:
        """One request.  An answer from another producer instance than the attached one (the producer restarted)
        attaches again first."""
        rep, producer = self.channel.exchange(req, timeout_s if timeout_s is not None else self.timeout_s)
        if producer != self.producer:
            self.connect()
        return rep
