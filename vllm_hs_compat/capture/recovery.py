"""A rank's leftovers brought back to a tree where every record file is named by an index part.

A run killed anywhere leaves at most: staging files, temporary files, record files no part names, and a journal of
the rows it adopted since its last part.  At start, each rank recovers its own (and those of ranks
``>= world_size`` whose lock is free): staging and temporary files are deleted, journaled records that verify again
(checksum) are indexed, and every other record file no part names is deleted, so the sample is captured again.
Either way the tree ends with exactly one verified record per sample.

Pure Python + torch (the records' checksums, through export/files.py) + pyarrow (the parts it writes).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

from vllm_hs_compat.errors import ExportConfigError, RecordFailedError, RecordFormatError
from vllm_hs_compat.export import files

from .durable import RankLock
from .index import TreeIndex
from .rows import IndexRow, sample_key
from .tree import JOURNAL_RE, SHARD_RE, STAGING_RE

log = logging.getLogger("vllm_hs_compat.capture")


def leftover_ranks(out: Path, rank: int, world_size: int) -> list[int]:
    """``rank``, and every rank ``>= world_size`` that left a journal, staging files or shards behind (ranks below
    the world size recover their own when they start)."""
    found = {rank}
    for p in (out / "index").iterdir():
        if m := JOURNAL_RE.match(p.name):
            found.add(int(m.group(1)))
    staging = out / ".staging"
    if staging.is_dir():
        found.update(int(m.group(1)) for p in staging.iterdir() if (m := STAGING_RE.match(p.name)))
    for p in out.iterdir():
        if m := SHARD_RE.match(p.name):
            found.add(int(m.group(1)))
    return sorted(r for r in found if r == rank or r >= world_size)


def recover_leftovers(
    index: TreeIndex, *, rank: int, world_size: int, done: set[str], owns_key: Callable[[str], bool]
) -> None:
    """Recover this rank's leftovers, and those of every rank past the world size whose lock is free (see
    :func:`recover`)."""
    for r in leftover_ranks(index.out, rank, world_size):
        if r == rank:
            recover(index, r, own_rank=rank, done=done, owns_key=owns_key)
            continue
        lock = RankLock(index.dir / f"rank-{r}.lock")
        if lock.acquire() and lock.works:
            try:
                recover(index, r, own_rank=rank, done=done, owns_key=owns_key)
            finally:
                lock.release()


def recover(index: TreeIndex, r: int, *, own_rank: int, done: set[str], owns_key: Callable[[str], bool]) -> None:
    """Bring rank ``r``'s leftovers to a state where every record file is named by an index part: journaled
    records that verify again are indexed (their sample keys added to ``done``), everything else that no part
    names is deleted.  ``owns_key``: whether this rank (``own_rank``) owns a sample key."""
    out = index.out
    staging = out / ".staging" / f"rank-{r}"
    removed = 0
    if staging.is_dir():
        for p in staging.iterdir():
            if p.is_file() or p.is_symlink():
                p.unlink()
                removed += 1
    for p in index.dir.iterdir():
        if p.name.startswith(f".rank-{r}-part-") and p.name.endswith(".tmp"):
            p.unlink()
    for p in [*out.glob(f".*.rank-{r}.tmp"), *out.glob(f".run.json.rank-{r}.*.tmp")]:
        p.unlink(missing_ok=True)
    if r != own_rank:
        with contextlib.suppress(OSError):
            staging.rmdir()
        (out / f"summary-rank-{r}.json").unlink(missing_ok=True)  # that rank is not in this job
    journal_path = index.dir / f"rank-{r}.journal"
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
    for shard in sorted(out.iterdir()):
        m = SHARD_RE.match(shard.name)
        if not m or int(m.group(1)) != r or not shard.is_dir():
            continue
        if shard.name in index.shards:
            continue  # sealed: a part names its records, and no record is added to a shard after that
        names = {f"{shard.name}/{p.name}" for p in shard.iterdir()}
        keep: set[str] = set()
        for name in sorted(names):
            if not name.endswith(".json") or name not in journal:
                continue
            part, row = journal[name]
            if (r, part) in index.parts:
                continue
            if (
                row.status != "ok"
                or sample_key(row.sample_id, row.source) in done
                or not owns_key(sample_key(row.sample_id, row.source))
            ):
                continue
            try:
                record = files.read_record(out / name, verify_checksum=True)
            except (RecordFormatError, RecordFailedError, ExportConfigError, OSError) as e:
                log.warning("%s: journaled record %s does not verify (%s); captured again", out, name, e)
                continue
            if record.meta.checksum != row.checksum:
                continue
            raw = json.loads((out / name).read_text())
            keep.add(name)
            keep.add(f"{shard.name}/{raw.get('tensors')}")
            recovered.append(row)
            done.add(sample_key(row.sample_id, row.source))
        for name in names - keep:
            (out / name).unlink()
            deleted += 1
        if not keep:
            with contextlib.suppress(OSError):
                shard.rmdir()
    for part, row in failed_rows:
        if (r, part) not in index.parts and sample_key(row.sample_id, row.source) not in done:
            recovered.append(row)
    if recovered:
        index.write(r, index.next_part(r), recovered)
    journal_path.unlink(missing_ok=True)
    if removed or deleted or recovered:
        log.info(
            "%s rank %d: recovered %d journaled rows, deleted %d unindexed record files and %d staging files",
            out,
            r,
            len(recovered),
            deleted,
            removed,
        )
