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

Pure Python + torch (through export/files.py) + pyarrow + xxhash; never vLLM.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, Final, ParamSpec, TypeVar

from vllm_hs_compat.core import finite
from vllm_hs_compat.core.vocabulary import REASON_NON_FINITE
from vllm_hs_compat.errors import (
    CaptureStoreError,
    CircuitOpenError,
    ExportConfigError,
    RecordFailedError,
    RecordFormatError,
    RunConfigMismatchError,
)
from vllm_hs_compat.export import files

if TYPE_CHECKING:
    import pyarrow as pa

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
    "read_index",
    "read_summary",
]

log = logging.getLogger("vllm_hs_compat.capture")

TREE_FORMAT: Final = "vllm-hs-compat capture tree"
TREE_VERSION: Final = 1

#: Columns of every index part, in order.
INDEX_COLUMNS: Final = (
    "sample_id",
    "source",
    "status",
    "reason",
    "message",
    "record",
    "tokens",
    "loss_tokens",
    "bytes",
    "rank",
    "checksum",
    "metadata",
    "time",
)

#: Failure reasons :class:`Retry` never retries by default: trying again gives the same answer.
NOT_RETRIED: Final = frozenset(
    {
        "tokenizer_mismatch",
        "partial_record",
        "wrong_sample",
        "malformed",
        "unknown_shape",
        "empty",
        "too_long",
        "template",
        "bad_field",
        "bad_params",
        REASON_NON_FINITE,
    }
)

_PART_RE: Final = re.compile(r"^rank-(\d+)-part-(\d+)\.parquet$")
_SHARD_RE: Final = re.compile(r"^shard-(\d+)-(\d+)$")
_JOURNAL_RE: Final = re.compile(r"^rank-(\d+)\.journal$")
_STAGING_RE: Final = re.compile(r"^rank-(\d+)$")
_MAX_MESSAGE: Final = 2000

# --- test hooks (tests/capture/store_driver.py sets them in its own process; nothing else does) ----------------
#: ``(point, n)``: SIGKILL this process the n-th time ``point`` is reached (points: "adopt.after_tensors",
#: "adopt.after_manifest", "adopt.after_journal", "index.mid_write", "index.before_rename").
_KILL_AT: tuple[str, int] | None = None
#: True turns the safety off (index parts and manifests written in place, no recovery at start): the negative
#: control of the kill-and-resume test, which must then find duplicates or half records.
_UNSAFE: bool = False
_hits: Counter[str] = Counter()


def _point(name: str) -> None:
    if _KILL_AT is not None and _KILL_AT[0] == name:
        _hits[name] += 1
        if _hits[name] >= _KILL_AT[1]:
            os.kill(os.getpid(), signal.SIGKILL)


def _pa() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401  (loads the submodule)
    except ImportError:
        raise CaptureStoreError(
            "the capture index is Parquet and needs pyarrow: pip install 'vllm-hs-compat[capture]' (or pyarrow)"
        ) from None
    return pyarrow


def _schema() -> pa.Schema:
    pa = _pa()
    return pa.schema(
        [
            ("sample_id", pa.string()),
            ("source", pa.string()),
            ("status", pa.string()),
            ("reason", pa.string()),
            ("message", pa.string()),
            ("record", pa.string()),
            ("tokens", pa.int64()),
            ("loss_tokens", pa.int64()),
            ("bytes", pa.int64()),
            ("rank", pa.int32()),
            ("checksum", pa.uint64()),
            ("metadata", pa.string()),
            ("time", pa.float64()),
        ]
    )


def sample_key(sample_id: str, source: str) -> str:
    """The key a sample is split, deduplicated and marked done by: its id, or ``"@" + source`` without one."""
    return sample_id if sample_id else "@" + source


def owner_of(key: str, world_size: int) -> int:
    """The rank that owns ``key`` (see :func:`sample_key`) among ``world_size`` ranks: xxh3_64 of its UTF-8 bytes
    modulo the world size."""
    from vllm_hs_compat.core.records import checksum_bytes

    return checksum_bytes(key.encode("utf-8"), "xxh3_64") % world_size


# --- the small value types ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SampleInfo:
    """What the store needs to know of one sample.

    ``input_ids`` are exactly the token ids the engine was given; :meth:`CaptureStore.adopt` needs them and adopts
    a record only when its token ids begin with them (and the record's prompt is exactly them: see adopt).
    ``sample_id`` may be empty for a row that has none (a malformed line): the row is then keyed by its source."""

    sample_id: str
    source: str
    num_tokens: int
    loss_tokens: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    input_ids: tuple[int, ...] | None = None

    @property
    def key(self) -> str:
        return sample_key(self.sample_id, self.source)

    @classmethod
    def of(cls, sample: Any) -> SampleInfo:
        """From a :class:`vllm_hs_compat.capture.samples.Sample` (``sample_id``, ``source``, ``input_ids``,
        ``loss_mask``, ``metadata``)."""
        ids = tuple(int(t) for t in sample.input_ids)
        mask = getattr(sample, "loss_mask", None)
        return cls(
            sample_id=str(sample.sample_id),
            source=str(sample.source),
            num_tokens=len(ids),
            loss_tokens=None if mask is None else int(sum(mask)),
            metadata=dict(getattr(sample, "metadata", None) or {}),
            input_ids=ids,
        )


@dataclass(frozen=True, slots=True)
class IndexRow:
    """One row of the index (the columns of ``index/rank-R-part-NNNNN.parquet``, :data:`INDEX_COLUMNS`)."""

    sample_id: str
    source: str
    status: str
    """"ok" (a verified record) or "failed"."""
    reason: str | None
    """Why it failed (None when ok): "tokenizer_mismatch", "bad_record", "partial_record", "missing_record",
    "non_finite", the connector's own reason from an ``.error.json``, or what the caller passed to
    :meth:`CaptureStore.fail`."""
    message: str | None
    record: str | None
    """The record's manifest, relative to the tree's root (posix separators); None when failed."""
    tokens: int
    """Token rows of the record (ok), or the sample's token count (failed)."""
    loss_tokens: int | None
    bytes: int
    """Bytes on disk of the record's two files (0 when failed)."""
    rank: int
    checksum: int | None
    """The record's hidden-states checksum (its manifest's ``checksum``)."""
    metadata: str
    """The sample's metadata as JSON text."""
    time: float
    """Unix time the row was written."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> IndexRow:
        return cls(**{k: d[k] for k in INDEX_COLUMNS})


@dataclass
class Summary:
    """Counters of one rank's latest run, or merged over ranks (:func:`read_summary`), plus the tree's totals from
    the merged index (``tree_*``: what a trainer will find, whatever runs made it)."""

    rows_read: int = 0
    """Rows of the rank's share read from the source in the run, whatever became of them (skipped included)."""
    captured: int = 0
    skipped: int = 0
    """Of those, rows whose sample was already done at start (reported through :meth:`CaptureStore.note_rows`)."""
    failed: dict[str, int] = field(default_factory=dict)
    """Samples (rows) of the run that ended failed, by reason: a failed attempt that a later attempt of the same
    run captured is not counted."""
    tokens: int = 0
    loss_tokens: int = 0
    bytes: int = 0
    elapsed_s: float = 0.0
    """Wall time of the run (merged: the longest rank's, ranks run side by side)."""
    engine_start_s: float = 0.0
    """Time the run's engine took to start (merged: the longest rank's); 0 when none started."""
    capture_s: float = 0.0
    """Time from a ready engine to the last record adopted (merged: the longest rank's)."""
    tokens_per_s: float = 0.0
    """Tokens captured per second of capture (``tokens / capture_s``; engine start-up not counted)."""
    ranks: list[int] = field(default_factory=list)
    world_size: int = 1
    closed: bool = False
    """True when every rank summarised closed its store (False: a rank still runs, or was killed)."""
    tree_records: int = 0
    tree_failed: dict[str, int] = field(default_factory=dict)
    tree_tokens: int = 0
    tree_loss_tokens: int = 0
    tree_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Summary:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


class Retry:
    """How many times one sample is tried (``max_attempts`` in all), for which failure reasons.

    ``retry_on``: the reasons worth another attempt; None = every reason except :data:`NOT_RETRIED`."""

    def __init__(self, max_attempts: int = 3, *, retry_on: Collection[str] | None = None) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise CaptureStoreError(f"Retry(max_attempts={max_attempts!r}): expected an int >= 1 (1 = no retry)")
        self.max_attempts = max_attempts
        self.retry_on = None if retry_on is None else frozenset(retry_on)
        self._failures: Counter[str] = Counter()

    def retriable(self, reason: str) -> bool:
        return reason not in NOT_RETRIED if self.retry_on is None else reason in self.retry_on

    def allow(self, sample_id: str, reason: str) -> bool:
        """Count a failed attempt of ``sample_id``; True when it may be tried again."""
        self._failures[sample_id] += 1
        return self.retriable(reason) and self._failures[sample_id] < self.max_attempts

    def attempts(self, sample_id: str) -> int:
        """Failed attempts of ``sample_id`` counted so far."""
        return self._failures[sample_id]

    def forget(self, sample_id: str) -> None:
        """Drop the count of a sample that is finished (captured, or failed for good)."""
        self._failures.pop(sample_id, None)


class Breaker:
    """Stops the run after ``max_consecutive`` failures in a row: :meth:`failure` raises :class:`CircuitOpenError`
    naming the reasons of those failures and the last message; :meth:`success` resets the count."""

    def __init__(self, max_consecutive: int = 20) -> None:
        if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise CaptureStoreError(f"Breaker(max_consecutive={max_consecutive!r}): expected an int >= 1")
        self.max_consecutive = max_consecutive
        self._recent: list[tuple[str, str]] = []

    @property
    def consecutive(self) -> int:
        return len(self._recent)

    def success(self) -> None:
        self._recent.clear()

    def failure(self, reason: str, message: str = "") -> None:
        self._recent.append((reason, message))
        if len(self._recent) >= self.max_consecutive:
            counts = Counter(r for r, _ in self._recent)
            reasons = ", ".join(f"{r} x{n}" for r, n in counts.most_common())
            last_reason, last_message = self._recent[-1]
            raise CircuitOpenError(
                f"stopped after {len(self._recent)} consecutive failures ({reasons}); last: {last_reason}: "
                f"{last_message[:_MAX_MESSAGE]}; fix that cause and re-run the same command: records captured so "
                "far are kept and skipped"
            )


# --- file helpers -----------------------------------------------------------------------------------------------
def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _syncfs(path: Path) -> bool:
    """Flush the file system holding ``path`` (Linux ``syncfs``: one call instead of an fsync per record file,
    measured 450 ms against 2.2 s for 500 files of 64 KiB); False where it is not available."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return bool(fn(fd) == 0)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes, *, tag: str, durable: bool = False) -> None:
    """Write ``data`` to ``path`` through the temporary name ``.<name>.<tag>.tmp`` in the same folder (fsynced
    first when ``durable``).  ``tag`` names the writer (``rank-R``): only that rank writes, and cleans, its
    temporary files."""
    if _UNSAFE:
        path.write_bytes(data)
        return
    tmp = path.with_name(f".{path.name}.{tag}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        _fsync_path(path.parent, directory=True)


def _json_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(run_config, Mapping):
        raise CaptureStoreError(f"run_config must be a mapping, found {type(run_config).__name__}")
    try:
        normal: dict[str, Any] = json.loads(json.dumps(dict(run_config), sort_keys=True))
    except (TypeError, ValueError) as e:
        raise CaptureStoreError(
            f"run_config must be JSON-able (str/int/float/bool/None, lists, string-keyed dicts): {e}"
        ) from None
    return normal


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _trim(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "..."


# --- the index --------------------------------------------------------------------------------------------------
def _list_parts(index_dir: Path) -> list[tuple[int, int, Path]]:
    """``(rank, part, path)`` of every index part, sorted; temporary and foreign files are not parts."""
    found = []
    if index_dir.is_dir():
        for p in index_dir.iterdir():
            m = _PART_RE.match(p.name)
            if m:
                found.append((int(m.group(1)), int(m.group(2)), p))
    return sorted(found)


def _read_part(path: Path) -> pa.Table:
    pa = _pa()
    try:
        table = pa.parquet.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise CaptureStoreError(
            f"index part {path} cannot be read ({type(e).__name__}: {e}); index parts are renamed into place only "
            "when complete, so it was damaged after it was written (disk, copy, or a writer that is not this "
            "package); restore it from a copy, or move it away and re-run: its samples are then captured again"
        ) from None
    want = _schema()
    if table.schema.names != want.names:
        raise CaptureStoreError(
            f"index part {path} has columns {table.schema.names}, expected {want.names}; it was written by "
            "another version of vllm-hs-compat or another tool"
        )
    return table.cast(want)


def _dedup(table: pa.Table) -> pa.Table:
    """One row per sample key: the earliest "ok" row when there is one, else the latest failed row."""
    pa = _pa()
    ids = table.column("sample_id").to_pylist()
    sources = table.column("source").to_pylist()
    status = table.column("status").to_pylist()
    times = table.column("time").to_pylist()
    best: dict[str, int] = {}
    for i, (sid, src, st, t) in enumerate(zip(ids, sources, status, times, strict=True)):
        key = sample_key(sid, src)
        j = best.get(key)
        if j is None:
            best[key] = i
        elif status[j] == "ok":
            if st == "ok" and t < times[j]:
                best[key] = i
        elif st == "ok" or t >= times[j]:
            best[key] = i
    order = sorted(best, key=lambda k: (ids[best[k]], sources[best[k]]))
    return table.take(pa.array([best[k] for k in order], type=pa.int64()))


def _concat(tables: list[pa.Table]) -> pa.Table:
    pa = _pa()
    if not tables:
        return _schema().empty_table()
    return pa.concat_tables(tables)


def read_index(out: str | os.PathLike[str]) -> pa.Table:
    """Every index part of every rank of the tree at ``out``, merged into one ``pyarrow.Table`` (columns
    :data:`INDEX_COLUMNS`), one row per sample (by :func:`sample_key`): its earliest "ok" row when it has one, else
    its latest failed row; sorted by sample id.  Record files that no part names are not in it (they do not count).
    Raises :class:`CaptureStoreError` for a part that cannot be read."""
    index_dir = Path(out) / "index"
    return _dedup(_concat([_read_part(p) for _, _, p in _list_parts(index_dir)]))


def failed_rows(out: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The failed rows of the merged index (:func:`read_index`), in source order: ``sample_id``, ``source``,
    ``reason``, ``message``, ``tokens`` (the sample's token count when it had one), ``rank``, ``time``."""
    keys = ("sample_id", "source", "reason", "message", "tokens", "rank", "time")
    rows = [{k: r[k] for k in keys} for r in read_index(out).to_pylist() if r["status"] != "ok"]

    def place(row: dict[str, Any]) -> tuple[str, int, str]:
        file, _, n = str(row["source"]).rpartition(":")
        return (file, int(n), row["sample_id"]) if n.isdigit() else (str(row["source"]), -1, row["sample_id"])

    return sorted(rows, key=place)


def _tree_totals(index: pa.Table, summary: Summary) -> None:
    status = index.column("status").to_pylist()
    reasons = index.column("reason").to_pylist()
    tokens = index.column("tokens").to_pylist()
    loss = index.column("loss_tokens").to_pylist()
    nbytes = index.column("bytes").to_pylist()
    failed: Counter[str] = Counter()
    for st, reason, tok, lt, nb in zip(status, reasons, tokens, loss, nbytes, strict=True):
        if st == "ok":
            summary.tree_records += 1
            summary.tree_tokens += tok
            summary.tree_loss_tokens += lt or 0
            summary.tree_bytes += nb
        else:
            failed[reason or "unknown"] += 1
    summary.tree_failed = dict(sorted(failed.items()))


def read_summary(out: str | os.PathLike[str]) -> Summary:
    """The runs' counters merged over ranks (every ``summary-rank-R.json``: each rank's latest run) plus the tree's
    totals from :func:`read_index`.  ``elapsed_s`` and ``capture_s`` are the longest rank's and ``tokens_per_s`` =
    tokens / ``capture_s``."""
    root = Path(out)
    merged = Summary()
    failed: Counter[str] = Counter()
    closed = True
    found = False
    for p in sorted(root.glob("summary-rank-*.json")):
        try:
            s = Summary.from_dict(json.loads(p.read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise CaptureStoreError(f"{p} cannot be read ({e}); it is rewritten by the next run of that rank") from None
        found = True
        merged.rows_read += s.rows_read
        merged.captured += s.captured
        merged.skipped += s.skipped
        failed.update(s.failed)
        merged.tokens += s.tokens
        merged.loss_tokens += s.loss_tokens
        merged.bytes += s.bytes
        merged.elapsed_s = max(merged.elapsed_s, s.elapsed_s)
        merged.engine_start_s = max(merged.engine_start_s, s.engine_start_s)
        merged.capture_s = max(merged.capture_s, s.capture_s)
        merged.ranks.extend(s.ranks)
        merged.world_size = max(merged.world_size, s.world_size)
        closed = closed and s.closed
    merged.failed = dict(sorted(failed.items()))
    merged.ranks.sort()
    merged.closed = closed and found
    merged.tokens_per_s = merged.tokens / merged.capture_s if merged.capture_s > 0 else 0.0
    _tree_totals(read_index(root), merged)
    return merged


# --- the store ----------------------------------------------------------------------------------------------------
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[CaptureStore, _P], _R]) -> Callable[Concatenate[CaptureStore, _P], _R]:
    """One writer at a time per store (the command may adopt from more than one thread)."""

    def wrapper(self: CaptureStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._mutex:
            return method(self, *args, **kwargs)

    functools.update_wrapper(wrapper, method)
    return wrapper


class _RankLock:
    """``index/rank-R.lock`` held with flock while a rank runs (or while another process recovers its leftovers).
    Where the file system has no flock, nothing is held and ``works`` is False."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.works = True

    def acquire(self) -> bool:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                self.works = False
                return True
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def holder(self) -> str:
        with contextlib.suppress(OSError):
            return self.path.read_text().strip() or "?"
        return "?"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


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
        self.run_config = _json_config(run_config)
        self._started = time.monotonic()
        self._closed = False
        self._summary = Summary(ranks=[rank], world_size=world_size)
        #: sample key -> reason, for this run's samples whose latest row is failed (a later "ok" takes it out)
        self._failed: dict[str, str] = {}
        self._mutex = threading.RLock()

        self.out.mkdir(parents=True, exist_ok=True)
        self._index_dir = self.out / "index"
        self._check_run_json()
        self._index_dir.mkdir(exist_ok=True)
        self._lock = _RankLock(self._index_dir / f"rank-{rank}.lock")
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

    # --- start: run.json, recovery, done set ------------------------------------------------------------------
    def _check_run_json(self) -> None:
        path = self.out / "run.json"
        doc = {"format": TREE_FORMAT, "version": TREE_VERSION, "run_config": self.run_config}
        if not path.exists():
            # a tree is made in a new folder (other ranks starting at the same time may have made these already)
            foreign = [
                p.name
                for p in self.out.iterdir()
                if p.name not in ("index", ".staging", "logs", "run.json") and not p.name.startswith(".run.json.")
            ]
            if foreign:
                raise CaptureStoreError(
                    f"{self.out} is not empty ({', '.join(sorted(foreign)[:5])}) and is not a capture tree (no "
                    "run.json): --out must be a new or empty folder, or a tree this command made"
                )
            tmp = self.out / f".run.json.rank-{self.rank}.{os.getpid()}.tmp"
            tmp.write_bytes(json.dumps(doc, indent=1, sort_keys=True).encode())
            try:
                os.link(tmp, path)  # creates run.json only if no other rank did first
            except (FileExistsError, FileNotFoundError):
                pass
            else:
                _fsync_path(self.out, directory=True)
            finally:
                tmp.unlink(missing_ok=True)
        try:
            found = json.loads(path.read_text())
            theirs = found["run_config"]
            if found.get("format") != TREE_FORMAT or not isinstance(theirs, dict):
                raise ValueError("not a capture tree's run.json")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CaptureStoreError(
                f"{path} cannot be read as a capture tree's run.json ({e}); --out must be a new folder or a tree "
                "this command made"
            ) from None
        if found.get("version") != TREE_VERSION:
            raise CaptureStoreError(
                f"{self.out} is a capture tree of version {found.get('version')}, this build writes "
                f"{TREE_VERSION}; use another --out or the vllm-hs-compat version that made it"
            )
        if theirs != self.run_config:
            keys = sorted(set(theirs) | set(self.run_config))
            diff = [k for k in keys if theirs.get(k, "<absent>") != self.run_config.get(k, "<absent>")]
            shown = "; ".join(
                f"{k}: tree has {_short(theirs.get(k, '<absent>'))}, this run has "
                f"{_short(self.run_config.get(k, '<absent>'))}"
                for k in diff
            )
            raise RunConfigMismatchError(
                f"{self.out} was made with other settings ({shown}); records of both would be mixed in one index. "
                "Use another --out for these settings, or re-run with the tree's settings to resume it"
            )

    def _open(self) -> None:
        parts = _list_parts(self._index_dir)
        tables = [_read_part(p) for _, _, p in parts]
        self._parts = {(r, n) for r, n, _ in parts}
        index_all = _concat(tables)
        merged = _dedup(index_all)
        keys = (
            sample_key(s, src)
            for s, src, st in zip(
                merged.column("sample_id").to_pylist(),
                merged.column("source").to_pylist(),
                merged.column("status").to_pylist(),
                strict=True,
            )
            if st == "ok"
        )
        self._done: set[str] = set(keys)
        self._indexed_records = {r for r in index_all.column("record").to_pylist() if r is not None}
        self._indexed_shards = {r.split("/", 1)[0] for r in self._indexed_records}
        if not _UNSAFE:
            for r in self._leftover_ranks():
                if r == self.rank:
                    self._recover(r)
                    continue
                lock = _RankLock(self._index_dir / f"rank-{r}.lock")
                if lock.acquire() and lock.works:
                    try:
                        self._recover(r)
                    finally:
                        lock.release()
        # this run's numbering: a new shard and the next part
        shards = [
            int(m.group(2))
            for p in self.out.iterdir()
            if (m := _SHARD_RE.match(p.name)) and int(m.group(1)) == self.rank
        ]
        self._shard_no = max(shards, default=-1) + 1
        self._shard_count = 0
        self._part_no = max((n for r, n in self._parts if r == self.rank), default=-1) + 1
        self._pending: list[IndexRow] = []
        self._journal_path = self._index_dir / f"rank-{self.rank}.journal"
        self._journal_fd: int | None = None
        self._staging = self.out / ".staging" / f"rank-{self.rank}"
        self._staging.mkdir(parents=True, exist_ok=True)
        self._write_rank_summary()

    def _leftover_ranks(self) -> list[int]:
        """This rank, and every rank ``>= world_size`` that left a journal, staging files or shards behind (ranks
        below the world size recover their own when they start)."""
        found = {self.rank}
        for p in self._index_dir.iterdir():
            if m := _JOURNAL_RE.match(p.name):
                found.add(int(m.group(1)))
        staging = self.out / ".staging"
        if staging.is_dir():
            found.update(int(m.group(1)) for p in staging.iterdir() if (m := _STAGING_RE.match(p.name)))
        for p in self.out.iterdir():
            if m := _SHARD_RE.match(p.name):
                found.add(int(m.group(1)))
        return sorted(r for r in found if r == self.rank or r >= self.world_size)

    def _recover(self, r: int) -> None:
        """Bring rank ``r``'s leftovers to a state where every record file is named by an index part: journaled
        records that verify again are indexed, everything else that no part names is deleted."""
        staging = self.out / ".staging" / f"rank-{r}"
        removed = 0
        if staging.is_dir():
            for p in staging.iterdir():
                if p.is_file() or p.is_symlink():
                    p.unlink()
                    removed += 1
        for p in self._index_dir.iterdir():
            if p.name.startswith(f".rank-{r}-part-") and p.name.endswith(".tmp"):
                p.unlink()
        for p in [*self.out.glob(f".*.rank-{r}.tmp"), *self.out.glob(f".run.json.rank-{r}.*.tmp")]:
            p.unlink(missing_ok=True)
        if r != self.rank:
            with contextlib.suppress(OSError):
                staging.rmdir()
            (self.out / f"summary-rank-{r}.json").unlink(missing_ok=True)  # that rank is not in this job
        journal_path = self._index_dir / f"rank-{r}.journal"
        journal: dict[str, tuple[int, IndexRow]] = {}  # record or "@key" -> (part, row)
        failed_rows: list[tuple[int, IndexRow]] = []
        if journal_path.exists():
            for line in journal_path.read_bytes().splitlines():
                try:
                    d = json.loads(line)
                    part, row = int(d["part"]), IndexRow.from_dict(d["row"])
                except (ValueError, KeyError, TypeError):
                    continue  # the torn last line of a killed writer
                if row.record is not None:
                    journal[row.record] = (part, row)
                else:
                    failed_rows.append((part, row))
        recovered: list[IndexRow] = []
        deleted = 0
        for shard in sorted(self.out.iterdir()):
            m = _SHARD_RE.match(shard.name)
            if not m or int(m.group(1)) != r or not shard.is_dir():
                continue
            if shard.name in self._indexed_shards:
                continue  # sealed: a part names its records, and no record is added to a shard after that
            names = {f"{shard.name}/{p.name}" for p in shard.iterdir()}
            keep: set[str] = set()
            for name in sorted(names):
                if not name.endswith(".json") or name not in journal:
                    continue
                part, row = journal[name]
                if (r, part) in self._parts:
                    continue
                if (
                    row.status != "ok"
                    or sample_key(row.sample_id, row.source) in self._done
                    or not self.owns_key(sample_key(row.sample_id, row.source))
                ):
                    continue
                try:
                    record = files.read_record(self.out / name, verify_checksum=True)
                except (RecordFormatError, RecordFailedError, ExportConfigError, OSError) as e:
                    log.warning("%s: journaled record %s does not verify (%s); captured again", self.out, name, e)
                    continue
                if record.meta.checksum != row.checksum:
                    continue
                raw = json.loads((self.out / name).read_text())
                keep.add(name)
                keep.add(f"{shard.name}/{raw.get('tensors')}")
                recovered.append(row)
                self._done.add(sample_key(row.sample_id, row.source))
            for name in names - keep:
                (self.out / name).unlink()
                deleted += 1
            if not keep:
                with contextlib.suppress(OSError):
                    shard.rmdir()
        for part, row in failed_rows:
            if (r, part) not in self._parts and sample_key(row.sample_id, row.source) not in self._done:
                recovered.append(row)
        if recovered:
            n = max((p for rr, p in self._parts if rr == r), default=-1) + 1
            self._write_part(r, n, recovered)
        journal_path.unlink(missing_ok=True)
        if removed or deleted or recovered:
            log.info(
                "%s rank %d: recovered %d journaled rows, deleted %d unindexed record files and %d staging files",
                self.out,
                r,
                len(recovered),
                deleted,
                removed,
            )

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

    @_locked
    def adopt(self, sample: SampleInfo, manifest: str | os.PathLike[str]) -> IndexRow:
        """Verify the staged record at ``manifest`` (its ``.json``; an ``.error.json`` beside it is read as the
        connector's failure) and move it into this rank's current shard.

        Verified: the checksum of its bytes, ``start == 0`` (the whole sequence), its token ids begin with
        ``sample.input_ids`` and its prompt is exactly them (``num_prompt_tokens == len(input_ids)``; a record
        that does not know its prompt length must have exactly those ids).  A record that fails any of these is
        not adopted: its files are deleted and a "failed" row is written (reason "tokenizer_mismatch",
        "partial_record", "bad_record", "missing_record", "non_finite" (NaN/Inf rows), or the connector's own
        reason) and returned."""
        self._check_writable(sample)
        if sample.input_ids is None:
            raise CaptureStoreError(
                f"sample {sample.key!r}: adopt needs SampleInfo.input_ids (the ids given to the engine) to check the "
                "record's token ids; build it with SampleInfo.of(sample)"
            )
        tensors_path, manifest_path, error_path = _record_files(Path(manifest))
        staged = [tensors_path, manifest_path, error_path]
        if not manifest_path.exists():
            if error_path.exists():
                try:
                    info = json.loads(error_path.read_text())
                    reason, message = str(info.get("reason") or "capture_failed"), str(info.get("message") or "")
                except (OSError, ValueError):
                    reason, message = "capture_failed", f"unreadable error file {error_path.name}"
                return self._fail_files(sample, reason, message, staged)
            return self._fail_files(sample, "missing_record", f"no record at {manifest_path}", staged)
        try:
            record = files.read_record(manifest_path, verify_checksum=True)
            raw = json.loads(manifest_path.read_text())
        except (RecordFormatError, RecordFailedError, ExportConfigError, OSError, ValueError) as e:
            return self._fail_files(sample, "bad_record", f"{type(e).__name__}: {e}", staged)
        meta = record.meta
        tensors_path = manifest_path.with_name(str(raw.get("tensors", tensors_path.name)))
        staged[0] = tensors_path
        if meta.start != 0:
            return self._fail_files(
                sample,
                "partial_record",
                f"the record starts at position {meta.start}, not 0: it does not hold the whole sequence (prefix "
                "caching shared the first positions?); capture with the connector's whole-sequence mode",
                staged,
            )
        recorded_id = str(getattr(meta, "sample_id", "") or "")  # schema 2 records say which sample they are
        if recorded_id and sample.sample_id and recorded_id != sample.sample_id:
            return self._fail_files(
                sample,
                "wrong_sample",
                f"the record at {manifest_path.name} was made for sample {recorded_id!r}, not {sample.sample_id!r}: "
                "the request that made it carried another sample's id",
                staged,
            )
        problem = _token_problem(meta.token_ids, meta.num_prompt_tokens, sample.input_ids)
        if problem is not None:
            return self._fail_files(sample, "tokenizer_mismatch", problem, staged)
        nonfinite = finite.problem(record.hidden_states, start=meta.start, layer_ids=meta.layer_ids)
        if nonfinite is not None:  # a checksum is of whatever was captured: NaN rows verify like any others
            return self._fail_files(sample, REASON_NON_FINITE, f"{nonfinite} (found when adopting the record)", staged)

        shard = self.out / f"shard-{self.rank}-{self._shard_no:05d}"
        shard.mkdir(exist_ok=True)
        stem = files.record_stem(sample.sample_id or sample.key)
        dest_tensors, dest_manifest = shard / f"{stem}.safetensors", shard / f"{stem}.json"
        if dest_tensors.exists() or dest_manifest.exists():
            raise CaptureStoreError(
                f"{dest_manifest} exists already: two samples of this run map to one file name, or another process "
                f"writes rank {self.rank}'s shards; each rank must run once at a time"
            )
        os.replace(tensors_path, dest_tensors)
        _point("adopt.after_tensors")
        raw["tensors"] = dest_tensors.name
        _write_atomic(dest_manifest, json.dumps(raw, indent=1).encode(), tag=f"rank-{self.rank}")
        _point("adopt.after_manifest")
        manifest_path.unlink(missing_ok=True)
        error_path.unlink(missing_ok=True)
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
        _point("adopt.after_journal")
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
            message=_trim(str(message)),
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
        if _UNSAFE:
            return
        if self._journal_fd is None:
            self._journal_fd = os.open(self._journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        line = json.dumps({"part": self._part_no, "row": row.to_dict()}) + "\n"
        os.write(self._journal_fd, line.encode())

    def _write_part(self, r: int, n: int, rows: list[IndexRow]) -> None:
        """Index part ``n`` of rank ``r``: the record files it names reach the disk first (one syncfs of the
        tree's file system; fsync of each file where there is no syncfs), then the part is written to a temporary
        name, fsynced and renamed into place."""
        pa = _pa()
        records = [self.out / row.record for row in rows if row.record is not None]
        if records and not _UNSAFE and not _syncfs(self.out):
            for manifest in records:
                _fsync_path(manifest)
                _fsync_path(manifest.with_suffix(".safetensors"))
            for d in {m.parent for m in records}:
                _fsync_path(d, directory=True)
        table = pa.Table.from_pylist([row.to_dict() for row in rows], schema=_schema())
        sink = pa.BufferOutputStream()
        pa.parquet.write_table(table, sink)
        data = sink.getvalue().to_pybytes()
        final = self._index_dir / f"rank-{r}-part-{n:05d}.parquet"
        target = final if _UNSAFE else self._index_dir / f".rank-{r}-part-{n:05d}.parquet.{os.getpid()}.tmp"
        with open(target, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            f.flush()
            _point("index.mid_write")
            f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())
        _point("index.before_rename")
        if target != final:
            os.replace(target, final)
        _fsync_path(self._index_dir, directory=True)
        self._parts.add((r, n))
        self._indexed_records.update(row.record for row in rows if row.record is not None)
        self._indexed_shards.update(row.record.split("/", 1)[0] for row in rows if row.record is not None)

    def _flush(self) -> None:
        """Write the pending rows as the next part, drop the journal, start a new shard."""
        if self._pending:
            self._write_part(self.rank, self._part_no, self._pending)
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

    def _rank_summary(self) -> Summary:
        s = self._summary
        s.failed = dict(sorted(Counter(self._failed.values()).items()))
        s.elapsed_s = time.monotonic() - self._started
        s.tokens_per_s = s.tokens / s.capture_s if s.capture_s > 0 else 0.0
        s.closed = self._closed
        return s

    @_locked
    def note_times(self, *, engine_start_s: float, capture_s: float) -> None:
        """The run's engine start and its capture (from a ready engine to the last record adopted): the summary's
        ``tokens_per_s`` is of the capture alone."""
        self._summary.engine_start_s = engine_start_s
        self._summary.capture_s = capture_s

    @_locked
    def run_summary(self) -> Summary:
        """This rank's counters of this run (what ``summary-rank-R.json`` holds), without the tree's totals."""
        return Summary.from_dict(self._rank_summary().to_dict())

    def _write_rank_summary(self) -> None:
        data = json.dumps(self._rank_summary().to_dict(), indent=1).encode()
        _write_atomic(self.out / f"summary-rank-{self.rank}.json", data, tag=f"rank-{self.rank}")

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
            _write_atomic(
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


def _record_files(path: Path) -> tuple[Path, Path, Path]:
    name = path.name
    for suffix in (".error.json", ".safetensors", ".json"):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            break
    else:
        stem = name
    return path.with_name(f"{stem}.safetensors"), path.with_name(f"{stem}.json"), path.with_name(f"{stem}.error.json")


def _token_problem(got: tuple[int, ...], num_prompt: int, expected: tuple[int, ...]) -> str | None:
    """Why a record's token ids are not the sample's, or None when they are."""
    n = len(expected)
    head = got[:n]
    if head != expected:
        at = next((i for i, (a, b) in enumerate(zip(head, expected, strict=False)) if a != b), min(len(head), n))
        return (
            f"the engine ran {len(got)} token ids that differ from the sample's {n} at position {at} (engine "
            f"{list(got[at : at + 4])}, sample {list(expected[at : at + 4])}); the tokenizer or chat template used to "
            "tokenize the data is not the served model's: pass the model's own tokenizer/template"
        )
    if num_prompt and num_prompt != n:
        return (
            f"the engine's prompt had {num_prompt} tokens, the sample has {n}: the record is of another prompt that "
            "begins like this one"
        )
    if not num_prompt and len(got) != n:
        return (
            f"the record has {len(got)} token ids and does not say its prompt length; the sample has {n}: cannot "
            "tell which are the sample's"
        )
    return None
