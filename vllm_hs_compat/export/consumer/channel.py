"""The control channel: the consumer's connection to its producer and every control call over it.

:class:`ControlChannel` holds the connection (through the gate, or a trainer's past it on the producer's direct
endpoint, back to the gate when that fails); the :class:`_Connected` layer says hello, attaches the data
transport the producer describes and makes the calls (``_call``: re-attaching when the producer restarted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from vllm_hs_compat import errors as E
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.client import ControlClient
from vllm_hs_compat.export.consumer.landing import _Landing
from vllm_hs_compat.export.consumer.state import _State
from vllm_hs_compat.export.nixl_backend import NixlConsumerTransport, settings_differ
from vllm_hs_compat.export.plain import PlainClient
from vllm_hs_compat.export.shm import ShmConsumerTransport
from vllm_hs_compat.export.transport import ConsumerTransport

log = logging.getLogger(__package__)  # one logger for the whole consumer: vllm_hs_compat.export.consumer

#: How long the first ping through an offered direct endpoint may take before the trainer stays on the gate.
DIRECT_CONFIRM_S = 2.0


class ControlChannel:
    """The control connection: ``gate`` (through the endpoint a ticket names) and ``client``, the one calls go
    to (the gate, or the producer's direct endpoint once confirmed); both ``None`` before :meth:`open` and after
    :meth:`close`.  ``counters``: the consumer's (``direct_*``)."""

    def __init__(
        self, endpoint: str, token: str | None, max_reply_bytes: int, counters: dict[str, int], plain: bool = True
    ) -> None:
        self.endpoint = endpoint
        self._token = token
        self._plain_wanted = plain
        self._max_reply_bytes = max_reply_bytes
        self._counters = counters
        self.client: ControlClient | PlainClient | None = None
        #: the connection through the gate (the ticket's endpoint); ``client`` is it, or the direct one
        self.gate: ControlClient | None = None

    def open(self, timeout_s: float, server_key: str | None) -> None:
        """Connect through the gate (``server_key``: the ticket's, for a ticket holder)."""
        self.client = ControlClient(
            self.endpoint,
            self._token,
            timeout_s,
            server_key=server_key,
            max_reply_bytes=self._max_reply_bytes,
        )
        self.gate = self.client

    @property
    def direct(self) -> bool:
        """Whether calls go to the producer's direct endpoint."""
        return self.client is not None and self.client is not self.gate

    def budget(self) -> int:
        """The largest answer the connection takes."""
        client = self.client
        return client.max_reply_bytes if client is not None else P.DEFAULT_REPLY_BYTES

    def exchange(self, req: P.Request, timeout: float | None) -> tuple[P.Reply, str]:
        """One request on the current connection; a direct one that fails sends it again through the gate."""
        client = self.client
        if client is None:
            raise E.ExportClosedError("consumer is closed")
        if client is self.gate:
            return client.call(req, timeout)
        rid = P.new_rid()
        try:
            return client.call(req, timeout, rid=rid)
        except (E.ExportTimeoutError, E.AuthError) as e:
            # the same request id through the gate: the producer answers it once (a claim keeps its leases)
            return self.fall_back(e).call(req, timeout, rid=rid)

    def go_direct(self, producer: str | None, timeout_s: float) -> None:
        """After a hello through the gate: ask for the plain channel (then the direct endpoint), confirm it with a
        ping (the same producer instance: ``producer``), then send every control call there.  Any failure keeps
        the gate (counted ``direct_failures`` when an offered endpoint did not answer)."""
        gate, token = self.gate, self._token
        if gate is None or self.client is not gate or token is None:
            return
        confirm_s = min(timeout_s, DIRECT_CONFIRM_S)
        if self._plain_wanted and self._switch(
            gate,
            P.PlainReq(),
            lambda ep: PlainClient(ep, token, confirm_s, max_reply_bytes=self._max_reply_bytes),
            "plain channel",
            producer,
            timeout_s,
        ):
            self._counters["plain_switches"] += 1
            return
        self._switch(
            gate,
            P.DirectReq(),
            lambda ep: ControlClient(
                ep, token, confirm_s, max_reply_bytes=self._max_reply_bytes, fail_on_disconnect=True
            ),
            "direct endpoint",
            producer,
            timeout_s,
        )

    def _switch(
        self,
        gate: ControlClient,
        ask: P.PlainReq | P.DirectReq,
        connect: Callable[[str], ControlClient | PlainClient],
        what: str,
        producer: str | None,
        timeout_s: float,
    ) -> bool:
        """Ask the gate for an endpoint (``ask``), connect to it, confirm it with a ping answered by ``producer``
        and move every call there (posted requests with them): whether it did."""
        try:
            rep, _ = gate.call(ask, timeout_s)
        except E.ExportError as e:  # an older producer: `protocol` error
            log.debug("no %s from %s: %s", what, self.endpoint, e)
            return False
        endpoint = rep.endpoint if isinstance(rep, P.PlainReply | P.DirectReply) else None
        if endpoint is None:
            return False
        client: ControlClient | PlainClient | None = None
        try:
            client = connect(endpoint)
            pong, answered = client.call(P.PingReq())
            if not isinstance(pong, P.PongReply) or answered != producer:
                raise E.StaleMetadataError(f"{what} {endpoint} answered as {answered}")
        except HsCompatError as e:
            self._counters["direct_failures"] += 1
            log.info("%s %s not usable (%s); not switching from the gate %s", what, endpoint, e, self.endpoint)
            if client is not None:
                client.close()
            return False
        client.timeout_s = timeout_s
        client.adopt(gate)
        self.client = client
        self._counters["direct_switches"] += 1
        return True

    def fall_back(self, why: BaseException) -> ControlClient:
        """The direct connection failed: close it and use the gate again (its posted requests move there)."""
        direct, gate = self.client, self.gate
        if gate is None:
            raise E.ExportClosedError("consumer is closed")
        if direct is not None and direct is not gate:
            gate.adopt(direct)
            direct.close()
        self.client = gate
        self._counters["direct_fallbacks"] += 1
        log.info("direct control endpoint failed (%s); back to the gate %s", why, self.endpoint)
        return gate

    def close(self) -> None:
        """Close the connection (and the gate's, when calls went past it)."""
        client, gate = self.client, self.gate
        if client is not None:
            client.close()
            if gate is not None and gate is not client:
                gate.close()
        self.client = None
        self.gate = None


class _Connected(_State):
    """The consumer's side of the channel: the hello that attaches the transport, the calls, their credential."""

    @property
    def principal(self) -> str:
        """``"trainer"`` (token) or ``"record"`` (a ticket's capability)."""
        return "record" if self._ticket is not None else "trainer"

    @property
    def direct(self) -> bool:
        """Whether control calls go to the producer's direct endpoint (the trainer's path past the gate)."""
        return self._channel.direct

    def _connect(self) -> None:
        client = self._channel.client
        rep, producer = self._channel.exchange(P.HelloReq(), client.timeout_s if client is not None else None)
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
        renew = info is not None and (self._transport is None or self._transport.kind != kind)
        if self.producer is not None and rep.producer != self.producer and not renew:
            self.counters["producer_changes"] += 1
            log.info("producer at %s changed (%s -> %s); re-attached", self.endpoint, self.producer, rep.producer)
        self._hello = rep
        self.hello = msgspec.to_builtins(rep, builtin_types=(bytes,))
        self.counters["handshakes"] += 1
        if rep.principal == "trainer" and self._direct_wanted and self._ticket is None:
            self._channel.go_direct(rep.producer, self.timeout_s)
        if info is not None and (renew or rep.producer != self.producer):
            self._attach(info, kind, renew)
        self.producer = rep.producer

    def _attach(self, info: P.TransportInfo, kind: str, renew: bool) -> None:
        """Make the transport the producer describes (``renew``: a new one, of ``kind``), check the settings its
        transfers depend on, and load the producer's pool description (its agent metadata)."""
        if renew:
            if self._transport is not None:
                self._transport.close()
                self._transport = None
                self._landing = self._new_landing()  # records lent from the old buffers keep them
            if kind == "nixl":
                self._transport = NixlConsumerTransport(self._landing_bytes, self._ucx)
            else:
                self._transport = ShmConsumerTransport(self._landing_bytes, self._shm_dir)
        transport = self._transport
        if transport is None:  # pragma: no cover - made above
            raise E.ExportClosedError("consumer is closed")
        self._check_settings(transport)
        transport.attach(info)

    def _check_settings(self, transport: ConsumerTransport) -> None:
        """Before the producer's agent metadata is loaded (no transfer yet): the settings a transfer depends on must
        be the producer's (see :mod:`~vllm_hs_compat.export.nixl_backend`), else
        :class:`TransportSettingsMismatchError`.  An older producer that does not know the request is not checked."""
        mine = getattr(transport, "settings", None)
        if not mine:
            return
        client = self._channel.client
        try:
            rep, _ = self._channel.exchange(
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

    def _new_landing(self) -> _Landing:
        landing = _Landing(self._landing_bytes)
        landing.on_drop = self._drop_region
        return landing

    def _drop_region(self, k: int) -> None:
        if self._transport is not None:
            self._transport.drop_region(k)

    def _call(self, req: P.Request, timeout_s: float | None = None) -> P.Reply:
        """One request.  An answer from another producer instance than the attached one (the producer restarted)
        re-attaches first."""
        rep, producer = self._channel.exchange(req, timeout_s if timeout_s is not None else self.timeout_s)
        if self._unsettled:
            self._reconcile()
        if producer != self.producer:
            self._connect()
        return rep

    def _cap(self) -> str | None:
        return self._ticket.cap if self._ticket is not None else None

    def _budget(self) -> int:
        return self._channel.budget()
