"""Checked reads: claimed records moved into the landing space, verified, released, handed out.

:class:`Reads` reads claims through the landing's transport (a ticket holder's record through the control plane
instead), verifies both checksums, releases each lease with its outcome through the releases and hands out the
records that passed.  A large verified read is checksummed piece by piece as it lands (posted reads in a window
over NIXL, a reader thread with ``overlap_verification``).
"""

from __future__ import annotations

import array
import collections
import gc
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.checksums import ChecksumState, checksum_bytes
from vllm_hs_compat.core.records import CaptureRecord, RecordMeta
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.consumer.claims import Claim, Claims
from vllm_hs_compat.export.consumer.landing import PAGE, Landing, _copied
from vllm_hs_compat.export.consumer.releases import Releases
from vllm_hs_compat.export.consumer.session import Session
from vllm_hs_compat.export.transport import (
    REGION_MASK,
    REGION_SHIFT,
    ConsumerTransport,
    checked_reads,
    posted_reads,
)

#: With verification on, a read of at least this many bytes is cut into pieces, each checksummed as soon as it
#: landed (``CHECK_PIECE_BYTES``); with ``overlap_verification`` a reader thread transfers piece k + 1 (NIXL's
#: ``transfer`` releases the GIL) while this thread checksums piece k.
OVERLAP_MIN_BYTES = 4 << 20
#: pieces of a verified read without ``overlap_verification``: each checksummed right after it landed
CHECK_PIECE_BYTES = 2 << 20
#: pieces of a pipelined read: about an eighth of it, between these bounds
PIECE_MIN_BYTES = 1 << 20
PIECE_MAX_BYTES = 8 << 20
#: A verified read over a transport with posted reads (NIXL): this many pieces in flight at once, each
#: checksummed as soon as it landed, in order, on the calling thread (1: one piece after another)
READ_WINDOW = 16
#: while a piece is awaited its READ is polled without pause for this long (over UCX TCP only the polls move
#: the bytes), then with short sleeps (a stalled producer does not burn a core until the deadline)
PIECE_SPIN_S = 20e-3


def _token_ids(raw: memoryview) -> tuple[int, ...]:
    ids = array.array("I")
    ids.frombytes(raw)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        ids.byteswap()
    return tuple(ids)


def _pieces(ranges: Sequence[tuple[int, int, int]], size: int) -> list[list[tuple[int, int, int, int, int]]]:
    """``(remote, local, nbytes)`` ranges cut into pieces of ``size`` bytes (the last one shorter), in order:
    each piece a list of ``(remote, local, nbytes, range index, offset in the range)``."""
    pieces: list[list[tuple[int, int, int, int, int]]] = [[]]
    room = size
    for k, (remote, local, nbytes) in enumerate(ranges):
        at = 0
        while at < nbytes:
            if room == 0:
                pieces.append([])
                room = size
            n = min(nbytes - at, room)
            pieces[-1].append((remote + at, local + at, n, k, at))
            room -= n
            at += n
    return pieces


class Reads:
    """Reading claimed records: transfer, verification, release, hand-out.

    ``verify_checksum`` (on by default): turning it off saves one memory pass over every record and leaves the size
    checks and the token ids' checksum: do it only where the transport is trusted.  ``overlap_verification``:
    checksum a large read piece by piece while a reader thread transfers the next piece (see :meth:`_transfer`);
    off by default: it needs a free core, and on the 2-vCPU box it was measured on (docs/benchmarks.md) it was
    slower than verifying after the transfer."""

    def __init__(
        self,
        session: Session,
        claims: Claims,
        releases: Releases,
        landing: Landing,
        *,
        verify_checksum: bool,
        overlap_verification: bool,
    ) -> None:
        self._session = session
        self._claims = claims
        self._releases = releases
        self._landing = landing
        self.verify_checksum = verify_checksum
        self.overlap_verification = overlap_verification
        self._reader: Any = None  # concurrent.futures.ThreadPoolExecutor, made on the first pipelined read
        self.counters = dict.fromkeys(
            (
                "records",
                "bytes",
                "checksum_failures",
                "read_failures",
                "inline_records",
                "lease_expired",
                "quarantined_bytes",
            ),
            0,
        )

    def check(self, c: Claim) -> None:
        """A claim this consumer can read: of the attached producer instance, inside its pool."""
        producer = self._session.producer
        if c.producer != producer:
            raise E.StaleMetadataError(
                f"record {c.record_id!r} was leased from producer {c.producer}, now attached to {producer}; "
                "the producer restarted and the record is gone"
            )
        pool = self._session.pool_bytes
        if c.offset + c.extent > pool:
            raise E.DescriptorError(
                f"record {c.record_id!r}: descriptor [{c.offset}, {c.offset + c.extent}) lies outside the "
                f"producer's {pool}-byte pool; refusing to read it"
            )

    def _verify(
        self, c: Claim, buf: torch.Tensor, off: int, digest: int | None = None
    ) -> tuple[RecordMeta | HsCompatError, str]:
        """Check the bytes at ``buf[off:]`` (``digest``: their hidden-state checksum, when it was computed while
        they were read): ``(metadata, "delivered")`` or ``(error, outcome)``."""
        return self._verify_bytes(c, self._landing.bytes_of(buf), off, digest)

    def _verify_bytes(
        self, c: Claim, raw: memoryview, off: int, digest: int | None = None
    ) -> tuple[RecordMeta | HsCompatError, str]:
        """:meth:`_verify` over a byte view."""
        algorithm = c.meta.checksum_algorithm
        if self.verify_checksum:
            got = checksum_bytes(raw[off : off + c.nbytes], algorithm) if digest is None else digest
            if got != c.meta.checksum:
                self.counters["checksum_failures"] += 1
                return (
                    E.ChecksumMismatchError(
                        f"record {c.record_id!r}: {algorithm} of the {c.nbytes} bytes read is {got:#018x}, the "
                        f"producer computed {c.meta.checksum:#018x}; the slot was overwritten or the transfer torn"
                    ),
                    "checksum_failed",
                )
        ids_raw = raw[off + c.ids_offset : off + c.extent]
        if checksum_bytes(ids_raw, algorithm) != c.ids_checksum:
            self.counters["checksum_failures"] += 1
            return (
                E.ChecksumMismatchError(
                    f"record {c.record_id!r}: the {c.meta.shape[0]} token ids read do not match their {algorithm} "
                    "checksum; the slot was overwritten or the transfer torn"
                ),
                "checksum_failed",
            )
        try:
            return c.meta.with_token_ids(_token_ids(ids_raw)), "delivered"
        except E.RecordFormatError as e:
            return e, "abandoned"

    def read(
        self, claims: Sequence[Claim], copy: bool = True, timeout_s: float | None = None
    ) -> list[CaptureRecord | HsCompatError]:
        """Read claimed records (one transfer per landing-buffer-full), verify each, release each lease with its
        outcome.  Returns one entry per claim: the record, or the named error that failed it."""
        if self._session.channel.client is None:
            raise E.ExportClosedError("consumer is closed")
        deadline = time.monotonic() + (timeout_s or self._session.timeout_s)
        results: list[CaptureRecord | HsCompatError | None] = [None] * len(claims)
        todo: collections.deque[tuple[int, Claim]] = collections.deque()
        for i, c in enumerate(claims):
            try:
                self.check(c)
                todo.append((i, c))
            except E.StaleMetadataError as e:
                results[i] = e  # a lease of a dead producer: nothing to give back
            except E.ExportError as e:
                results[i] = e
                self._claims.abandon([c])
        if any(c.inline is not None for _, c in todo):
            rest: collections.deque[tuple[int, Claim]] = collections.deque()
            for i, c in todo:
                if c.inline is None:
                    rest.append((i, c))
                else:
                    results[i] = self._read_given(c, c.inline)
            todo = rest
        landing = self._landing
        transport = landing.transport
        if transport is None:
            for i, c in todo:
                results[i] = self._read_inline(c, deadline)
            return [r if r is not None else E.ExportError("internal: no result") for r in results]

        def place(c: Claim, pending: int) -> tuple[int | None, bool]:
            return landing.place(c.extent, c.nbytes, copy, pending)

        while todo:
            group: list[tuple[int, Claim, int]] = []
            lend: set[int] = set()
            pending = 0  # landing-buffer bytes promised to records of this group that will be lent
            while todo and len(group) < P.MAX_RELEASES:
                i, c = todo[0]
                off, lent = place(c, pending)
                if off is None and not group and (landing.lent or landing.spill_lent):
                    gc.collect()  # owned records in reference cycles: give their lent space back first
                    off, lent = place(c, pending)
                if off is None:
                    break
                if lent:
                    lend.add(i)
                    if not off >> REGION_SHIFT:
                        pending += c.extent
                todo.popleft()
                group.append((i, c, off))
            if not group:
                i, c = todo.popleft()
                results[i] = landing.no_room(c.record_id, c.extent, batches=False)
                self._claims.abandon([c])
                continue
            try:
                digests = self._transfer(transport, group, deadline)
            except E.ExportError as e:
                self.counters["read_failures"] += len(group)
                for i, c, off in group:
                    results[i] = e
                    if isinstance(e, E.ExportTimeoutError):
                        # the transfer may still complete and write here: never reuse this space (it could be
                        # lent to an owned record, verified and handed out, before the late write lands)
                        self.counters["quarantined_bytes"] += c.extent
                    else:
                        landing.free(off, c.extent)
                if not isinstance(e, E.RemoteDisconnectedError | E.StaleMetadataError):
                    self._claims.abandon([c for _, c, _ in group])
                continue
            checked = [
                (i, c, off, *self._verify(c, *landing.locate(off), d))
                for (i, c, off), d in zip(group, digests, strict=True)
            ]
            settled = self._releases.release(
                [(c.lease, c.nonce, outcome) for _, c, _, _, outcome in checked],
                min(c.claimed_at for _, c, _, _, _ in checked),
                [c.record_id for _, c, _, _, _ in checked],
            )
            for k, (i, c, off, meta, _) in enumerate(checked):
                bad = (
                    settled
                    if isinstance(settled, E.ExportError)
                    else self._releases.verdict(c.record_id, c.lease, settled[k])
                )
                if isinstance(meta, HsCompatError) or bad is not None:
                    landing.free(off, c.extent)
                    # an expired lease explains whatever the bytes looked like: it comes first
                    expired = bad if isinstance(bad, E.LeaseExpiredError) else None
                    results[i] = expired or (meta if isinstance(meta, HsCompatError) else bad)
                    continue
                results[i] = self._finish(c, meta, off, copy, i in lend)
        return [r if r is not None else E.ExportError("internal: no result") for r in results]

    def _transfer(
        self, transport: ConsumerTransport, group: Sequence[tuple[int, Claim, int]], deadline: float
    ) -> list[int | None]:
        """Transfer the group's records into the landing buffer; their hidden-state checksums when they were
        computed on the way (verification on, a large read or a transport that checksums as it copies), else
        ``None`` each.

        With verification on, a read of at least ``OVERLAP_MIN_BYTES`` is cut into pieces and each piece is
        checksummed right after it landed, while it is still in cache (``CHECK_PIECE_BYTES``; measured on the
        2-vCPU box over NIXL/UCX loopback: a 64 MiB READ + xxh3 0.76x the bare READ, in 2 MiB pieces 0.87x; over
        NIXL the pieces are posted ``READ_WINDOW`` at a time, see :meth:`read_checked`).  With
        ``overlap_verification`` the pieces are about an eighth of the read and a reader thread transfers piece
        k + 1 while this thread checksums piece k (it pays only where a core is free)."""
        total = sum(c.extent for _, c, _ in group)
        if not self.verify_checksum or (total < OVERLAP_MIN_BYTES and checked_reads(transport) is None):
            transport.read([(c.offset, off, c.extent) for _, c, off in group], deadline)
            return [None] * len(group)
        return list(
            self.read_checked(
                transport,
                [(c.offset, off, c.extent, c.nbytes) for _, c, off in group],
                [c.meta.checksum_algorithm for _, c, _ in group],
                deadline,
                overlap=self.overlap_verification,
            )
        )

    def read_checked(
        self,
        transport: ConsumerTransport,
        items: Sequence[tuple[int, int, int, int]],
        algorithms: Sequence[str],
        deadline: float,
        *,
        overlap: bool = False,
    ) -> list[int]:
        """Read ``(remote, local, nbytes, checked)`` ranges and return the checksum of each one's first ``checked``
        bytes (its own algorithm), taken on the way while the bytes are in cache: over shm by the copy that
        checksums each chunk right after copying it (one algorithm for all), else in ``CHECK_PIECE_BYTES`` reads
        (pieces cut ranges anywhere), each checksummed as soon as it landed, or with ``overlap`` in pieces of
        about an eighth of the read, a reader thread transferring piece k + 1 while this thread checksums piece k.

        With posted reads (NIXL) up to ``READ_WINDOW`` pieces are in flight; they are completed in order on this
        thread, each checksummed as soon as it landed (posting stops while a transport moves bytes as it posts:
        the piece is checksummed while in cache).  On a deadline every posted read is released (the caller
        quarantines the range: a cancelled READ may still land); after any other failure the reads still in flight
        are waited for first (a read still in flight at the deadline turns the failure into a timeout)."""
        shm = checked_reads(transport)
        if shm is not None and len(set(algorithms)) == 1:
            return list(shm.read_checked(items, algorithms[0], deadline))
        total = sum(n for _, _, n, _ in items)
        size = max(PIECE_MIN_BYTES, min(PIECE_MAX_BYTES, -(-total // 8))) if overlap else CHECK_PIECE_BYTES
        pieces = _pieces([(r, lo, n) for r, lo, n, _ in items], size)
        states = [ChecksumState(a, it[3]) for a, it in zip(algorithms, items, strict=True)]
        land = self._landing.bytes_of(transport.landing)
        arena = self._landing.arena_view

        def check(piece: list[tuple[int, int, int, int, int]]) -> None:
            for _, lo, n, k, at in piece:
                checked = items[k][3]
                if at < checked:
                    view = land
                    if lo >> REGION_SHIFT:  # a spill arena
                        view, lo = arena(lo >> REGION_SHIFT), lo & REGION_MASK
                    states[k].update_bytes(view[lo : lo + min(n, checked - at)])

        if overlap:
            return self._read_overlapped(transport, pieces, check, states, total, deadline)
        posting = posted_reads(transport)
        if posting is None or READ_WINDOW <= 1:  # a transport without posted reads: one piece after another
            for piece in pieces:
                transport.read([(r, lo, n) for r, lo, n, _, _ in piece], deadline)
                check(piece)
            return [st.digest() for st in states]
        post, wait, release = posting.post_read, posting.wait_read, posting.release_read
        posted: collections.deque[tuple[Any, list[tuple[int, int, int, int, int]]]] = collections.deque()
        nxt = 0
        try:
            while posted or nxt < len(pieces):
                while nxt < len(pieces) and len(posted) < READ_WINDOW:
                    posted.append((post([(r, lo, n) for r, lo, n, _, _ in pieces[nxt]]), pieces[nxt]))
                    nxt += 1
                    if posted[-1][0].done:  # moved as it was posted (same-host shared memory): checksum it while
                        break  # it is in cache before moving more
                wait(posted[0][0], deadline, PIECE_SPIN_S)
                handle, piece = posted.popleft()
                release(handle)
                check(piece)
        except E.ExportTimeoutError:
            for h, _ in posted:  # the caller quarantines the whole range: a late write lands in space never reused
                release(h)
            raise
        except BaseException as e:
            # the caller frees the range after any other failure: every posted READ must be over before that
            late: E.ExportTimeoutError | None = None
            for h, _ in posted:
                if late is None:
                    try:
                        wait(h, deadline, PIECE_SPIN_S)
                    except E.ExportTimeoutError as t:
                        late = t
                    except E.ExportError:
                        pass  # over: it failed
                release(h)
            if late is not None and isinstance(e, E.ExportError):  # the caller quarantines the range instead
                raise E.ExportTimeoutError(
                    f"a read of {total} bytes failed ({e}); its other pieces were still in flight at the deadline"
                ) from e
            raise
        return [st.digest() for st in states]

    def _read_overlapped(
        self,
        transport: ConsumerTransport,
        pieces: list[list[tuple[int, int, int, int, int]]],
        check: Any,
        states: list[ChecksumState],
        total: int,
        deadline: float,
    ) -> list[int]:
        reader = self._reader_pool()
        fut = reader.submit(transport.read, [(r, lo, n) for r, lo, n, _, _ in pieces[0]], deadline)
        try:
            for p, piece in enumerate(pieces):
                fut.result(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
                fut = None
                if p + 1 < len(pieces):
                    nxt = [(r, lo, n) for r, lo, n, _, _ in pieces[p + 1]]
                    fut = reader.submit(transport.read, nxt, deadline)
                check(piece)
        except TimeoutError:
            raise E.ExportTimeoutError(f"a read of {total} bytes is still in progress past its deadline") from None
        finally:
            if fut is not None:  # never leave a transfer writing into landing space that is about to be freed
                fut.exception()
        return [st.digest() for st in states]

    def _reader_pool(self) -> Any:
        if self._reader is None:
            from concurrent.futures import ThreadPoolExecutor

            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsx-reader")
        return self._reader

    def _read_inline(self, c: Claim, deadline: float) -> CaptureRecord | HsCompatError:
        """A ticket holder's read: the record's bytes through the control plane, in bounded chunks."""
        owned = bytearray(c.extent)
        view = memoryview(owned)
        session = self._session
        limit = session.reply.max_read_bytes if session.reply is not None else P.MAX_READ_BYTES
        step = max(PAGE, min(limit, session.budget() - P.REPLY_OVERHEAD))
        pos = 0
        try:
            while pos < c.extent:
                n = min(step, c.extent - pos)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise E.ExportTimeoutError(f"record {c.record_id!r}: read past its deadline at byte {pos}")
                rep = session.call(P.ReadReq(c.lease, c.nonce, pos, n, cap=session.cap), left)
                if not isinstance(rep, P.ReadReply) or len(rep.data) != n:
                    raise E.ProtocolError(f"read of {n} bytes answered with {type(rep).__name__}")
                view[pos : pos + n] = rep.data
                pos += n
        except E.LeaseExpiredError as e:
            self.counters["lease_expired"] += 1
            return e
        except E.ExportError as e:
            self.counters["read_failures"] += 1
            self._claims.abandon([c])
            return e
        return self._settle_owned(c, owned)

    def _read_given(self, c: Claim, data: bytes | memoryview) -> CaptureRecord | HsCompatError:
        """A record whose bytes came in its claim's answer: checked and released as :meth:`_settle_owned` does."""
        got = self._settle_owned(c, bytearray(data))
        if isinstance(got, CaptureRecord):
            self.counters["inline_records"] += 1
        return got

    def _settle_owned(self, c: Claim, owned: bytearray) -> CaptureRecord | HsCompatError:
        """Verify a record read whole into ``owned`` (memory the record will own: its tensor is made over it, once,
        after the checks), release its lease with the outcome (posted as :meth:`Releases.release` decides for the
        trainer; a ticket holder waits for the verdict, so one that exits right after its fetch leaves no lease
        behind), and return the record or what failed it."""
        meta, outcome = self._verify_bytes(c, memoryview(owned), 0)
        entry = [(c.lease, c.nonce, outcome)]
        releases = self._releases
        trainer = self._session.ticket is None
        settled = releases.release(entry, c.claimed_at, [c.record_id]) if trainer else releases.settle(entry)
        bad = settled if isinstance(settled, E.ExportError) else releases.verdict(c.record_id, c.lease, settled[0])
        if isinstance(bad, E.LeaseExpiredError):
            return bad
        if isinstance(meta, HsCompatError):
            return meta
        if bad is not None:
            return bad
        self.counters["records"] += 1
        self.counters["bytes"] += c.nbytes
        dtype = meta.torch_dtype
        rows = torch.frombuffer(owned, dtype=dtype, count=c.nbytes // dtype.itemsize)
        return CaptureRecord(meta, rows.view(meta.shape))

    def _finish(self, c: Claim, meta: RecordMeta, off: int, copy: bool, lend: bool) -> CaptureRecord:
        """The record read at local offset ``off``: held (``copy=False``), lent its space (``lend``, decided by
        :meth:`Landing.place`) or copied out."""
        buf, at = self._landing.locate(off)
        self.counters["records"] += 1
        self.counters["bytes"] += c.nbytes
        if copy and lend:
            lent = self._landing.lend(buf, at, off, c.extent, c.nbytes)
            return CaptureRecord(meta, lent.view(meta.torch_dtype).view(meta.shape))
        t = buf[at : at + c.nbytes].view(meta.torch_dtype).view(meta.shape)
        if not copy:
            rec = CaptureRecord(meta, t)
            self._landing.hold(rec, off, c.extent)
        else:
            rec = CaptureRecord(meta, _copied(t))
            self._landing.free(off, c.extent)
        return rec

    def close(self) -> None:
        """Stop the reader thread (after any transfer it runs)."""
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
