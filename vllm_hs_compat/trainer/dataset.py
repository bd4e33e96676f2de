"""``HiddenStatesDataset``: capture records as a ``torch.utils.data.IterableDataset`` of training items.

Two sources, one item format (see :mod:`vllm_hs_compat.trainer.layouts` for the layouts):

* :meth:`HiddenStatesDataset.from_export` streams every record a producer publishes (the trainer token), through
  an :class:`~vllm_hs_compat.export.ExportConsumer` opened in the iterating process itself: with
  ``DataLoader(num_workers=N)`` every worker opens its own consumer (no socket, NIXL agent or landing buffer
  crosses a fork), and the producer's claims hand each record to exactly one claimant.
* :meth:`HiddenStatesDataset.from_files` reads the file sink's records (``<record>.json`` +
  ``<record>.safetensors``); workers take disjoint shards of the sorted record list (worker ``k`` of ``N`` takes
  positions ``k, k+N, ...``).

Resume (:meth:`~HiddenStatesDataset.state_dict` / :meth:`~HiddenStatesDataset.load_state_dict`): the state is
the set of record ids *consumed* so far in this epoch (files: a pass that runs to its end starts the next epoch,
:meth:`~HiddenStatesDataset.end_epoch`).  Without workers that is every item the dataset yielded; with workers the
main process does not see the workers' iterators, so the training loop reports what it consumed with
:meth:`~HiddenStatesDataset.mark_consumed` (``item["record_id"]``).  A dataset loaded with that state

* (files) skips those records and yields the rest exactly once;
* (export) yields what the producer still holds: a record handed to a trainer was released ``delivered``, so the
  producer never hands it out again; ``max_records`` counts the consumed records as spent; a consumed id that
  shows up again (another producer instance re-publishing it) is skipped and counted ``resume_skipped``.

Duplicates (export): the producer delivers at least once -- a record whose lease expired before its release
(its consumer died, or was slower than ``lease_ttl_s``) goes back to the producer's queue and is handed out again
(``max_redeliveries``).  A consumer whose lease expired under it is told so and does not hand the record out (it
comes again: counted ``lease_expired`` here and skipped, never raised); one that handed it out before the
verdict came back (a release posted early, see ``defer_releases``) may see it a second time.  Each stream drops a
record id it yielded among its last ``dedupe_window`` ids (default 65,536; counted ``duplicates``), per process:
with DataLoader workers, a duplicate that reaches another worker (or another rank) is not seen by this one's memory:
:func:`~vllm_hs_compat.trainer.even_steps` drops it across workers and ranks (without workers the resume state
drops it too).

Several endpoints (``from_export([ep1, ep2, ...])``: the engines of ``--data-parallel-size N``, several servers):
every iterating process opens one consumer per endpoint and sweeps them (the consumer's ``Sweep``); the
producers' claims hand each record to one claimant whichever rank or worker asks.  Equal step counts over
``torch.distributed`` ranks: :func:`~vllm_hs_compat.trainer.even_steps`.

What a stop loses, by construction: with ``batch=1`` (default) a record is claimed, read and released one at a
time just before it is yielded, so stopping between items loses nothing (``batch=B``: up to ``B - 1`` read but
not yielded).  With workers, the records already in the
DataLoader's prefetch queue (at most ``num_workers * prefetch_factor``) were delivered by the producer and not
trained on; compare the producer's ``delivered`` (``ExportConsumer.remote_stats()``) with the state's count.

Errors: a record that fails (checksum, NaN/Inf rows, bad format, failed at the server, does not fit the layout, a
transport error that failed that record alone) is counted in :attr:`~HiddenStatesDataset.stats` and then raised
(``on_error="raise"``, default) or logged and skipped (``on_error="skip"``).  A raised error ends that
iteration; the next one continues after the consumed records (export: the failed record was settled and does not
come back; files: it is read, and fails, again).  Errors of the connection itself (producer unreachable, wrong
token) always raise.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import torch
from torch.utils.data import IterableDataset, get_worker_info

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.finite import check_record
from vllm_hs_compat.core.records import CaptureRecord
from vllm_hs_compat.trainer.layouts import LossMaskFn, check_layout, check_loss_mask, to_item

log = logging.getLogger(__name__)

STATE_VERSION: Final = 1
#: Counter names of :attr:`HiddenStatesDataset.stats`.
COUNTERS: Final = (
    "records",  # items yielded
    "errors",  # failed records (the sum of the kinds below)
    "skipped",  # failed records skipped (on_error="skip"); the rest were raised
    "checksum_failed",  # ChecksumMismatchError
    "non_finite",  # NonFiniteRecordError: the rows hold NaN/Inf (the record is never yielded)
    "bad_format",  # RecordFormatError (other than checksum and layout): damaged manifest, tensor, descriptor
    "failed_at_source",  # RecordFailedError: the server recorded why the record will not exist
    "layout_refused",  # LayoutError: the record cannot take the layout (e.g. one plane for eagle3)
    "transport_failed",  # ExportError failing one record (lease expired, landing buffer full, ...)
    "resume_skipped",  # records skipped because the resume state says they were consumed
    "duplicates",  # export: records dropped because this stream yielded the same id recently (dedupe_window)
    "lease_expired",  # export stream: a lease expired under this consumer; the producer hands the record out again
)
#: Default of ``dedupe_window``: record ids remembered per stream to drop a redelivered record.
DEDUPE_WINDOW: Final = 1 << 16
_IDX: Final = {name: i for i, name in enumerate(COUNTERS)}
#: Rows of the shared counter table: row 0 is the main process, row k+1 DataLoader worker k.
_MAX_WORKERS: Final = 256


def _kind(exc: E.HsCompatError) -> str:
    if isinstance(exc, E.ChecksumMismatchError):
        return "checksum_failed"
    if isinstance(exc, E.NonFiniteRecordError):
        return "non_finite"
    if isinstance(exc, E.LayoutError):
        return "layout_refused"
    if isinstance(exc, E.RecordFormatError | E.DescriptorError):
        return "bad_format"
    if isinstance(exc, E.RecordFailedError):
        return "failed_at_source"
    return "transport_failed"


def _share(n_workers: int, budget: int | None, worker: int) -> int | None:
    """Worker ``worker``'s share of ``budget`` records (the shares add up to ``budget``)."""
    if budget is None:
        return None
    return budget // n_workers + (1 if worker < budget % n_workers else 0)


class HiddenStatesDataset(IterableDataset[dict[str, Any]]):
    """Capture records as training items (``dict``); build it with :meth:`from_export` or :meth:`from_files`.

    Item keys (every layout): ``input_ids`` LongTensor ``[T]``, ``hidden_states``, ``loss_mask`` LongTensor
    ``[T]``, ``loss_mask_from`` str (which mask: ``"record"``, ``"all"``, ``"generated"``, ``"callable"``),
    ``record_id`` str, ``sample_id`` str (``""``: not given), ``layer_ids`` LongTensor ``[P]``,
    ``num_prompt_tokens`` int, ``start`` int; plus, by ``layout``:

    * ``"eagle3"``: ``hidden_states`` ``[T, C]`` = the base hidden (the plane of the largest layer id, pre-norm),
      ``aux_hidden_states`` ``[T, (P-1)*C]`` = the other planes concatenated in ascending layer-id order;
    * ``"speculators"``: ``hidden_states`` ``[T, (P-1)*C]`` (aux), ``verifier_last_hidden_states`` ``[T, C]``,
      ``lengths`` ``[1]``, ``position_ids`` ``[T]``;
    * ``"dflash"``: ``hidden_states`` ``[T, P*C]`` (every plane, ascending layer id);
    * ``"planes"``: ``hidden_states`` ``[T, P, C]``.

    ``loss_mask`` (default ``"auto"``): the record's own mask when it carries one (``loss_mask_spans``, sent by
    the request that made it: see docs/connector.md), else every row -- ``loss_mask_from`` says which; ``"record"``
    refuses records without one; ``"all"``, ``"generated"`` or a function as in
    :func:`~vllm_hs_compat.trainer.layouts.resolve_loss_mask`.

    Items vary in T: use ``DataLoader(batch_size=None)`` or a collate function that pads or packs.
    """

    def __init__(
        self,
        source: _Source,
        *,
        layout: str = "eagle3",
        loss_mask: str | LossMaskFn = "auto",
        dtype: torch.dtype | None = None,
        on_error: str = "raise",
        max_records: int | None = None,
    ) -> None:
        """Use :meth:`from_export` or :meth:`from_files`."""
        if on_error not in ("raise", "skip"):
            raise E.DatasetConfigError(f"on_error must be 'raise' or 'skip', found {on_error!r}")
        if max_records is not None and (not isinstance(max_records, int) or max_records < 0):
            raise E.DatasetConfigError(f"max_records must be None or an int >= 0, found {max_records!r}")
        self.source = source
        self.layout = check_layout(layout)
        self.loss_mask = check_loss_mask(loss_mask)
        self.dtype = dtype
        self.on_error = on_error
        self.max_records = max_records
        self._consumed: set[str] = set()
        self._consumed_order: list[str] = []
        self.epoch = 0
        # One row per process (main, workers), in shared memory: the counts of every DataLoader worker reach
        # the dataset object of the main process (fork and spawn alike).
        self._counters = torch.zeros((_MAX_WORKERS + 1, len(COUNTERS)), dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]

    # --- constructors ---------------------------------------------------------------------------------------
    @classmethod
    def from_export(
        cls,
        endpoint_or_params: str | Mapping[str, Any] | Sequence[str],
        token: str | None = None,
        *,
        max_records: int | None = None,
        wait_s: float | None = 30.0,
        layout: str = "eagle3",
        loss_mask: str | LossMaskFn = "auto",
        dtype: torch.dtype | None = None,
        on_error: str = "raise",
        batch: int = 1,
        poll_s: float = 1.0,
        consumer_kwargs: Mapping[str, Any] | None = None,
        dedupe_window: int = DEDUPE_WINDOW,
    ) -> HiddenStatesDataset:
        """Stream records from an export producer.

        ``endpoint_or_params``: the producer's endpoint (``"tcp://host:port"``), a list of endpoints (several
        producers: the engines of ``--data-parallel-size N``, several servers; every iterating process opens one
        consumer per endpoint and takes records from all of them, see "Several endpoints" in docs/trainer.md), or a
        response's ``kv_transfer_params`` (a ticket: its endpoint is used).  ``token``: the trainer token (default:
        ``$VLLM_HS_COMPAT_EXPORT_TOKEN`` or the token file, see :func:`~vllm_hs_compat.export.control.read_token`).
        With a ticket and no trainer token on this host, the dataset yields that ticket's one record.

        The stream ends after ``max_records`` records (split over the DataLoader workers), or when no record
        arrived for ``wait_s`` seconds of asking (``None``: never; the time the training loop spends on the
        records yielded does not count, and the end comes only after one more claim found nothing).  ``batch``:
        records claimed and read per round trip (> 1 is faster for small records; a stop then loses up to
        ``batch - 1`` records read but not yielded, counted nowhere but the producer's ``delivered``).
        ``poll_s``: the long-poll of each claim.
        ``consumer_kwargs``: passed to :class:`~vllm_hs_compat.export.ExportConsumer` (``landing_bytes``,
        ``backend``, ``timeout_s``, ``ucx``, ``verify_checksum``, ...).  ``dedupe_window``: how many recently
        yielded record ids each process remembers to drop a redelivered record (``duplicates`` in :attr:`stats`;
        ~100 bytes per id; see the module docstring)."""
        source = _ExportSource(
            endpoint_or_params, token, wait_s, batch, poll_s, dict(consumer_kwargs or {}), dedupe_window
        )
        return cls(source, layout=layout, loss_mask=loss_mask, dtype=dtype, on_error=on_error, max_records=max_records)

    @classmethod
    def from_files(
        cls,
        path: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        *,
        layout: str = "eagle3",
        loss_mask: str | LossMaskFn = "auto",
        dtype: torch.dtype | None = None,
        on_error: str = "raise",
        max_records: int | None = None,
        verify_checksum: bool = True,
    ) -> HiddenStatesDataset:
        """Read the file sink's records: ``path`` is a directory (every ``<record>.json`` in it, sorted by name;
        ``<record>.error.json`` files count as failed records), one record's ``.json`` / ``.safetensors``, or a
        list of those.  ``max_records``: the first N records of the sorted list."""
        source = _FileSource(path, verify_checksum)
        return cls(source, layout=layout, loss_mask=loss_mask, dtype=dtype, on_error=on_error, max_records=max_records)

    @classmethod
    def from_capture(
        cls,
        out: str | os.PathLike[str],
        *,
        layout: str = "eagle3",
        loss_mask: str | LossMaskFn = "auto",
        dtype: torch.dtype | None = None,
        on_error: str = "raise",
        max_records: int | None = None,
        verify_checksum: bool = True,
    ) -> HiddenStatesDataset:
        """Read the records a ``vllm-hs-compat capture`` tree's index names (status ``ok``; files the index does
        not name, e.g. of a capture still running, are not read).  Items carry each record's own loss mask
        (``loss_mask="auto"``) and ``sample_id``.  Needs ``pyarrow`` (the ``capture`` extra)."""
        from vllm_hs_compat.capture.index import read_index

        root = Path(out)
        records = sorted(str(r["record"]) for r in read_index(root).to_pylist() if r["status"] == "ok")
        if not records:
            raise E.DatasetConfigError(
                f"the capture tree {root} indexes no captured record (run `vllm-hs-compat capture --out {root}`, "
                "or wait for its first shard)"
            )
        paths = [root / r for r in records]
        return cls.from_files(
            paths,
            layout=layout,
            loss_mask=loss_mask,
            dtype=dtype,
            on_error=on_error,
            max_records=max_records,
            verify_checksum=verify_checksum,
        )

    # --- iteration ------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (int(info.id), int(info.num_workers))
        row = 0 if info is None else worker + 1
        return self._iterate(worker, n_workers, row)

    def _count(self, row: int, name: str, n: int = 1) -> None:
        if row <= _MAX_WORKERS:
            self._counters[row, _IDX[name]] += n

    def _iterate(self, worker: int, n_workers: int, row: int) -> Iterator[dict[str, Any]]:
        budget = None if self.max_records is None else max(0, self.max_records - len(self._consumed))
        if budget == 0:
            return
        for res in self.source.records(worker, n_workers, budget, frozenset(self._consumed)):
            if isinstance(res, _Skipped):
                self._count(row, "resume_skipped")
                continue
            if isinstance(res, _Duplicate):
                self._count(row, "duplicates")
                continue
            if isinstance(res, _Requeued):
                self._count(row, "lease_expired")
                log.info("lease expired under this stream (requeued if redelivery is on): %s", res.error)
                continue
            if isinstance(res, CaptureRecord):
                if res.meta.record_id in self._consumed:
                    self._count(row, "resume_skipped")
                    continue
                try:
                    check_record(res, f"read by the trainer dataset from {self.source!r}")
                    item = to_item(res, self.layout, self.loss_mask, self.dtype)
                except E.HsCompatError as exc:
                    res = exc
                else:
                    self._count(row, "records")
                    if row == 0:  # no workers: what was yielded is what the trainer consumed
                        self._mark(item["record_id"])
                    yield item
                    continue
            self._count(row, "errors")
            self._count(row, _kind(res))
            if self.on_error == "skip":
                self._count(row, "skipped")
                log.warning("skipping a failed record (%s): %s", type(res).__name__, res)
                continue
            raise res
        if row == 0 and self.source.kind == "files":  # a pass over the files ran to its end: the epoch is over
            self.end_epoch()

    # --- resume ---------------------------------------------------------------------------------------------
    def _mark(self, record_id: str) -> None:
        if record_id not in self._consumed:
            self._consumed.add(record_id)
            self._consumed_order.append(record_id)

    def mark_consumed(self, record_ids: str | Iterable[str]) -> None:
        """Record that the training loop consumed these records (``item["record_id"]``, or a batch's list of
        them).  Needed with DataLoader workers, whose iterators the main process does not see; without workers
        the dataset marks every item it yields itself."""
        for rid in [record_ids] if isinstance(record_ids, str) else record_ids:
            self._mark(str(rid))

    def end_epoch(self) -> None:
        """Start the next epoch: forget the consumed records (``epoch`` + 1), so the next iteration reads every
        record again.  Files without workers do this themselves when an iteration runs to its end; with workers
        call it after each epoch.  An export stream has no epochs: calling it there only lets records whose ids
        come back (a restarted producer) through again."""
        self._consumed = set()
        self._consumed_order = []
        self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        """``{"version": 1, "source": "export" | "files", "epoch": n, "consumed": [record ids, in order]}``
        (JSON-safe; no credential)."""
        return {
            "version": STATE_VERSION,
            "source": self.source.kind,
            "epoch": self.epoch,
            "consumed": list(self._consumed_order),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after ``state`` (from :meth:`state_dict`): its consumed records are skipped and count
        against ``max_records``.  Raises :class:`DatasetConfigError` for a state of another version or source."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise E.DatasetConfigError(
                f"resume state must be a mapping with version {STATE_VERSION} (from HiddenStatesDataset.state_dict)"
                f", found {state if not isinstance(state, Mapping) else {'version': state.get('version')}!r}"
            )
        if state.get("source") != self.source.kind:
            raise E.DatasetConfigError(
                f"resume state is of a {state.get('source')!r} dataset, this one reads {self.source.kind!r}"
            )
        consumed = state.get("consumed")
        if not isinstance(consumed, list) or not all(isinstance(r, str) for r in consumed):
            raise E.DatasetConfigError("resume state 'consumed' must be a list of record ids (str)")
        epoch = state.get("epoch", 0)
        if not isinstance(epoch, int) or epoch < 0:
            raise E.DatasetConfigError(f"resume state 'epoch' must be an int >= 0, found {epoch!r}")
        self._consumed = set()
        self._consumed_order = []
        for rid in consumed:
            self._mark(rid)
        self.epoch = epoch

    # --- counters -------------------------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, int]:
        """Counters summed over the main process and every DataLoader worker (see :data:`COUNTERS`), plus
        ``consumed`` (the resume state's size)."""
        totals = self._counters.sum(dim=0).tolist()
        out = {name: int(totals[i]) for i, name in enumerate(COUNTERS)}
        out["consumed"] = len(self._consumed)
        return out

    def __repr__(self) -> str:
        return f"HiddenStatesDataset({self.source!r}, layout={self.layout!r}, on_error={self.on_error!r})"


# --- sources --------------------------------------------------------------------------------------------------
class _Skipped:
    """A record the source skipped because the resume state lists it (counted, never yielded)."""


class _Duplicate:
    """A record the stream yielded recently (its id is in the dedupe window): dropped, counted."""


class _Requeued:
    """A streamed record whose lease expired under this consumer: the producer requeues it (counted, skipped)."""

    def __init__(self, error: E.HsCompatError) -> None:
        self.error = error


class _Recent:
    """The last ``size`` ids added (a set for lookups, a deque for the order they leave in)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ids: set[str] = set()
        self._order: collections.deque[str] = collections.deque()

    def __contains__(self, rid: object) -> bool:
        return rid in self._ids

    def add(self, rid: str) -> None:
        if rid in self._ids or self.size == 0:
            return
        self._ids.add(rid)
        self._order.append(rid)
        if len(self._order) > self.size:
            self._ids.discard(self._order.popleft())

    def __len__(self) -> int:
        return len(self._order)


SourceItem = CaptureRecord | E.HsCompatError | _Skipped | _Duplicate | _Requeued


class _Source:
    kind: str = ""

    def records(
        self, worker: int, n_workers: int, budget: int | None, consumed: frozenset[str]
    ) -> Iterator[SourceItem]:
        """Worker ``worker`` of ``n_workers``'s records (at most ``budget`` records over all workers), or the
        named error of each record that failed."""
        raise NotImplementedError


class _FileSource(_Source):
    kind = "files"

    def __init__(self, path: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], verify_checksum: bool):
        if isinstance(path, str | os.PathLike):
            self.paths = [Path(path)]
        else:
            self.paths = [Path(p) for p in path]
        if not self.paths:
            raise E.DatasetConfigError("from_files needs a directory or at least one record path")
        for p in self.paths:
            if not p.exists():
                raise E.DatasetConfigError(f"no record directory or file at {p}")
        self.verify_checksum = verify_checksum

    def __repr__(self) -> str:
        return f"files:{','.join(map(str, self.paths))}"

    def manifests(self) -> list[Path]:
        """Every record's manifest (``.json``, ``.error.json`` included), sorted by name."""
        found: set[Path] = set()
        for p in self.paths:
            if p.is_dir():  # the sink writes to hidden temporary names first
                for m in p.glob("*.json"):
                    if m.name.startswith(".") or not m.is_file():
                        continue
                    if (
                        m.name.endswith(".error.json")
                        and m.with_name(m.name.removesuffix(".error.json") + ".json").exists()
                    ):
                        continue  # a record and its error file: the record wins
                    found.add(m)
            else:
                stem = p.name.removesuffix(".json").removesuffix(".safetensors").removesuffix(".error")
                good, bad = p.with_name(f"{stem}.json"), p.with_name(f"{stem}.error.json")
                found.add(good if good.exists() or not bad.exists() else bad)
        return sorted(found, key=lambda m: (str(m.parent), m.name))

    def records(
        self, worker: int, n_workers: int, budget: int | None, consumed: frozenset[str]
    ) -> Iterator[SourceItem]:
        from vllm_hs_compat.export.files import read_record, record_stem

        skip = {record_stem(r) for r in consumed}
        todo: list[Path] = []
        for m in self.manifests():
            stem = m.name.removesuffix(".json").removesuffix(".error")
            if stem in skip:
                if len(todo) % n_workers == worker:  # count each skipped record once, in one worker
                    yield _Skipped()
                continue
            todo.append(m)
        if budget is not None:
            todo = todo[:budget]
        for i, m in enumerate(todo):
            if i % n_workers != worker:
                continue
            try:  # an error file: read_record names why the record failed (RecordFailedError)
                yield read_record(m, verify_checksum=self.verify_checksum)
            except E.HsCompatError as exc:
                yield exc
            except (OSError, ValueError) as exc:  # an unreadable manifest (permissions, encoding)
                yield E.RecordFormatError(f"{m}: cannot read the record ({type(exc).__name__}: {exc})")


class _ExportSource(_Source):
    kind = "export"

    def __init__(
        self,
        endpoint_or_params: str | Mapping[str, Any] | Sequence[str],
        token: str | None,
        wait_s: float | None,
        batch: int,
        poll_s: float,
        consumer_kwargs: dict[str, Any],
        dedupe_window: int = DEDUPE_WINDOW,
    ) -> None:
        from vllm_hs_compat.export.credentials import read_token
        from vllm_hs_compat.export.protocol import ExportTicket

        if not isinstance(batch, int) or not 1 <= batch <= 1024:
            raise E.DatasetConfigError(f"batch must be an int in [1, 1024], found {batch!r}")
        if wait_s is not None and wait_s < 0:
            raise E.DatasetConfigError(f"wait_s must be None or >= 0, found {wait_s!r}")
        if not poll_s > 0:
            raise E.DatasetConfigError(f"poll_s must be > 0, found {poll_s!r}")
        if isinstance(dedupe_window, bool) or not isinstance(dedupe_window, int) or dedupe_window < 0:
            raise E.DatasetConfigError(f"dedupe_window must be an int >= 0 (0: off), found {dedupe_window!r}")
        #: ids this process's streams yielded lately (kept across iterations of the same dataset object)
        self.recent = _Recent(dedupe_window)
        self.params: dict[str, Any] | None = None
        self.ticket_record: str | None = None
        #: every endpoint streamed from (one unless a list was given)
        self.endpoints: list[str]
        if isinstance(endpoint_or_params, str):
            self.endpoints = [endpoint_or_params]
            self.token: str | None = token if token is not None else read_token()
        elif not isinstance(endpoint_or_params, Mapping):
            self.endpoints = list(endpoint_or_params)
            if not self.endpoints or not all(isinstance(e, str) and e for e in self.endpoints):
                raise E.DatasetConfigError(
                    f"from_export takes an endpoint, a non-empty list of endpoints (str) or a ticket "
                    f"(kv_transfer_params), found {endpoint_or_params!r}"
                )
            if len(set(self.endpoints)) != len(self.endpoints):
                raise E.DatasetConfigError(
                    f"an endpoint is listed twice in {self.endpoints}: each producer once (its claims already "
                    "share its records among every consumer)"
                )
            self.token = token if token is not None else read_token()
        else:
            ticket = ExportTicket.parse(endpoint_or_params)  # ProtocolError / ExportConfigError when malformed
            self.params = dict(endpoint_or_params)
            self.endpoints = [ticket.endpoint]
            self.ticket_record = ticket.record_id
            self.token = token
        self.wait_s = wait_s
        self.batch = batch
        self.poll_s = poll_s
        self.consumer_kwargs = consumer_kwargs

    @property
    def endpoint(self) -> str:
        """The first (usually the only) endpoint."""
        return self.endpoints[0]

    def __repr__(self) -> str:  # never the token
        return f"export:{','.join(self.endpoints)}"

    def _open(self, endpoint: str | None = None) -> Any:
        from vllm_hs_compat.export.consumer import ExportConsumer

        if self.params is not None:
            return ExportConsumer.from_params(self.params, self.token, **self.consumer_kwargs)
        return ExportConsumer(endpoint or self.endpoint, self.token, **self.consumer_kwargs)

    def records(
        self, worker: int, n_workers: int, budget: int | None, consumed: frozenset[str]
    ) -> Iterator[SourceItem]:
        if len(self.endpoints) > 1:
            yield from self._records_many(worker, n_workers, budget)
            return
        consumer = self._open()  # in this process: never shared across a fork
        try:
            if consumer.principal == "record":  # a ticket alone: its one record
                if worker != 0 or self.ticket_record is None:
                    return
                if self.ticket_record in consumed:
                    yield _Skipped()
                    return
                try:
                    wait = self.wait_s if self.wait_s is not None else float("inf")
                    yield consumer.fetch(self.ticket_record, wait_s=wait)
                except (E.RecordFormatError, E.RecordFailedError, E.LeaseExpiredError, E.TransportError) as exc:
                    yield exc
                return
            share = _share(n_workers, budget, worker)  # the workers' shares add up to the budget
            if share != 0:
                yield from self._stream(consumer, share)
        finally:
            consumer.close()

    def _records_many(self, worker: int, n_workers: int, budget: int | None) -> Iterator[SourceItem]:
        share = _share(n_workers, budget, worker)
        if share == 0:
            return
        consumers: list[Any] = []
        try:
            for ep in self.endpoints:  # in this process: never shared across a fork
                consumers.append(self._open(ep))
            for c in consumers:
                if c.principal == "record":
                    raise E.DatasetConfigError(
                        f"{c.endpoint}: a ticket's capability opens one record; several endpoints need the trainer "
                        "token"
                    )
            # each stream starts its sweep at another endpoint, so the first claims spread over the producers
            yield from self._stream(consumers, share, first=worker % len(consumers))
        finally:
            for c in consumers:
                c.close()

    def _stream(self, consumers: Any, budget: int | None, first: int = 0) -> Iterator[SourceItem]:
        """Yield records from one consumer or several (one per endpoint), round after round of the consumers'
        own (:class:`~vllm_hs_compat.export.consumer.Sweep`: one long-polled, or several swept in turn), each
        record or its named error in claim order; this adds the budget, the idle end (``wait_s``), dropping a
        record yielded recently and skipping a lease that expired under this stream."""
        from vllm_hs_compat.export.consumer import Sweep

        sweep = Sweep(list(consumers) if isinstance(consumers, list) else [consumers], first)
        last = time.monotonic()
        taken = 0
        while budget is None or taken < budget:
            expired = False
            if self.wait_s is None:
                poll = self.poll_s
            else:  # idle since the last records were handed out; the end needs one more empty answer
                left = self.wait_s - (time.monotonic() - last)
                expired = left <= 0
                poll = min(self.poll_s, max(left, 0.0))
            want = self.batch if budget is None else min(self.batch, budget - taken)
            items = sweep.next_records(want, poll, last_look=expired)
            if not items:
                if expired:
                    return
                continue
            for res in items:
                if isinstance(res, CaptureRecord):
                    rid = res.meta.record_id
                    if rid in self.recent:
                        yield _Duplicate()  # redelivered: not counted against the budget
                        continue
                    self.recent.add(rid)
                    taken += 1
                elif isinstance(res, E.LeaseExpiredError):
                    yield _Requeued(res)  # not lost: the producer requeues it (max_redeliveries)
                    continue
                yield res
            # the idle clock starts when the loop asks for more: time spent training on what was yielded (the
            # generator suspended at a yield) is not time without records
            last = time.monotonic()
