"""The capture's output tree: sharded record folders, a Parquet index, resume, rank split, summary.

One tree, written by one or many ranks (processes) at once::

    OUT/run.json                            {"format": ..., "run_config": {...}}: a resume must match it
    OUT/shard-R-NNNNN/<stem>.safetensors    records of rank R (the package's own files, export/files.py),
    OUT/shard-R-NNNNN/<stem>.json           at most ``records_per_shard`` per folder
    OUT/index/rank-R-part-NNNNN.parquet     index rows of rank R, one part per completed shard and at close
    OUT/index/rank-R.journal                rows adopted since rank R's last part (JSON lines; recovery only)
    OUT/index/rank-R.lock                   held (flock) while rank R runs
    OUT/summary-rank-R.json                 rank R's counters of its latest run (rewritten at every part)
    OUT/summary.json                        merged over ranks, plus the tree's totals from the index
    OUT/.staging/rank-R/                    where the connector's file sink of rank R writes

The rules (docs/capture.md, "Output tree", says the same for users):

* A record counts when, and only when, a row of an index part names it.  Index parts are written to a
  temporary name, fsynced with the record files they name, and renamed into place.
* :meth:`CaptureStore.adopt` verifies a staged record (checksum, token ids == the sample's) and moves it into the
  rank's current shard: tensors first, then the manifest (written anew, tmp + rename, naming the moved tensors),
  then one journal line.  A kill before the journal line leaves files no index and no journal names: the next
  start deletes them and the sample is captured again.  A kill after it leaves a journaled record: the next start
  verifies it again (checksum) and indexes it.  Either way: exactly one verified record per sample.
* At start, each rank recovers its own leftovers (and those of ranks ``>= world_size`` whose lock is free):
  staging and tmp files are deleted, journaled records re-verified and indexed, unnamed record files deleted.
* ``done(sample_id)``: an "ok" row for the sample in any part of any rank (read at start) or adopted in this run.
  Failed rows never make a sample done: a later run tries it again.
* Rank split: ``xxh3_64(key) % world_size == rank`` where key is the sample id (or ``"@" + source`` for a row
  that has no id).  A store adopts and recovers only samples it owns, so ranks of one world size never write the
  same sample.

This module is the store of one rank, :class:`CaptureStore`; its parts are modules of their own, and their public
names are re-exported here, where users import them:

* :mod:`.rows` -- :class:`SampleInfo`, :class:`IndexRow`, the sample key and the rank split;
* :mod:`.policy` -- :class:`Retry` and :class:`Breaker` (when to try again, when to stop);
* :mod:`.tree` -- the tree's names and its ``run.json``;
* :mod:`.durable` -- atomic writes, fsync, the rank lock, the test hooks;
* :mod:`.index` -- the Parquet index parts, read (:func:`read_index`, :func:`failed_rows`) and written;
* :mod:`.staged` -- a staged record checked against its sample before adoption;
* :mod:`.recovery` -- a rank's leftovers after a kill;
* :mod:`.summary` -- :class:`Summary` and :func:`read_summary`.

Pure Python + torch (through export/files.py) + pyarrow + xxhash; never vLLM.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from vllm_hs_compat.errors import CaptureStoreError, CircuitOpenError, RunConfigMismatchError
from vllm_hs_compat.export import files

from . import durable, recovery
from .durable import RankLock, write_atomic
from .index import TreeIndex, failed_rows, read_index
from .policy import NOT_RETRIED, Breaker, Retry
from .rows import INDEX_COLUMNS, IndexRow, SampleInfo, owner_of, sample_key, trim
from .staged import Refused, Staged, check_sample, record_files
from .summary import Summary, read_summary
from .tree import SHARD_RE, check_run_json, json_config

__all__ = [
    "INDEX_COLUMNS",
    "NOT_RETRIED",
    "Breaker",
    "CaptureStore",
    "CaptureStoreError",
    "CircuitOpenError",
    "IndexRow",
    "Retry",
    "RunConfigMismatchError",
    "SampleInfo",
    "Summary",
    "failed_rows",
    "owner_of",
    "read_index",
    "read_summary",
    "sample_key",
]

log = logging.getLogger("vllm_hs_compat.capture")

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[CaptureStore, _P], _R]) -> Callable[Concatenate[CaptureStore, _P], _R]:
    """One writer at a time per store (the command may adopt from more than one thread)."""

    def wrapper(self: CaptureStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._mutex:
            return method(self, *args, **kwargs)

    functools.update_wrapper(wrapper, method)
    return wrapper


class CaptureStore:
    """The output tree of one rank; many ranks (processes) may share one tree (see the module docstring).

    ``run_config``: what makes records of one run comparable (model, layers, capture mode, template hash, ...);
    JSON-able; kept in ``run.json``.  A store opened on a tree made with a different run config raises
    :class:`RunConfigMismatchError` naming the keys that differ.  ``rank``/``world_size``: this process's share
    (:meth:`owns`); may change between runs, but every rank writing the tree at the same time must use the same
    world size.  Use as a context manager, or call :meth:`close`."""

    def __init__(
        self,
        out: str | os.PathLike[str],
        *,
        run_config: Mapping[str, Any],
        rank: int = 0,
        world_size: int = 1,
        records_per_shard: int = 1000,
    ) -> None:
        for name, value, lo in (
            ("world_size", world_size, 1),
            ("rank", rank, 0),
            ("records_per_shard", records_per_shard, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise CaptureStoreError(f"{name}={value!r}: expected an int >= {lo}")
        if rank >= world_size:
            raise CaptureStoreError(f"rank {rank} is outside world size {world_size}: ranks are 0..{world_size - 1}")
        self.out = Path(out)
        self.rank = rank
        self.world_size = world_size
        self.records_per_shard = records_per_shard
        self.run_config = json_config(run_config)
        self._started = time.monotonic()
        self._closed = False
        self._summary = Summary(ranks=[rank], world_size=world_size)
        #: sample key -> reason, for this run's samples whose latest row is failed (a later "ok" takes it out)
        self._failed: dict[str, str] = {}
        self._mutex = threading.RLock()

        self.out.mkdir(parents=True, exist_ok=True)
        index_dir = self.out / "index"
        check_run_json(self.out, rank, self.run_config)
        index_dir.mkdir(exist_ok=True)
        self._lock = RankLock(index_dir / f"rank-{rank}.lock")
        if not self._lock.acquire():
            raise CaptureStoreError(
                f"rank {rank} of {self.out} is held by another running process (pid {self._lock.holder()}, or a "
                "process it started that still runs, such as an engine shutting down); each rank runs once at a "
                "time: give this process another --rank, or stop the other one"
            )
        if not self._lock.works:
            log.warning(
                "%s: the file system has no flock; nothing stops two processes running rank %d at once", self.out, rank
            )
        try:
            self._open()
        except BaseException:
            self._lock.release()
            raise

    # --- start: the index, recovery, done set -----------------------------------------------------------------
    def _open(self) -> None:
        self._index = TreeIndex(self.out)
        self._done: set[str] = self._index.ok_keys
        if not durable.unsafe():
            recovery.recover_leftovers(
                self._index, rank=self.rank, world_size=self.world_size, done=self._done, owns_key=self.owns_key
            )
        # this run's numbering: a new shard and the next part
        shards = [
            int(m.group(2))
            for p in self.out.iterdir()
            if (m := SHARD_RE.match(p.name)) and int(m.group(1)) == self.rank
        ]
        self._shard_no = max(shards, default=-1) + 1
        self._shard_count = 0
        self._part_no = self._index.next_part(self.rank)
        self._pending: list[IndexRow] = []
        self._journal_path = self._index.dir / f"rank-{self.rank}.journal"
        self._journal_fd: int | None = None
        self._staging = self.out / ".staging" / f"rank-{self.rank}"
        self._staging.mkdir(parents=True, exist_ok=True)
        self._write_rank_summary()

    # --- queries ----------------------------------------------------------------------------------------------
    def owns_key(self, key: str) -> bool:
        return owner_of(key, self.world_size) == self.rank

    def owns(self, sample_id: str) -> bool:
        """True when this rank captures ``sample_id``: ``xxh3_64(sample_id) % world_size == rank``.  For a row
        without an id, ask with ``"@" + source`` (what :class:`SampleInfo` keys it by)."""
        return self.owns_key(sample_id)

    def done(self, sample_id: str) -> bool:
        """True when ``sample_id`` has a verified record in the index (any rank, read at start) or was adopted in
        this run.  A sample whose rows are all failed is not done."""
        return sample_id in self._done

    def staging_dir(self) -> Path:
        """``OUT/.staging/rank-R/``: point the connector's file sink here; emptied at every start."""
        return self._staging

    # --- writes -----------------------------------------------------------------------------------------------
    def _check_writable(self, sample: SampleInfo) -> None:
        if self._closed:
            raise CaptureStoreError(f"the store of {self.out} rank {self.rank} is closed")
        if not isinstance(sample, SampleInfo):
            raise CaptureStoreError(f"expected a SampleInfo, found {type(sample).__name__}")
        key = sample.key
        if not self.owns_key(key):
            raise CaptureStoreError(
                f"sample {key!r} belongs to rank {owner_of(key, self.world_size)} of {self.world_size}, not rank "
                f"{self.rank}; ask store.owns() before capturing a sample"
            )
        if key in self._done:
            raise CaptureStoreError(
                f"sample {key!r} already has a verified record in {self.out}; ask store.done() before capturing"
            )

    def check(self, sample: SampleInfo, manifest: str | os.PathLike[str]) -> Staged | Refused:
        """:meth:`adopt`'s verification of the staged record alone: reads the record, changes nothing (no lock), so
        callers may verify records ahead in other threads and hand the answer to :meth:`adopt` (``checked``)."""
        return check_sample(sample, manifest)

    @_locked
    def adopt(
        self, sample: SampleInfo, manifest: str | os.PathLike[str], *, checked: Staged | Refused | None = None
    ) -> IndexRow:
        """Verify the staged record at ``manifest`` (its ``.json``; an ``.error.json`` beside it is read as the
        connector's failure) and move it into this rank's current shard.

        Verified: the checksum of its bytes, ``start == 0`` (the whole sequence), its token ids begin with
        ``sample.input_ids`` and its prompt is exactly them (``num_prompt_tokens == len(input_ids)``; a record
        that does not know its prompt length must have exactly those ids).  A record that fails any of these is
        not adopted: its files are deleted and a "failed" row is written (reason "tokenizer_mismatch",
        "partial_record", "bad_record", "missing_record", "non_finite" (NaN/Inf rows), or the connector's own
        reason) and returned.  ``checked``: :meth:`check`'s answer for this sample and manifest, computed earlier
        (the capture verifies records ahead of adopting them in order); None: checked here."""
        self._check_writable(sample)
        staged = self.check(sample, manifest) if checked is None else checked
        if isinstance(staged, Staged) and staged.manifest_path != record_files(Path(manifest))[1]:
            raise CaptureStoreError(f"checked {staged.manifest_path}, asked to adopt {manifest}: not the same record")
        if isinstance(staged, Refused):
            return self._fail_files(sample, staged.reason, staged.message, staged.files)
        meta = staged.meta
        shard = self.out / f"shard-{self.rank}-{self._shard_no:05d}"
        shard.mkdir(exist_ok=True)
        stem = files.record_stem(sample.sample_id or sample.key)
        dest_tensors, dest_manifest = shard / f"{stem}.safetensors", shard / f"{stem}.json"
        if dest_tensors.exists() or dest_manifest.exists():
            raise CaptureStoreError(
                f"{dest_manifest} exists already: two samples of this run map to one file name, or another process "
                f"writes rank {self.rank}'s shards; each rank must run once at a time"
            )
        os.replace(staged.tensors_path, dest_tensors)
        durable.point("adopt.after_tensors")
        raw = staged.manifest
        raw["tensors"] = dest_tensors.name
        # compact, as the connector wrote it (files.write_record: the C encoder, in the adopter beside the engine)
        write_atomic(dest_manifest, json.dumps(raw, separators=(",", ":")).encode(), tag=f"rank-{self.rank}")
        durable.point("adopt.after_manifest")
        staged.manifest_path.unlink(missing_ok=True)
        staged.error_path.unlink(missing_ok=True)
        # the rows a trainer will train: the record's own mask when it carries one (an on-policy record's generated
        # part is known only now), else what the sample said
        record_mask = meta.loss_mask()
        loss_tokens = int(record_mask.sum()) if record_mask is not None else sample.loss_tokens
        row = IndexRow(
            sample_id=sample.sample_id,
            source=sample.source,
            status="ok",
            reason=None,
            message=None,
            record=f"{shard.name}/{dest_manifest.name}",
            tokens=meta.shape[0],
            loss_tokens=loss_tokens,
            bytes=dest_tensors.stat().st_size + dest_manifest.stat().st_size,
            rank=self.rank,
            checksum=meta.checksum,
            metadata=json.dumps(dict(sample.metadata), sort_keys=True, default=str),
            time=time.time(),
        )
        self._append(row)
        durable.point("adopt.after_journal")
        self._done.add(sample.key)
        self._failed.pop(sample.key, None)  # an earlier attempt of this run failed: the sample is captured now
        s = self._summary
        s.captured += 1
        s.tokens += row.tokens
        s.loss_tokens += row.loss_tokens or 0
        s.bytes += row.bytes
        self._shard_count += 1
        if self._shard_count >= self.records_per_shard:
            self._flush()
        return row

    @_locked
    def fail(self, sample: SampleInfo, reason: str, message: str) -> IndexRow:
        """Write a "failed" row for ``sample`` (counted by reason in the summary).  A failed sample is not done: a
        later run tries it again.  ``sample.sample_id`` may be empty (a row without an id; keyed by its
        source)."""
        self._check_writable(sample)
        return self._fail_files(sample, reason, message, [])

    def _fail_files(self, sample: SampleInfo, reason: str, message: str, staged: list[Path]) -> IndexRow:
        if not isinstance(reason, str) or not reason:
            raise CaptureStoreError(f"a failure needs a reason (a short name), found {reason!r}")
        for p in staged:
            p.unlink(missing_ok=True)
        row = IndexRow(
            sample_id=sample.sample_id,
            source=sample.source,
            status="failed",
            reason=reason,
            message=trim(str(message)),
            record=None,
            tokens=sample.num_tokens,
            loss_tokens=sample.loss_tokens,
            bytes=0,
            rank=self.rank,
            checksum=None,
            metadata=json.dumps(dict(sample.metadata), sort_keys=True, default=str),
            time=time.time(),
        )
        self._append(row)
        self._failed[sample.key] = reason
        if len(self._pending) >= self.records_per_shard:
            self._flush()
        return row

    @_locked
    def note_rows(self, *, read: int = 0, skipped: int = 0) -> None:
        """Count rows read from the source and rows skipped because their sample was done (for the summary)."""
        self._summary.rows_read += read
        self._summary.skipped += skipped

    def _append(self, row: IndexRow) -> None:
        self._pending.append(row)
        if durable.unsafe():
            return
        if self._journal_fd is None:
            self._journal_fd = os.open(self._journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        line = json.dumps({"part": self._part_no, "row": row.to_dict()}) + "\n"
        os.write(self._journal_fd, line.encode())

    def _flush(self) -> None:
        """Write the pending rows as the next part, drop the journal, start a new shard."""
        if self._pending:
            self._index.write(self.rank, self._part_no, self._pending)
            self._part_no += 1
            self._pending = []
        if self._journal_fd is not None:
            os.close(self._journal_fd)
            self._journal_fd = None
        self._journal_path.unlink(missing_ok=True)
        if self._shard_count:
            self._shard_no += 1
            self._shard_count = 0
        self._write_rank_summary()

    # --- the summary, and the end -----------------------------------------------------------------------------
    def _rank_summary(self) -> Summary:
        s = self._summary
        s.failed = dict(sorted(Counter(self._failed.values()).items()))
        s.elapsed_s = time.monotonic() - self._started
        s.tokens_per_s = s.tokens / s.capture_s if s.capture_s > 0 else 0.0
        s.closed = self._closed
        return s

    @_locked
    def note_times(
        self,
        *,
        engine_start_s: float,
        capture_s: float,
        engine_s: float = 0.0,
        adopt_s: float = 0.0,
        adopt_wait_s: float = 0.0,
        overlap_s: float = 0.0,
    ) -> None:
        """The run's engine start and its capture (from a ready engine to the last record adopted): the summary's
        ``tokens_per_s`` is of the capture alone; where the capture's time went (:class:`Summary`'s ``engine_s``,
        ``adopt_s``, ``adopt_wait_s``, ``overlap_s``)."""
        s = self._summary
        s.engine_start_s, s.capture_s = engine_start_s, capture_s
        s.engine_s, s.adopt_s, s.adopt_wait_s, s.overlap_s = engine_s, adopt_s, adopt_wait_s, overlap_s

    @_locked
    def run_summary(self) -> Summary:
        """This rank's counters of this run (what ``summary-rank-R.json`` holds), without the tree's totals."""
        return Summary.from_dict(self._rank_summary().to_dict())

    def _write_rank_summary(self) -> None:
        data = json.dumps(self._rank_summary().to_dict(), indent=1).encode()
        write_atomic(self.out / f"summary-rank-{self.rank}.json", data, tag=f"rank-{self.rank}")

    @_locked
    def close(self) -> Summary:
        """Write the last index part and this rank's summary, then ``summary.json`` merged over the ranks whose
        summaries exist (see :func:`read_summary`); returns that merged summary.  Idempotent."""
        if self._closed:
            return read_summary(self.out)
        try:
            self._flush()
            self._closed = True
            self._write_rank_summary()
            with contextlib.suppress(OSError):
                self._staging.rmdir()
            merged = read_summary(self.out)
            write_atomic(
                self.out / "summary.json",
                json.dumps(merged.to_dict(), indent=1).encode(),
                tag=f"rank-{self.rank}",
                durable=True,
            )
            return merged
        finally:
            self._closed = True
            self._lock.release()

    def __enter__(self) -> CaptureStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
