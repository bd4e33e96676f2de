"""Slot bookkeeping of the producer's host pool: leases, TTLs, back-pressure and counters.

The pool is ``num_slots`` slots of ``slot_bytes`` bytes; a record takes the smallest contiguous run of slots
that holds it.  A lease moves WRITING -> READY (published, waiting for a consumer) -> CLAIMED (a consumer
holds the descriptor) -> freed (released by the consumer, or expired).  A READY lease expires after
``ready_ttl_s`` and a CLAIMED one after ``lease_ttl_s``, so a dead or slow trainer can never wedge serving.

At-least-once: a CLAIMED lease whose ``lease_ttl_s`` runs out before its release is *requeued*, up to
``max_redeliveries`` times per record: its slots are kept (the bytes stay as published), the record goes to the
back of the READY queue under a new lease (new ``lease_id`` and ``nonce``, a fresh ``ready_ttl_s`` clock), and the
old lease is dead -- a read or release naming it is told it expired.  Counted ``redelivered`` (each time; not a
fate).  The expiry after the last redelivery (or the first, with ``max_redeliveries=0``) is the terminal
``expired_claimed``.
When no run is free the ``on_full`` policy decides: ``"drop"`` fails the record at once, ``"wait"`` waits up
to ``wait_timeout_s`` for a release or expiry.

The ledger: every published record ends in exactly one terminal state, counted once --

* ``delivered``, ``checksum_failed``, ``abandoned``: a consumer released the lease and said which (their sum is
  ``released``);
* ``expired_ready`` (nobody claimed it in time), ``expired_claimed`` (claimed ``1 + max_redeliveries`` times and
  never released in time: each consumer died or was too slow);
* ``discarded_at_close``: still READY or CLAIMED when the pool closed;

so ``published == delivered + checksum_failed + abandoned + expired_ready + expired_claimed +
discarded_at_close + leases_ready + leases_claimed`` holds at every moment (``unaccounted`` in :meth:`stats` is
the difference, always 0).  Records refused before publication are counted apart (``dropped_full``,
``too_large``, ``duplicate``, ``aborted``).

Pure bookkeeping: no memory, no transport, thread-safe.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Literal

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import RecordMeta

FULL_POLICIES: Final = ("drop", "wait")
OUTCOMES: Final = ("delivered", "checksum_failed", "abandoned")
#: Default of ``max_redeliveries``: how often a record whose claimed lease expired goes back to the READY queue.
DEFAULT_MAX_REDELIVERIES: Final = 3
#: The fate remembered for a lease that expired CLAIMED and whose record was requeued under a new lease.
REQUEUED: Final = "expired_requeued"
#: Fates of freed leases remembered (so a late release is told "expired", not "unknown").
_FATES_KEPT: Final = 1 << 16

Outcome = Literal["delivered", "checksum_failed", "abandoned"]
Settled = Literal["released", "expired", "unknown"]


class LeaseState(enum.Enum):
    """Where a lease is in its life."""

    WRITING = "writing"
    READY = "ready"
    CLAIMED = "claimed"
    FREED = "freed"


@dataclasses.dataclass(slots=True)
class Lease:
    """One record's run of slots: ``[offset, offset + nbytes)`` of the pool."""

    lease_id: int
    record_id: str
    first_slot: int
    n_slots: int
    offset: int
    nbytes: int
    nonce: str
    state: LeaseState
    deadline: float
    meta: RecordMeta | None = None
    #: the encoded record descriptor (set by the producer at publish; the pool only carries it)
    wire: bytes = b""
    #: the publication nonce a ticket's capability is bound to (set by the producer before publish)
    publication: str = ""
    #: how many times this record went back to the READY queue after a claimed lease expired
    redeliveries: int = 0


_COUNTERS: Final = (
    "published",
    "bytes_published",
    "claimed",
    "released",
    "delivered",
    "checksum_failed",
    "abandoned",
    "expired_ready",
    "expired_claimed",
    "discarded_at_close",
    "dropped_full",
    "waited_full",
    "too_large",
    "duplicate",
    "aborted",
    "stale_releases",
    "redelivered",
)


class LeasePool:
    """The slots of one producer's pool and the lease of every record in it (see the module docstring)."""

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        lease_ttl_s: float = 30.0,
        ready_ttl_s: float | None = 300.0,
        on_full: str = "drop",
        wait_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        max_redeliveries: int = DEFAULT_MAX_REDELIVERIES,
    ) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise E.ExportConfigError(f"num_slots must be an int >= 1, found {num_slots!r}")
        if not isinstance(slot_bytes, int) or slot_bytes < 64 or slot_bytes % 64:
            raise E.ExportConfigError(
                f"slot_bytes must be a positive multiple of 64, found {slot_bytes!r}; round it up"
            )
        if not lease_ttl_s > 0:
            raise E.ExportConfigError(f"lease_ttl_s must be > 0, found {lease_ttl_s!r}")
        if ready_ttl_s is not None and not ready_ttl_s > 0:
            raise E.ExportConfigError(f"ready_ttl_s must be > 0 or None, found {ready_ttl_s!r}")
        if on_full not in FULL_POLICIES:
            raise E.ExportConfigError(f"on_full must be one of {FULL_POLICIES}, found {on_full!r}")
        if not wait_timeout_s >= 0:
            raise E.ExportConfigError(f"wait_timeout_s must be >= 0, found {wait_timeout_s!r}")
        if isinstance(max_redeliveries, bool) or not isinstance(max_redeliveries, int) or max_redeliveries < 0:
            raise E.ExportConfigError(
                f"max_redeliveries must be an int >= 0, found {max_redeliveries!r} (0: an expired claim is lost)"
            )
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.lease_ttl_s = float(lease_ttl_s)
        self.ready_ttl_s = None if ready_ttl_s is None else float(ready_ttl_s)
        self.on_full = on_full
        self.wait_timeout_s = float(wait_timeout_s)
        self.max_redeliveries = max_redeliveries
        self._clock = clock
        self._free = bytearray(num_slots)  # 0 = free, 1 = used
        self._used = 0
        self._cursor = 0
        self._next_id = 1
        self._by_id: dict[int, Lease] = {}
        self._by_record: dict[str, Lease] = {}
        # READY leases in publish order and CLAIMED leases in claim order: with fixed TTLs both are also in
        # deadline order, so expiry only ever looks at the front of each.
        self._ready: collections.OrderedDict[int, Lease] = collections.OrderedDict()
        self._claimed: collections.OrderedDict[int, Lease] = collections.OrderedDict()
        # the CLAIMED leases whose bytes went out in the claim's answer (no transport READ will come for them)
        self._inline: set[int] = set()
        self._cond = threading.Condition()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        self._requeued = False  # a record went back to READY since expire() last woke the long polls
        # lease id -> (nonce, fate) of freed leases, oldest first, bounded
        self._fates: collections.OrderedDict[int, tuple[str, str]] = collections.OrderedDict()
        #: called (outside the lock) after each publish and after :meth:`expire` requeued records; the producer
        #: wakes its parked long polls with it
        self.on_ready: Callable[[], None] | None = None
        #: the descriptor of a requeued record's new lease (called under the pool's lock with that lease, whose
        #: ``wire`` is still the old one); None: the wire is kept as it is
        self.rewire: Callable[[Lease], bytes] | None = None

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    # --- allocation -----------------------------------------------------------------------------------------
    def _find_run(self, n: int) -> int:
        pattern = bytes(n)
        i = self._free.find(pattern, self._cursor)
        if i < 0:
            i = self._free.find(pattern, 0)
        return i

    def allocate(self, record_id: str, nbytes: int) -> Lease:
        """Reserve a run of slots for ``nbytes``; the lease starts WRITING."""
        n = max(1, -(-nbytes // self.slot_bytes))
        with self._cond:
            if self._closed:
                raise E.ExportClosedError("the pool is closed")
            if record_id in self._by_record:
                self._counters["duplicate"] += 1
                raise E.DuplicateRecordError(
                    f"record id {record_id!r} is already in the pool; request ids must be unique per producer"
                )
            if n > self.num_slots:
                self._counters["too_large"] += 1
                raise E.RecordTooLargeError(
                    f"record {record_id!r} needs {nbytes} bytes ({n} slots), the pool holds "
                    f"{self.pool_bytes} "
                    f"bytes ({self.num_slots} x {self.slot_bytes}); raise num_slots or slot_bytes"
                )
            start = self._find_run(n)
            if start < 0:
                self._expire_locked()
                start = self._find_run(n)
            if start < 0 and self.on_full == "wait" and self.wait_timeout_s > 0:
                self._counters["waited_full"] += 1
                deadline = self._clock() + self.wait_timeout_s
                while start < 0 and not self._closed:
                    left = deadline - self._clock()
                    if left <= 0:
                        break
                    self._cond.wait(min(left, 0.05))
                    self._expire_locked()
                    start = self._find_run(n)
            if start < 0:
                self._counters["dropped_full"] += 1
                wait = f", waited {self.wait_timeout_s}s" if self.on_full == "wait" else ""
                raise E.PoolFullError(
                    f"record {record_id!r} ({nbytes} bytes, {n} slots) dropped: "
                    f"{self._used}/{self.num_slots} "
                    f"slots in use (policy {self.on_full!r}{wait}); trainers are not "
                    "keeping up: add consumers, enlarge the pool, or use on_full='wait'"
                )
            self._free[start : start + n] = b"\x01" * n
            self._used += n
            self._cursor = (start + n) % self.num_slots
            lease = Lease(
                lease_id=self._next_id,
                record_id=record_id,
                first_slot=start,
                n_slots=n,
                offset=start * self.slot_bytes,
                nbytes=nbytes,
                nonce=secrets.token_hex(8),
                state=LeaseState.WRITING,
                deadline=float("inf"),
            )
            self._next_id += 1
            self._by_id[lease.lease_id] = lease
            self._by_record[record_id] = lease
            return lease

    def _free_locked(self, lease: Lease, fate: str = "", notify: bool = True) -> None:
        if lease.state is LeaseState.FREED:
            return
        if fate:
            self._fates[lease.lease_id] = (lease.nonce, fate)
            while len(self._fates) > _FATES_KEPT:
                self._fates.popitem(last=False)
        if lease.n_slots == 1:
            self._free[lease.first_slot] = 0
        else:
            self._free[lease.first_slot : lease.first_slot + lease.n_slots] = bytes(lease.n_slots)
        self._used -= lease.n_slots
        lease.state = LeaseState.FREED
        self._by_id.pop(lease.lease_id, None)
        if self._by_record.get(lease.record_id) is lease:
            del self._by_record[lease.record_id]
        self._ready.pop(lease.lease_id, None)
        self._claimed.pop(lease.lease_id, None)
        self._inline.discard(lease.lease_id)
        if notify:
            self._cond.notify_all()

    def publish(self, lease: Lease, meta: RecordMeta, wire: bytes = b"") -> None:
        """WRITING -> READY: the record is complete and may be claimed.  After :meth:`close` this raises
        :class:`ExportClosedError` (the caller aborts the lease)."""
        with self._cond:
            if self._closed:
                raise E.ExportClosedError(f"record {lease.record_id!r}: the pool closed while it was written")
            if lease.state is not LeaseState.WRITING:
                raise E.ExportError(f"lease {lease.lease_id} is {lease.state.value}, expected writing")
            lease.meta = meta
            lease.wire = wire
            lease.state = LeaseState.READY
            lease.deadline = self._clock() + self.ready_ttl_s if self.ready_ttl_s is not None else float("inf")
            self._ready[lease.lease_id] = lease
            self._counters["published"] += 1
            self._counters["bytes_published"] += lease.nbytes
            self._cond.notify_all()
        hook = self.on_ready
        if hook is not None:
            hook()

    def note_aborted(self) -> None:
        """Count a record that was offered and never got a lease (the producer closed first)."""
        with self._cond:
            self._counters["aborted"] += 1

    def abort(self, lease: Lease) -> None:
        with self._cond:
            if lease.state is not LeaseState.FREED:
                self._counters["aborted"] += 1
                self._free_locked(lease)

    # --- consumer side --------------------------------------------------------------------------------------
    def _claim_locked(self, lease: Lease, now: float | None = None, snapshot: bool = True) -> Lease:
        lease.state = LeaseState.CLAIMED
        lease.deadline = (self._clock() if now is None else now) + self.lease_ttl_s
        self._ready.pop(lease.lease_id, None)
        self._claimed[lease.lease_id] = lease
        self._counters["claimed"] += 1
        return _snapshot(lease) if snapshot else lease  # a snapshot the caller may read without the lock

    def claim(self, record_id: str, publication: str | None = None) -> Lease:
        """Claim READY record ``record_id``; with ``publication``, only if that is its publication nonce (checked
        under the lock, so a record of the same id published in between is never claimed instead).  A record of
        another publication is answered exactly as one not in the pool."""
        with self._cond:
            self._expire_locked()
            lease = self._by_record.get(record_id)
            if lease is not None and publication is not None and not _same(lease.publication, publication):
                lease = None
            if lease is None or lease.state is not LeaseState.READY:
                why = "is not in the pool" if lease is None else f"is {lease.state.value}"
                raise E.UnknownRecordError(
                    f"record {record_id!r} {why} (never published, dropped, expired, or taken by another "
                    "consumer); see the producer's stats"
                )
            return self._claim_locked(lease)

    def claim_next(
        self,
        max_records: int,
        max_bytes: int,
        timeout_s: float,
        *,
        budget: int | None = None,
        cost: Callable[[Lease], int] | None = None,
        snapshots: bool = True,
    ) -> list[Lease]:
        """Claim up to ``max_records`` READY records (oldest first, at most ``max_bytes`` in total; the first one
        is always taken, even when larger, so the stream cannot stall on it), waiting up to ``timeout_s`` for the
        first.  With ``budget`` and ``cost``, the claimed leases' costs (their encoded descriptors) also sum to at
        most ``budget``: what does not fit stays READY for the next claim.  ``snapshots=False`` returns the live
        leases instead of copies: only their fields that never change after publication (``lease_id``,
        ``record_id``, ``offset``, ``nbytes``, ``nonce``, ``wire``) may be read without the lock (a requeue
        makes a new lease object and leaves the old one's fields as they were)."""
        deadline = self._clock() + timeout_s
        with self._cond:
            while True:
                self._expire_locked()
                if self._ready or self._closed:
                    break
                left = deadline - self._clock()
                if left <= 0:
                    return []
                self._cond.wait(min(left, 0.05))
            total = 0
            spent = 0
            take: list[Lease] = []
            for lease in self._ready.values():
                if len(take) >= max_records or (take and total + lease.nbytes > max_bytes):
                    break
                if cost is not None and budget is not None:
                    c = cost(lease)
                    if spent + c > budget:
                        break
                    spent += c
                total += lease.nbytes
                take.append(lease)
            now = self._clock()
            return [self._claim_locked(lease, now, snapshots) for lease in take]

    def ready_wire_size(self, record_id: str) -> int | None:
        """Encoded descriptor size of READY record ``record_id`` (None when it is not READY)."""
        with self._cond:
            lease = self._by_record.get(record_id)
            return len(lease.wire) if lease is not None and lease.state is LeaseState.READY else None

    def has_ready(self) -> bool:
        """True when a published record waits to be claimed."""
        with self._cond:
            self._expire_locked()
            return bool(self._ready)

    def claimed(self, lease_ids: Iterable[int]) -> list[Lease]:
        """Snapshots of those of ``lease_ids`` that are still CLAIMED (a retried claim is answered with them)."""
        with self._cond:
            self._expire_locked()
            out = []
            for lid in lease_ids:
                lease = self._by_id.get(lid)
                if lease is not None and lease.state is LeaseState.CLAIMED:
                    out.append(_snapshot(lease))
            return out

    def lease(self, lease_id: int, nonce: str) -> Lease | None:
        """A snapshot of CLAIMED lease ``lease_id`` if ``nonce`` is its nonce (after expiring what is due)."""
        with self._cond:
            self._expire_locked()
            lease = self._by_id.get(lease_id)
            if lease is None or lease.state is not LeaseState.CLAIMED or not _same(lease.nonce, nonce):
                return None
            return _snapshot(lease)

    def fate(self, lease_id: int, nonce: str) -> str | None:
        """How a freed lease ended (``released:<outcome>``, ``expired_ready``, ``expired_claimed``,
        ``expired_requeued`` (:data:`REQUEUED`: it expired and its record went back to the queue under a new
        lease), ``discarded_at_close``), if it is still remembered and ``nonce`` is its nonce."""
        with self._cond:
            got = self._fates.get(lease_id)
            if got is None or not _same(got[0], nonce):
                return None
            return got[1]

    def settle(self, lease_id: int, nonce: str, outcome: str = "delivered") -> Settled:
        """Release a CLAIMED lease with its outcome (``delivered``, ``checksum_failed`` or ``abandoned``):
        ``"released"``.  A lease already released with the same nonce answers ``"released"`` again (a retried
        release).  One whose TTL ran out first answers ``"expired"`` (also when its record was requeued: the
        record is then another lease's, and this release changes nothing); anything else ``"unknown"``.  Only
        ``"released"`` of a claimed lease counts; the others are counted ``stale_releases``."""
        return self.settle_many([(lease_id, nonce, outcome)])[0]

    def settle_many(self, items: Sequence[tuple[int, str, str]]) -> list[Settled]:
        """:meth:`settle` of every ``(lease_id, nonce, outcome)``, in order, under one lock (waiters are woken
        once, after all of them)."""
        for _, _, outcome in items:
            if outcome not in OUTCOMES:
                raise E.ProtocolError(f"release outcome must be one of {OUTCOMES}, found {outcome!r}")
        out: list[Settled] = []
        counters = self._counters
        with self._cond:
            now = self._clock()
            freed = False
            for lease_id, nonce, outcome in items:
                lease = self._by_id.get(lease_id)
                if lease is not None and lease.state is LeaseState.CLAIMED and lease.deadline <= now:
                    self._expire_locked()  # its deadline passed: it expired, whatever the sweep's timing
                    freed = True
                    lease = None
                if lease is not None and lease.state is LeaseState.CLAIMED and _same(lease.nonce, nonce):
                    counters["released"] += 1
                    counters[outcome] += 1
                    self._free_locked(lease, f"released:{outcome}", notify=False)
                    freed = True
                    out.append("released")
                    continue
                counters["stale_releases"] += 1
                got = self._fates.get(lease_id)
                if got is not None and _same(got[0], nonce):
                    out.append("released" if got[1].startswith("released:") else "expired")
                else:
                    out.append("unknown")
            if freed:
                self._cond.notify_all()
        return out

    def release(self, lease_id: int, nonce: str, outcome: str = "delivered") -> bool:
        """Free a CLAIMED lease (True); a wrong nonce or an unknown/expired lease is counted and ignored (False)."""
        with self._cond:
            lease = self._by_id.get(lease_id)
            if lease is None or lease.state is not LeaseState.CLAIMED:
                self._counters["stale_releases"] += 1
                return False
        return self.settle(lease_id, nonce, outcome) == "released"

    # --- time -----------------------------------------------------------------------------------------------
    def _expire_locked(self) -> int:
        now = self._clock()
        n = 0
        ready = self._ready
        while ready:
            lease = next(iter(ready.values()))
            if lease.deadline > now:
                break
            self._counters["expired_ready"] += 1
            self._free_locked(lease, "expired_ready")
            n += 1
        claimed = self._claimed
        while claimed:
            lease = next(iter(claimed.values()))
            if lease.deadline > now:
                break
            if lease.redeliveries >= self.max_redeliveries or self._closed or not self._requeue_locked(lease, now):
                self._counters["expired_claimed"] += 1  # terminal: redeliveries used up (or off)
                self._free_locked(lease, "expired_claimed")
            n += 1
        return n

    def _requeue_locked(self, lease: Lease, now: float) -> bool:
        """CLAIMED ``lease`` expired: the record goes back to the READY queue (its back: the queue stays in
        deadline order) under a new lease on the same slots, with a fresh ready clock.  The old lease object is
        marked FREED (never reused: a caller holding it reads fields that no longer change) and its id is
        remembered as :data:`REQUEUED`, so its holder's read or release is told it expired.  False (nothing
        changed; the caller ends the record) if :attr:`rewire` failed."""
        fresh = dataclasses.replace(
            lease,
            lease_id=self._next_id,
            nonce=secrets.token_hex(8),
            state=LeaseState.READY,
            deadline=now + self.ready_ttl_s if self.ready_ttl_s is not None else float("inf"),
            redeliveries=lease.redeliveries + 1,
        )
        hook = self.rewire
        if hook is not None:
            try:
                fresh.wire = hook(fresh)
            except Exception:  # a descriptor that cannot be re-encoded: the record ends expired_claimed
                return False
        self._next_id += 1
        del self._claimed[lease.lease_id]
        self._inline.discard(lease.lease_id)
        del self._by_id[lease.lease_id]
        self._fates[lease.lease_id] = (lease.nonce, REQUEUED)
        while len(self._fates) > _FATES_KEPT:
            self._fates.popitem(last=False)
        lease.state = LeaseState.FREED
        self._by_id[fresh.lease_id] = fresh
        self._by_record[fresh.record_id] = fresh
        self._ready[fresh.lease_id] = fresh
        self._counters["redelivered"] += 1
        self._requeued = True
        self._cond.notify_all()
        return True

    def expire(self) -> int:
        """Reclaim (or requeue) every lease past its deadline; returns how many."""
        with self._cond:
            n = self._expire_locked()
            requeued, self._requeued = self._requeued, False
        hook = self.on_ready
        if requeued and hook is not None:
            hook()  # a requeued record is claimable: wake the long polls parked for one
        return n

    def claimed_count(self) -> int:
        return len(self._claimed)

    def mark_inline(self, lease_ids: Iterable[int]) -> None:
        """Note that the bytes of these CLAIMED leases went out in their claim's answer: no transport READ will
        come for them (see :meth:`read_claimed_count`).  Ids no longer CLAIMED are ignored."""
        with self._cond:
            for lid in lease_ids:
                if lid in self._claimed:
                    self._inline.add(lid)

    def read_claimed_count(self) -> int:
        """CLAIMED leases a transport READ may still come for (all but those marked with :meth:`mark_inline`): the
        producer's pump progresses the transport while there are any."""
        with self._cond:
            return len(self._claimed) - len(self._inline)

    # --- introspection --------------------------------------------------------------------------------------
    def occupancy(self) -> int:
        """Slots in use (any state)."""
        with self._cond:
            return self._used

    def stats(self) -> dict[str, int]:
        """Counters, occupancy and the ledger balance (``unaccounted``: always 0)."""
        with self._cond:
            c = self._counters
            ready, claimed = len(self._ready), len(self._claimed)
            ended = sum(c[k] for k in ("delivered", "checksum_failed", "abandoned")) + sum(
                c[k] for k in ("expired_ready", "expired_claimed", "discarded_at_close")
            )
            return {
                **c,
                "num_slots": self.num_slots,
                "slot_bytes": self.slot_bytes,
                "max_redeliveries": self.max_redeliveries,
                "used_slots": self._used,
                "leases_writing": len(self._by_id) - ready - claimed,
                "leases_ready": ready,
                "leases_claimed": claimed,
                "unaccounted": c["published"] - ended - ready - claimed,
            }

    def close(self) -> None:
        """Refuse new records and discard the READY and CLAIMED ones (counted ``discarded_at_close``)."""
        with self._cond:
            self._closed = True
            for lease in list(self._ready.values()) + list(self._claimed.values()):
                self._counters["discarded_at_close"] += 1
                self._free_locked(lease, "discarded_at_close")
            self._cond.notify_all()


def _snapshot(lease: Lease) -> Lease:
    """A copy of ``lease`` (what ``dataclasses.replace`` makes, at a fraction of its cost: this runs per record)."""
    return Lease(
        lease.lease_id,
        lease.record_id,
        lease.first_slot,
        lease.n_slots,
        lease.offset,
        lease.nbytes,
        lease.nonce,
        lease.state,
        lease.deadline,
        lease.meta,
        lease.wire,
        lease.publication,
        lease.redeliveries,
    )


def _same(a: str, b: str) -> bool:
    """Constant-time equality of two nonces; any str (non-ASCII included) compares, never raises."""
    try:
        return secrets.compare_digest(a, b)  # ASCII strings (every real nonce): no encoding
    except TypeError:
        return secrets.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))
