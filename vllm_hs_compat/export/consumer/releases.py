"""Releases: each lease given back with its outcome, and the producer's verdict on it.

A release made far from its lease's deadline is posted and its verdict taken as given (``defer_releases``);
the answers are checked as they arrive (``_reconcile``) and at close.  Built on the channel layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_hs_compat import errors as E
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.consumer.channel import _Connected

if TYPE_CHECKING:
    from vllm_hs_compat.export.consumer.claims import Claim

log = logging.getLogger(__package__)  # one logger for the whole consumer: vllm_hs_compat.export.consumer

#: A release is posted without waiting for its answer while less than this share of the lease TTL has passed
#: since its claim was sent (``defer_releases``).
DEFER_FRACTION = 0.5
#: How long :meth:`ExportConsumer.close` waits for the answers to posted releases.
CLOSE_COLLECT_S = 2.0


class _Releases(_Connected):
    """Lease releases and their verdicts."""

    def _settle(self, entries: Sequence[tuple[int, str, str]]) -> list[str] | E.ExportError:
        """Release ``(lease, nonce, outcome)`` entries; the producer's verdict for each, or the error that kept
        it from answering."""
        out: list[str] = []
        try:
            for i in range(0, len(entries), P.MAX_RELEASES):
                part = entries[i : i + P.MAX_RELEASES]
                items = [P.ReleaseItem(lease, nonce, outcome) for lease, nonce, outcome in part]  # type: ignore[arg-type]
                rep = self._call(P.ReleaseReq(items, cap=self._cap()))
                if not isinstance(rep, P.ReleaseReply) or len(rep.results) != len(part):
                    raise E.ProtocolError(f"release of {len(part)} lease(s) answered with {type(rep).__name__}")
                out.extend(rep.results)
        except E.ExportError as e:
            log.info("release failed (%s); the producer's TTL reclaims the slots", e)
            return e
        return out

    def _release(
        self, entries: Sequence[tuple[int, str, str]], claimed_at: float, names: Sequence[str]
    ) -> list[str] | E.ExportError:
        """Release ``entries`` (of records ``names``) claimed at ``claimed_at``.  Far from the leases' deadline
        (``defer_releases``: before half their TTL has passed since the claim was sent) the release is posted and
        its verdict taken as ``released`` at once: no lease claimed then can have expired yet, so no byte read
        under it can be another record's, and the answer (collected by later calls) only confirms it; any other
        answer is counted (``late_verdicts``) and logged.  Otherwise this waits for the producer's verdicts."""
        client = self._channel.client
        ttl = self._hello.lease_ttl_s if self._hello is not None else 0.0
        if (
            not self.defer_releases
            or client is None
            or claimed_at <= 0.0
            or time.monotonic() >= claimed_at + DEFER_FRACTION * ttl
        ):
            return self._settle(entries)
        for i in range(0, len(entries), P.MAX_RELEASES):
            part = entries[i : i + P.MAX_RELEASES]
            items = [P.ReleaseItem(lease, nonce, outcome) for lease, nonce, outcome in part]  # type: ignore[arg-type]
            rid = client.post(P.ReleaseReq(items, cap=self._cap()))
            self._unsettled[rid] = list(names[i : i + P.MAX_RELEASES])
        self.counters["deferred_releases"] += len(entries)
        return ["released"] * len(entries)

    def _reconcile(self) -> None:
        """Check the answers to posted releases that have arrived."""
        client = self._channel.client
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

    def _verdict(self, c: Claim, settled: str) -> HsCompatError | None:
        if settled == "released":
            return None
        if settled == "expired":
            self.counters["lease_expired"] += 1
            ttl = self._hello.lease_ttl_s if self._hello is not None else "?"
            return E.LeaseExpiredError(
                f"record {c.record_id!r}: its lease (lease_ttl_s={ttl}) expired before the read was released; the "
                "bytes read may be another record's, so it is not handed out here (the producer hands it out again "
                "while its max_redeliveries last; read faster, or raise lease_ttl_s)"
            )
        return E.StaleMetadataError(
            f"record {c.record_id!r}: the producer does not know lease {c.lease} any more (it restarted?)"
        )

    def settle_pending(self, timeout_s: float | None = None) -> int:
        """Wait until the producer has answered every posted release (or ``timeout_s``, default the consumer's
        timeout); returns how many are still unanswered.  Not needed for correctness (see :meth:`_release`):
        for a caller that wants the producer's ledger settled now, e.g. before reading its stats."""
        client = self._channel.client
        if client is None:
            return 0
        client.collect(self.timeout_s if timeout_s is None else timeout_s)
        self._reconcile()
        return sum(len(v) for v in self._unsettled.values())

    def _collect_posted(self) -> None:
        """At close: wait up to ``CLOSE_COLLECT_S`` for the answers to posted releases (``unanswered_releases``
        counts the rest: their leases expire at the producer)."""
        client = self._channel.client
        if client is None or not self._unsettled:
            return
        try:
            client.collect(CLOSE_COLLECT_S)
            self._reconcile()
        except HsCompatError as e:
            log.info("collecting the answers to posted releases: %s", e)
        left = sum(len(v) for v in self._unsettled.values())
        if left:
            self.counters["unanswered_releases"] += left
            log.warning("%d posted release(s) unanswered at close; their leases expire at the producer", left)
        self._unsettled.clear()
