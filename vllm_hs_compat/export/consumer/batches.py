"""Batches: many claimed records read, verified and released together, packed by schema into
:class:`~vllm_hs_compat.export.batch.RecordBatch` objects (one transfer request and one release per batch).

:class:`Batches` claims through the claims, reads through the landing's transport with the record reader's checked
reads (its ``verify_checksum`` is the one setting both follow) and releases through the releases.
"""

from __future__ import annotations

import dataclasses
import enum
import gc
import time
from collections.abc import Mapping, Sequence
from typing import cast

import torch

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.checksums import byte_view, checksum_function
from vllm_hs_compat.core.dtypes import dtype_itemsize
from vllm_hs_compat.core.records import RecordMeta
from vllm_hs_compat.errors import HsCompatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.batch import BatchSchema, RecordBatch
from vllm_hs_compat.export.consumer.claims import Claim, Claims
from vllm_hs_compat.export.consumer.landing import PAGE, Landing, _copied
from vllm_hs_compat.export.consumer.reads import OVERLAP_MIN_BYTES, Reads
from vllm_hs_compat.export.consumer.releases import Entry, Releases
from vllm_hs_compat.export.consumer.session import Session
from vllm_hs_compat.export.transport import ConsumerTransport

#: Over NIXL, a batch whose records average at least this many bytes is read straight into its packed layout
#: (two descriptors per record: hidden states, token ids); smaller records are read whole (one descriptor each:
#: a descriptor costs a NIXL request about 2 us) and packed by two buffer copies each (cheaper than a descriptor).
#: Over shm every batch is copied straight into its packed layout.
BATCH_DIRECT_MIN_BYTES = 64 << 10


def _same_schema(a: RecordMeta, b: RecordMeta) -> bool:
    """The two records' rows can share one batch tensor (see :class:`BatchSchema`)."""
    return (
        a.shape[1] == b.shape[1]
        and a.shape[2] == b.shape[2]
        and a.dtype == b.dtype
        and a.layer_ids == b.layer_ids
        and a.pre_norm == b.pre_norm
        and a.checksum_algorithm == b.checksum_algorithm
        and a.schema_version == b.schema_version
        and a.vllm_version == b.vllm_version
        and a.adapter == b.adapter
    )


def _pack_uniform(
    landing: torch.Tensor, off: int, descs: Sequence[P.RecordDesc], slot: int, hidden: torch.Tensor, ids: torch.Tensor
) -> bool:
    """Pack records read whole into ``slot``-byte places from ``off`` on into ``hidden`` and ``ids`` with two
    strided copies (numpy's: one thread, no torch intra-op team), when every record has the same extent (the same
    token count: the usual small-record batch); False (nothing done) otherwise or without numpy."""
    d0 = descs[0]
    nb, at, extent = d0.nbytes, d0.ids_offset, d0.extent
    if any(d.extent != extent or d.nbytes != nb for d in descs):
        return False  # (records of one schema with the same nbytes have the same ids_offset)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - torch environments carry numpy
        return False
    n = len(descs)
    src = landing[off : off + n * slot].numpy().reshape(n, slot)
    np.copyto(hidden.numpy().reshape(n, nb), src[:, :nb])
    np.copyto(ids.numpy().view(np.uint8).reshape(n, extent - at), src[:, at:extent])
    return True


def _batch_schema(d: P.RecordDesc) -> BatchSchema:
    """The batch schema of a descriptor's record (its metadata was validated as it was decoded)."""
    m = d.meta
    return BatchSchema(
        layer_ids=tuple(m.layer_ids),
        pre_norm=m.pre_norm,
        dtype=m.dtype,
        planes=m.shape[1],
        hidden=m.shape[2],
        checksum_algorithm=m.checksum_algorithm,
        vllm_version=m.vllm_version,
        adapter=m.adapter,
        schema_version=m.schema_version,
    )


class _Miss(enum.Enum):
    """Why :meth:`Batches._read_part` made no batch."""

    #: the landing buffer cannot hold the part now: read it in halves
    SPLIT = "split"
    #: every record of the part failed (their errors were appended)
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class _Part:
    """Records of one schema read as one batch, and their place at ``off`` (``size`` bytes) in the landing buffer:
    ``direct``, in the packed layout (every record's hidden states, then every record's token ids from
    ``ids_at``), else each record whole in its slot at ``places[k]`` (packed into owned memory after)."""

    descs: list[P.RecordDesc]
    #: bytes of one token's row of hidden states
    rb: int
    #: cumulative token counts (``cu[k]``: the first row of record k; ``cu[-1]``: all rows)
    cu: list[int]
    direct: bool
    off: int
    size: int
    hidden_bytes: int
    ids_at: int
    slots: list[int]
    places: list[int]


class Batches:
    """Reading claimed records as batches."""

    def __init__(self, session: Session, claims: Claims, releases: Releases, reads: Reads, landing: Landing) -> None:
        self._session = session
        self._claims = claims
        self._releases = releases
        self._reads = reads
        self._landing = landing
        self.counters = dict.fromkeys(
            ("records", "batches", "bytes", "checksum_failures", "read_failures", "quarantined_bytes"), 0
        )

    def next_batches(
        self,
        max_records: int = 256,
        wait_s: float = 1.0,
        copy: bool = True,
        timeout_s: float | None = None,
    ) -> list[RecordBatch | HsCompatError]:
        """Claim up to ``max_records`` published records (oldest first, trainer only), read, verify and release
        them together; the records that passed come back as :class:`RecordBatch` objects (one per schema among
        them, usually one), each failed record as its own named error after them.  Empty when nothing was
        published within ``wait_s``.

        One claim message, one transfer request per batch (one descriptor per record for small records, two for
        large ones) and one release message; no per-record tensor or :class:`RecordMeta` is made.  ``copy``: as
        for :meth:`fetch` (``False``: the batch's tensors view the landing buffer until :meth:`release`)."""
        raws, claimed_at = self._claims.next_reply(max_records, wait_s, max(PAGE, self._landing.free_bytes() // 2))
        if not raws:
            return []
        return self.batches(raws, claimed_at, copy, timeout_s, [])

    def fetch_batch(
        self,
        record_ids: Sequence[str],
        copy: bool = True,
        timeout_s: float | None = None,
        wait_s: float = 0.0,
    ) -> list[RecordBatch | HsCompatError]:
        """Claim, read, verify and release the records ``record_ids`` together (trainer only): what
        :meth:`fetch` does for one id, with one claim message per ``MAX_CLAIM_IDS`` (32) ids, one transfer
        request and one release for all of them (so the claim's round trip is paid once, not per record).

        Returns, as :meth:`next_batches` does, the records that passed as :class:`RecordBatch` objects (one per
        schema, records in the order of ``record_ids``; ``batch.record_ids`` names them) and then one named error
        per id that failed: :class:`UnknownRecordError` for an id not published (after ``wait_s``, see
        :meth:`claim`), :class:`RecordFailedError` for one the producer knows failed, the control plane's error
        (a timeout...) for the ids whose claim it cut off, and the read's or the verification's error otherwise.
        Records claimed are read at once, not held while the ids still missing
        are waited for: those that turn up later come in batches of their own.  An id given twice is fetched
        once."""
        if self._landing.transport is None:
            raise E.ExportConfigError(
                "fetch_batch needs the trainer token (a ticket holder fetches its one record with fetch())"
            )
        ids = list(dict.fromkeys(record_ids))
        for rid in ids:
            if not isinstance(rid, str) or not 0 < len(rid) <= P.MAX_ID_CHARS:
                raise E.ExportConfigError(f"record ids must be strings of 1..{P.MAX_ID_CHARS} characters: {rid!r}")
        order = {rid: k for k, rid in enumerate(ids)}
        out: list[RecordBatch | HsCompatError] = []
        errors: list[HsCompatError] = []
        until = time.monotonic() + wait_s
        pause = 0.005
        while ids:  # a round: claim every id still pending, then read what was claimed at once
            raws: list[bytes] = []
            claimed_at = 0.0
            missing: list[tuple[str, str]] = []
            again: list[str] = []
            cut: E.ExportError | None = None
            for i in range(0, len(ids), P.MAX_CLAIM_IDS):
                sent = time.monotonic()
                req = P.ClaimReq(ids[i : i + P.MAX_CLAIM_IDS], max_reply_bytes=self._session.budget())
                try:
                    rep = self._session.call(req, timeout_s)
                    if not isinstance(rep, P.ClaimReply):
                        raise E.ProtocolError(f"claim answered with {type(rep).__name__}")
                except E.ExportError as e:  # this and the later ids fail with it; what was claimed is still read
                    cut = e
                    errors.extend([e] * (len(ids) - i))
                    break
                if rep.records:
                    raws.extend(rep.records)
                    claimed_at = claimed_at or sent  # the oldest claim bounds when releases may be posted
                for err in rep.errors:
                    if err.code == "failed_record":
                        errors.append(E.RecordFailedError(f"record {err.record_id!r} will not be published: "
                                                          f"{err.message}"))  # fmt: skip
                    elif err.message == P.REPLY_FULL:
                        again.append(err.record_id)
                    else:
                        missing.append((err.record_id, err.message))
            if raws:  # read now: a claimed lease must not age while the other ids are waited for
                got = self.batches(raws, claimed_at, copy, timeout_s, [], order)
                out.extend(g for g in got if isinstance(g, RecordBatch))
                errors.extend(g for g in got if not isinstance(g, RecordBatch))
            if cut is not None:  # no more rounds: the control plane failed
                errors.extend([cut] * len(again))
                errors.extend(E.UnknownRecordError(message) for _, message in missing)
                break
            if missing and time.monotonic() + pause <= until:
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
                again.extend(rid for rid, _ in missing)
            else:
                errors.extend(E.UnknownRecordError(message) for _, message in missing)
            ids = sorted(again, key=order.__getitem__)
        return out + errors

    def batches(
        self,
        raws: list[bytes],
        claimed_at: float,
        copy: bool,
        timeout_s: float | None,
        errors: list[HsCompatError],
        order: Mapping[str, int] | None = None,
        decoded: list[P.RecordDesc] | None = None,
    ) -> list[RecordBatch | HsCompatError]:
        """Decode (unless ``decoded``: ``raws`` decoded already), group by schema, read, verify and release claimed
        descriptors: batches, then errors."""
        try:
            descs = decoded if decoded is not None else P.decode_descriptors(raws)
        except (E.ProtocolError, E.RecordFormatError):  # one of them is bad: learn which, one by one
            descs = []
            bad: list[Entry] = []
            for raw in raws:
                try:
                    descs.append(P.decode_descriptor(raw))
                except (E.ProtocolError, E.RecordFormatError) as e:
                    errors.append(self._claims.refused(raw, e, bad))
            self._claims.give_back(bad)
        if order is not None:
            descs.sort(key=lambda d: order.get(d.record_id, len(order)))
        deadline = time.monotonic() + (self._session.timeout_s if timeout_s is None else timeout_s)
        out: list[RecordBatch | HsCompatError] = []
        groups: list[list[P.RecordDesc]] = []  # by schema, in order of first appearance (usually one)
        last: list[P.RecordDesc] = []
        for d in descs:
            if not last or not _same_schema(d.meta, last[0].meta):
                last = next((g for g in groups if _same_schema(d.meta, g[0].meta)), [])
                if not last:
                    groups.append(last)
            last.append(d)
        for group in groups:
            out.extend(self._read_group(group, copy, deadline, errors, claimed_at))
        return out + errors

    def _read_group(
        self,
        descs: list[P.RecordDesc],
        copy: bool,
        deadline: float,
        errors: list[HsCompatError],
        claimed_at: float = 0.0,
    ) -> list[RecordBatch]:
        """Check, read, verify and release records of one schema; their batches (several when the landing
        buffer cannot hold them at once).  Failed records' errors are appended to ``errors``."""
        try:
            schema = _batch_schema(descs[0])
        except E.RecordFormatError as e:
            bad: list[Entry] = []
            errors.extend(self._claims.refused(d, e, bad) for d in descs)
            self._claims.give_back(bad)
            return []
        rb = schema.planes * schema.hidden * dtype_itemsize(schema.dtype)
        pool = self._session.pool_bytes
        producer = self._session.producer
        # every nonce is 16 characters (the decoder checks lengths): all hex together, or check them one by one
        all_hex = P.is_hex("".join([d.nonce for d in descs]))
        is_nonce = P.is_nonce
        good: list[P.RecordDesc] = []
        refused: list[Entry] = []
        for d in descs:
            m, nb = d.meta, d.nbytes
            t = m.shape[0]
            ids_at = (nb + 7) // 8 * 8
            fits = (
                d.producer == producer
                and (all_hex or is_nonce(d.nonce))
                and m.checksum is not None
                and not m.token_ids
                and nb == t * rb
                and d.ids_offset == ids_at
                and d.extent == ids_at + 4 * t
                and d.offset + d.extent <= pool
            )
            if fits:  # (its metadata, sample fields included, was validated as it was decoded)
                good.append(d)
                continue
            try:  # name what is wrong: the per-record checks of fetch()
                c = Claim.from_desc(d)
                self._reads.check(c)
                raise E.RecordFormatError(f"record {d.record_id!r}: descriptor disagrees with its batch schema")
            except E.StaleMetadataError as e:
                errors.append(e)  # a lease of another producer instance: nothing to give back
            except (E.RecordFormatError, E.DescriptorError) as e:
                errors.append(self._claims.refused(d, e, refused))
        self._claims.give_back(refused)
        out: list[RecordBatch] = []
        todo = [good] if good else []
        while todo:
            part = todo.pop()
            got = self._read_part(schema, rb, part, copy, deadline, errors, claimed_at)
            if isinstance(got, RecordBatch):
                out.append(got)
            elif got is _Miss.SPLIT:  # did not fit the landing buffer: in halves, first half first
                half = len(part) // 2
                todo.extend([part[half:], part[:half]])
        return out

    def _read_part(
        self,
        schema: BatchSchema,
        rb: int,
        descs: list[P.RecordDesc],
        copy: bool,
        deadline: float,
        errors: list[HsCompatError],
        claimed_at: float = 0.0,
    ) -> RecordBatch | _Miss:
        """One batch of records of ``schema`` (``rb`` bytes per token row), or why there is none (:class:`_Miss`);
        failed records' errors are appended to ``errors``."""
        transport = self._landing.transport
        if transport is None:
            raise E.ExportClosedError("consumer has no transport (a ticket holder cannot stream batches)")
        n = len(descs)
        part = self._place_part(transport.kind, rb, descs, errors)
        if isinstance(part, _Miss):
            return part
        algorithm = schema.checksum_algorithm
        try:
            digests = self._transfer_part(transport, part, algorithm, deadline)
        except E.ExportError as e:
            self.counters["read_failures"] += n
            if isinstance(e, E.ExportTimeoutError):
                self.counters["quarantined_bytes"] += part.size  # a late write may still land there: never reuse it
            else:
                self._landing.free(part.off, part.size)
            errors.extend([e] * n)
            if not isinstance(e, E.RemoteDisconnectedError | E.StaleMetadataError):
                self._claims.abandon_leases(descs)
            return _Miss.FAILED
        hidden, ids32 = self._packed(transport.landing, part)
        failed, outcomes = self._verify_part(part, hidden, ids32, digests, algorithm)
        settled = self._releases.release(outcomes, claimed_at, [d.record_id for d in descs])
        if isinstance(settled, E.ExportError):
            self._landing.free(part.off, part.size)
            errors.extend([settled] * n)
            return _Miss.FAILED
        for k, d in enumerate(descs):
            verdict = settled[k]
            if verdict != "released":  # an expired lease explains whatever the bytes looked like: it comes first
                bad = self._releases.verdict(d.record_id, d.lease, verdict)
                failed[k] = bad or failed.get(k) or E.ExportError("internal")
        errors.extend(failed[k] for k in sorted(failed))
        if len(failed) == n:
            self._landing.free(part.off, part.size)
            return _Miss.FAILED
        return self._batch_of(schema, part, hidden, ids32, failed, copy, transport.landing)

    def _place_part(self, kind: str, rb: int, descs: list[P.RecordDesc], errors: list[HsCompatError]) -> _Part | _Miss:
        """The part's layout and place in the landing buffer (over ``kind`` of transport); ``SPLIT`` when it
        does not fit now, ``FAILED`` when its one record does not (its error appended, its lease given back)."""
        n = len(descs)
        cu = [0] * (n + 1)
        acc = 0
        for k, d in enumerate(descs):
            acc += d.meta.shape[0]
            cu[k + 1] = acc
        hidden_bytes = acc * rb
        # shm copies each part with a memmove anyway: straight into the packed layout, whatever the size
        direct = kind == "shm" or hidden_bytes >= n * BATCH_DIRECT_MIN_BYTES
        ids_at, slots = 0, []
        if direct:  # [hidden states of every record][token ids of every record], read in place
            ids_at = -(-hidden_bytes // 8) * 8
            size = ids_at + 4 * acc
        else:  # each record read whole (one descriptor), then packed into owned memory
            slots = [-(-d.extent // 8) * 8 for d in descs]
            size = sum(slots)
        off = self._landing.alloc(size)
        if off is None and self._landing.lent:
            gc.collect()  # owned records in reference cycles: give their lent space back first
            off = self._landing.alloc(size)
        if off is None:
            if n > 1:
                return _Miss.SPLIT
            errors.append(self._landing.no_room(descs[0].record_id, size, batches=True))
            self._claims.abandon_leases(descs)
            return _Miss.FAILED
        places = [0] * len(slots)
        at = off
        for k, s in enumerate(slots):
            places[k] = at
            at += s
        return _Part(descs, rb, cu, direct, off, size, hidden_bytes, ids_at, slots, places)

    def _transfer_part(
        self, transport: ConsumerTransport, part: _Part, algorithm: str, deadline: float
    ) -> list[int] | None:
        """Read the part into its place; its records' hidden-state checksums when they were taken on the way (a
        large part read in place with verification on, checksummed as a large fetch() is), else ``None``."""
        descs, cu, rb, off = part.descs, part.cu, part.rb, part.off
        n = len(descs)
        if part.direct:
            items = [(d.offset, off + cu[k] * rb, d.nbytes) for k, d in enumerate(descs)]
            items += [(d.offset + d.ids_offset, off + part.ids_at + 4 * cu[k], 4 * d.meta.shape[0])
                      for k, d in enumerate(descs)]  # fmt: skip
        else:
            items = [(d.offset, part.places[k], d.extent) for k, d in enumerate(descs)]
        if part.direct and self._reads.verify_checksum and part.hidden_bytes >= OVERLAP_MIN_BYTES:
            ranges = [(r, lo, m, m) for r, lo, m in items[:n]] + [(r, lo, m, 0) for r, lo, m in items[n:]]
            return self._reads.read_checked(transport, ranges, [algorithm] * len(ranges), deadline)[:n]
        transport.read(items, deadline)
        return None

    def _packed(self, landing: torch.Tensor, part: _Part) -> tuple[torch.Tensor, torch.Tensor]:
        """The part's hidden states (bytes) and token ids (int32): views of the landing buffer (``direct``), or
        packed into owned memory by buffer slice copies (a C memcpy each; no torch op per record)."""
        off, rb, cu = part.off, part.rb, part.cu
        if part.direct:
            hidden = landing[off : off + part.hidden_bytes]
            ids32 = landing[off + part.ids_at : off + part.ids_at + 4 * cu[-1]].view(torch.int32)
            return hidden, ids32
        hidden = torch.empty(part.hidden_bytes, dtype=torch.uint8)
        ids32 = torch.empty(cu[-1], dtype=torch.int32)
        if not _pack_uniform(landing, off, part.descs, part.slots[0], hidden, ids32):
            hout, iout, lv = byte_view(hidden), byte_view(ids32), self._landing.bytes_of(landing)
            for k, d in enumerate(part.descs):
                a, b, at = cu[k], cu[k + 1], part.places[k]
                hout[a * rb : b * rb] = lv[at : at + d.nbytes]
                iout[4 * a : 4 * b] = lv[at + d.ids_offset : at + d.extent]
        return hidden, ids32

    def _verify_part(
        self, part: _Part, hidden: torch.Tensor, ids32: torch.Tensor, digests: list[int] | None, algorithm: str
    ) -> tuple[dict[int, HsCompatError], list[tuple[int, str, str]]]:
        """Verify the bytes handed out, record by record (``digests``: the hidden states' checksums, when taken
        on the way): the failed records' errors by index, and each record's release entry."""
        rb, cu = part.rb, part.cu
        digest = checksum_function(algorithm)
        verify = self._reads.verify_checksum
        outcomes: list[tuple[int, str, str]] = []
        failed: dict[int, HsCompatError] = {}
        hv, iv = byte_view(hidden), byte_view(ids32)
        for k, d in enumerate(part.descs):
            a, b = cu[k], cu[k + 1]
            if verify and (digest(hv[a * rb : b * rb]) if digests is None else digests[k]) != d.meta.checksum:
                failed[k] = E.ChecksumMismatchError(
                    f"record {d.record_id!r}: {algorithm} of the {d.nbytes} bytes read does not match the "
                    "producer's checksum; the slot was overwritten or the transfer torn"
                )
            elif digest(iv[4 * a : 4 * b]) != d.ids_checksum:
                failed[k] = E.ChecksumMismatchError(
                    f"record {d.record_id!r}: the {b - a} token ids read do not match their {algorithm} checksum; "
                    "the slot was overwritten or the transfer torn"
                )
            outcomes.append((d.lease, d.nonce, "checksum_failed" if k in failed else "delivered"))
        self.counters["checksum_failures"] += len(failed)
        return failed, outcomes

    def _batch_of(
        self,
        schema: BatchSchema,
        part: _Part,
        hidden: torch.Tensor,
        ids32: torch.Tensor,
        failed: dict[int, HsCompatError],
        copy: bool,
        landing: torch.Tensor,
    ) -> RecordBatch:
        """The batch of the part's records that passed (``failed``: the others, by index), its hidden states
        held (``copy=False``), lent their landing space or copied out; the space is freed where nothing keeps
        it."""
        descs, cu_l, off, size = part.descs, part.cu, part.off, part.size
        n = len(descs)
        lengths = torch.tensor([d.meta.shape[0] for d in descs], dtype=torch.int64)
        token_ids = ids32.to(torch.int64).bitwise_and_(0xFFFFFFFF)
        keep = descs
        if failed:  # rare: drop the failed records' rows (a copy; the landing space is free at once)
            kept = [k for k in range(n) if k not in failed]
            rows = torch.cat([torch.arange(cu_l[k], cu_l[k + 1], dtype=torch.int64) for k in kept])
            hidden = hidden.view(-1, part.rb).index_select(0, rows).view(-1)
            token_ids = token_ids.index_select(0, rows)
            keep = [descs[k] for k in kept]
            lengths = lengths.index_select(0, torch.tensor(kept, dtype=torch.int64))
            self._landing.free(off, size)
        elif not part.direct:
            self._landing.free(off, size)  # packed into owned memory
        cu = torch.zeros(len(keep) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=cu[1:])
        hs = hidden.view(schema.torch_dtype).view(-1, schema.planes, schema.hidden)
        batch = RecordBatch(
            schema,
            tuple(d.record_id for d in keep),
            hs,
            token_ids,
            cu,
            torch.tensor([d.meta.start for d in keep], dtype=torch.int64),
            torch.tensor([d.meta.num_prompt_tokens for d in keep], dtype=torch.int64),
            tuple(cast(int, d.meta.checksum) for d in keep),  # (set: _read_group checked it)
            samples=tuple(d.meta.sample for d in keep) if any(d.meta.has_sample for d in keep) else None,
        )
        self.counters["records"] += len(keep)
        self.counters["bytes"] += sum(d.nbytes for d in keep)
        self.counters["batches"] += 1
        if part.direct and not failed:
            if not copy:
                self._landing.hold(batch, off, size)
            elif self._landing.lendable(size):
                flat = self._landing.lend(landing, off, off, size, part.hidden_bytes)
                batch.hidden_states = flat.view(schema.torch_dtype).view(-1, schema.planes, schema.hidden)
            else:
                batch.hidden_states = _copied(hs)
                self._landing.free(off, size)
        return batch
