"""Slot bookkeeping of the producer's host pool: leases, TTLs, back-pressure and counters.

The pool is ``num_slots`` slots of ``slot_bytes`` bytes; a record takes the smallest contiguous run of slots
that holds it.  A lease moves WRITING -> READY (published, waiting for a consumer) -> CLAIMED (a consumer
holds the descriptor) -> freed (released by the consumer, or expired).  A READY lease expires after
``ready_ttl_s`` and a CLAIMED one after ``lease_ttl_s``, so a dead or slow trainer can never wedge serving.
When no run is free the ``on_full`` policy decides: ``"drop"`` fails the record at once, ``"wait"`` waits up
to ``wait_timeout_s`` for a release or expiry.  Every outcome is counted in :meth:`LeasePool.stats`; nothing
leaves silently.

Pure bookkeeping: no memory, no transport, thread-safe.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import secrets
import threading
import time
from collections.abc import Callable
from typing import Final

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import RecordMeta

FULL_POLICIES: Final = ("drop", "wait")


class LeaseState(enum.Enum):
    WRITING = "writing"
    READY = "ready"
    CLAIMED = "claimed"
    FREED = "freed"


@dataclasses.dataclass(slots=True)
class Lease:
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


_COUNTERS: Final = (
    "published",
    "bytes_published",
    "claimed",
    "released",
    "expired_ready",
    "expired_claimed",
    "dropped_full",
    "waited_full",
    "too_large",
    "duplicate",
    "aborted",
    "stale_releases",
)


class LeasePool:
    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        lease_ttl_s: float = 30.0,
        ready_ttl_s: float | None = 300.0,
        on_full: str = "drop",
        wait_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
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
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.lease_ttl_s = float(lease_ttl_s)
        self.ready_ttl_s = None if ready_ttl_s is None else float(ready_ttl_s)
        self.on_full = on_full
        self.wait_timeout_s = float(wait_timeout_s)
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
        self._cond = threading.Condition()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._closed = False

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

    def _free_locked(self, lease: Lease) -> None:
        if lease.state is LeaseState.FREED:
            return
        self._free[lease.first_slot : lease.first_slot + lease.n_slots] = bytes(lease.n_slots)
        self._used -= lease.n_slots
        lease.state = LeaseState.FREED
        self._by_id.pop(lease.lease_id, None)
        if self._by_record.get(lease.record_id) is lease:
            del self._by_record[lease.record_id]
        self._ready.pop(lease.lease_id, None)
        self._claimed.pop(lease.lease_id, None)
        self._cond.notify_all()

    def publish(self, lease: Lease, meta: RecordMeta) -> None:
        with self._cond:
            if lease.state is not LeaseState.WRITING:
                raise E.ExportError(f"lease {lease.lease_id} is {lease.state.value}, expected writing")
            lease.meta = meta
            lease.state = LeaseState.READY
            lease.deadline = self._clock() + self.ready_ttl_s if self.ready_ttl_s is not None else float("inf")
            self._ready[lease.lease_id] = lease
            self._counters["published"] += 1
            self._counters["bytes_published"] += lease.nbytes
            self._cond.notify_all()

    def abort(self, lease: Lease) -> None:
        with self._cond:
            if lease.state is not LeaseState.FREED:
                self._counters["aborted"] += 1
                self._free_locked(lease)

    # --- consumer side --------------------------------------------------------------------------------------
    def _claim_locked(self, lease: Lease) -> Lease:
        lease.state = LeaseState.CLAIMED
        lease.deadline = self._clock() + self.lease_ttl_s
        self._ready.pop(lease.lease_id, None)
        self._claimed[lease.lease_id] = lease
        self._counters["claimed"] += 1
        return dataclasses.replace(lease)  # a snapshot the caller may read without the lock

    def claim(self, record_id: str) -> Lease:
        with self._cond:
            self._expire_locked()
            lease = self._by_record.get(record_id)
            if lease is None or lease.state is not LeaseState.READY:
                why = "is not in the pool" if lease is None else f"is {lease.state.value}"
                raise E.UnknownRecordError(
                    f"record {record_id!r} {why} (never published, dropped, expired, or taken by another "
                    "consumer); see the producer's stats"
                )
            return self._claim_locked(lease)

    def claim_next(self, max_records: int, max_bytes: int, timeout_s: float) -> list[Lease]:
        """Claim up to ``max_records`` READY records (oldest first, at most ``max_bytes`` in total; the
        first one
        is always taken if it fits alone), waiting up to ``timeout_s`` for the first."""
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
            take: list[Lease] = []
            for lease in self._ready.values():
                if take and (len(take) >= max_records or total + lease.nbytes > max_bytes):
                    break
                total += lease.nbytes
                take.append(lease)
            return [self._claim_locked(lease) for lease in take]

    def release(self, lease_id: int, nonce: str) -> bool:
        """Free a CLAIMED lease; a wrong nonce or an unknown/expired lease is counted and ignored."""
        with self._cond:
            lease = self._by_id.get(lease_id)
            if lease is None or lease.state is not LeaseState.CLAIMED or not secrets.compare_digest(lease.nonce, nonce):
                self._counters["stale_releases"] += 1
                return False
            self._counters["released"] += 1
            self._free_locked(lease)
            return True

    # --- time -----------------------------------------------------------------------------------------------
    def _expire_locked(self) -> int:
        now = self._clock()
        n = 0
        for queue, key in ((self._ready, "expired_ready"), (self._claimed, "expired_claimed")):
            while queue:
                lease = next(iter(queue.values()))
                if lease.deadline > now:
                    break
                self._counters[key] += 1
                self._free_locked(lease)
                n += 1
        return n

    def expire(self) -> int:
        """Reclaim every lease past its deadline; returns how many."""
        with self._cond:
            return self._expire_locked()

    def next_deadline(self) -> float:
        with self._cond:
            fronts = [next(iter(q.values())).deadline for q in (self._ready, self._claimed) if q]
            return min(fronts, default=float("inf"))

    def claimed_count(self) -> int:
        return len(self._claimed)

    # --- introspection --------------------------------------------------------------------------------------
    def occupancy(self) -> int:
        """Slots in use (any state)."""
        with self._cond:
            return self._used

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                **self._counters,
                "num_slots": self.num_slots,
                "slot_bytes": self.slot_bytes,
                "used_slots": self._used,
                "leases_writing": len(self._by_id) - len(self._ready) - len(self._claimed),
                "leases_ready": len(self._ready),
                "leases_claimed": len(self._claimed),
            }

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
