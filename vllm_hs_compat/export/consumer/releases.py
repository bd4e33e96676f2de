"""Releases: each lease given back with its outcome, and the producer's verdict on it.

:class:`Releases` settles leases (waiting for the verdicts), or, far from a lease's deadline, posts the release and
takes its verdict as given (``defer_releases``): the answers to posted releases are checked when they have arrived
(before it releases more, in :meth:`Releases.pending`, when the consumer's stats are read, and at close).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from vllm_hs_compat import errors as E
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.consumer.session import Session

log = logging.getLogger(__package__)  # one logger for the whole consumer: vllm_hs_compat.export.consumer

#: A release is posted without waiting for its answer while less than this share of the lease TTL has passed
#: since its claim was sent (``defer_releases``).
DEFER_FRACTION = 0.5
#: How long :meth:`ExportConsumer.close` waits for the answers to posted releases.
CLOSE_COLLECT_S = 2.0

#: ``(lease, nonce, outcome)``: one lease released with what became of its record
Entry = tuple[int, str, str]


class Releases:
    """Lease releases and their verdicts.  ``defer``: post a release far from its leases' deadline (one control
    round trip less per read); ``False``: wait for every verdict."""

    def __init__(self, session: Session, defer: bool) -> None:
        self._session = session
        self.defer = defer
        #: posted releases whose answers have not been checked: request id -> the names of their records
        self._unsettled: dict[bytes, list[str]] = {}
        self.counters = dict.fromkeys(("lease_expired", "deferred_releases", "late_verdicts", "unanswered_releases"), 0)

    def settle(self, entries: Sequence[Entry]) -> list[str] | E.ExportError:
        """Release ``(lease, nonce, outcome)`` entries; the producer's verdict for each, or the error that kept
        it from answering."""
        self.reconcile()
        out: list[str] = []
        try:
            for i in range(0, len(entries), P.MAX_RELEASES):
                part = entries[i : i + P.MAX_RELEASES]
                items = [P.ReleaseItem(lease, nonce, outcome) for lease, nonce, outcome in part]  # type: ignore[arg-type]
                rep = self._session.call(P.ReleaseReq(items, cap=self._session.cap))
                if not isinstance(rep, P.ReleaseReply) or len(rep.results) != len(part):
                    raise E.ProtocolError(f"release of {len(part)} lease(s) answered with {type(rep).__name__}")
                out.extend(rep.results)
        except E.ExportError as e:
            log.info("release failed (%s); the producer's TTL reclaims the slots", e)
            return e
        return out

    def release(self, entries: Sequence[Entry], claimed_at: float, names: Sequence[str]) -> list[str] | E.ExportError:
        """Release ``entries`` (of records ``names``) claimed at ``claimed_at``.  Far from the leases' deadline
        (``defer``: before half their TTL has passed since the claim was sent) the release is posted and its verdict
        taken as ``released`` at once: no lease claimed then can have expired yet, so no byte read under it can be
        another record's, and the answer (checked later) only confirms it; any other answer is counted
        (``late_verdicts``) and logged.  Otherwise this waits for the producer's verdicts."""
        client = self._session.channel.client
        hello = self._session.reply
        ttl = hello.lease_ttl_s if hello is not None else 0.0
        if (
            not self.defer
            or client is None
            or claimed_at <= 0.0
            or time.monotonic() >= claimed_at + DEFER_FRACTION * ttl
        ):
            return self.settle(entries)
        self.reconcile()
        for i in range(0, len(entries), P.MAX_RELEASES):
            part = entries[i : i + P.MAX_RELEASES]
            items = [P.ReleaseItem(lease, nonce, outcome) for lease, nonce, outcome in part]  # type: ignore[arg-type]
            rid = client.post(P.ReleaseReq(items, cap=self._session.cap))
            self._unsettled[rid] = list(names[i : i + P.MAX_RELEASES])
        self.counters["deferred_releases"] += len(entries)
        return ["released"] * len(entries)

    def reconcile(self) -> None:
        """Check the answers to posted releases that have arrived."""
        client = self._session.channel.client
        if client is None or not self._unsettled:
            return
        for rid, answer in client.answers():
            names = self._unsettled.pop(rid, None)
            if names is None:
                continue
            if isinstance(answer, HsCompatError):
                self.counters["late_verdicts"] += len(names)
                log.error(
                    "a deferred release of %d record(s) (%s...) failed at the producer: %s; their leases expire "
                    "there (counted expired_claimed) although the records were delivered here",
                    len(names),
                    names[:3],
                    answer,
                )
                continue
            rep = answer[0]
            results = rep.results if isinstance(rep, P.ReleaseReply) else []
            bad: list[tuple[str, str]] = [(n, r) for n, r in zip(names, results, strict=False) if r != "released"]
            bad += [(n, "no answer") for n in names[len(results) :]]
            if bad:
                self.counters["late_verdicts"] += len(bad)
                log.error(
                    "deferred releases answered %s for record(s) %s, delivered here before the answer (their "
                    "leases were claimed less than half a TTL earlier: the producer restarted or its clock jumped?)",
                    sorted({r for _, r in bad}),
                    [n for n, _ in bad][:8],
                )

    def verdict(self, record_id: str, lease: int, settled: str) -> HsCompatError | None:
        """The error a lease's verdict makes of its record (None: ``released``, the record may be handed out)."""
        if settled == "released":
            return None
        if settled == "expired":
            self.counters["lease_expired"] += 1
            hello = self._session.reply
            ttl = hello.lease_ttl_s if hello is not None else "?"
            return E.LeaseExpiredError(
                f"record {record_id!r}: its lease (lease_ttl_s={ttl}) expired before the read was released; the "
                "bytes read may be another record's, so it is not handed out here (the producer hands it out again "
                "while its max_redeliveries last; read faster, or raise lease_ttl_s)"
            )
        return E.StaleMetadataError(
            f"record {record_id!r}: the producer does not know lease {lease} any more (it restarted?)"
        )

    def pending(self, timeout_s: float | None = None) -> int:
        """Wait until the producer has answered every posted release (or ``timeout_s``, default the session's
        timeout); how many are still unanswered."""
        client = self._session.channel.client
        if client is None:
            return 0
        client.collect(self._session.timeout_s if timeout_s is None else timeout_s)
        self.reconcile()
        return sum(len(v) for v in self._unsettled.values())

    def close(self) -> None:
        """Wait up to ``CLOSE_COLLECT_S`` for the answers to posted releases (``unanswered_releases`` counts the
        rest: their leases expire at the producer)."""
        client = self._session.channel.client
        if client is None or not self._unsettled:
            return
        try:
            client.collect(CLOSE_COLLECT_S)
            self.reconcile()
        except HsCompatError as e:
            log.info("collecting the answers to posted releases: %s", e)
        left = sum(len(v) for v in self._unsettled.values())
        if left:
            self.counters["unanswered_releases"] += left
            log.warning("%d posted release(s) unanswered at close; their leases expire at the producer", left)
        self._unsettled.clear()
