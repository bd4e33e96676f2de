"""The control channel: the consumer's connection to its producer.

:class:`ControlChannel` holds the connection: through the gate (the endpoint a ticket names), or a trainer's past
it on the producer's plain channel or direct endpoint, back to the gate when that fails.  It sends requests
(:meth:`ControlChannel.exchange`) and knows nothing of what they mean: the session (:mod:`.session`) says hello
and makes the calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vllm_hs_compat import errors as E
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.client import ControlClient
from vllm_hs_compat.export.plain import PlainClient

log = logging.getLogger(__package__)  # one logger for the whole consumer: vllm_hs_compat.export.consumer

#: How long the first ping through an offered direct endpoint may take before the trainer stays on the gate.
DIRECT_CONFIRM_S = 2.0


class ControlChannel:
    """The control connection: ``gate`` (through the endpoint a ticket names) and ``client``, the one calls go
    to (the gate, or the producer's plain channel or direct endpoint once confirmed); both ``None`` before
    :meth:`open` and after :meth:`close`.  ``counters``: its switches (``direct_*``, ``plain_switches``)."""

    def __init__(self, endpoint: str, token: str | None, max_reply_bytes: int, plain: bool = True) -> None:
        self.endpoint = endpoint
        self._token = token
        self._plain_wanted = plain
        self._max_reply_bytes = max_reply_bytes
        self.counters = dict.fromkeys(("direct_switches", "direct_failures", "direct_fallbacks", "plain_switches"), 0)
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
            self.counters["plain_switches"] += 1
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
            self.counters["direct_failures"] += 1
            log.info("%s %s not usable (%s); not switching from the gate %s", what, endpoint, e, self.endpoint)
            if client is not None:
                client.close()
            return False
        client.timeout_s = timeout_s
        client.adopt(gate)
        self.client = client
        self.counters["direct_switches"] += 1
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
        self.counters["direct_fallbacks"] += 1
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
